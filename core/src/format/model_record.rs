//! The model record: which converted model directory an image was written for, kept in the
//! superblock's reserved bytes (docs/format.md, "Model record") so that `picchio --store URI` finds
//! the model of an image on a raw partition or an NVMe namespace, where no file can sit beside it.
//!
//! ```text
//! offset  type      field
//!   96    [u8; 8]   record magic "PCHMODEL" (anything else at 96: no record)
//!  104    u32       record version (1)
//!  108    u32       dir_len: bytes of the directory path (1 ..= 3952)
//!  112    [u8; 32]  SHA-256 of the directory's config.json as it was when the image was written
//!  144    [u8]      the directory's absolute path (UTF-8), then zeros to the end of the block
//! ```
//!
//! Picchio (C) reads only the first 96 bytes of the superblock, so an image with a record still
//! opens there; an image without one (Picchio (C)'s, or older ones of ours) has zeros at 96.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// `"PCHMODEL"`: the first bytes of a model record, at superblock offset 96.
pub const MODEL_RECORD_MAGIC: [u8; 8] = *b"PCHMODEL";
/// The only record version this crate reads and writes.
pub const MODEL_RECORD_VERSION: u32 = 1;

/// Field offsets in the superblock block.
mod off {
    pub const MAGIC: usize = super::super::SUPERBLOCK_ENCODED_LEN;
    pub const VERSION: usize = MAGIC + 8;
    pub const DIR_LEN: usize = MAGIC + 12;
    pub const CONFIG_SHA256: usize = MAGIC + 16;
    pub const DIR: usize = CONFIG_SHA256 + 32;
    const _: () = assert!(MAGIC == 96 && VERSION == 104 && DIR_LEN == 108 && CONFIG_SHA256 == 112 && DIR == 144);
}

/// The longest directory path a record holds, in bytes: the rest of the 4096-byte superblock block.
pub const MODEL_RECORD_MAX_DIR_LEN: usize = super::BLOCK_SIZE as usize - off::DIR;

/// The converted model directory an image was written for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelRecord {
    /// The directory's absolute path when the image was written (UTF-8, at most
    /// [`MODEL_RECORD_MAX_DIR_LEN`] bytes).
    pub dir: PathBuf,
    /// SHA-256 of the directory's config.json then: a directory found at `dir` (or beside the image)
    /// is the model only if its config.json still hashes to this.
    pub config_sha256: [u8; 32],
}

impl ModelRecord {
    /// Checks that the record fits the superblock: a non-empty UTF-8 path of at most
    /// [`MODEL_RECORD_MAX_DIR_LEN`] bytes.
    ///
    /// # Errors
    /// [`Error::WriterMisuse`] naming `dest` (the image) and the path.
    pub fn check(&self, dest: &Path) -> Result<()> {
        let misuse = |message: String| Error::WriterMisuse { path: dest.into(), message };
        let Some(s) = self.dir.to_str() else {
            return Err(misuse(format!("model record: {} is not UTF-8", self.dir.display())));
        };
        if s.is_empty() || s.len() > MODEL_RECORD_MAX_DIR_LEN {
            return Err(misuse(format!(
                "model record: the path {s:?} has {} bytes (1..={MODEL_RECORD_MAX_DIR_LEN} fit in the superblock)",
                s.len()
            )));
        }
        Ok(())
    }

    /// Writes the record into `block`, a superblock block of at least 4096 bytes whose bytes from
    /// 96 on are zero. The record must have passed [`ModelRecord::check`].
    pub(crate) fn encode_into(&self, block: &mut [u8]) {
        let dir = self.dir.to_str().expect("checked: UTF-8").as_bytes();
        block[off::MAGIC..off::MAGIC + 8].copy_from_slice(&MODEL_RECORD_MAGIC);
        block[off::VERSION..off::VERSION + 4].copy_from_slice(&MODEL_RECORD_VERSION.to_le_bytes());
        block[off::DIR_LEN..off::DIR_LEN + 4].copy_from_slice(&(dir.len() as u32).to_le_bytes());
        block[off::CONFIG_SHA256..off::CONFIG_SHA256 + 32].copy_from_slice(&self.config_sha256);
        block[off::DIR..off::DIR + dir.len()].copy_from_slice(dir);
    }

    /// The record in `block` (a superblock read from `source_name`), if any: `None` when the bytes
    /// at 96 are not [`MODEL_RECORD_MAGIC`] (zeros in Picchio (C)'s images), or when `block` is
    /// shorter than a 4096-byte block.
    ///
    /// # Errors
    /// [`Error::BadField`] naming the record field (`model_record.version`, `model_record.dir_len`,
    /// `model_record.dir`) and its offset when the magic is there but the rest is not a record.
    pub fn decode(block: &[u8], source_name: &str) -> Result<Option<ModelRecord>> {
        if block.len() < super::BLOCK_SIZE as usize || block[off::MAGIC..off::MAGIC + 8] != MODEL_RECORD_MAGIC {
            return Ok(None);
        }
        let u32_at = |o: usize| super::le_u32(block, o);
        let bad = super::bad_field(source_name);
        let version = u32_at(off::VERSION);
        if version != MODEL_RECORD_VERSION {
            return Err(bad("model_record.version", off::VERSION, format!("{MODEL_RECORD_VERSION}"), version.into()));
        }
        let len = u32_at(off::DIR_LEN) as usize;
        if len == 0 || len > MODEL_RECORD_MAX_DIR_LEN {
            return Err(bad(
                "model_record.dir_len",
                off::DIR_LEN,
                format!("1..={MODEL_RECORD_MAX_DIR_LEN}"),
                len as u64,
            ));
        }
        let dir = std::str::from_utf8(&block[off::DIR..off::DIR + len]).map_err(|e| {
            let at = off::DIR + e.valid_up_to();
            bad("model_record.dir", off::DIR, format!("a UTF-8 path (the byte at {at:#x} is not)"), block[at].into())
        })?;
        let mut config_sha256 = [0u8; 32];
        config_sha256.copy_from_slice(&block[off::CONFIG_SHA256..off::CONFIG_SHA256 + 32]);
        Ok(Some(ModelRecord { dir: PathBuf::from(dir), config_sha256 }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> ModelRecord {
        ModelRecord { dir: "/models/qwen3-q4".into(), config_sha256: [0xab; 32] }
    }

    #[test]
    fn round_trips_at_the_documented_offsets() {
        let mut b = vec![0u8; 4096];
        record().encode_into(&mut b);
        assert_eq!(&b[96..104], b"PCHMODEL");
        assert_eq!(u32::from_le_bytes(b[104..108].try_into().unwrap()), 1);
        assert_eq!(u32::from_le_bytes(b[108..112].try_into().unwrap()), 16);
        assert_eq!(&b[112..144], &[0xab; 32]);
        assert_eq!(&b[144..160], b"/models/qwen3-q4");
        assert!(b[160..].iter().all(|&x| x == 0));
        assert_eq!(ModelRecord::decode(&b, "img").unwrap(), Some(record()));
    }

    #[test]
    fn zeros_and_foreign_bytes_are_no_record() {
        assert_eq!(ModelRecord::decode(&[0u8; 4096], "img").unwrap(), None);
        let mut b = vec![0u8; 4096];
        b[96..104].copy_from_slice(b"SOMEELSE");
        assert_eq!(ModelRecord::decode(&b, "img").unwrap(), None);
        assert_eq!(ModelRecord::decode(&b[..200], "img").unwrap(), None);
    }

    #[test]
    fn a_damaged_record_names_its_field() {
        let mut b = vec![0u8; 4096];
        record().encode_into(&mut b);
        let mut v = b.clone();
        v[104] = 9;
        let e = ModelRecord::decode(&v, "img").unwrap_err().to_string();
        assert!(e.contains("img") && e.contains("model_record.version") && e.contains("0x68"), "{e}");
        let mut v = b.clone();
        v[108..112].copy_from_slice(&5000u32.to_le_bytes());
        let e = ModelRecord::decode(&v, "img").unwrap_err().to_string();
        assert!(e.contains("model_record.dir_len") && e.contains("5000"), "{e}");
        let mut v = b;
        v[150] = 0xff;
        let e = ModelRecord::decode(&v, "img").unwrap_err().to_string();
        assert!(e.contains("model_record.dir") && e.contains("UTF-8"), "{e}");
    }

    #[test]
    fn check_refuses_what_does_not_fit() {
        let long = ModelRecord { dir: PathBuf::from("/".repeat(MODEL_RECORD_MAX_DIR_LEN + 1)), ..record() };
        assert!(long.check(Path::new("img")).unwrap_err().to_string().contains("3952"));
        assert!(record().check(Path::new("img")).is_ok());
        let max = ModelRecord { dir: PathBuf::from("/".repeat(MODEL_RECORD_MAX_DIR_LEN)), ..record() };
        let mut b = vec![0u8; 4096];
        max.encode_into(&mut b);
        assert_eq!(ModelRecord::decode(&b, "img").unwrap(), Some(max));
    }
}
