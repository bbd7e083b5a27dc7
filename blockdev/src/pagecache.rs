//! The page cache of one file or device, as the bench sees it: drop it before a cold point and
//! measure what stayed (Linux: `posix_fadvise(DONTNEED)`, `mincore(2)`, `fstatfs(2)`; elsewhere
//! dropping does nothing and nothing can be measured). The system calls are in `sys/host_unix.rs`.

use std::io;
use std::path::Path;

/// Evicts the clean page-cache pages of `path` (`posix_fadvise(POSIX_FADV_DONTNEED)` over the whole
/// file or device). The caller must not write it meanwhile, so every page is clean.
///
/// Reads still in flight are caught too: `DONTNEED` skips a page locked for a read in progress,
/// and that page lands in the cache *after* the drop, its bytes charged (in `/proc/self/io`) to
/// whatever started the read. Opening a session reads the superblock and index with buffered I/O
/// whose readahead can still be reading the image when the drop comes: on a 136 KiB image, a cold
/// open left 64 KiB resident 200 ms after a drop that `mincore` had just seen take everything, so
/// the first `bench cache` point read half the image from memory. `mincore` cannot see such pages
/// until their read completes (it reports only up-to-date pages), so for a regular file the drop
/// is repeated while pages reappear: `mincore` is checked every 20 ms, and the drop ends after 3
/// quiet checks in a row (at most 50 checks, 1 s). On tmpfs or ramfs, whose pages are the file and
/// cannot be dropped, nothing is waited for; the caller reports what stayed resident.
///
/// # Errors
/// The `open` or `posix_fadvise` error (Linux); never elsewhere.
#[cfg(target_os = "linux")]
pub fn drop(path: &Path) -> io::Result<()> {
    use crate::sys::host::{fadvise_dontneed, resident_pages};
    let f = std::fs::File::open(path)?;
    fadvise_dontneed(&f)?;
    let any_resident = || resident_pages(&f).is_some_and(|p| p.contains(&true));
    if resident_pages(&f).is_none() || in_memory_fs(&f) {
        return Ok(()); // a device (no mincore here), or tmpfs/ramfs, whose pages cannot be dropped
    }
    let mut quiet = 0;
    for _ in 0..50 {
        std::thread::sleep(std::time::Duration::from_millis(20));
        if any_resident() {
            fadvise_dontneed(&f)?;
            quiet = 0;
        } else {
            quiet += 1;
            if quiet == 3 {
                break;
            }
        }
    }
    Ok(())
}

/// Page-cache dropping needs Linux's `posix_fadvise`; elsewhere nothing is done.
///
/// # Errors
/// Never.
#[cfg(not(target_os = "linux"))]
pub fn drop(_path: &Path) -> io::Result<()> {
    Ok(())
}

/// Fraction of a regular file's pages in the page cache (`mincore(2)` over a read-only mapping:
/// a page whose read is still in flight does not count), or `None` for anything else, an empty
/// file, on failure, or off Linux.
pub fn resident_fraction(path: &Path) -> Option<f64> {
    #[cfg(target_os = "linux")]
    {
        let f = std::fs::File::open(path).ok()?;
        let present = crate::sys::host::resident_pages(&f)?;
        Some(present.iter().filter(|&&p| p).count() as f64 / present.len() as f64)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        None
    }
}

/// Whether `f` lives on tmpfs or ramfs (`fstatfs` `f_type`: `TMPFS_MAGIC`, `RAMFS_MAGIC` of
/// `linux/magic.h`), whose pages are the file itself.
#[cfg(target_os = "linux")]
fn in_memory_fs(f: &std::fs::File) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    crate::sys::host::fs_magic(f).is_some_and(|t| t == TMPFS_MAGIC || t == RAMFS_MAGIC)
}
