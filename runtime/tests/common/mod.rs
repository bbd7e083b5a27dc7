//! Helpers shared by the `picchio` CLI tests: the vendored Picchio (C) fixture, a scratch directory
//! on the target's file system, and running the real binary with its output echoed to the test log.
#![allow(dead_code)] // each test binary uses a subset

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Picchio (C)'s fixture model directory (config, safetensors, `experts.picchioflat`).
pub fn model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/picchio_c/qwen3_moe")
}

/// The fixture's packed image as a `file:` store URI.
pub fn image() -> String {
    format!("file:{}", model().join("experts.picchioflat").display())
}

/// A fresh directory under the target's temporary directory (removed when dropped).
pub fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// Runs `picchio ARGS`, echoing the command, its status and its output to the test log.
pub fn picchio(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_picchio")).args(args).output().expect("run picchio");
    eprintln!(
        "$ picchio {}\n[{}]\n{}{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs `picchio ARGS`, asserts it succeeded, and returns its stdout.
pub fn ok(args: &[&str]) -> String {
    let o = picchio(args);
    assert!(o.status.success(), "picchio {} failed", args.join(" "));
    String::from_utf8_lossy(&o.stdout).into_owned()
}
