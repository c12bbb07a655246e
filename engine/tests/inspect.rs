//! `memra inspect` end to end: runs the built binary on a fixture written with the GGUF
//! writer (text and --json), on broken files, and on the real Gemma 3 270M file when present.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use memra_gguf::{GgmlType, GgufWriter};
use serde_json::Value;

const ARCH: &str = "memratest";
const N_TOKENS: usize = 300;

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("memra-inspect-{}-{name}", std::process::id()))
}

fn memra(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memra")).args(args).output().expect("run memra")
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).expect("utf-8 stdout")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A small model-like file: arch hparams, a BPE-style tokenizer, four tensor types,
/// alignment 64.
fn write_fixture(path: &Path) {
    let tokens: Vec<String> = (0..N_TOKENS).map(|i| format!("tok{i}")).collect();
    let mut w = GgufWriter::new().with_alignment(64);
    w.add_meta("general.architecture", ARCH)
        .add_meta("general.name", "fixture model")
        .add_meta("general.file_type", 7u32)
        .add_meta(format!("{ARCH}.block_count"), 2u32)
        .add_meta(format!("{ARCH}.embedding_length"), 64u64)
        .add_meta(format!("{ARCH}.attention.layer_norm_rms_epsilon"), 1e-6f32)
        .add_meta(format!("{ARCH}.rope.freq_base"), 10000.0f32)
        .add_meta("tokenizer.ggml.model", "gpt2")
        .add_meta("tokenizer.ggml.tokens", tokens)
        .add_meta("tokenizer.ggml.merges", vec!["t o", "to k"])
        .add_meta("tokenizer.ggml.bos_token_id", 1u32)
        .add_meta("tokenizer.ggml.eos_token_id", 2i32)
        .add_meta("tokenizer.ggml.padding_token_id", 0u8)
        .add_meta("tokenizer.ggml.add_bos_token", true)
        .add_meta("tokenizer.chat_template", "{% for m in messages %}\n{{ m }}\n{% endfor %}");
    let values: Vec<f32> = (0..64 * N_TOKENS).map(|i| (i % 17) as f32 / 17.0 - 0.5).collect();
    w.add_tensor_f32("token_embd.weight", &[64, N_TOKENS as u64], GgmlType::Q8_0, &values)
        .unwrap()
        .add_tensor_f32("output_norm.weight", &[64], GgmlType::F32, &values[..64])
        .unwrap()
        .add_tensor_f32("blk.0.attn_q.weight", &[64, 64], GgmlType::F16, &values[..64 * 64])
        .unwrap()
        .add_tensor_f32("blk.0.attn_output.weight", &[64, 64], GgmlType::Q8_0, &values[..4096])
        .unwrap()
        .add_tensor_f32("blk.0.ffn_down.weight", &[256, 2], GgmlType::Q4_K, &values[..512])
        .unwrap();
    w.write_file(path).unwrap();
}

#[test]
fn text_report_of_a_fixture() {
    let path = temp_path("text.gguf");
    write_fixture(&path);
    let out = memra(&["inspect", path.to_str().unwrap()]);
    std::fs::remove_file(&path).unwrap();
    let text = stdout(&out);
    assert!(out.status.success(), "stderr: {}", stderr(&out));

    for line in [
        format!("architecture: {ARCH}"),
        "name:         fixture model".to_string(),
        "file type:    Q8_0 (7)".to_string(),
        "version:      3".to_string(),
        "alignment:    64".to_string(),
        format!("spec: no memra spec for architecture {ARCH}"),
        format!("hparams ({ARCH}.*, 4 keys):"),
        "  model:           gpt2".to_string(),
        format!("  vocab size:      {N_TOKENS}"),
        "  bos/eos/pad/unk: 1 / 2 / 0 / -".to_string(),
        "  add_bos:         true".to_string(),
        "  merges:          2".to_string(),
        "tensors (5):".to_string(),
        "total: 5 tensors, ".to_string(),
    ] {
        assert!(text.contains(&line), "missing {line:?} in:\n{text}");
    }
    let has_row = |cells: &[&str]| {
        text.lines().any(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            words.len() >= cells.len() && words[..cells.len()] == *cells
        })
    };
    assert!(has_row(&[&format!("{ARCH}.block_count"), "2"]), "{text}");
    assert!(has_row(&[&format!("{ARCH}.attention.layer_norm_rms_epsilon"), "0.000001"]));
    // name, type, shape, bytes: Q8_0 rows of 64 take 68 bytes.
    let embd_bytes = (68 * N_TOKENS).to_string();
    assert!(has_row(&["token_embd.weight", "Q8_0", "[64,", &format!("{N_TOKENS}]"), &embd_bytes]));
    assert!(has_row(&["blk.0.attn_q.weight", "F16", "[64,", "64]", "8192"]), "{text}");
    assert!(has_row(&["blk.0.ffn_down.weight", "Q4_K", "[256,", "2]", "288"]), "{text}");
    // Per-type totals: two Q8_0 tensors.
    let q8_bytes = (68 * N_TOKENS + 68 * 64).to_string();
    let q8_params = (64 * N_TOKENS + 4096).to_string();
    assert!(has_row(&["Q8_0", "2", &q8_bytes, &q8_params]), "{text}");
    // The vocabulary and the multi-line template are summarized, not dumped.
    assert!(text.contains("\"tok0\"") && !text.contains("tok299"), "{text}");
    assert!(text.contains("\"{% for m in messages %}\\n"), "{text}");
}

#[test]
fn json_report_of_a_fixture() {
    let path = temp_path("json.gguf");
    write_fixture(&path);
    let out = memra(&["inspect", "--json", path.to_str().unwrap()]);
    std::fs::remove_file(&path).unwrap();
    assert!(out.status.success(), "stderr: {}", stderr(&out));
    let json: Value = serde_json::from_str(&stdout(&out)).expect("one JSON object");

    assert_eq!(json["architecture"], ARCH);
    assert_eq!(json["name"], "fixture model");
    assert_eq!(json["version"], 3);
    assert_eq!(json["alignment"], 64);
    assert_eq!(json["file_type"]["name"], "Q8_0");
    assert_eq!(json["spec"]["path"], Value::Null);
    let hparams = json["hparams"].as_array().unwrap();
    assert_eq!(hparams.len(), 4);
    assert_eq!(hparams[0]["key"], format!("{ARCH}.block_count"));
    assert_eq!(hparams[0]["type"], "UINT32");
    assert_eq!(hparams[0]["value"], 2);
    assert_eq!(hparams[2]["value"], 1e-6);
    let tok = &json["tokenizer"];
    assert_eq!(tok["vocab_size"], N_TOKENS);
    assert_eq!((tok["bos_token_id"].as_u64(), tok["eos_token_id"].as_u64()), (Some(1), Some(2)));
    assert_eq!(tok["unknown_token_id"], Value::Null);
    assert_eq!(tok["merges"], 2);

    let tokens = json["other_metadata"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["key"] == "tokenizer.ggml.tokens")
        .expect("tokens entry");
    assert_eq!(tokens["value"]["len"], N_TOKENS);
    assert_eq!(tokens["value"]["head"][0], "tok0");
    assert_eq!(tokens["value"]["head"].as_array().unwrap().len(), 8);

    let tensors = json["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 5);
    assert_eq!(tensors[0]["name"], "token_embd.weight");
    assert_eq!(tensors[0]["type"], "Q8_0");
    assert_eq!(tensors[0]["shape"], serde_json::json!([64, N_TOKENS]));
    assert_eq!(tensors[0]["bytes"], 68 * N_TOKENS);
    for t in tensors {
        assert_eq!(t["offset"].as_u64().unwrap() % 64, 0, "{t}");
    }
    let total_bytes: u64 = tensors.iter().map(|t| t["bytes"].as_u64().unwrap()).sum();
    assert_eq!(json["total"]["bytes"], total_bytes);
    assert_eq!(json["total"]["params"], 64 * N_TOKENS + 64 + 4096 * 2 + 512);
    let types: Vec<&str> =
        json["totals_by_type"].as_array().unwrap().iter().map(|t| t["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["F32", "F16", "Q8_0", "Q4_K"]);
}

#[test]
fn broken_files_fail_with_a_message() {
    let missing = temp_path("missing.gguf");
    let out = memra(&["inspect", missing.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("memra: error:") && err.contains("missing.gguf"), "{err}");

    let truncated = temp_path("truncated.gguf");
    write_fixture(&truncated);
    let full = std::fs::read(&truncated).unwrap();
    std::fs::write(&truncated, &full[..full.len() / 2]).unwrap();
    let out = memra(&["inspect", truncated.to_str().unwrap()]);
    std::fs::write(&truncated, b"not a gguf file at all").unwrap();
    let out_garbage = memra(&["inspect", "--json", truncated.to_str().unwrap()]);
    std::fs::remove_file(&truncated).unwrap();

    let err = stderr(&out);
    assert!(!out.status.success() && out.stdout.is_empty());
    assert!(err.contains("truncated.gguf") && err.contains("extends past end of file"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let err = stderr(&out_garbage);
    assert!(!out_garbage.status.success() && err.contains("not a GGUF file"), "{err}");

    let out = memra(&["inspect"]);
    assert!(!out.status.success() && stderr(&out).contains("<FILE>"));
}

/// `MEMRA_GEMMA3_GGUF`, or the path `scripts/fetch-gemma3-270m` downloads to.
fn gemma3_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MEMRA_GEMMA3_GGUF") {
        return Some(PathBuf::from(p));
    }
    let cache = std::env::var_os("MEMRA_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/memra")))?;
    Some(cache.join("models/gemma-3-270m-q4_k_m.gguf")).filter(|p| p.exists())
}

#[test]
fn real_gemma3_270m() {
    let Some(path) = gemma3_path() else {
        eprintln!(
            "SKIP real_gemma3_270m: no model (set MEMRA_GEMMA3_GGUF or run scripts/fetch-gemma3-270m)"
        );
        return;
    };
    let out = memra(&["inspect", "--json", path.to_str().unwrap()]);
    assert!(out.status.success(), "stderr: {}", stderr(&out));
    let json: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(json["architecture"], "gemma3");
    assert_eq!(json["file_type"]["name"], "Q4_K_M");
    assert_eq!(json["tokenizer"]["vocab_size"], 262144);
    assert_eq!(json["tokenizer"]["model"], "llama");
    let ids = ["bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id"]
        .map(|k| json["tokenizer"][k].as_u64());
    assert_eq!(ids, [Some(2), Some(1), Some(0), Some(3)]);
    assert_eq!(json["tokenizer"]["add_bos_token"], true);

    let hparam = |suffix: &str| {
        let key = format!("gemma3.{suffix}");
        json["hparams"].as_array().unwrap().iter().find(|e| e["key"] == key).map(|e| e["value"].clone())
    };
    for (suffix, value) in [
        ("block_count", 18.0),
        ("embedding_length", 640.0),
        ("feed_forward_length", 2048.0),
        ("context_length", 32768.0),
        ("attention.head_count", 4.0),
        ("attention.head_count_kv", 1.0),
        ("attention.key_length", 256.0),
        ("attention.value_length", 256.0),
        ("attention.sliding_window", 512.0),
        ("attention.layer_norm_rms_epsilon", 1e-6),
        ("rope.freq_base", 1e6),
    ] {
        assert_eq!(hparam(suffix).and_then(|v| v.as_f64()), Some(value), "gemma3.{suffix}");
    }

    let tensors = json["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 236);
    let embd = tensors.iter().find(|t| t["name"] == "token_embd.weight").unwrap();
    assert_eq!(embd["type"], "Q8_0");
    assert_eq!(embd["shape"], serde_json::json!([640, 262144]));
    assert!(tensors.iter().all(|t| t["name"] != "output.weight"), "gemma3 ties the LM head");
    assert_eq!(json["total"]["tensors"], 236);

    // The text report lists all 236 tensors.
    let out = memra(&["inspect", path.to_str().unwrap()]);
    assert!(out.status.success(), "stderr: {}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("tensors (236):") && text.contains("architecture: gemma3"));
    let rows = text.lines().filter(|l| l.trim_start().starts_with("blk.")).count();
    assert_eq!(rows, 236 - 2, "every blk.* tensor has a row");
}
