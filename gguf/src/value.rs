//! GGUF metadata values: the 13 value types (gguf.h `GGUF_TYPE_*`) and typed arrays.
//!
//! Arrays are stored per element type (`MetaArray::U8(Vec<u8>)`, ...) rather than as
//! `Vec<MetaValue>`, so an array costs about what it takes in the file. Nested arrays are
//! not representable: llama.cpp's reader rejects them and no model file uses them.

use std::fmt;

/// A metadata value type id as written in the file.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    Str = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    const ALL: [ValueType; 13] = [
        ValueType::U8,
        ValueType::I8,
        ValueType::U16,
        ValueType::I16,
        ValueType::U32,
        ValueType::I32,
        ValueType::F32,
        ValueType::Bool,
        ValueType::Str,
        ValueType::Array,
        ValueType::U64,
        ValueType::I64,
        ValueType::F64,
    ];

    /// The type with this id, or `None` for ids past 12.
    pub fn from_id(id: u32) -> Option<ValueType> {
        Self::ALL.get(usize::try_from(id).ok()?).copied()
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    /// The spelling of gguf.h / gguf-py (`"UINT32"`, `"STRING"`).
    pub fn name(self) -> &'static str {
        match self {
            ValueType::U8 => "UINT8",
            ValueType::I8 => "INT8",
            ValueType::U16 => "UINT16",
            ValueType::I16 => "INT16",
            ValueType::U32 => "UINT32",
            ValueType::I32 => "INT32",
            ValueType::F32 => "FLOAT32",
            ValueType::Bool => "BOOL",
            ValueType::Str => "STRING",
            ValueType::Array => "ARRAY",
            ValueType::U64 => "UINT64",
            ValueType::I64 => "INT64",
            ValueType::F64 => "FLOAT64",
        }
    }

    /// Encoded size of one value, or `None` for the variable-size STRING and ARRAY.
    pub fn fixed_size(self) -> Option<usize> {
        match self {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => Some(1),
            ValueType::U16 | ValueType::I16 => Some(2),
            ValueType::U32 | ValueType::I32 | ValueType::F32 => Some(4),
            ValueType::U64 | ValueType::I64 | ValueType::F64 => Some(8),
            ValueType::Str | ValueType::Array => None,
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(MetaArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array: element type and elements, packed as in the file.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    Str(Vec<String>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl MetaValue {
    pub fn value_type(&self) -> ValueType {
        match self {
            MetaValue::U8(_) => ValueType::U8,
            MetaValue::I8(_) => ValueType::I8,
            MetaValue::U16(_) => ValueType::U16,
            MetaValue::I16(_) => ValueType::I16,
            MetaValue::U32(_) => ValueType::U32,
            MetaValue::I32(_) => ValueType::I32,
            MetaValue::F32(_) => ValueType::F32,
            MetaValue::Bool(_) => ValueType::Bool,
            MetaValue::Str(_) => ValueType::Str,
            MetaValue::Array(_) => ValueType::Array,
            MetaValue::U64(_) => ValueType::U64,
            MetaValue::I64(_) => ValueType::I64,
            MetaValue::F64(_) => ValueType::F64,
        }
    }

    /// `"UINT32"`, or `"ARRAY of STRING"` for arrays.
    pub fn type_description(&self) -> String {
        match self {
            MetaValue::Array(a) => format!("ARRAY of {}", a.element_type()),
            v => v.value_type().name().to_string(),
        }
    }

    /// Any integer as i128 (which holds every u64 and i64 exactly); `None` for other types.
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Any float or integer as f64; `None` for other types.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_integer().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&MetaArray> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl MetaArray {
    pub fn element_type(&self) -> ValueType {
        match self {
            MetaArray::U8(_) => ValueType::U8,
            MetaArray::I8(_) => ValueType::I8,
            MetaArray::U16(_) => ValueType::U16,
            MetaArray::I16(_) => ValueType::I16,
            MetaArray::U32(_) => ValueType::U32,
            MetaArray::I32(_) => ValueType::I32,
            MetaArray::F32(_) => ValueType::F32,
            MetaArray::Bool(_) => ValueType::Bool,
            MetaArray::Str(_) => ValueType::Str,
            MetaArray::U64(_) => ValueType::U64,
            MetaArray::I64(_) => ValueType::I64,
            MetaArray::F64(_) => ValueType::F64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            MetaArray::U8(v) => v.len(),
            MetaArray::I8(v) => v.len(),
            MetaArray::U16(v) => v.len(),
            MetaArray::I16(v) => v.len(),
            MetaArray::U32(v) => v.len(),
            MetaArray::I32(v) => v.len(),
            MetaArray::F32(v) => v.len(),
            MetaArray::Bool(v) => v.len(),
            MetaArray::Str(v) => v.len(),
            MetaArray::U64(v) => v.len(),
            MetaArray::I64(v) => v.len(),
            MetaArray::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as a scalar value (cloned), or `None` past the end.
    pub fn get(&self, i: usize) -> Option<MetaValue> {
        Some(match self {
            MetaArray::U8(v) => MetaValue::U8(*v.get(i)?),
            MetaArray::I8(v) => MetaValue::I8(*v.get(i)?),
            MetaArray::U16(v) => MetaValue::U16(*v.get(i)?),
            MetaArray::I16(v) => MetaValue::I16(*v.get(i)?),
            MetaArray::U32(v) => MetaValue::U32(*v.get(i)?),
            MetaArray::I32(v) => MetaValue::I32(*v.get(i)?),
            MetaArray::F32(v) => MetaValue::F32(*v.get(i)?),
            MetaArray::Bool(v) => MetaValue::Bool(*v.get(i)?),
            MetaArray::Str(v) => MetaValue::Str(v.get(i)?.clone()),
            MetaArray::U64(v) => MetaValue::U64(*v.get(i)?),
            MetaArray::I64(v) => MetaValue::I64(*v.get(i)?),
            MetaArray::F64(v) => MetaValue::F64(*v.get(i)?),
        })
    }

    /// Writes element `i` for humans; strings are quoted and escaped.
    fn fmt_element(&self, i: usize, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetaArray::Str(v) => write!(f, "{:?}", v.get(i).map_or("", String::as_str)),
            _ => match self.get(i) {
                Some(value) => write!(f, "{value}"),
                None => Ok(()),
            },
        }
    }
}

/// Arrays longer than this are shown as their first elements plus a count.
const DISPLAY_ARRAY_HEAD: usize = 8;

impl fmt::Display for MetaArray {
    /// `[1, 2, 3]` for short arrays; `[STRING × 262144: "<pad>", "<eos>", …]` for long ones,
    /// so that printing a vocabulary never dumps it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let len = self.len();
        f.write_str("[")?;
        if len > DISPLAY_ARRAY_HEAD {
            write!(f, "{} × {len}: ", self.element_type())?;
        }
        for i in 0..len.min(DISPLAY_ARRAY_HEAD) {
            if i > 0 {
                f.write_str(", ")?;
            }
            self.fmt_element(i, f)?;
        }
        if len > DISPLAY_ARRAY_HEAD {
            f.write_str(", …")?;
        }
        f.write_str("]")
    }
}

impl fmt::Display for MetaValue {
    /// Numbers and booleans as Rust prints them, strings unquoted, arrays summarized.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetaValue::U8(v) => write!(f, "{v}"),
            MetaValue::I8(v) => write!(f, "{v}"),
            MetaValue::U16(v) => write!(f, "{v}"),
            MetaValue::I16(v) => write!(f, "{v}"),
            MetaValue::U32(v) => write!(f, "{v}"),
            MetaValue::I32(v) => write!(f, "{v}"),
            MetaValue::F32(v) => write!(f, "{v}"),
            MetaValue::Bool(v) => write!(f, "{v}"),
            MetaValue::Str(v) => f.write_str(v),
            MetaValue::Array(v) => write!(f, "{v}"),
            MetaValue::U64(v) => write!(f, "{v}"),
            MetaValue::I64(v) => write!(f, "{v}"),
            MetaValue::F64(v) => write!(f, "{v}"),
        }
    }
}

macro_rules! impl_from {
    ($($t:ty => $variant:ident),* $(,)?) => {$(
        impl From<$t> for MetaValue {
            fn from(v: $t) -> Self {
                MetaValue::$variant(v)
            }
        }
        impl From<Vec<$t>> for MetaArray {
            fn from(v: Vec<$t>) -> Self {
                MetaArray::$variant(v)
            }
        }
        impl From<Vec<$t>> for MetaValue {
            fn from(v: Vec<$t>) -> Self {
                MetaValue::Array(MetaArray::$variant(v))
            }
        }
    )*};
}

impl_from!(
    u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, String => Str, u64 => U64, i64 => I64, f64 => F64,
);

impl From<&str> for MetaValue {
    fn from(v: &str) -> Self {
        MetaValue::Str(v.to_string())
    }
}

impl From<Vec<&str>> for MetaValue {
    fn from(v: Vec<&str>) -> Self {
        MetaValue::Array(MetaArray::Str(v.into_iter().map(str::to_string).collect()))
    }
}

impl From<MetaArray> for MetaValue {
    fn from(v: MetaArray) -> Self {
        MetaValue::Array(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_ids_round_trip() {
        for id in 0..13 {
            assert_eq!(ValueType::from_id(id).map(ValueType::id), Some(id));
        }
        assert_eq!(ValueType::from_id(13), None);
        assert_eq!(ValueType::from_id(u32::MAX), None);
    }

    #[test]
    fn long_arrays_are_summarized() {
        let tokens: Vec<String> = (0..1000).map(|i| format!("tok{i}")).collect();
        let shown = MetaValue::from(tokens).to_string();
        assert!(shown.starts_with("[STRING × 1000: \"tok0\", \"tok1\""), "{shown}");
        assert!(shown.ends_with(", …]"), "{shown}");
        assert!(!shown.contains("tok8"), "{shown}");
        assert_eq!(MetaValue::from(vec![1i32, -2]).to_string(), "[1, -2]");
    }

    #[test]
    fn integers_widen_exactly() {
        assert_eq!(MetaValue::U64(u64::MAX).as_integer(), Some(u64::MAX as i128));
        assert_eq!(MetaValue::I8(-3).as_integer(), Some(-3));
        assert_eq!(MetaValue::F32(1.0).as_integer(), None);
        assert_eq!(MetaValue::I32(7).as_f64(), Some(7.0));
    }
}
