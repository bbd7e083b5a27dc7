//! `convert`, `pack` and `verify` against the vendored checkpoints and Picchio (C)'s own files:
//! quantized payloads equal the quantizer applied to the fixture weights, Picchio (C)'s image is
//! reproduced byte for byte, broken checkpoints fail with errors naming the file and tensor, and the
//! source directory is never modified.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use picchio_blockdev::{PsyncOptions, PsyncQueue};
use picchio_core::format::DENSE_LAYER_PLACEHOLDER;
use picchio_core::format::{decode_index, Superblock};
use picchio_core::{AlignedBuf, ExpertKey, FlatStore, FlatStoreOptions, LoadError, StoreExpect};
use picchio_runtime::expert::layout::ExpertLayout;
use picchio_runtime::expert::store::store_dims;
use picchio_runtime::image::convert::{convert, ConvertOptions, ExpertSource};
use picchio_runtime::image::pack::{pack, PackOptions};
use picchio_runtime::image::record::RecordModel;
use picchio_runtime::image::verify::{verify, FailureKind, VerifyOptions};
use picchio_runtime::model::safetensors::TensorStore;
use picchio_runtime::quant::{quantize_q3, quantize_q4, QuantKind};
use picchio_runtime::Config;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

// ------------------------------------------------------------------------------------------ helpers

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name)
}

fn opts() -> ConvertOptions {
    ConvertOptions { progress: false, ..Default::default() }
}

fn popts() -> PackOptions {
    PackOptions { progress: false, ..Default::default() }
}

/// Every file under `dir` (relative path → bytes).
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(p.strip_prefix(dir).unwrap().to_path_buf(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        std::fs::write(dst.join(p.file_name().unwrap()), std::fs::read(&p).unwrap()).unwrap();
    }
}

/// An owned tensor for rewriting checkpoints.
#[derive(Clone)]
struct Owned {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn read_tensors(path: &Path) -> Vec<(String, Owned)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<(String, Owned)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, Owned { dtype: t.dtype(), shape: t.shape().to_vec(), data: t.data().to_vec() }))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Writes tensors with the safetensors crate's `serialize_to_file`.
fn write_tensors(path: &Path, tensors: &[(String, Owned)]) {
    let views: Vec<(String, TensorView<'_>)> =
        tensors.iter().map(|(n, t)| (n.clone(), TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap())).collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), path).unwrap();
}

/// Rewrites the file of `dir` holding `name` (per the index, or model.safetensors) with `edit`.
fn edit_tensor(dir: &Path, name: &str, edit: impl FnOnce(&mut Owned)) {
    let file = shard_of(dir, name);
    let mut tensors = read_tensors(&file);
    let t = &mut tensors.iter_mut().find(|(n, _)| n == name).unwrap().1;
    edit(t);
    write_tensors(&file, &tensors);
}

fn shard_of(dir: &Path, name: &str) -> PathBuf {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(index).unwrap()).unwrap();
        dir.join(v["weight_map"][name].as_str().unwrap())
    } else {
        dir.join("model.safetensors")
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The payload of expert (l, e) computed from the Hugging Face fixture with the quantizer directly.
fn expected_payload(src: &TensorStore, quant: QuantKind, h: usize, i: usize, l: usize, e: usize) -> Vec<u8> {
    let get =
        |m: &str| src.get(&format!("model.layers.{l}.mlp.experts.{e}.{m}_proj.weight")).unwrap().to_f32().unwrap();
    let (gate, up, down) = (get("gate"), get("up"), get("down"));
    let mut gu = Vec::new();
    for r in 0..i {
        gu.extend_from_slice(&gate[r * h..(r + 1) * h]);
        gu.extend_from_slice(&up[r * h..(r + 1) * h]);
    }
    let q = |w: &[f32], rows, cols| match quant {
        QuantKind::Q4 => quantize_q4(w, rows, cols),
        QuantKind::Q3 => quantize_q3(w, rows, cols),
        QuantKind::F32 => (f32_bytes(w), vec![]),
    };
    let (a, b) = q(&gu, 2 * i, h);
    let (c, d) = q(&down, h, i);
    [a, f32_bytes(&b), c, f32_bytes(&d)].concat()
}

fn payload(store: &TensorStore, layout: &ExpertLayout, l: usize, e: usize) -> Vec<u8> {
    let mut p = vec![0u8; layout.len()];
    layout.payload_from_store(store, l, e, &mut p).unwrap();
    p
}

fn open_flat(path: &Path, model: Option<&Path>, verify: bool) -> FlatStore<PsyncQueue> {
    let expect = model.map(|m| {
        let cfg = Config::from_dir(m).unwrap();
        let layout = ExpertLayout::detect(&TensorStore::open(m).unwrap(), &cfg).unwrap();
        StoreExpect { dims: store_dims(&cfg), payload_len: layout.len() as u32 }
    });
    let queue = PsyncQueue::open(path, PsyncOptions::buffered(2)).unwrap();
    let opts = FlatStoreOptions { image_len: queue.len(), verify, expect, ..FlatStoreOptions::default() };
    FlatStore::open(queue, path.display().to_string(), opts).unwrap()
}

/// Loads one expert through a FlatStore and returns its payload bytes (or the error).
fn load(store: &mut FlatStore<PsyncQueue>, layer: u32, expert: u32, len: usize) -> Result<Vec<u8>, LoadError> {
    use picchio_core::ExpertLoader;
    let buf = AlignedBuf::new(len.next_multiple_of(4096), 4096).unwrap();
    let mut got = None;
    store.load(layer, vec![(expert, buf)], &mut |l| got = Some(l.result.map(|_| l.buf.as_slice()[..len].to_vec())));
    got.unwrap()
}

// ------------------------------------------------------------------------------------------ convert

#[test]
fn q4_payloads_equal_the_quantized_fixture_weights_and_dense_tensors_are_copied() {
    let src = fixture("qwen3_moe");
    let before = snapshot(&src);
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("q4");
    let r = convert(&src, &dst, &opts()).unwrap();
    eprintln!("convert qwen3_moe q4: {:?} on {} threads", r.elapsed, r.threads);
    assert_eq!(snapshot(&src), before, "the source directory must not change");
    assert_eq!(r.experts_converted, 3 * 16);
    assert!(r.expert_sources.iter().all(|&(_, s)| s == ExpertSource::PerExpert));
    assert_eq!(r.copied, ["config.json", "generation_config.json"]);
    let shown = r.to_string();
    assert!(shown.contains("experts: 48 in 3 MoE layers from per-expert tensors, q4 (6912 bytes each)"), "{shown}");
    assert_eq!(std::fs::read(dst.join("config.json")).unwrap(), std::fs::read(src.join("config.json")).unwrap());

    let cfg = Config::from_dir(&dst).unwrap();
    let out = TensorStore::open(&dst).unwrap();
    let layout = ExpertLayout::detect(&out, &cfg).unwrap();
    assert_eq!((layout.quant, layout.len()), (QuantKind::Q4, 6912));
    let hf = TensorStore::open(&src).unwrap();
    for l in 0..3 {
        for e in 0..16 {
            let want = expected_payload(&hf, QuantKind::Q4, 64, 64, l, e);
            assert!(payload(&out, &layout, l, e) == want, "payload of ({l}, {e})");
        }
    }
    // Picchio (C)'s shapes: flat U8 packed weights, flat F32 scales.
    let t = out.get("model.layers.2.mlp.experts.15.gate_up_proj").unwrap();
    assert_eq!((t.dtype, t.shape), (Dtype::U8, &[2 * 64 * 64 / 2][..]));
    let t = out.get("model.layers.2.mlp.experts.15.gate_up_proj.qs").unwrap();
    assert_eq!((t.dtype, t.shape), (Dtype::F32, &[2 * 64][..]));
    // Every other tensor is copied: same dtype, shape and bytes.
    let mut dense = 0;
    for name in hf.names().filter(|n| !n.contains(".mlp.experts.")) {
        let (a, b) = (hf.get(name).unwrap(), out.get(name).unwrap());
        assert_eq!((a.dtype, a.shape, a.bytes), (b.dtype, b.shape, b.bytes), "{name}");
        dense += 1;
    }
    assert_eq!(dense, r.dense_tensors);
    assert_eq!(out.names().count(), dense + 48 * 4);
    // The index: every tensor, and the total of the tensor bytes.
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dst.join("model.safetensors.index.json")).unwrap()).unwrap();
    assert_eq!(index["weight_map"].as_object().unwrap().len(), out.names().count());
    let total: usize = out.names().map(|n| out.get(n).unwrap().bytes.len()).sum();
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(total as u64));
    assert_eq!(r.total_size, total as u64);
    // Nothing else beside the destination (the temporary directory is gone).
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
}

#[test]
fn converted_experts_equal_picchio_c_conversion() {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("q4");
    convert(&fixture("qwen3_moe"), &dst, &opts()).unwrap();
    let c_dir = fixture("picchio_c/qwen3_moe");
    let (ours, theirs) = (TensorStore::open(&dst).unwrap(), TensorStore::open(&c_dir).unwrap());
    let layout = ExpertLayout::detect(&theirs, &Config::from_dir(&c_dir).unwrap()).unwrap();
    for l in 0..3 {
        for e in 0..16 {
            assert!(payload(&ours, &layout, l, e) == payload(&theirs, &layout, l, e), "({l}, {e})");
            for n in ["gate_up_proj", "gate_up_proj.qs", "down_proj", "down_proj.qs"] {
                let n = format!("model.layers.{l}.mlp.experts.{e}.{n}");
                let (a, b) = (ours.get(&n).unwrap(), theirs.get(&n).unwrap());
                assert_eq!((a.dtype, a.shape), (b.dtype, b.shape), "{n}");
            }
        }
    }
}

#[test]
fn none_and_q3_experts() {
    let src = fixture("qwen3_moe");
    let hf = TensorStore::open(&src).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    for quant in [QuantKind::F32, QuantKind::Q3] {
        let dst = tmp.path().join(quant.name());
        convert(&src, &dst, &ConvertOptions { experts: quant, ..opts() }).unwrap();
        let out = TensorStore::open(&dst).unwrap();
        let layout = ExpertLayout::detect(&out, &Config::from_dir(&dst).unwrap()).unwrap();
        assert_eq!(layout.quant, quant);
        for (l, e) in [(0, 0), (1, 7), (2, 15)] {
            assert!(payload(&out, &layout, l, e) == expected_payload(&hf, quant, 64, 64, l, e), "{quant} ({l}, {e})");
        }
        if quant == QuantKind::F32 {
            let t = out.get("model.layers.0.mlp.experts.0.gate_up_proj").unwrap();
            assert_eq!((t.dtype, t.shape), (Dtype::F32, &[2 * 64 * 64][..]));
            assert!(!out.contains("model.layers.0.mlp.experts.0.gate_up_proj.qs"));
        }
    }
}

#[test]
fn output_does_not_depend_on_threads_or_shard_bound() {
    let src = fixture("qwen3_moe");
    let tmp = tempfile::tempdir().unwrap();
    let one = tmp.path().join("t1");
    let two = tmp.path().join("t2");
    convert(&src, &one, &ConvertOptions { threads: Some(1), ..opts() }).unwrap();
    let r = convert(&src, &two, &ConvertOptions { threads: Some(3), ..opts() }).unwrap();
    assert_eq!(r.threads, 3);
    assert_eq!(snapshot(&one), snapshot(&two));
    assert_eq!(r.shards.len(), 1);
    assert!(one.join("model-00001-of-00001.safetensors").exists());

    let small = tmp.path().join("small");
    let r = convert(&src, &small, &ConvertOptions { max_shard_bytes: 300_000, ..opts() }).unwrap();
    assert!(r.shards.len() > 3, "{} shards", r.shards.len());
    for (k, p) in r.shards.iter().enumerate() {
        assert_eq!(
            p.file_name().unwrap().to_str().unwrap(),
            format!("model-{:05}-of-{:05}.safetensors", k + 1, r.shards.len())
        );
        // The bound holds for every shard but one holding a single larger tensor (the 512 KiB embedding).
        let n = read_tensors(p).len();
        let data: usize = read_tensors(p).iter().map(|(_, t)| t.data.len()).sum();
        assert!(data <= 300_000 || n == 1, "{}: {data} bytes in {n} tensors", p.display());
    }
    let (a, b) = (TensorStore::open(&one).unwrap(), TensorStore::open(&small).unwrap());
    assert_eq!(a.names().count(), b.names().count());
    for n in a.names() {
        assert_eq!(a.get(n).unwrap().bytes, b.get(n).unwrap().bytes, "{n}");
    }
}

/// The fixture's per-expert tensors fused as transformers 5 holds them: `gate_up_proj` [E, 2I, H]
/// (gate rows first, then up rows) and `down_proj` [E, H, I].
fn fuse_checkpoint(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    let cfg = Config::from_dir(src).unwrap();
    let hf = TensorStore::open(src).unwrap();
    let mut tensors: Vec<(String, Owned)> = Vec::new();
    for n in hf.names().filter(|n| !n.contains(".mlp.experts.")) {
        let t = hf.get(n).unwrap();
        tensors.push((n.into(), Owned { dtype: t.dtype, shape: t.shape.to_vec(), data: t.bytes.to_vec() }));
    }
    let (h, i, ne) = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts);
    for l in cfg.moe_layers() {
        let (mut gu, mut d) = (Vec::new(), Vec::new());
        for e in 0..ne {
            let p = format!("model.layers.{l}.mlp.experts.{e}");
            gu.extend_from_slice(hf.get(&format!("{p}.gate_proj.weight")).unwrap().bytes);
            gu.extend_from_slice(hf.get(&format!("{p}.up_proj.weight")).unwrap().bytes);
            d.extend_from_slice(hf.get(&format!("{p}.down_proj.weight")).unwrap().bytes);
        }
        let p = format!("model.layers.{l}.mlp.experts");
        tensors.push((format!("{p}.gate_up_proj"), Owned { dtype: Dtype::BF16, shape: vec![ne, 2 * i, h], data: gu }));
        tensors.push((format!("{p}.down_proj"), Owned { dtype: Dtype::BF16, shape: vec![ne, h, i], data: d }));
    }
    write_tensors(&dst.join("model.safetensors"), &tensors);
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
}

#[test]
fn fused_transformers5_experts_convert_to_the_same_directory() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["qwen3_moe", "qwen3_moe_wide"] {
        let fused = tmp.path().join(format!("{name}-fused"));
        fuse_checkpoint(&fixture(name), &fused);
        let (a, b) = (tmp.path().join(format!("{name}-a")), tmp.path().join(format!("{name}-b")));
        convert(&fixture(name), &a, &opts()).unwrap();
        let r = convert(&fused, &b, &opts()).unwrap();
        assert!(r.expert_sources.iter().all(|&(_, s)| s == ExpertSource::Fused), "{:?}", r.expert_sources);
        assert_eq!(snapshot(&a), snapshot(&b), "{name}: fused and per-expert checkpoints convert alike");
    }
}

#[test]
fn dense_mlp_layer_is_copied_and_packed_as_placeholders() {
    let src = fixture("qwen3_moe_wide");
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("wide");
    let r = convert(&src, &dst, &opts()).unwrap();
    assert_eq!(r.expert_sources.iter().map(|s| s.0).collect::<Vec<_>>(), [0, 2]);
    let (hf, out) = (TensorStore::open(&src).unwrap(), TensorStore::open(&dst).unwrap());
    for n in [
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    ] {
        assert_eq!(hf.get(n).unwrap().bytes, out.get(n).unwrap().bytes, "{n}");
    }
    assert!(!out.names().any(|n| n.starts_with("model.layers.1.mlp.experts")));
    let layout = ExpertLayout::detect(&out, &Config::from_dir(&dst).unwrap()).unwrap();
    for (l, e) in [(0, 0), (0, 7), (2, 3)] {
        // two Q4 groups per row: catches a scale layout bug between groups
        assert!(payload(&out, &layout, l, e) == expected_payload(&hf, QuantKind::Q4, 128, 128, l, e), "({l}, {e})");
    }

    let img = tmp.path().join("wide.picchioflat");
    let p = pack(&dst, &img, &popts()).unwrap();
    assert_eq!((p.experts, p.placeholders, p.superblock.n_entries), (16, 8, 24));
    assert!(p.to_string().contains("8 dense-MLP layer slots hold the placeholder"), "{p}");
    let mut fs = open_flat(&img, Some(&dst), true);
    for e in 0..8 {
        match fs.entry(ExpertKey { layer: 1, expert: e }) {
            Err(LoadError::Rejected { reason, .. }) => assert!(reason.contains("len 32 differs"), "{reason}"),
            other => panic!("dense-layer slot must be rejected for the model, got {other:?}"),
        }
        assert_eq!(load(&mut fs, 0, e, layout.len()).unwrap(), payload(&out, &layout, 0, e as usize));
    }
    // Without the model's expectations the placeholder is a valid, hash-checked entry.
    let mut raw = open_flat(&img, None, true);
    assert_eq!(load(&mut raw, 1, 3, 32).unwrap(), DENSE_LAYER_PLACEHOLDER);
    let v = verify(&img, Some(&dst), &VerifyOptions { progress: false, ..Default::default() }).unwrap();
    assert!(v.is_clean(), "{:?} {:?}", v.store_problems, v.failures);
    assert_eq!((v.placeholders, v.entries, v.compared_with_model), (8, 24, true));
}

#[test]
fn decoder_sparse_step_selects_the_moe_layers() {
    // From qwen3_moe_wide ([MoE, dense, MoE]) build [dense, MoE, dense] with decoder_sparse_step 2:
    // layers 0 and 2 get layer 1's dense MLP, layer 1 gets layer 0's router and experts.
    let wide = fixture("qwen3_moe_wide");
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let mut tensors = Vec::new();
    for (n, t) in read_tensors(&wide.join("model.safetensors")) {
        let moved = |from: &str, to: &str| n.strip_prefix(from).map(|rest| format!("{to}{rest}"));
        if n.starts_with("model.layers.1.mlp.") {
            for l in [0, 2] {
                tensors.push((moved("model.layers.1.", &format!("model.layers.{l}.")).unwrap(), t.clone()));
            }
        } else if n.starts_with("model.layers.0.mlp.") {
            tensors.push((moved("model.layers.0.", "model.layers.1.").unwrap(), t));
        } else if !n.starts_with("model.layers.2.mlp.") {
            tensors.push((n, t));
        }
    }
    write_tensors(&src.join("model.safetensors"), &tensors);
    let mut cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(wide.join("config.json")).unwrap()).unwrap();
    cfg["mlp_only_layers"] = serde_json::json!([]);
    cfg["decoder_sparse_step"] = 2.into();
    std::fs::write(src.join("config.json"), cfg.to_string()).unwrap();

    let dst = tmp.path().join("dst");
    let r = convert(&src, &dst, &opts()).unwrap();
    assert_eq!(r.expert_sources, [(1, ExpertSource::PerExpert)]);
    let (hf, out) = (TensorStore::open(&wide).unwrap(), TensorStore::open(&dst).unwrap());
    let layout = ExpertLayout::detect(&out, &Config::from_dir(&dst).unwrap()).unwrap();
    assert!(payload(&out, &layout, 1, 6) == expected_payload(&hf, QuantKind::Q4, 128, 128, 0, 6));
    assert!(out.contains("model.layers.2.mlp.down_proj.weight") && !out.contains("model.layers.0.mlp.gate.weight"));
    let img = tmp.path().join("e.picchioflat");
    let p = pack(&dst, &img, &popts()).unwrap();
    assert_eq!((p.experts, p.placeholders), (8, 16));
    let v = verify(&img, Some(&dst), &VerifyOptions { progress: false, ..Default::default() }).unwrap();
    assert!(v.is_clean() && v.placeholders == 16, "{v}");
}

// --------------------------------------------------------------------------------------------- pack

#[test]
fn pack_reproduces_picchio_c_image_byte_for_byte() {
    let c_dir = fixture("picchio_c/qwen3_moe");
    let want = std::fs::read(c_dir.join("experts.picchioflat")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("c.picchioflat");
    // Without the model record (RecordModel::Nothing), the image is Picchio (C)'s byte for byte.
    let bare = PackOptions { record: RecordModel::Nothing, ..popts() };
    let r = pack(&c_dir, &img, &bare).unwrap();
    assert_eq!((r.experts, r.placeholders, r.bytes), (48, 0, want.len() as u64));
    let got = std::fs::read(&img).unwrap();
    assert_eq!(&got[..4096], &want[..4096], "superblock");
    assert_eq!(decode_index(&got[4096..4096 + 1152]), decode_index(&want[4096..4096 + 1152]), "index");
    assert!(got == want, "payloads");
    assert_eq!(Superblock::decode(&got, "ours", got.len() as u64).unwrap(), r.superblock);

    // By default the superblock's reserved bytes (96..4096, zeros in Picchio (C)'s image, which
    // reads only the first 96) record the packed directory; every other byte is the same.
    let r = pack(&c_dir, &img, &popts()).unwrap();
    let got = std::fs::read(&img).unwrap();
    assert_eq!((&got[..96], &got[4096..]), (&want[..96], &want[4096..]));
    let sb = Superblock::decode(&got, "ours", got.len() as u64).unwrap();
    let rec = sb.model.clone().expect("a model record");
    assert_eq!(rec.dir, c_dir.canonicalize().unwrap());
    assert_eq!(rec.config_sha256, picchio_runtime::image::record::config_sha256(&c_dir).unwrap());
    assert_eq!(sb, r.superblock);

    // Our own conversion of the Hugging Face checkpoint packs to the same image.
    let dst = tmp.path().join("q4");
    convert(&fixture("qwen3_moe"), &dst, &opts()).unwrap();
    let ours = tmp.path().join("ours.picchioflat");
    pack(&dst, &ours, &bare).unwrap();
    assert!(std::fs::read(&ours).unwrap() == want, "convert + pack of qwen3_moe == Picchio (C)'s image");
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 3, "no temporary file left");
}

#[test]
fn packed_store_opens_with_every_check_and_serves_the_payloads() {
    let c_dir = fixture("picchio_c/qwen3_moe");
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("e.picchioflat");
    pack(&c_dir, &img, &popts()).unwrap();
    let mut fs = open_flat(&img, Some(&c_dir), true);
    let store = TensorStore::open(&c_dir).unwrap();
    let layout = ExpertLayout::detect(&store, &Config::from_dir(&c_dir).unwrap()).unwrap();
    for l in 0..3u32 {
        for e in 0..16u32 {
            let loc = fs.entry(ExpertKey { layer: l, expert: e }).unwrap();
            assert_eq!((loc.len, loc.padded_len), (6912, 8192));
            assert_eq!(load(&mut fs, l, e, layout.len()).unwrap(), payload(&store, &layout, l as usize, e as usize));
        }
    }
}

#[test]
fn prefix_store_holds_the_first_layers() {
    let c_dir = fixture("picchio_c/qwen3_moe");
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("p.picchioflat");
    let r = pack(&c_dir, &img, &PackOptions { layers: Some(2), ..popts() }).unwrap();
    assert_eq!((r.superblock.n_layers, r.superblock.n_entries), (3, 32));
    assert!(r.to_string().contains("from 2 of 3 layers (prefix store"), "{r}");
    let full = std::fs::read(c_dir.join("experts.picchioflat")).unwrap();
    let got = std::fs::read(&img).unwrap();
    // Same payload bytes, one index block earlier or not: the index of 32 entries still fits in one block.
    assert_eq!(&got[8192..], &full[8192..8192 + 32 * 8192]);
    let fs = open_flat(&img, Some(&c_dir), false);
    assert!(fs.entry(ExpertKey { layer: 1, expert: 15 }).is_ok());
    assert!(matches!(fs.entry(ExpertKey { layer: 2, expert: 0 }), Err(LoadError::Missing { n_entries: 32, .. })));
    for bad in [0, 4] {
        let e = pack(&c_dir, &img, &PackOptions { layers: Some(bad), ..popts() }).unwrap_err().to_string();
        assert!(e.contains(&format!("--layers {bad}")) && e.contains("1..=3"), "{e}");
    }
}

#[test]
fn pack_refuses_an_unconverted_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let img = tmp.path().join("x.picchioflat");
    let e = pack(&fixture("qwen3_moe"), &img, &popts()).unwrap_err().to_string();
    assert!(e.contains("picchio convert"), "{e}");
    assert!(!img.exists());
}

// ------------------------------------------------------------------------------------------- verify

#[test]
fn verify_reports_flipped_bytes_and_differing_models_by_expert_and_offset() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("q4");
    convert(&fixture("qwen3_moe"), &model, &opts()).unwrap();
    let img = tmp.path().join("e.picchioflat");
    pack(&model, &img, &popts()).unwrap();
    let vo = VerifyOptions { progress: false, ..Default::default() };
    let clean = verify(&img, Some(&model), &vo).unwrap();
    assert!(clean.is_clean() && clean.compared_with_model);
    assert!(clean.engine.starts_with("psync"), "{}", clean.engine);
    assert!(clean.to_string().ends_with(&format!("OK ({:.2?})", clean.elapsed)), "{clean}");
    assert_eq!((clean.entries, clean.bytes_read), (48, 48 * 6912));
    assert!(verify(&img, None, &vo).unwrap().is_clean());

    // One flipped byte in the payload of (1, 5): its hash no longer matches the index.
    let bytes = std::fs::read(&img).unwrap();
    let idx = decode_index(&bytes[4096..4096 + 48 * 24]);
    let loc = idx[16 + 5];
    let mut bad = bytes.clone();
    bad[loc.offset as usize + 100] ^= 0x10;
    let flipped = tmp.path().join("flipped.picchioflat");
    std::fs::write(&flipped, &bad).unwrap();
    let v = verify(&flipped, None, &vo).unwrap();
    assert!(!v.is_clean());
    assert_eq!(v.failures.len(), 1, "{:?}", v.failures);
    let p = &v.failures[0];
    assert_eq!((p.key, p.offset), (ExpertKey { layer: 1, expert: 5 }, loc.offset));
    assert!(matches!(p.kind, FailureKind::Hash { expected, .. } if expected == loc.hash));
    assert!(p.to_string().contains("(layer 1, expert 5)"), "{p}");
    let shown = v.to_string();
    assert!(
        shown.contains("FAILED: 0 image problem(s), 1 expert(s)") && shown.contains("(layer 1, expert 5)"),
        "{shown}"
    );

    // A model whose expert (1, 5) differs in one byte of down_proj: a mismatch at that offset.
    let other = tmp.path().join("other");
    copy_dir(&model, &other);
    edit_tensor(&other, "model.layers.1.mlp.experts.5.down_proj", |t| t.data[10] ^= 0xff);
    let v = verify(&img, Some(&other), &vo).unwrap();
    let layout = ExpertLayout::new(QuantKind::Q4, 64, 64).unwrap();
    assert_eq!(v.failures.len(), 1, "{:?}", v.failures);
    let p = &v.failures[0];
    assert_eq!(p.key, ExpertKey { layer: 1, expert: 5 });
    assert_eq!(p.kind, FailureKind::Mismatch { first: layout.down.start + 10, count: 1 });
    assert!(p.to_string().contains(&format!("{:#x}", loc.offset + layout.down.start as u64 + 10)), "{p}");

    // A model of other dimensions: reported, payloads not compared.
    let v = verify(&img, Some(&fixture("picchio_c/qwen3_moe")), &vo).unwrap();
    assert!(v.is_clean(), "Picchio (C)'s conversion is the same model");
    let wide = tmp.path().join("wide");
    convert(&fixture("qwen3_moe_wide"), &wide, &opts()).unwrap();
    let v = verify(&img, Some(&wide), &vo).unwrap();
    assert!(!v.compared_with_model && !v.store_problems.is_empty());
    assert!(
        v.store_problems[0].to_string().contains("hidden is 64 in the store, 128 in the model"),
        "{}",
        v.store_problems[0]
    );

    // A corrupt index entry and a corrupt index hash are reported; a bad magic is an error.
    let mut bad = bytes.clone();
    bad[4096 + 24 * 47] = 1; // offset of the last entry no longer block-aligned
    std::fs::write(&flipped, &bad).unwrap();
    let v = verify(&flipped, None, &vo).unwrap();
    assert!(v.store_problems[0].to_string().contains("SHA-256"), "{}", v.store_problems[0]);
    assert_eq!(v.failures.len(), 1);
    assert_eq!(v.failures[0].key, ExpertKey { layer: 2, expert: 15 });
    assert!(
        matches!(&v.failures[0].kind, FailureKind::BadEntry(r) if r.contains("not a multiple")),
        "{:?}",
        v.failures
    );
    let mut bad = bytes;
    bad[0] = b'X';
    std::fs::write(&flipped, &bad).unwrap();
    let e = verify(&flipped, None, &vo).unwrap_err().to_string();
    assert!(e.contains("bad magic") && e.contains("flipped.picchioflat"), "{e}");
}

#[test]
fn superblock_dimensions_no_hash_covers_are_checked_against_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("picchio_c/qwen3_moe");
    let mut b = std::fs::read(model.join("experts.picchioflat")).unwrap();
    b[16] ^= 0x80; // hidden 64 -> 192
    b[28] = 2; // topk 4 -> 2
    let img = tmp.path().join("dims.picchioflat");
    std::fs::write(&img, &b).unwrap();
    let vo = VerifyOptions { progress: false, ..Default::default() };

    // Hashes alone cannot see it; the report says the dimensions were not checked.
    let v = verify(&img, None, &vo).unwrap();
    assert!(v.is_clean(), "{v}");
    let shown = v.to_string();
    assert!(
        shown.contains("hidden 192") && shown.contains("topk 2") && shown.contains("not hash-protected"),
        "{shown}"
    );

    // The model catches both fields and does not compare payloads of "another" model.
    let v = verify(&img, Some(&model), &vo).unwrap();
    assert!(!v.is_clean() && !v.compared_with_model && v.failures.is_empty(), "{v}");
    let problems: Vec<String> = v.store_problems.iter().map(ToString::to_string).collect();
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert!(problems[0].contains("hidden is 192 in the store, 64 in the model"), "{problems:?}");
    assert!(problems[1].contains("topk is 2 in the store, 4 in the model"), "{problems:?}");
    assert!(!v.to_string().contains("not hash-protected"), "{v}");
}

// ---------------------------------------------------------------------------------------- bad input

/// Converts a broken copy of `fixture` (made by `breakage`) and returns the error; checks that the
/// source is unchanged and that nothing was left beside the destination.
fn convert_broken(fixture_name: &str, breakage: impl FnOnce(&Path)) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    copy_dir(&fixture(fixture_name), &src);
    breakage(&src);
    let before = snapshot(&src);
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let e = convert(&src, &out.join("dst"), &opts()).unwrap_err().to_string();
    eprintln!("{e}");
    assert_eq!(snapshot(&src), before, "the source directory must not change");
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0, "nothing left beside the destination: {e}");
    e
}

#[test]
fn missing_or_garbled_config_is_named() {
    let e = convert_broken("qwen3_moe", |s| std::fs::remove_file(s.join("config.json")).unwrap());
    assert!(e.contains("src/config.json") && e.contains("read config"), "{e}");
    let e = convert_broken("qwen3_moe", |s| {
        std::fs::write(s.join("config.json"), "{\"model_type\": \"qwen3_moe\",").unwrap()
    });
    assert!(e.contains("src/config.json: invalid config"), "{e}");
    let e = convert_broken("qwen3_moe", |s| {
        let p = s.join("config.json");
        let t = std::fs::read_to_string(&p).unwrap().replace("\"qwen3_moe\"", "\"mixtral\"");
        std::fs::write(p, t).unwrap();
    });
    assert!(e.contains("config.json: unsupported model_type \"mixtral\""), "{e}");
}

#[test]
fn missing_and_truncated_shards_are_named() {
    let e = convert_broken("qwen3_moe", |s| std::fs::remove_file(s.join("model-00002-of-00002.safetensors")).unwrap());
    assert!(e.contains("model-00002-of-00002.safetensors: open"), "{e}");
    let e = convert_broken("qwen3_moe", |s| {
        let p = s.join("model-00001-of-00002.safetensors");
        let b = std::fs::read(&p).unwrap();
        std::fs::write(&p, &b[..b.len() - 1000]).unwrap();
    });
    assert!(e.contains("model-00001-of-00002.safetensors: not a valid safetensors file"), "{e}");
}

#[test]
fn wrong_shape_or_dtype_names_file_and_tensor() {
    // A dense tensor with another shape (same bytes).
    let e = convert_broken("qwen3_moe", |s| {
        edit_tensor(s, "model.layers.1.self_attn.o_proj.weight", |t| t.shape = vec![32, 128]);
    });
    assert!(
        e.contains(
            ".safetensors: tensor `model.layers.1.self_attn.o_proj.weight` has shape [32, 128], expected [64, 64]"
        ),
        "{e}"
    );
    // An expert tensor with another shape.
    let e = convert_broken("qwen3_moe", |s| {
        edit_tensor(s, "model.layers.2.mlp.experts.9.down_proj.weight", |t| t.shape = vec![128, 32]);
    });
    assert!(
        e.contains("model-0000") && e.contains("`model.layers.2.mlp.experts.9.down_proj.weight` has shape [128, 32]"),
        "{e}"
    );
    // I32 instead of BF16, dense and expert.
    for name in ["model.norm.weight", "model.layers.0.mlp.experts.3.gate_proj.weight"] {
        let e = convert_broken("qwen3_moe", |s| {
            edit_tensor(s, name, |t| {
                t.dtype = Dtype::I32;
                t.data.extend(t.data.clone());
            })
        });
        assert!(e.contains(&format!("tensor `{name}` has dtype I32, expected F32, BF16 or F16")), "{e}");
        assert!(e.contains("src/model-0000"), "{e}");
    }
    // A missing tensor.
    let e = convert_broken("qwen3_moe_wide", |s| {
        let p = s.join("model.safetensors");
        let t: Vec<_> =
            read_tensors(&p).into_iter().filter(|(n, _)| n != "model.layers.1.mlp.up_proj.weight").collect();
        write_tensors(&p, &t);
    });
    assert!(e.contains("tensor `model.layers.1.mlp.up_proj.weight` not found in model.safetensors"), "{e}");
}

#[test]
fn unused_tensors_pass_through_and_stray_experts_fail() {
    let extra = Owned { dtype: Dtype::F32, shape: vec![8], data: f32_bytes(&[0.5; 8]) };
    let add = |name: &'static str, t: Owned| {
        move |s: &Path| {
            let p = s.join("model.safetensors");
            let mut v = read_tensors(&p);
            v.push((name.to_string(), t));
            write_tensors(&p, &v);
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    copy_dir(&fixture("qwen3_moe_wide"), &src);
    add("model.rotary_emb.inv_freq", extra.clone())(&src);
    let dst = tmp.path().join("dst");
    let r = convert(&src, &dst, &opts()).unwrap();
    assert_eq!(r.passthrough, ["model.rotary_emb.inv_freq"]);
    assert_eq!(TensorStore::open(&dst).unwrap().get("model.rotary_emb.inv_freq").unwrap().bytes, &extra.data[..]);

    let e = convert_broken("qwen3_moe_wide", add("model.layers.1.mlp.experts.0.up_proj.weight", extra.clone()));
    assert!(e.contains("unexpected routed-expert tensor `model.layers.1.mlp.experts.0.up_proj.weight`"), "{e}");
    assert!(e.contains("src/model.safetensors") && e.contains("mlp_only_layers [1]"), "{e}");
    let e = convert_broken("qwen3_moe_wide", add("model.layers.0.mlp.experts.gate_up_proj", extra));
    assert!(e.contains("`model.layers.0.mlp.experts.gate_up_proj` has shape [8], expected [8, 256, 128]"), "{e}");
}

#[test]
fn q4_needs_whole_groups() {
    let e = convert_broken("qwen3_moe", |s| {
        let p = s.join("config.json");
        let t = std::fs::read_to_string(&p)
            .unwrap()
            .replace("\"moe_intermediate_size\": 64", "\"moe_intermediate_size\": 48");
        std::fs::write(p, t).unwrap();
    });
    assert!(
        e.contains("config.json: config key `moe_intermediate_size`: 48 is not a multiple of 64")
            && e.contains("--experts none"),
        "{e}"
    );
}

#[test]
fn refuses_destination_in_source_or_existing_and_never_touches_the_source() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    copy_dir(&fixture("qwen3_moe"), &src);
    let before = snapshot(&src);
    for dst in [src.clone(), src.join("converted"), src.join("a/b/../c")] {
        let e = convert(&src, &dst, &opts()).unwrap_err().to_string();
        assert!(e.contains("source directory"), "{e}");
    }
    let e = convert(&src, tmp.path(), &opts()).unwrap_err().to_string();
    assert!(e.contains("contains the source directory"), "{e}");
    let dst = tmp.path().join("dst");
    convert(&src, &dst, &opts()).unwrap();
    let e = convert(&src, &dst, &opts()).unwrap_err().to_string();
    assert!(e.contains("already exists") && e.contains("pass --force"), "{e}");
    std::fs::write(dst.join("stale"), b"x").unwrap();
    convert(&src, &dst, &ConvertOptions { overwrite: true, ..opts() }).unwrap();
    assert!(!dst.join("stale").exists());
    assert_eq!(snapshot(&src), before, "the source directory must not change");
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 2, "only src and dst");
    // A converted directory is not a checkpoint.
    let e = convert(&dst, &tmp.path().join("again"), &opts()).unwrap_err().to_string();
    assert!(e.contains("already a converted Picchio directory"), "{e}");
}
