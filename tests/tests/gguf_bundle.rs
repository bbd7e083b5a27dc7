//! The expert bundle of a GGUF (`picchio pack model.gguf`, `.picchioflat` version 3), end to end on
//! `fixtures/gguf_bundle/tiny_moe.gguf` (2 layers × 8 experts, hidden 64; layer 1's
//! `ffn_down_exps` in Q4_0, the rest Q8_0, so the layers' payloads differ in length):
//! a run through the bundle gives the tokens and logits of the run in place; a stale bundle (the
//! GGUF's metadata rewritten) or a foreign one (another GGUF's, a version 2 image) falls back under
//! `--store auto` and is an error naming what differs under an explicit store; `verify` compares
//! the bundle with the GGUF byte for byte; and the bundle read by the user-space NVMe driver over
//! its controller model (`nvme-sim:`) or written to and read from a loop device (`raw:`) gives the
//! same tokens and logits.

use std::path::{Path, PathBuf};

use picchio_core::format::{decode_index, decode_layer_table, index_sha256, Superblock};
use picchio_core::StoreUri;
use picchio_runtime::expert::open::{EngineOptions, IoEngine};
use picchio_runtime::expert::store::default_image;
use picchio_runtime::image::bundle::{pack_gguf_to, BundleReport};
use picchio_runtime::image::verify::{verify, FailureKind, VerifyOptions};
use picchio_runtime::image::write::{WriteOptions, WriteTo};
use picchio_tests::*;

const N: usize = 8;
const PROMPT: [u32; 6] = [1, 17, 300, 4000, 42, 9];

/// A copy of the fixture GGUF in a scratch directory (its bundle goes beside it).
fn gguf_copy(tmp: &Path, name: &str) -> PathBuf {
    let p = tmp.join(name);
    std::fs::copy(fixture("gguf_bundle/tiny_moe.gguf"), &p).unwrap();
    p
}

fn pack_file(gguf: &Path, out: &Path) -> BundleReport {
    let to = StoreUri::File(out.into());
    pack_gguf_to(gguf, WriteTo::Uri(&to), None, false, &WriteOptions::default(), &mut |_| {}).unwrap()
}

fn run(gguf: &Path, store: StoreUri) -> picchio_runtime::Result<(picchio_runtime::run::Generation, String)> {
    let (g, s) = greedy(gguf, store, EngineOptions::default(), Some(4), &PROMPT, N)?;
    Ok((g, s.info.store.clone()))
}

/// Rewrites the u32 value of the metadata key `key` in the GGUF at `path` (a key/value is the
/// key's u64 length, its bytes, a u32 value type, then the value).
fn rewrite_u32(path: &Path, key: &str, value: u32) {
    let mut b = std::fs::read(path).unwrap();
    let mut needle = (key.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(key.as_bytes());
    let at = b.windows(needle.len()).position(|w| w == needle).unwrap_or_else(|| panic!("{key} not in the GGUF"));
    let ty = at + needle.len();
    assert_eq!(u32::from_le_bytes(b[ty..ty + 4].try_into().unwrap()), 4, "{key} is a u32");
    b[ty + 4..ty + 8].copy_from_slice(&value.to_le_bytes());
    std::fs::write(path, b).unwrap();
}

#[test]
fn a_run_through_the_bundle_equals_the_run_in_place_token_for_token_and_logit_for_logit() {
    let tmp = scratch();
    let gguf = gguf_copy(tmp.path(), "tiny_moe.gguf");
    let bundle = default_image(&gguf, true);
    assert_eq!(bundle, tmp.path().join("tiny_moe.gguf.picchioflat"));
    let report = pack_file(&gguf, &bundle);
    eprintln!("{report}");
    assert_eq!(report.experts, 16);
    assert_eq!(report.payload_lens.len(), 2, "layer 1's down slab is Q4_0: {:?}", report.payload_lens);

    // The image: version 3, the GGUF recorded, one descriptor per layer, per-layer entry lengths.
    let bytes = std::fs::read(&bundle).unwrap();
    let sb = Superblock::decode(&bytes, "b", bytes.len() as u64).unwrap();
    assert_eq!((sb.version, sb.n_layers, sb.n_experts, sb.n_entries, sb.hidden), (3, 2, 8, 16, 64));
    let h = sb.bundle.as_ref().unwrap();
    assert_eq!(h.source.path, std::path::absolute(&gguf).unwrap());
    let layers =
        decode_layer_table(&bytes[h.layers_offset as usize..(h.layers_offset + h.layers_len) as usize]).unwrap();
    let idx = decode_index(&bytes[sb.index_offset as usize..(sb.index_offset + sb.index_len) as usize]);
    for (i, loc) in idx.iter().enumerate() {
        assert_eq!(Some(u64::from(loc.len)), layers[i / 8].payload_len(), "entry {i}");
        assert_eq!(loc.offset % 4096, 0);
    }
    // Q8_0 (id 8) gate and up; down Q8_0 in layer 0, Q4_0 (id 2) in layer 1.
    let types: Vec<[u32; 3]> = layers.iter().map(|l| l.slabs.unwrap().map(|s| s.stored)).collect();
    assert_eq!(types, [[8, 8, 8], [8, 8, 2]]);

    let (in_place, store) = run(&gguf, StoreUri::Safetensors).unwrap();
    assert!(store.starts_with("gguf"), "{store}");
    assert_eq!(in_place.tokens.len(), N);
    for uri in [StoreUri::Auto, StoreUri::File(bundle.clone())] {
        let (g, store) = run(&gguf, uri.clone()).unwrap();
        assert_eq!(store, format!("file:{}", bundle.display()), "{uri}");
        assert_eq!(g.tokens, in_place.tokens, "{uri}");
        assert_eq!(g.logits, in_place.logits, "{uri}: logits bit for bit");
        assert_eq!((g.stats.fallbacks, g.stats.store_errors), (0, 0), "{uri}: {:?}", g.stats);
        assert!(g.stats.reads > 0 && g.stats.reads == g.stats.cache_misses, "{uri}: {:?}", g.stats);
    }
    // The user-space NVMe driver over its controller model (`nvme-sim:`), serving the bundle file
    // as a namespace: the same.
    #[cfg(target_os = "linux")]
    {
        let uri = StoreUri::NvmeSim(bundle.clone());
        let (g, store) = run(&gguf, uri.clone()).unwrap();
        assert_eq!(store, uri.to_string());
        assert_eq!(g.logits, in_place.logits, "{uri}");
        assert_eq!((g.stats.fallbacks, g.stats.store_errors), (0, 0), "{uri}: {:?}", g.stats);
        assert!(g.stats.reads > 0, "{uri}: {:?}", g.stats);
    }
    // psync with O_DIRECT and threads: the same.
    let io = EngineOptions { engine: IoEngine::Psync, direct: true, threads: 2, ..EngineOptions::default() };
    let (g, _) = greedy(&gguf, StoreUri::File(bundle), io, Some(16), &PROMPT, N).unwrap();
    assert_eq!(g.logits, in_place.logits);
}

#[test]
fn a_stale_or_foreign_bundle_falls_back_under_auto_and_is_refused_when_named() {
    let tmp = scratch();
    let gguf = gguf_copy(tmp.path(), "tiny_moe.gguf");
    let bundle = default_image(&gguf, true);
    pack_file(&gguf, &bundle);
    let (in_place, _) = run(&gguf, StoreUri::Safetensors).unwrap();

    // Stale: the GGUF's metadata changed after packing (the context length; same weights).
    rewrite_u32(&gguf, "qwen3moe.context_length", 1024);
    let (g, store) = run(&gguf, StoreUri::Auto).unwrap();
    assert!(store.starts_with("gguf"), "auto falls back to the GGUF in place: {store}");
    assert_eq!(g.logits, in_place.logits);
    let e = run(&gguf, StoreUri::File(bundle.clone())).expect_err("a stale bundle must not open").to_string();
    assert!(e.contains("not the expert bundle of this model") && e.contains("fingerprint"), "{e}");
    assert!(e.contains("tiny_moe.gguf.picchioflat"), "{e}");
    // `pack` again (what `pack --force` does for a file) rebuilds it: the bundle is used again.
    pack_file(&gguf, &bundle);
    let (g, store) = run(&gguf, StoreUri::Auto).unwrap();
    assert!(store.starts_with("file:"), "{store}");
    assert_eq!(g.logits, in_place.logits);

    // Foreign: another GGUF's bundle beside this one; the message names the GGUF it was packed from.
    let other = gguf_copy(tmp.path(), "other.gguf");
    rewrite_u32(&other, "qwen3moe.context_length", 256);
    pack_file(&other, &bundle);
    let (g, store) = run(&gguf, StoreUri::Auto).unwrap();
    assert!(store.starts_with("gguf"), "{store}");
    assert_eq!(g.tokens, in_place.tokens);
    let e = run(&gguf, StoreUri::File(bundle.clone())).err().unwrap().to_string();
    assert!(e.contains("other.gguf") && e.contains("fingerprint"), "{e}");

    // A version 2 image (a converted directory's) given for a GGUF, and a bundle given for a
    // converted directory.
    let v2 = fixture("picchio_c/qwen3_moe/experts.picchioflat");
    std::fs::copy(&v2, &bundle).unwrap();
    let (_, store) = run(&gguf, StoreUri::Auto).unwrap();
    assert!(store.starts_with("gguf"), "{store}");
    let e = run(&gguf, StoreUri::File(bundle.clone())).err().unwrap().to_string();
    assert!(e.contains("not the expert bundle") || e.contains("store was packed for a different model"), "{e}");
    pack_file(&gguf, &bundle);
    let e =
        greedy(&fixture("picchio_c/qwen3_moe"), StoreUri::File(bundle), EngineOptions::default(), Some(4), &PROMPT, 1)
            .err()
            .expect("a bundle must not serve a converted directory")
            .to_string();
    assert!(e.contains("store was packed for a different model") || e.contains("expert bundle (version 3)"), "{e}");
}

#[test]
fn verify_compares_the_bundle_with_its_gguf_and_finds_a_flipped_byte() {
    let tmp = scratch();
    let gguf = gguf_copy(tmp.path(), "tiny_moe.gguf");
    let bundle = default_image(&gguf, true);
    pack_file(&gguf, &bundle);
    let vopts = VerifyOptions { progress: false, ..Default::default() };
    for model in [Some(gguf.as_path()), None] {
        let v = verify(&bundle, model, &vopts).unwrap();
        assert!(v.is_clean() && v.compared_with_model && v.entries == 16, "{v}");
        assert!(v.bytes_read > 0, "{v}");
    }
    let bytes = std::fs::read(&bundle).unwrap();
    let sb = Superblock::decode(&bytes, "b", bytes.len() as u64).unwrap();
    let idx_range = sb.index_offset as usize..(sb.index_offset + sb.index_len) as usize;
    let idx = decode_index(&bytes[idx_range.clone()]);

    // One flipped payload byte: its hash no longer matches the index.
    let mut b = bytes.clone();
    b[idx[11].offset as usize + 77] ^= 0x20;
    std::fs::write(&bundle, &b).unwrap();
    let v = verify(&bundle, Some(&gguf), &vopts).unwrap();
    assert_eq!(v.failures.len(), 1, "{v}");
    assert_eq!((v.failures[0].key.layer, v.failures[0].key.expert), (1, 3));
    assert!(matches!(v.failures[0].kind, FailureKind::Hash { .. }), "{v}");

    // The same byte with the index rehashed: only the comparison with the GGUF finds it.
    let mut loc = idx[11];
    loc.hash = picchio_core::format::payload_hash(&b[loc.offset as usize..loc.offset as usize + loc.len as usize]);
    b[idx_range.start + 11 * 24..idx_range.start + 12 * 24].copy_from_slice(&loc.encode());
    let sha = index_sha256(&b[idx_range]);
    b[64..96].copy_from_slice(&sha);
    std::fs::write(&bundle, &b).unwrap();
    let v = verify(&bundle, Some(&gguf), &vopts).unwrap();
    assert_eq!(v.failures.len(), 1, "{v}");
    assert_eq!(v.failures[0].kind, FailureKind::Mismatch { first: 77, count: 1 }, "{v}");

    // Against another GGUF: a whole-image problem naming the fingerprint, no payload compared.
    std::fs::write(&bundle, &bytes).unwrap();
    rewrite_u32(&gguf, "qwen3moe.context_length", 1024);
    let v = verify(&bundle, Some(&gguf), &vopts).unwrap();
    assert!(!v.is_clean() && !v.compared_with_model, "{v}");
    assert!(v.store_problems.iter().any(|p| p.to_string().contains("fingerprint")), "{v}");
}

#[cfg(target_os = "linux")]
#[test]
#[ignore = "needs root: losetup (CI runs ignored tests as root)"]
fn the_bundle_on_a_raw_device_gives_the_tokens_in_place() {
    use picchio_testkit::loopdev::{sparse_file, LoopDevice, LoopOptions};
    let test = "the_bundle_on_a_raw_device_gives_the_tokens_in_place";
    let tmp = scratch();
    let gguf = gguf_copy(tmp.path(), "tiny_moe.gguf");
    let (in_place, _) = run(&gguf, StoreUri::Safetensors).unwrap();
    for (lbs, offset) in [(512u32, 0u64), (4096, 1 << 20)] {
        let file = sparse_file(&tmp.path().join(format!("d{lbs}.img")), 4 << 20);
        let lo = LoopDevice::attach_for_test(test, &file, LoopOptions { sector_size: lbs, ..Default::default() });
        let uri = StoreUri::Raw { device: lo.dev.clone(), offset };
        let wopts = WriteOptions { io_threads: 2, ..WriteOptions::default() };
        let report = pack_gguf_to(&gguf, WriteTo::Uri(&uri), None, false, &wopts, &mut |_| {}).unwrap();
        let verify = report.verify().expect("a raw write is read back");
        assert!(verify.is_clean() && verify.entries == 16, "{verify}");
        let io = EngineOptions { engine: IoEngine::Psync, direct: true, threads: 2, ..EngineOptions::default() };
        for ecap in [1, 16] {
            let (g, s) = greedy(&gguf, uri.clone(), io, Some(ecap), &PROMPT, N).unwrap();
            assert_eq!(s.info.store, uri.to_string());
            assert_eq!(g.tokens, in_place.tokens, "raw({lbs})@{offset} ecap {ecap}");
            assert_eq!(g.logits, in_place.logits);
            assert_eq!((g.stats.fallbacks, g.stats.store_errors), (0, 0), "{:?}", g.stats);
        }
        let vopts = VerifyOptions { progress: false, ..Default::default() };
        let v = picchio_runtime::image::verify::verify_raw(&lo.dev, offset, Some(&gguf), &vopts).unwrap();
        assert!(v.is_clean() && v.compared_with_model, "{v}");
    }
}

#[test]
fn given_only_the_bundle_the_front_end_finds_its_gguf() {
    use picchio_runtime::image::record::find_model_dir;
    let tmp = scratch();
    let gguf = gguf_copy(tmp.path(), "tiny_moe.gguf");
    let bundle = default_image(&gguf, true);
    pack_file(&gguf, &bundle);
    let found = find_model_dir(&StoreUri::File(bundle.clone()), EngineOptions::default()).unwrap();
    assert_eq!(found.dir, std::path::absolute(&gguf).unwrap());
    assert_eq!(found.how, "the GGUF the bundle records");
    // Moved together: the GGUF beside the bundle.
    let moved = tmp.path().join("moved");
    std::fs::create_dir(&moved).unwrap();
    let (g2, b2) = (moved.join("tiny_moe.gguf"), moved.join("tiny_moe.gguf.picchioflat"));
    std::fs::rename(&gguf, &g2).unwrap();
    std::fs::rename(&bundle, &b2).unwrap();
    let found = find_model_dir(&StoreUri::File(b2.clone()), EngineOptions::default()).unwrap();
    assert_eq!(
        (found.dir, found.how),
        (std::path::absolute(&g2).unwrap(), "the GGUF beside the bundle (moved with it)")
    );
    // The GGUF changed: neither matches, and the error says what was found.
    rewrite_u32(&g2, "qwen3moe.context_length", 1024);
    let e = find_model_dir(&StoreUri::File(b2), EngineOptions::default()).unwrap_err().to_string();
    assert!(e.contains("expert bundle of the GGUF") && e.contains("no GGUF there") && e.contains("--model"), "{e}");
}
