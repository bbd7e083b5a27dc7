//! Cross-tier identity and store faults, end to end through `Session`: every store and engine setting
//! gives the same greedy tokens, and every per-expert store fault falls back to safetensors, is
//! counted, and changes nothing in the output.

use picchio_core::format::{index_sha256, Superblock};
use picchio_core::StoreUri;
use picchio_runtime::expert::open::{EngineOptions, IoEngine};
use picchio_runtime::image::pack::{pack, PackOptions};
use picchio_tests::*;

fn c_prompt() -> Vec<u32> {
    ids(&reference_json(&fixture("qwen3_moe"), "reference.json"), "prompt_ids")
}

const N: usize = 16;

#[test]
fn picchio_c_directory_gives_picchio_c_tokens_through_every_store() {
    let dir = fixture("picchio_c/qwen3_moe");
    let image = dir.join("experts.picchioflat");
    let prompt = c_prompt();
    let total = 3 * 16;
    let mut runs = 0;
    for ecap in [1, 4, total] {
        let (g, _) = greedy(&dir, StoreUri::Safetensors, EngineOptions::default(), Some(ecap), &prompt, N).unwrap();
        assert_eq!(g.tokens, PICCHIO_C_TOKENS, "safetensors ecap {ecap}");
        for direct in [false, true] {
            for threads in [1, 2, 4] {
                let io = EngineOptions { engine: IoEngine::Psync, direct, threads, ..EngineOptions::default() };
                let (g, s) = greedy(&dir, StoreUri::File(image.clone()), io, Some(ecap), &prompt, N).unwrap();
                assert_eq!(g.tokens, PICCHIO_C_TOKENS, "file direct={direct} threads={threads} ecap={ecap}");
                assert_eq!(g.stats.fallbacks, 0);
                assert_eq!(g.stats.reads, g.stats.cache_misses, "every miss is one store read");
                assert!(g.stats.bytes_read >= g.stats.reads * 4096);
                assert!(s.info.engine.contains(if direct { "direct" } else { "buffered" }), "{}", s.info.engine);
                runs += 1;
            }
        }
    }
    // auto picks the image.
    let (g, s) = greedy(&dir, StoreUri::Auto, EngineOptions::default(), Some(4), &prompt, N).unwrap();
    assert_eq!(g.tokens, PICCHIO_C_TOKENS);
    assert!(s.info.store.starts_with("file:"), "{}", s.info.store);
    eprintln!("{runs} file-store runs gave Picchio (C)'s tokens");
}

#[test]
fn an_image_we_pack_from_the_picchio_c_directory_gives_the_same_tokens() {
    let tmp = scratch();
    let img = tmp.path().join("ours.picchioflat");
    pack(&fixture("picchio_c/qwen3_moe"), &img, &PackOptions::default()).unwrap();
    let (g, _) =
        greedy(&fixture("picchio_c/qwen3_moe"), StoreUri::File(img), EngineOptions::default(), Some(8), &c_prompt(), N)
            .unwrap();
    assert_eq!(g.tokens, PICCHIO_C_TOKENS);
}

/// A copy of the Picchio (C) directory whose image `corrupt` has modified.
fn corrupted(corrupt: impl FnOnce(&mut Vec<u8>)) -> tempfile::TempDir {
    let tmp = scratch();
    copy_dir(&fixture("picchio_c/qwen3_moe"), tmp.path());
    let p = tmp.path().join("experts.picchioflat");
    let mut b = std::fs::read(&p).unwrap();
    corrupt(&mut b);
    std::fs::write(&p, b).unwrap();
    tmp
}

fn rehash_index(b: &mut [u8]) {
    let sb = Superblock::decode(b, "t", b.len() as u64).unwrap();
    let idx = index_sha256(&b[sb.index_offset as usize..(sb.index_offset + sb.index_len) as usize]);
    b[64..96].copy_from_slice(&idx);
}

fn run_copy(
    tmp: &tempfile::TempDir,
    store: StoreUri,
    verify: bool,
) -> picchio_runtime::Result<picchio_runtime::run::Generation> {
    let opts = picchio_runtime::run::SessionOptions {
        model: picchio_runtime::ModelDir::open(tmp.path())?,
        store,
        engine: EngineOptions::default(),
        schedule: Default::default(),
        verify,
        ecap: Some(8),
        max_seq: c_prompt().len() + N,
        dense: Default::default(),
    };
    greedy_with(&opts, &c_prompt(), N).map(|(g, _)| g)
}

fn file(tmp: &tempfile::TempDir) -> StoreUri {
    StoreUri::File(tmp.path().join("experts.picchioflat"))
}

#[test]
fn per_expert_faults_fall_back_and_keep_the_tokens() {
    // Entry 5's offset moved off the block grid (index hash fixed up so only the entry is wrong).
    let t = corrupted(|b| {
        let o = 4096 + 5 * 24;
        let off = u64::from_le_bytes(b[o..o + 8].try_into().unwrap()) + 512;
        b[o..o + 8].copy_from_slice(&off.to_le_bytes());
        rehash_index(b);
    });
    let g = run_copy(&t, file(&t), false).unwrap();
    assert_eq!(g.tokens, PICCHIO_C_TOKENS);

    // One flipped byte in every payload: with --verify each read fails its hash and falls back.
    let t = corrupted(|b| {
        let sb = Superblock::decode(b, "t", b.len() as u64).unwrap();
        let idx = picchio_core::format::decode_index(&b[4096..4096 + sb.index_len as usize]);
        for loc in idx {
            b[loc.offset as usize + 100] ^= 0x55;
        }
    });
    let g = run_copy(&t, file(&t), true).unwrap();
    assert_eq!(g.tokens, PICCHIO_C_TOKENS);
    assert_eq!(g.stats.fallbacks, g.stats.cache_misses, "{:?}", g.stats);
    assert_eq!(g.stats.store_errors, g.stats.cache_misses);

    // A truncated image: the experts past the cut are rejected at open and fall back.
    let t = corrupted(|b| b.truncate(b.len() / 2));
    let g = run_copy(&t, file(&t), false).unwrap();
    assert_eq!(g.tokens, PICCHIO_C_TOKENS);
    assert!(g.stats.fallbacks > 0, "{:?}", g.stats);
}

#[test]
fn a_prefix_store_serves_its_layers_and_falls_back_for_the_rest() {
    let tmp = scratch();
    let img = tmp.path().join("prefix.picchioflat");
    pack(&fixture("picchio_c/qwen3_moe"), &img, &PackOptions { layers: Some(1), ..Default::default() }).unwrap();
    let (g, _) = greedy(
        &fixture("picchio_c/qwen3_moe"),
        StoreUri::File(img),
        EngineOptions::default(),
        Some(48),
        &c_prompt(),
        N,
    )
    .unwrap();
    assert_eq!(g.tokens, PICCHIO_C_TOKENS);
    assert!(g.stats.reads > 0 && g.stats.fallbacks > 0, "{:?}", g.stats);
    assert_eq!(g.stats.reads + g.stats.fallbacks, g.stats.cache_misses);
}

#[test]
fn whole_store_faults_stop_an_explicit_store_and_auto_falls_back() {
    type Corrupt = Box<dyn Fn(&mut Vec<u8>)>;
    let cases: Vec<(&str, Corrupt)> = vec![
        ("PCHIOFL1", Box::new(|b: &mut Vec<u8>| b[0] = b'X')),
        ("`version`", Box::new(|b: &mut Vec<u8>| b[8] = 9)),
        ("SHA-256", Box::new(|b: &mut Vec<u8>| b[4096 + 3] ^= 1)),
        ("hidden is 65 in the store, 64 in the model", Box::new(|b: &mut Vec<u8>| b[16] = 65)),
        ("truncated", Box::new(|b: &mut Vec<u8>| b.truncate(4096))),
    ];
    for (want, f) in cases {
        let t = corrupted(f);
        let e = run_copy(&t, file(&t), false).err().unwrap_or_else(|| panic!("{want}: opened")).to_string();
        assert!(e.contains(want) && e.contains("experts.picchioflat"), "want {want:?} in: {e}");
        let g = run_copy(&t, StoreUri::Auto, false).unwrap();
        assert_eq!(g.tokens, PICCHIO_C_TOKENS, "auto after {want}");
        assert_eq!(g.stats.store, "safetensors");
    }
}

#[test]
fn an_image_of_another_quantization_is_a_whole_store_mismatch() {
    use picchio_runtime::image::convert::{convert, ConvertOptions};
    use picchio_runtime::quant::QuantKind;
    let tmp = scratch();
    let q3 = tmp.path().join("q3");
    convert(
        &fixture("qwen3_moe"),
        &q3,
        &ConvertOptions { experts: QuantKind::Q3, progress: false, ..Default::default() },
    )
    .unwrap();
    let img = tmp.path().join("q3.picchioflat");
    pack(&q3, &img, &PackOptions { layers: None, progress: false, ..Default::default() }).unwrap();
    // The Picchio (C) directory is the same model in Q4: same dimensions, other payload size.
    let e =
        greedy(&fixture("picchio_c/qwen3_moe"), StoreUri::File(img), EngineOptions::default(), Some(8), &c_prompt(), 2)
            .err()
            .expect("a Q3 image must not open for a Q4 model")
            .to_string();
    assert!(e.contains("quantization") && e.contains("q3.picchioflat"), "{e}");
}
