//! The `decode` experiment (`picchio bench decode`): where a decode token's time goes, and how far
//! it is from the I/O floor, at each expert-cache budget. Each point is one real generation
//! ([`picchio_runtime::run::Session::generate`]: chunked prefill of the prompt, then greedy
//! decode) on a fresh session whose cache starts empty (or warm from a usage profile,
//! `--warm-from`), the image's pages dropped from the page cache first.
//!
//! Per point it reports prefill and decode tok/s, the decode step's time split (attention, router,
//! expert compute, exposed I/O wait, lm_head, the rest: [`DecodeSplit`]), expert reads and bytes
//! per decode token, the prefetch figures when `--prefetch` is on, peak RSS, and the **I/O floor**:
//! the decode bytes per token divided by the device rate this same run measured while reads were in
//! flight (`read_mb_s`: bytes over the wall time reads were in flight) — the time per token
//! if reading were all a decode step did. `floor_gap` = measured ms per token / floor ms per token
//! (1 is at the floor).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use picchio_core::StoreUri;
use picchio_runtime::expert::cache::PrefetchStats;
use picchio_runtime::expert::open::EngineOptions;
use picchio_runtime::model::DecodeSchedule;
use picchio_runtime::model::DenseFormat;
use picchio_runtime::run::{DecodeSplit, GenerateOptions, SessionOptions};
use picchio_runtime::ModelDir;

use crate::cache::{decode_points, drop_page_cache, open_point, point_options};

/// What `picchio bench decode` runs.
#[derive(Clone, Debug, Serialize)]
pub struct DecodeOptions {
    /// Converted model directory, its config read once by the command (every point's session
    /// is opened from it); recorded in the report's flags as `model_dir`, its path.
    #[serde(rename = "model_dir", serialize_with = "crate::cache::model_path")]
    pub model: ModelDir,
    /// The expert store.
    #[serde(serialize_with = "display")]
    pub store: StoreUri,
    /// Engine settings, reported as the flags' `io`.
    #[serde(rename = "io", serialize_with = "io_flags")]
    pub engine: EngineOptions,
    /// The decode schedule (async MoE, overlap, prefetch) of every point.
    pub schedule: DecodeSchedule,
    /// Expert-cache capacities, experts (one point each, ascending).
    pub ecaps: Vec<usize>,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate (decode figures are over the `tokens - 1` forward passes after the first).
    pub tokens: usize,
    /// Prompt tokens per prefill chunk.
    pub prefill_chunk: usize,
    /// Warm each point's cache from this usage profile first (`--warm-from`).
    pub warm_from: Option<PathBuf>,
    /// Drop the image's pages from the page cache before each point.
    pub drop_page_cache: bool,
    /// How the resident attention projections are kept (`--dense`).
    #[serde(serialize_with = "display_dense")]
    pub dense: DenseFormat,
    /// Int8-activation Q4 expert products (`--idot`).
    pub idot: bool,
}

fn display_dense<S: serde::Serializer>(v: &DenseFormat, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.collect_str(v)
}

fn display<S: serde::Serializer>(v: &StoreUri, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.collect_str(v)
}

fn io_flags<S: serde::Serializer>(io: &EngineOptions, s: S) -> std::result::Result<S::Ok, S::Error> {
    serde::Serialize::serialize(
        &serde_json::json!({
            "engine": io.engine.to_string(),
            "direct": io.direct,
            "qd": io.qd,
            "threads": io.threads,
        }),
        s,
    )
}

/// One capacity's point.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecodePoint {
    /// Expert-cache capacity, experts.
    pub ecap: usize,
    /// `ecap` as a percentage of all routed experts.
    pub cache_percent: f64,
    /// The engine as the runtime describes it.
    pub engine: String,
    /// Whether the image's pages were dropped from the page cache before the point.
    pub page_cache_dropped: bool,
    /// Experts read into the cache by the warm start (0 without `--warm-from`).
    pub warm_experts: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prefill wall time, milliseconds.
    pub prefill_ms: f64,
    /// Prompt tokens per second of prefill.
    pub prefill_tok_s: f64,
    /// Bytes read during prefill.
    pub prefill_bytes_read: u64,
    /// Decode forward passes (generated tokens after the first).
    pub decode_steps: u64,
    /// Decode wall time, milliseconds.
    pub decode_ms: f64,
    /// Decode forward passes per second.
    pub decode_tok_s: f64,
    /// Where a decode step's time went, milliseconds per step.
    pub split: DecodeSplit,
    /// Expert reads per decode token.
    pub reads_per_token: f64,
    /// Payload bytes of one read (the expert rounded up to 4096 B).
    pub read_bytes: u64,
    /// Bytes read per decode token (= reads_per_token × read_bytes).
    pub bytes_per_token: f64,
    /// Decode hit rate, hits / (hits + misses).
    pub hit_rate: f64,
    /// The device's rate while reads were in flight in this run, MB/s (prefill and decode).
    pub device_mb_s: f64,
    /// The I/O floor: `bytes_per_token` at `device_mb_s`, milliseconds per token (0 when nothing
    /// was read).
    pub floor_ms_per_token: f64,
    /// The I/O floor as tokens per second (`None` when nothing was read: no floor).
    pub floor_tok_s: Option<f64>,
    /// Measured ms per decode token over the floor's (`None` without a floor).
    pub floor_gap: Option<f64>,
    /// Speculative prefetch during decode (zeros without `--prefetch`).
    pub prefetch: PrefetchStats,
    /// Bytes of wasted prefetches during decode.
    pub prefetch_wasted_bytes: u64,
    /// Peak resident set of the process at the end of the point, bytes (`VmHWM`; reset before each
    /// point where the kernel allows, see [`reset_peak_rss`]).
    pub peak_rss_bytes: u64,
    /// The greedy tokens (the same at every point).
    pub tokens: Vec<u32>,
}

/// The `results` of `picchio bench decode`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecodeResults {
    /// The model directory.
    pub model: String,
    /// The store as the runtime names it.
    pub store: String,
    /// Decoder layers / MoE layers.
    pub layers: usize,
    /// MoE layers.
    pub moe_layers: usize,
    /// Experts per MoE layer.
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// All routed experts.
    pub total_experts: usize,
    /// Whether the peak RSS was reset before each point (`/proc/self/clear_refs`).
    pub peak_rss_reset: bool,
    /// Every point, capacities ascending.
    pub points: Vec<DecodePoint>,
}

/// Resets the process's peak RSS (`VmHWM`) to its current RSS by writing `5` to
/// `/proc/self/clear_refs` (Linux ≥ 4.0, proc(5)); whether it was done.
pub fn reset_peak_rss() -> bool {
    cfg!(target_os = "linux") && std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// A fixed pseudo-random prompt of `n` ids below `vocab` (the first 16 are `bench cache`'s).
pub fn prompt_of_len(n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 7) % vocab as u32).collect()
}

/// Runs every capacity of `opts`, calling `progress(done, total)` after each point.
///
/// # Errors
/// [`Error::NoValues`] for no capacity or a capacity of 0; [`Error::BadOption`] for an empty prompt or `tokens` < 2; session,
/// warm-start and forward-pass errors.
pub fn run_decode(opts: &DecodeOptions, progress: &mut dyn FnMut(usize, usize)) -> Result<DecodeResults> {
    if opts.ecaps.is_empty() || opts.ecaps.contains(&0) {
        return Err(Error::NoValues { options: "bench decode: --ecap", need: "needs capacities of at least 1 expert" });
    }
    if opts.prompt.is_empty() {
        return Err(Error::BadOption {
            experiment: Some("bench decode"),
            option: "--prompt-len",
            value: "0".into(),
            expected: "the prompt is empty".into(),
        });
    }
    let (ecaps, image) = decode_points("bench decode", &opts.ecaps, opts.tokens, &opts.store, &opts.model)?;
    let mut points = Vec::with_capacity(ecaps.len());
    let mut shape = None;
    let mut rss_reset = true;
    for &ecap in &ecaps {
        let base =
            point_options(&opts.model, &opts.store, opts.engine, opts.schedule, ecap, opts.prompt.len() + opts.tokens);
        rss_reset &= reset_peak_rss();
        let (mut s, total) = open_point(&SessionOptions { dense: opts.dense, ..base })?;
        s.model.set_prefill_chunk(opts.prefill_chunk)?;
        if opts.idot {
            s.model.set_kernels(s.model.kernels().with_idot(true));
        }
        let cfg = s.model.config();
        shape.get_or_insert_with(|| {
            (
                s.info.store.clone(),
                cfg.num_hidden_layers,
                cfg.moe_layers().len(),
                cfg.num_experts,
                cfg.num_experts_per_tok,
                total,
            )
        });
        let warm_experts = match &opts.warm_from {
            Some(p) => s.warm_from(p)?.experts,
            None => 0,
        };
        // After the warm start: its reads must come from the device too, but they are not the
        // point's (the page cache is dropped here so decode reads are device reads).
        let dropped = opts.drop_page_cache && image.as_deref().is_some_and(drop_page_cache);
        let g = s.generate(&opts.prompt, &GenerateOptions { max_new: opts.tokens, ..Default::default() })?;
        let st = &g.stats;
        let steps = st.decode_split.steps;
        let n = steps.max(1) as f64;
        let read_bytes = s.cache.slot_len() as u64;
        let decode_bytes = st.bytes_read - st.prefill_bytes_read;
        let decode_reads = st.reads - st.prefill_reads;
        let bytes_per_token = decode_bytes as f64 / n;
        let floor_ms = if st.read_mb_s > 0.0 { bytes_per_token / (st.read_mb_s * 1e6) * 1e3 } else { 0.0 };
        let ms_per_token = if st.decode_tok_s > 0.0 { 1e3 / st.decode_tok_s } else { 0.0 };
        points.push(DecodePoint {
            ecap,
            cache_percent: 100.0 * ecap as f64 / total.max(1) as f64,
            engine: s.info.engine.clone(),
            page_cache_dropped: dropped,
            warm_experts,
            prompt_tokens: st.prompt_tokens,
            prefill_ms: st.prefill_ms,
            prefill_tok_s: if st.prefill_ms > 0.0 { st.prompt_tokens as f64 / (st.prefill_ms / 1e3) } else { 0.0 },
            prefill_bytes_read: st.prefill_bytes_read,
            decode_steps: steps,
            decode_ms: st.decode_ms,
            decode_tok_s: st.decode_tok_s,
            split: st.decode_split,
            reads_per_token: decode_reads as f64 / n,
            read_bytes,
            bytes_per_token,
            hit_rate: {
                let (h, m) = (st.cache_hits, st.cache_misses);
                h as f64 / (h + m).max(1) as f64
            },
            device_mb_s: st.read_mb_s,
            floor_ms_per_token: floor_ms,
            floor_tok_s: (floor_ms > 0.0).then(|| 1e3 / floor_ms),
            floor_gap: (floor_ms > 0.0).then(|| ms_per_token / floor_ms),
            prefetch: st.prefetch_stats,
            prefetch_wasted_bytes: st.prefetch_wasted_bytes,
            peak_rss_bytes: st.peak_rss_bytes,
            tokens: g.tokens.clone(),
        });
        progress(points.len(), ecaps.len());
    }
    let (store, layers, moe_layers, num_experts, top_k, total_experts) = shape.expect("at least one point ran");
    Ok(DecodeResults {
        model: opts.model.path().display().to_string(),
        store,
        layers,
        moe_layers,
        num_experts,
        top_k,
        total_experts,
        peak_rss_reset: rss_reset,
        points,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_options_are_refused_before_running() {
        let o = DecodeOptions {
            model: ModelDir::open(&crate::cache::tests::fixture_model()).unwrap(),
            store: StoreUri::Safetensors,
            engine: EngineOptions::default(),
            schedule: DecodeSchedule::default(),
            ecaps: vec![],
            prompt: vec![1],
            tokens: 4,
            prefill_chunk: 64,
            warm_from: None,
            drop_page_cache: false,
            dense: DenseFormat::Stored,
            idot: false,
        };
        assert!(run_decode(&o, &mut |_, _| {}).unwrap_err().to_string().contains("at least 1 expert"));
        let o = DecodeOptions { ecaps: vec![1], prompt: vec![], ..o };
        assert!(run_decode(&o, &mut |_, _| {}).unwrap_err().to_string().contains("--prompt-len 0"));
        let o = DecodeOptions { prompt: vec![1], tokens: 1, ..o };
        assert!(run_decode(&o, &mut |_, _| {}).unwrap_err().to_string().contains("-n 1"));
        assert_eq!(prompt_of_len(3, 1000).len(), 3);
        assert!(prompt_of_len(40, 7).iter().all(|&t| t < 7));
    }
}
