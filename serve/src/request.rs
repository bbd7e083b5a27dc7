//! From a request body to the engine's [`Request`]: JSON to [`CompletionRequest`] (errors name the
//! field's path), then the checks OpenAI's API makes (the model, `n`, fields this server does not
//! do, `max_tokens`, the prompt's shape, sampling ranges), each refusal a 400 (404 for another
//! model) whose message names the field.

use picchio_runtime::chat::engine::{Prompt as EnginePrompt, Request};
use picchio_runtime::chat::Message;
use picchio_runtime::model::sampler::SamplerOptions;

use crate::api_error::ApiError;
use crate::wire::{ChatMessage, CompletionRequest, MessageContent, Prompt};

/// Which endpoint a body came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions` (reads `messages`).
    Chat,
    /// `POST /v1/completions` (reads `prompt`).
    Completions,
}

/// The body as [`CompletionRequest`].
///
/// # Errors
/// A 400 saying what is wrong, where: the field's path when the JSON got that far
/// (`messages[0].content: invalid type: ...`), serde's line and column, and for a `\uD800`-`\uDFFF`
/// escape not in a UTF-16 surrogate pair (serde says "lone leading surrogate" or "unexpected end of
/// hex escape") what JSON text requires.
pub fn parse_body(bytes: &[u8]) -> Result<CompletionRequest, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.inner();
        let at = if path == "." { String::new() } else { format!("{path}: ") };
        let text = inner.to_string();
        if inner.is_syntax() && (text.contains("surrogate") || text.contains("hex escape")) {
            return ApiError::bad_request(format!(
                "the body is not valid JSON: {at}a \\u escape of a UTF-16 surrogate (D800-DFFF) must be one of a \
                 high-low pair; a lone surrogate is not a character (line {}, column {})",
                inner.line(),
                inner.column()
            ));
        }
        ApiError::bad_request(format!("the body is not a valid request: {at}{text}"))
    })
}

/// The engine request of `body` sent to `endpoint` of a server of `model`; `mock_sampled` goes to
/// [`Request::mock_sampled`] (the test hook's ids, `None` in every real run).
///
/// # Errors
/// 404 `model_not_found` when the body names another model; 400 naming the field for `n` other than
/// 1, a field asked for that this server does not do ([`CompletionRequest::unsupported`]),
/// `max_tokens` below 1, no `messages` (chat) or `prompt` (completions), a content part that is not
/// text, `top_k` below -1, a sampling number past `f32`'s range and the sampler's own range checks.
pub fn to_engine(
    body: &CompletionRequest,
    endpoint: Endpoint,
    model: &str,
    mock_sampled: Option<Vec<u32>>,
) -> Result<Request, ApiError> {
    if let Some(m) = &body.model {
        if m != model {
            let msg = format!("the model `{m}` does not exist; this server has `{model}`");
            return Err(ApiError::invalid(404, Some("model_not_found"), msg));
        }
    }
    if body.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request("n must be 1"));
    }
    if let Some(field) = body.unsupported() {
        return Err(ApiError::bad_request(format!("{field} is not supported by this server")));
    }
    let max_tokens = match body.max_completion_tokens.or(body.max_tokens) {
        Some(n) if n < 1 => return Err(ApiError::bad_request(format!("max_tokens must be at least 1, got {n}"))),
        Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        None => None,
    };
    let prompt = match endpoint {
        Endpoint::Chat => {
            let Some(msgs) = &body.messages else { return Err(ApiError::bad_request("`messages` is required")) };
            EnginePrompt::Chat(msgs.iter().enumerate().map(|(i, m)| message(i, m)).collect::<Result<_, _>>()?)
        }
        Endpoint::Completions => match &body.prompt {
            Some(Prompt::Text(t)) => EnginePrompt::Text(t.clone()),
            Some(Prompt::Ids(ids)) => EnginePrompt::Ids(ids.clone()),
            None => return Err(ApiError::bad_request("`prompt` is required")),
        },
    };
    let top_k = match body.top_k {
        Some(k) if k < -1 => return Err(ApiError::bad_request(format!("top_k must be >= 0 (or -1 for all), got {k}"))),
        Some(k) if k <= 0 => 0,
        Some(k) => usize::try_from(k).unwrap_or(usize::MAX),
        None => 0,
    };
    let d = SamplerOptions::default();
    let sampler = SamplerOptions {
        // OpenAI's default temperature is 1.
        temperature: narrow("temperature", body.temperature)?.unwrap_or(1.0),
        top_p: narrow("top_p", body.top_p)?.unwrap_or(1.0),
        // A negative seed is its two's complement: any i64 is a seed.
        seed: body.seed.map_or(0, |s| s as u64),
        top_k,
        min_p: narrow("min_p", body.min_p)?.unwrap_or(0.0),
        repetition_penalty: narrow("repetition_penalty", body.repetition_penalty)?.unwrap_or(1.0),
        presence_penalty: narrow("presence_penalty", body.presence_penalty)?.unwrap_or(d.presence_penalty),
        frequency_penalty: narrow("frequency_penalty", body.frequency_penalty)?.unwrap_or(d.frequency_penalty),
    };
    sampler.check().map_err(ApiError::bad_request)?;
    Ok(Request {
        prompt,
        max_tokens,
        sampler,
        stop: body.stop.clone().map(|s| s.0).unwrap_or_default(),
        ignore_eos: body.ignore_eos,
        enable_thinking: body.chat_template_kwargs.and_then(|k| k.enable_thinking),
        tools: body.tools.clone().unwrap_or_default(),
        // "none": the model is not to call; a call it writes anyway is text (vLLM does the same).
        calls_as_text: body.tool_choice.as_ref().is_some_and(|c| c.is_none()),
        mock_sampled,
    })
}

/// Message `i` of `messages` as the template takes it.
///
/// # Errors
/// 400 for a content part other than text, naming its index.
fn message(i: usize, m: &ChatMessage) -> Result<Message, ApiError> {
    let content = match &m.content {
        MessageContent::Text(t) => t.clone(),
        MessageContent::Parts(parts) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => out.push_str(t),
                    ("text", None) => {
                        return Err(ApiError::bad_request(format!(
                            "messages[{i}].content[{j}]: a text part needs `text`"
                        )))
                    }
                    (kind, _) => {
                        return Err(ApiError::bad_request(format!(
                            "messages[{i}].content[{j}]: content part of type {kind} is not supported (text only)"
                        )))
                    }
                }
            }
            out
        }
    };
    Ok(Message {
        role: m.role.clone(),
        content,
        reasoning_content: m.reasoning_content.clone(),
        tool_calls: m.tool_calls.clone(),
        tool_call_id: m.tool_call_id.clone(),
        name: m.name.clone(),
    })
}

/// A sampling parameter as the sampler takes it (`f32`), read from the request as `f64` so that a
/// value past `f32`'s range is refused as the client wrote it (`temperature: 1e300`), not reported
/// as `inf` after the narrowing.
///
/// # Errors
/// 400 naming `field` and the value.
fn narrow(field: &str, v: Option<f64>) -> Result<Option<f32>, ApiError> {
    match v {
        Some(x) if x.abs() > f64::from(f32::MAX) => Err(ApiError::bad_request(format!(
            "{field} must be a number of magnitude at most {:e}, got {x:e}",
            f32::MAX
        ))),
        Some(x) => Ok(Some(x as f32)),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Parses `body` (JSON text) sent to `endpoint` of a server of model `m`.
    fn req(endpoint: Endpoint, body: &str) -> Result<Request, ApiError> {
        to_engine(&parse_body(body.as_bytes())?, endpoint, "m", None)
    }

    fn chat(body: serde_json::Value) -> Result<Request, ApiError> {
        req(Endpoint::Chat, &body.to_string())
    }

    fn completions(body: serde_json::Value) -> Result<Request, ApiError> {
        req(Endpoint::Completions, &body.to_string())
    }

    /// The 400 message of a refused body.
    fn refused(r: Result<Request, ApiError>) -> String {
        let e = r.expect_err("refused");
        assert_eq!((e.status, e.kind), (400, crate::wire::ErrorKind::InvalidRequestError), "{e}");
        e.message
    }

    #[test]
    fn a_chat_body_becomes_the_engine_request() {
        let r = chat(json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"},
            ],
            "max_completion_tokens": 7, "max_tokens": 99,
            "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": -1,
            "stop": ["\n\n", "END"], "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1,
            "ignore_eos": true, "chat_template_kwargs": {"enable_thinking": false, "other": 1},
            "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none",
            "logprobs": false, "top_logprobs": 0, "n": 1, "best_of": 1, "logit_bias": {}, "suffix": "",
            "response_format": {"type": "text"}, "unknown_field": {"ignored": true},
        }))
        .unwrap();
        let EnginePrompt::Chat(msgs) = &r.prompt else { panic!("not a chat prompt") };
        assert_eq!(msgs.len(), 4);
        assert_eq!((msgs[0].role.as_str(), msgs[0].content.as_str()), ("system", "Be brief."));
        assert_eq!(msgs[1].content, "Hi there");
        assert_eq!((msgs[2].content.as_str(), msgs[2].tool_calls.as_ref().map(Vec::len)), ("", Some(1)));
        assert_eq!(msgs[3].tool_call_id.as_deref(), Some("call_1"));
        assert_eq!(r.max_tokens, Some(7), "max_completion_tokens wins");
        assert_eq!(
            (r.sampler.temperature, r.sampler.top_p, r.sampler.top_k, r.sampler.min_p, r.sampler.seed),
            (0.5, 0.9, 20, 0.05, u64::MAX)
        );
        assert_eq!(
            (r.sampler.presence_penalty, r.sampler.frequency_penalty, r.sampler.repetition_penalty),
            (0.5, 0.25, 1.1)
        );
        assert_eq!(r.stop, ["\n\n", "END"]);
        assert!(r.ignore_eos && r.calls_as_text);
        assert_eq!((r.enable_thinking, r.tools.len(), r.mock_sampled), (Some(false), 1, None));
    }

    #[test]
    fn defaults_are_openai_s() {
        let r = chat(json!({"messages": [{"role": "user"}]})).unwrap();
        let EnginePrompt::Chat(msgs) = &r.prompt else { panic!("not a chat prompt") };
        assert_eq!(msgs[0].content, "", "absent content is empty");
        let d = SamplerOptions::default();
        assert_eq!((r.sampler.temperature, r.sampler.top_p, r.sampler.top_k, r.sampler.seed), (1.0, 1.0, 0, 0));
        assert_eq!(
            (r.sampler.presence_penalty, r.sampler.frequency_penalty),
            (d.presence_penalty, d.frequency_penalty)
        );
        assert_eq!((r.max_tokens, r.stop.len(), r.enable_thinking, r.calls_as_text), (None, 0, None, false));
        let r = chat(json!({"messages": [], "stop": "x", "top_k": -1, "tool_choice": "auto"})).unwrap();
        assert_eq!((r.stop, r.sampler.top_k, r.calls_as_text), (vec!["x".to_string()], 0, false));
        let r = chat(json!({"messages": [], "stop": null, "logprobs": null, "suffix": null})).unwrap();
        assert!(r.stop.is_empty());
    }

    #[test]
    fn completions_prompts_are_text_or_ids() {
        let p = |v: serde_json::Value| completions(json!({"prompt": v})).map(|r| r.prompt);
        assert!(matches!(p(json!("The quick")).unwrap(), EnginePrompt::Text(t) if t == "The quick"));
        assert!(matches!(p(json!(["one"])).unwrap(), EnginePrompt::Text(t) if t == "one"));
        assert!(matches!(p(json!([785, 3974])).unwrap(), EnginePrompt::Ids(ids) if ids == [785, 3974]));
        assert!(matches!(p(json!([4294967295u64])).unwrap(), EnginePrompt::Ids(ids) if ids == [u32::MAX]));
        // The chat endpoint does not read `prompt`, nor the completions one `messages`.
        assert_eq!(refused(chat(json!({"prompt": "x"}))), "`messages` is required");
        assert_eq!(refused(completions(json!({"messages": []}))), "`prompt` is required");
    }

    /// Every refusal of a body, with its message (the field named, and where it is).
    #[test]
    fn bad_bodies_are_refused_naming_the_field() {
        for (what, body, want) in [
            (
                "not JSON",
                r#"{"model": "#.to_string(),
                "the body is not a valid request: model: EOF while parsing a value",
            ),
            (
                "not an object",
                "\"5\"".into(),
                "the body is not a valid request: invalid type: string \"5\", expected struct CompletionRequest",
            ),
            (
                "lone surrogate",
                r#"{"messages": [{"role": "user", "content": "a\ud800b"}]}"#.into(),
                "the body is not valid JSON: messages[0].content: a \\u escape of a UTF-16 surrogate (D800-DFFF) \
                 must be one of a high-low pair; a lone surrogate is not a character (line 1, column",
            ),
            (
                "content of a wrong type",
                json!({"messages": [{"role": "user", "content": 5}]}).to_string(),
                "the body is not a valid request: messages[0].content: invalid type: integer `5`, expected a \
                 string, null, or a list of text parts",
            ),
            (
                "a part without a type",
                json!({"messages": [{"role": "user", "content": [{"text": "x"}]}]}).to_string(),
                "messages[0].content[0]: missing field `type`",
            ),
            (
                "no role",
                json!({"messages": [{"role": "user"}, {"content": "x"}]}).to_string(),
                "the body is not a valid request: messages[1]: missing field `role`",
            ),
            (
                "max_tokens not an integer",
                json!({"messages": [], "max_tokens": "5"}).to_string(),
                "the body is not a valid request: max_tokens: invalid type: string \"5\", expected i64",
            ),
            (
                "stream not a boolean",
                json!({"messages": [], "stream": 1}).to_string(),
                "stream: invalid type: integer `1`, expected a boolean",
            ),
            (
                "stop of a wrong type",
                json!({"messages": [], "stop": 3}).to_string(),
                "stop: invalid type: integer `3`, expected a string or a list of strings",
            ),
            (
                "stop with a number",
                json!({"messages": [], "stop": ["a", 3]}).to_string(),
                "stop[1]: invalid type: integer `3`, expected a string",
            ),
            (
                "prompt an object",
                json!({"prompt": {"a": 1}}).to_string(),
                "prompt: invalid type: map, expected a string, a list of one string, or a list of token ids",
            ),
            (
                "prompt of two strings",
                json!({"prompt": ["a", "b"]}).to_string(),
                "prompt: a list of 2 elements that is not a string, a list of one string, or a list of token ids",
            ),
            ("prompt empty", json!({"prompt": []}).to_string(), "prompt: a list of 0 elements"),
            (
                "prompt id past u32",
                json!({"prompt": [1, 4294967296u64]}).to_string(),
                "prompt[1]: prompt token ids must be below 2^32, got 4294967296",
            ),
            (
                "prompt id negative",
                json!({"prompt": [-1]}).to_string(),
                "prompt[0]: invalid type: integer `-1`, expected a string or a token id",
            ),
            (
                "tool_choice of a wrong type",
                json!({"messages": [], "tool_choice": 1}).to_string(),
                "tool_choice: invalid type: integer `1`, expected \"auto\", \"none\", \"required\" or",
            ),
            (
                "enable_thinking not a boolean",
                json!({"messages": [], "chat_template_kwargs": {"enable_thinking": "yes"}}).to_string(),
                "chat_template_kwargs.enable_thinking: invalid type: string \"yes\", expected a boolean",
            ),
        ] {
            let msg = refused(req(Endpoint::Chat, &body).and(req(Endpoint::Completions, &body)));
            assert!(msg.starts_with(want) || msg.contains(want), "{what}: {msg}");
        }
    }

    /// Every refusal after parsing, with its message.
    #[test]
    fn bad_requests_are_refused_naming_the_field() {
        let base = || json!({"messages": [{"role": "user", "content": "Hi"}]});
        let with = |k: &str, v: serde_json::Value| {
            let mut b = base();
            b[k] = v;
            b
        };
        for (body, want) in [
            (json!({}), "`messages` is required".to_string()),
            (with("n", json!(2)), "n must be 1".into()),
            (with("max_tokens", json!(0)), "max_tokens must be at least 1, got 0".into()),
            (with("max_tokens", json!(-3)), "max_tokens must be at least 1, got -3".into()),
            (with("max_completion_tokens", json!(-1)), "max_tokens must be at least 1, got -1".into()),
            (with("top_k", json!(-2)), "top_k must be >= 0 (or -1 for all), got -2".into()),
            (
                with("temperature", json!(1e300)),
                "temperature must be a number of magnitude at most 3.4028235e38, got 1e300".into(),
            ),
            (
                with("presence_penalty", json!(-1e39)),
                "presence_penalty must be a number of magnitude at most 3.4028235e38, got -1e39".into(),
            ),
            (with("temperature", json!(-1)), "temperature must be a finite number >= 0".into()),
            (with("top_p", json!(0)), "top_p must be in (0, 1], got 0".into()),
            (with("logprobs", json!(true)), "logprobs is not supported by this server".into()),
            (with("logprobs", json!(2)), "logprobs is not supported by this server".into()),
            (with("top_logprobs", json!(3)), "top_logprobs is not supported by this server".into()),
            (with("echo", json!(true)), "echo is not supported by this server".into()),
            (with("best_of", json!(3)), "best_of is not supported by this server".into()),
            (
                with("response_format", json!({"type": "json_object"})),
                "response_format (only {\"type\": \"text\"}) is not supported by this server".into(),
            ),
            (with("logit_bias", json!({"15": 100})), "logit_bias is not supported by this server".into()),
            (with("suffix", json!(" end")), "suffix is not supported by this server".into()),
            (with("tool_choice", json!("required")), "tool_choice (only \"auto\" or \"none\"".into()),
            (
                with("tool_choice", json!({"type": "function", "function": {"name": "f"}})),
                "tool_choice (only \"auto\" or \"none\"".into(),
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
                "messages[0].content[0]: content part of type image_url is not supported (text only)".into(),
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
                "messages[0].content[0]: a text part needs `text`".into(),
            ),
        ] {
            let msg = refused(chat(body.clone()));
            assert!(msg.starts_with(&want), "{body}: {msg}");
        }
    }

    #[test]
    fn another_model_is_404() {
        let e = chat(json!({"model": "gpt-9", "messages": []})).unwrap_err();
        assert_eq!((e.status, e.code), (404, Some("model_not_found")));
        assert_eq!(e.message, "the model `gpt-9` does not exist; this server has `m`");
    }

    #[test]
    fn the_mock_reaches_the_request() {
        let body = parse_body(br#"{"prompt": "x"}"#).unwrap();
        let r = to_engine(&body, Endpoint::Completions, "m", Some(vec![1, 2])).unwrap();
        assert_eq!(r.mock_sampled, Some(vec![1, 2]));
    }
}
