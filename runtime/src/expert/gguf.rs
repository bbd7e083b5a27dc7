//! The routed experts of a GGUF served from the GGUF itself ([`GgufInPlace`]): each expert's gate,
//! up and down slabs copied from the memory-mapped stacked tensors (`blk.N.ffn_{gate,up,down}_exps`)
//! into the cache slot, one after another ([`crate::expert::layout::ExpertLayout::gguf`]). Always
//! correct, the store of a bare `.gguf` and the fallback of a bundle built from it.

use std::sync::Arc;

use picchio_core::{AlignedBuf, ExpertKey, ExpertLoader, LoadError, Loaded};

use crate::expert::layout::ExpertLayout;
use crate::model::gguf::GgufWeights;

/// Serves a GGUF model's experts from its own file (memory-mapped, copied into the slot; the
/// copied pages are then dropped from the resident set, so serving experts never holds more of
/// the file than the expert being copied).
pub struct GgufInPlace {
    weights: Arc<GgufWeights>,
    layout: ExpertLayout,
}

impl GgufInPlace {
    /// Serves `weights`' experts with `layout` (an [`ExpertLayout::gguf`] layout).
    pub fn new(weights: Arc<GgufWeights>, layout: ExpertLayout) -> Self {
        GgufInPlace { weights, layout }
    }

    fn load_one(&self, key: ExpertKey, buf: &mut AlignedBuf) -> Result<(), LoadError> {
        let need = self.layout.len();
        if buf.len() < need {
            return Err(LoadError::SlotTooSmall { source_name: self.describe(), key, slot: buf.len(), need });
        }
        let (layer, expert) = (key.layer as usize, key.expert as usize);
        let slabs = self.layout.ggml.as_ref().and_then(|g| g.slabs(layer)).ok_or_else(|| {
            LoadError::Other(format!("{key}: layer {layer} of {} has no routed experts", self.describe()))
        })?;
        self.weights
            .expert_payload(layer, expert, slabs, buf.as_mut_slice())
            .map_err(|e| LoadError::Other(format!("{key}: {}", picchio_core::error::chain(&e))))?;
        self.weights.release_expert(layer, expert, slabs);
        Ok(())
    }
}

impl ExpertLoader for GgufInPlace {
    fn describe(&self) -> String {
        format!("gguf:{}", self.weights.path().display())
    }

    fn load(&mut self, layer: u32, requests: Vec<(u32, AlignedBuf)>, ready: &mut dyn FnMut(Loaded)) {
        for (expert, mut buf) in requests {
            let key = ExpertKey { layer, expert };
            let result = self.load_one(key, &mut buf);
            ready(Loaded { key, buf, result });
        }
    }
}
