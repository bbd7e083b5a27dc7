//! From the engine's [`Outcome`] and [`Delta`]s to OpenAI's answers: a whole completion, or the
//! streamed chunks (the chat role chunk, one chunk per delta, the finish chunk, the usage chunk).

use picchio_runtime::chat::engine::{self, Delta, Outcome};

use crate::request::Endpoint;
use crate::wire::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatDelta, Completion, FinishReason, FunctionOut,
    Object, PromptTokensDetails, TextChoice, TextCompletion, ToolCallOut, Usage,
};

/// What every chunk of one answer repeats, and what the request asked of the answer.
#[derive(Clone, Debug)]
pub struct Meta {
    /// `chatcmpl-N` or `cmpl-N`.
    pub id: String,
    /// The model's name.
    pub model: String,
    /// Unix seconds when the request started.
    pub created: u64,
    /// Chat or text completion.
    pub endpoint: Endpoint,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// vLLM's `return_token_ids`.
    pub token_ids: bool,
}

/// OpenAI's `finish_reason` of an engine outcome (a generation the server stopped is `abort`).
pub fn finish_reason(f: engine::FinishReason) -> FinishReason {
    match f {
        engine::FinishReason::Length => FinishReason::Length,
        engine::FinishReason::Stop => FinishReason::Stop,
        engine::FinishReason::Cancelled => FinishReason::Abort,
        engine::FinishReason::ToolCalls => FinishReason::ToolCalls,
    }
}

/// OpenAI's `tool_calls` entries of `calls`; streamed ones carry their `index`.
pub fn tool_calls(calls: &[engine::ToolCall], streamed: bool) -> Vec<ToolCallOut> {
    calls
        .iter()
        .map(|c| ToolCallOut {
            index: streamed.then_some(c.index),
            id: c.id.clone(),
            kind: "function",
            function: FunctionOut { name: c.call.name.clone(), arguments: c.call.arguments.clone() },
        })
        .collect()
}

impl Usage {
    /// The usage of `prompt` prompt tokens (of which `cached` came from the KV cache) and
    /// `completion` generated ones.
    pub fn new(prompt: usize, completion: usize, cached: usize) -> Usage {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: PromptTokensDetails { cached_tokens: cached },
        }
    }
}

/// The usage of an outcome.
pub fn usage(o: &Outcome) -> Usage {
    Usage::new(o.prompt_ids.len(), o.turn.completion_tokens(), o.turn.cached_tokens)
}

/// The answer's ids, the end-of-turn id included.
fn answer_ids(o: &Outcome) -> Vec<u32> {
    o.turn.tokens.iter().copied().chain(o.turn.stop_id).collect()
}

fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}

impl Meta {
    fn completion<C>(&self, object: Object, choices: Vec<C>, usage: Option<Usage>) -> Completion<C> {
        Completion {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
            prompt_token_ids: None,
        }
    }

    fn ids(&self, o: &Outcome) -> Option<Vec<u32>> {
        self.token_ids.then(|| answer_ids(o))
    }

    /// A whole chat answer: the content (null when the answer is only tool calls), the reasoning and
    /// the tool calls when there are some.
    pub fn chat_completion(&self, o: &Outcome) -> ChatCompletion {
        let calls = (!o.tool_calls.is_empty()).then(|| tool_calls(&o.tool_calls, false));
        let message = AssistantMessage {
            role: "assistant",
            content: if calls.is_some() && o.content.is_empty() { None } else { Some(o.content.clone()) },
            reasoning_content: non_empty(&o.reasoning),
            tool_calls: calls,
        };
        let choice = ChatChoice {
            index: 0,
            message,
            finish_reason: finish_reason(o.finish),
            logprobs: (),
            token_ids: self.ids(o),
        };
        let mut c = self.completion(Object::ChatCompletion, vec![choice], Some(usage(o)));
        c.prompt_token_ids = self.token_ids.then(|| o.prompt_ids.clone());
        c
    }

    /// A whole text completion.
    pub fn text_completion(&self, o: &Outcome) -> TextCompletion {
        let choice = TextChoice {
            index: 0,
            text: o.content.clone(),
            finish_reason: Some(finish_reason(o.finish)),
            logprobs: (),
            token_ids: self.ids(o),
        };
        let mut c = self.completion(Object::TextCompletion, vec![choice], Some(usage(o)));
        c.prompt_token_ids = self.token_ids.then(|| o.prompt_ids.clone());
        c
    }

    fn chat_chunk(&self, delta: ChatDelta, finish: Option<FinishReason>, token_ids: Option<Vec<u32>>) -> String {
        let choice = ChatChunkChoice { index: 0, delta, finish_reason: finish, token_ids };
        json(&self.completion(Object::ChatCompletionChunk, vec![choice], None))
    }

    fn text_chunk(&self, text: String, finish: Option<FinishReason>, token_ids: Option<Vec<u32>>) -> String {
        let choice = TextChoice { index: 0, text, finish_reason: finish, logprobs: (), token_ids };
        json(&self.completion(Object::TextCompletion, vec![choice], None))
    }

    /// The stream's first chunk: the chat answer's role (`{"role": "assistant", "content": ""}`);
    /// `None` for a text completion.
    pub fn role_chunk(&self) -> Option<String> {
        (self.endpoint == Endpoint::Chat).then(|| {
            let delta = ChatDelta { role: Some("assistant"), content: Some(String::new()), ..ChatDelta::default() };
            self.chat_chunk(delta, None, None)
        })
    }

    /// The chunk of one delta: its new text, reasoning and completed tool calls (chat), or its text.
    pub fn delta_chunk(&self, d: &Delta) -> String {
        match self.endpoint {
            Endpoint::Chat => {
                let delta = ChatDelta {
                    role: None,
                    content: non_empty(&d.content),
                    reasoning_content: non_empty(&d.reasoning),
                    tool_calls: (!d.tool_calls.is_empty()).then(|| tool_calls(&d.tool_calls, true)),
                };
                self.chat_chunk(delta, None, None)
            }
            Endpoint::Completions => self.text_chunk(d.content.clone(), None, None),
        }
    }

    /// The finish chunk: `finish_reason` (and the answer's ids when asked for).
    pub fn finish_chunk(&self, o: &Outcome) -> String {
        let f = Some(finish_reason(o.finish));
        match self.endpoint {
            Endpoint::Chat => self.chat_chunk(ChatDelta::default(), f, self.ids(o)),
            Endpoint::Completions => self.text_chunk(String::new(), f, self.ids(o)),
        }
    }

    /// The usage chunk (`stream_options.include_usage`): no choices, the usage.
    pub fn usage_chunk(&self, o: &Outcome) -> String {
        let object = match self.endpoint {
            Endpoint::Chat => Object::ChatCompletionChunk,
            Endpoint::Completions => Object::TextCompletion,
        };
        json(&self.completion::<TextChoice>(object, Vec::new(), Some(usage(o))))
    }
}

/// `v` as JSON text. (The wire types hold strings, numbers and enums only: serializing them cannot
/// fail.)
pub(crate) fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| unreachable!("serializing a wire type: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use picchio_runtime::chat::tools::Call;
    use serde_json::{json, Value};

    fn meta(endpoint: Endpoint) -> Meta {
        Meta { id: "chatcmpl-1".into(), model: "m".into(), created: 7, endpoint, include_usage: true, token_ids: false }
    }

    fn call(index: usize) -> engine::ToolCall {
        engine::ToolCall {
            index,
            id: format!("call_{index}"),
            call: Call { name: "f".into(), arguments: "{\"n\": 1}".into() },
        }
    }

    fn parse(s: &str) -> Value {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn chat_chunks_carry_only_what_is_new() {
        let m = meta(Endpoint::Chat);
        assert_eq!(
            parse(&m.role_chunk().unwrap()),
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]})
        );
        let d = Delta { reasoning: "hm".into(), content: String::new(), tool_calls: vec![call(1)] };
        assert_eq!(
            parse(&m.delta_chunk(&d))["choices"][0],
            json!({"index": 0, "finish_reason": null, "delta": {"reasoning_content": "hm", "tool_calls": [
                {"index": 1, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"n\": 1}"}}]}})
        );
        let d = Delta { reasoning: String::new(), content: "Hi".into(), tool_calls: Vec::new() };
        assert_eq!(parse(&m.delta_chunk(&d))["choices"][0]["delta"], json!({"content": "Hi"}));
    }

    #[test]
    fn text_chunks_and_whole_tool_calls() {
        let m = meta(Endpoint::Completions);
        assert_eq!(m.role_chunk(), None);
        let d = Delta { reasoning: String::new(), content: " fox".into(), tool_calls: Vec::new() };
        let v = parse(&m.delta_chunk(&d));
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0], json!({"index": 0, "text": " fox", "finish_reason": null, "logprobs": null}));
        let whole = serde_json::to_value(tool_calls(&[call(0)], false)).unwrap();
        assert_eq!(
            whole,
            json!([{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{\"n\": 1}"}}])
        );
    }

    #[test]
    fn usage_and_finish_reasons_in_openai_words() {
        assert_eq!(
            serde_json::to_value(Usage::new(10, 5, 3)).unwrap(),
            json!({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                   "prompt_tokens_details": {"cached_tokens": 3}})
        );
        let words: Vec<Value> = [
            engine::FinishReason::Stop,
            engine::FinishReason::Length,
            engine::FinishReason::Cancelled,
            engine::FinishReason::ToolCalls,
        ]
        .into_iter()
        .map(|f| serde_json::to_value(finish_reason(f)).unwrap())
        .collect();
        assert_eq!(words, [json!("stop"), json!("length"), json!("abort"), json!("tool_calls")]);
    }

    #[test]
    fn error_bodies_have_openai_s_shape() {
        let e = crate::ApiError::invalid(404, Some("model_not_found"), "no");
        assert_eq!(
            serde_json::to_value(e.body(None)).unwrap(),
            json!({"error": {"message": "no", "type": "invalid_request_error", "param": null, "code": "model_not_found"}})
        );
        let e = crate::ApiError::bad_request("bad");
        assert_eq!(
            serde_json::to_value(e.body(Some(crate::wire::ErrorKind::ServerError))).unwrap(),
            json!({"error": {"message": "bad", "type": "server_error", "param": null, "code": null}})
        );
        let card = serde_json::to_value(crate::wire::ModelCard::new("m", 512)).unwrap();
        assert_eq!(
            card,
            json!({"id": "m", "object": "model", "created": 0, "owned_by": "picchio", "context_length": 512})
        );
    }
}
