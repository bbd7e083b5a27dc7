//! `picchio_runtime::run::dump_logits` (`--dump-logits PATH`): written atomically, and an existing file
//! is replaced only when it is a previous dump.

use picchio_runtime::run::dump_logits;

#[test]
fn a_previous_dump_is_replaced_and_anything_else_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("logits.safetensors");
    dump_logits(&dump, &[1.0, 2.0, 3.0, 4.0], 2).unwrap();
    dump_logits(&dump, &[5.0, 6.0], 2).unwrap();
    let bytes = std::fs::read(&dump).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits").unwrap();
    assert_eq!((st.len(), t.shape()), (1, &[1usize, 2][..]));
    assert_eq!(t.data(), bytemuck::cast_slice::<f32, u8>(&[5.0, 6.0]));

    // A safetensors file with other tensors (a model shard), a non-safetensors file, a directory.
    let shard = dir.path().join("model-00001-of-00001.safetensors");
    let w = [0u8; 8];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2], &w).unwrap();
    safetensors::serialize_to_file([("logits", view.clone()), ("lm_head.weight", view)], None, &shard).unwrap();
    let config = dir.path().join("config.json");
    std::fs::write(&config, b"{\"model_type\": \"qwen3_moe\"}").unwrap();
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    for path in [&shard, &config, &sub] {
        let before = std::fs::read(path).ok();
        let e = dump_logits(path, &[1.0, 2.0], 2).unwrap_err().to_string();
        assert!(
            e.contains(&format!("{}: exists and is not a logits dump", path.display()))
                && e.contains("remove it or choose another path"),
            "{e}"
        );
        assert_eq!(std::fs::read(path).ok(), before, "{} changed", path.display());
    }
    let mut names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    names.sort();
    assert_eq!(
        names,
        ["config.json", "logits.safetensors", "model-00001-of-00001.safetensors", "sub"],
        "no temp file left"
    );
}

/// A failed write (the directory is missing) leaves nothing behind.
#[test]
fn a_failed_write_leaves_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("missing").join("logits.safetensors");
    let e = dump_logits(&path, &[1.0], 1).unwrap_err().to_string();
    assert!(e.contains("missing"), "{e}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
