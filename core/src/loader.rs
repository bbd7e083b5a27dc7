//! [`ExpertLoader`], the expert-load boundary the runtime consumes, and [`FlatStore`], which serves
//! it from a `.picchioflat` image through any [`IoQueue`].

use std::sync::Arc;
use std::time::Instant;

use crate::buf::AlignedBuf;
use crate::error::{Error, Result};
use crate::format::{
    decode_index, decode_layer_table, index_sha256, layer_table_sha256, payload_hash, round_up, ExpertLoc, LayerDesc,
    Superblock, BLOCK_SIZE,
};
use crate::io::{read_blocking, ByteOffset, Completion, IoQueue, ReadReq, SlotAllocator, Tag};
use crate::stats::IoStats;

/// One routed expert: `(layer, expert)`, both 0-based.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertKey {
    /// Decoder layer index.
    pub layer: u32,
    /// Expert index within the layer.
    pub expert: u32,
}

impl std::fmt::Display for ExpertKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "(layer {}, expert {})", self.layer, self.expert)
    }
}

/// Why one expert could not be delivered by a loader. Always per expert: the caller may fall back.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The store has no entry for the expert (a prefix store, or a model layer without experts).
    #[error("{source_name}: no entry for {key} (the store holds {n_entries} entries)")]
    Missing {
        /// The store.
        source_name: String,
        /// The expert.
        key: ExpertKey,
        /// Entries in the store.
        n_entries: u32,
    },
    /// The entry was rejected when the index was checked at open.
    #[error("{source_name}: index entry for {key} rejected: {reason}")]
    Rejected {
        /// The store.
        source_name: String,
        /// The expert.
        key: ExpertKey,
        /// What the check expected.
        reason: String,
    },
    /// The read failed.
    #[error("{source_name}: reading {key} at offset {offset:#x}")]
    Io {
        /// The store.
        source_name: String,
        /// The expert.
        key: ExpertKey,
        /// Byte offset of the read.
        offset: u64,
        /// The engine's error.
        #[source]
        cause: std::io::Error,
    },
    /// The read returned fewer bytes than the padded payload.
    #[error("{source_name}: short read of {key} at offset {offset:#x}: {got} of {want} bytes")]
    Short {
        /// The store.
        source_name: String,
        /// The expert.
        key: ExpertKey,
        /// Byte offset of the read.
        offset: u64,
        /// Bytes read.
        got: u32,
        /// Bytes requested.
        want: u32,
    },
    /// `--verify`: the payload hash differs from the index.
    #[error(
        "{source_name}: payload of {key} at offset {offset:#x} has hash {found:#018x}, index says {expected:#018x}"
    )]
    Hash {
        /// The store.
        source_name: String,
        /// The expert.
        key: ExpertKey,
        /// Byte offset of the payload.
        offset: u64,
        /// Hash in the index.
        expected: u64,
        /// Hash of the bytes read.
        found: u64,
    },
    /// The slot handed in is smaller than the payload.
    #[error("{source_name}: slot of {slot} bytes is too small for {key} ({need} bytes)")]
    SlotTooSmall {
        /// The store.
        source_name: String,
        /// The expert.
        key: ExpertKey,
        /// Slot length.
        slot: usize,
        /// Bytes needed.
        need: usize,
    },
    /// The image changed under the reader after it was opened (its superblock or index is no longer
    /// the one [`FlatStore::open`] checked): nothing more is read from it.
    #[error("{source_name}: not reading {key}: the image changed under this reader ({what})")]
    Changed {
        /// The store.
        source_name: String,
        /// The expert.
        key: ExpertKey,
        /// What differs from what was opened.
        what: String,
    },
    /// A loader-specific failure (e.g. a safetensors tensor missing), described in full.
    #[error("{0}")]
    Other(String),
}

/// An expert delivered into its slot (or the reason it was not).
#[derive(Debug)]
pub struct Loaded {
    /// Which expert.
    pub key: ExpertKey,
    /// The slot, holding the payload in its first bytes when `result` is `Ok`.
    pub buf: AlignedBuf,
    /// Success, or why the slot holds no valid payload.
    pub result: std::result::Result<(), LoadError>,
}

/// The expert-load boundary: the runtime sees only this trait.
///
/// `load` reads each requested expert of `layer` into the slot given with it and calls `ready` once
/// per request, as soon as that expert's bytes are in place (in completion order, not request order),
/// so compute can start on ready experts while others are still in flight. Every slot comes back
/// through `ready` exactly once, with or without a payload. The payload layout is the `.picchioflat`
/// one: gate_up packed, gate_up scales, down packed, down scales.
pub trait ExpertLoader: Send {
    /// What serves the experts, for logs and statistics (e.g. `file:/m/experts.picchioflat`).
    fn describe(&self) -> String;

    /// Loads `requests` (expert id, slot) of `layer`; see the trait documentation.
    fn load(&mut self, layer: u32, requests: Vec<(u32, AlignedBuf)>, ready: &mut dyn FnMut(Loaded));

    /// Where an expert cache of `count` slots of `len` bytes should allocate them so this loader's
    /// reads land in them without a copy ([`IoQueue::slot_allocator`] of the engine behind it).
    /// `None` (the default): on the heap.
    fn slot_allocator(&mut self, count: usize, len: usize) -> Option<Box<dyn SlotAllocator>> {
        let _ = (count, len);
        None
    }
}

impl<L: ExpertLoader + ?Sized> ExpertLoader for Box<L> {
    fn describe(&self) -> String {
        (**self).describe()
    }
    fn load(&mut self, layer: u32, requests: Vec<(u32, AlignedBuf)>, ready: &mut dyn FnMut(Loaded)) {
        (**self).load(layer, requests, ready)
    }
    fn slot_allocator(&mut self, count: usize, len: usize) -> Option<Box<dyn SlotAllocator>> {
        (**self).slot_allocator(count, len)
    }
}

/// The model dimensions a store's superblock records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreDims {
    /// Hidden size.
    pub hidden: u32,
    /// Decoder layers of the model.
    pub n_layers: u32,
    /// Routed experts per layer.
    pub n_experts: u32,
    /// Experts per token.
    pub topk: u32,
    /// 2 × moe_intermediate_size (fused gate_up rows).
    pub moe_inter: u32,
}

impl StoreDims {
    /// The superblock fields of `sb` that differ from these dimensions, in superblock order, as
    /// [`Error::DimensionMismatch`] (`expected` is ours, `found` the superblock's) naming the store
    /// `source_name`. `moe_inter` is named with what it is, `2 × moe_intermediate_size`, so the numbers
    /// are not mistaken for config.json's `moe_intermediate_size`.
    pub fn mismatches(&self, sb: &Superblock, source_name: &str) -> Vec<Error> {
        [
            ("hidden", self.hidden, sb.hidden),
            ("n_layers", self.n_layers, sb.n_layers),
            ("n_experts", self.n_experts, sb.n_experts),
            ("topk", self.topk, sb.topk),
            ("moe_inter (2 × moe_intermediate_size)", self.moe_inter, sb.moe_inter),
        ]
        .into_iter()
        .filter(|(_, want, got)| want != got)
        .map(|(field, want, got)| Error::DimensionMismatch {
            source_name: source_name.into(),
            field,
            expected: want.into(),
            found: got.into(),
        })
        .collect()
    }
}

/// What the model using a store requires of it, checked at open.
#[derive(Clone, Copy, Debug)]
pub struct StoreExpect {
    /// Dimensions that must equal the superblock's.
    pub dims: StoreDims,
    /// Exact payload bytes of one expert under the model's quantization; entries with another `len`
    /// are rejected (and fall back).
    pub payload_len: u32,
}

/// What the GGUF model using a version 3 bundle requires of it ([`FlatStore::open_bundle`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BundleExpect {
    /// The GGUF's fingerprint, which must equal the bundle's (`GgufWeights::fingerprint` in the
    /// runtime).
    pub fingerprint: [u8; 32],
    /// One descriptor per decoder layer, as the model computes with its experts: the bundle's
    /// layer table must equal it, and each entry's `len` must be its layer's payload length.
    pub layers: Vec<LayerDesc>,
}

/// Options for [`FlatStore::open`].
#[derive(Clone, Debug, Default)]
pub struct FlatStoreOptions {
    /// Byte offset of the image on the target (0 for a file; `raw:/dev/X@N`).
    pub base_offset: u64,
    /// Bytes of the target from `base_offset` to its end.
    pub image_len: u64,
    /// Check every payload's hash after reading it (`--verify`).
    pub verify: bool,
    /// Checks against the model, when a model uses the store.
    pub expect: Option<StoreExpect>,
    /// Re-read the superblock after every this many [`ExpertLoader::load`] calls that read something
    /// and compare it with the one opened (0: only after a failed read, short read or hash mismatch;
    /// see [`FlatStore`], "An image that changes under its reader").
    pub recheck_every: u32,
}

/// A `.picchioflat` image served through an [`IoQueue`]: one aligned read of `padded_len` bytes per
/// expert, with the superblock and every index entry checked once at open.
///
/// # An image that changes under its reader
/// Another process may overwrite the image in place while it is read (`pack --force` onto a `raw:`
/// device a run reads; any program writing the file). The store keeps the superblock block it opened
/// and compares it with the one on the target again ([`FlatStore::check_unchanged`]):
/// - after every batch in which a read failed, came back short or (under `--verify`) a payload's hash
///   differed from the index: then also the index is read again and hashed;
/// - every [`FlatStoreOptions::recheck_every`] batches that read something (the superblock only).
///
/// Once it differs, the image is marked changed: one error is logged, and every
/// later request fails at once with [`LoadError::Changed`] without touching the target, so a
/// [`FallbackLoader`] serves every expert from then on. What that guarantees: under `--verify` no
/// payload of another image is ever handed out (each is checked against the index opened, a
/// 64-bit hash); without it, payloads read between the overwrite and the next check are used as
/// read. Picchio's device writer destroys the old superblock before it writes any payload, so a check
/// after a batch sees every such overwrite that the batch could have read.
pub struct FlatStore<Q: IoQueue> {
    queue: Q,
    source_name: String,
    sb: Superblock,
    entries: Vec<std::result::Result<ExpertLoc, String>>,
    opts: FlatStoreOptions,
    stats: Arc<IoStats>,
    completions: Vec<Completion>,
    /// The engine's [`IoQueue::bounce_bytes`] already added to `stats`.
    bounce_seen: u64,
    /// The superblock block as opened (its first [`BLOCK_SIZE`] bytes).
    sb_block: Vec<u8>,
    /// Batches that read something since the superblock was last compared.
    since_check: u32,
    /// Set once the image is found changed: what differs.
    changed: Option<String>,
    /// Kept as long as the store and dropped just after the queue ([`FlatStore::with_guard`]).
    /// Declared last: fields drop in declaration order.
    guard: Option<Box<dyn Send>>,
}

impl<Q: IoQueue> FlatStore<Q> {
    /// Reads and checks the superblock and index of the image that `queue` reads, named
    /// `source_name` in messages.
    ///
    /// Whole-store faults (bad magic, version, dimensions, index hash, truncated index) are errors.
    /// Per-entry faults (misaligned, past the end, wrong length for the model) only reject that entry:
    /// loading it reports [`LoadError::Rejected`] so the caller can fall back.
    ///
    /// # Errors
    /// [`Error::Read`], [`Error::BadMagic`], [`Error::BadField`], [`Error::Truncated`],
    /// [`Error::IndexHash`], [`Error::DimensionMismatch`].
    pub fn open(queue: Q, source_name: impl Into<String>, opts: FlatStoreOptions) -> Result<Self> {
        Self::open_checked(queue, source_name.into(), opts, None)
    }

    /// Opens a version 3 bundle of a GGUF model as [`FlatStore::open`] does, and checks it against
    /// `bundle`: the bundle's recorded fingerprint, and its layer table (read, its SHA-256 checked
    /// against the superblock's, then compared layer by layer). Each entry's `len` must then equal
    /// its layer's payload length (the placeholder's for a layer without routed experts is rejected
    /// as in v2); `opts.expect`'s `payload_len` is not used for entries.
    ///
    /// # Errors
    /// As [`FlatStore::open`]; [`Error::LayerTable`] for a layer table that does not read, hash or
    /// decode; [`Error::NotThisBundle`] for a version 2 image, another GGUF's bundle (fingerprint)
    /// or a layer table that differs from `bundle`'s, naming the first difference.
    pub fn open_bundle(
        queue: Q,
        source_name: impl Into<String>,
        opts: FlatStoreOptions,
        bundle: &BundleExpect,
    ) -> Result<Self> {
        Self::open_checked(queue, source_name.into(), opts, Some(bundle))
    }

    fn open_checked(
        mut queue: Q,
        source_name: String,
        opts: FlatStoreOptions,
        bundle: Option<&BundleExpect>,
    ) -> Result<Self> {
        let bs = BLOCK_SIZE.max(queue.block_size());
        if opts.image_len < u64::from(bs) {
            return Err(short_target(&mut queue, source_name, opts.base_offset, opts.image_len, bs));
        }
        let rd = |queue: &mut Q, what: &'static str, offset: u64, len: u32| {
            let at = opts.base_offset.checked_add(offset).ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "base offset + offset is past 2^64")
            });
            at.and_then(|at| read_blocking(queue, at, len)).map_err(|cause| Error::Read {
                source_name: source_name.clone(),
                what,
                offset,
                cause,
            })
        };
        let sb_buf = rd(&mut queue, "superblock", 0, bs)?;
        let sb = Superblock::decode(sb_buf.as_slice(), &source_name, opts.image_len)?;
        let sb_block = sb_buf.as_slice()[..BLOCK_SIZE as usize].to_vec();
        let index_read = round_up(sb.index_len.max(1), u64::from(bs));
        let index_read = u32::try_from(index_read).map_err(|_| Error::BadField {
            source_name: source_name.clone(),
            field: "index_len",
            offset: 48,
            expected: format!("an index this reader can read in one request (at most {} bytes)", u32::MAX),
            found: sb.index_len,
        })?;
        let index_buf = rd(&mut queue, "index", sb.index_offset, index_read)?;
        let index_bytes = &index_buf.as_slice()[..sb.index_len as usize];
        let digest = index_sha256(index_bytes);
        if digest != sb.index_sha256 {
            return Err(Error::IndexHash {
                source_name,
                offset: sb.index_offset,
                len: sb.index_len,
                expected: hex(&sb.index_sha256),
                found: hex(&digest),
            });
        }
        if let Some(expect) = &opts.expect {
            if let Some(e) = expect.dims.mismatches(&sb, &source_name).into_iter().next() {
                return Err(e);
            }
        }
        // The payload length each entry must have: per layer for a bundle, else uniform.
        let layer_lens: Option<Vec<Option<u64>>> = match (bundle, &sb.bundle) {
            (Some(want), _) => {
                check_bundle(&mut queue, &sb, &source_name, &opts, want)?;
                Some(want.layers.iter().map(LayerDesc::payload_len).collect())
            }
            (None, Some(h)) if opts.expect.is_some() => {
                return Err(Error::NotThisBundle {
                    source_name,
                    what: format!(
                        "it is the expert bundle (version 3) of the GGUF {}, not an image of this model directory",
                        h.source.path.display()
                    ),
                })
            }
            (None, _) => None,
        };
        let n_experts = sb.n_experts.max(1) as usize;
        let expected_len = |i: usize| -> Option<u64> {
            match &layer_lens {
                Some(lens) => lens.get(i / n_experts).copied().flatten(),
                None => opts.expect.as_ref().map(|e| u64::from(e.payload_len)),
            }
        };
        let has_expect = opts.expect.is_some() || layer_lens.is_some();
        let entries = decode_index(index_bytes)
            .into_iter()
            .enumerate()
            .map(|(i, loc)| {
                loc.check(sb.block_size, sb.data_offset, opts.image_len)?;
                if has_expect {
                    match expected_len(i) {
                        Some(want) if u64::from(loc.len) == want => {}
                        Some(want) => {
                            return Err(format!(
                                "len {} differs from the model's expert payload of {want} bytes",
                                loc.len
                            ))
                        }
                        None => return Err("the model's layer has no routed experts".into()),
                    }
                }
                Ok(loc)
            })
            .collect::<Vec<_>>();
        if has_expect {
            // No entry of the model's payload size at all: the image holds another quantization (or
            // another model), which is a whole-store mismatch, not n_entries separate faults.
            let lens = decode_index(index_bytes);
            let fits = |(i, l): (usize, &ExpertLoc)| expected_len(i) == Some(u64::from(l.len));
            let first_moe = (0..lens.len()).find(|&i| expected_len(i).is_some());
            if let Some(i) = first_moe.filter(|_| !lens.iter().enumerate().any(fits)) {
                return Err(Error::DimensionMismatch {
                    source_name,
                    field: "expert payload length (quantization)",
                    expected: expected_len(i).unwrap_or(0),
                    found: lens[i].len.into(),
                });
            }
        }
        // One line per open, not one per entry (a model with dense-MLP layers has n_experts
        // placeholder entries per such layer, rejected by the length check and never requested).
        let mut rejected = entries.iter().enumerate().filter_map(|(i, e)| e.as_ref().err().map(|r| (i, r)));
        if let Some((i, reason)) = rejected.next() {
            let key = ExpertKey { layer: i as u32 / sb.n_experts, expert: i as u32 % sb.n_experts };
            tracing::warn!(
                "{source_name}: {} index entries rejected (first: {key}: {reason}); requests for them go to the fallback",
                1 + rejected.count()
            );
        }
        // Bounce bytes count expert loads only, not the superblock and index reads above.
        let bounce_seen = queue.bounce_bytes();
        Ok(FlatStore {
            queue,
            source_name,
            sb,
            entries,
            opts,
            stats: Arc::default(),
            completions: Vec::new(),
            bounce_seen,
            sb_block,
            since_check: 0,
            changed: None,
            guard: None,
        })
    }

    /// Keeps `guard` alive as long as this store, dropped just after its queue: what must outlive
    /// the reader of the target and nothing longer (the runtime's shared reader lock on the image
    /// file or device node, which writers of the target wait for). Replaces an earlier guard.
    pub fn with_guard(mut self, guard: impl Send + 'static) -> Self {
        self.guard = Some(Box::new(guard));
        self
    }

    /// Whether the image on the target is still the one opened: reads the superblock block again and
    /// compares it byte for byte (and, with `index`, reads the index again and checks its SHA-256
    /// against the opened superblock's). `Ok(Some(what))` says what differs; `Ok(None)`: unchanged.
    /// Engine reads only; called by [`ExpertLoader::load`] (see the type's docs), public for tests
    /// and tools.
    ///
    /// # Errors
    /// The engine's error when a read fails (a failing device is not taken for a changed image: its
    /// failing reads fall back one by one).
    pub fn check_unchanged(&mut self, index: bool) -> std::io::Result<Option<String>> {
        let bs = BLOCK_SIZE.max(self.queue.block_size());
        let base = self.opts.base_offset;
        let now = read_blocking(&mut self.queue, base, bs)?;
        let now = &now.as_slice()[..BLOCK_SIZE as usize];
        if now != self.sb_block.as_slice() {
            let what = match Superblock::decode(now, &self.source_name, self.opts.image_len) {
                Err(e) => format!("its superblock is no longer valid: {e}"),
                Ok(sb) if sb.index_sha256 != self.sb.index_sha256 => format!(
                    "its superblock now describes another index (SHA-256 {}…, opened {}…)",
                    hex(&sb.index_sha256[..8]),
                    hex(&self.sb.index_sha256[..8])
                ),
                Ok(_) => "its superblock block differs from the one opened".to_string(),
            };
            return Ok(Some(what));
        }
        if index {
            let len = round_up(self.sb.index_len.max(1), u64::from(bs)) as u32;
            let buf = read_blocking(&mut self.queue, base + self.sb.index_offset, len)?;
            if index_sha256(&buf.as_slice()[..self.sb.index_len as usize]) != self.sb.index_sha256 {
                return Ok(Some("its index no longer matches the SHA-256 in the superblock opened".into()));
            }
        }
        Ok(None)
    }

    /// The image was found changed (see the type's docs): what differs.
    pub fn changed(&self) -> Option<&str> {
        self.changed.as_deref()
    }

    /// Runs [`FlatStore::check_unchanged`] after a batch (`failed`: a read in it failed), marking
    /// the image changed and logging once when it differs.
    fn recheck(&mut self, failed: bool) {
        self.since_check += 1;
        let due = self.opts.recheck_every > 0 && self.since_check >= self.opts.recheck_every;
        if self.changed.is_some() || !(failed || due) {
            return;
        }
        self.since_check = 0;
        if let Ok(Some(what)) = self.check_unchanged(failed) {
            tracing::error!(
                "{}: the image changed under this run ({what}): nothing more is read from it; every expert \
                 comes from the fallback from now on",
                self.source_name
            );
            self.changed = Some(what);
        }
    }

    /// Shares statistics with another owner (e.g. the runtime's report).
    pub fn with_stats(mut self, stats: Arc<IoStats>) -> Self {
        self.stats = stats;
        self
    }

    /// The checked superblock.
    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }

    /// The index entry of `key`, or why it is unusable.
    pub fn entry(&self, key: ExpertKey) -> std::result::Result<ExpertLoc, LoadError> {
        if key.expert >= self.sb.n_experts {
            return Err(self.missing(key));
        }
        let i = key.layer as usize * self.sb.n_experts as usize + key.expert as usize;
        match self.entries.get(i) {
            None => Err(self.missing(key)),
            Some(Ok(loc)) => Ok(*loc),
            Some(Err(reason)) => {
                Err(LoadError::Rejected { source_name: self.source_name.clone(), key, reason: reason.clone() })
            }
        }
    }

    fn missing(&self, key: ExpertKey) -> LoadError {
        LoadError::Missing { source_name: self.source_name.clone(), key, n_entries: self.sb.n_entries }
    }

    /// Statistics of this store.
    pub fn stats(&self) -> &Arc<IoStats> {
        &self.stats
    }

    /// The engine serving the reads.
    pub fn queue(&self) -> &Q {
        &self.queue
    }

    /// The store's name in messages.
    pub fn source_name(&self) -> &str {
        &self.source_name
    }
}

impl<Q: IoQueue> std::fmt::Debug for FlatStore<Q> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlatStore")
            .field("source", &self.source_name)
            .field("engine", &self.queue.describe())
            .field("superblock", &self.sb)
            .finish_non_exhaustive()
    }
}

/// Reads the layer table of the bundle `sb` describes, checks its SHA-256, and compares the bundle
/// with what the model expects (`want`): the version, the fingerprint, then each layer.
fn check_bundle<Q: IoQueue>(
    queue: &mut Q,
    sb: &Superblock,
    source_name: &str,
    opts: &FlatStoreOptions,
    want: &BundleExpect,
) -> Result<()> {
    let not_this = |what: String| Error::NotThisBundle { source_name: source_name.into(), what };
    let Some(h) = &sb.bundle else {
        return Err(not_this(format!(
            "it is a version {} image, not the expert bundle (version 3) of a GGUF",
            sb.version
        )));
    };
    if h.source.fingerprint != want.fingerprint {
        return Err(not_this(format!(
            "it was packed from {} with fingerprint {}…, and this GGUF's fingerprint is {}… (the GGUF changed \
             since, or the bundle is another GGUF's)",
            h.source.path.display(),
            hex(&h.source.fingerprint[..8]),
            hex(&want.fingerprint[..8])
        )));
    }
    let table_err =
        |message: String| Error::LayerTable { source_name: source_name.into(), offset: h.layers_offset, message };
    let bs = BLOCK_SIZE.max(queue.block_size());
    let len = u32::try_from(round_up(h.layers_len.max(1), u64::from(bs)))
        .map_err(|_| table_err(format!("{} bytes do not fit one read", h.layers_len)))?;
    let at = opts.base_offset.checked_add(h.layers_offset).ok_or_else(|| table_err("offset past 2^64".into()))?;
    let buf = read_blocking(queue, at, len).map_err(|e| table_err(format!("read failed: {e}")))?;
    let table = &buf.as_slice()[..h.layers_len as usize];
    if layer_table_sha256(table) != h.layers_sha256 {
        return Err(table_err(format!(
            "SHA-256 {}, superblock says {}",
            hex(&layer_table_sha256(table)),
            hex(&h.layers_sha256)
        )));
    }
    let layers = decode_layer_table(table).map_err(table_err)?;
    if layers.len() != want.layers.len() {
        return Err(not_this(format!("{} layers in the bundle, {} in the model", layers.len(), want.layers.len())));
    }
    if let Some((l, (got, w))) = layers.iter().zip(&want.layers).enumerate().find(|(_, (g, w))| g != w) {
        return Err(not_this(format!("layer {l}: the bundle's experts are {got:?}, the model's {w:?}")));
    }
    Ok(())
}

/// The error for an image target of `image_len` bytes, shorter than one block of `bs` bytes, that
/// `queue` reads from byte `base`: [`Error::BadMagic`] when its first eight bytes are there and are not
/// the magic (a foreign file such as a config.json is "not a .picchioflat image", not a truncated
/// one), else [`Error::Truncated`] for the superblock.
pub fn short_target<Q: IoQueue + ?Sized>(
    queue: &mut Q,
    source_name: String,
    base: u64,
    image_len: u64,
    bs: u32,
) -> Error {
    match foreign_magic(queue, base, bs) {
        Some(found) => Error::BadMagic { source_name, found },
        None => Error::Truncated { source_name, what: "superblock", offset: 0, end: u64::from(bs), len: image_len },
    }
}

/// The first eight bytes of a target shorter than one block of `bs` bytes (one read of a block at
/// `base`, whose completion is short at the end of the target), when they are not the magic: `None`
/// when they are, when fewer than eight bytes are there, or when the read fails.
fn foreign_magic<Q: IoQueue + ?Sized>(queue: &mut Q, base: u64, bs: u32) -> Option<String> {
    let buf = AlignedBuf::new(bs as usize, bs.max(512) as usize).ok()?;
    queue.submit(ReadReq { offset: ByteOffset(base), len: bs, buf, tag: Tag(u64::MAX) });
    let mut out = Vec::with_capacity(1);
    while out.is_empty() {
        queue.reap(1, &mut out);
    }
    let c = out.pop()?;
    let n = c.result.ok()? as usize;
    let head = c.buf.as_slice().get(..n.min(8)).filter(|h| h.len() == 8)?;
    (head != crate::format::MAGIC.as_slice()).then(|| String::from_utf8_lossy(head).into_owned())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl<Q: IoQueue> ExpertLoader for FlatStore<Q> {
    fn describe(&self) -> String {
        format!("{} via {}", self.source_name, self.queue.describe())
    }

    fn load(&mut self, layer: u32, requests: Vec<(u32, AlignedBuf)>, ready: &mut dyn FnMut(Loaded)) {
        // Read wall time = time blocked in submit/reap, not the compute the caller does in `ready`
        // (with async MoE, experts are computed inside `ready` while other reads are in flight).
        let mut waited = std::time::Duration::ZERO;
        let t_submit = Instant::now();
        // Tag = position in `pending`; the payload's (key, loc) travel beside it.
        let mut pending: Vec<(ExpertKey, ExpertLoc)> = Vec::with_capacity(requests.len());
        for (expert, buf) in requests {
            let key = ExpertKey { layer, expert };
            if let Some(what) = &self.changed {
                self.stats.record_error();
                let e = LoadError::Changed { source_name: self.source_name.clone(), key, what: what.clone() };
                ready(Loaded { key, buf, result: Err(e) });
                continue;
            }
            let loc = match self.entry(key) {
                Ok(loc) => loc,
                Err(e) => {
                    // No entry by design (a prefix store) is not a store error.
                    if matches!(e, LoadError::Missing { .. }) {
                        self.stats.record_missing();
                    } else {
                        self.stats.record_error();
                    }
                    ready(Loaded { key, buf, result: Err(e) });
                    continue;
                }
            };
            if buf.len() < loc.padded_len as usize {
                self.stats.record_error();
                let e = LoadError::SlotTooSmall {
                    source_name: self.source_name.clone(),
                    key,
                    slot: buf.len(),
                    need: loc.padded_len as usize,
                };
                ready(Loaded { key, buf, result: Err(e) });
                continue;
            }
            let tag = Tag(pending.len() as u64);
            pending.push((key, loc));
            self.queue.submit(ReadReq {
                offset: ByteOffset(self.opts.base_offset + loc.offset),
                len: loc.padded_len,
                buf,
                tag,
            });
        }
        waited += t_submit.elapsed();
        // When the last completion was reaped: the end of the span reads were in flight.
        let mut last_reap = None;
        let mut left = pending.len();
        let mut done = vec![false; pending.len()];
        let mut failed = false;
        while left > 0 {
            self.completions.clear();
            let t_reap = Instant::now();
            let reaped = self.queue.reap(1, &mut self.completions);
            waited += t_reap.elapsed();
            if reaped > 0 {
                last_reap = Some(Instant::now());
            }
            if reaped == 0 && self.queue.in_flight() == 0 {
                // The engine lost requests: fail them rather than wait forever. Their slots are gone
                // with the engine's bookkeeping, so only the error can be reported.
                for (i, (key, _)) in pending.iter().enumerate().filter(|(i, _)| !done[*i]) {
                    tracing::error!(
                        "{}: the engine reported nothing in flight while {key} (request {i}) was pending",
                        self.source_name
                    );
                    self.stats.record_error();
                }
                break;
            }
            for c in self.completions.drain(..) {
                left -= 1;
                done[c.tag.0 as usize] = true;
                let (key, loc) = pending[c.tag.0 as usize];
                let result = match c.result {
                    Err(cause) => {
                        Err(LoadError::Io { source_name: self.source_name.clone(), key, offset: loc.offset, cause })
                    }
                    Ok(n) if n != loc.padded_len => Err(LoadError::Short {
                        source_name: self.source_name.clone(),
                        key,
                        offset: loc.offset,
                        got: n,
                        want: loc.padded_len,
                    }),
                    Ok(_) => {
                        self.stats.record_read(u64::from(loc.padded_len), c.latency_ns);
                        let found = if self.opts.verify {
                            payload_hash(&c.buf.as_slice()[..loc.len as usize])
                        } else {
                            loc.hash
                        };
                        if found == loc.hash {
                            Ok(())
                        } else {
                            Err(LoadError::Hash {
                                source_name: self.source_name.clone(),
                                key,
                                offset: loc.offset,
                                expected: loc.hash,
                                found,
                            })
                        }
                    }
                };
                if result.is_err() {
                    self.stats.record_error();
                    failed = true;
                }
                ready(Loaded { key, buf: c.buf, result });
            }
        }
        self.stats.add_wall(waited.as_nanos() as u64);
        if let Some(end) = last_reap {
            self.stats.add_span(end.duration_since(t_submit).as_nanos() as u64);
        }
        let bounce = self.queue.bounce_bytes();
        self.stats.record_bounce(bounce.saturating_sub(self.bounce_seen));
        self.bounce_seen = bounce;
        if !pending.is_empty() {
            crate::stop_point::loaded();
            self.recheck(failed);
            // The check's own reads are not expert loads.
            self.bounce_seen = self.queue.bounce_bytes();
        }
    }

    fn slot_allocator(&mut self, count: usize, len: usize) -> Option<Box<dyn SlotAllocator>> {
        self.queue.slot_allocator(count, len)
    }
}

/// Serves every expert from `primary`, and each one `primary` fails on from `fallback` (counted in
/// `stats`): a corrupt or partial store costs speed, never correctness.
///
/// Logging: each (layer, expert) that falls back is logged once (a warning with its cause), not once
/// per request; experts a prefix store has no entry for are logged once per store (info). When the
/// loader is dropped, one summary line gives the fallbacks per cause and how many distinct experts.
pub struct FallbackLoader<P, F> {
    primary: P,
    fallback: F,
    stats: Arc<IoStats>,
    /// The experts already logged.
    logged: std::collections::HashSet<ExpertKey>,
    /// Fallbacks per cause (see [`cause`]), for the summary.
    causes: std::collections::BTreeMap<&'static str, u64>,
}

impl<P: ExpertLoader, F: ExpertLoader> FallbackLoader<P, F> {
    /// Wraps `primary` with `fallback`; fallbacks are counted in `stats`.
    pub fn new(primary: P, fallback: F, stats: Arc<IoStats>) -> Self {
        FallbackLoader { primary, fallback, stats, logged: Default::default(), causes: Default::default() }
    }

    /// Distinct experts that fell back so far, and the fallbacks per cause.
    pub fn fallback_summary(&self) -> (usize, &std::collections::BTreeMap<&'static str, u64>) {
        (self.logged.len(), &self.causes)
    }
}

/// The cause of an expert a prefix store has no entry for.
fn cause_missing() -> &'static str {
    "not in the store (prefix image)"
}

/// A short name of `e`'s kind, for counting fallbacks by cause.
fn cause(e: &LoadError) -> &'static str {
    match e {
        LoadError::Missing { .. } => cause_missing(),
        LoadError::Rejected { .. } => "entry rejected at open",
        LoadError::Io { .. } => "read error",
        LoadError::Short { .. } => "short read",
        LoadError::Hash { .. } => "hash mismatch",
        LoadError::SlotTooSmall { .. } => "slot too small",
        LoadError::Changed { .. } => "image changed under the run",
        LoadError::Other(_) => "other",
    }
}

impl<P, F> Drop for FallbackLoader<P, F> {
    fn drop(&mut self) {
        if self.causes.is_empty() {
            return;
        }
        let by_cause: Vec<String> = self.causes.iter().map(|(c, n)| format!("{n} {c}")).collect();
        let total: u64 = self.causes.values().sum();
        let msg = format!(
            "{total} expert loads ({} distinct experts) were served by the fallback: {}",
            self.logged.len(),
            by_cause.join(", ")
        );
        // Only a prefix store's by-design misses: not a warning.
        if self.causes.keys().all(|c| *c == cause_missing()) {
            tracing::info!("{msg}");
        } else {
            tracing::warn!("{msg}");
        }
    }
}

impl<P: ExpertLoader, F: ExpertLoader> ExpertLoader for FallbackLoader<P, F> {
    fn describe(&self) -> String {
        format!("{} (fallback: {})", self.primary.describe(), self.fallback.describe())
    }

    fn load(&mut self, layer: u32, requests: Vec<(u32, AlignedBuf)>, ready: &mut dyn FnMut(Loaded)) {
        let mut retry = Vec::new();
        let (logged, causes) = (&mut self.logged, &mut self.causes);
        self.primary.load(layer, requests, &mut |l: Loaded| match l.result {
            Ok(()) => ready(l),
            Err(e) => {
                let missing = matches!(e, LoadError::Missing { .. });
                let first_of_cause = !causes.contains_key(cause(&e));
                *causes.entry(cause(&e)).or_default() += 1;
                // Once per expert, not per request; a prefix store misses whole layers by design:
                // one line for the store.
                // An image found changed said so once (FlatStore logs it); no line per expert.
                let changed = matches!(e, LoadError::Changed { .. });
                if logged.insert(l.key) && !changed {
                    if !missing {
                        tracing::warn!(
                            "{}; serving {} from the fallback (logged once per expert)",
                            crate::error::chain(&e),
                            l.key
                        );
                    } else if first_of_cause {
                        tracing::info!(
                            "{}: a prefix store; experts it has no entry for come from the fallback",
                            crate::error::chain(&e)
                        );
                    }
                }
                retry.push((l.key.expert, l.buf));
            }
        });
        if !retry.is_empty() {
            let stats = &self.stats;
            self.fallback.load(layer, retry, &mut |l: Loaded| {
                stats.record_fallback();
                ready(l)
            });
        }
    }

    /// The primary's: the fallback copies into whatever slot it is given.
    fn slot_allocator(&mut self, count: usize, len: usize) -> Option<Box<dyn SlotAllocator>> {
        self.primary.slot_allocator(count, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dimension_mismatches_name_every_differing_field_and_what_moe_inter_is() {
        let dims = StoreDims { hidden: 64, n_layers: 3, n_experts: 16, topk: 4, moe_inter: 256 };
        let sb = Superblock::layout(StoreDims { topk: 2, moe_inter: 128, ..dims }, 48, [0; 32], None);
        assert!(StoreDims { topk: 2, moe_inter: 128, ..dims }.mismatches(&sb, "img").is_empty());
        let m: Vec<String> = dims.mismatches(&sb, "img").iter().map(ToString::to_string).collect();
        assert_eq!(m.len(), 2, "{m:?}");
        assert!(m[0].starts_with("img: ") && m[0].contains("topk is 2 in the store, 4 in the model"), "{m:?}");
        assert!(m[1].contains("moe_inter (2 × moe_intermediate_size) is 128 in the store, 256 in the model"), "{m:?}");
    }

    use crate::format::{FlatWriter, ImageSink};
    use std::sync::Mutex;

    /// An image written into memory.
    #[derive(Default)]
    struct MemSink {
        bytes: Vec<u8>,
    }

    impl ImageSink for MemSink {
        fn dest(&self) -> &std::path::Path {
            std::path::Path::new("mem")
        }
        fn write_at(&mut self, offset: u64, bytes: &[u8]) -> std::io::Result<()> {
            let end = offset as usize + bytes.len();
            if self.bytes.len() < end {
                self.bytes.resize(end, 0);
            }
            self.bytes[offset as usize..end].copy_from_slice(bytes);
            Ok(())
        }
        fn barrier(&mut self) -> std::io::Result<()> {
            Ok(())
        }
        fn commit(&mut self, _len: u64) -> Result<()> {
            Ok(())
        }
    }

    /// A queue over `bytes` that records the offsets it was asked for in `asked` and, when dropped,
    /// writes `queue` to `dropped`.
    fn mem(bytes: Vec<u8>, asked: Arc<Mutex<Vec<u64>>>, dropped: Arc<Mutex<Vec<&'static str>>>) -> impl IoQueue {
        let on_drop = Dropped("queue", dropped);
        crate::InstantQueue::new(512, "mem", move |req| {
            let _ = &on_drop;
            asked.lock().unwrap().push(req.offset.0);
            crate::io::read_from_memory(&bytes, req)
        })
    }

    /// Writes its name to its list when dropped.
    struct Dropped(&'static str, Arc<Mutex<Vec<&'static str>>>);

    impl Drop for Dropped {
        fn drop(&mut self) {
            self.1.lock().unwrap().push(self.0);
        }
    }

    /// An image that starts past byte 0 of its target (`raw:/dev/X@BYTES`) is read at
    /// `base_offset + offset` — superblock, index, payloads and the superblock recheck — and the
    /// guard outlives the queue.
    #[test]
    fn a_bundle_opens_only_for_its_gguf_and_checks_each_layers_entry_length() {
        use crate::format::{GgufSource, LayerDesc, SlabDesc};
        let dims = StoreDims { hidden: 64, n_layers: 2, n_experts: 2, topk: 1, moe_inter: 128 };
        let s = |stored, bytes| SlabDesc { ty: stored, stored, bytes };
        let layers = vec![
            LayerDesc { slabs: Some([s(8, 100), s(8, 100), s(8, 100)]) },
            LayerDesc { slabs: Some([s(8, 100), s(8, 100), s(2, 50)]) },
        ];
        let mut sink = MemSink::default();
        let mut w = FlatWriter::with_sink(&mut sink, dims, 4).unwrap();
        w.set_bundle(GgufSource { path: "/m/a.gguf".into(), fingerprint: [1; 32] }, &layers).unwrap();
        // Entry 1 has layer 1's length in layer 0: rejected alone.
        for len in [300, 250, 250, 250] {
            w.push(&vec![9u8; len]).unwrap();
        }
        w.finish().unwrap();
        let bytes = sink.bytes;
        let open = |want: &BundleExpect, expect: bool| {
            let q = mem(bytes.clone(), Arc::default(), Arc::default());
            let opts = FlatStoreOptions {
                image_len: bytes.len() as u64,
                expect: expect.then_some(StoreExpect { dims, payload_len: 300 }),
                ..Default::default()
            };
            FlatStore::open_bundle(q, "b", opts, want)
        };
        let want = BundleExpect { fingerprint: [1; 32], layers: layers.clone() };
        let store = open(&want, true).unwrap();
        let key = |layer, expert| ExpertKey { layer, expert };
        assert!(store.entry(key(0, 0)).is_ok() && store.entry(key(1, 0)).is_ok() && store.entry(key(1, 1)).is_ok());
        let e = store.entry(key(0, 1)).unwrap_err().to_string();
        assert!(e.contains("len 250 differs from the model's expert payload of 300 bytes"), "{e}");
        // Another GGUF (fingerprint), other slabs in a layer: the whole store is refused, naming it.
        let e = open(&BundleExpect { fingerprint: [2; 32], ..want.clone() }, true).unwrap_err();
        assert!(matches!(e, Error::NotThisBundle { .. }) && e.to_string().contains("/m/a.gguf"), "{e}");
        let mut other = layers.clone();
        other[1].slabs.as_mut().unwrap()[2] = s(6, 210);
        let e = open(&BundleExpect { layers: other, ..want.clone() }, true).unwrap_err().to_string();
        assert!(e.contains("not the expert bundle of this model: layer 1:"), "{e}");
        // A bundle given to a model that is not a GGUF (plain open with expectations) is refused.
        let q = mem(bytes.clone(), Arc::default(), Arc::default());
        let opts = FlatStoreOptions {
            image_len: bytes.len() as u64,
            expect: Some(StoreExpect { dims, payload_len: 300 }),
            ..Default::default()
        };
        let e = FlatStore::open(q, "b", opts).unwrap_err().to_string();
        assert!(e.contains("expert bundle (version 3) of the GGUF /m/a.gguf"), "{e}");
        // A damaged layer table is named with its offset.
        let mut damaged = bytes.clone();
        damaged[8192 + 8] ^= 1;
        let q = mem(damaged, Arc::default(), Arc::default());
        let opts = FlatStoreOptions { image_len: bytes.len() as u64, ..Default::default() };
        let e = FlatStore::open_bundle(q, "b", opts, &want).unwrap_err().to_string();
        assert!(e.contains("layer table at 0x2000") && e.contains("SHA-256"), "{e}");
    }

    #[test]
    fn base_offset_is_added_to_every_read_and_the_guard_drops_after_the_queue() {
        let dims = StoreDims { hidden: 64, n_layers: 1, n_experts: 2, topk: 1, moe_inter: 128 };
        let payloads: [Vec<u8>; 2] = [(0..5000u32).map(|i| (i % 251) as u8).collect(), vec![7u8; 4096]];
        let mut sink = MemSink::default();
        let mut w = FlatWriter::with_sink(&mut sink, dims, 2).unwrap();
        let locs: Vec<ExpertLoc> = payloads.iter().map(|p| w.push(p).unwrap()).collect();
        w.finish().unwrap();
        let base = 3 * 4096u64;
        let mut target = vec![0xEE; base as usize];
        target.extend_from_slice(&sink.bytes);
        let (asked, dropped) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
        let q = mem(target, asked.clone(), dropped.clone());
        let opts = FlatStoreOptions {
            base_offset: base,
            image_len: sink.bytes.len() as u64,
            verify: true,
            recheck_every: 1,
            ..Default::default()
        };
        let mut store =
            FlatStore::open(q, "raw:mem@12288", opts).unwrap().with_guard(Dropped("guard", dropped.clone()));
        let sb = store.superblock().clone();
        assert_eq!(*asked.lock().unwrap(), [base, base + sb.index_offset], "superblock and index at base + offset");
        let mut got = Vec::new();
        let bufs = (0..2).map(|e| (e, AlignedBuf::new(8192, 4096).unwrap())).collect();
        store.load(0, bufs, &mut |l| got.push(l));
        got.sort_by_key(|l| l.key.expert);
        for (l, p) in got.iter().zip(&payloads) {
            assert!(l.result.is_ok(), "{:?}", l.result);
            assert!(l.buf.as_slice()[..p.len()] == p[..], "expert {} read from base + its offset", l.key);
        }
        let asked = asked.lock().unwrap()[2..].to_vec();
        let want_payloads = [base + locs[0].offset, base + locs[1].offset];
        assert!(asked.len() == 3 && want_payloads.iter().all(|o| asked.contains(o)), "{asked:?}");
        assert!(asked.contains(&base), "the recheck reads the superblock at the base: {asked:?}");
        assert!(store.changed().is_none());
        drop(store);
        assert_eq!(*dropped.lock().unwrap(), ["queue", "guard"]);
    }
}
