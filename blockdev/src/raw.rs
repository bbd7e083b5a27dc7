//! Raw block devices (tier S4): a `.picchioflat` image on a partition, a whole disk or a loop device,
//! with no file system, addressed by LBA (`raw:/dev/X[@BYTES]`).
//!
//! * [`RawDevice`] measures a block device: size (`BLKGETSIZE64`), logical and physical block size
//!   (`BLKSSZGET`, `BLKPBSZGET`), read-only flag (`BLKROGET`), and what sysfs says it is.
//! * [`RawTarget`] is a device plus the [`Lba`] where the image starts: the byte offset of
//!   `raw:/dev/X@BYTES` must be a whole number of logical blocks, and every read or write of the
//!   image lands at `LBA × logical block size + offset in the image`. [`OffsetQueue`] gives any
//!   [`IoQueue`] that view, so code that reads an image from byte 0 (verification) reads it there.
//! * [`RawTarget::inspect`] reads (never writes) what writing an image would destroy: mounts of the
//!   device or any partition of it, swap areas, holders (device-mapper, md), partition tables and
//!   file-system signatures, an earlier `.picchioflat` image, and whether the device backs `/`.
//!   [`Inspection`] prints as the plan `picchio pack --out raw:` shows before writing, and
//!   [`Inspection::permit`] turns it into a [`WritePermit`] or a refusal.
//! * [`DeviceSink`] writes the image through [`picchio_core::FlatWriter`] with `O_DIRECT | O_EXCL`, in
//!   aligned chunks; it can only be opened from a [`WritePermit`], so nothing writes a device that
//!   was not inspected and cleared.
//!
//! Linux only: the ioctls are Linux's, and so are sysfs, `/proc/self/mountinfo` and `/proc/swaps`.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use picchio_core::format::{ImageSink, Superblock, BLOCK_SIZE};
use picchio_core::io::read_blocking;
use picchio_core::{AlignedBuf, ByteOffset, Completion, IoQueue, ReadReq};

use crate::error::{Error, Result};
use crate::mountinfo::unescape;
pub use crate::mountinfo::DevNum;
use crate::psync::{PsyncOptions, PsyncQueue};
use crate::sys::{self, rawdev};

/// A logical block address: a count of the device's logical blocks (512 or 4096 bytes) from its
/// start. Never a byte offset: convert with [`RawDevice::byte_offset`] and [`RawDevice::lba`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lba(pub u64);

impl fmt::Display for Lba {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LBA {}", self.0)
    }
}

/// Bytes read from the start of a region when looking for signatures: covers btrfs (64 KiB + 64),
/// ISO 9660 (32 KiB + 1) and swap on 64 KiB pages. What [`scan_signatures`] needs to see everything
/// it knows; other targets (an NVMe namespace through the user-space driver) read this much too.
pub const HEAD_BYTES: u64 = 128 << 10;

/// Bytes per `O_DIRECT` write of [`DeviceSink`].
const WRITE_CHUNK: usize = 4 << 20;

/// A block device, measured once.
#[derive(Clone, Debug)]
pub struct RawDevice {
    path: PathBuf,
    devnum: DevNum,
    name: String,
    size: u64,
    logical_block: u32,
    physical_block: u32,
    read_only: bool,
    whole_disk: Option<String>,
    description: Option<String>,
}

impl RawDevice {
    /// Opens `path` read-only and measures it; `path` must be a block device (symlinks such as
    /// `/dev/disk/by-id/...` are followed).
    ///
    /// # Errors
    /// [`Error::NotBlockDevice`] for anything else (a regular file given as `raw:` is never read or
    /// written as a device); [`Error::Open`], [`Error::Stat`], [`Error::Ioctl`].
    pub fn open(path: &Path) -> Result<RawDevice> {
        RawDevice::open_with(path, &Sysfs::new("/sys"))
    }

    fn open_with(path: &Path, sysfs: &Sysfs) -> Result<RawDevice> {
        let not_block = |kind| Error::NotBlockDevice { path: path.into(), kind };
        // stat before open: opening a FIFO would block, and nothing but a block device is opened.
        match rawdev::stat_block_device(path) {
            Ok(Ok(_)) => {}
            Ok(Err(kind)) => return Err(not_block(kind)),
            Err(cause) => return Err(Error::Open { path: path.into(), mode: "inspection", cause }),
        }
        let file = sys::open(path, false)?;
        // fstat again: the path may have changed in between; the open file is what gets measured.
        let devnum = match rawdev::fstat_block(&file) {
            Ok(Ok(d)) => d,
            Ok(Err(kind)) => return Err(not_block(kind)),
            Err(cause) => return Err(Error::Stat { path: path.into(), cause }),
        };
        let probe = sys::probe(&file, path, false)?;
        let ioctl = |request| move |cause| Error::Ioctl { path: path.into(), request, cause };
        let logical_block = probe.logical_block.unwrap_or(512);
        let physical_block = rawdev::physical_block_size(&file).map_err(ioctl("BLKPBSZGET"))?;
        let read_only = rawdev::read_only(&file).map_err(ioctl("BLKROGET"))?;
        let dir = sysfs.dir(devnum);
        let name = dir
            .as_deref()
            .map(Sysfs::name)
            .unwrap_or_else(|| path.file_name().unwrap_or_default().to_string_lossy().into_owned());
        let whole_disk = dir.as_deref().and_then(Sysfs::parent).map(|p| Sysfs::name(&p));
        let description = dir.as_deref().and_then(Sysfs::describe);
        Ok(RawDevice {
            path: path.into(),
            devnum,
            name,
            size: probe.size,
            logical_block,
            physical_block,
            read_only,
            whole_disk,
            description,
        })
    }

    /// The path it was opened by.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its device number.
    pub fn devnum(&self) -> DevNum {
        self.devnum
    }

    /// The kernel's name for it (`loop3`, `nvme0n1p2`), from sysfs.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Size in bytes (`BLKGETSIZE64`).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Logical block size in bytes (`BLKSSZGET`): the unit of LBAs and of `O_DIRECT` alignment.
    pub fn logical_block(&self) -> u32 {
        self.logical_block
    }

    /// Physical block size in bytes (`BLKPBSZGET`; 4096 on a "512e" disk with 512-byte LBAs).
    pub fn physical_block(&self) -> u32 {
        self.physical_block
    }

    /// Whether the kernel marks the device read-only (`BLKROGET`).
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// The whole disk, when this is a partition.
    pub fn whole_disk(&self) -> Option<&str> {
        self.whole_disk.as_deref()
    }

    /// What sysfs says the device is: the disk's model, or a loop device's backing file.
    pub fn description(&self) -> Option<&str> {
        self.description.as_deref()
    }

    /// Number of logical blocks.
    pub fn lbas(&self) -> u64 {
        self.size / u64::from(self.logical_block)
    }

    /// The byte offset of `lba`: `lba × logical block size`.
    pub fn byte_offset(&self, lba: Lba) -> ByteOffset {
        ByteOffset(lba.0 * u64::from(self.logical_block))
    }

    /// The LBA at byte `offset`.
    ///
    /// # Errors
    /// [`Error::RawOffset`] when `offset` is not a multiple of the logical block size.
    pub fn lba(&self, offset: ByteOffset) -> Result<Lba> {
        let lbs = u64::from(self.logical_block);
        if !offset.0.is_multiple_of(lbs) {
            return Err(Error::RawOffset {
                path: self.path.clone(),
                offset: offset.0,
                logical_block: self.logical_block,
            });
        }
        Ok(Lba(offset.0 / lbs))
    }

    /// The image position `raw:PATH@offset`: checks that `offset` is a whole number of logical blocks
    /// inside the device, and that the logical block size divides the image's 4096-byte blocks.
    ///
    /// # Errors
    /// [`Error::RawOffset`], [`Error::RawOffsetPastEnd`], [`Error::UnsupportedBlockSize`].
    pub fn target(self, offset: ByteOffset) -> Result<RawTarget> {
        if self.logical_block > BLOCK_SIZE || !self.logical_block.is_power_of_two() {
            return Err(Error::UnsupportedBlockSize { path: self.path.clone(), logical_block: self.logical_block });
        }
        let start = self.lba(offset)?;
        if offset.0 >= self.size {
            return Err(Error::RawOffsetPastEnd { path: self.path.clone(), offset: offset.0, size: self.size });
        }
        Ok(RawTarget { device: self, start })
    }
}

impl fmt::Display for RawDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}, {})", self.path.display(), self.name, self.devnum)?;
        if let Some(d) = &self.description {
            write!(f, ", {d}")?;
        }
        if let Some(w) = &self.whole_disk {
            write!(f, ", a partition of {w}")?;
        }
        write!(
            f,
            ", {} bytes ({}), logical block {} B, physical block {} B",
            self.size,
            human(self.size),
            self.logical_block,
            self.physical_block
        )?;
        if self.read_only {
            write!(f, ", read-only")?;
        }
        Ok(())
    }
}

/// Where on a block device an image lives: the device and the LBA of the image's first byte.
#[derive(Clone, Debug)]
pub struct RawTarget {
    device: RawDevice,
    start: Lba,
}

impl RawTarget {
    /// Opens the device at `path` (see [`RawDevice::open`]) and places the image at byte `offset`
    /// (see [`RawDevice::target`]).
    ///
    /// # Errors
    /// As [`RawDevice::open`] and [`RawDevice::target`].
    pub fn open(path: &Path, offset: ByteOffset) -> Result<RawTarget> {
        RawDevice::open(path)?.target(offset)
    }

    /// The device.
    pub fn device(&self) -> &RawDevice {
        &self.device
    }

    /// The LBA of the image's first byte (its superblock).
    pub fn start(&self) -> Lba {
        self.start
    }

    /// The byte offset of the image's first byte: `start × logical block size`.
    pub fn base(&self) -> ByteOffset {
        self.device.byte_offset(self.start)
    }

    /// Bytes from [`RawTarget::base`] to the end of the device: the largest image that fits.
    pub fn capacity(&self) -> u64 {
        self.device.size - self.base().0
    }

    /// The store URI naming it, `raw:/dev/X` or `raw:/dev/X@BYTES`.
    pub fn uri(&self) -> String {
        match self.base().0 {
            0 => format!("raw:{}", self.device.path.display()),
            b => format!("raw:{}@{b}", self.device.path.display()),
        }
    }

    /// Reads (never writes) what writing an image of `image_len` bytes here would overwrite or
    /// disturb, as the running system sees it ([`Host::current`]).
    ///
    /// # Errors
    /// [`Error::Inspect`] when the mount table cannot be read; the [`PsyncQueue::open`] errors and
    /// [`Error::Inspect`] when the device's first blocks cannot be read.
    pub fn inspect(&self, image_len: u64) -> Result<Inspection> {
        self.inspect_with(image_len, &Host::current()?)
    }

    /// [`RawTarget::inspect`] against a given view of the system.
    ///
    /// # Errors
    /// As [`RawTarget::inspect`].
    pub fn inspect_with(&self, image_len: u64, host: &Host) -> Result<Inspection> {
        let mut findings = host.uses(self.device.devnum, &self.device.name);
        if let Some(root) = host.root_backing().get(&self.device.devnum) {
            findings.push(Finding::BacksRoot { device: self.device.name.clone(), root: root.clone() });
        }
        let base = self.base().0;
        let written = base..base.saturating_add(image_len);
        let mut starts = vec![0];
        if base != 0 {
            starts.push(base);
        }
        let mut queue = PsyncQueue::open(&self.device.path, PsyncOptions::direct(1))?;
        let lbs = u64::from(self.device.logical_block);
        for start in starts {
            let len = HEAD_BYTES.min(self.device.size - start) / lbs * lbs;
            if len == 0 {
                continue;
            }
            let head = read_blocking(&mut queue, start, len as u32).map_err(|cause| Error::Inspect {
                path: self.device.path.clone(),
                what: "read the first blocks for signatures",
                cause,
            })?;
            for signature in scan_signatures(head.as_slice(), start) {
                let overwritten = written.contains(&signature.offset);
                findings.push(Finding::Signature { signature, overwritten });
            }
        }
        Ok(Inspection { target: self.clone(), image_len, findings })
    }
}

/// One thing found on (or about) a device that writing it would destroy or disturb.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finding {
    /// The device, or a partition of it, is mounted.
    Mounted {
        /// The kernel name of the mounted device (the target or one of its partitions).
        device: String,
        /// Where.
        mount_point: PathBuf,
        /// The file-system type.
        fs_type: String,
    },
    /// The device, or a partition of it, is an active swap area (`/proc/swaps`).
    Swap {
        /// The kernel name of the swap device.
        device: String,
    },
    /// Something is built on the device or a partition of it (`/sys/class/block/X/holders`:
    /// device-mapper, LVM, LUKS, md RAID, bcache).
    Held {
        /// The held device.
        device: String,
        /// The holder (e.g. `dm-0`, `md127`).
        holder: String,
    },
    /// A partition table, file-system, volume or image signature.
    Signature {
        /// What and where.
        signature: Signature,
        /// Whether the image overwrites the signature's bytes (else they stay, describing a device
        /// whose contents the image has overwritten).
        overwritten: bool,
    },
    /// The device backs the root file system.
    BacksRoot {
        /// The device.
        device: String,
        /// How: the device `/` is on, and the chain down to this one.
        root: String,
    },
}

/// What a [`Finding`] means for writing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Verdict {
    /// Said, not a reason to refuse (an earlier `.picchioflat` image being overwritten).
    Note,
    /// Refused unless `--force`.
    Refuse,
    /// Refused even with `--force` (the device backing `/`).
    RefuseAlways,
}

/// The write decision over a target's findings, shared by every writer (`raw:` devices here, NVMe
/// namespaces through the user-space driver): refused when any finding is
/// [`Verdict::RefuseAlways`], or when any is [`Verdict::Refuse`] and `force` is false.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Write. `overridden` holds the reasons `--force` overrode (empty without such findings); the
    /// caller logs them.
    Write {
        /// [`Finding::reason`] of each [`Verdict::Refuse`] finding that `force` overrode.
        overridden: Vec<String>,
    },
    /// Do not write.
    Refuse {
        /// The reasons, `; `-joined, the always-refused ones first.
        reasons: String,
        /// Whether `--force` cannot change it (a [`Verdict::RefuseAlways`] finding).
        always: bool,
    },
}

/// Decides whether findings allow a write; see [`Decision`].
pub fn decide(findings: &[Finding], force: bool) -> Decision {
    let reasons =
        |v: Verdict| -> Vec<String> { findings.iter().filter(|f| f.verdict() == v).map(Finding::reason).collect() };
    let always = reasons(Verdict::RefuseAlways);
    let unless_forced = reasons(Verdict::Refuse);
    if !always.is_empty() || (!force && !unless_forced.is_empty()) {
        let mut all = always.clone();
        if !force {
            all.extend(unless_forced);
        }
        return Decision::Refuse { reasons: all.join("; "), always: !always.is_empty() };
    }
    Decision::Write { overridden: if force { unless_forced } else { Vec::new() } }
}

/// Writes the findings as `\n  found: …` lines, each with its verdict, or `\n  found: nothing
/// (<nothing>)` — the listing `pack --out raw:|nvme:` prints before writing.
///
/// # Errors
/// The formatter's.
pub fn write_findings(f: &mut fmt::Formatter<'_>, findings: &[Finding], nothing: &str) -> fmt::Result {
    if findings.is_empty() {
        return write!(f, "\n  found: nothing ({nothing})");
    }
    for finding in findings {
        let verdict = match finding.verdict() {
            Verdict::Note => "",
            Verdict::Refuse => " [refused without --force]",
            Verdict::RefuseAlways => " [refused, even with --force]",
        };
        write!(f, "\n  found: {finding}{verdict}")?;
    }
    Ok(())
}

impl Finding {
    /// What this finding means for writing; see [`Inspection::permit`].
    pub fn verdict(&self) -> Verdict {
        match self {
            Finding::Signature { signature, .. } if signature.kind == SignatureKind::Picchioflat => Verdict::Note,
            Finding::BacksRoot { .. } => Verdict::RefuseAlways,
            _ => Verdict::Refuse,
        }
    }
}

impl Finding {
    /// The finding as a reason to refuse, for [`Error::Refused`].
    pub fn reason(&self) -> String {
        match self {
            Finding::Signature { signature, .. } => format!("{signature} found on it"),
            other => other.to_string(),
        }
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Finding::Mounted { device, mount_point, fs_type } => {
                write!(f, "{device} is mounted at {} ({fs_type})", mount_point.display())
            }
            Finding::Swap { device } => write!(f, "{device} is an active swap area"),
            Finding::Held { device, holder } => {
                write!(f, "{device} is held by {holder} (device-mapper, LVM, LUKS or md is built on it)")
            }
            Finding::Signature { signature, overwritten } => {
                let fate = match (signature.kind == SignatureKind::Picchioflat, overwritten) {
                    (true, true) => "an earlier image, overwritten (not a reason to refuse)",
                    (true, false) => "an earlier image outside the new one, left in place (not a reason to refuse)",
                    (false, true) => "overwritten",
                    (false, false) => "outside the image: left in place, but what it describes is damaged",
                };
                write!(f, "{signature}: {fate}")
            }
            Finding::BacksRoot { device, root } => write!(f, "{device} backs the root file system ({root})"),
        }
    }
}

/// The kind of a [`Signature`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SignatureKind {
    /// An MBR (DOS) partition table with at least one used entry.
    Mbr,
    /// A GPT header (`"EFI PART"` at LBA 1).
    Gpt,
    /// ext2/3/4.
    Ext,
    /// XFS.
    Xfs,
    /// btrfs.
    Btrfs,
    /// F2FS.
    F2fs,
    /// A swap area.
    Swap,
    /// LUKS encryption.
    Luks,
    /// FAT12/16/32.
    Vfat,
    /// exFAT.
    Exfat,
    /// NTFS.
    Ntfs,
    /// An LVM2 physical volume.
    Lvm2,
    /// An md RAID member (superblock 1.1 or 1.2).
    MdRaid,
    /// ISO 9660.
    Iso9660,
    /// squashfs.
    Squashfs,
    /// A `.picchioflat` image (ours: overwriting it is not a refusal).
    Picchioflat,
}

impl SignatureKind {
    /// A human name, as messages use it.
    pub fn name(self) -> &'static str {
        match self {
            SignatureKind::Mbr => "MBR partition table",
            SignatureKind::Gpt => "GPT partition table",
            SignatureKind::Ext => "ext2/3/4 file system",
            SignatureKind::Xfs => "XFS file system",
            SignatureKind::Btrfs => "btrfs file system",
            SignatureKind::F2fs => "F2FS file system",
            SignatureKind::Swap => "swap area",
            SignatureKind::Luks => "LUKS encrypted volume",
            SignatureKind::Vfat => "FAT (vfat) file system",
            SignatureKind::Exfat => "exFAT file system",
            SignatureKind::Ntfs => "NTFS file system",
            SignatureKind::Lvm2 => "LVM2 physical volume",
            SignatureKind::MdRaid => "md RAID member",
            SignatureKind::Iso9660 => "ISO 9660 file system",
            SignatureKind::Squashfs => "squashfs file system",
            SignatureKind::Picchioflat => ".picchioflat image",
        }
    }
}

/// A signature found on a device: what, at which byte, and the evidence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Signature {
    /// What it is.
    pub kind: SignatureKind,
    /// Byte offset of the magic on the device.
    pub offset: u64,
    /// The evidence, e.g. `magic 0xEF53 at byte 1080`.
    pub detail: String,
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.kind.name(), self.detail)
    }
}

/// Looks for partition tables, file systems, volumes and images in `head`, the bytes of a device
/// from byte `start` on. Offsets in the result are device byte offsets.
///
/// Checked: MBR (`0x55AA` at 510 with a used entry) and GPT (`"EFI PART"` at 512 or 4096, LBA 1 of
/// either block size), ext2/3/4 (`0xEF53` at 1080), XFS (`"XFSB"` at 0), btrfs (`"_BHRfS_M"` at
/// 65600), F2FS (`0xF2F52010` at 1024), swap (`"SWAPSPACE2"` or `"SWAP-SPACE"` 10 bytes before the
/// end of a 4, 8, 16 or 64 KiB page), LUKS (`"LUKS\xba\xbe"` at 0, or the LUKS2 copy at 16 KiB), FAT
/// (`"FAT12   "`, `"FAT16   "` at 54 or `"FAT32   "` at 82, with `0x55AA` at 510), exFAT and NTFS
/// (OEM name at 3), LVM2 (`"LABELONE"` in one of the first four sectors), md RAID 1.1/1.2 (magic
/// `0xA92B4EFC` at 0 or 4096), ISO 9660 (`"CD001"` at 32769), squashfs (`"hsqs"` at 0), and
/// `.picchioflat` (`"PCHIOFL1"` at 0).
pub fn scan_signatures(head: &[u8], start: u64) -> Vec<Signature> {
    let at = |o: usize, magic: &[u8]| head.get(o..o + magic.len()) == Some(magic);
    let byte = |o: usize| start + o as u64;
    // (kind, offset in head, detail)
    let mut found: Vec<(SignatureKind, usize, String)> = Vec::new();
    let boot_sig = at(510, &[0x55, 0xAA]);
    let fat = boot_sig && (at(54, b"FAT12   ") || at(54, b"FAT16   ") || at(82, b"FAT32   "));
    let exfat = at(3, b"EXFAT   ");
    let ntfs = at(3, b"NTFS    ");
    // A FAT, exFAT or NTFS boot sector also ends in 0x55AA, with boot code where MBR entries would be.
    if boot_sig && !fat && !exfat && !ntfs {
        let used: Vec<u8> = (0..4).map(|i| head[446 + 16 * i + 4]).filter(|&t| t != 0).collect();
        if !used.is_empty() {
            let types = used.iter().map(|t| format!("{t:#04x}")).collect::<Vec<_>>().join(", ");
            let protective = if used.contains(&0xEE) { ", protective MBR of a GPT disk" } else { "" };
            let detail =
                format!("0x55AA at byte {}, {} used entries of type {types}{protective}", byte(510), used.len());
            found.push((SignatureKind::Mbr, 510, detail));
        }
    }
    // ext: s_magic at 1024 + 56; s_log_block_size (at 1024 + 24) is at most 6 (64 KiB blocks).
    let ext_log_bs = head.get(1048..1052).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
    if at(1080, &[0x53, 0xEF]) && ext_log_bs.is_some_and(|l| l <= 6) {
        found.push((SignatureKind::Ext, 1080, format!("magic 0xEF53 at byte {}", byte(1080))));
    }
    if fat {
        let o = if at(82, b"FAT32   ") { 82 } else { 54 };
        found.push((
            SignatureKind::Vfat,
            o,
            format!("\"FAT..   \" at byte {} and 0x55AA at byte {}", byte(o), byte(510)),
        ));
    }
    let swap_pages = [4096usize, 8192, 16384, 65536];
    let plain: Vec<(SignatureKind, usize, &[u8], &str)> = [
        (SignatureKind::Gpt, 512, &b"EFI PART"[..], "\"EFI PART\""),
        (SignatureKind::Gpt, 4096, b"EFI PART", "\"EFI PART\""),
        (SignatureKind::Xfs, 0, b"XFSB", "\"XFSB\""),
        (SignatureKind::Btrfs, 65600, b"_BHRfS_M", "\"_BHRfS_M\""),
        (SignatureKind::F2fs, 1024, &[0x10, 0x20, 0xF5, 0xF2], "magic 0xF2F52010"),
        (SignatureKind::Luks, 0, b"LUKS\xba\xbe", "\"LUKS\\xba\\xbe\""),
        (SignatureKind::Luks, 16384, b"SKUL\xba\xbe", "LUKS2 secondary header \"SKUL\\xba\\xbe\""),
        (SignatureKind::Exfat, 3, b"EXFAT   ", "\"EXFAT   \""),
        (SignatureKind::Ntfs, 3, b"NTFS    ", "\"NTFS    \""),
        (SignatureKind::Lvm2, 0, b"LABELONE", "\"LABELONE\""),
        (SignatureKind::Lvm2, 512, b"LABELONE", "\"LABELONE\""),
        (SignatureKind::Lvm2, 1024, b"LABELONE", "\"LABELONE\""),
        (SignatureKind::Lvm2, 1536, b"LABELONE", "\"LABELONE\""),
        (SignatureKind::MdRaid, 0, &[0xFC, 0x4E, 0x2B, 0xA9], "magic 0xA92B4EFC"),
        (SignatureKind::MdRaid, 4096, &[0xFC, 0x4E, 0x2B, 0xA9], "magic 0xA92B4EFC"),
        (SignatureKind::Iso9660, 32769, b"CD001", "\"CD001\""),
        (SignatureKind::Squashfs, 0, b"hsqs", "\"hsqs\""),
    ]
    .into_iter()
    .chain(swap_pages.iter().flat_map(|&p| {
        [
            (SignatureKind::Swap, p - 10, &b"SWAPSPACE2"[..], "\"SWAPSPACE2\""),
            (SignatureKind::Swap, p - 10, b"SWAP-SPACE", "\"SWAP-SPACE\""),
        ]
    }))
    .collect();
    for (kind, o, magic, shown) in plain {
        if at(o, magic) {
            found.push((kind, o, format!("{shown} at byte {}", byte(o))));
        }
    }
    if at(0, b"PCHIOFL1") {
        let what = match Superblock::decode(head, "", u64::MAX) {
            Ok(sb) => format!(
                "version {}, {} entries, hidden {}, {} layers × {} experts",
                sb.version, sb.n_entries, sb.hidden, sb.n_layers, sb.n_experts
            ),
            Err(_) => "superblock not decodable".into(),
        };
        found.push((SignatureKind::Picchioflat, 0, format!("\"PCHIOFL1\" at byte {start}, {what}")));
    }
    found.sort_by_key(|f| (f.0, f.1));
    found.into_iter().map(|(kind, o, detail)| Signature { kind, offset: byte(o), detail }).collect()
}

/// What writing an image to a [`RawTarget`] would overwrite: the plan `picchio pack` prints.
#[derive(Clone, Debug)]
pub struct Inspection {
    target: RawTarget,
    image_len: u64,
    findings: Vec<Finding>,
}

impl Inspection {
    /// The target inspected.
    pub fn target(&self) -> &RawTarget {
        &self.target
    }

    /// Bytes the image needs.
    pub fn image_len(&self) -> u64 {
        self.image_len
    }

    /// Everything found, in the order: uses (mounts, swap, holders), root, signatures.
    pub fn findings(&self) -> &[Finding] {
        &self.findings
    }

    /// Clears the target for writing, or refuses.
    ///
    /// Refused: an image that does not fit; and unless `force`, a device that is mounted, an active
    /// swap area or held (itself or any partition of it), or carries a partition table or a
    /// file-system, volume or RAID signature. An earlier `.picchioflat` image is no reason to refuse.
    ///
    /// The device backing the root file system is refused **even with `force`**: unlike every other
    /// check, this one is not a heuristic that can be stale (a leftover signature on a device the
    /// user has since emptied, a mount the user is about to undo); it is a fact about the running
    /// system, and writing that device destroys the system the command runs on — including the
    /// model it is packing — with no outcome anyone could have meant. A spare partition on the same
    /// disk is not refused by this rule (only the device `/` is on, the disk holding it, and what it
    /// is built from, e.g. the members of its LVM or RAID volume).
    ///
    /// `force` cannot override the kernel either: [`DeviceSink::open`] claims the device with
    /// `O_EXCL`, which fails (`EBUSY`) while a file system, swap area or holder uses it.
    ///
    /// # Errors
    /// [`Error::ImageTooLarge`] naming both sizes; [`Error::Refused`] listing every reason.
    pub fn permit(self, force: bool) -> Result<WritePermit> {
        let dev = &self.target.device;
        if self.image_len > self.target.capacity() {
            return Err(Error::ImageTooLarge {
                path: dev.path.clone(),
                offset: self.target.base().0,
                image_len: self.image_len,
                capacity: self.target.capacity(),
                size: dev.size,
            });
        }
        match decide(&self.findings, force) {
            Decision::Refuse { reasons, always } => Err(Error::Refused {
                path: dev.path.clone(),
                reasons,
                hint: if always {
                    "the device backing / is never written, not even with --force"
                } else {
                    "if this is the device you mean, unmount or release it and wipe it (wipefs -a), or pass --force"
                },
            }),
            Decision::Write { overridden } => {
                if !overridden.is_empty() {
                    tracing::warn!("{}: --force: overwriting although {}", dev.path.display(), overridden.join("; "));
                }
                Ok(WritePermit { target: self.target, image_len: self.image_len })
            }
        }
    }
}

impl fmt::Display for Inspection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = &self.target;
        let lbs = t.device.logical_block;
        let base = t.base().0;
        let end = base.saturating_add(self.image_len);
        writeln!(f, "{}: {}", t.uri(), t.device)?;
        write!(
            f,
            "  writes {} bytes ({}): device bytes {base:#x}..{end:#x}, LBA {}..{} of {} × {lbs} B",
            self.image_len,
            human(self.image_len),
            t.start.0,
            end.div_ceil(u64::from(lbs)),
            t.device.lbas(),
        )?;
        write_findings(f, &self.findings, "no mount, swap, holder, partition table or known signature")
    }
}

/// A [`RawTarget`] cleared for writing an image of a given length: the only way to a
/// [`DeviceSink`].
#[derive(Debug)]
pub struct WritePermit {
    target: RawTarget,
    image_len: u64,
}

impl WritePermit {
    /// The cleared target.
    pub fn target(&self) -> &RawTarget {
        &self.target
    }

    /// Bytes the image may take.
    pub fn image_len(&self) -> u64 {
        self.image_len
    }
}

/// The [`ImageSink`] that writes an image onto a block device cleared by a [`WritePermit`].
///
/// * Opened `O_WRONLY | O_DIRECT | O_EXCL` (never `O_CREAT`), and checked to be the very device the
///   permit was given for (same `major:minor`), so a path that changed since inspection is refused.
/// * The first image block is zeroed and synced at open: the old superblock (ours or a file
///   system's) is gone before anything else is written, so an interrupted pack leaves no
///   valid-looking image. The writer writes the new superblock last, after a
///   [`barrier`](ImageSink::barrier) (an `fsync`).
/// * Each contiguous run is gathered into a 4 MiB aligned buffer and written with `pwrite` in
///   aligned chunks; nothing is written outside `[base, base + image_len)` of the device.
pub struct DeviceSink {
    file: File,
    path: PathBuf,
    base: u64,
    limit: u64,
    align: usize,
    buf: AlignedBuf,
    buf_start: u64,
    buf_len: usize,
    written: u64,
}

impl DeviceSink {
    /// Opens the permit's device for writing and invalidates the old superblock (see the type's
    /// documentation).
    ///
    /// # Errors
    /// [`Error::WriteOpen`] (`EBUSY` when the kernel holds the device: mounted, swap, holder);
    /// [`Error::DeviceChanged`]; [`Error::Write`], [`Error::Sync`] for the first block.
    pub fn open(permit: &WritePermit) -> Result<DeviceSink> {
        let dev = &permit.target.device;
        let path = dev.path.clone();
        let file =
            rawdev::open_write_exclusive(&path).map_err(|cause| Error::WriteOpen { path: path.clone(), cause })?;
        match rawdev::fstat_block(&file) {
            Ok(Ok(found)) if found == dev.devnum => {}
            Ok(Ok(found)) => {
                return Err(Error::DeviceChanged { path, expected: dev.devnum.to_string(), found: found.to_string() })
            }
            Ok(Err(kind)) => {
                return Err(Error::DeviceChanged { path, expected: dev.devnum.to_string(), found: kind.into() })
            }
            Err(cause) => return Err(Error::Stat { path, cause }),
        }
        let mut sink = DeviceSink::new(file, path, permit.target.base().0, permit.image_len, dev.logical_block)?;
        let first = vec![0u8; BLOCK_SIZE as usize];
        sink.write_at(0, &first).map_err(|e| sink.unwrap_io(e))?;
        sink.barrier().map_err(|e| sink.unwrap_io(e))?;
        Ok(sink)
    }

    /// A sink over an open file: image byte `o` goes to byte `base + o`, up to `limit` image bytes.
    fn new(file: File, path: PathBuf, base: u64, limit: u64, logical_block: u32) -> Result<DeviceSink> {
        let align = (logical_block as usize).max(BLOCK_SIZE as usize);
        let buf = AlignedBuf::new(WRITE_CHUNK, align)?;
        Ok(DeviceSink {
            file,
            path,
            base,
            limit,
            align: logical_block as usize,
            buf,
            buf_start: 0,
            buf_len: 0,
            written: 0,
        })
    }

    /// Bytes written to the device so far.
    pub fn bytes_written(&self) -> u64 {
        self.written
    }

    /// The typed error inside an [`io::Error`] from this sink (or the I/O error as a write error).
    fn unwrap_io(&self, e: io::Error) -> Error {
        if !e.get_ref().is_some_and(|inner| inner.is::<Error>()) {
            return Error::Write { path: self.path.clone(), offset: self.base, len: 0, cause: e };
        }
        match e.into_inner().map(|b| b.downcast::<Error>()) {
            Some(Ok(typed)) => *typed,
            _ => unreachable!("checked to hold an Error just above"),
        }
    }

    /// Writes the gathered run to the device.
    fn flush(&mut self) -> io::Result<()> {
        if self.buf_len == 0 {
            return Ok(());
        }
        let len = self.buf_len;
        let at = self.base + self.buf_start;
        if !len.is_multiple_of(self.align) {
            return Err(Error::UnalignedWrite {
                path: self.path.clone(),
                offset: at,
                len: len as u64,
                align: self.align as u32,
            }
            .into_io());
        }
        let mut done = 0usize;
        while done < len {
            let off = at + done as u64;
            match rawdev::write_at(&self.file, &self.buf.as_slice()[done..len], off) {
                Ok(0) => {
                    let cause = io::Error::new(io::ErrorKind::WriteZero, "the device accepted no bytes");
                    return Err(Error::Write { path: self.path.clone(), offset: off, len: (len - done) as u64, cause }
                        .into_io());
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(cause) => {
                    return Err(Error::Write { path: self.path.clone(), offset: off, len: (len - done) as u64, cause }
                        .into_io())
                }
            }
        }
        self.written += len as u64;
        self.buf_start += len as u64;
        self.buf_len = 0;
        Ok(())
    }
}

impl ImageSink for DeviceSink {
    fn dest(&self) -> &Path {
        &self.path
    }

    fn write_at(&mut self, offset: u64, bytes: &[u8]) -> io::Result<()> {
        let end = offset.saturating_add(bytes.len() as u64);
        if end > self.limit {
            return Err(Error::WritePastImage {
                path: self.path.clone(),
                offset: self.base + offset,
                len: bytes.len() as u64,
                limit: self.limit,
            }
            .into_io());
        }
        if self.buf_len > 0 && offset != self.buf_start + self.buf_len as u64 {
            self.flush()?;
        }
        if self.buf_len == 0 {
            if !offset.is_multiple_of(self.align as u64) {
                return Err(Error::UnalignedWrite {
                    path: self.path.clone(),
                    offset: self.base + offset,
                    len: bytes.len() as u64,
                    align: self.align as u32,
                }
                .into_io());
            }
            self.buf_start = offset;
        }
        let mut rest = bytes;
        while !rest.is_empty() {
            let take = rest.len().min(WRITE_CHUNK - self.buf_len);
            self.buf.as_mut_slice()[self.buf_len..self.buf_len + take].copy_from_slice(&rest[..take]);
            self.buf_len += take;
            rest = &rest[take..];
            if self.buf_len == WRITE_CHUNK {
                self.flush()?;
            }
        }
        Ok(())
    }

    fn barrier(&mut self) -> io::Result<()> {
        self.flush()?;
        rawdev::sync(&self.file).map_err(|cause| Error::Sync { path: self.path.clone(), cause }.into_io())
    }

    fn commit(&mut self, len: u64) -> picchio_core::Result<()> {
        let path = self.path.clone();
        let werr = |what, cause| picchio_core::Error::Write { path: path.clone(), what, cause };
        if len > self.limit {
            let e = Error::WritePastImage { path: path.clone(), offset: self.base, len, limit: self.limit };
            return Err(werr("commit", e.into_io()));
        }
        self.barrier().map_err(|e| werr("final flush and sync", e))
    }
}

impl fmt::Debug for DeviceSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceSink")
            .field("path", &self.path)
            .field("base", &self.base)
            .field("limit", &self.limit)
            .field("written", &self.written)
            .finish_non_exhaustive()
    }
}

/// Any [`IoQueue`] seen from an image's first byte at `base` on its target: a read at image offset
/// `o` goes to `base + o`. Completions are passed through untouched (they carry no offset).
#[derive(Debug)]
pub struct OffsetQueue<Q> {
    inner: Q,
    base: ByteOffset,
}

impl<Q: IoQueue> OffsetQueue<Q> {
    /// Wraps `inner`; `base` should be a multiple of `inner.block_size()` (else every read completes
    /// with the engine's misalignment error).
    pub fn new(inner: Q, base: ByteOffset) -> Self {
        OffsetQueue { inner, base }
    }

    /// The offset added to every read.
    pub fn base(&self) -> ByteOffset {
        self.base
    }

    /// The wrapped queue.
    pub fn inner(&self) -> &Q {
        &self.inner
    }

    /// Unwraps the queue.
    pub fn into_inner(self) -> Q {
        self.inner
    }
}

impl<Q: IoQueue> IoQueue for OffsetQueue<Q> {
    fn block_size(&self) -> u32 {
        self.inner.block_size()
    }
    fn submit(&mut self, mut req: ReadReq) {
        // An overflowing offset becomes one the engine refuses as past the end.
        req.offset = ByteOffset(self.base.0.saturating_add(req.offset.0));
        self.inner.submit(req)
    }
    fn reap(&mut self, min: usize, out: &mut Vec<Completion>) -> usize {
        self.inner.reap(min, out)
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}

/// The kernel's view of block devices that inspection needs: sysfs, the mount table, the active swap
/// areas and the device of `/`. [`Host::current`] reads the running system's.
#[derive(Clone, Debug)]
pub struct Host {
    sysfs: Sysfs,
    mounts: Vec<Mount>,
    swaps: Vec<DevNum>,
    root: Vec<DevNum>,
}

/// One line of `/proc/self/mountinfo`, with the devices it uses.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Mount {
    /// The `major:minor` field, and the source's device when it is a block device node (btrfs and
    /// some others report an anonymous `0:N` in the first).
    devices: Vec<DevNum>,
    mount_point: PathBuf,
    fs_type: String,
}

impl Host {
    /// Reads `/proc/self/mountinfo`, `/proc/swaps` (absent means none) and the device of `/`.
    ///
    /// # Errors
    /// [`Error::Inspect`] when the mount table or `/` cannot be read.
    pub fn current() -> Result<Host> {
        let read =
            |p: &str, what| std::fs::read_to_string(p).map_err(|cause| Error::Inspect { path: p.into(), what, cause });
        let resolve = |p: &Path| rawdev::stat_block_device(p).ok().and_then(Result::ok);
        let mounts = parse_mountinfo(&read("/proc/self/mountinfo", "read the mount table")?, &resolve);
        let swaps = std::fs::read_to_string("/proc/swaps").map(|s| parse_swaps(&s, &resolve)).unwrap_or_default();
        let mut root = vec![rawdev::device_of(Path::new("/")).map_err(|cause| Error::Inspect {
            path: "/".into(),
            what: "stat the root directory",
            cause,
        })?];
        // The last mount on `/` is the visible one; its source names the device when st_dev does not.
        if let Some(m) = mounts.iter().rev().find(|m| m.mount_point == Path::new("/")) {
            root.extend(m.devices.iter().copied());
        }
        root.sort();
        root.dedup();
        Ok(Host { sysfs: Sysfs::new("/sys"), mounts, swaps, root })
    }

    /// The findings about how `dev` (named `name`) and each partition of it are used.
    fn uses(&self, dev: DevNum, name: &str) -> Vec<Finding> {
        let mut family = vec![(name.to_string(), dev, self.sysfs.dir(dev))];
        if let Some(dir) = self.sysfs.dir(dev) {
            for p in Sysfs::partitions(&dir) {
                if let Some(num) = Sysfs::devnum(&p) {
                    family.push((Sysfs::name(&p), num, Some(p)));
                }
            }
        }
        let mut out = Vec::new();
        for (device, num, dir) in family {
            for m in self.mounts.iter().filter(|m| m.devices.contains(&num)) {
                out.push(Finding::Mounted {
                    device: device.clone(),
                    mount_point: m.mount_point.clone(),
                    fs_type: m.fs_type.clone(),
                });
            }
            if self.swaps.contains(&num) {
                out.push(Finding::Swap { device: device.clone() });
            }
            for holder in dir.as_deref().map(|d| Sysfs::links(d, "holders")).unwrap_or_default() {
                out.push(Finding::Held { device: device.clone(), holder: Sysfs::name(&holder) });
            }
        }
        out
    }

    /// Every device whose overwriting destroys the root file system, with how it backs `/`: the
    /// device of `/`, the whole disk of a partition in the set, and the slaves (device-mapper, md
    /// members) of a device in the set, transitively.
    fn root_backing(&self) -> BTreeMap<DevNum, String> {
        let mut out = BTreeMap::new();
        let mut todo: Vec<(DevNum, String)> = self.root.iter().map(|&d| (d, "/ is on".to_string())).collect();
        while let Some((num, prefix)) = todo.pop() {
            if out.contains_key(&num) {
                continue;
            }
            let dir = self.sysfs.dir(num);
            let name = dir.as_deref().map(Sysfs::name).unwrap_or_else(|| num.to_string());
            let chain = format!("{prefix} {name}");
            if let Some(dir) = dir {
                if let Some(parent) = Sysfs::parent(&dir).and_then(|p| Sysfs::devnum(&p)) {
                    todo.push((parent, format!("{chain}, a partition of")));
                }
                for slave in Sysfs::links(&dir, "slaves") {
                    if let Some(n) = Sysfs::devnum(&slave) {
                        todo.push((n, format!("{chain}, built on")));
                    }
                }
            }
            out.insert(num, chain);
        }
        out
    }
}

/// The mount table ([`crate::mountinfo::parse`]) with the devices each mount uses: its `MAJ:MIN`
/// and, when the source is a path, the block device `resolve` maps it to.
fn parse_mountinfo(text: &str, resolve: &dyn Fn(&Path) -> Option<DevNum>) -> Vec<Mount> {
    crate::mountinfo::parse(text)
        .into_iter()
        .map(|e| {
            let mut devices: Vec<DevNum> = e.devnum.into_iter().collect();
            if e.source.starts_with('/') {
                if let Some(d) = resolve(Path::new(&e.source)).filter(|d| !devices.contains(d)) {
                    devices.push(d);
                }
            }
            Mount { devices, mount_point: e.mount_point, fs_type: e.fs_type }
        })
        .collect()
}

/// Parses `/proc/swaps` (a header line, then `FILENAME TYPE SIZE USED PRIORITY`) into the block
/// devices used as swap (swap files are skipped: they live on a file system, found as a mount).
fn parse_swaps(text: &str, resolve: &dyn Fn(&Path) -> Option<DevNum>) -> Vec<DevNum> {
    text.lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|name| resolve(Path::new(&unescape(name))))
        .collect()
}

/// Read-only queries of a sysfs tree (`/sys`, or a fake one in tests).
#[derive(Clone, Debug)]
struct Sysfs {
    root: PathBuf,
}

impl Sysfs {
    fn new(root: impl Into<PathBuf>) -> Self {
        Sysfs { root: root.into() }
    }

    /// The device's directory (`/sys/dev/block/M:m` resolved), if sysfs knows it.
    fn dir(&self, d: DevNum) -> Option<PathBuf> {
        std::fs::canonicalize(self.root.join("dev/block").join(d.to_string())).ok()
    }

    fn name(dir: &Path) -> String {
        dir.file_name().unwrap_or_default().to_string_lossy().into_owned()
    }

    fn read(path: &Path) -> Option<String> {
        std::fs::read_to_string(path).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
    }

    fn devnum(dir: &Path) -> Option<DevNum> {
        Sysfs::read(&dir.join("dev"))?.parse().ok()
    }

    fn is_partition(dir: &Path) -> bool {
        dir.join("partition").exists()
    }

    /// The whole disk of a partition.
    fn parent(dir: &Path) -> Option<PathBuf> {
        Sysfs::is_partition(dir).then(|| dir.parent().map(Path::to_path_buf)).flatten()
    }

    /// The partitions of a whole disk: its subdirectories holding a `partition` file.
    fn partitions(dir: &Path) -> Vec<PathBuf> {
        let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
            .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| Sysfs::is_partition(p)).collect())
            .unwrap_or_default();
        out.sort();
        out
    }

    /// The devices linked from `dir/<which>` (`holders`, `slaves`), resolved to their directories.
    fn links(dir: &Path, which: &str) -> Vec<PathBuf> {
        let mut out: Vec<PathBuf> = std::fs::read_dir(dir.join(which))
            .map(|rd| rd.filter_map(|e| e.ok()).filter_map(|e| std::fs::canonicalize(e.path()).ok()).collect())
            .unwrap_or_default();
        out.sort();
        out
    }

    /// A loop device's backing file, else the disk's vendor and model (a partition's from its disk).
    fn describe(dir: &Path) -> Option<String> {
        if let Some(f) = Sysfs::read(&dir.join("loop/backing_file")) {
            return Some(format!("loop device over {f}"));
        }
        let disk = Sysfs::parent(dir).unwrap_or_else(|| dir.to_path_buf());
        let part = |f: &str| Sysfs::read(&disk.join("device").join(f));
        match (part("vendor"), part("model")) {
            (Some(v), Some(m)) => Some(format!("{v} {m}")),
            (None, Some(m)) => Some(m),
            (Some(v), None) => Some(v),
            (None, None) => None,
        }
    }
}

/// `n` bytes in binary units, e.g. `392.0 KiB`.
fn human(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decide_refuses_always_before_force_and_reports_what_force_overrode() {
        let swap = Finding::Swap { device: "sdb1".into() };
        let root = Finding::BacksRoot { device: "vda".into(), root: "/ is on vda".into() };
        assert_eq!(decide(&[], false), Decision::Write { overridden: vec![] });
        assert_eq!(
            decide(std::slice::from_ref(&swap), false),
            Decision::Refuse { reasons: swap.reason(), always: false }
        );
        assert_eq!(decide(std::slice::from_ref(&swap), true), Decision::Write { overridden: vec![swap.reason()] });
        for force in [false, true] {
            let Decision::Refuse { reasons, always } = decide(&[swap.clone(), root.clone()], force) else {
                panic!("the root device is refused even with --force={force}")
            };
            assert!(always && reasons.starts_with(&root.reason()), "{reasons}");
            assert_eq!(reasons.contains(&swap.reason()), !force, "{reasons}");
        }
    }
    use std::os::unix::fs::symlink;

    fn head() -> Vec<u8> {
        vec![0u8; HEAD_BYTES as usize]
    }

    fn kinds(sigs: &[Signature]) -> Vec<SignatureKind> {
        sigs.iter().map(|s| s.kind).collect()
    }

    #[test]
    fn lba_display_and_devnum_parse() {
        assert_eq!(Lba(7).to_string(), "LBA 7");
        let d: DevNum = "259:3\n".parse().unwrap();
        assert_eq!((d, d.to_string()), (DevNum { major: 259, minor: 3 }, "259:3".to_string()));
        assert!("259".parse::<DevNum>().is_err() && "a:b".parse::<DevNum>().is_err());
    }

    #[test]
    fn blank_and_own_images() {
        assert!(scan_signatures(&head(), 0).is_empty());
        // A bare 0x55AA with four empty entries is not a partition table.
        let mut h = head();
        h[510..512].copy_from_slice(&[0x55, 0xAA]);
        assert!(scan_signatures(&h, 0).is_empty());
        let sb = Superblock {
            version: 2,
            block_size: 4096,
            hidden: 64,
            n_layers: 3,
            n_experts: 16,
            topk: 4,
            moe_inter: 128,
            n_entries: 48,
            index_offset: 4096,
            index_len: 48 * 24,
            data_offset: 8192,
            index_sha256: [0; 32],
        };
        let mut h = head();
        h[..4096].copy_from_slice(&sb.encode());
        let s = scan_signatures(&h, 1 << 20);
        assert_eq!(kinds(&s), [SignatureKind::Picchioflat]);
        assert_eq!(s[0].offset, 1 << 20);
        assert!(s[0].detail.contains("48 entries") && s[0].detail.contains("3 layers × 16 experts"), "{}", s[0]);
        let f = Finding::Signature { signature: s[0].clone(), overwritten: true };
        assert_eq!(f.verdict(), Verdict::Note);
        assert!(f.to_string().contains("not a reason to refuse"), "{f}");
    }

    #[test]
    fn every_signature_at_its_documented_offset() {
        type Put = fn(&mut [u8]);
        let cases: Vec<(SignatureKind, u64, Put)> = vec![
            (SignatureKind::Mbr, 510, |h| {
                h[446 + 4] = 0x83;
                h[510..512].copy_from_slice(&[0x55, 0xAA]);
            }),
            (SignatureKind::Gpt, 512, |h| h[512..520].copy_from_slice(b"EFI PART")),
            (SignatureKind::Gpt, 4096, |h| h[4096..4104].copy_from_slice(b"EFI PART")),
            (SignatureKind::Ext, 1080, |h| {
                h[1080..1082].copy_from_slice(&[0x53, 0xEF]);
                h[1048] = 2;
            }),
            (SignatureKind::Xfs, 0, |h| h[..4].copy_from_slice(b"XFSB")),
            (SignatureKind::Btrfs, 65600, |h| h[65600..65608].copy_from_slice(b"_BHRfS_M")),
            (SignatureKind::F2fs, 1024, |h| h[1024..1028].copy_from_slice(&[0x10, 0x20, 0xF5, 0xF2])),
            (SignatureKind::Swap, 4086, |h| h[4086..4096].copy_from_slice(b"SWAPSPACE2")),
            (SignatureKind::Swap, 65526, |h| h[65526..65536].copy_from_slice(b"SWAP-SPACE")),
            (SignatureKind::Luks, 0, |h| h[..6].copy_from_slice(b"LUKS\xba\xbe")),
            (SignatureKind::Vfat, 82, |h| {
                h[82..90].copy_from_slice(b"FAT32   ");
                h[446 + 4] = 0x33; // boot code, not a partition entry
                h[510..512].copy_from_slice(&[0x55, 0xAA]);
            }),
            (SignatureKind::Vfat, 54, |h| {
                h[54..62].copy_from_slice(b"FAT16   ");
                h[510..512].copy_from_slice(&[0x55, 0xAA]);
            }),
            (SignatureKind::Ntfs, 3, |h| {
                h[3..11].copy_from_slice(b"NTFS    ");
                h[446 + 4] = 0x07;
                h[510..512].copy_from_slice(&[0x55, 0xAA]);
            }),
            (SignatureKind::Exfat, 3, |h| h[3..11].copy_from_slice(b"EXFAT   ")),
            (SignatureKind::Lvm2, 512, |h| h[512..520].copy_from_slice(b"LABELONE")),
            (SignatureKind::MdRaid, 4096, |h| h[4096..4100].copy_from_slice(&[0xFC, 0x4E, 0x2B, 0xA9])),
            (SignatureKind::Iso9660, 32769, |h| h[32769..32774].copy_from_slice(b"CD001")),
            (SignatureKind::Squashfs, 0, |h| h[..4].copy_from_slice(b"hsqs")),
        ];
        for (kind, offset, put) in cases {
            let mut h = head();
            put(&mut h);
            let s = scan_signatures(&h, 0);
            assert_eq!(kinds(&s), [kind], "{kind:?}: {s:?}");
            assert_eq!(s[0].offset, offset, "{kind:?}");
            let f = Finding::Signature { signature: s[0].clone(), overwritten: false };
            assert_eq!(f.verdict(), Verdict::Refuse, "{kind:?}");
            assert!(f.to_string().starts_with(kind.name()), "{f}");
        }
        // ext magic with a nonsense block size is noise, not ext4.
        let mut h = head();
        h[1080..1082].copy_from_slice(&[0x53, 0xEF]);
        h[1048] = 40;
        assert!(scan_signatures(&h, 0).is_empty());
        // A protective MBR says so; a short head (a tiny device) is scanned as far as it goes.
        let mut h = head();
        h[446 + 4] = 0xEE;
        h[510..512].copy_from_slice(&[0x55, 0xAA]);
        h[512..520].copy_from_slice(b"EFI PART");
        let s = scan_signatures(&h[..1024], 0);
        assert_eq!(kinds(&s), [SignatureKind::Mbr, SignatureKind::Gpt]);
        assert!(s[0].detail.contains("protective MBR"), "{}", s[0]);
    }

    #[test]
    fn mountinfo_and_swaps_parse_with_escapes_and_resolved_sources() {
        let text = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
90 27 7:3 / /mnt/with\\040space rw shared:5 master:1 - ext4 /dev/loop3 rw
91 27 0:45 / /data rw - btrfs /dev/sdb2 rw
bogus line
";
        let resolve = |p: &Path| match p.to_str() {
            Some("/dev/sdb2") => Some(DevNum { major: 8, minor: 18 }),
            Some("/dev/loop3") => Some(DevNum { major: 7, minor: 3 }),
            Some("/dev/sdc") => Some(DevNum { major: 8, minor: 32 }),
            _ => None,
        };
        let m = parse_mountinfo(text, &resolve);
        assert_eq!(m.len(), 4);
        assert_eq!(m[2].mount_point, Path::new("/mnt/with space"));
        assert_eq!(m[2].devices, [DevNum { major: 7, minor: 3 }]);
        assert_eq!(m[3].devices, [DevNum { major: 0, minor: 45 }, DevNum { major: 8, minor: 18 }]);
        assert_eq!(m[3].fs_type, "btrfs");
        let swaps = "Filename\tType\tSize\tUsed\tPriority\n/dev/sdc  partition 100 0 -2\n/swapfile file 100 0 -3\n";
        assert_eq!(parse_swaps(swaps, &resolve), [DevNum { major: 8, minor: 32 }]);
        assert_eq!(unescape("a\\011b\\134c\\9"), "a\tb\\c\\9");
    }

    /// A fake sysfs: `devices/<disk>[/<part>]` directories with `dev` files, `dev/block/M:m` links.
    struct FakeSys {
        dir: tempfile::TempDir,
    }

    impl FakeSys {
        fn new() -> Self {
            FakeSys { dir: tempfile::tempdir().unwrap() }
        }
        fn root(&self) -> PathBuf {
            self.dir.path().to_path_buf()
        }
        fn add(&self, rel: &str, num: DevNum, partition: bool) -> PathBuf {
            let d = self.root().join("devices").join(rel);
            std::fs::create_dir_all(d.join("holders")).unwrap();
            std::fs::create_dir_all(d.join("slaves")).unwrap();
            std::fs::write(d.join("dev"), format!("{num}\n")).unwrap();
            if partition {
                std::fs::write(d.join("partition"), "1\n").unwrap();
            }
            std::fs::create_dir_all(self.root().join("dev/block")).unwrap();
            symlink(&d, self.root().join("dev/block").join(num.to_string())).unwrap();
            d
        }
        fn link(&self, from: &Path, which: &str, to: &Path) {
            symlink(to, from.join(which).join(to.file_name().unwrap())).unwrap();
        }
        fn host(&self, mounts: Vec<Mount>, swaps: Vec<DevNum>, root: Vec<DevNum>) -> Host {
            Host { sysfs: Sysfs::new(self.root()), mounts, swaps, root }
        }
    }

    const fn dn(major: u32, minor: u32) -> DevNum {
        DevNum { major, minor }
    }

    #[test]
    fn uses_cover_partitions_holders_and_swap() {
        let fs = FakeSys::new();
        let sda = fs.add("sda", dn(8, 0), false);
        let sda1 = fs.add("sda/sda1", dn(8, 1), true);
        let _sda2 = fs.add("sda/sda2", dn(8, 2), true);
        let dm0 = fs.add("dm-0", dn(253, 0), false);
        fs.link(&sda1, "holders", &dm0);
        std::fs::create_dir_all(sda.join("device")).unwrap();
        std::fs::write(sda.join("device/model"), "Fake SSD  \n").unwrap();
        let mnt = Mount { devices: vec![dn(8, 2)], mount_point: "/srv".into(), fs_type: "xfs".into() };
        let host = fs.host(vec![mnt], vec![dn(8, 0)], vec![dn(254, 0)]);
        let found = host.uses(dn(8, 0), "sda");
        assert_eq!(
            found,
            [
                Finding::Swap { device: "sda".into() },
                Finding::Held { device: "sda1".into(), holder: "dm-0".into() },
                Finding::Mounted { device: "sda2".into(), mount_point: "/srv".into(), fs_type: "xfs".into() },
            ]
        );
        assert!(found.iter().all(|f| f.verdict() == Verdict::Refuse));
        assert_eq!(Sysfs::describe(&sda1).as_deref(), Some("Fake SSD"));
        assert_eq!(Sysfs::parent(&sda1).map(|p| Sysfs::name(&p)).as_deref(), Some("sda"));
        // A partition alone only sees itself.
        assert_eq!(host.uses(dn(8, 1), "sda1").len(), 1);
        assert!(!host.root_backing().contains_key(&dn(8, 0)));
    }

    #[test]
    fn root_backing_follows_partitions_and_slaves() {
        let fs = FakeSys::new();
        let _nvme = fs.add("nvme0n1", dn(259, 0), false);
        let p2 = fs.add("nvme0n1/nvme0n1p2", dn(259, 2), true);
        let _p3 = fs.add("nvme0n1/nvme0n1p3", dn(259, 3), true);
        let dm = fs.add("dm-0", dn(253, 0), false);
        fs.link(&dm, "slaves", &p2);
        let host = fs.host(vec![], vec![], vec![dn(253, 0)]);
        let set = host.root_backing();
        assert_eq!(set.keys().copied().collect::<Vec<_>>(), [dn(253, 0), dn(259, 0), dn(259, 2)]);
        assert_eq!(set[&dn(259, 0)], "/ is on dm-0, built on nvme0n1p2, a partition of nvme0n1");
        // A spare partition of the root disk is not the root device.
        assert!(!set.contains_key(&dn(259, 3)));
        // An unknown root (no sysfs entry) still counts itself.
        let host = fs.host(vec![], vec![], vec![dn(0, 33)]);
        assert_eq!(host.root_backing().len(), 1);
    }

    fn fake_target(size: u64, lbs: u32, offset: u64) -> Result<RawTarget> {
        let dev = RawDevice {
            path: "/dev/fake".into(),
            devnum: dn(7, 9),
            name: "loop9".into(),
            size,
            logical_block: lbs,
            physical_block: lbs,
            read_only: false,
            whole_disk: None,
            description: Some("loop device over /x.img".into()),
        };
        dev.target(ByteOffset(offset))
    }

    #[test]
    fn lba_conversions_and_offset_errors() {
        let t = fake_target(8 << 20, 4096, 1 << 20).unwrap();
        assert_eq!((t.start(), t.base(), t.capacity()), (Lba(256), ByteOffset(1 << 20), 7 << 20));
        assert_eq!(t.uri(), "raw:/dev/fake@1048576");
        assert_eq!(t.device().byte_offset(Lba(3)), ByteOffset(12288));
        assert_eq!(t.device().lbas(), 2048);
        let e = fake_target(8 << 20, 4096, 512).unwrap_err();
        assert!(matches!(e, Error::RawOffset { offset: 512, logical_block: 4096, .. }), "{e}");
        assert!(e.to_string().contains("not a multiple of the device's logical block size (4096 bytes)"), "{e}");
        let t = fake_target(8 << 20, 512, 3584).unwrap();
        assert_eq!((t.start(), t.base()), (Lba(7), ByteOffset(3584)));
        let e = fake_target(8 << 20, 512, 8 << 20).unwrap_err();
        assert!(matches!(e, Error::RawOffsetPastEnd { .. }), "{e}");
        let e = fake_target(8 << 20, 8192, 0).unwrap_err();
        assert!(matches!(e, Error::UnsupportedBlockSize { logical_block: 8192, .. }), "{e}");
    }

    #[test]
    fn permit_refuses_unless_forced_but_root_always() {
        let t = fake_target(1 << 20, 512, 0).unwrap();
        let ext = Signature { kind: SignatureKind::Ext, offset: 1080, detail: "magic 0xEF53 at byte 1080".into() };
        let sig = Finding::Signature { signature: ext, overwritten: true };
        let insp = |findings: Vec<Finding>, len| Inspection { target: t.clone(), image_len: len, findings };
        let e = insp(vec![sig.clone()], 4096).permit(false).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("ext2/3/4 file system (magic 0xEF53 at byte 1080)") && s.contains("--force"), "{s}");
        let p = insp(vec![sig.clone()], 4096).permit(true).unwrap();
        assert_eq!((p.image_len(), p.target().base()), (4096, ByteOffset(0)));
        let root = Finding::BacksRoot { device: "loop9".into(), root: "/ is on loop9".into() };
        for force in [false, true] {
            let e = insp(vec![sig.clone(), root.clone()], 4096).permit(force).unwrap_err();
            assert!(e.to_string().contains("backs the root file system"), "{e}");
            assert!(e.to_string().contains("never written, not even with --force"), "{e}");
        }
        let e = insp(vec![], (1 << 20) + 4096).permit(true).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("1052672 bytes") && s.contains("1048576 bytes"), "{s}");
        // The plan names the device, the byte and LBA range, and each finding with its verdict.
        let plan = insp(vec![sig, root], 8192).to_string();
        for want in [
            "raw:/dev/fake: /dev/fake (loop9, 7:9), loop device over /x.img",
            "writes 8192 bytes",
            "LBA 0..16 of 2048 × 512 B",
            "[refused without --force]",
            "[refused, even with --force]",
        ] {
            assert!(plan.contains(want), "{want:?} in {plan}");
        }
        assert!(insp(vec![], 4096).to_string().contains("found: nothing"));
    }

    fn file_sink(len: u64, lbs: u32, base: u64, limit: u64) -> (tempfile::TempDir, PathBuf, DeviceSink) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev");
        std::fs::write(&path, vec![0xEEu8; len as usize]).unwrap();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let sink = DeviceSink::new(file, path.clone(), base, limit, lbs).unwrap();
        (dir, path, sink)
    }

    #[test]
    fn device_sink_gathers_runs_and_writes_only_its_window() {
        let (_d, path, mut s) = file_sink(3 * WRITE_CHUNK as u64, 512, 1024, 2 * WRITE_CHUNK as u64);
        let big: Vec<u8> = (0..WRITE_CHUNK + 1536).map(|i| (i % 251) as u8).collect();
        s.write_at(4096, &big[..1000]).unwrap();
        s.write_at(5096, &big[1000..]).unwrap(); // contiguous: one run crossing a chunk
        s.write_at(0, &[7u8; 512]).unwrap(); // a new run flushes the old one
        s.commit(4096 + big.len() as u64).unwrap();
        assert_eq!(s.bytes_written(), big.len() as u64 + 512);
        let out = std::fs::read(&path).unwrap();
        assert!(out[..1024].iter().all(|&b| b == 0xEE), "before base untouched");
        assert!(out[1024..1536].iter().all(|&b| b == 7));
        assert!(out[1536..1024 + 4096].iter().all(|&b| b == 0xEE));
        assert!(out[1024 + 4096..1024 + 4096 + big.len()] == big[..]);
        assert!(out[1024 + 4096 + big.len()..].iter().all(|&b| b == 0xEE), "after the run untouched");
    }

    #[test]
    fn device_sink_refuses_unaligned_runs_and_bytes_past_the_image() {
        let (_d, _p, mut s) = file_sink(1 << 16, 4096, 0, 1 << 15);
        let e = s.write_at(512, &[0; 4096]).unwrap_err();
        assert!(e.to_string().contains("not a multiple of 4096"), "{e}");
        let e = s.write_at((1 << 15) - 4096, &[0; 8192]).unwrap_err();
        assert!(e.to_string().contains("past the end of the image"), "{e}");
        s.write_at(0, &[1; 100]).unwrap();
        let e = s.commit(100).unwrap_err();
        assert!(e.to_string().contains("not a multiple of 4096"), "{e}");
    }

    #[test]
    fn device_sink_write_errors_name_device_offset_and_cause() {
        let (_d, path, mut s) = file_sink(1 << 16, 512, 8192, 1 << 15);
        rawdev::fail_write(&path, 8192 + 4096, libc::EIO);
        s.write_at(4096, &[3; 4096]).unwrap();
        let e = s.barrier().unwrap_err();
        let typed = e.get_ref().and_then(|e| e.downcast_ref::<Error>()).expect("typed");
        assert!(matches!(typed, Error::Write { offset: 0x3000, len: 4096, .. }), "{typed}");
        assert!(e.to_string().contains("write of 4096 bytes at offset 0x3000"), "{e}");
        assert_eq!(s.unwrap_io(e).to_string(), typed_string(&path));
    }

    fn typed_string(path: &Path) -> String {
        Error::Write { path: path.into(), offset: 0x3000, len: 4096, cause: io::Error::from_raw_os_error(libc::EIO) }
            .to_string()
    }

    #[test]
    fn offset_queue_shifts_reads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d");
        let bytes: Vec<u8> = (0..16384u32).map(|i| (i % 253) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let q = PsyncQueue::open(&path, PsyncOptions::buffered(1)).unwrap();
        let mut q = OffsetQueue::new(q, ByteOffset(4096));
        assert_eq!((q.base(), q.block_size()), (ByteOffset(4096), 512));
        let b = read_blocking(&mut q, 4096, 4096).unwrap();
        assert!(b.as_slice()[..4096] == bytes[8192..12288]);
        assert!(read_blocking(&mut q, 12288, 512).is_err(), "past the end of the target");
        assert_eq!(q.describe(), "psync(buffered, 1 thread)");
        assert_eq!(q.into_inner().len(), 16384);
    }

    #[test]
    fn regular_files_are_not_raw_devices() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let e = RawDevice::open(&path).unwrap_err();
        assert!(matches!(e, Error::NotBlockDevice { kind: "regular file", .. }), "{e}");
        assert!(e.to_string().contains("use file:"), "{e}");
        let e = RawDevice::open(dir.path()).unwrap_err();
        assert!(matches!(e, Error::NotBlockDevice { kind: "directory", .. }), "{e}");
        assert!(matches!(RawDevice::open(&dir.path().join("none")).unwrap_err(), Error::Open { .. }));
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(100), "100 B");
        assert_eq!(human(401408), "392.0 KiB");
        assert_eq!(human(3 << 30), "3.0 GiB");
    }
}
