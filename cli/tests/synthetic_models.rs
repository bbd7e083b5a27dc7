//! Real-geometry random-weight models through the real binary: `picchio demo --synthetic-gb N --arch
//! gpt-oss-20b` and `picchio synth --model-out DIR --arch A`, then `picchio run` on them (every expert
//! tier gives the same tokens, `--prompt` goes through the arch's tokenizer, routing is spread).
//!
//! The models have the real vocabularies (151,936 and 201,088 ids), so even one layer is 1.4 GB
//! (Qwen3) or 2.2 GB (GPT-OSS) on disk, most of it the I8 embeddings and lm_head. The tests take
//! [`ONE_MODEL_AT_A_TIME`] so this binary holds at most one such model at once, and each removes its
//! model when done. `--vocab`, `--experts` and `--no-tokenizer` make a small one (about 120 MB for
//! Qwen3, most of it the layer's F32 attention), run here too.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Mutex;

use common::{ok, picchio, scratch};

static ONE_MODEL_AT_A_TIME: Mutex<()> = Mutex::new(());

fn json(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

fn ids(v: &serde_json::Value, key: &str) -> Vec<u64> {
    v[key].as_array().unwrap_or_else(|| panic!("no {key}: {v}")).iter().map(|t| t.as_u64().unwrap()).collect()
}

/// `picchio run --model M --json ARGS` → the generated tokens.
fn run_tokens(model: &Path, args: &[&str]) -> Vec<u64> {
    let m = model.to_str().unwrap();
    let mut all = vec!["run", "--model", m, "--json"];
    all.extend_from_slice(args);
    ids(&json(&ok(&all)), "tokens")
}

/// The experts each layer of a `picchio-trace/1` file used.
fn experts_per_layer(trace: &Path) -> Vec<BTreeSet<u64>> {
    let text = std::fs::read_to_string(trace).unwrap();
    let mut lines = text.lines();
    let header: serde_json::Value = serde_json::from_str(lines.next().unwrap()).unwrap();
    let mut used = vec![BTreeSet::new(); header["num_layers"].as_u64().unwrap() as usize];
    for line in lines {
        let r: serde_json::Value = serde_json::from_str(line).unwrap();
        used[r["l"].as_u64().unwrap() as usize].extend(ids(&r, "e"));
    }
    used
}

/// Tokens of `model` from safetensors and from its image through both engines, buffered and
/// O_DIRECT, with a cache of `ecap` experts: all equal. Returns them.
fn same_tokens_on_every_tier(model: &Path, prompt: &str, ecap: &str) -> Vec<u64> {
    let image = format!("file:{}", model.join("experts.picchioflat").display());
    let base = ["--prompt-ids", prompt, "-n", "8", "--ecap", ecap];
    let want = run_tokens(model, &[&base[..], &["--store", "safetensors"]].concat());
    for io in ["psync", "uring"] {
        for read in ["--buffered", "--direct"] {
            let got = run_tokens(model, &[&base[..], &["--store", &image, "--io", io, read]].concat());
            assert_eq!(got, want, "--io {io} {read} differs from safetensors");
        }
    }
    want
}

#[test]
fn demo_synthetic_gpt_oss_streams_and_every_tier_agrees() {
    let _one = ONE_MODEL_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch();
    let w = dir.path().to_str().unwrap();
    let args = ["demo", "--synthetic-gb", "0.1", "--arch", "gpt-oss-20b", "-n", "6", "--workdir", w, "--buffered"];
    let o = picchio(&args);
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{err}");
    assert!(err.contains("writing a random-weight gpt-oss-20b model: 1 layer × 32 experts × 13996800 B"), "{err}");
    assert!(err.contains("expert cache: 3 of 32 experts"), "{err}");
    let line = out.lines().find(|l| l.starts_with("prompt ids -> ")).unwrap_or_else(|| panic!("{out}"));
    let demo_tokens: Vec<u64> = line["prompt ids -> ".len()..].split(' ').map(|t| t.parse().unwrap()).collect();
    assert_eq!(demo_tokens.len(), 6, "{line}");

    // The second run reuses the model (the stamp names the arch), with the same tokens.
    let again = picchio(&args);
    assert!(String::from_utf8_lossy(&again.stderr).contains("reusing"), "the second demo reuses its model");
    assert_eq!(String::from_utf8_lossy(&again.stdout), out);

    let model = dir.path().join("synthetic-gpt-oss-20b-1l-seed0");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    assert_eq!((cfg["model_type"].as_str(), cfg["vocab_size"].as_u64()), (Some("gpt_oss"), Some(201_088)));
    assert_eq!(cfg["picchio_synthetic"]["arch"], "gpt-oss-20b");

    // The demo's prompt (16 fixed pseudo-random ids) on every tier at a 4-expert cache.
    let v = json(&ok(&["demo", "--synthetic-gb", "0.1", "--arch", "gpt-oss-20b", "-n", "6", "--workdir", w, "--json"]));
    let prompt = ids(&v, "prompt_ids").iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let tokens = same_tokens_on_every_tier(&model, &prompt, "4");
    assert_eq!(&tokens[..6], &demo_tokens[..], "run gives the demo's tokens");

    // `--prompt` goes through the vendored o200k_harmony tokenizer copied into the model.
    let v = json(&ok(&["run", "--model", model.to_str().unwrap(), "--prompt", "Hello world", "-n", "2", "--json"]));
    assert_eq!(ids(&v, "prompt_ids"), [13225, 2375]);
    assert_eq!(
        std::fs::read(model.join("tokenizer.json")).unwrap(),
        std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizers/gpt_oss/tokenizer.json")
        )
        .unwrap()
    );
}

#[test]
fn demo_arch_needs_synthetic_gb_and_a_known_arch() {
    let dir = scratch();
    let w = dir.path().to_str().unwrap();
    let o = picchio(&["demo", "--arch", "gpt-oss-20b", "--workdir", w]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--arch only applies to --synthetic-gb"), "{err}");
    let o = picchio(&["demo", "--synthetic-gb", "1", "--arch", "llama", "--workdir", w]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("expected one of qwen3-30b-a3b, gpt-oss-20b"), "{err}");
    let o = picchio(&["synth", "--arch", "gpt-oss-120b", "--model-out", w]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("expected one of qwen3-30b-a3b, gpt-oss-20b"), "{err}");
    // An existing directory that is not a synthetic model is never overwritten.
    std::fs::write(dir.path().join("mine.txt"), "keep").unwrap();
    let o = picchio(&["synth", "--arch", "gpt-oss-20b", "--layers", "1", "--model-out", w]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("is not a synthetic model") && err.contains("refusing"), "{err}");
    assert_eq!(std::fs::read_to_string(dir.path().join("mine.txt")).unwrap(), "keep");
    let o = picchio(&["synth", "--arch", "qwen3-30b-a3b", "--model-out", w, "--out", "x.img"]);
    assert!(!o.status.success(), "--out and --model-out conflict");
}

#[test]
fn synth_model_out_both_archs_then_run() {
    for (arch, tok_dir, prompt_text, experts, min_used) in [
        ("qwen3-30b-a3b", "qwen3_moe_text", "The quick brown fox jumps over the lazy dog.", 128, 64),
        ("gpt-oss-20b", "tokenizers/gpt_oss", "Hello, world!", 32, 16),
    ] {
        let _one = ONE_MODEL_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let dir = scratch();
        let model = dir.path().join(arch);
        let m = model.to_str().unwrap();
        let out = ok(&["synth", "--arch", arch, "--layers", "1", "--seed", "7", "--model-out", m, "--no-progress"]);
        assert!(out.contains(&format!("random-weight {arch} model (seed 7), 1 layer, {experts} experts")), "{out}");
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(leftovers, [std::ffi::OsString::from(arch)], "only the model directory remains");
        let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(tok_dir).join("tokenizer.json");
        assert_eq!(std::fs::read(model.join("tokenizer.json")).unwrap(), std::fs::read(tok).unwrap(), "{arch}");
        ok(&["verify", &format!("file:{m}/experts.picchioflat"), "--model", m]);

        // Text prompt through the tokenizer, every tier equal, routing spread over the experts, and
        // decoding that does not repeat one token.
        let trace = dir.path().join("trace.jsonl");
        let v = json(&ok(&[
            "run",
            "--model",
            m,
            "--prompt",
            prompt_text,
            "-n",
            "12",
            "--json",
            "--trace",
            trace.to_str().unwrap(),
        ]));
        let prompt = ids(&v, "prompt_ids");
        let tokens = ids(&v, "tokens");
        assert!(prompt.len() >= 4, "{arch}: {prompt:?}");
        let distinct: BTreeSet<_> = tokens.iter().collect();
        assert!(distinct.len() >= 6, "{arch}: degenerate decoding {tokens:?}");
        let used = experts_per_layer(&trace);
        assert!(
            used.iter().all(|u| u.len() >= min_used),
            "{arch}: experts used per layer {:?}",
            used.iter().map(BTreeSet::len).collect::<Vec<_>>()
        );
        let prompt_csv = prompt.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
        let tiers = same_tokens_on_every_tier(&model, &prompt_csv, "3");
        assert_eq!(tiers, tokens[..8], "{arch}: --prompt-ids of the tokenized prompt give --prompt's tokens");
    }
}

/// `--vocab`, `--experts` and `--no-tokenizer` make a small model at the real layer geometry (tests,
/// CI). Bad values are refused naming the flag before anything is written, a vocabulary below the
/// vendored tokenizer's ids is refused unless `--no-tokenizer`, and the small model of each arch
/// loads, verifies and runs with prompts as ids, the same tokens from every tier.
#[test]
fn synth_model_out_with_a_small_vocabulary_loads_and_runs_with_id_prompts() {
    let dir = scratch();
    let model = dir.path().join("m");
    let m = model.to_str().unwrap();
    for (args, want) in [
        (&["--vocab", "0", "--no-tokenizer"][..], "--vocab must be at least 1"),
        (&["--experts", "4"][..], "--experts 4 is fewer than the qwen3-30b-a3b model's 8 experts per token"),
        (&["--hidden", "64"][..], "--hidden does not apply to --model-out"),
        (&["--vocab", "1000"][..], "--vocab 1000: "),
    ] {
        let base = ["synth", "--arch", "qwen3-30b-a3b", "--layers", "1", "--no-progress", "--model-out", m];
        let o = picchio(&[&base[..], args].concat());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{args:?}: {err}");
        let written: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(written.is_empty(), "{args:?} wrote {written:?}");
        if args == ["--vocab", "1000"] {
            common::assert_contains_all(
                &err,
                &[
                    "qwen3_moe_text/tokenizer.json: the tokenizer has",
                    "ids but the synthetic model's vocabulary is 1000",
                    "hint:",
                    "--no-tokenizer",
                ],
            );
        }
    }
    // An image has no vocabulary (a tiny geometry, should the refusal ever be lost).
    let image = dir.path().join("x.picchioflat");
    let tiny = ["synth", "--arch", "custom", "--hidden", "64", "--moe-intermediate", "64", "--experts", "2"];
    for flag in [&["--vocab", "8"][..], &["--no-tokenizer"][..]] {
        let o = picchio(&[&tiny[..], &["--model-layers", "1", "--out", image.to_str().unwrap()], flag].concat());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(&format!("{} only applies to --model-out", flag[0])), "{err}");
        assert!(!image.exists());
    }

    for (arch, experts_key, experts, vocab) in
        [("qwen3-30b-a3b", "num_experts", 8u64, 512u64), ("gpt-oss-20b", "num_local_experts", 4, 1)]
    {
        let _one = ONE_MODEL_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let (e, v) = (experts.to_string(), vocab.to_string());
        let out = ok(&[
            "synth",
            "--arch",
            arch,
            "--layers",
            "1",
            "--experts",
            &e,
            "--vocab",
            &v,
            "--no-tokenizer",
            "--seed",
            "3",
            "--no-progress",
            "--model-out",
            m,
        ]);
        assert!(
            out.contains(&format!("1 layer, {experts} experts"))
                && out.contains(&format!("vocabulary {vocab}, tokenizer none")),
            "{out}"
        );
        assert!(!model.join("tokenizer.json").exists(), "{arch}: --no-tokenizer");
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
        assert_eq!((cfg["vocab_size"].as_u64(), cfg[experts_key].as_u64()), (Some(vocab), Some(experts)), "{arch}");
        ok(&["verify", &format!("file:{m}/experts.picchioflat"), "--model", m]);

        let tokens = same_tokens_on_every_tier(&model, "0,0,0", "2");
        assert!(tokens.len() == 8 && tokens.iter().all(|&t| t < vocab), "{arch}: {tokens:?}");
        let o = picchio(&["run", "--model", m, "--prompt", "hello", "-n", "2"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains("has no tokenizer.json: give the prompt as token ids"), "{err}");
        let o = picchio(&["run", "--model", m, "--prompt-ids", &v, "-n", "2"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains(&format!("prompt id {vocab} is outside the vocabulary (size {vocab})")),
            "{err}"
        );
        std::fs::remove_dir_all(&model).unwrap();
    }
}
