//! The one way from a store URI ([`StoreUri`]) and engine options ([`EngineOptions`]) to an engine
//! reading its image: [`open_engine`], which returns the queue with the reader's lock on the target
//! ([`Opened`]). The kernel engines (psync, io_uring, IOCP: [`IoEngine`]) are opened here too. This
//! module is the bottom of opening: `picchio run` (through [`super::store::open_store`],
//! which builds the expert loader on it),
//! `picchio verify`, the read-back of `pack` and `synth` ([`crate::image::write`]) and every
//! `picchio bench` experiment open their queue here.
//!
//! | store | engine |
//! | --- | --- |
//! | `file:PATH` | the kernel engine of `io` (psync, io_uring, IOCP) on the file |
//! | `raw:/dev/X[@BYTES]` | the same on the block device, after [`picchio_blockdev::raw::RawTarget::open`] (a block device, a whole-LBA offset inside it) |
//! | `nvme:BDF[/NSID]` | our user-space driver over VFIO, `io.qd` commands in flight |
//! | `nvme-sim:PATH` | our driver against picchio-nvme's software controller model serving the file as namespace 1 |
//! | `nvme-tcp://HOST:PORT/NQN[/NSID]` | our NVMe/TCP initiator: `io.threads` I/O queues (TCP connections) of `io.qd` commands each |
//!
//! Which URIs a command accepts is decided before opening: [`bench_store`] (what bench reads) and
//! [`write_target`] (what pack and synth write) refuse the others with [`Error::StoreNotAccepted`],
//! naming the URI and the accepted forms. A run (`run`, `chat`, `serve`) reads every image form,
//! `nvme-sim:` included: the nvme: code path (queues, PRP lists, the controller shutdown at exit)
//! against the controller model, without a device.

use std::path::Path;

use picchio_blockdev::{PsyncOptions, PsyncQueue};
#[cfg(target_os = "linux")]
use picchio_blockdev::{UringOptions, UringQueue};
use picchio_core::{IoQueue, StoreUri};

use crate::error::{Error, Result};
use crate::image::guard::ReadLock;

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

/// What [`open_engine`] needs to open a store's engine: which kernel engine reads a file or
/// device, how (page cache or not, threads, queue depth, io_uring flags), and the depth and
/// queues of the NVMe engines. How a decode step schedules its expert reads is apart
/// ([`crate::model::DecodeSchedule`]), and so is checking payload hashes (`verify` of
/// [`super::store::open_flat`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineOptions {
    /// The kernel engine of `file:` and `raw:` stores (`--io`).
    pub engine: IoEngine,
    /// O_DIRECT (no page cache; `--buffered` clears it): the default for flat stores.
    pub direct: bool,
    /// Reader threads of the psync engine (`--io-threads`); for `nvme-tcp:`, its I/O queues (TCP
    /// connections).
    pub threads: usize,
    /// Reads in flight of the uring and IOCP engines, commands in flight of the NVMe engines
    /// (`--qd`, 1..=256).
    pub qd: u32,
    /// uring: a kernel thread polls the submission queue (`--sqpoll`).
    pub sqpoll: bool,
    /// uring: completions are polled from the device (`--iopoll`; needs O_DIRECT and polled queues).
    pub iopoll: bool,
    /// uring: register the file with the ring (the default; see `picchio_blockdev::UringOptions`).
    pub register_files: bool,
    /// uring: where io_uring is unavailable, read with the psync engine (warned about once; the
    /// default). Bench clears it, so that an unavailable io_uring is an error, not a psync figure
    /// labelled `uring`.
    pub uring_fallback: bool,
}

impl Default for EngineOptions {
    /// The platform's default engine ([`IoEngine::default`]), O_DIRECT, 2 psync threads, depth 32,
    /// a registered file, the psync fallback on.
    fn default() -> Self {
        EngineOptions {
            engine: IoEngine::default(),
            direct: true,
            threads: 2,
            qd: 32,
            sqpoll: false,
            iopoll: false,
            register_files: true,
            uring_fallback: true,
        }
    }
}

/// Opens `path` (a file or a block device) with the kernel engine `io` asks for and returns the
/// queue and the target's length in bytes: the file and device arm of [`open_engine`].
///
/// # Errors
/// [`Error::Engine`] naming the path when the engine cannot open it (e.g. O_DIRECT refused, or an
/// io_uring flag such as `--sqpoll` refused). An unavailable io_uring is not an error (psync
/// serves) unless `io.uring_fallback` is off.
fn open_queue(path: &Path, io: EngineOptions) -> Result<(Box<dyn IoQueue>, u64)> {
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
fn open_iocp(path: &Path, io: EngineOptions) -> Result<(Box<dyn IoQueue>, u64)> {
    let q = picchio_blockdev::IocpQueue::open(path, picchio_blockdev::IocpOptions { qd: io.qd })?;
    let len = q.len();
    Ok((Box::new(q), len))
}

#[cfg(not(windows))]
fn open_iocp(_path: &Path, _io: EngineOptions) -> Result<(Box<dyn IoQueue>, u64)> {
    Err(Error::Invalid("--io iocp is the Windows engine; use --io uring or --io psync here".into()))
}

fn open_psync(path: &Path, io: EngineOptions) -> Result<(Box<dyn IoQueue>, u64)> {
    let q = PsyncQueue::open(path, PsyncOptions { threads: io.threads.max(1), direct: io.direct })?;
    let len = q.len();
    Ok((Box::new(q), len))
}

/// The uring queue, or `None` (warned about once per process) when io_uring is unavailable here.
#[cfg(target_os = "linux")]
fn open_uring(path: &Path, io: EngineOptions) -> Result<Option<(Box<dyn IoQueue>, u64)>> {
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
fn open_uring(_path: &Path, io: EngineOptions) -> Result<Option<(Box<dyn IoQueue>, u64)>> {
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

/// An engine opened on a store's image, with the reader's lock on its target.
///
/// Whoever reads through `queue` keeps this value (or, having moved the queue out, its `lock`)
/// for as long as it reads: [`super::store::flat_from`] moves both into the
/// [`picchio_core::FlatStore`] ([`picchio_core::FlatStore::with_guard`]), the one-shot readers
/// (verify, the superblock read, pack's read-back, bench) read through `&mut *opened.queue`.
/// Fields drop in declaration order: the queue (and a controller model behind it) before the lock.
pub struct Opened {
    /// The queue, reading offsets of the target (the file, device or namespace): image offset `o`
    /// is at `base + o`.
    pub queue: Box<dyn IoQueue>,
    /// Byte offset of the image's first byte in the target (`raw:`'s `@BYTES`, else 0).
    pub base: u64,
    /// Bytes from the image's first byte to the end of the target.
    pub image_len: u64,
    /// The store as messages name it: `file:PATH`, `raw:/dev/X[@BYTES]`, `nvme:BDF/NSID`,
    /// `nvme-sim:PATH`.
    pub name: String,
    /// The shared lock on the image file or device node ([`ReadLock`]) that writers of the target
    /// (`pack`, `synth`) wait for or are refused by: `file:`, `raw:` and `nvme-sim:` stores hold
    /// one; `nvme:` and `nvme-tcp:` (no node of ours to lock) none.
    pub lock: Option<ReadLock>,
}

/// Opens the engine `io` asks for on the image `uri` names.
///
/// # Errors
/// [`Error::StoreNotAccepted`] for `auto` and `safetensors` (no image to open: a run resolves them
/// first); [`Error::Engine`] when the kernel engine cannot open the file or device, for a `raw:`
/// path that is not a block device or an offset that is not a whole LBA inside it;
/// [`Error::Invalid`] when `raw:`'s offset lies at or past the end, and naming the store for VFIO,
/// DMA, controller-model or controller-initialisation failures (and for `nvme:`/`nvme-sim:` off
/// Linux).
pub fn open_engine(uri: &StoreUri, io: EngineOptions) -> Result<Opened> {
    let uri = &resolve_device(uri.clone());
    match uri {
        StoreUri::Auto | StoreUri::Safetensors => Err(Error::StoreNotAccepted {
            option: "--store",
            uri: uri.to_string(),
            reason: "names no image to open: give file:PATH, raw:/dev/X[@BYTES], nvme:BDF[/NSID], nvme-sim:PATH or \
                     nvme-tcp://HOST:PORT/NQN[/NSID]"
                .into(),
        }),
        StoreUri::File(path) => {
            let name = format!("file:{}", path.display());
            let lock = ReadLock::acquire(path, &name, false)?;
            let (queue, len) = open_queue(path, io)?;
            Ok(Opened { queue, base: 0, image_len: len, name, lock: Some(lock) })
        }
        StoreUri::Raw { device, offset } => open_raw(device, *offset, io),
        StoreUri::Nvme { bdf, nsid } => open_nvme(&uri.to_string(), bdf, *nsid, io.qd),
        StoreUri::NvmeSim(path) => open_nvme_sim(path, io.qd),
        StoreUri::NvmeTcp { addr, subnqn, nsid } => open_nvme_tcp(addr, subnqn, *nsid, io),
    }
}

/// The store a plain path or `file:PATH` names when the path is a block device: `raw:PATH`, the image
/// from byte 0 (where `pack --out raw:PATH` writes it). `run`, `verify` and `bench` all read a store
/// through this, so a device named either way is read alike: checked as a block device (size, LBA
/// size), locked as one ([`crate::image::guard::ReadLock`]), measured as the S4 tier. Any other URI,
/// and a path that cannot be stat'ed (its opening names the error), is returned unchanged.
pub fn resolve_device(uri: StoreUri) -> StoreUri {
    #[cfg(unix)]
    if let StoreUri::File(p) = &uri {
        let block = std::fs::metadata(p).is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()));
        if block {
            return StoreUri::Raw { device: p.clone(), offset: 0 };
        }
    }
    uri
}

/// The NVMe/TCP initiator options of a store opened with `io`: `io.threads` I/O queues (one TCP
/// connection each, 1..=64), `io.qd` commands in flight on each (clamped by the controller).
/// `PICCHIO_NVME_TCP_DIGESTS` = `header`, `data` or `both` asks for CRC32C digests.
#[cfg(target_os = "linux")]
pub fn tcp_options(io: EngineOptions) -> picchio_nvme::TcpOptions {
    let digests = std::env::var("PICCHIO_NVME_TCP_DIGESTS").unwrap_or_default();
    picchio_nvme::TcpOptions {
        io_queues: io.threads.clamp(1, 64) as u16,
        qd: io.qd.clamp(1, 1024) as u16,
        hdgst: matches!(digests.as_str(), "header" | "both"),
        ddgst: matches!(digests.as_str(), "data" | "both"),
        ..picchio_nvme::TcpOptions::default()
    }
}

/// The initiator's queue of [`open_engine`]'s `nvme-tcp:` arm, for the writers that need the queue
/// itself (its namespace, Write and Flush).
///
/// # Errors
/// [`Error::NvmeTcp`] naming the store, with the initiator's error (address, step, status).
#[cfg(target_os = "linux")]
pub(crate) fn nvme_tcp_queue(
    addr: &str,
    subnqn: &str,
    nsid: u32,
    io: EngineOptions,
) -> Result<picchio_nvme::NvmeTcpQueue> {
    let target = picchio_nvme::TcpTarget { addr: addr.into(), subnqn: subnqn.into(), nsid };
    let name = target.to_string();
    let mut q = picchio_nvme::NvmeTcpQueue::connect(target, tcp_options(io))
        .map_err(|cause| Error::NvmeTcp { target: name, cause })?;
    q.set_interrupt(crate::interrupt::flag());
    Ok(q)
}

/// `nvme-tcp:`: namespace `nsid` of the subsystem `subnqn` at `addr`, read by our initiator.
#[cfg(target_os = "linux")]
fn open_nvme_tcp(addr: &str, subnqn: &str, nsid: u32, io: EngineOptions) -> Result<Opened> {
    let queue = nvme_tcp_queue(addr, subnqn, nsid, io)?;
    let name = queue.target().to_string();
    let image_len = queue.namespace().bytes();
    Ok(Opened { queue: Box::new(queue), base: 0, image_len, name, lock: None })
}

#[cfg(not(target_os = "linux"))]
fn open_nvme_tcp(addr: &str, subnqn: &str, nsid: u32, _io: EngineOptions) -> Result<Opened> {
    Err(Error::Invalid(format!(
        "nvme-tcp://{addr}/{subnqn}/{nsid}: the NVMe/TCP initiator (picchio-nvme) is Linux-only"
    )))
}

/// `raw:`: the device is measured and checked first (Linux), then read with the kernel engine.
fn open_raw(device: &Path, offset: u64, io: EngineOptions) -> Result<Opened> {
    #[cfg(target_os = "linux")]
    let (name, base) = {
        let target = picchio_blockdev::raw::RawTarget::open(device, picchio_core::ByteOffset(offset))?;
        (target.uri(), target.base().0)
    };
    #[cfg(not(target_os = "linux"))]
    let (name, base) = (StoreUri::Raw { device: device.into(), offset }.to_string(), offset);
    let lock = ReadLock::acquire(device, &name, true)?;
    let (queue, len) = open_queue(device, io)?;
    if base >= len {
        return Err(Error::Invalid(format!(
            "{name}: offset {base} is at or past the end of {} ({len} bytes)",
            device.display()
        )));
    }
    Ok(Opened { queue, base, image_len: len - base, name, lock: Some(lock) })
}

/// `nvme:`: namespace `nsid` of the controller `bdf` (bound to `vfio-pci`) with our driver: VFIO,
/// hugepage DMA, one I/O queue pair of depth `qd` (clamped to 1..=1024, and to what the controller
/// holds, with a warning), and the VFIO data path (pool slots zero-copy, other buffers through
/// bounce buffers). SIGINT/SIGTERM end any wait for the device ([`crate::interrupt`]).
#[cfg(target_os = "linux")]
fn open_nvme(name: &str, bdf: &str, nsid: u32, qd: u32) -> Result<Opened> {
    let queue = nvme_queue(name, bdf, nsid, qd)?;
    let image_len = queue.namespace().bytes();
    Ok(Opened { queue: Box::new(queue), base: 0, image_len, name: name.into(), lock: None })
}

/// The driver's queue of [`open_engine`]'s `nvme:` arm, for the writers that need the NVMe queue
/// itself (its namespace, Write and Flush commands: [`picchio_nvme::NvmeSink`]).
#[cfg(target_os = "linux")]
pub(crate) fn nvme_queue(name: &str, bdf: &str, nsid: u32, qd: u32) -> Result<picchio_nvme::NvmeQueue> {
    use picchio_nvme::engine::{NvmeQueue, NvmeQueueOptions};
    let qopts = NvmeQueueOptions { nsid, qd: qd.clamp(1, 1024) as u16, ..NvmeQueueOptions::default() };
    let fail = |cause: picchio_nvme::Error| Error::Nvme { target: name.to_string(), cause };
    let ctrlr = picchio_nvme::vfio::open_controller(bdf, qopts.ctrlr_options()).map_err(fail)?;
    let mut queue = NvmeQueue::with_bounce_buffer(ctrlr, nsid, qopts.timeout, format!("vfio {bdf}")).map_err(fail)?;
    queue.warn_if_clamped(qopts.qd);
    queue.set_interrupt(crate::interrupt::flag());
    Ok(queue)
}

#[cfg(not(target_os = "linux"))]
fn open_nvme(name: &str, _bdf: &str, _nsid: u32, _qd: u32) -> Result<Opened> {
    Err(Error::Invalid(format!("{name}: the user-space NVMe driver needs Linux VFIO")))
}

/// `nvme-sim:`: our driver against the controller model serving `path` as namespace 1 (4096-byte
/// LBAs when the file is a whole number of them, else 512), `qd` commands in flight. The queue owns
/// the model: its controller holds the model's register window, which keeps the model thread
/// running until the driver has shut the controller down. Like a `file:` reader it holds a shared
/// lock on the file ([`crate::image::guard::ReadLock`]) while it lives, so a writer of the file
/// (`pack`, `synth`) waits for it or is refused, as docs/guarantees.md says of every reader.
#[cfg(target_os = "linux")]
fn open_nvme_sim(path: &Path, qd: u32) -> Result<Opened> {
    use picchio_nvme::{sim::SimConfig, NvmeQueue, NvmeQueueOptions};
    let name = StoreUri::NvmeSim(path.into()).to_string();
    let lock = ReadLock::acquire(path, &name, false)?;
    let len = std::fs::metadata(path).map_err(Error::io(path, "stat the controller model's backing file"))?.len();
    let lba = if len.is_multiple_of(4096) { 4096 } else { 512 };
    let opts = NvmeQueueOptions { qd: u16::try_from(qd).unwrap_or(u16::MAX), ..NvmeQueueOptions::default() };
    // The `Sim` handle is only for fault injection and statistics; the queue keeps the model alive.
    let (queue, _sim) = NvmeQueue::open_sim(SimConfig::single(path, lba), &opts)
        .map_err(|cause| Error::Nvme { target: name.clone(), cause })?;
    let image_len = queue.namespace().bytes();
    // The lock is released after the queue (and the controller model) is dropped (`Opened`).
    Ok(Opened { queue: Box::new(queue), base: 0, image_len, name, lock: Some(lock) })
}

/// The controller model is part of picchio-nvme, which is Linux-only: always an error here.
#[cfg(not(target_os = "linux"))]
fn open_nvme_sim(path: &Path, _qd: u32) -> Result<Opened> {
    Err(Error::Invalid(format!("nvme-sim:{}: picchio-nvme is Linux-only", path.display())))
}

/// The forms `picchio bench` reads, as its refusals list them.
const BENCH_FORMS: &str = "give file:PATH (or a path), raw:/dev/X[@BYTES], nvme-sim:PATH, nvme:BDF[/NSID] or \
                           nvme-tcp://HOST:PORT/NQN[/NSID] \
                           (a .picchioflat image: `picchio synth` or `picchio pack` writes one)";

/// Parses a `picchio bench --store` value: `file:PATH` or a path, `raw:/dev/X[@BYTES]`,
/// `nvme-sim:PATH`, `nvme:BDF[/NSID]` or `nvme-tcp://HOST:PORT/NQN[/NSID]`.
///
/// # Errors
/// [`Error::StoreNotAccepted`] for `auto`, `safetensors`, an empty value or an unknown scheme,
/// listing the forms bench reads; [`Error::Store`] ([`picchio_core::Error::BadUri`]) for a
/// malformed URI of a known scheme.
pub fn bench_store(s: &str) -> Result<StoreUri> {
    let refuse = |uri: String, reason: String| Error::StoreNotAccepted { option: "--store", uri, reason };
    if s.is_empty() {
        return Err(refuse(format!("{s:?}"), BENCH_FORMS.into()));
    }
    match s.parse::<StoreUri>() {
        // StoreUri's list of schemes names `auto` and `safetensors`, which bench does not read.
        Err(picchio_core::Error::UnknownScheme { .. }) => Err(refuse(format!("{s:?}"), BENCH_FORMS.into())),
        Err(e) => Err(e.into()),
        Ok(uri @ (StoreUri::Auto | StoreUri::Safetensors)) => {
            Err(refuse(uri.to_string(), format!("bench reads a .picchioflat image: {BENCH_FORMS}")))
        }
        // A block device given as a path is read as `raw:` (as run and verify read it).
        Ok(uri) => Ok(resolve_device(uri)),
    }
}

/// Parses a `picchio pack --out` or `picchio synth --out` value with the `--store` parser, so every
/// scheme is either a place to write or refused by name — never taken for a file name: `file:PATH`
/// or a path, `raw:/dev/X[@BYTES]`, `nvme:BDF[/NSID]`, `nvme-tcp://HOST:PORT/NQN[/NSID]`. `auto` and `safetensors` choose what a run
/// reads and are refused; so is `nvme-sim:PATH` (`picchio bench`'s software controller reading an
/// image file: write the file, then measure `nvme-sim:` it).
///
/// # Errors
/// [`Error::StoreNotAccepted`] naming the value and the scheme (for an unknown scheme it also says
/// that a path containing ':' is written `file:PATH` or `./PATH`).
pub fn write_target(s: &str) -> Result<StoreUri> {
    let refuse = |uri: String, reason: String| Error::StoreNotAccepted { option: "--out", uri, reason };
    let uri = s.parse::<StoreUri>().map_err(|e| match e {
        picchio_core::Error::BadUri { message, .. } | picchio_core::Error::UnknownScheme { message, .. } => {
            refuse(format!("{s:?}"), message)
        }
        other => Error::Store(other),
    })?;
    match uri {
        StoreUri::File(_) | StoreUri::Raw { .. } | StoreUri::Nvme { .. } | StoreUri::NvmeTcp { .. } => Ok(uri),
        StoreUri::NvmeSim(path) => Err(refuse(
            s.into(),
            format!(
                "nvme-sim: is a read target of `picchio bench` (an image file served by the software NVMe \
                 controller), not a place to write: write --out file:{} and measure --store {s} (a file name \
                 containing ':' is written file:PATH or ./PATH)",
                path.display()
            ),
        )),
        StoreUri::Auto | StoreUri::Safetensors => Err(refuse(
            uri.to_string(),
            format!(
                "`{uri}` chooses what `picchio run --store` reads, it is not a place to write an image: give a path \
                 (file:PATH or ./PATH for a name like this one), raw:/dev/X[@BYTES], nvme:BDF[/NSID] or \
                 nvme-tcp://HOST:PORT/NQN[/NSID]"
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_command_accepts_its_forms_and_names_the_others() {
        for s in ["file:/a/e.picchioflat", "raw:/dev/loop3@4096", "nvme-sim:/a/e", "nvme:0000:03:00.0/1"] {
            assert_eq!(bench_store(s).unwrap().to_string(), s);
        }
        assert_eq!(bench_store("x.picchioflat").unwrap(), StoreUri::File("x.picchioflat".into()));
        for s in ["auto", "safetensors", "s3:x", ""] {
            let e = bench_store(s).unwrap_err();
            assert!(matches!(e, Error::StoreNotAccepted { .. }), "{s}: {e}");
            let e = e.to_string();
            assert!(e.contains("nvme-sim:PATH") && !e.contains("safetensors,") && !e.contains("auto,"), "{s}: {e}");
        }
        assert!(bench_store("nvme-sim:").is_err());
        assert_eq!(write_target("x.pf").unwrap(), StoreUri::File("x.pf".into()));
        for s in ["nvme-sim:x.pf", "auto", "s3:x"] {
            assert!(matches!(write_target(s), Err(Error::StoreNotAccepted { option: "--out", .. })), "{s}");
        }
    }

    #[test]
    fn auto_and_safetensors_open_no_engine() {
        for uri in [StoreUri::Auto, StoreUri::Safetensors] {
            let e = open_engine(&uri, EngineOptions::default()).err().unwrap();
            assert!(matches!(e, Error::StoreNotAccepted { .. }), "{e}");
        }
    }

    #[test]
    fn out_goes_through_the_store_uri_parser() {
        assert_eq!(write_target("x.pf").unwrap(), StoreUri::File("x.pf".into()));
        assert_eq!(write_target("file:a:b.pf").unwrap(), StoreUri::File("a:b.pf".into()));
        assert_eq!(write_target("./a:b.pf").unwrap(), StoreUri::File("./a:b.pf".into()));
        assert_eq!(
            write_target("raw:/dev/sdz@4096").unwrap(),
            StoreUri::Raw { device: "/dev/sdz".into(), offset: 4096 }
        );
        assert_eq!(write_target("nvme:0000:99:00.0").unwrap(), StoreUri::Nvme { bdf: "0000:99:00.0".into(), nsid: 1 });
        let e = write_target("nvme-sim:x.pf").unwrap_err().to_string();
        assert!(e.contains("nvme-sim:") && e.contains("file:x.pf") && e.contains("./PATH"), "{e}");
        let e = write_target("s3:bucket/x").unwrap_err().to_string();
        assert!(e.contains("unknown scheme \"s3:\"") && e.contains("file:PATH or ./PATH"), "{e}");
        let e = write_target("nvme:99:00.0").unwrap_err().to_string();
        assert!(e.contains("not a PCI address"), "{e}");
        for s in ["auto", "safetensors"] {
            let e = write_target(s).unwrap_err().to_string();
            assert!(e.contains("not a place to write"), "{e}");
        }
    }
}
