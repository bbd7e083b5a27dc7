//! Helpers shared by blockdev's integration tests: scratch directories (the test kit's), a directory
//! where O_DIRECT works, seeded bytes ([`picchio_core::rng::SplitMix64`]), a read-and-reap helper,
//! the checks of blockdev's typed errors the conformance suite calls, and [`open_store`] (a flat
//! store over a psync queue in one call).
#![allow(dead_code)]

use std::io;
use std::path::{Path, PathBuf};

use picchio_blockdev::{DioAlign, Error, PsyncOptions, PsyncQueue};
use picchio_core::{
    AlignedBuf, ByteOffset, Completion, FlatStore, FlatStoreOptions, IoQueue, ReadReq, StoreExpect, Tag,
};
use picchio_testkit::conformance::{Engine, Eof, Misalign, OpenFn};

#[allow(unused_imports)] // some test binaries draw no numbers of their own
pub use picchio_core::rng::SplitMix64 as Rng;

/// A scratch directory under cargo's per-target temp dir (on the build disk, so O_DIRECT usually
/// works even where /tmp is a tmpfs).
pub fn scratch() -> tempfile::TempDir {
    picchio_testkit::scratch!()
}

/// A directory where O_DIRECT reads work: cargo's target temp dir, else the system temp dir.
///
/// # Panics
/// When neither supports O_DIRECT (naming both and why): the direct cases are part of the suite,
/// and every disk file system Linux, Windows and tmpfs since Linux 6.6 support it — put the target
/// directory (`CARGO_TARGET_DIR`) on one.
pub fn direct_scratch(test: &str) -> tempfile::TempDir {
    let candidates = [PathBuf::from(env!("CARGO_TARGET_TMPDIR")), std::env::temp_dir()];
    let mut why = Vec::new();
    for base in &candidates {
        let dir = picchio_testkit::scratch::dir_in(base);
        let probe = dir.path().join("probe");
        std::fs::write(&probe, vec![0u8; 4096]).expect("write probe");
        match PsyncQueue::open(&probe, PsyncOptions::direct(1)) {
            Ok(_) => return dir,
            Err(e @ Error::DirectUnsupported { .. }) => why.push(e.to_string()),
            Err(e) => panic!("probing O_DIRECT in {}: {e}", base.display()),
        }
    }
    panic!(
        "{test} (direct cases): O_DIRECT is not supported in the target dir nor the temp dir: {}; \
         set CARGO_TARGET_DIR to a disk file system",
        why.join("; ")
    );
}

/// Writes `len` seeded bytes to `dir/name`, returning the path and the bytes.
pub fn random_file(dir: &Path, name: &str, len: usize, seed: u64) -> (PathBuf, Vec<u8>) {
    picchio_testkit::conformance::random_file(dir, name, len, seed)
}

/// Seeded images and their check ([`picchio_testkit::image`]).
#[allow(unused_imports)] // each test binary uses a subset
pub use picchio_testkit::image::{check_every_expert, write_image};

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

/// The typed blockdev error inside an I/O error of a completion.
pub fn typed_io(e: &io::Error) -> &Error {
    e.get_ref().and_then(|e| e.downcast_ref::<Error>()).unwrap_or_else(|| panic!("untyped error: {e}"))
}

/// The typed blockdev error of an error completion.
pub fn typed(c: &Completion) -> &Error {
    typed_io(c.result.as_ref().expect_err("expected an error completion"))
}

/// For the conformance suite: `e` is `Error::Misaligned` for `rule`, its message names the request
/// (`N bytes at offset 0x..`) and the file.
pub fn check_misaligned(e: &io::Error, rule: Misalign) {
    let t = typed_io(e);
    let Error::Misaligned { path, offset, len, what, .. } = t else { panic!("not Misaligned: {t:?}") };
    match rule {
        Misalign::Offset(o) => assert_eq!((*what, *offset), ("offset", o), "{t:?}"),
        Misalign::Length(l) => assert_eq!((*what, *len), ("length", l), "{t:?}"),
        Misalign::Buffer => assert_eq!(*what, "buffer address", "{t:?}"),
    }
    let msg = e.to_string();
    assert!(msg.contains(&format!("{len} bytes at offset {offset:#x}")), "{msg}");
    assert!(msg.contains(&path.display().to_string()) && msg.contains("O_DIRECT"), "{msg}");
}

/// For the conformance suite: `e` is `Error::PastEnd` of kind `UnexpectedEof` for the read at
/// `offset` of a file of `size` bytes, and its message names both.
pub fn check_past_end(e: &io::Error, offset: u64, size: u64) {
    let t = typed_io(e);
    let Error::PastEnd { offset: o, size: s, .. } = t else { panic!("not PastEnd: {t:?}") };
    assert_eq!((*o, *s), (offset, size), "{t:?}");
    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    let msg = e.to_string();
    assert!(msg.contains(&format!("offset {offset:#x}")) && msg.contains(&format!("{size:#x} bytes")), "{msg}");
}

/// For the conformance suite: `e` is `Error::BufferTooSmall` for a buffer of `buf_len` bytes.
pub fn check_too_small(e: &io::Error, buf_len: usize) {
    let t = typed_io(e);
    assert!(matches!(t, Error::BufferTooSmall { buf_len: b, .. } if *b == buf_len), "{t:?}");
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
}

/// Boxes a queue for the suite's opener.
pub fn boxed(q: impl IoQueue + 'static) -> Box<dyn IoQueue> {
    Box::new(q)
}

/// The conformance suite's description of one of this crate's file engines named `name`, whose
/// queues `open` opens on files in `dir` and which needs the alignment `align` (its probe's
/// [`DioAlign`]; `DioAlign::NONE` when buffered): a read across the end of a file is short (`pread`
/// semantics), and refusals are this crate's typed errors ([`check_misaligned`], [`check_past_end`],
/// [`check_too_small`]).
pub fn file_engine<'a>(name: &'a str, dir: &'a Path, open: &'a OpenFn<'a>, align: DioAlign) -> Engine<'a> {
    Engine {
        name,
        dir,
        open,
        align: align.offset,
        mem_align: align.mem,
        eof: Eof::Short,
        misaligned: &check_misaligned,
        past_end: &check_past_end,
        too_small: &check_too_small,
    }
}

/// Opens the image at `path` (a file, or a block device holding the image from byte 0) with a
/// [`PsyncQueue`], and reads and checks its superblock and index with [`FlatStore::open`], using the
/// whole target as the image (`image_len` = [`PsyncQueue::len`]). `verify` checks every payload's
/// hash after reading it; `expect` checks the store against a model. Named by `path` in messages.
///
/// # Errors
/// The [`PsyncQueue::open`] errors, and [`Error::Store`] for whole-store faults (bad magic,
/// version, dimensions, index hash, truncated index).
pub fn open_store(
    path: &Path,
    opts: PsyncOptions,
    verify: bool,
    expect: Option<StoreExpect>,
) -> Result<FlatStore<PsyncQueue>, Error> {
    let queue = PsyncQueue::open(path, opts)?;
    let image_len = queue.len();
    let store_opts = FlatStoreOptions { base_offset: 0, image_len, verify, expect, recheck_every: 0 };
    Ok(FlatStore::open(queue, path.display().to_string(), store_opts)?)
}
