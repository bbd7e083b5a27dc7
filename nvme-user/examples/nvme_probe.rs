//! Opens an NVMe controller through VFIO, initializes it, prints what Identify says, and reads LBAs
//! `0..N` of a namespace, printing an FNV-1a 64-bit hash of the bytes.
//!
//! ```text
//! nvme_probe <BDF> [NSID=1] [LBAS=256]
//! ```
//! The controller must be bound to vfio-pci, with hugepages available (`/proc/sys/vm/nr_hugepages`).
//! If `PICCHIO_NVME_IMAGE` names a file (non-empty), the bytes read are also compared with its first bytes and a
//! mismatch exits with status 1. Reads go through the interim bounce-buffer path
//! (`NvmeQueue::with_bounce_buffer`).

mod common;

common::linux_only_main!("nvme_probe", run);

#[cfg(target_os = "linux")]
fn fnv1a(h: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *h ^= u64::from(b);
        *h = h.wrapping_mul(0x0100_0000_01b3);
    }
}

#[cfg(target_os = "linux")]
fn run() -> Result<(), Box<dyn std::error::Error>> {
    use picchio_core::{AlignedBuf, ByteOffset, IoQueue, ReadReq, Tag};
    use picchio_nvme::{NvmeQueue, NvmeQueueOptions};
    use std::time::{Duration, Instant};

    let args: Vec<String> = std::env::args().collect();
    let bdf = args.get(1).ok_or("usage: nvme_probe <BDF> [NSID=1] [LBAS=256]")?;
    let nsid: u32 = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(1);
    let lbas: u64 = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(256);
    let opts = NvmeQueueOptions { nsid, qd: 32, timeout: Duration::from_secs(10) };

    let t = Instant::now();
    let ctrlr = picchio_nvme::vfio::open_controller(bdf, opts.ctrlr_options())?;
    let init_ms = t.elapsed().as_secs_f64() * 1e3;
    let id = ctrlr.identify().ok_or("no identify data")?;
    println!("controller {bdf}: CAP {:#018x} VS {} (init {init_ms:.1} ms)", ctrlr.cap().0, ctrlr.version());
    println!("  VID {:#06x} MN '{}' SN '{}' FR '{}' MDTS {} NN {}", id.vid, id.mn, id.sn, id.fr, id.mdts, id.nn);
    println!("  max transfer per command: {} bytes", ctrlr.max_transfer());
    for ns in ctrlr.namespaces() {
        println!(
            "  namespace {}: {} blocks of {} B (+{} B metadata)",
            ns.nsid, ns.blocks, ns.lba_size, ns.metadata_size
        );
    }
    let mut q = NvmeQueue::with_bounce_buffer(ctrlr, nsid, opts.timeout, format!("vfio {bdf}"))?;
    let ns = q.namespace();
    let lbas = lbas.min(ns.blocks);
    let total = lbas * u64::from(ns.lba_size);
    let chunk = 128u64 << 10;
    let mut data = vec![0u8; total as usize];
    let t = Instant::now();
    let mut out = Vec::new();
    let mut off = 0u64;
    while off < total || q.in_flight() > 0 {
        while off < total && q.in_flight() < 32 {
            let len = chunk.min(total - off) as u32;
            q.submit(ReadReq {
                offset: ByteOffset(off),
                len,
                buf: AlignedBuf::new(len as usize, 4096)?,
                tag: Tag(off),
            });
            off += u64::from(len);
        }
        q.reap(1, &mut out);
        for c in out.drain(..) {
            let n = c.result? as usize;
            data[c.tag.0 as usize..c.tag.0 as usize + n].copy_from_slice(&c.buf.as_slice()[..n]);
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    fnv1a(&mut h, &data);
    let head: String = data.iter().take(16).map(|b| format!("{b:02x}")).collect();
    println!("{}: read LBA 0..{lbas} ({total} bytes) in {:.1} ms", q.describe(), secs * 1e3);
    println!("fnv1a64 {h:016x}  first16 {head}");
    println!("stats {:?}", q.stats());
    if let Some(img) = std::env::var("PICCHIO_NVME_IMAGE").ok().filter(|s| !s.is_empty()) {
        let want = std::fs::read(&img)?;
        let n = want.len().min(data.len());
        if want[..n] != data[..n] {
            let first = (0..n).find(|&i| want[i] != data[i]).unwrap_or(0);
            return Err(format!("bytes differ from {img} (first difference at byte {first:#x})").into());
        }
        println!("matches the first {n} bytes of {img}");
    }
    Ok(())
}
