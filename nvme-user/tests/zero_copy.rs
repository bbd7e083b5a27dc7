//! Zero-copy reads into expert-cache slots lent from the driver's DMA pool, the bounce path for
//! other buffers, and NVM Write + Flush, all through the real driver against the controller model.
//!
//! The queues here use the VFIO data path (`open_sim_with(.., bounce = true)`): a buffer that is not
//! a pool slot goes through per-command bounce buffers, exactly as over VFIO, so `bounce_bytes` shows
//! which reads were copied.
#![cfg(target_os = "linux")]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use picchio_core::io::read_blocking;
use picchio_core::{AlignedBuf, ByteOffset, Completion, IoQueue, ReadReq, Tag};
use picchio_nvme::dma::hugepage_shortfall;
use picchio_nvme::engine::RecoveryPolicy;
use picchio_nvme::sim::{Fault, Sim, SimConfig};
use picchio_nvme::{HeapDma, NvmeQueue, NvmeQueueOptions, WriteReq};

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    picchio_core::rng::SplitMix64::new(seed).bytes(len)
}

fn backing(dir: &Path, len: usize, seed: u64) -> (PathBuf, Vec<u8>) {
    let bytes = pattern(len, seed);
    let p = dir.join("ns1");
    std::fs::write(&p, &bytes).unwrap();
    (p, bytes)
}

fn opts(qd: u16) -> NvmeQueueOptions {
    // Only a hang reaches 60 s: a loaded machine can stall the model's thread for seconds.
    NvmeQueueOptions { qd, timeout: Duration::from_secs(60), ..Default::default() }
}

/// Submits every `(offset, len, buf)` at once and returns the completions by tag (= index).
fn read_all(q: &mut NvmeQueue, reqs: Vec<(u64, u32, AlignedBuf)>) -> Vec<Completion> {
    let n = reqs.len();
    for (i, (offset, len, buf)) in reqs.into_iter().enumerate() {
        q.submit(ReadReq { offset: ByteOffset(offset), len, buf, tag: Tag(i as u64) });
    }
    let mut out = Vec::new();
    while out.len() < n {
        q.reap(1, &mut out);
    }
    out.sort_by_key(|c| c.tag.0);
    out
}

/// An expert-sized slot (2,654,208 B: one Qwen3-30B-A3B Q4 expert, padded) is larger than a 2 MiB
/// hugepage and than MDTS, so each read is several commands whose PRPs come from the slot's IOVAs.
const SLOT: usize = 2_654_208;

#[test]
fn slots_from_the_pool_are_read_with_no_copy_and_heap_buffers_bounce() {
    for lba in [512u32, 4096] {
        let dir = tempfile::tempdir().unwrap();
        let (path, file) = backing(dir.path(), 4 * SLOT + (1 << 20), 11 + u64::from(lba));
        let (mut q, sim) =
            NvmeQueue::open_sim_with(SimConfig::single(&path, lba), &opts(8), HeapDma::new(), true).expect("sim queue");
        assert_eq!(q.describe(), "nvme(sim, vfio data path, nsid 1, qd 8)");
        let mut alloc = q.slot_allocator(3, SLOT).expect("the sim's DMA memory holds the slots");
        assert!(alloc.describe().contains("3 slots of 2654208 B"), "{}", alloc.describe());
        assert!(q.describe().contains("zero-copy slots"), "{}", q.describe());
        let slots: Vec<AlignedBuf> = (0..3).map(|_| alloc.alloc(SLOT).unwrap()).collect();
        for s in &slots {
            assert_eq!(s.pool_name(), Some("nvme DMA slots"));
            assert_eq!((s.len(), s.addr() % 4096), (SLOT, 0));
        }
        let e = alloc.alloc(SLOT).unwrap_err();
        let why = std::error::Error::source(&e).map(ToString::to_string).unwrap_or_default();
        assert!(why.contains("all 3 slots are in use"), "{e}: {why}");
        assert!(alloc.alloc(SLOT + 4096).is_err(), "a slot cannot grow");

        // Expert-sized reads at LBA-aligned offsets that are not 4 KiB aligned (512-byte LBAs).
        let offsets = [0u64, u64::from(lba) * 3, SLOT as u64 + u64::from(lba)];
        let before = q.stats();
        let done = read_all(&mut q, offsets.iter().zip(slots).map(|(&o, b)| (o, SLOT as u32, b)).collect());
        let after = q.stats();
        for (c, &o) in done.iter().zip(&offsets) {
            assert_eq!(*c.result.as_ref().unwrap(), SLOT as u32);
            assert_eq!(c.buf.pool_name(), Some("nvme DMA slots"), "the slot came back");
            assert!(c.buf.as_slice() == &file[o as usize..o as usize + SLOT], "lba {lba} offset {o}");
        }
        assert_eq!(after.bounce_bytes, before.bounce_bytes, "no byte of a pool slot was copied");
        assert_eq!(after.zero_copy_reads - before.zero_copy_reads, 3);
        assert!(after.commands - before.commands >= 3 * SLOT.div_ceil(q.max_transfer()) as u64);

        // The same reads into heap buffers: identical bytes, every byte copied once.
        let heap = offsets.iter().map(|&o| (o, SLOT as u32, AlignedBuf::new(SLOT, 4096).unwrap())).collect();
        let again = read_all(&mut q, heap);
        let bounced = q.stats().bounce_bytes - after.bounce_bytes;
        assert_eq!(bounced, 3 * SLOT as u64);
        assert_eq!(q.bounce_bytes(), q.stats().bounce_bytes);
        for (a, b) in done.iter().zip(&again) {
            assert!(a.buf.as_slice() == b.buf.as_slice());
        }
        assert_eq!(sim.stats().dma_faults, 0);
        // Slots go back to the pool when dropped, and are lent again (zeroed).
        drop(done);
        let s = alloc.alloc(SLOT).unwrap();
        assert!(s.as_slice().iter().all(|&b| b == 0));
    }
}

#[test]
fn a_flat_store_with_pool_slots_copies_nothing() {
    use picchio_core::loader::StoreDims;
    use picchio_core::{ExpertLoader, FlatStore, FlatStoreOptions, FlatWriter, IoStats};
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img.picchioflat");
    let dims = StoreDims { hidden: 8, n_layers: 2, n_experts: 3, topk: 1, moe_inter: 16 };
    let payloads: Vec<Vec<u8>> = (0..6).map(|i| pattern(9000 + 4096 * i, 100 + i as u64)).collect();
    let mut w = FlatWriter::create(&img, dims, 6).unwrap();
    for p in &payloads {
        w.push(p).unwrap();
    }
    w.finish().unwrap();
    let (q, _sim) = NvmeQueue::open_sim_with(SimConfig::single(&img, 512), &opts(4), HeapDma::new(), true).unwrap();
    let len = std::fs::metadata(&img).unwrap().len();
    let stats = std::sync::Arc::new(IoStats::default());
    let opts = FlatStoreOptions { image_len: len, ..Default::default() };
    let mut store = FlatStore::open(q, "sim", opts).unwrap().with_stats(stats.clone());
    assert!(store.queue().bounce_bytes() > 0, "superblock and index were read into heap buffers");
    let slot_len = payloads.iter().map(Vec::len).max().unwrap().div_ceil(4096) * 4096;
    let mut alloc = store.slot_allocator(6, slot_len).expect("pool");
    for (layer, bounce) in [(0u32, false), (1, true)] {
        let requests = (0..3)
            .map(|e| {
                let buf =
                    if bounce { AlignedBuf::new(slot_len, 4096).unwrap() } else { alloc.alloc(slot_len).unwrap() };
                (e, buf)
            })
            .collect();
        let mut seen = 0;
        store.load(layer, requests, &mut |l| {
            l.result.unwrap();
            let p = &payloads[(l.key.layer * 3 + l.key.expert) as usize];
            assert!(&l.buf.as_slice()[..p.len()] == p.as_slice());
            seen += 1;
        });
        assert_eq!(seen, 3);
        let moved = stats.snapshot().bounce_bytes;
        if bounce {
            let padded: u64 = payloads[3..].iter().map(|p| p.len().div_ceil(4096) as u64 * 4096).sum();
            assert_eq!(moved, padded, "heap slots: every padded payload byte copied once");
        } else {
            assert_eq!(moved, 0, "pool slots: nothing copied (the open-time reads are not counted)");
        }
    }
}

#[test]
fn too_little_dma_memory_for_the_cache_falls_back_to_bounce_with_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let (path, file) = backing(dir.path(), 4 << 20, 5);
    let dma = HeapDma::new();
    dma.limit_regions(Some(1 << 20));
    let (mut q, _sim) = NvmeQueue::open_sim_with(SimConfig::single(&path, 4096), &opts(4), dma, true).unwrap();
    assert!(q.slot_allocator(4, 1 << 20).is_none(), "4 MiB of slots do not fit in the 1 MiB limit");
    assert!(!q.describe().contains("zero-copy"));
    let buf = read_blocking(&mut q, 1 << 20, 1 << 20).unwrap();
    assert!(buf.as_slice() == &file[1 << 20..2 << 20]);
    assert_eq!(q.stats().bounce_bytes, 1 << 20);
    assert_eq!(q.stats().zero_copy_reads, 0);
}

#[test]
fn the_shortfall_warning_says_how_many_hugepages_and_how_to_reserve_them() {
    let meminfo = "MemTotal: 1000 kB\nHugePages_Total:      64\nHugePages_Free:       10\nHugepagesize: 2048 kB\n";
    let m = hugepage_shortfall(61, 48, 2_654_208, meminfo, "Cannot allocate memory (os error 12)");
    assert!(m.contains("61 × 2 MiB hugepages for 48 slots of 2654208 B"), "{m}");
    assert!(m.contains("10 of the 64 reserved are free"), "{m}");
    assert!(m.contains("echo 115 > /proc/sys/vm/nr_hugepages"), "{m}");
    assert!(m.contains("bounce buffers") && m.contains("os error 12"), "{m}");
    let m = hugepage_shortfall(3, 1, 4096, "", "x");
    assert!(m.contains("free count is unknown") && m.contains("echo 3 >"), "{m}");
}

fn write(q: &mut NvmeQueue, offset: u64, buf: AlignedBuf, len: u32) -> std::io::Result<u32> {
    q.submit_write(WriteReq { offset: ByteOffset(offset), len, buf, tag: Tag(offset) });
    let mut out = Vec::new();
    while out.is_empty() {
        q.reap(1, &mut out);
    }
    out.pop().unwrap().result
}

#[test]
fn writes_then_flush_then_read_back_through_both_data_paths() {
    for (lba, bounce) in [(512u32, true), (4096, true), (4096, false)] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ns1");
        std::fs::write(&path, vec![0u8; 8 << 20]).unwrap();
        let mut cfg = SimConfig::single(&path, lba);
        cfg.namespaces[0].writable = true;
        let (mut q, sim) = NvmeQueue::open_sim_with(cfg, &opts(8), HeapDma::new(), bounce).unwrap();
        let mut alloc = q.slot_allocator(1, SLOT).unwrap();
        // From a heap buffer (bounced on the VFIO path) at an LBA-aligned, not 4 KiB aligned offset…
        let a = pattern(3 << 20, 7);
        let mut hb = AlignedBuf::new(a.len(), 4096).unwrap();
        hb.as_mut_slice().copy_from_slice(&a);
        let at_a = u64::from(lba);
        assert_eq!(write(&mut q, at_a, hb, a.len() as u32).unwrap(), a.len() as u32);
        let bounced = q.stats().bounce_bytes;
        assert_eq!(bounced, if bounce { a.len() as u64 } else { 0 });
        // …and from a pool slot (never copied).
        let b = pattern(SLOT, 8);
        let mut sb = alloc.alloc(SLOT).unwrap();
        sb.as_mut_slice().copy_from_slice(&b);
        let at_b = 4 << 20;
        assert_eq!(write(&mut q, at_b, sb, SLOT as u32).unwrap(), SLOT as u32);
        assert_eq!(q.stats().bounce_bytes, bounced, "a pool slot is written with no copy");
        q.flush().expect("flush");
        assert_eq!((q.stats().writes, q.stats().flushes), (2, 1));
        // Read back through the driver and from the backing file.
        let back = read_blocking(&mut q, at_a, a.len() as u32).unwrap();
        assert!(back.as_slice() == a.as_slice());
        let back = read_blocking(&mut q, at_b, SLOT as u32).unwrap();
        assert!(back.as_slice() == b.as_slice());
        let disk = std::fs::read(&path).unwrap();
        assert!(&disk[at_a as usize..at_a as usize + a.len()] == a.as_slice());
        assert!(&disk[at_b as usize..at_b as usize + SLOT] == b.as_slice());
        assert!(disk[..at_a as usize].iter().all(|&x| x == 0), "nothing written before the first LBA asked for");
        // Past the end: refused before any command, the queue keeps working.
        let e = write(&mut q, (8 << 20) - 4096, AlignedBuf::new(8192, 4096).unwrap(), 8192).unwrap_err();
        assert!(e.to_string().contains("NVMe write of 8192 bytes") && e.to_string().contains("past the end"), "{e}");
        assert_eq!(sim.stats().dma_faults, 0);
        q.flush().unwrap();
    }
}

#[test]
fn a_write_protected_namespace_fails_the_write_with_the_status() {
    let dir = tempfile::tempdir().unwrap();
    let (path, file) = backing(dir.path(), 1 << 20, 3);
    let (mut q, _sim) =
        NvmeQueue::open_sim_with(SimConfig::single(&path, 4096), &opts(4), HeapDma::new(), true).unwrap();
    let e = write(&mut q, 0, AlignedBuf::new(4096, 4096).unwrap(), 4096).unwrap_err().to_string();
    assert!(e.contains("NVMe write of namespace 1 at byte 0x0"), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), file, "the backing file is unchanged");
    assert_eq!(q.stats().errors, 1);
    q.flush().expect("flush still works");
}

/// Lets `flag` (returned) stop `q`: a hung read then waits for the flag, not for its abort (the
/// abort timeout is 60 s, far beyond the tests).
fn stoppable(q: &mut NvmeQueue) -> Arc<AtomicBool> {
    q.set_recovery(RecoveryPolicy { abort_timeout: Duration::from_secs(60), ..RecoveryPolicy::default() });
    let flag = Arc::new(AtomicBool::new(false));
    q.set_interrupt(flag.clone());
    flag
}

/// Submits `req` with the controller model holding it (neither executed nor completed until
/// released or aborted), and waits until the model has taken it: its buffer is then in flight. The
/// wait has no deadline: the model fetches the command as soon as the doorbell rings.
fn submit_held(q: &mut NvmeQueue, sim: &Sim, req: ReadReq) {
    sim.inject(Fault::io_hold(sim.io_count() + 1));
    let fired = sim.stats().faults_fired;
    q.submit(req);
    while sim.stats().faults_fired < fired + 1 {
        std::thread::yield_now();
    }
}

#[test]
fn a_slot_in_flight_when_the_queue_stops_is_quarantined_until_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let (path, file) = backing(dir.path(), 1 << 20, 77);
    // A per-command timeout far beyond the test: only the interrupt flag stops the queue.
    let o = NvmeQueueOptions { qd: 4, timeout: Duration::from_secs(600), ..Default::default() };
    let (mut q, sim) = NvmeQueue::open_sim_with(SimConfig::single(&path, 4096), &o, HeapDma::new(), true).unwrap();
    let flag = stoppable(&mut q);
    let mut alloc = q.slot_allocator(2, 8192).unwrap();
    let pool = q.slot_pools()[0].clone();
    let slot = alloc.alloc(8192).unwrap();
    let slot_addr = slot.addr();
    assert_eq!(pool.free_slots(), 1);

    // The device holds the read: the slot is in flight.
    submit_held(&mut q, &sim, ReadReq { offset: ByteOffset(0), len: 8192, buf: slot, tag: Tag(5) });
    flag.store(true, Ordering::Relaxed);
    let mut got = vec![];
    q.reap(1, &mut got);
    let c = got.pop().unwrap();
    assert_eq!(c.result.as_ref().unwrap_err().kind(), std::io::ErrorKind::Interrupted);
    assert_ne!(c.buf.addr(), slot_addr, "a fresh buffer comes back, not the slot the device may still write");
    assert_eq!((c.buf.pool_name(), c.buf.len()), (None, 8192));
    assert_eq!(pool.free_slots(), 1, "the slot is quarantined, not back on the free list");

    // The hung device finally does its DMA: into the quarantined slot, not the returned buffer.
    assert_eq!(sim.release_held(), 1);
    assert!(c.buf.as_slice().iter().all(|&b| b == 0), "the returned buffer was not written");
    // SAFETY: the quarantined slot's 8192 bytes at `slot_addr` stay allocated (the queue holds them, and
    // `pool` keeps the region mapped); the sim's write finished inside `release_held`, and nothing
    // writes them until the queue is dropped, so reading them here races with nothing.
    let quarantined = unsafe { std::slice::from_raw_parts(slot_addr as *const u8, 8192) };
    assert!(quarantined == &file[..8192], "the late DMA landed in the quarantined slot");

    drop(q); // shutdown confirms the controller stopped: the slot goes back
    assert_eq!(pool.free_slots(), 2);
    drop(c);
    assert_eq!(pool.free_slots(), 2, "the returned heap buffer was never a slot");
}

#[test]
fn a_controller_that_never_stops_leaks_the_slots_it_may_still_write() {
    // Whether the queue stopped first (slot quarantined) or was dropped with the read in flight.
    for stop_first in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = backing(dir.path(), 1 << 20, 78);
        let mut cfg = SimConfig::single(&path, 4096);
        cfg.to = 1; // CAP.TO = 500 ms: how long shutdown waits for CSTS.RDY = 0
        let o = NvmeQueueOptions { qd: 4, timeout: Duration::from_secs(600), ..Default::default() };
        let (mut q, sim) = NvmeQueue::open_sim_with(cfg, &o, HeapDma::new(), true).unwrap();
        let flag = stoppable(&mut q);
        let mut alloc = q.slot_allocator(3, 8192).unwrap();
        let pool = q.slot_pools()[0].clone();
        let idle = alloc.alloc(8192).unwrap();
        submit_held(
            &mut q,
            &sim,
            ReadReq { offset: ByteOffset(0), len: 8192, buf: alloc.alloc(8192).unwrap(), tag: Tag(1) },
        );
        if stop_first {
            flag.store(true, Ordering::Relaxed);
            let mut got = vec![];
            q.reap(1, &mut got);
            assert_eq!(got[0].buf.pool_name(), None, "a fresh buffer came back");
        }
        assert_eq!(pool.free_slots(), 1);
        sim.ignore_disable(true);
        drop(q); // CC.EN = 0 never clears CSTS.RDY: the error is logged and the slot leaked
        assert_eq!(pool.free_slots(), 1, "stop_first {stop_first}: the slot the device may write was not returned");
        drop(idle); // a slot the device was never given still comes back
        assert_eq!(pool.free_slots(), 2);
        assert_eq!(sim.bar().read32(picchio_nvme::spec::regs::CSTS) & 1, 1, "CSTS.RDY never cleared");
    }
}
