//! The `.picchioflat` version 2 image (byte-compatible with Picchio (C) v0.6+; see docs/format.md).
//!
//! ```text
//! offset 0              superblock, one BLOCK_SIZE block ([`Superblock`])
//! index_offset          n_entries × 24-byte [`ExpertLoc`], addressed by layer * n_experts + expert
//! data_offset           one payload per expert, (layer, expert) order, each padded to BLOCK_SIZE
//! ```

mod index;
mod superblock;
mod writer;

pub use index::{decode_index, encode_index, index_sha256, payload_hash, ExpertLoc, EXPERT_LOC_SIZE};
pub use superblock::{Superblock, MAGIC, SUPERBLOCK_ENCODED_LEN, VERSION};
pub use writer::{check_payload_len, data_offset, plan_image_len, FileSink, FlatWriter, ImageSink, MAX_PAYLOAD_LEN};

/// The block size of every `.picchioflat` image: all offsets and padded lengths are multiples of it.
pub const BLOCK_SIZE: u32 = 4096;

/// Rounds `n` up to a multiple of `to` (a power of two or any non-zero value).
pub const fn round_up(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}
