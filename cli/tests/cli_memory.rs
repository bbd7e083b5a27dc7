//! Memory bounds of the real binary on a synthetic model: `picchio pack` holds a few payloads, not
//! the image; `picchio run` holds the dense part once (its copy), not beside its mapped shards.
//!
//! Peak RSS is the process's own `VmHWM` (`/proc/self/status`), which `pack` prints and `run --json`
//! reports as `stats.peak_rss_bytes`: the child's `ru_maxrss` from wait4 would not do, because
//! Linux folds the parent's (this test binary's) high-water mark into it at exec. Bounds are
//! formulas of the payload and dense sizes, so they hold whatever the load or the page cache.
#![cfg(target_os = "linux")]

mod common;

use std::path::{Path, PathBuf};

use picchio_runtime::image::synthetic::{write_synthetic, SyntheticSpec};

/// A Qwen3-MoE-shaped random model: 3 layers × 64 experts of 884,736 B (170 MB of experts), hidden
/// 1024, and a vocabulary of 32,768 (embeddings and lm_head 67 MB each, bf16).
fn spec() -> SyntheticSpec {
    SyntheticSpec {
        layers: 3,
        hidden: 1024,
        heads: 8,
        kv_heads: 2,
        head_dim: 128,
        experts: 64,
        topk: 4,
        moe_inter: 512,
        vocab: 32_768,
        seed: 11,
    }
}

fn model(dir: &Path) -> PathBuf {
    let m = dir.join("model");
    write_synthetic(&m, &spec(), &mut |_, _| {}).unwrap();
    m
}

/// The `peak RSS … (N bytes)` figure of pack's report.
fn pack_peak(stdout: &str) -> u64 {
    let tail = stdout.split("peak RSS ").nth(1).unwrap_or_else(|| panic!("no peak RSS in:\n{stdout}"));
    let n = tail.split('(').nth(1).and_then(|t| t.split(' ').next()).unwrap();
    n.parse().unwrap_or_else(|e| panic!("{n}: {e}"))
}

#[test]
fn pack_peak_rss_is_a_few_payloads_whatever_the_image_size() {
    let dir = common::scratch();
    let m = model(dir.path());
    let payload = spec().expert_layout().len() as u64;
    let image = dir.path().join("all.picchioflat");
    let all = pack_peak(&common::ok(&["pack", m.to_str().unwrap(), "--out", image.to_str().unwrap(), "--no-progress"]));
    let one_path = dir.path().join("one.picchioflat");
    let one = pack_peak(&common::ok(&[
        "pack",
        m.to_str().unwrap(),
        "--out",
        one_path.to_str().unwrap(),
        "--layers",
        "1",
        "--no-progress",
    ]));
    let image_len = std::fs::metadata(&image).unwrap().len();
    assert!(image_len > 3 * 64 * payload, "{image_len}");
    // Three layers of experts cost at most two payloads more than one layer (the image is 3× larger);
    // before, every mapped page stayed resident and the difference was two layers: 113 MB.
    assert!(all <= one + 2 * payload, "peak RSS {all} B for 3 layers, {one} B for 1; payload {payload} B");
    // And the whole peak is well under the image: the program itself plus a few payloads.
    assert!(all < image_len / 2, "peak RSS {all} B packing a {image_len}-byte image");
    drop(std::fs::remove_file(&image));
}

#[test]
fn run_holds_the_dense_part_once() {
    let dir = common::scratch();
    let m = model(dir.path());
    let image = dir.path().join("e.picchioflat");
    common::ok(&["pack", m.to_str().unwrap(), "--out", image.to_str().unwrap(), "--no-progress"]);
    // The dense shard (embeddings, lm_head, attention, norms, routers; all bf16, kept as bf16).
    let dense = std::fs::metadata(m.join("model-00001-of-00004.safetensors")).unwrap().len();
    let ecap = 8u64;
    let store = format!("file:{}", image.display());
    let out = common::ok(&[
        "run",
        "--model",
        m.to_str().unwrap(),
        "--store",
        &store,
        "--prompt-ids",
        "1,2,3",
        "-n",
        "2",
        "--ecap",
        &ecap.to_string(),
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let peak = v["stats"]["peak_rss_bytes"].as_u64().unwrap();
    let slots = ecap * spec().expert_layout().len() as u64;
    // The copy of the dense part, the cache slots, and 64 MiB for the program itself (code, heap,
    // thread stacks, the KV cache of 5 positions). Keeping the mapped shard resident beside the
    // copy, as before, costs another `dense` (151 MB) and fails this.
    let bound = dense + slots + (64 << 20);
    assert!(peak <= bound, "peak RSS {peak} B > dense {dense} + slots {slots} + 64 MiB = {bound}");
    assert!(peak >= dense, "peak RSS {peak} B is below the dense part {dense} B: not the process's VmHWM?");
}
