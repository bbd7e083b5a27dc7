//! The GGUF reader and the ggml dequantizers against files gguf-py wrote
//! (`tests/fixtures/gguf/`, made by its `make_fixtures.py` with gguf 0.19.0 and numpy 2.4.6).

use picchio_core::format::gguf::{Array, GgmlType, GgufError, GgufFile, GgufModel, Value};
use picchio_runtime::kernels::ggml::{dequantize, SUPPORTED};
use picchio_tests::fixture;
use serde_json::Value as Json;

fn gguf_fixture(name: &str) -> std::path::PathBuf {
    fixture("gguf").join(name)
}

fn expected() -> Json {
    let text = std::fs::read_to_string(gguf_fixture("tiny.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Every supported type, on blocks of random bytes with sane scales: our f32s have the bit
/// patterns `gguf.quants.dequantize` gave (NaN payloads included for F32, F16 and BF16).
#[test]
fn dequantize_equals_gguf_py_bit_for_bit() {
    for ty in SUPPORTED {
        let raw = std::fs::read(gguf_fixture(&format!("dequant/{}.bin", ty.name()))).unwrap();
        let want = std::fs::read(gguf_fixture(&format!("dequant/{}.f32", ty.name()))).unwrap();
        let want: Vec<u32> = want.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).collect();
        assert!(want.len() >= 256, "{ty}: a few blocks at least");
        let mut got = vec![0f32; want.len()];
        dequantize(ty, &raw, &mut got).unwrap();
        let differ = got.iter().zip(&want).filter(|(g, w)| g.to_bits() != **w).count();
        let first = got.iter().zip(&want).position(|(g, w)| g.to_bits() != *w);
        assert_eq!(
            differ,
            0,
            "{ty}: {differ} of {} values differ from gguf-py; first at {first:?}: ours {:?}, gguf-py {:?}",
            want.len(),
            first.map(|i| got[i]),
            first.map(|i| f32::from_bits(want[i]))
        );
        assert!(got.iter().any(|v| *v != 0.0), "{ty}: the fixture is not all zeros");
    }
}

/// Checks one metadata value against what make_fixtures.py wrote.
fn check_value(key: &str, got: &Value, want: &Json) {
    let ty = want["type"].as_str().unwrap();
    let v = &want["value"];
    let ok = match (ty, got) {
        ("UINT8", Value::U8(x)) => v.as_u64() == Some(u64::from(*x)),
        ("INT8", Value::I8(x)) => v.as_i64() == Some(i64::from(*x)),
        ("UINT16", Value::U16(x)) => v.as_u64() == Some(u64::from(*x)),
        ("INT16", Value::I16(x)) => v.as_i64() == Some(i64::from(*x)),
        ("UINT32", Value::U32(x)) => v.as_u64() == Some(u64::from(*x)),
        ("INT32", Value::I32(x)) => v.as_i64() == Some(i64::from(*x)),
        ("UINT64", Value::U64(x)) => v.as_u64() == Some(*x),
        ("INT64", Value::I64(x)) => v.as_i64() == Some(*x),
        ("FLOAT32", Value::F32(x)) => want["bits"].as_u64() == Some(u64::from(x.to_bits())),
        ("FLOAT64", Value::F64(x)) => v.as_f64() == Some(*x),
        ("BOOL", Value::Bool(x)) => v.as_bool() == Some(*x),
        ("STRING", Value::String(x)) => v.as_str() == Some(x.as_str()),
        ("ARRAY", Value::Array(a)) => check_array(a, want["sub_type"].as_str().unwrap(), v),
        _ => false,
    };
    assert!(ok, "key `{key}`: read {got:?}, gguf-py wrote {want}");
}

fn check_array(a: &Array, sub: &str, v: &Json) -> bool {
    let w = v.as_array().unwrap();
    let ints = |got: Vec<i128>| {
        got == w
            .iter()
            .map(|x| x.as_i64().map_or_else(|| i128::from(x.as_u64().unwrap()), i128::from))
            .collect::<Vec<_>>()
    };
    match (sub, a) {
        ("UINT8", Array::U8(x)) => ints(x.iter().map(|&e| e.into()).collect()),
        ("INT8", Array::I8(x)) => ints(x.iter().map(|&e| e.into()).collect()),
        ("UINT16", Array::U16(x)) => ints(x.iter().map(|&e| e.into()).collect()),
        ("INT16", Array::I16(x)) => ints(x.iter().map(|&e| e.into()).collect()),
        ("UINT32", Array::U32(x)) => ints(x.iter().map(|&e| e.into()).collect()),
        ("INT32", Array::I32(x)) => ints(x.iter().map(|&e| e.into()).collect()),
        ("UINT64", Array::U64(x)) => ints(x.iter().map(|&e| e.into()).collect()),
        ("INT64", Array::I64(x)) => ints(x.iter().map(|&e| e.into()).collect()),
        // The file holds the f32 nearest each Python float, as `as f32` rounds.
        ("FLOAT32", Array::F32(x)) => *x == w.iter().map(|e| e.as_f64().unwrap() as f32).collect::<Vec<_>>(),
        ("FLOAT64", Array::F64(x)) => *x == w.iter().map(|e| e.as_f64().unwrap()).collect::<Vec<_>>(),
        ("BOOL", Array::Bool(x)) => *x == w.iter().map(|e| e.as_bool().unwrap()).collect::<Vec<_>>(),
        ("STRING", Array::String(x)) => *x == w.iter().map(|e| e.as_str().unwrap().to_owned()).collect::<Vec<_>>(),
        // gguf-py writes Python ints in nested arrays as INT32.
        ("ARRAY", Array::Array(x)) => x.len() == w.len() && x.iter().zip(w).all(|(a, v)| check_array(a, "INT32", v)),
        _ => false,
    }
}

/// Checks `f`'s tensor infos and keys against the entry of `name` in tiny.json.
fn check_file(f: &GgufFile, name: &str, exp: &Json) {
    let e = &exp["files"][name];
    assert_eq!(f.len(), e["size"].as_u64().unwrap(), "{name}");
    let keys: Vec<&str> = f.metadata().iter().map(|(k, _)| k.as_str()).collect();
    let want: Vec<&str> = e["keys"].as_array().unwrap().iter().map(|k| k.as_str().unwrap()).collect();
    assert_eq!(keys, want, "{name}: keys in file order");
    let tensors = e["tensors"].as_array().unwrap();
    assert_eq!(f.tensors().len(), tensors.len(), "{name}");
    for (t, w) in f.tensors().iter().zip(tensors) {
        assert_eq!(t.name, w["name"].as_str().unwrap());
        let ty = GgmlType::from_id(w["type"].as_u64().unwrap() as u32).unwrap();
        assert_eq!(t.ty, ty, "{}", t.name);
        let dims: Vec<u64> = w["dims"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
        assert_eq!(t.dims, dims, "{}", t.name);
        assert_eq!(t.range, w["start"].as_u64().unwrap()..w["end"].as_u64().unwrap(), "{}", t.name);
    }
}

/// The tiny GGUF: every key has the type and value gguf-py wrote, every tensor the dims, type and
/// absolute byte range gguf-py's own reader (GGUFReader) found; each tensor's bytes dequantize.
#[test]
fn the_tiny_gguf_reads_as_gguf_py_wrote_it() {
    let exp = expected();
    let m = GgufModel::open(gguf_fixture("tiny.gguf")).unwrap();
    assert_eq!(m.files().len(), 1);
    let f = m.meta();
    assert_eq!((f.version(), f.alignment()), (3, 32));
    check_file(f, "tiny.gguf", &exp);
    let meta = exp["metadata"].as_object().unwrap();
    assert_eq!(f.metadata().len(), meta.len());
    for (key, want) in meta {
        check_value(key, f.value(key).unwrap(), want);
    }
    assert_eq!(f.get_u32("qwen3moe.block_count").unwrap(), 2);
    assert_eq!(f.get_str("general.architecture").unwrap(), "qwen3moe");
    assert_eq!(f.get_str_array("tiny.arr.string").unwrap()[2], "Ġthe");
    let e = f.get_u32("qwen3moe.expert_used_count").unwrap_err();
    assert!(e.to_string().ends_with("tiny.gguf: no metadata key `qwen3moe.expert_used_count`"), "{e}");
    // Every tensor's bytes dequantize to its element count.
    let bytes = std::fs::read(gguf_fixture("tiny.gguf")).unwrap();
    for t in m.tensors() {
        let r = &t.info.range;
        let mut out = vec![0f32; t.info.n_elems() as usize];
        dequantize(t.info.ty, &bytes[r.start as usize..r.end as usize], &mut out).unwrap();
        // The float tensors hold infinities and NaNs on purpose; the block types' scales are finite.
        if !matches!(t.info.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            assert!(out.iter().all(|v| v.is_finite()), "{}", t.info.name);
        }
    }
}

/// The 2-way split opens from either file to the same tensors, with the same bytes, as tiny.gguf;
/// its first file holds the model's metadata.
#[test]
fn the_split_opens_to_the_same_tensors() {
    let exp = expected();
    let whole = GgufModel::open(gguf_fixture("tiny.gguf")).unwrap();
    let whole_bytes = std::fs::read(gguf_fixture("tiny.gguf")).unwrap();
    let names = ["tiny-split-00001-of-00002.gguf", "tiny-split-00002-of-00002.gguf"];
    for given in names {
        let m = GgufModel::open(gguf_fixture(given)).unwrap();
        assert_eq!(m.files().len(), 2);
        for (f, name) in m.files().iter().zip(names) {
            assert_eq!(f.path(), gguf_fixture(name));
            check_file(f, name, &exp);
        }
        assert_eq!(m.meta().get_uint("split.count").unwrap(), 2);
        assert_eq!(m.meta().get_u32("qwen3moe.expert_count").unwrap(), 4);
        assert_eq!(m.tensors().len(), whole.tensors().len());
        let files: Vec<Vec<u8>> = m.files().iter().map(|f| std::fs::read(f.path()).unwrap()).collect();
        for w in whole.tensors() {
            let t = m.tensor(&w.info.name).unwrap();
            assert_eq!((&t.info.dims, t.info.ty), (&w.info.dims, w.info.ty));
            let (a, b) = (&t.info.range, &w.info.range);
            assert_eq!(
                &files[t.file][a.start as usize..a.end as usize],
                &whole_bytes[b.start as usize..b.end as usize],
                "{}",
                w.info.name
            );
        }
    }
}

fn refused(bytes: &[u8]) -> GgufError {
    GgufFile::from_bytes("damaged.gguf", bytes).unwrap_err()
}

/// Truncated and corrupted copies of tiny.gguf are refused, each error naming the offset.
#[test]
fn damaged_copies_are_refused_with_the_offset() {
    let bytes = std::fs::read(gguf_fixture("tiny.gguf")).unwrap();
    let f = GgufFile::open(gguf_fixture("tiny.gguf")).unwrap();
    let (header_len, data) = (f.header_len() as usize, f.data_offset() as usize);
    // gguf-py pads the file after the last tensor: cut inside that tensor.
    let last_end = f.tensors().iter().map(|t| t.range.end).max().unwrap() as usize;
    for cut in [0, 3, 7, 20, 24, 100, header_len / 2, header_len - 1, data + 1, last_end - 1] {
        let e = refused(&bytes[..cut]);
        let text = e.to_string();
        assert!(text.starts_with("damaged.gguf: "), "{text}");
        if cut >= 4 {
            assert!(text.contains("0x"), "cut at {cut}: {text}");
        }
        match e {
            GgufError::BadMagic { .. } => assert!(cut < 4),
            GgufError::Truncated { offset, need, len, .. } => assert!(offset + need > len && len == cut as u64),
            GgufError::TooLarge { left, .. } => assert!(left < cut as u64),
            GgufError::TensorPastEnd { end, len, .. } => assert!(cut > header_len && end > len),
            other => panic!("cut at {cut}: {other}"),
        }
    }
    // Bad magic, a version-1 file, a big-endian version.
    let mut b = bytes.clone();
    b[..4].copy_from_slice(b"GGML");
    assert!(matches!(refused(&b), GgufError::BadMagic { .. }));
    b = bytes.clone();
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(matches!(refused(&b), GgufError::UnsupportedVersion { version: 1, .. }));
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(matches!(refused(&b), GgufError::BigEndian { version: 3, .. }));
    // The last tensor's type id (4 bytes before its u64 offset, at the end of the header) set to 99.
    b = bytes.clone();
    let type_at = header_len - 12;
    b[type_at..type_at + 4].copy_from_slice(&99u32.to_le_bytes());
    let e = refused(&b);
    assert!(matches!(e, GgufError::UnknownTensorType { id: 99, offset, .. } if offset == type_at as u64), "{e}");
    // Its offset moved off the alignment.
    b = bytes.clone();
    let off_at = header_len - 8;
    let off = u64::from_le_bytes(b[off_at..off_at + 8].try_into().unwrap());
    b[off_at..off_at + 8].copy_from_slice(&(off + 1).to_le_bytes());
    assert!(matches!(refused(&b), GgufError::Misaligned { at, .. } if at == off_at as u64));
    // Its offset moved past the end of the file.
    b[off_at..off_at + 8].copy_from_slice(&(off + 4096).to_le_bytes());
    assert!(matches!(refused(&b), GgufError::TensorPastEnd { .. }));
    // The kv count made huge: refused without allocating.
    b = bytes.clone();
    b[16..24].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    assert!(matches!(refused(&b), GgufError::TooLarge { offset: 16, .. }));
    // A second split file alone, renamed: its metadata says split, its name does not.
    let dir = tempfile::tempdir().unwrap();
    let lone = dir.path().join("lone.gguf");
    std::fs::copy(gguf_fixture("tiny-split-00002-of-00002.gguf"), &lone).unwrap();
    let e = GgufModel::open(&lone).unwrap_err();
    assert!(matches!(e, GgufError::Split { .. }), "{e}");
    // A split whose sibling is missing.
    std::fs::copy(gguf_fixture("tiny-split-00001-of-00002.gguf"), dir.path().join("t-00001-of-00002.gguf")).unwrap();
    let e = GgufModel::open(dir.path().join("t-00001-of-00002.gguf")).unwrap_err();
    assert!(matches!(&e, GgufError::Io { path, .. } if path == &dir.path().join("t-00002-of-00002.gguf")), "{e}");
}
