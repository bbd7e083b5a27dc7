//! The expert cache: an LRU over fixed-size, block-aligned slots ([`AlignedBuf`]) that hold routed
//! expert payloads (DESIGN.md, "The I/O stack", step 4).
//!
//! - Capacity is counted in experts (`--ecap N`, N >= 1). Slots are allocated lazily, the first time
//!   a miss needs one and fewer than `N` exist, and are reused for ever after.
//! - Each slot is [`ExpertLayout::len`](crate::expert::layout::ExpertLayout::len) rounded up to the block size
//!   (4096 B), so the same slot is a valid O_DIRECT / io_uring / NVMe DMA target.
//! - Slots come from the heap ([`AlignedBuf::new`]) unless [`ExpertCache::use_slots_from`] found a
//!   loader whose engine lends memory it reads into without a copy
//!   ([`ExpertLoader::slot_allocator`]): the user-space NVMe driver's hugepage DMA pool, so an expert
//!   goes from the flash into its slot with no copy. Should that memory run out, the slot is
//!   allocated on the heap instead (logged once) and the engine copies into it.
//! - The only way an expert gets in is an [`ExpertLoader`]: the cache moves the slot into
//!   [`ExpertLoader::load`] and the slot is out of the cache until the loader hands it back through
//!   `ready`. A hit is computed straight from its resident slot.
//! - A layer's experts are fetched in batches of at most `capacity`, so a cache smaller than top-k
//!   still serves every expert (hits first, then the misses batch by batch).
//!
//! # Async MoE (`--async-moe`, the default; `--no-async-moe`)
//! On: each missed expert is computed inside the loader's `ready`, as soon as its read completes and
//! while the batch's other reads are still in flight, so the order of the computations is the
//! completion order. Off ([`ExpertCache::set_async_moe`]): the whole batch is loaded first, then its
//! experts are computed in the order they were requested (canonical router order). Either way each
//! result lands in a place chosen by its index and the model sums them in canonical order, so the
//! output is bit-identical (tests/tests/async_moe.rs).
//!
//! # Slot lifetime: a slot being read into or computed from is never evicted
//! A slot is in exactly one state: *free* (in `free`), *lent* (its buffer moved into the loader:
//! `buf` is `None`, and it is neither in `map` nor in the LRU list), or *resident* (in `map` and the
//! LRU list, `buf` present). Only `take_slot` evicts, and it picks a free slot, a new
//! one, or the LRU *resident* head, never a lent slot, which is not in the list. `take_slot` runs
//! only at the start of a batch, before [`ExpertLoader::load`] is called, and never while `compute`
//! runs: hits are computed before the first batch takes slots; with async MoE a miss is computed
//! inside `ready` (no slot is taken during `load`); without, the batch's experts are computed after
//! `load` returns and before the next batch takes slots. So a slot the kernel or device is writing
//! (lent) or one `compute` reads (borrowed from `slots` for the call) cannot be handed out again.
//! - A failed load is a hard error of the forward pass: the store in front is expected to wrap a
//!   fallback ([`picchio_core::FallbackLoader`]).

use std::collections::HashMap;
use std::time::Instant;

use picchio_core::{AlignedBuf, ExpertKey, ExpertLoader, Loaded, SlotAllocator, BLOCK_SIZE};

use super::io_worker::{IoMsg, IoWorker};
use crate::error::{Error, Result};

/// End of the LRU list.
const NIL: usize = usize::MAX;

/// One slot: its buffer (absent while lent to a loader), the expert it holds, and its LRU links.
struct Slot {
    /// The bytes; `None` while the slot is inside [`ExpertLoader::load`].
    buf: Option<AlignedBuf>,
    /// The expert whose payload the slot holds (`None`: free).
    key: Option<ExpertKey>,
    /// Towards the least recently used end.
    prev: usize,
    /// Towards the most recently used end.
    next: usize,
}

/// One miss of the batch being loaded: where it is in the caller's list and which slot it got.
#[derive(Clone, Copy)]
struct Lent {
    /// Index in the `experts` slice passed to [`ExpertCache::fetch`].
    index: usize,
    /// Expert id.
    expert: u32,
    /// Slot index.
    slot: usize,
    /// Whether the loader has handed the slot back.
    returned: bool,
    /// Whether it came back holding the payload (and is now resident).
    loaded: bool,
}

/// A slot lent to an [`IoWorker`] job and not back yet (overlapped fetches only).
#[derive(Clone, Copy, Debug)]
struct InFlight {
    /// Slot index.
    slot: usize,
    /// The worker job that reads it.
    job: u64,
    /// Whether the read is a speculative prefetch.
    prefetch: bool,
}

/// A slot back from the I/O worker ([`ExpertCache::arrive`]).
struct Arrival {
    /// The expert.
    key: ExpertKey,
    /// Its slot, now resident, or why it holds no payload (the slot is then free).
    result: Result<usize>,
    /// Whether it was read by a speculative prefetch.
    prefetch: bool,
}

/// Speculative-prefetch figures ([`ExpertCache::prefetch_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PrefetchStats {
    /// Experts read speculatively, before their layer routed (each one read).
    pub issued: u64,
    /// Of those, experts their layer then picked.
    pub used: u64,
    /// Of those, experts their layer did not pick, or whose read failed or was lost (read for
    /// nothing; a failed one is read again if its layer picks it).
    pub wasted: u64,
}

/// LRU cache of routed-expert payloads in block-aligned slots; see the module documentation.
pub struct ExpertCache {
    payload_len: usize,
    slot_len: usize,
    capacity: usize,
    slots: Vec<Slot>,
    map: HashMap<ExpertKey, usize>,
    /// Least recently used resident slot.
    head: usize,
    /// Most recently used resident slot.
    tail: usize,
    /// Allocated slots that hold no expert.
    free: Vec<usize>,
    hits: u64,
    misses: u64,
    /// Scratch reused by every fetch: the misses of the current call, then the batch being loaded.
    missed: Vec<(usize, u32)>,
    lent: Vec<Lent>,
    /// Compute each miss as its read completes (`true`) or after the whole batch (`false`).
    async_moe: bool,
    /// Where slots come from when not the heap (see [`ExpertCache::use_slots_from`]).
    slot_alloc: Option<Box<dyn SlotAllocator>>,
    /// Slots (including replacements) the allocator provided.
    from_alloc: usize,
    /// The allocator failed once (warned; later slots silently go to the heap).
    alloc_failed: bool,
    /// Slots lent to an [`IoWorker`] (overlapped fetches), by the expert being read into them.
    in_flight: HashMap<ExpertKey, InFlight>,
    /// Experts read speculatively whose layer has not routed since (see [`PrefetchStats`]).
    speculative: Vec<ExpertKey>,
    prefetch: PrefetchStats,
    /// Nanoseconds fetches spent waiting for reads with nothing else to compute.
    io_wait_ns: u64,
}

impl ExpertCache {
    /// A cache of `capacity` experts (`--ecap`) whose payloads are `payload_len` bytes
    /// ([`ExpertLayout::len`](crate::expert::layout::ExpertLayout::len)); each slot is `payload_len` rounded
    /// up to [`BLOCK_SIZE`] (4096 B). No slot is allocated until a miss needs it.
    ///
    /// # Errors
    /// [`Error::BadOption`] (`ecap`) when `capacity` is 0; [`Error::Invalid`] when `payload_len` is 0.
    pub fn new(capacity: usize, payload_len: usize) -> Result<Self> {
        if capacity == 0 {
            let expected = "the expert cache needs room for at least 1 expert".into();
            return Err(Error::BadOption { option: "--ecap", value: "0".into(), expected });
        }
        if payload_len == 0 {
            return Err(Error::Invalid("expert cache: the expert payload length is 0".into()));
        }
        let bs = BLOCK_SIZE as usize;
        Ok(ExpertCache {
            payload_len,
            slot_len: payload_len.div_ceil(bs) * bs,
            capacity,
            slots: Vec::new(),
            map: HashMap::with_capacity(capacity),
            head: NIL,
            tail: NIL,
            free: Vec::new(),
            hits: 0,
            misses: 0,
            missed: Vec::new(),
            lent: Vec::new(),
            async_moe: true,
            slot_alloc: None,
            from_alloc: 0,
            alloc_failed: false,
            in_flight: HashMap::new(),
            speculative: Vec::new(),
            prefetch: PrefetchStats::default(),
            io_wait_ns: 0,
        })
    }

    /// Takes this cache's slots from memory `loader`'s engine reads into without a copy, when it
    /// has some ([`ExpertLoader::slot_allocator`], asked for [`ExpertCache::capacity`] slots of
    /// [`ExpertCache::slot_len`] bytes): the NVMe driver's hugepage DMA pool. Every other loader
    /// answers `None` and the slots stay on the heap, exactly as without this call. Call it before
    /// the first [`ExpertCache::fetch`] (slots allocated earlier stay where they are). Returns the
    /// allocator's description when there is one.
    pub fn use_slots_from(&mut self, loader: &mut dyn ExpertLoader) -> Option<String> {
        let alloc = loader.slot_allocator(self.capacity, self.slot_len)?;
        let what = alloc.describe();
        tracing::info!("expert cache: {} slots of {} B from {what}", self.capacity, self.slot_len);
        self.slot_alloc = Some(alloc);
        self.alloc_failed = false;
        Some(what)
    }

    /// Slots (including replacements of lost ones) that came from the loader's allocator rather than
    /// the heap (see [`ExpertCache::use_slots_from`]).
    pub fn slots_from_allocator(&self) -> usize {
        self.from_alloc
    }

    /// A buffer for a new (or replacement) slot: from the allocator when there is one and it has
    /// room, else from the heap.
    fn new_slot_buf(&mut self) -> Result<AlignedBuf> {
        if let Some(a) = self.slot_alloc.as_mut().filter(|_| !self.alloc_failed) {
            match a.alloc(self.slot_len) {
                Ok(b) if b.len() >= self.slot_len => {
                    self.from_alloc += 1;
                    return Ok(b);
                }
                Ok(b) => {
                    tracing::warn!(
                        "expert cache: {} gave a {}-byte slot for {} B; using heap slots from now on",
                        a.describe(),
                        b.len(),
                        self.slot_len
                    );
                    self.alloc_failed = true;
                }
                Err(e) => {
                    let why = picchio_core::error::chain(&e);
                    tracing::warn!("expert cache: {why}; using heap slots from now on (reads into them are copied)");
                    self.alloc_failed = true;
                }
            }
        }
        Ok(AlignedBuf::new(self.slot_len, BLOCK_SIZE as usize)?)
    }

    /// Async MoE on (the default: compute each miss as its read completes) or off (load the whole
    /// batch, then compute its experts in request order); see the module documentation.
    pub fn set_async_moe(&mut self, on: bool) {
        self.async_moe = on;
    }

    /// Whether misses are computed as their reads complete.
    pub fn async_moe(&self) -> bool {
        self.async_moe
    }

    /// Capacity in experts.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes of one slot (the payload rounded up to 4096 B).
    pub fn slot_len(&self) -> usize {
        self.slot_len
    }

    /// Exact payload bytes of one expert.
    pub fn payload_len(&self) -> usize {
        self.payload_len
    }

    /// Slots allocated so far (at most [`ExpertCache::capacity`]).
    pub fn allocated(&self) -> usize {
        self.slots.len()
    }

    /// Experts resident now.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no expert is resident.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether `key` is resident.
    pub fn contains(&self, key: ExpertKey) -> bool {
        self.map.contains_key(&key)
    }

    /// Expert uses served from a resident slot, since creation or [`ExpertCache::reset_counters`].
    pub fn hits(&self) -> u64 {
        self.hits
    }

    /// Expert uses that needed a load (each counts once, even if the load failed).
    pub fn misses(&self) -> u64 {
        self.misses
    }

    /// Zeroes the hit, miss, prefetch and wait counters (the resident experts stay).
    pub fn reset_counters(&mut self) {
        self.hits = 0;
        self.misses = 0;
        self.prefetch = PrefetchStats::default();
        self.io_wait_ns = 0;
    }

    /// Speculative prefetch figures since creation or [`ExpertCache::reset_counters`]. An expert
    /// counts as used or wasted when its layer next routes (or at [`ExpertCache::settle`] when it
    /// never does, as wasted).
    pub fn prefetch_stats(&self) -> PrefetchStats {
        self.prefetch
    }

    /// Exposed I/O wait, nanoseconds: the time fetches spent blocked on reads (in the loader's
    /// submit and reap, or on the I/O worker) with nothing to compute, since creation or
    /// [`ExpertCache::reset_counters`]. Time computing experts while reads are in flight is not
    /// counted.
    pub fn io_wait_ns(&self) -> u64 {
        self.io_wait_ns
    }

    /// Makes every slot free (the allocations are kept); the counters are unchanged.
    ///
    /// # Panics
    /// When slots are lent to an I/O worker (call [`ExpertCache::settle`] first).
    pub fn clear(&mut self) {
        assert!(self.in_flight.is_empty(), "expert cache: clear with reads in flight");
        self.speculative.clear();
        self.map.clear();
        self.free.clear();
        for (i, s) in self.slots.iter_mut().enumerate() {
            s.key = None;
            s.prev = NIL;
            s.next = NIL;
            self.free.push(i);
        }
        self.head = NIL;
        self.tail = NIL;
    }

    /// Calls `compute(i, payload)` once for every `experts[i]` of `layer`, with the expert's payload
    /// bytes (exactly [`ExpertCache::payload_len`] bytes, starting 4096-aligned).
    ///
    /// Resident experts are computed first (each a hit, moved to most recently used); the others are
    /// misses, loaded through `loader` in batches of at most [`ExpertCache::capacity`], each computed
    /// inside the loader's `ready` as soon as its bytes are in place (async MoE), or after its whole
    /// batch is loaded, in request order ([`ExpertCache::set_async_moe`]`(false)`). **The order of
    /// the calls is unspecified**: write each result to a place chosen by `i` and combine them
    /// afterwards in a fixed order. Slots for a batch come from free slots, then new allocations up to the capacity,
    /// then the least recently used resident experts.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the expert when `experts` repeats an id, when the loader fails to
    /// deliver an expert (its [`picchio_core::LoadError`]), returns a slot shorter than the payload, an
    /// expert it was not asked for, or does not return a slot; [`Error::Store`] when a slot cannot be
    /// allocated; the first error `compute` returns. A batch is always completed (every slot handed
    /// back is kept) before the first error is returned; experts that failed are not cached.
    pub fn fetch(
        &mut self,
        layer: u32,
        experts: &[u32],
        loader: &mut dyn ExpertLoader,
        compute: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        check_distinct(layer, experts)?;
        let plen = self.payload_len;
        // 1. Hits: compute straight from the resident slots.
        let mut missed = std::mem::take(&mut self.missed);
        missed.clear();
        let mut first_err: Option<Error> = None;
        for (i, &expert) in experts.iter().enumerate() {
            let key = ExpertKey { layer, expert };
            match self.map.get(&key) {
                Some(&s) => {
                    self.hits += 1;
                    self.touch(s);
                    let buf = self.slots[s].buf.as_ref().expect("a resident slot holds its buffer");
                    if let Err(e) = compute(i, &buf.as_slice()[..plen]) {
                        first_err.get_or_insert(e);
                    }
                }
                None => missed.push((i, expert)),
            }
        }
        // 2. Misses, at most `capacity` slots in flight at a time.
        let mut lent = std::mem::take(&mut self.lent);
        let mut result = Ok(());
        for batch in missed.chunks(self.capacity) {
            if first_err.is_some() {
                break;
            }
            if let Err(e) = self.load_batch(layer, batch, loader, compute, &mut lent, &mut first_err) {
                result = Err(e);
                break;
            }
        }
        self.missed = missed;
        self.lent = lent;
        result?;
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Loads one batch (`batch.len() <= capacity`) of `(index, expert)` misses and computes each as it
    /// arrives; per-expert failures go to `first_err`, a failure to get slots is returned.
    fn load_batch(
        &mut self,
        layer: u32,
        batch: &[(usize, u32)],
        loader: &mut dyn ExpertLoader,
        compute: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
        lent: &mut Vec<Lent>,
        first_err: &mut Option<Error>,
    ) -> Result<()> {
        lent.clear();
        // The trait takes the requests by value: this Vec is the one allocation per batch.
        let mut requests = Vec::with_capacity(batch.len());
        for &(index, expert) in batch {
            let slot = self.take_slot()?;
            let buf = self.slots[slot].buf.take().expect("a slot not in flight holds its buffer");
            lent.push(Lent { index, expert, slot, returned: false, loaded: false });
            requests.push((expert, buf));
        }
        self.misses += batch.len() as u64;
        let (plen, slot_len, async_moe) = (self.payload_len, self.slot_len, self.async_moe);
        // Contract violations by the loader, described once the loader can be asked its name.
        let mut violation: Option<String> = None;
        // Exposed wait = the load call's time less the experts computed inside it.
        let (t_load, mut computing) = (Instant::now(), std::time::Duration::ZERO);
        loader.load(layer, requests, &mut |l: Loaded| {
            let Loaded { key, buf, result } = l;
            let Some(j) = lent.iter().position(|x| !x.returned && x.expert == key.expert && key.layer == layer) else {
                violation.get_or_insert_with(|| {
                    let asked: Vec<u32> = batch.iter().map(|b| b.1).collect();
                    format!("delivered {key}, which was not requested (layer {layer}, experts {asked:?})")
                });
                return; // not one of our slots: dropped
            };
            lent[j].returned = true;
            let slot = lent[j].slot;
            match result {
                Ok(()) if buf.len() >= slot_len => {
                    if async_moe {
                        let t = Instant::now();
                        if let Err(e) = compute(lent[j].index, &buf.as_slice()[..plen]) {
                            first_err.get_or_insert(e);
                        }
                        computing += t.elapsed();
                    }
                    lent[j].loaded = true;
                    self.slots[slot].buf = Some(buf);
                    self.slots[slot].key = Some(key);
                    self.map.insert(key, slot);
                    self.push_mru(slot);
                }
                Ok(()) => {
                    violation.get_or_insert_with(|| {
                        format!("returned a slot of {} bytes for {key}; the cache lent {slot_len}", buf.len())
                    });
                    self.slots[slot].buf = Some(buf); // replaced below
                    self.free.push(slot);
                }
                Err(e) => {
                    first_err.get_or_insert(Error::ExpertLoad { key, cause: e });
                    self.slots[slot].buf = Some(buf);
                    self.free.push(slot);
                }
            }
        });
        self.io_wait_ns += t_load.elapsed().saturating_sub(computing).as_nanos() as u64;
        // Slots the loader kept, or handed back too short, are replaced by fresh ones.
        for x in lent.iter() {
            let short = self.slots[x.slot].buf.as_ref().is_some_and(|b| b.len() < slot_len);
            if !x.returned {
                let key = ExpertKey { layer, expert: x.expert };
                violation.get_or_insert_with(|| format!("did not return the slot of {key}"));
                self.free.push(x.slot);
            }
            if !x.returned || short {
                self.slots[x.slot].buf = Some(self.new_slot_buf()?);
            }
        }
        if let Some(v) = violation {
            first_err.get_or_insert(Error::Invalid(format!("{}: {v} (ExpertLoader contract)", loader.describe())));
        }
        if !async_moe {
            // The whole batch is in (and resident); `lent` is in request order. No slot is taken
            // until this loop ends (see "Slot lifetime").
            for x in lent.iter().filter(|x| x.loaded) {
                let buf = self.slots[x.slot].buf.as_ref().expect("a loaded slot holds its buffer");
                if let Err(e) = compute(x.index, &buf.as_slice()[..plen]) {
                    first_err.get_or_insert(e);
                }
            }
        }
        Ok(())
    }

    /// As [`ExpertCache::fetch`], with the misses read by `io`'s thread while this one computes:
    /// the misses are submitted first (one worker job), then, when `prefetch` = `(next_layer,
    /// predicted experts)` is given, a speculative job for the predicted experts of `next_layer`
    /// that are neither resident nor in flight; then the hits are computed while those reads are in
    /// flight, then each miss (and each expert an earlier prefetch is still reading) as its read
    /// completes. Whatever else completes meanwhile (a prefetch for a later layer) becomes resident.
    ///
    /// Slots for the misses and the prefetch never evict this layer's hits: when the misses need
    /// more slots than that leaves, every read in flight is settled first and the layer is fetched
    /// as [`ExpertCache::fetch`] does (hits, then misses in batches). A prefetch takes only as many
    /// slots as evict neither this layer's hits nor the predicted experts already resident (which
    /// it moves to the most recently used end), and never a slot in flight.
    ///
    /// The prefetched experts of `layer` count as used (and as hits) when `experts` picks them, else
    /// as wasted ([`ExpertCache::prefetch_stats`]). Reads may still be in flight when this returns:
    /// call [`ExpertCache::settle`] before the worker ends.
    ///
    /// # Errors
    /// As [`ExpertCache::fetch`]; [`Error::Invalid`] when the worker stops with experts of this
    /// layer outstanding. A prefetch that fails is not an error (it is not cached; the layer that
    /// needs the expert reads it again).
    pub fn fetch_overlapped(
        &mut self,
        layer: u32,
        experts: &[u32],
        io: &mut IoWorker,
        prefetch: Option<(u32, &[u32])>,
        compute: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        check_distinct(layer, experts)?;
        self.judge_speculation(layer, experts);
        // 1. Classify: resident (hit), being read by an earlier prefetch (waited for), or a miss.
        let mut hits: Vec<(usize, usize)> = Vec::with_capacity(experts.len());
        let mut missed = std::mem::take(&mut self.missed);
        missed.clear();
        let mut waiting = 0usize;
        for (i, &expert) in experts.iter().enumerate() {
            let key = ExpertKey { layer, expert };
            if let Some(&s) = self.map.get(&key) {
                hits.push((i, s));
            } else if self.in_flight.contains_key(&key) {
                waiting += 1;
            } else {
                missed.push((i, expert));
            }
        }
        if missed.len() > self.evictable(hits.len()) {
            // Too few slots to read the misses while the hits stay resident: the plain order.
            self.missed = missed;
            let settled = self.settle(io);
            let fetched = self.fetch(layer, experts, &mut WorkerLoader(io), compute);
            return settled.and(fetched);
        }
        // 2. The hits to the most recently used end: slots below are taken from other experts.
        for &(_, s) in &hits {
            self.touch(s);
        }
        self.hits += (hits.len() + waiting) as u64;
        self.misses += missed.len() as u64;
        // 3. The misses, one job.
        let requests = self.lend(layer, missed.iter().map(|m| m.1), io.next_job())?;
        io.submit(layer, requests);
        // 4. The speculative prefetch, queued behind the misses.
        if let Some((next, predicted)) = prefetch {
            let mut protected = hits.len();
            let mut want = Vec::with_capacity(predicted.len());
            for &expert in predicted {
                let key = ExpertKey { layer: next, expert };
                if let Some(&s) = self.map.get(&key) {
                    self.touch(s);
                    protected += 1;
                } else if !self.in_flight.contains_key(&key) && !want.contains(&expert) {
                    want.push(expert);
                }
            }
            want.truncate(self.evictable(protected));
            match self.lend(next, want.iter().copied(), io.next_job()) {
                Ok(requests) => {
                    for &expert in &want {
                        if let Some(f) = self.in_flight.get_mut(&ExpertKey { layer: next, expert }) {
                            f.prefetch = true;
                        }
                    }
                    self.prefetch.issued += requests.len() as u64;
                    self.speculative.extend(want.iter().map(|&expert| ExpertKey { layer: next, expert }));
                    io.submit(next, requests);
                }
                Err(e) => tracing::warn!("expert cache: prefetch of layer {next} skipped: {e}"),
            }
        }
        // 5. The hits, computed while the reads are in flight.
        let plen = self.payload_len;
        let mut first_err: Option<Error> = None;
        for &(i, s) in &hits {
            let buf = self.slots[s].buf.as_ref().expect("a resident slot holds its buffer");
            if let Err(e) = compute(i, &buf.as_slice()[..plen]) {
                first_err.get_or_insert(e);
            }
        }
        // 6. The misses and the waited-for prefetches, each as it completes.
        let mut need = missed.len() + waiting;
        self.missed = missed;
        let mut violation: Option<String> = None;
        let index_of =
            |key: ExpertKey| (key.layer == layer).then(|| experts.iter().position(|&e| e == key.expert)).flatten();
        let w0 = io.waited_ns();
        while need > 0 {
            match io.recv() {
                Some(IoMsg::Loaded(l)) => match self.arrive(l, &mut violation) {
                    Some(Arrival { key, result: Ok(s), .. }) => {
                        if let Some(i) = index_of(key) {
                            need -= 1;
                            let buf = self.slots[s].buf.as_ref().expect("a resident slot holds its buffer");
                            if let Err(e) = compute(i, &buf.as_slice()[..plen]) {
                                first_err.get_or_insert(e);
                            }
                        }
                    }
                    Some(Arrival { key, result: Err(e), prefetch: true }) if index_of(key).is_some() => {
                        // A prefetch this layer waited for failed: read it again, on demand.
                        tracing::warn!(
                            "expert cache: prefetch failed, reading again: {}",
                            picchio_core::error::chain(&e)
                        );
                        match self.lend(layer, std::iter::once(key.expert), io.next_job()) {
                            Ok(requests) => {
                                io.submit(layer, requests);
                            }
                            Err(e) => {
                                need -= 1;
                                first_err.get_or_insert(e);
                            }
                        }
                    }
                    Some(Arrival { key, result: Err(e), .. }) => {
                        if index_of(key).is_some() {
                            need -= 1;
                            first_err.get_or_insert(e);
                        } else {
                            tracing::warn!("expert cache: prefetch failed: {}", picchio_core::error::chain(&e));
                        }
                    }
                    None => {}
                },
                Some(IoMsg::JobEnd { job }) => {
                    for key in self.lost(job, &mut violation) {
                        if index_of(key).is_some() {
                            need -= 1;
                        }
                    }
                }
                None => {
                    first_err.get_or_insert(Error::Invalid(format!(
                        "expert cache: the I/O worker of {} stopped with {need} experts of layer {layer} outstanding",
                        io.describe()
                    )));
                    break;
                }
            }
        }
        self.io_wait_ns += io.waited_ns() - w0;
        if let Some(v) = violation {
            first_err.get_or_insert(Error::Invalid(format!("{}: {v} (ExpertLoader contract)", io.describe())));
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Reads `keys` into the cache through `loader` without computing anything (a warm start,
    /// `--warm-from`): at most [`ExpertCache::capacity`] of them, one fetch per layer, layers in
    /// ascending order; experts already resident are left as they are. The hit and miss counters
    /// are unchanged. Returns how many experts were read.
    ///
    /// # Errors
    /// As [`ExpertCache::fetch`].
    pub fn warm(&mut self, keys: &[ExpertKey], loader: &mut dyn ExpertLoader) -> Result<usize> {
        let (hits, misses) = (self.hits, self.misses);
        let mut keys: Vec<ExpertKey> = keys.iter().take(self.capacity).copied().collect();
        keys.sort_by_key(|k| (k.layer, k.expert));
        keys.dedup();
        let mut r = Ok(());
        for group in keys.chunk_by(|a, b| a.layer == b.layer) {
            let experts: Vec<u32> = group.iter().map(|k| k.expert).collect();
            r = self.fetch(group[0].layer, &experts, loader, &mut |_, _| Ok(()));
            if r.is_err() {
                break;
            }
        }
        let read = (self.misses - misses) as usize;
        (self.hits, self.misses) = (hits, misses);
        r.map(|()| read)
    }

    /// Receives every read still in flight on `io` (their experts become resident; slots of failed
    /// or lost reads become free) so no slot is left with the worker when it ends. Computes nothing.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the loader broke its contract (delivered an expert it was not asked
    /// for, kept a slot); failed reads are not errors here.
    pub fn settle(&mut self, io: &mut IoWorker) -> Result<()> {
        let mut violation: Option<String> = None;
        let w0 = io.waited_ns();
        while let Some(msg) = io.recv() {
            match msg {
                IoMsg::Loaded(l) => {
                    if let Some(Arrival { result: Err(e), .. }) = self.arrive(l, &mut violation) {
                        tracing::warn!("expert cache: prefetch failed: {}", picchio_core::error::chain(&e));
                    }
                }
                IoMsg::JobEnd { job } => {
                    self.lost(job, &mut violation);
                }
            }
        }
        self.io_wait_ns += io.waited_ns() - w0;
        // The worker stopped without ending some jobs (it panicked): their slots are gone.
        let gone: Vec<ExpertKey> = self.in_flight.keys().copied().collect();
        for key in gone {
            let f = self.in_flight.remove(&key).expect("listed above");
            self.replace_slot(f.slot);
            if f.prefetch {
                self.speculation_failed(key);
            }
            violation.get_or_insert_with(|| format!("the I/O worker stopped while reading {key}"));
        }
        match violation {
            Some(v) => Err(Error::Invalid(format!("{}: {v} (ExpertLoader contract)", io.describe()))),
            None => Ok(()),
        }
    }

    /// Counts every prefetched expert still waiting for its layer to route as wasted (at the end of
    /// a forward pass: no layer is left to pick it).
    pub fn end_speculation(&mut self) {
        self.prefetch.wasted += self.speculative.len() as u64;
        self.speculative.clear();
    }

    /// A prefetched expert whose read failed or was lost, before its layer routed: wasted, whatever
    /// the layer then picks (the layer reads it again as a miss).
    fn speculation_failed(&mut self, key: ExpertKey) {
        if let Some(i) = self.speculative.iter().position(|k| *k == key) {
            self.speculative.swap_remove(i);
            self.prefetch.wasted += 1;
        }
    }

    /// Used-or-wasted verdicts on the prefetched experts of `layer`, which now routed to `experts`.
    fn judge_speculation(&mut self, layer: u32, experts: &[u32]) {
        let before = self.speculative.len();
        let mut used = 0;
        self.speculative.retain(|k| {
            if k.layer != layer {
                return true;
            }
            used += u64::from(experts.contains(&k.expert));
            false
        });
        let judged = (before - self.speculative.len()) as u64;
        self.prefetch.used += used;
        self.prefetch.wasted += judged - used;
    }

    /// How many slots can be taken without evicting the `protected` most recently used residents
    /// or touching a slot in flight.
    fn evictable(&self, protected: usize) -> usize {
        self.free.len() + (self.capacity - self.slots.len()) + self.map.len().saturating_sub(protected)
    }

    /// Takes a slot for each of `experts` of `layer` and records it in flight for worker job `job`;
    /// returns the `(expert, slot buffer)` requests. On an allocation error no slot stays lent.
    fn lend(&mut self, layer: u32, experts: impl Iterator<Item = u32>, job: u64) -> Result<Vec<(u32, AlignedBuf)>> {
        let mut requests = Vec::with_capacity(experts.size_hint().0);
        for expert in experts {
            let slot = match self.take_slot() {
                Ok(s) => s,
                Err(e) => {
                    for (expert, buf) in requests {
                        let f = self.in_flight.remove(&ExpertKey { layer, expert }).expect("lent above");
                        self.slots[f.slot].buf = Some(buf);
                        self.free.push(f.slot);
                    }
                    return Err(e);
                }
            };
            let buf = self.slots[slot].buf.take().expect("a slot not in flight holds its buffer");
            self.in_flight.insert(ExpertKey { layer, expert }, InFlight { slot, job, prefetch: false });
            requests.push((expert, buf));
        }
        Ok(requests)
    }

    /// A slot back from the worker: resident (`Ok(slot)`) when it holds the payload, else free and
    /// the reason; `None` (and a `violation`) when the expert was not in flight.
    fn arrive(&mut self, l: Loaded, violation: &mut Option<String>) -> Option<Arrival> {
        let Loaded { key, buf, result } = l;
        let Some(f) = self.in_flight.remove(&key) else {
            violation.get_or_insert_with(|| format!("delivered {key}, which was not requested"));
            return None; // not one of our slots: dropped
        };
        let slot = f.slot;
        match result {
            Ok(()) if buf.len() >= self.slot_len => {
                self.slots[slot].buf = Some(buf);
                self.slots[slot].key = Some(key);
                self.map.insert(key, slot);
                self.push_mru(slot);
                Some(Arrival { key, result: Ok(slot), prefetch: f.prefetch })
            }
            Ok(()) => {
                let what =
                    format!("returned a slot of {} bytes for {key}; the cache lent {}", buf.len(), self.slot_len);
                violation.get_or_insert_with(|| what.clone());
                self.replace_slot(slot);
                if f.prefetch {
                    self.speculation_failed(key);
                }
                Some(Arrival {
                    key,
                    result: Err(Error::Invalid(format!("expert cache: {what}"))),
                    prefetch: f.prefetch,
                })
            }
            Err(cause) => {
                self.slots[slot].buf = Some(buf);
                self.free.push(slot);
                if f.prefetch {
                    self.speculation_failed(key);
                }
                Some(Arrival { key, result: Err(Error::ExpertLoad { key, cause }), prefetch: f.prefetch })
            }
        }
    }

    /// The experts of worker job `job` whose slots did not come back before its end (the loader
    /// kept them): a `violation`; their slots get fresh buffers and become free.
    fn lost(&mut self, job: u64, violation: &mut Option<String>) -> Vec<ExpertKey> {
        let keys: Vec<ExpertKey> = self.in_flight.iter().filter(|(_, f)| f.job == job).map(|(k, _)| *k).collect();
        for key in &keys {
            let f = self.in_flight.remove(key).expect("listed above");
            violation.get_or_insert_with(|| format!("did not return the slot of {key}"));
            self.replace_slot(f.slot);
            if f.prefetch {
                self.speculation_failed(*key);
            }
        }
        keys
    }

    /// Gives slot `s` (holding nothing, out of every list) a fresh buffer and makes it free; when
    /// no buffer can be had, the slot stays out of use (logged).
    fn replace_slot(&mut self, s: usize) {
        self.slots[s].key = None;
        match self.new_slot_buf() {
            Ok(b) => {
                self.slots[s].buf = Some(b);
                self.free.push(s);
            }
            Err(e) => tracing::error!("expert cache: slot {s} lost and not replaced: {e}"),
        }
    }

    /// A slot holding nothing, out of the LRU list: a free one, a new one, or the LRU victim.
    fn take_slot(&mut self) -> Result<usize> {
        if let Some(s) = self.free.pop() {
            return Ok(s);
        }
        if self.slots.len() < self.capacity {
            let buf = self.new_slot_buf()?;
            self.slots.push(Slot { buf: Some(buf), key: None, prev: NIL, next: NIL });
            return Ok(self.slots.len() - 1);
        }
        let victim = self.head;
        // Every allocated slot is free, resident or in the current batch, and a batch is at most
        // `capacity` long, so a resident victim exists whenever no slot is free.
        assert!(victim != NIL, "expert cache: no slot to evict (batch larger than the capacity)");
        self.unlink(victim);
        if let Some(key) = self.slots[victim].key.take() {
            self.map.remove(&key);
        }
        Ok(victim)
    }

    /// Moves resident slot `s` to the most recently used end.
    fn touch(&mut self, s: usize) {
        if self.tail != s {
            self.unlink(s);
            self.push_mru(s);
        }
    }

    fn unlink(&mut self, s: usize) {
        let (p, n) = (self.slots[s].prev, self.slots[s].next);
        if p == NIL {
            self.head = n;
        } else {
            self.slots[p].next = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.slots[n].prev = p;
        }
        self.slots[s].prev = NIL;
        self.slots[s].next = NIL;
    }

    fn push_mru(&mut self, s: usize) {
        self.slots[s].prev = self.tail;
        self.slots[s].next = NIL;
        if self.tail == NIL {
            self.head = s;
        } else {
            self.slots[self.tail].next = s;
        }
        self.tail = s;
    }

    /// Resident experts from least to most recently used (for tests and diagnostics).
    pub fn lru_order(&self) -> Vec<ExpertKey> {
        let mut out = Vec::with_capacity(self.map.len());
        let mut s = self.head;
        while s != NIL {
            if let Some(k) = self.slots[s].key {
                out.push(k);
            }
            s = self.slots[s].next;
        }
        out
    }
}

/// [`Error::Invalid`] when `experts` repeats an id.
fn check_distinct(layer: u32, experts: &[u32]) -> Result<()> {
    for (i, e) in experts.iter().enumerate() {
        if experts[..i].contains(e) {
            return Err(Error::Invalid(format!(
                "expert cache: layer {layer} requests expert {e} twice in one fetch ({experts:?})"
            )));
        }
    }
    Ok(())
}

/// An [`IoWorker`] with nothing in flight, seen as a (blocking) [`ExpertLoader`]: one job, its
/// slots handed to `ready` as they come back. The plain [`ExpertCache::fetch`] runs on it when an
/// overlapped fetch has too few slots.
struct WorkerLoader<'a, 'w>(&'a mut IoWorker<'w>);

impl ExpertLoader for WorkerLoader<'_, '_> {
    fn describe(&self) -> String {
        self.0.describe()
    }

    fn load(&mut self, layer: u32, requests: Vec<(u32, AlignedBuf)>, ready: &mut dyn FnMut(Loaded)) {
        debug_assert_eq!(self.0.open_jobs(), 0, "a WorkerLoader runs with nothing else in flight");
        self.0.submit(layer, requests);
        while let Some(m) = self.0.recv() {
            if let IoMsg::Loaded(l) = m {
                ready(l);
            }
        }
    }
}

impl std::fmt::Debug for ExpertCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertCache")
            .field("capacity", &self.capacity)
            .field("slot_len", &self.slot_len)
            .field("allocated", &self.slots.len())
            .field("from_allocator", &self.from_alloc)
            .field("resident", &self.map.len())
            .field("hits", &self.hits)
            .field("misses", &self.misses)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use picchio_core::LoadError;

    /// Writes `(layer, expert)` into the first 8 bytes; fails for listed experts; delivers in reverse
    /// request order (completion order differs from request order); records every batch.
    struct FakeLoader {
        fail: Vec<u32>,
        batches: Vec<Vec<u32>>,
        keep_slots: bool,
        kept: Vec<AlignedBuf>,
    }

    impl FakeLoader {
        fn new() -> Self {
            FakeLoader { fail: Vec::new(), batches: Vec::new(), keep_slots: false, kept: Vec::new() }
        }
    }

    impl ExpertLoader for FakeLoader {
        fn describe(&self) -> String {
            "fake".into()
        }
        fn load(&mut self, layer: u32, requests: Vec<(u32, AlignedBuf)>, ready: &mut dyn FnMut(Loaded)) {
            self.batches.push(requests.iter().map(|r| r.0).collect());
            for (expert, mut buf) in requests.into_iter().rev() {
                let key = ExpertKey { layer, expert };
                if self.keep_slots {
                    self.kept.push(buf);
                    continue;
                }
                assert_eq!(buf.as_mut_ptr() as usize % 4096, 0);
                let result = if self.fail.contains(&expert) {
                    Err(LoadError::Other(format!("{key}: injected failure")))
                } else {
                    buf.as_mut_slice()[..4].copy_from_slice(&layer.to_le_bytes());
                    buf.as_mut_slice()[4..8].copy_from_slice(&expert.to_le_bytes());
                    Ok(())
                };
                ready(Loaded { key, buf, result });
            }
        }
    }

    /// Hands out heap slots, at most `left` of them, and records their addresses.
    struct CountingAlloc {
        left: usize,
        given: std::sync::Arc<std::sync::Mutex<Vec<usize>>>,
    }

    impl SlotAllocator for CountingAlloc {
        fn alloc(&mut self, len: usize) -> picchio_core::Result<AlignedBuf> {
            if self.left == 0 {
                return Err(picchio_core::Error::Alloc { len, align: 4096, hugepages: true, cause: None });
            }
            self.left -= 1;
            let b = AlignedBuf::new(len, 4096)?;
            self.given.lock().unwrap().push(b.addr());
            Ok(b)
        }
        fn describe(&self) -> String {
            "counting test allocator".into()
        }
    }

    /// A [`FakeLoader`] whose engine offers `slots` slots of memory.
    struct PoolLoader(FakeLoader, usize, std::sync::Arc<std::sync::Mutex<Vec<usize>>>);

    impl ExpertLoader for PoolLoader {
        fn describe(&self) -> String {
            "fake with a slot pool".into()
        }
        fn load(&mut self, layer: u32, requests: Vec<(u32, AlignedBuf)>, ready: &mut dyn FnMut(Loaded)) {
            self.0.load(layer, requests, ready)
        }
        fn slot_allocator(&mut self, count: usize, len: usize) -> Option<Box<dyn SlotAllocator>> {
            assert_eq!((count, len), (3, 8192), "asked for capacity × slot_len");
            Some(Box::new(CountingAlloc { left: self.1, given: self.2.clone() }))
        }
    }

    #[test]
    fn slots_come_from_the_loaders_allocator_and_fall_back_to_the_heap() {
        // No allocator (every kernel engine): heap slots, as before.
        let mut c = ExpertCache::new(3, 5000).unwrap();
        let mut l = FakeLoader::new();
        assert!(c.use_slots_from(&mut l).is_none());
        fetch(&mut c, &mut l, 0, &[1, 2]).unwrap();
        assert_eq!((c.allocated(), c.slots_from_allocator()), (2, 0));
        // An allocator with room for 2 of the 3 slots: 2 from it, the third from the heap.
        let given = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut c = ExpertCache::new(3, 5000).unwrap();
        let mut l = PoolLoader(FakeLoader::new(), 2, given.clone());
        assert_eq!(c.use_slots_from(&mut l).as_deref(), Some("counting test allocator"));
        let mut seen = Vec::new();
        c.fetch(0, &[4, 5, 6], &mut l, &mut |i, p| {
            seen.push((i, p.as_ptr() as usize));
            Ok(())
        })
        .unwrap();
        assert_eq!((c.allocated(), c.slots_from_allocator()), (3, 2));
        let from_pool = seen.iter().filter(|(_, a)| given.lock().unwrap().contains(a)).count();
        assert_eq!(from_pool, 2, "two experts were computed straight from allocator slots");
    }

    fn check_payload(layer: u32, experts: &[u32], i: usize, p: &[u8]) {
        assert_eq!(p.len(), 5000);
        assert_eq!(p.as_ptr() as usize % 4096, 0);
        assert_eq!(u32::from_le_bytes(p[..4].try_into().unwrap()), layer);
        assert_eq!(u32::from_le_bytes(p[4..8].try_into().unwrap()), experts[i]);
    }

    /// One fetch of `experts` of `layer` (`run` calls the cache with the compute callback), checking
    /// each payload; returns the indices in compute order.
    fn computed(
        layer: u32,
        experts: &[u32],
        run: impl FnOnce(&mut dyn FnMut(usize, &[u8]) -> Result<()>) -> Result<()>,
    ) -> Result<Vec<usize>> {
        let mut seen = Vec::new();
        run(&mut |i, p| {
            check_payload(layer, experts, i, p);
            seen.push(i);
            Ok(())
        })?;
        Ok(seen)
    }

    fn fetch(c: &mut ExpertCache, l: &mut FakeLoader, layer: u32, experts: &[u32]) -> Result<Vec<usize>> {
        computed(layer, experts, |compute| c.fetch(layer, experts, l, compute))
    }

    #[test]
    fn lru_hits_misses_and_lazy_slots() {
        let mut c = ExpertCache::new(3, 5000).unwrap();
        assert_eq!(c.slot_len(), 8192);
        let mut l = FakeLoader::new();
        let mut seen = fetch(&mut c, &mut l, 0, &[5, 1]).unwrap();
        seen.sort();
        assert_eq!(seen, [0, 1]);
        assert_eq!((c.hits(), c.misses(), c.allocated()), (0, 2, 2));
        // 1 is a hit (computed first), 7 a miss taking the third slot
        assert_eq!(fetch(&mut c, &mut l, 0, &[7, 1]).unwrap(), [1, 0]);
        assert_eq!((c.hits(), c.misses(), c.allocated()), (1, 3, 3));
        assert_eq!(c.lru_order().iter().map(|k| k.expert).collect::<Vec<_>>(), [5, 1, 7]);
        // another layer evicts the LRU expert (0, 5)
        fetch(&mut c, &mut l, 1, &[5]).unwrap();
        assert!(!c.contains(ExpertKey { layer: 0, expert: 5 }));
        assert!(c.contains(ExpertKey { layer: 1, expert: 5 }));
        assert_eq!((c.hits(), c.misses(), c.allocated(), c.len()), (1, 4, 3, 3));
        c.reset_counters();
        c.clear();
        assert!(c.is_empty());
        fetch(&mut c, &mut l, 2, &[0, 1, 2]).unwrap();
        assert_eq!((c.hits(), c.misses(), c.allocated()), (0, 3, 3));
    }

    #[test]
    fn capacity_smaller_than_topk_loads_in_batches() {
        let mut c = ExpertCache::new(2, 5000).unwrap();
        let mut l = FakeLoader::new();
        let mut seen = fetch(&mut c, &mut l, 0, &[3, 9, 4, 2, 8]).unwrap();
        seen.sort();
        assert_eq!(seen, [0, 1, 2, 3, 4]);
        assert_eq!(l.batches, vec![vec![3, 9], vec![4, 2], vec![8]]);
        assert_eq!((c.hits(), c.misses(), c.allocated()), (0, 5, 2));
        // the last batch [8] evicted the LRU expert 2 (batches complete in reverse): 4 and 8 remain;
        // both are hits, computed before 3 and 9 are loaded in one batch
        assert_eq!(c.lru_order().iter().map(|k| k.expert).collect::<Vec<_>>(), [4, 8]);
        l.batches.clear();
        assert_eq!(fetch(&mut c, &mut l, 0, &[3, 8, 4, 9]).unwrap()[..2], [1, 2]);
        assert_eq!(l.batches, vec![vec![3, 9]]);
        assert_eq!((c.hits(), c.misses()), (2, 7));

        let mut c1 = ExpertCache::new(1, 5000).unwrap();
        let mut seen = fetch(&mut c1, &mut l, 4, &[0, 1, 2, 3]).unwrap();
        seen.sort();
        assert_eq!(seen, [0, 1, 2, 3]);
        assert_eq!((c1.allocated(), c1.len()), (1, 1));
    }

    #[test]
    fn failed_load_is_an_error_naming_the_expert_and_not_cached() {
        let mut c = ExpertCache::new(4, 5000).unwrap();
        let mut l = FakeLoader::new();
        l.fail = vec![6];
        let e = fetch(&mut c, &mut l, 2, &[1, 6, 3]).unwrap_err();
        let e = picchio_core::error::chain(&e).to_string();
        assert!(e.contains("loading expert (layer 2, expert 6)") && e.contains("injected failure"), "{e}");
        assert!(!c.contains(ExpertKey { layer: 2, expert: 6 }));
        assert!(c.contains(ExpertKey { layer: 2, expert: 1 }) && c.contains(ExpertKey { layer: 2, expert: 3 }));
        l.fail.clear();
        fetch(&mut c, &mut l, 2, &[1, 6, 3]).unwrap();
        assert_eq!((c.hits(), c.misses(), c.allocated()), (2, 4, 3));
    }

    #[test]
    fn async_off_computes_a_batch_in_request_order_after_it_is_loaded() {
        let mut c = ExpertCache::new(8, 5000).unwrap();
        assert!(c.async_moe());
        let mut l = FakeLoader::new();
        // On: the fake delivers in reverse, and each expert is computed as it is delivered.
        assert_eq!(fetch(&mut c, &mut l, 0, &[3, 9, 4]).unwrap(), [2, 1, 0]);
        c.set_async_moe(false);
        c.clear();
        assert_eq!(fetch(&mut c, &mut l, 0, &[3, 9, 4]).unwrap(), [0, 1, 2]);
        // Hits first, then the misses of each batch in request order; nothing computed twice.
        let mut c2 = ExpertCache::new(2, 5000).unwrap();
        c2.set_async_moe(false);
        fetch(&mut c2, &mut l, 1, &[5]).unwrap();
        assert_eq!(fetch(&mut c2, &mut l, 1, &[7, 5, 8, 6]).unwrap(), [1, 0, 2, 3]);
        // A failed load in a batch: the others are still computed, the error is returned.
        l.fail = vec![9];
        c.clear();
        let mut seen = Vec::new();
        let e = c.fetch(2, &[1, 9, 3], &mut l, &mut |i, _| {
            seen.push(i);
            Ok(())
        });
        assert!(e.unwrap_err().to_string().contains("expert 9"));
        assert_eq!(seen, [0, 2]);
    }

    /// `f` with an I/O worker over `l` on an I/O thread of its own.
    fn with_io_worker<R>(
        l: &mut dyn ExpertLoader,
        f: impl FnOnce(&mut crate::expert::io_worker::IoWorker<'_>) -> R,
    ) -> std::io::Result<R> {
        Ok(crate::expert::io_worker::IoThread::start()?.lend(l, f))
    }

    /// `fetch_overlapped` on an I/O worker over the fake loader; returns the indices in compute order.
    fn fetch_ov(
        c: &mut ExpertCache,
        io: &mut crate::expert::io_worker::IoWorker<'_>,
        layer: u32,
        experts: &[u32],
        prefetch: Option<(u32, &[u32])>,
    ) -> Result<Vec<usize>> {
        computed(layer, experts, |compute| c.fetch_overlapped(layer, experts, io, prefetch, compute))
    }

    #[test]
    fn overlapped_fetch_computes_hits_first_and_prefetches_the_next_layer() {
        let mut c = ExpertCache::new(6, 5000).unwrap();
        let mut l = FakeLoader::new();
        with_io_worker(&mut l, |io| {
            // Cold: three misses, one job; then a prefetch of layer 1's predicted [4, 5].
            let mut seen = fetch_ov(&mut c, io, 0, &[1, 2, 3], Some((1, &[4, 5]))).unwrap();
            seen.sort();
            assert_eq!(seen, [0, 1, 2]);
            assert_eq!((c.hits(), c.misses()), (0, 3));
            // Layer 1 picks 5 (prefetched: a hit, waited for or resident) and 6 (a miss); 4 was wasted.
            let seen = fetch_ov(&mut c, io, 1, &[6, 5], None).unwrap();
            assert_eq!(seen.len(), 2);
            assert_eq!((c.hits(), c.misses()), (1, 4));
            c.settle(io).unwrap();
            assert_eq!(c.prefetch_stats(), PrefetchStats { issued: 2, used: 1, wasted: 1 });
            // Layer 0 again: 1 and 3 are hits, computed before the miss 7 is delivered.
            let seen = fetch_ov(&mut c, io, 0, &[7, 1, 3], None).unwrap();
            assert_eq!(seen[..2], [1, 2], "hits first");
            c.settle(io).unwrap();
        })
        .unwrap();
        assert!(c.in_flight.is_empty());
        assert_eq!(c.lru_order().len(), 6);
        // The worker ran each fetch's misses as one job, the prefetch as another.
        assert_eq!(l.batches, vec![vec![1, 2, 3], vec![4, 5], vec![6], vec![7]]);
    }

    #[test]
    fn overlapped_fetch_never_evicts_its_own_hits() {
        // Capacity 3: [1, 2] resident, then [1, 2, 8, 9] needs 2 slots with only 1 evictable:
        // the plain order (hits, then misses in batches) serves it; a prefetch takes no hit's slot.
        let mut c = ExpertCache::new(3, 5000).unwrap();
        let mut l = FakeLoader::new();
        with_io_worker(&mut l, |io| {
            fetch_ov(&mut c, io, 0, &[1, 2], None).unwrap();
            let mut seen = fetch_ov(&mut c, io, 0, &[1, 2, 8, 9], Some((1, &[3, 4, 5]))).unwrap();
            seen.sort();
            assert_eq!(seen, [0, 1, 2, 3]);
            // 1 and 2 were hits, computed from their slots (check_payload read their keys there).
            assert_eq!((c.hits(), c.misses()), (2, 4));
            fetch_ov(&mut c, io, 0, &[5, 6], Some((1, &[3, 4, 5]))).unwrap();
            c.settle(io).unwrap();
            // The misses leave one resident slot that is not a hit: the prefetch takes at most that.
            assert!(c.prefetch_stats().issued <= 1, "{:?}", c.prefetch_stats());
        })
        .unwrap();
        assert_eq!(c.allocated(), 3);
        // Nothing read 1 or 2 again: no slot of a hit was taken while its layer was computed.
        assert!(l.batches[1..].iter().all(|b| !b.contains(&1) && !b.contains(&2)), "{:?}", l.batches);
        c.end_speculation();
        let p = c.prefetch_stats();
        assert_eq!(p.issued, p.used + p.wasted);
    }

    #[test]
    fn overlapped_fetch_reports_loader_failures_and_kept_slots() {
        let mut c = ExpertCache::new(4, 5000).unwrap();
        let mut l = FakeLoader::new();
        l.fail = vec![6];
        let e = with_io_worker(&mut l, |io| {
            let e = fetch_ov(&mut c, io, 2, &[1, 6], None).unwrap_err();
            c.settle(io).unwrap();
            e
        })
        .unwrap();
        assert!(picchio_core::error::chain(&e).to_string().contains("injected failure"), "{e}");
        assert!(!c.contains(ExpertKey { layer: 2, expert: 6 }));
        l.fail.clear();
        l.keep_slots = true;
        let e = with_io_worker(&mut l, |io| {
            let e = fetch_ov(&mut c, io, 3, &[1, 2], None).unwrap_err();
            c.settle(io).unwrap();
            e
        })
        .unwrap();
        assert!(e.to_string().contains("did not return the slot"), "{e}");
        l.keep_slots = false;
        with_io_worker(&mut l, |io| fetch_ov(&mut c, io, 3, &[1, 2], None)).unwrap().unwrap();
        assert_eq!(c.allocated(), 3, "the kept slots were replaced, not added to");
        assert!(c.contains(ExpertKey { layer: 3, expert: 1 }) && c.contains(ExpertKey { layer: 3, expert: 2 }));
    }

    #[test]
    fn a_failed_prefetch_counts_as_wasted_even_when_its_layer_picks_it() {
        let mut c = ExpertCache::new(6, 5000).unwrap();
        let mut l = FakeLoader::new();
        l.fail = vec![5];
        with_io_worker(&mut l, |io| {
            // Layer 0 prefetches layer 1's predicted [4, 5]; the read of 5 fails (not an error).
            fetch_ov(&mut c, io, 0, &[1], Some((1, &[4, 5]))).unwrap();
            c.settle(io).unwrap();
            assert!(!c.contains(ExpertKey { layer: 1, expert: 5 }));
            assert_eq!(c.prefetch_stats(), PrefetchStats { issued: 2, used: 0, wasted: 1 });
        })
        .unwrap();
        l.fail.clear();
        with_io_worker(&mut l, |io| {
            // Layer 1 picks 4 (prefetched: used, a hit) and 5 (its prefetch failed: a miss, read again).
            let (h, m) = (c.hits(), c.misses());
            fetch_ov(&mut c, io, 1, &[4, 5], None).unwrap();
            c.settle(io).unwrap();
            assert_eq!((c.hits() - h, c.misses() - m), (1, 1));
        })
        .unwrap();
        assert_eq!(c.prefetch_stats(), PrefetchStats { issued: 2, used: 1, wasted: 1 });
        assert_eq!(l.batches.last().unwrap(), &vec![5], "the failed prefetch is read again");
    }

    #[test]
    fn warm_reads_without_counting() {
        let mut c = ExpertCache::new(3, 5000).unwrap();
        let mut l = FakeLoader::new();
        let keys = |v: &[(u32, u32)]| v.iter().map(|&(layer, expert)| ExpertKey { layer, expert }).collect::<Vec<_>>();
        assert_eq!(c.warm(&keys(&[(1, 4), (0, 2), (1, 3), (0, 9)]), &mut l).unwrap(), 3);
        assert_eq!((c.hits(), c.misses(), c.len()), (0, 0, 3));
        assert_eq!(l.batches, vec![vec![2], vec![3, 4]], "one fetch per layer, the first `capacity` keys");
        fetch(&mut c, &mut l, 1, &[4]).unwrap();
        assert_eq!((c.hits(), c.misses()), (1, 0));
    }

    #[test]
    fn contract_violations_are_errors() {
        assert!(ExpertCache::new(0, 5000).unwrap_err().to_string().contains("--ecap 0: "));
        let mut c = ExpertCache::new(2, 5000).unwrap();
        let mut l = FakeLoader::new();
        let e = fetch(&mut c, &mut l, 0, &[1, 1]).unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");
        l.keep_slots = true;
        let e = fetch(&mut c, &mut l, 0, &[1, 2]).unwrap_err().to_string();
        assert!(e.contains("did not return the slot"), "{e}");
        // the lost slots were replaced
        l.keep_slots = false;
        fetch(&mut c, &mut l, 0, &[1, 2]).unwrap();
        assert_eq!(c.allocated(), 2);
        // a compute error is returned after the batch completes
        let e = c.fetch(1, &[4, 5], &mut l, &mut |_, _| Err(Error::Invalid("boom".into()))).unwrap_err();
        assert_eq!(e.to_string(), "boom");
        assert_eq!(c.len(), 2);
    }
}
