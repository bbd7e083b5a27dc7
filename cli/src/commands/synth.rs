//! `picchio synth`: a real-geometry image of pseudo-random payloads (`--out`), or with `--model-out`
//! a complete random-weight model directory (the writer `picchio demo --synthetic-gb` uses).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use picchio_core::StoreUri;
use picchio_runtime::expert::open::write_target;
use picchio_runtime::image::synthetic_image::{synth, synth_to, Geometry, SynthOptions};
use picchio_runtime::image::synthetic_model::{write_synthetic, SyntheticArch, SyntheticSpec, WriteSyntheticOptions};
use picchio_runtime::image::write::{WriteOptions, WriteTo};

/// Options of `picchio synth`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Expert geometry: qwen3-30b-a3b (48 × 128 experts of 2,654,208 B), gpt-oss-20b (24 × 32 of
    /// 13,996,800 B), gpt-oss-120b (36 × 128 of 13,996,800 B), or custom (--hidden,
    /// --moe-intermediate, --experts, --model-layers, [--topk], [--expert-bytes]). With --model-out:
    /// qwen3-30b-a3b or gpt-oss-20b.
    #[arg(long, value_name = "ARCH")]
    pub arch: String,
    /// Where to write the image. A path (or file:PATH; a name containing ':' must be written
    /// file:PATH or ./PATH) is written atomically, after checking the file system has room; an
    /// existing file is replaced only if it is empty or an earlier image. raw:/dev/X[@BYTES] writes a
    /// block device after inspecting it (refused if too small, mounted, in use, or carrying a
    /// partition table or file-system signature, unless --force; never the device behind /), then
    /// reads it back and checks it. nvme:BDF[/NSID] writes the namespace through the user-space
    /// driver exactly as `picchio pack --out nvme:` does (the controller bound to vfio-pci first);
    /// nvme-tcp://HOST:PORT/NQN[/NSID] through the NVMe/TCP initiator, as `pack --out nvme-tcp://`.
    #[arg(
        long,
        value_name = "PATH|raw:/dev/X[@BYTES]|nvme:BDF[/NSID]|nvme-tcp://HOST:PORT/NQN[/NSID]",
        required_unless_present = "model_out",
        conflicts_with = "model_out"
    )]
    pub out: Option<String>,
    /// Instead of an image: write a complete random-weight model directory with --arch's real
    /// geometry (qwen3-30b-a3b or gpt-oss-20b): config.json, the vendored tokenizer, resident tensors
    /// (I8 embeddings and lm_head with row scales, F32 attention, norms and router), Q4 expert shards
    /// and DIR/experts.picchioflat, initialised so a deep random stack routes and decodes like a real
    /// one (docs/synthetic-models.md). Built in .DIR.picchio-synthetic-PID/ beside DIR and renamed
    /// into place after a free-space check (a killed run's leftover is removed by the next one); an
    /// existing DIR is replaced only if it is an earlier synthetic model. For a small model (tests,
    /// CI) add --layers 1, --experts and --vocab.
    #[arg(long, value_name = "DIR")]
    pub model_out: Option<PathBuf>,
    /// With --model-out: the vocabulary size V [default: the real model's, 151,936 or 201,088]. The
    /// I8 embeddings and lm_head are V × hidden bytes each (622 MB together for Qwen3's real V), so a
    /// small V such as 1024 makes a small model. A V below the vendored tokenizer's ids (151,669
    /// for Qwen3, 200,019 for GPT-OSS) is refused unless --no-tokenizer is given.
    #[arg(long, value_name = "V")]
    pub vocab: Option<u32>,
    /// With --model-out: write no tokenizer. The model's prompts are then token ids below the
    /// vocabulary (`picchio run --prompt-ids 1,2,3`); needed with a --vocab smaller than the
    /// tokenizer's ids.
    #[arg(long)]
    pub no_tokenizer: bool,
    /// Write only the first N layers' entries (the superblock still records the model's layers).
    /// With --model-out: the model's decoder layers [default: the real model's, 48 or 24].
    #[arg(long, value_name = "N")]
    pub layers: Option<u32>,
    /// Seed of the pseudo-random payload bytes (same seed and geometry: same image).
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// custom: hidden size H.
    #[arg(long, value_name = "H")]
    pub hidden: Option<u32>,
    /// custom: expert width I (moe_intermediate_size; the superblock stores 2 × I).
    #[arg(long, value_name = "I")]
    pub moe_intermediate: Option<u32>,
    /// custom: routed experts per layer. With --model-out: routed experts per layer, at least the
    /// model's top-k (8 or 4) [default: the real model's, 128 or 32].
    #[arg(long, value_name = "E")]
    pub experts: Option<u32>,
    /// custom: decoder layers of the model.
    #[arg(long, value_name = "L")]
    pub model_layers: Option<u32>,
    /// custom: experts per token [default: min(8, E)].
    #[arg(long, value_name = "K")]
    pub topk: Option<u32>,
    /// custom: bytes of one expert payload [default: the Q4 payload of H × I, 27·H·I/16]; at most
    /// 4,294,963,200 (the format's u32 padded_len).
    #[arg(long, value_name = "BYTES")]
    pub expert_bytes: Option<u64>,
    /// With --out raw:, write the device although it carries a partition table or a file-system
    /// signature, or is found mounted or in use (never the device backing /); and write a file or
    /// device another picchio process is reading (a file's reader keeps the old image).
    #[arg(long)]
    pub force: bool,
    /// Reader threads for reading a raw: image back after writing it.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub io_threads: usize,
    /// Hide the progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

/// The first of the custom-geometry flags given, other than those in `allowed`.
fn custom_flag(a: &Args, allowed: &[&str]) -> Option<&'static str> {
    [
        ("--hidden", a.hidden.is_some()),
        ("--moe-intermediate", a.moe_intermediate.is_some()),
        ("--experts", a.experts.is_some()),
        ("--model-layers", a.model_layers.is_some()),
        ("--topk", a.topk.is_some()),
        ("--expert-bytes", a.expert_bytes.is_some()),
    ]
    .into_iter()
    .find(|(flag, given)| *given && !allowed.contains(flag))
    .map(|(flag, _)| flag)
}

fn geometry(a: &Args) -> anyhow::Result<Geometry> {
    if a.arch != "custom" {
        if let Some(flag) = custom_flag(a, &[]) {
            bail!("{flag} only applies to --arch custom (--arch {} has a fixed geometry)", a.arch);
        }
        return Ok(Geometry::named(&a.arch)?);
    }
    let need = |v: Option<u32>, flag: &str| v.ok_or_else(|| anyhow::anyhow!("--arch custom needs {flag}"));
    let (h, i) = (need(a.hidden, "--hidden")?, need(a.moe_intermediate, "--moe-intermediate")?);
    let (e, l) = (need(a.experts, "--experts")?, need(a.model_layers, "--model-layers")?);
    let mut g = Geometry::q4(h, l, e, a.topk.unwrap_or(e.min(8)), i);
    match a.expert_bytes {
        Some(b) => g.expert_bytes = b,
        None if h % 64 != 0 || i % 64 != 0 => {
            bail!("--hidden {h} and --moe-intermediate {i} must be multiples of 64 for the Q4 payload size (or give --expert-bytes)")
        }
        None => {}
    }
    g.check()?;
    Ok(g)
}

pub fn exec(a: Args) -> anyhow::Result<()> {
    if let Some(dir) = &a.model_out {
        return synth_model(&a, dir);
    }
    // (clap's `requires` would not catch these: --out conflicts with --model-out.)
    for (flag, given) in [("--vocab", a.vocab.is_some()), ("--no-tokenizer", a.no_tokenizer)] {
        if given {
            bail!("{flag} only applies to --model-out (an image of --out has no vocabulary or tokenizer)");
        }
    }
    let opts = SynthOptions { geometry: geometry(&a)?, layers: a.layers, seed: a.seed, progress: !a.no_progress };
    let out = match write_target(a.out.as_deref().expect("clap requires --out or --model-out"))? {
        StoreUri::File(path) => path,
        StoreUri::Raw { device, offset } => {
            picchio_runtime::interrupt::install().context("installing the SIGINT/SIGTERM handlers")?;
            return synth_raw(&a, &device, offset, &opts);
        }
        StoreUri::Nvme { bdf, nsid } => {
            picchio_runtime::interrupt::install().context("installing the SIGINT/SIGTERM handlers")?;
            return synth_nvme(&a, &bdf, nsid, &opts);
        }
        uri @ StoreUri::NvmeTcp { .. } => {
            picchio_runtime::interrupt::install().context("installing the SIGINT/SIGTERM handlers")?;
            return synth_device(&a, &uri, &opts);
        }
        other => unreachable!("write_target refuses {other}"),
    };
    // SIGINT/SIGTERM stop the write between payloads; the temporary file is removed on the way out.
    picchio_runtime::interrupt::install().context("installing the SIGINT/SIGTERM handlers")?;
    let report = if a.force {
        // A file image another picchio process is reading is replaced anyway (it keeps its old bytes).
        let wopts = WriteOptions { force: true, ..WriteOptions::default() };
        synth_to(WriteTo::Uri(&StoreUri::File(out)), &opts, &wopts, &mut |_| {})?
    } else {
        synth(&out, &opts)?
    };
    println!("{report}");
    Ok(())
}

fn synth_raw(a: &Args, device: &std::path::Path, offset: u64, opts: &SynthOptions) -> anyhow::Result<()> {
    synth_device(a, &StoreUri::Raw { device: device.into(), offset }, opts)
}

fn synth_nvme(a: &Args, bdf: &str, nsid: u32, opts: &SynthOptions) -> anyhow::Result<()> {
    synth_device(a, &StoreUri::Nvme { bdf: bdf.into(), nsid }, opts)
}

/// `--out raw:`, `nvme:` or `nvme-tcp:` through the image writer, which prints its plan before writing.
fn synth_device(a: &Args, uri: &StoreUri, opts: &SynthOptions) -> anyhow::Result<()> {
    let wopts = WriteOptions { force: a.force, io_threads: a.io_threads, ..WriteOptions::default() };
    let report = synth_to(WriteTo::Uri(uri), opts, &wopts, &mut |plan| eprintln!("{plan}"))?;
    println!("{report}");
    Ok(())
}

/// `--model-out DIR`: the random-weight model directory of `--arch`.
fn synth_model(a: &Args, dir: &Path) -> anyhow::Result<()> {
    let arch: SyntheticArch = a.arch.parse().with_context(|| format!("--arch {} with --model-out", a.arch))?;
    if let Some(flag) = custom_flag(a, &["--experts"]) {
        bail!("{flag} does not apply to --model-out (the model has --arch {arch}'s geometry; only --layers, --experts and --vocab change its size)");
    }
    if a.force {
        bail!("--force only applies to --out raw:/dev/X or nvme:BDF (--model-out replaces only an earlier synthetic model)");
    }
    let layers = match a.layers {
        Some(0) => bail!("--layers must be at least 1"),
        Some(n) => n as usize,
        None => arch.real_layers(),
    };
    let mut spec = SyntheticSpec::real(arch, layers, a.seed);
    match a.experts {
        Some(e) if (e as usize) < spec.topk => bail!(
            "--experts {e} is fewer than the {arch} model's {} experts per token: give --experts {} or more",
            spec.topk,
            spec.topk
        ),
        Some(e) => spec.experts = e as usize,
        None => {}
    }
    match a.vocab {
        Some(0) => bail!("--vocab must be at least 1 (the model needs a token to embed)"),
        Some(v) => spec.vocab = v as usize,
        None => {}
    }
    let layers_n = layers_phrase(layers as u64);
    eprintln!(
        "writing a random-weight {arch} model: {layers_n} × {} experts × {} B = {:.2} GB of Q4 experts \
         (about {:.1} GB on disk with the resident tensors and the image) -> {}",
        spec.experts,
        spec.expert_layout().len(),
        spec.expert_bytes() as f64 / 1e9,
        spec.disk_bytes() as f64 / 1e9,
        dir.display()
    );
    // SIGINT/SIGTERM stop the write between shards; the temporary directory is removed on the way out.
    picchio_runtime::interrupt::install().context("installing the SIGINT/SIGTERM handlers")?;
    let opts = if a.no_tokenizer {
        WriteSyntheticOptions { tokenizer: None, progress: !a.no_progress }
    } else {
        super::demo::synthetic_options(arch, !a.no_progress)
    };
    let tokenizer = opts.tokenizer.clone();
    write_synthetic(dir, &spec, &opts).map_err(|e| match e {
        // The one check of the tokenizer against the vocabulary is the writer's; here it gets the flag.
        e @ picchio_runtime::Error::VocabBelowTokenizer { .. } => {
            anyhow::Error::new(e).context(format!("--vocab {}", spec.vocab))
        }
        e => e.into(),
    })?;
    println!(
        "{}: random-weight {arch} model (seed {}), {layers_n}, {} experts of {} B ({:.2} GB of Q4 experts), \
         {:.2} GB resident, vocabulary {}, tokenizer {}; image {}",
        dir.display(),
        spec.seed,
        spec.experts,
        spec.expert_layout().len(),
        spec.expert_bytes() as f64 / 1e9,
        spec.dense_bytes() as f64 / 1e9,
        spec.vocab,
        tokenizer.map_or_else(
            || "none (prompts are token ids: --prompt-ids)".to_string(),
            |t| format!("from {}", t.display())
        ),
        dir.join(picchio_runtime::expert::store::DEFAULT_IMAGE).display()
    );
    Ok(())
}

/// `"1 layer"`, `"N layers"`: the count of decoder layers as the writers' messages say it.
pub(crate) fn layers_phrase(n: u64) -> String {
    if n == 1 {
        "1 layer".to_string()
    } else {
        format!("{n} layers")
    }
}
