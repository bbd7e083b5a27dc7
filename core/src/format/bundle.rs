//! Version 3: the expert bundle of a GGUF model (docs/format.md, "`.picchioflat` version 3").
//!
//! A v3 image is a v2 image whose payloads are a GGUF's expert slabs as the runtime computes with
//! them (gate, up, down one after another, each in its ggml type), which may differ per layer. It
//! adds to v2:
//!
//! ```text
//! superblock 96..192  the GGUF source record ([`BundleHeader`]): magic "PCHGGUF1", the path's
//!                     length, the GGUF's fingerprint, and where the layer table is
//! superblock 192..    the GGUF's absolute path (UTF-8), then zeros to the end of the block
//! layers_offset       n_layers × 64-byte [`LayerDesc`] (BS-aligned, after the index; zeros to data_offset)
//! ```
//!
//! Picchio (C) checks the version field and refuses a v3 image; v2 images are unchanged.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::{le_u32, le_u64, BLOCK_SIZE};
use crate::error::{Error, Result};

/// The format version of a bundle.
pub const BUNDLE_VERSION: u32 = 3;
/// `"PCHGGUF1"`: the first bytes of a bundle's source record, at superblock offset 96.
pub const BUNDLE_SOURCE_MAGIC: [u8; 8] = *b"PCHGGUF1";
/// Bytes of one [`LayerDesc`] on disk.
pub const LAYER_DESC_SIZE: usize = 64;

/// Field offsets of the source record in the superblock block.
mod off {
    pub const MAGIC: usize = super::super::SUPERBLOCK_ENCODED_LEN;
    pub const PATH_LEN: usize = MAGIC + 8;
    pub const RESERVED: usize = MAGIC + 12;
    pub const FINGERPRINT: usize = MAGIC + 16;
    pub const LAYERS_OFFSET: usize = FINGERPRINT + 32;
    pub const LAYERS_LEN: usize = LAYERS_OFFSET + 8;
    pub const LAYERS_SHA256: usize = LAYERS_LEN + 8;
    pub const PATH: usize = LAYERS_SHA256 + 32;
    const _: () = assert!(
        MAGIC == 96
            && PATH_LEN == 104
            && RESERVED == 108
            && FINGERPRINT == 112
            && LAYERS_OFFSET == 144
            && LAYERS_LEN == 152
            && LAYERS_SHA256 == 160
            && PATH == 192
    );
}

/// The longest GGUF path a bundle records, in bytes: the rest of the 4096-byte superblock block.
pub const BUNDLE_MAX_PATH_LEN: usize = BLOCK_SIZE as usize - off::PATH;

/// The GGUF a bundle was written from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufSource {
    /// The GGUF's absolute path when the bundle was written (UTF-8, at most [`BUNDLE_MAX_PATH_LEN`]
    /// bytes; the first file of a split model).
    pub path: PathBuf,
    /// The GGUF's fingerprint: SHA-256 over each file's length and its bytes before the tensor data
    /// (header, metadata, tensor infos: the shapes and ggml types of every tensor), as the runtime's
    /// `GgufWeights::fingerprint` computes it.
    pub fingerprint: [u8; 32],
}

/// What a v3 superblock adds to v2's fields (bytes 96..4096).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BundleHeader {
    /// The GGUF the payloads come from.
    pub source: GgufSource,
    /// Byte offset of the layer table, a multiple of [`BLOCK_SIZE`], at or after the index end.
    pub layers_offset: u64,
    /// Bytes of the layer table: n_layers × [`LAYER_DESC_SIZE`].
    pub layers_len: u64,
    /// SHA-256 of the `layers_len` table bytes.
    pub layers_sha256: [u8; 32],
}

impl BundleHeader {
    /// Checks that the source path fits the superblock: non-empty UTF-8 of at most
    /// [`BUNDLE_MAX_PATH_LEN`] bytes.
    ///
    /// # Errors
    /// [`Error::WriterMisuse`] naming `dest` (the image) and the path.
    pub fn check_source(source: &GgufSource, dest: &Path) -> Result<()> {
        let misuse = |message: String| Error::WriterMisuse { path: dest.into(), message };
        let Some(s) = source.path.to_str() else {
            return Err(misuse(format!("bundle source: {} is not UTF-8", source.path.display())));
        };
        if s.is_empty() || s.len() > BUNDLE_MAX_PATH_LEN {
            return Err(misuse(format!(
                "bundle source: the path {s:?} has {} bytes (1..={BUNDLE_MAX_PATH_LEN} fit in the superblock)",
                s.len()
            )));
        }
        Ok(())
    }

    /// Writes the record into `block` (a superblock block of 4096 bytes, zeros from 96 on). The
    /// source must have passed [`BundleHeader::check_source`].
    pub(crate) fn encode_into(&self, block: &mut [u8]) {
        let path = self.source.path.to_str().expect("checked: UTF-8").as_bytes();
        block[off::MAGIC..off::MAGIC + 8].copy_from_slice(&BUNDLE_SOURCE_MAGIC);
        block[off::PATH_LEN..off::PATH_LEN + 4].copy_from_slice(&(path.len() as u32).to_le_bytes());
        block[off::FINGERPRINT..off::FINGERPRINT + 32].copy_from_slice(&self.source.fingerprint);
        block[off::LAYERS_OFFSET..off::LAYERS_OFFSET + 8].copy_from_slice(&self.layers_offset.to_le_bytes());
        block[off::LAYERS_LEN..off::LAYERS_LEN + 8].copy_from_slice(&self.layers_len.to_le_bytes());
        block[off::LAYERS_SHA256..off::LAYERS_SHA256 + 32].copy_from_slice(&self.layers_sha256);
        block[off::PATH..off::PATH + path.len()].copy_from_slice(path);
    }

    /// Decodes the record of a v3 superblock `block` read from `source_name`; the geometry
    /// (`layers_offset`, `layers_len` against the index and data) is checked by
    /// [`super::Superblock::decode`].
    ///
    /// # Errors
    /// [`Error::Truncated`] for a block shorter than [`BLOCK_SIZE`]; [`Error::BadField`] naming the
    /// field (`bundle.magic`, `bundle.path_len`, `bundle.reserved`, `bundle.path`) and its offset.
    pub fn decode(block: &[u8], source_name: &str) -> Result<BundleHeader> {
        if block.len() < BLOCK_SIZE as usize {
            return Err(Error::Truncated {
                source_name: source_name.into(),
                what: "the version 3 superblock",
                offset: 0,
                end: u64::from(BLOCK_SIZE),
                len: block.len() as u64,
            });
        }
        let bad = super::bad_field(source_name);
        if block[off::MAGIC..off::MAGIC + 8] != BUNDLE_SOURCE_MAGIC {
            let found = u64::from_le_bytes(block[off::MAGIC..off::MAGIC + 8].try_into().expect("8 bytes"));
            return Err(bad(
                "bundle.magic",
                off::MAGIC,
                "\"PCHGGUF1\" (a version 3 image's source record)".into(),
                found,
            ));
        }
        let len = le_u32(block, off::PATH_LEN) as usize;
        if len == 0 || len > BUNDLE_MAX_PATH_LEN {
            return Err(bad("bundle.path_len", off::PATH_LEN, format!("1..={BUNDLE_MAX_PATH_LEN}"), len as u64));
        }
        let reserved = le_u32(block, off::RESERVED);
        if reserved != 0 {
            return Err(bad("bundle.reserved", off::RESERVED, "0".into(), reserved.into()));
        }
        let path = std::str::from_utf8(&block[off::PATH..off::PATH + len]).map_err(|e| {
            let at = off::PATH + e.valid_up_to();
            bad("bundle.path", off::PATH, format!("a UTF-8 path (the byte at {at:#x} is not)"), block[at].into())
        })?;
        let mut fingerprint = [0u8; 32];
        fingerprint.copy_from_slice(&block[off::FINGERPRINT..off::FINGERPRINT + 32]);
        let mut layers_sha256 = [0u8; 32];
        layers_sha256.copy_from_slice(&block[off::LAYERS_SHA256..off::LAYERS_SHA256 + 32]);
        Ok(BundleHeader {
            source: GgufSource { path: PathBuf::from(path), fingerprint },
            layers_offset: le_u64(block, off::LAYERS_OFFSET),
            layers_len: le_u64(block, off::LAYERS_LEN),
            layers_sha256,
        })
    }

    /// Superblock offsets of the table fields, for messages: (`layers_offset`, `layers_len`).
    pub(crate) const FIELD_OFFSETS: (usize, usize) = (off::LAYERS_OFFSET, off::LAYERS_LEN);
}

/// One slab of an expert payload: a matrix in one ggml type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlabDesc {
    /// The ggml type id of the bytes in the payload (ggml's `enum ggml_type`; F16 is widened to
    /// F32 = 0 by the runtime, so this is then 0).
    pub ty: u32,
    /// The ggml type id of the tensor in the GGUF.
    pub stored: u32,
    /// Bytes of this slab in the payload.
    pub bytes: u64,
}

/// One decoder layer's entry of a bundle's layer table: the payload of each of its experts.
///
/// On disk (64 bytes, little-endian):
///
/// | offset | type | field |
/// | ---: | --- | --- |
/// | 0 | u32 | kind: 0 = no routed experts (every other byte zero), 1 = gate, up, down slabs |
/// | 4 | u32 | reserved, 0 |
/// | 8 + 16k | u32, u32, u64 | slab k (0 gate, 1 up, 2 down): `ty`, `stored`, `bytes` |
/// | 56 | u64 | payload length: the three `bytes` summed |
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerDesc {
    /// Gate, up and down, in payload order; `None` for a layer without routed experts (its index
    /// slots hold [`super::DENSE_LAYER_PLACEHOLDER`]).
    pub slabs: Option<[SlabDesc; 3]>,
}

impl LayerDesc {
    /// Bytes of one expert's payload of this layer (`None` for a layer without routed experts).
    pub fn payload_len(&self) -> Option<u64> {
        self.slabs.map(|s| s.iter().map(|x| x.bytes).sum())
    }

    /// The 64 on-disk bytes.
    pub fn encode(&self) -> [u8; LAYER_DESC_SIZE] {
        let mut b = [0u8; LAYER_DESC_SIZE];
        if let Some(slabs) = &self.slabs {
            b[0..4].copy_from_slice(&1u32.to_le_bytes());
            for (k, s) in slabs.iter().enumerate() {
                let o = 8 + 16 * k;
                b[o..o + 4].copy_from_slice(&s.ty.to_le_bytes());
                b[o + 4..o + 8].copy_from_slice(&s.stored.to_le_bytes());
                b[o + 8..o + 16].copy_from_slice(&s.bytes.to_le_bytes());
            }
            b[56..64].copy_from_slice(&self.payload_len().unwrap_or(0).to_le_bytes());
        }
        b
    }

    /// Decodes 64 on-disk bytes; on failure says what is wrong (the caller names the layer).
    pub fn decode(b: &[u8; LAYER_DESC_SIZE]) -> std::result::Result<LayerDesc, String> {
        match le_u32(b, 0) {
            0 if b.iter().all(|&x| x == 0) => Ok(LayerDesc { slabs: None }),
            0 => Err("kind 0 (no routed experts) with non-zero bytes after it".into()),
            1 => {
                if le_u32(b, 4) != 0 {
                    return Err(format!("reserved word is {}, not 0", le_u32(b, 4)));
                }
                let slab = |k: usize| {
                    let o = 8 + 16 * k;
                    SlabDesc { ty: le_u32(b, o), stored: le_u32(b, o + 4), bytes: le_u64(b, o + 8) }
                };
                let d = LayerDesc { slabs: Some([slab(0), slab(1), slab(2)]) };
                let slabs = d.slabs.as_ref().expect("set");
                if slabs.iter().any(|s| s.bytes == 0) {
                    return Err("a slab of 0 bytes".into());
                }
                let sum = slabs.iter().try_fold(0u64, |a, s| a.checked_add(s.bytes));
                if sum != Some(le_u64(b, 56)) {
                    return Err(format!("payload length {} is not the slabs' sum {sum:?}", le_u64(b, 56)));
                }
                Ok(d)
            }
            k => Err(format!("kind {k} (expected 0 or 1)")),
        }
    }
}

/// The layer table's bytes for `layers` (one [`LayerDesc`] per decoder layer, in order).
pub fn encode_layer_table(layers: &[LayerDesc]) -> Vec<u8> {
    layers.iter().flat_map(|l| l.encode()).collect()
}

/// SHA-256 of the layer table's bytes (the superblock's `layers_sha256`).
pub fn layer_table_sha256(table: &[u8]) -> [u8; 32] {
    Sha256::digest(table).into()
}

/// Decodes a layer table (a whole number of [`LAYER_DESC_SIZE`] records).
///
/// # Errors
/// What is wrong with the first bad record, naming its layer.
pub fn decode_layer_table(table: &[u8]) -> std::result::Result<Vec<LayerDesc>, String> {
    table
        .chunks_exact(LAYER_DESC_SIZE)
        .enumerate()
        .map(|(l, c)| LayerDesc::decode(c.try_into().expect("64 bytes")).map_err(|e| format!("layer {l}: {e}")))
        .collect()
}

/// The byte offset of the layer table of a bundle of `n_entries` entries: where a v2 image's data
/// would start (the index region rounded up to [`BLOCK_SIZE`]).
pub fn bundle_layers_offset(n_entries: u32) -> u64 {
    super::data_offset(n_entries)
}

/// The byte offset of the first payload of a bundle of `n_entries` entries for a model of
/// `n_layers` layers: after the layer table, rounded up to [`BLOCK_SIZE`].
pub fn bundle_data_offset(n_entries: u32, n_layers: u32) -> u64 {
    let end = bundle_layers_offset(n_entries) + u64::from(n_layers) * LAYER_DESC_SIZE as u64;
    super::round_up(end, u64::from(BLOCK_SIZE))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> BundleHeader {
        BundleHeader {
            source: GgufSource { path: "/m/tiny.gguf".into(), fingerprint: [0xcd; 32] },
            layers_offset: 8192,
            layers_len: 128,
            layers_sha256: [0x11; 32],
        }
    }

    #[test]
    fn the_source_record_round_trips_at_the_documented_offsets() {
        let mut b = vec![0u8; 4096];
        header().encode_into(&mut b);
        assert_eq!(&b[96..104], b"PCHGGUF1");
        assert_eq!(le_u32(&b, 104), 12);
        assert_eq!(&b[112..144], &[0xcd; 32]);
        assert_eq!((le_u64(&b, 144), le_u64(&b, 152)), (8192, 128));
        assert_eq!(&b[160..192], &[0x11; 32]);
        assert_eq!(&b[192..204], b"/m/tiny.gguf");
        assert!(b[204..].iter().all(|&x| x == 0));
        assert_eq!(BundleHeader::decode(&b, "img").unwrap(), header());
        b[96] = b'X';
        let e = BundleHeader::decode(&b, "img").unwrap_err().to_string();
        assert!(e.contains("bundle.magic") && e.contains("0x60"), "{e}");
    }

    #[test]
    fn layer_descriptors_round_trip_and_damage_is_named() {
        let s = |ty, bytes| SlabDesc { ty, stored: ty, bytes };
        let layers = [
            LayerDesc { slabs: Some([s(8, 4352), s(8, 4352), s(8, 4352)]) },
            LayerDesc { slabs: None },
            LayerDesc { slabs: Some([s(8, 4352), s(8, 4352), s(2, 2304)]) },
        ];
        let t = encode_layer_table(&layers);
        assert_eq!(t.len(), 3 * 64);
        assert_eq!(le_u64(&t, 56), 3 * 4352);
        assert!(t[64..128].iter().all(|&x| x == 0));
        assert_eq!(decode_layer_table(&t).unwrap(), layers);
        let mut d = t.clone();
        d[128 + 56] ^= 1;
        assert!(decode_layer_table(&d).unwrap_err().starts_with("layer 2: payload length"));
        let mut d = t;
        d[64 + 9] = 1;
        assert!(decode_layer_table(&d).unwrap_err().starts_with("layer 1: kind 0"));
    }

    #[test]
    fn the_table_sits_between_index_and_data() {
        assert_eq!(bundle_layers_offset(16), 8192);
        assert_eq!(bundle_data_offset(16, 2), 12288);
        assert_eq!(bundle_data_offset(16, 64), 12288);
        assert_eq!(bundle_data_offset(16, 65), 16384);
    }
}
