//! Response bodies in OpenAI's shapes: the model list and card, whole completions (chat and text),
//! the streamed chunks (`data: {...}` events), usage, tool calls and the error body.

use serde::Serialize;

/// The `object` member of every response.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Object {
    /// A list (`/v1/models`).
    #[serde(rename = "list")]
    List,
    /// A model card.
    #[serde(rename = "model")]
    Model,
    /// A whole chat answer.
    #[serde(rename = "chat.completion")]
    ChatCompletion,
    /// A streamed chat chunk.
    #[serde(rename = "chat.completion.chunk")]
    ChatCompletionChunk,
    /// A text completion, whole or streamed (OpenAI names both so).
    #[serde(rename = "text_completion")]
    TextCompletion,
}

/// `GET /v1/models`.
#[derive(Clone, Debug, Serialize)]
pub struct ModelList {
    /// [`Object::List`].
    pub object: Object,
    /// The served model, alone.
    pub data: Vec<ModelCard>,
}

/// A model (`GET /v1/models/{id}`, and each entry of [`ModelList`]).
#[derive(Clone, Debug, Serialize)]
pub struct ModelCard {
    /// The model's name (its directory's name).
    pub id: String,
    /// [`Object::Model`].
    pub object: Object,
    /// Unix seconds of creation: 0 (unknown).
    pub created: u64,
    /// `picchio`.
    pub owned_by: &'static str,
    /// Tokens of the KV cache (`--ctx`): prompt and answer together.
    pub context_length: usize,
}

impl ModelCard {
    /// The card of model `id` served with `context_length` tokens.
    pub fn new(id: &str, context_length: usize) -> ModelCard {
        ModelCard { id: id.into(), object: Object::Model, created: 0, owned_by: "picchio", context_length }
    }
}

/// `GET /health`.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Health {
    /// `ok`.
    pub status: &'static str,
}

/// A completion, whole or one streamed chunk: its choices are [`ChatChoice`] (whole chat answer),
/// [`ChatChunkChoice`] (a streamed chat chunk) or [`TextChoice`] (text completions, both ways).
#[derive(Clone, Debug, Serialize)]
pub struct Completion<C> {
    /// `chatcmpl-N` or `cmpl-N`, the same for every chunk of one answer.
    pub id: String,
    /// What this is.
    pub object: Object,
    /// Unix seconds when the request started.
    pub created: u64,
    /// The model's name.
    pub model: String,
    /// One choice (n = 1); none in the streamed usage chunk.
    pub choices: Vec<C>,
    /// Token counts: always in a whole answer; in a stream only in the last chunk, when
    /// `stream_options.include_usage` asked for it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// vLLM's `return_token_ids`: the prompt's ids (whole answers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

/// A whole chat answer.
pub type ChatCompletion = Completion<ChatChoice>;
/// A streamed chat chunk.
pub type ChatCompletionChunk = Completion<ChatChunkChoice>;
/// A text completion (whole or streamed).
pub type TextCompletion = Completion<TextChoice>;

/// OpenAI's `finish_reason`; a generation the server stopped (a shutdown) is vLLM's `abort`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-turn id or a stop string.
    Stop,
    /// `max_tokens` or the end of the context.
    Length,
    /// The answer ended with function calls.
    ToolCalls,
    /// The server stopped it.
    Abort,
}

/// The choice of a whole chat answer.
#[derive(Clone, Debug, Serialize)]
pub struct ChatChoice {
    /// 0 (n = 1).
    pub index: u32,
    /// The answer.
    pub message: AssistantMessage,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Always null (log probabilities are refused).
    pub logprobs: (),
    /// vLLM's `return_token_ids`: the answer's ids, the end-of-turn id included.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// The assistant message of a whole chat answer.
#[derive(Clone, Debug, Serialize)]
pub struct AssistantMessage {
    /// `assistant`.
    pub role: &'static str,
    /// The answer text; null when the answer is only tool calls.
    pub content: Option<String>,
    /// The reasoning (Qwen3's `<think>` text, GPT-OSS's analysis channel), when there is some.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The function calls, when there are some.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

/// The choice of a streamed chat chunk.
#[derive(Clone, Debug, Serialize)]
pub struct ChatChunkChoice {
    /// 0 (n = 1).
    pub index: u32,
    /// What is new.
    pub delta: ChatDelta,
    /// Null until the finish chunk.
    pub finish_reason: Option<FinishReason>,
    /// vLLM's `return_token_ids`, in the finish chunk: the answer's ids.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// The `delta` of a streamed chat chunk: only the members with something new.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ChatDelta {
    /// `assistant`, in the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New answer text (`""` in the first chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// New reasoning text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Function calls completed since the last chunk, each whole, with its `index`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

/// The choice of a text completion (whole, or a streamed chunk's).
#[derive(Clone, Debug, Serialize)]
pub struct TextChoice {
    /// 0 (n = 1).
    pub index: u32,
    /// The text (a chunk's new text; `""` in the finish chunk).
    pub text: String,
    /// Why it ended; null until the finish chunk.
    pub finish_reason: Option<FinishReason>,
    /// Always null (log probabilities are refused).
    pub logprobs: (),
    /// vLLM's `return_token_ids`: the answer's ids (whole answers and the finish chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// One `tool_calls` entry.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToolCallOut {
    /// Its position among the answer's calls (streamed chunks only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    /// `call_N`, which the `tool` message answering it names.
    pub id: String,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The function and its arguments.
    pub function: FunctionOut,
}

/// The function of a [`ToolCallOut`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FunctionOut {
    /// The function's name.
    pub name: String,
    /// The arguments as the model wrote them (JSON text).
    pub arguments: String,
}

/// Token counts of an answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// The prompt's tokens.
    pub prompt_tokens: usize,
    /// Generated tokens (the end-of-turn id included).
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
    /// Of the prompt.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens reused from the KV cache (the prefix shared with the previous request).
    pub cached_tokens: usize,
}

/// An error response: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, Serialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorObject,
}

/// The `error` of an [`ErrorBody`].
#[derive(Clone, Debug, Serialize)]
pub struct ErrorObject {
    /// What went wrong and, where it helps, what to do.
    pub message: String,
    /// `invalid_request_error` or `server_error`.
    #[serde(rename = "type")]
    pub kind: ErrorKind,
    /// Always null.
    pub param: Option<String>,
    /// OpenAI's machine-readable code (`context_length_exceeded`, `model_not_found`), when one
    /// applies.
    pub code: Option<&'static str>,
}

/// OpenAI's error `type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request is at fault (4xx).
    InvalidRequestError,
    /// The server is (5xx, and an error after a stream started).
    ServerError,
}
