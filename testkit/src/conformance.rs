//! The `IoQueue` conformance suite: what every engine (psync buffered and direct, io_uring, IOCP, the
//! user-space NVMe driver on its controller model, the NVMe/TCP initiator on its in-process target
//! model) must do, written once.
//!
//! An engine test file describes its engine as an [`Engine`] (how to open a queue of a given depth on
//! a file, what alignment it needs, whether a read across the end is short or refused, and how to
//! recognise its typed errors) and expands [`conformance_tests!`](crate::conformance_tests), which
//! makes one `#[test]` per check:
//!
//! - [`random_reads`] at depth 1 and 32: every completion's bytes equal the file's, short counts are
//!   exactly the bytes left, each tag completes once, `in_flight` counts submitted-not-reaped.
//! - [`tags_round_trip`]: arbitrary tags (0, `u64::MAX`, ...) come back with their own read.
//! - [`reap_semantics`]: `reap` with nothing in flight returns at once; `min` above what is in
//!   flight waits only for what is in flight; `reap(0)` never waits.
//! - [`misaligned`]: a misaligned offset, length and buffer address are refused with the engine's
//!   error (kind `InvalidInput`) and the queue keeps working.
//! - [`past_end`]: reads starting at or after the end are refused; a read across the end is a short
//!   read of the bytes that exist (files) or refused (a namespace of whole blocks).
//! - [`too_small_buffer`]: a length beyond the buffer is refused.
//! - [`drop_in_flight`]: dropping a queue with reads queued, in the kernel and completed-unreaped
//!   neither hangs nor corrupts reaped buffers, and the file reads correctly afterwards.
//!
//! The files are written in the engine's scratch directory with [`picchio_core::rng::SplitMix64`]
//! bytes, one file per check, so checks running in parallel threads share nothing.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use picchio_core::rng::SplitMix64;
use picchio_core::{AlignedBuf, ByteOffset, Completion, IoQueue, ReadReq, Tag};

/// What a read that runs across the end of the data does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Eof {
    /// Completes with the bytes that exist (a file: `pread` semantics).
    Short,
    /// Is refused like a read that starts past the end (an NVMe namespace of whole LBAs).
    Refused,
}

/// Which alignment rule a request breaks (see [`Engine::misaligned`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Misalign {
    /// The offset (the request's offset is given).
    Offset(u64),
    /// The length (the request's length is given).
    Length(u32),
    /// The buffer's address.
    Buffer,
}

/// Opens a queue of depth `qd` on the file at the path.
pub type OpenFn<'a> = dyn Fn(&Path, u32) -> Box<dyn IoQueue> + Sync + 'a;

/// An engine under test.
pub struct Engine<'a> {
    /// For messages, e.g. `psync(direct)`.
    pub name: &'a str,
    /// Where the checks write their files (one per check).
    pub dir: &'a Path,
    /// Opens a queue of depth `qd` on a file.
    pub open: &'a OpenFn<'a>,
    /// Granularity of offsets and lengths the engine requires (1: any).
    pub align: u32,
    /// Alignment of buffer addresses the engine requires (1: any).
    pub mem_align: u32,
    /// A read across the end: short or refused. With [`Eof::Short`] files get a ragged tail of
    /// 1234 bytes, with [`Eof::Refused`] they are whole multiples of `align`.
    pub eof: Eof,
    /// Asserts that `err` is the engine's misalignment error for the rule given.
    pub misaligned: &'a (dyn Fn(&io::Error, Misalign) + Sync),
    /// Asserts that `err` is the engine's past-the-end error for a read at `offset` of a file of
    /// `size` bytes.
    pub past_end: &'a (dyn Fn(&io::Error, u64, u64) + Sync),
    /// Asserts that `err` is the engine's refusal of a length beyond a buffer of `buf_len` bytes.
    pub too_small: &'a (dyn Fn(&io::Error, usize) + Sync),
}

/// How long [`drop_in_flight`] waits for the drop to return: bounds a hang (a loaded machine is
/// slow, a deadlock is forever).
pub const DROP_LIMIT: Duration = Duration::from_secs(600);

/// Unit for reads the checks place by hand: 4096 bytes, or the engine's alignment if larger.
fn unit(e: &Engine) -> u64 {
    u64::from(e.align.max(4096))
}

/// The length of a check's file: `base` rounded down to `align`, plus a ragged tail for
/// [`Eof::Short`].
fn file_len(e: &Engine, base: usize) -> usize {
    let a = e.align as usize;
    let whole = base / a * a;
    match e.eof {
        Eof::Short => whole + 1234,
        Eof::Refused => whole,
    }
}

/// Writes `len` seeded bytes to `<dir>/<name>`.
pub fn random_file(dir: &Path, name: &str, len: usize, seed: u64) -> (PathBuf, Vec<u8>) {
    let path = dir.join(name);
    let bytes = SplitMix64::new(seed).bytes(len);
    std::fs::write(&path, &bytes).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    (path, bytes)
}

/// A buffer of at least `len` bytes (and 1) aligned to 4096 (every engine's memory alignment).
pub fn buf(len: u32) -> AlignedBuf {
    AlignedBuf::new((len as usize).max(1), 4096).expect("buffer")
}

/// Reaps until nothing is in flight.
pub fn reap_all(q: &mut dyn IoQueue) -> Vec<Completion> {
    let mut out = Vec::new();
    while q.in_flight() > 0 {
        q.reap(1, &mut out);
    }
    out
}

/// Submits one read (tag = offset) and reaps it.
pub fn read_one(q: &mut dyn IoQueue, offset: u64, len: u32) -> Completion {
    q.submit(ReadReq { offset: ByteOffset(offset), len, buf: buf(len), tag: Tag(offset) });
    let mut out = reap_all(q);
    assert_eq!(out.len(), 1, "{}: one read, one completion", q.describe());
    out.pop().unwrap()
}

fn err(c: &Completion) -> &io::Error {
    c.result.as_ref().err().unwrap_or_else(|| panic!("expected an error completion, got {:?}", c.result))
}

/// Asserts `c` read `want` bytes equal to `bytes[offset..offset + want]`.
fn check_bytes(c: &Completion, bytes: &[u8], offset: u64, want: usize, what: &str) {
    let n = c.result.as_ref().unwrap_or_else(|e| panic!("{what}: read {offset:#x}: {e}"));
    assert_eq!(*n as usize, want, "{what}: count of read at {offset:#x}");
    let o = offset as usize;
    assert!(c.buf.as_slice()[..want] == bytes[o..o + want], "{what}: bytes at {offset:#x}");
}

/// 300 random reads (offsets and lengths multiples of [`Engine::align`], up to 256 KiB, some
/// running past the end when [`Eof::Short`]) on a queue of depth `qd`, all submitted before most
/// are reaped (a non-blocking `reap(0)` every 97): every read completes exactly once, with the
/// file's bytes and exactly the count that exists; `in_flight` is submitted minus reaped throughout.
pub fn random_reads(e: &Engine, qd: u32, seed: u64) {
    let len = file_len(e, 3 << 20);
    let (path, bytes) = random_file(e.dir, &format!("random-qd{qd}"), len, seed);
    let mut q = (e.open)(&path, qd);
    let step = u64::from(e.align);
    let mut rng = SplitMix64::new(seed ^ 0x9e37);
    let mut expect = Vec::new();
    let mut out = Vec::new();
    let n = 300u64;
    for i in 0..n {
        let blocks = len as u64 / step;
        let offset = rng.below(blocks) * step;
        let mut rlen = (rng.below(256 << 10) / step).max(1) * step;
        if e.eof == Eof::Refused {
            rlen = rlen.min(len as u64 - offset);
        }
        expect.push((offset, rlen as u32));
        q.submit(ReadReq { offset: ByteOffset(offset), len: rlen as u32, buf: buf(rlen as u32), tag: Tag(i) });
        if i % 97 == 96 {
            q.reap(0, &mut out);
        }
        assert_eq!(q.in_flight(), (i + 1) as usize - out.len(), "{}: in_flight after {} submits", e.name, i + 1);
    }
    out.extend(reap_all(&mut *q));
    assert_eq!(out.len(), n as usize, "{} ({}): every read completes", e.name, q.describe());
    let mut seen = std::collections::HashSet::new();
    for c in &out {
        assert!(seen.insert(c.tag.0), "{}: tag {:?} completed twice", e.name, c.tag);
        let (offset, rlen) = expect[c.tag.0 as usize];
        let want = (rlen as usize).min(len - offset as usize);
        check_bytes(c, &bytes, offset, want, &format!("{} ({}) read +{rlen}", e.name, q.describe()));
    }
}

/// 64 reads of one unit each with arbitrary tags (0, 1, `u64::MAX`, `1 << 63`, random): each tag
/// comes back exactly once, with the bytes of its own read.
pub fn tags_round_trip(e: &Engine) {
    let u = unit(e);
    let (path, bytes) = random_file(e.dir, "tags", file_len(e, 64 * u as usize), 41);
    let mut q = (e.open)(&path, 8);
    let mut rng = SplitMix64::new(43);
    let mut tags: Vec<u64> = vec![0, 1, u64::MAX, 1 << 63];
    while tags.len() < 64 {
        let t = rng.next_u64();
        if !tags.contains(&t) {
            tags.push(t);
        }
    }
    let mut want = HashMap::new();
    for (i, &t) in tags.iter().enumerate() {
        let offset = (i as u64 * 37 % 64) * u;
        want.insert(t, offset);
        q.submit(ReadReq { offset: ByteOffset(offset), len: u as u32, buf: buf(u as u32), tag: Tag(t) });
    }
    let out = reap_all(&mut *q);
    assert_eq!(out.len(), 64, "{}", e.name);
    for c in &out {
        let offset = want.remove(&c.tag.0).unwrap_or_else(|| panic!("{}: unknown or repeated tag {:?}", e.name, c.tag));
        check_bytes(c, &bytes, offset, u as usize, &format!("{} tag {:#x}", e.name, c.tag.0));
    }
    assert!(want.is_empty(), "{}: tags never completed: {:?}", e.name, want.keys());
}

/// `reap(usize::MAX)` with nothing in flight returns 0 at once; `reap(64)` with 64 in flight returns
/// all 64; `reap(10)` with one in flight waits only for that one; `reap(0)` then returns 0.
pub fn reap_semantics(e: &Engine) {
    let u = unit(e);
    let (path, bytes) = random_file(e.dir, "reap", file_len(e, 64 * 16 * u as usize), 11);
    let mut q = (e.open)(&path, 8);
    let mut out = Vec::new();
    assert_eq!(q.reap(usize::MAX, &mut out), 0, "{}: nothing in flight: returns at once", e.name);
    let len = 16 * u as u32;
    for i in 0..64u64 {
        let offset = (i * 7 % 64) * u64::from(len);
        q.submit(ReadReq { offset: ByteOffset(offset), len, buf: buf(len), tag: Tag(offset) });
    }
    assert_eq!(q.in_flight(), 64);
    assert_eq!(q.reap(64, &mut out), 64, "{}", e.name);
    assert_eq!((out.len(), q.in_flight()), (64, 0));
    for c in &out {
        check_bytes(c, &bytes, c.tag.0, len as usize, e.name);
    }
    q.submit(ReadReq { offset: ByteOffset(0), len: u as u32, buf: buf(u as u32), tag: Tag(1) });
    out.clear();
    assert_eq!(q.reap(10, &mut out), 1, "{}: min above in_flight waits only for what is in flight", e.name);
    assert_eq!(q.reap(0, &mut out), 0, "{}", e.name);
}

/// A misaligned offset (`align / 2`), length (`align + align / 2`) and, when the engine needs
/// aligned memory and the allocator hands out a buffer that is not, buffer address: each completes
/// with the engine's error of kind `InvalidInput`; a good read submitted between them is unaffected
/// and the queue reads correctly afterwards.
///
/// # Panics
/// When the engine needs no alignment (`align == 1`): there is nothing to refuse.
pub fn misaligned(e: &Engine) {
    let a = e.align;
    assert!(a > 1, "{}: misaligned() needs an engine with an alignment", e.name);
    let u = unit(e);
    let (path, bytes) = random_file(e.dir, "misaligned", file_len(e, 16 * u as usize), 5);
    let mut q = (e.open)(&path, 4);
    let cases =
        [(u64::from(a) / 2, a, Misalign::Offset(u64::from(a) / 2)), (0, a + a / 2, Misalign::Length(a + a / 2))];
    for (i, &(offset, len, _)) in cases.iter().enumerate() {
        q.submit(ReadReq { offset: ByteOffset(offset), len, buf: buf(len + a), tag: Tag(i as u64) });
    }
    q.submit(ReadReq { offset: ByteOffset(u), len: u as u32, buf: buf(u as u32), tag: Tag(9) });
    let mut out = reap_all(&mut *q);
    out.sort_by_key(|c| c.tag.0);
    assert_eq!(out.len(), 3, "{}", e.name);
    for (c, &(_, _, rule)) in out.iter().zip(&cases) {
        let er = err(c);
        assert_eq!(er.kind(), io::ErrorKind::InvalidInput, "{}: {er}", e.name);
        (e.misaligned)(er, rule);
    }
    check_bytes(&out[2], &bytes, u, u as usize, &format!("{}: the good read between", e.name));

    if e.mem_align > 1 {
        // Small alignments often land on a multiple by chance: keep the first buffer that does not.
        let bufs: Vec<AlignedBuf> = (0..64).map(|_| AlignedBuf::new(a as usize + 64, 2).unwrap()).collect();
        match bufs.into_iter().find(|b| !(b.as_slice().as_ptr() as usize).is_multiple_of(e.mem_align as usize)) {
            Some(b) => {
                q.submit(ReadReq { offset: ByteOffset(0), len: a, buf: b, tag: Tag(10) });
                let c = reap_all(&mut *q).pop().unwrap();
                let er = err(&c);
                assert_eq!(er.kind(), io::ErrorKind::InvalidInput, "{}: {er}", e.name);
                (e.misaligned)(er, Misalign::Buffer);
            }
            None => {
                eprintln!("{}: buffer-address case not reached: every buffer landed {}-aligned", e.name, e.mem_align)
            }
        }
    }
    let c = read_one(&mut *q, 2 * u, 2 * u as u32);
    check_bytes(&c, &bytes, 2 * u, 2 * u as usize, &format!("{}: after the refusals", e.name));
}

/// Reads starting at or after the end are refused with the engine's past-the-end error (exactly at
/// the end too, when the end is aligned); a read across the end returns the bytes that exist
/// ([`Eof::Short`], a short read at end of file) or is refused ([`Eof::Refused`]).
pub fn past_end(e: &Engine) {
    let u = unit(e);
    let len = file_len(e, 3 * u as usize);
    let (path, bytes) = random_file(e.dir, "past-end", len, 9);
    let mut q = (e.open)(&path, 2);
    // Across the end.
    let at = 2 * u;
    let c = read_one(&mut *q, at, 2 * u as u32);
    match e.eof {
        Eof::Short => check_bytes(&c, &bytes, at, len - at as usize, &format!("{}: short read at end of file", e.name)),
        Eof::Refused => (e.past_end)(err(&c), at, len as u64),
    }
    // Wholly past the end.
    let first_past = (len as u64).div_ceil(u) * u;
    for offset in [first_past, first_past + 64 * u] {
        let c = read_one(&mut *q, offset, u as u32);
        (e.past_end)(err(&c), offset, len as u64);
    }
    if (len as u64).is_multiple_of(u64::from(e.align)) {
        let c = read_one(&mut *q, len as u64, e.align);
        (e.past_end)(err(&c), len as u64, len as u64);
    }
    // Still healthy.
    let c = read_one(&mut *q, 0, u as u32);
    check_bytes(&c, &bytes, 0, u as usize, &format!("{}: after the refusals", e.name));
}

/// A read of two units into a one-unit buffer is refused (tag kept), and the queue keeps working.
pub fn too_small_buffer(e: &Engine) {
    let u = unit(e);
    let (path, bytes) = random_file(e.dir, "small-buf", file_len(e, 4 * u as usize), 6);
    let mut q = (e.open)(&path, 2);
    q.submit(ReadReq {
        offset: ByteOffset(0),
        len: 2 * u as u32,
        buf: AlignedBuf::new(u as usize, 4096).unwrap(),
        tag: Tag(5),
    });
    let c = reap_all(&mut *q).pop().unwrap();
    assert_eq!(c.tag, Tag(5));
    (e.too_small)(err(&c), u as usize);
    let c = read_one(&mut *q, u, u as u32);
    check_bytes(&c, &bytes, u, u as usize, e.name);
}

/// Dropping queues with reads in flight, on a thread with a bounded wait ([`DROP_LIMIT`]): 256
/// reads of 1 MiB on a depth-32 queue dropped at once (most queued, some in the engine); then
/// depth-32 queues of 300 reads of 256 KiB dropped after reaping 0, 1 and 40 (the reaped buffers
/// keep the file's bytes); then a new queue reads correctly.
pub fn drop_in_flight(e: &Engine) {
    let len = file_len(e, 8 << 20);
    let (path, bytes) = random_file(e.dir, "drop", len, 13);
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let p = &path;
        let bytes = &bytes;
        s.spawn(move || {
            let mut q = (e.open)(p, 32);
            for i in 0..256u64 {
                let offset = (i % 8) << 20;
                q.submit(ReadReq { offset: ByteOffset(offset), len: 1 << 20, buf: buf(1 << 20), tag: Tag(i) });
            }
            assert_eq!(q.in_flight(), 256);
            drop(q);
            for reaped in [0usize, 1, 40] {
                let mut q = (e.open)(p, 32);
                let chunk = 256u64 << 10;
                for i in 0..300u64 {
                    let offset = (i % 16) * chunk;
                    q.submit(ReadReq {
                        offset: ByteOffset(offset),
                        len: chunk as u32,
                        buf: buf(chunk as u32),
                        tag: Tag(i),
                    });
                }
                let mut out = Vec::new();
                while out.len() < reaped {
                    q.reap(1, &mut out);
                }
                // `reap` returns every completion it finds, so on a fast (cached) read path all 300
                // may be back already: how many are still in flight here depends on timing, and is
                // not asserted (the 256 unreaped reads above always are in flight at their drop).
                drop(q);
                for c in &out {
                    check_bytes(
                        c,
                        bytes,
                        (c.tag.0 % 16) * chunk,
                        chunk as usize,
                        &format!("{} reaped before drop", e.name),
                    );
                }
            }
            tx.send(()).unwrap();
        });
        rx.recv_timeout(DROP_LIMIT).unwrap_or_else(|_| panic!("{}: drop with reads in flight hung", e.name));
    });
    let mut q = (e.open)(&path, 4);
    let c = read_one(&mut *q, 4096, 4096);
    check_bytes(&c, &bytes, 4096, 4096, &format!("{}: a new queue after the drops", e.name));
}

/// One `#[test]` per check of the suite for the engine that `$with` lends:
/// `fn $with(f: impl FnOnce(&Engine))` builds the [`Engine`] (its scratch directory and opener) and
/// calls `f` with it. Put each expansion in its own module. `misaligned` is generated only when
/// asked for with `aligned` (engines with an alignment).
///
/// ```text
/// mod direct {
///     picchio_testkit::conformance_tests!(super::with_direct, aligned);
/// }
/// ```
#[macro_export]
macro_rules! conformance_tests {
    (@each $with:path; $($name:ident => $check:ident($($arg:expr),*);)*) => {
        $(
            #[test]
            fn $name() {
                $with(|e: &$crate::conformance::Engine| $crate::conformance::$check(e $(, $arg)*));
            }
        )*
    };
    ($with:path, aligned) => {
        $crate::conformance_tests!($with);
        $crate::conformance_tests!(@each $with; conformance_misaligned => misaligned(););
    };
    ($with:path) => {
        $crate::conformance_tests!(@each $with;
            conformance_random_reads_at_qd_1 => random_reads(1, 18);
            conformance_random_reads_at_qd_32 => random_reads(32, 49);
            conformance_tags_round_trip => tags_round_trip();
            conformance_reap_semantics => reap_semantics();
            conformance_past_end => past_end();
            conformance_too_small_buffer => too_small_buffer();
            conformance_drop_in_flight => drop_in_flight();
        );
    };
}
