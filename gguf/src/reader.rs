//! Zero-copy GGUF reader: parses the header (metadata and tensor infos) and hands out tensor
//! data as slices of the memory map or buffer. Layout: `shared/reference/model-specs.md` §1.1.
//!
//! Every count, length, offset and shape is checked before use, with checked arithmetic.
//! Parsing never allocates more than the input's size: nothing is copied out of the file.
//! The reader keeps only u32 file offsets — one per metadata pair (4 bytes, plus 4 for the
//! by-key index, against at least 13 in the file), one per string-array element (4 against
//! its 8-byte length prefix), one per tensor info (4, plus 4 for the by-name index, against
//! at least 32) — and decodes keys, values and tensor infos from the bytes on access.
//! Counts are compared with the bytes left before anything is reserved for them.
//! Because of those u32 offsets, metadata and tensor infos must lie in the first 4 GiB
//! (tensor data may lie anywhere).
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

use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::GgmlType;
use crate::error::{ErrorKind, GgufError, Result};
use crate::value::{MetaArrayRef, MetaValueRef, NumArray, StrArray, ValueType};

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

/// A tensor's shape (ggml `ne`, fastest-varying first), kept inline: 1 to 4 dimensions.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dims {
    ne: [u64; MAX_DIMS],
    len: u8,
}

impl Dims {
    /// `None` for more than [`MAX_DIMS`] dimensions.
    pub fn new(dims: &[u64]) -> Option<Dims> {
        let mut ne = [0; MAX_DIMS];
        ne.get_mut(..dims.len())?.copy_from_slice(dims);
        Some(Dims { ne, len: dims.len() as u8 })
    }

    pub fn as_slice(&self) -> &[u64] {
        self.ne.get(..usize::from(self.len)).unwrap_or(&[])
    }
}

impl std::ops::Deref for Dims {
    type Target = [u64];
    fn deref(&self) -> &[u64] {
        self.as_slice()
    }
}

impl fmt::Debug for Dims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_slice(), f)
    }
}

impl PartialEq<[u64]> for Dims {
    fn eq(&self, other: &[u64]) -> bool {
        self.as_slice() == other
    }
}

impl<const N: usize> PartialEq<[u64; N]> for Dims {
    fn eq(&self, other: &[u64; N]) -> bool {
        self.as_slice() == other
    }
}

impl PartialEq<Vec<u64>> for Dims {
    fn eq(&self, other: &Vec<u64>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

/// One tensor's description from the header, decoded on access and borrowing its name
/// from the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorInfo<'a> {
    /// Exactly as written in the file (`blk.3.attn_q.weight`).
    pub name: &'a str,
    /// ggml `ne`: fastest-varying first, so `dims[0]` is the contiguous row length.
    pub dims: Dims,
    pub ggml_type: GgmlType,
    /// Byte offset of the data relative to the start of the data section.
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo<'_> {
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

/// Offsets into the file only; see the module comment.
struct Header {
    version: u32,
    /// File offset of each metadata pair (its key's length), in file order.
    kvs: Vec<u32>,
    /// Indices into `kvs`, sorted by key.
    kv_by_key: Vec<u32>,
    /// File offset of each element of every string array, arrays in file order.
    str_elements: Vec<u32>,
    /// File offset of each tensor info, in file order.
    tensors: Vec<u32>,
    /// Indices into `tensors`, sorted by name.
    tensor_by_name: Vec<u32>,
    alignment: u32,
    data_offset: u64,
}

/// All metadata pairs of a file, in file order.
#[derive(Clone, Copy)]
pub struct Metadata<'a> {
    bytes: &'a [u8],
    header: &'a Header,
}

impl<'a> Metadata<'a> {
    pub fn len(&self) -> usize {
        self.header.kvs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.header.kvs.is_empty()
    }

    /// Pair `i` in file order.
    pub fn get(&self, i: usize) -> Option<(&'a str, MetaValueRef<'a>)> {
        decode_kv(self.bytes, self.header, i)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&'a str, MetaValueRef<'a>)> + 'a {
        let this = *self;
        (0..self.len()).filter_map(move |i| this.get(i))
    }
}

impl<'a> IntoIterator for Metadata<'a> {
    type Item = (&'a str, MetaValueRef<'a>);
    type IntoIter = Box<dyn Iterator<Item = Self::Item> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

/// All tensor infos of a file, in file order.
#[derive(Clone, Copy)]
pub struct Tensors<'a> {
    bytes: &'a [u8],
    header: &'a Header,
}

impl<'a> Tensors<'a> {
    pub fn len(&self) -> usize {
        self.header.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.header.tensors.is_empty()
    }

    /// Tensor `i` in file order.
    pub fn get(&self, i: usize) -> Option<TensorInfo<'a>> {
        decode_tensor(self.bytes, *self.header.tensors.get(i)?)
    }

    pub fn iter(&self) -> impl Iterator<Item = TensorInfo<'a>> + 'a {
        let this = *self;
        (0..self.len()).filter_map(move |i| this.get(i))
    }
}

impl<'a> IntoIterator for Tensors<'a> {
    type Item = TensorInfo<'a>;
    type IntoIter = Box<dyn Iterator<Item = Self::Item> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

impl GgufFile {
    /// Maps the file read-only and parses its header. Errors name the file.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| GgufError::io(path, e))?;
        let meta = file.metadata().map_err(|e| GgufError::io(path, e))?;
        if meta.is_dir() {
            // mmap would say only "No such device".
            let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "is a directory, not a GGUF file");
            return Err(GgufError::io(path, e));
        }
        let len = meta.len();
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
    pub fn metadata(&self) -> Metadata<'_> {
        Metadata { bytes: self.bytes(), header: &self.header }
    }

    /// The value of `key` (binary search over the sorted keys).
    pub fn get(&self, key: &str) -> Option<MetaValueRef<'_>> {
        let (bytes, h) = (self.bytes(), &self.header);
        let at = h
            .kv_by_key
            .binary_search_by(|&i| kv_key(bytes, h, i as usize).cmp(key))
            .ok()?;
        let &i = h.kv_by_key.get(at)?;
        decode_kv(bytes, h, i as usize).map(|(_, v)| v)
    }

    /// All tensor infos in file order.
    pub fn tensors(&self) -> Tensors<'_> {
        Tensors { bytes: self.bytes(), header: &self.header }
    }

    /// The tensor called `name` (binary search over the sorted names).
    pub fn tensor(&self, name: &str) -> Option<TensorInfo<'_>> {
        let (bytes, h) = (self.bytes(), &self.header);
        let at = h
            .tensor_by_name
            .binary_search_by(|&i| tensor_name(bytes, h, i as usize).cmp(name))
            .ok()?;
        self.tensors().get(*h.tensor_by_name.get(at)? as usize)
    }

    /// The tensor's bytes, borrowed from the map. The reader checked at parse time that
    /// every tensor of this file lies inside it; a `TensorInfo` from another file that does
    /// not fit yields an empty slice.
    /// Takes the info by value or by reference.
    pub fn tensor_data<'i>(&self, info: impl std::borrow::Borrow<TensorInfo<'i>>) -> &[u8] {
        self.data_range(info.borrow()).and_then(|r| self.bytes().get(r)).unwrap_or(&[])
    }

    /// The bytes of the tensor called `name`, or an error naming it.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let info = self
            .tensor(name)
            .ok_or_else(|| self.err(ErrorKind::MissingTensor(name.to_string())))?;
        Ok(self.tensor_data(info))
    }

    fn data_range(&self, info: &TensorInfo<'_>) -> Option<std::ops::Range<usize>> {
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

    fn require(&self, key: &str) -> Result<MetaValueRef<'_>> {
        self.get(key).ok_or_else(|| self.err(ErrorKind::MissingKey(key.to_string())))
    }

    fn wrong_type(&self, key: &str, expected: &'static str, found: &MetaValueRef<'_>) -> GgufError {
        self.err(ErrorKind::WrongType {
            key: key.to_string(),
            expected,
            found: found.type_description(),
        })
    }

    /// Any integer type, converted to `T` or an error naming the key and value.
    fn get_int<T: TryFrom<i128>>(&self, key: &str, target: &'static str) -> Result<T> {
        let value = self.require(key)?;
        let int = value.as_integer().ok_or_else(|| self.wrong_type(key, "an integer", &value))?;
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
        value.as_f64().ok_or_else(|| self.wrong_type(key, "a number", &value))
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        let value = self.require(key)?;
        value.as_bool().ok_or_else(|| self.wrong_type(key, "BOOL", &value))
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        let value = self.require(key)?;
        value.as_str().ok_or_else(|| self.wrong_type(key, "STRING", &value))
    }

    pub fn get_array(&self, key: &str) -> Result<MetaArrayRef<'_>> {
        let value = self.require(key)?;
        value.as_array().ok_or_else(|| self.wrong_type(key, "ARRAY", &value))
    }

    /// An ARRAY of STRING (e.g. `tokenizer.ggml.tokens`, `tokenizer.ggml.merges`), borrowed.
    pub fn get_str_array(&self, key: &str) -> Result<StrArray<'_>> {
        match self.require(key)? {
            MetaValueRef::Array(MetaArrayRef::Str(v)) => Ok(v),
            other => Err(self.wrong_type(key, "ARRAY of STRING", &other)),
        }
    }

    /// An ARRAY of FLOAT32 (e.g. `tokenizer.ggml.scores`), decoded on access.
    pub fn get_f32_array(&self, key: &str) -> Result<NumArray<'_, f32>> {
        match self.require(key)? {
            MetaValueRef::Array(MetaArrayRef::F32(v)) => Ok(v),
            other => Err(self.wrong_type(key, "ARRAY of FLOAT32", &other)),
        }
    }

    /// An ARRAY of INT32 (e.g. `tokenizer.ggml.token_type`), decoded on access.
    pub fn get_i32_array(&self, key: &str) -> Result<NumArray<'_, i32>> {
        match self.require(key)? {
            MetaValueRef::Array(MetaArrayRef::I32(v)) => Ok(v),
            other => Err(self.wrong_type(key, "ARRAY of INT32", &other)),
        }
    }

    /// An array of any integer type (per-layer hparams), each element converted to u64;
    /// negative elements are an error.
    pub fn get_u64_array(&self, key: &str) -> Result<Vec<u64>> {
        let array = self.get_array(key)?;
        let mut out = Vec::with_capacity(array.len());
        for i in 0..array.len() {
            let element = array.get(i).unwrap_or(MetaValueRef::U8(0));
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
            .field("metadata_keys", &self.header.kvs.len())
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
            Ctx::Value(key) => write!(f, "the value of key '{}'", shorten(key)),
            Ctx::Element(key, i) => write!(f, "element {i} of key '{}'", shorten(key)),
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
    // Both counts are now below `left / 13`, so they fit in usize; a header this large
    // would put offsets past 4 GiB, which `offset_u32` rejects as they are met.
    let (kv_count, tensor_count) = (kv_count as usize, tensor_count as usize);

    let mut kvs: Vec<u32> = Vec::with_capacity(kv_count);
    let mut str_elements: Vec<u32> = Vec::new();
    let mut alignment_kv = None;
    for i in 0..kv_count as u64 {
        let start = c.offset();
        let start32 = offset_u32(start, "metadata")?;
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
        let type_at = c.offset();
        let type_id = c.u32(Ctx::Value(key))?;
        let ty = ValueType::from_id(type_id).ok_or_else(|| {
            GgufError::format_at(
                type_at,
                format!(
                    "key '{}': unknown value type {type_id} (known types are 0 to 12)",
                    shorten(key)
                ),
            )
        })?;
        let value = read_value(&mut c, ty, key, &mut Strings::Record(&mut str_elements))?;
        if key == ALIGNMENT_KEY {
            alignment_kv = Some((start, value));
        }
        kvs.push(start32);
    }

    let mut header = Header {
        version,
        kvs,
        kv_by_key: Vec::new(),
        str_elements,
        tensors: Vec::new(),
        tensor_by_name: Vec::new(),
        alignment: DEFAULT_ALIGNMENT,
        data_offset: 0,
    };
    header.kv_by_key = sorted_unique(
        header.kvs.len(),
        |i| kv_key(bytes, &header, i),
        |i| header.kvs.get(i).copied().unwrap_or(0),
        |key| format!("duplicate metadata key '{}'", shorten(key)),
    )?;

    header.alignment = match alignment_kv {
        None => DEFAULT_ALIGNMENT,
        Some((_, MetaValueRef::U32(a))) if a.is_power_of_two() => a,
        Some((at, MetaValueRef::U32(a))) => {
            return Err(GgufError::format_at(
                at,
                format!("{ALIGNMENT_KEY} = {a} is not a power of two"),
            ));
        }
        Some((at, other)) => {
            return Err(GgufError::format_at(
                at,
                format!("{ALIGNMENT_KEY} must be UINT32, found {}", other.type_description()),
            ));
        }
    };
    let alignment = header.alignment;

    // Re-checked against the bytes actually left, now that the metadata is read.
    let left = c.remaining() as u64;
    if tensor_count as u64 > left / MIN_TENSOR_INFO_BYTES {
        return Err(GgufError::format_at(
            8,
            format!(
                "tensor count {tensor_count} is impossible: each tensor info takes at least \
                 {MIN_TENSOR_INFO_BYTES} bytes and only {left} bytes are left for them"
            ),
        ));
    }
    header.tensors.reserve_exact(tensor_count);
    for i in 0..tensor_count as u64 {
        let start = c.offset();
        let start32 = offset_u32(start, "tensor info")?;
        read_tensor_info(&mut c, i)?;
        header.tensors.push(start32);
    }

    let infos_end = c.offset();
    header.data_offset = align_up(infos_end, alignment.into()).ok_or_else(|| {
        GgufError::format_at(infos_end, "data section offset overflows".to_string())
    })?;
    header.tensor_by_name = sorted_unique(
        header.tensors.len(),
        |i| tensor_name(bytes, &header, i),
        |i| header.tensors.get(i).copied().unwrap_or(0),
        |name| format!("duplicate tensor name '{name}'"),
    )?;
    check_tensor_extents(bytes, &header)?;
    Ok(header)
}

/// Offsets kept by the reader are 32-bit; see the module comment.
fn offset_u32(at: u64, what: &str) -> Result<u32> {
    u32::try_from(at).map_err(|_| {
        GgufError::format_at(
            at,
            format!("{what} past 4 GiB: this reader needs the header in the first 4 GiB"),
        )
    })
}

/// Indices `0..n` sorted by `name`, or an error at the second of two equal names.
fn sorted_unique<'n>(
    n: usize,
    name: impl Fn(usize) -> &'n str,
    offset: impl Fn(usize) -> u32,
    duplicate: impl Fn(&str) -> String,
) -> Result<Vec<u32>> {
    let mut order: Vec<u32> = Vec::with_capacity(n);
    order.extend((0..n).map(|i| i as u32));
    // Unstable sort: it does not allocate. Ties break by index, so the later one is reported.
    order.sort_unstable_by(|&a, &b| name(a as usize).cmp(name(b as usize)).then(a.cmp(&b)));
    for pair in order.windows(2) {
        if let &[a, b] = pair
            && name(a as usize) == name(b as usize)
        {
            return Err(GgufError::format_at(
                u64::from(offset(b as usize)),
                duplicate(name(b as usize)),
            ));
        }
    }
    Ok(order)
}

/// The key of pair `i` ("" if it cannot be read, which parsing has ruled out).
fn kv_key<'a>(bytes: &'a [u8], h: &Header, i: usize) -> &'a str {
    let Some(&start) = h.kvs.get(i) else { return "" };
    let mut c = Cursor { bytes, pos: start as usize };
    c.string(Ctx::KeyName(i as u64)).unwrap_or_default()
}

/// Pair `i`, decoded again from the bytes parsing checked.
fn decode_kv<'a>(bytes: &'a [u8], h: &'a Header, i: usize) -> Option<(&'a str, MetaValueRef<'a>)> {
    let mut c = Cursor { bytes, pos: *h.kvs.get(i)? as usize };
    let key = c.string(Ctx::KeyName(i as u64)).ok()?;
    let ty = ValueType::from_id(c.u32(Ctx::Value(key)).ok()?)?;
    let value = read_value(&mut c, ty, key, &mut Strings::Known(&h.str_elements)).ok()?;
    Some((key, value))
}

/// The name of tensor `i` ("" if it cannot be read, which parsing has ruled out).
fn tensor_name<'a>(bytes: &'a [u8], h: &Header, i: usize) -> &'a str {
    let Some(&start) = h.tensors.get(i) else { return "" };
    let mut c = Cursor { bytes, pos: start as usize };
    c.string(Ctx::TensorName(i as u64)).unwrap_or_default()
}

/// The tensor info at file offset `start`, decoded again from the bytes parsing checked.
fn decode_tensor(bytes: &[u8], start: u32) -> Option<TensorInfo<'_>> {
    read_tensor_info(&mut Cursor { bytes, pos: start as usize }, 0).ok()
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

fn bool_from_byte(byte: u8, at: u64, ctx: Ctx<'_>) -> Result<bool> {
    match byte {
        0 => Ok(false),
        1 => Ok(true),
        b => Err(GgufError::format_at(at, format!("{ctx}: bool byte is {b}, must be 0 or 1"))),
    }
}

/// Where string-array elements go: recorded while parsing, looked up when decoding again.
enum Strings<'a, 's> {
    Record(&'s mut Vec<u32>),
    /// Every recorded element offset, ascending.
    Known(&'a [u32]),
}

fn read_value<'a>(
    c: &mut Cursor<'a>,
    ty: ValueType,
    key: &str,
    strings: &mut Strings<'a, '_>,
) -> Result<MetaValueRef<'a>> {
    let ctx = Ctx::Value(key);
    Ok(match ty {
        ValueType::U8 => MetaValueRef::U8(c.u8(ctx)?),
        ValueType::I8 => MetaValueRef::I8(c.take_array(ctx).map(i8::from_le_bytes)?),
        ValueType::U16 => MetaValueRef::U16(c.take_array(ctx).map(u16::from_le_bytes)?),
        ValueType::I16 => MetaValueRef::I16(c.take_array(ctx).map(i16::from_le_bytes)?),
        ValueType::U32 => MetaValueRef::U32(c.u32(ctx)?),
        ValueType::I32 => MetaValueRef::I32(c.take_array(ctx).map(i32::from_le_bytes)?),
        ValueType::F32 => MetaValueRef::F32(c.take_array(ctx).map(f32::from_le_bytes)?),
        ValueType::U64 => MetaValueRef::U64(c.u64(ctx)?),
        ValueType::I64 => MetaValueRef::I64(c.take_array(ctx).map(i64::from_le_bytes)?),
        ValueType::F64 => MetaValueRef::F64(c.take_array(ctx).map(f64::from_le_bytes)?),
        ValueType::Bool => {
            let at = c.offset();
            MetaValueRef::Bool(bool_from_byte(c.u8(ctx)?, at, ctx)?)
        }
        ValueType::Str => MetaValueRef::Str(c.string(ctx)?),
        ValueType::Array => MetaValueRef::Array(read_array(c, key, strings)?),
    })
}

fn read_array<'a>(
    c: &mut Cursor<'a>,
    key: &str,
    strings: &mut Strings<'a, '_>,
) -> Result<MetaArrayRef<'a>> {
    let ctx = Ctx::Value(key);
    let type_at = c.offset();
    let type_id = c.u32(ctx)?;
    let elem = ValueType::from_id(type_id).ok_or_else(|| {
        GgufError::format_at(
            type_at,
            format!(
                "key '{}': unknown array element type {type_id} (known types are 0 to 12)",
                shorten(key)
            ),
        )
    })?;
    let nested = || {
        GgufError::format_at(
            type_at,
            format!(
                "key '{}': nested arrays are not supported (llama.cpp rejects them too)",
                shorten(key)
            ),
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
                "key '{}': array of {count} {elem} values needs at least {} bytes, only {left} left",
                shorten(key),
                u128::from(count) * min_size as u128
            ),
        )
    })?;
    // From here `count * min_size <= left`, so sizes below cannot overflow.
    let raw_at = c.offset();
    let raw = match elem.fixed_size() {
        Some(_) => c.take(count * min_size, ctx)?,
        None => &[],
    };
    Ok(match elem {
        ValueType::U8 => MetaArrayRef::U8(NumArray::new(raw)),
        ValueType::I8 => MetaArrayRef::I8(NumArray::new(raw)),
        ValueType::U16 => MetaArrayRef::U16(NumArray::new(raw)),
        ValueType::I16 => MetaArrayRef::I16(NumArray::new(raw)),
        ValueType::U32 => MetaArrayRef::U32(NumArray::new(raw)),
        ValueType::I32 => MetaArrayRef::I32(NumArray::new(raw)),
        ValueType::F32 => MetaArrayRef::F32(NumArray::new(raw)),
        ValueType::U64 => MetaArrayRef::U64(NumArray::new(raw)),
        ValueType::I64 => MetaArrayRef::I64(NumArray::new(raw)),
        ValueType::F64 => MetaArrayRef::F64(NumArray::new(raw)),
        ValueType::Bool => {
            for (&b, i) in raw.iter().zip(0u64..) {
                bool_from_byte(b, raw_at + i, Ctx::Element(key, i))?;
            }
            MetaArrayRef::Bool(NumArray::new(raw))
        }
        ValueType::Str => match strings {
            Strings::Record(elements) => {
                // At most doubles: under 8 bytes per element, the size of its length prefix.
                elements.reserve(count);
                for i in 0..count as u64 {
                    elements.push(offset_u32(c.offset(), "string array element")?);
                    c.string(Ctx::Element(key, i))?;
                }
                // The caller only needs the type while parsing.
                MetaArrayRef::Str(StrArray::new(c.bytes, &[]))
            }
            Strings::Known(all) => {
                // Element offsets ascend through the file, so this array's run is found by
                // its first element's offset.
                let starts = if count == 0 {
                    &[][..]
                } else {
                    let first = u32::try_from(raw_at).ok();
                    first
                        .and_then(|f| all.binary_search(&f).ok())
                        .and_then(|base| all.get(base..base.checked_add(count)?))
                        .unwrap_or(&[])
                };
                MetaArrayRef::Str(StrArray::new(c.bytes, starts))
            }
        },
        ValueType::Array => return Err(nested()),
    })
}

fn read_tensor_info<'a>(c: &mut Cursor<'a>, index: u64) -> Result<TensorInfo<'a>> {
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
    let mut ne = [0u64; MAX_DIMS];
    for (d, slot) in ne.iter_mut().take(n_dims as usize).enumerate() {
        let at = c.offset();
        let v = c.u64(Ctx::Tensor(name, "shape"))?;
        if v == 0 {
            return Err(fail(at, format!("dimension {d} is 0 (empty tensors are not supported)")));
        }
        if v > i64::MAX as u64 {
            return Err(fail(at, format!("dimension {d} = {v} is negative as a ggml int64")));
        }
        *slot = v;
    }
    let dims = Dims { ne, len: n_dims as u8 };
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

    Ok(TensorInfo { name, dims, ggml_type, offset, n_bytes })
}

/// Offsets aligned, data inside the file, no two tensors sharing bytes.
fn check_tensor_extents(bytes: &[u8], h: &Header) -> Result<()> {
    let (data_offset, alignment, file_len) = (h.data_offset, h.alignment, bytes.len() as u64);
    let info = |i: usize| h.tensors.get(i).and_then(|&at| Some((u64::from(at), decode_tensor(bytes, at)?)));
    for i in 0..h.tensors.len() {
        let Some((at, t)) = info(i) else { continue };
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
    // Inside the file, so offset + n_bytes cannot overflow. Sorting indices (4 bytes each)
    // and decoding on comparison keeps this check within the allocation bound.
    let span = |i: u32| info(i as usize).map_or((0, 0), |(_, t)| (t.offset, t.offset + t.n_bytes));
    let mut by_offset: Vec<u32> = Vec::with_capacity(h.tensors.len());
    by_offset.extend(0..h.tensors.len() as u32);
    by_offset.sort_unstable_by_key(|&i| (span(i), i));
    for pair in by_offset.windows(2) {
        let &[a, b] = pair else { continue };
        let ((a_start, a_end), (b_start, b_end)) = (span(a), span(b));
        if a_end > b_start {
            let name = |i: u32| info(i as usize).map_or("?", |(_, t)| t.name);
            let (name_a, name_b) = (name(a), name(b));
            return Err(GgufError::format_at(
                info(b as usize).map_or(0, |(at, _)| at),
                format!(
                    "tensors '{name_a}' (data 0x{a_start:x}..0x{a_end:x}) and '{name_b}' \
                     (data 0x{b_start:x}..0x{b_end:x}) overlap"
                ),
            ));
        }
    }
    Ok(())
}

