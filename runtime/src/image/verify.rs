//! `picchio verify`: checks a `.picchioflat` image completely — superblock, index SHA-256, every
//! index entry, every payload's hash — and, given the converted model directory, that every payload
//! is byte for byte what the model's safetensors tensors hold. A GGUF's expert bundle (version 3)
//! also has its layer table checked, and is compared byte for byte with its GGUF (the one given as
//! the model, else the one it records when that file exists), after its fingerprint.
//!
//! The superblock's dimension fields (hidden, n_layers, n_experts, topk, moe_inter) are covered by no
//! hash in format v2: without the model the report says they were not checked; with it they must
//! equal the model's ([`picchio_core::loader::StoreDims::mismatches`]).
//!
//! Whole-image faults that leave nothing to check (unreadable target, bad magic or version, an index
//! past the end) are errors; everything else is collected in a [`VerifyReport`] that names each
//! failing `(layer, expert)` with its offset, so one run lists every problem.
//!
//! The image is read once through an [`IoQueue`]: [`verify`] opens a file or block device with the
//! psync engine (O_DIRECT by default, so the bytes checked are the device's and not the page cache's;
//! buffered when the file system refuses O_DIRECT), [`verify_raw`] an image at an LBA of a block
//! device (`raw:/dev/X[@BYTES]`), [`verify_nvme`] an image at LBA 0 of an NVMe namespace through the
//! user-space driver (`nvme:BDF[/NSID]`), and [`verify_queue`] takes any engine. Nothing is ever
//! written.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use picchio_core::format::{
    decode_index, index_sha256, payload_hash, round_up, Superblock, BLOCK_SIZE, DENSE_LAYER_PLACEHOLDER,
};
use picchio_core::io::{read_blocking, ByteOffset, Completion, IoQueue, ReadReq, Tag};
use picchio_core::{AlignedBuf, ExpertKey, ExpertLoc};

use crate::error::{Error, Result};
use crate::expert::layout::ExpertLayout;
use crate::expert::store::store_dims;
use crate::model::config::Config;
use crate::model::safetensors::TensorStore;
use crate::progress;

/// Payload bytes in flight at once (at least one payload).
const WINDOW_BYTES: u64 = 64 << 20;

/// Options of [`verify`].
#[derive(Clone, Debug)]
pub struct VerifyOptions {
    /// Reader threads of the psync engine (default [`picchio_blockdev::DEFAULT_THREADS`]).
    pub io_threads: usize,
    /// Read with O_DIRECT (default), falling back to buffered reads when the file system refuses it;
    /// `false` reads through the page cache.
    pub direct: bool,
    /// Show a progress bar on stderr (default; it is hidden anyway when stderr is not a terminal).
    pub progress: bool,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        VerifyOptions { io_threads: picchio_blockdev::DEFAULT_THREADS, direct: true, progress: true }
    }
}

/// What is wrong with one index entry or its payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// The entry fails the geometry check that [`picchio_core::FlatStore::open`] applies.
    BadEntry(String),
    /// Reading the payload failed or returned fewer bytes.
    Read(String),
    /// The payload's hash differs from the index.
    Hash {
        /// Hash in the index.
        expected: u64,
        /// Hash of the bytes read.
        found: u64,
    },
    /// The entry's length is not the model's expert payload length.
    Length {
        /// The model's payload length.
        expected: usize,
        /// The entry's `len`.
        found: u32,
    },
    /// The payload differs from the model's tensors.
    Mismatch {
        /// Offset of the first differing byte within the payload.
        first: usize,
        /// Number of differing bytes.
        count: usize,
    },
    /// The slot of a dense-MLP layer does not hold the placeholder `pack` writes.
    NotPlaceholder,
    /// The model's tensors for this expert could not be read.
    Model(String),
}

/// One failing `(layer, expert)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertFailure {
    /// The expert (index slot `layer * n_experts + expert`).
    pub key: ExpertKey,
    /// The entry's payload offset in the image.
    pub offset: u64,
    /// What is wrong.
    pub kind: FailureKind,
}

impl std::fmt::Display for ExpertFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (k, o) = (self.key, self.offset);
        match &self.kind {
            FailureKind::BadEntry(r) => write!(f, "{k}: index entry (payload at {o:#x}) rejected: {r}"),
            FailureKind::Read(r) => write!(f, "{k}: reading the payload at {o:#x}: {r}"),
            FailureKind::Hash { expected, found } => {
                write!(f, "{k}: payload at {o:#x} has hash {found:#018x}, the index says {expected:#018x}")
            }
            FailureKind::Length { expected, found } => {
                write!(f, "{k}: payload at {o:#x} is {found} bytes, the model's is {expected}")
            }
            FailureKind::Mismatch { first, count } => write!(
                f,
                "{k}: payload at {o:#x} differs from the model from payload byte {first:#x} (image offset {:#x}): \
                 {count} bytes differ",
                o + *first as u64
            ),
            FailureKind::NotPlaceholder => {
                write!(f, "{k}: payload at {o:#x} of a dense-MLP layer is not the placeholder `pack` writes")
            }
            FailureKind::Model(r) => write!(f, "{k}: cannot read the model's tensors: {r}"),
        }
    }
}

/// The result of [`verify`].
#[derive(Debug)]
pub struct VerifyReport {
    /// The image, as named in messages.
    pub store: String,
    /// The engine that read it, e.g. `psync(direct, 2 threads)`.
    pub engine: String,
    /// Its superblock.
    pub superblock: Superblock,
    /// Image size in bytes.
    pub image_len: u64,
    /// Entries checked (the superblock's n_entries).
    pub entries: usize,
    /// Payload bytes read and hashed.
    pub bytes_read: u64,
    /// Entries holding the dense-layer placeholder.
    pub placeholders: usize,
    /// The model directory given, if any.
    pub model: Option<PathBuf>,
    /// Whether payloads were compared with the model (not when its dimensions differ from the store's).
    pub compared_with_model: bool,
    /// Whole-image failures: index hash, dimensions differing from the model.
    pub store_problems: Vec<picchio_core::Error>,
    /// Every failing entry, in index order.
    pub failures: Vec<ExpertFailure>,
    /// Wall time.
    pub elapsed: Duration,
}

impl VerifyReport {
    /// No problem found.
    pub fn is_clean(&self) -> bool {
        self.store_problems.is_empty() && self.failures.is_empty()
    }
}

impl std::fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} via {}: {} entries, {} payload bytes read",
            self.store, self.engine, self.entries, self.bytes_read
        )?;
        match (&self.model, self.compared_with_model) {
            (Some(m), true) => write!(f, ", compared with {}", m.display())?,
            (Some(m), false) => write!(f, ", not compared with {} (other dimensions)", m.display())?,
            (None, _) => write!(f, ", hashes only (give the model directory to compare payloads)")?,
        }
        if self.placeholders > 0 {
            write!(f, "; {} dense-MLP layer placeholders", self.placeholders)?;
        }
        if self.model.is_none() {
            let sb = &self.superblock;
            write!(
                f,
                "\nnot checked: the superblock dimensions (hidden {}, n_layers {}, n_experts {}, topk {}, moe_inter {}) \
                 are not hash-protected; give the model directory (--model) to check them against its config",
                sb.hidden, sb.n_layers, sb.n_experts, sb.topk, sb.moe_inter
            )?;
        }
        if self.is_clean() {
            return write!(f, "\nOK ({:.2?})", self.elapsed);
        }
        write!(f, "\nFAILED: {} image problem(s), {} expert(s)", self.store_problems.len(), self.failures.len())?;
        for p in &self.store_problems {
            write!(f, "\n  {p}")?;
        }
        for p in &self.failures {
            write!(f, "\n  {p}")?;
        }
        Ok(())
    }
}

/// The model side of a verification: a converted directory, or the GGUF of a bundle.
struct Model {
    cfg: Config,
    experts: ModelExperts,
}

/// Where the model's expert payloads come from.
enum ModelExperts {
    /// A converted directory's safetensors, in `layout`.
    Dir { store: TensorStore, layout: ExpertLayout },
    /// A GGUF's stacked expert tensors, per layer in `experts`.
    Gguf { weights: crate::model::gguf::GgufWeights, experts: crate::expert::layout::GgufExperts },
}

impl Model {
    /// The model's payload length of `layer`'s experts.
    fn payload_len(&self, layer: usize) -> usize {
        match &self.experts {
            ModelExperts::Dir { layout, .. } => layout.len(),
            ModelExperts::Gguf { experts, .. } => experts.payload_len(layer).unwrap_or(0),
        }
    }

    /// The model's payload of `(layer, expert)` into `out` (of [`Model::payload_len`] bytes).
    fn payload(&self, layer: usize, expert: usize, out: &mut [u8]) -> Result<()> {
        match &self.experts {
            ModelExperts::Dir { store, layout } => layout.payload_from_store(store, layer, expert, out),
            ModelExperts::Gguf { weights, experts } => {
                let slabs = experts.slabs(layer).expect("a MoE layer has slabs");
                weights.expert_payload(layer, expert, slabs, out)?;
                weights.release_expert(layer, expert, slabs);
                Ok(())
            }
        }
    }
}

/// Verifies the image in the file or block device `store` (read with the psync engine), and with
/// `model` (a converted directory) compares every payload with the model's tensors.
///
/// # Errors
/// [`Error::Engine`] when the engine cannot open `store`; otherwise as [`verify_queue`].
pub fn verify(store: &Path, model: Option<&Path>, opts: &VerifyOptions) -> Result<VerifyReport> {
    use crate::expert::open::{EngineOptions, IoEngine};
    let uri = picchio_core::StoreUri::File(store.into());
    let io = |direct| EngineOptions {
        engine: IoEngine::Psync,
        threads: opts.io_threads.max(1),
        direct,
        ..Default::default()
    };
    let mut opened = match crate::expert::open::open_engine(&uri, io(opts.direct)) {
        Ok(o) => o,
        Err(Error::Engine(e @ picchio_blockdev::Error::DirectUnsupported { .. })) => {
            tracing::warn!("{e}; verifying with buffered reads");
            crate::expert::open::open_engine(&uri, io(false))?
        }
        Err(e) => return Err(e),
    };
    // `opened` (the queue and the reader's lock) lives until the verification is over.
    verify_queue(&mut *opened.queue, &store.display().to_string(), 0, opened.image_len, model, opts)
}

/// Verifies the image on the block device `device` starting at byte `offset`
/// (`picchio verify raw:/dev/X[@offset]`), as [`verify`] does a file: the device is measured
/// (`BLKGETSIZE64`, `BLKSSZGET`), `offset` must be a whole number of logical blocks, and the image —
/// read with the psync engine, O_DIRECT unless `opts.direct` is false — runs from there to the end of
/// the device. The device is opened read-only.
///
/// # Errors
/// [`Error::Engine`] for a path that is not a block device, an offset that is not a whole LBA or lies
/// past the end, or a device the engine cannot open; otherwise as [`verify_queue`].
#[cfg(target_os = "linux")]
pub fn verify_raw(device: &Path, offset: u64, model: Option<&Path>, opts: &VerifyOptions) -> Result<VerifyReport> {
    let uri = picchio_core::StoreUri::Raw { device: device.into(), offset };
    verify_store(&uri, model, opts)
}

/// Verifies the image `uri` names, read through [`crate::expert::open::open_engine`] with the
/// psync engine (`opts.io_threads` workers, O_DIRECT unless `opts.direct` is false) for a file or
/// device, our driver for `nvme:` and `nvme-sim:`; the image runs to the end of its target.
///
/// # Errors
/// As [`crate::expert::open::open_engine`]; otherwise as [`verify_queue`].
pub fn verify_store(uri: &picchio_core::StoreUri, model: Option<&Path>, opts: &VerifyOptions) -> Result<VerifyReport> {
    use crate::expert::open::{EngineOptions, IoEngine};
    let io = EngineOptions {
        engine: IoEngine::Psync,
        threads: opts.io_threads.max(1),
        direct: opts.direct,
        qd: 32,
        ..EngineOptions::default()
    };
    let mut opened = crate::expert::open::open_engine(uri, io)?;
    let (base, image_len) = (opened.base, opened.image_len);
    verify_queue(&mut *opened.queue, &opened.name.clone(), base, image_len, model, opts)
}

/// Verifies the image at LBA 0 of namespace `nsid` of the NVMe controller `bdf`
/// (`picchio verify nvme:BDF[/NSID]`), read through our user-space driver (the controller must be
/// bound to `vfio-pci`, with 2 MiB hugepages reserved); the image runs to the end of the namespace.
/// Nothing is written.
///
/// # Errors
/// [`Error::Nvme`] naming the store when the controller cannot be opened; otherwise as
/// [`verify_queue`].
#[cfg(target_os = "linux")]
pub fn verify_nvme(bdf: &str, nsid: u32, model: Option<&Path>, opts: &VerifyOptions) -> Result<VerifyReport> {
    verify_store(&picchio_core::StoreUri::Nvme { bdf: bdf.into(), nsid }, model, opts)
}

/// Verifies the image of `image_len` bytes that starts at byte `base` of what `queue` reads (named
/// `source_name` in messages; offsets in messages and the report are image offsets); see
/// [`verify`]. Nothing else may be in flight on `queue`.
///
/// # Errors
/// [`Error::Store`] ([`picchio_core::Error::Read`], naming the offset) when the superblock or index
/// cannot be read; [`Error::Store`] for a superblock that
/// cannot be decoded (bad magic, version, block size, dimensions, index past the end); the errors of
/// opening `model` (config, safetensors, [`ExpertLayout::detect`]).
pub fn verify_queue<Q: IoQueue + ?Sized>(
    queue: &mut Q,
    source_name: &str,
    base: u64,
    image_len: u64,
    model: Option<&Path>,
    opts: &VerifyOptions,
) -> Result<VerifyReport> {
    let t0 = Instant::now();
    let bs = BLOCK_SIZE.max(queue.block_size());
    if image_len < u64::from(bs) {
        return Err(picchio_core::loader::short_target(queue, source_name.into(), base, image_len, bs).into());
    }
    // Read errors name the store, the structure and its offset (a short read says how many bytes came).
    let rd = |queue: &mut Q, what: &'static str, offset: u64, len: u64| -> Result<_> {
        let read_err = |cause| picchio_core::Error::Read { source_name: source_name.into(), what, offset, cause };
        let len = u32::try_from(len).map_err(|_| {
            read_err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{len} bytes is over one read")))
        })?;
        let at = base.checked_add(offset).ok_or_else(|| {
            read_err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "base offset + offset is past 2^64"))
        })?;
        Ok(read_blocking(queue, at, len).map_err(read_err)?)
    };
    let sb_buf = rd(queue, "the superblock", 0, u64::from(bs))?;
    let sb = Superblock::decode(sb_buf.as_slice(), source_name, image_len)?;
    let index_buf = match sb.index_len {
        0 => None,
        n => Some(rd(queue, "the index", sb.index_offset, round_up(n, u64::from(bs)))?),
    };
    let index = index_buf.as_ref().map_or(&[][..], |b| &b.as_slice()[..sb.index_len as usize]);
    let mut store_problems = Vec::new();
    let digest = index_sha256(index);
    if digest != sb.index_sha256 {
        store_problems.push(picchio_core::Error::IndexHash {
            source_name: source_name.into(),
            offset: sb.index_offset,
            len: sb.index_len,
            expected: hex(&sb.index_sha256),
            found: hex(&digest),
        });
    }
    // A bundle is compared with its recorded GGUF when no model is given and that file is there.
    let recorded = sb.bundle.as_ref().map(|h| h.source.path.clone()).filter(|p| p.is_file());
    let model = model.or(recorded.as_deref());
    let model_dir = model;
    if let Some(h) = &sb.bundle {
        // The layer table of a bundle: read, hashed, decoded.
        let len = round_up(h.layers_len.max(1), u64::from(bs));
        let table = rd(queue, "the layer table", h.layers_offset, len)?;
        let table = &table.as_slice()[..h.layers_len as usize];
        let problem = |message: String| picchio_core::Error::LayerTable {
            source_name: source_name.into(),
            offset: h.layers_offset,
            message,
        };
        let digest = picchio_core::format::layer_table_sha256(table);
        if digest != h.layers_sha256 {
            store_problems.push(problem(format!(
                "SHA-256 {}, superblock says {}",
                hex(&digest),
                hex(&h.layers_sha256)
            )));
        } else if let Err(e) = picchio_core::format::decode_layer_table(table) {
            store_problems.push(problem(e));
        }
    }
    let model = match model {
        None => None,
        Some(path) if crate::model::gguf::is_gguf(path) => {
            let weights = crate::model::gguf::GgufWeights::open(path)?;
            let cfg = weights.config()?;
            let layout = weights.expert_layout(&cfg)?;
            let experts = layout.ggml.clone().expect("a GGUF layout has its slabs");
            let mut mismatches = store_dims(&cfg).mismatches(&sb, source_name);
            // The bundle must be this GGUF's: fingerprint and layer table.
            let not_this = |what: String| picchio_core::Error::NotThisBundle { source_name: source_name.into(), what };
            match &sb.bundle {
                None => mismatches.push(not_this(format!(
                    "it is a version {} image, not the expert bundle (version 3) of a GGUF",
                    sb.version
                ))),
                Some(h) if h.source.fingerprint != experts.fingerprint => mismatches.push(not_this(format!(
                    "it was packed from a GGUF with fingerprint {}…, {}'s is {}…",
                    hex(&h.source.fingerprint[..8]),
                    path.display(),
                    hex(&experts.fingerprint[..8])
                ))),
                Some(_) => {}
            }
            let same = mismatches.is_empty();
            store_problems.extend(mismatches);
            same.then_some(Model { cfg, experts: ModelExperts::Gguf { weights, experts } })
        }
        Some(dir) => {
            let cfg = Config::from_dir(dir)?;
            let mstore = TensorStore::open(dir)?;
            let layout = ExpertLayout::detect(&mstore, &cfg)?;
            // The superblock's dimensions are covered by no hash (format v2): only the model checks them.
            let mismatches = store_dims(&cfg).mismatches(&sb, source_name);
            let same = mismatches.is_empty();
            store_problems.extend(mismatches);
            // Payloads of a store packed for other dimensions cannot be compared.
            same.then_some(Model { cfg, experts: ModelExperts::Dir { store: mstore, layout } })
        }
    };
    let entries = decode_index(index);
    let bar = progress::bar(entries.len() as u64, "verify", !opts.progress);
    let mut report = VerifyReport {
        store: source_name.into(),
        engine: queue.describe(),
        superblock: sb.clone(),
        image_len,
        entries: entries.len(),
        bytes_read: 0,
        placeholders: 0,
        model: model_dir.map(Path::to_path_buf),
        compared_with_model: model.is_some(),
        store_problems,
        failures: Vec::new(),
        elapsed: Duration::ZERO,
    };
    let key = |i: usize| ExpertKey { layer: i as u32 / sb.n_experts, expert: i as u32 % sb.n_experts };
    let mut failures: Vec<Option<ExpertFailure>> = vec![None; entries.len()];
    let mut todo: VecDeque<usize> = VecDeque::new();
    for (i, loc) in entries.iter().enumerate() {
        match loc.check(sb.block_size, sb.data_offset, image_len) {
            Ok(()) => todo.push_back(i),
            Err(reason) => {
                failures[i] =
                    Some(ExpertFailure { key: key(i), offset: loc.offset, kind: FailureKind::BadEntry(reason) });
                bar.inc(1);
            }
        }
    }
    let (mut in_flight, mut in_flight_bytes) = (0usize, 0u64);
    let mut done: Vec<Completion> = Vec::new();
    let mut expected = Vec::new();
    while !todo.is_empty() || in_flight > 0 {
        while let Some(&i) = todo.front() {
            let loc = entries[i];
            if in_flight > 0 && in_flight_bytes + u64::from(loc.padded_len) > WINDOW_BYTES {
                break;
            }
            todo.pop_front();
            let buf = AlignedBuf::new(loc.padded_len as usize, bs as usize)?;
            queue.submit(ReadReq {
                offset: ByteOffset(base + loc.offset),
                len: loc.padded_len,
                buf,
                tag: Tag(i as u64),
            });
            in_flight += 1;
            in_flight_bytes += u64::from(loc.padded_len);
        }
        done.clear();
        queue.reap(1, &mut done);
        for c in done.drain(..) {
            let i = c.tag.0 as usize;
            let loc = entries[i];
            in_flight -= 1;
            in_flight_bytes -= u64::from(loc.padded_len);
            let kind = match c.result {
                Err(e) => Some(FailureKind::Read(picchio_core::error::chain(&e).to_string())),
                Ok(n) if n < loc.len => Some(FailureKind::Read(format!("short read: {n} of {} bytes", loc.len))),
                Ok(_) => {
                    let payload = &c.buf.as_slice()[..loc.len as usize];
                    report.bytes_read += u64::from(loc.len);
                    report.placeholders += usize::from(payload == DENSE_LAYER_PLACEHOLDER);
                    check_payload(key(i), &loc, payload, model.as_ref(), &mut expected)
                }
            };
            failures[i] = kind.map(|kind| ExpertFailure { key: key(i), offset: loc.offset, kind });
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    report.failures = failures.into_iter().flatten().collect();
    report.elapsed = t0.elapsed();
    Ok(report)
}

/// Checks one payload read from the image against its index hash and, with a model, against the
/// model's tensors (`expected` is scratch space).
fn check_payload(
    key: ExpertKey,
    loc: &ExpertLoc,
    payload: &[u8],
    model: Option<&Model>,
    expected: &mut Vec<u8>,
) -> Option<FailureKind> {
    let found = payload_hash(payload);
    if found != loc.hash {
        return Some(FailureKind::Hash { expected: loc.hash, found });
    }
    let m = model?;
    let layer = key.layer as usize;
    if !m.cfg.is_moe_layer(layer) {
        return (payload != DENSE_LAYER_PLACEHOLDER).then_some(FailureKind::NotPlaceholder);
    }
    let want = m.payload_len(layer);
    if payload.len() != want {
        return Some(FailureKind::Length { expected: want, found: loc.len });
    }
    expected.resize(want, 0);
    if let Err(e) = m.payload(layer, key.expert as usize, expected) {
        return Some(FailureKind::Model(picchio_core::error::chain(&e).to_string()));
    }
    let mut diff = payload.iter().zip(expected.iter()).enumerate().filter(|(_, (a, b))| a != b).map(|(k, _)| k);
    diff.next().map(|first| FailureKind::Mismatch { first, count: 1 + diff.count() })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_display_key_and_offsets() {
        let p = ExpertFailure {
            key: ExpertKey { layer: 1, expert: 5 },
            offset: 0x2000,
            kind: FailureKind::Mismatch { first: 0x10, count: 3 },
        };
        let s = p.to_string();
        assert!(s.contains("(layer 1, expert 5)") && s.contains("0x2000") && s.contains("0x2010"), "{s}");
        let p = ExpertFailure { kind: FailureKind::Hash { expected: 1, found: 2 }, ..p };
        assert!(p.to_string().contains("0x0000000000000002"), "{p}");
    }
}
