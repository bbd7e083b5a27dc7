//! OpenAI's wire format, typed: what clients send ([`request`]) and what picchio answers
//! ([`response`]). Conversions to and from the runtime's types are in [`crate::request`] and
//! [`crate::answer`].

pub mod request;
pub mod response;

pub use request::{
    ChatMessage, ChatTemplateKwargs, CompletionRequest, ContentPart, Logprobs, MessageContent, Prompt, ResponseFormat,
    Stop, StreamOptions, ToolChoice,
};
pub use response::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, Completion,
    ErrorBody, ErrorKind, ErrorObject, FinishReason, FunctionOut, Health, ModelCard, ModelList, Object,
    PromptTokensDetails, TextChoice, TextCompletion, ToolCallOut, Usage,
};
