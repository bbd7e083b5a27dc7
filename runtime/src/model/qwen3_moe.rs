//! The Qwen3-MoE forward pass, declared like llama2.c `run.c`: [`Config`], [`Weights`] (the resident
//! dense part), [`RunState`] (all scratch and the KV cache, allocated once) and [`Model::forward`],
//! which allocates nothing per token (the [`ExpertLoader`] trait takes its request list by value:
//! that one `Vec` per expert batch is the exception).
//!
//! The math is transformers 5.24 `models/qwen3_moe/modeling_qwen3_moe.py` in f32:
//!
//! ```text
//! x = embed_tokens[token]
//! for each layer:
//!     h = rmsnorm(x) ; q, k, v = q_proj h, k_proj h, v_proj h
//!     q, k = per-head rmsnorm(q_norm), rmsnorm(k_norm)      (before RoPE)
//!     q, k = rope(q), rope(k)                                  (NeoX halves)
//!     o = softmax(q k^T / sqrt(head_dim)) v                     (GQA, KV cache)
//!     x = x + o_proj o
//!     h = rmsnorm(x)
//!     x = x + moe(h)      or   x + down(silu(gate h) * up h)    (dense-MLP layers)
//! logits = lm_head rmsnorm(x)
//! ```
//!
//! A layer is MoE unless it is in `mlp_only_layers` or `(l + 1) % decoder_sparse_step != 0`
//! ([`Config::is_moe_layer`]). Routed experts come through an [`ExpertCache`] from an
//! [`ExpertLoader`]; their outputs are summed in canonical router order ([`crate::model::moe`]).

use std::path::Path;
use std::sync::Arc;

use half::bf16;
use picchio_core::ExpertLoader;
use rayon::prelude::*;
use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::expert::cache::ExpertCache;
use crate::expert::layout::{ExpertLayout, SafetensorsExperts};
use crate::kernels::{self, Kernels, MatRef};
use crate::model::config::Config;
use crate::model::moe::{combine_canonical, expert_forward, ExpertScratch, Routing, RoutingObserver};
use crate::model::rope::Rope;
use crate::model::safetensors::{TensorRef, TensorStore};

/// Attention runs its heads on the rayon pool when `heads * positions * head_dim` reaches this.
const PAR_ATTENTION_ELEMS: usize = 1 << 16;

/// A resident weight matrix `[rows, cols]` in the dtype it is stored in.
#[derive(Clone, Debug)]
pub enum Matrix {
    /// Row-major f32 (Picchio (C) attention and router; F16 checkpoints are widened to this).
    F32(Vec<f32>),
    /// Row-major bf16 (Hugging Face checkpoints).
    Bf16(Vec<bf16>),
    /// Row-major i8 with one f32 scale per row, `value = q * scale` (Picchio (C) embeddings and
    /// lm_head: the tensor and its `<name>.qs` `[rows]`).
    I8Rows {
        /// Codes `[rows, cols]`.
        q: Vec<i8>,
        /// Row scales `[rows]`.
        scales: Vec<f32>,
    },
}

impl Matrix {
    /// The kernel view of the matrix.
    pub fn as_mat(&self) -> MatRef<'_> {
        match self {
            Matrix::F32(w) => MatRef::F32(w),
            Matrix::Bf16(w) => MatRef::Bf16(w),
            Matrix::I8Rows { q, scales } => MatRef::I8Rows { q, scales },
        }
    }

    /// Writes row `r` widened to f32 into `out [cols]` (an embedding lookup).
    ///
    /// # Panics
    /// When row `r` does not exist.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let n = out.len();
        let span = r * n..(r + 1) * n;
        match self {
            Matrix::F32(w) => out.copy_from_slice(&w[span]),
            Matrix::Bf16(w) => out.iter_mut().zip(&w[span]).for_each(|(o, v)| *o = v.to_f32()),
            Matrix::I8Rows { q, scales } => {
                let s = scales[r];
                out.iter_mut().zip(&q[span]).for_each(|(o, &v)| *o = f32::from(v) * s);
            }
        }
    }

    /// Reads tensor `name` from `store` as a `[rows, cols]` matrix: F32 and BF16 are kept as they are,
    /// F16 is widened to f32, and I8 takes its row scales from `<name>.qs` (F32 `[rows]`).
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::TensorShape`] or [`Error::TensorDtype`], each naming the
    /// tensor and its file.
    pub fn load(store: &TensorStore, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let t = store.get(name)?;
        t.expect_shape(&[rows, cols])?;
        Ok(match t.dtype {
            Dtype::F32 => Matrix::F32(f32_values(&t)?),
            Dtype::F16 => Matrix::F32(t.to_f32()?),
            Dtype::BF16 => Matrix::Bf16(
                t.bytes.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect(),
            ),
            Dtype::I8 => {
                let qs = store.get(&format!("{name}.qs"))?;
                qs.expect_shape(&[rows])?;
                if qs.dtype != Dtype::F32 {
                    return Err(qs.dtype_error("F32 (row scales of an I8 matrix)"));
                }
                Matrix::I8Rows { q: t.bytes.iter().map(|&b| b as i8).collect(), scales: f32_values(&qs)? }
            }
            _ => return Err(t.dtype_error("F32, BF16, F16, or I8 with a `.qs` row scale")),
        })
    }
}

/// The values of an F32 tensor.
fn f32_values(t: &TensorRef<'_>) -> Result<Vec<f32>> {
    if t.dtype != Dtype::F32 {
        return Err(t.dtype_error("F32"));
    }
    t.to_f32()
}

/// A norm weight `[len]` widened to f32.
fn vector(store: &TensorStore, name: &str, len: usize) -> Result<Vec<f32>> {
    let t = store.get(name)?;
    t.expect_shape(&[len])?;
    t.to_f32()
}

/// The MLP of one decoder layer.
#[derive(Clone, Debug)]
pub enum Mlp {
    /// Routed experts: only the router is resident; the experts stream through the cache.
    Moe {
        /// `mlp.gate.weight` `[E, H]`: router logits = gate · x.
        gate: Matrix,
    },
    /// A dense SwiGLU MLP (`mlp_only_layers`, or off the `decoder_sparse_step`), width `intermediate_size` D.
    Dense {
        /// `mlp.gate_proj.weight` `[D, H]`.
        gate_proj: Matrix,
        /// `mlp.up_proj.weight` `[D, H]`.
        up_proj: Matrix,
        /// `mlp.down_proj.weight` `[H, D]`.
        down_proj: Matrix,
    },
}

/// The resident weights of one decoder layer `model.layers.N`.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// `input_layernorm.weight` `[H]`.
    pub input_layernorm: Vec<f32>,
    /// `self_attn.q_proj.weight` `[nh*hd, H]`.
    pub q_proj: Matrix,
    /// `self_attn.k_proj.weight` `[nkv*hd, H]`.
    pub k_proj: Matrix,
    /// `self_attn.v_proj.weight` `[nkv*hd, H]`.
    pub v_proj: Matrix,
    /// `self_attn.o_proj.weight` `[H, nh*hd]`.
    pub o_proj: Matrix,
    /// `self_attn.q_norm.weight` `[hd]` (per-head RMSNorm of q).
    pub q_norm: Vec<f32>,
    /// `self_attn.k_norm.weight` `[hd]` (per-head RMSNorm of k).
    pub k_norm: Vec<f32>,
    /// `post_attention_layernorm.weight` `[H]`.
    pub post_attention_layernorm: Vec<f32>,
    /// Router or dense MLP.
    pub mlp: Mlp,
}

/// The resident (dense) weights of a Qwen3-MoE model, fetched by Hugging Face tensor name.
#[derive(Clone, Debug)]
pub struct Weights {
    /// `model.embed_tokens.weight` `[V, H]`.
    pub embed_tokens: Matrix,
    /// `model.layers.N.*`, one per decoder layer.
    pub layers: Vec<LayerWeights>,
    /// `model.norm.weight` `[H]`.
    pub norm: Vec<f32>,
    /// `lm_head.weight` `[V, H]`; `None` when `tie_word_embeddings` (embed_tokens is used).
    pub lm_head: Option<Matrix>,
}

impl Weights {
    /// Reads every resident tensor of `cfg`'s model from `store`, checking each shape.
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::TensorShape`], [`Error::TensorDtype`], naming tensor and file.
    pub fn load(store: &TensorStore, cfg: &Config) -> Result<Weights> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        let (qd, kvd) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let mat = |n: &str, r, c| Matrix::load(store, &format!("{p}.{n}"), r, c);
            let mlp = if cfg.is_moe_layer(l) {
                Mlp::Moe { gate: mat("mlp.gate.weight", cfg.num_experts, h)? }
            } else {
                let d = cfg.intermediate_size;
                Mlp::Dense {
                    gate_proj: mat("mlp.gate_proj.weight", d, h)?,
                    up_proj: mat("mlp.up_proj.weight", d, h)?,
                    down_proj: mat("mlp.down_proj.weight", h, d)?,
                }
            };
            layers.push(LayerWeights {
                input_layernorm: vector(store, &format!("{p}.input_layernorm.weight"), h)?,
                q_proj: mat("self_attn.q_proj.weight", qd, h)?,
                k_proj: mat("self_attn.k_proj.weight", kvd, h)?,
                v_proj: mat("self_attn.v_proj.weight", kvd, h)?,
                o_proj: mat("self_attn.o_proj.weight", h, qd)?,
                q_norm: vector(store, &format!("{p}.self_attn.q_norm.weight"), hd)?,
                k_norm: vector(store, &format!("{p}.self_attn.k_norm.weight"), hd)?,
                post_attention_layernorm: vector(store, &format!("{p}.post_attention_layernorm.weight"), h)?,
                mlp,
            });
        }
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(Matrix::load(store, "lm_head.weight", cfg.vocab_size, h)?)
        };
        Ok(Weights {
            embed_tokens: Matrix::load(store, "model.embed_tokens.weight", cfg.vocab_size, h)?,
            layers,
            norm: vector(store, "model.norm.weight", h)?,
            lm_head,
        })
    }

    /// The output projection `[V, H]`: lm_head, or embed_tokens when tied.
    pub fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }
}

/// All scratch of a forward pass and the KV cache, allocated once for `max_seq` positions.
#[derive(Clone, Debug)]
pub struct RunState {
    /// Residual stream `[H]`.
    pub x: Vec<f32>,
    /// Normalised input of the current block `[H]`.
    pub xb: Vec<f32>,
    /// Output of the current block (o_proj, MLP) `[H]`.
    pub xb2: Vec<f32>,
    /// Queries of the current position `[nh*hd]`.
    pub q: Vec<f32>,
    /// Attention scores `[nh, max_seq]`.
    pub att: Vec<f32>,
    /// Attention output before o_proj `[nh*hd]`.
    pub att_out: Vec<f32>,
    /// Keys `[L, max_seq, nkv*hd]` (after k_norm and RoPE).
    pub key_cache: Vec<f32>,
    /// Values `[L, max_seq, nkv*hd]`.
    pub value_cache: Vec<f32>,
    /// RoPE tables.
    pub rope: Rope,
    /// Router logits of the current MoE layer `[E]`.
    pub router_logits: Vec<f32>,
    /// Routing of the current MoE layer (top-k in canonical order).
    pub routing: Routing,
    /// Scratch of one expert.
    pub expert_scratch: ExpertScratch,
    /// Weighted output of each picked expert `[k, H]`, row j = canonical position j.
    pub expert_out: Vec<f32>,
    /// Dense MLP gate(x), then silu(gate) * up `[intermediate_size]` (empty without dense layers).
    pub mlp_gate: Vec<f32>,
    /// Dense MLP up(x) `[intermediate_size]`.
    pub mlp_up: Vec<f32>,
    /// Output logits `[V]`.
    pub logits: Vec<f32>,
    /// Positions the KV cache holds.
    pub max_seq: usize,
}

impl RunState {
    /// Buffers for `cfg` and `max_seq` positions.
    pub fn new(cfg: &Config, max_seq: usize) -> RunState {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        let (nh, kvd) = (cfg.num_attention_heads, cfg.num_key_value_heads * hd);
        let dense = (0..cfg.num_hidden_layers).any(|l| !cfg.is_moe_layer(l));
        let d = if dense { cfg.intermediate_size } else { 0 };
        RunState {
            x: vec![0.0; h],
            xb: vec![0.0; h],
            xb2: vec![0.0; h],
            q: vec![0.0; nh * hd],
            att: vec![0.0; nh * max_seq],
            att_out: vec![0.0; nh * hd],
            key_cache: vec![0.0; cfg.num_hidden_layers * max_seq * kvd],
            value_cache: vec![0.0; cfg.num_hidden_layers * max_seq * kvd],
            rope: Rope::new(hd, cfg.rope_theta()),
            router_logits: vec![0.0; cfg.num_experts],
            routing: Routing::new(cfg.num_experts, cfg.num_experts_per_tok),
            expert_scratch: ExpertScratch::new(cfg.moe_intermediate_size),
            expert_out: vec![0.0; cfg.num_experts_per_tok * h],
            mlp_gate: vec![0.0; d],
            mlp_up: vec![0.0; d],
            logits: vec![0.0; cfg.vocab_size],
            max_seq,
        }
    }
}

/// Debug outputs of one forward pass, for oracle tests (allocated once with [`Trace::new`]; filled
/// by [`Model::forward_traced`] without allocating).
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    /// `L + 1` rows of `[H]`, as transformers' `hidden_states`: 0 = the embedding, `i` in `1..L` =
    /// the residual stream after decoder layer `i - 1`, `L` = after the final norm.
    pub hidden: Vec<Vec<f32>>,
    /// Per decoder layer: the pre-softmax router logits `[E]` of a MoE layer, empty for a dense one.
    pub router_logits: Vec<Vec<f32>>,
    /// Per decoder layer: the picked experts in canonical order `[k]`, empty for a dense layer.
    pub experts: Vec<Vec<u32>>,
    /// Per decoder layer: their routing weights `[k]`, empty for a dense layer.
    pub weights: Vec<Vec<f32>>,
}

impl Trace {
    /// Empty rows shaped for `cfg`.
    pub fn new(cfg: &Config) -> Trace {
        let l = cfg.num_hidden_layers;
        let per_moe = |n: usize| (0..l).map(move |i| if cfg.is_moe_layer(i) { n } else { 0 });
        Trace {
            hidden: vec![vec![0.0; cfg.hidden_size]; l + 1],
            router_logits: per_moe(cfg.num_experts).map(|n| vec![0.0; n]).collect(),
            experts: per_moe(cfg.num_experts_per_tok).map(|n| vec![0; n]).collect(),
            weights: per_moe(cfg.num_experts_per_tok).map(|n| vec![0.0; n]).collect(),
        }
    }
}

/// A loaded Qwen3-MoE model: config, resident weights, expert payload layout and run state.
pub struct Model {
    config: Config,
    store: Arc<TensorStore>,
    layout: ExpertLayout,
    weights: Weights,
    state: RunState,
    kernels: Kernels,
    /// Sees every routing decision (`picchio run --trace`); `None` costs one branch per MoE layer.
    observer: Option<Box<dyn RoutingObserver>>,
}

impl Model {
    /// Loads the model of a converted directory (or a Picchio (C) one): `config.json`
    /// ([`Config::from_dir`]), the safetensors files ([`TensorStore::open`]), the expert payload layout
    /// ([`ExpertLayout::detect`]) and every resident tensor ([`Weights::load`]); the run state holds
    /// `max_seq` positions.
    ///
    /// # Errors
    /// Those of the steps above, and [`Error::BadOption`] when `max_seq` is 0.
    pub fn load(dir: &Path, max_seq: usize) -> Result<Model> {
        if max_seq == 0 {
            return Err(Error::BadOption {
                option: "max_seq",
                value: "0".into(),
                expected: "must be at least 1".into(),
            });
        }
        let config = Config::from_dir(dir)?;
        let store = Arc::new(TensorStore::open(dir)?);
        if let Some(l) = config.moe_layers().first() {
            let hf = [
                format!("model.layers.{l}.mlp.experts.0.gate_proj.weight"),
                format!("model.layers.{l}.mlp.experts.gate_up_proj"),
            ];
            if hf.iter().any(|n| store.contains(n))
                && !store.contains(&format!("model.layers.{l}.mlp.experts.0.gate_up_proj"))
            {
                return Err(Error::Invalid(format!(
                    "{} is a Hugging Face checkpoint (it has `{}`): convert it first with `picchio convert`",
                    dir.display(),
                    hf.iter().find(|n| store.contains(n)).map(String::as_str).unwrap_or_default()
                )));
            }
        }
        let layout = ExpertLayout::detect(&store, &config)?;
        let weights = Weights::load(&store, &config)?;
        let state = RunState::new(&config, max_seq);
        Ok(Model { config, store, layout, weights, state, kernels: Kernels::get(), observer: None })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The payload layout of one routed expert (its [`ExpertLayout::len`] sizes the cache slots).
    pub fn layout(&self) -> &ExpertLayout {
        &self.layout
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        self.store.dir()
    }

    /// The directory's tensors (shared with a [`SafetensorsExperts`] loader).
    pub fn tensors(&self) -> &Arc<TensorStore> {
        &self.store
    }

    /// The logits `[V]` of the last [`Model::forward`] (zeros before the first).
    pub fn logits(&self) -> &[f32] {
        &self.state.logits
    }

    /// The resident weights.
    pub fn weights(&self) -> &Weights {
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

    /// The always-correct loader: experts copied from this directory's safetensors tensors.
    pub fn safetensors_loader(&self) -> SafetensorsExperts {
        SafetensorsExperts::new(Arc::clone(&self.store), self.layout.clone())
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
    /// [`Error::Invalid`] when `token >= vocab_size`, `pos >= max_seq`, the cache was sized for
    /// another payload, or an expert cannot be loaded (naming the expert; see [`ExpertCache::fetch`]).
    pub fn forward_traced(
        &mut self,
        token: u32,
        pos: usize,
        cache: &mut ExpertCache,
        loader: &mut dyn ExpertLoader,
        mut trace: Option<&mut Trace>,
    ) -> Result<&[f32]> {
        let cfg = &self.config;
        let w = &self.weights;
        let k = self.kernels;
        let s = &mut self.state;
        if token as usize >= cfg.vocab_size {
            return Err(Error::OutOfVocabulary { what: "token id", id: u64::from(token), vocab: cfg.vocab_size });
        }
        if pos >= s.max_seq {
            return Err(Error::Invalid(format!("position {pos} is beyond the context of {} positions", s.max_seq)));
        }
        if cache.payload_len() != self.layout.len() {
            return Err(Error::Invalid(format!(
                "the expert cache holds {}-byte payloads, this model's experts are {} bytes",
                cache.payload_len(),
                self.layout.len()
            )));
        }
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let kvd = nkv * hd;
        let n_rep = nh / nkv;
        let eps = cfg.rms_norm_eps as f32;
        let scale = (hd as f64).powf(-0.5) as f32;
        let max_seq = s.max_seq;

        // Embedding.
        w.embed_tokens.row_into(token as usize, &mut s.x);
        if let Some(t) = trace.as_deref_mut() {
            t.hidden[0].copy_from_slice(&s.x);
        }
        s.rope.set_pos(pos);

        for (l, lw) in w.layers.iter().enumerate() {
            // 1. Attention input norm.
            k.rmsnorm(&mut s.xb, &s.x, &lw.input_layernorm, eps);

            // 2. q, k, v; k and v go straight into the KV cache row of this position.
            let row = (l * max_seq + pos) * kvd;
            let kc = &mut s.key_cache[row..row + kvd];
            let vc = &mut s.value_cache[row..row + kvd];
            k.matvec_par(lw.q_proj.as_mat(), &s.xb, &mut s.q);
            k.matvec_par(lw.k_proj.as_mat(), &s.xb, kc);
            k.matvec_par(lw.v_proj.as_mat(), &s.xb, vc);

            // 3. Per-head RMSNorm of q and k (q_norm / k_norm, weight [hd]), before RoPE.
            for qh in s.q.chunks_exact_mut(hd) {
                k.rmsnorm_inplace(qh, &lw.q_norm, eps);
            }
            for kh in kc.chunks_exact_mut(hd) {
                k.rmsnorm_inplace(kh, &lw.k_norm, eps);
            }

            // 4. RoPE (NeoX halves) on q and k.
            s.rope.apply(&mut s.q);
            s.rope.apply(kc);

            // 5. Attention over positions 0..=pos, each query head reading KV head h / n_rep.
            let attn = Attention {
                k,
                keys: &s.key_cache[l * max_seq * kvd..(l * max_seq + pos + 1) * kvd],
                values: &s.value_cache[l * max_seq * kvd..(l * max_seq + pos + 1) * kvd],
                kvd,
                hd,
                n_rep,
                scale,
            };
            // Heads are independent and each is computed by the same code: the split does not
            // change a bit.
            if nh * (pos + 1) * hd >= PAR_ATTENTION_ELEMS {
                let heads = s.att_out.par_chunks_mut(hd).zip(s.att.par_chunks_mut(max_seq)).zip(s.q.par_chunks(hd));
                heads.enumerate().for_each(|(hi, ((out, att), q))| attn.head(hi, q, &mut att[..=pos], out));
            } else {
                let heads = s.att_out.chunks_mut(hd).zip(s.att.chunks_mut(max_seq)).zip(s.q.chunks(hd));
                heads.enumerate().for_each(|(hi, ((out, att), q))| attn.head(hi, q, &mut att[..=pos], out));
            }

            // 6. Output projection and residual.
            k.matvec_par(lw.o_proj.as_mat(), &s.att_out, &mut s.xb2);
            add_into(&mut s.x, &s.xb2);

            // 7. MLP input norm.
            k.rmsnorm(&mut s.xb, &s.x, &lw.post_attention_layernorm, eps);

            // 8. MLP: routed experts or dense SwiGLU, into xb2; then the residual.
            match &lw.mlp {
                Mlp::Moe { gate } => {
                    k.matvec_par(gate.as_mat(), &s.xb, &mut s.router_logits);
                    s.routing.route(&s.router_logits, cfg.norm_topk_prob);
                    if let Some(o) = self.observer.as_deref_mut() {
                        o.routed(l, pos, &s.routing.experts, &s.routing.weights);
                    }
                    if let Some(t) = trace.as_deref_mut() {
                        t.router_logits[l].copy_from_slice(&s.router_logits);
                        t.experts[l].copy_from_slice(&s.routing.experts);
                        t.weights[l].copy_from_slice(&s.routing.weights);
                    }
                    let (xb, layout) = (&s.xb, &self.layout);
                    let (weights, scratch, outs) = (&s.routing.weights, &mut s.expert_scratch, &mut s.expert_out);
                    cache.fetch(l as u32, &s.routing.experts, loader, &mut |i, payload| {
                        expert_forward(k, layout, payload, xb, weights[i], scratch, &mut outs[i * h..(i + 1) * h])
                    })?;
                    combine_canonical(&s.expert_out, &mut s.xb2);
                }
                Mlp::Dense { gate_proj, up_proj, down_proj } => {
                    k.matvec_par(gate_proj.as_mat(), &s.xb, &mut s.mlp_gate);
                    k.matvec_par(up_proj.as_mat(), &s.xb, &mut s.mlp_up);
                    kernels::silu_mul(&mut s.mlp_gate, &s.mlp_up);
                    k.matvec_par(down_proj.as_mat(), &s.mlp_gate, &mut s.xb2);
                }
            }
            add_into(&mut s.x, &s.xb2);
            if let Some(t) = trace.as_deref_mut() {
                if l + 1 < cfg.num_hidden_layers {
                    t.hidden[l + 1].copy_from_slice(&s.x);
                }
            }
        }

        // Final norm and lm_head.
        k.rmsnorm(&mut s.xb, &s.x, &w.norm, eps);
        if let Some(t) = trace {
            t.hidden[cfg.num_hidden_layers].copy_from_slice(&s.xb);
        }
        k.matvec_par(w.lm_head().as_mat(), &s.xb, &mut s.logits);
        Ok(&s.logits)
    }
}

/// One layer's attention at one position: the cached keys and values of positions `0..=pos`.
struct Attention<'a> {
    k: Kernels,
    /// Keys `[pos + 1, nkv*hd]`.
    keys: &'a [f32],
    /// Values `[pos + 1, nkv*hd]`.
    values: &'a [f32],
    kvd: usize,
    hd: usize,
    /// Query heads per KV head.
    n_rep: usize,
    /// `1 / sqrt(head_dim)`.
    scale: f32,
}

impl Attention<'_> {
    /// Query head `hi`: `att[t] = softmax_t(q . key_t * scale)` over `att.len()` positions, then
    /// `out = sum_t att[t] * value_t`, reading KV head `hi / n_rep` (transformers `repeat_kv`).
    fn head(&self, hi: usize, q: &[f32], att: &mut [f32], out: &mut [f32]) {
        let (kvd, hd) = (self.kvd, self.hd);
        let off = (hi / self.n_rep) * hd;
        for (t, a) in att.iter_mut().enumerate() {
            *a = self.k.dot(q, &self.keys[t * kvd + off..t * kvd + off + hd]) * self.scale;
        }
        kernels::softmax_inplace(att);
        out.fill(0.0);
        for (t, &a) in att.iter().enumerate() {
            self.k.axpy(a, &self.values[t * kvd + off..t * kvd + off + hd], out);
        }
    }
}

/// `x[i] += y[i]` (a residual connection; a plain f32 add like transformers' `residual + h`).
fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(name)
    }

    #[test]
    fn loads_picchio_c_directory_with_i8_embeddings() {
        let m = Model::load(&fixture("picchio_c/qwen3_moe"), 8).unwrap();
        assert!(matches!(m.weights().embed_tokens, Matrix::I8Rows { .. }));
        assert!(matches!(m.weights().lm_head(), Matrix::I8Rows { .. }));
        assert!(matches!(m.weights().layers[0].q_proj, Matrix::F32(_)));
        assert_eq!(m.layout().quant, crate::quant::QuantKind::Q4);
    }

    #[test]
    fn forward_checks_token_position_and_cache() {
        let mut m = Model::load(&fixture("picchio_c/qwen3_moe"), 4).unwrap();
        let mut cache = m.new_cache(4).unwrap();
        let mut loader = m.safetensors_loader();
        let e = m.forward(4096, 0, &mut cache, &mut loader).unwrap_err().to_string();
        assert!(e.contains("token id 4096"), "{e}");
        let e = m.forward(1, 4, &mut cache, &mut loader).unwrap_err().to_string();
        assert!(e.contains("position 4"), "{e}");
        let mut other = ExpertCache::new(4, 100).unwrap();
        let e = m.forward(1, 0, &mut other, &mut loader).unwrap_err().to_string();
        assert!(e.contains("100-byte payloads"), "{e}");
        let logits = m.forward(1, 0, &mut cache, &mut loader).unwrap();
        assert_eq!(logits.len(), 4096);
        assert!(logits.iter().all(|v| v.is_finite()));
        assert_eq!((cache.hits(), cache.misses()), (0, 12));
    }

    #[test]
    fn hugging_face_checkpoint_asks_for_convert() {
        let e = Model::load(&fixture("qwen3_moe"), 8).err().unwrap().to_string();
        assert!(e.contains("picchio convert") && e.contains("experts.0.gate_proj.weight"), "{e}");
        let e = Model::load(&fixture("picchio_c/qwen3_moe"), 0).err().unwrap().to_string();
        assert!(e.contains("max_seq"), "{e}");
    }

    #[test]
    fn bad_shape_names_tensor_and_file() {
        let store = TensorStore::open(&fixture("qwen3_moe")).unwrap();
        let e = Matrix::load(&store, "model.norm.weight", 64, 1).unwrap_err().to_string();
        assert!(e.contains("model.norm.weight") && e.contains("safetensors") && e.contains("[64, 1]"), "{e}");
        let e = Matrix::load(&store, "model.layers.0.mlp.experts.0.gate_proj.weight", 64, 64).unwrap();
        assert!(matches!(e, Matrix::Bf16(_)));
    }
}
