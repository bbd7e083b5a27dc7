//! `config.json` of a Qwen3-MoE or GPT-OSS checkpoint, with Hugging Face's key names verbatim, read
//! once and dispatched on `model_type` (`qwen3_moe` | `gpt_oss`, see [`Arch`]).
//!
//! Accepts both the hub spelling and the transformers 5 spelling of every key the runtime uses:
//! `num_experts` / `num_local_experts`, `num_experts_per_tok` / `experts_per_token` (GPT-OSS),
//! `rope_theta` + `rope_scaling` / `rope_parameters`, `torch_dtype` / `dtype`. For GPT-OSS the
//! expert width is `intermediate_size` (stored here as `moe_intermediate_size`, the field every
//! architecture's experts use). Sources: transformers `models/qwen3_moe/configuration_qwen3_moe.py`,
//! `models/gpt_oss/configuration_gpt_oss.py`, `modeling_rope_utils.py` (RoPE parameters).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The `rope_parameters` object of transformers 5, or the hub's `rope_scaling` object (same keys,
/// `type` accepted for `rope_type`; θ then comes from the top-level `rope_theta`).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct RopeParameters {
    /// RoPE base θ.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// `default` (or absent) or `yarn`; anything else is refused by the config check.
    #[serde(default, alias = "type")]
    pub rope_type: Option<String>,
    /// YaRN: context scaling factor s.
    #[serde(default)]
    pub factor: Option<f64>,
    /// YaRN: β_fast (default 32).
    #[serde(default)]
    pub beta_fast: Option<f64>,
    /// YaRN: β_slow (default 1).
    #[serde(default)]
    pub beta_slow: Option<f64>,
    /// YaRN: the pre-training context (default `max_position_embeddings`).
    #[serde(default)]
    pub original_max_position_embeddings: Option<f64>,
    /// YaRN: round the correction range to whole dimensions (default true).
    #[serde(default)]
    pub truncate: Option<bool>,
    /// YaRN: the cos/sin scale (default `0.1 ln(factor) + 1`, or the mscale ratio).
    #[serde(default)]
    pub attention_factor: Option<f64>,
    /// YaRN (DeepSeek spelling): mscale.
    #[serde(default)]
    pub mscale: Option<f64>,
    /// YaRN (DeepSeek spelling): mscale_all_dim.
    #[serde(default)]
    pub mscale_all_dim: Option<f64>,
}

/// The model architecture, from `model_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `qwen3_moe`: QK-norm, softmax-then-top-k router, SiLU experts, no biases.
    Qwen3Moe,
    /// `gpt_oss`: attention biases and sinks, sliding-window layers, YaRN, top-k-then-softmax router
    /// with bias, clamped SwiGLU experts with biases.
    GptOss,
}

impl Arch {
    /// The `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::GptOss => "gpt_oss",
        }
    }
}

/// The attention kind of one decoder layer (`layer_types`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub enum LayerType {
    /// `full_attention`: every earlier position.
    #[serde(rename = "full_attention")]
    Full,
    /// `sliding_attention`: the last `sliding_window` positions, the query's own included.
    #[serde(rename = "sliding_attention")]
    Sliding,
}

/// The RoPE variant and its parameters, resolved from the config ([`Config::rope`]).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE (`rope_type: default`).
    Default,
    /// YaRN (transformers `_compute_yarn_parameters`), every default filled in.
    Yarn {
        /// Scaling factor s.
        factor: f64,
        /// β_fast.
        beta_fast: f64,
        /// β_slow.
        beta_slow: f64,
        /// Pre-training context length.
        original_max_position_embeddings: f64,
        /// Round the correction range to whole dimensions.
        truncate: bool,
        /// The factor cos and sin are multiplied by.
        attention_factor: f64,
    },
}

/// RoPE θ and variant of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    /// Base θ.
    pub theta: f64,
    /// Variant.
    pub scaling: RopeScaling,
}

/// A Qwen3-MoE or GPT-OSS configuration (only the keys the runtime uses; others are ignored).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct Config {
    /// `qwen3_moe` or `gpt_oss` ([`Config::arch`]).
    pub model_type: String,
    /// Vocabulary size V (rows of embed_tokens and lm_head).
    pub vocab_size: usize,
    /// Hidden size H.
    pub hidden_size: usize,
    /// Width of the dense MLP of `mlp_only_layers` layers.
    pub intermediate_size: usize,
    /// Width I of each routed expert (gate_up has 2I rows); GPT-OSS: `intermediate_size`.
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
    /// Experts per token (top-k); GPT-OSS hub spelling `experts_per_token`.
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
    /// RoPE scaling (hub spelling): null, `default` or `yarn`.
    #[serde(default)]
    pub rope_scaling: Option<RopeParameters>,
    /// Whether lm_head shares embed_tokens.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Maximum context (positions).
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Whether q/k/v/o have biases (GPT-OSS: default true; Qwen3-MoE: must be false, its checkpoints
    /// have none).
    #[serde(default)]
    pub attention_bias: bool,
    /// Attention kind per decoder layer (`[num_hidden_layers]`); empty means all full attention
    /// (GPT-OSS without the key: sliding, full, sliding, ... as transformers' default).
    #[serde(default)]
    pub layer_types: Vec<LayerType>,
    /// Window W of `sliding_attention` layers (positions, the query's own included).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// GPT-OSS clamp of the expert SwiGLU (default 7).
    #[serde(default)]
    pub swiglu_limit: Option<f64>,
    /// End-of-sequence token id(s), when the config names them.
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
}

/// The most decoder layers a config may declare (no checkpoint has more than a few hundred; the
/// bound keeps a corrupt `num_hidden_layers` from sizing per-layer work and memory).
pub const MAX_LAYERS: usize = 1 << 16;

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
        Self::parse(&text, path)
    }

    /// Checks `text`, the contents of the config file `path` (named by every error and by the
    /// warning that lists the transformers defaults filled in for missing keys: one warning per
    /// parse, so a command parses its model's config once, [`crate::model::dir::ModelDir`]).
    ///
    /// # Errors
    /// As [`Config::from_dir`], except [`Error::Io`].
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let raw: serde_json::Value =
            serde_json::from_str(text).map_err(|cause| match non_json_number(text, &cause) {
                Some((literal, key)) => Error::ConfigKey {
                    path: path.into(),
                    key,
                    message: format!(
                        "{literal} at line {}, column {} is not JSON (Python's json module writes it for a float that \
                     is not finite); write a finite number",
                        cause.line(),
                        cause.column()
                    ),
                },
                None => Error::Config { path: path.into(), cause },
            })?;
        let model_type = match raw.get("model_type") {
            None => String::new(),
            Some(serde_json::Value::String(t)) => t.clone(),
            Some(other) => {
                return Err(Error::ConfigKey {
                    path: path.into(),
                    key: "model_type".into(),
                    message: format!("{other}: expected a string, \"qwen3_moe\" or \"gpt_oss\""),
                })
            }
        };
        let arch = match model_type.as_str() {
            "qwen3_moe" => Arch::Qwen3Moe,
            "gpt_oss" => Arch::GptOss,
            _ => return Err(Error::UnsupportedModel { path: path.into(), model_type }),
        };
        let raw = normalize(raw, arch, path)?;
        let mut cfg = Self::deserialize_named(raw, path).map_err(with_expected)?;
        // Before anything is sized by it (the default layer_types below, per-layer vectors later).
        cfg.check_sizes(path)?;
        if arch == Arch::GptOss && cfg.layer_types.is_empty() {
            // transformers GptOssConfig: sliding on even layers, full on odd ones.
            cfg.layer_types = (0..cfg.num_hidden_layers)
                .map(|l| if l % 2 == 0 { LayerType::Sliding } else { LayerType::Full })
                .collect();
        }
        cfg.check(path)?;
        Ok(cfg)
    }

    /// `raw` as a [`Config`]; a value of the wrong JSON type (a string where a number is expected,
    /// a number where a list is) is named by its key path in config.json (`hidden_size`,
    /// `rope_scaling.factor`, `layer_types[2]`), not only by serde's line and column.
    fn deserialize_named(raw: serde_json::Value, path: &Path) -> Result<Self> {
        serde_path_to_error::deserialize(raw).map_err(|e| {
            let key = e.path().to_string();
            let cause = e.into_inner();
            if key == "." {
                // A whole-object error (a missing key, an object that is not one): serde names it.
                Error::Config { path: path.into(), cause }
            } else {
                Error::ConfigKey { path: path.into(), key, message: cause.to_string() }
            }
        })
    }

    /// The architecture (`model_type`, checked when the config was read).
    pub fn arch(&self) -> Arch {
        if self.model_type == "gpt_oss" {
            Arch::GptOss
        } else {
            Arch::Qwen3Moe
        }
    }

    /// Refuses sizes no checkpoint has, before they size any work or memory (found while writing the
    /// fuzz target `config`, docs/fuzzing.md): `num_hidden_layers` above [`MAX_LAYERS`] (the default
    /// GPT-OSS `layer_types`, [`Config::moe_layers`] and the model's per-layer vectors are that long),
    /// and any dimension or count that does not fit the `.picchioflat` superblock's 32-bit fields
    /// (`moe_inter` is 2 × `moe_intermediate_size`), which `expert::store::store_dims` would
    /// otherwise truncate into a different, valid-looking number.
    fn check_sizes(&self, path: &Path) -> Result<()> {
        let bad = |key: &'static str, message: String| Error::ConfigValue { path: PathBuf::from(path), key, message };
        if self.num_hidden_layers > MAX_LAYERS {
            return Err(bad(
                "num_hidden_layers",
                format!("{} is more than {MAX_LAYERS} layers (a corrupt config?)", self.num_hidden_layers),
            ));
        }
        let max = u32::MAX as usize;
        for (key, v, limit) in [
            ("vocab_size", self.vocab_size, max),
            ("hidden_size", self.hidden_size, max),
            ("intermediate_size", self.intermediate_size, max),
            ("moe_intermediate_size", self.moe_intermediate_size, max / 2),
            ("num_attention_heads", self.num_attention_heads, max),
            ("num_key_value_heads", self.num_key_value_heads, max),
            ("head_dim", self.head_dim.unwrap_or(0), max),
            ("num_experts", self.num_experts, max),
            ("num_experts_per_tok", self.num_experts_per_tok, max),
            ("max_position_embeddings", self.max_position_embeddings, max),
            ("sliding_window", self.sliding_window.unwrap_or(0), max),
        ] {
            if v > limit {
                return Err(bad(key, format!("{v} exceeds {limit}, the largest size a .picchioflat image can record")));
            }
        }
        Ok(())
    }

    /// Refuses values no model can run with, naming the key, the value and the accepted range:
    /// zero sizes and counts, a top-k above the experts, heads that do not divide, a head width that
    /// is zero, odd or (when `head_dim` is not given) not `hidden_size / num_attention_heads`
    /// exactly, RoPE θ, RMSNorm ε and the YaRN parameters that are not finite and positive, an
    /// unknown RoPE type, and the per-layer keys that do not match `num_hidden_layers`.
    fn check(&self, path: &Path) -> Result<()> {
        let bad = |key: &'static str, message: String| Error::ConfigValue { path: PathBuf::from(path), key, message };
        let positive = |key: &'static str, v: f64, what: &str| -> Result<()> {
            match v.is_finite() && v > 0.0 {
                true => Ok(()),
                false => Err(bad(key, format!("{v} is out of range: expected a finite number > 0 ({what})"))),
            }
        };
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
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(bad(key, "0 is out of range: expected an integer > 0".into()));
            }
        }
        // The first layer with a dense MLP (Qwen3-MoE: mlp_only_layers, or layer 0 when only every
        // decoder_sparse_step-th layer is MoE), whose width is intermediate_size.
        let dense = match self.arch() {
            Arch::GptOss => None,
            Arch::Qwen3Moe if self.decoder_sparse_step > 1 => Some(0),
            Arch::Qwen3Moe => self.mlp_only_layers.iter().copied().filter(|&l| l < self.num_hidden_layers).min(),
        };
        if let (0, Some(l)) = (self.intermediate_size, dense) {
            return Err(bad(
                "intermediate_size",
                format!("0 is out of range: expected an integer > 0 (layer {l} has a dense MLP of that width)"),
            ));
        }
        match self.head_dim {
            Some(0) => return Err(bad("head_dim", "0 is out of range: expected an even integer > 0".into())),
            Some(_) => {}
            None if !self.hidden_size.is_multiple_of(self.num_attention_heads) => {
                return Err(bad(
                    "head_dim",
                    format!(
                        "not given, and hidden_size {} is not a multiple of num_attention_heads {}: give head_dim",
                        self.hidden_size, self.num_attention_heads
                    ),
                ))
            }
            None => {}
        }
        positive("rms_norm_eps", self.rms_norm_eps, "the RMSNorm epsilon, e.g. 1e-6")?;
        if let Some(t) = self.rope_theta {
            positive("rope_theta", t, "the RoPE base θ, e.g. 1000000")?;
        }
        if let Some(t) =
            self.rope_parameters.as_ref().and_then(|p| p.rope_theta).filter(|t| !(t.is_finite() && *t > 0.0))
        {
            return Err(bad(
                "rope_parameters",
                format!("rope_theta {t} is out of range: expected a finite number > 0 (the RoPE base θ)"),
            ));
        }
        for (key, p) in [("rope_scaling", &self.rope_scaling), ("rope_parameters", &self.rope_parameters)] {
            let Some(p) = p else { continue };
            for (name, v) in [
                ("beta_fast", p.beta_fast),
                ("beta_slow", p.beta_slow),
                ("original_max_position_embeddings", p.original_max_position_embeddings),
                ("attention_factor", p.attention_factor),
            ] {
                if let Some(v) = v.filter(|v| !(v.is_finite() && *v > 0.0)) {
                    return Err(bad(key, format!("{name} {v} is out of range: expected a finite number > 0")));
                }
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(bad(
                "num_key_value_heads",
                format!(
                    "{} is out of range: expected a divisor of num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if self.num_experts_per_tok > self.num_experts {
            return Err(bad(
                "num_experts_per_tok",
                format!(
                    "{} is out of range: expected 1..={} (num_experts)",
                    self.num_experts_per_tok, self.num_experts
                ),
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(bad(
                "head_dim",
                format!("{} is out of range: expected an even integer > 0 (RoPE rotates pairs)", self.head_dim()),
            ));
        }
        for (key, p) in [("rope_scaling", &self.rope_scaling), ("rope_parameters", &self.rope_parameters)] {
            let Some(p) = p else { continue };
            match p.rope_type.as_deref() {
                None | Some("default") => {}
                Some("yarn") => {
                    if !p.factor.is_some_and(|f| f.is_finite() && f >= 1.0) {
                        return Err(bad(
                            key,
                            match p.factor {
                                Some(f) => format!("yarn needs a finite `factor` >= 1, got {f}"),
                                None => "yarn needs a `factor` (>= 1), and none is given".to_string(),
                            },
                        ));
                    }
                }
                Some(t) => {
                    return Err(bad(key, format!("rope_type {t:?} is not supported (only default and yarn)")));
                }
            }
        }
        if self.attention_bias && self.arch() == Arch::Qwen3Moe {
            return Err(bad("attention_bias", "true is not supported (Qwen3-MoE has no attention biases)".into()));
        }
        if !self.layer_types.is_empty() && self.layer_types.len() != self.num_hidden_layers {
            return Err(bad(
                "layer_types",
                format!("{} entries for num_hidden_layers {}", self.layer_types.len(), self.num_hidden_layers),
            ));
        }
        if let Some(l) = self.layer_types.iter().position(|&t| t == LayerType::Sliding) {
            if self.sliding_window.is_none_or(|w| w == 0) {
                return Err(bad(
                    "sliding_window",
                    format!("layer {l} is sliding_attention but sliding_window is {:?}", self.sliding_window),
                ));
            }
        }
        if let Some(v) = self.swiglu_limit.filter(|v| !(v.is_finite() && *v > 0.0)) {
            return Err(bad("swiglu_limit", format!("{v} is out of range: expected a finite number > 0")));
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

    /// θ and the RoPE variant: `rope_parameters` (transformers 5) when it names a type, else
    /// `rope_scaling` (hub), with transformers' defaults filled in (`beta_fast` 32, `beta_slow` 1,
    /// `original_max_position_embeddings` = `max_position_embeddings`, `truncate` true,
    /// `attention_factor` = `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are
    /// given, else `0.1 ln(factor) + 1`).
    pub fn rope(&self) -> RopeConfig {
        let theta = self.rope_theta();
        let p = [&self.rope_parameters, &self.rope_scaling]
            .into_iter()
            .flatten()
            .find(|p| p.rope_type.as_deref().is_some_and(|t| t != "default"));
        let scaling = match p {
            Some(p) if p.rope_type.as_deref() == Some("yarn") => {
                let factor = p.factor.unwrap_or(1.0);
                let mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
                let attention_factor = p.attention_factor.unwrap_or(match (p.mscale, p.mscale_all_dim) {
                    (Some(m), Some(a)) if m != 0.0 && a != 0.0 => mscale(factor, m) / mscale(factor, a),
                    _ => mscale(factor, 1.0),
                });
                RopeScaling::Yarn {
                    factor,
                    beta_fast: p.beta_fast.filter(|&b| b != 0.0).unwrap_or(32.0),
                    beta_slow: p.beta_slow.filter(|&b| b != 0.0).unwrap_or(1.0),
                    original_max_position_embeddings: p
                        .original_max_position_embeddings
                        .unwrap_or(self.max_position_embeddings as f64),
                    truncate: p.truncate.unwrap_or(true),
                    attention_factor,
                }
            }
            _ => RopeScaling::Default,
        };
        RopeConfig { theta, scaling }
    }

    /// The attention kind of layer `l` (full when `layer_types` is empty).
    pub fn layer_type(&self, l: usize) -> LayerType {
        self.layer_types.get(l).copied().unwrap_or(LayerType::Full)
    }

    /// The attention window of layer `l` in positions: `Some(sliding_window)` for a sliding layer,
    /// `None` for full attention.
    pub fn attention_window(&self, l: usize) -> Option<usize> {
        match self.layer_type(l) {
            LayerType::Full => None,
            LayerType::Sliding => self.sliding_window,
        }
    }

    /// The GPT-OSS SwiGLU clamp (`swiglu_limit`, default 7).
    pub fn swiglu_limit(&self) -> f32 {
        self.swiglu_limit.unwrap_or(7.0) as f32
    }

    /// Whether layer `l` routes to experts (else it has a dense MLP). transformers:
    /// `(l not in mlp_only_layers) and num_experts > 0 and (l + 1) % decoder_sparse_step == 0`;
    /// every GPT-OSS layer is MoE.
    pub fn is_moe_layer(&self, l: usize) -> bool {
        if self.arch() == Arch::GptOss {
            return l < self.num_hidden_layers;
        }
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

/// Maps the alternative spellings of `raw` onto the field names of [`Config`], refusing two
/// spellings of one key with different values.
fn normalize(mut raw: serde_json::Value, arch: Arch, path: &Path) -> Result<serde_json::Value> {
    let Some(o) = raw.as_object_mut() else { return Ok(raw) };
    let mut alias = |name: &'static str, other: &'static str| -> Result<()> {
        match (o.get(name).filter(|v| !v.is_null()).cloned(), o.remove(other).filter(|v| !v.is_null())) {
            (Some(a), Some(b)) if a != b => Err(Error::ConfigValue {
                path: path.into(),
                key: name,
                message: format!("{a} disagrees with `{other}` {b}"),
            }),
            (None, Some(b)) => {
                o.insert(name.into(), b);
                Ok(())
            }
            _ => Ok(()),
        }
    };
    alias("num_experts", "num_local_experts")?;
    if arch == Arch::GptOss {
        alias("num_experts_per_tok", "experts_per_token")?;
        if !o.contains_key("moe_intermediate_size") {
            if let Some(v) = o.get("intermediate_size").cloned() {
                o.insert("moe_intermediate_size".into(), v);
            }
        }
        o.entry("attention_bias").or_insert(serde_json::Value::Bool(true));
    }
    // transformers' defaults for the keys a config.json may leave out that change the model's
    // numbers (Qwen3MoeConfig, and GptOssConfig with its `default_theta`): filled in here, per
    // architecture, and said once per parse (a command parses its config once: `ModelDir`), so a
    // hand-written config that lacks one does not run with another model's value in silence.
    let (class, defaults): (&str, [(&str, serde_json::Value); 3]) = match arch {
        Arch::Qwen3Moe => (
            "Qwen3MoeConfig",
            [
                ("rope_theta", 10_000.0.into()),
                ("rms_norm_eps", 1e-6.into()),
                ("max_position_embeddings", 32_768.into()),
            ],
        ),
        Arch::GptOss => (
            "GptOssConfig",
            [
                ("rope_theta", 150_000.0.into()),
                ("rms_norm_eps", 1e-5.into()),
                ("max_position_embeddings", 131_072.into()),
            ],
        ),
    };
    let theta_in_parameters = o.get("rope_parameters").and_then(|p| p.get("rope_theta")).is_some_and(|t| !t.is_null());
    let mut filled = Vec::new();
    for (key, value) in defaults {
        if (key == "rope_theta" && theta_in_parameters) || o.get(key).is_some_and(|v| !v.is_null()) {
            continue;
        }
        filled.push((key, value.to_string()));
        o.insert(key.into(), value);
    }
    let no_rope = |k: &str| o.get(k).is_none_or(|v| v.is_null());
    if arch == Arch::GptOss && no_rope("rope_scaling") && no_rope("rope_parameters") {
        // GptOssConfig's default rope_parameters: YaRN, the released models' values.
        filled.push(("rope_scaling", "YaRN factor 32, beta_fast 32, beta_slow 1, original 4096, no truncation".into()));
        o.insert(
            "rope_scaling".into(),
            serde_json::json!({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": false, "original_max_position_embeddings": 4096}),
        );
    }
    if !filled.is_empty() {
        let keys: Vec<&str> = filled.iter().map(|(k, _)| *k).collect();
        let values: Vec<String> = filled.iter().map(|(k, v)| format!("{k} {v}")).collect();
        tracing::warn!(
            "{}: no {}; using transformers' {class} defaults ({})",
            path.display(),
            keys.join(", "),
            values.join("; ")
        );
    }
    Ok(raw)
}

/// A `NaN`, `Infinity` or `-Infinity` where serde_json stopped reading `text` (Python's json
/// module writes them for floats that are not finite; JSON has no such literal): the literal and
/// the key it is the value of, when the text before it on its line names one (`"rope_theta": NaN`),
/// else the line.
fn non_json_number(text: &str, e: &serde_json::Error) -> Option<(&'static str, String)> {
    if !e.is_syntax() {
        return None;
    }
    let line = text.lines().nth(e.line().checked_sub(1)?)?;
    // serde_json's column is 1-based and points at (or just past) the first byte it could not take.
    let start = e.column().saturating_sub(1).min(line.len());
    let from = [start, start.saturating_sub(1)].into_iter().find(|&i| {
        line.get(i..).is_some_and(|rest| ["NaN", "Infinity", "-Infinity"].iter().any(|l| rest.starts_with(l)))
    })?;
    // serde_json stops at the `I` of `-Infinity`, past the sign.
    let from = if line[..from].ends_with('-') { from - 1 } else { from };
    let rest = &line[from..];
    let literal = ["-Infinity", "Infinity", "NaN"].into_iter().find(|l| rest.starts_with(l))?;
    let key = line[..from]
        .trim_end()
        .strip_suffix(':')
        .and_then(|b| b.trim_end().strip_suffix('"'))
        .and_then(|b| b.rsplit('"').next())
        .filter(|k| !k.is_empty())
        .map_or_else(|| format!("line {}", e.line()), str::to_string);
    Some((literal, key))
}

/// What a key takes, for the wrong-type error of a key that has a range check (the check's words):
/// serde says `expected usize`, which does not say that 0 is refused too.
fn expected_of(key: &str) -> Option<&'static str> {
    Some(match key {
        "vocab_size"
        | "hidden_size"
        | "moe_intermediate_size"
        | "num_hidden_layers"
        | "num_attention_heads"
        | "num_key_value_heads"
        | "num_experts"
        | "num_local_experts"
        | "num_experts_per_tok"
        | "experts_per_token"
        | "decoder_sparse_step"
        | "max_position_embeddings" => "an integer > 0",
        "intermediate_size" => "an integer >= 0 (> 0 when a layer has a dense MLP)",
        "head_dim" => "an even integer > 0",
        "sliding_window" => "an integer > 0",
        "rope_theta" => "a finite number > 0 (the RoPE base θ, e.g. 1000000)",
        "rms_norm_eps" => "a finite number > 0 (the RMSNorm epsilon, e.g. 1e-6)",
        "swiglu_limit" => "a finite number > 0 (GPT-OSS: 7)",
        "rope_scaling.factor" | "rope_parameters.factor" => "a finite number >= 1",
        "rope_scaling.beta_fast"
        | "rope_parameters.beta_fast"
        | "rope_scaling.beta_slow"
        | "rope_parameters.beta_slow"
        | "rope_scaling.original_max_position_embeddings"
        | "rope_parameters.original_max_position_embeddings"
        | "rope_scaling.attention_factor"
        | "rope_parameters.attention_factor"
        | "rope_parameters.rope_theta" => "a finite number > 0",
        "mlp_only_layers" => "a list of layer indices",
        "layer_types" => "a list of \"full_attention\" / \"sliding_attention\", one per layer",
        "tie_word_embeddings" | "attention_bias" | "norm_topk_prob" => "true or false",
        _ => return None,
    })
}

/// A wrong-type error with what its key takes ([`expected_of`]) added.
fn with_expected(e: Error) -> Error {
    match e {
        Error::ConfigKey { path, key, message } => {
            let bare = key.split('[').next().unwrap_or(&key);
            let message = match expected_of(bare) {
                Some(what) => format!("{message}; `{bare}` takes {what}"),
                None => message,
            };
            Error::ConfigKey { path, key, message }
        }
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture;

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

    fn write(dir: &Path, v: &serde_json::Value) -> PathBuf {
        let p = dir.join("config.json");
        std::fs::write(&p, v.to_string()).unwrap();
        p
    }

    fn gpt_oss_json() -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(fixture("gpt_oss_mxfp4/config.json")).unwrap()).unwrap()
    }

    #[test]
    fn reads_gpt_oss_hub_spelling() {
        let c = Config::from_dir(&fixture("gpt_oss_mxfp4")).unwrap();
        assert_eq!(c.arch(), Arch::GptOss);
        assert_eq!((c.hidden_size, c.head_dim(), c.num_experts, c.num_experts_per_tok), (64, 16, 8, 4));
        assert_eq!(c.moe_intermediate_size, 64);
        assert!(c.attention_bias);
        assert_eq!(c.moe_layers(), vec![0, 1, 2, 3]);
        assert_eq!(c.layer_types, [LayerType::Sliding, LayerType::Full, LayerType::Sliding, LayerType::Full]);
        assert_eq!((c.attention_window(0), c.attention_window(1)), (Some(8), None));
        assert_eq!(c.swiglu_limit(), 7.0);
        // attention_factor: 0.1 ln(factor) + 1, computed exactly as the config does.
        let yarn = RopeScaling::Yarn {
            factor: 32.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max_position_embeddings: 4096.0,
            truncate: false,
            attention_factor: 0.1 * 32f64.ln() + 1.0,
        };
        assert_eq!(c.rope(), RopeConfig { theta: 150000.0, scaling: yarn });
        assert_eq!(Config::from_dir(&fixture("gpt_oss_bf16")).unwrap(), c);
    }

    #[test]
    fn reads_gpt_oss_transformers5_spelling() {
        let dir = tempfile::tempdir().unwrap();
        let mut v = gpt_oss_json();
        let o = v.as_object_mut().unwrap();
        o.remove("experts_per_token");
        o.remove("layer_types");
        let theta = o.remove("rope_theta").unwrap();
        let mut rp = o.remove("rope_scaling").unwrap();
        rp["rope_theta"] = theta;
        o.insert("rope_parameters".into(), rp);
        o.insert("dtype".into(), o["torch_dtype"].clone());
        o.remove("torch_dtype");
        let a = Config::from_file(&write(dir.path(), &v)).unwrap();
        let b = Config::from_dir(&fixture("gpt_oss_mxfp4")).unwrap();
        assert_eq!((a.rope(), a.num_experts, a.num_experts_per_tok), (b.rope(), 8, 4));
        // transformers' default layer_types: sliding on even layers
        assert_eq!(a.layer_types, b.layer_types);
        // only the hub spelling of top-k
        v.as_object_mut().unwrap().remove("num_experts_per_tok");
        v["experts_per_token"] = 2.into();
        assert_eq!(Config::from_file(&write(dir.path(), &v)).unwrap().num_experts_per_tok, 2);
    }

    #[test]
    fn gpt_oss_bad_values_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = gpt_oss_json();
            f(&mut v);
            // The whole chain: a serde error is the `source()` of `Error::Config`.
            picchio_core::error::chain(&Config::from_file(&write(dir.path(), &v)).unwrap_err()).to_string()
        };
        let e = err(&|v| v["layer_types"] = serde_json::json!(["full_attention"]));
        assert!(e.contains("layer_types") && e.contains("1 entries for num_hidden_layers 4"), "{e}");
        let e = err(&|v| v["layer_types"][2] = "chunked_attention".into());
        assert!(e.contains("chunked_attention"), "{e}");
        let e = err(&|v| {
            v.as_object_mut().unwrap().remove("sliding_window");
        });
        assert!(e.contains("sliding_window") && e.contains("layer 0 is sliding_attention"), "{e}");
        let e = err(&|v| v["rope_scaling"]["rope_type"] = "longrope".into());
        assert!(e.contains("rope_scaling") && e.contains("\"longrope\" is not supported"), "{e}");
        let e = err(&|v| v["experts_per_token"] = 2.into());
        assert!(e.contains("num_experts_per_tok") && e.contains("experts_per_token"), "{e}");
        let e = err(&|v| v["num_experts"] = 4.into());
        assert!(e.contains("num_experts") && e.contains("num_local_experts"), "{e}");
        let e = err(&|v| v["swiglu_limit"] = (-1.0).into());
        assert!(e.contains("swiglu_limit"), "{e}");
    }

    #[test]
    fn sizes_no_checkpoint_has_are_refused_before_they_size_anything() {
        // Regressions (found writing the fuzz target `config`): a GPT-OSS config without layer_types
        // and with num_hidden_layers 10^18 allocated its default layer_types (aborting), a Qwen3 one
        // made moe_layers() loop 10^18 times; sizes past 32 bits were truncated by store_dims into
        // other, valid-looking superblock fields.
        let dir = tempfile::tempdir().unwrap();
        let err = |v: serde_json::Value| {
            picchio_core::error::chain(&Config::from_file(&write(dir.path(), &v)).unwrap_err()).to_string()
        };
        let mut v = gpt_oss_json();
        v.as_object_mut().unwrap().remove("layer_types");
        v["num_hidden_layers"] = 1_000_000_000_000_000_000u64.into();
        let e = err(v);
        assert!(e.contains("num_hidden_layers") && e.contains("more than 65536 layers"), "{e}");
        let qwen: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_moe/config.json")).unwrap()).unwrap();
        let mut v = qwen.clone();
        v["num_hidden_layers"] = (MAX_LAYERS + 1).into();
        assert!(err(v).contains("num_hidden_layers"));
        let mut v = qwen.clone();
        v["moe_intermediate_size"] = (1u64 << 31).into();
        let e = err(v);
        assert!(e.contains("moe_intermediate_size") && e.contains("exceeds 2147483647"), "{e}");
        let mut v = qwen;
        v["num_experts"] = ((1u64 << 32) + 16).into();
        assert!(err(v).contains("`num_experts`"));
        let mut v = gpt_oss_json();
        v["num_hidden_layers"] = MAX_LAYERS.into();
        v.as_object_mut().unwrap().remove("layer_types");
        assert_eq!(Config::from_file(&write(dir.path(), &v)).unwrap().layer_types.len(), MAX_LAYERS);
    }

    #[test]
    fn qwen3_with_yarn_rope_scaling_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_moe/config.json")).unwrap()).unwrap();
        v["rope_scaling"] =
            serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768});
        let c = Config::from_file(&write(dir.path(), &v)).unwrap();
        let RopeScaling::Yarn { factor, beta_fast, original_max_position_embeddings, truncate, .. } = c.rope().scaling
        else {
            panic!()
        };
        assert_eq!((factor, beta_fast, original_max_position_embeddings, truncate), (4.0, 32.0, 32768.0, true));
        assert_eq!(c.layer_type(0), LayerType::Full);
        v["rope_scaling"] = serde_json::json!({"type": "dynamic", "factor": 2.0});
        let e = Config::from_file(&write(dir.path(), &v)).unwrap_err().to_string();
        assert!(e.contains("\"dynamic\" is not supported"), "{e}");
    }

    /// `config.json` = the qwen3_moe fixture's with `f` applied, read: the whole error chain.
    fn qwen3_err(f: &dyn Fn(&mut serde_json::Value)) -> (PathBuf, String) {
        let dir = tempfile::tempdir().unwrap();
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_moe/config.json")).unwrap()).unwrap();
        f(&mut v);
        let p = write(dir.path(), &v);
        let e = picchio_core::error::chain(&Config::from_file(&p).unwrap_err()).to_string();
        (p, e)
    }

    /// Asserts the error names the file, the key, the value and the expected range.
    fn assert_named(f: &dyn Fn(&mut serde_json::Value), key: &str, value: &str, expected: &str) {
        let (p, e) = qwen3_err(f);
        for want in [&p.display().to_string(), &format!("config key `{key}`"), value, expected] {
            assert!(e.contains(want), "no {want:?} in: {e}");
        }
    }

    #[test]
    fn float_values_out_of_range_are_refused_naming_key_value_and_range() {
        let finite = "expected a finite number > 0";
        assert_named(&|v| v["rope_theta"] = 0.0.into(), "rope_theta", ": 0 is out of range", finite);
        assert_named(&|v| v["rope_theta"] = (-1e4).into(), "rope_theta", "-10000 is out of range", finite);
        assert_named(&|v| v["rms_norm_eps"] = 0.0.into(), "rms_norm_eps", ": 0 is out of range", finite);
        assert_named(&|v| v["rms_norm_eps"] = (-1e-6).into(), "rms_norm_eps", "-0.000001 is out of range", finite);
        assert_named(
            &|v| v["rope_parameters"] = serde_json::json!({"rope_theta": -5.0}),
            "rope_parameters",
            "rope_theta -5 is out of range",
            finite,
        );
        assert_named(
            &|v| v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0, "beta_fast": -32.0}),
            "rope_scaling",
            "beta_fast -32 is out of range",
            finite,
        );
        // YaRN's factor: the value as written (not Rust's `Some(0.0)`), or that none is given.
        let (_, e) = qwen3_err(&|v| v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 0}));
        assert!(e.contains("yarn needs a finite `factor` >= 1, got 0") && !e.contains("Some("), "{e}");
        let (_, e) = qwen3_err(&|v| v["rope_scaling"] = serde_json::json!({"rope_type": "yarn"}));
        assert!(e.contains("yarn needs a `factor` (>= 1), and none is given"), "{e}");
        // NaN and infinity cannot be written in JSON; the check refuses them all the same.
        let mut c = Config::from_dir(&fixture("qwen3_moe")).unwrap();
        c.rms_norm_eps = f64::NAN;
        let e = c.check(Path::new("c.json")).unwrap_err().to_string();
        assert!(e.contains("`rms_norm_eps`: NaN is out of range"), "{e}");
        c.rms_norm_eps = 1e-6;
        c.rope_theta = Some(f64::INFINITY);
        let e = c.check(Path::new("c.json")).unwrap_err().to_string();
        assert!(e.contains("`rope_theta`: inf is out of range"), "{e}");
    }

    #[test]
    fn zero_counts_and_inconsistent_heads_and_experts_are_refused() {
        let positive = "expected an integer > 0";
        for key in [
            "num_attention_heads",
            "num_key_value_heads",
            "num_experts",
            "num_experts_per_tok",
            "max_position_embeddings",
        ] {
            assert_named(&|v| v[key] = 0.into(), key, ": 0 is out of range", positive);
        }
        assert_named(&|v| v["num_experts_per_tok"] = 17.into(), "num_experts_per_tok", "17 is out of range", "1..=16");
        assert_named(
            &|v| v["num_key_value_heads"] = 3.into(),
            "num_key_value_heads",
            "3 is out of range",
            "a divisor of num_attention_heads 4",
        );
        assert_named(&|v| v["head_dim"] = 0.into(), "head_dim", ": 0 is out of range", "an even integer > 0");
        assert_named(&|v| v["head_dim"] = 15.into(), "head_dim", "15 is out of range", "an even integer > 0");
        assert_named(
            &|v| {
                v.as_object_mut().unwrap().remove("head_dim");
                v["num_attention_heads"] = 3.into();
                v["num_key_value_heads"] = 1.into();
            },
            "head_dim",
            "hidden_size 64 is not a multiple of num_attention_heads 3",
            "give head_dim",
        );
        assert_named(
            &|v| {
                v["intermediate_size"] = 0.into();
                v["mlp_only_layers"] = serde_json::json!([1]);
            },
            "intermediate_size",
            ": 0 is out of range",
            "layer 1 has a dense MLP",
        );
        // Without a dense layer the width is not used: 0 is accepted.
        let dir = tempfile::tempdir().unwrap();
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_moe/config.json")).unwrap()).unwrap();
        v["intermediate_size"] = 0.into();
        v["mlp_only_layers"] = serde_json::json!([]);
        v["decoder_sparse_step"] = 1.into();
        assert!(Config::from_file(&write(dir.path(), &v)).is_ok());
    }

    #[test]
    fn a_value_of_the_wrong_json_type_names_its_key() {
        assert_named(
            &|v| v["hidden_size"] = "64".into(),
            "hidden_size",
            "invalid type: string \"64\"",
            "expected usize; `hidden_size` takes an integer > 0",
        );
        assert_named(&|v| v["head_dim"] = 1.5.into(), "head_dim", "1.5", "`head_dim` takes an even integer > 0");
        assert_named(&|v| v["num_experts"] = (-3).into(), "num_experts", "-3", "`num_experts` takes an integer > 0");
        assert_named(
            &|v| v["rope_theta"] = "abc".into(),
            "rope_theta",
            "\"abc\"",
            "`rope_theta` takes a finite number > 0 (the RoPE base θ",
        );
        assert_named(
            &|v| v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": "4"}),
            "rope_scaling.factor",
            "invalid type: string \"4\"",
            "expected f64; `rope_scaling.factor` takes a finite number >= 1",
        );
        assert_named(
            &|v| v["mlp_only_layers"] = serde_json::json!([0, "x"]),
            "mlp_only_layers[1]",
            "\"x\"",
            "`mlp_only_layers` takes a list of layer indices",
        );
        assert_named(&|v| v["model_type"] = 3.into(), "model_type", "3", "expected a string");
        // A missing key is named by serde itself.
        let (_, e) = qwen3_err(&|v| {
            v.as_object_mut().unwrap().remove("vocab_size");
        });
        assert!(e.contains("missing field `vocab_size`"), "{e}");
    }

    /// Python's json module writes `NaN`, `Infinity` and `-Infinity` for floats that are not
    /// finite; JSON has none of them. The error names the key, the literal, its line and column.
    #[test]
    fn a_nan_or_infinity_literal_is_named_with_its_key() {
        let text = std::fs::read_to_string(fixture("qwen3_moe/config.json")).unwrap();
        let dir = tempfile::tempdir().unwrap();
        for (literal, key) in [("NaN", "rope_theta"), ("Infinity", "rms_norm_eps"), ("-Infinity", "rope_theta")] {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            let pretty = serde_json::to_string_pretty(&v).unwrap();
            let old = format!("\"{key}\": {}", v[key]);
            assert!(pretty.contains(&old), "{old} in {pretty}");
            let p = dir.path().join("config.json");
            std::fs::write(&p, pretty.replace(&old, &format!("\"{key}\": {literal}"))).unwrap();
            let e = picchio_core::error::chain(&Config::from_file(&p).unwrap_err()).to_string();
            for want in
                [p.display().to_string(), format!("config key `{key}`: {literal} at line "), "is not JSON".into()]
            {
                assert!(e.contains(&want), "{literal}: no {want:?} in: {e}");
            }
        }
        // Elsewhere than a key's value, the line and column.
        let p = dir.path().join("config.json");
        std::fs::write(&p, "{\"layer_types\": [NaN]}").unwrap();
        let e = picchio_core::error::chain(&Config::from_file(&p).unwrap_err()).to_string();
        assert!(e.contains("config key `line 1`: NaN at line 1, column"), "{e}");
    }

    /// A key a config.json may leave out gets transformers' default for its architecture (they
    /// differ: Qwen3MoeConfig's RoPE θ is 10000, GptOssConfig's 150000), never the other model's.
    #[test]
    fn missing_keys_get_the_architectures_transformers_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let read = |name: &str, drop: &[&str]| {
            let mut v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(fixture(&format!("{name}/config.json"))).unwrap())
                    .unwrap();
            for k in drop {
                v.as_object_mut().unwrap().remove(*k);
            }
            Config::from_file(&write(dir.path(), &v)).unwrap()
        };
        let keys = ["rope_theta", "rms_norm_eps", "max_position_embeddings", "rope_scaling", "rope_parameters"];
        let q = read("qwen3_moe", &keys);
        assert_eq!((q.rope_theta(), q.rms_norm_eps, q.max_position_embeddings), (10_000.0, 1e-6, 32_768));
        assert!(matches!(q.rope().scaling, RopeScaling::Default));
        let g = read("gpt_oss_bf16", &keys);
        assert_eq!((g.rope_theta(), g.rms_norm_eps, g.max_position_embeddings), (150_000.0, 1e-5, 131_072));
        let RopeScaling::Yarn { factor, beta_fast, original_max_position_embeddings, truncate, .. } = g.rope().scaling
        else {
            panic!("GPT-OSS defaults to YaRN: {:?}", g.rope())
        };
        assert_eq!((factor, beta_fast, original_max_position_embeddings, truncate), (32.0, 32.0, 4096.0, false));
        // A given value is kept.
        let full = read("gpt_oss_bf16", &[]);
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture("gpt_oss_bf16/config.json")).unwrap()).unwrap();
        assert_eq!(full.rope_theta(), v["rope_theta"].as_f64().unwrap());
    }
}
