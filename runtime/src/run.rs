//! `picchio run`: open a converted model and its expert store, then generate.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use picchio_core::{ExpertLoader, IoStats, StoreUri};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::expert::cache::ExpertCache;
use crate::expert::store::{open_store, IoOptions, StoreInfo};
use crate::model::sampler::{Sampler, SamplerOptions};
use crate::model::tokenizer::Tokenizer;
use crate::model::{DenseFormat, Model};

/// How to open a model for generation.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Converted model directory.
    pub model_dir: PathBuf,
    /// Where routed experts come from.
    pub store: StoreUri,
    /// Flat-store I/O settings.
    pub io: IoOptions,
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
    /// The device's delivered rate while reads were in flight, MB/s (10^6 B): bytes_read /
    /// read_span_ms. Not bytes over the wait, which overstates the device whenever compute hides
    /// the reads.
    pub read_mb_s: f64,
    /// Bytes read over the whole generation's wall time (prefill + decode), MB/s.
    pub read_mb_s_run: f64,
    /// This process's peak resident set so far, bytes (`VmHWM`, [`crate::mem::peak_rss`]; 0 when
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
    let avail = crate::mem::mem_available().unwrap_or(4 << 30);
    let fit = (avail / 2) / slot_bytes.max(1) as u64;
    (fit as usize).clamp(topk.max(1), total_experts.max(1))
}

impl Session {
    /// Loads the model, opens the store and allocates the cache; `tokenizer` is the directory's
    /// (from [`Tokenizer::from_dir`], loaded by the caller to size `max_seq` from the prompt).
    ///
    /// # Errors
    /// Model loading errors (config, tensors), store errors (see [`open_store`]), allocation.
    pub fn open(opts: &SessionOptions, tokenizer: Option<Tokenizer>) -> Result<Self> {
        let cfg = crate::model::config::Config::from_dir(&opts.model_dir)?;
        if opts.max_seq > cfg.max_position_embeddings {
            return Err(Error::ContextOverflow {
                needed: opts.max_seq,
                context: cfg.max_position_embeddings,
                config: Some(opts.model_dir.join("config.json")),
            });
        }
        let model = Model::load_as(&opts.model_dir, opts.max_seq, opts.dense)?;
        let cfg = model.config().clone();
        let layout = model.layout().clone();
        let (mut loader, mut info, io_stats) =
            open_store(&opts.store, &opts.model_dir, &cfg, model.tensors().clone(), &layout, opts.io)?;
        let total = cfg.moe_layers().len() * cfg.num_experts;
        let ecap = match opts.ecap {
            Some(0) => {
                let expected = "must be at least 1".into();
                return Err(Error::BadOption { option: "ecap", value: "0".into(), expected });
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
        cache.set_async_moe(opts.io.async_moe);
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
        let stop_ids = Self::resolve_stop_ids(model.dir(), model.config(), tokenizer.as_ref())?;
        Ok(Session { model, cache, loader, info, io_stats, tokenizer, stop_ids, kv: Vec::new() })
    }

    /// The end-of-turn ids of the model directory, with the chat template's when it compiles (a
    /// template that does not is reported by the chat front ends, not by `run`).
    fn resolve_stop_ids(dir: &Path, cfg: &crate::Config, tokenizer: Option<&Tokenizer>) -> Result<Vec<u32>> {
        let format = crate::chat::ChatFormat::from_dir(dir, cfg).unwrap_or_else(|e| {
            tracing::warn!("{e}");
            None
        });
        let ids = crate::chat::stop::end_of_turn_ids(dir, cfg, tokenizer, format.as_ref())?;
        for s in &ids {
            tracing::debug!("end-of-turn id {} from {}", s.id, s.source);
        }
        Ok(ids.into_iter().map(|s| s.id).collect())
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
        // On an error the KV cache is taken to hold only `0..pos0`: positions past it are rewritten
        // by the next prefill.
        self.kv.truncate(pos0);
        self.model.prefill(ids, pos0, &mut self.cache, &mut *self.loader)?;
        self.kv.extend_from_slice(ids);
        Ok(())
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
    /// [`Error::Interrupted`] after SIGINT/SIGTERM (see [`crate::interrupt`]);
    /// [`Error::Invalid`] for an empty prompt, an id outside the vocabulary or a sequence longer than
    /// the KV cache; forward-pass errors.
    pub fn generate(&mut self, prompt_ids: &[u32], opts: &GenerateOptions) -> Result<Generation> {
        let vocab = self.model.config().vocab_size;
        if prompt_ids.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        if let Some(&bad) = prompt_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::OutOfVocabulary { what: "prompt id", id: u64::from(bad), vocab });
        }
        let needed = prompt_ids.len().saturating_add(opts.max_new);
        if needed > self.model.max_seq() {
            return Err(Error::ContextOverflow { needed, context: self.model.max_seq(), config: None });
        }
        let eos = if opts.stop_at_eos { self.stop_ids.clone() } else { Vec::new() };
        // Positions from 0: whatever the KV cache held is overwritten.
        self.kv.clear();
        let (h0, m0, io0) = (self.cache.hits(), self.cache.misses(), self.io_stats.snapshot());
        let mut sampler = Sampler::new(opts.sampler);
        let mut tokens = Vec::with_capacity(opts.max_new);
        let mut kept = Vec::new();

        let t0 = Instant::now();
        let mut pos = 0;
        let interrupted = |done| Error::Interrupted {
            signal: crate::interrupt::signal_name(),
            done,
            wanted: opts.max_new,
            unit: "tokens",
        };
        // The prompt in chunks (`Model::prefill`, which checks for an interrupt before each chunk).
        match self.prefill(prompt_ids, pos) {
            Err(Error::Interrupted { .. }) => return Err(interrupted(0)),
            r => r?,
        };
        pos += prompt_ids.len();
        let prefill = t0.elapsed();
        let io_prefill = self.io_stats.snapshot();
        let t1 = Instant::now();
        let mut decode_steps = 0usize;
        while tokens.len() < opts.max_new {
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
                return Err(interrupted(tokens.len()));
            }
            self.model.forward(next, pos, &mut self.cache, &mut *self.loader)?;
            self.kv.push(next);
            pos += 1;
            decode_steps += 1;
        }
        let decode = t1.elapsed();
        let stats =
            self.stats_since((h0, m0, io0), io_prefill, prompt_ids.len(), tokens.len(), prefill, decode, decode_steps);
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
            read_mb_s: mb_s(read_span_ms),
            read_mb_s_run: mb_s(run_ms),
            peak_rss_bytes: crate::mem::peak_rss().unwrap_or(0),
            bounce_bytes: io.bounce_bytes - io0.bounce_bytes,
            fallbacks: io.fallbacks - io0.fallbacks,
            store_errors: io.errors - io0.errors,
            store_missing: io.missing - io0.missing,
            store: self.info.store.clone(),
            engine: self.info.engine.clone(),
            async_moe: self.cache.async_moe(),
        }
    }

    /// Decodes ids to text when a tokenizer is present.
    ///
    /// # Errors
    /// Tokenizer errors.
    pub fn decode(&self, ids: &[u32]) -> Result<Option<String>> {
        self.tokenizer.as_ref().map(|t| t.decode(ids)).transpose()
    }
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
