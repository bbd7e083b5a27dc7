//! Picchio's kernel-path storage engines: the ways an expert image is read through the operating
//! system's block layer, each an implementation of [`picchio_core::IoQueue`].
//!
//! * [`PsyncQueue`] (tiers S1/S2): a pool of worker threads doing positional reads (`pread`) on one
//!   file or block device, through the page cache (`--buffered`) or around it (`O_DIRECT`, `--direct`),
//!   straight into the caller's block-aligned buffers.
//! * [`open_store`]: a [`picchio_core::FlatStore`] served by a `PsyncQueue`, in one call.
//!
//! Engines know nothing of models: they read `(offset, len)` into a buffer and report completions.
//! Every system call lives in the private `sys` module (one file per OS); opening errors are
//! [`Error`], and a failed read completes with a [`std::io::Error`] wrapping an [`Error`] that names
//! the path, offset and length.
#![deny(missing_docs)]

mod align;
mod error;
mod psync;
mod store;
mod sys;

pub use align::DioAlign;
pub use error::{Error, Result};
pub use psync::{PsyncOptions, PsyncQueue, DEFAULT_THREADS, MIN_REPORTED_BLOCK_SIZE};
pub use store::open_store;
