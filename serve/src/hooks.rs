//! Test hooks, compiled only with the `test-hooks` cargo feature (which only the tests that run the
//! binary enable: cli's `[dev-dependencies]`); without it every call here is empty and a release
//! build reads none of these variables. The names are public either way, for the tests.
//!
//! - A *hold point*: the worker, reaching the `N`th event of its kind in the first request that
//!   gets that far (once per process, as `picchio_core::stop_point` stops once), holds that request
//!   there until it is told to stop (its client leaves, or the server shuts down). A test then knows
//!   where a request is, and that it stays there for as long as the test needs (queue bounds,
//!   shutdown, a client leaving mid-prefill), on any machine, instead of hoping a long prompt or
//!   answer outlasts it: [`HOLD_AFTER_DELTAS_ENV`], [`HOLD_IN_PREFILL_ENV`].
//! - **A mock:** [`MOCK_SAMPLED_IDS_ENV`]`=ID,ID,...` makes every request generate those ids
//!   instead of sampling them (`Request::mock_sampled`); detokenizing, tool-call parsing, the HTTP
//!   answer and the client all run for real. A test uses it to have a random-weight fixture model
//!   answer with, e.g., a tool call.

/// `PICCHIO_SERVE_HOLD_AFTER_DELTAS=N`: the request is held after sending its `N`th delta.
pub const HOLD_AFTER_DELTAS_ENV: &str = "PICCHIO_SERVE_HOLD_AFTER_DELTAS";

/// `PICCHIO_SERVE_HOLD_IN_PREFILL=N`: the request is held before its `N`th prefill chunk (`N - 1`
/// chunks done).
pub const HOLD_IN_PREFILL_ENV: &str = "PICCHIO_SERVE_HOLD_IN_PREFILL";

/// `PICCHIO_SERVE_TEST_MOCK_SAMPLED_IDS=ID,ID,...`: the ids every request generates instead of
/// sampling.
pub const MOCK_SAMPLED_IDS_ENV: &str = "PICCHIO_SERVE_TEST_MOCK_SAMPLED_IDS";

#[cfg(feature = "test-hooks")]
mod on {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::OnceLock;
    use std::time::Duration;

    /// One hold point.
    pub struct HoldPoint {
        /// The variable that sets `N`.
        env: &'static str,
        /// Where the request is held, for the line printed when it is.
        place: &'static str,
        limit: OnceLock<u64>,
        held: AtomicBool,
    }

    impl HoldPoint {
        const fn new(env: &'static str, place: &'static str) -> Self {
            Self { env, place, limit: OnceLock::new(), held: AtomicBool::new(false) }
        }

        /// Holds (polling `stop` every 5 ms) if `count` is the hook's `N` and no request was held
        /// here yet.
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

    static HOLD_AFTER_DELTAS: HoldPoint = HoldPoint::new(super::HOLD_AFTER_DELTAS_ENV, "after a delta");
    static HOLD_IN_PREFILL: HoldPoint = HoldPoint::new(super::HOLD_IN_PREFILL_ENV, "in its prefill");

    /// The hold points' counts for one request.
    #[derive(Default)]
    pub struct RequestHooks {
        deltas: Cell<u64>,
        prefill_checks: Cell<u64>,
    }

    impl RequestHooks {
        pub fn after_delta(&self, stop: &dyn Fn() -> bool) {
            self.deltas.set(self.deltas.get() + 1);
            HOLD_AFTER_DELTAS.at(self.deltas.get(), stop);
        }

        pub fn before_check(&self, stop: &dyn Fn() -> bool) {
            // The checks before the first delta are the prefill's, one before each chunk.
            if self.deltas.get() == 0 {
                self.prefill_checks.set(self.prefill_checks.get() + 1);
                HOLD_IN_PREFILL.at(self.prefill_checks.get(), stop);
            }
        }
    }

    pub fn mock_sampled_ids() -> Option<Vec<u32>> {
        static IDS: OnceLock<Option<Vec<u32>>> = OnceLock::new();
        IDS.get_or_init(|| {
            let v = std::env::var(super::MOCK_SAMPLED_IDS_ENV).ok()?;
            let ids: Vec<u32> = v.split(',').filter_map(|t| t.trim().parse().ok()).collect();
            eprintln!(
                "picchio serve: {}: a test mock: {} ids replace sampling",
                super::MOCK_SAMPLED_IDS_ENV,
                ids.len()
            );
            Some(ids)
        })
        .clone()
    }
}

/// The hold points of one request, told of each delta sent and each stop check (one before every
/// prefill chunk and every token). Without `test-hooks`, an empty type whose calls do nothing.
#[derive(Default)]
pub(crate) struct RequestHooks {
    #[cfg(feature = "test-hooks")]
    on: on::RequestHooks,
}

impl RequestHooks {
    /// After the request sent a delta; `stop` says when a held request is to go on.
    #[inline(always)]
    pub(crate) fn after_delta(&self, stop: &dyn Fn() -> bool) {
        #[cfg(feature = "test-hooks")]
        self.on.after_delta(stop);
        #[cfg(not(feature = "test-hooks"))]
        let _ = stop;
    }

    /// Before the worker asks whether to stop (before each prefill chunk and each token).
    #[inline(always)]
    pub(crate) fn before_check(&self, stop: &dyn Fn() -> bool) {
        #[cfg(feature = "test-hooks")]
        self.on.before_check(stop);
        #[cfg(not(feature = "test-hooks"))]
        let _ = stop;
    }
}

/// The mock's ids ([`MOCK_SAMPLED_IDS_ENV`]), read once; `None` when it is unset, and always
/// without `test-hooks`.
#[inline(always)]
pub(crate) fn mock_sampled_ids() -> Option<Vec<u32>> {
    #[cfg(feature = "test-hooks")]
    return on::mock_sampled_ids();
    #[cfg(not(feature = "test-hooks"))]
    None
}
