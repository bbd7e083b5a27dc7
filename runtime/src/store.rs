//! Opening the expert store a run asks for (`--store`) as one [`ExpertLoader`], with the converted
//! safetensors experts behind it as the fallback for any expert the store cannot serve.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use picchio_blockdev::{PsyncOptions, PsyncQueue};
use picchio_core::loader::StoreDims;
use picchio_core::{ExpertLoader, FallbackLoader, FlatStore, FlatStoreOptions, IoStats, StoreExpect, StoreUri};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::expert::{ExpertLayout, SafetensorsExperts};
use crate::safetensors::TensorStore;

/// The default image name inside a converted model directory.
pub const DEFAULT_IMAGE: &str = "experts.picchioflat";

/// How flat stores are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoOptions {
    /// O_DIRECT (no page cache): the default for flat stores.
    pub direct: bool,
    /// Reader threads of the psync engine.
    pub threads: usize,
    /// Check every payload's SHA-256 prefix against the index after reading it.
    pub verify: bool,
}

impl Default for IoOptions {
    fn default() -> Self {
        IoOptions { direct: true, threads: 2, verify: false }
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

/// Opens a `.picchioflat` file with the psync engine, checked against the model.
///
/// # Errors
/// [`Error::Invalid`] when the file cannot be opened by the engine; [`Error::Store`] for a rejected
/// superblock, index hash or dimensions.
pub fn open_flat_file(
    path: &Path,
    cfg: &Config,
    layout: &ExpertLayout,
    io: IoOptions,
) -> Result<FlatStore<PsyncQueue>> {
    let queue = PsyncQueue::open(path, PsyncOptions { threads: io.threads.max(1), direct: io.direct })
        .map_err(|e| Error::Invalid(format!("{e:#}")))?;
    let image_len = queue.len();
    let opts = FlatStoreOptions {
        base_offset: 0,
        image_len,
        verify: io.verify,
        expect: Some(StoreExpect { dims: store_dims(cfg), payload_len: layout.len() as u32 }),
    };
    Ok(FlatStore::open(queue, format!("file:{}", path.display()), opts)?)
}

/// Opens `uri` for the model in `model_dir` and returns the loader (flat store with the safetensors
/// fallback, or safetensors alone), what it is, and the statistics it updates.
///
/// `auto` uses `<model_dir>/experts.picchioflat` when it exists and passes every check (if O_DIRECT
/// is refused by the file system it retries buffered), else logs why and uses safetensors. An explicit
/// `file:` store that fails to open is an error.
///
/// # Errors
/// As [`open_flat_file`]; [`Error::Invalid`] for `raw:` and `nvme:` (not in this build yet).
pub fn open_store(
    uri: &StoreUri,
    model_dir: &Path,
    cfg: &Config,
    tensors: Arc<TensorStore>,
    layout: &ExpertLayout,
    io: IoOptions,
) -> Result<(Box<dyn ExpertLoader>, StoreInfo, Arc<IoStats>)> {
    let stats = Arc::new(IoStats::default());
    let fallback = SafetensorsExperts::new(tensors, layout.clone());
    let safetensors_only = |fallback: SafetensorsExperts, stats| {
        let info = StoreInfo { store: "safetensors".into(), engine: "safetensors (mmap copy)".into() };
        Ok((Box::new(fallback) as Box<dyn ExpertLoader>, info, stats))
    };
    let path: PathBuf = match uri {
        StoreUri::Safetensors => return safetensors_only(fallback, stats),
        StoreUri::Auto => {
            let p = model_dir.join(DEFAULT_IMAGE);
            if !p.exists() {
                tracing::info!("{} not found: serving experts from safetensors", p.display());
                return safetensors_only(fallback, stats);
            }
            let attempt = open_flat_file(&p, cfg, layout, io).or_else(|e| {
                if io.direct {
                    tracing::warn!("{e}; retrying without O_DIRECT (use --buffered to skip this)");
                    open_flat_file(&p, cfg, layout, IoOptions { direct: false, ..io })
                } else {
                    Err(e)
                }
            });
            match attempt {
                Ok(flat) => return Ok(wrap(flat, fallback, stats)),
                Err(e) => {
                    tracing::warn!("{e}: serving experts from safetensors instead (run `picchio pack` to rebuild)");
                    return safetensors_only(fallback, stats);
                }
            }
        }
        StoreUri::File(p) => p.clone(),
        StoreUri::Raw { .. } | StoreUri::Nvme { .. } => {
            return Err(Error::Invalid(format!("--store {uri}: raw block devices and NVMe are not in this build yet")))
        }
    };
    let flat = open_flat_file(&path, cfg, layout, io)?;
    Ok(wrap(flat, fallback, stats))
}

fn wrap(
    flat: FlatStore<PsyncQueue>,
    fallback: SafetensorsExperts,
    stats: Arc<IoStats>,
) -> (Box<dyn ExpertLoader>, StoreInfo, Arc<IoStats>) {
    let info =
        StoreInfo { store: flat.source_name().to_string(), engine: picchio_core::IoQueue::describe(flat.queue()) };
    let flat = flat.with_stats(stats.clone());
    (Box::new(FallbackLoader::new(flat, fallback, stats.clone())), info, stats)
}
