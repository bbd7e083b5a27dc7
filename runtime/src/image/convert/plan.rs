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

/// Checks every tensor of `store` against `cfg` and plans the output.
///
/// # Errors
/// [`Error::MissingTensor`], [`Error::TensorShape`], [`Error::TensorDtype`] naming the file and
/// tensor; [`Error::Invalid`] for a directory that is already converted, a layer with both expert
/// layouts, or a routed-expert tensor that config.json does not account for.
pub(crate) fn plan(cfg: &Config, store: &TensorStore) -> Result<Plan> {
    if cfg.arch() == crate::model::config::Arch::GptOss {
        return super::gpt_oss::plan(cfg, store);
    }
    let (h, i, e) = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts);
    let (hd, nh, nkv) = (cfg.head_dim(), cfg.num_attention_heads, cfg.num_key_value_heads);
    if let Some(&l) = cfg.moe_layers().first() {
        let converted = ExpertTensorNames::new(l, 0).gate_up;
        if store.contains(&converted) {
            return Err(Error::Invalid(format!(
                "{}: already a converted Picchio directory (it has `{converted}`); convert reads a Hugging Face \
                 checkpoint",
                store.dir().display()
            )));
        }
    }
    let mut used: HashSet<String> = HashSet::new();
    let mut units = Vec::new();
    let dense = |units: &mut Vec<Unit>, used: &mut HashSet<String>, name: String, shape: &[usize]| -> Result<()> {
        check(store, &name, shape)?;
        used.insert(name.clone());
        units.push(Unit::Dense(name));
        Ok(())
    };
    dense(&mut units, &mut used, "model.embed_tokens.weight".into(), &[cfg.vocab_size, h])?;
    let mut sources = Vec::with_capacity(cfg.num_hidden_layers);
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        for (name, shape) in [
            (format!("{p}.input_layernorm.weight"), vec![h]),
            (format!("{p}.post_attention_layernorm.weight"), vec![h]),
            (format!("{p}.self_attn.q_proj.weight"), vec![nh * hd, h]),
            (format!("{p}.self_attn.k_proj.weight"), vec![nkv * hd, h]),
            (format!("{p}.self_attn.v_proj.weight"), vec![nkv * hd, h]),
            (format!("{p}.self_attn.o_proj.weight"), vec![h, nh * hd]),
            (format!("{p}.self_attn.q_norm.weight"), vec![hd]),
            (format!("{p}.self_attn.k_norm.weight"), vec![hd]),
        ] {
            dense(&mut units, &mut used, name, &shape)?;
        }
        if !cfg.is_moe_layer(l) {
            let d = cfg.intermediate_size;
            for (name, shape) in [
                (format!("{p}.mlp.gate_proj.weight"), vec![d, h]),
                (format!("{p}.mlp.up_proj.weight"), vec![d, h]),
                (format!("{p}.mlp.down_proj.weight"), vec![h, d]),
            ] {
                dense(&mut units, &mut used, name, &shape)?;
            }
            sources.push(None);
            continue;
        }
        dense(&mut units, &mut used, format!("{p}.mlp.gate.weight"), &[e, h])?;
        let (fgu, fd) = (fused_gate_up(l), fused_down(l));
        let source = if store.contains(&fgu) || store.contains(&fd) {
            check(store, &fgu, &[e, 2 * i, h])?;
            check(store, &fd, &[e, h, i])?;
            if let Some(name) = (0..e).flat_map(|x| per_expert(l, x)).find(|n| store.contains(n)) {
                let t = store.get(&name)?;
                return Err(Error::Invalid(format!(
                    "{}: tensor `{name}`: layer {l} has both fused (`{fgu}`) and per-expert expert tensors",
                    t.path.display()
                )));
            }
            used.insert(fgu);
            used.insert(fd);
            ExpertSource::Fused
        } else {
            for x in 0..e {
                let [g, u, d] = per_expert(l, x);
                check(store, &g, &[i, h])?;
                check(store, &u, &[i, h])?;
                check(store, &d, &[h, i])?;
                used.extend([g, u, d]);
            }
            ExpertSource::PerExpert
        };
        units.extend((0..e).map(|expert| Unit::Expert { layer: l, expert }));
        sources.push(Some(source));
    }
    dense(&mut units, &mut used, "model.norm.weight".into(), &[h])?;
    if !cfg.tie_word_embeddings || store.contains("lm_head.weight") {
        dense(&mut units, &mut used, "lm_head.weight".into(), &[cfg.vocab_size, h])?;
    }
    let mut passthrough: Vec<String> = store.names().filter(|n| !used.contains(*n)).map(String::from).collect();
    passthrough.sort();
    for name in &passthrough {
        if name.starts_with("model.layers.") && name.contains(".mlp.experts.") {
            let t = store.get(name)?;
            return Err(Error::Invalid(format!(
                "{}: unexpected routed-expert tensor `{name}`: config.json (num_experts {e}, num_hidden_layers {}, \
                 mlp_only_layers {:?}, decoder_sparse_step {}) has no such expert",
                t.path.display(),
                cfg.num_hidden_layers,
                cfg.mlp_only_layers,
                cfg.decoder_sparse_step
            )));
        }
        units.push(Unit::Dense(name.clone()));
    }
    if !passthrough.is_empty() {
        let more = if passthrough.len() > 4 { format!(" and {} more", passthrough.len() - 4) } else { String::new() };
        tracing::warn!(
            "{}: {} tensor(s) not used by the qwen3_moe model are copied unchanged: {}{more}",
            store.dir().display(),
            passthrough.len(),
            passthrough[..passthrough.len().min(4)].join(", ")
        );
    }
    Ok(Plan { units, sources, passthrough })
}
