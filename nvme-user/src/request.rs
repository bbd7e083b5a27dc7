//! The request layer every NVMe transport shares (in the manner of SPDK's `struct nvme_request`):
//! the PCIe queue pair ([`crate::NvmeQueue`]) and the NVMe/TCP initiator
//! ([`crate::tcp::NvmeTcpQueue`]) keep their requests here and differ only in how one command is
//! submitted and how its completion is reaped.
//!
//! - A [`Request`] is one caller's read ([`picchio_core::ReadReq`]), write ([`WriteReq`]) or
//!   Flush: its buffer and tag, its range, and its direction ([`Op`]). It is checked once against
//!   the namespace ([`check`]) with one set of typed errors ([`BadRequest`]).
//! - It is split at the transfer limit (MDTS, or less) into **child commands** ([`Child`]), issued
//!   lazily as the transport has a free CID: a request waits in the backlog while no CID is free,
//!   so `submit` never blocks.
//! - A child the transport lost (an NVMe/TCP connection that broke) may be **resubmitted** ahead of
//!   the backlog, reads and Flushes only, each request at most `max_retries` times
//!   ([`Requests::resubmit`]); a write is never sent twice.
//! - The request completes when its last child has: with the first child's error, or `Ok(len)`.
//!   Once a child fails, no further child of that request is issued.
//!
//! A transport implements [`Transport`]: submit one child command (or say the queue is full),
//! release a request's transport resources when it completes, and ring its doorbell once per batch.

use std::collections::VecDeque;
use std::io;
use std::time::Instant;

use picchio_core::{AlignedBuf, ByteOffset, Completion, Tag};

use crate::ctrlr::Namespace;
use crate::spec::nvm;

/// One write: `len` bytes from the start of `buf` to byte `offset` of the namespace, completed
/// like a read (a [`Completion`] with `Ok(len)` and the buffer back). The write path's own type, so
/// a namespace is written only through [`crate::NvmWriteQueue::submit_write`], never by a
/// [`picchio_core::ReadReq`] given to [`picchio_core::IoQueue::submit`].
///
/// `offset` and `len` must be whole LBAs of the namespace, `len <= buf.len()`.
#[derive(Debug)]
pub struct WriteReq {
    /// Where to write, in bytes from the start of the namespace.
    pub offset: ByteOffset,
    /// Bytes to write.
    pub len: u32,
    /// The data (its first `len` bytes); returned in the completion.
    pub buf: AlignedBuf,
    /// Identifier returned in the completion.
    pub tag: Tag,
}

/// What a request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// NVM Read (opcode 02h): the device writes the buffer.
    Read,
    /// NVM Write (opcode 01h): the device reads the buffer.
    Write,
    /// NVM Flush (opcode 00h): no data.
    Flush,
}

impl Op {
    /// The NVM command set opcode (NVM command set spec §3.2).
    pub fn opcode(self) -> u8 {
        match self {
            Op::Read => nvm::READ,
            Op::Write => nvm::WRITE,
            Op::Flush => nvm::FLUSH,
        }
    }
    /// `read`, `write` or `flush`, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
        }
    }
    /// The command's spec name: `Read`, `Write` or `Flush`.
    pub fn command(self) -> &'static str {
        match self {
            Op::Read => "Read",
            Op::Write => "Write",
            Op::Flush => "Flush",
        }
    }
}

/// Why a request was refused before any command was issued (the inner error of its
/// `io::ErrorKind::InvalidInput` completion).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadRequest {
    /// The offset or length is not a positive whole number of LBAs, or the buffer address is not
    /// aligned as the transport needs (PCIe: a dword, for PRP entries).
    #[error("NVMe {op} of {len} bytes at {offset:#x} with buffer {addr:#x} is not aligned to the {lba}-byte LBA")]
    Misaligned {
        /// `read` or `write`.
        op: &'static str,
        /// Byte offset in the namespace.
        offset: u64,
        /// Bytes.
        len: u32,
        /// The buffer's address.
        addr: u64,
        /// The namespace's LBA size.
        lba: u32,
        /// The buffer alignment the transport needs.
        mem_align: u32,
    },
    /// `len` is larger than the buffer.
    #[error("NVMe {op} of {len} bytes with a {buf_len}-byte buffer")]
    BufferTooSmall {
        /// `read` or `write`.
        op: &'static str,
        /// Bytes.
        len: u32,
        /// The buffer's length.
        buf_len: usize,
    },
    /// The range runs past the end of the namespace.
    #[error("NVMe {op} of {len} bytes at {offset:#x} past the end of {namespace} ({bytes} bytes)")]
    PastEnd {
        /// `read` or `write`.
        op: &'static str,
        /// Byte offset.
        offset: u64,
        /// Bytes.
        len: u32,
        /// The namespace, e.g. `namespace 1` or `nvme-tcp://127.0.0.1:4420/nqn.x/1`.
        namespace: String,
        /// The namespace's size.
        bytes: u64,
    },
}

impl BadRequest {
    /// As an `io::Error` of kind `InvalidInput` with `self` inside.
    pub fn into_io(self) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidInput, self)
    }
    /// The [`BadRequest`] inside `e`, if it carries one.
    pub fn of(e: &io::Error) -> Option<&BadRequest> {
        e.get_ref().and_then(|i| i.downcast_ref::<BadRequest>())
    }
}

/// Checks a read or write of `len` bytes at `offset` into `buf` against `ns` (named `namespace` in
/// the error), with buffer addresses aligned to `mem_align`.
///
/// # Errors
/// The [`BadRequest`] it breaks, first alignment, then the buffer, then the range.
pub fn check(
    op: Op,
    offset: u64,
    len: u32,
    buf: &AlignedBuf,
    ns: &Namespace,
    mem_align: u32,
    namespace: &dyn Fn() -> String,
) -> Result<(), BadRequest> {
    let lba = u64::from(ns.lba_size);
    let addr = buf.as_slice().as_ptr() as u64;
    let op = op.name();
    if len == 0
        || !u64::from(len).is_multiple_of(lba)
        || !offset.is_multiple_of(lba)
        || !addr.is_multiple_of(u64::from(mem_align.max(1)))
    {
        return Err(BadRequest::Misaligned { op, offset, len, addr, lba: ns.lba_size, mem_align });
    }
    if len as usize > buf.len() {
        return Err(BadRequest::BufferTooSmall { op, len, buf_len: buf.len() });
    }
    if offset.checked_add(u64::from(len)).is_none_or(|e| e > ns.bytes()) {
        return Err(BadRequest::PastEnd { op, offset, len, namespace: namespace(), bytes: ns.bytes() });
    }
    Ok(())
}

/// One command's share of a request: bytes `off..off + len` of request `req` (a Flush: 0, 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Child {
    /// The request's index in [`Requests`].
    pub req: u32,
    /// Byte offset within the request.
    pub off: u32,
    /// Bytes.
    pub len: u32,
}

impl Child {
    /// The 64-bit value a transport keeps with the command (request index, offset): the PCIe
    /// tracker's user data.
    pub fn user(self) -> u64 {
        (u64::from(self.req) << 32) | u64::from(self.off)
    }
    /// The request index and offset of [`Child::user`].
    pub fn parts(user: u64) -> (u32, u32) {
        ((user >> 32) as u32, user as u32)
    }
}

/// One caller's request and its progress; `X` is what the transport keeps with it (the PCIe
/// driver: the buffer's IOVA or pool slot).
#[derive(Debug)]
pub struct Request<X> {
    /// The caller's tag.
    pub tag: Tag,
    /// The caller's buffer (the DMA target of a read, the source of a write).
    pub buf: AlignedBuf,
    /// What it does.
    pub op: Op,
    /// Byte offset in the namespace.
    pub offset: u64,
    /// Bytes (0 for a Flush).
    pub len: u32,
    /// Bytes per child command (the transfer limit; whole LBAs).
    pub cmd_len: u32,
    /// The first error; the request completes with it.
    pub error: Option<io::Error>,
    /// Times a child of it was resubmitted.
    pub retries: u32,
    /// The transport's part.
    pub x: X,
    /// Offset of the next child to issue.
    next: u32,
    /// Children not yet issued.
    left: u32,
    /// Children issued and not completed (including those waiting to be resubmitted).
    outstanding: u32,
    /// In the backlog.
    queued: bool,
    started: Instant,
}

impl<X> Request<X> {
    /// A request of `len` bytes at `offset` (a Flush: `len` 0), split into commands of at most
    /// `cmd_len` bytes (> 0).
    pub fn new(op: Op, tag: Tag, buf: AlignedBuf, offset: u64, len: u32, cmd_len: u32, x: X) -> Request<X> {
        debug_assert!(cmd_len > 0 || op == Op::Flush);
        let left = if op == Op::Flush { 1 } else { len.div_ceil(cmd_len) };
        Request {
            tag,
            buf,
            op,
            offset,
            len,
            cmd_len,
            error: None,
            retries: 0,
            x,
            next: 0,
            left,
            outstanding: 0,
            queued: false,
            started: Instant::now(),
        }
    }
    /// Byte in the namespace where `child` starts.
    pub fn byte(&self, child: &Child) -> u64 {
        self.offset + u64::from(child.off)
    }
    /// Children issued and not yet completed.
    pub fn outstanding(&self) -> u32 {
        self.outstanding
    }
    fn fail(&mut self, e: io::Error) {
        self.error.get_or_insert(e);
        self.left = 0;
    }
    fn done(&self) -> bool {
        self.left == 0 && self.outstanding == 0 && !self.queued
    }
}

/// What [`Transport::submit`] did with a child.
#[derive(Debug)]
pub enum Submit<E> {
    /// The command is at the device (or on the wire).
    Sent,
    /// No CID is free: the child waits (and everything after it).
    Full,
    /// The command cannot be built (e.g. a PRP list error): the request fails with this error.
    Refused(io::Error),
    /// The command was handed to the transport, which then broke (a socket error): the child is in
    /// flight, and the caller handles `E` (e.g. reconnects and resubmits).
    Broken(E),
}

/// The two operations that differ between transports.
pub trait Transport {
    /// What the transport keeps with each request ([`Request::x`]).
    type Extra;
    /// A failure of the transport itself ([`Submit::Broken`]).
    type Error;
    /// Submits `child` of `r` as one command.
    fn submit(&mut self, child: Child, r: &mut Request<Self::Extra>) -> Submit<Self::Error>;
    /// `r` is complete (no command of it is at the device any more, or the device has been
    /// stopped): releases what the transport holds for it before its completion is delivered.
    fn retire(&mut self, r: &mut Request<Self::Extra>);
    /// Ends a batch of submissions (the PCIe SQ doorbell).
    fn ring(&mut self) {}
}

/// Why [`Requests::resubmit`] refused a lost child.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resubmit {
    /// Queued to be sent again ahead of the backlog.
    Queued,
    /// A write is not sent twice (its data may have reached the media in part).
    NotIdempotent,
    /// The request was already resubmitted `retries` times.
    Exhausted {
        /// Resubmissions so far.
        retries: u32,
    },
}

/// The requests of one queue: a slab indexed by [`Child::req`], the backlog of requests with
/// children to issue, the children to resubmit, and the completions ready for `reap`.
#[derive(Debug)]
pub struct Requests<X> {
    slab: Vec<Option<Request<X>>>,
    free: Vec<u32>,
    backlog: VecDeque<u32>,
    resubmit: VecDeque<Child>,
    ready: Vec<Completion>,
    flush: Option<io::Result<u32>>,
    active: usize,
}

impl<X> Default for Requests<X> {
    fn default() -> Self {
        Requests {
            slab: Vec::new(),
            free: Vec::new(),
            backlog: VecDeque::new(),
            resubmit: VecDeque::new(),
            ready: Vec::new(),
            flush: None,
            active: 0,
        }
    }
}

impl<X> Requests<X> {
    /// Requests accepted and not yet complete.
    pub fn active(&self) -> usize {
        self.active
    }
    /// Requests not yet reaped: active ones and ready completions.
    pub fn in_flight(&self) -> usize {
        self.active + self.ready.len()
    }
    /// Completions ready for `reap`.
    pub fn ready(&self) -> usize {
        self.ready.len()
    }
    /// Whether some request waits for a CID (in the backlog or to be resubmitted).
    pub fn waiting(&self) -> bool {
        !self.backlog.is_empty() || !self.resubmit.is_empty()
    }
    /// The live request `ri`.
    pub fn get(&self, ri: u32) -> Option<&Request<X>> {
        self.slab.get(ri as usize).and_then(Option::as_ref)
    }
    /// The live request `ri`.
    pub fn get_mut(&mut self, ri: u32) -> Option<&mut Request<X>> {
        self.slab.get_mut(ri as usize).and_then(Option::as_mut)
    }
    /// Every live request.
    pub fn iter(&self) -> impl Iterator<Item = &Request<X>> {
        self.slab.iter().flatten()
    }

    /// Accepts `r` into the backlog; [`Requests::pump`] issues it. Returns its index.
    pub fn push(&mut self, mut r: Request<X>) -> u32 {
        r.queued = true;
        let ri = match self.free.pop() {
            Some(i) => {
                self.slab[i as usize] = Some(r);
                i
            }
            None => {
                self.slab.push(Some(r));
                (self.slab.len() - 1) as u32
            }
        };
        self.active += 1;
        self.backlog.push_back(ri);
        ri
    }

    /// Completes a request that was never accepted with `err` (a Flush: as the Flush's outcome).
    pub fn fail_now(&mut self, op: Op, tag: Tag, buf: AlignedBuf, err: io::Error) {
        if op == Op::Flush {
            self.flush = Some(Err(err));
        } else {
            self.ready.push(Completion { tag, buf, result: Err(err), latency_ns: 0 });
        }
    }

    /// Issues children — first those to resubmit, then the backlog's in order — while the
    /// transport accepts them, then rings once.
    ///
    /// # Errors
    /// The transport's failure ([`Submit::Broken`]); the child it broke on is in flight.
    pub fn pump<T: Transport<Extra = X>>(&mut self, t: &mut T) -> Result<(), T::Error> {
        let out = self.issue(t);
        t.ring();
        out
    }

    fn issue<T: Transport<Extra = X>>(&mut self, t: &mut T) -> Result<(), T::Error> {
        while let Some(&c) = self.resubmit.front() {
            let Some(r) = self.slab[c.req as usize].as_mut() else {
                self.resubmit.pop_front();
                continue;
            };
            if r.error.is_some() {
                // Its request failed meanwhile: nothing to resend for.
                self.resubmit.pop_front();
                self.child_done(c.req, None, t);
                continue;
            }
            match t.submit(c, r) {
                Submit::Sent => {
                    self.resubmit.pop_front();
                }
                Submit::Full => return Ok(()),
                Submit::Refused(e) => {
                    self.resubmit.pop_front();
                    self.child_done(c.req, Some(e), t);
                }
                Submit::Broken(e) => {
                    self.resubmit.pop_front();
                    return Err(e);
                }
            }
        }
        while let Some(&ri) = self.backlog.front() {
            let Some(r) = self.slab[ri as usize].as_mut() else {
                self.backlog.pop_front();
                continue;
            };
            while r.left > 0 {
                let child = Child { req: ri, off: r.next, len: r.cmd_len.min(r.len - r.next) };
                match t.submit(child, r) {
                    Submit::Sent => {}
                    Submit::Full => return Ok(()),
                    Submit::Refused(e) => {
                        r.fail(e);
                        break;
                    }
                    Submit::Broken(e) => {
                        r.next += child.len;
                        r.left -= 1;
                        r.outstanding += 1;
                        if r.left == 0 {
                            r.queued = false;
                            self.backlog.pop_front();
                        }
                        return Err(e);
                    }
                }
                r.next += child.len;
                r.left -= 1;
                r.outstanding += 1;
            }
            self.backlog.pop_front();
            r.queued = false;
            if r.done() {
                self.finish(ri, t);
            }
        }
        Ok(())
    }

    /// A child of request `ri` completed, with `err` if it failed (then no further child of the
    /// request is issued); the request completes after its last child.
    pub fn child_done<T: Transport<Extra = X>>(&mut self, ri: u32, err: Option<io::Error>, t: &mut T) {
        let Some(r) = self.get_mut(ri) else { return };
        r.outstanding -= 1;
        if let Some(e) = err {
            r.fail(e);
        }
        if r.done() {
            self.finish(ri, t);
        }
    }

    /// A child the transport lost in flight (its connection broke): queues it to be sent again
    /// ahead of the backlog, if its request is a read or a Flush resubmitted fewer than
    /// `max_retries` times (counting this one). Otherwise the caller fails it with
    /// [`Requests::child_done`].
    pub fn resubmit(&mut self, child: Child, max_retries: u32) -> Resubmit {
        let r = self.get_mut(child.req).expect("a lost child belongs to a live request");
        if r.op == Op::Write {
            return Resubmit::NotIdempotent;
        }
        if r.retries >= max_retries {
            return Resubmit::Exhausted { retries: r.retries };
        }
        r.retries += 1;
        self.resubmit.push_back(child);
        Resubmit::Queued
    }

    /// Fails everything waiting for a CID (the backlog's requests, the children to resubmit) with
    /// `e()`; their commands in flight still complete them.
    pub fn fail_waiting<T: Transport<Extra = X>>(&mut self, e: &dyn Fn() -> io::Error, t: &mut T) {
        while let Some(c) = self.resubmit.pop_front() {
            self.child_done(c.req, Some(e()), t);
        }
        while let Some(ri) = self.backlog.pop_front() {
            let Some(r) = self.get_mut(ri) else { continue };
            r.fail(e());
            r.queued = false;
            if r.done() {
                self.finish(ri, t);
            }
        }
    }

    /// Ends every live request: `f` sees each (and sets its error, and anything the transport
    /// keeps), then it completes as if none of its commands were outstanding. For a queue that
    /// stops, after the device has been stopped or its buffers quarantined.
    pub fn end_all<T: Transport<Extra = X>>(&mut self, mut f: impl FnMut(&mut Request<X>), t: &mut T) {
        self.backlog.clear();
        self.resubmit.clear();
        for ri in 0..self.slab.len() as u32 {
            if let Some(r) = self.get_mut(ri) {
                f(r);
                r.outstanding = 0;
                r.left = 0;
                r.queued = false;
                self.finish(ri, t);
            }
        }
    }

    fn finish<T: Transport<Extra = X>>(&mut self, ri: u32, t: &mut T) {
        let Some(mut r) = self.slab[ri as usize].take() else { return };
        self.free.push(ri);
        self.active -= 1;
        t.retire(&mut r);
        let result = match r.error {
            Some(e) => Err(e),
            None => Ok(r.len),
        };
        if r.op == Op::Flush {
            self.flush = Some(result);
            return;
        }
        let latency_ns = r.started.elapsed().as_nanos() as u64;
        self.ready.push(Completion { tag: r.tag, buf: r.buf, result, latency_ns });
    }

    /// Moves the ready completions to `out`; returns how many.
    pub fn take_ready(&mut self, out: &mut Vec<Completion>) -> usize {
        let n = self.ready.len();
        out.append(&mut self.ready);
        n
    }
    /// Puts `held` back ahead of the ready completions.
    pub fn hold_back(&mut self, mut held: Vec<Completion>) {
        held.append(&mut self.ready);
        self.ready = held;
    }
    /// Forgets the outcome of an earlier Flush.
    pub fn clear_flush(&mut self) {
        self.flush = None;
    }
    /// The outcome of the last Flush, once it has completed (taken).
    pub fn take_flush(&mut self) -> Option<io::Result<u32>> {
        self.flush.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A transport with `free` CIDs that records what it was given.
    #[derive(Default)]
    struct Fake {
        free: usize,
        sent: Vec<Child>,
        refuse_at: Option<u32>,
        break_at: Option<u32>,
        retired: Vec<Tag>,
        rings: usize,
    }

    impl Transport for Fake {
        type Extra = ();
        type Error = &'static str;
        fn submit(&mut self, child: Child, _r: &mut Request<()>) -> Submit<&'static str> {
            if self.refuse_at == Some(child.off) {
                return Submit::Refused(io::Error::other("refused"));
            }
            if self.free == 0 {
                return Submit::Full;
            }
            self.free -= 1;
            self.sent.push(child);
            if self.break_at == Some(child.off) {
                return Submit::Broken("broken");
            }
            Submit::Sent
        }
        fn retire(&mut self, r: &mut Request<()>) {
            self.retired.push(r.tag);
        }
        fn ring(&mut self) {
            self.rings += 1;
        }
    }

    fn req(op: Op, tag: u64, len: u32, cmd_len: u32) -> Request<()> {
        Request::new(op, Tag(tag), AlignedBuf::new(len.max(1) as usize, 4096).unwrap(), 0x1000, len, cmd_len, ())
    }

    #[test]
    fn a_request_splits_at_the_command_size_and_waits_for_cids_in_order() {
        let mut rs = Requests::default();
        let mut t = Fake { free: 3, ..Fake::default() };
        let a = rs.push(req(Op::Read, 1, 10 << 10, 4 << 10));
        let b = rs.push(req(Op::Read, 2, 4 << 10, 4 << 10));
        rs.pump(&mut t).unwrap();
        let chunks: Vec<(u32, u32, u32)> = t.sent.iter().map(|c| (c.req, c.off, c.len)).collect();
        assert_eq!(chunks, [(a, 0, 4096), (a, 4096, 4096), (a, 8192, 2048)]);
        assert!(rs.waiting(), "b waits for a CID");
        assert_eq!((rs.active(), rs.in_flight(), t.rings), (2, 2, 1));
        for _ in 0..3 {
            rs.child_done(a, None, &mut t);
            t.free += 1;
        }
        rs.pump(&mut t).unwrap();
        assert_eq!(t.sent.last().map(|c| (c.req, c.off)), Some((b, 0)));
        rs.child_done(b, None, &mut t);
        let mut out = Vec::new();
        assert_eq!(rs.take_ready(&mut out), 2);
        assert_eq!(
            out.iter().map(|c| (c.tag.0, c.result.as_ref().copied().unwrap())).collect::<Vec<_>>(),
            [(1, 10 << 10), (2, 4 << 10)]
        );
        assert_eq!(t.retired, [Tag(1), Tag(2)]);
        assert_eq!(rs.in_flight(), 0);
    }

    #[test]
    fn a_failed_child_stops_its_request_and_the_first_error_is_kept() {
        let mut rs = Requests::default();
        let mut t = Fake { free: 2, ..Fake::default() };
        let a = rs.push(req(Op::Read, 1, 16 << 10, 4 << 10));
        rs.pump(&mut t).unwrap();
        rs.child_done(a, Some(io::Error::other("first")), &mut t);
        t.free += 1;
        rs.pump(&mut t).unwrap();
        assert_eq!(t.sent.len(), 2, "no child issued after the failure");
        rs.child_done(a, Some(io::Error::other("second")), &mut t);
        let mut out = Vec::new();
        rs.take_ready(&mut out);
        assert_eq!(out[0].result.as_ref().unwrap_err().to_string(), "first");
    }

    #[test]
    fn a_refused_command_fails_only_its_request() {
        let mut rs = Requests::default();
        let mut t = Fake { free: 8, refuse_at: Some(4096), ..Fake::default() };
        rs.push(req(Op::Read, 1, 8192, 4096));
        let b = rs.push(req(Op::Write, 2, 2048, 4096));
        rs.pump(&mut t).unwrap();
        rs.child_done(0, None, &mut t);
        rs.child_done(b, None, &mut t);
        let mut out = Vec::new();
        rs.take_ready(&mut out);
        out.sort_by_key(|c| c.tag.0);
        assert_eq!(out[0].result.as_ref().unwrap_err().to_string(), "refused");
        assert_eq!(*out[1].result.as_ref().unwrap(), 2048);
    }

    #[test]
    fn lost_reads_are_resubmitted_ahead_of_the_backlog_writes_never() {
        let mut rs = Requests::default();
        let mut t = Fake { free: 2, ..Fake::default() };
        let r = rs.push(req(Op::Read, 1, 4096, 4096));
        let w = rs.push(req(Op::Write, 2, 4096, 4096));
        let later = rs.push(req(Op::Read, 3, 4096, 4096));
        rs.pump(&mut t).unwrap();
        let (cr, cw) = (t.sent[0], t.sent[1]);
        // The connection breaks: both commands are lost.
        t.free = 2;
        assert_eq!(rs.resubmit(cr, 1), Resubmit::Queued);
        assert_eq!(rs.resubmit(cw, 1), Resubmit::NotIdempotent);
        rs.child_done(w, Some(io::Error::other("write lost")), &mut t);
        rs.pump(&mut t).unwrap();
        assert_eq!(t.sent[2..].iter().map(|c| c.req).collect::<Vec<_>>(), [r, later], "the resubmitted read first");
        assert_eq!(rs.resubmit(t.sent[2], 1), Resubmit::Exhausted { retries: 1 });
        rs.child_done(r, Some(io::Error::other("gave up")), &mut t);
        rs.child_done(later, None, &mut t);
        let mut out = Vec::new();
        rs.take_ready(&mut out);
        assert_eq!(out.len(), 3);
    }

    #[test]
    fn a_broken_transport_keeps_the_child_in_flight_and_fail_waiting_ends_the_backlog() {
        let mut rs = Requests::default();
        let mut t = Fake { free: 8, break_at: Some(0), ..Fake::default() };
        let a = rs.push(req(Op::Read, 1, 8192, 4096));
        let b = rs.push(req(Op::Read, 2, 4096, 4096));
        assert_eq!(rs.pump(&mut t), Err("broken"));
        assert_eq!(rs.get(a).unwrap().outstanding(), 1);
        rs.fail_waiting(&|| io::Error::other("disconnected"), &mut t);
        assert!(!rs.waiting());
        assert!(rs.get(b).is_none(), "b had nothing in flight: completed");
        assert!(rs.get(a).is_some(), "a completes with its command in flight");
        rs.child_done(a, None, &mut t);
        let mut out = Vec::new();
        rs.take_ready(&mut out);
        assert!(out.iter().all(|c| c.result.as_ref().unwrap_err().to_string() == "disconnected"));
    }

    #[test]
    fn a_flush_is_one_command_and_its_outcome_is_kept_apart() {
        let mut rs = Requests::default();
        let mut t = Fake { free: 1, ..Fake::default() };
        let f = rs.push(req(Op::Flush, u64::MAX, 0, 4096));
        rs.pump(&mut t).unwrap();
        assert_eq!(t.sent, [Child { req: f, off: 0, len: 0 }]);
        assert!(rs.take_flush().is_none());
        rs.child_done(f, None, &mut t);
        assert_eq!(rs.take_flush().unwrap().unwrap(), 0);
        assert_eq!(rs.ready(), 0);
        rs.fail_now(Op::Flush, Tag(0), AlignedBuf::new(1, 1).unwrap(), io::Error::other("stopped"));
        assert!(rs.take_flush().unwrap().is_err());
    }

    #[test]
    fn end_all_completes_every_request_with_the_error_it_is_given() {
        let mut rs = Requests::default();
        let mut t = Fake { free: 1, ..Fake::default() };
        rs.push(req(Op::Read, 1, 8192, 4096));
        rs.push(req(Op::Read, 2, 4096, 4096));
        rs.pump(&mut t).unwrap();
        rs.end_all(|r| r.error = Some(io::Error::other("stopped")), &mut t);
        assert_eq!((rs.active(), rs.ready()), (0, 2));
        assert!(!rs.waiting());
        let h = vec![];
        rs.hold_back(h);
        assert_eq!(rs.in_flight(), 2);
    }

    #[test]
    fn check_names_the_rule_broken() {
        let ns = Namespace { nsid: 1, blocks: 16, lba_size: 512, metadata_size: 0 };
        let buf = AlignedBuf::new(4096, 4096).unwrap();
        let name = || "namespace 1".to_string();
        let e = check(Op::Read, 256, 512, &buf, &ns, 4, &name).unwrap_err();
        assert!(matches!(e, BadRequest::Misaligned { offset: 256, .. }), "{e}");
        assert!(e.to_string().contains("is not aligned to the 512-byte LBA"), "{e}");
        let e = check(Op::Write, 0, 8192, &buf, &ns, 4, &name).unwrap_err();
        assert_eq!(e.to_string(), "NVMe write of 8192 bytes with a 4096-byte buffer");
        let e = check(Op::Read, 7680, 1024, &buf, &ns, 4, &name).unwrap_err();
        assert_eq!(e.to_string(), "NVMe read of 1024 bytes at 0x1e00 past the end of namespace 1 (8192 bytes)");
        assert!(check(Op::Read, 0, 0, &buf, &ns, 1, &name).is_err(), "zero bytes");
        check(Op::Read, 7168, 1024, &buf, &ns, 4, &name).unwrap();
        let io = e.clone().into_io();
        assert_eq!((io.kind(), BadRequest::of(&io)), (io::ErrorKind::InvalidInput, Some(&e)));
    }
}
