//! A submission/completion queue pair (§3.3.1): rings in DMA memory, one tracker per command
//! identifier, in-place SQE construction, doorbells once per batch, completions polled by phase tag.
//!
//! Ownership of ring slots: SQ slots from the device's head to our tail belong to the device once the
//! tail doorbell covers them; the slot at our tail is ours until then. CQ slots belong to the device
//! until their phase tag flips to the value we expect; we hand them back with the CQ head doorbell.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bar::{Bar, Doorbells};
use crate::dma::{DmaBuf, DmaPool, Iova, PAGE};
use crate::error::{Error, Result};
use crate::prp::{self, PrpError, PrpSink, Prps};
use crate::spec::{Command, Completion};

/// A command identifier: the index of the tracker that owns the command.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cid(pub u16);

/// Memory ordering between DMA memory and doorbells, in one place.
pub mod fence {
    use std::sync::atomic::{fence, Ordering};

    /// Before a doorbell write: every SQE (and PRP list) store must be visible to the device first.
    /// x86 keeps stores in order (TSO) and the doorbell is an uncached MMIO store, so a compiler
    /// barrier suffices there; elsewhere a full fence stands in for a DMA write barrier.
    #[inline(always)]
    pub fn publish() {
        if cfg!(any(target_arch = "x86_64", target_arch = "x86")) {
            fence(Ordering::Release);
        } else {
            fence(Ordering::SeqCst);
        }
    }

    /// After observing a new phase tag: the rest of the CQE (and the data it covers) is read after.
    #[inline(always)]
    pub fn consume() {
        fence(Ordering::Acquire);
    }
}

/// One completion handed to [`QueuePair::poll`]'s callback.
#[derive(Clone, Copy, Debug)]
pub struct CqEntry {
    /// The command's identifier.
    pub cid: Cid,
    /// The caller's value given at submission.
    pub user: u64,
    /// The entry as the device wrote it.
    pub cqe: Completion,
    /// The command had already been reported as timed out by [`QueuePair::expire`].
    pub late: bool,
}

/// A command that was outstanding when its queue was reset ([`QueuePair::reset_rings`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lost {
    /// Its identifier.
    pub cid: Cid,
    /// The caller's value given at submission.
    pub user: u64,
    /// Whether [`QueuePair::expire`] had reported it as timed out.
    pub timed_out: bool,
}

/// Counters of one queue pair.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Commands submitted.
    pub submitted: u64,
    /// Completions consumed.
    pub completed: u64,
    /// SQ tail doorbell writes.
    pub sq_doorbells: u64,
    /// CQ head doorbell writes.
    pub cq_doorbells: u64,
    /// Polls that found nothing.
    pub idle_polls: u64,
    /// Commands that timed out.
    pub timeouts: u64,
    /// Completions of already timed-out commands.
    pub late: u64,
}

struct Tracker {
    busy: bool,
    timed_out: bool,
    user: u64,
    started: Instant,
    /// This tracker's PRP-list pages (contiguous, chained by the builder); their IOVAs never change.
    prp_list: DmaBuf,
}

/// A tracker's list pages as a [`PrpSink`]: page `p` at byte `p · PAGE` of one DMA buffer.
struct ListSink<'a>(&'a mut DmaBuf);

impl PrpSink for ListSink<'_> {
    fn pages(&self) -> usize {
        self.0.len() / PAGE
    }
    fn page_iova(&self, p: usize) -> Iova {
        self.0.iova().add((p * PAGE) as u64)
    }
    fn set(&mut self, p: usize, i: usize, v: u64) {
        self.0.write::<u64>(p * PAGE + i * 8, v);
    }
}

/// A submission queue and its completion queue, polled (no interrupts).
pub struct QueuePair {
    qid: u16,
    entries: u16,
    sq: DmaBuf,
    cq: DmaBuf,
    sq_tail: u16,
    sq_head: u16,
    cq_head: u16,
    phase: bool,
    unrung: u16,
    db: Doorbells,
    bar: Arc<dyn Bar>,
    trackers: Vec<Tracker>,
    free: Vec<u16>,
    outstanding: usize,
    stats: QueueStats,
}

impl QueuePair {
    /// Allocates rings of `entries` slots (2..=4096) and `entries - 1` trackers, each with PRP-list
    /// pages for transfers of up to 2 MiB (see [`QueuePair::with_max_transfer`] for more).
    ///
    /// # Errors
    /// [`Error::DmaAlloc`], or [`Error::Unsupported`] for a bad size.
    pub fn new(bar: Arc<dyn Bar>, dma: &dyn DmaPool, qid: u16, entries: u16, dstrd: u8) -> Result<Self> {
        Self::with_max_transfer(bar, dma, qid, entries, dstrd, PAGE * (PAGE / 8))
    }

    /// As [`QueuePair::new`], with each tracker's PRP list sized for commands of up to `max_transfer`
    /// bytes at any dword offset: [`prp::list_pages_for_transfer`] chained pages per CID (9 pages,
    /// 36 KiB, for 16 MiB), allocated once, so a command never needs an allocation.
    ///
    /// # Errors
    /// As [`QueuePair::new`].
    pub fn with_max_transfer(
        bar: Arc<dyn Bar>,
        dma: &dyn DmaPool,
        qid: u16,
        entries: u16,
        dstrd: u8,
        max_transfer: usize,
    ) -> Result<Self> {
        let list_pages = prp::list_pages_for_transfer(max_transfer, PAGE);
        if !(2..=4096).contains(&entries) {
            return Err(Error::Unsupported { what: format!("queue {qid}: {entries} entries (2..=4096)") });
        }
        let n = usize::from(entries);
        let sq = dma.alloc(n * 64)?;
        let cq = dma.alloc(n * 16)?;
        let trackers = (0..n - 1)
            .map(|_| {
                Ok(Tracker {
                    busy: false,
                    timed_out: false,
                    user: 0,
                    started: Instant::now(),
                    prp_list: dma.alloc(list_pages * PAGE)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let free = (0..(n - 1) as u16).rev().collect();
        Ok(QueuePair {
            qid,
            entries,
            sq,
            cq,
            sq_tail: 0,
            sq_head: 0,
            cq_head: 0,
            phase: true,
            unrung: 0,
            db: Doorbells { dstrd },
            bar,
            trackers,
            free,
            outstanding: 0,
            stats: QueueStats::default(),
        })
    }

    /// Queue identifier (0 = admin).
    pub fn qid(&self) -> u16 {
        self.qid
    }
    /// Ring slots.
    pub fn entries(&self) -> u16 {
        self.entries
    }
    /// Commands that may be outstanding at once (`entries - 1`).
    pub fn capacity(&self) -> usize {
        self.trackers.len()
    }
    /// Commands submitted and not completed (including timed-out ones not yet completed).
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }
    /// IOVA of the submission ring.
    pub fn sq_iova(&self) -> Iova {
        self.sq.iova()
    }
    /// IOVA of the completion ring.
    pub fn cq_iova(&self) -> Iova {
        self.cq.iova()
    }
    /// Counters.
    pub fn stats(&self) -> QueueStats {
        self.stats
    }

    /// Takes a free command identifier.
    pub fn alloc_cid(&mut self) -> Option<Cid> {
        self.free.pop().map(Cid)
    }

    /// Returns an identifier taken with [`QueuePair::alloc_cid`] but never submitted.
    pub fn release_cid(&mut self, cid: Cid) {
        debug_assert!(!self.trackers[usize::from(cid.0)].busy);
        self.free.push(cid.0);
    }

    /// Builds the PRPs of a transfer for command `cid`, using its tracker's (chained) list pages.
    ///
    /// # Errors
    /// [`PrpError`] with the offending entry's index ([`PrpError::OutOfEntries`] beyond the
    /// `max_transfer` the queue was sized for).
    pub fn prps(&mut self, cid: Cid, segments: &[(Iova, usize)]) -> std::result::Result<Prps, PrpError> {
        let t = &mut self.trackers[usize::from(cid.0)];
        prp::build(segments, PAGE, &mut ListSink(&mut t.prp_list))
    }

    /// PRP-list pages per command identifier.
    pub fn list_pages(&self) -> usize {
        self.trackers.first().map_or(0, |t| t.prp_list.len() / PAGE)
    }

    /// Writes command `cid` into the SQ slot at the tail (zeroed, CID set, then `build`), and moves
    /// the tail. The device sees it at the next [`QueuePair::ring`].
    ///
    /// # Errors
    /// [`Error::QueueFull`] if the ring has no free slot (cannot happen with CIDs from `alloc_cid`).
    ///
    /// # Safety
    /// The device executes the command as written. Every address it carries (PRP1, PRP2 and the
    /// PRP list they lead to, MPTR) must lie in memory mapped for the device — a [`DmaBuf`], a
    /// pool slot, or a buffer lent with [`DmaPool::map_external`] — that the caller keeps allocated,
    /// mapped and otherwise untouched until this command's completion is consumed by
    /// [`QueuePair::poll`] or the controller is disabled (CSTS.RDY = 0). Build data pointers with
    /// [`QueuePair::prps`]. Without an IOMMU (no-IOMMU mode) a wrong address is a DMA into arbitrary
    /// physical memory; with one, an IOMMU fault. The safe way to read and write is
    /// [`NvmeQueue`](crate::NvmeQueue).
    pub unsafe fn submit(&mut self, cid: Cid, user: u64, build: impl FnOnce(&mut Command)) -> Result<()> {
        let next = (self.sq_tail + 1) % self.entries;
        if next == self.sq_head {
            return Err(Error::QueueFull { qid: self.qid, depth: self.entries });
        }
        let slot = self.sq.ptr_at(usize::from(self.sq_tail) * 64).cast::<Command>();
        // SAFETY: the slot at the tail is inside the ring (64-byte aligned in a page-aligned buffer)
        // and host-owned: the device reads only slots between its head and the last tail we rang,
        // and `next != sq_head` shows this slot is not among them. No other reference to it exists;
        // the `&mut` ends before the doorbell publishes the slot.
        let cmd = unsafe {
            slot.write(Command::new(0, cid.0));
            &mut *slot
        };
        build(cmd);
        cmd.set_cid(cid.0);
        let t = &mut self.trackers[usize::from(cid.0)];
        debug_assert!(!t.busy, "CID {} submitted twice", cid.0);
        t.busy = true;
        t.timed_out = false;
        t.user = user;
        t.started = Instant::now();
        self.sq_tail = next;
        self.unrung += 1;
        self.outstanding += 1;
        self.stats.submitted += 1;
        Ok(())
    }

    /// Rings the SQ tail doorbell if commands were written since the last ring (once per batch).
    pub fn ring(&mut self) {
        if self.unrung > 0 {
            fence::publish();
            self.db.sq_tail(&*self.bar, self.qid, self.sq_tail);
            self.unrung = 0;
            self.stats.sq_doorbells += 1;
        }
    }

    /// Consumes up to `max` new completions (phase tag = expected phase), calling `f` for each, then
    /// rings the CQ head doorbell once. Returns how many were consumed.
    ///
    /// # Errors
    /// [`Error::UnknownCid`] if an entry names a CID with no outstanding command; the entry is
    /// consumed, the others in the batch are still delivered.
    pub fn poll(&mut self, max: usize, mut f: impl FnMut(CqEntry)) -> Result<usize> {
        let mut n = 0;
        let mut unknown = None;
        while n < max {
            let off = usize::from(self.cq_head) * 16;
            let status: u16 = self.cq.read(off + Completion::STATUS_OFFSET);
            if (status & 1 != 0) != self.phase {
                break;
            }
            fence::consume();
            let cqe: Completion = self.cq.read(off);
            self.cq_head += 1;
            if self.cq_head == self.entries {
                self.cq_head = 0;
                self.phase = !self.phase;
            }
            self.sq_head = cqe.sqhd % self.entries;
            n += 1;
            match self.trackers.get_mut(usize::from(cqe.cid)) {
                Some(t) if t.busy => {
                    t.busy = false;
                    let late = t.timed_out;
                    self.free.push(cqe.cid);
                    self.outstanding -= 1;
                    self.stats.completed += 1;
                    if late {
                        self.stats.late += 1;
                    }
                    f(CqEntry { cid: Cid(cqe.cid), user: t.user, cqe, late });
                }
                _ => {
                    unknown.get_or_insert(Error::UnknownCid {
                        qid: self.qid,
                        cid: cqe.cid,
                        sqhd: cqe.sqhd,
                        status: cqe.status(),
                    });
                }
            }
        }
        if n > 0 {
            self.db.cq_head(&*self.bar, self.qid, self.cq_head);
            self.stats.cq_doorbells += 1;
        } else {
            self.stats.idle_polls += 1;
        }
        match unknown {
            Some(e) => Err(e),
            None => Ok(n),
        }
    }

    /// Marks commands outstanding longer than `timeout` as timed out and calls `f(cid, user)` once for
    /// each. Their CIDs stay taken until a (late) completion arrives, so a slow device can never
    /// complete a reused identifier. Returns how many expired.
    pub fn expire(&mut self, timeout: Duration, mut f: impl FnMut(Cid, u64)) -> usize {
        let now = Instant::now();
        let mut n = 0;
        for (i, t) in self.trackers.iter_mut().enumerate() {
            if t.busy && !t.timed_out && now.duration_since(t.started) >= timeout {
                t.timed_out = true;
                n += 1;
                f(Cid(i as u16), t.user);
            }
        }
        self.stats.timeouts += n as u64;
        n
    }

    /// Whether command `cid` is outstanding (submitted, no completion consumed yet).
    pub fn is_busy(&self, cid: Cid) -> bool {
        self.trackers.get(usize::from(cid.0)).is_some_and(|t| t.busy)
    }

    /// Returns the rings to their state at creation, for a controller reset (§3.7.2: a reset deletes
    /// every I/O queue; the admin queue restarts from AQA/ASQ/ACQ): both rings zeroed, SQ tail, SQ
    /// head and CQ head 0, expected phase 1, every tracker free. The DMA memory (rings, PRP lists)
    /// and its IOVAs stay, so the queue is re-created on the same memory.
    ///
    /// Call only after the controller is disabled (CSTS.RDY = 0), when it no longer reads or writes
    /// the rings. Returns the commands that were outstanding — they will never complete — as
    /// [`Lost`], in CID order.
    pub fn reset_rings(&mut self) -> Vec<Lost> {
        self.sq.zero();
        self.cq.zero();
        self.sq_tail = 0;
        self.sq_head = 0;
        self.cq_head = 0;
        self.phase = true;
        self.unrung = 0;
        let mut lost = Vec::new();
        for (i, t) in self.trackers.iter_mut().enumerate() {
            if t.busy {
                lost.push(Lost { cid: Cid(i as u16), user: t.user, timed_out: t.timed_out });
                t.busy = false;
                t.timed_out = false;
            }
        }
        self.free = (0..self.trackers.len() as u16).rev().collect();
        self.outstanding = 0;
        lost
    }

    /// Outstanding commands that have not timed out, as `(cid, user)`.
    pub fn pending(&self) -> impl Iterator<Item = (Cid, u64)> + '_ {
        self.trackers.iter().enumerate().filter(|(_, t)| t.busy && !t.timed_out).map(|(i, t)| (Cid(i as u16), t.user))
    }
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qid", &self.qid)
            .field("entries", &self.entries)
            .field("sq_tail", &self.sq_tail)
            .field("cq_head", &self.cq_head)
            .field("outstanding", &self.outstanding)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::HeapDma;
    use crate::spec::Status;
    use std::sync::Mutex;

    /// Records doorbell writes.
    #[derive(Default)]
    struct FakeBar(Mutex<Vec<(usize, u32)>>);
    impl Bar for FakeBar {
        fn read32(&self, _: usize) -> u32 {
            0
        }
        fn read64(&self, _: usize) -> u64 {
            0
        }
        fn write32(&self, off: usize, v: u32) {
            self.0.lock().unwrap().push((off, v));
        }
        fn write64(&self, _: usize, _: u64) {}
        fn kind(&self) -> &'static str {
            "fake"
        }
    }

    /// I/O queue pair 1 of `entries` entries in heap DMA memory, on a fake BAR (returned too, to
    /// inspect the doorbell writes).
    fn fake_pair(entries: u16) -> (Arc<FakeBar>, QueuePair) {
        let bar = Arc::new(FakeBar::default());
        let q = QueuePair::new(bar.clone(), &HeapDma::new(), 1, entries, 0).unwrap();
        (bar, q)
    }

    /// Posts a CQE the way a device would (raw write into the CQ ring).
    fn post(q: &mut QueuePair, slot: u16, cid: u16, sqhd: u16, phase: bool) {
        let c = Completion { dw0: 0, dw1: 0, sqhd, sqid: q.qid, cid, status: Status::SUCCESS.to_field(phase) };
        q.cq.write(usize::from(slot) * 16, c);
    }

    #[test]
    fn submit_builds_in_place_and_rings_once_per_batch() {
        let (bar, mut q) = fake_pair(4);
        assert_eq!(q.capacity(), 3);
        let a = q.alloc_cid().unwrap();
        let b = q.alloc_cid().unwrap();
        // SAFETY: (these tests) the fake BAR is no device; nothing executes the commands.
        unsafe { q.submit(a, 10, |c| *c = Command::rw(2, 999, 1, crate::spec::Lba(5), 1)) }.unwrap();
        // SAFETY: as above.
        unsafe { q.submit(b, 11, |c| c.nsid = 1) }.unwrap();
        let c0: Command = q.sq.read(0);
        assert_eq!((c0.opc(), c0.cid(), c0.slba().0), (2, a.0, 5), "CID forced to the tracker's");
        let c1: Command = q.sq.read(64);
        assert_eq!(c1.cid(), b.0);
        assert!(bar.0.lock().unwrap().is_empty());
        q.ring();
        q.ring();
        assert_eq!(*bar.0.lock().unwrap(), vec![(0x1008, 2)]);
    }

    #[test]
    fn poll_by_phase_wraps_and_rejects_unknown_cid() {
        let (_, mut q) = fake_pair(4);
        let mut seen = vec![];
        for round in 0..3u16 {
            let cids: Vec<Cid> = (0..3).map(|_| q.alloc_cid().unwrap()).collect();
            assert!(q.alloc_cid().is_none(), "3 trackers for 4 slots");
            for (i, &c) in cids.iter().enumerate() {
                // SAFETY: the fake BAR is no device; nothing executes the command.
                unsafe { q.submit(c, u64::from(round * 10) + i as u64, |_| {}) }.unwrap();
            }
            q.ring();
            assert_eq!(q.poll(8, |_| panic!("nothing posted")).unwrap(), 0);
            // The device completes in reverse order; CQ slots continue round-robin with phase flips.
            for (k, &c) in cids.iter().rev().enumerate() {
                let slot = (round * 3 + k as u16) % 4;
                let phase = ((round * 3 + k as u16) / 4).is_multiple_of(2);
                post(&mut q, slot, c.0, (round * 3 + 3) % 4, phase);
            }
            assert_eq!(q.poll(8, |e| seen.push(e.user)).unwrap(), 3);
        }
        assert_eq!(seen, vec![2, 1, 0, 12, 11, 10, 22, 21, 20]);
        assert_eq!(q.outstanding(), 0);
        // Unknown CID: posted for CID 2 while nothing is outstanding.
        post(&mut q, 1, 2, 0, true);
        assert!(matches!(q.poll(8, |_| {}), Err(Error::UnknownCid { qid: 1, cid: 2, .. })));
        let s = q.stats();
        assert_eq!((s.submitted, s.completed, s.cq_doorbells), (9, 9, 4));
    }

    #[test]
    fn timeouts_keep_cid_until_late_completion() {
        let (_, mut q) = fake_pair(2);
        let c = q.alloc_cid().unwrap();
        // SAFETY: the fake BAR is no device; nothing executes the command.
        unsafe { q.submit(c, 7, |_| {}) }.unwrap();
        q.ring();
        let mut expired = vec![];
        assert_eq!(q.expire(Duration::ZERO, |c, u| expired.push((c, u))), 1);
        assert_eq!(q.expire(Duration::ZERO, |_, _| panic!("reported twice")), 0);
        assert_eq!(expired, vec![(c, 7)]);
        assert!(q.alloc_cid().is_none(), "timed-out CID stays taken");
        post(&mut q, 0, c.0, 1, true);
        let mut late = false;
        q.poll(1, |e| late = e.late).unwrap();
        assert!(late);
        assert_eq!(q.alloc_cid(), Some(c));
    }

    #[test]
    fn reset_rings_frees_every_tracker_and_restarts_the_phase() {
        let (_, mut q) = fake_pair(4);
        let (sq, cq) = (q.sq_iova(), q.cq_iova());
        // Two commands complete (CQ slots 0 and 1 now hold entries with phase 1), two stay outstanding.
        for round in 0..2u16 {
            let c = q.alloc_cid().unwrap();
            // SAFETY: the fake BAR is no device; nothing executes the command.
            unsafe { q.submit(c, 0, |_| {}) }.unwrap();
            q.ring();
            post(&mut q, round, c.0, round + 1, true);
            assert_eq!(q.poll(1, |_| {}).unwrap(), 1);
        }
        let a = q.alloc_cid().unwrap();
        let b = q.alloc_cid().unwrap();
        // SAFETY: the fake BAR is no device; nothing executes the commands.
        unsafe { q.submit(a, 70, |_| {}) }.unwrap();
        // SAFETY: as above.
        unsafe { q.submit(b, 71, |_| {}) }.unwrap();
        q.ring();
        q.expire(Duration::ZERO, |_, _| {});
        let lost = q.reset_rings();
        let mut want = vec![Lost { cid: a, user: 70, timed_out: true }, Lost { cid: b, user: 71, timed_out: true }];
        want.sort_by_key(|l| l.cid);
        assert_eq!(lost, want);
        assert_eq!((q.outstanding(), q.sq_iova(), q.cq_iova()), (0, sq, cq), "same memory");
        assert!(!q.is_busy(a) && !q.is_busy(b));
        // The stale CQE left in slot 0 (phase 1) must not be seen as new: the ring was zeroed.
        assert_eq!(q.poll(8, |_| panic!("stale entry")).unwrap(), 0);
        // Fresh start: slot 0, phase 1.
        let c = q.alloc_cid().unwrap();
        // SAFETY: the fake BAR is no device; nothing executes the command.
        unsafe { q.submit(c, 5, |_| {}) }.unwrap();
        q.ring();
        let first: Command = q.sq.read(0);
        assert_eq!(first.cid(), c.0, "the first command after a reset goes to SQ slot 0");
        post(&mut q, 0, c.0, 1, true);
        let mut users = vec![];
        q.poll(8, |e| users.push(e.user)).unwrap();
        assert_eq!(users, vec![5]);
        assert_eq!(q.capacity(), 3);
    }

    #[test]
    fn prps_use_the_trackers_list_page() {
        let (_, mut q) = fake_pair(4);
        let c = q.alloc_cid().unwrap();
        let p = q.prps(c, &[(Iova(0x10_0000), 4 * 4096)]).unwrap();
        let list = &q.trackers[usize::from(c.0)].prp_list;
        assert_eq!(p.prp2, list.iova().0);
        assert_eq!(list.read::<u64>(16), 0x10_3000);
        assert_eq!(q.list_pages(), 1, "2 MiB at any offset: PRP1 + 512 list entries");
    }

    #[test]
    fn chained_list_pages_in_dma_memory() {
        let bar = Arc::new(FakeBar::default());
        let dma = HeapDma::new();
        let mut q = QueuePair::with_max_transfer(bar, &dma, 1, 4, 0, 16 << 20).unwrap();
        assert_eq!(q.list_pages(), 9);
        let c = q.alloc_cid().unwrap();
        let base = 0x4000_0000u64;
        let p = q.prps(c, &[(Iova(base), 16 << 20)]).unwrap();
        assert_eq!((p.list_entries, p.list_pages), (4095, 9));
        let list = &q.trackers[usize::from(c.0)].prp_list;
        for pg in 0..8 {
            let ptr: u64 = list.read(pg * PAGE + (PAGE - 8));
            assert_eq!(ptr, list.iova().0 + ((pg + 1) * PAGE) as u64, "chain pointer of list page {pg}");
        }
        // Data entry k (PRP entry k + 1) of page pg, slot s: k = pg * 511 + s.
        let first_of_page_8: u64 = list.read(8 * PAGE);
        assert_eq!(first_of_page_8, base + (8 * 511 + 1) * 4096);
        let last: u64 = list.read(8 * PAGE + (4095 - 8 * 511 - 1) * 8);
        assert_eq!(last, base + 4095 * 4096);
        // 9 chained pages hold 9 · 511 + 1 = 4600 list entries: 4601 pages (PRP1 + 4600) fit, 4602 do not.
        assert_eq!(q.prps(c, &[(Iova(base), 4601 * 4096)]).unwrap().list_entries, 4600);
        assert_eq!(
            q.prps(c, &[(Iova(base), 4602 * 4096)]),
            Err(PrpError::OutOfEntries { index: 4601, capacity: 4600 })
        );
    }
}
