//! The ids that end the assistant's turn, from every place a Hugging Face model keeps them, in
//! transformers' order of authority: generation_config.json's `eos_token_id` (what `generate`
//! stops at), then config.json's, then the tokenizer config's `eos_token`, then the chat format's
//! own end-of-turn tokens (the token a Jinja template writes after an assistant message, e.g.
//! Qwen3's `<|im_end|>`; harmony's `<|return|>` and `<|call|>`, never `<|end|>`). Every source
//! adds to the set (first ones first, no repeats): a config whose `eos_token_id` is null — every
//! fixture here — no longer leaves `--stop-at-eos` with nothing to stop at.

use std::path::Path;

use super::template::{special_token, Message, RenderOptions};
use super::{read_tokenizer_config, ChatFormat};
use crate::error::{Error, Result};
use crate::model::config::Config;
use crate::model::tokenizer::Tokenizer;

/// Where one end-of-turn id came from (for `--verbose` and the docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StopId {
    /// The id.
    pub id: u32,
    /// `generation_config.json`, `config.json`, `tokenizer_config.json eos_token`, `chat template`.
    pub source: &'static str,
}

/// The end-of-turn ids of the model in `dir` (see the module doc), deduplicated, in order of source.
/// `tokenizer` maps token spellings to ids (without one only the numeric sources count); `format`
/// is the model's chat format, when it has one.
///
/// # Errors
/// [`Error::Config`] for a generation_config.json or tokenizer_config.json that is not JSON;
/// [`Error::Io`].
pub fn end_of_turn_ids(
    dir: &Path,
    cfg: &Config,
    tokenizer: Option<&Tokenizer>,
    format: Option<&ChatFormat>,
) -> Result<Vec<StopId>> {
    let mut out: Vec<StopId> = Vec::new();
    let mut add = |id: u32, source: &'static str| {
        if !out.iter().any(|s| s.id == id) {
            out.push(StopId { id, source });
        }
    };
    let gen = dir.join("generation_config.json");
    if gen.is_file() {
        let text = std::fs::read_to_string(&gen).map_err(Error::io(&gen, "read"))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|cause| Error::Config { path: gen.clone(), cause })?;
        for id in json_ids(v.get("eos_token_id")) {
            add(id, "generation_config.json");
        }
    }
    for id in cfg.eos_ids() {
        add(id, "config.json");
    }
    let Some(tok) = tokenizer else { return Ok(out) };
    if let Some(tc) = read_tokenizer_config(dir)? {
        if let Some(id) = special_token(&tc, "eos_token").and_then(|t| tok.token_to_id(&t)) {
            add(id, "tokenizer_config.json eos_token");
        }
    }
    match format {
        Some(ChatFormat::Harmony(_)) => {
            for t in super::harmony::STOP_TOKENS {
                if let Some(id) = tok.token_to_id(t) {
                    add(id, "harmony format");
                }
            }
        }
        Some(f @ ChatFormat::Jinja(_)) => {
            if let Some(id) = template_end_of_turn(f, tok) {
                add(id, "chat template");
            }
        }
        None => {}
    }
    Ok(out)
}

/// The special token a Jinja template writes right after an assistant message's text: renders a
/// user message and an assistant message with a probe text, and takes the first token after the
/// probe if it is a special token. `None` when the template does not render such a conversation.
pub fn template_end_of_turn(format: &ChatFormat, tok: &Tokenizer) -> Option<u32> {
    const PROBE: &str = "picchio end-of-turn probe";
    let msgs = [Message::new("user", "hello"), Message::new("assistant", PROBE)];
    let text = match format.render(&msgs, RenderOptions::default()) {
        Ok(t) => t,
        Err(e) => {
            tracing::debug!("no end-of-turn token from the chat template: {e}");
            return None;
        }
    };
    let after = &text[text.find(PROBE)? + PROBE.len()..];
    let first = *tok.encode(after).ok()?.first()?;
    tok.is_special(first).then_some(first)
}

/// An `eos_token_id` value: an integer, a list of integers, or null.
fn json_ids(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|v| v.as_u64()).map(|n| n as u32).collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixtures() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
    }

    fn ids(v: &[StopId]) -> Vec<(u32, &'static str)> {
        v.iter().map(|s| (s.id, s.source)).collect()
    }

    #[test]
    fn qwen3_fixture_ends_at_im_end_although_its_config_has_none() {
        let dir = fixtures().join("qwen3_moe_text");
        let cfg = Config::from_dir(&dir).unwrap();
        assert!(cfg.eos_ids().is_empty());
        let tok = Tokenizer::from_dir(&dir).unwrap().unwrap();
        let f = ChatFormat::from_dir(&dir, &cfg).unwrap().unwrap();
        let got = end_of_turn_ids(&dir, &cfg, Some(&tok), Some(&f)).unwrap();
        // <|im_end|> = 151645, named by the tokenizer config and written by the template.
        assert_eq!(ids(&got), [(151645, "tokenizer_config.json eos_token")]);
        assert_eq!(template_end_of_turn(&f, &tok), Some(151645));
        // Without a tokenizer only the numeric sources count: none here.
        assert!(end_of_turn_ids(&dir, &cfg, None, None).unwrap().is_empty());
    }

    #[test]
    fn generation_config_comes_first_and_sources_add_up() {
        let src = fixtures().join("qwen3_moe_text");
        let dir = tempfile::tempdir().unwrap();
        for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
        }
        std::fs::write(dir.path().join("generation_config.json"), r#"{"eos_token_id": [151643, 151645]}"#).unwrap();
        let cfg = Config::from_dir(dir.path()).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap().unwrap();
        let got = end_of_turn_ids(dir.path(), &cfg, Some(&tok), None).unwrap();
        assert_eq!(ids(&got), [(151643, "generation_config.json"), (151645, "generation_config.json")]);
        std::fs::write(dir.path().join("generation_config.json"), "{not json").unwrap();
        let e = end_of_turn_ids(dir.path(), &cfg, Some(&tok), None).unwrap_err();
        assert!(e.to_string().contains("generation_config.json"), "{e}");
    }

    #[test]
    fn gpt_oss_ends_at_return_and_call_not_end() {
        let dir = tempfile::tempdir().unwrap();
        let tok_dir = fixtures().join("tokenizers/gpt_oss");
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(tok_dir.join(f), dir.path().join(f)).unwrap();
        }
        std::fs::copy(fixtures().join("gpt_oss_bf16/config.json"), dir.path().join("config.json")).unwrap();
        let cfg = Config::from_dir(dir.path()).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap().unwrap();
        let f = ChatFormat::from_dir(dir.path(), &cfg).unwrap().unwrap();
        assert!(matches!(f, ChatFormat::Harmony(_)));
        let got = end_of_turn_ids(dir.path(), &cfg, Some(&tok), Some(&f)).unwrap();
        assert_eq!(ids(&got), [(200002, "tokenizer_config.json eos_token"), (200012, "harmony format")]);
        assert_eq!(tok.token_to_id("<|end|>"), Some(200007));
        assert!(!got.iter().any(|s| s.id == 200007));
    }
}
