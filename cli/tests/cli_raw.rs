//! `picchio pack --out raw:` and `picchio verify raw:` as a user runs them: exit status, the plan and
//! the refusal on stderr, the reports on stdout, on loop devices. Root only for the device cases
//! (`#[ignore]`d; CI runs them as root with `-- --ignored`).
#![cfg(target_os = "linux")]

use picchio_testkit::loopdev;

use std::path::{Path, PathBuf};
use std::process::Output;

use loopdev::{mkfs_ext4, sparse_file, LoopDevice, LoopOptions};

fn model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/picchio_c/qwen3_moe")
}

fn scratch() -> tempfile::TempDir {
    picchio_testkit::scratch!()
}

fn picchio(args: &[&str]) -> Output {
    picchio_testkit::bin::Bin::new("picchio", env!("CARGO_BIN_EXE_picchio")).run(args)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn pack_refuses_a_device_with_a_file_system_names_it_and_force_writes_it() {
    let test = "pack_refuses_a_device_with_a_file_system_names_it_and_force_writes_it";
    loopdev::require_tool(test, "mkfs.ext4", &["-V"]);
    let tmp = scratch();
    let file = sparse_file(&tmp.path().join("ext4.img"), 16 << 20);
    let lo = LoopDevice::attach_for_test(test, &file, LoopOptions::default());
    mkfs_ext4(&lo.dev).unwrap();
    let m = model();
    let (m, dev) = (m.to_str().unwrap(), lo.dev.to_str().unwrap());
    let out_arg = format!("raw:{dev}");
    let before = std::fs::read(&file).unwrap();

    let o = picchio(&["pack", m, "--out", &out_arg, "--no-progress"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("Error: ") && e.contains("refusing to write"), "{e}");
    assert!(e.contains("ext2/3/4 file system (magic 0xEF53 at byte 1080)"), "{e}");
    assert!(e.contains(&format!("{out_arg}: {dev} (")) && e.contains("writes 401408 bytes"), "the plan: {e}");
    assert!(std::fs::read(&file).unwrap() == before, "a refused pack wrote to the device");

    let o = picchio(&["pack", m, "--out", &out_arg, "--force", "--no-progress"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    assert!(s.contains(&format!("packed {m} -> {out_arg}")) && s.contains("48 payload hashes OK"), "the report: {s}");

    let o = picchio(&["verify", &out_arg, "--model", m, "--no-progress"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    assert!(
        s.contains(&format!("{out_arg} via psync(direct")) && s.contains("compared with") && s.contains("\nOK"),
        "{s}"
    );

    // Again: now the device holds our own image, which is said but not refused.
    let o = picchio(&["pack", m, "--out", &out_arg, "--no-progress"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains(".picchioflat image (\"PCHIOFL1\" at byte 0"), "{}", stderr(&o));
}

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn pack_and_verify_at_an_lba_offset_and_misaligned_offsets_fail() {
    let test = "pack_and_verify_at_an_lba_offset_and_misaligned_offsets_fail";
    let tmp = scratch();
    let file = sparse_file(&tmp.path().join("d4k.img"), 4 << 20);
    let opts = LoopOptions { sector_size: 4096, ..Default::default() };
    let lo = LoopDevice::attach_for_test(test, &file, opts);
    let m = model();
    let (m, dev) = (m.to_str().unwrap(), lo.dev.to_str().unwrap());
    let at = format!("raw:{dev}@1048576");
    let o = picchio(&["pack", m, "--out", &at, "--no-progress"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("at LBA 256 × 4096 B (byte 1048576)"), "{}", stdout(&o));
    let o = picchio(&["verify", &at, "--no-progress"]);
    assert!(o.status.success() && stdout(&o).contains("\nOK"), "{}", stderr(&o));
    // Nothing at byte 0: not an image.
    let o = picchio(&["verify", &format!("raw:{dev}"), "--no-progress"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("bad magic"), "{}", stderr(&o));
    for cmd in [&["pack", m, "--out"][..], &["verify"][..]] {
        let mut args = cmd.to_vec();
        let bad = format!("raw:{dev}@512");
        args.extend([bad.as_str(), "--no-progress"]);
        let o = picchio(&args);
        assert_eq!(o.status.code(), Some(1));
        let e = stderr(&o);
        assert!(
            e.contains("not a multiple of the device's logical block size (4096 bytes)") && e.contains("@0 or @4096"),
            "{e}"
        );
    }
}

#[test]
fn raw_on_a_regular_file_and_misused_force_are_errors() {
    let tmp = scratch();
    let plain = sparse_file(&tmp.path().join("plain.img"), 4 << 20);
    let m = model();
    let m = m.to_str().unwrap();
    let raw_plain = format!("raw:{}", plain.display());
    let o = picchio(&["pack", m, "--out", &raw_plain, "--force", "--no-progress"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("is a regular file, not a block device"), "{}", stderr(&o));
    assert!(std::fs::read(&plain).unwrap().iter().all(|&b| b == 0), "the file was written");
    let o = picchio(&["verify", &raw_plain, "--no-progress"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("not a block device"), "{}", stderr(&o));
    let img = tmp.path().join("x.picchioflat");
    // On a file, --force only overrides readers of the image (none here): the pack is written.
    let o = picchio(&["pack", m, "--out", img.to_str().unwrap(), "--force", "--no-progress"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(img.exists());
    // A file image still packs and verifies as before.
    let o = picchio(&["pack", m, "--out", img.to_str().unwrap(), "--no-progress"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = picchio(&["verify", &format!("file:{}", img.display()), "--model", m, "--no-progress"]);
    assert!(o.status.success() && stdout(&o).contains("\nOK"), "{}", stderr(&o));
}
