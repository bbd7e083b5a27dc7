//! Dense kernels: `f32`, `bf16` and per-row-scaled `i8` matrix-vector products, `dot` and `axpy`.
//!
//! Shapes are checked by the caller ([`super::Kernels`]); the SIMD twins assert them again because
//! their memory safety depends on them. `bf16` widens to `f32` by a 16-bit shift (exact).

use half::bf16;

/// `f32` value of a `bf16` (exact; the same bits the SIMD twins produce, NaN payloads included).
#[inline(always)]
fn widen(v: bf16) -> f32 {
    f32::from_bits(u32::from(v.to_bits()) << 16)
}

/// The attention loops over the KV cache, for a level module whose `dot` and `axpy` take
/// `(&[f32], &[f32])` and `(f32, &[f32], &mut [f32])`: one call per head instead of one per cached
/// position, so the per-position work is inlined (`$feat` is the module's target features; the
/// scalar module writes the same two loops as safe functions). Each output is exactly what `dot` /
/// `axpy` give.
macro_rules! attention_rows {
    ($feat:literal) => {
        /// `out[t] = dot(q, rows[t * stride..t * stride + q.len()]) * scale`.
        ///
        /// # Safety
        /// The CPU must support the module's target features.
        #[target_feature(enable = $feat)]
        pub(crate) unsafe fn dot_rows(q: &[f32], rows: &[f32], stride: usize, scale: f32, out: &mut [f32]) {
            let hd = q.len();
            for (t, o) in out.iter_mut().enumerate() {
                // SAFETY: `dot` asserts equal lengths; the CPU features are the caller's contract.
                *o = unsafe { dot(q, &rows[t * stride..t * stride + hd]) } * scale;
            }
        }

        /// `out = 0`, then `axpy(w[t], rows[t * stride..t * stride + out.len()], out)` for each `t`
        /// in order.
        ///
        /// # Safety
        /// The CPU must support the module's target features.
        #[target_feature(enable = $feat)]
        pub(crate) unsafe fn weighted_rows(w: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
            let hd = out.len();
            out.fill(0.0);
            for (t, &a) in w.iter().enumerate() {
                // SAFETY: `axpy` asserts equal lengths; the CPU features are the caller's contract.
                unsafe { axpy(a, &rows[t * stride..t * stride + hd], out) };
            }
        }
    };
}

/// The row loops of a SIMD level module over its pointer dot products `dot_ptr` (`f32`),
/// `dot_bf16_ptr` (`bf16` read as `u16`) and `dot_i8_ptr` (`i8`), each `(w, x, n) -> f32` over `n`
/// elements: `dot`, and the matrix-vector and matrix-matrix products of every dense layout (`$feat`
/// is the module's target features). A matrix-vector product is the matrix-matrix product of one
/// input: the same dot product per output, so each output of `matmul_*` is exactly `matvec_*`'s.
macro_rules! row_loops {
    ($feat:literal) => {
        /// `sum_i a[i] * b[i]`.
        ///
        /// # Safety
        /// The CPU must support the module's target features.
        #[target_feature(enable = $feat)]
        pub(crate) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
            assert_eq!(a.len(), b.len());
            // SAFETY: both slices hold `a.len()` elements; CPU features by contract.
            unsafe { dot_ptr(a.as_ptr(), b.as_ptr(), a.len()) }
        }

        /// `y = W x`, `W [y.len(), x.len()]` row-major `f32`.
        ///
        /// # Safety
        /// The CPU must support the module's target features.
        #[target_feature(enable = $feat)]
        pub(crate) unsafe fn matvec_f32(w: &[f32], x: &[f32], y: &mut [f32]) {
            // SAFETY: CPU features by contract; `matmul_f32` checks the shapes.
            unsafe { matmul_f32(w, x, 1, y) }
        }

        /// `y = W x`, `W [y.len(), x.len()]` row-major `bf16`.
        ///
        /// # Safety
        /// The CPU must support the module's target features.
        #[target_feature(enable = $feat)]
        pub(crate) unsafe fn matvec_bf16(w: &[bf16], x: &[f32], y: &mut [f32]) {
            // SAFETY: CPU features by contract; `matmul_bf16` checks the shapes.
            unsafe { matmul_bf16(w, x, 1, y) }
        }

        /// `y[r] = row_scales[r] * sum_c q[r, c] * x[c]`.
        ///
        /// # Safety
        /// The CPU must support the module's target features.
        #[target_feature(enable = $feat)]
        pub(crate) unsafe fn matvec_i8_rows(q: &[i8], row_scales: &[f32], x: &[f32], y: &mut [f32]) {
            // SAFETY: CPU features by contract; `matmul_i8_rows` checks the shapes.
            unsafe { matmul_i8_rows(q, row_scales, x, 1, y) }
        }

        /// `yt[r * n + t] = W[r, :] . xs[t, :]` for row-major `f32 W [rows, cols]`, `xs [n, cols]`,
        /// `yt [rows, n]`: each weight row is read once for all `n` inputs (it stays in L1 while they
        /// are read).
        ///
        /// # Safety
        /// The CPU must support the module's target features.
        #[target_feature(enable = $feat)]
        pub(crate) unsafe fn matmul_f32(w: &[f32], xs: &[f32], n: usize, yt: &mut [f32]) {
            assert!(n > 0 && xs.len().is_multiple_of(n) && yt.len().is_multiple_of(n));
            let (rows, cols) = (yt.len() / n, xs.len() / n);
            assert_eq!(w.len(), size(rows, cols));
            for (r, out) in yt.chunks_exact_mut(n).enumerate() {
                for (t, o) in out.iter_mut().enumerate() {
                    // SAFETY: row `r` of `w` and row `t` of `xs` hold `cols` elements each (asserts).
                    *o = unsafe { dot_ptr(w.as_ptr().add(r * cols), xs.as_ptr().add(t * cols), cols) };
                }
            }
        }

        /// [`matmul_f32`] for row-major `bf16 W`.
        ///
        /// # Safety
        /// The CPU must support the module's target features.
        #[target_feature(enable = $feat)]
        pub(crate) unsafe fn matmul_bf16(w: &[bf16], xs: &[f32], n: usize, yt: &mut [f32]) {
            assert!(n > 0 && xs.len().is_multiple_of(n) && yt.len().is_multiple_of(n));
            let (rows, cols) = (yt.len() / n, xs.len() / n);
            assert_eq!(w.len(), size(rows, cols));
            // `bf16` is `#[repr(transparent)]` over `u16`, so the pointer can be read as `u16`s.
            let wp = w.as_ptr().cast::<u16>();
            for (r, out) in yt.chunks_exact_mut(n).enumerate() {
                for (t, o) in out.iter_mut().enumerate() {
                    // SAFETY: as in `matmul_f32`; same layout as `u16` (see above).
                    *o = unsafe { dot_bf16_ptr(wp.add(r * cols), xs.as_ptr().add(t * cols), cols) };
                }
            }
        }

        /// [`matmul_f32`] for per-row-scaled `i8 q`.
        ///
        /// # Safety
        /// The CPU must support the module's target features.
        #[target_feature(enable = $feat)]
        pub(crate) unsafe fn matmul_i8_rows(q: &[i8], row_scales: &[f32], xs: &[f32], n: usize, yt: &mut [f32]) {
            assert!(n > 0 && xs.len().is_multiple_of(n) && yt.len().is_multiple_of(n));
            let (rows, cols) = (yt.len() / n, xs.len() / n);
            assert_eq!(q.len(), size(rows, cols));
            assert_eq!(row_scales.len(), rows);
            for ((r, out), &scale) in yt.chunks_exact_mut(n).enumerate().zip(row_scales) {
                for (t, o) in out.iter_mut().enumerate() {
                    // SAFETY: row `r` of `q` and row `t` of `xs` hold `cols` elements each (asserts).
                    *o = unsafe { dot_i8_ptr(q.as_ptr().add(r * cols), xs.as_ptr().add(t * cols), cols) } * scale;
                }
            }
        }
    };
}

/// Portable reference kernels. Each dot product keeps 8 independent lane sums (element `i` goes to
/// lane `i % 8`, so the compiler can vectorize it on any target), reduces them in a fixed order, then
/// adds the tail elements one by one.
pub(super) mod scalar {
    use super::{bf16, widen};

    const LANES: usize = 8;

    /// Fixed-order sum of the lane accumulators.
    #[inline(always)]
    fn reduce(acc: [f32; LANES]) -> f32 {
        ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
    }

    /// `sum_i f(w[i]) * x[i]` over `min(w.len(), x.len())` elements.
    #[inline(always)]
    fn dot_map<T: Copy>(w: &[T], x: &[f32], f: impl Fn(T) -> f32) -> f32 {
        let mut acc = [0f32; LANES];
        let (wc, xc) = (w.chunks_exact(LANES), x.chunks_exact(LANES));
        let (wr, xr) = (wc.remainder(), xc.remainder());
        for (a, b) in wc.zip(xc) {
            for l in 0..LANES {
                acc[l] += f(a[l]) * b[l];
            }
        }
        let mut s = reduce(acc);
        for (&a, &b) in wr.iter().zip(xr) {
            s += f(a) * b;
        }
        s
    }

    /// `sum_i a[i] * b[i]`.
    pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
        dot_map(a, b, |v| v)
    }

    /// `y[i] += a * x[i]` (separate multiply and add).
    pub(crate) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        for (yi, &xi) in y.iter_mut().zip(x) {
            *yi += a * xi;
        }
    }

    /// `out[t] = dot(q, rows[t * stride..t * stride + q.len()]) * scale`.
    pub(crate) fn dot_rows(q: &[f32], rows: &[f32], stride: usize, scale: f32, out: &mut [f32]) {
        let hd = q.len();
        for (t, o) in out.iter_mut().enumerate() {
            *o = dot(q, &rows[t * stride..t * stride + hd]) * scale;
        }
    }

    /// `out = 0`, then `axpy(w[t], rows[t * stride..t * stride + out.len()], out)` for each `t`.
    pub(crate) fn weighted_rows(w: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
        let hd = out.len();
        out.fill(0.0);
        for (t, &a) in w.iter().enumerate() {
            axpy(a, &rows[t * stride..t * stride + hd], out);
        }
    }

    /// `y = W x`, `W [y.len(), x.len()]` row-major `f32`.
    pub(crate) fn matvec_f32(w: &[f32], x: &[f32], y: &mut [f32]) {
        let cols = x.len();
        for (r, out) in y.iter_mut().enumerate() {
            *out = dot(&w[r * cols..(r + 1) * cols], x);
        }
    }

    /// `y = W x`, `W [y.len(), x.len()]` row-major `bf16`.
    pub(crate) fn matvec_bf16(w: &[bf16], x: &[f32], y: &mut [f32]) {
        let cols = x.len();
        for (r, out) in y.iter_mut().enumerate() {
            *out = dot_map(&w[r * cols..(r + 1) * cols], x, widen);
        }
    }

    /// `y[r] = row_scales[r] * sum_c q[r, c] * x[c]`.
    pub(crate) fn matvec_i8_rows(q: &[i8], row_scales: &[f32], x: &[f32], y: &mut [f32]) {
        let cols = x.len();
        for (r, out) in y.iter_mut().enumerate() {
            *out = dot_map(&q[r * cols..(r + 1) * cols], x, f32::from) * row_scales[r];
        }
    }

    /// `yt[r * n + t] = W[r, :] . xs[t, :]` for row-major `f32 W [rows, cols]`, `xs [n, cols]`,
    /// `yt [rows, n]`: each weight row is read once for all `n` inputs, and each output is exactly
    /// [`matvec_f32`]'s for that input.
    pub(crate) fn matmul_f32(w: &[f32], xs: &[f32], n: usize, yt: &mut [f32]) {
        let cols = xs.len() / n;
        for (r, out) in yt.chunks_exact_mut(n).enumerate() {
            let row = &w[r * cols..(r + 1) * cols];
            for (t, o) in out.iter_mut().enumerate() {
                *o = dot(row, &xs[t * cols..(t + 1) * cols]);
            }
        }
    }

    /// [`matmul_f32`] for row-major `bf16 W`; each output is exactly [`matvec_bf16`]'s.
    pub(crate) fn matmul_bf16(w: &[bf16], xs: &[f32], n: usize, yt: &mut [f32]) {
        let cols = xs.len() / n;
        for (r, out) in yt.chunks_exact_mut(n).enumerate() {
            let row = &w[r * cols..(r + 1) * cols];
            for (t, o) in out.iter_mut().enumerate() {
                *o = dot_map(row, &xs[t * cols..(t + 1) * cols], widen);
            }
        }
    }

    /// [`matmul_f32`] for per-row-scaled `i8 q`; each output is exactly [`matvec_i8_rows`]'s.
    pub(crate) fn matmul_i8_rows(q: &[i8], row_scales: &[f32], xs: &[f32], n: usize, yt: &mut [f32]) {
        let cols = xs.len() / n;
        for (r, out) in yt.chunks_exact_mut(n).enumerate() {
            let row = &q[r * cols..(r + 1) * cols];
            for (t, o) in out.iter_mut().enumerate() {
                *o = dot_map(row, &xs[t * cols..(t + 1) * cols], f32::from) * row_scales[r];
            }
        }
    }
}

/// AVX2 + FMA twins: 4 accumulators of 8 lanes (32 elements per step), then 8 at a time into the first
/// accumulator, a fixed-order horizontal sum, and a fused scalar tail.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::super::size;
    use super::super::x86::{cvt_i8x8, hsum256};
    use half::bf16;
    use std::arch::x86_64::*;

    /// Adds the four accumulators as `(a0 + a1) + (a2 + a3)` and sums the lanes.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn finish(acc: [__m256; 4]) -> f32 {
        // SAFETY: register-only intrinsics; AVX2 is guaranteed by the caller.
        unsafe { hsum256(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]))) }
    }

    /// `sum_{i < n} a[i] * b[i]`.
    ///
    /// # Safety
    /// AVX2 + FMA; `a` and `b` valid for reads of `n` `f32`s.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_ptr(a: *const f32, b: *const f32, n: usize) -> f32 {
        // SAFETY: every load reads 8 elements at offset `i` with `i + 8 <= n`, or one at `i < n`;
        // the caller guarantees `n` readable elements behind both pointers and AVX2 + FMA.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i + 32 <= n {
                for (k, acc_k) in acc.iter_mut().enumerate() {
                    let o = i + 8 * k;
                    *acc_k = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(o)), _mm256_loadu_ps(b.add(o)), *acc_k);
                }
                i += 32;
            }
            while i + 8 <= n {
                acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), acc[0]);
                i += 8;
            }
            let mut s = finish(acc);
            while i < n {
                s = (*a.add(i)).mul_add(*b.add(i), s);
                i += 1;
            }
            s
        }
    }

    /// 8 `bf16` at `p` widened to `f32`.
    ///
    /// # Safety
    /// AVX2; `p` valid for reads of 8 `u16`s.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load_bf16x8(p: *const u16) -> __m256 {
        // SAFETY: one unaligned 16-byte load inside the caller's range; AVX2 by contract.
        unsafe {
            let h = _mm_loadu_si128(p.cast::<__m128i>());
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }

    /// `sum_{i < n} bf16(w[i]) * x[i]`, in exactly the order of [`dot_ptr`].
    ///
    /// # Safety
    /// AVX2 + FMA; `w` valid for `n` `u16`s and `x` for `n` `f32`s.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_bf16_ptr(w: *const u16, x: *const f32, n: usize) -> f32 {
        // SAFETY: as in `dot_ptr`: loads stay below `n` elements of both buffers; AVX2 + FMA.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i + 32 <= n {
                for (k, acc_k) in acc.iter_mut().enumerate() {
                    let o = i + 8 * k;
                    *acc_k = _mm256_fmadd_ps(load_bf16x8(w.add(o)), _mm256_loadu_ps(x.add(o)), *acc_k);
                }
                i += 32;
            }
            while i + 8 <= n {
                acc[0] = _mm256_fmadd_ps(load_bf16x8(w.add(i)), _mm256_loadu_ps(x.add(i)), acc[0]);
                i += 8;
            }
            let mut s = finish(acc);
            while i < n {
                let wi = f32::from_bits(u32::from(*w.add(i)) << 16);
                s = wi.mul_add(*x.add(i), s);
                i += 1;
            }
            s
        }
    }

    /// `sum_{i < n} q[i] * x[i]`.
    ///
    /// # Safety
    /// AVX2 + FMA; `q` valid for `n` `i8`s and `x` for `n` `f32`s.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_i8_ptr(q: *const i8, x: *const f32, n: usize) -> f32 {
        // SAFETY: 16-byte loads at `i` and `i + 16` with `i + 32 <= n`, an 8-byte load with
        // `i + 8 <= n`, single reads below `n`; AVX2 + FMA by contract.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i + 32 <= n {
                let v0 = _mm_loadu_si128(q.add(i).cast::<__m128i>());
                let v1 = _mm_loadu_si128(q.add(i + 16).cast::<__m128i>());
                let parts = [v0, _mm_srli_si128::<8>(v0), v1, _mm_srli_si128::<8>(v1)];
                for (k, (acc_k, part)) in acc.iter_mut().zip(parts).enumerate() {
                    *acc_k = _mm256_fmadd_ps(cvt_i8x8(part), _mm256_loadu_ps(x.add(i + 8 * k)), *acc_k);
                }
                i += 32;
            }
            while i + 8 <= n {
                let v = _mm_loadl_epi64(q.add(i).cast::<__m128i>());
                acc[0] = _mm256_fmadd_ps(cvt_i8x8(v), _mm256_loadu_ps(x.add(i)), acc[0]);
                i += 8;
            }
            let mut s = finish(acc);
            while i < n {
                s = f32::from(*q.add(i)).mul_add(*x.add(i), s);
                i += 1;
            }
            s
        }
    }

    /// `y[i] = fma(a, x[i], y[i])`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), y.len());
        let n = x.len();
        let (xp, yp) = (x.as_ptr(), y.as_mut_ptr());
        // SAFETY: loads and stores of 8 elements at `i` with `i + 8 <= n` in both slices (`y` is
        // borrowed mutably, so nothing else aliases it); AVX2 + FMA by contract.
        unsafe {
            let av = _mm256_set1_ps(a);
            let mut i = 0;
            while i + 8 <= n {
                let v = _mm256_fmadd_ps(av, _mm256_loadu_ps(xp.add(i)), _mm256_loadu_ps(yp.add(i)));
                _mm256_storeu_ps(yp.add(i), v);
                i += 8;
            }
            while i < n {
                *yp.add(i) = a.mul_add(*xp.add(i), *yp.add(i));
                i += 1;
            }
        }
    }

    attention_rows!("avx2,fma");
    row_loops!("avx2,fma");
}

/// AVX-512F twins: 4 accumulators of 16 lanes (64 elements per step), then 16 at a time into the
/// first accumulator, a fixed-order horizontal sum, and a fused scalar tail.
#[cfg(target_arch = "x86_64")]
// AVX-512 intrinsics and `target_feature(enable = "avx512f")` are stable since Rust 1.89: this
// module needs rustc >= 1.89 whatever `rust-version` says (see the module docs of `kernels`).
#[allow(clippy::incompatible_msrv)]
pub(super) mod avx512 {
    use super::super::size;
    use super::super::x86::{cvt_i8x16, hsum512};
    use half::bf16;
    use std::arch::x86_64::*;

    /// Adds the four accumulators as `(a0 + a1) + (a2 + a3)` and sums the lanes.
    ///
    /// # Safety
    /// The CPU must support AVX-512F and AVX2.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn finish(acc: [__m512; 4]) -> f32 {
        // SAFETY: register-only intrinsics; AVX-512F + AVX2 by contract.
        unsafe { hsum512(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]))) }
    }

    /// `sum_{i < n} a[i] * b[i]`.
    ///
    /// # Safety
    /// AVX-512F + AVX2 + FMA; `a` and `b` valid for reads of `n` `f32`s.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn dot_ptr(a: *const f32, b: *const f32, n: usize) -> f32 {
        // SAFETY: 16-element loads at `i` with `i + 16 <= n`, single reads below `n`; the caller
        // guarantees `n` readable elements behind both pointers and the CPU features.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); 4];
            let mut i = 0;
            while i + 64 <= n {
                for (k, acc_k) in acc.iter_mut().enumerate() {
                    let o = i + 16 * k;
                    *acc_k = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(o)), _mm512_loadu_ps(b.add(o)), *acc_k);
                }
                i += 64;
            }
            while i + 16 <= n {
                acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(i)), _mm512_loadu_ps(b.add(i)), acc[0]);
                i += 16;
            }
            let mut s = finish(acc);
            while i < n {
                s = (*a.add(i)).mul_add(*b.add(i), s);
                i += 1;
            }
            s
        }
    }

    /// 16 `bf16` at `p` widened to `f32`.
    ///
    /// # Safety
    /// AVX-512F; `p` valid for reads of 16 `u16`s.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn load_bf16x16(p: *const u16) -> __m512 {
        // SAFETY: one unaligned 32-byte load inside the caller's range; AVX-512F by contract.
        unsafe {
            let h = _mm256_loadu_si256(p.cast::<__m256i>());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }

    /// `sum_{i < n} bf16(w[i]) * x[i]`, in exactly the order of [`dot_ptr`].
    ///
    /// # Safety
    /// AVX-512F + AVX2 + FMA; `w` valid for `n` `u16`s and `x` for `n` `f32`s.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn dot_bf16_ptr(w: *const u16, x: *const f32, n: usize) -> f32 {
        // SAFETY: as in `dot_ptr`: loads stay below `n` elements of both buffers.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); 4];
            let mut i = 0;
            while i + 64 <= n {
                for (k, acc_k) in acc.iter_mut().enumerate() {
                    let o = i + 16 * k;
                    *acc_k = _mm512_fmadd_ps(load_bf16x16(w.add(o)), _mm512_loadu_ps(x.add(o)), *acc_k);
                }
                i += 64;
            }
            while i + 16 <= n {
                acc[0] = _mm512_fmadd_ps(load_bf16x16(w.add(i)), _mm512_loadu_ps(x.add(i)), acc[0]);
                i += 16;
            }
            let mut s = finish(acc);
            while i < n {
                let wi = f32::from_bits(u32::from(*w.add(i)) << 16);
                s = wi.mul_add(*x.add(i), s);
                i += 1;
            }
            s
        }
    }

    /// 16 `i8`s at `p` as 16 `f32`s.
    ///
    /// # Safety
    /// AVX-512F; `p` valid for reads of 16 bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn ld(p: *const i8) -> __m512 {
        // SAFETY: one unaligned 16-byte load inside the caller's range; AVX-512F by contract.
        unsafe { cvt_i8x16(_mm_loadu_si128(p.cast::<__m128i>())) }
    }

    /// `sum_{i < n} q[i] * x[i]`.
    ///
    /// # Safety
    /// AVX-512F + AVX2 + FMA; `q` valid for `n` `i8`s and `x` for `n` `f32`s.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn dot_i8_ptr(q: *const i8, x: *const f32, n: usize) -> f32 {
        // SAFETY: 16-byte loads at `i + 16 k` with `i + 64 <= n` (or `i + 16 <= n`), single reads
        // below `n`; the CPU features by contract.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); 4];
            let mut i = 0;
            while i + 64 <= n {
                for (k, acc_k) in acc.iter_mut().enumerate() {
                    let o = i + 16 * k;
                    *acc_k = _mm512_fmadd_ps(ld(q.add(o)), _mm512_loadu_ps(x.add(o)), *acc_k);
                }
                i += 64;
            }
            while i + 16 <= n {
                acc[0] = _mm512_fmadd_ps(ld(q.add(i)), _mm512_loadu_ps(x.add(i)), acc[0]);
                i += 16;
            }
            let mut s = finish(acc);
            while i < n {
                s = f32::from(*q.add(i)).mul_add(*x.add(i), s);
                i += 1;
            }
            s
        }
    }

    /// `y[i] = fma(a, x[i], y[i])`.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX2 and FMA.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(crate) unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), y.len());
        let n = x.len();
        let (xp, yp) = (x.as_ptr(), y.as_mut_ptr());
        // SAFETY: loads and stores of 16 elements at `i` with `i + 16 <= n` in both slices (`y` is
        // borrowed mutably, so nothing else aliases it); CPU features by contract.
        unsafe {
            let av = _mm512_set1_ps(a);
            let mut i = 0;
            while i + 16 <= n {
                let v = _mm512_fmadd_ps(av, _mm512_loadu_ps(xp.add(i)), _mm512_loadu_ps(yp.add(i)));
                _mm512_storeu_ps(yp.add(i), v);
                i += 16;
            }
            while i < n {
                *yp.add(i) = a.mul_add(*xp.add(i), *yp.add(i));
                i += 1;
            }
        }
    }

    attention_rows!("avx512f,avx2,fma");
    row_loops!("avx512f,avx2,fma");
}
