//! Element-wise helpers of the Qwen3-MoE forward pass, following Hugging Face transformers
//! (`Qwen3MoeRMSNorm`, `torch.softmax`, `torch.nn.functional.silu`), computed in `f32`.
//!
//! These are scalar at every kernel level: they use [`f32::exp`] (the platform libm, close to what
//! torch computes) and run on short vectors. RMSNorm's sum of squares goes through the level's `dot`
//! ([`super::Kernels::rmsnorm`]).

/// `1 / sqrt(sum_sq / n + eps)`: the RMSNorm multiplier from a sum of squares over `n` elements.
#[inline]
pub(super) fn rms_inv(sum_sq: f32, n: usize, eps: f32) -> f32 {
    let mean = if n == 0 { 0.0 } else { sum_sq / n as f32 };
    1.0 / (mean + eps).sqrt()
}

/// Softmax over `x` in place, in `f32`: `exp(x[i] - max) / sum_j exp(x[j] - max)`. An empty slice is
/// left as is. (Router probabilities and attention weights.)
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if x.is_empty() || max == f32::NEG_INFINITY {
        return;
    }
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// SiLU (swish): `x * sigmoid(x) = x / (1 + exp(-x))`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// The SwiGLU of a Qwen3 expert, in place: `gate[i] = silu(gate[i]) * up[i]`.
///
/// # Panics
/// When `gate.len() != up.len()`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul: gate and up lengths differ");
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// The SwiGLU of a converted expert whose `gate_up` rows are interleaved (DESIGN.md: row `2i` is gate
/// row `i`, row `2i + 1` is up row `i`): `out[i] = silu(gate_up[2i]) * gate_up[2i + 1]`.
///
/// # Panics
/// When `gate_up.len() != 2 * out.len()`.
pub fn silu_mul_interleaved(gate_up: &[f32], out: &mut [f32]) {
    assert_eq!(gate_up.len(), 2 * out.len(), "silu_mul_interleaved: gate_up must hold 2 values per output");
    for (o, gu) in out.iter_mut().zip(gate_up.chunks_exact(2)) {
        *o = silu(gu[0]) * gu[1];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_sums_to_one_and_is_shift_invariant() {
        let mut a = [1.0f32, 2.0, 3.0, -1.0];
        let mut b = a.map(|v| v + 100.0);
        softmax_inplace(&mut a);
        softmax_inplace(&mut b);
        assert!((a.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-6);
        }
        let e: Vec<f64> = [1.0f64, 2.0, 3.0, -1.0].iter().map(|v| v.exp()).collect();
        let s: f64 = e.iter().sum();
        for (x, ev) in a.iter().zip(&e) {
            assert!((f64::from(*x) - ev / s).abs() < 1e-7);
        }
        let mut empty: [f32; 0] = [];
        softmax_inplace(&mut empty);
        let mut masked = [f32::NEG_INFINITY, 0.0];
        softmax_inplace(&mut masked);
        assert_eq!(masked, [0.0, 1.0]);
    }

    #[test]
    fn silu_values() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((silu(-20.0) + 20.0 * (-20f32).exp()).abs() < 1e-9);
        assert_eq!(silu(-100.0), -0.0);
        let mut g = [1.0f32, -2.0];
        silu_mul(&mut g, &[2.0, 3.0]);
        assert_eq!(g, [silu(1.0) * 2.0, silu(-2.0) * 3.0]);
        let mut out = [0f32; 2];
        silu_mul_interleaved(&[1.0, 2.0, -2.0, 3.0], &mut out);
        assert_eq!(out, g);
    }
}
