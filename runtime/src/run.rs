//! `picchio run`: open a converted model and its expert store, then generate.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use picchio_core::{ExpertLoader, IoStats, StoreUri};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::expert::cache::{ExpertCache, PrefetchStats};
use crate::expert::open::EngineOptions;
use crate::expert::store::{open_store, StoreInfo};
use crate::expert::usage::UsageProfile;
use crate::model::dir::ModelDir;
use crate::model::sampler::{Sampler, SamplerOptions};
use crate::model::tokenizer::Tokenizer;
use crate::model::{DecodeSchedule, DenseFormat, Model, StepTimers};

/// How to open a model for generation.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Converted model directory, its config read once ([`ModelDir::open`]) by the command that
    /// opens the session.
    pub model: ModelDir,
    /// Where routed experts come from.
    pub store: StoreUri,
    /// How the store's engine is opened (engine, O_DIRECT, threads, queue depth).
    pub engine: EngineOptions,
    /// How decode steps schedule expert reads against compute (async MoE, overlap, prefetch).
    pub schedule: DecodeSchedule,
    /// Check every payload's SHA-256 prefix against the index after reading it (`--verify`).
    pub verify: bool,
    /// Expert-cache capacity in experts; `None` chooses [`default_ecap`].
    pub ecap: Option<usize>,
    /// Longest sequence (prompt + generated) to size the KV cache for.
    pub max_seq: usize,
    /// How the resident projections are kept (`--dense`; [`DenseFormat::Stored`] is exact).
    pub dense: DenseFormat,
}

/// A model, its expert cache and store, ready to generate.
pub struct Session {
    /// The resident model.
    pub model: Model,
    /// The LRU expert cache.
    pub cache: ExpertCache,
    /// The expert loader (store + fallback).
    pub loader: Box<dyn ExpertLoader>,
    /// What store and engine serve the experts.
    pub info: StoreInfo,
    /// I/O statistics of the store.
    pub io_stats: Arc<IoStats>,
    /// The tokenizer, when the directory has one.
    pub tokenizer: Option<Tokenizer>,
    /// The ids that end the assistant's turn ([`crate::chat::stop::end_of_turn_ids`]), which
    /// `stop_at_eos` stops at.
    pub stop_ids: Vec<u32>,
    /// The token ids whose keys and values the KV cache holds, at positions `0..kv.len()`: what
    /// [`Session::complete`](crate::chat::turn) reuses.
    pub(crate) kv: Vec<u32>,
    /// The warm start, when [`Session::warm_from`] ran.
    pub warm: Option<WarmStats>,
}

/// Generation settings.
#[derive(Clone, Debug, Default)]
pub struct GenerateOptions {
    /// Tokens to generate.
    pub max_new: usize,
    /// Sampling.
    pub sampler: SamplerOptions,
    /// Stop at the model's end-of-turn ids ([`Session::stop_ids`]).
    pub stop_at_eos: bool,
    /// Keep the logits each generated token was chosen from.
    pub keep_logits: bool,
}

/// Timing and cache figures of one generation.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RunStats {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub generated_tokens: usize,
    /// Wall time of the prompt's forward passes, milliseconds.
    pub prefill_ms: f64,
    /// Expert reads served by the store during the prompt's forward passes (part of `reads`).
    pub prefill_reads: u64,
    /// Bytes read from the store during the prompt's forward passes (part of `bytes_read`).
    pub prefill_bytes_read: u64,
    /// Wall time of the forward passes after the prompt, milliseconds.
    pub decode_ms: f64,
    /// Decode forward passes per second (generated tokens after the first / decode time).
    pub decode_tok_s: f64,
    /// Expert-cache hits.
    pub cache_hits: u64,
    /// Expert-cache misses (each one a load).
    pub cache_misses: u64,
    /// Expert-cache capacity in experts.
    pub cache_capacity: usize,
    /// Expert reads served by the store.
    pub reads: u64,
    /// Bytes read from the store.
    pub bytes_read: u64,
    /// Exposed I/O wait, milliseconds: wall time the forward pass spent blocked submitting and
    /// reaping expert reads (what overlapping compute with reads did not hide).
    pub read_wait_ms: f64,
    /// Wall time during which expert reads were in flight, milliseconds (per load call, first
    /// submit to last completion reaped; [`picchio_core::stats::StatsSnapshot::read_span_ns`]).
    pub read_span_ms: f64,
    /// Mean latency of the expert reads served by the store, milliseconds: from each read's submit to
    /// its completion being reaped ([`picchio_core::stats::StatsSnapshot::latency_sum_ns`] over
    /// `reads`; 0 without reads). A slow device shows here even when compute hides the wait.
    pub read_latency_mean_ms: f64,
    /// The device's delivered rate while reads were in flight, MB/s (10^6 B): bytes_read /
    /// read_span_ms. Not bytes over the wait, which overstates the device whenever compute hides
    /// the reads.
    pub read_mb_s: f64,
    /// Bytes read over the whole generation's wall time (prefill + decode), MB/s.
    pub read_mb_s_run: f64,
    /// This process's peak resident set so far, bytes (`VmHWM`, [`crate::plan::peak_rss`]; 0 when
    /// unknown, off Linux).
    pub peak_rss_bytes: u64,
    /// Bytes of expert reads the engine copied through bounce buffers rather than reading them
    /// straight into the cache slots (the NVMe driver when the slots are not in its DMA pool; 0 for
    /// every other store).
    pub bounce_bytes: u64,
    /// Experts served by the safetensors fallback after the store failed.
    pub fallbacks: u64,
    /// Store failures (each then served by the fallback).
    pub store_errors: u64,
    /// Experts the store has no entry for by design (layers past a `pack --layers N` prefix image),
    /// served by the fallback; not store errors.
    pub store_missing: u64,
    /// The store (`safetensors`, `file:PATH`).
    pub store: String,
    /// The engine (`psync(direct, 2 threads)`, `uring(direct, qd 32)`, ...).
    pub engine: String,
    /// Whether misses were computed as their reads completed (`--async-moe`).
    pub async_moe: bool,
    /// Whether decode read experts on an I/O worker, overlapped with compute (`--no-overlap` off).
    pub overlap: bool,
    /// Whether decode prefetched the next layer's predicted experts (`--prefetch`).
    pub prefetch: bool,
    /// The warm start before the generation (`--warm-from`), when there was one.
    pub warm: Option<WarmStats>,
    /// Speculative prefetch over the generation: experts read ahead, then used or wasted.
    pub prefetch_stats: PrefetchStats,
    /// Bytes read for prefetched experts their layer did not pick (`prefetch_stats.wasted` × the
    /// read length of one expert).
    pub prefetch_wasted_bytes: u64,
    /// Where one decode step's time went, milliseconds per step (mean over the decode steps).
    pub decode_split: DecodeSplit,
    /// The signal (`SIGINT`, `SIGTERM`) that stopped the generation before `max_new` tokens, when
    /// one did ([`Session::generate_until_interrupted`]): the figures are those of the tokens
    /// generated until then. Absent from the JSON of a generation that ran to its end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interrupted: Option<String>,
}

/// One decode step's time, milliseconds (mean over the decode steps; [`StepTimers`]). `io_wait_ms`
/// is the exposed wait (reads nothing else hid); `other_ms` is the rest of the step (norms,
/// embedding, residuals, the cache's bookkeeping), so the parts add up to `total_ms`.
#[derive(Clone, Copy, Debug, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct DecodeSplit {
    /// Decode steps averaged.
    pub steps: u64,
    /// Attention (norm, q/k/v, RoPE, scores, o_proj).
    pub attention_ms: f64,
    /// Routers (and the next layer's predicted routing with `--prefetch`).
    pub router_ms: f64,
    /// Routed experts' compute.
    pub experts_ms: f64,
    /// Dense MLP layers.
    pub dense_mlp_ms: f64,
    /// Exposed expert-read wait.
    pub io_wait_ms: f64,
    /// Final norm and lm_head.
    pub lm_head_ms: f64,
    /// The rest.
    pub other_ms: f64,
    /// Whole step.
    pub total_ms: f64,
}

impl DecodeSplit {
    /// The split of `steps` decode steps from timers `t` (their difference over the steps) and the
    /// exposed wait `io_wait_ns` over the same steps.
    pub fn from_timers(t: StepTimers, io_wait_ns: u64) -> DecodeSplit {
        let n = t.steps.max(1) as f64;
        let ms = |ns: u64| ns as f64 / 1e6 / n;
        let parts = [t.attention_ns, t.router_ns, t.experts_ns, t.dense_mlp_ns, io_wait_ns, t.lm_head_ns];
        let sum: u64 = parts.iter().sum();
        DecodeSplit {
            steps: t.steps,
            attention_ms: ms(t.attention_ns),
            router_ms: ms(t.router_ns),
            experts_ms: ms(t.experts_ns),
            dense_mlp_ms: ms(t.dense_mlp_ns),
            io_wait_ms: ms(io_wait_ns),
            lm_head_ms: ms(t.lm_head_ns),
            other_ms: ms(t.total_ns.saturating_sub(sum)),
            total_ms: ms(t.total_ns),
        }
    }
}

impl StepTimers {
    /// `self - earlier`, field by field.
    pub fn since(&self, earlier: &StepTimers) -> StepTimers {
        StepTimers {
            steps: self.steps - earlier.steps,
            attention_ns: self.attention_ns - earlier.attention_ns,
            router_ns: self.router_ns - earlier.router_ns,
            experts_ns: self.experts_ns - earlier.experts_ns,
            dense_mlp_ns: self.dense_mlp_ns - earlier.dense_mlp_ns,
            lm_head_ns: self.lm_head_ns - earlier.lm_head_ns,
            total_ns: self.total_ns - earlier.total_ns,
        }
    }
}

/// What a warm start ([`Session::warm_from`]) read.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct WarmStats {
    /// The usage profile.
    pub profile: PathBuf,
    /// Experts read into the cache.
    pub experts: usize,
    /// Bytes read.
    pub bytes_read: u64,
    /// Wall time, milliseconds.
    pub ms: f64,
}

/// Counter values at the start of a generation ([`Session::add_decode_figures`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SinceStart {
    /// Prefetch counters at the start.
    pub prefetch: PrefetchStats,
    /// The cache's exposed wait at the start, ns.
    pub io_wait_ns: u64,
    /// The model's timers when decode started.
    pub decode_timers: StepTimers,
    /// The cache's exposed wait when decode started, ns.
    pub decode_io_wait_ns: u64,
}

/// The result of one generation.
#[derive(Clone, Debug)]
pub struct Generation {
    /// The prompt ids.
    pub prompt_ids: Vec<u32>,
    /// The generated ids.
    pub tokens: Vec<u32>,
    /// The logits each generated token was chosen from, `[tokens.len(), vocab]` row-major, when kept.
    pub logits: Vec<f32>,
    /// Figures.
    pub stats: RunStats,
}

/// Default expert-cache capacity: every expert of the model if they fit in half of the available
/// memory (`MemAvailable` of /proc/meminfo, or 4 GiB when unknown), else as many as fit (at least top-k).
pub fn default_ecap(total_experts: usize, slot_bytes: usize, topk: usize) -> usize {
    let avail = crate::plan::mem_available().unwrap_or(4 << 30);
    let fit = (avail / 2) / slot_bytes.max(1) as u64;
    (fit as usize).clamp(topk.max(1), total_experts.max(1))
}

impl Session {
    /// Loads the model of `opts.model` (its config as read when it was opened: config.json is not
    /// read again), opens the store and allocates the cache; `tokenizer` is the directory's (from
    /// [`Tokenizer::from_dir`], loaded by the caller to size `max_seq` from the prompt).
    ///
    /// # Errors
    /// Model loading errors (config, tensors), store errors (see [`open_store`]), allocation.
    pub fn open(opts: &SessionOptions, tokenizer: Option<Tokenizer>) -> Result<Self> {
        let cfg = opts.model.config();
        if opts.max_seq > cfg.max_position_embeddings {
            return Err(Error::ContextOverflow {
                needed: opts.max_seq,
                context: cfg.max_position_embeddings,
                config: Some(opts.model.config_path()),
            });
        }
        let model = Model::load_as(&opts.model, opts.max_seq, opts.dense)?;
        let layout = model.layout().clone();
        let (mut loader, mut info, io_stats) = open_store(
            &opts.store,
            opts.model.path(),
            cfg,
            model.in_place_loader(),
            &layout,
            opts.engine,
            opts.verify,
        )?;
        let total = cfg.moe_layers().len() * cfg.num_experts;
        let ecap = match opts.ecap {
            Some(0) => {
                let expected = "must be at least 1".into();
                return Err(Error::BadOption { option: "--ecap", value: "0".into(), expected });
            }
            // As `bench cache` does: a capacity above the expert count is refused, not clamped silently.
            Some(n) if n > total => {
                return Err(Error::Invalid(format!(
                    "--ecap {n}: the model has only {total} routed experts ({} MoE layers × {})",
                    cfg.moe_layers().len(),
                    cfg.num_experts
                )))
            }
            Some(n) => n,
            None => default_ecap(total, layout.len(), cfg.num_experts_per_tok),
        };
        let mut cache = ExpertCache::new(ecap, layout.len())?;
        cache.set_async_moe(opts.schedule.async_moe);
        let mut model = model;
        model.set_decode_schedule(opts.schedule);
        // The one I/O thread of the session's decode steps, started before the first of them.
        if opts.schedule.overlapped() {
            model.start_io_thread()?;
        }
        // Slots in the engine's DMA memory when it has some (nvme:), else on the heap.
        if let Some(slots) = cache.use_slots_from(&mut *loader) {
            info.engine = format!("{}; expert cache slots: {slots}", info.engine);
        }
        tracing::info!("experts from {} via {}, cache {ecap} experts", info.store, info.engine);
        Self::from_parts(model, cache, loader, info, io_stats, tokenizer)
    }

    /// A session of parts opened elsewhere (a test's simulated store), with the end-of-turn ids of
    /// the model's directory and an empty KV record.
    ///
    /// # Errors
    /// As [`crate::chat::stop::end_of_turn_ids`].
    pub fn from_parts(
        model: Model,
        cache: ExpertCache,
        loader: Box<dyn ExpertLoader>,
        info: StoreInfo,
        io_stats: Arc<IoStats>,
        tokenizer: Option<Tokenizer>,
    ) -> Result<Self> {
        let stop_ids = Self::resolve_stop_ids(&model, tokenizer.as_ref())?;
        Ok(Session { model, cache, loader, info, io_stats, tokenizer, stop_ids, kv: Vec::new(), warm: None })
    }

    /// The end-of-turn ids of the model directory, with the chat template's when it compiles (a
    /// template that does not is reported by the chat front ends, not by `run`).
    fn resolve_stop_ids(model: &Model, tokenizer: Option<&Tokenizer>) -> Result<Vec<u32>> {
        let (dir, cfg) = (model.dir(), model.config());
        let format = crate::chat::ChatFormat::for_model(model).unwrap_or_else(|e| {
            tracing::warn!("{e}");
            None
        });
        let ids = crate::chat::stop::end_of_turn_ids(dir, cfg, tokenizer, format.as_ref())?;
        for s in &ids {
            tracing::debug!("end-of-turn id {} from {}", s.id, s.source);
        }
        Ok(ids.into_iter().map(|s| s.id).collect())
    }

    /// Warm start: reads the most used experts of the usage profile `path`
    /// ([`crate::expert::usage`]), as many as the expert cache holds, into the cache before the first
    /// token. Only the starting contents change: the cache stays an LRU and nothing is pinned.
    ///
    /// # Errors
    /// As [`UsageProfile::read`]; [`Error::Invalid`] when the profile's shape is not this model's;
    /// as [`ExpertCache::warm`].
    pub fn warm_from(&mut self, path: &Path) -> Result<&WarmStats> {
        let cfg = self.model.config();
        let profile = UsageProfile::read(path)?;
        profile.check_shape(cfg.num_hidden_layers, cfg.num_experts, &path.display().to_string())?;
        let t = Instant::now();
        let b0 = self.io_stats.snapshot().bytes;
        let experts = self.cache.warm(&profile.top(self.cache.capacity()), &mut *self.loader)?;
        let warm = WarmStats {
            profile: path.to_path_buf(),
            experts,
            bytes_read: self.io_stats.snapshot().bytes - b0,
            ms: t.elapsed().as_secs_f64() * 1e3,
        };
        tracing::info!("warm start from {}: {experts} experts in {:.0} ms", path.display(), warm.ms);
        Ok(self.warm.insert(warm))
    }

    /// The usage counts of every token run so far as a profile (what `--usage-out` saves).
    pub fn usage_profile(&self) -> UsageProfile {
        let cfg = self.model.config();
        UsageProfile::new(cfg.num_hidden_layers, cfg.num_experts, self.model.usage().to_vec())
    }

    /// The token ids whose K/V the cache holds (positions `0..len`).
    pub fn kv_ids(&self) -> &[u32] {
        &self.kv
    }

    /// Forgets what the KV cache holds: the next request prefills from position 0.
    pub fn reset_kv(&mut self) {
        self.kv.clear();
    }

    /// Runs `ids` (at least one) at positions `pos0..pos0 + ids.len()` (the KV cache must hold
    /// `0..pos0`, as [`Session::kv_ids`] records) through [`Model::prefill`](crate::model::Model::prefill),
    /// in chunks of `--prefill-chunk` tokens, leaving the logits after the last one in
    /// [`Model::logits`](crate::model::Model::logits) and `kv` = `kv[..pos0] + ids`. Checks
    /// [`crate::interrupt::requested`] before every chunk.
    ///
    /// # Errors
    /// [`Error::Interrupted`] and forward-pass errors, with `kv` left at `kv[..pos0]`.
    pub(crate) fn prefill(&mut self, ids: &[u32], pos0: usize) -> Result<()> {
        self.prefill_until(ids, pos0, &mut || false).map(|_| ())
    }

    /// [`Session::prefill`] asking `stop` before every chunk ([`Model::prefill_until`](crate::model::Model::prefill_until)):
    /// returns the ids run, `ids.len()` or fewer when `stop` said so, and `kv` then records the
    /// chunks that ran (their KV is valid; a later prompt sharing them reuses it).
    ///
    /// # Errors
    /// As [`Session::prefill`].
    pub(crate) fn prefill_until(&mut self, ids: &[u32], pos0: usize, stop: &mut dyn FnMut() -> bool) -> Result<usize> {
        // On an error the KV cache is taken to hold only `0..pos0`: positions past it are rewritten
        // by the next prefill.
        self.kv.truncate(pos0);
        let done = self.model.prefill_until(ids, pos0, &mut self.cache, &mut *self.loader, stop)?;
        self.kv.extend_from_slice(&ids[..done]);
        Ok(done)
    }

    /// Encodes `text` with the model's tokenizer.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the model directory has no tokenizer.json.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.tokenizer {
            Some(t) => t.encode(text),
            None => Err(Error::Invalid(format!(
                "{} has no tokenizer.json: give the prompt as ids with --prompt-ids",
                self.model.dir().display()
            ))),
        }
    }

    /// Generates up to `opts.max_new` tokens after `prompt_ids` (positions from 0: a fresh sequence).
    /// Before every forward pass it checks [`crate::interrupt::requested`].
    ///
    /// # Errors
    /// [`Error::Interrupted`] after SIGINT/SIGTERM (see [`crate::interrupt`]; the tokens generated
    /// until then are lost: [`Session::generate_until_interrupted`] keeps them);
    /// [`Error::Invalid`] for an empty prompt, an id outside the vocabulary or a sequence longer than
    /// the KV cache; forward-pass errors.
    pub fn generate(&mut self, prompt_ids: &[u32], opts: &GenerateOptions) -> Result<Generation> {
        let g = self.generate_until_interrupted(prompt_ids, opts)?;
        match g.stats.interrupted {
            Some(signal) => {
                Err(Error::Interrupted { signal, done: g.tokens.len(), wanted: opts.max_new, unit: "tokens" })
            }
            None => Ok(g),
        }
    }

    /// [`Session::generate`], except that a stop request (SIGINT/SIGTERM, [`crate::interrupt`])
    /// ends the generation with what it has: the tokens generated so far (none when the stop came
    /// during the prompt), their logits when kept, and the figures until the stop, with
    /// [`RunStats::interrupted`] naming the signal. `picchio run` prints them, then exits 128 + signal.
    ///
    /// # Errors
    /// As [`Session::generate`], [`Error::Interrupted`] excepted.
    pub fn generate_until_interrupted(&mut self, prompt_ids: &[u32], opts: &GenerateOptions) -> Result<Generation> {
        check_prompt(&self.model, prompt_ids, opts.max_new)?;
        let eos = if opts.stop_at_eos { self.stop_ids.clone() } else { Vec::new() };
        // Positions from 0: whatever the KV cache held is overwritten.
        self.kv.clear();
        let (h0, m0, io0) = (self.cache.hits(), self.cache.misses(), self.io_stats.snapshot());
        let (pf0, wait0) = (self.cache.prefetch_stats(), self.cache.io_wait_ns());
        let mut sampler = Sampler::new(opts.sampler);
        let mut tokens = Vec::with_capacity(opts.max_new);
        let mut kept = Vec::new();
        let mut interrupted = None;

        let t0 = Instant::now();
        let mut pos = 0;
        // The prompt in chunks (`Model::prefill`, which checks for an interrupt before each chunk).
        match self.prefill(prompt_ids, pos) {
            Err(Error::Interrupted { signal, .. }) => interrupted = Some(signal),
            r => r?,
        };
        pos += prompt_ids.len();
        let prefill = t0.elapsed();
        let io_prefill = self.io_stats.snapshot();
        let (timers0, dwait0) = (self.model.timers(), self.cache.io_wait_ns());
        let t1 = Instant::now();
        let mut decode_steps = 0usize;
        while interrupted.is_none() && tokens.len() < opts.max_new {
            let logits = self.model.logits();
            let next = if opts.sampler.penalizes() {
                sampler.sample_after(logits, &[prompt_ids, &tokens[..]].concat(), &tokens)
            } else {
                sampler.sample(logits)
            };
            if opts.keep_logits {
                kept.extend_from_slice(logits);
            }
            tokens.push(next);
            if eos.contains(&next) || tokens.len() == opts.max_new {
                break;
            }
            if crate::interrupt::requested() {
                interrupted = Some(crate::interrupt::signal_name());
                break;
            }
            self.model.forward(next, pos, &mut self.cache, &mut *self.loader)?;
            self.kv.push(next);
            pos += 1;
            decode_steps += 1;
        }
        let decode = t1.elapsed();
        let mut stats =
            self.stats_since((h0, m0, io0), io_prefill, prompt_ids.len(), tokens.len(), prefill, decode, decode_steps);
        let since = SinceStart { prefetch: pf0, io_wait_ns: wait0, decode_timers: timers0, decode_io_wait_ns: dwait0 };
        debug_assert_eq!(since.decode_timers.steps + decode_steps as u64, self.model.timers().steps);
        self.add_decode_figures(&mut stats, since);
        stats.interrupted = interrupted;
        Ok(Generation { prompt_ids: prompt_ids.to_vec(), tokens, logits: kept, stats })
    }

    /// The figures of a generation that started when the cache and I/O counters were `start`
    /// (hits, misses, I/O) and whose prefill ended when the I/O counters were `io_prefill`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn stats_since(
        &self,
        start: (u64, u64, picchio_core::StatsSnapshot),
        io_prefill: picchio_core::StatsSnapshot,
        prompt_tokens: usize,
        generated_tokens: usize,
        prefill: std::time::Duration,
        decode: std::time::Duration,
        decode_steps: usize,
    ) -> RunStats {
        let (h0, m0, io0) = start;
        let io = self.io_stats.snapshot();
        let read_wait_ms = (io.read_wall_ns - io0.read_wall_ns) as f64 / 1e6;
        let read_span_ms = (io.read_span_ns - io0.read_span_ns) as f64 / 1e6;
        let bytes_read = io.bytes - io0.bytes;
        let mb_s = |ms: f64| if ms > 0.0 { bytes_read as f64 / 1e6 / (ms / 1e3) } else { 0.0 };
        let run_ms = (prefill + decode).as_secs_f64() * 1e3;
        RunStats {
            prompt_tokens,
            generated_tokens,
            prefill_ms: prefill.as_secs_f64() * 1e3,
            prefill_reads: io_prefill.reads - io0.reads,
            prefill_bytes_read: io_prefill.bytes - io0.bytes,
            decode_ms: decode.as_secs_f64() * 1e3,
            decode_tok_s: if decode_steps > 0 { decode_steps as f64 / decode.as_secs_f64() } else { 0.0 },
            cache_hits: self.cache.hits() - h0,
            cache_misses: self.cache.misses() - m0,
            cache_capacity: self.cache.capacity(),
            reads: io.reads - io0.reads,
            bytes_read,
            read_wait_ms,
            read_span_ms,
            read_latency_mean_ms: match io.reads - io0.reads {
                0 => 0.0,
                n => (io.latency_sum_ns - io0.latency_sum_ns) as f64 / 1e6 / n as f64,
            },
            read_mb_s: mb_s(read_span_ms),
            read_mb_s_run: mb_s(run_ms),
            peak_rss_bytes: crate::plan::peak_rss().unwrap_or(0),
            bounce_bytes: io.bounce_bytes - io0.bounce_bytes,
            fallbacks: io.fallbacks - io0.fallbacks,
            store_errors: io.errors - io0.errors,
            store_missing: io.missing - io0.missing,
            store: self.info.store.clone(),
            engine: self.info.engine.clone(),
            async_moe: self.cache.async_moe(),
            overlap: self.model.decode_schedule().overlap && self.cache.async_moe(),
            prefetch: self.model.decode_schedule().prefetch
                && self.model.decode_schedule().overlap
                && self.cache.async_moe(),
            prefetch_stats: PrefetchStats::default(),
            prefetch_wasted_bytes: 0,
            decode_split: DecodeSplit::default(),
            warm: self.warm.clone(),
            interrupted: None,
        }
    }

    /// Fills the figures [`Session::stats_since`] leaves at their defaults: exposed wait
    /// (`read_wait_ms`, from the expert cache), prefetch and the decode split, from the counters at
    /// `since`.
    pub(crate) fn add_decode_figures(&self, st: &mut RunStats, since: SinceStart) {
        st.read_wait_ms = (self.cache.io_wait_ns() - since.io_wait_ns) as f64 / 1e6;
        let pf = self.cache.prefetch_stats();
        st.prefetch_stats = PrefetchStats {
            issued: pf.issued - since.prefetch.issued,
            used: pf.used - since.prefetch.used,
            wasted: pf.wasted - since.prefetch.wasted,
        };
        st.prefetch_wasted_bytes = st.prefetch_stats.wasted * self.cache.slot_len() as u64;
        let t = self.model.timers().since(&since.decode_timers);
        st.decode_split = DecodeSplit::from_timers(t, self.cache.io_wait_ns() - since.decode_io_wait_ns);
    }

    /// Decodes ids to text when a tokenizer is present.
    ///
    /// # Errors
    /// Tokenizer errors.
    pub fn decode(&self, ids: &[u32]) -> Result<Option<String>> {
        self.tokenizer.as_ref().map(|t| t.decode(ids)).transpose()
    }
}

/// Checks a prompt before a generation of up to `max_new` tokens on `model`: not empty, every id
/// below the vocabulary, and prompt + `max_new` positions within the model's KV cache.
///
/// # Errors
/// [`Error::EmptyPrompt`], [`Error::OutOfVocabulary`] naming the first id out of range,
/// [`Error::ContextOverflow`] with the positions needed and held.
pub(crate) fn check_prompt(model: &Model, prompt: &[u32], max_new: usize) -> Result<()> {
    let vocab = model.config().vocab_size;
    if prompt.is_empty() {
        return Err(Error::EmptyPrompt);
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::OutOfVocabulary { what: "prompt id", id: u64::from(bad), vocab });
    }
    let needed = prompt.len().saturating_add(max_new);
    if needed > model.max_seq() {
        return Err(Error::ContextOverflow { needed, context: model.max_seq(), config: None });
    }
    Ok(())
}

/// Writes `logits` `[rows, vocab]` as a safetensors file with one F32 tensor `logits`
/// (`--dump-logits`), atomically: into a temporary sibling, synced, then renamed over `path`, so a
/// failure never leaves half a file. An existing `path` is replaced only when it is a previous dump
/// ([`is_logits_dump`]); anything else (a model shard, config.json, a directory) is refused.
///
/// # Errors
/// [`Error::Invalid`] when `path` exists and is not a logits dump; [`Error::Io`] naming the path.
pub fn dump_logits(path: &Path, logits: &[f32], vocab: usize) -> Result<()> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(path, "stat the --dump-logits path")(e)),
        Ok(_) if is_logits_dump(path) => {}
        Ok(_) => {
            return Err(Error::Invalid(format!(
                "{}: exists and is not a logits dump (a safetensors file whose only tensor is `logits`); \
                 --dump-logits will not replace it: remove it or choose another path",
                path.display()
            )))
        }
    }
    let rows = logits.len() / vocab.max(1);
    let bytes: &[u8] = bytemuck::cast_slice(logits);
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![rows, vocab], bytes)
        .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
    let data = safetensors::serialize([("logits", view)], None)
        .map_err(|e| Error::io(path, "encode logits")(std::io::Error::other(e.to_string())))?;
    crate::image::guard::sweep_leftovers(path, "run --dump-logits")?;
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    let tmp = path.with_file_name(name);
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| std::io::Write::write_all(&mut f, &data).and_then(|()| f.sync_all()))
        .map_err(Error::io(path, "write logits (to a temporary file beside it)"))
        .and_then(|()| std::fs::rename(&tmp, path).map_err(Error::io(path, "rename the logits dump into place")));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Whether `path` is a regular file holding a previous [`dump_logits`] output: a safetensors file
/// whose header names exactly one tensor, `logits`. Only the header is read.
fn is_logits_dump(path: &Path) -> bool {
    use std::io::Read;
    // stat before open: opening a FIFO would block.
    if !std::fs::metadata(path).is_ok_and(|m| m.is_file()) {
        return false;
    }
    let Ok(mut f) = std::fs::File::open(path) else { return false };
    let mut len = [0u8; 8];
    if f.read_exact(&mut len).is_err() {
        return false;
    }
    let Ok(len) = usize::try_from(u64::from_le_bytes(len)) else { return false };
    if len > 1 << 20 {
        return false; // a one-tensor header is tiny; a model shard's is large
    }
    let mut header = vec![0u8; len];
    if f.read_exact(&mut header).is_err() {
        return false;
    }
    let Ok(serde_json::Value::Object(map)) = serde_json::from_slice(&header) else { return false };
    let mut tensors = map.keys().filter(|k| *k != "__metadata__");
    tensors.next().is_some_and(|k| k == "logits") && tensors.next().is_none()
}
