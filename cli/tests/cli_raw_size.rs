//! `picchio synth --out raw:` on a device too small for the image: refused before anything is
//! written, even with `--force`, naming the bytes needed and the device's size. Root only (loop
//! devices; prints `SKIPPED <name>: ...` otherwise).
#![cfg(target_os = "linux")]

use picchio_testkit::loopdev;

use std::process::Command;

use loopdev::{sparse_file, LoopDevice, LoopOptions};

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn synth_refuses_a_device_smaller_than_the_image_even_with_force() {
    let test = "synth_refuses_a_device_smaller_than_the_image_even_with_force";
    let tmp = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let file = sparse_file(&tmp.path().join("small.img"), 1 << 20);
    let lo = LoopDevice::attach_for_test(test, &file, LoopOptions::default());
    let before = std::fs::read(&file).unwrap();
    // 8 entries of 262,144 bytes: 8192 + 8 × 262144 = 2,105,344 bytes for a 1 MiB device.
    let out = Command::new(env!("CARGO_BIN_EXE_picchio"))
        .args(["synth", "--arch", "custom", "--hidden", "64", "--moe-intermediate", "64", "--experts", "8"])
        .args(["--model-layers", "1", "--expert-bytes", "262144", "--no-progress", "--force", "--out"])
        .arg(format!("raw:{}", lo.dev.display()))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("2105344") && err.contains("1048576"), "needed and available bytes named: {err}");
    assert!(out.stdout.is_empty());
    drop(lo);
    assert!(std::fs::read(&file).unwrap() == before, "the device was not written");
}
