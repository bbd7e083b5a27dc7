//! The error type of `picchio-core`: one variant per failing operation, each naming the file, the
//! offset in hex and what was expected.

use std::path::PathBuf;

/// Result alias for `picchio-core`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while reading, checking or writing a `.picchioflat` image.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O error while reading `what` from `source` at byte `offset`.
    #[error("{source_name}: reading {what} at offset {offset:#x}")]
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
    /// A version 3 bundle's layer table cannot be used: the read failed, its SHA-256 differs from
    /// the superblock's, or a descriptor is malformed.
    #[error("{source_name}: layer table at {offset:#x}: {message}")]
    LayerTable {
        /// The store.
        source_name: String,
        /// Byte offset of the table.
        offset: u64,
        /// What is wrong.
        message: String,
    },
    /// The image is not the expert bundle of the GGUF model it is used with (a v2 image, another
    /// GGUF's bundle, a stale bundle of a GGUF that changed), or a bundle is used with a converted
    /// directory.
    #[error("{source_name}: not the expert bundle of this model: {what}")]
    NotThisBundle {
        /// The store.
        source_name: String,
        /// The first difference found.
        what: String,
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
    #[error("{path}: writing {what}")]
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
    /// A store URI has a scheme no store has (`s3:`): callers that accept other forms than a run
    /// (bench, pack's `--out`) list their own.
    #[error("bad store URI {uri:?}: {message}")]
    UnknownScheme {
        /// The URI as given.
        uri: String,
        /// The scheme, without the `:`.
        scheme: String,
        /// What is wrong and what would be accepted.
        message: String,
    },
    /// A store URI could not be parsed.
    #[error("bad store URI {uri:?}: {message}")]
    BadUri {
        /// The URI as given.
        uri: String,
        /// What is wrong and what would be accepted.
        message: String,
    },
}

/// An error and every `source()` below it, joined by `": "` — what `{:#}` prints for an `anyhow`
/// chain. Every error type in the workspace keeps a cause either in its message or as its `source()`,
/// never both, so this prints each cause once. Use it wherever an error becomes text (a log line, a
/// report field, a message of another error): `e.to_string()` alone would drop the causes.
///
/// ```
/// let e = picchio_core::Error::Write {
///     path: "/m/e.picchioflat".into(),
///     what: "payload",
///     cause: std::io::Error::other("disk full"),
/// };
/// assert_eq!(e.to_string(), "/m/e.picchioflat: writing payload");
/// assert_eq!(picchio_core::error::chain(&e).to_string(), "/m/e.picchioflat: writing payload: disk full");
/// ```
pub fn chain<'a>(e: &'a (dyn std::error::Error + 'static)) -> Chain<'a> {
    Chain(e)
}

/// The [`Display`](std::fmt::Display) of [`chain`]: the error, then each `source()`, joined by `": "`.
#[derive(Clone, Copy)]
pub struct Chain<'a>(&'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(c) = cause {
            write!(f, ": {c}")?;
            cause = c.source();
        }
        Ok(())
    }
}

impl std::fmt::Debug for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
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

    /// Each cause is printed once: in the message or as `source()`, never both (vfio-ioctls'
    /// `test_vfio_error_fmt`), and [`chain`] joins them as `{:#}` of anyhow does.
    #[test]
    fn a_cause_is_in_the_message_or_the_source_not_both() {
        let eio = || std::io::Error::from_raw_os_error(libc::EIO);
        let os = eio().to_string();
        let errors: Vec<Box<dyn std::error::Error>> = vec![
            Box::new(Error::Read { source_name: "img".into(), what: "index", offset: 0x1000, cause: eio() }),
            Box::new(Error::Write { path: "/o.pf".into(), what: "payload", cause: eio() }),
            Box::new(Error::Alloc { len: 4096, align: 4096, hugepages: true, cause: Some(eio()) }),
            Box::new(crate::LoadError::Io {
                source_name: "img".into(),
                key: crate::ExpertKey { layer: 1, expert: 2 },
                offset: 0x2000,
                cause: eio(),
            }),
        ];
        for e in &errors {
            let src = e.source().expect("the cause is the source").to_string();
            assert_eq!(src, os);
            assert!(!e.to_string().contains(&src), "{e} repeats its source");
            assert_eq!(chain(e.as_ref()).to_string(), format!("{e}: {os}"));
        }
        assert_eq!(errors[0].to_string(), "img: reading index at offset 0x1000");
        assert_eq!(errors[1].to_string(), "/o.pf: writing payload");
        assert_eq!(errors[3].to_string(), "img: reading (layer 1, expert 2) at offset 0x2000");
        // An io::Error wrapping one of ours prints it, and its source() is the inner source.
        let wrapped = std::io::Error::other(Error::Write { path: "/o.pf".into(), what: "index", cause: eio() });
        assert_eq!(chain(&wrapped).to_string(), format!("/o.pf: writing index: {os}"));
    }
}
