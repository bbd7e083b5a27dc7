//! Request bodies of `POST /v1/chat/completions` and `POST /v1/completions`, as OpenAI's API
//! reference and vLLM's extensions define them. Only the fields picchio reads are declared; any
//! other field is ignored (as OpenAI-compatible servers do), so a client's extra options never fail
//! a request. A declared field of the wrong type fails with serde's message at its path
//! (`messages[0].content: invalid type: ...`, [`crate::request::parse_body`]).

use std::collections::BTreeMap;
use std::fmt;

use picchio_runtime::chat::{TemplateValue, ToolCall};
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

/// The body of either endpoint. The chat endpoint reads `messages`, the completions endpoint
/// `prompt`; every other field means the same on both.
#[derive(Debug, Default, Deserialize)]
pub struct CompletionRequest {
    /// The model asked for; when given it must be the served one (else 404 `model_not_found`).
    pub model: Option<String>,
    /// The conversation (chat).
    pub messages: Option<Vec<ChatMessage>>,
    /// The prompt (completions).
    pub prompt: Option<Prompt>,
    /// Tokens to generate at most (legacy name of `max_completion_tokens`).
    pub max_tokens: Option<i64>,
    /// Tokens to generate at most; wins over `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    /// Sampling temperature (OpenAI's default 1; 0 is greedy).
    pub temperature: Option<f64>,
    /// Nucleus sampling mass (default 1).
    pub top_p: Option<f64>,
    /// vLLM's top-k (0 or -1: all).
    pub top_k: Option<i64>,
    /// vLLM's min-p (default 0).
    pub min_p: Option<f64>,
    /// The sampler's seed (default 0); a negative one is taken as its two's complement.
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// OpenAI's presence penalty.
    pub presence_penalty: Option<f64>,
    /// OpenAI's frequency penalty.
    pub frequency_penalty: Option<f64>,
    /// vLLM's repetition penalty (default 1).
    pub repetition_penalty: Option<f64>,
    /// Answer as server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// vLLM's extension: go on past the end-of-turn ids.
    #[serde(default)]
    pub ignore_eos: bool,
    /// vLLM's extension: return the prompt's and the answer's token ids.
    #[serde(default)]
    pub return_token_ids: bool,
    /// vLLM's `chat_template_kwargs`.
    pub chat_template_kwargs: Option<ChatTemplateKwargs>,
    /// Function tools for the chat format, kept with their key order (a template writes them with
    /// `tojson`, harmony as TypeScript types).
    pub tools: Option<Vec<TemplateValue>>,
    /// Choices to generate; only 1 is served.
    pub n: Option<i64>,
    /// Refused when asked for (this server has no log probabilities).
    pub logprobs: Option<Logprobs>,
    /// Refused when above 0.
    pub top_logprobs: Option<i64>,
    /// Refused when true (the prompt is not echoed).
    #[serde(default)]
    pub echo: bool,
    /// Refused when not 1.
    pub best_of: Option<i64>,
    /// Refused unless `{"type": "text"}`.
    pub response_format: Option<ResponseFormat>,
    /// Refused unless empty.
    pub logit_bias: Option<BTreeMap<String, f64>>,
    /// Refused unless empty.
    pub suffix: Option<String>,
    /// `auto` and `none` are served; a choice that forces a call is refused.
    pub tool_choice: Option<ToolChoice>,
}

impl CompletionRequest {
    /// The first field asked for that this server does not do (`None`: none), so the request is
    /// refused instead of answered without it: logprobs, top_logprobs, echo, best_of other than 1, a
    /// response_format other than text, a non-empty logit_bias or suffix, and a tool_choice that
    /// forces a call ("required" or a named function). Their "off" values (null, false, 0, 1 for
    /// best_of, `{}`, "", "auto", "none") are accepted: clients send them by default.
    pub fn unsupported(&self) -> Option<&'static str> {
        if self.logprobs.is_some_and(|l| l.asked()) {
            Some("logprobs")
        } else if self.top_logprobs.is_some_and(|n| n != 0) {
            Some("top_logprobs")
        } else if self.echo {
            Some("echo")
        } else if self.best_of.is_some_and(|b| b != 1) {
            Some("best_of")
        } else if self.response_format.as_ref().is_some_and(|f| f.kind != "text") {
            Some("response_format (only {\"type\": \"text\"})")
        } else if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            Some("logit_bias")
        } else if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            Some("suffix")
        } else if self.tool_choice.as_ref().is_some_and(ToolChoice::forces_call) {
            Some("tool_choice (only \"auto\" or \"none\": the model decides whether to call a tool)")
        } else {
            None
        }
    }
}

/// `stream_options`.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage (and no choices) before `[DONE]`.
    #[serde(default)]
    pub include_usage: bool,
}

/// `chat_template_kwargs`: the keys picchio's templates read (others are ignored).
#[derive(Clone, Copy, Debug, Default, Deserialize)]
pub struct ChatTemplateKwargs {
    /// Qwen3's `enable_thinking`.
    pub enable_thinking: Option<bool>,
}

/// `response_format`: `{"type": "text" | "json_object" | "json_schema", ...}` (only the type is read).
#[derive(Clone, Debug, Deserialize)]
pub struct ResponseFormat {
    /// `text` is the only one served.
    #[serde(rename = "type")]
    pub kind: String,
}

/// One message of `messages`.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool` (checked by the template's renderer).
    pub role: String,
    /// The text: a string, null or absent (empty), or a list of parts.
    #[serde(default)]
    pub content: MessageContent,
    /// An assistant message's reasoning.
    pub reasoning_content: Option<String>,
    /// An assistant message's tool calls.
    pub tool_calls: Option<Vec<ToolCall>>,
    /// A `tool` message: the id of the call it answers.
    pub tool_call_id: Option<String>,
    /// A `tool` message: the function's name.
    pub name: Option<String>,
}

/// A message's `content`.
#[derive(Clone, Debug, PartialEq)]
pub enum MessageContent {
    /// A string (null or absent: empty).
    Text(String),
    /// A list of parts, of which picchio serves `{"type": "text", "text": ...}` only.
    Parts(Vec<ContentPart>),
}

impl Default for MessageContent {
    fn default() -> Self {
        MessageContent::Text(String::new())
    }
}

/// One part of a list `content`: `{"type": "text", "text": "..."}`, `{"type": "image_url", ...}`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct ContentPart {
    /// The part's type.
    #[serde(rename = "type")]
    pub kind: String,
    /// A text part's text.
    pub text: Option<String>,
}

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MessageContent;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, null, or a list of text parts")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(MessageContent::Text(v.into()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(MessageContent::Text(v))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(MessageContent::default())
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(MessageContent::default())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::new();
                while let Some(p) = seq.next_element()? {
                    parts.push(p);
                }
                Ok(MessageContent::Parts(parts))
            }
        }
        d.deserialize_any(V)
    }
}

/// A completions `prompt`: a string, a list of one string, or a list of token ids.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// Text to tokenize.
    Text(String),
    /// Token ids, each below 2^32.
    Ids(Vec<u32>),
}

/// One element of a list `prompt`.
enum PromptItem {
    Text(String),
    Id(u32),
}

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptItem;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or a token id")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(PromptItem::Text(v.into()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                u32::try_from(v)
                    .map(PromptItem::Id)
                    .map_err(|_| E::custom(format!("prompt token ids must be below 2^32, got {v}")))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        const EXPECTED: &str = "a string, a list of one string, or a list of token ids";
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Prompt;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(EXPECTED)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Prompt::Text(v.into()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Prompt::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::new();
                while let Some(x) = seq.next_element::<PromptItem>()? {
                    items.push(x);
                }
                let ids: Option<Vec<u32>> = items
                    .iter()
                    .map(|x| match x {
                        PromptItem::Id(id) => Some(*id),
                        PromptItem::Text(_) => None,
                    })
                    .collect();
                match (ids, items.as_mut_slice()) {
                    (Some(ids), _) if !ids.is_empty() => Ok(Prompt::Ids(ids)),
                    (_, [PromptItem::Text(t)]) => Ok(Prompt::Text(std::mem::take(t))),
                    _ => Err(de::Error::custom(format!(
                        "a list of {} elements that is not {EXPECTED} (one prompt per request)",
                        items.len()
                    ))),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// `stop`: a string or a list of strings (null: none).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stop(pub Vec<String>);

impl<'de> Deserialize<'de> for Stop {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Stop;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or a list of strings")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Stop(vec![v.into()]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    out.push(s);
                }
                Ok(Stop(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// `logprobs`: a boolean on the chat endpoint, a count on the completions endpoint.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Logprobs {
    /// Chat: `true` asks for them.
    Flag(bool),
    /// Completions: above 0 asks for that many.
    Count(i64),
}

impl Logprobs {
    /// Whether log probabilities are asked for (`true`, or a count other than 0).
    pub fn asked(self) -> bool {
        !matches!(self, Logprobs::Flag(false) | Logprobs::Count(0))
    }
}

impl<'de> Deserialize<'de> for Logprobs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Logprobs;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a boolean or an integer")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Ok(Logprobs::Flag(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(Logprobs::Count(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Logprobs::Count(i64::try_from(v).unwrap_or(i64::MAX)))
            }
        }
        d.deserialize_any(V)
    }
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    /// A string: `auto` (the model decides), `none` (no call: a call written anyway stays text),
    /// `required` (refused, as is any other string).
    Mode(String),
    /// `{"type": "function", "function": {"name": ...}}`: that function must be called (refused).
    Function(String),
}

impl ToolChoice {
    /// Whether the choice forces a call (anything but `auto` and `none`), which picchio does not do.
    pub fn forces_call(&self) -> bool {
        !matches!(self, ToolChoice::Mode(m) if m == "auto" || m == "none")
    }

    /// `none`: the model is not to call a tool.
    pub fn is_none(&self) -> bool {
        matches!(self, ToolChoice::Mode(m) if m == "none")
    }
}

impl<'de> Deserialize<'de> for ToolChoice {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Named {
            function: NamedFunction,
        }
        #[derive(Deserialize)]
        struct NamedFunction {
            name: String,
        }
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ToolChoice;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(
                    "\"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                )
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(ToolChoice::Mode(v.into()))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let n = Named::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(ToolChoice::Function(n.function.name))
            }
        }
        d.deserialize_any(V)
    }
}
