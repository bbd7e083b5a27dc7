//! Expert quantization formats, bit-exact with Picchio (C) and with the `reference_q4.*` oracles.
//!
//! Every format works on a row-major matrix `W [rows, cols]` in `nn.Linear` layout (`rows` = output
//! features, `cols` = input features, the reduction dimension). The quantized formats cut each row into
//! groups of [`GROUP_SIZE`] (64) consecutive weights along `cols` and give each group one `f32` scale;
//! scales are laid out `[rows, cols / 64]`. The source of truth is DESIGN.md ("Converted model
//! directory and expert quantization") and `tests/fixtures/README.md` ("The Q4 scheme"):
//!
//! - **Q4**: `scale = amax / 7` (an `f32` division), `q = clamp(round_half_to_even(w / scale), -8, 7)`
//!   where `w / scale` is a true `f32` division (not a multiplication by `1 / scale`). A group whose
//!   `amax` is 0 has scale 0 and every code 0. The nibble `q + 8` is stored two per byte, element `2i`
//!   in the low nibble and `2i + 1` in the high nibble, row-major `[rows, cols / 2]` bytes.
//! - **Q3**: `scale = amax / 3.5`, `q = clamp(round_half_to_even(w / scale), -4, 3)`, code `c = q + 4`.
//!   A group is 24 bytes: a 16-byte plane of the low 2 bits (element `j` in byte `j >> 2` at bit
//!   `(j & 3) * 2`), then an 8-byte plane of the high bit (bit `j & 7` of byte `16 + (j >> 3)`).
//!   Row-major `[rows, cols / 64 * 24]` bytes.
//! - **none** ([`QuantKind::F32`]): the weights as little-endian `f32`, no scales.
//!
//! Dequantization is `q * scale` in `f32`, element by element. The matrix-vector kernels that read
//! these layouts directly are in [`crate::kernels`].
//!
//! Rounding ties matter: `w / scale` lands exactly on `.5` for 0.33 % of the Qwen3 BF16 expert weights
//! in the fixtures, so [`f32::round_ties_even`] is used (not [`f32::round`], which rounds away from 0).

use std::fmt;
use std::str::FromStr;

/// Weights per quantization group, along `cols` (the input / reduction dimension).
pub const GROUP_SIZE: usize = 64;

/// Bytes of one Q4 group: 64 nibbles.
pub const Q4_GROUP_BYTES: usize = GROUP_SIZE / 2;

/// Bytes of one Q3 group: a 16-byte low-2-bit plane followed by an 8-byte high-bit plane.
pub const Q3_GROUP_BYTES: usize = 24;

/// Offset of the high-bit plane inside a Q3 group, in bytes.
pub const Q3_HIGH_PLANE_OFFSET: usize = 16;

/// Q4 scale divisor: `scale = amax / 7.0`.
pub const Q4_SCALE_DIVISOR: f32 = 7.0;

/// Q3 scale divisor: `scale = amax / 3.5`.
pub const Q3_SCALE_DIVISOR: f32 = 3.5;

/// Errors of the quantization layer (shape and name checks).
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum QuantError {
    /// A quantization name that is not `q4`, `q3` or `none`.
    #[error("unknown quantization {found:?}: expected one of \"q4\", \"q3\", \"none\"")]
    UnknownKind {
        /// The name that was given.
        found: String,
    },
    /// Q4 and Q3 need the input dimension to be a whole number of 64-wide groups.
    #[error(
        "{kind} quantization needs cols (the input dimension) to be a multiple of {GROUP_SIZE}; \
         got a [{rows}, {cols}] matrix (use quantization `none` for this model)"
    )]
    ColsNotMultipleOfGroup {
        /// The requested format.
        kind: QuantKind,
        /// Output rows of the matrix.
        rows: usize,
        /// Input columns of the matrix.
        cols: usize,
    },
    /// `rows * cols` (or its byte size) does not fit in `usize`.
    #[error("a [{rows}, {cols}] matrix is too large for {kind} on this platform")]
    TooLarge {
        /// The requested format.
        kind: QuantKind,
        /// Output rows of the matrix.
        rows: usize,
        /// Input columns of the matrix.
        cols: usize,
    },
    /// A buffer does not have the length the shape implies.
    #[error("{what}: expected {expected} elements for the given shape, found {found}")]
    LengthMismatch {
        /// Which buffer (for example `"q4 packed bytes"`).
        what: &'static str,
        /// The length implied by `[rows, cols]`.
        expected: usize,
        /// The length that was passed.
        found: usize,
    },
}

/// How routed expert weights are stored in a converted model directory.
///
/// Names (for `--quant`, [`FromStr`] and [`fmt::Display`]): `"q4"`, `"q3"`, `"none"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum QuantKind {
    /// 4-bit symmetric groups of 64, one `f32` scale per group (the default).
    #[default]
    Q4,
    /// 3-bit symmetric groups of 64 in 24 bytes, one `f32` scale per group.
    Q3,
    /// Unquantized little-endian `f32` (name `"none"`), for oracle tests against transformers.
    F32,
}

impl QuantKind {
    /// Every format, in the order Q4, Q3, F32.
    pub const ALL: [QuantKind; 3] = [QuantKind::Q4, QuantKind::Q3, QuantKind::F32];

    /// The name used on the command line and in config files: `"q4"`, `"q3"` or `"none"`.
    pub fn name(self) -> &'static str {
        match self {
            QuantKind::Q4 => "q4",
            QuantKind::Q3 => "q3",
            QuantKind::F32 => "none",
        }
    }

    /// Number of `rows * cols`, checking that a quantized format gets whole groups.
    fn elements(self, rows: usize, cols: usize) -> Result<usize, QuantError> {
        if self != QuantKind::F32 && !cols.is_multiple_of(GROUP_SIZE) {
            return Err(QuantError::ColsNotMultipleOfGroup { kind: self, rows, cols });
        }
        rows.checked_mul(cols).ok_or(QuantError::TooLarge { kind: self, rows, cols })
    }

    /// Size in bytes of the packed weights of a `[rows, cols]` matrix.
    ///
    /// Q4: `rows * cols / 2`; Q3: `rows * cols / 64 * 24`; F32: `rows * cols * 4`.
    ///
    /// # Errors
    /// [`QuantError::ColsNotMultipleOfGroup`] when `cols % 64 != 0` for Q4 or Q3;
    /// [`QuantError::TooLarge`] on `usize` overflow.
    pub fn packed_bytes(self, rows: usize, cols: usize) -> Result<usize, QuantError> {
        let n = self.elements(rows, cols)?;
        let bytes = match self {
            QuantKind::Q4 => Some(n / 2),
            QuantKind::Q3 => (n / GROUP_SIZE).checked_mul(Q3_GROUP_BYTES),
            QuantKind::F32 => n.checked_mul(4),
        };
        bytes.ok_or(QuantError::TooLarge { kind: self, rows, cols })
    }

    /// Number of `f32` scales of a `[rows, cols]` matrix: `rows * cols / 64` for Q4 and Q3
    /// (laid out `[rows, cols / 64]`), 0 for F32.
    ///
    /// # Errors
    /// As [`QuantKind::packed_bytes`].
    pub fn scale_count(self, rows: usize, cols: usize) -> Result<usize, QuantError> {
        let n = self.elements(rows, cols)?;
        Ok(match self {
            QuantKind::Q4 | QuantKind::Q3 => n / GROUP_SIZE,
            QuantKind::F32 => 0,
        })
    }

    /// Packed bytes of one row of `cols` weights (`cols` must satisfy the same rule as
    /// [`QuantKind::packed_bytes`]).
    ///
    /// # Errors
    /// As [`QuantKind::packed_bytes`].
    pub fn row_bytes(self, cols: usize) -> Result<usize, QuantError> {
        self.packed_bytes(1, cols)
    }
}

impl fmt::Display for QuantKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for QuantKind {
    type Err = QuantError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        QuantKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| QuantError::UnknownKind { found: s.to_owned() })
    }
}

/// Largest absolute value of a group (`NaN`s are ignored, as by [`f32::max`]).
fn group_amax(w: &[f32]) -> f32 {
    w.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// The code of one weight: `clamp(round_half_to_even(w / scale), lo, hi)`, 0 when `scale == 0`.
#[inline]
fn quantize_value(w: f32, scale: f32, lo: f32, hi: f32) -> i8 {
    if scale == 0.0 {
        return 0;
    }
    // `as i8` maps NaN (from a NaN weight) to 0; finite values are already in [lo, hi].
    round_ties_even_small(w / scale).clamp(lo, hi) as i8
}

/// 1.5 × 2²³: adding it to an f32 of magnitude below 2²² leaves no fraction bits, so the FPU's
/// round-to-nearest-even does the rounding.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `x.round_ties_even()` for the quotients `w / scale` of the quantizers (|x| <= 8 up to rounding),
/// exact for |x| < 2²² and otherwise delegated to the library. On baseline x86-64 (no SSE4.1 `roundss`)
/// `f32::round_ties_even` is a call to libm's `rintf`, which profiled at 39% of `picchio convert`;
/// this is two additions.
#[inline]
fn round_ties_even_small(x: f32) -> f32 {
    if x.abs() < 4_194_304.0 {
        (x + ROUND_MAGIC) - ROUND_MAGIC
    } else {
        x.round_ties_even()
    }
}

/// Checks the common shape contract of the `*_into` functions; returns the number of rows.
fn check_into(
    name: &str,
    w_len: usize,
    cols: usize,
    packed_len: usize,
    group_bytes: usize,
    scales_len: usize,
) -> usize {
    assert!(
        cols > 0 && cols.is_multiple_of(GROUP_SIZE),
        "{name}: cols = {cols} must be a positive multiple of {GROUP_SIZE}"
    );
    assert!(w_len.is_multiple_of(cols), "{name}: {w_len} weights are not a whole number of rows of {cols}");
    let groups = w_len / GROUP_SIZE;
    assert_eq!(packed_len, groups * group_bytes, "{name}: packed buffer length for {w_len} weights");
    assert_eq!(scales_len, groups, "{name}: scales buffer length for {w_len} weights");
    w_len / cols
}

/// Shared body of [`quantize_q4`] and [`quantize_q3`]: allocates the buffers for `w [rows, cols]`
/// in groups of `group_bytes` and fills them with `into` (a `*_into` quantizer).
fn quantize_matrix(
    name: &str,
    w: &[f32],
    (rows, cols): (usize, usize),
    group_bytes: usize,
    into: fn(&[f32], usize, &mut [u8], &mut [f32]),
) -> (Vec<u8>, Vec<f32>) {
    assert_eq!(w.len(), rows * cols, "{name}: w.len() != rows * cols");
    let groups = w.len() / GROUP_SIZE;
    let mut packed = vec![0u8; groups * group_bytes];
    let mut scales = vec![0f32; groups];
    if !w.is_empty() {
        into(w, cols, &mut packed, &mut scales);
    }
    (packed, scales)
}

/// Shared body of the `*_into` quantizers: per group of 64 weights, `scale = amax / divisor`, then
/// `pack(group, scale, out)` writes the group's `B` bytes.
fn quantize_groups_into<const B: usize>(
    name: &str,
    w: &[f32],
    cols: usize,
    (packed, scales): (&mut [u8], &mut [f32]),
    divisor: f32,
    pack: impl Fn(&[f32], f32, &mut [u8; B]),
) {
    check_into(name, w.len(), cols, packed.len(), B, scales.len());
    let groups = w.chunks_exact(GROUP_SIZE).zip(packed.chunks_exact_mut(B)).zip(scales.iter_mut());
    for ((g, out), scale_out) in groups {
        let scale = group_amax(g) / divisor;
        *scale_out = scale;
        pack(g, scale, out.try_into().expect("chunks_exact yields B bytes"));
    }
}

/// Quantizes a row-major `W [rows, cols]` to Q4; returns `(packed [rows, cols / 2] bytes,
/// scales [rows, cols / 64])`.
///
/// # Panics
/// When `cols` is not a positive multiple of 64 or `w.len() != rows * cols`. Check the shape first
/// with [`QuantKind::packed_bytes`] (or use [`quantize`]) to get a typed error instead.
pub fn quantize_q4(w: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    quantize_matrix("quantize_q4", w, (rows, cols), Q4_GROUP_BYTES, quantize_q4_into)
}

/// Quantizes whole rows of `cols` weights to Q4 into caller-provided buffers (any number of rows, so a
/// converter can split a matrix across threads): `packed.len() == w.len() / 2`,
/// `scales.len() == w.len() / 64`.
///
/// # Panics
/// When `cols` is not a positive multiple of 64, `w` is not whole rows, or a buffer has the wrong length.
pub fn quantize_q4_into(w: &[f32], cols: usize, packed: &mut [u8], scales: &mut [f32]) {
    let pack = |g: &[f32], scale: f32, out: &mut [u8; Q4_GROUP_BYTES]| {
        for (pair, byte) in g.chunks_exact(2).zip(out.iter_mut()) {
            let lo = (quantize_value(pair[0], scale, -8.0, 7.0) + 8) as u8;
            let hi = (quantize_value(pair[1], scale, -8.0, 7.0) + 8) as u8;
            *byte = lo | (hi << 4);
        }
    };
    quantize_groups_into("quantize_q4_into", w, cols, (packed, scales), Q4_SCALE_DIVISOR, pack);
}

/// Quantizes a row-major `W [rows, cols]` to Q3; returns `(packed [rows, cols / 64 * 24] bytes,
/// scales [rows, cols / 64])`.
///
/// # Panics
/// As [`quantize_q4`].
pub fn quantize_q3(w: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    quantize_matrix("quantize_q3", w, (rows, cols), Q3_GROUP_BYTES, quantize_q3_into)
}

/// Quantizes whole rows of `cols` weights to Q3 into caller-provided buffers:
/// `packed.len() == w.len() / 64 * 24`, `scales.len() == w.len() / 64`.
///
/// # Panics
/// As [`quantize_q4_into`].
pub fn quantize_q3_into(w: &[f32], cols: usize, packed: &mut [u8], scales: &mut [f32]) {
    let pack = |g: &[f32], scale: f32, out: &mut [u8; Q3_GROUP_BYTES]| {
        out.fill(0);
        for (j, &v) in g.iter().enumerate() {
            let c = (quantize_value(v, scale, -4.0, 3.0) + 4) as u8;
            out[j >> 2] |= (c & 3) << ((j & 3) * 2);
            out[Q3_HIGH_PLANE_OFFSET + (j >> 3)] |= (c >> 2) << (j & 7);
        }
    };
    quantize_groups_into("quantize_q3_into", w, cols, (packed, scales), Q3_SCALE_DIVISOR, pack);
}

/// The 64 signed codes (`q`, in `-8..=7`) of one 32-byte Q4 group.
#[inline]
pub fn q4_group_codes(group: &[u8; Q4_GROUP_BYTES]) -> [i8; GROUP_SIZE] {
    let mut q = [0i8; GROUP_SIZE];
    for (i, &b) in group.iter().enumerate() {
        q[2 * i] = (b & 0x0f) as i8 - 8;
        q[2 * i + 1] = (b >> 4) as i8 - 8;
    }
    q
}

/// The 64 signed codes (`q`, in `-4..=3`) of one 24-byte Q3 group.
#[inline]
pub fn q3_group_codes(group: &[u8; Q3_GROUP_BYTES]) -> [i8; GROUP_SIZE] {
    let mut q = [0i8; GROUP_SIZE];
    for (j, out) in q.iter_mut().enumerate() {
        let lo = (group[j >> 2] >> ((j & 3) * 2)) & 3;
        let hi = (group[Q3_HIGH_PLANE_OFFSET + (j >> 3)] >> (j & 7)) & 1;
        *out = (lo | (hi << 2)) as i8 - 4;
    }
    q
}

/// Shared body of the dequantizers: `out[j] = q[j] * scale[group(j)]` in `f32`.
fn dequantize_into<const B: usize>(
    name: &str,
    packed: &[u8],
    scales: &[f32],
    cols: usize,
    out: &mut [f32],
    codes: fn(&[u8; B]) -> [i8; GROUP_SIZE],
) {
    check_into(name, out.len(), cols, packed.len(), B, scales.len());
    let groups = packed.chunks_exact(B).zip(scales).zip(out.chunks_exact_mut(GROUP_SIZE));
    for ((g, &scale), o) in groups {
        let g: &[u8; B] = g.try_into().expect("chunks_exact yields B bytes");
        for (v, q) in o.iter_mut().zip(codes(g)) {
            *v = f32::from(q) * scale;
        }
    }
}

/// Shared body of [`dequantize_q4`] and [`dequantize_q3`]: a `[rows, cols]` output filled by `into`.
fn dequantize_matrix(
    packed: &[u8],
    scales: &[f32],
    (rows, cols): (usize, usize),
    into: fn(&[u8], &[f32], usize, &mut [f32]),
) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    if !out.is_empty() {
        into(packed, scales, cols, &mut out);
    }
    out
}

/// Dequantizes a Q4 matrix (`packed [rows, cols / 2]`, `scales [rows, cols / 64]`) to a row-major
/// `f32 [rows, cols]`. Reference path (tests, `picchio verify`); the model uses [`crate::kernels`].
///
/// # Panics
/// When `cols` is not a positive multiple of 64 or a buffer does not match `[rows, cols]`.
pub fn dequantize_q4(packed: &[u8], scales: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    dequantize_matrix(packed, scales, (rows, cols), dequantize_q4_into)
}

/// Dequantizes whole Q4 rows into `out` (`out.len()` weights, `cols` per row).
///
/// # Panics
/// As [`quantize_q4_into`].
pub fn dequantize_q4_into(packed: &[u8], scales: &[f32], cols: usize, out: &mut [f32]) {
    dequantize_into("dequantize_q4_into", packed, scales, cols, out, q4_group_codes);
}

/// Dequantizes a Q3 matrix (`packed [rows, cols / 64 * 24]`, `scales [rows, cols / 64]`) to a
/// row-major `f32 [rows, cols]`. Reference path (tests, `picchio verify`).
///
/// # Panics
/// As [`dequantize_q4`].
pub fn dequantize_q3(packed: &[u8], scales: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    dequantize_matrix(packed, scales, (rows, cols), dequantize_q3_into)
}

/// Dequantizes whole Q3 rows into `out` (`out.len()` weights, `cols` per row).
///
/// # Panics
/// As [`quantize_q4_into`].
pub fn dequantize_q3_into(packed: &[u8], scales: &[f32], cols: usize, out: &mut [f32]) {
    dequantize_into("dequantize_q3_into", packed, scales, cols, out, q3_group_codes);
}

/// Checks a buffer length against the shape.
fn check_len(what: &'static str, expected: usize, found: usize) -> Result<(), QuantError> {
    if expected == found {
        Ok(())
    } else {
        Err(QuantError::LengthMismatch { what, expected, found })
    }
}

/// Quantizes a row-major `W [rows, cols]` in the given format, with typed shape errors. For
/// [`QuantKind::F32`] the packed bytes are the weights as little-endian `f32` and there are no scales.
///
/// # Errors
/// [`QuantError::ColsNotMultipleOfGroup`], [`QuantError::TooLarge`], or
/// [`QuantError::LengthMismatch`] when `w.len() != rows * cols`.
pub fn quantize(kind: QuantKind, w: &[f32], rows: usize, cols: usize) -> Result<(Vec<u8>, Vec<f32>), QuantError> {
    kind.packed_bytes(rows, cols)?;
    check_len("weights", rows * cols, w.len())?;
    Ok(match kind {
        QuantKind::Q4 => quantize_q4(w, rows, cols),
        QuantKind::Q3 => quantize_q3(w, rows, cols),
        QuantKind::F32 => (w.iter().flat_map(|v| v.to_le_bytes()).collect(), Vec::new()),
    })
}

/// Dequantizes `packed` + `scales` of a `[rows, cols]` matrix in the given format to row-major `f32`.
///
/// # Errors
/// As [`quantize`], with [`QuantError::LengthMismatch`] naming the packed or scale buffer.
pub fn dequantize(
    kind: QuantKind,
    packed: &[u8],
    scales: &[f32],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, QuantError> {
    let what = match kind {
        QuantKind::Q4 => "q4 packed bytes",
        QuantKind::Q3 => "q3 packed bytes",
        QuantKind::F32 => "f32 weight bytes",
    };
    check_len(what, kind.packed_bytes(rows, cols)?, packed.len())?;
    check_len("scales", kind.scale_count(rows, cols)?, scales.len())?;
    Ok(match kind {
        QuantKind::Q4 => dequantize_q4(packed, scales, rows, cols),
        QuantKind::Q3 => dequantize_q3(packed, scales, rows, cols),
        QuantKind::F32 => packed.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
    })
}

#[cfg(test)]
mod round_tests {
    use super::round_ties_even_small;

    #[test]
    fn magic_rounding_equals_round_ties_even() {
        // Every multiple of 1/64 in [-16, 16] (all .5 ties included) and a dense sweep of odd values.
        for i in -1024..=1024 {
            let x = i as f32 / 64.0;
            // Equal as values (-0.5 gives +0.0 here and -0.0 from the library; both code 0).
            assert_eq!(round_ties_even_small(x), x.round_ties_even(), "{x}");
        }
        let mut x = -9.0f32;
        while x < 9.0 {
            assert_eq!(round_ties_even_small(x), x.round_ties_even(), "{x}");
            x = x.next_up().max(x + 1e-4);
        }
        for x in [4_194_303.5f32, 1e9, -1e9, f32::INFINITY] {
            assert_eq!(round_ties_even_small(x), x.round_ties_even(), "{x}");
        }
        assert!(round_ties_even_small(f32::NAN).is_nan());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use safetensors::{Dtype, SafeTensors};
    use std::path::PathBuf;

    // ---------------------------------------------------------------- f64 reference implementation
    //
    // Written independently of the code above: codes from an f64 division, packing by explicit bit
    // positions (one bit at a time), dequantization as an exact f64 product.

    /// Reference format parameters: (scale divisor, lowest code, highest code, bits per code).
    fn params(kind: QuantKind) -> (f64, f64, f64) {
        match kind {
            QuantKind::Q4 => (7.0, -8.0, 7.0),
            QuantKind::Q3 => (3.5, -4.0, 3.0),
            QuantKind::F32 => unreachable!(),
        }
    }

    /// Returns (codes [rows*cols], scales [rows*cols/64]); the scale is the f32 nearest to amax/div.
    fn ref_quantize(kind: QuantKind, w: &[f32]) -> (Vec<i8>, Vec<f32>) {
        let (div, lo, hi) = params(kind);
        let mut codes = Vec::with_capacity(w.len());
        let mut scales = Vec::new();
        for g in w.chunks(64) {
            let amax = g.iter().map(|v| f64::from(v.abs())).fold(0.0, f64::max);
            let scale = (amax / div) as f32;
            scales.push(scale);
            for &v in g {
                let q =
                    if scale == 0.0 { 0.0 } else { (f64::from(v) / f64::from(scale)).round_ties_even().clamp(lo, hi) };
                codes.push(q as i8);
            }
        }
        (codes, scales)
    }

    fn set_bit(buf: &mut [u8], bit: usize, on: bool) {
        if on {
            buf[bit / 8] |= 1 << (bit % 8);
        }
    }

    /// Packs codes bit by bit following DESIGN.md's wording.
    fn ref_pack(kind: QuantKind, codes: &[i8]) -> Vec<u8> {
        match kind {
            QuantKind::Q4 => {
                let mut out = vec![0u8; codes.len() / 2];
                for (e, &q) in codes.iter().enumerate() {
                    let nib = (i32::from(q) + 8) as u32;
                    // element 2i in the low nibble of byte i, element 2i+1 in the high nibble
                    for b in 0..4 {
                        set_bit(&mut out, e * 4 + b, (nib >> b) & 1 == 1);
                    }
                }
                out
            }
            QuantKind::Q3 => {
                let mut out = vec![0u8; codes.len() / 64 * 24];
                for (e, &q) in codes.iter().enumerate() {
                    let (g, j) = (e / 64, e % 64);
                    let c = (i32::from(q) + 4) as u32;
                    let base = g * 24 * 8;
                    // low plane: byte j>>2, bit (j&3)*2 -> bit index j*2 within the plane
                    set_bit(&mut out, base + (j >> 2) * 8 + (j & 3) * 2, c & 1 == 1);
                    set_bit(&mut out, base + (j >> 2) * 8 + (j & 3) * 2 + 1, c & 2 == 2);
                    // high plane at byte 16: bit j&7 of byte j>>3
                    set_bit(&mut out, base + (16 + (j >> 3)) * 8 + (j & 7), c & 4 == 4);
                }
                out
            }
            QuantKind::F32 => unreachable!(),
        }
    }

    /// A ratio `w / scale` this close to a half-integer may round differently in f32 and f64.
    fn near_tie(w: f32, scale: f32) -> bool {
        let r = f64::from(w) / f64::from(scale);
        let frac = r - r.floor();
        (frac - 0.5).abs() <= 1e-6 * r.abs().max(1.0)
    }

    /// Deterministic pseudo-random weights ([`SplitMix64`](picchio_core::rng::SplitMix64) in
    /// [-1, 1)), some groups scaled very differently, one zero group, one group with exact ties.
    fn sample_weights(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut g = picchio_core::rng::SplitMix64::new(seed);
        let mut next = move || g.next_signed_f32();
        let mut w: Vec<f32> = (0..rows * cols).map(|_| next()).collect();
        for (g, grp) in w.chunks_mut(64).enumerate() {
            let mag = [1.0f32, 1e-3, 37.5, 1e-30][g % 4];
            grp.iter_mut().for_each(|v| *v *= mag);
        }
        if rows * cols >= 192 {
            w[64..128].fill(0.0);
            // amax 7 -> scale 1 exactly: ratios are exact, with .5 ties both ways
            let ties = [7.0f32, -7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5];
            w[128..128 + ties.len()].copy_from_slice(&ties);
            w[128 + ties.len()..192].fill(0.25);
        }
        w
    }

    fn check_against_reference(kind: QuantKind, rows: usize, cols: usize, seed: u64) {
        let w = sample_weights(rows, cols, seed);
        let (packed, scales) = quantize(kind, &w, rows, cols).unwrap();
        let (ref_codes, ref_scales) = ref_quantize(kind, &w);
        assert_eq!(packed.len(), kind.packed_bytes(rows, cols).unwrap());
        assert_eq!(scales.len(), kind.scale_count(rows, cols).unwrap());
        for (s, r) in scales.iter().zip(&ref_scales) {
            assert_eq!(s.to_bits(), r.to_bits(), "{kind} scale");
        }
        // our codes, decoded with the reference understanding of the layout
        let deq = dequantize(kind, &packed, &scales, rows, cols).unwrap();
        let mut codes = ref_codes.clone();
        let mut differing = 0;
        for e in 0..w.len() {
            let scale = scales[e / 64];
            let q = if scale == 0.0 { 0 } else { (f64::from(deq[e]) / f64::from(scale)).round() as i8 };
            if q != ref_codes[e] {
                assert!(
                    near_tie(w[e], scale) && (i32::from(q) - i32::from(ref_codes[e])).abs() == 1,
                    "{kind} element {e}: w {} scale {scale} code {q} vs f64 reference {}",
                    w[e],
                    ref_codes[e]
                );
                differing += 1;
            }
            codes[e] = q;
            // dequantization is one f32 rounding of the exact product
            let exact = (f64::from(q) * f64::from(scale)) as f32;
            assert_eq!(deq[e].to_bits(), exact.to_bits(), "{kind} dequant {e}");
        }
        // Q3's ratio at w = -amax is -3.5 up to one rounding, so one near tie per group is expected
        assert!(differing <= w.len() / 64 + w.len() / 1000, "{differing} near-tie differences");
        assert_eq!(packed, ref_pack(kind, &codes), "{kind} packing");
    }

    #[test]
    fn q4_matches_f64_reference() {
        for (rows, cols, seed) in [(1, 64, 1), (3, 128, 2), (7, 2048, 3), (16, 768, 4)] {
            check_against_reference(QuantKind::Q4, rows, cols, seed);
        }
    }

    #[test]
    fn q3_matches_f64_reference() {
        for (rows, cols, seed) in [(1, 64, 5), (3, 128, 6), (7, 2048, 7), (16, 768, 8)] {
            check_against_reference(QuantKind::Q3, rows, cols, seed);
        }
    }

    #[test]
    fn ties_round_half_to_even() {
        // amax 7 (Q4) and 3.5 (Q3) give scale 1, so w / scale is exact
        let mut w = vec![0f32; 64];
        w[..8].copy_from_slice(&[7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -6.5]);
        let (p, s) = quantize_q4(&w, 1, 64);
        assert_eq!(s, vec![1.0]);
        let q = q4_group_codes(p[..32].try_into().unwrap());
        assert_eq!(&q[..8], &[7, 0, 2, 2, 0, -2, -2, -6]);

        w[..8].copy_from_slice(&[3.5, -3.5, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5]);
        let (p, s) = quantize_q3(&w, 1, 64);
        assert_eq!(s, vec![1.0]);
        let q = q3_group_codes(p[..24].try_into().unwrap());
        // 3.5 rounds to 4 and clamps to 3; -3.5 rounds to -4
        assert_eq!(&q[..8], &[3, -4, 0, 2, 2, 0, -2, -2]);
    }

    #[test]
    fn zero_group_has_zero_scale_and_zero_codes() {
        let w = vec![0f32; 128];
        let (p4, s4) = quantize_q4(&w, 2, 64);
        assert!(s4.iter().all(|&s| s == 0.0));
        assert!(p4.iter().all(|&b| b == 0x88), "nibble 8 means q = 0");
        let (p3, s3) = quantize_q3(&w, 1, 128);
        assert!(s3.iter().all(|&s| s == 0.0));
        // code 4 = 0b100: low plane all 0, high plane all 1
        for g in p3.chunks(24) {
            assert!(g[..16].iter().all(|&b| b == 0));
            assert!(g[16..].iter().all(|&b| b == 0xff));
        }
        assert!(dequantize_q3(&p3, &s3, 1, 128).iter().all(|&v| v == 0.0));
    }

    #[test]
    fn sizes_and_names() {
        assert_eq!(QuantKind::Q4.packed_bytes(1536, 2048), Ok(1536 * 1024));
        assert_eq!(QuantKind::Q4.scale_count(1536, 2048), Ok(1536 * 32));
        assert_eq!(QuantKind::Q3.packed_bytes(2048, 768), Ok(2048 * 12 * 24));
        assert_eq!(QuantKind::Q3.scale_count(2048, 768), Ok(2048 * 12));
        assert_eq!(QuantKind::F32.packed_bytes(3, 5), Ok(60));
        assert_eq!(QuantKind::F32.scale_count(3, 5), Ok(0));
        // a Qwen3-30B-A3B expert in Q4: gate_up [1536, 2048] + down [2048, 768], bytes + f32 scales
        let q4 = QuantKind::Q4;
        let expert = q4.packed_bytes(1536, 2048).unwrap()
            + 4 * q4.scale_count(1536, 2048).unwrap()
            + q4.packed_bytes(2048, 768).unwrap()
            + 4 * q4.scale_count(2048, 768).unwrap();
        assert_eq!(expert, 2_654_208);
        assert_eq!(expert, 648 * 4096);

        let err = QuantKind::Q3.packed_bytes(4, 100).unwrap_err();
        assert_eq!(err, QuantError::ColsNotMultipleOfGroup { kind: QuantKind::Q3, rows: 4, cols: 100 });
        assert!(err.to_string().contains("q3") && err.to_string().contains("[4, 100]"));
        assert!(matches!(QuantKind::Q4.packed_bytes(usize::MAX, 128), Err(QuantError::TooLarge { .. })));

        for k in QuantKind::ALL {
            assert_eq!(k.to_string().parse::<QuantKind>(), Ok(k));
        }
        assert_eq!("none".parse(), Ok(QuantKind::F32));
        let e = "q8".parse::<QuantKind>().unwrap_err();
        assert!(e.to_string().contains("\"q8\""), "{e}");
    }

    #[test]
    fn f32_kind_round_trips_bytes() {
        let w = [1.5f32, -0.0, f32::MIN_POSITIVE, 3e38];
        let (p, s) = quantize(QuantKind::F32, &w, 2, 2).unwrap();
        assert!(s.is_empty());
        assert_eq!(&p[..4], &1.5f32.to_le_bytes());
        assert_eq!(dequantize(QuantKind::F32, &p, &s, 2, 2).unwrap(), w);
        assert!(matches!(
            dequantize(QuantKind::Q4, &p, &s, 2, 64),
            Err(QuantError::LengthMismatch { what: "q4 packed bytes", expected: 64, found: 16 })
        ));
    }

    // ---------------------------------------------------------------- fixtures (bit-exact oracle)

    fn f32s(view: &safetensors::tensor::TensorView<'_>) -> Vec<f32> {
        assert_eq!(view.dtype(), Dtype::F32);
        let d = view.data();
        d.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    }

    /// Quantizes every `q4_sample.*.weight` of a reference_q4.safetensors and compares codes and
    /// scales bit for bit; returns how many matrices were checked.
    fn check_fixture(folder: &str) -> usize {
        let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), "..", "tests", "fixtures", folder, "reference_q4.safetensors"]
            .iter()
            .collect();
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut names: Vec<&str> =
            st.names().into_iter().filter(|n| n.starts_with("q4_sample.layers.") && n.ends_with(".weight")).collect();
        names.sort_unstable();
        let mut checked = 0;
        for name in names {
            let stem = name.strip_suffix(".weight").unwrap();
            let w_view = st.tensor(name).unwrap();
            let (rows, cols) = match w_view.shape() {
                [r, c] => (*r, *c),
                s => panic!("{name}: shape {s:?}"),
            };
            let w = f32s(&w_view);
            let q_view = st.tensor(&format!("{stem}.q")).unwrap();
            assert_eq!(q_view.dtype(), Dtype::I8);
            assert_eq!(q_view.shape(), &[rows, cols]);
            let q_ref: Vec<i8> = q_view.data().iter().map(|&b| b as i8).collect();
            let s_view = st.tensor(&format!("{stem}.scale")).unwrap();
            assert_eq!(s_view.shape(), &[rows, cols / 64], "{stem}.scale layout");
            let s_ref = f32s(&s_view);

            let (packed, scales) = quantize_q4(&w, rows, cols);
            assert_eq!(scales.len(), s_ref.len());
            for (i, (a, b)) in scales.iter().zip(&s_ref).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{stem}: scale {i}: {a} vs {b}");
            }
            let codes: Vec<i8> =
                packed.chunks_exact(Q4_GROUP_BYTES).flat_map(|g| q4_group_codes(g.try_into().unwrap())).collect();
            for (i, (a, b)) in codes.iter().zip(&q_ref).enumerate() {
                assert_eq!(a, b, "{stem}: code at [{}, {}] (w = {})", i / cols, i % cols, w[i]);
            }
            assert_eq!(packed, ref_pack(QuantKind::Q4, &q_ref), "{stem}: packing");
            // W' = q * scale (f32) is what the oracle model ran with
            let deq = dequantize_q4(&packed, &scales, rows, cols);
            for (i, v) in deq.iter().enumerate() {
                let want = f32::from(q_ref[i]) * s_ref[i / 64];
                assert_eq!(v.to_bits(), want.to_bits(), "{stem}: dequant {i}");
            }
            checked += 1;
        }
        checked
    }

    #[test]
    fn q4_bit_exact_against_qwen3_moe_fixture() {
        assert_eq!(check_fixture("qwen3_moe"), 3, "gate, up and down of one expert");
    }

    #[test]
    fn q4_bit_exact_against_qwen3_moe_wide_fixture() {
        // two groups per row (hidden 128, moe_intermediate 128): catches a [in/64, out] scale layout
        assert_eq!(check_fixture("qwen3_moe_wide"), 3);
    }

    // ---------------------------------------------------------------- properties

    fn matrix() -> impl Strategy<Value = (usize, usize, Vec<f32>)> {
        (1usize..4, 1usize..4).prop_flat_map(|(rows, groups)| {
            let cols = groups * 64;
            let w = prop::collection::vec(
                prop_oneof![
                    4 => -1.0e3f32..1.0e3,
                    4 => -1.0f32..1.0,
                    1 => Just(0.0f32),
                ],
                rows * cols,
            );
            (Just(rows), Just(cols), w)
        })
    }

    fn check_error_bound(kind: QuantKind, rows: usize, cols: usize, w: &[f32]) {
        let (packed, scales) = quantize(kind, w, rows, cols).unwrap();
        let deq = dequantize(kind, &packed, &scales, rows, cols).unwrap();
        for (i, (&a, &b)) in w.iter().zip(&deq).enumerate() {
            let scale = scales[i / 64];
            // |w - q*scale| <= scale/2, plus the two f32 roundings (w/scale and q*scale)
            let bound = scale * 0.5 + (a.abs() + scale) * 4.0 * f32::EPSILON;
            assert!((a - b).abs() <= bound, "{kind} element {i}: w {a}, dequant {b}, scale {scale}");
        }
    }

    proptest! {
        #[test]
        fn q4_dequant_error_at_most_half_scale((rows, cols, w) in matrix()) {
            check_error_bound(QuantKind::Q4, rows, cols, &w);
        }

        #[test]
        fn q3_dequant_error_at_most_half_scale((rows, cols, w) in matrix()) {
            check_error_bound(QuantKind::Q3, rows, cols, &w);
        }

        #[test]
        fn into_variants_split_by_rows((rows, cols, w) in matrix()) {
            // quantizing row by row gives the same bytes as the whole matrix
            let (p, s) = quantize_q4(&w, rows, cols);
            for r in 0..rows {
                let mut pr = vec![0u8; cols / 2];
                let mut sr = vec![0f32; cols / 64];
                quantize_q4_into(&w[r * cols..(r + 1) * cols], cols, &mut pr, &mut sr);
                prop_assert_eq!(&pr[..], &p[r * cols / 2..(r + 1) * cols / 2]);
                prop_assert_eq!(&sr[..], &s[r * cols / 64..(r + 1) * cols / 64]);
            }
        }
    }
}
