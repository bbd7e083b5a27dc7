//! [`Conn`]: one NVMe/TCP connection, carrying one NVMe queue (QID 0 is the admin queue): the
//! ICReq/ICResp exchange, sending CapsuleCmd and H2CData PDUs, and receiving and checking every
//! controller-to-host PDU (type, HLEN, PDO, PLEN, digests) before its fields are used.
//!
//! Blocking sockets with a read timeout: the engine waits for readability with `poll(2)` across
//! its connections, then reads one whole PDU. C2HData payloads are read straight into the caller's
//! buffer ([`Conn::read_data`]), with no copy beyond the socket read.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::spec::{Command, Completion};

use super::error::{TcpError, TcpResult};
use super::pdu::{self, flags, pdu_type, CommonHeader, DataHeader, IcReq, IcResp, TermReq, CH_LEN, DIGEST_LEN};

/// What a controller-to-host PDU said, after its header was checked.
#[derive(Debug)]
pub(crate) enum Rx {
    /// CapsuleResp: the completion.
    Resp(Completion),
    /// C2HData: its header and flags; its `length` data bytes must be read next with
    /// [`Conn::read_data`].
    Data {
        /// CCCID, DATAO, DATAL.
        hdr: DataHeader,
        /// FLAGS (LAST_PDU, SUCCESS).
        flags: u8,
    },
    /// R2T: the controller is ready for `length` bytes at `offset` of the command's data.
    R2t(DataHeader),
}

/// Connection parameters the host asks for in its ICReq.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnParams {
    pub hdgst: bool,
    pub ddgst: bool,
    /// TCP connect and per-PDU read timeout.
    pub timeout: Duration,
}

/// One connection (one queue) to a target.
pub(crate) struct Conn {
    stream: TcpStream,
    pub addr: String,
    pub qid: u16,
    pub hdgst: bool,
    pub ddgst: bool,
    /// CPDA from ICResp: data of host-to-controller PDUs starts at a multiple of (CPDA + 1) × 4.
    pub cpda: u8,
    /// MAXH2CDATA from ICResp.
    pub maxh2cdata: u32,
    tx: Vec<u8>,
    /// Data bytes (and the digest) of the current C2HData still to read.
    pending_data: usize,
    timeout: Duration,
}

impl Conn {
    /// Connects to `addr` (`HOST:PORT`) and exchanges ICReq/ICResp for queue `qid`.
    ///
    /// # Errors
    /// [`TcpError::Connect`], [`TcpError::Timeout`], [`TcpError::Closed`], [`TcpError::Socket`],
    /// [`TcpError::Terminated`], [`TcpError::BadPdu`] or [`TcpError::IcResp`].
    pub fn open(addr: &str, qid: u16, p: ConnParams) -> TcpResult<Conn> {
        let connect_err = |source| TcpError::Connect { addr: addr.into(), qid, source };
        let addrs: Vec<_> = addr.to_socket_addrs().map_err(connect_err)?.collect();
        let mut last = io::Error::new(io::ErrorKind::NotFound, "the name resolved to no address");
        let mut stream = None;
        for a in addrs {
            match TcpStream::connect_timeout(&a, p.timeout) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let stream = stream.ok_or_else(|| connect_err(last))?;
        let step = "ICReq/ICResp";
        let sock = |e| TcpError::Socket { addr: addr.into(), qid, step: step.into(), source: e };
        stream.set_nodelay(true).map_err(sock)?;
        stream.set_read_timeout(Some(p.timeout)).map_err(sock)?;
        stream.set_write_timeout(Some(p.timeout)).map_err(sock)?;
        let mut c = Conn {
            stream,
            addr: addr.into(),
            qid,
            hdgst: false,
            ddgst: false,
            cpda: 0,
            maxh2cdata: 0,
            tx: Vec::with_capacity(256),
            pending_data: 0,
            timeout: p.timeout,
        };
        let req = IcReq { pfv: pdu::PFV_1_0, hpda: 0, hdgst: p.hdgst, ddgst: p.ddgst, maxr2t: 0 };
        c.send_raw(&req.encode(), step)?;
        let mut ch = [0u8; CH_LEN];
        c.read_exact(&mut ch, step)?;
        let h = CommonHeader::parse(&ch);
        if h.pdu_type == pdu_type::C2H_TERM_REQ {
            return Err(c.read_term(h, step));
        }
        if h.pdu_type != pdu_type::IC_RESP {
            return Err(c.bad(h.pdu_type, format!("expected ICResp (01h), got PDU type {:#04x}", h.pdu_type)));
        }
        if usize::from(h.hlen) != pdu::IC_HLEN || h.plen != pdu::IC_HLEN as u32 || h.pdo != 0 {
            return Err(c.bad(
                h.pdu_type,
                format!("HLEN {} / PLEN {} / PDO {}, expected 128 / 128 / 0", h.hlen, h.plen, h.pdo),
            ));
        }
        let mut b = [0u8; pdu::IC_HLEN];
        b[..CH_LEN].copy_from_slice(&ch);
        c.read_exact(&mut b[CH_LEN..], step)?;
        let r = IcResp::parse(&b);
        let refuse = |what: String| TcpError::IcResp { addr: addr.into(), qid, what };
        if r.pfv != pdu::PFV_1_0 {
            return Err(refuse(format!("PFV {:#x}, this host speaks PFV 0 (NVMe/TCP 1.0)", r.pfv)));
        }
        if r.maxh2cdata < pdu::MIN_MAXH2CDATA {
            return Err(refuse(format!("MAXH2CDATA {} (at least 4096)", r.maxh2cdata)));
        }
        if r.cpda > 31 {
            return Err(refuse(format!("CPDA {} (0..=31)", r.cpda)));
        }
        if (r.hdgst, r.ddgst) != (p.hdgst, p.ddgst) {
            return Err(refuse(format!(
                "digests header {} / data {}, asked for header {} / data {}",
                on(r.hdgst),
                on(r.ddgst),
                on(p.hdgst),
                on(p.ddgst)
            )));
        }
        c.hdgst = r.hdgst;
        c.ddgst = r.ddgst;
        c.cpda = r.cpda;
        // H2CData PDUs are cut at a dword multiple (older Linux targets advertised 0xFFFF).
        c.maxh2cdata = r.maxh2cdata & !3;
        Ok(c)
    }

    /// The socket's file descriptor, for `poll(2)`.
    pub fn fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.stream.as_raw_fd()
    }

    fn bad(&self, t: u8, what: String) -> TcpError {
        TcpError::BadPdu { addr: self.addr.clone(), qid: self.qid, pdu: pdu::type_name(t), what }
    }

    fn io_err(&self, e: io::Error, step: &str) -> TcpError {
        let (addr, qid, step) = (self.addr.clone(), self.qid, step.to_string());
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                TcpError::Timeout { addr, qid, step, waited_ms: self.timeout.as_millis() as u64 }
            }
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => TcpError::Closed { addr, qid, step },
            _ => TcpError::Socket { addr, qid, step, source: e },
        }
    }

    fn read_exact(&mut self, b: &mut [u8], step: &str) -> TcpResult<()> {
        self.stream.read_exact(b).map_err(|e| self.io_err(e, step))
    }

    fn send_raw(&mut self, b: &[u8], step: &str) -> TcpResult<()> {
        self.stream.write_all(b).map_err(|e| self.io_err(e, step))
    }

    /// Reads the rest of a C2HTermReq whose common header is `h` and makes it an error.
    fn read_term(&mut self, h: CommonHeader, step: &str) -> TcpError {
        if usize::from(h.hlen) != pdu::HLEN_24 || h.plen < pdu::HLEN_24 as u32 || h.plen > pdu::MAX_TERM_PLEN {
            return self.bad(h.pdu_type, format!("HLEN {} / PLEN {} of a termination request", h.hlen, h.plen));
        }
        let mut b = vec![0u8; h.plen as usize];
        if let Err(e) = self.read_exact(&mut b[CH_LEN..], step) {
            return e;
        }
        let t = TermReq::parse(&b);
        TcpError::Terminated {
            addr: self.addr.clone(),
            qid: self.qid,
            fes: t.fes,
            fes_name: TermReq::fes_name(t.fes),
            fei: t.fei,
        }
    }

    /// Sends a CapsuleCmd with `cmd` and, when given, its in-capsule data.
    ///
    /// A command without data (Property Get/Set, Keep Alive, Flush) still goes out with PSDT = 01b
    /// and a null Transport SGL Data Block descriptor (length 0), as the Linux host does: NVMe over
    /// Fabrics requires SGLs on every command, and nvmet fails a command with PSDT = 00b with
    /// Invalid Field in Command (seen against the kernel's target in tests/vm's `tcp` case).
    pub fn send_capsule(&mut self, cmd: &Command, data: Option<&[u8]>, step: &str) -> TcpResult<()> {
        let mut cmd = *cmd;
        if cmd.cdw0 & (3 << 14) == 0 {
            pdu::sgl::set(&mut cmd, pdu::sgl::TRANSPORT, 0, 0);
        }
        let sqe = pdu::sqe_bytes(&cmd);
        self.send_pdu(pdu_type::CAPSULE_CMD, 0, &sqe, data.filter(|d| !d.is_empty()), step)
    }

    /// Sends one H2CData PDU: `data` at offset `offset` of command `cccid`'s data, for the R2T
    /// with tag `ttag`; `last` on the last PDU of that R2T.
    pub fn send_h2c(
        &mut self,
        cccid: u16,
        ttag: u16,
        offset: u32,
        data: &[u8],
        last: bool,
        step: &str,
    ) -> TcpResult<()> {
        let mut h = [0u8; pdu::HLEN_24 - CH_LEN];
        let mut full = [0u8; pdu::HLEN_24];
        DataHeader { cccid, ttag, offset, length: data.len() as u32 }.write(&mut full);
        h.copy_from_slice(&full[CH_LEN..]);
        self.send_pdu(pdu_type::H2C_DATA, if last { flags::LAST_PDU } else { 0 }, &h, Some(data), step)
    }

    /// Sends a PDU: common header, `specific` (the header after the CH), header digest, padding to
    /// CPDA, data and data digest as negotiated.
    fn send_pdu(&mut self, t: u8, extra_flags: u8, specific: &[u8], data: Option<&[u8]>, step: &str) -> TcpResult<()> {
        let hlen = CH_LEN + specific.len();
        let align = (usize::from(self.cpda) + 1) * 4;
        let ch = CommonHeader::framed(t, extra_flags, hlen, data.map(<[u8]>::len), align, (self.hdgst, self.ddgst));
        let pdo = usize::from(ch.pdo);
        let mut tx = std::mem::take(&mut self.tx);
        tx.clear();
        tx.resize(hlen, 0);
        ch.write(&mut tx);
        tx[CH_LEN..hlen].copy_from_slice(specific);
        if self.hdgst {
            let d = pdu::crc32c(&tx[..hlen]);
            tx.extend_from_slice(&d.to_le_bytes());
        }
        let r = match data {
            Some(d) => {
                tx.resize(pdo, 0);
                // Small PDUs go out in one write; a large data part is written from the caller's
                // buffer after the header (no copy of the payload).
                if d.len() <= 16 << 10 {
                    tx.extend_from_slice(d);
                    if self.ddgst {
                        tx.extend_from_slice(&pdu::crc32c(d).to_le_bytes());
                    }
                    self.send_raw(&tx, step)
                } else {
                    let r = self.send_raw(&tx, step).and_then(|()| self.send_raw(d, step));
                    if self.ddgst {
                        r.and_then(|()| self.send_raw(&pdu::crc32c(d).to_le_bytes(), step))
                    } else {
                        r
                    }
                }
            }
            None => self.send_raw(&tx, step),
        };
        self.tx = tx;
        r
    }

    /// Receives the next PDU's header (and its digest, and padding up to PDO) and checks it.
    /// `step` names what the caller waits for, in errors.
    ///
    /// # Errors
    /// [`TcpError::BadPdu`] for a PDU type the host never receives (or ICResp past the exchange),
    /// an HLEN, PDO or PLEN out of range, or digest flags not as negotiated;
    /// [`TcpError::HeaderDigest`]; [`TcpError::Terminated`] for a C2HTermReq; socket errors.
    pub fn recv(&mut self, step: &str) -> TcpResult<Rx> {
        debug_assert_eq!(self.pending_data, 0, "the previous C2HData's data is read first");
        let mut hb = [0u8; pdu::HLEN_24];
        self.read_exact(&mut hb[..CH_LEN], step)?;
        let ch: [u8; CH_LEN] = hb[..CH_LEN].try_into().expect("8 bytes");
        let h = CommonHeader::parse(&ch);
        match h.pdu_type {
            pdu_type::C2H_TERM_REQ => return Err(self.read_term(h, step)),
            pdu_type::CAPSULE_RESP | pdu_type::C2H_DATA | pdu_type::R2T => {}
            t => {
                return Err(self.bad(
                    t,
                    format!(
                        "unexpected PDU type {t:#04x} ({}) while waiting for {step}: a host receives CapsuleResp, \
                         C2HData, R2T or C2HTermReq",
                        pdu::type_name(t)
                    ),
                ))
            }
        }
        let name = pdu::type_name(h.pdu_type);
        let (addr, qid) = (self.addr.clone(), self.qid);
        let bad = |what: String| TcpError::BadPdu { addr: addr.clone(), qid, pdu: name, what };
        if usize::from(h.hlen) != pdu::HLEN_24 {
            return Err(bad(format!("HLEN {} (expected 24)", h.hlen)));
        }
        let hd = if self.hdgst { DIGEST_LEN } else { 0 };
        digest_flag(h.flags, flags::HDGSTF, "HDGSTF", self.hdgst, "header").map_err(&bad)?;
        let hlen_total = (pdu::HLEN_24 + hd) as u32;
        if h.plen < hlen_total {
            return Err(bad(format!("PLEN {} is shorter than its header ({hlen_total} bytes)", h.plen)));
        }
        self.read_exact(&mut hb[CH_LEN..], step)?;
        if self.hdgst {
            let mut d = [0u8; 4];
            self.read_exact(&mut d, step)?;
            let (got, want) = (u32::from_le_bytes(d), pdu::crc32c(&hb));
            if got != want {
                return Err(TcpError::HeaderDigest { addr: self.addr.clone(), qid: self.qid, pdu: name, got, want });
            }
        }
        match h.pdu_type {
            pdu_type::CAPSULE_RESP | pdu_type::R2T => {
                if h.plen != hlen_total || h.pdo != 0 {
                    return Err(bad(format!(
                        "PLEN {} / PDO {}: a {name} has no data (PLEN {hlen_total}, PDO 0)",
                        h.plen, h.pdo
                    )));
                }
                if h.pdu_type == pdu_type::CAPSULE_RESP {
                    // The CQE is bytes 23:8.
                    Ok(Rx::Resp(pdu::cqe_parse(&hb[CH_LEN..])))
                } else {
                    Ok(Rx::R2t(DataHeader::parse(&hb)))
                }
            }
            _ => {
                let d = DataHeader::parse(&hb);
                digest_flag(h.flags, flags::DDGSTF, "DDGSTF", self.ddgst, "data").map_err(&bad)?;
                if h.flags & flags::SUCCESS != 0 && h.flags & flags::LAST_PDU == 0 {
                    return Err(bad(format!("FLAGS {:#04x}: SUCCESS without LAST_PDU", h.flags)));
                }
                let pdo = u32::from(h.pdo);
                let dd = if self.ddgst { DIGEST_LEN as u32 } else { 0 };
                if pdo < hlen_total || pdo % 4 != 0 || pdo > h.plen {
                    return Err(bad(format!(
                        "PDO {pdo}: data must start after the header ({hlen_total} bytes), dword-aligned, within PLEN {}",
                        h.plen
                    )));
                }
                if u64::from(h.plen) != u64::from(pdo) + u64::from(d.length) + u64::from(dd) {
                    return Err(bad(format!(
                        "PLEN {} does not match PDO {pdo} + DATAL {} + data digest {dd}",
                        h.plen, d.length
                    )));
                }
                if d.length == 0 {
                    return Err(bad("DATAL 0".into()));
                }
                let pad = (pdo - hlen_total) as usize;
                if pad > 0 {
                    let mut p = vec![0u8; pad];
                    self.read_exact(&mut p, step)?;
                }
                self.pending_data = d.length as usize;
                Ok(Rx::Data { hdr: d, flags: h.flags })
            }
        }
    }

    /// Reads the pending C2HData's data into `dst` (exactly its DATAL bytes) and checks the data
    /// digest. `cid` names the command in errors.
    ///
    /// # Errors
    /// [`TcpError::DataDigest`]; socket errors.
    pub fn read_data(&mut self, dst: &mut [u8], cid: u16, step: &str) -> TcpResult<()> {
        debug_assert_eq!(dst.len(), self.pending_data);
        self.pending_data = 0;
        self.read_exact(dst, step)?;
        if self.ddgst {
            let mut d = [0u8; 4];
            self.read_exact(&mut d, step)?;
            let (got, want) = (u32::from_le_bytes(d), pdu::crc32c(dst));
            if got != want {
                return Err(TcpError::DataDigest {
                    addr: self.addr.clone(),
                    qid: self.qid,
                    pdu: "C2HData",
                    cid,
                    got,
                    want,
                });
            }
        }
        Ok(())
    }

    /// Sends `cmd` (with in-capsule `data_out`) and waits for its completion, reading C2HData for
    /// it into `data_in`: the admin path (Connect, properties, Identify, Keep Alive, Get Log Page).
    /// No other command may be outstanding on the connection.
    ///
    /// # Errors
    /// Any of [`Conn::recv`]'s and [`Conn::read_data`]'s; [`TcpError::BadPdu`] for a PDU naming
    /// another CID, an R2T, or data past `data_in`.
    pub fn command(
        &mut self,
        cmd: &Command,
        data_out: Option<&[u8]>,
        mut data_in: Option<&mut [u8]>,
        step: &str,
    ) -> TcpResult<Completion> {
        self.send_capsule(cmd, data_out, step)?;
        let cid = cmd.cid();
        loop {
            match self.recv(step)? {
                Rx::Resp(c) => {
                    if c.cid != cid {
                        return Err(
                            self.bad(pdu_type::CAPSULE_RESP, format!("CID {} in reply to {step} (CID {cid})", c.cid))
                        );
                    }
                    return Ok(c);
                }
                Rx::R2t(h) => {
                    return Err(self.bad(
                        pdu_type::R2T,
                        format!("R2T for CID {} during {step}, which sent its data in the capsule", h.cccid),
                    ))
                }
                Rx::Data { hdr, flags: f } => {
                    let cap = data_in.as_deref().map_or(0, |d| d.len());
                    if hdr.cccid != cid {
                        return Err(
                            self.bad(pdu_type::C2H_DATA, format!("CCCID {} in reply to {step} (CID {cid})", hdr.cccid))
                        );
                    }
                    let end = u64::from(hdr.offset) + u64::from(hdr.length);
                    if end > cap as u64 {
                        return Err(self.bad(
                            pdu_type::C2H_DATA,
                            format!(
                                "DATAO {} + DATAL {} past the {cap} bytes {step} asked for",
                                hdr.offset, hdr.length
                            ),
                        ));
                    }
                    let dst = &mut data_in.as_deref_mut().expect("cap > 0")[hdr.offset as usize..end as usize];
                    self.read_data(dst, cid, step)?;
                    if f & flags::SUCCESS != 0 {
                        return Ok(Completion { cid, ..Completion::default() });
                    }
                }
            }
        }
    }
}

/// Checks that the digest flag `flag` (named `name`) of a PDU's `FLAGS` is set exactly when `kind`
/// (`header`, `data`) digests were negotiated (`negotiated`); else what is wrong.
fn digest_flag(flags: u8, flag: u8, name: &str, negotiated: bool, kind: &str) -> Result<(), String> {
    let set = flags & flag != 0;
    if set == negotiated {
        return Ok(());
    }
    Err(format!("FLAGS {flags:#04x}: {name} {} but {kind} digests are {}", on(set), on(negotiated)))
}

fn on(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// Waits until one of `fds` is readable or `timeout` passes; returns the readable indices.
///
/// # Errors
/// The `poll(2)` error (EINTR is retried as a timeout with nothing ready).
pub(crate) fn poll_readable(fds: &[std::os::fd::RawFd], timeout: Duration, out: &mut Vec<usize>) -> io::Result<()> {
    out.clear();
    let mut p: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: `p` is a valid, initialized array of `p.len()` pollfd structures that lives across
    // the call; poll only writes their `revents` fields.
    let n = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted { Ok(()) } else { Err(e) };
    }
    for (i, pfd) in p.iter().enumerate() {
        if pfd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
            out.push(i);
        }
    }
    Ok(())
}
