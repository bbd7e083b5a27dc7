//! ggml's legacy 32-element blocks. Q4_0, Q4_1, Q5_0 and Q5_1 share one layout, read by one
//! function ([`LegacyBlock::dequantize`]): an f16 scale `d`, for the `_1` types an f16 minimum `m`,
//! for the Q5 types a little-endian u32 of fifth bits (bit j for element j), then 16 bytes whose low
//! nibbles are elements 0..16 and high nibbles elements 16..32. Q8_0 is an f16 `d` and 32 i8.

use super::f16_at;

/// Which fields a legacy block has.
#[derive(Debug, Clone, Copy)]
pub struct LegacyBlock {
    /// An f16 minimum after `d` (Q4_1, Q5_1): `y = d·q + m`; without one, `y = d·(q − 2^(bits−1))`.
    pub min: bool,
    /// A u32 of fifth bits before the nibbles (Q5_0, Q5_1).
    pub fifth_bit: bool,
}

impl LegacyBlock {
    /// Q4_0: 18 bytes, `y = d·(q − 8)`.
    pub const Q4_0: LegacyBlock = LegacyBlock { min: false, fifth_bit: false };
    /// Q4_1: 20 bytes, `y = d·q + m`.
    pub const Q4_1: LegacyBlock = LegacyBlock { min: true, fifth_bit: false };
    /// Q5_0: 22 bytes, `y = d·(q − 16)`.
    pub const Q5_0: LegacyBlock = LegacyBlock { min: false, fifth_bit: true };
    /// Q5_1: 24 bytes, `y = d·q + m`.
    pub const Q5_1: LegacyBlock = LegacyBlock { min: true, fifth_bit: true };

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        2 + if self.min { 2 } else { 0 } + if self.fifth_bit { 4 } else { 0 } + 16
    }

    /// Block `b`'s scale `d`, its minimum `m` (the `_1` types) and its 32 codes, signed: `q` for
    /// the `_1` types, `q − 2^(bits−1)` (in integers) for the `_0` types.
    pub fn decode(self, b: &[u8]) -> (f32, Option<f32>, [i32; 32]) {
        let offset = match (self.min, self.fifth_bit) {
            (true, _) => 0,
            (false, true) => 16,
            (false, false) => 8,
        };
        let d = f16_at(b, 0);
        let mut at = 2;
        let m = self.min.then(|| {
            at += 2;
            f16_at(b, 2)
        });
        let high = if self.fifth_bit {
            at += 4;
            u32::from_le_bytes([b[at - 4], b[at - 3], b[at - 2], b[at - 1]])
        } else {
            0
        };
        let qs = &b[at..at + 16];
        let q = std::array::from_fn(|j| {
            let nibble = if j < 16 { qs[j] & 0x0f } else { qs[j - 16] >> 4 };
            (i32::from(nibble) | (((high >> j) & 1) << 4) as i32) - offset
        });
        (d, m, q)
    }

    /// Decodes whole blocks of `bytes` into `out` (32 values per block). gguf-py and ggml agree on
    /// the operations: `d * (q - off) as f32` (the subtraction in integers) and `d * q + m`.
    pub fn dequantize(self, bytes: &[u8], out: &mut [f32]) {
        for (b, y) in bytes.chunks_exact(self.block_bytes()).zip(out.chunks_exact_mut(32)) {
            let (d, m, q) = self.decode(b);
            for (y, q) in y.iter_mut().zip(q) {
                *y = match m {
                    Some(m) => d * q as f32 + m,
                    None => d * q as f32,
                };
            }
        }
    }
}

/// A Q8_0 block's f16 `d` and its 32 codes.
pub(super) fn q8_0_decode(b: &[u8]) -> (f32, [i32; 32]) {
    (f16_at(b, 0), std::array::from_fn(|j| i32::from(b[2 + j] as i8)))
}

/// Q8_0 blocks of 34 bytes: `y = q · d` (gguf-py `x * d`; the product commutes).
pub(super) fn q8_0(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in bytes.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
        let (d, q) = q8_0_decode(b);
        for (y, q) in y.iter_mut().zip(q) {
            *y = q as f32 * d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_are_ggml_s() {
        use picchio_core::format::gguf::GgmlType;
        for (spec, ty) in [
            (LegacyBlock::Q4_0, GgmlType::Q4_0),
            (LegacyBlock::Q4_1, GgmlType::Q4_1),
            (LegacyBlock::Q5_0, GgmlType::Q5_0),
            (LegacyBlock::Q5_1, GgmlType::Q5_1),
        ] {
            assert_eq!(spec.block_bytes(), ty.block_bytes() as usize, "{ty}");
        }
    }

    /// A Q5_1 block built by hand: d = 0.5, m = −1, element j has code j (its fifth bit set from 16).
    #[test]
    fn a_hand_built_q5_1_block() {
        let mut b = vec![0x00, 0x38, 0x00, 0xbc]; // f16 0.5, f16 -1.0
        b.extend_from_slice(&0xffff_0000u32.to_le_bytes());
        b.extend((0..16u8).map(|j| j | (j << 4)));
        let mut y = [0f32; 32];
        LegacyBlock::Q5_1.dequantize(&b, &mut y);
        let want: Vec<f32> = (0..32).map(|j| 0.5 * j as f32 - 1.0).collect();
        assert_eq!(y.to_vec(), want);
    }
}
