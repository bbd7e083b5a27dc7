//! Tier S4 end to end on real block devices: each tier model (Picchio (C)'s Qwen3-MoE fixture,
//! GPT-OSS) packed onto loop devices with 512- and 4096-byte logical blocks, at byte 0 and at an LBA
//! offset, gives its tokens through `Session` with the psync engine (O_DIRECT); `pack --out raw:` refuses devices that carry
//! data or are mounted, and `--force` overrides the signature case; a device shorter than the image
//! and kernel read errors fall back per expert without changing a token.
//!
//! Root only (losetup, mkfs, mount): those tests are `#[ignore]`d; CI runs them as root with
//! `cargo test --workspace -- --ignored`.
#![cfg(target_os = "linux")]

use picchio_testkit::loopdev;

use std::path::{Path, PathBuf};

use loopdev::{mkfs_ext4, sparse_file, write_gpt_signature, DmDevice, LoopDevice, LoopOptions, Mounted};
use picchio_core::StoreUri;
use picchio_runtime::expert::open::{EngineOptions, IoEngine};
use picchio_runtime::image::pack::{PackOptions, PackReport};
use picchio_runtime::image::verify::{verify_raw, FailureKind, VerifyOptions};
use picchio_runtime::image::write::{WriteOptions, WriteTo};
use picchio_tests::*;

const MIB: u64 = 1 << 20;
const N: usize = 16;
/// The Picchio (C) fixture's image: 98 blocks of 4 KiB.
const IMAGE_LEN: u64 = 401_408;

fn model() -> PathBuf {
    fixture("picchio_c/qwen3_moe")
}

fn c_prompt() -> Vec<u32> {
    ids(&reference_json(&fixture("qwen3_moe"), "reference.json"), "prompt_ids")
}

fn psync_direct() -> EngineOptions {
    EngineOptions { engine: IoEngine::Psync, direct: true, threads: 2, ..EngineOptions::default() }
}

fn raw(dev: &Path, offset: u64) -> StoreUri {
    StoreUri::Raw { device: dev.into(), offset }
}

fn ropts(force: bool) -> WriteOptions {
    WriteOptions { force, io_threads: 2, ..WriteOptions::default() }
}

/// `pack --out raw:` of the model directory `dir`, returning the plan it announced as well.
fn pack_dir(dir: &Path, dev: &Path, offset: u64, force: bool) -> (picchio_runtime::Result<PackReport>, String) {
    let mut plan = String::new();
    let popts = PackOptions { progress: false, ..Default::default() };
    let to = WriteTo::Uri(&raw(dev, offset));
    let r = picchio_runtime::image::pack::pack_to(dir, to, &popts, &ropts(force), &mut |i| plan = i.to_string());
    (r, plan)
}

/// `pack --out raw:` of Picchio (C)'s fixture (see [`pack_dir`]).
fn pack_to(dev: &Path, offset: u64, force: bool) -> (picchio_runtime::Result<PackReport>, String) {
    pack_dir(&model(), dev, offset, force)
}

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn raw_devices_with_512_and_4096_byte_lbas_give_each_models_tokens() {
    let test = "raw_devices_with_512_and_4096_byte_lbas_give_each_models_tokens";
    let tmp = scratch();
    let mut runs = 0;
    for m in TierModel::all() {
        let image_len = std::fs::metadata(m.image()).unwrap().len();
        let n = m.tokens.len();
        for (lbs, offset) in [(512u32, 0u64), (4096, 0), (512, 1_048_576), (4096, 1_048_576)] {
            let what = format!("{} raw({lbs})@{offset}", m.name);
            let file = sparse_file(&tmp.path().join(format!("{}-d{lbs}-{offset}.img", m.name)), 4 * MIB);
            let opts = LoopOptions { sector_size: lbs, ..Default::default() };
            let lo = LoopDevice::attach_for_test(test, &file, opts);
            let (report, plan) = pack_dir(&m.dir, &lo.dev, offset, false);
            let report = report.unwrap_or_else(|e| panic!("{what}: {e}"));
            eprintln!("{plan}\n{report}");
            assert!(plan.contains(&format!("writes {image_len} bytes")) && plan.contains("found: nothing"), "{plan}");
            let verify = report.verify().expect("a raw write is read back");
            assert_eq!(report.bytes, image_len, "{what}");
            assert_eq!(report.raw_inspection().unwrap().target().start().0, offset / u64::from(lbs));
            assert!(verify.is_clean() && verify.entries == m.entries, "{what}: {verify}");
            let uri = raw(&lo.dev, offset);
            for ecap in [1, m.entries] {
                let (g, s) = greedy(&m.dir, uri.clone(), psync_direct(), Some(ecap), &m.prompt, n).unwrap();
                assert_eq!(g.tokens, m.tokens, "{what} ecap {ecap}");
                assert_eq!((g.stats.fallbacks, g.stats.store_errors), (0, 0), "{:?}", g.stats);
                assert_eq!(g.stats.reads, g.stats.cache_misses);
                assert_eq!(s.info.store, uri.to_string());
                assert!(s.info.engine.starts_with("psync(direct"), "{}", s.info.engine);
                runs += 1;
            }
            // verify raw: reads the same image, compared with the model.
            let vopts = VerifyOptions { progress: false, ..Default::default() };
            let v = verify_raw(&lo.dev, offset, Some(&m.dir), &vopts).unwrap();
            assert!(v.is_clean() && v.compared_with_model && v.entries == m.entries, "{what}: {v}");
            assert_eq!(v.store, uri.to_string());
        }
    }
    eprintln!("{runs} raw-device runs gave each model's tokens");
}

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn pack_refuses_devices_with_data_and_force_overrides_the_signature() {
    loopdev::require_root_and_tools("pack_refuses_devices_with_data_and_force_overrides_the_signature", &["mkfs.ext4"]);
    let tmp = scratch();

    // An ext4 signature, not mounted: refused and nothing written; --force writes and it runs.
    let file = sparse_file(&tmp.path().join("ext4.img"), 16 * MIB);
    let lo = LoopDevice::attach(&file, LoopOptions::default()).unwrap();
    mkfs_ext4(&lo.dev).unwrap();
    let before = std::fs::read(&file).unwrap();
    let (r, plan) = pack_to(&lo.dev, 0, false);
    let e = picchio_core::error::chain(&r.unwrap_err()).to_string();
    assert!(e.contains("refusing to write") && e.contains("ext2/3/4 file system (magic 0xEF53 at byte 1080)"), "{e}");
    assert!(plan.contains(&lo.dev.display().to_string()) && plan.contains("[refused without --force]"), "{plan}");
    assert!(std::fs::read(&file).unwrap() == before, "a refused pack wrote to the device");
    let (r, plan) = pack_to(&lo.dev, 0, true);
    r.unwrap();
    assert!(plan.contains("ext2/3/4 file system"), "{plan}");
    let (g, _) = greedy(&model(), raw(&lo.dev, 0), psync_direct(), Some(4), &c_prompt(), N).unwrap();
    assert_eq!(g.tokens, PICCHIO_C_TOKENS);
    assert_eq!(g.stats.fallbacks, 0);
    drop(lo);

    // A GPT disk.
    let file = sparse_file(&tmp.path().join("gpt.img"), 8 * MIB);
    write_gpt_signature(&file, 512);
    let lo = LoopDevice::attach(&file, LoopOptions::default()).unwrap();
    let e = picchio_core::error::chain(&pack_to(&lo.dev, 0, false).0.unwrap_err()).to_string();
    assert!(e.contains("GPT partition table") && e.contains("MBR partition table"), "{e}");
    drop(lo);

    // Mounted: refused; --force passes our check but not the kernel's exclusive claim.
    let file = sparse_file(&tmp.path().join("mounted.img"), 16 * MIB);
    let lo = LoopDevice::attach(&file, LoopOptions::default()).unwrap();
    mkfs_ext4(&lo.dev).unwrap();
    let mnt = Mounted::mount(&lo.dev, &tmp.path().join("mnt")).unwrap();
    std::fs::write(mnt.dir.join("keep.txt"), b"kept").unwrap();
    let e = picchio_core::error::chain(&pack_to(&lo.dev, 0, false).0.unwrap_err()).to_string();
    assert!(e.contains(&format!("is mounted at {}", mnt.dir.display())), "{e}");
    let e = picchio_core::error::chain(&pack_to(&lo.dev, 0, true).0.unwrap_err()).to_string();
    assert!(e.contains("exclusive") && e.contains("Device or resource busy"), "{e}");
    assert_eq!(std::fs::read(mnt.dir.join("keep.txt")).unwrap(), b"kept");
    drop(mnt);
}

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn offsets_sizes_and_non_devices_are_checked_before_anything_is_written() {
    let test = "offsets_sizes_and_non_devices_are_checked_before_anything_is_written";
    let tmp = scratch();
    // A regular file given as raw: is neither written nor read as a device.
    let plain = sparse_file(&tmp.path().join("plain.img"), 4 * MIB);
    let e = picchio_core::error::chain(&pack_to(&plain, 0, true).0.unwrap_err()).to_string();
    assert!(e.contains("not a block device") && e.contains("file:PATH"), "{e}");
    assert!(std::fs::read(&plain).unwrap().iter().all(|&b| b == 0), "the file was written");
    let e = greedy(&model(), raw(&plain, 0), psync_direct(), Some(4), &c_prompt(), 1).err().unwrap().to_string();
    assert!(e.contains("not a block device"), "{e}");

    let file = sparse_file(&tmp.path().join("d4k.img"), 4 * MIB);
    let opts = LoopOptions { sector_size: 4096, ..Default::default() };
    let lo = LoopDevice::attach_for_test(test, &file, opts);
    // 512 is not a whole LBA of a 4096-byte-block device: for pack, run and verify.
    let want = "not a multiple of the device's logical block size (4096 bytes)";
    let e = picchio_core::error::chain(&pack_to(&lo.dev, 512, false).0.unwrap_err()).to_string();
    assert!(e.contains(want), "{e}");
    let e = greedy(&model(), raw(&lo.dev, 512), psync_direct(), Some(4), &c_prompt(), 1).err().unwrap().to_string();
    assert!(e.contains(want), "{e}");
    let e =
        picchio_core::error::chain(&verify_raw(&lo.dev, 512, None, &VerifyOptions::default()).unwrap_err()).to_string();
    assert!(e.contains(want), "{e}");
    // The image does not fit 4 MiB - 3.75 MiB.
    let e = picchio_core::error::chain(&pack_to(&lo.dev, 3840 * 1024, false).0.unwrap_err()).to_string();
    assert!(e.contains(&format!("needs {IMAGE_LEN} bytes")) && e.contains("has 262144 bytes"), "{e}");
    assert!(std::fs::read(&file).unwrap().iter().all(|&b| b == 0), "a refused pack wrote to the device");
}

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn a_device_shorter_than_the_image_serves_what_it_holds_and_falls_back_for_the_rest() {
    let test = "a_device_shorter_than_the_image_serves_what_it_holds_and_falls_back_for_the_rest";
    let tmp = scratch();
    let img = std::fs::read(model().join("experts.picchioflat")).unwrap();
    let file = tmp.path().join("short.img");
    std::fs::write(&file, &img[..img.len() / 2 / 4096 * 4096]).unwrap();
    let opts = LoopOptions { read_only: true, ..Default::default() };
    let lo = LoopDevice::attach_for_test(test, &file, opts);
    for ecap in [1, 48] {
        let (g, _) = greedy(&model(), raw(&lo.dev, 0), psync_direct(), Some(ecap), &c_prompt(), N).unwrap();
        assert_eq!(g.tokens, PICCHIO_C_TOKENS, "ecap {ecap}");
        assert!(g.stats.reads > 0 && g.stats.fallbacks > 0, "{:?}", g.stats);
        assert_eq!(g.stats.reads + g.stats.fallbacks, g.stats.cache_misses);
    }
    let v = verify_raw(&lo.dev, 0, None, &VerifyOptions { progress: false, ..Default::default() }).unwrap();
    assert!(!v.is_clean() && v.failures.iter().all(|f| matches!(f.kind, FailureKind::BadEntry(_))), "{v}");
}

/// A real kernel read error without device-mapper: the loop device keeps its size when its backing
/// file is cut short after attaching, and the kernel fails reads past the cut with EIO.
#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn kernel_read_errors_fall_back_per_expert_and_keep_the_tokens() {
    let test = "kernel_read_errors_fall_back_per_expert_and_keep_the_tokens";
    let tmp = scratch();
    let lo = LoopDevice::sparse_for_test(test, &tmp.path().join("eio.img"), 4 * MIB, LoopOptions::default());
    pack_to(&lo.dev, 0, false).0.unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&lo.backing).unwrap();
    f.set_len(IMAGE_LEN / 2 / 4096 * 4096).unwrap();
    drop(f);
    for ecap in [1, 48] {
        let (g, _) = greedy(&model(), raw(&lo.dev, 0), psync_direct(), Some(ecap), &c_prompt(), N).unwrap();
        assert_eq!(g.tokens, PICCHIO_C_TOKENS, "ecap {ecap}");
        assert!(g.stats.store_errors > 0 && g.stats.fallbacks == g.stats.store_errors, "{:?}", g.stats);
    }
    let v = verify_raw(&lo.dev, 0, None, &VerifyOptions { progress: false, ..Default::default() }).unwrap();
    let reads =
        v.failures.iter().filter(|f| matches!(&f.kind, FailureKind::Read(r) if r.contains("os error 5"))).count();
    assert!(reads > 0 && reads == v.failures.len(), "{v}");
}

/// The same with device-mapper's `error` target over the second half of the image. Runs where
/// `dmsetup` can talk to the kernel (ignored; fails naming why elsewhere).
#[test]
#[ignore = "needs root and device-mapper in the kernel (dmsetup); CI skips it: run by hand"]
fn device_mapper_error_target_falls_back_and_keeps_the_tokens() {
    DmDevice::require("device_mapper_error_target_falls_back_and_keeps_the_tokens");
    let tmp = scratch();
    let file = sparse_file(&tmp.path().join("dm.img"), 4 * MIB);
    let lo = LoopDevice::attach(&file, LoopOptions::default()).unwrap();
    pack_to(&lo.dev, 0, false).0.unwrap();
    let good = IMAGE_LEN / 2 / 4096 * 8; // sectors
    let dm = DmDevice::linear_then_error(tmp.path(), "tiers", &lo.dev, good, 8192).unwrap();
    let dev = dm.dev.clone();
    let (g, _) = greedy(&model(), raw(&dev, 0), psync_direct(), Some(4), &c_prompt(), N).unwrap();
    assert_eq!(g.tokens, PICCHIO_C_TOKENS);
    assert!(g.stats.store_errors > 0 && g.stats.fallbacks == g.stats.store_errors, "{:?}", g.stats);
}
