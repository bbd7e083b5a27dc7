//! GGUF metadata values: the thirteen value types (`gguf_type` in llama.cpp's `gguf.h`, gguf-py's
//! `GGUFValueType`) and their Rust form. Arrays keep one typed `Vec` per element type, so a
//! 150,000-token vocabulary is one `Vec<String>`, not 150,000 tagged values.

/// A metadata value type, by its id in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueType {
    /// 0: u8.
    U8,
    /// 1: i8.
    I8,
    /// 2: u16.
    U16,
    /// 3: i16.
    I16,
    /// 4: u32.
    U32,
    /// 5: i32.
    I32,
    /// 6: f32.
    F32,
    /// 7: bool (one byte, 0 or 1).
    Bool,
    /// 8: string (u64 length, UTF-8 bytes, no terminator).
    String,
    /// 9: array (u32 element type, u64 count, elements).
    Array,
    /// 10: u64.
    U64,
    /// 11: i64.
    I64,
    /// 12: f64.
    F64,
}

impl ValueType {
    /// The type with id `id`, or `None`.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The fewest bytes one value of this type takes in the file (a string's or array's header):
    /// what bounds a count read from the file by the bytes left.
    pub fn min_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }

    /// The name used in messages ("u32", "array").
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// u8.
    U8(u8),
    /// i8.
    I8(i8),
    /// u16.
    U16(u16),
    /// i16.
    I16(i16),
    /// u32.
    U32(u32),
    /// i32.
    I32(i32),
    /// f32.
    F32(f32),
    /// bool.
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// An array of one element type.
    Array(Array),
    /// u64.
    U64(u64),
    /// i64.
    I64(i64),
    /// f64.
    F64(f64),
}

/// A metadata array: its elements, all of one type.
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    /// u8 elements.
    U8(Vec<u8>),
    /// i8 elements.
    I8(Vec<i8>),
    /// u16 elements.
    U16(Vec<u16>),
    /// i16 elements.
    I16(Vec<i16>),
    /// u32 elements.
    U32(Vec<u32>),
    /// i32 elements.
    I32(Vec<i32>),
    /// f32 elements.
    F32(Vec<f32>),
    /// bool elements.
    Bool(Vec<bool>),
    /// String elements.
    String(Vec<String>),
    /// Array elements (each with its own element type).
    Array(Vec<Array>),
    /// u64 elements.
    U64(Vec<u64>),
    /// i64 elements.
    I64(Vec<i64>),
    /// f64 elements.
    F64(Vec<f64>),
}

impl Value {
    /// This value's type.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// An integer value of any width and signedness as a `u64`, or `None` for a negative integer or
    /// a value of another type (llama.cpp's split keys are u16, some writers use u32 or i32).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// What messages call this value's type: "u32", or "array of string".
    pub fn type_name(&self) -> String {
        match self {
            Value::Array(a) => format!("array of {}", a.elem_type().name()),
            v => v.value_type().name().to_owned(),
        }
    }
}

impl Array {
    /// The element type.
    pub fn elem_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::F32(_) => ValueType::F32,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F64(_) => ValueType::F64,
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
