//! [`PsyncQueue`]: the simplest engine. A pool of worker threads performs positional reads (`pread`)
//! on one shared file descriptor, buffered or unbuffered (`O_DIRECT`), straight into each request's
//! [`AlignedBuf`].
//!
//! ```text
//! submit ──(validate)──► job channel ──► worker 0..N: pread loop into req.buf ──► completion channel ──► reap
//!            └── refused requests complete at once (local queue) ─────────────────────────────────────┘
//! ```
//!
//! The buffer moves into the engine with its request and comes back with its completion, so no Rust
//! reference to it exists while the kernel writes it, and no `unsafe` is needed for the read itself.

use std::collections::VecDeque;
use std::fs::File;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use picchio_core::{AlignedBuf, Completion, IoQueue, ReadReq};

use crate::align::{self, DioAlign};
use crate::error::{Error, Result};
use crate::sys::{self, TargetKind};

/// Worker threads when `--io-threads` is not given.
pub const DEFAULT_THREADS: usize = 2;

/// The most worker threads a [`PsyncQueue`] starts (`--io-threads`, and `picchio bench`'s psync
/// engines with one thread per read in flight). Each worker is an OS thread with its own stack, so
/// an unbounded count exhausts the process's threads or memory (100 000 workers fail with "failed
/// to set up alternative stack guard page"); 256 reads in flight already saturate NVMe devices.
pub const MAX_THREADS: usize = 256;

/// The smallest value [`IoQueue::block_size`] reports, even for buffered reads (see
/// [`PsyncQueue`]'s documentation for why).
pub const MIN_REPORTED_BLOCK_SIZE: u32 = 512;

/// How to open a [`PsyncQueue`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PsyncOptions {
    /// Worker threads, each with at most one read in the kernel (`--io-threads`; 1 to
    /// [`MAX_THREADS`]).
    pub threads: usize,
    /// Unbuffered reads (`O_DIRECT`), bypassing the page cache (`--direct`, the default for flat
    /// stores); `false` reads through the page cache (`--buffered`).
    pub direct: bool,
}

impl Default for PsyncOptions {
    /// [`DEFAULT_THREADS`] threads, direct (as DESIGN.md makes `--direct` the default for flat stores).
    fn default() -> Self {
        PsyncOptions { threads: DEFAULT_THREADS, direct: true }
    }
}

impl PsyncOptions {
    /// Unbuffered (`O_DIRECT`) reads with `threads` workers.
    pub fn direct(threads: usize) -> Self {
        PsyncOptions { threads, direct: true }
    }

    /// Page-cache reads with `threads` workers.
    pub fn buffered(threads: usize) -> Self {
        PsyncOptions { threads, direct: false }
    }
}

/// What the workers share: the target and its measurements, read-only after open.
struct Shared {
    file: File,
    path: PathBuf,
    size: u64,
    align: DioAlign,
    direct: bool,
    /// Set by `Drop`: workers discard the jobs still queued instead of reading them.
    shutdown: AtomicBool,
}

/// A request on its way to a worker.
struct Job {
    req: ReadReq,
    submitted: Instant,
}

/// An [`IoQueue`] over a file or block device served by a pool of `pread` worker threads.
///
/// * Reads go straight into the request's buffer (no bounce buffer), looping on short reads until
///   `len` bytes or end of file; the count is reported as is (a read that runs past the end of the
///   target completes `Ok` with fewer bytes).
/// * Requests that cannot be performed complete with an [`std::io::Error`] wrapping an [`Error`]
///   naming the path, offset and length, and never panic: a request starting at or past the end
///   ([`Error::PastEnd`]), a `len` larger than the buffer ([`Error::BufferTooSmall`]), and in direct
///   mode an offset, length or buffer address that is not aligned ([`Error::Misaligned`]). Kernel
///   errors arrive as [`Error::Read`] with the OS error as source.
/// * `reap` blocks on a channel; completions arrive in any order, each with the wall time from
///   `submit` in `latency_ns`.
/// * Dropping the queue discards reads not yet started, waits for those in the kernel and joins the
///   workers; every buffer is freed.
///
/// # Block size
/// [`PsyncQueue::alignment`] is what the kernel truly requires: the direct-I/O alignment, or 1 for
/// buffered reads (which accept any offset, length and address). [`IoQueue::block_size`] reports
/// that but never less than [`MIN_REPORTED_BLOCK_SIZE`] (512): callers size and align buffers and
/// requests from it, and a value of 1 would let code that works on a buffered queue fail as soon as
/// the same requests go to a direct, io_uring or NVMe queue. Reporting 512 costs nothing (expert reads
/// are 4096-aligned anyway) and keeps every engine's contract the same; the buffered queue still
/// accepts unaligned requests rather than refusing them.
pub struct PsyncQueue {
    shared: Arc<Shared>,
    kind: TargetKind,
    threads: usize,
    /// `None` only during `Drop`.
    jobs: Option<Sender<Job>>,
    done: Receiver<Completion>,
    /// Requests refused at submit, completed without reaching a worker.
    refused: VecDeque<Completion>,
    workers: Vec<JoinHandle<()>>,
    in_flight: usize,
}

impl PsyncQueue {
    /// Opens `path` (a regular file or a block device) read-only and starts `opts.threads` workers.
    ///
    /// # Errors
    /// [`Error::OptionOutOfRange`] for zero threads or more than [`MAX_THREADS`]; [`Error::Open`]; [`Error::DirectUnsupported`] when
    /// the file system refuses `O_DIRECT` (e.g. tmpfs on older kernels: use `--buffered`);
    /// [`Error::Stat`], [`Error::Ioctl`], [`Error::UnsupportedTarget`] while probing;
    /// [`Error::Spawn`].
    pub fn open(path: impl AsRef<Path>, opts: PsyncOptions) -> Result<Self> {
        let path = path.as_ref();
        if !(1..=MAX_THREADS).contains(&opts.threads) {
            return Err(Error::OptionOutOfRange {
                option: "PsyncOptions::threads",
                value: opts.threads as u64,
                min: 1,
                max: MAX_THREADS as u64,
            });
        }
        let file = sys::open(path, opts.direct)?;
        let probe = sys::probe(&file, path, opts.direct)?;
        let align = align::choose(opts.direct, probe.statx_dio, probe.logical_block)
            .map_err(|reason| Error::DirectUnsupported { path: path.into(), reason, cause: None })?;
        tracing::debug!(
            "{}: {:?} of {} bytes, {} reads, alignment {align:?}, {} threads",
            path.display(),
            probe.kind,
            probe.size,
            if opts.direct { "direct" } else { "buffered" },
            opts.threads
        );
        let shared = Arc::new(Shared {
            file,
            path: path.into(),
            size: probe.size,
            align,
            direct: opts.direct,
            shutdown: AtomicBool::new(false),
        });
        let (job_tx, job_rx) = mpsc::channel::<Job>();
        let (done_tx, done_rx) = mpsc::channel::<Completion>();
        let job_rx = Arc::new(Mutex::new(job_rx));
        // Built before the workers so that a failed spawn drops (and joins) the ones already started.
        let mut queue = PsyncQueue {
            shared,
            kind: probe.kind,
            threads: opts.threads,
            jobs: Some(job_tx),
            done: done_rx,
            refused: VecDeque::new(),
            workers: Vec::with_capacity(opts.threads),
            in_flight: 0,
        };
        for index in 0..opts.threads {
            let (shared, jobs, done) = (Arc::clone(&queue.shared), Arc::clone(&job_rx), done_tx.clone());
            let handle = std::thread::Builder::new()
                .name(format!("picchio-psync-{index}"))
                .spawn(move || worker(&shared, &jobs, &done))
                .map_err(|cause| Error::Spawn { path: path.into(), index, cause })?;
            queue.workers.push(handle);
        }
        Ok(queue)
    }

    /// Size of the target in bytes (the file size, or the block device size), measured at open.
    pub fn len(&self) -> u64 {
        self.shared.size
    }

    /// Whether the target holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.shared.size == 0
    }

    /// The alignment the kernel requires ([`DioAlign::NONE`] for buffered reads). See the type's
    /// documentation for how this relates to [`IoQueue::block_size`].
    pub fn alignment(&self) -> DioAlign {
        self.shared.align
    }

    /// Whether reads bypass the page cache (`O_DIRECT`).
    pub fn is_direct(&self) -> bool {
        self.shared.direct
    }

    /// Whether the target is a block device (rather than a regular file).
    pub fn is_block_device(&self) -> bool {
        self.kind == TargetKind::BlockDevice
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The path the queue was opened with.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// Checks a request before it reaches a worker; the error says what is wrong with it.
    fn check(&self, req: &ReadReq) -> Result<()> {
        let s = &self.shared;
        align::check_request(&s.path, s.size, s.align, s.direct, req)
    }

    fn refuse(&mut self, req: ReadReq, submitted: Instant, err: Error) {
        self.refused.push_back(Completion {
            tag: req.tag,
            buf: req.buf,
            result: Err(err.into_io()),
            latency_ns: nanos_since(submitted),
        });
    }
}

impl IoQueue for PsyncQueue {
    fn block_size(&self) -> u32 {
        let a = self.shared.align;
        MIN_REPORTED_BLOCK_SIZE.max(a.offset).max(a.mem)
    }

    fn submit(&mut self, req: ReadReq) {
        let submitted = Instant::now();
        self.in_flight += 1;
        if let Err(e) = self.check(&req) {
            return self.refuse(req, submitted, e);
        }
        let job = Job { req, submitted };
        let sent = match &self.jobs {
            Some(jobs) => jobs.send(job).map_err(|mpsc::SendError(job)| job),
            None => Err(job),
        };
        if let Err(Job { req, submitted }) = sent {
            // Every worker is gone (cannot happen: workers catch panics). Return the buffer anyway.
            let e = Error::WorkerPanicked { path: self.shared.path.clone(), offset: req.offset.0, len: req.len };
            self.refuse(req, submitted, e);
        }
    }

    fn reap(&mut self, min: usize, out: &mut Vec<Completion>) -> usize {
        let start = out.len();
        let want = min.min(self.in_flight);
        out.extend(self.refused.drain(..));
        while out.len() - start < want {
            match self.done.recv() {
                Ok(c) => out.push(c),
                // All workers have exited: nothing more can arrive.
                Err(mpsc::RecvError) => break,
            }
        }
        out.extend(self.done.try_iter());
        let n = out.len() - start;
        self.in_flight -= n;
        n
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn describe(&self) -> String {
        let n = self.threads;
        let mode = if self.shared.direct { "direct" } else { "buffered" };
        format!("psync({mode}, {n} thread{})", if n == 1 { "" } else { "s" })
    }
}

impl Drop for PsyncQueue {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        // Closing the job channel ends each worker's loop once the queued jobs are discarded.
        drop(self.jobs.take());
        for w in self.workers.drain(..) {
            // A worker never panics outside `catch_unwind`; a join error would only repeat one.
            let _ = w.join();
        }
    }
}

impl std::fmt::Debug for PsyncQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PsyncQueue")
            .field("path", &self.shared.path)
            .field("size", &self.shared.size)
            .field("kind", &self.kind)
            .field("direct", &self.shared.direct)
            .field("align", &self.shared.align)
            .field("threads", &self.threads)
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

fn nanos_since(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// One worker: takes jobs until the channel closes, reads, sends the completion.
fn worker(shared: &Shared, jobs: &Mutex<Receiver<Job>>, done: &Sender<Completion>) {
    loop {
        // Holding the lock while blocked in `recv` is the point: one idle worker waits on the
        // channel, the others on the lock.
        let job = jobs.lock().unwrap_or_else(PoisonError::into_inner).recv();
        let Ok(Job { req, submitted }) = job else { return };
        if shared.shutdown.load(Ordering::Acquire) {
            continue; // dropping `req` frees its buffer
        }
        let ReadReq { offset, len, mut buf, tag } = req;
        let result =
            catch_unwind(AssertUnwindSafe(|| read_full(shared, offset.0, len, &mut buf))).unwrap_or_else(|_| {
                Err(Error::WorkerPanicked { path: shared.path.clone(), offset: offset.0, len }.into_io())
            });
        let c = Completion { tag, buf, result, latency_ns: nanos_since(submitted) };
        if done.send(c).is_err() {
            return; // the queue is gone
        }
    }
}

/// Reads `len` bytes at `offset` into the start of `buf`, looping on short reads; stops early only at
/// end of file. Returns the bytes read.
fn read_full(shared: &Shared, offset: u64, len: u32, buf: &mut AlignedBuf) -> std::io::Result<u32> {
    let dst = &mut buf.as_mut_slice()[..len as usize];
    let mut done = 0usize;
    while done < dst.len() {
        let at = offset + done as u64;
        match sys::read_at(&shared.file, &mut dst[done..], at) {
            Ok(0) => break,
            Ok(n) => {
                done += n;
                // An unbuffered read only stops short of an aligned count at end of file; asking
                // again from the unaligned position would fail with EINVAL instead of returning 0.
                if shared.direct && !done.is_multiple_of(shared.align.offset as usize) {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(cause) => return Err(Error::Read { path: shared.path.clone(), offset, len, cause }.into_io()),
        }
    }
    Ok(done as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_file::{file_with, read};
    use picchio_core::{ByteOffset, Tag};

    fn assert_send<T: Send>() {}

    #[test]
    fn queue_is_send() {
        assert_send::<PsyncQueue>();
    }

    #[test]
    fn too_many_threads_is_refused_before_any_starts() {
        let (_d, path, _) = file_with(10);
        let e = PsyncQueue::open(&path, PsyncOptions::buffered(100_000)).unwrap_err();
        assert!(matches!(e, Error::OptionOutOfRange { option: "PsyncOptions::threads", value: 100_000, .. }), "{e}");
        assert!(e.to_string().contains("100000") && e.to_string().contains("256"), "{e}");
        assert_eq!(PsyncQueue::open(&path, PsyncOptions::buffered(MAX_THREADS)).unwrap().threads(), MAX_THREADS);
    }

    #[test]
    fn zero_threads_is_refused() {
        let (_d, path, _) = file_with(10);
        let e = PsyncQueue::open(&path, PsyncOptions::buffered(0)).unwrap_err();
        assert_eq!(e.to_string(), "invalid I/O options: PsyncOptions::threads = 0, expected 1..=256");
    }

    #[test]
    fn describe_and_sizes() {
        let (_d, path, _) = file_with(10_000);
        let q = PsyncQueue::open(&path, PsyncOptions::buffered(1)).unwrap();
        assert_eq!(q.describe(), "psync(buffered, 1 thread)");
        assert_eq!((q.len(), q.is_empty(), q.is_direct(), q.is_block_device()), (10_000, false, false, false));
        assert_eq!(q.alignment(), DioAlign::NONE);
        assert_eq!(IoQueue::block_size(&q), MIN_REPORTED_BLOCK_SIZE);
        let q = PsyncQueue::open(&path, PsyncOptions::buffered(3)).unwrap();
        assert_eq!(q.describe(), "psync(buffered, 3 threads)");
    }

    #[cfg(unix)]
    #[test]
    fn kernel_error_completes_with_path_offset_and_os_error() {
        let (_d, path, bytes) = file_with(3 * 4096);
        let mut q = PsyncQueue::open(&path, PsyncOptions::buffered(2)).unwrap();
        sys::fault::fail_read(&path, 4096, libc::EIO);
        let c = read(&mut q, 4096, 4096);
        let e = c.result.unwrap_err();
        assert!(e.to_string().contains("read of 4096 bytes at offset 0x1000"), "{e}");
        assert!(e.to_string().contains(&path.display().to_string()), "{e}");
        let typed = e.get_ref().and_then(|e| e.downcast_ref::<Error>()).expect("typed error");
        let Error::Read { cause, .. } = typed else { panic!("{typed:?}") };
        assert_eq!(cause.raw_os_error(), Some(libc::EIO));
        // Other reads are unaffected, and the buffer came back.
        assert_eq!(c.buf.len(), 4096);
        let c = read(&mut q, 0, 4096);
        assert_eq!(c.result.unwrap(), 4096);
        assert_eq!(&c.buf.as_slice()[..4096], &bytes[..4096]);
        sys::fault::clear(&path);
    }

    #[cfg(windows)]
    #[test]
    fn kernel_error_completes_with_path_offset_and_win32_error() {
        const ERROR_CRC: i32 = 23;
        let (_d, path, bytes) = file_with(3 * 4096);
        let mut q = PsyncQueue::open(&path, PsyncOptions::buffered(2)).unwrap();
        sys::fault::fail_read(&path, 4096, ERROR_CRC);
        let c = read(&mut q, 4096, 4096);
        sys::fault::clear(&path);
        let e = c.result.unwrap_err();
        assert!(e.to_string().contains("read of 4096 bytes at offset 0x1000"), "{e}");
        let typed = e.get_ref().and_then(|e| e.downcast_ref::<Error>()).expect("typed error");
        let Error::Read { cause, .. } = typed else { panic!("{typed:?}") };
        assert_eq!(cause.raw_os_error(), Some(ERROR_CRC));
        let c = read(&mut q, 0, 4096);
        assert_eq!(c.result.unwrap(), 4096);
        assert_eq!(&c.buf.as_slice()[..4096], &bytes[..4096]);
    }

    #[cfg(unix)]
    #[test]
    fn interrupted_reads_are_retried() {
        let (_d, path, bytes) = file_with(8192);
        let mut q = PsyncQueue::open(&path, PsyncOptions::buffered(1)).unwrap();
        // EINTR is retried; the fault keeps firing, so use a second offset to show progress
        // and clear the fault from another thread after a moment.
        sys::fault::fail_read(&path, 0, libc::EINTR);
        let p = path.clone();
        let clearer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            sys::fault::clear(&p);
        });
        let c = read(&mut q, 0, 8192);
        clearer.join().unwrap();
        assert_eq!(c.result.unwrap(), 8192);
        assert_eq!(&c.buf.as_slice()[..8192], &bytes[..]);
    }

    #[test]
    fn buffer_too_small_is_refused_without_reaching_a_worker() {
        let (_d, path, _) = file_with(8192);
        let mut q = PsyncQueue::open(&path, PsyncOptions::buffered(1)).unwrap();
        let buf = AlignedBuf::new(4096, 4096).unwrap();
        q.submit(ReadReq { offset: ByteOffset(0), len: 8192, buf, tag: Tag(7) });
        assert_eq!(q.in_flight(), 1);
        let mut out = Vec::new();
        assert_eq!(q.reap(1, &mut out), 1);
        assert_eq!(q.in_flight(), 0);
        let e = out[0].result.as_ref().unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("does not fit its 4096-byte buffer"), "{e}");
        assert_eq!(out[0].tag, Tag(7));
    }

    #[test]
    fn drop_discards_queued_jobs_and_joins_workers() {
        let (_d, path, _) = file_with(1 << 20);
        let mut q = PsyncQueue::open(&path, PsyncOptions::buffered(2)).unwrap();
        for i in 0..512u64 {
            let buf = AlignedBuf::new(64 << 10, 4096).unwrap();
            q.submit(ReadReq { offset: ByteOffset((i % 16) * (64 << 10)), len: 64 << 10, buf, tag: Tag(i) });
        }
        let shared = Arc::downgrade(&q.shared);
        drop(q);
        // Every worker held a strong reference until it returned: none is left running.
        assert!(shared.upgrade().is_none());
    }
}
