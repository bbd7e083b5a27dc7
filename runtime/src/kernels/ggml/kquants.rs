//! ggml's K-quants: super-blocks of 256 elements with per-group scales (`block_q2_K` …
//! `block_q6_K` in `ggml-common.h`). Element `i`'s bits are found by the small index functions
//! below, which encode ggml's interleaving once; each type is then one loop over `i`.

use super::f16_at;

/// Elements per super-block (`QK_K`).
const QK_K: usize = 256;

/// A 2-bit field of the planes Q2_K's and Q3_K's `qs` and Q6_K's `qh` use: per 128 elements, 32
/// bytes, element `i` at bits `2·((i mod 128) / 32)` of byte `32·(i / 128) + i mod 32`.
fn two_bits(plane: &[u8], i: usize) -> u8 {
    (plane[i / 128 * 32 + i % 32] >> (2 * (i % 128 / 32))) & 3
}

/// A 4-bit field of Q4_K's and Q5_K's `qs`: per 64 elements, 32 bytes, low nibbles first.
fn nibble(qs: &[u8], i: usize) -> u8 {
    (qs[i / 64 * 32 + i % 32] >> (4 * (i % 64 / 32))) & 0x0f
}

/// One bit of a 32-byte high-bit mask (Q3_K's `hmask`, Q5_K's `qh`): bit `i / 32` of byte `i mod 32`.
fn high_bit(mask: &[u8], i: usize) -> u8 {
    (mask[i % 32] >> (i / 32)) & 1
}

/// Q4_K's and Q5_K's 6-bit scale and minimum of group `j` (0..8) from their 12 packed bytes
/// (ggml's `get_scale_min_k4`).
fn scale_min_k4(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Q2_K (84 bytes: `scales[16]`, `qs[64]`, f16 `d`, f16 `dmin`): group `j` of 16 has scale
/// `d · (scales[j] & 15)` and minimum `dmin · (scales[j] >> 4)`; `y = dl·q − ml` (ggml and gguf-py).
pub(super) fn q2_k(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in bytes.chunks_exact(84).zip(out.chunks_exact_mut(QK_K)) {
        let (scales, qs) = (&b[..16], &b[16..80]);
        let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
        for (i, y) in y.iter_mut().enumerate() {
            let sc = scales[i / 16];
            let dl = d * f32::from(sc & 0x0f);
            let ml = dmin * f32::from(sc >> 4);
            *y = dl * f32::from(two_bits(qs, i)) - ml;
        }
    }
}

/// Q3_K (110 bytes: `hmask[32]`, `qs[64]`, 12 bytes of 6-bit scales, f16 `d`): the code is the two
/// low bits minus 4 when the high bit is clear; group `j` of 16 has scale `d · (s_j − 32)`;
/// `y = dl · q` (ggml and gguf-py).
pub(super) fn q3_k(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in bytes.chunks_exact(110).zip(out.chunks_exact_mut(QK_K)) {
        let (hmask, qs, s) = (&b[..32], &b[32..96], &b[96..108]);
        let d = f16_at(b, 108);
        let scale = |j: usize| {
            let low = if j < 8 { s[j] & 0x0f } else { s[j - 8] >> 4 };
            let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
            i32::from(low | (high << 4)) - 32
        };
        for (i, y) in y.iter_mut().enumerate() {
            let dl = d * scale(i / 16) as f32;
            let q = i32::from(two_bits(qs, i)) - if high_bit(hmask, i) == 1 { 0 } else { 4 };
            *y = dl * q as f32;
        }
    }
}

/// Q4_K (144 bytes: f16 `d`, f16 `dmin`, 12 bytes of scales and minimums, `qs[128]`) and, with
/// `fifth_bit`, Q5_K (176 bytes: the same with `qh[32]` before `qs`): group `j` of 32 has scale
/// `d · sc_j` and minimum `dmin · m_j`; `y = (d·sc)·q − dmin·m` (ggml and gguf-py).
pub(super) fn q4_k_q5_k(fifth_bit: bool, bytes: &[u8], out: &mut [f32]) {
    let (block, qs_at) = if fifth_bit { (176, 48) } else { (144, 16) };
    for (b, y) in bytes.chunks_exact(block).zip(out.chunks_exact_mut(QK_K)) {
        let (d, dmin, scales) = (f16_at(b, 0), f16_at(b, 2), &b[4..16]);
        let (qh, qs) = (&b[16..48], &b[qs_at..qs_at + 128]);
        for (i, y) in y.iter_mut().enumerate() {
            let (sc, m) = scale_min_k4(scales, i / 32);
            let high = if fifth_bit { high_bit(qh, i) << 4 } else { 0 };
            let q = nibble(qs, i) | high;
            *y = d * f32::from(sc) * f32::from(q) - dmin * f32::from(m);
        }
    }
}

/// Q6_K (210 bytes: `ql[128]`, `qh[64]`, `scales[16]` i8, f16 `d`): the code is 4 low bits (per 128
/// elements, 64 bytes, low nibbles first) and 2 high bits, minus 32; group `j` of 16 has scale
/// `d · scales[j]`; `y = (d·sc)·q` (ggml: `d * sc * q`, the same order).
pub(super) fn q6_k(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in bytes.chunks_exact(210).zip(out.chunks_exact_mut(QK_K)) {
        let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
        let d = f16_at(b, 208);
        for (i, y) in y.iter_mut().enumerate() {
            let low = (ql[i / 128 * 64 + i % 64] >> (4 * (i % 128 / 64))) & 0x0f;
            let q = i32::from(low | (two_bits(qh, i) << 4)) - 32;
            *y = d * f32::from(scales[i / 16] as i8) * q as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The index functions visit every byte and bit of their planes exactly once.
    #[test]
    fn index_functions_cover_their_planes_once() {
        let mut seen = vec![0u32; 64 * 8];
        for i in 0..QK_K {
            let at = i / 128 * 32 + i % 32;
            let shift = 2 * (i % 128 / 32);
            for bit in shift..shift + 2 {
                seen[at * 8 + bit] += 1;
            }
            let mut plane = [0u8; 64];
            plane[at] = 3 << shift;
            assert_eq!(two_bits(&plane, i), 3);
        }
        assert!(seen.iter().all(|&n| n == 1));
        let mut seen = vec![0u32; 128];
        for i in 0..QK_K {
            let mut qs = [0u8; 128];
            let at = i / 64 * 32 + i % 32;
            qs[at] = 0x0f << (4 * (i % 64 / 32));
            assert_eq!(nibble(&qs, i), 15);
            seen[at] += 1;
            let mut mask = [0u8; 32];
            mask[i % 32] = 1 << (i / 32);
            assert_eq!(high_bit(&mask, i), 1);
        }
        assert!(seen.iter().all(|&n| n == 2), "two nibbles per byte");
    }

    /// The packed scales of Q4_K: six bits each, the high two of groups 4..8 in the top bits of
    /// bytes 0..8.
    #[test]
    fn scale_min_k4_unpacks_six_bit_fields() {
        // Pack sc_j = j + 40, m_j = 63 - j the way ggml's quantizer does.
        let (sc, m): (Vec<u8>, Vec<u8>) = (0..8).map(|j| (j + 40, 63 - j)).unzip();
        let mut s = [0u8; 12];
        for (j, (&sc_j, &m_j)) in sc.iter().zip(&m).enumerate() {
            if j < 4 {
                s[j] = sc_j;
                s[j + 4] = m_j;
            } else {
                s[j + 4] = (sc_j & 0x0f) | ((m_j & 0x0f) << 4);
                s[j - 4] |= (sc_j >> 4) << 6;
                s[j] |= (m_j >> 4) << 6;
            }
        }
        for (j, want) in sc.into_iter().zip(m).enumerate() {
            assert_eq!(scale_min_k4(&s, j), want, "group {j}");
        }
    }
}
