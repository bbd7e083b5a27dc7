//! [`UringQueue`] (tier S3): one io_uring instance per queue, reading a file or block device at up to
//! `qd` reads in flight, straight into each request's [`AlignedBuf`].
//!
//! ```text
//! submit ──(validate)──► free slab slot? ──yes──► SQE pushed (no syscall) ─┐
//!   │                         └──no──► local FIFO ──(a completion frees a slot)──┘
//!   └─ refused requests complete at once ──────────────────────────────► ready ──► reap
//! reap: harvest CQEs ─► done / short (resubmit the rest) / EAGAIN, EINTR (resubmit) / error
//!       ─► refill SQEs from the FIFO ─► io_uring_enter(submit all, wait for `min`) ─► ready
//! ```
//!
//! # Ownership of the buffers
//! A request's buffer moves into the queue's *slab* (one entry per possible read in flight, indexed
//! by the SQE's `user_data`) and stays there, untouched, until the kernel has posted that entry's
//! CQE: the only `unsafe` in this file is where the kernel gets a pointer into such a buffer, and
//! the pointer is valid until reaped. Dropping the queue first waits for every read in the kernel;
//! if the ring breaks (an `io_uring_enter` error that cannot be retried) the buffers the kernel may
//! still write are leaked, never freed, and the requests complete with fresh buffers and an error.
//!
//! # Batching
//! `submit` only pushes an SQE; the kernel sees the batch at the next [`IoQueue::reap`], which
//! submits every pushed SQE and waits in one `io_uring_enter`, and before returning submits the
//! SQEs it pushed from the FIFO so those reads run while the caller computes. With `sqpoll` the
//! kernel's polling thread picks SQEs up as they are pushed and `submit` wakes it when it sleeps.
//!
//! # SQPOLL waits never rely on one wakeup
//! With `sqpoll`, a wait for completions is one `io_uring_enter(GETEVENTS)` that passes
//! `IORING_ENTER_SQ_WAKEUP` when the ring's `IORING_SQ_NEED_WAKEUP` flag, read after a full fence
//! (the pairing with the kernel thread's own barrier), says the thread sleeps. That protocol is
//! right, yet a waiter was once seen blocked in `io_cqring_wait` for good with the polling thread
//! asleep and reads pending (a loaded host; liburing issue 367 reports the same state, released only
//! by a timeout). So each SQPOLL wait lasts at most [`SQPOLL_WAIT_SLICE`]: when a slice ends with
//! fewer completions than wanted, the thread is woken whatever the flag says and the wait starts
//! again with the flag re-read. A wakeup lost anywhere (ours, or a kernel path that parks the thread
//! with work queued) then costs one slice, not the process.
//!
//! # Why no registered (fixed) buffers
//! `IORING_OP_READ_FIXED` saves pinning the buffer's pages per read, but needs every target buffer
//! in a table registered up front. Here buffers *move*: each request brings its own cache slot, the
//! cache allocates slots lazily and may replace one, and a registered buffer must stay mapped for as
//! long as it is registered (a freed-then-reused registered buffer is written by the kernel behind
//! the allocator's back). Keeping a registration table in step with slots that come and go would
//! need the cache to hand its slots to the engine up front. The saving is also small for expert
//! reads: pinning 648 pages costs a few microseconds against a 2.6 MB transfer of hundreds of
//! microseconds or more. Registered *files* (`register_files`) cost nothing per read and are used by
//! default.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use io_uring::{opcode, squeue, types, EnterFlags, IoUring};
use picchio_core::{AlignedBuf, Completion, IoQueue, ReadReq, Tag};

use crate::align::{self, DioAlign};
use crate::error::{Error, Result};
use crate::psync::MIN_REPORTED_BLOCK_SIZE;
use crate::sys::{self, TargetKind};

/// Reads in flight when `--qd` is not given.
pub const DEFAULT_QD: u32 = 32;

/// The largest `--qd` accepted.
pub const MAX_QD: u32 = 256;

/// Resubmissions of one read after `EAGAIN`/`EINTR` before its error is reported.
const MAX_RETRIES: u32 = 64;

/// Idle time after which the SQPOLL kernel thread sleeps (and `submit` must wake it), milliseconds.
const SQPOLL_IDLE_MS: u32 = 1000;

/// Longest single SQPOLL wait for completions before the polling thread is woken unconditionally and
/// the wait re-entered (see the module documentation). Long against a syscall, short against a hang.
const SQPOLL_WAIT_SLICE: std::time::Duration = std::time::Duration::from_millis(50);

/// How many [`SQPOLL_WAIT_SLICE`]s in a row `Drop` waits without any completion before it gives the
/// reads still in the kernel up (30 s): it logs them and leaks their buffers, so a read the kernel
/// never completes (seen once in CI with SQPOLL, after every read of the queue had completed) makes
/// the queue's drop return instead of hanging its thread.
const DRAIN_PATIENCE_SLICES: u32 = 600;

/// Where the kernel says whether io_uring may be used (Linux 6.6+): 0 yes, 1 only for
/// `kernel.io_uring_group` members and CAP_SYS_ADMIN, 2 no.
const IO_URING_DISABLED: &str = "/proc/sys/kernel/io_uring_disabled";

/// How to open a [`UringQueue`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UringOptions {
    /// Reads in the kernel at once (`--qd`, 1..=[`MAX_QD`]); more wait in a FIFO inside the queue.
    pub qd: u32,
    /// Unbuffered reads (`O_DIRECT`), bypassing the page cache (`--direct`, the default).
    pub direct: bool,
    /// A kernel thread polls the submission queue (`IORING_SETUP_SQPOLL`, `--sqpoll`): no syscall
    /// per batch, one CPU busy while reads flow. May need privileges on older kernels.
    pub sqpoll: bool,
    /// Completions are polled from the device instead of interrupts (`IORING_SETUP_IOPOLL`,
    /// `--iopoll`). Needs `direct` and a device with polled queues (NVMe with `poll_queues`).
    pub iopoll: bool,
    /// Register the file with the ring (`IORING_REGISTER_FILES`) and address it by index, saving a
    /// file-table lookup and reference count per read. On by default: never slower, and measurably
    /// faster where per-read cost shows (4 KiB page-cache reads: +0-8% reads/s here, fio +22%); at
    /// expert-sized reads the difference is below the device's noise.
    pub register_files: bool,
}

impl Default for UringOptions {
    /// [`DEFAULT_QD`] reads in flight, direct, no polling, registered file.
    fn default() -> Self {
        UringOptions { qd: DEFAULT_QD, direct: true, sqpoll: false, iopoll: false, register_files: true }
    }
}

impl UringOptions {
    /// Unbuffered (`O_DIRECT`) reads, `qd` in flight, no polling, registered file.
    pub fn direct(qd: u32) -> Self {
        UringOptions { qd, direct: true, ..UringOptions::default() }
    }

    /// Page-cache reads, `qd` in flight, no polling, registered file.
    pub fn buffered(qd: u32) -> Self {
        UringOptions { qd, direct: false, ..UringOptions::default() }
    }
}

/// A read that owns a slab slot: its buffer is the kernel's until the slot's CQE is reaped.
struct InFlight {
    tag: Tag,
    /// Owned here while the kernel may write it: never read, moved out or freed before the CQE.
    buf: AlignedBuf,
    /// Offset and length of the whole request.
    offset: u64,
    len: u32,
    /// Bytes already read (a short read resubmits `offset + done .. offset + len`).
    done: u32,
    /// `EAGAIN`/`EINTR` resubmissions so far.
    retries: u32,
    submitted: Instant,
}

/// A request waiting for a free slab slot.
struct Waiting {
    req: ReadReq,
    submitted: Instant,
}

/// An [`IoQueue`] over one io_uring instance, reading a file or block device with up to `qd` reads in
/// the kernel at once; see the module documentation for ownership and batching.
///
/// * Reads go straight into the request's buffer (opcode `READ`, no bounce buffer). A short read is
///   resubmitted for the remaining bytes until `len` bytes or end of file; a read that runs past
///   the end completes `Ok` with the bytes that exist (as [`crate::PsyncQueue`] does).
/// * `EAGAIN` and `EINTR` completions are resubmitted (up to 64 times each read); other kernel errors
///   complete with an [`io::Error`] wrapping [`Error::Read`] (path, offset, length, OS error).
/// * Requests that cannot be performed complete with an error without reaching the kernel, as with
///   psync: [`Error::PastEnd`], [`Error::BufferTooSmall`], and in direct mode [`Error::Misaligned`].
/// * [`IoQueue::block_size`] is the direct-I/O alignment from the same probe as psync
///   (`statx(STATX_DIOALIGN)`, then `BLKSSZGET`, then 4096), never less than 512.
/// * Dropping the queue discards requests still waiting in the FIFO and waits for the reads in the
///   kernel before freeing their buffers.
pub struct UringQueue {
    /// Declared first: after `Drop` has drained it, the ring is closed before the file.
    ring: IoUring,
    file: File,
    path: PathBuf,
    kind: TargetKind,
    size: u64,
    align: DioAlign,
    opts: UringOptions,
    /// `qd` slots; `user_data` of an SQE is its slot index.
    slab: Vec<Option<InFlight>>,
    /// Free slot indices.
    free: Vec<u32>,
    /// Requests beyond `qd`, in submission order.
    waiting: VecDeque<Waiting>,
    /// Completions not yet handed to `reap` (refused requests, finished reads).
    ready: VecDeque<Completion>,
    /// Scratch for CQEs copied out of the ring: `(user_data, res)`.
    cqes: Vec<(u64, i32)>,
    /// Submitted and not yet reaped.
    in_flight: usize,
    /// Set when `io_uring_enter` failed for good: the OS error; every later request fails with it.
    broken: Option<i32>,
    /// Test twin: results to substitute for the next CQEs of reads at given offsets.
    #[cfg(test)]
    faults: Vec<(u64, i32)>,
    /// Test twin: an error for the next `io_uring_enter`.
    #[cfg(test)]
    enter_fault: Option<i32>,
    /// SQPOLL waits whose slice ended short and that woke the polling thread unconditionally.
    sqpoll_rewakes: u64,
    /// Test twin: this many SQPOLL waits leave `IORING_ENTER_SQ_WAKEUP` out although the thread
    /// sleeps (the lost wakeup, made on purpose).
    #[cfg(test)]
    lose_wakeups: u32,
    /// Wait slices without a completion after which `Drop` gives up ([`DRAIN_PATIENCE_SLICES`]).
    drain_patience: u32,
    /// Test twin: this many CQEs are dropped unread (a completion the kernel never posts, made on
    /// purpose).
    #[cfg(test)]
    lose_cqes: u32,
}

impl UringQueue {
    /// Checks once per process that io_uring can be used here: the ring can be set up (not
    /// `ENOSYS`, not refused by `kernel.io_uring_disabled` or a seccomp filter), `IORING_OP_READ`
    /// is supported (`IORING_REGISTER_PROBE`), and a `NOP` makes the round trip through
    /// `io_uring_enter`.
    ///
    /// # Errors
    /// [`Error::UringUnavailable`] saying why.
    pub fn probe() -> Result<()> {
        static PROBED: OnceLock<std::result::Result<(), (String, Option<i32>)>> = OnceLock::new();
        match PROBED.get_or_init(probe_uncached) {
            Ok(()) => Ok(()),
            Err((reason, errno)) => {
                Err(Error::UringUnavailable { reason: reason.clone(), cause: errno.map(io::Error::from_raw_os_error) })
            }
        }
    }

    /// Opens `path` (a regular file or a block device) read-only and sets up a ring for `opts.qd`
    /// reads in flight.
    ///
    /// With `iopoll`, one block is read at open so that a device without polled queues is refused
    /// here rather than at the first expert.
    ///
    /// # Errors
    /// [`Error::OptionOutOfRange`] for `qd` outside 1..=256; [`Error::IopollNeedsDirect`] for `iopoll`
    /// without `direct`;
    /// [`Error::UringUnavailable`] (see [`UringQueue::probe`]); [`Error::Open`];
    /// [`Error::DirectUnsupported`]; [`Error::Stat`], [`Error::Ioctl`], [`Error::UnsupportedTarget`]
    /// while probing the target; [`Error::UringOption`] naming `sqpoll`, `iopoll` or
    /// `register_files` when the kernel or device refuses it.
    pub fn open(path: impl AsRef<Path>, opts: UringOptions) -> Result<Self> {
        Self::open_with_idle(path.as_ref(), opts, SQPOLL_IDLE_MS)
    }

    /// [`UringQueue::open`] with the SQPOLL thread's idle time `sqpoll_idle_ms` (tests make it sleep
    /// between submissions with 1 ms).
    fn open_with_idle(path: &Path, opts: UringOptions, sqpoll_idle_ms: u32) -> Result<Self> {
        if !(1..=MAX_QD).contains(&opts.qd) {
            return Err(Error::OptionOutOfRange {
                option: "UringOptions::qd",
                value: u64::from(opts.qd),
                min: 1,
                max: u64::from(MAX_QD),
            });
        }
        if opts.iopoll && !opts.direct {
            return Err(Error::IopollNeedsDirect);
        }
        UringQueue::probe()?;
        let file = sys::open(path, opts.direct)?;
        let probe = sys::probe(&file, path, opts.direct)?;
        let align = align::choose(opts.direct, probe.statx_dio, probe.logical_block)
            .map_err(|reason| Error::DirectUnsupported { path: path.into(), reason, cause: None })?;
        let ring = build_ring(path, &opts, sqpoll_idle_ms)?;
        let mut opts = opts;
        if opts.sqpoll && !opts.register_files && !ring.params().is_feature_sqpoll_nonfixed() {
            tracing::debug!("{}: this kernel's SQPOLL needs registered files; registering", path.display());
            opts.register_files = true;
        }
        if opts.register_files {
            ring.submitter().register_files(&[file.as_raw_fd()]).map_err(|cause| Error::UringOption {
                path: path.into(),
                option: "register_files",
                reason: "IORING_REGISTER_FILES failed".into(),
                cause: Some(cause),
            })?;
        }
        tracing::debug!(
            "{}: {:?} of {} bytes, io_uring {} reads, alignment {align:?}, qd {} ({} SQEs){}{}{}",
            path.display(),
            probe.kind,
            probe.size,
            if opts.direct { "direct" } else { "buffered" },
            opts.qd,
            ring.params().sq_entries(),
            if opts.sqpoll { ", sqpoll" } else { "" },
            if opts.iopoll { ", iopoll" } else { "" },
            if opts.register_files { ", registered file" } else { "" },
        );
        let qd = opts.qd as usize;
        let mut q = UringQueue {
            ring,
            file,
            path: path.into(),
            kind: probe.kind,
            size: probe.size,
            align,
            opts,
            slab: (0..qd).map(|_| None).collect(),
            free: (0..opts.qd).rev().collect(),
            waiting: VecDeque::new(),
            ready: VecDeque::new(),
            cqes: Vec::with_capacity(qd),
            in_flight: 0,
            broken: None,
            #[cfg(test)]
            faults: Vec::new(),
            #[cfg(test)]
            enter_fault: None,
            sqpoll_rewakes: 0,
            #[cfg(test)]
            lose_wakeups: 0,
            drain_patience: DRAIN_PATIENCE_SLICES,
            #[cfg(test)]
            lose_cqes: 0,
        };
        if opts.iopoll {
            q.check_iopoll()?;
        }
        Ok(q)
    }

    /// Size of the target in bytes (file size, or block device size), measured at open.
    pub fn len(&self) -> u64 {
        self.size
    }

    /// Whether the target holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// The alignment the kernel requires ([`DioAlign::NONE`] for buffered reads).
    pub fn alignment(&self) -> DioAlign {
        self.align
    }

    /// Whether reads bypass the page cache (`O_DIRECT`).
    pub fn is_direct(&self) -> bool {
        self.opts.direct
    }

    /// Whether the target is a block device (rather than a regular file).
    pub fn is_block_device(&self) -> bool {
        self.kind == TargetKind::BlockDevice
    }

    /// The options in force (`register_files` may have been turned on for an old kernel's SQPOLL).
    pub fn options(&self) -> UringOptions {
        self.opts
    }

    /// The path the queue was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads one block at offset 0 and turns the `EOPNOTSUPP`/`EINVAL` of a device without polled
    /// queues into an error naming `iopoll`.
    fn check_iopoll(&mut self) -> Result<()> {
        let len = self.block_size();
        if self.size < u64::from(len) {
            return Ok(()); // nothing to read: the first real read reports it
        }
        let buf = AlignedBuf::new(len as usize, len as usize).map_err(|cause| Error::IopollProbeBuffer {
            path: self.path.clone(),
            len,
            cause: Box::new(cause),
        })?;
        self.submit(ReadReq { offset: picchio_core::ByteOffset(0), len, buf, tag: Tag(u64::MAX) });
        let mut out = Vec::with_capacity(1);
        while out.is_empty() {
            self.reap(1, &mut out);
        }
        let Some(Err(e)) = out.pop().map(|c| c.result) else { return Ok(()) };
        let os = e.get_ref().and_then(|e| e.downcast_ref::<Error>()).and_then(|e| match e {
            Error::Read { cause, .. } => cause.raw_os_error(),
            _ => None,
        });
        let reason = match os {
            Some(libc::EOPNOTSUPP | libc::EINVAL) => {
                "the device has no polled I/O queues (NVMe needs the nvme.poll_queues=N module parameter, \
                 and a file system must pass polled reads through); turn iopoll off"
            }
            _ => "the first polled read failed; turn iopoll off",
        };
        Err(Error::UringOption { path: self.path.clone(), option: "iopoll", reason: reason.into(), cause: Some(e) })
    }

    /// Checks a request before it can reach the kernel; the error says what is wrong with it.
    fn check(&self, req: &ReadReq) -> Result<()> {
        if let Some(errno) = self.broken {
            let (offset, len) = (req.offset.0, req.len);
            let cause = io::Error::from_raw_os_error(errno);
            return Err(Error::Read { path: self.path.clone(), offset, len, cause });
        }
        crate::align::check_request(&self.path, self.size, self.align, self.opts.direct, req)
    }

    /// Completes `req` at once with `err`, without the kernel.
    fn refuse(&mut self, req: ReadReq, submitted: Instant, err: Error) {
        self.ready.push_back(Completion {
            tag: req.tag,
            buf: req.buf,
            result: Err(err.into_io()),
            latency_ns: nanos_since(submitted),
        });
    }

    /// Moves `w` into a free slab slot and pushes its SQE; gives it back when no slot is free.
    fn start(&mut self, w: Waiting) -> std::result::Result<(), Waiting> {
        let Some(idx) = self.free.pop() else { return Err(w) };
        let ReadReq { offset, len, buf, tag } = w.req;
        let entry = InFlight { tag, buf, offset: offset.0, len, done: 0, retries: 0, submitted: w.submitted };
        self.slab[idx as usize] = Some(entry);
        self.push(idx);
        Ok(())
    }

    /// Pushes the SQE reading the rest of slot `idx`'s request (`offset + done`, `len - done`).
    fn push(&mut self, idx: u32) {
        let e = self.slab[idx as usize].as_mut().expect("push: an occupied slot");
        let rest = e.len - e.done;
        let ptr = e.buf.as_mut_slice()[e.done as usize..].as_mut_ptr();
        let offset = e.offset + u64::from(e.done);
        let sqe = if self.opts.register_files {
            opcode::Read::new(types::Fixed(0), ptr, rest).offset(offset).build()
        } else {
            opcode::Read::new(types::Fd(self.file.as_raw_fd()), ptr, rest).offset(offset).build()
        };
        let sqe = sqe.user_data(u64::from(idx));
        // SAFETY: `ptr .. ptr + rest` lies inside the buffer owned by slab slot `idx` (`done + rest =
        // len <= buf.len()`, checked at submit). The buffer stays in the slot, unread and not freed,
        // until the CQE carrying `user_data = idx` is reaped: valid until reaped (`Drop` waits for
        // it, and a broken ring leaks the buffer). The descriptor (or registered file 0) stays open
        // for the life of the ring, which is closed before `file`.
        let pushed = unsafe { self.ring.submission().push(&sqe) };
        // The SQ has at least `qd` entries and each slot has at most one SQE queued or in flight.
        pushed.expect("io_uring submission queue full with a free slab slot");
    }

    /// Moves waiting requests into free slots.
    fn refill(&mut self) {
        while !self.free.is_empty() {
            let Some(w) = self.waiting.pop_front() else { break };
            if let Err(w) = self.start(w) {
                self.waiting.push_front(w);
                break;
            }
        }
    }

    /// Slots whose read is queued or in the kernel.
    fn occupied(&self) -> usize {
        self.slab.len() - self.free.len()
    }

    /// Copies the available CQEs out of the ring into `self.cqes`.
    fn copy_cqes(&mut self) {
        self.cqes.clear();
        self.cqes.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        #[cfg(test)]
        while self.lose_cqes > 0 && !self.cqes.is_empty() {
            self.lose_cqes -= 1;
            self.cqes.remove(0);
        }
        #[cfg(test)]
        for (ud, res) in self.cqes.iter_mut() {
            if let Some(e) = self.slab.get(*ud as usize).and_then(Option::as_ref) {
                let at = e.offset + u64::from(e.done);
                if let Some(i) = self.faults.iter().position(|f| f.0 == at) {
                    *res = self.faults.remove(i).1;
                }
            }
        }
    }

    /// Handles every available CQE: finished reads go to `ready`, short and retryable ones are
    /// pushed again.
    fn harvest(&mut self) {
        self.copy_cqes();
        let cqes = std::mem::take(&mut self.cqes);
        for &(ud, res) in &cqes {
            self.handle(ud, res);
        }
        self.cqes = cqes;
    }

    fn handle(&mut self, ud: u64, res: i32) {
        let idx = ud as usize;
        let Some(e) = self.slab.get_mut(idx).and_then(Option::as_mut) else {
            // Not ours (cannot happen: every SQE carries an occupied slot's index).
            return tracing::error!("{}: io_uring completion for unknown slot {ud}", self.path.display());
        };
        let result = if res < 0 {
            let errno = -res;
            if matches!(errno, libc::EAGAIN | libc::EINTR) && e.retries < MAX_RETRIES {
                e.retries += 1;
                return self.push(idx as u32);
            }
            let cause = io::Error::from_raw_os_error(errno);
            Err(Error::Read { path: self.path.clone(), offset: e.offset, len: e.len, cause }.into_io())
        } else {
            e.done += (res as u32).min(e.len - e.done);
            let pos = e.offset + u64::from(e.done);
            let aligned = !self.opts.direct || pos.is_multiple_of(u64::from(self.align.offset));
            if e.done < e.len && res > 0 && pos < self.size && aligned {
                return self.push(idx as u32); // short read inside the target: read the rest
            }
            // Complete, at end of file, or (direct) stopped off the block grid, which only end of
            // file does: the count is reported as is.
            Ok(e.done)
        };
        let e = self.slab[idx].take().expect("occupied");
        self.free.push(idx as u32);
        self.ready.push_back(Completion { tag: e.tag, buf: e.buf, result, latency_ns: nanos_since(e.submitted) });
    }

    /// Submits the pushed SQEs and waits for `want` completions. Retryable errors return (the
    /// caller loops); any other error breaks the ring (see [`UringQueue::fail_all`]).
    fn enter(&mut self, want: usize) {
        #[cfg(test)]
        let r = match self.enter_fault.take() {
            Some(errno) => Err(io::Error::from_raw_os_error(errno)),
            None => self.submit_and_wait(want),
        };
        #[cfg(not(test))]
        let r = self.submit_and_wait(want);
        match r.map_err(|e| e.raw_os_error()) {
            Ok(_) => {}
            // ETIME: an SQPOLL wait slice ended (the thread has been woken); the caller loops.
            Err(Some(libc::EINTR | libc::ETIME)) => {}
            // EAGAIN: the kernel is short of memory for requests; EBUSY: completions must be reaped
            // first. Both clear up once the caller's loop harvests.
            Err(Some(libc::EAGAIN | libc::EBUSY)) => std::thread::yield_now(),
            Err(errno) => self.fail_all(errno.unwrap_or(libc::EIO)),
        }
    }

    /// `submit_and_wait`, with SQPOLL waits in slices (see the module documentation): the io-uring
    /// crate's own for everything else.
    fn submit_and_wait(&mut self, want: usize) -> io::Result<usize> {
        if !self.opts.sqpoll {
            return self.ring.submit_and_wait(want);
        }
        #[cfg(test)]
        if self.lose_wakeups > 0 && self.ring.submission().need_wakeup() {
            self.lose_wakeups -= 1;
            return if want == 0 { Ok(0) } else { self.sqpoll_wait(want, false) };
        }
        if want == 0 || !self.ring.params().is_feature_ext_arg() {
            return self.ring.submit_and_wait(want);
        }
        // `need_wakeup` fences (SeqCst) before reading the flag: our tail store, published when the
        // `SubmissionQueue` that pushed was dropped, is ordered before the read, as the kernel
        // thread orders its flag store before re-reading the tail.
        let wake = self.ring.submission().need_wakeup();
        self.sqpoll_wait(want, wake)
    }

    /// One SQPOLL wait slice for `want` completions, waking the polling thread first when `wake`;
    /// when the slice ends short (`ETIME`, returned), the thread is woken unconditionally.
    fn sqpoll_wait(&mut self, want: usize, wake: bool) -> io::Result<usize> {
        let mut flags = EnterFlags::GETEVENTS | EnterFlags::EXT_ARG;
        if wake {
            flags |= EnterFlags::SQ_WAKEUP;
        }
        let ts = types::Timespec::from(SQPOLL_WAIT_SLICE);
        let args = types::SubmitArgs::new().timespec(&ts);
        let want = u32::try_from(want).unwrap_or(u32::MAX);
        // SAFETY: with IORING_ENTER_EXT_ARG the kernel reads `arg` as a `struct
        // io_uring_getevents_arg` of the size `enter` passes: `SubmitArgs` is `repr(transparent)`
        // over exactly that struct, and its `ts` points at `ts`; both live across the call. The
        // sigmask is null. With SQPOLL `to_submit` is ignored; nothing else is lent to the kernel.
        let r = unsafe { self.ring.submitter().enter(0, want, flags.bits(), Some(&args)) };
        if r.as_ref().is_err_and(|e| e.raw_os_error() == Some(libc::ETIME)) {
            self.sqpoll_rewakes += 1;
            tracing::debug!(
                "{}: SQPOLL wait slice of {SQPOLL_WAIT_SLICE:?} ended with reads pending; waking the polling thread",
                self.path.display()
            );
            // SAFETY: a wakeup carries no argument and no pointer (`arg` is null, size 0).
            unsafe { self.ring.submitter().enter::<libc::sigset_t>(0, 0, EnterFlags::SQ_WAKEUP.bits(), None) }?;
        }
        r
    }

    /// SQPOLL waits that ended a slice short and woke the polling thread unconditionally (see the
    /// module documentation): 0 unless a read took longer than [`SQPOLL_WAIT_SLICE`] or a wakeup
    /// was lost.
    pub fn sqpoll_rewakes(&self) -> u64 {
        self.sqpoll_rewakes
    }

    /// The ring is unusable: complete every request with `errno`. Reads that may be in the kernel
    /// give back a fresh zeroed buffer and leak theirs (the kernel might still write it).
    fn fail_all(&mut self, errno: i32) {
        tracing::error!(
            "{}: io_uring_enter failed: {}; failing the {} reads in flight and leaking their buffers",
            self.path.display(),
            io::Error::from_raw_os_error(errno),
            self.occupied()
        );
        self.broken = Some(errno);
        for idx in 0..self.slab.len() {
            let Some(e) = self.slab[idx].take() else { continue };
            self.free.push(idx as u32);
            let fresh = AlignedBuf::new(e.buf.len(), e.buf.align()).expect("allocating a replacement buffer");
            std::mem::forget(e.buf);
            let cause = io::Error::from_raw_os_error(errno);
            let err = Error::Read { path: self.path.clone(), offset: e.offset, len: e.len, cause };
            self.ready.push_back(Completion {
                tag: e.tag,
                buf: fresh,
                result: Err(err.into_io()),
                latency_ns: nanos_since(e.submitted),
            });
        }
        while let Some(w) = self.waiting.pop_front() {
            let cause = io::Error::from_raw_os_error(errno);
            let err = Error::Read { path: self.path.clone(), offset: w.req.offset.0, len: w.req.len, cause };
            self.refuse(w.req, w.submitted, err);
        }
    }

    /// Waits for every read in the kernel and frees its buffer; nothing is resubmitted. When
    /// `drain_patience` wait slices in a row bring no completion, the reads left are given up: they
    /// are logged and the ring marked broken (`ETIMEDOUT`), so `Drop` leaks their buffers (the
    /// kernel may still write them) instead of waiting forever.
    fn drain(&mut self) {
        self.waiting.clear();
        let mut idle = 0u32;
        while self.occupied() > 0 && self.broken.is_none() {
            self.copy_cqes();
            for i in 0..self.cqes.len() {
                let idx = self.cqes[i].0 as usize;
                if self.slab.get_mut(idx).and_then(Option::take).is_some() {
                    self.free.push(idx as u32); // the kernel is done with it: dropping frees it
                    idle = 0;
                }
            }
            if self.occupied() == 0 {
                break;
            }
            match self.drain_wait().map_err(|e| e.raw_os_error()) {
                Ok(_) | Err(Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => {}
                Err(Some(libc::ETIME)) => {
                    idle += 1;
                    if idle >= self.drain_patience {
                        self.give_up_in_flight(idle);
                    }
                }
                Err(errno) => self.fail_all(errno.unwrap_or(libc::EIO)),
            }
        }
    }

    /// One bounded wait of [`UringQueue::drain`] for a completion: an SQPOLL wait slice, or (without
    /// SQPOLL) a submit-and-wait of at most [`SQPOLL_WAIT_SLICE`]; `ETIME` when it ended with none.
    /// A kernel without `IORING_FEAT_EXT_ARG` (before Linux 5.11) waits unbounded.
    fn drain_wait(&mut self) -> io::Result<usize> {
        if self.opts.sqpoll || !self.ring.params().is_feature_ext_arg() {
            return self.submit_and_wait(1);
        }
        let ts = types::Timespec::from(SQPOLL_WAIT_SLICE);
        let args = types::SubmitArgs::new().timespec(&ts);
        self.ring.submitter().submit_with_args(1, &args)
    }

    /// The reads still in the kernel after `slices` empty waits are given up: logged, and the ring
    /// marked broken so `Drop` leaks their buffers.
    fn give_up_in_flight(&mut self, slices: u32) {
        let pending: Vec<String> = self
            .slab
            .iter()
            .flatten()
            .map(|e| format!("{} B at {:#x} ({} read, {} retries)", e.len, e.offset, e.done, e.retries))
            .collect();
        tracing::error!(
            "{}: no completion in {slices} waits of {SQPOLL_WAIT_SLICE:?} while closing the ring; giving up {} \
             reads still in the kernel and leaking their buffers: {}",
            self.path.display(),
            pending.len(),
            pending.join(", ")
        );
        self.broken = Some(libc::ETIMEDOUT);
    }
}

impl IoQueue for UringQueue {
    fn block_size(&self) -> u32 {
        MIN_REPORTED_BLOCK_SIZE.max(self.align.offset).max(self.align.mem)
    }

    fn submit(&mut self, req: ReadReq) {
        let submitted = Instant::now();
        self.in_flight += 1;
        if let Err(e) = self.check(&req) {
            return self.refuse(req, submitted, e);
        }
        let w = Waiting { req, submitted };
        if !self.waiting.is_empty() {
            return self.waiting.push_back(w); // keep FIFO order behind earlier requests
        }
        if let Err(w) = self.start(w) {
            return self.waiting.push_back(w);
        }
        if self.opts.sqpoll {
            // No syscall unless the polling thread has gone to sleep.
            self.enter(0);
        }
    }

    fn reap(&mut self, min: usize, out: &mut Vec<Completion>) -> usize {
        let start = out.len();
        let want = min.min(self.in_flight);
        loop {
            self.harvest();
            self.refill();
            out.extend(self.ready.drain(..));
            let got = out.len() - start;
            let in_kernel = self.occupied();
            if got >= want || in_kernel == 0 || self.broken.is_some() {
                if in_kernel > 0 && self.broken.is_none() && !self.ring.submission().is_empty() {
                    self.enter(0); // start what the FIFO refilled before the caller computes
                    out.extend(self.ready.drain(..));
                }
                break;
            }
            self.enter((want - got).min(in_kernel));
        }
        let n = out.len() - start;
        self.in_flight -= n;
        n
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn describe(&self) -> String {
        let mut s = format!("uring({}, qd {}", if self.opts.direct { "direct" } else { "buffered" }, self.opts.qd);
        for (on, name) in
            [(self.opts.sqpoll, "sqpoll"), (self.opts.iopoll, "iopoll"), (self.opts.register_files, "fixed file")]
        {
            if on {
                s.push_str(", ");
                s.push_str(name);
            }
        }
        s.push(')');
        s
    }
}

impl Drop for UringQueue {
    fn drop(&mut self) {
        self.drain();
        if self.broken.is_some() {
            // Anything still in the slab was handed to the kernel and never completed: leak it.
            for e in self.slab.iter_mut().filter_map(Option::take) {
                std::mem::forget(e.buf);
            }
        }
    }
}

impl std::fmt::Debug for UringQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringQueue")
            .field("path", &self.path)
            .field("size", &self.size)
            .field("kind", &self.kind)
            .field("align", &self.align)
            .field("opts", &self.opts)
            .field("in_flight", &self.in_flight)
            .field("in_kernel", &self.occupied())
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

fn nanos_since(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Sets up the ring for `opts`; the probe has already shown that a plain ring works, so a failure
/// here is blamed on the flag that asked for more.
fn build_ring(path: &Path, opts: &UringOptions, sqpoll_idle_ms: u32) -> Result<IoUring> {
    let entries = opts.qd.next_power_of_two();
    let mut b = IoUring::<squeue::Entry, io_uring::cqueue::Entry>::builder();
    if opts.sqpoll {
        b.setup_sqpoll(sqpoll_idle_ms);
    }
    if opts.iopoll {
        b.setup_iopoll();
    }
    b.build(entries).map_err(|cause| {
        let errno = cause.raw_os_error();
        let (option, reason) = match (opts.sqpoll, opts.iopoll, errno) {
            (true, _, Some(libc::EPERM)) => (
                "sqpoll",
                "not permitted: before Linux 5.11 an SQPOLL ring needs CAP_SYS_ADMIN (5.13+: CAP_SYS_NICE \
                 only to pin the thread); run as root or turn sqpoll off",
            ),
            (true, false, _) => ("sqpoll", "the kernel refused an SQPOLL ring; turn sqpoll off"),
            (false, true, _) => ("iopoll", "the kernel refused an IOPOLL ring; turn iopoll off"),
            (true, true, _) => ("sqpoll and iopoll", "the kernel refused this ring; turn one of them off"),
            (false, false, _) => {
                return Error::UringUnavailable { reason: setup_reason(errno, disabled_sysctl()), cause: Some(cause) }
            }
        };
        Error::UringOption { path: path.into(), option, reason: reason.into(), cause: Some(cause) }
    })
}

/// `kernel.io_uring_disabled`, when the kernel has the sysctl.
fn disabled_sysctl() -> Option<u32> {
    std::fs::read_to_string(IO_URING_DISABLED).ok()?.trim().parse().ok()
}

/// Why `io_uring_setup` failed with `errno`, given the `kernel.io_uring_disabled` sysctl.
fn setup_reason(errno: Option<i32>, disabled: Option<u32>) -> String {
    match (errno, disabled) {
        (Some(libc::ENOSYS), _) => "the kernel has no io_uring (ENOSYS: Linux before 5.1, or built without \
                                    CONFIG_IO_URING)"
            .into(),
        (Some(libc::EPERM), Some(2)) => "disabled by the sysctl kernel.io_uring_disabled = 2".into(),
        (Some(libc::EPERM), Some(1)) => "restricted by the sysctl kernel.io_uring_disabled = 1 to members of \
                                         kernel.io_uring_group and CAP_SYS_ADMIN"
            .into(),
        (Some(libc::EPERM), _) => "io_uring_setup is not permitted (EPERM): a seccomp filter (e.g. a container \
                                   runtime's default profile) blocks it"
            .into(),
        (Some(libc::ENOMEM), _) => "the rings cannot be allocated (ENOMEM: before Linux 5.12 they count against \
                                    RLIMIT_MEMLOCK; raise `ulimit -l`)"
            .into(),
        (Some(libc::EMFILE), _) => "no file descriptor left for the ring (EMFILE: the process's RLIMIT_NOFILE, \
                                    `ulimit -n`, is reached)"
            .into(),
        (Some(libc::ENFILE), _) => {
            "no file descriptor left for the ring (ENFILE: the system's file table is full)".into()
        }
        // The OS error itself is the `source()` of the error this reason goes into.
        (Some(e), _) => format!("io_uring_setup failed: unexpected errno {e}"),
        (None, _) => "io_uring_setup failed".into(),
    }
}

fn probe_uncached() -> std::result::Result<(), (String, Option<i32>)> {
    let disabled = disabled_sysctl();
    if disabled == Some(2) {
        return Err(("disabled by the sysctl kernel.io_uring_disabled = 2".into(), None));
    }
    let mut ring = IoUring::new(2).map_err(|e| (setup_reason(e.raw_os_error(), disabled), e.raw_os_error()))?;
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe).map_err(|e| {
        let why = "IORING_REGISTER_PROBE failed (Linux before 5.6 cannot list its opcodes, and lacks IORING_OP_READ)";
        (why.to_string(), e.raw_os_error())
    })?;
    if !probe.is_supported(opcode::Read::CODE) {
        return Err(("the kernel does not support IORING_OP_READ (Linux 5.6+)".into(), None));
    }
    let nop = opcode::Nop::new().build().user_data(7);
    // SAFETY: a NOP carries no pointer: nothing of ours is lent to the kernel.
    unsafe { ring.submission().push(&nop) }.map_err(|_| ("cannot queue a NOP on a new ring".to_string(), None))?;
    ring.submit_and_wait(1).map_err(|e| {
        let why = match e.raw_os_error() {
            Some(libc::EPERM) => "io_uring_enter is not permitted (EPERM): a seccomp filter blocks it".to_string(),
            _ => "io_uring_enter failed on a NOP".to_string(),
        };
        (why, e.raw_os_error())
    })?;
    let cqe = ring.completion().next().map(|c| (c.user_data(), c.result()));
    match cqe {
        Some((7, res)) if res >= 0 => Ok(()),
        Some((_, res)) => Err((format!("a NOP completed with {res}"), Some(-res))),
        None => Err(("a NOP did not complete".into(), None)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use picchio_core::ByteOffset;

    fn assert_send<T: Send>() {}

    #[test]
    fn queue_is_send() {
        assert_send::<UringQueue>();
    }

    /// A queue over a fresh file in a scratch dir under the target directory (always `Some`).
    ///
    /// # Panics
    /// When io_uring is unavailable here or the file system refuses O_DIRECT (naming why): these
    /// tests are the engine's own, a skip would read as a pass.
    fn queue(len: usize, opts: UringOptions) -> Option<(tempfile::TempDir, UringQueue, Vec<u8>)> {
        if let Err(e) = UringQueue::probe() {
            panic!("io_uring unavailable here (kernel, sysctl or seccomp): {e}");
        }
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR").to_string() + "/../target").unwrap();
        let path = dir.path().join("data");
        let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        match UringQueue::open(&path, opts) {
            Ok(q) => Some((dir, q, bytes)),
            Err(e) => panic!("{e}"),
        }
    }

    fn submit(q: &mut UringQueue, offset: u64, len: u32, tag: u64) {
        let buf = AlignedBuf::new(len.max(4096) as usize, 4096).unwrap();
        q.submit(ReadReq { offset: ByteOffset(offset), len, buf, tag: Tag(tag) });
    }

    fn reap_all(q: &mut UringQueue) -> Vec<Completion> {
        let mut out = Vec::new();
        while q.in_flight() > 0 {
            q.reap(1, &mut out);
        }
        out.sort_by_key(|c| c.tag.0);
        out
    }

    fn os_error(c: &Completion) -> Option<i32> {
        let e = c.result.as_ref().expect_err("an error completion");
        match e.get_ref().and_then(|e| e.downcast_ref::<Error>()) {
            Some(Error::Read { cause, .. }) => cause.raw_os_error(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn setup_reasons_name_the_cause() {
        assert!(setup_reason(Some(libc::ENOSYS), None).contains("ENOSYS"));
        assert!(setup_reason(Some(libc::EPERM), Some(2)).contains("io_uring_disabled = 2"));
        assert!(setup_reason(Some(libc::EPERM), Some(1)).contains("io_uring_group"));
        assert!(setup_reason(Some(libc::EPERM), Some(0)).contains("seccomp"));
        assert!(setup_reason(Some(libc::EPERM), None).contains("seccomp"));
        assert!(setup_reason(Some(libc::ENOMEM), None).contains("RLIMIT_MEMLOCK"));
        assert!(setup_reason(Some(libc::EMFILE), None).contains("RLIMIT_NOFILE"));
        assert!(setup_reason(Some(libc::EFAULT), None).starts_with("io_uring_setup failed: "));
    }

    #[test]
    fn options_are_checked() {
        for qd in [0, MAX_QD + 1] {
            let e = UringQueue::open("/nonexistent", UringOptions::direct(qd)).unwrap_err();
            assert_eq!(e.to_string(), format!("invalid I/O options: UringOptions::qd = {qd}, expected 1..=256"));
        }
        let opts = UringOptions { iopoll: true, ..UringOptions::buffered(4) };
        let e = UringQueue::open("/nonexistent", opts).unwrap_err();
        assert!(matches!(e, Error::IopollNeedsDirect), "{e}");
        assert!(
            e.to_string().contains("UringOptions::iopoll") && e.to_string().contains("UringOptions::direct"),
            "{e}"
        );
    }

    #[test]
    fn describe_names_mode_depth_and_flags() {
        let Some((_d, q, _)) = queue(8192, UringOptions::buffered(4)) else { return };
        assert_eq!(q.describe(), "uring(buffered, qd 4, fixed file)");
        assert_eq!(q.block_size(), MIN_REPORTED_BLOCK_SIZE);
        let Some((_d, q, _)) = queue(8192, UringOptions { register_files: false, ..UringOptions::buffered(32) }) else {
            return;
        };
        assert_eq!(q.describe(), "uring(buffered, qd 32)");
    }

    #[test]
    fn eagain_and_eintr_are_resubmitted() {
        let Some((_d, mut q, bytes)) = queue(4 * 4096, UringOptions::buffered(2)) else { return };
        q.faults = vec![(0, -libc::EAGAIN), (0, -libc::EINTR), (4096, -libc::EAGAIN)];
        submit(&mut q, 0, 4096, 0);
        submit(&mut q, 4096, 4096, 1);
        let out = reap_all(&mut q);
        assert!(q.faults.is_empty());
        for (i, c) in out.iter().enumerate() {
            assert_eq!(*c.result.as_ref().unwrap(), 4096);
            assert_eq!(c.buf.as_slice()[..4096], bytes[i * 4096..(i + 1) * 4096]);
        }
    }

    #[test]
    fn retries_are_bounded_then_reported() {
        let Some((_d, mut q, _)) = queue(4096, UringOptions::buffered(1)) else { return };
        q.faults = vec![(0, -libc::EAGAIN); MAX_RETRIES as usize + 1];
        submit(&mut q, 0, 4096, 0);
        let out = reap_all(&mut q);
        assert_eq!(os_error(&out[0]), Some(libc::EAGAIN));
    }

    #[test]
    fn short_reads_are_resubmitted_for_the_rest() {
        let Some((_d, mut q, bytes)) = queue(64 * 1024, UringOptions::buffered(4)) else { return };
        // The first read "returns" 4096 bytes, then the rest from 4096 returns 1 byte.
        q.faults = vec![(0, 4096), (4096, 1)];
        submit(&mut q, 0, 32 * 1024, 0);
        let c = reap_all(&mut q).pop().unwrap();
        assert_eq!(*c.result.as_ref().unwrap(), 32 * 1024);
        assert!(c.buf.as_slice()[..32 * 1024] == bytes[..32 * 1024]);
        assert!(q.faults.is_empty(), "both short reads were continued");
    }

    #[test]
    fn kernel_errors_name_path_offset_and_length() {
        let Some((_d, mut q, _)) = queue(3 * 4096, UringOptions::buffered(4)) else { return };
        q.faults = vec![(4096, -libc::EIO)];
        submit(&mut q, 4096, 8192, 0);
        submit(&mut q, 0, 4096, 1);
        let out = reap_all(&mut q);
        assert_eq!(os_error(&out[0]), Some(libc::EIO));
        let s = out[0].result.as_ref().unwrap_err().to_string();
        assert!(s.contains("read of 8192 bytes at offset 0x1000") && s.contains(&q.path.display().to_string()), "{s}");
        assert_eq!(out[0].buf.len(), 8192);
        assert_eq!(*out[1].result.as_ref().unwrap(), 4096);
    }

    #[test]
    fn a_broken_ring_fails_every_request_and_keeps_the_contract() {
        let Some((_d, mut q, _)) = queue(64 * 4096, UringOptions::buffered(2)) else { return };
        for i in 0..5 {
            submit(&mut q, i * 4096, 4096, i);
        }
        assert_eq!((q.occupied(), q.waiting.len()), (2, 3));
        q.enter_fault = Some(libc::EBADF);
        let out = reap_all(&mut q);
        assert_eq!(out.len(), 5);
        for c in &out {
            assert_eq!(os_error(c), Some(libc::EBADF));
            assert_eq!(c.buf.len(), 4096);
        }
        submit(&mut q, 0, 4096, 9);
        assert_eq!(os_error(&reap_all(&mut q)[0]), Some(libc::EBADF));
        // Dropping a broken queue must not wait for (or free) what the kernel was given.
    }

    /// The SQPOLL hang of stop 16 (a waiter in `io_cqring_wait`, the polling thread asleep, a read
    /// pending), made deterministic: with a 1 ms idle time the thread is asleep (NEED_WAKEUP set,
    /// waited for, not slept for) before each of 100 reads; every other read loses both wakeups (at
    /// submit and at the wait), which left that waiter blocked for good before the wait slices. Each
    /// read must complete with the file's bytes, and each lost wakeup must have been recovered by a
    /// slice that ended short. A watchdog turns a hang into a failure.
    #[test]
    fn sqpoll_reads_complete_when_the_polling_thread_sleeps_and_wakeups_are_lost() {
        if let Err(e) = UringQueue::probe() {
            panic!("io_uring unavailable here (kernel, sysctl or seccomp): {e}");
        }
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR").to_string() + "/../target").unwrap();
        let path = dir.path().join("data");
        let bytes: Vec<u8> = (0..64 * 4096).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let opts = UringOptions { sqpoll: true, ..UringOptions::buffered(4) };
            let mut q = UringQueue::open_with_idle(&path, opts, 1).unwrap();
            if !q.ring.params().is_feature_ext_arg() {
                panic!("this kernel has no IORING_FEAT_EXT_ARG (Linux 5.11+): SQPOLL waits are not sliced");
            }
            submit(&mut q, 0, 4096, 0); // the thread's first work: it sleeps after it
            reap_all(&mut q);
            let mut lost = 0;
            for i in 0..100u64 {
                while !q.ring.submission().need_wakeup() {
                    std::thread::yield_now();
                }
                if i % 2 == 1 {
                    q.lose_wakeups = 2;
                    lost += 1;
                }
                let at = (i * 7 % 64) * 4096;
                submit(&mut q, at, 4096, i);
                let c = reap_all(&mut q).pop().unwrap();
                assert_eq!(*c.result.as_ref().unwrap(), 4096, "read {i}");
                assert!(c.buf.as_slice()[..4096] == bytes[at as usize..at as usize + 4096], "read {i}");
                assert_eq!(q.lose_wakeups, 0, "read {i}: both wakeups were left out");
            }
            tx.send((lost, q.sqpoll_rewakes())).unwrap();
        });
        let (lost, rewakes) = rx
            .recv_timeout(std::time::Duration::from_secs(600))
            .expect("SQPOLL reads hung (or the test thread panicked: see above)");
        assert!(rewakes >= lost, "{lost} wakeups lost, only {rewakes} slices ended short and re-woke the thread");
    }

    #[test]
    fn drain_waits_for_every_read_in_the_kernel() {
        let Some((_d, mut q, _)) = queue(1 << 20, UringOptions::buffered(8)) else { return };
        for i in 0..40u64 {
            submit(&mut q, (i % 16) * 65536, 65536, i);
        }
        q.reap(0, &mut Vec::new()); // submit the first batch
        q.drain();
        assert_eq!((q.occupied(), q.waiting.len()), (0, 0));
        assert!(q.ring.completion().is_empty());
    }

    /// A completion that never comes (here its CQE is dropped unread, as the test twin does): the
    /// drain gives the read up after `drain_patience` empty waits, marks the ring broken so `Drop`
    /// leaks the buffer, and returns, with and without SQPOLL. (The case: a CI run whose uring
    /// test hung forever in `Drop` with SQPOLL, after every read of the queue had completed.)
    #[test]
    fn drain_gives_up_a_read_whose_completion_never_comes() {
        for sqpoll in [false, true] {
            let Some((_d, mut q, _)) = queue(1 << 20, UringOptions { sqpoll, ..UringOptions::buffered(4) }) else {
                return;
            };
            if !q.ring.params().is_feature_ext_arg() {
                panic!("this kernel has no IORING_FEAT_EXT_ARG (Linux 5.11+): drain waits are not bounded");
            }
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                q.drain_patience = 4;
                submit(&mut q, 0, 4096, 0);
                submit(&mut q, 65536, 4096, 1);
                q.reap(0, &mut Vec::new()); // both in the kernel
                q.lose_cqes = 1; // the first CQE to come is dropped unread: that read never completes
                q.drain();
                tx.send((q.occupied(), q.broken)).unwrap();
                // Drop leaks the slot's buffer (the ring is broken) and returns.
            });
            let (occupied, broken) = rx
                .recv_timeout(std::time::Duration::from_secs(600))
                .expect("the drain of a read whose completion never comes did not return");
            // One slot at least is never freed (two when the kernel completed neither read in time).
            assert!(occupied >= 1, "sqpoll {sqpoll}: {occupied} reads given up");
            assert_eq!(broken, Some(libc::ETIMEDOUT), "sqpoll {sqpoll}");
        }
    }
}
