//! Writing an image: payloads are appended in (layer, expert) order, then the index, then — after a
//! barrier — the superblock, through an [`ImageSink`].
//!
//! * [`FileSink`] (the default, [`FlatWriter::create`]): a temporary file beside the destination,
//!   synced and renamed over it, so a reader never sees a half-written image.
//! * A block device has no rename: its sink (`picchio_blockdev::raw::DeviceSink`) destroys the old
//!   superblock before writing anything else, and the writer writes the new superblock only after a
//!   barrier has made the payloads and the index durable. An interrupted write therefore leaves a
//!   device without a valid superblock, never a valid-looking image with stale or missing payloads.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::{
    encode_index, index_sha256, payload_hash, round_up, ExpertLoc, Superblock, BLOCK_SIZE, EXPERT_LOC_SIZE, VERSION,
};
use crate::error::{Error, Result};
use crate::loader::StoreDims;

/// Where a [`FlatWriter`]'s bytes go: a positional byte sink addressed from the image start.
///
/// The writer calls [`write_at`](ImageSink::write_at) in three ascending runs — the payloads from
/// [`data_offset`] on (each padded with zeros to [`BLOCK_SIZE`]), the index at [`BLOCK_SIZE`], and,
/// after one [`barrier`](ImageSink::barrier), the superblock block at 0 — then
/// [`commit`](ImageSink::commit) once. Every run starts and ends at a multiple of [`BLOCK_SIZE`] (the
/// index is padded with zeros up to the data), so a sink that needs block-aligned writes (`O_DIRECT`)
/// can buffer each run and write it in aligned chunks.
pub trait ImageSink {
    /// The image's final name, for messages (the destination file, the device).
    fn dest(&self) -> &Path;

    /// What is being written right now, for write errors (default: [`ImageSink::dest`]; the
    /// temporary file for [`FileSink`]).
    fn written_path(&self) -> &Path {
        self.dest()
    }

    /// Writes `bytes` at byte `offset` from the image start.
    ///
    /// # Errors
    /// The I/O error (it becomes [`Error::Write`] naming [`ImageSink::written_path`]).
    fn write_at(&mut self, offset: u64, bytes: &[u8]) -> std::io::Result<()>;

    /// Makes everything written so far durable before anything written after it. Default: nothing
    /// (a file image becomes visible only by [`ImageSink::commit`]'s rename anyway).
    ///
    /// # Errors
    /// The I/O error (it becomes [`Error::Write`]).
    fn barrier(&mut self) -> std::io::Result<()> {
        Ok(())
    }

    /// The image is complete at `len` bytes: make it durable and visible under [`ImageSink::dest`].
    ///
    /// # Errors
    /// [`Error::Write`] naming what failed.
    fn commit(&mut self, len: u64) -> Result<()>;
}

/// A borrowed sink: the caller keeps it (and what it recorded) after [`FlatWriter::finish`].
impl<S: ImageSink + ?Sized> ImageSink for &mut S {
    fn dest(&self) -> &Path {
        (**self).dest()
    }
    fn written_path(&self) -> &Path {
        (**self).written_path()
    }
    fn write_at(&mut self, offset: u64, bytes: &[u8]) -> std::io::Result<()> {
        (**self).write_at(offset, bytes)
    }
    fn barrier(&mut self) -> std::io::Result<()> {
        (**self).barrier()
    }
    fn commit(&mut self, len: u64) -> Result<()> {
        (**self).commit(len)
    }
}

/// The byte offset of the first payload in an image of `n_entries` entries: the superblock block,
/// then the index, rounded up to [`BLOCK_SIZE`]. With the payloads' padded lengths it gives the
/// image size before anything is written: `data_offset(n) + Σ round_up(len, BLOCK_SIZE)`.
pub fn data_offset(n_entries: u32) -> u64 {
    let bs = u64::from(BLOCK_SIZE);
    round_up(bs + u64::from(n_entries) * EXPERT_LOC_SIZE as u64, bs)
}

/// [`ImageSink`] for a file: a temporary file `<path>.tmp-<pid>` beside the destination, synced and
/// renamed over `path` by [`ImageSink::commit`], and removed if the sink is dropped uncommitted.
pub struct FileSink {
    path: PathBuf,
    tmp_path: PathBuf,
    out: Option<BufWriter<File>>,
    /// Where the buffered writer's cursor is.
    pos: u64,
    renamed: bool,
}

impl FileSink {
    /// Creates (truncating) the temporary file for an image at `path`.
    ///
    /// # Errors
    /// [`Error::Write`] if the temporary file cannot be created.
    pub fn create(path: &Path) -> Result<Self> {
        let mut name = path.file_name().unwrap_or_default().to_os_string();
        name.push(format!(".tmp-{}", std::process::id()));
        let tmp_path = path.with_file_name(name);
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp_path)
            .map_err(|cause| Error::Write { path: tmp_path.clone(), what: "temporary image", cause })?;
        Ok(FileSink {
            path: path.into(),
            tmp_path,
            out: Some(BufWriter::with_capacity(1 << 20, file)),
            pos: 0,
            renamed: false,
        })
    }
}

impl ImageSink for FileSink {
    fn dest(&self) -> &Path {
        &self.path
    }

    fn written_path(&self) -> &Path {
        &self.tmp_path
    }

    fn write_at(&mut self, offset: u64, bytes: &[u8]) -> std::io::Result<()> {
        let out = self.out.as_mut().ok_or_else(|| std::io::Error::other("image already committed"))?;
        if offset != self.pos {
            out.seek(SeekFrom::Start(offset))?;
        }
        out.write_all(bytes)?;
        self.pos = offset + bytes.len() as u64;
        Ok(())
    }

    fn commit(&mut self, len: u64) -> Result<()> {
        let tmp = &self.tmp_path;
        let werr = |what: &'static str| move |cause| Error::Write { path: tmp.clone(), what, cause };
        let out = self.out.take().ok_or_else(|| werr("flush")(std::io::Error::other("image already committed")))?;
        let file = out.into_inner().map_err(|e| werr("flush")(e.into_error()))?;
        // The file ends at the last padded payload (or at the data offset for an empty store).
        file.set_len(len).map_err(werr("set length"))?;
        file.sync_all().map_err(werr("sync"))?;
        drop(file);
        std::fs::rename(&self.tmp_path, &self.path).map_err(|cause| Error::Write {
            path: self.path.clone(),
            what: "rename into place",
            cause,
        })?;
        self.renamed = true;
        Ok(())
    }
}

impl Drop for FileSink {
    fn drop(&mut self) {
        // An unfinished image is never left behind under any name.
        if !self.renamed {
            drop(self.out.take());
            let _ = std::fs::remove_file(&self.tmp_path);
        }
    }
}

/// Writes a `.picchioflat` v2 image through an [`ImageSink`]: atomically into a file (temporary file
/// + rename, [`FlatWriter::create`]) or onto a block device ([`FlatWriter::with_sink`]).
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
pub struct FlatWriter<S: ImageSink = FileSink> {
    sink: S,
    dims: StoreDims,
    n_entries: u32,
    index_offset: u64,
    data_offset: u64,
    next_offset: u64,
    entries: Vec<ExpertLoc>,
}

impl FlatWriter<FileSink> {
    /// Starts an image at `path` holding `n_entries` experts (n_layers × n_experts, or fewer for a
    /// prefix store). The bytes go to `<path>.tmp-<pid>` until [`FlatWriter::finish`].
    ///
    /// # Errors
    /// [`Error::WriterMisuse`] if `n_entries` exceeds n_layers × n_experts; [`Error::Write`] if the
    /// temporary file cannot be created.
    pub fn create(path: &Path, dims: StoreDims, n_entries: u32) -> Result<Self> {
        check_entries(path, dims, n_entries)?;
        FlatWriter::with_sink(FileSink::create(path)?, dims, n_entries)
    }
}

fn check_entries(path: &Path, dims: StoreDims, n_entries: u32) -> Result<()> {
    if u64::from(n_entries) > u64::from(dims.n_layers) * u64::from(dims.n_experts) {
        return Err(Error::WriterMisuse {
            path: path.into(),
            message: format!("{n_entries} entries exceed n_layers × n_experts"),
        });
    }
    Ok(())
}

impl<S: ImageSink> FlatWriter<S> {
    /// Starts an image of `n_entries` experts written to `sink`; see [`FlatWriter::create`].
    ///
    /// # Errors
    /// [`Error::WriterMisuse`] if `n_entries` exceeds n_layers × n_experts.
    pub fn with_sink(sink: S, dims: StoreDims, n_entries: u32) -> Result<Self> {
        check_entries(sink.dest(), dims, n_entries)?;
        let data_offset = data_offset(n_entries);
        Ok(FlatWriter {
            sink,
            dims,
            n_entries,
            index_offset: u64::from(BLOCK_SIZE),
            data_offset,
            next_offset: data_offset,
            entries: Vec::with_capacity(n_entries as usize),
        })
    }

    /// The sink the image is written to.
    pub fn sink(&self) -> &S {
        &self.sink
    }

    fn werr(&self, what: &'static str) -> impl FnOnce(std::io::Error) -> Error {
        let path = self.sink.written_path().to_path_buf();
        move |cause| Error::Write { path, what, cause }
    }

    /// Appends the next expert's payload (in (layer, expert) order) and returns its index entry.
    ///
    /// # Errors
    /// [`Error::WriterMisuse`] past `n_entries` or for an empty payload; [`Error::Write`] on I/O failure.
    pub fn push(&mut self, payload: &[u8]) -> Result<ExpertLoc> {
        if self.entries.len() >= self.n_entries as usize || payload.is_empty() || payload.len() > u32::MAX as usize {
            return Err(Error::WriterMisuse {
                path: self.sink.dest().into(),
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
        let zeros = [0u8; BLOCK_SIZE as usize];
        let pad = &zeros[..(padded - payload.len() as u64) as usize];
        let end = loc.offset + payload.len() as u64;
        let result = self.sink.write_at(loc.offset, payload).and_then(|()| match pad.is_empty() {
            true => Ok(()),
            false => self.sink.write_at(end, pad),
        });
        result.map_err(self.werr("payload"))?;
        self.next_offset += padded;
        self.entries.push(loc);
        Ok(loc)
    }

    /// Writes the index, a barrier, then the superblock, and commits the image (a file is synced and
    /// renamed into place, a device synced).
    ///
    /// # Errors
    /// [`Error::WriterMisuse`] if fewer than `n_entries` payloads were pushed; [`Error::Write`] on I/O.
    pub fn finish(mut self) -> Result<Superblock> {
        if self.entries.len() != self.n_entries as usize {
            return Err(Error::WriterMisuse {
                path: self.sink.dest().into(),
                message: format!("{} payloads pushed, {} declared", self.entries.len(), self.n_entries),
            });
        }
        let mut index = encode_index(&self.entries);
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
        // The index region is padded with zeros up to the data, so it is whole blocks.
        index.resize((self.data_offset - self.index_offset) as usize, 0);
        self.sink.write_at(self.index_offset, &index).map_err(self.werr("index"))?;
        self.sink.barrier().map_err(self.werr("barrier before the superblock"))?;
        self.sink.write_at(0, &sb.encode()).map_err(self.werr("superblock"))?;
        self.sink.commit(self.next_offset)?;
        Ok(sb)
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

    /// An in-memory sink that records the order of writes, barriers and the commit.
    #[derive(Default)]
    struct Recorder {
        bytes: Vec<u8>,
        log: Vec<String>,
        fail_at: Option<u64>,
    }

    impl ImageSink for Recorder {
        fn dest(&self) -> &Path {
            Path::new("mem")
        }
        fn write_at(&mut self, offset: u64, bytes: &[u8]) -> std::io::Result<()> {
            if self.fail_at == Some(offset) {
                return Err(std::io::Error::from_raw_os_error(libc::EIO));
            }
            let end = offset as usize + bytes.len();
            if self.bytes.len() < end {
                self.bytes.resize(end, 0);
            }
            self.bytes[offset as usize..end].copy_from_slice(bytes);
            self.log.push(format!("w{offset}+{}", bytes.len()));
            Ok(())
        }
        fn barrier(&mut self) -> std::io::Result<()> {
            self.log.push("barrier".into());
            Ok(())
        }
        fn commit(&mut self, len: u64) -> Result<()> {
            self.log.push(format!("commit {len}"));
            Ok(())
        }
    }

    #[test]
    fn any_sink_gets_the_file_bytes_with_the_superblock_last_after_a_barrier() {
        let dims = StoreDims { hidden: 64, n_layers: 1, n_experts: 3, topk: 1, moe_inter: 128 };
        let payloads: [&[u8]; 3] = [&[1u8; 5000], &[2u8; 4096], &[3u8; 1]];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.picchioflat");
        let mut f = FlatWriter::create(&path, dims, 3).unwrap();
        let mut rec = Recorder::default();
        let mut m = FlatWriter::with_sink(&mut rec, dims, 3).unwrap();
        for p in payloads {
            assert_eq!(f.push(p).unwrap(), m.push(p).unwrap());
        }
        assert_eq!(m.sink().dest(), Path::new("mem"));
        assert_eq!(f.finish().unwrap(), m.finish().unwrap());
        let want = [
            "w8192+5000",
            "w13192+3192",
            "w16384+4096",
            "w20480+1",
            "w20481+4095",
            "w4096+4096",
            "barrier",
            "w0+4096",
            "commit 24576",
        ];
        assert_eq!(rec.log, want);
        assert_eq!(std::fs::read(&path).unwrap(), rec.bytes);
        assert_eq!(data_offset(3), 8192);
        assert_eq!(data_offset(170), 8192);
        assert_eq!(data_offset(171), 12288);
    }

    #[test]
    fn sink_errors_name_what_was_written() {
        let dims = StoreDims { hidden: 64, n_layers: 1, n_experts: 1, topk: 1, moe_inter: 128 };
        let mut w = FlatWriter::with_sink(Recorder { fail_at: Some(0), ..Default::default() }, dims, 1).unwrap();
        w.push(&[9u8; 100]).unwrap();
        let e = w.finish().unwrap_err();
        assert!(matches!(e, Error::Write { what: "superblock", .. }), "{e}");
        assert!(e.to_string().starts_with("mem: writing superblock: "), "{e}");
        let e = FlatWriter::with_sink(Recorder::default(), dims, 2).err().unwrap();
        assert!(e.to_string().contains("2 entries exceed"), "{e}");
    }
}
