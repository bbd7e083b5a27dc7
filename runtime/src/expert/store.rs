//! Opening the expert store a run asks for (`--store`) as one [`ExpertLoader`], with the converted
//! safetensors experts behind it as the fallback for any expert the store cannot serve.

use std::path::Path;
use std::sync::Arc;

use picchio_blockdev::{PsyncOptions, PsyncQueue};
#[cfg(target_os = "linux")]
use picchio_blockdev::{UringOptions, UringQueue};
use picchio_core::loader::StoreDims;
use picchio_core::{
    ExpertLoader, FallbackLoader, FlatStore, FlatStoreOptions, IoQueue, IoStats, StoreExpect, StoreUri,
};

use crate::error::{Error, Result};
use crate::expert::layout::{ExpertLayout, SafetensorsExperts};
use crate::expert::open::{open_engine, Opened};
use crate::model::config::Config;
use crate::model::safetensors::TensorStore;

/// The default image name inside a converted model directory.
pub const DEFAULT_IMAGE: &str = "experts.picchioflat";

/// The kernel-path engine that reads a file or block device (`--io`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IoEngine {
    /// A pool of `threads` reader threads doing positional reads (`--io psync`).
    Psync,
    /// One io_uring instance with up to `qd` reads in flight (`--io uring`, Linux). Where io_uring
    /// is unavailable (old kernel, seccomp, `kernel.io_uring_disabled`) the queue falls back to
    /// [`IoEngine::Psync`] with one warning.
    Uring,
    /// Overlapped unbuffered `ReadFile`s completed through an I/O completion port, up to `qd` in
    /// flight (`--io iocp`, Windows only; always unbuffered).
    Iocp,
}

impl Default for IoEngine {
    /// [`IoEngine::Uring`] on Linux, [`IoEngine::Iocp`] on Windows, [`IoEngine::Psync`] elsewhere.
    fn default() -> Self {
        if cfg!(target_os = "linux") {
            IoEngine::Uring
        } else if cfg!(windows) {
            IoEngine::Iocp
        } else {
            IoEngine::Psync
        }
    }
}

impl std::fmt::Display for IoEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IoEngine::Psync => "psync",
            IoEngine::Uring => "uring",
            IoEngine::Iocp => "iocp",
        })
    }
}

impl std::str::FromStr for IoEngine {
    type Err = String;

    /// `psync`, `uring` or `iocp`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "psync" => Ok(IoEngine::Psync),
            "uring" | "io_uring" => Ok(IoEngine::Uring),
            "iocp" => Ok(IoEngine::Iocp),
            _ => Err(format!("unknown I/O engine {s:?}: expected psync, uring (Linux) or iocp (Windows)")),
        }
    }
}

/// How flat stores are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoOptions {
    /// The engine.
    pub engine: IoEngine,
    /// O_DIRECT (no page cache): the default for flat stores.
    pub direct: bool,
    /// Reader threads of the psync engine.
    pub threads: usize,
    /// Check every payload's SHA-256 prefix against the index after reading it.
    pub verify: bool,
    /// Reads in flight of the uring engine (`--qd`, 1..=256).
    pub qd: u32,
    /// uring: a kernel thread polls the submission queue (`--sqpoll`).
    pub sqpoll: bool,
    /// uring: completions are polled from the device (`--iopoll`; needs O_DIRECT and polled queues).
    pub iopoll: bool,
    /// uring: register the file with the ring (the default; see `picchio_blockdev::UringOptions`).
    pub register_files: bool,
    /// Compute each missed expert as soon as its read completes (`--async-moe`, the default), rather
    /// than after the whole batch is loaded (`--no-async-moe`); see [`crate::expert::cache`].
    pub async_moe: bool,
    /// Decode steps read experts on an I/O worker thread while the forward pass computes the
    /// layer's cached experts (`--no-overlap` turns it off; needs `async_moe`); see
    /// [`crate::model::DecodeIo`].
    pub overlap: bool,
    /// Speculative prefetch of the next layer's experts from the current hidden state through the
    /// next layer's router (`--prefetch`, off by default; needs `overlap`).
    pub prefetch: bool,
    /// uring: where io_uring is unavailable, read with the psync engine (warned about once; the
    /// default). Bench clears it, so that an unavailable io_uring is an error, not a psync figure
    /// labelled `uring`.
    pub uring_fallback: bool,
}

impl Default for IoOptions {
    fn default() -> Self {
        IoOptions {
            engine: IoEngine::default(),
            direct: true,
            threads: 2,
            verify: false,
            qd: 32,
            sqpoll: false,
            iopoll: false,
            register_files: true,
            async_moe: true,
            overlap: true,
            prefetch: false,
            uring_fallback: true,
        }
    }
}

/// Opens `path` (a file or a block device) with the kernel engine `io` asks for and returns the
/// queue and the target's length in bytes: the file and device arm of
/// [`crate::expert::open::open_engine`].
///
/// # Errors
/// [`Error::Engine`] naming the path when the engine cannot open it (e.g. O_DIRECT refused, or an
/// io_uring flag such as `--sqpoll` refused). An unavailable io_uring is not an error (psync
/// serves) unless `io.uring_fallback` is off.
pub(crate) fn open_queue(path: &Path, io: IoOptions) -> Result<(Box<dyn IoQueue>, u64)> {
    match io.engine {
        IoEngine::Psync => open_psync(path, io),
        IoEngine::Uring => match open_uring(path, io)? {
            Some(opened) => Ok(opened),
            None => open_psync(path, io),
        },
        IoEngine::Iocp => open_iocp(path, io),
    }
}

#[cfg(windows)]
fn open_iocp(path: &Path, io: IoOptions) -> Result<(Box<dyn IoQueue>, u64)> {
    let q = picchio_blockdev::IocpQueue::open(path, picchio_blockdev::IocpOptions { qd: io.qd })?;
    let len = q.len();
    Ok((Box::new(q), len))
}

#[cfg(not(windows))]
fn open_iocp(_path: &Path, _io: IoOptions) -> Result<(Box<dyn IoQueue>, u64)> {
    Err(Error::Invalid("--io iocp is the Windows engine; use --io uring or --io psync here".into()))
}

fn open_psync(path: &Path, io: IoOptions) -> Result<(Box<dyn IoQueue>, u64)> {
    let q = PsyncQueue::open(path, PsyncOptions { threads: io.threads.max(1), direct: io.direct })?;
    let len = q.len();
    Ok((Box::new(q), len))
}

/// The uring queue, or `None` (warned about once per process) when io_uring is unavailable here.
#[cfg(target_os = "linux")]
fn open_uring(path: &Path, io: IoOptions) -> Result<Option<(Box<dyn IoQueue>, u64)>> {
    let opts = UringOptions {
        qd: io.qd,
        direct: io.direct,
        sqpoll: io.sqpoll,
        iopoll: io.iopoll,
        register_files: io.register_files,
    };
    match UringQueue::open(path, opts) {
        Ok(q) => {
            let len = q.len();
            Ok(Some((Box::new(q), len)))
        }
        Err(picchio_blockdev::Error::UringUnavailable { reason, .. }) if io.uring_fallback => {
            warn_uring_fallback(&reason);
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

#[cfg(not(target_os = "linux"))]
fn open_uring(_path: &Path, io: IoOptions) -> Result<Option<(Box<dyn IoQueue>, u64)>> {
    if !io.uring_fallback {
        return Err(Error::Invalid("engine uring: io_uring is Linux-only".into()));
    }
    warn_uring_fallback("it is Linux-only");
    Ok(None)
}

fn warn_uring_fallback(why: &str) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| tracing::warn!("io_uring is unavailable ({why}): reading with the psync engine (--io psync)"));
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
/// # Errors
/// As [`open_engine`]; [`Error::Store`] for a rejected superblock, index hash or dimensions.
pub fn open_flat(
    uri: &StoreUri,
    cfg: &Config,
    layout: &ExpertLayout,
    io: IoOptions,
) -> Result<FlatStore<Box<dyn IoQueue>>> {
    flat_from(open_engine(uri, io)?, cfg, layout, io.verify)
}

/// The image an opened engine reads, checked against the model (`verify`: every payload's hash
/// prefix is checked after reading).
///
/// # Errors
/// [`Error::Store`] for a rejected superblock, index hash or dimensions.
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
    Ok(FlatStore::open(opened.queue, opened.name, opts)?)
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
    io: IoOptions,
) -> Result<FlatStore<Box<dyn IoQueue>>> {
    let image_len = queue.namespace().bytes();
    flat_from(Opened { queue: Box::new(queue), base: 0, image_len, name }, cfg, layout, io.verify)
}

/// Opens a `.picchioflat` file; see [`open_flat`].
///
/// # Errors
/// As [`open_flat`].
pub fn open_flat_file(
    path: &Path,
    cfg: &Config,
    layout: &ExpertLayout,
    io: IoOptions,
) -> Result<FlatStore<Box<dyn IoQueue>>> {
    open_flat(&StoreUri::File(path.into()), cfg, layout, io)
}

/// Opens `uri` for the model in `model_dir` and returns the loader (flat store with the safetensors
/// fallback, or safetensors alone), what it is, and the statistics it updates.
///
/// `auto` uses `<model_dir>/experts.picchioflat` when it exists and passes every check (if O_DIRECT
/// is refused by the file system it retries buffered), else logs why and uses safetensors. An explicit
/// `file:` store that fails to open is an error.
///
/// # Errors
/// As [`open_flat`].
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
    match uri {
        StoreUri::Safetensors => safetensors_only(fallback, stats),
        StoreUri::Auto => {
            let p = model_dir.join(DEFAULT_IMAGE);
            if !p.exists() {
                tracing::info!("{} not found: serving experts from safetensors", p.display());
                return safetensors_only(fallback, stats);
            }
            let attempt = open_flat_file(&p, cfg, layout, io).or_else(|e| {
                if io.direct && matches!(e, Error::Engine(picchio_blockdev::Error::DirectUnsupported { .. })) {
                    tracing::warn!(
                        "{}; retrying without O_DIRECT (use --buffered to skip this)",
                        picchio_core::error::chain(&e)
                    );
                    open_flat_file(&p, cfg, layout, IoOptions { direct: false, ..io })
                } else {
                    Err(e)
                }
            });
            match attempt {
                Ok(flat) => Ok(wrap(flat, fallback, stats)),
                Err(e) => {
                    tracing::warn!("{e}: serving experts from safetensors instead (run `picchio pack` to rebuild)");
                    safetensors_only(fallback, stats)
                }
            }
        }
        _ => Ok(wrap(open_flat(uri, cfg, layout, io)?, fallback, stats)),
    }
}

/// `flat` with the model's safetensors experts (`tensors`, `layout`) as the fallback for every
/// expert it fails on, as [`open_store`] returns it: the loader, what it is, its statistics.
pub fn with_fallback(
    flat: FlatStore<Box<dyn IoQueue>>,
    tensors: Arc<TensorStore>,
    layout: &ExpertLayout,
) -> (Box<dyn ExpertLoader>, StoreInfo, Arc<IoStats>) {
    wrap(flat, SafetensorsExperts::new(tensors, layout.clone()), Arc::new(IoStats::default()))
}

fn wrap(
    flat: FlatStore<Box<dyn IoQueue>>,
    fallback: SafetensorsExperts,
    stats: Arc<IoStats>,
) -> (Box<dyn ExpertLoader>, StoreInfo, Arc<IoStats>) {
    let info = StoreInfo { store: flat.source_name().to_string(), engine: flat.queue().describe() };
    let flat = flat.with_stats(stats.clone());
    (Box::new(FallbackLoader::new(flat, fallback, stats.clone())), info, stats)
}
