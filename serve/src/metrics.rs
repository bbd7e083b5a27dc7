//! The figures `GET /metrics` shows, in Prometheus' text exposition format.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

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
