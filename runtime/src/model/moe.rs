//! Mixture-of-Experts pieces shared by the architectures: the routers (Qwen3-MoE: softmax, top-k,
//! optional renormalisation; GPT-OSS: top-k on the logits, softmax over the k), the canonical expert
//! order, the expert computed from a payload slot (SiLU SwiGLU, or GPT-OSS's clamped SwiGLU with
//! resident biases), and the combination of expert outputs in canonical order.
//!
//! Routing follows transformers 5.24 `Qwen3MoeTopKRouter` (tests/fixtures/README.md, "routing"):
//! softmax over all E router logits in f32, top-k, then (when `norm_topk_prob`) division by the sum of
//! the k picked probabilities; and `GptOssTopKRouter`: `torch.topk` of the logits (bias included),
//! then softmax over those k values. The **canonical order** of the picked experts is descending weight, ties
//! by ascending expert id; expert outputs are summed in that order whatever order their loads complete
//! in (DESIGN.md, "Determinism").

use crate::error::{Error, Result};
use crate::expert::layout::ExpertLayout;
use crate::kernels::{self, Kernels, MatRef};
use crate::quant::QuantKind;
use picchio_core::format::gguf::GgmlType;

/// The routing of one token in one MoE layer, in canonical order; buffers allocated once.
#[derive(Clone, Debug)]
pub struct Routing {
    /// Picked expert ids `[k]`, canonical order (descending weight, ties by id).
    pub experts: Vec<u32>,
    /// Routing weight of each picked expert `[k]` (the softmax probability, renormalised over the k
    /// when `norm_topk_prob`).
    pub weights: Vec<f32>,
    /// Softmax probabilities over all experts `[E]` (scratch, valid after [`Routing::route`]).
    pub probs: Vec<f32>,
}

impl Routing {
    /// Buffers for `n_experts` experts and top-`k` (`1 <= k <= n_experts`).
    pub fn new(n_experts: usize, k: usize) -> Self {
        assert!(k >= 1 && k <= n_experts, "top-{k} of {n_experts} experts");
        Routing { experts: vec![0; k], weights: vec![0.0; k], probs: vec![0.0; n_experts] }
    }

    /// Number of picked experts k.
    pub fn k(&self) -> usize {
        self.experts.len()
    }

    /// Routes one token from its router logits `[E]` (pre-softmax, f32): softmax over all E, the k
    /// largest probabilities in canonical order, divided by their f32 sum when `norm_topk_prob`.
    /// A NaN probability ranks below every number.
    ///
    /// # Panics
    /// When `logits.len()` differs from the E given to [`Routing::new`].
    pub fn route(&mut self, logits: &[f32], norm_topk_prob: bool) {
        assert_eq!(logits.len(), self.probs.len(), "router logits: one per expert");
        self.probs.copy_from_slice(logits);
        kernels::softmax_inplace(&mut self.probs);
        self.pick_topk();
        if norm_topk_prob {
            let sum: f32 = self.weights.iter().sum();
            for w in &mut self.weights {
                *w /= sum;
            }
        }
    }

    /// Routes one token as GPT-OSS does: the k largest logits `[E]` in canonical order (descending,
    /// ties by id; a NaN ranks below every number), then softmax over those k values (f32).
    /// [`Routing::probs`] holds the logits afterwards.
    ///
    /// # Panics
    /// When `logits.len()` differs from the E given to [`Routing::new`].
    pub fn route_topk_softmax(&mut self, logits: &[f32]) {
        assert_eq!(logits.len(), self.probs.len(), "router logits: one per expert");
        self.probs.copy_from_slice(logits);
        self.pick_topk();
        kernels::softmax_inplace(&mut self.weights);
    }

    /// The k largest of `probs` into `experts` / `weights`, canonical order.
    fn pick_topk(&mut self) {
        let k = self.experts.len();
        // Insertion into a sorted top-k: O(E k), no allocation.
        let mut n = 0;
        for (e, &p) in self.probs.iter().enumerate() {
            let p = if p.is_nan() { f32::NEG_INFINITY } else { p };
            // Strictly greater: an equal weight keeps the lower id (seen first) ahead.
            let pos = self.weights[..n].iter().position(|&w| p > w).unwrap_or(n);
            if pos >= k {
                continue;
            }
            let end = n.min(k - 1);
            self.experts.copy_within(pos..end, pos + 1);
            self.weights.copy_within(pos..end, pos + 1);
            self.experts[pos] = e as u32;
            self.weights[pos] = p;
            n = (n + 1).min(k);
        }
    }
}

/// The activation between an expert's gate_up and down projections.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertAct {
    /// Qwen3-MoE: `silu(gate) * up`.
    Silu,
    /// GPT-OSS (`GptOssExperts`): `gate = min(gate, limit)`, `up = clamp(up, -limit, limit)`,
    /// `(up + 1) * gate * sigmoid(alpha * gate)`.
    ClampedSwiglu {
        /// `swiglu_limit` (7 in gpt-oss).
        limit: f32,
        /// The sigmoid's slope (1.702 in gpt-oss).
        alpha: f32,
    },
}

impl ExpertAct {
    /// GPT-OSS's slope α of the gated sigmoid.
    pub const GPT_OSS_ALPHA: f32 = 1.702;
}

/// The resident biases of one expert (GPT-OSS `experts.gate_up_proj_bias[e]` and `down_proj_bias[e]`).
#[derive(Clone, Copy, Debug)]
pub struct ExpertBias<'a> {
    /// Added to gate_up(x) `[2I]`, interleaved like its rows.
    pub gate_up: &'a [f32],
    /// Added to down(h) `[H]`.
    pub down: &'a [f32],
}

/// `out[i] = act(gate_up[2i], gate_up[2i + 1])` for an interleaved gate_up `[2I]` → `out [I]`.
pub(crate) fn activate(act: ExpertAct, gate_up: &[f32], out: &mut [f32]) {
    match act {
        ExpertAct::Silu => kernels::silu_mul_interleaved(gate_up, out),
        ExpertAct::ClampedSwiglu { limit, alpha } => {
            assert_eq!(gate_up.len(), 2 * out.len(), "clamped SwiGLU: gate_up must hold 2 values per output");
            for (o, gu) in out.iter_mut().zip(gate_up.chunks_exact(2)) {
                let gate = gu[0].min(limit);
                let up = gu[1].clamp(-limit, limit);
                let glu = gate * (1.0 / (1.0 + (-(gate * alpha)).exp()));
                *o = (up + 1.0) * glu;
            }
        }
    }
}

/// Receives every routing decision a [`crate::model::Model`] makes (`Model::set_routing_observer`):
/// one call per MoE layer per token, right after the router and before any expert is fetched, in
/// the order the runtime makes them: position by position, layer by layer for
/// [`Model::forward`](crate::model::Model::forward) (and a prefill chunk of 1); for a chunked
/// [`Model::prefill`](crate::model::Model::prefill), chunk by chunk, and within a chunk layer by
/// layer, each layer's tokens in position order (every token's decision is reported once either
/// way). The observer only reads the decision: the forward pass, and so the tokens, are the same
/// with or without one.
///
/// `picchio run --trace PATH` installs [`crate::model::trace::TraceWriter`], which writes the
/// decisions to a `picchio-trace/1` file (docs/experiments.md, "trace").
pub trait RoutingObserver: Send {
    /// Decoder layer `layer` routed the token at position `pos` (0-based, the prompt included) to
    /// `experts` `[k]` (canonical order: descending weight, ties by id) with routing `weights` `[k]`
    /// (renormalised over the k when `norm_topk_prob`).
    fn routed(&mut self, layer: usize, pos: usize, experts: &[u32], weights: &[f32]);

    /// Called once when the observer is taken off the model with `Model::take_routing_observer`
    /// by its owner: flushes whatever it buffers. [`RoutingObserver::routed`] cannot fail (the
    /// forward pass does not stop for an observer), so an observer keeps its first error for here.
    ///
    /// # Errors
    /// The observer's first I/O error (writing a trace file), naming the file.
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

/// An expert's gate and up projections: one interleaved `[2I, H]` matrix (the `.picchioflat`
/// payload: row 2i = gate row i, row 2i+1 = up row i) or two `[I, H]` matrices (a GGUF's slabs).
/// [`GateUp::apply`] and [`GateUp::project`] give the interleaved `[2I]` output either way.
#[derive(Clone, Copy, Debug)]
pub enum GateUp<'a> {
    /// `gate_up [2I, H]`, rows interleaved.
    Interleaved(MatRef<'a>),
    /// `gate [I, H]` and `up [I, H]`.
    Split {
        /// The gate projection.
        gate: MatRef<'a>,
        /// The up projection.
        up: MatRef<'a>,
    },
}

impl GateUp<'_> {
    /// `out [2I]` = gate_up(x), interleaved (`out[2i]` gate row i, `out[2i + 1]` up row i); `h [I]`
    /// is scratch for the split form. Rows split across rayon as [`Kernels::matvec_par`].
    pub fn apply(&self, k: Kernels, x: &[f32], out: &mut [f32], h: &mut [f32]) {
        match *self {
            GateUp::Interleaved(w) => k.matvec_par(w, x, out),
            GateUp::Split { gate, up } => {
                let i = out.len() / 2;
                k.matvec_par(gate, x, &mut out[i..]);
                k.matvec_par(up, x, &mut h[..i]);
                // In place, front to back: step j reads out[i + j] before writing out[2j] and
                // out[2j + 1], neither of which is a gate value still to be read.
                for j in 0..i {
                    out[2 * j] = out[i + j];
                    out[2 * j + 1] = h[j];
                }
            }
        }
    }

    /// `out [n, 2I]` = gate_up of each of the `n` inputs `xs [n, H]` (interleaved per row), through
    /// [`crate::model::prefill::project`]'s matmul; `yt` is its transposed scratch (at least
    /// `2I * n`). Each row is bit-identical to [`GateUp::apply`] of that input.
    pub fn project(&self, k: Kernels, xs: &[f32], n: usize, yt: &mut [f32], out: &mut [f32]) {
        match *self {
            GateUp::Interleaved(w) => super::prefill::project(k, w, xs, n, yt, out),
            GateUp::Split { gate, up } => {
                let i = out.len() / n / 2;
                for (half, w) in [gate, up].into_iter().enumerate() {
                    let yt = &mut yt[..i * n];
                    k.matmul_par(w, xs, n, yt);
                    for (t, o) in out.chunks_exact_mut(2 * i).enumerate().take(n) {
                        for (r, pair) in o.chunks_exact_mut(2).enumerate() {
                            pair[half] = yt[r * n + t];
                        }
                    }
                }
            }
        }
    }
}

/// The matrices of one expert of layer `layer`, viewed in its payload bytes per [`ExpertLayout`]:
/// gate/up ([`GateUp`]) and `down [H, I]`.
///
/// # Errors
/// [`Error::PayloadShort`] when `payload` is shorter than the layout, [`Error::PayloadF32`] when an f32
/// part is not 4-byte aligned (cache slots are 4096-aligned and every range starts at a multiple of
/// 4, so this means a bug); [`Error::Invalid`] for a GGUF layout's layer without experts.
pub fn expert_mats<'a>(layout: &ExpertLayout, layer: usize, payload: &'a [u8]) -> Result<(GateUp<'a>, MatRef<'a>)> {
    if payload.len() < layout.len() {
        return Err(Error::PayloadShort { len: payload.len(), quant: layout.quant, need: layout.len() });
    }
    if let Some(g) = &layout.ggml {
        let s = g.slabs(layer).ok_or_else(|| Error::Invalid(format!("layer {layer} of the GGUF has no experts")))?;
        let (a, b) = (s[0].bytes, s[0].bytes + s[1].bytes);
        let view = |ty: GgmlType, r: std::ops::Range<usize>, what: &str| -> Result<MatRef<'a>> {
            let data = &payload[r.clone()];
            let cast = |cause| Error::PayloadF32 { what: what.into(), range: r.clone(), cause };
            Ok(match ty {
                GgmlType::F32 => MatRef::F32(bytemuck::try_cast_slice(data).map_err(cast)?),
                ty => MatRef::Ggml { ty, data },
            })
        };
        let gate = view(s[0].ty, 0..a, "gate")?;
        let up = view(s[1].ty, a..b, "up")?;
        let down = view(s[2].ty, b..b + s[2].bytes, "down")?;
        return Ok((GateUp::Split { gate, up }, down));
    }
    let f32s = |r: &std::ops::Range<usize>, what: &str| -> Result<&'a [f32]> {
        bytemuck::try_cast_slice(&payload[r.clone()]).map_err(|cause| Error::PayloadF32 {
            what: what.into(),
            range: r.clone(),
            cause,
        })
    };
    let mat = |w: &std::ops::Range<usize>, s: &std::ops::Range<usize>, what: &str| -> Result<MatRef<'a>> {
        Ok(match layout.quant {
            QuantKind::F32 => MatRef::F32(f32s(w, what)?),
            QuantKind::Q4 => MatRef::Q4 { packed: &payload[w.clone()], scales: f32s(s, what)? },
            QuantKind::Q3 => MatRef::Q3 { packed: &payload[w.clone()], scales: f32s(s, what)? },
        })
    };
    Ok((
        GateUp::Interleaved(mat(&layout.gate_up, &layout.gate_up_scales, "gate_up")?),
        mat(&layout.down, &layout.down_scales, "down")?,
    ))
}

/// Scratch for [`expert_forward`]: `gate_up [2I]` and `h [I]`, allocated once.
#[derive(Clone, Debug)]
pub struct ExpertScratch {
    /// gate_up(x), interleaved `[2I]`.
    pub gate_up: Vec<f32>,
    /// silu(gate) * up `[I]`.
    pub h: Vec<f32>,
}

impl ExpertScratch {
    /// Scratch for expert width `inter` (I).
    pub fn new(inter: usize) -> Self {
        ExpertScratch { gate_up: vec![0.0; 2 * inter], h: vec![0.0; inter] }
    }
}

/// One routed expert on one token: `out = weight * down(silu(gate(x)) * up(x))`, with the weights read
/// in place from `payload` (Q4/Q3 packed + f32 scales, or f32) per `layout`.
///
/// Shapes: `x [H]`, `out [H]`, scratch for I = `layout.inter`; `layer` picks a GGUF layout's slab
/// types ([`expert_mats`]). The routing weight multiplies the down
/// projection's output, as transformers does (`expert_out * routing_weight`).
///
/// # Errors
/// As [`expert_mats`].
#[allow(clippy::too_many_arguments)]
pub fn expert_forward(
    k: Kernels,
    layout: &ExpertLayout,
    layer: usize,
    payload: &[u8],
    x: &[f32],
    weight: f32,
    scratch: &mut ExpertScratch,
    out: &mut [f32],
) -> Result<()> {
    expert_forward_with(k, layout, layer, payload, x, weight, ExpertAct::Silu, None, scratch, out)
}

/// One routed expert on one token with activation `act` and optional resident `bias`:
/// `out = weight * (down(act(gate_up(x) + b_gu)) + b_down)` (GPT-OSS: the routing weight multiplies
/// the biased output, as `GptOssExperts` does). Shapes as [`expert_forward`].
///
/// # Errors
/// As [`expert_mats`].
#[allow(clippy::too_many_arguments)]
pub fn expert_forward_with(
    k: Kernels,
    layout: &ExpertLayout,
    layer: usize,
    payload: &[u8],
    x: &[f32],
    weight: f32,
    act: ExpertAct,
    bias: Option<ExpertBias<'_>>,
    scratch: &mut ExpertScratch,
    out: &mut [f32],
) -> Result<()> {
    let (gate_up, down) = expert_mats(layout, layer, payload)?;
    // Rows split across rayon for real-size experts; bit-identical for any thread count.
    gate_up.apply(k, x, &mut scratch.gate_up, &mut scratch.h);
    if let Some(b) = bias {
        scratch.gate_up.iter_mut().zip(b.gate_up).for_each(|(v, b)| *v += b);
    }
    activate(act, &scratch.gate_up, &mut scratch.h);
    k.matvec_par(down, &scratch.h, out);
    if let Some(b) = bias {
        out.iter_mut().zip(b.down).for_each(|(v, b)| *v += b);
    }
    for o in out.iter_mut() {
        *o *= weight;
    }
    Ok(())
}

/// Sums the k expert outputs `outs [k, H]` (row j = the expert at canonical position j) into `acc [H]`,
/// which is first set to zero: `acc = ((0 + outs[0]) + outs[1]) + ...`, always in canonical order.
///
/// # Panics
/// When `outs.len()` is not a multiple of `acc.len()`.
pub fn combine_canonical(outs: &[f32], acc: &mut [f32]) {
    let h = acc.len();
    assert!(h > 0 && outs.len().is_multiple_of(h), "combine: outs is not [k, {h}]");
    acc.fill(0.0);
    for row in outs.chunks_exact(h) {
        for (a, &v) in acc.iter_mut().zip(row) {
            *a += v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize, quantize};

    #[test]
    fn route_topk_canonical_and_renormalised() {
        let mut r = Routing::new(6, 3);
        let logits = [0.5f32, 2.0, -1.0, 2.0, 1.0, 0.0];
        r.route(&logits, false);
        // experts 1 and 3 tie: lower id first
        assert_eq!(r.experts, [1, 3, 4]);
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        for (&e, &w) in r.experts.iter().zip(&r.weights) {
            assert!((f64::from(w) - f64::from(logits[e as usize]).exp() / z).abs() < 1e-7);
        }
        r.route(&logits, true);
        assert_eq!(r.experts, [1, 3, 4]);
        assert!((r.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(r.weights[0] == r.weights[1] && r.weights[1] > r.weights[2]);

        // k = E, descending
        let mut r = Routing::new(4, 4);
        r.route(&[0.0, 3.0, 1.0, 2.0], true);
        assert_eq!(r.experts, [1, 3, 2, 0]);
        // NaN ranks last
        let mut r = Routing::new(3, 1);
        r.route(&[f32::NAN, 1.0, 0.0], false);
        assert_eq!(r.experts.len(), 1);
    }

    #[test]
    fn route_topk_then_softmax() {
        let mut r = Routing::new(5, 2);
        let logits = [0.5f32, 2.0, -1.0, 2.0, 3.0];
        r.route_topk_softmax(&logits);
        assert_eq!(r.experts, [4, 1]);
        let z = 3f64.exp() + 2f64.exp();
        assert!((f64::from(r.weights[0]) - 3f64.exp() / z).abs() < 1e-7);
        assert!((r.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        // ties by id
        r.route_topk_softmax(&[1.0, 2.0, 0.0, 2.0, 0.0]);
        assert_eq!(r.experts, [1, 3]);
        assert_eq!(r.weights, [0.5, 0.5]);
    }

    #[test]
    fn clamped_swiglu_values() {
        let act = ExpertAct::ClampedSwiglu { limit: 7.0, alpha: 1.702 };
        let mut out = [0f32; 3];
        activate(act, &[1.0, 2.0, 10.0, -9.0, -3.0, 8.0], &mut out);
        let g = |x: f64| x / (1.0 + (-1.702 * x).exp());
        let want = [g(1.0) * 3.0, g(7.0) * (-7.0 + 1.0), g(-3.0) * 8.0];
        for (o, w) in out.iter().zip(want) {
            assert!((f64::from(*o) - w).abs() < 1e-5 * w.abs().max(1.0), "{o} vs {w}");
        }
    }

    fn dense_reference(gate: &[f32], up: &[f32], down: &[f32], x: &[f32], w: f32, h: usize, i: usize) -> Vec<f64> {
        let mut hid = vec![0f64; i];
        for r in 0..i {
            let g: f64 = (0..h).map(|c| f64::from(gate[r * h + c]) * f64::from(x[c])).sum();
            let u: f64 = (0..h).map(|c| f64::from(up[r * h + c]) * f64::from(x[c])).sum();
            hid[r] = g / (1.0 + (-g).exp()) * u;
        }
        (0..h).map(|r| f64::from(w) * (0..i).map(|c| f64::from(down[r * i + c]) * hid[c]).sum::<f64>()).collect()
    }

    /// Builds a payload for `quant` from gate/up/down [I,H]/[I,H]/[H,I], as `picchio convert` lays it out.
    fn payload(layout: &ExpertLayout, gate: &[f32], up: &[f32], down: &[f32]) -> picchio_core::AlignedBuf {
        let (h, i) = (layout.hidden, layout.inter);
        let mut gu = Vec::with_capacity(2 * i * h);
        for r in 0..i {
            gu.extend_from_slice(&gate[r * h..(r + 1) * h]);
            gu.extend_from_slice(&up[r * h..(r + 1) * h]);
        }
        let (gp, gs) = quantize(layout.quant, &gu, 2 * i, h).unwrap();
        let (dp, ds) = quantize(layout.quant, down, h, i).unwrap();
        let mut buf = picchio_core::AlignedBuf::new(layout.len(), 4096).unwrap();
        let b = buf.as_mut_slice();
        b[layout.gate_up.clone()].copy_from_slice(&gp);
        b[layout.gate_up_scales.clone()].copy_from_slice(bytemuck::cast_slice(&gs));
        b[layout.down.clone()].copy_from_slice(&dp);
        b[layout.down_scales.clone()].copy_from_slice(bytemuck::cast_slice(&ds));
        buf
    }

    #[test]
    fn expert_forward_matches_dense_reference() {
        let (h, i) = (128, 64);
        let mut g = picchio_core::rng::SplitMix64::new(0x2545_f491_4f6c_dd1d);
        let mut rnd = || (g.next_f32() - 0.5) * 0.25;
        let gate: Vec<f32> = (0..i * h).map(|_| rnd()).collect();
        let up: Vec<f32> = (0..i * h).map(|_| rnd()).collect();
        let down: Vec<f32> = (0..h * i).map(|_| rnd()).collect();
        let x: Vec<f32> = (0..h).map(|_| rnd() * 8.0).collect();
        for quant in QuantKind::ALL {
            let layout = ExpertLayout::new(quant, h, i).unwrap();
            let buf = payload(&layout, &gate, &up, &down);
            // the reference runs in f64 on the weights the payload encodes
            let deq = |w: &[f32], rows, cols| {
                let (p, s) = quantize(quant, w, rows, cols).unwrap();
                dequantize(quant, &p, &s, rows, cols).unwrap()
            };
            let want = dense_reference(&deq(&gate, i, h), &deq(&up, i, h), &deq(&down, h, i), &x, 0.3, h, i);
            let mut scratch = ExpertScratch::new(i);
            let mut out = vec![0f32; h];
            expert_forward(Kernels::get(), &layout, 0, buf.as_slice(), &x, 0.3, &mut scratch, &mut out).unwrap();
            let err = out.iter().zip(&want).map(|(a, b)| (f64::from(*a) - b).abs()).fold(0.0, f64::max);
            let scale = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
            assert!(err <= 1e-5 * scale, "{quant}: max error {err} (output scale {scale})");
        }
        let layout = ExpertLayout::new(QuantKind::Q4, h, i).unwrap();
        let e = expert_mats(&layout, 0, &[0u8; 16]).unwrap_err().to_string();
        assert!(e.contains("shorter"), "{e}");
    }

    #[test]
    fn combine_is_in_canonical_order() {
        let outs = [1e8f32, 1.0, -1e8, 1.0];
        let mut acc = [5.0f32];
        combine_canonical(&outs, &mut acc);
        // ((0 + 1e8) + 1) + -1e8 + 1 in f32 = 1: the fixed order decides the rounding
        assert_eq!(acc, [((1e8f32 + 1.0) - 1e8) + 1.0]);
    }
}
