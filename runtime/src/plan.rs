//! The memory plan ([`plan`]): one budget (`--mem`) split between the dense part, the KV cache and
//! the expert cache, as `picchio plan` prints it and `picchio run --mem` uses it; and the memory
//! figures it is made of, of this process and this machine — the peak resident set (`VmHWM`), the
//! memory the kernel says is available (`MemAvailable`) and the cgroup's limit (`memory.max`), read
//! from procfs and cgroupfs text (Linux; `None` elsewhere or when a file is missing).
//!
//! | part | bytes |
//! | --- | --- |
//! | dense part | every resident tensor as loaded: F32, BF16 and I8 matrices as stored (the projections `--dense bf16\|int8` converts in their new size), vectors, biases and F16 widened to f32 ([`dense_bytes`]) |
//! | KV cache | `ctx × n_layers × kv_heads × head_dim × 4 B × 2` (keys and values, f32) |
//! | runtime | [`RUNTIME_BYTES`] for the program itself, plus the attention scores `heads × ctx × 4 B` and the logits `vocab × 4 B` |
//! | expert cache | the rest, in slots of the expert payload rounded up to 4 KiB |
//!
//! One token's working set is the dense part, the KV cache, the runtime and top-k slots (the
//! experts one MoE layer routes to must be resident together): a smaller budget is refused.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::{Error, Result};
use crate::expert::layout::ExpertLayout;
use crate::model::config::{Arch, Config};
use crate::model::dir::ModelDir;
use crate::model::matrix::DenseFormat;
use crate::model::safetensors::TensorStore;

/// The peak resident set size of this process in bytes: `VmHWM` of `/proc/self/status` (proc(5)),
/// the high-water mark of anonymous, file-backed and shared pages mapped at once — a mapped file's
/// pages count while they are mapped, which is why a model's safetensors pages are released after
/// copying. `None` off Linux.
pub fn peak_rss() -> Option<u64> {
    status_kb(&std::fs::read_to_string("/proc/self/status").ok()?, "VmHWM:")
}

/// The resident set size of this process now in bytes (`VmRSS` of `/proc/self/status`).
pub fn current_rss() -> Option<u64> {
    status_kb(&std::fs::read_to_string("/proc/self/status").ok()?, "VmRSS:")
}

/// The value of a `Key:   N kB` line of `/proc/*/status` or `/proc/meminfo`, in bytes.
fn status_kb(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line[key.len()..].split_whitespace().next()?.parse().ok()?;
    Some(kb * 1024)
}

/// `MemAvailable` of `/proc/meminfo` in bytes: the kernel's estimate of memory available to start
/// new work without swapping (proc(5)).
pub fn mem_available() -> Option<u64> {
    status_kb(&std::fs::read_to_string("/proc/meminfo").ok()?, "MemAvailable:")
}

/// The tightest memory limit of this process's cgroup and its ancestors, in bytes, with the file
/// that sets it: cgroup v2 `memory.max` (a number, or `max` for none) along the path that
/// `/proc/self/cgroup` gives for hierarchy `0::`, else cgroup v1 `memory.limit_in_bytes` of the
/// `memory` controller. `None` when no limit is set or nothing can be read.
pub fn cgroup_limit() -> Option<(u64, std::path::PathBuf)> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_limit_in(Path::new("/sys/fs/cgroup"), &cgroup)
}

/// [`cgroup_limit`] with the cgroup file system mounted at `root` and `/proc/self/cgroup`'s text.
pub(crate) fn cgroup_limit_in(root: &Path, proc_cgroup: &str) -> Option<(u64, std::path::PathBuf)> {
    let read = |p: &Path| std::fs::read_to_string(p).ok().map(|s| s.trim().to_string());
    // v1 reports "no limit" as a huge page-rounded number (LONG_MAX rounded down to pages).
    let limit = |s: &str| s.parse::<u64>().ok().filter(|&v| v < (1u64 << 62));
    let mut best: Option<(u64, std::path::PathBuf)> = None;
    let mut consider = |v: u64, p: std::path::PathBuf| {
        if best.as_ref().is_none_or(|(b, _)| v < *b) {
            best = Some((v, p));
        }
    };
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        let rel = path.trim_start_matches('/');
        let (dir, file) = if id == "0" && controllers.is_empty() {
            (root.to_path_buf(), "memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            (root.join("memory"), "memory.limit_in_bytes")
        } else {
            continue;
        };
        // The cgroup itself and every ancestor up to the root: the tightest one binds.
        let mut here = dir.join(rel);
        loop {
            let p = here.join(file);
            if let Some(v) = read(&p).as_deref().and_then(limit) {
                consider(v, p);
            }
            if here == dir || !here.pop() {
                break;
            }
        }
    }
    best
}

/// What the program itself takes beside the weights, caches and scratch the plan counts: code,
/// allocator arenas, thread stacks, the tokenizer. 64 MiB: `picchio run` on the vendored fixtures
/// peaks at 20–40 MB above its weights and slots (measured with `stats.peak_rss_bytes`).
pub const RUNTIME_BYTES: u64 = 64 << 20;

/// The KV-cache length `picchio plan` assumes without `--ctx`: 4096 positions (at most the
/// model's `max_position_embeddings`).
pub const DEFAULT_PLAN_CTX: usize = 4096;

/// A memory budget as `--mem` takes it: bytes, or a percentage of the cgroup's limit (else of
/// `MemAvailable`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MemBudget {
    /// This many bytes.
    Bytes(u64),
    /// This percentage (0–100] of the cgroup's `memory.max`, or of `MemAvailable` without one.
    Percent(f64),
}

impl std::str::FromStr for MemBudget {
    type Err = String;

    /// `8` or `8GB` (10^9 bytes; a bare number is GB), `8GiB` (2^30), `500MB`, `500MiB`, `1TB`, or
    /// `50%`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let t = s.trim();
        if let Some(p) = t.strip_suffix('%') {
            let v: f64 = p.trim().parse().map_err(|_| format!("{s}: not a percentage (e.g. 50%)"))?;
            if !(v > 0.0 && v <= 100.0) {
                return Err(format!("{s}: a percentage must be in (0, 100]"));
            }
            return Ok(MemBudget::Percent(v));
        }
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let v: f64 = num.parse().map_err(|_| format!("{s}: not a size (e.g. 8GB, 8GiB, 500MB or 50%)"))?;
        let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "g" | "gb" => 1e9,
            "gi" | "gib" => (1u64 << 30) as f64,
            "m" | "mb" => 1e6,
            "mi" | "mib" => (1u64 << 20) as f64,
            "t" | "tb" => 1e12,
            "ti" | "tib" => (1u64 << 40) as f64,
            other => return Err(format!("{s}: unknown unit `{other}` (use GB, GiB, MB, MiB, TB or %)")),
        };
        let bytes = v * scale;
        if !(bytes >= 1.0 && bytes < u64::MAX as f64) {
            return Err(format!("{s}: a budget must be at least 1 byte"));
        }
        Ok(MemBudget::Bytes(bytes as u64))
    }
}

/// How many experts the expert cache holds, as asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheRequest {
    /// `--ecap N`: N experts across all MoE layers.
    Experts(usize),
    /// `--ecap-per-layer N`: Picchio (C)'s ECAP, N slots per MoE layer (N × MoE layers in all).
    PerLayer(usize),
}

/// What [`plan`] is asked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlanRequest {
    /// The budget (`--mem`); `None` without one.
    pub budget: Option<MemBudget>,
    /// An explicit expert-cache size; `None`: what the budget leaves, or without a budget today's
    /// default ([`crate::run::default_ecap`]).
    pub cache: Option<CacheRequest>,
    /// Positions the KV cache holds (`--ctx`, or prompt + new tokens for a run).
    pub ctx: usize,
    /// How the resident projections are kept (`--dense`).
    pub dense: DenseFormat,
}

/// One budget split between the dense part, the KV cache, the runtime and the expert cache (module
/// docs), in bytes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemPlan {
    /// The model directory.
    pub model_dir: PathBuf,
    /// The budget in bytes, when one was given.
    pub budget_bytes: Option<u64>,
    /// Where the budget comes from (`--mem 8GB`, `50% of /sys/fs/cgroup/…/memory.max (…)`).
    pub budget_source: Option<String>,
    /// Resident weights ([`dense_bytes`]).
    pub dense_bytes: u64,
    /// How the resident projections are kept (`--dense`: `stored`, `bf16` or `int8`).
    pub dense_format: &'static str,
    /// KV-cache positions.
    pub ctx: usize,
    /// KV cache: ctx × layers × kv_heads × head_dim × 4 B × 2.
    pub kv_bytes: u64,
    /// [`RUNTIME_BYTES`] plus the attention scores and logits.
    pub runtime_bytes: u64,
    /// Bytes of one expert-cache slot (the payload rounded up to 4 KiB).
    pub slot_bytes: u64,
    /// Experts one token routes to per MoE layer.
    pub topk: usize,
    /// MoE layers.
    pub moe_layers: usize,
    /// Experts per MoE layer.
    pub experts_per_layer: usize,
    /// Routed experts in all.
    pub total_experts: usize,
    /// Expert-cache capacity, experts.
    pub ecap: usize,
    /// Where the capacity comes from (`--mem`, `--ecap 96`, `--ecap-per-layer 2`, `default`).
    pub ecap_source: String,
    /// ecap × slot_bytes.
    pub expert_cache_bytes: u64,
    /// dense + KV + runtime + expert cache.
    pub total_bytes: u64,
    /// One token's working set: dense + KV + runtime + top-k slots.
    pub one_token_bytes: u64,
    /// The cgroup's memory limit, bytes, when there is one.
    pub cgroup_limit_bytes: Option<u64>,
}

/// GB (10^9 bytes) with two decimals for messages, or MB with one below 0.1 GB.
fn gb(b: u64) -> String {
    if b < 100_000_000 {
        format!("{:.1} MB", b as f64 / 1e6)
    } else {
        format!("{:.2} GB", b as f64 / 1e9)
    }
}

impl MemPlan {
    /// The working set of one token against `have` bytes, for refusals.
    fn figures(&self) -> String {
        format!(
            "dense part {} + KV cache {} ({} positions) + runtime {} + {} expert slots × {} B ({})",
            gb(self.dense_bytes),
            gb(self.kv_bytes),
            self.ctx,
            gb(self.runtime_bytes),
            self.ecap,
            self.slot_bytes,
            gb(self.expert_cache_bytes)
        )
    }
}

impl fmt::Display for MemPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "memory plan for {}", self.model_dir.display())?;
        if let (Some(b), Some(src)) = (self.budget_bytes, &self.budget_source) {
            writeln!(f, "  budget        {:>10}  ({src})", gb(b))?;
        }
        writeln!(
            f,
            "  dense part    {:>10}  (resident weights: embeddings, attention, norms, routers, lm_head; projections {})",
            gb(self.dense_bytes),
            self.dense_format
        )?;
        writeln!(f, "  KV cache      {:>10}  ({} positions)", gb(self.kv_bytes), self.ctx)?;
        writeln!(f, "  runtime       {:>10}  (program, attention scores, logits)", gb(self.runtime_bytes))?;
        let pct = 100.0 * self.ecap as f64 / self.total_experts.max(1) as f64;
        let per_layer = self.ecap as f64 / self.moe_layers.max(1) as f64;
        writeln!(
            f,
            "  expert cache  {:>10}  ({} slots of {} B: {pct:.1}% of {} experts, {per_layer:.1} per MoE layer; {})",
            gb(self.expert_cache_bytes),
            self.ecap,
            self.slot_bytes,
            self.total_experts,
            self.ecap_source
        )?;
        writeln!(f, "  total         {:>10}", gb(self.total_bytes))?;
        write!(
            f,
            "  one token     {:>10}  (dense + KV + runtime + top-{} slots)",
            gb(self.one_token_bytes),
            self.topk
        )?;
        if let Some(c) = self.cgroup_limit_bytes {
            write!(f, "\n  cgroup limit  {:>10}", gb(c))?;
        }
        Ok(())
    }
}

/// Bytes the resident (dense) part of the model in `store` takes once loaded: every tensor but the
/// routed experts' payload tensors, F32, BF16 and I8 matrices as stored, vectors, `*_bias` tensors
/// and F16 widened to f32 (as [`crate::model::Matrix::load`] and the architectures' loaders keep
/// them), the projections [`DenseFormat::converts`] names in their `dense` size
/// ([`DenseFormat::matrix_bytes`]). An untied Qwen3-MoE lm_head counts; a tied one is the
/// embedding. Reads tensor headers only.
pub fn dense_bytes(store: &TensorStore, cfg: &Config, layout: &ExpertLayout, dense: DenseFormat) -> u64 {
    let mut experts = std::collections::HashSet::new();
    for l in cfg.moe_layers() {
        for e in 0..cfg.num_experts {
            let n = layout.names(l, e);
            experts.extend([n.gate_up, n.gate_up_qs, n.down, n.down_qs]);
        }
    }
    let tied = cfg.arch() == Arch::Qwen3Moe && cfg.tie_word_embeddings;
    let mut total = 0u64;
    for name in store.names() {
        if experts.contains(name) || (tied && name == "lm_head.weight") {
            continue;
        }
        let Ok(t) = store.get(name) else { continue };
        let widened = t.shape.len() == 1 || name.ends_with("_bias") || t.dtype == safetensors::Dtype::F16;
        let float_matrix = t.shape.len() == 2 && t.dtype != safetensors::Dtype::I8;
        total += if DenseFormat::converts(name) && float_matrix {
            // As loaded (F16 widened to f32), then converted (I8 ones stay, their `.qs` counted apart).
            let stored = if t.dtype == safetensors::Dtype::F16 { 4 } else { t.dtype.bitsize() / 8 };
            dense.matrix_bytes(stored, t.shape[0], t.shape[1])
        } else if widened {
            4 * t.numel() as u64
        } else {
            t.bytes.len() as u64
        };
    }
    total
}

/// The budget in bytes and where it comes from, `None` without `--mem`.
fn resolve_budget(b: MemBudget, cgroup: Option<&(u64, PathBuf)>) -> Result<(u64, String)> {
    match b {
        MemBudget::Bytes(n) => Ok((n, format!("--mem {}", gb(n)))),
        MemBudget::Percent(p) => {
            let (base, what) = match cgroup {
                Some((limit, file)) => (*limit, format!("{} ({})", file.display(), gb(*limit))),
                None => {
                    let avail = mem_available().ok_or_else(|| {
                        Error::Invalid(format!(
                            "--mem {p}%: this machine reports neither a cgroup memory.max nor MemAvailable: \
                             give the budget in bytes (e.g. --mem 8GB)"
                        ))
                    })?;
                    (avail, format!("MemAvailable ({})", gb(avail)))
                }
            };
            Ok(((base as f64 * p / 100.0) as u64, format!("--mem {p}% of {what}")))
        }
    }
}

/// The memory plan of the converted model `model` for `req` (module docs), with the cgroup limit of
/// this process ([`cgroup_limit`]). Reads the tensor headers only (the config was read when `model`
/// was opened).
///
/// # Errors
/// The directory's ([`TensorStore::open`], [`ExpertLayout::detect`]);
/// [`Error::Invalid`] naming the figures when the budget is below one token's working set, an
/// explicit cache does not fit the budget, the budget or the asked-for cache does not fit the
/// cgroup's limit, or a capacity is 0 or above the model's experts.
pub fn plan(model: &ModelDir, req: &PlanRequest) -> Result<MemPlan> {
    let cfg = model.config();
    if let Some(g) = model.gguf() {
        // A GGUF's dense part is kept as stored whatever `--dense` asks (DenseFormat applies to
        // converted directories).
        let layout = g.expert_layout(cfg)?;
        return plan_with(model.path(), cfg, g.dense_bytes(), layout.len(), req, cgroup_limit());
    }
    let store = TensorStore::open(model.path())?;
    let layout = ExpertLayout::detect(&store, cfg)?;
    let dense = dense_bytes(&store, cfg, &layout, req.dense);
    plan_with(model.path(), cfg, dense, layout.len(), req, cgroup_limit())
}

/// [`plan`] for a model of `cfg` whose dense part is `dense` bytes and expert payload `payload`
/// bytes, under the cgroup limit `cgroup`.
pub(crate) fn plan_with(
    model_dir: &Path,
    cfg: &Config,
    dense: u64,
    payload: usize,
    req: &PlanRequest,
    cgroup: Option<(u64, PathBuf)>,
) -> Result<MemPlan> {
    let bs = picchio_core::format::BLOCK_SIZE as u64;
    let slot = (payload as u64).div_ceil(bs) * bs;
    let ctx = req.ctx.max(1) as u64;
    let kv = ctx * (cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim()) as u64 * 4 * 2;
    let runtime = RUNTIME_BYTES + 4 * (cfg.num_attention_heads as u64 * ctx + cfg.vocab_size as u64);
    let moe_layers = cfg.moe_layers().len();
    let total = moe_layers * cfg.num_experts;
    let topk = cfg.num_experts_per_tok.max(1);
    let fixed = dense + kv + runtime;
    let budget = req.budget.map(|b| resolve_budget(b, cgroup.as_ref())).transpose()?;
    let invalid = |m: String| Err(Error::Invalid(m));
    let (ecap, source) = match req.cache {
        Some(CacheRequest::Experts(0)) | Some(CacheRequest::PerLayer(0)) => {
            return invalid("--ecap / --ecap-per-layer: the expert cache needs at least 1 expert".into());
        }
        Some(CacheRequest::Experts(n)) if n > total => {
            return invalid(format!(
                "--ecap {n}: the model has only {total} routed experts ({moe_layers} MoE layers × {})",
                cfg.num_experts
            ));
        }
        Some(CacheRequest::PerLayer(n)) if n > cfg.num_experts => {
            return invalid(format!("--ecap-per-layer {n}: a MoE layer has only {} experts", cfg.num_experts));
        }
        Some(CacheRequest::Experts(n)) => (n, format!("--ecap {n}")),
        Some(CacheRequest::PerLayer(n)) => (n * moe_layers, format!("--ecap-per-layer {n} × {moe_layers} MoE layers")),
        None => match &budget {
            Some((b, _)) => {
                let fit = b.saturating_sub(fixed) / slot.max(1);
                (usize::try_from(fit).unwrap_or(usize::MAX).min(total.max(1)), "what --mem leaves".into())
            }
            None => (crate::run::default_ecap(total, slot as usize, topk), "default: half of MemAvailable".into()),
        },
    };
    let ecap_bytes = ecap as u64 * slot;
    let plan = MemPlan {
        model_dir: model_dir.into(),
        budget_bytes: budget.as_ref().map(|b| b.0),
        budget_source: budget.as_ref().map(|b| b.1.clone()),
        dense_bytes: dense,
        dense_format: req.dense.name(),
        ctx: ctx as usize,
        kv_bytes: kv,
        runtime_bytes: runtime,
        slot_bytes: slot,
        topk,
        moe_layers,
        experts_per_layer: cfg.num_experts,
        total_experts: total,
        ecap,
        ecap_source: source,
        expert_cache_bytes: ecap_bytes,
        total_bytes: fixed + ecap_bytes,
        one_token_bytes: fixed + topk.min(total.max(1)) as u64 * slot,
        cgroup_limit_bytes: cgroup.as_ref().map(|c| c.0),
    };
    if let Some((b, src)) = &budget {
        if *b < plan.one_token_bytes {
            return invalid(format!(
                "{src}: {} is below one token's working set of {}: dense part {} + KV cache {} ({} positions) \
                 + runtime {} + top-{topk} expert slots {}; give at least {} (or a shorter --ctx)",
                gb(*b),
                gb(plan.one_token_bytes),
                gb(dense),
                gb(kv),
                plan.ctx,
                gb(runtime),
                gb(topk as u64 * slot),
                gb(plan.one_token_bytes)
            ));
        }
        if plan.total_bytes > *b {
            return invalid(format!(
                "{}: the plan needs {}, over the budget ({src}) of {}: {}",
                plan.ecap_source,
                gb(plan.total_bytes),
                gb(*b),
                plan.figures()
            ));
        }
    }
    if let Some((limit, file)) = &cgroup {
        // Only what the user asked for is refused; the default policy predates the plan.
        let asked = budget.is_some() || req.cache.is_some();
        if let Some((b, src)) = budget.as_ref().filter(|(b, _)| b > limit) {
            return invalid(format!(
                "{src}: the budget of {} is over this process's cgroup limit of {} ({}): lower --mem",
                gb(*b),
                gb(*limit),
                file.display()
            ));
        }
        if asked && plan.total_bytes > *limit {
            return invalid(format!(
                "{}: the plan needs {}, over this process's cgroup limit of {} ({}): {}; ask for fewer experts \
                 or use --mem to fit the limit",
                plan.ecap_source,
                gb(plan.total_bytes),
                gb(*limit),
                file.display(),
                plan.figures()
            ));
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture;

    #[test]
    fn budgets_parse_in_decimal_and_binary_units_and_percent() {
        let b = |s: &str| s.parse::<MemBudget>();
        assert_eq!(b("8"), Ok(MemBudget::Bytes(8_000_000_000)));
        assert_eq!(b("8GB"), Ok(MemBudget::Bytes(8_000_000_000)));
        assert_eq!(b("1.5g"), Ok(MemBudget::Bytes(1_500_000_000)));
        assert_eq!(b("8GiB"), Ok(MemBudget::Bytes(8 << 30)));
        assert_eq!(b("500MB"), Ok(MemBudget::Bytes(500_000_000)));
        assert_eq!(b("512MiB"), Ok(MemBudget::Bytes(512 << 20)));
        assert_eq!(b("50%"), Ok(MemBudget::Percent(50.0)));
        for bad in ["", "GB", "8XB", "0", "-1", "0%", "101%", "x%"] {
            assert!(b(bad).is_err(), "{bad:?} parsed");
        }
        assert!(b("8XB").unwrap_err().contains("unknown unit"));
    }

    /// The resident bytes the loaded weights really take.
    fn loaded_bytes(w: &crate::model::Weights) -> u64 {
        use crate::model::{Matrix, Mlp};
        let m = |m: &Matrix| m.resident_bytes();
        let v = |v: &Vec<f32>| 4 * v.len() as u64;
        let mut n = m(&w.embed_tokens) + v(&w.norm) + w.lm_head.as_ref().map_or(0, m);
        for l in &w.layers {
            n += v(&l.input_layernorm) + v(&l.q_norm) + v(&l.k_norm) + v(&l.post_attention_layernorm);
            n += m(&l.q_proj) + m(&l.k_proj) + m(&l.v_proj) + m(&l.o_proj);
            n += match &l.mlp {
                Mlp::Moe { gate } => m(gate),
                Mlp::Dense { gate_proj, up_proj, down_proj } => m(gate_proj) + m(up_proj) + m(down_proj),
            };
        }
        n
    }

    #[test]
    fn dense_bytes_are_what_loading_keeps_resident() {
        let check = |dir: &Path, name: &str| {
            let dir = ModelDir::open(dir).unwrap();
            for fmt in DenseFormat::ALL {
                let model = crate::model::Model::load_as(&dir, 4, fmt).unwrap();
                let w = model.weights().qwen3_moe().unwrap();
                let d = dense_bytes(model.tensors().unwrap(), model.config(), model.layout(), fmt);
                assert_eq!(d, loaded_bytes(w), "{name} --dense {fmt}");
            }
        };
        // I8 embeddings and lm_head + F32 attention (Picchio (C)).
        check(&fixture("picchio_c/qwen3_moe"), "picchio_c");
        // bf16 from our converter, with a dense-MLP layer (qwen3_moe_wide).
        let tmp = tempfile::tempdir().unwrap();
        let opts = crate::image::convert::ConvertOptions { progress: false, ..Default::default() };
        for name in ["qwen3_moe", "qwen3_moe_wide"] {
            let out = tmp.path().join(name);
            crate::image::convert::convert(&fixture(name), &out, &opts).unwrap();
            check(&out, name);
        }
    }

    fn plan_of(req: PlanRequest, cgroup: Option<(u64, PathBuf)>) -> Result<MemPlan> {
        let dir = fixture("picchio_c/qwen3_moe");
        let cfg = Config::from_dir(&dir).unwrap();
        // A 1 GB dense part, 1 MiB experts: round figures for the arithmetic below.
        plan_with(&dir, &cfg, 1_000_000_000, 1 << 20, &req, cgroup)
    }

    #[test]
    fn a_budget_is_split_and_the_rest_goes_to_expert_slots() {
        let req = PlanRequest {
            budget: Some(MemBudget::Bytes(1_090_000_000)),
            cache: None,
            ctx: 64,
            dense: DenseFormat::Stored,
        };
        let p = plan_of(req, None).unwrap();
        let cfg = Config::from_dir(&fixture("picchio_c/qwen3_moe")).unwrap();
        let kv = 64 * (cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim()) as u64 * 8;
        assert_eq!(p.kv_bytes, kv);
        assert_eq!(p.slot_bytes, 1 << 20);
        let fixed = p.dense_bytes + p.kv_bytes + p.runtime_bytes;
        let fit = ((1_090_000_000 - fixed) / (1 << 20)) as usize;
        assert!(fit < p.total_experts, "{fit}");
        assert_eq!(p.ecap, fit);
        assert!(p.total_bytes <= 1_090_000_000);
        assert_eq!(p.total_bytes, fixed + p.ecap as u64 * (1 << 20));
        let text = p.to_string();
        assert!(
            text.contains("budget") && text.contains("expert cache") && text.contains("what --mem leaves"),
            "{text}"
        );
        // A budget below one token's working set is refused with the figures.
        let req = PlanRequest {
            budget: Some(MemBudget::Bytes(1_000_000_000)),
            cache: None,
            ctx: 64,
            dense: DenseFormat::Stored,
        };
        let e = plan_of(req, None).unwrap_err().to_string();
        assert!(e.contains("below one token's working set") && e.contains("dense part 1.00 GB"), "{e}");
        assert!(e.contains(&format!("top-{} expert slots", cfg.num_experts_per_tok)), "{e}");
    }

    #[test]
    fn an_explicit_cache_is_counted_per_layer_or_in_all_and_checked_against_budget_and_cgroup() {
        let cfg = Config::from_dir(&fixture("picchio_c/qwen3_moe")).unwrap();
        let moe = cfg.moe_layers().len();
        let per =
            PlanRequest { budget: None, cache: Some(CacheRequest::PerLayer(2)), ctx: 16, dense: DenseFormat::Stored };
        let p = plan_of(per, None).unwrap();
        assert_eq!((p.ecap, p.expert_cache_bytes), (2 * moe, 2 * moe as u64 * (1 << 20)));
        assert!(p.ecap_source.contains("--ecap-per-layer 2"), "{}", p.ecap_source);
        let all =
            PlanRequest { budget: None, cache: Some(CacheRequest::Experts(3)), ctx: 16, dense: DenseFormat::Stored };
        assert_eq!(plan_of(all, None).unwrap().ecap, 3);
        let too_many = PlanRequest { cache: Some(CacheRequest::PerLayer(cfg.num_experts + 1)), ..per };
        assert!(plan_of(too_many, None).unwrap_err().to_string().contains("a MoE layer has only"));
        // Over the budget: every expert (48 MiB) does not fit 1.1 GB beside the 1 GB dense part.
        let tight = PlanRequest { budget: Some(MemBudget::Bytes(1_100_000_000)), ..per };
        assert_eq!(plan_of(tight, None).unwrap().ecap, 2 * moe);
        let over = PlanRequest { cache: Some(CacheRequest::Experts(moe * cfg.num_experts)), ..tight };
        let e = plan_of(over, None).unwrap_err().to_string();
        assert!(e.contains("over the budget") && e.contains(&format!("--ecap {}", moe * cfg.num_experts)), "{e}");
        // Under a cgroup limit below what was asked for: refused before anything loads, naming it.
        let cg = Some((1_000_000_000u64, PathBuf::from("/sys/fs/cgroup/job/memory.max")));
        let e = plan_of(per, cg.clone()).unwrap_err().to_string();
        assert!(
            e.contains("cgroup limit of 1.00 GB") && e.contains("job/memory.max") && e.contains("dense part"),
            "{e}"
        );
        let e = plan_of(tight, cg.clone()).unwrap_err().to_string();
        assert!(e.contains("over this process's cgroup limit"), "{e}");
        // The default policy is not refused, and a percentage is of the cgroup's limit.
        plan_of(PlanRequest { budget: None, cache: None, ctx: 16, dense: DenseFormat::Stored }, cg).unwrap();
        let cg = Some((4_000_000_000u64, PathBuf::from("/sys/fs/cgroup/job/memory.max")));
        let half =
            PlanRequest { budget: Some(MemBudget::Percent(50.0)), cache: None, ctx: 16, dense: DenseFormat::Stored };
        let p = plan_of(half, cg).unwrap();
        assert_eq!(p.budget_bytes, Some(2_000_000_000));
        assert!(p.budget_source.unwrap().contains("50% of /sys/fs/cgroup/job/memory.max"));
    }

    #[test]
    fn status_lines_are_read_in_bytes() {
        let text = "Name:\tpicchio\nVmPeak:\t  200 kB\nVmHWM:\t    1234 kB\nVmRSS:\t  1000 kB\n";
        assert_eq!(status_kb(text, "VmHWM:"), Some(1234 * 1024));
        assert_eq!(status_kb(text, "VmRSS:"), Some(1000 * 1024));
        assert_eq!(status_kb(text, "VmSwap:"), None);
        if cfg!(target_os = "linux") {
            let (peak, now) = (peak_rss().unwrap(), current_rss().unwrap());
            assert!(peak >= now && now > 0, "VmHWM {peak} < VmRSS {now}");
        }
    }

    #[test]
    fn the_tightest_cgroup_limit_of_the_path_binds() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::create_dir_all(r.join("user.slice/job")).unwrap();
        std::fs::write(r.join("user.slice/memory.max"), "8589934592\n").unwrap();
        std::fs::write(r.join("user.slice/job/memory.max"), "max\n").unwrap();
        let (v, p) = cgroup_limit_in(r, "0::/user.slice/job\n").unwrap();
        assert_eq!((v, p), (8 << 30, r.join("user.slice/memory.max")));
        std::fs::write(r.join("user.slice/job/memory.max"), "1073741824\n").unwrap();
        assert_eq!(cgroup_limit_in(r, "0::/user.slice/job\n").unwrap().0, 1 << 30);
        std::fs::write(r.join("user.slice/job/memory.max"), "max\n").unwrap();
        std::fs::write(r.join("user.slice/memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_limit_in(r, "0::/user.slice/job\n"), None);
        // cgroup v1: the memory controller's hierarchy; "unlimited" is a huge number.
        std::fs::create_dir_all(r.join("memory/docker/abc")).unwrap();
        std::fs::write(r.join("memory/docker/abc/memory.limit_in_bytes"), "536870912\n").unwrap();
        std::fs::write(r.join("memory/memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        let text = "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n";
        assert_eq!(cgroup_limit_in(r, text).unwrap().0, 512 << 20);
        assert_eq!(cgroup_limit_in(r, "4:memory:/\n"), None);
    }
}
