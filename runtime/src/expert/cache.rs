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

use picchio_core::{AlignedBuf, ExpertKey, ExpertLoader, Loaded, SlotAllocator, BLOCK_SIZE};

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
            return Err(Error::BadOption { option: "ecap", value: "0".into(), expected });
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

    /// Zeroes the hit and miss counters (the resident experts stay).
    pub fn reset_counters(&mut self) {
        self.hits = 0;
        self.misses = 0;
    }

    /// Makes every slot free (the allocations are kept); the counters are unchanged.
    pub fn clear(&mut self) {
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
        for (i, e) in experts.iter().enumerate() {
            if experts[..i].contains(e) {
                return Err(Error::Invalid(format!(
                    "expert cache: layer {layer} requests expert {e} twice in one fetch ({experts:?})"
                )));
            }
        }
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
                        if let Err(e) = compute(lent[j].index, &buf.as_slice()[..plen]) {
                            first_err.get_or_insert(e);
                        }
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

    fn fetch(c: &mut ExpertCache, l: &mut FakeLoader, layer: u32, experts: &[u32]) -> Result<Vec<usize>> {
        let mut seen = Vec::new();
        c.fetch(layer, experts, l, &mut |i, p| {
            check_payload(layer, experts, i, p);
            seen.push(i);
            Ok(())
        })?;
        Ok(seen)
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

    #[test]
    fn contract_violations_are_errors() {
        assert!(ExpertCache::new(0, 5000).unwrap_err().to_string().contains("option `ecap` = 0"));
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
