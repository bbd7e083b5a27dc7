//! The HTTP layer of `picchio serve` (axum over hyper's HTTP/1 connections): OpenAI's
//! `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions` and `POST /v1/completions`
//! (streamed as server-sent events ending in `data: [DONE]`, or whole), `GET /health` and
//! `GET /metrics`; request parsing and OpenAI's JSON error shape
//! (`{"error": {"message", "type", "param", "code"}}`) with the matching status, for every error
//! (unknown path, wrong method, body too large by its Content-Length, body too slow) and counted
//! by status in `/metrics`. Generation happens on the worker of [`super::serve`]; a handler only
//! queues a job and relays its events, and when the client goes away the event channel closes,
//! which stops the generation.
//!
//! Connections: hyper's HTTP/1 header-read timeout closes a connection that sends no (complete)
//! request head within `--idle-timeout` (idle keep-alive connections included), tower-http's
//! request-body timeout answers 408 when a body stalls for `--body-timeout`. The first SIGINT or
//! SIGTERM stops accepting, stops the running generation at its next token, answers the queued
//! requests 503 and lets the open connections finish their response; a second one exits at once.

use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as Sse, Sse as SseBody};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use picchio_runtime::chat::engine::{FinishReason, Outcome, Prompt, Request};
use picchio_runtime::chat::{Message, TemplateValue, ToolCall};
use picchio_runtime::model::sampler::SamplerOptions;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use super::serve::{Event, Failure, Job, Refused, Server};

type St = State<Arc<Server>>;

/// Listens on `host:port` and serves until SIGINT/SIGTERM (see the module doc for what a shutdown
/// does; a second signal exits the process at once with status 130).
///
/// # Errors
/// Binding the address.
pub async fn serve(server: Arc<Server>, host: IpAddr, port: u16) -> anyhow::Result<()> {
    let limits = server.limits;
    let app = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limits.max_body))
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(limits.body_timeout))
        .layer(axum::middleware::from_fn_with_state(server.clone(), http_layer))
        .with_state(server.clone());
    // Install the signal handlers before announcing the address, so a signal sent once the line
    // is out is never the default action (death).
    let mut signals = Signals::new()?;
    let listener =
        tokio::net::TcpListener::bind((host, port)).await.map_err(|e| anyhow::anyhow!("binding {host}:{port}: {e}"))?;
    let addr = listener.local_addr()?;
    if !host.is_loopback() && server.api_key.is_none() {
        eprintln!(
            "picchio serve: warning: listening on {addr}, which is not a loopback address, without an API key: \
             anyone who can reach it can use the model; set --api-key or $PICCHIO_API_KEY (or --host 127.0.0.1)"
        );
    }
    // Tests and scripts read this line to find a --port 0 server.
    eprintln!("picchio serve: listening on http://{addr} (OpenAI API under /v1)");
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(limits.idle_timeout);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // Out of file descriptors and the like: the listener stays, the next
                        // accept may succeed.
                        tracing::warn!("accepting a connection: {e}");
                        continue;
                    }
                };
                let service = hyper_util::service::TowerToHyperService::new(app.clone());
                let conn = graceful.watch(http.serve_connection(hyper_util::rt::TokioIo::new(stream), service));
                let metrics = server.metrics.clone();
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!("connection: {e}");
                        // A request hyper refused before picchio saw it, with an answer of its own.
                        if let Some(status) = parse_error_status(&e) {
                            metrics.count_failure(status);
                        }
                    }
                });
            }
            () = signals.next() => break,
        }
    }
    drop(listener);
    server.shutting_down.store(true, Ordering::SeqCst);
    eprintln!(
        "picchio serve: shutting down: the running request stops at its next token, queued ones get 503 \
         (interrupt again to exit at once)"
    );
    tokio::spawn(async move {
        signals.next().await;
        eprintln!("picchio serve: interrupted again: exiting now");
        std::process::exit(130);
    });
    graceful.shutdown().await;
    Ok(())
}

/// The status hyper's HTTP/1 server answered a request it could not parse with (hyper
/// `proto::h1::role::Server::on_error`): 431 for a head over its buffer, 414 for a URI too long, 400
/// for a bad method, URI, version or header; `None` for the errors it sends nothing for (an HTTP/2
/// preface, an internal error) and every error that is not a parse error.
fn parse_error_status(e: &hyper::Error) -> Option<u16> {
    if !e.is_parse() || e.is_parse_status() || e.is_parse_version_h2() {
        return None;
    }
    let text = e.to_string();
    if e.is_parse_too_large() {
        return Some(if text.contains("URI") { 414 } else { 431 });
    }
    (!text.contains("internal error")).then_some(400)
}

/// SIGINT (Ctrl-C) and SIGTERM.
struct Signals {
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Signals> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let int =
                signal(SignalKind::interrupt()).map_err(|e| anyhow::anyhow!("installing the SIGINT handler: {e}"))?;
            let term =
                signal(SignalKind::terminate()).map_err(|e| anyhow::anyhow!("installing the SIGTERM handler: {e}"))?;
            Ok(Signals { int, term })
        }
        #[cfg(not(unix))]
        Ok(Signals {})
    }

    /// The next signal.
    async fn next(&mut self) {
        #[cfg(unix)]
        tokio::select! { _ = self.int.recv() => {}, _ = self.term.recv() => {} }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Around every request: a body whose Content-Length exceeds `--max-body` is refused 413 from the
/// header, before it is read; every response with an error status is counted by status.
async fn http_layer(State(s): St, req: axum::extract::Request, next: Next) -> Response {
    /// Counts the request in progress until its response starts (or the connection drops it).
    struct InProgress<'a>(&'a AtomicUsize);
    impl Drop for InProgress<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::Relaxed);
        }
    }
    s.metrics.http_in_progress.fetch_add(1, Ordering::Relaxed);
    let _in_progress = InProgress(&s.metrics.http_in_progress);
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok());
    let response = match declared {
        Some(n) if n > s.limits.max_body as u64 => error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            Some("request_too_large"),
            format!(
                "the body is {n} bytes (Content-Length); this server takes at most {} (--max-body)",
                s.limits.max_body
            ),
        ),
        _ => next.run(req).await,
    };
    let status = response.status();
    if status.is_client_error() || status.is_server_error() {
        s.metrics.count_failure(status.as_u16());
    }
    response
}

/// An OpenAI-shaped error response.
fn error(status: StatusCode, kind: &str, code: Option<&str>, message: impl Into<String>) -> Response {
    let body = json!({"error": {"message": message.into(), "type": kind, "param": null, "code": code}});
    (status, Json(body)).into_response()
}

fn bad_request(message: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", None, message)
}

async fn not_found() -> Response {
    error(StatusCode::NOT_FOUND, "invalid_request_error", Some("not_found"), "no such endpoint")
}

async fn method_not_allowed() -> Response {
    error(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        Some("method_not_allowed"),
        "this endpoint does not take that method",
    )
}

async fn health() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

async fn metrics(State(s): St) -> Response {
    ([("content-type", "text/plain; version=0.0.4")], s.metrics.render()).into_response()
}

/// `Err(401)` unless the server has no key or `Authorization: Bearer <key>` names it.
#[allow(clippy::result_large_err)]
fn authorize(s: &Server, headers: &HeaderMap) -> Result<(), Response> {
    let Some(key) = &s.api_key else { return Ok(()) };
    // The scheme is case-insensitive (RFC 9110 §11.1): `bearer KEY` is the same as `Bearer KEY`.
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, k)| k.trim());
    match given {
        Some(g) if g == key => Ok(()),
        Some(_) => {
            Err(error(StatusCode::UNAUTHORIZED, "invalid_request_error", Some("invalid_api_key"), "incorrect API key"))
        }
        None => Err(error(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            Some("invalid_api_key"),
            "this server needs an API key: send `Authorization: Bearer <key>`",
        )),
    }
}

async fn models(State(s): St, headers: HeaderMap) -> Response {
    if let Err(r) = authorize(&s, &headers) {
        return r;
    }
    Json(json!({"object": "list", "data": [model_card(&s)]})).into_response()
}

/// OpenAI's "retrieve model": the model object of the served model, 404 `model_not_found` for any
/// other id.
async fn model(State(s): St, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Err(r) = authorize(&s, &headers) {
        return r;
    }
    if id != s.model {
        let msg = format!("the model `{id}` does not exist; this server has `{}`", s.model);
        return error(StatusCode::NOT_FOUND, "invalid_request_error", Some("model_not_found"), msg);
    }
    Json(model_card(&s)).into_response()
}

fn model_card(s: &Server) -> Value {
    json!({"id": s.model, "object": "model", "created": 0, "owned_by": "picchio", "context_length": s.context})
}

/// The fields of both endpoints' bodies that picchio reads (others are ignored, as OpenAI-compatible
/// servers do).
#[derive(Deserialize)]
struct Body {
    model: Option<String>,
    messages: Option<Vec<WireMessage>>,
    prompt: Option<Value>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    seed: Option<i64>,
    stop: Option<Value>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    repetition_penalty: Option<f64>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    ignore_eos: bool,
    /// vLLM's extension: return the prompt's and the answer's token ids.
    #[serde(default)]
    return_token_ids: bool,
    /// vLLM's `chat_template_kwargs` (`enable_thinking` is read).
    chat_template_kwargs: Option<Value>,
    /// Function tools for the chat format, kept with their key order (a template writes them with
    /// `tojson`, harmony as TypeScript types).
    tools: Option<Vec<TemplateValue>>,
    n: Option<i64>,
    /// Read only to refuse them: a client that asks for these would get an answer without them.
    logprobs: Option<Value>,
    top_logprobs: Option<Value>,
    #[serde(default)]
    echo: bool,
    best_of: Option<i64>,
    response_format: Option<Value>,
    logit_bias: Option<Value>,
    suffix: Option<Value>,
    tool_choice: Option<Value>,
}

impl Body {
    /// The first field asked for that this server does not do (`None`: none), so the request is
    /// refused instead of answered without it: logprobs, top_logprobs, echo, best_of > 1, a
    /// response_format other than text, a non-empty logit_bias or suffix, and a tool_choice that
    /// forces a call ("required" or a named function).
    fn unsupported(&self) -> Option<&'static str> {
        let asked = |v: &Option<Value>| match v {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Number(n)) => n.as_f64() != Some(0.0),
            Some(_) => true,
        };
        if asked(&self.logprobs) {
            Some("logprobs")
        } else if asked(&self.top_logprobs) {
            Some("top_logprobs")
        } else if self.echo {
            Some("echo")
        } else if self.best_of.is_some_and(|b| b != 1) {
            Some("best_of")
        } else if self.response_format.as_ref().is_some_and(|f| f.get("type").and_then(Value::as_str) != Some("text")) {
            Some("response_format (only {\"type\": \"text\"})")
        } else if self
            .logit_bias
            .as_ref()
            .is_some_and(|b| !(b.is_null() || b.as_object().is_some_and(|m| m.is_empty())))
        {
            Some("logit_bias")
        } else if self.suffix.as_ref().is_some_and(|x| !(x.is_null() || x.as_str() == Some(""))) {
            Some("suffix")
        } else if self
            .tool_choice
            .as_ref()
            .is_some_and(|c| !(c.is_null() || matches!(c.as_str(), Some("auto" | "none"))))
        {
            Some("tool_choice (only \"auto\" or \"none\": the model decides whether to call a tool)")
        } else {
            None
        }
    }
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize)]
struct WireMessage {
    role: String,
    #[serde(default)]
    content: Value,
    reasoning_content: Option<String>,
    tool_calls: Option<Vec<ToolCall>>,
    tool_call_id: Option<String>,
    name: Option<String>,
}

/// A message's `content`: a string, null, or a list of parts of which the `text` parts count.
fn content_text(i: usize, v: &Value) -> Result<String, String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    (kind, _) => {
                        return Err(format!(
                            "messages[{i}]: content part of type {} is not supported (text only)",
                            kind.unwrap_or("?")
                        ))
                    }
                }
            }
            Ok(out)
        }
        _ => Err(format!("messages[{i}].content must be a string or a list of text parts")),
    }
}

/// The engine request of a body, or the 400/404 response explaining why not.
#[allow(clippy::result_large_err)]
fn parse(s: &Server, bytes: Result<Bytes, BytesRejection>, chat: bool) -> Result<(Request, Body), Response> {
    let bytes = bytes.map_err(|r| {
        if body_timed_out(&r) {
            let msg = format!(
                "the request body stalled for {} s (--body-timeout); send it without pauses",
                s.limits.body_timeout.as_secs()
            );
            return error(StatusCode::REQUEST_TIMEOUT, "invalid_request_error", Some("request_timeout"), msg);
        }
        let status = r.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            let msg = format!("the body is larger than {} bytes (--max-body)", s.limits.max_body);
            return error(status, "invalid_request_error", Some("request_too_large"), msg);
        }
        error(status, "invalid_request_error", None, r.body_text())
    })?;
    let body: Body = parse_body(&bytes).map_err(bad_request)?;
    if let Some(m) = &body.model {
        if *m != s.model {
            let msg = format!("the model `{m}` does not exist; this server has `{}`", s.model);
            return Err(error(StatusCode::NOT_FOUND, "invalid_request_error", Some("model_not_found"), msg));
        }
    }
    if body.n.is_some_and(|n| n != 1) {
        return Err(bad_request("n must be 1"));
    }
    if let Some(field) = body.unsupported() {
        return Err(bad_request(format!("{field} is not supported by this server")));
    }
    let max_tokens = match body.max_completion_tokens.or(body.max_tokens) {
        Some(n) if n < 1 => return Err(bad_request(format!("max_tokens must be at least 1, got {n}"))),
        Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        None => None,
    };
    let prompt = if chat {
        let Some(msgs) = &body.messages else { return Err(bad_request("`messages` is required")) };
        let mut out = Vec::with_capacity(msgs.len());
        for (i, m) in msgs.iter().enumerate() {
            let content = content_text(i, &m.content).map_err(bad_request)?;
            out.push(Message {
                role: m.role.clone(),
                content,
                reasoning_content: m.reasoning_content.clone(),
                tool_calls: m.tool_calls.clone(),
                tool_call_id: m.tool_call_id.clone(),
                name: m.name.clone(),
            });
        }
        Prompt::Chat(out)
    } else {
        match &body.prompt {
            Some(Value::String(t)) => Prompt::Text(t.clone()),
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                Prompt::Text(a[0].as_str().unwrap_or("").into())
            }
            Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_u64) => {
                let ids: Option<Vec<u32>> = a.iter().map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok())).collect();
                Prompt::Ids(ids.ok_or_else(|| bad_request("prompt token ids must be below 2^32"))?)
            }
            Some(_) => {
                return Err(bad_request("`prompt` must be a string, a list of one string, or a list of token ids"))
            }
            None => return Err(bad_request("`prompt` is required")),
        }
    };
    let stop = match &body.stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(t)) => vec![t.clone()],
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect()
        }
        Some(_) => return Err(bad_request("`stop` must be a string or a list of strings")),
    };
    let top_k = match body.top_k {
        Some(k) if k < -1 => return Err(bad_request(format!("top_k must be >= 0 (or -1 for all), got {k}"))),
        Some(k) if k <= 0 => 0,
        Some(k) => usize::try_from(k).unwrap_or(usize::MAX),
        None => 0,
    };
    let d = SamplerOptions::default();
    let sampler = SamplerOptions {
        // OpenAI's default temperature is 1.
        temperature: narrow("temperature", body.temperature).map_err(bad_request)?.unwrap_or(1.0),
        top_p: narrow("top_p", body.top_p).map_err(bad_request)?.unwrap_or(1.0),
        seed: body.seed.map_or(0, |s| s as u64),
        top_k,
        min_p: narrow("min_p", body.min_p).map_err(bad_request)?.unwrap_or(0.0),
        repetition_penalty: narrow("repetition_penalty", body.repetition_penalty).map_err(bad_request)?.unwrap_or(1.0),
        presence_penalty: narrow("presence_penalty", body.presence_penalty)
            .map_err(bad_request)?
            .unwrap_or(d.presence_penalty),
        frequency_penalty: narrow("frequency_penalty", body.frequency_penalty)
            .map_err(bad_request)?
            .unwrap_or(d.frequency_penalty),
    };
    sampler.check().map_err(bad_request)?;
    let enable_thinking =
        body.chat_template_kwargs.as_ref().and_then(|k| k.get("enable_thinking")).and_then(Value::as_bool);
    let tools = body.tools.clone().unwrap_or_default();
    let req = Request {
        prompt,
        max_tokens,
        sampler,
        stop,
        ignore_eos: body.ignore_eos,
        enable_thinking,
        tools,
        // "none": the model is not to call; a call it writes anyway is text (vLLM does the same).
        calls_as_text: body.tool_choice.as_ref().and_then(Value::as_str) == Some("none"),
        mock_sampled: mock_sampled_ids(),
    };
    Ok((req, body))
}

/// **A mock, for tests only:** `PICCHIO_SERVE_TEST_MOCK_SAMPLED_IDS=ID,ID,...` makes every
/// request generate those ids instead of sampling them ([`Request::mock_sampled`]); detokenizing,
/// tool-call parsing, the HTTP answer and the client all run for real. A test uses it to have a
/// random-weight fixture model answer with, e.g., a tool call. Unset (every real run), `None`.
fn mock_sampled_ids() -> Option<Vec<u32>> {
    static IDS: std::sync::OnceLock<Option<Vec<u32>>> = std::sync::OnceLock::new();
    IDS.get_or_init(|| {
        let v = std::env::var("PICCHIO_SERVE_TEST_MOCK_SAMPLED_IDS").ok()?;
        let ids: Vec<u32> = v.split(',').filter_map(|t| t.trim().parse().ok()).collect();
        eprintln!(
            "picchio serve: PICCHIO_SERVE_TEST_MOCK_SAMPLED_IDS: a test mock: {} ids replace sampling",
            ids.len()
        );
        Some(ids)
    })
    .clone()
}

/// The request body as [`Body`].
///
/// # Errors
/// What is wrong, where: the field's path when the JSON got that far (`messages[0].content: invalid
/// type: ...`), serde's line and column, and for a `\uD800`-`\uDFFF` escape not in a UTF-16
/// surrogate pair (serde says "lone leading surrogate" or "unexpected end of hex escape") what JSON
/// text requires.
fn parse_body(bytes: &[u8]) -> Result<Body, String> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.inner();
        let at = if path == "." { String::new() } else { format!("{path}: ") };
        let text = inner.to_string();
        if inner.is_syntax() && (text.contains("surrogate") || text.contains("hex escape")) {
            return format!(
                "the body is not valid JSON: {at}a \\u escape of a UTF-16 surrogate (D800-DFFF) must be one of a \
                 high-low pair; a lone surrogate is not a character (line {}, column {})",
                inner.line(),
                inner.column()
            );
        }
        format!("the body is not a valid request: {at}{text}")
    })
}

/// A sampling parameter as the sampler takes it (`f32`), read from the request as `f64` so that a
/// value past `f32`'s range is refused as the client wrote it (`temperature: 1e300`), not reported
/// as `inf` after the narrowing.
///
/// # Errors
/// The message (answered 400) naming `field` and the value.
fn narrow(field: &str, v: Option<f64>) -> Result<Option<f32>, String> {
    match v {
        Some(x) if x.abs() > f64::from(f32::MAX) => {
            Err(format!("{field} must be a number of magnitude at most {:e}, got {x:e}", f32::MAX))
        }
        Some(x) => Ok(Some(x as f32)),
        None => Ok(None),
    }
}

/// Whether reading the body failed because it stalled (tower-http's body timeout).
fn body_timed_out(r: &BytesRejection) -> bool {
    let mut e: Option<&(dyn std::error::Error + 'static)> = Some(r);
    while let Some(x) = e {
        if x.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        e = x.source();
    }
    false
}

async fn chat_completions(State(s): St, headers: HeaderMap, bytes: Result<Bytes, BytesRejection>) -> Response {
    handle(s, headers, bytes, true).await
}

async fn completions(State(s): St, headers: HeaderMap, bytes: Result<Bytes, BytesRejection>) -> Response {
    handle(s, headers, bytes, false).await
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn handle(s: Arc<Server>, headers: HeaderMap, bytes: Result<Bytes, BytesRejection>, chat: bool) -> Response {
    if let Err(r) = authorize(&s, &headers) {
        return r;
    }
    let (request, body) = match parse(&s, bytes, chat) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    match s.submit(Job { request, events: tx }) {
        Ok(()) => {}
        Err(Refused::QueueFull) => {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("queue_full"),
                "the request queue is full; retry later",
            )
        }
        Err(Refused::ShuttingDown) => {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("server_shutting_down"),
                super::serve::SHUTTING_DOWN,
            )
        }
    }
    let id = format!("{}-{}", if chat { "chatcmpl" } else { "cmpl" }, NEXT_ID.fetch_add(1, Ordering::Relaxed));
    let meta = Meta {
        id,
        model: s.model.clone(),
        created: unix_now(),
        chat,
        include_usage: body.stream_options.as_ref().is_some_and(|o| o.include_usage),
        token_ids: body.return_token_ids,
    };
    // Wait for the worker to start the job; a request refused before generating (a bad prompt, a
    // context overflow) gets a plain error response, not a stream.
    let mut first = Vec::new();
    loop {
        match rx.recv().await {
            Some(Event::Started) => continue,
            Some(Event::Done(Err(f))) => return failure(&f),
            Some(e) => {
                first.push(e);
                break;
            }
            None => {
                return error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, "the generation thread stopped")
            }
        }
    }
    if body.stream {
        stream(meta, first, rx, s.metrics.clone()).into_response()
    } else {
        whole(meta, first, rx).await
    }
}

fn failure(f: &Failure) -> Response {
    let status = StatusCode::from_u16(f.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let kind = if f.status == 400 { "invalid_request_error" } else { "server_error" };
    error(status, kind, f.code, f.message.clone())
}

struct Meta {
    id: String,
    model: String,
    created: u64,
    chat: bool,
    include_usage: bool,
    token_ids: bool,
}

/// OpenAI's `finish_reason`; a generation the server stopped (a shutdown; a client that left never
/// reads it) is vLLM's `abort`.
fn finish_reason(o: &Outcome) -> &'static str {
    match o.finish {
        FinishReason::Length => "length",
        FinishReason::Stop => "stop",
        FinishReason::Cancelled => "abort",
        FinishReason::ToolCalls => "tool_calls",
    }
}

/// OpenAI's `tool_calls` entries for `calls`; streamed ones carry their `index`.
fn tool_calls_json(calls: &[picchio_runtime::chat::engine::ToolCall], streamed: bool) -> Value {
    Value::Array(
        calls
            .iter()
            .map(|c| {
                let mut v = json!({
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.call.name, "arguments": c.call.arguments},
                });
                if streamed {
                    v["index"] = json!(c.index);
                }
                v
            })
            .collect(),
    )
}

fn usage(o: &Outcome) -> Value {
    let (p, c) = (o.prompt_ids.len(), o.turn.completion_tokens());
    json!({
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": o.turn.cached_tokens},
    })
}

fn answer_ids(o: &Outcome) -> Vec<u32> {
    o.turn.tokens.iter().copied().chain(o.turn.stop_id).collect()
}

/// A non-streamed answer: collects the events to the end.
async fn whole(meta: Meta, first: Vec<Event>, mut rx: UnboundedReceiver<Event>) -> Response {
    let mut pending = first.into_iter();
    let outcome = loop {
        let e = match pending.next() {
            Some(e) => Some(e),
            None => rx.recv().await,
        };
        match e {
            Some(Event::Done(Ok(o))) => break o,
            Some(Event::Done(Err(f))) => return failure(&f),
            Some(_) => continue,
            None => {
                return error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, "the generation thread stopped")
            }
        }
    };
    let o = &*outcome;
    let mut choice = if meta.chat {
        let mut msg = json!({"role": "assistant", "content": o.content});
        if !o.reasoning.is_empty() {
            msg["reasoning_content"] = json!(o.reasoning);
        }
        if !o.tool_calls.is_empty() {
            msg["tool_calls"] = tool_calls_json(&o.tool_calls, false);
            if o.content.is_empty() {
                msg["content"] = Value::Null;
            }
        }
        json!({"index": 0, "message": msg, "finish_reason": finish_reason(o), "logprobs": null})
    } else {
        json!({"index": 0, "text": o.content, "finish_reason": finish_reason(o), "logprobs": null})
    };
    let mut body = json!({
        "id": meta.id,
        "object": if meta.chat { "chat.completion" } else { "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "usage": usage(o),
    });
    if meta.token_ids {
        choice["token_ids"] = json!(answer_ids(o));
        body["prompt_token_ids"] = json!(o.prompt_ids);
    }
    body["choices"] = json!([choice]);
    Json(body).into_response()
}

/// A streamed answer: one SSE chunk per delta, then the finish chunk, the usage chunk when asked
/// for, and `data: [DONE]`. The relay task ends when the client goes away (its send fails), which
/// drops the worker's receiver and so stops the generation.
fn stream(
    meta: Meta,
    first: Vec<Event>,
    mut rx: UnboundedReceiver<Event>,
    metrics: Arc<super::serve::Metrics>,
) -> impl IntoResponse {
    let (tx, out) = tokio::sync::mpsc::channel::<Result<Sse, Infallible>>(16);
    tokio::spawn(async move {
        let chunk = |choice: Value, usage: Option<Value>| {
            let mut v = json!({
                "id": meta.id,
                "object": if meta.chat { "chat.completion.chunk" } else { "text_completion" },
                "created": meta.created,
                "model": meta.model,
                "choices": if choice.is_null() { json!([]) } else { json!([choice]) },
            });
            if let Some(u) = usage {
                v["usage"] = u;
            }
            Ok(Sse::default().data(v.to_string()))
        };
        if meta.chat {
            let c = json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null});
            if tx.send(chunk(c, None)).await.is_err() {
                return;
            }
        }
        let mut pending = first.into_iter();
        loop {
            let e = match pending.next() {
                Some(e) => Some(e),
                None => rx.recv().await,
            };
            let Some(e) = e else { return };
            match e {
                Event::Started => {}
                Event::Delta(d) => {
                    let c = if meta.chat {
                        let mut delta = json!({});
                        if !d.content.is_empty() {
                            delta["content"] = json!(d.content);
                        }
                        if !d.reasoning.is_empty() {
                            delta["reasoning_content"] = json!(d.reasoning);
                        }
                        if !d.tool_calls.is_empty() {
                            delta["tool_calls"] = tool_calls_json(&d.tool_calls, true);
                        }
                        json!({"index": 0, "delta": delta, "finish_reason": null})
                    } else {
                        json!({"index": 0, "text": d.content, "finish_reason": null})
                    };
                    if tx.send(chunk(c, None)).await.is_err() {
                        return; // the client left: dropping rx stops the generation
                    }
                }
                Event::Done(Err(f)) => {
                    // The status line (200) is out: counted here.
                    metrics.count_failure(f.status);
                    let v =
                        json!({"error": {"message": f.message, "type": "server_error", "param": null, "code": f.code}});
                    let _ = tx.send(Ok(Sse::default().data(v.to_string()))).await;
                    break;
                }
                Event::Done(Ok(o)) => {
                    let mut c = if meta.chat {
                        json!({"index": 0, "delta": {}, "finish_reason": finish_reason(&o)})
                    } else {
                        json!({"index": 0, "text": "", "finish_reason": finish_reason(&o)})
                    };
                    if meta.token_ids {
                        c["token_ids"] = json!(answer_ids(&o));
                    }
                    if tx.send(chunk(c, None)).await.is_err() {
                        return;
                    }
                    if meta.include_usage && tx.send(chunk(Value::Null, Some(usage(&o)))).await.is_err() {
                        return;
                    }
                    break;
                }
            }
        }
        let _ = tx.send(Ok(Sse::default().data("[DONE]"))).await;
    });
    SseBody::new(tokio_stream::wrappers::ReceiverStream::new(out))
}
