//! [`NvmeQueue`]: the [`IoQueue`] engine over one NVMe I/O queue pair.
//!
//! A read becomes one NVMe Read per `max_transfer` bytes (the MDTS split), each with its own CID and
//! PRPs into the request's buffer; the request completes when all its commands have. Nothing blocks
//! in `submit`: requests wait in a backlog for free CIDs, and `reap` polls the CQ, refills the SQ and
//! rings each doorbell once per batch. The requests, their split, backlog and completion are the
//! request layer shared with NVMe/TCP ([`crate::request`]); this module is the PCIe transport under
//! it: one command's PRPs and SQE, and the CQ poll.
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
//! [`NvmeQueue::submit_write`] issues NVM Write commands (opcode 0x01) for a [`WriteReq`] through the same data paths
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

use std::io;
use std::sync::Arc;
use std::time::Duration;

use picchio_core::{AlignedBuf, Completion, IoQueue, ReadReq, SlotAllocator, Tag};

use crate::ctrlr::{Controller, CtrlrOptions, Namespace};
use crate::dma::{hugepage_shortfall, DmaBuf, DmaPool, DmaSlots, HeapDma, Iova, SlotPool};
use crate::error::{Error, Result};
use crate::queue::{CqEntry, QueuePair};
use crate::request::{self, Child, Op, Request, Requests, Submit, Transport, WriteReq};
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

/// What the PCIe transport keeps with a request.
#[derive(Debug)]
pub(crate) struct Pcie {
    /// IOVA of the buffer when mapped (direct path).
    iova: Option<Iova>,
    /// The buffer is a pool slot: (index into `NvmeQueue::slot_pools`, offset in its region).
    slot: Option<(usize, usize)>,
    /// A command of this request timed out and the queue stopped: the device may still write the
    /// buffer.
    lost: bool,
}

/// The PCIe transport under the request layer: the fields of an [`NvmeQueue`] that submitting one
/// command and retiring a request touch, borrowed apart from its [`Requests`].
struct PcieIo<'a> {
    q: Option<&'a mut QueuePair>,
    path: &'a mut DataPath,
    slot_pools: &'a [Arc<SlotPool>],
    segs: &'a mut Vec<(Iova, usize)>,
    stats: &'a mut NvmeQueueStats,
    dma: &'a Arc<dyn DmaPool>,
    quarantine: &'a mut Vec<(AlignedBuf, Option<(Iova, usize)>)>,
    nsid: u32,
    lba_shift: u32,
}

impl Transport for PcieIo<'_> {
    type Extra = Pcie;
    type Error = std::convert::Infallible;

    /// One command with its own CID: PRPs into the request's pool slot, mapped buffer or the CID's
    /// bounce buffer (filled first for a write).
    fn submit(&mut self, child: Child, r: &mut Request<Pcie>) -> Submit<Self::Error> {
        let Some(q) = self.q.as_deref_mut() else { return Submit::Full };
        let Some(cid) = q.alloc_cid() else { return Submit::Full };
        let nsid = self.nsid;
        if r.op == Op::Flush {
            // SAFETY: a Flush carries no data pointer.
            unsafe {
                q.submit(cid, child.user(), |c| {
                    *c = Command::new(nvm::FLUSH, cid.0);
                    c.nsid = nsid;
                })
            }
            .expect("a free CID implies a free SQ slot");
            self.stats.commands += 1;
            return Submit::Sent;
        }
        let (off, n) = (child.off, child.len);
        self.segs.clear();
        match (r.x.slot, &mut *self.path) {
            (Some((p, base)), _) => self.slot_pools[p].region().segments(base + off as usize, n as usize, self.segs),
            (None, DataPath::Direct) => {
                self.segs.push((r.x.iova.expect("mapped at submit").add(u64::from(off)), n as usize))
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
        let prps = match q.prps(cid, self.segs) {
            Ok(p) => p,
            Err(e) => {
                q.release_cid(cid);
                return Submit::Refused(io::Error::new(io::ErrorKind::InvalidInput, format!("PRP list: {e}")));
            }
        };
        let slba = Lba((r.offset + u64::from(off)) >> self.lba_shift);
        let opc = r.op.opcode();
        let nlb = n >> self.lba_shift;
        // SAFETY: the PRPs were built by `prps` (in this CID's own list pages) from the request's
        // pool slot, its buffer mapped at submit, or this CID's bounce buffer, for `n` bytes inside
        // it. The request keeps that memory (and the mapping) until its last completion is
        // consumed, or — if the queue stops first — quarantines it until the controller is shut
        // down (`retire`); a reset stops all DMA before requests are failed.
        unsafe {
            q.submit(cid, child.user(), |c| {
                *c = Command::rw(opc, cid.0, nsid, slba, nlb);
                c.prp1 = prps.prp1;
                c.prp2 = prps.prp2;
            })
        }
        .expect("a free CID implies a free SQ slot");
        self.stats.commands += 1;
        Submit::Sent
    }

    /// Unmaps the buffer (direct path), or quarantines it when the device may still write it.
    fn retire(&mut self, r: &mut Request<Pcie>) {
        if let Some(iova) = r.x.iova.filter(|_| !r.x.lost) {
            self.dma.unmap_external(iova, r.len as usize);
        }
        if r.x.lost {
            // The device may still write this buffer: keep it (and its mapping) until shutdown.
            let fresh = AlignedBuf::new(r.buf.len(), r.buf.align())
                .unwrap_or_else(|e| panic!("replacement buffer: {}", picchio_core::error::chain(&e)));
            self.quarantine.push((std::mem::replace(&mut r.buf, fresh), r.x.iova.map(|i| (i, r.len as usize))));
        }
        if r.op == Op::Flush && r.error.is_none() {
            self.stats.flushes += 1;
        }
    }

    fn ring(&mut self) {
        if let Some(q) = self.q.as_deref_mut() {
            q.ring();
        }
    }
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
    label: String,
    timeout: Duration,
    /// The request layer: requests, backlog, ready completions, the last Flush's outcome.
    reqs: Requests<Pcie>,
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
            label,
            timeout,
            reqs: Requests::default(),
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

    /// The request layer and the PCIe transport under it, borrowed apart.
    fn io(&mut self) -> (&mut Requests<Pcie>, PcieIo<'_>) {
        let t = PcieIo {
            q: self.ctrlr.io_queue(),
            path: &mut self.path,
            slot_pools: &self.slot_pools,
            segs: &mut self.segs,
            stats: &mut self.stats,
            dma: &self.dma,
            quarantine: &mut self.quarantine,
            nsid: self.ns.nsid,
            lba_shift: self.lba_shift,
        };
        (&mut self.reqs, t)
    }

    /// Issues commands for backlogged requests while CIDs are free; rings the SQ doorbell once.
    fn pump(&mut self) {
        let (reqs, mut t) = self.io();
        match reqs.pump(&mut t) {
            Ok(()) => {}
            Err(never) => match never {},
        }
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
        let (nsid, timeout) = (self.ns.nsid, self.timeout);
        for e in events.drain(..) {
            if e.late {
                // Its command timed out and was aborted (recovery.rs): handled like any completion;
                // an error status fails the request with `ReadFailure::Aborted`.
                self.stats.late += 1;
            }
            let (ri, off) = Child::parts(e.user);
            let (reqs, mut t) = self.io();
            let Some(r) = reqs.get_mut(ri) else { continue };
            let status = e.cqe.status();
            let err = if status.is_success() {
                if let (DataPath::Bounce(b), None, Op::Read) = (&*t.path, r.x.slot, r.op) {
                    let n = (r.len - off).min(r.cmd_len) as usize;
                    let dst = &mut r.buf.as_mut_slice()[off as usize..off as usize + n];
                    // SAFETY: this bounce buffer's command (CID `e.cid`) completed successfully and
                    // its completion was just consumed by `poll`; the CID is not reused before this.
                    unsafe { b[usize::from(e.cid.0)].copy_out(0, dst) };
                    t.stats.bounce_bytes += n as u64;
                }
                None
            } else {
                t.stats.errors += 1;
                let byte = r.offset + u64::from(off);
                Some(if e.late {
                    recovery::aborted(nsid, byte, e.cid, timeout, status)
                } else {
                    io::Error::other(format!("NVMe {} of namespace {nsid} at byte {byte:#x}: {status}", r.op.name()))
                })
            };
            reqs.child_done(ri, err, &mut t);
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
        self.reqs.in_flight()
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
        self.enqueue(Op::Read, req.tag, req.buf, req.offset.0, req.len);
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
            if self.reqs.ready() >= min || self.reqs.active() == 0 {
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
        self.reqs.take_ready(out)
    }
}

impl NvmeQueue {
    /// Submits a Write of `req.len` bytes from the start of `req.buf` to byte `req.offset` of the
    /// namespace (NVM Write, opcode 0x01), split at the transfer limit like a read. It completes
    /// through [`IoQueue::reap`] with `req.tag` and the buffer, like a read (`Ok(len)` once every
    /// command of it succeeded). Alignment and range rules are a read's. The controller may keep
    /// the data in a volatile write cache until [`NvmeQueue::flush`].
    pub fn submit_write(&mut self, req: WriteReq) {
        self.stats.writes += 1;
        self.enqueue(Op::Write, req.tag, req.buf, req.offset.0, req.len);
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

    /// Checks and queues one request (see [`IoQueue::submit`]): its data path (pool slot, mapped
    /// buffer or bounce buffers) fixes its bytes per command.
    fn enqueue(&mut self, op: Op, tag: Tag, mut buf: AlignedBuf, offset: u64, len: u32) {
        if let Some(why) = &self.fatal {
            let e = io::Error::other(why.clone());
            return self.reqs.fail_now(op, tag, buf, e);
        }
        if op != Op::Flush {
            let nsid = self.ns.nsid;
            // PRP entries need dword-aligned buffer addresses.
            if let Err(e) = request::check(op, offset, len, &buf, &self.ns, 4, &|| format!("namespace {nsid}")) {
                return self.reqs.fail_now(op, tag, buf, e.into_io());
            }
        }
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
                    let e = io::Error::other(picchio_core::error::chain(&e).to_string());
                    return self.reqs.fail_now(op, tag, buf, e);
                }
            },
            (DataPath::Bounce(b), None) => {
                chunk = chunk.min(b[0].len() as u32);
                chunk -= chunk % self.ns.lba_size;
                None
            }
        };
        let r = Request::new(op, tag, buf, offset, len, chunk, Pcie { iova, slot, lost: false });
        self.reqs.push(r);
        self.pump();
    }
}

impl crate::sink::FlushSteps for NvmeQueue {
    type Transport = Pcie;
    fn requests(&mut self) -> &mut Requests<Pcie> {
        &mut self.reqs
    }
    fn enqueue_flush(&mut self, buf: AlignedBuf) {
        self.enqueue(Op::Flush, Tag(u64::MAX), buf, 0, 0);
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
        for r in self.reqs.iter() {
            if let Some(iova) = r.x.iova {
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
        let mut bytes: usize = reqs.iter().map(|r| r.buf.len()).sum();
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
