//! The error type of `picchio-core`: one variant per failing operation, each naming the file, the
//! offset in hex and what was expected.

use std::path::PathBuf;

/// Result alias for `picchio-core`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while reading, checking or writing a `.picchioflat` image.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O error while reading `what` from `source` at byte `offset`.
    #[error("{source_name}: reading {what} at offset {offset:#x}: {cause}")]
    Read {
        /// The store (path or URI) being read.
        source_name: String,
        /// What was being read ("superblock", "index").
        what: &'static str,
        /// Byte offset of the read.
        offset: u64,
        /// The underlying error.
        #[source]
        cause: std::io::Error,
    },
    /// The image is shorter than a structure it must contain.
    #[error(
        "{source_name}: truncated: {what} needs bytes {offset:#x}..{end:#x}: expected at least {end} \
         bytes, found {len} bytes"
    )]
    Truncated {
        /// The store.
        source_name: String,
        /// The structure that does not fit.
        what: &'static str,
        /// Start of the structure.
        offset: u64,
        /// End of the structure (exclusive).
        end: u64,
        /// Length of the image or device in bytes.
        len: u64,
    },
    /// The superblock does not start with `PCHIOFL1`.
    #[error(
        "{source_name}: not a .picchioflat image (bad magic at offset 0x0: expected \"PCHIOFL1\", found {found:?})"
    )]
    BadMagic {
        /// The store.
        source_name: String,
        /// The eight bytes found.
        found: String,
    },
    /// A superblock field has a value this reader does not accept.
    #[error("{source_name}: superblock field `{field}` at offset {offset:#x}: expected {expected}, found {found}")]
    BadField {
        /// The store.
        source_name: String,
        /// Field name as in DESIGN.md.
        field: &'static str,
        /// Byte offset of the field in the superblock.
        offset: u64,
        /// What was expected.
        expected: String,
        /// What was found.
        found: u64,
    },
    /// The SHA-256 of the index does not match the one in the superblock.
    #[error("{source_name}: index at {offset:#x} ({len} bytes) has SHA-256 {found}, superblock says {expected}")]
    IndexHash {
        /// The store.
        source_name: String,
        /// Index byte offset.
        offset: u64,
        /// Index length in bytes.
        len: u64,
        /// Hex digest in the superblock.
        expected: String,
        /// Hex digest computed.
        found: String,
    },
    /// The store's dimensions differ from the model it is used with.
    #[error("{source_name}: store was packed for a different model: {field} is {found} in the store, {expected} in the model")]
    DimensionMismatch {
        /// The store.
        source_name: String,
        /// Superblock field, as messages name it (`moe_inter` with what it is:
        /// `moe_inter (2 × moe_intermediate_size)`; see [`crate::loader::StoreDims::mismatches`]).
        field: &'static str,
        /// Value the model needs.
        expected: u64,
        /// Value in the store.
        found: u64,
    },
    /// A buffer could not be allocated.
    #[error("cannot allocate a {len}-byte buffer aligned to {align} bytes{}", if *.hugepages { " in hugepages" } else { "" })]
    Alloc {
        /// Requested length in bytes.
        len: usize,
        /// Requested alignment in bytes.
        align: usize,
        /// Whether hugepages were requested.
        hugepages: bool,
        /// The OS error, when there is one.
        #[source]
        cause: Option<std::io::Error>,
    },
    /// Writing an image failed.
    #[error("{path}: writing {what}: {cause}")]
    Write {
        /// The file being written (the temporary file while packing).
        path: PathBuf,
        /// What was being written.
        what: &'static str,
        /// The underlying error.
        #[source]
        cause: std::io::Error,
    },
    /// The writer was given inconsistent input.
    #[error("{path}: {message}")]
    WriterMisuse {
        /// The image being written.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// An image would break a limit of the format (docs/format.md, "Limits"); boxed, so that the
    /// error stays small.
    #[error("{0}")]
    FormatLimit(Box<FormatLimit>),
    /// A store URI could not be parsed.
    #[error("bad store URI {uri:?}: {message}")]
    BadUri {
        /// The URI as given.
        uri: String,
        /// What is wrong and what would be accepted.
        message: String,
    },
}

/// The details of [`Error::FormatLimit`]: a payload longer than the index entry's u32 `padded_len`
/// can record, or an image whose end does not fit the u64 offsets.
#[derive(Debug)]
pub struct FormatLimit {
    /// The image being planned or written.
    pub path: PathBuf,
    /// The entry at fault (`entry 7 (layer 0, expert 7)`, or `the image of N entries`).
    pub entry: String,
    /// What is too large ("the payload", "the image").
    pub what: &'static str,
    /// Its size in bytes.
    pub value: u128,
    /// The largest size the format allows, in bytes.
    pub limit: u64,
    /// The field that bounds it, as docs/format.md names it.
    pub field: &'static str,
}

impl std::fmt::Display for FormatLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {}: {} is {} bytes, over the format's limit of {} bytes ({})",
            self.path.display(),
            self.entry,
            self.what,
            self.value,
            self.limit,
            self.field
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn display_names_source_offset_and_keeps_cause() {
        let e = Error::Read {
            source_name: "/x/experts.picchioflat".into(),
            what: "index",
            offset: 0x1000,
            cause: std::io::Error::from_raw_os_error(libc::EIO),
        };
        let s = e.to_string();
        assert!(s.contains("/x/experts.picchioflat") && s.contains("0x1000") && s.contains("index"), "{s}");
        assert!(e.source().is_some());
        let e = Error::BadMagic { source_name: "f".into(), found: "NOTMAGIC".into() };
        assert!(e.to_string().contains("expected \"PCHIOFL1\""));
    }
}
