//! PRP entries (NVMe base spec 2.0 §4.1.1 "Physical Region Page Entry and List"): PRP1, PRP2 and a
//! chain of PRP-list pages per command, built from IOVA segments with indexed errors, plus the split
//! of a transfer at MDTS.
//!
//! Rules (§4.1.1): the first entry may start at any dword-aligned offset in a page; every later entry
//! starts at a page boundary (offset 0); every entry but the last runs to the end of its page. Two
//! entries go in PRP1/PRP2; more put the second and later entries in a PRP list whose IOVA is PRP2.
//! A list page holds `page / 8` entries; when more entries remain than fit, the **last** entry of a
//! full list page is not a data entry but the pointer to the next list page (page aligned), so a list
//! of `L` pages carries `L · (page/8 − 1) + 1` data entries ([`list_pages_for`]). A command may
//! therefore carry any transfer up to MDTS ([`max_transfer`]); transfers are split only there.
//!
//! ```text
//! PRP1 ─► data page 0 (may start at an offset)
//! PRP2 ─► list page 0: [d1 d2 … d511 │ ptr] ─► list page 1: [d512 … d1022 │ ptr] ─► … ─► last: [… dE]
//! ```

use crate::dma::Iova;

/// Why a transfer cannot be described by PRPs. `index` is the PRP entry index (0 = PRP1).
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
    /// The transfer needs more entries than the command's PRP-list pages hold.
    #[error("entry {index}: out of PRP list entries (the list pages hold {capacity} data entries)")]
    OutOfEntries {
        /// The first entry that does not fit.
        index: usize,
        /// Data entries the list pages hold.
        capacity: usize,
    },
    /// The transfer is empty.
    #[error("empty transfer")]
    Empty,
}

/// Where the PRP list entries go: `pages()` list pages of `page / 8` entries each.
pub trait PrpSink {
    /// How many list pages are available (at least 1).
    fn pages(&self) -> usize;
    /// The IOVA of list page `p` (page aligned).
    fn page_iova(&self, p: usize) -> Iova;
    /// Writes entry `i` (`i < page / 8`) of list page `p`.
    fn set(&mut self, p: usize, i: usize, v: u64);
}

/// A host-memory stand-in for list pages (unit tests, and layout checks): `pages` pages at IOVAs
/// `base + p · page`, entries in `entries[p][i]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VecSink {
    /// IOVA of list page 0.
    pub base: Iova,
    /// Page size in bytes.
    pub page: usize,
    /// Entries, one vector of `page / 8` per list page.
    pub entries: Vec<Vec<u64>>,
}

impl VecSink {
    /// `pages` zeroed list pages of `page` bytes from IOVA `base`.
    pub fn new(base: Iova, page: usize, pages: usize) -> Self {
        VecSink { base, page, entries: vec![vec![0; page / 8]; pages] }
    }
}

impl PrpSink for VecSink {
    fn pages(&self) -> usize {
        self.entries.len()
    }
    fn page_iova(&self, p: usize) -> Iova {
        self.base.add((p * self.page) as u64)
    }
    fn set(&mut self, p: usize, i: usize, v: u64) {
        self.entries[p][i] = v;
    }
}

/// The data pointer of one command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prps {
    /// PRP Entry 1.
    pub prp1: u64,
    /// PRP Entry 2: 0, the second page, or the IOVA of list page 0.
    pub prp2: u64,
    /// Data entries written to the list (0 when PRP2 is not a list).
    pub list_entries: usize,
    /// List pages used (0 when PRP2 is not a list); all but the last end in a chain pointer.
    pub list_pages: usize,
}

/// List pages needed for `entries` list data entries with `page`-byte pages: 0 for none, 1 up to
/// `page / 8`, then one more per `page / 8 − 1` (the last slot of every full page is the chain pointer).
pub const fn list_pages_for(entries: usize, page: usize) -> usize {
    let per = page / 8;
    if entries == 0 {
        0
    } else if entries <= per {
        1
    } else {
        (entries - 1).div_ceil(per - 1)
    }
}

/// Data entries that `pages` chained list pages of `page` bytes hold.
pub const fn list_capacity(pages: usize, page: usize) -> usize {
    if pages == 0 {
        0
    } else {
        pages * (page / 8 - 1) + 1
    }
}

/// List pages one command needs for any transfer of up to `max_bytes` (the first data page may start
/// at a dword offset, so the transfer may span `⌈max_bytes / page⌉ + 1` pages, the first in PRP1).
/// At least 1.
pub const fn list_pages_for_transfer(max_bytes: usize, page: usize) -> usize {
    let p = list_pages_for(max_bytes.div_ceil(page), page);
    if p == 0 {
        1
    } else {
        p
    }
}

/// Where list data entry `k` (0-based, = PRP entry `k + 1`) goes in a list of `pages` pages:
/// `(page, slot)`.
const fn slot_of(k: usize, pages: usize, per: usize) -> (usize, usize) {
    let p = k / (per - 1);
    let p = if p > pages - 1 { pages - 1 } else { p };
    (p, k - p * (per - 1))
}

/// Builds the PRPs for `segments` (IOVA, bytes) with pages of `page` bytes, writing list entries (and
/// chain pointers) to `list`.
///
/// # Errors
/// [`PrpError`] with the index of the offending entry; nothing is guaranteed about what was written
/// to `list` then.
pub fn build(segments: &[(Iova, usize)], page: usize, list: &mut (impl PrpSink + ?Sized)) -> Result<Prps, PrpError> {
    debug_assert!(page.is_power_of_two() && page >= 64);
    let pg = page as u64;
    // Pass 1: validate and count the entries.
    let mut n = 0usize;
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
        n += ((end - addr / pg * pg).div_ceil(pg)) as usize;
        ends_at_page = end.is_multiple_of(pg);
    }
    if n == 0 {
        return Err(PrpError::Empty);
    }
    let data = n - 1; // entries after PRP1
    let per = page / 8;
    let pages = if data >= 2 { list_pages_for(data, page) } else { 0 };
    if pages > list.pages() {
        let capacity = list_capacity(list.pages(), page);
        return Err(PrpError::OutOfEntries { index: capacity + 1, capacity });
    }
    // Pass 2: write the entries.
    let mut prp1 = 0u64;
    let mut second = 0u64;
    let mut i = 0usize;
    for &(Iova(addr), len) in segments {
        let end = addr + len as u64;
        let mut a = addr;
        while a < end {
            match i {
                0 => prp1 = a,
                _ => {
                    if i == 1 {
                        second = a;
                    }
                    if pages > 0 {
                        let (p, s) = slot_of(i - 1, pages, per);
                        list.set(p, s, a);
                    }
                }
            }
            i += 1;
            a = (a / pg + 1) * pg;
        }
    }
    for p in 0..pages.saturating_sub(1) {
        list.set(p, per - 1, list.page_iova(p + 1).0);
    }
    Ok(match data {
        0 => Prps { prp1, prp2: 0, list_entries: 0, list_pages: 0 },
        1 => Prps { prp1, prp2: second, list_entries: 0, list_pages: 0 },
        _ => Prps { prp1, prp2: list.page_iova(0).0, list_entries: data, list_pages: pages },
    })
}

/// Largest transfer one command may carry: the controller's MDTS limit, capped at `cap` bytes (also
/// the bound used to size each command's PRP-list pages; `None` MDTS means no controller limit).
pub fn max_transfer(mdts_bytes: Option<usize>, cap: usize) -> usize {
    mdts_bytes.map_or(cap, |m| m.min(cap))
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
    const PER: usize = P / 8;
    const LIST: Iova = Iova(0x9000_0000);

    fn one(iova: u64, len: usize, list: &mut VecSink) -> Result<Prps, PrpError> {
        build(&[(Iova(iova), len)], P, list)
    }

    fn sink(pages: usize) -> VecSink {
        VecSink::new(LIST, P, pages)
    }

    /// Walks a built list like a controller (sim/io.rs does the same over DMA memory): data entries in
    /// order, following the chain pointer in the last slot of every full page.
    fn walk(p: &Prps, s: &VecSink, len: usize, page: usize) -> Vec<u64> {
        let mut out = vec![p.prp1];
        let first = len.min(page - (p.prp1 % page as u64) as usize);
        let mut rem = len - first;
        if rem == 0 {
            return out;
        }
        if rem <= page {
            out.push(p.prp2);
            return out;
        }
        let mut list_page = ((p.prp2 - s.base.0) / page as u64) as usize;
        let per = page / 8;
        loop {
            let entries = &s.entries[list_page];
            let needed = rem.div_ceil(page);
            let take = if needed > per { per - 1 } else { needed };
            for &e in &entries[..take] {
                out.push(e);
                rem -= rem.min(page);
            }
            if rem == 0 {
                return out;
            }
            let next = entries[per - 1];
            assert_eq!(next % page as u64, 0, "chain pointer {next:#x} page aligned");
            list_page = ((next - s.base.0) / page as u64) as usize;
        }
    }

    #[test]
    fn single_and_double_page() {
        let mut l = sink(1);
        let none = |prp1, prp2| Prps { prp1, prp2, list_entries: 0, list_pages: 0 };
        assert_eq!(one(0x10_0000, 4096, &mut l), Ok(none(0x10_0000, 0)));
        assert_eq!(one(0x10_0000, 512, &mut l).unwrap().prp2, 0);
        assert_eq!(one(0x10_0000, 8192, &mut l), Ok(none(0x10_0000, 0x10_1000)));
        // Offset start: 0x200 into a page, 4096 bytes straddle two pages.
        assert_eq!(one(0x10_0200, 4096, &mut l), Ok(none(0x10_0200, 0x10_1000)));
        assert_eq!(l, sink(1), "no list written for one or two entries");
    }

    #[test]
    fn list_for_three_or_more_pages() {
        let mut l = sink(1);
        let p = one(0x20_0000, 5 * 4096, &mut l).unwrap();
        assert_eq!(p, Prps { prp1: 0x20_0000, prp2: LIST.0, list_entries: 4, list_pages: 1 });
        assert_eq!(&l.entries[0][..4], &[0x20_1000, 0x20_2000, 0x20_3000, 0x20_4000]);
        // A full single page: 1 + 512 pages, the last slot is data (nothing follows).
        let p = one(0x40_0000, 513 * 4096, &mut l).unwrap();
        assert_eq!((p.list_entries, p.list_pages), (512, 1));
        assert_eq!(l.entries[0][511], 0x40_0000 + 512 * 4096);
    }

    #[test]
    fn entry_counts_at_page_boundaries() {
        assert_eq!(list_pages_for(0, P), 0);
        assert_eq!(list_pages_for(1, P), 1);
        assert_eq!(list_pages_for(PER, P), 1);
        assert_eq!(list_pages_for(PER + 1, P), 2);
        assert_eq!(list_capacity(2, P), 2 * (PER - 1) + 1);
        assert_eq!(list_pages_for(list_capacity(2, P), P), 2);
        assert_eq!(list_pages_for(list_capacity(2, P) + 1, P), 3);
        for pages in 1..40 {
            assert_eq!(list_pages_for(list_capacity(pages, P), P), pages);
            assert_eq!(list_pages_for(list_capacity(pages, P) + 1, P), pages + 1);
        }
        // Transfers: 2 MiB page aligned = 512 pages = PRP1 + 511 list entries; with an offset first
        // page it spans 513 pages = PRP1 + 512 entries; one page more needs a chained second page.
        assert_eq!(list_pages_for_transfer(2 << 20, P), 1, "2 MiB at an offset spans 513 pages: PRP1 + 512");
        assert_eq!(list_pages_for_transfer((2 << 20) + 4096, P), 2);
        assert_eq!(list_pages_for_transfer(8192, P), 1);
        assert_eq!(list_pages_for_transfer(16 << 20, P), 9); // 4096 entries: ⌈4095 / 511⌉
        let mut l = sink(2);
        for (pages_spanned, want_list_pages) in [(512, 1), (513, 1), (514, 2), (1023, 2), (1024, 2), (1025, 3)] {
            // PRP1 + (pages_spanned - 1) data entries
            let p = one(0x100_0000, pages_spanned * P, &mut l);
            match want_list_pages {
                1 | 2 => assert_eq!(p.unwrap().list_pages, want_list_pages, "{pages_spanned} pages"),
                _ => assert_eq!(
                    p,
                    Err(PrpError::OutOfEntries { index: list_capacity(2, P) + 1, capacity: list_capacity(2, P) })
                ),
            }
        }
    }

    #[test]
    fn chained_list_exact_layout() {
        // 1 + 1300 pages from an aligned start: 1300 data entries = 511 + 511 + 278 over 3 pages.
        let mut l = sink(4);
        let base = 0x1_0000_0000u64;
        let len = 1301 * P;
        let p = one(base, len, &mut l).unwrap();
        assert_eq!(p, Prps { prp1: base, prp2: LIST.0, list_entries: 1300, list_pages: 3 });
        let page_iova = |i: u64| LIST.0 + i * P as u64;
        let data = |k: u64| base + (k + 1) * P as u64; // list data entry k = page k + 1
        assert_eq!(l.entries[0][0], data(0));
        assert_eq!(l.entries[0][510], data(510));
        assert_eq!(l.entries[0][511], page_iova(1), "last slot of page 0 chains to page 1");
        assert_eq!(l.entries[1][0], data(511));
        assert_eq!(l.entries[1][510], data(1021));
        assert_eq!(l.entries[1][511], page_iova(2), "last slot of page 1 chains to page 2");
        assert_eq!(l.entries[2][0], data(1022));
        assert_eq!(l.entries[2][277], data(1299));
        assert_eq!(l.entries[2][278], 0, "nothing after the last entry");
        assert!(l.entries[3].iter().all(|&e| e == 0), "page 3 unused");
        let walked = walk(&p, &l, len, P);
        let want: Vec<u64> = (0..1301).map(|i| base + i * P as u64).collect();
        assert_eq!(walked, want);
    }

    #[test]
    fn chained_list_offset_first_page() {
        // A GPT-OSS-20B expert: 13,996,800 bytes starting 0x600 into a page: PRP1 covers 0xA00
        // bytes, then 3417 more pages (the last partial).
        let len = 13_996_800usize;
        let start = 0x2_0000_0600u64;
        let spanned = ((start % P as u64) as usize + len).div_ceil(P);
        assert_eq!(spanned, 3418);
        let mut l = sink(list_pages_for_transfer(len, P));
        assert_eq!(l.pages(), 7);
        let p = one(start, len, &mut l).unwrap();
        assert_eq!((p.prp1, p.list_entries, p.list_pages), (start, 3417, 7));
        let walked = walk(&p, &l, len, P);
        assert_eq!(walked.len(), 3418);
        assert_eq!(walked[0], start);
        for (i, &e) in walked.iter().enumerate().skip(1) {
            assert_eq!(e, start / P as u64 * P as u64 + (i * P) as u64, "entry {i}");
        }
        for pg in 0..6 {
            assert_eq!(l.entries[pg][PER - 1], LIST.0 + ((pg + 1) * P) as u64, "chain pointer of page {pg}");
        }
    }

    #[test]
    fn multi_segment() {
        let mut l = sink(1);
        let segs = [(Iova(0x1_0800), 2048), (Iova(0x5_0000), 8192), (Iova(0x9_0000), 100)];
        let p = build(&segs, P, &mut l).unwrap();
        assert_eq!(p.prp1, 0x1_0800);
        assert_eq!(&l.entries[0][..p.list_entries], &[0x5_0000, 0x5_1000, 0x9_0000]);
        // Two 2 MiB buffers in one command: 1024 entries over a chain of 3 pages.
        let mut l = sink(3);
        let segs = [(Iova(0x4000_0000), 2 << 20), (Iova(0x7000_0000), 2 << 20)];
        let p = build(&segs, P, &mut l).unwrap();
        assert_eq!((p.list_entries, p.list_pages), (1023, 2));
        let w = walk(&p, &l, 4 << 20, P);
        assert_eq!(w[511], 0x4000_0000 + 511 * 4096);
        assert_eq!(w[512], 0x7000_0000);
        assert_eq!(w[1023], 0x7000_0000 + 511 * 4096);
    }

    #[test]
    fn indexed_errors() {
        let mut l = VecSink { base: LIST, page: P, entries: vec![vec![0; PER]] };
        assert_eq!(one(0x1002, 4096, &mut l), Err(PrpError::NotDwordAligned { index: 0, addr: 0x1002 }));
        let segs = [(Iova(0x1000), 4096), (Iova(0x3004), 4092)];
        assert_eq!(build(&segs, P, &mut l), Err(PrpError::NotPageAligned { index: 1, addr: 0x3004, page: P }));
        // Previous segment ends mid-page.
        let segs = [(Iova(0x1000), 100), (Iova(0x3000), 4096)];
        assert!(matches!(build(&segs, P, &mut l), Err(PrpError::NotPageAligned { index: 1, .. })));
        let segs = [(Iova(0x1000), 4096), (Iova(0x3001), 4)];
        assert_eq!(build(&segs, P, &mut l), Err(PrpError::NotDwordAligned { index: 1, addr: 0x3001 }));
        // One page: 1 + 512 pages fit, the 514th does not.
        assert!(one(0x10_0000, 513 * 4096, &mut l).is_ok());
        assert_eq!(one(0x10_0000, 514 * 4096, &mut l), Err(PrpError::OutOfEntries { index: 513, capacity: 512 }));
        assert_eq!(one(0x10_0000, 0, &mut l), Err(PrpError::Empty));
    }

    #[test]
    fn mdts_split() {
        assert_eq!(max_transfer(None, 32 << 20), 32 << 20);
        assert_eq!(max_transfer(Some(128 << 10), 32 << 20), 128 << 10);
        assert_eq!(max_transfer(Some(64 << 20), 32 << 20), 32 << 20);
        let c: Vec<_> = split(300 << 10, 128 << 10).collect();
        assert_eq!(c, vec![(0, 128 << 10), (128 << 10, 128 << 10), (256 << 10, 44 << 10)]);
        assert_eq!(split(4096, 4096).count(), 1);
        assert_eq!(split(13_996_800, 16 << 20).count(), 1, "a GPT-OSS-20B expert is one command at MDTS 16 MiB");
    }
}
