//! What every `picchio bench` experiment shares: the common options (`--store`, `--json`), `--plot`,
//! the checks before a run, the report output after it, and the environment summary. Its own module
//! so that `bench` (the subcommand list) and `bench::io` / `bench::model` (the experiments) both import
//! it and not each other.

use std::path::{Path, PathBuf};

use picchio_bench::measure::StoreLayout;
use picchio_bench::{self as bench, env::Environment, output, Report};
use picchio_core::StoreUri;
use serde::Serialize;

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
