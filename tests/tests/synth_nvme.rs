//! `picchio synth --out nvme:` through the same driver path as `pack --out nvme:`, against the
//! controller model: the namespace ends up holding the very bytes `synth` writes to a file, and a
//! namespace too small for the image is refused before anything is written.
#![cfg(target_os = "linux")]

use std::path::Path;
use std::time::Duration;

use picchio_nvme::sim::{Sim, SimConfig};
use picchio_nvme::{HeapDma, NvmeQueue, NvmeQueueOptions};
use picchio_runtime::image::synthetic_image::{synth, synth_to, Geometry, SynthOptions, SynthReport};
use picchio_runtime::image::write::{Plan, WriteOptions, WriteTo};

/// `synth --out nvme:` onto the namespace `q` drives.
fn synth_nvme_queue(
    q: &mut NvmeQueue,
    name: &str,
    opts: &SynthOptions,
    force: bool,
    announce: &mut dyn FnMut(&Plan<'_>),
) -> picchio_runtime::Result<SynthReport> {
    let wopts = WriteOptions { force, ..WriteOptions::default() };
    synth_to(WriteTo::NvmeQueue { queue: q, name }, opts, &wopts, announce)
}

fn queue(ns: &Path) -> (NvmeQueue, Sim) {
    let mut cfg = SimConfig::single(ns, 4096);
    cfg.namespaces[0].writable = true;
    let opts = NvmeQueueOptions { qd: 8, timeout: Duration::from_secs(60), ..Default::default() };
    NvmeQueue::open_sim_with(cfg, &opts, HeapDma::new(), true).unwrap()
}

fn opts() -> SynthOptions {
    // 12 entries of 5000 bytes (not a whole number of blocks: the padding is written too).
    let mut geometry = Geometry::q4(64, 3, 4, 2, 64);
    geometry.expert_bytes = 5000;
    SynthOptions { geometry, layers: None, seed: 7, progress: false }
}

#[test]
fn synth_onto_a_namespace_writes_the_file_image_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("s.pf");
    let r = synth(&file, &opts()).unwrap();
    let want = std::fs::read(&file).unwrap();
    assert_eq!(want.len() as u64, r.bytes);

    let ns = dir.path().join("ns");
    std::fs::write(&ns, vec![0xA5u8; 1 << 20]).unwrap();
    let (mut q, sim) = queue(&ns);
    let mut plan = String::new();
    let r = synth_nvme_queue(&mut q, "nvme:sim/1", &opts(), false, &mut |i| plan = i.to_string()).unwrap();
    drop(q);
    assert_eq!(sim.stats().dma_faults, 0);
    assert!(plan.contains("nvme:sim/1"), "{plan}");
    let verify = r.verify().unwrap();
    assert_eq!((r.dest.as_str(), r.bytes, verify.entries), ("nvme:sim/1", want.len() as u64, 12));
    assert!(verify.is_clean(), "{}", verify);
    let got = std::fs::read(&ns).unwrap();
    assert_eq!(&got[..want.len()], &want[..], "the namespace holds the file image byte for byte");
    assert!(got[want.len()..].iter().all(|&b| b == 0xA5), "nothing written past the image");
}

#[test]
fn a_namespace_smaller_than_the_image_is_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let ns = dir.path().join("ns");
    // The image needs 8192 + 12 × 8192 bytes; the namespace has 64 KiB.
    std::fs::write(&ns, vec![0xA5u8; 64 << 10]).unwrap();
    let (mut q, _sim) = queue(&ns);
    let e = synth_nvme_queue(&mut q, "nvme:sim/1", &opts(), true, &mut |_| {}).unwrap_err().to_string();
    drop(q);
    assert!(e.contains("nvme:sim/1") && e.contains("106496") && e.contains("65536"), "{e}");
    assert!(std::fs::read(&ns).unwrap().iter().all(|&b| b == 0xA5), "nothing written");
}
