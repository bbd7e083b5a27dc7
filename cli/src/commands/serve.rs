//! `picchio serve`: an OpenAI-compatible HTTP server over one model. This file is the process
//! side: options, the generation worker (one thread owning the model session and its KV cache,
//! taking requests in arrival order from a bounded queue) and the figures `/metrics` shows; the
//! HTTP layer is [`super::serve_http`], the generation itself the runtime's
//! [`picchio_runtime::chat::engine::Engine`].

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use picchio_runtime::chat::engine::{is_bad_request, Delta, Engine, Outcome, Request};

/// Options of `picchio serve`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: super::model_args::ModelArgs,
    /// Address to listen on (loopback by default: give 0.0.0.0 to serve the network, with --api-key;
    /// without a key, a non-loopback address gets a warning at start-up).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1", value_parser = parse_host)]
    pub host: IpAddr,
    /// TCP port (0 picks a free one; the address is printed on stderr).
    #[arg(long, value_name = "PORT", default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer K` on /v1/ requests [default: $PICCHIO_API_KEY, else none].
    #[arg(long, value_name = "K", env = "PICCHIO_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Requests that may wait while one runs; more get 503.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub queue: usize,
    /// Largest request body in bytes; larger ones get 413 (from their Content-Length header, before
    /// the body is read, when they send one).
    #[arg(long, value_name = "BYTES", default_value_t = 4 << 20)]
    pub max_body: usize,
    /// Seconds a request body may stall: a client that stops sending its body for longer gets 408
    /// and its connection is closed.
    #[arg(long, value_name = "SECONDS", default_value_t = 30, value_parser = super::int_in::<u64>(1, Some(i128::from(MAX_TIMEOUT_S))))]
    pub body_timeout: u64,
    /// Seconds a connection may wait for (the headers of) its next request, idle keep-alive
    /// connections included, before it is closed.
    #[arg(long, value_name = "SECONDS", default_value_t = 60, value_parser = super::int_in::<u64>(1, Some(i128::from(MAX_TIMEOUT_S))))]
    pub idle_timeout: u64,
}

/// The longest --body-timeout and --idle-timeout: one day, in seconds. (A deadline far past it
/// overflows the clock's instant arithmetic inside the HTTP server: 2^64 − 1 seconds panicked on
/// every connection.)
pub const MAX_TIMEOUT_S: u64 = 86_400;

/// `--host`: an IP address (`127.0.0.1`, `0.0.0.0`, `::1`, `[::1]`) or `localhost` (127.0.0.1).
fn parse_host(s: &str) -> Result<IpAddr, String> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("localhost") {
        return Ok(IpAddr::from([127, 0, 0, 1]));
    }
    let t = t.strip_prefix('[').and_then(|r| r.strip_suffix(']')).unwrap_or(t);
    t.parse().map_err(|_| {
        format!("expected an IP address to listen on, such as 127.0.0.1 (loopback), 0.0.0.0 (every interface) or ::1, or localhost; got {s:?}")
    })
}

impl Args {
    /// Refuses option values that cannot work, naming the option.
    ///
    /// # Errors
    /// `--queue 0`, `--max-body 0`, an empty API key. (The timeouts' range, 1 to [`MAX_TIMEOUT_S`]
    /// seconds, is checked as they are parsed.)
    pub fn check(&self) -> anyhow::Result<()> {
        if self.queue == 0 {
            anyhow::bail!("--queue must be at least 1 (requests that may wait while one runs)");
        }
        if self.max_body == 0 {
            anyhow::bail!("--max-body must be at least 1 byte (every request has a JSON body); the default is 4194304");
        }
        if self.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            anyhow::bail!(
                "--api-key (or $PICCHIO_API_KEY) is empty or blank: give a key, or leave both unset to serve without one"
            );
        }
        Ok(())
    }
}

/// The HTTP layer's limits (from [`Args`]).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// `--max-body`, bytes.
    pub max_body: usize,
    /// `--body-timeout`.
    pub body_timeout: Duration,
    /// `--idle-timeout`.
    pub idle_timeout: Duration,
}

/// What the worker tells a request's handler.
pub enum Event {
    /// The request started generating (it left the queue).
    Started,
    /// New text.
    Delta(Delta),
    /// The end: the outcome, or an error with its HTTP status.
    Done(Result<Box<Outcome>, Failure>),
}

/// A request that failed, with the status and OpenAI error code it maps to.
pub struct Failure {
    /// 400 for bad requests, 500 otherwise.
    pub status: u16,
    /// OpenAI's `code` (`context_length_exceeded`), when one applies.
    pub code: Option<&'static str>,
    /// The message (the error chain).
    pub message: String,
}

/// A queued request.
pub struct Job {
    /// What to run.
    pub request: Request,
    /// Where its events go; when the receiver is gone (the client left) generation stops.
    pub events: tokio::sync::mpsc::UnboundedSender<Event>,
}

/// Counters for `/metrics` (Prometheus text format).
#[derive(Default)]
pub struct Metrics {
    /// Requests that finished (any outcome).
    pub requests: AtomicU64,
    /// Requests answered with an error, by HTTP status: refused by the HTTP layer (a body that is
    /// not a request, a missing key, an unknown path or model, a body too large or too slow, a full
    /// queue, a shutdown) or failed in the worker (400, 500).
    pub failed: Mutex<BTreeMap<u16, u64>>,
    /// Requests whose client went away before the end.
    pub cancelled: AtomicU64,
    /// Of those, the ones stopped while their prompt was being prefilled (no token generated).
    pub cancelled_in_prefill: AtomicU64,
    /// Requests refused because the queue was full.
    pub rejected: AtomicU64,
    /// Prompt tokens of all requests.
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens served from the KV cache.
    pub cached_tokens: AtomicU64,
    /// Generated tokens.
    pub completion_tokens: AtomicU64,
    /// HTTP requests whose head was read and whose response has not started (reading their body,
    /// waiting in the queue, generating a whole answer).
    pub http_in_progress: AtomicUsize,
    /// Requests waiting.
    pub queue_depth: AtomicUsize,
    /// Requests being generated (0 or 1: one KV cache).
    pub running: AtomicUsize,
    /// Expert-cache hits / misses and bytes read by the store.
    pub expert_hits: AtomicU64,
    /// See `expert_hits`.
    pub expert_misses: AtomicU64,
    /// See `expert_hits`.
    pub bytes_read: AtomicU64,
    /// Decode tok/s of the last request, as f64 bits.
    pub last_tok_s: AtomicU64,
}

impl Metrics {
    /// Counts one request answered with error `status`.
    pub fn count_failure(&self, status: u16) {
        *self.failed.lock().unwrap_or_else(|p| p.into_inner()).entry(status).or_insert(0) += 1;
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = String::new();
        let mut put = |name: &str, kind: &str, help: &str, v: String| {
            out.push_str(&format!("# HELP picchio_{name} {help}\n# TYPE picchio_{name} {kind}\npicchio_{name} {v}\n"));
        };
        put("requests_total", "counter", "Requests that finished.", g(&self.requests).to_string());
        {
            let failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
            out.push_str(
                "# HELP picchio_requests_failed_total Requests answered with an error, by HTTP status (refused by \
                 the HTTP layer or failed while generating).\n# TYPE picchio_requests_failed_total counter\n",
            );
            for (status, n) in failed.iter() {
                out.push_str(&format!("picchio_requests_failed_total{{status=\"{status}\"}} {n}\n"));
            }
        }
        let mut put = |name: &str, kind: &str, help: &str, v: String| {
            out.push_str(&format!("# HELP picchio_{name} {help}\n# TYPE picchio_{name} {kind}\npicchio_{name} {v}\n"));
        };
        put("requests_cancelled_total", "counter", "Requests whose client went away.", g(&self.cancelled).to_string());
        put(
            "requests_cancelled_in_prefill_total",
            "counter",
            "Requests whose client went away during the prompt's prefill (stopped there).",
            g(&self.cancelled_in_prefill).to_string(),
        );
        put("requests_rejected_total", "counter", "Requests refused: queue full.", g(&self.rejected).to_string());
        put("prompt_tokens_total", "counter", "Prompt tokens.", g(&self.prompt_tokens).to_string());
        put(
            "cached_prompt_tokens_total",
            "counter",
            "Prompt tokens reused from the KV cache.",
            g(&self.cached_tokens).to_string(),
        );
        put("completion_tokens_total", "counter", "Generated tokens.", g(&self.completion_tokens).to_string());
        put(
            "http_requests_in_progress",
            "gauge",
            "HTTP requests read whose response has not started (this one included).",
            self.http_in_progress.load(Ordering::Relaxed).to_string(),
        );
        put("queue_depth", "gauge", "Requests waiting.", self.queue_depth.load(Ordering::Relaxed).to_string());
        put("requests_running", "gauge", "Requests being generated.", self.running.load(Ordering::Relaxed).to_string());
        put("expert_cache_hits_total", "counter", "Expert-cache hits.", g(&self.expert_hits).to_string());
        put("expert_cache_misses_total", "counter", "Expert-cache misses (loads).", g(&self.expert_misses).to_string());
        put("store_bytes_read_total", "counter", "Bytes read from the expert store.", g(&self.bytes_read).to_string());
        put(
            "decode_tokens_per_second",
            "gauge",
            "Decode speed of the last request.",
            f64::from_bits(g(&self.last_tok_s)).to_string(),
        );
        out
    }
}

/// The handle the HTTP layer holds: the queue's sending end and the figures.
pub struct Server {
    /// The model's name (what `/v1/models` lists and requests must name).
    pub model: String,
    /// Context of the KV cache.
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
pub enum Refused {
    /// The queue is full.
    QueueFull,
    /// The server is shutting down.
    ShuttingDown,
}

impl Server {
    /// Queues `job`, unless the queue is full or the server is shutting down.
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

/// A test hook's hold point: the worker, reaching the `N`th event of its kind in the first request
/// that gets that far (once per process, as a stop point of `picchio_core::stop_point` stops once),
/// holds that request there until it is told to stop (its client leaves, or the server shuts down).
/// A test then knows where a request is, and that it stays there for as long as the test needs
/// (queue bounds, shutdown, a client leaving mid-prefill), on any machine, instead of hoping a long
/// prompt or answer outlasts it. Without the variable (every real run) this is one load of a cached
/// `u64::MAX` and a compare.
struct HoldPoint {
    /// The variable that sets `N`.
    env: &'static str,
    /// Where the request is held, for the line printed when it is.
    place: &'static str,
    limit: std::sync::OnceLock<u64>,
    held: AtomicBool,
}

impl HoldPoint {
    const fn new(env: &'static str, place: &'static str) -> Self {
        Self { env, place, limit: std::sync::OnceLock::new(), held: AtomicBool::new(false) }
    }

    /// Holds (polling `stop` every 5 ms) if `count` is the hook's `N` and no request was held here yet.
    fn at(&self, count: u64, stop: &dyn Fn() -> bool) {
        let limit = *self
            .limit
            .get_or_init(|| std::env::var(self.env).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(u64::MAX));
        if count != limit || self.held.swap(true, Ordering::Relaxed) {
            return;
        }
        eprintln!("picchio serve: {}={limit}: holding the request {} until it is stopped", self.env, self.place);
        while !stop() {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// `PICCHIO_SERVE_HOLD_AFTER_DELTAS=N`: held after sending its `N`th delta.
static HOLD_AFTER_DELTAS: HoldPoint = HoldPoint::new(HOLD_ENV, "after a delta");
/// `PICCHIO_SERVE_HOLD_IN_PREFILL=N`: held before its `N`th prefill chunk (`N - 1` chunks done).
static HOLD_IN_PREFILL: HoldPoint = HoldPoint::new(HOLD_PREFILL_ENV, "in its prefill");

/// The 503 message of a request refused or dropped from the queue because the server is shutting
/// down (at submit, or when the worker reaches it).
pub const SHUTTING_DOWN: &str = "the server is shutting down; the request was not run";

/// The variable of the hold point after the `N`th delta ([`HoldPoint`]).
pub const HOLD_ENV: &str = "PICCHIO_SERVE_HOLD_AFTER_DELTAS";

/// The variable of the hold point before the `N`th prefill chunk ([`HoldPoint`]).
pub const HOLD_PREFILL_ENV: &str = "PICCHIO_SERVE_HOLD_IN_PREFILL";

/// Runs queued jobs one at a time on `engine` until the queue's senders are gone. Once
/// `shutting_down` is set, the running job stops at its next token (or prefill chunk) and every job
/// still queued is answered 503 without running.
fn worker(mut engine: Engine, jobs: mpsc::Receiver<Job>, metrics: Arc<Metrics>, shutting_down: Arc<AtomicBool>) {
    while let Ok(job) = jobs.recv() {
        metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
        if shutting_down.load(Ordering::SeqCst) {
            let _ = job.events.send(Event::Done(Err(Failure {
                status: 503,
                code: Some("server_shutting_down"),
                message: SHUTTING_DOWN.into(),
            })));
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
        metrics.running.store(1, Ordering::Relaxed);
        let deltas = std::cell::Cell::new(0u64);
        // The checks before the first delta are the prefill's, one before each chunk.
        let prefill_checks = std::cell::Cell::new(0u64);
        let result = engine.run(
            &job.request,
            &mut |d| {
                if job.events.send(Event::Delta(d.clone())).is_err() {
                    gone = true;
                    return ControlFlow::Break(());
                }
                deltas.set(deltas.get() + 1);
                HOLD_AFTER_DELTAS.at(deltas.get(), &stop);
                ControlFlow::Continue(())
            },
            &|| {
                if deltas.get() == 0 {
                    prefill_checks.set(prefill_checks.get() + 1);
                    HOLD_IN_PREFILL.at(prefill_checks.get(), &stop);
                }
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
                let bad = is_bad_request(&e);
                let code = match &e {
                    picchio_runtime::Error::ContextOverflow { .. } => Some("context_length_exceeded"),
                    _ => None,
                };
                if !bad {
                    tracing::error!("request failed: {}", picchio_core::error::chain(&e));
                }
                Err(Failure {
                    status: if bad { 400 } else { 500 },
                    code,
                    message: picchio_core::error::chain(&e).to_string(),
                })
            }
        };
        let _ = job.events.send(Event::Done(done));
    }
}

pub fn exec(mut a: Args) -> anyhow::Result<()> {
    a.check()?;
    let engine = a.model.open()?;
    let (model, context) = (engine.name.clone(), engine.context());
    let (tx, rx) = mpsc::sync_channel(a.queue);
    let metrics = Arc::new(Metrics::default());
    let m = metrics.clone();
    let shutting_down = Arc::new(AtomicBool::new(false));
    let sd = shutting_down.clone();
    let worker = std::thread::Builder::new()
        .name("picchio-generate".into())
        .spawn(move || worker(engine, rx, m, sd))
        .context("starting the generation thread")?;
    let limits = Limits {
        max_body: a.max_body,
        body_timeout: Duration::from_secs(a.body_timeout),
        idle_timeout: Duration::from_secs(a.idle_timeout),
    };
    let server = Arc::new(Server {
        model,
        context,
        api_key: a.api_key.clone(),
        queue: Mutex::new(tx),
        metrics,
        limits,
        shutting_down,
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let served = rt.block_on(super::serve_http::serve(server.clone(), a.host, a.port));
    // Dropping the queue's last sender ends the worker, which drops the session (an nvme:
    // controller is shut down cleanly).
    drop(rt);
    drop(server);
    let _ = worker.join();
    served
}
