//! [`IocpQueue`]: Windows' native asynchronous engine. One file handle opened with
//! `FILE_FLAG_OVERLAPPED | FILE_FLAG_NO_BUFFERING`, associated with its own I/O completion port;
//! each read is an overlapped `ReadFile` straight into the request's [`AlignedBuf`], and `reap`
//! takes completions in batches with `GetQueuedCompletionStatusEx`.
//!
//! ```text
//! submit ──(validate)──► FIFO ──(≤ qd in the kernel)──► Box<Slot>::into_raw ──► ReadFile(&slot.overlapped)
//!    └─ refused: completes at once ─┐                                                  │ completion port
//! reap ◄── ready ◄── Box::from_raw(lpOverlapped) ◄── GetQueuedCompletionStatusEx ◄─────┘
//! ```
//!
//! # Ownership
//! A started read is a heap [`Slot`] holding the `OVERLAPPED` (first, so the pointer the port hands
//! back is the slot's address) together with the request's buffer. The slot is leaked with
//! `Box::into_raw` when the read starts, so nothing in Rust refers to memory the kernel writes, and
//! rebuilt with `Box::from_raw` from the `lpOverlapped` of its dequeued completion: the slot moves
//! into the kernel and comes back with its completion. `Drop` cancels every read (`CancelIoEx`)
//! and dequeues each outstanding completion before returning, so no buffer is freed while the
//! kernel may still write it.
//!
//! Completion ports make this I/O thread-agnostic: reads started on one thread complete on the
//! port whichever thread waits on it, and are not cancelled when the starting thread exits, so the
//! queue may move between threads (`IoQueue: Send`).

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::windows::io::OwnedHandle;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use picchio_core::{AlignedBuf, Completion, IoQueue, ReadReq, Tag};
use windows_sys::Win32::System::IO::{OVERLAPPED, OVERLAPPED_ENTRY};

use crate::align::{self, DioAlign};
use crate::error::{Error, Result};
use crate::psync::MIN_REPORTED_BLOCK_SIZE;
use crate::sys::windows::{self as win, Started};
use crate::sys::{self};

/// How to open an [`IocpQueue`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IocpOptions {
    /// Reads in the kernel at once (`--qd`, 1..=[`IocpOptions::MAX_QD`]); more wait in a FIFO
    /// inside the queue.
    pub qd: u32,
}

impl IocpOptions {
    /// Reads in flight when `--qd` is not given.
    pub const DEFAULT_QD: u32 = 32;
    /// The largest `--qd` accepted.
    pub const MAX_QD: u32 = 256;

    /// `qd` reads in flight.
    pub fn qd(qd: u32) -> Self {
        IocpOptions { qd }
    }
}

impl Default for IocpOptions {
    /// [`IocpOptions::DEFAULT_QD`] reads in flight.
    fn default() -> Self {
        IocpOptions { qd: Self::DEFAULT_QD }
    }
}

/// A read the kernel owns from `ReadFile` until its completion is dequeued.
#[repr(C)]
struct Slot {
    /// First field: the `OVERLAPPED` pointer a completion carries is the slot's address.
    overlapped: OVERLAPPED,
    /// Written by the kernel while the read is in flight: never touched before its completion.
    buf: AlignedBuf,
    tag: Tag,
    /// Offset and length of the whole request.
    offset: u64,
    len: u32,
    /// Bytes already read (a short read that stops on a sector boundary is resumed from here).
    done: u32,
    submitted: Instant,
}

// The port's `lpOverlapped` is cast back to the slot: the OVERLAPPED must be at offset 0.
const _: () = assert!(std::mem::offset_of!(Slot, overlapped) == 0);

/// A request waiting for one of the `qd` kernel slots.
struct Waiting {
    req: ReadReq,
    submitted: Instant,
}

/// An [`IoQueue`] over one file read with overlapped, unbuffered `ReadFile`s completed through an
/// I/O completion port, at most `qd` in the kernel at once (see the module documentation for
/// ownership).
///
/// * Reads go straight into the request's buffer. A read that runs past the end of the file
///   completes `Ok` with the bytes that exist, as with [`crate::PsyncQueue`]; a read the kernel
///   ends with `ERROR_HANDLE_EOF` (the file shrank since it was opened) completes `Ok` with the
///   bytes read so far.
/// * Requests that cannot be performed complete with an [`io::Error`] wrapping an [`Error`] without
///   reaching the kernel: [`Error::PastEnd`], [`Error::BufferTooSmall`], [`Error::Misaligned`]
///   (offsets and lengths must be multiples of the logical sector size, buffer addresses of the
///   physical one). Kernel errors complete with [`Error::Read`] naming the path, offset and length,
///   with the Win32 error as source.
/// * [`IoQueue::block_size`] is the unbuffered alignment from the same probe as psync's direct mode
///   (`FileStorageInfo`, then `GetDiskFreeSpaceW`, then 4096), never less than 512.
/// * Dropping the queue discards requests still waiting in the FIFO, cancels the reads in the
///   kernel and waits for each of their completions before freeing their buffers.
///
/// # Panics
/// `reap` and `drop` panic only if `GetQueuedCompletionStatusEx` fails on the queue's own port,
/// which happens only if its handle was closed behind the queue's back (a bug); `drop` then leaks
/// the outstanding buffers rather than free memory the kernel may still write.
pub struct IocpQueue {
    file: File,
    port: OwnedHandle,
    path: PathBuf,
    size: u64,
    align: DioAlign,
    qd: u32,
    /// Requests accepted but not yet started (beyond `qd`).
    waiting: VecDeque<Waiting>,
    /// Finished requests (refused at submit, failed at start, or dequeued) not yet reaped.
    ready: VecDeque<Completion>,
    /// Slots owned by the kernel: reads started whose completion has not been dequeued.
    outstanding: usize,
    /// Submitted and not yet reaped.
    in_flight: usize,
}

impl IocpQueue {
    /// Opens the regular file at `path` for overlapped unbuffered reads and creates its completion
    /// port.
    ///
    /// # Errors
    /// [`Error::OptionOutOfRange`] for a `qd` outside 1..=[`IocpOptions::MAX_QD`]; [`Error::Open`];
    /// [`Error::Stat`], [`Error::UnsupportedTarget`] (directories, devices); [`Error::CompletionPort`].
    pub fn open(path: impl AsRef<Path>, opts: IocpOptions) -> Result<Self> {
        let path = path.as_ref();
        if opts.qd == 0 || opts.qd > IocpOptions::MAX_QD {
            return Err(Error::OptionOutOfRange {
                option: "IocpOptions::qd",
                value: u64::from(opts.qd),
                min: 1,
                max: u64::from(IocpOptions::MAX_QD),
            });
        }
        let file = win::open_overlapped(path)?;
        let probe = sys::probe(&file, path, true)?;
        let align = align::choose(true, probe.statx_dio, probe.logical_block)
            .map_err(|reason| Error::DirectUnsupported { path: path.into(), reason, cause: None })?;
        let port = win::completion_port(&file).map_err(|cause| Error::CompletionPort { path: path.into(), cause })?;
        tracing::debug!("{}: {} bytes, alignment {align:?}, iocp qd {}", path.display(), probe.size, opts.qd);
        Ok(IocpQueue {
            file,
            port,
            path: path.into(),
            size: probe.size,
            align,
            qd: opts.qd,
            waiting: VecDeque::new(),
            ready: VecDeque::new(),
            outstanding: 0,
            in_flight: 0,
        })
    }

    /// Size of the file in bytes, measured at open.
    pub fn len(&self) -> u64 {
        self.size
    }

    /// Whether the file holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// The alignment unbuffered reads of this file require.
    pub fn alignment(&self) -> DioAlign {
        self.align
    }

    /// Reads in the kernel at once, at most.
    pub fn qd(&self) -> u32 {
        self.qd
    }

    /// The path the queue was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Checks a request before it is queued; the error says what is wrong with it.
    fn check(&self, req: &ReadReq) -> Result<()> {
        // IOCP reads are always unbuffered (FILE_FLAG_NO_BUFFERING), so always aligned.
        crate::align::check_request(&self.path, self.size, self.align, true, req)
    }

    fn complete(&mut self, tag: Tag, buf: AlignedBuf, result: io::Result<u32>, submitted: Instant) {
        self.ready.push_back(Completion { tag, buf, result, latency_ns: nanos_since(submitted) });
    }

    /// Starts waiting requests while fewer than `qd` reads are in the kernel.
    fn fill(&mut self) {
        while self.outstanding < self.qd as usize {
            let Some(Waiting { req, submitted }) = self.waiting.pop_front() else { return };
            let ReadReq { offset, len, buf, tag } = req;
            let slot = Box::new(Slot {
                overlapped: OVERLAPPED::default(),
                buf,
                tag,
                offset: offset.0,
                len,
                done: 0,
                submitted,
            });
            self.start(slot);
        }
    }

    /// Hands `slot` to the kernel for its remaining bytes, or completes it if the start fails.
    fn start(&mut self, mut slot: Box<Slot>) {
        let at = slot.offset + u64::from(slot.done);
        let want = slot.len - slot.done;
        // In bounds: `done < len <= buf.len()` (checked at submit).
        let dst = slot.buf.as_mut_ptr().wrapping_add(slot.done as usize);
        let raw = Box::into_raw(slot);
        // SAFETY: `raw` is the only pointer to the slot, leaked above and used again only once its
        // completion is dequeued (`dequeue`) or right below if nothing was queued; `dst` points
        // `done` bytes into the slot's buffer, which holds at least `len` bytes, so it is valid for
        // the `want` bytes asked; both live in heap memory that stays put while the slot is leaked.
        let started = unsafe { win::start_read(&self.file, dst, want, at, raw.cast::<OVERLAPPED>()) };
        match started {
            Started::Queued => self.outstanding += 1,
            Started::Failed(e) => {
                // SAFETY: nothing was queued, so the kernel holds no reference to the slot; `raw`
                // came from `Box::into_raw` above and is reclaimed exactly once.
                let slot = unsafe { Box::from_raw(raw) };
                self.finish(slot, Err(e));
            }
        }
    }

    /// Accounts for the end of one kernel read of `slot`: resumes a read that stopped short on a
    /// sector boundary, else completes the request.
    fn finish(&mut self, mut slot: Box<Slot>, result: io::Result<u32>) {
        let result = match result {
            Ok(n) => {
                slot.done += n.min(slot.len - slot.done);
                let resumable = n > 0 && slot.done < slot.len && slot.done.is_multiple_of(self.align.offset);
                if resumable {
                    return self.start(slot);
                }
                Ok(slot.done)
            }
            Err(e) if win::is_eof(&e) => Ok(slot.done),
            Err(cause) => {
                let (offset, len) = (slot.offset, slot.len);
                Err(Error::Read { path: self.path.clone(), offset, len, cause }.into_io())
            }
        };
        let Slot { buf, tag, submitted, .. } = *slot;
        self.complete(tag, buf, result, submitted);
    }

    /// Takes up to one batch of completions from the port, waiting up to `timeout` (`None`: until
    /// at least one arrives), and reclaims their slots. Returns the slots with their results.
    fn dequeue(&mut self, timeout: Option<Duration>) -> Vec<(Box<Slot>, io::Result<u32>)> {
        let mut entries = [OVERLAPPED_ENTRY::default(); win::DEQUEUE_BATCH];
        let n = win::dequeue(&self.port, &mut entries, timeout).unwrap_or_else(|e| {
            panic!("{}: GetQueuedCompletionStatusEx on the queue's own port: {e}", self.path.display())
        });
        let mut done = Vec::with_capacity(n);
        for entry in &entries[..n] {
            if entry.lpOverlapped.is_null() {
                continue; // a posted wake-up, not a read (this queue posts none)
            }
            // SAFETY: only this queue's file is associated with the port and nothing posts to it,
            // so `lpOverlapped` is the address of a slot leaked by `Box::into_raw` in `start`; its
            // completion has just been dequeued, so the kernel no longer touches the slot, and each
            // completion is dequeued exactly once.
            let slot = unsafe { Box::from_raw(entry.lpOverlapped.cast::<Slot>()) };
            self.outstanding -= 1;
            let result = win::overlapped_result(&self.file, &slot.overlapped);
            done.push((slot, result));
        }
        done
    }
}

impl IoQueue for IocpQueue {
    fn block_size(&self) -> u32 {
        MIN_REPORTED_BLOCK_SIZE.max(self.align.offset).max(self.align.mem)
    }

    fn submit(&mut self, req: ReadReq) {
        let submitted = Instant::now();
        self.in_flight += 1;
        if let Err(e) = self.check(&req) {
            return self.complete(req.tag, req.buf, Err(e.into_io()), submitted);
        }
        if req.len == 0 {
            return self.complete(req.tag, req.buf, Ok(0), submitted);
        }
        self.waiting.push_back(Waiting { req, submitted });
        self.fill();
    }

    fn reap(&mut self, min: usize, out: &mut Vec<Completion>) -> usize {
        let start = out.len();
        let want = min.min(self.in_flight);
        loop {
            self.fill();
            out.extend(self.ready.drain(..));
            // After `fill`, nothing outstanding means nothing waiting either: all is in `out`.
            if self.outstanding == 0 {
                break;
            }
            let block = out.len() - start < want;
            let batch = self.dequeue(if block { None } else { Some(Duration::ZERO) });
            if batch.is_empty() && !block {
                break;
            }
            for (slot, result) in batch {
                self.finish(slot, result);
            }
        }
        let n = out.len() - start;
        self.in_flight -= n;
        n
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn describe(&self) -> String {
        format!("iocp(direct, qd {})", self.qd)
    }
}

impl Drop for IocpQueue {
    fn drop(&mut self) {
        self.waiting.clear();
        self.ready.clear();
        if self.outstanding == 0 {
            return;
        }
        if let Err(e) = win::cancel_all(&self.file) {
            tracing::warn!("{}: CancelIoEx: {e}; waiting for the reads to finish", self.path.display());
        }
        while self.outstanding > 0 {
            // Each reclaimed slot (and its buffer) is freed here, after its completion.
            drop(self.dequeue(None));
        }
    }
}

impl std::fmt::Debug for IocpQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IocpQueue")
            .field("path", &self.path)
            .field("size", &self.size)
            .field("align", &self.align)
            .field("qd", &self.qd)
            .field("outstanding", &self.outstanding)
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

fn nanos_since(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_file::{file_with, read};

    fn assert_send<T: Send>() {}

    #[test]
    fn queue_is_send() {
        assert_send::<IocpQueue>();
    }

    #[test]
    fn options_are_checked_and_described() {
        let (_d, path, _) = file_with(8192);
        for qd in [0, IocpOptions::MAX_QD + 1] {
            let e = IocpQueue::open(&path, IocpOptions::qd(qd)).unwrap_err();
            assert!(e.to_string().contains("IocpOptions::qd") && e.to_string().contains("expected 1..=256"), "{e}");
        }
        let q = IocpQueue::open(&path, IocpOptions::default()).unwrap();
        assert_eq!(q.describe(), "iocp(direct, qd 32)");
        assert_eq!((q.len(), q.is_empty(), q.qd()), (8192, false, 32));
        assert!(q.block_size() >= 512 && q.block_size().is_power_of_two());
    }

    #[test]
    fn kernel_error_completes_with_path_offset_and_os_error() {
        let (_d, path, bytes) = file_with(3 * 4096);
        let mut q = IocpQueue::open(&path, IocpOptions::qd(4)).unwrap();
        const ERROR_CRC: i32 = 23;
        sys::fault::fail_read(&path, 4096, ERROR_CRC);
        let c = read(&mut q, 4096, 4096);
        sys::fault::clear(&path);
        let e = c.result.unwrap_err();
        assert!(e.to_string().contains("read of 4096 bytes at offset 0x1000"), "{e}");
        assert!(e.to_string().contains(&path.display().to_string()), "{e}");
        let typed = e.get_ref().and_then(|e| e.downcast_ref::<Error>()).expect("typed error");
        let Error::Read { cause, .. } = typed else { panic!("{typed:?}") };
        assert_eq!(cause.raw_os_error(), Some(ERROR_CRC));
        assert_eq!(c.buf.len(), 4096);
        // Other reads are unaffected.
        let c = read(&mut q, 0, 4096);
        assert_eq!(c.result.unwrap(), 4096);
        assert_eq!(&c.buf.as_slice()[..4096], &bytes[..4096]);
    }

    #[test]
    fn zero_length_read_completes_without_the_kernel() {
        let (_d, path, _) = file_with(4096);
        let mut q = IocpQueue::open(&path, IocpOptions::qd(1)).unwrap();
        let c = read(&mut q, 0, 0);
        assert_eq!(c.result.unwrap(), 0);
        assert_eq!((q.in_flight(), q.outstanding), (0, 0));
    }
}
