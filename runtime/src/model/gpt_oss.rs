//! The GPT-OSS forward pass, as transformers 5.24 `models/gpt_oss/modeling_gpt_oss.py` computes it
//! in f32 (eager attention), built from the shared pieces of [`super`]:
//!
//! ```text
//! x = embed_tokens[token]
//! for each layer l:
//!     h = rmsnorm(x) ; q, k, v = q_proj h + b_q, k_proj h + b_k, v_proj h + b_v   (no QK-norm)
//!     q, k = rope(q), rope(k)               (NeoX halves; YaRN: cos/sin times the attention factor)
//!     o = softmax_with_sink(q k^T / sqrt(head_dim)) v    (GQA; a sliding layer sees the last W positions)
//!     x = x + o_proj o + b_o
//!     h = rmsnorm(x)
//!     r = router h + b_router ; top-k of r, softmax over the k
//!     x = x + sum_j w_j (down_j(swiglu_clamped(gate_up_j h + b_gu_j)) + b_down_j)   (canonical order)
//! logits = lm_head rmsnorm(x)
//! ```
//!
//! Routed experts come through an [`ExpertCache`] from an [`ExpertLoader`] (payload = the Q4/Q3/f32
//! matrices only); their biases `experts.gate_up_proj_bias` `[E, 2I]` and `experts.down_proj_bias`
//! `[E, H]` are resident here.

use std::time::Instant;

use picchio_core::ExpertLoader;

use super::matrix::{add_into, vector, DenseFormat, Matrix};
use super::prefill::{attend_chunk, project, routed_experts_chunk, ChunkState, MoeChunk};
use super::state::Trace;
use super::{Io, RouterKind, Step};
use crate::error::Result;
use crate::expert::cache::ExpertCache;
use crate::kernels::Kernels;
use crate::model::config::Config;
use crate::model::moe::ExpertAct;
use crate::model::source::WeightSource;

/// A projection `y = W x + b` (the bias is absent when `attention_bias` is false).
#[derive(Clone, Debug)]
pub struct Linear {
    /// `weight` `[out, in]`.
    pub weight: Matrix,
    /// `bias` `[out]`.
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    fn load(
        store: &dyn WeightSource,
        name: &str,
        (rows, cols): (usize, usize),
        bias: bool,
        dense: DenseFormat,
    ) -> Result<Linear> {
        let weight = Matrix::load_as(store, &format!("{name}.weight"), rows, cols, dense)?;
        let bias = if bias { Some(vector(store, &format!("{name}.bias"), rows)?) } else { None };
        Ok(Linear { weight, bias })
    }

    /// `ys [n, out] = W xs [n, in] + b` per token (a prefill chunk; `yt` is the transposed
    /// matmul scratch), each row bit-identical to [`Linear::apply`] of that token.
    fn apply_chunk(&self, k: Kernels, xs: &[f32], n: usize, yt: &mut [f32], ys: &mut [f32]) {
        project(k, self.weight.as_mat(), xs, n, yt, ys);
        if let Some(b) = &self.bias {
            for y in ys.chunks_exact_mut(b.len()) {
                add_into(y, b);
            }
        }
    }

    /// `y = W x + b`.
    fn apply(&self, k: Kernels, x: &[f32], y: &mut [f32]) {
        k.matvec_par(self.weight.as_mat(), x, y);
        if let Some(b) = &self.bias {
            add_into(y, b);
        }
    }
}

/// The resident weights of one GPT-OSS decoder layer `model.layers.N`.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// `input_layernorm.weight` `[H]`.
    pub input_layernorm: Vec<f32>,
    /// `self_attn.q_proj` `[nh*hd, H]` (+ bias).
    pub q_proj: Linear,
    /// `self_attn.k_proj` `[nkv*hd, H]` (+ bias).
    pub k_proj: Linear,
    /// `self_attn.v_proj` `[nkv*hd, H]` (+ bias).
    pub v_proj: Linear,
    /// `self_attn.o_proj` `[H, nh*hd]` (+ bias).
    pub o_proj: Linear,
    /// `self_attn.sinks` `[nh]`: one sink logit per query head.
    pub sinks: Vec<f32>,
    /// `post_attention_layernorm.weight` `[H]`.
    pub post_attention_layernorm: Vec<f32>,
    /// `mlp.router` `[E, H]` + bias `[E]`.
    pub router: Linear,
    /// `mlp.experts.gate_up_proj_bias` `[E, 2I]` (interleaved like the gate_up rows).
    pub gate_up_bias: Vec<f32>,
    /// `mlp.experts.down_proj_bias` `[E, H]`.
    pub down_bias: Vec<f32>,
}

/// The resident weights of a GPT-OSS model (everything but the routed experts' matrices).
pub type Weights = super::ModelWeights<LayerWeights>;

impl super::DecoderLayer for LayerWeights {
    /// The attention projections are kept in `dense`; the router stays as stored.
    fn load_layers(store: &dyn WeightSource, cfg: &Config, dense: DenseFormat) -> Result<Vec<LayerWeights>> {
        let (h, hd, e, i) = (cfg.hidden_size, cfg.head_dim(), cfg.num_experts, cfg.moe_intermediate_size);
        let (qd, kvd) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let bias = cfg.attention_bias;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let lin = |n: &str, r, c, b| Linear::load(store, &format!("{p}.{n}"), (r, c), b, dense);
            let flat = |n: &str, len| vector(store, &format!("{p}.{n}"), len);
            layers.push(LayerWeights {
                input_layernorm: flat("input_layernorm.weight", h)?,
                q_proj: lin("self_attn.q_proj", qd, h, bias)?,
                k_proj: lin("self_attn.k_proj", kvd, h, bias)?,
                v_proj: lin("self_attn.v_proj", kvd, h, bias)?,
                o_proj: lin("self_attn.o_proj", h, qd, bias)?,
                sinks: flat("self_attn.sinks", cfg.num_attention_heads)?,
                post_attention_layernorm: flat("post_attention_layernorm.weight", h)?,
                router: lin("mlp.router", e, h, true)?,
                gate_up_bias: matrix_f32(store, &format!("{p}.mlp.experts.gate_up_proj_bias"), e, 2 * i)?,
                down_bias: matrix_f32(store, &format!("{p}.mlp.experts.down_proj_bias"), e, h)?,
            });
        }
        Ok(layers)
    }

    /// Tied when the config says so and the directory has no `lm_head.weight` of its own.
    fn tied(store: &dyn WeightSource, cfg: &Config) -> bool {
        cfg.tie_word_embeddings && !store.contains("lm_head.weight")
    }
}

/// A float tensor `[rows, cols]` widened to f32, row-major.
fn matrix_f32(store: &dyn WeightSource, name: &str, rows: usize, cols: usize) -> Result<Vec<f32>> {
    store.f32_tensor(name, &[rows, cols])
}

/// The GPT-OSS forward pass of `token` at `pos` into `step.s.logits` (module docs;
/// [`super::Model::forward_traced`] checks the token, position and cache first).
pub(crate) fn forward(
    step: Step<'_>,
    w: &Weights,
    token: u32,
    pos: usize,
    cache: &mut ExpertCache,
    io: &mut Io<'_, '_>,
    mut trace: Option<&mut Trace>,
) -> Result<()> {
    let t_step = Instant::now();
    let Step { cfg, layout, k, s, observer } = step;
    let kvd = cfg.num_key_value_heads * cfg.head_dim();
    let eps = cfg.rms_norm_eps as f32;
    let max_seq = s.max_seq;
    let act = ExpertAct::ClampedSwiglu { limit: cfg.swiglu_limit(), alpha: ExpertAct::GPT_OSS_ALPHA };

    s.embed(&w.embed_tokens, token, pos, trace.as_deref_mut());

    for (l, lw) in w.layers.iter().enumerate() {
        // Attention: q, k, v with biases (k and v into this position's KV cache row), RoPE, then
        // the visible window with the layer's sinks.
        let t_attn = Instant::now();
        k.rmsnorm(&mut s.xb, &s.x, &lw.input_layernorm, eps);
        let row = (l * max_seq + pos) * kvd;
        lw.q_proj.apply(k, &s.xb, &mut s.q);
        lw.k_proj.apply(k, &s.xb, &mut s.key_cache[row..row + kvd]);
        lw.v_proj.apply(k, &s.xb, &mut s.value_cache[row..row + kvd]);
        s.rope.apply(&mut s.q);
        s.rope.apply(&mut s.key_cache[row..row + kvd]);
        s.attend(k, cfg, l, pos, Some(&lw.sinks));
        lw.o_proj.apply(k, &s.att_out, &mut s.xb2);
        add_into(&mut s.x, &s.xb2);
        s.timers.attention_ns += t_attn.elapsed().as_nanos() as u64;

        // MoE: router with bias, top-k then softmax, clamped-SwiGLU experts with resident biases
        // (with `--prefetch`, the next layer's router first predicts its experts).
        k.rmsnorm(&mut s.xb, &s.x, &lw.post_attention_layernorm, eps);
        let t_router = Instant::now();
        lw.router.apply(k, &s.xb, &mut s.router_logits);
        s.timers.router_ns += t_router.elapsed().as_nanos() as u64;
        let next = w.layers.get(l + 1);
        let next_router = |k: Kernels, x: &[f32], out: &mut [f32]| {
            if let Some(n) = next {
                n.router.apply(k, x, out)
            }
        };
        let mut step = Step { cfg, layout, k, s: &mut *s, observer: &mut *observer };
        let next_router = next.map(|_| &next_router as &dyn Fn(Kernels, &[f32], &mut [f32]));
        step.predict_next(l, RouterKind::TopKSoftmax, next_router, io);
        step.routed_experts(
            l,
            pos,
            RouterKind::TopKSoftmax,
            act,
            Some((&lw.gate_up_bias, &lw.down_bias)),
            cache,
            io,
            trace.as_deref_mut(),
        )?;
        s.mlp_residual(l, trace.as_deref_mut());
    }

    s.head(k, (&w.norm, eps), w.lm_head(), trace, t_step);
    Ok(())
}

/// The GPT-OSS forward pass of one prefill chunk: `tokens` at positions `pos0..pos0 + n` (see
/// [`super::prefill`]; [`super::Model::prefill`] checks tokens, positions and cache first). The KV
/// cache gets every position of the chunk; when `last`, `step.s.logits` gets the logits after the
/// chunk's last token. Bit-identical to [`forward`] token by token.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prefill_chunk(
    step: Step<'_>,
    cs: &mut ChunkState,
    w: &Weights,
    tokens: &[u32],
    pos0: usize,
    last: bool,
    cache: &mut ExpertCache,
    loader: &mut dyn ExpertLoader,
) -> Result<()> {
    let Step { cfg, layout, k, s, observer } = step;
    let (h, hd, n, e) = (cfg.hidden_size, cfg.head_dim(), tokens.len(), cfg.num_experts);
    let (qd, kvd) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    let eps = cfg.rms_norm_eps as f32;
    let max_seq = s.max_seq;
    let act = ExpertAct::ClampedSwiglu { limit: cfg.swiglu_limit(), alpha: ExpertAct::GPT_OSS_ALPHA };

    for (t, &tok) in tokens.iter().enumerate() {
        w.embed_tokens.row_into(tok as usize, &mut cs.x[t * h..(t + 1) * h]);
        cs.ropes[t].set_pos(pos0 + t);
    }

    for (l, lw) in w.layers.iter().enumerate() {
        // Attention: q, k, v with biases for the chunk (k and v into the chunk's KV cache rows),
        // RoPE per position, then each query over its visible window with the layer's sinks.
        for t in 0..n {
            k.rmsnorm(&mut cs.xb[t * h..(t + 1) * h], &cs.x[t * h..(t + 1) * h], &lw.input_layernorm, eps);
        }
        let rows = (l * max_seq + pos0) * kvd..(l * max_seq + pos0 + n) * kvd;
        let xb = &cs.xb[..n * h];
        lw.q_proj.apply_chunk(k, xb, n, &mut cs.yt, &mut cs.q[..n * qd]);
        lw.k_proj.apply_chunk(k, xb, n, &mut cs.yt, &mut s.key_cache[rows.clone()]);
        lw.v_proj.apply_chunk(k, xb, n, &mut cs.yt, &mut s.value_cache[rows.clone()]);
        let kc = &mut s.key_cache[rows];
        for t in 0..n {
            cs.ropes[t].apply(&mut cs.q[t * qd..(t + 1) * qd]);
            cs.ropes[t].apply(&mut kc[t * kvd..(t + 1) * kvd]);
        }
        attend_chunk(k, cfg, s, l, pos0, n, &cs.q[..n * qd], &mut cs.att_out[..n * qd], Some(&lw.sinks));
        lw.o_proj.apply_chunk(k, &cs.att_out[..n * qd], n, &mut cs.yt, &mut cs.xb2[..n * h]);
        add_into(&mut cs.x[..n * h], &cs.xb2[..n * h]);

        // MoE: router with bias, top-k then softmax, the union of clamped-SwiGLU experts fetched once.
        for t in 0..n {
            k.rmsnorm(&mut cs.xb[t * h..(t + 1) * h], &cs.x[t * h..(t + 1) * h], &lw.post_attention_layernorm, eps);
        }
        lw.router.apply_chunk(k, &cs.xb[..n * h], n, &mut cs.yt, &mut cs.router_logits[..n * e]);
        let m = MoeChunk { cfg, layout, k, routing: &mut s.routing, usage: &mut s.usage, observer: &mut *observer };
        let biases = Some((&lw.gate_up_bias[..], &lw.down_bias[..]));
        routed_experts_chunk(m, cs, l, pos0, n, RouterKind::TopKSoftmax, act, biases, cache, loader)?;
        add_into(&mut cs.x[..n * h], &cs.xb2[..n * h]);
    }

    if last {
        k.rmsnorm(&mut s.xb, &cs.x[(n - 1) * h..n * h], &w.norm, eps);
        k.matvec_par(w.lm_head().as_mat(), &s.xb, &mut s.logits);
    }
    Ok(())
}
