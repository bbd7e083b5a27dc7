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
    /// An engine option is outside the range the engine accepts (zero worker threads, a queue
    /// depth over the limit). `option` names the options field (`PsyncOptions::threads`), not a
    /// command-line flag: the binary maps it to its flag.
    #[error("invalid I/O options: {option} = {value}, expected {min}..={max}")]
    OptionOutOfRange {
        /// The field, as `Type::field`.
        option: &'static str,
        /// The value given.
        value: u64,
        /// The smallest value accepted.
        min: u64,
        /// The largest value accepted.
        max: u64,
    },
    /// `UringOptions::iopoll` without `UringOptions::direct`: completions are polled from the
    /// device, which only unbuffered reads reach.
    #[error(
        "invalid I/O options: UringOptions::iopoll polls the device for completions and needs direct (O_DIRECT) \
         reads (UringOptions::direct)"
    )]
    IopollNeedsDirect,
    /// The buffer of the one-block read that checks polled completions could not be allocated.
    #[error("{}: allocating the {len}-byte io_uring iopoll probe buffer", path.display())]
    IopollProbeBuffer {
        /// The file or device.
        path: PathBuf,
        /// Bytes asked for (one logical block).
        len: u32,
        /// The buffer error (boxed: it would make every blockdev and runtime `Result` larger).
        #[source]
        cause: Box<picchio_core::Error>,
    },
    /// `open(2)` failed.
    #[error("{}: opening for {mode} reads", path.display())]
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
    #[error(
        "{}: unbuffered (O_DIRECT) reads are not supported here ({reason}); read it buffered instead (`direct: \
         false` in PsyncOptions or UringOptions)",
        path.display()
    )]
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
    #[error("{}: fstat", path.display())]
    Stat {
        /// The file or device.
        path: PathBuf,
        /// The OS error.
        #[source]
        cause: io::Error,
    },
    /// An ioctl on a block device failed.
    #[error("{}: ioctl {request}", path.display())]
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
    #[error("{}: spawning I/O worker thread {index}", path.display())]
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
    #[error("{}: read of {len} bytes at offset {offset:#x}", path.display())]
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

    // ---- io_uring engine (uring.rs) ----
    /// io_uring cannot be used on this system: no kernel support, disabled by the
    /// `kernel.io_uring_disabled` sysctl, blocked by a seccomp filter, or without `IORING_OP_READ`.
    #[error("io_uring is unavailable: {reason}; use the psync engine (PsyncQueue) instead")]
    UringUnavailable {
        /// What the probe found, and the likely cause.
        reason: String,
        /// The OS error of the failing call, when there is one.
        #[source]
        cause: Option<io::Error>,
    },
    /// An io_uring option ([`crate::UringOptions`]'s `sqpoll`, `iopoll`, `register_files`) is
    /// refused by the kernel or the device.
    #[error("{}: io_uring {option}: {reason}", path.display())]
    UringOption {
        /// The file or device.
        path: PathBuf,
        /// The option, as [`crate::UringOptions`] names it (`sqpoll`, `iopoll`, `sqpoll and iopoll`,
        /// `register_files`).
        option: &'static str,
        /// What failed and what to do instead.
        reason: String,
        /// The OS error (or the failed probe read's error).
        #[source]
        cause: Option<io::Error>,
    },

    // ---- IOCP engine (iocp.rs, Windows) ----
    /// `CreateIoCompletionPort` failed for the target's handle.
    #[error("{}: creating an I/O completion port", path.display())]
    CompletionPort {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        cause: io::Error,
    },

    // ---- raw block devices (raw.rs) ----
    /// A `raw:` path that is not a block device (a regular file is never written as a device).
    #[error(
        "{}: is a {kind}, not a block device: raw: takes a disk, a partition or a loop device; for an image in a \
         file, use file:PATH",
        path.display()
    )]
    NotBlockDevice {
        /// The path.
        path: PathBuf,
        /// What it is instead (`regular file`, `directory`, ...).
        kind: &'static str,
    },
    /// The image offset of `raw:/dev/X@BYTES` is not a whole number of logical blocks.
    #[error(
        "{}: image offset {offset} is not a multiple of the device's logical block size ({logical_block} bytes): \
         the image must start at a whole LBA, e.g. @{} or @{}",
        path.display(),
        offset / u64::from(*logical_block) * u64::from(*logical_block),
        (offset / u64::from(*logical_block) + 1) * u64::from(*logical_block)
    )]
    RawOffset {
        /// The device.
        path: PathBuf,
        /// The byte offset given.
        offset: u64,
        /// The logical block size (`BLKSSZGET`).
        logical_block: u32,
    },
    /// The image offset lies at or past the end of the device.
    #[error("{}: image offset {offset} is at or past the end of the device ({size} bytes)", path.display())]
    RawOffsetPastEnd {
        /// The device.
        path: PathBuf,
        /// The byte offset given.
        offset: u64,
        /// Device size in bytes.
        size: u64,
    },
    /// A logical block size that does not divide the image's 4096-byte blocks.
    #[error(
        "{}: logical block size {logical_block} bytes is not supported: the image's 4096-byte blocks must be whole \
         LBAs (512, 1024, 2048 or 4096-byte logical blocks)",
        path.display()
    )]
    UnsupportedBlockSize {
        /// The device.
        path: PathBuf,
        /// The logical block size (`BLKSSZGET`).
        logical_block: u32,
    },
    /// The image does not fit between its offset and the end of the device.
    #[error(
        "{}: the image needs {image_len} bytes but the device has {capacity} bytes from offset {offset} \
         ({size} bytes in all): use a larger device, a smaller offset, or a smaller image (fewer layers)",
        path.display()
    )]
    ImageTooLarge {
        /// The device.
        path: PathBuf,
        /// The image's byte offset on the device.
        offset: u64,
        /// Bytes the image needs.
        image_len: u64,
        /// Bytes from the offset to the end of the device.
        capacity: u64,
        /// Device size in bytes.
        size: u64,
    },
    /// Writing the device is refused: it is in use, carries data, or backs `/`.
    #[error("{}: refusing to write the image: {reasons}. Nothing was written; {hint}", path.display())]
    Refused {
        /// The device.
        path: PathBuf,
        /// Every reason, joined by "; ".
        reasons: String,
        /// What the user can do.
        hint: &'static str,
    },
    /// Reading what the system says about a device (mount table, sysfs) or its first blocks failed.
    #[error("{}: {what}", path.display())]
    Inspect {
        /// The file read.
        path: PathBuf,
        /// What was being read.
        what: &'static str,
        /// The OS error.
        #[source]
        cause: io::Error,
    },
    /// Opening a block device for writing (`O_WRONLY | O_DIRECT | O_EXCL`) failed.
    #[error("{}: opening for exclusive O_DIRECT writes{}", path.display(), write_open_hint(cause))]
    WriteOpen {
        /// The device.
        path: PathBuf,
        /// The OS error.
        #[source]
        cause: io::Error,
    },
    /// The path names another device than the one inspected (it changed in between).
    #[error(
        "{}: is no longer the device that was inspected (expected {expected}, found {found}); nothing was written",
        path.display()
    )]
    DeviceChanged {
        /// The path.
        path: PathBuf,
        /// The inspected device number.
        expected: String,
        /// What the opened path is now.
        found: String,
    },
    /// A positional write to a block device failed in the kernel.
    #[error("{}: write of {len} bytes at offset {offset:#x}", path.display())]
    Write {
        /// The device.
        path: PathBuf,
        /// Device byte offset of the write.
        offset: u64,
        /// Bytes to write.
        len: u64,
        /// The OS error.
        #[source]
        cause: io::Error,
    },
    /// `fsync` of a block device failed: the written data may not be on stable storage.
    #[error("{}: fsync", path.display())]
    Sync {
        /// The device.
        path: PathBuf,
        /// The OS error.
        #[source]
        cause: io::Error,
    },
    /// An unbuffered write whose offset or length is not a multiple of the logical block size.
    #[error(
        "{}: O_DIRECT write of {len} bytes at offset {offset:#x}: not a multiple of {align} bytes (the logical \
         block size)",
        path.display()
    )]
    UnalignedWrite {
        /// The device.
        path: PathBuf,
        /// Device byte offset.
        offset: u64,
        /// Bytes.
        len: u64,
        /// The alignment required.
        align: u32,
    },
    /// A write that would leave the region the image was permitted (refused, not performed).
    #[error(
        "{}: write of {len} bytes at device offset {offset:#x} runs past the end of the image ({limit} bytes from \
         its start): refused",
        path.display()
    )]
    WritePastImage {
        /// The device.
        path: PathBuf,
        /// Device byte offset of the write.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Bytes the image may take.
        limit: u64,
    },
}

/// The next step after a failed exclusive open for writing, by OS error.
fn write_open_hint(cause: &io::Error) -> &'static str {
    match cause.raw_os_error() {
        Some(libc::EBUSY) => {
            " (the kernel holds the device: a mounted file system, an active swap area, or device-mapper/md; \
             unmount or release it first — `force` cannot override this)"
        }
        Some(libc::EROFS) => " (the device is read-only)",
        Some(libc::EACCES) | Some(libc::EPERM) => " (writing a block device needs root or the disk group)",
        _ => "",
    }
}

impl Error {
    /// Wraps a read error for a [`picchio_core::Completion`], keeping the OS error kind.
    pub(crate) fn into_io(self) -> io::Error {
        let kind = match &self {
            Error::Read { cause, .. } | Error::Write { cause, .. } | Error::Sync { cause, .. } => cause.kind(),
            Error::UnalignedWrite { .. } | Error::WritePastImage { .. } => io::ErrorKind::InvalidInput,
            Error::Misaligned { .. }
            | Error::BufferTooSmall { .. }
            | Error::OptionOutOfRange { .. }
            | Error::IopollNeedsDirect => io::ErrorKind::InvalidInput,
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
        assert!(picchio_core::error::chain(&e).to_string().starts_with("/dev/loop9: ioctl BLKGETSIZE64: "), "{e}");
        assert!(e.source().is_some());

        let e = Error::Open { path: "/nope".into(), mode: "direct", cause: io::Error::from_raw_os_error(2) };
        assert!(e.to_string().contains("/nope: opening for direct reads"), "{e}");
        assert!(e.source().is_some());
    }

    /// Each cause is printed once: in the message or as `source()`, never both (vfio-ioctls'
    /// `test_vfio_error_fmt`).
    #[test]
    fn a_cause_is_in_the_message_or_the_source_not_both() {
        let busy = || io::Error::from_raw_os_error(libc::EBUSY);
        let os = busy().to_string();
        let p = || PathBuf::from("/dev/loop9");
        let errors = [
            Error::Open { path: p(), mode: "direct", cause: busy() },
            Error::Stat { path: p(), cause: busy() },
            Error::Ioctl { path: p(), request: "BLKGETSIZE64", cause: busy() },
            Error::Spawn { path: p(), index: 1, cause: busy() },
            Error::Read { path: p(), offset: 0x1000, len: 512, cause: busy() },
            Error::Inspect { path: p(), what: "reading the first blocks", cause: busy() },
            Error::WriteOpen { path: p(), cause: busy() },
            Error::Write { path: p(), offset: 0, len: 4096, cause: busy() },
            Error::Sync { path: p(), cause: busy() },
            Error::CompletionPort { path: p(), cause: busy() },
            Error::DirectUnsupported { path: p(), reason: "open with O_DIRECT failed".into(), cause: Some(busy()) },
            Error::UringUnavailable {
                reason: "io_uring_setup failed: unexpected errno 16".into(),
                cause: Some(busy()),
            },
        ];
        for e in &errors {
            let src = e.source().expect("the cause is the source").to_string();
            assert_eq!(src, os);
            assert!(!e.to_string().contains(&src), "{e} repeats its source");
            assert_eq!(picchio_core::error::chain(e).to_string(), format!("{e}: {os}"));
        }
        assert_eq!(errors[4].to_string(), "/dev/loop9: read of 512 bytes at offset 0x1000");
        assert!(errors[6].to_string().starts_with("/dev/loop9: opening for exclusive O_DIRECT writes (the kernel"));
        // Read errors travel inside an io::Error: the chain is the same.
        let io = Error::Read { path: p(), offset: 0, len: 1, cause: busy() }.into_io();
        assert_eq!(
            picchio_core::error::chain(&io).to_string(),
            format!("/dev/loop9: read of 1 bytes at offset 0x0: {os}")
        );
    }

    /// Option errors name the options field, never a command-line flag (the binary maps them).
    #[test]
    fn option_errors_name_the_options_field_not_a_flag() {
        let e = Error::OptionOutOfRange { option: "UringOptions::qd", value: 0, min: 1, max: 256 };
        assert_eq!(e.to_string(), "invalid I/O options: UringOptions::qd = 0, expected 1..=256");
        assert_eq!(e.into_io().kind(), io::ErrorKind::InvalidInput);
        let e = Error::IopollNeedsDirect;
        assert!(e.to_string().contains("UringOptions::iopoll") && e.to_string().contains("UringOptions::direct"));
        let e =
            Error::UringOption { path: "/d".into(), option: "iopoll", reason: "turn iopoll off".into(), cause: None };
        assert_eq!(e.to_string(), "/d: io_uring iopoll: turn iopoll off");
        let cause = picchio_core::AlignedBuf::new(4096, 3).unwrap_err();
        let want = cause.to_string();
        let e = Error::IopollProbeBuffer { path: "/d".into(), len: 4096, cause: Box::new(cause) };
        assert_eq!(e.to_string(), "/d: allocating the 4096-byte io_uring iopoll probe buffer");
        assert_eq!(e.source().map(|s| s.to_string()), Some(want));
        for e in [
            Error::OptionOutOfRange { option: "PsyncOptions::threads", value: 0, min: 1, max: 256 },
            Error::IopollNeedsDirect,
            Error::UringOption { path: "/d".into(), option: "sqpoll", reason: "r".into(), cause: None },
        ] {
            assert!(!e.to_string().contains("--"), "{e} names a flag");
        }
    }

    #[test]
    fn direct_unsupported_suggests_buffered() {
        let e = Error::DirectUnsupported {
            path: "/dev/shm/x".into(),
            reason: "open with O_DIRECT failed".into(),
            cause: Some(io::Error::from_raw_os_error(22)),
        };
        let s = e.to_string();
        assert!(
            s.contains("/dev/shm/x")
                && s.contains("O_DIRECT")
                && s.ends_with("read it buffered instead (`direct: false` in PsyncOptions or UringOptions)"),
            "{s}"
        );
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

    #[test]
    fn completion_port_error_names_the_path_and_keeps_cause() {
        let e = Error::CompletionPort { path: "C:/m/e.picchioflat".into(), cause: io::Error::from_raw_os_error(8) };
        let s = picchio_core::error::chain(&e).to_string();
        assert!(s.starts_with("C:/m/e.picchioflat: creating an I/O completion port: "), "{s}");
        assert_eq!(e.source().and_then(|s| s.downcast_ref::<io::Error>()).and_then(io::Error::raw_os_error), Some(8));
    }
}
