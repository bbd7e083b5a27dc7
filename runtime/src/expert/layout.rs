//! One routed expert's payload: its layout in a `.picchioflat` slot and in a converted directory
//! (the safetensors loader that reads it from the directory is [`crate::expert::safetensors`]).
//!
//! Payload (DESIGN.md, "`.picchioflat` version 2"), for hidden size H and expert width I:
//!
//! | part | matrix | bytes |
//! | --- | --- | --- |
//! | gate_up packed | [2I, H], rows interleaved (2i = gate row i, 2i+1 = up row i) | `quant.packed_bytes(2I, H)` |
//! | gate_up scales | f32 [2I, H/64] | `4 × quant.scale_count(2I, H)` |
//! | down packed | [H, I] | `quant.packed_bytes(H, I)` |
//! | down scales | f32 [H, I/64] | `4 × quant.scale_count(H, I)` |
//!
//! In a converted directory the four parts are the tensors `model.layers.L.mlp.experts.E.gate_up_proj`,
//! `…gate_up_proj.qs`, `…down_proj`, `…down_proj.qs` (GPT-OSS spelling, [`ExpertNaming::Suffixed`]:
//! `model.layers.L.mlp.experts.gate_up_proj.E`, `….gate_up_proj.E.qs`, `….down_proj.E`,
//! `….down_proj.E.qs`): U8 (Q4/Q3) with F32 scales, or F32 without scales for `none`. Expert
//! biases (GPT-OSS) are resident tensors, not part of the payload.
//!
//! A GGUF model's expert payload ([`ExpertLayout::gguf`]) is instead its three slabs as the GGUF
//! stores them, one after another: gate `[I, H]`, up `[I, H]`, down `[H, I]`, each in its stacked
//! tensor's ggml type, which may differ per layer (Q4_K_M keeps some layers' `ffn_down_exps` in
//! Q6_K); [`GgufExperts`] gives the types per layer and the slot holds the largest layer's payload.

use std::ops::Range;
use std::sync::Arc;

use picchio_core::format::{LayerDesc, SlabDesc};
use picchio_core::BundleExpect;
use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::model::config::{Arch, Config};
use crate::model::gguf::ExpertSlab;
use crate::model::safetensors::TensorStore;
use crate::quant::QuantKind;

/// How a converted directory names an expert's tensors (DESIGN.md, "Converted model directory").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertNaming {
    /// Qwen3-MoE (and Picchio (C)): `model.layers.L.mlp.experts.E.gate_up_proj`.
    #[default]
    PerExpert,
    /// GPT-OSS: `model.layers.L.mlp.experts.gate_up_proj.E`.
    Suffixed,
}

impl ExpertNaming {
    /// The spelling of `arch`'s converted directories.
    pub fn for_arch(arch: Arch) -> Self {
        match arch {
            Arch::Qwen3Moe => ExpertNaming::PerExpert,
            Arch::GptOss => ExpertNaming::Suffixed,
        }
    }
}

/// The slabs of a GGUF model's experts, per layer: `None` for a layer without routed experts, else
/// gate, up and down (their ggml types and bytes per expert), as
/// [`crate::model::gguf::GgufWeights::expert_slabs`] reads them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufExperts {
    /// Per decoder layer.
    pub layers: Arc<[Option<[ExpertSlab; 3]>]>,
    /// The GGUF's fingerprint ([`crate::model::gguf::GgufWeights::fingerprint`]): what a bundle of
    /// these experts records, and must record to be used for them.
    pub fingerprint: [u8; 32],
}

impl GgufExperts {
    /// The layer table of a bundle of these experts (docs/format.md, "version 3"): per decoder
    /// layer, gate, up and down with their slot and GGUF ggml type ids and bytes per expert.
    pub fn layer_descs(&self) -> Vec<LayerDesc> {
        let slab =
            |s: &ExpertSlab| SlabDesc { ty: s.ty.traits().id, stored: s.stored.traits().id, bytes: s.bytes as u64 };
        self.layers
            .iter()
            .map(|l| LayerDesc { slabs: l.as_ref().map(|s| [slab(&s[0]), slab(&s[1]), slab(&s[2])]) })
            .collect()
    }

    /// What a bundle must hold to serve these experts ([`picchio_core::FlatStore::open_bundle`]).
    pub fn bundle_expect(&self) -> BundleExpect {
        BundleExpect { fingerprint: self.fingerprint, layers: self.layer_descs() }
    }

    /// Bytes of one expert's payload of `layer` (`None` for a layer without routed experts).
    pub fn payload_len(&self, layer: usize) -> Option<usize> {
        self.slabs(layer).map(|s| s.iter().map(|x| x.bytes).sum())
    }

    /// The slabs of `layer`, or `None` for a layer without routed experts (or out of range).
    pub fn slabs(&self, layer: usize) -> Option<&[ExpertSlab; 3]> {
        self.layers.get(layer).and_then(Option::as_ref)
    }

    /// Bytes of the largest layer's payload (gate + up + down): the slot size.
    pub fn max_len(&self) -> usize {
        self.layers.iter().flatten().map(|s| s.iter().map(|x| x.bytes).sum::<usize>()).max().unwrap_or(0)
    }
}

/// Byte ranges of the four parts of one expert's payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertLayout {
    /// Quantization of both matrices (a GGUF layout keeps `F32` here; its types are in `ggml`).
    pub quant: QuantKind,
    /// For a GGUF model, the per-layer slabs that make the payload (the ranges below are then
    /// empty and unused); `None` for the `.picchioflat` payload of a converted directory.
    pub ggml: Option<GgufExperts>,
    /// Tensor names of the experts in a converted directory.
    pub naming: ExpertNaming,
    /// Hidden size H.
    pub hidden: usize,
    /// Expert width I (gate_up has 2I rows).
    pub inter: usize,
    /// gate_up packed weights.
    pub gate_up: Range<usize>,
    /// gate_up f32 scales (empty for `none`).
    pub gate_up_scales: Range<usize>,
    /// down packed weights.
    pub down: Range<usize>,
    /// down f32 scales (empty for `none`).
    pub down_scales: Range<usize>,
}

/// The converted-directory tensor names of one expert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertTensorNames {
    /// `model.layers.L.mlp.experts.E.gate_up_proj`
    pub gate_up: String,
    /// `….gate_up_proj.qs`
    pub gate_up_qs: String,
    /// `model.layers.L.mlp.experts.E.down_proj`
    pub down: String,
    /// `….down_proj.qs`
    pub down_qs: String,
}

impl ExpertTensorNames {
    /// Names for `(layer, expert)` in the Qwen3-MoE spelling ([`ExpertNaming::PerExpert`]).
    pub fn new(layer: usize, expert: usize) -> Self {
        Self::with(ExpertNaming::PerExpert, layer, expert)
    }

    /// Names for `(layer, expert)` in `naming`'s spelling.
    pub fn with(naming: ExpertNaming, layer: usize, expert: usize) -> Self {
        // `model.layers.L.mlp.experts.E.gate_up_proj` or `model.layers.L.mlp.experts.gate_up_proj.E`.
        let (p, e) = match naming {
            ExpertNaming::PerExpert => (format!("model.layers.{layer}.mlp.experts.{expert}"), String::new()),
            ExpertNaming::Suffixed => (format!("model.layers.{layer}.mlp.experts"), format!(".{expert}")),
        };
        ExpertTensorNames {
            gate_up: format!("{p}.gate_up_proj{e}"),
            gate_up_qs: format!("{p}.gate_up_proj{e}.qs"),
            down: format!("{p}.down_proj{e}"),
            down_qs: format!("{p}.down_proj{e}.qs"),
        }
    }
}

impl ExpertLayout {
    /// The layout for hidden size `hidden` and expert width `inter`.
    ///
    /// # Errors
    /// [`Error::Quant`] when a quantized format gets a width that is not a multiple of 64.
    pub fn new(quant: QuantKind, hidden: usize, inter: usize) -> Result<Self> {
        let q = |r: Result<usize, crate::quant::QuantError>| r.map_err(Error::from);
        let gu = q(quant.packed_bytes(2 * inter, hidden))?;
        let gus = 4 * q(quant.scale_count(2 * inter, hidden))?;
        let d = q(quant.packed_bytes(hidden, inter))?;
        let ds = 4 * q(quant.scale_count(hidden, inter))?;
        Ok(ExpertLayout {
            quant,
            ggml: None,
            naming: ExpertNaming::PerExpert,
            hidden,
            inter,
            gate_up: 0..gu,
            gate_up_scales: gu..gu + gus,
            down: gu + gus..gu + gus + d,
            down_scales: gu + gus + d..gu + gus + d + ds,
        })
    }

    /// The payload of a GGUF model's experts: per layer, its gate, up and down slabs as stored
    /// ([`GgufExperts`]); [`ExpertLayout::len`] is the largest layer's.
    pub fn gguf(hidden: usize, inter: usize, experts: GgufExperts) -> Self {
        let len = experts.max_len();
        ExpertLayout {
            quant: QuantKind::F32,
            ggml: Some(experts),
            naming: ExpertNaming::PerExpert,
            hidden,
            inter,
            gate_up: 0..0,
            gate_up_scales: 0..0,
            down: 0..0,
            down_scales: 0..len,
        }
    }

    /// The same layout with `naming`'s tensor names.
    pub fn with_naming(mut self, naming: ExpertNaming) -> Self {
        self.naming = naming;
        self
    }

    /// The converted-directory tensor names of `(layer, expert)`.
    pub fn names(&self, layer: usize, expert: usize) -> ExpertTensorNames {
        ExpertTensorNames::with(self.naming, layer, expert)
    }

    /// Exact payload bytes of one expert.
    pub fn len(&self) -> usize {
        self.down_scales.end
    }

    /// Always false (an expert has weights).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Detects the quantization of a converted directory from the first MoE layer's expert 0
    /// (U8 → Q4 or Q3 by byte count, F32 → none), and checks that the sizes match the config.
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::TensorDtype`], [`Error::TensorShape`]; [`Error::Invalid`]
    /// when the config has no MoE layer.
    pub fn detect(store: &TensorStore, cfg: &Config) -> Result<Self> {
        let layer = *cfg.moe_layers().first().ok_or_else(|| Error::Invalid("the config has no MoE layer".into()))?;
        let naming = ExpertNaming::for_arch(cfg.arch());
        let names = ExpertTensorNames::with(naming, layer, 0);
        let t = store.get(&names.gate_up)?;
        let (h, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
        let quant = match t.dtype {
            Dtype::F32 => QuantKind::F32,
            Dtype::U8 => {
                let n = t.bytes.len();
                if Ok(n) == QuantKind::Q4.packed_bytes(2 * i, h) {
                    QuantKind::Q4
                } else if Ok(n) == QuantKind::Q3.packed_bytes(2 * i, h) {
                    QuantKind::Q3
                } else {
                    return Err(Error::TensorShape {
                        path: t.path.into(),
                        name: t.name.into(),
                        expected: vec![QuantKind::Q4.packed_bytes(2 * i, h).unwrap_or(0)],
                        found: t.shape.into(),
                    });
                }
            }
            _ => return Err(t.dtype_error("U8 (Q4/Q3 experts) or F32 (unquantized experts)")),
        };
        Ok(Self::new(quant, h, i)?.with_naming(naming))
    }

    /// Copies the expert's four tensors from a converted directory into `out[..self.len()]`, then
    /// drops their mapped pages from the resident set ([`TensorStore::release`]).
    ///
    /// # Errors
    /// [`Error::MissingTensor`], or [`Error::TensorDtype`] / [`Error::TensorShape`] when a tensor's
    /// dtype or byte size differs from the layout.
    pub fn payload_from_store(&self, store: &TensorStore, layer: usize, expert: usize, out: &mut [u8]) -> Result<()> {
        let names = self.names(layer, expert);
        let packed_dtype = if self.quant == QuantKind::F32 { Dtype::F32 } else { Dtype::U8 };
        let parts = [
            (&names.gate_up, &self.gate_up, packed_dtype),
            (&names.gate_up_qs, &self.gate_up_scales, Dtype::F32),
            (&names.down, &self.down, packed_dtype),
            (&names.down_qs, &self.down_scales, Dtype::F32),
        ];
        for (name, range, dtype) in parts {
            if range.is_empty() {
                continue;
            }
            let t = store.get(name)?;
            if t.dtype != dtype {
                return Err(t.dtype_error(&format!("{dtype:?}")));
            }
            if t.bytes.len() != range.len() {
                return Err(Error::TensorShape {
                    path: t.path.into(),
                    name: t.name.into(),
                    expected: vec![range.len() / dtype.bitsize().div_ceil(8)],
                    found: t.shape.into(),
                });
            }
            out[range.clone()].copy_from_slice(t.bytes);
            // The copy is what counts: the mapped pages leave the resident set, so packing (or
            // the safetensors fallback) never holds more than the expert being copied.
            store.release(name);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use picchio_core::AlignedBuf;

    #[test]
    fn real_qwen3_30b_expert_is_648_blocks() {
        // Qwen3-30B-A3B: hidden 2048, moe_intermediate_size 768.
        let l = ExpertLayout::new(QuantKind::Q4, 2048, 768).unwrap();
        assert_eq!(l.len(), 2_654_208);
        assert_eq!(l.len() % 4096, 0);
        assert_eq!(l.gate_up_scales.start, 1536 * 1024);
    }

    #[test]
    fn real_gpt_oss_expert_is_the_synth_geometry() {
        // gpt-oss-20b and -120b: hidden 2880, intermediate_size 2880.
        let l = ExpertLayout::new(QuantKind::Q4, 2880, 2880).unwrap().with_naming(ExpertNaming::Suffixed);
        assert_eq!(l.len(), 13_996_800);
        assert_eq!(l.len() as u64, crate::image::synthetic_image::Geometry::gpt_oss_20b().expert_bytes);
        assert_eq!(l.len() as u64, crate::image::synthetic_image::Geometry::gpt_oss_120b().expert_bytes);
        let n = l.names(23, 31);
        assert_eq!(
            (n.gate_up.as_str(), n.gate_up_qs.as_str(), n.down.as_str(), n.down_qs.as_str()),
            (
                "model.layers.23.mlp.experts.gate_up_proj.31",
                "model.layers.23.mlp.experts.gate_up_proj.31.qs",
                "model.layers.23.mlp.experts.down_proj.31",
                "model.layers.23.mlp.experts.down_proj.31.qs"
            )
        );
    }

    #[test]
    fn picchio_c_directory_is_detected_as_q4() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/picchio_c/qwen3_moe");
        let store = TensorStore::open(&dir).unwrap();
        let cfg = Config::from_dir(&dir).unwrap();
        let l = ExpertLayout::detect(&store, &cfg).unwrap();
        assert_eq!(l.quant, QuantKind::Q4);
        let mut slot = AlignedBuf::new(l.len(), 4096).unwrap();
        l.payload_from_store(&store, 2, 15, slot.as_mut_slice()).unwrap();
        let e = l.payload_from_store(&store, 3, 0, slot.as_mut_slice()).unwrap_err().to_string();
        assert!(e.contains("model.layers.3.mlp.experts.0.gate_up_proj"), "{e}");
    }
}
