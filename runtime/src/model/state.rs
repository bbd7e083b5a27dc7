//! The run state every architecture's forward pass uses ([`RunState`]: scratch and KV cache,
//! allocated once) and the per-position debug outputs of oracle tests ([`Trace`]).

use std::time::Instant;

use crate::kernels::Kernels;
use crate::model::attention::Attention;
use crate::model::config::Config;
use crate::model::matrix::{add_into, Matrix};
use crate::model::moe::{ExpertScratch, Routing};
use crate::model::rope::Rope;

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
    /// The next MoE layer's router logits predicted from this layer's hidden state `[E]`
    /// (`--prefetch`).
    pub next_logits: Vec<f32>,
    /// The next MoE layer's predicted routing (`--prefetch`).
    pub next_routing: Routing,
    /// Where the forward passes' time went.
    pub timers: StepTimers,
    /// Expert-usage counts `[L * E]`: how many tokens each (layer, expert) was routed to, prompt
    /// and generated tokens alike (dense layers stay 0); what `--usage-out` saves
    /// ([`crate::expert::usage`]).
    pub usage: Vec<u64>,
}

/// Where the decode forward passes' ([`Model::forward`](super::Model::forward)) time went,
/// nanoseconds summed over passes (prefill chunks are not counted). Each is wall time on the
/// forward pass's thread, so with the exposed I/O wait
/// ([`ExpertCache::io_wait_ns`](crate::expert::cache::ExpertCache::io_wait_ns)) they add up to at
/// most the passes' wall time; the rest is norms, embeddings, residuals and the cache's own work.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StepTimers {
    /// Decode forward passes timed.
    pub steps: u64,
    /// Attention: the input norm, q/k/v projections, q/k norms, RoPE, attention over the KV cache
    /// and the output projection.
    pub attention_ns: u64,
    /// Routers: router logits, top-k, and the next layer's predicted routing (`--prefetch`).
    pub router_ns: u64,
    /// Routed experts' compute (gate_up, activation, down, weighting), read waits excluded.
    pub experts_ns: u64,
    /// Dense MLPs (`mlp_only_layers`).
    pub dense_mlp_ns: u64,
    /// Final norm and lm_head.
    pub lm_head_ns: u64,
    /// Whole forward passes.
    pub total_ns: u64,
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
            rope: Rope::from_config(hd, &cfg.rope()),
            router_logits: vec![0.0; cfg.num_experts],
            routing: Routing::new(cfg.num_experts, cfg.num_experts_per_tok),
            expert_scratch: ExpertScratch::new(cfg.moe_intermediate_size),
            expert_out: vec![0.0; cfg.num_experts_per_tok * h],
            mlp_gate: vec![0.0; d],
            mlp_up: vec![0.0; d],
            logits: vec![0.0; cfg.vocab_size],
            max_seq,
            next_logits: vec![0.0; cfg.num_experts],
            next_routing: Routing::new(cfg.num_experts, cfg.num_experts_per_tok),
            timers: StepTimers::default(),
            usage: vec![0; cfg.num_hidden_layers * cfg.num_experts],
        }
    }
}

/// The steps every architecture's decode forward pass shares around its own attention and MLP.
impl RunState {
    /// The pass's start: the embedding of `token` into `x` (and the trace's row 0), the RoPE tables
    /// at `pos`.
    pub(crate) fn embed(&mut self, embed_tokens: &Matrix, token: u32, pos: usize, trace: Option<&mut Trace>) {
        embed_tokens.row_into(token as usize, &mut self.x);
        if let Some(t) = trace {
            t.hidden[0].copy_from_slice(&self.x);
        }
        self.rope.set_pos(pos);
    }

    /// Layer `l`'s attention of the query `q` at `pos` over the visible KV cache rows (all of
    /// `0..=pos`, or the layer's window), each query head reading KV head `h / n_rep`, with the
    /// layer's `sinks` if any, into `att_out`.
    pub(crate) fn attend(&mut self, k: Kernels, cfg: &Config, l: usize, pos: usize, sinks: Option<&[f32]>) {
        let (hd, max_seq) = (cfg.head_dim(), self.max_seq);
        let kvd = cfg.num_key_value_heads * hd;
        let first = Attention::first_visible(pos, cfg.attention_window(l));
        let rows = (l * max_seq + first) * kvd..(l * max_seq + pos + 1) * kvd;
        let attn = Attention {
            k,
            keys: &self.key_cache[rows.clone()],
            values: &self.value_cache[rows],
            kvd,
            hd,
            n_rep: cfg.num_attention_heads / cfg.num_key_value_heads,
            scale: (hd as f64).powf(-0.5) as f32,
            sinks,
        };
        attn.run(&self.q, &mut self.att, max_seq, &mut self.att_out);
    }

    /// The end of decoder layer `l`: the MLP's residual `x += xb2`, and the trace's row `l + 1`
    /// (the last layer's row is the final norm's, written by [`RunState::head`]).
    pub(crate) fn mlp_residual(&mut self, l: usize, trace: Option<&mut Trace>) {
        add_into(&mut self.x, &self.xb2);
        if let Some(t) = trace {
            if l + 2 < t.hidden.len() {
                t.hidden[l + 1].copy_from_slice(&self.x);
            }
        }
    }

    /// The pass's end: the final norm (`norm`, `eps`) into `xb` (and the trace's last row), the
    /// logits `lm_head xb`, and the timers of a pass started at `t_step`.
    pub(crate) fn head(
        &mut self,
        k: Kernels,
        (norm, eps): (&[f32], f32),
        lm_head: &Matrix,
        trace: Option<&mut Trace>,
        t_step: Instant,
    ) {
        let t_head = Instant::now();
        k.rmsnorm(&mut self.xb, &self.x, norm, eps);
        if let Some(t) = trace {
            t.hidden.last_mut().expect("a trace has L + 1 rows").copy_from_slice(&self.xb);
        }
        k.matvec_par(lm_head.as_mat(), &self.xb, &mut self.logits);
        self.timers.lm_head_ns += t_head.elapsed().as_nanos() as u64;
        self.timers.total_ns += t_step.elapsed().as_nanos() as u64;
        self.timers.steps += 1;
    }
}

/// Debug outputs of one forward pass, for oracle tests (allocated once with [`Trace::new`]; filled
/// by [`Model::forward_traced`](super::Model::forward_traced) without allocating).
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
