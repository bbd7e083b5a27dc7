//! `picchio plan`: the memory plan of a model without running it, and the `--mem` /
//! `--ecap-per-layer` options `run` and `demo` share.

use std::path::PathBuf;

use anyhow::{bail, Context};
use picchio_runtime::model::DenseFormat;
use picchio_runtime::plan::{plan, CacheRequest, MemBudget, MemPlan, PlanRequest, DEFAULT_PLAN_CTX};
use picchio_runtime::ModelDir;

/// Options of `picchio plan`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Converted model directory (from `picchio convert`, or one written by Picchio (C)), or a GGUF
    /// file.
    #[arg(long, value_name = "DIR|GGUF")]
    pub model: PathBuf,
    /// The memory budget to split: bytes (8GB, 8GiB, 500MB; a bare number is GB) or a percentage of
    /// the cgroup's memory.max (else of MemAvailable), e.g. 50%. Without it the plan shows the
    /// default expert cache (half of MemAvailable, at most every expert).
    #[arg(long, value_name = "SIZE")]
    pub mem: Option<MemBudget>,
    /// KV-cache positions to plan for [default: 4096, at most the model's max_position_embeddings].
    #[arg(long, value_name = "N")]
    pub ctx: Option<usize>,
    /// Plan this expert-cache capacity (experts across all MoE layers) instead of what --mem leaves.
    #[arg(long, value_name = "N", conflicts_with = "ecap_per_layer")]
    pub ecap: Option<usize>,
    /// Plan N cache slots per MoE layer (Picchio (C)'s ECAP: N × MoE layers experts in all).
    #[arg(long, value_name = "N")]
    pub ecap_per_layer: Option<usize>,
    /// Plan the resident projections as `stored`, `bf16` or `int8` (as `run --dense`).
    #[arg(long, value_name = "FORMAT", default_value = "stored")]
    pub dense: picchio_runtime::model::DenseFormat,
    /// Print the plan as one JSON object (bytes) on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `--ecap N` / `--ecap-per-layer N` as a cache request.
pub(super) fn cache_request(ecap: Option<usize>, per_layer: Option<usize>) -> Option<CacheRequest> {
    ecap.map(CacheRequest::Experts).or(per_layer.map(CacheRequest::PerLayer))
}

/// The plan of `model` for a run of `ctx` positions: refused (with the figures) before anything
/// loads when it does not fit the budget or the cgroup's limit.
pub(super) fn plan_for(
    model: &ModelDir,
    budget: Option<MemBudget>,
    cache: Option<CacheRequest>,
    ctx: usize,
    dense: DenseFormat,
) -> anyhow::Result<MemPlan> {
    plan(model, &PlanRequest { budget, cache, ctx, dense })
        .with_context(|| format!("planning memory for {}", model.path().display()))
}

/// Refuses a `--ctx` of `ctx` positions outside the model's context (1..=max_position_embeddings):
/// `plan`, `run`, `chat` and `serve` say the same.
///
/// # Errors
/// A message naming `--ctx`, the value and the model's range.
pub fn check_ctx(ctx: usize, cfg: &picchio_runtime::Config) -> anyhow::Result<()> {
    if ctx == 0 || ctx > cfg.max_position_embeddings {
        bail!(
            "--ctx {ctx}: the model's context is 1..={} positions (max_position_embeddings)",
            cfg.max_position_embeddings
        );
    }
    Ok(())
}

pub fn exec(a: Args) -> anyhow::Result<()> {
    let model = ModelDir::open(&a.model)?;
    let cfg = model.config();
    let ctx = a.ctx.unwrap_or(DEFAULT_PLAN_CTX.min(cfg.max_position_embeddings));
    check_ctx(ctx, cfg)?;
    let p = plan_for(&model, a.mem, cache_request(a.ecap, a.ecap_per_layer), ctx, a.dense)?;
    if a.json {
        println!("{}", serde_json::to_string(&p)?);
    } else {
        println!("{p}");
    }
    Ok(())
}
