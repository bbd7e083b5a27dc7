//! Helpers shared by the integration tests: scratch directories on a real file system, an O_DIRECT
//! probe that skips visibly, deterministic pseudo-random bytes, and a read-and-reap helper.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use picchio_blockdev::{Error, PsyncOptions, PsyncQueue};
use picchio_core::{AlignedBuf, ByteOffset, Completion, IoQueue, ReadReq, Tag};

/// A scratch directory under cargo's per-target temp dir (on the build disk, so O_DIRECT usually
/// works even where /tmp is a tmpfs).
pub fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("scratch dir under CARGO_TARGET_TMPDIR")
}

/// A directory where O_DIRECT reads work: cargo's target temp dir, else the system temp dir.
/// `None` (after printing why) when neither supports them; callers skip their direct cases.
pub fn direct_scratch(test: &str) -> Option<tempfile::TempDir> {
    let candidates = [PathBuf::from(env!("CARGO_TARGET_TMPDIR")), std::env::temp_dir()];
    let mut why = Vec::new();
    for base in &candidates {
        let dir = tempfile::tempdir_in(base).expect("temp dir");
        let probe = dir.path().join("probe");
        std::fs::write(&probe, vec![0u8; 4096]).expect("write probe");
        match PsyncQueue::open(&probe, PsyncOptions::direct(1)) {
            Ok(_) => return Some(dir),
            Err(e @ Error::DirectUnsupported { .. }) => why.push(e.to_string()),
            Err(e) => panic!("probing O_DIRECT in {}: {e}", base.display()),
        }
    }
    eprintln!("SKIP {test} (direct cases): O_DIRECT is not supported here: {}", why.join("; "));
    None
}

/// Deterministic xorshift64* bytes/numbers.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| (self.next() >> 56) as u8).collect()
    }
}

/// Writes `len` pseudo-random bytes to `dir/name`, returning the path and the bytes.
pub fn random_file(dir: &Path, name: &str, len: usize, seed: u64) -> (PathBuf, Vec<u8>) {
    let path = dir.join(name);
    let bytes = Rng::new(seed).bytes(len);
    std::fs::write(&path, &bytes).expect("write test file");
    (path, bytes)
}

/// A buffer for `len` bytes aligned to the queue's block size.
pub fn buf_for(q: &PsyncQueue, len: u32) -> AlignedBuf {
    AlignedBuf::new((len as usize).max(1), q.block_size() as usize).expect("buffer")
}

/// Submits one read and reaps its completion.
pub fn read_one(q: &mut PsyncQueue, offset: u64, len: u32) -> Completion {
    let buf = buf_for(q, len);
    q.submit(ReadReq { offset: ByteOffset(offset), len, buf, tag: Tag(offset) });
    let mut out = Vec::new();
    while out.is_empty() {
        q.reap(1, &mut out);
    }
    assert_eq!(out.len(), 1);
    out.pop().unwrap()
}
