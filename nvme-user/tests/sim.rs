//! The real driver (controller init, queue pair, PRPs, engine) against the software controller model.
#![cfg(target_os = "linux")]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use picchio_core::loader::StoreDims;
use picchio_core::rng::SplitMix64 as Rng;
use picchio_core::{
    AlignedBuf, ByteOffset, Completion, ExpertLoader, FlatStore, FlatStoreOptions, IoQueue, ReadReq, Tag,
};
use picchio_nvme::bar::Bar;
use picchio_nvme::engine::{ReadFailure, RecoveryPolicy};
use picchio_nvme::sim::{Fault, Sim, SimConfig, SimNamespace};
use picchio_nvme::spec::{admin, regs, Status, StatusCodeType};
use picchio_nvme::{Controller, CtrlrOptions, Error, HeapDma, InitState, NvmeQueue, NvmeQueueOptions};
use picchio_testkit::conformance::{Engine, Eof, Misalign};
use picchio_testkit::image::{check_every_expert, write_image};

fn backing(dir: &Path, name: &str, len: usize, seed: u64) -> (PathBuf, Vec<u8>) {
    picchio_testkit::conformance::random_file(dir, name, len, seed)
}

/// Lends the conformance suite the driver on the controller model with `lba`-byte LBAs; the
/// namespace is the suite's file. Per-command timeout 60 s: the suite checks reads, not timeouts, and
/// a loaded machine can stall the model's thread far beyond the fault tests' 300 ms.
fn with_sim(lba: u32, f: impl FnOnce(&Engine)) {
    let dir = tempfile::tempdir().unwrap();
    let open = move |p: &Path, qd: u32| -> Box<dyn IoQueue> {
        let o = NvmeQueueOptions { qd: qd as u16, timeout: Duration::from_secs(60), ..Default::default() };
        // The queue owns the model: its controller holds the model's register window, which keeps
        // the model thread running until the driver has shut the controller down.
        let (q, _sim) = NvmeQueue::open_sim(SimConfig::single(p, lba), &o).unwrap();
        assert_eq!(q.block_size(), lba);
        Box::new(q)
    };
    let misaligned = |e: &std::io::Error, _: Misalign| assert!(e.to_string().contains("not aligned"), "{e}");
    let past_end = |e: &std::io::Error, offset: u64, size: u64| {
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        let s = e.to_string();
        assert!(
            s.contains("past the end")
                && s.contains(&format!("at {offset:#x}"))
                && s.contains(&format!("({size} bytes)")),
            "{s}"
        );
    };
    let too_small = |e: &std::io::Error, buf_len: usize| {
        assert!(e.to_string().contains(&format!("with a {buf_len}-byte buffer")), "{e}");
    };
    f(&Engine {
        name: &format!("nvme(sim, {lba}-byte LBA)"),
        dir: dir.path(),
        open: &open,
        align: lba,
        mem_align: 4,
        eof: Eof::Refused,
        misaligned: &misaligned,
        past_end: &past_end,
        too_small: &too_small,
    });
}

fn with_sim_512(f: impl FnOnce(&Engine)) {
    with_sim(512, f)
}

fn with_sim_4096(f: impl FnOnce(&Engine)) {
    with_sim(4096, f)
}

mod conformance_512 {
    picchio_testkit::conformance_tests!(super::with_sim_512, aligned);
}

mod conformance_4096 {
    picchio_testkit::conformance_tests!(super::with_sim_4096, aligned);
}

/// Options for tests whose commands all complete: a per-command timeout (60 s) that only a hang
/// reaches, so a loaded machine stalling the model's thread does not time a read out.
fn opts(qd: u16) -> NvmeQueueOptions {
    NvmeQueueOptions { qd, timeout: Duration::from_secs(60), ..Default::default() }
}

/// The per-command timeout of tests that make a command time out on purpose (a held or dropped
/// completion): short enough to keep them quick, long enough (2 s, not the 300 ms it once was) that
/// the *other* commands of the test do not time out while the machine is loaded.
const FAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// Options for tests that inject a held or dropped completion (see [`FAULT_TIMEOUT`]).
fn fault_opts(qd: u16) -> NvmeQueueOptions {
    NvmeQueueOptions { qd, timeout: FAULT_TIMEOUT, ..Default::default() }
}

/// The controller model started (not yet initialized by a driver) with one namespace of 1 MiB of
/// seeded bytes (kept in `dir`) and 512-byte LBAs, and the driver's DMA memory it may reach.
fn started_sim(dir: &Path, seed: u64) -> (Sim, HeapDma) {
    let (p, _) = backing(dir, "ns", 1 << 20, seed);
    let dma = HeapDma::new();
    let sim = Sim::start(SimConfig::single(&p, 512), dma.registry()).unwrap();
    (sim, dma)
}

fn read(q: &mut NvmeQueue, offset: u64, len: u32) -> Completion {
    let buf = AlignedBuf::new(len as usize, 4096).unwrap();
    q.submit(ReadReq { offset: ByteOffset(offset), len, buf, tag: Tag(offset) });
    let mut out = vec![];
    while out.is_empty() {
        q.reap(1, &mut out);
    }
    out.pop().unwrap()
}

#[test]
fn init_and_identify_two_namespaces() {
    let dir = tempfile::tempdir().unwrap();
    let (a, _) = backing(dir.path(), "a", 1 << 20, 1);
    let (b, _) = backing(dir.path(), "b", 2 << 20, 2);
    let mut cfg = SimConfig::single(&a, 512);
    cfg.namespaces.push(SimNamespace { path: b, lba_size: 4096, writable: false });
    let dma = HeapDma::new();
    let reg = dma.registry();
    let sim = Sim::start(cfg, dma.registry()).unwrap();
    let c = Controller::init(sim.bar(), Arc::new(dma), CtrlrOptions::default()).unwrap();
    assert_eq!(c.state(), InitState::Ready);
    let id = c.identify().unwrap();
    assert_eq!((id.mn.as_str(), id.sn.as_str(), id.nn, id.mdts), ("Picchio NVMe sim", "PICCHIO-SIM-0001", 2, 5));
    assert_eq!(c.version().to_string(), "1.4.0");
    let ns: Vec<_> = c.namespaces().iter().map(|n| (n.nsid, n.blocks, n.lba_size)).collect();
    assert_eq!(ns, vec![(1, 2048, 512), (2, 512, 4096)]);
    assert_eq!(c.max_transfer(), 128 << 10);
    assert!(matches!(c.namespace(3), Err(Error::NoNamespace { nsid: 3, .. })));
    let bar = sim.bar();
    drop(c);
    // Shutdown deleted the queues, completed CC.SHN and disabled the controller; all DMA memory is gone.
    assert_eq!(bar.read32(regs::CSTS) & 1, 0, "CSTS.RDY cleared");
    assert_eq!(reg.count(), 0, "every DMA range released");
    assert!(sim.stats().admin_cmds >= 8, "{:?}", sim.stats());
}

fn check_reads(lba: u32, mdts: u8, qd: u16) {
    let dir = tempfile::tempdir().unwrap();
    let (p, bytes) = backing(dir.path(), "ns", 8 << 20, 7 + u64::from(lba));
    let mut cfg = SimConfig::single(&p, lba);
    cfg.mdts = mdts;
    let (mut q, sim) = NvmeQueue::open_sim(cfg, &opts(qd)).unwrap();
    assert_eq!(q.block_size(), lba);
    assert_eq!(q.describe(), format!("nvme(sim, nsid 1, qd {qd})"));
    let mut rng = Rng::new(99);
    let reads: Vec<(u64, u32)> = (0..200u64)
        .map(|i| {
            let blocks = 1 + rng.next_u64() % if i % 10 == 0 { 1200 } else { 64 };
            let len = (blocks * u64::from(lba)).min(700 << 10) as u32;
            let off = (rng.next_u64() % ((8 << 20) - u64::from(len))) / u64::from(lba) * u64::from(lba);
            (off, len)
        })
        .collect();
    read_all_and_check(&mut q, &bytes, &reads, usize::from(qd));
    let s = q.stats();
    if mdts != 0 {
        assert!(s.commands > s.reads, "transfers above MDTS were split: {s:?}");
    }
    assert_eq!(sim.stats().io_cmds, s.commands);
    let qs = q.controller().io_queue_stats();
    assert_eq!((qs.submitted, qs.completed), (s.commands, s.commands));
    if qd > 1 && s.commands > s.reads {
        // A split read's commands go out under one tail doorbell.
        assert!(qs.sq_doorbells < qs.submitted, "one tail doorbell per batch: {qs:?}");
    }
}

#[test]
fn reads_equal_the_file_qd1_512() {
    check_reads(512, 5, 1);
}

#[test]
fn reads_equal_the_file_qd32_4096() {
    check_reads(4096, 5, 32);
}

#[test]
fn reads_equal_the_file_short_mdts() {
    check_reads(4096, 1, 32); // MDTS 1: 8 KiB per command
    check_reads(512, 0, 8); // no MDTS: the driver's 32 MiB cap, one command per read
}

#[test]
fn injected_statuses_fail_the_read_and_the_queue_keeps_working() {
    let dir = tempfile::tempdir().unwrap();
    let (p, bytes) = backing(dir.path(), "ns", 1 << 20, 4);
    let (mut q, sim) = NvmeQueue::open_sim(SimConfig::single(&p, 512), &opts(8)).unwrap();
    let statuses = [
        Status::UNRECOVERED_READ_ERROR,
        Status::LBA_OUT_OF_RANGE,
        Status::INTERNAL_ERROR,
        Status { dnr: true, ..Status::DATA_TRANSFER_ERROR },
        Status::new(StatusCodeType::VendorSpecific, 0xC3),
    ];
    for s in statuses {
        sim.inject(Fault::io_status(sim.io_count() + 1, s));
        let e = read(&mut q, 0, 4096).result.unwrap_err();
        assert!(e.to_string().contains(&s.to_string()), "{e} vs {s}");
        let c = read(&mut q, 8192, 4096);
        assert_eq!(c.result.unwrap(), 4096);
        assert_eq!(&c.buf.as_slice()[..4096], &bytes[8192..12288]);
    }
    // A status on the 2nd command of a split read fails the whole read.
    sim.inject(Fault::io_status(sim.io_count() + 2, Status::UNRECOVERED_READ_ERROR));
    assert!(read(&mut q, 0, 512 << 10).result.is_err());
    assert_eq!(read(&mut q, 0, 512 << 10).result.unwrap(), 512 << 10);
    assert_eq!(q.stats().errors, 6);
}

/// The typed recovery error inside a failed completion.
fn failure(c: &Completion) -> ReadFailure {
    let e = c.result.as_ref().expect_err("the read must fail");
    ReadFailure::of(e).unwrap_or_else(|| panic!("untyped error: {e}")).clone()
}

fn fast_recovery(q: &mut NvmeQueue, max_resets: u32) {
    q.set_recovery(RecoveryPolicy { abort_timeout: FAULT_TIMEOUT, max_resets, reset_window: Duration::from_secs(600) });
}

/// A queue opened with `o` over the controller model with one namespace of `len` seeded bytes (kept
/// in `dir`) and `lba`-byte LBAs, recovering quickly ([`fast_recovery`] with `max_resets`); the
/// model and the namespace's bytes.
fn recovering_queue(
    dir: &Path,
    len: usize,
    seed: u64,
    lba: u32,
    o: &NvmeQueueOptions,
    max_resets: u32,
) -> (NvmeQueue, Sim, Vec<u8>) {
    let (p, bytes) = backing(dir, "ns", len, seed);
    let (mut q, sim) = NvmeQueue::open_sim(SimConfig::single(&p, lba), o).unwrap();
    fast_recovery(&mut q, max_resets);
    (q, sim, bytes)
}

#[test]
fn dropped_completion_abort_then_reset_fails_only_that_read() {
    let dir = tempfile::tempdir().unwrap();
    let (mut q, sim, bytes) = recovering_queue(dir.path(), 1 << 20, 5, 4096, &fault_opts(4), 3);
    // The controller executes the read but never posts its completion: the Abort finds nothing
    // outstanding (DW0 bit 0 = 1), no completion comes, so the controller is reset.
    sim.inject(Fault::io_drop(sim.io_count() + 1));
    let t = std::time::Instant::now();
    let c = read(&mut q, 8192, 4096);
    let e = c.result.as_ref().unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
    match failure(&c) {
        ReadFailure::TimedOutReset { nsid: 1, byte: 8192, timeout_ms, why, .. }
            if timeout_ms == FAULT_TIMEOUT.as_millis() as u64 =>
        {
            assert!(why.contains("did not abort it (DW0 bit 0 = 1)"), "{why}")
        }
        f => panic!("{f:?}"),
    }
    assert!(e.to_string().contains("so the controller was reset"), "{e}");
    assert!(t.elapsed() >= 2 * FAULT_TIMEOUT, "timeout + abort timeout");
    // After a reset the device does no more DMA: the buffer itself comes back (not quarantined).
    assert_eq!(c.buf.len(), 4096);
    let s = q.stats();
    assert_eq!((s.timeouts, s.aborts, s.resets), (1, 1, 1), "{s:?}");
    assert_eq!(q.controller().resets(), 1);
    assert_eq!((sim.stats().dropped, sim.stats().resets, sim.stats().aborted), (1, 1, 0));
    assert!(q.fatal().is_none());
    for i in 0..20u64 {
        let c = read(&mut q, i * 4096, 4096);
        assert_eq!(c.result.unwrap(), 4096);
        assert_eq!(&c.buf.as_slice()[..4096], &bytes[i as usize * 4096..(i as usize + 1) * 4096]);
    }
    // Split reads across the re-created queue, many at once.
    check_many(&mut q, &bytes, 8);
}

/// Submits reads of 1..=40 pages at varied offsets with `qd` in flight, checks every byte.
fn check_many(q: &mut NvmeQueue, bytes: &[u8], qd: usize) {
    let mut rng = Rng::new(77);
    let reads: Vec<(u64, u32)> = (0..60)
        .map(|_| {
            let len = ((1 + rng.next_u64() % 40) * 4096) as u32;
            (rng.next_u64() % (bytes.len() as u64 - u64::from(len)) / 4096 * 4096, len)
        })
        .collect();
    read_all_and_check(q, bytes, &reads, qd);
}

/// Submits `reads` (byte offset, length; tagged by index) with at most `qd` in flight, reaps them
/// all, and checks each one's length and bytes against `bytes`.
fn read_all_and_check(q: &mut NvmeQueue, bytes: &[u8], reads: &[(u64, u32)], qd: usize) {
    let mut got = vec![];
    for (i, &(off, len)) in reads.iter().enumerate() {
        let buf = AlignedBuf::new(len as usize, 4096).unwrap();
        q.submit(ReadReq { offset: ByteOffset(off), len, buf, tag: Tag(i as u64) });
        while q.in_flight() >= qd {
            q.reap(1, &mut got);
        }
    }
    while q.in_flight() > 0 {
        q.reap(1, &mut got);
    }
    assert_eq!(got.len(), reads.len());
    for c in got {
        let (off, len) = reads[c.tag.0 as usize];
        assert_eq!(c.result.as_ref().map_err(ToString::to_string), Ok(&len), "tag {}", c.tag.0);
        let want = &bytes[off as usize..(off + u64::from(len)) as usize];
        assert!(c.buf.as_slice()[..len as usize] == *want, "tag {}: bytes at {off:#x}", c.tag.0);
    }
}

#[test]
fn hung_command_is_aborted_without_a_reset() {
    let dir = tempfile::tempdir().unwrap();
    let (mut q, sim, bytes) = recovering_queue(dir.path(), 1 << 20, 9, 512, &fault_opts(4), 3);
    // The controller holds the command (never executes or completes it) until the Abort names it.
    sim.inject(Fault::io_hold(sim.io_count() + 1));
    let c = read(&mut q, 4096, 8192);
    assert_eq!(c.result.as_ref().unwrap_err().kind(), std::io::ErrorKind::TimedOut);
    match failure(&c) {
        ReadFailure::Aborted { nsid: 1, byte: 4096, status, .. } => assert_eq!(status, Status::ABORT_REQUESTED),
        f => panic!("{f:?}"),
    }
    let s = q.stats();
    assert_eq!((s.timeouts, s.aborts, s.resets, s.late), (1, 1, 0, 1), "{s:?}");
    assert_eq!((sim.stats().aborted, sim.stats().resets), (1, 0));
    let c = read(&mut q, 4096, 8192);
    assert_eq!(c.result.unwrap(), 8192);
    assert_eq!(&c.buf.as_slice()[..8192], &bytes[4096..12288]);
}

#[test]
fn controller_fatal_status_resets_and_later_reads_are_byte_correct() {
    let dir = tempfile::tempdir().unwrap();
    // Queue depth 2: reads 3 and 4 go out together, 5 and 6 wait for free CIDs.
    let (mut q, sim, bytes) = recovering_queue(dir.path(), 2 << 20, 6, 4096, &opts(2), 3);
    for i in 0..2u64 {
        let c = read(&mut q, i * 4096, 4096);
        assert_eq!(c.result.unwrap(), 4096);
    }
    // CSTS.CFS when read 3 is fetched; read 4 stays in the SQ (the controller stopped).
    sim.inject(Fault::io_fatal(sim.io_count() + 1));
    for i in 3..7u64 {
        let len = 4096 * i as u32;
        q.submit(ReadReq {
            offset: ByteOffset(i << 16),
            len,
            buf: AlignedBuf::new(len as usize, 4096).unwrap(),
            tag: Tag(i),
        });
    }
    let mut got = vec![];
    while q.in_flight() > 0 {
        q.reap(1, &mut got);
    }
    got.sort_by_key(|c| c.tag.0);
    assert_eq!(got.iter().map(|c| c.tag.0).collect::<Vec<_>>(), vec![3, 4, 5, 6]);
    for c in &got[..2] {
        match failure(c) {
            ReadFailure::Reset { nsid: 1, byte, reason } => {
                assert_eq!(byte, c.tag.0 << 16);
                assert!(reason.contains("CSTS.CFS = 1"), "{reason}");
            }
            f => panic!("tag {}: {f:?}", c.tag.0),
        }
    }
    for c in &got[2..] {
        let (off, len) = ((c.tag.0 << 16) as usize, 4096 * c.tag.0 as usize);
        assert_eq!(
            *c.result.as_ref().unwrap() as usize,
            len,
            "tag {} was not in flight: served after the reset",
            c.tag.0
        );
        assert!(c.buf.as_slice()[..len] == bytes[off..off + len]);
    }
    assert_eq!((q.stats().resets, q.stats().timeouts, sim.stats().resets), (1, 0, 1));
    assert!(q.fatal().is_none());
    check_many(&mut q, &bytes, 2);
    drop(q); // a clean shutdown after the reset
}

#[test]
fn repeated_faults_stop_the_queue_after_the_reset_limit() {
    let dir = tempfile::tempdir().unwrap();
    let (mut q, sim, bytes) = recovering_queue(dir.path(), 1 << 20, 10, 512, &opts(4), 2);
    for round in 0..2 {
        sim.inject(Fault::io_fatal(sim.io_count() + 1));
        assert!(matches!(failure(&read(&mut q, 0, 4096)), ReadFailure::Reset { .. }), "round {round}");
        let c = read(&mut q, 4096, 4096);
        assert_eq!(c.result.unwrap(), 4096);
        assert_eq!(&c.buf.as_slice()[..4096], &bytes[4096..8192]);
    }
    // A third fault within the window: no third reset, the queue stops and says why.
    sim.inject(Fault::io_fatal(sim.io_count() + 1));
    let c = read(&mut q, 0, 4096);
    match failure(&c) {
        ReadFailure::ResetLimit { resets: 2, limit: 2, window_s: 600, last } => {
            assert!(last.contains("CSTS.CFS"), "{last}")
        }
        f => panic!("{f:?}"),
    }
    let why = q.fatal().expect("stopped").to_string();
    assert!(why.starts_with("NVMe queue stopped after 2 controller resets within 600 s (limit 2)"), "{why}");
    let e = read(&mut q, 4096, 4096).result.unwrap_err();
    assert!(e.to_string().contains("NVMe queue stopped after 2 controller resets"), "{e}");
    assert_eq!(q.stats().resets, 2);
    // Reset twice by the driver, then shut down (its CC.EN = 0 counts as the model's third).
    assert_eq!(sim.stats().resets, 3);
    drop(q);
}

#[test]
fn interrupt_flag_fails_waiting_reads_and_stops_the_queue() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let (p, _) = backing(dir.path(), "ns", 1 << 20, 13);
    // A per-command timeout far beyond the test: only the flag can end the wait.
    let o = NvmeQueueOptions { qd: 4, timeout: Duration::from_secs(600), ..Default::default() };
    let (mut q, sim) = NvmeQueue::open_sim(SimConfig::single(&p, 4096), &o).unwrap();
    let flag = Arc::new(AtomicBool::new(false));
    q.set_interrupt(flag.clone());
    // A hung command would keep reap waiting for the timeout; the flag ends the wait instead.
    q.set_recovery(RecoveryPolicy { abort_timeout: Duration::from_secs(60), ..RecoveryPolicy::default() });
    sim.inject(Fault::io_hold(sim.io_count() + 1));
    q.submit(ReadReq { offset: ByteOffset(0), len: 4096, buf: AlignedBuf::new(4096, 4096).unwrap(), tag: Tag(1) });
    let setter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        flag.store(true, Ordering::Relaxed);
    });
    let mut got = vec![];
    q.reap(1, &mut got);
    setter.join().unwrap();
    assert_eq!(got[0].result.as_ref().unwrap_err().kind(), std::io::ErrorKind::Interrupted);
    assert_eq!(failure(&got[0]), ReadFailure::Interrupted);
    assert!(q.fatal().is_some());
    assert_eq!(q.stats().timeouts, 0);
    let e = read(&mut q, 4096, 4096).result.unwrap_err();
    assert!(e.to_string().contains("interrupted"), "{e}");
    drop(q); // shutdown deletes the queues (the held command completes as aborted) and resets
}

#[test]
fn admin_failure_during_init_names_the_command() {
    let dir = tempfile::tempdir().unwrap();
    let (sim, dma) = started_sim(dir.path(), 8);
    sim.inject(Fault::admin_status(admin::CREATE_IO_SQ, Status::INVALID_QUEUE_SIZE));
    let e = Controller::init(sim.bar(), Arc::new(dma), CtrlrOptions::default()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "NVMe admin command Create I/O Submission Queue 1 failed: Invalid Queue Size (SCT 0x1 command specific, SC 0x02)"
    );
}

/// A controller that never becomes ready.
struct StuckBar;
impl Bar for StuckBar {
    fn read32(&self, off: usize) -> u32 {
        self.read64(off & !7) as u32
    }
    fn read64(&self, off: usize) -> u64 {
        if off == regs::CAP {
            regs::Cap::build(63, true, 1, 0, 1, 0, 0).0
        } else {
            0
        }
    }
    fn write32(&self, _: usize, _: u32) {}
    fn write64(&self, _: usize, _: u64) {}
    fn kind(&self) -> &'static str {
        "stuck"
    }
}

#[test]
fn init_timeout_names_the_state() {
    let e = Controller::init(Arc::new(StuckBar), Arc::new(HeapDma::new()), CtrlrOptions::default()).unwrap_err();
    assert!(matches!(e, Error::InitTimeout { state: InitState::WaitReady1, waited_ms } if waited_ms >= 500), "{e}");
}

/// A `.picchioflat` image in `dir` of `n_layers` × 4 experts (hidden 64, top-2, MoE intermediate
/// 128) with payloads of `payload_len(i)` bytes, seeded `seed`: its path, dimensions, payloads and
/// length in bytes.
fn image(
    dir: &Path,
    n_layers: u32,
    seed: u64,
    payload_len: impl Fn(usize) -> usize,
) -> (PathBuf, StoreDims, Vec<Vec<u8>>, u64) {
    let path = dir.join("experts.picchioflat");
    let dims = StoreDims { hidden: 64, n_layers, n_experts: 4, topk: 2, moe_inter: 128 };
    let payloads = write_image(&path, dims, seed, payload_len);
    let image_len = std::fs::metadata(&path).unwrap().len();
    (path, dims, payloads, image_len)
}

#[test]
fn flat_store_over_nvme_sim_is_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    let (path, dims, payloads, image_len) = image(dir.path(), 3, 11, |i| 3000 + i * 37_000);
    for lba in [512, 4096] {
        let (q, _sim) = NvmeQueue::open_sim(SimConfig::single(&path, lba), &opts(16)).unwrap();
        let opts = FlatStoreOptions { image_len, verify: true, ..Default::default() };
        let mut store = FlatStore::open(q, "nvme:sim", opts).unwrap();
        check_every_expert(&mut store, dims, &payloads, 512 << 10);
        assert!(store.queue().stats().commands > store.queue().stats().reads);
    }
}

#[test]
fn sim_admin_commands_follow_the_spec() {
    use picchio_nvme::spec::Command;
    let dir = tempfile::tempdir().unwrap();
    let (sim, dma) = started_sim(dir.path(), 12);
    let mut c = Controller::init(sim.bar(), Arc::new(dma), CtrlrOptions::default()).unwrap();
    // SAFETY: (this test) the sim reaches only registered DMA memory (its "IOMMU"); the one command
    // pointing elsewhere (0x1000) is refused by it, which is what this test checks.
    let mut admin = |what: &str, cmd: Command| unsafe { c.admin(what, |c| *c = cmd) };
    let status = |r: Result<picchio_nvme::spec::Completion, Error>| match r {
        Err(Error::AdminCommand { status, .. }) => status,
        other => panic!("expected an error status, got {other:?}"),
    };
    let nq = admin("Get Features", Command::get_features(0, admin::FID_NUMBER_OF_QUEUES)).unwrap();
    assert_eq!(nq.dw0, 14 | (14 << 16), "15 I/O SQs and CQs, 0-based");
    let ab = admin("Abort", Command::abort(0, 1, 5)).unwrap();
    assert_eq!(ab.dw0 & 1, 1, "command not aborted");
    assert_eq!(status(admin("Delete SQ 7", Command::delete_io_sq(0, 7))), Status::INVALID_QID);
    assert_eq!(status(admin("Delete CQ 1", Command::delete_io_cq(0, 1))), Status::INVALID_QUEUE_DELETION);
    assert_eq!(status(admin("Create SQ on CQ 9", Command::create_io_sq(0, 2, 8, 9, 0))), Status::CQ_INVALID);
    assert_eq!(status(admin("opcode 0x7f", Command::new(0x7f, 0))), Status::INVALID_OPCODE);
    assert_eq!(status(admin("Identify CNS 0x55", Command::identify(0, 0x55, 0, 0))), Status::INVALID_FIELD);
    // A data pointer outside the driver's DMA memory: the model refuses the access.
    let e = admin("Identify into unmapped memory", Command::identify(0, admin::CNS_CONTROLLER, 0, 0x1000));
    assert_eq!(status(e), Status::DATA_TRANSFER_ERROR);
    assert_eq!(sim.stats().dma_faults, 1);
    // The admin queue still works.
    admin("Get Features", Command::get_features(0, admin::FID_NUMBER_OF_QUEUES)).unwrap();
}

/// Reads `len` bytes at `off` through `q` and checks them against `bytes`.
fn read_check(q: &mut NvmeQueue, bytes: &[u8], off: u64, len: u32) {
    let c = read(q, off, len);
    assert_eq!(c.result.as_ref().map_err(ToString::to_string), Ok(&len), "read {len} at {off:#x}");
    assert!(c.buf.as_slice()[..len as usize] == bytes[off as usize..off as usize + len as usize], "bytes at {off:#x}");
}

#[test]
fn multi_mib_reads_are_one_command_with_a_chained_prp_list() {
    let dir = tempfile::tempdir().unwrap();
    let (p, bytes) = backing(dir.path(), "ns", 48 << 20, 21);
    // A GPT-OSS-20B expert (13,996,800 B) padded to whole pages: 3418 pages = PRP1 + 3417 list
    // entries over 7 chained list pages.
    let expert = 13_996_800u32.div_ceil(4096) * 4096;
    for lba in [512u32, 4096] {
        let mut cfg = SimConfig::single(&p, lba);
        cfg.mdts = 12; // 16 MiB
        let (mut q, sim) = NvmeQueue::open_sim(cfg, &opts(4)).unwrap();
        assert_eq!(q.max_transfer(), 16 << 20);
        let pages0 = sim.stats().prp_list_pages;
        read_check(&mut q, &bytes, 3 * 4096, expert);
        assert_eq!(q.stats().commands, 1, "one command up to MDTS");
        assert_eq!(sim.stats().prp_list_pages - pages0, 7, "the sim walked a 7-page chain");
        // Exactly MDTS: 4096 pages = PRP1 + 4095 entries on 9 pages; MDTS + 4 MiB: split in two.
        read_check(&mut q, &bytes, 1 << 20, 16 << 20);
        assert_eq!(q.stats().commands, 2);
        assert_eq!(sim.stats().prp_list_pages - pages0, 7 + 9);
        read_check(&mut q, &bytes, 24 << 20, 20 << 20);
        assert_eq!(q.stats().commands, 4, "20 MiB = 16 + 4 MiB");
        // Many at once, at LBA (not page) offsets.
        let mut rng = Rng::new(u64::from(lba));
        let reads: Vec<(u64, u32)> = (0..6)
            .map(|_| {
                let len = ((1 + rng.next_u64() % 4000) * 4096) as u32;
                (rng.next_u64() % ((48 << 20) - u64::from(len)) / u64::from(lba) * u64::from(lba), len)
            })
            .collect();
        read_all_and_check(&mut q, &bytes, &reads, usize::MAX); // all 6 submitted before the first reap
        assert_eq!(sim.stats().dma_faults, 0);
    }
}

/// Rings `q`'s submission doorbell and polls until the one command submitted completes; its status.
fn ring_and_complete(q: &mut picchio_nvme::QueuePair) -> Status {
    q.ring();
    let mut done = None;
    while done.is_none() {
        q.poll(8, |e| done = Some(e.cqe.status())).unwrap();
    }
    done.unwrap()
}

#[test]
fn chained_prp_list_from_an_offset_first_page_and_a_broken_chain() {
    use picchio_nvme::dma::DmaPool;
    use picchio_nvme::spec::{nvm, Command, Lba};
    let dir = tempfile::tempdir().unwrap();
    let (p, bytes) = backing(dir.path(), "ns", 8 << 20, 22);
    let mut cfg = SimConfig::single(&p, 512);
    cfg.mdts = 0; // no MDTS: the driver's 32 MiB cap applies
    let dma = HeapDma::new();
    let sim = Sim::start(cfg, dma.registry()).unwrap();
    let dma = Arc::new(dma);
    let mut c = Controller::init(sim.bar(), dma.clone(), CtrlrOptions::default()).unwrap();
    assert_eq!(c.max_transfer(), 32 << 20);
    let buf = dma.alloc(6 << 20).unwrap();
    let q = c.io_queue().unwrap();
    assert_eq!(q.list_pages(), 17);
    // 4 MiB + 512 B from 0x600 into a page: PRP1 covers 0xA00 bytes, then 1024 more pages.
    let (start, len) = (buf.iova().add(0x600), (4 << 20) + 512);
    let cid = q.alloc_cid().unwrap();
    let prps = q.prps(cid, &[(start, len)]).unwrap();
    assert_eq!((prps.list_entries, prps.list_pages), (1024, 3));
    let pages0 = sim.stats().prp_list_pages;
    // SAFETY: the PRPs describe `buf` (DMA memory that outlives the command's completion below).
    unsafe {
        q.submit(cid, 0, |cmd| {
            *cmd = Command::rw(nvm::READ, cid.0, 1, Lba(8), (len / 512) as u32);
            cmd.prp1 = prps.prp1;
            cmd.prp2 = prps.prp2;
        })
    }
    .unwrap();
    assert_eq!(ring_and_complete(q), Status::SUCCESS);
    assert_eq!(sim.stats().prp_list_pages - pages0, 3);
    let mut got = vec![0u8; len];
    // SAFETY: the Read completed and its completion was consumed above.
    unsafe { buf.copy_out(0x600, &mut got) };
    assert!(got == bytes[8 * 512..8 * 512 + len], "bytes through a 3-page chain from an offset first page");

    // A chain pointer that is not page aligned: the controller refuses it with PRP Offset Invalid.
    let mut list = dma.alloc(2 * 4096).unwrap();
    let data = buf.iova().0;
    for i in 0..511 {
        list.write::<u64>(i * 8, data + (i as u64 + 1) * 4096);
    }
    list.write::<u64>(511 * 8, list.iova().0 + 4096 + 8); // bad: mid-page
    for i in 0..10 {
        list.write::<u64>(4096 + 8 + i * 8, data + (512 + i as u64) * 4096);
    }
    let q = c.io_queue().unwrap();
    let cid = q.alloc_cid().unwrap();
    // SAFETY: `buf` and `list` are DMA memory that outlives the completion; the bad chain pointer
    // still lies inside `list`, and the sim refuses it before any data moves.
    unsafe {
        q.submit(cid, 0, |cmd| {
            *cmd = Command::rw(nvm::READ, cid.0, 1, Lba(0), 522 * 8);
            cmd.prp1 = data;
            cmd.prp2 = list.iova().0;
        })
    }
    .unwrap();
    assert_eq!(ring_and_complete(q), Status::PRP_OFFSET_INVALID);
}

/// Stand-in for the runtime's safetensors fallback (the runtime depends on this crate, so its real
/// loader cannot be used here): serves payloads from memory and records which experts it served.
struct MemLoader {
    payloads: Vec<Vec<u8>>,
    experts: u32,
    served: Arc<std::sync::Mutex<Vec<(u32, u32)>>>,
}

impl ExpertLoader for MemLoader {
    fn describe(&self) -> String {
        "memory (stand-in for safetensors)".into()
    }
    fn load(&mut self, layer: u32, requests: Vec<(u32, AlignedBuf)>, ready: &mut dyn FnMut(picchio_core::Loaded)) {
        for (expert, mut buf) in requests {
            let p = &self.payloads[(layer * self.experts + expert) as usize];
            buf.as_mut_slice()[..p.len()].copy_from_slice(p);
            self.served.lock().unwrap().push((layer, expert));
            ready(picchio_core::Loaded { key: picchio_core::ExpertKey { layer, expert }, buf, result: Ok(()) });
        }
    }
}

#[test]
fn flat_store_over_nvme_falls_back_for_the_reads_a_fault_failed() {
    use picchio_core::{FallbackLoader, IoStats};
    let dir = tempfile::tempdir().unwrap();
    let (path, _, payloads, image_len) = image(dir.path(), 4, 31, |i| 20_000 + i * 9_000);
    // Hung command → Abort; dropped completion → Abort fails → reset; CFS → reset.
    let faults: [fn(u64) -> Fault; 3] = [Fault::io_hold, Fault::io_drop, Fault::io_fatal];
    for (layer, fault) in faults.into_iter().enumerate() {
        let (mut q, sim) = NvmeQueue::open_sim(SimConfig::single(&path, 512), &fault_opts(2)).unwrap();
        fast_recovery(&mut q, 3);
        let stats = Arc::new(IoStats::default());
        let store = FlatStore::open(q, "nvme:sim", FlatStoreOptions { image_len, verify: true, ..Default::default() })
            .unwrap()
            .with_stats(stats.clone());
        let served = Arc::new(std::sync::Mutex::new(Vec::new()));
        let fallback = MemLoader { payloads: payloads.clone(), experts: 4, served: served.clone() };
        let mut loader = FallbackLoader::new(store, fallback, stats.clone());
        // The fault hits the first command of this layer's batch.
        sim.inject(fault(sim.io_count() + 1));
        let layer = layer as u32;
        let mut got = vec![];
        let reqs = (0..4).map(|e| (e, AlignedBuf::new(256 << 10, 4096).unwrap())).collect();
        loader.load(layer, reqs, &mut |l| {
            l.result.as_ref().unwrap_or_else(|e| panic!("{e}"));
            let p = &payloads[(layer * 4 + l.key.expert) as usize];
            assert!(l.buf.as_slice()[..p.len()] == p[..], "{}", l.key);
            got.push(l.key.expert);
        });
        got.sort_unstable();
        assert_eq!(got, vec![0, 1, 2, 3], "every expert delivered once");
        let snap = stats.snapshot();
        let fell_back = served.lock().unwrap().clone();
        assert!(!fell_back.is_empty(), "fault {layer}: the failed read was served by the fallback");
        assert_eq!(snap.fallbacks, fell_back.len() as u64);
        assert_eq!(snap.errors, fell_back.len() as u64, "exactly the failed reads fell back");
        assert!(fell_back.len() <= 2, "at most the 2 reads in flight failed: {fell_back:?}");
        // The next layer comes from the NVMe store again, with no fallback.
        let next = (layer + 1) % 4;
        let reqs = (0..4).map(|e| (e, AlignedBuf::new(256 << 10, 4096).unwrap())).collect();
        loader.load(next, reqs, &mut |l| {
            l.result.as_ref().unwrap_or_else(|e| panic!("{e}"));
            let p = &payloads[(next * 4 + l.key.expert) as usize];
            assert!(l.buf.as_slice()[..p.len()] == p[..], "{}", l.key);
        });
        assert_eq!(stats.snapshot().fallbacks, snap.fallbacks, "no fallback after recovery");
        assert_eq!(sim.stats().resets, u64::from(layer > 0), "hold: Abort only; drop and CFS: one reset");
    }
}

#[test]
fn shutdown_fails_when_csts_rdy_never_clears() {
    let dir = tempfile::tempdir().unwrap();
    let (a, _) = backing(dir.path(), "a", 1 << 20, 1);
    let mut cfg = SimConfig::single(&a, 512);
    cfg.to = 1; // CAP.TO = 500 ms
    let dma = HeapDma::new();
    let sim = Sim::start(cfg, dma.registry()).unwrap();
    let mut c = Controller::init(sim.bar(), Arc::new(dma), CtrlrOptions::default()).unwrap();
    assert!(!c.dma_stopped(), "a running controller may DMA");
    sim.ignore_disable(true);
    let e = c.shutdown().unwrap_err();
    assert!(matches!(e, Error::NotStopped { waited_ms: 500, .. }), "{e}");
    assert!(e.to_string().contains("CSTS.RDY still 1"), "{e}");
    assert!(!c.dma_stopped(), "an unconfirmed stop is not a stop");
    assert_eq!(sim.bar().read32(regs::CSTS) & 1, 1, "CSTS.RDY is still set");
    c.shutdown().unwrap(); // idempotent; the controller stays marked as possibly running
    assert!(!c.dma_stopped());
    drop(c); // leaks its queue memory (logged) instead of freeing it
}

#[test]
fn a_normal_shutdown_confirms_dma_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let (a, _) = backing(dir.path(), "a", 1 << 20, 1);
    let dma = HeapDma::new();
    let reg = dma.registry();
    let sim = Sim::start(SimConfig::single(&a, 512), dma.registry()).unwrap();
    let mut c = Controller::init(sim.bar(), Arc::new(dma), CtrlrOptions::default()).unwrap();
    c.shutdown().unwrap();
    assert!(c.dma_stopped());
    drop(c);
    assert_eq!(reg.count(), 0, "every DMA range released");
}
