//! The GPT-OSS checkpoint layouts `picchio convert` reads (H hidden, I intermediate_size, E
//! num_local_experts, V vocab; all BF16 unless noted):
//!
//! ```text
//! model.embed_tokens.weight [V,H]   lm_head.weight [V,H]   model.norm.weight [H]
//! model.layers.L.{input,post_attention}_layernorm.weight [H]
//! model.layers.L.self_attn.{q,k,v,o}_proj.weight + .bias (when attention_bias)   self_attn.sinks [nh]
//! model.layers.L.mlp.router.weight [E,H]   router.bias [E]
//! model.layers.L.mlp.experts.gate_up_proj_bias [E,2I]   down_proj_bias [E,H]     (resident, copied)
//! openai MXFP4:   experts.gate_up_proj_blocks U8 [E,2I,H/32,16] + _scales U8 [E,2I,H/32]
//!                 experts.down_proj_blocks    U8 [E,H,I/32,16]  + _scales U8 [E,H,I/32]
//! transformers:   experts.gate_up_proj [E,H,2I]   experts.down_proj [E,I,H]     (x @ W orientation)
//! ```
//!
//! In both, output column / row `c` of gate_up is gate row `c/2` when `c` is even and up row `c/2`
//! when odd (transformers `GptOssExperts`: `gate_up[..., ::2], gate_up[..., 1::2]`), which is the
//! converted directory's interleaving already. MXFP4 is output-major (`[out, in]` once unpacked,
//! see [`super::mxfp4`]); the transformers tensors are transposed (`x @ W`).

use super::mxfp4;
use super::plan::{check, refuse_converted, ExpertSource, Plan, PlanBuilder};
use super::quantize::widen;
use crate::error::{Error, Result};
use crate::expert::layout::{ExpertLayout, ExpertNaming, ExpertTensorNames};
use crate::model::config::Config;
use crate::model::safetensors::{TensorRef, TensorStore};

/// Source tensor name `model.layers.L.mlp.experts.<part>`.
fn experts(layer: usize, part: &str) -> String {
    format!("model.layers.{layer}.mlp.experts.{part}")
}

/// Checks every tensor of a GPT-OSS checkpoint against `cfg` and plans the output (see
/// [`super::plan::plan`] for the errors).
pub(crate) fn plan(cfg: &Config, store: &TensorStore) -> Result<Plan> {
    let (h, i, e) = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts);
    let (hd, nh, nkv) = (cfg.head_dim(), cfg.num_attention_heads, cfg.num_key_value_heads);
    refuse_converted(store, &ExpertTensorNames::with(ExpertNaming::Suffixed, 0, 0).gate_up)?;
    let mut b = PlanBuilder::new(store, cfg)?;
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        b.attention(cfg, l)?;
        let mut tensors = vec![
            (format!("{p}.self_attn.sinks"), vec![nh]),
            (format!("{p}.mlp.router.weight"), vec![e, h]),
            (format!("{p}.mlp.router.bias"), vec![e]),
            (experts(l, "gate_up_proj_bias"), vec![e, 2 * i]),
            (experts(l, "down_proj_bias"), vec![e, h]),
        ];
        if cfg.attention_bias {
            for (n, len) in [("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd), ("o", h)] {
                tensors.push((format!("{p}.self_attn.{n}_proj.bias"), vec![len]));
            }
        }
        for (name, shape) in tensors {
            b.dense(name, &shape)?;
        }
        let (gub, gus) = (experts(l, "gate_up_proj_blocks"), experts(l, "gate_up_proj_scales"));
        let (db, ds) = (experts(l, "down_proj_blocks"), experts(l, "down_proj_scales"));
        let (source, names) = if [&gub, &gus, &db, &ds].iter().any(|n| store.contains(n)) {
            mxfp4::check_pair(&store.get(&gub)?, &store.get(&gus)?, e, 2 * i, h)?;
            mxfp4::check_pair(&store.get(&db)?, &store.get(&ds)?, e, h, i)?;
            (ExpertSource::Mxfp4, vec![gub, gus, db, ds])
        } else {
            let (gu, d) = (experts(l, "gate_up_proj"), experts(l, "down_proj"));
            check(store, &gu, &[e, h, 2 * i])?;
            check(store, &d, &[e, i, h])?;
            (ExpertSource::FusedTransposed, vec![gu, d])
        };
        b.layer(l, e, Some(source), names);
    }
    b.finish(cfg, |name| {
        if name.starts_with("model.layers.") && name.contains(".mlp.experts") {
            let t = store.get(name)?;
            return Err(Error::UnexpectedExpertTensor {
                path: t.path.into(),
                name: name.to_string(),
                config: format!("num_local_experts {e}, num_hidden_layers {}", cfg.num_hidden_layers),
            });
        }
        Ok(())
    })
}

/// The bytes of expert `expert` in a tensor whose first dimension is the expert.
fn expert_bytes<'a>(t: &TensorRef<'a>, expert: usize, experts: usize) -> &'a [u8] {
    let per = t.bytes.len() / experts;
    &t.bytes[expert * per..(expert + 1) * per]
}

/// Splits an interleaved gate_up `[2I, H]` (row `2i` gate, `2i + 1` up) into gate and up `[I, H]`.
fn deinterleave(gate_up: &[f32], h: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut gate, mut up) = (Vec::with_capacity(gate_up.len() / 2), Vec::with_capacity(gate_up.len() / 2));
    for (r, row) in gate_up.chunks_exact(h).enumerate() {
        if r % 2 == 0 { &mut gate } else { &mut up }.extend_from_slice(row);
    }
    (gate, up)
}

/// `[rows, cols]` → `[cols, rows]`.
fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; m.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = m[r * cols + c];
        }
    }
    out
}

/// Reads GPT-OSS expert `(layer, expert)` as gate `[I,H]`, up `[I,H]` and down `[H,I]` (nn.Linear
/// layout, f32) from an [`ExpertSource::Mxfp4`] or [`ExpertSource::FusedTransposed`] checkpoint.
pub(crate) fn read_expert(
    store: &TensorStore,
    source: ExpertSource,
    layout: &ExpertLayout,
    layer: usize,
    expert: usize,
    experts_per_layer: usize,
) -> Result<[Vec<f32>; 3]> {
    let (h, i, n) = (layout.hidden, layout.inter, experts_per_layer);
    let (gate_up, down) = match source {
        ExpertSource::Mxfp4 => {
            let part = |name: &str, rows, cols| -> Result<Vec<f32>> {
                let (b, s) = (
                    store.get(&experts(layer, &format!("{name}_blocks")))?,
                    store.get(&experts(layer, &format!("{name}_scales")))?,
                );
                let what = format!("{}: tensor `{}` [{expert}]", s.path.display(), s.name);
                mxfp4::dequantize(expert_bytes(&b, expert, n), expert_bytes(&s, expert, n), rows, cols, &what)
            };
            (part("gate_up_proj", 2 * i, h)?, part("down_proj", h, i)?)
        }
        ExpertSource::FusedTransposed => {
            let (gu, d) = (store.get(&experts(layer, "gate_up_proj"))?, store.get(&experts(layer, "down_proj"))?);
            let what = format!(" [{expert}]");
            let gu_t = widen(&gu, expert_bytes(&gu, expert, n), &what)?;
            let d_t = widen(&d, expert_bytes(&d, expert, n), &what)?;
            (transpose(&gu_t, h, 2 * i), transpose(&d_t, i, h))
        }
        ExpertSource::PerExpert | ExpertSource::Fused => {
            return Err(Error::ExpertSourceArch { layer, source_layout: format!("{source:?}"), arch: "GPT-OSS" })
        }
    };
    let (gate, up) = deinterleave(&gate_up, h);
    Ok([gate, up, down])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deinterleave_and_transpose() {
        let gu: Vec<f32> = (0..8).map(|v| v as f32).collect(); // [4, 2]
        let (g, u) = deinterleave(&gu, 2);
        assert_eq!((g, u), (vec![0.0, 1.0, 4.0, 5.0], vec![2.0, 3.0, 6.0, 7.0]));
        assert_eq!(transpose(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2, 3), vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    }
}
