//! What a conversion writes: every checkpoint tensor is checked (dtype, shape against config.json)
//! and classified before a byte is written, so a broken checkpoint fails fast and names its file.
//!
//! Qwen3-MoE checkpoint tensors (H hidden, I moe_intermediate_size, E num_experts, V vocab):
//!
//! ```text
//! model.embed_tokens.weight [V,H]   model.norm.weight [H]   lm_head.weight [V,H] (absent when tied)
//! model.layers.L.{input,post_attention}_layernorm.weight [H]
//! model.layers.L.self_attn.q_proj.weight [nh*hd,H]  k_proj/v_proj [nkv*hd,H]  o_proj [H,nh*hd]  q_norm/k_norm [hd]
//! MoE layer:   model.layers.L.mlp.gate.weight [E,H]  (router)
//!              experts, one tensor each:  model.layers.L.mlp.experts.E.{gate,up}_proj.weight [I,H], down_proj.weight [H,I]
//!              or fused (transformers 5):  model.layers.L.mlp.experts.gate_up_proj [E,2I,H], .down_proj [E,H,I]
//! dense layer: model.layers.L.mlp.{gate,up}_proj.weight [intermediate_size,H], down_proj.weight [H,intermediate_size]
//! ```
//!
//! The fused layout is transformers 5's `Qwen3MoeExperts` (`modeling_qwen3_moe.py`): its forward does
//! `gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)`, and its checkpoint conversion
//! (`conversion_mapping.py`, `qwen2_moe`) builds `gate_up_proj` with `MergeModulelist(dim=0)` then
//! `Concatenate(dim=1)`: rows `0..I` of expert `e` are gate_proj, rows `I..2I` are up_proj (not interleaved).

use std::collections::HashSet;

use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::expert::layout::ExpertTensorNames;
use crate::model::config::Config;
use crate::model::safetensors::{TensorRef, TensorStore};

/// Where a MoE layer's routed expert weights come from in the checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertSource {
    /// One tensor per expert and matrix: `model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`
    /// (`[I,H]`, `[I,H]`, `[H,I]`), as the hub checkpoints and transformers 4 write them.
    PerExpert,
    /// transformers 5 fused 3-D tensors: `model.layers.L.mlp.experts.gate_up_proj` `[E, 2I, H]` (gate =
    /// rows `0..I`, up = rows `I..2I`) and `model.layers.L.mlp.experts.down_proj` `[E, H, I]`.
    Fused,
    /// GPT-OSS, openai's MXFP4 layout: `experts.{gate_up,down}_proj_{blocks,scales}` (see
    /// [`super::mxfp4`]), gate_up output rows interleaved (even gate, odd up).
    Mxfp4,
    /// GPT-OSS, transformers' layout: `experts.gate_up_proj` `[E, H, 2I]` and `experts.down_proj`
    /// `[E, I, H]` in `x @ W` orientation, gate = columns `0::2`, up = columns `1::2`.
    FusedTransposed,
}

/// One unit of output: a tensor copied unchanged, or one routed expert's four tensors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Unit {
    /// A checkpoint tensor copied with its dtype and shape.
    Dense(String),
    /// The routed expert `(layer, expert)`, quantized.
    Expert {
        /// Decoder layer.
        layer: usize,
        /// Expert index.
        expert: usize,
    },
}

/// The checked plan of a conversion.
pub(crate) struct Plan {
    /// Output units in model order (embeddings, then layer by layer, then final norm and lm_head,
    /// then tensors the model does not use, by name).
    pub units: Vec<Unit>,
    /// Per layer: where its experts come from (`None` for a dense-MLP layer).
    pub sources: Vec<Option<ExpertSource>>,
    /// Tensors the model does not use, copied through unchanged.
    pub passthrough: Vec<String>,
}

/// Name of the fused gate_up tensor of a layer (transformers 5).
pub(crate) fn fused_gate_up(layer: usize) -> String {
    format!("model.layers.{layer}.mlp.experts.gate_up_proj")
}

/// Name of the fused down tensor of a layer (transformers 5).
pub(crate) fn fused_down(layer: usize) -> String {
    format!("model.layers.{layer}.mlp.experts.down_proj")
}

/// Names of one expert's three matrices in a per-expert checkpoint: gate, up, down.
pub(crate) fn per_expert(layer: usize, expert: usize) -> [String; 3] {
    let p = format!("model.layers.{layer}.mlp.experts.{expert}");
    [format!("{p}.gate_proj.weight"), format!("{p}.up_proj.weight"), format!("{p}.down_proj.weight")]
}

/// Fails unless the tensor is F32, BF16 or F16 (the dtypes a checkpoint's weights may have).
pub(crate) fn check_float(t: &TensorRef<'_>) -> Result<()> {
    match t.dtype {
        Dtype::F32 | Dtype::BF16 | Dtype::F16 => Ok(()),
        _ => Err(t.dtype_error("F32, BF16 or F16")),
    }
}

/// Fails unless tensor `name` exists, is F32/BF16/F16 and has `shape`.
pub(crate) fn check(store: &TensorStore, name: &str, shape: &[usize]) -> Result<()> {
    let t = store.get(name)?;
    check_float(&t)?;
    t.expect_shape(shape)?;
    Ok(())
}

/// Fails when `store` already holds `converted` (a routed-expert tensor of a converted directory).
pub(crate) fn refuse_converted(store: &TensorStore, converted: &str) -> Result<()> {
    if store.contains(converted) {
        return Err(Error::AlreadyConverted { dir: store.dir().into(), tensor: converted.into() });
    }
    Ok(())
}

/// A plan being built, family by family: the units in model order and the checkpoint tensors they
/// account for.
pub(crate) struct PlanBuilder<'a> {
    store: &'a TensorStore,
    used: HashSet<String>,
    units: Vec<Unit>,
    sources: Vec<Option<ExpertSource>>,
}

impl<'a> PlanBuilder<'a> {
    /// An empty plan over `store` whose first unit is the embedding `[vocab_size, hidden_size]`.
    ///
    /// # Errors
    /// As [`check`].
    pub(crate) fn new(store: &'a TensorStore, cfg: &Config) -> Result<PlanBuilder<'a>> {
        let sources = Vec::with_capacity(cfg.num_hidden_layers);
        let mut b = PlanBuilder { store, used: HashSet::new(), units: Vec::new(), sources };
        b.dense("model.embed_tokens.weight".into(), &[cfg.vocab_size, cfg.hidden_size])?;
        Ok(b)
    }

    /// Checks the dense tensor `name` against `shape` ([`check`]) and plans its copy.
    ///
    /// # Errors
    /// As [`check`].
    pub(crate) fn dense(&mut self, name: String, shape: &[usize]) -> Result<()> {
        check(self.store, &name, shape)?;
        self.used.insert(name.clone());
        self.units.push(Unit::Dense(name));
        Ok(())
    }

    /// Plans layer `l`'s two norms and four attention projections, which every family has:
    /// `{input,post_attention}_layernorm.weight [H]`, `self_attn.{q,k,v}_proj.weight
    /// [nh*hd or nkv*hd, H]` and `self_attn.o_proj.weight [H, nh*hd]`.
    ///
    /// # Errors
    /// As [`check`].
    pub(crate) fn attention(&mut self, cfg: &Config, l: usize) -> Result<()> {
        let (h, hd, nh, nkv) = (cfg.hidden_size, cfg.head_dim(), cfg.num_attention_heads, cfg.num_key_value_heads);
        let p = format!("model.layers.{l}");
        for (name, shape) in [
            (format!("{p}.input_layernorm.weight"), vec![h]),
            (format!("{p}.post_attention_layernorm.weight"), vec![h]),
            (format!("{p}.self_attn.q_proj.weight"), vec![nh * hd, h]),
            (format!("{p}.self_attn.k_proj.weight"), vec![nkv * hd, h]),
            (format!("{p}.self_attn.v_proj.weight"), vec![nkv * hd, h]),
            (format!("{p}.self_attn.o_proj.weight"), vec![h, nh * hd]),
        ] {
            self.dense(name, &shape)?;
        }
        Ok(())
    }

    /// The next layer: its `experts` routed experts read from `source` (tensors `names`, already
    /// checked), or a dense-MLP layer when `source` is `None`.
    pub(crate) fn layer(&mut self, l: usize, experts: usize, source: Option<ExpertSource>, names: Vec<String>) {
        self.used.extend(names);
        if source.is_some() {
            self.units.extend((0..experts).map(|expert| Unit::Expert { layer: l, expert }));
        }
        self.sources.push(source);
    }

    /// The plan: the final norm and lm_head (unless tied and absent), then every tensor not
    /// accounted for, by name, copied through unchanged after `unexpected` has refused the
    /// routed-expert ones config.json does not account for (it gets each name); a warning names the
    /// copied tensors and the `model_type`.
    ///
    /// # Errors
    /// As [`check`], or the error of `unexpected`.
    pub(crate) fn finish(mut self, cfg: &Config, unexpected: impl Fn(&str) -> Result<()>) -> Result<Plan> {
        let h = cfg.hidden_size;
        self.dense("model.norm.weight".into(), &[h])?;
        if !cfg.tie_word_embeddings || self.store.contains("lm_head.weight") {
            self.dense("lm_head.weight".into(), &[cfg.vocab_size, h])?;
        }
        let mut passthrough: Vec<String> =
            self.store.names().filter(|n| !self.used.contains(*n)).map(String::from).collect();
        passthrough.sort();
        for name in &passthrough {
            unexpected(name)?;
            self.units.push(Unit::Dense(name.clone()));
        }
        if !passthrough.is_empty() {
            let more =
                if passthrough.len() > 4 { format!(" and {} more", passthrough.len() - 4) } else { String::new() };
            tracing::warn!(
                "{}: {} tensor(s) not used by the {} model are copied unchanged: {}{more}",
                self.store.dir().display(),
                passthrough.len(),
                cfg.arch().model_type(),
                passthrough[..passthrough.len().min(4)].join(", ")
            );
        }
        Ok(Plan { units: self.units, sources: self.sources, passthrough })
    }
}

/// Checks every tensor of `store` against `cfg` and plans the output.
///
/// # Errors
/// [`Error::MissingTensor`], [`Error::TensorShape`], [`Error::TensorDtype`] naming the file and
/// tensor; [`Error::AlreadyConverted`] for a directory that is already converted,
/// [`Error::MixedExpertTensors`] for a layer with both expert layouts, or
/// [`Error::UnexpectedExpertTensor`] for a routed-expert tensor that config.json does not account for.
pub(crate) fn plan(cfg: &Config, store: &TensorStore) -> Result<Plan> {
    if cfg.arch() == crate::model::config::Arch::GptOss {
        return super::gpt_oss::plan(cfg, store);
    }
    let (h, i, e, hd) = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.head_dim());
    if let Some(&l) = cfg.moe_layers().first() {
        refuse_converted(store, &ExpertTensorNames::new(l, 0).gate_up)?;
    }
    let mut b = PlanBuilder::new(store, cfg)?;
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        b.attention(cfg, l)?;
        b.dense(format!("{p}.self_attn.q_norm.weight"), &[hd])?;
        b.dense(format!("{p}.self_attn.k_norm.weight"), &[hd])?;
        if !cfg.is_moe_layer(l) {
            let d = cfg.intermediate_size;
            for (name, shape) in [
                (format!("{p}.mlp.gate_proj.weight"), vec![d, h]),
                (format!("{p}.mlp.up_proj.weight"), vec![d, h]),
                (format!("{p}.mlp.down_proj.weight"), vec![h, d]),
            ] {
                b.dense(name, &shape)?;
            }
            b.layer(l, e, None, Vec::new());
            continue;
        }
        b.dense(format!("{p}.mlp.gate.weight"), &[e, h])?;
        let (fgu, fd) = (fused_gate_up(l), fused_down(l));
        let (source, names) = if store.contains(&fgu) || store.contains(&fd) {
            check(store, &fgu, &[e, 2 * i, h])?;
            check(store, &fd, &[e, h, i])?;
            if let Some(name) = (0..e).flat_map(|x| per_expert(l, x)).find(|n| store.contains(n)) {
                let t = store.get(&name)?;
                return Err(Error::MixedExpertTensors { path: t.path.into(), name, layer: l, fused: fgu });
            }
            (ExpertSource::Fused, vec![fgu, fd])
        } else {
            let mut names = Vec::with_capacity(3 * e);
            for x in 0..e {
                let [g, u, d] = per_expert(l, x);
                check(store, &g, &[i, h])?;
                check(store, &u, &[i, h])?;
                check(store, &d, &[h, i])?;
                names.extend([g, u, d]);
            }
            (ExpertSource::PerExpert, names)
        };
        b.layer(l, e, Some(source), names);
    }
    b.finish(cfg, |name| {
        if name.starts_with("model.layers.") && name.contains(".mlp.experts.") {
            let t = store.get(name)?;
            return Err(Error::UnexpectedExpertTensor {
                path: t.path.into(),
                name: name.to_string(),
                config: format!(
                    "num_experts {e}, num_hidden_layers {}, mlp_only_layers {:?}, decoder_sparse_step {}",
                    cfg.num_hidden_layers, cfg.mlp_only_layers, cfg.decoder_sparse_step
                ),
            });
        }
        Ok(())
    })
}
