//! `picchio bench cache` as a user runs it on Picchio (C)'s fixture: every (read mode, capacity)
//! point is a real run of the runtime; the report's counts add up (hits + misses = expert uses,
//! reads = misses, bytes = misses × slot), the tokens are the same at every point, the misses equal
//! the LRU simulation of the same run's routing trace, O_DIRECT reads all reach the device, and the
//! charts are valid SVG. Structure and consistency only, never speeds.

mod common;
#[cfg_attr(not(target_os = "linux"), allow(unused_imports))] // the Linux-only cases use the rest
use common::{bench_with_report, image, model, ok, on_model, picchio, private_model, read_json, scratch, svg_count};

use std::path::Path;

use picchio_bench::trace::{simulate_lru, RoutingTrace};
use serde_json::Value;

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

/// Asserts that each of the charts `names` in `dir` is valid SVG with its axes' labels and marks.
fn charts_ok(dir: &Path, names: &[&str]) {
    for name in names {
        let path = dir.join(name);
        let (texts, marks) = (svg_count(&path, &["text"]), svg_count(&path, &["circle"]));
        assert!(texts > 4 && marks >= 4, "{}: {texts} texts, {marks} point marks", path.display());
    }
}

const PROMPT: &str = "1,2,3,4,5";

#[test]
fn cache_sweep_is_consistent_and_matches_the_trace_simulation() {
    let dir = scratch();
    let (m, store) = (model(), image());
    // psync with one thread completes reads in request order: the runtime's LRU order is then the
    // simulation's, so misses can be compared exactly.
    let rest = [
        "--ecap",
        "48,1,12,4",
        "--reads",
        "direct,buffered",
        "--io",
        "psync",
        "--io-threads",
        "1",
        "--prompt-ids",
        PROMPT,
        "-n",
        "10",
    ];
    let (out, r, plots) = bench_with_report(&on_model(&["bench", "cache"], &m, &store, &rest), dir.path(), "c");
    assert!(out.contains("miss/token"), "{out}");
    assert_eq!((r["schema"].as_str(), r["experiment"].as_str()), (Some("picchio-bench/1"), Some("cache")));
    assert_eq!(r["flags"]["ecaps"], serde_json::json!([48, 1, 12, 4]));
    assert_eq!((r["flags"]["io"]["engine"].as_str(), u(&r["flags"]["io"]["threads"])), (Some("psync"), 1));
    assert!(r["environment"]["target"]["uri"].as_str().unwrap().ends_with("experts.picchioflat"));
    let res = &r["results"];
    let (layers, k, total, slot) =
        (u(&res["moe_layers"]), u(&res["top_k"]), u(&res["total_experts"]), u(&res["slot_bytes"]));
    assert_eq!((layers, k, total), (3, 4, 48));
    assert_eq!(slot % 4096, 0);
    assert!(slot >= u(&res["expert_bytes"]));
    let points = res["points"].as_array().unwrap();
    let order: Vec<(String, u64)> =
        points.iter().map(|p| (p["mode"].as_str().unwrap().to_string(), u(&p["ecap"]))).collect();
    let want: Vec<(String, u64)> =
        ["direct", "buffered"].iter().flat_map(|m| [1u64, 4, 12, 48].map(|e| (m.to_string(), e))).collect();
    assert_eq!(order, want, "mode-major, capacities ascending");

    // The routing of the same prompt, to replay.
    let trace = dir.path().join("t.jsonl");
    ok(&[
        "run",
        "--model",
        m.to_str().unwrap(),
        "--store",
        "safetensors",
        "--prompt-ids",
        PROMPT,
        "-n",
        "10",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    let requests = RoutingTrace::read(&trace).unwrap().requests();

    let tokens0 = &points[0]["tokens"];
    assert_eq!(tokens0.as_array().unwrap().len(), 10);
    for p in points {
        let ecap = u(&p["ecap"]);
        let what = format!("{} ecap {ecap}", p["mode"]);
        assert_eq!(&p["tokens"], tokens0, "{what}: the cache changed the output");
        for (phase, forwards) in [("prefill", 5), ("decode", 9)] {
            let c = &p[phase];
            assert_eq!(u(&c["forwards"]), forwards, "{what} {phase}");
            assert_eq!(u(&c["hits"]) + u(&c["misses"]), forwards * layers * k, "{what} {phase}: uses");
            assert_eq!(u(&c["reads"]), u(&c["misses"]), "{what} {phase}: one read per miss");
            assert_eq!(u(&c["bytes_read"]), u(&c["misses"]) * slot, "{what} {phase}: bytes = misses x slot");
            assert_eq!(u(&c["fallbacks"]), 0);
            #[cfg(target_os = "linux")]
            if p["mode"] == "direct" {
                // Every O_DIRECT read is a block-layer read accounted to this process.
                assert!(u(&c["device_bytes"]) >= u(&c["bytes_read"]), "{what} {phase}: {c}");
            }
        }
        let d = &p["decode"];
        let n = 9.0;
        assert!((p["misses_per_token"].as_f64().unwrap() - u(&d["misses"]) as f64 / n).abs() < 1e-9);
        assert!((p["bytes_per_token"].as_f64().unwrap() - u(&d["bytes_read"]) as f64 / n).abs() < 1e-6);
        assert_eq!(u(&p["cache_bytes"]), ecap * slot);
        assert!((p["cache_percent"].as_f64().unwrap() - 100.0 * ecap as f64 / 48.0).abs() < 1e-9);
        assert!(p["page_cache_dropped"].as_bool().unwrap());
        let sim = simulate_lru(&requests, ecap as usize);
        let misses = u(&p["prefill"]["misses"]) + u(&d["misses"]);
        assert_eq!(misses, sim.misses, "{what}: runtime misses vs LRU simulation of the trace");
    }
    // Everything fits at 48: only the 48-or-fewer compulsory misses, whatever the read mode.
    let full = &points[3];
    assert!(u(&full["prefill"]["misses"]) + u(&full["decode"]["misses"]) <= 48);
    charts_ok(&plots, &["cache-tok-s.svg", "cache-bytes.svg"]);
}

#[test]
fn cache_percent_and_bad_capacities() {
    let dir = scratch();
    let json = dir.path().join("c.json");
    let (m, store) = (model(), image());
    let base = on_model(&["bench", "cache"], &m, &store, &["--reads", "buffered"]);
    ok(&[&base[..], &["-n", "3", "--cache-percent", "10,100,10", "--json", json.to_str().unwrap()][..]].concat());
    let r = read_json(&json);
    let ecaps: Vec<u64> = r["results"]["points"].as_array().unwrap().iter().map(|p| u(&p["ecap"])).collect();
    assert_eq!(ecaps, [5, 48], "10% of 48 rounds to 5; duplicates dropped");
    for (extra, want) in [
        (&["--ecap", "0", "-n", "3"][..], "--ecap 0"),
        (&["--ecap", "49", "-n", "3"][..], "only 48 routed experts"),
        (&["--cache-percent", "0", "-n", "3"][..], "(0, 100]"),
        (&["--ecap", "4", "-n", "1"][..], "-n 1"),
    ] {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        let o = picchio(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{extra:?}: {err}");
    }
    let o = picchio(&["bench", "cache", "--synthetic-gb", "0", "--workdir", dir.path().to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--synthetic-gb must be in (0, 4096]"), "{err}");
    let o = picchio(&["bench", "cache", "--model", m.to_str().unwrap(), "--synthetic-gb", "1"]);
    assert!(!o.status.success(), "--model and --synthetic-gb conflict");
}

/// The first buffered point after a cold start reads every expert it misses from the device: the
/// drop before it also catches the session's own readahead still in flight (which once landed after
/// the drop and left half of a small image cached, so the device showed fewer bytes than the
/// distinct experts read). With a cache of every expert, each miss is a distinct expert.
///
/// The image is this test's own copy: the shared fixture is read buffered by the other tests of this
/// binary while this one runs, and their reads would put its pages back in the page cache between the
/// drop and the point (a race that failed this test 3 of 3 in the default parallel mode).
#[cfg(target_os = "linux")]
#[test]
fn a_cold_buffered_point_reads_every_missed_expert_from_the_device() {
    let dir = scratch();
    let m = private_model(dir.path());
    let image_path = m.join("experts.picchioflat");
    let store = format!("file:{}", image_path.display());
    let json = dir.path().join("cold.json");
    for _ in 0..3 {
        assert!(picchio_bench::cache::drop_page_cache(&image_path));
        let rest = ["--cache-percent", "100", "--reads", "buffered", "--prompt-ids", PROMPT, "-n", "4", "--json"];
        ok(&on_model(&["bench", "cache"], &m, &store, &[&rest[..], &[json.to_str().unwrap()][..]].concat()));
        let r = read_json(&json);
        let slot = u(&r["results"]["slot_bytes"]);
        let p = &r["results"]["points"][0];
        let misses = u(&p["prefill"]["misses"]) + u(&p["decode"]["misses"]);
        let device = u(&p["prefill"]["device_bytes"]) + u(&p["decode"]["device_bytes"]);
        assert!(misses > 0);
        assert!(device >= misses * slot, "{misses} distinct experts of {slot} B, but {device} device bytes: {p}");
    }
}
