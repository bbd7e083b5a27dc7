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
//! [`pack_raw`] writes the same image onto a block device (`--out raw:/dev/X[@BYTES]`): it inspects
//! the device first and refuses one that is mounted, in use or carries data (unless `--force`; the
//! device backing `/` always), reports what it will overwrite, writes with `O_DIRECT` in aligned
//! chunks (superblock last), syncs, and reads the whole image back through `O_DIRECT` to check the
//! index and every payload hash ([`crate::verify::verify_queue`]).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use picchio_core::format::{plan_image_len, ImageSink};
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
    /// The image file, or the block device.
    pub path: PathBuf,
    /// Where the image went, as messages name it: the file path, or `raw:/dev/X[@BYTES]`.
    pub dest: String,
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
        writeln!(f, "packed {} -> {}", self.model_dir.display(), self.dest)?;
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

/// A converted directory opened for packing, with the image's geometry known before any byte is
/// written.
struct Source {
    cfg: Config,
    store: TensorStore,
    layout: ExpertLayout,
    layers: usize,
    n_entries: u32,
}

impl Source {
    fn open(model_dir: &Path, opts: &PackOptions) -> Result<Source> {
        let cfg = Config::from_dir(model_dir)?;
        let store = TensorStore::open(model_dir)?;
        if let Some(&l) = cfg.moe_layers().first() {
            let hf = format!("model.layers.{l}.mlp.experts.0.gate_proj.weight");
            let fused = format!("model.layers.{l}.mlp.experts.gate_up_proj");
            if store.contains(&hf) || store.contains(&fused) {
                return Err(Error::Invalid(format!(
                    "{}: a Hugging Face checkpoint, not a converted directory: run `picchio convert` on it first \
                     and pack the converted directory",
                    model_dir.display()
                )));
            }
        }
        let layout = ExpertLayout::detect(&store, &cfg)?;
        let n_layers = cfg.num_hidden_layers;
        let layers = opts.layers.unwrap_or(n_layers);
        if layers == 0 || layers > n_layers {
            return Err(Error::Invalid(format!(
                "--layers {layers}: the model has {n_layers} layers (use 1..={n_layers})"
            )));
        }
        let n_entries = u32::try_from(layers * cfg.num_experts)
            .map_err(|_| Error::Invalid(format!("{layers} layers × {} experts exceed u32 entries", cfg.num_experts)))?;
        Ok(Source { cfg, store, layout, layers, n_entries })
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

    /// Writes every payload through `w` and finishes the image; returns (superblock, experts,
    /// placeholders).
    fn write<S: ImageSink>(&self, mut w: FlatWriter<S>, progress: bool) -> Result<(Superblock, usize, usize)> {
        let bar = progress::bar(u64::from(self.n_entries), "pack", !progress);
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
        let superblock = w.finish()?;
        bar.finish_and_clear();
        Ok((superblock, experts, placeholders))
    }
}

/// Packs the routed experts of the converted directory `model_dir` into the image `out`.
///
/// # Errors
/// [`Error::Io`], [`Error::Config`], … from opening the directory; [`Error::Invalid`] for a
/// Hugging Face checkpoint that was not converted, or `layers` out of range; [`Error::MissingTensor`],
/// [`Error::TensorDtype`], [`Error::TensorShape`] for an expert tensor; [`Error::Store`] when writing
/// the image fails; [`Error::Invalid`] when `out` exists and is not a `.picchioflat` image (see
/// [`check_replaceable`]). On error no image (and no temporary file) is left at `out`, and an existing
/// file there is unchanged.
pub fn pack(model_dir: &Path, out: &Path, opts: &PackOptions) -> Result<PackReport> {
    let t0 = Instant::now();
    check_replaceable(out, "pack")?;
    let src = Source::open(model_dir, opts)?;
    let image_len = src.plan(out)?;
    check_free_space(out, image_len)?;
    let w = FlatWriter::create(out, store_dims(&src.cfg), src.n_entries)?;
    let (superblock, experts, placeholders) = src.write(w, opts.progress)?;
    let bytes = std::fs::metadata(out).map_err(Error::io(out, "stat the packed image"))?.len();
    debug_assert_eq!(bytes, image_len, "the image size pack_raw plans for a device");
    Ok(PackReport {
        model_dir: model_dir.into(),
        path: out.into(),
        dest: out.display().to_string(),
        superblock,
        quant: src.layout.quant,
        payload_len: src.layout.len(),
        experts,
        placeholders,
        bytes,
        elapsed: t0.elapsed(),
    })
}

/// Refuses an `out` that [`pack`] (or `command`, as messages name it: `pack`, `synth`) must not replace: anything but a missing path, an empty regular
/// file, or a regular file starting with the image magic `PCHIOFL1` (a previous image: re-packing
/// replaces it). So `--out MODEL/model.safetensors` or `--out MODEL/config.json` fails before any
/// work instead of destroying a model file.
///
/// # Errors
/// [`Error::Invalid`] naming `out`, what it is and `command`; [`Error::Io`] when it exists but cannot
/// be read.
pub fn check_replaceable(out: &Path, command: &str) -> Result<()> {
    use std::io::Read;
    let md = match std::fs::metadata(out) {
        Ok(md) => md,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(out, "stat the output path")(e)),
    };
    let refuse = |what: &str| {
        Err(Error::Invalid(format!(
            "{}: {what}; {command} will not replace it: remove it or choose another --out",
            out.display()
        )))
    };
    if md.is_dir() {
        return refuse("is a directory, not a .picchioflat image");
    }
    if !md.is_file() {
        return refuse("is not a regular file (for an image on a block device use --out raw:/dev/X)");
    }
    if md.len() == 0 {
        return Ok(());
    }
    let mut magic = [0u8; 8];
    let n = std::fs::File::open(out)
        .and_then(|f| f.take(8).read(&mut magic))
        .map_err(Error::io(out, "read the existing output file"))?;
    if n < magic.len() || magic != picchio_core::format::MAGIC {
        return refuse("exists and is not a .picchioflat image (it does not start with PCHIOFL1)");
    }
    Ok(())
}

/// Where `picchio pack --out` and `picchio synth --out` write an image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OutTarget {
    /// A file, written atomically (temporary file + rename).
    File(PathBuf),
    /// A block device from byte `offset` on (`raw:/dev/X[@BYTES]`).
    Raw {
        /// The device node.
        device: PathBuf,
        /// Byte offset of the image.
        offset: u64,
    },
    /// Namespace `nsid` of the NVMe controller `bdf`, through the user-space driver.
    Nvme {
        /// PCI address `DDDD:BB:DD.F`.
        bdf: String,
        /// Namespace id.
        nsid: u32,
    },
}

/// Parses an `--out` value with the same parser as `--store` ([`picchio_core::StoreUri`]), so every
/// scheme is either a place to write or refused by name — never taken for a file name: `file:PATH`
/// or a path, `raw:/dev/X[@BYTES]`, `nvme:BDF[/NSID]`. `auto` and `safetensors` choose what a run
/// reads and are refused; so is `nvme-sim:PATH` (`picchio bench`'s software controller reading an
/// image file: write the file, then measure `nvme-sim:` it).
///
/// # Errors
/// [`Error::Invalid`] naming the value and the scheme (for an unknown scheme it also says that a
/// path containing ':' is written `file:PATH` or `./PATH`).
pub fn parse_out(s: &str) -> Result<OutTarget> {
    if let Some(path) = s.strip_prefix("nvme-sim:") {
        return Err(Error::Invalid(format!(
            "--out {s}: nvme-sim: is a read target of `picchio bench` (an image file served by the software \
             NVMe controller), not a place to write: write --out file:{path} and measure --store {s} \
             (a file name containing ':' is written file:PATH or ./PATH)"
        )));
    }
    let uri = s.parse::<picchio_core::StoreUri>().map_err(|e| match e {
        picchio_core::Error::BadUri { message, .. } => Error::Invalid(format!("--out {s:?}: {message}")),
        other => Error::Store(other),
    })?;
    match uri {
        picchio_core::StoreUri::File(p) => Ok(OutTarget::File(p)),
        picchio_core::StoreUri::Raw { device, offset } => Ok(OutTarget::Raw { device, offset }),
        picchio_core::StoreUri::Nvme { bdf, nsid } => Ok(OutTarget::Nvme { bdf, nsid }),
        other @ (picchio_core::StoreUri::Auto | picchio_core::StoreUri::Safetensors) => Err(Error::Invalid(format!(
            "--out {other}: `{other}` chooses what `picchio run --store` reads, it is not a place to write an image: \
             give a path (file:PATH or ./PATH for a name like this one), raw:/dev/X[@BYTES] or nvme:BDF[/NSID]"
        ))),
    }
}

/// Refuses an output path `out` whose parent directory is missing (the same rule for convert's OUT_DIR
/// and pack's and synth's image files: the parent is never created).
///
/// # Errors
/// [`Error::NoParentDir`] naming `out` and its parent.
pub fn require_parent_dir(out: &Path) -> Result<()> {
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if parent.is_dir() {
        Ok(())
    } else {
        Err(Error::NoParentDir { path: out.into(), parent: parent.into() })
    }
}

/// Refuses to start writing an image of `needed` bytes at the file `out` when the file system that
/// will hold it (the one of `out`'s directory, where the temporary file goes) has fewer bytes
/// available to us (`statvfs`: `f_bavail × f_frsize`, what an unprivileged writer may use). The old
/// image, if any, stays until the rename, so all `needed` bytes must be free. On targets without
/// `statvfs` (Windows) nothing is checked and a full disk shows as the write error.
///
/// # Errors
/// [`Error::Invalid`] naming `out`, the bytes needed and the bytes available; [`Error::Io`] when the
/// file system cannot be queried.
pub fn check_free_space(out: &Path, needed: u64) -> Result<()> {
    require_parent_dir(out)?;
    let dir = match out.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Some(available) = free_space::available_bytes(dir).map_err(Error::io(dir, "query the free space (statvfs)"))?
    else {
        return Ok(());
    };
    if needed > available {
        return Err(Error::Invalid(format!(
            "{}: the image needs {needed} bytes ({:.2} GB) but its file system has {available} bytes ({:.2} GB) \
             available: free space or choose another --out",
            out.display(),
            needed as f64 / 1e9,
            available as f64 / 1e9
        )));
    }
    Ok(())
}

/// `statvfs(3)`, the one unsafe call of [`check_free_space`].
mod free_space {
    use std::path::Path;

    /// Bytes available to an unprivileged writer on the file system holding `dir`.
    #[cfg(unix)]
    pub(super) fn available_bytes(dir: &Path) -> std::io::Result<Option<u64>> {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
        let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
        // SAFETY: `c` is a NUL-terminated path that outlives the call, and `st` points to writable
        // memory of the size of `struct statvfs`, which `statvfs` fills completely on success.
        if unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: statvfs returned 0, so it initialised `st`.
        let st = unsafe { st.assume_init() };
        #[allow(clippy::useless_conversion)] // the field widths differ between libcs
        Ok(Some(u64::from(st.f_bavail).saturating_mul(u64::from(st.f_frsize))))
    }

    #[cfg(not(unix))]
    pub(super) fn available_bytes(_: &Path) -> std::io::Result<Option<u64>> {
        Ok(None)
    }
}

/// Options of [`pack_raw`].
#[derive(Clone, Debug, Default)]
pub struct RawPackOptions {
    /// As for a file.
    pub pack: PackOptions,
    /// Write even a device that is mounted, in use, or carries a partition table or a file-system
    /// signature (`--force`). Never the device backing `/`; and the kernel still refuses, through
    /// `O_EXCL`, a device a mounted file system, swap area or holder uses.
    pub force: bool,
    /// Reader threads of the read-back verification.
    pub io_threads: usize,
}

/// What [`pack_raw`] did.
#[cfg(target_os = "linux")]
#[derive(Debug)]
pub struct RawPackReport {
    /// The image written (`path` is the device, `dest` the `raw:` URI).
    pub pack: PackReport,
    /// The inspection the write was cleared by.
    pub inspection: picchio_blockdev::raw::Inspection,
    /// The read-back verification (clean, or [`pack_raw`] fails).
    pub verify: crate::verify::VerifyReport,
}

#[cfg(target_os = "linux")]
impl std::fmt::Display for RawPackReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = self.inspection.target();
        writeln!(f, "{}", self.pack)?;
        write!(
            f,
            "  at {} × {} B (byte {}) of {}; read back with O_DIRECT via {}: index and {} payload hashes OK",
            t.start(),
            t.device().logical_block(),
            t.base().0,
            t.device().path().display(),
            self.verify.engine,
            self.verify.entries
        )
    }
}

/// Packs the routed experts of `model_dir` onto the block device `device`, the image starting at
/// byte `offset` (a whole number of logical blocks): `picchio pack --out raw:/dev/X[@offset]`.
///
/// Steps: measure the image; inspect the device ([`picchio_blockdev::raw::RawTarget::inspect`], reads
/// only) and hand the result to `announce` (the command prints it: device, size, model, signatures,
/// bytes to be overwritten) — also when it is then refused; clear it
/// ([`picchio_blockdev::raw::Inspection::permit`]: the image must fit; refusals unless `force`, the
/// root device always); write through [`picchio_blockdev::raw::DeviceSink`] (`O_DIRECT | O_EXCL`,
/// aligned chunks, the old superblock destroyed first and the new one written last after a sync);
/// then read everything back through `O_DIRECT` with the psync engine and check the index hash and
/// every payload hash. Only the named device is ever opened for writing, and a path that is not a
/// block device never is.
///
/// # Errors
/// As [`pack`] for the model; [`Error::Engine`] wrapping [`picchio_blockdev::Error::NotBlockDevice`],
/// [`RawOffset`](picchio_blockdev::Error::RawOffset), [`ImageTooLarge`](picchio_blockdev::Error::ImageTooLarge),
/// [`Refused`](picchio_blockdev::Error::Refused), [`WriteOpen`](picchio_blockdev::Error::WriteOpen), …;
/// [`Error::Store`] when a write fails; [`Error::Invalid`] when the read-back finds a problem.
#[cfg(target_os = "linux")]
pub fn pack_raw(
    model_dir: &Path,
    device: &Path,
    offset: u64,
    opts: &RawPackOptions,
    announce: &mut dyn FnMut(&picchio_blockdev::raw::Inspection),
) -> Result<RawPackReport> {
    use picchio_blockdev::raw::{DeviceSink, OffsetQueue, RawTarget};
    use picchio_blockdev::{PsyncOptions, PsyncQueue};

    let t0 = Instant::now();
    let src = Source::open(model_dir, &opts.pack)?;
    let image_len = src.plan(device)?;
    let target = RawTarget::open(device, picchio_core::ByteOffset(offset))?;
    let inspection = target.inspect(image_len)?;
    announce(&inspection);
    let permit = inspection.clone().permit(opts.force)?;
    let sink = DeviceSink::open(&permit)?;
    let w = FlatWriter::with_sink(sink, store_dims(&src.cfg), src.n_entries)?;
    let (superblock, experts, placeholders) = src.write(w, opts.pack.progress)?;
    let name = target.uri();
    // The writer (and its exclusive claim) is closed; read the device back, around the page cache.
    let queue = PsyncQueue::open(device, PsyncOptions::direct(opts.io_threads.max(1)))?;
    let mut queue = OffsetQueue::new(queue, target.base());
    let vopts =
        crate::verify::VerifyOptions { io_threads: opts.io_threads, direct: true, progress: opts.pack.progress };
    let verify = crate::verify::verify_queue(&mut queue, &name, image_len, None, &vopts)?;
    if !verify.is_clean() || verify.entries != src.n_entries as usize {
        return Err(Error::Invalid(format!("{name}: the image was written but reading it back failed:\n{verify}")));
    }
    let pack = PackReport {
        model_dir: model_dir.into(),
        path: device.into(),
        dest: name,
        superblock,
        quant: src.layout.quant,
        payload_len: src.layout.len(),
        experts,
        placeholders,
        bytes: image_len,
        elapsed: t0.elapsed(),
    };
    Ok(RawPackReport { pack, inspection, verify })
}

/// What writing an image to an NVMe namespace through our driver would overwrite: the plan
/// `picchio pack --out nvme:` prints before writing (the namespace, the LBAs the image takes, and
/// every signature found in its first [`picchio_blockdev::raw::HEAD_BYTES`], with the same verdicts
/// as `--out raw:`).
///
/// Mounts, swap areas and holders cannot exist on a namespace whose controller is bound to
/// `vfio-pci`; `picchio nvme bind` refused (or was forced past) them before the kernel let go.
#[cfg(target_os = "linux")]
#[derive(Clone, Debug)]
pub struct NvmeInspection {
    /// `nvme:BDF/NSID`.
    pub name: String,
    /// The namespace (id, LBA size, blocks).
    pub namespace: picchio_nvme::Namespace,
    /// Bytes the image needs.
    pub image_len: u64,
    /// Signatures found (as [`picchio_blockdev::raw::Finding::Signature`]).
    pub findings: Vec<picchio_blockdev::raw::Finding>,
}

#[cfg(target_os = "linux")]
impl NvmeInspection {
    /// Reads the first [`picchio_blockdev::raw::HEAD_BYTES`] of the namespace through `queue` and
    /// looks for partition tables, file systems, volumes and images with
    /// [`picchio_blockdev::raw::scan_signatures`] (the `raw:` check). Reads only.
    ///
    /// # Errors
    /// [`Error::Io`] naming `name` when the read fails.
    pub fn read(queue: &mut picchio_nvme::NvmeQueue, name: &str, image_len: u64) -> Result<NvmeInspection> {
        use picchio_blockdev::raw::{scan_signatures, Finding, HEAD_BYTES};
        let namespace = queue.namespace();
        let lbs = u64::from(namespace.lba_size);
        let len = HEAD_BYTES.min(namespace.bytes()) / lbs * lbs;
        let head = picchio_core::io::read_blocking(queue, 0, len as u32)
            .map_err(Error::io(name, "read the namespace's first blocks for signatures"))?;
        let findings = scan_signatures(&head.as_slice()[..len as usize], 0)
            .into_iter()
            .map(|signature| {
                let overwritten = signature.offset < image_len;
                Finding::Signature { signature, overwritten }
            })
            .collect();
        Ok(NvmeInspection { name: name.into(), namespace, image_len, findings })
    }

    /// Clears the namespace for writing, or refuses as [`picchio_blockdev::raw::Inspection::permit`]
    /// does: an image larger than the namespace always; a partition table or a file-system, volume or
    /// RAID signature unless `force` (an earlier `.picchioflat` image is no reason to refuse).
    ///
    /// # Errors
    /// [`Error::Engine`] wrapping [`picchio_blockdev::Error::ImageTooLarge`] or
    /// [`picchio_blockdev::Error::Refused`] (naming every reason).
    pub fn permit(&self, force: bool) -> Result<()> {
        use picchio_blockdev::raw::{decide, Decision};
        let path = PathBuf::from(&self.name);
        let size = self.namespace.bytes();
        if self.image_len > size {
            let e = picchio_blockdev::Error::ImageTooLarge {
                path,
                offset: 0,
                image_len: self.image_len,
                capacity: size,
                size,
            };
            return Err(e.into());
        }
        match decide(&self.findings, force) {
            Decision::Refuse { reasons, .. } => {
                let hint = "if this is the namespace you mean, pass --force (everything on it is lost)";
                Err(picchio_blockdev::Error::Refused { path, reasons, hint }.into())
            }
            Decision::Write { overridden } => {
                if !overridden.is_empty() {
                    tracing::warn!("{}: --force: overwriting although {}", self.name, overridden.join("; "));
                }
                Ok(())
            }
        }
    }
}

#[cfg(target_os = "linux")]
impl std::fmt::Display for NvmeInspection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ns = &self.namespace;
        let lbs = u64::from(ns.lba_size);
        writeln!(
            f,
            "{}: namespace {}, {} LBAs × {} B = {} bytes (user-space driver, vfio-pci)",
            self.name,
            ns.nsid,
            ns.blocks,
            lbs,
            ns.bytes()
        )?;
        write!(
            f,
            "  writes {} bytes: namespace bytes 0x0..{:#x}, LBA 0..{} of {}",
            self.image_len,
            self.image_len,
            self.image_len.div_ceil(lbs),
            ns.blocks
        )?;
        picchio_blockdev::raw::write_findings(f, &self.findings, "no partition table or known signature")
    }
}

/// What [`pack_nvme`] did.
#[cfg(target_os = "linux")]
#[derive(Debug)]
pub struct NvmePackReport {
    /// The image written (`path` and `dest` are `nvme:BDF/NSID`).
    pub pack: PackReport,
    /// The inspection the write was cleared by.
    pub inspection: NvmeInspection,
    /// The read-back verification through the driver (clean, or [`pack_nvme`] fails).
    pub verify: crate::verify::VerifyReport,
    /// NVM Write commands issued and Flush commands completed.
    pub commands: (u64, u64),
}

#[cfg(target_os = "linux")]
impl std::fmt::Display for NvmePackReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{}", self.pack)?;
        write!(
            f,
            "  at LBA 0 of namespace {} ({} B LBAs) with {} NVM Write commands and {} Flush through the user-space \
             driver; read back through {}: index and {} payload hashes OK",
            self.inspection.namespace.nsid,
            self.inspection.namespace.lba_size,
            self.commands.0,
            self.commands.1,
            self.verify.engine,
            self.verify.entries
        )
    }
}

/// Packs the routed experts of `model_dir` onto namespace `nsid` of the NVMe controller `bdf` from
/// LBA 0, through our user-space driver: `picchio pack --out nvme:BDF[/NSID]`.
///
/// The controller must already be bound to `vfio-pci` (`picchio nvme bind`, which refuses a
/// controller with mounted namespaces, holders, or the one behind `/`); this is checked in `sysfs`
/// (normally `/sys`) before anything is opened. Then as [`pack_nvme_queue`].
///
/// # Errors
/// [`Error::Invalid`] when the controller is not bound to `vfio-pci` or cannot be opened; as
/// [`pack_nvme_queue`] otherwise.
#[cfg(target_os = "linux")]
pub fn pack_nvme(
    model_dir: &Path,
    sysfs: &Path,
    bdf: &str,
    nsid: u32,
    opts: &RawPackOptions,
    announce: &mut dyn FnMut(&NvmeInspection),
) -> Result<NvmePackReport> {
    let name = picchio_core::StoreUri::Nvme { bdf: bdf.into(), nsid }.to_string();
    require_vfio(sysfs, bdf, &name)?;
    let mut queue = crate::store::open_nvme_queue(&name, bdf, nsid, 32)?;
    pack_nvme_queue(model_dir, &mut queue, &name, opts, announce)
}

/// Refuses a controller that is not bound to `vfio-pci` according to `sysfs`, naming its driver
/// and the command that binds it.
#[cfg(target_os = "linux")]
pub(crate) fn require_vfio(sysfs: &Path, bdf: &str, name: &str) -> Result<()> {
    let bdf = crate::nvme_admin::Bdf::parse(bdf).map_err(|e| Error::Invalid(format!("{name}: {e}")))?;
    let ctrl = crate::nvme_admin::controller(sysfs, "", &bdf).map_err(|e| Error::Invalid(format!("{name}: {e}")))?;
    match ctrl.driver.as_deref() {
        Some("vfio-pci") => Ok(()),
        other => Err(Error::Invalid(format!(
            "{name}: the controller is bound to {}, not vfio-pci: run `picchio nvme bind {bdf}` first \
             (it refuses a controller with mounted namespaces); nothing was written",
            other.map_or("no driver".to_string(), |d| format!("the `{d}` driver"))
        ))),
    }
}

/// Packs `model_dir` onto the namespace `queue` drives (a VFIO controller, or the controller model
/// in tests), named `name` in messages.
///
/// Steps, as for `raw:` ([`pack_raw`]): measure the image; read the namespace's first blocks and
/// inspect them ([`NvmeInspection::read`]) and hand the result to `announce` — also when it is then
/// refused; clear it ([`NvmeInspection::permit`]); zero the first block and Flush, so an interrupted
/// pack leaves no valid-looking superblock; write the payloads and index with NVM Write commands in
/// 4 MiB runs (up to 4 in flight), Flush, write the superblock, Flush; then read the whole image
/// back through the driver and check the index hash and every payload hash.
///
/// # Errors
/// As [`pack`] for the model; [`Error::Engine`] for a refusal; [`Error::Store`] when a Write or
/// Flush fails; [`Error::Invalid`] when the read-back finds a problem.
#[cfg(target_os = "linux")]
pub fn pack_nvme_queue(
    model_dir: &Path,
    queue: &mut picchio_nvme::NvmeQueue,
    name: &str,
    opts: &RawPackOptions,
    announce: &mut dyn FnMut(&NvmeInspection),
) -> Result<NvmePackReport> {
    let t0 = Instant::now();
    let src = Source::open(model_dir, &opts.pack)?;
    let image_len = src.plan(Path::new(name))?;
    let inspection = NvmeInspection::read(queue, name, image_len)?;
    announce(&inspection);
    inspection.permit(opts.force)?;
    let before = queue.stats();
    let mut sink = nvme_sink::NvmeSink::open(queue, name, image_len).map_err(|cause| {
        Error::Store(picchio_core::Error::Write { path: name.into(), what: "the first block", cause })
    })?;
    let w = FlatWriter::with_sink(&mut sink, store_dims(&src.cfg), src.n_entries)?;
    let (superblock, experts, placeholders) = src.write(w, opts.pack.progress)?;
    drop(sink);
    let after = queue.stats();
    let vopts = crate::verify::VerifyOptions { io_threads: 1, direct: true, progress: opts.pack.progress };
    let verify = crate::verify::verify_queue(queue, name, image_len, None, &vopts)?;
    if !verify.is_clean() || verify.entries != src.n_entries as usize {
        return Err(Error::Invalid(format!("{name}: the image was written but reading it back failed:\n{verify}")));
    }
    let pack = PackReport {
        model_dir: model_dir.into(),
        path: name.into(),
        dest: name.into(),
        superblock,
        quant: src.layout.quant,
        payload_len: src.layout.len(),
        experts,
        placeholders,
        bytes: image_len,
        elapsed: t0.elapsed(),
    };
    let commands = (after.commands - before.commands, after.flushes - before.flushes);
    Ok(NvmePackReport { pack, inspection, verify, commands })
}

/// The [`ImageSink`] that writes an image onto an NVMe namespace through [`picchio_nvme::NvmeQueue`].
#[cfg(target_os = "linux")]
pub(crate) mod nvme_sink {
    use std::io;
    use std::path::{Path, PathBuf};

    use picchio_core::format::ImageSink;
    use picchio_core::{AlignedBuf, ByteOffset, Completion, IoQueue, ReadReq, Tag, BLOCK_SIZE};
    use picchio_nvme::NvmeQueue;

    /// Bytes per gathered write run.
    const RUN: usize = 4 << 20;
    /// Runs in flight at once.
    const DEPTH: usize = 4;

    /// Gathers contiguous writes into 4 MiB aligned runs and writes each with
    /// [`NvmeQueue::submit_write`]; [`ImageSink::barrier`] waits for every run and issues a Flush.
    pub(crate) struct NvmeSink<'q> {
        queue: &'q mut NvmeQueue,
        dest: PathBuf,
        limit: u64,
        lba: usize,
        run: Option<AlignedBuf>,
        run_start: u64,
        run_len: usize,
        spare: Vec<AlignedBuf>,
        in_flight: usize,
        done: Vec<Completion>,
        failed: Option<io::Error>,
    }

    impl<'q> NvmeSink<'q> {
        /// A sink for an image of `limit` bytes at LBA 0; zeroes the first image block and flushes
        /// before returning, so the old superblock (ours or a file system's) is gone first.
        pub(crate) fn open(queue: &'q mut NvmeQueue, name: &str, limit: u64) -> io::Result<NvmeSink<'q>> {
            let lba = queue.block_size() as usize;
            let mut sink = NvmeSink {
                queue,
                dest: PathBuf::from(name),
                limit,
                lba,
                run: None,
                run_start: 0,
                run_len: 0,
                spare: Vec::new(),
                in_flight: 0,
                done: Vec::new(),
                failed: None,
            };
            sink.write_at(0, &vec![0u8; BLOCK_SIZE as usize])?;
            sink.barrier()?;
            Ok(sink)
        }

        fn buffer(&mut self) -> io::Result<AlignedBuf> {
            match self.spare.pop() {
                Some(b) => Ok(b),
                None => AlignedBuf::new(RUN, BLOCK_SIZE as usize)
                    .map_err(|e| io::Error::new(io::ErrorKind::OutOfMemory, e.to_string())),
            }
        }

        /// Reaps completions until at most `max_in_flight` runs are outstanding.
        fn drain_to(&mut self, max_in_flight: usize) -> io::Result<()> {
            while self.in_flight > max_in_flight {
                self.done.clear();
                self.queue.reap(1, &mut self.done);
                for c in self.done.drain(..) {
                    self.in_flight -= 1;
                    if let Err(e) = c.result {
                        let at = c.tag.0;
                        self.failed.get_or_insert(io::Error::new(e.kind(), format!("write at byte {at:#x}: {e}")));
                    }
                    self.spare.push(c.buf);
                }
            }
            match self.failed.take() {
                Some(e) => Err(e),
                None => Ok(()),
            }
        }

        /// Submits the gathered run.
        fn submit(&mut self) -> io::Result<()> {
            let Some(buf) = self.run.take() else { return Ok(()) };
            let len = self.run_len;
            self.run_len = 0;
            if !len.is_multiple_of(self.lba) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "write of {len} bytes at byte {:#x} is not a whole number of {}-byte LBAs",
                        self.run_start, self.lba
                    ),
                ));
            }
            self.drain_to(DEPTH - 1)?;
            let at = self.run_start;
            self.queue.submit_write(ReadReq { offset: ByteOffset(at), len: len as u32, buf, tag: Tag(at) });
            self.in_flight += 1;
            self.run_start += len as u64;
            Ok(())
        }
    }

    impl ImageSink for NvmeSink<'_> {
        fn dest(&self) -> &Path {
            &self.dest
        }

        fn write_at(&mut self, offset: u64, bytes: &[u8]) -> io::Result<()> {
            let end = offset.saturating_add(bytes.len() as u64);
            if end > self.limit {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("write of {} bytes at byte {offset:#x} past the image's {} bytes", bytes.len(), self.limit),
                ));
            }
            if self.run.is_some() && offset != self.run_start + self.run_len as u64 {
                self.submit()?;
            }
            let mut rest = bytes;
            let mut at = offset;
            while !rest.is_empty() {
                if self.run.is_none() {
                    self.run = Some(self.buffer()?);
                    self.run_start = at;
                }
                let take = rest.len().min(RUN - self.run_len);
                let run = self.run.as_mut().expect("set above");
                run.as_mut_slice()[self.run_len..self.run_len + take].copy_from_slice(&rest[..take]);
                self.run_len += take;
                rest = &rest[take..];
                at += take as u64;
                if self.run_len == RUN {
                    self.submit()?;
                }
            }
            Ok(())
        }

        fn barrier(&mut self) -> io::Result<()> {
            self.submit()?;
            self.drain_to(0)?;
            self.queue.flush()
        }

        fn commit(&mut self, _len: u64) -> picchio_core::Result<()> {
            self.barrier().map_err(|cause| picchio_core::Error::Write {
                path: self.dest.clone(),
                what: "final writes and flush",
                cause,
            })
        }
    }

    impl Drop for NvmeSink<'_> {
        fn drop(&mut self) {
            // Buffers in flight must come back before the queue is used for anything else.
            let _ = self.drain_to(0);
        }
    }
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

    #[cfg(target_os = "linux")]
    #[test]
    fn pack_nvme_requires_the_controller_on_vfio_pci() {
        let sysfs = tempfile::tempdir().unwrap();
        let s = sysfs.path();
        let dev = s.join("bus/pci/devices/0000:00:02.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("class"), "0x010802\n").unwrap();
        for d in ["nvme", "vfio-pci"] {
            std::fs::create_dir_all(s.join("bus/pci/drivers").join(d)).unwrap();
        }
        let name = "nvme:0000:00:02.0/1";
        let e = require_vfio(s, "0000:00:02.0", name).unwrap_err().to_string();
        assert!(e.contains("bound to no driver") && e.contains("picchio nvme bind 0000:00:02.0"), "{e}");
        std::os::unix::fs::symlink(s.join("bus/pci/drivers/nvme"), dev.join("driver")).unwrap();
        let e = require_vfio(s, "0000:00:02.0", name).unwrap_err().to_string();
        assert!(e.starts_with(name) && e.contains("the `nvme` driver, not vfio-pci"), "{e}");
        assert!(e.contains("nothing was written"), "{e}");
        std::fs::remove_file(dev.join("driver")).unwrap();
        std::os::unix::fs::symlink(s.join("bus/pci/drivers/vfio-pci"), dev.join("driver")).unwrap();
        require_vfio(s, "0000:00:02.0", name).unwrap();
        let e = require_vfio(s, "0000:00:09.0", name).unwrap_err().to_string();
        assert!(e.contains("0000:00:09.0"), "{e}");
    }

    #[test]
    fn free_space_is_checked_on_the_output_file_system() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("e.picchioflat");
        assert!(check_free_space(&out, 4096).is_ok());
        let r = check_free_space(&out, u64::MAX);
        if cfg!(unix) {
            let e = r.unwrap_err().to_string();
            assert!(e.contains(&out.display().to_string()) && e.contains(&format!("needs {} bytes", u64::MAX)), "{e}");
            assert!(e.contains("bytes") && e.contains("available"), "{e}");
        }
        // A bare file name is checked in the current directory.
        assert!(check_free_space(Path::new("e.picchioflat"), 1).is_ok());
    }

    #[test]
    fn out_goes_through_the_store_uri_parser() {
        assert_eq!(parse_out("x.pf").unwrap(), OutTarget::File("x.pf".into()));
        assert_eq!(parse_out("file:a:b.pf").unwrap(), OutTarget::File("a:b.pf".into()));
        assert_eq!(parse_out("./a:b.pf").unwrap(), OutTarget::File("./a:b.pf".into()));
        assert_eq!(parse_out("raw:/dev/sdz@4096").unwrap(), OutTarget::Raw { device: "/dev/sdz".into(), offset: 4096 });
        assert_eq!(parse_out("nvme:0000:99:00.0").unwrap(), OutTarget::Nvme { bdf: "0000:99:00.0".into(), nsid: 1 });
        let e = parse_out("nvme-sim:x.pf").unwrap_err().to_string();
        assert!(e.contains("nvme-sim:") && e.contains("file:x.pf") && e.contains("./PATH"), "{e}");
        let e = parse_out("s3:bucket/x").unwrap_err().to_string();
        assert!(e.contains("unknown scheme \"s3:\"") && e.contains("file:PATH or ./PATH"), "{e}");
        let e = parse_out("nvme:99:00.0").unwrap_err().to_string();
        assert!(e.contains("not a PCI address"), "{e}");
        for s in ["auto", "safetensors"] {
            let e = parse_out(s).unwrap_err().to_string();
            assert!(e.contains("not a place to write"), "{e}");
        }
    }

    #[test]
    fn only_a_missing_path_an_empty_file_or_an_image_may_be_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n);
        assert!(check_replaceable(&p("missing"), "pack").is_ok());
        std::fs::write(p("empty"), b"").unwrap();
        assert!(check_replaceable(&p("empty"), "pack").is_ok());
        let mut image = picchio_core::format::MAGIC.to_vec();
        image.resize(4096, 0);
        std::fs::write(p("old.picchioflat"), &image).unwrap();
        assert!(check_replaceable(&p("old.picchioflat"), "pack").is_ok());
        for (name, bytes) in [("config.json", &b"{\"model_type\": \"qwen3_moe\"}"[..]), ("short", b"PCHIO")] {
            std::fs::write(p(name), bytes).unwrap();
            let e = check_replaceable(&p(name), "pack").unwrap_err().to_string();
            assert!(
                e.contains(&p(name).display().to_string())
                    && e.contains("is not a .picchioflat image")
                    && e.contains("remove it or choose another --out"),
                "{e}"
            );
        }
        let e = check_replaceable(dir.path(), "pack").unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
    }
}
