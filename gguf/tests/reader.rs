//! Reader API on valid files: header fields, typed accessors and their errors, tensor views,
//! file opening, and (when present) the real Gemma 3 270M file.

mod common;

use std::path::PathBuf;

use common::{TOKENS, fixture_bytes};
use memra_gguf::{ErrorKind, GgmlType, Gguf, GgufFile, GgufWriter, MetaArrayRef, MetaValue, MetaValueRef};

#[test]
fn header_fields_of_the_fixture() {
    let bytes = fixture_bytes();
    let f = Gguf::parse(&bytes[..]).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.data_offset() % 32, 0);
    assert!(f.data_offset() > 0 && f.data_offset() < bytes.len() as u64);
    assert_eq!(f.architecture().unwrap(), "tiny");
    assert_eq!(f.arch_key("block_count").unwrap(), "tiny.block_count");
    // Metadata keeps file order.
    let keys: Vec<&str> = f.metadata().iter().map(|(k, _)| k).collect();
    assert_eq!(keys.first(), Some(&"general.architecture"));
    assert_eq!(keys.last(), Some(&"tokenizer.ggml.add_bos_token"));
    assert_eq!(keys.len(), 15);
}

#[test]
fn integer_accessors_accept_any_width_and_reject_negatives() {
    let mut w = GgufWriter::new();
    w.add_meta("u8", 200u8)
        .add_meta("i8", MetaValue::I8(-1))
        .add_meta("u16", 65535u16)
        .add_meta("i16", MetaValue::I16(300))
        .add_meta("i32", 7i32)
        .add_meta("u64.big", u64::MAX)
        .add_meta("i64", 42i64)
        .add_meta("f32", 0.5f32)
        .add_meta("s", "text");
    let bytes = w.to_bytes().unwrap();
    let f = Gguf::parse(&bytes[..]).unwrap();

    assert_eq!(f.get_u32("u8").unwrap(), 200);
    assert_eq!(f.get_u64("u16").unwrap(), 65535);
    assert_eq!(f.get_usize("i16").unwrap(), 300);
    assert_eq!(f.get_u32("i32").unwrap(), 7);
    assert_eq!(f.get_u64("i64").unwrap(), 42);
    assert_eq!(f.get_u64("u64.big").unwrap(), u64::MAX);
    assert_eq!(f.get_i64("i8").unwrap(), -1);

    let neg = f.get_u32("i8").unwrap_err();
    assert!(matches!(neg.kind(), ErrorKind::OutOfRange { .. }));
    assert!(neg.to_string().contains("'i8'") && neg.to_string().contains("-1"), "{neg}");
    let big = f.get_u32("u64.big").unwrap_err().to_string();
    assert!(big.contains("'u64.big'") && big.contains("u32"), "{big}");
    let float = f.get_u32("f32").unwrap_err().to_string();
    assert!(float.contains("'f32'") && float.contains("FLOAT32"), "{float}");
    let missing = f.get_u32("nope").unwrap_err();
    assert!(missing.is_missing_key());
    assert!(missing.to_string().contains("'nope'"), "{missing}");
    let string = f.get_u64("s").unwrap_err().to_string();
    assert!(string.contains("STRING"), "{string}");
}

#[test]
fn float_bool_and_string_accessors() {
    let bytes = fixture_bytes();
    let f = Gguf::parse(&bytes[..]).unwrap();
    assert_eq!(f.get_f32("tiny.attention.layer_norm_rms_epsilon").unwrap(), 1e-6);
    assert_eq!(f.get_f32("tiny.rope.freq_base").unwrap(), 10000.0);
    assert_eq!(f.get_f64("tiny.block_count").unwrap(), 2.0, "integers convert to floats");
    assert!(!f.get_bool("tiny.use_bias").unwrap());
    assert!(f.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert_eq!(f.get_str("general.name").unwrap(), "fixture");
    let e = f.get_bool("general.name").unwrap_err().to_string();
    assert!(e.contains("'general.name'") && e.contains("BOOL"), "{e}");
    let e = f.get_str("tiny.block_count").unwrap_err().to_string();
    assert!(e.contains("UINT32") && e.contains("STRING"), "{e}");
}

#[test]
fn array_accessors() {
    let bytes = fixture_bytes();
    let f = Gguf::parse(&bytes[..]).unwrap();
    assert_eq!(f.get_str_array("tokenizer.ggml.tokens").unwrap(), TOKENS);
    assert_eq!(f.get_f32_array("tokenizer.ggml.scores").unwrap().get(3).unwrap(), -3.5);
    assert_eq!(f.get_i32_array("tokenizer.ggml.token_type").unwrap().to_vec(), [3, 3, 3, 1, 1, 6]);
    assert_eq!(
        f.get_u64_array("tokenizer.ggml.token_type").unwrap(),
        vec![3, 3, 3, 1, 1, 6]
    );
    assert_eq!(f.get_array("tokenizer.ggml.tokens").unwrap().len(), TOKENS.len());
    let e = f.get_f32_array("tokenizer.ggml.tokens").unwrap_err().to_string();
    assert!(e.contains("ARRAY of STRING") && e.contains("ARRAY of FLOAT32"), "{e}");
    let e = f.get_u64_array("tokenizer.ggml.scores").unwrap_err().to_string();
    assert!(e.contains("ARRAY of FLOAT32"), "{e}");
    let e = f.get_str_array("general.name").unwrap_err().to_string();
    assert!(e.contains("'general.name'"), "{e}");

    let mut w = GgufWriter::new();
    w.add_meta("layers", vec![4i16, -1]);
    let bytes = w.to_bytes().unwrap();
    let e = Gguf::parse(&bytes[..]).unwrap().get_u64_array("layers").unwrap_err().to_string();
    assert!(e.contains("layers[1]") && e.contains("-1"), "{e}");
}

#[test]
fn tensor_infos_and_views() {
    let writer = common::fixture_writer();
    let bytes = writer.to_bytes().unwrap();
    let f = Gguf::parse(&bytes[..]).unwrap();
    let names: Vec<&str> = f.tensors().iter().map(|t| t.name).collect();
    assert_eq!(
        names,
        ["token_embd.weight", "blk.0.attn_q.weight", "output_norm.weight", "blk.0.ffn_down.weight"]
    );

    let q = f.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(q.dims, [64, 8]);
    assert_eq!(q.ggml_type, GgmlType::Q8_0);
    assert_eq!((q.n_elements(), q.row_len(), q.n_rows(), q.row_bytes()), (512, 64, 8, 68));
    assert_eq!(q.n_bytes, 8 * 68);
    // Same seeded bytes as the fixture wrote.
    let mut rng = common::Rng::new(7);
    (0..64 * 6).for_each(|_| {
        rng.f32_sym();
    });
    assert_eq!(f.tensor_data(q), rng.bytes(8 * 68));
    assert_eq!(f.tensor_bytes("blk.0.attn_q.weight").unwrap(), f.tensor_data(q));

    let norm = f.tensor_data(f.tensor("output_norm.weight").unwrap());
    let first = f32::from_le_bytes(norm[..4].try_into().unwrap());
    let last = f32::from_le_bytes(norm[norm.len() - 4..].try_into().unwrap());
    assert_eq!((norm.len(), first, last), (256, 1.0, 1.0 + 63.0 / 64.0));

    for t in f.tensors() {
        assert_eq!(t.offset % 32, 0, "{}", t.name);
        assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes, "{}", t.name);
    }
    assert!(f.tensor("missing").is_none());
    let e = f.tensor_bytes("missing").unwrap_err().to_string();
    assert!(e.contains("'missing'"), "{e}");
}

#[test]
fn version_2_is_read_like_version_3() {
    let mut bytes = fixture_bytes();
    bytes[4] = 2;
    let f = Gguf::parse(&bytes[..]).unwrap();
    assert_eq!(f.version(), 2);
    assert_eq!(f.tensors().len(), 4);
}

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("memra-gguf-{}-{name}", std::process::id()))
}

#[test]
fn open_maps_a_file_and_errors_name_it() {
    let path = temp_path("open.gguf");
    common::fixture_writer().write_file(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.path(), Some(path.as_path()));
    assert_eq!(f.bytes(), fixture_bytes());
    let e = f.get_u32("absent").unwrap_err().to_string();
    assert!(e.starts_with(&path.display().to_string()), "{e}");

    std::fs::write(&path, b"GGUF\x01\x00\x00\x00").unwrap();
    let e = GgufFile::open(&path).unwrap_err().to_string();
    assert!(e.contains(&path.display().to_string()) && e.contains("version 1"), "{e}");
    std::fs::write(&path, b"").unwrap();
    let e = GgufFile::open(&path).unwrap_err().to_string();
    assert!(e.contains("empty"), "{e}");
    std::fs::remove_file(&path).unwrap();

    let e = GgufFile::open(&path).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Io(_)));
    assert!(e.to_string().contains(&path.display().to_string()), "{e}");

    // A directory is named as one (mmap alone says "No such device").
    let dir = temp_path("a-directory.gguf");
    std::fs::create_dir_all(&dir).unwrap();
    let e = GgufFile::open(&dir).unwrap_err().to_string();
    std::fs::remove_dir(&dir).unwrap();
    assert!(e.contains(&dir.display().to_string()) && e.contains("is a directory, not a GGUF file"), "{e}");
}

/// The real model, when it has been fetched (`scripts/fetch-gemma3-270m`).
fn gemma3_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MEMRA_GEMMA3_GGUF") {
        return Some(PathBuf::from(p));
    }
    let cache = std::env::var_os("MEMRA_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/memra")))?;
    let p = cache.join("models/gemma-3-270m-q4_k_m.gguf");
    p.exists().then_some(p)
}

#[test]
fn real_gemma3_270m_file() {
    let Some(path) = gemma3_path() else {
        eprintln!("SKIP real_gemma3_270m_file: model not found (set MEMRA_GEMMA3_GGUF)");
        return;
    };
    let start = std::time::Instant::now();
    let f = GgufFile::open(&path).unwrap();
    eprintln!("parsed {} in {:?}", path.display(), start.elapsed());

    assert_eq!(f.architecture().unwrap(), "gemma3");
    assert_eq!(f.tensors().len(), 236);
    assert_eq!(f.get_str_array("tokenizer.ggml.tokens").unwrap().len(), 262144);
    assert_eq!(f.get_f32_array("tokenizer.ggml.scores").unwrap().len(), 262144);
    assert_eq!(f.get_u32(&f.arch_key("block_count").unwrap()).unwrap(), 18);
    assert_eq!(f.get_u32("gemma3.embedding_length").unwrap(), 640);
    assert_eq!(f.get_u32("tokenizer.ggml.bos_token_id").unwrap(), 2);
    let embd = f.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.dims, [640, 262144]);
    assert_eq!(embd.ggml_type, GgmlType::Q8_0);
    assert_eq!(f.tensor("blk.0.attn_q.weight").unwrap().dims, [640, 1024]);
    // Every byte after the header is tensor data or padding.
    let data: u64 = f.tensors().iter().map(|t| t.n_bytes).sum();
    let end = f.tensors().iter().map(|t| t.offset + t.n_bytes).max().unwrap();
    assert!(data <= end && f.data_offset() + end <= f.bytes().len() as u64);
    assert!(matches!(f.get("general.file_type"), Some(MetaValueRef::U32(15))));
    assert!(matches!(
        f.get("tokenizer.ggml.token_type"),
        Some(MetaValueRef::Array(MetaArrayRef::I32(v))) if v.len() == 262144
    ));
}
