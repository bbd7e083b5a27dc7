//! How an [`NvmeQueue`] recovers from a hung command or a controller fatal status, and stops on an
//! interrupt.
//!
//! The waiting loops ([`IoQueue::reap`](picchio_core::IoQueue::reap), [`NvmeQueue::flush`]) call
//! [`NvmeQueue::expire`] every 64 polls. It checks, in order:
//! 1. the interrupt flag ([`NvmeQueue::set_interrupt`], set by a SIGINT/SIGTERM handler): every
//!    request fails with [`ReadFailure::Interrupted`] (`io::ErrorKind::Interrupted`) and the queue
//!    accepts no more, so the caller unwinds and `Drop` shuts the controller down;
//! 2. CSTS.CFS: the controller is reset;
//! 3. commands outstanding longer than the per-command timeout: each gets an **Abort** (admin
//!    opcode 08h with its SQID and CID, NVMe base spec 2.0 §5.1) with its own timeout
//!    ([`RecoveryPolicy::abort_timeout`]); if its completion then arrives, only its request is
//!    affected: an error status (Command Abort Requested, or any other) fails it with
//!    [`ReadFailure::Aborted`], while a late *success* completes it normally — the controller has
//!    transferred all of its data, so its bytes are whole. If the Abort fails,
//!    times out, or its command's completion still does not come, the controller is **reset**.
//!
//! A reset ([`Controller::reset`](crate::Controller::reset)) clears CC.EN, waits for CSTS.RDY = 0
//! within CAP.TO (the controller then does no more DMA, and CSTS.CFS is cleared), runs bring-up
//! again and re-creates I/O queue pair 1 on the same DMA memory. Exactly the requests with a
//! command in flight fail — the timed-out one with [`ReadFailure::TimedOutReset`], the others with
//! [`ReadFailure::Reset`] — and their buffers come back intact (no quarantine: DMA has stopped).
//! Requests not yet issued, and later ones, are served as usual. More than
//! [`RecoveryPolicy::max_resets`] resets within [`RecoveryPolicy::reset_window`] stop the queue
//! with [`ReadFailure::ResetLimit`].
//!
//! Every failure reaches the caller as an `io::Error` whose inner error is a [`ReadFailure`]
//! (`err.get_ref().and_then(|e| e.downcast_ref::<ReadFailure>())`); the runtime's `FlatStore`
//! counts it and the `FallbackLoader` serves that expert from safetensors.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::NvmeQueue;
use crate::queue::{Cid, Lost};
use crate::request::Child;
use crate::spec::Status;

/// Limits of an [`NvmeQueue`]'s recovery (see the module documentation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecoveryPolicy {
    /// How long an Abort, and then the aborted command's own completion, may take before the
    /// controller is reset.
    pub abort_timeout: Duration,
    /// Controller resets allowed within [`RecoveryPolicy::reset_window`]; one more stops the queue.
    pub max_resets: u32,
    /// The sliding window for [`RecoveryPolicy::max_resets`].
    pub reset_window: Duration,
}

impl Default for RecoveryPolicy {
    /// 1 s per Abort; at most 3 resets per 60 s.
    fn default() -> Self {
        RecoveryPolicy { abort_timeout: Duration::from_secs(1), max_resets: 3, reset_window: Duration::from_secs(60) }
    }
}

/// Why a request of an [`NvmeQueue`] failed during recovery: the inner error of the `io::Error`
/// in its completion ([`ReadFailure::kind`] gives that error's kind). Byte offsets are in the
/// namespace.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReadFailure {
    /// The command timed out; the Abort resolved it and it completed with `status`.
    #[error(
        "NVMe command CID {cid} at byte {byte:#x} of namespace {nsid}: no completion within {timeout_ms} ms; \
         aborted (Abort, §5.1), it completed with {status}"
    )]
    Aborted {
        /// Namespace.
        nsid: u32,
        /// First byte of the command.
        byte: u64,
        /// Its command identifier.
        cid: u16,
        /// The per-command timeout, ms.
        timeout_ms: u64,
        /// Its completion status (usually Command Abort Requested).
        status: Status,
    },
    /// The command timed out and the Abort did not resolve it: the controller was reset.
    #[error(
        "NVMe command CID {cid} at byte {byte:#x} of namespace {nsid}: no completion within {timeout_ms} ms; \
         {why}, so the controller was reset"
    )]
    TimedOutReset {
        /// Namespace.
        nsid: u32,
        /// First byte of the command.
        byte: u64,
        /// Its command identifier.
        cid: u16,
        /// The per-command timeout, ms.
        timeout_ms: u64,
        /// Why the Abort did not resolve it.
        why: String,
    },
    /// The command was in flight when the controller was reset for another reason.
    #[error(
        "NVMe command at byte {byte:#x} of namespace {nsid} was in flight when the controller was reset ({reason})"
    )]
    Reset {
        /// Namespace.
        nsid: u32,
        /// First byte of the command.
        byte: u64,
        /// Why the controller was reset.
        reason: String,
    },
    /// Too many resets: the queue is stopped.
    #[error(
        "NVMe queue stopped after {resets} controller resets within {window_s} s (limit {limit}); \
         last cause: {last}"
    )]
    ResetLimit {
        /// Resets in the window.
        resets: u32,
        /// The window, s.
        window_s: u64,
        /// [`RecoveryPolicy::max_resets`].
        limit: u32,
        /// What called for the reset that was refused.
        last: String,
    },
    /// The controller did not come back from a reset: the queue is stopped.
    #[error("NVMe queue stopped: controller reset after {reason} failed: {cause}")]
    ResetFailed {
        /// Why it was reset.
        reason: String,
        /// The reset's error.
        cause: String,
    },
    /// The namespace changed across a reset: the queue is stopped.
    #[error("NVMe queue stopped: after a reset namespace {nsid} is {now}, was {was}")]
    NamespaceChanged {
        /// Namespace.
        nsid: u32,
        /// Before.
        was: String,
        /// After.
        now: String,
    },
    /// The interrupt flag was raised (SIGINT/SIGTERM): the queue stopped waiting.
    #[error(
        "NVMe I/O interrupted (SIGINT/SIGTERM): the queue stopped; the controller is shut down when it is dropped"
    )]
    Interrupted,
}

impl ReadFailure {
    /// The `io::ErrorKind` of the completion carrying it: `TimedOut` for timed-out commands,
    /// `Interrupted` for an interrupt, `Other` otherwise.
    pub fn kind(&self) -> io::ErrorKind {
        match self {
            ReadFailure::Aborted { .. } | ReadFailure::TimedOutReset { .. } => io::ErrorKind::TimedOut,
            ReadFailure::Interrupted => io::ErrorKind::Interrupted,
            _ => io::ErrorKind::Other,
        }
    }
    /// As an `io::Error` of [`ReadFailure::kind`] with `self` inside.
    pub fn into_io(self) -> io::Error {
        io::Error::new(self.kind(), self)
    }
    /// The [`ReadFailure`] inside `e`, if it carries one.
    pub fn of(e: &io::Error) -> Option<&ReadFailure> {
        e.get_ref().and_then(|i| i.downcast_ref::<ReadFailure>())
    }
}

/// Recovery state of one queue.
#[derive(Debug, Default)]
pub(super) struct Recovery {
    policy: RecoveryPolicy,
    /// When recent resets happened (within the window).
    resets: VecDeque<Instant>,
    interrupt: Option<Arc<AtomicBool>>,
}

impl NvmeQueue {
    /// Sets the recovery limits (default: [`RecoveryPolicy::default`]).
    pub fn set_recovery(&mut self, policy: RecoveryPolicy) {
        self.recovery.policy = policy;
    }

    /// The recovery limits.
    pub fn recovery(&self) -> &RecoveryPolicy {
        &self.recovery.policy
    }

    /// A flag that, once true, makes every wait of this queue give up: requests fail with
    /// [`ReadFailure::Interrupted`] and the queue accepts no more. A SIGINT/SIGTERM handler sets it
    /// (`signal_hook::flag::register`), so a blocked `reap` returns, the caller unwinds, and `Drop`
    /// shuts the controller down. Checked every 64 polls.
    pub fn set_interrupt(&mut self, flag: Arc<AtomicBool>) {
        self.recovery.interrupt = Some(flag);
    }

    /// The periodic check of the waiting loops: interrupt, CSTS.CFS, then per-command timeouts (Abort,
    /// else reset). See the module documentation.
    pub(super) fn expire(&mut self) {
        if self.fatal.is_some() {
            return;
        }
        if self.recovery.interrupt.as_ref().is_some_and(|f| f.load(Ordering::Relaxed)) {
            self.stop(ReadFailure::Interrupted);
            return;
        }
        let csts = self.ctrlr.csts();
        if csts.cfs() {
            self.reset_controller(format!("controller fatal status (CSTS.CFS = 1, CSTS {:#x})", csts.0));
            return;
        }
        let Some(q) = self.ctrlr.io_queue() else { return };
        let mut expired = Vec::new();
        q.expire(self.timeout, |cid, _| expired.push(cid));
        for cid in expired {
            self.stats.timeouts += 1;
            // A reset for an earlier one frees every command; nothing was issued since.
            if self.fatal.is_some() || !self.ctrlr.io_queue().is_some_and(|q| q.is_busy(cid)) {
                continue;
            }
            if let Err(why) = self.abort_command(cid) {
                self.reset_controller(format!("CID {} unresolved: {why}", cid.0));
            }
        }
    }

    /// Aborts `cid` and waits for its completion (consumed by `poll`, which fails its request with
    /// [`ReadFailure::Aborted`]). `Err` says why it is still unresolved.
    fn abort_command(&mut self, cid: Cid) -> std::result::Result<(), String> {
        self.stats.aborts += 1;
        let t = self.recovery.policy.abort_timeout;
        let aborted = self
            .ctrlr
            .abort(1, cid, t)
            .map_err(|e| format!("the Abort failed ({})", picchio_core::error::chain(&e)))?;
        tracing::warn!(cid = cid.0, aborted, "nvme command timed out; Abort sent");
        let deadline = Instant::now() + t;
        loop {
            self.poll();
            if !self.ctrlr.io_queue().is_some_and(|q| q.is_busy(cid)) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(if aborted {
                    format!("the Abort succeeded but no completion came within {} ms", t.as_millis())
                } else {
                    format!(
                        "the Abort did not abort it (DW0 bit 0 = 1) and no completion came within {} ms",
                        t.as_millis()
                    )
                });
            }
            std::thread::yield_now();
        }
    }

    /// Resets the controller (bounded by the policy) and fails exactly the requests that had a
    /// command in flight.
    fn reset_controller(&mut self, reason: String) {
        let now = Instant::now();
        let (limit, window) = (self.recovery.policy.max_resets, self.recovery.policy.reset_window);
        self.recovery.resets.retain(|t| now.duration_since(*t) < window);
        if self.recovery.resets.len() >= limit as usize {
            let f = ReadFailure::ResetLimit {
                resets: self.recovery.resets.len() as u32,
                window_s: window.as_secs(),
                limit,
                last: reason,
            };
            self.stop(f);
            // Stop the device (delete queues, CC.SHN, CC.EN = 0) so nothing is DMA'd any more.
            if let Err(e) = self.ctrlr.shutdown() {
                tracing::warn!(error = %picchio_core::error::chain(&e), "nvme shutdown after the reset limit");
            }
            return;
        }
        self.recovery.resets.push_back(now);
        self.stats.resets += 1;
        tracing::warn!(%reason, "nvme: resetting the controller");
        let lost = match self.ctrlr.reset() {
            Ok(lost) => lost,
            Err(e) => {
                self.stop(ReadFailure::ResetFailed { reason, cause: picchio_core::error::chain(&e).to_string() });
                return;
            }
        };
        match self.ctrlr.namespace(self.ns.nsid) {
            Ok(ns) if ns == self.ns => {}
            other => {
                let now = other.map_or_else(|e| picchio_core::error::chain(&e).to_string(), |n| format!("{n:?}"));
                self.stop(ReadFailure::NamespaceChanged { nsid: self.ns.nsid, was: format!("{:?}", self.ns), now });
                return;
            }
        }
        for l in lost {
            self.fail_lost(l, &reason);
        }
    }

    /// A command lost in a reset: its request fails (the buffer is intact and not quarantined).
    fn fail_lost(&mut self, l: Lost, reason: &str) {
        let (ri, off) = Child::parts(l.user);
        let (nsid, timeout_ms) = (self.ns.nsid, self.timeout.as_millis() as u64);
        let Some(r) = self.reqs.get(ri) else { return };
        let byte = r.offset + u64::from(off);
        let f = if l.timed_out {
            ReadFailure::TimedOutReset { nsid, byte, cid: l.cid.0, timeout_ms, why: reason.to_string() }
        } else {
            ReadFailure::Reset { nsid, byte, reason: reason.to_string() }
        };
        // The request fails and issues nothing more; the first error is kept.
        let (reqs, mut t) = self.io();
        reqs.child_done(ri, Some(f.into_io()), &mut t);
    }

    /// Fails every request with `f` and accepts no more. Buffers of commands still in flight are
    /// quarantined until the controller is shut down (the device may still write them).
    fn stop(&mut self, f: ReadFailure) {
        tracing::error!(error = %f, "nvme queue stopped");
        let (reqs, mut t) = self.io();
        reqs.end_all(
            |r| {
                r.x.lost |= r.outstanding() > 0;
                r.error = Some(f.clone().into_io());
            },
            &mut t,
        );
        self.fatal = Some(f.to_string());
    }
}

/// The error of a late completion (after [`NvmeQueue::expire`] reported its command timed out and
/// sent an Abort) with a failing `status`.
pub(super) fn aborted(nsid: u32, byte: u64, cid: Cid, timeout: Duration, status: Status) -> io::Error {
    ReadFailure::Aborted { nsid, byte, cid: cid.0, timeout_ms: timeout.as_millis() as u64, status }.into_io()
}
