//! Random-weight Qwen3-MoE models at a chosen expert-store size, for watching experts stream from a
//! store larger than the cache (`picchio demo --synthetic-gb N`). No download needed.
//!
//! Shapes are Qwen3-30B-A3B's per layer (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of
//! width 768, top-8), so each Q4 expert is the real 2,654,208 bytes; the number of layers is chosen to
//! reach the requested size, and the vocabulary is 4096 ids (no tokenizer: prompts are ids).
//!
//! Initialisation follows `shared/notes/synthetic-models.md` (measured): symmetric zero-mean Q4 codes
//! in [-7, 7], group scales giving weights of standard deviation 1/√fan_in, and an extra factor
//! 1/√(2·n_layers) on the residual-branch outputs (o_proj and the experts' down_proj), so routing is
//! near-uniform and greedy output does not collapse to one token.

use std::collections::BTreeMap;
use std::path::Path;

use picchio_core::rng::{SplitMix64, GOLDEN_GAMMA};
use rayon::prelude::*;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::expert::layout::{ExpertLayout, ExpertTensorNames};
use crate::quant::QuantKind;

/// Shape of a synthetic model.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticSpec {
    /// Decoder layers (all MoE).
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Experts per layer.
    pub experts: usize,
    /// Experts per token.
    pub topk: usize,
    /// Expert width I.
    pub moe_inter: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Seed of every weight.
    pub seed: u64,
}

impl SyntheticSpec {
    /// Qwen3-30B-A3B-shaped layers, as many as make the Q4 experts at least `gb` × 10⁹ bytes
    /// (at least one layer).
    pub fn with_expert_gb(gb: f64, seed: u64) -> Self {
        let mut s = SyntheticSpec {
            layers: 1,
            hidden: 2048,
            heads: 32,
            kv_heads: 4,
            head_dim: 128,
            experts: 128,
            topk: 8,
            moe_inter: 768,
            vocab: 4096,
            seed,
        };
        let per_layer = (s.experts * s.expert_layout().len()) as f64;
        s.layers = ((gb * 1e9) / per_layer).ceil().max(1.0) as usize;
        s
    }

    /// The Q4 payload layout of one expert.
    pub fn expert_layout(&self) -> ExpertLayout {
        ExpertLayout::new(QuantKind::Q4, self.hidden, self.moe_inter).expect("multiples of 64")
    }

    /// Total expert payload bytes.
    pub fn expert_bytes(&self) -> u64 {
        (self.layers * self.experts * self.expert_layout().len()) as u64
    }

    fn config_json(&self) -> serde_json::Value {
        serde_json::json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": 4 * self.moe_inter,
            "moe_intermediate_size": self.moe_inter,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "num_experts": self.experts,
            "num_experts_per_tok": self.topk,
            "norm_topk_prob": true,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_scaling": null,
            "tie_word_embeddings": false,
            "max_position_embeddings": 40960,
            "torch_dtype": "bfloat16",
            "bos_token_id": null,
            "eos_token_id": null,
            "picchio_synthetic": {"seed": self.seed, "note": "random weights, see shared/notes/synthetic-models.md"}
        })
    }
}

/// [`SplitMix64`] (picchio_core::rng): each tensor gets its own stream, state
/// `seed ^ a·GOLDEN_GAMMA ^ b·0xC2B2AE3D27D4EB4F` advanced once, so the output does not depend on
/// thread count.
struct Rng(SplitMix64);
impl Rng {
    fn new(seed: u64, a: u64, b: u64) -> Self {
        let mut r = SplitMix64::new(seed ^ a.wrapping_mul(GOLDEN_GAMMA) ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F));
        r.next_u64();
        Rng(r)
    }
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Approximately normal (sum of 4 uniforms, variance-corrected), mean 0, std 1.
    fn normal(&mut self) -> f32 {
        let r = self.next();
        let s: f32 = (0..4).map(|i| ((r >> (16 * i)) & 0xffff) as f32 / 65535.0).sum();
        (s - 2.0) * (3.0f32).sqrt()
    }
}

/// Standard deviation of a code uniform on the 15 integers -7..=7: sqrt(2·Σk²/15) = sqrt(56/3).
const CODE_STD: f32 = 4.320_494;

/// Fills a Q4 matrix [rows, cols] with symmetric zero-mean codes and scales giving std `std`.
fn random_q4(rng: &mut Rng, rows: usize, cols: usize, std: f32, packed: &mut [u8], scales: &mut [u8]) {
    for b in packed.iter_mut() {
        let r = rng.next();
        // Two nibbles, each uniform on 1..=15 (value nibble - 8 in -7..=7).
        let lo = 1 + (((r & 0xffff) * 15) >> 16) as u8;
        let hi = 1 + ((((r >> 16) & 0xffff) * 15) >> 16) as u8;
        *b = lo | (hi << 4);
    }
    let s = (std / CODE_STD).to_le_bytes();
    for c in scales.chunks_exact_mut(4).take(rows * cols / 64) {
        c.copy_from_slice(&s);
    }
}

fn bf16_tensor(rng: &mut Rng, n: usize, std: f32) -> Vec<u8> {
    (0..n).flat_map(|_| half::bf16::from_f32(rng.normal() * std).to_le_bytes()).collect()
}

fn ones_bf16(n: usize) -> Vec<u8> {
    (0..n).flat_map(|_| half::bf16::from_f32(1.0).to_le_bytes()).collect()
}

/// One tensor to write: name, dtype, shape, little-endian bytes.
type OwnedTensor = (String, Dtype, Vec<usize>, Vec<u8>);

fn write_shard(path: &Path, tensors: &[OwnedTensor]) -> Result<()> {
    let views = tensors
        .iter()
        .map(|(n, d, s, b)| {
            TensorView::new(*d, s.clone(), b).map(|v| (n.clone(), v)).map_err(|e| Error::Invalid(format!("{n}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, path)
        .map_err(|e| Error::io(path, "write synthetic shard")(std::io::Error::other(e.to_string())))
}

/// Writes a converted model directory (config.json, dense and per-layer expert shards,
/// model.safetensors.index.json) for `spec` into `dir`, which must not exist yet (it is built in a
/// temporary sibling and renamed). Calls `progress(done, total)` after each shard.
///
/// # Errors
/// [`Error::Exists`] when `dir` exists; [`Error::Io`] on write failures.
pub fn write_synthetic(dir: &Path, spec: &SyntheticSpec, progress: &mut dyn FnMut(usize, usize)) -> Result<()> {
    if dir.exists() {
        return Err(Error::Exists { path: dir.into(), what: "directory", overwrite: None });
    }
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    let tmp = dir.with_file_name(name);
    crate::image::guard::sweep_leftovers(dir, "demo")?;
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(Error::io(&tmp, "create directory"))?;
    let result = write_into(&tmp, spec, progress)
        .and_then(|_| std::fs::rename(&tmp, dir).map_err(Error::io(dir, "rename synthetic model into place")));
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

fn write_into(dir: &Path, s: &SyntheticSpec, progress: &mut dyn FnMut(usize, usize)) -> Result<()> {
    let cfg = serde_json::to_string_pretty(&s.config_json()).expect("json");
    std::fs::write(dir.join("config.json"), cfg).map_err(Error::io(dir.join("config.json"), "write"))?;
    let (h, q, kv) = (s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let resid = 1.0 / (2.0 * s.layers as f32).sqrt();
    let total_shards = s.layers + 1;
    let mut weight_map = BTreeMap::new();
    let mut total_size = 0u64;

    // Dense shard: embeddings, lm_head, norms, attention, routers.
    let mut dense = Vec::new();
    let mut rng = Rng::new(s.seed, 1, 0);
    dense.push((
        "model.embed_tokens.weight".into(),
        Dtype::BF16,
        vec![s.vocab, h],
        bf16_tensor(&mut rng, s.vocab * h, 1.0),
    ));
    let lm_std = 1.0 / (h as f32).sqrt();
    dense.push(("lm_head.weight".into(), Dtype::BF16, vec![s.vocab, h], bf16_tensor(&mut rng, s.vocab * h, lm_std)));
    dense.push(("model.norm.weight".into(), Dtype::BF16, vec![h], ones_bf16(h)));
    for l in 0..s.layers {
        let mut rng = Rng::new(s.seed, 2, l as u64);
        let p = format!("model.layers.{l}");
        let std_h = 1.0 / (h as f32).sqrt();
        let std_q = 1.0 / (q as f32).sqrt();
        dense.push((format!("{p}.input_layernorm.weight"), Dtype::BF16, vec![h], ones_bf16(h)));
        dense.push((format!("{p}.post_attention_layernorm.weight"), Dtype::BF16, vec![h], ones_bf16(h)));
        dense.push((
            format!("{p}.self_attn.q_proj.weight"),
            Dtype::BF16,
            vec![q, h],
            bf16_tensor(&mut rng, q * h, std_h),
        ));
        dense.push((
            format!("{p}.self_attn.k_proj.weight"),
            Dtype::BF16,
            vec![kv, h],
            bf16_tensor(&mut rng, kv * h, std_h),
        ));
        dense.push((
            format!("{p}.self_attn.v_proj.weight"),
            Dtype::BF16,
            vec![kv, h],
            bf16_tensor(&mut rng, kv * h, std_h),
        ));
        let o = bf16_tensor(&mut rng, h * q, std_q * resid);
        dense.push((format!("{p}.self_attn.o_proj.weight"), Dtype::BF16, vec![h, q], o));
        dense.push((format!("{p}.self_attn.q_norm.weight"), Dtype::BF16, vec![s.head_dim], ones_bf16(s.head_dim)));
        dense.push((format!("{p}.self_attn.k_norm.weight"), Dtype::BF16, vec![s.head_dim], ones_bf16(s.head_dim)));
        let g = bf16_tensor(&mut rng, s.experts * h, std_h);
        dense.push((format!("{p}.mlp.gate.weight"), Dtype::BF16, vec![s.experts, h], g));
    }
    let name = format!("model-00001-of-{total_shards:05}.safetensors");
    write_shard(&dir.join(&name), &dense)?;
    for t in &dense {
        total_size += t.3.len() as u64;
        weight_map.insert(t.0.clone(), name.clone());
    }
    drop(dense);
    progress(1, total_shards);

    // One shard per layer of Q4 experts, generated in parallel, each expert from its own stream.
    let layout = s.expert_layout();
    for l in 0..s.layers {
        let experts: Vec<Vec<OwnedTensor>> = (0..s.experts)
            .into_par_iter()
            .map(|e| {
                let mut rng = Rng::new(s.seed, 3 + l as u64, e as u64);
                let mut gu = vec![0u8; layout.gate_up.len()];
                let mut gus = vec![0u8; layout.gate_up_scales.len()];
                let mut d = vec![0u8; layout.down.len()];
                let mut ds = vec![0u8; layout.down_scales.len()];
                random_q4(&mut rng, 2 * s.moe_inter, h, 1.0 / (h as f32).sqrt(), &mut gu, &mut gus);
                let down_std = resid / (s.moe_inter as f32).sqrt();
                random_q4(&mut rng, h, s.moe_inter, down_std, &mut d, &mut ds);
                let n = ExpertTensorNames::new(l, e);
                vec![
                    (n.gate_up, Dtype::U8, vec![gu.len()], gu),
                    (n.gate_up_qs, Dtype::F32, vec![gus.len() / 4], gus),
                    (n.down, Dtype::U8, vec![d.len()], d),
                    (n.down_qs, Dtype::F32, vec![ds.len() / 4], ds),
                ]
            })
            .collect();
        let tensors: Vec<_> = experts.into_iter().flatten().collect();
        let name = format!("model-{:05}-of-{total_shards:05}.safetensors", l + 2);
        write_shard(&dir.join(&name), &tensors)?;
        for t in &tensors {
            total_size += t.3.len() as u64;
            weight_map.insert(t.0.clone(), name.clone());
        }
        progress(l + 2, total_shards);
    }
    let index = serde_json::json!({"metadata": {"total_size": total_size}, "weight_map": weight_map});
    let p = dir.join("model.safetensors.index.json");
    std::fs::write(&p, serde_json::to_string_pretty(&index).expect("json")).map_err(Error::io(&p, "write"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_the_request_and_codes_are_symmetric() {
        let s = SyntheticSpec::with_expert_gb(2.0, 0);
        assert_eq!(s.layers, 6);
        assert!(s.expert_bytes() >= 2_000_000_000);
        let mut rng = Rng::new(1, 2, 3);
        let mut packed = vec![0u8; 64 * 32];
        let mut scales = vec![0u8; 64 * 4];
        random_q4(&mut rng, 64, 64, 0.125, &mut packed, &mut scales);
        let vals: Vec<i32> = packed.iter().flat_map(|b| [(b & 15) as i32 - 8, (b >> 4) as i32 - 8]).collect();
        assert!(vals.iter().all(|v| (-7..=7).contains(v)));
        let mean = vals.iter().sum::<i32>() as f64 / vals.len() as f64;
        assert!(mean.abs() < 0.2, "mean {mean}");
    }

    #[test]
    fn writes_a_loadable_small_model() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("m");
        let spec = SyntheticSpec {
            layers: 2,
            hidden: 128,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            experts: 8,
            topk: 2,
            moe_inter: 64,
            vocab: 256,
            seed: 5,
        };
        let mut calls = 0;
        write_synthetic(&out, &spec, &mut |_, _| calls += 1).unwrap();
        assert_eq!(calls, 3);
        let cfg = crate::model::config::Config::from_dir(&out).unwrap();
        let store = crate::model::safetensors::TensorStore::open(&out).unwrap();
        assert_eq!(crate::expert::layout::ExpertLayout::detect(&store, &cfg).unwrap(), spec.expert_layout());
        assert!(write_synthetic(&out, &spec, &mut |_, _| {}).is_err(), "refuses an existing directory");
    }
}
