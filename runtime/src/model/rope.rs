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
//!
//! YaRN (`rope_type: yarn`, [`Rope::from_config`]) follows transformers 5
//! `modeling_rope_utils._compute_yarn_parameters`, in f32 where it computes in f32:
//!
//! ```text
//! pos_freq[i] = theta^(2i / hd)                                           (f32)
//! d(r)        = hd ln(original_max / (2 pi r)) / (2 ln theta)             (f64)
//! low, high   = max(d(beta_fast), 0), min(d(beta_slow), hd - 1)           (floor / ceil when truncate)
//! ramp[i]     = clamp((i - low) / (high - low), 0, 1)                     (high += 0.001 when equal)
//! e[i]        = 1 - ramp[i]                                               (extrapolation weight)
//! inv_freq[i] = 1 / (factor pos_freq[i]) * (1 - e[i]) + 1 / pos_freq[i] * e[i]
//! cos, sin    = cos(pos inv_freq) * attention_factor, sin(pos inv_freq) * attention_factor
//! ```
//!
//! The `attention_factor` scales both q and k, so it multiplies the attention logits by its square
//! (transformers applies it to cos and sin, as here).

use crate::model::config::{RopeConfig, RopeScaling};

/// RoPE tables for one head width: `inv_freq [hd/2]` fixed, `cos`/`sin [hd/2]` of the current
/// position. Allocated once.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// Multiplies cos and sin (YaRN's attention factor; 1 for plain RoPE).
    scaling: f32,
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
        Rope { inv_freq, cos: vec![0.0; half], sin: vec![0.0; half], scaling: 1.0, pos: None }
    }

    /// Tables for head width `head_dim` (even) and the config's RoPE variant: [`Rope::new`] for
    /// `default`, YaRN as in the module docs.
    ///
    /// # Panics
    /// When `head_dim` is odd or zero (the config check rejects that earlier).
    pub fn from_config(head_dim: usize, rope: &RopeConfig) -> Self {
        let RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            original_max_position_embeddings,
            truncate,
            attention_factor,
        } = rope.scaling
        else {
            return Rope::new(head_dim, rope.theta);
        };
        let mut r = Rope::new(head_dim, rope.theta);
        let (dim, base) = (head_dim as f64, rope.theta);
        let correction_dim = |rot: f64| {
            dim * (original_max_position_embeddings / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
        };
        let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
        if truncate {
            low = low.floor();
            high = high.ceil();
        }
        let (low, mut high) = (low.max(0.0) as f32, high.min(dim - 1.0) as f32);
        if low == high {
            high += 0.001;
        }
        let (base32, factor32) = (base as f32, factor as f32);
        for (i, f) in r.inv_freq.iter_mut().enumerate() {
            let pos_freq = base32.powf((2 * i) as f32 / head_dim as f32);
            let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation = 1.0 - ramp;
            *f = 1.0 / (factor32 * pos_freq) * (1.0 - extrapolation) + 1.0 / pos_freq * extrapolation;
        }
        r.scaling = attention_factor as f32;
        r
    }

    /// The factor cos and sin are multiplied by (YaRN's attention factor; 1 for plain RoPE).
    pub fn attention_scaling(&self) -> f32 {
        self.scaling
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
            *c = a.cos() * self.scaling;
            *s = a.sin() * self.scaling;
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

    #[test]
    fn yarn_matches_f64_formula_and_scales_cos_sin() {
        // The GPT-OSS fixture: head_dim 16, theta 150000, factor 32, beta 32/1, original 4096, no truncate.
        let (hd, theta, factor) = (16usize, 150000f64, 32f64);
        let cfg = RopeConfig {
            theta,
            scaling: RopeScaling::Yarn {
                factor,
                beta_fast: 32.0,
                beta_slow: 1.0,
                original_max_position_embeddings: 4096.0,
                truncate: false,
                attention_factor: 0.1 * factor.ln() + 1.0,
            },
        };
        let mut r = Rope::from_config(hd, &cfg);
        let d = |rot: f64| hd as f64 * (4096f64 / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
        let (low, high) = (d(32.0).max(0.0), d(1.0).min(hd as f64 - 1.0));
        for i in 0..hd / 2 {
            let pf = theta.powf((2 * i) as f64 / hd as f64);
            let e = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let want = 1.0 / (factor * pf) * (1.0 - e) + e / pf;
            let got = f64::from(r.inv_freq()[i]);
            assert!((got - want).abs() <= 1e-6 * want, "inv_freq[{i}] {got} vs {want}");
        }
        // the first frequencies extrapolate (unscaled), the last interpolate (divided by the factor)
        assert_eq!(r.inv_freq()[0], 1.0);
        let last = 1.0 / (factor * theta.powf((hd - 2) as f64 / hd as f64));
        assert!((f64::from(r.inv_freq()[hd / 2 - 1]) - last).abs() < 1e-6 * last);
        r.set_pos(5);
        let mut x = vec![0f32; hd];
        x[0] = 1.0;
        r.apply(&mut x);
        let s = r.attention_scaling();
        assert!((f64::from(s) - (0.1 * 32f64.ln() + 1.0)).abs() < 1e-6);
        assert!((x[0] - 5f32.cos() * s).abs() < 1e-6 && (x[hd / 2] - 5f32.sin() * s).abs() < 1e-6);
        // default scaling is plain RoPE
        let plain = Rope::from_config(hd, &RopeConfig { theta, scaling: RopeScaling::Default });
        assert_eq!((plain.inv_freq(), plain.attention_scaling()), (Rope::new(hd, theta).inv_freq(), 1.0));
    }
}
