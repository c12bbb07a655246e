//! `fixture::micro_model` for every spec: the file parses, `dims::from_gguf` accepts it (every
//! tensor present at the spec's shape), it is small, its vocabulary matches `token_embd`, the
//! preset's types survive where the rows allow, and the bytes depend only on the seed.

use std::path::{Path, PathBuf};

use memra_codegen::dims;
use memra_codegen::fixture::{self, MICRO_N_VOCAB};
use memra_codegen::spec::ArchSpec;
use memra_gguf::{GgmlType, Gguf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

#[test]
fn every_spec_has_a_complete_micro_model() {
    let archs = memra_codegen::build::spec_archs(&root().join("specs")).unwrap();
    for arch in archs {
        let spec = ArchSpec::load(&root().join(format!("specs/{arch}.toml"))).unwrap();
        let bytes = fixture::micro_model(&spec, 7).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert!(bytes.len() < 8 << 20, "{arch}: {} bytes", bytes.len());
        assert_eq!(
            bytes,
            fixture::micro_model(&spec, 7).unwrap(),
            "{arch}: same seed, same bytes"
        );
        assert_ne!(
            bytes,
            fixture::micro_model(&spec, 8).unwrap(),
            "{arch}: seed unused"
        );
        let file = Gguf::parse(bytes).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let d = dims::from_gguf(&spec, &file).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let want = fixture::micro_dims(&spec).unwrap();
        for t in &want.tensors {
            let got = d
                .tensor(&t.name)
                .unwrap_or_else(|| panic!("{arch}: {} missing", t.name));
            assert_eq!(
                (&got.shape, got.ggml_type),
                (&t.shape, t.ggml_type),
                "{arch}: {}",
                t.name
            );
        }
        assert_eq!(d.int("n_vocab"), Some(MICRO_N_VOCAB as i64), "{arch}");
        let tokens = file.get_str_array("tokenizer.ggml.tokens").unwrap();
        assert_eq!(tokens.len(), MICRO_N_VOCAB, "{arch}");
        let model = file.get_str("tokenizer.ggml.model").unwrap();
        if model == "gpt2" {
            assert!(
                file.get_str_array("tokenizer.ggml.merges").unwrap().len() > 100,
                "{arch}"
            );
        } else {
            assert_eq!(model, "llama", "{arch}");
        }
        // Some matrix keeps a quantized type (the micro dims are multiples of 256 on purpose).
        assert!(
            d.tensors.iter().any(|t| t.ggml_type != GgmlType::F32),
            "{arch}: every tensor fell back to F32"
        );
        println!(
            "{arch}: {} tensors, {} layers",
            d.tensors.len(),
            d.int("n_layer").unwrap()
        );
    }
}

#[test]
fn micro_dims_cover_every_layer_kind() {
    let load = |a: &str| ArchSpec::load(&root().join(format!("specs/{a}.toml"))).unwrap();
    let g = fixture::micro_dims(&load("gemma3")).unwrap();
    assert_eq!(g.int("n_layer"), Some(6), "a whole sliding-window period");
    assert_eq!(g.int("sliding_window"), Some(4));
    let glm = fixture::micro_dims(&load("glm-dsa")).unwrap();
    assert_eq!(
        (
            glm.int("block_count"),
            glm.int("n_layer"),
            glm.int("leading_dense_block_count")
        ),
        (Some(4), Some(3), Some(1)),
        "one dense layer, two MoE layers, one nextn block"
    );
    assert_eq!(glm.int("indexer_top_k"), Some(4));
    assert!(glm.tensor("blk.0.ffn_gate.weight").is_some());
    assert!(glm.tensor("blk.1.ffn_gate_exps.weight").is_some());
    let q = fixture::micro_dims(&load("qwen3")).unwrap();
    assert_eq!(
        (q.int("n_head"), q.int("n_head_kv")),
        (Some(4), Some(2)),
        "GQA groups of 2"
    );
}
