//! A GGUF header as the reader sees it: the input is parsed from memory with
//! `GgufFile::from_bytes` (magic, version, every metadata value type, nested arrays, tensor infos,
//! alignment, byte ranges); on success every key is read through the typed accessors, every
//! tensor's range is checked to lie inside the input and its bytes are dequantized when the type
//! has a dequantizer. The input is then written as `m-00001-of-00002.gguf` in a scratch directory
//! and opened with `GgufModel::open` (the file path, and the split checks when its metadata says
//! split). Every outcome must be `Ok` or a clear error, with no allocation sized by a number in the
//! file beyond a small multiple of the input's length.
#![no_main]

use libfuzzer_sys::fuzz_target;
use picchio_core::format::gguf::{GgufFile, GgufModel};
use picchio_runtime::kernels::ggml::{dequantize, SUPPORTED};

fuzz_target!(|file: &[u8]| {
    let Ok(f) = GgufFile::from_bytes("fuzz.gguf", file) else { return };
    assert!(f.header_len() <= f.len() && f.data_offset() % f.alignment() == 0);
    for (key, value) in f.metadata() {
        // The same entry (compared by address: a NaN value is not equal to itself).
        assert!(f.get(key).is_some_and(|v| std::ptr::eq(v, value)), "keys are unique");
        let _ = (f.get_u32(key), f.get_str(key), f.get_uint(key), f.get_str_array(key), value.type_name());
    }
    for t in f.tensors() {
        assert!(t.range.start >= f.data_offset() && t.range.end <= file.len() as u64, "{t:?}");
        assert_eq!(Some(t.n_bytes()), t.ty.bytes_for(t.n_elems()));
        if SUPPORTED.contains(&t.ty) && t.n_elems() <= 1 << 16 {
            let mut out = vec![0f32; t.n_elems() as usize];
            dequantize(t.ty, &file[t.range.start as usize..t.range.end as usize], &mut out)
                .expect("a tensor that opened has whole blocks");
        }
    }
    let dir = picchio_fuzz::scratch_dir().join("gguf");
    std::fs::create_dir_all(&dir).expect("scratch");
    picchio_fuzz::put(&dir, "m-00001-of-00002.gguf", file);
    if let Ok(m) = GgufModel::open(dir.join("m-00001-of-00002.gguf")) {
        assert_eq!(m.tensors().len(), f.tensors().len());
    }
});
