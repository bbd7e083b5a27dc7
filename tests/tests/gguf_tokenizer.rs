//! The tokenizer rebuilt from a GGUF's metadata against the Hugging Face tokenizer the GGUF was made
//! from. The GGUFs (`tests/fixtures/gguf/{qwen3,gpt_oss}_tokenizer.gguf`) were written by llama.cpp's
//! own vocabulary code (`make_tokenizer_fixtures.py` there) from `qwen3_moe_text/` and
//! `tokenizers/gpt_oss/`; the oracle is that folder's tokenizer.json loaded by the `tokenizers` crate.

use std::sync::OnceLock;

use picchio_core::format::gguf::{Array, GgufFile, Value};
use picchio_core::rng::SplitMix64;
use picchio_runtime::chat::template::JinjaTemplate;
use picchio_runtime::model::gguf_tokenizer::GgufTokenizer;
use picchio_runtime::model::tokenizer::Tokenizer;
use picchio_runtime::Error;
use picchio_tests::{chat_cases, fixture};
use serde_json::Value as Json;

/// One fixture: the GGUF-built tokenizer, the tokenizer.json one, and tokenizer_config.json.
struct Pair {
    gguf: GgufTokenizer,
    json: Tokenizer,
    config: Json,
}

fn load(gguf: &str, dir: &str) -> Pair {
    let file = GgufFile::open(fixture("gguf").join(gguf)).unwrap();
    let gguf = Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{e}"));
    let dir = fixture(dir);
    let json = Tokenizer::from_dir(&dir).unwrap().unwrap();
    let config = serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap()).unwrap();
    Pair { gguf, json, config }
}

fn qwen3() -> &'static Pair {
    static P: OnceLock<Pair> = OnceLock::new();
    P.get_or_init(|| load("qwen3_tokenizer.gguf", "qwen3_moe_text"))
}

fn gpt_oss() -> &'static Pair {
    static P: OnceLock<Pair> = OnceLock::new();
    P.get_or_init(|| load("gpt_oss_tokenizer.gguf", "tokenizers/gpt_oss"))
}

/// Hand-picked texts: every script and run the two pre-tokenizer regexes treat differently, llama.cpp's
/// own pre-tokenizer check text, code, and the chat special tokens in context.
const TEXTS: &[&str] = &[
    "",
    "The quick brown fox jumps over the lazy dog.",
    "Hello world",
    " Hello world",
    "  leading spaces and trailing spaces   ",
    "HELLO WORLD, SHOUTING LOUDLY",
    "camelCaseIdentifier and PascalCaseName and snake_case_name and SCREAMING_CASE",
    "HTTPServerError XMLHttpRequest iPhone eBay McDonald's",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
    "DON'T WON'T CAN'T shouldn't y'all ma'am",
    "3 33 333 3333 33333 333333 3333333 33333333",
    "1234567890123456789012345678901234567890",
    "3.3 3..3 3...3 3.14159 2.718281828 -42 +7 1e-10 0x1F 0b1010",
    "1,000,000.00 $1,234.56 €99 ¥1000 100% 50°C",
    "phone: +1 (555) 123-4567, date 2026-12-06T21:24:20Z",
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n",
    "\r\n\r\nwindows line endings\r\n",
    "tabs\tbetween\t\twords\t\t\t",
    "a  b   c    d     e      f",
    "trailing newline\n",
    "\n\n\nleading newlines",
    "🚀 (normal) 😶\u{200d}🌫\u{fe0f} (multiple emojis concatenated) ✅ 🦙🦙",
    "👨\u{200d}👩\u{200d}👧\u{200d}👦 family, 🇮🇹 🇯🇵 flags, 👍🏽 skin tone",
    "emoji😀between😀words",
    "我想在apple工作1314151天～",
    "你好，世界！今天天气很好。",
    "こんにちは世界。カタカナとひらがな、漢字。",
    "안녕하세요 세계",
    "Привет, мир! нещо на Български",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "កាន់តែពិសេសអាច😁",
    "Ελληνικά ΚΕΦΑΛΑΙΑ και μικρά",
    "Ünïcödé àccénts çà et là, naïve café, Straße, ÆØÅ",
    "e\u{301}te\u{301} (combining accents)",
    "∑∫√∞ ≤ ≥ ≠ ± × ÷ → ← ↔",
    "ﬁ ﬂ ① ② ³ ½ Ⅻ",
    "''''''```````\"\"\"\"......!!!!!!?????? ------======= ~~~ ***",
    "<html><body class=\"x\">Hi &amp; bye</body></html>",
    "https://example.com/path/to/page?query=1&x=y#frag",
    "user@example.com /usr/local/bin ./relative/path C:\\Windows\\System32",
    "fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * 2).collect();\n    println!(\"{x:?}\");\n}\n",
    "def f(x):\n\tif x > 0:\n\t\treturn x ** 2\n\treturn -x\n",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "    indented by four\n        by eight\n",
    "x=1;y=2;z=x+y//comment\n/* block */",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<think>\n\n</think>\n\nThe answer is 4.<|im_end|>",
    "<think>\nLet me think about 2+2.\n</think>\n\n4",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>",
    "<tool_response>\n{\"temperature\": 21}\n</tool_response>",
    "<|endoftext|>",
    "text<|endoftext|>more text",
    "<|im_end|><|im_end|><|im_start|>",
    "<|im_st and <|im_end| are not tokens",
    "<|start|>system<|message|>You are ChatGPT.<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant",
    "<|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|return|>",
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>",
    "<|startoftext|>hello<|endofprompt|>",
    "A\u{a0}non-breaking space and a\u{2003}em space and a\u{3000}ideographic space",
    "zero\u{200b}width\u{200b}spaces",
    "mixed 日本語 and English and 123 and émoji 🎉 in one line",
];

/// Pieces the random texts are made of: words, numbers, punctuation, whitespace runs, other scripts,
/// emoji, and special tokens.
const PIECES: &[&str] = &[
    "the",
    "The",
    " the",
    "THE",
    "quick",
    " brown",
    "fox",
    "'s",
    "'ll",
    "n't",
    "I",
    "you're",
    "0",
    "7",
    "42",
    "123",
    "4567",
    "89012",
    "3.14",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n",
    "\n ",
    ",",
    ".",
    "!",
    "?",
    "...",
    "--",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    "\"",
    "'",
    "`",
    "```",
    "/",
    "\\",
    "_",
    "-",
    "=",
    "==",
    "=>",
    "->",
    "::",
    "#",
    "@",
    "&",
    "%",
    "$",
    "€",
    "中文",
    "字",
    "日本",
    "語",
    "한국어",
    "русский",
    "Ελλάδα",
    "عربى",
    "हिन्दी",
    "ไทย",
    "🚀",
    "😀",
    "🦙",
    "👍🏽",
    "🇮🇹",
    "é",
    "ß",
    "Æ",
    "ﬁ",
    "½",
    "∑",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<|start|>",
    "<|message|>",
    "<|end|>",
    "<|channel|>",
    "<|return|>",
    "<|call|>",
    "<|",
    "|>",
    "<",
    ">",
    "camelCase",
    "HTTPServer",
    "snake_case",
    "x86_64",
    "fn",
    "let",
    "def",
    "return",
    "https://",
    "www.",
    ".com",
];

/// [`TEXTS`], then 300 random concatenations of 1 to 12 [`PIECES`] (fixed seed).
fn corpus() -> Vec<String> {
    let mut out: Vec<String> = TEXTS.iter().map(|s| s.to_string()).collect();
    let mut rng = SplitMix64::new(22);
    for _ in 0..300 {
        let n = 1 + rng.below(12) as usize;
        out.push((0..n).map(|_| PIECES[rng.below(PIECES.len() as u64) as usize]).collect());
    }
    out
}

/// Same ids, same decoding (with and without special tokens) from both tokenizers on every text.
fn same_ids_and_decoding(p: &Pair, texts: &[String]) -> usize {
    let (g, j) = (&p.gguf.tokenizer, &p.json);
    let mut tokens = 0;
    for (i, text) in texts.iter().enumerate() {
        let ids = j.encode(text).unwrap();
        assert_eq!(g.encode(text).unwrap(), ids, "text {i} {text:?}");
        assert_eq!(g.decode(&ids).unwrap(), j.decode(&ids).unwrap(), "text {i} {text:?}");
        assert_eq!(g.decode_text(&ids).unwrap(), j.decode_text(&ids).unwrap(), "text {i} {text:?}");
        tokens += ids.len();
    }
    tokens
}

/// [`same_ids_and_decoding`] on the whole corpus, for the fixture whose pre-tokenizer is `pre`.
fn agrees_on_the_corpus(p: &Pair, pre: &str) -> Vec<String> {
    assert_eq!(p.gguf.pre.name, pre);
    let texts = corpus();
    let tokens = same_ids_and_decoding(p, &texts);
    assert!(texts.len() >= 350 && tokens > 3000, "{} texts, {tokens} tokens", texts.len());
    texts
}

#[test]
fn qwen3_gguf_tokenizes_like_its_tokenizer_json() {
    agrees_on_the_corpus(qwen3(), "qwen2");
}

#[test]
fn gpt_oss_gguf_tokenizes_like_its_tokenizer_json() {
    let p = gpt_oss();
    // No normalizer in o200k: decoding gives back the very text.
    for text in &agrees_on_the_corpus(p, "gpt-4o") {
        assert_eq!(&p.gguf.tokenizer.decode(&p.gguf.tokenizer.encode(text).unwrap()).unwrap(), text);
    }
}

/// Every id has the same spelling in both, and the same ids are special, except the added tokens
/// the converter marks control because they look like `<|…|>` (Qwen3's FIM and repo tokens are not
/// special in its tokenizer.json): decoding for display drops those too.
#[test]
fn vocabularies_and_special_flags_match() {
    for (p, looks_special) in [
        (
            qwen3(),
            &["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"][..],
        ),
        (gpt_oss(), &[][..]),
    ] {
        let (g, j) = (&p.gguf.tokenizer, &p.json);
        assert_eq!(g.vocab_size(), j.vocab_size());
        let mut differ = Vec::new();
        for id in 0..(g.vocab_size() as u32 + 2000) {
            assert_eq!(g.id_to_token(id), j.id_to_token(id), "id {id}");
            if g.is_special(id) != j.is_special(id) {
                assert!(g.is_special(id), "id {id}: special in tokenizer.json only");
                differ.push(g.id_to_token(id).unwrap());
            }
        }
        assert_eq!(differ, looks_special, "{}", g.path().display());
    }
}

/// The special ids and the chat template are tokenizer_config.json's.
#[test]
fn special_ids_and_chat_template_are_the_configs() {
    for p in [qwen3(), gpt_oss()] {
        let c = &p.config;
        let id = |k: &str| c.get(k).and_then(Json::as_str).map(|t| p.json.token_to_id(t).unwrap());
        let s = &p.gguf.special;
        let name = p.gguf.tokenizer.path().display();
        assert_eq!(
            (s.bos, s.eos, s.pad, s.unk),
            (id("bos_token"), id("eos_token"), id("pad_token"), id("unk_token")),
            "{name}"
        );
        assert!(s.eos.is_some() && s.pad.is_some(), "{name}");
        let flag = |k: &str| Some(c.get(k).and_then(Json::as_bool).unwrap_or(false));
        assert_eq!((s.add_bos, s.add_eos), (flag("add_bos_token"), flag("add_eos_token")), "{name}");
        assert_eq!(p.gguf.chat_template.as_deref(), c.get("chat_template").and_then(Json::as_str), "{name}");
    }
    assert!(qwen3().gguf.chat_template.is_some());
    assert_eq!(
        qwen3().gguf.template_tokens(),
        serde_json::json!({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    );
}

/// A conversation rendered from the GGUF alone (its template, its special tokens, its tokenizer)
/// gives the text and ids jinja2 + transformers gave (`tests/fixtures/chat/qwen3_rendering.json`).
#[test]
fn qwen3_chat_from_the_gguf_alone_matches_the_reference_rendering() {
    let g = &qwen3().gguf;
    let template =
        JinjaTemplate::new(g.chat_template.as_deref().unwrap(), g.tokenizer.path(), Some(&g.template_tokens()))
            .unwrap();
    let cases = chat_cases("qwen3_rendering.json");
    assert!(cases.len() >= 10);
    for c in &cases {
        let rendered = template.render(&c.messages, c.opts()).unwrap_or_else(|e| panic!("{}: {e}", c.name));
        assert_eq!(rendered, c.text, "{}", c.name);
        assert_eq!(g.tokenizer.encode(&rendered).unwrap(), c.ids, "{}", c.name);
    }
}

// --- refusals -----------------------------------------------------------------------------------

/// Writes `meta` as a GGUF v3 with no tensors (what `GGUFWriter` writes for a vocab-only file).
fn gguf_bytes(meta: &[(String, Value)]) -> Vec<u8> {
    fn string(b: &mut Vec<u8>, s: &str) {
        b.extend_from_slice(&(s.len() as u64).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
    }
    fn array(b: &mut Vec<u8>, a: &Array) {
        macro_rules! each {
            ($v:expr, $ty:expr, $put:expr) => {{
                b.extend_from_slice(&($ty as u32).to_le_bytes());
                b.extend_from_slice(&($v.len() as u64).to_le_bytes());
                for x in $v {
                    $put(&mut *b, x);
                }
            }};
        }
        match a {
            Array::U8(v) => each!(v, 0, |b: &mut Vec<u8>, x: &u8| b.push(*x)),
            Array::I8(v) => each!(v, 1, |b: &mut Vec<u8>, x: &i8| b.extend_from_slice(&x.to_le_bytes())),
            Array::U16(v) => each!(v, 2, |b: &mut Vec<u8>, x: &u16| b.extend_from_slice(&x.to_le_bytes())),
            Array::I16(v) => each!(v, 3, |b: &mut Vec<u8>, x: &i16| b.extend_from_slice(&x.to_le_bytes())),
            Array::U32(v) => each!(v, 4, |b: &mut Vec<u8>, x: &u32| b.extend_from_slice(&x.to_le_bytes())),
            Array::I32(v) => each!(v, 5, |b: &mut Vec<u8>, x: &i32| b.extend_from_slice(&x.to_le_bytes())),
            Array::F32(v) => each!(v, 6, |b: &mut Vec<u8>, x: &f32| b.extend_from_slice(&x.to_le_bytes())),
            Array::Bool(v) => each!(v, 7, |b: &mut Vec<u8>, x: &bool| b.push(u8::from(*x))),
            Array::String(v) => each!(v, 8, |b: &mut Vec<u8>, x: &String| string(b, x)),
            Array::Array(v) => each!(v, 9, |b: &mut Vec<u8>, x: &Array| array(b, x)),
            Array::U64(v) => each!(v, 10, |b: &mut Vec<u8>, x: &u64| b.extend_from_slice(&x.to_le_bytes())),
            Array::I64(v) => each!(v, 11, |b: &mut Vec<u8>, x: &i64| b.extend_from_slice(&x.to_le_bytes())),
            Array::F64(v) => each!(v, 12, |b: &mut Vec<u8>, x: &f64| b.extend_from_slice(&x.to_le_bytes())),
        }
    }
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&(meta.len() as u64).to_le_bytes());
    for (key, v) in meta {
        string(&mut b, key);
        b.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
        match v {
            Value::U8(x) => b.push(*x),
            Value::I8(x) => b.extend_from_slice(&x.to_le_bytes()),
            Value::U16(x) => b.extend_from_slice(&x.to_le_bytes()),
            Value::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
            Value::U32(x) => b.extend_from_slice(&x.to_le_bytes()),
            Value::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
            Value::F32(x) => b.extend_from_slice(&x.to_le_bytes()),
            Value::Bool(x) => b.push(u8::from(*x)),
            Value::String(s) => string(&mut b, s),
            Value::Array(a) => array(&mut b, a),
            Value::U64(x) => b.extend_from_slice(&x.to_le_bytes()),
            Value::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
            Value::F64(x) => b.extend_from_slice(&x.to_le_bytes()),
        }
    }
    b
}

/// The Qwen3 fixture's metadata with `edit` applied, written and read back, then built: the
/// refusal's key and message.
fn refusal(edit: impl FnOnce(&mut Vec<(String, Value)>)) -> (String, String) {
    let file = GgufFile::open(fixture("gguf").join("qwen3_tokenizer.gguf")).unwrap();
    let mut meta = file.metadata().to_vec();
    edit(&mut meta);
    let damaged = GgufFile::from_bytes("/d/damaged.gguf", &gguf_bytes(&meta)).unwrap();
    match Tokenizer::from_gguf(&damaged) {
        Err(e @ Error::GgufTokenizer { .. }) => {
            let shown = e.to_string();
            let Error::GgufTokenizer { path, key, message } = e else { unreachable!() };
            assert_eq!(path, std::path::Path::new("/d/damaged.gguf"));
            assert_eq!(shown, format!("/d/damaged.gguf: tokenizer metadata `{key}`: {message}"));
            (key, message)
        }
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("the damaged metadata was accepted"),
    }
}

fn set(meta: &mut [(String, Value)], key: &str, v: Value) {
    meta.iter_mut().find(|(k, _)| k == key).unwrap_or_else(|| panic!("{key}")).1 = v;
}

fn get_mut<'a>(meta: &'a mut [(String, Value)], key: &str) -> &'a mut Value {
    &mut meta.iter_mut().find(|(k, _)| k == key).unwrap_or_else(|| panic!("{key}")).1
}

#[test]
fn a_rewritten_copy_is_accepted() {
    // The writer above round-trips: the undamaged metadata builds the same tokenizer.
    let file = GgufFile::open(fixture("gguf").join("qwen3_tokenizer.gguf")).unwrap();
    let copy = GgufFile::from_bytes("/d/copy.gguf", &gguf_bytes(file.metadata())).unwrap();
    let t = Tokenizer::from_gguf(&copy).unwrap();
    let text = "Hello, 世界! <|im_end|>";
    assert_eq!(t.tokenizer.encode(text).unwrap(), qwen3().json.encode(text).unwrap());
    assert_eq!(t.special, qwen3().gguf.special);
}

#[test]
fn bad_tokenizer_metadata_is_refused_naming_the_key() {
    let (key, msg) = refusal(|m| m.retain(|(k, _)| k != "tokenizer.ggml.merges"));
    assert_eq!(key, "tokenizer.ggml.merges");
    assert!(msg.contains("missing"), "{msg}");

    let (key, msg) = refusal(|m| set(m, "tokenizer.ggml.pre", Value::String("llama-bpe".into())));
    assert_eq!(key, "tokenizer.ggml.pre");
    assert_eq!(msg, "\"llama-bpe\" is not a pre-tokenizer picchio builds (supported: qwen2, gpt-4o)");

    let (key, msg) = refusal(|m| set(m, "tokenizer.ggml.model", Value::String("llama".into())));
    assert_eq!(key, "tokenizer.ggml.model");
    assert_eq!(msg, "\"llama\" is not a tokenizer model picchio builds (supported: gpt2)");

    let (key, msg) = refusal(|m| {
        let Value::Array(Array::I32(types)) = get_mut(m, "tokenizer.ggml.token_type") else { panic!() };
        types.pop();
    });
    assert_eq!(key, "tokenizer.ggml.token_type");
    assert_eq!(msg, "has 151935 entries but tokenizer.ggml.tokens has 151936: one type per token is expected");

    let (key, msg) = refusal(|m| {
        let Value::Array(Array::I32(types)) = get_mut(m, "tokenizer.ggml.token_type") else { panic!() };
        types[100] = 6;
    });
    assert_eq!(key, "tokenizer.ggml.token_type");
    assert!(msg.starts_with("token 100 has type 6: expected 1 (normal)"), "{msg}");

    let (key, msg) = refusal(|m| {
        let Value::Array(Array::String(merges)) = get_mut(m, "tokenizer.ggml.merges") else { panic!() };
        merges[5] = "Ġ zzz-not-a-token".into();
    });
    assert_eq!(key, "tokenizer.ggml.merges");
    assert_eq!(msg, "entry 5 \"Ġ zzz-not-a-token\": \"zzz-not-a-token\" is not a token");

    let (key, msg) = refusal(|m| {
        let Value::Array(Array::String(merges)) = get_mut(m, "tokenizer.ggml.merges") else { panic!() };
        merges[7] = "nospace".into();
    });
    assert_eq!(key, "tokenizer.ggml.merges");
    assert!(msg.contains("entry 7 \"nospace\" is not two tokens"), "{msg}");

    let (key, msg) = refusal(|m| {
        let Value::Array(Array::String(tokens)) = get_mut(m, "tokenizer.ggml.tokens") else { panic!() };
        tokens[1] = tokens[0].clone();
    });
    assert_eq!(key, "tokenizer.ggml.tokens");
    assert_eq!(msg, "token \"!\" is spelled at ids 0 and 1");

    let (key, msg) = refusal(|m| set(m, "tokenizer.ggml.tokens", Value::Array(Array::I32(vec![1, 2]))));
    assert_eq!(key, "tokenizer.ggml.tokens");
    assert_eq!(msg, "expected array of string, found array of i32");

    let (key, msg) = refusal(|m| set(m, "tokenizer.ggml.eos_token_id", Value::U32(151936)));
    assert_eq!(key, "tokenizer.ggml.eos_token_id");
    assert_eq!(msg, "id 151936 is beyond the 151936 tokens");

    let (key, msg) = refusal(|m| set(m, "tokenizer.chat_template", Value::U32(1)));
    assert_eq!(key, "tokenizer.chat_template");
    assert_eq!(msg, "expected string, found u32");
}
