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
use crate::model::Model;

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
}

/// Generation settings.
#[derive(Clone, Debug, Default)]
pub struct GenerateOptions {
    /// Tokens to generate.
    pub max_new: usize,
    /// Sampling.
    pub sampler: SamplerOptions,
    /// Stop at the config's end-of-sequence ids.
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
    /// Wall time spent waiting for expert loads, milliseconds.
    pub read_wall_ms: f64,
    /// Expert-read throughput while waiting, MB/s (bytes_read / read wall time).
    pub read_mb_s: f64,
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
    let avail = mem_available().unwrap_or(4 << 30);
    let fit = (avail / 2) / slot_bytes.max(1) as u64;
    (fit as usize).clamp(topk.max(1), total_experts.max(1))
}

fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
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
        let model = Model::load(&opts.model_dir, opts.max_seq)?;
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
        Ok(Session { model, cache, loader, info, io_stats, tokenizer })
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
        let eos = if opts.stop_at_eos { self.model.config().eos_ids() } else { Vec::new() };
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
        for &t in prompt_ids {
            if crate::interrupt::requested() {
                return Err(interrupted(0));
            }
            self.model.forward(t, pos, &mut self.cache, &mut *self.loader)?;
            pos += 1;
        }
        let prefill = t0.elapsed();
        let t1 = Instant::now();
        let mut decode_steps = 0usize;
        while tokens.len() < opts.max_new {
            let logits = self.model.logits();
            let next = sampler.sample(logits);
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
            pos += 1;
            decode_steps += 1;
        }
        let decode = t1.elapsed();
        let io = self.io_stats.snapshot();
        let read_wall_ms = (io.read_wall_ns - io0.read_wall_ns) as f64 / 1e6;
        let bytes_read = io.bytes - io0.bytes;
        let stats = RunStats {
            prompt_tokens: prompt_ids.len(),
            generated_tokens: tokens.len(),
            prefill_ms: prefill.as_secs_f64() * 1e3,
            decode_ms: decode.as_secs_f64() * 1e3,
            decode_tok_s: if decode_steps > 0 { decode_steps as f64 / decode.as_secs_f64() } else { 0.0 },
            cache_hits: self.cache.hits() - h0,
            cache_misses: self.cache.misses() - m0,
            cache_capacity: self.cache.capacity(),
            reads: io.reads - io0.reads,
            bytes_read,
            read_wall_ms,
            read_mb_s: if read_wall_ms > 0.0 { bytes_read as f64 / 1e6 / (read_wall_ms / 1e3) } else { 0.0 },
            bounce_bytes: io.bounce_bytes - io0.bounce_bytes,
            fallbacks: io.fallbacks - io0.fallbacks,
            store_errors: io.errors - io0.errors,
            store_missing: io.missing - io0.missing,
            store: self.info.store.clone(),
            engine: self.info.engine.clone(),
            async_moe: self.cache.async_moe(),
        };
        Ok(Generation { prompt_ids: prompt_ids.to_vec(), tokens, logits: kept, stats })
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
