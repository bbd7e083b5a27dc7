//! The routed experts of a converted directory served straight from its safetensors tensors
//! ([`SafetensorsExperts`]): always correct, never fast, the fallback of every other store
//! ([`crate::expert::store::open_store`]) and the store of `--store safetensors`.

use std::sync::Arc;

use picchio_core::{AlignedBuf, ExpertKey, ExpertLoader, LoadError, Loaded};

use crate::expert::layout::ExpertLayout;
use crate::model::safetensors::TensorStore;

/// Serves experts from a converted directory's safetensors tensors (memory-mapped, copied into the
/// slot). Always correct, never fast: the fallback for every other store.
pub struct SafetensorsExperts {
    store: Arc<TensorStore>,
    layout: ExpertLayout,
}

impl SafetensorsExperts {
    /// Serves `store`'s experts with `layout`.
    pub fn new(store: Arc<TensorStore>, layout: ExpertLayout) -> Self {
        SafetensorsExperts { store, layout }
    }
}

impl ExpertLoader for SafetensorsExperts {
    fn describe(&self) -> String {
        format!("safetensors:{}", self.store.dir().display())
    }

    fn load(&mut self, layer: u32, requests: Vec<(u32, AlignedBuf)>, ready: &mut dyn FnMut(Loaded)) {
        for (expert, mut buf) in requests {
            let key = ExpertKey { layer, expert };
            let result = if buf.len() < self.layout.len() {
                Err(LoadError::SlotTooSmall {
                    source_name: self.describe(),
                    key,
                    slot: buf.len(),
                    need: self.layout.len(),
                })
            } else {
                self.layout
                    .payload_from_store(&self.store, layer as usize, expert as usize, buf.as_mut_slice())
                    .map_err(|e| LoadError::Other(format!("{key}: {}", picchio_core::error::chain(&e))))
            };
            ready(Loaded { key, buf, result });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Config;

    #[test]
    fn serves_the_directory_payload_and_refuses_a_short_slot() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/picchio_c/qwen3_moe");
        let store = Arc::new(TensorStore::open(&dir).unwrap());
        let layout = ExpertLayout::detect(&store, &Config::from_dir(&dir).unwrap()).unwrap();
        let mut want = AlignedBuf::new(layout.len(), 4096).unwrap();
        layout.payload_from_store(&store, 2, 15, want.as_mut_slice()).unwrap();
        let mut l = SafetensorsExperts::new(store, layout.clone());
        assert!(l.describe().starts_with("safetensors:") && l.describe().contains("qwen3_moe"), "{}", l.describe());
        let mut got = Vec::new();
        let reqs = vec![(15, AlignedBuf::new(layout.len(), 4096).unwrap()), (14, AlignedBuf::new(512, 512).unwrap())];
        l.load(2, reqs, &mut |x| got.push(x));
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].key, ExpertKey { layer: 2, expert: 15 });
        assert!(got[0].result.is_ok() && got[0].buf.as_slice()[..layout.len()] == want.as_slice()[..layout.len()]);
        assert!(matches!(got[1].result, Err(LoadError::SlotTooSmall { slot: 512, .. })), "{:?}", got[1].result);
    }
}
