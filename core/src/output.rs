//! The one way the writers (`pack`, `synth`, `synth --model-out`, `convert`, `transcode`) create a
//! file of their output: [`create`], [`OutputFile`] (buffered, counted for the stop point, synced by
//! [`OutputFile::finish`]) and [`write`].
//!
//! Permissions: a new output file gets `0o666` masked by the process's umask (`0644` under umask
//! `022`, `0640` under `027`), as `open(2)` with `O_CREAT` gives it and as `cp`, `tar` or `touch`
//! give a new file — never a private `0600` (what `tempfile`, and so
//! `safetensors::serialize_to_file`, creates its files with) and never the mode of a file it was
//! copied from (`std::fs::copy` keeps the source's). Every byte goes through
//! [`crate::stop_point::Counted`] below any buffer, so a crash test's stop point can fall on any byte
//! of the output.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::Path;

use crate::stop_point::Counted;

/// Creates (or truncates) the output file `path` for writing, with mode `0o666 & !umask` on Unix.
///
/// # Errors
/// The I/O error of `open(2)` (the caller names the path).
pub fn create(path: &Path) -> std::io::Result<File> {
    let mut o = OpenOptions::new();
    o.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // The mode `open(2)` is asked for; the kernel applies the umask.
        o.mode(0o666);
    }
    o.open(path)
}

/// An output file being written: [`create`]d, buffered (`capacity` bytes), and counted for
/// [`crate::stop_point`] below the buffer, so the count is of bytes the kernel has.
pub struct OutputFile {
    out: BufWriter<Counted<File>>,
}

impl OutputFile {
    /// Creates `path` ([`create`]) with a buffer of `capacity` bytes.
    ///
    /// # Errors
    /// The I/O error of creating the file.
    pub fn create(path: &Path, capacity: usize) -> std::io::Result<Self> {
        Ok(OutputFile { out: BufWriter::with_capacity(capacity, Counted(create(path)?)) })
    }

    /// Writes out the buffer and returns the file (not synced: for a caller that sets its length first).
    ///
    /// # Errors
    /// The I/O error of the last write.
    pub fn into_file(self) -> std::io::Result<File> {
        Ok(self.out.into_inner().map_err(|e| e.into_error())?.into_inner())
    }

    /// Writes out the buffer and makes the file durable (`fsync`).
    ///
    /// # Errors
    /// The I/O error of the last write or of the sync.
    pub fn finish(self) -> std::io::Result<()> {
        self.into_file()?.sync_all()
    }
}

impl Write for OutputFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.out.write(buf)
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        self.out.write_all(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

impl Seek for OutputFile {
    fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
        self.out.seek(pos)
    }
}

/// Writes `bytes` as the whole output file `path` ([`create`]), counted for the stop point, and
/// makes it durable. For small files (config.json, an index, a copied tokenizer).
///
/// # Errors
/// The I/O error of creating, writing or syncing the file.
pub fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = Counted(create(path)?);
    f.write_all(bytes)?;
    f.into_inner().sync_all()
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn outputs_get_the_umask_mode_and_every_byte_arrives() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        write(&a, b"abc").unwrap();
        let b = dir.path().join("b");
        let mut f = OutputFile::create(&b, 4).unwrap();
        f.write_all(b"0123456789").unwrap();
        f.seek(SeekFrom::Start(2)).unwrap();
        f.write_all(b"xy").unwrap();
        f.finish().unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), b"abc");
        assert_eq!(std::fs::read(&b).unwrap(), b"01xy456789");
        // The process umask, read from /proc (reading it with umask(2) would change it for a moment
        // under the other tests' threads).
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let umask = status.lines().find_map(|l| l.strip_prefix("Umask:")).expect("Linux 4.7+ reports Umask");
        let umask = u32::from_str_radix(umask.trim(), 8).unwrap();
        for p in [&a, &b] {
            let mode = std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o666 & !umask, "{}: mode {mode:o} under umask {umask:03o}", p.display());
        }
        // An existing file is truncated, not appended to.
        write(&a, b"z").unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), b"z");
    }
}
