//! Controller bring-up as an explicit state machine (§3.5.1 "Memory-based Controller
//! Initialization"), synchronous admin commands, Abort (§5.1), controller reset (§3.7.2), and
//! shutdown (§3.6.1) on drop.
//!
//! [`Controller::step`] advances one [`InitState`]; every state has a CAP.TO deadline set when it is
//! entered, and a timeout names the state. Controller Fatal Status is checked while waiting.
//! [`Controller::reset`] clears CC.EN, waits for CSTS.RDY = 0 and runs the same state machine again,
//! re-creating the admin and I/O queues on the memory they had (same IOVAs, rings zeroed).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bar::Bar;
use crate::dma::{DmaBuf, DmaPool, PAGE};
use crate::error::{Error, Result};
use crate::prp;
use crate::queue::{Cid, Lost, QueuePair};
use crate::spec::regs::{self, Aqa, Cap, Cc, Csts, Shn, Shst, Vs};
use crate::spec::{admin, Command, Completion, IdentifyController, IdentifyNamespace};

/// Controller initialization states, in order (act/wait pairs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InitState {
    /// Read CAP and VS; check the NVM command set and the host page size against MPSMIN/MPSMAX.
    ReadCap,
    /// If CC.EN = 1, clear it (reset the controller).
    DisableIfEnabled,
    /// Wait for CSTS.RDY = 0.
    WaitReady0,
    /// Allocate the admin queue pair; program AQA, ASQ, ACQ.
    ProgramAdminQueues,
    /// Write CC: CSS = NVM, MPS, IOSQES = 6, IOCQES = 4, EN = 1.
    Enable,
    /// Wait for CSTS.RDY = 1.
    WaitReady1,
    /// Identify Controller (CNS 01h): MDTS, NN, model, serial.
    IdentifyController,
    /// Active Namespace ID list (CNS 02h), then Identify Namespace (CNS 00h) for each.
    IdentifyNamespaces,
    /// Set Features, Number of Queues (FID 07h): one I/O SQ and CQ.
    SetNumQueues,
    /// Create I/O Completion Queue 1.
    CreateIoCq,
    /// Create I/O Submission Queue 1 on CQ 1.
    CreateIoSq,
    /// Initialized; I/O queue pair 1 is usable (if requested).
    Ready,
}

/// Options for [`Controller`].
#[derive(Clone, Debug)]
pub struct CtrlrOptions {
    /// Admin queue ring entries (2..=4096).
    pub admin_entries: u16,
    /// I/O queue ring entries (the queue depth is one less); 0 creates no I/O queue.
    pub io_entries: u16,
    /// Cap on admin command completion time outside init (init uses CAP.TO per state).
    pub admin_timeout: Duration,
    /// Cap on bytes per I/O command, applied below the controller's MDTS (and when it reports none),
    /// rounded down to whole pages and at most 32 MiB (NLB's 65,536 blocks at 512-byte LBAs). It sizes
    /// every CID's chained PRP list ([`prp::list_pages_for_transfer`]: 17 pages for 32 MiB).
    pub max_transfer: usize,
}

impl Default for CtrlrOptions {
    fn default() -> Self {
        CtrlrOptions {
            admin_entries: 32,
            io_entries: 65,
            admin_timeout: Duration::from_secs(5),
            max_transfer: DEFAULT_MAX_TRANSFER,
        }
    }
}

/// Default [`CtrlrOptions::max_transfer`]: 32 MiB.
pub const DEFAULT_MAX_TRANSFER: usize = 32 << 20;

/// An active namespace with a usable LBA format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Namespace {
    /// Namespace identifier.
    pub nsid: u32,
    /// NSZE, size in logical blocks.
    pub blocks: u64,
    /// LBA data size in bytes.
    pub lba_size: u32,
    /// Metadata bytes per LBA.
    pub metadata_size: u16,
}

impl Namespace {
    /// Size in bytes, NSZE × LBA size (saturating at `u64::MAX`; a namespace from Identify always
    /// fits, [`Namespace::fits`] refuses the others).
    pub fn bytes(&self) -> u64 {
        self.blocks.saturating_mul(u64::from(self.lba_size))
    }
    /// Whether NSZE × LBA size fits 64 bits: a controller may report any NSZE (a 64-bit count of
    /// LBAs), but no namespace holds 2^64 bytes or more.
    pub fn fits(&self) -> bool {
        self.blocks.checked_mul(u64::from(self.lba_size)).is_some()
    }
}

/// Host memory page size, as CC.MPS (4 KiB → 0).
const HOST_MPS: u8 = (PAGE.trailing_zeros() - 12) as u8;

/// One NVMe controller: registers, admin queue, namespaces, and (optionally) I/O queue pair 1.
pub struct Controller {
    bar: Arc<dyn Bar>,
    dma: Arc<dyn DmaPool>,
    opts: CtrlrOptions,
    state: InitState,
    entered: Instant,
    deadline: Instant,
    cap: Cap,
    vs: Vs,
    admin: Option<QueuePair>,
    scratch: Option<DmaBuf>,
    identify: Option<IdentifyController>,
    namespaces: Vec<Namespace>,
    active: Vec<u32>,
    io: Option<QueuePair>,
    io_cq_created: bool,
    io_sq_created: bool,
    max_transfer: usize,
    enabled: bool,
    shut_down: bool,
    /// A shutdown's CC.EN = 0 did not clear CSTS.RDY: the device may still DMA.
    not_stopped: bool,
    resets: u64,
}

impl Controller {
    /// A controller in [`InitState::ReadCap`]; drive it with [`Controller::step`] or use [`Controller::init`].
    pub fn new(bar: Arc<dyn Bar>, dma: Arc<dyn DmaPool>, opts: CtrlrOptions) -> Controller {
        let now = Instant::now();
        Controller {
            bar,
            dma,
            opts,
            state: InitState::ReadCap,
            entered: now,
            deadline: now + Duration::from_millis(500),
            cap: Cap(0),
            vs: Vs(0),
            admin: None,
            scratch: None,
            identify: None,
            namespaces: Vec::new(),
            active: Vec::new(),
            io: None,
            io_cq_created: false,
            io_sq_created: false,
            max_transfer: PAGE,
            enabled: false,
            shut_down: false,
            not_stopped: false,
            resets: 0,
        }
    }

    /// Runs [`Controller::step`] to [`InitState::Ready`].
    ///
    /// # Errors
    /// The first failing state's error.
    pub fn init(bar: Arc<dyn Bar>, dma: Arc<dyn DmaPool>, opts: CtrlrOptions) -> Result<Controller> {
        let mut c = Controller::new(bar, dma, opts);
        while !c.step()? {
            std::hint::spin_loop();
        }
        Ok(c)
    }

    /// The current state.
    pub fn state(&self) -> InitState {
        self.state
    }
    /// CAP as read at init.
    pub fn cap(&self) -> Cap {
        self.cap
    }
    /// VS as read at init.
    pub fn version(&self) -> Vs {
        self.vs
    }
    /// Identify Controller data (after [`InitState::IdentifyController`]).
    pub fn identify(&self) -> Option<&IdentifyController> {
        self.identify.as_ref()
    }
    /// Active namespaces with a usable format.
    pub fn namespaces(&self) -> &[Namespace] {
        &self.namespaces
    }
    /// The namespace `nsid`.
    ///
    /// # Errors
    /// [`Error::NoNamespace`].
    pub fn namespace(&self, nsid: u32) -> Result<Namespace> {
        self.namespaces
            .iter()
            .find(|n| n.nsid == nsid)
            .copied()
            .ok_or_else(|| Error::NoNamespace { nsid, available: self.namespaces.iter().map(|n| n.nsid).collect() })
    }
    /// Largest bytes per I/O command: MDTS, capped by [`CtrlrOptions::max_transfer`] (a whole number of
    /// pages). Each command's chained PRP list covers it.
    pub fn max_transfer(&self) -> usize {
        self.max_transfer
    }
    /// The register window.
    pub fn bar(&self) -> &Arc<dyn Bar> {
        &self.bar
    }
    /// True when the controller is known not to DMA: it was never enabled, or CC.EN = 0 was
    /// confirmed by CSTS.RDY = 0 (NVMe base spec 2.0, §3.5.2). False while it runs, and after a
    /// shutdown or reset whose CSTS.RDY never cleared ([`Error::NotStopped`]): memory the device was
    /// given must then be leaked, not freed.
    pub fn dma_stopped(&self) -> bool {
        !self.enabled && !self.not_stopped
    }

    /// The DMA allocator the controller's queues come from.
    pub fn dma(&self) -> &Arc<dyn DmaPool> {
        &self.dma
    }
    /// I/O queue pair 1, once created.
    pub fn io_queue(&mut self) -> Option<&mut QueuePair> {
        self.io.as_mut()
    }
    /// Counters of the I/O queue pair (zero before it exists).
    pub fn io_queue_stats(&self) -> crate::queue::QueueStats {
        self.io.as_ref().map(QueuePair::stats).unwrap_or_default()
    }
    /// Controller resets done by [`Controller::reset`].
    pub fn resets(&self) -> u64 {
        self.resets
    }
    /// Current CSTS.
    pub fn csts(&self) -> Csts {
        Csts(self.bar.read32(regs::CSTS))
    }

    /// Fails with [`Error::ControllerFatal`] if CSTS.CFS is set.
    ///
    /// # Errors
    /// [`Error::ControllerFatal`].
    pub fn check_fatal(&self, during: &str) -> Result<()> {
        let csts = self.csts();
        if csts.cfs() {
            return Err(Error::ControllerFatal { during: during.to_string(), csts: csts.0 });
        }
        Ok(())
    }

    fn enter(&mut self, s: InitState) {
        tracing::trace!(from = ?self.state, to = ?s, "nvme init");
        self.state = s;
        self.entered = Instant::now();
        self.deadline = self.entered + self.cap.timeout();
    }

    fn timed_out(&self) -> Error {
        Error::InitTimeout { state: self.state, waited_ms: self.entered.elapsed().as_millis() as u64 }
    }

    /// Waits (one check) for CSTS.RDY == `rdy`: `Ok(true)` when reached. CSTS.CFS fails the wait for
    /// RDY = 1 only: disabling the controller is how a fatal status is cleared.
    fn wait_rdy(&self, rdy: bool) -> Result<bool> {
        let csts = self.csts();
        if rdy && csts.cfs() {
            return Err(Error::ControllerFatal { during: format!("init state {:?}", self.state), csts: csts.0 });
        }
        if csts.rdy() == rdy {
            return Ok(true);
        }
        if Instant::now() >= self.deadline {
            return Err(self.timed_out());
        }
        Ok(false)
    }

    /// Advances initialization by one state. Returns `Ok(true)` once [`InitState::Ready`].
    ///
    /// # Errors
    /// [`Error::InitTimeout`] naming the state, [`Error::ControllerFatal`], [`Error::Unsupported`],
    /// [`Error::AdminCommand`], [`Error::DmaAlloc`].
    pub fn step(&mut self) -> Result<bool> {
        use InitState::*;
        match self.state {
            ReadCap => {
                self.cap = Cap(self.bar.read64(regs::CAP));
                self.vs = Vs(self.bar.read32(regs::VS));
                let cap = self.cap;
                if cap.css() & 1 == 0 {
                    return Err(Error::Unsupported {
                        what: format!("CAP.CSS {:#x} lacks the NVM command set", cap.css()),
                    });
                }
                if !(cap.mpsmin()..=cap.mpsmax()).contains(&HOST_MPS) {
                    return Err(Error::Unsupported {
                        what: format!(
                            "host page {PAGE} B outside CAP.MPSMIN..MPSMAX = {}..{} B",
                            4096u64 << cap.mpsmin(),
                            4096u64 << cap.mpsmax()
                        ),
                    });
                }
                tracing::debug!(cap = format_args!("{:#x}", cap.0), vs = %self.vs, "nvme CAP");
                self.enter(DisableIfEnabled);
            }
            DisableIfEnabled => {
                let cc = Cc(self.bar.read32(regs::CC));
                if cc.en() {
                    self.bar.write32(regs::CC, cc.with_en(false).0);
                    self.not_stopped = true; // until CSTS.RDY = 0 confirms it
                }
                self.enabled = false;
                self.enter(WaitReady0);
            }
            WaitReady0 => {
                if self.wait_rdy(false)? {
                    self.not_stopped = false;
                    self.enter(ProgramAdminQueues);
                }
            }
            ProgramAdminQueues => {
                // After a reset the admin queue restarts on its own memory (rings zeroed).
                let q = match self.admin.take() {
                    Some(mut q) => {
                        q.reset_rings();
                        q
                    }
                    None => {
                        let entries = self.opts.admin_entries.min(self.cap.mqes().saturating_add(1)).min(4096);
                        QueuePair::new(self.bar.clone(), &*self.dma, 0, entries, self.cap.dstrd())?
                    }
                };
                let entries = q.entries();
                self.bar.write32(regs::AQA, Aqa::from_entries(entries, entries).0);
                self.bar.write64(regs::ASQ, q.sq_iova().0);
                self.bar.write64(regs::ACQ, q.cq_iova().0);
                self.admin = Some(q);
                if self.scratch.is_none() {
                    self.scratch = Some(self.dma.alloc(PAGE)?);
                }
                self.enter(Enable);
            }
            Enable => {
                let cc = Cc(0).with_css(0).with_mps(HOST_MPS).with_iosqes(6).with_iocqes(4).with_en(true);
                self.bar.write32(regs::CC, cc.0);
                self.enabled = true;
                self.enter(WaitReady1);
            }
            WaitReady1 => {
                if self.wait_rdy(true)? {
                    self.enter(IdentifyController);
                }
            }
            IdentifyController => {
                let page = self.identify_page("Identify Controller", admin::CNS_CONTROLLER, 0)?;
                let id = crate::spec::IdentifyController::parse(&page);
                if id.sqes != 0 && !((id.sqes & 0xF)..=(id.sqes >> 4)).contains(&6) {
                    return Err(Error::Unsupported { what: format!("SQES {:#x} excludes 64-byte entries", id.sqes) });
                }
                if id.cqes != 0 && !((id.cqes & 0xF)..=(id.cqes >> 4)).contains(&4) {
                    return Err(Error::Unsupported { what: format!("CQES {:#x} excludes 16-byte entries", id.cqes) });
                }
                let cap = (self.opts.max_transfer / PAGE).clamp(1, 65536 * 512 / PAGE) * PAGE;
                let max = prp::max_transfer(id.max_transfer(4096 << self.cap.mpsmin()), cap);
                // After a reset the I/O queue's PRP lists were sized for the first value: never grow.
                self.max_transfer = if self.io.is_some() { self.max_transfer.min(max) } else { max };
                tracing::debug!(mn = %id.mn, sn = %id.sn, fr = %id.fr, mdts = id.mdts, nn = id.nn, "nvme identify");
                self.identify = Some(id);
                self.enter(IdentifyNamespaces);
            }
            IdentifyNamespaces => {
                let list = self.identify_page("Identify Active Namespace ID list", admin::CNS_ACTIVE_NS_LIST, 0)?;
                self.active = list
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .take_while(|&n| n != 0)
                    .collect();
                self.namespaces.clear();
                for nsid in self.active.clone() {
                    let page = self.identify_page(&format!("Identify Namespace {nsid}"), admin::CNS_NAMESPACE, nsid)?;
                    let ns = IdentifyNamespace::parse(&page);
                    match ns.lba_size() {
                        Some(lba_size) if ns.nsze > 0 => {
                            let n = Namespace { nsid, blocks: ns.nsze, lba_size, metadata_size: ns.metadata_size() };
                            if n.fits() {
                                self.namespaces.push(n);
                            } else {
                                tracing::warn!(
                                    nsid,
                                    nsze = ns.nsze,
                                    lba_size,
                                    "nvme namespace of NSZE × LBA size past 2^64 bytes; skipped"
                                );
                            }
                        }
                        _ => tracing::warn!(
                            nsid,
                            flbas = ns.flbas,
                            "nvme namespace without a usable LBA format; skipped"
                        ),
                    }
                }
                self.enter(if self.opts.io_entries > 0 { SetNumQueues } else { Ready });
            }
            SetNumQueues => {
                let c =
                    // SAFETY: Set Features (Number of Queues) carries no data pointer.
                    unsafe { self.admin_init("Set Features (Number of Queues)", |c| *c = Command::set_num_queues(0, 1, 1)) }?;
                tracing::debug!(nsqa = (c.dw0 & 0xFFFF) + 1, ncqa = (c.dw0 >> 16) + 1, "nvme queues granted");
                self.enter(CreateIoCq);
            }
            CreateIoCq => {
                // After a reset the queue pair is re-created on its own memory (`reset` zeroed it).
                if self.io.is_none() {
                    let entries = self.opts.io_entries.min(self.cap.mqes().saturating_add(1)).clamp(2, 4096);
                    let q = QueuePair::with_max_transfer(
                        self.bar.clone(),
                        &*self.dma,
                        1,
                        entries,
                        self.cap.dstrd(),
                        self.max_transfer,
                    )?;
                    self.io = Some(q);
                }
                let q = self.io.as_ref().expect("just created");
                let (entries, cq) = (q.entries(), q.cq_iova().0);
                // SAFETY: PRP1 is the I/O CQ ring, DMA memory `self.io` owns until shutdown (and leaks
                // if the controller does not confirm it stopped).
                unsafe {
                    self.admin_init("Create I/O Completion Queue 1", |c| *c = Command::create_io_cq(0, 1, entries, cq))
                }?;
                self.io_cq_created = true;
                self.enter(CreateIoSq);
            }
            CreateIoSq => {
                let q = self.io.as_ref().expect("created in CreateIoCq");
                let (entries, sq) = (q.entries(), q.sq_iova().0);
                // SAFETY: PRP1 is the I/O SQ ring, DMA memory `self.io` owns until shutdown (and leaks
                // if the controller does not confirm it stopped).
                unsafe {
                    self.admin_init("Create I/O Submission Queue 1", |c| {
                        *c = Command::create_io_sq(0, 1, entries, 1, sq)
                    })
                }?;
                self.io_sq_created = true;
                self.enter(Ready);
            }
            Ready => return Ok(true),
        }
        Ok(self.state == Ready)
    }

    fn identify_page(&mut self, what: &str, cns: u8, nsid: u32) -> Result<Vec<u8>> {
        let mut scratch = self.scratch.take().expect("allocated in ProgramAdminQueues");
        scratch.zero();
        let iova = scratch.iova().0;
        // SAFETY: PRP1 is the scratch page, a DMA buffer of one page the controller owns until
        // shutdown (it goes back into `self.scratch` below, also after a timeout, and is leaked if
        // the controller does not confirm it stopped).
        let r = unsafe { self.admin_init(what, |c| *c = Command::identify(0, cns, nsid, iova)) };
        let page = r.map(|_| {
            let mut page = vec![0u8; PAGE];
            // SAFETY: the Identify completed (`Ok`) and its completion was consumed: the device no
            // longer writes the scratch page.
            unsafe { scratch.copy_out(0, &mut page) };
            page
        });
        self.scratch = Some(scratch);
        page
    }

    /// An admin command during init: the state's deadline, and a timeout names the state.
    ///
    /// # Safety
    /// As [`Controller::admin_until`].
    unsafe fn admin_init(&mut self, what: &str, build: impl FnOnce(&mut Command)) -> Result<Completion> {
        let deadline = self.deadline;
        // SAFETY: forwarded to this function's caller.
        match unsafe { self.admin_until(what, build, deadline) } {
            Err(Error::AdminTimeout { .. }) => Err(self.timed_out()),
            r => r,
        }
    }

    /// Submits one admin command and polls for its completion (with [`CtrlrOptions::admin_timeout`]).
    ///
    /// # Errors
    /// [`Error::AdminCommand`] for an error status, [`Error::AdminTimeout`], [`Error::ControllerFatal`].
    ///
    /// # Safety
    /// As [`QueuePair::submit`]: any data pointer the command carries (e.g. an Identify's PRP1) must
    /// be device-mapped memory the caller keeps until this returns `Ok` or an error status (after an
    /// [`Error::AdminTimeout`], until the controller is reset or shut down).
    pub unsafe fn admin(&mut self, what: &str, build: impl FnOnce(&mut Command)) -> Result<Completion> {
        let deadline = Instant::now() + self.opts.admin_timeout;
        // SAFETY: forwarded to this function's caller (the same contract).
        unsafe { self.admin_until(what, build, deadline) }
    }

    /// Submits the admin command `build` makes and polls for its completion until `deadline`.
    ///
    /// # Errors
    /// As [`Controller::admin`].
    ///
    /// # Safety
    /// As [`QueuePair::submit`]: every data pointer the command carries must be device-mapped memory
    /// that stays allocated and untouched by the host until this returns `Ok` or an error status;
    /// after [`Error::AdminTimeout`] (or [`Error::ControllerFatal`]) the device may still access it,
    /// so it must live until the controller is reset or shut down. Commands without data pointers
    /// (Set Features Number of Queues, Abort, Delete I/O Queue) meet this trivially; the
    /// controller's own scratch page and queue rings meet it because they live until shutdown.
    unsafe fn admin_until(
        &mut self,
        what: &str,
        build: impl FnOnce(&mut Command),
        deadline: Instant,
    ) -> Result<Completion> {
        let start = Instant::now();
        let q = self.admin.as_mut().expect("admin queue programmed");
        let cid = q.alloc_cid().ok_or(Error::QueueFull { qid: 0, depth: q.entries() })?;
        // SAFETY: the data pointers meet `QueuePair::submit`'s contract per this function's.
        unsafe { q.submit(cid, 0, build) }?;
        q.ring();
        let mut done = None;
        let mut idle = 0u32;
        loop {
            let q = self.admin.as_mut().expect("admin queue");
            let polled = q.poll(usize::MAX, |e| {
                if e.cid == cid && !e.late {
                    done = Some(e.cqe);
                }
            });
            if let Err(e) = polled {
                // Not ours: keep waiting for our command's completion.
                tracing::warn!(error = %picchio_core::error::chain(&e), "nvme admin completion ignored");
            }
            if let Some(c) = done {
                let status = c.status();
                if !status.is_success() {
                    return Err(Error::AdminCommand { what: what.to_string(), status });
                }
                return Ok(c);
            }
            idle += 1;
            if idle.is_multiple_of(256) {
                self.check_fatal(&format!("admin command {what}"))?;
                if Instant::now() >= deadline {
                    // Leave the CID taken: a late completion must not match a new command.
                    let q = self.admin.as_mut().expect("admin queue");
                    q.expire(Duration::ZERO, |_, _| {});
                    return Err(Error::AdminTimeout {
                        what: what.to_string(),
                        cid: cid.0,
                        waited_ms: start.elapsed().as_millis() as u64,
                    });
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// **Fault injection only** (cargo feature `fault-injection`, used by the VM harness's stray-DMA
    /// check; not part of the driver's API): submits `cmd` exactly as given — its data pointers are
    /// not checked or built — on I/O queue 1 (its CID replaced by a free one) and waits up to
    /// `timeout` for its completion. `Ok(None)` when none came; its CID then stays taken.
    ///
    /// # Errors
    /// [`Error::Unsupported`] without an I/O queue, [`Error::QueueFull`].
    ///
    /// # Safety
    /// The device will DMA wherever `cmd` points. Behind an IOMMU an unmapped IOVA is blocked (an
    /// IOMMU fault); without one (no-IOMMU mode, the sim's registry aside) it is a DMA into arbitrary
    /// physical memory, so only call it behind an IOMMU or with pointers into memory the caller owns.
    #[cfg(feature = "fault-injection")]
    #[doc(hidden)]
    pub unsafe fn submit_raw_for_fault_test(&mut self, cmd: Command, timeout: Duration) -> Result<Option<Completion>> {
        let q = self.io.as_mut().ok_or_else(|| Error::Unsupported { what: "no I/O queue".into() })?;
        let cid = q.alloc_cid().ok_or(Error::QueueFull { qid: 1, depth: q.entries() })?;
        // SAFETY: forwarded to this function's caller.
        unsafe { q.submit(cid, u64::MAX, |c| *c = cmd) }?;
        q.ring();
        let deadline = Instant::now() + timeout;
        loop {
            let mut done = None;
            let q = self.io.as_mut().expect("checked above");
            q.poll(usize::MAX, |e| {
                if e.cid == cid {
                    done = Some(e.cqe);
                }
            })?;
            if done.is_some() {
                return Ok(done);
            }
            if Instant::now() >= deadline {
                q.expire(Duration::ZERO, |_, _| {});
                return Ok(None);
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// Aborts command `cid` of submission queue `sqid` (Abort, §5.1), waiting at most `timeout` for
    /// the Abort's own completion. `Ok(true)`: the controller aborted it (DW0 bit 0 = 0), and the
    /// command's own completion (status Command Abort Requested) is posted to its CQ; `Ok(false)`:
    /// not aborted (it may have completed already, or the controller could not) — the caller still
    /// has to see the command's completion, or reset the controller.
    ///
    /// # Errors
    /// [`Error::AdminTimeout`], [`Error::AdminCommand`] (e.g. Abort Command Limit Exceeded),
    /// [`Error::ControllerFatal`]: the caller should reset the controller.
    pub fn abort(&mut self, sqid: u16, cid: Cid, timeout: Duration) -> Result<bool> {
        let what = format!("Abort (SQ {sqid}, CID {})", cid.0);
        // SAFETY: Abort carries no data pointer.
        let c = unsafe { self.admin_until(&what, |c| *c = Command::abort(0, sqid, cid.0), Instant::now() + timeout) }?;
        Ok(c.dw0 & 1 == 0)
    }

    /// Controller reset (§3.7.2): CC.EN = 0, wait for CSTS.RDY = 0 within CAP.TO (this also clears
    /// CSTS.CFS), then the bring-up state machine again from [`InitState::ProgramAdminQueues`]:
    /// admin queue, enable, Identify, Number of Queues, Create I/O CQ and SQ 1 — on the same DMA
    /// memory (rings zeroed, IOVAs unchanged). Once CSTS.RDY = 0 the controller does no more DMA, so
    /// the buffers of the commands that were outstanding are free again.
    ///
    /// Returns the I/O commands that were outstanding on queue 1 (they will never complete).
    ///
    /// # Errors
    /// [`Error::InitTimeout`] naming the state (e.g. `WaitReady0` when RDY does not clear), and any
    /// bring-up error; the controller is then unusable.
    pub fn reset(&mut self) -> Result<Vec<Lost>> {
        tracing::warn!(kind = self.bar.kind(), csts = format_args!("{:#x}", self.csts().0), "nvme controller reset");
        self.io_sq_created = false;
        self.io_cq_created = false;
        self.shut_down = false;
        self.state = InitState::DisableIfEnabled;
        self.step()?; // CC.EN = 0
        while self.state == InitState::WaitReady0 {
            self.step()?;
            std::thread::sleep(Duration::from_micros(20));
        }
        // CSTS.RDY = 0: the controller stopped processing, so no DMA touches the queues or buffers.
        let lost = self.io.as_mut().map(QueuePair::reset_rings).unwrap_or_default();
        while !self.step()? {
            std::hint::spin_loop();
        }
        self.resets += 1;
        tracing::info!(kind = self.bar.kind(), lost = lost.len(), "nvme controller reset complete");
        Ok(lost)
    }

    /// Deletes I/O queue pair 1, then a normal shutdown (CC.SHN = 01b, wait CSTS.SHST = 10b), then
    /// CC.EN = 0. Idempotent; run by `Drop`.
    ///
    /// # Errors
    /// The first failure (the remaining steps still run).
    pub fn shutdown(&mut self) -> Result<()> {
        if self.shut_down || !self.enabled {
            return Ok(());
        }
        self.shut_down = true;
        let start = Instant::now();
        let mut first: Option<Error> = None;
        let fatal = self.csts().cfs();
        let deadline = Instant::now() + self.cap.timeout().min(self.opts.admin_timeout);
        if !fatal && self.io_sq_created {
            // SAFETY: Delete I/O Submission Queue carries no data pointer.
            if let Err(e) = unsafe {
                self.admin_until("Delete I/O Submission Queue 1", |c| *c = Command::delete_io_sq(0, 1), deadline)
            } {
                first.get_or_insert(e);
            }
            self.io_sq_created = false;
        }
        if !fatal && self.io_cq_created {
            // SAFETY: Delete I/O Completion Queue carries no data pointer.
            if let Err(e) = unsafe {
                self.admin_until("Delete I/O Completion Queue 1", |c| *c = Command::delete_io_cq(0, 1), deadline)
            } {
                first.get_or_insert(e);
            }
            self.io_cq_created = false;
        }
        let cc = Cc(self.bar.read32(regs::CC));
        if !fatal {
            self.bar.write32(regs::CC, cc.with_shn(Shn::Normal).0);
            let deadline = Instant::now() + self.cap.timeout();
            loop {
                let csts = self.csts();
                if csts.shst() == Shst::Complete as u8 {
                    tracing::info!(
                        "nvme {} shutdown complete (CSTS.SHST={}) after {:.1} ms",
                        self.bar.kind(),
                        csts.shst(),
                        start.elapsed().as_secs_f64() * 1e3
                    );
                    break;
                }
                if csts.cfs() || Instant::now() >= deadline {
                    first.get_or_insert(Error::InitTimeout {
                        state: self.state,
                        waited_ms: self.cap.timeout().as_millis() as u64,
                    });
                    break;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        // Reset so the device stops all DMA before the queues' memory is freed. Only CSTS.RDY = 0
        // confirms it did (also on the CSTS.CFS path, which skips CC.SHN): otherwise say so, and
        // `dma_stopped` stays false so owners of DMA memory leak it rather than free it.
        self.bar.write32(regs::CC, Cc(self.bar.read32(regs::CC)).with_en(false).with_shn(Shn::None).0);
        let deadline = Instant::now() + self.cap.timeout();
        loop {
            let csts = Csts(self.bar.read32(regs::CSTS));
            if !csts.rdy() {
                break;
            }
            if Instant::now() >= deadline {
                self.not_stopped = true;
                let e = Error::NotStopped { csts: csts.0, waited_ms: self.cap.timeout().as_millis() as u64 };
                // Reported in place of an earlier failure: it is the one that matters for memory safety.
                if let Some(prev) = first.replace(e) {
                    tracing::warn!(error = %prev, "nvme shutdown");
                }
                break;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        self.enabled = false;
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::warn!(error = %picchio_core::error::chain(&e), "nvme shutdown");
        }
        if !self.dma_stopped() {
            // The device may still read the SQs and write the CQs and scratch page: leak them.
            tracing::error!(
                "nvme {}: the controller did not confirm it stopped (CSTS.RDY = 1 after CC.EN = 0); leaking its \
                 queue memory (admin and I/O SQ/CQ rings, PRP lists, scratch page) instead of freeing memory it \
                 may still DMA into",
                self.bar.kind()
            );
            std::mem::forget(self.admin.take());
            std::mem::forget(self.io.take());
            std::mem::forget(self.scratch.take());
            std::mem::forget(self.dma.clone());
        }
    }
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("bar", &self.bar.kind())
            .field("state", &self.state)
            .field("cap", &format_args!("{:#x}", self.cap.0))
            .field("namespaces", &self.namespaces)
            .finish()
    }
}
