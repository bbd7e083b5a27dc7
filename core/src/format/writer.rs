//! Writing an image: payloads are appended in (layer, expert) order into a temporary file beside the
//! destination, then the index and the superblock are written, the file is synced and renamed over the
//! destination, so a reader never sees a half-written image.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::{
    encode_index, index_sha256, payload_hash, round_up, ExpertLoc, Superblock, BLOCK_SIZE, EXPERT_LOC_SIZE, VERSION,
};
use crate::error::{Error, Result};
use crate::loader::StoreDims;

/// Writes a `.picchioflat` v2 image atomically (temporary file + rename).
///
/// ```no_run
/// # use picchio_core::{FlatWriter, loader::StoreDims};
/// # fn f(payloads: Vec<Vec<u8>>) -> picchio_core::Result<()> {
/// let dims = StoreDims { hidden: 64, n_layers: 3, n_experts: 16, topk: 4, moe_inter: 128 };
/// let mut w = FlatWriter::create("experts.picchioflat".as_ref(), dims, 48)?;
/// for p in &payloads { w.push(p)?; }
/// w.finish()?;
/// # Ok(()) }
/// ```
pub struct FlatWriter {
    path: PathBuf,
    tmp_path: PathBuf,
    out: Option<BufWriter<File>>,
    dims: StoreDims,
    n_entries: u32,
    index_offset: u64,
    data_offset: u64,
    next_offset: u64,
    entries: Vec<ExpertLoc>,
    renamed: bool,
}

impl FlatWriter {
    /// Starts an image at `path` holding `n_entries` experts (n_layers × n_experts, or fewer for a
    /// prefix store). The bytes go to `<path>.tmp-<pid>` until [`FlatWriter::finish`].
    ///
    /// # Errors
    /// [`Error::WriterMisuse`] if `n_entries` exceeds n_layers × n_experts; [`Error::Write`] if the
    /// temporary file cannot be created.
    pub fn create(path: &Path, dims: StoreDims, n_entries: u32) -> Result<Self> {
        if u64::from(n_entries) > u64::from(dims.n_layers) * u64::from(dims.n_experts) {
            return Err(Error::WriterMisuse {
                path: path.into(),
                message: format!("{n_entries} entries exceed n_layers × n_experts"),
            });
        }
        let mut name = path.file_name().unwrap_or_default().to_os_string();
        name.push(format!(".tmp-{}", std::process::id()));
        let tmp_path = path.with_file_name(name);
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp_path)
            .map_err(|cause| Error::Write { path: tmp_path.clone(), what: "temporary image", cause })?;
        let bs = u64::from(BLOCK_SIZE);
        let index_offset = bs;
        let data_offset = round_up(index_offset + u64::from(n_entries) * EXPERT_LOC_SIZE as u64, bs);
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.seek(SeekFrom::Start(data_offset)).map_err(|cause| Error::Write {
            path: tmp_path.clone(),
            what: "seek to data",
            cause,
        })?;
        Ok(FlatWriter {
            path: path.into(),
            tmp_path,
            out: Some(out),
            dims,
            n_entries,
            index_offset,
            data_offset,
            next_offset: data_offset,
            entries: Vec::with_capacity(n_entries as usize),
            renamed: false,
        })
    }

    /// Appends the next expert's payload (in (layer, expert) order) and returns its index entry.
    ///
    /// # Errors
    /// [`Error::WriterMisuse`] past `n_entries` or for an empty payload; [`Error::Write`] on I/O failure.
    pub fn push(&mut self, payload: &[u8]) -> Result<ExpertLoc> {
        if self.entries.len() >= self.n_entries as usize || payload.is_empty() || payload.len() > u32::MAX as usize {
            return Err(Error::WriterMisuse {
                path: self.path.clone(),
                message: format!(
                    "payload {} of {} has {} bytes (must be 1..=u32::MAX, and at most n_entries payloads)",
                    self.entries.len(),
                    self.n_entries,
                    payload.len()
                ),
            });
        }
        let bs = u64::from(BLOCK_SIZE);
        let padded = round_up(payload.len() as u64, bs);
        let loc = ExpertLoc {
            offset: self.next_offset,
            len: payload.len() as u32,
            padded_len: padded as u32,
            hash: payload_hash(payload),
        };
        let out = self.out.as_mut().expect("open until finish");
        let zeros = [0u8; BLOCK_SIZE as usize];
        out.write_all(payload)
            .and_then(|_| out.write_all(&zeros[..(padded - payload.len() as u64) as usize]))
            .map_err(|cause| Error::Write { path: self.tmp_path.clone(), what: "payload", cause })?;
        self.next_offset += padded;
        self.entries.push(loc);
        Ok(loc)
    }

    /// Writes the index and the superblock, syncs, and renames the image into place.
    ///
    /// # Errors
    /// [`Error::WriterMisuse`] if fewer than `n_entries` payloads were pushed; [`Error::Write`] on I/O.
    pub fn finish(mut self) -> Result<Superblock> {
        if self.entries.len() != self.n_entries as usize {
            return Err(Error::WriterMisuse {
                path: self.path.clone(),
                message: format!("{} payloads pushed, {} declared", self.entries.len(), self.n_entries),
            });
        }
        let index = encode_index(&self.entries);
        let sb = Superblock {
            version: VERSION,
            block_size: BLOCK_SIZE,
            hidden: self.dims.hidden,
            n_layers: self.dims.n_layers,
            n_experts: self.dims.n_experts,
            topk: self.dims.topk,
            moe_inter: self.dims.moe_inter,
            n_entries: self.n_entries,
            index_offset: self.index_offset,
            index_len: index.len() as u64,
            data_offset: self.data_offset,
            index_sha256: index_sha256(&index),
        };
        let tmp = &self.tmp_path;
        let werr = |what: &'static str| move |cause| Error::Write { path: tmp.clone(), what, cause };
        let mut out = self.out.take().expect("open until finish");
        out.seek(SeekFrom::Start(self.index_offset)).map_err(werr("index"))?;
        out.write_all(&index).map_err(werr("index"))?;
        out.seek(SeekFrom::Start(0)).map_err(werr("superblock"))?;
        out.write_all(&sb.encode()).map_err(werr("superblock"))?;
        let file = out.into_inner().map_err(|e| werr("flush")(e.into_error()))?;
        // The file ends at the last padded payload (or at the data offset for an empty store).
        file.set_len(self.next_offset).map_err(werr("set length"))?;
        file.sync_all().map_err(werr("sync"))?;
        drop(file);
        std::fs::rename(&self.tmp_path, &self.path).map_err(|cause| Error::Write {
            path: self.path.clone(),
            what: "rename into place",
            cause,
        })?;
        self.renamed = true;
        Ok(sb)
    }
}

impl Drop for FlatWriter {
    fn drop(&mut self) {
        // An unfinished image is never left behind under any name.
        if !self.renamed {
            drop(self.out.take());
            let _ = std::fs::remove_file(&self.tmp_path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::decode_index;

    #[test]
    fn writes_aligned_payloads_and_consistent_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.picchioflat");
        let dims = StoreDims { hidden: 64, n_layers: 1, n_experts: 2, topk: 1, moe_inter: 128 };
        let mut w = FlatWriter::create(&path, dims, 2).unwrap();
        w.push(&[1u8; 5000]).unwrap();
        w.push(&[2u8; 4096]).unwrap();
        let sb = w.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len(), 8192 + 8192 + 4096);
        assert_eq!(Superblock::decode(&bytes, "t", bytes.len() as u64).unwrap(), sb);
        let idx = decode_index(&bytes[4096..4096 + 48]);
        assert_eq!(idx[0], ExpertLoc { offset: 8192, len: 5000, padded_len: 8192, hash: payload_hash(&[1u8; 5000]) });
        assert_eq!(idx[1].offset, 16384);
        assert_eq!(index_sha256(&bytes[4096..4096 + 48]), sb.index_sha256);
        assert!(bytes[8192 + 5000..16384].iter().all(|&b| b == 0));
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn dropped_writer_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.picchioflat");
        let dims = StoreDims { hidden: 64, n_layers: 1, n_experts: 2, topk: 1, moe_inter: 128 };
        let mut w = FlatWriter::create(&path, dims, 2).unwrap();
        w.push(&[1u8; 10]).unwrap();
        let e = w.finish().unwrap_err().to_string();
        assert!(e.contains("1 payloads pushed, 2 declared"), "{e}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
