//! Opening a `.picchioflat` image through a [`PsyncQueue`] in one call.

use std::path::Path;

use picchio_core::{FlatStore, FlatStoreOptions, StoreExpect};

use crate::error::Result;
use crate::psync::{PsyncOptions, PsyncQueue};

/// Opens the image at `path` (a file, or a block device holding the image from byte 0) with a
/// [`PsyncQueue`], and reads and checks its superblock and index with [`FlatStore::open`], using the
/// whole target as the image (`image_len` = [`PsyncQueue::len`]).
///
/// `verify` checks every payload's hash after reading it (`--verify`); `expect` checks the store
/// against the model using it. The store is named by `path` in messages.
///
/// # Errors
/// The [`PsyncQueue::open`] errors, and [`crate::Error::Store`] for whole-store faults (bad magic,
/// version, dimensions, index hash, truncated index). Faults in single entries only reject them:
/// loading such an expert reports a [`picchio_core::LoadError`].
pub fn open_store(
    path: &Path,
    opts: PsyncOptions,
    verify: bool,
    expect: Option<StoreExpect>,
) -> Result<FlatStore<PsyncQueue>> {
    let queue = PsyncQueue::open(path, opts)?;
    let image_len = queue.len();
    let store_opts = FlatStoreOptions { base_offset: 0, image_len, verify, expect, recheck_every: 0 };
    Ok(FlatStore::open(queue, path.display().to_string(), store_opts)?)
}
