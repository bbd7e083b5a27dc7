//! Resident weight matrices and vectors shared by every architecture: a [`Matrix`] in the dtype it
//! is stored in (f32, bf16, Picchio (C)'s i8 rows, or a GGUF's ggml blocks), norm/bias vectors
//! widened to f32, and the
//! residual add, and the opt-in conversion of the resident projections at load ([`DenseFormat`],
//! `--dense bf16|int8`).

use half::bf16;
use picchio_core::format::gguf::GgmlType;
use safetensors::Dtype;

use crate::error::Result;
use crate::kernels::{ggml, MatRef};
use crate::model::safetensors::{TensorRef, TensorStore};
use crate::model::source::WeightSource;

/// A resident weight matrix `[rows, cols]` in the dtype it is stored in.
#[derive(Clone, Debug)]
pub enum Matrix {
    /// Row-major f32 (Picchio (C) attention and router; F16 checkpoints are widened to this).
    F32(Vec<f32>),
    /// Row-major bf16 (Hugging Face checkpoints).
    Bf16(Vec<bf16>),
    /// Row-major i8 with one f32 scale per row, `value = q * scale` (Picchio (C) embeddings and
    /// lm_head: the tensor and its `<name>.qs` `[rows]`).
    I8Rows {
        /// Codes `[rows, cols]`.
        q: Vec<i8>,
        /// Row scales `[rows]`.
        scales: Vec<f32>,
    },
    /// A GGUF tensor kept as stored: `rows` rows of whole blocks of the ggml type `ty` (one of
    /// [`ggml::DOT_TYPES`]), products computed as ggml-cpu does ([`MatRef::Ggml`]).
    Ggml {
        /// The weight type.
        ty: GgmlType,
        /// `rows * cols / ty.block_elems() * ty.block_bytes()` bytes.
        data: Vec<u8>,
    },
}

/// How the resident projection matrices are kept once loaded (`picchio run --dense`): as stored, or
/// converted at load to trade exactness for the bytes a token streams from RAM.
///
/// Only the matrices [`DenseFormat::converts`] names are converted: the attention projections
/// (`self_attn.{q,k,v,o}_proj.weight`) and the dense-MLP projections
/// (`mlp.{gate,up,down}_proj.weight` of `mlp_only_layers`). The router (`mlp.gate.weight`,
/// `mlp.router.weight`) stays as stored, because its logits pick the experts and a flipped top-k
/// choice is a discrete change (and it is ~1.4% of the attention bytes); embeddings and lm_head stay
/// as stored (Picchio (C) directories already keep them as `i8` rows). Norms and biases stay `f32`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DenseFormat {
    /// Every matrix as stored in the directory (exact; the default).
    #[default]
    Stored,
    /// `f32` projections rounded to `bf16` (round to nearest even, `half::bf16::from_f32`): half
    /// the bytes, a relative error of at most 2^-9 per weight. `bf16` and `i8` matrices stay.
    Bf16,
    /// `f32` and `bf16` projections quantized to `i8` rows with one `f32` scale per row
    /// (`scale = max|row| / 127`, `q = round(w / scale)`, Picchio (C)'s embedding layout): a quarter
    /// of the `f32` bytes. `i8` matrices stay.
    Int8,
}

impl DenseFormat {
    /// Every format, the default first.
    pub const ALL: [DenseFormat; 3] = [DenseFormat::Stored, DenseFormat::Bf16, DenseFormat::Int8];

    /// The name `--dense` takes: `stored`, `bf16` or `int8`.
    pub fn name(self) -> &'static str {
        match self {
            DenseFormat::Stored => "stored",
            DenseFormat::Bf16 => "bf16",
            DenseFormat::Int8 => "int8",
        }
    }

    /// Whether the tensor `name` is one of the projections this option converts (see the type docs):
    /// `model.layers.N.self_attn.{q,k,v,o}_proj.weight` or `model.layers.N.mlp.{gate,up,down}_proj.weight`.
    pub fn converts(name: &str) -> bool {
        const SUFFIXES: [&str; 7] = [
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ];
        let Some(rest) = name.strip_prefix("model.layers.") else { return false };
        let Some((layer, tail)) = rest.split_once('.') else { return false };
        !layer.is_empty() && layer.bytes().all(|b| b.is_ascii_digit()) && SUFFIXES.contains(&tail)
    }

    /// The resident bytes of a `[rows, cols]` matrix of `stored` bytes per weight (4 for F32, 2 for
    /// BF16, 1 for I8 with its `4 * rows` bytes of scales) once kept in this format, as
    /// [`Matrix::load_as`] keeps a matrix that [`DenseFormat::converts`] names.
    pub fn matrix_bytes(self, stored: usize, rows: usize, cols: usize) -> u64 {
        let n = (rows * cols) as u64;
        let i8_rows = n + 4 * rows as u64;
        match (self, stored) {
            (_, 1) => i8_rows,
            (DenseFormat::Stored, b) => b as u64 * n,
            (DenseFormat::Bf16, b) => b.min(2) as u64 * n,
            (DenseFormat::Int8, _) => i8_rows,
        }
    }
}

impl std::fmt::Display for DenseFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DenseFormat {
    type Err = String;

    /// `stored`, `bf16` or `int8` (case-insensitive).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        DenseFormat::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| format!("{s:?} is not one of stored, bf16, int8"))
    }
}

/// `i8` codes and scale of one row: `scale = max|w| / 127`, `q = round(w / scale)` (ties away from
/// zero, [`f32::round`]); a row of zeros gets scale 0 and codes 0.
fn quantize_row_i8(w: impl Iterator<Item = f32> + Clone, q: &mut Vec<i8>) -> f32 {
    let amax = w.clone().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        q.extend(w.map(|_| 0i8));
        return 0.0;
    }
    let scale = amax / 127.0;
    q.extend(w.map(|v| (v / scale).round().clamp(-127.0, 127.0) as i8));
    scale
}

impl Matrix {
    /// This matrix kept in `fmt` (see [`DenseFormat`]); a format that does not apply (`bf16` of an
    /// `i8` matrix, `int8` of an `i8` one, `stored`) returns it unchanged.
    pub fn convert(self, fmt: DenseFormat, cols: usize) -> Matrix {
        match (fmt, self) {
            (DenseFormat::Bf16, Matrix::F32(w)) => Matrix::Bf16(w.iter().map(|&v| bf16::from_f32(v)).collect()),
            (DenseFormat::Int8, Matrix::F32(w)) => Matrix::int8_rows(&w, cols, |&v| v),
            (DenseFormat::Int8, Matrix::Bf16(w)) => Matrix::int8_rows(&w, cols, |v| v.to_f32()),
            (_, m) => m,
        }
    }

    /// `w [rows, cols]` quantized to `i8` rows with per-row scales.
    fn int8_rows<T>(w: &[T], cols: usize, f: impl Fn(&T) -> f32 + Copy) -> Matrix {
        let rows = w.len().checked_div(cols).unwrap_or(0);
        let mut q = Vec::with_capacity(w.len());
        let mut scales = Vec::with_capacity(rows);
        for r in 0..rows {
            scales.push(quantize_row_i8(w[r * cols..(r + 1) * cols].iter().map(f), &mut q));
        }
        Matrix::I8Rows { q, scales }
    }

    /// [`Matrix::load`], then [`Matrix::convert`] to `fmt` when [`DenseFormat::converts`] names the
    /// tensor (one matrix is held in its stored form at a time).
    ///
    /// # Errors
    /// As [`Matrix::load`].
    pub fn load_as(store: &dyn WeightSource, name: &str, rows: usize, cols: usize, fmt: DenseFormat) -> Result<Matrix> {
        let m = store.matrix(name, rows, cols)?;
        Ok(if DenseFormat::converts(name) { m.convert(fmt, cols) } else { m })
    }

    /// The bytes the matrix holds in RAM (codes, scales and blocks; no allocation slack).
    pub fn resident_bytes(&self) -> u64 {
        match self {
            Matrix::F32(v) => 4 * v.len() as u64,
            Matrix::Bf16(v) => 2 * v.len() as u64,
            Matrix::I8Rows { q, scales } => q.len() as u64 + 4 * scales.len() as u64,
            Matrix::Ggml { data, .. } => data.len() as u64,
        }
    }

    /// The kernel view of the matrix.
    pub fn as_mat(&self) -> MatRef<'_> {
        match self {
            Matrix::F32(w) => MatRef::F32(w),
            Matrix::Bf16(w) => MatRef::Bf16(w),
            Matrix::I8Rows { q, scales } => MatRef::I8Rows { q, scales },
            Matrix::Ggml { ty, data } => MatRef::Ggml { ty: *ty, data },
        }
    }

    /// Writes row `r` widened to f32 into `out [cols]` (an embedding lookup).
    ///
    /// # Panics
    /// When row `r` does not exist.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let n = out.len();
        let span = r * n..(r + 1) * n;
        match self {
            Matrix::F32(w) => out.copy_from_slice(&w[span]),
            Matrix::Bf16(w) => out.iter_mut().zip(&w[span]).for_each(|(o, v)| *o = v.to_f32()),
            Matrix::I8Rows { q, scales } => {
                let s = scales[r];
                out.iter_mut().zip(&q[span]).for_each(|(o, &v)| *o = f32::from(v) * s);
            }
            Matrix::Ggml { ty, data } => {
                let row_bytes = n / ty.block_elems() as usize * ty.block_bytes() as usize;
                let row = &data[r * row_bytes..(r + 1) * row_bytes];
                ggml::dequantize(*ty, row, out).expect("a checked ggml matrix dequantizes whole rows");
            }
        }
    }

    /// Reads tensor `name` (a Hugging Face name) from `store` as a `[rows, cols]` matrix, as stored
    /// ([`WeightSource::matrix`]).
    ///
    /// # Errors
    /// As [`WeightSource::matrix`].
    pub fn load(store: &dyn WeightSource, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        store.matrix(name, rows, cols)
    }

    /// Reads tensor `name` from a safetensors `store` as a `[rows, cols]` matrix: F32 and BF16 are
    /// kept as they are, F16 is widened to f32, and I8 takes its row scales from `<name>.qs` (F32
    /// `[rows]`). The tensors' mapped pages are then dropped from the resident set
    /// ([`TensorStore::release`]), so the dense part is resident once (as the copy), not twice.
    ///
    /// # Errors
    /// [`Error::MissingTensor`](crate::Error::MissingTensor), [`Error::TensorShape`](crate::Error::TensorShape) or [`Error::TensorDtype`](crate::Error::TensorDtype), each naming the
    /// tensor and its file.
    pub(crate) fn from_safetensors(store: &TensorStore, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let t = store.get(name)?;
        t.expect_shape(&[rows, cols])?;
        let n = rows * cols;
        let m = match t.dtype {
            Dtype::F32 => {
                let mut w = Vec::with_capacity(n);
                store.read_released(name, |b| {
                    w.extend(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                })?;
                Matrix::F32(w)
            }
            Dtype::F16 => Matrix::F32(t.to_f32()?),
            Dtype::BF16 => {
                let mut w = Vec::with_capacity(n);
                store.read_released(name, |b| {
                    w.extend(b.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))))
                })?;
                Matrix::Bf16(w)
            }
            Dtype::I8 => {
                let qs = store.get(&format!("{name}.qs"))?;
                qs.expect_shape(&[rows])?;
                if qs.dtype != Dtype::F32 {
                    return Err(qs.dtype_error("F32 (row scales of an I8 matrix)"));
                }
                let scales = f32_values(&qs)?;
                store.release(qs.name);
                let mut q = Vec::with_capacity(n);
                store.read_released(name, |b| q.extend(b.iter().map(|&v| v as i8)))?;
                Matrix::I8Rows { q, scales }
            }
            _ => return Err(t.dtype_error("F32, BF16, F16, or I8 with a `.qs` row scale")),
        };
        store.release(name);
        Ok(m)
    }
}

/// The values of an F32 tensor.
pub(crate) fn f32_values(t: &TensorRef<'_>) -> Result<Vec<f32>> {
    if t.dtype != Dtype::F32 {
        return Err(t.dtype_error("F32"));
    }
    t.to_f32()
}

/// A norm weight (or bias) `[len]` widened to f32 ([`WeightSource::f32_tensor`]).
pub(crate) fn vector(store: &dyn WeightSource, name: &str, len: usize) -> Result<Vec<f32>> {
    store.f32_tensor(name, &[len])
}
/// `x[i] += y[i]` (a residual connection; a plain f32 add like transformers' `residual + h`).
pub(crate) fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
