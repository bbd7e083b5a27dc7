//! `picchio pack --out nvme:` through our driver against the controller model (VFIO data path):
//! NVM Writes + Flush then read-back of every hash, the same refusals as `--out raw:` (file-system
//! and partition-table signatures in the namespace's first blocks, an image too large), `--force`,
//! and the runtime reading the packed namespace back to each tier model's tokens (Picchio (C)'s
//! Qwen3-MoE, GPT-OSS).
#![cfg(target_os = "linux")]

use std::path::Path;
use std::time::Duration;

use picchio_nvme::sim::{Sim, SimConfig};
use picchio_nvme::{HeapDma, NvmeQueue, NvmeQueueOptions};
use picchio_runtime::expert::cache::ExpertCache;
use picchio_runtime::expert::store::{open_nvme_flat, with_fallback};
use picchio_runtime::image::pack::{PackOptions, PackReport};
use picchio_runtime::image::record::RecordModel;
use picchio_runtime::image::write::{WriteOptions, WriteTo};
use picchio_runtime::model::Model;
use picchio_runtime::run::{GenerateOptions, Session};
use picchio_tests::*;

fn queue(ns: &Path, lba: u32) -> (NvmeQueue, Sim) {
    let mut cfg = SimConfig::single(ns, lba);
    cfg.namespaces[0].writable = true;
    let opts = NvmeQueueOptions { qd: 8, timeout: Duration::from_secs(60), ..Default::default() };
    NvmeQueue::open_sim_with(cfg, &opts, HeapDma::new(), true).unwrap()
}

// No model record: the namespace then holds Picchio (C)'s image byte for byte (the record itself is
// tested in convert_pack and the CLI tests).
const POPTS: PackOptions = PackOptions { layers: None, progress: false, record: RecordModel::Nothing };

fn opts(force: bool) -> WriteOptions {
    WriteOptions { force, io_threads: 1, ..WriteOptions::default() }
}

/// `pack --out nvme:` of the model directory `model` onto the namespace `q` drives.
fn pack_nvme_queue(
    model: &Path,
    q: &mut NvmeQueue,
    force: bool,
    announce: &mut dyn FnMut(&picchio_runtime::image::write::Plan<'_>),
) -> picchio_runtime::Result<PackReport> {
    let to = WriteTo::NvmeQueue { queue: q, name: "nvme:sim/1" };
    picchio_runtime::image::pack::pack_to(model, to, &POPTS, &opts(force), announce)
}

/// Packs `m`'s directory onto `ns` through a fresh sim queue; returns the plan printed and the result.
fn pack_model(m: &TierModel, ns: &Path, lba: u32, force: bool) -> (String, picchio_runtime::Result<PackReport>) {
    let (mut q, sim) = queue(ns, lba);
    let mut plan = String::new();
    let r = pack_nvme_queue(&m.dir, &mut q, force, &mut |i| plan = i.to_string());
    drop(q);
    assert_eq!(sim.stats().dma_faults, 0);
    (plan, r)
}

/// Packs Picchio (C)'s fixture onto `ns` (see [`pack_model`]).
fn pack_to(ns: &Path, lba: u32, force: bool) -> (String, picchio_runtime::Result<PackReport>) {
    pack_model(&TierModel::picchio_c(), ns, lba, force)
}

/// Runs `tm` with experts from the namespace file `ns` (through the driver, zero-copy slots).
fn run_model(tm: &TierModel, ns: &Path, lba: u32) -> Vec<u32> {
    let m = Model::load(&picchio_runtime::ModelDir::open(&tm.dir).unwrap(), tm.prompt.len() + tm.tokens.len()).unwrap();
    let (cfg, layout) = (m.config().clone(), m.layout().clone());
    let (q, sim) = queue(ns, lba);
    let flat = open_nvme_flat("nvme:sim/1".into(), q, &cfg, &layout, false).unwrap();
    let (mut loader, info, io_stats) = with_fallback(flat, m.in_place_loader());
    let mut cache = ExpertCache::new(4, layout.len()).unwrap();
    assert!(cache.use_slots_from(&mut *loader).is_some());
    let mut s = Session::from_parts(m, cache, loader, info, io_stats, None).unwrap();
    let g = s.generate(&tm.prompt, &GenerateOptions { max_new: tm.tokens.len(), ..Default::default() }).unwrap();
    assert_eq!((g.stats.fallbacks, g.stats.bounce_bytes), (0, 0));
    drop(s);
    drop(sim);
    g.tokens
}

/// Runs Picchio (C)'s fixture from `ns` (see [`run_model`]).
fn run_from(ns: &Path, lba: u32) -> Vec<u32> {
    run_model(&TierModel::picchio_c(), ns, lba)
}

#[test]
fn pack_writes_flushes_and_reads_back_then_the_runtime_gives_each_models_tokens() {
    TierModel::each_at_both_lbas(|m, image, lba, what| {
        let tmp = scratch();
        let ns = tmp.path().join("ns1");
        let mut junk = vec![0xA5u8; 4 << 20]; // old contents with no known signature
        junk[..8].copy_from_slice(b"NOTFSYET");
        std::fs::write(&ns, &junk).unwrap();
        let (plan, r) = pack_model(m, &ns, lba, false);
        let report = r.unwrap();
        assert!(plan.contains("nvme:sim/1: namespace 1") && plan.contains("found: nothing"), "{what}: {plan}");
        assert!(plan.contains(&format!("writes {} bytes", image.len())), "{what}: {plan}");
        let text = report.to_string();
        assert!(text.contains(&format!("{} B LBAs", lba)) && text.contains("payload hashes OK"), "{text}");
        let (commands, verify) = (report.nvme_commands().unwrap(), report.verify().unwrap());
        assert!(commands.0 > 0 && commands.1 >= 3, "writes and flushes: {:?}", commands);
        assert!(verify.is_clean() && verify.entries == m.entries, "{what}");
        let disk = std::fs::read(&ns).unwrap();
        assert!(disk[..image.len()] == image[..], "{what}: the namespace holds the file tier's image byte for byte");
        assert!(disk[image.len()..] == junk[image.len()..], "nothing written past the image");
        assert_eq!(run_model(m, &ns, lba), m.tokens, "{what}");
        // Re-packing over our own image is not refused (an earlier image is only noted).
        let (plan, r) = pack_model(m, &ns, lba, false);
        r.unwrap();
        assert!(plan.contains(".picchioflat image") && plan.contains("not a reason to refuse"), "{plan}");
    });
}

/// An ext4 superblock: magic 0xEF53 at byte 1080, s_log_block_size 2 (4 KiB blocks) at 1048.
fn ext4(b: &mut [u8]) {
    b[1048..1052].copy_from_slice(&2u32.to_le_bytes());
    b[1080..1082].copy_from_slice(&[0x53, 0xEF]);
}

/// A GPT: protective MBR (type 0xEE, 0x55AA) and "EFI PART" at LBA 1 of 512-byte LBAs.
fn gpt(b: &mut [u8]) {
    b[446 + 4] = 0xEE;
    b[510..512].copy_from_slice(&[0x55, 0xAA]);
    b[512..520].copy_from_slice(b"EFI PART");
}

#[test]
fn a_namespace_holding_a_file_system_or_partition_table_is_refused_unless_forced() {
    type Mark = fn(&mut [u8]);
    for (what, mark, expect) in [
        ("ext4", ext4 as Mark, "ext2/3/4 file system (magic 0xEF53 at byte 1080)"),
        ("gpt", gpt as Mark, "GPT partition table (\"EFI PART\" at byte 512)"),
    ] {
        let tmp = scratch();
        let ns = tmp.path().join("ns1");
        let mut old = vec![0u8; 2 << 20];
        mark(&mut old);
        std::fs::write(&ns, &old).unwrap();
        let (plan, r) = pack_to(&ns, 512, false);
        let e = r.unwrap_err().to_string();
        assert!(plan.contains(expect) && plan.contains("[refused without --force]"), "{what}: {plan}");
        assert!(
            e.starts_with("nvme:sim/1: refusing to write the image")
                && e.contains(expect)
                && e.contains("Nothing was written")
                && e.contains("--force"),
            "{what}: {e}"
        );
        assert_eq!(std::fs::read(&ns).unwrap(), old, "{what}: the namespace is unchanged");
        let (_, r) = pack_to(&ns, 512, true);
        r.unwrap();
        assert_eq!(run_from(&ns, 512), PICCHIO_C_TOKENS, "{what} overwritten with --force");
    }
}

#[test]
fn an_image_larger_than_the_namespace_is_refused_even_with_force() {
    let tmp = scratch();
    let ns = tmp.path().join("ns1");
    std::fs::write(&ns, vec![0u8; 256 << 10]).unwrap();
    let (_, r) = pack_to(&ns, 4096, true);
    let e = r.unwrap_err().to_string();
    assert!(e.contains("nvme:sim/1") && e.contains("401408"), "{e}");
    assert!(std::fs::read(&ns).unwrap().iter().all(|&b| b == 0), "nothing written");
}

#[test]
fn a_read_only_namespace_fails_the_pack_with_the_write_status() {
    let tmp = scratch();
    let ns = tmp.path().join("ns1");
    std::fs::write(&ns, vec![0u8; 1 << 20]).unwrap();
    let opts_q = NvmeQueueOptions { qd: 4, timeout: Duration::from_secs(60), ..Default::default() };
    let (mut q, _sim) = NvmeQueue::open_sim_with(SimConfig::single(&ns, 512), &opts_q, HeapDma::new(), true).unwrap();
    let e = pack_nvme_queue(&TierModel::picchio_c().dir, &mut q, false, &mut |_| {}).unwrap_err();
    let e = picchio_core::error::chain(&e).to_string();
    assert!(e.contains("nvme:sim/1") && e.contains("NVMe write of namespace 1"), "{e}");
}

#[test]
fn a_write_the_device_acknowledges_but_loses_fails_the_read_back_naming_the_experts() {
    // Each of the first few NVM Writes in turn is acknowledged but never reaches the media (a
    // device that loses acknowledged writes). The first write zeroes block 0 and is rewritten by
    // the superblock later, so losing it loses nothing; losing any later one loses a payload or
    // the index or the superblock, and the read-back must say so: never "payload hashes OK".
    let m = TierModel::picchio_c();
    let mut lost_payloads = 0;
    for nth in 1..=4u64 {
        let tmp = scratch();
        let ns = tmp.path().join("ns1");
        std::fs::write(&ns, vec![0x5Au8; 4 << 20]).unwrap();
        let (mut q, sim) = queue(&ns, 512);
        sim.inject(picchio_nvme::sim::Fault::io_vanish(picchio_nvme::spec::nvm::WRITE, nth));
        let r = pack_nvme_queue(&m.dir, &mut q, false, &mut |_| {});
        drop(q);
        assert_eq!(sim.stats().faults_fired, 1, "write {nth}: the fault fired");
        match r {
            Ok(report) if nth == 1 => assert!(report.verify().unwrap().is_clean()),
            Ok(report) => panic!("write {nth} was lost, yet the pack succeeded: {report}"),
            Err(e) => {
                assert!(nth > 1, "losing the first write (block 0, rewritten later) failed the pack: {e}");
                let text = picchio_core::error::chain(&e).to_string();
                assert!(
                    matches!(e, picchio_runtime::Error::ReadBack { .. })
                        && text.contains("nvme:sim/1: the image was written, but reading it back did not give it"),
                    "write {nth}: {text}"
                );
                lost_payloads += usize::from(text.contains("(layer "));
            }
        }
    }
    assert!(lost_payloads > 0, "no lost write was a payload's: the read-back never named an expert");
}
