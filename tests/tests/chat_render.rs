//! Chat rendering against Python: the real Qwen3 template rendered by minijinja equals what jinja2
//! renders (as transformers does) and tokenizes to the same ids as the `tokenizers` package
//! (fixtures/chat/render_qwen3.py); the harmony rendering equals openai-harmony's text and ids
//! (fixtures/chat/render_harmony.py).

use picchio_runtime::chat::harmony::Harmony;
use picchio_runtime::chat::ChatFormat;
use picchio_runtime::model::tokenizer::Tokenizer;
use picchio_runtime::Config;
use picchio_tests::{chat_cases as cases, fixture, ids, reference_json};

#[test]
fn qwen3_template_renders_like_jinja2_and_tokenizes_like_tokenizers() {
    let dir = fixture("qwen3_moe_text");
    let cfg = Config::from_dir(&dir).unwrap();
    let format = ChatFormat::from_dir(&dir, &cfg).unwrap().expect("the fixture has a chat template");
    let tok = Tokenizer::from_dir(&dir).unwrap().unwrap();
    let cases = cases("qwen3_rendering.json");
    assert!(cases.len() >= 10);
    assert!(cases.iter().filter(|c| !c.tools.is_empty()).count() >= 2, "conversations with tools");
    for case in &cases {
        let name = &case.name;
        let text = format.render(&case.messages, case.opts()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(text, case.text, "{name}");
        assert_eq!(tok.encode(&text).unwrap(), case.ids, "{name}");
    }
}

#[test]
fn harmony_renders_like_openai_harmony() {
    let tok = Tokenizer::from_dir(&fixture("tokenizers/gpt_oss")).unwrap().unwrap();
    let r = reference_json(&fixture("chat"), "harmony_rendering.json");
    let h = Harmony::default();
    let cases = cases("harmony_rendering.json");
    assert!(cases.iter().filter(|c| !c.tools.is_empty()).count() >= 2, "conversations with tools");
    for case in &cases {
        let name = &case.name;
        let text =
            h.render(&case.messages, &case.tools, case.add_generation_prompt).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(text, case.text, "{name}");
        assert_eq!(tok.encode(&text).unwrap(), case.ids, "{name}");
    }
    // The turn ends at <|call|> and <|return|>, as openai-harmony's stop set for assistant actions.
    let mut stops: Vec<u32> =
        picchio_runtime::chat::harmony::STOP_TOKENS.iter().map(|t| tok.token_to_id(t).unwrap()).collect();
    stops.sort_unstable();
    let mut want = ids(&r, "stop_tokens_for_assistant_actions");
    want.sort_unstable();
    assert_eq!(stops, want);
}

#[test]
fn a_broken_template_names_its_file_and_line() {
    let tmp = picchio_tests::scratch();
    let dir = tmp.path();
    std::fs::copy(fixture("qwen3_moe_text/config.json"), dir.join("config.json")).unwrap();
    std::fs::write(dir.join("chat_template.jinja"), "{% for m in messages %}\n{{ m.content + }}\n{% endfor %}")
        .unwrap();
    let cfg = Config::from_dir(dir).unwrap();
    let e = ChatFormat::from_dir(dir, &cfg).err().expect("a syntax error does not compile");
    let msg = e.to_string();
    assert!(msg.contains("chat_template.jinja: chat template line 2"), "{msg}");
    assert!(msg.contains("syntax error"), "{msg}");
}
