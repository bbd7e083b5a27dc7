//! `picchio bench <experiment>`: one subcommand per experiment, each writing a `picchio-bench/1`
//! report (docs/experiments.md).

use std::path::{Path, PathBuf};

use clap::Subcommand;
use picchio_bench::measure::StoreLayout;
use picchio_bench::{self as bench, env::Environment, output, Report};
use picchio_core::StoreUri;
use serde::Serialize;

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
    QdSweep(super::bench_io::QdSweepArgs),
    /// One expert as 3 or 9 scattered per-tensor reads (GGUF/safetensors placement) versus one
    /// contiguous read of the same bytes, per engine × threads × QD.
    Layout(super::bench_io::LayoutArgs),
    /// Every tier that can read the store, one table, same expert reads.
    Tiers(super::bench_io::TiersArgs),
    /// Software cost per read (submit + complete, ns) at QD 1 per engine, with the timestamp counter;
    /// a null engine shows the IoQueue trait's own cost.
    Overhead(super::bench_io::OverheadArgs),
    /// Routing traces (`picchio run --trace`, or recorded here with --model): token-to-token expert
    /// reuse, per-layer popularity, and LRU vs Belady (optimal) expert-cache hit rates by capacity.
    Trace(super::bench_model::TraceArgs),
    /// Decode tok/s, misses and bytes per token against the expert-cache budget (--ecap sweep),
    /// O_DIRECT vs buffered reads, from real runs of the model.
    Cache(super::bench_model::CacheArgs),
    /// Redraw the charts of a saved report (`--json`) as SVG (reports of qd-sweep, layout, trace,
    /// cache).
    Plot(super::bench_model::PlotArgs),
}

/// Options every storage experiment has: where to read, where the report goes.
#[derive(clap::Args, Debug, Clone, Serialize)]
pub struct Common {
    /// The image to measure: file:PATH (or a path), raw:/dev/X[@BYTES], nvme-sim:PATH (the image
    /// served by picchio-nvme's controller model) or nvme:BDF[/NSID]. `picchio synth` writes one.
    #[arg(long, value_name = "URI")]
    pub store: String,
    /// Also write the report as JSON to PATH (the schema: docs/experiments.md). An existing PATH is
    /// replaced only when it is an earlier picchio-bench report; its directory must exist.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
}

/// `--plot`, on the experiments that have charts (qd-sweep, layout; trace and cache have their own).
#[derive(clap::Args, Debug, Clone, Serialize)]
pub struct PlotArg {
    /// Draw the report's charts (SVG: no fonts or system libraries needed) into DIR (created if
    /// missing; its parent must exist).
    #[arg(long, value_name = "DIR")]
    pub plot: Option<PathBuf>,
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
        Experiment::QdSweep(a) => super::bench_io::qd_sweep(a),
        Experiment::Layout(a) => super::bench_io::layout(a),
        Experiment::Tiers(a) => super::bench_io::tiers(a),
        Experiment::Overhead(a) => super::bench_io::overhead(a),
        Experiment::Trace(a) => super::bench_model::trace(a),
        Experiment::Cache(a) => super::bench_model::cache(a),
        Experiment::Plot(a) => super::bench_model::plot(a),
    }
}

/// Checks made before measuring or printing anything, so a long run is not lost to a refusal at
/// the end: the `--store` parses and opens as an image (as every experiment then reads it), `--json`
/// may be written (an earlier report or a new file in an existing directory, never the store) and
/// `--plot` may be created. Returns the store and its layout.
pub(super) fn before_run(experiment: &str, c: &Common, plot: Option<&Path>) -> anyhow::Result<(StoreUri, StoreLayout)> {
    let store = picchio_runtime::expert::open::bench_store(&c.store)?;
    if let Some(dir) = plot {
        bench::check_plot_supported(experiment)?;
        output::check_plot_dir(dir)?;
    }
    if let Some(path) = &c.json {
        output::check_report_path(path, store_file(&store))?;
    }
    let layout = StoreLayout::of(&store)?;
    Ok((store, layout))
}

/// The file or device node a store reads (what `--json` must never be).
fn store_file(store: &StoreUri) -> Option<&Path> {
    store.local_path()
}

/// Writes the JSON report and the charts a run asked for.
pub(super) fn after_run<R: Serialize>(report: &Report<R>, c: &Common, plot: Option<&Path>) -> anyhow::Result<()> {
    if let Some(path) = &c.json {
        report.write_json(path)?;
        eprintln!("report: {}", path.display());
    }
    if let Some(dir) = plot {
        for f in bench::render_plots(&report.to_value_report(), dir)? {
            eprintln!("chart: {}", f.display());
        }
    }
    Ok(())
}

/// A few lines saying where the figures come from (the JSON has everything).
pub(super) fn describe_environment(e: &Environment) -> String {
    let mut s = format!(
        "cpu: {} ({} logical, {} available to this process)",
        e.cpu.model.as_deref().unwrap_or("unknown model"),
        e.cpu.logical_cpus,
        e.cpu.available_to_process
    );
    if let Some(k) = &e.kernel {
        s += &format!("\nkernel: {} {} {}", k.sysname, k.release, k.machine);
    }
    if let Some(m) = &e.memory {
        s += &format!(
            "\nmemory: {:.1} GiB total, {:.1} GiB available, {:.1} GiB page cache",
            gib(m.total_bytes),
            gib(m.available_bytes),
            gib(m.page_cache_bytes)
        );
    }
    if let Some(l) = e.load_avg_start {
        s += &format!("\nload average at start: {:.2} {:.2} {:.2}", l[0], l[1], l[2]);
    }
    if let Some(l) = e.load_avg_end {
        s += &format!(" (at end: {:.2} {:.2} {:.2})", l[0], l[1], l[2]);
    }
    if let Some(t) = &e.target {
        s += &format!("\nstore: {} ({}", t.uri, t.kind);
        if let Some(n) = t.size_bytes {
            s += &format!(", {n} bytes");
        }
        s += ")";
        if let Some(d) = &t.device {
            s += &format!(
                "\n  device: {} ({}, disk {}), model {}, firmware {}, driver {}, LBA {} B, scheduler {}, rotational {}",
                d.name,
                d.devnum,
                d.disk,
                d.model.as_deref().unwrap_or("-"),
                d.firmware.as_deref().unwrap_or("-"),
                d.driver.as_deref().unwrap_or("-"),
                d.logical_block_size.map_or("-".into(), |v| v.to_string()),
                d.scheduler.as_deref().unwrap_or("-"),
                d.rotational.map_or("-".into(), |v| v.to_string()),
            );
        }
        if let Some(f) = &t.filesystem {
            s += &format!("\n  file system: {} on {} at {} ({})", f.fstype, f.source, f.mount_point, f.super_options);
        }
        if let Some(n) = &t.note {
            s += &format!("\n  note: {n}");
        }
    }
    s
}

fn gib(b: u64) -> f64 {
    b as f64 / f64::from(1u32 << 30)
}
