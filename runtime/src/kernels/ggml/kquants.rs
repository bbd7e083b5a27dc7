//! ggml's K-quants: super-blocks of 256 elements with per-group scales (`block_q2_K` …
//! `block_q6_K` in `ggml-common.h`). Element `i`'s bits are found by the small index functions
//! below, which encode ggml's interleaving once; each type is then one loop over `i`.

use super::f16_at;
use picchio_core::format::gguf::GgmlType;

/// Elements per super-block (`QK_K`).
pub(super) const QK_K: usize = 256;

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
pub(super) fn scale_min_k4(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// One super-block decoded into what both dequantization and the dot products read: element `i`
/// is `(d · scale[i/16]) · q[i] − dmin · min[i/16]` (groups of 32 repeat their scale and minimum).
pub(super) struct KBlock {
    /// The f16 super-block scale.
    pub d: f32,
    /// The f16 minimum scale (Q2_K, Q4_K, Q5_K), 0 for Q3_K and Q6_K.
    pub dmin: f32,
    /// Per 16-element group, the integer scale.
    pub scale: [i32; 16],
    /// Per 16-element group, the integer minimum (0 for Q3_K and Q6_K).
    pub min: [i32; 16],
    /// The 256 signed codes.
    pub q: [i32; QK_K],
}

/// Decodes one super-block of `ty` (Q2_K … Q6_K; the caller checked the type and `b`'s length):
/// - Q2_K (84 bytes: `scales[16]`, `qs[64]`, f16 `d`, f16 `dmin`): group `j` of 16 has scale
///   `scales[j] & 15` and minimum `scales[j] >> 4`; codes 0..4.
/// - Q3_K (110 bytes: `hmask[32]`, `qs[64]`, 12 bytes of 6-bit scales, f16 `d`): the code is the
///   two low bits minus 4 when the high bit is clear; group scales `s_j − 32`.
/// - Q4_K (144 bytes: f16 `d`, f16 `dmin`, 12 bytes of scales and minimums, `qs[128]`) and Q5_K
///   (176 bytes: the same with `qh[32]` before `qs`): group `j` of 32 has scale `sc_j` and minimum
///   `m_j` ([`scale_min_k4`]); codes 0..16 (0..32 with the fifth bit).
/// - Q6_K (210 bytes: `ql[128]`, `qh[64]`, `scales[16]` i8, f16 `d`): 4 low bits (per 128
///   elements, 64 bytes, low nibbles first) and 2 high bits, minus 32; group scales i8.
pub(super) fn decode(ty: GgmlType, b: &[u8]) -> KBlock {
    let mut k = KBlock { d: 0.0, dmin: 0.0, scale: [0; 16], min: [0; 16], q: [0; QK_K] };
    match ty {
        GgmlType::Q2_K => {
            let (scales, qs) = (&b[..16], &b[16..80]);
            (k.d, k.dmin) = (f16_at(b, 80), f16_at(b, 82));
            k.scale = std::array::from_fn(|j| i32::from(scales[j] & 0x0f));
            k.min = std::array::from_fn(|j| i32::from(scales[j] >> 4));
            k.q = std::array::from_fn(|i| i32::from(two_bits(qs, i)));
        }
        GgmlType::Q3_K => {
            let (hmask, qs, s) = (&b[..32], &b[32..96], &b[96..108]);
            k.d = f16_at(b, 108);
            k.scale = std::array::from_fn(|j| {
                let low = if j < 8 { s[j] & 0x0f } else { s[j - 8] >> 4 };
                let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
                i32::from(low | (high << 4)) - 32
            });
            k.q = std::array::from_fn(|i| i32::from(two_bits(qs, i)) - if high_bit(hmask, i) == 1 { 0 } else { 4 });
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let fifth_bit = ty == GgmlType::Q5_K;
            let qs_at = if fifth_bit { 48 } else { 16 };
            (k.d, k.dmin) = (f16_at(b, 0), f16_at(b, 2));
            let (qh, qs) = (&b[16..48], &b[qs_at..qs_at + 128]);
            for j in 0..16 {
                let (sc, m) = scale_min_k4(&b[4..16], j / 2);
                (k.scale[j], k.min[j]) = (i32::from(sc), i32::from(m));
            }
            k.q = std::array::from_fn(|i| {
                let high = if fifth_bit { high_bit(qh, i) << 4 } else { 0 };
                i32::from(nibble(qs, i) | high)
            });
        }
        GgmlType::Q6_K => {
            let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
            k.d = f16_at(b, 208);
            k.scale = std::array::from_fn(|j| i32::from(scales[j] as i8));
            k.q = std::array::from_fn(|i| {
                let low = (ql[i / 128 * 64 + i % 64] >> (4 * (i % 128 / 64))) & 0x0f;
                i32::from(low | (two_bits(qh, i) << 4)) - 32
            });
        }
        _ => unreachable!("kquants::decode of {ty}"),
    }
    k
}

/// Dequantizes whole super-blocks of `ty` (Q2_K … Q6_K): `y = (d·scale)·q − dmin·min`, the
/// operations and order of ggml and gguf-py (for Q3_K and Q6_K, which have no minimum, the
/// subtraction of `0·0 = +0` leaves every value's bits as they were: `(d·sc)·q`).
pub(super) fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    for (b, y) in bytes.chunks_exact(ty.block_bytes() as usize).zip(out.chunks_exact_mut(QK_K)) {
        let k = decode(ty, b);
        for (i, y) in y.iter_mut().enumerate() {
            *y = k.d * k.scale[i / 16] as f32 * k.q[i] as f32 - k.dmin * k.min[i / 16] as f32;
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
