//! The `.picchioflat` superblock + index parser as the runtime reads an image: `FlatStore::open`
//! (superblock, index hash, per-entry checks, with and without the model's expectations), a load of
//! every entry it accepted (with `--verify` hashing), and `picchio verify`'s own reader
//! (`verify_queue`), and the model record in the superblock's reserved bytes (`ModelRecord::decode`,
//! which the superblock itself reads leniently). Input: the image bytes. Every outcome must be `Ok`
//! or a clear error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use picchio_core::loader::{FlatStore, FlatStoreOptions, StoreDims, StoreExpect};
use picchio_core::{AlignedBuf, ExpertLoader};
use picchio_fuzz::mem_queue;

fuzz_target!(|image: &[u8]| {
    let image_len = image.len() as u64;
    let _ = picchio_core::format::ModelRecord::decode(image, "fuzz.picchioflat");
    // Without and with a model's expectations (the superblock of the fixture: 64/3/16/4/128).
    let expects = [
        None,
        Some(StoreExpect {
            dims: StoreDims { hidden: 64, n_layers: 3, n_experts: 16, topk: 4, moe_inter: 128 },
            payload_len: 6912,
        }),
    ];
    for expect in expects {
        let opts = FlatStoreOptions { base_offset: 0, image_len, verify: true, expect, recheck_every: 0 };
        let Ok(mut store) = FlatStore::open(mem_queue(image), "fuzz.picchioflat", opts) else { continue };
        let sb = store.superblock().clone();
        // Each layer that has entries, every expert of it (as the runtime requests a layer's top-k).
        let n_layers = sb.n_entries.div_ceil(sb.n_experts);
        for layer in 0..n_layers {
            let first = layer * sb.n_experts;
            let experts = sb.n_experts.min(sb.n_entries - first);
            let mut requests = Vec::new();
            for expert in 0..experts {
                let key = picchio_core::ExpertKey { layer, expert };
                let len = store.entry(key).map_or(4096, |loc| loc.padded_len as usize);
                requests.push((expert, AlignedBuf::new(len, 4096).expect("bounded by the image")));
            }
            store.load(layer, requests, &mut |_loaded| {});
        }
    }
    let opts = picchio_runtime::image::verify::VerifyOptions { io_threads: 1, direct: false, progress: false };
    let _ = picchio_runtime::image::verify::verify_queue(
        &mut mem_queue(image),
        "fuzz.picchioflat",
        0,
        image_len,
        None,
        &opts,
    );
});
