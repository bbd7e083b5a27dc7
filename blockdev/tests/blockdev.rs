//! `PsyncQueue` on real block devices: loop devices from `losetup` over files in the target temp dir
//! (needs root: the tests are `#[ignore]`d; CI runs them as root with `-- --ignored`). Exercises `BLKGETSIZE64` and the block
//! device's direct-I/O alignment (`statx` on Linux 6.11+, else `BLKSSZGET`).
#![cfg(target_os = "linux")]

mod common;

use std::path::Path;

use common::{buf_for, check_every_expert, open_store, random_file, read_one, scratch, write_image, Rng};
use picchio_blockdev::{Error, PsyncOptions, PsyncQueue};
use picchio_core::loader::StoreDims;
use picchio_core::{ByteOffset, IoQueue, ReadReq, Tag};
use picchio_testkit::loopdev::{LoopDevice, LoopOptions};

/// A read-only loop device with `sector_size`-byte logical blocks over `file` (the loop driver
/// reading it buffered), from the test kit: detached on drop.
fn attach(test: &str, file: &Path, sector_size: u32) -> LoopDevice {
    let opts = LoopOptions { sector_size, direct_io: false, read_only: true, partscan: false };
    LoopDevice::attach_for_test(test, file, opts)
}

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn block_device_size_alignment_and_reads() {
    let dir = scratch();
    let (file, bytes) = random_file(dir.path(), "disk.img", 4 << 20, 77);
    let lo = attach("block_device_size_alignment_and_reads", &file, 4096);

    let mut q = PsyncQueue::open(&lo.dev, PsyncOptions::direct(2)).unwrap();
    eprintln!("{}: {q:?}", lo.dev.display());
    assert!(q.is_block_device());
    assert_eq!(q.len(), 4 << 20, "BLKGETSIZE64");
    assert_eq!(q.alignment().offset, 4096, "4 KiB logical blocks");
    assert_eq!(q.block_size(), 4096);

    let mut rng = Rng::new(5);
    for i in 0..64u64 {
        let offset = rng.below(1024) * 4096;
        let len = ((rng.below(16) + 1) * 4096) as u32;
        q.submit(ReadReq { offset: ByteOffset(offset), len, buf: buf_for(&q, len), tag: Tag(i) });
        let mut out = Vec::new();
        q.reap(1, &mut out);
        let c = out.pop().unwrap();
        let want = (len as usize).min(bytes.len() - offset as usize);
        assert_eq!(c.result.unwrap() as usize, want);
        assert!(c.buf.as_slice()[..want] == bytes[offset as usize..offset as usize + want]);
    }
    // 512 is aligned for a file on this disk, not for a device with 4 KiB sectors.
    let c = read_one(&mut q, 512, 4096);
    let e = c.result.unwrap_err();
    assert!(matches!(e.get_ref().and_then(|e| e.downcast_ref()), Some(Error::Misaligned { align: 4096, .. })), "{e}");
    let c = read_one(&mut q, 4 << 20, 4096);
    assert!(c.result.unwrap_err().to_string().contains("starts past the end"));
    drop(q);

    let mut q = PsyncQueue::open(&lo.dev, PsyncOptions::buffered(1)).unwrap();
    assert_eq!((q.len(), q.block_size(), q.describe().as_str()), (4 << 20, 512, "psync(buffered, 1 thread)"));
    let c = read_one(&mut q, 1000, 3000);
    assert_eq!(c.result.unwrap(), 3000);
    assert_eq!(&c.buf.as_slice()[..3000], &bytes[1000..4000]);
}

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn flat_store_on_a_loop_device() {
    let dir = scratch();
    let path = dir.path().join("experts.picchioflat");
    let dims = StoreDims { hidden: 64, n_layers: 2, n_experts: 3, topk: 1, moe_inter: 128 };
    let payloads = write_image(&path, dims, 9, |i| 3000 + i * 2500);
    let lo = attach("flat_store_on_a_loop_device", &path, 512);

    for opts in [PsyncOptions::direct(2), PsyncOptions::buffered(2)] {
        let mut store = open_store(&lo.dev, opts, true, None).unwrap();
        check_every_expert(&mut store, dims, &payloads, 16384);
    }
}
