//! The `cache` experiment (`picchio bench cache`): decode throughput, expert-cache misses per token and
//! bytes read per token against the expert-cache budget (`--ecap`), with the image read O_DIRECT and
//! buffered — the page-cache-vs-LRU question: buffered reads go through the kernel's page cache, a
//! second cache behind ours, so the runtime's misses and the bytes the device actually delivered can
//! differ. Each point is a real run of the runtime ([`Session`]: model, [`picchio_runtime::expert::cache::ExpertCache`],
//! store, engine) on a converted or synthetic model.
//!
//! Per point: a fresh session with that capacity (the cache starts empty), the image's pages dropped
//! from the page cache first (`posix_fadvise(POSIX_FADV_DONTNEED)` on the whole file; Linux), the
//! prompt run (prefill), then greedy decoding of `tokens` tokens. Prefill and decode are counted
//! apart; figures per token are over the decode forward passes only. Device bytes are the
//! `read_bytes` field of `/proc/self/io` (`proc(5)`: bytes this process caused to be fetched from the
//! storage layer, counted when the block I/O is submitted; all threads of the process, so io_uring's
//! and psync's workers are included) — `None` where the file does not exist.

use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use picchio_core::StoreUri;
use picchio_runtime::expert::open::EngineOptions;
use picchio_runtime::model::sampler::{Sampler, SamplerOptions};
use picchio_runtime::model::DecodeSchedule;
use picchio_runtime::run::{Session, SessionOptions};
use picchio_runtime::ModelDir;

/// How the image is read at one point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReadMode {
    /// O_DIRECT: every miss is a device read.
    Direct,
    /// Through the page cache: a miss may be served from memory the kernel kept.
    Buffered,
}

impl std::fmt::Display for ReadMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ReadMode::Direct => "direct",
            ReadMode::Buffered => "buffered",
        })
    }
}

impl std::str::FromStr for ReadMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "direct" => Ok(ReadMode::Direct),
            "buffered" => Ok(ReadMode::Buffered),
            _ => Err(Error::BadOption {
                experiment: None,
                option: "read mode",
                value: format!("{s:?}"),
                expected: "expected `direct` or `buffered`".into(),
            }),
        }
    }
}

/// What `picchio bench cache` runs.
#[derive(Clone, Debug, Serialize)]
pub struct CacheOptions {
    /// Converted model directory, its config read once by the command (every point's session
    /// is opened from it); recorded in the report's flags as `model_dir`, its path.
    #[serde(rename = "model_dir", serialize_with = "model_path")]
    pub model: ModelDir,
    /// The expert store (`file:PATH`, `raw:`, `nvme:`, `safetensors`, `auto`).
    #[serde(serialize_with = "display")]
    pub store: StoreUri,
    /// Engine settings (`direct` is set per point from `modes`), reported as the flags' `io`.
    #[serde(rename = "io", serialize_with = "io_flags")]
    pub engine: EngineOptions,
    /// The decode schedule of every point.
    pub schedule: DecodeSchedule,
    /// Check every payload's hash after reading it.
    pub verify: bool,
    /// Expert-cache capacities to measure, experts.
    pub ecaps: Vec<usize>,
    /// Read modes to measure at each capacity.
    pub modes: Vec<ReadMode>,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to decode after the prompt.
    pub tokens: usize,
    /// Drop the image's pages from the page cache before each point.
    pub drop_page_cache: bool,
}

/// The engine settings as the report's flags record them.
fn io_flags<S: serde::Serializer>(io: &EngineOptions, s: S) -> std::result::Result<S::Ok, S::Error> {
    serde::Serialize::serialize(
        &serde_json::json!({
            "engine": io.engine.to_string(),
            "qd": io.qd,
            "threads": io.threads,
            "sqpoll": io.sqpoll,
            "iopoll": io.iopoll,
            "register_files": io.register_files,
        }),
        s,
    )
}

/// A model directory as the report's flags record it: its path.
pub(crate) fn model_path<S: serde::Serializer>(m: &ModelDir, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.collect_str(&m.path().display())
}

fn display<S: serde::Serializer>(v: &StoreUri, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// Counters of one phase (prefill or decode) of one point.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseCounts {
    /// Forward passes (tokens run).
    pub forwards: u64,
    /// Wall time, milliseconds.
    pub wall_ms: f64,
    /// Expert uses served by the cache.
    pub hits: u64,
    /// Expert uses that needed a load.
    pub misses: u64,
    /// Expert reads the store completed.
    pub reads: u64,
    /// Bytes the store read (each read is the payload rounded up to 4096 B).
    pub bytes_read: u64,
    /// Bytes the device delivered to this process (`/proc/self/io` `read_bytes` delta); `None`
    /// where unavailable.
    pub device_bytes: Option<u64>,
    /// Experts served by the safetensors fallback after a store failure.
    pub fallbacks: u64,
}

/// One (read mode, capacity) point.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CachePoint {
    /// How the image was read.
    pub mode: ReadMode,
    /// Expert-cache capacity, experts.
    pub ecap: usize,
    /// `ecap` as a percentage of all routed experts.
    pub cache_percent: f64,
    /// Memory of the cache's slots at full capacity, bytes (`ecap` × slot size).
    pub cache_bytes: u64,
    /// The engine as the runtime describes it (`uring(direct, qd 32)`, …).
    pub engine: String,
    /// Whether the image's pages were dropped from the page cache before the point.
    pub page_cache_dropped: bool,
    /// The prompt.
    pub prefill: PhaseCounts,
    /// The generated tokens after the first (each one forward pass).
    pub decode: PhaseCounts,
    /// Decode forward passes per second.
    pub decode_tok_s: f64,
    /// Decode misses per decode token.
    pub misses_per_token: f64,
    /// Decode store bytes per decode token.
    pub bytes_per_token: f64,
    /// Decode device bytes per decode token; `None` where unavailable.
    pub device_bytes_per_token: Option<f64>,
    /// Decode hit rate, hits / (hits + misses).
    pub hit_rate: f64,
    /// The greedy tokens generated (the same at every point: the cache never changes the output).
    pub tokens: Vec<u32>,
}

/// The `results` of `picchio bench cache`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CacheResults {
    /// The model directory.
    pub model: String,
    /// The store as the runtime names it.
    pub store: String,
    /// MoE layers.
    pub moe_layers: usize,
    /// Experts per MoE layer.
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// All routed experts (MoE layers × E): the capacity at which everything fits.
    pub total_experts: usize,
    /// Bytes of one expert's payload.
    pub expert_bytes: u64,
    /// Bytes of one cache slot (the payload rounded up to 4096 B; what a flat-store miss reads).
    pub slot_bytes: u64,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens generated per point.
    pub tokens: usize,
    /// Every point, mode-major, capacities ascending.
    pub points: Vec<CachePoint>,
}

/// Bytes this process has caused to be read from storage (`read_bytes` of `/proc/self/io`).
pub fn device_read_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/io").ok()?;
    s.lines().find_map(|l| l.strip_prefix("read_bytes:")).and_then(|v| v.trim().parse().ok())
}

/// Drops `path`'s clean pages from the page cache (`posix_fadvise(POSIX_FADV_DONTNEED)` over the
/// whole file). Returns whether it was done (false off Linux, or for a path that cannot be opened).
pub fn drop_page_cache(path: &Path) -> bool {
    // The same drop as the storage experiments', which first waits for reads still in flight (the
    // session's open starts readahead of the image that would otherwise land after the drop).
    cfg!(target_os = "linux") && super::measure::drop_cache(path).is_ok()
}

/// Runs every (mode, capacity) point of `opts`, calling `progress(done, total)` after each.
///
/// # Errors
/// [`Error::NoValues`] for an empty capacity or mode list; [`Error::BadOption`] for a capacity of 0 or
/// `tokens` < 2; [`Error::EmptyPrompt`]; [`Error::Runtime`] for session errors (model, store, engine); forward-pass errors.
pub fn run_cache(opts: &CacheOptions, progress: &mut dyn FnMut(usize, usize)) -> Result<CacheResults> {
    if opts.ecaps.is_empty() || opts.modes.is_empty() {
        return Err(Error::NoValues {
            options: "bench cache: --ecap and --reads",
            need: "need at least one value each",
        });
    }
    if opts.ecaps.contains(&0) {
        return Err(Error::BadOption {
            experiment: None,
            option: "--ecap",
            value: "0".into(),
            expected: "the expert cache needs room for at least 1 expert".into(),
        });
    }
    if opts.prompt.is_empty() {
        return Err(Error::EmptyPrompt { experiment: "cache" });
    }
    let (ecaps, image) = decode_points("bench cache", &opts.ecaps, opts.tokens, &opts.store, &opts.model)?;
    let total_points = ecaps.len() * opts.modes.len();
    let mut points = Vec::with_capacity(total_points);
    let mut shape = None;
    for &mode in &opts.modes {
        for &ecap in &ecaps {
            let engine = EngineOptions { direct: mode == ReadMode::Direct, ..opts.engine };
            let base =
                point_options(&opts.model, &opts.store, engine, opts.schedule, ecap, opts.prompt.len() + opts.tokens);
            let (mut s, total) = open_point(&SessionOptions { verify: opts.verify, ..base })?;
            let cfg = s.model.config();
            // Session::open refuses an ecap above `total` ("only N routed experts").
            shape.get_or_insert_with(|| {
                (
                    s.info.store.clone(),
                    cfg.moe_layers().len(),
                    cfg.num_experts,
                    cfg.num_experts_per_tok,
                    total,
                    s.model.layout().len() as u64,
                    s.cache.slot_len() as u64,
                )
            });
            let dropped = opts.drop_page_cache && image.as_deref().is_some_and(drop_page_cache);
            points.push(run_point(&mut s, opts, mode, ecap, total, dropped)?);
            progress(points.len(), total_points);
        }
    }
    let (store, moe_layers, num_experts, top_k, total_experts, expert_bytes, slot_bytes) =
        shape.expect("at least one point ran");
    Ok(CacheResults {
        model: opts.model.path().display().to_string(),
        store,
        moe_layers,
        num_experts,
        top_k,
        total_experts,
        expert_bytes,
        slot_bytes,
        prompt_tokens: opts.prompt.len(),
        tokens: opts.tokens,
        points,
    })
}

/// Counters at one instant, to subtract.
struct Mark {
    t: Instant,
    hits: u64,
    misses: u64,
    io: picchio_core::StatsSnapshot,
    device: Option<u64>,
}

impl Mark {
    fn now(s: &Session) -> Mark {
        Mark {
            t: Instant::now(),
            hits: s.cache.hits(),
            misses: s.cache.misses(),
            io: s.io_stats.snapshot(),
            device: device_read_bytes(),
        }
    }

    fn since(&self, before: &Mark, forwards: u64) -> PhaseCounts {
        PhaseCounts {
            forwards,
            wall_ms: self.t.duration_since(before.t).as_secs_f64() * 1e3,
            hits: self.hits - before.hits,
            misses: self.misses - before.misses,
            reads: self.io.reads - before.io.reads,
            bytes_read: self.io.bytes - before.io.bytes,
            device_bytes: self.device.zip(before.device).map(|(a, b)| a.saturating_sub(b)),
            fallbacks: self.io.fallbacks - before.io.fallbacks,
        }
    }
}

/// One point: prompt, then `tokens` greedy tokens (`tokens - 1` decode forward passes).
fn run_point(
    s: &mut Session,
    opts: &CacheOptions,
    mode: ReadMode,
    ecap: usize,
    total: usize,
    dropped: bool,
) -> Result<CachePoint> {
    let mut sampler = Sampler::new(SamplerOptions::default());
    let m0 = Mark::now(s);
    for (pos, &t) in opts.prompt.iter().enumerate() {
        s.model.forward(t, pos, &mut s.cache, &mut *s.loader)?;
    }
    let m1 = Mark::now(s);
    let mut tokens = Vec::with_capacity(opts.tokens);
    let mut pos = opts.prompt.len();
    loop {
        let next = sampler.sample(s.model.logits());
        tokens.push(next);
        if tokens.len() == opts.tokens {
            break;
        }
        s.model.forward(next, pos, &mut s.cache, &mut *s.loader)?;
        pos += 1;
    }
    let m2 = Mark::now(s);
    let prefill = m1.since(&m0, opts.prompt.len() as u64);
    let decode = m2.since(&m1, (opts.tokens - 1) as u64);
    let n = decode.forwards as f64;
    Ok(CachePoint {
        mode,
        ecap,
        cache_percent: 100.0 * ecap as f64 / total.max(1) as f64,
        cache_bytes: (ecap * s.cache.slot_len()) as u64,
        engine: s.info.engine.clone(),
        page_cache_dropped: dropped,
        decode_tok_s: if decode.wall_ms > 0.0 { n / (decode.wall_ms / 1e3) } else { 0.0 },
        misses_per_token: decode.misses as f64 / n,
        bytes_per_token: decode.bytes_read as f64 / n,
        device_bytes_per_token: decode.device_bytes.map(|b| b as f64 / n),
        hit_rate: decode.hits as f64 / (decode.hits + decode.misses).max(1) as f64,
        prefill,
        decode,
        tokens,
    })
}

/// Capacities for `percents` of `total` experts (each rounded, at least 1), ascending, deduplicated.
pub fn ecaps_for_percents(total: usize, percents: &[f64]) -> Vec<usize> {
    let mut v: Vec<usize> =
        percents.iter().map(|p| ((total as f64 * p / 100.0).round() as usize).clamp(1, total.max(1))).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The checks and order of points shared by `bench cache` and `bench decode` (`experiment`): refuses
/// `tokens` < 2, and returns the capacities `ecaps` sorted, each once, with the image file whose
/// pages a point drops ([`image_file`]).
///
/// # Errors
/// [`Error::BadOption`] for `tokens` < 2.
pub(crate) fn decode_points(
    experiment: &'static str,
    ecaps: &[usize],
    tokens: usize,
    store: &StoreUri,
    model: &ModelDir,
) -> Result<(Vec<usize>, Option<std::path::PathBuf>)> {
    if tokens < 2 {
        return Err(Error::BadOption {
            experiment: Some(experiment),
            option: "-n",
            value: tokens.to_string(),
            expected: "decode needs at least 2 tokens".into(),
        });
    }
    let mut ecaps = ecaps.to_vec();
    ecaps.sort_unstable();
    ecaps.dedup();
    Ok((ecaps, image_file(store, model.path())))
}

/// The session options of one point: `model` on `store` read with `engine` and `schedule`, an
/// expert cache of `ecap` experts, `max_seq` positions; no payload verification, the stored dense
/// format.
pub(crate) fn point_options(
    model: &ModelDir,
    store: &StoreUri,
    engine: EngineOptions,
    schedule: DecodeSchedule,
    ecap: usize,
    max_seq: usize,
) -> SessionOptions {
    SessionOptions {
        model: model.clone(),
        store: store.clone(),
        engine,
        schedule,
        verify: false,
        ecap: Some(ecap),
        max_seq,
        dense: picchio_runtime::model::DenseFormat::Stored,
    }
}

/// Opens the session of one point, with the routed experts of its MoE layers in all.
///
/// # Errors
/// [`Error::Runtime`] for session errors (model, store, engine).
pub(crate) fn open_point(opts: &SessionOptions) -> Result<(Session, usize)> {
    let s = Session::open(opts, None)?;
    let cfg = s.model.config();
    let total = cfg.moe_layers().len() * cfg.num_experts;
    Ok((s, total))
}

/// The image file a run over `store` reads (`file:PATH`, or `auto`'s `model_dir/experts.picchioflat`
/// when it exists), for dropping its pages between points; `None` for devices and safetensors.
pub(crate) fn image_file(store: &StoreUri, model_dir: &std::path::Path) -> Option<std::path::PathBuf> {
    match store {
        StoreUri::File(p) => Some(p.clone()),
        StoreUri::Auto => Some(model_dir.join(picchio_runtime::expert::store::DEFAULT_IMAGE)).filter(|p| p.exists()),
        _ => None,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::path::PathBuf;

    /// The vendored Picchio (C) model directory.
    pub(crate) fn fixture_model() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/picchio_c/qwen3_moe")
    }

    #[test]
    fn percents_map_to_capacities() {
        assert_eq!(ecaps_for_percents(48, &[0.1, 10.0, 25.0, 100.0, 25.0]), [1, 5, 12, 48]);
    }

    #[test]
    fn read_modes_parse() {
        assert_eq!("direct".parse::<ReadMode>().unwrap(), ReadMode::Direct);
        assert_eq!("buffered".parse::<ReadMode>().unwrap(), ReadMode::Buffered);
        assert!("cached".parse::<ReadMode>().unwrap_err().to_string().contains("direct"));
        assert_eq!(serde_json::to_string(&ReadMode::Buffered).unwrap(), "\"buffered\"");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn proc_io_counts_and_fadvise_runs() {
        assert!(device_read_bytes().is_some());
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), vec![7u8; 1 << 16]).unwrap();
        assert!(drop_page_cache(f.path()));
        assert!(!drop_page_cache(Path::new("/nonexistent/picchio")));
    }

    #[test]
    fn bad_options_are_refused_before_running() {
        let o = CacheOptions {
            model: ModelDir::open(&crate::cache::tests::fixture_model()).unwrap(),
            store: StoreUri::Safetensors,
            engine: EngineOptions::default(),
            schedule: DecodeSchedule::default(),
            verify: false,
            ecaps: vec![],
            modes: vec![ReadMode::Direct],
            prompt: vec![1],
            tokens: 4,
            drop_page_cache: true,
        };
        assert!(run_cache(&o, &mut |_, _| {}).is_err());
        // The report's flags name the model by its path, as before the directory was opened once.
        let flags = serde_json::to_value(&o).unwrap();
        assert_eq!(flags["model_dir"], fixture_model().display().to_string());
        let o = CacheOptions { ecaps: vec![0], ..o };
        assert!(run_cache(&o, &mut |_, _| {}).unwrap_err().to_string().contains("--ecap 0"));
        let o = CacheOptions { ecaps: vec![1], tokens: 1, ..o };
        assert!(run_cache(&o, &mut |_, _| {}).unwrap_err().to_string().contains("-n 1"));
    }
}
