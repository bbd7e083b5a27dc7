//! GPT-OSS's harmony chat format (OpenAI's "harmony response format", as the `openai-harmony`
//! renderer writes it for a conversation without tools): a system message naming the model, the
//! reasoning effort and the valid channels; the request's system/developer text as the developer
//! message's `# Instructions`; `<|start|>{role}<|message|>{text}<|end|>` per message; an assistant
//! turn as `<|start|>assistant<|channel|>final<|message|>{text}<|end|>` (its analysis dropped, as
//! harmony drops the analysis of every turn that reached its final answer; an assistant message
//! with reasoning and no answer yet is rendered as its analysis message); and `<|start|>assistant`
//! to open the reply. Tested against openai-harmony's own rendering
//! (tests/fixtures/chat/render_harmony.py). The model ends its turn
//! with `<|return|>` (answer done) or `<|call|>` (tool call); `<|end|>` only ends one message (the
//! analysis) and the turn goes on.

use super::template::{check_messages, Message};
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

impl Harmony {
    /// Renders `messages`; `add_generation_prompt` appends `<|start|>assistant`.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an empty list, an unknown role, or a `tool` message (tool calls are
    /// not supported in harmony rendering here).
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        check_messages(messages)?;
        let mut out = format!(
            "<|start|>system<|message|>{SYSTEM}\n\nReasoning: {}\n\n# Valid channels: analysis, commentary, final. \
             Channel must be included for every message.<|end|>",
            self.reasoning_effort
        );
        for (i, m) in messages.iter().enumerate() {
            match m.role.as_str() {
                "system" | "developer" => {
                    out.push_str("<|start|>developer<|message|># Instructions\n\n");
                    out.push_str(&m.content);
                    out.push_str("<|end|>");
                }
                "user" => {
                    out.push_str("<|start|>user<|message|>");
                    out.push_str(&m.content);
                    out.push_str("<|end|>");
                }
                "assistant" => match m.reasoning_content.as_deref().filter(|r| m.content.is_empty() && !r.is_empty()) {
                    Some(r) => {
                        out.push_str("<|start|>assistant<|channel|>analysis<|message|>");
                        out.push_str(r);
                        out.push_str("<|end|>");
                    }
                    None => {
                        out.push_str("<|start|>assistant<|channel|>final<|message|>");
                        out.push_str(&m.content);
                        out.push_str("<|end|>");
                    }
                },
                other => {
                    return Err(Error::Invalid(format!(
                        "message {i} has role `{other}`: tool messages are not supported with the harmony format"
                    )))
                }
            }
        }
        if add_generation_prompt {
            out.push_str("<|start|>assistant");
        }
        Ok(out)
    }
}

/// Splits the text of an assistant turn the model generated after `<|start|>assistant` (decoded with
/// its special tokens) into (reasoning, answer): the `analysis` channel's messages are reasoning,
/// the `final` (or channel-less) messages the answer; headers and `<|end|>`/`<|start|>` markers are
/// dropped. An unfinished header yields nothing yet.
pub fn split_output(text: &str) -> (String, String) {
    let (mut reasoning, mut answer) = (String::new(), String::new());
    for msg in text.split("<|start|>") {
        let Some((header, body)) = msg.split_once("<|message|>") else { continue };
        let body = body.split("<|end|>").next().unwrap_or("");
        let body = body.trim_end_matches(STOP_TOKENS[0]).trim_end_matches(STOP_TOKENS[1]);
        let channel = header.split_once("<|channel|>").map(|(_, c)| c.split_whitespace().next().unwrap_or(""));
        let dst = match channel {
            Some("analysis") => &mut reasoning,
            Some("commentary") => &mut reasoning,
            _ => &mut answer,
        };
        dst.push_str(body);
    }
    (reasoning, answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_analysis_from_the_final_answer() {
        let t = "<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello!";
        assert_eq!(split_output(t), ("User says hi.".into(), "Hello!".into()));
        assert_eq!(split_output("<|channel|>analysis<|mess"), (String::new(), String::new()));
        assert_eq!(split_output("<|channel|>final<|message|>Hi<|return|>"), (String::new(), "Hi".into()));
    }

    #[test]
    fn refuses_tool_messages() {
        let e = Harmony::default().render(&[Message::new("tool", "{}")], true).unwrap_err();
        assert!(e.to_string().contains("harmony"), "{e}");
    }
}
