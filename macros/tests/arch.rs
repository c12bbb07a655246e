//! `arch!` for every spec: generated hparams read GGUF metadata (defaults, tensor dims,
//! derived values), and the weight loader maps tensors by name and reports every missing or
//! mis-shaped one. GGUFs are written from the spec with `memra_codegen::fixture`.

use std::path::{Path, PathBuf};

use memra_codegen::dims;
use memra_codegen::fixture::{self, Fill};
use memra_codegen::spec::{ArchSpec, Value};
use memra_gguf::{Gguf, GgufWriter};

mod glm_dsa {
    memra_macros::arch!("glm-dsa");
}
mod qwen3 {
    memra_macros::arch!("qwen3");
}
mod olmoe {
    memra_macros::arch!("olmoe");
}
mod gemma3 {
    memra_macros::arch!("gemma3");
}

use gemma3::{Gemma3, Gemma3Hparams, Gemma3Weights};
use glm_dsa::{GlmDsa, GlmDsaHparams, GlmDsaWeights};

fn spec(arch: &str) -> ArchSpec {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    ArchSpec::load(&root.join(format!("specs/{arch}.toml"))).unwrap()
}

/// The spec's GGUF image with some tensors dropped or reshaped and some keys dropped.
fn image(
    spec: &ArchSpec,
    overrides: &[(&str, Value)],
    drop: &[&str],
    reshape: &[(&str, &[u64])],
) -> Vec<u8> {
    let d = dims::from_preset_with(spec, None, overrides).unwrap_or_else(|e| panic!("{e}"));
    let full = Gguf::parse(
        fixture::writer_for(spec, &d, Fill::Zeros)
            .unwrap()
            .to_bytes()
            .unwrap(),
    )
    .unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in full.metadata() {
        if !drop.contains(&k) {
            w.add_meta(k, v);
        }
    }
    for t in full.tensors() {
        if drop.contains(&t.name) {
            continue;
        }
        let dims = reshape
            .iter()
            .find(|(n, _)| *n == t.name)
            .map(|(_, s)| s.to_vec())
            .unwrap_or_else(|| t.dims.to_vec());
        let bytes = dims[1..].iter().product::<u64>() * t.ggml_type.row_bytes(dims[0]).unwrap();
        w.add_tensor_bytes(t.name, &dims, t.ggml_type, vec![0; bytes as usize])
            .unwrap();
    }
    w.to_bytes().unwrap()
}

fn gemma3_micro() -> [(&'static str, Value); 2] {
    [("block_count", Value::Int(2)), ("n_vocab", Value::Int(512))]
}

#[test]
fn marker_types_carry_arch_and_capabilities() {
    assert_eq!(GlmDsa::ARCH, "glm-dsa");
    assert_eq!(GlmDsa::ATTENTION, "mla_dsa");
    assert_eq!(GlmDsa::ROUTER, "sigmoid_bias");
    let shared = GlmDsa::SHARED_EXPERT;
    assert!(shared, "spec: shared_expert = true");
    assert_eq!(Gemma3::NORM, "sandwich");
    assert_eq!(Gemma3::SLIDING_WINDOW_PATTERN, 6);
    assert_eq!(qwen3::Qwen3::TIED_EMBEDDINGS, "optional");
    assert_eq!(olmoe::Olmoe::QK_NORM, "full");
    assert!(
        Gemma3::SPEC.contains("name = \"gemma3\""),
        "SPEC is the spec text"
    );
}

#[test]
fn gemma3_hparams_and_weights_from_a_micro_gguf() {
    let s = spec("gemma3");
    let bytes = image(&s, &gemma3_micro(), &["gemma3.rope.freq_base_swa"], &[]);
    let file = Gguf::parse(&bytes[..]).unwrap();
    let hp = Gemma3Hparams::from_gguf(&file).unwrap();
    assert_eq!(
        (hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff),
        (640, 4, 1, 256, 2048)
    );
    assert_eq!(hp.n_rot, 256, "absent key: default `head_dim`");
    assert_eq!(hp.rope_freq_base_swa, 10000.0, "absent key: default value");
    assert_eq!(hp.n_vocab, 512, "read from token_embd ne[1]");
    assert_eq!((hp.block_count, hp.n_layer), (2, 2));
    assert!((hp.rms_eps - 1e-6).abs() < 1e-12);
    assert!(
        hp.is_sliding_window_layer(0)
            && !hp.is_sliding_window_layer(5)
            && hp.is_sliding_window_layer(6)
    );

    let w = Gemma3Weights::from_gguf(&file, &hp).unwrap();
    assert_eq!(w.layers.len(), 2);
    assert_eq!(w.global.token_embd.name, "token_embd.weight");
    assert_eq!(w.global.token_embd.dims, [640, 512]);
    assert_eq!(w.layers[1].attn_q.name, "blk.1.attn_q.weight");
    assert_eq!(w.layers[1].attn_k.dims, [640, 256]);
    assert_eq!(w.layers[0].post_ffw_norm.name, "blk.0.post_ffw_norm.weight");

    // try_map hands every tensor with its GGUF name to the caller, e.g. for uploads.
    let mut seen = Vec::new();
    let mapped = w.try_map(|name, info| {
        seen.push(name.to_string());
        assert_eq!(name, info.name);
        Ok::<u64, ()>(info.n_bytes)
    });
    let mapped = mapped.unwrap();
    assert_eq!(seen.len(), 2 + 2 * 13);
    assert_eq!(mapped.layers[0].attn_norm, 640 * 4);
}

#[test]
fn gemma3_loader_names_every_missing_and_mis_shaped_tensor() {
    let s = spec("gemma3");
    let bytes = image(
        &s,
        &gemma3_micro(),
        &["blk.1.ffn_up.weight", "blk.0.attn_q_norm.weight"],
        &[("blk.0.attn_k.weight", &[640, 512])],
    );
    let file = Gguf::parse(&bytes[..]).unwrap();
    let hp = Gemma3Hparams::from_gguf(&file).unwrap();
    let err = Gemma3Weights::from_gguf(&file, &hp).unwrap_err();
    assert_eq!(err.problems.len(), 3, "{err}");
    let text = err.to_string();
    assert!(
        text.contains("gemma3 model does not match specs/gemma3.toml (3 problem(s))"),
        "{text}"
    );
    assert!(
        text.contains("tensor 'blk.1.ffn_up.weight' is missing"),
        "{text}"
    );
    assert!(
        text.contains("tensor 'blk.0.attn_q_norm.weight' is missing"),
        "{text}"
    );
    assert!(text.contains("tensor 'blk.0.attn_k.weight' has shape [640, 512], expected [640, 256] = [n_embd, n_head_kv * head_dim]"), "{text}");
}

#[test]
fn hparam_errors_name_the_key_and_are_collected() {
    let s = spec("gemma3");
    let bytes = image(
        &s,
        &gemma3_micro(),
        &[
            "gemma3.embedding_length",
            "gemma3.attention.layer_norm_rms_epsilon",
        ],
        &[],
    );
    let err = Gemma3Hparams::from_gguf(&Gguf::parse(&bytes[..]).unwrap()).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("metadata key 'gemma3.embedding_length' is missing (hparam `n_embd`)"),
        "{text}"
    );
    assert!(
        text.contains(
            "metadata key 'gemma3.attention.layer_norm_rms_epsilon' is missing (hparam `rms_eps`)"
        ),
        "{text}"
    );
    assert_eq!(
        err.problems.len(),
        2,
        "head_dim's default needs n_embd but adds no second complaint: {text}"
    );

    let err = GlmDsaHparams::from_gguf(&Gguf::parse(&bytes[..]).unwrap()).unwrap_err();
    assert!(
        err.to_string()
            .contains("general.architecture is `gemma3`, expected `glm-dsa`"),
        "{err}"
    );
}

fn glm_micro() -> Vec<(&'static str, Value)> {
    // Small dims that keep Q4_K experts (ne0 multiple of 256) and Q8_0 elsewhere valid.
    vec![
        ("block_count", Value::Int(4)),
        ("leading_dense_block_count", Value::Int(1)),
        ("n_embd", Value::Int(256)),
        ("n_ff", Value::Int(512)),
        ("n_ff_exp", Value::Int(256)),
        ("n_head", Value::Int(2)),
        ("q_lora_rank", Value::Int(64)),
        ("kv_lora_rank", Value::Int(64)),
        ("key_length", Value::Int(96)),
        ("value_length", Value::Int(64)),
        ("key_length_mla", Value::Int(64)),
        ("value_length_mla", Value::Int(32)),
        ("n_rot", Value::Int(32)),
        ("n_expert", Value::Int(4)),
        ("n_expert_used", Value::Int(2)),
        ("indexer_n_head", Value::Int(2)),
        ("indexer_head_dim", Value::Int(32)),
        ("n_vocab", Value::Int(64)),
    ]
}

#[test]
fn glm_dsa_layer_ranges_and_optional_indexer() {
    let s = spec("glm-dsa");
    let indexer: Vec<String> = (0..3)
        .flat_map(|i| {
            [
                "attn_q_b.weight",
                "attn_k.weight",
                "k_norm.weight",
                "k_norm.bias",
                "proj.weight",
            ]
            .map(|t| format!("blk.{i}.indexer.{t}"))
        })
        .collect();
    let mut drop: Vec<&str> = indexer
        .iter()
        .filter(|n| !n.starts_with("blk.1."))
        .map(String::as_str)
        .collect();
    drop.push("glm-dsa.expert_group_count");
    let bytes = image(&s, &glm_micro(), &drop, &[]);
    let file = Gguf::parse(&bytes[..]).unwrap();
    let hp = GlmDsaHparams::from_gguf(&file).unwrap();
    assert_eq!(hp.n_layer, 3, "block_count 4 minus 1 nextn layer");
    assert_eq!(
        (hp.qk_nope_head_dim, hp.v_head_dim, hp.kv_a_dim),
        (32, 32, 96)
    );
    assert_eq!(hp.n_expert_groups, 1, "default");
    assert!(hp.expert_weights_norm);
    assert_eq!(hp.expert_weights_scale, 2.5);
    assert!(hp.is_dense_layer(0) && !hp.is_dense_layer(1));

    let w = GlmDsaWeights::from_gguf(&file, &hp).unwrap();
    assert_eq!(w.layers.len(), 3);
    assert!(w.layers[0].ffn_gate.is_some() && w.layers[0].ffn_gate_exps.is_none());
    assert!(w.layers[2].ffn_gate.is_none());
    assert_eq!(w.layers[2].ffn_gate_exps.unwrap().dims, [256, 256, 4]);
    assert_eq!(
        w.layers[1].exp_probs_b_bias.unwrap().name,
        "blk.1.exp_probs_b.bias"
    );
    assert_eq!(w.layers[1].attn_k_b.dims, [32, 64, 2]);
    // The indexer is optional: present only on layer 1 here (like GLM-5.2's shared layers).
    assert!(w.layers[0].indexer_attn_k.is_none() && w.layers[2].indexer_k_norm_bias.is_none());
    assert_eq!(
        w.layers[1].indexer_k_norm_bias.unwrap().name,
        "blk.1.indexer.k_norm.bias"
    );
}

#[test]
fn glm_dsa_missing_range_tensor_is_an_error_but_out_of_range_is_not_looked_for() {
    let s = spec("glm-dsa");
    let bytes = image(
        &s,
        &glm_micro(),
        &["blk.2.ffn_down_exps.weight"],
        &[("blk.0.ffn_gate.weight", &[256, 256])],
    );
    let file = Gguf::parse(&bytes[..]).unwrap();
    let hp = GlmDsaHparams::from_gguf(&file).unwrap();
    let text = GlmDsaWeights::from_gguf(&file, &hp)
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("tensor 'blk.2.ffn_down_exps.weight' is missing"),
        "{text}"
    );
    assert!(text.contains("tensor 'blk.0.ffn_gate.weight' has shape [256, 256], expected [256, 512] = [n_embd, n_ff]"), "{text}");
    assert!(
        !text.contains("blk.1.ffn_gate.weight"),
        "dense tensors are not expected on MoE layers: {text}"
    );
}

fn real_gemma3() -> Option<PathBuf> {
    let path = match std::env::var_os("MEMRA_GEMMA3_GGUF") {
        Some(p) => PathBuf::from(p),
        None => std::env::var_os("MEMRA_CACHE")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/memra")))?
            .join("models/gemma-3-270m-q4_k_m.gguf"),
    };
    path.is_file().then_some(path)
}

#[test]
fn gemma3_loader_on_the_real_file() {
    let Some(path) = real_gemma3() else {
        println!(
            "SKIP: real gemma3 GGUF absent (set MEMRA_GEMMA3_GGUF or run scripts/fetch-gemma3-270m)"
        );
        return;
    };
    let file = memra_gguf::GgufFile::open(&path).unwrap();
    let hp = Gemma3Hparams::from_gguf(&file).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (
            hp.n_embd,
            hp.n_layer,
            hp.n_head,
            hp.n_head_kv,
            hp.head_dim,
            hp.n_vocab
        ),
        (640, 18, 4, 1, 256, 262144)
    );
    assert_eq!(hp.sliding_window, 512);
    assert_eq!(hp.rope_freq_base, 1_000_000.0);
    let globals: Vec<usize> = (0..18)
        .filter(|&il| !hp.is_sliding_window_layer(il))
        .collect();
    assert_eq!(globals, [5, 11, 17], "model-specs §5.3: global layers");
    let w = Gemma3Weights::from_gguf(&file, &hp).unwrap_or_else(|e| panic!("{e}"));
    let mut count = 0;
    w.try_map(|_, _| {
        count += 1;
        Ok::<(), ()>(())
    })
    .unwrap();
    assert_eq!(
        count,
        file.tensors().len(),
        "every tensor of the file is claimed by the spec"
    );
    println!("gemma3 real file: {count} tensors mapped");
}
