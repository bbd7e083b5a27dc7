//! ggml's activation quantization: the Q8_0, Q8_1 and Q8_K blocks its CPU backend turns a matmul's
//! f32 input into (`from_float` of the weight type's `vec_dot_type`, `type_traits_cpu` in
//! `ggml-cpu.c`) before the integer dot products of [`super::dot`]. Every block's bytes equal
//! ggml's (test `picchio-tests` `ggml_dot::activation_quantization_equals_ggml_byte_for_byte`).
//!
//! Q8_0 and Q8_1 have two arithmetics in ggml, chosen at build time; [`Q8Arith`] names both. Q8_K
//! has one on x86 and in the generic build: `quantize_row_q8_K_ref`.
//!
//! Block layouts (`ggml-common.h`), little-endian:
//! - Q8_0, 34 bytes: f16 `d`, 32 × i8 `qs`; value ≈ `d · q`.
//! - Q8_1, 36 bytes: f16 `d`, f16 `s` = `d · Σ q`, 32 × i8 `qs`. (gguf-py's `GGML_QUANT_SIZES` still says
//!   40, the layout of when `d` and `s` were f32; [`GgmlType::block_bytes`] follows ggml.)
//! - Q8_K, 292 bytes: f32 `d`, 256 × i8 `qs`, 16 × i16 `bsums` (the sum of each 16 `qs`).

use super::dot::DotError;
use picchio_core::format::gguf::GgmlType;

/// Bytes of a Q8_0 block (32 values).
pub const Q8_0_BYTES: usize = 34;
/// Bytes of a Q8_1 block (32 values), as ggml lays it out; see the module doc on gguf-py's 40.
pub const Q8_1_BYTES: usize = 36;
/// Bytes of a Q8_K block (256 values).
pub const Q8_K_BYTES: usize = 292;

/// Which of ggml's Q8_0/Q8_1 quantizers to follow: they round differently, so a value exactly
/// between two codes (and, rarely, one next to it) gets another code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Q8Arith {
    /// `quantize_row_q8_0_ref` / `quantize_row_q8_1_ref` (`ggml-quants.c`): `d = amax / 127`,
    /// `id = 1 / d`, `q = roundf(x · id)` (ties away from zero). What ggml-cpu calls when built
    /// without AVX (`GGML_CPU_GENERIC`, or the `x64` variant of a multi-variant x86 build).
    Reference,
    /// `quantize_row_q8_0` / `quantize_row_q8_1` of `ggml-cpu/arch/x86/quants.c` under `__AVX__` or
    /// `__AVX2__`: `d = amax / 127`, `id = 127 / amax`, `q = _mm256_round_ps(x · id,
    /// _MM_ROUND_NEAREST)` (ties to even). What llama.cpp calls on any x86 CPU with AVX, which
    /// includes this project's machines.
    X86Avx,
}

/// The f32 rounded to the nearest f16 (ties to even), as `GGML_FP32_TO_FP16` and F16C's
/// `_cvtss_sh(x, 0)` do for every non-NaN value.
fn f16_bits(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

/// The largest `|x|` of a block (ggml's `MAX(amax, fabsf(v))` from 0; for non-NaN input every
/// order of the maximum gives the same value).
fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// One Q8_0/Q8_1 block's codes into `qs` (32 bytes); returns `d` as f32 and `Σ q`.
fn q8_codes(arith: Q8Arith, x: &[f32], qs: &mut [u8]) -> (f32, i32) {
    let amax = amax(x);
    let d = amax / 127.0;
    let mut sum = 0;
    for (q, &v) in qs.iter_mut().zip(x) {
        let c = match arith {
            Q8Arith::Reference => {
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                // C's `(int8_t)roundf(x0)`; |x0| ≤ 127.5 never holds more.
                (v * id).round() as i8
            }
            Q8Arith::X86Avx => {
                let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                // `_mm256_cvtps_epi32` of an integral value, then the saturating packs.
                (v * id).round_ties_even().clamp(-128.0, 127.0) as i8
            }
        };
        *q = c as u8;
        sum += i32::from(c);
    }
    (d, sum)
}

/// Checks `x` is whole blocks of `block_elems` and `out` holds exactly their `block_bytes` blocks.
fn check(ty: GgmlType, x: &[f32], out: &[u8], block_elems: usize, block_bytes: usize) -> Result<(), DotError> {
    if !x.len().is_multiple_of(block_elems) {
        return Err(DotError::PartialActivation { ty, values: x.len(), block_elems });
    }
    let expected = x.len() / block_elems * block_bytes;
    if out.len() != expected {
        return Err(DotError::ActivationLen { ty, values: x.len(), expected, found: out.len() });
    }
    Ok(())
}

/// Q8_0 or (`ty` = Q8_1, with `s`) Q8_1 blocks of `x` into `out`.
fn quantize_32(ty: GgmlType, arith: Q8Arith, x: &[f32], out: &mut [u8]) -> Result<(), DotError> {
    let block = if ty == GgmlType::Q8_1 { Q8_1_BYTES } else { Q8_0_BYTES };
    check(ty, x, out, 32, block)?;
    for (x, b) in x.chunks_exact(32).zip(out.chunks_exact_mut(block)) {
        let (d, sum) = q8_codes(arith, x, &mut b[block - 32..]);
        b[..2].copy_from_slice(&f16_bits(d).to_le_bytes());
        if ty == GgmlType::Q8_1 {
            b[2..4].copy_from_slice(&f16_bits(sum as f32 * d).to_le_bytes());
        }
    }
    Ok(())
}

/// Quantizes `x` (a multiple of 32 values) to Q8_0 blocks in `out` (34 bytes per 32 values).
///
/// # Errors
/// [`DotError::PartialActivation`] when `x.len()` is not a multiple of 32;
/// [`DotError::ActivationLen`] when `out` is not `x.len() / 32 · 34` bytes.
pub fn quantize_q8_0(arith: Q8Arith, x: &[f32], out: &mut [u8]) -> Result<(), DotError> {
    quantize_32(GgmlType::Q8_0, arith, x, out)
}

/// Quantizes `x` (a multiple of 32 values) to Q8_1 blocks in `out` (36 bytes per 32 values); `s`
/// is `f16(Σq · d)` in both arithmetics (the AVX2 code's `d · hsum` is the same product).
///
/// # Errors
/// As [`quantize_q8_0`], with 36-byte blocks.
pub fn quantize_q8_1(arith: Q8Arith, x: &[f32], out: &mut [u8]) -> Result<(), DotError> {
    quantize_32(GgmlType::Q8_1, arith, x, out)
}

/// ggml's `nearest_int`: rounds by adding 1.5 · 2^23 and reading the mantissa (ties to even, for
/// |v| ≤ 4194303, which ggml asserts).
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// Quantizes `x` (a multiple of 256 values) to Q8_K blocks in `out` (292 bytes per 256 values),
/// following `quantize_row_q8_K_ref`: `max` is the first value of the largest magnitude,
/// `iscale = −127 / max`, `q = min(127, nearest_int(iscale · x))`, `d = 1 / iscale` (so `d` has
/// the opposite sign of `max`). An all-zero block gets `d = 0` and zero codes; ggml leaves its
/// `bsums` unwritten (whatever the buffer held), we write zeros.
///
/// # Errors
/// As [`quantize_q8_0`], with 256 values per 292-byte block.
pub fn quantize_q8_k(x: &[f32], out: &mut [u8]) -> Result<(), DotError> {
    check(GgmlType::Q8_K, x, out, 256, Q8_K_BYTES)?;
    for (x, b) in x.chunks_exact(256).zip(out.chunks_exact_mut(Q8_K_BYTES)) {
        let (mut max, mut amax) = (0.0f32, 0.0f32);
        for &v in x {
            if v.abs() > amax {
                (amax, max) = (v.abs(), v);
            }
        }
        b.fill(0);
        if amax == 0.0 {
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in b[4..260].iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8 as u8;
        }
        for j in 0..16 {
            let sum: i32 = b[4 + 16 * j..4 + 16 * (j + 1)].iter().map(|&q| i32::from(q as i8)).sum();
            b[260 + 2 * j..262 + 2 * j].copy_from_slice(&(sum as i16).to_le_bytes());
        }
        b[..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
    Ok(())
}

/// Quantizes `x` to blocks of the activation type `ty` (Q8_0, Q8_1 or Q8_K, a weight type's
/// [`super::dot::vec_dot_type`]) in `out`, of [`activation_bytes`]`(ty, x.len())` bytes; `arith`
/// matters for Q8_0 and Q8_1 only.
///
/// # Errors
/// [`DotError::Unsupported`] for another `ty`; otherwise as [`quantize_q8_0`].
pub fn quantize_activation(ty: GgmlType, arith: Q8Arith, x: &[f32], out: &mut [u8]) -> Result<(), DotError> {
    match ty {
        GgmlType::Q8_0 => quantize_q8_0(arith, x, out),
        GgmlType::Q8_1 => quantize_q8_1(arith, x, out),
        GgmlType::Q8_K => quantize_q8_k(x, out),
        _ => Err(DotError::Unsupported { ty }),
    }
}

/// `(values per block, bytes per block)` of an activation type (Q8_0, Q8_1, Q8_K), else `None`.
pub fn activation_block(ty: GgmlType) -> Option<(usize, usize)> {
    match ty {
        GgmlType::Q8_0 => Some((32, Q8_0_BYTES)),
        GgmlType::Q8_1 => Some((32, Q8_1_BYTES)),
        GgmlType::Q8_K => Some((256, Q8_K_BYTES)),
        _ => None,
    }
}

/// Bytes of `n` values quantized to the activation type `ty`; `None` for another type or a partial
/// block.
pub fn activation_bytes(ty: GgmlType, n: usize) -> Option<usize> {
    let (elems, bytes) = activation_block(ty)?;
    n.is_multiple_of(elems).then_some(n / elems * bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        for (v, want) in [(2.5, 2), (3.5, 4), (-2.5, -2), (-0.5, 0), (126.6, 127), (-127.0, -127), (0.49, 0)] {
            assert_eq!(nearest_int(v), want, "{v}");
        }
        for i in -1000..1000 {
            let v = i as f32 * 0.173;
            assert_eq!(nearest_int(v), v.round_ties_even() as i32, "{v}");
        }
    }

    /// d = 1 (amax 127): the two arithmetics differ exactly on the ties.
    #[test]
    fn the_arithmetics_differ_on_ties() {
        let mut x = [0.0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -3.5;
        x[3] = 1.25;
        let (mut r, mut a) = ([0u8; 34], [0u8; 34]);
        quantize_q8_0(Q8Arith::Reference, &x, &mut r).unwrap();
        quantize_q8_0(Q8Arith::X86Avx, &x, &mut a).unwrap();
        assert_eq!(u16::from_le_bytes([r[0], r[1]]), 0x3c00, "d = 1.0");
        assert_eq!(r[..2], a[..2]);
        assert_eq!([r[2], r[3], r[4], r[5]], [127, 3, (-4i8) as u8, 1]);
        assert_eq!([a[2], a[3], a[4], a[5]], [127, 2, (-4i8) as u8, 1]);
        let mut q1 = [0u8; 36];
        quantize_q8_1(Q8Arith::Reference, &x, &mut q1).unwrap();
        assert_eq!(q1[4..], r[2..]);
        assert_eq!(half::f16::from_bits(u16::from_le_bytes([q1[2], q1[3]])).to_f32(), 127.0 + 3.0 - 4.0 + 1.0);
    }

    #[test]
    fn q8_k_keeps_the_first_largest_magnitude_and_its_sign() {
        let mut x = [0.0f32; 256];
        x[5] = -2.0;
        x[9] = 2.0;
        x[20] = 1.0;
        let mut b = [0u8; Q8_K_BYTES];
        quantize_q8_k(&x, &mut b).unwrap();
        // max = −2 (x[9] is not larger), iscale = 63.5, d = 1 / 63.5 > 0; 63.5 rounds to even.
        assert_eq!(f32::from_le_bytes(b[..4].try_into().unwrap()), 1.0 / 63.5);
        assert_eq!([b[4 + 5] as i8, b[4 + 9] as i8, b[4 + 20] as i8], [-127, 127, 64]);
        let bsum = |j: usize| i16::from_le_bytes([b[260 + 2 * j], b[261 + 2 * j]]);
        assert_eq!((bsum(0), bsum(1), bsum(2)), (0, 64, 0));
        // All zeros: d = 0 and zero codes and sums.
        quantize_q8_k(&[0.0; 256], &mut b).unwrap();
        assert!(b.iter().all(|&v| v == 0));
    }

    #[test]
    fn lengths_are_checked() {
        let e = quantize_q8_0(Q8Arith::Reference, &[0.0; 33], &mut [0; 34]).unwrap_err();
        assert_eq!(e, DotError::PartialActivation { ty: GgmlType::Q8_0, values: 33, block_elems: 32 });
        let e = quantize_q8_k(&[0.0; 256], &mut [0; 291]).unwrap_err();
        assert_eq!(e.to_string(), "quantizing 256 values to Q8_K: the output must be 292 bytes, it has 291");
        let e = quantize_activation(GgmlType::Q4_0, Q8Arith::Reference, &[0.0; 32], &mut [0; 18]).unwrap_err();
        assert_eq!(e, DotError::Unsupported { ty: GgmlType::Q4_0 });
        assert_eq!(activation_bytes(GgmlType::Q8_1, 64), Some(72));
        assert_eq!(activation_bytes(GgmlType::Q8_K, 100), None);
        assert_eq!(activation_bytes(GgmlType::F32, 32), None);
    }
}
