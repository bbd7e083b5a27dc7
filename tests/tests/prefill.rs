//! Chunked prefill ([`Model::prefill`]) against the token-by-token forward pass on every fixture:
//! the logits after the prompt and every decode step after it are bit-identical (so well within the
//! oracle tolerances), the greedy ids equal the transformers reference, and the KV cache the prefill
//! leaves carries decoding on correctly — at prefill chunks of 1, 3 and 64 and expert caches of 1, 4
//! and every expert. Also: a prefill from a start position, the union property (each distinct expert
//! of a chunk loaded at most once, all of a layer's misses in one load when the cache holds them) and
//! the routing observer seeing every token's decision.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use picchio_core::{AlignedBuf, ExpertLoader, Loaded};
use picchio_runtime::image::convert::{convert, ConvertOptions};
use picchio_runtime::model::moe::RoutingObserver;
use picchio_runtime::model::sampler::argmax;
use picchio_runtime::model::Model;
use picchio_runtime::quant::QuantKind;
use picchio_tests::{fixture, ids, reference_json, PICCHIO_C_TOKENS};

/// `(tokens, logits rows)` of greedy decoding `n` tokens: the logits after the prompt are
/// `first`; each further row comes from one token-by-token forward pass at `pos`, `pos + 1`, ...
fn decode(model: &mut Model, first: Vec<f32>, pos: usize, n: usize, run: &mut Run) -> (Vec<u32>, Vec<f32>) {
    let mut rows = first;
    let mut out = vec![argmax(&rows)];
    while out.len() < n {
        let next = *out.last().unwrap();
        let pos = pos + out.len() - 1;
        let logits = model.forward(next, pos, &mut run.cache, &mut run.loader).unwrap();
        out.push(argmax(logits));
        rows.extend_from_slice(logits);
    }
    (out, rows)
}

/// An expert cache and the safetensors loader of one run.
struct Run {
    cache: picchio_runtime::expert::cache::ExpertCache,
    loader: Box<dyn picchio_core::ExpertLoader>,
}

fn new_run(model: &Model, ecap: usize) -> Run {
    Run { cache: model.new_cache(ecap).unwrap(), loader: model.in_place_loader() }
}

fn total_experts(model: &Model) -> usize {
    model.config().moe_layers().len() * model.config().num_experts
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Token-by-token prompt then greedy decoding: the reference rows every chunked run must equal.
fn token_by_token(dir: &Path, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let mut model = Model::load(&picchio_runtime::ModelDir::open(dir).unwrap(), prompt.len() + n).unwrap();
    let mut run = new_run(&model, total_experts(&model));
    let mut last = Vec::new();
    for (pos, &t) in prompt.iter().enumerate() {
        last = model.forward(t, pos, &mut run.cache, &mut run.loader).unwrap().to_vec();
    }
    decode(&mut model, last, prompt.len(), n, &mut run)
}

/// Chunked prefill of `prompt` (in two calls when `split`: `..split` from 0, then the rest from
/// `split`), then greedy decoding.
fn chunked(
    dir: &Path,
    prompt: &[u32],
    n: usize,
    chunk: usize,
    ecap: usize,
    split: Option<usize>,
) -> (Vec<u32>, Vec<f32>) {
    let mut model = Model::load(&picchio_runtime::ModelDir::open(dir).unwrap(), prompt.len() + n).unwrap();
    model.set_prefill_chunk(chunk).unwrap();
    let ecap = ecap.min(total_experts(&model));
    let mut run = new_run(&model, ecap);
    let s = split.unwrap_or(0);
    if s > 0 {
        model.prefill(&prompt[..s], 0, &mut run.cache, &mut run.loader).unwrap();
    }
    let first = model.prefill(&prompt[s..], s, &mut run.cache, &mut run.loader).unwrap().to_vec();
    decode(&mut model, first, prompt.len(), n, &mut run)
}

/// Every chunk size and cache capacity against the token-by-token rows, bit for bit, and the greedy
/// ids against `want` (the reference's).
fn check_dir(what: &str, dir: &Path, prompt: &[u32], want: &[u32]) {
    let n = want.len();
    let (tokens, rows) = token_by_token(dir, prompt, n);
    assert_eq!(tokens, want, "{what}: token-by-token greedy ids vs reference");
    for chunk in [1usize, 3, 64] {
        for ecap in [1usize, 4, usize::MAX] {
            let (t, r) = chunked(dir, prompt, n, chunk, ecap, None);
            let case = format!("{what} chunk {chunk} ecap {ecap}");
            assert_eq!(t, want, "{case}: greedy ids");
            assert!(same_bits(&r, &rows), "{case}: logits differ from token by token");
        }
    }
    // From a start position (multi-turn reuse of the KV cache): prefill in two calls.
    let (t, r) = chunked(dir, prompt, n, 3, 4, Some(5));
    assert_eq!(t, want, "{what}: split prefill greedy ids");
    assert!(same_bits(&r, &rows), "{what}: split prefill logits differ");
    eprintln!("{what}: chunks 1/3/64 x ecap 1/4/all bit-identical to token by token, greedy ids exact");
}

/// Converts fixture `name` with each of `runs`' experts and checks it against that run's reference
/// file's greedy ids (with no reference file, against its own token-by-token tokens).
fn check_fixture(name: &str, runs: &[(QuantKind, Option<&str>)]) {
    let src = fixture(name);
    let tmp = tempfile::tempdir().unwrap();
    for &(experts, reference_file) in runs {
        let dst = tmp.path().join(format!("{name}-{experts}"));
        let opts = ConvertOptions { experts, progress: false, ..ConvertOptions::default() };
        convert(&src, &dst, &opts).unwrap_or_else(|e| panic!("convert {name}: {e}"));
        let r = reference_json(&src, reference_file.unwrap_or("reference_q4.json"));
        let prompt = ids(&r, "prompt_ids");
        let want = match reference_file {
            Some(_) => ids(&r, "greedy_ids"),
            // No reference for these experts: the token-by-token tokens are the reference.
            None => token_by_token(&dst, &prompt, 16).0,
        };
        check_dir(&format!("{name} --experts {experts}"), &dst, &prompt, &want);
    }
}

#[test]
fn qwen3_moe_chunked_prefill_equals_token_by_token() {
    check_fixture("qwen3_moe", &[(QuantKind::Q4, Some("reference_q4.json")), (QuantKind::F32, Some("reference.json"))]);
}

#[test]
fn qwen3_moe_wide_chunked_prefill_equals_token_by_token() {
    check_fixture("qwen3_moe_wide", &[(QuantKind::Q4, Some("reference_q4.json")), (QuantKind::Q3, None)]);
}

#[test]
fn qwen3_moe_text_chunked_prefill_equals_token_by_token() {
    check_fixture("qwen3_moe_text", &[(QuantKind::Q4, Some("reference_q4.json"))]);
}

#[test]
fn gpt_oss_mxfp4_chunked_prefill_equals_token_by_token() {
    // sliding_window 8 < the 12-token prompt: the window and the sinks are crossed inside a chunk
    check_fixture(
        "gpt_oss_mxfp4",
        &[(QuantKind::Q4, Some("reference_q4.json")), (QuantKind::F32, Some("reference.json"))],
    );
}

#[test]
fn gpt_oss_bf16_chunked_prefill_equals_token_by_token() {
    check_fixture("gpt_oss_bf16", &[(QuantKind::Q4, Some("reference_q4.json"))]);
}

#[test]
fn picchio_c_chunked_prefill_equals_token_by_token() {
    // I8 embeddings and lm_head, F32 attention and router, Q4 experts (Picchio (C)'s own directory)
    let prompt = ids(&reference_json(&fixture("qwen3_moe"), "reference.json"), "prompt_ids");
    check_dir("picchio_c/qwen3_moe", &fixture("picchio_c/qwen3_moe"), &prompt, &PICCHIO_C_TOKENS);
}

#[test]
fn long_prompt_crosses_chunks_and_the_sliding_window() {
    // 40 positions of GPT-OSS (window 8, YaRN rope): chunks of 7 end inside and across windows.
    let src = fixture("gpt_oss_mxfp4");
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("gpt_oss");
    convert(&src, &dst, &ConvertOptions { progress: false, ..ConvertOptions::default() }).unwrap();
    let r = reference_json(&src, "reference_q4.json");
    let base: Vec<u32> = ids(&r, "prompt_ids").into_iter().chain(ids(&r, "greedy_ids")).collect();
    let prompt: Vec<u32> = base.iter().cycle().take(40).copied().collect();
    let (tokens, rows) = token_by_token(&dst, &prompt, 6);
    for (chunk, ecap) in [(7usize, 3usize), (16, 32), (64, 2)] {
        let (t, r) = chunked(&dst, &prompt, 6, chunk, ecap, None);
        assert_eq!(t, tokens, "chunk {chunk} ecap {ecap}");
        assert!(same_bits(&r, &rows), "chunk {chunk} ecap {ecap}: logits differ");
    }
}

/// One [`ExpertLoader::load`] call: the layer and the experts asked for.
type LoadCall = (u32, Vec<u32>);

/// A counting loader wrapper: records every load call (layer, experts) before passing it on.
struct CountingLoader<L> {
    inner: L,
    calls: Vec<LoadCall>,
}

impl<L: ExpertLoader> ExpertLoader for CountingLoader<L> {
    fn describe(&self) -> String {
        format!("counting({})", self.inner.describe())
    }
    fn load(&mut self, layer: u32, requests: Vec<(u32, AlignedBuf)>, ready: &mut dyn FnMut(Loaded)) {
        self.calls.push((layer, requests.iter().map(|(e, _)| *e).collect()));
        self.inner.load(layer, requests, ready);
    }
}

/// One routing decision: `(layer, pos, experts, weight bits)`.
type Decision = (usize, usize, Vec<u32>, Vec<u32>);

/// Records every routing decision.
struct Recorder(Arc<Mutex<Vec<Decision>>>);

impl RoutingObserver for Recorder {
    fn routed(&mut self, layer: usize, pos: usize, experts: &[u32], weights: &[f32]) {
        let w = weights.iter().map(|v| v.to_bits()).collect();
        self.0.lock().unwrap().push((layer, pos, experts.to_vec(), w));
    }
}

fn q4_qwen3(tmp: &Path) -> PathBuf {
    let dst = tmp.join("qwen3_moe");
    convert(&fixture("qwen3_moe"), &dst, &ConvertOptions { progress: false, ..ConvertOptions::default() }).unwrap();
    dst
}

/// The routing decisions of a prefill of `prompt` at `chunk`, and the loader's calls.
fn routed_prefill(dir: &Path, prompt: &[u32], chunk: usize, ecap: usize) -> (Vec<Decision>, Vec<LoadCall>) {
    let mut model = Model::load(&picchio_runtime::ModelDir::open(dir).unwrap(), prompt.len()).unwrap();
    model.set_prefill_chunk(chunk).unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    model.set_routing_observer(Box::new(Recorder(Arc::clone(&log))));
    let mut cache = model.new_cache(ecap).unwrap();
    let mut loader = CountingLoader { inner: model.in_place_loader(), calls: Vec::new() };
    model.prefill(prompt, 0, &mut cache, &mut loader).unwrap();
    model.take_routing_observer().unwrap();
    let records = log.lock().unwrap().clone();
    (records, loader.calls)
}

#[test]
fn each_distinct_expert_of_a_chunk_is_loaded_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = q4_qwen3(tmp.path());
    let prompt = ids(&reference_json(&fixture("qwen3_moe"), "reference.json"), "prompt_ids");
    let cfg = picchio_runtime::Config::from_dir(&dir).unwrap();
    let total = cfg.moe_layers().len() * cfg.num_experts;
    let (by_token, _) = routed_prefill(&dir, &prompt, 1, total);
    // The union of each layer's routed experts over chunks of `chunk` positions.
    let unions = |chunk: usize| -> BTreeMap<(usize, usize), BTreeSet<u32>> {
        let mut u: BTreeMap<(usize, usize), BTreeSet<u32>> = BTreeMap::new();
        for (l, pos, e, _) in &by_token {
            u.entry((pos / chunk, *l)).or_default().extend(e.iter().copied());
        }
        u
    };

    // The cache holds every expert: per chunk and layer one load call with exactly the experts of the
    // union not loaded by an earlier chunk; no expert is ever loaded twice.
    for chunk in [3usize, 64] {
        let (records, calls) = routed_prefill(&dir, &prompt, chunk, total);
        let mut loaded: BTreeSet<(u32, u32)> = BTreeSet::new();
        let mut want_calls = Vec::new();
        for ((_, l), union) in unions(chunk) {
            let fresh: Vec<u32> = union.iter().copied().filter(|&e| !loaded.contains(&(l as u32, e))).collect();
            loaded.extend(fresh.iter().map(|&e| (l as u32, e)));
            if !fresh.is_empty() {
                want_calls.push((l as u32, fresh));
            }
        }
        let mut got = calls.clone();
        for c in &mut got {
            c.1.sort_unstable();
        }
        assert_eq!(got, want_calls, "chunk {chunk}: one load per layer and chunk, of the new experts of the union");
        // The observer saw every token's decision once, the same ones; layer-major within a chunk.
        let mut sorted = records.clone();
        sorted.sort_by_key(|r| (r.1, r.0));
        assert_eq!(sorted, by_token, "chunk {chunk}: routing decisions");
        let order: Vec<(usize, usize, usize)> = records.iter().map(|r| (r.1 / chunk, r.0, r.1)).collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "chunk {chunk}: chunk, then layer, then position order");
    }

    // A cache smaller than the union (and than top-k): still each distinct expert of a chunk loaded
    // at most once per chunk, in batches of at most the capacity.
    for ecap in [1usize, 4] {
        let chunk = 64;
        let (_, calls) = routed_prefill(&dir, &prompt, chunk, ecap);
        let mut per_layer: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for (l, e) in &calls {
            assert!(e.len() <= ecap, "ecap {ecap}: a batch of {} experts", e.len());
            per_layer.entry(*l).or_default().extend(e);
        }
        for ((_, l), union) in unions(chunk) {
            let mut got = per_layer.remove(&(l as u32)).unwrap_or_default();
            got.sort_unstable();
            let want: Vec<u32> = union.into_iter().collect();
            assert_eq!(got, want, "ecap {ecap} layer {l}: every expert of the union exactly once");
        }
    }
}

#[test]
fn prefill_checks_its_arguments() {
    let dir = fixture("picchio_c/qwen3_moe");
    let mut m = Model::load(&picchio_runtime::ModelDir::open(&dir).unwrap(), 8).unwrap();
    let mut cache = m.new_cache(4).unwrap();
    let mut loader = m.in_place_loader();
    let e = m.prefill(&[], 0, &mut cache, &mut loader).unwrap_err().to_string();
    assert!(e.contains("empty") || e.contains("prompt"), "{e}");
    let e = m.prefill(&[1, 4096], 0, &mut cache, &mut loader).unwrap_err().to_string();
    assert!(e.contains("token id 4096"), "{e}");
    let e = m.prefill(&[1, 2, 3], 6, &mut cache, &mut loader).unwrap_err().to_string();
    assert!(e.contains("position 8") && e.contains("8 positions"), "{e}");
    let mut other = picchio_runtime::expert::cache::ExpertCache::new(4, 100).unwrap();
    let e = m.prefill(&[1], 0, &mut other, &mut loader).unwrap_err().to_string();
    assert!(e.contains("100-byte payloads"), "{e}");
    let e = m.set_prefill_chunk(0).unwrap_err().to_string();
    assert!(e.contains("prefill-chunk"), "{e}");
    assert_eq!(m.prefill_chunk(), picchio_runtime::model::prefill::DEFAULT_PREFILL_CHUNK);
}
