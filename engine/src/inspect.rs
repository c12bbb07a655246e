//! `memra inspect FILE [--json]`: what a GGUF file holds (header, hparams, tokenizer,
//! tensors, totals) and which memra spec matches its architecture.
//!
//! One [`Report`] feeds both outputs, so the text and the JSON always agree. Long arrays
//! (the vocabulary) are summarized, never dumped.

use std::collections::BTreeMap;
use std::error::Error;
use std::fmt::Write as _;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

use memra_gguf::{GgmlType, Gguf, GgufFile, MetaArray, MetaValue};
use serde::Serialize;
use serde_json::{Value, json};

/// Arguments of `memra inspect`.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// The GGUF model file to describe.
    pub file: PathBuf,
    /// Print one JSON object (same content as the text report) instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Runs `memra inspect`: opens the file, prints the report to stdout.
pub fn run(args: &InspectArgs) -> Result<(), Box<dyn Error>> {
    let file = GgufFile::open(&args.file)?;
    let report = Report::new(&file, &args.file.display().to_string());
    let text = if args.json { report.to_json() } else { report.render_text() };
    write_stdout(&text)?;
    Ok(())
}

/// Writes to stdout; a closed pipe (`memra inspect f | head`) is not an error.
fn write_stdout(text: &str) -> io::Result<()> {
    let mut out = io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

/// Everything `memra inspect` shows.
#[derive(Debug, Serialize)]
pub struct Report {
    pub file: String,
    pub file_bytes: u64,
    pub version: u32,
    pub alignment: u32,
    pub data_offset: u64,
    pub architecture: Option<String>,
    pub name: Option<String>,
    pub file_type: Option<FileType>,
    pub spec: SpecMatch,
    /// Every `{arch}.*` key, in file order.
    pub hparams: Vec<Entry>,
    pub tokenizer: Option<TokenizerSummary>,
    /// Every other key (general.*, tokenizer.*, ...), in file order; arrays summarized.
    pub other_metadata: Vec<Entry>,
    pub tensors: Vec<TensorRow>,
    pub totals_by_type: Vec<TypeTotal>,
    pub total: Total,
}

#[derive(Debug, Serialize)]
pub struct FileType {
    pub id: u64,
    /// llama.cpp's name for the `llama_ftype` (15 = `Q4_K_M`), if known.
    pub name: Option<&'static str>,
}

/// One metadata pair. `value` is JSON with long arrays summarized; `text` is the one-line
/// human form.
#[derive(Debug, Serialize)]
pub struct Entry {
    pub key: String,
    #[serde(rename = "type")]
    pub value_type: String,
    pub value: Value,
    #[serde(skip)]
    pub text: String,
}

#[derive(Debug, Default, Serialize)]
pub struct TokenizerSummary {
    pub model: Option<String>,
    pub pre: Option<String>,
    /// Length of `tokenizer.ggml.tokens`.
    pub vocab_size: Option<usize>,
    pub bos_token_id: Option<u64>,
    pub eos_token_id: Option<u64>,
    pub padding_token_id: Option<u64>,
    pub unknown_token_id: Option<u64>,
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    /// Length of `tokenizer.ggml.merges` (BPE vocabularies only).
    pub merges: Option<usize>,
}

#[derive(Debug, Serialize)]
pub struct TensorRow {
    pub name: String,
    #[serde(rename = "type")]
    pub ggml_type: String,
    /// ggml `ne`, row length first.
    pub shape: Vec<u64>,
    pub bytes: u64,
    /// Offset in the data section.
    pub offset: u64,
}

#[derive(Debug, Serialize)]
pub struct TypeTotal {
    #[serde(rename = "type")]
    pub ggml_type: String,
    pub tensors: usize,
    pub bytes: u64,
    pub params: u64,
}

#[derive(Debug, Serialize)]
pub struct Total {
    pub tensors: usize,
    pub bytes: u64,
    pub params: u64,
}

/// Which memra spec describes the file's architecture.
#[derive(Debug, Serialize)]
pub struct SpecMatch {
    /// The spec file, when one exists.
    pub path: Option<String>,
    /// The one-line verdict printed after `spec:`.
    pub message: String,
}

/// Looks for `specs/<arch>.toml` in the workspace this binary was built from. Kept small on
/// purpose: the spec loader will replace it with a real match (dims, quant types).
pub fn find_spec(architecture: Option<&str>) -> SpecMatch {
    let Some(arch) = architecture else {
        return SpecMatch { path: None, message: "no general.architecture in the file".into() };
    };
    let engine_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let specs_dir = engine_dir.parent().unwrap_or(engine_dir).join("specs");
    let candidate = specs_dir.join(format!("{arch}.toml"));
    if candidate.is_file() {
        let shown = candidate.display().to_string();
        SpecMatch { message: format!("{shown} (architecture {arch})"), path: Some(shown) }
    } else {
        SpecMatch {
            path: None,
            message: format!(
                "no memra spec for architecture {arch} (looked for {})",
                candidate.display()
            ),
        }
    }
}

/// llama.cpp `llama_ftype` names (llama.h), for `general.file_type`.
fn file_type_name(id: u64) -> Option<&'static str> {
    Some(match id {
        0 => "ALL_F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        19 => "IQ2_XXS",
        20 => "IQ2_XS",
        21 => "Q2_K_S",
        22 => "IQ3_XS",
        23 => "IQ3_XXS",
        24 => "IQ1_S",
        25 => "IQ4_NL",
        26 => "IQ3_S",
        27 => "IQ3_M",
        28 => "IQ2_S",
        29 => "IQ2_M",
        30 => "IQ4_XS",
        31 => "IQ1_M",
        32 => "BF16",
        36 => "TQ1_0",
        37 => "TQ2_0",
        38 => "MXFP4_MOE",
        _ => return None,
    })
}

/// Arrays up to this length appear whole in JSON; longer ones as a summary with a head.
const JSON_ARRAY_MAX: usize = 16;
const JSON_ARRAY_HEAD: usize = 8;
/// Strings longer than this are cut in the text report (JSON keeps them whole).
const TEXT_STRING_MAX: usize = 100;

fn json_scalar(v: &MetaValue) -> Value {
    match v {
        MetaValue::Str(s) => Value::from(s.as_str()),
        MetaValue::Bool(b) => Value::from(*b),
        // Through the shortest decimal form, so 1e-6f32 prints as 1e-6, not 9.99999997e-7.
        MetaValue::F32(f) => f.to_string().parse::<f64>().map_or(Value::Null, Value::from),
        MetaValue::F64(f) => Value::from(*f),
        MetaValue::Array(a) => json_array(a),
        other => match other.as_integer() {
            Some(i) => {
                u64::try_from(i).map(Value::from).or_else(|_| i64::try_from(i).map(Value::from))
            }
            .unwrap_or(Value::Null),
            None => Value::Null,
        },
    }
}

fn json_array(a: &MetaArray) -> Value {
    let elements = |n: usize| -> Vec<Value> {
        (0..n.min(a.len())).filter_map(|i| a.get(i)).map(|v| json_scalar(&v)).collect()
    };
    if a.len() <= JSON_ARRAY_MAX {
        Value::Array(elements(a.len()))
    } else {
        json!({
            "element_type": a.element_type().name(),
            "len": a.len(),
            "head": elements(JSON_ARRAY_HEAD),
        })
    }
}

/// One line for humans: long or multi-line strings are escaped and cut.
fn text_value(v: &MetaValue) -> String {
    match v {
        MetaValue::Str(s) if s.len() > TEXT_STRING_MAX || s.chars().any(char::is_control) => {
            let cut: String = s.chars().take(TEXT_STRING_MAX).collect();
            let more = if cut.len() < s.len() { "…" } else { "" };
            format!("{cut:?}{more} ({} bytes)", s.len())
        }
        other => other.to_string(),
    }
}

fn entry(key: &str, value: &MetaValue) -> Entry {
    Entry {
        key: key.to_string(),
        value_type: value.type_description(),
        value: json_scalar(value),
        text: text_value(value),
    }
}

fn tokenizer_summary<B: AsRef<[u8]>>(f: &Gguf<B>) -> Option<TokenizerSummary> {
    if !f.metadata().iter().any(|(k, _)| k.starts_with("tokenizer.")) {
        return None;
    }
    let array_len = |key| f.get_array(key).ok().map(|a| a.len());
    let id = |key| f.get_u64(key).ok();
    Some(TokenizerSummary {
        model: f.get_str("tokenizer.ggml.model").ok().map(str::to_string),
        pre: f.get_str("tokenizer.ggml.pre").ok().map(str::to_string),
        vocab_size: array_len("tokenizer.ggml.tokens"),
        bos_token_id: id("tokenizer.ggml.bos_token_id"),
        eos_token_id: id("tokenizer.ggml.eos_token_id"),
        padding_token_id: id("tokenizer.ggml.padding_token_id"),
        unknown_token_id: id("tokenizer.ggml.unknown_token_id"),
        add_bos_token: f.get_bool("tokenizer.ggml.add_bos_token").ok(),
        add_eos_token: f.get_bool("tokenizer.ggml.add_eos_token").ok(),
        merges: array_len("tokenizer.ggml.merges"),
    })
}

impl Report {
    /// Builds the report for a parsed file; `file` is the name to show.
    pub fn new<B: AsRef<[u8]>>(f: &Gguf<B>, file: &str) -> Report {
        let architecture = f.architecture().ok().map(str::to_string);
        let arch_prefix = architecture.as_ref().map(|a| format!("{a}."));
        let (hparams, other_metadata) = f
            .metadata()
            .iter()
            .map(|(k, v)| entry(k, &v.into_owned()))
            .partition(|e| arch_prefix.as_ref().is_some_and(|p| e.key.starts_with(p)));

        let tensors: Vec<TensorRow> = f
            .tensors()
            .iter()
            .map(|t| TensorRow {
                name: t.name.to_string(),
                ggml_type: t.ggml_type.name().to_string(),
                shape: t.dims.to_vec(),
                bytes: t.n_bytes,
                offset: t.offset,
            })
            .collect();
        let mut by_type: BTreeMap<GgmlType, TypeTotal> = BTreeMap::new();
        for t in f.tensors() {
            let total = by_type.entry(t.ggml_type).or_insert_with(|| TypeTotal {
                ggml_type: t.ggml_type.name().to_string(),
                tensors: 0,
                bytes: 0,
                params: 0,
            });
            total.tensors += 1;
            total.bytes += t.n_bytes;
            total.params += t.n_elements();
        }
        let totals_by_type: Vec<TypeTotal> = by_type.into_values().collect();
        let total = Total {
            tensors: tensors.len(),
            bytes: totals_by_type.iter().map(|t| t.bytes).sum(),
            params: totals_by_type.iter().map(|t| t.params).sum(),
        };

        Report {
            file: file.to_string(),
            file_bytes: f.bytes().len() as u64,
            version: f.version(),
            alignment: f.alignment(),
            data_offset: f.data_offset(),
            spec: find_spec(architecture.as_deref()),
            name: f.get_str("general.name").ok().map(str::to_string),
            file_type: f
                .get_u64("general.file_type")
                .ok()
                .map(|id| FileType { id, name: file_type_name(id) }),
            architecture,
            hparams,
            tokenizer: tokenizer_summary(f),
            other_metadata,
            tensors,
            totals_by_type,
            total,
        }
    }

    /// The report as one pretty-printed JSON object (with a trailing newline).
    pub fn to_json(&self) -> String {
        let mut s = serde_json::to_string_pretty(self).unwrap_or_else(|e| {
            // Serializing plain structs of strings and numbers cannot fail; say so if it does.
            json!({ "error": e.to_string() }).to_string()
        });
        s.push('\n');
        s
    }

    /// The human-readable report.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = self.write_text(&mut out);
        out
    }

    fn write_text(&self, out: &mut String) -> std::fmt::Result {
        let or_none = |v: &Option<String>| v.clone().unwrap_or_else(|| "(none)".into());
        let file_type = match &self.file_type {
            Some(FileType { id, name: Some(name) }) => format!("{name} ({id})"),
            Some(FileType { id, name: None }) => format!("unknown ({id})"),
            None => "(none)".into(),
        };
        writeln!(out, "file:         {} ({} bytes)", self.file, self.file_bytes)?;
        writeln!(out, "architecture: {}", or_none(&self.architecture))?;
        writeln!(out, "name:         {}", or_none(&self.name))?;
        writeln!(out, "file type:    {file_type}")?;
        writeln!(out, "version:      {}", self.version)?;
        writeln!(out, "alignment:    {}", self.alignment)?;
        writeln!(out, "data offset:  0x{:x}", self.data_offset)?;
        writeln!(out, "spec: {}", self.spec.message)?;

        let arch = self.architecture.as_deref().unwrap_or("?");
        writeln!(out, "\nhparams ({arch}.*, {} keys):", self.hparams.len())?;
        write_entries(out, &self.hparams)?;

        if let Some(t) = &self.tokenizer {
            let show = |v: Option<String>| v.unwrap_or_else(|| "-".into());
            let id = |v: Option<u64>| show(v.map(|v| v.to_string()));
            writeln!(out, "\ntokenizer:")?;
            writeln!(out, "  model:           {}", show(t.model.clone()))?;
            writeln!(out, "  pre:             {}", show(t.pre.clone()))?;
            writeln!(out, "  vocab size:      {}", show(t.vocab_size.map(|v| v.to_string())))?;
            writeln!(
                out,
                "  bos/eos/pad/unk: {} / {} / {} / {}",
                id(t.bos_token_id),
                id(t.eos_token_id),
                id(t.padding_token_id),
                id(t.unknown_token_id)
            )?;
            writeln!(out, "  add_bos:         {}", show(t.add_bos_token.map(|v| v.to_string())))?;
            writeln!(out, "  add_eos:         {}", show(t.add_eos_token.map(|v| v.to_string())))?;
            writeln!(out, "  merges:          {}", show(t.merges.map(|v| v.to_string())))?;
        }

        writeln!(out, "\nother metadata ({} keys):", self.other_metadata.len())?;
        write_entries(out, &self.other_metadata)?;

        writeln!(out, "\ntensors ({}):", self.tensors.len())?;
        let shapes: Vec<String> = self.tensors.iter().map(|t| format!("{:?}", t.shape)).collect();
        let name_w = self.tensors.iter().map(|t| t.name.len()).max().unwrap_or(0).max(4);
        let shape_w = shapes.iter().map(String::len).max().unwrap_or(0).max(5);
        writeln!(out, "  {:<name_w$}  {:<7}  {:<shape_w$}  {:>12}", "NAME", "TYPE", "SHAPE", "BYTES")?;
        for (t, shape) in self.tensors.iter().zip(&shapes) {
            writeln!(
                out,
                "  {:<name_w$}  {:<7}  {:<shape_w$}  {:>12}",
                t.name, t.ggml_type, shape, t.bytes
            )?;
        }

        writeln!(out, "\ntotals by type:")?;
        writeln!(out, "  {:<7}  {:>7}  {:>12}  {:>12}", "TYPE", "TENSORS", "BYTES", "PARAMS")?;
        for t in &self.totals_by_type {
            writeln!(
                out,
                "  {:<7}  {:>7}  {:>12}  {:>12}",
                t.ggml_type, t.tensors, t.bytes, t.params
            )?;
        }
        writeln!(
            out,
            "total: {} tensors, {} bytes ({:.1} MiB), {} params",
            self.total.tensors,
            self.total.bytes,
            self.total.bytes as f64 / (1024.0 * 1024.0),
            self.total.params
        )
    }
}

fn write_entries(out: &mut String, entries: &[Entry]) -> std::fmt::Result {
    let key_w = entries.iter().map(|e| e.key.len()).max().unwrap_or(0);
    for e in entries {
        writeln!(out, "  {:<key_w$}  {}", e.key, e.text)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use memra_gguf::GgufWriter;

    #[test]
    fn json_values_keep_short_arrays_and_summarize_long_ones() {
        assert_eq!(json_scalar(&MetaValue::F32(1e-6)), json!(1e-6));
        assert_eq!(json_scalar(&MetaValue::I8(-3)), json!(-3));
        assert_eq!(json_scalar(&MetaValue::U64(u64::MAX)), json!(u64::MAX));
        assert_eq!(json_scalar(&vec![1u32, 2].into()), json!([1, 2]));
        let long: MetaValue = (0..1000).map(|i| i.to_string()).collect::<Vec<_>>().into();
        let summary = json_scalar(&long);
        assert_eq!(summary["len"], json!(1000));
        assert_eq!(summary["element_type"], json!("STRING"));
        assert_eq!(summary["head"].as_array().map(Vec::len), Some(JSON_ARRAY_HEAD));
    }

    #[test]
    fn text_values_cut_long_and_multiline_strings() {
        assert_eq!(text_value(&"plain".into()), "plain");
        assert_eq!(text_value(&"a\nb".into()), "\"a\\nb\" (3 bytes)");
        let long = "x".repeat(500);
        let shown = text_value(&long.as_str().into());
        assert!(shown.ends_with("\"… (500 bytes)") && shown.len() < 120, "{shown}");
    }

    #[test]
    fn hparams_are_the_arch_keys() {
        let mut w = GgufWriter::new();
        w.add_meta("general.architecture", "tiny")
            .add_meta("tiny.block_count", 2u32)
            .add_meta("tinyx.other", 1u32)
            .add_meta("general.file_type", 15u32);
        let bytes = w.to_bytes().unwrap();
        let report = Report::new(&Gguf::parse(&bytes[..]).unwrap(), "mem");
        let keys = |v: &[Entry]| v.iter().map(|e| e.key.clone()).collect::<Vec<_>>();
        assert_eq!(keys(&report.hparams), ["tiny.block_count"]);
        assert_eq!(
            keys(&report.other_metadata),
            ["general.architecture", "tinyx.other", "general.file_type"]
        );
        assert_eq!(report.file_type.as_ref().and_then(|t| t.name), Some("Q4_K_M"));
        assert!(report.tokenizer.is_none());
        assert!(report.spec.message.contains("no memra spec for architecture tiny"));
    }
}
