//! One routed expert, from checkpoint weights to its payload: gate and up fused with interleaved rows,
//! then both matrices quantized (DESIGN.md, "Converted model directory and expert quantization").

use safetensors::Dtype;

use super::plan::{fused_down, fused_gate_up, per_expert, ExpertSource};
use crate::error::{Error, Result};
use crate::expert::layout::ExpertLayout;
use crate::model::safetensors::{TensorRef, TensorStore};
use crate::quant::quantize;

/// Quantizes one expert into its payload (the bytes of its four converted tensors, in payload
/// order): gate_up packed, gate_up scales, down packed, down scales; for [`crate::quant::QuantKind::F32`] the two
/// matrices as little-endian f32 without scales.
///
/// `gate` and `up` are `[I, H]` and `down` is `[H, I]`, row-major in `nn.Linear` layout, with
/// `H = layout.hidden` and `I = layout.inter`. gate_up is `[2I, H]` with row `2i` = gate row `i` and
/// row `2i + 1` = up row `i`.
///
/// # Errors
/// [`Error::ExpertMatrixLen`] when a matrix length does not match the layout; [`Error::Quant`] when the
/// layout's widths are not whole 64-wide groups for Q4/Q3.
pub fn expert_payload(layout: &ExpertLayout, gate: &[f32], up: &[f32], down: &[f32]) -> Result<Vec<u8>> {
    let (h, i) = (layout.hidden, layout.inter);
    for (what, len, want) in [("gate", gate.len(), i * h), ("up", up.len(), i * h), ("down", down.len(), h * i)] {
        if len != want {
            return Err(Error::ExpertMatrixLen { what, len, want });
        }
    }
    let mut gate_up = Vec::with_capacity(2 * i * h);
    for (g, u) in gate.chunks_exact(h).zip(up.chunks_exact(h)) {
        gate_up.extend_from_slice(g);
        gate_up.extend_from_slice(u);
    }
    let q = |w: &[f32], rows, cols| quantize(layout.quant, w, rows, cols).map_err(Error::from);
    let (gu_packed, gu_scales) = q(&gate_up, 2 * i, h)?;
    let (d_packed, d_scales) = q(down, h, i)?;
    let mut out = Vec::with_capacity(layout.len());
    out.extend_from_slice(&gu_packed);
    out.extend(gu_scales.iter().flat_map(|s| s.to_le_bytes()));
    out.extend_from_slice(&d_packed);
    out.extend(d_scales.iter().flat_map(|s| s.to_le_bytes()));
    debug_assert_eq!(out.len(), layout.len());
    Ok(out)
}

/// Widens `bytes` (a whole tensor or a slice of one) of `t`'s dtype to f32, refusing non-finite values.
pub(crate) fn widen(t: &TensorRef<'_>, bytes: &[u8], what: &str) -> Result<Vec<f32>> {
    let v: Vec<f32> = match t.dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        _ => return Err(t.dtype_error("F32, BF16 or F16")),
    };
    if let Some(k) = v.iter().position(|x| !x.is_finite()) {
        return Err(Error::NonFiniteWeight {
            path: t.path.into(),
            name: t.name.into(),
            part: what.into(),
            index: k,
            value: v[k],
        });
    }
    Ok(v)
}

/// Reads expert `(layer, expert)`'s gate `[I,H]`, up `[I,H]` and down `[H,I]` as f32 from the checkpoint.
pub(crate) fn read_expert(
    store: &TensorStore,
    source: ExpertSource,
    layout: &ExpertLayout,
    layer: usize,
    expert: usize,
    experts_per_layer: usize,
) -> Result<[Vec<f32>; 3]> {
    match source {
        ExpertSource::Mxfp4 | ExpertSource::FusedTransposed => {
            super::gpt_oss::read_expert(store, source, layout, layer, expert, experts_per_layer)
        }
        ExpertSource::PerExpert => {
            let [g, u, d] = per_expert(layer, expert);
            let read = |name: &str| -> Result<Vec<f32>> {
                let t = store.get(name)?;
                widen(&t, t.bytes, "")
            };
            Ok([read(&g)?, read(&u)?, read(&d)?])
        }
        ExpertSource::Fused => {
            let (h, i) = (layout.hidden, layout.inter);
            let gu = store.get(&fused_gate_up(layer))?;
            let d = store.get(&fused_down(layer))?;
            let what = format!(" [{expert}]");
            fn slice<'a>(t: &TensorRef<'a>, expert: usize, per: usize) -> &'a [u8] {
                let eb = t.dtype.bitsize() / 8;
                &t.bytes[expert * per * eb..(expert + 1) * per * eb]
            }
            let mut gate = widen(&gu, slice(&gu, expert, 2 * i * h), &what)?;
            let up = gate.split_off(i * h);
            let down = widen(&d, slice(&d, expert, h * i), &what)?;
            Ok([gate, up, down])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize, QuantKind};

    #[test]
    fn gate_up_rows_interleave() {
        // H = 64, I = 64: gate rows hold 1.0 * (row + 1), up rows hold -(row + 1); F32 keeps them exact.
        let (h, i) = (64, 64);
        let layout = ExpertLayout::new(QuantKind::F32, h, i).unwrap();
        let gate: Vec<f32> = (0..i * h).map(|k| (k / h + 1) as f32).collect();
        let up: Vec<f32> = gate.iter().map(|v| -v).collect();
        let down = vec![0.5f32; h * i];
        let p = expert_payload(&layout, &gate, &up, &down).unwrap();
        assert_eq!(p.len(), layout.len());
        let gu = dequantize(QuantKind::F32, &p[layout.gate_up.clone()], &[], 2 * i, h).unwrap();
        for r in 0..2 * i {
            let want = if r % 2 == 0 { (r / 2 + 1) as f32 } else { -((r / 2 + 1) as f32) };
            assert!(gu[r * h..(r + 1) * h].iter().all(|&v| v == want), "row {r}");
        }
        assert!(p[layout.down.clone()].chunks(4).all(|c| c == 0.5f32.to_le_bytes()));
    }

    #[test]
    fn q4_payload_parts_are_in_layout_order() {
        let (h, i) = (128, 64);
        let layout = ExpertLayout::new(QuantKind::Q4, h, i).unwrap();
        let gate: Vec<f32> = (0..i * h).map(|k| ((k * 7919) % 113) as f32 / 50.0 - 1.0).collect();
        let up: Vec<f32> = gate.iter().rev().copied().collect();
        let down: Vec<f32> = gate.iter().map(|v| v * 0.5).collect();
        let p = expert_payload(&layout, &gate, &up, &down).unwrap();
        let (dp, ds) = crate::quant::quantize_q4(&down, h, i);
        assert_eq!(&p[layout.down.clone()], &dp[..]);
        let ds: Vec<u8> = ds.iter().flat_map(|s| s.to_le_bytes()).collect();
        assert_eq!(&p[layout.down_scales.clone()], &ds[..]);
        let e = expert_payload(&layout, &gate[1..], &up, &down).unwrap_err().to_string();
        assert!(e.contains("gate matrix has 8191 weights"), "{e}");
    }
}
