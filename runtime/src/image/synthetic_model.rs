//! Random-weight models with a real model's geometry, for watching experts stream from a store larger
//! than the cache without downloading anything: `picchio demo --synthetic-gb N [--arch A]` and
//! `picchio synth --model-out DIR --arch A`. One writer, [`write_synthetic`], makes the complete
//! converted directory (config.json, tokenizer, resident tensors, Q4 expert shards,
//! model.safetensors.index.json and the `.picchioflat` image) that `Model::load` reads like any
//! `picchio convert` output.
//!
//! Geometries ([`SyntheticArch`]), per layer as the real checkpoints' config.json:
//! - `qwen3-30b-a3b`: hidden 2048, 32 query / 4 KV heads of 128, QK-norm, 128 experts of width 768,
//!   top-8, vocabulary 151,936; each Q4 expert is 2,654,208 B.
//! - `gpt-oss-20b`: hidden 2880, 64 query / 8 KV heads of 64, attention biases and sinks, sliding
//!   (window 128) and full attention alternating, YaRN RoPE (θ 150000, factor 32 over 4096 positions),
//!   32 experts of width 2880, top-4, resident expert biases, swiglu_limit 7, vocabulary 201,088;
//!   each Q4 expert is 13,996,800 B.
//!
//! The resident tensors use Picchio (C)'s converted layout (`tests/fixtures/picchio_c`): embeddings
//! and lm_head I8 `[V, H]` with an F32 row scale `<name>.qs` `[V]`, everything else F32 (attention,
//! biases, sinks, norms, router). Experts are Q4 as `picchio convert` writes them, in the arch's
//! spelling ([`ExpertNaming`]).
//!
//! Initialisation follows `docs/synthetic-models.md` (measured): symmetric zero-mean Q4 codes
//! in [-7, 7], group scales giving weights of standard deviation 1/√fan_in, and an extra factor
//! 1/√(2·n_layers) on the residual-branch outputs (o_proj and the experts' down_proj, and their
//! biases), so routing is near-uniform and greedy output does not collapse to one token.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use picchio_core::rng::{SplitMix64, GOLDEN_GAMMA};
use rayon::prelude::*;
use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::expert::layout::{ExpertLayout, ExpertNaming};
use crate::expert::store::DEFAULT_IMAGE;
use crate::image::convert::shard::{header, OutTensor};
use crate::image::convert::{write_file, TempDir};
use crate::image::pack::{pack, PackOptions};
use crate::model::config::Arch;
use crate::quant::QuantKind;

/// The real models whose geometry a synthetic model copies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SyntheticArch {
    /// Qwen/Qwen3-30B-A3B (`qwen3_moe`).
    #[default]
    Qwen3_30bA3b,
    /// openai/gpt-oss-20b (`gpt_oss`).
    GptOss20b,
}

impl SyntheticArch {
    /// Every arch, in the order the CLI lists them.
    pub const ALL: [SyntheticArch; 2] = [SyntheticArch::Qwen3_30bA3b, SyntheticArch::GptOss20b];

    /// The CLI name: `qwen3-30b-a3b` or `gpt-oss-20b`.
    pub fn name(self) -> &'static str {
        match self {
            SyntheticArch::Qwen3_30bA3b => "qwen3-30b-a3b",
            SyntheticArch::GptOss20b => "gpt-oss-20b",
        }
    }

    /// The runtime architecture the model is read as.
    pub fn arch(self) -> Arch {
        match self {
            SyntheticArch::Qwen3_30bA3b => Arch::Qwen3Moe,
            SyntheticArch::GptOss20b => Arch::GptOss,
        }
    }

    /// Decoder layers of the real model (48 and 24).
    pub fn real_layers(self) -> usize {
        match self {
            SyntheticArch::Qwen3_30bA3b => 48,
            SyntheticArch::GptOss20b => 24,
        }
    }

    /// The vendored tokenizer of this arch in the checkout this crate was built from
    /// (`tests/fixtures/qwen3_moe_text` for Qwen3, `tests/fixtures/tokenizers/gpt_oss` for GPT-OSS),
    /// or `None` when that checkout is not here (an installed binary).
    pub fn vendored_tokenizer(self) -> Option<PathBuf> {
        let rel = match self {
            SyntheticArch::Qwen3_30bA3b => "qwen3_moe_text",
            SyntheticArch::GptOss20b => "tokenizers/gpt_oss",
        };
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(rel);
        dir.join("tokenizer.json").is_file().then(|| dir.canonicalize().unwrap_or(dir))
    }
}

impl std::fmt::Display for SyntheticArch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for SyntheticArch {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|a| a.name() == s).ok_or_else(|| {
            let names: Vec<_> = Self::ALL.iter().map(|a| a.name()).collect();
            Error::BadOption {
                option: "synthetic arch",
                value: format!("{s:?}"),
                expected: format!("expected one of {}", names.join(", ")),
            }
        })
    }
}

/// Shape of a synthetic model.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticSpec {
    /// Architecture (config spelling, tensor names, attention and expert kind).
    pub arch: SyntheticArch,
    /// Decoder layers (all MoE).
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Experts per layer.
    pub experts: usize,
    /// Experts per token.
    pub topk: usize,
    /// Expert width I.
    pub moe_inter: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Seed of every weight.
    pub seed: u64,
}

/// Version of the writer's bytes, recorded in config.json (`picchio_synthetic.writer`): a model
/// written by another version is rewritten rather than reused.
const WRITER_VERSION: u64 = 3;

impl SyntheticSpec {
    /// The real geometry of `arch` with `layers` decoder layers.
    pub fn real(arch: SyntheticArch, layers: usize, seed: u64) -> Self {
        match arch {
            SyntheticArch::Qwen3_30bA3b => SyntheticSpec {
                arch,
                layers,
                hidden: 2048,
                heads: 32,
                kv_heads: 4,
                head_dim: 128,
                experts: 128,
                topk: 8,
                moe_inter: 768,
                vocab: 151_936,
                seed,
            },
            SyntheticArch::GptOss20b => SyntheticSpec {
                arch,
                layers,
                hidden: 2880,
                heads: 64,
                kv_heads: 8,
                head_dim: 64,
                experts: 32,
                topk: 4,
                moe_inter: 2880,
                vocab: 201_088,
                seed,
            },
        }
    }

    /// `arch`'s real layers, as many as make the Q4 experts at least `gb` × 10⁹ bytes (at least one
    /// layer).
    pub fn with_expert_gb(arch: SyntheticArch, gb: f64, seed: u64) -> Self {
        let mut s = Self::real(arch, 1, seed);
        let per_layer = (s.experts * s.expert_layout().len()) as f64;
        s.layers = ((gb * 1e9) / per_layer).ceil().max(1.0) as usize;
        s
    }

    /// The Q4 payload layout of one expert (with the arch's tensor names).
    pub fn expert_layout(&self) -> ExpertLayout {
        ExpertLayout::new(QuantKind::Q4, self.hidden, self.moe_inter)
            .expect("multiples of 64")
            .with_naming(ExpertNaming::for_arch(self.arch.arch()))
    }

    /// Total expert payload bytes.
    pub fn expert_bytes(&self) -> u64 {
        (self.layers * self.experts * self.expert_layout().len()) as u64
    }

    /// Bytes of the resident tensors (embeddings, lm_head, attention, norms, router, biases).
    pub fn dense_bytes(&self) -> u64 {
        let (h, q, kv, e) = (self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.experts);
        let embed = 2 * (self.vocab * h + 4 * self.vocab) + 4 * h;
        let attn = (q * h + 2 * kv * h + h * q) * 4;
        let per_layer = match self.arch {
            SyntheticArch::Qwen3_30bA3b => attn + 4 * (2 * h + 2 * self.head_dim + e * h),
            SyntheticArch::GptOss20b => {
                attn + 4 * (2 * h + q + 2 * kv + h + self.heads + e * h + e + e * 2 * self.moe_inter + e * h)
            }
        };
        (embed + self.layers * per_layer) as u64
    }

    /// Bytes the finished directory holds before the tokenizer: resident tensors, expert shards and
    /// the image (experts padded to 4096-byte slots), plus headers and the index.
    pub fn disk_bytes(&self) -> u64 {
        let slots = (self.layers * self.experts) as u64 * (self.expert_layout().len() as u64).next_multiple_of(4096);
        self.dense_bytes() + self.expert_bytes() + slots + (1 << 20) * (self.layers as u64 + 2)
    }

    /// The directory name under a work directory: `synthetic-<arch>-<L>l-seed<S>`.
    pub fn dir_name(&self) -> String {
        format!("synthetic-{}-{}l-seed{}", self.arch, self.layers, self.seed)
    }

    /// What config.json records under `picchio_synthetic`: arch, layers, experts, vocabulary, seed
    /// and writer version.
    /// [`is_written`] compares it to decide whether a directory can be reused.
    pub fn stamp(&self) -> serde_json::Value {
        serde_json::json!({
            "arch": self.arch.name(),
            "layers": self.layers,
            "experts": self.experts,
            "vocab": self.vocab,
            "seed": self.seed,
            "writer": WRITER_VERSION,
            "note": "random weights, see docs/synthetic-models.md",
        })
    }

    fn config_json(&self) -> serde_json::Value {
        let mut c = match self.arch {
            SyntheticArch::Qwen3_30bA3b => serde_json::json!({
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "vocab_size": self.vocab,
                "hidden_size": self.hidden,
                "intermediate_size": 8 * self.moe_inter,
                "moe_intermediate_size": self.moe_inter,
                "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim,
                "num_experts": self.experts,
                "num_experts_per_tok": self.topk,
                "norm_topk_prob": true,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0,
                "rope_scaling": null,
                "tie_word_embeddings": false,
                "max_position_embeddings": 40960,
                "torch_dtype": "bfloat16",
                "bos_token_id": null,
                "eos_token_id": null,
            }),
            SyntheticArch::GptOss20b => serde_json::json!({
                "architectures": ["GptOssForCausalLM"],
                "model_type": "gpt_oss",
                "attention_bias": true,
                "attention_dropout": 0.0,
                "vocab_size": self.vocab,
                "hidden_size": self.hidden,
                "intermediate_size": self.moe_inter,
                "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim,
                "num_local_experts": self.experts,
                "experts_per_token": self.topk,
                "num_experts_per_tok": self.topk,
                "layer_types": (0..self.layers)
                    .map(|l| if l % 2 == 0 { "sliding_attention" } else { "full_attention" })
                    .collect::<Vec<_>>(),
                "sliding_window": 128,
                "initial_context_length": 4096,
                "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5,
                "rope_theta": 150000.0,
                "rope_scaling": {
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "factor": 32.0,
                    "original_max_position_embeddings": 4096,
                    "rope_type": "yarn",
                    "truncate": false
                },
                "swiglu_limit": 7.0,
                "hidden_act": "silu",
                "tie_word_embeddings": false,
                "torch_dtype": "bfloat16",
                "eos_token_id": null,
                "pad_token_id": null,
            }),
        };
        c["picchio_synthetic"] = self.stamp();
        c
    }
}

/// Whether `dir` holds a complete synthetic model of `spec` (its config.json's `picchio_synthetic`
/// equals [`SyntheticSpec::stamp`] and the image exists): such a directory is reused as it is.
pub fn is_written(dir: &Path, spec: &SyntheticSpec) -> bool {
    dir.join(DEFAULT_IMAGE).is_file() && synthetic_stamp(dir).is_some_and(|s| s == spec.stamp())
}

/// The `picchio_synthetic` object of `dir/config.json`, when it is a synthetic model's.
fn synthetic_stamp(dir: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v.get("picchio_synthetic").cloned()
}

/// Options of [`write_synthetic`].
#[derive(Clone, Debug, Default)]
pub struct WriteSyntheticOptions {
    /// Directory whose `tokenizer.json` (and `tokenizer_config.json`, when present) are copied into
    /// the model; its vocabulary must fit in the model's. `None`: no tokenizer (prompts are ids).
    pub tokenizer: Option<PathBuf>,
    /// Show progress bars on stderr (hidden anyway when stderr is not a terminal).
    pub progress: bool,
}

/// [`SplitMix64`] (picchio_core::rng): each tensor (or row, or expert) gets its own stream, state
/// `seed ^ a·GOLDEN_GAMMA ^ b·0xC2B2AE3D27D4EB4F` advanced once, so the output does not depend on
/// thread count.
struct Rng(SplitMix64);
impl Rng {
    fn new(seed: u64, a: u64, b: u64) -> Self {
        let mut r = SplitMix64::new(seed ^ a.wrapping_mul(GOLDEN_GAMMA) ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F));
        r.next_u64();
        Rng(r)
    }
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Approximately normal (sum of 4 uniforms, variance-corrected), mean 0, std 1.
    fn normal(&mut self) -> f32 {
        let r = self.next();
        let s: f32 = (0..4).map(|i| ((r >> (16 * i)) & 0xffff) as f32 / 65535.0).sum();
        (s - 2.0) * (3.0f32).sqrt()
    }
}

/// Stream tags (`a` of [`Rng::new`]): experts use `3 + layer`, so these sit at the top of the range.
const TAG_EMBED: u64 = u64::MAX;
const TAG_LM_HEAD: u64 = u64::MAX - 1;
const TAG_DENSE: u64 = 2;

/// Standard deviation of a code uniform on the 15 integers -7..=7: sqrt(2·Σk²/15) = sqrt(56/3).
const CODE_STD: f32 = 4.320_494;

/// Standard deviation of a code uniform on the 255 integers -127..=127: sqrt(127·128/3).
const I8_CODE_STD: f32 = 73.611_59;

/// Fills a Q4 matrix [rows, cols] with symmetric zero-mean codes and scales giving std `std`.
fn random_q4(rng: &mut Rng, rows: usize, cols: usize, std: f32, packed: &mut [u8], scales: &mut [u8]) {
    for b in packed.iter_mut() {
        let r = rng.next();
        // Two nibbles, each uniform on 1..=15 (value nibble - 8 in -7..=7).
        let lo = 1 + (((r & 0xffff) * 15) >> 16) as u8;
        let hi = 1 + ((((r >> 16) & 0xffff) * 15) >> 16) as u8;
        *b = lo | (hi << 4);
    }
    let s = (std / CODE_STD).to_le_bytes();
    for c in scales.chunks_exact_mut(4).take(rows * cols / 64) {
        c.copy_from_slice(&s);
    }
}

/// An I8 matrix [rows, cols] with an F32 row scale (Picchio (C)'s embeddings and lm_head): codes
/// uniform on -127..=127 (zero mean), scale `std / I8_CODE_STD`, each row from its own stream
/// (`tag`, row), generated in parallel. Returns (codes, scales) as little-endian bytes.
fn random_i8_rows(seed: u64, tag: u64, rows: usize, cols: usize, std: f32) -> (Vec<u8>, Vec<u8>) {
    let mut codes = vec![0u8; rows * cols];
    codes.par_chunks_mut(cols).enumerate().for_each(|(r, row)| {
        let mut rng = Rng::new(seed, tag, r as u64);
        for quad in row.chunks_mut(4) {
            let x = rng.next();
            for (i, c) in quad.iter_mut().enumerate() {
                // 16 random bits → 0..=254 → -127..=127.
                let v = ((((x >> (16 * i)) & 0xffff) * 255) >> 16) as i32 - 127;
                *c = v as i8 as u8;
            }
        }
    });
    let scale = (std / I8_CODE_STD).to_le_bytes();
    (codes, scale.repeat(rows))
}

fn f32_normal(rng: &mut Rng, n: usize, std: f32) -> Vec<u8> {
    (0..n).flat_map(|_| (rng.normal() * std).to_le_bytes()).collect()
}

fn ones_f32(n: usize) -> Vec<u8> {
    1.0f32.to_le_bytes().repeat(n)
}

/// One tensor to write: name, dtype, shape, little-endian bytes.
type OwnedTensor = (String, Dtype, Vec<usize>, Vec<u8>);

/// Writes one safetensors shard: the header `picchio convert` writes
/// ([`crate::image::convert::shard::header`]), then the tensors' bytes in the order given (every
/// tensor is a multiple of 4 bytes, so each starts aligned to its element size), through
/// [`picchio_core::output::OutputFile`]: created with the umask's mode, every byte counted for the
/// stop point as it reaches the kernel, synced at the end.
fn write_shard(path: &Path, tensors: &[OwnedTensor]) -> Result<()> {
    let out = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            let want = shape.iter().product::<usize>() * dtype.bitsize() / 8;
            if want != bytes.len() || bytes.len() % 4 != 0 {
                return Err(Error::TensorBytes {
                    path: path.into(),
                    name: name.clone(),
                    dtype: dtype.to_string(),
                    shape: shape.clone(),
                    want,
                    found: bytes.len(),
                });
            }
            Ok(OutTensor { name: name.clone(), dtype: *dtype, shape: shape.clone(), len: bytes.len() })
        })
        .collect::<Result<Vec<_>>>()?;
    let header = header(&out, path)?;
    // The OS error itself is kept (a full disk is told apart by its kind).
    let werr = |cause: std::io::Error| Error::io(path, "write synthetic shard")(cause);
    let mut w = picchio_core::output::OutputFile::create(path, 8 << 20).map_err(werr)?;
    w.write_all(&header).map_err(werr)?;
    for t in tensors {
        w.write_all(&t.3).map_err(werr)?;
    }
    w.finish().map_err(werr)
}

/// Writes the complete converted model directory of `spec` into `dir`: config.json (with
/// `picchio_synthetic`, see [`SyntheticSpec::stamp`]), the tokenizer of `opts.tokenizer`, one shard
/// of embeddings and lm_head, one shard per layer (its resident tensors and Q4 experts),
/// model.safetensors.index.json, and the packed `experts.picchioflat`.
///
/// Nothing is written before the file system is checked to have room for [`SyntheticSpec::disk_bytes`]
/// plus the tokenizer. The directory is built as `.<name>.picchio-synthetic-<pid>/` beside `dir` and
/// renamed into place when complete, as `picchio convert` builds its output; an existing `dir` is
/// replaced only when it is an earlier synthetic model (its config.json has `picchio_synthetic`) or
/// empty. What a killed writer left beside `dir` is removed first, and named on stderr
/// ([`crate::image::guard::sweep_leftovers`]). Every file is created with the umask's mode and
/// every byte is counted for the stop point ([`picchio_core::output`]). SIGINT/SIGTERM (once
/// [`crate::interrupt::install`]ed) stop between shards, removing the partial output.
///
/// # Errors
/// [`Error::NotSynthetic`] when `dir` exists and is neither empty nor a synthetic model;
/// [`Error::NotEnoughSpace`] without room;
/// [`Error::VocabBelowTokenizer`] when the tokenizer has more ids than `spec.vocab` (before anything
/// is written); [`Error::Io`] on write failures;
/// [`Error::Interrupted`]; the pack errors.
pub fn write_synthetic(dir: &Path, spec: &SyntheticSpec, opts: &WriteSyntheticOptions) -> Result<()> {
    if std::fs::symlink_metadata(dir).is_ok() {
        let empty = std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_none());
        if !empty && synthetic_stamp(dir).is_none() {
            return Err(Error::NotSynthetic { dir: dir.into() });
        }
    }
    let tokenizer_files = match &opts.tokenizer {
        Some(t) => tokenizer_files(t, spec)?,
        None => Vec::new(),
    };
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(Error::io(parent, "create directory"))?;
    }
    let tok_bytes: u64 = tokenizer_files.iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).sum();
    let needed = spec.disk_bytes() + tok_bytes;
    // Another writer of `dir` is refused, and what a killed one left beside it goes first, before
    // the free-space check (a killed writer's leftover is no reason to refuse).
    let _claim = crate::image::guard::WriteLock::file(dir, true)?;
    crate::image::guard::sweep_leftovers(dir, "synth")?;
    crate::image::write::check_free_space(dir, needed)?;
    // The write phase: a failure drops `tmp` (the partial output goes) before the error is told.
    let write_phase = || -> Result<()> {
        let tmp = TempDir::create(dir, "synthetic")?;
        for src in &tokenizer_files {
            // Read and written (not `fs::copy`, which would give the copy the source's mode).
            let bytes = std::fs::read(src).map_err(Error::io(src, "read the tokenizer"))?;
            write_file(&tmp.path.join(src.file_name().expect("a file")), &bytes)?;
        }
        write_shards(&tmp.path, spec, opts.progress)?;
        // The image records `dir`, where the temporary directory is renamed to.
        let record = crate::image::record::RecordModel::At(dir.to_path_buf());
        pack(&tmp.path, &tmp.path.join(DEFAULT_IMAGE), &PackOptions { layers: None, progress: opts.progress, record })?;
        tmp.persist(dir)
    };
    write_phase().map_err(crate::image::write::out_of_space(dir, needed))
}

/// The tokenizer files of `dir` to copy, after checking its vocabulary fits in `spec`'s.
fn tokenizer_files(dir: &Path, spec: &SyntheticSpec) -> Result<Vec<PathBuf>> {
    let t = crate::model::tokenizer::Tokenizer::from_dir(dir)?.ok_or_else(|| Error::NoTokenizer { dir: dir.into() })?;
    if t.vocab_size() > spec.vocab {
        return Err(Error::VocabBelowTokenizer {
            path: dir.join("tokenizer.json"),
            ids: t.vocab_size(),
            vocab: spec.vocab,
        });
    }
    Ok(["tokenizer.json", "tokenizer_config.json"].iter().map(|f| dir.join(f)).filter(|p| p.is_file()).collect())
}

/// The resident tensors of layer `l` (each tensor from its own stream `(TAG_DENSE, l·64 + k)`).
fn layer_dense(s: &SyntheticSpec, l: usize) -> Vec<OwnedTensor> {
    let (h, q, kv, e) = (s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.experts);
    let resid = 1.0 / (2.0 * s.layers as f32).sqrt();
    let (std_h, std_q) = (1.0 / (h as f32).sqrt(), 1.0 / (q as f32).sqrt());
    let p = format!("model.layers.{l}");
    // (name, shape, init): init None = ones (a norm), Some(std) = normal.
    let mut specs: Vec<(String, Vec<usize>, Option<f32>)> = vec![
        (format!("{p}.input_layernorm.weight"), vec![h], None),
        (format!("{p}.post_attention_layernorm.weight"), vec![h], None),
        (format!("{p}.self_attn.q_proj.weight"), vec![q, h], Some(std_h)),
        (format!("{p}.self_attn.k_proj.weight"), vec![kv, h], Some(std_h)),
        (format!("{p}.self_attn.v_proj.weight"), vec![kv, h], Some(std_h)),
        (format!("{p}.self_attn.o_proj.weight"), vec![h, q], Some(std_q * resid)),
    ];
    match s.arch {
        SyntheticArch::Qwen3_30bA3b => specs.extend([
            (format!("{p}.self_attn.q_norm.weight"), vec![s.head_dim], None),
            (format!("{p}.self_attn.k_norm.weight"), vec![s.head_dim], None),
            (format!("{p}.mlp.gate.weight"), vec![e, h], Some(std_h)),
        ]),
        SyntheticArch::GptOss20b => specs.extend([
            (format!("{p}.self_attn.q_proj.bias"), vec![q], Some(0.1)),
            (format!("{p}.self_attn.k_proj.bias"), vec![kv], Some(0.1)),
            (format!("{p}.self_attn.v_proj.bias"), vec![kv], Some(0.1)),
            (format!("{p}.self_attn.o_proj.bias"), vec![h], Some(0.1 * resid)),
            (format!("{p}.self_attn.sinks"), vec![s.heads], Some(0.5)),
            (format!("{p}.mlp.router.weight"), vec![e, h], Some(std_h)),
            (format!("{p}.mlp.router.bias"), vec![e], Some(0.1)),
            (format!("{p}.mlp.experts.gate_up_proj_bias"), vec![e, 2 * s.moe_inter], Some(0.1)),
            (format!("{p}.mlp.experts.down_proj_bias"), vec![e, h], Some(0.1 * resid)),
        ]),
    }
    specs
        .into_par_iter()
        .enumerate()
        .map(|(k, (name, shape, init))| {
            let n = shape.iter().product();
            let bytes = match init {
                None => ones_f32(n),
                Some(std) => f32_normal(&mut Rng::new(s.seed, TAG_DENSE, (l * 64 + k) as u64), n, std),
            };
            (name, Dtype::F32, shape, bytes)
        })
        .collect()
}

/// The Q4 experts of layer `l`, generated in parallel, each from its own stream `(3 + l, e)`.
fn layer_experts(s: &SyntheticSpec, l: usize) -> Vec<OwnedTensor> {
    let layout = s.expert_layout();
    let resid = 1.0 / (2.0 * s.layers as f32).sqrt();
    let h = s.hidden;
    let experts: Vec<Vec<OwnedTensor>> = (0..s.experts)
        .into_par_iter()
        .map(|e| {
            let mut rng = Rng::new(s.seed, 3 + l as u64, e as u64);
            let mut gu = vec![0u8; layout.gate_up.len()];
            let mut gus = vec![0u8; layout.gate_up_scales.len()];
            let mut d = vec![0u8; layout.down.len()];
            let mut ds = vec![0u8; layout.down_scales.len()];
            random_q4(&mut rng, 2 * s.moe_inter, h, 1.0 / (h as f32).sqrt(), &mut gu, &mut gus);
            let down_std = resid / (s.moe_inter as f32).sqrt();
            random_q4(&mut rng, h, s.moe_inter, down_std, &mut d, &mut ds);
            let n = layout.names(l, e);
            vec![
                (n.gate_up, Dtype::U8, vec![gu.len()], gu),
                (n.gate_up_qs, Dtype::F32, vec![gus.len() / 4], gus),
                (n.down, Dtype::U8, vec![d.len()], d),
                (n.down_qs, Dtype::F32, vec![ds.len() / 4], ds),
            ]
        })
        .collect();
    experts.into_iter().flatten().collect()
}

/// config.json, the shards and the index into `dir`.
fn write_shards(dir: &Path, s: &SyntheticSpec, progress: bool) -> Result<()> {
    let cfg = serde_json::to_string_pretty(&s.config_json()).expect("json");
    write_file(&dir.join("config.json"), cfg.as_bytes())?;
    let h = s.hidden;
    let total_shards = s.layers + 1;
    let bar = crate::progress::bar(total_shards as u64, "writing shards", !progress);
    let mut weight_map = BTreeMap::new();
    let mut total_size = 0u64;
    let mut put = |name: String, tensors: Vec<OwnedTensor>| -> Result<()> {
        write_shard(&dir.join(&name), &tensors)?;
        for t in &tensors {
            total_size += t.3.len() as u64;
            weight_map.insert(t.0.clone(), name.clone());
        }
        Ok(())
    };

    // Shard 1: embeddings (std 1) and lm_head (std 1/√H) as I8 rows, the final norm.
    let (eq, es) = random_i8_rows(s.seed, TAG_EMBED, s.vocab, h, 1.0);
    let (lq, ls) = random_i8_rows(s.seed, TAG_LM_HEAD, s.vocab, h, 1.0 / (h as f32).sqrt());
    let first = vec![
        ("model.embed_tokens.weight".into(), Dtype::I8, vec![s.vocab, h], eq),
        ("model.embed_tokens.weight.qs".into(), Dtype::F32, vec![s.vocab], es),
        ("lm_head.weight".into(), Dtype::I8, vec![s.vocab, h], lq),
        ("lm_head.weight.qs".into(), Dtype::F32, vec![s.vocab], ls),
        ("model.norm.weight".into(), Dtype::F32, vec![h], ones_f32(h)),
    ];
    put(format!("model-00001-of-{total_shards:05}.safetensors"), first)?;
    bar.set_position(1);

    // One shard per layer: its resident tensors and its experts.
    for l in 0..s.layers {
        crate::interrupt::check(l + 1, total_shards, "shards")?;
        let mut tensors = layer_dense(s, l);
        tensors.extend(layer_experts(s, l));
        put(format!("model-{:05}-of-{total_shards:05}.safetensors", l + 2), tensors)?;
        bar.set_position(l as u64 + 2);
    }
    bar.finish_and_clear();
    let index = serde_json::json!({"metadata": {"total_size": total_size}, "weight_map": weight_map});
    let p = dir.join("model.safetensors.index.json");
    let index = serde_json::to_string_pretty(&index).expect("json");
    write_file(&p, index.as_bytes())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Config;
    use crate::model::safetensors::TensorStore;

    #[test]
    fn sizes_follow_the_request_and_codes_are_symmetric() {
        let s = SyntheticSpec::with_expert_gb(SyntheticArch::Qwen3_30bA3b, 2.0, 0);
        assert_eq!(s.layers, 6);
        assert!(s.expert_bytes() >= 2_000_000_000);
        let g = SyntheticSpec::with_expert_gb(SyntheticArch::GptOss20b, 2.0, 0);
        assert_eq!(g.expert_layout().len(), 13_996_800);
        assert_eq!(g.layers, 5, "4 layers of 32 × 13,996,800 B are 1.79 GB");
        assert_eq!(g.expert_layout().naming, ExpertNaming::Suffixed);
        let mut rng = Rng::new(1, 2, 3);
        let mut packed = vec![0u8; 64 * 32];
        let mut scales = vec![0u8; 64 * 4];
        random_q4(&mut rng, 64, 64, 0.125, &mut packed, &mut scales);
        let vals: Vec<i32> = packed.iter().flat_map(|b| [(b & 15) as i32 - 8, (b >> 4) as i32 - 8]).collect();
        assert!(vals.iter().all(|v| (-7..=7).contains(v)));
        let mean = vals.iter().sum::<i32>() as f64 / vals.len() as f64;
        assert!(mean.abs() < 0.2, "mean {mean}");
        let (codes, _) = random_i8_rows(1, 9, 64, 256, 1.0);
        let vals: Vec<f64> = codes.iter().map(|&c| f64::from(c as i8)).collect();
        assert!(vals.iter().all(|&v| v >= -127.0));
        let mean = vals.iter().sum::<f64>() / vals.len() as f64;
        let std = (vals.iter().map(|v| v * v).sum::<f64>() / vals.len() as f64).sqrt();
        assert!(mean.abs() < 1.5 && (std - f64::from(I8_CODE_STD)).abs() < 2.0, "mean {mean} std {std}");
        assert_eq!("gpt-oss-20b".parse::<SyntheticArch>().unwrap(), SyntheticArch::GptOss20b);
        assert!("gpt-oss-120b"
            .parse::<SyntheticArch>()
            .unwrap_err()
            .to_string()
            .contains("qwen3-30b-a3b, gpt-oss-20b"));
    }

    fn small(arch: SyntheticArch) -> SyntheticSpec {
        SyntheticSpec {
            arch,
            layers: 2,
            hidden: 128,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            experts: 8,
            topk: 2,
            moe_inter: 64,
            vocab: 256,
            seed: 5,
        }
    }

    #[test]
    fn writes_loadable_small_models_of_both_archs() {
        for arch in SyntheticArch::ALL {
            let dir = tempfile::tempdir().unwrap();
            let out = dir.path().join("m");
            let spec = small(arch);
            write_synthetic(&out, &spec, &WriteSyntheticOptions::default()).unwrap();
            assert!(is_written(&out, &spec));
            let cfg = Config::from_dir(&out).unwrap();
            assert_eq!(cfg.arch(), arch.arch());
            let store = TensorStore::open(&out).unwrap();
            assert_eq!(ExpertLayout::detect(&store, &cfg).unwrap(), spec.expert_layout());
            let on_disk: u64 = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
            assert!(on_disk <= spec.disk_bytes(), "{on_disk} > estimate {}", spec.disk_bytes());
            crate::model::Model::load(&crate::ModelDir::open(&out).unwrap(), 8).unwrap();
            // Another seed replaces the synthetic model; a directory that is not one is refused.
            let other = SyntheticSpec { seed: 6, ..spec.clone() };
            assert!(!is_written(&out, &other));
            write_synthetic(&out, &other, &WriteSyntheticOptions::default()).unwrap();
            assert!(is_written(&out, &other));
            let foreign = dir.path().join("foreign");
            std::fs::create_dir(&foreign).unwrap();
            std::fs::write(foreign.join("notes.txt"), "mine").unwrap();
            let e = write_synthetic(&foreign, &spec, &WriteSyntheticOptions::default()).unwrap_err();
            assert!(e.to_string().contains("is not a synthetic model") && e.to_string().contains("refusing"), "{e}");
            assert_eq!(std::fs::read_to_string(foreign.join("notes.txt")).unwrap(), "mine");
            let leftovers: Vec<_> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with('.'))
                .collect();
            assert!(leftovers.is_empty(), "{leftovers:?}");
        }
    }

    /// The tokenizer is read and written, not `fs::copy`ed: the copy gets the umask's mode like every
    /// other file of the model (the CLI test `cli_file_modes` checks the rest through the binary), not
    /// the source's (here 0400).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_fitting_tokenizer_is_copied_and_every_file_gets_the_umask_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let tok = dir.path().join("tok");
        std::fs::create_dir(&tok).unwrap();
        let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
            "pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
            "model":{"type":"WordLevel","vocab":{"<unk>":0,"a":1,"b":2},"unk_token":"<unk>"}}"#;
        std::fs::write(tok.join("tokenizer.json"), json).unwrap();
        std::fs::set_permissions(tok.join("tokenizer.json"), std::fs::Permissions::from_mode(0o400)).unwrap();
        let out = dir.path().join("m");
        let opts = WriteSyntheticOptions { tokenizer: Some(tok), progress: false };
        write_synthetic(&out, &small(SyntheticArch::Qwen3_30bA3b), &opts).unwrap();
        assert_eq!(std::fs::read_to_string(out.join("tokenizer.json")).unwrap(), json);
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let umask = status.lines().find_map(|l| l.strip_prefix("Umask:")).expect("Linux 4.7+ reports Umask");
        let umask = u32::from_str_radix(umask.trim(), 8).unwrap();
        let mut files = 0;
        for e in std::fs::read_dir(&out).unwrap() {
            let e = e.unwrap();
            let mode = e.metadata().unwrap().permissions().mode() & 0o7777;
            assert_eq!(mode, 0o666 & !umask, "{}: {mode:04o} under umask {umask:03o}", e.path().display());
            files += 1;
        }
        // config.json, tokenizer.json, 3 shards, the index, the image.
        assert_eq!(files, 7);
    }

    #[test]
    fn a_tokenizer_larger_than_the_vocabulary_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let opts = WriteSyntheticOptions { tokenizer: SyntheticArch::GptOss20b.vendored_tokenizer(), progress: false };
        assert!(opts.tokenizer.is_some(), "the checkout vendors tests/fixtures/tokenizers/gpt_oss");
        let e = write_synthetic(&dir.path().join("m"), &small(SyntheticArch::GptOss20b), &opts).unwrap_err();
        assert!(
            e.to_string().contains("the tokenizer has 200019 ids but the synthetic model's vocabulary is 256"),
            "{e}"
        );
        assert!(!dir.path().join("m").exists());
    }
}
