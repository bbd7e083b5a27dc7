//! `picchio run`.

use std::path::PathBuf;

use anyhow::{bail, Context};
use picchio_core::StoreUri;
use picchio_runtime::expert::open::{EngineOptions, IoEngine};
use picchio_runtime::expert::usage::UsageOut;
use picchio_runtime::model::prefill::DEFAULT_PREFILL_CHUNK;
use picchio_runtime::model::sampler::SamplerOptions;
use picchio_runtime::model::tokenizer::Tokenizer;
use picchio_runtime::model::trace::{TraceHeader, TraceWriter};
use picchio_runtime::model::DecodeSchedule;
use picchio_runtime::run::{dump_logits, GenerateOptions, RunStats, Session, SessionOptions};
use picchio_runtime::ModelDir;

/// Options of `picchio run`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Converted model directory (from `picchio convert`), or a GGUF file (`qwen3moe` or `gpt-oss`,
    /// llama.cpp's files as they are; split files by their first part), read in place.
    #[arg(long, value_name = "DIR|GGUF")]
    pub model: PathBuf,
    /// Where routed experts come from: `auto` (DIR/experts.picchioflat when present and valid, else
    /// safetensors), `safetensors`, `file:PATH` or a path (a .picchioflat image in a file; a name
    /// containing ':' is written file:PATH or ./PATH), `raw:/dev/X[@BYTES]` (an image on a block
    /// device from byte BYTES, default 0, as `pack --out raw:` wrote it), `nvme:BDF[/NSID]` (an
    /// image at LBA 0 of namespace NSID, default 1, of the NVMe controller BDF, read through the
    /// user-space driver; bind it first with `picchio nvme bind BDF`), or
    /// `nvme-tcp://HOST:PORT/NQN[/NSID]` (an image at LBA 0 of a namespace of a remote NVMe-oF
    /// subsystem, read over NVMe/TCP by our initiator; `picchio nvme discover HOST:PORT` lists NQNs).
    #[arg(long, value_name = "URI", default_value = "auto")]
    pub store: StoreUri,
    /// Read flat stores with O_DIRECT, bypassing the page cache (the default).
    #[arg(long, conflicts_with = "buffered")]
    pub direct: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub compute: super::compute_args::ComputeArgs,
    /// Expert-cache capacity in experts across all MoE layers [default: what --mem leaves, else all
    /// experts that fit in half the available memory].
    #[arg(long, value_name = "N", conflicts_with = "ecap_per_layer")]
    pub ecap: Option<usize>,
    /// Expert-cache capacity in slots per MoE layer (Picchio (C)'s ECAP): N × MoE layers experts.
    #[arg(long, value_name = "N")]
    pub ecap_per_layer: Option<usize>,
    /// One memory budget for the dense part, the KV cache and the expert cache (which gets the rest):
    /// bytes (8GB, 8GiB, 500MB; a bare number is GB) or a percentage of the cgroup's memory.max (else
    /// of MemAvailable), e.g. 50%. The plan is printed on stderr (`picchio plan` prints it alone); a
    /// budget below one token's working set is refused with the figures.
    #[arg(long, value_name = "SIZE")]
    pub mem: Option<picchio_runtime::plan::MemBudget>,
    /// KV-cache positions [default: prompt + new tokens]; at least that many.
    #[arg(long, value_name = "N")]
    pub ctx: Option<usize>,
    /// Check every expert payload's hash after reading it; mismatches fall back to safetensors.
    #[arg(long)]
    pub verify: bool,
    /// Save the expert-usage profile of this run (tokens routed to each layer's experts, prompt
    /// included) to FILE as `picchio-usage/1` text, adding to FILE's counts when it already holds a
    /// profile of this model's shape (docs/experiments.md, "usage profile").
    #[arg(long, value_name = "FILE")]
    pub usage_out: Option<PathBuf>,
    /// Warm start: before the prompt, read the most used experts of the usage profile FILE (from
    /// --usage-out), as many as the expert cache holds, into the cache. The cache stays an LRU
    /// (nothing is pinned); --json reports the warm-up as stats.warm. Off by default (a cold start).
    #[arg(long, value_name = "FILE")]
    pub warm_from: Option<PathBuf>,
    /// Prompt text (needs DIR/tokenizer.json).
    #[arg(long, value_name = "TEXT", conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "max-new-tokens", value_name = "N", default_value_t = 32)]
    pub n: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, value_name = "T", default_value_t = 0.0, value_parser = super::f32_in_range)]
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1].
    #[arg(long, value_name = "P", default_value_t = 1.0, value_parser = super::f32_in_range)]
    pub top_p: f32,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Sampling seed.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Stop at the model's end-of-turn ids: generation_config.json's and config.json's
    /// `eos_token_id`, the tokenizer config's `eos_token`, the chat template's end-of-turn token.
    #[arg(long)]
    pub stop_at_eos: bool,
    /// Print one JSON object on stdout: prompt_ids, tokens, text, stats.
    #[arg(long)]
    pub json: bool,
    /// Write the logits each generated token was chosen from to a safetensors file
    /// (tensor `logits`, f32 [n_generated, vocab]).
    #[arg(long, value_name = "PATH")]
    pub dump_logits: Option<PathBuf>,
    /// Record every routing decision (layer, position, top-k experts, their weights) to a
    /// picchio-trace/1 file (JSON lines; docs/experiments.md, "trace"), for `picchio bench trace`.
    #[arg(long, value_name = "PATH")]
    pub trace: Option<PathBuf>,
}

/// Sampling options beyond temperature and top-p, shared by `run` and `chat`.
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Keep only the K most probable tokens when sampling; 0 keeps all.
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub top_k: usize,
    /// Keep only tokens at least P times as probable as the most probable one; 0 disables.
    #[arg(long, value_name = "P", default_value_t = 0.0, value_parser = super::f32_in_range)]
    pub min_p: f32,
    /// Repetition penalty over the sequence's ids (transformers' `repetition_penalty`; 1 is none).
    #[arg(long, value_name = "R", default_value_t = 1.0, value_parser = super::f32_in_range)]
    pub repetition_penalty: f32,
}

impl SamplingArgs {
    /// The sampler options of these flags with `temperature`, `top_p` and `seed`, range-checked.
    pub fn options(&self, temperature: f32, top_p: f32, seed: u64) -> anyhow::Result<SamplerOptions> {
        let o = SamplerOptions {
            temperature,
            top_p,
            seed,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            ..SamplerOptions::default()
        };
        o.check().map_err(|m| anyhow::anyhow!("--{}", m.replacen('_', "-", 1)))?;
        Ok(o)
    }
}

/// Engine and MoE scheduling options shared by `run`, `demo`, `chat`, `serve`, `bench cache` and
/// `bench decode`.
#[derive(clap::Args, Debug, Clone)]
pub struct EngineArgs {
    /// Read flat stores through the page cache instead of O_DIRECT (for file systems without
    /// O_DIRECT, or warm-cache runs; `bench cache`: measure buffered reads only, as --reads buffered).
    #[arg(long)]
    pub buffered: bool,
    /// Reader threads of the psync engine; for an nvme-tcp:// store, the I/O queues (TCP connections).
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = super::int_in::<u16>(1, Some(256)))]
    pub io_threads: u16,
    /// I/O engine for flat stores: `uring` (io_uring, Linux; the default there, falling back to psync
    /// with a warning where io_uring is unavailable), `psync` (a pool of --io-threads pread threads),
    /// or `iocp` (overlapped I/O with a completion port; Windows, its default there).
    #[arg(long = "io", value_name = "ENGINE", default_value_t = IoEngine::default(), value_parser = engine_of_this_os)]
    pub io: IoEngine,
    /// uring: reads in flight at once (1-256); nvme-tcp://: commands in flight per I/O queue. 1 is
    /// one read at a time; deeper queues let the device work on several experts together.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = super::int_in::<u32>(1, Some(256)))]
    pub qd: u32,
    /// uring: a kernel thread polls for new reads, so none needs a syscall (costs a busy CPU; may need
    /// root on kernels before 5.11).
    #[arg(long)]
    pub sqpoll: bool,
    /// uring: poll the device for completions instead of waiting for interrupts (needs O_DIRECT and a
    /// device with polled queues, e.g. NVMe with nvme.poll_queues=N).
    #[arg(long, conflicts_with = "buffered")]
    pub iopoll: bool,
    /// uring: register the file with the ring (measurement switch; on by default).
    #[arg(long, hide = true, value_name = "BOOL", action = clap::ArgAction::Set,
          default_value_t = EngineOptions::default().register_files)]
    pub register_files: bool,
    /// Compute each routed expert as soon as its read completes, while the layer's other reads are in
    /// flight (the default).
    #[arg(long, overrides_with = "no_async_moe")]
    pub async_moe: bool,
    /// Wait for all of a layer's expert reads, then compute the experts in router order (for
    /// measurement: tokens are identical either way).
    #[arg(long, overrides_with = "async_moe")]
    pub no_async_moe: bool,
    /// Prompt tokens per prefill chunk: each chunk runs every dense projection as one matrix-matrix
    /// product and fetches the union of its routed experts once per MoE layer, so the prompt reads
    /// each expert (and streams each resident weight) once per chunk instead of once per token.
    /// 1 runs the prompt token by token; tokens are identical at any size. [default: 256 (measured
    /// fastest on the real-geometry model: docs/experiments.md); 1 with --trace, whose file is in
    /// token-by-token order]
    #[arg(long, value_name = "N", value_parser = super::int_in::<u32>(1, None))]
    pub prefill_chunk: Option<u32>,
    /// Decode without the I/O thread: each layer computes its cached experts first and only then
    /// reads its misses (for measurement: tokens are identical either way). By default a decode
    /// step's reads run on an I/O thread while the layer's cached experts are computed.
    #[arg(long)]
    pub no_overlap: bool,
    /// Speculative prefetch: before a layer's experts are computed, predict the next layer's
    /// experts from the current hidden state through the next layer's router and start reading
    /// them. Costs the wrong guesses' reads (`--json`: prefetch_stats, prefetch_wasted_bytes);
    /// off by default (docs/experiments.md, "bench decode"). Tokens are identical either way.
    #[arg(long, conflicts_with_all = ["no_overlap", "no_async_moe"])]
    pub prefetch: bool,
}

/// The engines this OS has, its default first.
const ENGINES_HERE: &[IoEngine] = if cfg!(target_os = "linux") {
    &[IoEngine::Uring, IoEngine::Psync]
} else if cfg!(windows) {
    &[IoEngine::Iocp, IoEngine::Psync]
} else {
    &[IoEngine::Psync]
};

/// `--io ENGINE`: an engine this OS has. Another OS's engine (`iocp` on Linux, `uring` on Windows) is
/// a usage error naming the engines here, not a warning followed by a run from safetensors.
fn engine_of_this_os(s: &str) -> Result<IoEngine, String> {
    let e: IoEngine = s.parse()?;
    if ENGINES_HERE.contains(&e) {
        return Ok(e);
    }
    let here = ENGINES_HERE.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
    let only = match e {
        IoEngine::Iocp => "the Windows engine",
        IoEngine::Uring => "the Linux engine",
        IoEngine::Psync => "not available",
    };
    Err(format!("{e} is {only}; this OS ({}) has {here}", std::env::consts::OS))
}

impl EngineArgs {
    /// The prefill chunk of `--prefill-chunk` ([`DEFAULT_PREFILL_CHUNK`] when not given); with a
    /// routing trace (`tracing`), 1 when not given, since a picchio-trace/1 file and the cache
    /// simulations of `bench trace` are in token-by-token order.
    ///
    /// # Errors
    /// `--prefill-chunk` above 1 together with `--trace`.
    pub fn prefill_chunk(&self, tracing: bool) -> anyhow::Result<usize> {
        match (self.prefill_chunk, tracing) {
            (Some(n), true) if n > 1 => bail!(
                "--trace records a token-by-token trace (picchio-trace/1 is in position order): \
                 leave out --prefill-chunk {n} or give --prefill-chunk 1"
            ),
            (Some(n), _) => Ok(n as usize),
            (None, true) => Ok(1),
            (None, false) => Ok(DEFAULT_PREFILL_CHUNK),
        }
    }

    /// The engine options of these flags.
    pub fn options(&self) -> EngineOptions {
        EngineOptions {
            engine: self.io,
            direct: !self.buffered,
            threads: usize::from(self.io_threads),
            qd: self.qd,
            sqpoll: self.sqpoll,
            iopoll: self.iopoll,
            register_files: self.register_files,
            ..EngineOptions::default()
        }
    }

    /// The decode schedule of these flags (`--no-async-moe`, `--no-overlap`, `--prefetch`).
    pub fn schedule(&self) -> DecodeSchedule {
        DecodeSchedule { async_moe: !self.no_async_moe, overlap: !self.no_overlap, prefetch: self.prefetch }
    }
}

/// The end of the stats line `run` and `demo` print: where the experts came from, through which
/// engine, the fallbacks to safetensors and the peak RSS
/// (`from STORE via ENGINE[, async MoE]; N fallbacks; peak RSS M MB`).
pub(super) fn source_summary(st: &RunStats) -> String {
    format!(
        "from {} via {}{}; {} fallbacks; peak RSS {:.0} MB",
        st.store,
        st.engine,
        if st.async_moe { ", async MoE" } else { "" },
        st.fallbacks,
        st.peak_rss_bytes as f64 / 1e6
    )
}

pub fn exec(a: Args) -> anyhow::Result<()> {
    // Ctrl-C / SIGTERM stop generation (and any wait for an nvme: device) so the store is closed
    // cleanly; the process then exits 128 + signal (main.rs).
    picchio_runtime::interrupt::install().context("installing the SIGINT/SIGTERM handlers")?;
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", a.top_p);
    }
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        bail!("--temperature must be a finite number >= 0 (0 is greedy), got {}", a.temperature);
    }
    let sampler = a.sampling.options(a.temperature, a.top_p, a.seed)?;
    // config.json is read here, once, and handed down (the plan, the usage profile, the session).
    let model = ModelDir::open(&a.model).with_context(|| format!("opening model {}", a.model.display()))?;
    // Claimed before anything loads: a path that cannot take the profile is refused now, not after
    // the run's output.
    let usage_out = match &a.usage_out {
        Some(p) => {
            let out = UsageOut::create(p, model.config())
                .with_context(|| format!("--usage-out {}: cannot save the usage profile there", p.display()))?;
            Some(out)
        }
        None => None,
    };
    let tokenizer = Tokenizer::for_model(&model)?;
    let prompt_ids = match (&a.prompt, &a.prompt_ids, &tokenizer) {
        (_, Some(ids), _) => ids.clone(),
        (Some(text), None, Some(t)) => t.encode(text)?,
        (Some(_), None, None) => {
            bail!("{} has no tokenizer.json: give the prompt as token ids with --prompt-ids 1,2,3", a.model.display())
        }
        (None, None, _) => unreachable!("clap requires --prompt or --prompt-ids"),
    };
    let needed = prompt_ids.len().saturating_add(a.n);
    let max_seq = match a.ctx {
        Some(c) if c < needed => {
            bail!("--ctx {c}: the prompt ({}) and -n {} need {needed} positions", prompt_ids.len(), a.n)
        }
        Some(c) => {
            super::plan::check_ctx(c, model.config())?;
            c
        }
        None => needed,
    };
    // With a budget or an explicit cache the plan decides the capacity, and refuses (naming the
    // figures) before anything loads when it cannot fit; without either, Session's default.
    let cache = super::plan::cache_request(a.ecap, a.ecap_per_layer);
    let ecap = if a.mem.is_some() || cache.is_some() {
        let plan = super::plan::plan_for(&model, a.mem, cache, max_seq, a.compute.dense)?;
        if a.mem.is_some() {
            eprintln!("{plan}");
        }
        Some(plan.ecap)
    } else {
        None
    };
    let opts = SessionOptions {
        model,
        store: a.store.clone(),
        engine: a.engine.options(),
        schedule: a.engine.schedule(),
        verify: a.verify,
        ecap,
        max_seq,
        dense: a.compute.dense,
    };
    let chunk = a.engine.prefill_chunk(a.trace.is_some())?;
    let mut s = Session::open(&opts, tokenizer).with_context(|| format!("opening model {}", a.model.display()))?;
    s.model.set_prefill_chunk(chunk)?;
    a.compute.apply(&mut s.model);
    let gen =
        GenerateOptions { max_new: a.n, sampler, stop_at_eos: a.stop_at_eos, keep_logits: a.dump_logits.is_some() };
    if let Some(p) = &a.trace {
        let header = TraceHeader::new(&a.model, s.model.config(), s.cache.slot_len() as u64);
        s.model.set_routing_observer(Box::new(TraceWriter::create(p, &header)?));
    }
    if let Some(p) = &a.warm_from {
        s.warm_from(p).with_context(|| format!("warm start from {}", p.display()))?;
    }
    // Ctrl-C / SIGTERM end the generation with what it has: printed below like a whole run's, with
    // the stats marked interrupted, then the exit status says so (128 + signal).
    let g = s.generate_until_interrupted(&prompt_ids, &gen)?;
    // Saved now, told after the output: a profile that cannot be written does not lose the tokens.
    let usage_saved = usage_out.map(|u| {
        let p = u.path().to_path_buf();
        u.save(&s.usage_profile()).map(|merged| (p, merged))
    });
    if let Some(p) = &a.trace {
        s.model.take_routing_observer().with_context(|| format!("writing the trace {}", p.display()))?;
    }
    if let Some(p) = &a.dump_logits {
        dump_logits(p, &g.logits, s.model.config().vocab_size)?;
    }
    let text = s.decode(&g.tokens)?;
    if a.json {
        let out = serde_json::json!({
            "prompt_ids": g.prompt_ids,
            "tokens": g.tokens,
            "text": text,
            "stats": g.stats,
        });
        println!("{out}");
    } else {
        match &text {
            Some(t) => println!("{t}"),
            None => println!("{}", g.tokens.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")),
        }
        let st = &g.stats;
        let stopped = match &st.interrupted {
            Some(signal) => format!(" (interrupted by {signal} after {} of {} tokens)", st.generated_tokens, a.n),
            None => String::new(),
        };
        eprintln!(
            "{} tokens{stopped}, {:.2} tok/s decode (prefill {:.0} ms); cache {} hits / {} misses (capacity {}); \
             {:.1} MB read ({:.0} MB/s while in flight, {:.0} ms of exposed I/O wait) {}",
            st.generated_tokens,
            st.decode_tok_s,
            st.prefill_ms,
            st.cache_hits,
            st.cache_misses,
            st.cache_capacity,
            st.bytes_read as f64 / 1e6,
            st.read_mb_s,
            st.read_wait_ms,
            source_summary(st)
        );
    }
    match usage_saved {
        Some(Ok((p, merged))) => {
            tracing::info!("usage profile {} {}", if merged { "added to" } else { "written to" }, p.display())
        }
        Some(Err(e)) => return Err(e).context("saving the usage profile (--usage-out); the output above is complete"),
        None => {}
    }
    match g.stats.interrupted {
        // The output above holds what was generated; the status tells the run did not finish.
        Some(signal) => {
            Err(picchio_runtime::Error::Interrupted { signal, done: g.tokens.len(), wanted: a.n, unit: "tokens" }
                .into())
        }
        None => Ok(()),
    }
}
