//! memra-gguf: GGUF files — a zero-copy reader over a memory map, a writer for test
//! fixtures, and every quant block format (dequantize, and quantize for fixtures).
//!
//! Format facts: `shared/reference/model-specs.md` §1.

mod error;
pub mod quant;
mod reader;
mod types;
mod value;
mod writer;

pub use error::{ErrorKind, GgufError, Result};
pub use reader::{
    ALIGNMENT_KEY, ARCHITECTURE_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, Gguf, GgufFile,
    MAX_DIMS, MAX_KEY_LEN, MAX_TENSOR_NAME_LEN, Dims, Metadata, TensorInfo, Tensors,
};
pub use types::GgmlType;
pub use value::{Element, MetaArray, MetaArrayRef, MetaValue, MetaValueRef, NumArray, StrArray, ValueType};
pub use writer::GgufWriter;
