//! `picchio serve` driven by the official `openai` Python client (cli/tests/openai_client.py) on
//! the vendored real-tokenizer model, converted and packed: chat and completions, streamed and not,
//! models listed and retrieved (404 for an unknown id),
//! greedy tokens equal to `picchio run --prompt-ids <rendered ids>`, `cached_tokens` of a request
//! that extends the previous one equal to the shared prefix, and a client that disconnects
//! mid-stream freeing the queue. Needs a Python with `openai` installed, named by
//! `PICCHIO_TEST_PYTHON` (.ci/run makes a venv for it).

mod common;

use common::serve::{openai_client, packed_model, Served, WEATHER_CALL_ANSWER};
use serde_json::{json, Value};

#[test]
#[ignore = "needs the openai Python client: PICCHIO_TEST_PYTHON=<python with openai> (.ci/run sets it)"]
fn the_openai_python_client_gets_run_s_tokens_and_the_cached_prefix() {
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    // The conversation and its ids as jinja2 + tokenizers render them (fixtures/chat).
    let fixtures = common::serve::text_fixture().join("../chat/qwen3_rendering.json");
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&fixtures).unwrap()).unwrap();
    let case = r["cases"].as_array().unwrap().iter().find(|c| c["name"] == "system_and_user").unwrap();
    let ids: Vec<u64> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    let ids_arg = ids.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let m = model.to_str().unwrap();
    let run: Value = serde_json::from_str(&common::ok(&[
        "run",
        "--model",
        m,
        "--ecap",
        "4",
        "--prompt-ids",
        &ids_arg,
        "-n",
        "12",
        "--json",
    ]))
    .unwrap();
    let tokens: Vec<u32> = run["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(tokens.len(), 12);
    // The answer as a chat shows it: special tokens skipped.
    let tok = picchio_runtime::model::tokenizer::Tokenizer::from_dir(&model).unwrap().unwrap();
    let expect = json!({
        "model": "m",
        "messages": case["messages"],
        "prompt_ids": ids,
        "tokens": tokens,
        "text": tok.decode_text(&tokens).unwrap(),
    });
    let s = Served::start(&model, &["--ctx", "512"]);
    let o = openai_client("openai_client.py", &s, &[("PICCHIO_EXPECT", &expect.to_string())]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("all openai client checks passed"));
}

/// Tool calls through the official client (cli/tests/openai_tool_calls.py): whole, streamed and
/// put together as its users do, and the follow-up with the tool's result. The random-weight
/// fixture never writes a call itself: the test mock `PICCHIO_SERVE_TEST_MOCK_SAMPLED_IDS` makes it
/// generate one (the tokens of a Hermes `<tool_call>` block, then `<|im_end|>`); everything after
/// the choice of token runs for real.
#[test]
#[ignore = "needs the openai Python client: PICCHIO_TEST_PYTHON=<python with openai> (.ci/run sets it)"]
fn the_openai_python_client_reads_tool_calls_whole_and_streamed() {
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    let (s, _) = Served::start_answering(&model, WEATHER_CALL_ANSWER);
    let o = openai_client("openai_tool_calls.py", &s, &[]);
    let out = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    for line in ["whole: ok", "streamed: ok", "follow-up: ok"] {
        assert!(out.contains(line), "no {line:?} in:\n{out}");
    }
}
