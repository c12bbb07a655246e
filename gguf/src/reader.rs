//! Zero-copy GGUF reader: parses the header (metadata and tensor infos) and hands out tensor
//! data as slices of the memory map or buffer. Layout: `shared/reference/model-specs.md` §1.1.
//!
//! Every count, length, offset and shape is checked before use, with checked arithmetic.
//! Allocation is bounded by the input: a count is compared with the bytes left before
//! anything is reserved for it (an array of N strings needs at least 8·N bytes, so its
//! `Vec<String>` costs at most about 3× the bytes it was read from).
//!
//! Choices where the spec or llama.cpp leave room (all rejected inputs get an error):
//! - Versions 2 and 3 are read (same layout); 0, 1, > 3 and big-endian files are rejected.
//! - Nested arrays are rejected, as llama.cpp's `gguf.cpp` does.
//! - Strings (keys, values, tensor names) must be UTF-8. Keys are at most 65535 bytes;
//!   tensor names at most 63 bytes (ggml's `GGML_MAX_NAME` is 64 including the NUL).
//! - Tensors have 1 to 4 dimensions, each at least 1 and at most `i64::MAX` (ggml stores
//!   them as int64); empty tensors are rejected. The element count must fit in an int64.
//! - `general.alignment` must be a UINT32 power of two (llama.cpp's rule; the spec's extra
//!   "multiple of 8" is not enforced). Default 32.
//! - Tensor offsets must be multiples of the alignment, and tensors must lie inside the file
//!   and not overlap. Unlike llama.cpp, tensors need not be packed in info order.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::GgmlType;
use crate::error::{ErrorKind, GgufError, Result};
use crate::value::{MetaArray, MetaValue, ValueType};

pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// The version the writer emits. Version 2 has the same layout and is read too.
pub const GGUF_VERSION: u32 = 3;
pub const DEFAULT_ALIGNMENT: u32 = 32;
pub const ALIGNMENT_KEY: &str = "general.alignment";
pub const ARCHITECTURE_KEY: &str = "general.architecture";
pub const MAX_KEY_LEN: usize = 65535;
/// ggml's `GGML_MAX_NAME` (64) counts the terminating NUL.
pub const MAX_TENSOR_NAME_LEN: usize = 63;
pub const MAX_DIMS: usize = 4;

/// Smallest possible encodings, used to bound counts before reserving memory for them.
const MIN_KV_BYTES: u64 = 8 + 4 + 1; // empty key, type, 1-byte value
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8; // empty name, n_dims, one dim, type, offset

/// One tensor's description from the header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Exactly as written in the file (`blk.3.attn_q.weight`).
    pub name: String,
    /// ggml `ne`: fastest-varying first, so `dims[0]` is the contiguous row length.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Byte offset of the data relative to the start of the data section.
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Product of the dims (saturating; the reader has checked it fits in an i64).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).unwrap_or(u64::MAX)
    }

    /// `ne0`, the number of elements in one contiguous row.
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(0)
    }

    /// Number of rows: the product of `dims[1..]`.
    pub fn n_rows(&self) -> u64 {
        self.n_elements().checked_div(self.row_len()).unwrap_or(0)
    }

    /// Bytes of one row (`nb1`).
    pub fn row_bytes(&self) -> u64 {
        self.ggml_type.row_bytes(self.row_len()).unwrap_or(0)
    }
}

/// A parsed GGUF file over any byte container: `Gguf<Mmap>` (= [`GgufFile`]) for files,
/// `Gguf<&[u8]>` or `Gguf<Vec<u8>>` for buffers.
pub struct Gguf<B> {
    bytes: B,
    path: Option<PathBuf>,
    header: Header,
}

/// A GGUF file opened with [`GgufFile::open`] and read through a memory map.
pub type GgufFile = Gguf<Mmap>;

struct Header {
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u32,
    data_offset: u64,
}

impl GgufFile {
    /// Maps the file read-only and parses its header. Errors name the file.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| GgufError::io(path, e))?;
        let len = file.metadata().map_err(|e| GgufError::io(path, e))?.len();
        if len == 0 {
            return Err(GgufError::format_at(0, "file is empty").in_file(Some(path)));
        }
        // SAFETY: the map is read-only and lives as long as `Gguf`, and every slice handed
        // out borrows it. Another process truncating or rewriting the file while it is
        // mapped would change the bytes under us; like llama.cpp we accept that for model
        // files, which are not modified in place.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| GgufError::io(path, e))?;
        Self::from_parts(map, Some(path))
    }
}

impl<B: AsRef<[u8]>> Gguf<B> {
    /// Parses a GGUF image held in memory (tests, fuzzing, embedded files).
    pub fn parse(bytes: B) -> Result<Self> {
        Self::from_parts(bytes, None)
    }

    fn from_parts(bytes: B, path: Option<&Path>) -> Result<Self> {
        let header = parse_header(bytes.as_ref()).map_err(|e| e.in_file(path))?;
        Ok(Gguf { bytes, path: path.map(Path::to_path_buf), header })
    }

    /// The file this was opened from, if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.bytes.as_ref()
    }

    pub fn version(&self) -> u32 {
        self.header.version
    }

    pub fn alignment(&self) -> u32 {
        self.header.alignment
    }

    /// Absolute file offset of the data section; tensor offsets are relative to it.
    pub fn data_offset(&self) -> u64 {
        self.header.data_offset
    }

    /// All key/value pairs in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.header.metadata
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        let &i = self.header.key_index.get(key)?;
        self.header.metadata.get(i).map(|(_, v)| v)
    }

    /// All tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        let &i = self.header.tensor_index.get(name)?;
        self.header.tensors.get(i)
    }

    /// The tensor's bytes, borrowed from the map. The reader checked at parse time that
    /// every tensor of this file lies inside it; a `TensorInfo` from another file that does
    /// not fit yields an empty slice.
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        self.data_range(info).and_then(|r| self.bytes().get(r)).unwrap_or(&[])
    }

    /// The bytes of the tensor called `name`, or an error naming it.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let info = self
            .tensor(name)
            .ok_or_else(|| self.err(ErrorKind::MissingTensor(name.to_string())))?;
        Ok(self.tensor_data(info))
    }

    fn data_range(&self, info: &TensorInfo) -> Option<std::ops::Range<usize>> {
        let start = self.header.data_offset.checked_add(info.offset)?;
        let end = start.checked_add(info.n_bytes)?;
        Some(usize::try_from(start).ok()?..usize::try_from(end).ok()?)
    }

    /// `general.architecture`, e.g. `"gemma3"`.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str(ARCHITECTURE_KEY)
    }

    /// `"{arch}.{suffix}"`, e.g. `arch_key("block_count")` → `"gemma3.block_count"`.
    pub fn arch_key(&self, suffix: &str) -> Result<String> {
        Ok(format!("{}.{suffix}", self.architecture()?))
    }

    fn err(&self, kind: ErrorKind) -> GgufError {
        GgufError::new(kind).in_file(self.path())
    }

    fn require(&self, key: &str) -> Result<&MetaValue> {
        self.get(key).ok_or_else(|| self.err(ErrorKind::MissingKey(key.to_string())))
    }

    fn wrong_type(&self, key: &str, expected: &'static str, found: &MetaValue) -> GgufError {
        self.err(ErrorKind::WrongType {
            key: key.to_string(),
            expected,
            found: found.type_description(),
        })
    }

    /// Any integer type, converted to `T` or an error naming the key and value.
    fn get_int<T: TryFrom<i128>>(&self, key: &str, target: &'static str) -> Result<T> {
        let value = self.require(key)?;
        let int = value.as_integer().ok_or_else(|| self.wrong_type(key, "an integer", value))?;
        T::try_from(int).map_err(|_| {
            self.err(ErrorKind::OutOfRange { key: key.to_string(), value: int.to_string(), target })
        })
    }

    /// Any integer width and signedness; negative values are an error.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get_int(key, "u64")
    }

    /// Any integer width and signedness; negative or too large values are an error.
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.get_int(key, "u32")
    }

    /// Any integer width and signedness; negative or too large values are an error.
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        self.get_int(key, "usize")
    }

    /// Any integer width and signedness that fits in an i64.
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.get_int(key, "i64")
    }

    /// FLOAT32, FLOAT64 (rounded) or any integer (converted).
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.get_f64(key).map(|v| v as f32)
    }

    /// FLOAT32, FLOAT64 or any integer (converted).
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let value = self.require(key)?;
        value.as_f64().ok_or_else(|| self.wrong_type(key, "a number", value))
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        let value = self.require(key)?;
        value.as_bool().ok_or_else(|| self.wrong_type(key, "BOOL", value))
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        let value = self.require(key)?;
        value.as_str().ok_or_else(|| self.wrong_type(key, "STRING", value))
    }

    pub fn get_array(&self, key: &str) -> Result<&MetaArray> {
        let value = self.require(key)?;
        value.as_array().ok_or_else(|| self.wrong_type(key, "ARRAY", value))
    }

    /// An ARRAY of STRING (e.g. `tokenizer.ggml.tokens`, `tokenizer.ggml.merges`).
    pub fn get_str_array(&self, key: &str) -> Result<&[String]> {
        match self.require(key)? {
            MetaValue::Array(MetaArray::Str(v)) => Ok(v),
            other => Err(self.wrong_type(key, "ARRAY of STRING", other)),
        }
    }

    /// An ARRAY of FLOAT32 (e.g. `tokenizer.ggml.scores`).
    pub fn get_f32_array(&self, key: &str) -> Result<&[f32]> {
        match self.require(key)? {
            MetaValue::Array(MetaArray::F32(v)) => Ok(v),
            other => Err(self.wrong_type(key, "ARRAY of FLOAT32", other)),
        }
    }

    /// An ARRAY of INT32 (e.g. `tokenizer.ggml.token_type`).
    pub fn get_i32_array(&self, key: &str) -> Result<&[i32]> {
        match self.require(key)? {
            MetaValue::Array(MetaArray::I32(v)) => Ok(v),
            other => Err(self.wrong_type(key, "ARRAY of INT32", other)),
        }
    }

    /// An array of any integer type (per-layer hparams), each element converted to u64;
    /// negative elements are an error.
    pub fn get_u64_array(&self, key: &str) -> Result<Vec<u64>> {
        let array = self.get_array(key)?;
        let mut out = Vec::with_capacity(array.len());
        for i in 0..array.len() {
            let element = array.get(i).unwrap_or(MetaValue::U8(0));
            let int = element.as_integer().ok_or_else(|| {
                self.err(ErrorKind::WrongType {
                    key: key.to_string(),
                    expected: "ARRAY of integers",
                    found: format!("ARRAY of {}", array.element_type()),
                })
            })?;
            let v = u64::try_from(int).map_err(|_| {
                self.err(ErrorKind::OutOfRange {
                    key: format!("{key}[{i}]"),
                    value: int.to_string(),
                    target: "u64",
                })
            })?;
            out.push(v);
        }
        Ok(out)
    }
}

impl<B> fmt::Debug for Gguf<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gguf")
            .field("path", &self.path)
            .field("version", &self.header.version)
            .field("metadata_keys", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .field("alignment", &self.header.alignment)
            .field("data_offset", &self.header.data_offset)
            .finish()
    }
}

/// What is being read, for error messages. Cheap to pass; formatted only on error.
#[derive(Clone, Copy)]
enum Ctx<'k> {
    Header(&'static str),
    KeyName(u64),
    Value(&'k str),
    Element(&'k str, u64),
    TensorName(u64),
    Tensor(&'k str, &'static str),
}

impl fmt::Display for Ctx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Ctx::Header(field) => write!(f, "the header ({field})"),
            Ctx::KeyName(i) => write!(f, "the name of metadata key #{i}"),
            Ctx::Value(key) => write!(f, "the value of key '{key}'"),
            Ctx::Element(key, i) => write!(f, "element {i} of key '{key}'"),
            Ctx::TensorName(i) => write!(f, "the name of tensor #{i}"),
            Ctx::Tensor(name, field) => write!(f, "the {field} of tensor '{name}'"),
        }
    }
}

/// At most this many characters of an untrusted string go into an error message.
fn shorten(s: &str) -> String {
    const MAX_CHARS: usize = 80;
    match s.char_indices().nth(MAX_CHARS) {
        Some((cut, _)) => format!("{}…", &s[..cut]),
        None => s.to_string(),
    }
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn take(&mut self, n: usize, ctx: Ctx<'_>) -> Result<&'a [u8]> {
        let slice = self.pos.checked_add(n).and_then(|end| self.bytes.get(self.pos..end));
        match slice {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => Err(GgufError::format_at(
                self.offset(),
                format!(
                    "unexpected end of file in {ctx}: need {n} bytes, {} left",
                    self.remaining()
                ),
            )),
        }
    }

    fn take_array<const N: usize>(&mut self, ctx: Ctx<'_>) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, ctx)?);
        Ok(out)
    }

    fn u8(&mut self, ctx: Ctx<'_>) -> Result<u8> {
        self.take_array::<1>(ctx).map(|[b]| b)
    }

    fn u32(&mut self, ctx: Ctx<'_>) -> Result<u32> {
        self.take_array(ctx).map(u32::from_le_bytes)
    }

    fn u64(&mut self, ctx: Ctx<'_>) -> Result<u64> {
        self.take_array(ctx).map(u64::from_le_bytes)
    }

    /// A gguf string: u64 byte length, then UTF-8 bytes.
    fn string(&mut self, ctx: Ctx<'_>) -> Result<&'a str> {
        let start = self.offset();
        let len = self.u64(ctx)?;
        let left = self.remaining();
        let len = usize::try_from(len).ok().filter(|&l| l <= left).ok_or_else(|| {
            GgufError::format_at(
                start,
                format!("{ctx}: string length {len} exceeds the {left} bytes left in the file"),
            )
        })?;
        let body_start = self.offset();
        let raw = self.take(len, ctx)?;
        std::str::from_utf8(raw).map_err(|e| {
            GgufError::format_at(
                body_start + e.valid_up_to() as u64,
                format!("{ctx}: string is not valid UTF-8"),
            )
        })
    }
}

fn parse_header(bytes: &[u8]) -> Result<Header> {
    let mut c = Cursor { bytes, pos: 0 };

    let magic: [u8; 4] = c.take_array(Ctx::Header("magic"))?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::format_at(
            0,
            format!("not a GGUF file: starts with \"{}\", not \"GGUF\"", magic.escape_ascii()),
        ));
    }
    let version = c.u32(Ctx::Header("version"))?;
    check_version(version)?;

    let tensor_count = c.u64(Ctx::Header("tensor count"))?;
    let kv_count = c.u64(Ctx::Header("metadata key count"))?;
    let left = c.remaining() as u64;
    if kv_count > left / MIN_KV_BYTES {
        return Err(GgufError::format_at(
            16,
            format!(
                "metadata key count {kv_count} is impossible: each key takes at least \
                 {MIN_KV_BYTES} bytes and only {left} bytes are left after the header"
            ),
        ));
    }
    let left_for_tensors = left - kv_count * MIN_KV_BYTES;
    if tensor_count > left_for_tensors / MIN_TENSOR_INFO_BYTES {
        return Err(GgufError::format_at(
            8,
            format!(
                "tensor count {tensor_count} is impossible: each tensor info takes at least \
                 {MIN_TENSOR_INFO_BYTES} bytes and at most {left_for_tensors} bytes are left \
                 for them"
            ),
        ));
    }

    let mut metadata: Vec<(String, MetaValue)> = Vec::new();
    let mut key_index = HashMap::new();
    let mut alignment_at = 0;
    for i in 0..kv_count {
        let start = c.offset();
        let key = c.string(Ctx::KeyName(i))?;
        if key.len() > MAX_KEY_LEN {
            return Err(GgufError::format_at(
                start,
                format!(
                    "metadata key #{i} ('{}') is {} bytes long; keys are at most {MAX_KEY_LEN} bytes",
                    shorten(key),
                    key.len()
                ),
            ));
        }
        if key_index.contains_key(key) {
            return Err(GgufError::format_at(start, format!("duplicate metadata key '{key}'")));
        }
        if key == ALIGNMENT_KEY {
            alignment_at = start;
        }
        let type_at = c.offset();
        let type_id = c.u32(Ctx::Value(key))?;
        let ty = ValueType::from_id(type_id).ok_or_else(|| {
            GgufError::format_at(
                type_at,
                format!("key '{key}': unknown value type {type_id} (known types are 0 to 12)"),
            )
        })?;
        let value = read_value(&mut c, ty, key)?;
        key_index.insert(key.to_string(), metadata.len());
        metadata.push((key.to_string(), value));
    }

    let alignment = match key_index.get(ALIGNMENT_KEY).and_then(|&i| metadata.get(i)) {
        None => DEFAULT_ALIGNMENT,
        Some((_, MetaValue::U32(a))) if a.is_power_of_two() => *a,
        Some((_, MetaValue::U32(a))) => {
            return Err(GgufError::format_at(
                alignment_at,
                format!("{ALIGNMENT_KEY} = {a} is not a power of two"),
            ));
        }
        Some((_, other)) => {
            return Err(GgufError::format_at(
                alignment_at,
                format!("{ALIGNMENT_KEY} must be UINT32, found {}", other.type_description()),
            ));
        }
    };

    let mut tensors: Vec<TensorInfo> = Vec::new();
    let mut info_offsets: Vec<u64> = Vec::new();
    let mut tensor_index = HashMap::new();
    for i in 0..tensor_count {
        let start = c.offset();
        let info = read_tensor_info(&mut c, i)?;
        if tensor_index.contains_key(&info.name) {
            return Err(GgufError::format_at(
                start,
                format!("duplicate tensor name '{}'", info.name),
            ));
        }
        tensor_index.insert(info.name.clone(), tensors.len());
        tensors.push(info);
        info_offsets.push(start);
    }

    let infos_end = c.offset();
    let data_offset = align_up(infos_end, alignment.into()).ok_or_else(|| {
        GgufError::format_at(infos_end, "data section offset overflows".to_string())
    })?;
    check_tensor_extents(&tensors, &info_offsets, data_offset, alignment, bytes.len() as u64)?;

    Ok(Header { version, metadata, key_index, tensors, tensor_index, alignment, data_offset })
}

fn check_version(version: u32) -> Result<()> {
    // A byte-swapped small version number has its low 16 bits zero.
    if version != 0 && version & 0xFFFF == 0 {
        return Err(GgufError::format_at(
            4,
            format!(
                "file is big-endian (version field reads 0x{version:08x}); only little-endian \
                 GGUF files are supported"
            ),
        ));
    }
    match version {
        2 | 3 => Ok(()),
        1 => Err(GgufError::format_at(
            4,
            "GGUF version 1 is not supported (it used 32-bit counts); convert the model again",
        )),
        v => Err(GgufError::format_at(
            4,
            format!("unsupported GGUF version {v}; this reader supports versions 2 and 3"),
        )),
    }
}

fn align_up(offset: u64, alignment: u64) -> Option<u64> {
    let rem = offset.checked_rem(alignment)?;
    if rem == 0 { Some(offset) } else { offset.checked_add(alignment - rem) }
}

/// Decodes `raw` (a whole number of `N`-byte little-endian values) with `from_le`.
fn decode_le<const N: usize, T>(raw: &[u8], from_le: fn([u8; N]) -> T) -> Vec<T> {
    raw.chunks_exact(N)
        .map(|chunk| {
            let mut bytes = [0u8; N];
            bytes.copy_from_slice(chunk);
            from_le(bytes)
        })
        .collect()
}

fn bool_from_byte(byte: u8, at: u64, ctx: Ctx<'_>) -> Result<bool> {
    match byte {
        0 => Ok(false),
        1 => Ok(true),
        b => Err(GgufError::format_at(at, format!("{ctx}: bool byte is {b}, must be 0 or 1"))),
    }
}

fn read_value(c: &mut Cursor<'_>, ty: ValueType, key: &str) -> Result<MetaValue> {
    let ctx = Ctx::Value(key);
    Ok(match ty {
        ValueType::U8 => MetaValue::U8(c.u8(ctx)?),
        ValueType::I8 => MetaValue::I8(c.take_array(ctx).map(i8::from_le_bytes)?),
        ValueType::U16 => MetaValue::U16(c.take_array(ctx).map(u16::from_le_bytes)?),
        ValueType::I16 => MetaValue::I16(c.take_array(ctx).map(i16::from_le_bytes)?),
        ValueType::U32 => MetaValue::U32(c.u32(ctx)?),
        ValueType::I32 => MetaValue::I32(c.take_array(ctx).map(i32::from_le_bytes)?),
        ValueType::F32 => MetaValue::F32(c.take_array(ctx).map(f32::from_le_bytes)?),
        ValueType::U64 => MetaValue::U64(c.u64(ctx)?),
        ValueType::I64 => MetaValue::I64(c.take_array(ctx).map(i64::from_le_bytes)?),
        ValueType::F64 => MetaValue::F64(c.take_array(ctx).map(f64::from_le_bytes)?),
        ValueType::Bool => {
            let at = c.offset();
            MetaValue::Bool(bool_from_byte(c.u8(ctx)?, at, ctx)?)
        }
        ValueType::Str => MetaValue::Str(c.string(ctx)?.to_string()),
        ValueType::Array => MetaValue::Array(read_array(c, key)?),
    })
}

fn read_array(c: &mut Cursor<'_>, key: &str) -> Result<MetaArray> {
    let ctx = Ctx::Value(key);
    let type_at = c.offset();
    let type_id = c.u32(ctx)?;
    let elem = ValueType::from_id(type_id).ok_or_else(|| {
        GgufError::format_at(
            type_at,
            format!("key '{key}': unknown array element type {type_id} (known types are 0 to 12)"),
        )
    })?;
    let nested = || {
        GgufError::format_at(
            type_at,
            format!("key '{key}': nested arrays are not supported (llama.cpp rejects them too)"),
        )
    };
    if elem == ValueType::Array {
        return Err(nested());
    }
    let count_at = c.offset();
    let count = c.u64(ctx)?;
    // Strings take at least their 8-byte length.
    let min_size = elem.fixed_size().unwrap_or(8);
    let left = c.remaining();
    let count = usize::try_from(count).ok().filter(|&n| n <= left / min_size).ok_or_else(|| {
        GgufError::format_at(
            count_at,
            format!(
                "key '{key}': array of {count} {elem} values needs at least {} bytes, only {left} left",
                u128::from(count) * min_size as u128
            ),
        )
    })?;
    // From here `count * min_size <= left`, so sizes below cannot overflow and reservations
    // are bounded by the input.
    let raw_at = c.offset();
    let raw = match elem.fixed_size() {
        Some(_) => c.take(count * min_size, ctx)?,
        None => &[],
    };
    Ok(match elem {
        ValueType::U8 => MetaArray::U8(raw.to_vec()),
        ValueType::I8 => MetaArray::I8(decode_le(raw, i8::from_le_bytes)),
        ValueType::U16 => MetaArray::U16(decode_le(raw, u16::from_le_bytes)),
        ValueType::I16 => MetaArray::I16(decode_le(raw, i16::from_le_bytes)),
        ValueType::U32 => MetaArray::U32(decode_le(raw, u32::from_le_bytes)),
        ValueType::I32 => MetaArray::I32(decode_le(raw, i32::from_le_bytes)),
        ValueType::F32 => MetaArray::F32(decode_le(raw, f32::from_le_bytes)),
        ValueType::U64 => MetaArray::U64(decode_le(raw, u64::from_le_bytes)),
        ValueType::I64 => MetaArray::I64(decode_le(raw, i64::from_le_bytes)),
        ValueType::F64 => MetaArray::F64(decode_le(raw, f64::from_le_bytes)),
        ValueType::Bool => {
            let values = raw
                .iter()
                .zip(0u64..)
                .map(|(&b, i)| bool_from_byte(b, raw_at + i, Ctx::Element(key, i)))
                .collect::<Result<Vec<bool>>>()?;
            MetaArray::Bool(values)
        }
        ValueType::Str => {
            let mut values = Vec::with_capacity(count);
            for i in 0..count as u64 {
                values.push(c.string(Ctx::Element(key, i))?.to_string());
            }
            MetaArray::Str(values)
        }
        ValueType::Array => return Err(nested()),
    })
}

fn read_tensor_info(c: &mut Cursor<'_>, index: u64) -> Result<TensorInfo> {
    let start = c.offset();
    let name = c.string(Ctx::TensorName(index))?;
    if name.len() > MAX_TENSOR_NAME_LEN {
        return Err(GgufError::format_at(
            start,
            format!(
                "tensor #{index} name '{}' is {} bytes long; ggml allows at most {MAX_TENSOR_NAME_LEN}",
                shorten(name),
                name.len()
            ),
        ));
    }
    let fail = |at: u64, msg: String| GgufError::format_at(at, format!("tensor '{name}': {msg}"));

    let n_dims_at = c.offset();
    let n_dims = c.u32(Ctx::Tensor(name, "dimension count"))?;
    if n_dims == 0 || n_dims as usize > MAX_DIMS {
        return Err(fail(n_dims_at, format!("{n_dims} dimensions, must be 1 to {MAX_DIMS}")));
    }
    let mut dims = Vec::with_capacity(MAX_DIMS);
    for d in 0..n_dims {
        let at = c.offset();
        let ne = c.u64(Ctx::Tensor(name, "shape"))?;
        if ne == 0 {
            return Err(fail(at, format!("dimension {d} is 0 (empty tensors are not supported)")));
        }
        if ne > i64::MAX as u64 {
            return Err(fail(at, format!("dimension {d} = {ne} is negative as a ggml int64")));
        }
        dims.push(ne);
    }
    let type_at = c.offset();
    let type_id = c.u32(Ctx::Tensor(name, "type"))?;
    let ggml_type = GgmlType::from_id(type_id)
        .ok_or_else(|| fail(type_at, format!("unknown ggml type id {type_id}")))?;
    let offset = c.u64(Ctx::Tensor(name, "data offset"))?;

    let n_elements = dims
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(|| fail(start, format!("element count of shape {dims:?} overflows")))?;
    let ne0 = dims.first().copied().unwrap_or(1);
    if ne0 % ggml_type.block_size() != 0 {
        return Err(fail(
            start,
            format!(
                "row length {ne0} is not a multiple of the {ggml_type} block size {}",
                ggml_type.block_size()
            ),
        ));
    }
    let n_bytes = ggml_type
        .row_bytes(ne0)
        .and_then(|row| row.checked_mul(n_elements / ne0))
        .ok_or_else(|| fail(start, format!("byte size of shape {dims:?} overflows")))?;

    Ok(TensorInfo { name: name.to_string(), dims, ggml_type, offset, n_bytes })
}

/// Offsets aligned, data inside the file, no two tensors sharing bytes.
fn check_tensor_extents(
    tensors: &[TensorInfo],
    info_offsets: &[u64],
    data_offset: u64,
    alignment: u32,
    file_len: u64,
) -> Result<()> {
    for (t, &at) in tensors.iter().zip(info_offsets) {
        if t.offset % u64::from(alignment) != 0 {
            return Err(GgufError::format_at(
                at,
                format!(
                    "tensor '{}': data offset 0x{:x} is not a multiple of the alignment {alignment}",
                    t.name, t.offset
                ),
            ));
        }
        let end = data_offset.checked_add(t.offset).and_then(|s| s.checked_add(t.n_bytes));
        if end.is_none_or(|end| end > file_len) {
            return Err(GgufError::format_at(
                at,
                format!(
                    "tensor '{}' extends past end of file (data at 0x{:x}, {} bytes, file is {file_len} bytes)",
                    t.name,
                    u128::from(data_offset) + u128::from(t.offset),
                    t.n_bytes
                ),
            ));
        }
    }
    // Inside the file, so these ends cannot overflow.
    let mut spans: Vec<(u64, u64, usize)> =
        tensors.iter().enumerate().map(|(i, t)| (t.offset, t.offset + t.n_bytes, i)).collect();
    spans.sort_unstable();
    for pair in spans.windows(2) {
        let &[(a_start, a_end, a), (b_start, b_end, b)] = pair else { continue };
        if a_end > b_start {
            let name = |i: usize| tensors.get(i).map_or("?", |t| t.name.as_str());
            let (name_a, name_b) = (name(a), name(b));
            return Err(GgufError::format_at(
                info_offsets.get(b).copied().unwrap_or(0),
                format!(
                    "tensors '{name_a}' (data 0x{a_start:x}..0x{a_end:x}) and '{name_b}' \
                     (data 0x{b_start:x}..0x{b_end:x}) overlap"
                ),
            ));
        }
    }
    Ok(())
}
