//! What `picchio synth` / `pack` write, and what they refuse to write: SIGINT/SIGTERM during a long
//! write (exit 128 + signal, no temporary file left), geometries over the format's limits, `--out`
//! values with a scheme (parsed like `--store`, never taken for a file name), and the store errors
//! a fresh user meets (`verify` of a cut-off or corrupted image).
#![cfg(unix)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{names, strs, synth_custom};

fn picchio(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_picchio"))
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .expect("run picchio")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Starts a 2 GB synth (768 Qwen3 experts) in a fresh directory, waits until its temporary file
/// holds data (the write is under way), sends `signal`, and returns the exit code, stderr and the
/// directory's names afterwards.
fn synth_and_signal(signal: i32) -> (Option<i32>, String, Vec<String>) {
    let dir = tempfile::tempdir().unwrap();
    let args = ["synth", "--arch", "qwen3-30b-a3b", "--layers", "6", "--out", "s.pf", "--no-progress"];
    let out_file = dir.path().join("s.pf");
    let writing = |pid: u32| std::fs::metadata(common::stop::tmp_of(&out_file, pid)).is_ok_and(|m| m.len() > 0);
    let out = common::signal_once_writing(dir.path(), &args, writing, signal);
    assert!(out.stdout.is_empty(), "no report after an interrupt: {}", String::from_utf8_lossy(&out.stdout));
    (out.status.code(), stderr(&out), names(dir.path()))
}

#[test]
fn sigint_during_synth_exits_130_and_leaves_no_temporary_file() {
    let (code, err, left) = synth_and_signal(libc::SIGINT);
    assert_eq!(code, Some(130), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(last.starts_with("Error: interrupted by SIGINT after ") && last.ends_with(" of 768 payloads"), "{last}");
    assert!(left.is_empty(), "nothing left behind, found {left:?}");
}

#[test]
fn sigterm_during_synth_exits_143_and_leaves_no_temporary_file() {
    let (code, err, left) = synth_and_signal(libc::SIGTERM);
    assert_eq!(code, Some(143), "{err}");
    assert!(err.contains("interrupted by SIGTERM"), "{err}");
    assert!(left.is_empty(), "nothing left behind, found {left:?}");
}

#[test]
fn a_geometry_over_the_format_limits_is_refused_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let mut huge = synth_custom(65536, 65536, 100_000, 1000);
    huge.extend(["--out".into(), "cx.pf".into()]);
    let o = picchio(dir.path(), &strs(&huge));
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("cx.pf: entry 0 (layer 0, expert 0): the payload is 7247757312 bytes"), "{e}");
    assert!(e.contains("limit of 4294963200 bytes") && e.contains("padded_len"), "{e}");
    assert!(names(dir.path()).is_empty());
    // --expert-bytes one over the limit, within a u32: refused the same way.
    let mut over = synth_custom(64, 64, 2, 1);
    over.extend(["--expert-bytes", "4294963201", "--out", "cx.pf"].map(String::from));
    let o = picchio(dir.path(), &strs(&over));
    assert!(stderr(&o).contains("the payload is 4294963201 bytes"), "{}", stderr(&o));
    assert!(names(dir.path()).is_empty());
}

#[test]
fn out_schemes_are_written_or_refused_never_taken_for_file_names() {
    let dir = tempfile::tempdir().unwrap();
    let synth = |out: &str| {
        let mut args = synth_custom(64, 64, 2, 1);
        args.extend(["--no-progress", "--out", out].map(String::from));
        picchio(dir.path(), &strs(&args))
    };
    // nvme: goes to the driver path (no such controller here), not to a file `nvme:0000:99:00.0`.
    let o = synth("nvme:0000:99:00.0");
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("nvme:0000:99:00.0/1: no PCI device 0000:99:00.0"), "{}", stderr(&o));
    // nvme-sim: is a read target of bench.
    let o = synth("nvme-sim:x.pf");
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("nvme-sim: is a read target of `picchio bench`") && e.contains("file:x.pf"), "{e}");
    // An unknown scheme is named, with how to write a path containing ':'.
    let o = synth("zz:x.pf");
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("unknown scheme \"zz:\"") && e.contains("file:PATH or ./PATH"), "{e}");
    let o = picchio(dir.path(), &["pack", "model", "--out", "nvme-sim:x.pf"]);
    assert!(stderr(&o).contains("nvme-sim: is a read target"), "{}", stderr(&o));
    assert!(names(dir.path()).is_empty(), "no file named after a URI: {:?}", names(dir.path()));
    // Spelled as a path, a name with ':' is a file.
    for out in ["./a:b.pf", "file:c:d.pf"] {
        let o = synth(out);
        assert!(o.status.success(), "{out}: {}", stderr(&o));
    }
    assert_eq!(names(dir.path()), ["a:b.pf", "c:d.pf"]);
}

#[test]
fn run_help_lists_every_store_scheme() {
    let o = picchio(Path::new("."), &["run", "--help"]);
    let help = String::from_utf8_lossy(&o.stdout);
    for scheme in ["auto", "safetensors", "file:PATH", "raw:/dev/X[@BYTES]", "nvme:BDF[/NSID]"] {
        assert!(help.contains(scheme), "{scheme} missing from:\n{help}");
    }
}

/// A small valid image in `dir` (2 entries of 4096 bytes: 16384 bytes).
fn small_image(dir: &Path) -> PathBuf {
    let mut args = synth_custom(64, 64, 2, 1);
    args.extend(["--expert-bytes", "4096", "--no-progress", "--out", "img.pf"].map(String::from));
    let o = picchio(dir, &strs(&args));
    assert!(o.status.success(), "{}", stderr(&o));
    dir.join("img.pf")
}

#[test]
fn verify_names_the_first_wrong_field_and_a_cut_off_image() {
    let dir = tempfile::tempdir().unwrap();
    let img = small_image(dir.path());
    let mut bytes = std::fs::read(&img).unwrap();
    assert_eq!(bytes.len(), 16384);
    // index_offset (superblock byte 40) corrupted to 2^63: index_offset is named, not data_offset.
    bytes[40..48].copy_from_slice(&0x8000_0000_0000_0000u64.to_le_bytes());
    let bad = dir.path().join("bad.pf");
    std::fs::write(&bad, &bytes).unwrap();
    let o = picchio(dir.path(), &["verify", "bad.pf"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("bad.pf: superblock field `index_offset` at offset 0x28"), "{e}");
    assert!(e.contains("found 9223372036854775808") && !e.contains("data_offset"), "{e}");
    // The valid image cut to 5000 bytes: the file, the region's offsets and expected vs found length.
    let cut = dir.path().join("cut.pf");
    std::fs::write(&cut, &std::fs::read(&img).unwrap()[..5000]).unwrap();
    let o = picchio(dir.path(), &["verify", "cut.pf"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("cut.pf: truncated: the image is shorter than its superblock says"), "{e}");
    assert!(e.contains("0x1000..0x2000") && e.contains("expected at least 8192 bytes, found 5000 bytes"), "{e}");
}
