//! Multi-turn generation with KV reuse ([`Session::complete`]) on the vendored real-tokenizer model:
//! greedy tokens equal `generate` (what `picchio run` prints, itself equal to transformers), a
//! prompt that extends the previous one reuses exactly the shared prefix and gives the same tokens
//! as a fresh session, a prompt that diverges rewinds, and the end-of-turn ids stop a turn.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use picchio_core::StoreUri;
use picchio_runtime::chat::turn::{Finish, TurnOptions};
use picchio_runtime::expert::open::EngineOptions;
use picchio_runtime::image::convert::{convert, ConvertOptions};
use picchio_runtime::model::tokenizer::Tokenizer;
use picchio_runtime::run::{GenerateOptions, Session, SessionOptions};
use picchio_tests::{fixture, ids, reference_json, scratch};

/// The fixture converted with Q4 experts into `dir`, with its Q4 reference's prompt and greedy ids.
fn converted(dir: &Path) -> (PathBuf, Vec<u32>, Vec<u32>) {
    let out = dir.join("m");
    convert(&fixture("qwen3_moe_text"), &out, &ConvertOptions { progress: false, ..Default::default() }).unwrap();
    let r = reference_json(&fixture("qwen3_moe_text"), "reference_q4.json");
    (out, ids(&r, "prompt_ids"), ids(&r, "greedy_ids"))
}

fn session(model: &Path, max_seq: usize) -> Session {
    let opts = SessionOptions {
        model: picchio_runtime::ModelDir::open(model).unwrap(),
        store: StoreUri::Safetensors,
        engine: EngineOptions::default(),
        schedule: Default::default(),
        verify: false,
        ecap: Some(4),
        max_seq,
        dense: picchio_runtime::model::DenseFormat::Stored,
    };
    Session::open(&opts, Tokenizer::from_dir(model).unwrap()).unwrap()
}

fn greedy(n: usize) -> TurnOptions {
    TurnOptions { max_new: n, ..Default::default() }
}

fn go(s: &mut Session, prompt: &[u32], o: &TurnOptions) -> picchio_runtime::chat::turn::Turn {
    s.complete(prompt, o, &mut |_| ControlFlow::Continue(())).unwrap()
}

#[test]
fn complete_reuses_the_common_prefix_and_keeps_greedy_tokens() {
    let tmp = scratch();
    let (model, prompt, want) = converted(tmp.path());
    let mut s = session(&model, 128);

    // Turn 1 from an empty cache: the reference tokens, nothing reused.
    let t1 = go(&mut s, &prompt, &greedy(want.len()));
    assert_eq!(t1.tokens, want);
    assert_eq!((t1.cached_tokens, t1.finish, t1.stop_id), (0, Finish::Length, None));
    // The cache holds the prompt and every generated token but the last.
    assert_eq!(s.kv_ids(), [&prompt[..], &want[..want.len() - 1]].concat());

    // Turn 2 extends turn 1: only the new tokens are prefilled, and the tokens equal a fresh run.
    let mut p2 = [&prompt[..], &want[..]].concat();
    p2.extend([13, 576, 3974]);
    let t2 = go(&mut s, &p2, &greedy(8));
    assert_eq!(t2.cached_tokens, prompt.len() + want.len() - 1);
    let mut fresh = session(&model, 128);
    let g = fresh.generate(&p2, &GenerateOptions { max_new: 8, ..Default::default() }).unwrap();
    assert_eq!(t2.tokens, g.tokens);

    // The same prompt again: all but its last token come from the cache.
    let t2b = go(&mut s, &p2, &greedy(8));
    assert_eq!((t2b.cached_tokens, &t2b.tokens), (p2.len() - 1, &g.tokens));

    // A prompt that diverges after 4 tokens rewinds there.
    let p3 = [&prompt[..4], &[1000, 2000, 3000][..]].concat();
    let t3 = go(&mut s, &p3, &greedy(6));
    assert_eq!(t3.cached_tokens, 4);
    let g3 = fresh.generate(&p3, &GenerateOptions { max_new: 6, ..Default::default() }).unwrap();
    assert_eq!(t3.tokens, g3.tokens);

    // A prompt beyond the context is refused before anything runs; the cache record is kept.
    let before = s.kv_ids().to_vec();
    let long = vec![13u32; 120];
    let e = s.complete(&long, &greedy(9), &mut |_| ControlFlow::Continue(())).unwrap_err();
    assert!(e.to_string().contains("129"), "{e}");
    assert_eq!(s.kv_ids(), before);
    // `generate` starts at position 0 and records what it ran.
    let g4 = s.generate(&prompt, &GenerateOptions { max_new: 3, ..Default::default() }).unwrap();
    assert_eq!(s.kv_ids(), [&prompt[..], &g4.tokens[..2]].concat());
    s.reset_kv();
    assert!(s.kv_ids().is_empty());
}

#[test]
fn the_callback_cancels_and_end_of_turn_ids_stop() {
    let tmp = scratch();
    let (model, prompt, want) = converted(tmp.path());
    let mut s = session(&model, 64);
    // The fixture's end-of-turn id is <|im_end|> (tokenizer config), not in config.json.
    assert_eq!(s.stop_ids, [151645]);

    let mut seen = Vec::new();
    let t = s
        .complete(&prompt, &greedy(16), &mut |id| {
            seen.push(id);
            if seen.len() == 3 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .unwrap();
    assert_eq!((t.finish, &t.tokens, &seen), (Finish::Cancelled, &want[..3].to_vec(), &want[..3].to_vec()));
    // The cancelled last token was never run.
    assert_eq!(s.kv_ids(), [&prompt[..], &want[..2]].concat());

    // Make greedy token 5 an end-of-turn id: the turn stops there, and the id is not a token.
    s.stop_ids.push(want[5]);
    let o = TurnOptions { stop_at_eos: true, ..greedy(16) };
    let t = go(&mut s, &prompt, &o);
    assert_eq!((t.finish, t.stop_id, &t.tokens), (Finish::Stop, Some(want[5]), &want[..5].to_vec()));
    assert_eq!(t.completion_tokens(), 6);
    assert_eq!(t.cached_tokens, prompt.len() - 1);
}

/// `complete_until` asks its stop callback before every prefill chunk: stopped there, the turn is
/// cancelled with no token, the KV record keeps exactly the chunks that ran, and the next turn
/// reuses them and gives the same greedy tokens as an uninterrupted run.
#[test]
fn a_stop_during_the_prefill_ends_the_turn_between_chunks() {
    let tmp = scratch();
    let (model, prompt, want) = converted(tmp.path());
    assert!(prompt.len() >= 6, "the prompt has {} ids", prompt.len());
    let mut s = session(&model, 128);
    s.model.set_prefill_chunk(2).unwrap();

    // Stop at the third check: two chunks of 2 tokens ran.
    let mut asked = 0;
    let mut stop = || {
        asked += 1;
        asked == 3
    };
    let mut tokens = 0;
    let t = s
        .complete_until(
            &prompt,
            &greedy(want.len()),
            &mut |_| {
                tokens += 1;
                ControlFlow::Continue(())
            },
            &mut stop,
        )
        .unwrap();
    assert_eq!((t.finish, t.tokens.len(), t.stop_id, tokens), (Finish::Cancelled, 0, None, 0));
    assert_eq!((t.cached_tokens, t.completion_tokens(), t.stats.prompt_tokens), (0, 0, prompt.len()));
    assert_eq!(s.kv_ids(), &prompt[..4], "the two chunks that ran");

    // The same prompt again: those 4 positions are reused, the tokens are the reference's.
    let t = go(&mut s, &prompt, &greedy(want.len()));
    assert_eq!((t.cached_tokens, &t.tokens), (4, &want));

    // A stop asked during the decode ends the turn after the token just produced.
    s.reset_kv();
    let mut n = 0;
    let t = s
        .complete_until(&prompt, &greedy(want.len()), &mut |_| ControlFlow::Continue(()), &mut || {
            n += 1;
            n > prompt.len().div_ceil(2) + 1
        })
        .unwrap();
    assert_eq!((t.finish, &t.tokens), (Finish::Cancelled, &want[..2].to_vec()));
}
