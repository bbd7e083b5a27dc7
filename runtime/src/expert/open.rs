//! The one way from a store URI ([`StoreUri`]) and I/O options ([`IoOptions`]) to an engine reading
//! its image: [`open_engine`]. `picchio run` (through [`crate::expert::store::open_store`]),
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

use picchio_core::{ByteOffset, IoQueue, OffsetQueue, StoreUri};

use crate::error::{Error, Result};
use crate::expert::store::{open_queue, IoOptions};

/// An engine opened on a store's image.
pub struct Opened {
    /// The queue, reading offsets of the target (the file, device or namespace).
    pub queue: Box<dyn IoQueue>,
    /// Byte offset of the image's first byte in the target (`raw:`'s `@BYTES`, else 0).
    pub base: u64,
    /// Bytes from the image's first byte to the end of the target.
    pub image_len: u64,
    /// The store as messages name it: `file:PATH`, `raw:/dev/X[@BYTES]`, `nvme:BDF/NSID`,
    /// `nvme-sim:PATH`.
    pub name: String,
}

impl Opened {
    /// The queue reading image offsets: wrapped in an [`OffsetQueue`] when the image starts past
    /// byte 0 of the target.
    pub fn into_image_queue(self) -> Box<dyn IoQueue> {
        match self.base {
            0 => self.queue,
            b => Box::new(OffsetQueue::new(self.queue, ByteOffset(b))),
        }
    }
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
pub fn open_engine(uri: &StoreUri, io: IoOptions) -> Result<Opened> {
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
            let lock = crate::image::guard::ReadLock::acquire(path, &name, false)?;
            let (queue, len) = open_queue(path, io)?;
            Ok(Opened { queue: Locked::wrap(queue, lock), base: 0, image_len: len, name })
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
pub fn tcp_options(io: IoOptions) -> picchio_nvme::TcpOptions {
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
pub(crate) fn nvme_tcp_queue(addr: &str, subnqn: &str, nsid: u32, io: IoOptions) -> Result<picchio_nvme::NvmeTcpQueue> {
    let target = picchio_nvme::TcpTarget { addr: addr.into(), subnqn: subnqn.into(), nsid };
    let name = target.to_string();
    let mut q = picchio_nvme::NvmeTcpQueue::connect(target, tcp_options(io))
        .map_err(|cause| Error::NvmeTcp { target: name, cause })?;
    q.set_interrupt(crate::interrupt::flag());
    Ok(q)
}

/// `nvme-tcp:`: namespace `nsid` of the subsystem `subnqn` at `addr`, read by our initiator.
#[cfg(target_os = "linux")]
fn open_nvme_tcp(addr: &str, subnqn: &str, nsid: u32, io: IoOptions) -> Result<Opened> {
    let queue = nvme_tcp_queue(addr, subnqn, nsid, io)?;
    let name = queue.target().to_string();
    let image_len = queue.namespace().bytes();
    Ok(Opened { queue: Box::new(queue), base: 0, image_len, name })
}

#[cfg(not(target_os = "linux"))]
fn open_nvme_tcp(addr: &str, subnqn: &str, nsid: u32, _io: IoOptions) -> Result<Opened> {
    Err(Error::Invalid(format!(
        "nvme-tcp://{addr}/{subnqn}/{nsid}: the NVMe/TCP initiator (picchio-nvme) is Linux-only"
    )))
}

/// `raw:`: the device is measured and checked first (Linux), then read with the kernel engine.
fn open_raw(device: &Path, offset: u64, io: IoOptions) -> Result<Opened> {
    #[cfg(target_os = "linux")]
    let (name, base) = {
        let target = picchio_blockdev::raw::RawTarget::open(device, ByteOffset(offset))?;
        (target.uri(), target.base().0)
    };
    #[cfg(not(target_os = "linux"))]
    let (name, base) = (StoreUri::Raw { device: device.into(), offset }.to_string(), offset);
    let lock = crate::image::guard::ReadLock::acquire(device, &name, true)?;
    let (queue, len) = open_queue(device, io)?;
    let queue = Locked::wrap(queue, lock);
    if base >= len {
        return Err(Error::Invalid(format!(
            "{name}: offset {base} is at or past the end of {} ({len} bytes)",
            device.display()
        )));
    }
    Ok(Opened { queue, base, image_len: len - base, name })
}

/// A kernel engine's queue holding the reader's shared lock on its file or device node
/// ([`crate::image::guard::ReadLock`]) for as long as it lives.
struct Locked {
    inner: Box<dyn IoQueue>,
    _lock: crate::image::guard::ReadLock,
}

impl Locked {
    fn wrap(inner: Box<dyn IoQueue>, lock: crate::image::guard::ReadLock) -> Box<dyn IoQueue> {
        Box::new(Locked { inner, _lock: lock })
    }
}

impl IoQueue for Locked {
    fn block_size(&self) -> u32 {
        self.inner.block_size()
    }
    fn submit(&mut self, req: picchio_core::ReadReq) {
        self.inner.submit(req)
    }
    fn reap(&mut self, min: usize, out: &mut Vec<picchio_core::Completion>) -> usize {
        self.inner.reap(min, out)
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn slot_allocator(&mut self, count: usize, len: usize) -> Option<Box<dyn picchio_core::SlotAllocator>> {
        self.inner.slot_allocator(count, len)
    }
    fn bounce_bytes(&self) -> u64 {
        self.inner.bounce_bytes()
    }
}

/// `nvme:`: namespace `nsid` of the controller `bdf` (bound to `vfio-pci`) with our driver: VFIO,
/// hugepage DMA, one I/O queue pair of depth `qd` (clamped to 1..=1024, and to what the controller
/// holds, with a warning), and the VFIO data path (pool slots zero-copy, other buffers through
/// bounce buffers). SIGINT/SIGTERM end any wait for the device ([`crate::interrupt`]).
#[cfg(target_os = "linux")]
fn open_nvme(name: &str, bdf: &str, nsid: u32, qd: u32) -> Result<Opened> {
    let queue = nvme_queue(name, bdf, nsid, qd)?;
    let image_len = queue.namespace().bytes();
    Ok(Opened { queue: Box::new(queue), base: 0, image_len, name: name.into() })
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
    let lock = crate::image::guard::ReadLock::acquire(path, &name, false)?;
    let len = std::fs::metadata(path).map_err(Error::io(path, "stat the controller model's backing file"))?.len();
    let lba = if len.is_multiple_of(4096) { 4096 } else { 512 };
    let opts = NvmeQueueOptions { qd: u16::try_from(qd).unwrap_or(u16::MAX), ..NvmeQueueOptions::default() };
    // The `Sim` handle is only for fault injection and statistics; the queue keeps the model alive.
    let (queue, _sim) = NvmeQueue::open_sim(SimConfig::single(path, lba), &opts)
        .map_err(|cause| Error::Nvme { target: name.clone(), cause })?;
    let image_len = queue.namespace().bytes();
    // The lock is released after the queue (and the controller model) is dropped.
    Ok(Opened { queue: Locked::wrap(Box::new(queue), lock), base: 0, image_len, name })
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
            let e = open_engine(&uri, IoOptions::default()).err().unwrap();
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
