//! SIGINT / SIGTERM as a stop request that long-running loops poll, so the program unwinds and every
//! `Drop` runs — above all the NVMe driver's clean controller shutdown (delete I/O queues, CC.SHN
//! normal, wait for CSTS.SHST complete, unmap DMA) — instead of dying with the device mid-command.
//!
//! [`install`] registers the handlers with `signal-hook` (flag registration only: no code of ours
//! runs in signal context). The first signal sets [`flag`] and records its number; a second one
//! ends the process at once with `128 + signal` (for a run that does not react). What polls the flag:
//! - [`Session::generate`](crate::run::Session::generate), before every forward pass, returning
//!   [`Error::Interrupted`](crate::Error::Interrupted);
//! - the image writers — `picchio synth`, `pack` and `convert` — between payloads (tensors), through
//!   [`check`]: the [`Error::Interrupted`](crate::Error::Interrupted) unwinds and drops the writer,
//!   which removes its temporary file (`picchio_core::format::FileSink`), so a stopped write leaves
//!   nothing behind;
//! - the `nvme:` engine's waiting loops (`NvmeQueue::set_interrupt`): in-flight reads fail with
//!   `ErrorKind::Interrupted` and the queue stops, so a read stuck on a dead device cannot keep the
//!   process from exiting.
//!
//! `picchio` then exits with status `128 + signal` (130 for SIGINT, 143 for SIGTERM).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

struct State {
    flag: Arc<AtomicBool>,
    signal: Arc<AtomicUsize>,
}

fn state() -> &'static State {
    static STATE: OnceLock<State> = OnceLock::new();
    STATE.get_or_init(|| State { flag: Arc::new(AtomicBool::new(false)), signal: Arc::new(AtomicUsize::new(0)) })
}

/// The process-wide stop request: true once SIGINT or SIGTERM arrived (after [`install`]).
pub fn flag() -> Arc<AtomicBool> {
    state().flag.clone()
}

/// Whether a stop was requested.
pub fn requested() -> bool {
    state().flag.load(Ordering::Relaxed)
}

/// The signal that requested the stop (e.g. 2 for SIGINT), if any.
pub fn signal() -> Option<i32> {
    match state().signal.load(Ordering::Relaxed) {
        0 => None,
        s => Some(s as i32),
    }
}

/// The signal's name, `SIGINT` or `SIGTERM` (or `signal N`).
pub fn signal_name() -> String {
    match signal() {
        Some(signal_hook::consts::SIGINT) => "SIGINT".into(),
        Some(signal_hook::consts::SIGTERM) => "SIGTERM".into(),
        Some(s) => format!("signal {s}"),
        None => "a stop request".into(),
    }
}

/// The conventional exit status after the stop: `128 + signal` (130 for SIGINT).
pub fn exit_code() -> i32 {
    128 + signal().unwrap_or(signal_hook::consts::SIGINT)
}

/// Registers SIGINT and SIGTERM: the first sets [`flag`], a second exits at once with `128 + signal`.
///
/// # Errors
/// The OS error of the registration.
pub fn install() -> std::io::Result<()> {
    let s = state();
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // Order matters: the conditional shutdown sees the flag as it was before this signal.
        signal_hook::flag::register_conditional_shutdown(sig, 128 + sig, s.flag.clone())?;
        signal_hook::flag::register_usize(sig, s.signal.clone(), sig as usize)?;
        signal_hook::flag::register(sig, s.flag.clone())?;
    }
    tracing::debug!("SIGINT/SIGTERM handlers installed");
    Ok(())
}

/// Returns [`Error::Interrupted`](crate::Error::Interrupted) (`done` of `wanted` `unit`) once a
/// stop was requested, for loops that poll between units of work.
///
/// # Errors
/// [`Error::Interrupted`](crate::Error::Interrupted) after SIGINT/SIGTERM (or [`request`]).
pub fn check(done: usize, wanted: usize, unit: &'static str) -> crate::Result<()> {
    match requested() {
        true => Err(crate::Error::Interrupted { signal: signal_name(), done, wanted, unit }),
        false => Ok(()),
    }
}

/// Raises the stop request by hand, as a signal would (for tests and embedders).
pub fn request(signal: i32) {
    let s = state();
    s.signal.store(signal as usize, Ordering::Relaxed);
    s.flag.store(true, Ordering::Relaxed);
}
