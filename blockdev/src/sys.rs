//! Every system call and ioctl of this crate, one small function each, behind three entry points:
//! [`open`], [`probe`] and [`read_at`]. One file per OS (`sys/unix.rs`, `sys/windows.rs`); every
//! `unsafe` block lives there with a `// SAFETY:` note.
//!
//! Under `cfg(test)`, [`read_at`] has a twin behaviour: reads registered with [`fault::fail_read`]
//! fail with a chosen OS error before reaching the kernel, so error paths run without a failing disk.

use std::fs::File;
use std::io;
use std::path::Path;

use crate::align::StatxDio;
use crate::error::Result;

#[cfg(unix)]
mod unix;
#[cfg(unix)]
use unix as imp;

#[cfg(windows)]
pub(crate) mod windows;
#[cfg(windows)]
use windows as imp;

/// The host queries (page cache, free space, CPU time, kernel): see `sys/host_unix.rs`.
#[cfg(unix)]
#[path = "sys/host_unix.rs"]
pub(crate) mod host;
/// The host queries off unix: unknown.
#[cfg(windows)]
#[path = "sys/host_windows.rs"]
pub(crate) mod host;

#[cfg(not(any(unix, windows)))]
compile_error!("picchio-blockdev supports unix and windows targets");

/// What a path opened for reading turned out to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TargetKind {
    /// A regular file.
    File,
    /// A block device (a whole disk, a partition, a loop device).
    #[cfg_attr(windows, allow(dead_code))] // raw disks on Windows come with the IOCP engine
    BlockDevice,
}

/// Everything measured about an opened target.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Probe {
    /// File or block device.
    pub kind: TargetKind,
    /// Size in bytes (`st_size`, or `BLKGETSIZE64` for a block device).
    pub size: u64,
    /// The `STATX_DIOALIGN` answer, when asked for (direct mode) and given. On Windows: the
    /// `FileStorageInfo` sector sizes (logical for offsets, physical for buffer addresses).
    pub statx_dio: Option<StatxDio>,
    /// The logical block size of a block device (`BLKSSZGET`). On Windows: the volume's bytes per
    /// sector (`GetDiskFreeSpaceW`), when `FileStorageInfo` gave nothing.
    pub logical_block: Option<u32>,
}

/// Opens `path` read-only, with `O_DIRECT` when `direct`. On unix the path is stat'ed first and
/// anything but a regular file or a block device is refused without being opened (opening a FIFO
/// would block; a directory or a character device would fail as if O_DIRECT were unsupported).
///
/// # Errors
/// [`crate::Error::UnsupportedTarget`] for a directory, FIFO, socket or character device (unix);
/// [`crate::Error::DirectUnsupported`] when the file system or platform refuses unbuffered reads
/// (`EINVAL` from `open`), else [`crate::Error::Open`].
pub(crate) fn open(path: &Path, direct: bool) -> Result<File> {
    imp::open(path, direct)
}

/// Measures an opened target: kind, size, and (when `direct`) the kernel's direct-I/O alignment.
///
/// # Errors
/// [`crate::Error::Stat`], [`crate::Error::Ioctl`], [`crate::Error::UnsupportedTarget`].
pub(crate) fn probe(file: &File, path: &Path, direct: bool) -> Result<Probe> {
    imp::probe(file, path, direct)
}

/// One positional read of up to `buf.len()` bytes at `offset` (`pread(2)`); does not move any file
/// cursor, so many threads may read one `File` at once. Returns the count, 0 at end of file.
pub(crate) fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    #[cfg(test)]
    if let Some(e) = fault::check(file, offset) {
        return Err(e);
    }
    imp::read_at(file, buf, offset)
}

/// Test-only fault injection for [`read_at`], keyed by the file's identity and the read offset.
#[cfg(all(test, unix))]
pub(crate) mod fault {
    use std::fs::File;
    use std::io;
    use std::os::unix::fs::MetadataExt;
    use std::sync::Mutex;

    /// (device, inode, offset, errno) of reads that must fail.
    static FAULTS: Mutex<Vec<(u64, u64, u64, i32)>> = Mutex::new(Vec::new());

    fn id(md: &std::fs::Metadata) -> (u64, u64) {
        (md.dev(), md.ino())
    }

    /// Makes every read of the file at `path` starting at `offset` fail with `errno` until
    /// [`clear`] is called for that file.
    pub(crate) fn fail_read(path: &std::path::Path, offset: u64, errno: i32) {
        let (dev, ino) = id(&std::fs::metadata(path).expect("stat fault target"));
        FAULTS.lock().unwrap_or_else(|e| e.into_inner()).push((dev, ino, offset, errno));
    }

    /// Removes the faults registered for the file at `path`.
    pub(crate) fn clear(path: &std::path::Path) {
        let (dev, ino) = id(&std::fs::metadata(path).expect("stat fault target"));
        FAULTS.lock().unwrap_or_else(|e| e.into_inner()).retain(|f| (f.0, f.1) != (dev, ino));
    }

    pub(super) fn check(file: &File, offset: u64) -> Option<io::Error> {
        let faults = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
        if faults.is_empty() {
            return None;
        }
        let (dev, ino) = id(&file.metadata().ok()?);
        faults.iter().find(|f| (f.0, f.1, f.2) == (dev, ino, offset)).map(|f| io::Error::from_raw_os_error(f.3))
    }
}

/// Test-only fault injection on Windows, as on unix but keyed by (volume serial number, file
/// index); checked by [`read_at`] and by the IOCP engine's `windows::start_read`.
#[cfg(all(test, windows))]
pub(crate) mod fault {
    use std::fs::File;
    use std::io;
    use std::sync::Mutex;

    /// (volume serial, file index, offset, Win32 error code) of reads that must fail.
    static FAULTS: Mutex<Vec<(u32, u64, u64, i32)>> = Mutex::new(Vec::new());

    fn id_of(path: &std::path::Path) -> (u32, u64) {
        let file = File::open(path).expect("open fault target");
        super::windows::file_id(&file).expect("identify fault target")
    }

    /// Makes every read of the file at `path` starting at `offset` fail with the Win32 error
    /// `code` until [`clear`] is called for that file.
    pub(crate) fn fail_read(path: &std::path::Path, offset: u64, code: i32) {
        let (vol, index) = id_of(path);
        FAULTS.lock().unwrap_or_else(|e| e.into_inner()).push((vol, index, offset, code));
    }

    /// Removes the faults registered for the file at `path`.
    pub(crate) fn clear(path: &std::path::Path) {
        let (vol, index) = id_of(path);
        FAULTS.lock().unwrap_or_else(|e| e.into_inner()).retain(|f| (f.0, f.1) != (vol, index));
    }

    pub(super) fn check(file: &File, offset: u64) -> Option<io::Error> {
        let faults = FAULTS.lock().unwrap_or_else(|e| e.into_inner());
        if faults.is_empty() {
            return None;
        }
        let (vol, index) = super::windows::file_id(file).ok()?;
        faults.iter().find(|f| (f.0, f.1, f.2) == (vol, index, offset)).map(|f| io::Error::from_raw_os_error(f.3))
    }
}

#[cfg(test)]
mod tests {
    #[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
    #[test]
    fn ioctl_numbers_match_linux_uapi() {
        // include/uapi/linux/fs.h: BLKSSZGET _IO(0x12,104), BLKGETSIZE64 _IOR(0x12,114,size_t).
        assert_eq!(super::unix::BLKSSZGET, 0x1268 as libc::Ioctl);
        assert_eq!(super::unix::BLKGETSIZE64, 0x8008_1272_u32 as libc::Ioctl);
    }

    #[cfg(unix)]
    #[test]
    fn regular_file_probe_and_positional_read() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::File::create(&path).unwrap().write_all(&[7u8; 5000]).unwrap();
        let f = super::open(&path, false).unwrap();
        let p = super::probe(&f, &path, false).unwrap();
        assert_eq!((p.kind, p.size, p.statx_dio, p.logical_block), (super::TargetKind::File, 5000, None, None));
        let mut b = [0u8; 100];
        assert_eq!(super::read_at(&f, &mut b, 4950).unwrap(), 50);
        assert_eq!(super::read_at(&f, &mut b, 5000).unwrap(), 0);
    }

    #[cfg(unix)]
    #[test]
    fn directory_is_rejected_and_missing_path_named() {
        let dir = tempfile::tempdir().unwrap();
        let f = std::fs::File::open(dir.path()).unwrap();
        let e = super::probe(&f, dir.path(), false).unwrap_err();
        assert!(matches!(e, crate::Error::UnsupportedTarget { kind: "directory", .. }), "{e}");
        let missing = dir.path().join("missing");
        let e = super::open(&missing, false).unwrap_err();
        assert!(matches!(e, crate::Error::Open { mode: "buffered", .. }), "{e}");
        assert!(e.to_string().contains("missing"), "{e}");
    }

    /// A directory, a FIFO and /dev/null are refused by a stat before any open, in both modes, with
    /// what they are; a FIFO without a writer would otherwise block open(2) forever. The opens run on
    /// a thread with a deadline so a regression fails instead of hanging.
    #[cfg(unix)]
    #[test]
    fn non_file_targets_are_refused_before_open_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(fifo.as_os_str())).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path that outlives the call; mkfifo only reads it.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo: {}", std::io::Error::last_os_error());
        let cases = [
            (fifo, "FIFO"),
            (dir.path().to_path_buf(), "directory"),
            (std::path::PathBuf::from("/dev/null"), "character device"),
        ];
        for (path, want) in cases {
            for direct in [false, true] {
                let (tx, rx) = std::sync::mpsc::channel();
                let p = path.clone();
                std::thread::spawn(move || tx.send(super::open(&p, direct).map(drop)).unwrap());
                let r = rx
                    .recv_timeout(std::time::Duration::from_secs(10))
                    .unwrap_or_else(|_| panic!("opening {} (direct {direct}) blocked", path.display()));
                let e = r.unwrap_err();
                assert!(matches!(e, crate::Error::UnsupportedTarget { kind, .. } if kind == want), "{e}");
                let s = e.to_string();
                assert!(
                    s.contains(&path.display().to_string())
                        && s.contains(&format!("is a {want}; expected a regular file or a block device")),
                    "{s}"
                );
            }
        }
    }

    /// Both ioctls on a real block device: a 4 KiB-sector loop device (root only: ignored, run by CI
    /// as root with `-- --ignored`).
    #[cfg(target_os = "linux")]
    #[test]
    #[ignore = "needs root: losetup (CI runs ignored tests as root)"]
    fn block_device_ioctls_on_a_loop_device() {
        use picchio_testkit::loopdev::{LoopDevice, LoopOptions};
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("disk.img");
        std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
        let opts = LoopOptions { sector_size: 4096, direct_io: false, read_only: true, partscan: false };
        let lo = LoopDevice::attach_for_test("block_device_ioctls_on_a_loop_device", &img, opts);
        let p = super::open(&lo.dev, false).and_then(|f| super::probe(&f, &lo.dev, false)).unwrap();
        assert_eq!((p.kind, p.size, p.logical_block), (super::TargetKind::BlockDevice, 1 << 20, Some(4096)));
    }

    #[cfg(unix)]
    #[test]
    fn fault_twin_fails_only_the_registered_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, [1u8; 8192]).unwrap();
        let f = super::open(&path, false).unwrap();
        super::fault::fail_read(&path, 4096, libc::EIO);
        let mut b = [0u8; 16];
        assert_eq!(super::read_at(&f, &mut b, 4096).unwrap_err().raw_os_error(), Some(libc::EIO));
        assert_eq!(super::read_at(&f, &mut b, 0).unwrap(), 16);
        super::fault::clear(&path);
        assert_eq!(super::read_at(&f, &mut b, 4096).unwrap(), 16);
    }
}

// ============================================================================================ raw
// Raw block devices (tier S4, `raw.rs`): device numbers, the two extra block-device ioctls, and the
// write side (`O_DIRECT | O_EXCL` open, positional write, fsync). Linux only: everything `raw.rs`
// inspects (sysfs, mountinfo) is Linux's.

/// The system calls of `raw.rs`, one small function each.
///
/// Under `cfg(test)`, [`rawdev::write_at`] has a twin behaviour like [`read_at`]'s: writes registered
/// with [`rawdev::fail_write`] fail with a chosen OS error before reaching the kernel.
#[cfg(target_os = "linux")]
pub(crate) mod rawdev {
    use std::fs::{File, Metadata, OpenOptions};
    use std::io;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
    use std::path::Path;

    use crate::mountinfo::DevNum;

    /// `BLKROGET`: whether the device is read-only, as an `int` (`_IO(0x12, 94)`, include/uapi/linux/fs.h).
    pub(crate) const BLKROGET: libc::Ioctl = 0x125e as libc::Ioctl;
    /// `BLKPBSZGET`: the physical block size, as an `unsigned int` (`_IO(0x12, 123)`).
    pub(crate) const BLKPBSZGET: libc::Ioctl = libc::BLKPBSZGET;

    /// The device number of a block device's metadata (`st_rdev`), or what the file is instead.
    pub(crate) fn block_device_number(md: &Metadata) -> Result<DevNum, &'static str> {
        let ft = md.file_type();
        if ft.is_block_device() {
            Ok(devnum(md.rdev()))
        } else if ft.is_file() {
            Err("regular file")
        } else if ft.is_dir() {
            Err("directory")
        } else if ft.is_char_device() {
            Err("character device")
        } else if ft.is_fifo() {
            Err("FIFO")
        } else if ft.is_socket() {
            Err("socket")
        } else {
            Err("special file")
        }
    }

    /// `stat(2)` of `path` (following symlinks, so `/dev/disk/by-id/...` works) as a block device
    /// number, or what the file is instead. Nothing is opened (opening a FIFO would block).
    pub(crate) fn stat_block_device(path: &Path) -> io::Result<Result<DevNum, &'static str>> {
        std::fs::metadata(path).map(|md| block_device_number(&md))
    }

    /// `fstat(2)` of an open file as a block device number, or what the file is instead.
    pub(crate) fn fstat_block(file: &File) -> io::Result<Result<DevNum, &'static str>> {
        file.metadata().map(|md| block_device_number(&md))
    }

    /// The device number of the file system holding `path` (`st_dev`), e.g. the device of `/`.
    pub(crate) fn device_of(path: &Path) -> io::Result<DevNum> {
        std::fs::metadata(path).map(|md| devnum(md.dev()))
    }

    fn devnum(dev: u64) -> DevNum {
        DevNum { major: libc::major(dev), minor: libc::minor(dev) }
    }

    /// `ioctl(fd, BLKROGET)`: whether the kernel marks the device read-only.
    pub(crate) fn read_only(file: &File) -> io::Result<bool> {
        let mut ro: libc::c_int = 0;
        // SAFETY: BLKROGET writes exactly one `int` through its argument, which points at `ro`, a live
        // local that nothing else aliases; the descriptor is owned by `file` and open for the call.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKROGET, &mut ro as *mut libc::c_int) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(ro != 0)
    }

    /// `ioctl(fd, BLKPBSZGET)`: the physical block size (larger than the logical one on 512e disks).
    pub(crate) fn physical_block_size(file: &File) -> io::Result<u32> {
        let mut pbs: libc::c_uint = 0;
        // SAFETY: BLKPBSZGET writes exactly one `unsigned int` through its argument, which points at
        // `pbs`, a live local that nothing else aliases; the descriptor is open for the call.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKPBSZGET, &mut pbs as *mut libc::c_uint) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(pbs)
    }

    /// Opens `path` for unbuffered writes: `O_WRONLY | O_DIRECT | O_EXCL` (never `O_CREAT`, so no
    /// file is ever created). On a block device `O_EXCL` claims it exclusively: the kernel refuses
    /// (`EBUSY`) a device that a mounted file system, an active swap area, device-mapper or md holds,
    /// and keeps anyone from mounting it while we write.
    pub(crate) fn open_write_exclusive(path: &Path) -> io::Result<File> {
        OpenOptions::new().write(true).custom_flags(libc::O_DIRECT | libc::O_EXCL).open(path)
    }

    /// One positional write of up to `buf.len()` bytes at `offset` (`pwrite(2)`); returns the count.
    pub(crate) fn write_at(file: &File, buf: &[u8], offset: u64) -> io::Result<usize> {
        #[cfg(test)]
        if let Some(e) = check_write(file, offset) {
            return Err(e);
        }
        // pwrite(2) through std: safe, the buffer is a plain `&[u8]` borrowed for the call.
        file.write_at(buf, offset)
    }

    /// `fsync(2)`: on a block device, also flushes the device's volatile write cache.
    pub(crate) fn sync(file: &File) -> io::Result<()> {
        file.sync_all()
    }

    /// (device, inode, offset, errno) of writes that must fail.
    #[cfg(test)]
    static WRITE_FAULTS: std::sync::Mutex<Vec<(u64, u64, u64, i32)>> = std::sync::Mutex::new(Vec::new());

    /// Makes every write of the file at `path` starting at `offset` fail with `errno`.
    #[cfg(test)]
    pub(crate) fn fail_write(path: &Path, offset: u64, errno: i32) {
        let md = std::fs::metadata(path).expect("stat fault target");
        WRITE_FAULTS.lock().unwrap_or_else(|e| e.into_inner()).push((md.dev(), md.ino(), offset, errno));
    }

    #[cfg(test)]
    fn check_write(file: &File, offset: u64) -> Option<io::Error> {
        let faults = WRITE_FAULTS.lock().unwrap_or_else(|e| e.into_inner());
        if faults.is_empty() {
            return None;
        }
        let md = file.metadata().ok()?;
        let hit = faults.iter().find(|f| (f.0, f.1, f.2) == (md.dev(), md.ino(), offset));
        hit.map(|f| io::Error::from_raw_os_error(f.3))
    }

    #[cfg(test)]
    mod tests {
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        #[test]
        fn raw_ioctl_numbers_match_linux_uapi() {
            // include/uapi/linux/fs.h: BLKROGET _IO(0x12,94), BLKPBSZGET _IO(0x12,123).
            assert_eq!(super::BLKROGET, 0x125e as libc::Ioctl);
            assert_eq!(super::BLKPBSZGET, 0x127b as libc::Ioctl);
        }

        #[test]
        fn device_numbers_and_file_kinds() {
            let dir = tempfile::tempdir().unwrap();
            let f = dir.path().join("f");
            std::fs::write(&f, b"x").unwrap();
            assert_eq!(super::stat_block_device(&f).unwrap(), Err("regular file"));
            assert_eq!(super::stat_block_device(dir.path()).unwrap(), Err("directory"));
            let null = std::path::Path::new("/dev/null");
            assert_eq!(super::stat_block_device(null).unwrap(), Err("character device"));
            assert_eq!(super::fstat_block(&std::fs::File::open(&f).unwrap()).unwrap(), Err("regular file"));
            assert!(super::stat_block_device(&dir.path().join("missing")).is_err());
            let root = super::device_of(std::path::Path::new("/")).unwrap();
            assert_eq!(root, super::device_of(std::path::Path::new("/.")).unwrap());
            // Not a block device: BLKROGET fails (ENOTTY) instead of answering.
            assert!(super::read_only(&std::fs::File::open(&f).unwrap()).is_err());
        }

        #[test]
        fn open_write_exclusive_never_creates() {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("absent");
            let e = super::open_write_exclusive(&p).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
            assert!(!p.exists());
        }

        #[test]
        fn write_fault_twin() {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("w");
            std::fs::write(&p, [0u8; 8192]).unwrap();
            let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
            super::fail_write(&p, 4096, libc::EIO);
            assert_eq!(super::write_at(&f, &[1; 16], 4096).unwrap_err().raw_os_error(), Some(libc::EIO));
            assert_eq!(super::write_at(&f, &[1; 16], 0).unwrap(), 16);
            super::sync(&f).unwrap();
        }
    }
}
