//! The storage experiments of `picchio bench`: qd-sweep, layout, tiers, overhead.

use anyhow::bail;
use picchio_bench as bench;
use picchio_bench::measure::{Engine, PointResult, Stop};
use picchio_bench::qd_sweep::{self, QdPoint, QdSweepOptions};
use serde::Serialize;

use super::common::{after_run, before_run, describe_environment, Common, PlotArg};

/// How long each point runs.
#[derive(clap::Args, Debug, Clone, Serialize)]
pub struct StopArgs {
    /// Seconds of reads per point [default: 2 unless --bytes].
    #[arg(long, value_name = "SECS", conflicts_with = "bytes")]
    pub duration: Option<f64>,
    /// Bytes read per point instead of a duration (K, M, G suffixes: powers of 1024).
    #[arg(long, value_name = "N", value_parser = parse_size)]
    pub bytes: Option<u64>,
}

impl StopArgs {
    fn stop(&self, default_s: f64) -> anyhow::Result<Stop> {
        Ok(match (self.duration, self.bytes) {
            (Some(s), _) if !(s > 0.0 && s.is_finite()) => {
                bail!("--duration {s}: must be a positive number of seconds")
            }
            (Some(s), _) => Stop::Duration(s),
            (None, Some(0)) => bail!("--bytes 0: must be positive"),
            (None, Some(b)) => Stop::Bytes(b),
            (None, None) => Stop::Duration(default_s),
        })
    }
}

/// A byte count with an optional K/M/G/T suffix (powers of 1024).
fn parse_size(s: &str) -> Result<u64, String> {
    let (num, mult) = match s.trim().char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m = match c.to_ascii_uppercase() {
                'K' => 1u64 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => return Err(format!("{s:?}: unknown suffix {c:?} (use K, M, G or T)")),
            };
            (&s.trim()[..i], m)
        }
        _ => (s.trim(), 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is not a byte count such as 65536, 64K or 1G"))
}

/// A read size: a byte count (as [`parse_size`]) that is a positive multiple of 4096 — the
/// O_DIRECT alignment every engine and store here needs — and below 4 GiB.
fn parse_bs(s: &str) -> Result<u64, String> {
    let b = parse_size(s)?;
    if b == 0 || !b.is_multiple_of(4096) {
        return Err(format!("{b} is not a positive multiple of 4096 bytes (the block size reads are aligned to)"));
    }
    if b > u64::from(u32::MAX) {
        return Err(format!("{b} bytes: at most 4 GiB - 4096 per read"));
    }
    Ok(b)
}

/// `--qd` (reads in flight per queue): 1 to [`bench::measure::MAX_QD`], as `picchio run --qd`.
fn qd_parser() -> impl Fn(&str) -> Result<u32, String> + Clone + Send + Sync + 'static {
    super::int_in(1, Some(i128::from(bench::measure::MAX_QD)))
}

/// `--threads`: 1 to [`bench::measure::MAX_THREADS`], as `picchio run --io-threads`.
fn threads_parser() -> impl Fn(&str) -> Result<u32, String> + Clone + Send + Sync + 'static {
    super::int_in(1, Some(i128::from(bench::measure::MAX_THREADS)))
}

/// Options of `picchio bench qd-sweep`.
#[derive(clap::Args, Debug, Serialize)]
pub struct QdSweepArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: Common,
    #[command(flatten)]
    #[serde(flatten)]
    pub plot: PlotArg,
    /// Engines, comma-separated: psync-buffered, psync-direct, uring, nvme-sim, nvme [default:
    /// every engine that can read the store].
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub engines: Option<Vec<Engine>>,
    /// Queue depths (reads in flight per thread, 1-256), comma-separated.
    #[arg(long = "qd", value_name = "LIST", value_delimiter = ',', default_value = "1,2,4,8,16,32,64,128,256",
          value_parser = qd_parser())]
    pub qd: Vec<u32>,
    /// Submitting threads (each with its own queue; 1-256), comma-separated [default: 1 up to the
    /// CPUs available].
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = threads_parser())]
    pub threads: Option<Vec<u32>>,
    /// Read size in bytes, a multiple of 4096 [default: one expert entry per read].
    #[arg(long, value_name = "BYTES", value_parser = parse_bs)]
    pub bs: Option<u64>,
    #[command(flatten)]
    #[serde(flatten)]
    pub stop: StopArgs,
    /// Seed of our random offsets (fio runs with --randrepeat=0: seeded, its parallel jobs would all
    /// read the same offsets).
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Keep the page cache as it is before buffered points (default: dropped, so figures are the
    /// device's).
    #[arg(long)]
    pub warm: bool,
    /// Do not run fio beside our engines even when it is installed.
    #[arg(long)]
    pub no_fio: bool,
}

pub fn qd_sweep(a: QdSweepArgs) -> anyhow::Result<()> {
    let (store, _) = before_run("qd-sweep", &a.common, a.plot.plot.as_deref())?;
    let bs = a.bs.map(|b| u32::try_from(b).expect("parse_bs bounds --bs"));
    let opts = QdSweepOptions {
        engines: a.engines.clone(),
        qds: a.qd.clone(),
        threads: a.threads.clone().unwrap_or_else(|| QdSweepOptions::default().threads),
        bs,
        stop: a.stop.stop(2.0)?,
        seed: a.seed,
        warm: a.warm,
        fio: !a.no_fio,
    };
    let run = bench::Run::start("qd-sweep", &bench::flags(&a, &opts)?, Some(&store))?;
    eprintln!("{}", describe_environment(run.environment()));
    println!("{}", point_header(true));
    let results = qd_sweep::run(&store, &opts, &mut |p: &QdPoint| {
        println!("{}", point_row(&p.ours, Some((p.fio.as_ref().map(|f| f.mb_s), p.ours_over_fio))))
    })?;
    for s in &results.skipped {
        println!("skipped {}: {}", s.what, s.reason);
    }
    let report = run.finish(results);
    println!(
        "read size {} B ({}), {} candidates; load average at end {}",
        report.results.bs,
        report.results.region.pattern,
        report.results.region.candidates,
        load(report.environment.load_avg_end)
    );
    after_run(&report, &a.common, a.plot.plot.as_deref())
}

fn load(l: Option<[f64; 3]>) -> String {
    l.map_or("-".into(), |l| format!("{:.2} {:.2} {:.2}", l[0], l[1], l[2]))
}

/// The table header of [`point_row`].
pub fn point_header(fio: bool) -> String {
    let mut s = format!(
        "{:<15} {:>3} {:>4} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8}",
        "engine", "thr", "qd", "MB/s", "IOPS", "p50 µs", "p99 µs", "p99.9 µs", "max µs", "CPU s/GB", "cache"
    );
    if fio {
        s += &format!(" {:>9} {:>8}", "fio MB/s", "ours/fio");
    }
    s
}

/// One table row for a point.
/// `fio`: `None` for a table without fio columns, else (fio MB/s, ours / fio) when fio ran.
pub fn point_row(p: &PointResult, fio: Option<(Option<f64>, Option<f64>)>) -> String {
    let l = &p.latency_us;
    let mut s = format!(
        "{:<15} {:>3} {:>4} {:>9.1} {:>9.0} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>8.3} {:>8}",
        p.engine, p.threads, p.qd, p.mb_s, p.iops, l.p50, l.p99, l.p99_9, l.max, p.cpu.s_per_gb, p.page_cache.action
    );
    match fio {
        None => {}
        Some((Some(f), Some(r))) => s += &format!(" {f:>9.1} {r:>8.2}"),
        Some(_) => s += &format!(" {:>9} {:>8}", "-", "-"),
    }
    s
}

/// Options of `picchio bench layout`.
#[derive(clap::Args, Debug, Serialize)]
pub struct LayoutArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: Common,
    #[command(flatten)]
    #[serde(flatten)]
    pub plot: PlotArg,
    /// Engines, comma-separated [default: every engine that can read the store].
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub engines: Option<Vec<Engine>>,
    /// Pieces per expert to compare with one contiguous read: 3 (gate/up/down, as GGUF) and/or 9
    /// (weight/scales/biases of each, as MLX/GPT-OSS-style safetensors).
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_value = "3,9")]
    pub pieces: Vec<u32>,
    /// Queue depths (reads in flight per thread, 1-256), comma-separated.
    #[arg(long = "qd", value_name = "LIST", value_delimiter = ',', default_value = "1,4,16,64", value_parser = qd_parser())]
    pub qd: Vec<u32>,
    /// Submitting threads (1-256), comma-separated [default: 1 up to the CPUs available].
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = threads_parser())]
    pub threads: Option<Vec<u32>>,
    #[command(flatten)]
    #[serde(flatten)]
    pub stop: StopArgs,
    /// Seed of the experts drawn.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Keep the page cache as it is before buffered points.
    #[arg(long)]
    pub warm: bool,
}

pub fn layout(a: LayoutArgs) -> anyhow::Result<()> {
    use picchio_bench::layout::{self, LayoutOptions, LayoutPoint};
    let (store, _) = before_run("layout", &a.common, a.plot.plot.as_deref())?;
    let opts = LayoutOptions {
        engines: a.engines.clone(),
        pieces: a.pieces.clone(),
        qds: a.qd.clone(),
        threads: a.threads.clone().unwrap_or_else(|| LayoutOptions::default().threads),
        stop: a.stop.stop(2.0)?,
        seed: a.seed,
        warm: a.warm,
    };
    let run = bench::Run::start("layout", &bench::flags(&a, &opts)?, Some(&store))?;
    eprintln!("{}", describe_environment(run.environment()));
    println!(
        "{:<6} {:<10} {:<15} {:>3} {:>3} {:>9} {:>9} {:>11} {:>11} {:>8}",
        "pieces", "variant", "engine", "thr", "qd", "experts/s", "MB/s", "p50 exp µs", "p99 exp µs", "CPU s/GB"
    );
    let results = layout::run(&store, &opts, &mut |p: &LayoutPoint| {
        let o = &p.ours;
        println!(
            "{:<6} {:<10} {:<15} {:>3} {:>3} {:>9.1} {:>9.1} {:>11.1} {:>11.1} {:>8.3}",
            p.pieces,
            p.variant,
            o.engine,
            o.threads,
            o.qd,
            o.units_per_s,
            o.mb_s,
            o.unit_latency_us.p50,
            o.unit_latency_us.p99,
            o.cpu.s_per_gb
        )
    })?;
    println!("\ncontiguous / scattered, experts per second:");
    for c in &results.comparisons {
        println!(
            "  {} pieces, {:<15} {} thr, QD {:>3}: {:.2}× ({:.1} vs {:.1} experts/s)",
            c.pieces,
            c.engine,
            c.threads,
            c.qd,
            c.contiguous_over_scattered,
            c.contiguous_experts_per_s,
            c.scattered_experts_per_s
        );
    }
    for s in &results.skipped {
        println!("skipped {}: {}", s.what, s.reason);
    }
    let report = run.finish(results);
    println!("load average at end {}", load(report.environment.load_avg_end));
    after_run(&report, &a.common, a.plot.plot.as_deref())
}

/// Options of `picchio bench tiers`.
#[derive(clap::Args, Debug, Serialize)]
pub struct TiersArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: Common,
    /// Submitting threads of every row (1-256).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = threads_parser())]
    pub threads: u32,
    /// Reads in flight per thread of every row (1-256).
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = qd_parser())]
    pub qd: u32,
    #[command(flatten)]
    #[serde(flatten)]
    pub stop: StopArgs,
    /// Seed of the offsets.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
}

pub fn tiers(a: TiersArgs) -> anyhow::Result<()> {
    use picchio_bench::tiers::{self, TierRow, TiersOptions};
    let (store, _) = before_run("tiers", &a.common, None)?;
    let opts = TiersOptions { threads: a.threads, qd: a.qd, stop: a.stop.stop(3.0)?, seed: a.seed };
    let run = bench::Run::start("tiers", &bench::flags(&a, &opts)?, Some(&store))?;
    eprintln!("{}", describe_environment(run.environment()));
    println!("{:<4} {}", "tier", point_header(false));
    let results = tiers::run(&store, &opts, &mut |r: &TierRow| {
        println!("{:<4} {}   {}", r.tier, point_row(&r.point, None), r.name)
    })?;
    for s in &results.skipped {
        println!("skipped {}: {}", s.what, s.reason);
    }
    let report = run.finish(results);
    println!(
        "expert reads of {} B, {} thread(s) × QD {}; load average at end {}",
        report.results.bs,
        a.threads,
        a.qd,
        load(report.environment.load_avg_end)
    );
    after_run(&report, &a.common, None)
}

/// Options of `picchio bench overhead`.
#[derive(clap::Args, Debug, Serialize)]
pub struct OverheadArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: Common,
    /// Engines, comma-separated: null, psync, uring, nvme-sim.
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_value = "null,psync,uring,nvme-sim",
          value_parser = ["null", "psync", "uring", "nvme-sim"])]
    pub engines: Vec<String>,
    /// Timed reads per engine (plus a tenth as untimed warm-up).
    #[arg(long, value_name = "N", default_value_t = 100_000, value_parser = super::int_in::<u64>(1, None))]
    pub reads: u64,
    /// Read size in bytes (a multiple of 4096).
    #[arg(long, value_name = "BYTES", default_value = "4096", value_parser = parse_bs)]
    pub bs: u64,
    /// Bytes at the start of the image the reads are drawn from (read once first, so cached)
    /// [default: 64M, or the whole image when smaller]. At most the image's size.
    #[arg(long, value_name = "BYTES", value_parser = parse_size)]
    pub range: Option<u64>,
    /// Seed of the offsets.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
}

pub fn overhead(a: OverheadArgs) -> anyhow::Result<()> {
    use picchio_bench::overhead::{self, OverheadOptions, OverheadRow};
    let (store, layout) = before_run("overhead", &a.common, None)?;
    let opts = OverheadOptions {
        engines: a.engines.clone(),
        reads: a.reads,
        bs: u32::try_from(a.bs).expect("parse_bs bounds --bs"),
        range: a.range,
        seed: a.seed,
    };
    let (data, payload) = layout.payload();
    let range = opts.resolve_range(data + payload)?;
    let resolved = OverheadOptions { range: Some(range), ..opts.clone() };
    let run = bench::Run::start("overhead", &bench::flags(&a, &resolved)?, Some(&store))?;
    eprintln!("{}", describe_environment(run.environment()));
    println!(
        "{:<9} {:>10} {:>10} {:>10} {:>10} {:>10}  complete includes",
        "engine", "submit ns", "reap ns", "total ns", "total p50", "total p99"
    );
    let results = overhead::run(&store, &opts, &mut |r: &OverheadRow| {
        println!(
            "{:<9} {:>10.0} {:>10.0} {:>10.0} {:>10.0} {:>10.0}  {}",
            r.engine,
            r.submit_ns.mean,
            r.complete_ns.mean,
            r.total_ns.mean,
            r.total_ns.p50,
            r.total_ns.p99,
            r.complete_includes
        )
    })?;
    for s in &results.skipped {
        println!("skipped {}: {}", s.what, s.reason);
    }
    let report = run.finish(results);
    println!(
        "means over {} reads of {} B drawn from the image's first {} B, at QD 1; clock {} ({:.3} ticks/ns); \
         load average at end {}",
        a.reads,
        a.bs,
        report.results.range,
        report.results.clock,
        report.results.ticks_per_ns,
        load(report.environment.load_avg_end)
    );
    after_run(&report, &a.common, None)
}
