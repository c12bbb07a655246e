//! memra-gguf: GGUF files — a zero-copy reader over a memory map, a writer for test
//! fixtures, and every quant block format (dequantize, and quantize for fixtures).
//!
//! Format facts: `shared/reference/model-specs.md` §1.

mod types;

pub use types::GgmlType;
