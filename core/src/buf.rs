//! Block-aligned buffers: the cache slots that reads (O_DIRECT, io_uring, NVMe DMA) land in.
//!
//! An [`AlignedBuf`] owns heap memory (the default), a `MAP_HUGETLB` mapping, or a block lent by a
//! [`BufPool`] — memory some engine reads into without a copy, such as the NVMe driver's hugepage DMA
//! pool — which goes back to its pool when the buffer is dropped.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result};

/// An owned, zero-initialised byte buffer whose address and length are multiples of `align`.
///
/// It moves into an [`IoQueue`](crate::IoQueue) with a read and comes back with its completion, so the
/// kernel or device only ever writes a buffer no Rust reference points at.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    align: usize,
    backing: Backing,
}

enum Backing {
    Heap(Layout),
    #[cfg(unix)]
    Mmap(usize),
    /// Lent by a pool; handed back on drop. The `Arc` keeps the pool (and its memory) alive.
    Pool(Arc<dyn BufPool>),
}

/// An allocator that lends memory to [`AlignedBuf`]s (see [`AlignedBuf::from_pool`]) and takes each
/// block back when its buffer is dropped; e.g. the NVMe driver's DMA pool, whose blocks the device can
/// write directly.
pub trait BufPool: Send + Sync {
    /// Takes back the `len` bytes at `ptr` that [`AlignedBuf::from_pool`] wrapped, so the pool may
    /// lend them again.
    ///
    /// # Safety
    /// Only the `Drop` of the [`AlignedBuf`] that wraps `ptr`/`len` may call this, exactly once, when
    /// no reference to the bytes remains: afterwards the pool may hand them to a new owner (and a
    /// device may write them), so any other call would leave two owners of the same memory.
    /// Implementations should still check what they can (e.g. that the block is lent, not free) and
    /// panic on a violation rather than lend a block twice.
    unsafe fn give_back(&self, ptr: NonNull<u8>, len: usize);

    /// A short name for logs and `Debug` (e.g. `nvme DMA slots`).
    fn name(&self) -> &str;
}

// SAFETY: `AlignedBuf` owns its allocation exclusively (like `Vec<u8>`); no aliasing pointer is kept
// elsewhere, so moving it to another thread or sharing `&AlignedBuf` is as safe as for `Vec<u8>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: see `Send`; `&AlignedBuf` only gives `&[u8]`.
unsafe impl Sync for AlignedBuf {}

/// Options for [`AlignedBuf`]: alignment (the device block size) and hugepage backing.
#[derive(Clone, Copy, Debug)]
pub struct AlignedBufBuilder {
    align: usize,
    hugepages: bool,
}

impl Default for AlignedBufBuilder {
    fn default() -> Self {
        AlignedBufBuilder { align: crate::BLOCK_SIZE as usize, hugepages: false }
    }
}

impl AlignedBufBuilder {
    /// Alignment in bytes of address and length (a power of two; default 4096).
    pub fn align(mut self, align: usize) -> Self {
        self.align = align;
        self
    }

    /// Back the buffer with 2 MiB hugepages (`MAP_HUGETLB`, Linux); the length is rounded up to 2 MiB.
    pub fn hugepages(mut self, on: bool) -> Self {
        self.hugepages = on;
        self
    }

    /// Allocates a zeroed buffer of at least `len` bytes (rounded up to the alignment).
    ///
    /// # Errors
    /// [`Error::Alloc`] if the alignment is not a power of two or memory (or hugepages) is unavailable.
    pub fn build(self, len: usize) -> Result<AlignedBuf> {
        let fail = |cause| Error::Alloc { len, align: self.align, hugepages: self.hugepages, cause };
        if !self.align.is_power_of_two() {
            return Err(fail(None));
        }
        let rounded = len.max(1).div_ceil(self.align) * self.align;
        if self.hugepages {
            #[cfg(target_os = "linux")]
            {
                let map_len = rounded.div_ceil(2 << 20) * (2 << 20);
                // SAFETY: an anonymous private mapping with no address hint aliases no existing
                // memory; the result is checked for MAP_FAILED before use.
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        map_len,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB,
                        -1,
                        0,
                    )
                };
                if p == libc::MAP_FAILED {
                    return Err(fail(Some(std::io::Error::last_os_error())));
                }
                let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| fail(None))?;
                return Ok(AlignedBuf { ptr, len: rounded, align: self.align, backing: Backing::Mmap(map_len) });
            }
            #[cfg(not(target_os = "linux"))]
            return Err(fail(Some(std::io::Error::from(std::io::ErrorKind::Unsupported))));
        }
        let layout = Layout::from_size_align(rounded, self.align).map_err(|_| fail(None))?;
        // SAFETY: `layout` has a non-zero size (len.max(1) rounded up).
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or_else(|| fail(None))?;
        Ok(AlignedBuf { ptr, len: rounded, align: self.align, backing: Backing::Heap(layout) })
    }
}

impl AlignedBuf {
    /// Options for a new buffer.
    pub fn builder() -> AlignedBufBuilder {
        AlignedBufBuilder::default()
    }

    /// A zeroed heap buffer of at least `len` bytes aligned to `align` (a power of two).
    ///
    /// # Errors
    /// See [`AlignedBufBuilder::build`].
    pub fn new(len: usize, align: usize) -> Result<Self> {
        Self::builder().align(align).build(len)
    }

    /// Length in bytes (a multiple of [`AlignedBuf::align`]).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: buffers hold at least one aligned block.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Alignment of address and length, in bytes.
    pub fn align(&self) -> usize {
        self.align
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised bytes for the life of `self`, and while the
        // buffer is lent to an engine it has been moved out of any place a `&self` could come from.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Raw pointer for an engine to hand to the kernel or a device (valid for `len` bytes).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Address of byte 0 (for an engine to recognise memory it lent, e.g. from its DMA pool).
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Wraps `len` bytes at `ptr` that `pool` lends; the buffer gives them back to `pool`
    /// ([`BufPool::give_back`]) when it is dropped, and keeps `pool` alive until then.
    ///
    /// # Safety
    /// - `ptr` is valid for reads and writes of `len` initialised bytes (e.g. zeroed) until
    ///   `pool.give_back(ptr, len)` is called, and nothing else reads or writes them until then: the
    ///   buffer owns them exclusively, as a `Box<[u8]>` would (a device may write them only while the
    ///   buffer is lent to the engine that drives it, as with any [`AlignedBuf`]).
    /// - `align` is a power of two, and `ptr` and `len` (> 0) are multiples of it.
    pub unsafe fn from_pool(ptr: NonNull<u8>, len: usize, align: usize, pool: Arc<dyn BufPool>) -> AlignedBuf {
        debug_assert!(align.is_power_of_two() && len > 0);
        debug_assert!((ptr.as_ptr() as usize).is_multiple_of(align) && len.is_multiple_of(align));
        AlignedBuf { ptr, len, align, backing: Backing::Pool(pool) }
    }

    /// The name ([`BufPool::name`]) of the pool this buffer's memory was lent by, if any (`None` for
    /// heap and hugepage-mapped buffers). The pool itself is not exposed: only this buffer's `Drop`
    /// may give its memory back.
    pub fn pool_name(&self) -> Option<&str> {
        match &self.backing {
            Backing::Pool(p) => Some(p.name()),
            _ => None,
        }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        match &self.backing {
            // SAFETY: allocated by `alloc_zeroed` with exactly this layout, freed once.
            Backing::Heap(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), *layout) },
            #[cfg(unix)]
            // SAFETY: mapped by `mmap` with exactly this length, unmapped once.
            Backing::Mmap(map_len) => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), *map_len);
            },
            // SAFETY: this is the `Drop` of the buffer that wraps `ptr`/`len` (lent by `pool` through
            // `from_pool`), running once, with no reference to the bytes left — `give_back`'s contract.
            Backing::Pool(pool) => unsafe { pool.give_back(self.ptr, self.len) },
        }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("AlignedBuf");
        d.field("len", &self.len).field("align", &self.align);
        if let Backing::Pool(p) = &self.backing {
            d.field("pool", &p.name());
        }
        d.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_rounded() {
        for align in [512, 4096, 65536] {
            let mut b = AlignedBuf::new(5000, align).unwrap();
            assert_eq!(b.as_mut_ptr() as usize % align, 0);
            assert_eq!(b.len() % align, 0);
            assert!(b.len() >= 5000);
            assert!(b.as_slice().iter().all(|&x| x == 0));
            b.as_mut_slice()[4999] = 9;
            assert_eq!(b.as_slice()[4999], 9);
        }
        assert!(AlignedBuf::new(10, 3000).is_err());
    }

    /// A pool of heap blocks that records what comes back.
    struct TestPool {
        layout: Layout,
        base: NonNull<u8>,
        returned: std::sync::Mutex<Vec<(usize, usize)>>,
    }
    // SAFETY: `base` is only dereferenced through the `AlignedBuf`s lent from it.
    unsafe impl Send for TestPool {}
    // SAFETY: as for `Send`; `returned` is behind a mutex.
    unsafe impl Sync for TestPool {}
    impl BufPool for TestPool {
        unsafe fn give_back(&self, ptr: NonNull<u8>, len: usize) {
            self.returned.lock().unwrap().push((ptr.as_ptr() as usize - self.base.as_ptr() as usize, len));
        }
        fn name(&self) -> &str {
            "test pool"
        }
    }
    impl Drop for TestPool {
        fn drop(&mut self) {
            // SAFETY: allocated in the test with this layout; every buffer is gone (they hold the Arc).
            unsafe { std::alloc::dealloc(self.base.as_ptr(), self.layout) }
        }
    }

    #[test]
    fn pool_buffers_return_to_their_pool_on_drop() {
        let layout = Layout::from_size_align(4 * 4096, 4096).unwrap();
        // SAFETY: non-zero size.
        let base = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).unwrap();
        let pool = Arc::new(TestPool { layout, base, returned: Default::default() });
        let dynpool: Arc<dyn BufPool> = pool.clone();
        // SAFETY: two disjoint zeroed blocks of the pool's allocation, each lent once.
        let (mut a, b) = unsafe {
            (
                AlignedBuf::from_pool(base, 8192, 4096, dynpool.clone()),
                AlignedBuf::from_pool(NonNull::new(base.as_ptr().add(8192)).unwrap(), 4096, 4096, dynpool),
            )
        };
        assert_eq!((a.len(), a.align(), a.addr()), (8192, 4096, base.as_ptr() as usize));
        assert_eq!(a.pool_name(), Some("test pool"));
        assert_eq!(AlignedBuf::new(10, 512).unwrap().pool_name(), None);
        a.as_mut_slice()[8191] = 7;
        assert_eq!(a.as_slice()[8191], 7);
        assert!(format!("{a:?}").contains("test pool"));
        drop(b);
        drop(a);
        assert_eq!(*pool.returned.lock().unwrap(), [(8192, 4096), (0, 8192)]);
        assert_eq!(Arc::strong_count(&pool), 1, "the buffers released the pool");
    }

    #[test]
    fn hugepages_allocate_or_fail_cleanly() {
        match AlignedBuf::builder().hugepages(true).build(4096) {
            Ok(b) => assert_eq!(b.len(), 4096),
            Err(e) => eprintln!("hugepages unavailable here (skipping the mapped case): {e}"),
        }
    }
}
