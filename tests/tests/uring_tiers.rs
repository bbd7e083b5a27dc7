//! Cross-tier identity for the io_uring engine (tier S3), end to end through `Session`: the Picchio (C)
//! directory's image read by `--io uring` at queue depths 1, 4 and 32, direct and buffered, with async
//! MoE on and off, for cache capacities 1, 4 and all, gives Picchio (C)'s tokens; so do the psync
//! engine's thread counts (pinned to `--io psync`, now that uring is the default) and the SQPOLL and
//! registered-file variants. Skipped visibly where io_uring is unavailable.

use picchio_core::StoreUri;
use picchio_runtime::expert::open::{EngineOptions, IoEngine};
use picchio_runtime::model::DecodeSchedule;
use picchio_tests::*;

const N: usize = 16;

fn c_prompt() -> Vec<u32> {
    ids(&reference_json(&fixture("qwen3_moe"), "reference.json"), "prompt_ids")
}

#[cfg(target_os = "linux")]
fn uring_unavailable() -> Option<String> {
    picchio_blockdev::UringQueue::probe().err().map(|e| e.to_string())
}

#[cfg(not(target_os = "linux"))]
fn uring_unavailable() -> Option<String> {
    Some("io_uring is Linux-only".into())
}

fn check(io: EngineOptions, async_moe: bool, ecap: usize, want_engine: &str) {
    let dir = fixture("picchio_c/qwen3_moe");
    let image = StoreUri::File(dir.join("experts.picchioflat"));
    let what = format!("{io:?} async_moe {async_moe} ecap {ecap}");
    let opts = picchio_runtime::run::SessionOptions {
        model: picchio_runtime::ModelDir::open(&dir).unwrap(),
        store: image,
        engine: io,
        schedule: DecodeSchedule { async_moe, ..DecodeSchedule::default() },
        verify: false,
        ecap: Some(ecap),
        max_seq: c_prompt().len() + N,
        dense: Default::default(),
    };
    let (g, s) = greedy_with(&opts, &c_prompt(), N).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(g.tokens, PICCHIO_C_TOKENS, "{what}");
    assert_eq!(g.stats.fallbacks, 0, "{what}");
    assert_eq!(g.stats.reads, g.stats.cache_misses, "{what}: every miss is one store read");
    assert_eq!(g.stats.async_moe, async_moe);
    assert_eq!(s.info.engine, want_engine, "{what}");
}

#[test]
fn uring_at_every_depth_and_async_setting_gives_picchio_c_tokens() {
    if let Some(why) = uring_unavailable() {
        panic!("io_uring unavailable here (kernel, sysctl or seccomp): {why}");
    }
    let mut runs = 0;
    for ecap in [1, 4, 3 * 16] {
        for direct in [true, false] {
            for qd in [1, 4, 32] {
                for async_moe in [true, false] {
                    let io = EngineOptions { engine: IoEngine::Uring, direct, qd, ..EngineOptions::default() };
                    let mode = if direct { "direct" } else { "buffered" };
                    check(io, async_moe, ecap, &format!("uring({mode}, qd {qd}, fixed file)"));
                    runs += 1;
                }
            }
        }
    }
    eprintln!("{runs} uring runs gave Picchio (C)'s tokens");
}

#[test]
fn uring_flags_give_picchio_c_tokens() {
    if let Some(why) = uring_unavailable() {
        panic!("io_uring unavailable here (kernel, sysctl or seccomp): {why}");
    }
    let base = EngineOptions { engine: IoEngine::Uring, qd: 8, ..EngineOptions::default() };
    check(EngineOptions { register_files: false, ..base }, true, 4, "uring(direct, qd 8)");
    let dir = fixture("picchio_c/qwen3_moe");
    let sqpoll = EngineOptions { sqpoll: true, ..base };
    match greedy(&dir, StoreUri::File(dir.join("experts.picchioflat")), sqpoll, Some(4), &c_prompt(), N) {
        Ok((g, s)) => {
            assert_eq!(g.tokens, PICCHIO_C_TOKENS);
            assert!(s.info.engine.starts_with("uring(direct, qd 8, sqpoll"), "{}", s.info.engine);
        }
        // Older kernels need privileges for SQPOLL: the error names the option (the binary's hint
        // names its flag).
        Err(e) => {
            assert!(e.to_string().contains("io_uring sqpoll"), "{e}");
            eprintln!("sqpoll refused here, naming the option (checked): {e}");
        }
    }
    // iopoll either works or is refused naming the option (a file on a disk without polled queues).
    let iopoll = EngineOptions { iopoll: true, ..base };
    match greedy(&dir, StoreUri::File(dir.join("experts.picchioflat")), iopoll, Some(4), &c_prompt(), N) {
        Ok((g, _)) => assert_eq!(g.tokens, PICCHIO_C_TOKENS),
        Err(e) => assert!(e.to_string().contains("io_uring iopoll"), "{e}"),
    }
}

#[test]
fn psync_threads_still_give_picchio_c_tokens_and_uring_is_the_default() {
    for ecap in [1, 4] {
        for threads in [1, 2, 4] {
            let io = EngineOptions { engine: IoEngine::Psync, threads, ..EngineOptions::default() };
            check(io, true, ecap, &format!("psync(direct, {threads} thread{})", if threads == 1 { "" } else { "s" }));
        }
    }
    let dir = fixture("picchio_c/qwen3_moe");
    let (g, s) = greedy(&dir, StoreUri::Auto, EngineOptions::default(), Some(4), &c_prompt(), N).unwrap();
    assert_eq!(g.tokens, PICCHIO_C_TOKENS);
    match uring_unavailable() {
        None => assert_eq!(s.info.engine, "uring(direct, qd 32, fixed file)"),
        // The default falls back to psync with a warning.
        Some(why) => {
            assert!(s.info.engine.starts_with("psync("), "{}", s.info.engine);
            eprintln!("the default fell back to psync (checked): io_uring unavailable: {why}");
        }
    }
}
