//! GGUF metadata values.

/// Value type ids as GGUF stores them.
pub mod type_id {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(GgufArray),
}

/// Arrays are stored typed (not as `Vec<GgufValue>`) so that memory stays proportional
/// to the bytes in the file: a hostile 100 MB u8 array costs 100 MB, not 3 GB.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<GgufArray>),
}

impl GgufValue {
    pub fn type_id(&self) -> u32 {
        use type_id::*;
        match self {
            Self::U8(_) => U8,
            Self::I8(_) => I8,
            Self::U16(_) => U16,
            Self::I16(_) => I16,
            Self::U32(_) => U32,
            Self::I32(_) => I32,
            Self::U64(_) => U64,
            Self::I64(_) => I64,
            Self::F32(_) => F32,
            Self::F64(_) => F64,
            Self::Bool(_) => BOOL,
            Self::String(_) => STRING,
            Self::Array(_) => ARRAY,
        }
    }

    /// A short name of the type for error messages.
    pub fn type_name(&self) -> &'static str {
        type_name(self.type_id())
    }

    /// Any integer type that holds a non-negative value fitting in u64.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Self::Bool(b) => Some(*b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl GgufArray {
    pub fn elem_type_id(&self) -> u32 {
        use type_id::*;
        match self {
            Self::U8(_) => U8,
            Self::I8(_) => I8,
            Self::U16(_) => U16,
            Self::I16(_) => I16,
            Self::U32(_) => U32,
            Self::I32(_) => I32,
            Self::U64(_) => U64,
            Self::I64(_) => I64,
            Self::F32(_) => F32,
            Self::F64(_) => F64,
            Self::Bool(_) => BOOL,
            Self::String(_) => STRING,
            Self::Array(_) => ARRAY,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Self::U8(v) => v.len(),
            Self::I8(v) => v.len(),
            Self::U16(v) => v.len(),
            Self::I16(v) => v.len(),
            Self::U32(v) => v.len(),
            Self::I32(v) => v.len(),
            Self::U64(v) => v.len(),
            Self::I64(v) => v.len(),
            Self::F32(v) => v.len(),
            Self::F64(v) => v.len(),
            Self::Bool(v) => v.len(),
            Self::String(v) => v.len(),
            Self::Array(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            Self::String(v) => Some(v),
            _ => None,
        }
    }
}

pub fn type_name(id: u32) -> &'static str {
    use type_id::*;
    match id {
        U8 => "u8",
        I8 => "i8",
        U16 => "u16",
        I16 => "i16",
        U32 => "u32",
        I32 => "i32",
        F32 => "f32",
        BOOL => "bool",
        STRING => "string",
        ARRAY => "array",
        U64 => "u64",
        I64 => "i64",
        F64 => "f64",
        _ => "unknown",
    }
}

/// The smallest number of bytes one element of type `id` occupies in a file; bounds
/// element counts by the bytes left. `None` for an unknown type.
pub(crate) fn min_size(id: u32) -> Option<usize> {
    use type_id::*;
    Some(match id {
        U8 | I8 | BOOL => 1,
        U16 | I16 => 2,
        U32 | I32 | F32 => 4,
        U64 | I64 | F64 | STRING => 8,
        ARRAY => 12,
        _ => return None,
    })
}
