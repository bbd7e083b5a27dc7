//! `picchio run`, `plan` and `chat`'s model loading on a bare `.gguf` (tests/fixtures/gguf/models,
//! made by llama.cpp's own converter and quantizer): no other file beside it, greedy tokens equal to
//! llama.cpp's at every prefill chunk size and expert-cache capacity, and a GGUF of another
//! architecture or a damaged one refused with the file and what was expected.

mod common;

use std::path::PathBuf;

use common::{ok, picchio, scratch};
use serde_json::Value;

fn gguf(name: &str) -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../tests/fixtures/gguf/models/{name}"))
}

/// The prompt ids and llama.cpp's greedy ids (setting B, F32 attention) of fixture `name`.
fn oracle(name: &str) -> (String, Vec<u64>) {
    let j: Value = serde_json::from_str(&std::fs::read_to_string(gguf(&format!("{name}.json"))).unwrap()).unwrap();
    let prompt: Vec<String> = j["prompt_ids"].as_array().unwrap().iter().map(Value::to_string).collect();
    let ids = j["B"]["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    (prompt.join(","), ids)
}

fn tokens(json: &str) -> Vec<u64> {
    let v: Value = serde_json::from_str(json).unwrap();
    v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
}

#[test]
fn run_on_a_bare_gguf_gives_llama_cpp_tokens_at_any_chunk_and_cache() {
    for name in ["qwen3_moe_k-Q4_K_M", "gpt_oss_mxfp4"] {
        let (prompt, want) = oracle(name);
        // Copied alone into an empty directory: nothing beside the GGUF is read.
        let dir = scratch();
        let file = dir.path().join(format!("{name}.gguf"));
        std::fs::copy(gguf(&format!("{name}.gguf")), &file).unwrap();
        let f = file.to_str().unwrap();
        for (chunk, ecap) in [("256", "2"), ("1", "5"), ("5", "8")] {
            let args = ["run", "--model", f, "--prompt-ids", &prompt, "-n", "16", "--json"];
            let out = ok(&[&args[..], &["--prefill-chunk", chunk, "--ecap", ecap]].concat());
            assert_eq!(tokens(&out), want, "{name} --prefill-chunk {chunk} --ecap {ecap}");
            let v: Value = serde_json::from_str(&out).unwrap();
            assert_eq!(v["stats"]["engine"], "gguf (mmap copy)", "{out}");
            assert_eq!(v["stats"]["fallbacks"], 0, "{out}");
        }
        let plan = ok(&["plan", "--model", f]);
        assert!(plan.contains("dense part") && plan.contains("expert cache"), "{plan}");
    }
}

#[test]
fn a_gguf_of_another_architecture_or_damaged_is_refused_naming_the_file() {
    let dir = scratch();
    let bytes = std::fs::read(gguf("qwen3_moe-Q8_0.gguf")).unwrap();
    // general.architecture's value is the first "qwen3moe" after its key; same length, so the file
    // stays a valid GGUF of an architecture this runtime does not run.
    let key = b"general.architecture";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4 + 8;
    assert_eq!(&bytes[at..at + 8], b"qwen3moe");
    let mut other = bytes.clone();
    other[at..at + 8].copy_from_slice(b"llamamoe");
    let p = dir.path().join("other.gguf");
    std::fs::write(&p, &other).unwrap();
    let o = picchio(&["run", "--model", p.to_str().unwrap(), "--prompt-ids", "1,2", "-n", "1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("other.gguf") && err.contains("\"llamamoe\"") && err.contains("\"qwen3moe\""), "{err}");

    // Cut inside the tensor infos: the reader names the file, the offset and the field.
    let p = dir.path().join("cut.gguf");
    std::fs::write(&p, &bytes[..at + 4096]).unwrap();
    let o = picchio(&["run", "--model", p.to_str().unwrap(), "--prompt-ids", "1,2", "-n", "1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("cut.gguf") && err.contains("offset"), "{err}");
}
