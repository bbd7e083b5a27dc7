//! The runtime's operating-system calls that need `unsafe`: one small function per call, each with
//! its `// SAFETY:` note and a typed error. Outside this module and the SIMD kernels
//! ([`crate::kernels`]) the runtime has no `unsafe`.

use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use crate::error::{Error, Result};

/// Maps `file` (opened from `path`) read-only and private, for the zero-copy tensor views of
/// [`crate::model::safetensors::TensorStore`].
///
/// The contract, as for every mmap-based model loader: the file is not truncated or modified while
/// the map lives (a checkpoint is not rewritten under a loaded model); if it were, reads of the
/// changed pages would see the new bytes, or fault with SIGBUS past a new end.
///
/// # Errors
/// [`Error::Io`] naming `path` and `mmap`, with the OS error as `source()`.
pub(crate) fn map_readonly(path: &Path, file: &File) -> Result<Mmap> {
    // SAFETY: the map is read-only and private to this process, so no Rust reference we hand out
    // aliases memory we write; the file is not modified while the map lives (the contract above),
    // so the bytes behind the returned slices do not change.
    unsafe { Mmap::map(file) }.map_err(Error::io(path, "mmap"))
}

/// Drops the pages of `map[range]` from this process's resident set (`madvise(MADV_DONTNEED)`; the
/// range is widened to whole pages by the kernel and by memmap2, which rounds its start down): the
/// bytes stay in the page cache, and the next read of them faults them back in, unchanged. What
/// keeps peak RSS bounded while `pack` copies every expert out of the mapped shards and after a
/// model's dense tensors were copied out of theirs (an mmap'ed page counts in RSS while it is
/// mapped). Best effort: a failure (which the kernel reports only for a bad range) is logged and
/// changes nothing but the resident set. A no-op off Unix.
pub(crate) fn drop_mapped_pages(path: &Path, map: &Mmap, range: std::ops::Range<usize>) {
    if range.is_empty() {
        return;
    }
    #[cfg(unix)]
    {
        // SAFETY: `map` is a read-only private file mapping ([`map_readonly`]) that nothing ever
        // writes, so none of its pages was copied on write: MADV_DONTNEED only removes page-table
        // entries, and every later access (through any `&[u8]` we handed out) faults the same file
        // bytes back in, which do not change while the map lives (the contract of
        // [`map_readonly`]). The range is within the map (memmap2 checks it).
        let r = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, range.start, range.len()) };
        if let Err(e) = r {
            tracing::debug!("{}: madvise(DONTNEED) of bytes {range:?}: {e}", path.display());
        }
    }
    #[cfg(not(unix))]
    let _ = (path, map, range);
}

/// Restores the default SIGPIPE action (terminate), which the Rust runtime replaces with "ignore", so
/// that `picchio verify IMG | head` ends quietly when the reader goes away, like other Unix tools,
/// instead of panicking in `println!` with "failed printing to stdout". Call it first thing in
/// `main`, before any other thread exists. A no-op off Unix.
pub fn restore_default_sigpipe() {
    #[cfg(unix)]
    // SAFETY: `signal` only sets the process's disposition for SIGPIPE to the default; it touches no
    // memory of ours. Called before other threads exist, it races with no other signal setup, and no
    // Rust code relies on SIGPIPE being ignored (a write to a closed pipe now ends the process instead
    // of returning EPIPE).
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
