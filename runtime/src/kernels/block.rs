//! The matrix products shared by the group-quantized layouts of [`crate::quant`] (Q4, Q3): per row,
//! groups of 64 weights in [`GroupFormat::BYTES`] bytes and one `f32` scale per group;
//! `y[r] = sum_g scale[r, g] * sum_{j < 64} q[r, g, j] * x[64 g + j]`.
//!
//! A format says how to decode one group ([`GroupFormat`]: the scalar codes, and at each SIMD level
//! the 64 codes as `f32` vectors in element order); the skeletons here, one per level, do the rest
//! the same way for every format: each group's dot product of codes and `x` first, then times the
//! group scale, accumulated left to right. The matrix-matrix skeleton decodes each group once for a
//! block of up to [`super::MATMUL_BLOCK`] inputs and sums every input exactly as the matrix-vector
//! skeleton does, so each output equals the matrix-vector product's bit for bit.

use crate::quant::GROUP_SIZE;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{__m256, __m512};

/// A group-quantized layout: how to decode one group of [`GROUP_SIZE`] weights.
pub(super) trait GroupFormat {
    /// Bytes of one packed group.
    const BYTES: usize;

    /// The 64 signed codes of one group (`group.len() == BYTES`), for the scalar reference.
    fn codes(group: &[u8]) -> [i8; GROUP_SIZE];

    /// The 64 codes of the group at `gp` as 8 vectors of 8 `f32`s, elements `8k..8k + 8` in vector `k`.
    ///
    /// # Safety
    /// AVX2 + FMA; `gp` valid for reads of `BYTES` bytes.
    #[cfg(target_arch = "x86_64")]
    unsafe fn decode_avx2(gp: *const u8) -> [__m256; 8];

    /// The 64 codes of the group at `gp` as 4 vectors of 16 `f32`s, elements `16k..16k + 16` in
    /// vector `k`.
    ///
    /// # Safety
    /// AVX-512F + AVX2 + FMA; `gp` valid for reads of `BYTES` bytes.
    #[cfg(target_arch = "x86_64")]
    unsafe fn decode_avx512(gp: *const u8) -> [__m512; 4];
}

/// Portable reference: decode a group with [`GroupFormat::codes`], take its dot product with the
/// 8-lane scalar `dot`, accumulate `group_dot * scale` left to right.
pub(super) mod scalar {
    use super::super::dense::scalar::dot;
    use super::GroupFormat;
    use crate::quant::GROUP_SIZE;

    /// `y = W x` for `W [y.len(), x.len()]` in format `F`; shapes checked by the caller.
    pub(crate) fn matvec<F: GroupFormat>(packed: &[u8], scales: &[f32], x: &[f32], y: &mut [f32]) {
        let groups = x.len() / GROUP_SIZE;
        for (r, out) in y.iter_mut().enumerate() {
            let mut acc = 0f32;
            for (g, xg) in x.chunks_exact(GROUP_SIZE).enumerate() {
                let gi = r * groups + g;
                let codes = F::codes(&packed[gi * F::BYTES..(gi + 1) * F::BYTES]);
                acc += dot(&codes.map(f32::from), xg) * scales[gi];
            }
            *out = acc;
        }
    }

    /// `yt [rows, n]` = W `xs [n, cols]` in format `F`: each group is decoded once for every input of
    /// a block of [`super::super::MATMUL_BLOCK`] and its dot products accumulated exactly as
    /// [`matvec`] does, so each output equals [`matvec`]'s bit for bit.
    pub(crate) fn matmul<F: GroupFormat>(packed: &[u8], scales: &[f32], xs: &[f32], n: usize, yt: &mut [f32]) {
        const B: usize = super::super::MATMUL_BLOCK;
        let cols = xs.len() / n;
        let groups = cols / GROUP_SIZE;
        for (r, out) in yt.chunks_exact_mut(n).enumerate() {
            for (b, out) in out.chunks_mut(B).enumerate() {
                let mut acc = [0f32; B];
                for g in 0..groups {
                    let gi = r * groups + g;
                    let codes = F::codes(&packed[gi * F::BYTES..(gi + 1) * F::BYTES]).map(f32::from);
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

/// The SIMD skeleton of one level, written once for every level: `$feat` is the level's target
/// features, `$lanes` the lanes of its `f32` vector and `$decode` the [`GroupFormat`] decoder that
/// gives a group as `64 / $lanes` such vectors. The level module names its vector type `V` and its
/// intrinsics `vzero`, `vload`, `vset1`, `vfmadd`, `vadd`, and `vhsum` its fixed-order horizontal sum. A
/// group's vectors are fused with `x` into 4 partial sums (vector `k` into sum `k % 4`), added as
/// `(p0 + p1) + (p2 + p3)`, then fused with the group scale into the row's accumulator.
macro_rules! block_level {
    ($feat:literal, $lanes:literal, $decode:ident) => {
        /// The partial dot product of decoded codes `w` with `xg[0..64]`.
        ///
        /// # Safety
        /// The level's CPU features; `xg` valid for reads of 64 `f32`s.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn group_dot(w: &[V; GROUP_SIZE / $lanes], xg: *const f32) -> V {
            // SAFETY: `64 / $lanes` loads of `$lanes` elements inside the caller's 64 `f32`s; CPU
            // features by contract.
            unsafe {
                let mut part = [vzero(); 4];
                for (k, wk) in w.iter().enumerate() {
                    part[k % 4] = vfmadd(*wk, vload(xg.add($lanes * k)), part[k % 4]);
                }
                vadd(vadd(part[0], part[1]), vadd(part[2], part[3]))
            }
        }

        /// One row: `groups` groups of packed bytes at `p`, scales at `s`, input at `x`.
        ///
        /// # Safety
        /// The level's CPU features; `p` valid for `groups * F::BYTES` bytes, `s` for `groups` and
        /// `x` for `groups * 64` `f32`s.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn row<F: GroupFormat>(p: *const u8, s: *const f32, x: *const f32, groups: usize) -> f32 {
            // SAFETY: group `g` reads bytes `F::BYTES * g..F::BYTES * (g + 1)`, scale `g` and
            // `x[64 g..64 g + 64]`, all inside the caller's ranges; CPU features by contract.
            unsafe {
                let mut acc = vzero();
                for g in 0..groups {
                    let w = F::$decode(p.add(g * F::BYTES));
                    let gsum = group_dot(&w, x.add(g * GROUP_SIZE));
                    acc = vfmadd(gsum, vset1(*s.add(g)), acc);
                }
                vhsum(acc)
            }
        }

        /// `y = W x` for `W [y.len(), x.len()]` in format `F`.
        ///
        /// # Safety
        /// The CPU must support the level's features.
        #[target_feature(enable = $feat)]
        pub(crate) unsafe fn matvec<F: GroupFormat>(packed: &[u8], scales: &[f32], x: &[f32], y: &mut [f32]) {
            assert_eq!(x.len() % GROUP_SIZE, 0);
            let groups = x.len() / GROUP_SIZE;
            assert_eq!(packed.len(), size(size(y.len(), groups), F::BYTES));
            assert_eq!(scales.len(), size(y.len(), groups));
            for (r, out) in y.iter_mut().enumerate() {
                let gi = r * groups;
                // SAFETY: row `r` owns groups `gi..gi + groups`, inside both buffers by the asserts.
                *out = unsafe {
                    row::<F>(packed.as_ptr().add(gi * F::BYTES), scales.as_ptr().add(gi), x.as_ptr(), groups)
                };
            }
        }

        /// `yt [rows, n]` = W `xs [n, cols]` in format `F`: each group is decoded once for a block of
        /// up to [`super::super::MATMUL_BLOCK`] inputs, and each output equals [`matvec`]'s bit for bit.
        ///
        /// # Safety
        /// The CPU must support the level's features.
        #[target_feature(enable = $feat)]
        pub(crate) unsafe fn matmul<F: GroupFormat>(
            packed: &[u8],
            scales: &[f32],
            xs: &[f32],
            n: usize,
            yt: &mut [f32],
        ) {
            const B: usize = super::super::MATMUL_BLOCK;
            assert!(n > 0 && xs.len().is_multiple_of(n) && yt.len().is_multiple_of(n));
            let (rows, cols) = (yt.len() / n, xs.len() / n);
            assert!(cols.is_multiple_of(GROUP_SIZE));
            let groups = cols / GROUP_SIZE;
            assert_eq!(packed.len(), size(size(rows, groups), F::BYTES));
            assert_eq!(scales.len(), size(rows, groups));
            for (r, out) in yt.chunks_exact_mut(n).enumerate() {
                for (b, out) in out.chunks_mut(B).enumerate() {
                    let mut acc = [vzero(); B];
                    for g in 0..groups {
                        let gi = r * groups + g;
                        // SAFETY: group `gi` is inside `packed` and `scales` (asserts); input `b B + j`
                        // is a row of `xs` and its group `g` spans 64 of its `cols` values.
                        unsafe {
                            let w = F::$decode(packed.as_ptr().add(gi * F::BYTES));
                            let sc = vset1(*scales.get_unchecked(gi));
                            for (j, a) in acc[..out.len()].iter_mut().enumerate() {
                                let xg = xs.as_ptr().add((b * B + j) * cols + g * GROUP_SIZE);
                                *a = vfmadd(group_dot(&w, xg), sc, *a);
                            }
                        }
                    }
                    for (o, &a) in out.iter_mut().zip(&acc) {
                        // SAFETY: register-only; CPU features by contract.
                        *o = unsafe { vhsum(a) };
                    }
                }
            }
        }
    };
}

/// AVX2 + FMA: 8 vectors of 8 lanes per group.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::super::size;
    use super::super::x86::hsum256 as vhsum;
    use super::GroupFormat;
    use crate::quant::GROUP_SIZE;
    use std::arch::x86_64::{
        __m256 as V, _mm256_add_ps as vadd, _mm256_fmadd_ps as vfmadd, _mm256_loadu_ps as vload,
        _mm256_set1_ps as vset1, _mm256_setzero_ps as vzero,
    };

    block_level!("avx2,fma", 8, decode_avx2);
}

/// AVX-512F: 4 vectors of 16 lanes per group.
#[cfg(target_arch = "x86_64")]
// AVX-512 intrinsics and `target_feature(enable = "avx512f")` are stable since Rust 1.89: this
// module needs rustc >= 1.89 whatever `rust-version` says (see the module docs of `kernels`).
#[allow(clippy::incompatible_msrv)]
pub(super) mod avx512 {
    use super::super::size;
    use super::super::x86::hsum512 as vhsum;
    use super::GroupFormat;
    use crate::quant::GROUP_SIZE;
    use std::arch::x86_64::{
        __m512 as V, _mm512_add_ps as vadd, _mm512_fmadd_ps as vfmadd, _mm512_loadu_ps as vload,
        _mm512_set1_ps as vset1, _mm512_setzero_ps as vzero,
    };

    block_level!("avx512f,avx2,fma", 16, decode_avx512);
}
