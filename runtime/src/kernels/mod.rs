//! Compute kernels: matrix-vector products over every weight layout the model reads, and the small
//! vector helpers of a Qwen3-MoE forward pass (RMSNorm, softmax, SiLU, dot, axpy).
//!
//! # Matrix-vector products
//!
//! Every `matvec_*` computes `y[r] = sum_c W[r, c] * x[c]` for a row-major `W [rows, cols]` with
//! `rows = y.len()` and `cols = x.len()`, accumulating in `f32`:
//!
//! | kernel | weights | value of `W[r, c]` |
//! | --- | --- | --- |
//! | [`matvec_f32`] | `&[f32]` `[rows, cols]` | `w[r * cols + c]` |
//! | [`matvec_bf16`] | `&[bf16]` `[rows, cols]` (safetensors BF16; from `&[u16]` use [`half::slice::HalfBitsSliceExt::reinterpret_cast`]) | `f32::from(w[r * cols + c])` |
//! | [`matvec_i8_rows`] | `q: &[i8]` `[rows, cols]`, `row_scales: &[f32]` `[rows]` (Picchio (C) embeddings and lm_head, `.qs`) | `q[r * cols + c] * row_scales[r]` |
//! | [`matvec_q4`] | Q4 `packed [rows, cols / 2]`, `scales [rows, cols / 64]` ([`crate::quant`]) | `q * scale` |
//! | [`matvec_q3`] | Q3 `packed [rows, cols / 64 * 24]`, `scales [rows, cols / 64]` | `q * scale` |
//!
//! [`matvec`] and [`matvec_par`] take any of them as a [`MatRef`]; [`matvec_par`] splits rows across
//! the current rayon pool when `rows * cols >= `[`PAR_MIN_ELEMS`]. Every row is computed by the same
//! code whatever the split, so results are **bit-identical for any thread count**.
//!
//! # Matrix-matrix products (chunked prefill)
//!
//! [`Kernels::matmul`] and [`Kernels::matmul_par`] apply one matrix to `n` inputs at once:
//! `xs [n, cols]` (input `t` is row `t`) gives `yt [rows, n]` (**transposed**: `yt[r * n + t]`),
//! streaming each weight row from memory once for all `n` inputs (the row stays in L1 while the
//! inputs are read) and, for Q4/Q3, decoding each group once per block of [`MATMUL_BLOCK`] inputs.
//! Every output is computed by the same instruction sequence as the matrix-vector kernel of the same
//! level, so `yt[r * n + t]` is **bit-identical** to `y[r]` of `matvec(w, xs[t])`: a chunked
//! prefill gives exactly the token-by-token logits (the tests check it at every level).
//!
//! # Instruction-set levels
//!
//! Each kernel has a portable scalar reference (`scalar` modules, also the only code on non-x86
//! targets) and, on `x86_64`, an AVX2 + FMA twin and an AVX-512F twin. The level is chosen once per
//! process ([`Kernels::get`], cached in a [`OnceLock`]): the best one the CPU supports
//! (`is_x86_feature_detected!`), lowered by the environment variable **`PICCHIO_KERNELS`**:
//!
//! - `PICCHIO_KERNELS=scalar` — the portable reference only;
//! - `PICCHIO_KERNELS=avx2` — at most AVX2 + FMA;
//! - `PICCHIO_KERNELS=avx512` — at most AVX-512F (the default when supported).
//!
//! A level the CPU lacks, or an unknown value, falls back to the best supported level with a warning.
//! Tests and benches pick a level explicitly with [`Kernels::new`], which returns `None` when the CPU
//! lacks it: holding a [`Kernels`] is the proof that its level may run.
//!
//! The AVX-512 twins use `std::arch` intrinsics and the `avx512f` target feature, which are stable
//! since **Rust 1.89**; the crate therefore needs rustc >= 1.89 on `x86_64` (other targets build the
//! scalar kernels only).
//!
//! Within one level every kernel is deterministic (fixed summation order). Different levels sum in
//! different orders, so they agree only to rounding (the tests bound the relative difference).
//! SiLU and softmax are scalar at every level: they call [`f32::exp`] from the platform's libm, are
//! `O(n)` on short vectors, and a vector `exp` approximation would move them away from transformers.

use std::sync::OnceLock;

use half::bf16;
use picchio_core::format::gguf::GgmlType;
use rayon::prelude::*;

use crate::quant::{GROUP_SIZE, Q3_GROUP_BYTES, Q4_GROUP_BYTES};

mod block;
mod dense;
pub mod ggml;
mod idot;
mod norm;
mod q3;
mod q4;
#[cfg(target_arch = "x86_64")]
mod x86;

use q3::Q3;
use q4::Q4;

pub use idot::QuantizedInput;
pub use norm::{silu, silu_mul, silu_mul_interleaved, softmax_inplace};

/// Name of the environment variable that lowers the kernel level (`scalar`, `avx2` or `avx512`).
pub const LEVEL_ENV: &str = "PICCHIO_KERNELS";

/// Name of the environment variable that turns on the integer Q4 kernels process-wide
/// (`PICCHIO_IDOT=1`, as Picchio (C)'s `IDOT=1`; `picchio run --idot` sets them per model).
pub const IDOT_ENV: &str = "PICCHIO_IDOT";

/// [`matvec_par`] splits rows across threads only when `rows * cols` is at least this (`1 << 18`
/// weights); smaller products run on the calling thread.
pub const PAR_MIN_ELEMS: usize = 1 << 18;

/// Target number of weights per rayon task in [`matvec_par`].
const PAR_CHUNK_ELEMS: usize = 1 << 16;

/// Inputs per block of the Q4/Q3 matrix-matrix kernels ([`Kernels::matmul`]): a weight group is
/// decoded once for up to this many inputs (one accumulator register each, kept on the stack).
pub const MATMUL_BLOCK: usize = 64;

/// An instruction-set level for the kernels, ordered from lowest to highest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Portable scalar Rust (the reference; the only level on non-x86 targets).
    Scalar,
    /// x86-64 AVX2 + FMA, 8 `f32` lanes.
    Avx2,
    /// x86-64 AVX-512F (with AVX2 + FMA), 16 `f32` lanes.
    Avx512,
}

impl Level {
    /// Every level, lowest first.
    pub const ALL: [Level; 3] = [Level::Scalar, Level::Avx2, Level::Avx512];

    /// The name accepted by [`LEVEL_ENV`]: `"scalar"`, `"avx2"` or `"avx512"`.
    pub fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }

    /// Parses a [`Level::name`] (case-insensitive, surrounding spaces ignored).
    pub fn from_name(s: &str) -> Option<Level> {
        let s = s.trim();
        Level::ALL.into_iter().find(|l| l.name().eq_ignore_ascii_case(s))
    }

    /// Whether this CPU can run the level (runtime feature detection).
    pub fn is_supported(self) -> bool {
        match self {
            Level::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Level::Avx2 | Level::Avx512 => false,
        }
    }

    /// The highest level this CPU supports.
    pub fn best_supported() -> Level {
        Level::ALL.into_iter().rev().find(|l| l.is_supported()).unwrap_or(Level::Scalar)
    }
}

impl std::fmt::Display for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Picks the level from the value of [`LEVEL_ENV`] (if set) and the best supported level; returns the
/// level and a warning to log when the request could not be honoured.
fn select_level(requested: Option<&str>, best: Level) -> (Level, Option<String>) {
    let Some(req) = requested.filter(|s| !s.trim().is_empty()) else {
        return (best, None);
    };
    match Level::from_name(req) {
        Some(l) if l <= best => (l, None),
        Some(l) => (best, Some(format!("{LEVEL_ENV}={req}: this CPU does not support {l}; using {best}"))),
        None => (best, Some(format!("{LEVEL_ENV}={req:?} is not one of scalar, avx2, avx512; using {best}"))),
    }
}

/// A weight matrix in one of the layouts the kernels read, borrowed. The shape `[rows, cols]` is not
/// stored: it comes from `y.len()` and `x.len()` at each call.
#[derive(Debug, Clone, Copy)]
pub enum MatRef<'a> {
    /// Row-major `f32 [rows, cols]`.
    F32(&'a [f32]),
    /// Row-major `bf16 [rows, cols]`.
    Bf16(&'a [bf16]),
    /// Row-major `i8 [rows, cols]` with one scale per row (`value = q * scales[row]`).
    I8Rows {
        /// Codes `[rows, cols]`.
        q: &'a [i8],
        /// Per-row scales `[rows]`.
        scales: &'a [f32],
    },
    /// Q4 groups of 64 ([`crate::quant`]).
    Q4 {
        /// Packed nibbles `[rows, cols / 2]`.
        packed: &'a [u8],
        /// Group scales `[rows, cols / 64]`.
        scales: &'a [f32],
    },
    /// Q3 groups of 64 in 24 bytes ([`crate::quant`]).
    Q3 {
        /// Packed groups `[rows, cols / 64 * 24]`.
        packed: &'a [u8],
        /// Group scales `[rows, cols / 64]`.
        scales: &'a [f32],
    },
    /// A GGUF tensor's rows as stored: `rows` rows of `cols / ty.block_elems()` whole blocks of the
    /// ggml type `ty` (one of [`ggml::DOT_TYPES`]), row-major (ggml's `ne[0]` = cols). Products
    /// quantize the input to `ty`'s activation type first, as ggml-cpu does ([`ggml::q8`]), and
    /// compute ggml's `vec_dot` per row ([`ggml::dot`]).
    Ggml {
        /// The weight type.
        ty: GgmlType,
        /// `rows * cols / ty.block_elems() * ty.block_bytes()` bytes.
        data: &'a [u8],
    },
}

/// `a * b`, panicking on overflow: shape arithmetic that guards the SIMD kernels' loads must not wrap.
#[inline]
#[track_caller]
pub(crate) fn size(a: usize, b: usize) -> usize {
    a.checked_mul(b).expect("kernel shape overflows usize")
}

/// Panics with a message naming the kernel unless `found == expected`.
#[inline]
#[track_caller]
fn check_len(kernel: &str, what: &str, found: usize, expected: usize, rows: usize, cols: usize) {
    assert!(
        found == expected,
        "{kernel}: {what} has {found} elements, expected {expected} for a [{rows}, {cols}] matrix"
    );
}

/// Panics unless `cols` is a multiple of the quantization group (64).
#[inline]
#[track_caller]
fn check_groups(kernel: &str, cols: usize) {
    assert!(cols.is_multiple_of(GROUP_SIZE), "{kernel}: cols = {cols} is not a multiple of {GROUP_SIZE}");
}

impl<'a> MatRef<'a> {
    /// Panics unless the buffers match `[rows, cols]`.
    #[track_caller]
    fn check(&self, rows: usize, cols: usize) {
        let n = size(rows, cols);
        match *self {
            MatRef::F32(w) => check_len("matvec_f32", "w", w.len(), n, rows, cols),
            MatRef::Bf16(w) => check_len("matvec_bf16", "w", w.len(), n, rows, cols),
            MatRef::I8Rows { q, scales } => {
                check_len("matvec_i8_rows", "q", q.len(), n, rows, cols);
                check_len("matvec_i8_rows", "row_scales", scales.len(), rows, rows, cols);
            }
            MatRef::Q4 { packed, scales } => {
                check_groups("matvec_q4", cols);
                check_len("matvec_q4", "packed", packed.len(), n / 2, rows, cols);
                check_len("matvec_q4", "scales", scales.len(), n / 64, rows, cols);
            }
            MatRef::Q3 { packed, scales } => {
                check_groups("matvec_q3", cols);
                let bytes = n / GROUP_SIZE * Q3_GROUP_BYTES;
                check_len("matvec_q3", "packed", packed.len(), bytes, rows, cols);
                check_len("matvec_q3", "scales", scales.len(), n / 64, rows, cols);
            }
            MatRef::Ggml { ty, data } => {
                let bf16 = ty == GgmlType::BF16;
                assert!(bf16 || ggml::vec_dot_type(ty).is_some(), "matvec_ggml: no dot product for {ty:?}");
                let elems = ty.block_elems() as usize;
                assert!(cols.is_multiple_of(elems), "matvec_ggml: cols = {cols} is not whole {ty:?} blocks of {elems}");
                let bytes = size(rows, cols / elems * ty.block_bytes() as usize);
                check_len("matvec_ggml", "data (bytes)", data.len(), bytes, rows, cols);
            }
        }
    }

    /// Rows `r0..r1` of a checked matrix with `cols` columns.
    fn rows(self, r0: usize, r1: usize, cols: usize) -> MatRef<'a> {
        let groups = cols / GROUP_SIZE;
        match self {
            MatRef::F32(w) => MatRef::F32(&w[r0 * cols..r1 * cols]),
            MatRef::Bf16(w) => MatRef::Bf16(&w[r0 * cols..r1 * cols]),
            MatRef::I8Rows { q, scales } => MatRef::I8Rows { q: &q[r0 * cols..r1 * cols], scales: &scales[r0..r1] },
            MatRef::Q4 { packed, scales } => MatRef::Q4 {
                packed: &packed[r0 * groups * Q4_GROUP_BYTES..r1 * groups * Q4_GROUP_BYTES],
                scales: &scales[r0 * groups..r1 * groups],
            },
            MatRef::Q3 { packed, scales } => MatRef::Q3 {
                packed: &packed[r0 * groups * Q3_GROUP_BYTES..r1 * groups * Q3_GROUP_BYTES],
                scales: &scales[r0 * groups..r1 * groups],
            },
            MatRef::Ggml { ty, data } => {
                let row_bytes = cols / ty.block_elems() as usize * ty.block_bytes() as usize;
                MatRef::Ggml { ty, data: &data[r0 * row_bytes..r1 * row_bytes] }
            }
        }
    }
}

/// `(rows, cols)` of a [`Kernels::matmul`] call, panicking on a shape that is not `n` whole rows.
#[track_caller]
fn matmul_shape(xs: &[f32], n: usize, yt: &[f32]) -> (usize, usize) {
    assert!(n > 0, "matmul: no inputs (n = 0)");
    assert!(xs.len().is_multiple_of(n), "matmul: xs has {} values, not {n} whole inputs", xs.len());
    assert!(yt.len().is_multiple_of(n), "matmul: yt has {} values, not {n} whole outputs", yt.len());
    (yt.len() / n, xs.len() / n)
}

/// A set of kernels at one instruction-set [`Level`] that this CPU supports. Copy it freely; the free
/// functions of this module use [`Kernels::get`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernels {
    /// Invariant: `level.is_supported()` was true when this value was made.
    level: Level,
    /// Q4 products through the integer kernels ([`Kernels::with_idot`]).
    idot: bool,
}

/// Dispatches `$scalar`, `$avx2` or `$avx512` (paths to functions with the same arguments) on the level.
/// A generic kernel takes its type after the name: `block::matvec::<Q4>(...)`.
macro_rules! dispatch {
    ($self:expr, $module:ident :: $func:ident $(::<$g:ty>)? ( $($arg:expr),* )) => {
        match $self.level {
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => {
                // SAFETY: a `Kernels` holds `Avx512` only if `Level::is_supported` detected
                // avx512f + avx2 + fma on this CPU (`Kernels::new`); the kernel checks its shapes.
                unsafe { $module::avx512::$func$(::<$g>)?($($arg),*) }
            }
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => {
                // SAFETY: a `Kernels` holds `Avx2` only if `Level::is_supported` detected avx2 + fma
                // on this CPU (`Kernels::new`); the kernel checks its shapes.
                unsafe { $module::avx2::$func$(::<$g>)?($($arg),*) }
            }
            _ => $module::scalar::$func$(::<$g>)?($($arg),*),
        }
    };
}

impl Kernels {
    /// Kernels at `level`, or `None` when this CPU does not support it.
    pub fn new(level: Level) -> Option<Kernels> {
        level.is_supported().then_some(Kernels { level, idot: false })
    }

    /// The portable scalar reference kernels (always available).
    pub fn scalar() -> Kernels {
        Kernels { level: Level::Scalar, idot: false }
    }

    /// The best level this CPU supports, ignoring [`LEVEL_ENV`].
    pub fn best() -> Kernels {
        Kernels { level: Level::best_supported(), idot: false }
    }

    /// The process-wide kernels: the best supported level lowered by [`LEVEL_ENV`], chosen on the
    /// first call and cached.
    pub fn get() -> Kernels {
        static CHOSEN: OnceLock<Kernels> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let requested = std::env::var(LEVEL_ENV).ok();
            let (level, warning) = select_level(requested.as_deref(), Level::best_supported());
            if let Some(w) = warning {
                tracing::warn!("{w}");
            }
            let idot = std::env::var(IDOT_ENV).is_ok_and(|v| v.trim() == "1");
            tracing::debug!(level = level.name(), idot, "kernel level");
            Kernels { level, idot }
        })
    }

    /// The instruction-set level of these kernels.
    pub fn level(self) -> Level {
        self.level
    }

    /// These kernels with the Q4 products ([`Kernels::matvec_q4`], and Q4 in [`Kernels::matvec`],
    /// [`Kernels::matvec_par`], [`Kernels::matmul`], [`Kernels::matmul_par`]) computed by the
    /// integer kernels when `on` (the input quantized to `i8` per group of 64; see
    /// [`Kernels::matvec_q4_quantized`]), or by the exact `f32` ones. Other layouts are unchanged.
    pub fn with_idot(self, on: bool) -> Kernels {
        Kernels { idot: on, ..self }
    }

    /// Whether Q4 products use the integer kernels ([`Kernels::with_idot`]).
    pub fn idot(self) -> bool {
        self.idot
    }

    /// `y = W x` for a Q4 matrix `[y.len(), x.len()]` and an input quantized to `i8` per group of
    /// 64 ([`QuantizedInput::quantize`]), in integer arithmetic (module `idot`; Picchio (C)'s
    /// `IDOT=1`). Every level gives the same bits: the AVX2 and AVX-512 levels run the AVX2
    /// `vpmaddubsw` kernel, the scalar level its portable twin.
    ///
    /// # Panics
    /// When a buffer does not match the shape.
    pub fn matvec_q4_quantized(self, packed: &[u8], scales: &[f32], x: &QuantizedInput, y: &mut [f32]) {
        MatRef::Q4 { packed, scales }.check(y.len(), x.len());
        match self.level {
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 | Level::Avx512 => {
                // SAFETY: a `Kernels` holds `Avx2` or `Avx512` only if `Level::is_supported`
                // detected avx2 + fma on this CPU (`Kernels::new`); the kernel checks its shapes.
                unsafe { idot::avx2::matvec(packed, scales, x, y) }
            }
            _ => idot::scalar::matvec(packed, scales, x, y),
        }
    }

    /// The Q4 product of quantized inputs `qxs[t]` into `yt [rows, n]` (`yt[r * n + t]`), each
    /// output exactly [`Kernels::matvec_q4_quantized`]'s.
    fn matmul_q4_quantized(self, packed: &[u8], scales: &[f32], qxs: &[QuantizedInput], yt: &mut [f32]) {
        let n = qxs.len();
        let rows = yt.len() / n;
        let mut col = vec![0f32; rows];
        for (t, qx) in qxs.iter().enumerate() {
            self.matvec_q4_quantized(packed, scales, qx, &mut col);
            for (r, &v) in col.iter().enumerate() {
                yt[r * n + t] = v;
            }
        }
    }

    /// Runs `f` on each of the `n` rows of `xs` quantized ([`QuantizedInput::quantize`]) into this
    /// thread's buffers, which are kept for the next product: after the first product of a shape,
    /// `--idot` allocates nothing per product. The buffers are taken out of the thread-local for
    /// the call, so `f` may itself quantize.
    fn with_quantized<R>(xs: &[f32], n: usize, f: impl FnOnce(&[QuantizedInput]) -> R) -> R {
        thread_local! {
            static QUANTIZED: std::cell::RefCell<Vec<QuantizedInput>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let mut qs = QUANTIZED.take();
        let cols = xs.len() / n;
        if qs.len() < n {
            qs.resize_with(n, QuantizedInput::default);
        }
        for (t, q) in qs[..n].iter_mut().enumerate() {
            q.quantize(&xs[t * cols..(t + 1) * cols]);
        }
        let r = f(&qs[..n]);
        QUANTIZED.set(qs);
        r
    }

    /// `y = W x` for row-major `f32 W [y.len(), x.len()]`.
    ///
    /// # Panics
    /// When `w.len() != y.len() * x.len()`.
    pub fn matvec_f32(self, w: &[f32], x: &[f32], y: &mut [f32]) {
        MatRef::F32(w).check(y.len(), x.len());
        dispatch!(self, dense::matvec_f32(w, x, y));
    }

    /// `y = W x` for row-major `bf16 W [y.len(), x.len()]`, each weight widened to `f32`.
    ///
    /// # Panics
    /// When `w.len() != y.len() * x.len()`.
    pub fn matvec_bf16(self, w: &[bf16], x: &[f32], y: &mut [f32]) {
        MatRef::Bf16(w).check(y.len(), x.len());
        dispatch!(self, dense::matvec_bf16(w, x, y));
    }

    /// `y[r] = row_scales[r] * sum_c q[r, c] * x[c]` for row-major `i8 q [y.len(), x.len()]`.
    ///
    /// # Panics
    /// When `q.len() != y.len() * x.len()` or `row_scales.len() != y.len()`.
    pub fn matvec_i8_rows(self, q: &[i8], row_scales: &[f32], x: &[f32], y: &mut [f32]) {
        MatRef::I8Rows { q, scales: row_scales }.check(y.len(), x.len());
        dispatch!(self, dense::matvec_i8_rows(q, row_scales, x, y));
    }

    /// `y = W x` for a Q4 matrix `[y.len(), x.len()]`: `packed [rows, cols / 2]`,
    /// `scales [rows, cols / 64]` (layout in [`crate::quant`]).
    ///
    /// # Panics
    /// When `x.len()` is not a multiple of 64 or a buffer does not match the shape.
    pub fn matvec_q4(self, packed: &[u8], scales: &[f32], x: &[f32], y: &mut [f32]) {
        MatRef::Q4 { packed, scales }.check(y.len(), x.len());
        if self.idot {
            return Kernels::with_quantized(x, 1, |qx| self.matvec_q4_quantized(packed, scales, &qx[0], y));
        }
        dispatch!(self, block::matvec::<Q4>(packed, scales, x, y));
    }

    /// `y = W x` for a Q3 matrix `[y.len(), x.len()]`: `packed [rows, cols / 64 * 24]`,
    /// `scales [rows, cols / 64]` (layout in [`crate::quant`]).
    ///
    /// # Panics
    /// When `x.len()` is not a multiple of 64 or a buffer does not match the shape.
    pub fn matvec_q3(self, packed: &[u8], scales: &[f32], x: &[f32], y: &mut [f32]) {
        MatRef::Q3 { packed, scales }.check(y.len(), x.len());
        dispatch!(self, block::matvec::<Q3>(packed, scales, x, y));
    }

    /// `y = W x` for any layout, on the calling thread.
    ///
    /// # Panics
    /// When the buffers of `w` do not match `[y.len(), x.len()]`.
    pub fn matvec(self, w: MatRef<'_>, x: &[f32], y: &mut [f32]) {
        match w {
            MatRef::F32(w) => self.matvec_f32(w, x, y),
            MatRef::Bf16(w) => self.matvec_bf16(w, x, y),
            MatRef::I8Rows { q, scales } => self.matvec_i8_rows(q, scales, x, y),
            MatRef::Q4 { packed, scales } => self.matvec_q4(packed, scales, x, y),
            MatRef::Q3 { packed, scales } => self.matvec_q3(packed, scales, x, y),
            MatRef::Ggml { ty, data } => {
                w.check(y.len(), x.len());
                if ty == GgmlType::BF16 {
                    return ggml::bf16::matvec(data, x, y);
                }
                ggml::with_activation(ty, x, 1, |xq| ggml::dot::matvec_quantized(self.level, ty, data, xq, y))
            }
        }
    }

    /// `y = W x` for any layout, rows split across the current rayon pool when
    /// `rows * cols >= `[`PAR_MIN_ELEMS`] (run it inside `ThreadPool::install` to choose the pool).
    /// Bit-identical to [`Kernels::matvec`] for any number of threads.
    ///
    /// # Panics
    /// As [`Kernels::matvec`].
    pub fn matvec_par(self, w: MatRef<'_>, x: &[f32], y: &mut [f32]) {
        let (rows, cols) = (y.len(), x.len());
        w.check(rows, cols);
        if rows * cols < PAR_MIN_ELEMS || rayon::current_num_threads() < 2 {
            return self.matvec(w, x, y);
        }
        let chunk_rows = (PAR_CHUNK_ELEMS / cols.max(1)).max(1);
        if let MatRef::Ggml { ty: GgmlType::BF16, .. } = w {
            y.par_chunks_mut(chunk_rows).enumerate().for_each(|(i, y_chunk)| {
                let r0 = i * chunk_rows;
                self.matvec(w.rows(r0, r0 + y_chunk.len(), cols), x, y_chunk);
            });
            return;
        }
        if let MatRef::Ggml { ty, .. } = w {
            // The input is quantized once for every chunk of rows.
            return ggml::with_activation(ty, x, 1, |xq| {
                y.par_chunks_mut(chunk_rows).enumerate().for_each(|(i, y_chunk)| {
                    let r0 = i * chunk_rows;
                    if let MatRef::Ggml { data, .. } = w.rows(r0, r0 + y_chunk.len(), cols) {
                        ggml::dot::matvec_quantized(self.level, ty, data, xq, y_chunk);
                    }
                })
            });
        }
        if let (true, MatRef::Q4 { .. }) = (self.idot, w) {
            // The input is quantized once for every chunk of rows.
            return Kernels::with_quantized(x, 1, |qx| {
                y.par_chunks_mut(chunk_rows).enumerate().for_each(|(i, y_chunk)| {
                    let r0 = i * chunk_rows;
                    if let MatRef::Q4 { packed, scales } = w.rows(r0, r0 + y_chunk.len(), cols) {
                        self.matvec_q4_quantized(packed, scales, &qx[0], y_chunk);
                    }
                })
            });
        }
        y.par_chunks_mut(chunk_rows).enumerate().for_each(|(i, y_chunk)| {
            let r0 = i * chunk_rows;
            self.matvec(w.rows(r0, r0 + y_chunk.len(), cols), x, y_chunk);
        });
    }

    /// `yt [rows, n]` = W `xs [n, cols]` for any layout, on the calling thread: `n` inputs at once,
    /// `yt[r * n + t]` bit-identical to [`Kernels::matvec`] of input `t` (see the module docs,
    /// "Matrix-matrix products"). `rows = yt.len() / n`, `cols = xs.len() / n`.
    ///
    /// # Panics
    /// When `n` is 0, `xs` or `yt` is not a whole number of `n` rows, or the buffers of `w` do not
    /// match `[rows, cols]`.
    pub fn matmul(self, w: MatRef<'_>, xs: &[f32], n: usize, yt: &mut [f32]) {
        let (rows, cols) = matmul_shape(xs, n, yt);
        w.check(rows, cols);
        match w {
            MatRef::F32(w) => dispatch!(self, dense::matmul_f32(w, xs, n, yt)),
            MatRef::Bf16(w) => dispatch!(self, dense::matmul_bf16(w, xs, n, yt)),
            MatRef::I8Rows { q, scales } => dispatch!(self, dense::matmul_i8_rows(q, scales, xs, n, yt)),
            MatRef::Q4 { packed, scales } if self.idot => {
                Kernels::with_quantized(xs, n, |qxs| self.matmul_q4_quantized(packed, scales, qxs, yt))
            }
            MatRef::Q4 { packed, scales } => dispatch!(self, block::matmul::<Q4>(packed, scales, xs, n, yt)),
            MatRef::Q3 { packed, scales } => dispatch!(self, block::matmul::<Q3>(packed, scales, xs, n, yt)),
            MatRef::Ggml { ty: GgmlType::BF16, data } => ggml::bf16::matmul(data, xs, n, yt),
            MatRef::Ggml { ty, data } => {
                ggml::with_activation(ty, xs, n, |xqs| ggml::dot::matmul_quantized(self.level, ty, data, xqs, n, yt))
            }
        }
    }

    /// [`Kernels::matmul`] with the rows split across the current rayon pool when
    /// `rows * cols >= `[`PAR_MIN_ELEMS`], as [`Kernels::matvec_par`] splits them; bit-identical to
    /// [`Kernels::matmul`] (and so to [`Kernels::matvec`] per input) for any number of threads.
    ///
    /// # Panics
    /// As [`Kernels::matmul`].
    pub fn matmul_par(self, w: MatRef<'_>, xs: &[f32], n: usize, yt: &mut [f32]) {
        let (rows, cols) = matmul_shape(xs, n, yt);
        w.check(rows, cols);
        if rows * cols < PAR_MIN_ELEMS || rayon::current_num_threads() < 2 {
            return self.matmul(w, xs, n, yt);
        }
        let chunk_rows = (PAR_CHUNK_ELEMS / cols.max(1)).max(1);
        if let MatRef::Ggml { ty: GgmlType::BF16, .. } = w {
            yt.par_chunks_mut(chunk_rows * n).enumerate().for_each(|(i, y_chunk)| {
                let r0 = i * chunk_rows;
                self.matmul(w.rows(r0, r0 + y_chunk.len() / n, cols), xs, n, y_chunk);
            });
            return;
        }
        if let MatRef::Ggml { ty, .. } = w {
            // The inputs are quantized once for every chunk of rows.
            return ggml::with_activation(ty, xs, n, |xqs| {
                yt.par_chunks_mut(chunk_rows * n).enumerate().for_each(|(i, y_chunk)| {
                    let r0 = i * chunk_rows;
                    if let MatRef::Ggml { data, .. } = w.rows(r0, r0 + y_chunk.len() / n, cols) {
                        ggml::dot::matmul_quantized(self.level, ty, data, xqs, n, y_chunk);
                    }
                })
            });
        }
        if let (true, MatRef::Q4 { .. }) = (self.idot, w) {
            // The inputs are quantized once for every chunk of rows.
            return Kernels::with_quantized(xs, n, |qxs| {
                yt.par_chunks_mut(chunk_rows * n).enumerate().for_each(|(i, y_chunk)| {
                    let r0 = i * chunk_rows;
                    if let MatRef::Q4 { packed, scales } = w.rows(r0, r0 + y_chunk.len() / n, cols) {
                        self.matmul_q4_quantized(packed, scales, qxs, y_chunk);
                    }
                })
            });
        }
        yt.par_chunks_mut(chunk_rows * n).enumerate().for_each(|(i, y_chunk)| {
            let r0 = i * chunk_rows;
            self.matmul(w.rows(r0, r0 + y_chunk.len() / n, cols), xs, n, y_chunk);
        });
    }

    /// `sum_i a[i] * b[i]` in `f32`.
    ///
    /// # Panics
    /// When `a.len() != b.len()`.
    pub fn dot(self, a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len(), "dot: lengths differ");
        dispatch!(self, dense::dot(a, b))
    }

    /// `y[i] += a * x[i]` (the SIMD levels fuse the multiply-add).
    ///
    /// # Panics
    /// When `x.len() != y.len()`.
    pub fn axpy(self, a: f32, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), y.len(), "axpy: lengths differ");
        dispatch!(self, dense::axpy(a, x, y));
    }

    /// Attention scores over a KV cache: `out[t] = dot(q, rows[t * stride..t * stride + q.len()]) *
    /// scale` for `t < out.len()`, each exactly [`Kernels::dot`] times `scale` (one call per head
    /// instead of one per cached position).
    ///
    /// # Panics
    /// When `out` is not empty and `(out.len() - 1) * stride + q.len() > rows.len()`.
    pub fn dot_rows(self, q: &[f32], rows: &[f32], stride: usize, scale: f32, out: &mut [f32]) {
        if let Some(last) = out.len().checked_sub(1) {
            assert!(
                size(last, stride) + q.len() <= rows.len(),
                "dot_rows: {} rows of stride {stride} past {}",
                out.len(),
                rows.len()
            );
        }
        dispatch!(self, dense::dot_rows(q, rows, stride, scale, out));
    }

    /// The attention-weighted sum of values: `out = sum_t w[t] * rows[t * stride..t * stride +
    /// out.len()]`, exactly `out.fill(0.0)` then [`Kernels::axpy`] for each `t` in order.
    ///
    /// # Panics
    /// When `w` is not empty and `(w.len() - 1) * stride + out.len() > rows.len()`.
    pub fn weighted_rows(self, w: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
        if let Some(last) = w.len().checked_sub(1) {
            assert!(
                size(last, stride) + out.len() <= rows.len(),
                "weighted_rows: {} rows of stride {stride} past {}",
                w.len(),
                rows.len()
            );
        }
        dispatch!(self, dense::weighted_rows(w, rows, stride, out));
    }

    /// Hugging Face `Qwen3RMSNorm` in `f32`: `out[i] = weight[i] * (x[i] * rsqrt(mean(x^2) + eps))`,
    /// with `mean(x^2)` from [`Kernels::dot`].
    ///
    /// # Panics
    /// When `out`, `x` and `weight` differ in length.
    pub fn rmsnorm(self, out: &mut [f32], x: &[f32], weight: &[f32], eps: f32) {
        assert_eq!(out.len(), x.len(), "rmsnorm: out and x lengths differ");
        assert_eq!(weight.len(), x.len(), "rmsnorm: weight and x lengths differ");
        let inv = norm::rms_inv(self.dot(x, x), x.len(), eps);
        for ((o, &v), &g) in out.iter_mut().zip(x).zip(weight) {
            *o = (v * inv) * g;
        }
    }

    /// [`Kernels::rmsnorm`] in place (for example the per-head q/k norms of Qwen3 attention).
    ///
    /// # Panics
    /// When `weight.len() != x.len()`.
    pub fn rmsnorm_inplace(self, x: &mut [f32], weight: &[f32], eps: f32) {
        assert_eq!(weight.len(), x.len(), "rmsnorm: weight and x lengths differ");
        let inv = norm::rms_inv(self.dot(x, x), x.len(), eps);
        for (v, &g) in x.iter_mut().zip(weight) {
            *v = (*v * inv) * g;
        }
    }
}

/// [`Kernels::matvec_f32`] at the process-wide level ([`Kernels::get`]): `y = W x`, `W [y.len(), x.len()]`.
pub fn matvec_f32(w: &[f32], x: &[f32], y: &mut [f32]) {
    Kernels::get().matvec_f32(w, x, y);
}

/// [`Kernels::matvec_bf16`] at the process-wide level: `y = W x`, `bf16 W [y.len(), x.len()]`.
pub fn matvec_bf16(w: &[bf16], x: &[f32], y: &mut [f32]) {
    Kernels::get().matvec_bf16(w, x, y);
}

/// [`Kernels::matvec_i8_rows`] at the process-wide level: `y[r] = row_scales[r] * (q[r, :] . x)`.
pub fn matvec_i8_rows(q: &[i8], row_scales: &[f32], x: &[f32], y: &mut [f32]) {
    Kernels::get().matvec_i8_rows(q, row_scales, x, y);
}

/// [`Kernels::matvec_q4`] at the process-wide level: `y = W x` for a Q4 `W [y.len(), x.len()]`.
pub fn matvec_q4(packed: &[u8], scales: &[f32], x: &[f32], y: &mut [f32]) {
    Kernels::get().matvec_q4(packed, scales, x, y);
}

/// [`Kernels::matvec_q3`] at the process-wide level: `y = W x` for a Q3 `W [y.len(), x.len()]`.
pub fn matvec_q3(packed: &[u8], scales: &[f32], x: &[f32], y: &mut [f32]) {
    Kernels::get().matvec_q3(packed, scales, x, y);
}

/// [`Kernels::matvec`] at the process-wide level, on the calling thread.
pub fn matvec(w: MatRef<'_>, x: &[f32], y: &mut [f32]) {
    Kernels::get().matvec(w, x, y);
}

/// [`Kernels::matvec_par`] at the process-wide level: rows split across rayon for large matrices,
/// bit-identical for any thread count.
pub fn matvec_par(w: MatRef<'_>, x: &[f32], y: &mut [f32]) {
    Kernels::get().matvec_par(w, x, y);
}

/// [`Kernels::dot`] at the process-wide level: `sum_i a[i] * b[i]`.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    Kernels::get().dot(a, b)
}

/// [`Kernels::axpy`] at the process-wide level: `y[i] += a * x[i]`.
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    Kernels::get().axpy(a, x, y);
}

/// [`Kernels::rmsnorm`] at the process-wide level: HF Qwen3 RMSNorm of `x` into `out`.
pub fn rmsnorm(out: &mut [f32], x: &[f32], weight: &[f32], eps: f32) {
    Kernels::get().rmsnorm(out, x, weight, eps);
}

/// [`Kernels::rmsnorm_inplace`] at the process-wide level.
pub fn rmsnorm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    Kernels::get().rmsnorm_inplace(x, weight, eps);
}

#[cfg(test)]
mod tests {
    //! Every SIMD twin against the scalar reference; levels the CPU lacks are skipped with a message.

    use super::*;
    use crate::quant::{quantize_q3, quantize_q4};

    /// [`SplitMix64`](picchio_core::rng::SplitMix64) in [-1, 1).
    struct Rng(picchio_core::rng::SplitMix64);
    impl Rng {
        fn new(seed: u64) -> Self {
            Rng(picchio_core::rng::SplitMix64::new(seed))
        }
        fn next(&mut self) -> f32 {
            self.0.next_signed_f32()
        }
        fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.next()).collect()
        }
    }

    /// The SIMD levels this CPU has, announcing the ones it lacks.
    fn simd_levels(test: &str) -> Vec<Kernels> {
        let mut out = Vec::new();
        for level in [Level::Avx2, Level::Avx512] {
            match Kernels::new(level) {
                Some(k) => out.push(k),
                None => eprintln!("{test}: SKIPPED level {level}: not supported by this CPU/target"),
            }
        }
        out
    }

    /// `|a - b| <= rel * scale + tiny`, elementwise, where `scale[i]` bounds the summed magnitudes.
    fn assert_close(what: &str, a: &[f32], b: &[f32], scale: &[f32], rel: f32) {
        assert_eq!(a.len(), b.len());
        for i in 0..a.len() {
            let tol = rel * scale[i] + 1e-30;
            assert!((a[i] - b[i]).abs() <= tol, "{what}: y[{i}] = {} vs scalar {} (tol {tol})", a[i], b[i]);
        }
    }

    /// `sum_c |W[r, c] * x[c]|` for each of the `rows` rows of a dequantized matrix.
    fn abs_rows(w: &[f32], x: &[f32], rows: usize) -> Vec<f32> {
        (0..rows).map(|r| w[r * x.len()..(r + 1) * x.len()].iter().zip(x).map(|(a, b)| (a * b).abs()).sum()).collect()
    }

    const REL: f32 = 1e-5;
    const DENSE_SHAPES: &[(usize, usize)] =
        &[(1, 1), (3, 7), (9, 33), (5, 64), (13, 100), (7, 128), (17, 255), (3, 2048), (11, 2048 + 13), (4, 0)];
    const QUANT_SHAPES: &[(usize, usize)] = &[(1, 64), (5, 64), (13, 128), (7, 192), (9, 768), (3, 2048)];

    #[test]
    fn matvec_f32_twins_match_scalar() {
        let mut rng = Rng::new(0x1234_5678);
        for k in simd_levels("matvec_f32") {
            for &(rows, cols) in DENSE_SHAPES {
                let w = rng.vec(rows * cols);
                let x = rng.vec(cols);
                let (mut y, mut r) = (vec![0f32; rows], vec![0f32; rows]);
                k.matvec_f32(&w, &x, &mut y);
                Kernels::scalar().matvec_f32(&w, &x, &mut r);
                let what = format!("matvec_f32 {} [{rows}, {cols}]", k.level());
                assert_close(&what, &y, &r, &abs_rows(&w, &x, rows), REL);
            }
            eprintln!("matvec_f32: checked {}", k.level());
        }
    }

    #[test]
    fn matvec_bf16_twins_match_scalar() {
        let mut rng = Rng::new(0x9e37_79b9);
        for k in simd_levels("matvec_bf16") {
            for &(rows, cols) in DENSE_SHAPES {
                let w: Vec<bf16> = rng.vec(rows * cols).into_iter().map(bf16::from_f32).collect();
                let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
                let x = rng.vec(cols);
                let (mut y, mut r, mut f) = (vec![0f32; rows], vec![0f32; rows], vec![0f32; rows]);
                k.matvec_bf16(&w, &x, &mut y);
                Kernels::scalar().matvec_bf16(&w, &x, &mut r);
                // the bf16 kernel is the f32 kernel on the widened weights, bit for bit
                k.matvec_f32(&wf, &x, &mut f);
                assert_eq!(y, f, "bf16 vs f32 at {}", k.level());
                let what = format!("matvec_bf16 {} [{rows}, {cols}]", k.level());
                assert_close(&what, &y, &r, &abs_rows(&wf, &x, rows), REL);
            }
            eprintln!("matvec_bf16: checked {}", k.level());
        }
    }

    #[test]
    fn matvec_i8_rows_twins_match_scalar() {
        let mut rng = Rng::new(0xdead_beef);
        for k in simd_levels("matvec_i8_rows") {
            for &(rows, cols) in DENSE_SHAPES {
                let q: Vec<i8> = (0..rows * cols).map(|_| (rng.next() * 128.0) as i8).collect();
                let s: Vec<f32> = (0..rows).map(|_| rng.next().abs() * 0.01).collect();
                let x = rng.vec(cols);
                let (mut y, mut r) = (vec![0f32; rows], vec![0f32; rows]);
                k.matvec_i8_rows(&q, &s, &x, &mut y);
                Kernels::scalar().matvec_i8_rows(&q, &s, &x, &mut r);
                let wf: Vec<f32> = q.iter().enumerate().map(|(i, &v)| f32::from(v) * s[i / cols.max(1)]).collect();
                let what = format!("matvec_i8_rows {} [{rows}, {cols}]", k.level());
                assert_close(&what, &y, &r, &abs_rows(&wf, &x, rows), REL);
            }
            eprintln!("matvec_i8_rows: checked {}", k.level());
        }
    }

    #[test]
    fn matvec_q4_twins_match_scalar() {
        let mut rng = Rng::new(0x0bad_cafe);
        for k in simd_levels("matvec_q4") {
            for &(rows, cols) in QUANT_SHAPES {
                let w = rng.vec(rows * cols);
                let (p, s) = quantize_q4(&w, rows, cols);
                let wf = crate::quant::dequantize_q4(&p, &s, rows, cols);
                let x = rng.vec(cols);
                let (mut y, mut r) = (vec![0f32; rows], vec![0f32; rows]);
                k.matvec_q4(&p, &s, &x, &mut y);
                Kernels::scalar().matvec_q4(&p, &s, &x, &mut r);
                let what = format!("matvec_q4 {} [{rows}, {cols}]", k.level());
                assert_close(&what, &y, &r, &abs_rows(&wf, &x, rows), REL);
            }
            eprintln!("matvec_q4: checked {}", k.level());
        }
    }

    #[test]
    fn matvec_q3_twins_match_scalar() {
        let mut rng = Rng::new(0xfeed_f00d);
        for k in simd_levels("matvec_q3") {
            for &(rows, cols) in QUANT_SHAPES {
                let w = rng.vec(rows * cols);
                let (p, s) = quantize_q3(&w, rows, cols);
                let wf = crate::quant::dequantize_q3(&p, &s, rows, cols);
                let x = rng.vec(cols);
                let (mut y, mut r) = (vec![0f32; rows], vec![0f32; rows]);
                k.matvec_q3(&p, &s, &x, &mut y);
                Kernels::scalar().matvec_q3(&p, &s, &x, &mut r);
                let what = format!("matvec_q3 {} [{rows}, {cols}]", k.level());
                assert_close(&what, &y, &r, &abs_rows(&wf, &x, rows), REL);
            }
            eprintln!("matvec_q3: checked {}", k.level());
        }
    }

    /// Every layout at `[rows, cols]` from `w` (quantized ones need `cols % 64 == 0`).
    struct Mats {
        w: Vec<f32>,
        wb: Vec<bf16>,
        qi: Vec<i8>,
        si: Vec<f32>,
        q4: Option<(Vec<u8>, Vec<f32>)>,
        q3: Option<(Vec<u8>, Vec<f32>)>,
    }

    impl Mats {
        fn new(rng: &mut Rng, rows: usize, cols: usize) -> Mats {
            let w = rng.vec(rows * cols);
            let quant = cols.is_multiple_of(GROUP_SIZE);
            Mats {
                wb: w.iter().map(|&v| bf16::from_f32(v)).collect(),
                qi: w.iter().map(|&v| (v * 127.0) as i8).collect(),
                si: (0..rows).map(|_| rng.next().abs() * 0.01).collect(),
                q4: quant.then(|| quantize_q4(&w, rows, cols)),
                q3: quant.then(|| quantize_q3(&w, rows, cols)),
                w,
            }
        }

        fn refs(&self) -> Vec<(&'static str, MatRef<'_>)> {
            let mut v = vec![
                ("f32", MatRef::F32(&self.w)),
                ("bf16", MatRef::Bf16(&self.wb)),
                ("i8_rows", MatRef::I8Rows { q: &self.qi, scales: &self.si }),
            ];
            if let Some((p, s)) = &self.q4 {
                v.push(("q4", MatRef::Q4 { packed: p, scales: s }));
            }
            if let Some((p, s)) = &self.q3 {
                v.push(("q3", MatRef::Q3 { packed: p, scales: s }));
            }
            v
        }
    }

    /// `yt [rows, n]` back to `[n, rows]`.
    fn untranspose(yt: &[f32], n: usize) -> Vec<f32> {
        let rows = yt.len() / n;
        (0..n * rows).map(|i| yt[(i % rows) * n + i / rows]).collect()
    }

    #[test]
    fn matmul_equals_matvec_per_input_bit_for_bit_at_every_level() {
        let mut rng = Rng::new(0x5eed_0001);
        let mut levels = vec![Kernels::scalar()];
        levels.extend(simd_levels("matmul"));
        let shapes: &[(usize, usize)] = &[(1, 64), (3, 7), (5, 128), (9, 33), (7, 192), (13, 100), (4, 0), (3, 2048)];
        for &(rows, cols) in shapes {
            let m = Mats::new(&mut rng, rows, cols);
            // n crosses the Q4/Q3 block of MATMUL_BLOCK inputs
            for n in [1usize, 2, 5, MATMUL_BLOCK, MATMUL_BLOCK + 3, 2 * MATMUL_BLOCK + 1] {
                let xs = rng.vec(n * cols);
                for k in &levels {
                    for (name, w) in m.refs() {
                        let mut yt = vec![f32::NAN; rows * n];
                        k.matmul(w, &xs, n, &mut yt);
                        let ys = untranspose(&yt, n);
                        for t in 0..n {
                            let mut y = vec![0f32; rows];
                            k.matvec(w, &xs[t * cols..(t + 1) * cols], &mut y);
                            let got = &ys[t * rows..(t + 1) * rows];
                            let same = got.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(same, "{} {name} [{rows}, {cols}] n={n} input {t}: {got:?} vs {y:?}", k.level());
                        }
                        // and the twin against the scalar reference, within rounding
                        let mut r = vec![0f32; rows * n];
                        Kernels::scalar().matmul(w, &xs, n, &mut r);
                        for (i, (a, b)) in yt.iter().zip(&r).enumerate() {
                            let scale: f32 = (0..cols).map(|c| (xs[(i % n) * cols + c] * 2.0).abs()).sum::<f32>();
                            assert!((a - b).abs() <= REL * scale + 1e-30, "{} {name} vs scalar: {a} vs {b}", k.level());
                        }
                    }
                }
            }
        }
        eprintln!("matmul: checked {:?}", levels.iter().map(|k| k.level()).collect::<Vec<_>>());
    }

    #[test]
    fn matmul_par_is_bit_identical_for_any_thread_count() {
        let (rows, cols, n) = (1536usize, 256usize, 5usize);
        assert!(rows * cols >= PAR_MIN_ELEMS);
        let mut rng = Rng::new(0x5eed_0002);
        let m = Mats::new(&mut rng, rows, cols);
        let xs = rng.vec(n * cols);
        let mut levels = vec![Kernels::scalar()];
        levels.extend(simd_levels("matmul_par"));
        for k in levels {
            for (name, w) in m.refs() {
                let mut single = vec![0f32; rows * n];
                k.matmul(w, &xs, n, &mut single);
                for threads in [1, 2, 3, 8] {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    let mut par = vec![0f32; rows * n];
                    pool.install(|| k.matmul_par(w, &xs, n, &mut par));
                    let same = single.iter().zip(&par).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{} {name}: {threads} threads differ", k.level());
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "matmul: no inputs")]
    fn matmul_needs_inputs() {
        Kernels::scalar().matmul(MatRef::F32(&[]), &[], 0, &mut []);
    }

    #[test]
    #[should_panic(expected = "not 2 whole inputs")]
    fn matmul_refuses_a_partial_input() {
        let mut yt = [0f32; 2];
        Kernels::scalar().matmul(MatRef::F32(&[0.0; 3]), &[0.0; 5], 2, &mut yt);
    }

    #[test]
    fn scalar_quant_kernels_match_dequantized_f64() {
        // the scalar reference itself against an f64 product of the dequantized matrix
        let mut rng = Rng::new(42);
        for &(rows, cols) in QUANT_SHAPES {
            let w = rng.vec(rows * cols);
            let x = rng.vec(cols);
            let (p4, s4) = quantize_q4(&w, rows, cols);
            let (p3, s3) = quantize_q3(&w, rows, cols);
            let cases = [
                ("q4", MatRef::Q4 { packed: &p4, scales: &s4 }, crate::quant::dequantize_q4(&p4, &s4, rows, cols)),
                ("q3", MatRef::Q3 { packed: &p3, scales: &s3 }, crate::quant::dequantize_q3(&p3, &s3, rows, cols)),
            ];
            for (name, m, deq) in cases {
                let mut y = vec![0f32; rows];
                Kernels::scalar().matvec(m, &x, &mut y);
                let exact: Vec<f32> = deq
                    .chunks(cols)
                    .map(|row| row.iter().zip(&x).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>() as f32)
                    .collect();
                let what = format!("scalar {name} [{rows}, {cols}] vs f64");
                assert_close(&what, &y, &exact, &abs_rows(&deq, &x, rows), REL);
            }
        }
    }

    #[test]
    fn dot_axpy_rmsnorm_twins_match_scalar() {
        let mut rng = Rng::new(7);
        for k in simd_levels("dot/axpy/rmsnorm") {
            for n in [0usize, 1, 7, 8, 15, 16, 31, 64, 100, 128, 2048, 2061] {
                let a = rng.vec(n);
                let b = rng.vec(n);
                let abs: f32 = a.iter().zip(&b).map(|(x, y)| (x * y).abs()).sum();
                let (d, r) = (k.dot(&a, &b), Kernels::scalar().dot(&a, &b));
                assert!((d - r).abs() <= REL * abs + 1e-30, "dot {n}: {d} vs {r}");

                let (mut y1, mut y2) = (b.clone(), b.clone());
                k.axpy(0.37, &a, &mut y1);
                Kernels::scalar().axpy(0.37, &a, &mut y2);
                for i in 0..n {
                    let tol = 2.0 * f32::EPSILON * (b[i].abs() + (0.37 * a[i]).abs());
                    assert!((y1[i] - y2[i]).abs() <= tol, "axpy {n}[{i}]");
                }

                let g = rng.vec(n);
                let (mut o1, mut o2) = (vec![0f32; n], vec![0f32; n]);
                k.rmsnorm(&mut o1, &a, &g, 1e-6);
                Kernels::scalar().rmsnorm(&mut o2, &a, &g, 1e-6);
                for i in 0..n {
                    assert!((o1[i] - o2[i]).abs() <= 1e-5 * o2[i].abs() + 1e-30, "rmsnorm {n}");
                }
                let mut o3 = a.clone();
                k.rmsnorm_inplace(&mut o3, &g, 1e-6);
                assert_eq!(o1, o3, "rmsnorm_inplace == rmsnorm");
            }
            eprintln!("dot/axpy/rmsnorm: checked {}", k.level());
        }
    }

    /// Bits of a slice, for exact comparisons that print well.
    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn idot_levels_are_bit_identical_and_within_the_input_quantization_bound() {
        let mut rng = Rng::new(0x1d07);
        let mut levels = vec![Kernels::scalar().with_idot(true)];
        levels.extend(simd_levels("idot").into_iter().map(|k| k.with_idot(true)));
        for &(rows, cols) in QUANT_SHAPES.iter().chain(&[(1536, 2048), (2048, 768)]) {
            let w = rng.vec(rows * cols);
            let (p, s) = quantize_q4(&w, rows, cols);
            let wf = crate::quant::dequantize_q4(&p, &s, rows, cols);
            let mut x = rng.vec(cols);
            x[0] = 0.0;
            if cols >= 128 {
                x[64..128].fill(0.0); // a group of zeros: scale 0
            }
            let mut reference = vec![0f32; rows];
            levels[0].matvec_q4(&p, &s, &x, &mut reference);
            // the input's quantization error is at most max|x_g| / 254 per element
            let mut exact = vec![0f32; rows];
            Kernels::scalar().matvec_q4(&p, &s, &x, &mut exact);
            for r in 0..rows {
                let mut bound = 0f32;
                for (g, xg) in x.chunks_exact(GROUP_SIZE).enumerate() {
                    let amax = xg.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let wsum: f32 = wf[r * cols + g * GROUP_SIZE..][..GROUP_SIZE].iter().map(|v| v.abs()).sum();
                    bound += amax / 254.0 * wsum;
                }
                let abs: f32 = (0..cols).map(|c| (wf[r * cols + c] * x[c]).abs()).sum();
                let tol = bound * 1.001 + 1e-5 * abs + 1e-30;
                let d = (reference[r] - exact[r]).abs();
                assert!(
                    d <= tol,
                    "idot [{rows}, {cols}] row {r}: {} vs exact {} (bound {tol})",
                    reference[r],
                    exact[r]
                );
            }
            let m = MatRef::Q4 { packed: &p, scales: &s };
            for k in &levels {
                let mut y = vec![0f32; rows];
                k.matvec(m, &x, &mut y);
                assert_eq!(bits(&y), bits(&reference), "idot {} [{rows}, {cols}] vs scalar", k.level());
                for threads in [1, 2, 3] {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    let mut par = vec![0f32; rows];
                    pool.install(|| k.matvec_par(m, &x, &mut par));
                    assert_eq!(bits(&par), bits(&reference), "idot {} matvec_par {threads} threads", k.level());
                }
                let n = 3;
                let mut xs = rng.vec(n * cols);
                xs[cols..2 * cols].copy_from_slice(&x);
                for par in [false, true] {
                    let mut yt = vec![f32::NAN; rows * n];
                    if par {
                        k.matmul_par(m, &xs, n, &mut yt);
                    } else {
                        k.matmul(m, &xs, n, &mut yt);
                    }
                    let ys = untranspose(&yt, n);
                    for t in 0..n {
                        let mut y = vec![0f32; rows];
                        k.matvec(m, &xs[t * cols..(t + 1) * cols], &mut y);
                        assert_eq!(
                            bits(&ys[t * rows..(t + 1) * rows]),
                            bits(&y),
                            "idot {} matmul (par {par})",
                            k.level()
                        );
                    }
                }
            }
        }
        eprintln!("idot: checked {:?}", levels.iter().map(|k| k.level()).collect::<Vec<_>>());
    }

    #[test]
    fn idot_leaves_other_layouts_exact() {
        let mut rng = Rng::new(0x1d08);
        let m = Mats::new(&mut rng, 7, 192);
        let x = rng.vec(192);
        let k = Kernels::best();
        for (name, w) in m.refs().into_iter().filter(|(n, _)| *n != "q4") {
            let (mut a, mut b) = (vec![0f32; 7], vec![0f32; 7]);
            k.matvec(w, &x, &mut a);
            k.with_idot(true).matvec(w, &x, &mut b);
            assert_eq!(bits(&a), bits(&b), "{name}");
        }
    }

    #[test]
    fn rmsnorm_follows_hf_formula() {
        let x = [1.0f32, -2.0, 3.0, 0.5];
        let w = [1.0f32, 0.5, 2.0, -1.0];
        let mut out = [0f32; 4];
        Kernels::scalar().rmsnorm(&mut out, &x, &w, 1e-6);
        let ms = x.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / 4.0;
        let inv = 1.0 / (ms + 1e-6).sqrt();
        for i in 0..4 {
            let want = f64::from(x[i]) * inv * f64::from(w[i]);
            assert!((f64::from(out[i]) - want).abs() < 1e-6, "{i}");
        }
    }

    #[test]
    fn every_level_is_deterministic_and_par_is_bit_identical() {
        let (rows, cols) = (1536usize, 2048usize);
        assert!(rows * cols >= PAR_MIN_ELEMS);
        let mut rng = Rng::new(99);
        let w = rng.vec(rows * cols);
        let x = rng.vec(cols);
        let (p4, s4) = quantize_q4(&w, rows, cols);
        let (p3, s3) = quantize_q3(&w, rows, cols);
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let qi: Vec<i8> = w.iter().map(|&v| (v * 127.0) as i8).collect();
        let si = vec![0.01f32; rows];
        let mats = [
            MatRef::F32(&w),
            MatRef::Bf16(&wb),
            MatRef::I8Rows { q: &qi, scales: &si },
            MatRef::Q4 { packed: &p4, scales: &s4 },
            MatRef::Q3 { packed: &p3, scales: &s3 },
        ];
        let mut levels = vec![Kernels::scalar()];
        levels.extend(simd_levels("par"));
        for k in levels {
            for m in mats {
                let mut single = vec![0f32; rows];
                k.matvec(m, &x, &mut single);
                let mut again = vec![0f32; rows];
                k.matvec(m, &x, &mut again);
                assert_eq!(single, again, "{} not deterministic", k.level());
                for threads in [1, 2, 3, 8] {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    let mut par = vec![0f32; rows];
                    pool.install(|| k.matvec_par(m, &x, &mut par));
                    let same = single.iter().zip(&par).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{} {m:?}: {threads} threads differ", k.level());
                }
            }
        }
    }

    #[test]
    fn free_functions_use_the_process_level() {
        let k = Kernels::get();
        assert!(k.level().is_supported());
        eprintln!("process kernel level: {}", k.level());
        let w = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut y = [0f32; 2];
        matvec_f32(&w, &[1.0, 0.0, -1.0], &mut y);
        assert_eq!(y, [-2.0, -2.0]);
        assert_eq!(dot(&[1.0, 2.0], &[3.0, 4.0]), 11.0);
    }

    #[test]
    fn level_selection_from_env_value() {
        use Level::*;
        assert_eq!(select_level(None, Avx512), (Avx512, None));
        assert_eq!(select_level(Some(""), Avx2), (Avx2, None));
        assert_eq!(select_level(Some("scalar"), Avx512), (Scalar, None));
        assert_eq!(select_level(Some(" AVX2 "), Avx512), (Avx2, None));
        assert_eq!(select_level(Some("avx512"), Avx512), (Avx512, None));
        let (l, w) = select_level(Some("avx512"), Avx2);
        assert_eq!(l, Avx2);
        assert!(w.unwrap().contains("does not support avx512"));
        let (l, w) = select_level(Some("neon"), Scalar);
        assert_eq!(l, Scalar);
        assert!(w.unwrap().contains("\"neon\""));
        assert!(Kernels::new(Scalar).is_some());
        assert_eq!(Kernels::best().level(), Level::best_supported());
    }

    #[test]
    #[should_panic(expected = "matvec_q4: packed has")]
    fn shape_mismatch_names_the_kernel() {
        let mut y = [0f32; 2];
        Kernels::scalar().matvec_q4(&[0u8; 32], &[0.0; 2], &[0.0; 64], &mut y);
    }

    #[test]
    #[should_panic(expected = "not a multiple of 64")]
    fn q3_needs_whole_groups() {
        let mut y = [0f32; 1];
        Kernels::scalar().matvec_q3(&[], &[], &[0.0; 10], &mut y);
    }
}
