//! Opening the expert store a run asks for (`--store`) as one [`ExpertLoader`], with the converted
//! safetensors experts behind it as the fallback for any expert the store cannot serve. The engine
//! under a flat store comes from [`crate::expert::open::open_engine`]; this module only assembles
//! the loader on it (it is the one that imports the other, never the reverse).

use std::path::Path;
use std::sync::Arc;

use picchio_core::loader::StoreDims;
use picchio_core::{
    ExpertLoader, FallbackLoader, FlatStore, FlatStoreOptions, IoQueue, IoStats, StoreExpect, StoreUri,
};

use crate::error::{Error, Result};
use crate::expert::layout::ExpertLayout;
use crate::expert::open::{open_engine, EngineOptions, Opened};
use crate::model::config::Config;

/// The default image name inside a converted model directory.
pub const DEFAULT_IMAGE: &str = "experts.picchioflat";

/// The default image of the model at `model`: `<model>/experts.picchioflat` for a converted
/// directory, the expert bundle `<model>.picchioflat` beside a GGUF file (`X.gguf` →
/// `X.gguf.picchioflat`; docs/format.md, "version 3").
pub fn default_image(model: &Path, gguf: bool) -> std::path::PathBuf {
    if gguf {
        let mut name = model.as_os_str().to_os_string();
        name.push(".picchioflat");
        name.into()
    } else {
        model.join(DEFAULT_IMAGE)
    }
}

/// What was opened, for reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreInfo {
    /// `safetensors` or `file:PATH`.
    pub store: String,
    /// The engine, e.g. `psync(direct, 2 threads)`, or `safetensors (mmap)`.
    pub engine: String,
}

/// The model dimensions a `.picchioflat` superblock must carry for `cfg`.
pub fn store_dims(cfg: &Config) -> StoreDims {
    StoreDims {
        hidden: cfg.hidden_size as u32,
        n_layers: cfg.num_hidden_layers as u32,
        n_experts: cfg.num_experts as u32,
        topk: cfg.num_experts_per_tok as u32,
        moe_inter: 2 * cfg.moe_intermediate_size as u32,
    }
}

/// Opens the `.picchioflat` image `uri` names through [`open_engine`], checked against the model.
///
/// A `raw:` image is read at the device offsets (`FlatStoreOptions::base_offset`), an `nvme:` one
/// from LBA 0. For `nvme:`, the controller must already be bound to `vfio-pci` and 2 MiB hugepages
/// reserved (tests/vm shows the steps); expert reads are zero-copy once the expert cache takes its
/// slots from the driver's hugepage DMA pool ([`crate::expert::cache::ExpertCache::use_slots_from`],
/// done by [`crate::run::Session::open`]); reads into any other buffer go through per-command bounce
/// buffers and are counted (`bounce_bytes`).
///
/// `verify` checks every payload's hash prefix after reading it (`--verify`).
///
/// # Errors
/// As [`open_engine`]; [`Error::Store`] for a rejected superblock, index hash or dimensions.
pub fn open_flat(
    uri: &StoreUri,
    cfg: &Config,
    layout: &ExpertLayout,
    engine: EngineOptions,
    verify: bool,
) -> Result<FlatStore<Box<dyn IoQueue>>> {
    flat_from(open_engine(uri, engine)?, cfg, layout, verify)
}

/// The image an opened engine reads, checked against the model (`verify`: every payload's hash
/// prefix is checked after reading). For a GGUF model (`layout.ggml`) the image must be its expert
/// bundle ([`FlatStore::open_bundle`]: version 3, the GGUF's fingerprint, the same per-layer slabs). The store reads at `opened.base` plus each image offset and
/// keeps `opened.lock` for as long as it lives, dropping it after the queue
/// ([`FlatStore::with_guard`]).
///
/// # Errors
/// [`Error::Store`] for a rejected superblock, index hash or dimensions;
/// [`picchio_core::Error::NotThisBundle`] in it for a bundle of another GGUF, a stale one, or a
/// version 2 image given for a GGUF (or a bundle given for a converted directory).
pub fn flat_from(
    opened: Opened,
    cfg: &Config,
    layout: &ExpertLayout,
    verify: bool,
) -> Result<FlatStore<Box<dyn IoQueue>>> {
    let opts = FlatStoreOptions {
        base_offset: opened.base,
        image_len: opened.image_len,
        verify,
        expect: Some(StoreExpect { dims: store_dims(cfg), payload_len: layout.len() as u32 }),
        recheck_every: RECHECK_EVERY,
    };
    let store = match &layout.ggml {
        Some(g) => FlatStore::open_bundle(opened.queue, opened.name, opts, &g.bundle_expect())?,
        None => FlatStore::open(opened.queue, opened.name, opts)?,
    };
    Ok(match opened.lock {
        Some(lock) => store.with_guard(lock),
        None => store,
    })
}

/// How often a run's flat store compares the superblock on the target with the one it opened: after
/// every this many MoE-layer batches that read something (about one token of a 48-layer model), one
/// 4 KiB read, besides the check after any failed read ([`FlatStore`], "An image that changes under
/// its reader").
pub const RECHECK_EVERY: u32 = 64;

/// The image at LBA 0 of an open NVMe queue's namespace (the controller model in tests, whose
/// `Sim` handle injects faults), named `name`, checked against the model like [`open_flat`].
///
/// # Errors
/// [`Error::Store`] for a rejected superblock, index hash or dimensions.
#[cfg(target_os = "linux")]
pub fn open_nvme_flat(
    name: String,
    queue: picchio_nvme::NvmeQueue,
    cfg: &Config,
    layout: &ExpertLayout,
    verify: bool,
) -> Result<FlatStore<Box<dyn IoQueue>>> {
    let image_len = queue.namespace().bytes();
    flat_from(Opened { queue: Box::new(queue), base: 0, image_len, name, lock: None }, cfg, layout, verify)
}

/// Opens a `.picchioflat` file; see [`open_flat`].
///
/// # Errors
/// As [`open_flat`].
pub fn open_flat_file(
    path: &Path,
    cfg: &Config,
    layout: &ExpertLayout,
    engine: EngineOptions,
    verify: bool,
) -> Result<FlatStore<Box<dyn IoQueue>>> {
    open_flat(&StoreUri::File(path.into()), cfg, layout, engine, verify)
}

/// Opens `uri` for the model in `model_dir` and returns the loader (flat store with the model's
/// in-place loader as its fallback, or the in-place loader alone), what it is, and the statistics
/// it updates. `fallback` is [`crate::model::Model::in_place_loader`]: the directory's safetensors
/// experts, or a GGUF's own expert tensors.
///
/// `auto` uses the model's default image ([`default_image`]: `<model_dir>/experts.picchioflat`, or
/// `X.gguf.picchioflat` beside a GGUF `X.gguf`) when it exists and passes every check (if O_DIRECT
/// is refused by the file system it retries buffered), else logs why in one line and uses the
/// in-place loader (a stale or foreign GGUF bundle: what differs, and that `picchio pack --force`
/// rebuilds it). An explicit store that fails to open is an error.
///
/// # Errors
/// As [`open_flat`].
pub fn open_store(
    uri: &StoreUri,
    model_dir: &Path,
    cfg: &Config,
    fallback: Box<dyn ExpertLoader>,
    layout: &ExpertLayout,
    engine: EngineOptions,
    verify: bool,
) -> Result<(Box<dyn ExpertLoader>, StoreInfo, Arc<IoStats>)> {
    let stats = Arc::new(IoStats::default());
    let safetensors_only = |fallback: Box<dyn ExpertLoader>, stats| {
        // "safetensors:<dir>" or "gguf:<file>": the kind of file the experts are copied from.
        let kind = fallback.describe().split(':').next().unwrap_or("safetensors").to_owned();
        let info = StoreInfo { store: kind.clone(), engine: format!("{kind} (mmap copy)") };
        Ok((fallback, info, stats))
    };
    match uri {
        StoreUri::Safetensors => safetensors_only(fallback, stats),
        StoreUri::Auto => {
            let p = default_image(model_dir, layout.ggml.is_some());
            let kind = if layout.ggml.is_some() { "the GGUF in place" } else { "safetensors" };
            if !p.exists() {
                tracing::info!("{} not found: serving experts from {kind}", p.display());
                return safetensors_only(fallback, stats);
            }
            let attempt = open_flat_file(&p, cfg, layout, engine, verify).or_else(|e| {
                if engine.direct && matches!(e, Error::Engine(picchio_blockdev::Error::DirectUnsupported { .. })) {
                    tracing::warn!(
                        "{}; retrying without O_DIRECT (use --buffered to skip this)",
                        picchio_core::error::chain(&e)
                    );
                    open_flat_file(&p, cfg, layout, EngineOptions { direct: false, ..engine }, verify)
                } else {
                    Err(e)
                }
            });
            match attempt {
                Ok(flat) => Ok(wrap(flat, fallback, stats)),
                Err(Error::Store(e @ picchio_core::Error::NotThisBundle { .. })) => {
                    tracing::warn!(
                        "stale or foreign bundle: {e}; serving experts from {kind} (`picchio pack {} --force` rebuilds it)",
                        model_dir.display()
                    );
                    safetensors_only(fallback, stats)
                }
                Err(e) => {
                    tracing::warn!("{e}: serving experts from {kind} instead (run `picchio pack` to rebuild)");
                    safetensors_only(fallback, stats)
                }
            }
        }
        _ => Ok(wrap(open_flat(uri, cfg, layout, engine, verify)?, fallback, stats)),
    }
}

/// `flat` with `fallback` (the model's in-place loader, [`crate::model::Model::in_place_loader`])
/// for every expert it fails on, as [`open_store`] returns it: the loader, what it is, its
/// statistics.
pub fn with_fallback(
    flat: FlatStore<Box<dyn IoQueue>>,
    fallback: Box<dyn ExpertLoader>,
) -> (Box<dyn ExpertLoader>, StoreInfo, Arc<IoStats>) {
    wrap(flat, fallback, Arc::new(IoStats::default()))
}

fn wrap(
    flat: FlatStore<Box<dyn IoQueue>>,
    fallback: Box<dyn ExpertLoader>,
    stats: Arc<IoStats>,
) -> (Box<dyn ExpertLoader>, StoreInfo, Arc<IoStats>) {
    let info = StoreInfo { store: flat.source_name().to_string(), engine: flat.queue().describe() };
    let flat = flat.with_stats(stats.clone());
    (Box::new(FallbackLoader::new(flat, fallback, stats.clone())), info, stats)
}
