//! `picchio bench qd-sweep`: random reads over the store at each queue depth × thread count ×
//! engine, with fio's figure beside ours when fio is installed.
//!
//! Reads are expert-sized by default: each read is one whole index entry (`padded_len` bytes at the
//! entry's offset), drawn uniformly among the entries of the most common length — the read the
//! runtime issues for a cache miss. With `--bs B` (a multiple of 4096) reads are `B` bytes at
//! offsets `data_offset + k·B` drawn uniformly over the data region, which is fio's pattern for
//! `--offset=data_offset --size=region --bs=B`.

use serde::{Deserialize, Serialize};

use super::fio::{self, FioJob, FioResult};
use super::measure::{self, Engine, PointResult, PointSpec, Skipped, Stop, StoreLayout, UnitSource};
use crate::error::{Error, Result};
use picchio_core::StoreUri;

/// Options of [`run`] (recorded in the report's `flags`).
#[derive(Clone, Debug, Serialize)]
pub struct QdSweepOptions {
    /// Engines to measure (`None`: every engine that can read the store, see
    /// [`Engine::defaults_for`]).
    pub engines: Option<Vec<Engine>>,
    /// Queue depths (reads in flight per thread).
    pub qds: Vec<u32>,
    /// Submitting-thread counts (each thread has its own queue).
    pub threads: Vec<u32>,
    /// Read size in bytes (`None`: one expert entry per read).
    pub bs: Option<u32>,
    /// Per point: stop after this duration or byte count.
    pub stop: Stop,
    /// Seed of our offsets (fio's are not seeded: see [`super::fio`]).
    pub seed: u64,
    /// Do not drop the page cache before buffered points.
    pub warm: bool,
    /// Run fio beside each point when it is installed.
    pub fio: bool,
}

impl Default for QdSweepOptions {
    fn default() -> Self {
        QdSweepOptions {
            engines: None,
            qds: vec![1, 2, 4, 8, 16, 32, 64, 128, 256],
            threads: (1..=std::thread::available_parallelism().map_or(1, usize::from) as u32).collect(),
            bs: None,
            stop: Stop::Duration(2.0),
            seed: 0,
            warm: false,
            fio: true,
        }
    }
}

/// The region reads are drawn from.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    /// `expert entries` or `bs-aligned offsets`.
    pub pattern: String,
    /// First byte (image offset).
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Distinct reads that can be drawn (entries, or region / bs).
    pub candidates: u64,
}

/// One point of the sweep: ours, and fio's when it ran.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QdPoint {
    /// Our measurement (engine, threads, qd, mb_s, latency_us, …).
    #[serde(flatten)]
    pub ours: PointResult,
    /// Read size of the point, bytes.
    pub bs: u32,
    /// fio with the same pattern (`null` when fio is absent, off, or has no such engine).
    pub fio: Option<FioResult>,
    /// Our MB/s divided by fio's.
    pub ours_over_fio: Option<f64>,
}

/// `results` of a qd-sweep report.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QdSweepResults {
    /// The store measured.
    pub store: String,
    /// Read size, bytes.
    pub bs: u32,
    /// Where reads land.
    pub region: Region,
    /// `fio --version`, when fio ran.
    pub fio_version: Option<String>,
    /// Every point, in the order measured (engine, then threads, then qd).
    pub points: Vec<QdPoint>,
    /// Engines or comparisons not run, with the reason.
    pub skipped: Vec<Skipped>,
}

/// The unit source of expert-sized reads over `entries`, or `bs` reads over `region`.
pub(crate) fn read_source(entries: Option<std::sync::Arc<Vec<u64>>>, region: &Region, bs: u32) -> UnitSource {
    let (offset, candidates) = (region.offset, region.candidates);
    Box::new(move |rng, out| {
        let k = rng.below(candidates);
        let off = match &entries {
            Some(e) => e[k as usize],
            None => offset + k * u64::from(bs),
        };
        out.push((off, bs));
    })
}

/// Reads the store's index and decides the read size and region.
pub(crate) fn plan(
    store: &StoreUri,
    engine: Engine,
    bs: Option<u32>,
) -> Result<(StoreLayout, u32, Region, Option<Vec<u64>>)> {
    let layout = StoreLayout::read(store, engine)?;
    let (expert_len, offsets) = layout.expert_entries();
    Ok(match bs {
        None => {
            let lo = *offsets.iter().min().expect("non-empty");
            let hi = offsets.iter().max().expect("non-empty") + u64::from(expert_len);
            let region =
                Region { pattern: "expert entries".into(), offset: lo, len: hi - lo, candidates: offsets.len() as u64 };
            (layout, expert_len, region, Some(offsets))
        }
        Some(b) => {
            if b == 0 || !b.is_multiple_of(4096) {
                return Err(Error::BadOption {
                    experiment: None,
                    option: "--bs",
                    value: b.to_string(),
                    expected: "must be a positive multiple of 4096 bytes".into(),
                });
            }
            let lo = layout.superblock.data_offset;
            let hi = layout.entries.iter().map(|&(o, l)| o + u64::from(l)).max().expect("non-empty");
            let candidates = (hi - lo) / u64::from(b);
            if candidates == 0 {
                return Err(Error::BadOption {
                    experiment: None,
                    option: "--bs",
                    value: b.to_string(),
                    expected: format!("larger than the data region ({} bytes)", hi - lo),
                });
            }
            let region =
                Region { pattern: "bs-aligned offsets".into(), offset: lo, len: candidates * u64::from(b), candidates };
            (layout, b, region, None)
        }
    })
}

/// The engines to run: the requested ones, or the defaults for the store.
pub(crate) fn engines(store: &StoreUri, requested: &Option<Vec<Engine>>, skipped: &mut Vec<Skipped>) -> Vec<Engine> {
    match requested {
        Some(e) => e.clone(),
        None => Engine::defaults_for(store, skipped),
    }
}

/// The file or device fio reads, and the byte offset of the image on it (`None` for NVMe stores).
fn fio_target(store: &StoreUri) -> Option<(std::path::PathBuf, u64)> {
    match store {
        StoreUri::File(p) => Some((p.clone(), 0)),
        StoreUri::Raw { device, offset } => Some((device.clone(), *offset)),
        _ => None,
    }
}

/// Runs the sweep; `progress` is called after each point with the point (for a live table).
///
/// # Errors
/// Opening the store or an engine, a failed read ([`measure::run_point`]). A failed fio run is
/// listed in `skipped` and leaves that point's `fio` empty.
pub fn run(store: &StoreUri, opts: &QdSweepOptions, progress: &mut dyn FnMut(&QdPoint)) -> Result<QdSweepResults> {
    if opts.qds.is_empty() || opts.threads.is_empty() || opts.qds.contains(&0) || opts.threads.contains(&0) {
        return Err(Error::NoValues {
            options: "--qd and --threads",
            need: "need at least one value, each at least 1",
        });
    }
    let mut skipped = Vec::new();
    let engines = engines(store, &opts.engines, &mut skipped);
    let first = *engines.first().ok_or_else(|| Error::NoEngine { store: store.to_string() })?;
    let (_layout, bs, region, entries) = plan(store, first, opts.bs)?;
    let entries = entries.map(std::sync::Arc::new);
    let fio_version = if opts.fio { fio::version() } else { None };
    match (&fio_version, opts.fio, fio_target(store)) {
        (_, false, _) => skipped.push(Skipped { what: "fio".into(), reason: "--no-fio".into() }),
        (None, true, _) => skipped.push(Skipped { what: "fio".into(), reason: "fio is not on PATH".into() }),
        (Some(_), true, None) => {
            skipped.push(Skipped { what: "fio".into(), reason: format!("fio has no engine for {store}") })
        }
        _ => {}
    }
    let mut points = Vec::new();
    for &engine in &engines {
        for &threads in &opts.threads {
            for &qd in &opts.qds {
                let spec = PointSpec { engine, threads, qd, stop: opts.stop, seed: opts.seed, warm: opts.warm };
                let entries = entries.clone();
                let region2 = region.clone();
                let ours = measure::run_point(store, &spec, bs, &move |_| read_source(entries.clone(), &region2, bs))?;
                let fio = match (&fio_version, fio_target(store)) {
                    (Some(_), Some((file, base))) => {
                        if engine.buffered() && opts.warm {
                            None
                        } else {
                            if engine.buffered() {
                                // fio's own invalidate=1 is not relied on: drop as before our point.
                                measure::drop_cache(&file)?;
                            }
                            fio::run(&FioJob {
                                filename: &file,
                                engine,
                                threads,
                                qd,
                                bs,
                                offset: base + region.offset,
                                size: region.len,
                                stop: opts.stop,
                            })
                            .unwrap_or_else(|e| {
                                // fio failing (an option this fio lacks, a job error) does not void
                                // our measurement: the point keeps `fio: null` and says why.
                                skipped.push(Skipped {
                                    what: format!("fio beside {engine} at {threads} × QD {qd}"),
                                    reason: picchio_core::error::chain(&e).to_string(),
                                });
                                None
                            })
                        }
                    }
                    _ => None,
                };
                let ours_over_fio = fio.as_ref().filter(|f| f.mb_s > 0.0).map(|f| ours.mb_s / f.mb_s);
                let p = QdPoint { ours, bs, fio, ours_over_fio };
                progress(&p);
                points.push(p);
            }
        }
    }
    if opts.warm && fio_version.is_some() && engines.iter().any(|e| e.buffered()) {
        skipped.push(Skipped {
            what: "fio for psync-buffered".into(),
            reason: "--warm: fio invalidates the page cache at job start, so its figure would not be warm".into(),
        });
    }
    Ok(QdSweepResults { store: store.to_string(), bs, region, fio_version, points, skipped })
}
