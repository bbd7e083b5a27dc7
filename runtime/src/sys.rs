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
