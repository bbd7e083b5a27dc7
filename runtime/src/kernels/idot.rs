//! Opt-in integer dot products for Q4 experts (`picchio run --idot`, Picchio (C)'s `IDOT=1`): the
//! input vector is quantized to `i8` per group of 64 ([`QuantizedInput`]), and each weight group's
//! dot product with it is computed in exact integer arithmetic (`u8` nibble × `i8` products summed
//! in `i32`), then scaled by `weight scale × input scale` in `f32`.
//!
//! For row `r`, group `g` (64 weights in 32 bytes, nibble `n = code + 8`), input scale `sx[g]` and
//! codes `qx` (`x ≈ sx * qx`, `sx = max|x_g| / 127`, `qx = round(x / sx)`):
//!
//! ```text
//! isum[g, l] = sum_{b in 4l..4l+4} n_lo[b] qx[2b] + n_hi[b] qx[2b+1]  -  8 sum_{b in 4l..4l+4} (qx[2b] + qx[2b+1])
//! acc[l]     = fma(f32(isum[g, l]), scale[r, g] * sx[g], acc[l])      (l = 0..8, g = 0, 1, ...)
//! y[r]       = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7))
//! ```
//!
//! The eight lanes `l` are the `i32` lanes of AVX2's `vpmaddubsw` + `vpmaddwd` over the 32 packed
//! bytes (and of AVX-VNNI / AVX512-VNNI `vpdpbusd`, which sums the same four bytes per lane), so the
//! integer part is exact at every level and the `f32` part runs the same operations in the same
//! order: **every level gives bit-identical results** (the tests check it), unlike the `f32`
//! kernels. The input is stored with each group's even elements first, then its odd ones, to meet
//! the low and high nibbles of the packed bytes.
//!
//! Against the exact `f32` kernel the result differs by the input's quantization (relative error up
//! to 1/254 of a group's largest input per element); the drift on whole models is measured in
//! docs/kernels.md.

use crate::quant::{GROUP_SIZE, Q4_GROUP_BYTES};

/// `i32` lanes per group (AVX2 register width).
const LANES: usize = 8;

/// An `f32` input quantized to `i8` per group of 64, laid out for the integer Q4 kernels.
#[derive(Clone, Debug, Default)]
pub struct QuantizedInput {
    /// Codes, per group: the 32 even elements, then the 32 odd ones. `[cols]`.
    q: Vec<i8>,
    /// Scale of each group, `max|x| / 127` (0 for a group of zeros). `[cols / 64]`.
    scales: Vec<f32>,
    /// `8 * (sum of the codes lane l covers)` per group and lane: the offset of the nibbles' `+ 8`.
    /// `[cols / 64 * 8]`.
    offsets: Vec<i32>,
}

impl QuantizedInput {
    /// `x` (length a multiple of 64) quantized; reuses this value's buffers.
    ///
    /// # Panics
    /// When `x.len()` is not a multiple of 64.
    pub fn quantize(&mut self, x: &[f32]) {
        assert!(x.len().is_multiple_of(GROUP_SIZE), "idot: input length {} is not a multiple of 64", x.len());
        let groups = x.len() / GROUP_SIZE;
        self.q.resize(x.len(), 0);
        self.scales.resize(groups, 0.0);
        self.offsets.resize(groups * LANES, 0);
        for (g, xg) in x.chunks_exact(GROUP_SIZE).enumerate() {
            let amax = xg.iter().fold(0f32, |m, v| m.max(v.abs()));
            let (scale, inv) = if amax > 0.0 { (amax / 127.0, 127.0 / amax) } else { (0.0, 0.0) };
            self.scales[g] = scale;
            let q = &mut self.q[g * GROUP_SIZE..(g + 1) * GROUP_SIZE];
            for (b, pair) in xg.chunks_exact(2).enumerate() {
                q[b] = (pair[0] * inv).round().clamp(-127.0, 127.0) as i8;
                q[32 + b] = (pair[1] * inv).round().clamp(-127.0, 127.0) as i8;
            }
            for l in 0..LANES {
                let s: i32 = (4 * l..4 * l + 4).map(|b| i32::from(q[b]) + i32::from(q[32 + b])).sum();
                self.offsets[g * LANES + l] = 8 * s;
            }
        }
    }

    /// Elements quantized.
    pub fn len(&self) -> usize {
        self.q.len()
    }

    /// Whether no element was quantized.
    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }
}

/// Fixed-order sum of the lane accumulators (the order of `x86::hsum256`).
#[inline(always)]
fn reduce(acc: [f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// Portable reference.
pub(super) mod scalar {
    use super::*;

    /// `y = W x` for Q4 `W [y.len(), x.len()]` and quantized `x`; shapes checked by the caller.
    pub(crate) fn matvec(packed: &[u8], scales: &[f32], x: &QuantizedInput, y: &mut [f32]) {
        let groups = x.scales.len();
        for (r, out) in y.iter_mut().enumerate() {
            let mut acc = [0f32; LANES];
            for g in 0..groups {
                let gi = r * groups + g;
                let p = &packed[gi * Q4_GROUP_BYTES..(gi + 1) * Q4_GROUP_BYTES];
                let q = &x.q[g * GROUP_SIZE..(g + 1) * GROUP_SIZE];
                let d = scales[gi] * x.scales[g];
                for (l, a) in acc.iter_mut().enumerate() {
                    let mut s = -x.offsets[g * LANES + l];
                    for b in 4 * l..4 * l + 4 {
                        s += i32::from(p[b] & 0x0f) * i32::from(q[b]) + i32::from(p[b] >> 4) * i32::from(q[32 + b]);
                    }
                    *a = (s as f32).mul_add(d, *a);
                }
            }
            *out = reduce(acc);
        }
    }
}

/// AVX2: `vpmaddubsw` (nibbles × codes, pairs summed in `i16`; at most 2 × 15 × 127 per pair, and
/// the low and high sums together at most 7,620, so nothing saturates) then `vpmaddwd` by ones.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::super::size;
    use super::super::x86::hsum256;
    use super::*;
    use std::arch::x86_64::*;

    /// One row: `groups` groups of packed bytes at `p`, weight scales at `s`.
    ///
    /// # Safety
    /// AVX2 + FMA; `p` valid for `groups * 32` bytes and `s` for `groups` `f32`s; `x` holds
    /// `groups` groups.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn row(p: *const u8, s: *const f32, x: &QuantizedInput, groups: usize) -> f32 {
        // SAFETY: group `g` reads bytes `32 g..32 g + 32` of `p`, scale `g` of `s` (caller), codes
        // `64 g..64 g + 64`, offsets `8 g..8 g + 8` and scale `g` of `x` (it has `groups` groups);
        // AVX2 + FMA by contract.
        unsafe {
            let (xq, xs, off) = (x.q.as_ptr(), x.scales.as_ptr(), x.offsets.as_ptr());
            let mask = _mm256_set1_epi8(0x0f);
            let ones = _mm256_set1_epi16(1);
            let mut acc = _mm256_setzero_ps();
            for g in 0..groups {
                let raw = _mm256_loadu_si256(p.add(g * Q4_GROUP_BYTES).cast::<__m256i>());
                let lo = _mm256_and_si256(raw, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask);
                let xe = _mm256_loadu_si256(xq.add(g * GROUP_SIZE).cast::<__m256i>());
                let xo = _mm256_loadu_si256(xq.add(g * GROUP_SIZE + 32).cast::<__m256i>());
                let p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
                let i32s = _mm256_madd_epi16(p16, ones);
                let i32s = _mm256_sub_epi32(i32s, _mm256_loadu_si256(off.add(g * LANES).cast::<__m256i>()));
                let d = _mm256_set1_ps(*s.add(g) * *xs.add(g));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32s), d, acc);
            }
            hsum256(acc)
        }
    }

    /// `y = W x` for Q4 `W [y.len(), x.len()]` and quantized `x`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn matvec(packed: &[u8], scales: &[f32], x: &QuantizedInput, y: &mut [f32]) {
        let groups = x.scales.len();
        assert_eq!(x.q.len(), groups * GROUP_SIZE);
        assert_eq!(x.offsets.len(), groups * LANES);
        assert_eq!(packed.len(), size(size(y.len(), groups), Q4_GROUP_BYTES));
        assert_eq!(scales.len(), size(y.len(), groups));
        for (r, out) in y.iter_mut().enumerate() {
            let gi = r * groups;
            // SAFETY: row `r` owns groups `gi..gi + groups`, inside both buffers by the asserts.
            *out = unsafe { row(packed.as_ptr().add(gi * Q4_GROUP_BYTES), scales.as_ptr().add(gi), x, groups) };
        }
    }
}
