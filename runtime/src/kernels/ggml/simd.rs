//! SIMD twins of [`super::dot`]'s scalar dot products (AVX2, AVX-512), **bit-identical** to it and
//! so to ggml's generic C (`ggml_vec_dot_*_generic`, `ggml-cpu/quants.c`): the integer parts are
//! exact in any order, and every f32 operation is the scalar's, in the scalar's order, unfused.
//!
//! **K-quants** (Q2_K … Q6_K against Q8_K). The scalar sums `scale · q8 · q` of each super-block
//! into 8 integer lanes, lane `l` holding the elements `i ≡ l (mod 8)`, then per lane
//! `sums[l] += (d·dy) · lane[l]` in f32, and at the end `sumf += sums[0]; … sumf += sums[7]`. Here
//! the 8 lanes are the 8 i32 lanes of one AVX2 register: each 32-element chunk's codes are
//! permuted (`vpermd` then an in-lane `vpshufb`, [`perm_index`]) so that bytes `4k..4k + 4` hold
//! elements `k, k + 8, k + 16, k + 24`, all of lane `k`; the activation's codes are permuted the
//! same way once per product ([`permute_q8_k`]). Then `vpmaddubsw` (codes × activation, pairs
//! `k, k + 8` and `k + 16, k + 24` summed in i16: at most 2 · 63 · 127, no saturation) and
//! `vpmaddwd` by the pair of 16-element group scales (i32 lane `k`) give each chunk's lane sums
//! exactly; the f32 part is an 8-lane `mul` then `add` (no FMA) and the final lane sum in the
//! scalar's order. Signed codes (Q3_K: `u − 4`, Q6_K: `u − 32`) are `vpmaddubsw(u, a) −
//! vpmaddubsw(offset, a)` in i16 (both sides and the difference fit).
//!
//! **32-element types** (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4 against Q8_0/Q8_1). The scalar adds one
//! f32 term per block to `sumf`, in block order; here each block's integer dot is one
//! `vpmaddubsw`/`vpmaddwd` and a horizontal integer sum, and the f32 term and the sum are the
//! scalar's, in scalar code. Signed weight codes use `vpmaddubsw(|w|, sign(a, w))`, exact as long
//! as no activation code is −128, which ggml's quantizers (and [`super::q8`]) never write: they
//! round `x · 127 / amax` (Q8_0, Q8_1) or `−127 · x / max` (Q8_K), at most 127 in magnitude.
//!
//! AVX-512 (with AVX-512BW) runs the K-quants' chunks two at a time in 512-bit registers, the two
//! 256-bit halves' integer lanes added before the f32 part; the 32-element types run the AVX2 code
//! at the AVX-512 level (one block is one 256-bit register). Without AVX-512BW the AVX-512 level
//! runs the AVX2 code. Every level gives the same bits (tests below).

use super::f16_at;
use super::kquants::QK_K;
use super::q8::Q8_K_BYTES;
use crate::kernels::Level;
use picchio_core::format::gguf::GgmlType;

/// Whether the activation's Q8_K codes are read in [`permute_q8_k`]'s order (every K-quant).
fn is_k(ty: GgmlType) -> bool {
    ty.block_elems() as usize == QK_K
}

/// The position in a 32-element chunk that byte `p` of the permuted chunk holds: byte `4k + j`
/// holds element `k + 8j` (`k` < 8, `j` < 4), so i32 lane `k` of a 256-bit register holds elements
/// of one scalar lane `k`.
pub(super) const fn perm_index(p: usize) -> usize {
    p / 4 + 8 * (p % 4)
}

/// The codes of Q8_K blocks `act` (292 bytes each), each 32-element chunk permuted by
/// [`perm_index`], into `out` (256 bytes per block).
fn permute_q8_k(act: &[u8], out: &mut Vec<u8>) {
    out.clear();
    for y in act.chunks_exact(Q8_K_BYTES) {
        for chunk in y[4..4 + QK_K].chunks_exact(32) {
            out.extend((0..32).map(|p| chunk[perm_index(p)]));
        }
    }
}

/// The activations `xqs` (`n` inputs of `xq_bytes` bytes) as the row kernels of `ty` read them:
/// for the K-quants, the permuted codes of each input, one after another ([`permute_q8_k`]); for
/// the others, nothing (they read `xqs` as it is). Runs `f` with them, from a buffer reused per
/// thread.
fn with_permuted<R>(ty: GgmlType, xqs: &[u8], f: impl FnOnce(&[u8]) -> R) -> R {
    thread_local! {
        static PERM: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    if !is_k(ty) {
        return f(&[]);
    }
    let mut buf = PERM.take();
    permute_q8_k(xqs, &mut buf);
    let r = f(&buf);
    PERM.set(buf);
    r
}

/// A row kernel: the dot product of one row `w` (whole weight blocks) with the activation blocks
/// `act` and (K-quants) their permuted codes `pq`.
///
/// # Safety
/// The CPU must support the kernel's level; `act` and `pq` hold as many blocks as `w` (checked by
/// the kernels with assertions, so a mismatch panics rather than reads out of bounds).
type RowFn = unsafe fn(w: &[u8], act: &[u8], pq: &[u8]) -> f32;

/// The row kernel of `ty` at `level` (Avx2 or Avx512), or `None` (the scalar code then runs).
#[cfg(target_arch = "x86_64")]
fn row_fn(level: Level, ty: GgmlType) -> Option<RowFn> {
    use GgmlType::*;
    let wide = level == Level::Avx512 && std::arch::is_x86_feature_detected!("avx512bw");
    Some(match (wide, ty) {
        (true, Q2_K) => avx512::q2_k,
        (true, Q3_K) => avx512::q3_k,
        (true, Q4_K) => avx512::q4_k,
        (true, Q5_K) => avx512::q5_k,
        (true, Q6_K) => avx512::q6_k,
        (_, Q2_K) => avx2::q2_k,
        (_, Q3_K) => avx2::q3_k,
        (_, Q4_K) => avx2::q4_k,
        (_, Q5_K) => avx2::q5_k,
        (_, Q6_K) => avx2::q6_k,
        (_, Q4_0) => avx2::q4_0,
        (_, Q4_1) => avx2::q4_1,
        (_, Q5_0) => avx2::q5_0,
        (_, Q5_1) => avx2::q5_1,
        (_, Q8_0) => avx2::q8_0,
        (_, MXFP4) => avx2::mxfp4,
        _ => return None,
    })
}

/// No SIMD kernels off x86-64.
#[cfg(not(target_arch = "x86_64"))]
fn row_fn(_: Level, _: GgmlType) -> Option<RowFn> {
    None
}

/// `out[r]` = the dot product of weight row `r` (`out.len()` rows of `row_bytes` bytes in
/// `weights`) with the activation `xq`, at `level` (Avx2 or Avx512, which the CPU supports: the
/// caller holds a `Kernels` of it). Returns `false`, computing nothing, when `ty` has no SIMD
/// kernel here.
pub(super) fn matvec(level: Level, ty: GgmlType, weights: &[u8], row_bytes: usize, xq: &[u8], out: &mut [f32]) -> bool {
    matmul(level, ty, weights, row_bytes, xq, 1, out)
}

/// `yt[r * n + t]` = the dot product of weight row `r` with input `t` of `xqs` (`n` activations one
/// after another), at `level` (see [`matvec`]). Returns `false` when `ty` has no SIMD kernel here.
pub(super) fn matmul(
    level: Level,
    ty: GgmlType,
    weights: &[u8],
    row_bytes: usize,
    xqs: &[u8],
    n: usize,
    yt: &mut [f32],
) -> bool {
    let Some(row) = row_fn(level, ty) else { return false };
    let xq_bytes = xqs.len() / n;
    let pq_bytes = if is_k(ty) { row_bytes / ty.block_bytes() as usize * QK_K } else { 0 };
    with_permuted(ty, xqs, |pqs| {
        for (w, y) in weights.chunks_exact(row_bytes).zip(yt.chunks_exact_mut(n)) {
            for (t, o) in y.iter_mut().enumerate() {
                let xq = &xqs[t * xq_bytes..(t + 1) * xq_bytes];
                let pq = if pq_bytes > 0 { &pqs[t * pq_bytes..(t + 1) * pq_bytes] } else { &[][..] };
                // SAFETY: `row_fn` returned a kernel of `level`, which the CPU supports (the
                // caller's `Kernels` holds it); the kernel checks the lengths of `w`, `xq`, `pq`.
                *o = unsafe { row(w, xq, pq) };
            }
        }
    });
    true
}

/// The 16 scales of a Q3_K super-block (`b`: the block), `s_j − 32`, as ggml unpacks them.
fn q3_k_scales(b: &[u8]) -> [i16; 16] {
    let s = &b[96..108];
    std::array::from_fn(|j| {
        let low = if j < 8 { s[j] & 0x0f } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        i16::from(low | (high << 4)) - 32
    })
}

/// The 8 scales and 8 minimums of a Q4_K or Q5_K super-block (`b`: the block), 6 bits each, as
/// bytes: `kquants::scale_min_k4` of groups 0..8, four groups at a time in u32 arithmetic.
fn q4_k_scales(b: &[u8]) -> ([u8; 8], [u8; 8]) {
    let word = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let (a, m, c) = (word(4), word(8), word(12));
    let (low6, low4, top2) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
    let sc_hi = (c & low4) | (((a >> 6) & top2) << 4);
    let m_hi = ((c >> 4) & low4) | (((m >> 6) & top2) << 4);
    let join = |lo: u32, hi: u32| {
        let mut out = [0u8; 8];
        out[..4].copy_from_slice(&lo.to_le_bytes());
        out[4..].copy_from_slice(&hi.to_le_bytes());
        out
    };
    (join(a & low6, sc_hi), join(m & low6, m_hi))
}

/// Σ_j `bsums[j] · min[j / per]` of a Q8_K block `y` (16 sums of 16 codes) and 16 / `per` minimums.
#[cfg(test)]
fn bsum_mins(y: &[u8], mins: &[u8], per: usize) -> i32 {
    (0..16).map(|j| i32::from(i16::from_le_bytes([y[260 + 2 * j], y[261 + 2 * j]])) * i32::from(mins[j / per])).sum()
}

/// The f32 scale `d` of a Q8_K block.
fn q8_k_d(y: &[u8]) -> f32 {
    f32::from_le_bytes([y[0], y[1], y[2], y[3]])
}

/// `sumf += sums[0]; … sumf += sums[7]`: the scalar's final lane sum, in its order.
fn add_lanes(mut sumf: f32, sums: [f32; 8]) -> f32 {
    for s in sums {
        sumf += s;
    }
    sumf
}

/// The per-block f32 term of a 32-element type (`dot_32`'s), from the weight block `b`, the
/// activation block `y` and the integer dot `sumi`.
#[inline(always)]
fn term_32(ty: GgmlType, b: &[u8], y: &[u8], sumi: i32) -> f32 {
    let dy = f16_at(y, 0);
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 => f16_at(b, 0) * dy * sumi as f32 + f16_at(b, 2) * f16_at(y, 2),
        GgmlType::Q4_0 => sumi as f32 * f16_at(b, 0) * dy,
        GgmlType::MXFP4 => super::floats::e8m0_half(b[0]) * dy * sumi as f32,
        _ => f16_at(b, 0) * dy * sumi as f32,
    }
}

/// Checks a row kernel's slices: `w` whole blocks of `block_bytes`, `act` as many `act_bytes`
/// blocks, `pq` as many 256-byte permuted code blocks (K-quants; `pq_block` 0 otherwise).
#[inline(always)]
fn check_row(w: &[u8], act: &[u8], pq: &[u8], block_bytes: usize, act_bytes: usize, pq_block: usize) -> usize {
    let blocks = w.len() / block_bytes;
    assert!(
        blocks * block_bytes == w.len() && act.len() == blocks * act_bytes && pq.len() == blocks * pq_block,
        "ggml simd row: mismatched block counts"
    );
    blocks
}

/// AVX2 kernels (the AVX2 instructions only: no FMA, no F16C).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// The 32 bytes at `p` with each byte moved to its [`perm_index`] place: `vpermd` gathers the
    /// dwords of elements `8m..8m + 4` in the low half and `8m + 4..8m + 8` in the high half, and
    /// an in-lane `vpshufb` transposes each half's 4 × 4 bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn perm(v: __m256i) -> __m256i {
        let d = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
        let t = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm256_shuffle_epi8(d, _mm256_set_m128i(t, t))
    }

    /// 32 bytes at `p`.
    ///
    /// # Safety
    /// `p` valid for reads of 32 bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn load(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 32 readable bytes; `loadu` has no alignment requirement.
        unsafe { _mm256_loadu_si256(p.cast()) }
    }

    /// i16 pairs `(s0, s1)` repeated: the `vpmaddwd` multiplier of a chunk whose groups of 16 have
    /// scales `s0` (elements 0..16) and `s1` (16..32).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn scale_pair(s0: i16, s1: i16) -> __m256i {
        _mm256_set1_epi32((i32::from(s1 as u16) << 16) | i32::from(s0 as u16))
    }

    /// Lane sums of one permuted chunk: `u` (unsigned codes) · `a` (activation), minus `off · a`
    /// when `OFF` ≠ 0, pairs weighted by `scales` ([`scale_pair`]).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn chunk<const OFF: i8>(u: __m256i, a: __m256i, scales: __m256i) -> __m256i {
        let mut p = _mm256_maddubs_epi16(u, a);
        if OFF != 0 {
            p = _mm256_sub_epi16(p, _mm256_maddubs_epi16(_mm256_set1_epi8(OFF), a));
        }
        _mm256_madd_epi16(p, scales)
    }

    /// The low 2 bits of each byte of `v` after shifting it right by `s` (2 · chunk).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn bits2(v: __m256i, s: i32) -> __m256i {
        _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(s)), _mm256_set1_epi8(3))
    }

    /// Bit `s` of each byte of `v`, as 0 or 1.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn bit(v: __m256i, s: i32) -> __m256i {
        _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(s)), _mm256_set1_epi8(1))
    }

    /// `sums += d · f32(lanes)` (mul, then add: the scalar's `sums[l] += d * lanes[l]`).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn accumulate(sums: __m256, d: f32, lanes: __m256i) -> __m256 {
        _mm256_add_ps(sums, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes)))
    }

    /// The 8 f32 lanes of `v`, lane 0 first.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn lanes(v: __m256) -> [f32; 8] {
        let mut out = [0f32; 8];
        // SAFETY: `out` has room for 8 f32s; `storeu` has no alignment requirement.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
        out
    }

    /// The sum of the 8 i32 lanes of `v` (exact in any order).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }

    /// Σ_j `bsums[j] · mins[j]` of the Q8_K block `y` and 16 minimums (i16) `mins` (exact).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn mins_dot(y: &[u8], mins: __m256i) -> i32 {
        assert!(y.len() >= 292);
        // SAFETY: the 16 `bsums` are bytes 260..292 of the block (length asserted).
        let bsums = unsafe { load(y.as_ptr().add(260)) };
        hsum_i32(_mm256_madd_epi16(bsums, mins))
    }

    /// 8 minimums `m` (bytes), each repeated for its two groups of 16, as 16 i16s.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn mins_32(m: [u8; 8]) -> __m256i {
        let v = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(i64::from_le_bytes(m)));
        _mm256_set_m128i(_mm_unpackhi_epi16(v, v), _mm_unpacklo_epi16(v, v))
    }

    /// Q2_K's 16 minimums (the high nibbles of `scales`, bytes 0..16 of the block) as 16 i16s.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn mins_q2_k(b: &[u8]) -> __m256i {
        assert!(b.len() >= 16);
        // SAFETY: 16 bytes, length asserted.
        let s = unsafe { _mm_loadu_si128(b.as_ptr().cast()) };
        _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(s), _mm_set1_epi8(0x0f)))
    }

    /// Q4_K row (144-byte blocks: f16 `d`, f16 `dmin`, 12 scale bytes, `qs[128]`).
    ///
    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn q4_k(w: &[u8], act: &[u8], pq: &[u8]) -> f32 {
        let blocks = check_row(w, act, pq, 144, Q8_K_BYTES, QK_K);
        let (mut sums, mut sumf) = (_mm256_setzero_ps(), 0f32);
        let m4 = _mm256_set1_epi8(0x0f);
        for i in 0..blocks {
            let (b, y, a) = (&w[i * 144..(i + 1) * 144], &act[i * Q8_K_BYTES..(i + 1) * Q8_K_BYTES], &pq[i * QK_K..]);
            let (sc, m) = q4_k_scales(b);
            let mut acc = _mm256_setzero_si256();
            for p in 0..4 {
                // SAFETY: `qs` bytes 32p..32p + 32 at 16 + 32p < 144; codes 64p..64p + 64 < 256 of `a`.
                let (raw, a0, a1) = unsafe {
                    (
                        perm(load(b.as_ptr().add(16 + 32 * p))),
                        load(a.as_ptr().add(64 * p)),
                        load(a.as_ptr().add(64 * p + 32)),
                    )
                };
                let lo = _mm256_and_si256(raw, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4);
                acc = _mm256_add_epi32(acc, chunk::<0>(lo, a0, scale_pair(sc[2 * p].into(), sc[2 * p].into())));
                acc = _mm256_add_epi32(acc, chunk::<0>(hi, a1, scale_pair(sc[2 * p + 1].into(), sc[2 * p + 1].into())));
            }
            let (dy, mins) = (q8_k_d(y), mins_dot(y, mins_32(m)));
            sums = accumulate(sums, f16_at(b, 0) * dy, acc);
            sumf -= f16_at(b, 2) * dy * mins as f32;
        }
        add_lanes(sumf, lanes(sums))
    }

    /// Q5_K row (176-byte blocks: as Q4_K with `qh[32]` before `qs`).
    ///
    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn q5_k(w: &[u8], act: &[u8], pq: &[u8]) -> f32 {
        let blocks = check_row(w, act, pq, 176, Q8_K_BYTES, QK_K);
        let (mut sums, mut sumf) = (_mm256_setzero_ps(), 0f32);
        let m4 = _mm256_set1_epi8(0x0f);
        for i in 0..blocks {
            let (b, y, a) = (&w[i * 176..(i + 1) * 176], &act[i * Q8_K_BYTES..(i + 1) * Q8_K_BYTES], &pq[i * QK_K..]);
            let (sc, m) = q4_k_scales(b);
            // SAFETY: `qh` is bytes 16..48 of the 176-byte block.
            let qh = perm(unsafe { load(b.as_ptr().add(16)) });
            let mut acc = _mm256_setzero_si256();
            for p in 0..4 {
                // SAFETY: `qs` bytes 32p..32p + 32 at 48 + 32p < 176; codes 64p..64p + 64 of `a`.
                let (raw, a0, a1) = unsafe {
                    (
                        perm(load(b.as_ptr().add(48 + 32 * p))),
                        load(a.as_ptr().add(64 * p)),
                        load(a.as_ptr().add(64 * p + 32)),
                    )
                };
                let c = 2 * p as i32;
                let lo = _mm256_or_si256(_mm256_and_si256(raw, m4), _mm256_slli_epi16::<4>(bit(qh, c)));
                let hi = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4),
                    _mm256_slli_epi16::<4>(bit(qh, c + 1)),
                );
                acc = _mm256_add_epi32(acc, chunk::<0>(lo, a0, scale_pair(sc[2 * p].into(), sc[2 * p].into())));
                acc = _mm256_add_epi32(acc, chunk::<0>(hi, a1, scale_pair(sc[2 * p + 1].into(), sc[2 * p + 1].into())));
            }
            let (dy, mins) = (q8_k_d(y), mins_dot(y, mins_32(m)));
            sums = accumulate(sums, f16_at(b, 0) * dy, acc);
            sumf -= f16_at(b, 2) * dy * mins as f32;
        }
        add_lanes(sumf, lanes(sums))
    }

    /// Q6_K row (210-byte blocks: `ql[128]`, `qh[64]`, i8 `scales[16]`, f16 `d`).
    ///
    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn q6_k(w: &[u8], act: &[u8], pq: &[u8]) -> f32 {
        let blocks = check_row(w, act, pq, 210, Q8_K_BYTES, QK_K);
        let mut sums = _mm256_setzero_ps();
        let m4 = _mm256_set1_epi8(0x0f);
        for i in 0..blocks {
            let (b, y, a) = (&w[i * 210..(i + 1) * 210], &act[i * Q8_K_BYTES..(i + 1) * Q8_K_BYTES], &pq[i * QK_K..]);
            let sc: [i16; 16] = std::array::from_fn(|j| i16::from(b[192 + j] as i8));
            let mut acc = _mm256_setzero_si256();
            for h in 0..2 {
                // SAFETY: `ql` bytes 64h..64h + 64 and `qh` bytes 128 + 32h..160 + 32h of the block.
                let (ql0, ql1, qh) = unsafe {
                    let p = b.as_ptr();
                    (perm(load(p.add(64 * h))), perm(load(p.add(64 * h + 32))), perm(load(p.add(128 + 32 * h))))
                };
                let nibs = [
                    _mm256_and_si256(ql0, m4),
                    _mm256_and_si256(ql1, m4),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                ];
                for (cc, nib) in nibs.into_iter().enumerate() {
                    let c = 4 * h + cc;
                    let u = _mm256_or_si256(nib, _mm256_slli_epi16::<4>(bits2(qh, 2 * cc as i32)));
                    // SAFETY: codes 32c..32c + 32 < 256 of `a`.
                    let av = unsafe { load(a.as_ptr().add(32 * c)) };
                    acc = _mm256_add_epi32(acc, chunk::<32>(u, av, scale_pair(sc[2 * c], sc[2 * c + 1])));
                }
            }
            sums = accumulate(sums, f16_at(b, 208) * q8_k_d(y), acc);
        }
        add_lanes(0.0, lanes(sums))
    }

    /// Q3_K row (110-byte blocks: `hmask[32]`, `qs[64]`, 12 scale bytes, f16 `d`).
    ///
    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn q3_k(w: &[u8], act: &[u8], pq: &[u8]) -> f32 {
        let blocks = check_row(w, act, pq, 110, Q8_K_BYTES, QK_K);
        let mut sums = _mm256_setzero_ps();
        for i in 0..blocks {
            let (b, y, a) = (&w[i * 110..(i + 1) * 110], &act[i * Q8_K_BYTES..(i + 1) * Q8_K_BYTES], &pq[i * QK_K..]);
            let sc = q3_k_scales(b);
            // SAFETY: `hmask` is bytes 0..32 of the block.
            let hm = perm(unsafe { load(b.as_ptr()) });
            let mut acc = _mm256_setzero_si256();
            for h in 0..2 {
                // SAFETY: `qs` bytes 32h..32h + 32 at 32 + 32h < 110.
                let qs = perm(unsafe { load(b.as_ptr().add(32 + 32 * h)) });
                for cc in 0..4 {
                    let c = 4 * h + cc;
                    let u = _mm256_or_si256(bits2(qs, 2 * cc as i32), _mm256_slli_epi16::<2>(bit(hm, c as i32)));
                    // SAFETY: codes 32c..32c + 32 < 256 of `a`.
                    let av = unsafe { load(a.as_ptr().add(32 * c)) };
                    acc = _mm256_add_epi32(acc, chunk::<4>(u, av, scale_pair(sc[2 * c], sc[2 * c + 1])));
                }
            }
            sums = accumulate(sums, f16_at(b, 108) * q8_k_d(y), acc);
        }
        add_lanes(0.0, lanes(sums))
    }

    /// Q2_K row (84-byte blocks: `scales[16]`, `qs[64]`, f16 `d`, f16 `dmin`): one f32 term per
    /// block, `(dy·d)·isum − (dy·dmin)·Σ bsums·min`.
    ///
    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn q2_k(w: &[u8], act: &[u8], pq: &[u8]) -> f32 {
        let blocks = check_row(w, act, pq, 84, Q8_K_BYTES, QK_K);
        let mut sumf = 0f32;
        for i in 0..blocks {
            let (b, y, a) = (&w[i * 84..(i + 1) * 84], &act[i * Q8_K_BYTES..(i + 1) * Q8_K_BYTES], &pq[i * QK_K..]);
            let sc: [i16; 16] = std::array::from_fn(|j| i16::from(b[j] & 0x0f));
            let mut acc = _mm256_setzero_si256();
            for h in 0..2 {
                // SAFETY: `qs` bytes 32h..32h + 32 at 16 + 32h < 84.
                let qs = perm(unsafe { load(b.as_ptr().add(16 + 32 * h)) });
                for cc in 0..4 {
                    let c = 4 * h + cc;
                    // SAFETY: codes 32c..32c + 32 < 256 of `a`.
                    let av = unsafe { load(a.as_ptr().add(32 * c)) };
                    acc = _mm256_add_epi32(
                        acc,
                        chunk::<0>(bits2(qs, 2 * cc as i32), av, scale_pair(sc[2 * c], sc[2 * c + 1])),
                    );
                }
            }
            let dy = q8_k_d(y);
            let (dall, dmin) = (dy * f16_at(b, 80), dy * f16_at(b, 82));
            sumf += dall * hsum_i32(acc) as f32 - dmin * mins_dot(y, mins_q2_k(b)) as f32;
        }
        sumf
    }

    /// The 16 bytes at `p` split into nibbles: low nibbles in bytes 0..16, high in 16..32 (the
    /// element order of the legacy types and MXFP4).
    ///
    /// # Safety
    /// `p` valid for reads of 16 bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        // SAFETY: 16 readable bytes by contract.
        let q = unsafe { _mm_loadu_si128(p.cast()) };
        let m4 = _mm_set1_epi8(0x0f);
        _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(q), m4), _mm_and_si128(q, m4))
    }

    /// Bit `j` of `h` in byte `j` as 16 (Q5_0's and Q5_1's fifth bits), 0 where clear.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn fifth_bits(h: u32) -> __m256i {
        // Byte j of `spread` is byte j / 8 of `h`; `sel` picks its bit j % 8.
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(h as i32),
            _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303),
        );
        let sel = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel);
        _mm256_and_si256(set, _mm256_set1_epi8(16))
    }

    /// Σ `w · a` over 32 signed codes `w` and activation codes `a` (no −128 in `a`).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn dot_signed(w: __m256i, a: __m256i) -> i32 {
        let p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
        hsum_i32(_mm256_madd_epi16(p, _mm256_set1_epi16(1)))
    }

    /// Σ `u · a` over 32 unsigned codes `u` (< 128) and activation codes `a`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn dot_unsigned(u: __m256i, a: __m256i) -> i32 {
        hsum_i32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)))
    }

    /// A row of a 32-element type: per block the integer dot `codes(block) · a`, then the
    /// scalar's f32 term and sum ([`term_32`]), in block order.
    macro_rules! row_32 {
        ($name:ident, $ty:expr, $bytes:expr, $act:expr, $doc:literal, |$b:ident, $a:ident| $dot:expr) => {
            #[doc = $doc]
            ///
            /// # Safety
            /// AVX2.
            #[target_feature(enable = "avx2")]
            pub(super) unsafe fn $name(w: &[u8], act: &[u8], pq: &[u8]) -> f32 {
                let blocks = check_row(w, act, pq, $bytes, $act, 0);
                let mut sumf = 0f32;
                for i in 0..blocks {
                    let ($b, y) = (&w[i * $bytes..(i + 1) * $bytes], &act[i * $act..(i + 1) * $act]);
                    // SAFETY: the activation's 32 codes are its last 32 bytes.
                    let $a = unsafe { load(y.as_ptr().add($act - 32)) };
                    let sumi: i32 = $dot;
                    sumf += term_32($ty, $b, y, sumi);
                }
                sumf
            }
        };
    }

    row_32!(q8_0, GgmlType::Q8_0, 34, 34, "Q8_0 row (34-byte blocks: f16 `d`, 32 × i8).", |b, a| {
        // SAFETY: the codes are bytes 2..34 of the block.
        dot_signed(unsafe { load(b.as_ptr().add(2)) }, a)
    });
    row_32!(
        q4_0,
        GgmlType::Q4_0,
        18,
        34,
        "Q4_0 row (18-byte blocks: f16 `d`, 16 bytes of nibbles; code − 8).",
        |b, a| {
            // SAFETY: the nibbles are bytes 2..18 of the block.
            let u = unsafe { nibbles(b.as_ptr().add(2)) };
            dot_signed(_mm256_sub_epi8(u, _mm256_set1_epi8(8)), a)
        }
    );
    row_32!(
        q4_1,
        GgmlType::Q4_1,
        20,
        36,
        "Q4_1 row (20-byte blocks: f16 `d`, f16 `m`, 16 bytes of nibbles).",
        |b, a| {
            // SAFETY: the nibbles are bytes 4..20 of the block.
            dot_unsigned(unsafe { nibbles(b.as_ptr().add(4)) }, a)
        }
    );
    row_32!(
        q5_0,
        GgmlType::Q5_0,
        22,
        34,
        "Q5_0 row (22-byte blocks: f16 `d`, u32 fifth bits, nibbles; code − 16).",
        |b, a| {
            // SAFETY: the nibbles are bytes 6..22 of the block.
            let u = _mm256_or_si256(
                unsafe { nibbles(b.as_ptr().add(6)) },
                fifth_bits(u32::from_le_bytes([b[2], b[3], b[4], b[5]])),
            );
            dot_signed(_mm256_sub_epi8(u, _mm256_set1_epi8(16)), a)
        }
    );
    row_32!(
        q5_1,
        GgmlType::Q5_1,
        24,
        36,
        "Q5_1 row (24-byte blocks: f16 `d`, f16 `m`, u32 fifth bits, nibbles).",
        |b, a| {
            // SAFETY: the nibbles are bytes 8..24 of the block.
            let u = _mm256_or_si256(
                unsafe { nibbles(b.as_ptr().add(8)) },
                fifth_bits(u32::from_le_bytes([b[4], b[5], b[6], b[7]])),
            );
            dot_unsigned(u, a)
        }
    );
    row_32!(
        mxfp4,
        GgmlType::MXFP4,
        17,
        34,
        "MXFP4 row (17-byte blocks: E8M0 exponent, 16 bytes of E2M1 nibbles).",
        |b, a| {
            let table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
            // SAFETY: the nibbles are bytes 1..17 of the block.
            let u = unsafe { nibbles(b.as_ptr().add(1)) };
            dot_signed(_mm256_shuffle_epi8(_mm256_set_m128i(table, table), u), a)
        }
    );
}

/// AVX-512 kernels of the K-quants (AVX-512F + AVX-512BW, with AVX2): two permuted 32-element
/// chunks per 512-bit register, chunk `c` in the low half and `c + 1` (or the chunk paired with it)
/// in the high half; the halves' i32 lanes are added per super-block before the f32 part, which is
/// the AVX2 kernels' (8 lanes).
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::avx2::{accumulate, hsum_i32, lanes, load, mins_32, mins_dot, mins_q2_k};
    use super::*;
    use std::arch::x86_64::*;

    /// Two 256-bit registers as one 512-bit one, `lo` in the low half.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    fn join(lo: __m256i, hi: __m256i) -> __m512i {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }

    /// [`super::avx2::perm`] of each 256-bit half.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    fn perm(v: __m512i) -> __m512i {
        let d = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15), v);
        let t = _mm512_set4_epi32(0x0f0b_0703, 0x0e0a_0602, 0x0d09_0501, 0x0c08_0400);
        _mm512_shuffle_epi8(d, t)
    }

    /// 64 bytes at `p`.
    ///
    /// # Safety
    /// `p` valid for reads of 64 bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    unsafe fn load64(p: *const u8) -> __m512i {
        // SAFETY: 64 readable bytes by contract; `loadu` has no alignment requirement.
        unsafe { _mm512_loadu_si512(p.cast()) }
    }

    /// i16 scale pairs: `(s0, s1)` repeated in the low half, `(s2, s3)` in the high half.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    fn scales2(s0: i16, s1: i16, s2: i16, s3: i16) -> __m512i {
        let pair = |a: i16, b: i16| (i32::from(b as u16) << 16) | i32::from(a as u16);
        let (lo, hi) = (pair(s0, s1), pair(s2, s3));
        _mm512_setr_epi32(lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi)
    }

    /// As [`super::avx2`]'s `chunk`, on two chunks at once.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    fn chunk2<const OFF: i8>(u: __m512i, a: __m512i, scales: __m512i) -> __m512i {
        let mut p = _mm512_maddubs_epi16(u, a);
        if OFF != 0 {
            p = _mm512_sub_epi16(p, _mm512_maddubs_epi16(_mm512_set1_epi8(OFF), a));
        }
        _mm512_madd_epi16(p, scales)
    }

    /// The low 2 bits of each byte of `v` shifted right by `s`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    fn bits2(v: __m512i, s: u32) -> __m512i {
        _mm512_and_si512(_mm512_srl_epi16(v, _mm_cvtsi32_si128(s as i32)), _mm512_set1_epi8(3))
    }

    /// Bit `s` of each byte of `v`, as 0 or 1.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    fn bit(v: __m512i, s: u32) -> __m512i {
        _mm512_and_si512(_mm512_srl_epi16(v, _mm_cvtsi32_si128(s as i32)), _mm512_set1_epi8(1))
    }

    /// The two 256-bit halves' i32 lanes added: lane `k` of both chunks (exact).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    fn fold(v: __m512i) -> __m256i {
        _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
    }

    /// Q4_K row; see [`super::avx2`]'s `q4_k`. The 64 bytes of `qs` for chunks `4q..4q + 4` are one
    /// register: low nibbles chunks `4q` and `4q + 2`, high nibbles `4q + 1` and `4q + 3`.
    ///
    /// # Safety
    /// AVX-512F, AVX-512BW, AVX2.
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    pub(super) unsafe fn q4_k(w: &[u8], act: &[u8], pq: &[u8]) -> f32 {
        let blocks = check_row(w, act, pq, 144, Q8_K_BYTES, QK_K);
        let (mut sums, mut sumf) = (_mm256_setzero_ps(), 0f32);
        let m4 = _mm512_set1_epi8(0x0f);
        for i in 0..blocks {
            let (b, y, a) = (&w[i * 144..(i + 1) * 144], &act[i * Q8_K_BYTES..(i + 1) * Q8_K_BYTES], &pq[i * QK_K..]);
            let (sc, m) = q4_k_scales(b);
            let mut acc = _mm512_setzero_si512();
            for q in 0..2 {
                // SAFETY: `qs` bytes 64q..64q + 64 at 16 + 64q < 144; codes 128q..128q + 128 of `a`.
                let (raw, a0, a1, a2, a3) = unsafe {
                    let ap = a.as_ptr().add(128 * q);
                    (
                        load64(b.as_ptr().add(16 + 64 * q)),
                        load(ap),
                        load(ap.add(32)),
                        load(ap.add(64)),
                        load(ap.add(96)),
                    )
                };
                let raw = perm(raw);
                let lo = _mm512_and_si512(raw, m4);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4);
                let c = 4 * q;
                acc = _mm512_add_epi32(
                    acc,
                    chunk2::<0>(
                        lo,
                        join(a0, a2),
                        scales2(sc[c].into(), sc[c].into(), sc[c + 2].into(), sc[c + 2].into()),
                    ),
                );
                acc = _mm512_add_epi32(
                    acc,
                    chunk2::<0>(
                        hi,
                        join(a1, a3),
                        scales2(sc[c + 1].into(), sc[c + 1].into(), sc[c + 3].into(), sc[c + 3].into()),
                    ),
                );
            }
            let (dy, mins) = (q8_k_d(y), mins_dot(y, mins_32(m)));
            sums = accumulate(sums, f16_at(b, 0) * dy, fold(acc));
            sumf -= f16_at(b, 2) * dy * mins as f32;
        }
        add_lanes(sumf, lanes(sums))
    }

    /// Q5_K row; as [`q4_k`] with the fifth bits of `qh` (bit `c` of byte `j` for chunk `c`).
    ///
    /// # Safety
    /// AVX-512F, AVX-512BW, AVX2.
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    pub(super) unsafe fn q5_k(w: &[u8], act: &[u8], pq: &[u8]) -> f32 {
        let blocks = check_row(w, act, pq, 176, Q8_K_BYTES, QK_K);
        let (mut sums, mut sumf) = (_mm256_setzero_ps(), 0f32);
        let m4 = _mm512_set1_epi8(0x0f);
        for i in 0..blocks {
            let (b, y, a) = (&w[i * 176..(i + 1) * 176], &act[i * Q8_K_BYTES..(i + 1) * Q8_K_BYTES], &pq[i * QK_K..]);
            let (sc, m) = q4_k_scales(b);
            // SAFETY: `qh` is bytes 16..48 of the block.
            let qh = unsafe { load(b.as_ptr().add(16)) };
            let qh = perm(join(qh, qh));
            let mut acc = _mm512_setzero_si512();
            for q in 0..2 {
                // SAFETY: `qs` bytes 64q..64q + 64 at 48 + 64q < 176; codes 128q..128q + 128 of `a`.
                let (raw, a0, a1, a2, a3) = unsafe {
                    let ap = a.as_ptr().add(128 * q);
                    (
                        load64(b.as_ptr().add(48 + 64 * q)),
                        load(ap),
                        load(ap.add(32)),
                        load(ap.add(64)),
                        load(ap.add(96)),
                    )
                };
                let raw = perm(raw);
                let c = 4 * q;
                // Fifth bits: chunk c (low half) and c + 2 (high half), then c + 1 and c + 3.
                let h_lo =
                    join(_mm512_castsi512_si256(bit(qh, c as u32)), _mm512_castsi512_si256(bit(qh, c as u32 + 2)));
                let h_hi =
                    join(_mm512_castsi512_si256(bit(qh, c as u32 + 1)), _mm512_castsi512_si256(bit(qh, c as u32 + 3)));
                let lo = _mm512_or_si512(_mm512_and_si512(raw, m4), _mm512_slli_epi16::<4>(h_lo));
                let hi =
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4), _mm512_slli_epi16::<4>(h_hi));
                acc = _mm512_add_epi32(
                    acc,
                    chunk2::<0>(
                        lo,
                        join(a0, a2),
                        scales2(sc[c].into(), sc[c].into(), sc[c + 2].into(), sc[c + 2].into()),
                    ),
                );
                acc = _mm512_add_epi32(
                    acc,
                    chunk2::<0>(
                        hi,
                        join(a1, a3),
                        scales2(sc[c + 1].into(), sc[c + 1].into(), sc[c + 3].into(), sc[c + 3].into()),
                    ),
                );
            }
            let (dy, mins) = (q8_k_d(y), mins_dot(y, mins_32(m)));
            sums = accumulate(sums, f16_at(b, 0) * dy, fold(acc));
            sumf -= f16_at(b, 2) * dy * mins as f32;
        }
        add_lanes(sumf, lanes(sums))
    }

    /// Q6_K row; see [`super::avx2`]'s `q6_k`. Per 128 elements, `ql` (64 bytes) is one register:
    /// low nibbles chunks `4h` and `4h + 1`, high nibbles `4h + 2` and `4h + 3`.
    ///
    /// # Safety
    /// AVX-512F, AVX-512BW, AVX2.
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    pub(super) unsafe fn q6_k(w: &[u8], act: &[u8], pq: &[u8]) -> f32 {
        let blocks = check_row(w, act, pq, 210, Q8_K_BYTES, QK_K);
        let mut sums = _mm256_setzero_ps();
        let m4 = _mm512_set1_epi8(0x0f);
        for i in 0..blocks {
            let (b, y, a) = (&w[i * 210..(i + 1) * 210], &act[i * Q8_K_BYTES..(i + 1) * Q8_K_BYTES], &pq[i * QK_K..]);
            let sc: [i16; 16] = std::array::from_fn(|j| i16::from(b[192 + j] as i8));
            let mut acc = _mm512_setzero_si512();
            for h in 0..2 {
                // SAFETY: `ql` bytes 64h..64h + 64 and `qh` bytes 128 + 32h..160 + 32h of the
                // block; codes 128h..128h + 128 of `a`.
                let (ql, qh, a01, a23) = unsafe {
                    let p = b.as_ptr();
                    let qh = load(p.add(128 + 32 * h));
                    (
                        load64(p.add(64 * h)),
                        join(qh, qh),
                        load64(a.as_ptr().add(128 * h)),
                        load64(a.as_ptr().add(128 * h + 64)),
                    )
                };
                let (ql, qh) = (perm(ql), perm(qh));
                // qh bits 2cc..2cc + 2 for chunk cc: (0, 1) in the halves for the low nibbles,
                // (2, 3) for the high ones.
                let h01 = join(_mm512_castsi512_si256(bits2(qh, 0)), _mm512_castsi512_si256(bits2(qh, 2)));
                let h23 = join(_mm512_castsi512_si256(bits2(qh, 4)), _mm512_castsi512_si256(bits2(qh, 6)));
                let u01 = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_slli_epi16::<4>(h01));
                let u23 =
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4), _mm512_slli_epi16::<4>(h23));
                let c = 4 * h;
                let s01 = scales2(sc[2 * c], sc[2 * c + 1], sc[2 * c + 2], sc[2 * c + 3]);
                let s23 = scales2(sc[2 * c + 4], sc[2 * c + 5], sc[2 * c + 6], sc[2 * c + 7]);
                acc = _mm512_add_epi32(acc, chunk2::<32>(u01, a01, s01));
                acc = _mm512_add_epi32(acc, chunk2::<32>(u23, a23, s23));
            }
            sums = accumulate(sums, f16_at(b, 208) * q8_k_d(y), fold(acc));
        }
        add_lanes(0.0, lanes(sums))
    }

    /// Q3_K row; see [`super::avx2`]'s `q3_k`: chunks `4h + 2t` and `4h + 2t + 1` per register.
    ///
    /// # Safety
    /// AVX-512F, AVX-512BW, AVX2.
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    pub(super) unsafe fn q3_k(w: &[u8], act: &[u8], pq: &[u8]) -> f32 {
        let blocks = check_row(w, act, pq, 110, Q8_K_BYTES, QK_K);
        let mut sums = _mm256_setzero_ps();
        for i in 0..blocks {
            let (b, y, a) = (&w[i * 110..(i + 1) * 110], &act[i * Q8_K_BYTES..(i + 1) * Q8_K_BYTES], &pq[i * QK_K..]);
            let sc = q3_k_scales(b);
            // SAFETY: `hmask` is bytes 0..32 of the block.
            let hm = unsafe { load(b.as_ptr()) };
            let hm = perm(join(hm, hm));
            let mut acc = _mm512_setzero_si512();
            for h in 0..2 {
                // SAFETY: `qs` bytes 32h..32h + 32 at 32 + 32h < 110.
                let qs = unsafe { load(b.as_ptr().add(32 + 32 * h)) };
                let qs = perm(join(qs, qs));
                for t in 0..2 {
                    let c = 4 * h + 2 * t;
                    let two = join(
                        _mm512_castsi512_si256(bits2(qs, 4 * t as u32)),
                        _mm512_castsi512_si256(bits2(qs, 4 * t as u32 + 2)),
                    );
                    let hb =
                        join(_mm512_castsi512_si256(bit(hm, c as u32)), _mm512_castsi512_si256(bit(hm, c as u32 + 1)));
                    let u = _mm512_or_si512(two, _mm512_slli_epi16::<2>(hb));
                    // SAFETY: codes 32c..32c + 64 ≤ 256 of `a`.
                    let av = unsafe { load64(a.as_ptr().add(32 * c)) };
                    let s = scales2(sc[2 * c], sc[2 * c + 1], sc[2 * c + 2], sc[2 * c + 3]);
                    acc = _mm512_add_epi32(acc, chunk2::<4>(u, av, s));
                }
            }
            sums = accumulate(sums, f16_at(b, 108) * q8_k_d(y), fold(acc));
        }
        add_lanes(0.0, lanes(sums))
    }

    /// Q2_K row; see [`super::avx2`]'s `q2_k`: chunks `4h + 2t` and `4h + 2t + 1` per register.
    ///
    /// # Safety
    /// AVX-512F, AVX-512BW, AVX2.
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    pub(super) unsafe fn q2_k(w: &[u8], act: &[u8], pq: &[u8]) -> f32 {
        let blocks = check_row(w, act, pq, 84, Q8_K_BYTES, QK_K);
        let mut sumf = 0f32;
        for i in 0..blocks {
            let (b, y, a) = (&w[i * 84..(i + 1) * 84], &act[i * Q8_K_BYTES..(i + 1) * Q8_K_BYTES], &pq[i * QK_K..]);
            let sc: [i16; 16] = std::array::from_fn(|j| i16::from(b[j] & 0x0f));
            let mut acc = _mm512_setzero_si512();
            for h in 0..2 {
                // SAFETY: `qs` bytes 32h..32h + 32 at 16 + 32h < 84.
                let qs = unsafe { load(b.as_ptr().add(16 + 32 * h)) };
                let qs = perm(join(qs, qs));
                for t in 0..2 {
                    let c = 4 * h + 2 * t;
                    let u = join(
                        _mm512_castsi512_si256(bits2(qs, 4 * t as u32)),
                        _mm512_castsi512_si256(bits2(qs, 4 * t as u32 + 2)),
                    );
                    // SAFETY: codes 32c..32c + 64 ≤ 256 of `a`.
                    let av = unsafe { load64(a.as_ptr().add(32 * c)) };
                    let s = scales2(sc[2 * c], sc[2 * c + 1], sc[2 * c + 2], sc[2 * c + 3]);
                    acc = _mm512_add_epi32(acc, chunk2::<0>(u, av, s));
                }
            }
            let dy = q8_k_d(y);
            let (dall, dmin) = (dy * f16_at(b, 80), dy * f16_at(b, 82));
            sumf += dall * hsum_i32(fold(acc)) as f32 - dmin * mins_dot(y, mins_q2_k(b)) as f32;
        }
        sumf
    }
}

#[cfg(test)]
mod tests {
    use super::super::dot::{matmul_quantized, matvec_quantized, vec_dot_type, DOT_TYPES};
    use super::super::kquants::scale_min_k4;
    use super::super::q8::{activation_bytes, quantize_activation, Q8Arith};
    use super::*;

    /// A small deterministic generator (64-bit LCG, high bits out).
    struct Lcg(u64);

    impl Lcg {
        fn next(&mut self) -> u32 {
            self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (self.0 >> 32) as u32
        }

        /// A finite f16 (any sign, exponent 0..=30: subnormals, zeros and normals up to 65504).
        fn f16(&mut self) -> [u8; 2] {
            let r = self.next();
            let bits = (r & 0x83ff) as u16 | (((r >> 10) % 31) as u16) << 10;
            bits.to_le_bytes()
        }
    }

    /// `blocks` random blocks of `ty`: random bytes, every f16 field a random finite f16, MXFP4's
    /// exponent byte anything.
    fn random_blocks(ty: GgmlType, blocks: usize, g: &mut Lcg) -> Vec<u8> {
        let bb = ty.block_bytes() as usize;
        let mut w: Vec<u8> = (0..blocks * bb).map(|_| g.next() as u8).collect();
        let f16_fields = super::super::f16_scale_fields(ty);
        for b in w.chunks_exact_mut(bb) {
            for &at in f16_fields {
                b[at..at + 2].copy_from_slice(&g.f16());
            }
        }
        w
    }

    /// `n` random inputs of `cols` values, each block of 32 with its own magnitude (some blocks all
    /// zero), quantized to `act` as the kernels do.
    fn random_activations(act: GgmlType, cols: usize, n: usize, g: &mut Lcg) -> Vec<u8> {
        let x: Vec<f32> = (0..n * cols)
            .map(|i| {
                let r = g.next();
                let scale = match (i / 32) % 5 {
                    0 => 0.0,
                    1 => 1e-3,
                    2 => 1.0,
                    3 => 40.0,
                    _ => 1e4,
                };
                (r as f32 / u32::MAX as f32 - 0.5) * scale
            })
            .collect();
        let per = activation_bytes(act, cols).unwrap();
        let mut out = vec![0u8; n * per];
        for (x, o) in x.chunks_exact(cols).zip(out.chunks_exact_mut(per)) {
            quantize_activation(act, Q8Arith::X86Avx, x, o).unwrap();
        }
        out
    }

    /// For every type and every level this CPU has, random weights × random activations in many
    /// shapes: `matvec_quantized` and `matmul_quantized` give the scalar code's bits.
    #[test]
    fn every_level_gives_the_scalar_bits() {
        let levels: Vec<Level> = Level::ALL.into_iter().filter(|l| *l != Level::Scalar).collect();
        for l in &levels {
            if !l.is_supported() {
                println!("{l}: not supported by this CPU, skipped");
            }
        }
        let levels: Vec<Level> = levels.into_iter().filter(|l| l.is_supported()).collect();
        let mut g = Lcg(7);
        let mut checked = 0usize;
        for ty in DOT_TYPES {
            let act = vec_dot_type(ty).unwrap();
            let be = ty.block_elems() as usize;
            let mut nonzero = 0;
            for (blocks, rows, n) in [(1, 1, 1), (2, 3, 2), (3, 5, 1), (8, 4, 3), (16, 2, 2), (11, 7, 4)] {
                let cols = blocks * be;
                for _ in 0..4 {
                    let w = random_blocks(ty, blocks * rows, &mut g);
                    let xqs = random_activations(act, cols, n, &mut g);
                    let per = xqs.len() / n;
                    let mut want = vec![0f32; rows * n];
                    for t in 0..n {
                        let mut y = vec![0f32; rows];
                        matvec_quantized(Level::Scalar, ty, &w, &xqs[t * per..(t + 1) * per], &mut y);
                        for r in 0..rows {
                            want[r * n + t] = y[r];
                        }
                    }
                    let want_bits: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
                    let mut scalar_mm = vec![0f32; rows * n];
                    matmul_quantized(Level::Scalar, ty, &w, &xqs, n, &mut scalar_mm);
                    assert_eq!(
                        scalar_mm.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        want_bits,
                        "{ty} scalar matmul"
                    );
                    for &level in &levels {
                        let mut got = vec![0f32; rows * n];
                        for t in 0..n {
                            let mut y = vec![0f32; rows];
                            matvec_quantized(level, ty, &w, &xqs[t * per..(t + 1) * per], &mut y);
                            for r in 0..rows {
                                got[r * n + t] = y[r];
                            }
                        }
                        let got_bits: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                        assert_eq!(
                            got_bits, want_bits,
                            "{ty} {level} matvec, {blocks} blocks × {rows} rows: {got:?} vs {want:?}"
                        );
                        let mut mm = vec![0f32; rows * n];
                        matmul_quantized(level, ty, &w, &xqs, n, &mut mm);
                        let mm_bits: Vec<u32> = mm.iter().map(|v| v.to_bits()).collect();
                        assert_eq!(mm_bits, want_bits, "{ty} {level} matmul, {blocks} blocks × {rows} rows × {n}");
                        checked += 2 * rows * n;
                    }
                    nonzero += want.iter().filter(|v| **v != 0.0).count();
                }
            }
            assert!(nonzero > 0, "{ty}: every output is zero");
        }
        println!("{checked} SIMD outputs bit-identical to the scalar ones");
    }

    /// Each SIMD kernel is the one that runs: the dispatch covers every dot type at both levels.
    #[test]
    fn every_dot_type_has_simd_kernels() {
        for ty in DOT_TYPES {
            for level in [Level::Avx2, Level::Avx512] {
                assert_eq!(row_fn(level, ty).is_some(), cfg!(target_arch = "x86_64"), "{ty} {level}");
            }
        }
    }

    /// The u32 unpacking of Q4_K's scales and the SIMD minimum sums equal the scalar ones.
    #[test]
    fn scale_and_min_helpers_equal_the_scalar_ones() {
        let mut g = Lcg(3);
        for _ in 0..1000 {
            let b: Vec<u8> = (0..176).map(|_| g.next() as u8).collect();
            let (sc, m) = q4_k_scales(&b);
            for j in 0..8 {
                assert_eq!((sc[j], m[j]), scale_min_k4(&b[4..16], j), "group {j}");
            }
            let y: Vec<u8> = (0..Q8_K_BYTES).map(|_| g.next() as u8).collect();
            #[cfg(target_arch = "x86_64")]
            if Level::Avx2.is_supported() {
                // SAFETY: AVX2 checked just above.
                let (k4, k2) =
                    unsafe { (avx2::mins_dot(&y, avx2::mins_32(m)), avx2::mins_dot(&y, avx2::mins_q2_k(&b))) };
                let m2: Vec<u8> = b[..16].iter().map(|v| v >> 4).collect();
                assert_eq!((k4, k2), (bsum_mins(&y, &m, 2), bsum_mins(&y, &m2, 1)));
            }
        }
    }

    #[test]
    fn perm_index_is_a_permutation_grouping_lanes() {
        let mut seen = [false; 32];
        for p in 0..32 {
            let e = perm_index(p);
            assert!(!seen[e]);
            seen[e] = true;
            assert_eq!(e % 8, p / 4, "byte {p} is in i32 lane {} and holds element {e}", p / 4);
        }
    }
}
