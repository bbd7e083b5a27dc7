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

use picchio_runtime::image::synthetic_model::{write_synthetic, SyntheticArch, SyntheticSpec, WriteSyntheticOptions};

/// A Qwen3-MoE-shaped random model: 3 layers × 64 experts of 884,736 B (170 MB of experts), hidden
/// 1024, and a vocabulary of 32,768 (embeddings and lm_head 34 MB each, I8 with row scales).
fn spec() -> SyntheticSpec {
    SyntheticSpec {
        arch: SyntheticArch::Qwen3_30bA3b,
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
    write_synthetic(&m, &spec(), &WriteSyntheticOptions { tokenizer: None, progress: false }).unwrap();
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

/// `picchio plan --json ARGS` as JSON.
fn plan(m: &Path, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["plan", "--model", m.to_str().unwrap(), "--json"];
    all.extend_from_slice(args);
    serde_json::from_str(common::ok(&all).trim()).unwrap()
}

/// `picchio run` of 3 prompt ids and 2 new tokens on `m` with `args`, as JSON.
fn run(m: &Path, image: &Path, args: &[&str]) -> serde_json::Value {
    let store = format!("file:{}", image.display());
    let mut all = vec!["run", "--model", m.to_str().unwrap(), "--store", &store, "--prompt-ids", "1,2,3", "-n", "2"];
    all.extend_from_slice(args);
    all.push("--json");
    serde_json::from_str(common::ok(&all).trim()).unwrap()
}

#[test]
fn run_holds_the_dense_part_once_and_stays_within_its_plan() {
    let dir = common::scratch();
    let m = model(dir.path());
    let image = dir.path().join("e.picchioflat");
    common::ok(&["pack", m.to_str().unwrap(), "--out", image.to_str().unwrap(), "--no-progress"]);
    // The resident tensors as stored (I8 embeddings and lm_head with their row scales, F32
    // attention, norms and routers: kept as they are), i.e. every tensor but the routed experts.
    let tensors = picchio_runtime::model::safetensors::TensorStore::open(&m).unwrap();
    let names: Vec<String> = tensors.names().filter(|n| !n.contains(".mlp.experts.")).map(str::to_owned).collect();
    let shard: u64 = names.iter().map(|n| tensors.get(n).unwrap().bytes.len() as u64).sum();
    drop(tensors);
    let p = plan(&m, &["--ctx", "5", "--ecap", "8"]);
    let (dense, total) = (p["dense_bytes"].as_u64().unwrap(), p["total_bytes"].as_u64().unwrap());
    let slot = p["slot_bytes"].as_u64().unwrap();
    assert!(dense.abs_diff(shard) <= shard / 100, "dense {dense} B, resident tensors {shard} B");
    assert_eq!(slot, spec().expert_layout().len().div_ceil(4096) as u64 * 4096);

    // The copy of the dense part, 8 slots, the KV cache and the program (the plan's 64 MiB): keeping
    // the mapped tensors resident beside the copy, as before, costs their size again and fails this.
    let v = run(&m, &image, &["--ecap", "8"]);
    let peak = v["stats"]["peak_rss_bytes"].as_u64().unwrap();
    assert!(peak <= total, "peak RSS {peak} B over the plan's {total} B (dense {dense} B)");
    assert!(peak >= dense, "peak RSS {peak} B is below the dense part {dense} B: not the process's VmHWM?");

    // --mem: the expert cache gets what the budget leaves, and the run stays within the budget.
    let budget_mb = (total + 2 * slot).div_ceil(1_000_000);
    let mem = format!("{budget_mb}MB");
    let p = plan(&m, &["--ctx", "5", "--mem", &mem]);
    let fixed = total - 8 * slot;
    let want = (budget_mb * 1_000_000 - fixed) / slot;
    assert_eq!(p["ecap"].as_u64(), Some(want), "{p}");
    assert!(want >= 10);
    let v = run(&m, &image, &["--mem", &mem]);
    assert_eq!(v["stats"]["cache_capacity"].as_u64(), Some(want));
    let peak = v["stats"]["peak_rss_bytes"].as_u64().unwrap();
    assert!(peak <= budget_mb * 1_000_000, "peak RSS {peak} B over --mem {mem}");

    // A budget below one token's working set is refused, with the figures, before loading.
    let small = format!("{}MB", dense / 1_000_000);
    let o =
        common::picchio(&["run", "--model", m.to_str().unwrap(), "--prompt-ids", "1,2,3", "-n", "2", "--mem", &small]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("below one token's working set") && err.contains("dense part"), "{err}");
}

#[test]
fn ecap_per_layer_is_slots_per_moe_layer() {
    // Picchio (C)'s fixture: 3 MoE layers of 16 experts.
    let m = common::model();
    let p = plan(&m, &["--ecap-per-layer", "2", "--ctx", "8"]);
    assert_eq!((p["ecap"].as_u64(), p["moe_layers"].as_u64()), (Some(6), Some(3)), "{p}");
    let v = run(&m, &m.join("experts.picchioflat"), &["--ecap-per-layer", "2"]);
    assert_eq!(v["stats"]["cache_capacity"].as_u64(), Some(6));
    let text = common::ok(&["plan", "--model", m.to_str().unwrap(), "--ecap-per-layer", "2"]);
    assert!(text.contains("--ecap-per-layer 2 × 3 MoE layers") && text.contains("KV cache"), "{text}");
    let o = common::picchio(&["plan", "--model", m.to_str().unwrap(), "--ecap-per-layer", "17"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("a MoE layer has only 16 experts"));
    let o = common::picchio(&[
        "run",
        "--model",
        m.to_str().unwrap(),
        "--prompt-ids",
        "1",
        "--ecap",
        "4",
        "--ecap-per-layer",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(2), "--ecap and --ecap-per-layer together are a usage error");
}
