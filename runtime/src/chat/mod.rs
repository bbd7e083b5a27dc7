//! Chat: formatting a conversation with the model's own template ([`template`], [`harmony`]), the
//! ids that end the assistant's turn ([`stop`]), separating reasoning from the answer in what the
//! model writes ([`Reasoning`]), and generation that reuses the KV cache of the longest common
//! prefix with what the session ran before ([`turn`]). The front ends (`picchio chat`, `picchio
//! serve`) live in the CLI; this module has no terminal or HTTP code.

pub mod engine;
pub mod harmony;
pub mod stop;
pub mod template;
pub mod tools;
pub mod turn;

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::model::config::{Arch, Config};
pub use template::{FunctionCall, Message, RenderOptions, ToolCall};

/// A JSON value as templates see it, maps in their own key order (what [`RenderOptions::tools`] and
/// [`FunctionCall::arguments`] hold; deserialize it straight from the JSON text to keep the order).
pub use minijinja::Value as TemplateValue;

/// How a model's conversations are rendered.
pub enum ChatFormat {
    /// A Jinja chat template (tokenizer_config.json's `chat_template`, or chat_template.jinja).
    Jinja(Box<template::JinjaTemplate>),
    /// GPT-OSS's harmony format.
    Harmony(harmony::Harmony),
}

impl ChatFormat {
    /// The model directory's chat format: chat_template.jinja when present, else the
    /// `chat_template` of tokenizer_config.json (a string, or a list of `{name, template}` of which
    /// `default` is used), else harmony for a GPT-OSS config, else `None`.
    ///
    /// # Errors
    /// [`Error::Io`] for an unreadable file, [`Error::Config`] for a tokenizer_config.json that is
    /// not JSON, [`Error::Template`] for a template that does not compile.
    pub fn from_dir(dir: &Path, cfg: &Config) -> Result<Option<ChatFormat>> {
        let tc = read_tokenizer_config(dir)?;
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let src = std::fs::read_to_string(&jinja).map_err(Error::io(&jinja, "read the chat template"))?;
            return Ok(Some(ChatFormat::Jinja(Box::new(template::JinjaTemplate::new(&src, &jinja, tc.as_ref())?))));
        }
        let tc_path = dir.join("tokenizer_config.json");
        let src = match tc.as_ref().and_then(|t| t.get("chat_template")) {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
            _ => None,
        };
        if let Some(src) = src {
            return Ok(Some(ChatFormat::Jinja(Box::new(template::JinjaTemplate::new(&src, &tc_path, tc.as_ref())?))));
        }
        if cfg.arch() == Arch::GptOss {
            return Ok(Some(ChatFormat::Harmony(harmony::Harmony::default())));
        }
        Ok(None)
    }

    /// The chat format of a loaded model: for a GGUF, harmony for GPT-OSS (whatever template the
    /// file carries) and otherwise its `tokenizer.chat_template` with the special tokens its
    /// metadata names (`bos_token`, `eos_token`, … as the template expects them); for a directory,
    /// [`ChatFormat::from_dir`].
    ///
    /// # Errors
    /// As [`ChatFormat::from_dir`]; for a GGUF, those of
    /// [`crate::model::tokenizer::Tokenizer::from_gguf`] and a template that does not compile.
    pub fn for_model(model: &crate::model::Model) -> Result<Option<ChatFormat>> {
        let crate::model::ModelFiles::Gguf(g) = model.files() else {
            return Self::from_dir(model.dir(), model.config());
        };
        if model.config().arch() == Arch::GptOss {
            return Ok(Some(ChatFormat::Harmony(harmony::Harmony::default())));
        }
        let meta = g.gguf().meta();
        if meta.get("tokenizer.chat_template").is_none() {
            return Ok(None);
        }
        let t = crate::model::tokenizer::Tokenizer::from_gguf(meta)?;
        let Some(src) = t.chat_template.as_deref() else { return Ok(None) };
        let tokens = t.template_tokens();
        Ok(Some(ChatFormat::Jinja(Box::new(template::JinjaTemplate::new(src, g.path(), Some(&tokens))?))))
    }

    /// Renders `messages` as the model's prompt text.
    ///
    /// # Errors
    /// As [`template::JinjaTemplate::render`] / [`harmony::Harmony::render`].
    pub fn render(&self, messages: &[Message], opts: RenderOptions<'_>) -> Result<String> {
        match self {
            ChatFormat::Jinja(t) => t.render(messages, opts),
            ChatFormat::Harmony(h) => h.render(messages, opts.tools, opts.add_generation_prompt),
        }
    }

    /// How reasoning is marked in what the model writes.
    pub fn reasoning(&self) -> Reasoning {
        match self {
            ChatFormat::Jinja(_) => Reasoning::Think,
            ChatFormat::Harmony(_) => Reasoning::Harmony,
        }
    }

    /// A short name: the template file, or `harmony`.
    pub fn describe(&self) -> String {
        match self {
            ChatFormat::Jinja(t) => format!("jinja template from {}", t.path().display()),
            ChatFormat::Harmony(h) => format!("harmony (reasoning {})", h.reasoning_effort),
        }
    }
}

/// tokenizer_config.json of `dir`, parsed, or `None` when absent.
///
/// # Errors
/// [`Error::Io`], [`Error::Config`] (not JSON).
pub fn read_tokenizer_config(dir: &Path) -> Result<Option<serde_json::Value>> {
    let path: PathBuf = dir.join("tokenizer_config.json");
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(Error::io(&path, "read"))?;
    serde_json::from_str(&text).map(Some).map_err(|cause| Error::Config { path, cause })
}

/// How a model marks its reasoning in its output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reasoning {
    /// Qwen3: `<think>…</think>` before the answer.
    Think,
    /// GPT-OSS: the `analysis` channel before the `final` one.
    Harmony,
}

impl Reasoning {
    /// Splits the assistant text generated so far (decoded with special tokens) into (reasoning,
    /// answer); `done` when the turn has ended (what was held back as a possible marker is final).
    /// For `Think`: the text before `</think>` (without `<think>` and the newlines around)
    /// is reasoning, the text after it (leading newlines dropped) the answer; an open `<think>`
    /// without its end is all reasoning; no tag at all is all answer, unchanged. For `Harmony`:
    /// [`harmony::split_output`] (text outside every channel is answer).
    pub fn split(self, text: &str, done: bool) -> (String, String) {
        match self {
            Reasoning::Harmony => harmony::split_output(text, done),
            Reasoning::Think => {
                let t = text.trim_start_matches('\n');
                if let Some((r, a)) = t.split_once("</think>") {
                    let r = r.strip_prefix("<think>").unwrap_or(r);
                    (r.trim_matches('\n').to_string(), a.trim_start_matches('\n').to_string())
                } else if let Some(r) = t.strip_prefix("<think>") {
                    (r.trim_matches('\n').to_string(), String::new())
                } else if "<think>".starts_with(t) && !t.is_empty() && !done {
                    (String::new(), String::new()) // a tag still being written
                } else {
                    (String::new(), text.to_string())
                }
            }
        }
    }
}

/// Streams the reasoning and the answer apart while tokens arrive: each [`ReasoningStream::push`] of
/// the whole text so far returns what is new in each part since the last call.
pub struct ReasoningStream {
    kind: Reasoning,
    reasoning: String,
    answer: String,
    /// Harmony with function tools: calls come out of the text ([`harmony::split_output_calls`]).
    tools: bool,
    calls: Vec<tools::Call>,
}

impl ReasoningStream {
    /// A stream for `kind`.
    pub fn new(kind: Reasoning) -> Self {
        ReasoningStream { kind, reasoning: String::new(), answer: String::new(), tools: false, calls: Vec::new() }
    }

    /// A stream for `kind` of a request with function tools: harmony's calls to `functions.*` are
    /// taken out as [`tools::Call`]s ([`ReasoningStream::calls`]) rather than shown as reasoning.
    pub fn with_tools(kind: Reasoning) -> Self {
        ReasoningStream { tools: true, ..Self::new(kind) }
    }

    /// The kind of text it splits.
    pub fn kind(&self) -> Reasoning {
        self.kind
    }

    /// The complete calls seen so far (harmony with tools; else none).
    pub fn calls(&self) -> &[tools::Call] {
        &self.calls
    }

    /// Given the whole assistant text so far, returns (new reasoning, new answer). A part that was
    /// rewritten rather than extended (a trailing newline that turned out to be the end of the
    /// reasoning) yields nothing new.
    pub fn push(&mut self, text: &str) -> (String, String) {
        self.push_part(text, false)
    }

    /// As [`ReasoningStream::push`] for the turn's whole text, once it has ended: releases what was
    /// held back as a possible marker.
    pub fn push_last(&mut self, text: &str) -> (String, String) {
        self.push_part(text, true)
    }

    fn push_part(&mut self, text: &str, done: bool) -> (String, String) {
        let (r, a) = match self.kind {
            Reasoning::Harmony if self.tools => {
                let (r, a, calls) = harmony::split_output_calls(text, done);
                if calls.starts_with(&self.calls) {
                    self.calls = calls;
                }
                (r, a)
            }
            kind => kind.split(text, done),
        };
        let dr = delta(&mut self.reasoning, r);
        let da = delta(&mut self.answer, a);
        (dr, da)
    }

    /// The reasoning and answer seen so far.
    pub fn parts(&self) -> (&str, &str) {
        (&self.reasoning, &self.answer)
    }
}

fn delta(seen: &mut String, now: String) -> String {
    if now.len() > seen.len() && now.starts_with(seen.as_str()) {
        let d = now[seen.len()..].to_string();
        *seen = now;
        d
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn think_tags_split_reasoning_from_the_answer() {
        let k = Reasoning::Think;
        assert_eq!(k.split("<think>\nhmm\n</think>\n\nYes.", false), ("hmm".into(), "Yes.".into()));
        assert_eq!(k.split("<think>\nhm", false), ("hm".into(), String::new()));
        assert_eq!(k.split("Plain.", false), (String::new(), "Plain.".into()));
        assert_eq!(k.split("\nPlain.", false), (String::new(), "\nPlain.".into()));
        assert_eq!(k.split("<thi", false), (String::new(), String::new()));
        assert_eq!(k.split("<thi", true), (String::new(), "<thi".into()), "not a tag once the turn ended");
        let mut s = ReasoningStream::new(k);
        let mut text = String::new();
        let (mut r, mut a) = (String::new(), String::new());
        for piece in ["<think>", "\n", "a", "b\n", "</think>", "\n\n", "X", "Y"] {
            text.push_str(piece);
            let (dr, da) = s.push(&text);
            r.push_str(&dr);
            a.push_str(&da);
        }
        assert_eq!((r.as_str(), a.as_str()), ("ab", "XY"));
    }
}
