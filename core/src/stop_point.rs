//! Test hooks for crash and fault tests: a process that stops itself (`SIGSTOP`) at a point named by
//! a count, so a test can act at exactly that point instead of after a sleep.
//!
//! - `PICCHIO_STOP_AFTER_BYTES=N` ([`BYTES_ENV`]): the writers (`pack`, `synth`, `convert`,
//!   `transcode`, the synthetic-model writer) stop once they have handed `N` bytes of output to the
//!   kernel in all ([`wrote`] is called after each write into a temporary output; a buffered
//!   writer counts below its buffer, through [`Counted`]).
//! - `PICCHIO_STOP_AFTER_LOADS=N` ([`LOADS_ENV`]): a reader stops after the `N`th batch of expert
//!   reads a [`crate::FlatStore`] completed ([`loaded`]).
//!
//! The test waits for the stop (`waitpid(WUNTRACED)`), then kills the process with `SIGKILL` at
//! exactly that point, or changes the world under it (fills its file system, rewrites its image) and
//! lets it go on with `SIGCONT`. The same count stops the process at the same point on every machine.
//!
//! The same idea as the failpoints of TiKV's `fail` crate or FoundationDB's buggify, reduced to the
//! points these tests need. The points are compiled only with the `test-hooks` cargo feature, which
//! only the tests that run the binary enable (cli's `[dev-dependencies]`): without it [`wrote`] and
//! [`loaded`] are empty and a release build reads neither variable. With it but without the
//! variables a call is one load of a cached `u64::MAX` and a compare. Off Unix the variables are
//! ignored. The variables' names are public either way, for the tests.

#[cfg(feature = "test-hooks")]
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
#[cfg(feature = "test-hooks")]
use std::sync::OnceLock;

/// The writers' variable: a decimal byte count.
pub const BYTES_ENV: &str = "PICCHIO_STOP_AFTER_BYTES";
/// The readers' variable: a decimal count of load batches.
pub const LOADS_ENV: &str = "PICCHIO_STOP_AFTER_LOADS";

/// One counted point.
#[cfg(feature = "test-hooks")]
struct Point {
    env: &'static str,
    unit: &'static str,
    limit: OnceLock<u64>,
    count: AtomicU64,
    stopped: AtomicBool,
}

#[cfg(feature = "test-hooks")]
impl Point {
    const fn new(env: &'static str, unit: &'static str) -> Point {
        Point { env, unit, limit: OnceLock::new(), count: AtomicU64::new(0), stopped: AtomicBool::new(false) }
    }

    fn add(&self, n: u64) {
        let limit = *self
            .limit
            .get_or_init(|| std::env::var(self.env).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(u64::MAX));
        if limit == u64::MAX {
            return;
        }
        let after = self.count.fetch_add(n, Ordering::Relaxed).saturating_add(n);
        // The call that reaches the count stops the process, once.
        if after >= limit && !self.stopped.swap(true, Ordering::Relaxed) {
            eprintln!("picchio: {}={limit}: stopping (SIGSTOP) after {after} {}", self.env, self.unit);
            stop_self();
        }
    }
}

#[cfg(feature = "test-hooks")]
static BYTES: Point = Point::new(BYTES_ENV, "bytes written");
#[cfg(feature = "test-hooks")]
static LOADS: Point = Point::new(LOADS_ENV, "load batches");

/// Records that a writer handed `bytes` more bytes of output to the kernel; stops the process the
/// first time the total reaches [`BYTES_ENV`]'s count. Call it after each write of a temporary
/// output (an image's payloads, a shard's tensors, a copied file). Empty without `test-hooks`.
#[inline(always)]
pub fn wrote(bytes: u64) {
    #[cfg(feature = "test-hooks")]
    BYTES.add(bytes);
    #[cfg(not(feature = "test-hooks"))]
    let _ = bytes;
}

/// A writer that reports each write to the kernel to [`wrote`]: put it under a `BufWriter`
/// (`BufWriter<Counted<File>>`), so the count is of bytes the kernel has, not bytes waiting in
/// the buffer, and a process stopped at `N` bytes has at least `N` bytes in its output file.
pub struct Counted<W>(pub W);

impl<W> Counted<W> {
    /// The wrapped writer.
    pub fn into_inner(self) -> W {
        self.0
    }
}

impl<W: std::io::Write> std::io::Write for Counted<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.0.write(buf)?;
        wrote(n as u64);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

impl<W: std::io::Seek> std::io::Seek for Counted<W> {
    fn seek(&mut self, pos: std::io::SeekFrom) -> std::io::Result<u64> {
        self.0.seek(pos)
    }
}

/// Records that a [`crate::FlatStore`] completed a batch of expert reads; stops the process after
/// the [`LOADS_ENV`]th. Empty without `test-hooks`.
#[inline(always)]
pub fn loaded() {
    #[cfg(feature = "test-hooks")]
    LOADS.add(1);
}

#[cfg(all(unix, feature = "test-hooks"))]
fn stop_self() {
    // SAFETY: `kill` on our own pid has no memory-safety preconditions; SIGSTOP cannot be caught, so
    // no handler of ours runs. All threads stop until SIGCONT (or SIGKILL).
    unsafe {
        libc::kill(libc::getpid(), libc::SIGSTOP);
    }
}

#[cfg(all(not(unix), feature = "test-hooks"))]
fn stop_self() {}
