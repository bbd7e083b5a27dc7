//! I/O statistics shared between a store and whoever reports them.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Latency bucket upper bounds in microseconds (the last bucket is open-ended).
pub const LATENCY_BUCKETS_US: [u64; 12] = [10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 50_000, u64::MAX];

/// Counters updated by expert loaders (lock-free; share with `Arc`).
#[derive(Debug, Default)]
pub struct IoStats {
    reads: AtomicU64,
    bytes: AtomicU64,
    read_wall_ns: AtomicU64,
    read_span_ns: AtomicU64,
    fallbacks: AtomicU64,
    errors: AtomicU64,
    missing: AtomicU64,
    bounce: AtomicU64,
    latency_sum_ns: AtomicU64,
    latency: [AtomicU64; LATENCY_BUCKETS_US.len()],
}

/// A copy of [`IoStats`] at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Expert reads completed.
    pub reads: u64,
    /// Bytes read from the store (padded lengths).
    pub bytes: u64,
    /// Wall time spent waiting in `load` (blocked in submit and reap: the I/O wait the caller
    /// sees, not the time the device took), in nanoseconds.
    pub read_wall_ns: u64,
    /// Wall time during which reads were in flight, in nanoseconds: per `load` call, from the first
    /// submit to the reap of the last completion (compute done between reaps, with async MoE, is
    /// inside the span, since the device keeps working then). Bytes over this span is a device rate.
    pub read_span_ns: u64,
    /// Experts served by the fallback loader after the primary failed.
    pub fallbacks: u64,
    /// Failed reads or checks in the primary store.
    pub errors: u64,
    /// Experts the primary store has no entry for by design (the layers past a `pack --layers N`
    /// prefix image): served by the fallback, and not counted as `errors`.
    pub missing: u64,
    /// Bytes of expert reads the engine copied through bounce buffers instead of reading them
    /// straight into the cache slot ([`crate::IoQueue::bounce_bytes`]; 0 for kernel engines).
    pub bounce_bytes: u64,
    /// Sum of the latencies of the completed reads, in nanoseconds (each from its submit to its
    /// completion being reaped, [`crate::Completion::latency_ns`]); over `reads` it is the mean read
    /// latency, which shows a slow device (e.g. device-mapper's `delay` target) whatever the overlap.
    pub latency_sum_ns: u64,
    /// Read count per bucket of [`LATENCY_BUCKETS_US`].
    pub latency_hist: Vec<u64>,
}

impl IoStats {
    /// Records one completed read of `bytes` taking `latency_ns`.
    pub fn record_read(&self, bytes: u64, latency_ns: u64) {
        self.reads.fetch_add(1, Relaxed);
        self.bytes.fetch_add(bytes, Relaxed);
        let us = latency_ns / 1000;
        let b = LATENCY_BUCKETS_US.iter().position(|&ub| us <= ub).unwrap_or(LATENCY_BUCKETS_US.len() - 1);
        self.latency[b].fetch_add(1, Relaxed);
        self.latency_sum_ns.fetch_add(latency_ns, Relaxed);
    }
    /// Adds wall time spent in a load call.
    pub fn add_wall(&self, ns: u64) {
        self.read_wall_ns.fetch_add(ns, Relaxed);
    }
    /// Adds the wall time one load call had reads in flight (see [`StatsSnapshot::read_span_ns`]).
    pub fn add_span(&self, ns: u64) {
        self.read_span_ns.fetch_add(ns, Relaxed);
    }
    /// Counts one expert served by the fallback.
    pub fn record_fallback(&self) {
        self.fallbacks.fetch_add(1, Relaxed);
    }
    /// Counts one failed read or check.
    pub fn record_error(&self) {
        self.errors.fetch_add(1, Relaxed);
    }
    /// Counts one expert the store has no entry for (see [`StatsSnapshot::missing`]).
    pub fn record_missing(&self) {
        self.missing.fetch_add(1, Relaxed);
    }
    /// Counts bytes an engine copied through bounce buffers.
    pub fn record_bounce(&self, bytes: u64) {
        self.bounce.fetch_add(bytes, Relaxed);
    }
    /// Copies the counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            reads: self.reads.load(Relaxed),
            bytes: self.bytes.load(Relaxed),
            read_wall_ns: self.read_wall_ns.load(Relaxed),
            read_span_ns: self.read_span_ns.load(Relaxed),
            fallbacks: self.fallbacks.load(Relaxed),
            errors: self.errors.load(Relaxed),
            missing: self.missing.load(Relaxed),
            bounce_bytes: self.bounce.load(Relaxed),
            latency_sum_ns: self.latency_sum_ns.load(Relaxed),
            latency_hist: self.latency.iter().map(|a| a.load(Relaxed)).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn buckets_by_microseconds() {
        let s = IoStats::default();
        s.record_read(4096, 5_000); // 5 us
        s.record_read(4096, 150_000); // 150 us
        s.record_read(4096, 10_000_000_000); // 10 s
        let snap = s.snapshot();
        assert_eq!((snap.reads, snap.bytes), (3, 12288));
        assert_eq!(snap.latency_sum_ns, 10_000_155_000);
        assert_eq!(snap.latency_hist[0], 1);
        assert_eq!(snap.latency_hist[4], 1);
        assert_eq!(snap.latency_hist[11], 1);
    }
}
