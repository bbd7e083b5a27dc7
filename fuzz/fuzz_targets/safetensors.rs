//! The safetensors header and tensor views as the runtime reads them: the input is written as
//! `model.safetensors` of a scratch model directory, opened with `TensorStore::open` (the
//! memory-mapped loader every command uses), and every tensor it indexed is looked up and viewed
//! (bytes, element count, shape check, widening to f32). Every outcome must be `Ok` or a clear error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use picchio_runtime::model::safetensors::TensorStore;

fuzz_target!(|file: &[u8]| {
    let dir = picchio_fuzz::scratch_with("single", "model.safetensors", file);
    let Ok(store) = TensorStore::open(&dir) else { return };
    let names: Vec<String> = store.names().map(str::to_owned).collect();
    for name in &names {
        let t = store.get(name).expect("an indexed name is found");
        assert!(t.bytes.len() <= file.len(), "a view lies inside the file");
        let _ = t.numel();
        let _ = t.expect_shape(&[1]);
        if let Ok(v) = t.to_f32() {
            assert!(v.len() <= t.bytes.len(), "at most one value per byte");
        }
    }
    assert!(store.get("no such tensor").is_err());
});
