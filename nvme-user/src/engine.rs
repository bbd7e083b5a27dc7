//! [`NvmeQueue`]: the [`IoQueue`] engine over one NVMe I/O queue pair.
//!
//! A read becomes one NVMe Read per `max_transfer` bytes (the MDTS split), each with its own CID and
//! PRPs into the request's buffer; the request completes when all its commands have. Nothing blocks
//! in `submit`: requests wait in a backlog for free CIDs, and `reap` polls the CQ, refills the SQ and
//! rings each doorbell once per batch.
//!
//! # Where the bytes land
//! - **Pool slots** (zero-copy, both data paths below): [`IoQueue::slot_allocator`] maps one
//!   [`DmaRegion`](crate::dma::DmaRegion) of `count × len` bytes (2 MiB hugepages for VFIO) and lends
//!   it as [`AlignedBuf`] slots ([`SlotPool`]). A request whose buffer lies in such a region is
//!   recognised by its address, and its PRPs are built straight from the region's IOVAs: the device
//!   writes the expert cache's slot itself.
//! - **Direct** (the sim, [`NvmeQueue::new`]): any other buffer is lent to the device with
//!   [`DmaPool::map_external`]; for the sim's [`HeapDma`] its IOVA is its host address.
//! - **Bounce** ([`NvmeQueue::with_bounce_buffer`], VFIO, whose hugepage pool cannot map arbitrary
//!   heap memory): any other buffer is served through per-CID bounce buffers from the [`DmaPool`]
//!   (at most 128 KiB per command) and copied on completion (reads) or before submission (writes),
//!   counted in [`NvmeQueueStats::bounce_bytes`] ([`IoQueue::bounce_bytes`]). The superblock and
//!   index reads at open take this path; expert reads do when the cache's slots could not be placed
//!   in hugepages (warned once, with the number of pages to reserve).
//!
//! # Writes and Flush
//! [`NvmeQueue::submit_write`] issues NVM Write commands (opcode 0x01) through the same data paths
//! and completes through [`IoQueue::reap`] like a read; [`NvmeQueue::flush`] issues a Flush (opcode
//! 0x00, NVM command set §3.2.2) and waits for it. `picchio pack --out nvme:` writes images this way.
//!
//! # Failures
//! An error status completes the request with an `io::Error` naming the status. A command without a
//! completion after the timeout is aborted (Abort, §5.1), and if that does not resolve it — or on
//! CSTS.CFS — the controller is reset and re-initialized on the same DMA memory: exactly the requests
//! with a command in flight fail, with a typed [`ReadFailure`] inside the `io::Error`, and later
//! requests are served (bounded by [`RecoveryPolicy`]; details in `engine/recovery.rs`). Only when
//! the queue stops (reset limit, failed reset, interrupt) may the device still own a buffer: it is
//! then quarantined until the controller is shut down and a fresh zeroed buffer goes back instead.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use picchio_core::{AlignedBuf, Completion, IoQueue, ReadReq, SlotAllocator, Tag};

use crate::ctrlr::{Controller, CtrlrOptions, Namespace};
use crate::dma::{hugepage_shortfall, DmaBuf, DmaPool, DmaSlots, HeapDma, Iova, SlotPool};
use crate::error::{Error, Result};
use crate::queue::CqEntry;
use crate::sim::{Sim, SimConfig};

mod recovery;
use crate::spec::{nvm, Command, Lba};
pub use recovery::{ReadFailure, RecoveryPolicy};

/// Options for [`NvmeQueue`].
#[derive(Clone, Debug)]
pub struct NvmeQueueOptions {
    /// Namespace to read.
    pub nsid: u32,
    /// Commands in flight at once (the I/O queue has `qd + 1` entries). The controller caps the
    /// queue at CAP.MQES + 1 entries (NVMe base spec 2.0, §3.1.3.1; at most 4096 here), so the depth
    /// used is at most CAP.MQES: a larger `qd` is clamped with a warning
    /// ([`NvmeQueue::queue_depth`] says what was used); further reads wait inside the queue.
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
    /// Abort commands sent for timed-out commands.
    pub aborts: u64,
    /// Controller resets (after an unresolved timeout or CSTS.CFS).
    pub resets: u64,
    /// Completions that arrived after their command timed out.
    pub late: u64,
    /// Completions with an unknown CID.
    pub unknown_cids: u64,
    /// Commands completed with an error status.
    pub errors: u64,
    /// Bytes copied between bounce buffers and request buffers (reads and writes whose buffer is not
    /// DMA memory the device reaches); 0 when every buffer is a pool slot.
    pub bounce_bytes: u64,
    /// Reads whose buffer was a pool slot, read into with no copy.
    pub zero_copy_reads: u64,
    /// Write requests submitted.
    pub writes: u64,
    /// Flush commands completed.
    pub flushes: u64,
}

/// What a request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Read,
    Write,
    /// NVM Flush: no data; `len` is 0.
    Flush,
}

/// Bytes per command through a bounce buffer.
const BOUNCE_XFER: usize = 128 << 10;

/// A command must carry at least one LBA (through the bounce buffer too): an LBA larger than
/// `max_xfer` (MDTS) would round every command down to zero bytes.
///
/// # Errors
/// [`Error::Unsupported`] naming the LBA size and the per-command limit.
fn check_lba_fits_a_command(nsid: u32, lba_size: u32, max_xfer: usize, bounce: bool) -> Result<()> {
    let per_cmd = if bounce { max_xfer.min(BOUNCE_XFER) } else { max_xfer };
    if per_cmd < lba_size as usize {
        return Err(Error::Unsupported {
            what: format!(
                "namespace {nsid} has {lba_size}-byte LBAs, but a command carries at most {per_cmd} bytes{}",
                if bounce { " (MDTS, and the bounce buffer)" } else { " (MDTS)" }
            ),
        });
    }
    Ok(())
}

enum DataPath {
    Direct,
    Bounce(Vec<DmaBuf>),
}

struct Req {
    tag: Tag,
    buf: AlignedBuf,
    op: Op,
    /// IOVA of the buffer when mapped (direct path).
    iova: Option<Iova>,
    /// The buffer is a pool slot: (index into `NvmeQueue::slot_pools`, offset in its region).
    slot: Option<(usize, usize)>,
    /// Bytes per command for this request (bounce buffers hold less than MDTS).
    chunk: u32,
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
    /// Regions lent out as cache slots ([`IoQueue::slot_allocator`]).
    slot_pools: Vec<Arc<SlotPool>>,
    /// Scratch for a command's PRP segments.
    segs: Vec<(Iova, usize)>,
    /// Result of the last [`NvmeQueue::flush`] command, set when it completes.
    flush_done: Option<io::Result<u32>>,
    label: String,
    timeout: Duration,
    reqs: Vec<Option<Req>>,
    free_reqs: Vec<u32>,
    active: usize,
    backlog: VecDeque<u32>,
    ready: Vec<Completion>,
    events: Vec<CqEntry>,
    fatal: Option<String>,
    /// Abort/reset/interrupt state (`recovery.rs`).
    recovery: recovery::Recovery,
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

    /// The VFIO data path: like [`NvmeQueue::new`], but a buffer that is not a slot of this queue's
    /// DMA pool ([`IoQueue::slot_allocator`]) is served through per-CID bounce buffers allocated from
    /// the controller's [`DmaPool`] (at most 128 KiB per command), copied on completion (reads) or
    /// before submission (writes) and counted in [`NvmeQueueStats::bounce_bytes`]; pool slots are
    /// read and written with no copy. (The hugepage pool cannot map arbitrary heap memory.)
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
        check_lba_fits_a_command(nsid, ns.lba_size, max_xfer, bounce)?;
        let cap = ctrlr
            .io_queue()
            .ok_or_else(|| Error::Unsupported { what: "controller initialized without an I/O queue".into() })?
            .capacity();
        let path = if bounce {
            DataPath::Bounce((0..cap).map(|_| dma.alloc(max_xfer.min(BOUNCE_XFER))).collect::<Result<_>>()?)
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
            slot_pools: Vec::new(),
            segs: Vec::with_capacity(8),
            flush_done: None,
            label,
            timeout,
            reqs: Vec::new(),
            free_reqs: Vec::new(),
            active: 0,
            backlog: VecDeque::new(),
            ready: Vec::new(),
            events: Vec::with_capacity(cap),
            fatal: None,
            recovery: Default::default(),
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
        Self::open_sim_with(cfg, opts, HeapDma::new(), false)
    }

    /// As [`NvmeQueue::open_sim`], with the DMA allocator given (e.g. with
    /// [`HeapDma::limit_regions`]) and, with `bounce`, the VFIO data path: buffers that are not pool
    /// slots go through bounce buffers ([`NvmeQueue::with_bounce_buffer`]) instead of being mapped.
    ///
    /// # Errors
    /// As [`NvmeQueue::open_sim`].
    pub fn open_sim_with(
        cfg: SimConfig,
        opts: &NvmeQueueOptions,
        dma: HeapDma,
        bounce: bool,
    ) -> Result<(NvmeQueue, Sim)> {
        let sim = Sim::start(cfg, dma.registry())?;
        let ctrlr = Controller::init(sim.bar(), Arc::new(dma), opts.ctrlr_options())?;
        let label = if bounce { "sim, vfio data path" } else { "sim" };
        let queue = Self::build(ctrlr, opts.nsid, opts.timeout, label.into(), bounce)?;
        queue.warn_if_clamped(opts.qd);
        Ok((queue, sim))
    }

    /// Commands this engine keeps in flight at most: the I/O queue's entries − 1 (one slot stays
    /// empty so a full SQ is told from an empty one), i.e. at most CAP.MQES.
    pub fn queue_depth(&self) -> usize {
        self.qd
    }

    /// Logs a warning when `requested` (an [`NvmeQueueOptions::qd`]) is above what the controller
    /// granted (CAP.MQES + 1 entries, one kept empty): reads beyond it wait in the driver's backlog.
    /// Returns whether it was clamped.
    pub fn warn_if_clamped(&self, requested: u16) -> bool {
        let clamped = usize::from(requested) > self.qd;
        if clamped {
            tracing::warn!(
                "{}: queue depth {requested} requested, but the controller's I/O queue holds {} commands \
                 (CAP.MQES + 1 entries, one kept empty): using {}",
                self.label,
                self.qd,
                self.qd
            );
        }
        clamped
    }

    /// The namespace being read.
    pub fn namespace(&self) -> Namespace {
        self.ns
    }
    /// Bytes per NVMe command into a pool slot or mapped buffer (MDTS and PRP list limits applied;
    /// through a bounce buffer at most 128 KiB).
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

    fn validate(&self, req: &ReadReq, what: &str) -> std::result::Result<(), String> {
        let lba = u64::from(self.ns.lba_size);
        let addr = req.buf.as_slice().as_ptr() as u64;
        if req.len == 0 || u64::from(req.len) % lba != 0 || !req.offset.0.is_multiple_of(lba) || !addr.is_multiple_of(4)
        {
            return Err(format!(
                "NVMe {what} of {} bytes at {:#x} with buffer {addr:#x} is not aligned to the {lba}-byte LBA",
                req.len, req.offset.0
            ));
        }
        if req.len as usize > req.buf.len() {
            return Err(format!("NVMe {what} of {} bytes with a {}-byte buffer", req.len, req.buf.len()));
        }
        if req.offset.0.checked_add(u64::from(req.len)).is_none_or(|e| e > self.ns.bytes()) {
            return Err(format!(
                "NVMe {what} of {} bytes at {:#x} past the end of namespace {} ({} bytes)",
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
            if r.op == Op::Flush && r.outstanding == 0 && r.error.is_none() && r.queued {
                let Some(cid) = q.alloc_cid() else { break 'outer };
                let nsid = self.ns.nsid;
                // SAFETY: a Flush carries no data pointer.
                unsafe {
                    q.submit(cid, u64::from(ri) << 32, |c| {
                        *c = Command::new(nvm::FLUSH, cid.0);
                        c.nsid = nsid;
                    })
                }
                .expect("a free CID implies a free SQ slot");
                r.outstanding += 1;
                self.stats.commands += 1;
            }
            while r.issued < r.len {
                let Some(cid) = q.alloc_cid() else { break 'outer };
                let off = r.issued;
                let n = (r.len - off).min(r.chunk);
                self.segs.clear();
                match (r.slot, &mut self.path) {
                    (Some((p, base)), _) => {
                        self.slot_pools[p].region().segments(base + off as usize, n as usize, &mut self.segs)
                    }
                    (None, DataPath::Direct) => {
                        self.segs.push((r.iova.expect("mapped at submit").add(u64::from(off)), n as usize))
                    }
                    (None, DataPath::Bounce(b)) => {
                        let bb = &mut b[usize::from(cid.0)];
                        if r.op == Op::Write {
                            bb.copy_in(0, &r.buf.as_slice()[off as usize..(off + n) as usize]);
                            self.stats.bounce_bytes += u64::from(n);
                        }
                        self.segs.push((bb.iova(), n as usize));
                    }
                }
                let prps = match q.prps(cid, &self.segs) {
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
                let opc = if r.op == Op::Write { nvm::WRITE } else { nvm::READ };
                // SAFETY: the PRPs were built by `prps` (in this CID's own list pages) from the
                // request's pool slot, its buffer mapped at submit, or this CID's bounce buffer, for
                // `n` bytes inside it. The request keeps that memory (and the mapping) until its
                // last completion is consumed, or — if the queue stops first — quarantines it until
                // the controller is shut down; a reset stops all DMA before requests are failed.
                unsafe {
                    q.submit(cid, user, |c| {
                        *c = Command::rw(opc, cid.0, nsid, slba, n >> self.lba_shift);
                        c.prp1 = prps.prp1;
                        c.prp2 = prps.prp2;
                    })
                }
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
            let fresh = AlignedBuf::new(r.buf.len(), r.buf.align())
                .unwrap_or_else(|e| panic!("replacement buffer: {}", picchio_core::error::chain(&e)));
            self.quarantine.push((std::mem::replace(&mut r.buf, fresh), r.iova.map(|i| (i, r.len as usize))));
            r.buf
        } else {
            r.buf
        };
        let result = match r.error {
            Some(e) => Err(e),
            None => Ok(r.len),
        };
        if r.op == Op::Flush {
            self.stats.flushes += u64::from(result.is_ok());
            self.flush_done = Some(result);
            return;
        }
        self.ready.push(Completion { tag: r.tag, buf, result, latency_ns: r.started.elapsed().as_nanos() as u64 });
    }

    /// One poll of the CQ; returns completions consumed.
    fn poll(&mut self) -> usize {
        let Some(q) = self.ctrlr.io_queue() else { return 0 };
        let events = &mut self.events;
        let res = q.poll(usize::MAX, |e| events.push(e));
        if let Err(e) = res {
            self.stats.unknown_cids += 1;
            tracing::error!(error = %picchio_core::error::chain(&e), "nvme completion ignored");
        }
        let n = self.events.len();
        let mut events = std::mem::take(&mut self.events);
        for e in events.drain(..) {
            if e.late {
                // Its command timed out and was aborted (recovery.rs): handled like any completion;
                // an error status fails the request with `ReadFailure::Aborted`.
                self.stats.late += 1;
            }
            let ri = (e.user >> 32) as u32;
            let off = e.user as u32;
            let Some(r) = self.reqs[ri as usize].as_mut() else { continue };
            r.outstanding -= 1;
            let status = e.cqe.status();
            if status.is_success() {
                if let (DataPath::Bounce(b), None, Op::Read) = (&self.path, r.slot, r.op) {
                    let n = (r.len - off).min(r.chunk) as usize;
                    let dst = &mut r.buf.as_mut_slice()[off as usize..off as usize + n];
                    // SAFETY: this bounce buffer's command (CID `e.cid`) completed successfully and
                    // its completion was just consumed by `poll`; the CID is not reused before this.
                    unsafe { b[usize::from(e.cid.0)].copy_out(0, dst) };
                    self.stats.bounce_bytes += n as u64;
                }
            } else {
                self.stats.errors += 1;
                let what = match r.op {
                    Op::Read => "read",
                    Op::Write => "write",
                    Op::Flush => "flush",
                };
                if e.late {
                    let byte = r.offset + u64::from(off);
                    r.error.get_or_insert_with(|| recovery::aborted(self.ns.nsid, byte, e.cid, self.timeout, status));
                }
                r.error.get_or_insert_with(|| {
                    io::Error::other(format!(
                        "NVMe {what} of namespace {} at byte {:#x}: {status}",
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
}

impl IoQueue for NvmeQueue {
    fn block_size(&self) -> u32 {
        self.ns.lba_size
    }

    fn in_flight(&self) -> usize {
        self.active + self.ready.len()
    }

    fn describe(&self) -> String {
        let cap = self.qd;
        // Buffers outside the slot pools are copied through bounce buffers on the VFIO data path
        // (counted in bounce_bytes); the description says when slots are lent.
        let slots = if self.slot_pools.is_empty() { "" } else { ", zero-copy slots" };
        format!("nvme({}, nsid {}, qd {cap}{slots})", self.label, self.ns.nsid)
    }

    fn submit(&mut self, req: ReadReq) {
        self.stats.reads += 1;
        self.enqueue(Op::Read, req);
    }

    fn slot_allocator(&mut self, count: usize, len: usize) -> Option<Box<dyn SlotAllocator>> {
        if count == 0 || len == 0 {
            return None;
        }
        let slot_len = len.div_ceil(crate::dma::PAGE) * crate::dma::PAGE;
        let bytes = slot_len.saturating_mul(count);
        let pool = self.dma.alloc_region(bytes).and_then(|region| SlotPool::new(region, slot_len, count));
        match pool {
            Ok(pool) => {
                let pool = Arc::new(pool);
                self.slot_pools.push(pool.clone());
                let a = DmaSlots::new(pool, self.dma.kind());
                tracing::debug!("{}: {}", self.label, a.describe());
                Some(Box::new(a))
            }
            Err(e) => {
                let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
                let pages = bytes.div_ceil(2 << 20);
                let why = picchio_core::error::chain(&e).to_string();
                tracing::warn!("{}: {}", self.label, hugepage_shortfall(pages, count, slot_len, &meminfo, &why));
                None
            }
        }
    }

    fn bounce_bytes(&self) -> u64 {
        self.stats.bounce_bytes
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
}

impl NvmeQueue {
    /// Submits a Write of `req.len` bytes from the start of `req.buf` to byte `req.offset` of the
    /// namespace (NVM Write, opcode 0x01), split at the transfer limit like a read. It completes
    /// through [`IoQueue::reap`] with `req.tag` and the buffer, like a read (`Ok(len)` once every
    /// command of it succeeded). Alignment and range rules are a read's. The controller may keep
    /// the data in a volatile write cache until [`NvmeQueue::flush`].
    pub fn submit_write(&mut self, req: ReadReq) {
        self.stats.writes += 1;
        self.enqueue(Op::Write, req);
    }

    /// Issues an NVM Flush (opcode 0x00) for the namespace after every command submitted so far has
    /// completed, and waits for it: data of completed writes is then in non-volatile media
    /// (NVM command set §3.2.2). Completions of other requests stay queued for the next
    /// [`IoQueue::reap`].
    ///
    /// # Errors
    /// The failure of any write still in flight is reported by its own completion; this returns the
    /// Flush command's error status, a timeout, or a controller fatal status.
    pub fn flush(&mut self) -> io::Result<()> {
        crate::sink::flush_after_in_flight(self)
    }

    /// Validates and queues one request (see [`IoQueue::submit`]).
    fn enqueue(&mut self, op: Op, req: ReadReq) {
        let what = match op {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
        };
        if let Some(why) = &self.fatal {
            let e = io::Error::other(why.clone());
            if op == Op::Flush {
                self.flush_done = Some(Err(e));
                return;
            }
            return self.complete_now(req.tag, req.buf, e);
        }
        if op != Op::Flush {
            if let Err(why) = self.validate(&req, what) {
                return self.complete_now(req.tag, req.buf, io::Error::new(io::ErrorKind::InvalidInput, why));
            }
        }
        let ReadReq { offset, len, mut buf, tag } = req;
        let addr = buf.addr();
        let slot = self
            .slot_pools
            .iter()
            .enumerate()
            .find_map(|(i, p)| p.region().locate(addr, len as usize).map(|off| (i, off)));
        let mut chunk = self.max_xfer as u32;
        let iova = match (&self.path, slot) {
            _ if op == Op::Flush => None,
            (_, Some(_)) => {
                self.stats.zero_copy_reads += u64::from(op == Op::Read);
                None
            }
            (DataPath::Direct, None) => match self.dma.map_external(buf.as_mut_ptr(), len as usize) {
                Ok(i) => Some(i),
                Err(e) => {
                    return self.complete_now(tag, buf, io::Error::other(picchio_core::error::chain(&e).to_string()))
                }
            },
            (DataPath::Bounce(b), None) => {
                chunk = chunk.min(b[0].len() as u32);
                chunk -= chunk % self.ns.lba_size;
                None
            }
        };
        let r = Req {
            tag,
            buf,
            op,
            iova,
            slot,
            chunk,
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
}

impl crate::sink::FlushSteps for NvmeQueue {
    fn queue_flush(&mut self, buf: AlignedBuf) {
        self.flush_done = None;
        self.enqueue(Op::Flush, ReadReq { offset: picchio_core::ByteOffset(0), len: 0, buf, tag: Tag(u64::MAX) });
    }
    fn take_flush_outcome(&mut self) -> Option<io::Result<()>> {
        self.flush_done.take().map(|r| r.map(|_| ()))
    }
    fn hold_back(&mut self, mut held: Vec<Completion>) {
        held.append(&mut self.ready);
        self.ready = held;
    }
}

impl Drop for NvmeQueue {
    fn drop(&mut self) {
        // Stop the device before lent buffers (in flight or quarantined) are unmapped and freed.
        let shutdown = self.ctrlr.shutdown();
        if let Err(e) = &shutdown {
            tracing::warn!(error = %picchio_core::error::chain(e), "nvme shutdown");
        }
        if !self.ctrlr.dma_stopped() {
            self.leak_dma_memory(shutdown.err());
            return;
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

impl NvmeQueue {
    /// The slot pools lent out by [`IoQueue::slot_allocator`], in creation order (e.g. to check how
    /// many slots are free with [`SlotPool::free_slots`]).
    pub fn slot_pools(&self) -> &[Arc<SlotPool>] {
        &self.slot_pools
    }

    /// The controller may still DMA (its shutdown did not clear CSTS.RDY): leaks, rather than frees
    /// or returns to a pool, every buffer the device was given — in-flight requests', quarantined
    /// ones, bounce buffers — and the slot pools and DMA allocator (so no region is unmapped), and
    /// says how much in one error.
    fn leak_dma_memory(&mut self, why: Option<Error>) {
        let reqs = std::mem::take(&mut self.reqs);
        let quarantine = std::mem::take(&mut self.quarantine);
        let bounce = std::mem::replace(&mut self.path, DataPath::Direct);
        let slot_pools = std::mem::take(&mut self.slot_pools);
        let mut bytes: usize = reqs.iter().flatten().map(|r| r.buf.len()).sum();
        bytes += quarantine.iter().map(|(b, _)| b.len()).sum::<usize>();
        if let DataPath::Bounce(b) = &bounce {
            bytes += b.iter().map(DmaBuf::len).sum::<usize>();
        }
        let slot_bytes: usize = slot_pools.iter().map(|p| p.region().len()).sum();
        tracing::error!(
            "{}: leaking {bytes} bytes of request, quarantined and bounce buffers and {slot_bytes} bytes of \
             slot-pool DMA memory: the controller did not confirm it stopped ({}), so it may still DMA into them",
            self.label,
            why.map_or_else(
                || "CSTS.RDY did not clear after CC.EN = 0".to_string(),
                |e| picchio_core::error::chain(&e).to_string()
            )
        );
        std::mem::forget(reqs);
        std::mem::forget(quarantine);
        std::mem::forget(bounce);
        std::mem::forget(slot_pools);
        std::mem::forget(self.dma.clone());
    }
}

impl std::fmt::Debug for NvmeQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qd_above_the_controllers_queue_capacity_is_clamped_and_said() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ns.img");
        std::fs::write(&path, vec![7u8; 64 * 512]).unwrap();
        let mut cfg = SimConfig::single(&path, 512);
        cfg.mqes = 15; // 16 entries: 15 commands in flight at most
        let opts = NvmeQueueOptions { qd: 1000, ..NvmeQueueOptions::default() };
        let (q, _sim) = NvmeQueue::open_sim(cfg, &opts).unwrap();
        assert_eq!(q.queue_depth(), 15);
        assert!(q.warn_if_clamped(1000));
        assert!(!q.warn_if_clamped(15));
        assert!(q.describe().contains("qd 15"), "{}", q.describe());
    }

    /// Found reading the code the `nvme_tcp` fuzz target drives (the NVMe/TCP initiator had the
    /// same division): an LBA larger than MDTS rounded the per-command transfer down to 0 bytes.
    /// The simulator serves 512- and 4096-byte LBAs only and MDTS is at least a page, so the check
    /// `build` runs is tested on its own.
    #[test]
    fn an_lba_larger_than_mdts_is_refused_at_open_not_split_into_empty_commands() {
        let e = check_lba_fits_a_command(1, 16384, 8192, false).unwrap_err();
        assert_eq!(
            e.to_string(),
            "NVMe controller unsupported: namespace 1 has 16384-byte LBAs, but a command carries at most 8192 \
             bytes (MDTS)"
        );
        let e = check_lba_fits_a_command(2, 256 << 10, 1 << 20, true).unwrap_err();
        assert!(e.to_string().ends_with("at most 131072 bytes (MDTS, and the bounce buffer)"), "{e}");
        check_lba_fits_a_command(1, 4096, 4096, true).unwrap();
        check_lba_fits_a_command(1, 512, 128 << 10, false).unwrap();
    }
}
