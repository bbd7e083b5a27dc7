//! Opening the expert store a run asks for (`--store`) as one [`ExpertLoader`], with the converted
//! safetensors experts behind it as the fallback for any expert the store cannot serve.

use std::path::{Path, PathBuf};
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
use crate::model::config::Config;
use crate::model::safetensors::TensorStore;

/// The default image name inside a converted model directory.
pub const DEFAULT_IMAGE: &str = "experts.picchioflat";

/// The kernel-path engine that reads a file or block device (`--io`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
        }
    }
}

/// Opens `path` (a file or a block device) with the engine `io` asks for and returns the queue and
/// the target's length in bytes.
///
/// # Errors
/// [`Error::Engine`] naming the path when the engine cannot open it (e.g. O_DIRECT refused, or an
/// io_uring flag such as `--sqpoll` refused). An unavailable io_uring is not an error: psync serves.
pub fn open_queue(path: &Path, io: IoOptions) -> Result<(Box<dyn IoQueue>, u64)> {
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
        Err(picchio_blockdev::Error::UringUnavailable { reason, .. }) => {
            warn_uring_fallback(&reason);
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

#[cfg(not(target_os = "linux"))]
fn open_uring(_path: &Path, _io: IoOptions) -> Result<Option<(Box<dyn IoQueue>, u64)>> {
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

/// Opens a `.picchioflat` image in a file (`offset` 0) or on a block device at byte `offset`, checked
/// against the model; `name` is how messages call it (`file:PATH`, `raw:/dev/X@N`).
///
/// # Errors
/// [`Error::Engine`] when the target cannot be opened; [`Error::Invalid`] when `offset` lies at or
/// past the end of the target; [`Error::Store`] for a rejected superblock, index hash or dimensions.
pub fn open_flat(
    name: String,
    path: &Path,
    offset: u64,
    cfg: &Config,
    layout: &ExpertLayout,
    io: IoOptions,
) -> Result<FlatStore<Box<dyn IoQueue>>> {
    let (queue, len) = open_queue(path, io)?;
    if offset >= len {
        return Err(Error::Invalid(format!(
            "{name}: offset {offset} is at or past the end of {} ({len} bytes)",
            path.display()
        )));
    }
    let opts = FlatStoreOptions {
        base_offset: offset,
        image_len: len - offset,
        verify: io.verify,
        expect: Some(StoreExpect { dims: store_dims(cfg), payload_len: layout.len() as u32 }),
    };
    Ok(FlatStore::open(queue, name, opts)?)
}

/// Opens a `.picchioflat` image on a block device (`raw:/dev/X[@offset]`); see [`open_flat`].
///
/// The device is measured first (size from `BLKGETSIZE64`, logical block size from `BLKSSZGET`):
/// `offset` must be a whole number of logical blocks, the image starts at LBA `offset / LBA size`,
/// and each expert is one read at `LBA × LBA size + its offset in the image`, through whichever engine
/// `io` asks for. Reading never writes. A path that is not a block device is refused (use `file:`).
///
/// # Errors
/// [`Error::Engine`] for a path that is not a block device, an offset that is not a whole LBA or lies
/// past the end, or an engine that cannot open the device; as [`open_flat`] otherwise.
pub fn open_raw(
    device: &Path,
    offset: u64,
    cfg: &Config,
    layout: &ExpertLayout,
    io: IoOptions,
) -> Result<FlatStore<Box<dyn IoQueue>>> {
    #[cfg(target_os = "linux")]
    {
        let target = picchio_blockdev::raw::RawTarget::open(device, picchio_core::ByteOffset(offset))?;
        open_flat(target.uri(), device, target.base().0, cfg, layout, io)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let name = StoreUri::Raw { device: device.into(), offset }.to_string();
        open_flat(name, device, offset, cfg, layout, io)
    }
}

/// Opens a `.picchioflat` image at LBA 0 of namespace `nsid` of the NVMe controller `bdf` through our
/// user-space driver (`picchio-nvme`, VFIO + hugepage DMA), with queue depth `io.qd`.
///
/// The controller must already be bound to `vfio-pci` and 2 MiB hugepages reserved (tests/vm shows
/// the steps). Expert reads are zero-copy once the expert cache takes its slots from the driver's
/// hugepage DMA pool ([`crate::expert::cache::ExpertCache::use_slots_from`], done by
/// [`crate::run::Session::open`]); reads into any other buffer (the superblock and index at open, or
/// every read when too few hugepages are free for the cache, which is warned about) go through
/// per-command bounce buffers and are counted (`bounce_bytes`).
///
/// # Errors
/// [`Error::Invalid`] naming the BDF for VFIO, DMA or controller-initialisation failures (and on
/// non-Linux systems); [`Error::Store`] for a rejected image.
pub fn open_nvme(
    name: String,
    bdf: &str,
    nsid: u32,
    cfg: &Config,
    layout: &ExpertLayout,
    io: IoOptions,
) -> Result<FlatStore<Box<dyn IoQueue>>> {
    #[cfg(target_os = "linux")]
    {
        let queue = open_nvme_queue(&name, bdf, nsid, io.qd)?;
        open_nvme_flat(name, queue, cfg, layout, io)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (bdf, nsid, cfg, layout, io);
        Err(Error::Invalid(format!("{name}: the user-space NVMe driver needs Linux VFIO")))
    }
}

/// Opens namespace `nsid` of the controller `bdf` (bound to `vfio-pci`) with our driver: VFIO,
/// hugepage DMA, one I/O queue pair of depth `qd`, and the VFIO data path (pool slots zero-copy,
/// other buffers through bounce buffers). `name` is the store's name in messages.
///
/// # Errors
/// [`Error::Invalid`] naming `name` for VFIO, DMA or controller-initialisation failures.
#[cfg(target_os = "linux")]
pub fn open_nvme_queue(name: &str, bdf: &str, nsid: u32, qd: u32) -> Result<picchio_nvme::NvmeQueue> {
    use picchio_nvme::engine::{NvmeQueue, NvmeQueueOptions};
    let qopts = NvmeQueueOptions { nsid, qd: qd.clamp(1, 1024) as u16, ..NvmeQueueOptions::default() };
    let fail = |e: picchio_nvme::Error| Error::Invalid(format!("{name}: {}", picchio_core::error::chain(&e)));
    let ctrlr = picchio_nvme::vfio::open_controller(bdf, qopts.ctrlr_options()).map_err(fail)?;
    let mut queue = NvmeQueue::with_bounce_buffer(ctrlr, nsid, qopts.timeout, format!("vfio {bdf}")).map_err(fail)?;
    // SIGINT/SIGTERM end any wait for the device (crate::interrupt).
    queue.set_interrupt(crate::interrupt::flag());
    Ok(queue)
}

/// The image at LBA 0 of an open NVMe queue's namespace (a VFIO controller from
/// [`open_nvme_queue`], or the controller model in tests), checked against the model like
/// [`open_flat`].
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
    let opts = FlatStoreOptions {
        base_offset: 0,
        image_len,
        verify: io.verify,
        expect: Some(StoreExpect { dims: store_dims(cfg), payload_len: layout.len() as u32 }),
    };
    Ok(FlatStore::open(Box::new(queue) as Box<dyn IoQueue>, name, opts)?)
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
    open_flat(format!("file:{}", path.display()), path, 0, cfg, layout, io)
}

/// Opens `uri` for the model in `model_dir` and returns the loader (flat store with the safetensors
/// fallback, or safetensors alone), what it is, and the statistics it updates.
///
/// `auto` uses `<model_dir>/experts.picchioflat` when it exists and passes every check (if O_DIRECT
/// is refused by the file system it retries buffered), else logs why and uses safetensors. An explicit
/// `file:` store that fails to open is an error.
///
/// # Errors
/// As [`open_flat`]; [`Error::Invalid`] for `nvme:` (not in this build yet).
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
                Ok(flat) => return Ok(wrap(flat, fallback, stats)),
                Err(e) => {
                    tracing::warn!(
                        "{}: serving experts from safetensors instead (run `picchio pack` to rebuild)",
                        picchio_core::error::chain(&e)
                    );
                    return safetensors_only(fallback, stats);
                }
            }
        }
        StoreUri::File(p) => p.clone(),
        StoreUri::Raw { device, offset } => {
            let flat = open_raw(device, *offset, cfg, layout, io)?;
            return Ok(wrap(flat, fallback, stats));
        }
        StoreUri::Nvme { bdf, nsid } => {
            let flat = open_nvme(uri.to_string(), bdf, *nsid, cfg, layout, io)?;
            return Ok(wrap(flat, fallback, stats));
        }
    };
    let flat = open_flat_file(&path, cfg, layout, io)?;
    Ok(wrap(flat, fallback, stats))
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
