//! Scratch directories on the target directory's file system: a real disk file system next to the
//! build (O_DIRECT usually works there, while `/tmp` may be a tmpfs), private to each test and
//! removed when dropped.

use std::path::Path;

/// A fresh directory under `base` (created if missing), removed when the guard drops.
///
/// # Panics
/// When `base` cannot be created or the directory cannot be made in it (the message names `base`).
pub fn dir_in(base: impl AsRef<Path>) -> tempfile::TempDir {
    let base = base.as_ref();
    std::fs::create_dir_all(base).unwrap_or_else(|e| panic!("scratch base {}: {e}", base.display()));
    tempfile::tempdir_in(base).unwrap_or_else(|e| panic!("scratch dir under {}: {e}", base.display()))
}

/// A fresh scratch directory under cargo's per-target temporary directory (`CARGO_TARGET_TMPDIR`,
/// which cargo sets for integration tests and benches of the calling package), removed when
/// dropped: `let dir = picchio_testkit::scratch!();`.
#[macro_export]
macro_rules! scratch {
    () => {
        $crate::scratch::dir_in(env!("CARGO_TARGET_TMPDIR"))
    };
}
