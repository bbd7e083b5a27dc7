//! `transcode` (a converted directory's experts re-quantized without the checkpoint) on every
//! fixture layout: Qwen3-MoE sharded with an index, with a dense-MLP layer and two groups per row,
//! GPT-OSS (suffixed expert names, resident expert biases), and Picchio (C)'s directory (no index,
//! I8 embeddings, an expert image that is not copied).
//!
//! - Q4 → Q3 is not `convert --experts q3` of the checkpoint (requantizing a dequantized Q4 group
//!   differs from quantizing the float weights), so each Q3 tensor is checked against the Q3
//!   quantization of the Q4-dequantized values computed here with quant.rs's own functions; every
//!   other tensor must be byte-identical to the source's.
//! - none → Q4/Q3 is exactly `convert --experts q4|q3` (the f32 experts are the checkpoint's values),
//!   so those directories must equal convert's tensor for tensor, and the Q4 one must give
//!   transformers' Q4 tokens.
//! - The transcoded directories run, with the same tokens from safetensors and from a packed image.
//! - Refusals (no-op, Q3 → Q4, to none, an existing destination) write nothing, and the source is
//!   never written (every file hashed before and after).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use picchio_core::StoreUri;
use picchio_runtime::expert::open::{EngineOptions, IoEngine};
use picchio_runtime::image::convert::{convert, ConvertOptions};
use picchio_runtime::image::pack::{pack, PackOptions};
use picchio_runtime::image::transcode::{transcode, TranscodeOptions};
use picchio_runtime::model::safetensors::TensorStore;
use picchio_runtime::quant::{dequantize_q4, quantize_q3, QuantKind};
use picchio_runtime::Error;
use picchio_tests::*;

fn converted(tmp: &Path, src: &str, experts: QuantKind) -> PathBuf {
    let dst = tmp.join(format!("{}-{experts}", src.replace('/', "_")));
    let opts = ConvertOptions { experts, progress: false, ..Default::default() };
    convert(&fixture(src), &dst, &opts).unwrap_or_else(|e| panic!("convert {src}: {e}"));
    dst
}

fn to(kind: QuantKind) -> TranscodeOptions {
    TranscodeOptions { to: kind, progress: false, ..Default::default() }
}

/// Every entry of `dir`: name → the first 8 bytes of the SHA-256 of a file's bytes (the format's
/// payload hash; 0 for a directory), to show a directory was not written.
fn hashes(dir: &Path) -> BTreeMap<String, u64> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| {
            let h = if p.is_dir() { 0 } else { picchio_core::format::payload_hash(&std::fs::read(&p).unwrap()) };
            (p.file_name().unwrap().to_string_lossy().into_owned(), h)
        })
        .collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The converted Q4 directories the tests transcode: (what, dir).
fn q4_sources(tmp: &Path) -> Vec<(&'static str, PathBuf)> {
    vec![
        ("qwen3_moe", converted(tmp, "qwen3_moe", QuantKind::Q4)),
        ("qwen3_moe_wide", converted(tmp, "qwen3_moe_wide", QuantKind::Q4)),
        ("gpt_oss_mxfp4", converted(tmp, "gpt_oss_mxfp4", QuantKind::Q4)),
        ("picchio_c", fixture("picchio_c/qwen3_moe")),
    ]
}

/// The tensor names of `a`, sorted, after asserting `b` has the same ones (`what` names the pair).
fn same_names<'a>(a: &'a TensorStore, b: &TensorStore, what: &str) -> Vec<&'a str> {
    let mut names_a: Vec<&str> = a.names().collect();
    let mut names_b: Vec<&str> = b.names().collect();
    names_a.sort();
    names_b.sort();
    assert_eq!(names_a, names_b, "{what}: the same tensors");
    names_a
}

#[test]
fn q4_to_q3_writes_the_q3_quantization_of_the_dequantized_q4_experts_and_copies_the_rest() {
    let tmp = scratch();
    for (what, src) in q4_sources(tmp.path()) {
        let before = hashes(&src);
        let dst = tmp.path().join(format!("{what}-q3"));
        let report = transcode(&src, &dst, &to(QuantKind::Q3)).unwrap_or_else(|e| panic!("{what}: {e}"));
        eprintln!("{report}");
        assert_eq!(hashes(&src), before, "{what}: the source was written");
        assert_eq!((report.from, report.to), (QuantKind::Q4, QuantKind::Q3));

        let (s, d) = (TensorStore::open(&src).unwrap(), TensorStore::open(&dst).unwrap());
        let names_s = same_names(&s, &d, what);
        let cfg = picchio_runtime::model::config::Config::from_dir(&src).unwrap();
        let (h, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
        let layout = picchio_runtime::expert::layout::ExpertLayout::detect(&s, &cfg).unwrap();
        let mut expert_tensors = std::collections::HashSet::new();
        let mut matrices = 0;
        for &l in &cfg.moe_layers() {
            for e in 0..cfg.num_experts {
                let n = layout.names(l, e);
                for (packed, qs, rows, cols) in [(&n.gate_up, &n.gate_up_qs, 2 * i, h), (&n.down, &n.down_qs, h, i)] {
                    let (sp, ss) = (s.get(packed).unwrap(), s.get(qs).unwrap());
                    let w = dequantize_q4(sp.bytes, &f32s(ss.bytes), rows, cols);
                    let (want_p, want_s) = quantize_q3(&w, rows, cols);
                    let (dp, ds) = (d.get(packed).unwrap(), d.get(qs).unwrap());
                    assert_eq!(dp.dtype, safetensors::Dtype::U8);
                    assert!(dp.bytes == &want_p[..], "{what}: {packed} is not the Q3 of the dequantized Q4");
                    assert_eq!(f32s(ds.bytes), want_s, "{what}: {qs}");
                    assert_eq!(dp.bytes.len(), rows * cols / 64 * 24);
                    expert_tensors.extend([packed.clone(), qs.clone()]);
                    matrices += 1;
                }
            }
        }
        assert_eq!(matrices, 2 * report.experts);
        let mut dense = 0;
        for name in names_s.iter().filter(|n| !expert_tensors.contains(**n)) {
            let (a, b) = (s.get(name).unwrap(), d.get(name).unwrap());
            assert!(a.bytes == b.bytes && a.dtype == b.dtype && a.shape == b.shape, "{what}: {name} changed");
            dense += 1;
        }
        assert_eq!(dense, report.dense_tensors, "{what}");
        // Same files (Picchio (C)'s directory keeps having no index), config copied, image not.
        let files = |p: &Path| {
            let mut v: Vec<String> = hashes(p).into_keys().filter(|n| n != "experts.picchioflat").collect();
            v.retain(|n| n.ends_with(".safetensors") || n.ends_with(".json"));
            v
        };
        assert_eq!(files(&src), files(&dst), "{what}");
        assert_eq!(std::fs::read(src.join("config.json")).unwrap(), std::fs::read(dst.join("config.json")).unwrap());
        assert!(!dst.join("experts.picchioflat").exists());
        let text = report.to_string();
        if what == "picchio_c" {
            assert!(
                text.contains("not copied: experts.picchioflat")
                    && text.contains(&format!("picchio pack {}", dst.display())),
                "{text}"
            );
        } else {
            assert!(!text.contains("not copied"), "{text}");
        }
        // Nothing but the destination was created beside it (no temporary directory left).
        let left: Vec<String> = hashes(tmp.path()).into_keys().filter(|n| n.starts_with('.')).collect();
        assert!(left.is_empty(), "{left:?}");
    }
}

#[test]
fn none_to_q4_and_q3_equal_convert_from_the_checkpoint() {
    let tmp = scratch();
    for src in ["qwen3_moe", "gpt_oss_bf16"] {
        let none = converted(tmp.path(), src, QuantKind::F32);
        for kind in [QuantKind::Q4, QuantKind::Q3] {
            let direct = converted(tmp.path(), src, kind);
            let dst = tmp.path().join(format!("{src}-none-to-{kind}"));
            transcode(&none, &dst, &to(kind)).unwrap();
            let (a, b) = (TensorStore::open(&direct).unwrap(), TensorStore::open(&dst).unwrap());
            for n in same_names(&a, &b, &format!("{src} {kind}")) {
                let (x, y) = (a.get(n).unwrap(), b.get(n).unwrap());
                assert!(x.bytes == y.bytes && x.dtype == y.dtype && x.shape == y.shape, "{src} {kind}: {n}");
            }
        }
    }
}

fn psync(direct: bool) -> EngineOptions {
    EngineOptions { engine: IoEngine::Psync, direct, ..EngineOptions::default() }
}

/// Greedy tokens of `dir` from safetensors and from an image packed into it (psync buffered and
/// direct, io_uring where the kernel has it), which must all agree; returns them.
fn tokens_on_every_tier(dir: &Path, prompt: &[u32], n: usize) -> Vec<u32> {
    let (g, _) = greedy(dir, StoreUri::Safetensors, EngineOptions::default(), Some(4), prompt, n).unwrap();
    let image = dir.join("experts.picchioflat");
    pack(dir, &image, &PackOptions { progress: false, ..Default::default() }).unwrap();
    let mut ios = vec![psync(false), psync(true)];
    // io_uring is Linux's (the Windows build has no UringQueue).
    #[cfg(target_os = "linux")]
    let uring = picchio_blockdev::UringQueue::probe().is_ok();
    #[cfg(not(target_os = "linux"))]
    let uring = false;
    if uring {
        ios.push(EngineOptions { engine: IoEngine::Uring, direct: true, ..EngineOptions::default() });
    } else {
        eprintln!("SKIPPED: io_uring unavailable (psync only)");
    }
    for io in ios {
        let what = format!("{} {:?} direct={}", dir.display(), io.engine, io.direct);
        let (f, _) = greedy(dir, StoreUri::File(image.clone()), io, Some(4), prompt, n).unwrap();
        assert_eq!(f.tokens, g.tokens, "{what}: the packed image and safetensors disagree");
        assert_eq!(f.stats.fallbacks, 0, "{what}");
        assert!(f.stats.reads > 0, "{what}");
    }
    g.tokens
}

#[test]
fn transcoded_directories_run_with_the_same_tokens_on_every_tier() {
    let tmp = scratch();
    let prompt_of = |f: &str| ids(&reference_json(&fixture(f), "reference_q4.json"), "prompt_ids");
    for (what, src) in q4_sources(tmp.path()) {
        let reference = if what == "picchio_c" { "qwen3_moe" } else { what };
        let prompt = prompt_of(reference);
        let dst = tmp.path().join(format!("{what}-run-q3"));
        transcode(&src, &dst, &to(QuantKind::Q3)).unwrap();
        let t = tokens_on_every_tier(&dst, &prompt, 16);
        assert_eq!(t.len(), 16, "{what}");
        eprintln!("{what} q4 -> q3: {t:?}");
    }
    // none -> q4 is convert's Q4: transformers' Q4 tokens, on every tier.
    for src in ["qwen3_moe", "gpt_oss_mxfp4"] {
        let none = converted(tmp.path(), src, QuantKind::F32);
        let dst = tmp.path().join(format!("{src}-run-none-q4"));
        transcode(&none, &dst, &to(QuantKind::Q4)).unwrap();
        let want = ids(&reference_json(&fixture(src), "reference_q4.json"), "greedy_ids");
        assert_eq!(tokens_on_every_tier(&dst, &prompt_of(src), want.len()), want, "{src} none -> q4");
    }
}

#[test]
fn refusals_write_nothing_and_the_source_is_never_written() {
    let tmp = scratch();
    let q4 = converted(tmp.path(), "qwen3_moe", QuantKind::Q4);
    let q4_hashes = hashes(&q4);
    let names = |p: &Path| -> Vec<String> { hashes(p).into_keys().collect() };
    let beside = names(tmp.path());
    let out = tmp.path().join("out");
    let refused = |src: &Path, kind: QuantKind| -> String {
        let e = transcode(src, &out, &to(kind)).unwrap_err();
        assert!(matches!(e, Error::TranscodeRefused { .. }), "{e}");
        assert!(!out.exists());
        e.to_string()
    };
    let e = refused(&q4, QuantKind::Q4);
    assert!(
        e.contains("its routed experts are q4: refusing to transcode them to q4") && e.contains("nothing to do"),
        "{e}"
    );
    let e = refused(&q4, QuantKind::F32);
    assert!(e.contains("transcode writes q4 or q3 experts"), "{e}");
    let q3 = tmp.path().join("q3");
    transcode(&q4, &q3, &to(QuantKind::Q3)).unwrap();
    let q3_hashes = hashes(&q3);
    let e = refused(&q3, QuantKind::Q4);
    assert!(e.contains("are q3: refusing to transcode them to q4: Q3 dropped information"), "{e}");
    assert!(refused(&q3, QuantKind::Q3).contains("nothing to do"));

    // An existing destination: refused without overwrite (untouched), replaced with it.
    let e = transcode(&q4, &q3, &to(QuantKind::Q3)).unwrap_err();
    assert!(matches!(e, Error::Exists { replace_with: Some("--force"), .. }), "{e}");
    assert_eq!(hashes(&q3), q3_hashes);
    std::fs::write(q3.join("stale.txt"), b"old").unwrap();
    transcode(&q4, &q3, &TranscodeOptions { overwrite: true, ..to(QuantKind::Q3) }).unwrap();
    assert!(!q3.join("stale.txt").exists(), "the old directory was replaced whole");
    assert_eq!(hashes(&q3), q3_hashes, "the same bytes again");
    // Inside the source: refused.
    let e = transcode(&q4, &q4.join("q3"), &to(QuantKind::Q3)).unwrap_err().to_string();
    assert!(e.contains("inside the source directory"), "{e}");

    assert_eq!(hashes(&q4), q4_hashes, "the source was never written");
    let mut now = names(tmp.path());
    now.retain(|n| n != "q3");
    assert_eq!(now, beside, "nothing else was created (no temporary directory left)");
}

#[test]
fn a_bad_expert_tensor_is_named_and_nothing_is_written() {
    let tmp = scratch();
    let q4 = converted(tmp.path(), "gpt_oss_mxfp4", QuantKind::Q4);
    // Remove one expert's scales from the index: the tensor is then missing.
    let index = q4.join("model.safetensors.index.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&index).unwrap()).unwrap();
    let name = "model.layers.2.mlp.experts.down_proj.5.qs";
    assert!(v["weight_map"].as_object_mut().unwrap().remove(name).is_some());
    std::fs::write(&index, serde_json::to_vec(&v).unwrap()).unwrap();
    let out = tmp.path().join("out");
    let e = transcode(&q4, &out, &to(QuantKind::Q3)).unwrap_err().to_string();
    assert!(e.contains(name), "{e}");
    assert!(!out.exists());
}
