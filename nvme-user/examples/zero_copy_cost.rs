//! Driver CPU per expert-sized read against the sim, on the VFIO data path: into an expert-cache slot
//! lent from the driver's DMA pool (zero-copy: PRPs from the slot's IOVAs) versus into a heap buffer
//! (every command through a per-CID bounce buffer, copied on completion).
//!
//! As in `sim_cost`, only the driver's own work is timed: `submit` and the `reap` that consumes
//! completions the sim has already posted (the copy out of the bounce buffers happens there). MDTS is
//! 128 KiB, the bounce buffers' size, so both paths issue the same commands and differ by the copy.
//! Run with `cargo run --release -p picchio-nvme --example zero_copy_cost [reads] [bytes]`
//! (default 400 reads of 2,654,208 B, one Qwen3-30B-A3B Q4 expert).

mod common;

#[cfg(target_os = "linux")]
mod linux {
    use std::time::{Duration, Instant};

    use picchio_core::{AlignedBuf, ByteOffset, IoQueue, ReadReq, Tag};
    use picchio_nvme::sim::SimConfig;
    use picchio_nvme::{HeapDma, NvmeQueue, NvmeQueueOptions};

    pub fn main() -> Result<(), Box<dyn std::error::Error>> {
        let mut args = std::env::args().skip(1);
        let reads: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(400);
        let len: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(2_654_208);
        let len = len.div_ceil(4096) * 4096;
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("ns");
        let span = 8 * len;
        std::fs::write(&path, vec![0x5a; span])?;
        println!(
            "driver CPU per {len}-byte read (submit + reap of posted completions), {reads} reads, QD 1, sim backend"
        );
        for pool in [true, false] {
            let mut cfg = SimConfig::single(&path, 4096);
            cfg.mdts = 5;
            let opts = NvmeQueueOptions { qd: 32, timeout: Duration::from_secs(5), ..Default::default() };
            let (mut q, sim) = NvmeQueue::open_sim_with(cfg, &opts, HeapDma::new(), true)?;
            let mut buf = match pool {
                true => q.slot_allocator(1, len).ok_or("no DMA pool")?.alloc(len)?,
                false => AlignedBuf::new(len, 4096)?,
            };
            let mut out = Vec::with_capacity(1);
            let (mut submit, mut reap) = (Duration::ZERO, Duration::ZERO);
            let warmup = reads / 10;
            for i in 0..reads + warmup {
                let base = sim.stats().completions;
                let c0 = q.stats().commands;
                let off = ((i % 8) * len) as u64;
                let t = Instant::now();
                q.submit(ReadReq { offset: ByteOffset(off), len: len as u32, buf, tag: Tag(i as u64) });
                let s = t.elapsed();
                // Commands beyond the queue depth are issued from reap; with 21 commands per read
                // and 32 CIDs all of them go out in submit.
                let cmds = q.stats().commands - c0;
                while sim.stats().completions < base + cmds {
                    std::hint::spin_loop();
                }
                let t = Instant::now();
                while out.is_empty() {
                    q.reap(1, &mut out);
                }
                let r = t.elapsed();
                if i >= warmup {
                    submit += s;
                    reap += r;
                }
                let c = out.pop().expect("one completion");
                c.result?;
                buf = c.buf;
            }
            let n = reads as f64;
            let st = q.stats();
            println!(
                "{}: submit {:.1} µs + reap {:.1} µs = {:.1} µs per read; {} commands per read; bounce bytes {} ({:.1} MB per read)",
                if pool { "pool slot (zero-copy)" } else { "heap buffer (bounce) " },
                submit.as_nanos() as f64 / n / 1e3,
                reap.as_nanos() as f64 / n / 1e3,
                (submit + reap).as_nanos() as f64 / n / 1e3,
                st.commands / (reads + warmup) as u64,
                st.bounce_bytes,
                st.bounce_bytes as f64 / (reads + warmup) as f64 / 1e6
            );
        }
        Ok(())
    }
}

common::linux_only_main!("zero_copy_cost", linux::main);
