//! `PsyncQueue` on real files: buffered everywhere, O_DIRECT where the file system supports it (probed;
//! the direct cases are skipped with a visible message otherwise).

mod common;

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use common::{buf_for, direct_scratch, random_file, read_one, scratch, Rng};
use picchio_blockdev::{DioAlign, Error, PsyncOptions, PsyncQueue, MIN_REPORTED_BLOCK_SIZE};
use picchio_core::{ByteOffset, Completion, IoQueue, ReadReq, Tag};

/// 3 MiB and a ragged tail, so reads near the end come back short.
const FILE_LEN: usize = (3 << 20) + 1234;

fn typed(c: &Completion) -> &Error {
    let e = c.result.as_ref().expect_err("expected an error completion");
    e.get_ref().and_then(|e| e.downcast_ref::<Error>()).unwrap_or_else(|| panic!("untyped error: {e}"))
}

fn modes(test: &str) -> Vec<(PsyncOptions, tempfile::TempDir)> {
    let mut v = vec![(PsyncOptions::buffered(1), scratch())];
    if let Some(d) = direct_scratch(test) {
        v.push((PsyncOptions::direct(1), d));
    }
    v
}

/// Random reads (aligned to what the mode requires, some running past the end) with `threads` workers;
/// every completion's bytes equal the file's and short counts are exactly the bytes left.
fn random_reads(dir: &Path, direct: bool, threads: usize, seed: u64) {
    let (path, bytes) = random_file(dir, &format!("r{threads}"), FILE_LEN, seed);
    let mut q = PsyncQueue::open(&path, PsyncOptions { threads, direct }).unwrap();
    assert_eq!(q.len(), FILE_LEN as u64);
    let step = u64::from(q.alignment().offset);
    assert!(q.block_size() >= MIN_REPORTED_BLOCK_SIZE && q.block_size().is_multiple_of(q.alignment().mem));
    let mut rng = Rng::new(seed ^ 0x9e37);
    let mut expect = Vec::new();
    for i in 0..300u64 {
        let blocks = FILE_LEN as u64 / step;
        let offset = rng.below(blocks + 1) * step;
        let offset = if offset >= FILE_LEN as u64 { offset - step } else { offset };
        let len = ((rng.below(256 << 10) / step).max(1) * step) as u32;
        expect.push((offset, len));
        q.submit(ReadReq { offset: ByteOffset(offset), len, buf: buf_for(&q, len), tag: Tag(i) });
    }
    assert_eq!(q.in_flight(), 300);
    let mut out = Vec::new();
    while q.in_flight() > 0 {
        q.reap(1, &mut out);
    }
    assert_eq!(out.len(), 300);
    let mut seen = HashSet::new();
    for c in &out {
        assert!(seen.insert(c.tag.0), "tag {:?} completed twice", c.tag);
        let (offset, len) = expect[c.tag.0 as usize];
        let n = c.result.as_ref().unwrap_or_else(|e| panic!("read {offset:#x}+{len}: {e}"));
        let want = (len as usize).min(FILE_LEN - offset as usize);
        assert_eq!(*n as usize, want, "count of read {offset:#x}+{len} ({})", q.describe());
        assert!(c.buf.as_slice()[..want] == bytes[offset as usize..offset as usize + want], "bytes at {offset:#x}");
    }
}

#[test]
fn random_reads_match_the_file_with_1_2_4_threads() {
    for (opts, dir) in modes("random_reads_match_the_file_with_1_2_4_threads") {
        for threads in [1, 2, 4] {
            random_reads(dir.path(), opts.direct, threads, 17 + threads as u64);
        }
    }
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

#[test]
fn misaligned_direct_reads_complete_with_an_error_naming_the_offset() {
    let Some(dir) = direct_scratch("misaligned_direct_reads_complete_with_an_error_naming_the_offset") else {
        return;
    };
    let (path, bytes) = random_file(dir.path(), "f", 64 << 10, 5);
    let mut q = PsyncQueue::open(&path, PsyncOptions::direct(2)).unwrap();
    let a = q.alignment();
    eprintln!("direct alignment in {}: {a:?}, block_size {}", dir.path().display(), q.block_size());
    assert!(a.offset >= 512 && a.offset.is_power_of_two(), "{a:?}");
    assert!(q.block_size() >= a.offset);

    let c = read_one(&mut q, 100, 4096);
    assert!(matches!(typed(&c), Error::Misaligned { offset: 100, what: "offset", .. }), "{:?}", typed(&c));
    let msg = c.result.unwrap_err().to_string();
    assert!(msg.contains("offset 0x64") && msg.contains(&path.display().to_string()), "{msg}");

    let c = read_one(&mut q, 0, 100);
    assert!(matches!(typed(&c), Error::Misaligned { len: 100, what: "length", .. }), "{:?}", typed(&c));
    assert_eq!(c.result.unwrap_err().kind(), std::io::ErrorKind::InvalidInput);

    // The queue is still healthy afterwards.
    let c = read_one(&mut q, 4096, 8192);
    assert_eq!(c.result.unwrap(), 8192);
    assert_eq!(&c.buf.as_slice()[..8192], &bytes[4096..12288]);
}

#[test]
fn reads_past_the_end_are_short_or_refused() {
    for (opts, dir) in modes("reads_past_the_end_are_short_or_refused") {
        let len = 3 * 4096 + 1000;
        let (path, bytes) = random_file(dir.path(), "f", len, 9);
        let mut q = PsyncQueue::open(&path, PsyncOptions { threads: 2, ..opts }).unwrap();
        // Straddling the end: the bytes that exist, counted honestly.
        let c = read_one(&mut q, 8192, 8192);
        assert_eq!(c.result.unwrap(), 4096 + 1000, "{}", q.describe());
        assert_eq!(&c.buf.as_slice()[..5096], &bytes[8192..]);
        // Starting at or after the end: an error naming the offset and the size.
        for offset in [4 * 4096, 64 * 4096] {
            let c = read_one(&mut q, offset, 4096);
            assert!(matches!(typed(&c), Error::PastEnd { .. }), "{:?}", typed(&c));
            let msg = c.result.unwrap_err().to_string();
            assert!(msg.contains(&format!("offset {offset:#x}")) && msg.contains(&format!("{len:#x} bytes")), "{msg}");
        }
        if !opts.direct {
            let c = read_one(&mut q, len as u64, 1);
            assert!(matches!(typed(&c), Error::PastEnd { .. }));
        }
    }
}

#[test]
fn many_in_flight_then_reap_all() {
    for (opts, dir) in modes("many_in_flight_then_reap_all") {
        let (path, bytes) = random_file(dir.path(), "f", 4 << 20, 11);
        let mut q = PsyncQueue::open(&path, PsyncOptions { threads: 4, ..opts }).unwrap();
        let mut out = Vec::new();
        assert_eq!(q.reap(usize::MAX, &mut out), 0, "nothing in flight: returns at once");
        for i in 0..256u64 {
            let offset = (i * 7 % 256) * 16384;
            q.submit(ReadReq { offset: ByteOffset(offset), len: 16384, buf: buf_for(&q, 16384), tag: Tag(offset) });
        }
        assert_eq!(q.in_flight(), 256);
        assert_eq!(q.reap(256, &mut out), 256);
        assert_eq!((out.len(), q.in_flight()), (256, 0));
        let tags: HashSet<u64> = out.iter().map(|c| c.tag.0).collect();
        assert_eq!(tags.len(), 256);
        for c in &out {
            assert_eq!(*c.result.as_ref().unwrap(), 16384);
            let o = c.tag.0 as usize;
            assert!(c.buf.as_slice()[..16384] == bytes[o..o + 16384]);
            assert!(c.latency_ns > 0);
        }
        // A `min` larger than what is in flight waits only for what is in flight.
        q.submit(ReadReq { offset: ByteOffset(0), len: 4096, buf: buf_for(&q, 4096), tag: Tag(1) });
        out.clear();
        assert_eq!(q.reap(10, &mut out), 1);
        assert_eq!(q.reap(0, &mut out), 0);
    }
}

#[test]
fn dropping_with_reads_in_flight_neither_hangs_nor_loses_buffers() {
    for (opts, dir) in modes("dropping_with_reads_in_flight_neither_hangs_nor_loses_buffers") {
        let (path, _) = random_file(dir.path(), "f", 8 << 20, 13);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut q = PsyncQueue::open(&path, PsyncOptions { threads: 2, ..opts }).unwrap();
            for i in 0..256u64 {
                let offset = (i % 8) << 20;
                q.submit(ReadReq { offset: ByteOffset(offset), len: 1 << 20, buf: buf_for(&q, 1 << 20), tag: Tag(i) });
            }
            // Drop at once: most reads are still queued, a few are in the kernel, some are done
            // and unreaped. All of their buffers are freed and the workers joined.
            assert_eq!(q.in_flight(), 256);
            drop(q);
            tx.send(()).unwrap();
        });
        rx.recv_timeout(Duration::from_secs(120)).expect("drop with reads in flight hung");
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

#[cfg(target_os = "linux")]
#[test]
fn direct_on_a_file_system_without_o_direct_suggests_buffered() {
    // tmpfs refused O_DIRECT before Linux 6.6; newer kernels accept it.
    let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
        eprintln!("SKIP direct_on_a_file_system_without_o_direct_suggests_buffered: no /dev/shm");
        return;
    };
    let path = dir.path().join("f");
    std::fs::write(&path, [0u8; 4096]).unwrap();
    match PsyncQueue::open(&path, PsyncOptions::direct(1)) {
        Ok(q) => eprintln!(
            "SKIP direct_on_a_file_system_without_o_direct_suggests_buffered: tmpfs accepts O_DIRECT here ({q:?})"
        ),
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
