//! `models::validate` refuses bad model files before any GPU work, naming the key or tensor:
//! each case starts from a good one-layer gemma3 fixture (fixture writer) and breaks one thing.

use std::path::{Path, PathBuf};

use memra_codegen::dims;
use memra_codegen::fixture::{self, Fill};
use memra_codegen::spec::{ArchSpec, Value};
use memra_engine::models::validate::{self, ValidateError};
use memra_gguf::{GgmlType, Gguf, GgufWriter, MetaValue};

const PATH: &str = "bad-model-test.gguf";

fn spec() -> ArchSpec {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    ArchSpec::load(&root.join("specs/gemma3.toml")).unwrap()
}

/// The good model: gemma3's preset with one layer and a 256-token vocabulary.
fn good() -> Vec<u8> {
    let spec = spec();
    let d = dims::from_preset_with(
        &spec,
        None,
        &[("block_count", Value::Int(1)), ("n_vocab", Value::Int(256))],
    )
    .unwrap();
    fixture::writer_for(&spec, &d, Fill::Zeros)
        .unwrap()
        .to_bytes()
        .unwrap()
}

/// A copy of `bytes` with metadata and tensors passed through `meta` and `tensor`
/// (return `None` to drop an entry; a tensor may change its dims and type, and gets zero data).
fn rewrite(
    bytes: &[u8],
    meta: impl Fn(&str, MetaValue) -> Option<MetaValue>,
    tensor: impl Fn(&str, Vec<u64>, GgmlType) -> Option<(Vec<u64>, GgmlType)>,
) -> Vec<u8> {
    let file = Gguf::parse(bytes).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata() {
        if let Some(v) = meta(k, v.into_owned()) {
            w.add_meta(k, v);
        }
    }
    for t in file.tensors() {
        if let Some((dims, ty)) = tensor(t.name, t.dims.to_vec(), t.ggml_type) {
            let n = dims[1..].iter().product::<u64>() * ty.row_bytes(dims[0]).unwrap();
            w.add_tensor_bytes(t.name, &dims, ty, vec![0; n as usize])
                .unwrap();
        }
    }
    w.to_bytes().unwrap()
}

fn refuse(bytes: &[u8]) -> String {
    let file = Gguf::parse(bytes).unwrap();
    let err = validate::validate(&file, Path::new(PATH)).expect_err("the model should be refused");
    let text = err.to_string();
    println!("{text}");
    assert!(text.starts_with(PATH), "the message names the file: {text}");
    text
}

#[test]
fn the_good_fixture_is_accepted() {
    let bytes = good();
    let file = Gguf::parse(bytes.as_slice()).unwrap();
    let info = validate::validate(&file, Path::new(PATH)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((info.arch, info.n_layer), ("gemma3", 1));
    assert_eq!(info.n_tensors, file.tensors().len());
    let data: u64 = file.tensors().iter().map(|t| t.n_bytes).sum();
    assert_eq!(info.tensor_bytes, data);
    assert_eq!(
        info.types.iter().map(|(_, n)| n).sum::<usize>(),
        info.n_tensors
    );
}

#[test]
fn unknown_architecture_is_refused_naming_the_key_and_the_known_ones() {
    let bytes = rewrite(
        &good(),
        |k, v| {
            Some(if k == "general.architecture" {
                "llama".into()
            } else {
                v
            })
        },
        |_, d, t| Some((d, t)),
    );
    let text = refuse(&bytes);
    assert!(text.contains("general.architecture is 'llama'"), "{text}");
    for arch in validate::known_architectures() {
        assert!(
            text.contains(arch),
            "known architecture '{arch}' not listed: {text}"
        );
    }
    assert!(matches!(
        validate::validate(&Gguf::parse(bytes.as_slice()).unwrap(), Path::new(PATH)),
        Err(ValidateError::Architecture { .. })
    ));

    let bytes = rewrite(
        &good(),
        |k, v| (k != "general.architecture").then_some(v),
        |_, d, t| Some((d, t)),
    );
    let text = refuse(&bytes);
    assert!(text.contains("'general.architecture' is missing"), "{text}");
}

#[test]
fn hparam_contradicting_tensor_shapes_is_refused_naming_the_tensors() {
    // n_embd 640 in every tensor, 512 in the metadata.
    let bytes = rewrite(
        &good(),
        |k, v| {
            Some(if k == "gemma3.embedding_length" {
                MetaValue::U32(512)
            } else {
                v
            })
        },
        |_, d, t| Some((d, t)),
    );
    let text = refuse(&bytes);
    assert!(
        text.contains("tensor 'token_embd.weight' has shape [640, 256], expected [512, 256]"),
        "{text}"
    );
    assert!(
        text.contains("tensor 'blk.0.ffn_down.weight' has shape [2048, 640]"),
        "{text}"
    );
    // ... and the metadata key behind the contradiction.
    assert!(
        text.contains("n_embd = 512 from 'gemma3.embedding_length'"),
        "{text}"
    );
}

#[test]
fn absurd_layer_count_is_refused_before_the_weights_are_mapped() {
    let bytes = rewrite(
        &good(),
        |k, v| {
            Some(if k == "gemma3.block_count" {
                MetaValue::U32(u32::MAX)
            } else {
                v
            })
        },
        |_, d, t| Some((d, t)),
    );
    let text = refuse(&bytes);
    assert!(
        text.contains("n_layer = 4294967295 (from 'gemma3.block_count')"),
        "{text}"
    );
}

#[test]
fn generated_weights_loader_refuses_an_absurd_layer_count_itself() {
    use memra_engine::models::spec::gemma3::{Gemma3Hparams, Gemma3Weights};
    let bytes = good();
    let file = Gguf::parse(bytes.as_slice()).unwrap();
    let mut hp = Gemma3Hparams::from_gguf(&file).unwrap();
    hp.n_layer = u32::MAX;
    let err = Gemma3Weights::from_gguf(&file, &hp)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("n_layer = 4294967295 exceeds the file's 15 tensors"),
        "{err}"
    );
}

#[test]
fn missing_hparam_key_is_refused_naming_it() {
    let bytes = rewrite(
        &good(),
        |k, v| (k != "gemma3.attention.head_count").then_some(v),
        |_, d, t| Some((d, t)),
    );
    let text = refuse(&bytes);
    assert!(
        text.contains("'gemma3.attention.head_count' is missing"),
        "{text}"
    );
}

#[test]
fn missing_tensor_is_refused_naming_it() {
    let bytes = rewrite(
        &good(),
        |_, v| Some(v),
        |name, d, t| (name != "blk.0.ffn_gate.weight").then_some((d, t)),
    );
    let text = refuse(&bytes);
    assert!(
        text.contains("tensor 'blk.0.ffn_gate.weight' is missing"),
        "{text}"
    );
}

#[test]
fn unsupported_quant_type_is_refused_naming_tensor_and_type() {
    let supported = validate::supported_types();
    assert!(
        !supported.is_empty(),
        "the registry has no matvec/matmul/embed variants"
    );
    // blk.0.attn_output.weight has rows of n_head * head_dim_v = 1024 elements: any block size
    // up to 256 fits. The type is the first one no weight-reading variant of this build reads.
    let target = "blk.0.attn_output.weight";
    let unsupported = GgmlType::all()
        .find(|t| !supported.contains(t) && t.row_bytes(1024).is_some())
        .expect("some ggml type has no kernel");
    let bytes = rewrite(
        &good(),
        |_, v| Some(v),
        |name, d, t| Some((d, if name == target { unsupported } else { t })),
    );
    let text = refuse(&bytes);
    assert!(
        text.contains(&format!(
            "tensor '{target}' has type {unsupported}, which no"
        )),
        "{text}"
    );
    // Every other tensor's type is readable: exactly one problem.
    assert!(text.contains("(1 problem(s))"), "{text}");
}

#[test]
fn truncated_tensor_data_is_refused_naming_the_tensor() {
    let bytes = good();
    let file = Gguf::parse(bytes.as_slice()).unwrap();
    let last = file.tensors().iter().max_by_key(|t| t.offset).unwrap();
    let (last_name, cut) = (
        last.name.to_string(),
        bytes.len() - (last.n_bytes as usize) / 2,
    );
    let path = temp_path("truncated.gguf");
    std::fs::write(&path, &bytes[..cut]).unwrap();
    let err = validate::validate_path(&path)
        .map(|_| ())
        .expect_err("a truncated file is refused");
    std::fs::remove_file(&path).ok();
    let text = err.to_string();
    println!("{text}");
    assert!(matches!(err, ValidateError::Read(_)), "{err:?}");
    assert!(text.contains(&path.display().to_string()), "{text}");
    assert!(
        text.contains(&format!("tensor '{last_name}' extends past end of file")),
        "{text}"
    );
}

#[test]
fn validate_path_accepts_the_good_fixture_on_disk() {
    let path = temp_path("good.gguf");
    std::fs::write(&path, good()).unwrap();
    let result = validate::validate_path(&path);
    std::fs::remove_file(&path).ok();
    let (file, info) = result.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(info.n_tensors, file.tensors().len());
}

#[test]
fn the_real_gemma3_file_is_accepted() {
    let path = match std::env::var_os("MEMRA_GEMMA3_GGUF") {
        Some(p) => PathBuf::from(p),
        None => std::env::var_os("MEMRA_CACHE")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/memra")))
            .unwrap_or_default()
            .join("models/gemma-3-270m-q4_k_m.gguf"),
    };
    if !path.is_file() {
        println!(
            "SKIP: real gemma3 GGUF absent (set MEMRA_GEMMA3_GGUF or run scripts/fetch-gemma3-270m)"
        );
        return;
    }
    let (file, info) = validate::validate_path(&path).unwrap_or_else(|e| panic!("{e}"));
    println!("{info:?}");
    assert_eq!(
        (info.arch, info.n_layer, info.n_tensors),
        ("gemma3", 18, file.tensors().len())
    );
    let types: Vec<GgmlType> = info.types.iter().map(|(t, _)| *t).collect();
    for t in [GgmlType::F32, GgmlType::Q4_K, GgmlType::Q6_K] {
        assert!(types.contains(&t), "{t} missing from {types:?}");
    }
}

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("memra-bad-models-{}-{name}", std::process::id()))
}
