//! Picchio's kernel-path storage engines: the ways an expert image is read through the operating
//! system's block layer, each an implementation of [`picchio_core::IoQueue`].
//!
//! * [`PsyncQueue`] (tiers S1/S2): a pool of worker threads doing positional reads (`pread`) on one
//!   file or block device, through the page cache (`--buffered`) or around it (`O_DIRECT`, `--direct`),
//!   straight into the caller's block-aligned buffers.
//! * `UringQueue` (tier S3, Linux only): one io_uring instance reading at up to `qd` reads in flight
//!   (`--io uring --qd N`), buffered or `O_DIRECT`, with optional SQPOLL, IOPOLL and a registered file.
//! * `IocpQueue` (Windows only): overlapped, unbuffered `ReadFile`s on one handle completed through
//!   an I/O completion port, up to `qd` in flight (`PsyncQueue` works on Windows too, with
//!   `FILE_FLAG_NO_BUFFERING` for `--direct`).
//! * [`host`]: the host's view of its block devices — mounted, partitions, holders, swap, the
//!   device(s) behind `/` — for the write refusals of `raw`, `picchio nvme` and bench records.
//! * `raw` (tier S4, Linux only): block devices addressed by LBA — measuring and inspecting them,
//!   the refusals before writing one and the `O_DIRECT` device writer (a reader of the image adds
//!   its base to every offset: [`picchio_core::FlatStoreOptions::base_offset`]).
//!
//! Engines know nothing of models: they read `(offset, len)` into a buffer and report completions.
//! Every system call lives in the private `sys` module (one file per OS); opening errors are
//! [`Error`], and a failed read completes with a [`std::io::Error`] wrapping an [`Error`] that names
//! the path, offset and length.
#![deny(missing_docs)]

mod align;
mod error;
pub mod host;
#[cfg(windows)]
mod iocp;
pub mod mountinfo;
pub mod pagecache;
mod psync;
#[cfg(target_os = "linux")]
pub mod raw;
mod sys;
#[cfg(test)]
mod test_file;
#[cfg(target_os = "linux")]
mod uring;

pub use align::DioAlign;
pub use error::{Error, Result};
#[cfg(windows)]
pub use iocp::{IocpOptions, IocpQueue};
pub use psync::{PsyncOptions, PsyncQueue, DEFAULT_THREADS, MAX_THREADS, MIN_REPORTED_BLOCK_SIZE};
#[cfg(target_os = "linux")]
pub use uring::{UringOptions, UringQueue, DEFAULT_QD, MAX_QD};
