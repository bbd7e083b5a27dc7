//! Windows: every Win32 call of the crate.
//!
//! * `PsyncQueue`: `CreateFile` through std (with `FILE_FLAG_NO_BUFFERING` for direct reads),
//!   positional `ReadFile` through std, and the sector-size probes that decide the unbuffered
//!   alignment: `GetFileInformationByHandleEx(FileStorageInfo)` (per file, Windows 8+), then
//!   `GetVolumePathNameW` + `GetDiskFreeSpaceW` (the volume's bytes per sector), else the caller's
//!   4096-byte fallback.
//! * `IocpQueue`: a handle opened with `FILE_FLAG_OVERLAPPED | FILE_FLAG_NO_BUFFERING`, its I/O
//!   completion port (`CreateIoCompletionPort`), overlapped `ReadFile`, `GetQueuedCompletionStatusEx`,
//!   `GetOverlappedResult` and `CancelIoEx`.
//!
//! Not handled: raw disks (`\\.\PhysicalDriveN`, `IOCTL_DISK_GET_LENGTH_INFO`); only regular files
//! are accepted.

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::windows::ffi::OsStrExt;
use std::os::windows::fs::{FileExt, OpenOptionsExt};
use std::os::windows::io::{AsRawHandle, FromRawHandle, OwnedHandle};
use std::path::Path;
use std::time::Duration;

use windows_sys::Win32::Foundation::{
    ERROR_HANDLE_EOF, ERROR_IO_PENDING, ERROR_NOT_FOUND, HANDLE, MAX_PATH, WAIT_TIMEOUT,
};
use windows_sys::Win32::Storage::FileSystem::{
    FileStorageInfo, GetDiskFreeSpaceW, GetFileInformationByHandleEx, GetVolumePathNameW, ReadFile,
    FILE_FLAG_NO_BUFFERING, FILE_FLAG_OVERLAPPED, FILE_STORAGE_INFO,
};
use windows_sys::Win32::System::IO::{
    CancelIoEx, CreateIoCompletionPort, GetOverlappedResult, GetQueuedCompletionStatusEx, OVERLAPPED, OVERLAPPED_0,
    OVERLAPPED_0_0, OVERLAPPED_ENTRY,
};

use super::{Probe, TargetKind};
use crate::align::StatxDio;
use crate::error::{Error, Result};

/// `INFINITE` (winbase.h): wait without a time limit.
const INFINITE: u32 = u32::MAX;

/// Completions taken from the port per `GetQueuedCompletionStatusEx` call.
pub(crate) const DEQUEUE_BATCH: usize = 64;

fn raw(file: &File) -> HANDLE {
    file.as_raw_handle()
}

fn last_error() -> io::Error {
    io::Error::last_os_error()
}

fn is(e: &io::Error, code: u32) -> bool {
    e.raw_os_error() == i32::try_from(code).ok()
}

/// NUL-terminated UTF-16 for a `PCWSTR` argument.
fn wide(s: &OsStr) -> Vec<u16> {
    s.encode_wide().chain(std::iter::once(0)).collect()
}

pub(super) fn open(path: &Path, direct: bool) -> Result<File> {
    let mut opts = OpenOptions::new();
    opts.read(true);
    if direct {
        opts.custom_flags(FILE_FLAG_NO_BUFFERING);
    }
    opts.open(path).map_err(|cause| open_error(path, if direct { "direct" } else { "buffered" }, cause))
}

/// `CreateFile` refuses a directory (access denied) unless asked for backup semantics: say what the
/// path is rather than reporting a permission problem.
fn open_error(path: &Path, mode: &'static str, cause: io::Error) -> Error {
    if std::fs::metadata(path).is_ok_and(|md| md.is_dir()) {
        Error::UnsupportedTarget { path: path.into(), kind: "directory" }
    } else {
        Error::Open { path: path.into(), mode, cause }
    }
}

pub(super) fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    // ReadFile with an OVERLAPPED offset on a synchronous handle: positional, safe to call from
    // several threads (the shared file pointer it also moves is never used by this crate).
    file.seek_read(buf, offset)
}

pub(super) fn probe(file: &File, path: &Path, direct: bool) -> Result<Probe> {
    let md = file.metadata().map_err(|cause| Error::Stat { path: path.into(), cause })?;
    if !md.is_file() {
        let kind = if md.is_dir() { "directory" } else { "special file" };
        return Err(Error::UnsupportedTarget { path: path.into(), kind });
    }
    let (statx_dio, logical_block) = if direct { sector_sizes(file, path) } else { (None, None) };
    Ok(Probe { kind: TargetKind::File, size: md.len(), statx_dio, logical_block })
}

/// What unbuffered reads of `file` must be aligned to, in the shape `align::choose` takes: the
/// per-file answer (offsets and lengths to the logical sector, buffer addresses to the physical
/// sector, as `FILE_FLAG_NO_BUFFERING` asks) or the volume's bytes per sector. `(None, None)` lets
/// the caller fall back to 4096.
fn sector_sizes(file: &File, path: &Path) -> (Option<StatxDio>, Option<u32>) {
    match storage_info(file) {
        Ok(si) if si.LogicalBytesPerSector > 0 => {
            let mem = si.LogicalBytesPerSector.max(si.PhysicalBytesPerSectorForPerformance);
            return (Some(StatxDio { mem, offset: si.LogicalBytesPerSector }), None);
        }
        Ok(_) => tracing::debug!("{}: FileStorageInfo reports no sector size", path.display()),
        Err(e) => tracing::debug!("{}: GetFileInformationByHandleEx(FileStorageInfo): {e}", path.display()),
    }
    match volume_bytes_per_sector(path) {
        Ok(n) => (None, Some(n)),
        Err(e) => {
            tracing::debug!("{}: GetDiskFreeSpaceW: {e}; assuming 4096-byte sectors", path.display());
            (None, None)
        }
    }
}

/// `GetFileInformationByHandleEx(FileStorageInfo)`: the sector sizes of the device under `file`.
fn storage_info(file: &File) -> io::Result<FILE_STORAGE_INFO> {
    let mut info = FILE_STORAGE_INFO::default();
    let size = u32::try_from(std::mem::size_of::<FILE_STORAGE_INFO>()).expect("28 bytes");
    // SAFETY: the handle is owned by `file` and open for the call; `info` is a live, writable
    // FILE_STORAGE_INFO of exactly `size` bytes, the structure this class fills, aliased by nothing.
    let ok = unsafe { GetFileInformationByHandleEx(raw(file), FileStorageInfo, (&raw mut info).cast(), size) };
    if ok == 0 {
        return Err(last_error());
    }
    Ok(info)
}

/// `GetVolumePathNameW` then `GetDiskFreeSpaceW`: the bytes per sector of the volume holding `path`.
fn volume_bytes_per_sector(path: &Path) -> io::Result<u32> {
    let name = wide(std::path::absolute(path)?.as_os_str());
    // The volume path is a prefix of the path plus a backslash; MAX_PATH covers short names too.
    let mut root = vec![0u16; name.len().max(MAX_PATH as usize) + 2];
    let cap = u32::try_from(root.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidFilename))?;
    // SAFETY: `name` is NUL-terminated UTF-16; `root` is a live, writable buffer of `cap` u16s that
    // the call fills with a NUL-terminated string (or fails), aliased by nothing.
    if unsafe { GetVolumePathNameW(name.as_ptr(), root.as_mut_ptr(), cap) } == 0 {
        return Err(last_error());
    }
    let (mut sectors_per_cluster, mut bytes_per_sector, mut free, mut total) = (0u32, 0u32, 0u32, 0u32);
    // SAFETY: `root` holds the NUL-terminated volume path written above; the four out-pointers
    // point at live locals that nothing else aliases.
    let ok = unsafe {
        GetDiskFreeSpaceW(root.as_ptr(), &mut sectors_per_cluster, &mut bytes_per_sector, &mut free, &mut total)
    };
    if ok == 0 {
        return Err(last_error());
    }
    Ok(bytes_per_sector)
}

// ----------------------------------------------------------------------------- IOCP engine (iocp.rs)

/// Opens `path` for overlapped, unbuffered reads: `FILE_FLAG_OVERLAPPED | FILE_FLAG_NO_BUFFERING`.
pub(crate) fn open_overlapped(path: &Path) -> Result<File> {
    let mut opts = OpenOptions::new();
    opts.read(true).custom_flags(FILE_FLAG_OVERLAPPED | FILE_FLAG_NO_BUFFERING);
    opts.open(path).map_err(|cause| open_error(path, "overlapped direct", cause))
}

/// `CreateIoCompletionPort`: a new completion port with `file` associated (completion key 0), so
/// every overlapped operation on `file` posts its completion there.
pub(crate) fn completion_port(file: &File) -> io::Result<OwnedHandle> {
    // SAFETY: `file`'s handle is open for the call and associated with no port yet; a null
    // existing port asks for a new one. No memory is passed.
    let port = unsafe { CreateIoCompletionPort(raw(file), std::ptr::null_mut(), 0, 1) };
    if port.is_null() {
        return Err(last_error());
    }
    // SAFETY: `port` is a fresh, valid handle that nothing else owns; `OwnedHandle` closes it once.
    Ok(unsafe { OwnedHandle::from_raw_handle(port) })
}

/// How an overlapped read started.
#[derive(Debug)]
pub(crate) enum Started {
    /// Accepted (at once or pending): exactly one completion will be posted to the port.
    Queued,
    /// Refused at once: nothing was queued and the kernel holds no reference to the buffer or the
    /// `OVERLAPPED`. `ERROR_HANDLE_EOF` means the read starts at or past the end of the file.
    Failed(io::Error),
}

/// Overlapped `ReadFile` of `len` bytes at byte `offset` of `file` into `buf`. Writes `*ov` (the
/// offset split into `Offset`/`OffsetHigh`, no event) before the call.
///
/// A read that succeeds at once still posts its completion (the handle does not use
/// `FILE_SKIP_COMPLETION_PORT_ON_SUCCESS`), so both success and `ERROR_IO_PENDING` are
/// [`Started::Queued`].
///
/// # Safety
/// `buf` must be valid for writes of `len` bytes and `ov` must point at a writable `OVERLAPPED`.
/// If this returns [`Started::Queued`], both must stay at their addresses, and nothing may read,
/// write or free them, until this read's completion has been dequeued from the port `file` is
/// associated with: the kernel writes them asynchronously until then.
pub(crate) unsafe fn start_read(file: &File, buf: *mut u8, len: u32, offset: u64, ov: *mut OVERLAPPED) -> Started {
    #[cfg(test)]
    if let Some(e) = super::fault::check(file, offset) {
        return Started::Failed(e);
    }
    let at = OVERLAPPED_0_0 { Offset: offset as u32, OffsetHigh: (offset >> 32) as u32 };
    // SAFETY: the caller guarantees `ov` points at a writable OVERLAPPED that the kernel does not
    // own yet (no read is queued with it).
    unsafe { ov.write(OVERLAPPED { Anonymous: OVERLAPPED_0 { Anonymous: at }, ..OVERLAPPED::default() }) };
    // SAFETY: the handle is open for the call; the caller guarantees `buf` (for `len` bytes) and
    // `ov` stay valid and untouched until the completion is dequeued; the byte count pointer is
    // null, as ReadFile requires for overlapped reads.
    let ok = unsafe { ReadFile(raw(file), buf, len, std::ptr::null_mut(), ov) };
    if ok != 0 {
        return Started::Queued;
    }
    let e = last_error();
    if is(&e, ERROR_IO_PENDING) {
        Started::Queued
    } else {
        Started::Failed(e)
    }
}

/// `GetQueuedCompletionStatusEx`: waits up to `timeout` (`None`: without limit) for completions on
/// `port` and stores up to `entries.len()` of them; returns how many (0 when the time ran out).
pub(crate) fn dequeue(
    port: &OwnedHandle,
    entries: &mut [OVERLAPPED_ENTRY],
    timeout: Option<Duration>,
) -> io::Result<usize> {
    let ms = timeout.map_or(INFINITE, |t| u32::try_from(t.as_millis()).unwrap_or(INFINITE - 1));
    let count = u32::try_from(entries.len()).unwrap_or(u32::MAX);
    let mut removed = 0u32;
    // SAFETY: the port handle is open for the call; `entries` is a live, writable array of at least
    // `count` entries and `removed` a live local, both aliased by nothing; not alertable.
    let ok =
        unsafe { GetQueuedCompletionStatusEx(port.as_raw_handle(), entries.as_mut_ptr(), count, &mut removed, ms, 0) };
    if ok == 0 {
        let e = last_error();
        return if is(&e, WAIT_TIMEOUT) { Ok(0) } else { Err(e) };
    }
    Ok(removed as usize)
}

/// `GetOverlappedResult` of a read whose completion has been dequeued: the bytes it transferred, or
/// its error (`ERROR_HANDLE_EOF` at end of file, `ERROR_OPERATION_ABORTED` when cancelled).
pub(crate) fn overlapped_result(file: &File, ov: &OVERLAPPED) -> io::Result<u32> {
    let mut n = 0u32;
    // SAFETY: the handle is open; `ov` is a completed OVERLAPPED (its packet was dequeued), so the
    // kernel no longer writes it and, with bWait FALSE, the call only reads it; `n` is a live local.
    let ok = unsafe { GetOverlappedResult(raw(file), ov, &mut n, 0) };
    if ok == 0 {
        return Err(last_error());
    }
    Ok(n)
}

/// Whether a read error means "end of file" (`ERROR_HANDLE_EOF`): a short read, not a failure.
pub(crate) fn is_eof(e: &io::Error) -> bool {
    is(e, ERROR_HANDLE_EOF)
}

/// `CancelIoEx(file, NULL)`: asks the kernel to cancel every outstanding I/O on `file`, from any
/// thread. Each still posts its completion (`ERROR_OPERATION_ABORTED` if cancelled in time).
pub(crate) fn cancel_all(file: &File) -> io::Result<()> {
    // SAFETY: the handle is open for the call; a null OVERLAPPED means "all I/O on this handle" and
    // no memory is read or written.
    let ok = unsafe { CancelIoEx(raw(file), std::ptr::null()) };
    if ok == 0 {
        let e = last_error();
        // Nothing left to cancel: every read had already completed.
        return if is(&e, ERROR_NOT_FOUND) { Ok(()) } else { Err(e) };
    }
    Ok(())
}

/// The identity of an open file for the test fault twin: (volume serial number, file index).
#[cfg(test)]
pub(super) fn file_id(file: &File) -> io::Result<(u32, u64)> {
    use windows_sys::Win32::Storage::FileSystem::{GetFileInformationByHandle, BY_HANDLE_FILE_INFORMATION};
    // SAFETY: a C struct of integers and FILETIMEs (integers), for which all-zero bytes are valid.
    let mut info: BY_HANDLE_FILE_INFORMATION = unsafe { std::mem::zeroed() };
    // SAFETY: the handle is open for the call; `info` is a live, writable structure of the type the
    // call fills, aliased by nothing.
    if unsafe { GetFileInformationByHandle(raw(file), &mut info) } == 0 {
        return Err(last_error());
    }
    Ok((info.dwVolumeSerialNumber, (u64::from(info.nFileIndexHigh) << 32) | u64::from(info.nFileIndexLow)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(len: usize) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![7u8; len]).unwrap();
        (dir, path)
    }

    #[test]
    fn regular_file_probe_and_positional_read() {
        let (_d, path) = file_with(5000);
        let f = super::super::open(&path, false).unwrap();
        let p = super::super::probe(&f, &path, false).unwrap();
        assert_eq!((p.kind, p.size, p.statx_dio, p.logical_block), (TargetKind::File, 5000, None, None));
        let mut b = [0u8; 100];
        assert_eq!(super::super::read_at(&f, &mut b, 4950).unwrap(), 50);
        assert_eq!(super::super::read_at(&f, &mut b, 5000).unwrap(), 0);
    }

    #[test]
    fn direct_probe_reports_a_sector_size() {
        let (_d, path) = file_with(8192);
        let f = super::super::open(&path, true).unwrap();
        let p = super::super::probe(&f, &path, true).unwrap();
        eprintln!(
            "sector sizes of {}: statx_dio {:?}, logical_block {:?}",
            path.display(),
            p.statx_dio,
            p.logical_block
        );
        let sector = p.statx_dio.map(|s| s.offset).or(p.logical_block);
        if let Some(s) = sector {
            assert!(s.is_power_of_two() && (512..=65536).contains(&s), "{s}");
        }
        // The volume probe answers on its own as well.
        let n = volume_bytes_per_sector(&path).unwrap();
        assert!(n.is_power_of_two() && n >= 512, "{n}");
    }

    #[test]
    fn directory_and_missing_path_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let e = super::super::open(dir.path(), false).unwrap_err();
        assert!(matches!(e, Error::UnsupportedTarget { kind: "directory", .. }), "{e}");
        let missing = dir.path().join("missing");
        let e = super::super::open(&missing, true).unwrap_err();
        assert!(matches!(e, Error::Open { mode: "direct", .. }) && e.to_string().contains("missing"), "{e}");
        let e = open_overlapped(&missing).unwrap_err();
        assert!(e.to_string().contains("opening for overlapped direct reads"), "{e}");
    }

    #[test]
    fn eof_and_pending_codes() {
        assert!(is_eof(&io::Error::from_raw_os_error(38)));
        assert!(!is_eof(&io::Error::from_raw_os_error(997)));
        assert_eq!((ERROR_HANDLE_EOF, ERROR_IO_PENDING, ERROR_NOT_FOUND, WAIT_TIMEOUT), (38, 997, 1168, 258));
        assert_eq!((FILE_FLAG_NO_BUFFERING, FILE_FLAG_OVERLAPPED), (0x2000_0000, 0x4000_0000));
    }

    #[test]
    fn empty_port_times_out_with_no_entries() {
        let (_d, path) = file_with(4096);
        let f = open_overlapped(&path).unwrap();
        let port = completion_port(&f).unwrap();
        let mut entries = [OVERLAPPED_ENTRY::default(); 4];
        assert_eq!(dequeue(&port, &mut entries, Some(Duration::ZERO)).unwrap(), 0);
        cancel_all(&f).unwrap(); // nothing outstanding: ERROR_NOT_FOUND is success
    }
}
