//! GGUF v3 writer for test fixtures and synthetic models: metadata of every type, tensors
//! given as raw bytes or as f32 values quantized on the way in.
//!
//! ```
//! use memra_gguf::{GgmlType, Gguf, GgufWriter};
//! let mut w = GgufWriter::new();
//! w.add_meta("general.architecture", "gemma3")
//!     .add_meta("gemma3.block_count", 2u32)
//!     .add_tensor_f32("output_norm.weight", &[4], GgmlType::F32, &[1.0, 2.0, 3.0, 4.0])?;
//! let bytes = w.to_bytes()?;
//! let file = Gguf::parse(&bytes[..])?;
//! assert_eq!(file.get_u32("gemma3.block_count")?, 2);
//! # Ok::<(), memra_gguf::GgufError>(())
//! ```

use std::collections::HashSet;
use std::fs;
use std::io::Write;
use std::path::Path;

use crate::GgmlType;
use crate::error::{GgufError, Result};
use crate::reader::{
    ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, MAX_DIMS, MAX_KEY_LEN,
    MAX_TENSOR_NAME_LEN,
};
use crate::value::{MetaArray, MetaValue};

/// Builds a GGUF file in memory. Metadata and tensors keep the order they were added in.
#[derive(Clone, Debug)]
pub struct GgufWriter {
    alignment: u32,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<PendingTensor>,
}

#[derive(Clone, Debug)]
struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    data: Vec<u8>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty file with the default alignment (32).
    pub fn new() -> Self {
        GgufWriter { alignment: DEFAULT_ALIGNMENT, metadata: Vec::new(), tensors: Vec::new() }
    }

    /// Sets the data alignment. A non-default alignment is recorded as `general.alignment`
    /// (UINT32) when the file is written. `to_bytes` rejects values that are not powers of two.
    pub fn with_alignment(mut self, alignment: u32) -> Self {
        self.alignment = alignment;
        self
    }

    /// Appends a metadata pair. Duplicate keys are reported by `to_bytes`.
    pub fn add_meta(&mut self, key: impl Into<String>, value: impl Into<MetaValue>) -> &mut Self {
        self.metadata.push((key.into(), value.into()));
        self
    }

    /// Appends a tensor whose data is already encoded in `ggml_type`. `dims` is ggml `ne`
    /// (row length first); `data` must be exactly the tensor's byte size.
    pub fn add_tensor_bytes(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ggml_type: GgmlType,
        data: Vec<u8>,
    ) -> Result<&mut Self> {
        let name = name.into();
        let expected = tensor_n_bytes(&name, dims, ggml_type)?;
        if data.len() as u64 != expected {
            return Err(GgufError::invalid(format!(
                "tensor '{name}': {ggml_type} {dims:?} takes {expected} bytes, got {}",
                data.len()
            )));
        }
        self.tensors.push(PendingTensor { name, dims: dims.to_vec(), ggml_type, data });
        Ok(self)
    }

    /// Appends a tensor given as f32 values (row-major in ggml order: `dims[0]` fastest),
    /// converted to `ggml_type` with `crate::quant::quantize`.
    pub fn add_tensor_f32(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ggml_type: GgmlType,
        values: &[f32],
    ) -> Result<&mut Self> {
        let name = name.into();
        tensor_n_bytes(&name, dims, ggml_type)?;
        let n_elements = dims.iter().product::<u64>();
        if values.len() as u64 != n_elements {
            return Err(GgufError::invalid(format!(
                "tensor '{name}': shape {dims:?} has {n_elements} elements, got {} values",
                values.len()
            )));
        }
        let data = crate::quant::quantize(ggml_type, values)
            .map_err(|e| GgufError::invalid(format!("tensor '{name}': {e}")))?;
        self.add_tensor_bytes(name, dims, ggml_type, data)
    }

    /// The complete file. Errors on duplicate or over-long keys and names, a bad alignment,
    /// or a `general.alignment` entry that disagrees with `with_alignment`.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let metadata = self.checked_metadata()?;
        self.check_tensor_names()?;
        let alignment = u64::from(self.alignment);

        let mut out = Vec::new();
        out.extend_from_slice(&GGUF_MAGIC);
        out.extend_from_slice(&GGUF_VERSION.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (key, value) in &metadata {
            write_string(&mut out, key);
            out.extend_from_slice(&value.value_type().id().to_le_bytes());
            write_value(&mut out, value);
        }

        let mut offset = 0u64;
        for t in &self.tensors {
            write_string(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for &d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset = padded(offset + t.data.len() as u64, alignment);
        }

        pad_to(&mut out, alignment);
        for t in &self.tensors {
            out.extend_from_slice(&t.data);
            pad_to(&mut out, alignment);
        }
        Ok(out)
    }

    /// Writes the file through a temporary next to `path`, then renames it into place, so a
    /// reader never sees a half-written file.
    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = self.to_bytes().map_err(|e| e.in_file(Some(path)))?;
        let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
        tmp_name.push(format!(".tmp{}", std::process::id()));
        let tmp = path.with_file_name(tmp_name);
        let written = fs::File::create(&tmp)
            .and_then(|mut f| f.write_all(&bytes).and_then(|()| f.sync_all()))
            .and_then(|()| fs::rename(&tmp, path));
        written.map_err(|e| {
            let _ = fs::remove_file(&tmp);
            GgufError::io(path, e)
        })
    }

    /// The metadata to write: the caller's, plus `general.alignment` when it is not the
    /// default and the caller did not add it.
    fn checked_metadata(&self) -> Result<Vec<(&str, MetaValue)>> {
        if !self.alignment.is_power_of_two() {
            return Err(GgufError::invalid(format!(
                "alignment {} is not a power of two",
                self.alignment
            )));
        }
        let mut seen = HashSet::new();
        let mut out = Vec::with_capacity(self.metadata.len() + 1);
        for (key, value) in &self.metadata {
            if key.len() > MAX_KEY_LEN {
                return Err(GgufError::invalid(format!(
                    "metadata key of {} bytes is longer than {MAX_KEY_LEN}",
                    key.len()
                )));
            }
            if !seen.insert(key.as_str()) {
                return Err(GgufError::invalid(format!("duplicate metadata key '{key}'")));
            }
            if key == ALIGNMENT_KEY && *value != MetaValue::U32(self.alignment) {
                return Err(GgufError::invalid(format!(
                    "{ALIGNMENT_KEY} = {value} ({}) disagrees with the writer's alignment {} (UINT32)",
                    value.type_description(),
                    self.alignment
                )));
            }
            out.push((key.as_str(), value.clone()));
        }
        if self.alignment != DEFAULT_ALIGNMENT && !seen.contains(ALIGNMENT_KEY) {
            out.push((ALIGNMENT_KEY, MetaValue::U32(self.alignment)));
        }
        Ok(out)
    }

    fn check_tensor_names(&self) -> Result<()> {
        let mut seen = HashSet::new();
        for t in &self.tensors {
            if !seen.insert(t.name.as_str()) {
                return Err(GgufError::invalid(format!("duplicate tensor name '{}'", t.name)));
            }
        }
        Ok(())
    }
}

/// Validates a tensor's name and shape as the reader will, returning its byte size.
fn tensor_n_bytes(name: &str, dims: &[u64], ggml_type: GgmlType) -> Result<u64> {
    let fail = |msg: String| GgufError::invalid(format!("tensor '{name}': {msg}"));
    if name.len() > MAX_TENSOR_NAME_LEN {
        return Err(fail(format!("name is longer than {MAX_TENSOR_NAME_LEN} bytes")));
    }
    if dims.is_empty() || dims.len() > MAX_DIMS {
        return Err(fail(format!("{} dimensions, must be 1 to {MAX_DIMS}", dims.len())));
    }
    if dims.iter().any(|&d| d == 0 || d > i64::MAX as u64) {
        return Err(fail(format!("shape {dims:?} has a dimension that is 0 or too large")));
    }
    let n_elements = dims
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(|| fail(format!("element count of shape {dims:?} overflows")))?;
    let ne0 = dims[0];
    let row = ggml_type.row_bytes(ne0).ok_or_else(|| {
        fail(format!(
            "row length {ne0} is not a multiple of the {ggml_type} block size {}",
            ggml_type.block_size()
        ))
    })?;
    row.checked_mul(n_elements / ne0)
        .ok_or_else(|| fail(format!("byte size of shape {dims:?} overflows")))
}

fn padded(offset: u64, alignment: u64) -> u64 {
    offset.div_ceil(alignment) * alignment
}

fn pad_to(out: &mut Vec<u8>, alignment: u64) {
    let len = padded(out.len() as u64, alignment) as usize;
    out.resize(len, 0);
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, value: &MetaValue) {
    match value {
        MetaValue::U8(v) => out.push(*v),
        MetaValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::Bool(v) => out.push(u8::from(*v)),
        MetaValue::Str(v) => write_string(out, v),
        MetaValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::Array(array) => write_array(out, array),
    }
}

fn write_array(out: &mut Vec<u8>, array: &MetaArray) {
    out.extend_from_slice(&array.element_type().id().to_le_bytes());
    out.extend_from_slice(&(array.len() as u64).to_le_bytes());
    fn le<const N: usize, T: Copy>(out: &mut Vec<u8>, values: &[T], to_le: fn(T) -> [u8; N]) {
        for &v in values {
            out.extend_from_slice(&to_le(v));
        }
    }
    match array {
        MetaArray::U8(v) => out.extend_from_slice(v),
        MetaArray::I8(v) => le(out, v, i8::to_le_bytes),
        MetaArray::U16(v) => le(out, v, u16::to_le_bytes),
        MetaArray::I16(v) => le(out, v, i16::to_le_bytes),
        MetaArray::U32(v) => le(out, v, u32::to_le_bytes),
        MetaArray::I32(v) => le(out, v, i32::to_le_bytes),
        MetaArray::F32(v) => le(out, v, f32::to_le_bytes),
        MetaArray::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        MetaArray::Str(v) => v.iter().for_each(|s| write_string(out, s)),
        MetaArray::U64(v) => le(out, v, u64::to_le_bytes),
        MetaArray::I64(v) => le(out, v, i64::to_le_bytes),
        MetaArray::F64(v) => le(out, v, f64::to_le_bytes),
    }
}
