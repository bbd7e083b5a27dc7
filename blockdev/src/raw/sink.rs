//! The device writer: [`DeviceSink`], an [`ImageSink`] over a block device cleared by a
//! [`WritePermit`].

use std::fmt;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use picchio_core::format::{ImageSink, BLOCK_SIZE};
use picchio_core::AlignedBuf;

use super::WritePermit;
use crate::error::{Error, Result};
use crate::sys::rawdev;

/// Bytes per `O_DIRECT` write of [`DeviceSink`].
const WRITE_CHUNK: usize = 4 << 20;

/// The [`ImageSink`] that writes an image onto a block device cleared by a [`WritePermit`].
///
/// * Opened `O_WRONLY | O_DIRECT | O_EXCL` (never `O_CREAT`), and checked to be the very device the
///   permit was given for (same `major:minor`), so a path that changed since inspection is refused.
/// * The first image block is zeroed and synced at open: the old superblock (ours or a file
///   system's) is gone before anything else is written, so an interrupted pack leaves no
///   valid-looking image. The writer writes the new superblock last, after a
///   [`barrier`](ImageSink::barrier) (an `fsync`).
/// * Each contiguous run is gathered into a 4 MiB aligned buffer and written with `pwrite` in
///   aligned chunks; nothing is written outside `[base, base + image_len)` of the device.
pub struct DeviceSink {
    file: File,
    path: PathBuf,
    base: u64,
    limit: u64,
    align: usize,
    buf: AlignedBuf,
    buf_start: u64,
    buf_len: usize,
    written: u64,
}

impl DeviceSink {
    /// Opens the permit's device for writing and invalidates the old superblock (see the type's
    /// documentation).
    ///
    /// # Errors
    /// [`Error::WriteOpen`] (`EBUSY` when the kernel holds the device: mounted, swap, holder);
    /// [`Error::DeviceChanged`]; [`Error::Write`], [`Error::Sync`] for the first block.
    pub fn open(permit: &WritePermit) -> Result<DeviceSink> {
        let dev = &permit.target().device;
        let path = dev.path.clone();
        let file =
            rawdev::open_write_exclusive(&path).map_err(|cause| Error::WriteOpen { path: path.clone(), cause })?;
        match rawdev::fstat_block(&file) {
            Ok(Ok(found)) if found == dev.devnum => {}
            Ok(Ok(found)) => {
                return Err(Error::DeviceChanged { path, expected: dev.devnum.to_string(), found: found.to_string() })
            }
            Ok(Err(kind)) => {
                return Err(Error::DeviceChanged { path, expected: dev.devnum.to_string(), found: kind.into() })
            }
            Err(cause) => return Err(Error::Stat { path, cause }),
        }
        let mut sink = DeviceSink::new(file, path, permit.target().base().0, permit.image_len(), dev.logical_block)?;
        let first = vec![0u8; BLOCK_SIZE as usize];
        sink.write_at(0, &first).map_err(|e| sink.unwrap_io(e))?;
        sink.barrier().map_err(|e| sink.unwrap_io(e))?;
        Ok(sink)
    }

    /// A sink over an open file: image byte `o` goes to byte `base + o`, up to `limit` image bytes.
    fn new(file: File, path: PathBuf, base: u64, limit: u64, logical_block: u32) -> Result<DeviceSink> {
        let align = (logical_block as usize).max(BLOCK_SIZE as usize);
        let buf = AlignedBuf::new(WRITE_CHUNK, align)?;
        Ok(DeviceSink {
            file,
            path,
            base,
            limit,
            align: logical_block as usize,
            buf,
            buf_start: 0,
            buf_len: 0,
            written: 0,
        })
    }

    /// Bytes written to the device so far.
    pub fn bytes_written(&self) -> u64 {
        self.written
    }

    /// The typed error inside an [`io::Error`] from this sink (or the I/O error as a write error).
    fn unwrap_io(&self, e: io::Error) -> Error {
        if !e.get_ref().is_some_and(|inner| inner.is::<Error>()) {
            return Error::Write { path: self.path.clone(), offset: self.base, len: 0, cause: e };
        }
        match e.into_inner().map(|b| b.downcast::<Error>()) {
            Some(Ok(typed)) => *typed,
            _ => unreachable!("checked to hold an Error just above"),
        }
    }

    /// Writes the gathered run to the device.
    fn flush(&mut self) -> io::Result<()> {
        if self.buf_len == 0 {
            return Ok(());
        }
        let len = self.buf_len;
        let at = self.base + self.buf_start;
        if !len.is_multiple_of(self.align) {
            return Err(Error::UnalignedWrite {
                path: self.path.clone(),
                offset: at,
                len: len as u64,
                align: self.align as u32,
            }
            .into_io());
        }
        let mut done = 0usize;
        while done < len {
            let off = at + done as u64;
            match rawdev::write_at(&self.file, &self.buf.as_slice()[done..len], off) {
                Ok(0) => {
                    let cause = io::Error::new(io::ErrorKind::WriteZero, "the device accepted no bytes");
                    return Err(Error::Write { path: self.path.clone(), offset: off, len: (len - done) as u64, cause }
                        .into_io());
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(cause) => {
                    return Err(Error::Write { path: self.path.clone(), offset: off, len: (len - done) as u64, cause }
                        .into_io())
                }
            }
        }
        self.written += len as u64;
        self.buf_start += len as u64;
        self.buf_len = 0;
        Ok(())
    }
}

impl ImageSink for DeviceSink {
    fn dest(&self) -> &Path {
        &self.path
    }

    fn write_at(&mut self, offset: u64, bytes: &[u8]) -> io::Result<()> {
        let end = offset.saturating_add(bytes.len() as u64);
        if end > self.limit {
            return Err(Error::WritePastImage {
                path: self.path.clone(),
                offset: self.base + offset,
                len: bytes.len() as u64,
                limit: self.limit,
            }
            .into_io());
        }
        if self.buf_len > 0 && offset != self.buf_start + self.buf_len as u64 {
            self.flush()?;
        }
        if self.buf_len == 0 {
            if !offset.is_multiple_of(self.align as u64) {
                return Err(Error::UnalignedWrite {
                    path: self.path.clone(),
                    offset: self.base + offset,
                    len: bytes.len() as u64,
                    align: self.align as u32,
                }
                .into_io());
            }
            self.buf_start = offset;
        }
        let mut rest = bytes;
        while !rest.is_empty() {
            let take = rest.len().min(WRITE_CHUNK - self.buf_len);
            self.buf.as_mut_slice()[self.buf_len..self.buf_len + take].copy_from_slice(&rest[..take]);
            self.buf_len += take;
            rest = &rest[take..];
            if self.buf_len == WRITE_CHUNK {
                self.flush()?;
            }
        }
        Ok(())
    }

    fn end_run(&mut self) -> io::Result<()> {
        self.flush()
    }

    fn barrier(&mut self) -> io::Result<()> {
        self.flush()?;
        rawdev::sync(&self.file).map_err(|cause| Error::Sync { path: self.path.clone(), cause }.into_io())
    }

    fn commit(&mut self, len: u64) -> picchio_core::Result<()> {
        let path = self.path.clone();
        let werr = |what, cause| picchio_core::Error::Write { path: path.clone(), what, cause };
        if len > self.limit {
            let e = Error::WritePastImage { path: path.clone(), offset: self.base, len, limit: self.limit };
            return Err(werr("commit", e.into_io()));
        }
        self.barrier().map_err(|e| werr("final flush and sync", e))
    }
}

impl fmt::Debug for DeviceSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceSink")
            .field("path", &self.path)
            .field("base", &self.base)
            .field("limit", &self.limit)
            .field("written", &self.written)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_sink(len: u64, lbs: u32, base: u64, limit: u64) -> (tempfile::TempDir, PathBuf, DeviceSink) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev");
        std::fs::write(&path, vec![0xEEu8; len as usize]).unwrap();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let sink = DeviceSink::new(file, path.clone(), base, limit, lbs).unwrap();
        (dir, path, sink)
    }

    #[test]
    fn device_sink_gathers_runs_and_writes_only_its_window() {
        let (_d, path, mut s) = file_sink(3 * WRITE_CHUNK as u64, 512, 1024, 2 * WRITE_CHUNK as u64);
        let big: Vec<u8> = (0..WRITE_CHUNK + 1536).map(|i| (i % 251) as u8).collect();
        s.write_at(4096, &big[..1000]).unwrap();
        s.write_at(5096, &big[1000..]).unwrap(); // contiguous: one run crossing a chunk
        s.write_at(0, &[7u8; 512]).unwrap(); // a new run flushes the old one
        s.commit(4096 + big.len() as u64).unwrap();
        assert_eq!(s.bytes_written(), big.len() as u64 + 512);
        let out = std::fs::read(&path).unwrap();
        assert!(out[..1024].iter().all(|&b| b == 0xEE), "before base untouched");
        assert!(out[1024..1536].iter().all(|&b| b == 7));
        assert!(out[1536..1024 + 4096].iter().all(|&b| b == 0xEE));
        assert!(out[1024 + 4096..1024 + 4096 + big.len()] == big[..]);
        assert!(out[1024 + 4096 + big.len()..].iter().all(|&b| b == 0xEE), "after the run untouched");
    }

    #[test]
    fn device_sink_refuses_unaligned_runs_and_bytes_past_the_image() {
        let (_d, _p, mut s) = file_sink(1 << 16, 4096, 0, 1 << 15);
        let e = s.write_at(512, &[0; 4096]).unwrap_err();
        assert!(e.to_string().contains("not a multiple of 4096"), "{e}");
        let e = s.write_at((1 << 15) - 4096, &[0; 8192]).unwrap_err();
        assert!(e.to_string().contains("past the end of the image"), "{e}");
        s.write_at(0, &[1; 100]).unwrap();
        let e = s.commit(100).unwrap_err();
        let e = picchio_core::error::chain(&e).to_string();
        assert!(e.contains("not a multiple of 4096"), "{e}");
    }

    #[test]
    fn device_sink_write_errors_name_device_offset_and_cause() {
        let (_d, path, mut s) = file_sink(1 << 16, 512, 8192, 1 << 15);
        rawdev::fail_write(&path, 8192 + 4096, libc::EIO);
        s.write_at(4096, &[3; 4096]).unwrap();
        let e = s.barrier().unwrap_err();
        let typed = e.get_ref().and_then(|e| e.downcast_ref::<Error>()).expect("typed");
        assert!(matches!(typed, Error::Write { offset: 0x3000, len: 4096, .. }), "{typed}");
        assert!(e.to_string().contains("write of 4096 bytes at offset 0x3000"), "{e}");
        assert_eq!(s.unwrap_io(e).to_string(), typed_string(&path));
    }

    fn typed_string(path: &Path) -> String {
        Error::Write { path: path.into(), offset: 0x3000, len: 4096, cause: io::Error::from_raw_os_error(libc::EIO) }
            .to_string()
    }
}
