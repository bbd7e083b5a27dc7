//! DMA memory: buffers the device reads and writes, each with an [`Iova`] (the address the device
//! uses). A [`DmaBuf`] is never behind a Rust reference: the driver reads and writes it through
//! volatile accesses while the device may use it, and copies bytes out only after the completion.
//!
//! Two allocators implement [`DmaPool`]:
//! - [`HeapDma`] for the sim: page-aligned heap memory whose IOVA is its host address. Every region
//!   it hands out (and every buffer lent with [`DmaPool::map_external`]) is recorded in a
//!   [`DmaRegistry`], the sim's "IOMMU": the model refuses to touch memory outside it.
//! - [`HugepageDma`] for VFIO: 2 MiB hugepage chunks mapped for the device by an [`IovaMapper`]
//!   (`VFIO_IOMMU_MAP_DMA` at IOVAs the driver chooses), carved into page-aligned pieces.
//!
//! For long-lived request buffers — an expert cache's slots — [`DmaPool::alloc_region`] maps one
//! [`DmaRegion`] of many 2 MiB hugepages at once (one `VFIO_IOMMU_MAP_DMA` for the whole region, or
//! each page's physical address in no-IOMMU mode), and a [`SlotPool`] lends it out in fixed-size slots
//! as [`AlignedBuf`]s ([`picchio_core::BufPool`]) that come back when dropped. The engine recognises
//! such a buffer by its address and builds PRPs from the region's IOVAs: the device writes the slot
//! itself, no copy.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use picchio_core::{AlignedBuf, BufPool, SlotAllocator};

use crate::error::{Error, Result};
use crate::spec::{Command, Completion};

/// An I/O virtual address: what the device puts on the bus (never a host pointer in the driver's
/// eyes, even where the sim makes them equal).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Iova(pub u64);

impl Iova {
    /// This IOVA plus `bytes`.
    pub const fn add(self, bytes: u64) -> Iova {
        Iova(self.0 + bytes)
    }
}

/// Host page size the driver builds PRPs with (the smallest MPS every controller supports).
pub const PAGE: usize = 4096;

mod sealed {
    pub trait Sealed {}
}

/// Plain-old-data values that may be read or written volatile in DMA memory: fixed size, no padding,
/// every bit pattern valid. Sealed: implemented for the integer widths and the queue entries only.
pub trait DmaValue: Copy + sealed::Sealed {}
macro_rules! dma_value {
    ($($t:ty),*) => {$(impl sealed::Sealed for $t {} impl DmaValue for $t {})*};
}
// `Command` and `Completion` are `repr(C)` with const-asserted sizes equal to the sum of their fields.
dma_value!(u8, u16, u32, u64, Command, Completion);

/// Releases an IOVA range when the memory behind it goes away.
pub trait IovaSpace: Send + Sync {
    /// Removes the device mapping of `len` bytes at `iova`.
    fn release(&self, iova: Iova, len: usize);
}

enum Backing {
    Heap(Layout),
    Chunk(#[allow(dead_code)] Arc<HugeChunk>),
}

/// A DMA buffer: `len` bytes at a host address the driver never turns into a reference, and the IOVA
/// the device uses for them.
pub struct DmaBuf {
    ptr: NonNull<u8>,
    len: usize,
    iova: Iova,
    backing: Backing,
    space: Option<Arc<dyn IovaSpace>>,
}

// SAFETY: a `DmaBuf` owns its memory exclusively on the host side (like `Vec<u8>`); all accesses go
// through `&self`/`&mut self` methods doing volatile or raw copies, so moving it between threads is sound.
unsafe impl Send for DmaBuf {}
// SAFETY: `&DmaBuf` only allows volatile reads, and volatile writes through `&self` are not offered.
unsafe impl Sync for DmaBuf {}

impl DmaBuf {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Never true: buffers hold at least one page.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The device address of byte 0.
    pub fn iova(&self) -> Iova {
        self.iova
    }
    /// Raw pointer to byte `off` (for queue code that writes entries in place).
    pub fn ptr_at(&self, off: usize) -> *mut u8 {
        assert!(off <= self.len, "DMA offset {off:#x} beyond {:#x}", self.len);
        // SAFETY: within (or one past) the allocation.
        unsafe { self.ptr.as_ptr().add(off) }
    }
    fn check<T>(&self, off: usize) {
        let n = std::mem::size_of::<T>();
        assert!(
            off.is_multiple_of(std::mem::align_of::<T>()) && off + n <= self.len,
            "DMA access {off:#x}+{n} of {:#x}",
            self.len
        );
    }
    /// Volatile read of a `T` at byte `off` (aligned for `T`).
    pub fn read<T: DmaValue>(&self, off: usize) -> T {
        self.check::<T>(off);
        // SAFETY: bounds and alignment checked; `T: DmaValue` accepts any bit pattern.
        unsafe { std::ptr::read_volatile(self.ptr.as_ptr().add(off).cast::<T>()) }
    }
    /// Volatile write of a `T` at byte `off` (aligned for `T`).
    pub fn write<T: DmaValue>(&mut self, off: usize, v: T) {
        self.check::<T>(off);
        // SAFETY: bounds and alignment checked; no reference to this memory exists.
        unsafe { std::ptr::write_volatile(self.ptr.as_ptr().add(off).cast::<T>(), v) }
    }
    /// Zeroes the buffer (call only while the device does not use it).
    pub fn zero(&mut self) {
        // SAFETY: the whole allocation, exclusively ours (`&mut self`) and idle per the contract.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr(), 0, self.len) }
    }
    /// Copies `out.len()` bytes from byte `off` into `out`: an acquire fence
    /// ([`crate::queue::fence::consume`]), then one plain `memcpy`.
    ///
    /// Not volatile, on purpose: this is the bounce-buffer read path (every byte of a read into a
    /// buffer that is not a pool slot goes through it), and a byte- or word-wise volatile copy costs
    /// several times a `memcpy`. A plain copy is sound only once the device has stopped writing the
    /// range, so that is the contract; the fence orders the copy after the completion entry read
    /// that proved it.
    ///
    /// # Panics
    /// If `off + out.len()` is beyond the buffer.
    ///
    /// # Safety
    /// The device must not write bytes `off .. off + out.len()` during the call: the command that
    /// wrote them has completed and its completion was consumed ([`crate::QueuePair::poll`]), or no
    /// outstanding command targets them, or the controller is disabled (CSTS.RDY = 0). Otherwise the
    /// copy races with the device's DMA.
    pub unsafe fn copy_out(&self, off: usize, out: &mut [u8]) {
        assert!(
            off.checked_add(out.len()).is_some_and(|end| end <= self.len),
            "DMA copy {off:#x}+{} of {:#x}",
            out.len(),
            self.len
        );
        crate::queue::fence::consume();
        // SAFETY: in bounds (checked); the device does not write the range (this function's
        // contract), so no access races with this read; `out` is ordinary memory that cannot overlap
        // a DMA buffer, which is never behind a reference.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), out.as_mut_ptr(), out.len()) }
    }
    /// Copies `src` to byte `off` (call only while the device does not read that range).
    pub fn copy_in(&mut self, off: usize, src: &[u8]) {
        assert!(off + src.len() <= self.len);
        // SAFETY: in bounds; exclusive (`&mut self`).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(off), src.len()) }
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        if let Some(space) = &self.space {
            space.release(self.iova, self.len);
        }
        if let Backing::Heap(layout) = self.backing {
            // SAFETY: allocated by `alloc_zeroed` with this layout; freed once, after the IOVA release.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
        }
    }
}

impl std::fmt::Debug for DmaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaBuf").field("iova", &format_args!("{:#x}", self.iova.0)).field("len", &self.len).finish()
    }
}

/// Allocates DMA memory and lends host memory to the device.
pub trait DmaPool: Send + Sync {
    /// A zeroed, page-aligned buffer of at least `len` bytes (rounded up to [`PAGE`]).
    ///
    /// # Errors
    /// [`Error::DmaAlloc`].
    fn alloc(&self, len: usize) -> Result<DmaBuf>;
    /// The IOVA of `len` bytes of host memory at `addr` that the caller lends to the device until
    /// [`DmaPool::unmap_external`] (a cache slot being read into).
    ///
    /// # Errors
    /// [`Error::DmaMap`] if the memory cannot be reached by the device.
    fn map_external(&self, addr: *mut u8, len: usize) -> Result<Iova>;
    /// Ends a [`DmaPool::map_external`] loan.
    fn unmap_external(&self, iova: Iova, len: usize);
    /// Short name for logs.
    fn kind(&self) -> &'static str;
    /// A zeroed region of at least `len` bytes, contiguous in the process and mapped for the device
    /// once, for long-lived buffers (a [`SlotPool`]). [`HugepageDma`] rounds up to whole 2 MiB
    /// hugepages; the heap (sim) to 4 KiB pages.
    ///
    /// # Errors
    /// [`Error::DmaAlloc`] (for hugepages: too few free, `ENOMEM`); [`Error::Vfio`] from the mapping.
    fn alloc_region(&self, len: usize) -> Result<DmaRegion>;
}

/// What to undo when a [`DmaRegion`] goes away.
enum RegionRelease {
    /// Heap memory registered with the sim's registry.
    Heap(Layout, Arc<DmaRegistry>),
    /// An anonymous hugepage mapping of `len` bytes, mapped for the device at `mapped` (one range per
    /// `IovaMapper::map` call; empty in no-IOMMU mode).
    Huge { map_len: usize, mapper: Arc<dyn IovaMapper>, mapped: Vec<(Iova, usize)> },
}

/// Host memory mapped for the device once: `len` bytes, contiguous in the process, made of pages of
/// `page` bytes (2 MiB hugepages for VFIO), each with its own IOVA (contiguous under an IOMMU; each
/// hugepage's physical address without one). Accessed only through raw pointers: the bytes belong to
/// whoever holds a slot ([`SlotPool`]).
pub struct DmaRegion {
    ptr: NonNull<u8>,
    len: usize,
    page: usize,
    /// IOVA of each page.
    iovas: Vec<Iova>,
    release: RegionRelease,
}

// SAFETY: the region owns its memory (like `Vec<u8>`); it hands out raw pointers only, and those are
// dereferenced by the `AlignedBuf`s a `SlotPool` lends (each slot to one owner at a time).
unsafe impl Send for DmaRegion {}
// SAFETY: `&DmaRegion` offers no access to the bytes, only addresses and IOVAs.
unsafe impl Sync for DmaRegion {}

impl DmaRegion {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Never true.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Bytes per page (each page is contiguous for the device): 2 MiB for hugepage regions.
    pub fn page_size(&self) -> usize {
        self.page
    }
    /// Pages in the region.
    pub fn pages(&self) -> usize {
        self.iovas.len()
    }
    /// Host address of byte 0.
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }
    /// The offset in the region of `len` bytes at host address `addr`, if they lie wholly inside it.
    pub fn locate(&self, addr: usize, len: usize) -> Option<usize> {
        let off = addr.checked_sub(self.addr())?;
        (off.checked_add(len)? <= self.len).then_some(off)
    }
    /// Appends to `out` the `(IOVA, bytes)` segments the device uses for region bytes
    /// `off..off + len`: one per page crossed, merged where the IOVAs are contiguous.
    ///
    /// # Panics
    /// If the range is not inside the region.
    pub fn segments(&self, off: usize, len: usize, out: &mut Vec<(Iova, usize)>) {
        assert!(off + len <= self.len, "DMA region range {off:#x}+{len:#x} beyond {:#x}", self.len);
        let mut o = off;
        let end = off + len;
        while o < end {
            let (p, in_page) = (o / self.page, o % self.page);
            let n = (self.page - in_page).min(end - o);
            let iova = self.iovas[p].add(in_page as u64);
            match out.last_mut() {
                Some((last, l)) if last.0 + *l as u64 == iova.0 => *l += n,
                _ => out.push((iova, n)),
            }
            o += n;
        }
    }
}

impl Drop for DmaRegion {
    fn drop(&mut self) {
        match &self.release {
            RegionRelease::Heap(layout, registry) => {
                registry.remove(self.ptr.as_ptr() as u64);
                // SAFETY: allocated by `alloc_zeroed` with this layout in `HeapDma::alloc_region`;
                // freed once, after the device's access was revoked.
                unsafe { std::alloc::dealloc(self.ptr.as_ptr(), *layout) }
            }
            RegionRelease::Huge { map_len, mapper, mapped } => {
                for &(iova, len) in mapped {
                    mapper.unmap(iova, len);
                }
                // SAFETY: mapped by `mmap` with length `map_len` in `HugepageDma::alloc_region`,
                // unmapped once, after the device mapping is gone.
                unsafe { libc::munmap(self.ptr.as_ptr().cast(), *map_len) };
            }
        }
    }
}

impl std::fmt::Debug for DmaRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaRegion")
            .field("len", &self.len)
            .field("page", &self.page)
            .field("first_iova", &format_args!("{:#x}", self.iovas.first().map_or(0, |i| i.0)))
            .finish()
    }
}

/// A [`DmaRegion`] carved into `count` slots of `slot_len` bytes (a multiple of 4096), lent as
/// [`AlignedBuf`]s that return here when dropped: the expert cache's slots, read into by the device
/// with no copy. Each slot is lent to one owner at a time (a free list under a mutex; taking and
/// returning slots happens when the cache fills, never per read).
pub struct SlotPool {
    region: DmaRegion,
    slot_len: usize,
    count: usize,
    free: Mutex<FreeSlots>,
}

/// The free list of a [`SlotPool`] and, per slot, whether it is on it (to refuse a double return).
#[derive(Debug)]
struct FreeSlots {
    list: Vec<usize>,
    is_free: Vec<bool>,
}

impl SlotPool {
    /// `count` slots of `slot_len` bytes (rounded up to [`PAGE`]) in `region`.
    ///
    /// # Errors
    /// [`Error::DmaAlloc`] when the region is smaller than `count × slot_len`.
    pub fn new(region: DmaRegion, slot_len: usize, count: usize) -> Result<SlotPool> {
        let slot_len = slot_len.max(1).div_ceil(PAGE) * PAGE;
        let need = slot_len.checked_mul(count).filter(|&n| n <= region.len());
        if need.is_none() {
            return Err(Error::DmaAlloc { len: slot_len.saturating_mul(count), hugepages: false, cause: None });
        }
        let free = Mutex::new(FreeSlots { list: (0..count).rev().collect(), is_free: vec![true; count] });
        Ok(SlotPool { region, slot_len, count, free })
    }
    /// The region.
    pub fn region(&self) -> &DmaRegion {
        &self.region
    }
    /// Bytes per slot.
    pub fn slot_len(&self) -> usize {
        self.slot_len
    }
    /// Slots in the pool.
    pub fn count(&self) -> usize {
        self.count
    }
    /// Slots not lent out.
    pub fn free_slots(&self) -> usize {
        self.free.lock().expect("slot pool").list.len()
    }
    /// Lends a zeroed slot, or `None` when all are lent.
    pub fn take(self: &Arc<Self>) -> Option<AlignedBuf> {
        let i = {
            let mut free = self.free.lock().expect("slot pool");
            let i = free.list.pop()?;
            free.is_free[i] = false;
            i
        };
        let off = i * self.slot_len;
        // SAFETY: `off + slot_len <= region.len()` (checked in `new`), so the pointer is in bounds.
        let p = unsafe { self.region.ptr.as_ptr().add(off) };
        // SAFETY: slot `i` was on the free list, so no `AlignedBuf` owns it and the device is not
        // using it (a slot lent to an engine comes back only after its command completed or the
        // controller was shut down); zeroing it races with nothing.
        unsafe { std::ptr::write_bytes(p, 0, self.slot_len) };
        let pool: Arc<dyn BufPool> = self.clone();
        // SAFETY: the slot is valid, initialised (zeroed) memory of `slot_len` bytes, page-aligned
        // (region and slot length are multiples of PAGE), owned by no one else until `give_back`
        // puts `i` back on the free list; the `Arc` in the buffer keeps the region alive until then.
        Some(unsafe { AlignedBuf::from_pool(NonNull::new(p).expect("non-null"), self.slot_len, PAGE, pool) })
    }
}

impl BufPool for SlotPool {
    /// Puts the slot back on the free list.
    ///
    /// # Panics
    /// When `ptr`/`len` is not exactly one slot of this pool, or the slot is already free (a
    /// violation of the caller's contract: lending it twice would give two owners of memory the
    /// device writes, so this refuses loudly instead).
    unsafe fn give_back(&self, ptr: NonNull<u8>, len: usize) {
        let addr = ptr.as_ptr() as usize;
        let off = self
            .region
            .locate(addr, len)
            .unwrap_or_else(|| panic!("nvme DMA slots: {len} bytes at {addr:#x} are not in this pool's region"));
        assert!(
            off.is_multiple_of(self.slot_len) && len == self.slot_len && off / self.slot_len < self.count,
            "nvme DMA slots: {len} bytes at region offset {off} are not one slot of {} bytes",
            self.slot_len
        );
        let i = off / self.slot_len;
        let mut free = self.free.lock().expect("slot pool");
        if free.is_free[i] {
            drop(free); // panic with the lock released: the pool stays usable
            panic!("nvme DMA slots: slot {i} (region offset {off}) given back twice");
        }
        free.is_free[i] = true;
        free.list.push(i);
    }
    fn name(&self) -> &str {
        "nvme DMA slots"
    }
}

impl std::fmt::Debug for SlotPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotPool")
            .field("slots", &self.count)
            .field("slot_len", &self.slot_len)
            .field("free", &self.free_slots())
            .field("region", &self.region)
            .finish()
    }
}

/// The [`SlotAllocator`] an expert cache gets from an NVMe engine: slots of a [`SlotPool`].
#[derive(Debug)]
pub struct DmaSlots {
    pool: Arc<SlotPool>,
    kind: &'static str,
}

impl DmaSlots {
    /// Slots of `pool`, whose memory is `kind` (`hugepage`, `heap`) for [`SlotAllocator::describe`].
    pub fn new(pool: Arc<SlotPool>, kind: &'static str) -> Self {
        DmaSlots { pool, kind }
    }
}

impl SlotAllocator for DmaSlots {
    fn alloc(&mut self, len: usize) -> picchio_core::Result<AlignedBuf> {
        let fail = |why: &str| picchio_core::Error::Alloc {
            len,
            align: PAGE,
            hugepages: self.kind == "hugepage",
            cause: Some(std::io::Error::other(format!("nvme DMA slot pool: {why}"))),
        };
        if len > self.pool.slot_len {
            return Err(fail(&format!("a slot holds {} bytes", self.pool.slot_len)));
        }
        self.pool.take().ok_or_else(|| fail(&format!("all {} slots are in use", self.pool.count)))
    }
    fn describe(&self) -> String {
        let r = self.pool.region();
        let ps = r.page_size();
        let size = if ps.is_multiple_of(1 << 20) { format!("{} MiB", ps >> 20) } else { format!("{} KiB", ps >> 10) };
        let what = if self.kind == "hugepage" { "hugepages".to_string() } else { format!("{} pages", self.kind) };
        format!("nvme DMA pool: {} slots of {} B in {} × {size} {what}", self.pool.count, self.pool.slot_len, r.pages())
    }
}

/// The warning for an expert cache that does not fit in the free 2 MiB hugepages: how many it
/// needs, how many `meminfo` (the text of `/proc/meminfo`) says are free and reserved, and how to
/// reserve more. `cause` is the allocation error.
pub fn hugepage_shortfall(needed_pages: usize, slots: usize, slot_len: usize, meminfo: &str, cause: &str) -> String {
    let field = |name: &str| -> Option<usize> {
        meminfo.lines().find_map(|l| l.strip_prefix(name)?.split_whitespace().next()?.parse().ok())
    };
    let (total, free) = (field("HugePages_Total:"), field("HugePages_Free:"));
    let have = match (total, free) {
        (Some(t), Some(f)) => format!("{f} of the {t} reserved are free"),
        _ => "the free count is unknown (no HugePages_Free in /proc/meminfo)".into(),
    };
    let target = total.unwrap_or(0) + needed_pages.saturating_sub(free.unwrap_or(0));
    format!(
        "zero-copy NVMe reads need the expert cache in DMA memory: {needed_pages} × 2 MiB hugepages for {slots} \
         slots of {slot_len} B, but {have} ({cause}); expert reads will be copied through bounce buffers instead \
         (counted as bounce_bytes in the engine statistics and reports). Reserve them before the run, as root: \
         echo {target} > /proc/sys/vm/nr_hugepages"
    )
}

/// The set of host ranges the device may access (the sim's IOMMU), keyed by start address.
#[derive(Default, Debug)]
pub struct DmaRegistry {
    ranges: Mutex<BTreeMap<u64, usize>>,
}

impl DmaRegistry {
    fn insert(&self, start: u64, len: usize) {
        self.ranges.lock().expect("dma registry").insert(start, len);
    }
    fn remove(&self, start: u64) {
        self.ranges.lock().expect("dma registry").remove(&start);
    }
    /// Runs `f` with the registry locked if `addr..addr + len` lies inside one registered range, so a
    /// concurrent release waits until `f` returns. `None` if it does not.
    pub fn with_range<R>(&self, addr: u64, len: usize, f: impl FnOnce() -> R) -> Option<R> {
        let g = self.ranges.lock().expect("dma registry");
        let (&start, &rlen) = g.range(..=addr).next_back()?;
        (addr.checked_add(len as u64)? <= start + rlen as u64).then(f)
    }
    /// Registered ranges (for leak checks in tests).
    pub fn count(&self) -> usize {
        self.ranges.lock().expect("dma registry").len()
    }
}

/// Every [`DmaBuf`] and [`DmaRegion`] of a [`HeapDma`] holds its registry, so the registry drops only
/// once all of them were freed (memory leaked on purpose, after a controller that did not stop,
/// keeps it alive): the log line says the sim's DMA memory is all gone.
impl Drop for DmaRegistry {
    fn drop(&mut self) {
        let left = self.ranges.get_mut().map_or(0, |r| r.len());
        tracing::info!(
            "nvme-sim DMA memory freed: every buffer and region released ({left} external ranges still mapped)"
        );
    }
}

impl IovaSpace for DmaRegistry {
    fn release(&self, iova: Iova, _len: usize) {
        self.remove(iova.0);
    }
}

/// Heap DMA memory for the sim: IOVA = host address, every range recorded in a [`DmaRegistry`].
#[derive(Clone, Default, Debug)]
pub struct HeapDma {
    registry: Arc<DmaRegistry>,
    /// Largest [`DmaPool::alloc_region`] allowed (`None`: any).
    region_limit: Arc<Mutex<Option<usize>>>,
}

impl HeapDma {
    /// A new allocator with an empty registry.
    pub fn new() -> Self {
        Self::default()
    }
    /// Refuses [`DmaPool::alloc_region`] above `bytes` (test knob standing in for a machine with too
    /// few free hugepages; applies to every clone).
    pub fn limit_regions(&self, bytes: Option<usize>) {
        *self.region_limit.lock().expect("heap dma") = bytes;
    }
    /// The registry the sim checks device accesses against.
    pub fn registry(&self) -> Arc<DmaRegistry> {
        self.registry.clone()
    }
}

impl DmaPool for HeapDma {
    fn alloc(&self, len: usize) -> Result<DmaBuf> {
        let rounded = len.max(1).div_ceil(PAGE) * PAGE;
        let fail = |cause| Error::DmaAlloc { len, hugepages: false, cause };
        let layout = Layout::from_size_align(rounded, PAGE).map_err(|_| fail(None))?;
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or_else(|| fail(None))?;
        let iova = Iova(ptr.as_ptr() as u64);
        self.registry.insert(iova.0, rounded);
        let space: Arc<dyn IovaSpace> = self.registry.clone();
        Ok(DmaBuf { ptr, len: rounded, iova, backing: Backing::Heap(layout), space: Some(space) })
    }
    fn map_external(&self, addr: *mut u8, len: usize) -> Result<Iova> {
        if addr.is_null() || len == 0 {
            return Err(Error::DmaMap { addr: addr as usize, len, why: "null or empty".into() });
        }
        self.registry.insert(addr as u64, len);
        Ok(Iova(addr as u64))
    }
    fn unmap_external(&self, iova: Iova, _len: usize) {
        self.registry.remove(iova.0);
    }
    fn kind(&self) -> &'static str {
        "heap"
    }
    fn alloc_region(&self, len: usize) -> Result<DmaRegion> {
        let rounded = len.max(1).div_ceil(PAGE) * PAGE;
        let fail = |cause| Error::DmaAlloc { len, hugepages: false, cause };
        if let Some(limit) = *self.region_limit.lock().expect("heap dma") {
            if rounded > limit {
                let why = format!("the sim's region limit is {limit} bytes (standing in for too few hugepages)");
                return Err(fail(Some(std::io::Error::new(std::io::ErrorKind::OutOfMemory, why))));
            }
        }
        let layout = Layout::from_size_align(rounded, PAGE).map_err(|_| fail(None))?;
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or_else(|| fail(None))?;
        self.registry.insert(ptr.as_ptr() as u64, rounded);
        Ok(DmaRegion {
            ptr,
            len: rounded,
            page: rounded,
            iovas: vec![Iova(ptr.as_ptr() as u64)],
            release: RegionRelease::Heap(layout, self.registry.clone()),
        })
    }
}

/// Maps host memory for the device at an IOVA (VFIO type1: `VFIO_IOMMU_MAP_DMA`).
pub trait IovaMapper: Send + Sync {
    /// Maps `len` bytes at host `vaddr` for device reads and writes, at `iova` when the mapper chooses
    /// addresses (type1), and returns the IOVA the device must use (the physical address without an
    /// IOMMU).
    ///
    /// # Errors
    /// The OS error, as [`Error::Vfio`].
    fn map(&self, vaddr: *mut u8, len: usize, iova: Iova) -> Result<Iova>;
    /// Unmaps what [`IovaMapper::map`] mapped.
    fn unmap(&self, iova: Iova, len: usize);
    /// Whether [`IovaMapper::map`] translates (an IOMMU: the device sees the IOVA asked for, so one
    /// call maps a whole multi-page region at contiguous IOVAs) rather than returning the physical
    /// address of `vaddr` (no IOMMU: each hugepage must be looked up on its own). Default: true.
    fn translates(&self) -> bool {
        true
    }
}

const HUGE: usize = 2 << 20;

struct HugeChunk {
    base: NonNull<u8>,
    iova: Iova,
    mapper: Arc<dyn IovaMapper>,
}

// SAFETY: the chunk is an owned anonymous mapping; pieces are handed out once each as `DmaBuf`s.
unsafe impl Send for HugeChunk {}
// SAFETY: as for `Send`; the chunk itself is never accessed through `&HugeChunk`.
unsafe impl Sync for HugeChunk {}

impl Drop for HugeChunk {
    fn drop(&mut self) {
        self.mapper.unmap(self.iova, HUGE);
        // SAFETY: mapped by `mmap` with length HUGE in `HugepageDma::chunk`, unmapped once, after the
        // device mapping is gone.
        unsafe { libc::munmap(self.base.as_ptr().cast(), HUGE) };
    }
}

struct HugeState {
    current: Option<(Arc<HugeChunk>, usize)>,
    next_iova: u64,
}

/// Hugepage-backed DMA memory for VFIO: 2 MiB `MAP_HUGETLB` chunks mapped at increasing IOVAs from
/// `iova_base`, carved into page-aligned pieces (a bump allocator: pieces return with their chunk).
/// Buffers larger than 2 MiB are not supported.
pub struct HugepageDma {
    mapper: Arc<dyn IovaMapper>,
    state: Mutex<HugeState>,
}

impl HugepageDma {
    /// An allocator mapping chunks through `mapper` at IOVAs from `iova_base` (2 MiB aligned).
    pub fn new(mapper: Arc<dyn IovaMapper>, iova_base: Iova) -> Self {
        HugepageDma { mapper, state: Mutex::new(HugeState { current: None, next_iova: iova_base.0 }) }
    }

    fn chunk(&self, st: &mut HugeState) -> Result<Arc<HugeChunk>> {
        // SAFETY: anonymous private mapping without an address hint; checked for MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                HUGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::DmaAlloc { len: HUGE, hugepages: true, cause: Some(std::io::Error::last_os_error()) });
        }
        let base = NonNull::new(p.cast::<u8>()).expect("mmap returned non-null");
        let iova = match self.mapper.map(base.as_ptr(), HUGE, Iova(st.next_iova)) {
            Ok(iova) => iova,
            Err(e) => {
                // SAFETY: just mapped above with length HUGE, never shared.
                unsafe { libc::munmap(p, HUGE) };
                return Err(e);
            }
        };
        st.next_iova += HUGE as u64;
        Ok(Arc::new(HugeChunk { base, iova, mapper: self.mapper.clone() }))
    }
}

impl DmaPool for HugepageDma {
    fn alloc(&self, len: usize) -> Result<DmaBuf> {
        let rounded = len.max(1).div_ceil(PAGE) * PAGE;
        if rounded > HUGE {
            return Err(Error::DmaAlloc { len, hugepages: true, cause: None });
        }
        let mut st = self.state.lock().expect("hugepage dma");
        let (chunk, used) = match st.current.take() {
            Some((c, used)) if used + rounded <= HUGE => (c, used),
            _ => (self.chunk(&mut st)?, 0),
        };
        // SAFETY: `used + rounded <= HUGE`, inside the chunk.
        let p = unsafe { chunk.base.as_ptr().add(used) };
        // SAFETY: the piece was never handed out before; hugepage memory is zeroed by the kernel.
        unsafe { std::ptr::write_bytes(p, 0, rounded) };
        let buf = DmaBuf {
            ptr: NonNull::new(p).expect("non-null"),
            len: rounded,
            iova: chunk.iova.add(used as u64),
            backing: Backing::Chunk(chunk.clone()),
            space: None,
        };
        st.current = Some((chunk, used + rounded));
        Ok(buf)
    }
    fn map_external(&self, addr: *mut u8, len: usize) -> Result<Iova> {
        Err(Error::DmaMap {
            addr: addr as usize,
            len,
            why: "VFIO DMA must target the hugepage pool (a slot from IoQueue::slot_allocator, or a bounce \
                  buffer: see NvmeQueue::with_bounce_buffer)"
                .into(),
        })
    }
    fn unmap_external(&self, _iova: Iova, _len: usize) {}
    fn kind(&self) -> &'static str {
        "hugepage"
    }
    fn alloc_region(&self, len: usize) -> Result<DmaRegion> {
        let pages = len.max(1).div_ceil(HUGE);
        let map_len = pages * HUGE;
        // SAFETY: anonymous private mapping without an address hint; checked for MAP_FAILED. Without
        // MAP_NORESERVE the kernel reserves all the hugepages now or fails with ENOMEM, and
        // MAP_POPULATE faults them in, so the physical pages exist (and never move) before mapping.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::DmaAlloc {
                len: map_len,
                hugepages: true,
                cause: Some(std::io::Error::last_os_error()),
            });
        }
        let base = NonNull::new(p.cast::<u8>()).expect("mmap returned non-null");
        let mut st = self.state.lock().expect("hugepage dma");
        let mut mapped = Vec::new();
        let mut iovas = Vec::with_capacity(pages);
        let result = if self.mapper.translates() {
            // One mapping for the whole region at IOVAs we choose: contiguous for the device.
            let at = Iova(st.next_iova);
            self.mapper.map(base.as_ptr(), map_len, at).map(|iova| {
                mapped.push((iova, map_len));
                iovas.extend((0..pages).map(|k| iova.add((k * HUGE) as u64)));
                st.next_iova += map_len as u64;
            })
        } else {
            // No IOMMU: each hugepage is contiguous in physical memory, the region is not.
            (0..pages).try_for_each(|k| {
                // SAFETY: `k * HUGE < map_len`, inside the mapping.
                let v = unsafe { base.as_ptr().add(k * HUGE) };
                self.mapper.map(v, HUGE, Iova(0)).map(|iova| iovas.push(iova))
            })
        };
        if let Err(e) = result {
            for &(iova, l) in &mapped {
                self.mapper.unmap(iova, l);
            }
            // SAFETY: mapped above with length `map_len`, never shared.
            unsafe { libc::munmap(p, map_len) };
            return Err(e);
        }
        Ok(DmaRegion {
            ptr: base,
            len: map_len,
            page: HUGE,
            iovas,
            release: RegionRelease::Huge { map_len, mapper: self.mapper.clone(), mapped },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_dma_registers_and_releases() {
        let dma = HeapDma::new();
        let reg = dma.registry();
        let mut b = dma.alloc(100).unwrap();
        assert_eq!(b.len(), PAGE);
        assert_eq!(b.iova().0 % PAGE as u64, 0);
        assert_eq!(reg.count(), 1);
        assert_eq!(reg.with_range(b.iova().0 + 8, 64, || 1), Some(1));
        assert_eq!(reg.with_range(b.iova().0 + 4090, 64, || 1), None);
        b.write::<u64>(8, 0xdead_beef);
        assert_eq!(b.read::<u32>(8), 0xdead_beef);
        let mut out = [0u8; 4];
        // SAFETY: heap memory no device writes.
        unsafe { b.copy_out(8, &mut out) };
        assert_eq!(u32::from_le_bytes(out), 0xdead_beef);
        b.zero();
        assert_eq!(b.read::<u64>(8), 0);
        drop(b);
        assert_eq!(reg.count(), 0);
        let mut v = vec![0u8; 64];
        let iova = dma.map_external(v.as_mut_ptr(), 64).unwrap();
        assert_eq!(reg.count(), 1);
        dma.unmap_external(iova, 64);
        assert_eq!(reg.count(), 0);
    }

    #[test]
    fn region_segments_follow_each_pages_iova() {
        let dma = HeapDma::new();
        let mut r = dma.alloc_region(3 * 8192).unwrap();
        assert_eq!((r.len(), r.pages()), (3 * 8192, 1));
        assert_eq!(dma.registry().count(), 1);
        // As in no-IOMMU mode: pages of 8 KiB at unrelated "physical" addresses (pages 1, 2 adjacent).
        r.page = 8192;
        r.iovas = vec![Iova(0x10_0000), Iova(0x40_0000), Iova(0x40_2000)];
        let mut out = Vec::new();
        r.segments(4096, 3 * 8192 - 4096 - 512, &mut out);
        assert_eq!(out, [(Iova(0x10_1000), 4096), (Iova(0x40_0000), 2 * 8192 - 512)]);
        out.clear();
        r.segments(8192 + 100, 50, &mut out);
        assert_eq!(out, [(Iova(0x40_0064), 50)]);
        assert_eq!(r.locate(r.addr() + 8192, 8192), Some(8192));
        assert_eq!(r.locate(r.addr() + 8192, 3 * 8192), None);
        assert_eq!(r.locate(r.addr().wrapping_sub(1), 1), None);
        drop(r);
        assert_eq!(dma.registry().count(), 0, "the region's device access is revoked");
        dma.limit_regions(Some(4096));
        assert!(dma.alloc_region(8192).is_err());
    }

    #[test]
    fn slot_pool_lends_each_slot_once() {
        let pool = Arc::new(SlotPool::new(HeapDma::new().alloc_region(3 * PAGE).unwrap(), 5000, 1).unwrap());
        assert_eq!(pool.slot_len(), 2 * PAGE);
        let a = pool.take().unwrap();
        assert!(pool.take().is_none());
        assert_eq!(a.addr(), pool.region().addr());
        drop(a);
        assert_eq!(pool.free_slots(), 1);
        assert!(SlotPool::new(HeapDma::new().alloc_region(PAGE).unwrap(), PAGE, 2).is_err());
    }

    #[test]
    #[should_panic(expected = "given back twice")]
    fn a_double_give_back_panics() {
        let pool = Arc::new(SlotPool::new(HeapDma::new().alloc_region(2 * PAGE).unwrap(), PAGE, 2).unwrap());
        let a = pool.take().unwrap();
        let (ptr, len) = (NonNull::new(a.addr() as *mut u8).unwrap(), a.len());
        drop(a); // the one legitimate give_back
        assert_eq!(pool.free_slots(), 2);
        // SAFETY: deliberately violates `give_back`'s contract (a second return of a slot no buffer
        // owns) to test that the pool refuses it with a panic instead of lending the slot twice; no
        // memory is touched before the check.
        unsafe { pool.give_back(ptr, len) };
    }

    #[test]
    #[should_panic(expected = "not one slot")]
    fn a_give_back_of_part_of_a_slot_panics() {
        let pool = Arc::new(SlotPool::new(HeapDma::new().alloc_region(4 * PAGE).unwrap(), 2 * PAGE, 2).unwrap());
        let a = pool.take().unwrap();
        let ptr = NonNull::new((a.addr() + PAGE) as *mut u8).unwrap();
        // SAFETY: deliberately violates `give_back`'s contract (a range that is not a lent slot) to
        // test the check; it panics before touching the free list or the memory.
        unsafe { pool.give_back(ptr, PAGE) };
    }

    #[test]
    #[should_panic(expected = "DMA access")]
    fn out_of_bounds_access_panics() {
        let b = HeapDma::new().alloc(PAGE).unwrap();
        let _ = b.read::<u64>(PAGE);
    }
}
