//! `picchio bench <experiment>`: one subcommand per experiment, each writing a `picchio-bench/1`
//! report (docs/experiments.md).

use clap::Subcommand;
use serde::Serialize;

use picchio_bench as bench;

use self::common::{after_run, before_run, describe_environment, Common};
// The experiments' modules name these commands' items as `super::int_in`, `super::run::...`.
use super::{compute_args, demo, int_in, run};

mod common;
mod io;
mod model;

/// Options of `picchio bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    experiment: Experiment,
}

#[derive(Subcommand, Debug)]
enum Experiment {
    /// Record only the environment (CPU, kernel, memory, load, and the store's device and file
    /// system) after checking the store is a readable image: what every other experiment's report
    /// carries in `environment`.
    Env(EnvArgs),
    /// Random reads (expert-sized or --bs) at each queue depth × thread count × engine: MB/s and
    /// IOPS from wall time, latency percentiles, CPU s/GB, page cache dropped unless --warm; fio's
    /// figure beside each point when fio is installed.
    QdSweep(io::QdSweepArgs),
    /// One expert as 3 or 9 scattered per-tensor reads (GGUF/safetensors placement) versus one
    /// contiguous read of the same bytes, per engine × threads × QD.
    Layout(io::LayoutArgs),
    /// Every tier that can read the store, one table, same expert reads.
    Tiers(io::TiersArgs),
    /// Software cost per read (submit + complete, ns) at QD 1 per engine, with the timestamp counter;
    /// a null engine shows the IoQueue trait's own cost.
    Overhead(io::OverheadArgs),
    /// Routing traces (`picchio run --trace`, or recorded here with --model): token-to-token expert
    /// reuse, per-layer popularity, and LRU vs Belady (optimal) expert-cache hit rates by capacity.
    Trace(model::TraceArgs),
    /// Decode tok/s, misses and bytes per token against the expert-cache budget (--ecap sweep),
    /// O_DIRECT vs buffered reads, from real runs of the model.
    Cache(model::CacheArgs),
    /// Where a decode token's time goes at each expert-cache budget: prefill and decode tok/s, the
    /// step's split (attention, router, expert compute, exposed I/O wait, lm_head), reads and bytes
    /// per token, peak RSS, and the I/O floor from the same run's device rate.
    Decode(model::DecodeArgs),
    /// Redraw the charts of a saved report (`--json`) as SVG (reports of qd-sweep, layout, trace,
    /// cache, decode).
    Plot(model::PlotArgs),
}

/// Options of `picchio bench env`.
#[derive(clap::Args, Debug, Serialize)]
pub struct EnvArgs {
    #[command(flatten)]
    #[serde(flatten)]
    common: Common,
}

pub fn exec(a: Args) -> anyhow::Result<()> {
    match a.experiment {
        Experiment::Env(a) => {
            let (store, _) = before_run("env", &a.common, None)?;
            let run = bench::Run::start("env", &a, Some(&store))?;
            let report = run.finish(serde_json::json!({}));
            println!("{}", describe_environment(&report.environment));
            after_run(&report, &a.common, None)
        }
        Experiment::QdSweep(a) => io::qd_sweep(a),
        Experiment::Layout(a) => io::layout(a),
        Experiment::Tiers(a) => io::tiers(a),
        Experiment::Overhead(a) => io::overhead(a),
        Experiment::Trace(a) => model::trace(a),
        Experiment::Cache(a) => model::cache(a),
        Experiment::Decode(a) => model::decode(a),
        Experiment::Plot(a) => model::plot(a),
    }
}
