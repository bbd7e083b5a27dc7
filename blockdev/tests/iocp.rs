//! `IocpQueue` on real files: overlapped unbuffered reads through an I/O completion port, checked
//! against the file's bytes, and its refusals, end of file, and drop with reads in the kernel.
#![cfg(windows)]

mod common;

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use common::{random_file, scratch, Rng};
use picchio_blockdev::{Error, IocpOptions, IocpQueue, MIN_REPORTED_BLOCK_SIZE};
use picchio_core::format::round_up;
use picchio_core::loader::StoreDims;
use picchio_core::{
    AlignedBuf, ByteOffset, Completion, ExpertLoader, FlatStore, FlatStoreOptions, FlatWriter, IoQueue, ReadReq, Tag,
};

/// 3 MiB and a ragged tail, so reads near the end come back short.
const FILE_LEN: usize = (3 << 20) + 1234;

fn typed(c: &Completion) -> &Error {
    let e = c.result.as_ref().expect_err("expected an error completion");
    e.get_ref().and_then(|e| e.downcast_ref::<Error>()).unwrap_or_else(|| panic!("untyped error: {e}"))
}

fn buf_for(q: &IocpQueue, len: u32) -> AlignedBuf {
    AlignedBuf::new((len as usize).max(1), q.block_size() as usize).expect("buffer")
}

fn read_one(q: &mut IocpQueue, offset: u64, len: u32) -> Completion {
    q.submit(ReadReq { offset: ByteOffset(offset), len, buf: buf_for(q, len), tag: Tag(offset) });
    let mut out = Vec::new();
    while out.is_empty() {
        q.reap(1, &mut out);
    }
    assert_eq!(out.len(), 1);
    out.pop().unwrap()
}

/// 300 random sector-aligned reads (some running past the end) submitted at once with `qd` in the
/// kernel; every completion's bytes equal the file's and short counts are exactly the bytes left.
fn random_reads(dir: &Path, qd: u32, seed: u64) {
    let (path, bytes) = random_file(dir, &format!("r{qd}"), FILE_LEN, seed);
    let mut q = IocpQueue::open(&path, IocpOptions::qd(qd)).unwrap();
    eprintln!("{}: {q:?}, block_size {}", path.display(), q.block_size());
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
fn random_reads_match_the_file_at_qd_1_and_32() {
    let dir = scratch();
    for qd in [1, 32] {
        random_reads(dir.path(), qd, 17 + u64::from(qd));
    }
}

#[test]
fn reap_waits_for_min_and_takes_what_is_ready() {
    let dir = scratch();
    let (path, bytes) = random_file(dir.path(), "f", 4 << 20, 11);
    let mut q = IocpQueue::open(&path, IocpOptions::qd(8)).unwrap();
    let mut out = Vec::new();
    assert_eq!(q.reap(usize::MAX, &mut out), 0, "nothing in flight: returns at once");
    for i in 0..64u64 {
        let offset = (i * 7 % 64) * 65536;
        q.submit(ReadReq { offset: ByteOffset(offset), len: 65536, buf: buf_for(&q, 65536), tag: Tag(offset) });
    }
    assert_eq!(q.in_flight(), 64);
    assert_eq!(q.reap(64, &mut out), 64);
    assert_eq!((out.len(), q.in_flight()), (64, 0));
    for c in &out {
        assert_eq!(*c.result.as_ref().unwrap(), 65536);
        let o = c.tag.0 as usize;
        assert!(c.buf.as_slice()[..65536] == bytes[o..o + 65536]);
    }
    // A `min` larger than what is in flight waits only for what is in flight.
    q.submit(ReadReq { offset: ByteOffset(0), len: 4096, buf: buf_for(&q, 4096), tag: Tag(1) });
    out.clear();
    assert_eq!(q.reap(10, &mut out), 1);
    assert_eq!(q.reap(0, &mut out), 0);
}

#[test]
fn misaligned_reads_complete_with_an_error_naming_the_offset() {
    let dir = scratch();
    let (path, bytes) = random_file(dir.path(), "f", 64 << 10, 5);
    let mut q = IocpQueue::open(&path, IocpOptions::qd(4)).unwrap();
    let a = q.alignment();
    eprintln!("unbuffered alignment in {}: {a:?}, block_size {}", dir.path().display(), q.block_size());
    assert!(a.offset >= 512 && a.offset.is_power_of_two(), "{a:?}");

    let c = read_one(&mut q, 100, 4096);
    assert!(matches!(typed(&c), Error::Misaligned { offset: 100, what: "offset", .. }), "{:?}", typed(&c));
    let msg = c.result.unwrap_err().to_string();
    assert!(msg.contains("offset 0x64") && msg.contains(&path.display().to_string()), "{msg}");

    let c = read_one(&mut q, 0, 100);
    assert!(matches!(typed(&c), Error::Misaligned { len: 100, what: "length", .. }), "{:?}", typed(&c));
    assert_eq!(c.result.unwrap_err().kind(), std::io::ErrorKind::InvalidInput);

    // A buffer whose address is not a multiple of the memory alignment (small alignments often
    // land on one by chance: keep the first that does not).
    let bufs: Vec<AlignedBuf> = (0..16).map(|_| AlignedBuf::new(a.offset as usize, 16).unwrap()).collect();
    if let Some(buf) = bufs.into_iter().find(|b| !(b.as_slice().as_ptr() as usize).is_multiple_of(a.mem as usize)) {
        q.submit(ReadReq { offset: ByteOffset(0), len: a.offset, buf, tag: Tag(9) });
        let mut out = Vec::new();
        q.reap(1, &mut out);
        let e = typed(&out[0]);
        assert!(matches!(e, Error::Misaligned { what: "buffer address", .. }), "{e:?}");
    } else {
        eprintln!("SKIP the buffer-address case: every 16-aligned buffer landed {}-aligned", a.mem);
    }

    // The queue is still healthy afterwards.
    let c = read_one(&mut q, 4096, 8192);
    assert_eq!(c.result.unwrap(), 8192);
    assert_eq!(&c.buf.as_slice()[..8192], &bytes[4096..12288]);
}

#[test]
fn a_length_beyond_the_buffer_is_refused() {
    let dir = scratch();
    let (path, _) = random_file(dir.path(), "f", 64 << 10, 6);
    let mut q = IocpQueue::open(&path, IocpOptions::qd(2)).unwrap();
    q.submit(ReadReq { offset: ByteOffset(0), len: 8192, buf: AlignedBuf::new(4096, 4096).unwrap(), tag: Tag(0) });
    let mut out = Vec::new();
    q.reap(1, &mut out);
    assert!(matches!(typed(&out[0]), Error::BufferTooSmall { buf_len: 4096, .. }), "{:?}", typed(&out[0]));
}

#[test]
fn reads_past_the_end_are_short_or_refused() {
    let dir = scratch();
    let len = 3 * 4096 + 1000;
    let (path, bytes) = random_file(dir.path(), "f", len, 9);
    let mut q = IocpQueue::open(&path, IocpOptions::qd(2)).unwrap();
    // Straddling the end: the bytes that exist, counted honestly.
    let c = read_one(&mut q, 8192, 8192);
    assert_eq!(c.result.unwrap(), 4096 + 1000);
    assert_eq!(&c.buf.as_slice()[..5096], &bytes[8192..]);
    // Starting at or after the end: an error naming the offset and the size.
    for offset in [4 * 4096, 64 * 4096] {
        let c = read_one(&mut q, offset, 4096);
        assert!(matches!(typed(&c), Error::PastEnd { .. }), "{:?}", typed(&c));
        let msg = c.result.unwrap_err().to_string();
        assert!(msg.contains(&format!("offset {offset:#x}")) && msg.contains(&format!("{len:#x} bytes")), "{msg}");
    }
}

#[test]
fn end_of_file_from_the_kernel_is_a_short_read() {
    // The file shrinks after open: the queue still believes the old size, so these reads reach
    // the kernel, which ends them with ERROR_HANDLE_EOF (or a short count).
    let dir = scratch();
    let (path, bytes) = random_file(dir.path(), "f", 16 * 4096, 21);
    let mut q = IocpQueue::open(&path, IocpOptions::qd(4)).unwrap();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(4 * 4096).unwrap();
    let c = read_one(&mut q, 8 * 4096, 4096);
    assert_eq!(c.result.unwrap(), 0, "read wholly past the new end");
    let c = read_one(&mut q, 2 * 4096, 4 * 4096);
    assert_eq!(c.result.unwrap(), 2 * 4096, "read across the new end");
    assert!(c.buf.as_slice()[..2 * 4096] == bytes[2 * 4096..4 * 4096]);
}

#[test]
fn dropping_with_reads_in_flight_neither_hangs_nor_loses_buffers() {
    let dir = scratch();
    let (path, _) = random_file(dir.path(), "f", 8 << 20, 13);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut q = IocpQueue::open(&path, IocpOptions::qd(32)).unwrap();
        for i in 0..256u64 {
            let offset = (i % 8) << 20;
            q.submit(ReadReq { offset: ByteOffset(offset), len: 1 << 20, buf: buf_for(&q, 1 << 20), tag: Tag(i) });
        }
        // Drop at once: 32 reads are in the kernel (cancelled or finishing), the rest wait in the
        // FIFO. Every buffer is freed only after its completion is dequeued.
        assert_eq!(q.in_flight(), 256);
        drop(q);
        // Dropping after some reaping, with completions left on the port, works too.
        let mut q = IocpQueue::open(&path, IocpOptions::qd(8)).unwrap();
        for i in 0..16u64 {
            q.submit(ReadReq { offset: ByteOffset(i << 16), len: 65536, buf: buf_for(&q, 65536), tag: Tag(i) });
        }
        let mut out = Vec::new();
        q.reap(1, &mut out);
        std::thread::sleep(Duration::from_millis(20));
        drop(q);
        tx.send(()).unwrap();
    });
    rx.recv_timeout(Duration::from_secs(120)).expect("drop with reads in flight hung");
}

#[test]
fn reads_started_on_one_thread_complete_on_another() {
    let dir = scratch();
    let (path, bytes) = random_file(dir.path(), "f", 1 << 20, 31);
    let mut q = IocpQueue::open(&path, IocpOptions::qd(16)).unwrap();
    for i in 0..64u64 {
        q.submit(ReadReq { offset: ByteOffset(i * 16384), len: 16384, buf: buf_for(&q, 16384), tag: Tag(i) });
    }
    let out = std::thread::spawn(move || {
        let mut out = Vec::new();
        while q.in_flight() > 0 {
            q.reap(1, &mut out);
        }
        out
    })
    .join()
    .unwrap();
    assert_eq!(out.len(), 64);
    for c in &out {
        let o = c.tag.0 as usize * 16384;
        assert_eq!(*c.result.as_ref().unwrap(), 16384);
        assert!(c.buf.as_slice()[..16384] == bytes[o..o + 16384]);
    }
}

#[test]
fn flat_store_loads_every_expert_through_iocp() {
    let dir = scratch();
    let path = dir.path().join("experts.picchioflat");
    let dims = StoreDims { hidden: 64, n_layers: 2, n_experts: 3, topk: 1, moe_inter: 128 };
    let mut rng = Rng::new(9);
    let payloads: Vec<Vec<u8>> = (0..6).map(|i| rng.bytes(3000 + i * 2500)).collect();
    let mut w = FlatWriter::create(&path, dims, 6).unwrap();
    for p in &payloads {
        w.push(p).unwrap();
    }
    w.finish().unwrap();

    let q = IocpQueue::open(&path, IocpOptions::default()).unwrap();
    let opts = FlatStoreOptions { base_offset: 0, image_len: q.len(), verify: true, expect: None };
    let mut store = FlatStore::open(q, path.display().to_string(), opts).unwrap_or_else(|e| panic!("{e}"));
    assert!(store.describe().contains("iocp(direct, qd 32)"), "{}", store.describe());
    let slot = round_up(16384, 4096) as usize;
    for layer in 0..2u32 {
        let reqs = (0..3).map(|e| (e, AlignedBuf::new(slot, 4096).unwrap())).collect();
        let mut n = 0;
        store.load(layer, reqs, &mut |l| {
            n += 1;
            l.result.unwrap_or_else(|e| panic!("{e}"));
            let p = &payloads[(l.key.layer * 3 + l.key.expert) as usize];
            assert!(l.buf.as_slice()[..p.len()] == p[..], "{}", l.key);
        });
        assert_eq!(n, 3);
    }
}

#[test]
fn opening_errors_name_the_path() {
    let dir = scratch();
    let missing = dir.path().join("missing.picchioflat");
    let e = IocpQueue::open(&missing, IocpOptions::default()).unwrap_err();
    assert!(matches!(e, Error::Open { .. }) && e.to_string().contains("missing.picchioflat"), "{e}");
    let e = IocpQueue::open(dir.path(), IocpOptions::default()).unwrap_err();
    assert!(matches!(e, Error::UnsupportedTarget { kind: "directory", .. }), "{e}");
}
