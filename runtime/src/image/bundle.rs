//! `picchio pack model.gguf`: a GGUF's routed experts → its expert bundle, a `.picchioflat` version
//! 3 image (docs/format.md, "version 3"), through the one image writer
//! ([`crate::image::write::write_image`]: a file, `raw:`, `nvme:` or `nvme-tcp://`).
//!
//! Each payload is what the in-place loader ([`crate::expert::gguf::GgufInPlace`]) puts in a cache
//! slot: the expert's gate, up and down slabs copied from the GGUF's stacked tensors
//! (`blk.N.ffn_{gate,up,down}_exps`, [`GgufWeights::expert_payload`]): the bytes as the GGUF
//! stores them (F16 widened to F32, as the kernels take it). Layers may differ in their slabs'
//! types and lengths; the superblock records the GGUF's path and fingerprint, and the layer table
//! every layer's slabs, so a run finds a stale or foreign bundle before reading a payload. A
//! layer without routed experts gets [`DENSE_LAYER_PLACEHOLDER`] in each slot, as in version 2.
//!
//! The default bundle of `X.gguf` is `X.gguf.picchioflat` beside it
//! ([`crate::expert::store::default_image`]), where `--store auto` looks for it.

use std::path::{Path, PathBuf};

use picchio_core::format::{
    bundle_data_offset, data_offset, plan_image_len, GgufSource, ImageSink, DENSE_LAYER_PLACEHOLDER,
};
use picchio_core::loader::StoreDims;
use picchio_core::{FlatWriter, Superblock};

use crate::error::{Error, Result};
use crate::expert::layout::GgufExperts;
use crate::expert::store::store_dims;
use crate::image::write::{PayloadSource, ReportHead, WriteReport};
use crate::model::config::Config;
use crate::model::gguf::GgufWeights;
use crate::progress;

/// What [`crate::image::pack::pack_to`] wrote for a GGUF.
pub type BundleReport = WriteReport<Bundled>;

/// The bundle's part of a [`BundleReport`].
#[derive(Clone, Debug)]
pub struct Bundled {
    /// The GGUF (its absolute path, as recorded).
    pub gguf: PathBuf,
    /// Expert payloads written.
    pub experts: usize,
    /// Slots of layers without routed experts holding [`DENSE_LAYER_PLACEHOLDER`].
    pub placeholders: usize,
    /// Distinct payload lengths, smallest first (more than one when layers differ in their types).
    pub payload_lens: Vec<usize>,
}

impl ReportHead for Bundled {
    fn fmt_head(r: &WriteReport<Bundled>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (sb, bytes, elapsed) = (&r.superblock, r.bytes, r.elapsed);
        writeln!(f, "packed {} -> {} (expert bundle, format version {})", r.gguf.display(), r.dest, sb.version)?;
        let lens = r.payload_lens.iter().map(usize::to_string).collect::<Vec<_>>().join(", ");
        write!(f, "  {} experts ({lens} bytes each) from {} of {} layers", r.experts, sb.image_layers(), sb.n_layers)?;
        if r.placeholders > 0 {
            write!(f, "; {} slots of layers without experts hold the placeholder", r.placeholders)?;
        }
        write!(f, "\n  {} entries, {} bytes, {:.2?}", sb.n_entries, bytes, elapsed)
    }
}

/// A GGUF opened for packing.
pub(crate) struct GgufBundle {
    weights: GgufWeights,
    gguf: PathBuf,
    cfg: Config,
    experts: GgufExperts,
    layers: usize,
    n_entries: u32,
    progress: bool,
}

impl GgufBundle {
    /// Opens the GGUF `path` for a bundle of its first `layers` layers (all by default).
    ///
    /// # Errors
    /// As [`GgufWeights::open`], [`GgufWeights::config`], [`GgufWeights::expert_layout`];
    /// [`Error::BadOption`] for `layers` out of range; [`Error::Io`] when the path cannot be made
    /// absolute.
    pub(crate) fn open(path: &Path, layers: Option<usize>, progress: bool) -> Result<GgufBundle> {
        let weights = GgufWeights::open(path)?;
        let cfg = weights.config()?;
        let layout = weights.expert_layout(&cfg)?;
        let experts = layout.ggml.clone().expect("a GGUF layout has its slabs");
        let n_layers = cfg.num_hidden_layers;
        let layers = layers.unwrap_or(n_layers);
        if layers == 0 || layers > n_layers {
            return Err(Error::BadOption {
                option: "--layers",
                value: layers.to_string(),
                expected: format!("the model has {n_layers} layers (use 1..={n_layers})"),
            });
        }
        let n_entries = u32::try_from(layers * cfg.num_experts)
            .map_err(|_| Error::TooManyEntries { layers: layers as u64, experts: cfg.num_experts as u64 })?;
        let gguf = std::path::absolute(path).map_err(Error::io(path, "make the GGUF's path absolute"))?;
        Ok(GgufBundle { weights, gguf, cfg, experts, layers, n_entries, progress })
    }

    fn len_of(&self, layer: usize) -> u64 {
        self.experts.payload_len(layer).unwrap_or(DENSE_LAYER_PLACEHOLDER.len()) as u64
    }
}

impl PayloadSource for GgufBundle {
    type Summary = Bundled;

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

    /// The image size: as a version 2 image of these payloads, plus the layer table's blocks
    /// between the index and the data.
    fn plan(&self, dest: &Path) -> Result<u64> {
        let e = self.cfg.num_experts;
        let lens = (0..self.layers).flat_map(|l| std::iter::repeat_n(self.len_of(l), e));
        let v2 = plan_image_len(dest, self.dims(), self.n_entries, lens)?;
        let table = bundle_data_offset(self.n_entries, self.dims().n_layers) - data_offset(self.n_entries);
        Ok(v2 + table)
    }

    fn write<S: ImageSink>(&self, mut w: FlatWriter<S>) -> Result<(Superblock, Bundled)> {
        let source = GgufSource { path: self.gguf.clone(), fingerprint: *self.weights.fingerprint() };
        w.set_bundle(source, &self.experts.layer_descs())?;
        let bar = progress::bar(u64::from(self.n_entries), "pack", !self.progress);
        let mut payload = vec![0u8; self.experts.max_len()];
        let (mut experts, mut placeholders) = (0, 0);
        let wanted = self.n_entries as usize;
        for l in 0..self.layers {
            for e in 0..self.cfg.num_experts {
                // SIGINT/SIGTERM: the error drops `w`, which removes its temporary file.
                crate::interrupt::check(experts + placeholders, wanted, "payloads")?;
                match self.experts.slabs(l) {
                    Some(slabs) => {
                        let len = self.len_of(l) as usize;
                        self.weights.expert_payload(l, e, slabs, &mut payload[..len])?;
                        self.weights.release_expert(l, e, slabs);
                        w.push(&payload[..len])?;
                        experts += 1;
                    }
                    None => {
                        w.push(DENSE_LAYER_PLACEHOLDER)?;
                        placeholders += 1;
                    }
                }
                bar.inc(1);
            }
        }
        let superblock = w.finish()?;
        bar.finish_and_clear();
        let mut payload_lens: Vec<usize> = (0..self.layers).filter_map(|l| self.experts.payload_len(l)).collect();
        payload_lens.sort_unstable();
        payload_lens.dedup();
        Ok((superblock, Bundled { gguf: self.gguf.clone(), experts, placeholders, payload_lens }))
    }
}

/// Packs the routed experts of the GGUF `gguf` into its expert bundle at `to` through the image
/// writer ([`crate::image::write::write_image`]; the default place is
/// [`crate::expert::store::default_image`]), its first `layers` layers (all by default). An existing
/// bundle (or any `.picchioflat` image) at a file target is replaced, as `pack` replaces images.
///
/// # Errors
/// As [`GgufBundle::open`] for the GGUF; [`Error::NotReplaced`] for a file target that is not an
/// image; as [`crate::image::write::write_image`] for the target.
pub fn pack_gguf_to(
    gguf: &Path,
    to: crate::image::write::WriteTo<'_>,
    layers: Option<usize>,
    progress: bool,
    wopts: &crate::image::write::WriteOptions,
    announce: &mut dyn FnMut(&crate::image::write::Plan<'_>),
) -> Result<BundleReport> {
    if let crate::image::write::WriteTo::Uri(picchio_core::StoreUri::File(out)) = &to {
        crate::image::write::check_replaceable(out, "pack")?;
    }
    let src = GgufBundle::open(gguf, layers, progress)?;
    crate::image::write::write_image(to, &src, wopts, announce)
}
