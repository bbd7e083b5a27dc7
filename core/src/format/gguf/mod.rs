//! GGUF, llama.cpp's model file, read in place (versions 2 and 3, little-endian; docs/format.md,
//! "GGUF files").
//!
//! ```text
//! offset 0        magic "GGUF", u32 version, u64 tensor_count, u64 kv_count
//! 24              kv_count × (string key, u32 value type, value)
//!                 tensor_count × (string name, u32 n_dims, n_dims × u64 ne, u32 ggml type, u64 offset)
//! data_offset     the header's end rounded up to general.alignment (default 32): tensor data, each
//!                 tensor at data_offset + its offset (a multiple of the alignment)
//! ```
//! A string is a u64 byte length and that many UTF-8 bytes; an array a u32 element type, a u64 count
//! and the elements (arrays may nest). Dimensions are ggml's: `ne[0]` is the innermost (the row
//! length), so a `[rows, cols]` matrix is stored with dims `[cols, rows]`.
//!
//! [`GgufFile::open`] reads the header and tensor infos with ordinary buffered reads (no mmap) and
//! gives every tensor its absolute byte range ([`TensorInfo::range`]), so callers read slabs with any
//! engine. [`GgufModel::open`] opens a model, following split files (`X-00001-of-00003.gguf`).
//! Every count and length read from the file is bounded by the bytes left in it before anything is
//! allocated for it, so a damaged or hostile header cannot make the reader allocate more than a
//! small multiple of the file's size.

mod error;
mod split;
mod types;
mod value;

use std::collections::HashMap;
use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};

pub use error::GgufError;
pub use split::{split_paths, GgufModel, ModelTensor, SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT};
pub use types::{GgmlType, TypeTraits, GGML_TYPES};
pub use value::{Array, Value, ValueType};

/// The four bytes every GGUF starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";

/// The alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// ggml's `GGML_MAX_DIMS`: a tensor has 1 to 4 dimensions.
pub const MAX_DIMS: u32 = 4;

/// How deep arrays of arrays are followed (llama.cpp's own writers nest at most once).
pub const MAX_ARRAY_DEPTH: u32 = 8;

/// Result alias of the reader.
pub type Result<T, E = GgufError> = std::result::Result<T, E>;

/// One tensor's info, as the header gives it, with its place in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The name (`blk.0.ffn_gate_exps.weight`).
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` (ne[0]) is the row length, the innermost.
    pub dims: Vec<u64>,
    /// The element type.
    pub ty: GgmlType,
    /// The offset written in the info, relative to the data section.
    pub offset: u64,
    /// The absolute bytes of the tensor in its file: `data_offset + offset ..` + its size.
    pub range: Range<u64>,
}

impl TensorInfo {
    /// The number of elements (the product of the dimensions; checked at open).
    pub fn n_elems(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The size in bytes.
    pub fn n_bytes(&self) -> u64 {
        self.range.end - self.range.start
    }
}

/// One GGUF file's header: version, metadata and tensor infos.
#[derive(Debug, Clone)]
pub struct GgufFile {
    path: PathBuf,
    len: u64,
    version: u32,
    metadata: Vec<(String, Value)>,
    keys: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    names: HashMap<String, usize>,
    alignment: u64,
    header_len: u64,
    data_offset: u64,
}

impl GgufFile {
    /// Reads the header of the GGUF at `path`.
    ///
    /// # Errors
    /// [`GgufError::Io`] when it cannot be opened or read, and every refusal of [`GgufFile::parse`].
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let io = |what, cause| GgufError::Io { path: path.to_owned(), what, offset: 0, cause };
        let file = std::fs::File::open(path).map_err(|e| io("the file (open)", e))?;
        let len = file.metadata().map_err(|e| io("the file size", e))?.len();
        GgufFile::parse(path, std::io::BufReader::with_capacity(1 << 16, file), len)
    }

    /// Reads a GGUF header from `reader`, positioned at the file's first byte, of a file `len`
    /// bytes long; `path` names it in errors and is what [`GgufFile::path`] returns.
    ///
    /// # Errors
    /// A [`GgufError`] naming the offset and the field: truncated fields, bad magic, a big-endian
    /// file, versions other than 2 and 3, counts or lengths past the file's end, unknown value or
    /// tensor types, non-UTF-8 strings, bools other than 0/1, duplicate keys or tensor names, a bad
    /// `general.alignment`, 0 or more than 4 dimensions, sizes that overflow, rows not a whole
    /// number of blocks, misaligned offsets, tensors past the end of the file.
    pub fn parse(path: impl AsRef<Path>, reader: impl Read, len: u64) -> Result<GgufFile> {
        let mut r = Reader { inner: reader, path: path.as_ref().to_owned(), pos: 0, len };
        r.parse_file()
    }

    /// [`GgufFile::parse`] over bytes in memory.
    ///
    /// # Errors
    /// As [`GgufFile::parse`].
    pub fn from_bytes(path: impl AsRef<Path>, bytes: &[u8]) -> Result<GgufFile> {
        GgufFile::parse(path, bytes, bytes.len() as u64)
    }

    /// The file as given to `open`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file is empty (never, for a file that opened).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// `general.alignment`, or 32.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// The end of the tensor infos: the bytes `0..header_len` are the whole header.
    pub fn header_len(&self) -> u64 {
        self.header_len
    }

    /// Where tensor data starts: `header_len` rounded up to the alignment.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Every key and value, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// Every tensor info, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`, if the file has it.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.names.get(name).map(|&i| &self.tensors[i])
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.keys.get(key).map(|&i| &self.metadata[i].1)
    }

    /// The value of `key`.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`] naming the key and the file.
    pub fn value(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| GgufError::MissingKey { path: self.path.clone(), key: key.to_owned() })
    }

    fn wrong_type(&self, key: &str, expected: &'static str, found: &Value) -> GgufError {
        GgufError::WrongType { path: self.path.clone(), key: key.to_owned(), expected, found: found.type_name() }
    }

    /// An integer key of any width and signedness, as a `u64` (for keys writers spell differently:
    /// `split.count` is u16 from llama.cpp).
    ///
    /// # Errors
    /// [`GgufError::MissingKey`]; [`GgufError::WrongType`] for a non-integer or negative value.
    pub fn get_uint(&self, key: &str) -> Result<u64> {
        let v = self.value(key)?;
        v.as_u64().ok_or_else(|| self.wrong_type(key, "a non-negative integer", v))
    }

    /// A string key.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`]; [`GgufError::WrongType`] naming the type found.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.value(key)? {
            Value::String(s) => Ok(s),
            v => Err(self.wrong_type(key, "string", v)),
        }
    }

    /// An array key.
    ///
    /// # Errors
    /// [`GgufError::MissingKey`]; [`GgufError::WrongType`].
    pub fn get_array(&self, key: &str) -> Result<&Array> {
        match self.value(key)? {
            Value::Array(a) => Ok(a),
            v => Err(self.wrong_type(key, "array", v)),
        }
    }

    /// An array-of-strings key (`tokenizer.ggml.tokens`).
    ///
    /// # Errors
    /// [`GgufError::MissingKey`]; [`GgufError::WrongType`].
    pub fn get_str_array(&self, key: &str) -> Result<&[String]> {
        match self.value(key)? {
            Value::Array(Array::String(s)) => Ok(s),
            v => Err(self.wrong_type(key, "array of string", v)),
        }
    }
}

macro_rules! typed_getters {
    ($($(#[$doc:meta])* $fn:ident -> $ty:ty : $variant:ident, $name:literal;)*) => {
        impl GgufFile {
            $(
                $(#[$doc])*
                ///
                /// # Errors
                /// [`GgufError::MissingKey`] naming the key and the file; [`GgufError::WrongType`]
                /// naming the type found (no conversion between types is made).
                pub fn $fn(&self, key: &str) -> Result<$ty> {
                    match self.value(key)? {
                        Value::$variant(v) => Ok(*v),
                        v => Err(self.wrong_type(key, $name, v)),
                    }
                }
            )*
        }
    };
}

typed_getters! {
    /// A u8 key.
    get_u8 -> u8: U8, "u8";
    /// An i8 key.
    get_i8 -> i8: I8, "i8";
    /// A u16 key.
    get_u16 -> u16: U16, "u16";
    /// An i16 key.
    get_i16 -> i16: I16, "i16";
    /// A u32 key (`qwen3moe.block_count`).
    get_u32 -> u32: U32, "u32";
    /// An i32 key.
    get_i32 -> i32: I32, "i32";
    /// A u64 key.
    get_u64 -> u64: U64, "u64";
    /// An i64 key.
    get_i64 -> i64: I64, "i64";
    /// An f32 key (`qwen3moe.rope.freq_base`).
    get_f32 -> f32: F32, "f32";
    /// An f64 key.
    get_f64 -> f64: F64, "f64";
    /// A bool key.
    get_bool -> bool: Bool, "bool";
}

/// Items reserved ahead of reading them; beyond this a `Vec` grows as values are actually read.
const RESERVE_CAP: u64 = 1 << 16;

/// A reader that knows where it is and how long the file is.
struct Reader<R> {
    inner: R,
    path: PathBuf,
    pos: u64,
    len: u64,
}

impl<R: Read> Reader<R> {
    fn left(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    fn truncated(&self, what: &dyn std::fmt::Display, need: u64) -> GgufError {
        GgufError::Truncated { path: self.path.clone(), what: what.to_string(), offset: self.pos, need, len: self.len }
    }

    /// Reads exactly `buf.len()` bytes of field `what`.
    fn fill(&mut self, buf: &mut [u8], what: &dyn std::fmt::Display) -> Result<()> {
        let need = buf.len() as u64;
        if self.left() < need {
            return Err(self.truncated(what, need));
        }
        match self.inner.read_exact(buf) {
            Ok(()) => {
                self.pos += need;
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(self.truncated(what, need)),
            Err(cause) => Err(GgufError::Io { path: self.path.clone(), what: "the header", offset: self.pos, cause }),
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn std::fmt::Display) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.fill(&mut b, what)?;
        Ok(b)
    }

    fn u8(&mut self, what: &dyn std::fmt::Display) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u32(&mut self, what: &dyn std::fmt::Display) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn std::fmt::Display) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Reads a count of items that take at least `min_size` bytes each, refusing one that cannot
    /// fit in the rest of the file.
    fn count(&mut self, what: &dyn std::fmt::Display, min_size: u64) -> Result<u64> {
        let offset = self.pos;
        let count = self.u64(what)?;
        let need = count.saturating_mul(min_size);
        if need > self.left() {
            return Err(GgufError::TooLarge {
                path: self.path.clone(),
                what: what.to_string(),
                offset,
                count,
                need,
                left: self.left(),
            });
        }
        Ok(count)
    }

    fn string(&mut self, what: &dyn std::fmt::Display) -> Result<String> {
        let n = self.count(&format_args!("length of {what}"), 1)?;
        let at = self.pos;
        let mut bytes = vec![0u8; n as usize];
        self.fill(&mut bytes, what)?;
        String::from_utf8(bytes).map_err(|_| GgufError::NotUtf8 {
            path: self.path.clone(),
            what: what.to_string(),
            offset: at,
        })
    }

    fn value_type(&mut self, what: &dyn std::fmt::Display) -> Result<ValueType> {
        let offset = self.pos;
        let id = self.u32(what)?;
        ValueType::from_id(id).ok_or_else(|| GgufError::UnknownValueType {
            path: self.path.clone(),
            what: what.to_string(),
            offset,
            found: id,
        })
    }

    fn bool(&mut self, what: &dyn std::fmt::Display) -> Result<bool> {
        let offset = self.pos;
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            found => Err(GgufError::BadBool { path: self.path.clone(), what: what.to_string(), offset, found }),
        }
    }

    /// A value of type `ty` (of `key`, at array depth `depth`).
    fn value(&mut self, ty: ValueType, key: &str, depth: u32) -> Result<Value> {
        let what = format!("value of key `{key}`");
        Ok(match ty {
            ValueType::U8 => Value::U8(self.u8(&what)?),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(&what)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            ValueType::U32 => Value::U32(self.u32(&what)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            ValueType::Bool => Value::Bool(self.bool(&what)?),
            ValueType::String => Value::String(self.string(&what)?),
            ValueType::U64 => Value::U64(self.u64(&what)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            ValueType::Array => Value::Array(self.array_value(key, depth)?),
        })
    }

    /// `n` items read by `read`, reserving at most [`RESERVE_CAP`] ahead.
    fn items<T>(&mut self, n: u64, mut read: impl FnMut(&mut Self) -> Result<T>) -> Result<Vec<T>> {
        let mut v = Vec::with_capacity(n.min(RESERVE_CAP) as usize);
        for _ in 0..n {
            v.push(read(self)?);
        }
        Ok(v)
    }

    /// An array (element type, count, elements) of `key`, itself at nesting `depth` (0: the value).
    fn array_value(&mut self, key: &str, depth: u32) -> Result<Array> {
        let start = self.pos;
        if depth >= MAX_ARRAY_DEPTH {
            return Err(GgufError::TooDeep {
                path: self.path.clone(),
                key: key.to_owned(),
                offset: start,
                max: MAX_ARRAY_DEPTH,
            });
        }
        let what = format!("elements of key `{key}`");
        let ty = self.value_type(&what)?;
        let n = self.count(&format_args!("element count of key `{key}`"), ty.min_size())?;
        macro_rules! le {
            ($t:ty) => {
                self.items(n, |r| Ok(<$t>::from_le_bytes(r.array(&what)?)))?
            };
        }
        Ok(match ty {
            ValueType::U8 => Array::U8(le!(u8)),
            ValueType::I8 => Array::I8(le!(i8)),
            ValueType::U16 => Array::U16(le!(u16)),
            ValueType::I16 => Array::I16(le!(i16)),
            ValueType::U32 => Array::U32(le!(u32)),
            ValueType::I32 => Array::I32(le!(i32)),
            ValueType::F32 => Array::F32(le!(f32)),
            ValueType::U64 => Array::U64(le!(u64)),
            ValueType::I64 => Array::I64(le!(i64)),
            ValueType::F64 => Array::F64(le!(f64)),
            ValueType::Bool => Array::Bool(self.items(n, |r| r.bool(&what))?),
            ValueType::String => Array::String(self.items(n, |r| r.string(&what))?),
            ValueType::Array => Array::Array(self.items(n, |r| r.array_value(key, depth + 1))?),
        })
    }

    fn parse_file(&mut self) -> Result<GgufFile> {
        // Magic and version.
        let mut magic = [0u8; 4];
        let got = self.len.min(4) as usize;
        self.fill(&mut magic[..got], &"magic")?;
        if got < 4 || magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic {
                path: self.path.clone(),
                found: magic[..got].escape_ascii().to_string(),
            });
        }
        let version_bytes: [u8; 4] = self.array(&"version")?;
        let version = u32::from_le_bytes(version_bytes);
        if version != 2 && version != 3 {
            let swapped = u32::from_be_bytes(version_bytes);
            if swapped == 2 || swapped == 3 {
                return Err(GgufError::BigEndian { path: self.path.clone(), version: swapped });
            }
            return Err(GgufError::UnsupportedVersion { path: self.path.clone(), version });
        }
        // Smallest tensor info: empty name (8), n_dims (4), one dim (8), type (4), offset (8).
        let tensor_count = self.count(&"tensor count", 32)?;
        // Smallest key/value: empty key (8), type (4), a one-byte value (1).
        let kv_count = self.count(&"metadata key/value count", 13)?;

        // Metadata.
        let mut metadata = Vec::with_capacity(kv_count.min(RESERVE_CAP) as usize);
        let mut keys = HashMap::new();
        for i in 0..kv_count {
            let at = self.pos;
            let key = self.string(&format_args!("key {i}"))?;
            let ty = self.value_type(&format_args!("type of key `{key}`"))?;
            let value = self.value(ty, &key, 0)?;
            if keys.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::DuplicateKey { path: self.path.clone(), key, offset: at });
            }
            metadata.push((key, value));
        }
        let alignment = match keys.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(Value::U32(a)) if a.is_power_of_two() => u64::from(*a),
            Some(Value::U32(a)) => {
                return Err(GgufError::BadAlignment { path: self.path.clone(), found: a.to_string() })
            }
            Some(v) => return Err(GgufError::BadAlignment { path: self.path.clone(), found: v.type_name() }),
        };

        // Tensor infos.
        let mut infos = Vec::with_capacity(tensor_count.min(RESERVE_CAP) as usize);
        let mut names = HashMap::new();
        for i in 0..tensor_count {
            let at = self.pos;
            let name = self.string(&format_args!("tensor {i}'s name"))?;
            let dims_at = self.pos;
            let n_dims = self.u32(&format_args!("tensor `{name}`'s dimension count"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(GgufError::BadDimCount { path: self.path.clone(), tensor: name, offset: dims_at, n_dims });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for d in 0..n_dims {
                dims.push(self.u64(&format_args!("tensor `{name}`'s dimension {d}"))?);
            }
            let type_at = self.pos;
            let id = self.u32(&format_args!("tensor `{name}`'s type"))?;
            let ty = GgmlType::from_id(id).ok_or_else(|| GgufError::UnknownTensorType {
                path: self.path.clone(),
                tensor: name.clone(),
                offset: type_at,
                id,
            })?;
            let offset_at = self.pos;
            let offset = self.u64(&format_args!("tensor `{name}`'s offset"))?;
            if names.contains_key(&name) {
                return Err(GgufError::DuplicateTensor { path: self.path.clone(), tensor: name, offset: at });
            }
            let n_bytes = self.tensor_bytes(&name, &dims, ty)?;
            if !offset.is_multiple_of(alignment) {
                return Err(GgufError::Misaligned {
                    path: self.path.clone(),
                    tensor: name,
                    offset,
                    at: offset_at,
                    alignment,
                });
            }
            names.insert(name.clone(), infos.len());
            infos.push((name, dims, ty, offset, n_bytes));
        }
        let header_len = self.pos;
        let data_offset = header_len.div_ceil(alignment) * alignment;
        let mut tensors = Vec::with_capacity(infos.len());
        for (name, dims, ty, offset, n_bytes) in infos {
            let start = data_offset.saturating_add(offset);
            let end = start.saturating_add(n_bytes);
            if end > self.len {
                return Err(GgufError::TensorPastEnd {
                    path: self.path.clone(),
                    tensor: name,
                    start,
                    end,
                    len: self.len,
                });
            }
            tensors.push(TensorInfo { name, dims, ty, offset, range: start..end });
        }
        Ok(GgufFile {
            path: self.path.clone(),
            len: self.len,
            version,
            metadata,
            keys,
            tensors,
            names,
            alignment,
            header_len,
            data_offset,
        })
    }

    /// The byte size of a tensor of `dims` and `ty`, refusing overflow and partial blocks.
    fn tensor_bytes(&self, name: &str, dims: &[u64], ty: GgmlType) -> Result<u64> {
        let overflow =
            || GgufError::DimsOverflow { path: self.path.clone(), tensor: name.to_owned(), dims: dims.to_vec() };
        let n_elems = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).filter(|&n| n <= i64::MAX as u64);
        let n_elems = n_elems.ok_or_else(overflow)?;
        let block = ty.block_elems();
        if !dims[0].is_multiple_of(u64::from(block)) {
            return Err(GgufError::PartialBlock {
                path: self.path.clone(),
                tensor: name.to_owned(),
                ne0: dims[0],
                ty: ty.name(),
                block,
            });
        }
        ty.bytes_for(n_elems).filter(|&b| b <= i64::MAX as u64).ok_or_else(overflow)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Builds GGUF bytes field by field (little-endian), for tests.
    #[derive(Default)]
    pub(crate) struct Builder {
        pub(crate) b: Vec<u8>,
    }

    impl Builder {
        pub(crate) fn header(version: u32, n_tensors: u64, n_kv: u64) -> Builder {
            let mut b = Builder::default();
            b.b.extend_from_slice(b"GGUF");
            b.u32(version).u64(n_tensors).u64(n_kv);
            b
        }
        pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
            self.b.extend_from_slice(&v.to_le_bytes());
            self
        }
        pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
            self.b.extend_from_slice(&v.to_le_bytes());
            self
        }
        pub(crate) fn str(&mut self, s: &str) -> &mut Self {
            self.u64(s.len() as u64);
            self.b.extend_from_slice(s.as_bytes());
            self
        }
        /// A key with a u32 value.
        pub(crate) fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
            self.str(key).u32(4).u32(v)
        }
        /// A key with a string value.
        pub(crate) fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
            self.str(key).u32(8).str(v)
        }
        pub(crate) fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
            self.str(name).u32(dims.len() as u32);
            for &d in dims {
                self.u64(d);
            }
            self.u32(ty).u64(offset)
        }
        /// Pads to `align` and appends `n` data bytes.
        pub(crate) fn data(&mut self, align: usize, n: usize) -> &mut Self {
            self.b.resize(self.b.len().div_ceil(align) * align, 0);
            self.b.extend((0..n).map(|i| i as u8));
            self
        }
    }

    fn parse(b: &Builder) -> Result<GgufFile> {
        GgufFile::from_bytes("t.gguf", &b.b)
    }

    /// A valid file: two keys, two tensors (F32 [4, 2] and Q8_0 [32]).
    fn valid() -> Builder {
        let mut b = Builder::header(3, 2, 2);
        b.kv_str("general.architecture", "qwen3moe").kv_u32("qwen3moe.block_count", 48);
        b.tensor("a", &[4, 2], 0, 0).tensor("b", &[32], 8, 32);
        b.data(32, 32 + 34);
        b
    }

    #[test]
    fn a_valid_file_opens_with_its_ranges_and_keys() {
        let b = valid();
        let f = parse(&b).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.alignment(), 32);
        let header_len =
            24 + (8 + 20 + 4 + 8 + 8) + (8 + 20 + 4 + 4) + (8 + 1 + 4 + 16 + 4 + 8) + (8 + 1 + 4 + 8 + 4 + 8);
        assert_eq!(f.header_len(), header_len);
        assert_eq!(f.data_offset(), header_len.div_ceil(32) * 32);
        let a = f.tensor("a").unwrap();
        assert_eq!((a.ty, a.dims.clone(), a.n_elems()), (GgmlType::F32, vec![4, 2], 8));
        assert_eq!(a.range, f.data_offset()..f.data_offset() + 32);
        let t = f.tensor("b").unwrap();
        assert_eq!(t.range, f.data_offset() + 32..f.data_offset() + 66);
        assert_eq!(f.get_u32("qwen3moe.block_count").unwrap(), 48);
        assert_eq!(f.get_str("general.architecture").unwrap(), "qwen3moe");
        assert_eq!(f.get_uint("qwen3moe.block_count").unwrap(), 48);
        // v2 is the same layout.
        let mut b2 = valid();
        b2.b[4] = 2;
        assert_eq!(parse(&b2).unwrap().version(), 2);
    }

    #[test]
    fn accessors_name_the_key_and_the_file() {
        let f = parse(&valid()).unwrap();
        let e = f.get_u32("qwen3moe.expert_count").unwrap_err();
        assert_eq!(e.to_string(), "t.gguf: no metadata key `qwen3moe.expert_count`");
        let e = f.get_f32("qwen3moe.block_count").unwrap_err();
        assert_eq!(e.to_string(), "t.gguf: metadata key `qwen3moe.block_count` is u32, expected f32");
        let e = f.get_str_array("general.architecture").unwrap_err();
        assert!(e.to_string().contains("is string, expected array of string"), "{e}");
    }

    /// Every prefix of a valid file is refused, with the offset where the file ends inside a field.
    #[test]
    fn every_truncation_is_refused() {
        let b = valid();
        for cut in 0..b.b.len() {
            let e = GgufFile::from_bytes("t.gguf", &b.b[..cut]).unwrap_err();
            match &e {
                GgufError::BadMagic { .. } => assert!(cut < 4),
                GgufError::Truncated { offset, need, len, .. } => {
                    assert_eq!(*len, cut as u64);
                    assert!(*offset <= cut as u64 && offset + need > cut as u64, "{e}");
                }
                GgufError::TooLarge { left, .. } => assert!(*left < cut as u64, "{e}"),
                GgufError::TensorPastEnd { end, len, .. } => assert!(end > len),
                other => panic!("cut at {cut}: {other}"),
            }
        }
        let e = GgufFile::from_bytes("t.gguf", &b.b[..6]).unwrap_err();
        assert_eq!(e.to_string(), "t.gguf: truncated: version at offset 0x4 needs 4 bytes, the file has 6 bytes");
    }

    #[test]
    fn bad_magic_big_endian_and_versions_are_refused() {
        let mut b = valid();
        b.b[0] = b'X';
        assert!(matches!(parse(&b), Err(GgufError::BadMagic { .. })));
        let mut b = valid();
        b.b[4..8].copy_from_slice(&3u32.to_be_bytes());
        let e = parse(&b).unwrap_err();
        assert!(matches!(e, GgufError::BigEndian { version: 3, .. }), "{e}");
        assert!(e.to_string().contains("big-endian"));
        for v in [0u32, 1, 4, 99] {
            let mut b = valid();
            b.b[4..8].copy_from_slice(&v.to_le_bytes());
            let e = parse(&b).unwrap_err();
            assert!(matches!(e, GgufError::UnsupportedVersion { version, .. } if version == v), "{e}");
        }
    }

    #[test]
    fn absurd_counts_are_refused_before_allocating() {
        for (tensors, kvs, field) in [(u64::MAX, 0, "tensor count"), (0, 1 << 40, "metadata key/value count")] {
            let b = Builder::header(3, tensors, kvs);
            let e = parse(&b).unwrap_err();
            assert!(matches!(&e, GgufError::TooLarge { what, .. } if what == field), "{e}");
        }
        // A string length of 2^63.
        let mut b = Builder::header(3, 0, 1);
        b.u64(1 << 63).u64(0);
        let e = parse(&b).unwrap_err();
        assert!(matches!(&e, GgufError::TooLarge { offset: 0x18, .. }), "{e}");
        // An array of 2^40 u32.
        let mut b = Builder::header(3, 0, 1);
        b.str("k").u32(9).u32(4).u64(1 << 40);
        let e = parse(&b).unwrap_err();
        assert!(e.to_string().contains("element count of key `k`"), "{e}");
    }

    #[test]
    fn value_types_nesting_utf8_bools_and_duplicates_are_checked() {
        let mut b = Builder::header(3, 0, 1);
        b.str("k").u32(13).u32(0);
        let e = parse(&b).unwrap_err();
        assert!(matches!(e, GgufError::UnknownValueType { found: 13, offset: 0x21, .. }), "{e}");
        // Arrays nested past the limit.
        let mut b = Builder::header(3, 0, 1);
        b.str("deep");
        b.u32(9);
        for _ in 0..MAX_ARRAY_DEPTH {
            b.u32(9).u64(1);
        }
        b.u32(0).u64(0);
        let e = parse(&b).unwrap_err();
        assert!(matches!(e, GgufError::TooDeep { .. }), "{e}");
        // Nested within the limit reads.
        let mut b = Builder::header(3, 0, 1);
        b.str("nest").u32(9).u32(9).u64(2).u32(4).u64(1).u32(7).u32(8).u64(1).str("x");
        let f = parse(&b).unwrap();
        let want = Array::Array(vec![Array::U32(vec![7]), Array::String(vec!["x".into()])]);
        assert_eq!(f.get_array("nest").unwrap(), &want);
        // Not UTF-8.
        let mut b = Builder::header(3, 0, 1);
        b.u64(2).b.extend_from_slice(&[0xff, 0xfe]);
        b.u32(0).b.push(0); // a u8 value, so that the key/value count fits
        assert!(matches!(parse(&b), Err(GgufError::NotUtf8 { offset: 0x20, .. })));
        // A bool of 2.
        let mut b = Builder::header(3, 0, 1);
        b.str("flag").u32(7).b.push(2);
        assert!(matches!(parse(&b), Err(GgufError::BadBool { found: 2, .. })));
        // The same key twice.
        let mut b = Builder::header(3, 0, 2);
        b.kv_u32("k", 1).kv_u32("k", 2);
        assert!(matches!(parse(&b), Err(GgufError::DuplicateKey { offset: 0x29, .. })));
    }

    #[test]
    fn alignment_is_read_and_checked() {
        let mut b = Builder::header(3, 1, 1);
        b.kv_u32("general.alignment", 64).tensor("a", &[16], 0, 64).data(64, 128);
        let f = parse(&b).unwrap();
        assert_eq!(f.alignment(), 64);
        assert_eq!(f.data_offset() % 64, 0);
        assert_eq!(f.tensor("a").unwrap().range.start, f.data_offset() + 64);
        for bad in [0u32, 48] {
            let mut b = Builder::header(3, 0, 1);
            b.kv_u32("general.alignment", bad);
            assert!(matches!(parse(&b), Err(GgufError::BadAlignment { .. })), "{bad}");
        }
        let mut b = Builder::header(3, 0, 1);
        b.kv_str("general.alignment", "32");
        let e = parse(&b).unwrap_err();
        assert_eq!(e.to_string(), "t.gguf: general.alignment is string: expected a u32 power of two");
    }

    #[test]
    fn bad_tensor_infos_are_refused_with_the_tensor_named() {
        let one = |dims: &[u64], ty: u32, offset: u64, data: usize| {
            let mut b = Builder::header(3, 1, 0);
            b.tensor("w", dims, ty, offset).data(32, data);
            parse(&b)
        };
        assert!(one(&[32], 8, 0, 34).is_ok());
        assert!(matches!(one(&[32], 4, 0, 34), Err(GgufError::UnknownTensorType { id: 4, .. })));
        assert!(matches!(one(&[], 0, 0, 4), Err(GgufError::BadDimCount { n_dims: 0, .. })));
        assert!(matches!(one(&[1, 1, 1, 1, 1], 0, 0, 4), Err(GgufError::BadDimCount { n_dims: 5, .. })));
        assert!(matches!(one(&[1 << 32, 1 << 32], 0, 0, 4), Err(GgufError::DimsOverflow { .. })));
        assert!(matches!(one(&[1 << 62], 0, 0, 4), Err(GgufError::DimsOverflow { .. })), "bytes past 2^63");
        assert!(matches!(one(&[16], 12, 0, 144), Err(GgufError::PartialBlock { ne0: 16, block: 256, .. })));
        assert!(matches!(one(&[32], 8, 16, 64), Err(GgufError::Misaligned { offset: 16, alignment: 32, .. })));
        let e = one(&[32], 8, 0, 33).unwrap_err();
        assert!(matches!(e, GgufError::TensorPastEnd { .. }), "{e}");
        assert!(e.to_string().starts_with("t.gguf: tensor `w` needs bytes 0x"), "{e}");
        let e = one(&[32], 8, u64::MAX - 31, 34).unwrap_err();
        assert!(matches!(e, GgufError::TensorPastEnd { end: u64::MAX, .. }), "{e}");
        let mut b = Builder::header(3, 2, 0);
        b.tensor("w", &[4], 0, 0).tensor("w", &[4], 0, 32).data(32, 64);
        assert!(matches!(parse(&b), Err(GgufError::DuplicateTensor { .. })));
    }

    #[test]
    fn an_io_error_is_reported_with_its_offset() {
        struct Failing;
        impl Read for Failing {
            fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
                Err(std::io::Error::other("device gone"))
            }
        }
        let e = GgufFile::parse("t.gguf", Failing, 100).unwrap_err();
        assert!(matches!(e, GgufError::Io { offset: 0, .. }), "{e}");
        assert_eq!(crate::error::chain(&e).to_string(), "t.gguf: reading the header at offset 0x0: device gone");
    }
}
