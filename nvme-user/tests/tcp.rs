//! The NVMe/TCP initiator against the in-process target model (`picchio_nvme::tcp::model`) over a
//! real loopback TCP socket: reads, writes (in-capsule and R2T), digests, several queues, discovery,
//! and every fault the model injects, each with the typed error (or the recovery) expected.
#![cfg(target_os = "linux")]

use std::time::Duration;

use picchio_core::io::read_blocking;
use picchio_core::{AlignedBuf, ByteOffset, Completion, IoQueue, ReadReq, Tag};
use picchio_nvme::request::BadRequest;
use picchio_nvme::sim::SimConfig;
use picchio_nvme::spec::{Status, StatusCodeType};
use picchio_nvme::tcp::fabrics::connect_status;
use picchio_nvme::tcp::model::{Fault, ModelConfig, TargetModel};
use picchio_nvme::tcp::{discover, NvmeTcpQueue, TcpError, TcpOptions, TcpTarget};
use picchio_nvme::{NvmWriteQueue, NvmeQueue, NvmeQueueOptions, WriteReq};

/// 4 MiB of a position-dependent pattern.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i / 512) as u8) ^ (i as u8).wrapping_mul(31)).collect()
}

fn opts() -> TcpOptions {
    TcpOptions { timeout: Duration::from_secs(20), reconnect_delay: Duration::from_millis(10), ..TcpOptions::default() }
}

fn model(lba: u32) -> (TargetModel, Vec<u8>) {
    let data = pattern(4 << 20);
    (TargetModel::start(ModelConfig::memory(data.clone(), lba)).unwrap(), data)
}

fn read(q: &mut NvmeTcpQueue, off: u64, len: u32) -> std::io::Result<Vec<u8>> {
    read_blocking(q, off, len).map(|b| b.as_slice()[..len as usize].to_vec())
}

/// The typed error inside a failed read.
fn read_err(q: &mut NvmeTcpQueue, off: u64, len: u32) -> std::io::Error {
    read_blocking(q, off, len).expect_err("the read fails")
}

/// An [`NvmeTcpQueue`] that owns the target model serving its file: the queue is shut down and
/// dropped first, then the model; then the file must hold exactly the bytes it held at open (a read
/// never writes the namespace).
struct TcpEngine {
    q: Option<NvmeTcpQueue>,
    model: Option<TargetModel>,
    path: std::path::PathBuf,
    original: Vec<u8>,
}

impl TcpEngine {
    fn q(&self) -> &NvmeTcpQueue {
        self.q.as_ref().expect("open")
    }
    fn q_mut(&mut self) -> &mut NvmeTcpQueue {
        self.q.as_mut().expect("open")
    }
}

impl IoQueue for TcpEngine {
    fn block_size(&self) -> u32 {
        self.q().block_size()
    }
    fn submit(&mut self, req: ReadReq) {
        self.q_mut().submit(req)
    }
    fn reap(&mut self, min: usize, out: &mut Vec<Completion>) -> usize {
        self.q_mut().reap(min, out)
    }
    fn in_flight(&self) -> usize {
        self.q().in_flight()
    }
    fn describe(&self) -> String {
        self.q().describe()
    }
}

impl Drop for TcpEngine {
    fn drop(&mut self) {
        drop(self.q.take());
        drop(self.model.take());
        if !std::thread::panicking() {
            let now = std::fs::read(&self.path).unwrap();
            assert!(now == self.original, "{}: a read changed the namespace", self.path.display());
        }
    }
}

/// Lends the conformance suite the NVMe/TCP initiator against the in-process target model with
/// `lba`-byte LBAs, over loopback TCP; the namespace is the suite's file. Per-command timeout 60 s:
/// the suite checks reads, not timeouts.
fn with_tcp(lba: u32, f: impl FnOnce(&picchio_testkit::conformance::Engine)) {
    use picchio_testkit::conformance::{Engine, Eof, Misalign};
    let dir = tempfile::tempdir().unwrap();
    let open = move |p: &std::path::Path, qd: u32| -> Box<dyn IoQueue> {
        let original = std::fs::read(p).unwrap();
        let m = TargetModel::start(ModelConfig::file(p, lba)).unwrap();
        let o = TcpOptions { qd: qd as u16, timeout: Duration::from_secs(60), ..opts() };
        let q = NvmeTcpQueue::connect(m.target(1), o).unwrap();
        assert_eq!((q.block_size(), q.queue_depth()), (lba, qd as u16));
        Box::new(TcpEngine { q: Some(q), model: Some(m), path: p.to_path_buf(), original })
    };
    let misaligned = |e: &std::io::Error, rule: Misalign| {
        let Some(BadRequest::Misaligned { offset, len, .. }) = BadRequest::of(e) else { panic!("{e}") };
        match rule {
            Misalign::Offset(o) => assert_eq!(*offset, o),
            Misalign::Length(l) => assert_eq!(*len, l),
            Misalign::Buffer => panic!("NVMe/TCP takes any buffer address: {e}"),
        }
        assert!(e.to_string().contains("not aligned"), "{e}");
    };
    let past_end = |e: &std::io::Error, offset: u64, size: u64| {
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        let Some(BadRequest::PastEnd { offset: o, bytes, namespace, .. }) = BadRequest::of(e) else { panic!("{e}") };
        assert_eq!((*o, *bytes), (offset, size));
        assert!(namespace.starts_with("nvme-tcp://127.0.0.1:") && namespace.ends_with("/1"), "{namespace}");
    };
    let too_small = |e: &std::io::Error, buf_len: usize| {
        assert!(
            matches!(BadRequest::of(e), Some(BadRequest::BufferTooSmall { buf_len: b, .. }) if *b == buf_len),
            "{e}"
        );
    };
    f(&Engine {
        name: &format!("nvme-tcp(model, {lba}-byte LBA)"),
        dir: dir.path(),
        open: &open,
        align: lba,
        mem_align: 1,
        eof: Eof::Refused,
        misaligned: &misaligned,
        past_end: &past_end,
        too_small: &too_small,
    });
}

fn with_tcp_512(f: impl FnOnce(&picchio_testkit::conformance::Engine)) {
    with_tcp(512, f)
}

fn with_tcp_4096(f: impl FnOnce(&picchio_testkit::conformance::Engine)) {
    with_tcp(4096, f)
}

mod conformance_512 {
    picchio_testkit::conformance_tests!(super::with_tcp_512, aligned);
}

mod conformance_4096 {
    picchio_testkit::conformance_tests!(super::with_tcp_4096, aligned);
}

#[test]
fn reads_land_in_the_buffer_for_both_lba_sizes_and_digest_settings() {
    for lba in [512, 4096] {
        for (hdgst, ddgst) in [(false, false), (true, false), (false, true), (true, true)] {
            let (m, data) = model(lba);
            let mut q = NvmeTcpQueue::connect(m.target(1), TcpOptions { hdgst, ddgst, ..opts() }).unwrap();
            assert_eq!((q.namespace().lba_size, q.namespace().bytes()), (lba, 4 << 20));
            assert_eq!(q.block_size(), lba);
            // Several C2HData PDUs per command (128 KiB each), and an MDTS split (1 MiB commands).
            let got = read(&mut q, 8192, 3 << 20).unwrap();
            assert_eq!(got, data[8192..8192 + (3 << 20)], "lba {lba} hdgst {hdgst} ddgst {ddgst}");
            assert!(q.describe().starts_with("nvme-tcp(127.0.0.1:"), "{}", q.describe());
        }
    }
}

#[test]
fn success_flag_completes_reads_without_a_capsule_resp() {
    let data = pattern(1 << 20);
    let m = TargetModel::start(ModelConfig { success_flag: true, ..ModelConfig::memory(data.clone(), 512) }).unwrap();
    let mut q = NvmeTcpQueue::connect(m.target(1), opts()).unwrap();
    assert_eq!(read(&mut q, 0, 1 << 20).unwrap(), data);
}

#[test]
fn several_queues_at_depth_complete_every_read() {
    let (m, data) = model(4096);
    let mut q = NvmeTcpQueue::connect(m.target(1), TcpOptions { io_queues: 3, qd: 4, ..opts() }).unwrap();
    assert_eq!(q.queue_depth(), 4);
    for i in 0..48u64 {
        let buf = AlignedBuf::new(65536, 4096).unwrap();
        q.submit(ReadReq { offset: ByteOffset((i * 65536) % (4 << 20)), len: 65536, buf, tag: Tag(i) });
    }
    let mut out: Vec<Completion> = Vec::new();
    while out.len() < 48 {
        q.reap(1, &mut out);
    }
    for c in out {
        let off = ((c.tag.0 * 65536) % (4 << 20)) as usize;
        assert_eq!(c.result.unwrap(), 65536);
        assert_eq!(&c.buf.as_slice()[..65536], &data[off..off + 65536], "tag {}", c.tag.0);
    }
    assert_eq!(q.stats().commands, 48);
}

#[test]
fn queue_depth_is_clamped_to_maxcmd_and_mqes() {
    let m = TargetModel::start(ModelConfig { maxcmd: 6, ..ModelConfig::memory(vec![0; 1 << 20], 512) }).unwrap();
    let q = NvmeTcpQueue::connect(m.target(1), TcpOptions { qd: 64, ..opts() }).unwrap();
    assert_eq!(q.queue_depth(), 6);
    let m = TargetModel::start(ModelConfig { mqes: 7, ..ModelConfig::memory(vec![0; 1 << 20], 512) }).unwrap();
    let q = NvmeTcpQueue::connect(m.target(1), TcpOptions { qd: 64, ..opts() }).unwrap();
    assert_eq!(q.queue_depth(), 7, "CAP.MQES 7: 8 entries, 7 usable");
}

#[test]
fn writes_in_the_capsule_and_after_r2t_then_flush() {
    for ddgst in [false, true] {
        let (m, mut data) = model(512);
        let mut q = NvmeTcpQueue::connect(m.target(1), TcpOptions { ddgst, hdgst: ddgst, ..opts() }).unwrap();
        assert_eq!(q.in_capsule_bytes(), 8192);
        // 4 KiB: in the capsule. 1 MiB: four 256 KiB R2Ts, each answered with 32 KiB H2CData PDUs.
        for (off, len, fill) in [(4096usize, 4096usize, 0xA5u8), (1 << 20, 1 << 20, 0x3C)] {
            let mut buf = AlignedBuf::new(len, 4096).unwrap();
            buf.as_mut_slice()[..len].fill(fill);
            q.submit_write(WriteReq { offset: ByteOffset(off as u64), len: len as u32, buf, tag: Tag(off as u64) });
            data[off..off + len].fill(fill);
        }
        let mut out = Vec::new();
        while out.len() < 2 {
            q.reap(1, &mut out);
        }
        for c in &out {
            assert!(c.result.is_ok(), "{:?}", c.result);
        }
        q.flush().unwrap();
        let s = m.stats();
        assert_eq!((s.in_capsule_writes, s.r2ts), (1, 4));
        assert_eq!(q.stats().r2ts, 4);
        assert_eq!(m.contents(), data);
        assert_eq!(read(&mut q, 0, 4 << 20).unwrap(), data);
    }
}

#[test]
fn a_file_backed_model_serves_and_keeps_writes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ns1");
    std::fs::write(&path, pattern(1 << 20)).unwrap();
    let m = TargetModel::start(ModelConfig::file(&path, 4096)).unwrap();
    let mut q = NvmeTcpQueue::connect(m.target(1), opts()).unwrap();
    let mut buf = AlignedBuf::new(8192, 4096).unwrap();
    buf.as_mut_slice().fill(7);
    q.submit_write(WriteReq { offset: ByteOffset(0), len: 8192, buf, tag: Tag(1) });
    let mut out = Vec::new();
    q.reap(1, &mut out);
    out[0].result.as_ref().unwrap();
    q.flush().unwrap();
    assert_eq!(&std::fs::read(&path).unwrap()[..8192], &[7u8; 8192][..]);
}

#[test]
fn shutdown_on_drop_and_keep_alive() {
    let (m, _) = model(512);
    let q = NvmeTcpQueue::connect(m.target(1), TcpOptions { kato: Duration::from_millis(200), ..opts() }).unwrap();
    // Keep Alive every KATO / 2: wait (bounded) until the model has seen two.
    let t0 = std::time::Instant::now();
    while m.stats().keep_alives < 2 && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(m.stats().keep_alives >= 2);
    drop(q);
    assert_eq!(m.stats().shutdowns, 1, "CC.SHN = 01b on drop");
}

#[test]
fn discovery_lists_the_subsystem() {
    let (m, _) = model(512);
    let entries = discover(&m.addr(), &opts()).unwrap();
    assert_eq!(entries.len(), 1);
    let e = &entries[0];
    assert_eq!((e.trtype_name().as_str(), e.traddr.as_str(), e.subnqn.as_str()), ("tcp", "127.0.0.1", m.subnqn()));
    assert_eq!(e.trsvcid, m.addr().rsplit(':').next().unwrap());
}

#[test]
fn bad_requests_complete_with_invalid_input() {
    let (m, _) = model(4096);
    let mut q = NvmeTcpQueue::connect(m.target(1), opts()).unwrap();
    for (off, len) in [(512, 4096), (0, 100), (4 << 20, 4096)] {
        let e = read_err(&mut q, off, len);
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{off} {len}: {e}");
    }
}

// ---- connection set-up failures ----

#[test]
fn a_refused_connection_names_the_address() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let t = TcpTarget { addr: addr.clone(), subnqn: "nqn.x".into(), nsid: 1 };
    let e = NvmeTcpQueue::connect(t, opts()).unwrap_err();
    assert!(matches!(&e, TcpError::Connect { qid: 0, .. }), "{e:?}");
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
    assert!(e.to_string().contains(&addr), "{e}");
}

#[test]
fn a_wrong_nqn_is_connect_invalid_parameters_on_the_subnqn() {
    let (m, _) = model(512);
    let t = TcpTarget { subnqn: "nqn.2026-12.io.picchio:nope".into(), ..m.target(1) };
    let e = NvmeTcpQueue::connect(t, opts()).unwrap_err();
    let TcpError::ConnectRejected { status, iattr, ipo, .. } = &e else { panic!("{e:?}") };
    assert_eq!((status.sc, *iattr, *ipo), (0x82, Some(1), Some(256)));
    assert!(
        e.to_string().contains("Connect Invalid Parameters") && e.to_string().contains("nqn.2026-12.io.picchio:nope")
    );
}

#[test]
fn every_connect_status_is_a_typed_rejection_with_its_spec_name() {
    let names = [
        "Connect Incompatible Format",
        "Connect Controller Busy",
        "Connect Invalid Parameters",
        "Connect Restart Discovery",
        "Connect Invalid Host",
        "Invalid Queue Type",
    ];
    let (m, _) = model(512);
    for (sc, name) in connect_status::ALL.into_iter().zip(names) {
        let s = Status::new(StatusCodeType::CommandSpecific, sc);
        m.inject(Fault::RejectConnect(s));
        let e = NvmeTcpQueue::connect(m.target(1), opts()).unwrap_err();
        let TcpError::ConnectRejected { status, qid: 0, .. } = &e else { panic!("{e:?}") };
        assert_eq!(*status, s);
        assert!(e.to_string().contains(name) && e.to_string().contains(&m.addr()), "{e}");
    }
    // A generic status is named too.
    m.inject(Fault::RejectConnect(Status::INVALID_FIELD));
    let e = NvmeTcpQueue::connect(m.target(1), opts()).unwrap_err();
    assert!(e.to_string().contains("Invalid Field in Command"), "{e}");
}

#[test]
fn a_controller_that_never_sets_csts_rdy_times_out_within_cap_to() {
    let (m, _) = model(512);
    m.inject(Fault::NeverReady);
    let e = NvmeTcpQueue::connect(m.target(1), opts()).unwrap_err();
    let TcpError::NotReady { waited_ms, .. } = &e else { panic!("{e:?}") };
    assert_eq!(*waited_ms, 500, "CAP.TO 1 = 500 ms");
    assert!(e.to_string().contains("CSTS.RDY still 0"), "{e}");
}

#[test]
fn a_target_that_never_answers_icreq_times_out_naming_the_step() {
    let (m, _) = model(512);
    m.inject(Fault::SilentIcReq);
    let e =
        NvmeTcpQueue::connect(m.target(1), TcpOptions { timeout: Duration::from_millis(300), ..opts() }).unwrap_err();
    let TcpError::Timeout { step, qid: 0, .. } = &e else { panic!("{e:?}") };
    assert_eq!(step, "ICReq/ICResp");
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
}

#[test]
fn a_missing_namespace_is_named() {
    let (m, _) = model(512);
    let e = NvmeTcpQueue::connect(m.target(2), opts()).unwrap_err();
    assert!(matches!(&e, TcpError::Command { status, .. } if *status == Status::INVALID_NAMESPACE), "{e:?}");
    assert!(e.to_string().contains("Identify Namespace 2"), "{e}");
}

// ---- PDU faults during I/O: each breaks the connection; the read is resubmitted on a new one ----

/// Injects `fault`, then reads: the fault breaks the connection with `check`'s error (seen in the
/// log and counted), the initiator reconnects and the resubmitted read returns the right bytes.
fn recovers(cfg: TcpOptions, fault: Fault) {
    let (m, data) = model(512);
    let mut q = NvmeTcpQueue::connect(m.target(1), cfg).unwrap();
    m.inject(fault.clone());
    let got = read(&mut q, 65536, 256 << 10).unwrap_or_else(|e| panic!("{fault:?}: {e}"));
    assert_eq!(got, data[65536..65536 + (256 << 10)], "{fault:?}");
    assert_eq!((q.stats().reconnects, q.stats().resubmitted), (1, 1), "{fault:?}");
}

/// Injects `fault` with no resubmission allowed: the read fails with
/// [`TcpError::RetriesExhausted`]; returns the message of the failure that ended the connection.
fn fails(cfg: TcpOptions, fault: Fault) -> String {
    let (m, _) = model(512);
    let mut q = NvmeTcpQueue::connect(m.target(1), TcpOptions { max_retries: 0, ..cfg }).unwrap();
    m.inject(fault);
    let e = read_err(&mut q, 65536, 256 << 10);
    let Some(TcpError::RetriesExhausted { cause, byte: 65536, retries: 0, .. }) = TcpError::of(&e) else {
        panic!("{e}")
    };
    assert!(e.to_string().contains(&m.addr()), "{e}");
    // The queue still works: the next read goes over a new connection.
    assert!(read(&mut q, 0, 4096).is_ok());
    cause.clone()
}

#[test]
fn pdu_faults_end_the_connection_with_their_error_and_the_read_is_resubmitted() {
    let dg = TcpOptions { hdgst: true, ddgst: true, ..opts() };
    for (cfg, fault, want) in [
        (opts(), Fault::ShortPdu, "bad CapsuleResp PDU: PLEN 20 is shorter than its header (24 bytes)"),
        (dg.clone(), Fault::BadHeaderDigest, "C2HData header digest mismatch"),
        (dg.clone(), Fault::BadDataDigest, "C2HData for CID"),
        (opts(), Fault::UnexpectedPduType, "unexpected PDU type 0x06 (H2CData)"),
        (opts(), Fault::C2HPastBuffer, "bad C2HData PDU: DATAO"),
        (opts(), Fault::C2HWrongCid, "has no command outstanding"),
        (opts(), Fault::TermReq, "C2HTermReq): Data Transfer Out of Range (FES 0x04"),
        (opts(), Fault::DropMidRead, "the target closed the connection"),
    ] {
        recovers(cfg.clone(), fault.clone());
        let msg = fails(cfg, fault.clone());
        assert!(msg.contains(want), "{fault:?}: {msg}");
    }
}

#[test]
fn an_error_status_fails_only_that_read_with_the_spec_name() {
    let (m, data) = model(512);
    let mut q = NvmeTcpQueue::connect(m.target(1), opts()).unwrap();
    m.inject(Fault::ErrorStatus(Status::UNRECOVERED_READ_ERROR));
    let e = read_err(&mut q, 0, 4096);
    let TcpError::Command { status, step, .. } = TcpError::of(&e).unwrap() else { panic!("{e}") };
    assert_eq!((*status, step.as_str()), (Status::UNRECOVERED_READ_ERROR, "Read at byte 0x0"));
    assert!(e.to_string().contains("Unrecovered Read Error"), "{e}");
    assert_eq!(read(&mut q, 0, 4096).unwrap(), data[..4096]);
    assert_eq!(q.stats().reconnects, 0, "a status is not a connection failure");
}

#[test]
fn an_r2t_for_more_than_asked_fails_the_write_without_resubmission() {
    let (m, _) = model(512);
    let mut q = NvmeTcpQueue::connect(m.target(1), opts()).unwrap();
    m.inject(Fault::R2tTooLong);
    let buf = AlignedBuf::new(1 << 20, 4096).unwrap();
    q.submit_write(WriteReq { offset: ByteOffset(0), len: 1 << 20, buf, tag: Tag(9) });
    let mut out = Vec::new();
    q.reap(1, &mut out);
    let e = out.pop().unwrap().result.unwrap_err();
    let Some(TcpError::WriteLost { cause, .. }) = TcpError::of(&e) else { panic!("{e}") };
    assert!(cause.contains("bad R2T PDU") && cause.contains("the write has 1048576 bytes"), "{cause}");
    assert_eq!(q.stats().reconnects, 1);
}

#[test]
fn a_command_without_an_answer_times_out_and_is_resubmitted() {
    let cfg = TcpOptions { timeout: Duration::from_millis(300), ..opts() };
    recovers(cfg.clone(), Fault::Silent);
    let (m, _) = model(512);
    let mut q = NvmeTcpQueue::connect(m.target(1), cfg).unwrap();
    m.inject(Fault::Hang);
    let e = read_err(&mut q, 0, 4096);
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
    let Some(TcpError::RetriesExhausted { retries: 2, cause, .. }) = TcpError::of(&e) else { panic!("{e}") };
    assert!(cause.contains("Read CID") && cause.contains("no answer within 300 ms"), "{cause}");
    assert_eq!(q.stats().timeouts, 3);
}

#[test]
fn a_target_that_went_away_fails_reads_and_is_used_again_when_it_returns() {
    let (m, data) = model(512);
    let cfg = TcpOptions {
        reconnect_attempts: 1,
        reconnect_delay: Duration::ZERO,
        timeout: Duration::from_millis(300),
        ..opts()
    };
    let mut q = NvmeTcpQueue::connect(m.target(1), cfg).unwrap();
    // The target drops every connection and answers no new one (ICReq gets no ICResp).
    m.inject(Fault::SilentIcReq);
    m.drop_connections();
    let e = read_err(&mut q, 0, 4096);
    let Some(TcpError::Disconnected { last, .. }) = TcpError::of(&e) else { panic!("{e}") };
    assert!(last.contains("ICReq/ICResp: no answer within 300 ms"), "{last}");
    // It comes back: the next read reconnects (reconnect_delay 0) and is served.
    m.clear_faults();
    assert_eq!(read(&mut q, 0, 4096).unwrap(), data[..4096]);
    assert_eq!(q.stats().reconnects, 1);
}

/// Submits two writes and a read to `q` and flushes without reaping them first: the flush waits
/// for them, and its completion is not among theirs; all three come back, intact, from the next
/// reap, and the written bytes read back.
fn flush_keeps_the_completions_it_waited_for<Q: NvmWriteQueue>(q: &mut Q) {
    let (_, flushes) = q.command_counts();
    for (tag, fill) in [(1u64, 0x11u8), (2, 0x22)] {
        let mut buf = AlignedBuf::new(4096, 4096).unwrap();
        buf.as_mut_slice().fill(fill);
        q.submit_write(WriteReq { offset: ByteOffset(tag * 4096), len: 4096, buf, tag: Tag(tag) });
    }
    let buf = AlignedBuf::new(4096, 4096).unwrap();
    q.submit(ReadReq { offset: ByteOffset(0), len: 4096, buf, tag: Tag(3) });
    q.flush().unwrap();
    assert_eq!(q.command_counts().1, flushes + 1, "one Flush counted");
    assert_eq!(q.in_flight(), 3, "the three completions are held for the caller");
    let mut out = Vec::new();
    assert_eq!(q.reap(0, &mut out), 3);
    let mut tags: Vec<u64> = out.iter().map(|c| c.tag.0).collect();
    tags.sort_unstable();
    assert_eq!(tags, [1, 2, 3], "the Flush's own completion (tag u64::MAX) is not returned");
    assert!(out.iter().all(|c| c.result.as_ref().is_ok_and(|&n| n == 4096)), "{:?}", out[0].result);
    assert_eq!(q.in_flight(), 0);
    let back = read_blocking(q, 4096, 8192).unwrap();
    assert_eq!(&back.as_slice()[..8192], &[[0x11u8; 4096], [0x22; 4096]].concat()[..]);
}

/// The one flush procedure both write queues share (`NvmeQueue` over the controller model, and
/// `NvmeTcpQueue` over the target model): here because it needs loopback TCP, which the VM guests
/// of tests/vm do not bring up.
#[test]
fn flush_keeps_the_completions_it_waited_for_on_vfio_and_tcp_queues() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ns1");
    std::fs::write(&path, vec![0xEEu8; 1 << 20]).unwrap();
    let mut cfg = SimConfig::single(&path, 512);
    cfg.namespaces[0].writable = true;
    let (mut q, _sim) = NvmeQueue::open_sim(cfg, &NvmeQueueOptions::default()).unwrap();
    flush_keeps_the_completions_it_waited_for(&mut q);
    let m = TargetModel::start(ModelConfig::memory(vec![0; 1 << 20], 512)).unwrap();
    let mut q = NvmeTcpQueue::connect(m.target(1), opts()).unwrap();
    flush_keeps_the_completions_it_waited_for(&mut q);
}

/// Found reading the code the `nvme_tcp` fuzz target drives: an LBA larger than MDTS rounded the
/// per-command transfer down to 0 bytes, and the first read divided by it (a panic). Connect now
/// refuses such a namespace with a clear error.
#[test]
fn an_lba_larger_than_mdts_is_refused_at_connect_not_a_division_by_zero() {
    let cfg = ModelConfig { mdts: 1, ..ModelConfig::memory(pattern(1 << 20), 16384) };
    let m = TargetModel::start(cfg).unwrap();
    let e = NvmeTcpQueue::connect(m.target(1), opts()).unwrap_err();
    assert!(matches!(e, TcpError::Unsupported { .. }), "{e}");
    assert!(
        e.to_string().ends_with("MDTS allows 8192 bytes per command, less than one 16384-byte LBA of namespace 1"),
        "{e}"
    );
}

/// CSTS is read without pausing when `csts_poll` is zero, and the default still enables and shuts
/// down the controller.
#[test]
fn csts_poll_zero_and_default_both_enable_and_shut_down() {
    for poll in [Duration::ZERO, TcpOptions::default().csts_poll] {
        let (m, data) = model(512);
        let mut q = NvmeTcpQueue::connect(m.target(1), TcpOptions { csts_poll: poll, ..opts() }).unwrap();
        assert_eq!(read(&mut q, 0, 4096).unwrap(), data[..4096]);
        drop(q);
        assert_eq!(m.stats().shutdowns, 1);
    }
}

/// Found by the `nvme_tcp` fuzz target (fuzz/corpus/nvme_tcp/crash-nsze-times-lba-overflow): an
/// Identify Namespace whose NSZE × LBA size passes 2^64 made `Namespace::bytes` overflow (a panic)
/// at the first read's range check. A namespace of 2^64 bytes or more is now
/// refused at connect (and skipped by the PCIe driver), and `bytes` saturates.
#[test]
fn a_namespace_of_2_64_bytes_or_more_is_refused_at_connect_not_an_overflow() {
    let input =
        include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/corpus/nvme_tcp/crash-nsze-times-lba-overflow"));
    let out = picchio_nvme::tcp::replay::run(input);
    let e = out.error().expect("an error");
    assert!(e.message.contains("bytes is 2^64 bytes or more"), "{out:#?}");
    assert!(e.message.contains("namespace 1: NSZE "), "{}", e.message);
    let ns = picchio_nvme::Namespace { nsid: 1, blocks: u64::MAX / 256, lba_size: 512, metadata_size: 0 };
    assert!(!ns.fits());
    assert_eq!(ns.bytes(), u64::MAX);
    let ns = picchio_nvme::Namespace { nsid: 1, blocks: u64::MAX / 512, lba_size: 512, metadata_size: 0 };
    assert!(ns.fits());
}
