//! `IocpQueue` on real files: the `IoQueue` conformance suite (picchio-testkit) over overlapped
//! unbuffered reads through an I/O completion port, and what only IOCP does: end of file reported by
//! the kernel, completions reaped on another thread, a `FlatStore` over the queue. Runs under Wine
//! (tests/windows/run.sh).
#![cfg(windows)]

mod common;

use std::path::Path;

use common::{check_every_expert, random_file, scratch, write_image};
use picchio_blockdev::{Error, IocpOptions, IocpQueue, MIN_REPORTED_BLOCK_SIZE};
use picchio_core::format::round_up;
use picchio_core::loader::StoreDims;
use picchio_core::{
    AlignedBuf, ByteOffset, Completion, ExpertLoader, FlatStore, FlatStoreOptions, IoQueue, ReadReq, Tag,
};
use picchio_testkit::conformance::{Engine, Eof};

/// Lends the suite an IOCP engine (always unbuffered) of depth `qd` in its own scratch dir.
fn with_iocp(f: impl FnOnce(&Engine)) {
    let dir = scratch();
    let probe = random_file(dir.path(), "probe", 4096, 1).0;
    let a = IocpQueue::open(&probe, IocpOptions::qd(1)).unwrap().alignment();
    eprintln!("unbuffered alignment in {}: {a:?}", dir.path().display());
    assert!(a.offset >= 512 && a.offset.is_power_of_two(), "{a:?}");
    let open = |p: &Path, qd: u32| {
        let q = IocpQueue::open(p, IocpOptions::qd(qd)).unwrap();
        assert!(q.block_size() >= MIN_REPORTED_BLOCK_SIZE && q.block_size().is_multiple_of(q.alignment().mem));
        common::boxed(q)
    };
    f(&Engine {
        name: "iocp",
        dir: dir.path(),
        open: &open,
        align: a.offset,
        mem_align: a.mem,
        eof: Eof::Short,
        misaligned: &common::check_misaligned,
        past_end: &common::check_past_end,
        too_small: &common::check_too_small,
    });
}

mod suite {
    picchio_testkit::conformance_tests!(super::with_iocp, aligned);
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
    let payloads = write_image(&path, dims, 9, |i| 3000 + i * 2500);

    let q = IocpQueue::open(&path, IocpOptions::default()).unwrap();
    let opts = FlatStoreOptions { base_offset: 0, image_len: q.len(), verify: true, expect: None, recheck_every: 0 };
    let mut store = FlatStore::open(q, path.display().to_string(), opts).unwrap_or_else(|e| panic!("{e}"));
    assert!(store.describe().contains("iocp(direct, qd 32)"), "{}", store.describe());
    check_every_expert(&mut store, dims, &payloads, round_up(16384, 4096) as usize);
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
