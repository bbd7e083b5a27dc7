//! Windows: `CreateFile` (with `FILE_FLAG_NO_BUFFERING` for direct reads) and positional `ReadFile`
//! through std. No `unsafe` here yet; the IOCP engine will add its own calls beside these.
//!
//! Not yet probed: the sector size (`GetFileInformationByHandleEx(FileStorageInfo)`) and raw disks
//! (`\\.\PhysicalDriveN`, `IOCTL_DISK_GET_LENGTH_INFO`); direct reads assume 4096-byte alignment.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::windows::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use super::{Probe, TargetKind};
use crate::error::{Error, Result};

/// `FILE_FLAG_NO_BUFFERING` (winbase.h): unbuffered reads, sector-aligned offsets, lengths, buffers.
const FILE_FLAG_NO_BUFFERING: u32 = 0x2000_0000;

pub(super) fn open(path: &Path, direct: bool) -> Result<File> {
    let mut opts = OpenOptions::new();
    opts.read(true);
    if direct {
        opts.custom_flags(FILE_FLAG_NO_BUFFERING);
    }
    opts.open(path).map_err(|cause| Error::Open {
        path: path.into(),
        mode: if direct { "direct" } else { "buffered" },
        cause,
    })
}

pub(super) fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    // ReadFile with an OVERLAPPED offset on a synchronous handle: positional, safe to call from
    // several threads (the shared file pointer it also moves is never used by this crate).
    file.seek_read(buf, offset)
}

pub(super) fn probe(file: &File, path: &Path, _direct: bool) -> Result<Probe> {
    let md = file.metadata().map_err(|cause| Error::Stat { path: path.into(), cause })?;
    if !md.is_file() {
        let kind = if md.is_dir() { "directory" } else { "special file" };
        return Err(Error::UnsupportedTarget { path: path.into(), kind });
    }
    Ok(Probe { kind: TargetKind::File, size: md.len(), statx_dio: None, logical_block: None })
}
