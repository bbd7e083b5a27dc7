//! A GGUF model read in place ([`GgufWeights`]): the configuration from its `<arch>.*` metadata,
//! the resident tensors by Hugging Face name through an architecture table ([`GgufArch`]), kept in
//! the ggml types they are stored in ([`Matrix::Ggml`]), and each routed expert's three slabs
//! (gate, up, down) located in the stacked `ffn_*_exps` tensors.
//!
//! The tensor names and shapes follow llama.cpp's loaders (`src/models/qwen3moe.cpp`,
//! `src/models/openai-moe.cpp`, names in `src/llama-arch.cpp`), the keys its
//! `convert_hf_to_gguf.py` writes. GGUF dims list `ne[0]` (the contiguous, innermost one) first,
//! so a PyTorch `[rows, cols]` matrix is the GGUF tensor `[cols, rows]`; a stacked expert tensor
//! `[cols, rows, n_expert]` holds expert `e`'s matrix as its `e`-th run of `rows` rows. Neither
//! architecture permutes Q/K rows (both use NeoX RoPE, which llama.cpp's converter leaves alone).
//!
//! A new architecture is one more [`GgufArch`] entry (its name, model type and the renames where it
//! departs from the common table) plus its math; the loaders ([`super::DecoderLayer`]) are shared.

use std::fs::File;
use std::path::Path;

use memmap2::Mmap;
use picchio_core::format::gguf::{GgmlType, GgufModel, ModelTensor, Value};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::expert::layout::{ExpertLayout, GgufExperts};
use crate::kernels::ggml;
use crate::model::config::Config;
use crate::model::matrix::Matrix;
use crate::model::source::WeightSource;

/// How one llama.cpp architecture (`general.architecture`) maps onto a Hugging Face model type.
#[derive(Debug, PartialEq, Eq)]
pub struct GgufArch {
    /// `general.architecture` (`qwen3moe`, `gpt-oss`), also the prefix of its hyperparameter keys.
    pub name: &'static str,
    /// The Hugging Face `model_type` whose math runs it (`qwen3_moe`, `gpt_oss`).
    pub model_type: &'static str,
    /// Per-layer renames that differ from [`LAYER_NAMES`]: `(Hugging Face suffix after
    /// `model.layers.N.`, GGUF suffix after `blk.N.`)`, looked up first.
    pub layer_names: &'static [(&'static str, &'static str)],
}

/// The architectures this runtime runs from a GGUF.
pub const ARCHS: [GgufArch; 2] = [
    GgufArch {
        name: "qwen3moe",
        model_type: "qwen3_moe",
        layer_names: &[
            ("post_attention_layernorm.weight", "ffn_norm.weight"),
            ("mlp.gate.weight", "ffn_gate_inp.weight"),
        ],
    },
    GgufArch {
        name: "gpt-oss",
        model_type: "gpt_oss",
        layer_names: &[
            ("post_attention_layernorm.weight", "post_attention_norm.weight"),
            ("self_attn.sinks", "attn_sinks.weight"),
            ("mlp.router.weight", "ffn_gate_inp.weight"),
            ("mlp.router.bias", "ffn_gate_inp.bias"),
            ("mlp.experts.down_proj_bias", "ffn_down_exps.bias"),
        ],
    },
];

/// The per-layer renames every architecture shares (llama-arch.cpp's `LLM_TENSOR_*` names).
pub const LAYER_NAMES: [(&str, &str); 15] = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.q_proj.bias", "attn_q.bias"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.k_proj.bias", "attn_k.bias"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.v_proj.bias", "attn_v.bias"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.o_proj.bias", "attn_output.bias"),
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
];

/// The model-level renames (`model.embed_tokens.weight` → `token_embd.weight`, …).
pub const MODEL_NAMES: [(&str, &str); 3] = [
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

/// The three stacked expert tensors of a layer, in payload order: gate, up, down.
pub const EXPERT_TENSORS: [&str; 3] = ["ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"];

/// One expert matrix of one layer: the stacked tensor's ggml type, the type it has in a cache slot
/// and its bytes there. Quantized types and F32/BF16 are kept as stored (`ty == stored`, `bytes` =
/// `rows * cols / block_elems * block_bytes`); F16 is widened to F32 as it is copied (there is no
/// F16 kernel; F16 experts are for oracle files, not for models streamed from disk).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExpertSlab {
    /// The ggml type in the slot: the stored one, or F32 for F16.
    pub ty: GgmlType,
    /// The ggml type in the GGUF.
    pub stored: GgmlType,
    /// Bytes of one expert's slab in the slot.
    pub bytes: usize,
}

impl ExpertSlab {
    /// Bytes of one expert's slab in the GGUF.
    pub fn stored_bytes(&self) -> usize {
        match (self.stored, self.ty) {
            (GgmlType::F16, GgmlType::F32) => self.bytes / 2,
            _ => self.bytes,
        }
    }
}

/// Whether experts of ggml type `ty` can be computed: the quantized types with a dot product
/// ([`ggml::DOT_TYPES`]), F32, BF16, and F16 (widened to F32 in the slot).
pub fn expert_type_supported(ty: GgmlType) -> bool {
    ggml::vec_dot_type(ty).is_some() || matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// A GGUF model (one file or split files) opened for reading in place: metadata parsed once, every
/// file memory-mapped read-only.
pub struct GgufWeights {
    model: GgufModel,
    arch: &'static GgufArch,
    maps: Vec<Mmap>,
    fingerprint: [u8; 32],
}

impl std::fmt::Debug for GgufWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufWeights").field("path", &self.path()).field("arch", &self.arch.name).finish()
    }
}

/// Whether `path` names a GGUF file: a file (not a directory) whose first four bytes are `GGUF`.
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file() && File::open(path).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && &magic == b"GGUF"
}

impl GgufWeights {
    /// Opens the GGUF at `path` (every file of a split model), checks that its
    /// `general.architecture` is one of [`ARCHS`], maps its files and computes its fingerprint
    /// (SHA-256 over each file's length and its header, key/value and tensor-info bytes).
    ///
    /// # Errors
    /// [`Error::Gguf`] for a file that is not a valid GGUF (naming file, offset and field);
    /// [`Error::GgufModel`] for an architecture this runtime does not run; [`Error::Io`] naming the
    /// file when it cannot be mapped.
    pub fn open(path: &Path) -> Result<GgufWeights> {
        let model = GgufModel::open(path)?;
        let meta = model.meta();
        let name = meta.get_str("general.architecture")?;
        let arch = ARCHS.iter().find(|a| a.name == name).ok_or_else(|| Error::GgufModel {
            path: path.into(),
            message: format!(
                "general.architecture is {name:?}; this runtime runs {}",
                ARCHS.iter().map(|a| format!("{:?}", a.name)).collect::<Vec<_>>().join(", ")
            ),
        })?;
        let mut maps = Vec::with_capacity(model.files().len());
        let mut hash = Sha256::new();
        for f in model.files() {
            let file = File::open(f.path()).map_err(Error::io(f.path(), "open"))?;
            let map = crate::sys::map_readonly(f.path(), &file)?;
            if (map.len() as u64) < f.len() {
                return Err(Error::GgufModel {
                    path: f.path().into(),
                    message: format!("the file shrank to {} bytes after it was read ({} before)", map.len(), f.len()),
                });
            }
            hash.update(f.len().to_le_bytes());
            hash.update(&map[..f.data_offset() as usize]);
            maps.push(map);
        }
        Ok(GgufWeights { model, arch, maps, fingerprint: hash.finalize().into() })
    }

    /// The path the model was opened with (its first file).
    pub fn path(&self) -> &Path {
        self.model.meta().path()
    }

    /// The parsed GGUF (files, metadata, tensor infos).
    pub fn gguf(&self) -> &GgufModel {
        &self.model
    }

    /// The architecture table entry.
    pub fn arch(&self) -> &'static GgufArch {
        self.arch
    }

    /// SHA-256 over each file's length and its bytes before the tensor data (header, metadata,
    /// tensor infos): what a bundle built from this GGUF records to tell a stale one.
    pub fn fingerprint(&self) -> &[u8; 32] {
        &self.fingerprint
    }

    /// The model's configuration, from `<arch>.*` keys (llama.cpp's `LLM_KV_*` names), as the
    /// Hugging Face config of the architecture's `model_type` would give it, checked as
    /// [`Config::parse`] checks a config.json. The vocabulary size is `token_embd.weight`'s row
    /// count; `tie_word_embeddings` is the absence of `output.weight`. Qwen3-MoE GGUFs route with
    /// renormalised top-k weights and have every layer MoE (llama.cpp's qwen3moe graph hard-codes
    /// both); GPT-OSS layers alternate sliding (even) and full (odd) attention as llama.cpp's
    /// `load_swa_pattern(ml, 2)` sets them, clamp the SwiGLU at 7 as its `swiglu_oai` does, and
    /// round YaRN's correction dims outward as ggml does (transformers' `truncate: true`).
    ///
    /// # Errors
    /// [`Error::Gguf`] naming a missing key or one of the wrong type; the errors of
    /// [`Config::parse`], naming the GGUF file.
    pub fn config(&self) -> Result<Config> {
        let m = self.model.meta();
        let a = self.arch.name;
        let key = |k: &str| format!("{a}.{k}");
        let uint = |k: &str| -> Result<u64> { Ok(m.get_uint(&key(k))?) };
        let opt_uint = |k: &str| -> Result<Option<u64>> {
            match m.get(&key(k)) {
                None => Ok(None),
                Some(_) => uint(k).map(Some),
            }
        };
        let float = |k: &str| -> Result<Option<f64>> {
            match m.get(&key(k)) {
                None => Ok(None),
                Some(Value::F32(v)) => Ok(Some(f64::from(*v))),
                Some(Value::F64(v)) => Ok(Some(*v)),
                Some(v) => Err(Error::GgufModel {
                    path: self.path().into(),
                    message: format!("key `{}` is {}, expected f32", key(k), v.type_name()),
                }),
            }
        };
        let embd = self.model.tensor("token_embd.weight")?;
        let vocab = match embd.info.dims.as_slice() {
            [_, v] => *v,
            dims => {
                return Err(Error::GgufModel {
                    path: self.model.path_of(embd).into(),
                    message: format!("tensor `token_embd.weight` has dims {dims:?}, expected 2"),
                })
            }
        };
        let hidden = uint("embedding_length")?;
        let heads = uint("attention.head_count")?;
        let layers = uint("block_count")?;
        let head_dim = opt_uint("attention.key_length")?.unwrap_or(hidden.checked_div(heads).unwrap_or(0));
        let expert_ff = uint("expert_feed_forward_length")?;
        let mut cfg = json!({
            "model_type": self.arch.model_type,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": opt_uint("feed_forward_length")?.unwrap_or(expert_ff),
            "moe_intermediate_size": expert_ff,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": opt_uint("attention.head_count_kv")?.unwrap_or(heads),
            "head_dim": head_dim,
            "num_experts": uint("expert_count")?,
            "num_experts_per_tok": uint("expert_used_count")?,
            "rms_norm_eps": float("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6),
            "rope_theta": float("rope.freq_base")?.unwrap_or(10_000.0),
            "max_position_embeddings": uint("context_length")?,
            "tie_word_embeddings": self.model.tensor("output.weight").is_err(),
        });
        if let Some(eos) = m.get("tokenizer.ggml.eos_token_id").and_then(Value::as_u64) {
            cfg["eos_token_id"] = json!(eos);
        }
        match self.arch.model_type {
            "qwen3_moe" => {
                cfg["norm_topk_prob"] = json!(true);
            }
            _ => {
                // gpt_oss: the expert width is `intermediate_size` in its Hugging Face config.
                cfg["intermediate_size"] = json!(expert_ff);
                cfg["attention_bias"] = json!(true);
                cfg["swiglu_limit"] = json!(7.0);
                if let Some(w) = opt_uint("attention.sliding_window")? {
                    cfg["sliding_window"] = json!(w);
                }
                let types: Vec<&str> =
                    (0..layers).map(|l| if l % 2 == 0 { "sliding_attention" } else { "full_attention" }).collect();
                cfg["layer_types"] = json!(types);
                if let Ok("yarn") = m.get_str(&key("rope.scaling.type")) {
                    cfg["rope_scaling"] = json!({
                        "rope_type": "yarn",
                        "factor": float("rope.scaling.factor")?.unwrap_or(1.0),
                        "original_max_position_embeddings": opt_uint("rope.scaling.original_context_length")?,
                        "beta_fast": 32.0,
                        "beta_slow": 1.0,
                        // ggml rounds the YaRN correction dims outward always
                        // (`ggml_rope_yarn_corr_dims`: floorf/ceilf), which is transformers'
                        // `truncate: true` (tests/fixtures/gguf/models/gpt_oss_yarn_check.json).
                        "truncate": true,
                    });
                }
            }
        }
        Config::parse(&cfg.to_string(), self.path())
    }

    /// The GGUF name of the Hugging Face tensor `name`, or `None` when the table has no entry.
    pub fn gguf_name(&self, name: &str) -> Option<String> {
        if let Some((_, g)) = MODEL_NAMES.iter().find(|(hf, _)| *hf == name) {
            return Some((*g).to_owned());
        }
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, suffix) = rest.split_once('.')?;
        if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let g =
            self.arch.layer_names.iter().chain(LAYER_NAMES.iter()).find(|(hf, _)| *hf == suffix).map(|(_, g)| *g)?;
        Some(format!("blk.{layer}.{g}"))
    }

    /// The GGUF tensor behind Hugging Face name `name`.
    fn lookup(&self, name: &str) -> Result<&ModelTensor> {
        let g = self.gguf_name(name).ok_or_else(|| Error::GgufModel {
            path: self.path().into(),
            message: format!("no GGUF tensor corresponds to `{name}` for architecture {}", self.arch.name),
        })?;
        Ok(self.model.tensor(&g)?)
    }

    /// The bytes of tensor `t` (in its file's map).
    fn bytes(&self, t: &ModelTensor) -> &[u8] {
        let r = &t.info.range;
        &self.maps[t.file][r.start as usize..r.end as usize]
    }

    /// Checks `t`'s dims equal `shape` (PyTorch order, outermost first) and returns its values
    /// dequantized to f32 in row-major order.
    fn f32_values(&self, hf: &str, t: &ModelTensor, shape: &[usize]) -> Result<Vec<f32>> {
        self.expect_dims(hf, t, shape)?;
        let mut out = vec![0f32; shape.iter().product()];
        ggml::dequantize(t.info.ty, self.bytes(t), &mut out).map_err(|e| self.tensor_error(t, e.to_string()))?;
        Ok(out)
    }

    fn expect_dims(&self, hf: &str, t: &ModelTensor, shape: &[usize]) -> Result<()> {
        let found: Vec<usize> = t.info.dims.iter().rev().map(|&d| d as usize).collect();
        if found != shape {
            return Err(Error::TensorShape {
                path: self.model.path_of(t).into(),
                name: format!("{} (as {hf})", t.info.name),
                expected: shape.to_vec(),
                found,
            });
        }
        Ok(())
    }

    fn tensor_error(&self, t: &ModelTensor, message: String) -> Error {
        Error::GgufModel {
            path: self.model.path_of(t).into(),
            message: format!("tensor `{}` ({}) at offset {:#x}: {message}", t.info.name, t.info.ty, t.info.range.start),
        }
    }

    /// The slabs of layer `layer`'s stacked expert tensors (gate, up, down), each checked to be
    /// `[n_expert, inter, hidden]` (down: `[n_expert, hidden, inter]`, PyTorch order) of a type
    /// with a dot product ([`ggml::DOT_TYPES`]).
    ///
    /// # Errors
    /// [`Error::Gguf`] for a missing tensor; [`Error::TensorShape`] or [`Error::GgufModel`] for a
    /// shape or type that does not fit.
    pub fn expert_slabs(&self, layer: usize, cfg: &Config) -> Result<[ExpertSlab; 3]> {
        let (h, i, e) = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts);
        let mut out = [ExpertSlab { ty: GgmlType::F32, stored: GgmlType::F32, bytes: 0 }; 3];
        for (k, suffix) in EXPERT_TENSORS.iter().enumerate() {
            let t = self.model.tensor(&format!("blk.{layer}.{suffix}"))?;
            let (rows, cols) = if k == 2 { (h, i) } else { (i, h) };
            self.expect_dims(suffix, t, &[e, rows, cols])?;
            let stored = t.info.ty;
            if !expert_type_supported(stored) {
                return Err(self.tensor_error(
                    t,
                    format!(
                        "experts of type {stored} are not supported (supported: F32, F16, BF16, {:?})",
                        ggml::DOT_TYPES
                    ),
                ));
            }
            let ty = if stored == GgmlType::F16 { GgmlType::F32 } else { stored };
            let bytes = rows * cols / ty.block_elems() as usize * ty.block_bytes() as usize;
            out[k] = ExpertSlab { ty, stored, bytes };
        }
        Ok(out)
    }

    /// The expert payload layout of the model ([`ExpertLayout::gguf`]): every MoE layer's slabs.
    ///
    /// # Errors
    /// As [`GgufWeights::expert_slabs`].
    pub fn expert_layout(&self, cfg: &Config) -> Result<ExpertLayout> {
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| if cfg.is_moe_layer(l) { self.expert_slabs(l, cfg).map(Some) } else { Ok(None) })
            .collect::<Result<Vec<_>>>()?;
        Ok(ExpertLayout::gguf(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            GgufExperts { layers: layers.into(), fingerprint: self.fingerprint },
        ))
    }

    /// The bytes the resident part takes once loaded: every tensor but the stacked expert weights
    /// (`blk.N.ffn_{gate,up,down}_exps.weight`), as [`WeightSource::matrix`] and
    /// [`WeightSource::f32_tensor`] keep them (F16 widened to f32, the rest as stored; 1-D tensors
    /// and expert biases widened to f32).
    pub fn dense_bytes(&self) -> u64 {
        let mut total = 0u64;
        for t in self.model.tensors() {
            let name = &t.info.name;
            if EXPERT_TENSORS.iter().any(|s| name.ends_with(s)) {
                continue;
            }
            let widened = t.info.dims.len() == 1 || name.ends_with(".bias") || t.info.ty == GgmlType::F16;
            total += if widened { 4 * t.info.n_elems() } else { t.info.n_bytes() };
        }
        total
    }

    /// Copies expert `expert`'s gate, up and down slabs of layer `layer` into `out`, one after
    /// another ([`GgufWeights::expert_slabs`] gives their lengths): the payload of a GGUF expert.
    ///
    /// # Errors
    /// [`Error::Gguf`] for a missing tensor; [`Error::GgufModel`] when `out` is shorter than the
    /// three slabs or the expert is outside the tensor.
    pub fn expert_payload(&self, layer: usize, expert: usize, slabs: &[ExpertSlab; 3], out: &mut [u8]) -> Result<()> {
        let mut at = 0;
        for (suffix, slab) in EXPERT_TENSORS.iter().zip(slabs) {
            let t = self.model.tensor(&format!("blk.{layer}.{suffix}"))?;
            let src = self.bytes(t);
            let n = slab.stored_bytes();
            let range = expert * n..(expert + 1) * n;
            let (Some(src), Some(dst)) = (src.get(range.clone()), out.get_mut(at..at + slab.bytes)) else {
                return Err(self.tensor_error(
                    t,
                    format!("expert {expert} (bytes {range:?}) does not fit the tensor or the {}-byte slot", out.len()),
                ));
            };
            if slab.stored == slab.ty {
                dst.copy_from_slice(src);
            } else {
                for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(2)) {
                    let v = ggml::floats::f16_to_f32(u16::from_le_bytes([s[0], s[1]]));
                    d.copy_from_slice(&v.to_le_bytes());
                }
            }
            at += slab.bytes;
        }
        Ok(())
    }

    /// Drops the mapped pages of expert `expert`'s three slabs of layer `layer` from the resident
    /// set (after they were copied), as the safetensors fallback does.
    pub fn release_expert(&self, layer: usize, expert: usize, slabs: &[ExpertSlab; 3]) {
        for (suffix, slab) in EXPERT_TENSORS.iter().zip(slabs) {
            if let Ok(t) = self.model.tensor(&format!("blk.{layer}.{suffix}")) {
                let n = slab.stored_bytes();
                let start = t.info.range.start as usize + expert * n;
                crate::sys::drop_mapped_pages(self.model.path_of(t), &self.maps[t.file], start..start + n);
            }
        }
    }

    /// `blk.{layer}.{gate,up}_exps.bias` `[E, I]` interleaved into `[E, 2I]` (row `2i` the gate's
    /// bias `i`, row `2i + 1` the up's), the layout of Picchio's `gate_up_proj_bias`.
    fn gate_up_bias(&self, hf: &str, layer: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let [e, i2] = shape else {
            return Err(Error::GgufModel { path: self.path().into(), message: format!("`{hf}` is 2-D") });
        };
        let i = i2 / 2;
        let gate = self.model.tensor(&format!("blk.{layer}.ffn_gate_exps.bias"))?;
        let up = self.model.tensor(&format!("blk.{layer}.ffn_up_exps.bias"))?;
        let g = self.f32_values(hf, gate, &[*e, i])?;
        let u = self.f32_values(hf, up, &[*e, i])?;
        let mut out = Vec::with_capacity(e * i2);
        for (gr, ur) in g.chunks_exact(i.max(1)).zip(u.chunks_exact(i.max(1))) {
            for (a, b) in gr.iter().zip(ur) {
                out.extend([*a, *b]);
            }
        }
        Ok(out)
    }
}

impl WeightSource for GgufWeights {
    fn contains(&self, name: &str) -> bool {
        if name.ends_with("mlp.experts.gate_up_proj_bias") {
            return true;
        }
        self.gguf_name(name).is_some_and(|g| self.model.tensor(&g).is_ok())
    }

    /// F32 and the types ggml-cpu multiplies are kept as stored (F32 as [`Matrix::F32`]; BF16 and
    /// the quantized types with a dot product as [`Matrix::Ggml`], computed as ggml computes them:
    /// BF16 by [`ggml::bf16`], with the input rounded to BF16); F16 is widened to f32.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let t = self.lookup(name)?;
        self.expect_dims(name, t, &[rows, cols])?;
        let bytes = self.bytes(t);
        Ok(match t.info.ty {
            GgmlType::F32 | GgmlType::F16 => Matrix::F32(self.f32_values(name, t, &[rows, cols])?),
            ty if ty == GgmlType::BF16 || ggml::vec_dot_type(ty).is_some() => Matrix::Ggml { ty, data: bytes.to_vec() },
            ty => {
                return Err(Error::TensorDtype {
                    path: self.model.path_of(t).into(),
                    name: t.info.name.clone(),
                    expected: format!("F32, F16, BF16 or one of {:?}", ggml::DOT_TYPES),
                    found: ty.to_string(),
                })
            }
        })
    }

    fn f32_tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        if let Some(rest) = name.strip_prefix("model.layers.") {
            if let Some(layer) = rest.strip_suffix(".mlp.experts.gate_up_proj_bias") {
                return self.gate_up_bias(name, layer, shape);
            }
        }
        let t = self.lookup(name)?;
        self.f32_values(name, t, shape)
    }

    fn release_all(&self) {
        for (f, map) in self.model.files().iter().zip(&self.maps) {
            crate::sys::drop_mapped_pages(f.path(), map, 0..map.len());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_onto_llama_cpp_tensors() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gguf/qwen3_tokenizer.gguf");
        let model = GgufModel::open(&path).unwrap();
        let w = GgufWeights { model, arch: &ARCHS[0], maps: Vec::new(), fingerprint: [0; 32] };
        let cases = [
            ("model.embed_tokens.weight", Some("token_embd.weight")),
            ("lm_head.weight", Some("output.weight")),
            ("model.layers.3.self_attn.q_proj.weight", Some("blk.3.attn_q.weight")),
            ("model.layers.0.post_attention_layernorm.weight", Some("blk.0.ffn_norm.weight")),
            ("model.layers.12.mlp.gate.weight", Some("blk.12.ffn_gate_inp.weight")),
            ("model.layers.x.mlp.gate.weight", None),
            ("model.layers.1.mlp.experts.0.gate_proj.weight", None),
        ];
        for (hf, g) in cases {
            assert_eq!(w.gguf_name(hf).as_deref(), g, "{hf}");
        }
        let w = GgufWeights { arch: &ARCHS[1], ..w };
        assert_eq!(
            w.gguf_name("model.layers.2.post_attention_layernorm.weight").unwrap(),
            "blk.2.post_attention_norm.weight"
        );
        assert_eq!(w.gguf_name("model.layers.2.self_attn.sinks").unwrap(), "blk.2.attn_sinks.weight");
        assert_eq!(w.gguf_name("model.layers.2.mlp.router.bias").unwrap(), "blk.2.ffn_gate_inp.bias");
    }

    #[test]
    fn a_file_that_is_not_gguf_is_not_taken_for_one() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.gguf");
        std::fs::write(&p, b"GGU").unwrap();
        assert!(!is_gguf(&p) && !is_gguf(dir.path()));
        std::fs::write(&p, b"GGUF\x03\0\0\0").unwrap();
        assert!(is_gguf(&p));
    }
}
