//! GGUF metadata values: the 13 value types (gguf.h `GGUF_TYPE_*`) and typed arrays.
//!
//! Arrays are stored per element type (`MetaArray::U8(Vec<u8>)`, ...) rather than as
//! `Vec<MetaValue>`, so an array costs about what it takes in the file. Nested arrays are
//! not representable: llama.cpp's reader rejects them and no model file uses them.
//!
//! The reader hands out borrowed forms ([`MetaValueRef`], [`MetaArrayRef`], [`NumArray`],
//! [`StrArray`]) that point into the file's bytes, so parsing allocates no strings.

use std::fmt;
use std::marker::PhantomData;

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
        fmt_array(self.element_type(), self.len(), f, |i, f| self.fmt_element(i, f))
    }
}

fn fmt_array(
    element_type: ValueType,
    len: usize,
    f: &mut fmt::Formatter<'_>,
    mut element: impl FnMut(usize, &mut fmt::Formatter<'_>) -> fmt::Result,
) -> fmt::Result {
    f.write_str("[")?;
    if len > DISPLAY_ARRAY_HEAD {
        write!(f, "{element_type} × {len}: ")?;
    }
    for i in 0..len.min(DISPLAY_ARRAY_HEAD) {
        if i > 0 {
            f.write_str(", ")?;
        }
        element(i, f)?;
    }
    if len > DISPLAY_ARRAY_HEAD {
        f.write_str(", …")?;
    }
    f.write_str("]")
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

// ---- borrowed values, as the reader hands them out ----

/// An array element type that can be read from its little-endian encoding in the file.
pub trait Element: Copy + sealed::Sealed + 'static {
    /// Encoded size in bytes.
    const SIZE: usize;
    #[doc(hidden)]
    fn from_le(raw: &[u8]) -> Self;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! impl_element {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            fn from_le(raw: &[u8]) -> Self {
                let mut bytes = [0u8; std::mem::size_of::<$t>()];
                bytes.copy_from_slice(raw);
                <$t>::from_le_bytes(bytes)
            }
        }
    )*};
}

impl_element!(u8, i8, u16, i16, u32, i32, f32, u64, i64, f64);

impl sealed::Sealed for bool {}
impl Element for bool {
    const SIZE: usize = 1;
    /// The reader has checked every byte is 0 or 1.
    fn from_le(raw: &[u8]) -> Self {
        raw.first().is_some_and(|&b| b != 0)
    }
}

/// A numeric (or BOOL) metadata array borrowed from the file: elements are decoded on
/// access, because the file does not align them.
#[derive(Clone, Copy, PartialEq)]
pub struct NumArray<'a, T> {
    raw: &'a [u8],
    _element: PhantomData<T>,
}

impl<'a, T: Element> NumArray<'a, T> {
    /// `raw` holds a whole number of elements (the reader checked it).
    pub(crate) fn new(raw: &'a [u8]) -> Self {
        NumArray { raw, _element: PhantomData }
    }

    pub fn len(&self) -> usize {
        self.raw.len() / T::SIZE
    }

    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
    }

    pub fn get(&self, i: usize) -> Option<T> {
        let start = i.checked_mul(T::SIZE)?;
        self.raw.get(start..start.checked_add(T::SIZE)?).map(T::from_le)
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = T> + 'a {
        self.raw.chunks_exact(T::SIZE).map(T::from_le)
    }

    pub fn to_vec(&self) -> Vec<T> {
        self.iter().collect()
    }
}

impl<T: Element + fmt::Debug> fmt::Debug for NumArray<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// An array of STRING borrowed from the file. It keeps the file offset of each element's
/// 8-byte length prefix (4 bytes per element, less than the file spends on it); the reader
/// has checked every element is UTF-8 and inside the file.
#[derive(Clone, Copy)]
pub struct StrArray<'a> {
    file: &'a [u8],
    starts: &'a [u32],
}

impl<'a> StrArray<'a> {
    pub(crate) fn new(file: &'a [u8], starts: &'a [u32]) -> Self {
        StrArray { file, starts }
    }

    pub fn len(&self) -> usize {
        self.starts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.starts.is_empty()
    }

    /// Element `i`, or `None` past the end.
    pub fn get(&self, i: usize) -> Option<&'a str> {
        let start = usize::try_from(*self.starts.get(i)?).ok()?;
        let body = start.checked_add(8)?;
        let len = <u64 as Element>::from_le(self.file.get(start..body)?);
        let end = body.checked_add(usize::try_from(len).ok()?)?;
        std::str::from_utf8(self.file.get(body..end)?).ok()
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = &'a str> + 'a {
        let this = *self;
        (0..self.len()).map(move |i| this.get(i).unwrap_or_default())
    }

    pub fn to_vec(&self) -> Vec<String> {
        self.iter().map(str::to_string).collect()
    }
}

impl fmt::Debug for StrArray<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl PartialEq for StrArray<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl<S: AsRef<str>> PartialEq<[S]> for StrArray<'_> {
    fn eq(&self, other: &[S]) -> bool {
        self.len() == other.len() && self.iter().zip(other).all(|(a, b)| a == b.as_ref())
    }
}

impl<S: AsRef<str>, const N: usize> PartialEq<[S; N]> for StrArray<'_> {
    fn eq(&self, other: &[S; N]) -> bool {
        *self == other[..]
    }
}

/// A metadata value borrowed from the file ([`MetaValue`] is the owned form the writer takes).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MetaValueRef<'a> {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(&'a str),
    Array(MetaArrayRef<'a>),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array borrowed from the file, per element type.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MetaArrayRef<'a> {
    U8(NumArray<'a, u8>),
    I8(NumArray<'a, i8>),
    U16(NumArray<'a, u16>),
    I16(NumArray<'a, i16>),
    U32(NumArray<'a, u32>),
    I32(NumArray<'a, i32>),
    F32(NumArray<'a, f32>),
    Bool(NumArray<'a, bool>),
    Str(StrArray<'a>),
    U64(NumArray<'a, u64>),
    I64(NumArray<'a, i64>),
    F64(NumArray<'a, f64>),
}

impl<'a> MetaValueRef<'a> {
    pub fn value_type(&self) -> ValueType {
        match self {
            MetaValueRef::U8(_) => ValueType::U8,
            MetaValueRef::I8(_) => ValueType::I8,
            MetaValueRef::U16(_) => ValueType::U16,
            MetaValueRef::I16(_) => ValueType::I16,
            MetaValueRef::U32(_) => ValueType::U32,
            MetaValueRef::I32(_) => ValueType::I32,
            MetaValueRef::F32(_) => ValueType::F32,
            MetaValueRef::Bool(_) => ValueType::Bool,
            MetaValueRef::Str(_) => ValueType::Str,
            MetaValueRef::Array(_) => ValueType::Array,
            MetaValueRef::U64(_) => ValueType::U64,
            MetaValueRef::I64(_) => ValueType::I64,
            MetaValueRef::F64(_) => ValueType::F64,
        }
    }

    /// `"UINT32"`, or `"ARRAY of STRING"` for arrays.
    pub fn type_description(&self) -> String {
        match self {
            MetaValueRef::Array(a) => format!("ARRAY of {}", a.element_type()),
            v => v.value_type().name().to_string(),
        }
    }

    /// Any integer as i128 (which holds every u64 and i64 exactly); `None` for other types.
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            MetaValueRef::U8(v) => v.into(),
            MetaValueRef::I8(v) => v.into(),
            MetaValueRef::U16(v) => v.into(),
            MetaValueRef::I16(v) => v.into(),
            MetaValueRef::U32(v) => v.into(),
            MetaValueRef::I32(v) => v.into(),
            MetaValueRef::U64(v) => v.into(),
            MetaValueRef::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Any float or integer as f64; `None` for other types.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValueRef::F32(v) => Some(v.into()),
            MetaValueRef::F64(v) => Some(v),
            _ => self.as_integer().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValueRef::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&'a str> {
        match *self {
            MetaValueRef::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<MetaArrayRef<'a>> {
        match *self {
            MetaValueRef::Array(a) => Some(a),
            _ => None,
        }
    }

    /// An owned copy (e.g. to hand to [`crate::GgufWriter`]).
    pub fn into_owned(self) -> MetaValue {
        match self {
            MetaValueRef::U8(v) => MetaValue::U8(v),
            MetaValueRef::I8(v) => MetaValue::I8(v),
            MetaValueRef::U16(v) => MetaValue::U16(v),
            MetaValueRef::I16(v) => MetaValue::I16(v),
            MetaValueRef::U32(v) => MetaValue::U32(v),
            MetaValueRef::I32(v) => MetaValue::I32(v),
            MetaValueRef::F32(v) => MetaValue::F32(v),
            MetaValueRef::Bool(v) => MetaValue::Bool(v),
            MetaValueRef::Str(v) => MetaValue::Str(v.to_string()),
            MetaValueRef::Array(v) => MetaValue::Array(v.into_owned()),
            MetaValueRef::U64(v) => MetaValue::U64(v),
            MetaValueRef::I64(v) => MetaValue::I64(v),
            MetaValueRef::F64(v) => MetaValue::F64(v),
        }
    }
}

impl From<MetaValueRef<'_>> for MetaValue {
    fn from(v: MetaValueRef<'_>) -> Self {
        v.into_owned()
    }
}

impl PartialEq<MetaValue> for MetaValueRef<'_> {
    fn eq(&self, other: &MetaValue) -> bool {
        self.into_owned() == *other
    }
}

impl<'a> MetaArrayRef<'a> {
    pub fn element_type(&self) -> ValueType {
        match self {
            MetaArrayRef::U8(_) => ValueType::U8,
            MetaArrayRef::I8(_) => ValueType::I8,
            MetaArrayRef::U16(_) => ValueType::U16,
            MetaArrayRef::I16(_) => ValueType::I16,
            MetaArrayRef::U32(_) => ValueType::U32,
            MetaArrayRef::I32(_) => ValueType::I32,
            MetaArrayRef::F32(_) => ValueType::F32,
            MetaArrayRef::Bool(_) => ValueType::Bool,
            MetaArrayRef::Str(_) => ValueType::Str,
            MetaArrayRef::U64(_) => ValueType::U64,
            MetaArrayRef::I64(_) => ValueType::I64,
            MetaArrayRef::F64(_) => ValueType::F64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            MetaArrayRef::U8(v) => v.len(),
            MetaArrayRef::I8(v) => v.len(),
            MetaArrayRef::U16(v) => v.len(),
            MetaArrayRef::I16(v) => v.len(),
            MetaArrayRef::U32(v) => v.len(),
            MetaArrayRef::I32(v) => v.len(),
            MetaArrayRef::F32(v) => v.len(),
            MetaArrayRef::Bool(v) => v.len(),
            MetaArrayRef::Str(v) => v.len(),
            MetaArrayRef::U64(v) => v.len(),
            MetaArrayRef::I64(v) => v.len(),
            MetaArrayRef::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as a scalar value, or `None` past the end.
    pub fn get(&self, i: usize) -> Option<MetaValueRef<'a>> {
        Some(match self {
            MetaArrayRef::U8(v) => MetaValueRef::U8(v.get(i)?),
            MetaArrayRef::I8(v) => MetaValueRef::I8(v.get(i)?),
            MetaArrayRef::U16(v) => MetaValueRef::U16(v.get(i)?),
            MetaArrayRef::I16(v) => MetaValueRef::I16(v.get(i)?),
            MetaArrayRef::U32(v) => MetaValueRef::U32(v.get(i)?),
            MetaArrayRef::I32(v) => MetaValueRef::I32(v.get(i)?),
            MetaArrayRef::F32(v) => MetaValueRef::F32(v.get(i)?),
            MetaArrayRef::Bool(v) => MetaValueRef::Bool(v.get(i)?),
            MetaArrayRef::Str(v) => MetaValueRef::Str(v.get(i)?),
            MetaArrayRef::U64(v) => MetaValueRef::U64(v.get(i)?),
            MetaArrayRef::I64(v) => MetaValueRef::I64(v.get(i)?),
            MetaArrayRef::F64(v) => MetaValueRef::F64(v.get(i)?),
        })
    }

    /// An owned copy.
    pub fn into_owned(self) -> MetaArray {
        match self {
            MetaArrayRef::U8(v) => MetaArray::U8(v.to_vec()),
            MetaArrayRef::I8(v) => MetaArray::I8(v.to_vec()),
            MetaArrayRef::U16(v) => MetaArray::U16(v.to_vec()),
            MetaArrayRef::I16(v) => MetaArray::I16(v.to_vec()),
            MetaArrayRef::U32(v) => MetaArray::U32(v.to_vec()),
            MetaArrayRef::I32(v) => MetaArray::I32(v.to_vec()),
            MetaArrayRef::F32(v) => MetaArray::F32(v.to_vec()),
            MetaArrayRef::Bool(v) => MetaArray::Bool(v.to_vec()),
            MetaArrayRef::Str(v) => MetaArray::Str(v.to_vec()),
            MetaArrayRef::U64(v) => MetaArray::U64(v.to_vec()),
            MetaArrayRef::I64(v) => MetaArray::I64(v.to_vec()),
            MetaArrayRef::F64(v) => MetaArray::F64(v.to_vec()),
        }
    }
}

impl fmt::Display for MetaArrayRef<'_> {
    /// As [`MetaArray`]'s: long arrays are summarized.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt_array(self.element_type(), self.len(), f, |i, f| match self.get(i) {
            Some(MetaValueRef::Str(s)) => write!(f, "{s:?}"),
            Some(value) => write!(f, "{value}"),
            None => Ok(()),
        })
    }
}

impl fmt::Display for MetaValueRef<'_> {
    /// Numbers and booleans as Rust prints them, strings unquoted, arrays summarized.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetaValueRef::U8(v) => write!(f, "{v}"),
            MetaValueRef::I8(v) => write!(f, "{v}"),
            MetaValueRef::U16(v) => write!(f, "{v}"),
            MetaValueRef::I16(v) => write!(f, "{v}"),
            MetaValueRef::U32(v) => write!(f, "{v}"),
            MetaValueRef::I32(v) => write!(f, "{v}"),
            MetaValueRef::F32(v) => write!(f, "{v}"),
            MetaValueRef::Bool(v) => write!(f, "{v}"),
            MetaValueRef::Str(v) => f.write_str(v),
            MetaValueRef::Array(v) => write!(f, "{v}"),
            MetaValueRef::U64(v) => write!(f, "{v}"),
            MetaValueRef::I64(v) => write!(f, "{v}"),
            MetaValueRef::F64(v) => write!(f, "{v}"),
        }
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
