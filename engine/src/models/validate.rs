//! Refuses a model file before anything touches the GPU: an architecture without a spec in
//! this build, hparams that are missing or contradict the tensor shapes, missing tensors,
//! tensor data outside the file, and quant types no kernel of this build can read. Every
//! message names the file and the key or tensor at fault; all problems are reported at once.
//!
//! Data-driven: the architectures are the `arch!` modules of [`super::spec`] (one table line
//! each), and the readable quant types are the `qtype`s of the registry's weight-reading
//! families, so a new spec or kernel variant needs no change here.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use memra_gguf::{GgmlType, Gguf, GgufError, GgufFile};

use super::spec;
use crate::kernels::registry;

/// The kernel families that read weight tensors in their stored type; the union of their
/// variants' `qtype`s is what a model's tensors may use.
pub const WEIGHT_FAMILIES: &[&str] = &["matvec", "matmul", "embed"];

/// What a validated file holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelInfo {
    /// `general.architecture`, as spelled by the spec (`"gemma3"`).
    pub arch: &'static str,
    pub n_layer: usize,
    pub n_tensors: usize,
    /// Bytes of tensor data (what the weights will take on the device).
    pub tensor_bytes: u64,
    /// Tensor count per type, in type order.
    pub types: Vec<(GgmlType, usize)>,
}

/// Why a model file is refused.
#[derive(Debug)]
pub enum ValidateError {
    /// The file cannot be opened, or its GGUF header is malformed (this includes tensor data
    /// past the end of a truncated file; the message names the tensor).
    Read(GgufError),
    /// `general.architecture` is missing, not a string, or names an architecture without a
    /// spec in this build.
    Architecture { path: PathBuf, message: String },
    /// Everything else, all at once: hparam keys, tensors (missing, mis-shaped, out of the
    /// file, unsupported type).
    Model {
        path: PathBuf,
        arch: &'static str,
        problems: Vec<String>,
    },
}

impl fmt::Display for ValidateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValidateError::Read(e) => write!(f, "{e}"),
            ValidateError::Architecture { path, message } => {
                write!(f, "{}: {message}", path.display())
            }
            ValidateError::Model {
                path,
                arch,
                problems,
            } => {
                write!(
                    f,
                    "{}: refusing this {arch} model ({} problem(s)):",
                    path.display(),
                    problems.len()
                )?;
                for p in problems {
                    write!(f, "\n  {p}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for ValidateError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ValidateError::Read(e) => Some(e),
            _ => None,
        }
    }
}

/// One architecture with a spec in this build: its `general.architecture` name and a loader
/// that reads the hparams and maps every tensor the spec lists (shapes checked), giving the
/// layer count or every problem found.
struct Architecture<B> {
    name: &'static str,
    load: fn(&Gguf<B>) -> Result<usize, Vec<String>>,
    /// hparam name -> GGUF metadata key, to name the keys behind a contradicted shape.
    keys: &'static [(&'static str, &'static str)],
}

/// One line per `arch!` module of `models/spec.rs`: module, marker type, hparams, weights.
macro_rules! architectures {
    ($($module:ident: $marker:ident, $hparams:ident, $weights:ident;)*) => {
        fn architectures<B: AsRef<[u8]>>() -> Vec<Architecture<B>> {
            vec![$(Architecture {
                name: spec::$module::$marker::ARCH,
                load: |file| {
                    let hp = spec::$module::$hparams::from_gguf(file).map_err(|e| e.problems)?;
                    check_layer_count(file, hp.n_layer)?;
                    spec::$module::$weights::from_gguf(file, &hp).map_err(|e| e.problems)?;
                    Ok(hp.n_layer as usize)
                },
                keys: spec::$module::$hparams::GGUF_KEYS,
            }),*]
        }
    };
}

architectures! {
    deepseek2: Deepseek2, Deepseek2Hparams, Deepseek2Weights;
    gemma3: Gemma3, Gemma3Hparams, Gemma3Weights;
    glm_dsa: GlmDsa, GlmDsaHparams, GlmDsaWeights;
    olmoe: Olmoe, OlmoeHparams, OlmoeWeights;
    qwen3: Qwen3, Qwen3Hparams, Qwen3Weights;
}

/// The architectures this build has a spec for, sorted.
pub fn known_architectures() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = architectures::<&[u8]>().iter().map(|a| a.name).collect();
    names.sort_unstable();
    names
}

/// Every tensor type some weight-reading kernel variant of this build reads
/// (see [`WEIGHT_FAMILIES`]), in type order.
pub fn supported_types() -> Vec<GgmlType> {
    let mut types: Vec<GgmlType> = registry::variants()
        .iter()
        .filter(|v| WEIGHT_FAMILIES.contains(&v.family))
        .filter_map(|v| match v.param("qtype") {
            Some(registry::Param::Sym(q)) => GgmlType::from_name(q),
            _ => None,
        })
        .collect();
    types.sort_unstable();
    types.dedup();
    types
}

/// Opens `path` and validates it; the header is parsed once and the file is returned for loading.
pub fn validate_path(path: &Path) -> Result<(GgufFile, ModelInfo), ValidateError> {
    let file = GgufFile::open(path).map_err(ValidateError::Read)?;
    let info = validate(&file, path)?;
    Ok((file, info))
}

/// Checks a parsed model file against its architecture's spec and this build's kernels;
/// `path` is only used in messages. Reads the header and tensor infos only; no tensor data,
/// no GPU.
pub fn validate<B: AsRef<[u8]>>(file: &Gguf<B>, path: &Path) -> Result<ModelInfo, ValidateError> {
    let refuse_arch = |message: String| ValidateError::Architecture {
        path: path.to_path_buf(),
        message,
    };
    let found = file
        .architecture()
        .map_err(|e| refuse_arch(e.to_string()))?;
    let archs = architectures::<B>();
    let Some(arch) = archs.iter().find(|a| a.name == found) else {
        return Err(refuse_arch(format!(
            "general.architecture is '{found}', which has no spec in this build (known: {})",
            known_architectures().join(", ")
        )));
    };

    let mut problems = Vec::new();
    let n_layer = (arch.load)(file).unwrap_or_else(|p| {
        problems.extend(p);
        0
    });
    if let Some(hint) = shape_keys_hint(file, &problems, arch.keys) {
        problems.push(hint);
    }

    let supported = supported_types();
    let (file_len, data_offset) = (file.bytes().len() as u64, file.data_offset());
    let mut types: BTreeMap<GgmlType, usize> = BTreeMap::new();
    let mut tensor_bytes = 0u64;
    for t in file.tensors() {
        *types.entry(t.ggml_type).or_default() += 1;
        tensor_bytes = tensor_bytes.saturating_add(t.n_bytes);
        // The reader checks this at parse time; repeated here because loading copies these
        // bytes to the device and a short copy must never happen.
        let end = data_offset
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(t.n_bytes));
        if end.is_none_or(|end| end > file_len) {
            problems.push(format!(
                "tensor '{}': data (offset 0x{:x} + {} bytes in the data section at 0x{data_offset:x}) \
                 lies past the end of the file ({file_len} bytes): truncated?",
                t.name, t.offset, t.n_bytes
            ));
        }
        if !supported.contains(&t.ggml_type) {
            problems.push(format!(
                "tensor '{}' has type {}, which no {} kernel in this build reads (supported: {})",
                t.name,
                t.ggml_type,
                WEIGHT_FAMILIES.join("/"),
                supported
                    .iter()
                    .map(|t| t.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
    }
    if !problems.is_empty() {
        return Err(ValidateError::Model {
            path: path.to_path_buf(),
            arch: arch.name,
            problems,
        });
    }
    Ok(ModelInfo {
        arch: arch.name,
        n_layer,
        n_tensors: file.tensors().len(),
        tensor_bytes,
        types: types.into_iter().collect(),
    })
}

/// Every layer has at least one tensor, so a layer count above the tensor count is a
/// corrupt or hostile `block_count`; refusing it here keeps the weights loader from
/// allocating per-layer tables (and one message per missing tensor) for billions of layers.
fn check_layer_count<B: AsRef<[u8]>>(file: &Gguf<B>, n_layer: u32) -> Result<(), Vec<String>> {
    let n_tensors = file.tensors().len();
    if n_layer as usize > n_tensors {
        let key = file
            .arch_key("block_count")
            .unwrap_or_else(|_| "block_count".into());
        return Err(vec![format!(
            "hparam n_layer = {n_layer} (from '{key}') exceeds the file's {n_tensors} tensors"
        )]);
    }
    Ok(())
}

/// For shape problems (`... expected [512, 256] = [n_embd, n_vocab]`): one line giving the
/// value and metadata key of every key-sourced hparam those shapes use, since a contradiction
/// between a key and the tensors is as likely the key's fault as the tensors'.
fn shape_keys_hint<B: AsRef<[u8]>>(
    file: &Gguf<B>,
    problems: &[String],
    keys: &[(&str, &str)],
) -> Option<String> {
    let mut used: Vec<&str> = Vec::new();
    for p in problems.iter().filter(|p| p.contains("has shape")) {
        let Some((_, exprs)) = p.rsplit_once(" = [") else {
            continue;
        };
        for word in exprs.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if keys.iter().any(|(name, _)| *name == word) && !used.contains(&word) {
                used.push(word);
            }
        }
    }
    let parts: Vec<String> = keys
        .iter()
        .filter(|(name, _)| used.contains(name))
        .map(|(name, key)| match file.get(key) {
            Some(value) => format!("{name} = {value} from '{key}'"),
            None => format!("{name} from its default ('{key}' is absent)"),
        })
        .collect();
    (!parts.is_empty()).then(|| format!("the expected shapes use {}", parts.join(", ")))
}
