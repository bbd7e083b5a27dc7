//! Dequantization of ggml's block types, as stored in GGUF files: scalar reference functions that
//! equal gguf-py's `gguf.quants.dequantize` bit for bit (checked against fixtures it wrote:
//! `tests/fixtures/gguf/dequant/`, test `picchio-tests` `gguf::dequantize_equals_gguf_py_bit_for_bit`).
//!
//! Every value is computed with the f32 operations, in the order, that gguf-py's numpy code uses
//! (numpy computes in f32 and never fuses a multiply and an add; neither does Rust without
//! `mul_add`). The order turns out not to matter: a block's f16 scale has 11 significant bits and
//! its integer factors at most 14, so every product is exact in f32 (Q6_K's `d·sc·q` may round
//! once, but from an exact `d·sc`), and the only rounding is the final add of the minimum. So
//! ggml's C (`dequantize_row_*` in `ggml-quants.c`), which orders some products differently and may
//! be compiled with fused multiply-adds, gives the same bits; they differ only on F16 NaNs (ggml's
//! conversion quiets a signalling NaN, numpy and [`floats::f16_to_f32`] keep it).
//!
//! One file per family: [`legacy`] (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), [`kquants`] (Q2_K … Q6_K),
//! [`floats`] (F32, F16, BF16, MXFP4); each decodes a block once, for dequantization and for the
//! dot products.
//!
//! ggml's CPU matmul path, scalar and exact: [`q8`] quantizes activations to Q8_0/Q8_1/Q8_K blocks
//! byte for byte as ggml does, and [`dot`] computes each weight type's dot product with them bit
//! for bit as ggml's generic C (`ggml-cpu/quants.c`), with a row matvec ([`ggml_matvec`]);
//! `simd.rs` has its AVX2 and AVX-512 twins, bit-identical ([`ggml_matvec_at`]).

use picchio_core::format::gguf::GgmlType;

pub mod bf16;
pub mod dot;
pub mod floats;
pub mod kquants;
pub mod legacy;
pub mod q8;
mod simd;

pub use dot::{ggml_matvec, ggml_matvec_at, vec_dot, vec_dot_type, DotError, DOT_TYPES};
pub use q8::{quantize_activation, Q8Arith};

/// Why [`dequantize`] refused its input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    /// A type without a dequantizer here (the I-quants, ternary, NVFP4, Q1_0, integer types,
    /// F64, and the activation types Q8_1/Q8_K).
    #[error("dequantizing {ty}: not supported (supported: {})", SUPPORTED.map(|t| t.name()).join(", "))]
    Unsupported {
        /// The type.
        ty: GgmlType,
    },
    /// The input is not a whole number of blocks.
    #[error("dequantizing {ty}: {bytes} bytes are not a whole number of {block_bytes}-byte blocks")]
    PartialBlock {
        /// The type.
        ty: GgmlType,
        /// Input length in bytes.
        bytes: usize,
        /// Bytes per block.
        block_bytes: u32,
    },
    /// The output's length differs from the input's element count.
    #[error("dequantizing {ty}: {bytes} bytes hold {expected} values, the output has {found}")]
    OutputLen {
        /// The type.
        ty: GgmlType,
        /// Input length in bytes.
        bytes: usize,
        /// Values the input holds.
        expected: usize,
        /// Length of the output.
        found: usize,
    },
}

/// The types [`dequantize`] accepts.
pub const SUPPORTED: [GgmlType; 14] = {
    use GgmlType::*;
    [F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4]
};

/// Writes the values of `bytes`, whole blocks of type `ty` as stored in a GGUF, to `out`
/// (`out.len()` = blocks × the type's block elements), in ggml's element order.
///
/// # Errors
/// [`DequantError::Unsupported`] for a type not in [`SUPPORTED`]; [`DequantError::PartialBlock`]
/// when `bytes.len()` is not a multiple of the block size; [`DequantError::OutputLen`] when `out`
/// has another length than the values `bytes` holds.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    use GgmlType::*;
    let run: fn(&[u8], &mut [f32]) = match ty {
        F32 => floats::f32s,
        F16 => floats::f16s,
        BF16 => floats::bf16s,
        MXFP4 => floats::mxfp4,
        Q8_0 => legacy::q8_0,
        Q4_0 => |b, y| legacy::LegacyBlock::Q4_0.dequantize(b, y),
        Q4_1 => |b, y| legacy::LegacyBlock::Q4_1.dequantize(b, y),
        Q5_0 => |b, y| legacy::LegacyBlock::Q5_0.dequantize(b, y),
        Q5_1 => |b, y| legacy::LegacyBlock::Q5_1.dequantize(b, y),
        Q2_K => |b, y| kquants::dequantize(Q2_K, b, y),
        Q3_K => |b, y| kquants::dequantize(Q3_K, b, y),
        Q4_K => |b, y| kquants::dequantize(Q4_K, b, y),
        Q5_K => |b, y| kquants::dequantize(Q5_K, b, y),
        Q6_K => |b, y| kquants::dequantize(Q6_K, b, y),
        _ => return Err(DequantError::Unsupported { ty }),
    };
    let (block_bytes, block_elems) = (ty.block_bytes(), ty.block_elems() as usize);
    if !bytes.len().is_multiple_of(block_bytes as usize) {
        return Err(DequantError::PartialBlock { ty, bytes: bytes.len(), block_bytes });
    }
    let expected = bytes.len() / block_bytes as usize * block_elems;
    if out.len() != expected {
        return Err(DequantError::OutputLen { ty, bytes: bytes.len(), expected, found: out.len() });
    }
    run(bytes, out);
    Ok(())
}

/// Runs `f` with `xs` (`n` inputs of `xs.len() / n` values each) quantized to the activation type
/// ggml-cpu pairs with weights of `ty` ([`vec_dot_type`]), the inputs' blocks one after another,
/// in a buffer reused per thread. Q8_0 and Q8_1 are rounded as ggml's x86 AVX code does
/// ([`Q8Arith::X86Avx`]: what llama.cpp runs on every x86-64 CPU this project targets).
///
/// # Panics
/// When `ty` has no dot product or an input is not whole activation blocks (the kernels check both
/// first).
pub(crate) fn with_activation<R>(ty: GgmlType, xs: &[f32], n: usize, f: impl FnOnce(&[u8]) -> R) -> R {
    thread_local! {
        static ACT: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let act = vec_dot_type(ty).expect("a ggml dot type");
    let cols = xs.len() / n;
    let per = q8::activation_bytes(act, cols).expect("whole activation blocks");
    let mut buf = ACT.take();
    buf.clear();
    buf.resize(per * n, 0);
    if per > 0 {
        for (x, out) in xs.chunks_exact(cols).zip(buf.chunks_exact_mut(per)) {
            quantize_activation(act, Q8Arith::X86Avx, x, out).expect("whole activation blocks");
        }
    }
    let r = f(&buf);
    ACT.set(buf);
    r
}

/// Byte offsets, within one block of `ty`, of its f16 scale fields (`d`, then `m`/`dmin` where the
/// type has one), as ggml's block structs lay them out (`ggml-common.h`): Q4_0/Q5_0/Q8_0 `d` at 0;
/// Q4_1/Q5_1/Q4_K/Q5_K `d` at 0 and `m`/`dmin` at 2; Q2_K `d` at 80 and `dmin` at 82; Q3_K `d` at
/// 108; Q6_K `d` at 208. Empty for the float types and MXFP4 (its scale is the e8m0 byte 0). For
/// making valid blocks in tests and benches (random bytes elsewhere, a finite f16 here).
pub fn f16_scale_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => &[],
    }
}

/// The little-endian u16 at byte `at` of `b`.
fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// The f16 at byte `at` of `b`, widened exactly ([`floats::f16_to_f32`]).
fn f16_at(b: &[u8], at: usize) -> f32 {
    floats::f16_to_f32(le16(b, at))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_and_types_are_checked() {
        let mut out = [0f32; 64];
        assert_eq!(
            dequantize(GgmlType::Q8_0, &[0; 33], &mut out[..32]),
            Err(DequantError::PartialBlock { ty: GgmlType::Q8_0, bytes: 33, block_bytes: 34 })
        );
        let e = dequantize(GgmlType::Q8_0, &[0; 68], &mut out[..63]).unwrap_err();
        assert_eq!(e.to_string(), "dequantizing Q8_0: 68 bytes hold 64 values, the output has 63");
        let e = dequantize(GgmlType::IQ4_XS, &[0; 136], &mut [0f32; 256]).unwrap_err();
        assert_eq!(e, DequantError::Unsupported { ty: GgmlType::IQ4_XS });
        assert!(e.to_string().contains("supported: F32, F16, BF16, Q8_0"), "{e}");
        dequantize(GgmlType::Q4_K, &[], &mut []).unwrap();
    }

    /// Every supported type decodes a block of zero bytes to zeros (all its scales are +0).
    #[test]
    fn zero_blocks_are_zero() {
        for ty in SUPPORTED {
            let (bb, be) = (ty.block_bytes() as usize, ty.block_elems() as usize);
            let mut out = vec![f32::NAN; 2 * be];
            dequantize(ty, &vec![0; 2 * bb], &mut out).unwrap();
            assert!(out.iter().all(|&v| v == 0.0), "{ty}: {out:?}");
        }
    }
}
