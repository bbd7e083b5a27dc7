//! The converted directory's safetensors shards: which tensors go in which file, the header of each
//! file, and `model.safetensors.index.json`.
//!
//! Units (a dense tensor, or one expert's four tensors) fill `model-0000i-of-0000N.safetensors` in
//! model order until the next unit would pass the size bound. Inside a file the experts come first,
//! in (layer, expert) order with each expert's tensors adjacent in payload order (gate_up, gate_up.qs,
//! down, down.qs: the file holds each payload contiguously), then the dense tensors by descending
//! element size and name. Every expert tensor is a multiple of 4 bytes, so every tensor starts at an
//! offset aligned to its element size, as `safetensors::serialize` would place it.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use super::plan::Unit;
use crate::error::{Error, Result};
use crate::expert::layout::ExpertLayout;
use crate::model::safetensors::TensorStore;
use crate::quant::QuantKind;

/// One tensor of a converted file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct OutTensor {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Bytes.
    pub len: usize,
}

/// The tensors of one converted expert, in payload order (flat 1-D, as Picchio (C) writes them).
pub(crate) fn expert_tensors(layout: &ExpertLayout, layer: usize, expert: usize) -> Vec<OutTensor> {
    let n = layout.names(layer, expert);
    let packed = if layout.quant == QuantKind::F32 { Dtype::F32 } else { Dtype::U8 };
    let width = |d: Dtype| d.bitsize() / 8;
    [
        (n.gate_up, packed, layout.gate_up.len()),
        (n.gate_up_qs, Dtype::F32, layout.gate_up_scales.len()),
        (n.down, packed, layout.down.len()),
        (n.down_qs, Dtype::F32, layout.down_scales.len()),
    ]
    .into_iter()
    .filter(|(_, _, len)| *len > 0)
    .map(|(name, dtype, len)| OutTensor { name, dtype, shape: vec![len / width(dtype)], len })
    .collect()
}

/// One output file.
#[derive(Debug, Default)]
pub(crate) struct Shard {
    /// Experts, in (layer, expert) order.
    pub experts: Vec<(usize, usize)>,
    /// Dense tensors (source names), by descending element size then name.
    pub dense: Vec<String>,
    /// Tensors in file order.
    pub tensors: Vec<OutTensor>,
    /// Data bytes (without the header).
    pub bytes: u64,
}

/// Assigns `units` to shards of at most `max_bytes` data bytes each (a unit larger than that gets a
/// shard of its own) and orders each shard's tensors.
pub(crate) fn assign(units: &[Unit], store: &TensorStore, layout: &ExpertLayout, max_bytes: u64) -> Result<Vec<Shard>> {
    let mut shards: Vec<Shard> = Vec::new();
    let mut cur = Shard::default();
    for u in units {
        let size = match u {
            Unit::Dense(name) => store.get(name)?.bytes.len() as u64,
            Unit::Expert { .. } => layout.len() as u64,
        };
        if cur.bytes > 0 && cur.bytes + size > max_bytes {
            shards.push(std::mem::take(&mut cur));
        }
        cur.bytes += size;
        match u {
            Unit::Dense(name) => cur.dense.push(name.clone()),
            Unit::Expert { layer, expert } => cur.experts.push((*layer, *expert)),
        }
    }
    if cur.bytes > 0 || shards.is_empty() {
        shards.push(cur);
    }
    for s in &mut shards {
        let mut dense = Vec::with_capacity(s.dense.len());
        for name in &s.dense {
            let t = store.get(name)?;
            dense.push(OutTensor { name: name.clone(), dtype: t.dtype, shape: t.shape.to_vec(), len: t.bytes.len() });
        }
        dense.sort_by(|a, b| b.dtype.bitsize().cmp(&a.dtype.bitsize()).then_with(|| a.name.cmp(&b.name)));
        s.dense = dense.iter().map(|t| t.name.clone()).collect();
        s.tensors = s.experts.iter().flat_map(|&(l, e)| expert_tensors(layout, l, e)).chain(dense).collect();
    }
    Ok(shards)
}

/// The file name of shard `i` (0-based) of `n`: `model-0000{i+1}-of-0000{n}.safetensors`.
pub(crate) fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
}

/// The bytes before the tensor data: u64 header length, then the JSON header padded with spaces to
/// a multiple of 8 (as the safetensors crate writes it), with `__metadata__ = {"format": "pt"}`.
pub(crate) fn header(tensors: &[OutTensor], path: &Path) -> Result<Vec<u8>> {
    let mut offset = 0;
    let infos = tensors
        .iter()
        .map(|t| {
            let info = TensorInfo { dtype: t.dtype, shape: t.shape.clone(), data_offsets: (offset, offset + t.len) };
            offset += t.len;
            (t.name.clone(), info)
        })
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bad = |cause| Error::Safetensors { path: path.into(), cause };
    let metadata = Metadata::new(Some(meta), infos).map_err(bad)?;
    let mut json = serde_json::to_vec(&metadata).map_err(|e| bad(e.into()))?;
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

/// `model.safetensors.index.json`: `metadata.total_size` (data bytes of all shards) and the
/// `weight_map`, keys sorted.
pub(crate) fn index_json(shards: &[Shard]) -> String {
    let mut map = BTreeMap::new();
    let n = shards.len();
    for (i, s) in shards.iter().enumerate() {
        for t in &s.tensors {
            map.insert(t.name.as_str(), shard_name(i, n));
        }
    }
    let total: u64 = shards.iter().map(|s| s.bytes).sum();
    let v = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": map });
    serde_json::to_string_pretty(&v).expect("a JSON value serializes") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_parses_and_is_padded() {
        let layout = ExpertLayout::new(QuantKind::Q4, 64, 64).unwrap();
        let mut tensors = expert_tensors(&layout, 0, 3);
        tensors.push(OutTensor { name: "model.norm.weight".into(), dtype: Dtype::BF16, shape: vec![64], len: 128 });
        let h = header(&tensors, Path::new("x")).unwrap();
        assert_eq!((h.len() - 8) % 8, 0);
        let data_len = layout.len() + 128;
        let mut file = h.clone();
        file.resize(h.len() + data_len, 0);
        let st = safetensors::SafeTensors::deserialize(&file).unwrap();
        let t = st.tensor("model.layers.0.mlp.experts.3.gate_up_proj").unwrap();
        assert_eq!((t.dtype(), t.shape()), (Dtype::U8, &[4096][..]));
        let t = st.tensor("model.layers.0.mlp.experts.3.down_proj.qs").unwrap();
        assert_eq!((t.dtype(), t.shape()), (Dtype::F32, &[64][..]));
        // payload order inside the file
        let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
        let want: Vec<String> = ["gate_up_proj", "gate_up_proj.qs", "down_proj", "down_proj.qs"]
            .iter()
            .map(|s| format!("model.layers.0.mlp.experts.3.{s}"))
            .collect();
        assert_eq!(names[..4], want.iter().map(String::as_str).collect::<Vec<_>>()[..]);
    }

    #[test]
    fn none_has_no_scales() {
        let layout = ExpertLayout::new(QuantKind::F32, 64, 32).unwrap();
        let t = expert_tensors(&layout, 1, 0);
        assert_eq!(t.len(), 2);
        assert_eq!((t[0].dtype, t[0].shape.clone()), (Dtype::F32, vec![2 * 32 * 64]));
        assert_eq!(t[1].shape, vec![64 * 32]);
    }

    #[test]
    fn shard_names() {
        assert_eq!(shard_name(0, 3), "model-00001-of-00003.safetensors");
    }
}
