//! Picchio's OpenAI-compatible HTTP server (`picchio serve`) over one model: `GET /v1/models`,
//! `GET /v1/models/{id}`, `POST /v1/chat/completions` and `POST /v1/completions` (streamed as
//! server-sent events or whole), `GET /health` and `GET /metrics`.
//!
//! A request goes: [`http`] reads the body (limits, timeouts, API key) → [`request`] parses it into
//! the typed [`wire::CompletionRequest`] (errors name the field's path) and checks it into the
//! engine's [`picchio_runtime::chat::engine::Request`] → [`queue`] queues it for the one
//! generation thread, which owns the model session and its KV cache and runs requests in arrival
//! order → the thread's events come back to the handler, which [`answer`] turns into OpenAI's
//! answer (whole, or chunk by chunk) → [`metrics`] counts it. Every error is OpenAI's error body
//! ([`ApiError`]) with the matching status.
//!
//! The test hooks ([`hooks`]) are compiled only with the `test-hooks` feature.
#![deny(missing_docs)]

pub mod answer;
pub mod api_error;
pub mod error;
pub mod hooks;
mod http;
pub mod metrics;
pub mod queue;
pub mod request;
pub mod wire;

use std::net::IpAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc, Mutex};

use picchio_runtime::chat::engine::Engine;

pub use api_error::ApiError;
pub use error::{Error, Result};
pub use queue::Limits;

/// The longest body and idle timeouts: one day, in seconds. (A deadline far past it overflows the
/// clock's instant arithmetic inside the HTTP server: 2^64 − 1 seconds panicked on every
/// connection.)
pub const MAX_TIMEOUT_S: u64 = 86_400;

/// How to serve.
#[derive(Clone, Debug)]
pub struct Options {
    /// Address to listen on.
    pub host: IpAddr,
    /// TCP port (0 picks a free one; the address is printed on stderr).
    pub port: u16,
    /// Require `Authorization: Bearer K` on /v1/ requests.
    pub api_key: Option<String>,
    /// Requests that may wait while one runs (at least 1); more get 503.
    pub queue: usize,
    /// Body size and connection timeouts.
    pub limits: Limits,
}

/// Serves `engine` until SIGINT/SIGTERM: the first signal stops accepting, stops the running
/// generation at its next token, answers the queued requests 503 and lets the open connections
/// finish their response; a second one exits the process at once with status 130. Prints
/// `picchio serve: listening on http://ADDR` on stderr once it accepts connections. The engine (and
/// so its store: an `nvme:` controller is shut down cleanly) is dropped before this returns.
///
/// # Errors
/// Starting the generation thread or the async runtime, installing the signal handlers, binding
/// the address.
pub fn serve(engine: Engine, options: &Options) -> Result<()> {
    let (model, context) = (engine.name.clone(), engine.context());
    let (tx, rx) = mpsc::sync_channel(options.queue);
    let metrics = Arc::new(metrics::Metrics::default());
    let shutting_down = Arc::new(AtomicBool::new(false));
    let (m, sd) = (metrics.clone(), shutting_down.clone());
    let worker = std::thread::Builder::new()
        .name("picchio-generate".into())
        .spawn(move || queue::worker(engine, rx, m, sd))
        .map_err(Error::Thread)?;
    let server = Arc::new(queue::Server {
        model,
        context,
        api_key: options.api_key.clone(),
        queue: Mutex::new(tx),
        metrics,
        limits: options.limits,
        shutting_down,
    });
    let served = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(Error::Runtime)
        .and_then(|rt| {
            let r = rt.block_on(http::serve(server.clone(), options.host, options.port));
            drop(rt);
            r
        });
    // Dropping the queue's last sender ends the worker, which drops the session.
    drop(server);
    let _ = worker.join();
    served
}
