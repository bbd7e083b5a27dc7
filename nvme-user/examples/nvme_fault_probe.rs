//! Driver checks against a real (or QEMU-emulated) controller that the VM harness (tests/vm) runs
//! as separate counted checks, because each needs something a libtest binary should not do on its
//! own: a device with a large MDTS, a controller reset mid-run, or a deliberate DMA fault.
//!
//! ```text
//! nvme_fault_probe <BDF> chained-prp [NSID=1]   one Read of 4 MiB (MDTS permitting) into 1 MiB
//!                                               of each of four 2 MiB hugepage chunks: PRP1 +
//!                                               1023 entries on a chain of 3 PRP-list pages;
//!                                               bytes checked against $PICCHIO_NVME_IMAGE (then
//!                                               zeros)
//! nvme_fault_probe <BDF> reset [NSID=1]         read, Abort of an idle CID (must say "not
//!                                               aborted"), controller reset (CC.EN = 0, RDY = 0,
//!                                               bring-up again on the same DMA memory), read again
//! nvme_fault_probe <BDF> stray-dma [IOVA]       fault injection: a Read whose PRP1 is an IOVA that
//!                                               is not mapped (default 0x40000000); IOMMU only
//! ```
//! Exit status 0 = passed, 1 = failed, 77 = not applicable here (e.g. MDTS below 4 MiB), with a
//! reason on stderr. Needs the controller bound to vfio-pci and 2 MiB hugepages; built only with the
//! crate's `fault-injection` feature (`Controller::submit_raw_for_fault_test`).

#[cfg(target_os = "linux")]
fn main() {
    match run() {
        Ok(()) => {}
        Err(Outcome::Skip(why)) => {
            eprintln!("not applicable: {why}");
            std::process::exit(77);
        }
        Err(Outcome::Fail(why)) => {
            eprintln!("FAILED: {why}");
            std::process::exit(1);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn main() {
    eprintln!("nvme_fault_probe needs Linux VFIO");
    std::process::exit(1);
}

#[cfg(target_os = "linux")]
enum Outcome {
    Skip(String),
    Fail(String),
}

#[cfg(target_os = "linux")]
impl<E: std::fmt::Display> From<E> for Outcome {
    fn from(e: E) -> Self {
        Outcome::Fail(e.to_string())
    }
}

#[cfg(target_os = "linux")]
use picchio_nvme::{dma::DmaBuf, spec::Status, Controller, Iova};

/// Opens `bdf` through VFIO like `vfio::open_controller`, and says whether it is a no-IOMMU group.
#[cfg(target_os = "linux")]
fn open(bdf: &str) -> Result<(Controller, bool), Outcome> {
    use picchio_nvme::vfio::VfioDevice;
    use std::sync::Arc;
    // VFIO errors keep their OS error as `source()`: print it too.
    let fail = |e: picchio_nvme::Error| Outcome::Fail(picchio_core::error::chain(&e).to_string());
    let dev = Arc::new(VfioDevice::open(bdf).map_err(fail)?);
    dev.enable_bus_master().map_err(fail)?;
    let bar = Arc::new(dev.map_bar0().map_err(fail)?);
    let dma = Arc::new(dev.dma());
    let noiommu = dev.noiommu();
    let c = Controller::init(bar, dma, picchio_nvme::CtrlrOptions::default())?;
    Ok((c, noiommu))
}

/// One NVM Read of `blocks` LBAs at `slba` into `segments`, PRPs built by the driver (chained when
/// long); returns the completion status.
#[cfg(target_os = "linux")]
fn read(c: &mut Controller, nsid: u32, slba: u64, blocks: u32, segments: &[(Iova, usize)]) -> Result<Status, Outcome> {
    use picchio_nvme::spec::{nvm, Command, Lba};
    use std::time::{Duration, Instant};
    let q = c.io_queue().ok_or("no I/O queue")?;
    let cid = q.alloc_cid().ok_or("no free CID")?;
    let prps = q.prps(cid, segments)?;
    eprintln!(
        "Read {blocks} LBAs at {slba}: PRP1 {:#x}, PRP2 {:#x}, {} list entries on {} list page(s)",
        prps.prp1, prps.prp2, prps.list_entries, prps.list_pages
    );
    // SAFETY: the PRPs were built by `prps` from `segments`, which are DmaBufs from the
    // controller's pool that the caller keeps until this function has seen the completion.
    unsafe {
        q.submit(cid, 0, |cmd| {
            *cmd = Command::rw(nvm::READ, cid.0, nsid, Lba(slba), blocks);
            cmd.prp1 = prps.prp1;
            cmd.prp2 = prps.prp2;
        })
    }?;
    q.ring();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut done = None;
        q.poll(8, |e| done = Some(e.cqe.status()))?;
        if let Some(s) = done {
            return Ok(s);
        }
        if Instant::now() > deadline {
            return Err(Outcome::Fail("no completion within 30 s".into()));
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// What LBA 0.. of the namespace must hold: `$PICCHIO_NVME_IMAGE`, then zeros (the harness writes
/// the image at byte 0 of a sparse file).
#[cfg(target_os = "linux")]
fn expected(len: usize) -> Result<Vec<u8>, Outcome> {
    let img = std::env::var("PICCHIO_NVME_IMAGE").map_err(|_| "PICCHIO_NVME_IMAGE is not set")?;
    let mut want = std::fs::read(&img).map_err(|e| format!("{img}: {e}"))?;
    want.resize(len, 0);
    Ok(want)
}

/// Compares `bufs` (in order) with the first bytes of `want`.
///
/// # Safety
/// The Read that filled `bufs` has completed (its completion was consumed): the device no longer
/// writes them.
#[cfg(target_os = "linux")]
unsafe fn check(bufs: &[DmaBuf], want: &[u8]) -> Result<(), Outcome> {
    let mut off = 0;
    for b in bufs {
        let n = b.len().min(want.len() - off);
        let mut got = vec![0u8; n];
        // SAFETY: the device no longer writes `bufs` (this function's contract).
        unsafe { b.copy_out(0, &mut got) };
        if got != want[off..off + n] {
            let i = (0..n).find(|&i| got[i] != want[off + i]).unwrap_or(0);
            return Err(Outcome::Fail(format!(
                "byte {:#x}: got {:#04x}, want {:#04x}",
                off + i,
                got[i],
                want[off + i]
            )));
        }
        off += n;
    }
    Ok(())
}

/// Fills `b` with 0xA5 so a transfer that skips a page cannot pass for zeros.
#[cfg(target_os = "linux")]
fn poison(b: &mut DmaBuf) {
    let len = b.len();
    b.copy_in(0, &vec![0xA5u8; len]);
}

#[cfg(target_os = "linux")]
fn run() -> Result<(), Outcome> {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: nvme_fault_probe <BDF> chained-prp|reset|stray-dma [NSID|IOVA]";
    let (bdf, what) = match (args.get(1), args.get(2)) {
        (Some(b), Some(w)) => (b.as_str(), w.as_str()),
        _ => return Err(Outcome::Fail(usage.into())),
    };
    match what {
        "chained-prp" => chained_prp(bdf, args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(1)),
        "reset" => reset(bdf, args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(1)),
        "stray-dma" => {
            let iova = match args.get(3) {
                Some(s) => u64::from_str_radix(s.trim_start_matches("0x"), 16)?,
                None => 0x4000_0000,
            };
            stray_dma(bdf, iova)
        }
        _ => Err(Outcome::Fail(usage.into())),
    }
}

#[cfg(target_os = "linux")]
fn chained_prp(bdf: &str, nsid: u32) -> Result<(), Outcome> {
    // 4 MiB = 1024 pages: QEMU's controller maps at most 1024 PRP entries per command (IOV_MAX in
    // hw/nvme/ctrl.c nvme_map_addr; more fails with Internal Error, DNR), so this is the longest
    // chain it can serve. Each segment is 1 MiB of a separate 2 MiB chunk (not IOVA-adjacent).
    const CHUNK: usize = 2 << 20;
    const SEG: usize = 1 << 20;
    const LEN: usize = 4 * SEG;
    let (mut c, _) = open(bdf)?;
    let mdts = c.identify().map_or(0, |i| i.mdts);
    if c.max_transfer() < LEN {
        return Err(Outcome::Skip(format!(
            "max transfer {} B (MDTS {mdts}) is below {LEN} B: no command needs a chained PRP list",
            c.max_transfer()
        )));
    }
    let ns = c.namespace(nsid)?;
    let mut bufs = (0..4).map(|_| c.dma().alloc(CHUNK)).collect::<Result<Vec<_>, _>>()?;
    bufs.iter_mut().for_each(poison);
    let segs: Vec<(Iova, usize)> = bufs.iter().map(|b| (b.iova(), SEG)).collect();
    eprintln!("segments: {segs:x?}");
    let status = read(&mut c, nsid, 0, (LEN / ns.lba_size as usize) as u32, &segs)?;
    if !status.is_success() {
        return Err(Outcome::Fail(format!("the {LEN}-byte Read completed with {status}")));
    }
    let want = expected(LEN)?;
    for (i, b) in bufs.iter().enumerate() {
        let mut got = vec![0u8; CHUNK];
        // SAFETY: the Read completed (its status was checked above), so the device is done with `b`.
        unsafe { b.copy_out(0, &mut got) };
        if got[..SEG] != want[i * SEG..(i + 1) * SEG] {
            let j = (0..SEG).find(|&j| got[j] != want[i * SEG + j]).unwrap_or(0);
            return Err(Outcome::Fail(format!("byte {:#x} (segment {i}) differs", i * SEG + j)));
        }
        if got[SEG..].iter().any(|&x| x != 0xA5) {
            return Err(Outcome::Fail(format!("chunk {i}: bytes beyond its 1 MiB segment were written")));
        }
    }
    println!(
        "chained-prp: one {LEN}-byte Read (MDTS {mdts}, LBA {}, 3 chained list pages) into 4 hugepage chunks matches the image",
        ns.lba_size
    );
    Ok(())
}

#[cfg(target_os = "linux")]
fn reset(bdf: &str, nsid: u32) -> Result<(), Outcome> {
    use std::time::Duration;
    const LEN: usize = 256 << 10;
    let (mut c, _) = open(bdf)?;
    let ns = c.namespace(nsid)?;
    let want = expected(LEN)?;
    let mut buf = c.dma().alloc(LEN)?;
    let blocks = (LEN / ns.lba_size as usize) as u32;
    for round in ["before", "after"] {
        poison(&mut buf);
        let status = read(&mut c, nsid, 0, blocks, &[(buf.iova(), LEN)])?;
        if !status.is_success() {
            return Err(Outcome::Fail(format!("Read {round} the reset completed with {status}")));
        }
        // SAFETY: `read` returned the Read's completion status, so it completed.
        unsafe { check(std::slice::from_ref(&buf), &want) }?;
        if round == "before" {
            // No command is outstanding: the controller must report CID 0 as not aborted.
            let aborted = c.abort(1, picchio_nvme::Cid(0), Duration::from_secs(5))?;
            if aborted {
                return Err(Outcome::Fail("Abort of an idle CID reported it aborted (DW0 bit 0 = 0)".into()));
            }
            let lost = c.reset()?;
            if !lost.is_empty() {
                return Err(Outcome::Fail(format!("reset reported lost commands while idle: {lost:?}")));
            }
            eprintln!("reset: CSTS {:#x} after bring-up, {} reset(s)", c.csts().0, c.resets());
        }
    }
    println!(
        "reset: Abort of an idle CID → not aborted; controller reset and re-initialized; reads before and after match"
    );
    Ok(())
}

#[cfg(target_os = "linux")]
fn stray_dma(bdf: &str, iova: u64) -> Result<(), Outcome> {
    use picchio_nvme::spec::{nvm, Command, Lba};
    use std::time::Duration;
    let (mut c, noiommu) = open(bdf)?;
    if noiommu {
        return Err(Outcome::Skip("no-IOMMU mode: a stray DMA would hit physical memory; not sent".into()));
    }
    let ns = c.namespace(1)?;
    let mut cmd = Command::rw(nvm::READ, 0, ns.nsid, Lba(0), 4096 / ns.lba_size);
    cmd.prp1 = iova;
    eprintln!("stray-dma: Read of 4096 bytes to unmapped IOVA {iova:#x}");
    // SAFETY: type1 mode (checked above): the IOMMU has no mapping at `iova` (the driver's DMA
    // chunks start at vfio::IOVA_BASE, 4 GiB), so the device's write is blocked there, not done.
    let done = unsafe { c.submit_raw_for_fault_test(cmd, Duration::from_secs(10)) }?;
    let Some(cqe) = done else {
        return Err(Outcome::Fail("no completion within 10 s (the controller hung on the blocked DMA)".into()));
    };
    let status = cqe.status();
    // The controller must still work: a normal Read into mapped memory.
    let mut buf = c.dma().alloc(4096)?;
    poison(&mut buf);
    let after = read(&mut c, 1, 0, 4096 / ns.lba_size, &[(buf.iova(), 4096)])?;
    if !after.is_success() {
        return Err(Outcome::Fail(format!("a normal Read after the stray one failed: {after}")));
    }
    let want = expected(4096)?;
    // SAFETY: `read` returned the Read's completion status, so it completed.
    unsafe { check(std::slice::from_ref(&buf), &want) }?;
    println!(
        "stray-dma: completed with {status}{}; a Read after it is correct",
        if status.is_success() {
            " (the controller did not see the IOMMU block; the DMAR fault is the witness)"
        } else {
            ""
        }
    );
    Ok(())
}
