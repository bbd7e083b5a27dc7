//! What the engines' unit tests share: a file of known bytes, and one read submitted and reaped.

use std::path::PathBuf;

use picchio_core::{AlignedBuf, ByteOffset, Completion, IoQueue, ReadReq, Tag};

/// A temporary directory holding `data`, a file of `len` bytes (byte `i` is `i * 31 % 251`); its
/// path and bytes.
pub(crate) fn file_with(len: usize) -> (tempfile::TempDir, PathBuf, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data");
    let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    std::fs::write(&path, &bytes).unwrap();
    (dir, path, bytes)
}

/// Submits a read of `len` bytes at `offset` (tagged with the offset, into a 4 KiB-aligned buffer)
/// and reaps until its completion arrives.
pub(crate) fn read(q: &mut dyn IoQueue, offset: u64, len: u32) -> Completion {
    let buf = AlignedBuf::new(len.max(1) as usize, 4096).unwrap();
    q.submit(ReadReq { offset: ByteOffset(offset), len, buf, tag: Tag(offset) });
    let mut out = Vec::new();
    while out.is_empty() {
        q.reap(1, &mut out);
    }
    out.pop().unwrap()
}
