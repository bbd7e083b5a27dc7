//! The Q3 group format of [`crate::quant`] for the kernels of [`super::block`]: per row, groups of
//! 64 weights in 24 bytes (a 16-byte plane of low 2 bits, element `j` at byte `j >> 2` bit
//! `(j & 3) * 2`, then an 8-byte plane of high bits, element `j` at bit `j & 7` of byte `16 + (j >> 3)`;
//! code `c` means `c - 4`) and one `f32` scale per group.
//!
//! AVX2 packs the 16 low-plane bits and 8 high-plane bits of 8 elements into one `u32`, broadcasts
//! it and shifts it per lane (`vpsrlvd`) to extract each 3-bit code; AVX-512F broadcasts the 32
//! low-plane bits and (pre-shifted) 16 high-plane bits of 16 elements separately and does the same.

use super::block::GroupFormat;
use crate::quant::{q3_group_codes, GROUP_SIZE, Q3_GROUP_BYTES};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The Q3 layout ([`crate::quant`]): two bit planes in 24 bytes.
pub(super) struct Q3;

impl GroupFormat for Q3 {
    const BYTES: usize = Q3_GROUP_BYTES;

    #[inline]
    fn codes(group: &[u8]) -> [i8; GROUP_SIZE] {
        q3_group_codes(group.try_into().expect("24-byte group"))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn decode_avx2(gp: *const u8) -> [__m256; 8] {
        // SAFETY: `planes` reads the caller's 24 bytes; the rest is register-only; AVX2 by contract.
        unsafe {
            // lane t of 8: low bits at 2t, high bit at 16 + t (moved to bit 2 by a shift of 14 + t)
            let sh_lo = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
            let sh_hi = _mm256_setr_epi32(14, 15, 16, 17, 18, 19, 20, 21);
            let (three, four) = (_mm256_set1_epi32(3), _mm256_set1_epi32(4));
            let (lo, hi) = planes(gp);
            let mut out = [_mm256_setzero_ps(); 8];
            for (k, o) in out.iter_mut().enumerate() {
                let l16 = (lo[k / 4] >> (16 * (k % 4))) & 0xffff;
                let h8 = (hi >> (8 * k)) & 0xff;
                let v = _mm256_set1_epi32((l16 | (h8 << 16)) as i32);
                let c = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srlv_epi32(v, sh_lo), three),
                    _mm256_and_si256(_mm256_srlv_epi32(v, sh_hi), four),
                );
                *o = _mm256_cvtepi32_ps(_mm256_sub_epi32(c, four));
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
        // SAFETY: `planes` reads the caller's 24 bytes; the rest is register-only; CPU features by
        // contract.
        unsafe {
            // lane t of 16: low bits at 2t of the low word, high bit at t of the (<< 2) high word
            let sh_lo = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            let sh_hi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            let (three, four) = (_mm512_set1_epi32(3), _mm512_set1_epi32(4));
            let (lo, hi) = planes(gp);
            let mut out = [_mm512_setzero_ps(); 4];
            for (k, o) in out.iter_mut().enumerate() {
                let l32 = (lo[k / 2] >> (32 * (k % 2))) as u32;
                let h16 = (((hi >> (16 * k)) & 0xffff) << 2) as u32;
                let vl = _mm512_set1_epi32(l32 as i32);
                let vh = _mm512_set1_epi32(h16 as i32);
                let c = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srlv_epi32(vl, sh_lo), three),
                    _mm512_and_si512(_mm512_srlv_epi32(vh, sh_hi), four),
                );
                *o = _mm512_cvtepi32_ps(_mm512_sub_epi32(c, four));
            }
            out
        }
    }
}

/// Reads a group's planes as three little-endian `u64`s: low bits of elements 0..32, low bits of
/// elements 32..64, high bits of elements 0..64.
///
/// # Safety
/// `p` valid for reads of 24 bytes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn planes(p: *const u8) -> ([u64; 2], u64) {
    // SAFETY: three unaligned 8-byte reads at offsets 0, 8 and 16 of the caller's 24 bytes.
    unsafe {
        let rd = |o: usize| u64::from_le(std::ptr::read_unaligned(p.add(o).cast::<u64>()));
        ([rd(0), rd(8)], rd(16))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Kernels, Level};
    use crate::quant::Q3_HIGH_PLANE_OFFSET;

    /// Each code position picked out by a one-hot `x`, at every level: pins both bit planes and the -4.
    #[test]
    fn one_hot_columns_read_each_code() {
        // one row of two groups; element j of group g has code (j + 3 g) % 8
        let code = |g: usize, j: usize| ((j + 3 * g) % 8) as u8;
        let mut packed = vec![0u8; 48];
        for g in 0..2 {
            let grp = &mut packed[24 * g..24 * g + 24];
            for j in 0..64 {
                let c = code(g, j);
                grp[j >> 2] |= (c & 3) << ((j & 3) * 2);
                grp[Q3_HIGH_PLANE_OFFSET + (j >> 3)] |= (c >> 2) << (j & 7);
            }
        }
        let scales = [0.5f32, 2.0];
        for level in Level::ALL {
            let Some(k) = Kernels::new(level) else {
                eprintln!("q3 one-hot: SKIPPED level {level}: not supported");
                continue;
            };
            for c in 0..128 {
                let mut x = vec![0f32; 128];
                x[c] = 1.0;
                let mut y = [f32::NAN];
                k.matvec_q3(&packed, &scales, &x, &mut y);
                let want = (f32::from(code(c / 64, c % 64)) - 4.0) * scales[c / 64];
                assert_eq!(y[0], want, "{level} column {c}");
            }
        }
    }
}
