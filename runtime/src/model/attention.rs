//! Scaled dot-product attention of one position over the KV cache, shared by every architecture:
//! grouped-query heads (transformers `repeat_kv`), an optional window (GPT-OSS `sliding_attention`
//! layers) and optional per-head sink logits (GPT-OSS `self_attn.sinks`).
//!
//! For query head `h` at position `pos`, over the cached positions `t` of the window
//! (`pos - W < t <= pos` for window W, transformers `masking_utils.sliding_window_overlay`; every
//! `t <= pos` without one):
//!
//! ```text
//! s_t    = q . key_t * scale
//! m      = max(max_t s_t, sink_h)                          (sink only when the layer has sinks)
//! att_t  = exp(s_t - m) / (sum_t exp(s_t - m) + exp(sink_h - m))
//! out    = sum_t att_t value_t
//! ```
//!
//! which is transformers' `eager_attention_forward` of `modeling_gpt_oss.py` (the sink column is
//! concatenated to the logits, the row max subtracted, softmax taken, the sink column dropped), and
//! the plain softmax of `modeling_qwen3_moe.py` without a sink.

use rayon::prelude::*;

use crate::kernels::{self, Kernels};

/// Attention runs its heads on the rayon pool when `heads * positions * head_dim` reaches this.
pub(crate) const PAR_ATTENTION_ELEMS: usize = 1 << 16;

/// One layer's attention at one position: the cached keys and values of the visible positions.
pub(crate) struct Attention<'a> {
    /// Kernels for the dot products and the weighted sum.
    pub k: Kernels,
    /// Keys `[n, nkv*hd]` of the `n` visible positions, oldest first.
    pub keys: &'a [f32],
    /// Values `[n, nkv*hd]`.
    pub values: &'a [f32],
    /// Width of one cached row `nkv*hd`.
    pub kvd: usize,
    /// Head width.
    pub hd: usize,
    /// Query heads per KV head.
    pub n_rep: usize,
    /// `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// Per query head sink logits `[nh]` (GPT-OSS), or none.
    pub sinks: Option<&'a [f32]>,
}

impl Attention<'_> {
    /// The first visible position for a query at `pos` in a layer with `window` (none: 0).
    pub fn first_visible(pos: usize, window: Option<usize>) -> usize {
        window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }

    /// Query head `hi` over `att.len()` positions (see the module docs), reading KV head
    /// `hi / n_rep`.
    pub(crate) fn head(&self, hi: usize, q: &[f32], att: &mut [f32], out: &mut [f32]) {
        let off = (hi / self.n_rep) * self.hd;
        // s_t = q . key_t * scale over the cached rows of KV head hi / n_rep (one kernel call).
        self.k.dot_rows(q, &self.keys[off..], self.kvd, self.scale, att);
        match self.sinks {
            None => kernels::softmax_inplace(att),
            Some(sinks) => softmax_with_sink(att, sinks[hi]),
        }
        // out = sum_t att_t value_t, in position order.
        self.k.weighted_rows(att, &self.values[off..], self.kvd, out);
    }

    /// Every head: `q [nh*hd]` → `out [nh*hd]`, with `att [nh, max_seq]` as score scratch (each
    /// head uses its first `n` entries). Heads are independent and each is computed by the same
    /// code, so running them on the rayon pool does not change a bit.
    pub fn run(&self, q: &[f32], att: &mut [f32], max_seq: usize, out: &mut [f32]) {
        let (hd, n) = (self.hd, self.keys.len() / self.kvd);
        let nh = q.len() / hd;
        if nh * n * hd >= PAR_ATTENTION_ELEMS {
            let heads = out.par_chunks_mut(hd).zip(att.par_chunks_mut(max_seq)).zip(q.par_chunks(hd));
            heads.enumerate().for_each(|(hi, ((out, att), q))| self.head(hi, q, &mut att[..n], out));
        } else {
            let heads = out.chunks_mut(hd).zip(att.chunks_mut(max_seq)).zip(q.chunks(hd));
            heads.enumerate().for_each(|(hi, ((out, att), q))| self.head(hi, q, &mut att[..n], out));
        }
    }
}

/// `x_t = exp(x_t - m) / (sum exp(x - m) + exp(sink - m))` with `m = max(max x, sink)`, in place.
fn softmax_with_sink(x: &mut [f32], sink: f32) {
    let m = x.iter().copied().fold(sink, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    sum += (sink - m).exp();
    for v in x.iter_mut() {
        *v /= sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sink_takes_its_share_and_window_limits_positions() {
        let mut a = [1.0f32, 2.0];
        softmax_with_sink(&mut a, 3.0);
        let z = 1f64.exp() + 2f64.exp() + 3f64.exp();
        assert!((f64::from(a[0]) - 1f64.exp() / z).abs() < 1e-7 && (f64::from(a[1]) - 2f64.exp() / z).abs() < 1e-7);
        // a very negative sink is a plain softmax
        let mut b = [1.0f32, 2.0];
        softmax_with_sink(&mut b, -1e30);
        let mut c = [1.0f32, 2.0];
        kernels::softmax_inplace(&mut c);
        assert_eq!(b, c);
        assert_eq!(Attention::first_visible(3, Some(8)), 0);
        assert_eq!(Attention::first_visible(8, Some(8)), 1);
        assert_eq!(Attention::first_visible(27, Some(8)), 20);
        assert_eq!(Attention::first_visible(27, None), 0);
    }
}
