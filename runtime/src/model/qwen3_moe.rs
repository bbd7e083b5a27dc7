//! The Qwen3-MoE forward pass, declared like llama2.c `run.c`: [`Config`], [`Weights`] (the resident
//! dense part), [`RunState`] (all scratch and the KV cache, allocated once) and [`forward`] (run by
//! [`super::Model::forward`]), which allocates nothing per token (the [`ExpertLoader`] trait takes
//! its request list by value: that one `Vec` per expert batch is the exception).
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

use std::time::Instant;

use picchio_core::ExpertLoader;

use super::matrix::{add_into, vector, DenseFormat};
use super::prefill::{attend_chunk, project, routed_experts_chunk, ChunkState, MoeChunk};
use super::{Io, RouterKind, Step};
use crate::error::Result;
use crate::expert::cache::ExpertCache;
use crate::kernels::{self, Kernels};
use crate::model::config::Config;
use crate::model::moe::ExpertAct;
use crate::model::source::WeightSource;

pub use super::matrix::Matrix;
pub use super::state::{RunState, Trace};

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
pub type Weights = super::ModelWeights<LayerWeights>;

impl super::DecoderLayer for LayerWeights {
    /// The attention and dense-MLP projections are kept in `dense`.
    fn load_layers(store: &dyn WeightSource, cfg: &Config, dense: DenseFormat) -> Result<Vec<LayerWeights>> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        let (qd, kvd) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let mat = |n: &str, r, c| Matrix::load_as(store, &format!("{p}.{n}"), r, c, dense);
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
        Ok(layers)
    }
}

/// The Qwen3-MoE forward pass of `token` at `pos` into `step.s.logits` (see the module docs and
/// [`super::Model::forward_traced`], which checks the token, position and cache first).
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
    let hd = cfg.head_dim();
    let kvd = cfg.num_key_value_heads * hd;
    let eps = cfg.rms_norm_eps as f32;
    let max_seq = s.max_seq;

    // Embedding.
    s.embed(&w.embed_tokens, token, pos, trace.as_deref_mut());

    for (l, lw) in w.layers.iter().enumerate() {
        // 1. Attention input norm.
        let t_attn = Instant::now();
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

        // 5. Attention over the visible positions (all of 0..=pos, or the layer's window), each query
        //    head reading KV head h / n_rep.
        s.attend(k, cfg, l, pos, None);

        // 6. Output projection and residual.
        k.matvec_par(lw.o_proj.as_mat(), &s.att_out, &mut s.xb2);
        add_into(&mut s.x, &s.xb2);
        s.timers.attention_ns += t_attn.elapsed().as_nanos() as u64;

        // 7. MLP input norm.
        k.rmsnorm(&mut s.xb, &s.x, &lw.post_attention_layernorm, eps);

        // 8. MLP: routed experts or dense SwiGLU, into xb2; then the residual. With `--prefetch`,
        //    the next layer's router first predicts its experts from this hidden state, so their
        //    reads queue behind this layer's misses.
        match &lw.mlp {
            Mlp::Moe { gate } => {
                let t_router = Instant::now();
                k.matvec_par(gate.as_mat(), &s.xb, &mut s.router_logits);
                s.timers.router_ns += t_router.elapsed().as_nanos() as u64;
                let router = RouterKind::SoftmaxTopK { norm: cfg.norm_topk_prob };
                let next_gate = match w.layers.get(l + 1).map(|n| &n.mlp) {
                    Some(Mlp::Moe { gate }) => Some(gate),
                    _ => None,
                };
                let next_router = |k: Kernels, x: &[f32], out: &mut [f32]| {
                    if let Some(g) = next_gate {
                        k.matvec_par(g.as_mat(), x, out)
                    }
                };
                let mut step = Step { cfg, layout, k, s: &mut *s, observer: &mut *observer };
                step.predict_next(
                    l,
                    router,
                    next_gate.map(|_| &next_router as &dyn Fn(Kernels, &[f32], &mut [f32])),
                    io,
                );
                step.routed_experts(l, pos, router, ExpertAct::Silu, None, cache, io, trace.as_deref_mut())?;
            }
            Mlp::Dense { gate_proj, up_proj, down_proj } => {
                let t_mlp = Instant::now();
                k.matvec_par(gate_proj.as_mat(), &s.xb, &mut s.mlp_gate);
                k.matvec_par(up_proj.as_mat(), &s.xb, &mut s.mlp_up);
                kernels::silu_mul(&mut s.mlp_gate, &s.mlp_up);
                k.matvec_par(down_proj.as_mat(), &s.mlp_gate, &mut s.xb2);
                s.timers.dense_mlp_ns += t_mlp.elapsed().as_nanos() as u64;
            }
        }
        s.mlp_residual(l, trace.as_deref_mut());
    }

    // Final norm and lm_head.
    s.head(k, (&w.norm, eps), w.lm_head(), trace, t_step);
    Ok(())
}

/// The Qwen3-MoE forward pass of one prefill chunk: `tokens` at positions `pos0..pos0 + n` (see
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
    let (h, hd, n) = (cfg.hidden_size, cfg.head_dim(), tokens.len());
    let (qd, kvd) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    let eps = cfg.rms_norm_eps as f32;
    let max_seq = s.max_seq;

    // Embeddings, and one RoPE table per position.
    for (t, &tok) in tokens.iter().enumerate() {
        w.embed_tokens.row_into(tok as usize, &mut cs.x[t * h..(t + 1) * h]);
        cs.ropes[t].set_pos(pos0 + t);
    }

    for (l, lw) in w.layers.iter().enumerate() {
        // 1. Attention input norm, per token.
        for t in 0..n {
            k.rmsnorm(&mut cs.xb[t * h..(t + 1) * h], &cs.x[t * h..(t + 1) * h], &lw.input_layernorm, eps);
        }

        // 2. q, k, v for the whole chunk; k and v straight into the chunk's KV cache rows.
        let rows = (l * max_seq + pos0) * kvd..(l * max_seq + pos0 + n) * kvd;
        let xb = &cs.xb[..n * h];
        project(k, lw.q_proj.as_mat(), xb, n, &mut cs.yt, &mut cs.q[..n * qd]);
        project(k, lw.k_proj.as_mat(), xb, n, &mut cs.yt, &mut s.key_cache[rows.clone()]);
        project(k, lw.v_proj.as_mat(), xb, n, &mut cs.yt, &mut s.value_cache[rows.clone()]);

        // 3-4. Per-head q/k RMSNorm, then RoPE at each token's position.
        let kc = &mut s.key_cache[rows];
        for t in 0..n {
            let (q, kt) = (&mut cs.q[t * qd..(t + 1) * qd], &mut kc[t * kvd..(t + 1) * kvd]);
            for qh in q.chunks_exact_mut(hd) {
                k.rmsnorm_inplace(qh, &lw.q_norm, eps);
            }
            for kh in kt.chunks_exact_mut(hd) {
                k.rmsnorm_inplace(kh, &lw.k_norm, eps);
            }
            cs.ropes[t].apply(q);
            cs.ropes[t].apply(kt);
        }

        // 5. Causal attention, one query at a time over the cache (the chunk's rows included).
        attend_chunk(k, cfg, s, l, pos0, n, &cs.q[..n * qd], &mut cs.att_out[..n * qd], None);

        // 6. Output projection and residual.
        project(k, lw.o_proj.as_mat(), &cs.att_out[..n * qd], n, &mut cs.yt, &mut cs.xb2[..n * h]);
        add_into(&mut cs.x[..n * h], &cs.xb2[..n * h]);

        // 7. MLP input norm.
        for t in 0..n {
            k.rmsnorm(&mut cs.xb[t * h..(t + 1) * h], &cs.x[t * h..(t + 1) * h], &lw.post_attention_layernorm, eps);
        }

        // 8. MLP for the chunk: routed experts (the union fetched once) or dense SwiGLU; residual.
        match &lw.mlp {
            Mlp::Moe { gate } => {
                let e = cfg.num_experts;
                project(k, gate.as_mat(), &cs.xb[..n * h], n, &mut cs.yt, &mut cs.router_logits[..n * e]);
                let m =
                    MoeChunk { cfg, layout, k, routing: &mut s.routing, usage: &mut s.usage, observer: &mut *observer };
                let router = RouterKind::SoftmaxTopK { norm: cfg.norm_topk_prob };
                routed_experts_chunk(m, cs, l, pos0, n, router, ExpertAct::Silu, None, cache, loader)?;
            }
            Mlp::Dense { gate_proj, up_proj, down_proj } => {
                let d = cfg.intermediate_size;
                let xb = &cs.xb[..n * h];
                project(k, gate_proj.as_mat(), xb, n, &mut cs.yt, &mut cs.mlp_gate[..n * d]);
                project(k, up_proj.as_mat(), xb, n, &mut cs.yt, &mut cs.mlp_up[..n * d]);
                kernels::silu_mul(&mut cs.mlp_gate[..n * d], &cs.mlp_up[..n * d]);
                project(k, down_proj.as_mat(), &cs.mlp_gate[..n * d], n, &mut cs.yt, &mut cs.xb2[..n * h]);
            }
        }
        add_into(&mut cs.x[..n * h], &cs.xb2[..n * h]);
    }

    // Final norm and lm_head of the prompt's last token only.
    if last {
        k.rmsnorm(&mut s.xb, &cs.x[(n - 1) * h..n * h], &w.norm, eps);
        k.matvec_par(w.lm_head().as_mat(), &s.xb, &mut s.logits);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture;
    use crate::model::{dir::ModelDir, safetensors::TensorStore, Model};

    #[test]
    fn loads_picchio_c_directory_with_i8_embeddings() {
        let m = Model::load(&ModelDir::open(&fixture("picchio_c/qwen3_moe")).unwrap(), 8).unwrap();
        assert!(matches!(m.weights().embed_tokens(), Matrix::I8Rows { .. }));
        assert!(matches!(m.weights().lm_head(), Matrix::I8Rows { .. }));
        assert!(matches!(m.weights().qwen3_moe().unwrap().layers[0].q_proj, Matrix::F32(_)));
        assert_eq!(m.layout().quant, crate::quant::QuantKind::Q4);
    }

    #[test]
    fn forward_checks_token_position_and_cache() {
        let mut m = Model::load(&ModelDir::open(&fixture("picchio_c/qwen3_moe")).unwrap(), 4).unwrap();
        let mut cache = m.new_cache(4).unwrap();
        let mut loader = m.in_place_loader();
        let e = m.forward(4096, 0, &mut cache, &mut loader).unwrap_err().to_string();
        assert!(e.contains("token id 4096"), "{e}");
        let e = m.forward(1, 4, &mut cache, &mut loader).unwrap_err().to_string();
        assert!(e.contains("position 4"), "{e}");
        let mut other = crate::expert::cache::ExpertCache::new(4, 100).unwrap();
        let e = m.forward(1, 0, &mut other, &mut loader).unwrap_err().to_string();
        assert!(e.contains("100-byte payloads"), "{e}");
        let logits = m.forward(1, 0, &mut cache, &mut loader).unwrap();
        assert_eq!(logits.len(), 4096);
        assert!(logits.iter().all(|v| v.is_finite()));
        assert_eq!((cache.hits(), cache.misses()), (0, 12));
    }

    #[test]
    fn hugging_face_checkpoint_asks_for_convert() {
        let e = Model::load(&ModelDir::open(&fixture("qwen3_moe")).unwrap(), 8).err().unwrap().to_string();
        assert!(e.contains("picchio convert") && e.contains("experts.0.gate_proj.weight"), "{e}");
        let e = Model::load(&ModelDir::open(&fixture("picchio_c/qwen3_moe")).unwrap(), 0).err().unwrap().to_string();
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
