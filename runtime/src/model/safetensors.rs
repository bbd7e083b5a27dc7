//! Reading tensors by Hugging Face name from a directory of safetensors files.
//!
//! Which files: `model.safetensors.index.json` when present (its `weight_map` is followed exactly:
//! no layer or file-name order is assumed), else `model.safetensors`, else every
//! `model-*.safetensors` (how Picchio (C) writes converted directories, without an index).

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors, TensorInfo};

use crate::error::{Error, Result};

/// The tensors of one model directory, memory-mapped, looked up by name.
pub struct TensorStore {
    dir: PathBuf,
    files: Vec<(PathBuf, Mmap, usize)>,
    tensors: HashMap<String, (usize, TensorInfo)>,
}

/// One tensor: where it lives, its dtype and shape, and its raw little-endian bytes.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    /// The checkpoint tensor name.
    pub name: &'a str,
    /// The file holding it.
    pub path: &'a Path,
    /// Element type.
    pub dtype: Dtype,
    /// Shape, outermost first.
    pub shape: &'a [usize],
    /// The raw bytes.
    pub bytes: &'a [u8],
}

/// The error for a safetensors file the parser refused with `cause`: when the header parses, the first
/// tensor whose byte span disagrees with its dtype and shape (name, expected and found bytes), or the
/// file's truncation ("truncated: N of M bytes"); else the parser's own error. The parser's
/// `TensorInvalidInfo` and `MetadataIncompleteBuffer` name no tensor and no size.
fn explain(path: &Path, bytes: &[u8], cause: safetensors::SafeTensorError) -> Error {
    match tensor_mismatch(bytes) {
        Some(detail) => Error::SafetensorsTensor { path: path.into(), detail },
        None => Error::Safetensors { path: path.into(), cause },
    }
}

/// What is wrong with a tensor of the safetensors file `bytes`, if its header parses (see [`explain`]).
fn tensor_mismatch(bytes: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Info {
        dtype: Dtype,
        shape: Vec<u64>,
        data_offsets: (u64, u64),
    }
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let header = bytes.get(8..usize::try_from(n).ok()?.checked_add(8)?)?;
    let v: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(header).ok()?;
    let mut tensors: Vec<(String, Info)> = v
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .map(|(k, t)| Some((k, serde_json::from_value(t).ok()?)))
        .collect::<Option<_>>()?;
    tensors.sort_by_key(|(_, t)| t.data_offsets);
    let data_start = 8 + n;
    let mut end = 0u64;
    for (name, t) in &tensors {
        let (b, e) = t.data_offsets;
        let found = e.checked_sub(b);
        let bits = t.dtype.bitsize() as u64;
        let expected = t.shape.iter().try_fold(bits, |acc, &d| acc.checked_mul(d)).map(|b| b.div_ceil(8));
        if found.is_none() || (expected.is_some() && found != expected) || b != end {
            let shape = t.shape.iter().map(u64::to_string).collect::<Vec<_>>().join(", ");
            return Some(format!(
                "tensor `{name}` ({:?} [{shape}]) needs {} bytes, its data_offsets [{b}, {e}] give {}{}",
                t.dtype,
                expected.map_or_else(|| "more than 2^64".into(), |x| x.to_string()),
                found.map_or_else(|| "a negative count".into(), |x| x.to_string()),
                if b != end { format!(" (the previous tensor ends at {end})") } else { String::new() },
            ));
        }
        end = e;
    }
    let need = data_start.checked_add(end)?;
    let have = bytes.len() as u64;
    if have < need {
        let last = tensors.iter().rev().find(|(_, t)| data_start + t.data_offsets.1 > have)?;
        let first = tensors.iter().find(|(_, t)| data_start + t.data_offsets.1 > have)?;
        return Some(format!(
            "truncated: {have} of {need} bytes (tensor `{}` onwards, through `{}`, lies past the end)",
            first.0, last.0
        ));
    }
    if have > need {
        return Some(format!(
            "{} bytes after the last tensor's data (the file has {have}, the header covers {need})",
            have - need
        ));
    }
    None
}

impl TensorStore {
    /// Opens every weight file of `dir` (see the module docs) and indexes its tensors.
    ///
    /// # Errors
    /// [`Error::NoWeights`], [`Error::ShardIndex`] (bad JSON, or a `weight_map` naming a file that is
    /// missing or a tensor that the file lacks), [`Error::Safetensors`] (bad header, truncated file),
    /// [`Error::DuplicateTensor`], [`Error::Io`].
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let (names, weight_map) = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(Error::io(&index_path, "read"))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::ShardIndex { path: index_path.clone(), message: e.to_string() })?;
            let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| Error::ShardIndex {
                path: index_path.clone(),
                message: "no `weight_map` object".into(),
            })?;
            let mut wm = HashMap::new();
            for (k, f) in map {
                let f =
                    f.as_str().filter(|f| !f.contains('/') && !f.contains('\\')).ok_or_else(|| Error::ShardIndex {
                        path: index_path.clone(),
                        message: format!("weight_map[{k:?}] is not a file name"),
                    })?;
                wm.insert(k.clone(), f.to_string());
            }
            let files: BTreeSet<String> = wm.values().cloned().collect();
            (files.into_iter().collect::<Vec<_>>(), Some(wm))
        } else if dir.join("model.safetensors").exists() {
            (vec!["model.safetensors".to_string()], None)
        } else {
            let rd = std::fs::read_dir(dir).map_err(Error::io(dir, "list directory"))?;
            let mut v: Vec<String> = rd
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("model-") && n.ends_with(".safetensors"))
                .collect();
            v.sort();
            (v, None)
        };
        if names.is_empty() {
            return Err(Error::NoWeights { dir: dir.into() });
        }
        let mut files = Vec::with_capacity(names.len());
        let mut tensors: HashMap<String, (usize, TensorInfo)> = HashMap::new();
        for name in &names {
            let path = dir.join(name);
            let file = File::open(&path).map_err(Error::io(&path, "open"))?;
            // Read-only and private; checkpoints are not modified while a model is loaded.
            let map = crate::sys::map_readonly(&path, &file)?;
            let (header_len, meta) = SafeTensors::read_metadata(&map).map_err(|cause| explain(&path, &map, cause))?;
            let fi = files.len();
            for (tname, info) in meta.tensors() {
                if let Some(wm) = &weight_map {
                    if wm.get(&tname).map(String::as_str) != Some(name.as_str()) {
                        continue; // the index assigns this tensor to another file (or to none)
                    }
                }
                if let Some((other, _)) = tensors.get(&tname) {
                    return Err(Error::DuplicateTensor {
                        name: tname,
                        first: files_path(&files, *other, dir, &names),
                        second: path.clone(),
                    });
                }
                tensors.insert(tname, (fi, info.clone()));
            }
            files.push((path, map, 8 + header_len));
        }
        if let Some(wm) = &weight_map {
            for (tname, f) in wm {
                if !tensors.contains_key(tname) {
                    return Err(Error::ShardIndex {
                        path: index_path.clone(),
                        message: format!("weight_map puts `{tname}` in {f}, which does not contain it"),
                    });
                }
            }
        }
        Ok(TensorStore { dir: dir.into(), files, tensors })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether a tensor named `name` exists.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// All tensor names (unordered).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The weight files, in the order opened.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|(p, _, _)| p.as_path())
    }

    /// Each weight file (in the order opened) with the names of the tensors it serves, in the order
    /// of their data in the file (a tensor the index assigns to another file is not listed).
    pub fn file_tensors(&self) -> Vec<(&Path, Vec<&str>)> {
        let mut per: Vec<Vec<(usize, &str)>> = vec![Vec::new(); self.files.len()];
        for (name, (fi, info)) in &self.tensors {
            per[*fi].push((info.data_offsets.0, name.as_str()));
        }
        self.files
            .iter()
            .zip(per)
            .map(|((p, _, _), mut v)| {
                v.sort();
                (p.as_path(), v.into_iter().map(|(_, n)| n).collect())
            })
            .collect()
    }

    /// Looks up `name`.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] naming the directory and the files searched.
    pub fn get(&self, name: &str) -> Result<TensorRef<'_>> {
        let Some((key, (fi, info))) = self.tensors.get_key_value(name) else {
            return Err(Error::MissingTensor {
                dir: self.dir.clone(),
                name: name.into(),
                files: self
                    .files
                    .iter()
                    .map(|(p, _, _)| p.file_name().unwrap_or_default().to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        };
        let (path, map, data_start) = &self.files[*fi];
        let (a, b) = info.data_offsets;
        Ok(TensorRef {
            name: key,
            path,
            dtype: info.dtype,
            shape: &info.shape,
            bytes: &map[data_start + a..data_start + b],
        })
    }
}

/// How far beyond a released range pages are dropped too, bytes: the kernel's fault-around maps up
/// to `fault_around_bytes` of already-cached pages around each fault (64 KiB by default, aligned,
/// never crossing a 2 MiB page-table boundary), so reading the start of a tensor maps the end of the
/// one before it again. Dropping 2 MiB on either side undoes that whatever the setting.
const FAULT_AROUND_MARGIN: usize = 2 << 20;

/// The bytes [`TensorStore::read_released`] hands over at a time.
const RELEASE_CHUNK: usize = 4 << 20;

impl TensorStore {
    /// Drops the mapped pages of tensor `name` from the resident set once its bytes were copied out
    /// (see [`crate::sys::drop_mapped_pages`]): a later [`TensorStore::get`] still reads the same
    /// bytes, faulting them back in from the page cache or the file. Pages within
    /// [`FAULT_AROUND_MARGIN`] on either side go too (they come back the same way). An unknown name
    /// is ignored.
    pub fn release(&self, name: &str) {
        if let Some((fi, info)) = self.tensors.get(name) {
            let (a, b) = info.data_offsets;
            self.release_span(*fi, a..b);
        }
    }

    /// [`TensorStore::release`] of bytes `span` of file `fi`'s tensor data (offsets from the data
    /// start), widened by [`FAULT_AROUND_MARGIN`] and clipped to the file.
    fn release_span(&self, fi: usize, span: std::ops::Range<usize>) {
        let (path, map, data_start) = &self.files[fi];
        let start = (data_start + span.start).saturating_sub(FAULT_AROUND_MARGIN);
        let end = (data_start + span.end).saturating_add(FAULT_AROUND_MARGIN).min(map.len());
        crate::sys::drop_mapped_pages(path, map, start..end);
    }

    /// Hands the bytes of tensor `name` to `f` in pieces of [`RELEASE_CHUNK`] (4 MiB: a multiple of
    /// every element size), dropping each piece's mapped pages after `f` copied it, so copying a
    /// tensor out never holds more than a few MiB of it mapped beside the copy.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] as [`TensorStore::get`].
    pub fn read_released(&self, name: &str, mut f: impl FnMut(&[u8])) -> Result<()> {
        let t = self.get(name)?;
        let fi = self.tensors[name].0;
        for (i, piece) in t.bytes.chunks(RELEASE_CHUNK).enumerate() {
            f(piece);
            let a = self.tensors[name].1.data_offsets.0 + i * RELEASE_CHUNK;
            self.release_span(fi, a..a + piece.len());
        }
        Ok(())
    }

    /// Drops every mapped page of every file from the resident set ([`TensorStore::release`] of
    /// everything): after the dense part was copied out, the mapping costs no RSS until a tensor is
    /// read again (the safetensors fallback reading an expert).
    pub fn release_all(&self) {
        for (path, map, _) in &self.files {
            crate::sys::drop_mapped_pages(path, map, 0..map.len());
        }
    }
}

fn files_path(files: &[(PathBuf, Mmap, usize)], i: usize, dir: &Path, names: &[String]) -> PathBuf {
    files.get(i).map(|f| f.0.clone()).unwrap_or_else(|| dir.join(&names[i]))
}

impl TensorRef<'_> {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Fails unless the shape is exactly `expected`.
    ///
    /// # Errors
    /// [`Error::TensorShape`] naming the file and tensor.
    pub fn expect_shape(&self, expected: &[usize]) -> Result<&Self> {
        if self.shape != expected {
            return Err(Error::TensorShape {
                path: self.path.into(),
                name: self.name.into(),
                expected: expected.into(),
                found: self.shape.into(),
            });
        }
        Ok(self)
    }

    /// A dtype error naming this tensor, for callers that accept other dtypes than [`TensorRef::to_f32`].
    pub fn dtype_error(&self, expected: &str) -> Error {
        Error::TensorDtype {
            path: self.path.into(),
            name: self.name.into(),
            expected: expected.into(),
            found: format!("{:?}", self.dtype),
        }
    }

    /// The values widened to f32 (from F32, BF16 or F16; exact).
    ///
    /// # Errors
    /// [`Error::TensorDtype`] for any other dtype.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let b = self.bytes;
        Ok(match self.dtype {
            Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::BF16 => b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::F16 => b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            _ => return Err(self.dtype_error("F32, BF16 or F16")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture;

    /// A one-file model directory holding `bytes` as model.safetensors.
    fn dir_with(bytes: &[u8]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("model.safetensors"), bytes).unwrap();
        d
    }

    /// A safetensors file of tensors `a` (F32 [4, 2], 32 bytes) and `b` (BF16 [8], 16 bytes).
    fn two_tensors() -> Vec<u8> {
        use safetensors::tensor::TensorView;
        let (a, b) = (vec![0u8; 32], vec![0u8; 16]);
        let views = [
            ("a", TensorView::new(Dtype::F32, vec![4, 2], &a).unwrap()),
            ("b", TensorView::new(Dtype::BF16, vec![8], &b).unwrap()),
        ];
        safetensors::serialize(views, None).unwrap()
    }

    #[test]
    fn a_truncated_file_names_the_tensor_and_both_byte_counts() {
        let full = two_tensors();
        let cut = &full[..full.len() - 10];
        let e = TensorStore::open(dir_with(cut).path()).err().unwrap().to_string();
        let want = format!("truncated: {} of {} bytes", cut.len(), full.len());
        assert!(e.contains(&want) && e.contains("`b`") && e.contains("model.safetensors"), "{e}");
    }

    #[test]
    fn a_tensor_whose_span_disagrees_with_its_shape_is_named_with_expected_and_found_bytes() {
        let header = br#"{"a":{"dtype":"F32","shape":[4,2],"data_offsets":[0,24]}}"#;
        let mut f = (header.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(header);
        f.extend_from_slice(&[0; 24]);
        let e = TensorStore::open(dir_with(&f).path()).err().unwrap().to_string();
        assert!(e.contains("tensor `a`") && e.contains("needs 32 bytes") && e.contains("give 24"), "{e}");
    }

    #[test]
    fn follows_weight_map_across_shards() {
        let s = TensorStore::open(&fixture("qwen3_moe")).unwrap();
        let t = s.get("model.layers.0.mlp.experts.3.down_proj.weight").unwrap();
        assert_eq!(t.shape, &[64, 64]);
        assert_eq!(t.to_f32().unwrap().len(), 64 * 64);
        let e = s.get("model.layers.9.mlp.gate.weight").unwrap_err().to_string();
        assert!(e.contains("model.layers.9.mlp.gate.weight") && e.contains("model-00001-of-00002.safetensors"), "{e}");
        let e = t.expect_shape(&[64, 32]).unwrap_err().to_string();
        assert!(e.contains("expected [64, 32]"), "{e}");
    }

    #[test]
    fn scans_picchio_c_directory_and_single_file() {
        let s = TensorStore::open(&fixture("picchio_c/qwen3_moe")).unwrap();
        assert_eq!(s.get("lm_head.weight").unwrap().dtype, Dtype::I8);
        assert_eq!(s.files().count(), 2);
        let s = TensorStore::open(&fixture("qwen3_moe_wide")).unwrap();
        assert!(s.contains("model.layers.1.mlp.gate_proj.weight"));
        assert!(!s.contains("logits"), "reference.safetensors must not be read as weights");
    }

    #[test]
    fn truncated_and_missing_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let src = std::fs::read(fixture("qwen3_moe_wide/model.safetensors")).unwrap();
        std::fs::write(dir.path().join("model.safetensors"), &src[..src.len() / 2]).unwrap();
        let e = TensorStore::open(dir.path()).err().unwrap().to_string();
        assert!(e.contains("model.safetensors: not a valid safetensors file"), "{e}");
        std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
        let e = TensorStore::open(dir.path()).err().unwrap().to_string();
        assert!(e.contains("no model.safetensors.index.json"), "{e}");
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            r#"{"weight_map": {"a": "model-00001-of-00002.safetensors"}}"#,
        )
        .unwrap();
        let e = TensorStore::open(dir.path()).err().unwrap().to_string();
        assert!(e.contains("model-00001-of-00002.safetensors: open"), "{e}");
    }
}
