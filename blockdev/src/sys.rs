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
mod windows;
#[cfg(windows)]
use windows as imp;

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
    /// The `STATX_DIOALIGN` answer, when asked for (direct mode) and given.
    pub statx_dio: Option<StatxDio>,
    /// The logical block size of a block device (`BLKSSZGET`).
    pub logical_block: Option<u32>,
}

/// Opens `path` read-only, with `O_DIRECT` when `direct`.
///
/// # Errors
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

#[cfg(all(test, not(unix)))]
mod fault {
    pub(super) fn check(_: &std::fs::File, _: u64) -> Option<std::io::Error> {
        None
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
        let f = super::open(dir.path(), false).unwrap();
        let e = super::probe(&f, dir.path(), false).unwrap_err();
        assert!(matches!(e, crate::Error::UnsupportedTarget { kind: "directory", .. }), "{e}");
        let missing = dir.path().join("missing");
        let e = super::open(&missing, false).unwrap_err();
        assert!(matches!(e, crate::Error::Open { mode: "buffered", .. }), "{e}");
        assert!(e.to_string().contains("missing"), "{e}");
    }

    /// Both ioctls on a real block device: a 4 KiB-sector loop device (root only; skipped visibly).
    #[cfg(target_os = "linux")]
    #[test]
    fn block_device_ioctls_on_a_loop_device() {
        use std::process::Command;
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("disk.img");
        std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
        let out = Command::new("losetup")
            .args(["--find", "--show", "--read-only", "--sector-size", "4096"])
            .arg(&img)
            .output();
        let dev = match out {
            Ok(o) if o.status.success() => std::path::PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()),
            Ok(o) => {
                return eprintln!("SKIP block_device_ioctls_on_a_loop_device: {}", String::from_utf8_lossy(&o.stderr))
            }
            Err(e) => return eprintln!("SKIP block_device_ioctls_on_a_loop_device: cannot run losetup: {e}"),
        };
        let probed = super::open(&dev, false).and_then(|f| super::probe(&f, &dev, false));
        let _ = Command::new("losetup").arg("-d").arg(&dev).status();
        let p = probed.unwrap();
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
