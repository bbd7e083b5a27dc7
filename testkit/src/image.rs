//! Seeded `.picchioflat` images for the tests of every crate that reads one.

use std::path::Path;

use picchio_core::loader::StoreDims;
use picchio_core::rng::SplitMix64;
use picchio_core::{AlignedBuf, ExpertLoader, FlatWriter};

/// Writes a `.picchioflat` image at `path` for `dims` whose expert `i` (layer-major, `n_layers ×
/// n_experts` of them) is `payload_len(i)` bytes of [`SplitMix64`] seeded with `seed`, drawn in
/// expert order; returns the payloads in that order.
///
/// # Panics
/// When the image cannot be written (this is a test helper).
pub fn write_image(path: &Path, dims: StoreDims, seed: u64, payload_len: impl Fn(usize) -> usize) -> Vec<Vec<u8>> {
    let n = (dims.n_layers * dims.n_experts) as usize;
    let mut rng = SplitMix64::new(seed);
    let payloads: Vec<Vec<u8>> = (0..n).map(|i| rng.bytes(payload_len(i))).collect();
    FlatWriter::write(path, dims, &payloads).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    payloads
}

/// Loads every expert of every layer of `dims` from `store`, one layer at a time into buffers of
/// `slot` bytes (4 KiB-aligned), and checks each against `payloads` (as [`write_image`] returns them).
///
/// # Panics
/// On a failed load, a byte that differs, or a layer that does not complete every expert once.
pub fn check_every_expert(store: &mut dyn ExpertLoader, dims: StoreDims, payloads: &[Vec<u8>], slot: usize) {
    for layer in 0..dims.n_layers {
        let reqs = (0..dims.n_experts).map(|e| (e, AlignedBuf::new(slot, 4096).unwrap())).collect();
        let mut n = 0;
        store.load(layer, reqs, &mut |l| {
            n += 1;
            l.result.unwrap_or_else(|e| panic!("{e}"));
            let p = &payloads[(l.key.layer * dims.n_experts + l.key.expert) as usize];
            assert!(l.buf.as_slice()[..p.len()] == p[..], "{}", l.key);
        });
        assert_eq!(n, dims.n_experts, "layer {layer}: one completion per expert");
    }
}
