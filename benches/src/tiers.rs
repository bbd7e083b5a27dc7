//! `picchio bench tiers`: every tier that can read the store, side by side, with one configuration
//! (expert-sized random reads at the same threads × QD), in one table.
//!
//! | store | rows |
//! | --- | --- |
//! | `file:` or `nvme-sim:` (an image file) | S1 page cache (psync buffered, cache dropped first), S2 O_DIRECT (psync), S3 io_uring (O_DIRECT), S5 our NVMe driver against the **controller model** serving the same file |
//! | `raw:` | S4: psync buffered, psync direct and io_uring on the block device |
//! | `nvme:` | S5: our NVMe driver on the real controller |
//!
//! The controller-model row measures the driver plus a software device that reads its backing file
//! through the page cache: it is not a drive's figure and is labelled so.

use serde::{Deserialize, Serialize};

use super::measure::{self, Engine, PointResult, PointSpec, Skipped, Stop, StoreLayout};
use super::qd_sweep::read_source;
use crate::error::{Error, Result};
use picchio_core::StoreUri;

/// Options of [`run`] (recorded in the report's `flags`).
#[derive(Clone, Debug, Serialize)]
pub struct TiersOptions {
    /// Submitting threads of every row.
    pub threads: u32,
    /// Reads in flight per thread of every row.
    pub qd: u32,
    /// Per row: stop after this duration or byte count.
    pub stop: Stop,
    /// Seed of the offsets.
    pub seed: u64,
}

impl Default for TiersOptions {
    fn default() -> Self {
        TiersOptions { threads: 1, qd: 8, stop: Stop::Duration(3.0), seed: 0 }
    }
}

/// One row.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TierRow {
    /// `S1` … `S5`.
    pub tier: String,
    /// What the tier is, e.g. `page cache (psync, buffered; cache dropped before the row)`.
    pub name: String,
    /// The store URI the row read.
    pub store: String,
    /// The measurement.
    #[serde(flatten)]
    pub point: PointResult,
}

/// `results` of a tiers report.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TiersResults {
    /// The store as given.
    pub store: String,
    /// Read size (one expert entry), bytes.
    pub bs: u32,
    /// Every row.
    pub rows: Vec<TierRow>,
    /// Tiers not run, with the reason.
    pub skipped: Vec<Skipped>,
}

/// The rows of the kernel's three paths over one file or device `s`: psync buffered, psync O_DIRECT
/// and io_uring (only when `uring_ok`), with their `(tier, name)`s in that order.
fn kernel_rows(
    s: &StoreUri,
    names: [(&'static str, &'static str); 3],
    uring_ok: bool,
) -> Vec<(&'static str, &'static str, StoreUri, Engine)> {
    let engines = [Engine::PSYNC_BUFFERED, Engine::PSYNC_DIRECT, Engine::URING];
    let n = if uring_ok { 3 } else { 2 };
    names.into_iter().zip(engines).take(n).map(|((tier, name), e)| (tier, name, s.clone(), e)).collect()
}

/// The (tier, name, store, engine) rows for `store`.
fn plan(store: &StoreUri, skipped: &mut Vec<Skipped>) -> Vec<(&'static str, &'static str, StoreUri, Engine)> {
    let uring_ok = {
        let mut s = Vec::new();
        let ok = Engine::defaults_for(&StoreUri::File("x".into()), &mut s).contains(&Engine::URING);
        skipped.extend(s.into_iter().map(|mut s| {
            s.what = format!("{} tier", s.what);
            s
        }));
        ok
    };
    let mut rows = Vec::new();
    match store {
        StoreUri::File(p) | StoreUri::NvmeSim(p) => {
            let kernel = [
                ("S1", "page cache (psync, buffered; cache dropped before the row)"),
                ("S2", "O_DIRECT file (psync)"),
                ("S3", "io_uring (O_DIRECT, registered file)"),
            ];
            rows.extend(kernel_rows(&StoreUri::File(p.clone()), kernel, uring_ok));
            if cfg!(target_os = "linux") {
                rows.push((
                    "S5",
                    "our NVMe driver against the controller model (software device over the same file)",
                    StoreUri::NvmeSim(p.clone()),
                    Engine::NVME_SIM,
                ));
            } else {
                skipped.push(Skipped { what: "S5 tier".into(), reason: "picchio-nvme is Linux-only".into() });
            }
            skipped.push(Skipped { what: "S4 tier".into(), reason: "needs a raw:/dev/X store".into() });
        }
        StoreUri::Raw { .. } => {
            let kernel = [
                ("S4", "raw block device, psync buffered (cache dropped before the row)"),
                ("S4", "raw block device, psync O_DIRECT"),
                ("S4", "raw block device, io_uring O_DIRECT"),
            ];
            rows.extend(kernel_rows(store, kernel, uring_ok));
        }
        StoreUri::Nvme { .. } => rows.push(("S5", "our NVMe driver over VFIO", store.clone(), Engine::NVME)),
        StoreUri::NvmeTcp { .. } => {
            rows.push(("S6", "our NVMe/TCP initiator (remote namespace)", store.clone(), Engine::NVME_TCP))
        }
        // bench_store refuses these before any experiment runs.
        StoreUri::Auto | StoreUri::Safetensors => {}
    }
    rows
}

/// Runs every tier; `progress` is called after each row.
///
/// # Errors
/// Opening the store or an engine, a failed read.
pub fn run(store: &StoreUri, opts: &TiersOptions, progress: &mut dyn FnMut(&TierRow)) -> Result<TiersResults> {
    if opts.threads == 0 || opts.qd == 0 {
        return Err(Error::NoValues { options: "--threads and --qd", need: "must be at least 1" });
    }
    let mut skipped = Vec::new();
    let rows_plan = plan(store, &mut skipped);
    let (s0, e0) = (&rows_plan[0].2, rows_plan[0].3);
    let layout = StoreLayout::read(s0, e0)?;
    let (bs, offsets) = layout.expert_entries();
    let entries = std::sync::Arc::new(offsets);
    let region = super::qd_sweep::Region {
        pattern: "expert entries".into(),
        offset: 0,
        len: 0,
        candidates: entries.len() as u64,
    };
    let mut rows = Vec::new();
    for (tier, name, s, engine) in rows_plan {
        let spec =
            PointSpec { engine, threads: opts.threads, qd: opts.qd, stop: opts.stop, seed: opts.seed, warm: false };
        let (e, r) = (entries.clone(), region.clone());
        let point = measure::run_point(&s, &spec, bs, &move |_| read_source(Some(e.clone()), &r, bs))?;
        let row = TierRow { tier: tier.into(), name: name.into(), store: s.to_string(), point };
        progress(&row);
        rows.push(row);
    }
    Ok(TiersResults { store: store.to_string(), bs, rows, skipped })
}
