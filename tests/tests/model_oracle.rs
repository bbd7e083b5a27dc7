//! Oracle tests of the Qwen3-MoE and GPT-OSS forward passes against Hugging Face transformers
//! (tests/fixtures).
//!
//! - `picchio_c/qwen3_moe` (converted by Picchio (C): Q4 experts, I8 embeddings and lm_head): greedy
//!   ids equal the ones Picchio (C) printed, for expert-cache capacities 1, 4 and all, with the
//!   experts delivered in any order.
//! - Every Qwen3-MoE fixture converted by `picchio convert` with experts `none` (against
//!   `reference.*`: greedy ids exact, logits, hidden states and router logits within 1e-4) and `q4`
//!   (against `reference_q4.*`: greedy ids exact, the same within 1e-3).
//! - Both GPT-OSS fixtures (`gpt_oss_mxfp4`: openai's MXFP4 experts; `gpt_oss_bf16`: transformers'
//!   BF16 layout) the same way: they are one model, so both compare with their own (identical)
//!   references.
//!
//! `logits` row t of a reference is the no-cache prediction after token t of prompt + greedy; with the
//! KV cache, feeding prompt + greedy one token at a time gives the same rows.

use std::path::{Path, PathBuf};

use picchio_core::{AlignedBuf, ExpertLoader, Loaded};
use picchio_runtime::expert::cache::ExpertCache;
use picchio_runtime::image::convert::{convert, ConvertOptions};
use picchio_runtime::model::sampler::argmax;
use picchio_runtime::model::{Model, Trace};
use picchio_runtime::quant::QuantKind;
use safetensors::tensor::{Dtype, SafeTensors};

/// What Picchio (C) v0.8.0 generated from `picchio_c/qwen3_moe` (tests/fixtures/picchio_c/README.md).
const PICCHIO_C_GREEDY: [u32; 16] =
    [731, 1930, 347, 2860, 3377, 3184, 3525, 2504, 41, 2411, 547, 193, 3590, 3840, 3815, 1426];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// A reference file (`reference.safetensors` / `reference_q4.safetensors`), read whole.
struct Reference {
    name: String,
    bytes: Vec<u8>,
}

impl Reference {
    fn open(path: &Path) -> Reference {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Reference { name: path.display().to_string(), bytes }
    }

    fn st(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).unwrap_or_else(|e| panic!("{}: {e}", self.name))
    }

    fn has(&self, name: &str) -> bool {
        self.st().names().contains(&name)
    }

    /// An F32 tensor as `(values, shape)`.
    fn f32(&self, name: &str) -> (Vec<f32>, Vec<usize>) {
        let st = self.st();
        let t = st.tensor(name).unwrap_or_else(|e| panic!("{}: {name}: {e}", self.name));
        assert_eq!(t.dtype(), Dtype::F32, "{}: {name}", self.name);
        let v = t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        (v, t.shape().to_vec())
    }

    /// An I64 tensor as u32 ids.
    fn ids(&self, name: &str) -> Vec<u32> {
        let st = self.st();
        let t = st.tensor(name).unwrap_or_else(|e| panic!("{}: {name}: {e}", self.name));
        assert_eq!(t.dtype(), Dtype::I64, "{}: {name}", self.name);
        t.data().chunks_exact(8).map(|c| u32::try_from(i64::from_le_bytes(c.try_into().unwrap())).unwrap()).collect()
    }
}

/// Greedy generation of `n` tokens after `prompt` (positions from 0); returns the tokens and the
/// logits of every forward pass, concatenated.
fn greedy(
    model: &mut Model,
    cache: &mut ExpertCache,
    loader: &mut dyn ExpertLoader,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, Vec<f32>) {
    let mut all_logits = Vec::new();
    let mut out = Vec::with_capacity(n);
    let mut next = 0;
    for (pos, &t) in prompt.iter().enumerate() {
        let logits = model.forward(t, pos, cache, loader).unwrap();
        all_logits.extend_from_slice(logits);
        next = argmax(logits);
    }
    let mut pos = prompt.len();
    loop {
        out.push(next);
        if out.len() == n {
            break;
        }
        let logits = model.forward(next, pos, cache, loader).unwrap();
        all_logits.extend_from_slice(logits);
        next = argmax(logits);
        pos += 1;
    }
    (out, all_logits)
}

/// Wraps a loader and hands its experts back in the reverse of their completion order, so a test can
/// check that the result does not depend on the order loads complete in.
struct Reversed<L>(L);

impl<L: ExpertLoader> ExpertLoader for Reversed<L> {
    fn describe(&self) -> String {
        format!("reversed({})", self.0.describe())
    }
    fn load(&mut self, layer: u32, requests: Vec<(u32, AlignedBuf)>, ready: &mut dyn FnMut(Loaded)) {
        let mut got = Vec::new();
        self.0.load(layer, requests, &mut |l| got.push(l));
        for l in got.into_iter().rev() {
            ready(l);
        }
    }
}

#[test]
fn picchio_c_directory_generates_picchio_c_tokens_at_every_cache_capacity() {
    let dir = fixtures().join("picchio_c/qwen3_moe");
    let reference = Reference::open(&fixtures().join("qwen3_moe/reference.safetensors"));
    let prompt = reference.ids("prompt_ids");
    assert_eq!(prompt.len(), 12);
    let mut model = Model::load(&picchio_runtime::ModelDir::open(&dir).unwrap(), 28).unwrap();
    let cfg = model.config().clone();
    let total = cfg.moe_layers().len() * cfg.num_experts;
    assert_eq!(total, 48);
    // forward passes: the prompt, then every generated token but the last
    let uses = ((prompt.len() + 15) * cfg.moe_layers().len() * cfg.num_experts_per_tok) as u64;

    let mut first_logits: Option<Vec<f32>> = None;
    let mut all_misses = 0;
    for (cap, reversed) in [(total, false), (12, false), (4, false), (1, false), (4, true), (1, true)] {
        let mut cache = model.new_cache(cap).unwrap();
        let plain = model.in_place_loader();
        let mut loader: Box<dyn ExpertLoader> = if reversed { Box::new(Reversed(plain)) } else { Box::new(plain) };
        let (tokens, logits) = greedy(&mut model, &mut cache, &mut *loader, &prompt, 16);
        eprintln!(
            "picchio_c ecap {cap:>2}{}: hits {} misses {} (allocated {} slots of {} B)",
            if reversed { " reversed" } else { "" },
            cache.hits(),
            cache.misses(),
            cache.allocated(),
            cache.slot_len()
        );
        assert_eq!(tokens, PICCHIO_C_GREEDY, "ecap {cap} reversed {reversed}");
        assert_eq!(cache.hits() + cache.misses(), uses, "ecap {cap}: every expert use is a hit or a miss");
        assert!(cache.allocated() <= cap && cache.len() <= cap);
        match cap {
            48 => {
                // every expert is loaded once at most, then always hit
                assert!(cache.misses() <= 48 && cache.misses() == cache.allocated() as u64);
                all_misses = cache.misses();
            }
            // at most top-k slots: each layer's experts evict the previous layer's, never a hit
            1 | 4 => assert_eq!((cache.hits(), cache.misses()), (0, uses)),
            // room for one token's 12 experts: an expert routed again at the next token is a hit
            _ => assert!(cache.hits() > 0 && cache.misses() >= all_misses && cache.misses() < uses),
        }
        // the sum over experts is in canonical order: bit-identical logits whatever the capacity
        // and the completion order
        match &first_logits {
            None => first_logits = Some(logits),
            Some(f) => assert!(f.iter().zip(&logits).all(|(a, b)| a.to_bits() == b.to_bits()), "ecap {cap}"),
        }
    }
}

/// Largest `|a - b|`, asserting it is at most `tol`; `what` names the comparison.
fn max_err(what: &str, ours: &[f32], want: &[f32], tol: f32) -> f32 {
    assert_eq!(ours.len(), want.len(), "{what}: lengths");
    let mut worst = (0f32, 0usize);
    for (i, (a, b)) in ours.iter().zip(want).enumerate() {
        let d = (a - b).abs();
        if d > worst.0 || d.is_nan() {
            worst = (d, i);
        }
    }
    assert!(
        worst.0 <= tol,
        "{what}: |{} - {}| = {} at {} exceeds {tol}",
        ours[worst.1],
        want[worst.1],
        worst.0,
        worst.1
    );
    worst.0
}

/// The largest errors seen in one oracle run.
#[derive(Debug, Default)]
struct Errors {
    logits: f32,
    hidden: f32,
    router: f32,
}

/// Feeds prompt + greedy of `reference` through the converted model in `dir` one token at a time and
/// compares every row: greedy ids exactly (argmax of row t for t >= P - 1), logits (or the top-64
/// logits at their ids), hidden states and router logits within `tol`, and the picked experts.
fn check_against_reference(dir: &Path, reference: &Reference, tol: f32) -> Errors {
    let prompt = reference.ids("prompt_ids");
    let greedy_ids = reference.ids("greedy_ids");
    let tokens: Vec<u32> = prompt.iter().chain(&greedy_ids).copied().collect();
    let t_len = tokens.len();
    let mut model = Model::load(&picchio_runtime::ModelDir::open(dir).unwrap(), t_len).unwrap();
    let cfg = model.config().clone();
    let (h, v, n_layers) = (cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers);
    let full_logits = reference.has("logits").then(|| reference.f32("logits"));
    let topk =
        (!reference.has("logits")).then(|| (reference.f32("logits_topk_values"), reference.ids("logits_topk_ids")));
    let hidden: Vec<(Vec<f32>, Vec<usize>)> =
        (0..=n_layers).map(|i| reference.f32(&format!("hidden_states.{i}"))).collect();
    for (hs, shape) in &hidden {
        assert_eq!(shape, &[t_len, h]);
        assert_eq!(hs.len(), t_len * h);
    }
    let routers: Vec<Option<Vec<f32>>> = (0..n_layers)
        .map(|l| {
            let name = format!("router_logits.{l}");
            assert_eq!(reference.has(&name), cfg.is_moe_layer(l), "{name}");
            reference.has(&name).then(|| reference.f32(&name).0)
        })
        .collect();
    let e = cfg.num_experts;

    let mut cache = model.new_cache(cfg.moe_layers().len() * e).unwrap();
    let mut loader = model.in_place_loader();
    let mut trace = Trace::new(&cfg);
    let mut errs = Errors::default();
    let mut ours_greedy = Vec::new();
    for (t, &tok) in tokens.iter().enumerate() {
        let logits = model.forward_traced(tok, t, &mut cache, &mut loader, Some(&mut trace)).unwrap();
        let what = |x: &str| format!("{} row {t}: {x}", reference.name);
        match (&full_logits, &topk) {
            (Some((lg, shape)), _) => {
                assert_eq!(shape, &[t_len, v]);
                errs.logits = errs.logits.max(max_err(&what("logits"), logits, &lg[t * v..(t + 1) * v], tol));
            }
            (None, Some(((vals, shape), ids))) => {
                let k = shape[1];
                let ids = &ids[t * k..(t + 1) * k];
                let ours: Vec<f32> = ids.iter().map(|&i| logits[i as usize]).collect();
                errs.logits = errs.logits.max(max_err(&what("top-64 logits"), &ours, &vals[t * k..(t + 1) * k], tol));
                assert_eq!(argmax(logits), ids[0], "{}", what("argmax vs logits_topk_ids[0]"));
            }
            _ => unreachable!(),
        }
        if t + 1 >= prompt.len() && ours_greedy.len() < greedy_ids.len() {
            ours_greedy.push(argmax(logits));
        }
        for (i, (hs, _)) in hidden.iter().enumerate() {
            let d = max_err(&what(&format!("hidden_states.{i}")), &trace.hidden[i], &hs[t * h..(t + 1) * h], tol);
            errs.hidden = errs.hidden.max(d);
        }
        for (l, r) in routers.iter().enumerate() {
            let Some(r) = r else {
                assert!(trace.router_logits[l].is_empty());
                continue;
            };
            let want = &r[t * e..(t + 1) * e];
            let d = max_err(&what(&format!("router_logits.{l}")), &trace.router_logits[l], want, tol);
            errs.router = errs.router.max(d);
            // the same experts as top-k of the reference logits (canonical order)
            let mut order: Vec<u32> = (0..e as u32).collect();
            order.sort_by(|&a, &b| want[b as usize].total_cmp(&want[a as usize]).then(a.cmp(&b)));
            assert_eq!(
                trace.experts[l],
                order[..cfg.num_experts_per_tok],
                "{}",
                what(&format!("experts of layer {l}"))
            );
        }
    }
    assert_eq!(ours_greedy, greedy_ids, "{}: greedy ids", reference.name);
    errs
}

/// Converts fixture `name` with `experts` into a temporary directory and checks it against its
/// reference (`reference` for `none`, `reference_q4` for `q4`).
fn convert_and_check(name: &str, experts: QuantKind) {
    let src = fixtures().join(name);
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join(format!("{name}-{experts}"));
    let opts = ConvertOptions { experts, progress: false, ..ConvertOptions::default() };
    convert(&src, &dst, &opts).unwrap_or_else(|e| panic!("convert {name} --experts {experts}: {e}"));
    let (file, tol) = match experts {
        QuantKind::F32 => ("reference.safetensors", 1e-4),
        QuantKind::Q4 => ("reference_q4.safetensors", 1e-3),
        QuantKind::Q3 => unreachable!("no Q3 reference"),
    };
    let reference = Reference::open(&src.join(file));
    let errs = check_against_reference(&dst, &reference, tol);
    eprintln!("{name} --experts {experts}: max |error| vs {file}: {errs:?}");
}

#[test]
fn qwen3_moe_none_matches_transformers() {
    convert_and_check("qwen3_moe", QuantKind::F32);
}

#[test]
fn qwen3_moe_q4_matches_transformers_q4() {
    convert_and_check("qwen3_moe", QuantKind::Q4);
}

#[test]
fn qwen3_moe_wide_none_matches_transformers() {
    convert_and_check("qwen3_moe_wide", QuantKind::F32);
}

#[test]
fn qwen3_moe_wide_q4_matches_transformers_q4() {
    convert_and_check("qwen3_moe_wide", QuantKind::Q4);
}

#[test]
fn qwen3_moe_text_none_matches_transformers() {
    convert_and_check("qwen3_moe_text", QuantKind::F32);
}

#[test]
fn qwen3_moe_text_q4_matches_transformers_q4() {
    convert_and_check("qwen3_moe_text", QuantKind::Q4);
}

#[test]
fn gpt_oss_mxfp4_none_matches_transformers() {
    convert_and_check("gpt_oss_mxfp4", QuantKind::F32);
}

#[test]
fn gpt_oss_mxfp4_q4_matches_transformers_q4() {
    convert_and_check("gpt_oss_mxfp4", QuantKind::Q4);
}

#[test]
fn gpt_oss_bf16_none_matches_transformers() {
    convert_and_check("gpt_oss_bf16", QuantKind::F32);
}

#[test]
fn gpt_oss_bf16_q4_matches_transformers_q4() {
    convert_and_check("gpt_oss_bf16", QuantKind::Q4);
}

/// Qwen3-MoE with YaRN `rope_scaling` (its long-context opt-in) runs: no transformers reference
/// exists for it in the fixtures (see tests/fixtures/README.md), so this checks what follows from
/// the math: position 0 attends to itself only (softmax of one score is 1 whatever RoPE does), so
/// its logits are bit-identical to the unscaled model's; later positions differ; all are finite.
#[test]
fn qwen3_moe_with_yarn_rope_scaling_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let plain = tmp.path().join("plain");
    let opts = ConvertOptions { experts: QuantKind::F32, progress: false, ..ConvertOptions::default() };
    convert(&fixtures().join("qwen3_moe"), &plain, &opts).unwrap();
    let yarn = tmp.path().join("yarn");
    std::fs::create_dir(&yarn).unwrap();
    for e in std::fs::read_dir(&plain).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, yarn.join(p.file_name().unwrap())).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(yarn.join("config.json")).unwrap()).unwrap();
    cfg["rope_scaling"] =
        serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8});
    std::fs::write(yarn.join("config.json"), cfg.to_string()).unwrap();
    let prompt = Reference::open(&fixtures().join("qwen3_moe/reference.safetensors")).ids("prompt_ids");
    let run = |dir: &Path| {
        let mut model = Model::load(&picchio_runtime::ModelDir::open(dir).unwrap(), prompt.len() + 4).unwrap();
        let mut cache = model.new_cache(48).unwrap();
        let mut loader = model.in_place_loader();
        greedy(&mut model, &mut cache, &mut loader, &prompt, 4)
    };
    let ((_, a), (tokens, b)) = (run(&plain), run(&yarn));
    assert_eq!(tokens.len(), 4);
    assert!(b.iter().all(|v| v.is_finite()));
    let v = 4096;
    assert!(a[..v].iter().zip(&b[..v]).all(|(x, y)| x.to_bits() == y.to_bits()), "position 0");
    assert!(a[v..].iter().zip(&b[v..]).any(|(x, y)| x != y), "YaRN changes the later positions");
}
