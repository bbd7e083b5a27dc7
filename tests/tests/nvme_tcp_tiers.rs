//! The S6 tier end to end: `pack --out nvme-tcp://…` onto picchio-nvme's in-process NVMe/TCP
//! target model (a real loopback TCP socket; a *model*, not a target — the real Linux nvmet-tcp
//! target runs in the VM harness), then `run --store nvme-tcp://…` through the runtime's one engine
//! factory: each tier model's tokens (Picchio (C)'s Qwen3-MoE, GPT-OSS) equal the file tier's.
//! Also the write refusals (a file system on the namespace, an image larger than the namespace),
//! `verify`, bench's store parser, and a target that goes away mid-run (experts fall back to
//! safetensors, counted).
#![cfg(target_os = "linux")]

use picchio_core::{IoQueue, StoreUri};
use picchio_nvme::tcp::model::{Backing, Fault, ModelConfig, TargetModel};
use picchio_runtime::expert::open::EngineOptions;
use picchio_runtime::image::pack::{pack_to, PackOptions, PackReport};
use picchio_runtime::image::record::RecordModel;
use picchio_runtime::image::write::{WriteOptions, WriteTo};
use picchio_runtime::run::GenerateOptions;
use picchio_tests::*;

// No model record: the namespace then holds Picchio (C)'s image byte for byte (the record itself is
// tested in convert_pack and the CLI tests).
const POPTS: PackOptions = PackOptions { layers: None, progress: false, record: RecordModel::Nothing };

/// A model target of `len` bytes of `fill` (a file in a scratch directory) with `lba`-byte LBAs.
fn target(len: usize, lba: u32, fill: u8) -> (TargetModel, tempfile::TempDir) {
    let tmp = scratch();
    let ns = tmp.path().join("ns1");
    std::fs::write(&ns, vec![fill; len]).unwrap();
    (TargetModel::start(ModelConfig::file(&ns, lba)).unwrap(), tmp)
}

fn uri(t: &TargetModel) -> StoreUri {
    t.uri().parse().unwrap()
}

fn pack(m: &TierModel, t: &TargetModel, force: bool) -> (String, picchio_runtime::Result<PackReport>) {
    let mut plan = String::new();
    let u = uri(t);
    let wopts = WriteOptions { force, io_threads: 1, ..WriteOptions::default() };
    let r = pack_to(&m.dir, WriteTo::Uri(&u), &POPTS, &wopts, &mut |p| plan = p.to_string());
    (plan, r)
}

#[test]
fn pack_onto_nvme_tcp_then_run_gives_the_file_tiers_tokens() {
    TierModel::each_at_both_lbas(|m, image, lba, what| {
        let (t, _tmp) = target(4 << 20, lba, 0xA5);
        let (plan, r) = pack(m, &t, false);
        let report = r.unwrap_or_else(|e| panic!("{what}: {e:#}"));
        assert!(plan.contains("user-space NVMe/TCP initiator") && plan.contains("found: nothing"), "{plan}");
        let (commands, verify) = (report.nvme_commands().unwrap(), report.verify().unwrap());
        assert!(commands.0 > 0 && commands.1 >= 3, "{what}: writes and flushes {commands:?}");
        assert!(verify.is_clean() && verify.entries == m.entries, "{what}");
        assert_eq!(&t.contents()[..image.len()], image, "{what}: the namespace holds the image");
        assert!(t.stats().r2ts > 0, "{what}: 4 MiB runs go after R2Ts");
        // run --store nvme-tcp://…, two I/O queues.
        let io = EngineOptions { threads: 2, qd: 4, ..EngineOptions::default() };
        let (g, s) = greedy(&m.dir, uri(&t), io, Some(4), &m.prompt, m.tokens.len()).unwrap();
        assert_eq!(g.tokens, m.tokens, "{what}");
        assert_eq!(g.stats.fallbacks, 0, "{what}");
        assert!(g.stats.reads > 0 && g.stats.bounce_bytes == 0, "{what}");
        drop(s);
        let v = picchio_runtime::image::verify::verify_store(
            &uri(&t),
            Some(&m.dir),
            &picchio_runtime::image::verify::VerifyOptions { io_threads: 1, direct: true, progress: false },
        )
        .unwrap();
        assert!(v.is_clean(), "{what}: verify nvme-tcp://");
    });
}

#[test]
fn digests_on_give_the_same_tokens() {
    let m = TierModel::picchio_c();
    let image = std::fs::read(m.image()).unwrap();
    let t = TargetModel::start(ModelConfig::memory(image.clone(), 4096)).unwrap();
    // The store URI's options are the runtime's: digests through the initiator directly.
    let target = t.target(1);
    let opts = picchio_nvme::TcpOptions { hdgst: true, ddgst: true, ..picchio_nvme::TcpOptions::default() };
    let mut q = picchio_nvme::NvmeTcpQueue::connect(target, opts).unwrap();
    let buf = picchio_core::io::read_blocking(&mut q, 0, image.len() as u32).unwrap();
    assert_eq!(&buf.as_slice()[..image.len()], &image[..]);
    assert!(q.describe().contains("hdgst, ddgst"), "{}", q.describe());
}

#[test]
fn a_namespace_with_a_file_system_is_refused_unless_forced_and_a_small_one_always() {
    let m = TierModel::picchio_c();
    // An ext4 superblock in the namespace's first blocks.
    let tmp = scratch();
    let ns = tmp.path().join("ns1");
    let mut old = vec![0u8; 4 << 20];
    old[1048..1052].copy_from_slice(&2u32.to_le_bytes());
    old[1080..1082].copy_from_slice(&[0x53, 0xEF]);
    std::fs::write(&ns, &old).unwrap();
    let t =
        TargetModel::start(ModelConfig { backing: Backing::File(ns.clone()), ..ModelConfig::memory(Vec::new(), 512) })
            .unwrap();
    let (plan, r) = pack(&m, &t, false);
    let e = format!("{:#}", r.unwrap_err());
    assert!(e.contains("ext2/3/4 file system") && e.contains("--force"), "{e}");
    assert!(plan.contains("ext2/3/4"), "{plan}");
    assert_eq!(std::fs::read(&ns).unwrap(), old, "nothing was written");
    let (_, r) = pack(&m, &t, true);
    r.unwrap();
    // A namespace smaller than the image: refused, even with --force.
    let (small, _tmp) = target(64 << 10, 512, 0);
    let (_, r) = pack(&m, &small, true);
    let e = format!("{:#}", r.unwrap_err());
    assert!(e.contains(&small.uri()) && e.contains("the image needs"), "{e}");
    assert_eq!(small.contents(), vec![0u8; 64 << 10], "nothing was written");
}

#[test]
fn a_target_that_goes_away_mid_run_falls_back_to_safetensors_counted() {
    let m = TierModel::picchio_c();
    let image = std::fs::read(m.image()).unwrap();
    let t = TargetModel::start(ModelConfig::memory(image, 512)).unwrap();
    let io = EngineOptions { threads: 1, qd: 4, ..EngineOptions::default() };
    let opts = picchio_runtime::run::SessionOptions {
        model: picchio_runtime::ModelDir::open(&m.dir).unwrap(),
        store: uri(&t),
        engine: io,
        schedule: Default::default(),
        verify: false,
        ecap: Some(1),
        max_seq: m.prompt.len() + m.tokens.len(),
        dense: picchio_runtime::model::DenseFormat::Stored,
    };
    let mut s = picchio_runtime::run::Session::open(
        &opts,
        picchio_runtime::model::tokenizer::Tokenizer::from_dir(&m.dir).unwrap(),
    )
    .unwrap();
    // Every connection is dropped and every new one closed at once: reads fail, experts come from
    // the converted safetensors, and the tokens stay right.
    t.inject(Fault::CloseOnAccept);
    t.drop_connections();
    let g = s.generate(&m.prompt, &GenerateOptions { max_new: m.tokens.len(), ..Default::default() }).unwrap();
    assert_eq!(g.tokens, m.tokens);
    assert!(g.stats.fallbacks > 0, "{:?}", g.stats);
}

#[test]
fn every_command_accepts_nvme_tcp_and_a_uri_without_port_or_nqn_is_a_usage_error() {
    use picchio_runtime::expert::open::{bench_store, write_target};
    let u = "nvme-tcp://127.0.0.1:4420/nqn.2026-12.io.picchio:x/1";
    assert_eq!(bench_store(u).unwrap().to_string(), u);
    assert_eq!(write_target(u).unwrap().to_string(), u);
    for (s, want) in
        [("nvme-tcp://127.0.0.1/nqn.a:b", "needs a port"), ("nvme-tcp://127.0.0.1:4420", "needs the subsystem NQN")]
    {
        let e = bench_store(s).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
        let e = write_target(s).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
}
