//! Writing an image: payloads are appended in (layer, expert) order, then the index, then — after a
//! barrier — the superblock, through an [`ImageSink`].
//!
//! * [`FileSink`] (the default, [`FlatWriter::create`]): a temporary file beside the destination,
//!   synced and renamed over it, so a reader never sees a half-written image.
//! * A block device has no rename: its sink (`picchio_blockdev::raw::DeviceSink`) destroys the old
//!   superblock before writing anything else, and the writer writes the new superblock only after a
//!   barrier has made the payloads and the index durable. An interrupted write therefore leaves a
//!   device without a valid superblock, never a valid-looking image with stale or missing payloads.

use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::output::OutputFile;

use super::{
    encode_index, encode_layer_table, index_sha256, layer_table_sha256, payload_hash, round_up, BundleHeader,
    ExpertLoc, GgufSource, LayerDesc, ModelRecord, Superblock, BLOCK_SIZE, EXPERT_LOC_SIZE,
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

    /// Writes out what a buffering sink still holds of the runs written so far, and waits for it
    /// (the writer calls it after the last payload, so a failed payload write is told as one, not as
    /// the next run's write that would have flushed it). Default: nothing (an unbuffered sink).
    ///
    /// # Errors
    /// The I/O error (it becomes [`Error::Write`]).
    fn end_run(&mut self) -> std::io::Result<()> {
        Ok(())
    }

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
    fn end_run(&mut self) -> std::io::Result<()> {
        (**self).end_run()
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

/// The longest payload an image can hold, in bytes: the index entry's `padded_len` is a u32 and
/// must be the payload length rounded up to [`BLOCK_SIZE`], so 2^32 − 4096 = 4,294,963,200 bytes
/// (docs/format.md, "Limits"). `len` (also a u32) is never the binding limit.
pub const MAX_PAYLOAD_LEN: u64 = (u32::MAX as u64 / BLOCK_SIZE as u64) * BLOCK_SIZE as u64;

/// Names entry `i` of an image with `n_experts` experts per layer: `entry 7 (layer 0, expert 7)`.
fn entry_name(i: u64, n_experts: u32) -> String {
    let e = u64::from(n_experts.max(1));
    format!("entry {i} (layer {}, expert {})", i / e, i % e)
}

/// Checks the payload of entry `entry` against the format's limits and returns its padded length
/// (a multiple of [`BLOCK_SIZE`], at most [`MAX_PAYLOAD_LEN`]).
///
/// # Errors
/// [`Error::FormatLimit`] naming `dest`, the entry and the `padded_len` limit for a payload over
/// [`MAX_PAYLOAD_LEN`]; [`Error::WriterMisuse`] for an empty payload.
pub fn check_payload_len(dest: &Path, dims: StoreDims, entry: u64, len: u64) -> Result<u64> {
    if len == 0 {
        return Err(Error::WriterMisuse {
            path: dest.into(),
            message: format!("{}: an empty payload (a payload has at least 1 byte)", entry_name(entry, dims.n_experts)),
        });
    }
    if len > MAX_PAYLOAD_LEN {
        return Err(Error::FormatLimit(Box::new(crate::error::FormatLimit {
            path: dest.into(),
            entry: entry_name(entry, dims.n_experts),
            what: "the payload",
            value: len.into(),
            limit: MAX_PAYLOAD_LEN,
            field: "the index entry's u32 padded_len, a multiple of 4096",
        })));
    }
    Ok(round_up(len, u64::from(BLOCK_SIZE)))
}

/// The size in bytes of an image of `n_entries` entries whose payloads have the lengths
/// `payload_lens` yields (in entry order; it may yield fewer, the last length then stands for the
/// rest), checked against every limit of the format before a byte is written: each payload as
/// [`check_payload_len`], `n_entries <= n_layers × n_experts`, and the image end within the u64
/// offsets. Computed with checked arithmetic throughout.
///
/// # Errors
/// [`Error::FormatLimit`] naming the entry (or `the image`) and the limit; [`Error::WriterMisuse`] for
/// too many entries or an empty payload.
pub fn plan_image_len(
    dest: &Path,
    dims: StoreDims,
    n_entries: u32,
    payload_lens: impl IntoIterator<Item = u64>,
) -> Result<u64> {
    check_entries(dest, dims, n_entries)?;
    let mut total = u128::from(data_offset(n_entries));
    let mut lens = payload_lens.into_iter();
    let mut last = None;
    let mut i = 0u64;
    while i < u64::from(n_entries) {
        match lens.next() {
            Some(len) => {
                total += u128::from(check_payload_len(dest, dims, i, len)?);
                last = Some(len);
                i += 1;
            }
            None => {
                let Some(len) = last else { break };
                // The rest share the last length: one multiplication, not one step per entry.
                let padded = check_payload_len(dest, dims, i, len)?;
                total += u128::from(padded) * u128::from(u64::from(n_entries) - i);
                break;
            }
        }
    }
    if total > u128::from(u64::MAX) {
        return Err(Error::FormatLimit(Box::new(crate::error::FormatLimit {
            path: dest.into(),
            entry: format!("the image of {n_entries} entries"),
            what: "the image",
            value: total,
            limit: u64::MAX,
            field: "the u64 offsets of the superblock and index",
        })));
    }
    Ok(total as u64)
}

/// [`ImageSink`] for a file: a temporary file `<path>.tmp-<pid>` beside the destination, synced and
/// renamed over `path` by [`ImageSink::commit`], and removed if the sink is dropped uncommitted.
pub struct FileSink {
    path: PathBuf,
    tmp_path: PathBuf,
    /// The temporary file under its buffer, counted for the writers' stop point.
    out: Option<OutputFile>,
    /// Where the buffered writer's cursor is.
    pos: u64,
    renamed: bool,
}

impl FileSink {
    /// Creates (truncating) the temporary file for an image at `path` ([`crate::output::create`]:
    /// mode `0o666` under the umask).
    ///
    /// # Errors
    /// [`Error::Write`] if the temporary file cannot be created.
    pub fn create(path: &Path) -> Result<Self> {
        let mut name = path.file_name().unwrap_or_default().to_os_string();
        name.push(format!(".tmp-{}", std::process::id()));
        let tmp_path = path.with_file_name(name);
        let out = OutputFile::create(&tmp_path, 1 << 20).map_err(|cause| Error::Write {
            path: tmp_path.clone(),
            what: "temporary image",
            cause,
        })?;
        Ok(FileSink { path: path.into(), tmp_path, out: Some(out), pos: 0, renamed: false })
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

    fn end_run(&mut self) -> std::io::Result<()> {
        match self.out.as_mut() {
            Some(out) => out.flush(),
            None => Err(std::io::Error::other("image already committed")),
        }
    }

    fn commit(&mut self, len: u64) -> Result<()> {
        let tmp = &self.tmp_path;
        let werr = |what: &'static str| move |cause| Error::Write { path: tmp.clone(), what, cause };
        let out = self.out.take().ok_or_else(|| werr("flush")(std::io::Error::other("image already committed")))?;
        let file = out.into_file().map_err(werr("flush"))?;
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
    model: Option<ModelRecord>,
    /// A version 3 bundle: its source and its encoded layer table.
    bundle: Option<(GgufSource, Vec<u8>)>,
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

    /// Writes a whole image at `path` from payloads held in memory, in (layer, expert) order:
    /// [`FlatWriter::create`] for `payloads.len()` entries, [`FlatWriter::push`] each payload, then
    /// [`FlatWriter::finish`].
    ///
    /// # Errors
    /// As those three.
    pub fn write<P: AsRef<[u8]>>(path: &Path, dims: StoreDims, payloads: &[P]) -> Result<Superblock> {
        let mut w = FlatWriter::create(path, dims, u32::try_from(payloads.len()).unwrap_or(u32::MAX))?;
        for p in payloads {
            w.push(p.as_ref())?;
        }
        w.finish()
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
            model: None,
            bundle: None,
        })
    }

    /// Makes the image a version 3 bundle of the GGUF `source` (docs/format.md, "version 3"):
    /// `layers` (one descriptor per decoder layer, `dims.n_layers` of them) go into the layer table
    /// after the index, and the payloads start after it ([`super::bundle_data_offset`]). Call it
    /// before the first [`FlatWriter::push`]; the image then has no model record.
    ///
    /// # Errors
    /// [`Error::WriterMisuse`] after a payload was pushed, for a model record already set, for a
    /// layer count other than `dims.n_layers`, or a source path that does not fit
    /// ([`BundleHeader::check_source`]).
    pub fn set_bundle(&mut self, source: GgufSource, layers: &[LayerDesc]) -> Result<()> {
        let misuse = |message: String| Error::WriterMisuse { path: self.sink.dest().into(), message };
        if !self.entries.is_empty() || self.model.is_some() {
            return Err(misuse("set_bundle after a payload or a model record".into()));
        }
        if layers.len() != self.dims.n_layers as usize {
            return Err(misuse(format!(
                "{} layer descriptors for a model of {} layers",
                layers.len(),
                self.dims.n_layers
            )));
        }
        BundleHeader::check_source(&source, self.sink.dest())?;
        self.data_offset = super::bundle_data_offset(self.n_entries, self.dims.n_layers);
        self.next_offset = self.data_offset;
        self.bundle = Some((source, encode_layer_table(layers)));
        Ok(())
    }

    /// Records `record` (the converted model directory the image is for) in the superblock's
    /// reserved bytes ([`ModelRecord`]).
    ///
    /// # Errors
    /// [`Error::WriterMisuse`] when the path is not UTF-8 or too long ([`ModelRecord::check`]).
    pub fn set_model_record(&mut self, record: ModelRecord) -> Result<()> {
        record.check(self.sink.dest())?;
        if self.bundle.is_some() {
            return Err(Error::WriterMisuse {
                path: self.sink.dest().into(),
                message: "a version 3 bundle records its GGUF, not a model directory".into(),
            });
        }
        self.model = Some(record);
        Ok(())
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
    /// [`Error::WriterMisuse`] past `n_entries` or for an empty payload; [`Error::FormatLimit`] for a
    /// payload over [`MAX_PAYLOAD_LEN`] or one that would end past 2^64; [`Error::Write`] on I/O failure.
    pub fn push(&mut self, payload: &[u8]) -> Result<ExpertLoc> {
        if self.entries.len() >= self.n_entries as usize {
            return Err(Error::WriterMisuse {
                path: self.sink.dest().into(),
                message: format!("payload {} pushed, but only {} entries declared", self.entries.len(), self.n_entries),
            });
        }
        let padded = check_payload_len(self.sink.dest(), self.dims, self.entries.len() as u64, payload.len() as u64)?;
        let end = self.next_offset.checked_add(padded).ok_or_else(|| {
            Error::FormatLimit(Box::new(crate::error::FormatLimit {
                path: self.sink.dest().into(),
                entry: entry_name(self.entries.len() as u64, self.dims.n_experts),
                what: "the image",
                value: u128::from(self.next_offset) + u128::from(padded),
                limit: u64::MAX,
                field: "the index entry's u64 offset",
            }))
        })?;
        let loc = ExpertLoc {
            offset: self.next_offset,
            len: payload.len() as u32,
            padded_len: padded as u32,
            hash: payload_hash(payload),
        };
        let zeros = [0u8; BLOCK_SIZE as usize];
        let pad = &zeros[..(padded - payload.len() as u64) as usize];
        let payload_end = loc.offset + payload.len() as u64;
        let result = self.sink.write_at(loc.offset, payload).and_then(|()| match pad.is_empty() {
            true => Ok(()),
            false => self.sink.write_at(payload_end, pad),
        });
        result.map_err(self.werr("payload"))?;
        self.next_offset = end;
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
        let sha = index_sha256(&index);
        let sb = match self.bundle.take() {
            None => Superblock::layout(self.dims, self.n_entries, sha, self.model.take()),
            Some((source, table)) => {
                let header =
                    BundleHeader { source, layers_offset: 0, layers_len: 0, layers_sha256: layer_table_sha256(&table) };
                let sb = Superblock::layout_bundle(self.dims, self.n_entries, sha, header);
                // Index, zeros to the table, the table: one run from index_offset.
                let h = sb.bundle.as_ref().expect("set");
                index.resize((h.layers_offset - self.index_offset) as usize, 0);
                index.extend_from_slice(&table);
                sb
            }
        };
        debug_assert_eq!(
            (sb.index_offset, sb.index_len, sb.data_offset),
            (self.index_offset, sb.index_len, self.data_offset)
        );
        debug_assert_eq!(sb.index_len, self.entries.len() as u64 * EXPERT_LOC_SIZE as u64);
        // The index region (with a bundle's table) is padded with zeros up to the data, so it is whole blocks.
        index.resize((self.data_offset - self.index_offset) as usize, 0);
        self.sink.end_run().map_err(self.werr("payload"))?;
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
        let sb = FlatWriter::write(&path, dims, &[&[1u8; 5000][..], &[2u8; 4096]]).unwrap();
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
    fn a_bundle_has_its_layer_table_between_index_and_data() {
        use crate::format::{decode_layer_table, GgufSource, LayerDesc, SlabDesc};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf.picchioflat");
        let dims = StoreDims { hidden: 64, n_layers: 2, n_experts: 2, topk: 1, moe_inter: 128 };
        let s = |bytes| SlabDesc { ty: 8, stored: 8, bytes };
        let layers =
            [LayerDesc { slabs: Some([s(100), s(100), s(100)]) }, LayerDesc { slabs: Some([s(100), s(100), s(50)]) }];
        let source = GgufSource { path: "/m/m.gguf".into(), fingerprint: [3; 32] };
        let mut w = FlatWriter::create(&path, dims, 4).unwrap();
        w.set_bundle(source.clone(), &layers).unwrap();
        for len in [300, 300, 250, 250] {
            w.push(&vec![7u8; len]).unwrap();
        }
        let sb = w.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        // superblock, index (4 × 24 B), table (2 × 64 B), 4 one-block payloads
        assert_eq!(bytes.len(), 3 * 4096 + 4 * 4096);
        let back = Superblock::decode(&bytes, "t", bytes.len() as u64).unwrap();
        assert_eq!(back, sb);
        assert_eq!((back.version, back.data_offset, back.model.as_ref()), (3, 12288, None));
        let h = back.bundle.unwrap();
        assert_eq!((h.source, h.layers_offset, h.layers_len), (source, 8192, 128));
        assert_eq!(decode_layer_table(&bytes[8192..8192 + 128]).unwrap(), layers);
        assert_eq!(decode_index(&bytes[4096..4096 + 96])[2].len, 250);
        // Picchio (C) reads the version at 8 and refuses anything but 2.
        assert_eq!(&bytes[8..12], &3u32.to_le_bytes());
        // Only before the first payload.
        let mut w = FlatWriter::create(&path, dims, 4).unwrap();
        w.push(&[1]).unwrap();
        assert!(w.set_bundle(GgufSource { path: "/m".into(), fingerprint: [0; 32] }, &layers).is_err());
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
        assert!(crate::error::chain(&e).to_string().starts_with("mem: writing superblock: "), "{e}");
        let e = FlatWriter::with_sink(Recorder::default(), dims, 2).err().unwrap();
        assert!(e.to_string().contains("2 entries exceed"), "{e}");
    }

    /// A sink that holds every write until [`ImageSink::end_run`] or a non-contiguous write, as the
    /// device and NVMe sinks gather runs, and fails the flush of its first run.
    #[derive(Default)]
    struct FailingRun {
        held: usize,
        next: u64,
    }

    impl ImageSink for FailingRun {
        fn dest(&self) -> &Path {
            Path::new("/dev/held")
        }
        fn write_at(&mut self, offset: u64, bytes: &[u8]) -> std::io::Result<()> {
            if self.held > 0 && offset != self.next {
                return Err(std::io::Error::from_raw_os_error(libc::EIO));
            }
            self.held += bytes.len();
            self.next = offset + bytes.len() as u64;
            Ok(())
        }
        fn end_run(&mut self) -> std::io::Result<()> {
            match self.held {
                0 => Ok(()),
                _ => Err(std::io::Error::from_raw_os_error(libc::EIO)),
            }
        }
        fn commit(&mut self, _: u64) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_buffered_payload_write_that_fails_is_told_as_a_payload_write() {
        // The payloads are one run the sink holds; its failure shows when the writer ends the run
        // after the last payload, not at the index write that follows (which used to flush it and be
        // blamed: "writing index").
        let dims = StoreDims { hidden: 64, n_layers: 1, n_experts: 2, topk: 1, moe_inter: 128 };
        let mut w = FlatWriter::with_sink(FailingRun::default(), dims, 2).unwrap();
        w.push(&[1u8; 4096]).unwrap();
        w.push(&[2u8; 4096]).unwrap();
        let e = w.finish().unwrap_err();
        assert!(matches!(e, Error::Write { what: "payload", .. }), "{e}");
        assert!(crate::error::chain(&e).to_string().starts_with("/dev/held: writing payload: "), "{e}");
    }

    #[test]
    fn oversize_geometry_is_refused_before_writing_naming_entry_and_limit() {
        let dest = Path::new("cx.pf");
        // `synth --arch custom --hidden 65536 --moe-intermediate 65536 --experts 100000
        // --model-layers 1000`: 27·H·I/16 = 7,247,757,312-byte payloads.
        let dims = StoreDims { hidden: 65536, n_layers: 1000, n_experts: 100_000, topk: 8, moe_inter: 131_072 };
        let e = plan_image_len(dest, dims, 100_000_000, [7_247_757_312]).unwrap_err();
        assert!(matches!(&e, Error::FormatLimit(l) if l.what == "the payload" && l.limit == MAX_PAYLOAD_LEN), "{e}");
        let s = e.to_string();
        assert!(s.starts_with("cx.pf: entry 0 (layer 0, expert 0): the payload is 7247757312 bytes"), "{s}");
        assert!(s.contains("4294963200") && s.contains("padded_len"), "{s}");
        // The largest payload is accepted; one byte more is not (its padded_len would not fit a u32).
        let one = StoreDims { n_layers: 1, n_experts: 1, ..dims };
        assert_eq!(plan_image_len(dest, one, 1, [MAX_PAYLOAD_LEN]).unwrap(), 8192 + MAX_PAYLOAD_LEN);
        assert!(plan_image_len(dest, one, 1, [MAX_PAYLOAD_LEN + 1]).is_err());
        // With u32 entries of at most MAX_PAYLOAD_LEN the image end always fits the u64 offsets.
        let big = StoreDims { n_layers: 65536, n_experts: 65536, ..dims };
        let max = plan_image_len(dest, big, u32::MAX, [MAX_PAYLOAD_LEN]).unwrap();
        assert_eq!(u128::from(max), u128::from(data_offset(u32::MAX)) + u128::from(u32::MAX) * 4_294_963_200);
        // The error names the entry whose length is wrong, not the first one.
        let e = plan_image_len(dest, StoreDims { n_experts: 4, ..one }, 3, [4096, 4096, 0]).unwrap_err();
        assert!(e.to_string().contains("entry 2 (layer 0, expert 2): an empty payload"), "{e}");
        // A uniform geometry is sized in one step: data offset plus n × padded payload.
        assert_eq!(plan_image_len(dest, StoreDims { n_experts: 3, ..one }, 3, [5000]).unwrap(), 8192 + 3 * 8192);
    }

    /// A sink that accepts and forgets everything, to push payloads past the format's limits
    /// without storing them.
    struct Discard;

    impl ImageSink for Discard {
        fn dest(&self) -> &Path {
            Path::new("discard")
        }
        fn write_at(&mut self, _: u64, _: &[u8]) -> std::io::Result<()> {
            Ok(())
        }
        fn commit(&mut self, _: u64) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn push_refuses_what_the_index_cannot_record() {
        let dims = StoreDims { hidden: 64, n_layers: 1, n_experts: 2, topk: 1, moe_inter: 128 };
        let mut w = FlatWriter::with_sink(Discard, dims, 2).unwrap();
        let e = w.push(&[]).unwrap_err().to_string();
        assert!(e.contains("entry 0 (layer 0, expert 0): an empty payload"), "{e}");
        // A payload one byte over the limit (4 GiB of zeros, never written: the limit is checked
        // before the sink sees a byte).
        let huge = vec![0u8; MAX_PAYLOAD_LEN as usize + 1];
        let e = w.push(&huge).unwrap_err();
        assert!(matches!(&e, Error::FormatLimit(l) if l.what == "the payload"), "{e}");
        assert!(e.to_string().contains("entry 0 (layer 0, expert 0)"), "{e}");
    }
}
