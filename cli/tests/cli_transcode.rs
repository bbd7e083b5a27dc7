//! `picchio transcode`: the default output directory, the report (the expert image is not copied),
//! the refusals with their exit status and hint, and SIGINT during a long transcode (exit 130, no
//! temporary directory and no destination left).
#![cfg(unix)]

mod common;

use std::path::{Path, PathBuf};

use common::{model, names, ok, picchio, scratch};

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A private copy of Picchio (C)'s fixture, so the default destination (beside it) is ours.
fn copy_of_model(dir: &Path) -> PathBuf {
    common::private_model(dir)
}

#[test]
fn transcode_writes_model_q3_beside_the_source_and_says_to_pack_again() {
    let tmp = scratch();
    let src = copy_of_model(tmp.path());
    let out = ok(&["transcode", &src.to_string_lossy(), "--to", "q3", "--no-progress"]);
    let dst = tmp.path().join("qwen3_moe-q3");
    assert!(out.contains(&format!("transcoded {} -> {}", src.display(), dst.display())), "{out}");
    assert!(out.contains("experts: 48 from q4 (6912 bytes each) to q3 (5376 bytes each)"), "{out}");
    assert!(out.contains("not copied: experts.picchioflat") && out.contains("picchio pack"), "{out}");
    assert_eq!(names(tmp.path()), ["qwen3_moe", "qwen3_moe-q3"]);
    assert!(!dst.join("experts.picchioflat").exists());
    // Packed again, it runs; the image verifies against the new directory.
    ok(&["pack", &dst.to_string_lossy(), "--no-progress"]);
    ok(&["verify", &dst.join("experts.picchioflat").to_string_lossy(), "--model", &dst.to_string_lossy()]);
    let run = ok(&["run", "--model", &dst.to_string_lossy(), "--prompt-ids", "1,2,3", "-n", "4", "--json"]);
    assert!(run.contains("\"tokens\""), "{run}");

    // Again: the destination exists (refused, with the --force hint), then replaced with --force.
    let o = picchio(&["transcode", &src.to_string_lossy(), "--to", "q3", "--no-progress"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("qwen3_moe-q3: destination already exists") && e.contains("or pass --force to replace it"),
        "{e}"
    );
    let o = picchio(&["transcode", &src.to_string_lossy(), "--to", "q3", "--no-progress", "--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn transcode_refuses_a_no_op_and_q3_to_q4_naming_the_directory() {
    let tmp = scratch();
    let out = tmp.path().join("o");
    let (m, o) = (model().to_string_lossy().into_owned(), out.to_string_lossy().into_owned());
    let r = picchio(&["transcode", &m, "--to", "q4", "--out", &o]);
    assert_eq!(r.status.code(), Some(1));
    let e = stderr(&r);
    assert!(e.contains(&format!("Error: {m}: its routed experts are q4: refusing to transcode them to q4")), "{e}");
    ok(&["transcode", &m, "--to", "q3", "--out", &o, "--no-progress"]);
    let r = picchio(&["transcode", &o, "--to", "q4", "--out", &tmp.path().join("p").to_string_lossy()]);
    assert_eq!(r.status.code(), Some(1));
    assert!(stderr(&r).contains("refusing to transcode them to q4: Q3 dropped information"), "{}", stderr(&r));
    let r = picchio(&["transcode", &m, "--to", "q5"]);
    assert_eq!(r.status.code(), Some(2), "a bad --to is a usage error");
    assert_eq!(names(tmp.path()), ["o"]);
}

#[test]
fn sigint_during_transcode_exits_130_and_leaves_no_temporary_directory() {
    use picchio_runtime::image::synthetic_model::{
        write_synthetic, SyntheticArch, SyntheticSpec, WriteSyntheticOptions,
    };
    let tmp = scratch();
    // 128 experts of Qwen3-30B-A3B's size (340 MB of Q4): seconds of transcoding, where the fixture
    // takes milliseconds. A small vocabulary (no tokenizer) keeps the dense part small.
    let spec = SyntheticSpec {
        layers: 2,
        experts: 64,
        vocab: 4096,
        ..SyntheticSpec::with_expert_gb(SyntheticArch::Qwen3_30bA3b, 0.1, 7)
    };
    let src = tmp.path().join("big");
    write_synthetic(&src, &spec, &WriteSyntheticOptions::default()).unwrap();
    let before = names(tmp.path());
    // Under way when a file in its temporary directory holds data.
    let writing = |pid: u32| {
        let temp = tmp.path().join(format!(".big-q3.picchio-transcode-{pid}"));
        std::fs::read_dir(temp).is_ok_and(|r| r.filter_map(|e| e.ok()).any(|e| e.metadata().is_ok_and(|m| m.len() > 0)))
    };
    let args = ["transcode", "big", "--to", "q3", "--no-progress"];
    let out = common::signal_once_writing(tmp.path(), &args, writing, libc::SIGINT);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(out.stdout.is_empty(), "no report after an interrupt");
    let last = err.lines().last().unwrap_or_default();
    assert!(last.starts_with("Error: interrupted by SIGINT after ") && last.ends_with(" tensors"), "{last}");
    assert_eq!(names(tmp.path()), before, "no temporary directory and no destination left");
}
