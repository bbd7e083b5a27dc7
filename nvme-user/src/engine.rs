//! [`NvmeQueue`]: the [`IoQueue`] engine over one NVMe I/O queue pair.
//!
//! A read becomes one NVMe Read per `max_transfer` bytes (the MDTS split), each with its own CID and
//! PRPs into the request's buffer; the request completes when all its commands have. Nothing blocks
//! in `submit`: requests wait in a backlog for free CIDs, and `reap` polls the CQ, refills the SQ and
//! rings each doorbell once per batch.
//!
//! # Where the bytes land
//! - **Direct** (the sim, [`NvmeQueue::new`]): the request's [`AlignedBuf`] is lent to the device with
//!   [`DmaPool::map_external`]; for the sim's [`HeapDma`] its IOVA is its host address, so bytes go
//!   from the device into the cache slot with no copy.
//! - **Bounce** ([`NvmeQueue::with_bounce_buffer`]) — an **interim** for VFIO until the runtime's cache
//!   slots are allocated from the DMA pool: every command reads into a per-CID bounce buffer from the
//!   [`DmaPool`] and the bytes are copied into the `AlignedBuf` on completion. Correct, one extra copy.
//!
//! # Failures
//! An error status completes the request with an `io::Error` naming the status; a command without a
//! completion after the timeout completes its request with `TimedOut`, and because the device could
//! still write that buffer later, the buffer is quarantined until the controller is shut down and a
//! fresh zeroed buffer of the same size goes back instead. CSTS.CFS fails every request in flight
//! and every later one.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use picchio_core::{AlignedBuf, Completion, IoQueue, ReadReq, Tag};

use crate::ctrlr::{Controller, CtrlrOptions, Namespace};
use crate::dma::{DmaBuf, DmaPool, HeapDma, Iova};
use crate::error::{Error, Result};
use crate::queue::CqEntry;
use crate::sim::{Sim, SimConfig};
use crate::spec::{nvm, Command, Lba};

/// Options for [`NvmeQueue`].
#[derive(Clone, Debug)]
pub struct NvmeQueueOptions {
    /// Namespace to read.
    pub nsid: u32,
    /// Commands in flight at once (the I/O queue has `qd + 1` entries).
    pub qd: u16,
    /// Per-command timeout.
    pub timeout: Duration,
}

impl Default for NvmeQueueOptions {
    fn default() -> Self {
        NvmeQueueOptions { nsid: 1, qd: 32, timeout: Duration::from_secs(5) }
    }
}

impl NvmeQueueOptions {
    /// Controller options creating an I/O queue for this depth.
    pub fn ctrlr_options(&self) -> CtrlrOptions {
        CtrlrOptions { io_entries: self.qd.saturating_add(1), ..CtrlrOptions::default() }
    }
}

/// Counters of an [`NvmeQueue`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NvmeQueueStats {
    /// Reads submitted.
    pub reads: u64,
    /// NVMe commands issued (more than `reads` when transfers are split at MDTS).
    pub commands: u64,
    /// Commands that timed out.
    pub timeouts: u64,
    /// Completions that arrived after their command timed out.
    pub late: u64,
    /// Completions with an unknown CID.
    pub unknown_cids: u64,
    /// Commands completed with an error status.
    pub errors: u64,
    /// Bytes copied from bounce buffers.
    pub bounce_bytes: u64,
}

enum DataPath {
    Direct,
    Bounce(Vec<DmaBuf>),
}

struct Req {
    tag: Tag,
    buf: AlignedBuf,
    /// IOVA of the buffer when mapped (direct path).
    iova: Option<Iova>,
    offset: u64,
    len: u32,
    issued: u32,
    outstanding: u32,
    error: Option<io::Error>,
    /// A command of this request timed out: the device may still write the buffer.
    lost: bool,
    /// Still in the backlog (commands left to issue).
    queued: bool,
    started: Instant,
}

/// One NVMe I/O queue pair as an [`IoQueue`] (see the module documentation).
pub struct NvmeQueue {
    // Declared first: dropped (controller shut down, DMA stopped) before any buffer below.
    ctrlr: Controller,
    ns: Namespace,
    lba_shift: u32,
    max_xfer: usize,
    dma: Arc<dyn DmaPool>,
    path: DataPath,
    label: String,
    timeout: Duration,
    reqs: Vec<Option<Req>>,
    free_reqs: Vec<u32>,
    active: usize,
    backlog: VecDeque<u32>,
    ready: Vec<Completion>,
    events: Vec<CqEntry>,
    fatal: Option<String>,
    quarantine: Vec<(AlignedBuf, Option<(Iova, usize)>)>,
    idle: u32,
    polls: u64,
    qd: usize,
    stats: NvmeQueueStats,
}

impl NvmeQueue {
    /// An engine over `ctrlr`'s I/O queue pair, reading namespace `nsid` directly into request buffers
    /// lent with [`DmaPool::map_external`]. `label` names the controller in [`IoQueue::describe`].
    ///
    /// # Errors
    /// [`Error::NoNamespace`]; [`Error::Unsupported`] if the controller has no I/O queue.
    pub fn new(ctrlr: Controller, nsid: u32, timeout: Duration, label: impl Into<String>) -> Result<Self> {
        Self::build(ctrlr, nsid, timeout, label.into(), false)
    }

    /// **Interim for VFIO**: like [`NvmeQueue::new`], but every command reads into a per-CID bounce
    /// buffer allocated from the controller's [`DmaPool`] (at most 128 KiB per command), copied into
    /// the request's `AlignedBuf` on completion. Use until cache slots come from the DMA pool.
    ///
    /// # Errors
    /// As [`NvmeQueue::new`], plus [`Error::DmaAlloc`].
    pub fn with_bounce_buffer(
        ctrlr: Controller,
        nsid: u32,
        timeout: Duration,
        label: impl Into<String>,
    ) -> Result<Self> {
        Self::build(ctrlr, nsid, timeout, label.into(), true)
    }

    fn build(mut ctrlr: Controller, nsid: u32, timeout: Duration, label: String, bounce: bool) -> Result<Self> {
        let ns = ctrlr.namespace(nsid)?;
        let dma = ctrlr.dma().clone();
        let mut max_xfer = ctrlr.max_transfer();
        let cap = ctrlr
            .io_queue()
            .ok_or_else(|| Error::Unsupported { what: "controller initialized without an I/O queue".into() })?
            .capacity();
        let path = if bounce {
            max_xfer = max_xfer.min(128 << 10);
            DataPath::Bounce((0..cap).map(|_| dma.alloc(max_xfer)).collect::<Result<_>>()?)
        } else {
            DataPath::Direct
        };
        // Whole LBAs per command.
        max_xfer -= max_xfer % ns.lba_size as usize;
        Ok(NvmeQueue {
            ctrlr,
            lba_shift: ns.lba_size.trailing_zeros(),
            ns,
            max_xfer,
            dma,
            path,
            label,
            timeout,
            reqs: Vec::new(),
            free_reqs: Vec::new(),
            active: 0,
            backlog: VecDeque::new(),
            ready: Vec::new(),
            events: Vec::with_capacity(cap),
            fatal: None,
            quarantine: Vec::new(),
            idle: 0,
            polls: 0,
            qd: cap,
            stats: NvmeQueueStats::default(),
        })
    }

    /// Starts a [`Sim`] with `cfg`, initializes the driver against it, and returns the engine and the
    /// sim (for fault injection and statistics).
    ///
    /// # Errors
    /// Sim start-up, controller init, or namespace errors.
    pub fn open_sim(cfg: SimConfig, opts: &NvmeQueueOptions) -> Result<(NvmeQueue, Sim)> {
        let dma = HeapDma::new();
        let sim = Sim::start(cfg, dma.registry())?;
        let ctrlr = Controller::init(sim.bar(), Arc::new(dma), opts.ctrlr_options())?;
        Ok((NvmeQueue::new(ctrlr, opts.nsid, opts.timeout, "sim")?, sim))
    }

    /// The namespace being read.
    pub fn namespace(&self) -> Namespace {
        self.ns
    }
    /// Bytes per NVMe command (MDTS, PRP list and bounce limits applied).
    pub fn max_transfer(&self) -> usize {
        self.max_xfer
    }
    /// Counters.
    pub fn stats(&self) -> NvmeQueueStats {
        self.stats
    }
    /// The controller.
    pub fn controller(&self) -> &Controller {
        &self.ctrlr
    }
    /// Whether a controller fatal status stopped this queue (and why).
    pub fn fatal(&self) -> Option<&str> {
        self.fatal.as_deref()
    }

    fn complete_now(&mut self, tag: Tag, buf: AlignedBuf, err: io::Error) {
        self.ready.push(Completion { tag, buf, result: Err(err), latency_ns: 0 });
    }

    fn validate(&self, req: &ReadReq) -> std::result::Result<(), String> {
        let lba = u64::from(self.ns.lba_size);
        let addr = req.buf.as_slice().as_ptr() as u64;
        if req.len == 0 || u64::from(req.len) % lba != 0 || !req.offset.0.is_multiple_of(lba) || !addr.is_multiple_of(4)
        {
            return Err(format!(
                "NVMe read of {} bytes at {:#x} into {addr:#x} is not aligned to the {lba}-byte LBA",
                req.len, req.offset.0
            ));
        }
        if req.len as usize > req.buf.len() {
            return Err(format!("NVMe read of {} bytes into a {}-byte buffer", req.len, req.buf.len()));
        }
        if req.offset.0.checked_add(u64::from(req.len)).is_none_or(|e| e > self.ns.bytes()) {
            return Err(format!(
                "NVMe read of {} bytes at {:#x} past the end of namespace {} ({} bytes)",
                req.len,
                req.offset.0,
                self.ns.nsid,
                self.ns.bytes()
            ));
        }
        Ok(())
    }

    /// Issues commands for backlogged requests while CIDs are free; rings the SQ doorbell once.
    fn pump(&mut self) {
        'outer: while let Some(&ri) = self.backlog.front() {
            let Some(q) = self.ctrlr.io_queue() else { return };
            let Some(r) = self.reqs[ri as usize].as_mut() else {
                self.backlog.pop_front();
                continue;
            };
            while r.issued < r.len {
                let Some(cid) = q.alloc_cid() else { break 'outer };
                let off = r.issued;
                let n = (r.len - off).min(self.max_xfer as u32);
                let seg = match &self.path {
                    DataPath::Direct => r.iova.expect("mapped at submit").add(u64::from(off)),
                    DataPath::Bounce(b) => b[usize::from(cid.0)].iova(),
                };
                let prps = match q.prps(cid, &[(seg, n as usize)]) {
                    Ok(p) => p,
                    Err(e) => {
                        q.release_cid(cid);
                        r.error.get_or_insert_with(|| {
                            io::Error::new(io::ErrorKind::InvalidInput, format!("PRP list: {e}"))
                        });
                        r.issued = r.len;
                        break;
                    }
                };
                let slba = Lba((r.offset + u64::from(off)) >> self.lba_shift);
                let nsid = self.ns.nsid;
                let user = (u64::from(ri) << 32) | u64::from(off);
                q.submit(cid, user, |c| {
                    *c = Command::rw(nvm::READ, cid.0, nsid, slba, n >> self.lba_shift);
                    c.prp1 = prps.prp1;
                    c.prp2 = prps.prp2;
                })
                .expect("a free CID implies a free SQ slot");
                r.issued += n;
                r.outstanding += 1;
                self.stats.commands += 1;
            }
            self.backlog.pop_front();
            r.queued = false;
            if r.outstanding == 0 {
                self.finish(ri);
            }
        }
        if let Some(q) = self.ctrlr.io_queue() {
            q.ring();
        }
    }

    fn finish(&mut self, ri: u32) {
        let Some(mut r) = self.reqs[ri as usize].take() else { return };
        self.free_reqs.push(ri);
        self.active -= 1;
        if let Some(iova) = r.iova.filter(|_| !r.lost) {
            self.dma.unmap_external(iova, r.len as usize);
        }
        let buf = if r.lost {
            // The device may still write this buffer: keep it (and its mapping) until shutdown.
            let fresh =
                AlignedBuf::new(r.buf.len(), r.buf.align()).unwrap_or_else(|e| panic!("replacement buffer: {e}"));
            self.quarantine.push((std::mem::replace(&mut r.buf, fresh), r.iova.map(|i| (i, r.len as usize))));
            r.buf
        } else {
            r.buf
        };
        let result = match r.error {
            Some(e) => Err(e),
            None => Ok(r.len),
        };
        self.ready.push(Completion { tag: r.tag, buf, result, latency_ns: r.started.elapsed().as_nanos() as u64 });
    }

    /// One poll of the CQ; returns completions consumed.
    fn poll(&mut self) -> usize {
        let Some(q) = self.ctrlr.io_queue() else { return 0 };
        let events = &mut self.events;
        let res = q.poll(usize::MAX, |e| events.push(e));
        if let Err(e) = res {
            self.stats.unknown_cids += 1;
            tracing::error!(error = %e, "nvme completion ignored");
        }
        let n = self.events.len();
        let mut events = std::mem::take(&mut self.events);
        for e in events.drain(..) {
            if e.late {
                self.stats.late += 1;
                continue;
            }
            let ri = (e.user >> 32) as u32;
            let off = e.user as u32;
            let max = self.max_xfer as u32;
            let Some(r) = self.reqs[ri as usize].as_mut() else { continue };
            r.outstanding -= 1;
            let status = e.cqe.status();
            if status.is_success() {
                if let DataPath::Bounce(b) = &self.path {
                    let n = (r.len - off).min(max) as usize;
                    b[usize::from(e.cid.0)].copy_out(0, &mut r.buf.as_mut_slice()[off as usize..off as usize + n]);
                    self.stats.bounce_bytes += n as u64;
                }
            } else {
                self.stats.errors += 1;
                r.error.get_or_insert_with(|| {
                    io::Error::other(format!(
                        "NVMe read of namespace {} at byte {:#x}: {status}",
                        self.ns.nsid,
                        r.offset + u64::from(off)
                    ))
                });
                r.issued = r.len; // issue nothing more for this request
            }
            if r.outstanding == 0 && r.issued == r.len && !r.queued {
                self.finish(ri);
            }
        }
        self.events = events;
        n
    }

    fn expire(&mut self) {
        let Some(q) = self.ctrlr.io_queue() else { return };
        let mut expired = Vec::new();
        q.expire(self.timeout, |cid, user| expired.push((cid, user)));
        for (cid, user) in expired {
            self.stats.timeouts += 1;
            let ri = (user >> 32) as u32;
            let Some(r) = self.reqs[ri as usize].as_mut() else { continue };
            r.outstanding -= 1;
            r.lost = true;
            r.issued = r.len;
            let ms = self.timeout.as_millis();
            r.error.get_or_insert_with(|| {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("NVMe read at byte {:#x}: no completion for CID {} after {ms} ms", r.offset, cid.0),
                )
            });
            if r.outstanding == 0 && !r.queued {
                self.finish(ri);
            }
        }
        if let Err(e) = self.ctrlr.check_fatal("I/O") {
            self.fail_all(e.to_string());
        }
    }

    /// Controller fatal: every request fails, the queue accepts no more.
    fn fail_all(&mut self, why: String) {
        tracing::error!(%why, "nvme queue stopped");
        self.backlog.clear();
        for ri in 0..self.reqs.len() as u32 {
            if let Some(r) = self.reqs[ri as usize].as_mut() {
                r.lost |= r.outstanding > 0;
                r.outstanding = 0;
                r.queued = false;
                r.issued = r.len;
                r.error = Some(io::Error::other(why.clone()));
                self.finish(ri);
            }
        }
        self.fatal = Some(why);
    }
}

impl IoQueue for NvmeQueue {
    fn block_size(&self) -> u32 {
        self.ns.lba_size
    }

    fn submit(&mut self, req: ReadReq) {
        self.stats.reads += 1;
        if let Some(why) = &self.fatal {
            let e = io::Error::other(why.clone());
            return self.complete_now(req.tag, req.buf, e);
        }
        if let Err(why) = self.validate(&req) {
            return self.complete_now(req.tag, req.buf, io::Error::new(io::ErrorKind::InvalidInput, why));
        }
        let ReadReq { offset, len, mut buf, tag } = req;
        let iova = match self.path {
            DataPath::Direct => match self.dma.map_external(buf.as_mut_ptr(), len as usize) {
                Ok(i) => Some(i),
                Err(e) => return self.complete_now(tag, buf, io::Error::other(e.to_string())),
            },
            DataPath::Bounce(_) => None,
        };
        let r = Req {
            tag,
            buf,
            iova,
            offset: offset.0,
            len,
            issued: 0,
            outstanding: 0,
            error: None,
            lost: false,
            queued: true,
            started: Instant::now(),
        };
        let ri = match self.free_reqs.pop() {
            Some(i) => {
                self.reqs[i as usize] = Some(r);
                i
            }
            None => {
                self.reqs.push(Some(r));
                (self.reqs.len() - 1) as u32
            }
        };
        self.active += 1;
        self.backlog.push_back(ri);
        self.pump();
    }

    fn reap(&mut self, min: usize, out: &mut Vec<Completion>) -> usize {
        loop {
            let got = self.poll();
            self.pump();
            if self.ready.len() >= min || self.active == 0 {
                break;
            }
            self.polls += 1;
            if self.polls.is_multiple_of(64) {
                self.expire(); // also while other commands keep completing
            }
            if got == 0 {
                self.idle += 1;
                if self.idle.is_multiple_of(1024) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            } else {
                self.idle = 0;
            }
        }
        let n = self.ready.len();
        out.append(&mut self.ready);
        n
    }

    fn in_flight(&self) -> usize {
        self.active + self.ready.len()
    }

    fn describe(&self) -> String {
        let cap = self.qd;
        let bounce = if matches!(self.path, DataPath::Bounce(_)) { ", bounce" } else { "" };
        format!("nvme({}, nsid {}, qd {cap}{bounce})", self.label, self.ns.nsid)
    }
}

impl Drop for NvmeQueue {
    fn drop(&mut self) {
        // Stop the device before lent buffers (in flight or quarantined) are unmapped and freed.
        if let Err(e) = self.ctrlr.shutdown() {
            tracing::warn!(error = %e, "nvme shutdown");
        }
        for r in self.reqs.iter().flatten() {
            if let Some(iova) = r.iova {
                self.dma.unmap_external(iova, r.len as usize);
            }
        }
        for (_, m) in &self.quarantine {
            if let Some((iova, len)) = *m {
                self.dma.unmap_external(iova, len);
            }
        }
    }
}

impl std::fmt::Debug for NvmeQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}
