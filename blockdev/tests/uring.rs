//! `UringQueue` on real files (O_DIRECT under `CARGO_TARGET_TMPDIR` where the file system supports
//! it, buffered everywhere) and on a loop device when root: random reads at queue depths 1-256 equal
//! the file, refused and failing requests complete with typed errors, dropping with reads in flight
//! is safe, and a `FlatStore` over the queue loads byte-identical experts. Every test first probes
//! io_uring and prints `SKIPPED: io_uring unavailable: ...` when the kernel or a seccomp filter
//! refuses it.
#![cfg(target_os = "linux")]

mod common;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{direct_scratch, random_file, scratch, Rng};
use picchio_blockdev::{Error, PsyncOptions, PsyncQueue, UringOptions, UringQueue, MIN_REPORTED_BLOCK_SIZE};
use picchio_core::format::round_up;
use picchio_core::loader::StoreDims;
use picchio_core::{
    AlignedBuf, ByteOffset, Completion, ExpertKey, ExpertLoader, FlatStore, FlatStoreOptions, FlatWriter, IoQueue,
    LoadError, ReadReq, Tag, BLOCK_SIZE,
};

/// 3 MiB and a ragged tail, so reads near the end come back short.
const FILE_LEN: usize = (3 << 20) + 1234;

/// Whether io_uring works here; prints the visible skip line when it does not.
fn uring_available(test: &str) -> bool {
    match UringQueue::probe() {
        Ok(()) => true,
        Err(e) => {
            eprintln!("SKIPPED: io_uring unavailable: {test}: {e}");
            false
        }
    }
}

/// Buffered in a scratch dir, and direct where the file system supports O_DIRECT.
fn modes(test: &str) -> Vec<(bool, tempfile::TempDir)> {
    let mut v = vec![(false, scratch())];
    if let Some(d) = direct_scratch(test) {
        v.push((true, d));
    }
    v
}

fn buf(len: u32) -> AlignedBuf {
    AlignedBuf::new((len as usize).max(4096), 4096).unwrap()
}

fn typed(c: &Completion) -> &Error {
    let e = c.result.as_ref().expect_err("expected an error completion");
    e.get_ref().and_then(|e| e.downcast_ref::<Error>()).unwrap_or_else(|| panic!("untyped error: {e}"))
}

fn reap_all(q: &mut UringQueue) -> Vec<Completion> {
    let mut out = Vec::new();
    while q.in_flight() > 0 {
        q.reap(1, &mut out);
    }
    out
}

fn read_one(q: &mut UringQueue, offset: u64, len: u32) -> Completion {
    q.submit(ReadReq { offset: ByteOffset(offset), len, buf: buf(len), tag: Tag(offset) });
    let mut out = reap_all(q);
    assert_eq!(out.len(), 1);
    out.pop().unwrap()
}

/// 400 random reads (aligned to what the mode needs, some running past the end) at depth `qd`, all
/// submitted before the first reap; every completion's bytes equal the file's and short counts are
/// exactly the bytes left.
fn random_reads(path: &Path, bytes: &[u8], opts: UringOptions, seed: u64) {
    let mut q = UringQueue::open(path, opts).unwrap();
    assert_eq!(q.len(), bytes.len() as u64);
    let step = u64::from(q.alignment().offset);
    assert!(q.block_size() >= MIN_REPORTED_BLOCK_SIZE && q.block_size().is_multiple_of(q.alignment().mem));
    let mut rng = Rng::new(seed);
    let mut expect = Vec::new();
    let mut out = Vec::new();
    let n = 400u64;
    for i in 0..n {
        let blocks = bytes.len() as u64 / step;
        let offset = rng.below(blocks + 1) * step;
        let offset = if offset >= bytes.len() as u64 { offset - step } else { offset };
        let len = ((rng.below(256 << 10) / step).max(1) * step) as u32;
        expect.push((offset, len));
        q.submit(ReadReq { offset: ByteOffset(offset), len, buf: buf(len), tag: Tag(i) });
        // Reap what is there now and then, with reads still queued behind the depth.
        if i % 97 == 96 {
            q.reap(0, &mut out);
        }
    }
    while q.in_flight() > 0 {
        q.reap(1, &mut out);
    }
    check(&out, &expect, bytes, &q);
    expect_seen(&mut HashSet::new(), &out);
    assert_eq!(out.len(), n as usize, "{}: every read completes exactly once", q.describe());
}

fn expect_seen(seen: &mut HashSet<u64>, out: &[Completion]) {
    for c in out {
        assert!(seen.insert(c.tag.0), "tag {:?} completed twice", c.tag);
    }
}

fn check(out: &[Completion], expect: &[(u64, u32)], bytes: &[u8], q: &UringQueue) {
    for c in out {
        let (offset, len) = expect[c.tag.0 as usize];
        let n = c.result.as_ref().unwrap_or_else(|e| panic!("read {offset:#x}+{len}: {e}"));
        let want = (len as usize).min(bytes.len() - offset as usize);
        assert_eq!(*n as usize, want, "count of read {offset:#x}+{len} ({})", q.describe());
        assert!(c.buf.as_slice()[..want] == bytes[offset as usize..offset as usize + want], "bytes at {offset:#x}");
    }
}

#[test]
fn random_reads_match_the_file_at_qd_1_4_32_256() {
    let test = "random_reads_match_the_file_at_qd_1_4_32_256";
    if !uring_available(test) {
        return;
    }
    for (direct, dir) in modes(test) {
        let (path, bytes) = random_file(dir.path(), "r", FILE_LEN, 11);
        for qd in [1, 4, 32, 256] {
            let opts = UringOptions { qd, direct, ..UringOptions::default() };
            random_reads(&path, &bytes, opts, 100 + u64::from(qd));
            eprintln!("ran {test}: {}", UringQueue::open(&path, opts).unwrap().describe());
        }
        // An unregistered file and SQPOLL (root, or Linux 5.11+) read the same bytes.
        for opts in [
            UringOptions { register_files: false, ..UringOptions { qd: 8, direct, ..UringOptions::default() } },
            UringOptions { sqpoll: true, ..UringOptions { qd: 8, direct, ..UringOptions::default() } },
        ] {
            match UringQueue::open(&path, opts) {
                Ok(q) => {
                    let d = q.describe();
                    drop(q);
                    random_reads(&path, &bytes, opts, 7);
                    eprintln!("ran {test}: {d}");
                }
                Err(e @ Error::UringOption { flag: "--sqpoll", .. }) => eprintln!("SKIPPED {test}: {e}"),
                Err(e) => panic!("{e}"),
            }
        }
    }
}

#[test]
fn describe_and_sizes() {
    if !uring_available("describe_and_sizes") {
        return;
    }
    let dir = scratch();
    let (path, _) = random_file(dir.path(), "f", 10_000, 1);
    let q = UringQueue::open(&path, UringOptions::buffered(4)).unwrap();
    assert_eq!(q.describe(), "uring(buffered, qd 4, fixed file)");
    assert_eq!((q.len(), q.is_empty(), q.is_direct(), q.is_block_device()), (10_000, false, false, false));
    assert_eq!(q.block_size(), MIN_REPORTED_BLOCK_SIZE);
    if let Some(d) = direct_scratch("describe_and_sizes") {
        let (path, _) = random_file(d.path(), "f", 10_000, 1);
        let q = UringQueue::open(&path, UringOptions::default()).unwrap();
        assert_eq!(q.describe(), "uring(direct, qd 32, fixed file)");
        // The same alignment probe as psync.
        let p = PsyncQueue::open(&path, PsyncOptions::direct(1)).unwrap();
        assert_eq!((q.alignment(), q.block_size()), (p.alignment(), p.block_size()));
    }
}

#[test]
fn misaligned_requests_complete_with_an_error() {
    let test = "misaligned_requests_complete_with_an_error";
    if !uring_available(test) {
        return;
    }
    let Some(dir) = direct_scratch(test) else { return };
    let (path, bytes) = random_file(dir.path(), "f", 64 << 10, 2);
    let mut q = UringQueue::open(&path, UringOptions::direct(4)).unwrap();
    let a = q.alignment().offset;
    let cases = [(u64::from(a) / 2, a, "offset"), (0, a + a / 2, "length")];
    for (i, &(offset, len, _)) in cases.iter().enumerate() {
        q.submit(ReadReq { offset: ByteOffset(offset), len, buf: buf(len + a), tag: Tag(i as u64) });
    }
    // A good read between the bad ones is unaffected.
    q.submit(ReadReq { offset: ByteOffset(4096), len: 4096, buf: buf(4096), tag: Tag(9) });
    let mut out = reap_all(&mut q);
    out.sort_by_key(|c| c.tag.0);
    assert_eq!(out.len(), 3);
    for (c, &(offset, len, what)) in out.iter().zip(&cases) {
        let Error::Misaligned { what: w, align, .. } = typed(c) else { panic!("{:?}", typed(c)) };
        assert_eq!((*w, *align), (what, a));
        let e = c.result.as_ref().unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        let s = e.to_string();
        assert!(s.contains(&format!("{len} bytes at offset {offset:#x}")) && s.contains("f: O_DIRECT"), "{s}");
    }
    assert_eq!(*out[2].result.as_ref().unwrap(), 4096);
    assert!(out[2].buf.as_slice()[..4096] == bytes[4096..8192]);
}

#[test]
fn past_the_end_and_too_small_buffers() {
    if !uring_available("past_the_end_and_too_small_buffers") {
        return;
    }
    for (direct, dir) in modes("past_the_end_and_too_small_buffers") {
        let (path, bytes) = random_file(dir.path(), "f", 3 * 4096 + 100, 3);
        let mut q = UringQueue::open(&path, UringOptions { qd: 2, direct, ..UringOptions::default() }).unwrap();
        // Starting past the end: refused.
        let c = read_one(&mut q, 8 * 4096, 4096);
        let Error::PastEnd { size, .. } = typed(&c) else { panic!("{:?}", typed(&c)) };
        assert_eq!(*size, bytes.len() as u64);
        assert_eq!(c.result.as_ref().unwrap_err().kind(), std::io::ErrorKind::UnexpectedEof);
        // Running past the end: the bytes that exist.
        let c = read_one(&mut q, 2 * 4096, 4 * 4096);
        assert_eq!(*c.result.as_ref().unwrap(), 4096 + 100);
        assert!(c.buf.as_slice()[..4196] == bytes[8192..]);
        // Buffer shorter than the read.
        q.submit(ReadReq { offset: ByteOffset(0), len: 8192, buf: buf(4096), tag: Tag(5) });
        let c = reap_all(&mut q).pop().unwrap();
        assert!(matches!(typed(&c), Error::BufferTooSmall { buf_len: 4096, .. }), "{:?}", typed(&c));
        assert_eq!(c.tag, Tag(5));
    }
}

#[test]
fn drop_with_reads_in_flight_waits_for_them() {
    if !uring_available("drop_with_reads_in_flight_waits_for_them") {
        return;
    }
    for (direct, dir) in modes("drop_with_reads_in_flight_waits_for_them") {
        let (path, bytes) = random_file(dir.path(), "f", 4 << 20, 4);
        for reaped in [0usize, 1, 40] {
            let mut q = UringQueue::open(&path, UringOptions { qd: 32, direct, ..UringOptions::default() }).unwrap();
            // 300 reads of 256 KiB: 32 in the kernel, the rest waiting in the queue's FIFO.
            for i in 0..300u64 {
                let offset = (i % 16) * (256 << 10);
                q.submit(ReadReq { offset: ByteOffset(offset), len: 256 << 10, buf: buf(256 << 10), tag: Tag(i) });
            }
            let mut out = Vec::new();
            while out.len() < reaped {
                q.reap(1, &mut out);
            }
            assert!(q.in_flight() > 0);
            drop(q); // waits for the reads in the kernel, frees the waiting ones
            for c in &out {
                let off = (c.tag.0 % 16) as usize * (256 << 10);
                assert!(c.buf.as_slice()[..256 << 10] == bytes[off..off + (256 << 10)]);
            }
        }
        // The file and a new queue are fine afterwards.
        let mut q = UringQueue::open(&path, UringOptions { qd: 4, direct, ..UringOptions::default() }).unwrap();
        let c = read_one(&mut q, 4096, 4096);
        assert!(c.buf.as_slice()[..4096] == bytes[4096..8192]);
    }
}

#[test]
fn options_outside_the_range_are_refused() {
    for qd in [0, 257] {
        let e = UringQueue::open("/nonexistent", UringOptions::direct(qd)).unwrap_err();
        assert!(matches!(e, Error::InvalidOptions { .. }) && e.to_string().contains("--qd"), "{e}");
    }
    if !uring_available("options_outside_the_range_are_refused") {
        return;
    }
    let e = UringQueue::open("/nonexistent/x", UringOptions::direct(4)).unwrap_err();
    assert!(matches!(e, Error::Open { .. }) && e.to_string().contains("/nonexistent/x"), "{e}");
}

#[test]
fn iopoll_on_a_file_works_or_names_the_flag() {
    let test = "iopoll_on_a_file_works_or_names_the_flag";
    if !uring_available(test) {
        return;
    }
    let Some(dir) = direct_scratch(test) else { return };
    let (path, bytes) = random_file(dir.path(), "f", 1 << 20, 5);
    match UringQueue::open(&path, UringOptions { iopoll: true, ..UringOptions::direct(8) }) {
        Ok(mut q) => {
            let c = read_one(&mut q, 8192, 65536);
            assert!(c.buf.as_slice()[..65536] == bytes[8192..8192 + 65536]);
            eprintln!("ran {test}: {} works here", q.describe());
        }
        Err(e) => {
            assert!(matches!(e, Error::UringOption { flag: "--iopoll", .. }), "{e}");
            let s = e.to_string();
            assert!(s.contains("--iopoll") && s.contains("drop --iopoll") && s.contains("/f:"), "{s}");
            eprintln!("ran {test}: refused as expected here: {s}");
        }
    }
}

#[test]
fn uring_errors_display_their_cause_and_fix() {
    use std::error::Error as _;
    let e = Error::UringUnavailable {
        reason: "disabled by the sysctl kernel.io_uring_disabled = 2".into(),
        cause: Some(std::io::Error::from_raw_os_error(libc_eperm())),
    };
    let s = e.to_string();
    assert!(
        s.starts_with("io_uring is unavailable: disabled by")
            && s.ends_with("use the psync engine (PsyncQueue) instead"),
        "{s}"
    );
    assert!(e.source().is_some());
    let e = Error::UringOption { path: "/d".into(), flag: "--sqpoll", reason: "not permitted".into(), cause: None };
    assert_eq!(e.to_string(), "/d: io_uring --sqpoll: not permitted");
    assert!(e.source().is_none());
}

fn libc_eperm() -> i32 {
    1
}

// ---- FlatStore over UringQueue ----

const DIMS: StoreDims = StoreDims { hidden: 64, n_layers: 3, n_experts: 6, topk: 2, moe_inter: 128 };

/// An image of 3 layers × 6 experts with payloads of assorted (mostly unaligned) sizes.
fn image(dir: &Path) -> (PathBuf, Vec<Vec<u8>>) {
    let path = dir.join("experts.picchioflat");
    let n = (DIMS.n_layers * DIMS.n_experts) as usize;
    let mut rng = Rng::new(42);
    let payloads: Vec<Vec<u8>> = (0..n).map(|i| rng.bytes(1 + (i * 7919 + 3000) % 20_000)).collect();
    let mut w = FlatWriter::create(&path, DIMS, n as u32).unwrap();
    for p in &payloads {
        w.push(p).unwrap();
    }
    w.finish().unwrap();
    (path, payloads)
}

type Got = BTreeMap<u32, (AlignedBuf, Result<(), LoadError>)>;

fn load(store: &mut impl ExpertLoader, layer: u32, experts: &[u32]) -> Got {
    let slot = round_up(20_000, u64::from(BLOCK_SIZE)) as usize;
    let reqs = experts.iter().map(|&e| (e, AlignedBuf::new(slot, BLOCK_SIZE as usize).unwrap())).collect();
    let mut got = BTreeMap::new();
    store.load(layer, reqs, &mut |l| {
        assert!(got.insert(l.key.expert, (l.buf, l.result)).is_none(), "{} delivered twice", l.key);
    });
    assert_eq!(got.len(), experts.len());
    got
}

#[test]
fn flat_store_over_uring_loads_byte_identical_experts() {
    let test = "flat_store_over_uring_loads_byte_identical_experts";
    if !uring_available(test) {
        return;
    }
    for (direct, dir) in modes(test) {
        let (path, payloads) = image(dir.path());
        for qd in [1, 4, 32] {
            let q = UringQueue::open(&path, UringOptions { qd, direct, ..UringOptions::default() }).unwrap();
            let opts = FlatStoreOptions { image_len: q.len(), verify: true, ..Default::default() };
            let mut store = FlatStore::open(q, path.display().to_string(), opts).unwrap();
            let mode = if direct { "direct" } else { "buffered" };
            let d = store.describe();
            assert!(d.contains(&format!("uring({mode}, qd {qd}, fixed file)")), "{d}");
            for round in 0..2 {
                for layer in 0..DIMS.n_layers {
                    // All six experts of a layer at once: more than qd 1 and 4 hold in the kernel.
                    let order: Vec<u32> = if round == 0 { vec![5, 0, 3, 1, 4, 2] } else { vec![2, 4] };
                    for (expert, (buf, result)) in load(&mut store, layer, &order) {
                        let key = ExpertKey { layer, expert };
                        result.unwrap_or_else(|e| panic!("{key}: {e}"));
                        let p = &payloads[(layer * DIMS.n_experts + expert) as usize];
                        assert!(buf.as_slice()[..p.len()] == p[..], "{key}: bytes differ (qd {qd}, direct {direct})");
                    }
                }
            }
            let st = store.stats().snapshot();
            assert_eq!((st.reads, st.errors), (3 * 8, 0));
        }
    }
}

// ---- a real block device ----

/// A read-only loop device over a file, detached on drop.
struct Loop(PathBuf);

impl Loop {
    fn attach(file: &Path) -> Result<Loop, String> {
        let out = Command::new("losetup")
            .args(["--find", "--show", "--read-only", "--sector-size", "4096", "--direct-io=on"])
            .arg(file)
            .output()
            .map_err(|e| format!("cannot run losetup: {e}"))?;
        if !out.status.success() {
            return Err(format!("losetup failed: {}", String::from_utf8_lossy(&out.stderr).trim()));
        }
        Ok(Loop(String::from_utf8_lossy(&out.stdout).trim().into()))
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}

#[test]
fn loop_device_reads_at_depth_and_refuses_iopoll_by_name() {
    let test = "loop_device_reads_at_depth_and_refuses_iopoll_by_name";
    if !uring_available(test) {
        return;
    }
    let dir = scratch();
    let (path, bytes) = random_file(dir.path(), "img", 2 << 20, 6);
    let dev = match Loop::attach(&path) {
        Ok(d) => d,
        Err(why) => return eprintln!("SKIPPED {test}: no loop device (needs root): {why}"),
    };
    let mut q = UringQueue::open(&dev.0, UringOptions::direct(16)).unwrap();
    assert!(q.is_block_device());
    assert_eq!((q.len(), q.alignment().offset), (2 << 20, 4096));
    for i in 0..64u64 {
        let offset = (i * 7 % 500) * 4096;
        q.submit(ReadReq { offset: ByteOffset(offset), len: 16384, buf: buf(16384), tag: Tag(offset) });
    }
    for c in reap_all(&mut q) {
        let o = c.tag.0 as usize;
        assert_eq!(*c.result.as_ref().unwrap(), 16384);
        assert!(c.buf.as_slice()[..16384] == bytes[o..o + 16384]);
    }
    // The loop driver has no polled queues: --iopoll is refused at open, naming the flag.
    match UringQueue::open(&dev.0, UringOptions { iopoll: true, ..UringOptions::direct(4) }) {
        Ok(q) => eprintln!("{test}: {} works on this loop device", q.describe()),
        Err(e) => assert!(matches!(e, Error::UringOption { flag: "--iopoll", .. }), "{e}"),
    }
}
