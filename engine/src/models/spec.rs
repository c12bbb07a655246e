//! Typed hparams and weight structs for every architecture, generated at compile time from
//! `specs/<arch>.toml` by `memra_macros::arch!` (editing a spec rebuilds this file). For
//! `gemma3`: `Gemma3` (arch id + capabilities), `Gemma3Hparams::from_gguf`,
//! `Gemma3Weights::<&TensorInfo>::from_gguf` (every missing or mis-shaped tensor reported),
//! `Gemma3Weights::try_map` (handles -> device buffers) and `Gemma3LoadError`.

pub mod glm_dsa {
    memra_macros::arch!("glm-dsa");
}

pub mod qwen3 {
    memra_macros::arch!("qwen3");
}

pub mod olmoe {
    memra_macros::arch!("olmoe");
}

pub mod gemma3 {
    memra_macros::arch!("gemma3");
}

pub mod deepseek2 {
    memra_macros::arch!("deepseek2");
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use memra_codegen::dims;
    use memra_codegen::fixture::{self, Fill};
    use memra_codegen::spec::{ArchSpec, Value};
    use memra_gguf::{Gguf, GgufWriter};

    use super::gemma3::{Gemma3Hparams, Gemma3Weights};

    fn real_gemma3() -> Option<PathBuf> {
        let path = match std::env::var_os("MEMRA_GEMMA3_GGUF") {
            Some(p) => PathBuf::from(p),
            None => std::env::var_os("MEMRA_CACHE")
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/memra"))
                })?
                .join("models/gemma-3-270m-q4_k_m.gguf"),
        };
        path.is_file().then_some(path)
    }

    #[test]
    fn gemma3_structs_load_the_real_file() {
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
                hp.n_ff
            ),
            (640, 18, 4, 1, 256, 2048)
        );
        let w = Gemma3Weights::from_gguf(&file, &hp).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(w.layers.len(), 18);
        assert_eq!(w.layers[17].ffn_down.ggml_type, memra_gguf::GgmlType::Q6_K);
        assert_eq!(w.global.token_embd.dims, [640, 262144]);
    }

    #[test]
    fn gemma3_loader_names_an_omitted_and_a_mis_shaped_tensor() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap();
        let spec = ArchSpec::load(&root.join("specs/gemma3.toml")).unwrap();
        let d = dims::from_preset_with(
            &spec,
            None,
            &[("block_count", Value::Int(1)), ("n_vocab", Value::Int(256))],
        )
        .unwrap();
        let full = Gguf::parse(
            fixture::writer_for(&spec, &d, Fill::Zeros)
                .unwrap()
                .to_bytes()
                .unwrap(),
        )
        .unwrap();
        let mut w = GgufWriter::new();
        for (k, v) in full.metadata() {
            w.add_meta(k, v);
        }
        for t in full
            .tensors()
            .iter()
            .filter(|t| t.name != "blk.0.ffn_gate.weight")
        {
            let dims = if t.name == "blk.0.attn_output.weight" {
                vec![1024, 512]
            } else {
                t.dims.to_vec()
            };
            let n = dims[1..].iter().product::<u64>() * t.ggml_type.row_bytes(dims[0]).unwrap();
            w.add_tensor_bytes(t.name, &dims, t.ggml_type, vec![0; n as usize])
                .unwrap();
        }
        let file = Gguf::parse(w.to_bytes().unwrap()).unwrap();
        let hp = Gemma3Hparams::from_gguf(&file).unwrap();
        let err = Gemma3Weights::from_gguf(&file, &hp)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tensor 'blk.0.ffn_gate.weight' is missing"),
            "{err}"
        );
        assert!(err.contains("tensor 'blk.0.attn_output.weight' has shape [1024, 512], expected [1024, 640] = [n_head * head_dim_v, n_embd]"), "{err}");
    }
}
