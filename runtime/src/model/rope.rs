//! Rotary position embedding, the "default" rope type of transformers (`rope_type: default`), in the
//! NeoX "rotate half" layout that Qwen3 uses: element `i` of a head is paired with element
//! `i + head_dim / 2`.
//!
//! Source: transformers `modeling_rope_utils._compute_default_rope_parameters` and
//! `models/qwen3_moe/modeling_qwen3_moe.py` (`rotate_half`, `apply_rotary_pos_emb`):
//!
//! ```text
//! inv_freq[i] = 1 / theta^(2i / head_dim)               i < head_dim / 2
//! cos, sin    = cos(pos * inv_freq[i]), sin(pos * inv_freq[i])   (f32, repeated for both halves)
//! out[i]      = x[i] * cos[i] - x[i + hd/2] * sin[i]
//! out[i+hd/2] = x[i + hd/2] * cos[i] + x[i] * sin[i]
//! ```
//!
//! `inv_freq` is computed in f64 and rounded once to f32; `pos * inv_freq` and the trigonometry are
//! f32, as in transformers' fp32 forward.

/// RoPE tables for one head width: `inv_freq [hd/2]` fixed, `cos`/`sin [hd/2]` of the current
/// position. Allocated once.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    pos: Option<usize>,
}

impl Rope {
    /// Tables for head width `head_dim` (even) and base `theta`.
    ///
    /// # Panics
    /// When `head_dim` is odd or zero (the config check rejects that earlier).
    pub fn new(head_dim: usize, theta: f64) -> Self {
        assert!(head_dim > 0 && head_dim.is_multiple_of(2), "RoPE needs an even head_dim, got {head_dim}");
        let half = head_dim / 2;
        let inv_freq = (0..half).map(|i| (1.0 / theta.powf((2 * i) as f64 / head_dim as f64)) as f32).collect();
        Rope { inv_freq, cos: vec![0.0; half], sin: vec![0.0; half], pos: None }
    }

    /// The inverse frequencies `[hd/2]`.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Computes `cos`/`sin` of position `pos` (cached: a repeated position costs nothing).
    pub fn set_pos(&mut self, pos: usize) {
        if self.pos == Some(pos) {
            return;
        }
        let p = pos as f32;
        for ((c, s), &f) in self.cos.iter_mut().zip(&mut self.sin).zip(&self.inv_freq) {
            let a = p * f;
            *c = a.cos();
            *s = a.sin();
        }
        self.pos = Some(pos);
    }

    /// Rotates every head of `x` (`[n_heads * head_dim]`) in place at the position of the last
    /// [`Rope::set_pos`].
    ///
    /// # Panics
    /// When `x.len()` is not a multiple of `head_dim`, or before the first `set_pos`.
    pub fn apply(&self, x: &mut [f32]) {
        assert!(self.pos.is_some(), "Rope::apply before set_pos");
        let half = self.inv_freq.len();
        assert!(x.len().is_multiple_of(2 * half), "RoPE: {} values are not whole heads of {}", x.len(), 2 * half);
        for head in x.chunks_exact_mut(2 * half) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * self.cos[i] - x2 * self.sin[i];
                b[i] = x2 * self.cos[i] + x1 * self.sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_f64_rotation_and_preserves_norm() {
        let hd = 16;
        let mut r = Rope::new(hd, 1e6);
        assert_eq!(r.inv_freq()[0], 1.0);
        assert_eq!(r.inv_freq()[1], (1.0 / 1e6f64.powf(2.0 / 16.0)) as f32);
        let x: Vec<f32> = (0..2 * hd).map(|i| (i as f32 * 0.37).sin()).collect();
        for pos in [0usize, 1, 27, 511] {
            r.set_pos(pos);
            let mut y = x.clone();
            r.apply(&mut y);
            for h in 0..2 {
                for i in 0..hd / 2 {
                    let a = pos as f64 * 1e6f64.powf(-((2 * i) as f64) / hd as f64);
                    let (x1, x2) = (f64::from(x[h * hd + i]), f64::from(x[h * hd + i + hd / 2]));
                    let want1 = x1 * a.cos() - x2 * a.sin();
                    let want2 = x2 * a.cos() + x1 * a.sin();
                    assert!((f64::from(y[h * hd + i]) - want1).abs() < 1e-4, "pos {pos} i {i}");
                    assert!((f64::from(y[h * hd + i + hd / 2]) - want2).abs() < 1e-4, "pos {pos} i {i}");
                }
            }
            if pos == 0 {
                assert_eq!(x, y);
            }
            let n0: f32 = x.iter().map(|v| v * v).sum();
            let n1: f32 = y.iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-4);
        }
    }
}
