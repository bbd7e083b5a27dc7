//! Tier S4 on real kernel objects: loop devices (512- and 4096-byte logical blocks) measured,
//! inspected, refused, written with `DeviceSink` and read back at an LBA offset; kernel I/O errors
//! from a loop device whose backing file was cut short; device-mapper's `error` target where it
//! exists. Root only: those tests are `#[ignore]`d (CI runs them as root with `-- --ignored`), and a
//! missing tool then fails them with its name.
#![cfg(target_os = "linux")]

mod common;
use picchio_testkit::loopdev;

use std::path::{Path, PathBuf};

use common::{scratch, Rng};
use loopdev::{
    mkfs_ext4, run, sparse_file, write_gpt_signature, write_mbr_partition, DmDevice, LoopDevice, LoopOptions, Mounted,
};
use picchio_blockdev::host::{Host, Use};
use picchio_blockdev::raw::{DeviceSink, Finding, Inspection, Lba, RawDevice, RawTarget, SignatureKind, Verdict};
use picchio_blockdev::{Error, PsyncOptions, PsyncQueue};
use picchio_core::loader::StoreDims;
use picchio_core::{AlignedBuf, ByteOffset, ExpertLoader, FlatStore, FlatStoreOptions, FlatWriter, LoadError};

const MIB: u64 = 1 << 20;
const DIMS: StoreDims = StoreDims { hidden: 64, n_layers: 2, n_experts: 3, topk: 1, moe_inter: 128 };

/// A backing file of `len` bytes filled with 0xA5 (no signature looks like that), so bytes the
/// writer must not touch can be checked afterwards.
fn patterned(dir: &Path, name: &str, len: u64) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, vec![0xA5u8; len as usize]).unwrap();
    p
}

fn payloads() -> Vec<Vec<u8>> {
    let mut rng = Rng::new(41);
    (0..6).map(|i| rng.bytes(3000 + i * 2500)).collect()
}

fn kinds(i: &Inspection) -> Vec<SignatureKind> {
    i.findings()
        .iter()
        .filter_map(|f| match f {
            Finding::Signature { signature, .. } => Some(signature.kind),
            _ => None,
        })
        .collect()
}

/// Writes the six test payloads as an image through a `DeviceSink` on `target`; returns its length.
fn write_image(target: &RawTarget, force: bool) -> Result<u64, Error> {
    let image_len = picchio_core::format::data_offset(6)
        + payloads().iter().map(|p| p.len().div_ceil(4096) as u64 * 4096).sum::<u64>();
    let permit = target.inspect(image_len)?.permit(force)?;
    let sink = DeviceSink::open(&permit)?;
    let mut w = FlatWriter::with_sink(sink, DIMS, 6)?;
    for p in payloads() {
        w.push(&p)?;
    }
    w.finish()?;
    Ok(image_len)
}

/// Opens the image at `target` with the psync engine (direct) and checks every payload.
fn read_back(target: &RawTarget) {
    let q = PsyncQueue::open(target.device().path(), PsyncOptions::direct(2)).unwrap();
    let opts = FlatStoreOptions {
        base_offset: target.base().0,
        image_len: target.capacity(),
        verify: true,
        expect: None,
        recheck_every: 0,
    };
    let mut store = FlatStore::open(q, target.uri(), opts).unwrap();
    let want = payloads();
    for layer in 0..2u32 {
        let reqs = (0..3).map(|e| (e, AlignedBuf::new(16384, 4096).unwrap())).collect();
        store.load(layer, reqs, &mut |l| {
            l.result.unwrap_or_else(|e| panic!("{}: {e}", target.uri()));
            let p = &want[(l.key.layer * 3 + l.key.expert) as usize];
            assert!(l.buf.as_slice()[..p.len()] == p[..], "{} {}", target.uri(), l.key);
        });
    }
}

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn devices_with_512_and_4096_byte_lbas_are_measured_and_addressed_by_lba() {
    let test = "devices_with_512_and_4096_byte_lbas_are_measured_and_addressed_by_lba";
    let dir = scratch();
    for lbs in [512u32, 4096] {
        let file = sparse_file(&dir.path().join(format!("m{lbs}.img")), 8 * MIB);
        let opts = LoopOptions { sector_size: lbs, ..Default::default() };
        let lo = LoopDevice::attach_for_test(test, &file, opts);
        let dev = RawDevice::open(&lo.dev).unwrap();
        eprintln!("{dev}");
        assert_eq!((dev.size(), dev.logical_block(), dev.lbas()), (8 * MIB, lbs, 8 * MIB / u64::from(lbs)));
        assert!(dev.physical_block() >= lbs && !dev.read_only());
        assert_eq!(dev.name(), lo.name());
        assert!(dev.description().unwrap_or_default().contains(&file.display().to_string()), "{dev}");
        assert_eq!(dev.byte_offset(Lba(3)), ByteOffset(3 * u64::from(lbs)));
        let t = dev.clone().target(ByteOffset(MIB)).unwrap();
        assert_eq!((t.start(), t.capacity()), (Lba(MIB / u64::from(lbs)), 7 * MIB));
        // 512 is a whole LBA only of the 512-byte device.
        assert_eq!(dev.clone().target(ByteOffset(512)).map(|t| t.start()).ok(), (lbs == 512).then_some(Lba(1)));
        let e = dev.clone().target(ByteOffset(u64::from(lbs) / 2)).unwrap_err();
        assert!(matches!(e, Error::RawOffset { logical_block, .. } if logical_block == lbs), "{e}");
        assert!(e.to_string().contains(&format!("logical block size ({lbs} bytes)")), "{e}");
        let e = dev.target(ByteOffset(8 * MIB)).unwrap_err();
        assert!(matches!(e, Error::RawOffsetPastEnd { size, .. } if size == 8 * MIB), "{e}");
    }
}

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn an_image_written_at_an_lba_reads_back_and_nothing_outside_it_changes() {
    let test = "an_image_written_at_an_lba_reads_back_and_nothing_outside_it_changes";
    let dir = scratch();
    for (lbs, offset) in [(512u32, 0u64), (512, 7 * 512), (4096, 0), (4096, MIB)] {
        let file = patterned(dir.path(), &format!("w{lbs}-{offset}.img"), 4 * MIB);
        let opts = LoopOptions { sector_size: lbs, ..Default::default() };
        let lo = LoopDevice::attach_for_test(test, &file, opts);
        let target = RawTarget::open(&lo.dev, ByteOffset(offset)).unwrap();
        assert_eq!(target.start(), Lba(offset / u64::from(lbs)));
        let insp = target.inspect(65536).unwrap();
        assert!(insp.findings().is_empty(), "{insp}");
        let len = write_image(&target, false).unwrap();
        read_back(&target);
        // The superblock is at image offset 0: the target's base on the device.
        let mut q = PsyncQueue::open(&lo.dev, PsyncOptions::direct(1)).unwrap();
        let sb = picchio_core::io::read_blocking(&mut q, target.base().0, 4096).unwrap();
        assert_eq!(&sb.as_slice()[..8], b"PCHIOFL1");
        drop(q);
        drop(lo);
        let bytes = std::fs::read(&file).unwrap();
        let (a, b) = (offset as usize, (offset + len) as usize);
        assert!(bytes[..a].iter().all(|&x| x == 0xA5), "{lbs}@{offset}: bytes before the image changed");
        assert!(bytes[b..].iter().all(|&x| x == 0xA5), "{lbs}@{offset}: bytes after the image changed");
        // Writing again over our own image is allowed, and said.
        let lo = LoopDevice::attach(&file, opts).unwrap();
        let target = RawTarget::open(&lo.dev, ByteOffset(offset)).unwrap();
        let insp = target.inspect(len).unwrap();
        assert_eq!(kinds(&insp), [SignatureKind::Picchioflat], "{insp}");
        assert_eq!(insp.findings()[0].verdict(), Verdict::Note);
        assert!(insp.to_string().contains("an earlier image, overwritten"), "{insp}");
        write_image(&target, false).unwrap();
        read_back(&target);
    }
}

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn signatures_partitions_and_mounts_are_refused_and_force_overrides_only_ours() {
    let test = "signatures_partitions_and_mounts_are_refused_and_force_overrides_only_ours";
    loopdev::require_root_and_tools(test, &["mkfs.ext4"]);
    let dir = scratch();
    let opts = LoopOptions::default();

    // ext4, not mounted: refused; --force writes, and the image reads back.
    let file = sparse_file(&dir.path().join("ext4.img"), 16 * MIB);
    let lo = LoopDevice::attach_for_test(test, &file, opts);
    mkfs_ext4(&lo.dev).unwrap();
    let target = RawTarget::open(&lo.dev, ByteOffset(0)).unwrap();
    let insp = target.inspect(MIB).unwrap();
    assert_eq!(kinds(&insp), [SignatureKind::Ext], "{insp}");
    let e = insp.permit(false).unwrap_err();
    assert!(matches!(e, Error::Refused { .. }) && e.to_string().contains("ext2/3/4 file system"), "{e}");
    write_image(&target, true).unwrap();
    read_back(&target);
    drop(lo);

    // GPT written by hand (protective MBR + "EFI PART"), at LBA 1 of a 512 and of a 4096 device.
    for lbs in [512u32, 4096] {
        let file = sparse_file(&dir.path().join(format!("gpt{lbs}.img")), 8 * MIB);
        write_gpt_signature(&file, u64::from(lbs));
        let lo = LoopDevice::attach(&file, LoopOptions { sector_size: lbs, ..opts }).unwrap();
        let insp = RawTarget::open(&lo.dev, ByteOffset(0)).unwrap().inspect(MIB).unwrap();
        assert_eq!(kinds(&insp), [SignatureKind::Mbr, SignatureKind::Gpt], "{insp}");
        let e = insp.permit(false).unwrap_err().to_string();
        assert!(e.contains("GPT partition table") && e.contains("protective MBR"), "{e}");
    }

    // Mounted: refused; with --force our check yields, but the kernel's exclusive claim does not,
    // and the file system is intact afterwards.
    let file = sparse_file(&dir.path().join("mounted.img"), 16 * MIB);
    let lo = LoopDevice::attach(&file, opts).unwrap();
    mkfs_ext4(&lo.dev).unwrap();
    let mnt = Mounted::mount(&lo.dev, &dir.path().join("mnt")).unwrap();
    std::fs::write(mnt.dir.join("keep.txt"), b"still here").unwrap();
    let target = RawTarget::open(&lo.dev, ByteOffset(0)).unwrap();
    let insp = target.inspect(MIB).unwrap();
    assert!(
        insp.findings()
            .iter()
            .any(|f| matches!(f, Finding::InUse(Use::Mounted { mount_point, .. }) if *mount_point == mnt.dir)),
        "{insp}"
    );
    let e = insp.clone().permit(false).unwrap_err().to_string();
    assert!(e.contains("is mounted at") && e.contains(&mnt.dir.display().to_string()), "{e}");
    let permit = insp.permit(true).unwrap();
    let e = DeviceSink::open(&permit).unwrap_err();
    assert!(matches!(&e, Error::WriteOpen { cause, .. } if cause.raw_os_error() == Some(libc::EBUSY)), "{e}");
    assert!(e.to_string().contains("`force` cannot override this"), "{e}");
    assert_eq!(std::fs::read(mnt.dir.join("keep.txt")).unwrap(), b"still here");
    drop(mnt);
    drop(lo);

    // A mounted partition refuses its whole disk.
    let file = sparse_file(&dir.path().join("parts.img"), 16 * MIB);
    write_mbr_partition(&file, 2048, 8 * 2048);
    let lo = LoopDevice::attach(&file, LoopOptions { partscan: true, ..opts }).unwrap();
    let p1 = lo.partition(1, 2048, 8 * 2048).unwrap();
    mkfs_ext4(&p1).unwrap();
    let mnt = Mounted::mount(&p1, &dir.path().join("mnt-p1")).unwrap();
    let insp = RawTarget::open(&lo.dev, ByteOffset(0)).unwrap().inspect(MIB).unwrap();
    let p1_name = p1.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        insp.findings().iter().any(|f| matches!(f, Finding::InUse(Use::Mounted { device, .. }) if *device == p1_name)),
        "{insp}"
    );
    assert!(kinds(&insp).contains(&SignatureKind::Mbr), "{insp}");
    let e = insp.permit(false).unwrap_err().to_string();
    assert!(e.contains(&format!("{p1_name} is mounted at")) && e.contains("MBR partition table"), "{e}");
    drop(mnt);
}

/// The device backing `/` is refused even with force. Only inspected (read): nothing here ever
/// opens it for writing.
#[test]
#[ignore = "needs root and read access to the disk behind / (a VM or bare machine); CI skips it: run by hand"]
fn the_root_device_is_refused_even_with_force() {
    let test = "the_root_device_is_refused_even_with_force";
    loopdev::require_root(test);
    let root = std::fs::read_to_string("/proc/self/mountinfo").unwrap().lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        let sep = f.iter().position(|&x| x == "-")?;
        (f[4] == "/").then(|| f[sep + 2].to_string())
    });
    let Some(dev) = root.clone().filter(|s| s.starts_with("/dev/") && Path::new(s).exists()) else {
        panic!(
            "{test}: / is not on a block device node here ({root:?}); run it on a machine (or VM) whose / is a disk"
        );
    };
    let target = RawTarget::open(Path::new(&dev), ByteOffset(0)).unwrap_or_else(|e| panic!("{test}: {dev}: {e}"));
    let insp = target.inspect_with(4096, &Host::current().unwrap()).unwrap();
    eprintln!("{insp}");
    assert!(insp.findings().iter().any(|f| f.verdict() == Verdict::RefuseAlways), "{insp}");
    let e = insp.permit(true).unwrap_err().to_string();
    assert!(e.contains("backs the root file system") && e.contains("not even with `force`"), "{e}");
}

#[test]
fn a_regular_file_is_never_a_raw_device() {
    let dir = scratch();
    let f = sparse_file(&dir.path().join("plain.img"), MIB);
    let e = RawTarget::open(&f, ByteOffset(0)).unwrap_err();
    assert!(matches!(e, Error::NotBlockDevice { kind: "regular file", .. }), "{e}");
    assert_eq!(std::fs::metadata(&f).unwrap().len(), MIB);
}

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn an_image_larger_than_the_device_is_refused_naming_both_sizes() {
    let test = "an_image_larger_than_the_device_is_refused_naming_both_sizes";
    let dir = scratch();
    let file = sparse_file(&dir.path().join("small.img"), MIB);
    let lo = LoopDevice::attach_for_test(test, &file, LoopOptions::default());
    let target = RawTarget::open(&lo.dev, ByteOffset(512 * 1024)).unwrap();
    let e = target.inspect(600 * 1024).unwrap().permit(true).unwrap_err();
    let s = e.to_string();
    assert!(
        matches!(e, Error::ImageTooLarge { .. }) && s.contains("614400 bytes") && s.contains("524288 bytes"),
        "{s}"
    );
}

/// A loop device whose backing file is cut short after attaching still reports its old size; reads
/// past the cut fail in the kernel with EIO (the loop driver ends a read that finds no data with
/// `BLK_STS_IOERR`). The store rejects nothing at open, and each expert past the cut fails with a
/// read error that names the device, offset and OS error, without hanging or panicking.
#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn kernel_read_errors_from_a_cut_backing_file_fail_only_those_experts() {
    let test = "kernel_read_errors_from_a_cut_backing_file_fail_only_those_experts";
    let dir = scratch();
    let file = patterned(dir.path(), "cut.img", 4 * MIB);
    let lo = LoopDevice::attach_for_test(test, &file, LoopOptions::default());
    let target = RawTarget::open(&lo.dev, ByteOffset(0)).unwrap();
    write_image(&target, false).unwrap();
    // Payloads: 8192 (3000 B), 12288 (5500 B), 20480 (8000 B), 28672 ... cut inside the third.
    let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    f.set_len(20480).unwrap();
    drop(f);
    let q = PsyncQueue::open(&lo.dev, PsyncOptions::direct(2)).unwrap();
    assert_eq!(q.len(), 4 * MIB, "the loop device keeps its size");
    let opts = FlatStoreOptions { base_offset: 0, image_len: 4 * MIB, verify: true, expect: None, recheck_every: 0 };
    let mut store = FlatStore::open(q, target.uri(), opts).unwrap();
    let mut outcome = Vec::new();
    for layer in 0..2u32 {
        let reqs = (0..3).map(|e| (e, AlignedBuf::new(16384, 4096).unwrap())).collect();
        store.load(layer, reqs, &mut |l| outcome.push((l.key.layer * 3 + l.key.expert, l.result)));
    }
    outcome.sort_by_key(|o| o.0);
    assert!(outcome[0].1.is_ok() && outcome[1].1.is_ok(), "{outcome:?}");
    for (i, r) in &outcome[2..] {
        let e = r.as_ref().unwrap_err();
        let LoadError::Io { cause, .. } = e else { panic!("expert {i}: {e}") };
        let typed = cause.get_ref().and_then(|c| c.downcast_ref::<Error>());
        assert!(
            matches!(typed, Some(Error::Read { cause, .. }) if cause.raw_os_error() == Some(libc::EIO)),
            "expert {i}: {e}"
        );
        assert!(e.to_string().contains(&lo.dev.display().to_string()), "{e}");
    }
}

/// device-mapper's `error` target (every read fails with EIO) in the middle of a linear mapping.
/// Runs where `dmsetup` can talk to the kernel (ignored; fails naming why elsewhere).
#[test]
#[ignore = "needs root and device-mapper in the kernel (dmsetup); CI skips it: run by hand"]
fn device_mapper_error_target_fails_only_the_mapped_experts() {
    DmDevice::require("device_mapper_error_target_fails_only_the_mapped_experts");
    let dir = scratch();
    let file = patterned(dir.path(), "dm.img", 4 * MIB);
    let lo = LoopDevice::attach(&file, LoopOptions::default()).unwrap();
    let target = RawTarget::open(&lo.dev, ByteOffset(0)).unwrap();
    write_image(&target, false).unwrap();
    // Sectors 0..40 (bytes 0..20480) linear, 40..8192 error: experts 2.. fail.
    let dm = DmDevice::linear_then_error(dir.path(), "test", &lo.dev, 40, 8192).unwrap();
    let dm_path = dm.dev.clone();
    let q = PsyncQueue::open(&dm_path, PsyncOptions::direct(2)).unwrap();
    let opts = FlatStoreOptions { base_offset: 0, image_len: 4 * MIB, verify: true, expect: None, recheck_every: 0 };
    let mut store = FlatStore::open(q, format!("raw:{}", dm_path.display()), opts).unwrap();
    let mut failed = Vec::new();
    for layer in 0..2u32 {
        let reqs = (0..3).map(|e| (e, AlignedBuf::new(16384, 4096).unwrap())).collect();
        store.load(layer, reqs, &mut |l| {
            if l.result.is_err() {
                failed.push(l.key.layer * 3 + l.key.expert);
            }
        });
    }
    failed.sort();
    assert_eq!(failed, [2, 3, 4, 5]);
}

/// `blkid -p` as a second opinion, on real loop devices: it names an ext4 file system our scan also
/// finds (one finding, ours), and a minix file system our scan does not know (a `Finding::Blkid`,
/// refused unless forced). Needs root, `blkid`, `mkfs.ext4` and `mkfs.minix` (all util-linux or
/// e2fsprogs, which `.ci/run` installs).
#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn blkid_names_what_it_finds_and_what_our_scan_misses_is_refused() {
    use picchio_blockdev::raw::BlkidProbe;
    let test = "blkid_names_what_it_finds_and_what_our_scan_misses_is_refused";
    loopdev::require_root_and_tools(test, &["blkid", "mkfs.ext4", "mkfs.minix"]);
    let dir = scratch();
    let file = sparse_file(&dir.path().join("ext4.img"), 16 * MIB);
    let lo = LoopDevice::attach_for_test(test, &file, LoopOptions::default());
    mkfs_ext4(&lo.dev).unwrap();
    let probe = BlkidProbe::run(&lo.dev, 0).expect("blkid is installed");
    assert_eq!((probe.get("TYPE"), probe.get("USAGE")), (Some("ext4"), Some("filesystem")), "{probe:?}");
    let insp = RawTarget::open(&lo.dev, ByteOffset(0)).unwrap().inspect(MIB).unwrap();
    assert_eq!(kinds(&insp), [SignatureKind::Ext], "{insp}");
    assert!(!insp.findings().iter().any(|f| matches!(f, Finding::Blkid { .. })), "ours already says ext4: {insp}");
    drop(lo);

    let file = sparse_file(&dir.path().join("minix.img"), 16 * MIB);
    let lo = LoopDevice::attach(&file, LoopOptions::default()).unwrap();
    run("mkfs.minix", &[lo.dev.to_str().unwrap()]).unwrap();
    let insp = RawTarget::open(&lo.dev, ByteOffset(0)).unwrap().inspect(MIB).unwrap();
    assert!(kinds(&insp).is_empty(), "our scan does not know minix: {insp}");
    let found: Vec<&Finding> = insp.findings().iter().filter(|f| matches!(f, Finding::Blkid { .. })).collect();
    assert_eq!(found.len(), 1, "{insp}");
    assert!(found[0].to_string().starts_with("blkid -p reports minix"), "{}", found[0]);
    assert_eq!(found[0].verdict(), Verdict::Refuse);
    let e = insp.permit(false).unwrap_err().to_string();
    assert!(e.contains("blkid -p reports minix"), "{e}");
}
