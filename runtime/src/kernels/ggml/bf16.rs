//! ggml's BF16 products, as ggml-cpu computes them on an x86-64 CPU with AVX512-BF16 (what
//! llama.cpp runs on this project's machines, `GGML_NATIVE`): the input rounded to BF16
//! (`ggml_cpu_fp32_to_bf16`: round to nearest even), then `ggml_vec_dot_bf16` per weight row
//! (`ggml-cpu/vec.cpp`): two 16-lane accumulators fed by `_mm512_dpbf16_ps` over each 64 values
//! (lane `j` of a 32-value half adds the product of pair element `2j + 1`, then of `2j`; products of
//! two BF16 values are exact in f32, each add rounds to nearest even with denormals flushed), each
//! reduced as GCC's `_mm512_reduce_add_ps` does (halves: 16 → 8 → 4, then `(0 + 2) + (1 + 3)`), the
//! two sums and the products of the last `n % 64` values added in f64, the total rounded to f32.
//!
//! Emulated in scalar code: the result has those bits on any CPU.

/// The f32 `v` rounded to BF16 bits as ggml does (`GGML_FP32_TO_BF16`): round to nearest even; a
/// NaN stays a quiet NaN.
pub fn bf16_bits(v: f32) -> u16 {
    let u = v.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

fn widen(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// Denormals as zero (DPBF16PS's DAZ on inputs and FTZ on results), keeping the sign.
fn flush(v: f32) -> f32 {
    if v != 0.0 && v.abs() < f32::MIN_POSITIVE {
        0.0f32.copysign(v)
    } else {
        v
    }
}

/// GCC's `_mm512_reduce_add_ps` of 16 lanes.
fn reduce16(c: &[f32; 16]) -> f32 {
    let t3: [f32; 8] = std::array::from_fn(|i| c[8 + i] + c[i]);
    let t6: [f32; 4] = std::array::from_fn(|i| t3[4 + i] + t3[i]);
    (t6[0] + t6[2]) + (t6[1] + t6[3])
}

/// `ggml_vec_dot_bf16` of weight row `w` (BF16 bits) with input `x` (BF16 bits), as the module docs
/// describe.
fn dot_row(w: &[u16], x: &[u16]) -> f32 {
    let n = w.len();
    let (mut c1, mut c2) = ([0f32; 16], [0f32; 16]);
    let mut i = 0;
    while i + 64 <= n {
        for (c, base) in [(&mut c1, i), (&mut c2, i + 32)] {
            for (j, lane) in c.iter_mut().enumerate() {
                let p = |k: usize| flush(widen(w[base + k])) * flush(widen(x[base + k]));
                *lane = flush(flush(*lane + p(2 * j + 1)) + p(2 * j));
            }
        }
        i += 64;
    }
    let mut sum = f64::from(reduce16(&c1)) + f64::from(reduce16(&c2));
    for k in i..n {
        sum += f64::from(widen(w[k]) * widen(x[k]));
    }
    sum as f32
}

/// `out[r]` = ggml's BF16 product of weight row `r` (`weights`: `out.len()` rows of `x.len()` BF16
/// values, little-endian bytes as stored in a GGUF) with `x`, rounded to BF16 first.
///
/// # Panics
/// When `weights` is not `out.len() * x.len() * 2` bytes (the kernels check the shape first).
pub fn matvec(weights: &[u8], x: &[f32], out: &mut [f32]) {
    let n = x.len();
    assert_eq!(weights.len(), out.len() * n * 2, "matvec_bf16_ggml: weights do not match [{}, {n}]", out.len());
    let xb: Vec<u16> = x.iter().map(|&v| bf16_bits(v)).collect();
    let mut row = vec![0u16; n];
    for (o, w) in out.iter_mut().zip(weights.chunks_exact(2 * n.max(1))) {
        for (d, c) in row.iter_mut().zip(w.chunks_exact(2)) {
            *d = u16::from_le_bytes([c[0], c[1]]);
        }
        *o = dot_row(&row, &xb);
    }
}

/// `yt[r * n + t]` = [`matvec`] of input `t` of `xs` (`n` inputs of `xs.len() / n` values) for
/// every weight row `r` (the transposed layout of [`crate::kernels::Kernels::matmul`]).
///
/// # Panics
/// As [`matvec`].
pub fn matmul(weights: &[u8], xs: &[f32], n: usize, yt: &mut [f32]) {
    let (cols, rows) = (xs.len() / n, yt.len() / n);
    let mut y = vec![0f32; rows];
    for (t, x) in xs.chunks_exact(cols.max(1)).enumerate().take(n) {
        matvec(weights, x, &mut y);
        for (r, v) in y.iter().enumerate() {
            yt[r * n + t] = *v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_to_nearest_even_and_keeps_nan() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: even (1) wins; 1 + 3·2^-8 rounds up.
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
        assert!(widen(bf16_bits(f32::NAN)).is_nan());
        assert_eq!(bf16_bits(-0.0), 0x8000);
    }

    #[test]
    fn small_integer_products_are_exact_and_the_tail_is_summed() {
        // 64 + 3 values: the lanes, the reduction and the f64 tail see only small integers.
        let n = 67;
        let x: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
        let w: Vec<f32> = (0..2 * n).map(|i| (i % 5) as f32 - 2.0).collect();
        let bytes: Vec<u8> = w.iter().flat_map(|&v| bf16_bits(v).to_le_bytes()).collect();
        let mut out = [0f32; 2];
        matvec(&bytes, &x, &mut out);
        for (r, o) in out.iter().enumerate() {
            let want: f32 = (0..n).map(|c| w[r * n + c] * x[c]).sum();
            assert_eq!(*o, want, "row {r}");
        }
    }
}
