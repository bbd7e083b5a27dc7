//! The NVMe completion queue entry (§4.6) as the driver consumes it: a queue pair on heap DMA
//! memory with every command identifier outstanding, and a fuzzed "device" that writes the input,
//! 16 bytes at a time, into the completion ring as a controller would (DMA into the CQ at
//! increasing slots, whatever the phase tag, CID, SQ head or status says). After each entry the
//! driver polls; completions of unknown or already-completed CIDs must be errors, never a panic,
//! a double completion or a lost command. Each entry's status is also decoded and named.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use picchio_nvme::spec::{nvm, Command, Completion, Lba, Status};
use picchio_nvme::{Bar, HeapDma, QueuePair};

/// A register window that accepts doorbell writes and reads zeros (the fuzzed device acts through
/// DMA only).
struct NullBar;
impl Bar for NullBar {
    fn read32(&self, _: usize) -> u32 {
        0
    }
    fn read64(&self, _: usize) -> u64 {
        0
    }
    fn write32(&self, _: usize, _: u32) {}
    fn write64(&self, _: usize, _: u64) {}
    fn kind(&self) -> &'static str {
        "fuzz"
    }
}

/// Submits a Read for every free CID (the fuzzed device never executes them).
fn fill(q: &mut QueuePair, next_user: &mut u64) {
    while let Some(cid) = q.alloc_cid() {
        *next_user += 1;
        // SAFETY: no device executes this command: the fuzzed device only writes completion
        // entries and never reads the submission ring, so PRP1 = 0 is never used as an address.
        let r = unsafe { q.submit(cid, *next_user, |c| *c = Command::rw(nvm::READ, cid.0, 1, Lba(0), 1)) };
        if r.is_err() {
            // The fuzzed SQ head says the ring is full: a clear error; the CID goes back.
            q.release_cid(cid);
            break;
        }
    }
    q.ring();
}

fuzz_target!(|data: &[u8]| {
    let Some((&size, entries)) = data.split_first() else { return };
    let dma = HeapDma::new();
    let ring = 2 + u16::from(size % 31);
    let mut q = QueuePair::new(Arc::new(NullBar), &dma, 1, ring, 0).expect("queue pair");
    let registry = dma.registry();
    let mut next_user = 0;
    fill(&mut q, &mut next_user);
    for (k, raw) in entries.chunks_exact(16).take(512).enumerate() {
        let raw: [u8; 16] = raw.try_into().expect("16 bytes");
        // Decode the way the driver does: the entry's own layout (little-endian words).
        let w = |i: usize| u32::from_le_bytes(raw[i * 4..i * 4 + 4].try_into().expect("4"));
        let cqe = Completion {
            dw0: w(0),
            dw1: w(1),
            sqhd: w(2) as u16,
            sqid: (w(2) >> 16) as u16,
            cid: w(3) as u16,
            status: (w(3) >> 16) as u16,
        };
        let st = cqe.status();
        assert_eq!(Status::from_field(st.to_field(cqe.phase())), st, "status round trip");
        let _ = (st.name(), st.to_string(), st.is_success());
        // The device's DMA write of slot k into the completion ring.
        let addr = q.cq_iova().0 + (k % usize::from(ring)) as u64 * 16;
        registry
            .with_range(addr, 16, || {
                // SAFETY: `addr..addr + 16` lies inside the live CQ allocation (checked by the
                // registry, which holds its lock while we write); the driver keeps no reference to
                // ring memory and reads it only with volatile reads, on this thread, after this write.
                unsafe { std::ptr::write_volatile(addr as *mut [u8; 16], raw) }
            })
            .expect("the CQ is registered");
        let before = q.outstanding();
        let mut seen = Vec::new();
        let r = q.poll(usize::from(ring), |e| seen.push(e.cid));
        for cid in &seen {
            assert!(!q.is_busy(*cid), "a delivered completion frees its CID");
        }
        assert_eq!(q.outstanding() + seen.len(), before, "every completion accounted once");
        let _ = r.map_err(|e| e.to_string());
        assert!(q.outstanding() <= q.capacity());
        fill(&mut q, &mut next_user);
    }
});
