//! `kill -9` of every writer at seeded points of its write, through the real binary: `pack`, `synth`
//! (an image file), `convert`, `transcode` and `synth --model-out` (model directories).
//!
//! A kill point is a byte count, not a sleep: the writer runs with `PICCHIO_STOP_AFTER_BYTES=N`
//! (`picchio_core::stop_point`) and stops itself (`SIGSTOP`) once it has written `N` bytes of its
//! output; the test waits for the stop (`waitpid(WUNTRACED)`) and sends `SIGKILL`. `N` is drawn by
//! SplitMix64 from the seed over the size of the complete output, so a seed names one point of the
//! write on every machine. After each kill:
//! - the previous output (image file or directory) is byte-identical to what it was;
//! - the killed writer's temporary output is there (nothing can remove it at a kill);
//! - the next writer of the same target removes it and names it and its size on stderr.
//!
//! The last writer runs to the end: its output replaces the old one and nothing else is left in
//! the directory. [`SEEDS`] seeds per writer (each one is a writer started and killed part way).
#![cfg(target_os = "linux")]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::stop::{assert_leftover_removed, kill_writer_at, tmp_of};
use common::{ok, private_model, scratch, strs, synth_custom, synth_one_layer};
use picchio_core::rng::SplitMix64;

/// Kill points per writer.
const SEEDS: u64 = 10;

/// Every file under `p` (a file, or a directory tree) by relative path, with its bytes.
fn contents(p: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    fn walk(root: &Path, p: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
        if p.is_dir() {
            for e in std::fs::read_dir(p).unwrap() {
                walk(root, &e.unwrap().path(), out);
            }
        } else {
            out.insert(p.strip_prefix(root).unwrap().into(), std::fs::read(p).unwrap());
        }
    }
    walk(p, p, &mut out);
    out
}

fn size(p: &Path) -> u64 {
    contents(p).values().map(|b| b.len() as u64).sum()
}

/// One writer under test: `args` writes `out`; a killed one (pid) leaves `leftover(pid)`.
struct Writer<'a> {
    name: &'a str,
    args: Vec<String>,
    out: PathBuf,
    leftover: Box<dyn Fn(u32) -> PathBuf + 'a>,
}

/// The seeded kill schedule of one writer, run against its existing complete output.
fn kill_at_seeded_points(w: &Writer<'_>, logs: &Path) {
    let old = contents(&w.out);
    let total = size(&w.out);
    assert!(total > 0, "{}: no previous output at {}", w.name, w.out.display());
    let mut previous: Option<(PathBuf, u64)> = None;
    for seed in 0..SEEDS {
        // SplitMix64 over the seed and the writer's name: a point in [0, total).
        let salt = w.name.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
        let at = SplitMix64::new(seed ^ salt).below(total);
        let log = logs.join(format!("{}-{seed}.log", w.name));
        let killed = kill_writer_at(&w.args, at, &log)
            .unwrap_or_else(|e| panic!("{} seed {seed}: never wrote {at} of {total} bytes: {e}", w.name));
        eprintln!("{} seed {seed}: killed -9 after {at} of {total} bytes", w.name);
        assert!(contents(&w.out) == old, "{} seed {seed}: the killed write changed {}", w.name, w.out.display());
        let tmp = (w.leftover)(killed.pid);
        assert!(tmp.exists(), "{} seed {seed}: no temporary output {} after the kill", w.name, tmp.display());
        if let Some((prev, bytes)) = &previous {
            assert_leftover_removed(&killed.stderr, prev, *bytes);
        }
        previous = Some((tmp.clone(), size(&tmp)));
    }
    // The next complete run removes the last leftover, says so, and replaces the output.
    let o = common::picchio(&strs(&w.args));
    assert!(o.status.success(), "{}: the final run failed", w.name);
    let (prev, bytes) = previous.unwrap();
    assert_leftover_removed(&String::from_utf8_lossy(&o.stderr), &prev, bytes);
    // Deterministic writers: the new output equals the old one byte for byte.
    assert!(contents(&w.out) == old, "{}: the complete run wrote other bytes", w.name);
    let dir = w.out.parent().unwrap();
    let name = w.out.file_name().unwrap().to_string_lossy().into_owned();
    let stray: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(&name) && *n != name)
        .collect();
    assert!(stray.is_empty(), "{}: left beside {}: {stray:?}", w.name, w.out.display());
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// The leftover of a killed writer of the image file `out` ([`tmp_of`]).
fn tmp_file(out: &Path) -> impl Fn(u32) -> PathBuf + '_ {
    move |pid| tmp_of(out, pid)
}

fn tmp_dir<'a>(out: &'a Path, tag: &'a str) -> impl Fn(u32) -> PathBuf + 'a {
    move |pid| out.with_file_name(format!(".{}.picchio-{tag}-{pid}", out.file_name().unwrap().to_string_lossy()))
}

#[test]
fn kill_9_of_pack_at_seeded_points_keeps_the_old_image_and_the_next_pack_removes_the_leftover() {
    let dir = scratch();
    let m = private_model(dir.path());
    let out = m.join("experts.picchioflat");
    let w = Writer {
        name: "pack",
        args: vec!["pack".into(), s(&m), "--no-progress".into()],
        out: out.clone(),
        leftover: Box::new(tmp_file(&out)),
    };
    // The previous image is this pack's own (the fixture's copy has no model record: the bytes of a
    // complete pack of this directory differ from it there).
    let o = common::picchio(&strs(&w.args));
    assert!(o.status.success(), "the first pack failed: {}", String::from_utf8_lossy(&o.stderr));
    kill_at_seeded_points(&w, dir.path());
}

#[test]
fn kill_9_of_synth_at_seeded_points_keeps_the_old_image_and_the_next_synth_removes_the_leftover() {
    let dir = scratch();
    let out = dir.path().join("synth.picchioflat");
    let mut args = synth_custom(256, 256, 8, 4);
    args.extend(["--seed", "7", "--no-progress", "--out", &s(&out)].map(String::from));
    ok(&strs(&args));
    let w = Writer { name: "synth", args, out: out.clone(), leftover: Box::new(tmp_file(&out)) };
    kill_at_seeded_points(&w, dir.path());
}

#[test]
fn kill_9_of_synth_model_out_at_seeded_points_keeps_the_old_directory_and_the_next_synth_removes_the_leftover() {
    let dir = scratch();
    let out = dir.path().join("synthetic");
    // One layer of Qwen3-30B-A3B's geometry, a vocabulary of 1024: about 120 MB.
    let mut args = synth_one_layer(1024);
    args.extend(["--seed", "7", "--no-progress", "--model-out"].map(String::from));
    args.push(s(&out));
    ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    // Every byte of the directory is counted: a stop point at its last byte is reached.
    let total = size(&out);
    let log = dir.path().join("synth-model-out-last.log");
    let pid = kill_writer_at(&args, total - 1, &log).unwrap_or_else(|e| panic!("the last of {total} bytes: {e}")).pid;
    assert!(tmp_dir(&out, "synthetic")(pid).exists(), "no temporary output after the kill at the last byte");
    let w = Writer { name: "synth-model-out", args, out: out.clone(), leftover: Box::new(tmp_dir(&out, "synthetic")) };
    kill_at_seeded_points(&w, dir.path());
}

fn hf_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe")
}

#[test]
fn kill_9_of_convert_at_seeded_points_keeps_the_old_directory_and_the_next_convert_removes_the_leftover() {
    let dir = scratch();
    let out = dir.path().join("converted");
    ok(&["convert", &s(&hf_fixture()), &s(&out), "--no-progress"]);
    let w = Writer {
        name: "convert",
        args: vec!["convert".into(), s(&hf_fixture()), s(&out), "--force".into(), "--no-progress".into()],
        out: out.clone(),
        leftover: Box::new(tmp_dir(&out, "convert")),
    };
    kill_at_seeded_points(&w, dir.path());
}

#[test]
fn kill_9_of_transcode_at_seeded_points_keeps_the_old_directory_and_the_next_transcode_removes_the_leftover() {
    let dir = scratch();
    let src = dir.path().join("q4");
    ok(&["convert", &s(&hf_fixture()), &s(&src), "--no-progress"]);
    let out = dir.path().join("q3");
    let args: Vec<String> =
        ["transcode", &s(&src), "--to", "q3", "--out", &s(&out), "--force", "--no-progress"].map(String::from).into();
    ok(&strs(&args));
    let w = Writer { name: "transcode", args, out: out.clone(), leftover: Box::new(tmp_dir(&out, "transcode")) };
    kill_at_seeded_points(&w, dir.path());
}
