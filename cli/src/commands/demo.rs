//! `picchio demo`: the embedded default. Converts and packs the vendored real-tokenizer Qwen3-MoE
//! fixture, runs its prompt with an expert cache smaller than the expert set (so experts really stream
//! from the .picchioflat image), and checks the tokens against transformers' reference. With
//! `--synthetic-gb N [--arch qwen3-30b-a3b|gpt-oss-20b]` it instead writes a random-weight model with
//! that model's real layer shapes whose experts total N GB ([`picchio_runtime::image::synthetic_model`]).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use picchio_core::StoreUri;
use picchio_runtime::expert::store::DEFAULT_IMAGE;
use picchio_runtime::image::convert::{convert, ConvertOptions};
use picchio_runtime::image::pack::{pack, PackOptions};
use picchio_runtime::image::synthetic_model::{
    is_written, write_synthetic, SyntheticArch, SyntheticSpec, WriteSyntheticOptions,
};
use picchio_runtime::model::tokenizer::Tokenizer;
use picchio_runtime::model::DenseFormat;
use picchio_runtime::quant::QuantKind;
use picchio_runtime::run::{GenerateOptions, Session, SessionOptions};
use picchio_runtime::ModelDir;

/// The vendored fixture in the checkout the binary was built from (the default of `--fixture`).
const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/qwen3_moe_text");

/// Options of `picchio demo`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Instead of the fixture, write (once, then reuse) a random-weight model with --arch's real layer
    /// shapes and tokenizer, as many layers as make its Q4 experts about this many GB, and stream it.
    #[arg(long, value_name = "GB")]
    pub synthetic_gb: Option<f64>,
    /// With --synthetic-gb: the real model whose geometry the random-weight model copies,
    /// qwen3-30b-a3b (128 experts of 2,654,208 B per layer) or gpt-oss-20b (32 experts of 13,996,800
    /// B per layer) [default: qwen3-30b-a3b].
    #[arg(long, value_name = "ARCH")]
    pub arch: Option<SyntheticArch>,
    /// Expert-cache capacity as a percentage of all experts [default: 25 for the fixture, 10 for
    /// --synthetic-gb].
    #[arg(long, value_name = "PCT", conflicts_with = "mem")]
    pub cache_percent: Option<f64>,
    /// Instead of --cache-percent, one memory budget split between the dense part, the KV cache and
    /// the expert cache (as `picchio run --mem`; the plan is printed on stderr).
    #[arg(long, value_name = "SIZE")]
    pub mem: Option<picchio_runtime::plan::MemBudget>,
    /// Tokens to generate [default: the reference's 16 for the fixture, 32 for --synthetic-gb].
    #[arg(short = 'n', long, value_name = "N")]
    pub n: Option<usize>,
    #[command(flatten)]
    pub engine: super::run::EngineArgs,
    #[command(flatten)]
    pub compute: super::compute_args::ComputeArgs,
    /// Where converted and synthetic models are written and kept for the next run [default:
    /// $PICCHIO_WORKDIR, else the user's cache directory: $XDG_CACHE_HOME/picchio or ~/.cache/picchio].
    #[arg(long, value_name = "DIR")]
    pub workdir: Option<PathBuf>,
    /// The Hugging Face fixture to convert [default: $PICCHIO_DEMO_FIXTURE, else
    /// tests/fixtures/qwen3_moe_text of the checkout the binary was built from].
    #[arg(long, value_name = "DIR")]
    pub fixture: Option<PathBuf>,
    /// Print one JSON object with tokens and stats on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn exec(a: Args) -> anyhow::Result<()> {
    check_args(&a)?;
    let workdir = workdir(a.workdir.as_deref())?;
    std::fs::create_dir_all(&workdir).with_context(|| format!("creating {}", workdir.display()))?;
    // Messages show plain absolute paths, not `<checkout>/runtime/../tests/...`.
    let workdir = workdir.canonicalize().with_context(|| format!("resolving {}", workdir.display()))?;
    match a.synthetic_gb {
        Some(gb) => synthetic(&a, &workdir, gb),
        None => fixture(&a, &workdir, &fixture_dir(a.fixture.as_deref())?),
    }
}

/// The demo's work directory: `flag` (`--workdir`), else `$PICCHIO_WORKDIR`, else `picchio` in the
/// user's cache directory (`$XDG_CACHE_HOME`, else `~/.cache`; `%LOCALAPPDATA%` on Windows), so an
/// installed binary works from any directory. Shared with `bench cache|trace --synthetic-gb`.
///
/// # Errors
/// When none of these is set.
pub(super) fn workdir(flag: Option<&Path>) -> anyhow::Result<PathBuf> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = flag.map(Path::to_path_buf).or_else(|| env("PICCHIO_WORKDIR")) {
        return Ok(p);
    }
    let cache = if cfg!(windows) {
        env("LOCALAPPDATA")
    } else {
        env("XDG_CACHE_HOME").filter(|p| p.is_absolute()).or_else(|| env("HOME").map(|h| h.join(".cache")))
    };
    cache.map(|c| c.join("picchio")).context(
        "no cache directory for the demo's models: set $XDG_CACHE_HOME or $HOME, $PICCHIO_WORKDIR, or pass --workdir DIR",
    )
}

/// The fixture to convert: `flag` (`--fixture`), else `$PICCHIO_DEMO_FIXTURE`, else the checkout's
/// vendored `tests/fixtures/qwen3_moe_text` (canonical).
fn fixture_dir(flag: Option<&Path>) -> anyhow::Result<PathBuf> {
    let from_env = std::env::var_os("PICCHIO_DEMO_FIXTURE").filter(|v| !v.is_empty()).map(PathBuf::from);
    let dir = flag.map(Path::to_path_buf).or(from_env).unwrap_or_else(|| PathBuf::from(FIXTURE));
    dir.canonicalize().with_context(|| {
        format!(
            "the demo fixture {} is missing (this binary was built from a checkout that is not here): pass \
             --fixture DIR or set PICCHIO_DEMO_FIXTURE to a checkout's tests/fixtures/qwen3_moe_text",
            dir.display()
        )
    })
}

/// What the converted demo model was made from: this binary's version, the expert format, and every
/// fixture file's name, length and modification time. Written to the stamp file last, after convert
/// and pack finished, so a stamp that matches means a complete directory and image of this fixture.
fn fingerprint(fixture: &Path) -> anyhow::Result<String> {
    let mut files: Vec<_> = std::fs::read_dir(fixture)
        .with_context(|| format!("listing {}", fixture.display()))?
        .collect::<std::io::Result<_>>()
        .with_context(|| format!("listing {}", fixture.display()))?;
    files.sort_by_key(std::fs::DirEntry::file_name);
    let mut out = format!("picchio {}\nexperts q4\nfixture {}\n", env!("CARGO_PKG_VERSION"), fixture.display());
    for f in files {
        let m = f.metadata().with_context(|| format!("reading {}", f.path().display()))?;
        let mtime = m.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).unwrap_or_default();
        out.push_str(&format!(
            "{} {} {}.{:09}\n",
            f.file_name().to_string_lossy(),
            m.len(),
            mtime.as_secs(),
            mtime.subsec_nanos()
        ));
    }
    Ok(out)
}

fn check_args(a: &Args) -> anyhow::Result<()> {
    if let Some(p) = a.cache_percent {
        if !(p > 0.0 && p <= 100.0) {
            bail!("--cache-percent must be in (0, 100], got {p}");
        }
    }
    if a.n == Some(0) {
        bail!("-n must be at least 1");
    }
    if a.arch.is_some() && a.synthetic_gb.is_none() {
        bail!("--arch only applies to --synthetic-gb (the fixture is a tiny Qwen3-MoE)");
    }
    Ok(())
}

fn ecap_for(total: usize, pct: f64) -> usize {
    ((total as f64 * pct / 100.0).round() as usize).max(1)
}

/// The expert cache of a demo run of `max_seq` positions: what `--mem` leaves (the plan printed on
/// stderr), else `--cache-percent` (default `pct`) of the `total` experts.
fn demo_ecap(a: &Args, model: &ModelDir, total: usize, pct: f64, max_seq: usize) -> anyhow::Result<usize> {
    match a.mem {
        Some(m) => {
            let plan = super::plan::plan_for(model, Some(m), None, max_seq, a.compute.dense)?;
            eprintln!("{plan}");
            Ok(plan.ecap)
        }
        None => Ok(ecap_for(total, a.cache_percent.unwrap_or(pct))),
    }
}

fn fixture(a: &Args, workdir: &Path, fixture: &Path) -> anyhow::Result<()> {
    let reference: serde_json::Value = {
        let p = fixture.join("reference_q4.json");
        serde_json::from_str(&std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?)
            .with_context(|| format!("parsing {}", p.display()))?
    };
    let ids = |k: &str| -> Vec<u32> {
        reference[k]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_u64()).map(|v| v as u32).collect())
            .unwrap_or_default()
    };
    let (want, prompt_text) = (ids("greedy_ids"), reference["prompt_text"].as_str().unwrap_or_default().to_string());

    let model = workdir.join("qwen3_moe_text-q4");
    let stamp = workdir.join("qwen3_moe_text-q4.stamp");
    let want_stamp = fingerprint(fixture)?;
    let complete =
        model.join(DEFAULT_IMAGE).is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == want_stamp);
    if complete {
        eprintln!(
            "reusing {} (converted and packed from {}; {} matches)",
            model.display(),
            fixture.display(),
            stamp.display()
        );
    } else {
        // A missing or different stamp: an interrupted or older build, or another fixture. Rebuild.
        if stamp.exists() {
            std::fs::remove_file(&stamp).with_context(|| format!("removing the stale {}", stamp.display()))?;
        }
        if model.exists() {
            std::fs::remove_dir_all(&model).with_context(|| format!("removing the previous {}", model.display()))?;
        }
        eprintln!("converting {} -> {} (Q4 experts)", fixture.display(), model.display());
        convert(fixture, &model, &ConvertOptions { experts: QuantKind::Q4, ..Default::default() })?;
        eprintln!("packing {}", model.join(DEFAULT_IMAGE).display());
        pack(&model, &model.join(DEFAULT_IMAGE), &PackOptions::default())?;
        std::fs::write(&stamp, &want_stamp).with_context(|| format!("writing {}", stamp.display()))?;
    }

    let tokenizer = Tokenizer::from_dir(&model)?.context("the fixture has no tokenizer.json")?;
    let prompt = tokenizer.encode(&prompt_text)?;
    let n = a.n.unwrap_or(want.len());
    let dir = ModelDir::open(&model)?;
    let cfg = dir.config();
    let total = cfg.moe_layers().len() * cfg.num_experts;
    let ecap = demo_ecap(a, &dir, total, 25.0, prompt.len().saturating_add(n))?;
    let store = StoreUri::File(model.join(DEFAULT_IMAGE));
    let mut s = demo_session(a, dir, store, ecap, prompt.len().saturating_add(n), Some(tokenizer))?;
    let g = s.generate(&prompt, &GenerateOptions { max_new: n, ..Default::default() })?;
    let text = s.decode(&g.tokens)?.unwrap_or_default();
    let matches = g.tokens == want[..n.min(want.len())] && n <= want.len();
    report(a, &format!("{prompt_text:?} ->"), &text, &g, total)?;
    if n <= want.len() {
        if matches {
            eprintln!("tokens equal the transformers reference (reference_q4.json greedy_ids, {n} tokens)");
        } else if a.compute.dense != DenseFormat::Stored || a.compute.idot {
            let same = g.tokens.iter().zip(&want).take_while(|(a, b)| a == b).count();
            eprintln!(
                "--dense {} --idot {}: the first {same} of {n} tokens equal the transformers reference (these \
                 options trade exactness for speed)",
                a.compute.dense, a.compute.idot
            );
        } else {
            bail!(
                "tokens differ from the transformers reference:\n  ours      {:?}\n  reference {:?}",
                g.tokens,
                &want[..n]
            );
        }
    } else {
        eprintln!("(the reference has {} tokens; generated {n}, so only a prefix could be compared)", want.len());
    }
    Ok(())
}

/// The demo's session: `dir`'s model on `store` with the reading, scheduling and compute flags of
/// `a`, an expert cache of `ecap` experts and `max_seq` positions (opened as [`open_session`] does).
fn demo_session(
    a: &Args,
    dir: ModelDir,
    store: StoreUri,
    ecap: usize,
    max_seq: usize,
    tokenizer: Option<Tokenizer>,
) -> anyhow::Result<Session> {
    let opts = SessionOptions {
        model: dir,
        store,
        engine: a.engine.options(),
        schedule: a.engine.schedule(),
        verify: false,
        ecap: Some(ecap),
        max_seq,
        dense: a.compute.dense,
    };
    let mut s = open_session(&opts, tokenizer)?;
    s.model.set_prefill_chunk(a.engine.prefill_chunk(false)?)?;
    a.compute.apply(&mut s.model);
    Ok(s)
}

/// Opens with O_DIRECT and, if the file system refuses it (tmpfs), retries buffered with a warning.
fn open_session(opts: &SessionOptions, tokenizer: Option<Tokenizer>) -> anyhow::Result<Session> {
    match Session::open(opts, tokenizer) {
        Ok(s) => Ok(s),
        Err(e @ picchio_runtime::Error::Engine(picchio_blockdev::Error::DirectUnsupported { .. }))
            if opts.engine.direct =>
        {
            eprintln!(
                "warning: {}; retrying with buffered reads (pass --buffered to skip this)",
                picchio_core::error::chain(&e)
            );
            let tokenizer = Tokenizer::from_dir(opts.model.path())?;
            let mut o = opts.clone();
            o.engine.direct = false;
            Ok(Session::open(&o, tokenizer)?)
        }
        Err(e) => Err(e.into()),
    }
}

fn synthetic(a: &Args, workdir: &Path, gb: f64) -> anyhow::Result<()> {
    let (spec, model, image) = synthetic_model(workdir, a.arch.unwrap_or_default(), gb, a.json)?;
    let n = a.n.unwrap_or(32);
    let total = spec.layers * spec.experts;
    // A fixed pseudo-random prompt of 16 ids.
    let prompt = picchio_bench::decode::prompt_of_len(16, spec.vocab);
    let dir = ModelDir::open(&model)?;
    let ecap = demo_ecap(a, &dir, total, 10.0, prompt.len().saturating_add(n))?;
    let tokenizer = Tokenizer::from_dir(&model)?;
    let mut s = demo_session(a, dir, StoreUri::File(image), ecap, prompt.len().saturating_add(n), tokenizer)?;
    let g = s.generate(&prompt, &GenerateOptions { max_new: n, ..Default::default() })?;
    let ids = g.tokens.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
    // With the model's tokenizer, also the text of the ids (random weights: not language).
    let text = s.decode(&g.tokens).ok().flatten();
    report(a, "prompt ids ->", text.as_deref().unwrap_or(&ids), &g, total)?;
    if let (Some(t), false) = (&text, a.json) {
        eprintln!("as text ({} tokenizer): {t:?}", spec.arch);
    }
    Ok(())
}

fn report(a: &Args, what: &str, text: &str, g: &picchio_runtime::run::Generation, total: usize) -> anyhow::Result<()> {
    let st = &g.stats;
    if a.json {
        println!("{}", serde_json::json!({"prompt_ids": g.prompt_ids, "tokens": g.tokens, "text": text, "stats": st}));
    } else if a.synthetic_gb.is_some() {
        println!("{what} {}", g.tokens.iter().map(u32::to_string).collect::<Vec<_>>().join(" "));
    } else {
        println!("{what} {text}");
    }
    eprintln!(
        "{} tokens at {:.2} tok/s decode (prefill {:.0} ms, decode {:.0} ms)\n\
         expert cache: {} of {} experts; {} hits, {} misses ({:.1}% hit rate)\n\
         read {:.1} MB in {} expert reads at {:.0} MB/s while in flight ({:.0} ms), {:.0} ms of exposed I/O wait, \
         {}",
        st.generated_tokens,
        st.decode_tok_s,
        st.prefill_ms,
        st.decode_ms,
        st.cache_capacity,
        total,
        st.cache_hits,
        st.cache_misses,
        100.0 * st.cache_hits as f64 / (st.cache_hits + st.cache_misses).max(1) as f64,
        st.bytes_read as f64 / 1e6,
        st.reads,
        st.read_mb_s,
        st.read_span_ms,
        st.read_wait_ms,
        super::run::source_summary(st)
    );
    Ok(())
}

/// The random-weight `arch` model of `--synthetic-gb GB` under `workdir`, in
/// `synthetic-<arch>-<L>l-seed0`: written and packed on first use, reused while its config.json's
/// `picchio_synthetic` stamp (arch, layers, vocabulary, seed, writer version) matches and its image
/// exists, rewritten otherwise (the writer builds it beside and renames it into place, so an
/// interrupted write leaves no half directory). It gets the arch's vendored tokenizer when the
/// checkout the binary was built from is here. Returns its spec, directory and image. Shared by
/// `picchio demo` and `picchio bench cache|trace --synthetic-gb`.
///
/// # Errors
/// `gb` outside (0, 4096], or the write/pack errors, naming the path.
pub(super) fn synthetic_model(
    workdir: &Path,
    arch: SyntheticArch,
    gb: f64,
    quiet_progress: bool,
) -> anyhow::Result<(SyntheticSpec, PathBuf, PathBuf)> {
    if !(gb > 0.0 && gb <= 4096.0) {
        bail!("--synthetic-gb must be in (0, 4096], got {gb}");
    }
    std::fs::create_dir_all(workdir).with_context(|| format!("creating {}", workdir.display()))?;
    let workdir = workdir.canonicalize().with_context(|| format!("resolving {}", workdir.display()))?;
    let spec = SyntheticSpec::with_expert_gb(arch, gb, 0);
    let model = workdir.join(spec.dir_name());
    let image = model.join(DEFAULT_IMAGE);
    if is_written(&model, &spec) {
        eprintln!(
            "reusing {} ({arch}, {} layers, {:.2} GB of experts)",
            model.display(),
            spec.layers,
            spec.expert_bytes() as f64 / 1e9
        );
    } else {
        eprintln!(
            "writing a random-weight {arch} model: {} × {} experts × {} B = {:.2} GB of Q4 experts \
             (about {:.1} GB on disk with the resident tensors and the image) -> {}",
            super::synth::layers_phrase(spec.layers as u64),
            spec.experts,
            spec.expert_layout().len(),
            spec.expert_bytes() as f64 / 1e9,
            spec.disk_bytes() as f64 / 1e9,
            model.display()
        );
        write_synthetic(&model, &spec, &synthetic_options(arch, !quiet_progress))?;
    }
    Ok((spec, model, image))
}

/// The writer options of a synthetic `arch` model: its vendored tokenizer when the checkout is here
/// (else a warning: prompts must then be ids).
pub(super) fn synthetic_options(arch: SyntheticArch, progress: bool) -> WriteSyntheticOptions {
    let tokenizer = arch.vendored_tokenizer();
    if tokenizer.is_none() {
        eprintln!(
            "warning: the {arch} tokenizer of the checkout this binary was built from is not here; the model \
             gets no tokenizer.json (prompts must be ids)"
        );
    }
    WriteSyntheticOptions { tokenizer, progress }
}
