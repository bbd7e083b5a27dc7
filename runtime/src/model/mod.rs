//! Model architectures, declared like llama2.c `run.c`: `Config`, resident `Weights`, a
//! [`RunState`] allocated once, and a `forward` that streams routed experts through an
//! [`ExpertCache`] from an [`ExpertLoader`].
//!
//! [`Model`] is the seam: one loaded model of either architecture ([`ArchWeights`]), sharing the
//! config, the expert payload layout, the run state, the kernels and the routing observer; each
//! architecture's forward pass ([`qwen3_moe`], [`gpt_oss`]) is built from the shared pieces:
//! [`matrix`] (resident matrices), [`attention`] (GQA with optional window and sinks),
//! [`crate::model::rope`] (RoPE and YaRN), [`crate::model::moe`] (routers, expert activations, canonical sum)
//! and [`Step::routed_experts`].

pub mod attention;
pub mod config;
pub mod dir;
pub mod gguf;
pub mod gguf_tokenizer;
pub mod gpt_oss;
pub mod matrix;
pub mod moe;
pub mod prefill;
pub mod qwen3_moe;
pub mod rope;
pub mod safetensors;
pub mod sampler;
pub mod source;
pub mod state;
pub mod tokenizer;
pub mod trace;
pub mod weights;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use picchio_core::ExpertLoader;

use crate::error::{Error, Result};
use crate::expert::cache::ExpertCache;
use crate::expert::gguf::GgufInPlace;
use crate::expert::io_worker::{IoThread, IoWorker};
use crate::expert::layout::{ExpertLayout, ExpertNaming, ExpertTensorNames};
use crate::expert::safetensors::SafetensorsExperts;
use crate::kernels::Kernels;
use crate::model::config::{Arch, Config};
use crate::model::dir::ModelDir;
use crate::model::gguf::GgufWeights;
use crate::model::moe::{combine_canonical, expert_forward_with, ExpertAct, ExpertBias, RoutingObserver};
use crate::model::prefill::{ChunkState, DEFAULT_PREFILL_CHUNK};
use crate::model::safetensors::TensorStore;

pub use matrix::{DenseFormat, Matrix};
pub use qwen3_moe::{LayerWeights, Mlp, Weights};
pub use source::WeightSource;
pub use state::{RunState, StepTimers, Trace};
pub use weights::{DecoderLayer, ModelWeights};

/// How a MoE layer turns router logits into its top-k routing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RouterKind {
    /// Qwen3-MoE: softmax over all E, top-k, renormalised when `norm_topk_prob`.
    SoftmaxTopK {
        /// `norm_topk_prob`.
        norm: bool,
    },
    /// GPT-OSS: top-k of the logits, softmax over the k.
    TopKSoftmax,
}

/// A MoE layer's router as a closure: `logits [n_experts] = router(x [hidden])`, computed with the
/// given kernels (`--prefetch` applies the next layer's to the current hidden state).
pub(crate) type RouterFn<'a> = dyn Fn(Kernels, &[f32], &mut [f32]) + 'a;

/// What one forward pass of any architecture works with, borrowed from the [`Model`].
pub(crate) struct Step<'a> {
    /// The configuration.
    pub cfg: &'a Config,
    /// The routed experts' payload layout.
    pub layout: &'a ExpertLayout,
    /// Kernels.
    pub k: Kernels,
    /// Scratch and KV cache.
    pub s: &'a mut RunState,
    /// The routing observer, if any.
    pub observer: &'a mut Option<Box<dyn RoutingObserver>>,
}

impl Step<'_> {
    /// The routed experts of MoE layer `l` at position `pos`: routes `s.router_logits` with
    /// `router`, reports the decision to the observer and `trace`, runs the k picked experts on
    /// `s.xb` (payloads from `cache`, misses loaded through `loader`; `biases` = the layer's resident
    /// `([E, 2I], [E, H])` expert biases) and sums their weighted outputs in canonical order into
    /// `s.xb2`.
    ///
    /// # Errors
    /// As [`ExpertCache::fetch`] (an expert that cannot be loaded, naming it).
    #[allow(clippy::too_many_arguments)]
    pub fn routed_experts(
        &mut self,
        l: usize,
        pos: usize,
        router: RouterKind,
        act: ExpertAct,
        biases: Option<(&[f32], &[f32])>,
        cache: &mut ExpertCache,
        io: &mut Io<'_, '_>,
        trace: Option<&mut Trace>,
    ) -> Result<()> {
        let s = &mut *self.s;
        let t_router = Instant::now();
        match router {
            RouterKind::SoftmaxTopK { norm } => s.routing.route(&s.router_logits, norm),
            RouterKind::TopKSoftmax => s.routing.route_topk_softmax(&s.router_logits),
        }
        let e_n = self.cfg.num_experts;
        for &e in &s.routing.experts {
            s.usage[l * e_n + e as usize] += 1;
        }
        if let Some(o) = self.observer.as_deref_mut() {
            o.routed(l, pos, &s.routing.experts, &s.routing.weights);
        }
        if let Some(t) = trace {
            t.router_logits[l].copy_from_slice(&s.router_logits);
            t.experts[l].copy_from_slice(&s.routing.experts);
            t.weights[l].copy_from_slice(&s.routing.weights);
        }
        s.timers.router_ns += t_router.elapsed().as_nanos() as u64;
        let (k, layout, h, i2) = (self.k, self.layout, self.cfg.hidden_size, 2 * self.cfg.moe_intermediate_size);
        let (xb, experts, weights) = (&s.xb, &s.routing.experts, &s.routing.weights);
        let (scratch, outs) = (&mut s.expert_scratch, &mut s.expert_out);
        let mut experts_ns = 0u64;
        let mut compute = |i: usize, payload: &[u8]| {
            let t = Instant::now();
            let e = experts[i] as usize;
            let bias =
                biases.map(|(gu, d)| ExpertBias { gate_up: &gu[e * i2..(e + 1) * i2], down: &d[e * h..(e + 1) * h] });
            let r = expert_forward_with(
                k,
                layout,
                l,
                payload,
                xb,
                weights[i],
                act,
                bias,
                scratch,
                &mut outs[i * h..(i + 1) * h],
            );
            experts_ns += t.elapsed().as_nanos() as u64;
            r
        };
        let fetched = match io {
            Io::Direct(loader) => cache.fetch(l as u32, experts, &mut **loader, &mut compute),
            Io::Worker { io, predicted, .. } => {
                let prefetch = predicted.take().map(|next| (next as u32, &s.next_routing.experts[..]));
                cache.fetch_overlapped(l as u32, experts, io, prefetch, &mut compute)
            }
        };
        s.timers.experts_ns += experts_ns;
        fetched?;
        combine_canonical(&s.expert_out, &mut s.xb2);
        Ok(())
    }

    /// With `--prefetch` on an overlapped pass, predicts layer `l + 1`'s experts when it is a MoE
    /// layer: its router `next_router` (`logits [E] = router(x)`) applied to `s.xb` (layer `l`'s
    /// normalised MLP input, the hidden state at hand), routed as `router` into `s.next_routing`,
    /// and the prediction handed to `io` for layer `l`'s fetch to read speculatively. Otherwise
    /// does nothing.
    pub fn predict_next(
        &mut self,
        l: usize,
        router: RouterKind,
        next_router: Option<&RouterFn<'_>>,
        io: &mut Io<'_, '_>,
    ) {
        let Io::Worker { predicted, prefetch: true, .. } = io else { return };
        let Some(next_router) = next_router else { return };
        if l + 1 >= self.cfg.num_hidden_layers || !self.cfg.is_moe_layer(l + 1) {
            return;
        }
        let t = Instant::now();
        let s = &mut *self.s;
        next_router(self.k, &s.xb, &mut s.next_logits);
        match router {
            RouterKind::SoftmaxTopK { norm } => s.next_routing.route(&s.next_logits, norm),
            RouterKind::TopKSoftmax => s.next_routing.route_topk_softmax(&s.next_logits),
        }
        *predicted = Some(l + 1);
        s.timers.router_ns += t.elapsed().as_nanos() as u64;
    }
}

/// Where a decode step's expert reads go.
pub(crate) enum Io<'a, 'w> {
    /// Blocking loads on the forward pass's thread ([`ExpertCache::fetch`]).
    Direct(&'a mut dyn ExpertLoader),
    /// Reads on the model's I/O thread, overlapped with compute ([`ExpertCache::fetch_overlapped`]).
    Worker {
        /// The worker.
        io: &'a mut IoWorker<'w>,
        /// Whether to prefetch the next layer's predicted experts (`--prefetch`).
        prefetch: bool,
        /// The layer whose predicted experts `RunState::next_routing` holds, for the next fetch.
        predicted: Option<usize>,
    },
}

/// How the forward passes schedule their expert reads against compute: what the decode loop needs,
/// apart from how the store's engine is opened ([`crate::expert::open::EngineOptions`]). Tokens are
/// the same under every schedule (DESIGN.md, "Determinism"); only the time differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DecodeSchedule {
    /// Compute each missed expert as soon as its read completes (`--async-moe`, the default), rather
    /// than after the whole batch is loaded (`--no-async-moe`). A mode of the expert cache
    /// ([`ExpertCache::set_async_moe`], which [`crate::run::Session::open`] sets from this), so it
    /// holds for prefill too; [`Model::forward`] reads the cache's.
    pub async_moe: bool,
    /// Decode steps read experts on the model's I/O thread while the layer's cached experts are
    /// computed (`--no-overlap` turns it off). Only with async MoE; prefill always reads on its own
    /// thread.
    pub overlap: bool,
    /// Speculative prefetch of the next layer's experts from the current hidden state through the
    /// next layer's router (`--prefetch`, off by default; only with `overlap`).
    pub prefetch: bool,
}

impl Default for DecodeSchedule {
    /// Async MoE and overlap on, no prefetch.
    fn default() -> Self {
        DecodeSchedule { async_moe: true, overlap: true, prefetch: false }
    }
}

impl DecodeSchedule {
    /// Whether decode steps read on the I/O thread: `overlap` with `async_moe`.
    pub fn overlapped(self) -> bool {
        self.overlap && self.async_moe
    }

    /// Whether decode steps prefetch: `prefetch` on an overlapped schedule.
    pub fn prefetching(self) -> bool {
        self.prefetch && self.overlapped()
    }
}

/// The resident weights of one architecture.
#[derive(Clone, Debug)]
pub enum ArchWeights {
    /// `qwen3_moe`.
    Qwen3Moe(qwen3_moe::Weights),
    /// `gpt_oss`.
    GptOss(gpt_oss::Weights),
}

impl ArchWeights {
    /// `model.embed_tokens.weight` `[V, H]`.
    pub fn embed_tokens(&self) -> &Matrix {
        match self {
            ArchWeights::Qwen3Moe(w) => &w.embed_tokens,
            ArchWeights::GptOss(w) => &w.embed_tokens,
        }
    }

    /// The output projection `[V, H]` (embed_tokens when tied).
    pub fn lm_head(&self) -> &Matrix {
        match self {
            ArchWeights::Qwen3Moe(w) => w.lm_head(),
            ArchWeights::GptOss(w) => w.lm_head(),
        }
    }

    /// The Qwen3-MoE weights, if this is one.
    pub fn qwen3_moe(&self) -> Option<&qwen3_moe::Weights> {
        match self {
            ArchWeights::Qwen3Moe(w) => Some(w),
            ArchWeights::GptOss(_) => None,
        }
    }

    /// The GPT-OSS weights, if this is one.
    pub fn gpt_oss(&self) -> Option<&gpt_oss::Weights> {
        match self {
            ArchWeights::GptOss(w) => Some(w),
            ArchWeights::Qwen3Moe(_) => None,
        }
    }
}

/// Where a loaded model's tensors are read from: a converted directory's safetensors or a GGUF
/// read in place (its routed experts too, by [`Model::in_place_loader`]).
#[derive(Clone)]
pub enum ModelFiles {
    /// A converted directory (or a Picchio (C) one).
    Safetensors(Arc<TensorStore>),
    /// A GGUF file (or split files), [`crate::model::gguf`].
    Gguf(Arc<GgufWeights>),
}

/// A loaded model of any architecture ([`Config::arch`]): config, resident weights, expert payload
/// layout and run state. The expert cache, loaders, kernels and sampler are the same for all.
pub struct Model {
    config: Config,
    files: ModelFiles,
    layout: ExpertLayout,
    weights: ArchWeights,
    state: RunState,
    kernels: Kernels,
    /// Sees every routing decision (`picchio run --trace`); `None` costs one branch per MoE layer.
    observer: Option<Box<dyn RoutingObserver>>,
    /// Tokens per prefill chunk ([`Model::set_prefill_chunk`]).
    prefill_chunk: usize,
    /// Scratch of the chunked prefill, allocated by the first [`Model::prefill`] that needs it.
    chunk_state: Option<Box<ChunkState>>,
    /// How decode steps schedule expert reads.
    schedule: DecodeSchedule,
    /// The I/O thread of overlapped decode steps, started once ([`Model::start_io_thread`], or by
    /// the first overlapped [`Model::forward`]) and kept for the model's life.
    io_thread: Option<IoThread>,
}

impl Model {
    /// Loads the model of a converted directory (or a Picchio (C) one) opened with its config
    /// ([`ModelDir::open`]): the safetensors files ([`TensorStore::open`]), the expert payload
    /// layout ([`ExpertLayout::detect`]) and every resident tensor ([`ModelWeights::load_as`] with
    /// the architecture's [`DecoderLayer`]); the run state holds `max_seq` positions. config.json is
    /// not read again.
    ///
    /// # Errors
    /// Those of the steps above, [`Error::ZeroContext`] when `max_seq` is 0, and [`Error::NotConverted`]
    /// for a Hugging Face checkpoint.
    pub fn load(dir: &ModelDir, max_seq: usize) -> Result<Model> {
        Model::load_as(dir, max_seq, DenseFormat::Stored)
    }

    /// [`Model::load`] with the resident attention and dense-MLP projections converted to `dense` at
    /// load ([`DenseFormat`], `picchio run --dense`): fewer bytes streamed from RAM per token, at the
    /// cost of exactness (the drift is measured in docs/kernels.md).
    ///
    /// # Errors
    /// As [`Model::load`].
    pub fn load_as(model: &ModelDir, max_seq: usize, dense: DenseFormat) -> Result<Model> {
        let dir = model.path();
        if max_seq == 0 {
            return Err(Error::ZeroContext { dir: dir.into() });
        }
        let config = model.config().clone();
        let (files, layout) = match model.gguf() {
            Some(g) => (ModelFiles::Gguf(Arc::clone(g)), g.expert_layout(&config)?),
            None => {
                let store = Arc::new(TensorStore::open(dir)?);
                Self::refuse_unconverted(&store, &config, dir)?;
                let layout = ExpertLayout::detect(&store, &config)?;
                (ModelFiles::Safetensors(store), layout)
            }
        };
        let source: &dyn WeightSource = match &files {
            ModelFiles::Safetensors(s) => &**s,
            ModelFiles::Gguf(g) => &**g,
        };
        let weights = match config.arch() {
            Arch::Qwen3Moe => ArchWeights::Qwen3Moe(qwen3_moe::Weights::load_as(source, &config, dense)?),
            Arch::GptOss => ArchWeights::GptOss(gpt_oss::Weights::load_as(source, &config, dense)?),
        };
        // The dense part is resident once, as the copies just made: no mapped page stays behind
        // (the in-place expert loaders fault an expert's pages in only when they read that expert).
        source.release_all();
        let state = RunState::new(&config, max_seq);
        Ok(Model {
            config,
            files,
            layout,
            weights,
            state,
            kernels: Kernels::get(),
            observer: None,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            chunk_state: None,
            schedule: DecodeSchedule::default(),
            io_thread: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The payload layout of one routed expert (its [`ExpertLayout::len`] sizes the cache slots).
    pub fn layout(&self) -> &ExpertLayout {
        &self.layout
    }

    /// Refuses a Hugging Face checkpoint that was not converted (its experts are not in the
    /// payload layout), naming the tensor that shows it.
    fn refuse_unconverted(store: &TensorStore, config: &Config, dir: &Path) -> Result<()> {
        if let Some(l) = config.moe_layers().first() {
            let hf = [
                format!("model.layers.{l}.mlp.experts.0.gate_proj.weight"),
                format!("model.layers.{l}.mlp.experts.gate_up_proj"),
                format!("model.layers.{l}.mlp.experts.gate_up_proj_blocks"),
            ];
            let converted = ExpertTensorNames::with(ExpertNaming::for_arch(config.arch()), *l, 0).gate_up;
            if hf.iter().any(|n| store.contains(n)) && !store.contains(&converted) {
                return Err(Error::NotConverted {
                    dir: dir.into(),
                    tensor: hf.iter().find(|n| store.contains(n)).cloned(),
                    pack: false,
                });
            }
        }
        Ok(())
    }

    /// The model directory, or the GGUF file.
    pub fn dir(&self) -> &Path {
        match &self.files {
            ModelFiles::Safetensors(s) => s.dir(),
            ModelFiles::Gguf(g) => g.path(),
        }
    }

    /// Where the model's tensors are read from.
    pub fn files(&self) -> &ModelFiles {
        &self.files
    }

    /// The directory's safetensors tensors (shared with a [`SafetensorsExperts`] loader); `None`
    /// for a GGUF model.
    pub fn tensors(&self) -> Option<&Arc<TensorStore>> {
        match &self.files {
            ModelFiles::Safetensors(s) => Some(s),
            ModelFiles::Gguf(_) => None,
        }
    }

    /// The logits `[V]` of the last [`Model::forward`] (zeros before the first).
    pub fn logits(&self) -> &[f32] {
        &self.state.logits
    }

    /// The resident weights.
    pub fn weights(&self) -> &ArchWeights {
        &self.weights
    }

    /// Positions the KV cache holds.
    pub fn max_seq(&self) -> usize {
        self.state.max_seq
    }

    /// Installs `observer`, which then sees every routing decision of the following forward passes
    /// (see [`RoutingObserver`]); returns the one it replaces, without calling its `finish`.
    pub fn set_routing_observer(&mut self, observer: Box<dyn RoutingObserver>) -> Option<Box<dyn RoutingObserver>> {
        self.observer.replace(observer)
    }

    /// Removes the routing observer and calls its [`RoutingObserver::finish`]; `Ok(None)` when
    /// there was none.
    ///
    /// # Errors
    /// The observer's `finish` error (e.g. a trace file that could not be written); the observer is
    /// removed either way.
    pub fn take_routing_observer(&mut self) -> Result<Option<Box<dyn RoutingObserver>>> {
        match self.observer.take() {
            Some(mut o) => o.finish().map(|()| Some(o)),
            None => Ok(None),
        }
    }

    /// An expert cache for this model holding `capacity` experts.
    ///
    /// # Errors
    /// As [`ExpertCache::new`].
    pub fn new_cache(&self, capacity: usize) -> Result<ExpertCache> {
        ExpertCache::new(capacity, self.layout.len())
    }

    /// The always-correct loader of the model's own files: experts copied from a directory's
    /// safetensors tensors ([`SafetensorsExperts`]) or from a GGUF's stacked expert tensors
    /// ([`GgufInPlace`]). Every other store falls back to it.
    pub fn in_place_loader(&self) -> Box<dyn ExpertLoader> {
        match &self.files {
            ModelFiles::Safetensors(s) => Box::new(SafetensorsExperts::new(Arc::clone(s), self.layout.clone())),
            ModelFiles::Gguf(g) => Box::new(GgufInPlace::new(Arc::clone(g), self.layout.clone())),
        }
    }

    /// The kernels of later forward passes and prefills.
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// Runs later forward passes and prefills with `k` (default [`Kernels::get`]); for example
    /// `Kernels::get().with_idot(true)` for the integer Q4 expert kernels (`picchio run --idot`).
    pub fn set_kernels(&mut self, k: Kernels) {
        self.kernels = k;
    }

    /// Sets the tokens per chunk of [`Model::prefill`] (`--prefill-chunk`; default
    /// [`DEFAULT_PREFILL_CHUNK`]); 1 runs the prompt token by token through [`Model::forward`].
    ///
    /// # Errors
    /// [`Error::BadOption`] (`prefill-chunk`) when `n` is 0.
    pub fn set_prefill_chunk(&mut self, n: usize) -> Result<()> {
        if n == 0 {
            let expected = "at least 1 token per chunk (1 = token by token)".into();
            return Err(Error::BadOption { option: "--prefill-chunk", value: "0".into(), expected });
        }
        self.prefill_chunk = n;
        Ok(())
    }

    /// Sets how [`Model::forward`] schedules expert reads (default: overlapped, no prefetch); its
    /// `async_moe` is the expert cache's to apply ([`DecodeSchedule::async_moe`]). The tokens are
    /// the same either way.
    pub fn set_decode_schedule(&mut self, schedule: DecodeSchedule) {
        self.schedule = schedule;
    }

    /// How [`Model::forward`] schedules expert reads.
    pub fn decode_schedule(&self) -> DecodeSchedule {
        self.schedule
    }

    /// Starts the I/O thread of overlapped decode steps now, if it is not running, so that no
    /// decode step starts one ([`crate::run::Session::open`] does this for an overlapped
    /// schedule). Without it the first overlapped [`Model::forward`] starts it. One thread per
    /// model, for its whole life.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the OS error when the thread cannot be started.
    pub fn start_io_thread(&mut self) -> Result<()> {
        if self.io_thread.is_none() {
            self.io_thread = Some(start_io_thread()?);
        }
        Ok(())
    }

    /// How many tokens each (layer, expert) was routed to so far, `[L * E]` row-major (prompt and
    /// generated tokens; see [`crate::expert::usage::UsageProfile`]).
    pub fn usage(&self) -> &[u64] {
        &self.state.usage
    }

    /// Time split of the forward passes so far ([`StepTimers`]).
    pub fn timers(&self) -> StepTimers {
        self.state.timers
    }

    /// Tokens per chunk of [`Model::prefill`].
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    /// Runs `tokens` at positions `pos0..pos0 + tokens.len()` (positions `0..pos0` must have been
    /// run before, so the KV cache holds them) and returns the logits `[V]` after the last one,
    /// in chunks of [`Model::prefill_chunk`] tokens (see [`prefill`]: dense projections as
    /// matrix–matrix products over the chunk, causal attention over the KV cache, each MoE layer's
    /// union of routed experts fetched once per chunk). The result, and the KV cache it leaves, are
    /// bit-identical to running the tokens one by one through [`Model::forward`], which is what a
    /// chunk of 1 does. A routing observer sees every token's decision, layer by layer within a
    /// chunk (see [`RoutingObserver`]); per-position [`Trace`]s come from [`Model::forward_traced`].
    ///
    /// Before each chunk it checks [`crate::interrupt::requested`].
    ///
    /// # Errors
    /// [`Error::EmptyPrompt`] for no tokens; as [`Model::forward_traced`] (a token outside the
    /// vocabulary, a position beyond the KV cache, a cache sized for another payload, an expert that
    /// cannot be loaded); [`Error::Interrupted`] (`done` = tokens run, `unit` =
    /// `prompt tokens`) after SIGINT/SIGTERM.
    pub fn prefill(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        cache: &mut ExpertCache,
        loader: &mut dyn ExpertLoader,
    ) -> Result<&[f32]> {
        self.prefill_until(tokens, pos0, cache, loader, &mut || false)?;
        Ok(&self.state.logits)
    }

    /// [`Model::prefill`] that also asks `stop` before each chunk (after the interrupt check) and
    /// ends there when it says so: a chat whose user pressed Ctrl-C, a server whose client went
    /// away. Returns the tokens run: `tokens.len()`, or fewer when stopped (a whole number of
    /// chunks, whose positions the KV cache then holds; the logits are not those of the last token).
    ///
    /// # Errors
    /// As [`Model::prefill`].
    pub fn prefill_until(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        cache: &mut ExpertCache,
        loader: &mut dyn ExpertLoader,
        stop: &mut dyn FnMut() -> bool,
    ) -> Result<usize> {
        let cfg = &self.config;
        if tokens.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(Error::OutOfVocabulary { what: "token id", id: u64::from(bad), vocab: cfg.vocab_size });
        }
        let end = pos0.saturating_add(tokens.len());
        if end > self.state.max_seq {
            return Err(Error::BeyondContext { position: end - 1, context: self.state.max_seq });
        }
        if cache.payload_len() != self.layout.len() {
            return Err(Error::CachePayload { cache: cache.payload_len(), model: self.layout.len() });
        }
        let chunk = self.prefill_chunk.max(1);
        let interrupted = |done| Error::Interrupted {
            signal: crate::interrupt::signal_name(),
            done,
            wanted: tokens.len(),
            unit: "prompt tokens",
        };
        if chunk == 1 {
            for (i, &t) in tokens.iter().enumerate() {
                if crate::interrupt::requested() {
                    return Err(interrupted(i));
                }
                if stop() {
                    return Ok(i);
                }
                self.forward(t, pos0 + i, cache, loader)?;
            }
            return Ok(tokens.len());
        }
        let cap = chunk.min(tokens.len());
        if self.chunk_state.as_ref().is_none_or(|c| c.cap < cap) {
            self.chunk_state = Some(Box::new(ChunkState::new(&self.config, cap)));
        }
        let cs = self.chunk_state.as_deref_mut().expect("allocated above");
        for (c, part) in tokens.chunks(chunk).enumerate() {
            let start = c * chunk;
            if crate::interrupt::requested() {
                return Err(interrupted(start));
            }
            if stop() {
                return Ok(start);
            }
            let last = start + part.len() == tokens.len();
            let step = Step {
                cfg: &self.config,
                layout: &self.layout,
                k: self.kernels,
                s: &mut self.state,
                observer: &mut self.observer,
            };
            match &self.weights {
                ArchWeights::Qwen3Moe(w) => {
                    qwen3_moe::prefill_chunk(step, cs, w, part, pos0 + start, last, cache, loader)?
                }
                ArchWeights::GptOss(w) => gpt_oss::prefill_chunk(step, cs, w, part, pos0 + start, last, cache, loader)?,
            }
        }
        Ok(tokens.len())
    }

    /// The logits `[V]` after `token` at position `pos`; see [`Model::forward_traced`].
    ///
    /// # Errors
    /// As [`Model::forward_traced`].
    pub fn forward(
        &mut self,
        token: u32,
        pos: usize,
        cache: &mut ExpertCache,
        loader: &mut dyn ExpertLoader,
    ) -> Result<&[f32]> {
        self.forward_traced(token, pos, cache, loader, None)
    }

    /// Runs `token` at position `pos` (positions `0..pos` must have been run before, in order, for the
    /// KV cache to hold them) and returns the logits `[V]` predicting the next token. Routed experts
    /// come from `cache`, which loads misses through `loader`. When `trace` is given, it receives the
    /// hidden states and router decisions of this position.
    ///
    /// # Errors
    /// [`Error::OutOfVocabulary`] when `token >= vocab_size`, [`Error::BeyondContext`] when
    /// `pos >= max_seq`, [`Error::CachePayload`] when the cache was sized for another payload, or the
    /// cache's error when an expert cannot be loaded (naming the expert; see [`ExpertCache::fetch`]).
    pub fn forward_traced(
        &mut self,
        token: u32,
        pos: usize,
        cache: &mut ExpertCache,
        loader: &mut dyn ExpertLoader,
        trace: Option<&mut Trace>,
    ) -> Result<&[f32]> {
        let cfg = &self.config;
        let s = &mut self.state;
        if token as usize >= cfg.vocab_size {
            return Err(Error::OutOfVocabulary { what: "token id", id: u64::from(token), vocab: cfg.vocab_size });
        }
        if pos >= s.max_seq {
            return Err(Error::BeyondContext { position: pos, context: s.max_seq });
        }
        if cache.payload_len() != self.layout.len() {
            return Err(Error::CachePayload { cache: cache.payload_len(), model: self.layout.len() });
        }
        let step = Step { cfg, layout: &self.layout, k: self.kernels, s, observer: &mut self.observer };
        let weights = &self.weights;
        let run = |step: Step<'_>, io: &mut Io<'_, '_>, cache: &mut ExpertCache| match weights {
            ArchWeights::Qwen3Moe(w) => qwen3_moe::forward(step, w, token, pos, cache, io, trace),
            ArchWeights::GptOss(w) => gpt_oss::forward(step, w, token, pos, cache, io, trace),
        };
        let DecodeSchedule { overlap, prefetch, .. } = self.schedule;
        if overlap && cache.async_moe() {
            let io_thread = match &mut self.io_thread {
                Some(t) => t,
                none => none.insert(start_io_thread()?),
            };
            let mut settle_ns = 0;
            io_thread.lend(loader, |w| {
                let ran = run(step, &mut Io::Worker { io: &mut *w, prefetch, predicted: None }, &mut *cache);
                // Every slot back from the worker before it ends, even after an error.
                let t_settle = std::time::Instant::now();
                let settled = cache.settle(w);
                cache.end_speculation();
                settle_ns = t_settle.elapsed().as_nanos() as u64;
                ran.and(settled)
            })?;
            // Waiting for reads still in flight (wrong prefetch guesses) is part of the step: the
            // exposed wait counts it, so the step's time must too (the split's parts add up to it).
            self.state.timers.total_ns += settle_ns;
        } else {
            run(step, &mut Io::Direct(loader), cache)?;
        }
        Ok(&self.state.logits)
    }
}

/// The model's I/O thread ([`IoThread::start`]).
fn start_io_thread() -> Result<IoThread> {
    IoThread::start().map_err(|cause| Error::Invalid(format!("cannot start the expert I/O thread: {cause}")))
}
