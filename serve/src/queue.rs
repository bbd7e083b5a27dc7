//! The request queue and the generation worker: one thread owns the model session and its KV
//! cache ([`Engine`]) and takes requests in arrival order from a bounded queue; a request's handler
//! hears what happens to it as [`Event`]s.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use picchio_runtime::chat::engine::{is_bad_request, Delta, Engine, Outcome, Request};

use crate::api_error::ApiError;
use crate::hooks::RequestHooks;
use crate::metrics::Metrics;

/// The HTTP layer's limits.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest request body, bytes (`--max-body`).
    pub max_body: usize,
    /// How long a request body may stall (`--body-timeout`).
    pub body_timeout: Duration,
    /// How long a connection may wait for its next request's head (`--idle-timeout`).
    pub idle_timeout: Duration,
}

/// What the worker tells a request's handler.
pub enum Event {
    /// The request started generating (it left the queue).
    Started,
    /// New text.
    Delta(Delta),
    /// The end: the outcome, or the error answer (400 for bad requests, 500 otherwise, 503 for a
    /// request dropped from the queue by a shutdown).
    Done(Result<Box<Outcome>, ApiError>),
}

/// A queued request.
pub struct Job {
    /// What to run.
    pub request: Request,
    /// Where its events go; when the receiver is gone (the client left) generation stops.
    pub events: tokio::sync::mpsc::UnboundedSender<Event>,
}

/// The handle the HTTP layer holds: the queue's sending end and the figures.
pub struct Server {
    /// The model's name (what `/v1/models` lists and requests must name).
    pub model: String,
    /// Context of the KV cache, tokens.
    pub context: usize,
    /// The API key, when one is required.
    pub api_key: Option<String>,
    /// The queue into the worker.
    pub queue: Mutex<mpsc::SyncSender<Job>>,
    /// Figures.
    pub metrics: Arc<Metrics>,
    /// The HTTP limits.
    pub limits: Limits,
    /// Set by the first SIGINT/SIGTERM: no request starts any more, the running one stops at its
    /// next token, the queued ones are answered 503.
    pub shutting_down: Arc<AtomicBool>,
}

/// Why [`Server::submit`] refused a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The queue is full.
    QueueFull,
    /// The server is shutting down.
    ShuttingDown,
}

/// The 503 message of a request refused or dropped from the queue because the server is shutting
/// down (at submit, or when the worker reaches it).
pub const SHUTTING_DOWN: &str = "the server is shutting down; the request was not run";

impl Refused {
    /// The 503 answer.
    pub fn answer(self) -> ApiError {
        match self {
            Refused::QueueFull => ApiError::server(503, Some("queue_full"), "the request queue is full; retry later"),
            Refused::ShuttingDown => ApiError::server(503, Some("server_shutting_down"), SHUTTING_DOWN),
        }
    }
}

impl Server {
    /// Queues `job`, unless the queue is full or the server is shutting down.
    ///
    /// # Errors
    /// [`Refused`] says which.
    pub fn submit(&self, job: Job) -> Result<(), Refused> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(Refused::ShuttingDown);
        }
        let q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        self.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
        match q.try_send(job) {
            Ok(()) => Ok(()),
            Err(_) => {
                self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
                self.metrics.rejected.fetch_add(1, Ordering::Relaxed);
                Err(Refused::QueueFull)
            }
        }
    }
}

/// Runs queued jobs one at a time on `engine` until the queue's senders are gone. Once
/// `shutting_down` is set, the running job stops at its next token (or prefill chunk) and every job
/// still queued is answered 503 without running.
pub(crate) fn worker(
    mut engine: Engine,
    jobs: mpsc::Receiver<Job>,
    metrics: Arc<Metrics>,
    shutting_down: Arc<AtomicBool>,
) {
    while let Ok(job) = jobs.recv() {
        metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
        if shutting_down.load(Ordering::SeqCst) {
            let _ = job.events.send(Event::Done(Err(Refused::ShuttingDown.answer())));
            continue;
        }
        if job.events.send(Event::Started).is_err() {
            metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            continue; // the client left while waiting
        }
        let mut gone = false;
        // The client's receiver is dropped when it disconnects: asked before every prefill chunk
        // and every token, so a long prompt is not prefilled to the end for nobody.
        let left = || job.events.is_closed();
        let stop = || left() || shutting_down.load(Ordering::SeqCst);
        let hooks = RequestHooks::default();
        metrics.running.store(1, Ordering::Relaxed);
        let result = engine.run(
            &job.request,
            &mut |d| {
                if job.events.send(Event::Delta(d.clone())).is_err() {
                    gone = true;
                    return ControlFlow::Break(());
                }
                hooks.after_delta(&stop);
                ControlFlow::Continue(())
            },
            &|| {
                hooks.before_check(&stop);
                stop()
            },
        );
        metrics.running.store(0, Ordering::Relaxed);
        gone |= left();
        metrics.requests.fetch_add(1, Ordering::Relaxed);
        let done = match result {
            Ok(o) => {
                let st = &o.turn.stats;
                metrics.prompt_tokens.fetch_add(st.prompt_tokens as u64, Ordering::Relaxed);
                metrics.cached_tokens.fetch_add(o.turn.cached_tokens as u64, Ordering::Relaxed);
                metrics.completion_tokens.fetch_add(o.turn.completion_tokens() as u64, Ordering::Relaxed);
                metrics.expert_hits.fetch_add(st.cache_hits, Ordering::Relaxed);
                metrics.expert_misses.fetch_add(st.cache_misses, Ordering::Relaxed);
                metrics.bytes_read.fetch_add(st.bytes_read, Ordering::Relaxed);
                metrics.last_tok_s.store(st.decode_tok_s.to_bits(), Ordering::Relaxed);
                if gone {
                    metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    if o.turn.completion_tokens() == 0 {
                        metrics.cancelled_in_prefill.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Ok(Box::new(o))
            }
            Err(e) => {
                // Counted by status where the HTTP layer answers it.
                let message = picchio_core::error::chain(&e).to_string();
                if is_bad_request(&e) {
                    let code = match &e {
                        picchio_runtime::Error::ContextOverflow { .. } => Some("context_length_exceeded"),
                        _ => None,
                    };
                    Err(ApiError::invalid(400, code, message))
                } else {
                    tracing::error!("request failed: {message}");
                    Err(ApiError::server(500, None, message))
                }
            }
        };
        let _ = job.events.send(Event::Done(done));
    }
}
