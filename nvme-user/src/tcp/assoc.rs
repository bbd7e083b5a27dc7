//! An association with a controller over NVMe/TCP (NVMe base spec 2.0, §3.3 "NVMe over Fabrics"):
//! the admin queue's Connect, controller enable through Property Set/Get (CC.EN, CSTS.RDY within
//! CAP.TO), Identify, Keep Alive on a thread, the I/O queues' Connects, and shutdown (CC.SHN,
//! CSTS.SHST) through properties.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::ctrlr::Namespace;
use crate::spec::regs::Shn;
use crate::spec::{self, Cap, Cc, Command, Completion, Csts, IdentifyController, IdentifyNamespace, Vs};

use super::conn::{Conn, ConnParams};
use super::error::{TcpError, TcpResult};
use super::fabrics::{self, ConnectData, FabricsIdentify, CNTLID_DYNAMIC};

/// Options of the NVMe/TCP initiator.
#[derive(Clone, Debug)]
pub struct TcpOptions {
    /// HOSTNQN of the Connect data (default: [`default_host_identity`]).
    pub hostnqn: String,
    /// HOSTID of the Connect data.
    pub hostid: [u8; 16],
    /// Ask for header digests (CRC32C) in ICReq.
    pub hdgst: bool,
    /// Ask for data digests (CRC32C) in ICReq.
    pub ddgst: bool,
    /// KATO of the admin Connect; Keep Alive is sent every KATO / 2. Zero: no keep-alive.
    pub kato: Duration,
    /// Per-command timeout (and TCP connect and per-PDU read timeout).
    pub timeout: Duration,
    /// I/O queues (one TCP connection each), at least 1.
    pub io_queues: u16,
    /// Commands in flight per I/O queue (clamped to what the controller allows: CAP.MQES + 1 −
    /// 1 and MAXCMD).
    pub qd: u16,
    /// Attempts to re-establish a lost association before the requests in flight fail.
    pub reconnect_attempts: u32,
    /// Pause between those attempts, and before the next attempt after they all failed.
    pub reconnect_delay: Duration,
    /// Times one read is resubmitted over a new connection before it fails.
    pub max_retries: u32,
    /// Pause between reads of CSTS while waiting for CSTS.RDY = 1 after CC.EN = 1 and for
    /// CSTS.SHST = 10b after CC.SHN = 01b (both bounded by CAP.TO). Default 5 ms; zero polls
    /// without pausing (the `nvme_tcp` fuzz target, whose replayed target answers at once).
    pub csts_poll: Duration,
}

impl Default for TcpOptions {
    fn default() -> Self {
        let (hostnqn, hostid) = default_host_identity();
        TcpOptions {
            hostnqn,
            hostid,
            hdgst: false,
            ddgst: false,
            kato: Duration::from_secs(10),
            timeout: Duration::from_secs(10),
            io_queues: 1,
            qd: 32,
            reconnect_attempts: 3,
            reconnect_delay: Duration::from_millis(500),
            max_retries: 2,
            csts_poll: Duration::from_millis(5),
        }
    }
}

/// The host's NQN and ID as nvme-cli keeps them (`/etc/nvme/hostnqn`, `/etc/nvme/hostid`), else
/// a UUID NQN (`nqn.2014-08.org.nvmexpress:uuid:…`) derived from `/etc/machine-id`, else a fixed
/// Picchio UUID.
pub fn default_host_identity() -> (String, [u8; 16]) {
    let read = |p: &str| std::fs::read_to_string(p).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty());
    let parse_uuid = |s: &str| -> Option<[u8; 16]> {
        let hex: String = s.chars().filter(|c| c.is_ascii_hexdigit()).collect();
        (hex.len() == 32).then(|| {
            let mut id = [0u8; 16];
            for (i, b) in id.iter_mut().enumerate() {
                *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0);
            }
            id
        })
    };
    let id = read("/etc/nvme/hostid")
        .and_then(|s| parse_uuid(&s))
        .or_else(|| read("/etc/machine-id").and_then(|s| parse_uuid(&s)))
        .unwrap_or(*b"picchio-nvme-tcp");
    let uuid = format!(
        "{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
        id[0],
        id[1],
        id[2],
        id[3],
        id[4],
        id[5],
        id[6],
        id[7],
        id[8],
        id[9],
        id[10],
        id[11],
        id[12],
        id[13],
        id[14],
        id[15]
    );
    let nqn = read("/etc/nvme/hostnqn").unwrap_or_else(|| format!("nqn.2014-08.org.nvmexpress:uuid:{uuid}"));
    (nqn, id)
}

/// Property offsets (the register offsets of §3.1.4): CAP, VS, CC, CSTS.
mod prop {
    pub const CAP: u32 = crate::spec::regs::CAP as u32;
    pub const VS: u32 = crate::spec::regs::VS as u32;
    pub const CC: u32 = crate::spec::regs::CC as u32;
    pub const CSTS: u32 = crate::spec::regs::CSTS as u32;
}

/// The admin queue of an association.
pub(crate) struct Admin {
    pub conn: Conn,
    pub cntlid: u16,
    pub cap: Cap,
    pub vs: Vs,
    cid: u16,
    subnqn: String,
    csts_poll: Duration,
}

/// What the controller said about itself at association.
#[derive(Clone, Debug)]
pub struct ControllerInfo {
    /// CNTLID from the admin Connect.
    pub cntlid: u16,
    /// CAP.
    pub cap: Cap,
    /// VS.
    pub vs: Vs,
    /// Identify Controller.
    pub id: IdentifyController,
    /// The Fabrics fields of Identify Controller.
    pub fabrics: FabricsIdentify,
}

impl Admin {
    fn next_cid(&mut self) -> u16 {
        self.cid = self.cid.wrapping_add(1);
        self.cid
    }

    /// Sends `cmd` (its CID replaced) and returns the completion, or the error status as
    /// [`TcpError::Command`] naming `step`.
    fn run(&mut self, mut cmd: Command, data_in: Option<&mut [u8]>, step: &str) -> TcpResult<Completion> {
        cmd.set_cid(self.next_cid());
        let c = self.conn.command(&cmd, None, data_in, step)?;
        if !c.status().is_success() {
            return Err(TcpError::Command {
                addr: self.conn.addr.clone(),
                qid: 0,
                step: step.into(),
                status: c.status(),
            });
        }
        Ok(c)
    }

    fn get(&mut self, off: u32, eight: bool, name: &str) -> TcpResult<u64> {
        let c = self.run(fabrics::property_get(0, off, eight), None, &format!("Property Get {name}"))?;
        Ok(u64::from(c.dw0) | if eight { u64::from(c.dw1) << 32 } else { 0 })
    }

    fn set(&mut self, off: u32, v: u32, name: &str) -> TcpResult<()> {
        self.run(fabrics::property_set(0, off, v.into(), false), None, &format!("Property Set {name}")).map(|_| ())
    }

    /// Identify with a 4096-byte page in `buf`.
    pub fn identify(&mut self, cns: u8, nsid: u32, step: &str) -> TcpResult<Vec<u8>> {
        let mut buf = vec![0u8; 4096];
        let mut cmd = Command::identify(0, cns, nsid, 0);
        super::pdu::sgl::set(&mut cmd, super::pdu::sgl::TRANSPORT, 0, 4096);
        self.run(cmd, Some(&mut buf), step)?;
        Ok(buf)
    }

    /// Get Log Page of `bytes` bytes at `offset`.
    pub fn log_page(&mut self, lid: u8, bytes: u32, offset: u64, step: &str) -> TcpResult<Vec<u8>> {
        let mut buf = vec![0u8; bytes as usize];
        let mut cmd = fabrics::get_log_page(0, lid, bytes, offset);
        super::pdu::sgl::set(&mut cmd, super::pdu::sgl::TRANSPORT, 0, bytes);
        self.run(cmd, Some(&mut buf), step)?;
        Ok(buf)
    }

    /// Keep Alive.
    pub fn keep_alive(&mut self) -> TcpResult<()> {
        let mut cmd = fabrics::keep_alive(0);
        super::pdu::sgl::set(&mut cmd, super::pdu::sgl::TRANSPORT, 0, 0);
        self.run(cmd, None, "Keep Alive").map(|_| ())
    }

    /// Normal shutdown: CC.SHN = 01b, then CSTS.SHST = 10b (shutdown complete) within CAP.TO.
    pub fn shutdown(&mut self) -> TcpResult<()> {
        let cc = Cc(self.get(prop::CC, false, "CC")? as u32).with_shn(Shn::Normal);
        self.set(prop::CC, cc.0, "CC (CC.SHN = 01b)")?;
        let deadline = Instant::now() + self.cap.timeout();
        loop {
            let csts = Csts(self.get(prop::CSTS, false, "CSTS")? as u32);
            if csts.shst() == spec::regs::Shst::Complete as u8 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(TcpError::Timeout {
                    addr: self.conn.addr.clone(),
                    qid: 0,
                    step: format!("shutdown (CSTS.SHST = {:#b}, waiting for 10b)", csts.shst()),
                    waited_ms: self.cap.timeout().as_millis() as u64,
                });
            }
            std::thread::sleep(self.csts_poll);
        }
    }
}

/// Connects a queue: TCP, ICReq/ICResp, then Connect with QID `qid`, SQSIZE `sqsize` entries.
/// Returns the connection and the completion's dword 0 (CNTLID for the admin queue).
pub(crate) fn connect_queue(
    addr: &str,
    subnqn: &str,
    qid: u16,
    sqsize: u16,
    cntlid: u16,
    opts: &TcpOptions,
) -> TcpResult<(Conn, u16)> {
    let p = ConnParams { hdgst: opts.hdgst, ddgst: opts.ddgst, timeout: opts.timeout };
    let mut conn = Conn::open(addr, qid, p)?;
    let kato = if qid == 0 { opts.kato.as_millis().min(u128::from(u32::MAX)) as u32 } else { 0 };
    let mut cmd = fabrics::connect(1, qid, sqsize, kato);
    let data =
        ConnectData { hostid: opts.hostid, cntlid, subnqn: subnqn.into(), hostnqn: opts.hostnqn.clone() }.encode();
    super::pdu::sgl::set(&mut cmd, super::pdu::sgl::IN_CAPSULE, 0, data.len() as u32);
    let c = conn.command(&cmd, Some(&data), None, "Connect")?;
    let s = c.status();
    if !s.is_success() {
        let invalid =
            s.sct == spec::StatusCodeType::CommandSpecific && s.sc == fabrics::connect_status::INVALID_PARAMETERS;
        return Err(TcpError::ConnectRejected {
            addr: addr.into(),
            qid,
            subnqn: subnqn.into(),
            status: s,
            status_name: fabrics::status_name(s),
            // Connect Invalid Parameters: IPO in DW0 bits 15:0, IATTR in bits 23:16 (as nvmet's
            // IPO_IATTR_CONNECT_DATA and SPDK's spdk_nvmf_fabric_connect_rsp encode them).
            iattr: invalid.then_some(((c.dw0 >> 16) & 1) as u8),
            ipo: invalid.then_some(c.dw0 as u16),
        });
    }
    Ok((conn, c.dw0 as u16))
}

/// Connects the admin queue of `subnqn` at `addr`, enables the controller (CC.EN = 1, then
/// CSTS.RDY = 1 within CAP.TO) and identifies it.
///
/// # Errors
/// Every step's [`TcpError`]: [`TcpError::ConnectRejected`], [`TcpError::NotReady`],
/// [`TcpError::ControllerFatal`], [`TcpError::Command`] and the connection's.
pub(crate) fn associate(addr: &str, subnqn: &str, opts: &TcpOptions) -> TcpResult<(Admin, ControllerInfo)> {
    let (conn, cntlid) = connect_queue(addr, subnqn, 0, 32, CNTLID_DYNAMIC, opts)?;
    let mut a =
        Admin { conn, cntlid, cap: Cap(0), vs: Vs(0), cid: 1, subnqn: subnqn.into(), csts_poll: opts.csts_poll };
    a.cap = Cap(a.get(prop::CAP, true, "CAP")?);
    a.vs = Vs(a.get(prop::VS, false, "VS")? as u32);
    let csts = Csts(a.get(prop::CSTS, false, "CSTS")? as u32);
    if csts.cfs() {
        return Err(TcpError::ControllerFatal { addr: addr.into(), step: "enable".into(), csts: csts.0 });
    }
    // CSS NVM (000b), MPS 4 KiB, AMS round robin, IOSQES 2^6 = 64, IOCQES 2^4 = 16, EN.
    let cc = Cc(0).with_css(0).with_mps(0).with_iosqes(6).with_iocqes(4).with_en(true);
    a.set(prop::CC, cc.0, "CC (CC.EN = 1)")?;
    let t0 = Instant::now();
    let limit = a.cap.timeout();
    loop {
        let csts = Csts(a.get(prop::CSTS, false, "CSTS")? as u32);
        if csts.cfs() {
            return Err(TcpError::ControllerFatal { addr: addr.into(), step: "enable".into(), csts: csts.0 });
        }
        if csts.rdy() {
            break;
        }
        if t0.elapsed() >= limit {
            return Err(TcpError::NotReady { addr: addr.into(), csts: csts.0, waited_ms: limit.as_millis() as u64 });
        }
        std::thread::sleep(a.csts_poll);
    }
    let page = a.identify(spec::admin::CNS_CONTROLLER, 0, "Identify Controller")?;
    let info = ControllerInfo {
        cntlid,
        cap: a.cap,
        vs: a.vs,
        id: IdentifyController::parse(&page),
        fabrics: FabricsIdentify::parse(&page),
    };
    Ok((a, info))
}

/// Identify Namespace `nsid` into a [`Namespace`] (LBA size from the format in use, NSZE blocks).
pub(crate) fn identify_namespace(a: &mut Admin, nsid: u32) -> TcpResult<Namespace> {
    let page = a.identify(spec::admin::CNS_NAMESPACE, nsid, &format!("Identify Namespace {nsid}"))?;
    let id = IdentifyNamespace::parse(&page);
    let err = |what: String| TcpError::Namespace { addr: a.conn.addr.clone(), subnqn: a.subnqn.clone(), nsid, what };
    if id.nsze == 0 {
        return Err(err("not active (Identify Namespace reports NSZE 0)".into()));
    }
    let lba_size = id.lba_size().ok_or_else(|| err(format!("LBA format {} is invalid", id.format_index())))?;
    if id.metadata_size() != 0 && id.flbas & 0x10 != 0 {
        return Err(err(format!("extended-metadata LBA format ({} B of metadata per LBA)", id.metadata_size())));
    }
    let ns = Namespace { nsid, blocks: id.nsze, lba_size, metadata_size: id.metadata_size() };
    if !ns.fits() {
        return Err(err(format!("NSZE {} LBAs of {lba_size} bytes is 2^64 bytes or more", id.nsze)));
    }
    Ok(ns)
}

/// The admin queue, kept alive by a thread that sends Keep Alive every KATO / 2 (none when KATO
/// is 0); shut down and closed on drop.
pub(crate) struct KeptAdmin {
    shared: Arc<(Mutex<Option<Admin>>, Condvar)>,
    stop: Arc<Mutex<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl KeptAdmin {
    pub fn start(admin: Admin, kato: Duration) -> KeptAdmin {
        let shared = Arc::new((Mutex::new(Some(admin)), Condvar::new()));
        let stop = Arc::new(Mutex::new(false));
        let thread = (!kato.is_zero()).then(|| {
            let (shared, stop) = (shared.clone(), stop.clone());
            let period = kato / 2;
            std::thread::Builder::new()
                .name("nvme-tcp-keepalive".into())
                .spawn(move || keep_alive_loop(&shared, &stop, period))
                .expect("spawn the keep-alive thread")
        });
        KeptAdmin { shared, stop, thread }
    }

    /// Stops keep-alive and closes the admin connection without a shutdown (the association is
    /// being replaced after a failure; the target ends the old controller when KATO expires).
    pub fn abandon(mut self) {
        self.halt();
        drop(self.shared.0.lock().unwrap_or_else(|e| e.into_inner()).take());
    }

    fn halt(&mut self) {
        *self.stop.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.shared.1.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn keep_alive_loop(shared: &Arc<(Mutex<Option<Admin>>, Condvar)>, stop: &Mutex<bool>, period: Duration) {
    let (lock, cv) = &**shared;
    let mut next = Instant::now() + period;
    let mut guard = lock.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if *stop.lock().unwrap_or_else(|e| e.into_inner()) {
            return;
        }
        let now = Instant::now();
        if now < next {
            guard = cv.wait_timeout(guard, next - now).unwrap_or_else(|e| e.into_inner()).0;
            continue;
        }
        next = now + period;
        if let Some(a) = guard.as_mut() {
            if let Err(e) = a.keep_alive() {
                tracing::warn!("{}: keep-alive failed: {}", a.conn.addr, picchio_core::error::chain(&e));
                *guard = None;
            }
        }
    }
}

impl Drop for KeptAdmin {
    fn drop(&mut self) {
        self.halt();
        if let Some(mut a) = self.shared.0.lock().unwrap_or_else(|e| e.into_inner()).take() {
            if let Err(e) = a.shutdown() {
                tracing::warn!("{}: controller shutdown: {}", a.conn.addr, picchio_core::error::chain(&e));
            }
        }
    }
}

/// Lists the subsystems a discovery controller at `addr` offers: Connect to
/// [`fabrics::DISCOVERY_NQN`], Get Log Page 70h (header, then every record), shutdown.
///
/// # Errors
/// The association's errors, [`TcpError::Command`] for Get Log Page.
pub fn discover(addr: &str, opts: &TcpOptions) -> TcpResult<Vec<fabrics::DiscoveryEntry>> {
    let opts = TcpOptions { kato: Duration::ZERO, ..opts.clone() };
    let (mut a, _info) = associate(addr, fabrics::DISCOVERY_NQN, &opts)?;
    let head = a.log_page(fabrics::LID_DISCOVERY, 1024, 0, "Get Log Page 70h (header)")?;
    let h = fabrics::DiscoveryHeader::parse(&head);
    let n = h.numrec.min(1024) as u32;
    let mut out = Vec::with_capacity(n as usize);
    if n > 0 {
        let bytes = n * fabrics::DiscoveryEntry::LEN as u32;
        let recs = a.log_page(fabrics::LID_DISCOVERY, bytes, 1024, "Get Log Page 70h (records)")?;
        out.extend(recs.chunks_exact(fabrics::DiscoveryEntry::LEN).map(fabrics::DiscoveryEntry::parse));
    }
    if let Err(e) = a.shutdown() {
        tracing::warn!("{addr}: discovery controller shutdown: {}", picchio_core::error::chain(&e));
    }
    Ok(out)
}
