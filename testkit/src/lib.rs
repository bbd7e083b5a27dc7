//! Picchio's shared test kit (a dev-dependency, never published): what the integration tests of
//! several packages need, once.
//!
//! - [`scratch`]: temporary directories on the target directory's file system ([`scratch!`]).
//! - [`loopdev`] (Linux): loop devices of a given logical block size and mounts, undone on drop.
//! - [`bin`]: running a binary with its output echoed to the test log, with a bounded wait.
//! - [`conformance`]: the `IoQueue` conformance suite every engine runs.
//! - [`image`]: seeded `.picchioflat` images.
//! - [`global_lock`] and [`wait_until`]: a lock for tests that take a machine-wide resource, and a
//!   bounded wait on a condition instead of a fixed sleep.
//!
//! Seeded pseudo-random data comes from [`picchio_core::rng`], not from here.

pub mod bin;
pub mod conformance;
pub mod image;
#[cfg(target_os = "linux")]
pub mod loopdev;
pub mod scratch;

use std::time::{Duration, Instant};

/// Polls `cond` (every 10 ms) until it holds or `limit` has passed; returns whether it held. For
/// waiting on something another thread or the kernel does (a device node appearing, a child
/// process writing its first line): pick `limit` generously — it bounds a hang, it is not a timing
/// assertion.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    loop {
        if cond() {
            return true;
        }
        if t0.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A machine-wide lock named `name`, held until the guard drops: an exclusive `flock` on
/// `<temp dir>/picchio-test-<name>.lock` (std's [`std::fs::File::lock`]). For tests that take or
/// observe a global resource (the page cache via `drop_caches`, the hugepage pool): tests in one
/// binary run in parallel threads and the QEMU/Windows CI steps run beside others, so such tests
/// serialise on the same name across threads and processes.
///
/// # Panics
/// When the lock file cannot be created or locked.
pub fn global_lock(name: &str) -> GlobalLock {
    let path = std::env::temp_dir().join(format!("picchio-test-{name}.lock"));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("lock file {}: {e}", path.display()));
    file.lock().unwrap_or_else(|e| panic!("locking {}: {e}", path.display()));
    GlobalLock { _file: file }
}

/// The guard of [`global_lock`]; the lock is released when it drops (the file is closed).
#[derive(Debug)]
pub struct GlobalLock {
    _file: std::fs::File,
}
