//! Resident weight matrices and vectors shared by every architecture: a [`Matrix`] in the dtype it
//! is stored in (f32, bf16, or Picchio (C)'s i8 rows), norm/bias vectors widened to f32, and the
//! residual add.

use half::bf16;
use safetensors::Dtype;

use crate::error::Result;
use crate::kernels::MatRef;
use crate::model::safetensors::{TensorRef, TensorStore};

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
}

impl Matrix {
    /// The kernel view of the matrix.
    pub fn as_mat(&self) -> MatRef<'_> {
        match self {
            Matrix::F32(w) => MatRef::F32(w),
            Matrix::Bf16(w) => MatRef::Bf16(w),
            Matrix::I8Rows { q, scales } => MatRef::I8Rows { q, scales },
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
        }
    }

    /// Reads tensor `name` from `store` as a `[rows, cols]` matrix: F32 and BF16 are kept as they are,
    /// F16 is widened to f32, and I8 takes its row scales from `<name>.qs` (F32 `[rows]`). The
    /// tensors' mapped pages are then dropped from the resident set ([`TensorStore::release`]), so
    /// the dense part is resident once (as the copy), not twice.
    ///
    /// # Errors
    /// [`Error::MissingTensor`](crate::Error::MissingTensor), [`Error::TensorShape`](crate::Error::TensorShape) or [`Error::TensorDtype`](crate::Error::TensorDtype), each naming the
    /// tensor and its file.
    pub fn load(store: &TensorStore, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
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

/// A norm weight `[len]` widened to f32.
pub(crate) fn vector(store: &TensorStore, name: &str, len: usize) -> Result<Vec<f32>> {
    let t = store.get(name)?;
    t.expect_shape(&[len])?;
    let v = t.to_f32()?;
    store.release(name);
    Ok(v)
}
/// `x[i] += y[i]` (a residual connection; a plain f32 add like transformers' `residual + h`).
pub(crate) fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
