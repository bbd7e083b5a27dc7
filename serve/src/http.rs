//! The HTTP layer of `picchio serve` (axum over hyper's HTTP/1 connections): OpenAI's
//! `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions` and `POST /v1/completions`
//! (streamed as server-sent events ending in `data: [DONE]`, or whole), `GET /health` and
//! `GET /metrics`; request parsing and OpenAI's JSON error shape
//! (`{"error": {"message", "type", "param", "code"}}`) with the matching status, for every error
//! (unknown path, wrong method, body too large by its Content-Length, body too slow) and counted
//! by status in `/metrics`. Generation happens on the worker of [`crate::queue`]; a handler only
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
use tokio::sync::mpsc::UnboundedReceiver;

use crate::answer::Meta;
use crate::api_error::ApiError;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::queue::{Event, Job, Server};
use crate::request::Endpoint;
use crate::wire::{ErrorKind, Health, ModelCard, ModelList, Object};

type St = State<Arc<Server>>;

/// Listens on `host:port` and serves until SIGINT/SIGTERM (see the module doc for what a shutdown
/// does; a second signal exits the process at once with status 130).
///
/// # Errors
/// Installing the signal handlers, binding the address.
pub(crate) async fn serve(server: Arc<Server>, host: IpAddr, port: u16) -> Result<()> {
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
    let listener = tokio::net::TcpListener::bind((host, port))
        .await
        .map_err(|source| Error::Bind { addr: std::net::SocketAddr::from((host, port)).to_string(), source })?;
    let addr = listener.local_addr().map_err(Error::LocalAddr)?;
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
    fn new() -> Result<Signals> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let int = signal(SignalKind::interrupt()).map_err(|source| Error::Signal { signal: "SIGINT", source })?;
            let term = signal(SignalKind::terminate()).map_err(|source| Error::Signal { signal: "SIGTERM", source })?;
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
        Some(n) if n > s.limits.max_body as u64 => reply(&ApiError::invalid(
            413,
            Some("request_too_large"),
            format!(
                "the body is {n} bytes (Content-Length); this server takes at most {} (--max-body)",
                s.limits.max_body
            ),
        )),
        _ => next.run(req).await,
    };
    let status = response.status();
    if status.is_client_error() || status.is_server_error() {
        s.metrics.count_failure(status.as_u16());
    }
    response
}

/// The response of an error answer: its status and OpenAI's error body.
fn reply(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(e.body(None))).into_response()
}

async fn not_found() -> Response {
    reply(&ApiError::invalid(404, Some("not_found"), "no such endpoint"))
}

async fn method_not_allowed() -> Response {
    reply(&ApiError::invalid(405, Some("method_not_allowed"), "this endpoint does not take that method"))
}

async fn health() -> Response {
    Json(Health { status: "ok" }).into_response()
}

async fn metrics(State(s): St) -> Response {
    ([("content-type", "text/plain; version=0.0.4")], s.metrics.render()).into_response()
}

/// `Err(401)` unless the server has no key or `Authorization: Bearer <key>` names it.
fn authorize(s: &Server, headers: &HeaderMap) -> std::result::Result<(), ApiError> {
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
        Some(_) => Err(ApiError::invalid(401, Some("invalid_api_key"), "incorrect API key")),
        None => Err(ApiError::invalid(
            401,
            Some("invalid_api_key"),
            "this server needs an API key: send `Authorization: Bearer <key>`",
        )),
    }
}

async fn models(State(s): St, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return reply(&e);
    }
    Json(ModelList { object: Object::List, data: vec![ModelCard::new(&s.model, s.context)] }).into_response()
}

/// OpenAI's "retrieve model": the model object of the served model, 404 `model_not_found` for any
/// other id.
async fn model(State(s): St, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Err(e) = authorize(&s, &headers) {
        return reply(&e);
    }
    if id != s.model {
        let msg = format!("the model `{id}` does not exist; this server has `{}`", s.model);
        return reply(&ApiError::invalid(404, Some("model_not_found"), msg));
    }
    Json(ModelCard::new(&s.model, s.context)).into_response()
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

/// The body's bytes, or the answer to a body that could not be read: 408 when it stalled past
/// `--body-timeout`, 413 past `--max-body`.
fn body_bytes(s: &Server, bytes: std::result::Result<Bytes, BytesRejection>) -> std::result::Result<Bytes, ApiError> {
    bytes.map_err(|r| {
        if body_timed_out(&r) {
            let msg = format!(
                "the request body stalled for {} s (--body-timeout); send it without pauses",
                s.limits.body_timeout.as_secs()
            );
            return ApiError::invalid(408, Some("request_timeout"), msg);
        }
        let status = r.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            let msg = format!("the body is larger than {} bytes (--max-body)", s.limits.max_body);
            return ApiError::invalid(413, Some("request_too_large"), msg);
        }
        ApiError::invalid(status.as_u16(), None, r.body_text())
    })
}

async fn chat_completions(
    State(s): St,
    headers: HeaderMap,
    bytes: std::result::Result<Bytes, BytesRejection>,
) -> Response {
    handle(s, headers, bytes, Endpoint::Chat).await
}

async fn completions(State(s): St, headers: HeaderMap, bytes: std::result::Result<Bytes, BytesRejection>) -> Response {
    handle(s, headers, bytes, Endpoint::Completions).await
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn handle(
    s: Arc<Server>,
    headers: HeaderMap,
    bytes: std::result::Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
) -> Response {
    match start(&s, &headers, bytes, endpoint) {
        Ok((meta, stream, rx)) => relay(s, meta, stream, rx).await,
        Err(e) => reply(&e),
    }
}

/// Authorizes, parses and queues a request: its answer's [`Meta`], whether it is streamed, and its
/// events.
fn start(
    s: &Server,
    headers: &HeaderMap,
    bytes: std::result::Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
) -> std::result::Result<(Meta, bool, UnboundedReceiver<Event>), ApiError> {
    authorize(s, headers)?;
    let body = crate::request::parse_body(&body_bytes(s, bytes)?)?;
    let request = crate::request::to_engine(&body, endpoint, &s.model, crate::hooks::mock_sampled_ids())?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    s.submit(Job { request, events: tx }).map_err(|r| r.answer())?;
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completions => "cmpl",
    };
    let meta = Meta {
        id: format!("{prefix}-{}", NEXT_ID.fetch_add(1, Ordering::Relaxed)),
        model: s.model.clone(),
        created: unix_now(),
        endpoint,
        include_usage: body.stream_options.is_some_and(|o| o.include_usage),
        token_ids: body.return_token_ids,
    };
    Ok((meta, body.stream, rx))
}

fn thread_stopped() -> ApiError {
    ApiError::server(500, None, "the generation thread stopped")
}

/// Waits for the worker to start the job, then answers: a request refused before generating (a
/// bad prompt, a context overflow) gets a plain error response, not a stream.
async fn relay(s: Arc<Server>, meta: Meta, stream: bool, mut rx: UnboundedReceiver<Event>) -> Response {
    let mut first = Vec::new();
    loop {
        match rx.recv().await {
            Some(Event::Started) => continue,
            Some(Event::Done(Err(e))) => return reply(&e),
            Some(e) => {
                first.push(e);
                break;
            }
            None => return reply(&thread_stopped()),
        }
    }
    if stream {
        self::stream(meta, first, rx, s.metrics.clone()).into_response()
    } else {
        whole(meta, first, rx).await
    }
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
            Some(Event::Done(Err(e))) => return reply(&e),
            Some(_) => continue,
            None => return reply(&thread_stopped()),
        }
    };
    match meta.endpoint {
        Endpoint::Chat => Json(meta.chat_completion(&outcome)).into_response(),
        Endpoint::Completions => Json(meta.text_completion(&outcome)).into_response(),
    }
}

/// A streamed answer: the role chunk (chat), one SSE chunk per delta, then the finish chunk, the
/// usage chunk when asked for, and `data: [DONE]`. The relay task ends when the client goes away
/// (its send fails), which drops the worker's receiver and so stops the generation.
fn stream(meta: Meta, first: Vec<Event>, mut rx: UnboundedReceiver<Event>, metrics: Arc<Metrics>) -> impl IntoResponse {
    let (tx, out) = tokio::sync::mpsc::channel::<std::result::Result<Sse, Infallible>>(16);
    tokio::spawn(async move {
        let send = |data: String| {
            let tx = tx.clone();
            async move { tx.send(Ok(Sse::default().data(data))).await.is_ok() }
        };
        if let Some(c) = meta.role_chunk() {
            if !send(c).await {
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
                    if !send(meta.delta_chunk(&d)).await {
                        return; // the client left: dropping rx stops the generation
                    }
                }
                Event::Done(Err(e)) => {
                    // The status line (200) is out: counted here.
                    metrics.count_failure(e.status);
                    let _ = send(crate::answer::json(&e.body(Some(ErrorKind::ServerError)))).await;
                    break;
                }
                Event::Done(Ok(o)) => {
                    if !send(meta.finish_chunk(&o)).await {
                        return;
                    }
                    if meta.include_usage && !send(meta.usage_chunk(&o)).await {
                        return;
                    }
                    break;
                }
            }
        }
        let _ = send("[DONE]".into()).await;
    });
    SseBody::new(tokio_stream::wrappers::ReceiverStream::new(out))
}
