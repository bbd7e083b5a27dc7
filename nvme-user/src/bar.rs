//! The controller's register window. [`Bar`] is the one trait the driver talks through; it is
//! implemented by [`MmioBar`] (a VFIO BAR0 mapping) and by the software model
//! ([`crate::sim::SimBar`]), so queue and controller code is identical over both.

use crate::spec::regs;

/// 32- and 64-bit register accesses at byte offsets into BAR0.
///
/// Implementations must perform each access as one access of that width (MMIO registers have side
/// effects: a doorbell write is a command to the device). Offsets are within the BAR.
pub trait Bar: Send + Sync {
    /// Reads the 32-bit register at `off`.
    fn read32(&self, off: usize) -> u32;
    /// Reads the 64-bit register at `off` (CAP, ASQ, ACQ).
    fn read64(&self, off: usize) -> u64;
    /// Writes the 32-bit register at `off`.
    fn write32(&self, off: usize, v: u32);
    /// Writes the 64-bit register at `off`.
    fn write64(&self, off: usize, v: u64);
    /// Short name of the back end for logs (`sim`, `vfio`).
    fn kind(&self) -> &'static str;
}

/// Doorbell addressing for one controller (`CAP.DSTRD`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Doorbells {
    /// CAP.DSTRD.
    pub dstrd: u8,
}

impl Doorbells {
    /// Rings the Submission Queue `qid` Tail Doorbell with the new tail.
    pub fn sq_tail(self, bar: &dyn Bar, qid: u16, tail: u16) {
        bar.write32(regs::sq_tail_doorbell(qid, self.dstrd), u32::from(tail));
    }
    /// Rings the Completion Queue `qid` Head Doorbell with the new head.
    pub fn cq_head(self, bar: &dyn Bar, qid: u16, head: u16) {
        bar.write32(regs::cq_head_doorbell(qid, self.dstrd), u32::from(head));
    }
}

/// A memory-mapped register window (VFIO BAR0): bounds-checked, one volatile access per call.
pub struct MmioBar {
    base: *mut u8,
    len: usize,
    /// A byte range that must never be touched (the MSI-X table page), `start..end`.
    hole: std::ops::Range<usize>,
    _owner: Box<dyn Send + Sync>,
}

// SAFETY: the mapping is device memory shared with the device; every access is a single volatile
// load or store, which is what MMIO needs from any thread. `_owner` keeps the mapping alive.
unsafe impl Send for MmioBar {}
// SAFETY: as for `Send`; `&MmioBar` only offers volatile register accesses.
unsafe impl Sync for MmioBar {}

impl MmioBar {
    /// Wraps a mapping of `len` bytes at `base`; `owner` unmaps it on drop; `hole` is never accessed.
    ///
    /// # Safety
    /// `base..base + len` must be a live device-register mapping for as long as `owner` lives, with
    /// `base` 8-byte aligned.
    pub unsafe fn new(base: *mut u8, len: usize, hole: std::ops::Range<usize>, owner: Box<dyn Send + Sync>) -> Self {
        MmioBar { base, len, hole, _owner: owner }
    }

    fn check(&self, off: usize, width: usize) {
        assert!(
            off.is_multiple_of(width) && off + width <= self.len,
            "BAR access {off:#x}+{width} outside {:#x}",
            self.len
        );
        assert!(off + width <= self.hole.start || off >= self.hole.end, "BAR access {off:#x} inside the MSI-X hole");
    }
}

impl Bar for MmioBar {
    fn read32(&self, off: usize) -> u32 {
        self.check(off, 4);
        // SAFETY: `check` keeps the aligned access inside the live mapping (`new`'s contract).
        unsafe { std::ptr::read_volatile(self.base.add(off).cast::<u32>()) }
    }
    fn read64(&self, off: usize) -> u64 {
        // Two 32-bit reads, low first: NVMe allows 64-bit registers to be read as two dwords (§3.1.4).
        u64::from(self.read32(off)) | (u64::from(self.read32(off + 4)) << 32)
    }
    fn write32(&self, off: usize, v: u32) {
        self.check(off, 4);
        // SAFETY: as in `read32`.
        unsafe { std::ptr::write_volatile(self.base.add(off).cast::<u32>(), v) }
    }
    fn write64(&self, off: usize, v: u64) {
        self.write32(off, v as u32);
        self.write32(off + 4, (v >> 32) as u32);
    }
    fn kind(&self) -> &'static str {
        "vfio"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mmio_bar_volatile_and_bounds() {
        let mut mem = vec![0u64; 0x2000 / 8];
        let base = mem.as_mut_ptr().cast::<u8>();
        // SAFETY: `mem` outlives `bar` (dropped first below) and is 8-byte aligned.
        let bar = unsafe { MmioBar::new(base, 0x2000, 0x1800..0x1900, Box::new(())) };
        bar.write64(regs::ASQ, 0x1234_5678_9abc_def0);
        assert_eq!(bar.read64(regs::ASQ), 0x1234_5678_9abc_def0);
        Doorbells { dstrd: 0 }.sq_tail(&bar, 1, 7);
        assert_eq!(bar.read32(0x1008), 7);
        assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| bar.read32(0x1800))).is_err());
        assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| bar.read32(0x2000))).is_err());
        drop(bar);
        assert_eq!(mem[0x1008 / 8] & 0xFFFF_FFFF, 7);
    }
}
