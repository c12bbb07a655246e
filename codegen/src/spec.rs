//! The architecture spec (`specs/<arch>.toml`): data model, parsing and validation.
//! The schema is described field by field in `specs/README.md`; this file is its checker.
//! Every error names the file, line, column and key.

use std::path::Path;

use memra_gguf::GgmlType;
use toml::Spanned;
use toml::de::DeValue;

use crate::expr::Expr;
use crate::shard::Cut;
use crate::source::{Loc, SourceFile, SpecErrors, Table, as_float, as_int, describe};

/// Names that mean something in kernel-parameter expressions of per-tensor kernels.
pub const TENSOR_SCOPE_NAMES: &[&str] = &["ne0", "ne1", "ne2", "ne3"];
/// The pseudo tensor of a kernel entry that means "`output.weight`, or `token_embd.weight`
/// when the model ties its LM head to the embedding".
pub const LM_HEAD: &str = "lm_head";
/// Placeholder for the layer index in per-layer tensor names (llama.cpp writes `blk.%d.`).
pub const LAYER_PREFIX: &str = "blk.{i}.";

/// One parsed, validated `specs/<arch>.toml`.
#[derive(Clone, Debug)]
pub struct ArchSpec {
    /// GGUF `general.architecture`, e.g. `glm-dsa`.
    pub arch: String,
    /// Name of the preset used when no GGUF is given.
    pub default_preset: String,
    pub sources: Vec<String>,
    pub hparams: Vec<HParam>,
    pub derived: Vec<Derived>,
    pub caps: Capabilities,
    pub tensors: Vec<TensorSpec>,
    pub presets: Vec<Preset>,
    pub kernels: Vec<KernelSpec>,
    /// `[parallel]`: how the model splits over GPUs (`crate::shard`); `None` without the
    /// table (a model never split).
    pub parallel: Option<Parallel>,
    pub loc: Loc,
}

/// The `[parallel]` table; the split tensors are the `[tensors]` entries with a `split`.
#[derive(Clone, Debug)]
pub struct Parallel {
    /// The GPU counts (> 1) whose per-rank shapes get specialized variants too.
    pub shards: Vec<usize>,
    /// The hparams and derived values a rank holds 1/N of (heads, FFN widths).
    pub per_rank: Vec<(String, Loc)>,
    pub loc: Loc,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum HParamType {
    U32,
    F32,
    Bool,
}

impl HParamType {
    pub fn name(self) -> &'static str {
        match self {
            HParamType::U32 => "u32",
            HParamType::F32 => "f32",
            HParamType::Bool => "bool",
        }
    }
}

/// A concrete hparam value.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Value {
    Int(i64),
    Float(f64),
    Bool(bool),
}

impl std::fmt::Display for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::Int(v) => write!(f, "{v}"),
            Value::Float(v) => write!(f, "{v:?}"),
            Value::Bool(v) => write!(f, "{v}"),
        }
    }
}

/// Where an hparam's value comes from in a GGUF file.
#[derive(Clone, Debug, PartialEq)]
pub enum HParamSource {
    /// `<arch>.<suffix>`, e.g. `attention.head_count`.
    Key(String),
    /// A dimension of a tensor, e.g. n_vocab = ne[1] of `token_embd.weight`.
    TensorDim { tensor: String, dim: usize },
}

/// The value used when the GGUF lacks the key.
#[derive(Clone, Debug, PartialEq)]
pub enum HParamDefault {
    Value(Value),
    /// A u32 default computed from hparams declared before this one (llama.cpp's
    /// `n_rot = n_embd_head_k` style fallbacks).
    Expr(Expr),
}

#[derive(Clone, Debug)]
pub struct HParam {
    pub name: String,
    pub from: HParamSource,
    pub ty: HParamType,
    pub default: Option<HParamDefault>,
    pub source: String,
    pub loc: Loc,
}

impl HParam {
    /// The full GGUF key for a `Key` source (`glm-dsa.attention.head_count`).
    pub fn gguf_key(&self, arch: &str) -> Option<String> {
        match &self.from {
            HParamSource::Key(suffix) => Some(format!("{arch}.{suffix}")),
            HParamSource::TensorDim { .. } => None,
        }
    }
}

/// An integer computed from other hparams (`n_layer = block_count - nextn_predict_layers`).
#[derive(Clone, Debug)]
pub struct Derived {
    pub name: String,
    pub expr: Expr,
    pub source: String,
    pub loc: Loc,
}

macro_rules! token_enum {
    ($(#[$m:meta])* $name:ident { $($variant:ident = $tok:literal),* $(,)? }) => {
        $(#[$m])*
        #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
        pub enum $name { $($variant),* }
        impl $name {
            pub const TOKENS: &'static [&'static str] = &[$($tok),*];
            pub fn token(self) -> &'static str { match self { $($name::$variant => $tok),* } }
            pub fn from_token(s: &str) -> Option<Self> { match s { $($tok => Some($name::$variant),)* _ => None } }
        }
    };
}

token_enum!(
    /// How attention is computed (model-specs.md §3 GQA, §6 MLA, §8 DSA).
    Attention { Gqa = "gqa", Mla = "mla", MlaDsa = "mla_dsa" }
);
token_enum!(
    /// RMSNorm on q/k before RoPE: over each head, over the whole projection, or none.
    QkNorm { PerHead = "per_head", Full = "full", None = "none" }
);
token_enum!(
    /// RoPE pairing: NEOX (x[i], x[i + n/2]) or interleaved/NORM (x[2i], x[2i+1]).
    Rope { Neox = "neox", Interleaved = "interleaved" }
);
token_enum!(
    /// Feed-forward kind of the (non-dense) layers.
    Ffn { Swiglu = "swiglu", Geglu = "geglu", Moe = "moe" }
);
token_enum!(
    /// Pre-norm only, or pre + post norms around attention and FFN (Gemma).
    NormPlacement { Pre = "pre", Sandwich = "sandwich" }
);
token_enum!(
    /// MoE router scoring: softmax, or sigmoid with a selection-only bias (DeepSeek V3 / GLM).
    Router { None = "none", Softmax = "softmax", SigmoidBias = "sigmoid_bias" }
);
token_enum!(
    /// Whether the LM head is `token_embd` (always), `output` (never), or `output` when present.
    TiedEmbeddings { Never = "never", Always = "always", Optional = "optional" }
);
token_enum!(
    /// Scale applied to token embeddings before the first layer.
    EmbeddingScale { None = "none", SqrtNEmbd = "sqrt_n_embd" }
);

/// Gemma-style interleaved local/global attention: layer `il` is local (windowed) when
/// `il % pattern < pattern - 1`.
#[derive(Clone, Debug)]
pub struct SlidingWindow {
    pub pattern: i64,
    /// The hparam holding the window length.
    pub window: String,
}

#[derive(Clone, Debug)]
pub struct Capabilities {
    pub attention: Attention,
    pub qk_norm: QkNorm,
    pub rope: Rope,
    pub ffn: Ffn,
    pub shared_expert: bool,
    pub norm: NormPlacement,
    pub router: Router,
    pub sliding_window: Option<SlidingWindow>,
    pub tied_embeddings: TiedEmbeddings,
    pub embedding_scale: EmbeddingScale,
    /// For `ffn = "moe"`: the layers that use a dense SwiGLU instead.
    pub dense_layers: Option<LayerRange>,
}

/// `start..end` over layer indices, both ends expressions.
#[derive(Clone, Debug)]
pub struct LayerRange {
    pub start: Expr,
    pub end: Expr,
    pub text: String,
}

impl LayerRange {
    pub fn parse(text: &str) -> Result<LayerRange, String> {
        let Some((a, b)) = text.split_once("..") else {
            return Err(format!("layer range `{text}` must look like `start..end`"));
        };
        let start = Expr::parse(a).map_err(|e| e.to_string())?;
        let end = Expr::parse(b).map_err(|e| e.to_string())?;
        Ok(LayerRange {
            start,
            end,
            text: text.to_string(),
        })
    }
}

/// One tensor of the tensor table.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    /// The GGUF name with `{i}` for the layer index (`blk.{i}.attn_q_a.weight`).
    pub name: String,
    /// Struct field name: the middle segment (`attn_q_a`, `indexer_attn_k`).
    pub field: String,
    pub shape: Vec<Expr>,
    pub optional: bool,
    /// `Some` for per-layer tensors (default `0..n_layer`), `None` for global ones.
    pub layers: Option<LayerRange>,
    /// How it is split across GPUs (`split`; absent: whole).
    pub split: Cut,
    pub loc: Loc,
}

impl TensorSpec {
    pub fn per_layer(&self) -> bool {
        self.layers.is_some()
    }

    /// The GGUF name for layer `i` (global tensors ignore `i`).
    pub fn gguf_name(&self, i: usize) -> String {
        self.name.replace("{i}", &i.to_string())
    }

    /// Whether the field must be an `Option` in the generated structs: optional, or only in
    /// some layers.
    pub fn explicit_layers(&self) -> bool {
        matches!(&self.layers, Some(r) if r.text != DEFAULT_LAYERS)
    }
}

pub const DEFAULT_LAYERS: &str = "0..n_layer";

/// Whether GGUF tensor `name` is an instance of the `[tensors]` entry `pattern`: equal, with
/// `{i}` standing for a layer index (decimal digits).
pub fn name_matches(pattern: &str, name: &str) -> bool {
    match pattern.split_once("{i}") {
        None => pattern == name,
        Some((head, tail)) => name
            .strip_prefix(head)
            .and_then(|rest| rest.strip_suffix(tail))
            .is_some_and(|i| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit())),
    }
}

/// Tensor types of a preset: one type for all layers, or one per layer.
#[derive(Clone, Debug, PartialEq)]
pub enum TypeChoice {
    All(GgmlType),
    PerLayer(Vec<GgmlType>),
}

#[derive(Clone, Debug)]
pub struct Preset {
    pub name: String,
    pub source: String,
    pub hparams: Vec<(String, Value, Loc)>,
    /// Type of every rank >= 2 tensor not listed in `types`.
    pub default_type: GgmlType,
    /// Per tensor field.
    pub types: Vec<(String, TypeChoice, Loc)>,
    /// Optional tensors this model does not have (GGUF names).
    pub absent: Vec<String>,
    pub loc: Loc,
}

/// A kernel-parameter value as written in the spec.
#[derive(Clone, Debug)]
pub enum ParamValue {
    /// A dimension: expression over hparams (and `ne0..ne3` for per-tensor entries).
    Expr(Expr),
    /// An enum token (`neox`, `q4_k`, `bf16`) or `type` = the tensor's ggml type.
    Sym(String),
    Bool(bool),
}

#[derive(Clone, Debug)]
pub struct KernelParam {
    pub key: String,
    pub value: ParamValue,
    pub loc: Loc,
}

/// One entry of `[[kernels]]`: a family this architecture needs and what it bakes in.
#[derive(Clone, Debug)]
pub struct KernelSpec {
    pub family: String,
    /// Non-empty: one variant per listed tensor (per layer for per-layer tensors).
    pub tensors: Vec<(String, Loc)>,
    /// `stack = true`: the listed per-layer tensors are one matrix per run of consecutive
    /// tensors of equal type and row length, rows stacked in list order
    /// ([`crate::plan::stack_runs`]); one variant per run (the q/k/v of a decode step in one
    /// launch).
    pub stack: bool,
    /// `widen = true` (with `stack`): neighbours whose types differ stack too when both are
    /// exact in a common wider type (`memra_gguf::quant::common_lossless_type`: Q4_0 / Q5_0 →
    /// Q8_0); the engine re-encodes them at load, and every kernel entry sees them in that type.
    /// Fewer launches for a few more bytes: for small, latency-bound decode steps.
    pub widen: bool,
    /// `at_run_time = ["n"]`: dims evaluated per tensor (still validated, and recorded as the
    /// shapes the variant serves) but passed to the kernel at run time, not baked: for a dim
    /// that only sizes the grid and the edge guards, one variant then serves every value.
    pub at_run_time: Vec<(String, Loc)>,
    /// `xq8_types = ["q4_k", …]`: the weight types whose variants take the entry's integer path
    /// (`xq8` / `fuse_x`); tensors of other types keep f32 x. Absent: every type that has the
    /// integer path. (Where the f32 path decodes cheaply, Q8_0, the extra quantize launch can
    /// cost more than the integer products save.)
    pub xq8_types: Option<Vec<(String, Loc)>>,
    pub params: Vec<KernelParam>,
    /// Why the architecture needs it (free text).
    pub note: Option<String>,
    /// Set when no template exists yet: the entry documents the need and plans nothing.
    pub pending: Option<String>,
    pub loc: Loc,
}

/// Enum tokens accepted as kernel-parameter symbols, besides ggml type names.
pub fn known_symbol(s: &str) -> bool {
    s == "type"
        || matches!(
            s,
            "none" | "interleaved" | "neox" | "per_head" | "full" | "f32" | "bf16"
        )
        || matches!(s, "plain" | "swiglu" | "geglu" | "down" | "softmax" | "sigmoid")
        || GgmlType::from_name(s).is_some()
}

/// hparams a capability value relies on; the forward file may use them unconditionally.
fn required_names(caps: &Capabilities) -> Vec<(&'static str, &'static str)> {
    let mut req = vec![
        ("n_layer", "every architecture"),
        ("n_embd", "every architecture"),
        ("n_vocab", "every architecture"),
        ("rms_eps", "every architecture"),
    ];
    match caps.attention {
        Attention::Gqa => req.extend([
            ("n_head", "attention = gqa"),
            ("n_head_kv", "attention = gqa"),
            ("head_dim", "attention = gqa"),
        ]),
        Attention::Mla | Attention::MlaDsa => req.extend([
            ("n_head", "attention = mla"),
            ("kv_lora_rank", "attention = mla"),
            ("qk_nope_head_dim", "attention = mla"),
            ("rope_dim", "attention = mla"),
            ("v_head_dim", "attention = mla"),
        ]),
    }
    if caps.attention == Attention::MlaDsa {
        req.extend([
            ("indexer_n_head", "attention = mla_dsa"),
            ("indexer_head_dim", "attention = mla_dsa"),
            ("indexer_top_k", "attention = mla_dsa"),
        ]);
    }
    if caps.ffn == Ffn::Moe {
        req.extend([("n_expert", "ffn = moe"), ("n_expert_used", "ffn = moe")]);
    }
    req
}

const RESERVED: &[&str] = &[
    "ne0", "ne1", "ne2", "ne3", "type", "lm_head", "self", "type_", "loop", "match", "fn", "mod",
    "use", "impl", "ref", "move", "box", "in", "as", "struct", "enum", "where", "let", "const",
    "static", "crate", "super", "dyn", "async", "await", "gen",
];

fn is_ident(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some('a'..='z' | '_'))
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

impl ArchSpec {
    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<ArchSpec, SpecErrors> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            let src = SourceFile::new(path, "");
            SpecErrors(vec![
                src.loc(&(0..0), "").error(format!("cannot read: {e}")),
            ])
        })?;
        Self::parse(path, &text)
    }

    /// Parses and validates spec text; `path` is only used in messages.
    pub fn parse(path: &Path, text: &str) -> Result<ArchSpec, SpecErrors> {
        let mut src = SourceFile::new(path, text);
        let Some(doc) = src.parse(text) else {
            return Err(SpecErrors(src.take_errors()));
        };
        let spec = parse_doc(&mut src, doc.span(), doc.get_ref());
        match spec {
            Some(spec) if !src.has_errors() => Ok(spec),
            _ => Err(SpecErrors(src.take_errors())),
        }
    }

    pub fn hparam(&self, name: &str) -> Option<&HParam> {
        self.hparams.iter().find(|h| h.name == name)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorSpec> {
        self.tensors.iter().find(|t| t.name == name)
    }

    pub fn preset(&self, name: &str) -> Option<&Preset> {
        self.presets.iter().find(|p| p.name == name)
    }

    /// The module name (`glm_dsa`).
    pub fn module_name(&self) -> String {
        module_name(&self.arch)
    }

    /// The type prefix (`GlmDsa`).
    pub fn type_prefix(&self) -> String {
        type_prefix(&self.arch)
    }

    /// The cargo feature (`model-glm-dsa`).
    pub fn feature(&self) -> String {
        format!("model-{}", self.arch)
    }
}

/// `glm-dsa` -> `glm_dsa`.
pub fn module_name(arch: &str) -> String {
    arch.replace('-', "_")
}

/// `glm-dsa` -> `GlmDsa`, `qwen3` -> `Qwen3`.
pub fn type_prefix(arch: &str) -> String {
    arch.split(['-', '_'])
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect()
}

/// `blk.{i}.indexer.k_norm.weight` -> `indexer_k_norm`; `.weight` is implied, other suffixes
/// (`.bias`) stay.
pub fn field_name(tensor: &str) -> String {
    let s = tensor.strip_prefix(LAYER_PREFIX).unwrap_or(tensor);
    let s = s.strip_suffix(".weight").unwrap_or(s);
    s.replace('.', "_")
}

fn parse_doc(
    src: &mut SourceFile,
    span: std::ops::Range<usize>,
    doc: &toml::de::DeTable<'_>,
) -> Option<ArchSpec> {
    let mut top = Table::new("", span.clone(), doc);
    let top_loc = src.loc(&(0..0), "");

    let arch_tbl = top.table(src, "arch");
    let (arch, default_preset, sources, arch_loc) = match arch_tbl {
        Some(mut t) => {
            let name = t.req_str(src, "name");
            let preset = t.req_str(src, "preset");
            let mut sources = Vec::new();
            match t.array(src, "sources") {
                Some((path, _, items)) => {
                    for (i, it) in items.iter().enumerate() {
                        match it.get_ref() {
                            DeValue::String(s) => sources.push(s.to_string()),
                            other => src.error(
                                &it.span(),
                                &format!("{path}[{i}]"),
                                format!("expected a string, found {}", describe(other)),
                            ),
                        }
                    }
                }
                None => src.error(
                    &t.span.clone(),
                    "arch.sources",
                    "missing required key (the references this spec restates)",
                ),
            }
            if let Some(n) = &name
                && (n.get_ref().is_empty()
                    || !n
                        .get_ref()
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'))
                {
                    src.error(
                        &n.span(),
                        "arch.name",
                        format!(
                            "`{}` is not a GGUF architecture string (lower case, digits, '-')",
                            n.get_ref()
                        ),
                    );
                }
            let loc = src.loc(&t.span, "arch");
            t.finish(src, &["name", "preset", "sources"]);
            (name.map(|s| s.into_inner()), preset, sources, loc)
        }
        None => {
            src.error(&(0..0), "arch", "missing required table [arch]");
            (None, None, Vec::new(), top_loc.clone())
        }
    };

    let hparams = top
        .table(src, "hparams")
        .map(|t| parse_hparams(src, t))
        .unwrap_or_else(|| {
            src.error(&(0..0), "hparams", "missing required table [hparams]");
            Vec::new()
        });
    let derived = top
        .table(src, "derived")
        .map(|t| parse_derived(src, t))
        .unwrap_or_default();
    let caps = match top.table(src, "capabilities") {
        Some(t) => parse_caps(src, t),
        None => {
            src.error(
                &(0..0),
                "capabilities",
                "missing required table [capabilities]",
            );
            None
        }
    };
    let tensors = top
        .table(src, "tensors")
        .map(|t| parse_tensors(src, t))
        .unwrap_or_else(|| {
            src.error(&(0..0), "tensors", "missing required table [tensors]");
            Vec::new()
        });
    let presets = top
        .table(src, "presets")
        .map(|t| parse_presets(src, t))
        .unwrap_or_else(|| {
            src.error(&(0..0), "presets", "missing required table [presets]");
            Vec::new()
        });
    let kernels = match top.array(src, "kernels") {
        Some((path, _, items)) => parse_kernels(src, &path, items),
        None => {
            src.error(&(0..0), "kernels", "missing required array [[kernels]]");
            Vec::new()
        }
    };
    let parallel = top.table(src, "parallel").map(|t| parse_parallel(src, t));
    top.finish(
        src,
        &[
            "arch",
            "hparams",
            "derived",
            "capabilities",
            "tensors",
            "presets",
            "kernels",
            "parallel",
        ],
    );

    // Cross-references are checked even when [arch] or [capabilities] are broken, so one
    // pass reports as much as possible; the spec is returned only when everything parsed.
    let complete = arch.is_some() && caps.is_some() && default_preset.is_some();
    let spec = ArchSpec {
        arch: arch.unwrap_or_default(),
        default_preset: default_preset
            .as_ref()
            .map(|p| p.get_ref().clone())
            .unwrap_or_default(),
        sources,
        hparams,
        derived,
        caps: caps.clone().unwrap_or_else(Capabilities::placeholder),
        tensors,
        presets,
        kernels,
        parallel,
        loc: arch_loc,
    };
    check(src, &spec, default_preset.as_ref(), caps.is_some());
    if complete && !src.has_errors() {
        check_splits(src, &spec);
    }
    complete.then_some(spec)
}

impl Capabilities {
    /// Stands in while checking a spec whose [capabilities] did not parse.
    fn placeholder() -> Capabilities {
        Capabilities {
            attention: Attention::Gqa,
            qk_norm: QkNorm::None,
            rope: Rope::Neox,
            ffn: Ffn::Swiglu,
            shared_expert: false,
            norm: NormPlacement::Pre,
            router: Router::None,
            sliding_window: None,
            tied_embeddings: TiedEmbeddings::Optional,
            embedding_scale: EmbeddingScale::None,
            dense_layers: None,
        }
    }
}

/// `[parallel] shards = [1, 2, 8]`: GPU counts ≥ 1 (1, the unsplit model, is always planned);
/// `per_rank = ["n_head", ...]`: names, checked against the spec by `check`.
fn parse_parallel(src: &mut SourceFile, mut t: Table<'_, '_>) -> Parallel {
    let loc = src.loc(&t.span, "parallel");
    let mut shards = Vec::new();
    match t.array(src, "shards") {
        Some((path, _, items)) => {
            for (i, it) in items.iter().enumerate() {
                match as_int(it.get_ref()) {
                    Some(n) if n >= 1 => shards.push(n as usize),
                    _ => src.error(
                        &it.span(),
                        &format!("{path}[{i}]"),
                        format!(
                            "expected a GPU count (an integer >= 1), found {}",
                            describe(it.get_ref())
                        ),
                    ),
                }
            }
        }
        None => src.error(
            &t.span.clone(),
            "parallel.shards",
            "missing required key (the GPU counts to specialize shard shapes for)",
        ),
    }
    let mut per_rank = Vec::new();
    match t.array(src, "per_rank") {
        Some((path, _, items)) => {
            for (i, it) in items.iter().enumerate() {
                let ipath = format!("{path}[{i}]");
                match it.get_ref() {
                    DeValue::String(s) => {
                        per_rank.push((s.to_string(), src.loc(&it.span(), &ipath)))
                    }
                    other => src.error(
                        &it.span(),
                        &ipath,
                        format!(
                            "expected an hparam or derived name, found {}",
                            describe(other)
                        ),
                    ),
                }
            }
        }
        None => src.error(
            &t.span.clone(),
            "parallel.per_rank",
            "missing required key (the hparams a GPU holds 1/N of; [] for none)",
        ),
    }
    t.finish(src, &["shards", "per_rank"]);
    Parallel {
        shards: crate::shard::normalize(shards),
        per_rank,
        loc,
    }
}

fn parse_hparams(src: &mut SourceFile, mut t: Table<'_, '_>) -> Vec<HParam> {
    let mut out = Vec::new();
    for (name, path, kspan, v) in t.all() {
        if !is_ident(&name) {
            src.error(
                &kspan,
                &path,
                format!("hparam name `{name}` must be a snake_case identifier"),
            );
            continue;
        }
        let DeValue::Table(tbl) = v.get_ref() else {
            src.error(
                &v.span(),
                &path,
                format!(
                    "expected {{ key = .., type = .., source = .. }}, found {}",
                    describe(v.get_ref())
                ),
            );
            continue;
        };
        let mut h = Table::new(&path, v.span(), tbl);
        let loc = src.loc(&kspan, &path);
        let key = h.str(src, "key");
        let tensor = h.str(src, "tensor");
        let dim = h.int(src, "dim");
        let ty = h.str(src, "type");
        let source = h.req_str(src, "source");
        let default = h.get("default");
        let from = match (key, tensor) {
            (Some(k), None) => {
                if k.get_ref().is_empty() || k.get_ref().starts_with('.') {
                    src.error(
                        &k.span(),
                        &format!("{path}.key"),
                        "must be the key suffix after `<arch>.`, e.g. `attention.head_count`",
                    );
                }
                if let Some(d) = &dim {
                    src.error(
                        &d.span(),
                        &format!("{path}.dim"),
                        "`dim` goes with `tensor`, not with `key`",
                    );
                }
                Some(HParamSource::Key(k.into_inner()))
            }
            (None, Some(tn)) => match dim {
                Some(d) if (0..4).contains(d.get_ref()) => Some(HParamSource::TensorDim {
                    tensor: tn.into_inner(),
                    dim: *d.get_ref() as usize,
                }),
                Some(d) => {
                    src.error(&d.span(), &format!("{path}.dim"), "must be 0..=3");
                    None
                }
                None => {
                    src.error(
                        &v.span(),
                        &format!("{path}.dim"),
                        "missing required key (which ne index of the tensor)",
                    );
                    None
                }
            },
            (Some(k), Some(_)) => {
                src.error(&k.span(), &path, "give either `key` or `tensor`, not both");
                None
            }
            (None, None) => {
                src.error(
                    &v.span(),
                    &format!("{path}.key"),
                    "missing required key (or `tensor` + `dim`)",
                );
                None
            }
        };
        let ty = match (&from, ty) {
            (Some(HParamSource::TensorDim { .. }), None) => Some(HParamType::U32),
            (_, Some(ty)) => match ty.get_ref().as_str() {
                "u32" => Some(HParamType::U32),
                "f32" => Some(HParamType::F32),
                "bool" => Some(HParamType::Bool),
                other => {
                    src.error(
                        &ty.span(),
                        &format!("{path}.type"),
                        format!("unknown type `{other}`; expected u32, f32 or bool"),
                    );
                    None
                }
            },
            (_, None) => {
                src.error(
                    &v.span(),
                    &format!("{path}.type"),
                    "missing required key (u32, f32 or bool)",
                );
                None
            }
        };
        let default = match (ty, default) {
            (Some(ty), Some((dpath, d))) => {
                let got = match (ty, d.get_ref()) {
                    (HParamType::U32, DeValue::String(text)) => match Expr::parse(text) {
                        Ok(e) => Some(HParamDefault::Expr(e)),
                        Err(e) => {
                            src.error(&d.span(), &dpath, e.to_string());
                            Some(HParamDefault::Value(Value::Int(0)))
                        }
                    },
                    (HParamType::U32, v) => as_int(v)
                        .filter(|v| (0..=u32::MAX as i64).contains(v))
                        .map(|i| HParamDefault::Value(Value::Int(i))),
                    (HParamType::F32, v) => {
                        as_float(v).map(|f| HParamDefault::Value(Value::Float(f)))
                    }
                    (HParamType::Bool, DeValue::Boolean(b)) => {
                        Some(HParamDefault::Value(Value::Bool(*b)))
                    }
                    (HParamType::Bool, _) => None,
                };
                if got.is_none() {
                    src.error(
                        &d.span(),
                        &dpath,
                        format!("default {} is not a {}", describe(d.get_ref()), ty.name()),
                    );
                }
                got
            }
            _ => None,
        };
        h.finish(src, &["key", "tensor", "dim", "type", "default", "source"]);
        if let (Some(from), Some(ty), Some(source)) = (from, ty, source) {
            out.push(HParam {
                name,
                from,
                ty,
                default,
                source: source.into_inner(),
                loc,
            });
        }
    }
    out
}

fn parse_derived(src: &mut SourceFile, mut t: Table<'_, '_>) -> Vec<Derived> {
    let mut out = Vec::new();
    for (name, path, kspan, v) in t.all() {
        if !is_ident(&name) {
            src.error(
                &kspan,
                &path,
                format!("derived name `{name}` must be a snake_case identifier"),
            );
            continue;
        }
        let DeValue::Table(tbl) = v.get_ref() else {
            src.error(
                &v.span(),
                &path,
                format!(
                    "expected {{ expr = .., source = .. }}, found {}",
                    describe(v.get_ref())
                ),
            );
            continue;
        };
        let mut d = Table::new(&path, v.span(), tbl);
        let expr = d.req_str(src, "expr");
        let source = d.req_str(src, "source");
        d.finish(src, &["expr", "source"]);
        let loc = src.loc(&kspan, &path);
        let (Some(expr), Some(source)) = (expr, source) else {
            continue;
        };
        match Expr::parse(expr.get_ref()) {
            Ok(e) => out.push(Derived {
                name,
                expr: e,
                source: source.into_inner(),
                loc,
            }),
            Err(e) => src.error(&expr.span(), &format!("{path}.expr"), e.to_string()),
        }
    }
    out
}

fn parse_token<T>(
    src: &mut SourceFile,
    t: &mut Table<'_, '_>,
    key: &str,
    tokens: &[&str],
    from: fn(&str) -> Option<T>,
    required: bool,
) -> Option<T> {
    let s = if required {
        t.req_str(src, key)
    } else {
        t.str(src, key)
    }?;
    let got = from(s.get_ref());
    if got.is_none() {
        src.error(
            &s.span(),
            &t.child_path(key),
            format!(
                "unknown value `{}`; expected one of: {}",
                s.get_ref(),
                tokens.join(", ")
            ),
        );
    }
    got
}

fn parse_caps(src: &mut SourceFile, mut t: Table<'_, '_>) -> Option<Capabilities> {
    let attention = parse_token(
        src,
        &mut t,
        "attention",
        Attention::TOKENS,
        Attention::from_token,
        true,
    );
    let qk_norm = parse_token(
        src,
        &mut t,
        "qk_norm",
        QkNorm::TOKENS,
        QkNorm::from_token,
        true,
    );
    let rope = parse_token(src, &mut t, "rope", Rope::TOKENS, Rope::from_token, true);
    let ffn = parse_token(src, &mut t, "ffn", Ffn::TOKENS, Ffn::from_token, true);
    let norm = parse_token(
        src,
        &mut t,
        "norm",
        NormPlacement::TOKENS,
        NormPlacement::from_token,
        true,
    );
    let router_given = t.entries.iter().any(|(k, _, _)| k == "router");
    let router = parse_token(
        src,
        &mut t,
        "router",
        Router::TOKENS,
        Router::from_token,
        false,
    );
    let tied = parse_token(
        src,
        &mut t,
        "tied_embeddings",
        TiedEmbeddings::TOKENS,
        TiedEmbeddings::from_token,
        true,
    );
    let scale = parse_token(
        src,
        &mut t,
        "embedding_scale",
        EmbeddingScale::TOKENS,
        EmbeddingScale::from_token,
        false,
    );
    let shared = t.bool(src, "shared_expert");
    let dense = t.str(src, "dense_layers");
    let sliding = t.table(src, "sliding_window");
    let caps_span = t.span.clone();
    t.finish(
        src,
        &[
            "attention",
            "qk_norm",
            "rope",
            "ffn",
            "shared_expert",
            "norm",
            "router",
            "sliding_window",
            "tied_embeddings",
            "embedding_scale",
            "dense_layers",
        ],
    );

    let sliding_window = sliding.and_then(|mut s| {
        let pattern = s.int(src, "pattern");
        let window = s.req_str(src, "window");
        if pattern.is_none() && !s.entries.iter().any(|(k, _, _)| k == "pattern") {
            src.error(
                &s.span.clone(),
                "capabilities.sliding_window.pattern",
                "missing required key",
            );
        }
        let span = s.span.clone();
        s.finish(src, &["pattern", "window"]);
        let pattern = pattern?;
        if *pattern.get_ref() < 2 {
            src.error(
                &pattern.span(),
                "capabilities.sliding_window.pattern",
                "must be at least 2 (every pattern-th layer is global)",
            );
        }
        let _ = span;
        Some(SlidingWindow {
            pattern: *pattern.get_ref(),
            window: window?.into_inner(),
        })
    });
    let dense_layers = dense
        .as_ref()
        .and_then(|d| match LayerRange::parse(d.get_ref()) {
            Ok(r) => Some(r),
            Err(e) => {
                src.error(&d.span(), "capabilities.dense_layers", e);
                None
            }
        });
    let ffn = ffn?;
    let router = router.unwrap_or(Router::None);
    if ffn == Ffn::Moe && router == Router::None {
        let loc_span = caps_span.clone();
        src.error(
            &loc_span,
            "capabilities.router",
            "ffn = \"moe\" needs a router (softmax or sigmoid_bias)",
        );
    }
    if ffn != Ffn::Moe && router_given && router != Router::None {
        src.error(
            &caps_span,
            "capabilities.router",
            "a router only makes sense with ffn = \"moe\"",
        );
    }
    if let Some(s) = &shared
        && *s.get_ref() && ffn != Ffn::Moe {
            src.error(
                &s.span(),
                "capabilities.shared_expert",
                "a shared expert only makes sense with ffn = \"moe\"",
            );
        }
    if let Some(d) = &dense
        && ffn != Ffn::Moe {
            src.error(
                &d.span(),
                "capabilities.dense_layers",
                "dense_layers only makes sense with ffn = \"moe\"",
            );
        }
    Some(Capabilities {
        attention: attention?,
        qk_norm: qk_norm?,
        rope: rope?,
        ffn,
        shared_expert: shared.map(|s| s.into_inner()).unwrap_or(false),
        norm: norm?,
        router,
        sliding_window,
        tied_embeddings: tied?,
        embedding_scale: scale.unwrap_or(EmbeddingScale::None),
        dense_layers,
    })
}

fn parse_expr_value(src: &mut SourceFile, path: &str, v: &Spanned<DeValue<'_>>) -> Option<Expr> {
    match v.get_ref() {
        DeValue::String(s) => match Expr::parse(s) {
            Ok(e) => Some(e),
            Err(e) => {
                src.error(&v.span(), path, e.to_string());
                None
            }
        },
        other => match as_int(other) {
            Some(i) => Some(Expr::int(i)),
            None => {
                src.error(
                    &v.span(),
                    path,
                    format!(
                        "expected an expression string or integer, found {}",
                        describe(other)
                    ),
                );
                None
            }
        },
    }
}

fn parse_tensors(src: &mut SourceFile, mut t: Table<'_, '_>) -> Vec<TensorSpec> {
    let mut out = Vec::new();
    for (name, path, kspan, v) in t.all() {
        let loc = src.loc(&kspan, &path);
        let per_layer = name.contains("{i}");
        if per_layer && (!name.starts_with(LAYER_PREFIX) || name.matches("{i}").count() != 1) {
            src.error(
                &kspan,
                &path,
                format!(
                    "per-layer tensor names start with `{LAYER_PREFIX}` and contain `{{i}}` once"
                ),
            );
        }
        if name.contains(['{', '}']) && !per_layer {
            src.error(
                &kspan,
                &path,
                "the only placeholder in a tensor name is `{i}`",
            );
        }
        let DeValue::Table(tbl) = v.get_ref() else {
            src.error(
                &v.span(),
                &path,
                format!(
                    "expected {{ shape = [..] }}, found {}",
                    describe(v.get_ref())
                ),
            );
            continue;
        };
        let mut e = Table::new(&path, v.span(), tbl);
        let mut shape = Vec::new();
        let shape_ok = match e.array(src, "shape") {
            Some((spath, sspan, items)) => {
                if items.is_empty() || items.len() > 4 {
                    src.error(
                        &sspan,
                        &spath,
                        format!("a GGUF tensor has 1 to 4 dimensions, not {}", items.len()),
                    );
                }
                let mut ok = true;
                for (i, it) in items.iter().enumerate() {
                    match parse_expr_value(src, &format!("{spath}[{i}]"), it) {
                        Some(x) => shape.push(x),
                        None => ok = false,
                    }
                }
                ok
            }
            None => {
                src.error(&v.span(), &format!("{path}.shape"), "missing required key");
                false
            }
        };
        let optional = e
            .bool(src, "optional")
            .map(|b| b.into_inner())
            .unwrap_or(false);
        let layers = match e.str(src, "layers") {
            Some(l) if !per_layer => {
                src.error(
                    &l.span(),
                    &format!("{path}.layers"),
                    "only per-layer tensors (`blk.{i}.…`) have a layer range",
                );
                None
            }
            Some(l) => match LayerRange::parse(l.get_ref()) {
                Ok(r) => Some(r),
                Err(msg) => {
                    src.error(&l.span(), &format!("{path}.layers"), msg);
                    None
                }
            },
            None if per_layer => {
                Some(LayerRange::parse(DEFAULT_LAYERS).expect("default range parses"))
            }
            None => None,
        };
        let field = match e.str(src, "field") {
            Some(f) => {
                if !is_ident(f.get_ref()) {
                    src.error(
                        &f.span(),
                        &format!("{path}.field"),
                        "must be a snake_case identifier",
                    );
                }
                f.into_inner()
            }
            None => field_name(&name),
        };
        let split = match e.str(src, "split") {
            Some(sp) => {
                let spath = format!("{path}.split");
                match Cut::from_token(sp.get_ref()) {
                    Some(_) if shape.len() < 2 => {
                        src.error(&sp.span(), &spath, "only matrices (2 to 4 dims) are split");
                        Cut::Whole
                    }
                    Some(cut) => cut,
                    None => {
                        src.error(
                            &sp.span(),
                            &spath,
                            format!(
                                "unknown value `{}`; expected one of: {} (no `split`: whole)",
                                sp.get_ref(),
                                Cut::TOKENS.join(", ")
                            ),
                        );
                        Cut::Whole
                    }
                }
            }
            None => Cut::Whole,
        };
        e.finish(src, &["shape", "optional", "layers", "field", "split"]);
        if !is_ident(&field) || RESERVED.contains(&field.as_str()) {
            src.error(
                &kspan,
                &path,
                format!("derived field name `{field}` is not usable; set `field = \"...\"`"),
            );
        }
        if shape_ok {
            out.push(TensorSpec {
                name,
                field,
                shape,
                optional,
                layers,
                split,
                loc,
            });
        }
    }
    out
}

fn parse_presets(src: &mut SourceFile, mut t: Table<'_, '_>) -> Vec<Preset> {
    let mut out = Vec::new();
    for (name, path, kspan, v) in t.all() {
        let DeValue::Table(tbl) = v.get_ref() else {
            src.error(
                &v.span(),
                &path,
                format!("expected a table, found {}", describe(v.get_ref())),
            );
            continue;
        };
        let loc = src.loc(&kspan, &path);
        let mut p = Table::new(&path, v.span(), tbl);
        let source = p.req_str(src, "source");
        let mut hparams = Vec::new();
        match p.table(src, "hparams") {
            Some(mut h) => {
                for (hname, hpath, hspan, hv) in h.all() {
                    let value = match hv.get_ref() {
                        DeValue::Boolean(b) => Some(Value::Bool(*b)),
                        DeValue::Float(_) => as_float(hv.get_ref()).map(Value::Float),
                        other => as_int(other).map(Value::Int),
                    };
                    match value {
                        Some(val) => hparams.push((hname, val, src.loc(&hspan, &hpath))),
                        None => src.error(
                            &hv.span(),
                            &hpath,
                            format!(
                                "expected a number or boolean, found {}",
                                describe(hv.get_ref())
                            ),
                        ),
                    }
                }
            }
            None => src.error(
                &v.span(),
                &format!("{path}.hparams"),
                "missing required table",
            ),
        }
        let mut default_type = None;
        let mut types = Vec::new();
        match p.table(src, "types") {
            Some(mut ty) => {
                for (field, tpath, tspan, tv) in ty.all() {
                    let parse_one = |src: &mut SourceFile,
                                     v: &Spanned<DeValue<'_>>,
                                     path: &str|
                     -> Option<GgmlType> {
                        match v.get_ref() {
                            DeValue::String(s) => {
                                let got = GgmlType::from_name(s).filter(|t| t.name() == s.as_ref());
                                if got.is_none() {
                                    src.error(&v.span(), path, format!("unknown ggml type `{s}` (spell it as ggml does: Q4_K, Q8_0, F32, ...)"));
                                }
                                got
                            }
                            other => {
                                src.error(
                                    &v.span(),
                                    path,
                                    format!("expected a ggml type name, found {}", describe(other)),
                                );
                                None
                            }
                        }
                    };
                    if field == "default" {
                        default_type = parse_one(src, tv, &tpath);
                        continue;
                    }
                    let choice = match tv.get_ref() {
                        DeValue::Array(items) => {
                            let mut all = Vec::new();
                            for (i, it) in items.iter().enumerate() {
                                if let Some(t) = parse_one(src, it, &format!("{tpath}[{i}]")) {
                                    all.push(t);
                                }
                            }
                            (all.len() == items.len()).then_some(TypeChoice::PerLayer(all))
                        }
                        _ => parse_one(src, tv, &tpath).map(TypeChoice::All),
                    };
                    if let Some(c) = choice {
                        types.push((field, c, src.loc(&tspan, &tpath)));
                    }
                }
                if default_type.is_none() && !ty.entries.iter().any(|(k, _, _)| k == "default") {
                    src.error(
                        &ty.span.clone(),
                        &format!("{path}.types.default"),
                        "missing required key (type of the matrices not listed)",
                    );
                }
            }
            None => src.error(
                &v.span(),
                &format!("{path}.types"),
                "missing required table",
            ),
        }
        let mut absent = Vec::new();
        if let Some((apath, _, items)) = p.array(src, "absent") {
            for (i, it) in items.iter().enumerate() {
                match it.get_ref() {
                    DeValue::String(s) => absent.push(s.to_string()),
                    other => src.error(
                        &it.span(),
                        &format!("{apath}[{i}]"),
                        format!("expected a tensor name, found {}", describe(other)),
                    ),
                }
            }
        }
        p.finish(src, &["source", "hparams", "types", "absent"]);
        if let (Some(source), Some(default_type)) = (source, default_type) {
            out.push(Preset {
                name,
                source: source.into_inner(),
                hparams,
                default_type,
                types,
                absent,
                loc,
            });
        }
    }
    out
}

fn parse_kernels(
    src: &mut SourceFile,
    path: &str,
    items: &[Spanned<DeValue<'_>>],
) -> Vec<KernelSpec> {
    let mut out = Vec::new();
    for (i, it) in items.iter().enumerate() {
        let kpath = format!("{path}[{i}]");
        let DeValue::Table(tbl) = it.get_ref() else {
            src.error(
                &it.span(),
                &kpath,
                format!("expected a table, found {}", describe(it.get_ref())),
            );
            continue;
        };
        let loc = src.loc(&it.span(), &kpath);
        let mut k = Table::new(&kpath, it.span(), tbl);
        let family = k.req_str(src, "family");
        let note = k.str(src, "for").map(|s| s.into_inner());
        let pending = k.str(src, "pending").map(|s| s.into_inner());
        let stack = k.bool(src, "stack").map(|b| (*b.get_ref(), b.span()));
        let widen = k.bool(src, "widen").map(|b| (*b.get_ref(), b.span()));
        let mut tensors = Vec::new();
        if let Some((tpath, _, titems)) = k.array(src, "tensors") {
            for (j, t) in titems.iter().enumerate() {
                match t.get_ref() {
                    DeValue::String(s) => {
                        tensors.push((s.to_string(), src.loc(&t.span(), &format!("{tpath}[{j}]"))))
                    }
                    other => src.error(
                        &t.span(),
                        &format!("{tpath}[{j}]"),
                        format!("expected a tensor name, found {}", describe(other)),
                    ),
                }
            }
        }
        let mut at_run_time = Vec::new();
        if let Some((rpath, _, ritems)) = k.array(src, "at_run_time") {
            for (j, r) in ritems.iter().enumerate() {
                match r.get_ref() {
                    DeValue::String(s) if is_ident(s) => {
                        at_run_time.push((s.to_string(), src.loc(&r.span(), &format!("{rpath}[{j}]"))))
                    }
                    other => src.error(
                        &r.span(),
                        &format!("{rpath}[{j}]"),
                        format!("expected a dim key of the family (e.g. \"n\"), found {}", describe(other)),
                    ),
                }
            }
        }
        let mut xq8_types = None;
        if let Some((xpath, xspan, xitems)) = k.array(src, "xq8_types") {
            let mut types = Vec::new();
            for (j, x) in xitems.iter().enumerate() {
                match x.get_ref() {
                    DeValue::String(s) if crate::families::has_int_path(s) => types.push((s.to_string(), src.loc(&x.span(), &format!("{xpath}[{j}]")))),
                    other => src.error(
                        &x.span(),
                        &format!("{xpath}[{j}]"),
                        format!(
                            "expected a weight type with the integer path ({}), found {}",
                            crate::families::INT_DOT_QTYPES.iter().map(|t| crate::families::qtype_token(*t)).collect::<Vec<_>>().join(", "),
                            describe(other)
                        ),
                    ),
                }
            }
            xq8_types = Some((types, xspan, xpath));
        }
        let mut params = Vec::new();
        let reserved = ["family", "for", "pending", "tensors", "stack", "widen", "at_run_time", "xq8_types"];
        for (key, ppath, pspan, v) in k.all() {
            if reserved.contains(&key.as_str()) {
                continue;
            }
            let loc = src.loc(&pspan, &ppath);
            if !is_ident(&key) {
                src.error(
                    &pspan,
                    &ppath,
                    "kernel parameter keys are the Cfg field names in lower case",
                );
                continue;
            }
            let value = match v.get_ref() {
                DeValue::Boolean(b) => Some(ParamValue::Bool(*b)),
                DeValue::String(s) if known_symbol(s) => Some(ParamValue::Sym(s.to_string())),
                _ => parse_expr_value(src, &ppath, v).map(ParamValue::Expr),
            };
            if let Some(value) = value {
                params.push(KernelParam { key, value, loc });
            }
        }
        if let Some(family) = family {
            if !is_ident(family.get_ref()) {
                src.error(
                    &family.span(),
                    &format!("{kpath}.family"),
                    "family names are snake_case (templates/README.md sections)",
                );
            }
            if let Some((true, span)) = &stack
                && (tensors.len() < 2 || tensors.iter().any(|(t, _)| !t.starts_with("blk.{i}.")))
            {
                src.error(span, &format!("{kpath}.stack"), "stack = true needs two or more per-layer tensors (`blk.{i}.…`) in `tensors`");
            }
            if let Some((true, span)) = &widen
                && !matches!(stack, Some((true, _)))
            {
                src.error(span, &format!("{kpath}.widen"), "widen = true applies to a stacked entry: add stack = true");
            }
            // Off: `false`, or an expression of constants that folds to 0 (`0`, `1 - 1`).
            let off = |v: &ParamValue| match v {
                ParamValue::Expr(e) => e.eval(&|_| None).is_ok_and(|x| x == 0), // a name does not evaluate here
                ParamValue::Bool(b) => !b,
                ParamValue::Sym(_) => false,
            };
            let on = |key: &str| params.iter().any(|p| p.key == key && !off(&p.value));
            if let Some((_, span, xpath)) = &xq8_types
                && !on("xq8")
                && !on("fuse_x")
            {
                src.error(span, xpath, "xq8_types narrows the entry's integer path: add xq8 = 1 (or fuse_x = 1)");
            }
            out.push(KernelSpec {
                family: family.into_inner(),
                tensors,
                stack: stack.is_some_and(|(b, _)| b),
                widen: widen.is_some_and(|(b, _)| b),
                at_run_time,
                xq8_types: xq8_types.map(|(types, ..)| types),
                params,
                note,
                pending,
                loc,
            });
        }
    }
    out
}

/// Cross-references: names used in expressions exist and are integers, tensors named by
/// hparams and kernels exist, presets cover every required hparam, capabilities have the
/// hparams they rely on.
fn check(
    src: &mut SourceFile,
    spec: &ArchSpec,
    default_preset: Option<&Spanned<String>>,
    caps_ok: bool,
) {
    let int_names: Vec<&str> = spec
        .hparams
        .iter()
        .filter(|h| h.ty == HParamType::U32)
        .map(|h| h.name.as_str())
        .chain(spec.derived.iter().map(|d| d.name.as_str()))
        .collect();
    let kind_of = |n: &str| -> Option<&'static str> {
        if int_names.contains(&n) {
            Some("u32")
        } else {
            spec.hparam(n).map(|h| h.ty.name())
        }
    };
    let check_expr = |src: &mut SourceFile, loc: &Loc, e: &Expr, extra: &[&str]| {
        for n in e.names() {
            match kind_of(n) {
                Some("u32") => {}
                Some(ty) => src.push(loc.error(format!("expression `{e}`: `{n}` is a {ty} hparam; only integers can appear in expressions"))),
                None if extra.contains(&n) => {}
                None => src.push(loc.error(format!("expression `{e}`: unknown name `{n}` (not an hparam or derived value)"))),
            }
        }
    };

    let mut seen: Vec<&str> = Vec::new();
    for (name, loc) in spec
        .hparams
        .iter()
        .map(|h| (&h.name, &h.loc))
        .chain(spec.derived.iter().map(|d| (&d.name, &d.loc)))
    {
        if seen.contains(&name.as_str()) {
            src.push(loc.error(format!(
                "`{name}` is defined twice (hparams and derived share one namespace)"
            )));
        }
        if RESERVED.contains(&name.as_str()) {
            src.push(loc.error(format!("`{name}` is reserved")));
        }
        seen.push(name);
    }
    for h in &spec.hparams {
        if let HParamSource::TensorDim { tensor, .. } = &h.from {
            match spec.tensor(tensor) {
                Some(t) if !t.per_layer() && !t.optional => {}
                Some(_) => src.push(h.loc.error(format!(
                    "tensor `{tensor}` must be global and required to define an hparam"
                ))),
                None => src.push(
                    h.loc
                        .error(format!("tensor `{tensor}` is not in [tensors]")),
                ),
            }
            if h.default.is_some() {
                src.push(
                    h.loc
                        .error("an hparam read from a tensor dimension cannot have a default"),
                );
            }
        }
    }
    // Defaults and derived values may only use names defined before them: one-pass evaluation.
    for (i, h) in spec.hparams.iter().enumerate() {
        if let Some(HParamDefault::Expr(e)) = &h.default {
            for n in e.names() {
                match spec.hparams[..i].iter().find(|x| x.name == n) {
                    Some(x) if x.ty == HParamType::U32 => {}
                    Some(x) => src.push(h.loc.error(format!("default `{e}`: `{n}` is a {} hparam; only integers can appear in expressions", x.ty.name()))),
                    None => src.push(h.loc.error(format!("default `{e}`: `{n}` is not an hparam declared before `{}`", h.name))),
                }
            }
        }
    }
    for (i, d) in spec.derived.iter().enumerate() {
        for n in d.expr.names() {
            let earlier = spec.derived[..i].iter().any(|x| x.name == n);
            match kind_of(n) {
                Some("u32") if spec.hparam(n).is_some() || earlier => {}
                Some("u32") => src.push(d.loc.error(format!("expression `{}`: `{n}` is derived later; derived values may only use earlier ones", d.expr))),
                Some(ty) => src.push(d.loc.error(format!("expression `{}`: `{n}` is a {ty} hparam; only integers can appear in expressions", d.expr))),
                None => src.push(d.loc.error(format!("expression `{}`: unknown name `{n}` (not an hparam or derived value)", d.expr))),
            }
        }
    }
    for (name, why) in if caps_ok {
        required_names(&spec.caps)
    } else {
        Vec::new()
    } {
        match kind_of(name) {
            Some(_) => {}
            None => src.push(spec.loc.error(format!(
                "hparam `{name}` is required ({why}); define it in [hparams] or [derived]"
            ))),
        }
    }
    if let Some(sw) = spec.caps.sliding_window.as_ref().filter(|_| caps_ok)
        && kind_of(&sw.window) != Some("u32") {
            src.push(spec.loc.error(format!(
                "capabilities.sliding_window.window names `{}`, which is not a u32 hparam",
                sw.window
            )));
        }
    if let Some(r) = &spec.caps.dense_layers {
        check_expr(src, &spec.loc, &r.start, &[]);
        check_expr(src, &spec.loc, &r.end, &[]);
    }

    let mut fields: Vec<&str> = Vec::new();
    let mut names: Vec<&str> = Vec::new();
    for t in &spec.tensors {
        for e in &t.shape {
            check_expr(src, &t.loc, e, &[]);
        }
        if let Some(r) = &t.layers {
            check_expr(src, &t.loc, &r.start, &[]);
            check_expr(src, &t.loc, &r.end, &[]);
        }
        if fields.contains(&t.field.as_str()) {
            src.push(t.loc.error(format!(
                "field name `{}` is used by two tensors; set `field` on one",
                t.field
            )));
        }
        if names.contains(&t.name.as_str()) {
            src.push(t.loc.error(format!("tensor `{}` is listed twice", t.name)));
        }
        fields.push(&t.field);
        names.push(&t.name);
    }
    if spec.tensor("token_embd.weight").is_none() {
        src.push(spec.loc.error("[tensors] must list `token_embd.weight`"));
    }
    match spec.caps.tied_embeddings {
        _ if !caps_ok => {}
        TiedEmbeddings::Always => {
            if spec.tensor("output.weight").is_some() {
                src.push(
                    spec.loc
                        .error("tied_embeddings = \"always\" but [tensors] lists `output.weight`"),
                );
            }
        }
        TiedEmbeddings::Never | TiedEmbeddings::Optional => match spec.tensor("output.weight") {
            None => {
                src.push(spec.loc.error(
                    "[tensors] must list `output.weight` unless tied_embeddings = \"always\"",
                ))
            }
            Some(t) if spec.caps.tied_embeddings == TiedEmbeddings::Optional && !t.optional => src
                .push(t.loc.error(
                    "tied_embeddings = \"optional\" needs `output.weight` marked optional = true",
                )),
            _ => {}
        },
    }

    if let Some(p) = default_preset
        && spec.preset(p.get_ref()).is_none() {
            src.error(
                &p.span(),
                "arch.preset",
                format!("no [presets.{}] in this file", p.get_ref()),
            );
        }
    for p in &spec.presets {
        for (name, value, loc) in &p.hparams {
            match (spec.hparam(name), value) {
                (None, _) if spec.derived.iter().any(|d| &d.name == name) => {
                    src.push(loc.error(format!("`{name}` is derived; presets give only [hparams]")))
                }
                (None, _) => src.push(loc.error(format!("`{name}` is not an hparam of this spec"))),
                (Some(h), v) => {
                    let ok = matches!((h.ty, v), (HParamType::U32, Value::Int(i)) if (0..=u32::MAX as i64).contains(i))
                        || matches!(
                            (h.ty, v),
                            (HParamType::F32, Value::Float(_) | Value::Int(_))
                        )
                        || matches!((h.ty, v), (HParamType::Bool, Value::Bool(_)));
                    if !ok {
                        src.push(loc.error(format!("value {v} is not a {}", h.ty.name())));
                    }
                }
            }
        }
        for h in &spec.hparams {
            if h.default.is_none() && !p.hparams.iter().any(|(n, _, _)| n == &h.name) {
                src.push(p.loc.error(format!(
                    "preset lacks hparam `{}` (required, no default)",
                    h.name
                )));
            }
        }
        for (field, _, loc) in &p.types {
            if !spec.tensors.iter().any(|t| &t.field == field) {
                src.push(loc.error(format!("`{field}` is not a tensor field of this spec")));
            }
        }
        for name in &p.absent {
            match spec.tensor(name) {
                Some(t) if t.optional => {}
                Some(_) => src.push(p.loc.error(format!(
                    "absent: `{name}` is required, a preset cannot leave it out"
                ))),
                None => src.push(p.loc.error(format!("absent: `{name}` is not in [tensors]"))),
            }
        }
    }

    match &spec.parallel {
        Some(p) => {
            for (i, (name, loc)) in p.per_rank.iter().enumerate() {
                if kind_of(name) != Some("u32") {
                    src.push(loc.error(format!(
                        "`{name}` is not an integer hparam or derived value of this spec"
                    )));
                } else if p.per_rank[..i].iter().any(|(n, _)| n == name) {
                    src.push(loc.error(format!("`{name}` is listed twice")));
                }
            }
            if spec.tensors.iter().all(|t| t.split == Cut::Whole) {
                src.push(p.loc.error(
                    "no [tensors] entry has a `split`: every GPU would hold and compute the whole model",
                ));
            }
        }
        None => {
            for t in spec.tensors.iter().filter(|t| t.split != Cut::Whole) {
                src.push(t.loc.error(
                    "`split` needs a [parallel] table (the GPU counts and per_rank values)",
                ));
            }
        }
    }

    for k in &spec.kernels {
        for (name, loc) in &k.tensors {
            match spec.tensor(name) {
                Some(t) if t.shape.len() >= 2 => {}
                Some(_) => src.push(loc.error(format!(
                    "`{name}` has rank 1; per-tensor kernels take matrices"
                ))),
                None if name == LM_HEAD && spec.tensor("token_embd.weight").is_some() => {}
                None => src.push(loc.error(format!("`{name}` is not in [tensors]"))),
            }
        }
        let extra: &[&str] = if k.tensors.is_empty() {
            &[]
        } else {
            TENSOR_SCOPE_NAMES
        };
        for p in &k.params {
            match &p.value {
                ParamValue::Expr(e) => check_expr(src, &p.loc, e, extra),
                ParamValue::Sym(s) if s == "type" && k.tensors.is_empty() => src.push(
                    p.loc
                        .error("`type` (the tensor's ggml type) needs a `tensors` list"),
                ),
                _ => {}
            }
        }
    }
}

/// Every `[parallel] shards` count splits the default preset (the dims the build plans): each
/// split tensor's cut (whole rows of its last dim, whole quant blocks of its columns) and each
/// `per_rank` value are equal parts, by the rules the planner and the ranks use
/// (`crate::shard`). One error per tensor entry and count, at the entry.
fn check_splits(src: &mut SourceFile, spec: &ArchSpec) {
    let Some(p) = &spec.parallel else {
        return;
    };
    // A preset that does not evaluate is reported where it is used (dims, the build).
    let Ok(dims) = crate::dims::from_preset(spec, None) else {
        return;
    };
    for &n in &p.shards {
        let at = format!(
            "{n} GPUs ([parallel] shards) at preset `{}`",
            spec.default_preset
        );
        for (name, loc) in &p.per_rank {
            if let Some(Value::Int(v)) = dims.value(name)
                && let Err(e) = crate::shard::rank_value(name, v, n)
            {
                src.push(loc.error(format!("{at}: {e}")));
            }
        }
        let mut reported: Vec<usize> = Vec::new();
        for t in &dims.tensors {
            let entry = &spec.tensors[t.spec_index];
            if entry.split == Cut::Whole || reported.contains(&t.spec_index) {
                continue;
            }
            let block = t.ggml_type.block_size();
            if let Err(e) = crate::shard::rank_shape(entry.split, &t.name, &t.shape, block, n) {
                src.push(entry.loc.error(format!("{at}: {e}")));
                reported.push(t.spec_index);
            }
        }
    }
}
