//! `picchio run --prefill-chunk N` on Picchio (C)'s fixture: the tokens are the same at every chunk
//! size, `--json` reports the prefill's store reads and bytes, a chunk reads each distinct expert once
//! (so a small cache reads far less during prefill than token by token), and the flag's misuses are
//! refused.

mod common;

use common::{image, model, ok, picchio};
use serde_json::Value;

/// The greedy tokens Picchio (C) v0.8.0 printed for this fixture (fixtures/picchio_c/README.md).
const PICCHIO_C_TOKENS: [u64; 16] =
    [731, 1930, 347, 2860, 3377, 3184, 3525, 2504, 41, 2411, 547, 193, 3590, 3840, 3815, 1426];

/// The 12 prompt ids of the qwen3_moe reference.
fn prompt_ids() -> String {
    let p = model().join("../../qwen3_moe/reference.json");
    let r: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let ids: Vec<String> = r["prompt_ids"].as_array().unwrap().iter().map(|v| v.to_string()).collect();
    ids.join(",")
}

fn run(chunk: &str, ecap: &str) -> Value {
    let (m, store, ids) = (model(), image(), prompt_ids());
    let args = ["run", "--model", m.to_str().unwrap(), "--store", &store, "--prompt-ids", &ids, "-n", "16", "--json"];
    let out = ok(&[&args[..], &["--ecap", ecap, "--prefill-chunk", chunk, "--io", "psync"]].concat());
    serde_json::from_str(&out).unwrap()
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

#[test]
fn chunked_prefill_reads_each_expert_once_and_keeps_the_tokens() {
    // 12 prompt tokens, 3 MoE layers of 16 experts, top-4.
    let (prompt, layers, experts, k) = (12u64, 3u64, 16u64, 4u64);
    for ecap in ["4", "48"] {
        let mut prefill_reads = Vec::new();
        for chunk in ["1", "3", "64"] {
            let v = run(chunk, ecap);
            let toks: Vec<u64> = v["tokens"].as_array().unwrap().iter().map(u).collect();
            assert_eq!(toks, PICCHIO_C_TOKENS, "chunk {chunk} ecap {ecap}");
            let st = &v["stats"];
            assert!(u(&st["prefill_reads"]) > 0 && u(&st["prefill_reads"]) <= u(&st["reads"]), "{st}");
            assert!(u(&st["prefill_bytes_read"]) <= u(&st["bytes_read"]), "{st}");
            // every read is one whole expert slot
            assert_eq!(u(&st["prefill_bytes_read"]) % u(&st["prefill_reads"]), 0, "{st}");
            prefill_reads.push(u(&st["prefill_reads"]));
        }
        if ecap == "4" {
            // Token by token, a cache of k experts never hits across 3 layers: every use is a read.
            assert_eq!(prefill_reads[0], prompt * layers * k, "token by token at ecap 4");
            // One chunk: each distinct expert of a layer read once.
            assert!(prefill_reads[2] <= layers * experts, "chunk 64 at ecap 4: {prefill_reads:?}");
        } else {
            // Everything fits: each expert is read at most once whatever the chunk.
            assert!(prefill_reads.iter().all(|&r| r <= layers * experts), "{prefill_reads:?}");
        }
    }
}

#[test]
fn prefill_chunk_misuse_is_refused() {
    let (m, ids) = (model(), prompt_ids());
    let base = ["run", "--model", m.to_str().unwrap(), "--store", "safetensors", "--prompt-ids", &ids, "-n", "2"];
    let o = picchio(&[&base[..], &["--prefill-chunk", "0"]].concat());
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--prefill-chunk"));

    let dir = common::scratch();
    let trace = dir.path().join("t.jsonl");
    let o = picchio(&[&base[..], &["--prefill-chunk", "4", "--trace", trace.to_str().unwrap()]].concat());
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("--trace records a token-by-token trace") && e.contains("--prefill-chunk 1"), "{e}");
    assert!(!trace.exists());
    // --prefill-chunk 1 with --trace is what --trace does anyway
    ok(&[&base[..], &["--prefill-chunk", "1", "--trace", trace.to_str().unwrap()]].concat());
    assert!(trace.exists());
}
