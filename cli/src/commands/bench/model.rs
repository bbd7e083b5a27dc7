//! The `picchio bench` experiments that run the model itself: `trace` (routing traces: reuse,
//! popularity, LRU vs Belady), `cache` (decode speed and bytes against the expert-cache budget),
//! `decode` (a decode token's time split and its I/O floor per cache budget), and
//! `plot` (charts redrawn from a saved report).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use picchio_bench::cache::{ecaps_for_percents, run_cache, CacheOptions, ReadMode};
use picchio_bench::decode::{prompt_of_len, run_decode, DecodeOptions};
use picchio_bench::trace::{analyse, default_capacities, RoutingTrace, TraceHeader, TraceWriter};
use picchio_bench::{self as bench, Report};
use picchio_core::StoreUri;
use picchio_runtime::expert::open::EngineOptions;
use picchio_runtime::expert::store::DEFAULT_IMAGE;
use picchio_runtime::model::tokenizer::Tokenizer;
use picchio_runtime::run::{GenerateOptions, Session, SessionOptions};
use picchio_runtime::ModelDir;
use serde::Serialize;

use super::run::EngineArgs;

/// Where the report and its charts go.
#[derive(clap::Args, Debug, Clone, Serialize)]
pub struct Output {
    /// Also write the report as JSON to PATH (the schema: docs/experiments.md). An existing PATH is
    /// replaced only when it is an earlier picchio-bench report; its directory must exist.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// Draw the report's charts (SVG) into DIR (created if missing; its parent must exist).
    #[arg(long, value_name = "DIR")]
    pub plot: Option<PathBuf>,
}

impl Output {
    /// Checks `--json` and `--plot` before the run (see `bench::before_run`); `store` is the image
    /// file read, which `--json` must not be.
    fn check(&self, experiment: &str, store: Option<&Path>) -> anyhow::Result<()> {
        if let Some(dir) = &self.plot {
            bench::check_plot_supported(experiment)?;
            bench::output::check_plot_dir(dir)?;
        }
        if let Some(path) = &self.json {
            bench::output::check_report_path(path, store)?;
        }
        Ok(())
    }
}

/// Options of `picchio bench trace`.
#[derive(clap::Args, Debug, Serialize)]
pub struct TraceArgs {
    /// The routing trace to analyse (written by `picchio run --trace PATH`, or here with --model).
    #[arg(long, value_name = "PATH")]
    pub trace: PathBuf,
    /// First record the trace by running this converted model (greedy, experts from --store).
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// With --model: where routed experts come from (auto, safetensors, file:PATH, raw:, nvme:).
    #[arg(long, value_name = "URI", default_value = "auto", requires = "model")]
    pub store: String,
    /// With --model: the prompt as comma-separated token ids [default: 16 fixed pseudo-random ids].
    #[arg(long, value_name = "IDS", value_delimiter = ',', requires = "model")]
    pub prompt_ids: Option<Vec<u32>>,
    /// With --model: tokens to generate.
    #[arg(short = 'n', long = "max-new-tokens", value_name = "N", default_value_t = 64, requires = "model")]
    pub n: usize,
    /// With --model: replace the file --trace names when it exists (a trace recorded earlier is
    /// otherwise kept, and the command refuses to start).
    #[arg(long, requires = "model")]
    pub force: bool,
    /// Cache capacities (experts) to simulate, comma-separated [default: k, 2k, and 5-100% of all
    /// routed experts].
    #[arg(long, value_name = "N,...", value_delimiter = ',')]
    pub ecap: Option<Vec<usize>>,
    #[command(flatten)]
    #[serde(flatten)]
    pub out: Output,
}

/// Options of `picchio bench cache`.
#[derive(clap::Args, Debug)]
pub struct CacheArgs {
    /// Converted model directory.
    #[arg(long, value_name = "DIR", required_unless_present = "synthetic_gb", conflicts_with = "synthetic_gb")]
    pub model: Option<PathBuf>,
    /// Instead of --model: a random-weight Qwen3-30B-A3B-shaped model whose Q4 experts total about
    /// this many GB, written once under --workdir and reused (the one `picchio demo --synthetic-gb` uses).
    #[arg(long, value_name = "GB")]
    pub synthetic_gb: Option<f64>,
    /// Where --synthetic-gb models are written [default: $PICCHIO_WORKDIR, else the user's cache
    /// directory: $XDG_CACHE_HOME/picchio or ~/.cache/picchio].
    #[arg(long, value_name = "DIR")]
    pub workdir: Option<PathBuf>,
    /// Where routed experts come from: `auto` (DIR/experts.picchioflat when present, else
    /// safetensors), `safetensors`, `file:PATH`, `raw:/dev/X[@BYTES]` or `nvme:BDF[/NSID]`.
    #[arg(long, value_name = "URI", default_value = "auto")]
    pub store: StoreUri,
    /// Expert-cache capacities to measure, in experts, comma-separated.
    #[arg(long, value_name = "N,...", value_delimiter = ',', conflicts_with = "cache_percent")]
    pub ecap: Option<Vec<usize>>,
    /// Expert-cache capacities as percentages of all routed experts [default: 5,10,25,50,100].
    #[arg(long, value_name = "PCT,...", value_delimiter = ',')]
    pub cache_percent: Option<Vec<f64>>,
    /// Read modes to measure at each capacity: direct (O_DIRECT), buffered (page cache).
    #[arg(long, value_name = "MODE,...", value_delimiter = ',', default_value = "direct,buffered")]
    pub reads: Vec<ReadMode>,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// The prompt as comma-separated token ids [default: 16 fixed pseudo-random ids].
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate per point (decode figures are over the n - 1 forward passes after the first).
    #[arg(short = 'n', long = "max-new-tokens", value_name = "N", default_value_t = 32)]
    pub n: usize,
    /// Keep the image's pages in the page cache between points (by default each point starts cold:
    /// posix_fadvise DONTNEED on the image).
    #[arg(long)]
    pub warm: bool,
    #[command(flatten)]
    pub out: Output,
}

/// Options of `picchio bench decode`.
#[derive(clap::Args, Debug)]
pub struct DecodeArgs {
    /// Converted model directory (e.g. from `picchio synth --arch qwen3-30b-a3b --model-out DIR`).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Where routed experts come from: `auto` (DIR/experts.picchioflat when present, else
    /// safetensors), `safetensors`, `file:PATH`, `raw:/dev/X[@BYTES]` or `nvme:BDF[/NSID]`.
    #[arg(long, value_name = "URI", default_value = "auto")]
    pub store: StoreUri,
    /// Expert-cache capacities to measure, in experts, comma-separated.
    #[arg(long, value_name = "N,...", value_delimiter = ',', conflicts_with = "cache_percent")]
    pub ecap: Option<Vec<usize>>,
    /// Expert-cache capacities as percentages of all routed experts [default: 10,50,100].
    #[arg(long, value_name = "PCT,...", value_delimiter = ',')]
    pub cache_percent: Option<Vec<f64>>,
    /// Prompt length in tokens (fixed pseudo-random ids, the first 16 those of `bench cache`).
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub prompt_len: usize,
    /// Tokens to generate per point (decode figures are over the n - 1 forward passes after the first).
    #[arg(short = 'n', long = "max-new-tokens", value_name = "N", default_value_t = 32)]
    pub n: usize,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Warm each point's expert cache from this usage profile (`picchio run --usage-out`) before
    /// the prompt; without it every point starts cold.
    #[arg(long, value_name = "FILE")]
    pub warm_from: Option<PathBuf>,
    /// Keep the image's pages in the page cache between points (by default each point starts cold:
    /// posix_fadvise DONTNEED on the image).
    #[arg(long)]
    pub warm: bool,
    #[command(flatten)]
    pub compute: super::compute_args::ComputeArgs,
    #[command(flatten)]
    pub out: Output,
}

/// Options of `picchio bench plot`.
#[derive(clap::Args, Debug)]
pub struct PlotArgs {
    /// A saved report (`--json` of any experiment with charts: qd-sweep, layout, trace, cache,
    /// decode).
    #[arg(value_name = "REPORT.json")]
    pub report: PathBuf,
    /// Directory for the SVG charts (created if missing; its parent must exist).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

/// The expert-cache capacities `bench cache` and `bench decode` measure on a model of `total`
/// routed experts: `--ecap`, else `--cache-percent` of `total` (`default_percents` when neither is
/// given).
///
/// # Errors
/// A percentage outside (0, 100].
fn capacities(
    ecap: Option<&[usize]>,
    cache_percent: Option<&[f64]>,
    total: usize,
    default_percents: &[f64],
) -> anyhow::Result<Vec<usize>> {
    if let Some(e) = ecap {
        return Ok(e.to_vec());
    }
    let p = cache_percent.unwrap_or(default_percents);
    if let Some(bad) = p.iter().find(|p| !(**p > 0.0 && **p <= 100.0)) {
        bail!("--cache-percent must be in (0, 100], got {bad}");
    }
    Ok(ecaps_for_percents(total, p))
}

/// A fixed pseudo-random prompt of 16 ids below `vocab` (the one `picchio demo --synthetic-gb` uses).
fn default_prompt(vocab: usize) -> Vec<u32> {
    prompt_of_len(16, vocab)
}

/// `picchio bench trace`.
pub fn trace(a: TraceArgs) -> anyhow::Result<()> {
    a.out.check("trace", None)?;
    if a.model.is_some() && !a.force {
        // Before the model loads: recording over a trace recorded earlier would lose it.
        match std::fs::symlink_metadata(&a.trace) {
            Ok(_) => bail!(
                "--trace {}: the file exists (a trace recorded earlier?); recording with --model would replace it: \
                 pass --force to replace it, choose another --trace path, or leave out --model to analyse it",
                a.trace.display()
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("--trace {}", a.trace.display())),
        }
    }
    let run = bench::Run::start("trace", &a, None)?;
    if let Some(model) = &a.model {
        record_trace(&a, model)?;
    }
    let t = RoutingTrace::read(&a.trace)?;
    let caps = a.ecap.clone().unwrap_or_else(|| default_capacities(&t.header));
    let results = analyse(&a.trace, &t, &caps)?;
    println!(
        "{}: {} routing records over {} tokens ({} MoE layers x {} experts, top-{})",
        a.trace.display(),
        results.records,
        results.tokens,
        results.header.moe_layers.len(),
        results.header.num_experts,
        results.header.top_k
    );
    match results.reuse {
        Some(r) => println!(
            "token-to-token reuse: {:.1}% of a token's experts were the previous token's (uniform routing: {:.1}%)",
            100.0 * r,
            100.0 * results.reuse_uniform
        ),
        None => println!("token-to-token reuse: needs at least two tokens"),
    }
    println!("{:>6} {:>8} {:>8} {:>10} {:>8} {:>14}", "layer", "tokens", "reuse", "max share", "used", "entropy");
    for l in &results.layers {
        println!(
            "{:>6} {:>8} {:>7.1}% {:>9.1}% {:>4}/{:<3} {:>6.2} bits ({:.0}% of uniform)",
            l.layer,
            l.tokens,
            100.0 * l.reuse.unwrap_or(0.0),
            100.0 * l.max_share,
            l.experts_used,
            results.header.num_experts,
            l.entropy_bits,
            100.0 * l.entropy_norm
        );
    }
    println!(
        "one token uses {} experts (MoE layers x k); between two uses of an expert every other MoE layer runs, so \
         LRU gets no hit at all with capacity <= (MoE layers - 1) x k = {} and can hit only above that",
        results.working_set, results.lru_no_hit_capacity
    );
    println!("{:>9} {:>7} {:>10} {:>10} {:>12} {:>12}", "capacity", "%", "LRU hits", "Belady", "LRU MB", "Belady MB");
    for c in &results.capacities {
        println!(
            "{:>9} {:>6.1}% {:>9.1}% {:>9.1}% {:>12.1} {:>12.1}",
            c.capacity,
            c.capacity_percent,
            100.0 * c.lru_hit_rate,
            100.0 * c.belady_hit_rate,
            c.lru_bytes as f64 / 1e6,
            c.belady_bytes as f64 / 1e6
        );
    }
    let report = run.finish(results);
    write_outputs(&report, &a.out)
}

/// Runs `model` greedily with a [`TraceWriter`] on its router, writing `a.trace`.
fn record_trace(a: &TraceArgs, model: &Path) -> anyhow::Result<()> {
    let dir = ModelDir::open(model)?;
    let tokenizer = Tokenizer::for_model(&dir)?;
    let prompt = a.prompt_ids.clone().unwrap_or_else(|| default_prompt(dir.config().vocab_size));
    let opts = SessionOptions {
        model: dir,
        store: a.store.parse()?,
        engine: EngineOptions::default(),
        schedule: Default::default(),
        verify: false,
        ecap: None,
        max_seq: prompt.len() + a.n,
        dense: picchio_runtime::model::DenseFormat::Stored,
    };
    let mut s = Session::open(&opts, tokenizer).with_context(|| format!("opening model {}", model.display()))?;
    // A picchio-trace/1 file is in token-by-token order (the cache simulations replay it so).
    s.model.set_prefill_chunk(1)?;
    let header = TraceHeader::new(model, s.model.config(), s.cache.slot_len() as u64);
    s.model.set_routing_observer(Box::new(TraceWriter::create(&a.trace, &header)?));
    let g = s.generate(&prompt, &GenerateOptions { max_new: a.n, ..Default::default() })?;
    s.model.take_routing_observer().with_context(|| format!("writing the trace {}", a.trace.display()))?;
    eprintln!(
        "recorded {} prompt + {} generated tokens of {} into {}",
        g.prompt_ids.len(),
        g.tokens.len(),
        model.display(),
        a.trace.display()
    );
    Ok(())
}

/// `picchio bench cache`.
pub fn cache(a: CacheArgs) -> anyhow::Result<()> {
    // Before a synthetic model is written (minutes); again below with the image, once it is known.
    a.out.check("cache", None)?;
    if a.reads.is_empty() {
        bail!("--reads needs at least one of direct, buffered");
    }
    let modes = if a.engine.buffered { vec![ReadMode::Buffered] } else { a.reads.clone() };
    let (model, store) = match (&a.model, a.synthetic_gb) {
        (Some(m), _) => (m.clone(), a.store.clone()),
        (None, Some(gb)) => {
            let (_, m, image) = super::demo::synthetic_model(
                &super::demo::workdir(a.workdir.as_deref())?,
                Default::default(),
                gb,
                false,
            )?;
            let store = if a.store == StoreUri::Auto { StoreUri::File(image) } else { a.store.clone() };
            (m, store)
        }
        (None, None) => unreachable!("clap requires --model or --synthetic-gb"),
    };
    let dir = ModelDir::open(&model)?;
    let cfg = dir.config();
    let total = cfg.moe_layers().len() * cfg.num_experts;
    let ecaps = capacities(a.ecap.as_deref(), a.cache_percent.as_deref(), total, &[5.0, 10.0, 25.0, 50.0, 100.0])?;
    let prompt = a.prompt_ids.clone().unwrap_or_else(|| default_prompt(cfg.vocab_size));
    let opts = CacheOptions {
        model: dir,
        store: store.clone(),
        engine: a.engine.options(),
        schedule: a.engine.schedule(),
        verify: false,
        ecaps,
        modes,
        prompt,
        tokens: a.n,
        drop_page_cache: !a.warm,
    };
    let image = image_of(&store, &model);
    a.out.check("cache", image.as_deref())?;
    let target = image.map(StoreUri::File);
    let run = bench::Run::start("cache", &bench::flags(&a.out, &opts)?, target.as_ref())?;
    let n_points = opts.ecaps.len() * opts.modes.len();
    let bar = picchio_runtime::progress::bar(n_points as u64, "cache points", false);
    let results = run_cache(&opts, &mut |done, _| bar.set_position(done as u64))?;
    bar.finish_and_clear();
    println!(
        "{} ({} MoE layers x {} experts, top-{}, {} B per expert read), store {}; {} prompt + {} generated tokens per point",
        results.model,
        results.moe_layers,
        results.num_experts,
        results.top_k,
        results.slot_bytes,
        results.store,
        results.prompt_tokens,
        results.tokens
    );
    println!(
        "{:>8} {:>6} {:>6} {:>9} {:>8} {:>11} {:>11} {:>13}  engine",
        "reads", "ecap", "%", "tok/s", "hit %", "miss/token", "MB/token", "device MB/tok"
    );
    for p in &results.points {
        println!(
            "{:>8} {:>6} {:>5.1}% {:>9.2} {:>7.1}% {:>11.2} {:>11.2} {:>13}  {}",
            p.mode.to_string(),
            p.ecap,
            p.cache_percent,
            p.decode_tok_s,
            100.0 * p.hit_rate,
            p.misses_per_token,
            p.bytes_per_token / 1e6,
            p.device_bytes_per_token.map_or("-".into(), |d| format!("{:.2}", d / 1e6)),
            p.engine
        );
    }
    let report = run.finish(results);
    write_outputs(&report, &a.out)
}

/// `picchio bench decode`.
pub fn decode(a: DecodeArgs) -> anyhow::Result<()> {
    a.out.check("decode", None)?;
    let dir = ModelDir::open(&a.model)?;
    let cfg = dir.config();
    let total = cfg.moe_layers().len() * cfg.num_experts;
    let ecaps = capacities(a.ecap.as_deref(), a.cache_percent.as_deref(), total, &[10.0, 50.0, 100.0])?;
    let prompt = prompt_of_len(a.prompt_len, cfg.vocab_size);
    let opts = DecodeOptions {
        model: dir,
        store: a.store.clone(),
        engine: a.engine.options(),
        schedule: a.engine.schedule(),
        ecaps,
        prompt,
        tokens: a.n,
        prefill_chunk: a.engine.prefill_chunk(false)?,
        warm_from: a.warm_from.clone(),
        drop_page_cache: !a.warm,
        dense: a.compute.dense,
        idot: a.compute.idot,
    };
    let image = image_of(&a.store, &a.model);
    a.out.check("decode", image.as_deref())?;
    let target = image.map(StoreUri::File);
    let run = bench::Run::start("decode", &bench::flags(&a.out, &opts)?, target.as_ref())?;
    let bar = picchio_runtime::progress::bar(opts.ecaps.len() as u64, "decode points", false);
    let results = run_decode(&opts, &mut |done, _| bar.set_position(done as u64))?;
    bar.finish_and_clear();
    println!(
        "{} ({} layers, {} MoE x {} experts, top-{}), store {}; {} prompt + {} generated tokens per point",
        results.model,
        results.layers,
        results.moe_layers,
        results.num_experts,
        results.top_k,
        results.store,
        opts.prompt.len(),
        opts.tokens
    );
    println!(
        "{:>6} {:>6} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>8}",
        "ecap",
        "%",
        "prefill/s",
        "decode/s",
        "attn ms",
        "router",
        "experts",
        "io wait",
        "lm_head",
        "other",
        "MB/token",
        "dev MB/s",
        "floor/s",
        "RSS MB"
    );
    for p in &results.points {
        let sp = &p.split;
        println!(
            "{:>6} {:>5.1}% {:>9.2} {:>9.2} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>9.1} {:>9.0} {:>9} {:>8.0}",
            p.ecap,
            p.cache_percent,
            p.prefill_tok_s,
            p.decode_tok_s,
            sp.attention_ms,
            sp.router_ms,
            sp.experts_ms,
            sp.io_wait_ms,
            sp.lm_head_ms,
            sp.other_ms,
            p.bytes_per_token / 1e6,
            p.device_mb_s,
            p.floor_tok_s.map_or("-".into(), |f| format!("{f:.2}")),
            p.peak_rss_bytes as f64 / 1e6
        );
        if p.prefetch.issued > 0 {
            println!(
                "       prefetch: {} issued, {} used ({:.0}%), {:.1} MB wasted",
                p.prefetch.issued,
                p.prefetch.used,
                100.0 * p.prefetch.used as f64 / p.prefetch.issued as f64,
                p.prefetch_wasted_bytes as f64 / 1e6
            );
        }
    }
    let report = run.finish(results);
    write_outputs(&report, &a.out)
}

/// The image file a store reads, for the environment record.
fn image_of(store: &StoreUri, model: &Path) -> Option<PathBuf> {
    match store {
        StoreUri::File(p) => Some(p.clone()),
        StoreUri::Auto => Some(model.join(DEFAULT_IMAGE)).filter(|p| p.exists()),
        _ => None,
    }
}

/// `picchio bench plot REPORT.json --out DIR`.
pub fn plot(a: PlotArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&a.report).with_context(|| format!("reading {}", a.report.display()))?;
    let report: Report<serde_json::Value> =
        serde_json::from_str(&text).with_context(|| format!("{}: not a picchio-bench report", a.report.display()))?;
    if report.schema != bench::SCHEMA {
        bail!("{}: schema {:?}, this build reads {:?}", a.report.display(), report.schema, bench::SCHEMA);
    }
    for f in bench::render_plots(&report, &a.out)? {
        println!("{}", f.display());
    }
    Ok(())
}

/// Writes the JSON report and the charts a run asked for.
fn write_outputs<R: Serialize>(report: &Report<R>, out: &Output) -> anyhow::Result<()> {
    if let Some(path) = &out.json {
        report.write_json(path)?;
        eprintln!("report: {}", path.display());
    }
    if let Some(dir) = &out.plot {
        for f in bench::render_plots(&report.to_value_report(), dir)? {
            eprintln!("chart: {}", f.display());
        }
    }
    Ok(())
}
