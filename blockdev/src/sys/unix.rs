//! Unix: `open(O_DIRECT)`, `pread`, `fstat`, `statx(STATX_DIOALIGN)` and the block-device ioctls.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::Path;

use super::{Probe, TargetKind};
use crate::align::StatxDio;
use crate::error::{Error, Result};

/// The `O_DIRECT` open flag where the platform has one.
#[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
const O_DIRECT: Option<libc::c_int> = Some(libc::O_DIRECT);
#[cfg(not(any(target_os = "linux", target_os = "android", target_os = "freebsd")))]
const O_DIRECT: Option<libc::c_int> = None;

/// `BLKSSZGET`: the logical block size of a block device, as an `int` (include/uapi/linux/fs.h).
#[cfg(target_os = "linux")]
pub(crate) const BLKSSZGET: libc::Ioctl = libc::BLKSSZGET;
/// `BLKGETSIZE64`: the size of a block device in bytes, as a `u64` (`_IOR(0x12, 114, size_t)`).
#[cfg(target_os = "linux")]
pub(crate) const BLKGETSIZE64: libc::Ioctl = libc::_IOR::<libc::size_t>(0x12, 114);

pub(super) fn open(path: &Path, direct: bool) -> Result<File> {
    // stat before open: opening a FIFO blocks until a writer appears, and O_DIRECT on a directory or a
    // character device fails with an EINVAL that would read as "O_DIRECT not supported". A stat that
    // fails (a missing path) is left to open to report; probe checks the opened file again.
    if let Some(kind) = std::fs::metadata(path).ok().and_then(|md| unsupported_kind(md.file_type())) {
        return Err(Error::UnsupportedTarget { path: path.into(), kind });
    }
    let mut opts = OpenOptions::new();
    opts.read(true);
    if direct {
        let Some(flag) = O_DIRECT else {
            return Err(Error::DirectUnsupported {
                path: path.into(),
                reason: "this platform has no O_DIRECT".into(),
                cause: None,
            });
        };
        opts.custom_flags(flag);
    }
    opts.open(path).map_err(|cause| {
        if direct && cause.raw_os_error() == Some(libc::EINVAL) {
            Error::DirectUnsupported {
                path: path.into(),
                reason: "open with O_DIRECT failed".into(),
                cause: Some(cause),
            }
        } else {
            Error::Open { path: path.into(), mode: if direct { "direct" } else { "buffered" }, cause }
        }
    })
}

pub(super) fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    // pread(2) through std: safe, and the buffer is a plain `&mut [u8]` we own for the call.
    file.read_at(buf, offset)
}

pub(super) fn probe(file: &File, path: &Path, direct: bool) -> Result<Probe> {
    let md = file.metadata().map_err(|cause| Error::Stat { path: path.into(), cause })?;
    let ft = md.file_type();
    let (kind, size, logical_block) = if ft.is_file() {
        (TargetKind::File, md.len(), None)
    } else if ft.is_block_device() {
        let size = block_device_size(file).map_err(|cause| Error::Ioctl {
            path: path.into(),
            request: "BLKGETSIZE64",
            cause,
        })?;
        let lbs = logical_block_size(file).map_err(|cause| Error::Ioctl {
            path: path.into(),
            request: "BLKSSZGET",
            cause,
        })?;
        (TargetKind::BlockDevice, size, lbs)
    } else {
        let kind = unsupported_kind(ft).unwrap_or("special file");
        return Err(Error::UnsupportedTarget { path: path.into(), kind });
    };
    let statx_dio = if direct {
        statx_dio(file).unwrap_or_else(|e| {
            tracing::debug!("{}: statx(STATX_DIOALIGN) unavailable ({e}); using fallbacks", path.display());
            None
        })
    } else {
        None
    };
    Ok(Probe { kind, size, statx_dio, logical_block })
}

/// What a file type is when it is neither a regular file nor a block device (the only targets an
/// engine reads), as [`Error::UnsupportedTarget`] names it; `None` for those two.
fn unsupported_kind(ft: std::fs::FileType) -> Option<&'static str> {
    Some(if ft.is_file() || ft.is_block_device() {
        return None;
    } else if ft.is_dir() {
        "directory"
    } else if ft.is_char_device() {
        "character device"
    } else if ft.is_fifo() {
        "FIFO"
    } else if ft.is_socket() {
        "socket"
    } else {
        "special file"
    })
}

/// `statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN)`: `None` when the kernel does not report it.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn statx_dio(file: &File) -> io::Result<Option<StatxDio>> {
    use std::os::fd::AsRawFd;
    // SAFETY: `libc::statx` is a C struct of integers (and integer arrays), for which all-zero bytes
    // are a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the descriptor is owned by `file` and open for the whole call; the path is a valid
    // NUL-terminated (empty) string, which with AT_EMPTY_PATH makes statx describe the descriptor;
    // `stx` is a live, writable `struct statx` that the kernel fills and nothing else aliases.
    let rc =
        unsafe { libc::statx(file.as_raw_fd(), c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, &mut stx) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return Ok(None);
    }
    Ok(Some(StatxDio { mem: stx.stx_dio_mem_align, offset: stx.stx_dio_offset_align }))
}

/// No `statx` binding for this platform: the caller falls back.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn statx_dio(_file: &File) -> io::Result<Option<StatxDio>> {
    Ok(None)
}

/// `ioctl(fd, BLKGETSIZE64)`: the device size in bytes.
#[cfg(target_os = "linux")]
fn block_device_size(file: &File) -> io::Result<u64> {
    use std::os::fd::AsRawFd;
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes exactly one u64 through its argument, which points at `size`, a
    // live local that nothing else aliases; the descriptor is open for the call.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

/// Other unix: the size is where a seek to the end lands (works for disk devices on the BSDs).
#[cfg(not(target_os = "linux"))]
fn block_device_size(file: &File) -> io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    (&*file).seek(SeekFrom::End(0))
}

/// `ioctl(fd, BLKSSZGET)`: the logical block size (the `O_DIRECT` granularity of older kernels).
#[cfg(target_os = "linux")]
fn logical_block_size(file: &File) -> io::Result<Option<u32>> {
    use std::os::fd::AsRawFd;
    let mut lbs: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes exactly one `int` through its argument, which points at `lbs`, a live
    // local that nothing else aliases; the descriptor is open for the call.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKSSZGET, &mut lbs as *mut libc::c_int) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(u32::try_from(lbs).ok())
}

/// Other unix: unknown; the caller falls back to 4096.
#[cfg(not(target_os = "linux"))]
fn logical_block_size(_file: &File) -> io::Result<Option<u32>> {
    Ok(None)
}
