//! `picchio bench decode` and the expert-usage profile as a user runs them on Picchio (C)'s
//! fixture: the report's figures are consistent with each other (bytes = reads × read size, the
//! time split adds up to at most the step, the floor is bytes over the same run's device rate,
//! every prefetched expert is used or wasted), the tokens are the same at every point and with
//! `--prefetch`, `--no-overlap` or a warm start, `run --usage-out` counts every routing decision
//! and adds to an existing profile, and `--warm-from` a profile of the same run leaves nothing to
//! read. Structure and consistency only, never speeds.

mod common;
use std::path::Path;

use common::{bench_with_report, image, model, ok, on_model, picchio, scratch};

use serde_json::Value;

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// Runs `bench decode` on the fixture with `extra` flags; returns the report.
fn bench(dir: &Path, name: &str, extra: &[&str]) -> Value {
    let (m, store) = (model(), image());
    let rest = [&["--ecap", "48,4,12", "--prompt-len", "6", "-n", "9"][..], extra].concat();
    let (out, report, plots) = bench_with_report(&on_model(&["bench", "decode"], &m, &store, &rest), dir, name);
    assert!(out.contains("decode/s") && out.contains("floor/s"), "{out}");
    for chart in ["decode-tok-s.svg", "decode-split.svg"] {
        let text = std::fs::read_to_string(plots.join(chart)).unwrap();
        assert!(roxmltree::Document::parse(&text).unwrap().root_element().tag_name().name() == "svg");
    }
    report
}

/// Checks one report's consistency; returns each point's tokens.
fn check(r: &Value, prefetch: bool) -> Vec<Vec<u64>> {
    assert_eq!((r["schema"].as_str(), r["experiment"].as_str()), (Some("picchio-bench/1"), Some("decode")));
    let res = &r["results"];
    assert_eq!((u(&res["moe_layers"]), u(&res["top_k"]), u(&res["total_experts"])), (3, 4, 48));
    let points = res["points"].as_array().unwrap();
    assert_eq!(points.iter().map(|p| u(&p["ecap"])).collect::<Vec<_>>(), [4, 12, 48], "ascending");
    let mut tokens = Vec::new();
    for p in points {
        let what = format!("ecap {}", p["ecap"]);
        let steps = u(&p["decode_steps"]);
        assert_eq!(steps, 8, "{what}: -n 9 is 8 decode steps");
        assert_eq!(u(&p["prompt_tokens"]), 6);
        let read = u(&p["read_bytes"]);
        assert_eq!(read % 4096, 0, "{what}");
        let (rpt, bpt) = (f(&p["reads_per_token"]), f(&p["bytes_per_token"]));
        assert!((rpt * read as f64 - bpt).abs() <= 1e-6 * bpt.max(1.0), "{what}: {rpt} reads × {read} B != {bpt}");
        // The split: every part >= 0, the parts sum to the step, the step within the decode time.
        let sp = &p["split"];
        assert_eq!(u(&sp["steps"]), steps, "{what}");
        let parts: Vec<f64> =
            ["attention_ms", "router_ms", "experts_ms", "dense_mlp_ms", "io_wait_ms", "lm_head_ms", "other_ms"]
                .iter()
                .map(|k| f(&sp[*k]))
                .collect();
        assert!(parts.iter().all(|&v| v >= 0.0), "{what}: {sp}");
        let total = f(&sp["total_ms"]);
        assert!(parts[..6].iter().sum::<f64>() <= total * (1.0 + 1e-9) + 1e-6, "{what}: parts exceed the step: {sp}");
        assert!((parts.iter().sum::<f64>() - total).abs() <= 1e-6 * total.max(1.0), "{what}: {sp}");
        assert!(f(&sp["attention_ms"]) > 0.0 && f(&sp["experts_ms"]) > 0.0 && f(&sp["lm_head_ms"]) > 0.0, "{what}");
        let decode_ms = f(&p["decode_ms"]);
        assert!(
            total * steps as f64 <= decode_ms * (1.0 + 1e-9),
            "{what}: steps {total} ms × {steps} > {decode_ms} ms"
        );
        assert!((f(&p["decode_tok_s"]) - steps as f64 / (decode_ms / 1e3)).abs() <= 1e-6 * f(&p["decode_tok_s"]));
        // The floor: bytes per token at this run's device rate.
        match p["floor_tok_s"].as_f64() {
            Some(floor) => {
                let want_ms = bpt / (f(&p["device_mb_s"]) * 1e6) * 1e3;
                assert!((f(&p["floor_ms_per_token"]) - want_ms).abs() <= 1e-9 * want_ms.max(1.0), "{what}");
                assert!((floor - 1e3 / want_ms).abs() <= 1e-6 * floor, "{what}");
                assert!(f(&p["floor_gap"]) > 0.0);
            }
            None => assert_eq!(bpt, 0.0, "{what}: reads but no floor"),
        }
        let pf = &p["prefetch"];
        assert_eq!(u(&pf["issued"]), u(&pf["used"]) + u(&pf["wasted"]), "{what}: {pf}");
        assert_eq!(u(&p["prefetch_wasted_bytes"]), u(&pf["wasted"]) * read, "{what}");
        assert!(prefetch || u(&pf["issued"]) == 0, "{what}: prefetch without --prefetch");
        assert!(u(&p["peak_rss_bytes"]) > 0);
        let hr = f(&p["hit_rate"]);
        assert!((0.0..=1.0).contains(&hr));
        tokens.push(p["tokens"].as_array().unwrap().iter().map(u).collect());
    }
    assert!(tokens.windows(2).all(|w| w[0] == w[1]), "tokens differ between capacities: {tokens:?}");
    // A small cache misses during decode on this model: the smallest point reads something.
    assert!(f(&points[0]["bytes_per_token"]) > 0.0);
    tokens
}

#[test]
fn decode_report_is_consistent_and_the_tokens_never_change() {
    let dir = scratch();
    let plain = check(&bench(dir.path(), "plain", &[]), false);
    let prefetch_report = bench(dir.path(), "prefetch", &["--prefetch"]);
    assert_eq!(check(&prefetch_report, true), plain, "--prefetch changed the tokens");
    assert_eq!(prefetch_report["flags"]["schedule"]["prefetch"], true);
    let issued: u64 =
        prefetch_report["results"]["points"].as_array().unwrap().iter().map(|p| u(&p["prefetch"]["issued"])).sum();
    assert!(issued > 0, "--prefetch read nothing ahead");
    assert_eq!(check(&bench(dir.path(), "sync", &["--no-overlap"]), false), plain, "--no-overlap changed the tokens");
    // Flags that cannot go together are refused by name.
    let o = picchio(&["bench", "decode", "--model", model().to_str().unwrap(), "--prefetch", "--no-overlap"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--no-overlap"));
}

#[test]
fn usage_profile_counts_every_decision_and_warms_the_cache() {
    let dir = scratch();
    let profile = dir.path().join("q.picchio_usage");
    let m = model();
    let store = image();
    let run = |extra: &[&str]| -> Value {
        let rest = [&["--prompt-ids", "1,2,3,4,5", "-n", "6", "--ecap", "48", "--json"][..], extra].concat();
        serde_json::from_str(ok(&on_model(&["run"], &m, &store, &rest)).trim()).unwrap()
    };
    let cold = run(&["--usage-out", profile.to_str().unwrap()]);
    let text = std::fs::read_to_string(&profile).unwrap();
    assert!(text.starts_with("picchio-usage/1\nlayers 3\nexperts 16\n"), "{text}");
    let sum = |t: &str| -> u64 {
        t.lines()
            .filter(|l| !l.starts_with('#') && l.split_whitespace().count() == 3)
            .map(|l| l.split_whitespace().nth(2).unwrap().parse::<u64>().unwrap())
            .sum()
    };
    // 5 prompt tokens + 5 generated tokens run (the 6th is never run) × 3 MoE layers × top-4.
    assert_eq!(sum(&text), 10 * 3 * 4, "{text}");
    // A second run adds to the profile.
    let again = run(&["--usage-out", profile.to_str().unwrap()]);
    assert_eq!(again["tokens"], cold["tokens"]);
    assert_eq!(sum(&std::fs::read_to_string(&profile).unwrap()), 2 * 10 * 3 * 4);
    // Warm from it: every expert the run uses is in before the prompt, so nothing is read after.
    let warm = run(&["--warm-from", profile.to_str().unwrap()]);
    assert_eq!(warm["tokens"], cold["tokens"], "a warm start changed the tokens");
    let (ws, cs) = (&warm["stats"], &cold["stats"]);
    let used = text.lines().skip(4).count() as u64;
    assert_eq!(u(&ws["warm"]["experts"]), used, "{ws}");
    assert!(u(&ws["warm"]["bytes_read"]) > 0);
    assert_eq!((u(&ws["cache_misses"]), u(&ws["bytes_read"])), (0, 0), "{ws}");
    assert_eq!(u(&cs["cache_misses"]), used, "cold: each used expert read once at ecap 48");
    assert!(cs["warm"].is_null());
    // A profile of another shape, and a file that is not one, are refused by name.
    let ms = m.to_str().unwrap();
    let refused = |from: &Path, want: &str| {
        let o = picchio(&["run", "--model", ms, "--prompt-ids", "1", "-n", "1", "--warm-from", from.to_str().unwrap()]);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && e.contains(want), "--warm-from {}: want {want:?} in {e}", from.display());
    };
    std::fs::write(&profile, "picchio-usage/1\nlayers 2\nexperts 16\n").unwrap();
    refused(&profile, "2 layers × 16 experts");
    refused(&m.join("config.json"), "expected `picchio-usage/1`");
}
