//! Q4 matrix-vector product straight from the packed layout of [`crate::quant`]: per row, groups of
//! 64 weights in 32 bytes (element `2i` in the low nibble of byte `i`, code `nibble - 8`) and one `f32`
//! scale; `y[r] = sum_g scale[r, g] * sum_{j < 64} q[r, g, j] * x[64 g + j]`.
//!
//! Every level computes each group's dot product of codes and `x` first, then multiplies it by the
//! group scale and accumulates.

/// Portable reference: decode a group with [`crate::quant::q4_group_codes`], take its dot product with
/// the 8-lane scalar `dot`, accumulate `group_dot * scale` left to right.
pub(super) mod scalar {
    use super::super::dense::scalar::dot;
    use crate::quant::{q4_group_codes, GROUP_SIZE, Q4_GROUP_BYTES};

    /// `y = W x` for Q4 `W [y.len(), x.len()]`; shapes checked by the caller.
    pub(crate) fn matvec(packed: &[u8], scales: &[f32], x: &[f32], y: &mut [f32]) {
        let groups = x.len() / GROUP_SIZE;
        for (r, out) in y.iter_mut().enumerate() {
            let mut acc = 0f32;
            for (g, xg) in x.chunks_exact(GROUP_SIZE).enumerate() {
                let gi = r * groups + g;
                let bytes = &packed[gi * Q4_GROUP_BYTES..(gi + 1) * Q4_GROUP_BYTES];
                let codes = q4_group_codes(bytes.try_into().expect("32-byte group"));
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
                    let bytes = &packed[gi * Q4_GROUP_BYTES..(gi + 1) * Q4_GROUP_BYTES];
                    let codes = q4_group_codes(bytes.try_into().expect("32-byte group")).map(f32::from);
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

/// AVX2 + FMA: 16 packed bytes are widened to 16-bit lanes and their nibbles re-interleaved so the
/// register holds the 32 codes in element order (`lo | hi << 8` per lane), `- 8` is applied to the
/// bytes, and 8 codes at a time are widened to `f32` and fused into 4 partial sums per group.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::super::size;
    use super::super::x86::hsum256;
    use crate::quant::{GROUP_SIZE, Q4_GROUP_BYTES};
    use std::arch::x86_64::*;

    /// The 32 signed codes of 16 packed bytes at `p`, in element order, one per byte.
    ///
    /// # Safety
    /// AVX2; `p` valid for reads of 16 bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn codes32(p: *const u8) -> __m256i {
        // SAFETY: one unaligned 16-byte load inside the caller's range; AVX2 by contract.
        unsafe {
            let w16 = _mm256_cvtepu8_epi16(_mm_loadu_si128(p.cast::<__m128i>()));
            let lo = _mm256_and_si256(w16, _mm256_set1_epi16(0x000f));
            let hi = _mm256_slli_epi16::<4>(_mm256_and_si256(w16, _mm256_set1_epi16(0x00f0)));
            _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(8))
        }
    }

    /// The low 8 `i8`s of `v` as `f32`s.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[inline]
    // Since Rust 1.87 these register-only intrinsics are safe inside a matching
    // `target_feature` function; the `unsafe` block keeps the crate building on 1.85.
    #[allow(unused_unsafe)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn cvt(v: __m128i) -> __m256 {
        // SAFETY: register-only intrinsics; AVX2 by contract.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)) }
    }

    /// One row: `groups` groups of packed bytes at `p`, scales at `s`, input at `x`.
    ///
    /// # Safety
    /// AVX2 + FMA; `p` valid for `groups * 32` bytes, `s` for `groups` and `x` for `groups * 64` `f32`s.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn row(p: *const u8, s: *const f32, x: *const f32, groups: usize) -> f32 {
        // SAFETY: group `g` reads bytes `32 g..32 g + 32`, scale `g` and `x[64 g..64 g + 64]`, all
        // inside the caller's ranges; AVX2 + FMA by contract.
        unsafe {
            let mut acc = _mm256_setzero_ps();
            for g in 0..groups {
                let (gp, xg) = (p.add(g * Q4_GROUP_BYTES), x.add(g * GROUP_SIZE));
                let mut part = [_mm256_setzero_ps(); 4];
                for h in 0..2 {
                    let c = codes32(gp.add(16 * h));
                    let lo = _mm256_castsi256_si128(c);
                    let hi = _mm256_extracti128_si256::<1>(c);
                    let q = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
                    for (k, (part_k, qk)) in part.iter_mut().zip(q).enumerate() {
                        let xv = _mm256_loadu_ps(xg.add(32 * h + 8 * k));
                        *part_k = _mm256_fmadd_ps(cvt(qk), xv, *part_k);
                    }
                }
                let gsum = _mm256_add_ps(_mm256_add_ps(part[0], part[1]), _mm256_add_ps(part[2], part[3]));
                acc = _mm256_fmadd_ps(gsum, _mm256_set1_ps(*s.add(g)), acc);
            }
            hsum256(acc)
        }
    }

    /// `y = W x` for Q4 `W [y.len(), x.len()]`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn matvec(packed: &[u8], scales: &[f32], x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len() % GROUP_SIZE, 0);
        let groups = x.len() / GROUP_SIZE;
        assert_eq!(packed.len(), size(size(y.len(), groups), Q4_GROUP_BYTES));
        assert_eq!(scales.len(), size(y.len(), groups));
        for (r, out) in y.iter_mut().enumerate() {
            let gi = r * groups;
            // SAFETY: row `r` owns groups `gi..gi + groups`, inside both buffers by the asserts.
            *out =
                unsafe { row(packed.as_ptr().add(gi * Q4_GROUP_BYTES), scales.as_ptr().add(gi), x.as_ptr(), groups) };
        }
    }

    /// The 64 codes of the group at `gp` as 8 vectors of 8 `f32`s, in the order [`row`] uses them.
    ///
    /// # Safety
    /// AVX2; `gp` valid for reads of 32 bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn decode(gp: *const u8) -> [__m256; 8] {
        // SAFETY: two 16-byte loads inside the caller's 32 bytes; AVX2 by contract.
        unsafe {
            let mut out = [_mm256_setzero_ps(); 8];
            for h in 0..2 {
                let c = codes32(gp.add(16 * h));
                let lo = _mm256_castsi256_si128(c);
                let hi = _mm256_extracti128_si256::<1>(c);
                let q = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
                for (k, qk) in q.into_iter().enumerate() {
                    out[4 * h + k] = cvt(qk);
                }
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
            for h in 0..2 {
                for (k, part_k) in part.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(xg.add(32 * h + 8 * k));
                    *part_k = _mm256_fmadd_ps(w[4 * h + k], xv, *part_k);
                }
            }
            _mm256_add_ps(_mm256_add_ps(part[0], part[1]), _mm256_add_ps(part[2], part[3]))
        }
    }

    /// `yt [rows, n]` = W `xs [n, cols]` for Q4 `W`: each group is decoded once for a block of up
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
        assert_eq!(packed.len(), size(size(rows, groups), Q4_GROUP_BYTES));
        assert_eq!(scales.len(), size(rows, groups));
        for (r, out) in yt.chunks_exact_mut(n).enumerate() {
            for (b, out) in out.chunks_mut(B).enumerate() {
                let mut acc = [_mm256_setzero_ps(); B];
                for g in 0..groups {
                    let gi = r * groups + g;
                    // SAFETY: group `gi` is inside `packed` and `scales` (asserts); input `b B + j`
                    // is a row of `xs` and its group `g` spans 64 of its `cols` values.
                    unsafe {
                        let w = decode(packed.as_ptr().add(gi * Q4_GROUP_BYTES));
                        let sc = _mm256_set1_ps(*scales.get_unchecked(gi));
                        for (j, a) in acc[..out.len()].iter_mut().enumerate() {
                            let xg = xs.as_ptr().add((b * B + j) * cols + g * GROUP_SIZE);
                            *a = _mm256_fmadd_ps(group_dot(&w, xg), sc, *a);
                        }
                    }
                }
                for (o, &a) in out.iter_mut().zip(&acc) {
                    // SAFETY: register-only; AVX2 by contract.
                    *o = unsafe { hsum256(a) };
                }
            }
        }
    }
}

/// AVX-512F: the AVX2 nibble re-interleave for 16 bytes, then 16 codes at a time widened to `f32`
/// (`vpmovsxbd`, AVX-512F) and fused into 4 partial sums per group.
#[cfg(target_arch = "x86_64")]
// AVX-512 intrinsics and `target_feature(enable = "avx512f")` are stable since Rust 1.89: this
// module needs rustc >= 1.89 whatever `rust-version` says (see the module docs of `kernels`).
#[allow(clippy::incompatible_msrv)]
pub(super) mod avx512 {
    use super::super::size;
    use super::super::x86::hsum512;
    use crate::quant::{GROUP_SIZE, Q4_GROUP_BYTES};
    use std::arch::x86_64::*;

    /// 16 `i8`s as `f32`s.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[inline]
    // Since Rust 1.87 these register-only intrinsics are safe inside a matching
    // `target_feature` function; the `unsafe` block keeps the crate building on 1.85.
    #[allow(unused_unsafe)]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn cvt(v: __m128i) -> __m512 {
        // SAFETY: register-only intrinsics; AVX-512F by contract.
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)) }
    }

    /// One row: `groups` groups of packed bytes at `p`, scales at `s`, input at `x`.
    ///
    /// # Safety
    /// AVX-512F + AVX2 + FMA; `p` valid for `groups * 32` bytes, `s` for `groups` and `x` for
    /// `groups * 64` `f32`s.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn row(p: *const u8, s: *const f32, x: *const f32, groups: usize) -> f32 {
        // SAFETY: group `g` reads bytes `32 g..32 g + 32`, scale `g` and `x[64 g..64 g + 64]`, all
        // inside the caller's ranges; CPU features by contract (AVX-512F implies the AVX2 used by
        // `codes32`, which is also detected).
        unsafe {
            let mut acc = _mm512_setzero_ps();
            for g in 0..groups {
                let (gp, xg) = (p.add(g * Q4_GROUP_BYTES), x.add(g * GROUP_SIZE));
                let mut part = [_mm512_setzero_ps(); 4];
                for h in 0..2 {
                    let c = super::avx2::codes32(gp.add(16 * h));
                    let lo = _mm256_castsi256_si128(c);
                    let hi = _mm256_extracti128_si256::<1>(c);
                    let x0 = _mm512_loadu_ps(xg.add(32 * h));
                    let x1 = _mm512_loadu_ps(xg.add(32 * h + 16));
                    part[2 * h] = _mm512_fmadd_ps(cvt(lo), x0, part[2 * h]);
                    part[2 * h + 1] = _mm512_fmadd_ps(cvt(hi), x1, part[2 * h + 1]);
                }
                let gsum = _mm512_add_ps(_mm512_add_ps(part[0], part[1]), _mm512_add_ps(part[2], part[3]));
                acc = _mm512_fmadd_ps(gsum, _mm512_set1_ps(*s.add(g)), acc);
            }
            hsum512(acc)
        }
    }

    /// `y = W x` for Q4 `W [y.len(), x.len()]`.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX2 and FMA.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(crate) unsafe fn matvec(packed: &[u8], scales: &[f32], x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len() % GROUP_SIZE, 0);
        let groups = x.len() / GROUP_SIZE;
        assert_eq!(packed.len(), size(size(y.len(), groups), Q4_GROUP_BYTES));
        assert_eq!(scales.len(), size(y.len(), groups));
        for (r, out) in y.iter_mut().enumerate() {
            let gi = r * groups;
            // SAFETY: row `r` owns groups `gi..gi + groups`, inside both buffers by the asserts.
            *out =
                unsafe { row(packed.as_ptr().add(gi * Q4_GROUP_BYTES), scales.as_ptr().add(gi), x.as_ptr(), groups) };
        }
    }

    /// The 64 codes of the group at `gp` as 4 vectors of 16 `f32`s, in the order [`row`] uses them.
    ///
    /// # Safety
    /// AVX-512F + AVX2; `gp` valid for reads of 32 bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn decode(gp: *const u8) -> [__m512; 4] {
        // SAFETY: two 16-byte loads inside the caller's 32 bytes; CPU features by contract.
        unsafe {
            let mut out = [_mm512_setzero_ps(); 4];
            for h in 0..2 {
                let c = super::avx2::codes32(gp.add(16 * h));
                out[2 * h] = cvt(_mm256_castsi256_si128(c));
                out[2 * h + 1] = cvt(_mm256_extracti128_si256::<1>(c));
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

    /// `yt [rows, n]` = W `xs [n, cols]` for Q4 `W`: each group is decoded once for a block of up
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
        assert_eq!(packed.len(), size(size(rows, groups), Q4_GROUP_BYTES));
        assert_eq!(scales.len(), size(rows, groups));
        for (r, out) in yt.chunks_exact_mut(n).enumerate() {
            for (b, out) in out.chunks_mut(B).enumerate() {
                let mut acc = [_mm512_setzero_ps(); B];
                for g in 0..groups {
                    let gi = r * groups + g;
                    // SAFETY: group `gi` is inside `packed` and `scales` (asserts); input `b B + j`
                    // is a row of `xs` and its group `g` spans 64 of its `cols` values.
                    unsafe {
                        let w = decode(packed.as_ptr().add(gi * Q4_GROUP_BYTES));
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
