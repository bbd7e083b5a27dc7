//! The `.picchioflat` version 2 image (byte-compatible with Picchio (C) v0.6+; see docs/format.md),
//! and version 3, a GGUF's expert bundle ([`BundleHeader`], [`LayerDesc`]).
//!
//! ```text
//! offset 0              superblock, one BLOCK_SIZE block ([`Superblock`]; from byte 96 an optional [`ModelRecord`])
//! index_offset          n_entries × 24-byte [`ExpertLoc`], addressed by layer * n_experts + expert
//! data_offset           one payload per expert, (layer, expert) order, each padded to BLOCK_SIZE
//! ```
//!
//! [`gguf`] reads llama.cpp's GGUF model files (a model source; nothing here writes them).

mod bundle;
pub mod gguf;
mod index;
mod model_record;
mod superblock;
mod writer;

pub use bundle::{
    bundle_data_offset, bundle_layers_offset, decode_layer_table, encode_layer_table, layer_table_sha256, BundleHeader,
    GgufSource, LayerDesc, SlabDesc, BUNDLE_MAX_PATH_LEN, BUNDLE_SOURCE_MAGIC, BUNDLE_VERSION, LAYER_DESC_SIZE,
};
pub use index::{decode_index, encode_index, index_sha256, payload_hash, ExpertLoc, EXPERT_LOC_SIZE};
pub use model_record::{ModelRecord, MODEL_RECORD_MAGIC, MODEL_RECORD_MAX_DIR_LEN, MODEL_RECORD_VERSION};
pub use superblock::{Superblock, MAGIC, SUPERBLOCK_ENCODED_LEN, VERSION};
pub use writer::{check_payload_len, data_offset, plan_image_len, FileSink, FlatWriter, ImageSink, MAX_PAYLOAD_LEN};

/// The block size of every `.picchioflat` image: all offsets and padded lengths are multiples of it.
pub const BLOCK_SIZE: u32 = 4096;

/// The payload of every index slot of a dense-MLP layer (32 bytes, one 4 KiB block on disk;
/// docs/format.md, "Dense layers").
///
/// No expert payload has this length: an unquantized one is 12·H·I bytes (never 32), a Q4 one
/// 27·H·I/16 and a Q3 one 21·H·I/16 bytes with H, I ≥ 64. A store opened for the model (with
/// [`crate::StoreExpect`]) rejects such an entry, so anything requesting it falls back instead of
/// computing with made-up weights; `picchio verify --model` checks that the slots hold exactly this.
pub const DENSE_LAYER_PLACEHOLDER: &[u8; 32] = b"PICCHIO:DENSE-MLP-LAYER:NOEXPERT";

/// The little-endian `u32` at byte `o` of `b` (every integer field of the format is little-endian).
///
/// # Panics
/// When `b` is shorter than `o + 4` (callers check lengths first).
pub(crate) fn le_u32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}

/// The little-endian `u64` at byte `o` of `b`.
///
/// # Panics
/// When `b` is shorter than `o + 8`.
pub(crate) fn le_u64(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

/// The field checks' error for the store `source_name`: `bad(field, offset, expected, found)` is
/// the [`crate::Error::BadField`] naming the field, its byte offset, and the value expected and found.
pub(crate) fn bad_field(source_name: &str) -> impl Fn(&'static str, usize, String, u64) -> crate::Error + '_ {
    move |field, offset, expected, found| crate::Error::BadField {
        source_name: source_name.into(),
        field,
        offset: offset as u64,
        expected,
        found,
    }
}

/// Rounds `n` up to a multiple of `to` (a power of two or any non-zero value).
pub const fn round_up(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}
