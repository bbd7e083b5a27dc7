//! The driver against a real (or QEMU-emulated) controller through VFIO. Skips, with a visible
//! message, unless `PICCHIO_NVME_BDF` names a function bound to vfio-pci (the VM harness sets it, and
//! `PICCHIO_NVME_NSID`, `PICCHIO_NVME_IMAGE`, `PICCHIO_NVME_LBA_SIZE`).
#![cfg(target_os = "linux")]
#![cfg(target_os = "linux")]

use std::time::Duration;

use picchio_core::{AlignedBuf, ByteOffset, ExpertLoader, FlatStore, FlatStoreOptions, IoQueue, ReadReq, Tag};
use picchio_nvme::{NvmeQueue, NvmeQueueOptions};

fn env() -> Option<(String, NvmeQueueOptions)> {
    let Ok(bdf) = std::env::var("PICCHIO_NVME_BDF") else {
        eprintln!("skipped: PICCHIO_NVME_BDF is not set (no VFIO-bound NVMe controller)");
        return None;
    };
    let nsid = std::env::var("PICCHIO_NVME_NSID").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    Some((bdf, NvmeQueueOptions { nsid, qd: 32, timeout: Duration::from_secs(10) }))
}

fn open(bdf: &str, opts: &NvmeQueueOptions) -> NvmeQueue {
    let ctrlr = picchio_nvme::vfio::open_controller(bdf, opts.ctrlr_options()).unwrap_or_else(|e| panic!("{e}"));
    NvmeQueue::with_bounce_buffer(ctrlr, opts.nsid, opts.timeout, format!("vfio {bdf}")).unwrap()
}

#[test]
fn vfio_init_identify_and_read_the_image() {
    let Some((bdf, opts)) = env() else { return };
    let mut q = open(&bdf, &opts);
    let ns = q.namespace();
    eprintln!("{}: {ns:?}, max transfer {}", q.describe(), q.max_transfer());
    if let Some(lba) = std::env::var("PICCHIO_NVME_LBA_SIZE").ok().and_then(|s| s.parse::<u32>().ok()) {
        assert_eq!(ns.lba_size, lba);
    }
    let Ok(img) = std::env::var("PICCHIO_NVME_IMAGE") else {
        eprintln!("PICCHIO_NVME_IMAGE not set: identify only");
        return;
    };
    let want = std::fs::read(&img).unwrap();
    let n = want.len().min(2 << 20) / 4096 * 4096;
    for (qd, len) in [(1usize, 4096u32), (32, 4096), (8, 1 << 20)] {
        let mut out = Vec::new();
        let mut off = 0u64;
        while off < n as u64 || q.in_flight() > 0 {
            while off < n as u64 && q.in_flight() < qd {
                let l = len.min(n as u32 - off as u32);
                q.submit(ReadReq {
                    offset: ByteOffset(off),
                    len: l,
                    buf: AlignedBuf::new(l as usize, 4096).unwrap(),
                    tag: Tag(off),
                });
                off += u64::from(l);
            }
            q.reap(1, &mut out);
        }
        for c in out {
            let l = c.result.unwrap() as usize;
            let o = c.tag.0 as usize;
            assert!(c.buf.as_slice()[..l] == want[o..o + l], "qd {qd}: bytes at {o:#x} differ from {img}");
        }
    }
}

#[test]
fn vfio_flat_store_loads_every_expert_with_verified_hashes() {
    let Some((bdf, opts)) = env() else { return };
    let Ok(img) = std::env::var("PICCHIO_NVME_IMAGE") else {
        eprintln!("skipped: PICCHIO_NVME_IMAGE not set");
        return;
    };
    let image_len = std::fs::metadata(&img).unwrap().len();
    let q = open(&bdf, &opts);
    let so = FlatStoreOptions { image_len, verify: true, ..Default::default() };
    let mut store = FlatStore::open(q, format!("nvme:{bdf}"), so).unwrap();
    let sb = store.superblock().clone();
    let mut loaded = 0;
    for layer in 0..sb.n_layers {
        let per = sb.n_entries / sb.n_layers.max(1);
        let reqs: Vec<_> = (0..per.min(sb.n_experts))
            .filter_map(|e| {
                let loc = store.entry(picchio_core::ExpertKey { layer, expert: e }).ok()?;
                Some((e, AlignedBuf::new(loc.padded_len as usize, 4096).unwrap()))
            })
            .collect();
        store.load(layer, reqs, &mut |l| {
            l.result.unwrap_or_else(|e| panic!("{}: {e}", l.key));
            loaded += 1;
        });
    }
    assert!(loaded > 0);
    eprintln!("{loaded} experts loaded and verified over {}", store.queue().describe());
}

/// With a type1 IOMMU (kernel ≥ 5.4 reports the capability), the usable IOVA ranges are read at
/// open and the DMA pool's first chunk lies inside them; in no-IOMMU mode there are none (IOVAs are
/// physical addresses).
#[test]
fn vfio_iommu_iova_ranges_cover_the_dma_pool_base() {
    let Some((bdf, _)) = env() else { return };
    let dev = picchio_nvme::vfio::VfioDevice::open(&bdf).unwrap_or_else(|e| panic!("{e}"));
    let ranges = dev.iova_ranges();
    eprintln!("{bdf}: noiommu {}, IOVA ranges {ranges:x?}", dev.noiommu());
    if dev.noiommu() {
        assert!(ranges.is_empty());
        return;
    }
    assert!(!ranges.is_empty(), "the guest kernel (6.1) reports VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE");
    let base = picchio_nvme::vfio::IOVA_BASE.0;
    assert!(ranges.iter().any(|r| r.contains(base, 2 << 20)), "IOVA_BASE {base:#x} outside {ranges:x?}");
    assert!(
        !ranges.iter().any(|r| r.contains(0xfee0_0000, 4096)),
        "the x86 MSI window 0xfee00000 is reserved by the IOMMU: {ranges:x?}"
    );
}
