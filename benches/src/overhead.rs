//! `picchio bench overhead`: the software cost of one read at QD 1, per engine, in nanoseconds,
//! split into `submit` and `complete` (the `reap` that returns it).
//!
//! Timed with the CPU timestamp counter where there is one (x86-64 `rdtsc`, ordered by `lfence`,
//! calibrated against `CLOCK_MONOTONIC` (Rust's `Instant`) over 100 ms at start); elsewhere with
//! `Instant` itself. What each row's `complete` includes:
//!
//! * `null` — [`null_queue`]: nothing but the `IoQueue` calls (dynamic dispatch, moving the request
//!   and completion). The floor under every engine.
//! * `nvme-sim` — our NVMe driver against the controller model: the wait for the model to post the
//!   CQE is **not** timed (spun on outside the clock, as `picchio-nvme`'s `sim_cost` example does), so
//!   `complete` is the driver's own work (phase-tag poll, CQ doorbell, finishing the request).
//! * `psync` (buffered, 1 worker) and `uring` (buffered, QD 1) on a file whose read range was read
//!   once first, so every read is a page-cache hit: `complete` includes the kernel's copy of `bs`
//!   bytes and, for psync, handing the read to a worker thread and back. There is no device wait in
//!   it, but there is kernel work: these rows are what the kernel path costs at best.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use picchio_core::{AlignedBuf, ByteOffset, Completion, IoQueue, ReadReq, Tag};
use serde::{Deserialize, Serialize};

use super::measure::{Skipped, SplitMix64};
use super::null::null_queue;
use crate::error::{Error, Result};
use picchio_core::StoreUri;

/// Options of [`run`] (recorded in the report's `flags`).
#[derive(Clone, Debug, Serialize)]
pub struct OverheadOptions {
    /// Engines: `null`, `psync`, `uring`, `nvme-sim`.
    pub engines: Vec<String>,
    /// Timed reads per engine (after `reads / 10` untimed warm-up reads).
    pub reads: u64,
    /// Read size, bytes (a multiple of 4096).
    pub bs: u32,
    /// Bytes at the start of the image that reads are drawn from (read once first to cache them):
    /// `None` is [`DEFAULT_RANGE`] clamped to the image (its end: the end of the last entry of the
    /// payload area); an explicit range larger than the image is refused.
    pub range: Option<u64>,
    /// Seed of the offsets.
    pub seed: u64,
}

/// The read range when none is given: 64 MiB, or the whole image when it is smaller.
pub const DEFAULT_RANGE: u64 = 64 << 20;

impl OverheadOptions {
    /// Checks `bs`, `reads` and `range` against the image (`image_end`: bytes from the image's
    /// first byte to the end of its payload area, [`super::measure::StoreLayout::payload`]) and
    /// returns the read range to use, a whole number of reads. Called before anything is measured.
    ///
    /// # Errors
    /// [`Error::BadOption`] naming the option that is wrong: `--bs` zero or not a multiple of 4096,
    /// `--reads` zero, or `--range` smaller than one read or larger than the image (naming its size).
    pub fn resolve_range(&self, image_end: u64) -> Result<u64> {
        if self.bs == 0 || !self.bs.is_multiple_of(4096) {
            return Err(Error::BadOption {
                experiment: Some("overhead"),
                option: "--bs",
                value: self.bs.to_string(),
                expected: "must be a positive multiple of 4096".into(),
            });
        }
        if self.reads == 0 {
            return Err(Error::BadOption {
                experiment: Some("overhead"),
                option: "--reads",
                value: "0".into(),
                expected: "must be positive".into(),
            });
        }
        let range = match self.range {
            None => DEFAULT_RANGE.min(image_end),
            Some(r) if r > image_end => {
                return Err(Error::BadOption {
                    experiment: Some("overhead"),
                    option: "--range",
                    value: r.to_string(),
                    expected: format!("larger than the image ({image_end} bytes up to the end of its payload)"),
                })
            }
            Some(r) => r,
        };
        let bs = u64::from(self.bs);
        if range < bs {
            return Err(Error::BadOption {
                experiment: Some("overhead"),
                option: "--range",
                value: range.to_string(),
                expected: format!(
                    "smaller than one read of --bs {bs} bytes{}",
                    if self.range.is_none() { " (the whole image)" } else { "" }
                ),
            });
        }
        Ok(range - range % bs)
    }
}

impl Default for OverheadOptions {
    fn default() -> Self {
        OverheadOptions {
            engines: ["null", "psync", "uring", "nvme-sim"].map(String::from).to_vec(),
            reads: 100_000,
            bs: 4096,
            range: None,
            seed: 0,
        }
    }
}

/// Nanosecond statistics of one cost.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CostNs {
    /// Mean, ns.
    pub mean: f64,
    /// Median, ns.
    pub p50: f64,
    /// 90th percentile, ns.
    pub p90: f64,
    /// 99th percentile, ns.
    pub p99: f64,
    /// Largest, ns.
    pub max: f64,
}

impl CostNs {
    fn of(h: &Histogram<u64>, ticks_per_ns: f64) -> Self {
        let ns = |t: u64| t as f64 / ticks_per_ns;
        CostNs {
            mean: h.mean() / ticks_per_ns,
            p50: ns(h.value_at_quantile(0.5)),
            p90: ns(h.value_at_quantile(0.9)),
            p99: ns(h.value_at_quantile(0.99)),
            max: ns(h.highest_equivalent(h.max())),
        }
    }
}

/// One engine's costs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OverheadRow {
    /// `null`, `psync`, `uring`, `nvme-sim`.
    pub engine: String,
    /// The queue's own description.
    pub detail: String,
    /// What `complete` includes (see the module documentation).
    pub complete_includes: String,
    /// Timed reads.
    pub reads: u64,
    /// Cost of `submit`.
    pub submit_ns: CostNs,
    /// Cost of the `reap` that returns the read.
    pub complete_ns: CostNs,
    /// submit + complete, per read.
    pub total_ns: CostNs,
    /// Fraction of the read range in the page cache before the timed reads (`mincore`; files only).
    pub resident_before: Option<f64>,
}

/// `results` of an overhead report.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OverheadResults {
    /// The store whose file the kernel engines and the model read.
    pub store: String,
    /// `rdtsc` or `CLOCK_MONOTONIC`.
    pub clock: String,
    /// Clock ticks per nanosecond (measured for rdtsc; 1 for CLOCK_MONOTONIC).
    pub ticks_per_ns: f64,
    /// Read size, bytes.
    pub bs: u32,
    /// Bytes at the start of the image the reads were drawn from (`--range`, or its default clamped
    /// to the image).
    pub range: u64,
    /// Every engine measured.
    pub rows: Vec<OverheadRow>,
    /// Engines not run, with the reason.
    pub skipped: Vec<Skipped>,
}

/// A timestamp source: `rdtsc` on x86-64, `Instant` elsewhere.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    base: Instant,
    /// Ticks per nanosecond.
    pub ticks_per_ns: f64,
    /// Whether `now` reads the timestamp counter.
    pub tsc: bool,
}

impl Clock {
    /// The timestamp counter calibrated against `Instant` over `calibrate` (x86-64), or `Instant`.
    pub fn new(calibrate: Duration) -> Self {
        let base = Instant::now();
        if cfg!(target_arch = "x86_64") {
            let (t0, i0) = (tsc(), Instant::now());
            std::thread::sleep(calibrate);
            let (t1, i1) = (tsc(), Instant::now());
            let ns = i1.duration_since(i0).as_nanos() as f64;
            if t1 > t0 && ns > 0.0 {
                return Clock { base, ticks_per_ns: (t1 - t0) as f64 / ns, tsc: true };
            }
        }
        Clock { base, ticks_per_ns: 1.0, tsc: false }
    }

    /// Now, in ticks.
    #[inline]
    pub fn now(&self) -> u64 {
        if self.tsc {
            tsc()
        } else {
            u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX)
        }
    }
}

/// The timestamp counter, after earlier instructions have completed (`lfence; rdtsc`).
#[cfg(target_arch = "x86_64")]
#[inline]
#[allow(unused_unsafe)]
fn tsc() -> u64 {
    // SAFETY: lfence and rdtsc exist on every x86-64 CPU (SSE2 is baseline) and touch no memory.
    unsafe {
        core::arch::x86_64::_mm_lfence();
        core::arch::x86_64::_rdtsc()
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn tsc() -> u64 {
    0
}

/// A queue to time, and how to wait (untimed) for a submitted read to be ready.
struct Target {
    queue: Box<dyn IoQueue>,
    /// The reader's lock on the file ([`picchio_runtime::image::guard::ReadLock`]), held as long as
    /// the queue (declared after it: dropped after it).
    _lock: Option<picchio_runtime::image::guard::ReadLock>,
    complete_includes: &'static str,
    /// Spins until the device side has finished the read (the controller model), untimed.
    wait_device: Option<Box<dyn FnMut()>>,
    resident_before: Option<f64>,
}

/// `engine` through the page cache at depth 1 on the file or device `p`, from the runtime's engine
/// factory (io_uring without the psync fallback).
fn open_buffered(
    p: &std::path::Path,
    engine: picchio_runtime::expert::open::IoEngine,
) -> Result<picchio_runtime::expert::open::Opened> {
    let io = picchio_runtime::expert::open::EngineOptions {
        engine,
        direct: false,
        threads: 1,
        qd: 1,
        uring_fallback: false,
        ..Default::default()
    };
    Ok(picchio_runtime::expert::open::open_engine(&StoreUri::File(p.into()), io)?)
}

fn open_target(engine: &str, store: &StoreUri, range: u64) -> Result<std::result::Result<Target, String>> {
    let path = store.local_path().map(std::path::Path::to_path_buf);
    let file = || path.clone().ok_or_else(|| format!("{engine} reads a file; {store} is not one"));
    let warm = |p: &std::path::Path| -> Result<Option<f64>> {
        use std::io::Read;
        let mut f = std::fs::File::open(p).map_err(Error::io(p, "open to warm the page cache"))?;
        let mut buf = vec![0u8; 1 << 20];
        let mut left = range;
        while left > 0 {
            let n =
                f.read(&mut buf[..left.min(1 << 20) as usize]).map_err(Error::io(p, "read to warm the page cache"))?;
            if n == 0 {
                break;
            }
            left -= n as u64;
        }
        Ok(super::measure::resident_fraction(p))
    };
    Ok(Ok(match engine {
        "null" => Target {
            queue: Box::new(null_queue()),
            _lock: None,
            complete_includes: "the IoQueue calls only (NullQueue completes at submit)",
            wait_device: None,
            resident_before: None,
        },
        "psync" | "uring" => {
            use picchio_runtime::expert::open::IoEngine;
            if engine == "uring" && !cfg!(target_os = "linux") {
                return Ok(Err("io_uring is Linux-only".into()));
            }
            let p = match file() {
                Ok(p) => p,
                Err(e) => return Ok(Err(e)),
            };
            let (io, complete_includes) = if engine == "psync" {
                (IoEngine::Psync, "handing the read to the worker thread and back, and the kernel's page-cache copy")
            } else {
                #[cfg(target_os = "linux")]
                if let Err(e) = picchio_blockdev::UringQueue::probe() {
                    return Ok(Err(picchio_core::error::chain(&e).to_string()));
                }
                (IoEngine::Uring, "io_uring_enter (submit + wait) and the kernel's page-cache copy")
            };
            let resident_before = warm(&p)?;
            let o = open_buffered(&p, io)?;
            Target { queue: o.queue, _lock: o.lock, complete_includes, wait_device: None, resident_before }
        }
        "nvme-sim" => {
            #[cfg(target_os = "linux")]
            {
                use picchio_nvme::{sim::SimConfig, NvmeQueue, NvmeQueueOptions};
                let p = match (store, file()) {
                    (StoreUri::Raw { .. }, _) => {
                        return Ok(Err("the controller model serves a file, not a device".into()))
                    }
                    (_, Ok(p)) => p,
                    (_, Err(e)) => return Ok(Err(e)),
                };
                // A reader's shared lock on the file, as every reader of an image holds (a writer of
                // it waits or is refused); held as long as the queue (`Target::_lock`).
                let name = format!("nvme-sim:{}", p.display());
                let lock = picchio_runtime::image::guard::ReadLock::acquire(&p, &name, false)?;
                let len = std::fs::metadata(&p).map_err(Error::io(&p, "stat"))?.len();
                let lba = if len.is_multiple_of(4096) { 4096 } else { 512 };
                let qopts = NvmeQueueOptions { qd: 1, ..NvmeQueueOptions::default() };
                let (queue, sim) = NvmeQueue::open_sim(SimConfig::single(&p, lba), &qopts)
                    .map_err(picchio_runtime::Error::nvme(format!("nvme-sim:{}", p.display())))?;
                let resident_before = warm(&p)?;
                let mut seen = sim.stats().completions;
                let wait = move || {
                    while sim.stats().completions == seen {
                        std::hint::spin_loop();
                    }
                    seen = sim.stats().completions;
                };
                Target {
                    queue: Box::new(queue),
                    _lock: Some(lock),
                    complete_includes:
                        "the driver's completion work only (the model's CQE is awaited outside the clock)",
                    wait_device: Some(Box::new(wait)),
                    resident_before,
                }
            }
            #[cfg(not(target_os = "linux"))]
            return Ok(Err("picchio-nvme is Linux-only".into()));
        }
        other => {
            return Err(Error::BadOption {
                experiment: Some("overhead"),
                option: "engine",
                value: format!("{other:?}"),
                expected: "expected null, psync, uring or nvme-sim".into(),
            })
        }
    }))
}

/// Measures every engine of `opts`; `progress` is called after each row.
///
/// # Errors
/// An unknown engine, a failed open, a failed or short read.
pub fn run(
    store: &StoreUri,
    opts: &OverheadOptions,
    progress: &mut dyn FnMut(&OverheadRow),
) -> Result<OverheadResults> {
    let layout = super::measure::StoreLayout::of(store)?;
    let (data, payload) = layout.payload();
    let range = opts.resolve_range(data + payload)?;
    let clock = Clock::new(Duration::from_millis(100));
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    for engine in &opts.engines {
        let mut t = match open_target(engine, store, range)? {
            Ok(t) => t,
            Err(reason) => {
                skipped.push(Skipped { what: engine.clone(), reason });
                continue;
            }
        };
        let row = measure_engine(engine, &mut t, opts, range, &clock)?;
        progress(&row);
        rows.push(row);
    }
    Ok(OverheadResults {
        store: store.to_string(),
        clock: if clock.tsc { "rdtsc (lfence; rdtsc), calibrated against CLOCK_MONOTONIC" } else { "CLOCK_MONOTONIC" }
            .into(),
        ticks_per_ns: clock.ticks_per_ns,
        bs: opts.bs,
        range,
        rows,
        skipped,
    })
}

fn measure_engine(
    engine: &str,
    t: &mut Target,
    opts: &OverheadOptions,
    range: u64,
    clock: &Clock,
) -> Result<OverheadRow> {
    let hist = || Histogram::<u64>::new_with_bounds(1, 1_000_000_000_000, 3).expect("valid bounds");
    let (mut hs, mut hc, mut ht) = (hist(), hist(), hist());
    let mut rng = SplitMix64::new(opts.seed, 0);
    let slots = range / u64::from(opts.bs);
    let mut buf = Some(AlignedBuf::new(opts.bs as usize, 4096)?);
    let mut out: Vec<Completion> = Vec::with_capacity(1);
    let warmup = opts.reads / 10;
    for i in 0..warmup + opts.reads {
        let offset = rng.below(slots) * u64::from(opts.bs);
        let req = ReadReq { offset: ByteOffset(offset), len: opts.bs, buf: buf.take().expect("returned"), tag: Tag(i) };
        let t0 = clock.now();
        t.queue.submit(req);
        let t1 = clock.now();
        if let Some(w) = t.wait_device.as_mut() {
            w();
        }
        let t2 = clock.now();
        while out.is_empty() {
            t.queue.reap(1, &mut out);
        }
        let t3 = clock.now();
        let c = out.pop().expect("one completion");
        match c.result {
            Ok(n) if n == opts.bs => {}
            Ok(n) => return Err(Error::ShortRead { engine: engine.to_string(), offset, got: n, len: opts.bs }),
            Err(cause) => return Err(Error::OverheadRead { engine: engine.to_string(), offset, cause }),
        }
        buf = Some(c.buf);
        if i >= warmup {
            let (s, cpl) = (t1.saturating_sub(t0).max(1), t3.saturating_sub(t2).max(1));
            hs.saturating_record(s);
            hc.saturating_record(cpl);
            ht.saturating_record(s + cpl);
        }
    }
    Ok(OverheadRow {
        engine: engine.into(),
        detail: t.queue.describe(),
        complete_includes: t.complete_includes.into(),
        reads: opts.reads,
        submit_ns: CostNs::of(&hs, clock.ticks_per_ns),
        complete_ns: CostNs::of(&hc, clock.ticks_per_ns),
        total_ns: CostNs::of(&ht, clock.ticks_per_ns),
        resident_before: t.resident_before,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_defaults_to_the_image_and_each_bad_option_is_named() {
        let o = |bs, reads, range| OverheadOptions { bs, reads, range, ..OverheadOptions::default() };
        // A 128 KiB image: the 64 MiB default is clamped to it.
        assert_eq!(o(4096, 10, None).resolve_range(128 << 10).unwrap(), 128 << 10);
        assert_eq!(o(4096, 10, None).resolve_range(1 << 30).unwrap(), DEFAULT_RANGE);
        assert_eq!(o(8192, 10, Some(20_000)).resolve_range(1 << 20).unwrap(), 16_384);
        let err = |o: OverheadOptions, end| o.resolve_range(end).unwrap_err().to_string();
        let e = err(o(4096, 10, Some(64 << 20)), 128 << 10);
        assert!(e.contains("--range 67108864") && e.contains("131072 bytes"), "{e}");
        assert!(err(o(1000, 10, None), 1 << 20).contains("--bs 1000"));
        assert!(err(o(4096, 0, None), 1 << 20).contains("--reads 0"));
        let e = err(o(8192, 10, Some(4096)), 1 << 20);
        assert!(e.contains("--range 4096") && e.contains("smaller than one read"), "{e}");
    }

    #[test]
    fn clock_ticks_forward_at_a_calibrated_rate() {
        let c = Clock::new(Duration::from_millis(20));
        assert!(c.ticks_per_ns > 0.0);
        let a = c.now();
        std::thread::sleep(Duration::from_millis(5));
        let b = c.now();
        let ns = (b - a) as f64 / c.ticks_per_ns;
        // At least the sleep (a sleep never ends early); no upper bound is asserted (loaded machine).
        assert!(ns >= 4.0e6, "{ns} ns");
    }
}
