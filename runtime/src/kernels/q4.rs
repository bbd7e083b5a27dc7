//! The Q4 group format of [`crate::quant`] for the kernels of [`super::block`]: per row, groups of
//! 64 weights in 32 bytes (element `2i` in the low nibble of byte `i`, code `nibble - 8`) and one
//! `f32` scale.
//!
//! AVX2 decodes 16 packed bytes at a time: widened to 16-bit lanes, their nibbles re-interleaved so
//! the register holds the 32 codes in element order (`lo | hi << 8` per lane), `- 8` applied to the
//! bytes, then 8 (AVX2) or 16 (AVX-512F, `vpmovsxbd`) codes at a time widened to `f32`.

use super::block::GroupFormat;
use crate::quant::{q4_group_codes, GROUP_SIZE, Q4_GROUP_BYTES};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The Q4 layout ([`crate::quant`]): 64 nibbles in 32 bytes.
pub(super) struct Q4;

impl GroupFormat for Q4 {
    const BYTES: usize = Q4_GROUP_BYTES;

    #[inline]
    fn codes(group: &[u8]) -> [i8; GROUP_SIZE] {
        q4_group_codes(group.try_into().expect("32-byte group"))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn decode_avx2(gp: *const u8) -> [__m256; 8] {
        use super::x86::cvt_i8x8;
        // SAFETY: two 16-byte loads inside the caller's 32 bytes; AVX2 by contract.
        unsafe {
            let mut out = [_mm256_setzero_ps(); 8];
            for h in 0..2 {
                let c = codes32(gp.add(16 * h));
                let lo = _mm256_castsi256_si128(c);
                let hi = _mm256_extracti128_si256::<1>(c);
                let q = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
                for (k, qk) in q.into_iter().enumerate() {
                    out[4 * h + k] = cvt_i8x8(qk);
                }
            }
            out
        }
    }

    #[cfg(target_arch = "x86_64")]
    // AVX-512 intrinsics and `target_feature(enable = "avx512f")` are stable since Rust 1.89 (see the
    // module docs of `kernels`).
    #[allow(clippy::incompatible_msrv)]
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn decode_avx512(gp: *const u8) -> [__m512; 4] {
        use super::x86::cvt_i8x16;
        // SAFETY: two 16-byte loads inside the caller's 32 bytes; CPU features by contract
        // (AVX-512F implies the AVX2 used by `codes32`, which is also detected).
        unsafe {
            let mut out = [_mm512_setzero_ps(); 4];
            for h in 0..2 {
                let c = codes32(gp.add(16 * h));
                out[2 * h] = cvt_i8x16(_mm256_castsi256_si128(c));
                out[2 * h + 1] = cvt_i8x16(_mm256_extracti128_si256::<1>(c));
            }
            out
        }
    }
}

/// The 32 signed codes of 16 packed bytes at `p`, in element order, one per byte.
///
/// # Safety
/// AVX2; `p` valid for reads of 16 bytes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn codes32(p: *const u8) -> __m256i {
    // SAFETY: one unaligned 16-byte load inside the caller's range; AVX2 by contract.
    unsafe {
        let w16 = _mm256_cvtepu8_epi16(_mm_loadu_si128(p.cast::<__m128i>()));
        let lo = _mm256_and_si256(w16, _mm256_set1_epi16(0x000f));
        let hi = _mm256_slli_epi16::<4>(_mm256_and_si256(w16, _mm256_set1_epi16(0x00f0)));
        _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(8))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Kernels, Level};

    /// Each code position picked out by a one-hot `x`, at every level: pins nibble order and the -8.
    #[test]
    fn one_hot_columns_read_each_code() {
        // row 0: byte i = (lo = i % 16, hi = 15 - i % 16), scale 0.5; row 1: all 0x88 (q = 0), scale 3
        let mut packed = vec![0u8; 2 * 64];
        for i in 0..64 {
            packed[i] = (i % 16) as u8 | ((15 - i % 16) as u8) << 4;
            packed[64 + i] = 0x88;
        }
        let scales = [0.5f32, 0.25, 3.0, 3.0];
        for level in Level::ALL {
            let Some(k) = Kernels::new(level) else {
                eprintln!("q4 one-hot: SKIPPED level {level}: not supported");
                continue;
            };
            for c in 0..128 {
                let mut x = vec![0f32; 128];
                x[c] = 1.0;
                let mut y = [f32::NAN; 2];
                k.matvec_q4(&packed, &scales, &x, &mut y);
                let byte = (c / 2) % 16;
                let nib = if c % 2 == 0 { byte } else { 15 - byte };
                let want = (nib as f32 - 8.0) * scales[c / 64];
                assert_eq!(y, [want, 0.0], "{level} column {c}");
            }
        }
    }
}
