//! `picchio pack`: a converted directory's routed experts → a `.picchioflat` v2 image, through
//! [`picchio_core::FlatWriter`] (temporary file + atomic rename).
//!
//! Payloads go in (layer, expert) order, one per index slot `layer * n_experts + expert`, for the
//! first `layers` decoder layers (all of them by default; fewer make a prefix store). The payload of a
//! MoE layer's expert is [`ExpertLayout::payload_from_store`]'s bytes, so packing a Picchio (C)
//! converted directory reproduces Picchio (C)'s own image byte for byte.
//!
//! A dense-MLP layer (`mlp_only_layers`, `decoder_sparse_step`) has no experts, but the index still
//! gives it `n_experts` slots. Each gets [`DENSE_LAYER_PLACEHOLDER`]: a valid entry (aligned, one
//! block, correct hash) whose length can never equal an expert payload, so a store opened for the
//! model (with [`picchio_core::StoreExpect`]) rejects it and anything requesting such an expert falls back and fails
//! loudly instead of computing with made-up weights. Nothing requests them: dense layers never route.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use picchio_core::{FlatWriter, Superblock};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::expert::ExpertLayout;
use crate::progress;
use crate::quant::QuantKind;
use crate::safetensors::TensorStore;
use crate::store::{store_dims, DEFAULT_IMAGE};

/// The payload of every index slot of a dense-MLP layer (32 bytes, one 4 KiB block on disk).
///
/// No expert payload has this length: an unquantized one is 12·H·I bytes (never 32), a Q4 one
/// 27·H·I/16 and a Q3 one 21·H·I/16 bytes with H, I ≥ 64.
pub const DENSE_LAYER_PLACEHOLDER: &[u8; 32] = b"PICCHIO:DENSE-MLP-LAYER:NOEXPERT";

/// The image `pack` writes by default: `<model_dir>/experts.picchioflat`.
pub fn default_store_path(model_dir: &Path) -> PathBuf {
    model_dir.join(DEFAULT_IMAGE)
}

/// Options of [`pack`].
#[derive(Clone, Debug)]
pub struct PackOptions {
    /// Pack only the first N decoder layers (`--layers N`): a prefix store of N × n_experts entries
    /// whose superblock still records the model's n_layers. Default: every layer.
    pub layers: Option<usize>,
    /// Show a progress bar on stderr (default; it is hidden anyway when stderr is not a terminal).
    pub progress: bool,
}

impl Default for PackOptions {
    fn default() -> Self {
        PackOptions { layers: None, progress: true }
    }
}

/// What [`pack`] wrote.
#[derive(Clone, Debug)]
pub struct PackReport {
    /// The converted directory.
    pub model_dir: PathBuf,
    /// The image.
    pub path: PathBuf,
    /// Its superblock.
    pub superblock: Superblock,
    /// Expert quantization detected in the converted directory.
    pub quant: QuantKind,
    /// Bytes of one expert payload.
    pub payload_len: usize,
    /// Expert payloads written.
    pub experts: usize,
    /// Slots of dense-MLP layers holding [`DENSE_LAYER_PLACEHOLDER`].
    pub placeholders: usize,
    /// Image size in bytes.
    pub bytes: u64,
    /// Wall time.
    pub elapsed: Duration,
}

impl std::fmt::Display for PackReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sb = &self.superblock;
        let layers = sb.n_entries / sb.n_experts.max(1);
        writeln!(f, "packed {} -> {}", self.model_dir.display(), self.path.display())?;
        write!(
            f,
            "  {} experts ({}, {} bytes each) from {layers} of {} layers",
            self.experts, self.quant, self.payload_len, sb.n_layers
        )?;
        if layers < sb.n_layers {
            write!(f, " (prefix store: later layers are served from safetensors)")?;
        }
        if self.placeholders > 0 {
            write!(f, "; {} dense-MLP layer slots hold the placeholder", self.placeholders)?;
        }
        write!(f, "\n  {} entries, {} bytes, {:.2?}", sb.n_entries, self.bytes, self.elapsed)
    }
}

/// Packs the routed experts of the converted directory `model_dir` into the image `out`.
///
/// # Errors
/// [`Error::Io`], [`Error::Config`], … from opening the directory; [`Error::Invalid`] for a
/// Hugging Face checkpoint that was not converted, or `layers` out of range; [`Error::MissingTensor`],
/// [`Error::TensorDtype`], [`Error::TensorShape`] for an expert tensor; [`Error::Store`] when writing
/// the image fails. On error no image (and no temporary file) is left at `out`.
pub fn pack(model_dir: &Path, out: &Path, opts: &PackOptions) -> Result<PackReport> {
    let t0 = Instant::now();
    let cfg = Config::from_dir(model_dir)?;
    let store = TensorStore::open(model_dir)?;
    if let Some(&l) = cfg.moe_layers().first() {
        let hf = format!("model.layers.{l}.mlp.experts.0.gate_proj.weight");
        let fused = format!("model.layers.{l}.mlp.experts.gate_up_proj");
        if store.contains(&hf) || store.contains(&fused) {
            return Err(Error::Invalid(format!(
                "{}: a Hugging Face checkpoint, not a converted directory: run `picchio convert` on it first and \
                 pack the converted directory",
                model_dir.display()
            )));
        }
    }
    let layout = ExpertLayout::detect(&store, &cfg)?;
    let dims = store_dims(&cfg);
    let n_layers = cfg.num_hidden_layers;
    let layers = opts.layers.unwrap_or(n_layers);
    if layers == 0 || layers > n_layers {
        return Err(Error::Invalid(format!("--layers {layers}: the model has {n_layers} layers (use 1..={n_layers})")));
    }
    let n_entries = u32::try_from(layers * cfg.num_experts)
        .map_err(|_| Error::Invalid(format!("{layers} layers × {} experts exceed u32 entries", cfg.num_experts)))?;
    let mut w = FlatWriter::create(out, dims, n_entries)?;
    let bar = progress::bar(u64::from(n_entries), "pack", !opts.progress);
    let mut payload = vec![0u8; layout.len()];
    let (mut experts, mut placeholders) = (0, 0);
    for l in 0..layers {
        let moe = cfg.is_moe_layer(l);
        for e in 0..cfg.num_experts {
            if moe {
                layout.payload_from_store(&store, l, e, &mut payload)?;
                w.push(&payload)?;
                experts += 1;
            } else {
                w.push(DENSE_LAYER_PLACEHOLDER)?;
                placeholders += 1;
            }
            bar.inc(1);
        }
    }
    let superblock = w.finish()?;
    bar.finish_and_clear();
    let bytes = std::fs::metadata(out).map_err(Error::io(out, "stat the packed image"))?.len();
    Ok(PackReport {
        model_dir: model_dir.into(),
        path: out.into(),
        superblock,
        quant: layout.quant,
        payload_len: layout.len(),
        experts,
        placeholders,
        bytes,
        elapsed: t0.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholder_never_has_an_expert_payload_length() {
        for h in (64..=4096).step_by(64) {
            for i in (64..=2048).step_by(64) {
                for q in QuantKind::ALL {
                    assert_ne!(ExpertLayout::new(q, h, i).unwrap().len(), DENSE_LAYER_PLACEHOLDER.len());
                }
            }
        }
        // unquantized experts allow any width: 12·H·I is never 32
        assert!((1..=32).all(|h| (1..=32).all(|i| ExpertLayout::new(QuantKind::F32, h, i).unwrap().len() != 32)));
    }
}
