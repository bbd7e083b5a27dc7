//! The runtime over our NVMe driver against the controller model (`picchio-nvme`'s sim), with the
//! VFIO data path: each tier model's image (Picchio (C)'s Qwen3-MoE, GPT-OSS) as namespace 1, the
//! expert cache's slots lent from the driver's DMA pool. Tokens must equal the file tier's, and no
//! expert byte may be copied through a bounce buffer; with heap slots (no pool) the same tokens come
//! with every expert byte bounced.
#![cfg(target_os = "linux")]

use std::time::Duration;

use picchio_core::StoreUri;
use picchio_nvme::sim::{Sim, SimConfig};
use picchio_nvme::{HeapDma, NvmeQueue, NvmeQueueOptions};
use picchio_runtime::expert::cache::ExpertCache;
use picchio_runtime::expert::open::EngineOptions;
use picchio_runtime::expert::store::{open_nvme_flat, with_fallback};
use picchio_runtime::model::Model;
use picchio_runtime::run::{GenerateOptions, Session};
use picchio_tests::*;

/// A session whose experts come from the sim over `m`'s image (LBA size `lba`); with `pool`, the
/// cache takes its slots from the driver's DMA memory. Drop the session before the sim (the driver
/// shuts the controller down on drop).
fn sim_session(m: &TierModel, lba: u32, ecap: usize, pool: bool, dma: HeapDma) -> (Session, Sim) {
    let model =
        Model::load(&picchio_runtime::ModelDir::open(&m.dir).unwrap(), m.prompt.len() + m.tokens.len()).unwrap();
    let (cfg, layout) = (model.config().clone(), model.layout().clone());
    let opts = NvmeQueueOptions { qd: 8, timeout: Duration::from_secs(60), ..Default::default() };
    let cfg_sim = SimConfig::single(m.image(), lba);
    let (q, sim) = NvmeQueue::open_sim_with(cfg_sim, &opts, dma, true).unwrap();
    let flat = open_nvme_flat("nvme:sim".into(), q, &cfg, &layout, false).unwrap();
    let (mut loader, info, io_stats) = with_fallback(flat, model.in_place_loader());
    let mut cache = ExpertCache::new(ecap, layout.len()).unwrap();
    let got = cache.use_slots_from(&mut *loader);
    assert_eq!(got.is_some(), pool, "{got:?}");
    assert_eq!(loader.describe().contains("zero-copy slots"), pool, "{}", loader.describe());
    (Session::from_parts(model, cache, loader, info, io_stats, None).unwrap(), sim)
}

#[test]
fn the_nvme_tier_over_the_sim_gives_the_file_tiers_tokens_with_zero_copy_slots() {
    for m in TierModel::all() {
        let n = m.tokens.len();
        let (file, _) =
            greedy(&m.dir, StoreUri::File(m.image()), EngineOptions::default(), Some(4), &m.prompt, n).unwrap();
        assert_eq!(file.tokens, m.tokens, "{}: the file tier", m.name);
        let gen = GenerateOptions { max_new: n, ..Default::default() };
        let all = m.entries;
        for (lba, ecap) in [(512, 4), (4096, 4), (4096, all), (512, 1)] {
            let what = format!("{} lba {lba} ecap {ecap}", m.name);
            let (mut s, sim) = sim_session(&m, lba, ecap, true, HeapDma::new());
            let g = s.generate(&m.prompt, &gen).unwrap();
            assert_eq!(g.tokens, file.tokens, "{what}");
            let st = &g.stats;
            assert_eq!(st.fallbacks, 0, "{what}");
            assert_eq!(st.reads, st.cache_misses, "{what}: every miss is one read from the namespace");
            assert!(st.bytes_read > 0);
            assert_eq!(st.bounce_bytes, 0, "{what}: an expert byte went through a bounce buffer");
            assert_eq!(s.cache.slots_from_allocator(), s.cache.allocated(), "every slot came from the DMA pool");
            let json = serde_json::to_value(st).unwrap();
            assert_eq!(json["bounce_bytes"], 0, "run --json reports it");
            drop(s);
            assert_eq!(sim.stats().dma_faults, 0);
        }
    }
}

#[test]
fn without_dma_memory_for_the_cache_the_same_tokens_come_through_bounce_buffers() {
    for m in TierModel::all() {
        let dma = HeapDma::new();
        dma.limit_regions(Some(4096)); // stands in for too few free hugepages
        let (mut s, sim) = sim_session(&m, 4096, 8, false, dma);
        let g = s.generate(&m.prompt, &GenerateOptions { max_new: m.tokens.len(), ..Default::default() }).unwrap();
        assert_eq!(g.tokens, m.tokens, "{}", m.name);
        assert_eq!(s.cache.slots_from_allocator(), 0);
        assert_eq!(g.stats.bounce_bytes, g.stats.bytes_read, "{}: heap slots: every expert byte copied once", m.name);
        assert_eq!(g.stats.fallbacks, 0);
        drop(s);
        drop(sim);
    }
}
