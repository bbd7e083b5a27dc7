//! GPT-OSS end to end through `convert`, `pack`, `verify` and `Session`: the MXFP4 and BF16
//! checkpoints convert to byte-identical weights, the converted directory's image verifies against
//! it, and every tier (safetensors; file buffered and direct × psync and io_uring) gives
//! transformers' Q4 greedy tokens (`reference_q4.json`). Bad MXFP4 input fails naming the tensor.

use std::path::{Path, PathBuf};

use picchio_core::StoreUri;
use picchio_runtime::expert::open::{EngineOptions, IoEngine};
use picchio_runtime::image::convert::{convert, ConvertOptions};
use picchio_runtime::image::pack::{pack, PackOptions};
use picchio_runtime::image::verify::{verify, VerifyOptions};
use picchio_runtime::quant::QuantKind;
use picchio_tests::*;

fn convert_to(src: &str, dst: &Path, experts: QuantKind) {
    let opts = ConvertOptions { experts, progress: false, ..Default::default() };
    convert(&fixture(src), dst, &opts).unwrap_or_else(|e| panic!("convert {src}: {e}"));
}

/// The weight files of a converted directory (shards and index; config.json and
/// generation_config.json are copied from the source, which differ).
fn weights_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".safetensors") || p.to_string_lossy().ends_with(".index.json"))
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
        .collect();
    v.sort();
    v
}

#[test]
fn mxfp4_and_bf16_checkpoints_convert_to_identical_weights() {
    let tmp = scratch();
    for experts in [QuantKind::F32, QuantKind::Q4, QuantKind::Q3] {
        let (a, b) = (tmp.path().join(format!("mx-{experts}")), tmp.path().join(format!("bf-{experts}")));
        convert_to("gpt_oss_mxfp4", &a, experts);
        convert_to("gpt_oss_bf16", &b, experts);
        let (fa, fb) = (weights_files(&a), weights_files(&b));
        assert_eq!(fa.iter().map(|f| &f.0).collect::<Vec<_>>(), fb.iter().map(|f| &f.0).collect::<Vec<_>>());
        for ((name, x), (_, y)) in fa.iter().zip(&fb) {
            assert!(x == y, "--experts {experts}: {name} differs between the MXFP4 and BF16 conversions");
        }
        // the GPT-OSS spelling, biases resident, no MXFP4 tensors left
        let store = picchio_runtime::model::safetensors::TensorStore::open(&a).unwrap();
        assert!(store.contains("model.layers.3.mlp.experts.gate_up_proj.7"));
        assert_eq!(store.contains("model.layers.3.mlp.experts.down_proj.7.qs"), experts != QuantKind::F32);
        assert!(store.contains("model.layers.0.mlp.experts.gate_up_proj_bias"));
        assert!(!store.names().any(|n| n.ends_with("_blocks") || n.ends_with("_scales")));
    }
}

fn q4_dir(tmp: &Path, src: &str) -> PathBuf {
    let dst = tmp.join(format!("{src}-q4"));
    convert_to(src, &dst, QuantKind::Q4);
    dst
}

#[cfg(target_os = "linux")]
fn uring_available() -> bool {
    picchio_blockdev::UringQueue::probe().is_ok()
}

#[cfg(not(target_os = "linux"))]
fn uring_available() -> bool {
    false
}

#[test]
fn every_tier_gives_transformers_q4_tokens_for_both_layouts() {
    let tmp = scratch();
    for src in ["gpt_oss_mxfp4", "gpt_oss_bf16"] {
        let reference = reference_json(&fixture(src), "reference_q4.json");
        let (prompt, want) = (ids(&reference, "prompt_ids"), ids(&reference, "greedy_ids"));
        let dir = q4_dir(tmp.path(), src);
        let image = dir.join("experts.picchioflat");
        pack(&dir, &image, &PackOptions { progress: false, ..Default::default() }).unwrap();
        let v = verify(&image, Some(&dir), &VerifyOptions { progress: false, ..Default::default() }).unwrap();
        assert!(v.is_clean() && v.compared_with_model, "{src}: verify: {:?}", v.failures);
        assert_eq!(v.entries, 4 * 8);
        assert_eq!((v.superblock.hidden, v.superblock.moe_inter, v.superblock.topk), (64, 128, 4));

        let n = want.len();
        let mut runs = 0;
        for ecap in [1, 4, 32] {
            let (g, _) = greedy(&dir, StoreUri::Safetensors, EngineOptions::default(), Some(ecap), &prompt, n).unwrap();
            assert_eq!(g.tokens, want, "{src} safetensors ecap {ecap}");
            let mut engines = vec![IoEngine::Psync];
            if uring_available() {
                engines.push(IoEngine::Uring);
            } else {
                eprintln!("SKIPPED: io_uring unavailable (psync only)");
            }
            for &engine in &engines {
                for direct in [false, true] {
                    let io = EngineOptions { engine, direct, ..EngineOptions::default() };
                    let what = format!("{src} {engine:?} direct={direct} ecap {ecap}");
                    let (g, _) = greedy(&dir, StoreUri::File(image.clone()), io, Some(ecap), &prompt, n)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_eq!(g.tokens, want, "{what}");
                    assert_eq!(g.stats.fallbacks, 0, "{what}");
                    assert_eq!(g.stats.reads, g.stats.cache_misses, "{what}: every miss is one store read");
                    runs += 1;
                }
            }
        }
        eprintln!("{src}: {runs} file-store runs gave transformers' Q4 tokens");
    }
}

#[test]
fn an_image_packed_for_other_dimensions_is_a_whole_store_mismatch() {
    let tmp = scratch();
    let dir = q4_dir(tmp.path(), "gpt_oss_mxfp4");
    let image = dir.join("experts.picchioflat");
    pack(&dir, &image, &PackOptions { progress: false, ..Default::default() }).unwrap();
    let good = std::fs::read(&image).unwrap();
    let prompt = ids(&reference_json(&fixture("gpt_oss_mxfp4"), "reference_q4.json"), "prompt_ids");
    for (offset, value, want) in [
        (16, 96u32, "hidden is 96 in the store, 64 in the model"),
        (32, 256, "moe_inter (2 × moe_intermediate_size) is 256 in the store, 128 in the model"),
    ] {
        let mut b = good.clone();
        b[offset..offset + 4].copy_from_slice(&value.to_le_bytes());
        std::fs::write(&image, &b).unwrap();
        let e = greedy(&dir, StoreUri::File(image.clone()), EngineOptions::default(), Some(4), &prompt, 2)
            .err()
            .unwrap_or_else(|| panic!("{want}: opened"))
            .to_string();
        assert!(e.contains(want) && e.contains("experts.picchioflat"), "want {want:?} in: {e}");
    }
}

/// One tensor of a rewritten checkpoint: name, dtype, shape, bytes.
type Tensor = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// A copy of the MXFP4 fixture whose tensors `edit` has changed (rewritten with the safetensors
/// crate, so the file itself stays valid).
fn broken_mxfp4(tmp: &Path, edit: impl FnOnce(&mut Vec<Tensor>)) -> PathBuf {
    let dir = tmp.join("broken");
    let _ = std::fs::remove_dir_all(&dir);
    copy_dir(&fixture("gpt_oss_mxfp4"), &dir);
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<Tensor> =
        st.tensors().into_iter().map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec())).collect();
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(&p, safetensors::serialize(views, None).unwrap()).unwrap();
    dir
}

fn tensor<'a>(ts: &'a mut [Tensor], name: &str) -> &'a mut Tensor {
    ts.iter_mut().find(|t| t.0 == name).unwrap()
}

fn convert_err(src: &Path, tmp: &Path) -> String {
    let dst = tmp.join("out");
    let e = convert(src, &dst, &ConvertOptions { progress: false, ..Default::default() }).unwrap_err().to_string();
    assert!(!dst.exists(), "nothing is left at the destination");
    e
}

#[test]
fn bad_mxfp4_tensors_are_named() {
    let tmp = scratch();
    let scales = "model.layers.1.mlp.experts.gate_up_proj_scales";
    // A NaN (0xFF) E8M0 scale: the tensor, expert and position are named.
    let src = broken_mxfp4(tmp.path(), |ts| {
        tensor(ts, scales).3[2 * 128 * 2 + 5 * 2] = 0xFF; // expert 2, row 5, group 0
    });
    let e = convert_err(&src, tmp.path());
    assert!(e.contains(scales) && e.contains("[2]") && e.contains("0xFF") && e.contains("row 5"), "{e}");
    // Scales whose shape disagrees with their blocks.
    let src = broken_mxfp4(tmp.path(), |ts| {
        let t = tensor(ts, scales);
        t.2 = vec![8, 128, 1];
        t.3.truncate(8 * 128);
    });
    let e = convert_err(&src, tmp.path());
    assert!(e.contains(scales) && e.contains("does not match its blocks") && e.contains("[8, 128, 2, 16]"), "{e}");
    // Blocks cut short (a tensor of the wrong shape).
    let blocks = "model.layers.0.mlp.experts.down_proj_blocks";
    let src = broken_mxfp4(tmp.path(), |ts| {
        let t = tensor(ts, blocks);
        t.2 = vec![8, 64, 2, 8];
        t.3.truncate(8 * 64 * 2 * 8);
    });
    let e = convert_err(&src, tmp.path());
    assert!(e.contains(blocks) && e.contains("[8, 64, 2, 16]"), "{e}");
}
