//! Unix: the host queries of [`crate::host`] and [`crate::pagecache`] — `posix_fadvise`,
//! `mincore`, `fstatfs`, `statvfs`, `getrusage`, `uname`, `sysconf`. Each is one small function
//! with its `// SAFETY:` note; the public wrappers are safe.

use std::fs::File;
use std::io;
#[cfg(target_os = "linux")]
use std::os::fd::AsRawFd;
use std::path::Path;

/// `posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)`: evict the clean page-cache pages of the whole
/// file or device.
#[cfg(target_os = "linux")]
pub(crate) fn fadvise_dontneed(f: &File) -> io::Result<()> {
    // SAFETY: the descriptor is open for the duration of the call; fadvise only advises the kernel.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    match rc {
        0 => Ok(()),
        rc => Err(io::Error::from_raw_os_error(rc)),
    }
}

/// Which pages (of the system page size) of the regular file `f` are in the page cache
/// (`mincore(2)` over a read-only shared mapping: only up-to-date pages count), or `None` for
/// anything else, an empty file, or on failure.
#[cfg(target_os = "linux")]
pub(crate) fn resident_pages(f: &File) -> Option<Vec<bool>> {
    let md = f.metadata().ok()?;
    if !md.is_file() || md.len() == 0 {
        return None;
    }
    let len = usize::try_from(md.len()).ok()?;
    let page = page_size()?;
    // SAFETY: a new read-only shared mapping of `len` bytes of a file open for reading; the kernel
    // chooses the address. It is never dereferenced, only passed to mincore, and unmapped below.
    let addr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 0) };
    if addr == libc::MAP_FAILED {
        return None;
    }
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: `addr` is a live, page-aligned mapping of `len` bytes, and `vec` has one byte per page
    // of it, as mincore requires.
    let rc = unsafe { libc::mincore(addr, len, vec.as_mut_ptr()) };
    // SAFETY: `addr`/`len` are exactly the mapping made above, which nothing else refers to.
    unsafe { libc::munmap(addr, len) };
    (rc == 0).then(|| vec.iter().map(|&b| b & 1 == 1).collect())
}

/// `fstatfs(2)`'s `f_type` of the file system holding `f` (`linux/magic.h` numbers).
#[cfg(target_os = "linux")]
pub(crate) fn fs_magic(f: &File) -> Option<i64> {
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `st` is a writable statfs buffer and the descriptor is open for the call.
    let rc = unsafe { libc::fstatfs(f.as_raw_fd(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // `f_type` is i64 on x86-64 glibc but another width elsewhere (u32 on s390x, i32 on musl arm).
    #[allow(clippy::unnecessary_cast)]
    // SAFETY: fstatfs returned 0, so it filled `st`.
    let t = unsafe { st.assume_init() }.f_type as i64;
    Some(t)
}

/// Bytes available to an unprivileged writer on the file system holding `dir` (`statvfs(3)`:
/// `f_bavail × f_frsize`).
pub(crate) fn available_bytes(dir: &Path) -> io::Result<Option<u64>> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path that outlives the call, and `st` points to writable
    // memory of the size of `struct statvfs`, which `statvfs` fills completely on success.
    if unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it initialised `st`.
    let st = unsafe { st.assume_init() };
    #[allow(clippy::useless_conversion)] // the field widths differ between libcs
    Ok(Some(u64::from(st.f_bavail).saturating_mul(u64::from(st.f_frsize))))
}

/// `getrusage(RUSAGE_SELF)` user and system seconds.
pub(crate) fn cpu_times() -> Option<(f64, f64)> {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `ru` is a valid, writable `rusage`.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: getrusage returned 0, so it filled `ru` (and all-zero is a valid rusage anyway).
    let ru = unsafe { ru.assume_init() };
    let s = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    Some((s(ru.ru_utime), s(ru.ru_stime)))
}

/// `uname(2)`: sysname, release, version, machine.
pub(crate) fn uname() -> Option<[String; 4]> {
    let mut u = std::mem::MaybeUninit::<libc::utsname>::zeroed();
    // SAFETY: `u` is a valid, writable `utsname`; uname fills it with NUL-terminated strings.
    if unsafe { libc::uname(u.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: uname returned 0, so it filled `u` (all-zero arrays of c_char are valid too).
    let u = unsafe { u.assume_init() };
    let field = |f: &[libc::c_char]| {
        let bytes: Vec<u8> = f.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    Some([field(&u.sysname), field(&u.release), field(&u.version), field(&u.machine)])
}

/// `sysconf(_SC_NPROCESSORS_ONLN)`.
pub(crate) fn online_cpus() -> Option<usize> {
    // SAFETY: sysconf has no memory effects; it returns -1 on failure, handled below.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).ok().filter(|&n| n > 0)
}

/// `sysconf(_SC_PAGESIZE)`.
#[cfg(target_os = "linux")]
fn page_size() -> Option<usize> {
    // SAFETY: sysconf has no memory effects; it returns -1 on failure, handled below.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).ok().filter(|&p| p > 0)
}
