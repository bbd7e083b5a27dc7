//! Shared x86-64 SIMD helpers: fixed-order horizontal sums, so every kernel reduces the same way.

use std::arch::x86_64::*;

/// Sum of the 8 lanes of `v`, in the fixed order `((0+4)+(2+6)) + ((1+5)+(3+7))`.
///
/// # Safety
/// The CPU must support AVX2.
#[inline]
// Since Rust 1.87 these register-only intrinsics are safe inside a matching
// `target_feature` function; the `unsafe` block keeps the crate building on 1.85.
#[allow(unused_unsafe)]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn hsum256(v: __m256) -> f32 {
    // SAFETY: register-only AVX/SSE intrinsics; the caller guarantees AVX2.
    unsafe {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
        _mm_cvtss_f32(s1)
    }
}

/// Sum of the 16 lanes of `v`: the two 256-bit halves are added, then [`hsum256`].
///
/// # Safety
/// The CPU must support AVX-512F and AVX2.
// AVX-512 intrinsics and `target_feature(enable = "avx512f")` are stable since Rust 1.89: this
// module needs rustc >= 1.89 whatever `rust-version` says (see the module docs of `kernels`).
#[allow(clippy::incompatible_msrv)]
#[inline]
#[target_feature(enable = "avx512f,avx2")]
pub(super) unsafe fn hsum512(v: __m512) -> f32 {
    // SAFETY: register-only intrinsics; the caller guarantees AVX-512F + AVX2.
    // (`_mm512_extractf64x4_pd` is AVX-512F; the f32x8 form would need AVX-512DQ.)
    unsafe {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        hsum256(_mm256_add_ps(lo, hi))
    }
}

/// The low 8 `i8`s of `v` as 8 `f32`s.
///
/// # Safety
/// The CPU must support AVX2.
#[inline]
// Since Rust 1.87 these register-only intrinsics are safe inside a matching
// `target_feature` function; the `unsafe` block keeps the crate building on 1.85.
#[allow(unused_unsafe)]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn cvt_i8x8(v: __m128i) -> __m256 {
    // SAFETY: register-only intrinsics; AVX2 by contract.
    unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)) }
}

/// The 16 `i8`s of `v` as 16 `f32`s (`vpmovsxbd`).
///
/// # Safety
/// The CPU must support AVX-512F.
// AVX-512 intrinsics and `target_feature(enable = "avx512f")` are stable since Rust 1.89: this
// module needs rustc >= 1.89 whatever `rust-version` says (see the module docs of `kernels`).
#[allow(clippy::incompatible_msrv)]
#[inline]
#[allow(unused_unsafe)]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn cvt_i8x16(v: __m128i) -> __m512 {
    // SAFETY: register-only intrinsics; AVX-512F by contract.
    unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)) }
}
