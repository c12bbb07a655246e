//! Dims resolution: presets (values, derived values, per-layer ranges and types) and GGUF
//! headers written with `memra_gguf::GgufWriter` (defaults, tensor-sourced hparams, and
//! errors that name the key or tensor).

use std::path::{Path, PathBuf};

use memra_codegen::dims::{self, ModelDims};
use memra_codegen::fixture::{self, Fill};
use memra_codegen::spec::{ArchSpec, Value};
use memra_gguf::{GgmlType, Gguf, GgufWriter};

fn spec(arch: &str) -> ArchSpec {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    ArchSpec::load(&root.join(format!("specs/{arch}.toml"))).unwrap_or_else(|e| panic!("{e}"))
}

fn ty(d: &ModelDims, name: &str) -> GgmlType {
    d.tensor(name)
        .unwrap_or_else(|| panic!("no tensor {name}"))
        .ggml_type
}

#[test]
fn glm5_preset_resolves_mla_dims_ranges_and_types() {
    let s = spec("glm-dsa");
    let d = dims::from_preset(&s, None).unwrap();
    assert_eq!(d.origin.to_string(), "preset `glm-5`");
    for (name, want) in [
        ("n_embd", 6144),
        ("n_head", 64),
        ("q_lora_rank", 2048),
        ("kv_lora_rank", 512),
        ("qk_nope_head_dim", 192),
        ("rope_dim", 64),
        ("v_head_dim", 256),
        ("kv_a_dim", 576),
        ("n_layer", 78),
        ("n_ff_shexp", 2048),
    ] {
        assert_eq!(d.int(name), Some(want), "{name}");
    }
    assert_eq!(d.value("expert_weights_scale"), Some(Value::Float(2.5)));
    assert_eq!(d.value("expert_weights_norm"), Some(Value::Bool(true)));
    // 3 global; 15 tensors on each of 78 layers; dense FFN on 3 layers; 8 MoE tensors on 75.
    assert_eq!(d.tensors.len(), 3 + 78 * 15 + 3 * 3 + 75 * 8);
    assert!(
        d.tensor("blk.2.ffn_gate.weight").is_some() && d.tensor("blk.3.ffn_gate.weight").is_none()
    );
    assert!(
        d.tensor("blk.3.ffn_gate_exps.weight").is_some()
            && d.tensor("blk.2.ffn_gate_exps.weight").is_none()
    );
    assert!(
        d.tensor("blk.78.attn_norm.weight").is_none(),
        "the nextn layer is not a main layer"
    );
    assert_eq!(
        d.tensor("blk.5.attn_k_b.weight").unwrap().shape,
        [192, 512, 64]
    );
    assert_eq!(
        d.tensor("blk.5.attn_q_b.weight").unwrap().shape,
        [2048, 16384]
    );
    assert_eq!(ty(&d, "blk.77.ffn_down_exps.weight"), GgmlType::Q4_K);
    assert_eq!(ty(&d, "blk.7.attn_q_a.weight"), GgmlType::Q8_0);
    assert_eq!(ty(&d, "blk.7.ffn_gate_inp.weight"), GgmlType::F32);
    assert_eq!(
        ty(&d, "blk.7.attn_kv_a_norm.weight"),
        GgmlType::F32,
        "1-D tensors stay F32"
    );
}

#[test]
fn gemma3_preset_has_the_real_files_per_layer_types() {
    let d = dims::from_preset(&spec("gemma3"), None).unwrap();
    assert_eq!(d.tensors.len(), 236, "the real Q4_K_M file has 236 tensors");
    assert_eq!(d.int("head_dim"), Some(256));
    assert_eq!(
        d.int("n_rot"),
        Some(256),
        "default expression n_rot = head_dim"
    );
    assert_eq!(d.value("rope_freq_base_swa"), Some(Value::Float(10000.0)));
    assert_eq!(ty(&d, "blk.0.attn_v.weight"), GgmlType::Q8_0);
    assert_eq!(ty(&d, "blk.2.attn_v.weight"), GgmlType::Q5_0);
    assert_eq!(ty(&d, "blk.13.ffn_down.weight"), GgmlType::Q6_K);
    assert_eq!(ty(&d, "blk.14.ffn_down.weight"), GgmlType::Q4_K);
    assert_eq!(ty(&d, "token_embd.weight"), GgmlType::Q8_0);
}

#[test]
fn preset_errors_name_the_problem() {
    let s = spec("gemma3");
    let e = dims::from_preset(&s, Some("gemma-3-1b"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no preset `gemma-3-1b` (presets: gemma-3-270m)"),
        "{e}"
    );
    // Cutting the layer count is allowed only through overrides (per-layer lists are cut).
    let d = dims::from_preset_with(
        &s,
        None,
        &[("block_count", Value::Int(2)), ("n_vocab", Value::Int(512))],
    )
    .unwrap();
    assert_eq!(d.tensors.len(), 2 + 2 * 13);
    let e = dims::from_preset_with(&s, None, &[("n_layers", Value::Int(2))])
        .unwrap_err()
        .to_string();
    assert!(e.contains("override `n_layers` is not an hparam"), "{e}");
    // A K-quant on a 640-long row is what llama.cpp's fallback avoids; the spec may not claim it.
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs/gemma3.toml"))
            .unwrap();
    let bad = text.replace("attn_q = \"Q5_0\"", "attn_q = \"Q4_K\"");
    let s = ArchSpec::parse(Path::new("specs/gemma3.toml"), &bad).unwrap();
    let e = dims::from_preset(&s, None).unwrap_err().to_string();
    assert!(e.contains("`blk.0.attn_q.weight` is Q4_K but its row length ne0 = 640 is not a multiple of Q4_K's block size 256"), "{e}");
    assert!(e.contains("specs/gemma3.toml:"), "{e}");
}

/// A gemma3 GGUF at the 270M per-layer dims with 2 layers and a small vocabulary.
fn gemma3_micro() -> (ArchSpec, GgufWriter) {
    let s = spec("gemma3");
    let d = dims::from_preset_with(
        &s,
        None,
        &[("block_count", Value::Int(2)), ("n_vocab", Value::Int(512))],
    )
    .unwrap();
    let w = fixture::writer_for(&s, &d, Fill::Zeros).unwrap();
    (s, w)
}

/// Rebuilds a writer's image with one metadata key or tensor left out or changed.
fn rewrite(
    w: &GgufWriter,
    skip_key: Option<&str>,
    skip_tensor: Option<&str>,
    reshape: Option<(&str, &[u64])>,
) -> Vec<u8> {
    let file = Gguf::parse(w.to_bytes().unwrap()).unwrap();
    let mut out = GgufWriter::new();
    for (k, v) in file.metadata() {
        if Some(k) != skip_key {
            out.add_meta(k, v);
        }
    }
    for t in file.tensors() {
        if Some(t.name) == skip_tensor {
            continue;
        }
        let dims: Vec<u64> = match reshape {
            Some((name, shape)) if name == t.name => shape.to_vec(),
            _ => t.dims.to_vec(),
        };
        let n: u64 = dims[1..].iter().product::<u64>() * t.ggml_type.row_bytes(dims[0]).unwrap();
        out.add_tensor_bytes(t.name, &dims, t.ggml_type, vec![0; n as usize])
            .unwrap();
    }
    out.to_bytes().unwrap()
}

#[test]
fn gguf_dims_come_from_metadata_with_defaults_and_tensor_dims() {
    let (s, w) = gemma3_micro();
    let bytes = rewrite(&w, Some("gemma3.rope.dimension_count"), None, None);
    let file = Gguf::parse(&bytes[..]).unwrap();
    let d = dims::from_gguf(&s, &file).unwrap();
    assert_eq!(d.int("n_embd"), Some(640));
    assert_eq!(d.int("n_head"), Some(4));
    assert_eq!(d.int("n_head_kv"), Some(1));
    assert_eq!(d.int("head_dim"), Some(256));
    assert_eq!(d.int("n_rot"), Some(256), "absent key: default expression");
    assert_eq!(d.int("n_vocab"), Some(512), "from token_embd ne[1]");
    assert_eq!(d.int("n_layer"), Some(2));
    assert_eq!(d.tensors.len(), 2 + 2 * 13);
    assert_eq!(
        ty(&d, "blk.1.attn_v.weight"),
        GgmlType::Q8_0,
        "types come from the file"
    );
    assert_eq!(ty(&d, "blk.1.attn_output.weight"), GgmlType::Q4_K);
}

#[test]
fn gguf_errors_name_key_and_tensor() {
    let (s, w) = gemma3_micro();
    let bytes = rewrite(
        &w,
        Some("gemma3.embedding_length"),
        Some("blk.1.ffn_up.weight"),
        Some(("blk.0.attn_k.weight", &[640, 512])),
    );
    let file = Gguf::parse(&bytes[..]).unwrap();
    let e = dims::from_gguf(&s, &file).unwrap_err().to_string();
    assert!(
        e.contains("metadata key 'gemma3.embedding_length' is missing (hparam `n_embd`"),
        "{e}"
    );
    assert!(e.contains("gemma3.toml:"), "the spec line is named: {e}");
    // Tensor checks need n_embd, so they are reported once the key is back.
    let bytes = rewrite(
        &w,
        None,
        Some("blk.1.ffn_up.weight"),
        Some(("blk.0.attn_k.weight", &[640, 512])),
    );
    let file = Gguf::parse(&bytes[..]).unwrap();
    let e = dims::from_gguf(&s, &file).unwrap_err();
    assert_eq!(e.problems.len(), 2, "{e}");
    let e = e.to_string();
    assert!(e.contains("tensor 'blk.1.ffn_up.weight' is missing"), "{e}");
    assert!(e.contains("tensor 'blk.0.attn_k.weight' has shape [640, 512], expected [640, 256] = [n_embd, n_head_kv * head_dim]"), "{e}");
}

#[test]
fn gguf_of_another_arch_or_wrong_type_is_rejected() {
    let (s, w) = gemma3_micro();
    let e = dims::from_gguf(&spec("qwen3"), &Gguf::parse(w.to_bytes().unwrap()).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("general.architecture is `gemma3`, but") && e.contains("describes `qwen3`"),
        "{e}"
    );
    let mut w2 = GgufWriter::new();
    let file = Gguf::parse(w.to_bytes().unwrap()).unwrap();
    for (k, v) in file.metadata() {
        if k == "gemma3.attention.head_count" {
            w2.add_meta(k, "four");
        } else {
            w2.add_meta(k, v);
        }
    }
    let e = dims::from_gguf(&s, &Gguf::parse(w2.to_bytes().unwrap()).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("metadata key 'gemma3.attention.head_count' = ")
            && e.contains("is not a u32 (hparam `n_head`"),
        "{e}"
    );
}

/// The real Gemma 3 270M file, when fetched (scripts/fetch-gemma3-270m).
pub fn real_gemma3() -> Option<PathBuf> {
    let path = match std::env::var_os("MEMRA_GEMMA3_GGUF") {
        Some(p) => PathBuf::from(p),
        None => {
            let cache = std::env::var_os("MEMRA_CACHE")
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/memra"))
                })?;
            cache.join("models/gemma-3-270m-q4_k_m.gguf")
        }
    };
    path.is_file().then_some(path)
}

#[test]
fn real_gemma3_file_matches_the_spec_and_its_preset() {
    let Some(path) = real_gemma3() else {
        println!(
            "SKIP: real gemma3 GGUF absent (set MEMRA_GEMMA3_GGUF or run scripts/fetch-gemma3-270m)"
        );
        return;
    };
    let s = spec("gemma3");
    let file = memra_gguf::GgufFile::open(&path).unwrap();
    let from_file = dims::from_gguf(&s, &file).unwrap_or_else(|e| panic!("{e}"));
    let from_preset = dims::from_preset(&s, None).unwrap();
    for (name, v) in &from_preset.values {
        assert_eq!(from_file.value(name), Some(*v), "hparam {name}");
    }
    assert_eq!(
        from_file.tensors, from_preset.tensors,
        "preset shapes and types equal the file's"
    );
}
