//! The one image writer of `picchio pack` and `picchio synth`: given a target ([`WriteTo`]: a
//! `file:`, `raw:`, `nvme:` or `nvme-tcp:` URI, or an open NVMe queue) and a [`PayloadSource`] (pack's converted
//! experts, synth's seeded payloads), [`write_image`] inspects the target, announces what it will
//! overwrite, writes through the target's sink and reads every hash back.
//!
//! | target | inspect | sink | read back |
//! | --- | --- | --- | --- |
//! | `file:PATH` | [`check_replaceable`], [`check_free_space`] | [`picchio_core::FileSink`] (temporary file + atomic rename) | — |
//! | `raw:/dev/X[@BYTES]` | [`picchio_blockdev::raw::RawTarget::inspect`] | [`picchio_blockdev::raw::DeviceSink`] (`O_DIRECT \| O_EXCL`, superblock last) | psync `O_DIRECT` through [`crate::expert::open::open_engine`] |
//! | `nvme:BDF[/NSID]` | [`require_vfio`], [`NvmeInspection`] | [`picchio_nvme::NvmeSink`] (NVM Write + Flush, superblock last) | the driver |
//! | `nvme-tcp://HOST:PORT/NQN[/NSID]` | [`NvmeInspection`] | [`picchio_nvme::NvmeSink`] over [`picchio_nvme::NvmeTcpQueue`] (NVM Write in the capsule or after R2T, Flush) | the initiator |
//!
//! Every device write checks the index hash and every payload hash of what it wrote
//! ([`crate::image::verify::verify_queue`]) and fails if one differs.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use picchio_core::format::ImageSink;
use picchio_core::loader::StoreDims;
use picchio_core::{FlatWriter, StoreUri, Superblock};

use crate::error::{Error, Result};

/// What [`write_image`] writes: the image's geometry and its payloads in index order.
pub trait PayloadSource {
    /// What the source reports about its payloads, printed first in the [`WriteReport`].
    type Summary: ReportHead;

    /// The command, as messages name it (`pack`, `synth`).
    fn command(&self) -> &'static str;
    /// Whether to show a progress bar on stderr.
    fn progress(&self) -> bool;
    /// The superblock's model dimensions.
    fn dims(&self) -> StoreDims;
    /// Index entries.
    fn n_entries(&self) -> u32;
    /// The image's size in bytes, checked against the format's limits, `dest` named in errors.
    ///
    /// # Errors
    /// The source's own (geometry, `--layers`, format limits).
    fn plan(&self, dest: &Path) -> Result<u64>;
    /// Pushes every payload through `w` and finishes the image.
    ///
    /// # Errors
    /// The source's read errors; [`Error::Store`] when writing fails; [`Error::Interrupted`].
    fn write<S: ImageSink>(&self, w: FlatWriter<S>) -> Result<(Superblock, Self::Summary)>;
}

/// The first lines of a [`WriteReport`]: what the source wrote.
pub trait ReportHead: Sized {
    /// Writes them (no trailing newline) for `report`: its image (`dest`, `superblock`, `bytes`
    /// written in `elapsed`) and this summary (`report.summary`).
    ///
    /// # Errors
    /// The formatter's.
    fn fmt_head(report: &WriteReport<Self>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result;
}

/// Where [`write_image`] writes.
pub enum WriteTo<'a> {
    /// A `file:`, `raw:` or `nvme:` store (what [`crate::expert::open::write_target`] accepts).
    Uri(&'a StoreUri),
    /// The namespace an open NVMe queue drives (the controller model in tests), named `name`.
    #[cfg(target_os = "linux")]
    NvmeQueue {
        /// The queue.
        queue: &'a mut picchio_nvme::NvmeQueue,
        /// Its name in messages.
        name: &'a str,
    },
}

/// How [`write_image`] treats a device.
#[derive(Clone, Debug)]
pub struct WriteOptions {
    /// Write even a device that is mounted, in use, or carries a partition table or a file-system
    /// signature (`--force`). Never the device backing `/`; and the kernel still refuses, through
    /// `O_EXCL`, a device a mounted file system, swap area or holder uses.
    pub force: bool,
    /// Reader threads of a `raw:` read-back.
    pub io_threads: usize,
    /// Where sysfs is (normally `/sys`): an `nvme:` controller must be bound to `vfio-pci` there.
    pub sysfs: PathBuf,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions { force: false, io_threads: 1, sysfs: "/sys".into() }
    }
}

/// What a device write will overwrite, handed to the `announce` callback before writing (also
/// when the write is then refused).
pub enum Plan<'a> {
    /// A `raw:` block device.
    #[cfg(target_os = "linux")]
    Raw(&'a picchio_blockdev::raw::Inspection),
    /// An NVMe namespace.
    #[cfg(target_os = "linux")]
    Nvme(&'a NvmeInspection),
    #[doc(hidden)]
    #[cfg(not(target_os = "linux"))]
    _None(std::marker::PhantomData<&'a ()>),
}

impl std::fmt::Display for Plan<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            #[cfg(target_os = "linux")]
            Plan::Raw(i) => write!(f, "{}", i.plan("--force")),
            #[cfg(target_os = "linux")]
            Plan::Nvme(i) => write!(f, "{i}"),
            #[cfg(not(target_os = "linux"))]
            Plan::_None(_) => f.write_str(""),
        }
    }
}

/// Where the image went, beyond a file.
#[derive(Debug)]
pub enum Written {
    /// A file, replaced atomically.
    File,
    /// A block device.
    #[cfg(target_os = "linux")]
    Raw {
        /// The inspection the write was cleared by.
        inspection: picchio_blockdev::raw::Inspection,
        /// The read-back verification (clean, or the write fails).
        verify: crate::image::verify::VerifyReport,
    },
    /// An NVMe namespace.
    #[cfg(target_os = "linux")]
    Nvme {
        /// The inspection the write was cleared by.
        inspection: NvmeInspection,
        /// The read-back verification through the driver (clean, or the write fails).
        verify: crate::image::verify::VerifyReport,
        /// NVM Write commands issued and Flush commands completed.
        commands: (u64, u64),
    },
}

/// What [`write_image`] wrote: the image, the source's summary (reachable through `Deref`) and,
/// for a device, the inspection and the read-back.
#[derive(Debug)]
pub struct WriteReport<S> {
    /// Where the image went, as messages name it: the file path, `raw:/dev/X[@BYTES]`, `nvme:BDF/NSID`.
    pub dest: String,
    /// The image file, the block device, or the NVMe store's name.
    pub path: PathBuf,
    /// Its superblock.
    pub superblock: Superblock,
    /// Image size in bytes.
    pub bytes: u64,
    /// Wall time.
    pub elapsed: Duration,
    /// The source's summary.
    pub summary: S,
    /// The device part.
    pub written: Written,
}

impl<S> std::ops::Deref for WriteReport<S> {
    type Target = S;
    fn deref(&self) -> &S {
        &self.summary
    }
}

impl<S> WriteReport<S> {
    /// The read-back verification of a device write (`None` for a file).
    pub fn verify(&self) -> Option<&crate::image::verify::VerifyReport> {
        match &self.written {
            Written::File => None,
            #[cfg(target_os = "linux")]
            Written::Raw { verify, .. } | Written::Nvme { verify, .. } => Some(verify),
        }
    }

    /// The inspection a `raw:` write was cleared by (`None` for another target).
    #[cfg(target_os = "linux")]
    pub fn raw_inspection(&self) -> Option<&picchio_blockdev::raw::Inspection> {
        match &self.written {
            Written::Raw { inspection, .. } => Some(inspection),
            _ => None,
        }
    }

    /// NVM Write commands issued and Flush commands completed by an NVMe write (`None` for
    /// another target).
    pub fn nvme_commands(&self) -> Option<(u64, u64)> {
        match &self.written {
            #[cfg(target_os = "linux")]
            Written::Nvme { commands, .. } => Some(*commands),
            _ => None,
        }
    }
}

impl<S: ReportHead> std::fmt::Display for WriteReport<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        S::fmt_head(self, f)?;
        match &self.written {
            Written::File => Ok(()),
            #[cfg(target_os = "linux")]
            Written::Raw { inspection, verify } => {
                let t = inspection.target();
                write!(
                    f,
                    "\n  at {} × {} B (byte {}) of {}; read back with O_DIRECT via {}: index and {} payload hashes OK",
                    t.start(),
                    t.device().logical_block(),
                    t.base().0,
                    t.device().path().display(),
                    verify.engine,
                    verify.entries
                )
            }
            #[cfg(target_os = "linux")]
            Written::Nvme { inspection, verify, commands } => write!(
                f,
                "\n  at LBA 0 of namespace {} ({} B LBAs) with {} NVM Write commands and {} Flush through the \
                 user-space driver; read back through {}: index and {} payload hashes OK",
                inspection.namespace.nsid,
                inspection.namespace.lba_size,
                commands.0,
                commands.1,
                verify.engine,
                verify.entries
            ),
        }
    }
}

/// Writes the image of `src` to `to`.
///
/// - `file:PATH`: refused unless replaceable ([`check_replaceable`]) and its file system has room
///   ([`check_free_space`]); written atomically (temporary file + rename).
/// - `raw:/dev/X[@BYTES]`: the device is inspected ([`picchio_blockdev::raw::RawTarget::inspect`],
///   reads only) and the result handed to `announce` — also when it is then refused; cleared
///   ([`picchio_blockdev::raw::Inspection::permit`]: the image must fit; refusals unless
///   `opts.force`, the root device always); written through [`picchio_blockdev::raw::DeviceSink`]
///   (`O_DIRECT | O_EXCL`, aligned chunks, the old superblock destroyed first and the new one written
///   last after a sync); then read back through `O_DIRECT` with the psync engine. Only the named
///   device is ever opened for writing, and a path that is not a block device never is.
/// - `nvme:BDF[/NSID]`: the controller must be bound to `vfio-pci` ([`require_vfio`]); then as
///   [`WriteTo::NvmeQueue`]: the namespace's first blocks are inspected ([`NvmeInspection::read`])
///   and announced, cleared ([`NvmeInspection::permit`]), the first block zeroed and flushed (so an
///   interrupted write leaves no valid-looking superblock), payloads and index written with NVM
///   Write commands, Flush, the superblock, Flush; then read back through the driver.
///
/// # Errors
/// The source's; [`Error::StoreNotAccepted`] for a URI that is not a place to write;
/// [`Error::NotReplaced`] for a file that may not be replaced, [`Error::NotEnoughSpace`] when it has
/// no room, [`Error::NotVfio`] for a controller not bound to `vfio-pci`; [`Error::ReadBack`] when the read-back of a device or
/// namespace does not give the image written (a read fails, or the bytes are not what was written);
/// [`Error::Engine`] for a device refusal (not a block device, offset, too large, refused, busy);
/// [`Error::Store`] when a write fails; [`Error::Interrupted`] after SIGINT/SIGTERM. After an error
/// nothing is left at a file target (nor a temporary file).
pub fn write_image<P: PayloadSource>(
    to: WriteTo<'_>,
    src: &P,
    opts: &WriteOptions,
    announce: &mut dyn FnMut(&Plan<'_>),
) -> Result<WriteReport<P::Summary>> {
    let t0 = Instant::now();
    #[cfg(not(target_os = "linux"))]
    let _ = (opts, &announce); // device targets only
    let uri = match to {
        #[cfg(target_os = "linux")]
        WriteTo::NvmeQueue { queue, name } => return write_nvme(queue, name, src, opts, announce, t0),
        WriteTo::Uri(uri) => uri,
    };
    match uri {
        StoreUri::File(out) => write_file(out, src, opts, t0),
        #[cfg(target_os = "linux")]
        StoreUri::Raw { device, offset } => write_raw(device, *offset, src, opts, announce, t0),
        #[cfg(target_os = "linux")]
        StoreUri::Nvme { bdf, nsid } => {
            let name = uri.to_string();
            require_vfio(&opts.sysfs, bdf, &name)?;
            let mut queue = crate::expert::open::nvme_queue(&name, bdf, *nsid, 32)?;
            write_nvme(&mut queue, &name, src, opts, announce, t0)
        }
        #[cfg(target_os = "linux")]
        StoreUri::NvmeTcp { addr, subnqn, nsid } => {
            let name = uri.to_string();
            let io = crate::expert::open::EngineOptions { threads: 1, ..Default::default() };
            let mut queue = crate::expert::open::nvme_tcp_queue(addr, subnqn, *nsid, io)?;
            write_nvme(&mut queue, &name, src, opts, announce, t0)
        }
        #[cfg(not(target_os = "linux"))]
        StoreUri::NvmeTcp { .. } => Err(Error::StoreNotAccepted {
            option: "--out",
            uri: uri.to_string(),
            reason: "the NVMe/TCP initiator (picchio-nvme) is Linux-only".into(),
        }),
        #[cfg(not(target_os = "linux"))]
        StoreUri::Raw { device, .. } => Err(Error::StoreNotAccepted {
            option: "--out",
            uri: format!("raw:{}", device.display()),
            reason: "writing block devices is supported on Linux only".into(),
        }),
        #[cfg(not(target_os = "linux"))]
        StoreUri::Nvme { .. } => Err(Error::StoreNotAccepted {
            option: "--out",
            uri: uri.to_string(),
            reason: "the user-space NVMe driver needs Linux VFIO".into(),
        }),
        StoreUri::Auto | StoreUri::Safetensors | StoreUri::NvmeSim(_) => Err(Error::StoreNotAccepted {
            option: "--out",
            uri: uri.to_string(),
            reason: "is not a place to write an image: give file:PATH, raw:/dev/X[@BYTES], nvme:BDF[/NSID] or \
                     nvme-tcp://HOST:PORT/NQN[/NSID]"
                .into(),
        }),
    }
}

fn write_file<P: PayloadSource>(
    out: &Path,
    src: &P,
    opts: &WriteOptions,
    t0: Instant,
) -> Result<WriteReport<P::Summary>> {
    let image_len = src.plan(out)?;
    check_replaceable(out, src.command())?;
    require_parent_dir(out)?;
    // Held until the image is renamed into place: a second writer of `out` is refused meanwhile.
    let _claim = crate::image::guard::WriteLock::file(out, opts.force)?;
    crate::image::guard::sweep_leftovers(out, src.command())?;
    check_free_space(out, image_len)?;
    let (superblock, summary) = FlatWriter::create(out, src.dims(), src.n_entries())
        .map_err(Error::from)
        .and_then(|w| src.write(w))
        .map_err(out_of_space(out, image_len))?;
    let bytes = std::fs::metadata(out).map_err(Error::io(out, "stat the written image"))?.len();
    debug_assert_eq!(bytes, image_len, "the image size planned for a device");
    Ok(WriteReport {
        dest: out.display().to_string(),
        path: out.into(),
        superblock,
        bytes,
        elapsed: t0.elapsed(),
        summary,
        written: Written::File,
    })
}

#[cfg(target_os = "linux")]
fn write_raw<P: PayloadSource>(
    device: &Path,
    offset: u64,
    src: &P,
    opts: &WriteOptions,
    announce: &mut dyn FnMut(&Plan<'_>),
    t0: Instant,
) -> Result<WriteReport<P::Summary>> {
    use picchio_blockdev::raw::{DeviceSink, RawTarget};
    let image_len = src.plan(device)?;
    let target = RawTarget::open(device, picchio_core::ByteOffset(offset))?;
    let inspection = target.inspect(image_len)?;
    announce(&Plan::Raw(&inspection));
    let permit = inspection.clone().permit(opts.force)?;
    // Readers of the device refuse while it is written; a reader already at it refuses us.
    let claim = crate::image::guard::WriteLock::device(device, opts.force)?;
    let sink = DeviceSink::open(&permit)?;
    let w = FlatWriter::with_sink(sink, src.dims(), src.n_entries())?;
    let (superblock, summary) = src.write(w)?;
    drop(claim);
    let name = target.uri();
    // The writer (and its exclusive claim) is closed; read the device back, around the page cache.
    let io = crate::expert::open::EngineOptions {
        engine: crate::expert::open::IoEngine::Psync,
        direct: true,
        threads: opts.io_threads.max(1),
        ..Default::default()
    };
    let uri = StoreUri::Raw { device: device.into(), offset };
    let mut opened = crate::expert::open::open_engine(&uri, io)?;
    let base = opened.base;
    let verify = read_back(&mut *opened.queue, &name, base, image_len, src, opts.io_threads)?;
    Ok(WriteReport {
        dest: name,
        path: device.into(),
        superblock,
        bytes: image_len,
        elapsed: t0.elapsed(),
        summary,
        written: Written::Raw { inspection, verify },
    })
}

#[cfg(target_os = "linux")]
fn write_nvme<Q: picchio_nvme::NvmWriteQueue, P: PayloadSource>(
    queue: &mut Q,
    name: &str,
    src: &P,
    opts: &WriteOptions,
    announce: &mut dyn FnMut(&Plan<'_>),
    t0: Instant,
) -> Result<WriteReport<P::Summary>> {
    let image_len = src.plan(Path::new(name))?;
    let inspection = NvmeInspection::read(queue, name, image_len)?;
    announce(&Plan::Nvme(&inspection));
    inspection.permit(opts.force)?;
    let before = queue.command_counts();
    let mut sink = picchio_nvme::NvmeSink::open(queue, name, image_len).map_err(|cause| {
        Error::Store(picchio_core::Error::Write { path: name.into(), what: "the first block", cause })
    })?;
    let w = FlatWriter::with_sink(&mut sink, src.dims(), src.n_entries())?;
    let (superblock, summary) = src.write(w)?;
    drop(sink);
    let after = queue.command_counts();
    let verify = read_back(queue, name, 0, image_len, src, 1)?;
    let commands = (after.0 - before.0, after.1 - before.1);
    Ok(WriteReport {
        dest: name.into(),
        path: name.into(),
        superblock,
        bytes: image_len,
        elapsed: t0.elapsed(),
        summary,
        written: Written::Nvme { inspection, verify, commands },
    })
}

/// Reads the image (at byte `base` of what `queue` reads) back and checks the index hash and every
/// payload hash.
#[cfg(target_os = "linux")]
fn read_back<Q: picchio_core::IoQueue + ?Sized, P: PayloadSource>(
    queue: &mut Q,
    name: &str,
    base: u64,
    image_len: u64,
    src: &P,
    io_threads: usize,
) -> Result<crate::image::verify::VerifyReport> {
    let vopts = crate::image::verify::VerifyOptions { io_threads, direct: true, progress: src.progress() };
    let verify = crate::image::verify::verify_queue(queue, name, base, image_len, None, &vopts)
        .map_err(|e| Error::ReadBack { dest: name.into(), report: None, cause: Some(Box::new(e)) })?;
    if !verify.is_clean() || verify.entries != src.n_entries() as usize {
        return Err(Error::ReadBack { dest: name.into(), report: Some(verify.to_string()), cause: None });
    }
    Ok(verify)
}

/// Refuses an `out` that `command` (as messages name it: `pack`, `synth`) must not replace:
/// anything but a missing path, an empty regular file, or a regular file starting with the image magic `PCHIOFL1` (a previous image: re-packing
/// replaces it). So `--out MODEL/model.safetensors` or `--out MODEL/config.json` fails before any
/// work instead of destroying a model file.
///
/// # Errors
/// [`Error::NotReplaced`] naming `out`, what it is and `command`; [`Error::Io`] when it exists but cannot
/// be read.
pub fn check_replaceable(out: &Path, command: &str) -> Result<()> {
    use std::io::Read;
    let md = match std::fs::metadata(out) {
        Ok(md) => md,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(out, "stat the output path")(e)),
    };
    let refuse = |what: &'static str| Err(Error::NotReplaced { path: out.into(), command: command.into(), what });
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

/// Refuses to start writing `needed` bytes at `out` (an image file, or a model directory from
/// convert, transcode or the synthetic writer) when the file system that will hold it (the one of
/// `out`'s directory, where the temporary file or directory goes) has fewer bytes
/// available to us (`statvfs`: `f_bavail × f_frsize`, what an unprivileged writer may use). The old
/// output, if any, stays until the rename, so all `needed` bytes must be free. On targets without
/// `statvfs` (Windows) nothing is checked and a full disk shows as the write error.
///
/// # Errors
/// [`Error::NotEnoughSpace`] naming `out`, the bytes needed and the bytes available; [`Error::Io`] when the
/// file system cannot be queried.
pub fn check_free_space(out: &Path, needed: u64) -> Result<()> {
    require_parent_dir(out)?;
    let dir = match out.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Some(available) =
        picchio_blockdev::host::free_bytes(dir).map_err(Error::io(dir, "query the free space (statvfs)"))?
    else {
        return Ok(());
    };
    if needed > available {
        return Err(Error::NotEnoughSpace { path: out.into(), needed, available });
    }
    Ok(())
}

/// For a write to `out` (an image file or a model directory) that needed `needed` bytes: turns an
/// error caused by its file system filling up (`ENOSPC`, or `EDQUOT` for a quota) into
/// [`Error::NoSpace`] naming `out`, the bytes needed and the bytes available now; any other error
/// passes through. Call it on the write phase's error after its temporary output was dropped (the
/// message says the partial output is gone). The free-space check before the write passed, so a
/// full disk here means something else used the space meanwhile (another writer, a log).
pub fn out_of_space(out: &Path, needed: u64) -> impl FnOnce(Error) -> Error + '_ {
    move |e| {
        let full = {
            let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            let mut found = false;
            while let Some(c) = cur {
                if let Some(io) = c.downcast_ref::<std::io::Error>() {
                    if matches!(io.kind(), std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded) {
                        found = true;
                        break;
                    }
                }
                cur = c.source();
            }
            found
        };
        if !full {
            return e;
        }
        let dir = match out.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let available = picchio_blockdev::host::free_bytes(dir).ok().flatten();
        Error::NoSpace { path: out.into(), needed, available, cause: Box::new(e) }
    }
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
    /// How the namespace is reached (`user-space driver, vfio-pci`, `user-space NVMe/TCP initiator`).
    pub transport: &'static str,
}

#[cfg(target_os = "linux")]
impl NvmeInspection {
    /// Reads the first [`picchio_blockdev::raw::HEAD_BYTES`] of the namespace through `queue` and
    /// looks for partition tables, file systems, volumes and images with
    /// [`picchio_blockdev::raw::scan_signatures`] (the `raw:` check). Reads only.
    ///
    /// # Errors
    /// [`Error::Io`] naming `name` when the read fails.
    pub fn read<Q: picchio_nvme::NvmWriteQueue>(queue: &mut Q, name: &str, image_len: u64) -> Result<NvmeInspection> {
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
        Ok(NvmeInspection { name: name.into(), namespace, image_len, findings, transport: queue.transport() })
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
            "{}: namespace {}, {} LBAs × {} B = {} bytes ({})",
            self.name,
            ns.nsid,
            ns.blocks,
            lbs,
            ns.bytes(),
            self.transport
        )?;
        write!(
            f,
            "  writes {} bytes: namespace bytes 0x0..{:#x}, LBA 0..{} of {}",
            self.image_len,
            self.image_len,
            self.image_len.div_ceil(lbs),
            ns.blocks
        )?;
        picchio_blockdev::raw::write_findings(f, &self.findings, "no partition table or known signature", "--force")
    }
}

/// Refuses a controller that is not bound to `vfio-pci` according to `sysfs`, naming its driver
/// and the command that binds it.
#[cfg(target_os = "linux")]
pub fn require_vfio(sysfs: &Path, bdf: &str, name: &str) -> Result<()> {
    let bdf = crate::nvme_admin::Bdf::parse(bdf).map_err(Error::admin(name))?;
    let ctrl = crate::nvme_admin::controller(sysfs, "", &bdf).map_err(Error::admin(name))?;
    match ctrl.driver.as_deref() {
        Some("vfio-pci") => Ok(()),
        other => Err(Error::NotVfio { target: name.into(), bdf: bdf.to_string(), driver: other.map(str::to_string) }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        // The sysfs error is the source (`Error::Admin`): the chain, as printed, names the address.
        let e = picchio_core::error::chain(&require_vfio(s, "0000:00:09.0", name).unwrap_err()).to_string();
        assert!(e.starts_with(name) && e.contains("0000:00:09.0"), "{e}");
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
