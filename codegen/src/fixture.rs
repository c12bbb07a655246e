//! GGUF images that match a spec and resolved dims: the metadata keys the spec reads and every
//! tensor at its resolved shape and type. For tests and benchmarks (micro models at small dims,
//! or real per-layer shapes with few layers); never a real model.

use memra_gguf::{GgufWriter, MetaValue};

use crate::dims::ModelDims;
use crate::spec::{ArchSpec, HParamSource, HParamType, Value};

/// Tensor contents.
#[derive(Copy, Clone, Debug)]
pub enum Fill {
    /// All bytes zero (fast; a valid encoding for every type).
    Zeros,
    /// Uniform in [-1, 1) from a xorshift generator seeded per tensor from `seed` and the name,
    /// quantized to the tensor's type.
    Random(u64),
}

/// A writer holding `general.architecture`, every `Key`-sourced hparam and every tensor of
/// `dims`; callers may add or change entries before `to_bytes()`.
/// Errors name the tensor.
pub fn writer_for(spec: &ArchSpec, dims: &ModelDims, fill: Fill) -> Result<GgufWriter, String> {
    let mut w = GgufWriter::new();
    w.add_meta("general.architecture", spec.arch.as_str());
    for h in &spec.hparams {
        let (HParamSource::Key(suffix), Some(v)) = (&h.from, dims.value(&h.name)) else {
            continue;
        };
        let key = format!("{}.{suffix}", spec.arch);
        let value: MetaValue = match (h.ty, v) {
            (HParamType::U32, Value::Int(i)) => MetaValue::U32(i as u32),
            (HParamType::F32, Value::Float(f)) => MetaValue::F32(f as f32),
            (HParamType::Bool, Value::Bool(b)) => MetaValue::Bool(b),
            _ => continue,
        };
        w.add_meta(key, value);
    }
    for t in &dims.tensors {
        match fill {
            Fill::Zeros => {
                let rows: u64 = t.shape[1..].iter().product();
                let row = t.ggml_type.row_bytes(t.shape[0]).ok_or_else(|| {
                    format!(
                        "tensor '{}': ne0 {} is not a whole number of {} blocks",
                        t.name, t.shape[0], t.ggml_type
                    )
                })?;
                w.add_tensor_bytes(
                    t.name.clone(),
                    &t.shape,
                    t.ggml_type,
                    vec![0u8; (row * rows) as usize],
                )
                .map_err(|e| e.to_string())?;
            }
            Fill::Random(seed) => {
                let n: u64 = t.shape.iter().product();
                let mut state = seed
                    ^ t.name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
                    });
                let values: Vec<f32> = (0..n)
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
                    })
                    .collect();
                w.add_tensor_f32(t.name.clone(), &t.shape, t.ggml_type, &values)
                    .map_err(|e| e.to_string())?;
            }
        }
    }
    Ok(w)
}
