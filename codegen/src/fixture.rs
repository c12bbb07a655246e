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

pub mod vocab;

use memra_gguf::GgmlType;

use crate::dims::TensorInstance;
use crate::spec::{Attention, TypeChoice};

/// Token count of every micro model's vocabulary.
pub const MICRO_N_VOCAB: usize = 512;

/// Small dims that keep every tensor a whole number of 256-element blocks where the real
/// model's types need it, by hparam name; applied when the spec has the hparam.
const MICRO_VALUES: &[(&str, i64)] = &[
    ("n_embd", 256),
    ("n_ff", 256),
    ("n_ff_exp", 256),
    ("n_head", 4),
    ("head_dim", 64),
    ("head_dim_v", 64),
    // MLA: latent 128 (the GPU MLA kernels take multiples of 128), q/k heads 32 nope + 16
    // rope, v 32; the q LoRA 64.
    ("q_lora_rank", 64),
    ("kv_lora_rank", 128),
    ("key_length_mla", 48),
    ("value_length_mla", 32),
    ("key_length", 128 + 16),
    ("value_length", 128),
    // DSA: a top-k of 4 makes contexts of 5+ tokens take the sparse path; 8 indexer heads
    // (the GPU indexer's tensor-core tiles are 8 heads wide).
    ("indexer_n_head", 8),
    ("indexer_head_dim", 32),
    ("indexer_top_k", 4),
    ("n_expert", 4),
    ("n_expert_used", 2),
    ("n_expert_shared", 1),
    // Gemma 3: a 4-position window so short prompts exercise the local layers' mask.
    ("sliding_window", 4),
];

/// The dims of [`micro_model`]: the spec's default preset with [`MICRO_VALUES`], enough
/// layers for every layer kind (≥ 2; a whole sliding-window period, so gemma3 gets local
/// layers and a global one; one leading dense layer and two MoE layers; one nextn block on
/// top when the spec has `nextn_predict_layers`), `n_vocab` = [`MICRO_N_VOCAB`]. Tensor types
/// are the preset's where the block size divides the row, else Q8_0, else F32.
pub fn micro_dims(spec: &ArchSpec) -> Result<ModelDims, String> {
    let has = |name: &str| spec.hparam(name).is_some();
    let mut overrides: Vec<(&str, Value)> = MICRO_VALUES
        .iter()
        .filter(|(n, _)| has(n))
        .map(|&(n, v)| (n, Value::Int(v)))
        .collect();
    if spec.caps.attention == Attention::Gqa && has("n_head_kv") {
        overrides.push(("n_head_kv", Value::Int(2)));
    }
    if spec.caps.attention != Attention::Gqa && has("n_rot") {
        overrides.push(("n_rot", Value::Int(16)));
    }
    let mut n_layer = 2i64;
    if let Some(sw) = &spec.caps.sliding_window {
        n_layer = n_layer.max(sw.pattern);
    }
    if let Some(r) = &spec.caps.dense_layers {
        let end = r.text.split_once("..").map(|(_, e)| e.trim()).unwrap_or("");
        if has(end) {
            overrides.push((end, Value::Int(1)));
            n_layer = n_layer.max(3);
        }
    }
    let nextn = if has("nextn_predict_layers") { 1 } else { 0 };
    if nextn > 0 {
        overrides.push(("nextn_predict_layers", Value::Int(nextn)));
    }
    let block_count = spec
        .hparams
        .iter()
        .find(|h| matches!(&h.from, HParamSource::Key(k) if k == "block_count"))
        .ok_or_else(|| format!("{}: no hparam reads `block_count`", spec.arch))?;
    overrides.push((block_count.name.as_str(), Value::Int(n_layer + nextn)));
    let n_vocab = spec
        .hparams
        .iter()
        .find(|h| matches!(&h.from, HParamSource::TensorDim { .. }) && h.name == "n_vocab")
        .ok_or_else(|| format!("{}: no `n_vocab` hparam", spec.arch))?;
    overrides.push((n_vocab.name.as_str(), Value::Int(MICRO_N_VOCAB as i64)));

    // Resolve shapes with every tensor F32 (always valid), then pick the real types.
    let preset_name = spec.default_preset.clone();
    let preset = spec
        .preset(&preset_name)
        .ok_or_else(|| format!("{}: no preset `{preset_name}`", spec.arch))?;
    let mut all_f32 = spec.clone();
    for p in &mut all_f32.presets {
        p.types.clear();
        p.default_type = GgmlType::F32;
    }
    let mut dims =
        crate::dims::from_preset_with(&all_f32, None, &overrides).map_err(|e| e.to_string())?;
    let mut seen: Vec<usize> = vec![0; spec.tensors.len()];
    for t in &mut dims.tensors {
        let pos = seen[t.spec_index];
        seen[t.spec_index] += 1;
        let field = &spec.tensors[t.spec_index].field;
        let wanted = match preset.types.iter().find(|(f, _, _)| f == field) {
            Some((_, TypeChoice::All(ty), _)) => *ty,
            Some((_, TypeChoice::PerLayer(list), _)) => list
                .get(pos)
                .or(list.last())
                .copied()
                .unwrap_or(preset.default_type),
            None if t.shape.len() == 1 => GgmlType::F32,
            None => preset.default_type,
        };
        t.ggml_type = [wanted, GgmlType::Q8_0, GgmlType::F32]
            .into_iter()
            .find(|ty| ty.row_bytes(t.shape[0]).is_some())
            .unwrap_or(GgmlType::F32);
    }
    Ok(dims)
}

/// Weight values of one tensor: matrices uniform with variance `1/ne0` (activations keep their
/// scale through a projection), `token_embd` uniform in [-1, 1), norm weights `1 ± 0.2`,
/// biases `± 0.1`. Deterministic in `seed` and the name.
fn micro_values(name: &str, shape: &[u64], seed: u64) -> Vec<f32> {
    let n: u64 = shape.iter().product();
    let mut state = (seed ^ 0x9e37_79b9_7f4a_7c15)
        ^ name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    let (offset, scale) = if name.ends_with(".bias") {
        (0.0, 0.1)
    } else if shape.len() == 1 {
        (1.0, 0.2)
    } else if name == "token_embd.weight" {
        (0.0, 1.0)
    } else {
        (0.0, (3.0 / shape[0] as f32).sqrt())
    };
    (0..n).map(|_| offset + scale * uniform()).collect()
}

/// Elements from which [`model_from_dims`] generates and quantizes a tensor on all cores, in
/// row chunks with one stream each (never reached by micro models, whose bytes stay as they were).
const BIG_TENSOR: u64 = 1 << 26;

/// A large tensor's bytes in `ty`: [`micro_values`]' distribution, chunks of whole rows on
/// `available_parallelism` threads, chunk `c`'s stream seeded from `seed`, the name and `c`.
fn big_tensor_bytes(name: &str, shape: &[u64], ty: GgmlType, seed: u64) -> Result<Vec<u8>, String> {
    let row = shape[0] as usize;
    let rows = (shape.iter().product::<u64>() / shape[0]) as usize;
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let chunk_rows = rows.div_ceil(threads * 4).max(1);
    let chunks: Vec<std::ops::Range<usize>> = (0..rows)
        .step_by(chunk_rows)
        .map(|r| r..(r + chunk_rows).min(rows))
        .collect();
    let scale = (3.0 / shape[0] as f32).sqrt();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut parts: Vec<Option<Result<Vec<u8>, String>>> = (0..chunks.len()).map(|_| None).collect();
    let slots: Vec<std::sync::Mutex<&mut Option<Result<Vec<u8>, String>>>> =
        parts.iter_mut().map(std::sync::Mutex::new).collect();
    std::thread::scope(|sc| {
        for _ in 0..threads {
            sc.spawn(|| loop {
                let c = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(range) = chunks.get(c) else { break };
                let mut state = (seed ^ 0x9e37_79b9_7f4a_7c15 ^ (c as u64).wrapping_mul(0x2545_f491_4f6c_dd1d))
                    ^ name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
                    });
                let values: Vec<f32> = (0..range.len() * row)
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        scale * ((state >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
                    })
                    .collect();
                let bytes = memra_gguf::quant::quantize(ty, &values).map_err(|e| format!("tensor '{name}': {e}"));
                **slots[c].lock().expect("no panics while held") = Some(bytes);
            });
        }
    });
    drop(slots);
    let mut out = Vec::new();
    for p in parts {
        out.extend(p.ok_or_else(|| format!("tensor '{name}': a chunk was not generated"))??);
    }
    Ok(out)
}

/// The DeepSeek-style MTP tensors of nextn block `il` (model-specs §7.3): the last layer's
/// block tensors renamed to `blk.{il}.`, plus `nextn.eh_proj` `[2·n_embd, n_embd]` and the
/// `nextn.enorm` / `hnorm` / `shared_head_norm` weights.
fn nextn_tensors(dims: &ModelDims, il: usize, n_embd: u64) -> Vec<TensorInstance> {
    let last = il - 1;
    let prefix = format!("blk.{last}.");
    let mut out: Vec<TensorInstance> = dims
        .tensors
        .iter()
        .filter(|t| t.layer == Some(last))
        .map(|t| TensorInstance {
            layer: Some(il),
            name: format!("blk.{il}.{}", &t.name[prefix.len()..]),
            ..t.clone()
        })
        .collect();
    let matrix_type = out
        .iter()
        .find(|t| t.shape.len() == 2)
        .map_or(GgmlType::F32, |t| t.ggml_type);
    let extra = |name: &str, shape: Vec<u64>, ty: GgmlType| TensorInstance {
        spec_index: usize::MAX,
        layer: Some(il),
        name: format!("blk.{il}.nextn.{name}"),
        shape,
        ggml_type: ty,
    };
    out.push(extra(
        "eh_proj.weight",
        vec![2 * n_embd, n_embd],
        matrix_type,
    ));
    for norm in ["enorm", "hnorm", "shared_head_norm"] {
        out.push(extra(
            &format!("{norm}.weight"),
            vec![n_embd],
            GgmlType::F32,
        ));
    }
    out
}

/// The tokenizer a micro model of `arch` carries: SentencePiece-style for gemma3 (its real
/// vocabulary is `llama`), GPT-2 BPE with the real model's pre-tokenizer name otherwise.
fn micro_vocab(arch: &str) -> Result<vocab::MicroVocab, String> {
    match arch {
        "gemma3" => vocab::spm(MICRO_N_VOCAB),
        "qwen3" => vocab::bpe("qwen2", MICRO_N_VOCAB),
        "olmoe" => vocab::bpe("olmo", MICRO_N_VOCAB),
        "glm-dsa" => vocab::bpe("glm4", MICRO_N_VOCAB),
        _ => vocab::bpe("gpt2", MICRO_N_VOCAB),
    }
}

/// A small but complete GGUF of `spec` ([`micro_dims`]): every metadata key the spec reads,
/// every tensor (plus nextn blocks where the spec has them) with random weights of
/// [`micro_values`]'s scale in the preset's types, and a [`MICRO_N_VOCAB`]-token tokenizer
/// (`tokenizer.ggml.*`) so text can be encoded and decoded. A spec whose preset has a
/// `rope.scaling.factor` ≠ 1 gets `rope.scaling.type` (`yarn` when it also reads
/// `rope.scaling.original_context_length`, else `linear`). Deterministic in `seed`.
pub fn micro_model(spec: &ArchSpec, seed: u64) -> Result<Vec<u8>, String> {
    model_from_dims(spec, micro_dims(spec)?, seed)
}

/// [`micro_model`]'s file at any resolved `dims` whose `n_vocab` is [`MICRO_N_VOCAB`] (e.g. a
/// preset's real per-layer shapes with few layers): the same metadata, tokenizer, nextn blocks
/// and [`micro_values`]-scaled random weights in the dims' tensor types.
pub fn model_from_dims(spec: &ArchSpec, mut dims: ModelDims, seed: u64) -> Result<Vec<u8>, String> {
    if dims.int("n_vocab") != Some(MICRO_N_VOCAB as i64) {
        return Err(format!(
            "{}: n_vocab {:?} is not the micro tokenizer's {MICRO_N_VOCAB}",
            spec.arch,
            dims.int("n_vocab")
        ));
    }
    let voc = micro_vocab(&spec.arch)?;
    let n_embd = dims
        .int("n_embd")
        .ok_or_else(|| format!("{}: no n_embd", spec.arch))? as u64;
    if let (Some(n_layer), Some(nextn)) = (dims.int("n_layer"), dims.int("nextn_predict_layers")) {
        for il in n_layer..n_layer + nextn {
            let extra = nextn_tensors(&dims, il as usize, n_embd);
            dims.tensors.extend(extra);
        }
    }
    let mut out = GgufWriter::new();
    out.add_meta("general.architecture", spec.arch.as_str());
    out.add_meta("general.name", format!("memra micro {}", spec.arch));
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
        out.add_meta(key, value);
    }
    let reads = |k: &str| {
        spec.hparams
            .iter()
            .find(|h| matches!(&h.from, HParamSource::Key(s) if s == k))
    };
    if let Some(h) = reads("rope.scaling.factor")
        && matches!(dims.value(&h.name), Some(Value::Float(f)) if f != 1.0)
    {
        let ty = if reads("rope.scaling.original_context_length").is_some() {
            "yarn"
        } else {
            "linear"
        };
        out.add_meta(format!("{}.rope.scaling.type", spec.arch), ty);
    }
    voc.write(&mut out);
    for t in &dims.tensors {
        let n: u64 = t.shape.iter().product();
        if n < BIG_TENSOR {
            let values = micro_values(&t.name, &t.shape, seed);
            out.add_tensor_f32(t.name.clone(), &t.shape, t.ggml_type, &values)
                .map_err(|e| format!("{}: {e}", spec.arch))?;
        } else {
            let bytes = big_tensor_bytes(&t.name, &t.shape, t.ggml_type, seed)?;
            out.add_tensor_bytes(t.name.clone(), &t.shape, t.ggml_type, bytes)
                .map_err(|e| format!("{}: {e}", spec.arch))?;
        }
    }
    out.to_bytes().map_err(|e| format!("{}: {e}", spec.arch))
}
