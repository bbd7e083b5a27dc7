//! End to end: a `.picchioflat` image written by `FlatWriter`, served by `FlatStore<PsyncQueue>`
//! buffered and direct, and the whole-store and per-entry faults through this engine.

mod common;

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use common::{direct_scratch, open_store, scratch, write_image};
use picchio_blockdev::{Error, PsyncOptions, PsyncQueue};
use picchio_core::format::{decode_index, index_sha256, round_up, EXPERT_LOC_SIZE};
use picchio_core::loader::StoreDims;
use picchio_core::{
    AlignedBuf, ExpertKey, ExpertLoader, FlatStore, FlatWriter, LoadError, StoreExpect, Superblock, BLOCK_SIZE,
};

const DIMS: StoreDims = StoreDims { hidden: 64, n_layers: 3, n_experts: 4, topk: 2, moe_inter: 128 };

/// An image of 3 layers × 4 experts with payloads of assorted (mostly unaligned) sizes.
struct Image {
    path: PathBuf,
    payloads: Vec<Vec<u8>>,
}

impl Image {
    fn write(dir: &Path, payload_len: impl Fn(usize) -> usize) -> Image {
        let path = dir.join("experts.picchioflat");
        let payloads = write_image(&path, DIMS, 42, payload_len);
        Image { path, payloads }
    }

    fn assorted(dir: &Path) -> Image {
        Image::write(dir, |i| 1 + (i * 7919 + 3000) % 20_000)
    }

    fn payload(&self, k: ExpertKey) -> &[u8] {
        &self.payloads[(k.layer * DIMS.n_experts + k.expert) as usize]
    }

    fn superblock(&self) -> Superblock {
        let bytes = std::fs::read(&self.path).unwrap();
        Superblock::decode(&bytes, "t", bytes.len() as u64).unwrap()
    }

    /// The index as written: entry `layer * 4 + expert` locates expert `(layer, expert)`.
    fn locs(&self) -> Vec<picchio_core::ExpertLoc> {
        let sb = self.superblock();
        let bytes = std::fs::read(&self.path).unwrap();
        decode_index(&bytes[sb.index_offset as usize..(sb.index_offset + sb.index_len) as usize])
    }

    fn write_at(&self, offset: u64, bytes: &[u8]) {
        let mut f = OpenOptions::new().write(true).open(&self.path).unwrap();
        f.seek(SeekFrom::Start(offset)).unwrap();
        f.write_all(bytes).unwrap();
    }

    /// Rewrites index entry `i` with `edit`, then fixes up the index SHA-256 in the superblock
    /// (bytes 64..96) so that only that entry is wrong.
    fn edit_entry(&self, i: usize, edit: impl FnOnce(&mut picchio_core::ExpertLoc)) {
        let sb = self.superblock();
        let bytes = std::fs::read(&self.path).unwrap();
        let start = sb.index_offset as usize;
        let mut index = bytes[start..start + sb.index_len as usize].to_vec();
        let mut loc = decode_index(&index)[i];
        edit(&mut loc);
        index[i * EXPERT_LOC_SIZE..(i + 1) * EXPERT_LOC_SIZE].copy_from_slice(&loc.encode());
        self.write_at(sb.index_offset, &index);
        self.write_at(64, &index_sha256(&index));
    }
}

/// Loads `experts` of `layer` into fresh slots; returns each expert's slot and result.
fn load(
    store: &mut FlatStore<PsyncQueue>,
    layer: u32,
    experts: &[u32],
) -> BTreeMap<u32, (AlignedBuf, Result<(), LoadError>)> {
    let slot = round_up(20_000, u64::from(BLOCK_SIZE)) as usize;
    let reqs = experts.iter().map(|&e| (e, AlignedBuf::new(slot, BLOCK_SIZE as usize).unwrap())).collect();
    let mut got = BTreeMap::new();
    store.load(layer, reqs, &mut |l| {
        assert_eq!(l.key.layer, layer);
        assert!(got.insert(l.key.expert, (l.buf, l.result)).is_none(), "{} delivered twice", l.key);
    });
    assert_eq!(got.len(), experts.len());
    got
}

fn assert_loaded(img: &Image, layer: u32, got: &BTreeMap<u32, (AlignedBuf, Result<(), LoadError>)>) {
    for (&expert, (buf, result)) in got {
        let key = ExpertKey { layer, expert };
        result.as_ref().unwrap_or_else(|e| panic!("{key}: {e}"));
        let p = img.payload(key);
        assert!(buf.as_slice()[..p.len()] == p[..], "{key}: bytes differ from what was written");
    }
}

/// The error of an open that must fail (`FlatStore` has no `Debug`, so no `unwrap_err`).
fn open_err(path: &Path, opts: PsyncOptions, expect: Option<StoreExpect>) -> Error {
    match open_store(path, opts, false, expect) {
        Ok(store) => panic!("{} opened but should not have", store.describe()),
        Err(e) => e,
    }
}

/// Buffered, and direct in a directory that supports O_DIRECT.
fn engines(test: &str) -> Vec<(PsyncOptions, tempfile::TempDir)> {
    vec![(PsyncOptions::buffered(2), scratch()), (PsyncOptions::direct(2), direct_scratch(test))]
}

#[test]
fn loads_every_expert_byte_identical_buffered_and_direct() {
    for (opts, dir) in engines("loads_every_expert_byte_identical_buffered_and_direct") {
        let img = Image::assorted(dir.path());
        for threads in [1, 4] {
            let mut store = open_store(&img.path, PsyncOptions { threads, ..opts }, true, None).unwrap();
            let d = store.describe();
            assert!(d.contains("experts.picchioflat") && d.contains("psync("), "{d}");
            for layer in 0..DIMS.n_layers {
                // Out of order and repeated across calls: completion order must not matter.
                let got = load(&mut store, layer, &[3, 0, 2, 1]);
                assert_loaded(&img, layer, &got);
            }
            let stats = store.stats().snapshot();
            assert_eq!((stats.reads, stats.errors), (12, 0));
        }
    }
}

#[test]
fn model_expectations_are_checked_through_the_engine() {
    let dir = scratch();
    let img = Image::write(dir.path(), |_| 9000);
    let expect = StoreExpect { dims: DIMS, payload_len: 9000 };
    let mut store = open_store(&img.path, PsyncOptions::buffered(2), false, Some(expect)).unwrap();
    assert_loaded(&img, 1, &load(&mut store, 1, &[0, 1, 2, 3]));
    let wrong = StoreExpect { dims: StoreDims { hidden: 128, ..DIMS }, payload_len: 9000 };
    let e = open_err(&img.path, PsyncOptions::buffered(2), Some(wrong));
    assert!(matches!(e, Error::Store(picchio_core::Error::DimensionMismatch { field: "hidden", .. })), "{e}");
}

#[test]
fn bad_magic_is_rejected_at_open() {
    for (opts, dir) in engines("bad_magic_is_rejected_at_open") {
        let img = Image::assorted(dir.path());
        img.write_at(0, b"NOTMAGIC");
        let e = open_err(&img.path, opts, None);
        assert!(matches!(e, Error::Store(picchio_core::Error::BadMagic { .. })), "{e}");
        let s = e.to_string();
        assert!(s.contains("PCHIOFL1") && s.contains("NOTMAGIC") && s.contains("experts.picchioflat"), "{s}");
    }
}

#[test]
fn unsupported_version_is_rejected_at_open() {
    for (opts, dir) in engines("unsupported_version_is_rejected_at_open") {
        let img = Image::assorted(dir.path());
        img.write_at(8, &3u32.to_le_bytes());
        let e = open_err(&img.path, opts, None);
        assert!(matches!(e, Error::Store(picchio_core::Error::BadField { field: "version", found: 3, .. })), "{e}");
    }
}

#[test]
fn index_hash_mismatch_is_rejected_at_open() {
    for (opts, dir) in engines("index_hash_mismatch_is_rejected_at_open") {
        let img = Image::assorted(dir.path());
        let sb = img.superblock();
        // Flip one bit of entry 5's hash field, without fixing the superblock's SHA-256.
        let at = sb.index_offset + 5 * EXPERT_LOC_SIZE as u64 + 16;
        let b = std::fs::read(&img.path).unwrap()[at as usize];
        img.write_at(at, &[b ^ 1]);
        let e = open_err(&img.path, opts, None);
        assert!(matches!(e, Error::Store(picchio_core::Error::IndexHash { .. })), "{e}");
        assert!(e.to_string().contains("SHA-256"), "{e}");
    }
}

#[test]
fn truncated_image_rejects_the_cut_experts_only() {
    for (opts, dir) in engines("truncated_image_rejects_the_cut_experts_only") {
        let img = Image::assorted(dir.path());
        let locs = img.locs();
        // Cut in the middle of expert (1, 2)'s payload, at an unaligned length.
        let cut = locs[6].offset + 1000;
        std::fs::OpenOptions::new().write(true).open(&img.path).unwrap().set_len(cut).unwrap();
        let mut store = open_store(&img.path, opts, true, None).unwrap();
        assert_loaded(&img, 0, &load(&mut store, 0, &[0, 1, 2, 3]));
        let mut got = load(&mut store, 1, &[0, 1, 2, 3]);
        let cut_off = got.split_off(&2);
        assert_loaded(&img, 1, &got);
        for e in [2, 3] {
            let err = cut_off[&e].1.as_ref().unwrap_err();
            assert!(matches!(err, LoadError::Rejected { .. }), "{err}");
            assert!(err.to_string().contains("past the image end"), "{err}");
        }
        for (_, (_, r)) in load(&mut store, 2, &[0, 3]) {
            assert!(matches!(r, Err(LoadError::Rejected { .. })));
        }
    }
}

#[test]
fn misaligned_entry_fails_alone() {
    for (opts, dir) in engines("misaligned_entry_fails_alone") {
        let img = Image::assorted(dir.path());
        img.edit_entry(4 + 1, |loc| loc.offset += 512); // (layer 1, expert 1)
        let mut store = open_store(&img.path, opts, true, None).unwrap();
        let got = load(&mut store, 1, &[0, 1, 2, 3]);
        let err = got[&1].1.as_ref().unwrap_err();
        assert!(matches!(err, LoadError::Rejected { key: ExpertKey { layer: 1, expert: 1 }, .. }), "{err}");
        assert!(err.to_string().contains("not a multiple of the block size"), "{err}");
        for e in [0, 2, 3] {
            let (buf, r) = &got[&e];
            r.as_ref().unwrap();
            let p = img.payload(ExpertKey { layer: 1, expert: e });
            assert!(buf.as_slice()[..p.len()] == p[..]);
        }
    }
}

#[test]
fn verify_catches_a_flipped_payload_byte() {
    for (opts, dir) in engines("verify_catches_a_flipped_payload_byte") {
        let img = Image::assorted(dir.path());
        let loc = img.locs()[9];
        let bytes = std::fs::read(&img.path).unwrap();
        img.write_at(loc.offset + 17, &[bytes[(loc.offset + 17) as usize] ^ 0x80]); // (layer 2, expert 1)

        let mut store = open_store(&img.path, opts, true, None).unwrap();
        let got = load(&mut store, 2, &[0, 1, 2, 3]);
        let err = got[&1].1.as_ref().unwrap_err();
        let LoadError::Hash { key, offset, expected, found, .. } = err else { panic!("{err}") };
        assert_eq!((*key, *offset, *expected), (ExpertKey { layer: 2, expert: 1 }, loc.offset, loc.hash));
        assert_ne!(found, expected);
        for e in [0, 2, 3] {
            got[&e].1.as_ref().unwrap();
        }
        assert_eq!(store.stats().snapshot().errors, 1);

        // Without --verify the corruption is not looked for (the superblock and index still are).
        let mut store = open_store(&img.path, opts, false, None).unwrap();
        assert!(load(&mut store, 2, &[1])[&1].1.is_ok());
    }
}

#[test]
fn image_shrunk_after_open_reports_short_reads() {
    for (opts, dir) in engines("image_shrunk_after_open_reports_short_reads") {
        let img = Image::assorted(dir.path());
        let mut store = open_store(&img.path, opts, false, None).unwrap();
        let last = store.entry(ExpertKey { layer: 2, expert: 3 }).unwrap();
        // Another process truncates the image under us: the last payload loses its tail.
        let keep = last.offset + u64::from(BLOCK_SIZE);
        assert!(keep < last.offset + u64::from(last.padded_len));
        OpenOptions::new().write(true).open(&img.path).unwrap().set_len(keep).unwrap();
        let got = load(&mut store, 2, &[2, 3]);
        got[&2].1.as_ref().unwrap();
        let err = got[&3].1.as_ref().unwrap_err();
        assert!(
            matches!(err, LoadError::Short { got: 4096, .. }),
            "expected a short read of 4096 bytes ({}): {err}",
            store.describe()
        );
    }
}

/// Overwrites the image file in place (same inode, as a program writing it would; not a rename)
/// with another image of the same layout whose payloads are the complement of the first's.
fn rewrite_in_place(img: &Image) {
    let other = img.path.with_file_name("other.picchioflat");
    let complement: Vec<Vec<u8>> = img.payloads.iter().map(|p| p.iter().map(|b| !b).collect()).collect();
    FlatWriter::write(&other, DIMS, &complement).unwrap();
    img.write_at(0, &std::fs::read(&other).unwrap());
    OpenOptions::new().write(true).open(&img.path).unwrap().sync_all().unwrap();
}

fn open_rechecking(img: &Image, opts: PsyncOptions, verify: bool, recheck_every: u32) -> FlatStore<PsyncQueue> {
    let queue = PsyncQueue::open(&img.path, opts).unwrap();
    let o = picchio_core::FlatStoreOptions { image_len: queue.len(), verify, recheck_every, ..Default::default() };
    FlatStore::open(queue, img.path.display().to_string(), o).unwrap()
}

#[test]
fn an_image_rewritten_under_a_verifying_reader_is_never_mixed_and_then_no_longer_read() {
    for (opts, dir) in engines("an_image_rewritten_under_a_verifying_reader") {
        let img = Image::assorted(dir.path());
        let mut store = open_rechecking(&img, opts, true, 0);
        assert_loaded(&img, 0, &load(&mut store, 0, &[0, 1, 2, 3]));
        assert_eq!(store.changed(), None);
        rewrite_in_place(&img);
        // Every payload now read belongs to the other image: each fails its hash (never handed out
        // as this image's), and the check after the batch finds the new superblock.
        let got = load(&mut store, 1, &[0, 1, 2, 3]);
        for (e, (_, r)) in &got {
            assert!(matches!(r, Err(LoadError::Hash { .. })), "expert {e}: {r:?}");
        }
        let what = store.changed().expect("the change was detected").to_string();
        assert!(what.contains("now describes another index"), "{what}");
        // From now on nothing is read from it: every request fails at once, naming why.
        let reads = store.stats().snapshot().reads;
        let got = load(&mut store, 2, &[0, 3]);
        for (_, r) in got.values() {
            let e = r.as_ref().unwrap_err();
            assert!(
                matches!(e, LoadError::Changed { .. }) && e.to_string().contains("changed under this reader"),
                "{e}"
            );
        }
        assert_eq!(store.stats().snapshot().reads, reads, "a changed image was read again");
    }
}

#[test]
fn without_verify_a_rewrite_is_found_by_the_periodic_check_after_the_batch_that_read_it() {
    for (opts, dir) in engines("without_verify_a_rewrite_is_found_by_the_periodic_check") {
        let img = Image::assorted(dir.path());
        let mut store = open_rechecking(&img, opts, false, 1);
        assert_loaded(&img, 0, &load(&mut store, 0, &[0, 1]));
        assert_eq!(store.changed(), None, "an unchanged image is not taken for changed");
        rewrite_in_place(&img);
        // The limit, stated in FlatStore's docs: without --verify the batch that first reads the
        // new bytes hands them out; the check after it stops every later read.
        let got = load(&mut store, 1, &[0]);
        assert!(got[&0].1.is_ok());
        assert!(store.changed().is_some());
        assert!(matches!(load(&mut store, 1, &[1])[&1].1, Err(LoadError::Changed { .. })));
        // With no periodic check (recheck_every 0) and no failure, nothing is compared.
        let second = dir.path().join("second");
        std::fs::create_dir_all(&second).unwrap();
        let img2 = Image::assorted(&second);
        let mut store = open_rechecking(&img2, opts, false, 0);
        rewrite_in_place(&img2);
        assert!(load(&mut store, 1, &[0])[&0].1.is_ok());
        assert_eq!(store.changed(), None);
    }
}
