//! `model.safetensors.index.json` as the runtime follows it: the input is the index file of a scratch
//! model directory that also holds two small valid shards (`model-00001-of-00002.safetensors` with
//! tensors `a`, `b`, `shared`; `model-00002-of-00002.safetensors` with `c`, `shared`), opened with
//! `TensorStore::open` and every indexed tensor viewed. A weight_map may name files that are
//! missing, directories, paths, the same tensor in both shards, tensors no shard has: every outcome
//! must be `Ok` or a clear error.
#![no_main]

use std::sync::Once;

use libfuzzer_sys::fuzz_target;
use picchio_runtime::model::safetensors::TensorStore;

/// A safetensors file of F32 tensors of the given names and lengths (elements), zero-filled.
fn shard(tensors: &[(&str, usize)]) -> Vec<u8> {
    let mut header = String::from("{");
    let mut at = 0;
    for (i, (name, n)) in tensors.iter().enumerate() {
        if i > 0 {
            header.push(',');
        }
        header += &format!(r#""{name}":{{"dtype":"F32","shape":[{n}],"data_offsets":[{at},{}]}}"#, at + 4 * n);
        at += 4 * n;
    }
    header.push('}');
    let mut f = (header.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(header.as_bytes());
    f.resize(f.len() + at, 0);
    f
}

fuzz_target!(|index: &[u8]| {
    let dir = picchio_fuzz::scratch_dir().join("sharded");
    static SHARDS: Once = Once::new();
    SHARDS.call_once(|| {
        std::fs::create_dir_all(dir.join("subdir")).expect("scratch");
        picchio_fuzz::put(&dir, "model-00001-of-00002.safetensors", &shard(&[("a", 4), ("b", 2), ("shared", 1)]));
        picchio_fuzz::put(&dir, "model-00002-of-00002.safetensors", &shard(&[("c", 3), ("shared", 1)]));
        picchio_fuzz::put(&dir, "config.json", b"{}");
    });
    picchio_fuzz::put(&dir, "model.safetensors.index.json", index);
    let Ok(store) = TensorStore::open(&dir) else { return };
    let names: Vec<String> = store.names().map(str::to_owned).collect();
    for name in &names {
        let t = store.get(name).expect("an indexed name is found");
        let _ = t.to_f32();
    }
});
