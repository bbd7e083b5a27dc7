//! The error type of `picchio-blockdev`: one variant per failing operation, each naming the path, the
//! operation and (for reads) the hex offset and length; the OS error is kept as the `#[source]`.
//!
//! Opening and probing return [`Error`] directly. A read that fails completes with a
//! [`std::io::Error`] (that is what [`picchio_core::Completion`] carries) wrapping one of the read
//! variants, so `err.get_ref()` downcasts back to [`Error`] and `source()` still reaches the OS error.

use std::io;
use std::path::PathBuf;

/// Result alias for `picchio-blockdev`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while opening a target or reading from it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The options ask for something impossible (e.g. zero I/O threads).
    #[error("invalid I/O options: {message}")]
    InvalidOptions {
        /// What is wrong and what would be accepted.
        message: String,
    },
    /// `open(2)` failed.
    #[error("{}: opening for {mode} reads: {cause}", path.display())]
    Open {
        /// The file or device.
        path: PathBuf,
        /// `"direct"` or `"buffered"`.
        mode: &'static str,
        /// The OS error.
        #[source]
        cause: io::Error,
    },
    /// Unbuffered (`O_DIRECT`) reads are not possible on this file system or platform.
    #[error("{}: unbuffered (O_DIRECT) reads are not supported here ({reason}); use --buffered", path.display())]
    DirectUnsupported {
        /// The file or device.
        path: PathBuf,
        /// What showed it (the failing open, or the probe's answer).
        reason: String,
        /// The OS error, when there is one (`EINVAL` from `open`).
        #[source]
        cause: Option<io::Error>,
    },
    /// `fstat(2)` failed.
    #[error("{}: fstat: {cause}", path.display())]
    Stat {
        /// The file or device.
        path: PathBuf,
        /// The OS error.
        #[source]
        cause: io::Error,
    },
    /// An ioctl on a block device failed.
    #[error("{}: ioctl {request}: {cause}", path.display())]
    Ioctl {
        /// The block device.
        path: PathBuf,
        /// The request name (`BLKGETSIZE64`, `BLKSSZGET`).
        request: &'static str,
        /// The OS error.
        #[source]
        cause: io::Error,
    },
    /// The path is neither a regular file nor a block device.
    #[error("{}: is a {kind}; expected a regular file or a block device", path.display())]
    UnsupportedTarget {
        /// The path.
        path: PathBuf,
        /// What it is instead (`directory`, `character device`, ...).
        kind: &'static str,
    },
    /// A worker thread could not be started.
    #[error("{}: spawning I/O worker thread {index}: {cause}", path.display())]
    Spawn {
        /// The target the worker would serve.
        path: PathBuf,
        /// Worker number (0-based).
        index: usize,
        /// The OS error.
        #[source]
        cause: io::Error,
    },
    /// A positional read failed in the kernel.
    #[error("{}: read of {len} bytes at offset {offset:#x}: {cause}", path.display())]
    Read {
        /// The file or device.
        path: PathBuf,
        /// Byte offset of the read.
        offset: u64,
        /// Bytes requested.
        len: u32,
        /// The OS error.
        #[source]
        cause: io::Error,
    },
    /// An unbuffered read whose offset, length or buffer address is not a multiple of the required
    /// alignment (it would fail with `EINVAL` in the kernel; it is refused before the syscall).
    #[error(
        "{}: O_DIRECT read of {len} bytes at offset {offset:#x}: the {what} is not a multiple of {align} bytes",
        path.display()
    )]
    Misaligned {
        /// The file or device.
        path: PathBuf,
        /// Byte offset of the read.
        offset: u64,
        /// Bytes requested.
        len: u32,
        /// `"offset"`, `"length"` or `"buffer address"`.
        what: &'static str,
        /// The alignment required, in bytes.
        align: u32,
    },
    /// A read that starts at or after the end of the target.
    #[error("{}: read of {len} bytes at offset {offset:#x} starts past the end ({size:#x} bytes)", path.display())]
    PastEnd {
        /// The file or device.
        path: PathBuf,
        /// Byte offset of the read.
        offset: u64,
        /// Bytes requested.
        len: u32,
        /// Size of the target in bytes (measured at open).
        size: u64,
    },
    /// The request asks for more bytes than its buffer holds.
    #[error("{}: read of {len} bytes at offset {offset:#x} does not fit its {buf_len}-byte buffer", path.display())]
    BufferTooSmall {
        /// The file or device.
        path: PathBuf,
        /// Byte offset of the read.
        offset: u64,
        /// Bytes requested.
        len: u32,
        /// Buffer length in bytes.
        buf_len: usize,
    },
    /// The worker performing the read panicked, or no worker is left to perform it (a bug).
    #[error("{}: read of {len} bytes at offset {offset:#x}: the I/O worker panicked", path.display())]
    WorkerPanicked {
        /// The file or device.
        path: PathBuf,
        /// Byte offset of the read.
        offset: u64,
        /// Bytes requested.
        len: u32,
    },
    /// Opening the `.picchioflat` image on the target failed (the core error names the image).
    #[error(transparent)]
    Store(#[from] picchio_core::Error),
}

impl Error {
    /// Wraps a read error for a [`picchio_core::Completion`], keeping the OS error kind.
    pub(crate) fn into_io(self) -> io::Error {
        let kind = match &self {
            Error::Read { cause, .. } => cause.kind(),
            Error::Misaligned { .. } | Error::BufferTooSmall { .. } | Error::InvalidOptions { .. } => {
                io::ErrorKind::InvalidInput
            }
            Error::PastEnd { .. } => io::ErrorKind::UnexpectedEof,
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    fn eio() -> io::Error {
        io::Error::from_raw_os_error(5)
    }

    #[test]
    fn display_names_path_operation_and_offset_and_keeps_cause() {
        let e = Error::Read { path: "/x/e.picchioflat".into(), offset: 0x3000, len: 4096, cause: eio() };
        let s = e.to_string();
        assert!(s.contains("/x/e.picchioflat") && s.contains("0x3000") && s.contains("4096 bytes"), "{s}");
        let src = e.source().expect("cause kept as source");
        assert_eq!(src.downcast_ref::<io::Error>().and_then(io::Error::raw_os_error), Some(5));

        let e = Error::Ioctl { path: "/dev/loop9".into(), request: "BLKGETSIZE64", cause: eio() };
        assert!(e.to_string().starts_with("/dev/loop9: ioctl BLKGETSIZE64: "), "{e}");
        assert!(e.source().is_some());

        let e = Error::Open { path: "/nope".into(), mode: "direct", cause: io::Error::from_raw_os_error(2) };
        assert!(e.to_string().contains("/nope: opening for direct reads"), "{e}");
        assert!(e.source().is_some());
    }

    #[test]
    fn direct_unsupported_suggests_buffered() {
        let e = Error::DirectUnsupported {
            path: "/dev/shm/x".into(),
            reason: "open with O_DIRECT failed".into(),
            cause: Some(io::Error::from_raw_os_error(22)),
        };
        let s = e.to_string();
        assert!(s.contains("/dev/shm/x") && s.contains("O_DIRECT") && s.ends_with("use --buffered"), "{s}");
        assert!(e.source().is_some());
        let e = Error::DirectUnsupported { path: "f".into(), reason: "r".into(), cause: None };
        assert!(e.source().is_none());
    }

    #[test]
    fn request_errors_name_offset_length_and_requirement() {
        let e = Error::Misaligned { path: "d".into(), offset: 0x64, len: 4096, what: "offset", align: 512 };
        assert_eq!(
            e.to_string(),
            "d: O_DIRECT read of 4096 bytes at offset 0x64: the offset is not a multiple of 512 bytes"
        );
        let e = Error::PastEnd { path: "d".into(), offset: 0x2000, len: 512, size: 0x1000 };
        assert!(e.to_string().contains("0x2000") && e.to_string().contains("0x1000"), "{e}");
        assert!(e.source().is_none());
    }

    #[test]
    fn into_io_keeps_kind_typed_error_and_chain() {
        let io = Error::Read { path: "f".into(), offset: 0, len: 1, cause: eio() }.into_io();
        assert!(io.to_string().contains("f: read of 1 bytes at offset 0x0"), "{io}");
        assert!(matches!(io.get_ref().and_then(|e| e.downcast_ref::<Error>()), Some(Error::Read { .. })));
        // io::Error forwards `source()` to the wrapped error's source: the OS error.
        let src = io.source().and_then(|s| s.downcast_ref::<io::Error>()).and_then(io::Error::raw_os_error);
        assert_eq!(src, Some(5));
        let io = Error::Misaligned { path: "f".into(), offset: 1, len: 1, what: "offset", align: 512 }.into_io();
        assert_eq!(io.kind(), io::ErrorKind::InvalidInput);
        let io = Error::PastEnd { path: "f".into(), offset: 1, len: 1, size: 0 }.into_io();
        assert_eq!(io.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn store_errors_pass_through() {
        let core = picchio_core::Error::BadMagic { source_name: "img".into(), found: "NOTMAGIC".into() };
        let want = core.to_string();
        let e = Error::from(core);
        assert_eq!(e.to_string(), want);
    }
}
