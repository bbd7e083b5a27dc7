//! The index: `n_entries` × 24-byte [`ExpertLoc`] records, addressed by `layer * n_experts + expert`.

use sha2::{Digest, Sha256};

/// Bytes per index entry.
pub const EXPERT_LOC_SIZE: usize = 24;

/// Where one expert's payload lives in the image (24 bytes on disk, little-endian).
///
/// | offset | field |
/// | --- | --- |
/// | 0 | `u64 offset` (bytes from the image start, a multiple of the block size) |
/// | 8 | `u32 len` (exact payload bytes) |
/// | 12 | `u32 padded_len` (`len` rounded up to the block size) |
/// | 16 | `u64 hash` (first 8 bytes of SHA-256 of the payload, read as LE u64) |
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ExpertLoc {
    /// Byte offset of the payload from the image start.
    pub offset: u64,
    /// Exact payload length in bytes.
    pub len: u32,
    /// Payload length rounded up to the block size: the length of the read.
    pub padded_len: u32,
    /// [`payload_hash`] of the `len` payload bytes.
    pub hash: u64,
}

impl ExpertLoc {
    /// Encodes as the 24 on-disk bytes.
    pub fn encode(&self) -> [u8; EXPERT_LOC_SIZE] {
        let mut b = [0u8; EXPERT_LOC_SIZE];
        b[0..8].copy_from_slice(&self.offset.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..16].copy_from_slice(&self.padded_len.to_le_bytes());
        b[16..24].copy_from_slice(&self.hash.to_le_bytes());
        b
    }

    /// Decodes 24 on-disk bytes.
    pub fn decode(b: &[u8; EXPERT_LOC_SIZE]) -> Self {
        ExpertLoc {
            offset: super::le_u64(b, 0),
            len: super::le_u32(b, 8),
            padded_len: super::le_u32(b, 12),
            hash: super::le_u64(b, 16),
        }
    }

    /// Checks the entry against the image geometry; on failure returns what was expected.
    ///
    /// An entry is valid when `offset` is a multiple of `block_size` at or after `data_offset`,
    /// `0 < len <= padded_len`, `padded_len` is `len` rounded up to the block size, and the padded
    /// payload ends inside the image (`image_len` bytes).
    pub fn check(&self, block_size: u32, data_offset: u64, image_len: u64) -> Result<(), String> {
        let bs = u64::from(block_size);
        if !self.offset.is_multiple_of(bs) {
            return Err(format!("offset {:#x} is not a multiple of the block size {bs}", self.offset));
        }
        if self.offset < data_offset {
            return Err(format!("offset {:#x} is before the data region at {data_offset:#x}", self.offset));
        }
        if self.len == 0 || self.len > self.padded_len {
            return Err(format!("len {} must be in 1..=padded_len ({})", self.len, self.padded_len));
        }
        if u64::from(self.padded_len) != super::round_up(u64::from(self.len), bs) {
            return Err(format!("padded_len {} is not len {} rounded up to {bs}", self.padded_len, self.len));
        }
        let Some(end) = self.offset.checked_add(u64::from(self.padded_len)) else {
            return Err(format!("payload at {:#x} of {} bytes ends past 2^64", self.offset, self.padded_len));
        };
        if end > image_len {
            return Err(format!("payload {:#x}..{end:#x} ends past the image end {image_len:#x}", self.offset));
        }
        Ok(())
    }
}

/// First 8 bytes of SHA-256(`payload`), read as a little-endian u64 (the index `hash` field).
pub fn payload_hash(payload: &[u8]) -> u64 {
    let d = Sha256::digest(payload);
    u64::from_le_bytes(d[..8].try_into().expect("8"))
}

/// SHA-256 of the encoded index bytes (the superblock's `index_sha256`).
pub fn index_sha256(index_bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(index_bytes).into()
}

/// Encodes entries into index bytes (`entries.len()` × 24).
pub fn encode_index(entries: &[ExpertLoc]) -> Vec<u8> {
    entries.iter().flat_map(|e| e.encode()).collect()
}

/// Decodes index bytes; `bytes.len()` must be a multiple of 24 (trailing bytes are ignored).
pub fn decode_index(bytes: &[u8]) -> Vec<ExpertLoc> {
    bytes.chunks_exact(EXPERT_LOC_SIZE).map(|c| ExpertLoc::decode(c.try_into().expect("24"))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hash_is_le_prefix_of_sha256() {
        // SHA-256("abc") = ba7816bf 8f01cfea ...
        assert_eq!(payload_hash(b"abc"), u64::from_le_bytes([0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea]));
    }

    #[test]
    fn check_names_each_fault() {
        let ok = ExpertLoc { offset: 8192, len: 5000, padded_len: 8192, hash: 0 };
        assert!(ok.check(4096, 8192, 16384).is_ok());
        let e = ExpertLoc { offset: 8193, ..ok }.check(4096, 8192, 1 << 20).unwrap_err();
        assert!(e.contains("not a multiple"), "{e}");
        let e = ok.check(4096, 8192, 12288).unwrap_err();
        assert!(e.contains("past the image end"), "{e}");
        let e = ExpertLoc { len: 9000, ..ok }.check(4096, 8192, 1 << 20).unwrap_err();
        assert!(e.contains("padded_len"), "{e}");
        let e = ExpertLoc { offset: 4096, ..ok }.check(4096, 8192, 1 << 20).unwrap_err();
        assert!(e.contains("before the data region"), "{e}");
        // An offset near 2^64 is named, not wrapped around into range.
        let e = ExpertLoc { offset: u64::MAX - 4095, ..ok }.check(4096, 8192, 1 << 20).unwrap_err();
        assert!(e.contains("past 2^64"), "{e}");
    }

    proptest! {
        #[test]
        fn entry_round_trips(offset: u64, len: u32, padded_len: u32, hash: u64) {
            let e = ExpertLoc { offset, len, padded_len, hash };
            prop_assert_eq!(ExpertLoc::decode(&e.encode()), e);
            prop_assert_eq!(decode_index(&encode_index(&[e, e])), vec![e, e]);
        }
    }
}
