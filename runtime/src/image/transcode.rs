//! `picchio transcode`: a converted directory's routed experts re-quantized to another expert
//! quantization without the original checkpoint, as Picchio (C)'s `transcode_i4_to_i3.py` does.
//!
//! Each expert matrix (gate_up `[2I, H]`, down `[H, I]`) is dequantized group by group with
//! [`crate::quant::dequantize`] (`q × scale` in f32) and quantized again with
//! [`crate::quant::quantize`] in the DESIGN.md layout of the target ("Converted model directory and
//! expert quantization"). Requantizing a dequantized Q4 group is not the same as quantizing the
//! checkpoint's float weights to Q3 (the Q4 rounding error is quantized too), so a Q4 → Q3 directory
//! differs from `convert --experts q3` of the checkpoint; from `none` (f32 experts) the result is
//! byte for byte what `convert --experts q4|q3` writes.
//!
//! Allowed: Q4 → Q3, none → Q4, none → Q3. Refused ([`Error::TranscodeRefused`]): the quantization
//! the directory already has (a no-op), Q3 → Q4 (Q3 dropped information Q4 cannot get back), and
//! `none` as a target.
//!
//! What is written: every weight file of the source under its own name, with the same tensors in the
//! same order, the expert matrices replaced by their transcoded bytes (each packed tensor followed by
//! its `.qs` scales, flat 1-D U8 and F32, as `convert` writes them); every other tensor (dense
//! weights, GPT-OSS expert biases, Picchio (C)'s I8 embeddings and their scales) copied byte for
//! byte; `model.safetensors.index.json` rewritten when the source has one (a directory without one,
//! like Picchio (C)'s, gets none); config.json and the tokenizer files ([`COPIED_FILES`]) copied. An
//! expert image (`*.picchioflat`) is not copied: it holds the old payloads, so the new directory is
//! packed again (`picchio pack OUT`).
//!
//! As for `convert`: everything is checked (quantizations, tensor dtypes and sizes, free space)
//! before anything is written; the output is built in a temporary sibling directory and renamed into
//! place; an existing destination is replaced only with `overwrite`, and only once the new one is
//! complete; SIGINT/SIGTERM stop between tensors and remove the temporary directory; the source is
//! only read.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::expert::layout::ExpertLayout;
use crate::image::convert::shard::{header, OutTensor};
use crate::image::convert::{check_paths, write_file, TempDir, COPIED_FILES};
use crate::model::config::Config;
use crate::model::safetensors::TensorStore;
use crate::progress;
use crate::quant::{dequantize, quantize, QuantKind};

/// Options of [`transcode`].
#[derive(Clone, Debug)]
pub struct TranscodeOptions {
    /// The expert quantization to write (`--to q3|q4`).
    pub to: QuantKind,
    /// Replace an existing destination (`--force`); it is removed only after the new one is complete.
    pub overwrite: bool,
    /// Show a progress bar on stderr (hidden anyway when stderr is not a terminal).
    pub progress: bool,
    /// Threads transcoding expert matrices (default: rayon's global pool). The output does not
    /// depend on it.
    pub threads: Option<usize>,
}

impl Default for TranscodeOptions {
    fn default() -> Self {
        TranscodeOptions { to: QuantKind::Q3, overwrite: false, progress: true, threads: None }
    }
}

/// What [`transcode`] wrote.
#[derive(Clone, Debug)]
pub struct TranscodeReport {
    /// The source directory.
    pub src: PathBuf,
    /// The new directory.
    pub dst: PathBuf,
    /// The source's expert quantization.
    pub from: QuantKind,
    /// The new one.
    pub to: QuantKind,
    /// Experts transcoded (MoE layers × experts).
    pub experts: usize,
    /// Bytes of one expert's payload, before and after.
    pub payload_len: (usize, usize),
    /// Tensors copied unchanged.
    pub dense_tensors: usize,
    /// The weight files written, in order.
    pub files: Vec<PathBuf>,
    /// Tensor bytes over all files.
    pub total_size: u64,
    /// Other files copied from the source (config.json first).
    pub copied: Vec<String>,
    /// Expert images of the source that were not copied (they hold the old payloads).
    pub images_not_copied: Vec<String>,
    /// Threads that transcoded.
    pub threads: usize,
    /// Wall time.
    pub elapsed: Duration,
}

impl std::fmt::Display for TranscodeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "transcoded {} -> {}", self.src.display(), self.dst.display())?;
        writeln!(
            f,
            "  experts: {} from {} ({} bytes each) to {} ({} bytes each)",
            self.experts, self.from, self.payload_len.0, self.to, self.payload_len.1
        )?;
        writeln!(f, "  dense tensors copied: {}", self.dense_tensors)?;
        crate::image::fmt_files(f, self.files.len(), "weight file", self.total_size, &self.copied)?;
        if !self.images_not_copied.is_empty() {
            writeln!(
                f,
                "  not copied: {} (old {} payloads); pack the new directory: picchio pack {}",
                self.images_not_copied.join(", "),
                self.from,
                self.dst.display()
            )?;
        }
        write!(f, "  {:.2?} on {} thread(s)", self.elapsed, self.threads)
    }
}

/// The default destination of `picchio transcode SRC --to KIND`: `SRC-KIND` beside the source
/// (`model` → `model-q3`).
pub fn default_destination(src: &Path, to: QuantKind) -> PathBuf {
    let name = src.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    src.with_file_name(format!("{name}-{to}"))
}

/// Which matrix of an expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Matrix {
    /// `[2I, H]`, gate and up rows interleaved.
    GateUp,
    /// `[H, I]`.
    Down,
}

/// One unit of an output file.
#[derive(Clone, Debug)]
enum Item<'a> {
    /// A tensor copied unchanged.
    Dense(&'a str),
    /// An expert matrix, transcoded: its packed tensor and its scales.
    Expert { layer: usize, expert: usize, matrix: Matrix },
}

/// One output weight file.
struct OutFile<'a> {
    name: String,
    items: Vec<Item<'a>>,
    tensors: Vec<OutTensor>,
    bytes: u64,
}

/// Checks that `from` → `to` is a transcode this command does.
fn check_kinds(dir: &Path, from: QuantKind, to: QuantKind) -> Result<()> {
    let why = match (from, to) {
        (_, QuantKind::F32) => {
            "transcode writes q4 or q3 experts (for unquantized experts convert the checkpoint \
                                with --experts none)"
        }
        (f, t) if f == t => "they already are: nothing to do, the directory is usable as it is",
        (QuantKind::Q3, QuantKind::Q4) => {
            "Q3 dropped information that Q4 cannot get back (the result would hold Q3's \
                                           values in Q4's larger layout); convert the checkpoint with --experts q4"
        }
        _ => return Ok(()),
    };
    Err(Error::TranscodeRefused { dir: dir.into(), from, to, why })
}

/// The rows and columns of `m` for hidden size `h` and expert width `i`.
fn shape(m: Matrix, h: usize, i: usize) -> (usize, usize) {
    match m {
        Matrix::GateUp => (2 * i, h),
        Matrix::Down => (h, i),
    }
}

/// The tensor names (packed, scales) of one expert matrix in `layout`'s spelling.
fn names(layout: &ExpertLayout, layer: usize, expert: usize, m: Matrix) -> (String, String) {
    let n = layout.names(layer, expert);
    match m {
        Matrix::GateUp => (n.gate_up, n.gate_up_qs),
        Matrix::Down => (n.down, n.down_qs),
    }
}

/// Reads one expert matrix of `store` (quantization `from`) and returns it quantized as `to`:
/// the packed bytes followed by the little-endian f32 scales.
///
/// # Errors
/// [`Error::MissingTensor`], [`Error::TensorDtype`], [`Error::TensorShape`] naming the source
/// tensor when it does not have the layout's dtype and size.
fn transcode_matrix(
    store: &TensorStore,
    from: &ExpertLayout,
    to: QuantKind,
    (layer, expert, m): (usize, usize, Matrix),
) -> Result<Vec<u8>> {
    let (rows, cols) = shape(m, from.hidden, from.inter);
    let (packed_name, qs_name) = names(from, layer, expert, m);
    let packed_dtype = if from.quant == QuantKind::F32 { Dtype::F32 } else { Dtype::U8 };
    fn get<'s>(store: &'s TensorStore, name: &str, dtype: Dtype, len: usize) -> Result<&'s [u8]> {
        let t = store.get(name)?;
        if t.dtype != dtype {
            return Err(t.dtype_error(&format!("{dtype:?}")));
        }
        if t.bytes.len() != len {
            return Err(Error::TensorShape {
                path: t.path.into(),
                name: t.name.into(),
                expected: vec![len / (dtype.bitsize() / 8)],
                found: t.shape.into(),
            });
        }
        Ok(t.bytes)
    }
    let packed = get(store, &packed_name, packed_dtype, from.quant.packed_bytes(rows, cols)?)?;
    let n_scales = from.quant.scale_count(rows, cols)?;
    let scales: Vec<f32> = if n_scales == 0 {
        Vec::new()
    } else {
        get(store, &qs_name, Dtype::F32, 4 * n_scales)?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let w = dequantize(from.quant, packed, &scales, rows, cols)?;
    let (p, s) = quantize(to, &w, rows, cols)?;
    let mut out = p;
    out.extend(s.iter().flat_map(|v| v.to_le_bytes()));
    Ok(out)
}

/// Re-quantizes the routed experts of the converted directory `src` (Qwen3-MoE, GPT-OSS, or a
/// Picchio (C) directory) to `opts.to` into a new directory `dst` (see the module docs).
///
/// # Errors
/// - [`Error::TranscodeRefused`]: the directory's experts are already `to`, Q3 → Q4, or `to` is none.
/// - [`Error::DestinationOverlapsSource`]: `dst` is `src`, inside it or contains it;
///   [`Error::NotEnoughSpace`]: not enough free space.
///   [`Error::Exists`]: `dst` exists without `overwrite`.
/// - [`Error::Config`], [`Error::MissingTensor`], [`Error::TensorDtype`], [`Error::TensorShape`]
///   (an expert tensor of the wrong dtype or size, naming file and tensor), [`Error::Io`],
///   [`Error::Interrupted`] after SIGINT/SIGTERM.
///
/// On error nothing is left at `dst` (an existing `dst` is untouched) and `src` is never written.
pub fn transcode(src: &Path, dst: &Path, opts: &TranscodeOptions) -> Result<TranscodeReport> {
    let t0 = Instant::now();
    check_paths(src, dst, opts.overwrite)?;
    let cfg = Config::from_dir(src)?;
    let store = TensorStore::open(src)?;
    let from = ExpertLayout::detect(&store, &cfg)?;
    check_kinds(src, from.quant, opts.to)?;
    let to = ExpertLayout::new(opts.to, from.hidden, from.inter)?.with_naming(from.naming);

    // Which source tensor belongs to which expert matrix (packed or scales).
    let mut expert_of: HashMap<String, (usize, usize, Matrix, bool)> = HashMap::new();
    for &l in &cfg.moe_layers() {
        for e in 0..cfg.num_experts {
            for m in [Matrix::GateUp, Matrix::Down] {
                let (packed, qs) = names(&from, l, e, m);
                store.get(&packed)?; // a missing tensor fails here, naming the files searched
                expert_of.insert(packed, (l, e, m, true));
                if from.quant != QuantKind::F32 {
                    store.get(&qs)?;
                    expert_of.insert(qs, (l, e, m, false));
                }
            }
        }
    }

    // The output files: the source's, tensor for tensor, expert matrices transcoded in place.
    let mut files = Vec::new();
    let mut dense_tensors = 0;
    for (path, tensors) in store.file_tensors() {
        let mut f = OutFile {
            name: path.file_name().expect("a weight file has a name").to_string_lossy().into_owned(),
            items: Vec::new(),
            tensors: Vec::new(),
            bytes: 0,
        };
        for name in tensors {
            match expert_of.get(name) {
                Some(&(layer, expert, matrix, true)) => {
                    let (rows, cols) = shape(matrix, to.hidden, to.inter);
                    let (packed, qs) = names(&to, layer, expert, matrix);
                    let (p, s) = (to.quant.packed_bytes(rows, cols)?, 4 * to.quant.scale_count(rows, cols)?);
                    f.tensors.push(OutTensor { name: packed, dtype: Dtype::U8, shape: vec![p], len: p });
                    f.tensors.push(OutTensor { name: qs, dtype: Dtype::F32, shape: vec![s / 4], len: s });
                    f.items.push(Item::Expert { layer, expert, matrix });
                    f.bytes += (p + s) as u64;
                }
                Some(&(_, _, _, false)) => {} // scales: written after their packed tensor
                None => {
                    let t = store.get(name)?;
                    f.tensors.push(OutTensor {
                        name: name.into(),
                        dtype: t.dtype,
                        shape: t.shape.to_vec(),
                        len: t.bytes.len(),
                    });
                    f.items.push(Item::Dense(name));
                    f.bytes += t.bytes.len() as u64;
                    dense_tensors += 1;
                }
            }
        }
        if !f.items.is_empty() {
            files.push(f);
        }
    }
    let headers = files.iter().map(|f| header(&f.tensors, &dst.join(&f.name))).collect::<Result<Vec<_>>>()?;
    let copied: Vec<&str> =
        std::iter::once("config.json").chain(COPIED_FILES.iter().copied().filter(|n| src.join(n).is_file())).collect();
    let mut images_not_copied: Vec<String> = std::fs::read_dir(src)
        .map_err(Error::io(src, "list directory"))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".picchioflat"))
        .collect();
    images_not_copied.sort();

    crate::image::write::require_parent_dir(dst)?;
    // Another writer of `dst` is refused, and what a killed one left beside it goes first.
    let _claim = crate::image::guard::WriteLock::file(dst, true)?;
    crate::image::guard::sweep_leftovers(dst, "transcode")?;
    let mut needed: u64 =
        files.iter().map(|f| f.bytes).sum::<u64>() + headers.iter().map(|h| h.len() as u64).sum::<u64>();
    for name in &copied {
        let p = src.join(name);
        needed += std::fs::metadata(&p).map_err(Error::io(&p, "read"))?.len();
    }
    crate::image::write::check_free_space(dst, needed)?;

    // The write phase: a failure drops `tmp` (the partial output goes) before the error is told.
    let write_phase = || -> Result<usize> {
        let tmp = TempDir::create(dst, "transcode")?;
        let n_items: usize = files.iter().map(|f| f.items.len()).sum();
        let bar = progress::bar(n_items as u64, "transcode", !opts.progress);
        let threads = crate::image::on_threads(opts.threads, "transcoding", || {
            for (f, h) in files.iter().zip(&headers) {
                write_file_items(&tmp.path.join(&f.name), f, h, &store, &from, to.quant, &bar)?;
            }
            Ok(())
        })?;
        bar.finish_and_clear();
        if src.join("model.safetensors.index.json").is_file() {
            let mut map = BTreeMap::new();
            for f in &files {
                for t in &f.tensors {
                    map.insert(t.name.as_str(), f.name.as_str());
                }
            }
            let total: u64 = files.iter().map(|f| f.bytes).sum();
            let v = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": map });
            let text = serde_json::to_string_pretty(&v).expect("a JSON value serializes") + "\n";
            write_file(&tmp.path.join("model.safetensors.index.json"), text.as_bytes())?;
        }
        for name in &copied {
            let from_path = src.join(name);
            let bytes = std::fs::read(&from_path).map_err(Error::io(&from_path, "read"))?;
            write_file(&tmp.path.join(name), &bytes)?;
        }
        tmp.persist(dst)?;
        Ok(threads)
    };
    let threads = write_phase().map_err(crate::image::write::out_of_space(dst, needed))?;

    Ok(TranscodeReport {
        src: src.into(),
        dst: dst.into(),
        from: from.quant,
        to: to.quant,
        experts: cfg.moe_layers().len() * cfg.num_experts,
        payload_len: (from.len(), to.len()),
        dense_tensors,
        files: files.iter().map(|f| dst.join(&f.name)).collect(),
        total_size: files.iter().map(|f| f.bytes).sum(),
        copied: copied.iter().map(|s| s.to_string()).collect(),
        images_not_copied,
        threads,
        elapsed: t0.elapsed(),
    })
}

/// Writes one output file: its header, then its items in order (expert matrices transcoded in
/// parallel chunks, written in order, so the bytes do not depend on the thread count).
fn write_file_items(
    path: &Path,
    f: &OutFile<'_>,
    header: &[u8],
    store: &TensorStore,
    from: &ExpertLayout,
    to: QuantKind,
    bar: &indicatif::ProgressBar,
) -> Result<()> {
    let mut w = picchio_core::output::OutputFile::create(path, 8 << 20).map_err(Error::io(path, "create"))?;
    w.write_all(header).map_err(Error::io(path, "write"))?;
    let chunk = (4 * rayon::current_num_threads()).max(16);
    let mut written = 0u64;
    for c in f.items.chunks(chunk) {
        // SIGINT/SIGTERM: the error unwinds to `transcode`, whose `TempDir` removes the partial output.
        let (done, wanted) = (bar.position() as usize, bar.length().unwrap_or_default() as usize);
        crate::interrupt::check(done, wanted, "tensors")?;
        let bytes = c
            .par_iter()
            .map(|item| match *item {
                Item::Dense(name) => Ok(store.get(name)?.bytes.to_vec()),
                Item::Expert { layer, expert, matrix } => transcode_matrix(store, from, to, (layer, expert, matrix)),
            })
            .collect::<Result<Vec<_>>>()?;
        for b in bytes {
            w.write_all(&b).map_err(Error::io(path, "write"))?;
            written += b.len() as u64;
            bar.inc(1);
        }
    }
    if written != f.bytes {
        return Err(Error::ShardBytes { path: path.into(), written, planned: f.bytes });
    }
    w.finish().map_err(Error::io(path, "write"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_q4_to_q3_and_none_to_q4_or_q3_are_transcoded() {
        let d = Path::new("/m");
        for (from, to, ok) in [
            (QuantKind::Q4, QuantKind::Q3, true),
            (QuantKind::F32, QuantKind::Q4, true),
            (QuantKind::F32, QuantKind::Q3, true),
            (QuantKind::Q4, QuantKind::Q4, false),
            (QuantKind::Q3, QuantKind::Q3, false),
            (QuantKind::Q3, QuantKind::Q4, false),
            (QuantKind::Q4, QuantKind::F32, false),
        ] {
            assert_eq!(check_kinds(d, from, to).is_ok(), ok, "{from} -> {to}");
        }
        let e = check_kinds(d, QuantKind::Q3, QuantKind::Q4).unwrap_err().to_string();
        assert!(e.starts_with("/m: its routed experts are q3: refusing to transcode them to q4: Q3 dropped"), "{e}");
        let e = check_kinds(d, QuantKind::Q4, QuantKind::Q4).unwrap_err().to_string();
        assert!(e.contains("nothing to do"), "{e}");
    }

    #[test]
    fn the_default_destination_is_a_sibling_named_after_the_target() {
        assert_eq!(default_destination(Path::new("/a/model"), QuantKind::Q3), Path::new("/a/model-q3"));
        assert_eq!(default_destination(Path::new("m"), QuantKind::Q4), Path::new("m-q4"));
    }
}
