//! The runtime over our NVMe driver against the controller model while the controller misbehaves:
//! a hung command (Abort resolves it), a lost completion (Abort cannot: controller reset) and a
//! Controller Fatal Status (reset). Each failed expert read is served by the safetensors fallback,
//! so the tokens still equal Picchio (C)'s, and reads after each recovery come from the namespace.
#![cfg(target_os = "linux")]

use std::time::Duration;

use picchio_nvme::engine::RecoveryPolicy;
use picchio_nvme::sim::{Fault, SimConfig};
use picchio_nvme::{NvmeQueue, NvmeQueueOptions};
use picchio_runtime::expert::cache::ExpertCache;
use picchio_runtime::expert::store::{open_nvme_flat, with_fallback};
use picchio_runtime::model::Model;
use picchio_runtime::run::{GenerateOptions, Session};
use picchio_tests::*;

const N: usize = 16;

#[test]
fn faults_during_generation_fall_back_to_safetensors_and_the_tokens_stay_exact() {
    let prompt = ids(&reference_json(&fixture("qwen3_moe"), "reference.json"), "prompt_ids");
    let dir = fixture("picchio_c/qwen3_moe");
    let model = Model::load(&picchio_runtime::ModelDir::open(&dir).unwrap(), prompt.len() + N).unwrap();
    let (cfg, layout) = (model.config().clone(), model.layout().clone());
    // The held and dropped completions time out after 2 s (not 300 ms: on a loaded machine the other
    // reads of the run must not time out too, or the abort/reset counts below would be off).
    let opts = NvmeQueueOptions { qd: 8, timeout: Duration::from_secs(2), ..Default::default() };
    let (mut q, sim) = NvmeQueue::open_sim(SimConfig::single(dir.join("experts.picchioflat"), 512), &opts).unwrap();
    q.set_recovery(RecoveryPolicy {
        abort_timeout: Duration::from_secs(2),
        max_resets: 3,
        reset_window: Duration::from_secs(600),
    });
    let flat = open_nvme_flat("nvme:sim".into(), q, &cfg, &layout, false).unwrap();
    let (loader, info, io_stats) = with_fallback(flat, model.in_place_loader());
    // A small cache: every token misses, so the faults land during generation.
    let cache = ExpertCache::new(4, layout.len()).unwrap();
    let mut s = Session::from_parts(model, cache, loader, info, io_stats, None).unwrap();
    let at = sim.io_count();
    sim.inject(Fault::io_hold(at + 3));
    sim.inject(Fault::io_drop(at + 20));
    sim.inject(Fault::io_fatal(at + 40));
    let g = s.generate(&prompt, &GenerateOptions { max_new: N, ..Default::default() }).unwrap();
    assert_eq!(g.tokens, PICCHIO_C_TOKENS);
    let st = &g.stats;
    let sims = sim.stats();
    assert_eq!(sims.faults_fired, 3, "every fault hit a read of this run: {sims:?}");
    assert_eq!((sims.aborted, sims.resets), (1, 2), "hold: aborted; drop and CFS: reset: {sims:?}");
    assert!(st.fallbacks >= 3, "each fault failed at least its own read: {st:?}");
    assert_eq!(st.fallbacks, st.store_errors, "exactly the failed reads fell back: {st:?}");
    assert!(st.reads > st.fallbacks * 5, "the namespace served the rest: {st:?}");
    drop(s);
    assert_eq!(sim.stats().dma_faults, 0);
}
