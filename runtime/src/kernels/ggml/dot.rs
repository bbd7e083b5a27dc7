//! ggml's quantized dot products, scalar: each weight type against its `vec_dot_type` (the
//! activation blocks of [`super::q8`]) as `type_traits_cpu` in `ggml-cpu.c` pairs them, computed
//! as the generic C of `ggml-cpu/quants.c` (`ggml_vec_dot_<type>_<vec_dot_type>_generic`) does,
//! operation for operation: the integer sums in integers (their order cannot matter), every f32
//! product and sum in the C's order, no fused multiply-add (gcc contracts `a*b + c` only where the
//! target has FMA; ggml's generic build for x86-64 has none). So the f32 result has the generic
//! C's bits (test `picchio-tests` `ggml_dot::dot_products_equal_ggml_generic_c_bit_for_bit`).
//!
//! | weight | activation | ggml function | f32 per block `b` (`sumi` its integer dot) |
//! | --- | --- | --- | --- |
//! | Q4_0 | Q8_0 | `ggml_vec_dot_q4_0_q8_0_generic` | `sumf += sumi·dx·dy` |
//! | Q5_0, Q8_0 | Q8_0 | `…_q5_0_q8_0_generic`, `…_q8_0_q8_0_generic` | `sumf += (dx·dy)·sumi` |
//! | MXFP4 | Q8_0 | `…_mxfp4_q8_0_generic` | `sumf += (dy·e8m0_half)·sumi` |
//! | Q4_1, Q5_1 | Q8_1 | `…_q4_1_q8_1_generic`, `…_q5_1_q8_1_generic` | `sumf += (dx·dy)·sumi + m·s` |
//! | Q2_K | Q8_K | `…_q2_K_q8_K_generic` | `sumf += (dy·d)·isum − (dy·dmin)·Σ bsums·min` |
//! | Q3_K, Q6_K | Q8_K | `…_q3_K_q8_K_generic`, `…_q6_K_q8_K_generic` | 8 lanes: `sums[l] += (d·dy)·aux32[l]`; at the end `sumf = Σ_l sums[l]` |
//! | Q4_K, Q5_K | Q8_K | `…_q4_K_q8_K_generic`, `…_q5_K_q8_K_generic` | as Q3_K, and `sumf −= (dmin·dy)·Σ bsums·min` per block |
//!
//! (`aux32[l]` sums `scale · q8 · q` over the block's elements `i ≡ l (mod 8)`.) These are the
//! functions llama.cpp runs where no SIMD twin exists; on x86 with AVX2 it runs twins that sum in
//! another order (docs/kernels.md). This module's AVX2 and AVX-512 twins (`simd.rs`, chosen by the
//! kernel `Level` in [`matvec_quantized`] / [`matmul_quantized`] and [`ggml_matvec_at`]) give the
//! same bits as this scalar code. F32/F16/BF16 dots are not here.

use super::f16_at;
use super::floats::mxfp4_decode;
use super::kquants::{self, QK_K};
use super::legacy::{q8_0_decode, LegacyBlock};
use super::q8::activation_block;
use crate::kernels::Level;
use picchio_core::format::gguf::GgmlType;

/// Why a quantization or dot product refused its input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DotError {
    /// A type without a dot product (or, for quantizing, not an activation type) here.
    #[error("{ty}: no ggml dot product here (weights: {}; activations: Q8_0, Q8_1, Q8_K)",
        DOT_TYPES.map(|t| t.name()).join(", "))]
    Unsupported {
        /// The type.
        ty: GgmlType,
    },
    /// The f32 input to quantize is not a whole number of blocks.
    #[error("quantizing {values} values to {ty}: not a whole number of {block_elems}-value blocks")]
    PartialActivation {
        /// The activation type.
        ty: GgmlType,
        /// Values given.
        values: usize,
        /// Values per block.
        block_elems: usize,
    },
    /// The output of a quantization has another length than the blocks it needs.
    #[error("quantizing {values} values to {ty}: the output must be {expected} bytes, it has {found}")]
    ActivationLen {
        /// The activation type.
        ty: GgmlType,
        /// Values given.
        values: usize,
        /// Bytes the blocks take.
        expected: usize,
        /// Length of the output.
        found: usize,
    },
    /// The weights are not `rows` rows of whole blocks.
    #[error("{ty} weights: {bytes} bytes are not {rows} rows of whole {block_bytes}-byte blocks")]
    WeightLen {
        /// The weight type.
        ty: GgmlType,
        /// Bytes of weights given.
        bytes: usize,
        /// Rows asked for (the output's length).
        rows: usize,
        /// Bytes per weight block.
        block_bytes: usize,
    },
    /// The quantized activation has another number of blocks than a weight row.
    #[error("{ty} weights, rows of {blocks} blocks: the {act} activation has {act_bytes} bytes, not {expected}")]
    ActivationBlocks {
        /// The weight type.
        ty: GgmlType,
        /// Its activation type.
        act: GgmlType,
        /// Blocks per weight row.
        blocks: usize,
        /// Bytes of activation given.
        act_bytes: usize,
        /// Bytes `blocks` activation blocks take.
        expected: usize,
    },
}

/// The weight types [`vec_dot`] and [`ggml_matvec`] accept.
pub const DOT_TYPES: [GgmlType; 11] = {
    use GgmlType::*;
    [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K]
};

/// The activation type ggml-cpu quantizes the input to for weights of `ty` (`vec_dot_type` in
/// `type_traits_cpu`): Q8_0 for Q4_0, Q5_0, Q8_0 and MXFP4; Q8_1 for Q4_1 and Q5_1; Q8_K for the
/// K-quants; `None` for a type not in [`DOT_TYPES`].
pub fn vec_dot_type(ty: GgmlType) -> Option<GgmlType> {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 | MXFP4 => Some(Q8_0),
        Q4_1 | Q5_1 => Some(Q8_1),
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K => Some(Q8_K),
        _ => None,
    }
}

/// A 32-element weight block's scale, minimum (Q4_1, Q5_1) and signed codes.
fn decode_32(ty: GgmlType, b: &[u8]) -> (f32, Option<f32>, [i32; 32]) {
    use GgmlType::*;
    let legacy = |spec: LegacyBlock| spec.decode(b);
    let plain = |(d, q): (f32, [i32; 32])| (d, None, q);
    match ty {
        Q4_0 => legacy(LegacyBlock::Q4_0),
        Q4_1 => legacy(LegacyBlock::Q4_1),
        Q5_0 => legacy(LegacyBlock::Q5_0),
        Q5_1 => legacy(LegacyBlock::Q5_1),
        Q8_0 => plain(q8_0_decode(b)),
        MXFP4 => plain(mxfp4_decode(b)),
        _ => unreachable!("decode_32 of {ty}"),
    }
}

/// The i8 codes of an activation block's `qs`.
fn codes(qs: &[u8]) -> impl Iterator<Item = i32> + '_ {
    qs.iter().map(|&q| i32::from(q as i8))
}

/// One row of 32-element blocks against Q8_0/Q8_1 blocks (the table's first four lines).
fn dot_32(ty: GgmlType, w: &[u8], act: &[u8], act_bytes: usize) -> f32 {
    let mut sumf = 0.0f32;
    for (b, y) in w.chunks_exact(ty.block_bytes() as usize).zip(act.chunks_exact(act_bytes)) {
        let (dx, mx, q) = decode_32(ty, b);
        let dy = f16_at(y, 0);
        let sumi: i32 = q.iter().zip(codes(&y[act_bytes - 32..])).map(|(q, a)| q * a).sum();
        sumf += match mx {
            // Q4_1, Q5_1: the Q8_1 block's `s` at byte 2.
            Some(m) => dx * dy * sumi as f32 + m * f16_at(y, 2),
            None if ty == GgmlType::Q4_0 => sumi as f32 * dx * dy,
            None => dx * dy * sumi as f32,
        };
    }
    sumf
}

/// One row of K-quant super-blocks against Q8_K blocks (the table's last three lines).
fn dot_k(ty: GgmlType, w: &[u8], act: &[u8]) -> f32 {
    let (mut sumf, mut sums) = (0.0f32, [0.0f32; 8]);
    for (b, y) in w.chunks_exact(ty.block_bytes() as usize).zip(act.chunks_exact(super::q8::Q8_K_BYTES)) {
        let k = kquants::decode(ty, b);
        let dy = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
        let mut lanes = [0i32; 8];
        for ((i, q), a) in k.q.iter().enumerate().zip(codes(&y[4..4 + QK_K])) {
            lanes[i % 8] += k.scale[i / 16] * (a * q);
        }
        let mins: i32 =
            (0..16).map(|j| i32::from(i16::from_le_bytes([y[260 + 2 * j], y[261 + 2 * j]])) * k.min[j]).sum();
        if ty == GgmlType::Q2_K {
            let (dall, dmin) = (dy * k.d, dy * k.dmin);
            sumf += dall * lanes.iter().sum::<i32>() as f32 - dmin * mins as f32;
            continue;
        }
        let d = k.d * dy;
        for (s, &l) in sums.iter_mut().zip(&lanes) {
            *s += d * l as f32;
        }
        if matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K) {
            sumf -= k.dmin * dy * mins as f32;
        }
    }
    if ty != GgmlType::Q2_K {
        for s in sums {
            sumf += s;
        }
    }
    sumf
}

/// The bytes of one weight block and one activation block of `ty`, checked to be a dot type.
fn block_sizes(ty: GgmlType) -> Result<(usize, GgmlType, usize), DotError> {
    let act = vec_dot_type(ty).ok_or(DotError::Unsupported { ty })?;
    let (_, act_bytes) = activation_block(act).expect("an activation type");
    Ok((ty.block_bytes() as usize, act, act_bytes))
}

/// Checks `act` holds the activation blocks for rows of `row_bytes` bytes of `ty`.
fn check_act(ty: GgmlType, row_bytes: usize, act: &[u8]) -> Result<usize, DotError> {
    let (block_bytes, act_ty, act_bytes) = block_sizes(ty)?;
    let blocks = row_bytes / block_bytes;
    if act.len() != blocks * act_bytes {
        return Err(DotError::ActivationBlocks {
            ty,
            act: act_ty,
            blocks,
            act_bytes: act.len(),
            expected: blocks * act_bytes,
        });
    }
    Ok(act_bytes)
}

/// One row's dot product, unchecked: `w` whole blocks of `ty`, `act` as many activation blocks.
fn dot_row(ty: GgmlType, w: &[u8], act: &[u8], act_bytes: usize) -> f32 {
    if ty.block_elems() as usize == QK_K {
        dot_k(ty, w, act)
    } else {
        dot_32(ty, w, act, act_bytes)
    }
}

/// The dot product of one row of weights `w` (whole blocks of `ty`, as stored in a GGUF) with
/// `act`, the same number of values quantized to [`vec_dot_type`]`(ty)` ([`super::q8`]): ggml's
/// `vec_dot` of `ty` with `n` = the row's values, bit for bit as its generic C.
///
/// # Errors
/// [`DotError::Unsupported`] for a type not in [`DOT_TYPES`]; [`DotError::WeightLen`] when `w` is
/// not whole blocks; [`DotError::ActivationBlocks`] when `act` is not as many activation blocks.
pub fn vec_dot(ty: GgmlType, w: &[u8], act: &[u8]) -> Result<f32, DotError> {
    let mut out = [0.0f32];
    ggml_matvec(ty, w, act, &mut out)?;
    Ok(out[0])
}

/// `out[r]` = [`vec_dot`] of weight row `r` with `x_quantized`, for `out.len()` rows of equal
/// length stored one after another in `weights` (a GGUF tensor of `ne[1]` = rows, `ne[0]` = the
/// row's values): what ggml's `mul_mat` computes for one activation column, one `vec_dot` call per
/// whole row.
///
/// # Errors
/// As [`vec_dot`]; [`DotError::WeightLen`] also when `weights` does not split into `out.len()`
/// rows of whole blocks.
pub fn ggml_matvec(ty: GgmlType, weights: &[u8], x_quantized: &[u8], out: &mut [f32]) -> Result<(), DotError> {
    let (block_bytes, _, _) = block_sizes(ty)?;
    let rows = out.len();
    let row_bytes = weights.len().checked_div(rows).unwrap_or(0);
    if row_bytes * rows != weights.len() || !row_bytes.is_multiple_of(block_bytes) {
        return Err(DotError::WeightLen { ty, bytes: weights.len(), rows, block_bytes });
    }
    let act_bytes = check_act(ty, row_bytes, x_quantized)?;
    if row_bytes == 0 {
        out.fill(0.0);
        return Ok(());
    }
    for (o, w) in out.iter_mut().zip(weights.chunks_exact(row_bytes)) {
        *o = dot_row(ty, w, x_quantized, act_bytes);
    }
    Ok(())
}

/// `out[r]` = ggml's `vec_dot` of weight row `r` of `weights` (`out.len()` rows of whole `ty`
/// blocks) with `xq` (one input quantized to [`vec_dot_type`]`(ty)`), at kernel level `level`: the
/// product of [`crate::kernels::MatRef::Ggml`] once the kernels have checked the shapes. Every level
/// gives the bits of [`ggml_matvec`] (the generic C's); AVX2 and AVX-512 run `simd.rs`.
///
/// # Panics
/// When the shapes do not match (the caller checked them: `MatRef::check`).
pub(crate) fn matvec_quantized(level: Level, ty: GgmlType, weights: &[u8], xq: &[u8], out: &mut [f32]) {
    matvec_checked(level, ty, weights, xq, out).expect("matvec_ggml: shapes checked by the caller");
}

/// [`ggml_matvec`] at `level`, which the CPU supports.
fn matvec_checked(level: Level, ty: GgmlType, weights: &[u8], xq: &[u8], out: &mut [f32]) -> Result<(), DotError> {
    if level != Level::Scalar && !out.is_empty() {
        let row_bytes = weights.len() / out.len();
        if row_bytes > 0
            && row_bytes * out.len() == weights.len()
            && row_bytes.is_multiple_of(ty.block_bytes() as usize)
            && check_act(ty, row_bytes, xq).is_ok()
            && super::simd::matvec(level, ty, weights, row_bytes, xq, out)
        {
            return Ok(());
        }
    }
    ggml_matvec(ty, weights, xq, out)
}

/// [`ggml_matvec`] computed by the kernels of `level` (`ggml/simd.rs`'s AVX2 and AVX-512 twins,
/// or the scalar code): the same bits at every level. A level the CPU lacks
/// ([`Level::is_supported`]) runs the scalar code.
///
/// # Errors
/// As [`ggml_matvec`].
pub fn ggml_matvec_at(
    level: Level,
    ty: GgmlType,
    weights: &[u8],
    x_quantized: &[u8],
    out: &mut [f32],
) -> Result<(), DotError> {
    let level = if level.is_supported() { level } else { Level::Scalar };
    matvec_checked(level, ty, weights, x_quantized, out)
}

/// `yt[r * n + t]` = [`matvec_quantized`] of input `t` (`xqs` holds `n` quantized inputs one after
/// another) for every weight row `r`: each weight row is read once for all `n` inputs.
///
/// # Panics
/// When the shapes do not match (the caller checked them).
pub(crate) fn matmul_quantized(level: Level, ty: GgmlType, weights: &[u8], xqs: &[u8], n: usize, yt: &mut [f32]) {
    let rows = yt.len() / n;
    let (block_bytes, _, _) = block_sizes(ty).expect("matmul_ggml: a dot type");
    let row_bytes = weights.len().checked_div(rows).unwrap_or(0);
    let xq_bytes = xqs.len() / n;
    assert!(rows * row_bytes == weights.len() && row_bytes.is_multiple_of(block_bytes) && xq_bytes * n == xqs.len());
    if row_bytes == 0 {
        yt.fill(0.0);
        return;
    }
    let act_bytes = check_act(ty, row_bytes, &xqs[..xq_bytes]).expect("matmul_ggml: shapes checked by the caller");
    if level != Level::Scalar && super::simd::matmul(level, ty, weights, row_bytes, xqs, n, yt) {
        return;
    }
    for (w, y) in weights.chunks_exact(row_bytes).zip(yt.chunks_exact_mut(n)) {
        for (o, xq) in y.iter_mut().zip(xqs.chunks_exact(xq_bytes)) {
            *o = dot_row(ty, w, xq, act_bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::q8::{quantize_activation, Q8Arith};
    use super::super::{dequantize, floats::f16_to_f32};
    use super::*;

    /// Blocks of `ty` with codes from a small generator and scales 2^-k, so every product and sum
    /// below is exact in f32 and the dot equals the f64 dot of the dequantized values.
    fn exact_blocks(ty: GgmlType, n_blocks: usize, seed: u32) -> Vec<u8> {
        let mut state = seed;
        let mut b: Vec<u8> = (0..n_blocks * ty.block_bytes() as usize)
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (state >> 24) as u8
            })
            .collect();
        // f16 0.25 (and dmin 0.125) in every f16 field, a small exponent for MXFP4.
        let f16_fields = super::super::f16_scale_fields(ty);
        for blk in b.chunks_exact_mut(ty.block_bytes() as usize) {
            for (k, &at) in f16_fields.iter().enumerate() {
                let bits: u16 = if k == 0 { 0x3400 } else { 0x3000 };
                blk[at..at + 2].copy_from_slice(&bits.to_le_bytes());
            }
            if ty == GgmlType::MXFP4 {
                blk[0] = 125;
            }
        }
        b
    }

    /// On weights and activations where f32 is exact, every type's dot equals the dot of the
    /// dequantized weights with the dequantized activation: the decoding and pairing are right
    /// (the rounding order is what the fixtures pin).
    #[test]
    fn exact_inputs_give_the_dequantized_dot() {
        for ty in DOT_TYPES {
            let n = 512;
            let blocks = n / ty.block_elems() as usize;
            let w = exact_blocks(ty, blocks, ty as u32 + 1);
            let mut wf = vec![0f32; n];
            dequantize(ty, &w, &mut wf).unwrap();
            // Integers with amax 127 at the start of each block (so the codes are the values) and
            // small block sums (so Q8_1's f16 `s` is exact).
            let x: Vec<f32> = (0..n)
                .map(|i| match i % 32 {
                    0 => 127.0,
                    1 => -127.0,
                    _ => (i * 37 % 61) as f32 - 30.0,
                })
                .collect();
            let act_ty = vec_dot_type(ty).unwrap();
            let mut a = vec![0u8; super::super::q8::activation_bytes(act_ty, n).unwrap()];
            quantize_activation(act_ty, Q8Arith::Reference, &x, &mut a).unwrap();
            // The activation is exact: d = 1 (Q8_0, Q8_1) or −1 (Q8_K: max = 127, iscale = −1).
            let got = vec_dot(ty, &w, &a).unwrap();
            let want: f64 = wf.iter().zip(&x).map(|(&w, &x)| f64::from(w) * f64::from(x)).sum();
            assert_eq!(f64::from(got), want, "{ty}");
            assert_ne!(got, 0.0, "{ty}");
            if act_ty != GgmlType::Q8_K {
                assert_eq!(f16_to_f32(u16::from_le_bytes([a[0], a[1]])), 1.0);
            }
        }
    }

    #[test]
    fn shapes_and_types_are_checked() {
        let w = vec![0u8; 2 * 18 * 2]; // Q4_0: 2 rows of 2 blocks
        let a = vec![0u8; 2 * 34];
        let mut out = [1.0f32; 2];
        ggml_matvec(GgmlType::Q4_0, &w, &a, &mut out).unwrap();
        assert_eq!(out, [0.0, 0.0]);
        let e = ggml_matvec(GgmlType::Q4_0, &w, &a, &mut [0.0; 3]).unwrap_err();
        assert_eq!(e, DotError::WeightLen { ty: GgmlType::Q4_0, bytes: 72, rows: 3, block_bytes: 18 });
        let e = ggml_matvec(GgmlType::Q4_0, &w, &a[..34], &mut out).unwrap_err();
        assert_eq!(e.to_string(), "Q4_0 weights, rows of 2 blocks: the Q8_0 activation has 34 bytes, not 68");
        let e = vec_dot(GgmlType::Q4_K, &[0; 144], &[0; 34]).unwrap_err();
        assert!(matches!(e, DotError::ActivationBlocks { act: GgmlType::Q8_K, expected: 292, .. }), "{e}");
        let e = vec_dot(GgmlType::F16, &[0; 64], &[0; 64]).unwrap_err();
        assert_eq!(e, DotError::Unsupported { ty: GgmlType::F16 });
        assert!(e.to_string().contains("weights: Q4_0, Q4_1"), "{e}");
        assert_eq!(vec_dot(GgmlType::Q8_0, &[], &[]), Ok(0.0));
        ggml_matvec(GgmlType::Q8_0, &[], &[], &mut []).unwrap();
        for ty in DOT_TYPES {
            assert!(vec_dot_type(ty).is_some(), "{ty}");
        }
        assert_eq!(vec_dot_type(GgmlType::Q5_1), Some(GgmlType::Q8_1));
    }
}
