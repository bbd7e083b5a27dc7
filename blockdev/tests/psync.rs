//! `PsyncQueue` on real files: the `IoQueue` conformance suite (picchio-testkit) buffered and with
//! O_DIRECT (in a directory where the file system supports it), and what only psync does.

mod common;

use std::collections::HashSet;
use std::path::Path;

use common::{buf_for, direct_scratch, random_file, read_one, scratch};
use picchio_blockdev::{DioAlign, Error, PsyncOptions, PsyncQueue, MIN_REPORTED_BLOCK_SIZE};
use picchio_core::{ByteOffset, IoQueue, ReadReq, Tag};
use picchio_testkit::conformance::{self, Engine};

/// Lends the suite a psync engine, buffered or direct, in its own scratch dir; queue depth `qd`
/// maps to `min(qd, 4)` worker threads.
fn with_psync(direct: bool, f: impl FnOnce(&Engine)) {
    let dir = if direct { direct_scratch("psync conformance") } else { scratch() };
    let probe = random_file(dir.path(), "probe", 4096, 1).0;
    let a = PsyncQueue::open(&probe, PsyncOptions { threads: 1, direct }).unwrap().alignment();
    assert_eq!(a == DioAlign::NONE, !direct, "{a:?}");
    let open = move |p: &Path, qd: u32| {
        let q = PsyncQueue::open(p, PsyncOptions { threads: qd.clamp(1, 4) as usize, direct }).unwrap();
        assert!(q.block_size() >= MIN_REPORTED_BLOCK_SIZE && q.block_size().is_multiple_of(q.alignment().mem));
        common::boxed(q)
    };
    f(&common::file_engine(if direct { "psync(direct)" } else { "psync(buffered)" }, dir.path(), &open, a));
}

fn with_buffered(f: impl FnOnce(&Engine)) {
    with_psync(false, f)
}

fn with_direct(f: impl FnOnce(&Engine)) {
    with_psync(true, f)
}

mod buffered {
    picchio_testkit::conformance_tests!(super::with_buffered);
}

mod direct {
    picchio_testkit::conformance_tests!(super::with_direct, aligned);
}

/// The suite runs depths 1 and 32 (1 and 4 threads); 2 threads as well.
#[test]
fn random_reads_match_the_file_with_2_threads() {
    with_buffered(|e| conformance::random_reads(e, 2, 19));
    with_direct(|e| conformance::random_reads(e, 2, 19));
}

#[test]
fn buffered_reads_need_no_alignment() {
    let dir = scratch();
    let (path, bytes) = random_file(dir.path(), "f", 10_000, 3);
    let mut q = PsyncQueue::open(&path, PsyncOptions::buffered(2)).unwrap();
    assert_eq!(q.alignment(), DioAlign::NONE);
    assert_eq!(q.block_size(), MIN_REPORTED_BLOCK_SIZE);
    let c = read_one(&mut q, 100, 333);
    assert_eq!(c.result.unwrap(), 333);
    assert_eq!(&c.buf.as_slice()[..333], &bytes[100..433]);
    let c = read_one(&mut q, 0, 0);
    assert_eq!(c.result.unwrap(), 0);
}

/// Every completion carries the time its read took (the suite's reap checks run on psync too).
#[test]
fn completions_carry_a_latency() {
    for direct in [false, true] {
        let dir = if direct { direct_scratch("completions_carry_a_latency") } else { scratch() };
        let (path, bytes) = random_file(dir.path(), "f", 1 << 20, 11);
        let mut q = PsyncQueue::open(&path, PsyncOptions { threads: 4, direct }).unwrap();
        for i in 0..64u64 {
            let offset = i * 16384;
            q.submit(ReadReq { offset: ByteOffset(offset), len: 16384, buf: buf_for(&q, 16384), tag: Tag(offset) });
        }
        let mut out = Vec::new();
        assert_eq!(q.reap(64, &mut out), 64);
        let tags: HashSet<u64> = out.iter().map(|c| c.tag.0).collect();
        assert_eq!(tags.len(), 64);
        for c in &out {
            assert_eq!(*c.result.as_ref().unwrap(), 16384);
            let o = c.tag.0 as usize;
            assert!(c.buf.as_slice()[..16384] == bytes[o..o + 16384]);
            assert!(c.latency_ns > 0);
        }
    }
}

#[test]
fn opening_errors_name_the_path() {
    let dir = scratch();
    let missing = dir.path().join("missing.picchioflat");
    let e = PsyncQueue::open(&missing, PsyncOptions::buffered(1)).unwrap_err();
    assert!(matches!(e, Error::Open { .. }) && e.to_string().contains("missing.picchioflat"), "{e}");
    let e = PsyncQueue::open(dir.path(), PsyncOptions::buffered(1)).unwrap_err();
    assert!(matches!(e, Error::UnsupportedTarget { kind: "directory", .. }), "{e}");
}

/// On tmpfs (`/dev/shm`): kernels before 6.6 refuse O_DIRECT there, and then the error advises
/// buffered reads and names the file; newer kernels accept it, and then direct reads work. Either way
/// the outcome is checked (no skip): `/dev/shm` is a tmpfs on every Linux this runs on.
#[cfg(target_os = "linux")]
#[test]
fn direct_on_a_file_system_without_o_direct_suggests_buffered() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap_or_else(|e| panic!("/dev/shm (a tmpfs on Linux): {e}"));
    let (path, bytes) = random_file(dir.path(), "f", 8192, 4);
    match PsyncQueue::open(&path, PsyncOptions::direct(1)) {
        Ok(mut q) => {
            eprintln!("tmpfs accepts O_DIRECT here ({q:?}): checking that direct reads work");
            let c = read_one(&mut q, 0, 4096);
            assert_eq!(c.result.unwrap(), 4096);
            assert!(c.buf.as_slice()[..4096] == bytes[..4096]);
        }
        Err(e) => {
            assert!(matches!(e, Error::DirectUnsupported { .. }), "{e}");
            assert!(
                e.to_string().contains("read it buffered instead (`direct: false`")
                    && e.to_string().contains("/dev/shm"),
                "{e}"
            );
        }
    }
}
