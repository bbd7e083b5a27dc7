//! [`NvmeTcpQueue`]: the [`IoQueue`] engine over NVMe/TCP — a namespace of a remote subsystem read
//! (and written) through `io_queues` I/O queues, one TCP connection each, up to `qd` commands in
//! flight on each.
//!
//! A request becomes one NVM Read (or Write) per `max_transfer` bytes — the split, the backlog while
//! no CID is free, the resubmission after a lost connection and the completion are the request
//! layer shared with the PCIe driver ([`crate::request`]); this module is the transport under it:
//! one command as a CapsuleCmd on a connection with a free CID, and the PDUs that answer it. Each
//! command carries a Transport SGL Data Block descriptor and its data arrives in C2HData PDUs read
//! straight into the request's buffer. Writes up to the controller's in-capsule size (IOCCSZ × 16 − 64) travel in
//! the CapsuleCmd; larger ones wait for R2Ts and answer with H2CData PDUs of at most MAXH2CDATA.
//!
//! # Failures
//! A command's error status completes its request with [`TcpError::Command`]. Anything that breaks
//! a connection — a socket error, the target closing it, a PDU field out of range, a bad digest, a
//! C2HTermReq, or a command without an answer within the timeout — ends the association: the
//! sockets are closed, a new association is made (up to `reconnect_attempts` times) and the reads
//! in flight are resubmitted (reads are idempotent; each at most `max_retries` times). Writes in
//! flight fail ([`TcpError::WriteLost`]). When reconnecting fails, every request fails with
//! [`TcpError::Disconnected`]; after `reconnect_delay` the next request tries again, so a target
//! that comes back is used again.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use picchio_core::{AlignedBuf, Completion, IoQueue, ReadReq, Tag};

use crate::ctrlr::Namespace;
use crate::request::{self, Child, Op, Request, Requests, Resubmit, Submit, Transport, WriteReq};
use crate::spec::{Command, Lba};

use super::assoc::{self, ControllerInfo, KeptAdmin, TcpOptions};
use super::conn::{poll_readable, Conn, Rx};
use super::error::{TcpError, TcpResult};
use super::pdu::{flags, sgl};

/// Where a namespace is: `HOST:PORT`, the subsystem NQN and the NSID.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpTarget {
    /// `HOST:PORT` (an IPv6 host in brackets).
    pub addr: String,
    /// The subsystem's NQN.
    pub subnqn: String,
    /// Namespace id (1-based).
    pub nsid: u32,
}

impl std::fmt::Display for TcpTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "nvme-tcp://{}/{}/{}", self.addr, self.subnqn, self.nsid)
    }
}

/// Counters of an [`NvmeTcpQueue`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpQueueStats {
    /// Read requests submitted.
    pub reads: u64,
    /// Write requests submitted.
    pub writes: u64,
    /// Flushes.
    pub flushes: u64,
    /// NVMe commands sent on I/O queues.
    pub commands: u64,
    /// Bytes received in C2HData PDUs.
    pub c2h_bytes: u64,
    /// Bytes sent in the capsule or in H2CData PDUs.
    pub h2c_bytes: u64,
    /// R2Ts answered.
    pub r2ts: u64,
    /// Associations re-established after a failure.
    pub reconnects: u64,
    /// Commands resubmitted after a reconnect.
    pub resubmitted: u64,
    /// Commands that timed out.
    pub timeouts: u64,
    /// Requests that failed.
    pub errors: u64,
}

struct Cmd {
    chunk: Child,
    deadline: Instant,
    /// Data bytes received (reads) or sent after R2Ts (writes).
    moved: u32,
}

struct IoConn {
    conn: Conn,
    cmds: Vec<Option<Cmd>>,
    free: Vec<u16>,
}

struct Assoc {
    admin: KeptAdmin,
    ios: Vec<IoConn>,
}

/// The NVMe/TCP [`IoQueue`] engine (module docs).
pub struct NvmeTcpQueue {
    target: TcpTarget,
    opts: TcpOptions,
    assoc: Option<Assoc>,
    info: ControllerInfo,
    ns: Namespace,
    depth: u16,
    max_xfer: u32,
    in_capsule: u32,
    /// The request layer: requests, backlog, resubmissions, ready completions, the last Flush.
    reqs: Requests<()>,
    next_conn: usize,
    retry_at: Option<Instant>,
    last_failure: String,
    stats: TcpQueueStats,
    interrupt: Option<Arc<AtomicBool>>,
    fds: Vec<std::os::fd::RawFd>,
    readable: Vec<usize>,
}

/// Largest transfer of one command when the controller reports no MDTS.
const DEFAULT_MAX_XFER: u32 = 8 << 20;

impl NvmeTcpQueue {
    /// Connects to `target`: association (admin Connect, CC.EN, CSTS.RDY, Identify), Identify
    /// Namespace, and `opts.io_queues` I/O queues.
    ///
    /// # Errors
    /// The first failing step's [`TcpError`] (each names the address and step).
    pub fn connect(target: TcpTarget, opts: TcpOptions) -> TcpResult<NvmeTcpQueue> {
        let (assoc, info, ns, depth) = establish(&target, &opts)?;
        let mdts = info.id.max_transfer(4096 << info.cap.mpsmin()).map_or(DEFAULT_MAX_XFER as usize, |m| m);
        let nlb_max = 65536u64 * u64::from(ns.lba_size);
        let max_xfer = (mdts as u64).min(nlb_max).min(u64::from(DEFAULT_MAX_XFER)) as u32;
        let max_xfer = max_xfer / ns.lba_size * ns.lba_size;
        if max_xfer == 0 {
            // A command must carry at least one LBA: MDTS (or the 8 MiB cap) below the LBA size
            // would make every request zero-sized chunks.
            return Err(TcpError::Unsupported {
                addr: target.addr,
                what: format!(
                    "MDTS allows {} bytes per command, less than one {}-byte LBA of namespace {}",
                    (mdts as u64).min(u64::from(DEFAULT_MAX_XFER)),
                    ns.lba_size,
                    ns.nsid
                ),
            });
        }
        let in_capsule = info.fabrics.in_capsule_bytes();
        Ok(NvmeTcpQueue {
            target,
            opts,
            assoc: Some(assoc),
            info,
            ns,
            depth,
            max_xfer,
            in_capsule,
            reqs: Requests::default(),
            next_conn: 0,
            retry_at: None,
            last_failure: String::new(),
            stats: TcpQueueStats::default(),
            interrupt: None,
            fds: Vec::new(),
            readable: Vec::new(),
        })
    }

    /// The namespace (NSID, LBA size, blocks).
    pub fn namespace(&self) -> Namespace {
        self.ns
    }
    /// What the controller reported at association.
    pub fn controller(&self) -> &ControllerInfo {
        &self.info
    }
    /// Commands in flight per I/O queue.
    pub fn queue_depth(&self) -> u16 {
        self.depth
    }
    /// Bytes of one command at most.
    pub fn max_transfer(&self) -> u32 {
        self.max_xfer
    }
    /// Bytes a write may carry in the capsule.
    pub fn in_capsule_bytes(&self) -> u32 {
        self.in_capsule
    }
    /// Counters.
    pub fn stats(&self) -> TcpQueueStats {
        self.stats
    }
    /// The target.
    pub fn target(&self) -> &TcpTarget {
        &self.target
    }
    /// A flag that, once true, ends every wait: requests in flight and later ones fail with an
    /// `Interrupted` error (SIGINT/SIGTERM).
    pub fn set_interrupt(&mut self, flag: Arc<AtomicBool>) {
        self.interrupt = Some(flag);
    }

    /// Submits an NVM Write of `req.len` bytes from `req.buf` to byte `req.offset`; completes
    /// through [`IoQueue::reap`] like a read. Data up to the in-capsule size travels in the
    /// CapsuleCmd, more after R2Ts.
    pub fn submit_write(&mut self, req: WriteReq) {
        self.stats.writes += 1;
        self.enqueue(Op::Write, req.tag, req.buf, req.offset.0, req.len);
    }

    /// Waits for every command submitted so far, then issues an NVM Flush and waits for it.
    /// Completions of other requests stay queued for the next [`IoQueue::reap`].
    ///
    /// # Errors
    /// The Flush's error status, or the connection's failure.
    pub fn flush(&mut self) -> io::Result<()> {
        crate::sink::flush_after_in_flight(self)
    }

    /// Checks and queues one request, split at the transfer limit.
    fn enqueue(&mut self, op: Op, tag: Tag, buf: AlignedBuf, offset: u64, len: u32) {
        if op != Op::Flush {
            let target = &self.target;
            // Data moves through the socket: any buffer address will do.
            if let Err(e) = request::check(op, offset, len, &buf, &self.ns, 1, &|| target.to_string()) {
                self.stats.errors += 1;
                return self.reqs.fail_now(op, tag, buf, e.into_io());
            }
        }
        self.reqs.push(Request::new(op, tag, buf, offset, len, self.max_xfer, ()));
        self.pump();
    }

    /// The request layer and the transport under it, borrowed apart.
    fn io(&mut self) -> (&mut Requests<()>, TcpIo<'_>) {
        let t = TcpIo {
            assoc: self.assoc.as_mut(),
            next_conn: &mut self.next_conn,
            ns: self.ns,
            in_capsule: self.in_capsule,
            timeout: self.opts.timeout,
            stats: &mut self.stats,
        };
        (&mut self.reqs, t)
    }

    /// Fails every request waiting for a CID with `e()`.
    fn fail_backlog(&mut self, e: &dyn Fn() -> io::Error) {
        let (reqs, mut t) = self.io();
        reqs.fail_waiting(e, &mut t);
    }

    /// A child of request `ri` completed (with `err` if it failed).
    fn child_done(&mut self, ri: u32, err: Option<io::Error>) {
        let (reqs, mut t) = self.io();
        reqs.child_done(ri, err, &mut t);
    }

    /// Sends backlog chunks while I/O queues have room.
    fn pump(&mut self) {
        if self.interrupted() {
            let addr = self.target.addr.clone();
            self.fail_backlog(&|| interrupted(&addr));
            return;
        }
        if !self.reqs.waiting() {
            return;
        }
        if self.assoc.is_none() {
            let due = self.retry_at.is_none_or(|t| Instant::now() >= t);
            if !due {
                let (addr, last) = (self.target.addr.clone(), self.last_failure.clone());
                self.fail_backlog(&|| {
                    TcpError::Disconnected {
                        addr: addr.clone(),
                        cause: last.clone(),
                        attempts: 0,
                        last: "waiting before the next attempt".into(),
                    }
                    .into_io()
                });
                return;
            }
            if !self.reconnect(self.last_failure.clone(), 1) {
                return;
            }
        }
        let (reqs, mut t) = self.io();
        if let Err(e) = reqs.pump(&mut t) {
            self.connection_failed(e);
        }
    }

    fn interrupted(&self) -> bool {
        self.interrupt.as_ref().is_some_and(|f| f.load(Ordering::Relaxed))
    }

    /// Handles one PDU on I/O queue `qi`, completing the child it ends.
    fn on_pdu(&mut self, qi: usize) -> TcpResult<()> {
        if let Some((ri, err)) = self.receive(qi)? {
            self.child_done(ri, err);
        }
        Ok(())
    }

    /// Receives one PDU on I/O queue `qi` and moves its data; returns the child it completes (its
    /// request, and its error).
    fn receive(&mut self, qi: usize) -> TcpResult<Option<(u32, Option<io::Error>)>> {
        let io = &mut self.assoc.as_mut().expect("connected").ios[qi];
        let rx = io.conn.recv("a response to the commands in flight")?;
        let (addr, qid) = (io.conn.addr.clone(), io.conn.qid);
        let bad = |pdu: &'static str, what: String| TcpError::BadPdu { addr: addr.clone(), qid, pdu, what };
        match rx {
            Rx::Resp(cqe) => {
                let Some(cmd) = io.cmds.get_mut(usize::from(cqe.cid)).and_then(Option::take) else {
                    return Err(bad("CapsuleResp", format!("CID {} has no command outstanding", cqe.cid)));
                };
                io.free.push(cqe.cid);
                let r = self.reqs.get(cmd.chunk.req).expect("live request");
                let byte = r.byte(&cmd.chunk);
                let step = r.op.command();
                let s = cqe.status();
                let err = if !s.is_success() {
                    Some(
                        TcpError::Command { addr, qid, step: format!("{step} at byte {byte:#x}"), status: s }.into_io(),
                    )
                } else if r.op == Op::Read && cmd.moved != cmd.chunk.len {
                    Some(
                        bad(
                            "CapsuleResp",
                            format!("success after {} of {} bytes of Read CID {}", cmd.moved, cmd.chunk.len, cqe.cid),
                        )
                        .into_io(),
                    )
                } else {
                    None
                };
                Ok(Some((cmd.chunk.req, err)))
            }
            Rx::Data { hdr, flags: f } => {
                let slot = io.cmds.get_mut(usize::from(hdr.cccid)).and_then(Option::as_mut);
                let Some(cmd) = slot else {
                    return Err(bad("C2HData", format!("CCCID {} has no command outstanding", hdr.cccid)));
                };
                let r = self.reqs.get_mut(cmd.chunk.req).expect("live request");
                if r.op != Op::Read {
                    return Err(bad("C2HData", format!("CCCID {} is a {:?}, not a Read", hdr.cccid, r.op)));
                }
                let end = u64::from(hdr.offset) + u64::from(hdr.length);
                if hdr.offset != cmd.moved || end > u64::from(cmd.chunk.len) {
                    return Err(bad(
                        "C2HData",
                        format!(
                            "DATAO {} + DATAL {} for CID {}: expected data at offset {} within the command's {} bytes",
                            hdr.offset, hdr.length, hdr.cccid, cmd.moved, cmd.chunk.len
                        ),
                    ));
                }
                let at = (cmd.chunk.off + hdr.offset) as usize;
                let dst = &mut r.buf.as_mut_slice()[at..at + hdr.length as usize];
                io.conn.read_data(dst, hdr.cccid, "C2HData")?;
                cmd.moved += hdr.length;
                self.stats.c2h_bytes += u64::from(hdr.length);
                if f & flags::SUCCESS != 0 {
                    if cmd.moved != cmd.chunk.len {
                        return Err(bad(
                            "C2HData",
                            format!("SUCCESS after {} of {} bytes of CID {}", cmd.moved, cmd.chunk.len, hdr.cccid),
                        ));
                    }
                    let chunk = cmd.chunk;
                    io.cmds[usize::from(hdr.cccid)] = None;
                    io.free.push(hdr.cccid);
                    return Ok(Some((chunk.req, None)));
                }
                Ok(None)
            }
            Rx::R2t(h) => {
                let slot = io.cmds.get_mut(usize::from(h.cccid)).and_then(Option::as_mut);
                let Some(cmd) = slot else {
                    return Err(bad("R2T", format!("CCCID {} has no command outstanding", h.cccid)));
                };
                let r = self.reqs.get(cmd.chunk.req).expect("live request");
                if r.op != Op::Write || cmd.chunk.len <= self.in_capsule {
                    return Err(bad("R2T", format!("CCCID {} is not a write waiting for R2T", h.cccid)));
                }
                let end = u64::from(h.offset) + u64::from(h.length);
                if h.length == 0 || h.offset != cmd.moved || end > u64::from(cmd.chunk.len) {
                    return Err(bad(
                        "R2T",
                        format!(
                            "R2TO {} + R2TL {} for CID {}: the write has {} bytes, {} sent",
                            h.offset, h.length, h.cccid, cmd.chunk.len, cmd.moved
                        ),
                    ));
                }
                let base = cmd.chunk.off as usize;
                let max = io.conn.maxh2cdata;
                let mut o = h.offset;
                while o < end as u32 {
                    let n = max.min(end as u32 - o);
                    let d = &r.buf.as_slice()[base + o as usize..base + (o + n) as usize];
                    io.conn.send_h2c(h.cccid, h.ttag, o, d, o + n == end as u32, "H2CData")?;
                    o += n;
                }
                cmd.moved = end as u32;
                self.stats.h2c_bytes += u64::from(h.length);
                self.stats.r2ts += 1;
                Ok(None)
            }
        }
    }

    /// Ends the association after `cause`: requeues the reads (and flushes) in flight for
    /// resubmission, fails the writes, and reconnects.
    fn connection_failed(&mut self, cause: TcpError) {
        let cause_text = picchio_core::error::chain(&cause).to_string();
        tracing::warn!("{}: {cause_text}; reconnecting", self.target);
        if matches!(cause, TcpError::Timeout { .. }) {
            self.stats.timeouts += 1;
        }
        let Some(assoc) = self.assoc.take() else { return };
        let mut failed = Vec::new();
        let mut requeued = 0;
        for io in assoc.ios {
            for cmd in io.cmds.into_iter().flatten() {
                let c = cmd.chunk;
                let r = self.reqs.get(c.req).expect("live request");
                let (byte, op) = (r.byte(&c), r.op);
                let addr = self.target.addr.clone();
                match self.reqs.resubmit(c, self.opts.max_retries) {
                    Resubmit::Queued => requeued += 1,
                    Resubmit::NotIdempotent => {
                        let e = TcpError::WriteLost { addr, byte, cause: cause_text.clone() };
                        failed.push((c.req, e.into_io()));
                    }
                    Resubmit::Exhausted { retries } => {
                        let e = TcpError::RetriesExhausted {
                            addr,
                            what: op.name(),
                            byte,
                            retries,
                            cause: cause_text.clone(),
                        };
                        failed.push((c.req, io::Error::new(cause.kind(), e)));
                    }
                }
            }
        }
        assoc.admin.abandon();
        for (ri, e) in failed {
            self.child_done(ri, Some(e));
        }
        self.stats.resubmitted += requeued;
        if self.reconnect(cause_text, self.opts.reconnect_attempts.max(1)) {
            self.pump();
        }
    }

    /// Tries to re-establish the association; on failure fails the backlog and sets the time of
    /// the next attempt. Returns whether it is connected.
    fn reconnect(&mut self, cause: String, attempts: u32) -> bool {
        let mut last = String::new();
        for i in 0..attempts {
            if self.interrupted() {
                break;
            }
            if i > 0 {
                std::thread::sleep(self.opts.reconnect_delay);
            }
            match establish(&self.target, &self.opts) {
                Ok((assoc, _info, ns, _depth)) if ns == self.ns => {
                    self.assoc = Some(assoc);
                    self.retry_at = None;
                    self.stats.reconnects += 1;
                    tracing::info!("{}: reconnected", self.target);
                    return true;
                }
                Ok((_, _, ns, _)) => {
                    last = format!(
                        "namespace changed: {} LBAs of {} B, was {} of {} B",
                        ns.blocks, ns.lba_size, self.ns.blocks, self.ns.lba_size
                    );
                    break;
                }
                Err(e) => last = picchio_core::error::chain(&e).to_string(),
            }
        }
        self.retry_at = Some(Instant::now() + self.opts.reconnect_delay);
        self.last_failure = format!("{cause}; last reconnect: {last}");
        let (addr, a) = (self.target.addr.clone(), attempts);
        self.fail_backlog(&|| {
            TcpError::Disconnected { addr: addr.clone(), cause: cause.clone(), attempts: a, last: last.clone() }
                .into_io()
        });
        false
    }

    /// Polls the connections once (up to `wait`) and handles what arrived; then checks deadlines.
    fn poll_once(&mut self, wait: Duration) -> usize {
        let Some(assoc) = self.assoc.as_ref() else { return 0 };
        self.fds.clear();
        self.fds.extend(assoc.ios.iter().map(|io| io.conn.fd()));
        let mut readable = std::mem::take(&mut self.readable);
        let mut handled = 0;
        if let Err(e) = poll_readable(&self.fds, wait, &mut readable) {
            let e = TcpError::Socket { addr: self.target.addr.clone(), qid: 1, step: "poll".into(), source: e };
            self.connection_failed(e);
            self.readable = readable;
            return 0;
        }
        for &qi in &readable {
            if let Err(e) = self.on_pdu(qi) {
                self.connection_failed(e);
                break;
            }
            handled += 1;
        }
        self.readable = readable;
        // Per-command deadlines.
        let now = Instant::now();
        let expired = self.assoc.as_ref().and_then(|a| {
            a.ios.iter().find_map(|io| {
                io.cmds
                    .iter()
                    .enumerate()
                    .find_map(|(cid, c)| c.as_ref().filter(|c| c.deadline <= now).map(|c| (io.conn.qid, cid, c.chunk)))
            })
        });
        if let Some((qid, cid, chunk)) = expired {
            let r = self.reqs.get(chunk.req).expect("live request");
            let e = TcpError::Timeout {
                addr: self.target.addr.clone(),
                qid,
                step: format!("{} CID {cid} at byte {:#x}", r.op.command(), r.byte(&chunk)),
                waited_ms: self.opts.timeout.as_millis() as u64,
            };
            self.connection_failed(e);
        }
        handled
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.assoc.as_ref()?.ios.iter().flat_map(|io| io.cmds.iter().flatten().map(|c| c.deadline)).min()
    }
}

/// The NVMe/TCP transport under the request layer: the fields of an [`NvmeTcpQueue`] that sending
/// one command touches, borrowed apart from its [`Requests`].
struct TcpIo<'a> {
    assoc: Option<&'a mut Assoc>,
    next_conn: &'a mut usize,
    ns: Namespace,
    in_capsule: u32,
    timeout: Duration,
    stats: &'a mut TcpQueueStats,
}

impl Transport for TcpIo<'_> {
    type Extra = ();
    type Error = TcpError;

    /// Sends `child` as one CapsuleCmd on the next I/O queue (round robin) with a free CID.
    fn submit(&mut self, child: Child, r: &mut Request<()>) -> Submit<TcpError> {
        let Some(assoc) = self.assoc.as_deref_mut() else { return Submit::Full };
        let n = assoc.ios.len();
        let Some(qi) = (0..n).map(|k| (*self.next_conn + k) % n).find(|&i| !assoc.ios[i].free.is_empty()) else {
            return Submit::Full;
        };
        *self.next_conn = (qi + 1) % n;
        match self.send(qi, child, r) {
            Ok(()) => Submit::Sent,
            Err(e) => Submit::Broken(e),
        }
    }

    fn retire(&mut self, r: &mut Request<()>) {
        self.stats.errors += u64::from(r.error.is_some());
    }
}

impl TcpIo<'_> {
    /// Sends `chunk` of `r` as one command on I/O queue `qi` (registered as in flight first, so a
    /// send that fails leaves it to be resubmitted).
    fn send(&mut self, qi: usize, chunk: Child, r: &Request<()>) -> TcpResult<()> {
        let io = &mut self.assoc.as_deref_mut().expect("connected").ios[qi];
        let cid = io.free.pop().expect("a free CID");
        let lba = u64::from(self.ns.lba_size);
        let byte = r.byte(&chunk);
        let (nsid, nlb) = (self.ns.nsid, (u64::from(chunk.len) / lba) as u32);
        let (mut cmd, data) = match r.op {
            Op::Read => {
                let mut c = Command::rw(r.op.opcode(), cid, nsid, Lba(byte / lba), nlb);
                sgl::set(&mut c, sgl::TRANSPORT, 0, chunk.len);
                (c, None)
            }
            Op::Write => {
                let mut c = Command::rw(r.op.opcode(), cid, nsid, Lba(byte / lba), nlb);
                if chunk.len <= self.in_capsule {
                    sgl::set(&mut c, sgl::IN_CAPSULE, 0, chunk.len);
                    (c, Some(&r.buf.as_slice()[chunk.off as usize..(chunk.off + chunk.len) as usize]))
                } else {
                    sgl::set(&mut c, sgl::TRANSPORT, 0, chunk.len);
                    (c, None)
                }
            }
            Op::Flush => {
                let mut c = Command::new(r.op.opcode(), cid);
                c.nsid = nsid;
                sgl::set(&mut c, sgl::TRANSPORT, 0, 0);
                (c, None)
            }
        };
        cmd.set_cid(cid);
        if let Some(d) = data {
            self.stats.h2c_bytes += d.len() as u64;
        }
        io.cmds[cid as usize] = Some(Cmd { chunk, deadline: Instant::now() + self.timeout, moved: 0 });
        self.stats.commands += 1;
        io.conn.send_capsule(&cmd, data, &format!("{} CID {cid} at byte {byte:#x}", r.op.command()))
    }
}

fn interrupted(addr: &str) -> io::Error {
    io::Error::new(io::ErrorKind::Interrupted, format!("nvme-tcp {addr}: I/O interrupted (SIGINT/SIGTERM)"))
}

/// Association + namespace + I/O queues.
fn establish(target: &TcpTarget, opts: &TcpOptions) -> TcpResult<(Assoc, ControllerInfo, Namespace, u16)> {
    let (mut admin, info) = assoc::associate(&target.addr, &target.subnqn, opts)?;
    if info.fabrics.icdoff != 0 {
        return Err(TcpError::Unsupported {
            addr: target.addr.clone(),
            what: format!("ICDOFF {} (NVMe/TCP in-capsule data starts at offset 0)", info.fabrics.icdoff),
        });
    }
    let ns = assoc::identify_namespace(&mut admin, target.nsid)?;
    // SQ entries: at most CAP.MQES + 1; one is kept empty, and MAXCMD caps commands outstanding.
    let mqes = u32::from(info.cap.mqes()) + 1;
    let mut depth = u32::from(opts.qd.max(1)).min(mqes.saturating_sub(1).max(1));
    if info.fabrics.maxcmd > 0 {
        depth = depth.min(u32::from(info.fabrics.maxcmd));
    }
    if depth < u32::from(opts.qd) {
        tracing::warn!(
            "{target}: queue depth {} clamped to {depth} (CAP.MQES {}, MAXCMD {})",
            opts.qd,
            info.cap.mqes(),
            info.fabrics.maxcmd
        );
    }
    let depth = depth as u16;
    let cntlid = admin.cntlid;
    let kept = KeptAdmin::start(admin, opts.kato);
    let mut ios = Vec::with_capacity(usize::from(opts.io_queues.max(1)));
    for qid in 1..=opts.io_queues.max(1) {
        let (conn, _) = assoc::connect_queue(&target.addr, &target.subnqn, qid, depth + 1, cntlid, opts)?;
        ios.push(IoConn { conn, cmds: (0..depth).map(|_| None).collect(), free: (0..depth).rev().collect() });
    }
    Ok((Assoc { admin: kept, ios }, info, ns, depth))
}

impl crate::sink::FlushSteps for NvmeTcpQueue {
    type Transport = ();
    fn requests(&mut self) -> &mut Requests<()> {
        &mut self.reqs
    }
    fn enqueue_flush(&mut self, buf: AlignedBuf) {
        self.stats.flushes += 1;
        self.enqueue(Op::Flush, Tag(u64::MAX), buf, 0, 0);
    }
}

impl IoQueue for NvmeTcpQueue {
    fn block_size(&self) -> u32 {
        self.ns.lba_size
    }

    fn submit(&mut self, req: ReadReq) {
        self.stats.reads += 1;
        self.enqueue(Op::Read, req.tag, req.buf, req.offset.0, req.len);
    }

    fn reap(&mut self, min: usize, out: &mut Vec<Completion>) -> usize {
        loop {
            self.pump();
            if self.reqs.ready() >= min || self.reqs.active() == 0 || self.assoc.is_none() {
                // Disconnected: `pump` failed or resubmitted everything it could.
                break;
            }
            let wait = self
                .next_deadline()
                .map_or(Duration::from_millis(100), |d| d.saturating_duration_since(Instant::now()))
                .min(Duration::from_millis(100));
            self.poll_once(wait);
            if self.interrupted() {
                if let Some(a) = self.assoc.take() {
                    let addr = self.target.addr.clone();
                    for io in a.ios {
                        for c in io.cmds.into_iter().flatten() {
                            self.child_done(c.chunk.req, Some(interrupted(&addr)));
                        }
                    }
                }
                let addr = self.target.addr.clone();
                self.fail_backlog(&|| interrupted(&addr));
                self.retry_at = Some(Instant::now() + Duration::from_secs(3600));
            }
        }
        self.reqs.take_ready(out)
    }

    fn in_flight(&self) -> usize {
        self.reqs.in_flight()
    }

    fn describe(&self) -> String {
        format!(
            "nvme-tcp({}, {}, nsid {}, {} queue{} × qd {}{}{})",
            self.target.addr,
            self.target.subnqn,
            self.ns.nsid,
            self.opts.io_queues.max(1),
            if self.opts.io_queues > 1 { "s" } else { "" },
            self.depth,
            if self.opts.hdgst { ", hdgst" } else { "" },
            if self.opts.ddgst { ", ddgst" } else { "" },
        )
    }
}

impl std::fmt::Debug for NvmeTcpQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeTcpQueue").field("target", &self.target).field("ns", &self.ns).finish_non_exhaustive()
    }
}
