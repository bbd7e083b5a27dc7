//! Chunked prefill ([`super::Model::prefill`]): the prompt runs through the model a chunk of `n`
//! tokens at a time (`--prefill-chunk`, default [`DEFAULT_PREFILL_CHUNK`]), as Picchio (C) does:
//!
//! - every dense projection (q/k/v/o, router, dense MLP) is one matrix–matrix product over the
//!   chunk ([`Kernels::matmul_par`]), so each resident weight row is streamed from RAM once per
//!   chunk instead of once per token;
//! - attention stays per token, causal: the chunk's keys and values are written into the KV cache
//!   first, then the query at position `p` reads positions `first_visible(p)..=p` only (the layer's
//!   sliding window and sinks as in [`super::attention`]; RoPE/YaRN tables one per position);
//! - each MoE layer fetches the **union** of the chunk's routed experts with one
//!   [`ExpertCache::fetch`]: every distinct expert is loaded at most once per chunk and layer, all
//!   misses are submitted to the loader together when the cache can hold them, and each expert's
//!   weights are applied to all the chunk's tokens routed to it at once (Q4/Q3 groups decoded once
//!   per block of tokens). When the union is larger than the cache, `fetch` loads it in batches of
//!   at most the capacity (hits first, then the misses batch by batch), computing every expert of a
//!   batch before the next batch may evict it: still one load per distinct expert, never a thrash,
//!   whatever `--ecap` is (1 included).
//!
//! Each token's expert outputs land in its own `[k, H]` rows at their canonical positions and are
//! summed by [`combine_canonical`] in canonical router order (DESIGN.md, "Determinism"). Since the
//! matrix–matrix kernels compute every output with the instruction sequence of the matrix–vector
//! kernel ([`crate::kernels`], "Matrix-matrix products"), a chunked prefill gives **bit-identical**
//! logits and KV cache to the token-by-token one at any chunk size (tests/tests/prefill.rs).
//!
//! The routing observer sees every token's decision, at chunk granularity: for each MoE layer, the
//! chunk's tokens in position order, then the next layer (see [`RoutingObserver`]).

use picchio_core::ExpertLoader;
use rayon::prelude::*;

use super::attention::{Attention, PAR_ATTENTION_ELEMS};
use super::moe::{activate, combine_canonical, expert_mats, ExpertAct, Routing, RoutingObserver};
use super::rope::Rope;
use super::RouterKind;
use crate::error::Result;
use crate::expert::cache::ExpertCache;
use crate::expert::layout::ExpertLayout;
use crate::kernels::{Kernels, MatRef};
use crate::model::config::Config;

/// Tokens per prefill chunk when `--prefill-chunk` is not given. Picchio (C) uses 64; on the
/// real-geometry Qwen3-30B-A3B model at a 10% expert cache a 512-token prompt prefilled in 75.7 s
/// at 64, 62.1 s at 128, 60.7 s at 256 and 66.4 s at 512 (one sitting, docs/experiments.md): at
/// 256 each MoE layer's union of routed experts is read twice per 512 tokens instead of eight
/// times, and larger chunks are compute-bound.
pub const DEFAULT_PREFILL_CHUNK: usize = 256;

/// Scratch of one prefill chunk of up to `cap` tokens, row `t` = the chunk's token `t` (allocated
/// once per [`super::Model`] and chunk capacity, reused by every chunk).
#[derive(Clone, Debug)]
pub(crate) struct ChunkState {
    /// Tokens it holds room for.
    pub cap: usize,
    /// Residual streams `[cap, H]`.
    pub x: Vec<f32>,
    /// Normalised inputs of the current block `[cap, H]`.
    pub xb: Vec<f32>,
    /// Outputs of the current block `[cap, H]`.
    pub xb2: Vec<f32>,
    /// Queries `[cap, nh*hd]`.
    pub q: Vec<f32>,
    /// Attention outputs `[cap, nh*hd]`.
    pub att_out: Vec<f32>,
    /// Router logits `[cap, E]`.
    pub router_logits: Vec<f32>,
    /// Picked experts `[cap, k]`, canonical order per token.
    pub experts: Vec<u32>,
    /// Their routing weights `[cap, k]`.
    pub weights: Vec<f32>,
    /// Weighted expert outputs `[cap, k, H]`: token `t`'s canonical position `j` at row `t k + j`.
    pub expert_out: Vec<f32>,
    /// Dense MLP gate, then silu(gate) * up `[cap, D]`.
    pub mlp_gate: Vec<f32>,
    /// Dense MLP up `[cap, D]`.
    pub mlp_up: Vec<f32>,
    /// Transposed matmul output `[max rows, cap]` ([`Kernels::matmul`]).
    pub yt: Vec<f32>,
    /// One RoPE table per chunk position.
    pub ropes: Vec<Rope>,
    /// The MoE layer's union of routed experts, ascending ids.
    pub union: Vec<u32>,
    /// Per expert id: users of it in this chunk (then the running fill index).
    pub count: Vec<usize>,
    /// `union[i]`'s users are `users[offsets[i]..offsets[i + 1]]`.
    pub offsets: Vec<usize>,
    /// `(token, canonical position)` of each use, grouped by expert, tokens ascending.
    pub users: Vec<(usize, usize)>,
    /// One expert's inputs gathered `[cap, H]`.
    pub ex_x: Vec<f32>,
    /// Its gate_up outputs `[cap, 2I]`.
    pub ex_gu: Vec<f32>,
    /// Its activations `[cap, I]`.
    pub ex_h: Vec<f32>,
    /// Its outputs `[cap, H]`.
    pub ex_out: Vec<f32>,
}

impl ChunkState {
    /// Scratch for chunks of up to `cap` tokens of `cfg`'s model.
    pub fn new(cfg: &Config, cap: usize) -> ChunkState {
        let (h, hd, e, k) = (cfg.hidden_size, cfg.head_dim(), cfg.num_experts, cfg.num_experts_per_tok);
        let (qd, kvd, i) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.moe_intermediate_size);
        let dense = (0..cfg.num_hidden_layers).any(|l| !cfg.is_moe_layer(l));
        let d = if dense { cfg.intermediate_size } else { 0 };
        let rows = [qd, kvd, h, e, d, 2 * i].into_iter().max().unwrap_or(0);
        let rope = Rope::from_config(hd, &cfg.rope());
        ChunkState {
            cap,
            x: vec![0.0; cap * h],
            xb: vec![0.0; cap * h],
            xb2: vec![0.0; cap * h],
            q: vec![0.0; cap * qd],
            att_out: vec![0.0; cap * qd],
            router_logits: vec![0.0; cap * e],
            experts: vec![0; cap * k],
            weights: vec![0.0; cap * k],
            expert_out: vec![0.0; cap * k * h],
            mlp_gate: vec![0.0; cap * d],
            mlp_up: vec![0.0; cap * d],
            yt: vec![0.0; rows * cap],
            ropes: vec![rope; cap],
            union: Vec::with_capacity(e),
            count: vec![0; e],
            offsets: Vec::with_capacity(e + 1),
            users: Vec::with_capacity(cap * k),
            ex_x: vec![0.0; cap * h],
            ex_gu: vec![0.0; cap * 2 * i],
            ex_h: vec![0.0; cap * i],
            ex_out: vec![0.0; cap * h],
        }
    }
}

/// `out [n, rows]` = W `xs [n, cols]` (token-major in and out) through the transposed matmul
/// output `yt`; each value is bit-identical to `matvec_par(w, xs[t])[r]`.
pub(crate) fn project(k: Kernels, w: MatRef<'_>, xs: &[f32], n: usize, yt: &mut [f32], out: &mut [f32]) {
    let rows = out.len() / n;
    let yt = &mut yt[..rows * n];
    k.matmul_par(w, xs, n, yt);
    for (t, o) in out.chunks_exact_mut(rows.max(1)).enumerate().take(n) {
        for (r, v) in o.iter_mut().enumerate() {
            *v = yt[r * n + t];
        }
    }
}

/// Causal attention of the chunk's `n` queries `q [n, nh*hd]` at positions `pos0..pos0 + n` of layer
/// `l` over the KV cache (which already holds these positions' keys and values) into
/// `out [n, nh*hd]`, one query at a time exactly as the token-by-token forward runs it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_chunk(
    k: Kernels,
    cfg: &Config,
    s: &mut super::RunState,
    l: usize,
    pos0: usize,
    n: usize,
    q: &[f32],
    out: &mut [f32],
    sinks: Option<&[f32]>,
) {
    let hd = cfg.head_dim();
    let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    let (kvd, qd, max_seq) = (nkv * hd, nh * hd, s.max_seq);
    let scale = (hd as f64).powf(-0.5) as f32;
    let (key_cache, value_cache) = (&s.key_cache, &s.value_cache);
    // Query head `hi` of token `t` (work item `t * nh + hi`), exactly as `Attention::run` computes
    // it for that token alone; `att` is score scratch of at least `pos + 1` entries.
    let one = |i: usize, att: &mut [f32], out: &mut [f32]| {
        let (t, hi) = (i / nh, i % nh);
        let pos = pos0 + t;
        let first = Attention::first_visible(pos, cfg.attention_window(l));
        let attn = Attention {
            k,
            keys: &key_cache[(l * max_seq + first) * kvd..(l * max_seq + pos + 1) * kvd],
            values: &value_cache[(l * max_seq + first) * kvd..(l * max_seq + pos + 1) * kvd],
            kvd,
            hd,
            n_rep: nh / nkv,
            scale,
            sinks,
        };
        attn.head(hi, &q[t * qd + hi * hd..t * qd + (hi + 1) * hd], &mut att[..pos + 1 - first], out);
    };
    // One split across the pool for the whole chunk (every token's heads), not one per token.
    let out = &mut out[..n * qd];
    if n * nh * hd * (pos0 + n) >= PAR_ATTENTION_ELEMS {
        out.par_chunks_mut(hd).enumerate().for_each_init(|| vec![0f32; max_seq], |att, (i, o)| one(i, att, o));
    } else {
        out.chunks_mut(hd).enumerate().for_each(|(i, o)| one(i, &mut s.att[..max_seq], o));
    }
}

/// What [`routed_experts_chunk`] needs besides the chunk state.
pub(crate) struct MoeChunk<'a> {
    /// The configuration.
    pub cfg: &'a Config,
    /// The experts' payload layout.
    pub layout: &'a ExpertLayout,
    /// Kernels.
    pub k: Kernels,
    /// Per-token routing scratch (the run state's).
    pub routing: &'a mut Routing,
    /// Expert-usage counts `[L * E]` (the run state's [`RunState::usage`](super::RunState::usage)).
    pub usage: &'a mut [u64],
    /// The routing observer, if any.
    pub observer: &'a mut Option<Box<dyn RoutingObserver>>,
}

/// The routed experts of MoE layer `l` for the chunk's `n` tokens at `pos0..`: routes each token's
/// `cs.router_logits` row, reports it to the observer, fetches the union of the picked experts once
/// (see the module docs), applies each to the `cs.xb` rows of its tokens and sums every token's
/// weighted outputs in canonical order into its `cs.xb2` row. `biases` = the layer's resident
/// `([E, 2I], [E, H])` expert biases (GPT-OSS).
///
/// # Errors
/// As [`ExpertCache::fetch`] and [`expert_mats`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn routed_experts_chunk(
    m: MoeChunk<'_>,
    cs: &mut ChunkState,
    l: usize,
    pos0: usize,
    n: usize,
    router: RouterKind,
    act: ExpertAct,
    biases: Option<(&[f32], &[f32])>,
    cache: &mut ExpertCache,
    loader: &mut dyn ExpertLoader,
) -> Result<()> {
    let (e_n, topk, h) = (m.cfg.num_experts, m.cfg.num_experts_per_tok, m.cfg.hidden_size);
    let (inter, layout, k) = (m.cfg.moe_intermediate_size, m.layout, m.k);
    let i2 = 2 * inter;

    // 1. Route every token (canonical order), and tell the observer.
    for t in 0..n {
        let logits = &cs.router_logits[t * e_n..(t + 1) * e_n];
        match router {
            RouterKind::SoftmaxTopK { norm } => m.routing.route(logits, norm),
            RouterKind::TopKSoftmax => m.routing.route_topk_softmax(logits),
        }
        cs.experts[t * topk..(t + 1) * topk].copy_from_slice(&m.routing.experts);
        cs.weights[t * topk..(t + 1) * topk].copy_from_slice(&m.routing.weights);
        for &e in &m.routing.experts {
            m.usage[l * e_n + e as usize] += 1;
        }
        if let Some(o) = m.observer.as_deref_mut() {
            o.routed(l, pos0 + t, &m.routing.experts, &m.routing.weights);
        }
    }

    // 2. The union of the picked experts (ascending ids) and, per expert, its (token, position) uses.
    cs.count.fill(0);
    for &e in &cs.experts[..n * topk] {
        cs.count[e as usize] += 1;
    }
    cs.union.clear();
    cs.offsets.clear();
    let mut off = 0;
    for (e, c) in cs.count.iter_mut().enumerate() {
        if *c > 0 {
            cs.union.push(e as u32);
            cs.offsets.push(off);
            off += *c;
            *c = off - *c; // from here: the next free index of expert e's users
        }
    }
    cs.offsets.push(off);
    cs.users.clear();
    cs.users.resize(off, (0, 0));
    for t in 0..n {
        for j in 0..topk {
            let e = cs.experts[t * topk + j] as usize;
            cs.users[cs.count[e]] = (t, j);
            cs.count[e] += 1;
        }
    }

    // 3. Each distinct expert once, on all of its tokens; outputs to each token's canonical row.
    let ChunkState { xb, weights, expert_out, yt, union, offsets, users, ex_x, ex_gu, ex_h, ex_out, .. } = cs;
    let (union, offsets, users, xb, weights) = (&*union, &*offsets, &*users, &*xb, &*weights);
    cache.fetch(l as u32, union, loader, &mut |i, payload| {
        let e = union[i] as usize;
        let uses = &users[offsets[i]..offsets[i + 1]];
        let n_e = uses.len();
        for (u, &(t, _)) in uses.iter().enumerate() {
            ex_x[u * h..(u + 1) * h].copy_from_slice(&xb[t * h..(t + 1) * h]);
        }
        let (gate_up, down) = expert_mats(layout, l, payload)?;
        gate_up.project(k, &ex_x[..n_e * h], n_e, yt, &mut ex_gu[..n_e * i2]);
        for u in 0..n_e {
            let gu = &mut ex_gu[u * i2..(u + 1) * i2];
            if let Some((b, _)) = biases {
                gu.iter_mut().zip(&b[e * i2..(e + 1) * i2]).for_each(|(v, b)| *v += b);
            }
            activate(act, gu, &mut ex_h[u * inter..(u + 1) * inter]);
        }
        project(k, down, &ex_h[..n_e * inter], n_e, yt, &mut ex_out[..n_e * h]);
        for (u, &(t, j)) in uses.iter().enumerate() {
            let o = &mut ex_out[u * h..(u + 1) * h];
            if let Some((_, b)) = biases {
                o.iter_mut().zip(&b[e * h..(e + 1) * h]).for_each(|(v, b)| *v += b);
            }
            let w = weights[t * topk + j];
            let row = t * topk + j;
            for (d, &v) in expert_out[row * h..(row + 1) * h].iter_mut().zip(o.iter()) {
                *d = v * w;
            }
        }
        Ok(())
    })?;

    // 4. Each token's sum in canonical order.
    for t in 0..n {
        combine_canonical(&cs.expert_out[t * topk * h..(t + 1) * topk * h], &mut cs.xb2[t * h..(t + 1) * h]);
    }
    Ok(())
}
