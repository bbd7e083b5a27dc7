//! The measuring loop every I/O experiment shares: engines opened on the store, a point run by `T`
//! submitting threads each keeping `QD` reads in flight on its own queue, and what a point reports.
//!
//! A point's work is a stream of *units*, each one or more reads (`qd-sweep`: one expert read;
//! `layout`: the N per-tensor reads of one expert). Each thread draws units from its own seeded
//! generator, keeps at most `qd` reads submitted, and stops drawing when the point's duration has
//! passed or its share of the byte budget is submitted; reads in flight are then completed. The
//! point's wall time runs from the moment every thread is ready (queues opened, buffers allocated)
//! to the last completion, so throughput = bytes / wall (never a sum of per-read latencies).
//! Per-read latency is the engine's submit-to-completion time ([`picchio_core::Completion`]'s
//! `latency_ns`); per-unit latency is the time from a unit's first submit to its last completion.
//! CPU time is `getrusage(RUSAGE_SELF)` user + system over the same interval (all our threads,
//! psync workers and io_uring's io-wq workers included).

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use picchio_core::{AlignedBuf, ByteOffset, Completion, IoQueue, ReadReq, Tag};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use picchio_core::StoreUri;
use picchio_runtime::expert::open::{EngineOptions, IoEngine, Opened};

/// An I/O engine a bench point uses: a name in reports and on the command line, and the
/// [`EngineOptions`] of the runtime's engine factory ([`picchio_runtime::expert::open::open_engine`])
/// it stands for. The kernel engines read a file or block device; the driver engines read the
/// store's NVMe controller (the model for `nvme-sim:`, VFIO for `nvme:`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "&'static str", try_from = "String")]
pub struct Engine {
    name: &'static str,
    /// The kernel engine and whether it bypasses the page cache; `None` for our NVMe driver.
    kernel: Option<(IoEngine, bool)>,
}

impl Engine {
    /// `PsyncQueue` through the page cache (cache dropped before each point unless `--warm`).
    pub const PSYNC_BUFFERED: Engine = Engine { name: "psync-buffered", kernel: Some((IoEngine::Psync, false)) };
    /// `PsyncQueue` with `O_DIRECT`.
    pub const PSYNC_DIRECT: Engine = Engine { name: "psync-direct", kernel: Some((IoEngine::Psync, true)) };
    /// `UringQueue` with `O_DIRECT` and a registered file (the runtime's default engine).
    pub const URING: Engine = Engine { name: "uring", kernel: Some((IoEngine::Uring, true)) };
    /// Our NVMe driver (`NvmeQueue`) against picchio-nvme's software controller model serving the
    /// image file as namespace 1: the driver's and the model's cost, not a drive's.
    pub const NVME_SIM: Engine = Engine { name: "nvme-sim", kernel: None };
    /// Our NVMe driver over VFIO on a real controller (`nvme:` stores).
    pub const NVME: Engine = Engine { name: "nvme", kernel: None };
    /// Our NVMe/TCP initiator on a remote namespace (`nvme-tcp:` stores): each submitting thread
    /// has its own association with one I/O queue (one TCP connection) of depth `qd`.
    pub const NVME_TCP: Engine = Engine { name: "nvme-tcp", kernel: None };

    /// Every engine, in report order.
    pub const ALL: [Engine; 6] =
        [Engine::PSYNC_BUFFERED, Engine::PSYNC_DIRECT, Engine::URING, Engine::NVME_SIM, Engine::NVME, Engine::NVME_TCP];

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        self.name
    }

    /// Whether reads go through the page cache.
    pub fn buffered(self) -> bool {
        self == Engine::PSYNC_BUFFERED
    }

    /// The runtime's I/O options this engine stands for at `qd` reads in flight (psync: `qd` worker
    /// threads; io_uring without the psync fallback, so a figure labelled `uring` is io_uring's).
    pub fn io_options(self, qd: u32) -> EngineOptions {
        let (engine, direct) = self.kernel.unwrap_or((IoEngine::Psync, true));
        // nvme-tcp: `threads` is the number of I/O queues (TCP connections) of one queue.
        let threads = if self == Engine::NVME_TCP { 1 } else { qd as usize };
        EngineOptions { engine, direct, threads, qd, uring_fallback: false, ..EngineOptions::default() }
    }

    /// Checks that this engine reads `store`: a kernel engine a file or block device, `nvme-sim`
    /// an `nvme-sim:` store, `nvme` an `nvme:` one.
    ///
    /// # Errors
    /// [`Error::EngineStore`] naming the engine, the store and what it reads.
    pub fn check_reads(self, store: &StoreUri) -> Result<()> {
        let ok = match (self.kernel, store) {
            (Some(_), StoreUri::File(_) | StoreUri::Raw { .. }) => true,
            (None, StoreUri::NvmeSim(_)) => self == Engine::NVME_SIM,
            (None, StoreUri::Nvme { .. }) => self == Engine::NVME,
            (None, StoreUri::NvmeTcp { .. }) => self == Engine::NVME_TCP,
            _ => false,
        };
        match (ok, self.kernel) {
            (true, _) => Ok(()),
            (false, kernel) => Err(Error::EngineStore {
                engine: self.to_string(),
                needs: match kernel {
                    Some(_) => "reads a file or block device",
                    None if self == Engine::NVME_SIM => "needs an nvme-sim:PATH store",
                    None if self == Engine::NVME_TCP => "needs an nvme-tcp://HOST:PORT/NQN[/NSID] store",
                    None => "needs an nvme:BDF store",
                },
                store: store.to_string(),
            }),
        }
    }

    /// The engines that can read `store` by default: the kernel engines for a file or device, the
    /// driver against the controller model for `nvme-sim:`, the VFIO driver for `nvme:`. io_uring is
    /// left out (with the reason in `skipped`) where the kernel refuses it.
    pub fn defaults_for(store: &StoreUri, skipped: &mut Vec<Skipped>) -> Vec<Engine> {
        match store {
            StoreUri::NvmeSim(_) => vec![Engine::NVME_SIM],
            StoreUri::Nvme { .. } => vec![Engine::NVME],
            StoreUri::NvmeTcp { .. } => vec![Engine::NVME_TCP],
            _ => {
                let mut v = vec![Engine::PSYNC_BUFFERED, Engine::PSYNC_DIRECT];
                match uring_unavailable() {
                    None => v.push(Engine::URING),
                    Some(reason) => skipped.push(Skipped { what: "uring".into(), reason }),
                }
                v
            }
        }
    }
}

impl From<Engine> for &'static str {
    fn from(e: Engine) -> &'static str {
        e.name
    }
}

impl TryFrom<String> for Engine {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Self, String> {
        s.parse()
    }
}

impl std::fmt::Display for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Engine {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Engine::ALL.into_iter().find(|e| e.name() == s).ok_or_else(|| {
            format!("unknown engine {s:?}: expected psync-buffered, psync-direct, uring, nvme-sim or nvme")
        })
    }
}

/// Something an experiment did not run, and why (reported, never silently dropped).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skipped {
    /// The engine, tier or comparison.
    pub what: String,
    /// Why.
    pub reason: String,
}

#[cfg(target_os = "linux")]
fn uring_unavailable() -> Option<String> {
    picchio_blockdev::UringQueue::probe().err().map(|e| picchio_core::error::chain(&e).to_string())
}

#[cfg(not(target_os = "linux"))]
fn uring_unavailable() -> Option<String> {
    Some("io_uring is Linux-only".into())
}

/// The most reads in flight per queue a bench point runs (`--qd`): as `picchio run --qd`, and
/// what io_uring accepts ([`picchio_blockdev::MAX_QD`]); the psync engines start one worker thread
/// per read in flight, capped by [`picchio_blockdev::MAX_THREADS`].
pub const MAX_QD: u32 = 256;

/// The most submitting threads of a bench point (`--threads`), each with its own queue (and, for
/// `nvme-sim`, its own controller model): as `picchio run --io-threads`.
pub const MAX_THREADS: u32 = 256;

/// Above this fraction of the image's pages resident just after `posix_fadvise(DONTNEED)`, the drop
/// is reported as not having taken effect (`drop-ineffective`): tmpfs and ramfs pages *are* the
/// file and cannot be evicted, and pages mapped or locked by another process stay.
pub const DROP_INEFFECTIVE_ABOVE: f64 = 0.01;

/// Checks a point's `threads` and `qd` against [`MAX_THREADS`] and [`MAX_QD`] (both at least 1),
/// before any thread or queue is made.
///
/// # Errors
/// [`Error::BadOption`] naming the option, the value and the bound.
pub fn check_depth(threads: u32, qd: u32) -> Result<()> {
    let within = |option: &'static str, value: u32, max: u32, what: &str| match (1..=max).contains(&value) {
        true => Ok(()),
        false => Err(Error::BadOption {
            experiment: None,
            option,
            value: value.to_string(),
            expected: format!("must be 1 to {max} {what}"),
        }),
    };
    within("--threads", threads, MAX_THREADS, "(a queue per thread)")?;
    within("--qd", qd, MAX_QD, "reads in flight per thread")
}

/// Checks that a point's read buffers — `threads × qd × max_read` bytes, allocated before the
/// clock starts — fit in half of `available` memory (`MemAvailable`; unchecked when unknown), so
/// a large expert at 256 × 256 is refused with the figure instead of driving the machine out of
/// memory.
///
/// # Errors
/// [`Error::BufferMemory`] naming the threads, depth, read size and the bytes needed and available.
pub fn check_buffer_memory(threads: u32, qd: u32, max_read: u32, available: Option<u64>) -> Result<()> {
    let need = u64::from(threads) * u64::from(qd) * u64::from(max_read);
    match available {
        Some(available) if need > available / 2 => Err(Error::BufferMemory { threads, qd, max_read, need, available }),
        _ => Ok(()),
    }
}

/// Opens `engine` on `store` with `qd` reads in flight (psync: `qd` worker threads): the queue,
/// the image's base and length on the target and the reader's lock, through the runtime's engine
/// factory ([`picchio_runtime::expert::open::open_engine`]; a `raw:` store is
/// checked as `picchio run` and `picchio verify` check it: a block device, a whole-LBA offset
/// inside it).
///
/// # Errors
/// [`Error::EngineStore`] when the engine cannot read this kind of store; the engine's open errors.
pub fn open(store: &StoreUri, engine: Engine, qd: u32) -> Result<Opened> {
    check_depth(1, qd)?;
    engine.check_reads(store)?;
    Ok(picchio_runtime::expert::open::open_engine(store, engine.io_options(qd))?)
}

/// The image's geometry as the bench reads it: the superblock and every usable entry.
#[derive(Clone, Debug)]
pub struct StoreLayout {
    /// The checked superblock.
    pub superblock: picchio_core::Superblock,
    /// Byte offset and padded length of each entry that passed the checks at open.
    pub entries: Vec<(u64, u32)>,
    /// Image bytes from its first byte to the end of the target.
    pub image_len: u64,
}

impl StoreLayout {
    /// Opens the image through `engine` and reads its superblock and index (checked as
    /// [`picchio_core::FlatStore::open`] checks them).
    ///
    /// # Errors
    /// The engine's open errors; [`Error::Store`] for a bad superblock or index; [`Error::NoUsableEntry`]
    /// for an image without a usable entry.
    pub fn read(store: &StoreUri, engine: Engine) -> Result<Self> {
        let opened = open(store, engine, 1)?;
        let image_len = opened.image_len;
        let opts = picchio_core::FlatStoreOptions { base_offset: opened.base, image_len, ..Default::default() };
        // The reader's lock is held until the superblock and index are read.
        let flat = picchio_core::FlatStore::open(opened.queue, store.to_string(), opts)?;
        let sb = flat.superblock().clone();
        let entries: Vec<(u64, u32)> = (0..sb.n_entries)
            .filter_map(|i| {
                let key = picchio_core::ExpertKey { layer: i / sb.n_experts, expert: i % sb.n_experts };
                flat.entry(key).ok().map(|l| (l.offset, l.padded_len))
            })
            .collect();
        if entries.is_empty() {
            return Err(Error::NoUsableEntry { store: store.to_string() });
        }
        Ok(StoreLayout { superblock: sb, entries, image_len })
    }

    /// [`StoreLayout::read`] through the engine that reads any store of this kind (psync buffered
    /// for a file, psync O_DIRECT for a `raw:` block device, the driver for `nvme-sim:` and
    /// `nvme:`): what every experiment does first, so a missing path, a directory, a regular file
    /// given as `raw:` or a file that is not an image is refused before anything is measured.
    ///
    /// # Errors
    /// As [`StoreLayout::read`].
    pub fn of(store: &StoreUri) -> Result<Self> {
        let engine = match store {
            StoreUri::Raw { .. } => Engine::PSYNC_DIRECT,
            StoreUri::NvmeSim(_) => Engine::NVME_SIM,
            StoreUri::Nvme { .. } => Engine::NVME,
            StoreUri::NvmeTcp { .. } => Engine::NVME_TCP,
            _ => Engine::PSYNC_BUFFERED,
        };
        if let StoreUri::File(p) | StoreUri::NvmeSim(p) = store {
            match std::fs::metadata(p) {
                Ok(m) if m.is_file() => {}
                Ok(_) => return Err(Error::NotRegularFile { store: store.to_string() }),
                Err(e) => return Err(Error::io(p, "open the store")(e)),
            }
        }
        Self::read(store, engine)
    }

    /// The payload area: image bytes from the superblock's `data_offset` to the end of the last
    /// entry (what `overhead` and `qd-sweep --bs` draw reads from).
    pub fn payload(&self) -> (u64, u64) {
        let lo = self.superblock.data_offset;
        let hi = self.entries.iter().map(|&(o, l)| o + u64::from(l)).max().unwrap_or(lo);
        (lo, hi.saturating_sub(lo))
    }

    /// The most common padded length among the entries (the expert read size; dense-layer
    /// placeholders and stray entries are smaller) and the entries that have it.
    pub fn expert_entries(&self) -> (u32, Vec<u64>) {
        let mut counts = std::collections::BTreeMap::<u32, usize>::new();
        for &(_, len) in &self.entries {
            *counts.entry(len).or_default() += 1;
        }
        let (&len, _) = counts.iter().max_by_key(|&(l, n)| (*n, *l)).expect("at least one entry");
        (len, self.entries.iter().filter(|e| e.1 == len).map(|e| e.0).collect())
    }
}

/// The bench's seeded offset generator: [`picchio_core::rng::SplitMix64`] (Steele, Lea & Flood,
/// OOPSLA 2014), one stream per thread.
#[derive(Clone, Debug)]
pub struct SplitMix64(picchio_core::rng::SplitMix64);

impl SplitMix64 {
    /// A generator for stream `stream` of `seed` ([`picchio_core::rng::SplitMix64::stream`], advanced
    /// once; streams are independent for practical purposes).
    pub fn new(seed: u64, stream: u64) -> Self {
        let mut g = picchio_core::rng::SplitMix64::stream(seed, stream);
        g.next_u64();
        SplitMix64(g)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `0..n` (`n > 0`; Lemire's multiply-shift, bias below 2⁻³² for the n used here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0.below(n)
    }
}

/// When a point stops drawing new units.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stop {
    /// After this much wall time (seconds).
    Duration(f64),
    /// After this many bytes have been submitted (over all threads).
    Bytes(u64),
}

/// One point: an engine at `threads` × `qd`.
#[derive(Clone, Debug)]
pub struct PointSpec {
    /// The engine.
    pub engine: Engine,
    /// Submitting threads, each with its own queue.
    pub threads: u32,
    /// Reads in flight per thread.
    pub qd: u32,
    /// When to stop.
    pub stop: Stop,
    /// Seed of the units drawn.
    pub seed: u64,
    /// Leave the page cache as it is (buffered engines; otherwise dropped before the point).
    pub warm: bool,
}

/// Draws the next unit's reads into the vector: `(image offset, length)` pairs.
pub type DrawUnit = dyn FnMut(&mut SplitMix64, &mut Vec<(u64, u32)>) + Send;

/// A thread's [`DrawUnit`].
pub type UnitSource = Box<DrawUnit>;

/// Latency percentiles in microseconds, from an HDR histogram of nanoseconds (3 significant
/// digits: each percentile and `max` is the upper end of its bucket, so `p50 <= p90 <= … <= max`,
/// within 0.1% of the exact value; `min` and `mean` are exact up to the same resolution).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyUs {
    /// Samples.
    pub count: u64,
    /// Smallest.
    pub min: f64,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p99_9: f64,
    /// Largest.
    pub max: f64,
}

impl LatencyUs {
    /// The percentiles of `h` (nanoseconds).
    pub fn of(h: &Histogram<u64>) -> Self {
        let us = |ns: u64| ns as f64 / 1000.0;
        if h.is_empty() {
            return LatencyUs::default();
        }
        LatencyUs {
            count: h.len(),
            min: us(h.min()),
            mean: h.mean() / 1000.0,
            p50: us(h.value_at_quantile(0.5)),
            p90: us(h.value_at_quantile(0.9)),
            p99: us(h.value_at_quantile(0.99)),
            p99_9: us(h.value_at_quantile(0.999)),
            max: us(h.highest_equivalent(h.max())),
        }
    }
}

/// A histogram of nanoseconds from 1 ns to 100 s at 3 significant digits.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("valid bounds")
}

/// CPU time over a point.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuTime {
    /// User time, seconds.
    pub user_s: f64,
    /// System time, seconds.
    pub sys_s: f64,
    /// (user + system) seconds per 10⁹ bytes read.
    pub s_per_gb: f64,
}

/// The page cache before a point.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CacheState {
    /// `dropped` (posix_fadvise DONTNEED on the target before the point), `drop-ineffective` (the
    /// same was asked, but more than [`DROP_INEFFECTIVE_ABOVE`] of the image stayed resident — tmpfs
    /// or ramfs, whose pages are the file, or pages another process maps — so the point read
    /// memory, not the device), `bypassed` (O_DIRECT or the NVMe driver), `warm` (`--warm`: left as
    /// it was), or `model` (the controller model reads its backing file through the page cache,
    /// whatever we do).
    pub action: String,
    /// Fraction of the image's pages in the page cache just before the point (`mincore`), for a
    /// file; `null` for a device or where it cannot be measured.
    pub resident_before: Option<f64>,
}

/// What one point measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PointResult {
    /// Engine name (`psync-buffered`, …).
    pub engine: String,
    /// The engine's own description of one thread's queue, e.g. `uring(direct, qd 32, …)`.
    pub engine_detail: String,
    /// Submitting threads.
    pub threads: u32,
    /// Reads in flight per thread.
    pub qd: u32,
    /// Units completed (expert reads for qd-sweep, experts for layout).
    pub units: u64,
    /// Reads completed.
    pub reads: u64,
    /// Bytes read (sum of the reads' lengths).
    pub bytes: u64,
    /// Wall time of the point, seconds (all threads ready → last completion).
    pub wall_s: f64,
    /// bytes / wall_s / 10⁶.
    pub mb_s: f64,
    /// reads / wall_s.
    pub iops: f64,
    /// units / wall_s.
    pub units_per_s: f64,
    /// Per-read latency (submit → completion as the engine reports it).
    pub latency_us: LatencyUs,
    /// Per-unit latency (first submit → last completion of the unit).
    pub unit_latency_us: LatencyUs,
    /// CPU time of the process over the point.
    pub cpu: CpuTime,
    /// The page cache before the point.
    pub page_cache: CacheState,
}

/// Runs one point: `spec.threads` threads, each opening `spec.engine` on `store` at depth `spec.qd`
/// and drawing units from `make_source(thread)` with generator `SplitMix64::new(seed, thread)`.
/// `max_read` is the largest read a unit may contain (buffers are allocated up front).
///
/// # Errors
/// Opening the engine; [`Error::PointRead`] naming the engine, the depth and the cause when a read fails or
/// comes back short (a bench figure with failed reads in it would be wrong).
pub fn run_point(
    store: &StoreUri,
    spec: &PointSpec,
    max_read: u32,
    make_source: &dyn Fn(u32) -> UnitSource,
) -> Result<PointResult> {
    check_depth(spec.threads, spec.qd)?;
    let (threads, qd) = (spec.threads, spec.qd);
    check_buffer_memory(threads, qd, max_read, super::env::memory().map(|m| m.available_bytes))?;
    let page_cache = prepare_cache(store, spec)?;
    // Open every queue before starting the clock; an open error ends the point before it starts.
    let mut opened = Vec::with_capacity(threads as usize);
    for _ in 0..threads {
        opened.push(open(store, spec.engine, qd)?);
    }
    let engine_detail = opened[0].queue.describe();
    let gate = Arc::new(StartGate::default());
    let per_thread_bytes = match spec.stop {
        Stop::Bytes(b) => Some(b.div_ceil(u64::from(threads)).max(1)),
        Stop::Duration(_) => None,
    };
    let duration = match spec.stop {
        Stop::Duration(s) => Some(Duration::from_secs_f64(s.max(0.0))),
        Stop::Bytes(_) => None,
    };
    let mut handles = Vec::with_capacity(threads as usize);
    for (t, o) in opened.into_iter().enumerate() {
        let g = gate.clone();
        let source = make_source(t as u32);
        let seed = spec.seed;
        let spawned = std::thread::Builder::new().name(format!("picchio-bench-{t}")).spawn(move || {
            thread_loop(o, source, SplitMix64::new(seed, t as u64), qd, max_read, duration, per_thread_bytes, &g)
        });
        match spawned {
            Ok(h) => handles.push(h),
            Err(cause) => {
                // The threads already started are told not to measure, and end.
                gate.open(false);
                handles.into_iter().for_each(|h| drop(h.join()));
                return Err(Error::SpawnMeasure { index: t, cause });
            }
        }
    }
    // Every thread has its queue and buffers (or ended early: then nobody measures).
    if !gate.wait_ready(&handles) {
        gate.open(false);
        handles.into_iter().for_each(|h| drop(h.join()));
        return Err(Error::MeasureThread { what: "ended before the start" });
    }
    let ru0 = rusage();
    let t0 = Instant::now();
    gate.open(true);
    // Threads hand their queues back, so no queue is torn down (psync joins its workers, io_uring
    // drains, the NVMe driver shuts down) inside the measured CPU time.
    let joined: Vec<_> = handles.into_iter().map(|h| h.join()).collect();
    let ru1 = rusage();
    let mut reads_h = histogram();
    let mut units_h = histogram();
    let (mut reads, mut bytes, mut units) = (0u64, 0u64, 0u64);
    let mut end = t0;
    let mut first_error = None;
    let mut queues = Vec::with_capacity(joined.len());
    for j in joined {
        let (r, queue) = j.map_err(|_| Error::MeasureThread { what: "panicked" })?;
        queues.push(queue);
        match r {
            Ok(s) => {
                reads += s.reads;
                bytes += s.bytes;
                units += s.units;
                end = end.max(s.end);
                reads_h.add(&s.reads_h).expect("same bounds");
                units_h.add(&s.units_h).expect("same bounds");
            }
            Err(e) => first_error = first_error.or(Some(e)),
        }
    }
    if let Some(e) = first_error {
        return Err(Error::PointRead {
            store: store.to_string(),
            engine: spec.engine.to_string(),
            threads,
            qd,
            reason: e,
        });
    }
    let wall_s = end.duration_since(t0).as_secs_f64().max(1e-9);
    let (user_s, sys_s) = (ru1.0 - ru0.0, ru1.1 - ru0.1);
    Ok(PointResult {
        engine: spec.engine.name().into(),
        engine_detail,
        threads,
        qd,
        units,
        reads,
        bytes,
        wall_s,
        mb_s: bytes as f64 / wall_s / 1e6,
        iops: reads as f64 / wall_s,
        units_per_s: units as f64 / wall_s,
        latency_us: LatencyUs::of(&reads_h),
        unit_latency_us: LatencyUs::of(&units_h),
        cpu: CpuTime {
            user_s,
            sys_s,
            s_per_gb: if bytes == 0 { 0.0 } else { (user_s + sys_s) / (bytes as f64 / 1e9) },
        },
        page_cache,
    })
}

struct ThreadStats {
    reads: u64,
    bytes: u64,
    units: u64,
    end: Instant,
    reads_h: Histogram<u64>,
    units_h: Histogram<u64>,
}

/// A unit in flight: when its first read was submitted and how many reads are outstanding.
struct UnitState {
    started: Instant,
    remaining: u32,
}

#[allow(clippy::too_many_arguments)]
fn thread_loop(
    mut opened: Opened,
    mut source: UnitSource,
    mut rng: SplitMix64,
    qd: u32,
    max_read: u32,
    duration: Option<Duration>,
    byte_budget: Option<u64>,
    gate: &StartGate,
) -> (std::result::Result<ThreadStats, String>, Opened) {
    let queue = &mut opened.queue;
    // Buffers first (from the engine's zero-copy memory when it has some), outside the clock.
    let mut bufs: Vec<AlignedBuf> = Vec::with_capacity(qd as usize);
    let mut alloc = queue.slot_allocator(qd as usize, max_read as usize);
    let align = queue.block_size().max(4096) as usize;
    let mut setup_error = None;
    for _ in 0..qd {
        let b = match alloc.as_mut().map(|a| a.alloc(max_read as usize)) {
            Some(Ok(b)) => Ok(b),
            _ => AlignedBuf::new(max_read as usize, align),
        };
        match b {
            Ok(b) => bufs.push(b),
            Err(e) => {
                setup_error = Some(picchio_core::error::chain(&e).to_string());
                break;
            }
        }
    }
    if !gate.arrive_and_wait() {
        return (Err("the point was called off before the start".into()), opened);
    }
    let result = match setup_error {
        Some(e) => Err(e),
        None => measure(&mut **queue, opened.base, &mut *source, &mut rng, bufs, duration, byte_budget),
    };
    (result, opened)
}

/// The start line of a point: measuring threads arrive when ready and wait; the coordinator waits
/// until all have arrived, then lets them go (or calls the point off).
#[derive(Default)]
struct StartGate {
    /// (threads arrived, the decision: `Some(true)` go, `Some(false)` called off).
    state: Mutex<(usize, Option<bool>)>,
    cv: Condvar,
}

impl StartGate {
    /// A measuring thread: counts itself ready and waits for the decision.
    fn arrive_and_wait(&self) -> bool {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.0 += 1;
        self.cv.notify_all();
        while st.1.is_none() {
            st = self.cv.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        st.1 == Some(true)
    }

    /// The coordinator: waits until every thread of `handles` has arrived; `false` if one of them
    /// ended first (a setup panic), so the wait never hangs.
    fn wait_ready<T>(&self, handles: &[std::thread::JoinHandle<T>]) -> bool {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        while st.0 < handles.len() {
            if handles.iter().any(std::thread::JoinHandle::is_finished) {
                return false;
            }
            st = self.cv.wait_timeout(st, Duration::from_millis(20)).unwrap_or_else(PoisonError::into_inner).0;
        }
        true
    }

    /// The coordinator: go (`true`) or call the point off (`false`).
    fn open(&self, go: bool) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).1 = Some(go);
        self.cv.notify_all();
    }
}

/// Units drawn from `source` are image offsets; reads go to `base` plus them on the target.
fn measure(
    queue: &mut dyn IoQueue,
    base: u64,
    source: &mut DrawUnit,
    rng: &mut SplitMix64,
    mut bufs: Vec<AlignedBuf>,
    duration: Option<Duration>,
    byte_budget: Option<u64>,
) -> std::result::Result<ThreadStats, String> {
    let t0 = Instant::now();
    let deadline = duration.map(|d| t0 + d);
    let mut st = ThreadStats { reads: 0, bytes: 0, units: 0, end: t0, reads_h: histogram(), units_h: histogram() };
    let mut pending: VecDeque<(u32, u64, u32)> = VecDeque::new();
    let mut units: Vec<Option<UnitState>> = Vec::new();
    let mut free_units: Vec<u32> = Vec::new();
    let mut unit_reads = Vec::new();
    let mut submitted_bytes = 0u64;
    let mut drawing = true;
    let mut out: Vec<Completion> = Vec::new();
    let mut error: Option<String> = None;
    loop {
        while !bufs.is_empty() && error.is_none() {
            if pending.is_empty() {
                let over_time = deadline.is_some_and(|d| Instant::now() >= d);
                let over_bytes = byte_budget.is_some_and(|b| submitted_bytes >= b);
                if !drawing || over_time || over_bytes {
                    drawing = false;
                    break;
                }
                unit_reads.clear();
                source(rng, &mut unit_reads);
                let id = free_units.pop().unwrap_or_else(|| {
                    units.push(None);
                    units.len() as u32 - 1
                });
                units[id as usize] = Some(UnitState { started: Instant::now(), remaining: unit_reads.len() as u32 });
                for &(off, len) in &unit_reads {
                    pending.push_back((id, off, len));
                    submitted_bytes += u64::from(len);
                }
            }
            let Some((id, off, len)) = pending.pop_front() else { break };
            let buf = bufs.pop().expect("checked non-empty");
            let offset = ByteOffset(base + off);
            queue.submit(ReadReq { offset, len, buf, tag: Tag(u64::from(id) << 32 | u64::from(len)) });
        }
        if queue.in_flight() == 0 {
            break;
        }
        out.clear();
        queue.reap(1, &mut out);
        let now = Instant::now();
        for c in out.drain(..) {
            let id = (c.tag.0 >> 32) as u32;
            let want = c.tag.0 as u32;
            match &c.result {
                Ok(n) if *n == want => {
                    st.reads += 1;
                    st.bytes += u64::from(want);
                    st.reads_h.saturating_record(c.latency_ns.max(1));
                }
                Ok(n) => {
                    error.get_or_insert_with(|| format!("short read: {n} of {want} bytes"));
                }
                Err(e) => {
                    error.get_or_insert_with(|| picchio_core::error::chain(e).to_string());
                }
            }
            bufs.push(c.buf);
            if let Some(u) = units.get_mut(id as usize).and_then(Option::as_mut) {
                u.remaining -= 1;
                if u.remaining == 0 {
                    let ns = u64::try_from(now.duration_since(u.started).as_nanos()).unwrap_or(u64::MAX);
                    st.units_h.saturating_record(ns.max(1));
                    st.units += 1;
                    units[id as usize] = None;
                    free_units.push(id);
                }
            }
        }
        st.end = now;
        if error.is_some() {
            drawing = false;
            pending.clear();
        }
    }
    match error {
        Some(e) => Err(e),
        None => Ok(st),
    }
}

/// `getrusage(RUSAGE_SELF)` user and system seconds ([`picchio_blockdev::host::cpu_seconds`]);
/// zero where unavailable.
pub fn rusage() -> (f64, f64) {
    picchio_blockdev::host::cpu_seconds().unwrap_or((0.0, 0.0))
}

/// Drops (or leaves, with `warm`) the page cache of the store's file or device before a buffered
/// point, and measures what is resident.
fn prepare_cache(store: &StoreUri, spec: &PointSpec) -> Result<CacheState> {
    let path = store.local_path();
    let resident = |p: &Option<&std::path::Path>| p.and_then(resident_fraction);
    Ok(match spec.engine {
        Engine::PSYNC_BUFFERED if spec.warm => CacheState { action: "warm".into(), resident_before: resident(&path) },
        Engine::PSYNC_BUFFERED => {
            if let Some(p) = path {
                drop_cache(p)?;
            }
            let resident_before = resident(&path);
            let action = if resident_before.is_some_and(|r| r > DROP_INEFFECTIVE_ABOVE) {
                tracing::warn!(
                    "{store}: {:.0}% of the image is still in the page cache after posix_fadvise(DONTNEED) \
                     (tmpfs/ramfs, or mapped elsewhere): the psync-buffered point reads memory, not the device",
                    resident_before.unwrap_or(0.0) * 100.0
                );
                "drop-ineffective"
            } else {
                "dropped"
            };
            CacheState { action: action.into(), resident_before }
        }
        Engine::NVME_SIM => CacheState { action: "model".into(), resident_before: resident(&path) },
        _ => CacheState { action: "bypassed".into(), resident_before: resident(&path) },
    })
}

/// Evicts the clean page-cache pages of `path` ([`picchio_blockdev::pagecache::drop`], which
/// repeats the drop while pages of reads still in flight reappear). The image is never written while
/// measured, so every page is clean.
///
/// # Errors
/// [`Error::Io`] naming the path.
pub fn drop_cache(path: &std::path::Path) -> Result<()> {
    picchio_blockdev::pagecache::drop(path).map_err(Error::io(path, "drop its page cache (posix_fadvise DONTNEED)"))
}

/// Fraction of a regular file's pages in the page cache
/// ([`picchio_blockdev::pagecache::resident_fraction`]), or `None` for anything else, on failure or
/// off Linux.
pub fn resident_fraction(path: &std::path::Path) -> Option<f64> {
    picchio_blockdev::pagecache::resident_fraction(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_and_buffer_memory_are_bounded() {
        assert!(check_depth(1, 1).is_ok() && check_depth(MAX_THREADS, MAX_QD).is_ok());
        for (t, q) in [(0, 1), (1, 0), (MAX_THREADS + 1, 1), (1, MAX_QD + 1), (100_000, 1)] {
            assert!(check_depth(t, q).is_err(), "{t} × {q}");
        }
        // 256 × 256 reads of a 2.6 MB expert: 174 GB of buffers, refused with 24 GiB available.
        let e = check_buffer_memory(256, 256, 2_654_208, Some(24 << 30)).unwrap_err().to_string();
        assert!(e.contains("256 threads × QD 256") && e.contains("173946175488 bytes"), "{e}");
        assert!(check_buffer_memory(2, 32, 2_654_208, Some(24 << 30)).is_ok());
        assert!(check_buffer_memory(256, 256, 2_654_208, None).is_ok());
    }

    #[test]
    fn engine_names_round_trip() {
        for e in Engine::ALL {
            assert_eq!(e.name().parse::<Engine>().unwrap(), e);
            assert_eq!(serde_json::to_value(e).unwrap(), serde_json::json!(e.name()));
        }
        assert!("sync".parse::<Engine>().is_err());
    }

    #[test]
    fn percentiles_are_ordered_and_in_microseconds() {
        let mut h = histogram();
        for ns in [1_000u64, 2_000, 3_000, 50_000, 1_000_000] {
            h.record(ns).unwrap();
        }
        let l = LatencyUs::of(&h);
        assert_eq!(l.count, 5);
        assert!((l.min - 1.0).abs() < 0.01 && (l.max - 1000.0).abs() < 1.0, "{l:?}");
        assert!(l.min <= l.p50 && l.p50 <= l.p90 && l.p90 <= l.p99 && l.p99 <= l.p99_9 && l.p99_9 <= l.max);
    }

    #[test]
    fn generator_is_seeded_and_bounded() {
        let mut a = SplitMix64::new(1, 0);
        let mut b = SplitMix64::new(1, 0);
        let mut c = SplitMix64::new(1, 1);
        let (x, y, z): (Vec<u64>, Vec<u64>, Vec<u64>) =
            (0..64).map(|_| (a.below(10), b.below(10), c.below(10))).fold((vec![], vec![], vec![]), |mut acc, t| {
                acc.0.push(t.0);
                acc.1.push(t.1);
                acc.2.push(t.2);
                acc
            });
        assert_eq!(x, y);
        assert_ne!(x, z);
        assert!(x.iter().all(|&v| v < 10));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn drop_cache_empties_the_file_from_the_page_cache() {
        // On the build disk, not /tmp (often a tmpfs, whose pages are the file: DONTNEED cannot
        // evict them); a file of this test's own, so no other test's reads refill its pages.
        let dir = picchio_testkit::scratch::dir_in(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/test-scratch"));
        let p = dir.path().join("f");
        std::fs::write(&p, vec![7u8; 1 << 20]).unwrap();
        let spec = StoreUri::File(p.clone());
        let fs = crate::env::Environment::capture(Some(&spec)).target.and_then(|t| t.filesystem);
        assert!(
            fs.as_ref().is_none_or(|f| f.fstype != "tmpfs"),
            "{} is on tmpfs: put the target dir on a disk",
            p.display()
        );
        let f = std::fs::File::open(&p).unwrap();
        f.sync_all().unwrap();
        let _ = std::fs::read(&p).unwrap();
        let before = resident_fraction(&p).unwrap();
        drop_cache(&p).unwrap();
        let after = resident_fraction(&p).unwrap();
        assert!(after < before || before == 0.0, "before {before}, after {after}");
        assert!(after < 0.5, "after {after}");
    }
}
