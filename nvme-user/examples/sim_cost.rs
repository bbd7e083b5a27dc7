//! Driver CPU cost per 4 KiB read against the sim, at QD 1 and QD 32.
//!
//! Only the driver's own work is timed: `submit` (validate, lend the buffer, build the SQE and PRPs,
//! ring the doorbell) and the `reap` that consumes completions the sim has *already* posted (poll by
//! phase, CQ doorbell, finish the request). The wait for the sim thread in between is not timed.
//! Run with `cargo run --release -p picchio-nvme --example sim_cost [reads]`.

mod common;

#[cfg(target_os = "linux")]
mod linux {

    use std::time::{Duration, Instant};

    use picchio_core::{AlignedBuf, ByteOffset, IoQueue, ReadReq, Tag};
    use picchio_nvme::sim::SimConfig;
    use picchio_nvme::{NvmeQueue, NvmeQueueOptions};

    pub fn main() -> Result<(), Box<dyn std::error::Error>> {
        let reads: usize = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(200_000);
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("ns");
        std::fs::write(&path, vec![0x5a; 64 << 20])?;
        println!("driver CPU per 4 KiB read (submit + reap of posted completions), {reads} reads, sim backend");
        for qd in [1u16, 32] {
            let opts = NvmeQueueOptions { qd, timeout: Duration::from_secs(5), ..Default::default() };
            let (mut q, sim) = NvmeQueue::open_sim(SimConfig::single(&path, 4096), &opts)?;
            let mut bufs: Vec<AlignedBuf> = (0..qd).map(|_| AlignedBuf::new(4096, 4096)).collect::<Result<_, _>>()?;
            let mut out = Vec::with_capacity(usize::from(qd));
            let (mut submit, mut reap) = (Duration::ZERO, Duration::ZERO);
            let mut done = 0usize;
            let mut next = 0u64;
            let warmup = reads / 10;
            while done < reads + warmup {
                let base = sim.stats().completions;
                let t = Instant::now();
                for buf in bufs.drain(..) {
                    let off = (next % 16384) * 4096;
                    next += 1;
                    q.submit(ReadReq { offset: ByteOffset(off), len: 4096, buf, tag: Tag(next) });
                }
                let s = t.elapsed();
                while sim.stats().completions < base + u64::from(qd) {
                    std::hint::spin_loop();
                }
                let t = Instant::now();
                while out.len() < usize::from(qd) {
                    q.reap(usize::from(qd) - out.len(), &mut out);
                }
                let r = t.elapsed();
                if done >= warmup {
                    submit += s;
                    reap += r;
                }
                done += usize::from(qd);
                for c in out.drain(..) {
                    c.result?;
                    bufs.push(c.buf);
                }
            }
            let n = (done - warmup) as f64;
            println!(
                "{}: submit {:.0} ns + reap {:.0} ns = {:.0} ns per read",
                q.describe(),
                submit.as_nanos() as f64 / n,
                reap.as_nanos() as f64 / n,
                (submit + reap).as_nanos() as f64 / n
            );
        }
        Ok(())
    }
}

common::linux_only_main!("sim_cost", linux::main);
