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
//!
//! The converted directory is a [`PayloadSource`]; [`pack_to`] hands it to the image writer
//! ([`crate::image::write::write_image`]), which writes a file, a block device
//! (`--out raw:/dev/X[@BYTES]`) or an NVMe namespace (`--out nvme:BDF[/NSID]`), inspecting,
//! announcing and reading back as it does for `picchio synth`.

use std::path::{Path, PathBuf};

use picchio_core::format::{plan_image_len, ImageSink};
use picchio_core::loader::StoreDims;
use picchio_core::{FlatWriter, StoreUri, Superblock};

use crate::error::{Error, Result};
use crate::expert::layout::ExpertLayout;
use crate::expert::store::{store_dims, DEFAULT_IMAGE};
use crate::image::record::{record_for, RecordModel};
use crate::image::write::{write_image, PayloadSource, Plan, ReportHead, WriteOptions, WriteReport, WriteTo};
use crate::model::config::Config;
use crate::model::dir::ModelDir;
use crate::model::safetensors::TensorStore;
use crate::progress;
use crate::quant::QuantKind;

use picchio_core::format::DENSE_LAYER_PLACEHOLDER;

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
    /// The model directory recorded in the superblock's reserved bytes, so that a front end given
    /// only the store finds the model ([`crate::image::record`]; docs/format.md, "Model record").
    /// Default: the packed directory.
    pub record: RecordModel,
}

impl Default for PackOptions {
    fn default() -> Self {
        PackOptions { layers: None, progress: true, record: RecordModel::Packed }
    }
}

/// What [`pack`] wrote: the image writer's report with pack's summary (fields reachable
/// through `Deref`: `report.experts`).
pub type PackReport = WriteReport<Packed>;

/// Pack's part of a [`PackReport`].
#[derive(Clone, Debug)]
pub struct Packed {
    /// The converted directory.
    pub model_dir: PathBuf,
    /// Expert quantization detected in the converted directory.
    pub quant: QuantKind,
    /// Bytes of one expert payload.
    pub payload_len: usize,
    /// Expert payloads written.
    pub experts: usize,
    /// Slots of dense-MLP layers holding [`DENSE_LAYER_PLACEHOLDER`].
    pub placeholders: usize,
    /// This process's peak resident set after the last payload, bytes ([`crate::plan::peak_rss`];
    /// `None` off Linux): a few payloads beyond the program itself, whatever the image size, since
    /// each expert's mapped pages are dropped once copied.
    pub peak_rss: Option<u64>,
}

impl ReportHead for Packed {
    fn fmt_head(r: &WriteReport<Packed>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (dest, sb, bytes, elapsed) = (&r.dest, &r.superblock, r.bytes, r.elapsed);
        let layers = sb.image_layers();
        writeln!(f, "packed {} -> {dest}", r.model_dir.display())?;
        write!(
            f,
            "  {} experts ({}, {} bytes each) from {layers} of {} layers",
            r.experts, r.quant, r.payload_len, sb.n_layers
        )?;
        if layers < sb.n_layers {
            write!(f, " (prefix store: later layers are served from safetensors)")?;
        }
        if r.placeholders > 0 {
            write!(f, "; {} dense-MLP layer slots hold the placeholder", r.placeholders)?;
        }
        write!(f, "\n  {} entries, {} bytes, {:.2?}", sb.n_entries, bytes, elapsed)?;
        if let Some(rss) = r.peak_rss {
            write!(f, "; peak RSS {:.1} MB ({rss} bytes)", rss as f64 / 1e6)?;
        }
        Ok(())
    }
}

/// A converted directory opened for packing, with the image's geometry known before any byte is
/// written.
struct Source {
    model_dir: PathBuf,
    progress: bool,
    cfg: Config,
    store: TensorStore,
    layout: ExpertLayout,
    layers: usize,
    n_entries: u32,
    record: Option<picchio_core::format::ModelRecord>,
}

impl Source {
    fn open(model_dir: &Path, opts: &PackOptions) -> Result<Source> {
        // config.json is read once: parsed here, and its SHA-256 recorded from the same bytes.
        let model = ModelDir::open(model_dir)?;
        let cfg = model.config().clone();
        let store = TensorStore::open(model_dir)?;
        if let Some(&l) = cfg.moe_layers().first() {
            let hf = format!("model.layers.{l}.mlp.experts.0.gate_proj.weight");
            let fused = format!("model.layers.{l}.mlp.experts.gate_up_proj");
            if store.contains(&hf) || store.contains(&fused) {
                return Err(Error::NotConverted { dir: model_dir.into(), tensor: None, pack: true });
            }
        }
        let layout = ExpertLayout::detect(&store, &cfg)?;
        let n_layers = cfg.num_hidden_layers;
        let layers = opts.layers.unwrap_or(n_layers);
        if layers == 0 || layers > n_layers {
            return Err(Error::BadOption {
                option: "--layers",
                value: layers.to_string(),
                expected: format!("the model has {n_layers} layers (use 1..={n_layers})"),
            });
        }
        let n_entries = u32::try_from(layers * cfg.num_experts)
            .map_err(|_| Error::TooManyEntries { layers: layers as u64, experts: cfg.num_experts as u64 })?;
        let record = record_for(&model, &opts.record)?;
        Ok(Source {
            model_dir: model_dir.into(),
            progress: opts.progress,
            cfg,
            store,
            layout,
            layers,
            n_entries,
            record,
        })
    }
}

impl PayloadSource for Source {
    type Summary = Packed;

    fn command(&self) -> &'static str {
        "pack"
    }

    fn progress(&self) -> bool {
        self.progress
    }

    fn dims(&self) -> StoreDims {
        store_dims(&self.cfg)
    }

    fn n_entries(&self) -> u32 {
        self.n_entries
    }

    /// The image size — superblock and index blocks, then one padded payload per entry (a dense
    /// layer's slots one block each) — checked against the format's limits before anything is
    /// written ([`picchio_core::format::plan_image_len`]), `dest` named in the error.
    fn plan(&self, dest: &Path) -> Result<u64> {
        let experts = self.cfg.num_experts;
        let payload = self.layout.len() as u64;
        let placeholder = DENSE_LAYER_PLACEHOLDER.len() as u64;
        let lens = (0..self.layers).flat_map(|l| {
            let len = if self.cfg.is_moe_layer(l) { payload } else { placeholder };
            std::iter::repeat_n(len, experts)
        });
        Ok(plan_image_len(dest, store_dims(&self.cfg), self.n_entries, lens)?)
    }

    fn write<S: ImageSink>(&self, mut w: FlatWriter<S>) -> Result<(Superblock, Packed)> {
        let bar = progress::bar(u64::from(self.n_entries), "pack", !self.progress);
        let mut payload = vec![0u8; self.layout.len()];
        let (mut experts, mut placeholders) = (0, 0);
        let wanted = self.n_entries as usize;
        for l in 0..self.layers {
            let moe = self.cfg.is_moe_layer(l);
            for e in 0..self.cfg.num_experts {
                // SIGINT/SIGTERM: the error drops `w`, which removes its temporary file.
                crate::interrupt::check(experts + placeholders, wanted, "payloads")?;
                if moe {
                    self.layout.payload_from_store(&self.store, l, e, &mut payload)?;
                    w.push(&payload)?;
                    experts += 1;
                } else {
                    w.push(DENSE_LAYER_PLACEHOLDER)?;
                    placeholders += 1;
                }
                bar.inc(1);
            }
        }
        if let Some(r) = &self.record {
            w.set_model_record(r.clone())?;
        }
        let superblock = w.finish()?;
        bar.finish_and_clear();
        let packed = Packed {
            model_dir: self.model_dir.clone(),
            quant: self.layout.quant,
            payload_len: self.layout.len(),
            experts,
            placeholders,
            peak_rss: crate::plan::peak_rss(),
        };
        Ok((superblock, packed))
    }
}

/// Packs the routed experts of the converted directory `model_dir` into the image file `out`
/// ([`pack_to`] a `file:` target).
///
/// # Errors
/// [`Error::Io`], [`Error::Config`], … from opening the directory; [`Error::NotConverted`] for a
/// Hugging Face checkpoint that was not converted, [`Error::BadOption`] for `layers` out of range; [`Error::MissingTensor`],
/// [`Error::TensorDtype`], [`Error::TensorShape`] for an expert tensor; [`Error::Store`] when writing
/// the image fails; [`Error::NotReplaced`] when `out` exists and is not a `.picchioflat` image (see
/// [`crate::image::write::check_replaceable`]). On error no image (and no temporary file) is left at
/// `out`, and an existing file there is unchanged.
pub fn pack(model_dir: &Path, out: &Path, opts: &PackOptions) -> Result<PackReport> {
    pack_to(model_dir, WriteTo::Uri(&StoreUri::File(out.into())), opts, &WriteOptions::default(), &mut |_| {})
}

/// Packs the routed experts of `model_dir` to `to` through the image writer
/// ([`crate::image::write::write_image`]: a file, `raw:/dev/X[@BYTES]` or `nvme:BDF[/NSID]`, with
/// the writer's inspection, `announce`, refusals and read-back).
///
/// A file that may not be replaced is refused before the directory is opened.
///
/// # Errors
/// As [`pack`] for the model; as [`crate::image::write::write_image`] for the target.
pub fn pack_to(
    model_dir: &Path,
    to: WriteTo<'_>,
    opts: &PackOptions,
    wopts: &WriteOptions,
    announce: &mut dyn FnMut(&Plan<'_>),
) -> Result<PackReport> {
    if let WriteTo::Uri(StoreUri::File(out)) = &to {
        crate::image::write::check_replaceable(out, "pack")?;
    }
    let src = Source::open(model_dir, opts)?;
    write_image(to, &src, wopts, announce)
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
