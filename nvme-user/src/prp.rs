//! PRP entries (§4.1.1 "Physical Region Page Entry and List"): PRP1, PRP2 and one PRP-list page per
//! command, built from IOVA segments with indexed errors, plus the split of a transfer at MDTS.
//!
//! Rules (§4.1.1): the first entry may start at any dword-aligned offset in a page; every later entry
//! starts at a page boundary (offset 0); every entry but the last runs to the end of its page. Two
//! entries go in PRP1/PRP2; more put the second and later entries in a PRP list whose IOVA is PRP2.
//! One list page (page / 8 entries, no chaining) bounds a command to [`max_transfer`] bytes.

use crate::dma::Iova;

/// Why a transfer cannot be described by PRPs. `entry` is the PRP entry index (0 = PRP1).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PrpError {
    /// An entry address is not dword (4-byte) aligned.
    #[error("entry {index}: address {addr:#x} is not dword aligned")]
    NotDwordAligned {
        /// The PRP entry index.
        index: usize,
        /// The address.
        addr: u64,
    },
    /// An entry after the first does not start at a page boundary, or the previous one does not end at one.
    #[error("entry {index}: address {addr:#x} is not page aligned (page {page} bytes), or the previous segment ends mid-page")]
    NotPageAligned {
        /// The PRP entry index.
        index: usize,
        /// The address.
        addr: u64,
        /// Page size.
        page: usize,
    },
    /// The transfer needs more entries than one PRP-list page holds.
    #[error("entry {index}: out of PRP list entries (list holds {capacity})")]
    OutOfEntries {
        /// The first entry that does not fit.
        index: usize,
        /// Entries one list page holds.
        capacity: usize,
    },
    /// The transfer is empty.
    #[error("empty transfer")]
    Empty,
}

/// Where the PRP list entries go (entry `i` of the list is PRP entry `i + 1`).
pub trait PrpSink {
    /// How many list entries fit.
    fn capacity(&self) -> usize;
    /// Writes list entry `i` (`i < capacity`).
    fn set(&mut self, i: usize, v: u64);
}

impl PrpSink for [u64] {
    fn capacity(&self) -> usize {
        self.len()
    }
    fn set(&mut self, i: usize, v: u64) {
        self[i] = v;
    }
}

/// The data pointer of one command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prps {
    /// PRP Entry 1.
    pub prp1: u64,
    /// PRP Entry 2: 0, the second page, or the PRP list's IOVA.
    pub prp2: u64,
    /// Entries written to the list (0 when PRP2 is not a list).
    pub list_entries: usize,
}

/// Builds the PRPs for `segments` (IOVA, bytes), pages of `page` bytes, writing list entries to
/// `list`, whose own IOVA is `list_iova` (page aligned).
///
/// # Errors
/// [`PrpError`] with the index of the offending entry.
pub fn build(
    segments: &[(Iova, usize)],
    page: usize,
    list_iova: Iova,
    list: &mut (impl PrpSink + ?Sized),
) -> Result<Prps, PrpError> {
    debug_assert!(page.is_power_of_two() && list_iova.0.is_multiple_of(page as u64));
    let pg = page as u64;
    let mut n = 0usize; // entries so far
    let mut prp1 = 0u64;
    let mut second = 0u64;
    let mut ends_at_page = true;
    for &(Iova(addr), len) in segments {
        if len == 0 {
            continue;
        }
        if addr % 4 != 0 {
            return Err(PrpError::NotDwordAligned { index: n, addr });
        }
        if n > 0 && (addr % pg != 0 || !ends_at_page) {
            return Err(PrpError::NotPageAligned { index: n, addr, page });
        }
        let end = addr + len as u64;
        let mut a = addr;
        while a < end {
            match n {
                0 => prp1 = a,
                _ => {
                    if n == 1 {
                        second = a;
                    }
                    if n > list.capacity() {
                        return Err(PrpError::OutOfEntries { index: n, capacity: list.capacity() });
                    }
                    list.set(n - 1, a);
                }
            }
            n += 1;
            a = (a / pg + 1) * pg;
        }
        ends_at_page = end.is_multiple_of(pg);
    }
    match n {
        0 => Err(PrpError::Empty),
        1 => Ok(Prps { prp1, prp2: 0, list_entries: 0 }),
        2 => Ok(Prps { prp1, prp2: second, list_entries: 0 }),
        _ => Ok(Prps { prp1, prp2: list_iova.0, list_entries: n - 1 }),
    }
}

/// Largest transfer one command may carry: the controller's MDTS limit (`None`: unlimited) capped by
/// what one PRP-list page describes for a page-aligned buffer.
pub fn max_transfer(page: usize, mdts_bytes: Option<usize>) -> usize {
    let list_limit = (page / 8) * page;
    mdts_bytes.map_or(list_limit, |m| m.min(list_limit))
}

/// Splits `len` bytes into `(offset, len)` chunks of at most `max` bytes (the MDTS split).
pub fn split(len: usize, max: usize) -> impl Iterator<Item = (usize, usize)> {
    assert!(max > 0);
    (0..len.div_ceil(max)).map(move |i| (i * max, max.min(len - i * max)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: usize = 4096;
    const LIST: Iova = Iova(0x9000_0000);

    fn one(iova: u64, len: usize, list: &mut [u64]) -> Result<Prps, PrpError> {
        build(&[(Iova(iova), len)], P, LIST, list)
    }

    #[test]
    fn single_and_double_page() {
        let mut l = [0u64; 512];
        assert_eq!(one(0x10_0000, 4096, &mut l), Ok(Prps { prp1: 0x10_0000, prp2: 0, list_entries: 0 }));
        assert_eq!(one(0x10_0000, 512, &mut l).unwrap().prp2, 0);
        assert_eq!(one(0x10_0000, 8192, &mut l), Ok(Prps { prp1: 0x10_0000, prp2: 0x10_1000, list_entries: 0 }));
        // Offset start: 0x200 into a page, 4096 bytes straddle two pages.
        assert_eq!(one(0x10_0200, 4096, &mut l), Ok(Prps { prp1: 0x10_0200, prp2: 0x10_1000, list_entries: 0 }));
    }

    #[test]
    fn list_for_three_or_more_pages() {
        let mut l = [0u64; 512];
        let p = one(0x20_0000, 5 * 4096, &mut l).unwrap();
        assert_eq!(p, Prps { prp1: 0x20_0000, prp2: LIST.0, list_entries: 4 });
        assert_eq!(&l[..4], &[0x20_1000, 0x20_2000, 0x20_3000, 0x20_4000]);
        // The full list: 1 + 512 pages.
        let p = one(0x40_0000, 513 * 4096, &mut l).unwrap();
        assert_eq!(p.list_entries, 512);
        assert_eq!(l[511], 0x40_0000 + 512 * 4096);
    }

    #[test]
    fn multi_segment() {
        let mut l = [0u64; 8];
        let segs = [(Iova(0x1_0800), 2048), (Iova(0x5_0000), 8192), (Iova(0x9_0000), 100)];
        let p = build(&segs, P, LIST, &mut l[..]).unwrap();
        assert_eq!(p.prp1, 0x1_0800);
        assert_eq!(&l[..p.list_entries], &[0x5_0000, 0x5_1000, 0x9_0000]);
    }

    #[test]
    fn indexed_errors() {
        let mut l = [0u64; 4];
        assert_eq!(one(0x1002, 4096, &mut l), Err(PrpError::NotDwordAligned { index: 0, addr: 0x1002 }));
        let segs = [(Iova(0x1000), 4096), (Iova(0x3004), 4092)];
        assert_eq!(
            build(&segs, P, LIST, &mut l[..]),
            Err(PrpError::NotPageAligned { index: 1, addr: 0x3004, page: P })
        );
        // Previous segment ends mid-page.
        let segs = [(Iova(0x1000), 100), (Iova(0x3000), 4096)];
        assert!(matches!(build(&segs, P, LIST, &mut l[..]), Err(PrpError::NotPageAligned { index: 1, .. })));
        let segs = [(Iova(0x1000), 4096), (Iova(0x3001), 4)];
        assert_eq!(build(&segs, P, LIST, &mut l[..]), Err(PrpError::NotDwordAligned { index: 1, addr: 0x3001 }));
        // 1 + 4 list entries fit, the 6th page does not.
        assert!(one(0x10_0000, 5 * 4096, &mut l).is_ok());
        assert_eq!(one(0x10_0000, 6 * 4096, &mut l), Err(PrpError::OutOfEntries { index: 5, capacity: 4 }));
        assert_eq!(one(0x10_0000, 0, &mut l), Err(PrpError::Empty));
    }

    #[test]
    fn mdts_split() {
        assert_eq!(max_transfer(4096, None), 2 << 20);
        assert_eq!(max_transfer(4096, Some(128 << 10)), 128 << 10);
        let c: Vec<_> = split(300 << 10, 128 << 10).collect();
        assert_eq!(c, vec![(0, 128 << 10), (128 << 10, 128 << 10), (256 << 10, 44 << 10)]);
        assert_eq!(split(4096, 4096).count(), 1);
    }
}
