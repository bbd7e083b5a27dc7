//! The superblock: the first `BLOCK_SIZE` bytes of an image (Python struct `<8sIIIIIIIIQQQ32s`).

use super::{le_u32, le_u64, BundleHeader, ModelRecord, BLOCK_SIZE, BUNDLE_VERSION, EXPERT_LOC_SIZE, LAYER_DESC_SIZE};
use crate::error::{Error, Result};
use crate::loader::StoreDims;

/// `"PCHIOFL1"`, the first eight bytes of every image.
pub const MAGIC: [u8; 8] = *b"PCHIOFL1";
/// The format version of images of converted directories (Picchio (C)'s); a GGUF's expert bundle is
/// [`BUNDLE_VERSION`] (3).
pub const VERSION: u32 = 2;
/// Bytes of the superblock that carry fields (the rest of the block is reserved, written as zeros).
pub const SUPERBLOCK_ENCODED_LEN: usize = 96;

/// Field offsets in bytes, as DESIGN.md gives them.
mod off {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 8;
    pub const BLOCK_SIZE: usize = 12;
    pub const HIDDEN: usize = 16;
    pub const N_LAYERS: usize = 20;
    pub const N_EXPERTS: usize = 24;
    pub const TOPK: usize = 28;
    pub const MOE_INTER: usize = 32;
    pub const N_ENTRIES: usize = 36;
    pub const INDEX_OFFSET: usize = 40;
    pub const INDEX_LEN: usize = 48;
    pub const DATA_OFFSET: usize = 56;
    pub const INDEX_SHA256: usize = 64;
    const _: () = assert!(INDEX_SHA256 + 32 == super::SUPERBLOCK_ENCODED_LEN);
}

/// The decoded superblock of a `.picchioflat` v2 image, or of a v3 GGUF bundle (`bundle`).
///
/// All integers are little-endian on disk. `moe_inter` is **2 × moe_intermediate_size**: the number of
/// rows of the fused gate_up matrix, as Picchio (C) writes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    /// Format version (2).
    pub version: u32,
    /// Block size in bytes (4096).
    pub block_size: u32,
    /// Model hidden size.
    pub hidden: u32,
    /// Number of decoder layers of the model (not of the store: see `n_entries`).
    pub n_layers: u32,
    /// Routed experts per MoE layer.
    pub n_experts: u32,
    /// Experts chosen per token.
    pub topk: u32,
    /// Rows of the fused gate_up matrix: 2 × moe_intermediate_size.
    pub moe_inter: u32,
    /// Entries in the index (n_layers × n_experts, fewer for a prefix store).
    pub n_entries: u32,
    /// Byte offset of the index, a multiple of `block_size`.
    pub index_offset: u64,
    /// Index length in bytes (= n_entries × 24).
    pub index_len: u64,
    /// Byte offset of the first payload, a multiple of `block_size`.
    pub data_offset: u64,
    /// SHA-256 of the `index_len` index bytes.
    pub index_sha256: [u8; 32],
    /// The converted model directory the image was written for, in the reserved bytes from 96 on
    /// ([`ModelRecord`]); `None` for images without one (Picchio (C)'s write zeros there) and for a
    /// damaged record (magic present, the rest not a record): the record only finds the model, so
    /// damage there never stops the experts from being read. [`ModelRecord::decode`] on the block
    /// names what is wrong with it.
    pub model: Option<ModelRecord>,
    /// Version 3 only: the GGUF the payloads come from and where the layer table is (superblock
    /// bytes 96.. hold it instead of a model record; [`BundleHeader`]). `None` for version 2.
    pub bundle: Option<BundleHeader>,
}

impl Superblock {
    /// The superblock [`super::FlatWriter`] writes for an image of `n_entries` entries of a model of
    /// `dims` (n_layers × n_experts entries, fewer for a prefix image): format version 2,
    /// [`BLOCK_SIZE`]-byte blocks, the index at byte [`BLOCK_SIZE`] (`n_entries` × 24 bytes), the
    /// payloads from [`super::data_offset`]`(n_entries)`. `index_sha256` is the SHA-256 of the index
    /// bytes and `model` the model record, if any (docs/format.md).
    pub fn layout(dims: StoreDims, n_entries: u32, index_sha256: [u8; 32], model: Option<ModelRecord>) -> Superblock {
        Superblock {
            version: VERSION,
            block_size: BLOCK_SIZE,
            hidden: dims.hidden,
            n_layers: dims.n_layers,
            n_experts: dims.n_experts,
            topk: dims.topk,
            moe_inter: dims.moe_inter,
            n_entries,
            index_offset: u64::from(BLOCK_SIZE),
            index_len: u64::from(n_entries) * EXPERT_LOC_SIZE as u64,
            data_offset: super::data_offset(n_entries),
            index_sha256,
            model,
            bundle: None,
        }
    }

    /// The superblock of a version 3 bundle ([`super::FlatWriter::set_bundle`]): as
    /// [`Superblock::layout`], but version [`BUNDLE_VERSION`], the layer table of `dims.n_layers`
    /// descriptors at [`super::bundle_layers_offset`]`(n_entries)`, the payloads from
    /// [`super::bundle_data_offset`], and `bundle` (its `layers_offset` and `layers_len` are set
    /// here) in place of a model record.
    pub fn layout_bundle(dims: StoreDims, n_entries: u32, index_sha256: [u8; 32], bundle: BundleHeader) -> Superblock {
        let bundle = BundleHeader {
            layers_offset: super::bundle_layers_offset(n_entries),
            layers_len: u64::from(dims.n_layers) * LAYER_DESC_SIZE as u64,
            ..bundle
        };
        Superblock {
            version: BUNDLE_VERSION,
            data_offset: super::bundle_data_offset(n_entries, dims.n_layers),
            bundle: Some(bundle),
            ..Superblock::layout(dims, n_entries, index_sha256, None)
        }
    }

    /// Layers whose experts the image holds: `n_entries / n_experts` (`n_layers` for a whole model,
    /// fewer for a prefix image; 0 when `n_experts` is 0).
    pub fn image_layers(&self) -> u32 {
        self.n_entries / self.n_experts.max(1)
    }

    /// Encodes into a full block of `block_size` bytes: the fields, the model record when there is
    /// one (it must have passed [`ModelRecord::check`]), zeros elsewhere.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; self.block_size.max(SUPERBLOCK_ENCODED_LEN as u32) as usize];
        b[off::MAGIC..off::MAGIC + 8].copy_from_slice(&MAGIC);
        for (o, v) in [
            (off::VERSION, self.version),
            (off::BLOCK_SIZE, self.block_size),
            (off::HIDDEN, self.hidden),
            (off::N_LAYERS, self.n_layers),
            (off::N_EXPERTS, self.n_experts),
            (off::TOPK, self.topk),
            (off::MOE_INTER, self.moe_inter),
            (off::N_ENTRIES, self.n_entries),
        ] {
            b[o..o + 4].copy_from_slice(&v.to_le_bytes());
        }
        for (o, v) in [
            (off::INDEX_OFFSET, self.index_offset),
            (off::INDEX_LEN, self.index_len),
            (off::DATA_OFFSET, self.data_offset),
        ] {
            b[o..o + 8].copy_from_slice(&v.to_le_bytes());
        }
        b[off::INDEX_SHA256..off::INDEX_SHA256 + 32].copy_from_slice(&self.index_sha256);
        if b.len() >= super::BLOCK_SIZE as usize {
            if let Some(h) = &self.bundle {
                h.encode_into(&mut b);
            } else if let Some(r) = &self.model {
                r.encode_into(&mut b);
            }
        }
        b
    }

    /// Decodes and checks a superblock read from `source_name` whose image is `image_len` bytes long.
    ///
    /// # Errors
    /// [`Error::BadMagic`], [`Error::BadField`] (version, block size, zero dimensions, misaligned or
    /// inconsistent offsets; not the model record, see [`Superblock::model`]) or [`Error::Truncated`] (index or data region
    /// past `image_len`).
    pub fn decode(bytes: &[u8], source_name: &str, image_len: u64) -> Result<Self> {
        // The magic first: a short foreign buffer is "not an image", not a truncated one.
        if bytes.len() >= 8 && bytes[..8] != MAGIC {
            return Err(Error::BadMagic {
                source_name: source_name.into(),
                found: String::from_utf8_lossy(&bytes[..8]).into_owned(),
            });
        }
        if bytes.len() < SUPERBLOCK_ENCODED_LEN {
            return Err(Error::Truncated {
                source_name: source_name.into(),
                what: "superblock",
                offset: 0,
                end: SUPERBLOCK_ENCODED_LEN as u64,
                len: bytes.len() as u64,
            });
        }
        if bytes[..8] != MAGIC {
            return Err(Error::BadMagic {
                source_name: source_name.into(),
                found: String::from_utf8_lossy(&bytes[..8]).into_owned(),
            });
        }
        let mut index_sha256 = [0u8; 32];
        index_sha256.copy_from_slice(&bytes[off::INDEX_SHA256..off::INDEX_SHA256 + 32]);
        let sb = Superblock {
            version: le_u32(bytes, off::VERSION),
            block_size: le_u32(bytes, off::BLOCK_SIZE),
            hidden: le_u32(bytes, off::HIDDEN),
            n_layers: le_u32(bytes, off::N_LAYERS),
            n_experts: le_u32(bytes, off::N_EXPERTS),
            topk: le_u32(bytes, off::TOPK),
            moe_inter: le_u32(bytes, off::MOE_INTER),
            n_entries: le_u32(bytes, off::N_ENTRIES),
            index_offset: le_u64(bytes, off::INDEX_OFFSET),
            index_len: le_u64(bytes, off::INDEX_LEN),
            data_offset: le_u64(bytes, off::DATA_OFFSET),
            index_sha256,
            model: None,
            bundle: None,
        };
        let bad = super::bad_field(source_name);
        // Version 3 is a GGUF bundle: without its source record at 96 the version is what is wrong.
        let bundle_record = bytes.len() >= 104 && bytes[96..104] == super::BUNDLE_SOURCE_MAGIC;
        if sb.version != VERSION && !(sb.version == BUNDLE_VERSION && bundle_record) {
            return Err(bad(
                "version",
                off::VERSION,
                format!("{VERSION} (or {BUNDLE_VERSION} with a GGUF source record \"PCHGGUF1\" at 0x60)"),
                sb.version.into(),
            ));
        }
        if sb.block_size != super::BLOCK_SIZE {
            return Err(bad("block_size", off::BLOCK_SIZE, format!("{}", super::BLOCK_SIZE), sb.block_size.into()));
        }
        for (field, o, v) in [
            ("hidden", off::HIDDEN, sb.hidden),
            ("n_layers", off::N_LAYERS, sb.n_layers),
            ("n_experts", off::N_EXPERTS, sb.n_experts),
            ("topk", off::TOPK, sb.topk),
            ("moe_inter", off::MOE_INTER, sb.moe_inter),
        ] {
            if v == 0 {
                return Err(bad(field, o, "a non-zero value".into(), 0));
            }
        }
        if sb.topk > sb.n_experts {
            return Err(bad("topk", off::TOPK, format!("at most n_experts = {}", sb.n_experts), sb.topk.into()));
        }
        let full = u64::from(sb.n_layers) * u64::from(sb.n_experts);
        if u64::from(sb.n_entries) > full {
            return Err(bad(
                "n_entries",
                off::N_ENTRIES,
                format!("at most n_layers × n_experts = {full}"),
                sb.n_entries.into(),
            ));
        }
        if sb.index_len != u64::from(sb.n_entries) * super::EXPERT_LOC_SIZE as u64 {
            return Err(bad(
                "index_len",
                off::INDEX_LEN,
                format!("n_entries × 24 = {}", u64::from(sb.n_entries) * 24),
                sb.index_len,
            ));
        }
        // Offsets are checked in dependency order — index_offset, then the index end, then
        // data_offset — with checked arithmetic, so the first wrong field is the one named.
        let bs = u64::from(sb.block_size);
        if sb.index_offset < bs || !sb.index_offset.is_multiple_of(bs) {
            return Err(bad(
                "index_offset",
                off::INDEX_OFFSET,
                format!("a non-zero multiple of {bs}"),
                sb.index_offset,
            ));
        }
        // Every writer puts the index right after the superblock block; one elsewhere and past the
        // end is a wrong field (an image cut off right after its superblock is reported below).
        if sb.index_offset != bs && sb.index_offset >= image_len {
            return Err(bad(
                "index_offset",
                off::INDEX_OFFSET,
                format!("an offset inside the image of {image_len} bytes (writers use {bs})"),
                sb.index_offset,
            ));
        }
        let Some(index_end) = sb.index_offset.checked_add(sb.index_len) else {
            return Err(bad(
                "index_offset",
                off::INDEX_OFFSET,
                format!("an offset whose index of {} bytes ends below 2^64", sb.index_len),
                sb.index_offset,
            ));
        };
        if !sb.data_offset.is_multiple_of(bs) || sb.data_offset < index_end {
            return Err(bad(
                "data_offset",
                off::DATA_OFFSET,
                format!("a multiple of {bs} at or after the index end {index_end:#x}"),
                sb.data_offset,
            ));
        }
        // The index region runs to data_offset (padded with zeros), and every image is at least
        // that long: a shorter one was cut off (the payloads, if any, start at data_offset).
        if sb.data_offset > image_len {
            return Err(Error::Truncated {
                source_name: source_name.into(),
                what: "the image is shorter than its superblock says: the index region (index_offset..data_offset)",
                offset: sb.index_offset,
                end: sb.data_offset,
                len: image_len,
            });
        }
        if sb.version == BUNDLE_VERSION {
            let h = BundleHeader::decode(bytes, source_name)?;
            let (lo_off, ll_off) = BundleHeader::FIELD_OFFSETS;
            let want = u64::from(sb.n_layers) * LAYER_DESC_SIZE as u64;
            if h.layers_len != want {
                return Err(bad("bundle.layers_len", ll_off, format!("n_layers × 64 = {want}"), h.layers_len));
            }
            // The table lies between the index end and data_offset, both BS-aligned.
            let fits = h.layers_offset.checked_add(h.layers_len).is_some_and(|end| end <= sb.data_offset);
            if !h.layers_offset.is_multiple_of(bs) || h.layers_offset < index_end || !fits {
                return Err(bad(
                    "bundle.layers_offset",
                    lo_off,
                    format!(
                        "a multiple of {bs} at or after the index end {index_end:#x} whose {} bytes end by data_offset {:#x}",
                        h.layers_len, sb.data_offset
                    ),
                    h.layers_offset,
                ));
            }
            return Ok(Superblock { bundle: Some(h), ..sb });
        }
        Ok(Superblock { model: ModelRecord::decode(bytes, source_name).ok().flatten(), ..sb })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_foreign_buffer_is_bad_magic_and_a_short_image_is_truncated() {
        let e = Superblock::decode(b"{\n  \"architectures\": []}", "config.json", 27).unwrap_err();
        assert!(matches!(e, Error::BadMagic { .. }) && e.to_string().contains("not a .picchioflat image"), "{e}");
        let e = Superblock::decode(b"PCHIOFL1 and less", "short", 17).unwrap_err();
        assert!(matches!(e, Error::Truncated { .. }), "{e}");
    }

    fn sample() -> Superblock {
        let dims = StoreDims { hidden: 64, n_layers: 3, n_experts: 16, topk: 4, moe_inter: 128 };
        let sb = Superblock::layout(dims, 48, [7; 32], None);
        assert_eq!(
            (sb.version, sb.block_size, sb.index_offset, sb.index_len, sb.data_offset),
            (2, 4096, 4096, 48 * 24, 8192)
        );
        assert_eq!(sb.image_layers(), 3);
        sb
    }

    #[test]
    fn a_model_record_goes_into_the_reserved_bytes_only() {
        let model = Some(ModelRecord { dir: "/m/q4".into(), config_sha256: [1; 32] });
        let with = Superblock { model: model.clone(), ..sample() };
        let (a, b) = (sample().encode(), with.encode());
        assert_eq!(&a[..96], &b[..96], "the fields Picchio (C) reads are unchanged");
        assert_eq!(&b[96..104], b"PCHMODEL");
        assert_eq!(Superblock::decode(&b, "t", 1 << 20).unwrap().model, model);
        assert_eq!(Superblock::decode(&a, "t", 1 << 20).unwrap().model, None);
        // A damaged record (bad version) loses the record, not the image.
        let mut d = b.clone();
        d[104] = 9;
        let sb = Superblock::decode(&d, "t", 1 << 20).unwrap();
        assert_eq!(sb, Superblock { model: None, ..with.clone() });
        assert!(ModelRecord::decode(&d, "t").unwrap_err().to_string().contains("model_record.version"));
    }

    #[test]
    fn layout_matches_python_struct_offsets() {
        let b = sample().encode();
        assert_eq!(b.len(), 4096);
        assert_eq!(&b[0..8], b"PCHIOFL1");
        assert_eq!(le_u32(&b, 8), 2);
        assert_eq!(le_u32(&b, 32), 128);
        assert_eq!(le_u32(&b, 36), 48);
        assert_eq!(le_u64(&b, 40), 4096);
        assert_eq!(le_u64(&b, 48), 1152);
        assert_eq!(le_u64(&b, 56), 8192);
        assert_eq!(&b[64..96], &[7; 32]);
        assert!(b[96..].iter().all(|&x| x == 0));
        assert_eq!(Superblock::decode(&b, "t", 1 << 20).unwrap(), sample());
    }

    #[test]
    fn rejects_bad_magic_version_and_truncation() {
        let mut b = sample().encode();
        b[0] = b'X';
        let e = Superblock::decode(&b, "img", 1 << 20).unwrap_err().to_string();
        assert!(e.contains("img") && e.contains("PCHIOFL1"), "{e}");
        let mut b = sample().encode();
        b[8] = 3;
        let e = Superblock::decode(&b, "img", 1 << 20).unwrap_err().to_string();
        assert!(e.contains("version") && e.contains("0x8") && e.contains("found 3"), "{e}");
        let e = Superblock::decode(&sample().encode(), "img", 4096).unwrap_err().to_string();
        assert!(e.contains("truncated") && e.contains("index"), "{e}");
    }

    #[test]
    fn a_version_3_superblock_needs_its_source_record_and_a_table_between_index_and_data() {
        use crate::format::{BundleHeader, GgufSource};
        let dims = StoreDims { hidden: 64, n_layers: 3, n_experts: 16, topk: 4, moe_inter: 128 };
        let source = GgufSource { path: "/m/x.gguf".into(), fingerprint: [5; 32] };
        let h = BundleHeader { source, layers_offset: 0, layers_len: 0, layers_sha256: [6; 32] };
        let sb = Superblock::layout_bundle(dims, 48, [7; 32], h);
        assert_eq!((sb.version, sb.data_offset), (3, 12288));
        let b = sb.encode();
        assert_eq!(&b[..8], b"PCHIOFL1");
        assert_eq!(Superblock::decode(&b, "t", 1 << 20).unwrap(), sb);
        // The table must not overlap the index.
        let mut bad = sb.clone();
        bad.bundle.as_mut().unwrap().layers_offset = 4096;
        let e = Superblock::decode(&bad.encode(), "t", 1 << 20).unwrap_err().to_string();
        assert!(e.contains("bundle.layers_offset") && e.contains("0x90"), "{e}");
        // One descriptor per layer.
        let mut bad = sb.clone();
        bad.bundle.as_mut().unwrap().layers_len = 64;
        let e = Superblock::decode(&bad.encode(), "t", 1 << 20).unwrap_err().to_string();
        assert!(e.contains("bundle.layers_len") && e.contains("192"), "{e}");
        // Version 3 without the source record: the version is what is wrong.
        let mut b = b;
        b[96..].fill(0);
        let e = Superblock::decode(&b, "t", 1 << 20).unwrap_err().to_string();
        assert!(e.contains("`version`") && e.contains("PCHGGUF1"), "{e}");
    }

    #[test]
    fn names_the_first_wrong_offset_field() {
        // index_offset corrupted to 2^63: blamed on index_offset, not on data_offset.
        let mut sb = sample();
        sb.index_offset = 0x8000_0000_0000_0000;
        let e = Superblock::decode(&sb.encode(), "img", 1 << 20).unwrap_err().to_string();
        assert!(e.contains("`index_offset` at offset 0x28") && e.contains("inside the image of 1048576 bytes"), "{e}");
        // index_offset + index_len past 2^64: no wrap-around into a valid-looking range.
        let mut sb = sample();
        (sb.n_layers, sb.n_experts, sb.n_entries) = (65536, 65536, u32::MAX);
        sb.index_len = u64::from(u32::MAX) * 24;
        sb.index_offset = u64::MAX - 4095;
        let e = Superblock::decode(&sb.encode(), "img", u64::MAX).unwrap_err().to_string();
        assert!(e.contains("`index_offset`") && e.contains("2^64"), "{e}");
        // data_offset inside the index: data_offset is the first wrong field.
        let mut sb = sample();
        sb.data_offset = 4096;
        let e = Superblock::decode(&sb.encode(), "img", 1 << 20).unwrap_err().to_string();
        assert!(e.contains("`data_offset`") && e.contains("index end 0x1480"), "{e}");
    }

    #[test]
    fn a_cut_off_image_says_how_long_it_should_be() {
        // An image of 48 entries truncated to 5000 bytes: the index region runs to 8192.
        let e = Superblock::decode(&sample().encode(), "img.pf", 5000).unwrap_err().to_string();
        assert!(e.contains("img.pf") && e.contains("shorter than its superblock says"), "{e}");
        assert!(e.contains("0x1000..0x2000") && e.contains("at least 8192 bytes, found 5000 bytes"), "{e}");
    }
}
