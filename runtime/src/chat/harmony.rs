//! GPT-OSS's harmony chat format (OpenAI's "harmony response format", as the `openai-harmony`
//! renderer writes it). An OpenAI-shaped conversation is mapped to harmony messages — as vLLM and
//! the gpt-oss chat template do — and rendered as `<|start|>{author}[ to={recipient}]
//! [<|channel|>{channel}][ {content type}]<|message|>{text}<|end|>` (`<|call|>` ending an assistant
//! message to a tool):
//! - a system message naming the model, the reasoning effort and the valid channels (and, with
//!   function tools, that calls to them go to the commentary channel);
//! - a `system`/`developer` message as a developer message with its text under `# Instructions`;
//!   the request's function tools as that message's `# Tools` section (of the first message when it
//!   is system/developer, else of a developer message of their own before it), each tool's JSON-schema
//!   parameters written as a TypeScript type ([`tools_section`]);
//! - `user` as a user message;
//! - `assistant` as its reasoning on the `analysis` channel, its text on `final` (or, beside tool
//!   calls, as a `commentary` preamble), and each tool call as a `commentary` message to
//!   `functions.NAME` of content type `<|constrain|>json` holding the arguments;
//! - `tool` as a message from `functions.NAME` (its `name`, or the name of the call its
//!   `tool_call_id` answers) to the assistant on the `commentary` channel;
//! - harmony's analysis rule: when the last assistant message is a `final` one, the analysis
//!   messages before the first `final` message are dropped;
//! - `<|start|>assistant` to open the reply.
//!
//! Tested against openai-harmony's own rendering (tests/fixtures/chat/render_harmony.py). The
//! model ends its turn with `<|return|>` (answer done) or `<|call|>` (tool call); `<|end|>` only
//! ends one message (the analysis) and the turn goes on.

use minijinja::value::{Value, ValueKind};

use super::template::{check_messages, Message};
use super::tools::Call;
use crate::error::{Error, Result};

/// The tokens that end the assistant's turn.
pub const STOP_TOKENS: &[&str] = &["<|return|>", "<|call|>"];

/// The system message's text, before the `Reasoning:` line (no `Current date:` line, so a rendering
/// does not depend on the day).
const SYSTEM: &str = "You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06";

/// Harmony rendering settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Harmony {
    /// `low`, `medium` (the default) or `high`.
    pub reasoning_effort: String,
}

impl Default for Harmony {
    fn default() -> Self {
        Harmony { reasoning_effort: "medium".into() }
    }
}

/// One harmony message.
struct HMsg {
    /// `system`, `developer`, `user`, `assistant`, or a tool's name (`functions.get_weather`).
    author: String,
    /// An assistant message is from the assistant (ends with `<|call|>` when it has a recipient).
    assistant: bool,
    recipient: Option<String>,
    channel: Option<&'static str>,
    content_type: Option<&'static str>,
    text: String,
}

impl HMsg {
    fn new(author: &str, text: String) -> HMsg {
        HMsg {
            author: author.into(),
            assistant: author == "assistant",
            recipient: None,
            channel: None,
            content_type: None,
            text,
        }
    }
    fn on(mut self, channel: &'static str) -> HMsg {
        self.channel = Some(channel);
        self
    }
}

impl Harmony {
    /// Renders `messages` with the function `tools` (OpenAI's `{"type": "function", "function":
    /// {"name", "description", "parameters"}}`; empty for none); `add_generation_prompt` appends
    /// `<|start|>assistant`.
    ///
    /// # Errors
    /// [`Error::NoMessages`] for an empty list, [`Error::UnknownRole`] for an unknown role,
    /// [`Error::BadTool`] for a tool that is not a function tool or whose parameters use `oneOf` (not
    /// rendered here), [`Error::ToolMessage`] for a `tool` message whose function is unknown (no
    /// `name`, and no earlier tool call with its `tool_call_id`).
    pub fn render(&self, messages: &[Message], tools: &[Value], add_generation_prompt: bool) -> Result<String> {
        check_messages(messages)?;
        let functions = tools_section(tools)?;
        let mut channels =
            "# Valid channels: analysis, commentary, final. Channel must be included for every message.".to_string();
        if functions.is_some() {
            channels.push_str("\nCalls to these tools must go to the commentary channel: 'functions'.");
        }
        let system = format!("{SYSTEM}\n\nReasoning: {}\n\n{channels}", self.reasoning_effort);
        let mut conv = vec![HMsg::new("system", system)];
        let first_is_developer = matches!(messages[0].role.as_str(), "system" | "developer");
        if let (Some(f), false) = (&functions, first_is_developer) {
            conv.push(HMsg::new("developer", f.clone()));
        }
        // Tool call ids seen so far → function names, for the `tool` messages answering them.
        let mut calls: Vec<(String, String)> = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            match m.role.as_str() {
                "system" | "developer" => {
                    let mut text = format!("# Instructions\n\n{}", m.content);
                    if let (Some(f), 0) = (&functions, i) {
                        text = format!("{text}\n\n{f}");
                    }
                    conv.push(HMsg::new("developer", text));
                }
                "user" => conv.push(HMsg::new("user", m.content.clone())),
                "tool" => {
                    let name = match (&m.name, &m.tool_call_id) {
                        (Some(n), _) => n.clone(),
                        (None, Some(id)) => calls
                            .iter()
                            .find(|(c, _)| c == id)
                            .map(|(_, n)| n.clone())
                            .ok_or_else(|| Error::ToolMessage { index: i, call_id: Some(id.clone()) })?,
                        (None, None) => return Err(Error::ToolMessage { index: i, call_id: None }),
                    };
                    let mut h = HMsg::new(&format!("functions.{name}"), m.content.clone()).on("commentary");
                    h.recipient = Some("assistant".into());
                    conv.push(h);
                }
                _ => {
                    let tool_calls = m.tool_calls.as_deref().unwrap_or(&[]);
                    let reasoning = m.reasoning_content.as_deref().unwrap_or("");
                    if !reasoning.is_empty() {
                        conv.push(HMsg::new("assistant", reasoning.into()).on("analysis"));
                    }
                    if !tool_calls.is_empty() {
                        if !m.content.is_empty() {
                            conv.push(HMsg::new("assistant", m.content.clone()).on("commentary"));
                        }
                    } else if !m.content.is_empty() || reasoning.is_empty() {
                        conv.push(HMsg::new("assistant", m.content.clone()).on("final"));
                    }
                    for c in tool_calls {
                        if let Some(id) = &c.id {
                            calls.push((id.clone(), c.function.name.clone()));
                        }
                        let args = match c.function.arguments.as_str() {
                            Some(s) => s.to_string(),
                            None => serde_json::to_string(&c.function.arguments)
                                .map_err(|cause| Error::ToolCallArguments { index: i, cause })?,
                        };
                        let mut h = HMsg::new("assistant", args).on("commentary");
                        h.recipient = Some(format!("functions.{}", c.function.name));
                        h.content_type = Some("<|constrain|>json");
                        conv.push(h);
                    }
                }
            }
        }
        // Harmony drops the analysis before the first final answer once the conversation ends
        // with a final answer (openai-harmony's `auto_drop_analysis`).
        let last_is_final = conv.iter().rev().find(|m| m.assistant).is_some_and(|m| m.channel == Some("final"));
        let first_final = conv.iter().position(|m| m.channel == Some("final"));
        let mut out = String::new();
        for (idx, m) in conv.iter().enumerate() {
            if last_is_final && first_final.is_some_and(|f| idx < f) && m.channel == Some("analysis") {
                continue;
            }
            out.push_str("<|start|>");
            out.push_str(&m.author);
            if let Some(r) = &m.recipient {
                out.push_str(" to=");
                out.push_str(r);
            }
            if let Some(c) = m.channel {
                out.push_str("<|channel|>");
                out.push_str(c);
            }
            if let Some(t) = m.content_type {
                out.push(' ');
                out.push_str(t);
            }
            out.push_str("<|message|>");
            out.push_str(&m.text);
            out.push_str(if m.assistant && m.recipient.is_some() { "<|call|>" } else { "<|end|>" });
        }
        if add_generation_prompt {
            out.push_str("<|start|>assistant");
        }
        Ok(out)
    }
}

/// The developer message's `# Tools` section for OpenAI function `tools` (`None` when there are
/// none): the `functions` namespace with one TypeScript-like type per tool, its description lines as
/// `//` comments and its JSON-schema parameters as the argument's type ([`schema_type`]).
///
/// # Errors
/// [`Error::BadTool`] for a tool that is not `{"type": "function", "function": {"name", ...}}`, or
/// parameters that cannot be rendered.
pub fn tools_section(tools: &[Value]) -> Result<Option<String>> {
    if tools.is_empty() {
        return Ok(None);
    }
    let mut parts = vec!["## functions\n".to_string(), "namespace functions {\n".to_string()];
    for (i, t) in tools.iter().enumerate() {
        let bad = |why: &str| Error::BadTool { index: i, why: why.into() };
        if get(t, "type").as_ref().and_then(Value::as_str).is_some_and(|k| k != "function") {
            return Err(bad("only function tools ({\"type\": \"function\", ...}) are supported"));
        }
        let f = get(t, "function").ok_or_else(|| bad("no `function`"))?;
        let name = get(&f, "name")
            .as_ref()
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| bad("no `function.name`"))?;
        if let Some(d) = get(&f, "description") {
            for line in d.as_str().unwrap_or("").lines() {
                parts.push(format!("// {line}"));
            }
        }
        match get(&f, "parameters") {
            Some(p) => {
                let ty = schema_type(&p, "").map_err(|why| bad(&format!("function `{name}`: {why}")))?;
                parts.push(format!("type {name} = (_: {ty}) => any;\n"));
            }
            None => parts.push(format!("type {name} = () => any;\n")),
        }
    }
    parts.push("} // namespace functions".into());
    Ok(Some(format!("# Tools\n\n{}", parts.join("\n"))))
}

/// `v[key]` when `v` is a map that has it (and it is not null).
fn get(v: &Value, key: &str) -> Option<Value> {
    if v.kind() != ValueKind::Map {
        return None;
    }
    v.get_item(&Value::from(key)).ok().filter(|x| !x.is_undefined() && !x.is_none())
}

fn get_str(v: &Value, key: &str) -> Option<String> {
    get(v, key).and_then(|x| x.as_str().map(str::to_owned))
}

/// A JSON-schema value as harmony writes it in a comment: a string of a non-enum schema quoted,
/// of an enum bare, anything else as compact JSON.
fn default_comment(schema: &Value, d: &Value) -> String {
    match d.as_str() {
        Some(s) if get(schema, "enum").is_some_and(|e| e.len().unwrap_or(0) > 0) => format!("default: {s}"),
        Some(s) => format!("default: \"{s}\""),
        None => format!("default: {}", serde_json::to_string(d).unwrap_or_else(|_| "null".into())),
    }
}

/// The TypeScript-like type of a JSON schema, as openai-harmony renders tool parameters: an object
/// as `{` one `name[?]: type,` line per property (`?` when not required; its title, description
/// and examples as `//` comments above, its default after; nested objects indented by four
/// spaces) `}`, with its own description as a comment before the brace; a string enum as the union of
/// its quoted values; `integer` and `number` as `number`; an array as `T[]` (`Array<any>` without
/// `items`); a list of types as their union; `nullable` adds `| null`; anything else `any`.
///
/// # Errors
/// A `oneOf` (harmony's rendering of alternatives is not reproduced here).
pub fn schema_type(schema: &Value, indent: &str) -> std::result::Result<String, String> {
    if get(schema, "oneOf").is_some() {
        return Err("`oneOf` in a parameter schema is not supported by picchio's harmony rendering".into());
    }
    let Some(ty) = get(schema, "type") else { return Ok("any".into()) };
    if ty.kind() == ValueKind::Seq {
        let names: Vec<String> = ty
            .try_iter()
            .map_err(|e| e.to_string())?
            .filter_map(|t| t.as_str().map(|s| if s == "integer" { "number".to_string() } else { s.to_string() }))
            .collect();
        if !names.is_empty() {
            return Ok(names.join(" | "));
        }
        return Ok("any".into());
    }
    Ok(match ty.as_str().unwrap_or("") {
        "object" => {
            let mut out = String::new();
            if let Some(d) = get_str(schema, "description") {
                out.push_str(&format!("{indent}// {d}\n"));
            }
            out.push_str("{\n");
            let required: Vec<String> = get(schema, "required")
                .and_then(|r| r.try_iter().ok().map(|it| it.filter_map(|x| x.as_str().map(str::to_owned)).collect()))
                .unwrap_or_default();
            if let Some(props) = get(schema, "properties").filter(|p| p.kind() == ValueKind::Map) {
                for key in props.try_iter().map_err(|e| e.to_string())? {
                    let name = key.as_str().map_or_else(|| key.to_string(), str::to_owned);
                    let p = props.get_item(&key).map_err(|e| e.to_string())?;
                    if let Some(t) = get_str(&p, "title") {
                        out.push_str(&format!("{indent}// {t}\n{indent}//\n"));
                    }
                    if let Some(d) = get_str(&p, "description") {
                        out.push_str(&format!("{indent}// {d}\n"));
                    }
                    if let Some(ex) = get(&p, "examples").filter(|e| e.len().unwrap_or(0) > 0) {
                        out.push_str(&format!("{indent}// Examples:\n"));
                        for x in ex.try_iter().map_err(|e| e.to_string())? {
                            if let Some(s) = x.as_str() {
                                out.push_str(&format!("{indent}// - \"{s}\"\n"));
                            }
                        }
                    }
                    let optional = if required.contains(&name) { "" } else { "?" };
                    let mut t = schema_type(&p, &format!("{indent}    "))?;
                    if get(&p, "nullable").is_some_and(|n| n.is_true()) && !t.contains("null") {
                        t.push_str(" | null");
                    }
                    out.push_str(&format!("{indent}{name}{optional}: {t},"));
                    if let Some(d) = get(&p, "default") {
                        out.push_str(&format!(" // {}", default_comment(&p, &d)));
                    }
                    out.push('\n');
                }
            }
            out.push_str(&format!("{indent}}}"));
            out
        }
        "string" => {
            let values: Vec<String> = get(schema, "enum")
                .and_then(|e| {
                    e.try_iter().ok().map(|it| it.filter_map(|x| x.as_str().map(|s| format!("\"{s}\""))).collect())
                })
                .unwrap_or_default();
            if values.is_empty() {
                "string".into()
            } else {
                values.join(" | ")
            }
        }
        "number" | "integer" => "number".into(),
        "boolean" => "boolean".into(),
        "array" => match get(schema, "items") {
            Some(items) => format!("{}[]", schema_type(&items, indent)?),
            None => "Array<any>".into(),
        },
        _ => "any".into(),
    })
}

/// The markers that end a message: `<|end|>`, and the ends of the turn ([`STOP_TOKENS`]).
const MESSAGE_ENDS: [&str; 3] = ["<|end|>", "<|return|>", "<|call|>"];

/// Whether `header` (text between `<|start|>` and `<|message|>`) has a harmony header's shape: one
/// line of at most four words once the `<|channel|>`/`<|constrain|>` markers count as spaces (an
/// author, ` to=RECIPIENT`, the channel, a content type).
fn header_shaped(header: &str) -> bool {
    let words = header.replace("<|channel|>", " ").replace("<|constrain|>", " ");
    !header.contains('\n') && words.split_whitespace().count() <= 4
}

/// Whether `header` is a harmony header: header-shaped, and naming a channel, a recipient, or only
/// the assistant (what follows a `<|start|>` the model wrote itself).
fn is_header(header: &str) -> bool {
    header_shaped(header)
        && (header.contains("<|channel|>")
            || header.split_whitespace().any(|w| w.starts_with("to="))
            || matches!(header.trim(), "" | "assistant"))
}

/// Appends text written outside any message to `answer`, without the end markers in it.
fn push_stray(answer: &mut String, text: &str) {
    let mut t = text.to_string();
    for m in MESSAGE_ENDS {
        t = t.replace(m, "");
    }
    answer.push_str(&t);
}

/// Splits the text of an assistant turn the model generated after `<|start|>assistant` (decoded with
/// its special tokens) into (reasoning, answer), by harmony's channels (OpenAI's "harmony response
/// format": analysis is the chain of thought, not shown to users; final is the answer; commentary
/// carries tool calls, and preambles addressed to the user):
/// - `analysis` messages and `commentary` messages to a recipient (tool calls) are reasoning;
/// - `final` messages, `commentary` messages to no one (preambles) and messages of another or no
///   channel are the answer;
/// - headers and the `<|start|>`, `<|message|>`, `<|end|>`, `<|return|>`, `<|call|>` markers are
///   dropped.
///
/// Text the model writes outside any message — with no header closed by `<|message|>`, or after a
/// message's end and before the next `<|start|>` — has no channel (openai-harmony's parser rejects
/// it). It is never dropped: it is answer text, in order. While the turn runs (`done` false), a
/// last header not yet closed by `<|message|>` yields nothing as long as it may still become one
/// (it has a header's shape); once `done`, such a cut-off header (a channel or recipient, nothing
/// else) is dropped, and any other unclosed text is answer.
///
/// The parts only grow as `text` grows (a streaming caller can emit differences).
pub fn split_output(text: &str, done: bool) -> (String, String) {
    split(text, done, None)
}

/// As [`split_output`] for a request with function tools: a message to `functions.NAME` ended by
/// `<|call|>` is a [`Call`] (its body the arguments) instead of reasoning text; one not yet ended
/// is held back while the turn runs, and is reasoning text (as without tools) if the turn ended
/// without its `<|call|>`. A message to another recipient stays reasoning.
pub fn split_output_calls(text: &str, done: bool) -> (String, String, Vec<Call>) {
    let mut calls = Vec::new();
    let (reasoning, answer) = split(text, done, Some(&mut calls));
    (reasoning, answer, calls)
}

fn split(text: &str, done: bool, mut calls: Option<&mut Vec<Call>>) -> (String, String) {
    let (mut reasoning, mut answer) = (String::new(), String::new());
    let segments: Vec<&str> = text.split("<|start|>").collect();
    for (i, seg) in segments.iter().enumerate() {
        let last = i + 1 == segments.len();
        let Some((header, rest)) = seg.split_once("<|message|>") else {
            let pending = last && header_shaped(seg) && (!done || is_header(seg));
            if !pending {
                push_stray(&mut answer, seg);
            }
            continue;
        };
        if !is_header(header) {
            answer.push_str(header);
        }
        let end = MESSAGE_ENDS.iter().filter_map(|m| rest.find(m).map(|at| (at, m.len()))).min();
        let (body, after) = match end {
            Some((at, len)) => (&rest[..at], &rest[at + len..]),
            None => (rest, ""),
        };
        let channel = header
            .split_once("<|channel|>")
            .map(|(_, c)| c.split(|ch: char| ch.is_whitespace() || ch == '<').next().unwrap_or(""));
        let to_someone = header.split_whitespace().any(|w| w.starts_with("to="));
        let function = header
            .split(|ch: char| ch.is_whitespace() || ch == '<')
            .find_map(|w| w.strip_prefix("to=functions."))
            .filter(|f| !f.is_empty());
        if let (Some(calls), Some(name)) = (calls.as_deref_mut(), function) {
            match end {
                Some((at, _)) if rest[at..].starts_with("<|call|>") => {
                    calls.push(Call { name: name.to_string(), arguments: body.trim().to_string() });
                    push_stray(&mut answer, after);
                    continue;
                }
                // Not ended yet: it may still become a call.
                None if !done => continue,
                _ => {}
            }
        }
        let dst = match channel {
            Some("analysis") => &mut reasoning,
            Some("commentary") if to_someone => &mut reasoning,
            _ => &mut answer,
        };
        dst.push_str(body);
        push_stray(&mut answer, after);
    }
    (reasoning, answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn both(r: &str, a: &str) -> (String, String) {
        (r.into(), a.into())
    }

    #[test]
    fn splits_analysis_from_the_final_answer() {
        let t = "<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello!";
        assert_eq!(split_output(t, false), both("User says hi.", "Hello!"));
        assert_eq!(split_output(t, true), both("User says hi.", "Hello!"));
        assert_eq!(split_output("<|channel|>analysis<|mess", false), both("", ""));
        assert_eq!(split_output("<|channel|>final<|message|>Hi<|return|>", true), both("", "Hi"));
        // A tool call is reasoning; a preamble (commentary to no one) is for the user.
        let t =
            "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.f<|channel|>commentary \
                 <|constrain|>json<|message|>{}<|call|>";
        assert_eq!(split_output(t, true), both("{}", "Checking."));
    }

    #[test]
    fn with_tools_a_call_to_a_function_is_a_call_not_reasoning() {
        let t = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary \
                 to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>";
        let call = Call { name: "get_weather".into(), arguments: "{\"city\": \"Paris\"}".into() };
        assert_eq!(split_output_calls(t, true), ("Need weather.".into(), String::new(), vec![call.clone()]));
        // The recipient may come before the channel, too.
        let t2 = "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>";
        assert_eq!(split_output_calls(t2, true).2, vec![call.clone()]);
        // Not ended: held back while the turn runs; reasoning (as without tools) if it ended so.
        let cut = &t[..t.len() - "<|call|>".len()];
        assert_eq!(split_output_calls(cut, false), ("Need weather.".into(), String::new(), vec![]));
        assert_eq!(split_output_calls(cut, true).0, "Need weather.{\"city\": \"Paris\"}");
        // Without tools, as before: the call is reasoning.
        assert_eq!(split_output(t, true), ("Need weather.{\"city\": \"Paris\"}".into(), String::new()));
        // Fed a character at a time (special tokens whole, as decoded tokens arrive), the parts
        // only grow and end as the whole text's do.
        let (mut r, mut a, mut c) = (String::new(), String::new(), Vec::new());
        let mut ends = Vec::new();
        let mut i = 0;
        while i < t.len() {
            i += match t[i..].strip_prefix("<|") {
                Some(rest) => rest.find("|>").map_or(t.len() - i, |e| e + 4),
                None => t[i..].chars().next().unwrap().len_utf8(),
            };
            ends.push(i);
        }
        for i in ends {
            let (r2, a2, c2) = split_output_calls(&t[..i], false);
            assert!(r2.starts_with(&r) && a2.starts_with(&a) && c2.starts_with(&c), "{i}");
            (r, a, c) = (r2, a2, c2);
        }
        assert_eq!(split_output_calls(t, true).2, vec![call]);
    }

    #[test]
    fn text_outside_every_channel_reaches_the_answer() {
        // No header at all (the model skipped `<|channel|>`): the answer, once it cannot be a header.
        let t = "Hello there, this has no channel.<|return|>";
        assert_eq!(split_output(t, false), both("", "Hello there, this has no channel."));
        assert_eq!(split_output("Hello", false), both("", ""), "may still be a header while running");
        assert_eq!(split_output("Hello", true), both("", "Hello"), "not a header at the end");
        // Between a message's end and the next <|start|>.
        let t = "<|channel|>analysis<|message|>Think.<|end|>Stray words<|start|>assistant<|channel|>final<|message|>Hi";
        assert_eq!(split_output(t, true), both("Think.", "Stray wordsHi"));
        // A "header" that is a sentence: its text is the answer, the body by its (missing) channel too.
        let t = "I will now answer the question directly<|message|>42";
        assert_eq!(split_output(t, true), both("", "I will now answer the question directly42"));
        // An unknown channel is the answer.
        assert_eq!(split_output("<|channel|>notes<|message|>x<|end|>", true), both("", "x"));
        // A header cut off by the end of the turn (max_tokens) is formatting, not text.
        assert_eq!(
            split_output("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>fin", true),
            both("a", "")
        );
        // The parts only grow, token by token (a marker is one token), so a stream of differences
        // loses nothing.
        let tokens = [
            "Plain",
            " start",
            "<|end|>",
            "<|start|>",
            "assistant",
            "<|channel|>",
            "analysis",
            "<|message|>",
            "h",
            "m",
            "<|end|>",
            "ta",
            "il",
        ];
        let (mut full, mut r, mut a) = (String::new(), String::new(), String::new());
        for t in tokens {
            full.push_str(t);
            let (r2, a2) = split_output(&full, false);
            assert!(r2.starts_with(&r) && a2.starts_with(&a), "after {t:?}: {r2:?} {a2:?} after {r:?} {a:?}");
            (r, a) = (r2, a2);
        }
        assert_eq!(split_output(&full, true), both("hm", "Plain starttail"));
    }

    #[test]
    fn a_tool_message_must_name_its_function() {
        let e = Harmony::default().render(&[Message::new("tool", "{}")], &[], true).unwrap_err();
        assert!(e.to_string().contains("names no function"), "{e}");
        let mut m = Message::new("tool", "{}");
        m.tool_call_id = Some("call_9".into());
        let e = Harmony::default().render(&[m], &[], true).unwrap_err();
        assert!(e.to_string().contains("`call_9`"), "{e}");
    }

    #[test]
    fn unsupported_tools_are_refused_by_name() {
        let t: Value =
            serde_json::from_str(r#"{"type": "function", "function": {"name": "f", "parameters": {"oneOf": []}}}"#)
                .unwrap();
        let e = tools_section(&[t]).unwrap_err().to_string();
        assert!(e.contains("tools[0]") && e.contains("`f`") && e.contains("oneOf"), "{e}");
        let t: Value = serde_json::from_str(r#"{"type": "web_search"}"#).unwrap();
        assert!(tools_section(&[t]).unwrap_err().to_string().contains("only function tools"));
    }
}
