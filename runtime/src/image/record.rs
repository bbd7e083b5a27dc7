//! Which converted model directory an image belongs to: `picchio pack` and `picchio synth
//! --model-out` record it in the image's superblock ([`picchio_core::format::ModelRecord`]: the
//! directory's absolute path and the SHA-256 of its config.json), and the front ends that are given
//! a store and no model (`picchio --store raw:/dev/X`, `picchio serve --store nvme:BDF`) find the
//! directory with [`find_model_dir`].

use std::path::{Path, PathBuf};

use picchio_core::format::ModelRecord;
use picchio_core::{StoreUri, Superblock, BLOCK_SIZE};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::expert::open::EngineOptions;
use crate::model::dir::ModelDir;

/// Which directory [`crate::image::pack::pack_to`] records in the image.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum RecordModel {
    /// The packed directory itself, by its canonical path (the default).
    #[default]
    Packed,
    /// The directory that will hold the packed one's files at `path` (`synth --model-out` packs a
    /// temporary directory that is renamed into place afterwards); made absolute.
    At(PathBuf),
    /// No record (the reserved bytes stay zero, as Picchio (C) writes them).
    Nothing,
}

/// SHA-256 of `dir/config.json`.
///
/// # Errors
/// [`Error::Io`] naming the file.
pub fn config_sha256(dir: &Path) -> Result<[u8; 32]> {
    let path = dir.join("config.json");
    let bytes = std::fs::read(&path).map_err(Error::io(&path, "read (to record the model in the image)"))?;
    Ok(Sha256::digest(&bytes).into())
}

/// The record naming `model` as `how` says (`None` for [`RecordModel::Nothing`]), with the SHA-256
/// of the config.json bytes `model` was opened with.
///
/// # Errors
/// [`Error::Io`] when the directory (or, for [`RecordModel::At`], its parent) cannot be resolved.
pub fn record_for(model: &ModelDir, how: &RecordModel) -> Result<Option<ModelRecord>> {
    let model_dir = model.path();
    let dir = match how {
        RecordModel::Nothing => return Ok(None),
        RecordModel::Packed => {
            model_dir.canonicalize().map_err(Error::io(model_dir, "resolve (to record the model in the image)"))?
        }
        RecordModel::At(path) => {
            let abs = std::path::absolute(path).map_err(Error::io(path, "make absolute"))?;
            match (abs.parent(), abs.file_name()) {
                (Some(parent), Some(name)) => match parent.canonicalize() {
                    Ok(p) => p.join(name),
                    Err(_) => abs,
                },
                _ => abs,
            }
        }
    };
    Ok(Some(ModelRecord { dir, config_sha256: *model.config_sha256() }))
}

/// The superblock at the start of the image `uri` names (read with one block read; nothing else):
/// the store's name, the decoded superblock and the model record's own decode (`Err` naming the
/// field of a damaged record, which the superblock reads as none).
///
/// # Errors
/// As [`crate::expert::open::open_engine`]; [`Error::Store`] for a read failure or a block that
/// is not a superblock.
pub fn read_superblock(
    uri: &StoreUri,
    io: EngineOptions,
) -> Result<(String, Superblock, picchio_core::Result<Option<ModelRecord>>)> {
    let mut opened = crate::expert::open::open_engine(uri, io)?;
    let (name, base, image_len) = (opened.name.clone(), opened.base, opened.image_len);
    let queue = &mut *opened.queue;
    let bs = BLOCK_SIZE.max(queue.block_size());
    if image_len < u64::from(bs) {
        return Err(picchio_core::loader::short_target(queue, name, base, image_len, bs).into());
    }
    let block = picchio_core::io::read_blocking(queue, base, bs).map_err(|cause| picchio_core::Error::Read {
        source_name: name.clone(),
        what: "the superblock",
        offset: 0,
        cause,
    })?;
    let sb = Superblock::decode(block.as_slice(), &name, image_len)?;
    let record = ModelRecord::decode(block.as_slice(), &name);
    Ok((name, sb, record))
}

/// Where the model directory of a store was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundModel {
    /// The converted model directory.
    pub dir: PathBuf,
    /// How it was found, for the log: `recorded in the image`, `beside the image (moved with it)`, ...
    pub how: &'static str,
}

/// The converted model directory of the image `uri` names, for a front end given no `--model`:
/// 1. the directory the image's model record names, when its config.json still hashes to the
///    recorded SHA-256;
/// 2. for a file image, the directory holding it, when its config.json hashes so (the model
///    directory was moved or copied together with its `experts.picchioflat`);
/// 3. for a file image without a record (Picchio (C)'s, or one packed before records existed), the
///    directory holding it when it has a config.json (where `picchio pack` writes by default; the
///    session checks the image's dimensions against it);
/// 4. for a GGUF's expert bundle (version 3), the GGUF it records, or `X.gguf` beside a file
///    bundle `X.gguf.picchioflat`, when its fingerprint is the recorded one (the path is then the
///    GGUF file, which [`crate::ModelDir::open`] takes as a model).
///
/// # Errors
/// [`Error::RecordedModelMissing`], [`Error::NoModelRecord`] or [`Error::RecordDamaged`] naming the
/// store and what was recorded (the path and the config.json
/// SHA-256 prefix, and why neither candidate matched), that nothing was, or which field of a damaged
/// record is wrong, and suggesting
/// `--model DIR`; the errors of [`read_superblock`]; [`Error::StoreNotAccepted`] for `auto` and
/// `safetensors`, which name no image.
pub fn find_model_dir(uri: &StoreUri, io: EngineOptions) -> Result<FoundModel> {
    if matches!(uri, StoreUri::Auto | StoreUri::Safetensors) {
        return Err(Error::StoreNotAccepted {
            option: "--store",
            uri: uri.to_string(),
            reason: "names no image to find the model in: give --model DIR (or set PICCHIO_MODEL)".into(),
        });
    }
    let (name, superblock, record) = read_superblock(uri, io)?;
    let beside = match uri {
        StoreUri::File(p) | StoreUri::NvmeSim(p) => {
            let p = std::path::absolute(p).unwrap_or_else(|_| p.clone());
            p.parent().map(Path::to_path_buf)
        }
        _ => None,
    };
    if let Some(h) = &superblock.bundle {
        return find_bundle_gguf(uri, &name, h);
    }
    let hash_of = |dir: &Path| -> Option<[u8; 32]> {
        if dir.join("config.json").is_file() {
            config_sha256(dir).ok()
        } else {
            None
        }
    };
    let rec = match record {
        Ok(Some(rec)) => rec,
        // The experts are readable (the superblock reads a damaged record as none); only the way to
        // the model is lost.
        Err(cause) => return Err(Error::RecordDamaged { image: name, cause: Box::new(cause) }),
        Ok(None) => return no_record(&name, beside),
    };
    let short = hex8(&rec.config_sha256);
    let recorded = match hash_of(&rec.dir) {
        Some(h) if h == rec.config_sha256 => return Ok(FoundModel { dir: rec.dir, how: "recorded in the image" }),
        Some(h) => format!("its config.json now has SHA-256 {}…, not the recorded {short}…", hex8(&h)),
        None if rec.dir.is_dir() => "it has no readable config.json".to_string(),
        None => "it does not exist".to_string(),
    };
    let mut why = format!("{} ({recorded})", rec.dir.display());
    if let Some(dir) = beside.filter(|d| *d != rec.dir) {
        match hash_of(&dir) {
            Some(h) if h == rec.config_sha256 => {
                return Ok(FoundModel { dir, how: "the directory holding the image (moved with it)" })
            }
            Some(h) => why.push_str(&format!(
                "; the image's own directory {} has a config.json with SHA-256 {}…",
                dir.display(),
                hex8(&h)
            )),
            None => {}
        }
    }
    Err(Error::RecordedModelMissing { image: name, dir: rec.dir, sha256_8: short, why })
}

/// [`find_model_dir`] for a GGUF's expert bundle (format version 3): the GGUF it records, when
/// that file's fingerprint is still the recorded one; else, for a file bundle `X.gguf.picchioflat`,
/// the GGUF `X.gguf` beside it when its fingerprint is (the two were moved together).
///
/// # Errors
/// [`Error::BundleGgufMissing`] naming the recorded GGUF, the fingerprint prefix and why neither
/// candidate matched.
fn find_bundle_gguf(uri: &StoreUri, name: &str, h: &picchio_core::format::BundleHeader) -> Result<FoundModel> {
    let fingerprint_of = |p: &Path| -> Option<[u8; 32]> {
        crate::model::gguf::is_gguf(p)
            .then(|| crate::model::gguf::GgufWeights::open(p).ok())
            .flatten()
            .map(|g| *g.fingerprint())
    };
    let want = h.source.fingerprint;
    let recorded = &h.source.path;
    let mut why = match fingerprint_of(recorded) {
        Some(f) if f == want => return Ok(FoundModel { dir: recorded.clone(), how: "the GGUF the bundle records" }),
        Some(f) => format!("{} (its fingerprint is now {}…)", recorded.display(), hex8(&f)),
        None => format!("{} (no GGUF there)", recorded.display()),
    };
    if let StoreUri::File(p) | StoreUri::NvmeSim(p) = uri {
        let p = std::path::absolute(p).unwrap_or_else(|_| p.clone());
        let beside = p.to_str().and_then(|s| s.strip_suffix(".picchioflat")).map(PathBuf::from);
        if let Some(g) = beside.filter(|g| g != recorded) {
            match fingerprint_of(&g) {
                Some(f) if f == want => {
                    return Ok(FoundModel { dir: g, how: "the GGUF beside the bundle (moved with it)" })
                }
                Some(f) => why.push_str(&format!("; {} has fingerprint {}…", g.display(), hex8(&f))),
                None => {}
            }
        }
    }
    Err(Error::BundleGgufMissing { image: name.into(), gguf: recorded.clone(), fingerprint_8: hex8(&want), why })
}

/// [`find_model_dir`] for an image without a record: the directory holding a file image (`beside`)
/// when it has a config.json, else an error suggesting `--model`.
fn no_record(name: &str, beside: Option<PathBuf>) -> Result<FoundModel> {
    if let Some(dir) = beside.filter(|d| d.join("config.json").is_file()) {
        return Ok(FoundModel { dir, how: "the directory holding the image (the image records no model)" });
    }
    Err(Error::NoModelRecord { image: name.into() })
}

/// The first 8 bytes of a digest in hex (16 characters).
fn hex8(d: &[u8; 32]) -> String {
    d[..8].iter().map(|b| format!("{b:02x}")).collect()
}
