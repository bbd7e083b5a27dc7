//! The errors of the GGUF reader: one variant per way a file is refused, each naming the file, the
//! byte offset (hex) and what was expected.

use std::path::PathBuf;

/// Why a GGUF file (or a set of split files) was refused, or a key or tensor could not be had.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or read.
    #[error("{path}: reading {what} at offset {offset:#x}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being read ("the header", "the file size").
        what: &'static str,
        /// Byte offset of the read.
        offset: u64,
        /// The OS error.
        #[source]
        cause: std::io::Error,
    },
    /// The file ends inside a field.
    #[error("{path}: truncated: {what} at offset {offset:#x} needs {need} bytes, the file has {len} bytes")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// The field ("tensor count", "key 7's value").
        what: String,
        /// Where the field starts.
        offset: u64,
        /// Bytes the field needs.
        need: u64,
        /// Length of the file.
        len: u64,
    },
    /// The file does not start with `GGUF`.
    #[error("{path}: not a GGUF file: bad magic at offset 0x0: expected \"GGUF\", found \"{found}\"")]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// The first (up to) four bytes, ASCII-escaped.
        found: String,
    },
    /// The version field reads as 2 or 3 only when byte-swapped: a big-endian GGUF.
    #[error("{path}: big-endian GGUF (version field at offset 0x4 is {version} byte-swapped): only little-endian files are read")]
    BigEndian {
        /// The file.
        path: PathBuf,
        /// The version, read big-endian.
        version: u32,
    },
    /// A version other than 2 and 3.
    #[error("{path}: GGUF version {version} at offset 0x4: expected 2 or 3")]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version found.
        version: u32,
    },
    /// A count or length read from the file cannot fit in the bytes that remain.
    #[error(
        "{path}: {what} at offset {offset:#x} is {count}: that needs at least {need} bytes, only {left} remain in the file"
    )]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The field ("tensor count", "string length of key 3").
        what: String,
        /// Where the count is.
        offset: u64,
        /// The count read.
        count: u64,
        /// The fewest bytes that many items take (saturating).
        need: u64,
        /// Bytes from the end of the count to the end of the file.
        left: u64,
    },
    /// A metadata value type id no GGUF type has.
    #[error("{path}: {what} at offset {offset:#x}: unknown value type {found} (expected 0..=12)")]
    UnknownValueType {
        /// The file.
        path: PathBuf,
        /// Which value ("key `general.name`", "elements of key `x`").
        what: String,
        /// Where the type id is.
        offset: u64,
        /// The id found.
        found: u32,
    },
    /// Arrays nested deeper than the reader follows.
    #[error("{path}: key `{key}` at offset {offset:#x}: arrays nested deeper than {max} levels")]
    TooDeep {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// Where the innermost array refused starts.
        offset: u64,
        /// The deepest nesting read.
        max: u32,
    },
    /// A string that is not UTF-8.
    #[error("{path}: {what} at offset {offset:#x} is not UTF-8")]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// Which string ("key 4", "value of key `x`", "tensor 2's name").
        what: String,
        /// Where the string's bytes start.
        offset: u64,
    },
    /// A bool that is neither 0 nor 1.
    #[error("{path}: {what} at offset {offset:#x}: bool byte is {found}, expected 0 or 1")]
    BadBool {
        /// The file.
        path: PathBuf,
        /// Which value.
        what: String,
        /// Where the byte is.
        offset: u64,
        /// The byte found.
        found: u8,
    },
    /// The same key twice.
    #[error("{path}: key `{key}` at offset {offset:#x} appears a second time")]
    DuplicateKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// Where the second one starts.
        offset: u64,
    },
    /// `general.alignment` is not a non-zero power of two (or not a u32).
    #[error("{path}: general.alignment is {found}: expected a u32 power of two")]
    BadAlignment {
        /// The file.
        path: PathBuf,
        /// The value as found (`"7"`, `"a string"`).
        found: String,
    },
    /// A tensor's ggml type id is unknown.
    #[error("{path}: tensor `{tensor}`: type id {id} at offset {offset:#x} is no ggml type")]
    UnknownTensorType {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Where the id is.
        offset: u64,
        /// The id found.
        id: u32,
    },
    /// A tensor with more dimensions than ggml's four, or none.
    #[error("{path}: tensor `{tensor}`: {n_dims} dimensions at offset {offset:#x}: expected 1..=4")]
    BadDimCount {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Where the count is.
        offset: u64,
        /// The count found.
        n_dims: u32,
    },
    /// A tensor's element count or byte size overflows, or a dimension is negative as an `i64`.
    #[error("{path}: tensor `{tensor}`: dimensions {dims:?} overflow (element count or byte size past 2^63)")]
    DimsOverflow {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The dimensions, ne[0] first.
        dims: Vec<u64>,
    },
    /// A tensor's rows (ne[0]) are not a whole number of its type's blocks.
    #[error("{path}: tensor `{tensor}`: rows of {ne0} elements are not a whole number of {ty} blocks of {block}")]
    PartialBlock {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// ne[0].
        ne0: u64,
        /// The type's name.
        ty: &'static str,
        /// Elements per block.
        block: u32,
    },
    /// A tensor's offset (relative to the data section) is not a multiple of the alignment.
    #[error(
        "{path}: tensor `{tensor}`: offset {offset:#x} (at {at:#x}) is not a multiple of the alignment {alignment}"
    )]
    Misaligned {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The offset found.
        offset: u64,
        /// Where the offset field is.
        at: u64,
        /// `general.alignment`.
        alignment: u64,
    },
    /// A tensor's bytes run past the end of its file.
    #[error("{path}: tensor `{tensor}` needs bytes {start:#x}..{end:#x}, the file has {len} bytes")]
    TensorPastEnd {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// Absolute start.
        start: u64,
        /// Absolute end (exclusive; saturating).
        end: u64,
        /// Length of the file.
        len: u64,
    },
    /// Two tensors with one name (in one file or across split files).
    #[error("{path}: tensor `{tensor}` (info at {offset:#x}) appears a second time")]
    DuplicateTensor {
        /// The file of the second one.
        path: PathBuf,
        /// The name.
        tensor: String,
        /// Where the second info starts.
        offset: u64,
    },
    /// A key that is not there.
    #[error("{path}: no metadata key `{key}`")]
    MissingKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
    },
    /// A key with a value of another type than asked.
    #[error("{path}: metadata key `{key}` is {found}, expected {expected}")]
    WrongType {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// The type asked for.
        expected: &'static str,
        /// The type found.
        found: String,
    },
    /// A tensor name no file has.
    #[error("{path}: no tensor `{tensor}`")]
    MissingTensor {
        /// The (first) file.
        path: PathBuf,
        /// The name.
        tensor: String,
    },
    /// Split files that do not make one model.
    #[error("{path}: split GGUF: {message}")]
    Split {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong and what was expected.
        message: String,
    },
}
