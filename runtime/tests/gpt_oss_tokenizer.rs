//! The vendored GPT-OSS tokenizer (`tests/fixtures/tokenizers/gpt_oss`, o200k_harmony) through the
//! runtime's [`Tokenizer`]: known texts give tiktoken's ids, text round-trips, and the Harmony
//! special tokens have the ids `SOURCE.txt` lists.
//!
//! The expected ids of ordinary text are tiktoken's `o200k_base` ids (o200k_harmony only adds
//! special tokens to o200k_base; its ordinary ranks are the same), as published in the exact-id
//! tests of tiktoken-compatible tokenizers (e.g. splintr's `test_o200k.py`: "Hello world" →
//! [13225, 2375], "Hello, world!" → [13225, 11, 2375, 0], "你好世界" → [177519, 28428],
//! "Hello 🌍 World!" → [13225, 130321, 235, 5922, 0]). tiktoken itself could not be run here: it
//! downloads its BPE file, which this machine cannot reach.

use std::path::PathBuf;

use picchio_runtime::model::tokenizer::Tokenizer;

fn tokenizer() -> Tokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizers/gpt_oss");
    Tokenizer::from_dir(&dir).unwrap().expect("tests/fixtures/tokenizers/gpt_oss/tokenizer.json")
}

#[test]
fn known_texts_encode_to_tiktoken_o200k_ids() {
    let t = tokenizer();
    let cases: &[(&str, &[u32])] = &[
        ("Hello world", &[13225, 2375]),
        ("Hello, world!", &[13225, 11, 2375, 0]),
        ("你好世界", &[177519, 28428]),
        ("Hello 🌍 World!", &[13225, 130321, 235, 5922, 0]),
    ];
    for (text, want) in cases {
        assert_eq!(t.encode(text).unwrap(), *want, "{text:?}");
        assert_eq!(t.decode(want).unwrap(), *text, "{want:?}");
    }
}

#[test]
fn text_round_trips() {
    let t = tokenizer();
    for text in [
        "The quick brown fox jumps over the lazy dog.",
        "Multi-line\ntext\nwith\nnewlines",
        "Unicode: こんにちは 世界 🦀 — “quotes” and em—dashes",
        "fn main() {\n    println!(\"{}\", 1 + 2);\n}\n",
        "   \n\t  ",
    ] {
        let ids = t.encode(text).unwrap();
        assert!(!ids.is_empty() && ids.iter().all(|&i| i < 199_998), "{text:?}: {ids:?}");
        assert_eq!(t.decode(&ids).unwrap(), text);
    }
}

#[test]
fn harmony_special_tokens_have_the_listed_ids() {
    let t = tokenizer();
    // SOURCE.txt: 199,998 tokens + 21 added = 200,019.
    assert_eq!(t.vocab_size(), 200_019);
    for (tok, id) in [
        ("<|return|>", 200_002),
        ("<|constrain|>", 200_003),
        ("<|channel|>", 200_005),
        ("<|start|>", 200_006),
        ("<|end|>", 200_007),
        ("<|message|>", 200_008),
        ("<|call|>", 200_012),
        ("<|endoftext|>", 199_999),
    ] {
        assert_eq!(t.encode(tok).unwrap(), [id], "{tok}");
        assert_eq!(t.decode(&[id]).unwrap(), tok);
    }
    // Special tokens are split out of running text (transformers' added-token handling).
    let ids = t.encode("<|start|>user<|message|>Hello world<|end|>").unwrap();
    assert_eq!(ids.first(), Some(&200_006));
    assert_eq!(ids.last(), Some(&200_007));
    let msg = ids.iter().position(|&i| i == 200_008).expect("<|message|>");
    assert_eq!(&ids[msg + 1..ids.len() - 1], &[13225, 2375]);
}
