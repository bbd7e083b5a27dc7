//! One request, start to end, for the chat front ends: render the messages with the model's chat
//! format (or take raw text / ids), check the context, generate with KV reuse
//! ([`Session::complete`]), turn the tokens into text as they come (holding back an unfinished
//! UTF-8 sequence and anything that may be the start of a stop string), split reasoning from the
//! answer, and stop at an end-of-turn id, a stop string, `max_tokens`, or when the caller's callback
//! says so (a client that went away, Ctrl-C). No terminal or HTTP code here.

use std::ops::ControlFlow;

use super::template::RenderOptions;
use super::turn::{Finish, Turn, TurnOptions};
use super::{ChatFormat, Message, Reasoning, ReasoningStream};
use crate::error::{Error, Result};
use crate::model::sampler::SamplerOptions;
use crate::run::Session;

/// What to generate after.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// A conversation, rendered with the model's chat format and a generation prompt.
    Chat(Vec<Message>),
    /// Raw text, tokenized as is (OpenAI's completions).
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
}

/// One request.
#[derive(Clone, Debug)]
pub struct Request {
    /// The prompt.
    pub prompt: Prompt,
    /// Tokens to generate at most; `None` is the rest of the context.
    pub max_tokens: Option<usize>,
    /// Sampling.
    pub sampler: SamplerOptions,
    /// Stop strings: the answer ends before the first one (which is not returned).
    pub stop: Vec<String>,
    /// Go on past the end-of-turn ids.
    pub ignore_eos: bool,
    /// Qwen3's `enable_thinking` for the template.
    pub enable_thinking: Option<bool>,
    /// Function tools for the chat format ([`RenderOptions::tools`]).
    pub tools: Vec<minijinja::Value>,
    /// OpenAI's `tool_choice: "none"`: the model is not to call a tool, so a call it writes anyway
    /// stays text (as vLLM leaves it); `tools` are still rendered into the prompt. With `false`
    /// (`"auto"`, the default) and `tools`, calls come out as [`Outcome::tool_calls`].
    pub calls_as_text: bool,
    /// **A mock, for tests only** ([`TurnOptions::mock_sampled`]): ids generated instead of
    /// sampled. `None` in every real request.
    pub mock_sampled: Option<Vec<u32>>,
}

impl Request {
    /// A greedy chat request with defaults.
    pub fn chat(messages: Vec<Message>) -> Request {
        Request {
            prompt: Prompt::Chat(messages),
            max_tokens: None,
            sampler: SamplerOptions::default(),
            stop: Vec::new(),
            ignore_eos: false,
            enable_thinking: None,
            tools: Vec::new(),
            calls_as_text: false,
            mock_sampled: None,
        }
    }
}

/// New text of a running answer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Delta {
    /// New reasoning text.
    pub reasoning: String,
    /// New answer text.
    pub content: String,
    /// Function calls completed since the last delta (a request with `tools` only).
    pub tool_calls: Vec<ToolCall>,
}

/// A function call of the answer, as OpenAI's `tool_calls` entries carry it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// Its position among the answer's calls (0, 1, ...): `tool_calls[].index` when streamed.
    pub index: usize,
    /// `call_N`, unique among the calls this engine has returned (a later request's `tool`
    /// message answers it by this id).
    pub id: String,
    /// The function and the arguments (JSON text) as the model wrote them.
    pub call: super::tools::Call,
}

/// Why a request ended, in OpenAI's words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-turn id or a stop string.
    Stop,
    /// `max_tokens` (or the end of the context).
    Length,
    /// The callback stopped it.
    Cancelled,
    /// The answer ended with function calls (at an end-of-turn id).
    ToolCalls,
}

impl FinishReason {
    /// `stop`, `length`, `cancelled`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// The result of a request.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The prompt's ids.
    pub prompt_ids: Vec<u32>,
    /// The answer text (reasoning apart, stop string cut).
    pub content: String,
    /// The reasoning text.
    pub reasoning: String,
    /// The function calls (a request with `tools` only; the answer text is what is left around them).
    pub tool_calls: Vec<ToolCall>,
    /// Why it ended.
    pub finish: FinishReason,
    /// The generation (tokens, cached prefix, figures).
    pub turn: Turn,
}

/// A session and its chat format: runs [`Request`]s one after another, reusing the KV cache.
pub struct Engine {
    /// The model session.
    pub session: Session,
    /// The chat format, when the model has one.
    pub format: Option<ChatFormat>,
    /// A name for the model (the directory's name): what `/v1/models` lists.
    pub name: String,
    /// Function calls returned so far: the next call's id is `call_{calls_made}`.
    pub calls_made: u64,
}

/// A request that cannot run as asked: the HTTP front end answers 400 with the message.
pub fn is_bad_request(e: &Error) -> bool {
    matches!(
        e,
        Error::Invalid(_)
            | Error::NoChatTemplate { .. }
            | Error::EmptyStop { .. }
            | Error::ZeroMaxTokens
            | Error::NoMessages
            | Error::UnknownRole { .. }
            | Error::ToolMessage { .. }
            | Error::ToolCallArguments { .. }
            | Error::BadTool { .. }
            | Error::BeyondContext { .. }
            | Error::EmptyPrompt
            | Error::OutOfVocabulary { .. }
            | Error::ContextOverflow { .. }
            | Error::Template { .. }
            | Error::BadOption { .. }
    )
}

impl Engine {
    /// An engine over `session`, with the chat format of the model's directory.
    ///
    /// # Errors
    /// As [`ChatFormat::for_model`] (a template that does not compile).
    pub fn new(session: Session) -> Result<Engine> {
        let dir = session.model.dir().to_path_buf();
        let format = ChatFormat::for_model(&session.model)?;
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
        Ok(Engine { session, format, name, calls_made: 0 })
    }

    /// The context (KV cache positions).
    pub fn context(&self) -> usize {
        self.session.model.max_seq()
    }

    /// The prompt's ids: the rendered conversation, the tokenized text, or the ids.
    ///
    /// # Errors
    /// [`Error::NoChatTemplate`] without a chat format; the tokenizer's and the rendering errors.
    pub fn prompt_ids(
        &self,
        prompt: &Prompt,
        enable_thinking: Option<bool>,
        tools: &[minijinja::Value],
    ) -> Result<Vec<u32>> {
        match prompt {
            Prompt::Ids(ids) => Ok(ids.clone()),
            Prompt::Text(t) => self.session.encode(t),
            Prompt::Chat(messages) => {
                let Some(f) = &self.format else {
                    return Err(Error::NoChatTemplate { dir: self.session.model.dir().into() });
                };
                let text = f.render(messages, RenderOptions { add_generation_prompt: true, enable_thinking, tools })?;
                self.session.encode(&text)
            }
        }
    }

    /// Runs `req`. `on_delta` sees the new reasoning/answer text as soon as it is final (no stop
    /// string can begin in it); [`ControlFlow::Break`] stops the generation (finish `cancelled`).
    /// `stop` is asked before every prefill chunk and every token: true ends the request there
    /// (finish `cancelled`; during the prefill, with no answer), so a client that went away or a
    /// Ctrl-C is noticed while a long prompt is still being prefilled.
    ///
    /// # Errors
    /// Bad requests ([`is_bad_request`]: rendering, an empty prompt, a prompt plus `max_tokens`
    /// longer than the context, `max_tokens` 0) before anything runs; generation errors.
    pub fn run(
        &mut self,
        req: &Request,
        on_delta: &mut dyn FnMut(&Delta) -> ControlFlow<()>,
        stop: &dyn Fn() -> bool,
    ) -> Result<Outcome> {
        if let Some(m) = req.stop.iter().find(|s| s.is_empty()) {
            return Err(Error::EmptyStop { got: m.clone() });
        }
        req.sampler.check().map_err(Error::Invalid)?;
        let prompt_ids = self.prompt_ids(&req.prompt, req.enable_thinking, &req.tools)?;
        if prompt_ids.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let ctx = self.context();
        let max_new = match req.max_tokens {
            Some(0) => return Err(Error::ZeroMaxTokens),
            Some(n) => n,
            None if prompt_ids.len() >= ctx => {
                return Err(Error::ContextOverflow { needed: prompt_ids.len() + 1, context: ctx, config: None })
            }
            None => ctx - prompt_ids.len(),
        };
        let chat = matches!(req.prompt, Prompt::Chat(_));
        let kind = match (&self.format, chat) {
            (Some(f), true) => Some(f.reasoning()),
            _ => None,
        };
        let opts = TurnOptions {
            max_new,
            sampler: req.sampler,
            stop_at_eos: !req.ignore_eos,
            mock_sampled: req.mock_sampled.clone(),
        };
        let mut text = TextStream::new(kind, req.stop.clone());
        // Calls are parsed in a chat answer only: a text completion has no `tool_calls` to carry them.
        if chat && !req.tools.is_empty() && !req.calls_as_text {
            text = text.with_tools(self.calls_made);
        }
        let mut tokens = Vec::new();
        let mut stopped_by_string = false;
        let session = &mut self.session;
        let tok = session.tokenizer.take();
        let result = session.complete_until(
            &prompt_ids,
            &opts,
            &mut |id| {
                tokens.push(id);
                let Some(t) = &tok else { return ControlFlow::Continue(()) };
                // Harmony needs its channel markers; Qwen3's <think> tags are not special tokens.
                let decoded = if kind == Some(Reasoning::Harmony) { t.decode(&tokens) } else { t.decode_text(&tokens) };
                let Ok(decoded) = decoded else { return ControlFlow::Continue(()) };
                let (delta, hit) = text.push(&decoded, false);
                if !delta.reasoning.is_empty() || !delta.content.is_empty() || !delta.tool_calls.is_empty() {
                    on_delta(&delta)?;
                }
                if hit {
                    stopped_by_string = true;
                    return ControlFlow::Break(());
                }
                ControlFlow::Continue(())
            },
            &mut || stop(),
        );
        session.tokenizer = tok;
        let turn = result?;
        // What was held back (a possible stop-string start, a partial character) is final now.
        if !stopped_by_string {
            if let Some(t) = &session.tokenizer {
                let ids = &turn.tokens;
                let decoded = if kind == Some(Reasoning::Harmony) {
                    // The end-of-turn id ends harmony's last message (`<|call|>` makes it a call):
                    // it is not among the answer's tokens, so it is decoded with them here.
                    let with_end: Vec<u32> = ids.iter().copied().chain(turn.stop_id).collect();
                    t.decode(&with_end)?
                } else {
                    t.decode_text(ids)?
                };
                let (delta, _) = text.push(&decoded, true);
                if !delta.reasoning.is_empty() || !delta.content.is_empty() || !delta.tool_calls.is_empty() {
                    let _ = on_delta(&delta);
                }
            }
        }
        let finish = match turn.finish {
            _ if stopped_by_string => FinishReason::Stop,
            Finish::Stop => FinishReason::Stop,
            Finish::Length => FinishReason::Length,
            Finish::Cancelled => FinishReason::Cancelled,
        };
        let finish = match finish {
            FinishReason::Stop if !text.calls.is_empty() && !stopped_by_string => FinishReason::ToolCalls,
            f => f,
        };
        self.calls_made += text.calls.len() as u64;
        // The content is what was streamed, so a streaming client assembles the same answer.
        Ok(Outcome {
            prompt_ids,
            content: text.content,
            reasoning: text.reasoning,
            tool_calls: text.calls,
            finish,
            turn,
        })
    }
}

/// Turns the growing decoded text into final deltas: splits reasoning from the answer, cuts the
/// answer at the first stop string, and holds back a trailing partial UTF-8 character (decoded as
/// U+FFFD) and any answer suffix that may begin a stop string.
struct TextStream {
    split: Option<ReasoningStream>,
    stop: Vec<String>,
    reasoning: String,
    /// The answer as far as it is known (may run past what was emitted).
    answer: String,
    /// The answer emitted so far.
    content: String,
    /// Take function calls out of the text (a request with `tools`), numbering their ids from
    /// `call_{first_id}`.
    tools: Option<u64>,
    /// The calls emitted so far.
    calls: Vec<ToolCall>,
}

impl TextStream {
    fn new(kind: Option<Reasoning>, stop: Vec<String>) -> Self {
        TextStream {
            split: kind.map(ReasoningStream::new),
            stop,
            reasoning: String::new(),
            answer: String::new(),
            content: String::new(),
            tools: None,
            calls: Vec::new(),
        }
    }

    /// The stream of a request with function tools: calls come out of the text as
    /// [`Delta::tool_calls`] (Hermes `<tool_call>` blocks in the answer, harmony's messages to
    /// `functions.*`; [`super::tools`]), their ids numbered from `call_{first_id}`.
    fn with_tools(mut self, first_id: u64) -> Self {
        if let Some(s) = &self.split {
            self.split = Some(ReasoningStream::with_tools(s.kind()));
        }
        self.tools = Some(first_id);
        self
    }

    /// Given the whole decoded text so far, returns the new final text and whether a stop string
    /// was reached. `last` releases everything held back.
    fn push(&mut self, decoded: &str, last: bool) -> (Delta, bool) {
        let decoded = if last { decoded } else { decoded.trim_end_matches('\u{FFFD}') };
        let mut delta = Delta::default();
        match &mut self.split {
            Some(s) => {
                let (r, a) = if last { s.push_last(decoded) } else { s.push(decoded) };
                self.reasoning.push_str(&r);
                delta.reasoning = r;
                self.answer.push_str(&a);
            }
            None => self.answer = decoded.to_string(),
        }
        // With tools, the calls leave the answer: harmony's were taken out by the split, Hermes
        // blocks are taken out of the answer here.
        let (answer, calls) = match (self.tools, &self.split) {
            (None, _) => (std::borrow::Cow::Borrowed(self.answer.as_str()), Vec::new()),
            (Some(_), Some(s)) if s.kind() == Reasoning::Harmony => (self.answer.as_str().into(), s.calls().to_vec()),
            (Some(_), _) => {
                let (a, c) = super::tools::split_hermes(&self.answer, last);
                (a.into(), c)
            }
        };
        if let Some(first_id) = self.tools {
            for (index, call) in calls.into_iter().enumerate().skip(self.calls.len()) {
                let c = ToolCall { index, id: format!("call_{}", first_id + index as u64), call };
                delta.tool_calls.push(c.clone());
                self.calls.push(c);
            }
        }
        let hit = self.stop.iter().filter_map(|s| answer.find(s.as_str())).min();
        let mut end = match hit {
            Some(i) => i,
            None if last => answer.len(),
            None => answer.len() - held_back(&answer, &self.stop),
        };
        // With tools, trailing whitespace waits for the text that follows it: what is left around
        // the calls is often only the newlines before and between the blocks, which are not
        // content. It is content once more text follows, or if the turn ended without a call.
        if self.tools.is_some() && !((last || hit.is_some()) && self.calls.is_empty()) {
            end = end.min(answer[..end].trim_end().len());
        }
        if end > self.content.len() && answer.is_char_boundary(end) && answer.starts_with(&self.content) {
            delta.content = answer[self.content.len()..end].to_string();
            self.content.push_str(&delta.content);
        }
        (delta, hit.is_some())
    }
}

/// Bytes at the end of `text` that are a proper prefix of one of `stop` (they may become a stop
/// string with the next token), rounded to a character boundary.
fn held_back(text: &str, stop: &[String]) -> usize {
    let mut n = 0;
    for s in stop {
        for k in (1..s.len()).rev() {
            if k > n && s.is_char_boundary(k) && text.ends_with(&s[..k]) {
                n = k;
                break;
            }
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(stream: &mut TextStream, pieces: &[&str]) -> (String, String, bool) {
        let (mut r, mut c, mut text) = (String::new(), String::new(), String::new());
        for p in pieces {
            text.push_str(p);
            let (d, hit) = stream.push(&text, false);
            r.push_str(&d.reasoning);
            c.push_str(&d.content);
            if hit {
                return (r, c, true);
            }
        }
        let (d, _) = stream.push(&text, true);
        r.push_str(&d.reasoning);
        c.push_str(&d.content);
        (r, c, false)
    }

    #[test]
    fn stop_strings_cut_the_answer_and_partial_matches_wait() {
        let mut s = TextStream::new(None, vec!["STOP".into()]);
        let mut text = String::new();
        let mut out = Vec::new();
        for p in ["Hello ", "ST", "OP and more"] {
            text.push_str(p);
            let (d, hit) = s.push(&text, false);
            out.push((d.content, hit));
        }
        assert_eq!(out, [("Hello ".into(), false), (String::new(), false), (String::new(), true)]);
        assert_eq!(s.content, "Hello ");
        // A partial match that does not complete is released.
        let mut s = TextStream::new(None, vec!["STOP".into()]);
        assert_eq!(feed(&mut s, &["a S", "Tx"]), (String::new(), "a STx".into(), false));
        // A partial UTF-8 character waits for the rest.
        let mut s = TextStream::new(None, vec![]);
        let (d, _) = s.push("ok\u{FFFD}", false);
        assert_eq!(d.content, "ok");
        let (d, _) = s.push("ok😀", false);
        assert_eq!(d.content, "😀");
    }

    #[test]
    fn reasoning_goes_apart_and_stop_strings_apply_to_the_answer() {
        let mut s = TextStream::new(Some(Reasoning::Think), vec!["END".into()]);
        let got = feed(&mut s, &["<think>", "\nEND is", " fine here\n", "</think>", "\n\nAnswer", " END tail"]);
        assert_eq!(got, ("END is fine here".into(), "Answer ".into(), true));
    }

    #[test]
    fn harmony_text_outside_every_channel_is_the_answer() {
        // Held while it may be a header, released as answer once it cannot be or the turn ends.
        let mut s = TextStream::new(Some(Reasoning::Harmony), vec![]);
        assert_eq!(feed(&mut s, &["Hi", " there"]), (String::new(), "Hi there".into(), false));
        let mut s = TextStream::new(Some(Reasoning::Harmony), vec![]);
        let pieces =
            ["<|channel|>", "analysis", "<|message|>", "Hm.", "<|end|>", "Loose text", "<|start|>", "assistant"];
        assert_eq!(feed(&mut s, &pieces), ("Hm.".into(), "Loose text".into(), false));
    }

    /// Feeds `pieces` (the last call with `last`); the reasoning, content and calls streamed.
    fn feed_calls(stream: &mut TextStream, pieces: &[&str]) -> (String, String, Vec<ToolCall>) {
        let (mut r, mut c, mut calls, mut text) = (String::new(), String::new(), Vec::new(), String::new());
        for (i, p) in pieces.iter().enumerate() {
            text.push_str(p);
            let (d, _) = stream.push(&text, i + 1 == pieces.len());
            r.push_str(&d.reasoning);
            c.push_str(&d.content);
            calls.extend(d.tool_calls);
        }
        (r, c, calls)
    }

    #[test]
    fn with_tools_calls_leave_the_text_and_stream_once_complete() {
        let call = |index: usize, id: &str, name: &str, arguments: &str| ToolCall {
            index,
            id: id.into(),
            call: super::super::tools::Call { name: name.into(), arguments: arguments.into() },
        };
        // Qwen3: thinking, some answer, two Hermes blocks, fed in small pieces.
        let text = "<think>\nNeed tools.\n</think>\n\nChecking.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
        // The think tags arrive whole (each is one token); the rest three characters at a time.
        let (head, tail) = text.split_at(text.find("</think>").unwrap() + "</think>".len());
        let mut pieces: Vec<String> =
            vec!["<think>".into(), head["<think>".len()..head.len() - 8].into(), "</think>".into()];
        pieces.extend(tail.chars().collect::<Vec<_>>().chunks(3).map(|c| c.iter().collect::<String>()));
        let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
        let mut s = TextStream::new(Some(Reasoning::Think), vec![]).with_tools(7);
        let (r, c, calls) = feed_calls(&mut s, &pieces);
        assert_eq!(r, "Need tools.");
        assert_eq!(c, "Checking.");
        assert_eq!(calls, vec![call(0, "call_7", "a", "{\"x\": 1}"), call(1, "call_8", "b", "{}")]);
        // Without tools the same text is answer text.
        let mut s = TextStream::new(Some(Reasoning::Think), vec![]);
        let (_, c, calls) = feed_calls(&mut s, &pieces);
        assert!(c.contains("<tool_call>") && calls.is_empty());
        // GPT-OSS: the call to functions.get is a call, not reasoning.
        let pieces = [
            "<|channel|>",
            "analysis",
            "<|message|>",
            "Look it up.",
            "<|end|>",
            "<|start|>",
            "assistant",
            "<|channel|>",
            "commentary to=functions.get ",
            "<|constrain|>",
            "json",
            "<|message|>",
            "{\"q\":",
            " 2}",
            "<|call|>",
        ];
        let mut s = TextStream::new(Some(Reasoning::Harmony), vec![]).with_tools(0);
        assert_eq!(
            feed_calls(&mut s, &pieces),
            ("Look it up.".into(), String::new(), vec![call(0, "call_0", "get", "{\"q\": 2}")])
        );
    }

    /// Hermes calls through the stream: the content and calls of each case, the same fed one
    /// character at a time as fed at once (what a streaming client assembles is what a
    /// non-streaming one gets).
    #[test]
    fn with_tools_streamed_and_whole_agree_case_by_case() {
        use super::super::tools::Call;
        let block = |name: &str, args: &str| {
            format!("<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {args}}}\n</tool_call>")
        };
        let (a, b) = (block("a", "{\"x\": 1}"), block("b", "{}"));
        let ca = Call { name: "a".into(), arguments: "{\"x\": 1}".into() };
        let cb = Call { name: "b".into(), arguments: "{}".into() };
        let malformed = "<tool_call>\n{\"name\": \"a\", \"arguments\": {x}}\n</tool_call>";
        let unclosed = "Sure. <tool_call>\n{\"name\": \"a\", \"argu";
        let cases: Vec<(String, Vec<&str>, String, Vec<Call>)> = vec![
            // (text, stop strings, content, calls)
            (a.clone(), vec![], "".into(), vec![ca.clone()]),
            (format!("{a}\n{b}"), vec![], "".into(), vec![ca.clone(), cb.clone()]),
            (format!("\n{a}\n{b}\n"), vec![], "".into(), vec![ca.clone(), cb.clone()]),
            (format!("Let me check.\n\n{a}"), vec![], "Let me check.".into(), vec![ca.clone()]),
            (format!("Before.\n{a}\nAfter."), vec![], "Before.\n\nAfter.".into(), vec![ca.clone()]),
            // Malformed JSON: the raw block is content, no call (vLLM's hermes parser does so).
            (format!("x {malformed}"), vec![], format!("x {malformed}"), vec![]),
            // Unclosed at the end (max_tokens): its text is content.
            (unclosed.to_string(), vec![], unclosed.into(), vec![]),
            // No call: trailing whitespace is content at the end, as without tools.
            ("Hi.\n\n".to_string(), vec![], "Hi.\n\n".into(), vec![]),
            ("Hi \nEND more".to_string(), vec!["END"], "Hi \n".into(), vec![]),
            // A stop string inside a call does not cut it (the call is not answer text).
            (a.clone(), vec!["x"], "".into(), vec![ca.clone()]),
        ];
        for (text, stop, content, calls) in cases {
            let stop: Vec<String> = stop.into_iter().map(String::from).collect();
            let chars: Vec<String> = text.chars().map(String::from).collect();
            let by_char: Vec<&str> = chars.iter().map(String::as_str).collect();
            for pieces in [vec![text.as_str()], by_char] {
                let mut s = TextStream::new(None, stop.clone()).with_tools(0);
                let (_, c, got) = feed_calls(&mut s, &pieces);
                assert_eq!(c, content, "{text:?} in {} pieces", pieces.len());
                assert_eq!(c, s.content, "{text:?}");
                let got: Vec<Call> = got.into_iter().map(|t| t.call).collect();
                assert_eq!(got, calls, "{text:?} in {} pieces", pieces.len());
            }
        }
    }

    #[test]
    fn held_back_is_the_longest_stop_prefix() {
        let stop = vec!["</s>".to_string(), "xyz".to_string()];
        assert_eq!(held_back("abc</", &stop), 2);
        assert_eq!(held_back("abcxy", &stop), 2);
        assert_eq!(held_back("abc", &stop), 0);
    }
}
