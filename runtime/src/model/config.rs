//! `config.json` of a Qwen3-MoE checkpoint, with Hugging Face's key names verbatim.
//!
//! Accepts both the hub spelling (`num_experts`, `rope_theta`, `torch_dtype`) and the transformers 5
//! spelling (`num_local_experts`, `rope_parameters.rope_theta`, `dtype`). Source:
//! transformers `models/qwen3_moe/configuration_qwen3_moe.py`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The `rope_parameters` object of transformers 5.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct RopeParameters {
    /// RoPE base θ.
    pub rope_theta: Option<f64>,
    /// Only `default` is implemented.
    #[serde(default)]
    pub rope_type: Option<String>,
}

/// A Qwen3-MoE configuration (only the keys the runtime uses; others are ignored).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct Config {
    /// Must be `qwen3_moe`.
    pub model_type: String,
    /// Vocabulary size V (rows of embed_tokens and lm_head).
    pub vocab_size: usize,
    /// Hidden size H.
    pub hidden_size: usize,
    /// Width of the dense MLP of `mlp_only_layers` layers.
    pub intermediate_size: usize,
    /// Width I of each routed expert (gate_up has 2I rows).
    pub moe_intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA).
    pub num_key_value_heads: usize,
    /// Per-head width (default hidden_size / num_attention_heads).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Routed experts per MoE layer E.
    #[serde(alias = "num_local_experts")]
    pub num_experts: usize,
    /// Experts per token (top-k).
    pub num_experts_per_tok: usize,
    /// Renormalise the top-k routing weights to sum to 1.
    #[serde(default)]
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer is MoE (layer l is MoE when (l+1) % step == 0).
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    /// Layers with a dense MLP instead of experts.
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    /// RMSNorm ε.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE θ (hub spelling).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RoPE parameters (transformers 5 spelling).
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    /// Must be null: scaled RoPE is not implemented for Qwen3-MoE.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Whether lm_head shares embed_tokens.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Maximum context (positions).
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Must be false: Qwen3-MoE checkpoints have no attention biases, and the forward pass has none.
    #[serde(default)]
    pub attention_bias: bool,
    /// End-of-sequence token id(s), when the config names them.
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
}

fn one() -> usize {
    1
}
fn default_eps() -> f64 {
    1e-6
}
fn default_max_pos() -> usize {
    32768
}

impl Config {
    /// Reads and checks `<dir>/config.json`.
    ///
    /// # Errors
    /// [`Error::Io`] if unreadable, [`Error::Config`] for bad JSON or a missing key,
    /// [`Error::UnsupportedModel`] for another `model_type`, [`Error::ConfigValue`] for inconsistent
    /// values (heads not divisible, top-k > experts, rope scaling, zero sizes).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join("config.json"))
    }

    /// Reads and checks a config file; see [`Config::from_dir`].
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(Error::io(path, "read config"))?;
        let raw: serde_json::Value =
            serde_json::from_str(&text).map_err(|cause| Error::Config { path: path.into(), cause })?;
        let model_type = raw.get("model_type").and_then(|v| v.as_str()).unwrap_or("");
        if model_type != "qwen3_moe" {
            return Err(Error::UnsupportedModel { path: path.into(), model_type: model_type.into() });
        }
        let cfg: Config = serde_json::from_value(raw).map_err(|cause| Error::Config { path: path.into(), cause })?;
        cfg.check(path)?;
        Ok(cfg)
    }

    fn check(&self, path: &Path) -> Result<()> {
        let bad = |key: &'static str, message: String| Error::ConfigValue { path: PathBuf::from(path), key, message };
        for (key, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("num_experts", self.num_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("decoder_sparse_step", self.decoder_sparse_step),
        ] {
            if v == 0 {
                return Err(bad(key, "must be > 0".into()));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(bad(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if self.num_experts_per_tok > self.num_experts {
            return Err(bad(
                "num_experts_per_tok",
                format!("{} exceeds num_experts {}", self.num_experts_per_tok, self.num_experts),
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(bad("head_dim", format!("{} must be even for RoPE", self.head_dim())));
        }
        if let Some(s) = &self.rope_scaling {
            let ty = s.get("rope_type").or_else(|| s.get("type")).and_then(|t| t.as_str());
            if !s.is_null() && ty != Some("default") {
                return Err(bad("rope_scaling", format!("{s} is not supported (only null / default)")));
            }
        }
        if let Some(RopeParameters { rope_type: Some(t), .. }) = &self.rope_parameters {
            if t != "default" {
                return Err(bad("rope_parameters", format!("rope_type {t:?} is not supported (only default)")));
            }
        }
        if self.attention_bias {
            return Err(bad("attention_bias", "true is not supported (Qwen3-MoE has no attention biases)".into()));
        }
        if let Some(&l) = self.mlp_only_layers.iter().find(|&&l| l >= self.num_hidden_layers) {
            return Err(bad("mlp_only_layers", format!("layer {l} >= num_hidden_layers {}", self.num_hidden_layers)));
        }
        Ok(())
    }

    /// Per-head width (`head_dim`, default hidden_size / num_attention_heads).
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// RoPE θ from `rope_parameters` or `rope_theta` (default 10000, as transformers).
    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters.as_ref().and_then(|p| p.rope_theta).or(self.rope_theta).unwrap_or(10_000.0)
    }

    /// Whether layer `l` routes to experts (else it has a dense MLP). transformers:
    /// `(l not in mlp_only_layers) and num_experts > 0 and (l + 1) % decoder_sparse_step == 0`.
    pub fn is_moe_layer(&self, l: usize) -> bool {
        !self.mlp_only_layers.contains(&l) && self.num_experts > 0 && (l + 1).is_multiple_of(self.decoder_sparse_step)
    }

    /// Indices of the MoE layers.
    pub fn moe_layers(&self) -> Vec<usize> {
        (0..self.num_hidden_layers).filter(|&l| self.is_moe_layer(l)).collect()
    }

    /// End-of-sequence ids named by the config (an int or a list).
    pub fn eos_ids(&self) -> Vec<u32> {
        match &self.eos_token_id {
            Some(serde_json::Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
            Some(serde_json::Value::Array(a)) => a.iter().filter_map(|v| v.as_u64()).map(|n| n as u32).collect(),
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(name)
    }

    #[test]
    fn reads_hub_spelling() {
        let c = Config::from_dir(&fixture("qwen3_moe_wide")).unwrap();
        assert_eq!((c.hidden_size, c.head_dim(), c.num_experts, c.num_experts_per_tok), (128, 32, 8, 2));
        assert_eq!(c.moe_layers(), vec![0, 2]);
        assert_eq!(c.rope_theta(), 1e6);
    }

    #[test]
    fn reads_transformers5_spelling_and_rejects_bad_values() {
        let dir = tempfile::tempdir().unwrap();
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_moe/config.json")).unwrap()).unwrap();
        let o = v.as_object_mut().unwrap();
        let n = o.remove("num_experts").unwrap();
        o.insert("num_local_experts".into(), n);
        o.remove("rope_theta");
        o.insert("rope_parameters".into(), serde_json::json!({"rope_theta": 5e5, "rope_type": "default"}));
        let p = dir.path().join("config.json");
        std::fs::write(&p, v.to_string()).unwrap();
        let c = Config::from_file(&p).unwrap();
        assert_eq!((c.num_experts, c.rope_theta()), (16, 5e5));

        v["model_type"] = "llama".into();
        std::fs::write(&p, v.to_string()).unwrap();
        let e = Config::from_file(&p).unwrap_err().to_string();
        assert!(e.contains("unsupported model_type \"llama\"") && e.contains("config.json"), "{e}");

        v["model_type"] = "qwen3_moe".into();
        v["num_experts_per_tok"] = 99.into();
        std::fs::write(&p, v.to_string()).unwrap();
        let e = Config::from_file(&p).unwrap_err().to_string();
        assert!(e.contains("num_experts_per_tok"), "{e}");

        v.as_object_mut().unwrap().remove("hidden_size");
        std::fs::write(&p, v.to_string()).unwrap();
        let e = Config::from_file(&p).unwrap_err();
        let e = picchio_core::error::chain(&e).to_string();
        assert!(e.contains("hidden_size"), "{e}");

        std::fs::write(&p, "{not json").unwrap();
        let e = Config::from_file(&p).unwrap_err().to_string();
        assert!(e.contains("invalid config"), "{e}");
        let e = Config::from_dir(dir.path().join("nope").as_path()).unwrap_err().to_string();
        assert!(e.contains("nope/config.json"), "{e}");
    }
}
