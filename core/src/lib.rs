//! Picchio core: the `.picchioflat` expert-image format, the two traits that every storage tier and the
//! runtime meet at ([`IoQueue`] for block reads, [`ExpertLoader`] for whole experts), block-aligned
//! buffers, store URIs, and I/O statistics.
//!
//! Dependencies run one way: engines (`picchio-blockdev`, `picchio-nvme`) implement [`IoQueue`]; the
//! runtime consumes [`ExpertLoader`]. Nothing here knows about models or about a particular engine.
#![deny(missing_docs)]

pub mod buf;
pub mod error;
pub mod format;
pub mod io;
pub mod loader;
pub mod output;
pub mod rng;
pub mod stats;
pub mod stop_point;
pub mod units;
pub mod uri;

pub use buf::{AlignedBuf, BufPool};
pub use error::{Error, Result};
pub use format::{ExpertLoc, FlatWriter, Superblock, BLOCK_SIZE};
pub use io::{ByteOffset, Completion, InstantQueue, IoQueue, ReadReq, SlotAllocator, Tag};
pub use loader::{
    BundleExpect, ExpertKey, ExpertLoader, FallbackLoader, FlatStore, FlatStoreOptions, LoadError, Loaded, StoreExpect,
};
pub use stats::{IoStats, StatsSnapshot};
pub use units::human_bytes;
pub use uri::StoreUri;
