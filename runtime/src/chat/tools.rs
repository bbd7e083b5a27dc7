//! Function calls in the model's output, taken out of the text so a front end can return them as
//! OpenAI's `tool_calls` instead of as answer or reasoning text.
//!
//! - Qwen3 (and every Hermes-style template): `<tool_call>\n{"name": NAME, "arguments": {...}}\n
//!   </tool_call>` blocks in the answer, as Qwen3's chat template writes an assistant's calls (and
//!   vLLM's `hermes` tool parser reads them). A block whose body is not that JSON object stays answer
//!   text, as vLLM leaves it; so does a block not closed when the turn ends.
//! - GPT-OSS (harmony): a message to `functions.NAME` on the `commentary` channel, its body the
//!   arguments, ended by `<|call|>` ([`super::harmony::split_output_calls`]).
//!
//! Both work on the whole text so far and only grow as it grows (a call is reported once it is
//! complete), so a streaming caller reports the calls past those it has already sent.

use serde::Deserialize;
use serde_json::value::RawValue;

/// One function call the model made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    /// The function's name (`get_weather`, without harmony's `functions.` namespace).
    pub name: String,
    /// The arguments as the model wrote them: JSON text (OpenAI's `function.arguments` is a string).
    pub arguments: String,
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// Splits Hermes-style `<tool_call>` blocks out of `text` (the answer so far): the answer text to
/// show, and the complete calls in order. While the turn runs (`done` false), an unclosed block and
/// a trailing proper prefix of `<tool_call>` are held back (they may become a call); once `done`,
/// they are answer text.
pub fn split_hermes(text: &str, done: bool) -> (String, Vec<Call>) {
    let (mut answer, mut calls) = (String::new(), Vec::new());
    let mut rest = text;
    loop {
        let Some(at) = rest.find(OPEN) else {
            let keep = if done { 0 } else { partial_suffix(rest, OPEN) };
            answer.push_str(&rest[..rest.len() - keep]);
            break;
        };
        answer.push_str(&rest[..at]);
        let body_and_after = &rest[at + OPEN.len()..];
        let Some(end) = body_and_after.find(CLOSE) else {
            if done {
                answer.push_str(&rest[at..]);
            }
            break;
        };
        match hermes_call(&body_and_after[..end]) {
            Some(c) => calls.push(c),
            None => answer.push_str(&rest[at..at + OPEN.len() + end + CLOSE.len()]),
        }
        rest = &body_and_after[end + CLOSE.len()..];
    }
    (answer, calls)
}

/// The length of the longest suffix of `text` that is a proper prefix of `marker` (character
/// boundaries only).
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len()).rev().find(|&k| text.ends_with(&marker[..k])).unwrap_or(0)
}

/// `{"name": ..., "arguments": ...}` (arguments an object, or a string holding one); `None` for
/// anything else.
fn hermes_call(body: &str) -> Option<Call> {
    #[derive(Deserialize)]
    struct Hermes<'a> {
        name: String,
        #[serde(borrow)]
        arguments: Option<&'a RawValue>,
    }
    let h: Hermes = serde_json::from_str(body.trim()).ok()?;
    if h.name.is_empty() {
        return None;
    }
    let arguments = match h.arguments {
        None => "{}".to_string(),
        Some(raw) => match serde_json::from_str::<String>(raw.get()) {
            // Some models write the arguments as a JSON string; OpenAI's field is that string.
            Ok(s) => s,
            Err(_) => raw.get().to_string(),
        },
    };
    Some(Call { name: h.name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: &str) -> Call {
        Call { name: name.into(), arguments: arguments.into() }
    }

    #[test]
    fn hermes_blocks_become_calls_and_the_rest_stays_answer() {
        let one = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>";
        assert_eq!(
            split_hermes(one, true),
            (String::new(), vec![call("get_weather", "{\"city\": \"Paris\", \"unit\": \"c\"}")])
        );
        let two = format!("Let me check.\n{one}\n<tool_call>\n{{\"name\": \"time\", \"arguments\": \"{{\\\"tz\\\": 1}}\"}}\n</tool_call>");
        let (answer, calls) = split_hermes(&two, true);
        assert_eq!(answer, "Let me check.\n\n");
        assert_eq!(
            calls,
            vec![call("get_weather", "{\"city\": \"Paris\", \"unit\": \"c\"}"), call("time", "{\"tz\": 1}")]
        );
        // No arguments: an empty object.
        assert_eq!(split_hermes("<tool_call>{\"name\": \"now\"}</tool_call>", true).1, vec![call("now", "{}")]);
    }

    #[test]
    fn malformed_or_unclosed_blocks_stay_answer_text() {
        let bad = "<tool_call>\n{\"name\": \"f\", \"arguments\": {oops}\n</tool_call> after";
        assert_eq!(split_hermes(bad, true), (bad.to_string(), vec![]));
        let nameless = "<tool_call>{\"arguments\": {}}</tool_call>";
        assert_eq!(split_hermes(nameless, true), (nameless.to_string(), vec![]));
        // Unclosed: held back while the turn runs, answer text once it ended (max_tokens).
        let open = "Sure. <tool_call>\n{\"name\": \"f\", \"argu";
        assert_eq!(split_hermes(open, false), ("Sure. ".to_string(), vec![]));
        assert_eq!(split_hermes(open, true), (open.to_string(), vec![]));
        // A partial marker is held back, then released when it turns out not to be one.
        assert_eq!(split_hermes("a <tool_", false).0, "a ");
        assert_eq!(split_hermes("a <tool_", true).0, "a <tool_");
        assert_eq!(split_hermes("a <tool_x", false).0, "a <tool_x");
    }

    /// Fed one character at a time, the answer only grows and ends as the whole text's does.
    #[test]
    fn character_by_character_agrees_with_all_at_once() {
        let text = "I'll call two.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": [1, 2]}}\n</tool_call>\n\
                    <tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
        let (mut shown, mut calls) = (String::new(), Vec::new());
        let mut prefix = String::new();
        for ch in text.chars() {
            prefix.push(ch);
            let (answer, now) = split_hermes(&prefix, false);
            assert!(answer.starts_with(&shown), "the answer only grows: {shown:?} then {answer:?}");
            assert!(now.starts_with(&calls), "calls only grow");
            (shown, calls) = (answer, now);
        }
        assert_eq!((shown, calls), split_hermes(text, true));
    }
}
