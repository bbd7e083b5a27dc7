//! A GGUF model that may be split across files (llama.cpp's `gguf-split`, gguf-py's
//! `split_max_tensors`): `X-00001-of-00003.gguf`, `X-00002-of-00003.gguf`, … each a whole GGUF with
//! `split.no` (from 0), `split.count` and `split.tensors.count` in its metadata; the model's other
//! metadata is in the first. Each tensor lives in exactly one file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::{GgufError, GgufFile, Result, TensorInfo};

/// The key holding the number of files of a split model.
pub const SPLIT_COUNT: &str = "split.count";
/// The key holding a file's index in a split model, from 0.
pub const SPLIT_NO: &str = "split.no";
/// The key holding the number of tensors across all files.
pub const SPLIT_TENSORS_COUNT: &str = "split.tensors.count";

/// The most files a split model may have (`split.count` is a u16).
const MAX_SPLITS: u64 = u16::MAX as u64;

/// A tensor of a [`GgufModel`]: its info and the file it is in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelTensor {
    /// Index of its file in [`GgufModel::files`].
    pub file: usize,
    /// Its info; `info.range` is absolute in that file.
    pub info: TensorInfo,
}

/// A model in one GGUF or in split files.
#[derive(Debug, Clone)]
pub struct GgufModel {
    files: Vec<GgufFile>,
    tensors: Vec<ModelTensor>,
    names: HashMap<String, usize>,
}

/// The paths of every file of a split model from one of its paths (`X-00002-of-00003.gguf` gives
/// `X-00001-of-00003.gguf` … `X-00003-of-00003.gguf`) and the given file's index (from 0), or
/// `None` when the name does not follow llama.cpp's `<prefix>-%05d-of-%05d.gguf`.
pub fn split_paths(path: &Path) -> Option<(Vec<PathBuf>, usize)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (head, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = head.rsplit_once('-')?;
    let digits = |s: &str| s.len() >= 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(count) || !digits(no) || prefix.is_empty() {
        return None;
    }
    let (count, no): (u64, u64) = (count.parse().ok()?, no.parse().ok()?);
    if count == 0 || count > MAX_SPLITS || no == 0 || no > count {
        return None;
    }
    let dir = path.parent().unwrap_or(Path::new(""));
    let paths = (1..=count).map(|i| dir.join(format!("{prefix}-{i:05}-of-{count:05}.gguf"))).collect();
    Some((paths, (no - 1) as usize))
}

impl GgufModel {
    /// Opens the model at `path`: one GGUF, or, when its metadata says `split.count` > 1, every
    /// file of the split (whichever of them `path` names), each checked to carry its own
    /// `split.no` and the same `split.count`, with `split.tensors.count` tensors in all and no name
    /// twice.
    ///
    /// # Errors
    /// Every error of [`GgufFile::open`] for each file; [`GgufError::Split`] for a name not of the
    /// form `<prefix>-%05d-of-%05d.gguf` or one disagreeing with the file's split keys, a sibling
    /// with other split keys, or a tensor count differing from `split.tensors.count`;
    /// [`GgufError::DuplicateTensor`] for a name in two files.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufModel> {
        let path = path.as_ref();
        let given = GgufFile::open(path)?;
        let count = match given.get(SPLIT_COUNT) {
            None => 1,
            Some(_) => given.get_uint(SPLIT_COUNT)?,
        };
        if count <= 1 {
            return GgufModel::from_files(vec![given]);
        }
        let split_err = |p: &Path, message: String| GgufError::Split { path: p.to_owned(), message };
        let no = given.get_uint(SPLIT_NO)?;
        let (paths, index) = split_paths(path).ok_or_else(|| {
            split_err(path, format!("split.count is {count} but the name is not <prefix>-NNNNN-of-{count:05}.gguf"))
        })?;
        if paths.len() as u64 != count || index as u64 != no {
            return Err(split_err(
                path,
                format!(
                    "the name says file {} of {}, its metadata split.no {no} (from 0) of split.count {count}",
                    index + 1,
                    paths.len()
                ),
            ));
        }
        let mut given = Some(given);
        let mut files = Vec::with_capacity(paths.len());
        for (i, p) in paths.iter().enumerate() {
            let f = if i == index { given.take().expect("the given file is taken once") } else { GgufFile::open(p)? };
            let (c, n) = (f.get_uint(SPLIT_COUNT)?, f.get_uint(SPLIT_NO)?);
            if c != count || n != i as u64 {
                return Err(split_err(
                    p,
                    format!("split.no {n} of split.count {c}: expected split.no {i} of split.count {count}"),
                ));
            }
            files.push(f);
        }
        let model = GgufModel::from_files(files)?;
        if let Some(v) = model.files[0].get(SPLIT_TENSORS_COUNT) {
            let want = v.as_u64();
            if want != Some(model.tensors.len() as u64) {
                return Err(split_err(
                    &paths[0],
                    format!("split.tensors.count is {v:?}, the {count} files hold {} tensors", model.tensors.len()),
                ));
            }
        }
        Ok(model)
    }

    /// A model of `files` in order (the first holds the model's metadata).
    fn from_files(files: Vec<GgufFile>) -> Result<GgufModel> {
        let mut tensors = Vec::new();
        let mut names = HashMap::new();
        for (file, f) in files.iter().enumerate() {
            for info in f.tensors() {
                if names.insert(info.name.clone(), tensors.len()).is_some() {
                    return Err(GgufError::DuplicateTensor {
                        path: f.path().to_owned(),
                        tensor: info.name.clone(),
                        offset: f.data_offset() + info.offset,
                    });
                }
                tensors.push(ModelTensor { file, info: info.clone() });
            }
        }
        Ok(GgufModel { files, tensors, names })
    }

    /// The files, in split order (one for an unsplit model).
    pub fn files(&self) -> &[GgufFile] {
        &self.files
    }

    /// The file holding the model's metadata (the first): its typed accessors (`get_u32`, …)
    /// read the model's keys.
    pub fn meta(&self) -> &GgufFile {
        &self.files[0]
    }

    /// Every tensor, file by file in file order.
    pub fn tensors(&self) -> &[ModelTensor] {
        &self.tensors
    }

    /// The tensor named `name`.
    ///
    /// # Errors
    /// [`GgufError::MissingTensor`] naming the tensor and the (first) file.
    pub fn tensor(&self, name: &str) -> Result<&ModelTensor> {
        self.names
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| GgufError::MissingTensor { path: self.files[0].path().to_owned(), tensor: name.to_owned() })
    }

    /// The path of the file holding `t`.
    pub fn path_of(&self, t: &ModelTensor) -> &Path {
        self.files[t.file].path()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::Builder;
    use super::*;

    #[test]
    fn split_names_give_their_siblings() {
        let (paths, i) = split_paths(Path::new("/m/Qwen3-30B-A3B-Q4_K_M-00002-of-00003.gguf")).unwrap();
        assert_eq!(i, 1);
        assert_eq!(
            paths,
            ["00001", "00002", "00003"]
                .map(|n| PathBuf::from(format!("/m/Qwen3-30B-A3B-Q4_K_M-{n}-of-00003.gguf")))
                .to_vec()
        );
        for bad in [
            "m.gguf",
            "m-1-of-2.gguf",
            "m-00003-of-00002.gguf",
            "m-00000-of-00002.gguf",
            "-00001-of-00002.gguf",
            "m-00001-of-00002.bin",
        ] {
            assert_eq!(split_paths(Path::new(bad)), None, "{bad}");
        }
    }

    /// A split file with tensor `name` and the split keys.
    fn shard(no: u16, count: u16, total: i32, name: &str) -> Vec<u8> {
        let mut b = Builder::header(3, 1, 3);
        b.str(SPLIT_NO).u32(2).b.extend_from_slice(&no.to_le_bytes());
        b.str(SPLIT_COUNT).u32(2).b.extend_from_slice(&count.to_le_bytes());
        b.str(SPLIT_TENSORS_COUNT).u32(5).b.extend_from_slice(&total.to_le_bytes());
        b.tensor(name, &[8], 0, 0).data(32, 32);
        b.b
    }

    #[test]
    fn split_files_open_from_any_of_them_and_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = |i: u32| dir.path().join(format!("m-{i:05}-of-00002.gguf"));
        std::fs::write(p(1), shard(0, 2, 2, "a")).unwrap();
        std::fs::write(p(2), shard(1, 2, 2, "b")).unwrap();
        for i in [1, 2] {
            let m = GgufModel::open(p(i)).unwrap();
            assert_eq!(m.files().len(), 2);
            assert_eq!(m.path_of(m.tensor("a").unwrap()), p(1));
            assert_eq!(m.path_of(m.tensor("b").unwrap()), p(2));
            assert_eq!(m.tensor("b").unwrap().info.range, m.files()[1].data_offset()..m.files()[1].data_offset() + 32);
        }
        assert!(matches!(GgufModel::open(p(1)).unwrap().tensor("c"), Err(GgufError::MissingTensor { .. })));
        // A sibling with the wrong split.no.
        std::fs::write(p(2), shard(0, 2, 2, "b")).unwrap();
        let e = GgufModel::open(p(1)).unwrap_err();
        assert!(matches!(&e, GgufError::Split { path, .. } if *path == p(2)), "{e}");
        // A tensor in both.
        std::fs::write(p(2), shard(1, 2, 2, "a")).unwrap();
        assert!(matches!(GgufModel::open(p(1)), Err(GgufError::DuplicateTensor { .. })));
        // Tensor total differs.
        std::fs::write(p(1), shard(0, 2, 3, "a")).unwrap();
        std::fs::write(p(2), shard(1, 2, 3, "b")).unwrap();
        let e = GgufModel::open(p(2)).unwrap_err();
        assert!(e.to_string().contains("the 2 files hold 2 tensors"), "{e}");
        // A missing sibling.
        std::fs::remove_file(p(2)).unwrap();
        assert!(matches!(GgufModel::open(p(1)), Err(GgufError::Io { .. })));
        // A split file renamed.
        let renamed = dir.path().join("m.gguf");
        std::fs::rename(p(1), &renamed).unwrap();
        let e = GgufModel::open(&renamed).unwrap_err();
        assert!(matches!(e, GgufError::Split { .. }), "{e}");
    }
}
