//! `UringQueue` on real files: the `IoQueue` conformance suite (picchio-testkit) buffered and with
//! O_DIRECT (under `CARGO_TARGET_TMPDIR` where the file system supports it), more depths and ring
//! options, and a `FlatStore` over the queue loads byte-identical experts; on a loop device when root
//! (an ignored test, run by CI). Every test first requires io_uring: when the kernel or a seccomp
//! filter refuses it the test fails, naming why (`--io psync` is the fallback for users, not for
//! this suite).
#![cfg(target_os = "linux")]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{direct_scratch, random_file, scratch, write_image};
use picchio_blockdev::{Error, PsyncOptions, PsyncQueue, UringOptions, UringQueue, MIN_REPORTED_BLOCK_SIZE};
use picchio_core::format::round_up;
use picchio_core::loader::StoreDims;
use picchio_core::{
    AlignedBuf, ByteOffset, Completion, ExpertKey, ExpertLoader, FlatStore, FlatStoreOptions, IoQueue, LoadError,
    ReadReq, Tag, BLOCK_SIZE,
};
use picchio_testkit::conformance::{self, Engine};
use picchio_testkit::loopdev::{LoopDevice, LoopOptions};

/// Panics, naming `test` and the reason, unless io_uring works here.
fn require_uring(test: &str) {
    if let Err(e) = UringQueue::probe() {
        panic!("{test}: io_uring unavailable here (kernel, sysctl or seccomp): {e}");
    }
}

/// Buffered in a scratch dir, and direct in a directory that supports O_DIRECT.
fn modes(test: &str) -> Vec<(bool, tempfile::TempDir)> {
    vec![(false, scratch()), (true, direct_scratch(test))]
}

/// Lends the suite an io_uring engine (buffered or direct) whose depth-`qd` queues use `opts(qd)`.
fn with_uring_opts(direct: bool, opts: impl Fn(u32) -> UringOptions + Sync, f: impl FnOnce(&Engine)) {
    require_uring("uring conformance");
    let dir = if direct { direct_scratch("uring conformance") } else { scratch() };
    let probe = random_file(dir.path(), "probe", 4096, 1).0;
    let a = UringQueue::open(&probe, opts(1)).unwrap().alignment();
    let open = |p: &Path, qd: u32| {
        let q = UringQueue::open(p, opts(qd)).unwrap();
        assert_eq!(q.len(), std::fs::metadata(p).unwrap().len());
        assert!(q.block_size() >= MIN_REPORTED_BLOCK_SIZE && q.block_size().is_multiple_of(q.alignment().mem));
        common::boxed(q)
    };
    let name = UringQueue::open(&probe, opts(32)).unwrap().describe();
    f(&common::file_engine(&name, dir.path(), &open, a));
}

fn with_buffered(f: impl FnOnce(&Engine)) {
    with_uring_opts(false, |qd| UringOptions { qd, direct: false, ..UringOptions::default() }, f)
}

fn with_direct(f: impl FnOnce(&Engine)) {
    with_uring_opts(true, |qd| UringOptions { qd, direct: true, ..UringOptions::default() }, f)
}

mod buffered {
    picchio_testkit::conformance_tests!(super::with_buffered);
}

mod direct {
    picchio_testkit::conformance_tests!(super::with_direct, aligned);
}

fn buf(len: u32) -> AlignedBuf {
    AlignedBuf::new((len as usize).max(4096), 4096).unwrap()
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

/// The suite's random reads at the depths it does not run (4 and 256; it runs 1 and 32), with an
/// unregistered file, and with SQPOLL (root, or Linux 5.11+; refused by name otherwise, which fails).
#[test]
fn random_reads_match_the_file_at_qd_4_256_unregistered_and_sqpoll() {
    let test = "random_reads_match_the_file_at_qd_4_256_unregistered_and_sqpoll";
    require_uring(test);
    for direct in [false, true] {
        for qd in [4, 256] {
            with_uring_opts(
                direct,
                move |_| UringOptions { qd, direct, ..UringOptions::default() },
                |e| {
                    conformance::random_reads(e, qd, 100 + u64::from(qd));
                    eprintln!("ran {test}: {}", e.name);
                },
            );
        }
        with_uring_opts(
            direct,
            move |_| UringOptions {
                register_files: false,
                ..UringOptions { qd: 8, direct, ..UringOptions::default() }
            },
            |e| conformance::random_reads(e, 8, 7),
        );
        with_uring_opts(
            direct,
            move |_| UringOptions { sqpoll: true, ..UringOptions { qd: 8, direct, ..UringOptions::default() } },
            |e| conformance::random_reads(e, 8, 7),
        );
    }
}

#[test]
fn describe_and_sizes() {
    require_uring("describe_and_sizes");
    let dir = scratch();
    let (path, _) = random_file(dir.path(), "f", 10_000, 1);
    let q = UringQueue::open(&path, UringOptions::buffered(4)).unwrap();
    assert_eq!(q.describe(), "uring(buffered, qd 4, fixed file)");
    assert_eq!((q.len(), q.is_empty(), q.is_direct(), q.is_block_device()), (10_000, false, false, false));
    assert_eq!(q.block_size(), MIN_REPORTED_BLOCK_SIZE);
    {
        let d = direct_scratch("describe_and_sizes");
        let (path, _) = random_file(d.path(), "f", 10_000, 1);
        let q = UringQueue::open(&path, UringOptions::default()).unwrap();
        assert_eq!(q.describe(), "uring(direct, qd 32, fixed file)");
        // The same alignment probe as psync.
        let p = PsyncQueue::open(&path, PsyncOptions::direct(1)).unwrap();
        assert_eq!((q.alignment(), q.block_size()), (p.alignment(), p.block_size()));
    }
}

#[test]
fn options_outside_the_range_are_refused() {
    for qd in [0, 257] {
        let e = UringQueue::open("/nonexistent", UringOptions::direct(qd)).unwrap_err();
        assert!(matches!(e, Error::OptionOutOfRange { option: "UringOptions::qd", .. }), "{e}");
        assert!(e.to_string().contains("UringOptions::qd"), "{e}");
    }
    require_uring("options_outside_the_range_are_refused");
    let e = UringQueue::open("/nonexistent/x", UringOptions::direct(4)).unwrap_err();
    assert!(matches!(e, Error::Open { .. }) && e.to_string().contains("/nonexistent/x"), "{e}");
}

#[test]
fn iopoll_on_a_file_works_or_names_the_option() {
    let test = "iopoll_on_a_file_works_or_names_the_option";
    require_uring(test);
    let dir = direct_scratch(test);
    let (path, bytes) = random_file(dir.path(), "f", 1 << 20, 5);
    match UringQueue::open(&path, UringOptions { iopoll: true, ..UringOptions::direct(8) }) {
        Ok(mut q) => {
            let c = read_one(&mut q, 8192, 65536);
            assert!(c.buf.as_slice()[..65536] == bytes[8192..8192 + 65536]);
            eprintln!("ran {test}: {} works here", q.describe());
        }
        Err(e) => {
            assert!(matches!(e, Error::UringOption { option: "iopoll", .. }), "{e}");
            let s = e.to_string();
            assert!(s.contains("io_uring iopoll") && s.contains("turn iopoll off") && s.contains("/f:"), "{s}");
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
    let e = Error::UringOption { path: "/d".into(), option: "sqpoll", reason: "not permitted".into(), cause: None };
    assert_eq!(e.to_string(), "/d: io_uring sqpoll: not permitted");
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
    let payloads = write_image(&path, DIMS, 42, |i| 1 + (i * 7919 + 3000) % 20_000);
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
    require_uring(test);
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

#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn loop_device_reads_at_depth_and_refuses_iopoll_by_name() {
    let test = "loop_device_reads_at_depth_and_refuses_iopoll_by_name";
    require_uring(test);
    let dir = scratch();
    let (path, bytes) = random_file(dir.path(), "img", 2 << 20, 6);
    let opts = LoopOptions { sector_size: 4096, direct_io: true, read_only: true, partscan: false };
    let dev = LoopDevice::attach_for_test(test, &path, opts);
    let mut q = UringQueue::open(&dev.dev, UringOptions::direct(16)).unwrap();
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
    // The loop driver has no polled queues: iopoll is refused at open, naming the option.
    match UringQueue::open(&dev.dev, UringOptions { iopoll: true, ..UringOptions::direct(4) }) {
        Ok(q) => eprintln!("{test}: {} works on this loop device", q.describe()),
        Err(e) => assert!(matches!(e, Error::UringOption { option: "iopoll", .. }), "{e}"),
    }
}
