//! Raw block devices (tier S4): a `.picchioflat` image on a partition, a whole disk or a loop device,
//! with no file system, addressed by LBA (`raw:/dev/X[@BYTES]`).
//!
//! * [`RawDevice`] measures a block device: size (`BLKGETSIZE64`), logical and physical block size
//!   (`BLKSSZGET`, `BLKPBSZGET`), read-only flag (`BLKROGET`), and what sysfs says it is.
//! * [`RawTarget`] is a device plus the [`Lba`] where the image starts: the byte offset of
//!   `raw:/dev/X@BYTES` must be a whole number of logical blocks, and every read or write of the
//!   image lands at `LBA × logical block size + offset in the image` ([`RawTarget::base`] is the
//!   byte offset a reader adds: [`picchio_core::FlatStoreOptions::base_offset`]).
//! * [`RawTarget::inspect`] (`inspect.rs`) reads (never writes) what writing an image would destroy:
//!   how the device and its partitions are used ([`crate::host`]: mounts, swap, holders, whether it
//!   backs `/`), and partition tables, file-system signatures and an earlier `.picchioflat` image
//!   (`signature.rs`, with `blkid -p` as a second opinion where installed, `blkid.rs`).
//!   [`Inspection`] prints as the plan `picchio pack --out raw:` shows before writing, and
//!   [`Inspection::permit`] turns it into a [`WritePermit`] or a refusal.
//! * [`DeviceSink`] (`sink.rs`) writes the image through [`picchio_core::FlatWriter`] with
//!   `O_DIRECT | O_EXCL`, in aligned chunks; it can only be opened from a [`WritePermit`], so nothing
//!   writes a device that was not inspected and cleared.
//!
//! Linux only: the ioctls are Linux's, and so are sysfs, `/proc/self/mountinfo` and `/proc/swaps`.

use std::fmt;
use std::path::{Path, PathBuf};

use picchio_core::{human_bytes as human, ByteOffset, BLOCK_SIZE};

use crate::error::{Error, Result};
pub use crate::host::DevNum;
use crate::host::Sysfs;
use crate::sys::{self, rawdev};

mod blkid;
mod inspect;
mod signature;
mod sink;

pub use blkid::{parse_blkid_export, BlkidProbe};
pub use inspect::{decide, write_findings, Decision, Finding, Inspection, Verdict, WritePermit};
pub use signature::{scan_signatures, Signature, SignatureKind, HEAD_BYTES};
pub use sink::DeviceSink;

/// A logical block address: a count of the device's logical blocks (512 or 4096 bytes) from its
/// start. Never a byte offset: convert with [`RawDevice::byte_offset`] and [`RawDevice::lba`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lba(pub u64);

impl fmt::Display for Lba {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LBA {}", self.0)
    }
}

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
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use picchio_core::io::read_blocking;
    use picchio_core::IoQueue;

    use crate::psync::{PsyncOptions, PsyncQueue};

    pub(crate) const fn dn(major: u32, minor: u32) -> DevNum {
        DevNum { major, minor }
    }

    #[test]
    fn lba_display_and_devnum_parse() {
        assert_eq!(Lba(7).to_string(), "LBA 7");
        let d: DevNum = "259:3\n".parse().unwrap();
        assert_eq!((d, d.to_string()), (DevNum { major: 259, minor: 3 }, "259:3".to_string()));
        assert!("259".parse::<DevNum>().is_err() && "a:b".parse::<DevNum>().is_err());
    }

    pub(crate) fn fake_target(size: u64, lbs: u32, offset: u64) -> Result<RawTarget> {
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
    fn an_image_at_a_base_is_read_at_base_plus_image_offset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d");
        let bytes: Vec<u8> = (0..16384u32).map(|i| (i % 253) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let mut q = PsyncQueue::open(&path, PsyncOptions::buffered(1)).unwrap();
        // The reader adds the target's base (FlatStoreOptions::base_offset) to every image offset.
        let base = fake_target(16384, 512, 4096).unwrap().base();
        assert_eq!((base, q.block_size()), (ByteOffset(4096), 512));
        let b = read_blocking(&mut q, base.0 + 4096, 4096).unwrap();
        assert!(b.as_slice()[..4096] == bytes[8192..12288]);
        assert!(read_blocking(&mut q, base.0 + 12288, 512).is_err(), "past the end of the target");
        assert_eq!(q.describe(), "psync(buffered, 1 thread)");
        assert_eq!(q.len(), 16384);
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
}
