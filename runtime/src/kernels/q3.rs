//! Q3 matrix-vector product straight from the packed layout of [`crate::quant`]: per row, groups of
//! 64 weights in 24 bytes (a 16-byte plane of low 2 bits, element `j` at byte `j >> 2` bit
//! `(j & 3) * 2`, then an 8-byte plane of high bits, element `j` at bit `j & 7` of byte `16 + (j >> 3)`;
//! code `c` means `c - 4`) and one `f32` scale per group.
//!
//! Every level computes each group's dot product of codes and `x` first, then multiplies it by the
//! group scale and accumulates.

/// Portable reference: decode a group with [`crate::quant::q3_group_codes`], take its dot product with
/// the 8-lane scalar `dot`, accumulate `group_dot * scale` left to right.
pub(super) mod scalar {
    use super::super::dense::scalar::dot;
    use crate::quant::{q3_group_codes, GROUP_SIZE, Q3_GROUP_BYTES};

    /// `y = W x` for Q3 `W [y.len(), x.len()]`; shapes checked by the caller.
    pub(crate) fn matvec(packed: &[u8], scales: &[f32], x: &[f32], y: &mut [f32]) {
        let groups = x.len() / GROUP_SIZE;
        for (r, out) in y.iter_mut().enumerate() {
            let mut acc = 0f32;
            for (g, xg) in x.chunks_exact(GROUP_SIZE).enumerate() {
                let gi = r * groups + g;
                let bytes = &packed[gi * Q3_GROUP_BYTES..(gi + 1) * Q3_GROUP_BYTES];
                let codes = q3_group_codes(bytes.try_into().expect("24-byte group"));
                acc += dot(&codes.map(f32::from), xg) * scales[gi];
            }
            *out = acc;
        }
    }

    /// `yt [rows, n]` = W `xs [n, cols]`: each group is decoded once for every input of a block of
    /// [`super::super::MATMUL_BLOCK`] and its dot products accumulated exactly as [`matvec`] does,
    /// so each output equals [`matvec`]'s bit for bit.
    pub(crate) fn matmul(packed: &[u8], scales: &[f32], xs: &[f32], n: usize, yt: &mut [f32]) {
        const B: usize = super::super::MATMUL_BLOCK;
        let cols = xs.len() / n;
        let groups = cols / GROUP_SIZE;
        for (r, out) in yt.chunks_exact_mut(n).enumerate() {
            for (b, out) in out.chunks_mut(B).enumerate() {
                let mut acc = [0f32; B];
                for g in 0..groups {
                    let gi = r * groups + g;
                    let bytes = &packed[gi * Q3_GROUP_BYTES..(gi + 1) * Q3_GROUP_BYTES];
                    let codes = q3_group_codes(bytes.try_into().expect("24-byte group")).map(f32::from);
                    for (j, a) in acc[..out.len()].iter_mut().enumerate() {
                        let x = &xs[(b * B + j) * cols + g * GROUP_SIZE..][..GROUP_SIZE];
                        *a += dot(&codes, x) * scales[gi];
                    }
                }
                out.copy_from_slice(&acc[..out.len()]);
            }
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

/// AVX2 + FMA: for 8 elements at a time, their 16 low-plane bits and 8 high-plane bits are packed into
/// one `u32`, broadcast, and shifted per lane (`vpsrlvd`) to extract each 3-bit code.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::super::size;
    use super::super::x86::hsum256;
    use crate::quant::{GROUP_SIZE, Q3_GROUP_BYTES};
    use std::arch::x86_64::*;

    /// One row: `groups` groups of packed bytes at `p`, scales at `s`, input at `x`.
    ///
    /// # Safety
    /// AVX2 + FMA; `p` valid for `groups * 24` bytes, `s` for `groups` and `x` for `groups * 64` `f32`s.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn row(p: *const u8, s: *const f32, x: *const f32, groups: usize) -> f32 {
        // SAFETY: group `g` reads bytes `24 g..24 g + 24`, scale `g` and `x[64 g..64 g + 64]`, all
        // inside the caller's ranges; AVX2 + FMA by contract.
        unsafe {
            // lane t of 8: low bits at 2t, high bit at 16 + t (moved to bit 2 by a shift of 14 + t)
            let sh_lo = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
            let sh_hi = _mm256_setr_epi32(14, 15, 16, 17, 18, 19, 20, 21);
            let (three, four) = (_mm256_set1_epi32(3), _mm256_set1_epi32(4));
            let mut acc = _mm256_setzero_ps();
            for g in 0..groups {
                let (lo, hi) = super::planes(p.add(g * Q3_GROUP_BYTES));
                let xg = x.add(g * GROUP_SIZE);
                let mut part = [_mm256_setzero_ps(); 4];
                for k in 0..8 {
                    let l16 = (lo[k / 4] >> (16 * (k % 4))) & 0xffff;
                    let h8 = (hi >> (8 * k)) & 0xff;
                    let v = _mm256_set1_epi32((l16 | (h8 << 16)) as i32);
                    let c = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srlv_epi32(v, sh_lo), three),
                        _mm256_and_si256(_mm256_srlv_epi32(v, sh_hi), four),
                    );
                    let w = _mm256_cvtepi32_ps(_mm256_sub_epi32(c, four));
                    part[k % 4] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xg.add(8 * k)), part[k % 4]);
                }
                let gsum = _mm256_add_ps(_mm256_add_ps(part[0], part[1]), _mm256_add_ps(part[2], part[3]));
                acc = _mm256_fmadd_ps(gsum, _mm256_set1_ps(*s.add(g)), acc);
            }
            hsum256(acc)
        }
    }

    /// `y = W x` for Q3 `W [y.len(), x.len()]`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn matvec(packed: &[u8], scales: &[f32], x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len() % GROUP_SIZE, 0);
        let groups = x.len() / GROUP_SIZE;
        assert_eq!(packed.len(), size(size(y.len(), groups), Q3_GROUP_BYTES));
        assert_eq!(scales.len(), size(y.len(), groups));
        for (r, out) in y.iter_mut().enumerate() {
            let gi = r * groups;
            // SAFETY: row `r` owns groups `gi..gi + groups`, inside both buffers by the asserts.
            *out =
                unsafe { row(packed.as_ptr().add(gi * Q3_GROUP_BYTES), scales.as_ptr().add(gi), x.as_ptr(), groups) };
        }
    }

    /// The 64 codes of the group at `gp` as 8 vectors of 8 `f32`s, as [`row`] extracts them.
    ///
    /// # Safety
    /// AVX2; `gp` valid for reads of 24 bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn decode(gp: *const u8) -> [__m256; 8] {
        // SAFETY: `planes` reads the caller's 24 bytes; the rest is register-only; AVX2 by contract.
        unsafe {
            let sh_lo = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
            let sh_hi = _mm256_setr_epi32(14, 15, 16, 17, 18, 19, 20, 21);
            let (three, four) = (_mm256_set1_epi32(3), _mm256_set1_epi32(4));
            let (lo, hi) = super::planes(gp);
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

    /// The 8-lane partial dot product of decoded codes `w` with `x[0..64]`, summed exactly as
    /// [`row`] sums one group.
    ///
    /// # Safety
    /// AVX2 + FMA; `xg` valid for reads of 64 `f32`s.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn group_dot(w: &[__m256; 8], xg: *const f32) -> __m256 {
        // SAFETY: eight 8-element loads inside the caller's 64 `f32`s; AVX2 + FMA by contract.
        unsafe {
            let mut part = [_mm256_setzero_ps(); 4];
            for (k, wk) in w.iter().enumerate() {
                part[k % 4] = _mm256_fmadd_ps(*wk, _mm256_loadu_ps(xg.add(8 * k)), part[k % 4]);
            }
            _mm256_add_ps(_mm256_add_ps(part[0], part[1]), _mm256_add_ps(part[2], part[3]))
        }
    }

    /// `yt [rows, n]` = W `xs [n, cols]` for Q3 `W`: each group is decoded once for a block of up
    /// to [`super::super::MATMUL_BLOCK`] inputs, and each output equals [`matvec`]'s bit for bit.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn matmul(packed: &[u8], scales: &[f32], xs: &[f32], n: usize, yt: &mut [f32]) {
        const B: usize = super::super::MATMUL_BLOCK;
        assert!(n > 0 && xs.len().is_multiple_of(n) && yt.len().is_multiple_of(n));
        let (rows, cols) = (yt.len() / n, xs.len() / n);
        assert!(cols.is_multiple_of(GROUP_SIZE));
        let groups = cols / GROUP_SIZE;
        assert_eq!(packed.len(), size(size(rows, groups), Q3_GROUP_BYTES));
        assert_eq!(scales.len(), size(rows, groups));
        for (r, out) in yt.chunks_exact_mut(n).enumerate() {
            for (b, out) in out.chunks_mut(B).enumerate() {
                let mut acc = [_mm256_setzero_ps(); B];
                for g in 0..groups {
                    let gi = r * groups + g;
                    // SAFETY: group `gi` is inside `packed` and `scales` (asserts); input `b B + j`
                    // is a row of `xs` and its group `g` spans 64 of its `cols` values.
                    unsafe {
                        let w = decode(packed.as_ptr().add(gi * Q3_GROUP_BYTES));
                        let sc = _mm256_set1_ps(*scales.get_unchecked(gi));
                        for (j, a) in acc[..out.len()].iter_mut().enumerate() {
                            let xg = xs.as_ptr().add((b * B + j) * cols + g * GROUP_SIZE);
                            *a = _mm256_fmadd_ps(group_dot(&w, xg), sc, *a);
                        }
                    }
                }
                for (o, &a) in out.iter_mut().zip(&acc) {
                    // SAFETY: register-only; CPU features by contract.
                    *o = unsafe { hsum256(a) };
                }
            }
        }
    }
}

/// AVX-512F: for 16 elements at a time, their 32 low-plane bits and (pre-shifted) 16 high-plane bits
/// are broadcast separately and shifted per lane (`vpsrlvd`) to extract each 3-bit code.
#[cfg(target_arch = "x86_64")]
// AVX-512 intrinsics and `target_feature(enable = "avx512f")` are stable since Rust 1.89: this
// module needs rustc >= 1.89 whatever `rust-version` says (see the module docs of `kernels`).
#[allow(clippy::incompatible_msrv)]
pub(super) mod avx512 {
    use super::super::size;
    use super::super::x86::hsum512;
    use crate::quant::{GROUP_SIZE, Q3_GROUP_BYTES};
    use std::arch::x86_64::*;

    /// One row: `groups` groups of packed bytes at `p`, scales at `s`, input at `x`.
    ///
    /// # Safety
    /// AVX-512F + AVX2 + FMA; `p` valid for `groups * 24` bytes, `s` for `groups` and `x` for
    /// `groups * 64` `f32`s.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn row(p: *const u8, s: *const f32, x: *const f32, groups: usize) -> f32 {
        // SAFETY: group `g` reads bytes `24 g..24 g + 24`, scale `g` and `x[64 g..64 g + 64]`, all
        // inside the caller's ranges; CPU features by contract.
        unsafe {
            // lane t of 16: low bits at 2t of the low word, high bit at t of the (<< 2) high word
            let sh_lo = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            let sh_hi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            let (three, four) = (_mm512_set1_epi32(3), _mm512_set1_epi32(4));
            let mut acc = _mm512_setzero_ps();
            for g in 0..groups {
                let (lo, hi) = super::planes(p.add(g * Q3_GROUP_BYTES));
                let xg = x.add(g * GROUP_SIZE);
                let mut part = [_mm512_setzero_ps(); 4];
                for (k, part_k) in part.iter_mut().enumerate() {
                    let l32 = (lo[k / 2] >> (32 * (k % 2))) as u32;
                    let h16 = (((hi >> (16 * k)) & 0xffff) << 2) as u32;
                    let vl = _mm512_set1_epi32(l32 as i32);
                    let vh = _mm512_set1_epi32(h16 as i32);
                    let c = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srlv_epi32(vl, sh_lo), three),
                        _mm512_and_si512(_mm512_srlv_epi32(vh, sh_hi), four),
                    );
                    let w = _mm512_cvtepi32_ps(_mm512_sub_epi32(c, four));
                    *part_k = _mm512_fmadd_ps(w, _mm512_loadu_ps(xg.add(16 * k)), *part_k);
                }
                let gsum = _mm512_add_ps(_mm512_add_ps(part[0], part[1]), _mm512_add_ps(part[2], part[3]));
                acc = _mm512_fmadd_ps(gsum, _mm512_set1_ps(*s.add(g)), acc);
            }
            hsum512(acc)
        }
    }

    /// `y = W x` for Q3 `W [y.len(), x.len()]`.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX2 and FMA.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(crate) unsafe fn matvec(packed: &[u8], scales: &[f32], x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len() % GROUP_SIZE, 0);
        let groups = x.len() / GROUP_SIZE;
        assert_eq!(packed.len(), size(size(y.len(), groups), Q3_GROUP_BYTES));
        assert_eq!(scales.len(), size(y.len(), groups));
        for (r, out) in y.iter_mut().enumerate() {
            let gi = r * groups;
            // SAFETY: row `r` owns groups `gi..gi + groups`, inside both buffers by the asserts.
            *out =
                unsafe { row(packed.as_ptr().add(gi * Q3_GROUP_BYTES), scales.as_ptr().add(gi), x.as_ptr(), groups) };
        }
    }

    /// The 64 codes of the group at `gp` as 4 vectors of 16 `f32`s, as [`row`] extracts them.
    ///
    /// # Safety
    /// AVX-512F; `gp` valid for reads of 24 bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn decode(gp: *const u8) -> [__m512; 4] {
        // SAFETY: `planes` reads the caller's 24 bytes; the rest is register-only; CPU features by
        // contract.
        unsafe {
            let sh_lo = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            let sh_hi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            let (three, four) = (_mm512_set1_epi32(3), _mm512_set1_epi32(4));
            let (lo, hi) = super::planes(gp);
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

    /// The 16-lane partial dot product of decoded codes `w` with `x[0..64]`, summed exactly as
    /// [`row`] sums one group.
    ///
    /// # Safety
    /// AVX-512F + AVX2 + FMA; `xg` valid for reads of 64 `f32`s.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn group_dot(w: &[__m512; 4], xg: *const f32) -> __m512 {
        // SAFETY: four 16-element loads inside the caller's 64 `f32`s; CPU features by contract.
        unsafe {
            let mut part = [_mm512_setzero_ps(); 4];
            for (k, part_k) in part.iter_mut().enumerate() {
                *part_k = _mm512_fmadd_ps(w[k], _mm512_loadu_ps(xg.add(16 * k)), *part_k);
            }
            _mm512_add_ps(_mm512_add_ps(part[0], part[1]), _mm512_add_ps(part[2], part[3]))
        }
    }

    /// `yt [rows, n]` = W `xs [n, cols]` for Q3 `W`: each group is decoded once for a block of up
    /// to [`super::super::MATMUL_BLOCK`] inputs, and each output equals [`matvec`]'s bit for bit.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX2 and FMA.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(crate) unsafe fn matmul(packed: &[u8], scales: &[f32], xs: &[f32], n: usize, yt: &mut [f32]) {
        const B: usize = super::super::MATMUL_BLOCK;
        assert!(n > 0 && xs.len().is_multiple_of(n) && yt.len().is_multiple_of(n));
        let (rows, cols) = (yt.len() / n, xs.len() / n);
        assert!(cols.is_multiple_of(GROUP_SIZE));
        let groups = cols / GROUP_SIZE;
        assert_eq!(packed.len(), size(size(rows, groups), Q3_GROUP_BYTES));
        assert_eq!(scales.len(), size(rows, groups));
        for (r, out) in yt.chunks_exact_mut(n).enumerate() {
            for (b, out) in out.chunks_mut(B).enumerate() {
                let mut acc = [_mm512_setzero_ps(); B];
                for g in 0..groups {
                    let gi = r * groups + g;
                    // SAFETY: group `gi` is inside `packed` and `scales` (asserts); input `b B + j`
                    // is a row of `xs` and its group `g` spans 64 of its `cols` values.
                    unsafe {
                        let w = decode(packed.as_ptr().add(gi * Q3_GROUP_BYTES));
                        let sc = _mm512_set1_ps(*scales.get_unchecked(gi));
                        for (j, a) in acc[..out.len()].iter_mut().enumerate() {
                            let xg = xs.as_ptr().add((b * B + j) * cols + g * GROUP_SIZE);
                            *a = _mm512_fmadd_ps(group_dot(&w, xg), sc, *a);
                        }
                    }
                }
                for (o, &a) in out.iter_mut().zip(&acc) {
                    // SAFETY: register-only; CPU features by contract.
                    *o = unsafe { hsum512(a) };
                }
            }
        }
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
