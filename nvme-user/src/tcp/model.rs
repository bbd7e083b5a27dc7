//! A **model** of an NVMe/TCP target for tests — not a target to serve anything with: one NVM
//! subsystem with one namespace (backed by a file or by memory) and a discovery controller, on a
//! real TCP socket bound to 127.0.0.1, one thread per connection. It speaks the PDUs, Fabrics
//! commands and admin/NVM commands the initiator uses (ICReq/ICResp with digests, Connect, Property
//! Get/Set with CC.EN/CSTS.RDY and CC.SHN/CSTS.SHST, Identify, Keep Alive, Get Log Page 70h, Read
//! with C2HData, Write in the capsule or after R2Ts, Flush), and injects the faults of [`Fault`]
//! so every error path of the initiator runs in `cargo test`.
//!
//! The real targets (Linux nvmet-tcp in a QEMU guest) are exercised by the VM harness (tests/vm).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::spec::regs::Shst;
use crate::spec::{self, Cap, Cc, Command, Completion, Csts, LbaFormat, Status, StatusCodeType};

use super::fabrics::{self, ConnectData, DiscoveryEntry};
use super::pdu::{self, flags, pdu_type, CommonHeader, DataHeader, IcReq, IcResp, TermReq, CH_LEN};
use super::queue::TcpTarget;

/// What backs the model's namespace.
#[derive(Clone, Debug)]
pub enum Backing {
    /// A file, read and written in place.
    File(PathBuf),
    /// Bytes in memory.
    Memory(Vec<u8>),
}

/// The model's configuration.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// The subsystem's NQN.
    pub subnqn: String,
    /// The namespace's bytes (a whole number of LBAs; a partial last LBA is not exposed).
    pub backing: Backing,
    /// LBA size (512 or 4096).
    pub lba_size: u32,
    /// Whether Write is accepted (else it completes with Namespace is Write Protected).
    pub writable: bool,
    /// MAXH2CDATA in ICResp.
    pub maxh2cdata: u32,
    /// In-capsule data bytes accepted on I/O queues (IOCCSZ = (this + 64) / 16).
    pub in_capsule: u32,
    /// Largest C2HData PDU; a read is sent in PDUs of at most this many bytes.
    pub c2h_chunk: u32,
    /// Largest R2T; a write beyond the capsule is asked for in R2Ts of at most this many bytes.
    pub r2t_chunk: u32,
    /// CAP.MQES (0-based queue entries).
    pub mqes: u16,
    /// MAXCMD in Identify Controller.
    pub maxcmd: u16,
    /// MDTS (in 4 KiB units, log2; 0 = no limit).
    pub mdts: u8,
    /// CPDA in ICResp.
    pub cpda: u8,
    /// Complete reads with the C2HData SUCCESS flag (no CapsuleResp) instead of a CapsuleResp.
    pub success_flag: bool,
}

impl ModelConfig {
    /// A model serving `bytes` from memory with `lba_size`-byte LBAs, writable.
    pub fn memory(bytes: Vec<u8>, lba_size: u32) -> ModelConfig {
        ModelConfig {
            subnqn: "nqn.2026-12.io.picchio:model".into(),
            backing: Backing::Memory(bytes),
            lba_size,
            writable: true,
            maxh2cdata: 32 << 10,
            in_capsule: 8192,
            c2h_chunk: 128 << 10,
            r2t_chunk: 256 << 10,
            mqes: 127,
            maxcmd: 128,
            mdts: 8,
            cpda: 0,
            success_flag: false,
        }
    }
    /// A model serving the file `path`.
    pub fn file(path: impl Into<PathBuf>, lba_size: u32) -> ModelConfig {
        ModelConfig { backing: Backing::File(path.into()), ..ModelConfig::memory(Vec::new(), lba_size) }
    }
}

/// A fault the model injects. One-shot faults are consumed by the first PDU or command they
/// apply to; [`Fault::NeverReady`], [`Fault::Hang`], [`Fault::SilentIcReq`] and [`Fault::CloseOnAccept`] stay until
/// [`TargetModel::clear_faults`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The next I/O CapsuleResp has PLEN 20, shorter than its 24-byte header.
    ShortPdu,
    /// The next I/O CapsuleResp or C2HData has a wrong header digest (header digests on).
    BadHeaderDigest,
    /// The next C2HData has a wrong data digest (data digests on).
    BadDataDigest,
    /// An H2CData PDU (a type a host never receives) instead of the next C2HData.
    UnexpectedPduType,
    /// The next R2T asks for 4096 bytes more than the write carries.
    R2tTooLong,
    /// The next C2HData's DATAO + DATAL runs past the command's data.
    C2HPastBuffer,
    /// The next C2HData names a CID with no command outstanding.
    C2HWrongCid,
    /// The next I/O command completes with this status.
    ErrorStatus(Status),
    /// The next admin Connect completes with this status (Connect Invalid Parameters with IATTR 1,
    /// IPO 256: the SUBNQN).
    RejectConnect(Status),
    /// CC.EN = 1 never sets CSTS.RDY.
    NeverReady,
    /// The next read sends half its data, then the connection is closed.
    DropMidRead,
    /// The next I/O command gets no answer.
    Silent,
    /// No I/O command gets an answer.
    Hang,
    /// No ICReq gets an ICResp.
    SilentIcReq,
    /// Every new connection is closed as soon as it is accepted (a target whose port is gone).
    CloseOnAccept,
    /// The next I/O command is answered with a C2HTermReq (Data Transfer Out of Range).
    TermReq,
}

impl Fault {
    fn sticky(&self) -> bool {
        matches!(self, Fault::NeverReady | Fault::Hang | Fault::SilentIcReq | Fault::CloseOnAccept)
    }
}

struct Ctrl {
    cc: Cc,
    csts: Csts,
}

struct Shared {
    cfg: ModelConfig,
    port: u16,
    store: Mutex<Store>,
    ctrls: Mutex<HashMap<u16, Arc<Mutex<Ctrl>>>>,
    next_cntlid: AtomicU16,
    faults: Mutex<Vec<Fault>>,
    conns: Mutex<Vec<TcpStream>>,
    stop: AtomicBool,
    stats: ModelCounters,
}

#[derive(Default)]
struct ModelCounters {
    connections: AtomicU64,
    io_commands: AtomicU64,
    connects: AtomicU64,
    keep_alives: AtomicU64,
    shutdowns: AtomicU64,
    r2ts: AtomicU64,
    in_capsule_writes: AtomicU64,
}

/// Counters of the model, for tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModelStats {
    /// TCP connections accepted.
    pub connections: u64,
    /// NVM commands received on I/O queues.
    pub io_commands: u64,
    /// Connect commands.
    pub connects: u64,
    /// Keep Alive commands.
    pub keep_alives: u64,
    /// Normal shutdowns (CC.SHN = 01b).
    pub shutdowns: u64,
    /// R2Ts sent.
    pub r2ts: u64,
    /// Writes with in-capsule data.
    pub in_capsule_writes: u64,
}

enum Store {
    File(std::fs::File, u64),
    Memory(Vec<u8>),
}

impl Store {
    fn len(&self) -> u64 {
        match self {
            Store::File(_, n) => *n,
            Store::Memory(v) => v.len() as u64,
        }
    }
    fn read(&self, at: u64, out: &mut [u8]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        match self {
            Store::File(f, _) => f.read_exact_at(out, at),
            Store::Memory(v) => {
                out.copy_from_slice(&v[at as usize..at as usize + out.len()]);
                Ok(())
            }
        }
    }
    fn write(&mut self, at: u64, data: &[u8]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        match self {
            Store::File(f, _) => f.write_all_at(data, at),
            Store::Memory(v) => {
                v[at as usize..at as usize + data.len()].copy_from_slice(data);
                Ok(())
            }
        }
    }
}

/// The running model: its listener thread serves until the model is dropped.
pub struct TargetModel {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TargetModel {
    /// Binds 127.0.0.1 on a free port and starts serving.
    ///
    /// # Errors
    /// Opening the backing file or binding the socket.
    pub fn start(cfg: ModelConfig) -> std::io::Result<TargetModel> {
        let store = match &cfg.backing {
            Backing::File(p) => {
                let f = std::fs::OpenOptions::new().read(true).write(cfg.writable).open(p)?;
                let n = f.metadata()?.len();
                Store::File(f, n)
            }
            Backing::Memory(v) => Store::Memory(v.clone()),
        };
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            cfg,
            port,
            store: Mutex::new(store),
            ctrls: Mutex::new(HashMap::new()),
            next_cntlid: AtomicU16::new(1),
            faults: Mutex::new(Vec::new()),
            conns: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            stats: ModelCounters::default(),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new().name("nvme-tcp-model".into()).spawn(move || {
            for stream in listener.incoming() {
                if s.stop.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(stream) = stream else { continue };
                s.stats.connections.fetch_add(1, Ordering::Relaxed);
                if let Ok(c) = stream.try_clone() {
                    lock(&s.conns).push(c);
                }
                let s2 = s.clone();
                let _ = std::thread::Builder::new().name("nvme-tcp-model-conn".into()).spawn(move || {
                    let _ = Session::new(stream, s2).serve();
                });
            }
        })?;
        Ok(TargetModel { shared, thread: Some(thread) })
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.shared.port)
    }
    /// The subsystem NQN.
    pub fn subnqn(&self) -> &str {
        &self.shared.cfg.subnqn
    }
    /// The target of namespace `nsid` of this model.
    pub fn target(&self, nsid: u32) -> TcpTarget {
        TcpTarget { addr: self.addr(), subnqn: self.shared.cfg.subnqn.clone(), nsid }
    }
    /// `nvme-tcp://127.0.0.1:PORT/NQN/1`.
    pub fn uri(&self) -> String {
        self.target(1).to_string()
    }
    /// Injects `f`.
    pub fn inject(&self, f: Fault) {
        lock(&self.shared.faults).push(f);
    }
    /// Removes every fault not yet consumed (the sticky ones included).
    pub fn clear_faults(&self) {
        lock(&self.shared.faults).clear();
    }
    /// Closes every connection accepted so far (a target restart; the listener stays).
    pub fn drop_connections(&self) {
        for c in lock(&self.shared.conns).drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
    /// The namespace's bytes now.
    pub fn contents(&self) -> Vec<u8> {
        let st = lock(&self.shared.store);
        let mut v = vec![0u8; st.len() as usize];
        st.read(0, &mut v).expect("read the model's backing");
        v
    }
    /// Counters.
    pub fn stats(&self) -> ModelStats {
        let c = &self.shared.stats;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ModelStats {
            connections: g(&c.connections),
            io_commands: g(&c.io_commands),
            connects: g(&c.connects),
            keep_alives: g(&c.keep_alives),
            shutdowns: g(&c.shutdowns),
            r2ts: g(&c.r2ts),
            in_capsule_writes: g(&c.in_capsule_writes),
        }
    }
}

impl Drop for TargetModel {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop.
        let _ = TcpStream::connect(self.addr());
        self.drop_connections();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A write waiting for H2CData.
struct PendingWrite {
    cmd: Command,
    data: Vec<u8>,
    received: u32,
    asked: u32,
}

struct Session {
    s: TcpStream,
    sh: Arc<Shared>,
    hdgst: bool,
    ddgst: bool,
    qid: u16,
    ctrl: Option<Arc<Mutex<Ctrl>>>,
    discovery: bool,
    writes: HashMap<u16, PendingWrite>,
}

type R = std::io::Result<()>;

impl Session {
    fn new(s: TcpStream, sh: Arc<Shared>) -> Session {
        Session { s, sh, hdgst: false, ddgst: false, qid: 0, ctrl: None, discovery: false, writes: HashMap::new() }
    }

    fn take_fault(&self, f: impl Fn(&Fault) -> bool) -> Option<Fault> {
        let mut faults = lock(&self.sh.faults);
        let i = faults.iter().position(f)?;
        Some(if faults[i].sticky() { faults[i].clone() } else { faults.remove(i) })
    }

    fn serve(mut self) -> R {
        if self.take_fault(|f| *f == Fault::CloseOnAccept).is_some() {
            let _ = self.s.shutdown(Shutdown::Both);
            return Ok(());
        }
        let mut b = [0u8; pdu::IC_HLEN];
        self.s.read_exact(&mut b)?;
        let req = IcReq::parse(&b);
        if self.take_fault(|f| *f == Fault::SilentIcReq).is_some() {
            // Never answer: wait for the host to give up.
            let mut sink = [0u8; 64];
            while self.s.read(&mut sink)? > 0 {}
            return Ok(());
        }
        self.hdgst = req.hdgst;
        self.ddgst = req.ddgst;
        let resp = IcResp {
            pfv: 0,
            cpda: self.sh.cfg.cpda,
            hdgst: req.hdgst,
            ddgst: req.ddgst,
            maxh2cdata: self.sh.cfg.maxh2cdata,
        };
        self.s.write_all(&resp.encode())?;
        loop {
            let mut ch = [0u8; CH_LEN];
            if self.s.read_exact(&mut ch).is_err() {
                return Ok(());
            }
            let h = CommonHeader::parse(&ch);
            let mut hdr = vec![0u8; usize::from(h.hlen)];
            hdr[..CH_LEN].copy_from_slice(&ch);
            self.s.read_exact(&mut hdr[CH_LEN..])?;
            let mut consumed = usize::from(h.hlen);
            if h.flags & flags::HDGSTF != 0 {
                let mut d = [0u8; 4];
                self.s.read_exact(&mut d)?;
                consumed += 4;
                if u32::from_le_bytes(d) != pdu::crc32c(&hdr) {
                    return self.term(TermReq::HEADER_DIGEST_ERROR, 0, &hdr);
                }
            }
            let mut data = Vec::new();
            if h.pdo != 0 {
                let pad = usize::from(h.pdo).saturating_sub(consumed);
                let mut p = vec![0u8; pad];
                self.s.read_exact(&mut p)?;
                let dd = if h.flags & flags::DDGSTF != 0 { 4 } else { 0 };
                let dlen = (h.plen as usize).saturating_sub(usize::from(h.pdo) + dd);
                data = vec![0u8; dlen];
                self.s.read_exact(&mut data)?;
                if dd == 4 {
                    let mut d = [0u8; 4];
                    self.s.read_exact(&mut d)?;
                    if u32::from_le_bytes(d) != pdu::crc32c(&data) {
                        // A data digest error completes the command with Transient Transport Error.
                        let cid =
                            if h.pdu_type == pdu_type::CAPSULE_CMD { pdu::le16(&hdr, 10) } else { pdu::le16(&hdr, 8) };
                        self.writes.remove(&cid);
                        return self.resp(cid, Status::new(StatusCodeType::Generic, 0x22), 0);
                    }
                }
            }
            match h.pdu_type {
                pdu_type::CAPSULE_CMD => {
                    let cmd = pdu::sqe_parse(&hdr[CH_LEN..CH_LEN + 64]);
                    if !self.command(cmd, data)? {
                        return Ok(());
                    }
                }
                pdu_type::H2C_DATA => self.h2c(DataHeader::parse(&hdr), h.flags, data)?,
                pdu_type::H2C_TERM_REQ => return Ok(()),
                _ => return self.term(TermReq::INVALID_HEADER_FIELD, 0, &hdr),
            }
        }
    }

    fn term(&mut self, fes: u16, fei: u32, bad: &[u8]) -> R {
        let b = TermReq { fes, fei }.encode(pdu_type::C2H_TERM_REQ, bad);
        self.s.write_all(&b)?;
        let _ = self.s.shutdown(Shutdown::Both);
        Ok(())
    }

    /// Sends a PDU with digests as negotiated; `corrupt_h`/`corrupt_d` break the digests.
    fn send(&mut self, t: u8, fl: u8, specific: &[u8], data: Option<&[u8]>, corrupt: (bool, bool)) -> R {
        let hlen = CH_LEN + specific.len();
        // Data at the next dword (HPDA 0, what our host asks for).
        let ch = CommonHeader::framed(t, fl, hlen, data.map(<[u8]>::len), 4, (self.hdgst, self.ddgst));
        let pdo = usize::from(ch.pdo);
        let mut b = vec![0u8; hlen];
        ch.write(&mut b);
        b[CH_LEN..].copy_from_slice(specific);
        if self.hdgst {
            let d = pdu::crc32c(&b) ^ u32::from(corrupt.0);
            b.extend_from_slice(&d.to_le_bytes());
        }
        if let Some(d) = data {
            b.resize(pdo, 0);
            b.extend_from_slice(d);
            if self.ddgst {
                b.extend_from_slice(&(pdu::crc32c(d) ^ u32::from(corrupt.1)).to_le_bytes());
            }
        }
        self.s.write_all(&b)
    }

    fn resp(&mut self, cid: u16, status: Status, dw0: u32) -> R {
        self.resp64(cid, status, u64::from(dw0))
    }

    fn resp64(&mut self, cid: u16, status: Status, v: u64) -> R {
        let cqe = Completion {
            dw0: v as u32,
            dw1: (v >> 32) as u32,
            sqhd: 0,
            sqid: self.qid,
            cid,
            status: status.to_field(false),
        };
        let mut corrupt = (false, false);
        if self.qid > 0 {
            if self.take_fault(|f| *f == Fault::ShortPdu).is_some() {
                let mut b = [0u8; 24];
                CommonHeader { pdu_type: pdu_type::CAPSULE_RESP, flags: 0, hlen: 24, pdo: 0, plen: 20 }.write(&mut b);
                b[8..24].copy_from_slice(&cqe.to_bytes());
                return self.s.write_all(&b);
            }
            corrupt.0 = self.hdgst && self.take_fault(|f| *f == Fault::BadHeaderDigest).is_some();
        }
        self.send(pdu_type::CAPSULE_RESP, 0, &cqe.to_bytes(), None, corrupt)
    }

    fn data_hdr(cccid: u16, ttag: u16, offset: u32, length: u32) -> [u8; 16] {
        let mut full = [0u8; 24];
        DataHeader { cccid, ttag, offset, length }.write(&mut full);
        full[8..24].try_into().expect("16 bytes")
    }

    /// Returns false when the connection is to be closed.
    fn command(&mut self, cmd: Command, data: Vec<u8>) -> std::io::Result<bool> {
        let cid = cmd.cid();
        // As nvmet (nvmet_req_init): every command over a fabric uses SGLs, PSDT = 01b.
        if cmd.cdw0 & (3 << 14) != pdu::sgl::PSDT_SGL {
            self.resp(cid, Status::INVALID_FIELD, 0)?;
            return Ok(true);
        }
        if cmd.opc() == fabrics::FABRICS_OPCODE {
            self.fabrics(cmd, &data)?;
            return Ok(true);
        }
        if self.ctrl.is_none() {
            self.resp(cid, Status::new(StatusCodeType::CommandSpecific, 0x02), 0)?; // not connected
            return Ok(true);
        }
        if self.qid == 0 {
            self.admin(cmd)?;
            return Ok(true);
        }
        self.sh.stats.io_commands.fetch_add(1, Ordering::Relaxed);
        if self.take_fault(|f| matches!(f, Fault::Silent | Fault::Hang)).is_some() {
            return Ok(true);
        }
        if self.take_fault(|f| *f == Fault::TermReq).is_some() {
            self.term(TermReq::DATA_OUT_OF_RANGE, 0, &pdu::sqe_bytes(&cmd))?;
            return Ok(false);
        }
        if let Some(Fault::ErrorStatus(s)) = self.take_fault(|f| matches!(f, Fault::ErrorStatus(_))) {
            self.resp(cid, s, 0)?;
            return Ok(true);
        }
        let lba = u64::from(self.sh.cfg.lba_size);
        let ns_bytes = lock(&self.sh.store).len() / lba * lba;
        let (byte, len) = (cmd.slba().0 * lba, u64::from(cmd.nlb()) * lba);
        let io_cmd = matches!(cmd.opc(), spec::nvm::READ | spec::nvm::WRITE);
        if io_cmd && cmd.nsid != 1 {
            return self.resp(cid, Status::INVALID_NAMESPACE, 0).map(|()| true);
        }
        if io_cmd && byte + len > ns_bytes {
            return self.resp(cid, Status::LBA_OUT_OF_RANGE, 0).map(|()| true);
        }
        match cmd.opc() {
            spec::nvm::READ => self.read(cid, byte, len as u32),
            spec::nvm::WRITE => {
                if !self.sh.cfg.writable {
                    return self.resp(cid, Status::new(StatusCodeType::Generic, 0x20), 0).map(|()| true);
                }
                let (id, _, sgl_len) = pdu::sgl::get(&cmd);
                if id == pdu::sgl::IN_CAPSULE {
                    if data.len() as u64 != len || sgl_len as u64 != len || data.len() > self.sh.cfg.in_capsule as usize
                    {
                        return self.resp(cid, Status::new(StatusCodeType::Generic, 0x0D), 0).map(|()| true);
                        // SGL Data Block... invalid
                    }
                    self.sh.stats.in_capsule_writes.fetch_add(1, Ordering::Relaxed);
                    lock(&self.sh.store).write(byte, &data)?;
                    return self.resp(cid, Status::SUCCESS, 0).map(|()| true);
                }
                self.writes.insert(cid, PendingWrite { cmd, data: vec![0u8; len as usize], received: 0, asked: 0 });
                self.r2t(cid)?;
                Ok(true)
            }
            spec::nvm::FLUSH => {
                if let Store::File(f, _) = &*lock(&self.sh.store) {
                    f.sync_all()?;
                }
                self.resp(cid, Status::SUCCESS, 0).map(|()| true)
            }
            _ => self.resp(cid, Status::INVALID_OPCODE, 0).map(|()| true),
        }
    }

    fn read(&mut self, cid: u16, byte: u64, len: u32) -> std::io::Result<bool> {
        let mut buf = vec![0u8; len as usize];
        lock(&self.sh.store).read(byte, &mut buf)?;
        let chunk = self.sh.cfg.c2h_chunk.max(4);
        let drop_mid = self.take_fault(|f| *f == Fault::DropMidRead).is_some();
        let mut off = 0u32;
        while off < len {
            let n = chunk.min(len - off);
            let last = off + n == len;
            if drop_mid && off >= len / 2 {
                let _ = self.s.shutdown(Shutdown::Both);
                return Ok(false);
            }
            let (mut cccid, mut o, mut t) = (cid, off, pdu_type::C2H_DATA);
            let mut corrupt = (false, false);
            if self.take_fault(|f| *f == Fault::C2HWrongCid).is_some() {
                cccid = cid ^ 0x4000;
            }
            if self.take_fault(|f| *f == Fault::C2HPastBuffer).is_some() {
                o = len - n + 512;
            }
            if self.take_fault(|f| *f == Fault::UnexpectedPduType).is_some() {
                t = pdu_type::H2C_DATA;
            }
            if self.hdgst && self.take_fault(|f| *f == Fault::BadHeaderDigest).is_some() {
                corrupt.0 = true;
            }
            if self.ddgst && self.take_fault(|f| *f == Fault::BadDataDigest).is_some() {
                corrupt.1 = true;
            }
            let mut fl = if last { flags::LAST_PDU } else { 0 };
            if last && self.sh.cfg.success_flag {
                fl |= flags::SUCCESS;
            }
            let h = Self::data_hdr(cccid, 0, o, n);
            self.send(t, fl, &h, Some(&buf[off as usize..(off + n) as usize]), corrupt)?;
            off += n;
        }
        if !self.sh.cfg.success_flag {
            self.resp(cid, Status::SUCCESS, 0)?;
        }
        Ok(true)
    }

    fn r2t(&mut self, cid: u16) -> R {
        let w = self.writes.get_mut(&cid).expect("pending write");
        let total = w.data.len() as u32;
        let n = self.sh.cfg.r2t_chunk.min(total - w.asked);
        let off = w.asked;
        w.asked += n;
        let mut len = n;
        let sh = self.sh.clone();
        {
            let mut faults = lock(&sh.faults);
            if let Some(i) = faults.iter().position(|f| *f == Fault::R2tTooLong) {
                faults.remove(i);
                len = total - off + 4096;
            }
        }
        self.sh.stats.r2ts.fetch_add(1, Ordering::Relaxed);
        let h = Self::data_hdr(cid, cid, off, len);
        self.send(pdu_type::R2T, 0, &h, None, (false, false))
    }

    fn h2c(&mut self, h: DataHeader, fl: u8, data: Vec<u8>) -> R {
        let Some(w) = self.writes.get_mut(&h.cccid) else {
            return self.term(TermReq::INVALID_HEADER_FIELD, 8, &[]);
        };
        if h.offset != w.received || h.length as usize != data.len() || h.offset + h.length > w.asked {
            return self.term(TermReq::DATA_OUT_OF_RANGE, 12, &[]);
        }
        w.data[h.offset as usize..(h.offset + h.length) as usize].copy_from_slice(&data);
        w.received += h.length;
        let (received, asked, total) = (w.received, w.asked, w.data.len() as u32);
        if received == asked && fl & flags::LAST_PDU == 0 {
            return self.term(TermReq::PDU_SEQUENCE_ERROR, 1, &[]);
        }
        if received < asked {
            return Ok(());
        }
        if received < total {
            return self.r2t(h.cccid);
        }
        let w = self.writes.remove(&h.cccid).expect("pending write");
        let lba = u64::from(self.sh.cfg.lba_size);
        lock(&self.sh.store).write(w.cmd.slba().0 * lba, &w.data)?;
        self.resp(h.cccid, Status::SUCCESS, 0)
    }

    fn fabrics(&mut self, cmd: Command, data: &[u8]) -> R {
        let cid = cmd.cid();
        match fabrics::fctype(&cmd) {
            fabrics::FCTYPE_CONNECT => {
                self.sh.stats.connects.fetch_add(1, Ordering::Relaxed);
                let qid = (cmd.cdw10 >> 16) as u16;
                let sqsize = cmd.cdw11 as u16;
                let invalid =
                    |attr: u32, ipo: u32| (Status::new(StatusCodeType::CommandSpecific, 0x82), (attr << 16) | ipo);
                if data.len() != fabrics::CONNECT_DATA_LEN {
                    let (s, d) = invalid(0, 24);
                    return self.resp(cid, s, d);
                }
                let d = ConnectData::parse(data);
                if qid == 0 {
                    if let Some(Fault::RejectConnect(s)) = self.take_fault(|f| matches!(f, Fault::RejectConnect(_))) {
                        let dw0 =
                            if s.sct == StatusCodeType::CommandSpecific && s.sc == 0x82 { (1 << 16) | 256 } else { 0 };
                        return self.resp(cid, s, dw0);
                    }
                }
                let discovery = d.subnqn == fabrics::DISCOVERY_NQN;
                if !discovery && d.subnqn != self.sh.cfg.subnqn {
                    let (s, dw0) = invalid(1, 256);
                    return self.resp(cid, s, dw0);
                }
                if (qid > 0 && sqsize > self.sh.cfg.mqes) || (qid == 0 && sqsize < 31) {
                    let (s, dw0) = invalid(0, 44);
                    return self.resp(cid, s, dw0);
                }
                let cntlid = if qid == 0 {
                    let id = self.sh.next_cntlid.fetch_add(1, Ordering::Relaxed);
                    let c = Arc::new(Mutex::new(Ctrl { cc: Cc(0), csts: Csts(0) }));
                    lock(&self.sh.ctrls).insert(id, c.clone());
                    self.ctrl = Some(c);
                    id
                } else {
                    let Some(c) = lock(&self.sh.ctrls).get(&d.cntlid).cloned() else {
                        let (s, dw0) = invalid(1, 16);
                        return self.resp(cid, s, dw0);
                    };
                    if !lock(&c).csts.rdy() {
                        let (s, dw0) = invalid(1, 16);
                        return self.resp(cid, s, dw0);
                    }
                    self.ctrl = Some(c);
                    d.cntlid
                };
                self.qid = qid;
                self.discovery = discovery;
                self.resp(cid, Status::SUCCESS, u32::from(cntlid))
            }
            fabrics::FCTYPE_PROPERTY_GET => {
                let Some(c) = self.ctrl.clone() else {
                    return self.resp(cid, Status::new(StatusCodeType::CommandSpecific, 0x02), 0);
                };
                let c = lock(&c);
                let v = match cmd.cdw11 as usize {
                    spec::regs::CAP => Cap::build(self.sh.cfg.mqes, true, 1, 0, 1, 0, 0).0,
                    spec::regs::VS => 0x0002_0000,
                    spec::regs::CC => u64::from(c.cc.0),
                    spec::regs::CSTS => u64::from(c.csts.0),
                    _ => {
                        drop(c);
                        return self.resp(cid, Status::INVALID_FIELD, 0);
                    }
                };
                drop(c);
                self.resp64(cid, Status::SUCCESS, v)
            }
            fabrics::FCTYPE_PROPERTY_SET => {
                let Some(c) = self.ctrl.clone() else {
                    return self.resp(cid, Status::new(StatusCodeType::CommandSpecific, 0x02), 0);
                };
                if cmd.cdw11 as usize != spec::regs::CC {
                    return self.resp(cid, Status::INVALID_FIELD, 0);
                }
                let never = lock(&self.sh.faults).contains(&Fault::NeverReady);
                {
                    let mut c = lock(&c);
                    let cc = Cc(cmd.cdw12);
                    let rdy = cc.en() && !never;
                    let shst = if cc.shn() != 0 {
                        self.sh.stats.shutdowns.fetch_add(1, Ordering::Relaxed);
                        Shst::Complete
                    } else {
                        Shst::Normal
                    };
                    c.cc = cc;
                    c.csts = Csts::build(rdy, false, shst);
                }
                self.resp(cid, Status::SUCCESS, 0)
            }
            _ => self.resp(cid, Status::INVALID_OPCODE, 0),
        }
    }

    fn admin(&mut self, cmd: Command) -> R {
        let cid = cmd.cid();
        match cmd.opc() {
            spec::admin::IDENTIFY => {
                let mut page = vec![0u8; 4096];
                match cmd.cdw10 as u8 {
                    spec::admin::CNS_CONTROLLER => {
                        page[4..24].copy_from_slice(b"picchio-model       ");
                        page[24..64].copy_from_slice(format!("{:<40}", "picchio NVMe/TCP target model").as_bytes());
                        page[77] = self.sh.cfg.mdts;
                        page[512] = 0x66;
                        page[513] = 0x44;
                        page[514..516].copy_from_slice(&self.sh.cfg.maxcmd.to_le_bytes());
                        page[516..520].copy_from_slice(&1u32.to_le_bytes());
                        page[320..322].copy_from_slice(&10u16.to_le_bytes());
                        let nqn = if self.discovery { fabrics::DISCOVERY_NQN } else { &self.sh.cfg.subnqn };
                        page[768..768 + nqn.len()].copy_from_slice(nqn.as_bytes());
                        let ioccsz = (self.sh.cfg.in_capsule + 64) / 16;
                        page[1792..1796].copy_from_slice(&ioccsz.to_le_bytes());
                        page[1796..1800].copy_from_slice(&1u32.to_le_bytes());
                    }
                    spec::admin::CNS_NAMESPACE if cmd.nsid == 1 && !self.discovery => {
                        let lba = u64::from(self.sh.cfg.lba_size);
                        let blocks = lock(&self.sh.store).len() / lba;
                        page[0..8].copy_from_slice(&blocks.to_le_bytes());
                        page[8..16].copy_from_slice(&blocks.to_le_bytes());
                        page[16..24].copy_from_slice(&blocks.to_le_bytes());
                        let f = LbaFormat { ms: 0, lbads: self.sh.cfg.lba_size.trailing_zeros() as u8, rp: 0 };
                        page[128..132].copy_from_slice(&f.raw().to_le_bytes());
                    }
                    spec::admin::CNS_NAMESPACE => return self.resp(cid, Status::INVALID_NAMESPACE, 0),
                    _ => return self.resp(cid, Status::INVALID_FIELD, 0),
                }
                self.send_admin_data(cid, &page)
            }
            fabrics::KEEP_ALIVE => {
                self.sh.stats.keep_alives.fetch_add(1, Ordering::Relaxed);
                self.resp(cid, Status::SUCCESS, 0)
            }
            fabrics::GET_LOG_PAGE if cmd.cdw10 as u8 == fabrics::LID_DISCOVERY && self.discovery => {
                let numd = ((cmd.cdw10 >> 16) | (cmd.cdw11 << 16)) + 1;
                let off = u64::from(cmd.cdw12) | (u64::from(cmd.cdw13) << 32);
                let mut log = vec![0u8; 2048];
                log[0..8].copy_from_slice(&1u64.to_le_bytes());
                log[8..16].copy_from_slice(&1u64.to_le_bytes());
                let e = DiscoveryEntry::tcp_ipv4_nvm("127.0.0.1", &self.sh.port.to_string(), &self.sh.cfg.subnqn);
                log[1024..2048].copy_from_slice(&e.encode());
                let want = (numd * 4) as usize;
                let mut out = vec![0u8; want];
                let from = (off as usize).min(log.len());
                let n = (log.len() - from).min(want);
                out[..n].copy_from_slice(&log[from..from + n]);
                self.send_admin_data(cid, &out)
            }
            _ => self.resp(cid, Status::INVALID_OPCODE, 0),
        }
    }

    fn send_admin_data(&mut self, cid: u16, data: &[u8]) -> R {
        let h = Self::data_hdr(cid, 0, 0, data.len() as u32);
        self.send(pdu_type::C2H_DATA, flags::LAST_PDU, &h, Some(data), (false, false))?;
        self.resp(cid, Status::SUCCESS, 0)
    }
}
