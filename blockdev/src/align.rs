//! Direct-I/O alignment: what `O_DIRECT` requires of a read's offset, length and buffer address, decided
//! from what the kernel reports (see `sys::probe`) with conservative fallbacks.
//!
//! Order of preference: `statx(STATX_DIOALIGN)` (Linux 6.1+, per file; for block devices 6.11+), then
//! the logical block size from `BLKSSZGET` for block devices, then 4096 bytes (safe for 512-byte and
//! 4Kn devices alike; every `.picchioflat` read is 4096-aligned anyway).

use std::path::Path;

use picchio_core::ReadReq;

use crate::error::Error;

/// Alignment in bytes that unbuffered reads need (both 1 for buffered reads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DioAlign {
    /// Offsets and lengths must be multiples of this (the logical block size, usually 512 or 4096).
    pub offset: u32,
    /// Buffer addresses must be multiples of this (often smaller than `offset` on modern kernels).
    pub mem: u32,
}

impl DioAlign {
    /// No requirement (buffered reads).
    pub const NONE: DioAlign = DioAlign { offset: 1, mem: 1 };

    /// Used when the kernel reports nothing for a regular file: 4096 covers 512e and 4Kn devices.
    pub const FALLBACK: DioAlign = DioAlign { offset: 4096, mem: 4096 };
}

/// The `STATX_DIOALIGN` answer for a file: `stx_dio_mem_align`, `stx_dio_offset_align`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(any(all(target_os = "linux", target_env = "gnu"), windows)), allow(dead_code))] // statx, FileStorageInfo
pub(crate) struct StatxDio {
    /// `stx_dio_mem_align`.
    pub mem: u32,
    /// `stx_dio_offset_align`; 0 means the file does not support direct I/O.
    pub offset: u32,
}

/// Decides the alignment of a target opened with or without `O_DIRECT`.
///
/// `statx` is the kernel's `STATX_DIOALIGN` answer when it gave one, `logical_block` the `BLKSSZGET`
/// answer for a block device. On failure returns why direct I/O is impossible.
pub(crate) fn choose(direct: bool, statx: Option<StatxDio>, logical_block: Option<u32>) -> Result<DioAlign, String> {
    if !direct {
        return Ok(DioAlign::NONE);
    }
    let sane = |v: u32| v.is_power_of_two() && v <= 1 << 20;
    match statx {
        Some(s) if s.offset == 0 => {
            Err("statx(STATX_DIOALIGN) reports that this file does not support direct I/O".into())
        }
        Some(s) if sane(s.offset) && (s.mem == 0 || sane(s.mem)) => {
            Ok(DioAlign { offset: s.offset, mem: s.mem.max(1) })
        }
        _ => match logical_block {
            Some(lb) if sane(lb) => Ok(DioAlign { offset: lb, mem: lb }),
            _ => Ok(DioAlign::FALLBACK),
        },
    }
}

/// Checks a read before any engine hands it to the kernel (shared by psync, io_uring and IOCP):
/// `len` must fit the buffer ([`Error::BufferTooSmall`]); with `direct`, offset and length must be
/// multiples of `align.offset` and the buffer address of `align.mem` ([`Error::Misaligned`]); a
/// non-empty read must start before `size` bytes ([`Error::PastEnd`]). Errors name `path`.
pub(crate) fn check_request(path: &Path, size: u64, align: DioAlign, direct: bool, req: &ReadReq) -> Result<(), Error> {
    let (offset, len) = (req.offset.0, req.len);
    if len as usize > req.buf.len() {
        return Err(Error::BufferTooSmall { path: path.into(), offset, len, buf_len: req.buf.len() });
    }
    if direct {
        let addr = req.buf.as_slice().as_ptr() as u64;
        for (what, value, align) in [
            ("offset", offset, align.offset),
            ("length", u64::from(len), align.offset),
            ("buffer address", addr, align.mem),
        ] {
            if value % u64::from(align) != 0 {
                return Err(Error::Misaligned { path: path.into(), offset, len, what, align });
            }
        }
    }
    if len > 0 && offset >= size {
        return Err(Error::PastEnd { path: path.into(), offset, len, size });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffered_needs_nothing() {
        assert_eq!(choose(false, None, None), Ok(DioAlign::NONE));
        assert_eq!(choose(false, Some(StatxDio { mem: 0, offset: 0 }), Some(4096)), Ok(DioAlign::NONE));
    }

    #[test]
    fn statx_wins_then_logical_block_then_fallback() {
        let s = StatxDio { mem: 4, offset: 512 };
        assert_eq!(choose(true, Some(s), Some(4096)), Ok(DioAlign { offset: 512, mem: 4 }));
        assert_eq!(choose(true, None, Some(4096)), Ok(DioAlign { offset: 4096, mem: 4096 }));
        assert_eq!(choose(true, None, Some(512)), Ok(DioAlign { offset: 512, mem: 512 }));
        assert_eq!(choose(true, None, None), Ok(DioAlign::FALLBACK));
    }

    #[test]
    fn zero_offset_alignment_means_unsupported() {
        let e = choose(true, Some(StatxDio { mem: 0, offset: 0 }), None).unwrap_err();
        assert!(e.contains("does not support direct I/O"), "{e}");
    }

    #[test]
    fn nonsense_answers_fall_back() {
        assert_eq!(choose(true, Some(StatxDio { mem: 3, offset: 512 }), None), Ok(DioAlign::FALLBACK));
        assert_eq!(choose(true, Some(StatxDio { mem: 512, offset: 1000 }), Some(4096)).unwrap().offset, 4096);
        assert_eq!(choose(true, None, Some(0)), Ok(DioAlign::FALLBACK));
    }
}
