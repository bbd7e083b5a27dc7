//! Wall time per 4 KiB read through `UringQueue` on a page-cache-hot file (buffered), at QD 1 and 32:
//! the kernel-path figure to set beside `picchio-nvme`'s `sim_cost` example (driver CPU per read).
//!
//! `cargo run --release -p picchio-blockdev --example uring_cost [MiB]`

#[cfg(target_os = "linux")]
fn main() {
    use picchio_blockdev::{UringOptions, UringQueue};
    use picchio_core::{AlignedBuf, ByteOffset, IoQueue, ReadReq, Tag};
    use std::time::Instant;

    let mib: u64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(64);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("hot.bin");
    std::fs::write(&path, vec![0x5au8; (mib << 20) as usize]).expect("write");
    let blocks = (mib << 20) / 4096;
    let n = 200_000u64;
    for qd in [1u32, 32] {
        let opts = UringOptions { qd, direct: false, sqpoll: false, iopoll: false, register_files: true };
        let mut q = UringQueue::open(&path, opts).expect("io_uring");
        let mut bufs: Vec<AlignedBuf> = (0..qd).map(|_| AlignedBuf::new(4096, 4096).expect("buf")).collect();
        let mut out = Vec::new();
        let mut g = picchio_core::rng::SplitMix64::new(0x9e37_79b9_7f4a_7c15);
        let mut next = || g.below(blocks) * 4096;
        // The file was just written, so its pages are in the page cache: time n reads, qd in flight.
        let t0 = Instant::now();
        let (mut submitted, mut done) = (0u64, 0u64);
        while done < n {
            while submitted < n && submitted - done < u64::from(qd) {
                let buf = bufs.pop().expect("free buffer");
                q.submit(ReadReq { offset: ByteOffset(next()), len: 4096, buf, tag: Tag(submitted) });
                submitted += 1;
            }
            out.clear();
            q.reap(1, &mut out);
            for c in out.drain(..) {
                assert_eq!(c.result.expect("read"), 4096);
                bufs.push(c.buf);
                done += 1;
            }
        }
        let ns = t0.elapsed().as_nanos() as f64 / n as f64;
        println!("{}: {ns:.0} ns per 4 KiB read (wall, page-cache hot, {n} reads)", q.describe());
    }
}

#[cfg(not(target_os = "linux"))]
fn main() {
    eprintln!("uring_cost: io_uring is Linux-only");
}
