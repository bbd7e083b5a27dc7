//! `picchio convert`: a Hugging Face Qwen3-MoE or GPT-OSS checkpoint → a Picchio converted directory.
//!
//! The source is config.json plus one `model.safetensors` or shards with
//! `model.safetensors.index.json` (followed exactly), tensors in BF16, F16 or F32, routed experts
//! either one tensor per expert or fused 3-D tensors (transformers 5), or for GPT-OSS openai's
//! MXFP4 blocks and scales ([`mxfp4`]) or transformers' `x @ W` fused tensors (see [`ExpertSource`]).
//!
//! The converted directory (DESIGN.md, "Converted model directory and expert quantization"):
//! - every tensor except the routed experts copied unchanged (dtype, shape, bytes): embeddings,
//!   lm_head, norms, attention, the router `mlp.gate.weight`, dense-MLP layers' `mlp.{gate,up,down}_proj`;
//! - per routed expert `model.layers.L.mlp.experts.E.gate_up_proj` (gate and up rows interleaved) and
//!   `…down_proj`, flat 1-D U8 with flat F32 `.qs` scales for Q4/Q3 (as Picchio (C) writes them), or
//!   flat F32 without `.qs` for `none`; their bytes are exactly [`ExpertLayout::payload_from_store`]'s
//!   payload;
//! - shards `model-0000i-of-0000N.safetensors` of bounded size and `model.safetensors.index.json`
//!   (`weight_map`, `metadata.total_size`);
//! - config.json and the tokenizer files, copied byte for byte.
//!
//! Everything is checked before anything is written, the output is built in a temporary directory
//! beside the destination and renamed into place at the end, and the source directory is only read.
//! Experts are quantized in parallel (rayon) and written in a fixed order, so the bytes do not depend
//! on the thread count.

mod gpt_oss;
pub mod mxfp4;
mod plan;
mod quantize;
pub(crate) mod shard;

use std::io::Write;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use rayon::prelude::*;

pub use plan::ExpertSource;
pub use quantize::expert_payload;

use crate::error::{Error, Overlap, Result};
use crate::expert::layout::{ExpertLayout, ExpertNaming};
use crate::model::config::Config;
use crate::model::safetensors::TensorStore;
use crate::progress;
use crate::quant::{QuantKind, GROUP_SIZE};
use plan::Unit;
use shard::Shard;

/// Default bound on the tensor bytes of one output shard (2 GiB).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 2 << 30;

/// Files copied byte for byte from the source directory when present (config.json always is).
pub const COPIED_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
];

/// Options of [`convert`].
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    /// How routed experts are stored (`--experts q4|q3|none`; default Q4).
    pub experts: QuantKind,
    /// Bound on the tensor bytes of one shard (default [`DEFAULT_MAX_SHARD_BYTES`]); a single
    /// tensor larger than this gets a shard of its own.
    pub max_shard_bytes: u64,
    /// Threads quantizing experts (default: rayon's global pool). The output does not depend on it.
    pub threads: Option<usize>,
    /// Replace an existing destination directory (`--force`); it is removed only after the new one
    /// is complete.
    pub overwrite: bool,
    /// Show a progress bar on stderr (default; it is hidden anyway when stderr is not a terminal).
    pub progress: bool,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            experts: QuantKind::Q4,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            threads: None,
            overwrite: false,
            progress: true,
        }
    }
}

/// What [`convert`] wrote.
#[derive(Clone, Debug)]
pub struct ConvertReport {
    /// The checkpoint directory.
    pub src: PathBuf,
    /// The converted directory.
    pub dst: PathBuf,
    /// Expert storage.
    pub experts: QuantKind,
    /// Bytes of one expert's payload.
    pub payload_len: usize,
    /// Each MoE layer and the checkpoint layout its experts were read from.
    pub expert_sources: Vec<(usize, ExpertSource)>,
    /// Experts quantized (MoE layers × num_experts).
    pub experts_converted: usize,
    /// Tensors copied unchanged (including `passthrough`).
    pub dense_tensors: usize,
    /// Checkpoint tensors the model does not use, copied unchanged.
    pub passthrough: Vec<String>,
    /// The shard files, in order.
    pub shards: Vec<PathBuf>,
    /// Tensor bytes over all shards (`metadata.total_size` of the index).
    pub total_size: u64,
    /// Files copied from the source (config.json first).
    pub copied: Vec<String>,
    /// Threads that quantized experts.
    pub threads: usize,
    /// Wall time.
    pub elapsed: Duration,
}

impl std::fmt::Display for ConvertReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let layouts = match self.expert_sources.iter().map(|s| s.1).collect::<Vec<_>>().as_slice() {
            [] => "no MoE layer",
            s if s.iter().all(|&x| x == ExpertSource::PerExpert) => "per-expert tensors",
            s if s.iter().all(|&x| x == ExpertSource::Fused) => "fused tensors",
            s if s.iter().all(|&x| x == ExpertSource::Mxfp4) => "MXFP4 blocks",
            s if s.iter().all(|&x| x == ExpertSource::FusedTransposed) => "fused x@W tensors",
            _ => "per-expert and fused tensors",
        };
        writeln!(f, "converted {} -> {}", self.src.display(), self.dst.display())?;
        writeln!(
            f,
            "  experts: {} in {} MoE layers from {layouts}, {} ({} bytes each)",
            self.experts_converted,
            self.expert_sources.len(),
            self.experts,
            self.payload_len
        )?;
        writeln!(f, "  dense tensors copied: {}", self.dense_tensors)?;
        if !self.passthrough.is_empty() {
            writeln!(f, "  not used by the model, copied unchanged: {}", self.passthrough.join(", "))?;
        }
        crate::image::fmt_files(f, self.shards.len(), "shard", self.total_size, &self.copied)?;
        write!(f, "  {:.2?} on {} thread(s)", self.elapsed, self.threads)
    }
}

/// Converts the Hugging Face checkpoint in `src` into a Picchio converted directory at `dst`.
///
/// # Errors
/// - [`Error::DestinationOverlapsSource`]: `dst` is `src`, inside it, or contains it;
///   [`Error::AlreadyConverted`]: the source is already converted; [`Error::MixedExpertTensors`],
///   [`Error::UnexpectedExpertTensor`]: inconsistent expert tensors. [`Error::Exists`]: `dst` exists without `overwrite`.
/// - [`Error::Io`] (missing config.json or shard, write failures), [`Error::Config`],
///   [`Error::ConfigValue`] (also: Q4/Q3 with a width that is not a multiple of 64),
///   [`Error::UnsupportedModel`], [`Error::Safetensors`] (truncated file), [`Error::ShardIndex`],
///   [`Error::MissingTensor`], [`Error::TensorShape`], [`Error::TensorDtype`]: each names the file
///   and, where there is one, the tensor.
///
/// On error nothing is left at `dst` (an existing `dst` is untouched) and `src` is never written.
pub fn convert(src: &Path, dst: &Path, opts: &ConvertOptions) -> Result<ConvertReport> {
    let t0 = Instant::now();
    // Another convert onto `dst` is refused, and what a killed one left beside it goes first
    // (a destination it had moved aside comes back) — before `dst` is judged.
    let _claim = match dst.parent() {
        Some(p) if !p.as_os_str().is_empty() && !p.is_dir() => None,
        _ => {
            let claim = crate::image::guard::WriteLock::file(dst, true)?;
            crate::image::guard::sweep_leftovers(dst, "convert")?;
            Some(claim)
        }
    };
    check_paths(src, dst, opts.overwrite)?;
    let cfg_path = src.join("config.json");
    let cfg = Config::from_dir(src)?;
    let (h, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
    let inter_key = match cfg.arch() {
        crate::model::config::Arch::Qwen3Moe => "moe_intermediate_size",
        crate::model::config::Arch::GptOss => "intermediate_size",
    };
    if opts.experts != QuantKind::F32 {
        for (key, v) in [("hidden_size", h), (inter_key, i)] {
            if v % GROUP_SIZE != 0 {
                return Err(Error::ConfigValue {
                    path: cfg_path,
                    key,
                    message: format!(
                        "{v} is not a multiple of {GROUP_SIZE}, which {} expert quantization needs (groups of \
                         {GROUP_SIZE} along the input dimension); convert with --experts none",
                        opts.experts
                    ),
                });
            }
        }
    }
    let store = TensorStore::open(src)?;
    let layout = ExpertLayout::new(opts.experts, h, i)?.with_naming(ExpertNaming::for_arch(cfg.arch()));
    let plan = plan::plan(&cfg, &store)?;
    let shards = shard::assign(&plan.units, &store, &layout, opts.max_shard_bytes.max(1))?;

    crate::image::write::require_parent_dir(dst)?;
    // Room for the shards (data and headers), the index and the copied files, before a byte is written.
    let mut needed: u64 = 0;
    for (k, sh) in shards.iter().enumerate() {
        needed += sh.bytes + shard::header(&sh.tensors, &dst.join(shard::shard_name(k, shards.len())))?.len() as u64;
    }
    needed += shard::index_json(&shards).len() as u64;
    for name in std::iter::once("config.json").chain(COPIED_FILES.iter().copied()) {
        needed += std::fs::metadata(src.join(name)).map(|m| m.len()).unwrap_or(0);
    }
    crate::image::write::check_free_space(dst, needed)?;
    // The write phase: a failure drops `tmp` (the partial output goes) before the error is told.
    let write_phase = || -> Result<(usize, Vec<String>)> {
        let tmp = TempDir::create(dst, "convert")?;
        let n_tensors: usize = shards.iter().map(|s| s.tensors.len()).sum();
        let bar = progress::bar(n_tensors as u64, "convert", !opts.progress);
        let threads = crate::image::on_threads(opts.threads, "conversion", || {
            for (k, s) in shards.iter().enumerate() {
                let path = tmp.path.join(shard::shard_name(k, shards.len()));
                write_shard(&path, s, &store, &layout, &plan.sources, cfg.num_experts, &bar)?;
            }
            Ok(())
        })?;
        bar.finish_and_clear();
        let index = tmp.path.join("model.safetensors.index.json");
        write_file(&index, shard::index_json(&shards).as_bytes())?;
        let mut copied = Vec::new();
        for name in std::iter::once("config.json").chain(COPIED_FILES.iter().copied()) {
            let from = src.join(name);
            if name != "config.json" && !from.is_file() {
                continue;
            }
            let bytes = std::fs::read(&from).map_err(Error::io(&from, "read"))?;
            write_file(&tmp.path.join(name), &bytes)?;
            copied.push(name.to_string());
        }
        tmp.persist(dst)?;
        Ok((threads, copied))
    };
    let (threads, copied) = write_phase().map_err(crate::image::write::out_of_space(dst, needed))?;

    let dense_tensors = plan.units.iter().filter(|u| matches!(u, Unit::Dense(_))).count();
    Ok(ConvertReport {
        src: src.into(),
        dst: dst.into(),
        experts: opts.experts,
        payload_len: layout.len(),
        expert_sources: plan.sources.iter().enumerate().filter_map(|(l, s)| s.map(|s| (l, s))).collect(),
        experts_converted: plan.units.len() - dense_tensors,
        dense_tensors,
        passthrough: plan.passthrough,
        shards: (0..shards.len()).map(|k| dst.join(shard::shard_name(k, shards.len()))).collect(),
        total_size: shards.iter().map(|s| s.bytes).sum(),
        copied,
        threads,
        elapsed: t0.elapsed(),
    })
}

/// Writes one shard: header, experts (quantized in parallel chunks, written in order), dense tensors.
fn write_shard(
    path: &Path,
    s: &Shard,
    store: &TensorStore,
    layout: &ExpertLayout,
    sources: &[Option<ExpertSource>],
    experts_per_layer: usize,
    bar: &indicatif::ProgressBar,
) -> Result<()> {
    let mut w = picchio_core::output::OutputFile::create(path, 8 << 20).map_err(Error::io(path, "create"))?;
    let header = shard::header(&s.tensors, path)?;
    w.write_all(&header).map_err(Error::io(path, "write"))?;
    let per_expert = shard::expert_tensors(layout, 0, 0).len() as u64;
    let chunk = (4 * rayon::current_num_threads()).max(16);
    let mut written = 0u64;
    // SIGINT/SIGTERM: the error unwinds to `convert`, whose `TempDir` removes the partial output.
    let stop = || {
        let (done, wanted) = (bar.position() as usize, bar.length().unwrap_or_default() as usize);
        crate::interrupt::check(done, wanted, "tensors")
    };
    for c in s.experts.chunks(chunk) {
        stop()?;
        let payloads = c
            .par_iter()
            .map(|&(l, e)| {
                let source = sources[l].expect("experts are planned for MoE layers only");
                let [gate, up, down] = quantize::read_expert(store, source, layout, l, e, experts_per_layer)?;
                expert_payload(layout, &gate, &up, &down)
            })
            .collect::<Result<Vec<_>>>()?;
        for p in payloads {
            w.write_all(&p).map_err(Error::io(path, "write"))?;
            written += p.len() as u64;
            bar.inc(per_expert);
        }
    }
    for name in &s.dense {
        stop()?;
        let t = store.get(name)?;
        w.write_all(t.bytes).map_err(Error::io(path, "write"))?;
        written += t.bytes.len() as u64;
        bar.inc(1);
    }
    if written != s.bytes {
        return Err(Error::ShardBytes { path: path.into(), written, planned: s.bytes });
    }
    w.finish().map_err(Error::io(path, "write"))
}

/// Writes the small output file `path` (config.json, an index, a copied tokenizer file) through
/// [`picchio_core::output::write`]: the umask's mode, counted for the stop point, synced.
pub(crate) fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    picchio_core::output::write(path, bytes).map_err(Error::io(path, "write"))
}

/// `p` made absolute with symlinks resolved, also when its last components do not exist yet.
fn resolve(p: &Path) -> Result<PathBuf> {
    let abs = std::path::absolute(p).map_err(Error::io(p, "resolve path"))?;
    let comps: Vec<Component<'_>> = abs.components().collect();
    for k in (1..=comps.len()).rev() {
        let prefix: PathBuf = comps[..k].iter().collect();
        if let Ok(mut out) = prefix.canonicalize() {
            for c in &comps[k..] {
                match c {
                    Component::ParentDir => {
                        out.pop();
                    }
                    Component::Normal(n) => out.push(n),
                    _ => {}
                }
            }
            return Ok(out);
        }
    }
    Ok(abs)
}

/// Refuses a destination that is the source, inside it, or contains it, and an existing one unless
/// `overwrite`.
pub(crate) fn check_paths(src: &Path, dst: &Path, overwrite: bool) -> Result<()> {
    let meta = std::fs::metadata(src).map_err(Error::io(src, "open model directory"))?;
    if !meta.is_dir() {
        return Err(Error::SourceNotDir { path: src.into() });
    }
    let (s, d) = (resolve(src)?, resolve(dst)?);
    let overlap = if d == s {
        Some(Overlap::Same)
    } else if d.starts_with(&s) {
        Some(Overlap::Inside)
    } else if s.starts_with(&d) {
        Some(Overlap::Contains)
    } else {
        None
    };
    if let Some(overlap) = overlap {
        return Err(Error::DestinationOverlapsSource { dst: dst.into(), src: src.into(), overlap });
    }
    if let Ok(m) = std::fs::symlink_metadata(dst) {
        if !m.is_dir() {
            return Err(Error::DestinationNotDir { dst: dst.into() });
        }
        if !overwrite {
            return Err(Error::Exists { path: dst.into(), what: "destination", replace_with: Some("--force") });
        }
    }
    Ok(())
}

/// The output being built: `.<name>.picchio-<tag>-<pid>` beside the destination (tag `convert`,
/// `transcode`, or `synthetic` for [`crate::image::synthetic_model`]), removed on drop unless persisted.
pub(crate) struct TempDir {
    pub(crate) path: PathBuf,
    done: bool,
}

impl TempDir {
    fn sibling(dst: &Path, tag: &str) -> PathBuf {
        let name = dst.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "converted".into());
        dst.with_file_name(format!(".{name}.picchio-{tag}-{}", std::process::id()))
    }

    pub(crate) fn create(dst: &Path, tag: &str) -> Result<Self> {
        let path = Self::sibling(dst, tag);
        if path.exists() {
            std::fs::remove_dir_all(&path).map_err(Error::io(&path, "remove stale temporary directory"))?;
        }
        std::fs::create_dir(&path).map_err(Error::io(&path, "create temporary directory"))?;
        Ok(TempDir { path, done: false })
    }

    /// Renames the finished directory to `dst`, replacing an existing `dst` only once the new one is
    /// complete.
    pub(crate) fn persist(mut self, dst: &Path) -> Result<()> {
        if std::fs::symlink_metadata(dst).is_ok() {
            let old = Self::sibling(dst, "old");
            std::fs::rename(dst, &old).map_err(Error::io(dst, "move the existing destination aside"))?;
            if let Err(cause) = std::fs::rename(&self.path, dst) {
                let _ = std::fs::rename(&old, dst);
                return Err(Error::io(dst, "rename the converted directory into place")(cause));
            }
            self.done = true;
            std::fs::remove_dir_all(&old).map_err(Error::io(&old, "remove the replaced destination"))?;
        } else {
            std::fs::rename(&self.path, dst).map_err(Error::io(dst, "rename the converted directory into place"))?;
            self.done = true;
        }
        #[cfg(unix)]
        if let Some(parent) = dst.parent().filter(|p| !p.as_os_str().is_empty()) {
            // Make the rename durable (best effort: some file systems refuse to sync a directory).
            let _ = std::fs::File::open(parent).and_then(|d| d.sync_all());
        }
        Ok(())
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_handles_missing_tails() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().canonicalize().unwrap();
        assert_eq!(resolve(&dir.path().join("a/b/../c")).unwrap(), base.join("a/c"));
        assert_eq!(resolve(dir.path()).unwrap(), base);
    }

    #[test]
    fn refuses_destinations_in_or_around_the_source() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("m");
        std::fs::create_dir(&src).unwrap();
        let e = check_paths(&src, &src.join("."), false).unwrap_err().to_string();
        assert!(e.contains("is the source directory"), "{e}");
        let e = check_paths(&src, &src.join("out/x"), false).unwrap_err().to_string();
        assert!(e.contains("inside the source directory"), "{e}");
        let e = check_paths(&src, dir.path(), true).unwrap_err().to_string();
        assert!(e.contains("contains the source directory"), "{e}");
        std::fs::create_dir(dir.path().join("o")).unwrap();
        let e = check_paths(&src, &dir.path().join("o"), false).unwrap_err().to_string();
        assert!(e.contains("already exists") && e.contains("pass --force to replace it"), "{e}");
        assert!(check_paths(&src, &dir.path().join("o"), true).is_ok());
        let e = check_paths(&dir.path().join("nope"), &dir.path().join("o2"), false).unwrap_err().to_string();
        assert!(e.contains("nope: open model directory"), "{e}");
    }
}
