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
//! the pointer is valid until reaped, even when its request has been given up by the read timeout
//! (see below). Dropping the queue first waits for every read in the kernel;
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
//! # No wait without a bound: reads that never complete
//! A read whose CQE has not come [`DEFAULT_READ_TIMEOUT`] (30 s, [`UringQueue::set_read_timeout`])
//! after it entered the kernel is *given up*: `reap` completes its request at once with an error of
//! kind [`io::ErrorKind::TimedOut`] (an [`Error::Read`] naming path, offset and length, whose cause
//! says how long it waited, the bytes already read and the retries), and logs once the state of the
//! ring (see below). Every wait of `reap` is bounded by the nearest deadline (an `EXT_ARG` timeout,
//! Linux 5.11+; older kernels wait unbounded, as before), so a lost completion costs the bound, not
//! the process.
//!
//! The kernel may still write into a given-up read's buffer, so that buffer is **not** handed back:
//! the slot keeps it, marked *abandoned*, and the request completes with a fresh zeroed buffer of
//! the same length and alignment (the caller's slot is replaced, not lost: every submitted request
//! still comes back exactly once, and the flat store turns the error into a fallback load of that
//! expert, as for any failed read). When the abandoned read's CQE comes after all, it is ignored (no
//! second completion, no resubmission of a short read) and only then is the buffer freed and the
//! slot reused; until then the queue runs with one slot fewer. Requests queued in the FIFO while
//! every slot is abandoned are given up the same way `read_timeout` after their submission, with
//! their own buffer (the kernel never had it). `Drop` waits for abandoned reads too, with the drain's
//! patience, and leaks what it gives up.
//!
//! The stall log tells a kernel stall from our own bookkeeping: the SQ and CQ head and tail as this
//! queue sees them (SQ tail = SQEs pushed, CQ head = CQEs consumed, the other end read from the
//! ring), the SQPOLL `NEED_WAKEUP` and CQ-overflow flags, the slab (live, abandoned, free, FIFO), and
//! the kernel's own view from `/proc/self/fdinfo/<ring fd>` (`SqHead`, `SqTail`, `CachedSqHead`,
//! `CqHead`, `CqTail`, `CachedCqTail`, `SqThread`, `SqThreadCpu`) with the polling thread's
//! scheduler state from `/proc/self/task/<SqThread>/stat`. An SQ tail ahead of the kernel's head
//! means the kernel never picked the SQE up; a CQ tail ahead of our head, a CQE we failed to see;
//! both equal with a read pending, a read the kernel holds (block layer, file system, device).
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

/// How long a read may stay in the kernel before `reap` gives it up (see the module documentation);
/// [`UringQueue::set_read_timeout`] changes it per queue.
const DEFAULT_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

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
    /// When the kernel was first given the read's SQE (with SQPOLL when it was pushed, else at the
    /// `io_uring_enter` that submitted it; `None` until then): the read timeout counts from here, so
    /// a caller computing between `submit` and `reap` does not run the clock of reads the kernel has
    /// not seen.
    started: Option<Instant>,
    /// Given up by the read timeout: the request has completed with a fresh buffer; this slot keeps
    /// `buf` until the kernel's CQE comes (then ignored) or the ring is torn down.
    abandoned: bool,
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
/// * A read whose completion has not come 30 s (see [`UringQueue::set_read_timeout`]) after the
///   kernel got it completes with an [`io::ErrorKind::TimedOut`] error and a fresh buffer; its own
///   buffer stays with the queue until the kernel completes it (see the module documentation).
/// * Dropping the queue discards requests still waiting in the FIFO and waits for the reads in the
///   kernel before freeing their buffers; after 30 s without a completion it leaks them instead.
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
    /// Test twin: the next CQE of the read at each of these offsets (`offset + done`) is dropped
    /// unread.
    #[cfg(test)]
    lose_cqe_at: Vec<u64>,
    /// Test twin: the next CQE of the read at each of these offsets is held back (a late completion)
    /// until [`UringQueue::release_held_cqes`].
    #[cfg(test)]
    hold_cqe_at: Vec<u64>,
    /// Test twin: CQEs held back, `(user_data, res)`.
    #[cfg(test)]
    held: Vec<(u64, i32)>,
    /// Test twin: the held CQEs are delivered at the next harvest.
    #[cfg(test)]
    release_held: bool,
    /// Slots whose SQE found the SQ full, in order (see [`UringQueue::push`]).
    unpushed: VecDeque<u32>,
    /// Test twin: this many SQE pushes are refused as if the SQ were full.
    #[cfg(test)]
    refuse_pushes: u32,
    /// How long a read may stay in the kernel ([`DEFAULT_READ_TIMEOUT`]).
    read_timeout: std::time::Duration,
    /// Requests given up by the read timeout so far.
    timeouts: u64,
    /// SQEs pushed so far: the SQ tail as we wrote it (the kernel's ring starts at 0; wraps).
    sq_pushed: u32,
    /// CQEs consumed so far: the CQ head as we wrote it (wraps).
    cq_consumed: u32,
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
            #[cfg(test)]
            lose_cqe_at: Vec::new(),
            #[cfg(test)]
            hold_cqe_at: Vec::new(),
            #[cfg(test)]
            held: Vec::new(),
            #[cfg(test)]
            release_held: false,
            unpushed: VecDeque::new(),
            #[cfg(test)]
            refuse_pushes: 0,
            read_timeout: DEFAULT_READ_TIMEOUT,
            timeouts: 0,
            sq_pushed: 0,
            cq_consumed: 0,
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

    /// Sets how long a read may stay in the kernel before `reap` gives it up and completes it with
    /// a [`io::ErrorKind::TimedOut`] error (see the module documentation); at least 1 ms. Default
    /// 30 s (`DEFAULT_READ_TIMEOUT`).
    pub fn set_read_timeout(&mut self, timeout: std::time::Duration) {
        self.read_timeout = timeout.max(std::time::Duration::from_millis(1));
    }

    /// Requests given up by the read timeout since the queue was opened (each completed once with a
    /// `TimedOut` error).
    pub fn timeouts(&self) -> u64 {
        self.timeouts
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
        let entry = InFlight {
            tag,
            buf,
            offset: offset.0,
            len,
            done: 0,
            retries: 0,
            submitted: w.submitted,
            started: None,
            abandoned: false,
        };
        self.slab[idx as usize] = Some(entry);
        self.push(idx);
        Ok(())
    }

    /// Pushes the SQE reading the rest of slot `idx`'s request (`offset + done`, `len - done`); when
    /// the SQ is full, the slot waits in `unpushed` for [`UringQueue::push_unpushed`].
    ///
    /// A full SQ with a free slot happens under SQPOLL: the polling thread publishes the SQ head
    /// only after issuing its whole batch, and a buffered read completes inline during its issue,
    /// so its CQE can be reaped, its slot refilled and a new SQE pushed while the SQEs it consumed
    /// still count as queued (seen under load: 9 of 480 parallel runs of the integration tests
    /// panicked here, and the slot left without an SQE then stalled `Drop`'s drain for 30 s).
    /// SQPOLL rings get 2 × `qd` SQ entries so that a lagging head cannot fill them; this path
    /// keeps the queue correct whatever the kernel does.
    fn push(&mut self, idx: u32) {
        if self.opts.sqpoll {
            // The polling thread sees the SQE as soon as it is pushed (or is about to be given it:
            // a read stuck unpushed times out too); without SQPOLL the next `enter` submits it.
            self.slab[idx as usize].as_mut().expect("occupied").started.get_or_insert_with(Instant::now);
        }
        if !self.try_push(idx) {
            self.unpushed.push_back(idx);
        }
    }

    /// Pushes the SQEs of the slots that found the SQ full, in order, until it is full again; a slot
    /// given up by the timeout meanwhile is freed (the kernel never had its buffer).
    fn push_unpushed(&mut self) {
        while let Some(&idx) = self.unpushed.front() {
            if self.slab[idx as usize].as_ref().is_some_and(|e| e.abandoned) {
                self.unpushed.pop_front();
                self.slab[idx as usize] = None;
                self.free.push(idx);
                continue;
            }
            if !self.try_push(idx) {
                break;
            }
            self.unpushed.pop_front();
        }
    }

    /// One attempt of [`UringQueue::push`]: false when the SQ is full.
    fn try_push(&mut self, idx: u32) -> bool {
        #[cfg(test)]
        if self.refuse_pushes > 0 {
            self.refuse_pushes -= 1;
            return false;
        }
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
        // for the life of the ring, which is closed before `file`. A refused push (SQ full) queues
        // nothing and lends nothing.
        let pushed = unsafe { self.ring.submission().push(&sqe) };
        if pushed.is_err() {
            return false;
        }
        self.sq_pushed = self.sq_pushed.wrapping_add(1);
        true
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

    /// Slots whose read is queued or in the kernel (abandoned ones included).
    fn occupied(&self) -> usize {
        self.slab.len() - self.free.len()
    }

    /// Slots whose read is in the kernel and not abandoned: completions the caller still waits for.
    fn live(&self) -> usize {
        self.slab.iter().flatten().filter(|e| !e.abandoned).count()
    }

    /// Copies the available CQEs out of the ring into `self.cqes`.
    fn copy_cqes(&mut self) {
        self.cqes.clear();
        self.cqes.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        self.cq_consumed = self.cq_consumed.wrapping_add(self.cqes.len() as u32);
        #[cfg(test)]
        while self.lose_cqes > 0 && !self.cqes.is_empty() {
            self.lose_cqes -= 1;
            self.cqes.remove(0);
        }
        #[cfg(test)]
        if !self.lose_cqe_at.is_empty() || !self.hold_cqe_at.is_empty() {
            let mut kept = Vec::with_capacity(self.cqes.len());
            for &(ud, res) in &self.cqes {
                let at = self.slab.get(ud as usize).and_then(Option::as_ref).map(|e| e.offset + u64::from(e.done));
                if let Some(i) = at.and_then(|at| self.lose_cqe_at.iter().position(|&o| o == at)) {
                    self.lose_cqe_at.remove(i);
                } else if let Some(i) = at.and_then(|at| self.hold_cqe_at.iter().position(|&o| o == at)) {
                    self.hold_cqe_at.remove(i);
                    self.held.push((ud, res));
                } else {
                    kept.push((ud, res));
                }
            }
            self.cqes = kept;
        }
        #[cfg(test)]
        if std::mem::take(&mut self.release_held) {
            self.cqes.append(&mut self.held);
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
        if e.abandoned {
            // The late CQE of a read given up by the timeout: the kernel is done with the buffer
            // now. Its request has completed already; nothing is resubmitted or reported.
            tracing::warn!(
                "{}: the read of {} B at {:#x} given up by the timeout completed after {:?} (result {res}); ignored",
                self.path.display(),
                e.len,
                e.offset,
                e.started.map(|t| t.elapsed()).unwrap_or_default()
            );
            self.slab[idx] = None;
            return self.free.push(idx as u32);
        }
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

    /// Submits the pushed SQEs and waits for `want` completions, at most `limit` when given (and the
    /// kernel has `IORING_FEAT_EXT_ARG`). Retryable errors return (the caller loops); any other
    /// error breaks the ring (see [`UringQueue::fail_all`]).
    fn enter(&mut self, want: usize, limit: Option<std::time::Duration>) {
        if !self.opts.sqpoll {
            // This call submits every pushed SQE: their reads' timeouts start now.
            let now = Instant::now();
            for e in self.slab.iter_mut().flatten() {
                e.started.get_or_insert(now);
            }
        }
        #[cfg(test)]
        let r = match self.enter_fault.take() {
            Some(errno) => Err(io::Error::from_raw_os_error(errno)),
            None => self.submit_and_wait(want, limit),
        };
        #[cfg(not(test))]
        let r = self.submit_and_wait(want, limit);
        match r.map_err(|e| e.raw_os_error()) {
            Ok(_) => {}
            // ETIME: a bounded wait ended (an SQPOLL slice: the thread has been woken); the caller
            // checks the read deadlines and loops.
            Err(Some(libc::EINTR | libc::ETIME)) => {}
            // EAGAIN: the kernel is short of memory for requests; EBUSY: completions must be reaped
            // first. Both clear up once the caller's loop harvests.
            Err(Some(libc::EAGAIN | libc::EBUSY)) => std::thread::yield_now(),
            Err(errno) => self.fail_all(errno.unwrap_or(libc::EIO)),
        }
    }

    /// `submit_and_wait`, lasting at most `limit` when given (`ETIME` when it ends with fewer
    /// completions, unless SQEs were submitted), with SQPOLL waits in slices of at most
    /// [`SQPOLL_WAIT_SLICE`] (see the module documentation). Without `IORING_FEAT_EXT_ARG` (before
    /// Linux 5.11) the io-uring crate's unbounded wait.
    fn submit_and_wait(&mut self, want: usize, limit: Option<std::time::Duration>) -> io::Result<usize> {
        let ext_arg = self.ring.params().is_feature_ext_arg();
        if !self.opts.sqpoll {
            return match limit {
                Some(limit) if want > 0 && ext_arg => {
                    let ts = types::Timespec::from(limit);
                    let args = types::SubmitArgs::new().timespec(&ts);
                    self.ring.submitter().submit_with_args(want, &args)
                }
                _ => self.ring.submit_and_wait(want),
            };
        }
        let slice = limit.map_or(SQPOLL_WAIT_SLICE, |l| l.min(SQPOLL_WAIT_SLICE));
        #[cfg(test)]
        if self.lose_wakeups > 0 && self.ring.submission().need_wakeup() {
            self.lose_wakeups -= 1;
            return if want == 0 { Ok(0) } else { self.sqpoll_wait(want, false, slice) };
        }
        if want == 0 || !ext_arg {
            return self.ring.submit_and_wait(want);
        }
        // `need_wakeup` fences (SeqCst) before reading the flag: our tail store, published when the
        // `SubmissionQueue` that pushed was dropped, is ordered before the read, as the kernel
        // thread orders its flag store before re-reading the tail.
        let wake = self.ring.submission().need_wakeup();
        self.sqpoll_wait(want, wake, slice)
    }

    /// One SQPOLL wait slice of `slice` for `want` completions, waking the polling thread first
    /// when `wake`; when the slice ends short (`ETIME`, returned), the thread is woken
    /// unconditionally.
    fn sqpoll_wait(&mut self, want: usize, wake: bool, slice: std::time::Duration) -> io::Result<usize> {
        let mut flags = EnterFlags::GETEVENTS | EnterFlags::EXT_ARG;
        if wake {
            flags |= EnterFlags::SQ_WAKEUP;
        }
        let ts = types::Timespec::from(slice);
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
                "{}: SQPOLL wait slice of {slice:?} ended with reads pending; waking the polling thread",
                self.path.display()
            );
            // SAFETY: a wakeup carries no argument and no pointer (`arg` is null, size 0).
            unsafe { self.ring.submitter().enter::<libc::sigset_t>(0, 0, EnterFlags::SQ_WAKEUP.bits(), None) }?;
        }
        r
    }

    /// SQPOLL waits that ended a slice short and woke the polling thread unconditionally (see the
    /// module documentation): 0 unless a read took longer than `SQPOLL_WAIT_SLICE` (50 ms) or a wakeup
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
        self.unpushed.clear();
        for idx in 0..self.slab.len() {
            let Some(e) = self.slab[idx].take() else { continue };
            self.free.push(idx as u32);
            if e.abandoned {
                // Its request completed at the timeout: only the buffer is left, and it is leaked.
                std::mem::forget(e.buf);
                continue;
            }
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
        // Slots whose SQE never reached the ring: the kernel never had their buffers.
        while let Some(idx) = self.unpushed.pop_front() {
            self.slab[idx as usize] = None;
            self.free.push(idx);
        }
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
        self.submit_and_wait(1, Some(SQPOLL_WAIT_SLICE))
    }

    /// The reads still in the kernel after `slices` empty waits are given up: logged, and the ring
    /// marked broken so `Drop` leaks their buffers.
    fn give_up_in_flight(&mut self, slices: u32) {
        let pending: Vec<String> = self
            .slab
            .iter()
            .flatten()
            .map(|e| {
                let abandoned = if e.abandoned { ", given up by the read timeout" } else { "" };
                format!("{} B at {:#x} ({} read, {} retries{abandoned})", e.len, e.offset, e.done, e.retries)
            })
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

    /// Gives up every live read that entered the kernel `read_timeout` or more before `now`, and,
    /// when every slot is held by an abandoned read, every FIFO request submitted that long ago
    /// (see the module documentation): their requests complete in `ready` with a `TimedOut` error,
    /// and the ring's state is logged once for the lot. Returns whether any was given up.
    fn expire(&mut self, now: Instant) -> bool {
        let limit = self.read_timeout;
        let mut given = Vec::new();
        for idx in 0..self.slab.len() {
            let Some(e) = self.slab[idx].as_ref() else { continue };
            let Some(started) = e.started else { continue };
            let waited = now.saturating_duration_since(started);
            if e.abandoned || waited < limit {
                continue;
            }
            // A replacement for the buffer the kernel may still write: the caller gets its slot
            // back (zeroed, same shape); this one stays here until its CQE or the ring's end.
            let fresh = match AlignedBuf::new(e.buf.len(), e.buf.align()) {
                Ok(b) => b,
                Err(err) => {
                    tracing::error!(
                        "{}: cannot allocate a replacement buffer of {} B to give up a stalled read: {err}; \
                         waiting on for another {limit:?}",
                        self.path.display(),
                        e.buf.len()
                    );
                    self.slab[idx].as_mut().expect("occupied").started = Some(now);
                    continue;
                }
            };
            let what = format!(
                "no completion {waited:?} after the read entered the kernel ({} of {} bytes read, {} \
                 retries; ETIMEDOUT): given up, its buffer kept until the kernel completes it",
                e.done, e.len, e.retries
            );
            given.push(format!("{} B at {:#x} ({} read, {} retries)", e.len, e.offset, e.done, e.retries));
            let cause = io::Error::new(io::ErrorKind::TimedOut, what);
            let err = Error::Read { path: self.path.clone(), offset: e.offset, len: e.len, cause };
            let completion =
                Completion { tag: e.tag, buf: fresh, result: Err(err.into_io()), latency_ns: nanos_since(e.submitted) };
            self.ready.push_back(completion);
            self.slab[idx].as_mut().expect("occupied").abandoned = true;
        }
        if self.free.is_empty() && self.live() == 0 {
            while self.waiting.front().is_some_and(|w| now.saturating_duration_since(w.submitted) >= limit) {
                let w = self.waiting.pop_front().expect("a front");
                let (offset, len) = (w.req.offset.0, w.req.len);
                let what = format!(
                    "no free slot {:?} after submission: every slot is held by a read given up by the \
                     timeout (ETIMEDOUT); never submitted",
                    now.saturating_duration_since(w.submitted)
                );
                given.push(format!("{len} B at {offset:#x} (queued)"));
                let cause = io::Error::new(io::ErrorKind::TimedOut, what);
                self.refuse(w.req, w.submitted, Error::Read { path: self.path.clone(), offset, len, cause });
            }
        }
        if given.is_empty() {
            return false;
        }
        self.timeouts += given.len() as u64;
        let state = self.ring_state();
        // Tests install no subscriber: the stall's state goes to the test's captured output too.
        #[cfg(test)]
        eprintln!(
            "{}: {} reads given up after {limit:?}: {}; {state}",
            self.path.display(),
            given.len(),
            given.join(", ")
        );
        tracing::error!(
            "{}: giving up {} reads after the read timeout of {limit:?}: {}; {state}",
            self.path.display(),
            given.len(),
            given.join(", "),
        );
        true
    }

    /// The nearest read deadline after `now` (a live read's, or a FIFO request's when every slot is
    /// abandoned), as a wait bound of at least 1 ms; `None` when there is none.
    fn until_deadline(&self, now: Instant) -> Option<std::time::Duration> {
        // A read not submitted yet is, at the latest, by the wait this bound is for.
        let mut first = self.slab.iter().flatten().filter(|e| !e.abandoned).map(|e| e.started.unwrap_or(now)).min();
        if self.free.is_empty() && first.is_none() {
            first = self.waiting.front().map(|w| w.submitted);
        }
        let left = (first? + self.read_timeout).saturating_duration_since(now);
        Some(left.max(std::time::Duration::from_millis(1)))
    }

    /// The ring's state for the stall log (see the module documentation): our view of the SQ and CQ
    /// heads and tails and flags, the slab, and the kernel's view from `/proc/self/fdinfo`.
    fn ring_state(&mut self) -> String {
        let (sq_len, need_wakeup, cq_overflow, dropped) = {
            let sq = self.ring.submission();
            (sq.len() as u32, sq.need_wakeup(), sq.cq_overflow(), sq.dropped())
        };
        let cq_len = self.ring.completion().len() as u32;
        let abandoned = self.slab.iter().flatten().filter(|e| e.abandoned).count();
        let mut s = format!(
            "ring as seen here: SQ head {} tail {}, CQ head {} tail {}, NEED_WAKEUP {need_wakeup}, CQ overflow \
             {cq_overflow}, dropped {dropped}; slots: {} live, {abandoned} abandoned, {} free; {} queued",
            self.sq_pushed.wrapping_sub(sq_len),
            self.sq_pushed,
            self.cq_consumed,
            self.cq_consumed.wrapping_add(cq_len),
            self.live(),
            self.free.len(),
            self.waiting.len()
        );
        let fdinfo = format!("/proc/self/fdinfo/{}", self.ring.as_raw_fd());
        match std::fs::read_to_string(&fdinfo) {
            Ok(text) => {
                const KEYS: [&str; 8] =
                    ["SqHead", "SqTail", "CachedSqHead", "CqHead", "CqTail", "CachedCqTail", "SqThread", "SqThreadCpu"];
                let fields: Vec<(&str, &str)> = text
                    .lines()
                    .filter_map(|l| l.split_once(':'))
                    .map(|(k, v)| (k.trim(), v.trim()))
                    .filter(|(k, _)| KEYS.contains(k))
                    .collect();
                let shown: Vec<String> = fields.iter().map(|(k, v)| format!("{k} {v}")).collect();
                s.push_str(&format!("; kernel ({fdinfo}): {}", shown.join(", ")));
                let thread = fields.iter().find(|(k, _)| *k == "SqThread").map(|(_, v)| *v);
                if let Some(tid) = thread.filter(|t| t.parse::<i64>().is_ok_and(|t| t > 0)) {
                    // `pid (comm) S ...`: the state is the first field after the command's `)`.
                    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok();
                    let state =
                        stat.as_deref().and_then(|t| t.rsplit_once(')')).and_then(|(_, r)| r.split_whitespace().next());
                    if let Some(state) = state {
                        s.push_str(&format!(", SQ thread state {state}"));
                    }
                }
            }
            Err(e) => s.push_str(&format!("; {fdinfo} unreadable: {e}")),
        }
        s
    }

    /// Test twin: stops holding CQEs back and delivers the held ones at the next harvest.
    #[cfg(test)]
    fn release_held_cqes(&mut self) {
        self.hold_cqe_at.clear();
        self.release_held = true;
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
            self.enter(0, None);
        }
    }

    fn reap(&mut self, min: usize, out: &mut Vec<Completion>) -> usize {
        let start = out.len();
        let want = min.min(self.in_flight);
        loop {
            self.push_unpushed();
            self.harvest();
            self.refill();
            out.extend(self.ready.drain(..));
            let got = out.len() - start;
            let live = self.live();
            if got >= want || (live == 0 && self.waiting.is_empty()) || self.broken.is_some() {
                if live > 0 && self.broken.is_none() && !self.ring.submission().is_empty() {
                    self.enter(0, None); // start what the FIFO refilled before the caller computes
                    out.extend(self.ready.drain(..));
                }
                break;
            }
            if !self.unpushed.is_empty() {
                self.enter(0, None); // submit (or wake the polling thread) to make room, then push
                self.push_unpushed();
            }
            let now = Instant::now();
            if self.expire(now) {
                continue; // the given-up requests are in `ready`
            }
            // With live reads, wait for the completions missing; with only abandoned slots and a
            // FIFO, for any CQE (a late one frees a slot). Never past the nearest deadline.
            self.enter((want - got).min(live.max(1)), self.until_deadline(now));
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
    // SQPOLL: twice the reads in flight, as the polling thread's SQ head lags (see `UringQueue::push`).
    let entries = if opts.sqpoll { (2 * opts.qd).next_power_of_two() } else { opts.qd.next_power_of_two() };
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
    /// The error of a request given up by the read timeout: kind `TimedOut`, with its message chain.
    fn timed_out(c: &Completion) -> String {
        let e = c.result.as_ref().expect_err("a timeout");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        let mut s = e.to_string();
        let mut src = e.get_ref().and_then(|e| std::error::Error::source(e));
        while let Some(cause) = src {
            s.push_str(": ");
            s.push_str(&cause.to_string());
            src = cause.source();
        }
        s
    }

    /// Runs `f` on a thread and waits for its answer with a generous hang limit (a hang is the bug
    /// these tests exist for: it must fail, not block the run).
    fn within_hang_limit<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(f()).unwrap());
        rx.recv_timeout(std::time::Duration::from_secs(600))
            .unwrap_or_else(|_| panic!("{what}: hung (or the test thread panicked: see above)"))
    }

    /// A read whose completion never comes (its CQE dropped unread by the twin) comes back from
    /// `reap` as a `TimedOut` error naming offset, length, bytes done and retries, with a fresh
    /// buffer of the same length, while the other reads of the batch (two of them queued behind it
    /// in the FIFO) complete with the file's bytes; every tag comes back once; the abandoned read
    /// keeps its slot; the stall log's state names the kernel's view; `Drop` returns.
    #[test]
    fn a_read_whose_completion_never_comes_times_out_and_the_batch_completes() {
        for sqpoll in [false, true] {
            let Some((_d, mut q, bytes)) = queue(1 << 20, UringOptions { sqpoll, ..UringOptions::buffered(4) }) else {
                return;
            };
            if !q.ring.params().is_feature_ext_arg() {
                panic!("this kernel has no IORING_FEAT_EXT_ARG (Linux 5.11+): reap waits are not bounded");
            }
            let (out, occupied, timeouts, state) = within_hang_limit("a stalled read", move || {
                q.set_read_timeout(std::time::Duration::from_secs(1));
                q.drain_patience = 4;
                q.lose_cqe_at = vec![65536];
                for i in 0..6u64 {
                    submit(&mut q, i * 65536, 4096, i);
                }
                let out = reap_all(&mut q);
                let state = q.ring_state();
                let r = (out, q.occupied(), q.timeouts(), state);
                drop(q); // the abandoned read is given up by the drain and its buffer leaked
                r
            });
            assert_eq!(out.iter().map(|c| c.tag.0).collect::<Vec<_>>(), (0..6).collect::<Vec<_>>(), "sqpoll {sqpoll}");
            let s = timed_out(&out[1]);
            assert!(
                s.contains("4096 bytes at offset 0x10000") && s.contains("0 of 4096 bytes read, 0 retries"),
                "sqpoll {sqpoll}: {s}"
            );
            assert_eq!(out[1].buf.len(), 4096);
            for c in out.iter().filter(|c| c.tag.0 != 1) {
                let at = c.tag.0 as usize * 65536;
                assert_eq!(*c.result.as_ref().unwrap(), 4096, "sqpoll {sqpoll}, read {}", c.tag.0);
                assert!(c.buf.as_slice()[..4096] == bytes[at..at + 4096], "sqpoll {sqpoll}, read {}", c.tag.0);
            }
            assert_eq!((occupied, timeouts), (1, 1), "sqpoll {sqpoll}: the abandoned read keeps its slot");
            assert!(state.contains("SQ head") && state.contains("SqHead") && state.contains("CqTail"), "{state}");
        }
    }

    /// A late CQE for a read given up by the timeout (held back by the twin, then delivered) is
    /// ignored: no second completion; it frees the slot, and a request queued behind the abandoned
    /// slot (qd 1) then reads the file's bytes.
    #[test]
    fn a_late_completion_after_the_timeout_is_ignored() {
        for sqpoll in [false, true] {
            let Some((_d, mut q, bytes)) = queue(1 << 20, UringOptions { sqpoll, ..UringOptions::buffered(1) }) else {
                return;
            };
            let (first, second, occupied, timeouts) = within_hang_limit("a late completion", move || {
                q.set_read_timeout(std::time::Duration::from_secs(1));
                q.hold_cqe_at = vec![0];
                submit(&mut q, 0, 4096, 0);
                let first = reap_all(&mut q);
                submit(&mut q, 8192, 4096, 1); // no free slot: queued behind the abandoned read
                q.release_held_cqes();
                let second = reap_all(&mut q);
                (first, second, q.occupied(), q.timeouts())
            });
            assert_eq!(first.len(), 1, "sqpoll {sqpoll}");
            let s = timed_out(&first[0]);
            assert!(s.contains("4096 bytes at offset 0x0"), "sqpoll {sqpoll}: {s}");
            assert_eq!(second.len(), 1, "sqpoll {sqpoll}: the late CQE made no completion");
            assert_eq!(second[0].tag.0, 1);
            assert_eq!(*second[0].result.as_ref().unwrap(), 4096, "sqpoll {sqpoll}");
            assert!(second[0].buf.as_slice()[..4096] == bytes[8192..8192 + 4096], "sqpoll {sqpoll}");
            assert_eq!((occupied, timeouts), (0, 1), "sqpoll {sqpoll}");
        }
    }

    /// With every slot held by an abandoned read (qd 1, its CQE never comes), a request queued in
    /// the FIFO is given up too, with its own buffer, instead of waiting for a slot forever; `Drop`
    /// returns.
    #[test]
    fn a_request_queued_behind_abandoned_slots_times_out() {
        for sqpoll in [false, true] {
            let Some((_d, mut q, _)) = queue(1 << 20, UringOptions { sqpoll, ..UringOptions::buffered(1) }) else {
                return;
            };
            let (out, timeouts) = within_hang_limit("a request behind an abandoned slot", move || {
                q.set_read_timeout(std::time::Duration::from_secs(1));
                q.drain_patience = 4;
                q.lose_cqe_at = vec![0];
                submit(&mut q, 0, 4096, 0);
                submit(&mut q, 4096, 8192, 1);
                let out = reap_all(&mut q);
                let timeouts = q.timeouts();
                drop(q);
                (out, timeouts)
            });
            assert_eq!(out.len(), 2, "sqpoll {sqpoll}");
            assert!(timed_out(&out[0]).contains("at offset 0x0"), "sqpoll {sqpoll}");
            let s = timed_out(&out[1]);
            assert!(s.contains("8192 bytes at offset 0x1000") && s.contains("never submitted"), "sqpoll {sqpoll}: {s}");
            assert_eq!(out[1].buf.len(), 8192);
            assert_eq!(timeouts, 2, "sqpoll {sqpoll}");
        }
    }
    /// Without SQPOLL an SQE reaches the kernel only at the next `reap`: a caller that computes for
    /// longer than the read timeout between `submit` and `reap` must not see its reads given up.
    #[test]
    fn the_timeout_counts_from_submission_to_the_kernel() {
        let Some((_d, mut q, bytes)) = queue(1 << 20, UringOptions::buffered(4)) else { return };
        q.set_read_timeout(std::time::Duration::from_millis(200));
        submit(&mut q, 4096, 4096, 0);
        std::thread::sleep(std::time::Duration::from_millis(400)); // the caller computes
        let out = reap_all(&mut q);
        assert_eq!(*out[0].result.as_ref().unwrap(), 4096);
        assert!(out[0].buf.as_slice()[..4096] == bytes[4096..8192]);
        assert_eq!(q.timeouts(), 0);
    }
    /// An SQ found full with free slots (the SQPOLL head lag; made here by refusing pushes) delays
    /// the reads, never loses them: each completes once with the file's bytes.
    #[test]
    fn reads_that_find_the_sq_full_are_pushed_later() {
        for sqpoll in [false, true] {
            let Some((_d, mut q, bytes)) = queue(1 << 20, UringOptions { sqpoll, ..UringOptions::buffered(4) }) else {
                return;
            };
            let out = within_hang_limit("reads behind a full SQ", move || {
                q.refuse_pushes = 3;
                for i in 0..6u64 {
                    submit(&mut q, i * 8192, 4096, i);
                }
                let out = reap_all(&mut q);
                assert!(q.unpushed.is_empty() && q.occupied() == 0, "sqpoll {sqpoll}");
                out
            });
            assert_eq!(out.iter().map(|c| c.tag.0).collect::<Vec<_>>(), (0..6).collect::<Vec<_>>(), "sqpoll {sqpoll}");
            for c in &out {
                let at = c.tag.0 as usize * 8192;
                assert_eq!(*c.result.as_ref().unwrap(), 4096, "sqpoll {sqpoll}");
                assert!(c.buf.as_slice()[..4096] == bytes[at..at + 4096], "sqpoll {sqpoll}, read {}", c.tag.0);
            }
        }
    }
}
