//! Routing traces as a user records and analyses them: `picchio run --trace` on Picchio (C)'s
//! fixture leaves the tokens and logits unchanged and writes one record per MoE layer per forward
//! pass; the runtime's own cache counters equal the LRU simulation replayed on that trace; and
//! `picchio bench trace` / `picchio bench plot` produce a consistent report and valid SVG charts.
//! Structure and internal consistency only, never speeds.

mod common;
use common::{bench_with_report, image, model, ok, on_model, picchio, scratch, svg_count};

use std::path::Path;

use picchio_bench::trace::{simulate_belady, simulate_lru, RoutingTrace, TRACE_FORMAT};
use serde_json::Value;

const PROMPT: &str = "1,2,3,4,5";
const N: usize = 12;

/// `picchio run ... --json` with extra arguments; returns the JSON object.
fn run_json(extra: &[&str]) -> Value {
    let n = N.to_string();
    let m = model();
    let mut args = vec!["run", "--model", m.to_str().unwrap(), "--prompt-ids", PROMPT, "-n", &n, "--json"];
    args.extend_from_slice(extra);
    serde_json::from_str(ok(&args).trim()).unwrap()
}

fn tokens(v: &Value) -> Vec<u64> {
    v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
}

#[test]
fn tracing_changes_neither_tokens_nor_logits() {
    let dir = scratch();
    let store = image();
    for engine in [["--io", "psync"], ["--io", "uring"]] {
        let (la, lb) = (dir.path().join("a.safetensors"), dir.path().join("b.safetensors"));
        let trace = dir.path().join("t.jsonl");
        // --trace prefills token by token (a picchio-trace/1 file is in position order): the
        // untraced run it is compared with, misses included, does too; the default chunked prefill
        // gives the same tokens and logits.
        let lc = dir.path().join("c.safetensors");
        // `run --json --store STORE --ecap 5 --dump-logits LOGITS MORE... ENGINE`.
        let run = |logits: &Path, more: &[&str]| {
            let base = ["--store", store.as_str(), "--ecap", "5", "--dump-logits", logits.to_str().unwrap()];
            run_json(&[&base[..], more, &engine[..]].concat())
        };
        let c = run(&lc, &[]);
        let a = run(&la, &["--prefill-chunk", "1"]);
        assert_eq!(tokens(&a), tokens(&c), "{engine:?}: chunked prefill");
        assert_eq!(std::fs::read(&la).unwrap(), std::fs::read(&lc).unwrap(), "logits differ with chunked prefill");
        let b = run(&lb, &["--trace", trace.to_str().unwrap()]);
        assert_eq!(tokens(&a), tokens(&b), "{engine:?}");
        assert_eq!(tokens(&a).len(), N);
        assert_eq!(std::fs::read(&la).unwrap(), std::fs::read(&lb).unwrap(), "logits differ with --trace");
        assert_eq!(a["stats"]["cache_misses"], b["stats"]["cache_misses"]);

        // One record per MoE layer per forward pass: the prompt, then each generated token but the
        // last (which is sampled, not run), positions in order, layers in order within a position.
        let t = RoutingTrace::read(&trace).unwrap();
        assert_eq!(t.header.format, TRACE_FORMAT);
        assert_eq!((t.header.moe_layers.clone(), t.header.num_experts, t.header.top_k), (vec![0, 1, 2], 16, 4));
        assert_eq!(t.header.expert_bytes % 4096, 0);
        let forwards = 5 + N - 1;
        assert_eq!(t.records.len(), forwards * 3);
        for (i, r) in t.records.iter().enumerate() {
            assert_eq!((r.t as usize, r.l as usize), (i / 3, i % 3), "record {i}");
            let sum: f32 = r.w.iter().sum();
            assert!((sum - 1.0).abs() < 1e-5, "norm_topk_prob weights sum to {sum}");
            assert!(r.w.windows(2).all(|w| w[0] >= w[1]), "canonical order is descending weight: {:?}", r.w);
        }
        let accesses = t.records.len() as u64 * 4;
        let st = &b["stats"];
        assert_eq!(st["cache_hits"].as_u64().unwrap() + st["cache_misses"].as_u64().unwrap(), accesses);
    }
}

#[test]
fn lru_simulation_replays_the_runtime_cache_exactly() {
    // Loaders that complete in request order (safetensors; psync with one thread) insert misses in
    // the order the simulation does, so hit counts must be equal at every capacity.
    let dir = scratch();
    let store = image();
    let loaders: [&[&str]; 2] =
        [&["--store", "safetensors"], &["--store", &store, "--io", "psync", "--io-threads", "1"]];
    for loader in loaders {
        for ecap in [1usize, 3, 4, 8, 12, 20, 48] {
            let trace = dir.path().join(format!("t{ecap}.jsonl"));
            let e = ecap.to_string();
            let mut args = vec!["--ecap", &e, "--trace", trace.to_str().unwrap()];
            args.extend_from_slice(loader);
            let v = run_json(&args);
            let t = RoutingTrace::read(&trace).unwrap();
            let sim = simulate_lru(&t.requests(), ecap);
            let st = &v["stats"];
            assert_eq!(
                (st["cache_hits"].as_u64().unwrap(), st["cache_misses"].as_u64().unwrap()),
                (sim.hits, sim.misses),
                "{loader:?} ecap {ecap}"
            );
            assert!(simulate_belady(&t.requests(), ecap).hits >= sim.hits);
        }
    }
}

/// Asserts that each of the charts `names` in `dir` is valid SVG with its axes' labels and marks.
fn charts_ok(dir: &Path, names: &[&str]) {
    for name in names {
        let path = dir.join(name);
        let (lines, texts) = (svg_count(&path, &["polyline", "path", "line"]), svg_count(&path, &["text"]));
        assert!(lines > 2 && texts > 4, "{}: {lines} lines, {texts} texts", path.display());
    }
}

/// Checks a `trace` report's structure and the consistency of its numbers.
fn check_trace_report(r: &Value, want_caps: &[u64]) {
    assert_eq!(r["schema"], "picchio-bench/1");
    assert_eq!(r["experiment"], "trace");
    assert!(r["environment"]["cpu"]["logical_cpus"].as_u64().unwrap() >= 1);
    let res = &r["results"];
    let (k, e) = (res["header"]["top_k"].as_u64().unwrap(), res["header"]["num_experts"].as_u64().unwrap());
    let records = res["records"].as_u64().unwrap();
    assert_eq!(res["working_set"].as_u64().unwrap(), 3 * k, "MoE layers x k");
    // LRU cannot hit at a capacity of at most (MoE layers - 1) x k: every other layer runs between
    // two uses of an expert.
    let no_hit = res["lru_no_hit_capacity"].as_u64().unwrap();
    assert_eq!(no_hit, 2 * k);
    for c in res["capacities"].as_array().unwrap() {
        if c["capacity"].as_u64().unwrap() <= no_hit {
            assert_eq!(c["lru_hit_rate"].as_f64().unwrap(), 0.0, "{c}");
        }
    }
    let expert_bytes = res["header"]["expert_bytes"].as_u64().unwrap();
    let layers = res["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 3);
    let mut uses = 0;
    for l in layers {
        let counts: Vec<u64> = l["counts"].as_array().unwrap().iter().map(|c| c.as_u64().unwrap()).collect();
        assert_eq!(counts.len() as u64, e);
        assert_eq!(counts.iter().sum::<u64>(), l["tokens"].as_u64().unwrap() * k);
        assert_eq!(counts.iter().filter(|&&c| c > 0).count() as u64, l["experts_used"].as_u64().unwrap());
        let h = l["entropy_bits"].as_f64().unwrap();
        assert!(h >= 0.0 && h <= (e as f64).log2() + 1e-9);
        let reuse = l["reuse"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&reuse));
        uses += counts.iter().sum::<u64>();
    }
    assert_eq!(uses, records * k);
    let caps = res["capacities"].as_array().unwrap();
    let got: Vec<u64> = caps.iter().map(|c| c["capacity"].as_u64().unwrap()).collect();
    assert_eq!(got, want_caps);
    let mut last_belady = 0;
    for c in caps {
        let acc = c["accesses"].as_u64().unwrap();
        assert_eq!(acc, records * k);
        for p in ["lru", "belady"] {
            let (h, m) = (c[p]["hits"].as_u64().unwrap(), c[p]["misses"].as_u64().unwrap());
            assert_eq!(h + m, acc, "{p}: hits + misses = accesses");
            assert_eq!(c[format!("{p}_bytes")].as_u64().unwrap(), m * expert_bytes, "{p}: bytes = misses x expert");
            let rate = c[format!("{p}_hit_rate")].as_f64().unwrap();
            assert!((rate - h as f64 / acc as f64).abs() < 1e-12);
        }
        let (lru, opt) = (c["lru"]["hits"].as_u64().unwrap(), c["belady"]["hits"].as_u64().unwrap());
        assert!(opt >= lru, "Belady {opt} < LRU {lru}");
        assert!(opt >= last_belady, "Belady hits fall as capacity grows");
        last_belady = opt;
    }
    // With room for every expert both policies only take the compulsory misses.
    let all = caps.last().unwrap();
    assert_eq!(all["lru"], all["belady"]);
}

#[test]
fn bench_trace_reports_and_plots_from_a_recorded_or_given_trace() {
    let dir = scratch();
    let trace = dir.path().join("t.jsonl");
    // Record by running the model, then analyse.
    let (m, store) = (model(), image());
    let rest = ["--prompt-ids", PROMPT, "-n", "24", "--trace", trace.to_str().unwrap(), "--ecap", "48,4,12,1,24"];
    let (out, r, plots) = bench_with_report(&on_model(&["bench", "trace"], &m, &store, &rest), dir.path(), "r");
    assert!(out.contains("LRU") && out.contains("Belady"), "{out}");
    check_trace_report(&r, &[1, 4, 12, 24, 48]);
    assert_eq!(r["results"]["tokens"], 5 + 24 - 1);
    charts_ok(&plots, &["trace-hit-rate.svg", "trace-popularity.svg"]);
    // The same trace analysed on its own, with the default capacities.
    let json2 = dir.path().join("r2.json");
    ok(&["bench", "trace", "--trace", trace.to_str().unwrap(), "--json", json2.to_str().unwrap()]);
    let r2: Value = serde_json::from_str(&std::fs::read_to_string(&json2).unwrap()).unwrap();
    // k=4, 2k=8, then 5..100% of 48: 2, 5, 10, 14, 24, 36, 48.
    check_trace_report(&r2, &[2, 4, 5, 8, 10, 14, 24, 36, 48]);
    assert_eq!(r2["results"]["layers"], r["results"]["layers"]);
    // Charts redrawn from the saved report.
    let again = dir.path().join("again");
    let json = dir.path().join("r.json");
    let listed = ok(&["bench", "plot", json.to_str().unwrap(), "--out", again.to_str().unwrap()]);
    assert_eq!(listed.lines().count(), 2, "{listed}");
    charts_ok(&again, &["trace-hit-rate.svg", "trace-popularity.svg"]);
}

#[test]
fn bad_traces_and_paths_are_refused_with_the_file_and_line() {
    let dir = scratch();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"format\":\"picchio-trace/1\",\"model\":\"m\",\"num_layers\":1,\"moe_layers\":[0],\"num_experts\":4,\"top_k\":2,\"norm_topk_prob\":true,\"expert_bytes\":4096}\n{\"l\":0,\"t\":0,\"e\":[1,9],\"w\":[0.5,0.5]}\n").unwrap();
    let o = picchio(&["bench", "trace", "--trace", bad.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("bad.jsonl: line 2") && err.contains("expert 9"), "{err}");
    // --trace never replaces a file that is not a trace (here: the model's config).
    let cfg = dir.path().join("config.json");
    std::fs::write(&cfg, "{}").unwrap();
    let m = model();
    let ms = m.to_str().unwrap();
    let o = picchio(&["run", "--model", ms, "--prompt-ids", "1,2", "-n", "2", "--trace", cfg.to_str().unwrap()]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("not a picchio-trace/1 trace"));
    assert_eq!(std::fs::read_to_string(&cfg).unwrap(), "{}");
}

#[test]
fn recording_over_an_existing_trace_is_refused_unless_forced() {
    let dir = scratch();
    let trace = dir.path().join("t.jsonl");
    let m = model();
    let (ms, ts, store) = (m.to_str().unwrap(), trace.to_str().unwrap(), image());
    let record = |extra: &[&str]| {
        let mut args = vec!["bench", "trace", "--model", ms, "--store", &store, "--prompt-ids", PROMPT];
        args.extend_from_slice(&["--trace", ts]);
        args.extend_from_slice(extra);
        picchio(&args)
    };
    let o = record(&["-n", "4"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let first = std::fs::read(&trace).unwrap();
    // Again without --force: refused before the model runs, naming the flag and the file; kept.
    let o = record(&["-n", "2"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("--trace {ts}: the file exists")) && err.contains("pass --force"), "{err}");
    assert!(!err.contains("prompt + "), "the model ran: {err}");
    assert_eq!(std::fs::read(&trace).unwrap(), first, "the recorded trace was changed");
    // Analysing it (no --model) reads it as before; with --force it is recorded anew.
    ok(&["bench", "trace", "--trace", ts]);
    let o = record(&["-n", "2", "--force"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let t = RoutingTrace::read(&trace).unwrap();
    assert_eq!(t.records.len(), 3 * (5 + 2 - 1), "the new trace: 3 MoE layers x 6 forward passes");
}
