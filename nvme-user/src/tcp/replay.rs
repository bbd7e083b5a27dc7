//! Replaying a target's bytes to the initiator, for the `nvme_tcp` fuzz target and for tests.
//!
//! - [`ReplayTarget`]: a loopback listener (127.0.0.1, a free port) that accepts each connection
//!   the host opens, drains whatever the host sends, writes that connection's recorded (or fuzzed)
//!   stream of controller-to-host bytes — whatever the host asked for — and closes it, so a stream
//!   that ends is the target closing the connection: the initiator sees [`TcpError::Closed`] at
//!   once, never a wait for its timeout.
//! - [`Recorder`]: a proxy between the initiator and a real target (here the [`model`](super::model))
//!   that records each connection's controller-to-host bytes.
//! - [`run`]: parses a [`Session`], starts a [`ReplayTarget`] with its streams and drives the
//!   initiator through its public API in one fixed scenario ([`io_scenario`] or discovery); [`record`]
//!   runs the same scenario against the model through a [`Recorder`] and returns the session, so
//!   a recorded session replays byte for byte (the seeds of `fuzz/corpus/nvme_tcp/`).
//!
//! # Session format
//! Byte 0 is the options: bit 0 HDGST and bit 1 DDGST (asked for in ICReq, so the recorded
//! ICResp matches), bit 2 discovery ([`discover`] instead of [`io_scenario`]); bits 7:3 are
//! ignored. Then, for each TCP connection in the order the host opens them (admin queue, the I/O
//! queue, then those of a reconnect), a 4-byte little-endian length N and the N bytes the target
//! sends on it; a length past the end of the input takes the rest. Connections past the last
//! stream are accepted and closed at once. An empty input is a session with no streams.
//!
//! The scenario uses one I/O queue: the streams are written before the host asks, so with two the
//! host would read one connection's answers to commands it has not yet sent on it.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use picchio_core::{AlignedBuf, ByteOffset, IoQueue, ReadReq, Tag};

use super::error::TcpError;
use super::model::{ModelConfig, TargetModel};
use super::{discover, NvmeTcpQueue, TcpOptions, TcpTarget};
use crate::request::WriteReq;

/// Option bit 0: ask for header digests.
pub const OPT_HDGST: u8 = 1 << 0;
/// Option bit 1: ask for data digests.
pub const OPT_DDGST: u8 = 1 << 1;
/// Option bit 2: the discovery scenario.
pub const OPT_DISCOVERY: u8 = 1 << 2;

/// The subsystem NQN the scenario connects to (the model's default).
pub const SUBNQN: &str = "nqn.2026-12.io.picchio:model";

/// Largest LBA the I/O scenario reads and writes: beyond it the scenario stops after the
/// association, so no buffer is sized by a length the target chose.
pub const MAX_SCENARIO_LBA: u32 = 64 << 10;

/// Largest write the I/O scenario sends to get R2Ts (when the in-capsule size is below it).
const MAX_R2T_WRITE: u32 = 64 << 10;

/// A parsed session: the options byte and each connection's stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Session<'a> {
    /// The options byte (`OPT_*`).
    pub options: u8,
    /// The controller-to-host bytes of each connection, in the order the host opens them.
    pub streams: Vec<&'a [u8]>,
}

impl<'a> Session<'a> {
    /// Parses `input` (the module's session format; never fails: a short length takes the rest).
    pub fn parse(input: &'a [u8]) -> Session<'a> {
        let Some((&options, mut rest)) = input.split_first() else {
            return Session { options: 0, streams: Vec::new() };
        };
        let mut streams = Vec::new();
        while !rest.is_empty() {
            let mut len = [0u8; 4];
            let n = rest.len().min(4);
            len[..n].copy_from_slice(&rest[..n]);
            rest = &rest[n..];
            let take = (u32::from_le_bytes(len) as usize).min(rest.len());
            streams.push(&rest[..take]);
            rest = &rest[take..];
        }
        Session { options, streams }
    }

    /// Encodes `options` and `streams` in the session format.
    pub fn encode(options: u8, streams: &[Vec<u8>]) -> Vec<u8> {
        let mut out = vec![options];
        for s in streams {
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s);
        }
        out
    }
}

/// The initiator options of the scenario for an options byte: digests as asked, one I/O queue,
/// keep-alive off (no thread sends on its own clock), no pause between CSTS reads, one reconnect
/// attempt with no delay, one resubmission, a fixed host identity, and a 5 s timeout that a replay
/// never waits for (every stream ends with the connection closed).
pub fn options(opts: u8) -> TcpOptions {
    TcpOptions {
        hostnqn: "nqn.2014-08.org.nvmexpress:uuid:70696363-6869-6f2d-7265-706c61790000".into(),
        hostid: *b"picchio-replay\0\0",
        hdgst: opts & OPT_HDGST != 0,
        ddgst: opts & OPT_DDGST != 0,
        kato: Duration::ZERO,
        timeout: Duration::from_secs(5),
        io_queues: 1,
        qd: 4,
        reconnect_attempts: 0,
        reconnect_delay: Duration::ZERO,
        max_retries: 1,
        csts_poll: Duration::ZERO,
    }
}

/// How one step of the scenario ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepError {
    /// The error's kind ([`TcpError::kind`] for the initiator's errors).
    pub kind: io::ErrorKind,
    /// The error and its causes.
    pub message: String,
}

/// One step of the scenario: its name and result (for reads, the CRC32C of the bytes read; for
/// discovery, the number of entries).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// `connect`, `read`, `read pair`, `write in capsule`, `write after R2T`, `flush`, `discover`.
    pub what: &'static str,
    /// `Ok` with the step's value, or the error.
    pub result: Result<u64, StepError>,
}

/// Every step the scenario took, in order. It stops at the first failing step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// The steps.
    pub steps: Vec<Step>,
}

impl Outcome {
    /// The result of the first step named `what`, if it ran.
    pub fn step(&self, what: &str) -> Option<&Result<u64, StepError>> {
        self.steps.iter().find(|s| s.what == what).map(|s| &s.result)
    }
    /// Whether every step named `what` ran and succeeded (false when none ran).
    pub fn ok(&self, what: &str) -> bool {
        let mut any = false;
        for s in self.steps.iter().filter(|s| s.what == what) {
            any = true;
            if s.result.is_err() {
                return false;
            }
        }
        any
    }
    /// The first error, if a step failed.
    pub fn error(&self) -> Option<&StepError> {
        self.steps.iter().find_map(|s| s.result.as_ref().err())
    }
    fn push(&mut self, what: &'static str, r: Result<u64, StepError>) -> bool {
        let ok = r.is_ok();
        self.steps.push(Step { what, result: r });
        ok
    }
}

fn tcp_err(e: &TcpError) -> StepError {
    StepError { kind: e.kind(), message: picchio_core::error::chain(e).to_string() }
}

fn io_err(e: &io::Error) -> StepError {
    StepError { kind: e.kind(), message: picchio_core::error::chain(e).to_string() }
}

/// Replays `input` (the session format) to the initiator and returns what the scenario did.
///
/// # Panics
/// When the loopback listener cannot be bound or its threads started (the machine, not the
/// input).
pub fn run(input: &[u8]) -> Outcome {
    let s = Session::parse(input);
    let target = ReplayTarget::start(s.streams.iter().map(|b| b.to_vec()).collect()).expect("loopback replay target");
    let out = scenario(s.options, &target.addr(), SUBNQN);
    drop(target);
    out
}

/// Runs the scenario of the options byte `opts` against the target at `addr` (subsystem `subnqn`).
pub fn scenario(opts: u8, addr: &str, subnqn: &str) -> Outcome {
    let o = options(opts);
    let mut out = Outcome::default();
    if opts & OPT_DISCOVERY != 0 {
        let r = discover(addr, &o).map(|e| e.len() as u64).map_err(|e| tcp_err(&e));
        out.push("discover", r);
        return out;
    }
    let target = TcpTarget { addr: addr.into(), subnqn: subnqn.into(), nsid: 1 };
    match NvmeTcpQueue::connect(target, o) {
        Ok(mut q) => {
            out.push("connect", Ok(q.namespace().blocks));
            io_scenario(&mut q, &mut out);
        }
        Err(e) => {
            out.push("connect", Err(tcp_err(&e)));
        }
    }
    out
}

/// The I/O part of the scenario on a connected queue: a read of 2 LBAs at LBA 0; a read of 1 LBA at
/// LBA 2 and one of 4 LBAs at LBA 3 in flight together; a write of 1 LBA at LBA 8 (in the capsule
/// when it fits); a write of one LBA more than the in-capsule size at LBA 16 (after R2Ts), when
/// that is at most 64 KiB; a Flush. Skipped when the LBA is over [`MAX_SCENARIO_LBA`].
pub fn io_scenario(q: &mut NvmeTcpQueue, out: &mut Outcome) {
    let lba = q.namespace().lba_size;
    if lba > MAX_SCENARIO_LBA {
        out.push(
            "read",
            Err(StepError {
                kind: io::ErrorKind::Unsupported,
                message: format!("{lba}-byte LBAs: the scenario reads LBAs of at most {MAX_SCENARIO_LBA} bytes"),
            }),
        );
        return;
    }
    let at = |k: u32| ByteOffset(u64::from(k) * u64::from(lba));
    let r = picchio_core::io::read_blocking(q, at(0).0, 2 * lba)
        .map(|b| u64::from(super::pdu::crc32c(&b.as_slice()[..2 * lba as usize])))
        .map_err(|e| io_err(&e));
    if !out.push("read", r) {
        return;
    }
    // Two reads in flight together (one command each, or more when MDTS splits the second).
    for (tag, k, n) in [(1u64, 2u32, 1u32), (2, 3, 4)] {
        let buf = match AlignedBuf::new((n * lba) as usize, 4096) {
            Ok(b) => b,
            Err(e) => {
                out.push("read pair", Err(StepError { kind: io::ErrorKind::OutOfMemory, message: e.to_string() }));
                return;
            }
        };
        q.submit(ReadReq { offset: at(k), len: n * lba, buf, tag: Tag(tag) });
    }
    let mut done = Vec::new();
    while done.len() < 2 {
        q.reap(2 - done.len(), &mut done);
    }
    done.sort_by_key(|c| c.tag.0);
    let mut crc = 0u64;
    for c in &done {
        match &c.result {
            Ok(n) => crc = (crc << 32) | u64::from(super::pdu::crc32c(&c.buf.as_slice()[..*n as usize])),
            Err(e) => {
                out.push("read pair", Err(io_err(e)));
                return;
            }
        }
    }
    out.push("read pair", Ok(crc));
    if !write(q, out, "write in capsule", at(8), lba) {
        return;
    }
    let big = (q.in_capsule_bytes() / lba + 1).saturating_mul(lba);
    if big <= MAX_R2T_WRITE && !write(q, out, "write after R2T", at(16), big) {
        return;
    }
    out.push("flush", q.flush().map(|()| 0).map_err(|e| io_err(&e)));
}

/// Writes `len` bytes of a pattern at `offset`; pushes the step; returns whether it succeeded.
fn write(q: &mut NvmeTcpQueue, out: &mut Outcome, what: &'static str, offset: ByteOffset, len: u32) -> bool {
    let mut buf = match AlignedBuf::new(len as usize, 4096) {
        Ok(b) => b,
        Err(e) => return out.push(what, Err(StepError { kind: io::ErrorKind::OutOfMemory, message: e.to_string() })),
    };
    for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    q.submit_write(WriteReq { offset, len, buf, tag: Tag(3) });
    let mut done = Vec::new();
    while done.is_empty() {
        q.reap(1, &mut done);
    }
    let r = match &done[0].result {
        Ok(n) => Ok(u64::from(*n)),
        Err(e) => Err(io_err(e)),
    };
    out.push(what, r)
}

/// Records the scenario of `opts` against a model target with `cfg` (its subsystem NQN set to
/// [`SUBNQN`]) through a [`Recorder`]: returns the session (the module's format) and the outcome.
///
/// # Errors
/// Starting the model or the recorder.
pub fn record(opts: u8, mut cfg: ModelConfig) -> io::Result<(Vec<u8>, Outcome)> {
    cfg.subnqn = SUBNQN.into();
    let model = TargetModel::start(cfg)?;
    let rec = Recorder::start(&model.addr())?;
    let out = scenario(opts, &rec.addr(), SUBNQN);
    let streams = rec.finish();
    drop(model);
    Ok((Session::encode(opts, &streams), out))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Accepts connections on `listener` until `stop`, handing each (with its index) to `serve`;
/// returns the threads `serve` started.
fn accept_loop(
    listener: TcpListener,
    stop: Arc<AtomicBool>,
    accepted: Arc<AtomicUsize>,
    mut serve: impl FnMut(usize, TcpStream) -> Vec<JoinHandle<()>> + Send + 'static,
) -> io::Result<JoinHandle<Vec<JoinHandle<()>>>> {
    std::thread::Builder::new().name("nvme-tcp-replay".into()).spawn(move || {
        let mut threads = Vec::new();
        while let Ok((s, _)) = listener.accept() {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            let k = accepted.fetch_add(1, Ordering::SeqCst);
            threads.extend(serve(k, s));
        }
        threads
    })
}

/// Stops an accept loop: sets `stop`, wakes the blocked `accept` with a connection of its own,
/// and joins it and every thread it started.
fn stop_loop(addr: SocketAddr, stop: &AtomicBool, thread: Option<JoinHandle<Vec<JoinHandle<()>>>>) {
    stop.store(true, Ordering::SeqCst);
    let _ = TcpStream::connect(addr);
    if let Some(t) = thread {
        for c in t.join().unwrap_or_default() {
            let _ = c.join();
        }
    }
}

/// A loopback target that plays streams of bytes back (module docs). Dropping it stops the
/// listener and waits for each connection's thread, which ends when the host closes its side.
pub struct ReplayTarget {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accepted: Arc<AtomicUsize>,
    thread: Option<JoinHandle<Vec<JoinHandle<()>>>>,
}

impl ReplayTarget {
    /// Binds 127.0.0.1 on a free port; connection k (from 0, in accept order) gets `streams[k]`,
    /// later ones nothing.
    ///
    /// # Errors
    /// Binding the socket or starting its thread.
    pub fn start(streams: Vec<Vec<u8>>) -> io::Result<ReplayTarget> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let (stop, accepted) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
        let mut streams = streams.into_iter();
        let thread = accept_loop(listener, stop.clone(), accepted.clone(), move |_, s| {
            let bytes = streams.next().unwrap_or_default();
            std::thread::Builder::new()
                .name("nvme-tcp-replay-conn".into())
                .spawn(move || play(s, &bytes))
                .map_or_else(|_| Vec::new(), |t| vec![t])
        })?;
        Ok(ReplayTarget { addr, stop, accepted, thread: Some(thread) })
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

/// Writes `bytes` to the host, closes the sending side (the host reads end-of-stream after them),
/// then reads and drops what the host sends until it closes: a socket closed with unread bytes
/// would reset the connection, and the host could lose the end of the stream.
fn play(mut s: TcpStream, bytes: &[u8]) {
    let _ = s.write_all(bytes);
    let _ = s.shutdown(Shutdown::Write);
    let mut sink = [0u8; 4096];
    while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
}

impl Drop for ReplayTarget {
    fn drop(&mut self) {
        stop_loop(self.addr, &self.stop, self.thread.take());
    }
}

/// One connection's target-to-host bytes, appended to as they pass the proxy.
type Record = Arc<Mutex<Vec<u8>>>;

/// A recording proxy: each connection accepted is forwarded to `upstream`, and the bytes
/// `upstream` sends on it are kept ([`Recorder::finish`]).
pub struct Recorder {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    records: Arc<Mutex<Vec<Record>>>,
    thread: Option<JoinHandle<Vec<JoinHandle<()>>>>,
}

impl Recorder {
    /// Binds 127.0.0.1 on a free port, forwarding to `upstream` (`HOST:PORT`).
    ///
    /// # Errors
    /// Binding the socket or starting its thread.
    pub fn start(upstream: &str) -> io::Result<Recorder> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let records: Arc<Mutex<Vec<Record>>> = Arc::new(Mutex::new(Vec::new()));
        let (up, recs) = (upstream.to_string(), records.clone());
        let thread = accept_loop(listener, stop.clone(), Arc::new(AtomicUsize::new(0)), move |_, host| {
            let rec = Arc::new(Mutex::new(Vec::new()));
            lock(&recs).push(rec.clone());
            let Ok(target) = TcpStream::connect(&up) else { return Vec::new() };
            let (Ok(host2), Ok(target2)) = (host.try_clone(), target.try_clone()) else { return Vec::new() };
            let h2t = std::thread::spawn(move || forward(host, target, None));
            let t2h = std::thread::spawn(move || forward(target2, host2, Some(rec)));
            vec![h2t, t2h]
        })?;
        Ok(Recorder { addr, stop, records, thread: Some(thread) })
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// Stops accepting, waits until every connection has ended (the host closed it: call this after
    /// the initiator is done), and returns each connection's target-to-host bytes in accept order.
    pub fn finish(mut self) -> Vec<Vec<u8>> {
        stop_loop(self.addr, &self.stop, self.thread.take());
        lock(&self.records).iter().map(|r| std::mem::take(&mut *lock(r))).collect()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        stop_loop(self.addr, &self.stop, self.thread.take());
    }
}

/// Copies `from` to `to` until `from` ends, keeping a copy in `rec`; then shuts both down, so the
/// other direction of the pair ends too.
fn forward(mut from: TcpStream, to: TcpStream, rec: Option<Record>) {
    let mut to = to;
    let mut b = vec![0u8; 64 << 10];
    loop {
        match from.read(&mut b) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if let Some(r) = &rec {
                    lock(r).extend_from_slice(&b[..n]);
                }
                if to.write_all(&b[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

/// The sessions the `nvme_tcp` seed corpus is recorded from (name, options byte, model): the I/O
/// scenario with 512-byte LBAs, with header and data digests, with 4 KiB LBAs where MDTS (8 KiB)
/// splits a read, every read arrives in 4 KiB C2HData PDUs ending with the
/// SUCCESS flag and a write is asked for in two R2Ts, with header digests and CPDA 1; and
/// discovery, without and with digests.
pub fn seed_sessions() -> Vec<(&'static str, u8, ModelConfig)> {
    let bytes: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(7) >> 3) as u8).collect();
    let m512 = ModelConfig::memory(bytes.clone(), 512);
    let m4k_split = ModelConfig {
        mdts: 1,
        c2h_chunk: 4096,
        success_flag: true,
        maxh2cdata: 4096,
        in_capsule: 4096,
        r2t_chunk: 4096,
        ..ModelConfig::memory(bytes.clone(), 4096)
    };
    vec![
        ("io_512", 0, m512.clone()),
        ("io_512_digests", OPT_HDGST | OPT_DDGST, m512.clone()),
        ("io_4k_split_success_r2t", 0, m4k_split),
        ("io_512_hdgst_cpda1", OPT_HDGST, ModelConfig { cpda: 1, ..m512.clone() }),
        ("discovery", OPT_DISCOVERY, m512.clone()),
        ("discovery_digests", OPT_DISCOVERY | OPT_HDGST | OPT_DDGST, m512),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every step of the scenario of `opts` ran and succeeded.
    fn assert_deep(name: &str, opts: u8, out: &Outcome) {
        assert!(out.error().is_none(), "{name}: {out:#?}");
        if opts & OPT_DISCOVERY != 0 {
            assert_eq!(out.step("discover"), Some(&Ok(1)), "{name}: one discovery log entry");
        } else {
            for s in ["connect", "read", "read pair", "write in capsule", "write after R2T", "flush"] {
                assert!(out.ok(s), "{name}: step {s} did not succeed: {out:#?}");
            }
        }
    }

    #[test]
    fn a_recorded_session_replays_to_the_same_outcome() {
        for (name, opts, cfg) in seed_sessions() {
            let (bytes, recorded) = record(opts, cfg).unwrap();
            assert_deep(name, opts, &recorded);
            assert!(bytes.len() < 64 << 10, "{name}: {} bytes", bytes.len());
            // The same reads (CRC32C of the data), writes and flush, from the recording alone.
            assert_eq!(run(&bytes), recorded, "{name}");
        }
    }

    #[test]
    fn the_checked_in_seeds_replay_to_a_successful_read() {
        // Compiled in, so the test binary runs away from its source tree too (the tests/vm guests).
        // Regenerate them with `cargo run -p picchio-nvme --example nvme_tcp_seeds -- fuzz/corpus/nvme_tcp`.
        macro_rules! seed {
            ($name:literal) => {
                ($name, &include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/corpus/nvme_tcp/", $name))[..])
            };
        }
        let checked_in: [(&str, &[u8]); 6] = [
            seed!("io_512"),
            seed!("io_512_digests"),
            seed!("io_4k_split_success_r2t"),
            seed!("io_512_hdgst_cpda1"),
            seed!("discovery"),
            seed!("discovery_digests"),
        ];
        let sessions = seed_sessions();
        assert_eq!(
            sessions.iter().map(|s| s.0).collect::<Vec<_>>(),
            checked_in.iter().map(|s| s.0).collect::<Vec<_>>(),
            "every recorded session is checked in"
        );
        for ((name, opts, _), (_, bytes)) in sessions.into_iter().zip(checked_in) {
            assert_eq!(bytes[0], opts, "{name}: options byte");
            assert_deep(name, opts, &run(bytes));
        }
    }

    #[test]
    fn a_stream_cut_anywhere_ends_in_closed_at_once_never_a_timeout() {
        let (bytes, _) = record(OPT_HDGST | OPT_DDGST, ModelConfig::memory(vec![9; 64 << 10], 512)).unwrap();
        let s = Session::parse(&bytes);
        assert_eq!(s.streams.len(), 2, "admin and one I/O queue");
        // The admin queue's last three answers are the shutdown's (CC, CC.SHN, CSTS), whose
        // failure is only logged; cut before them.
        let shutdown = 3 * (24 + 4);
        for (k, stream) in s.streams.iter().enumerate() {
            let end = if k == 0 { stream.len() - shutdown } else { stream.len() };
            let mut cuts: Vec<usize> = (0..end).step_by(61).collect();
            cuts.extend([1, 7, 8, 127, 128, 129, end - 1]);
            for cut in cuts {
                let mut streams: Vec<Vec<u8>> = s.streams.iter().map(|b| b.to_vec()).collect();
                streams[k].truncate(cut);
                streams.truncate(k + 1);
                let out = run(&Session::encode(s.options, &streams));
                let e = out.error().unwrap_or_else(|| panic!("stream {k} cut at {cut}: no error: {out:#?}"));
                assert_ne!(e.kind, io::ErrorKind::TimedOut, "stream {k} cut at {cut}: {}", e.message);
                assert!(e.message.contains("closed the connection"), "stream {k} cut at {cut}: {}", e.message);
            }
        }
    }

    #[test]
    fn the_session_format_round_trips_and_a_long_length_takes_the_rest() {
        let streams = vec![b"abc".to_vec(), Vec::new(), vec![7; 300]];
        let enc = Session::encode(OPT_DISCOVERY, &streams);
        let s = Session::parse(&enc);
        assert_eq!(s.options, OPT_DISCOVERY);
        assert_eq!(s.streams, vec![&b"abc"[..], &[][..], &[7u8; 300][..]]);
        assert_eq!(Session::parse(&[]), Session { options: 0, streams: vec![] });
        assert_eq!(Session::parse(&[1, 0xFF, 0xFF, 0xFF, 0xFF, 5, 6]).streams, vec![&[5u8, 6][..]]);
        assert_eq!(Session::parse(&[1, 2, 0]).streams, vec![&[][..]]);
    }

    #[test]
    fn an_empty_session_fails_the_connect_cleanly() {
        for opts in [0, OPT_DISCOVERY] {
            let out = run(&[opts]);
            let e = out.error().expect("an error");
            assert_eq!(e.kind, io::ErrorKind::ConnectionAborted, "{}", e.message);
        }
    }
}
