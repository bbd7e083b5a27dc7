//! The run state every architecture's forward pass uses ([`RunState`]: scratch and KV cache,
//! allocated once) and the per-position debug outputs of oracle tests ([`Trace`]).

use crate::model::config::Config;
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
