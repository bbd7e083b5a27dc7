//! The float types and MXFP4: F32 (the bytes), F16 and BF16 (widened exactly), and MXFP4 (OCP
//! microscaling: E2M1 codes times a power-of-two scale).

/// ggml's `kvalues_mxfp4`: the E2M1 code values, doubled (the scale is halved to match).
const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// An IEEE binary16 widened to f32 exactly, NaN payloads kept and not quieted (as numpy's
/// `astype(np.float32)` does; ggml's software conversion quiets a signalling NaN, the only place
/// the two differ).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = h & 0x7c00;
    let man = u32::from(h & 0x03ff);
    let bits = match exp {
        // Zero and subnormals: man · 2^-24, exact in f32.
        0 => (man as f32 * f32::from_bits(0x3380_0000)).to_bits(),
        // Infinities and NaNs: the exponent all ones, the payload shifted into place.
        0x7c00 => 0x7f80_0000 | (man << 13),
        // Normal: rebias the exponent (127 − 15 = 112).
        _ => (u32::from(h & 0x7fff) << 13) + (112 << 23),
    };
    f32::from_bits(sign | bits)
}

/// ggml's `GGML_E8M0_TO_FP32_HALF`: half of 2^(e − 127), as f32 bits (subnormal for e < 2).
pub(super) fn e8m0_half(e: u8) -> f32 {
    let e = u32::from(e);
    f32::from_bits(if e < 2 { 0x0020_0000 << e } else { (e - 1) << 23 })
}

/// F32: each 4 bytes, little-endian.
pub(super) fn f32s(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in bytes.chunks_exact(4).zip(out) {
        *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// F16: each 2 bytes, little-endian, widened by [`f16_to_f32`].
pub(super) fn f16s(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in bytes.chunks_exact(2).zip(out) {
        *y = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
}

/// BF16: each 2 bytes are the high half of an f32.
pub(super) fn bf16s(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in bytes.chunks_exact(2).zip(out) {
        *y = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
    }
}

/// An MXFP4 block's scale ([`e8m0_half`] of its exponent byte) and its 32 codes (ggml's doubled
/// `kvalues_mxfp4`): the low nibbles of bytes 1..17 are elements 0..16, the high nibbles 16..32.
pub(super) fn mxfp4_decode(b: &[u8]) -> (f32, [i32; 32]) {
    let q = std::array::from_fn(|j| {
        let nibble = if j < 16 { b[1 + j] & 0x0f } else { b[1 + j - 16] >> 4 };
        i32::from(MXFP4_VALUES[usize::from(nibble)])
    });
    (e8m0_half(b[0]), q)
}

/// MXFP4 blocks of 17 bytes: an E8M0 exponent `e`, then 16 bytes of E2M1 codes
/// ([`mxfp4_decode`]); `y = d · kvalue[code]` with `d` = [`e8m0_half`]`(e)`.
pub(super) fn mxfp4(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in bytes.chunks_exact(17).zip(out.chunks_exact_mut(32)) {
        let (d, q) = mxfp4_decode(b);
        for (y, q) in y.iter_mut().zip(q) {
            *y = d * q as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_widening_matches_the_half_crate_except_for_nan_payloads() {
        for h in 0..=u16::MAX {
            let ours = f16_to_f32(h);
            let theirs = half::f16::from_bits(h).to_f32();
            if theirs.is_nan() {
                // `half` sets the quiet bit; the payload and sign are the same.
                assert!(ours.is_nan());
                assert_eq!(ours.to_bits() | 0x0040_0000, theirs.to_bits(), "{h:#x}");
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{h:#x}");
            }
        }
        assert_eq!(f16_to_f32(0x7c01).to_bits(), 0x7f80_2000, "a signalling NaN stays signalling");
    }

    #[test]
    fn e8m0_half_is_half_a_power_of_two() {
        assert_eq!(e8m0_half(127), 0.5);
        assert_eq!(e8m0_half(128), 1.0);
        assert_eq!(e8m0_half(2), f32::powi(2.0, -126));
        assert_eq!(e8m0_half(1), f32::powi(2.0, -127));
        assert_eq!(e8m0_half(0), f32::powi(2.0, -128));
        assert_eq!(e8m0_half(255), f32::powi(2.0, 127));
    }
}
