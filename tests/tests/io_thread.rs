//! One long-lived I/O thread per session: decode steps start no thread. Its own test binary, so
//! no other test starts threads while it counts.

use picchio_core::StoreUri;
use picchio_runtime::expert::io_worker::threads_started;
use picchio_runtime::expert::open::{EngineOptions, IoEngine};
use picchio_runtime::model::tokenizer::Tokenizer;
use picchio_runtime::run::{GenerateOptions, Session, SessionOptions};
use picchio_tests::*;

/// Threads of this process now (`/proc/self/task`; `None` off Linux).
fn tasks() -> Option<usize> {
    std::fs::read_dir("/proc/self/task").ok().map(|d| d.count())
}

#[test]
fn decoding_32_tokens_starts_no_thread() {
    let dir = fixture("picchio_c/qwen3_moe");
    let prompt = ids(&reference_json(&fixture("qwen3_moe"), "reference.json"), "prompt_ids");
    // 33 tokens: the first comes from the prompt's logits, the other 32 from one decode step each.
    let n = 33;
    let opts = SessionOptions {
        model: picchio_runtime::ModelDir::open(&dir).unwrap(),
        store: StoreUri::File(dir.join("experts.picchioflat")),
        engine: EngineOptions { engine: IoEngine::Psync, direct: false, threads: 2, ..EngineOptions::default() },
        schedule: Default::default(),
        verify: false,
        // Far fewer slots than experts: every decode step misses, so its reads go to the I/O thread.
        ecap: Some(3),
        max_seq: prompt.len() + n,
        dense: Default::default(),
    };
    let before_open = threads_started();
    let mut s = Session::open(&opts, Tokenizer::from_dir(&dir).unwrap()).unwrap();
    assert_eq!(threads_started(), before_open + 1, "Session::open starts the session's one I/O thread");
    let gen = GenerateOptions { max_new: n, ..Default::default() };
    // A first generation, so whatever starts on first use (a compute pool) has started.
    let first = s.generate(&prompt, &gen).unwrap();
    let (started, tasks_before) = (threads_started(), tasks());
    let g = s.generate(&prompt, &gen).unwrap();
    assert_eq!(g.tokens.len(), n);
    assert_eq!(g.tokens, first.tokens, "the same tokens on the same thread");
    assert_eq!(g.tokens[..PICCHIO_C_TOKENS.len()], PICCHIO_C_TOKENS);
    assert_eq!(g.stats.decode_split.steps, 32, "{:?}", g.stats.decode_split);
    assert!(g.stats.overlap, "the decode steps read on the I/O thread");
    assert!(g.stats.reads > g.stats.prefill_reads, "the decode steps read experts: {:?}", g.stats);
    assert_eq!(threads_started(), started, "32 decode steps started no I/O thread");
    assert_eq!(tasks(), tasks_before, "the process has as many threads after 32 decode steps as before");
    eprintln!(
        "32 decode steps, {} expert reads, {} threads in the process throughout",
        g.stats.reads - g.stats.prefill_reads,
        tasks_before.map_or("?".into(), |t| t.to_string())
    );
    drop(s);
}
