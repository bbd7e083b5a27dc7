//! A software NVMe controller that implements [`Bar`] in host memory, for testing the real driver code
//! without hardware.
//!
//! The register file (CAP, VS, CC, CSTS, AQA, ASQ, ACQ, doorbells) follows §3.1; enabling the
//! controller (CC.EN 0 → 1) takes the admin queues from AQA/ASQ/ACQ, CC.SHN completes a shutdown, and
//! CC.EN 1 → 0 resets it. A thread watches the SQ tail doorbells, fetches SQEs, executes admin
//! (`admin.rs`) and NVM I/O (`io.rs`) commands against namespaces backed by files, and posts CQEs with
//! the phase tag. [`fault`] injects statuses, dropped completions, held (hung) commands and
//! Controller Fatal Status. Abort (§5.1) aborts a held command (it completes with Command Abort
//! Requested); a reset (CC.EN 1 → 0) deletes the queues, drops held commands and clears CSTS.CFS.
//!
//! The model reaches host memory only through `dma_copy`, which accepts an IOVA only inside a
//! range the driver's [`HeapDma`](crate::dma::HeapDma) registered (IOVA = host address): a driver bug
//! that points the device elsewhere gets a Data Transfer Error, not memory corruption.

mod admin;
pub mod fault;
mod io;

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

pub use fault::{Fault, FaultAction, FaultWhen};

use crate::bar::Bar;
use crate::dma::DmaRegistry;
use crate::error::{Error, Result};
use crate::spec::regs::{self, Aqa, Cap, Cc, Csts, Shst, Vs};
use crate::spec::{Command, Completion, Status};

/// Queue identifiers the model supports (admin + 15 I/O queues).
pub const MAX_QUEUES: usize = 16;

/// One namespace of the model.
#[derive(Clone, Debug)]
pub struct SimNamespace {
    /// Backing file; the namespace has `len / lba_size` blocks.
    pub path: PathBuf,
    /// LBA data size: 512 or 4096.
    pub lba_size: u32,
    /// Whether Write commands may change the file.
    pub writable: bool,
}

/// Model parameters.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Namespaces 1, 2, … in order.
    pub namespaces: Vec<SimNamespace>,
    /// Identify Controller MDTS (log2 pages of 4 KiB; 0 = unlimited).
    pub mdts: u8,
    /// CAP.MQES (0-based maximum queue entries).
    pub mqes: u16,
    /// CAP.DSTRD.
    pub dstrd: u8,
    /// CAP.TO in 500 ms units.
    pub to: u8,
}

impl SimConfig {
    /// One read-only namespace over `path` with `lba_size`, MDTS 5 (128 KiB), DSTRD 0, MQES 1023.
    pub fn single(path: impl Into<PathBuf>, lba_size: u32) -> SimConfig {
        SimConfig {
            namespaces: vec![SimNamespace { path: path.into(), lba_size, writable: false }],
            mdts: 5,
            mqes: 1023,
            dstrd: 0,
            to: 4,
        }
    }
}

/// What the model did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Admin commands executed.
    pub admin_cmds: u64,
    /// I/O commands executed.
    pub io_cmds: u64,
    /// Completions posted.
    pub completions: u64,
    /// Completions withheld by a fault.
    pub dropped: u64,
    /// Abort commands that found and aborted their command.
    pub aborted: u64,
    /// Controller resets (CC.EN 1 → 0).
    pub resets: u64,
    /// Normal or abrupt shutdowns (CC.SHN 00b → non-zero while enabled), each completed at once
    /// (CSTS.SHST = 10b).
    pub shutdowns: u64,
    /// DMA accesses refused (outside registered memory).
    pub dma_faults: u64,
    /// Faults fired.
    pub faults_fired: u64,
    /// PRP-list pages read while walking data pointers (each page of a chain counts).
    pub prp_list_pages: u64,
}

pub(crate) struct Sq {
    pub(crate) base: u64,
    pub(crate) entries: u16,
    pub(crate) head: u16,
    pub(crate) cqid: u16,
}

pub(crate) struct Cq {
    pub(crate) base: u64,
    pub(crate) entries: u16,
    pub(crate) tail: u16,
    pub(crate) phase: bool,
}

pub(crate) struct SimNs {
    pub(crate) file: File,
    pub(crate) lba_size: u32,
    pub(crate) blocks: u64,
    pub(crate) writable: bool,
}

pub(crate) struct Model {
    pub(crate) cap: Cap,
    pub(crate) cc: Cc,
    pub(crate) csts: Csts,
    pub(crate) aqa: Aqa,
    pub(crate) asq: u64,
    pub(crate) acq: u64,
    pub(crate) sqs: Vec<Option<Sq>>,
    pub(crate) cqs: Vec<Option<Cq>>,
    pub(crate) ns: Vec<SimNs>,
    pub(crate) mdts: u8,
    pub(crate) page: usize,
    pub(crate) faults: Vec<Fault>,
    pub(crate) io_count: u64,
    /// I/O commands fetched so far, by opcode ([`FaultWhen::IoOpcode`]).
    io_opcode_counts: [u64; 256],
    pub(crate) stats: SimStats,
    pub(crate) queues_granted: u16,
    pub(crate) scratch: Vec<u8>,
    /// Commands held outstanding by [`FaultAction::Hold`], as `(sqid, cid)`.
    pub(crate) held: Vec<(u16, u16)>,
    /// The commands behind `held` (by SQ ID), for [`Sim::release_held`].
    held_cmds: Vec<(u16, Command)>,
    /// [`Sim::ignore_disable`]: CC.EN 1 → 0 leaves CSTS.RDY = 1 and the controller's state as is.
    ignore_disable: bool,
}

pub(crate) struct Shared {
    model: Mutex<Model>,
    doorbells: Vec<AtomicU32>,
    stop: AtomicBool,
    dstrd: u8,
    registry: Arc<DmaRegistry>,
}

impl Shared {
    fn model(&self) -> MutexGuard<'_, Model> {
        self.model.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct SimThread {
    shared: Arc<Shared>,
    join: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for SimThread {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(j) = self.join.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = j.join();
        }
    }
}

/// A running model: hand [`Sim::bar`] to the driver; keep the `Sim` to inject faults and read stats.
/// The model thread stops when the `Sim` and every bar are dropped.
#[derive(Clone)]
pub struct Sim {
    shared: Arc<Shared>,
    thread: Arc<SimThread>,
}

/// The model's register window, implementing [`Bar`].
pub struct SimBar {
    shared: Arc<Shared>,
    _thread: Arc<SimThread>,
}

/// Direction of a model DMA access.
pub(crate) enum Dma<'a> {
    /// Device reads host memory into the slice.
    FromHost(&'a mut [u8]),
    /// Device writes the slice to host memory.
    ToHost(&'a [u8]),
}

/// The only place the model touches host memory: copies between `iova` (= a host address inside a
/// range the driver registered) and `data`. Returns false, touching nothing, if any byte is outside
/// the registered memory.
pub(crate) fn dma_copy(registry: &DmaRegistry, iova: u64, data: Dma<'_>) -> bool {
    let len = match &data {
        Dma::FromHost(d) => d.len(),
        Dma::ToHost(d) => d.len(),
    };
    registry
        .with_range(iova, len, || match data {
            // SAFETY: `iova..iova + len` lies inside one range the driver registered as DMA memory
            // (a live `DmaBuf`, or a buffer lent with `map_external` until its completion is
            // consumed), and the registry lock is held, so the range cannot be released (and freed)
            // during the copy. The driver accesses DMA memory only via volatile/raw accesses, never
            // through references, while the device owns it; `data` is the model's own memory.
            Dma::FromHost(d) => unsafe { std::ptr::copy_nonoverlapping(iova as *const u8, d.as_mut_ptr(), len) },
            // SAFETY: as above.
            Dma::ToHost(d) => unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), iova as *mut u8, len) },
        })
        .is_some()
}

impl Sim {
    /// Opens the namespaces' files and starts the model thread. `registry` is the driver allocator's
    /// ([`HeapDma::registry`](crate::dma::HeapDma::registry)).
    ///
    /// # Errors
    /// [`Error::SimBacking`] if a file cannot be opened or is shorter than one LBA (naming the file,
    /// its size and the minimum); [`Error::Unsupported`] for a bad LBA size.
    pub fn start(cfg: SimConfig, registry: Arc<DmaRegistry>) -> Result<Sim> {
        let mut ns = Vec::new();
        for (i, n) in cfg.namespaces.iter().enumerate() {
            let nsid = i as u32 + 1;
            if !matches!(n.lba_size, 512 | 4096) {
                return Err(Error::Unsupported { what: format!("sim namespace {nsid}: LBA size {}", n.lba_size) });
            }
            let backing = |cause| Error::SimBacking { nsid, path: n.path.clone(), cause };
            let file = std::fs::OpenOptions::new().read(true).write(n.writable).open(&n.path).map_err(backing)?;
            let len = file.metadata().map_err(backing)?.len();
            // A file shorter than one LBA would be a namespace of 0 blocks, which a controller does
            // not report as active: say what is wrong with the file instead of "namespace not found".
            if len < u64::from(n.lba_size) {
                return Err(backing(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!(
                        "{len} bytes, shorter than one {}-byte LBA (the minimum; a .picchioflat image has at \
                         least 8192 bytes): not a namespace image",
                        n.lba_size
                    ),
                )));
            }
            ns.push(SimNs { file, lba_size: n.lba_size, blocks: len / u64::from(n.lba_size), writable: n.writable });
        }
        let model = Model {
            cap: Cap::build(cfg.mqes, true, cfg.to, cfg.dstrd, 1, 0, 4),
            cc: Cc(0),
            csts: Csts(0),
            aqa: Aqa(0),
            asq: 0,
            acq: 0,
            sqs: (0..MAX_QUEUES).map(|_| None).collect(),
            cqs: (0..MAX_QUEUES).map(|_| None).collect(),
            ns,
            mdts: cfg.mdts,
            page: 4096,
            faults: Vec::new(),
            io_count: 0,
            io_opcode_counts: [0; 256],
            stats: SimStats::default(),
            queues_granted: (MAX_QUEUES - 1) as u16,
            scratch: Vec::new(),
            held: Vec::new(),
            held_cmds: Vec::new(),
            ignore_disable: false,
        };
        let shared = Arc::new(Shared {
            model: Mutex::new(model),
            doorbells: (0..2 * MAX_QUEUES).map(|_| AtomicU32::new(0)).collect(),
            stop: AtomicBool::new(false),
            dstrd: cfg.dstrd,
            registry,
        });
        let s2 = shared.clone();
        let join = std::thread::Builder::new()
            .name("nvme-sim".into())
            .spawn(move || run(&s2))
            .map_err(|e| Error::Unsupported { what: format!("sim thread: {e}") })?;
        let thread = Arc::new(SimThread { shared: shared.clone(), join: Mutex::new(Some(join)) });
        Ok(Sim { shared, thread })
    }

    /// The register window for the driver.
    pub fn bar(&self) -> Arc<dyn Bar> {
        Arc::new(SimBar { shared: self.shared.clone(), _thread: self.thread.clone() })
    }

    /// Adds a one-shot fault.
    pub fn inject(&self, f: Fault) {
        self.shared.model().faults.push(f);
    }

    /// Makes the controller ignore CC.EN 1 → 0 (`on`): CSTS.RDY stays 1, so a shutdown cannot
    /// confirm that DMA stopped, and held commands stay held — a device that hangs in reset.
    pub fn ignore_disable(&self, on: bool) {
        self.shared.model().ignore_disable = on;
    }

    /// Executes the data transfer of every command held by [`Fault::io_hold`] — as a hung device
    /// finally doing the DMA it was given — without posting completions (the driver gave up on
    /// them). Returns how many commands ran.
    pub fn release_held(&self) -> usize {
        let mut m = self.shared.model();
        let held = std::mem::take(&mut m.held);
        let cmds = std::mem::take(&mut m.held_cmds);
        let mut ran = 0;
        for (sqid, cid) in held {
            if let Some((_, cmd)) = cmds.iter().find(|(q, c)| (*q, c.cid()) == (sqid, cid)) {
                let _ = m.dispatch(&self.shared, sqid, cmd);
                ran += 1;
            }
        }
        ran
    }

    /// Counters.
    pub fn stats(&self) -> SimStats {
        self.shared.model().stats
    }

    /// I/O commands fetched so far (the `N` of [`FaultWhen::Io`] counts from here + 1).
    pub fn io_count(&self) -> u64 {
        self.shared.model().io_count
    }
}

fn run(shared: &Shared) {
    let mut idle = 0u32;
    while !shared.stop.load(Ordering::Acquire) {
        let worked = {
            let mut m = shared.model();
            m.running() && m.process(shared)
        };
        if worked {
            idle = 0;
        } else {
            idle = idle.saturating_add(1);
            if idle < 2000 {
                std::hint::spin_loop();
            } else if idle < 4000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
    // The driver's last register window is gone: say what the controller saw at the end, so a
    // test of a front end can check that its exit shut the controller down (CC.SHN) first.
    let m = shared.model();
    tracing::info!(
        "nvme-sim controller model stopped: {} shutdown(s) (CC.SHN set, CSTS.SHST complete), {} reset(s), \
         enabled at the end: {}, {} admin and {} I/O commands",
        m.stats.shutdowns,
        m.stats.resets,
        m.cc.en(),
        m.stats.admin_cmds,
        m.stats.io_cmds
    );
}

fn le_command(b: &[u8; 64]) -> Command {
    let d = |i: usize| u32::from_le_bytes(b[i * 4..i * 4 + 4].try_into().expect("4"));
    let q = |i: usize| u64::from(d(i)) | (u64::from(d(i + 1)) << 32);
    Command {
        cdw0: d(0),
        nsid: d(1),
        cdw2: d(2),
        cdw3: d(3),
        mptr: q(4),
        prp1: q(6),
        prp2: q(8),
        cdw10: d(10),
        cdw11: d(11),
        cdw12: d(12),
        cdw13: d(13),
        cdw14: d(14),
        cdw15: d(15),
    }
}

/// The outcome of executing one command: status and DW0, no completion at all, or held outstanding.
pub(crate) enum Outcome {
    Complete(Status, u32),
    Drop,
    Hold,
}

impl Model {
    fn running(&self) -> bool {
        self.cc.en() && self.csts.rdy() && !self.csts.cfs() && self.cc.shn() == 0
    }

    /// Serves every SQ once (up to a batch each). True if any command was processed.
    fn process(&mut self, shared: &Shared) -> bool {
        let mut worked = false;
        for qid in 0..MAX_QUEUES {
            let Some(sq) = &self.sqs[qid] else { continue };
            let tail = shared.doorbells[2 * qid].load(Ordering::Acquire);
            if tail >= u32::from(sq.entries) {
                continue; // invalid doorbell value: ignored (a real device would post an async event)
            }
            let tail = tail as u16;
            let mut batch = 0;
            while batch < 64 && self.running() {
                let sq = self.sqs[qid].as_ref().expect("exists");
                if sq.head == tail {
                    break;
                }
                let cqid = usize::from(sq.cqid);
                let Some(cq) = &self.cqs[cqid] else { break };
                let cq_head = shared.doorbells[2 * cqid + 1].load(Ordering::Acquire) as u16;
                if (cq.tail + 1) % cq.entries == cq_head {
                    break; // CQ full: leave the command in the SQ
                }
                let addr = sq.base + u64::from(sq.head) * 64;
                let mut raw = [0u8; 64];
                let fetched = dma_copy(&shared.registry, addr, Dma::FromHost(&mut raw));
                let sq = self.sqs[qid].as_mut().expect("exists");
                sq.head = (sq.head + 1) % sq.entries;
                let sqhd = sq.head;
                batch += 1;
                worked = true;
                if !fetched {
                    self.stats.dma_faults += 1;
                    continue; // cannot even read the command: nothing to complete
                }
                let cmd = le_command(&raw);
                match self.execute(shared, qid as u16, &cmd) {
                    Outcome::Complete(status, dw0) => self.post(
                        shared,
                        cqid,
                        Completion { dw0, dw1: 0, sqhd, sqid: qid as u16, cid: cmd.cid(), status: 0 },
                        status,
                    ),
                    Outcome::Drop => self.stats.dropped += 1,
                    Outcome::Hold => {
                        let key = (qid as u16, cmd.cid());
                        self.held_cmds.retain(|(q, c)| (*q, c.cid()) != key);
                        self.held_cmds.push((key.0, cmd));
                        self.held.push(key);
                    }
                }
            }
        }
        worked
    }

    fn execute(&mut self, shared: &Shared, qid: u16, cmd: &Command) -> Outcome {
        if qid != 0 {
            self.io_count += 1;
            self.io_opcode_counts[usize::from(cmd.opc())] += 1;
        }
        let opcode_count = self.io_opcode_counts[usize::from(cmd.opc())];
        if let Some(action) = fault::take(&mut self.faults, qid, cmd.opc(), self.io_count, opcode_count) {
            self.stats.faults_fired += 1;
            match action {
                FaultAction::Status(s) => return Outcome::Complete(s, 0),
                FaultAction::DropCompletion => {
                    let _ = self.dispatch(shared, qid, cmd);
                    return Outcome::Drop;
                }
                FaultAction::Fatal => {
                    self.csts = Csts(self.csts.0 | 2);
                    return Outcome::Drop;
                }
                FaultAction::Hold => return Outcome::Hold,
                FaultAction::Vanish => return Outcome::Complete(Status::SUCCESS, 0),
            }
        }
        self.dispatch(shared, qid, cmd)
    }

    fn dispatch(&mut self, shared: &Shared, qid: u16, cmd: &Command) -> Outcome {
        if qid == 0 {
            self.stats.admin_cmds += 1;
            self.admin(shared, cmd)
        } else {
            self.stats.io_cmds += 1;
            let (s, dw0) = self.io(shared, cmd);
            Outcome::Complete(s, dw0)
        }
    }

    pub(crate) fn post(&mut self, shared: &Shared, cqid: usize, mut cqe: Completion, status: Status) {
        let cq = self.cqs[cqid].as_mut().expect("checked by caller");
        cqe.status = status.to_field(cq.phase);
        let addr = cq.base + u64::from(cq.tail) * 16;
        let b = cqe.to_bytes();
        // Everything but the status first, then the status half-word with the phase tag.
        let ok = dma_copy(&shared.registry, addr, Dma::ToHost(&b[..14])) && {
            std::sync::atomic::fence(Ordering::Release);
            dma_copy(&shared.registry, addr + 14, Dma::ToHost(&b[14..]))
        };
        if !ok {
            self.stats.dma_faults += 1;
            return;
        }
        cq.tail += 1;
        if cq.tail == cq.entries {
            cq.tail = 0;
            cq.phase = !cq.phase;
        }
        self.stats.completions += 1;
    }

    fn write_cc(&mut self, shared: &Shared, new: Cc) {
        let old = self.cc;
        self.cc = new;
        if !old.en() && new.en() {
            if new.iosqes() != 6 || new.iocqes() != 4 || new.css() != 0 || new.mps() > self.cap.mpsmax() {
                // Invalid configuration: the spec leaves it undefined; we refuse to become ready.
                tracing::warn!(cc = format_args!("{:#x}", new.0), "sim: unsupported CC, staying not ready");
                return;
            }
            self.page = 4096 << new.mps();
            let (sqs, cqs) = (self.aqa.asqs() + 1, self.aqa.acqs() + 1);
            self.sqs[0] = Some(Sq { base: self.asq, entries: sqs, head: 0, cqid: 0 });
            self.cqs[0] = Some(Cq { base: self.acq, entries: cqs, tail: 0, phase: true });
            self.csts = Csts::build(true, false, Shst::Normal);
        } else if old.en() && !new.en() && self.ignore_disable {
            // A controller that never stops (test knob): CSTS.RDY stays 1, held commands stay held.
            tracing::warn!("sim: ignoring CC.EN = 0 (CSTS.RDY stays 1)");
        } else if old.en() && !new.en() {
            // Controller reset: queues deleted, held commands dropped, doorbells and status (CFS too)
            // cleared.
            self.held.clear();
            self.held_cmds.clear();
            self.stats.resets += 1;
            for q in &mut self.sqs {
                *q = None;
            }
            for q in &mut self.cqs {
                *q = None;
            }
            for d in &shared.doorbells {
                d.store(0, Ordering::Release);
            }
            self.csts = Csts(0);
        }
        if new.en() && new.shn() != 0 && old.shn() == 0 {
            self.csts = Csts((self.csts.0 & !0xC) | ((Shst::Complete as u32) << 2));
            self.stats.shutdowns += 1;
        }
    }
}

impl Bar for SimBar {
    fn read32(&self, off: usize) -> u32 {
        let m = self.shared.model();
        match off {
            regs::CAP => m.cap.0 as u32,
            0x04 => (m.cap.0 >> 32) as u32,
            regs::VS => Vs(0x0001_0400).0,
            regs::CC => m.cc.0,
            regs::CSTS => m.csts.0,
            regs::AQA => m.aqa.0,
            regs::ASQ => m.asq as u32,
            0x2C => (m.asq >> 32) as u32,
            regs::ACQ => m.acq as u32,
            0x34 => (m.acq >> 32) as u32,
            _ => 0,
        }
    }
    fn read64(&self, off: usize) -> u64 {
        u64::from(self.read32(off)) | (u64::from(self.read32(off + 4)) << 32)
    }
    fn write32(&self, off: usize, v: u32) {
        if off >= regs::DOORBELL_BASE {
            let idx = (off - regs::DOORBELL_BASE) / (4usize << self.shared.dstrd);
            if let Some(d) = self.shared.doorbells.get(idx) {
                d.store(v, Ordering::Release);
            }
            return;
        }
        let mut m = self.shared.model();
        match off {
            regs::CC => m.write_cc(&self.shared, Cc(v)),
            regs::AQA => m.aqa = Aqa(v),
            regs::ASQ => m.asq = (m.asq & !0xFFFF_FFFF) | u64::from(v),
            0x2C => m.asq = (m.asq & 0xFFFF_FFFF) | (u64::from(v) << 32),
            regs::ACQ => m.acq = (m.acq & !0xFFFF_FFFF) | u64::from(v),
            0x34 => m.acq = (m.acq & 0xFFFF_FFFF) | (u64::from(v) << 32),
            _ => {}
        }
    }
    fn write64(&self, off: usize, v: u64) {
        self.write32(off, v as u32);
        self.write32(off + 4, (v >> 32) as u32);
    }
    fn kind(&self) -> &'static str {
        "sim"
    }
}
