//! The kernel-family catalogue, read from `templates/README.md`: one `## <family>` section per
//! family with a table `| field | type | kind | default | meaning |` whose rows are the Cfg
//! fields in order (the order is also the variant-name key order).

use std::fmt;
use std::path::Path;

use memra_gguf::GgmlType;

/// How a Cfg field varies.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FieldKind {
    /// A shape; 0 = read at run time (generic variants leave it out).
    Dim,
    /// Compile-time choice in specialized and generic variants alike.
    Enum,
    /// A tuning constant (threads, tiles); compile-time in both.
    Tune,
}

/// C++ type of a Cfg field.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FieldType {
    Int,
    QType,
    RopeMode,
    QkNorm,
    CacheType,
    /// `memra::MoeMode`: what a moe_matvec launch computes.
    MoeMode,
    /// `memra::Gating`: MoE router probability function.
    Gating,
    /// `memra::Glu` (norm_matvec.cuh): a plain projection or a gated pair with its activation.
    Glu,
}

/// The QTypes of the contract (`memra::QType`), in enum order.
pub const QTYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::BF16,
];

/// The QTypes with an integer dot product (`qunit::Unit<Q>::INT_DOT` in matvec.cuh): the only
/// weights a tuning field `xq8` (x as int8 blocks, products by __dp4a) applies to.
pub const INT_DOT_QTYPES: &[GgmlType] = &[
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
];

/// Whether the weight type named by `token` (`q4_k`) has the integer path.
pub fn has_int_path(token: &str) -> bool {
    INT_DOT_QTYPES.iter().any(|t| qtype_token(*t) == token)
}

impl FieldType {
    fn parse(s: &str) -> Option<FieldType> {
        Some(match s.trim_matches('`') {
            "int" => FieldType::Int,
            "memra::QType" => FieldType::QType,
            "memra::RopeMode" => FieldType::RopeMode,
            "memra::QkNorm" => FieldType::QkNorm,
            "memra::CacheType" => FieldType::CacheType,
            "memra::MoeMode" => FieldType::MoeMode,
            "memra::Gating" => FieldType::Gating,
            "memra::Glu" => FieldType::Glu,
            _ => return None,
        })
    }

    /// Every value of an enum type as a lower-case token (empty for `Int`).
    pub fn tokens(self) -> Vec<&'static str> {
        match self {
            FieldType::Int => Vec::new(),
            FieldType::QType => QTYPES.iter().map(|t| qtype_token(*t)).collect(),
            FieldType::RopeMode => vec!["none", "interleaved", "neox"],
            FieldType::QkNorm => vec!["none", "per_head", "full"],
            FieldType::CacheType => vec!["f32", "bf16"],
            FieldType::MoeMode => vec!["plain", "swiglu", "geglu", "down"],
            FieldType::Gating => vec!["softmax", "sigmoid"],
            FieldType::Glu => vec!["none", "swiglu", "geglu"],
        }
    }

    /// The C++ spelling of a token (`q4_k` -> `memra::QType::Q4_K`).
    pub fn cpp(self, token: &str) -> Option<String> {
        let v = match self {
            FieldType::Int => return None,
            FieldType::QType => {
                let t = QTYPES.iter().find(|t| qtype_token(**t) == token)?;
                format!("memra::QType::{}", t.name())
            }
            FieldType::RopeMode => format!(
                "memra::RopeMode::{}",
                camel(token, &["none", "interleaved", "neox"])?
            ),
            FieldType::QkNorm => format!(
                "memra::QkNorm::{}",
                camel(token, &["none", "per_head", "full"])?
            ),
            FieldType::CacheType => match token {
                "f32" => "memra::CacheType::F32".into(),
                "bf16" => "memra::CacheType::BF16".into(),
                _ => return None,
            },
            FieldType::MoeMode => format!(
                "memra::MoeMode::{}",
                camel(token, &["plain", "swiglu", "geglu", "down"])?
            ),
            FieldType::Gating => format!(
                "memra::Gating::{}",
                camel(token, &["softmax", "sigmoid"])?
            ),
            FieldType::Glu => format!(
                "memra::Glu::{}",
                camel(token, &["none", "swiglu", "geglu"])?
            ),
        };
        Some(v)
    }

    pub fn cpp_type(self) -> &'static str {
        match self {
            FieldType::Int => "int",
            FieldType::QType => "memra::QType",
            FieldType::RopeMode => "memra::RopeMode",
            FieldType::QkNorm => "memra::QkNorm",
            FieldType::CacheType => "memra::CacheType",
            FieldType::MoeMode => "memra::MoeMode",
            FieldType::Gating => "memra::Gating",
            FieldType::Glu => "memra::Glu",
        }
    }
}

fn camel(token: &str, allowed: &[&str]) -> Option<String> {
    allowed
        .contains(&token)
        .then(|| crate::spec::type_prefix(token))
}

/// The one dtype token table (`q4_k`, `iq4_nl`, `bf16`).
pub fn qtype_token(t: GgmlType) -> &'static str {
    match t {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q4_K => "q4_k",
        GgmlType::Q5_K => "q5_k",
        GgmlType::Q6_K => "q6_k",
        GgmlType::IQ4_NL => "iq4_nl",
        GgmlType::IQ4_XS => "iq4_xs",
        _ => "unsupported",
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Field {
    /// Upper case, as in the Cfg struct (`N_EMBD`).
    pub name: String,
    pub ty: FieldType,
    pub kind: FieldKind,
    /// Token or integer text; `None` = required.
    pub default: Option<String>,
}

impl Field {
    /// The spec / params key (`n_embd`).
    pub fn key(&self) -> String {
        self.name.to_ascii_lowercase()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Family {
    pub name: String,
    /// Empty while the section has no Cfg table yet (a placeholder).
    pub fields: Vec<Field>,
}

impl Family {
    pub fn field(&self, key: &str) -> Option<&Field> {
        self.fields.iter().find(|f| f.key() == key)
    }

    /// The header and `MEMRA_DEFINE_<F>` macro are named after the family.
    pub fn header(&self) -> String {
        format!("memra/{}.cuh", self.name)
    }

    pub fn define_macro(&self) -> String {
        format!("MEMRA_DEFINE_{}", self.name.to_ascii_uppercase())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Catalogue {
    pub families: Vec<Family>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct CatalogueError(pub String);

impl fmt::Display for CatalogueError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CatalogueError {}

impl Catalogue {
    pub fn load(path: &Path) -> Result<Catalogue, CatalogueError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| CatalogueError(format!("{}: cannot read: {e}", path.display())))?;
        Self::parse(path, &text)
    }

    pub fn family(&self, name: &str) -> Option<&Family> {
        self.families.iter().find(|f| f.name == name)
    }

    /// Parses the README text; `path` is for messages.
    pub fn parse(path: &Path, text: &str) -> Result<Catalogue, CatalogueError> {
        let mut families: Vec<Family> = Vec::new();
        let mut columns: Option<Vec<String>> = None;
        for (n, line) in text.lines().enumerate() {
            let err = |m: String| CatalogueError(format!("{}:{}: {m}", path.display(), n + 1));
            if let Some(title) = line.strip_prefix("## ") {
                let name = title.split_whitespace().next().unwrap_or("").to_string();
                if name.is_empty()
                    || !name
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
                {
                    return Err(err(format!(
                        "family heading `{title}` is not a snake_case family name"
                    )));
                }
                families.push(Family {
                    name,
                    fields: Vec::new(),
                });
                columns = None;
                continue;
            }
            let Some(family) = families.last_mut() else {
                continue;
            };
            let trimmed = line.trim();
            if !trimmed.starts_with('|') {
                columns = None;
                continue;
            }
            let cells: Vec<String> = trimmed
                .trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect();
            if cells
                .iter()
                .all(|c| c.chars().all(|ch| ch == '-' || ch == ':'))
            {
                continue;
            }
            let Some(cols) = &columns else {
                if cells.first().map(String::as_str) == Some("field") {
                    for want in ["field", "type", "kind", "default"] {
                        if !cells.iter().any(|c| c == want) {
                            return Err(err(format!(
                                "Cfg table of `{}` lacks a `{want}` column",
                                family.name
                            )));
                        }
                    }
                    columns = Some(cells);
                }
                continue;
            };
            let cell = |name: &str| {
                cols.iter()
                    .position(|c| c == name)
                    .and_then(|i| cells.get(i))
                    .map(String::as_str)
                    .unwrap_or("")
            };
            let field = cell("field").trim_matches('`').to_string();
            if field.is_empty()
                || !field
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
            {
                return Err(err(format!(
                    "`{}`: field `{field}` is not an UPPER_CASE Cfg member",
                    family.name
                )));
            }
            let ty = FieldType::parse(cell("type")).ok_or_else(|| {
                err(format!(
                    "`{}`.{field}: unknown type `{}`",
                    family.name,
                    cell("type")
                ))
            })?;
            let kind = match cell("kind") {
                "dim" => FieldKind::Dim,
                "enum" => FieldKind::Enum,
                "tune" => FieldKind::Tune,
                other => {
                    return Err(err(format!(
                        "`{}`.{field}: unknown kind `{other}` (dim, enum or tune)",
                        family.name
                    )));
                }
            };
            let default = match cell("default").trim_matches('`') {
                "" | "—" | "-" => None,
                d => Some(normalize_default(ty, d).ok_or_else(|| {
                    err(format!(
                        "`{}`.{field}: default `{d}` is not a {}",
                        family.name,
                        ty.cpp_type()
                    ))
                })?),
            };
            if kind == FieldKind::Dim && (ty != FieldType::Int || default.is_some()) {
                return Err(err(format!(
                    "`{}`.{field}: a dim is an int with no default",
                    family.name
                )));
            }
            family.fields.push(Field {
                name: field,
                ty,
                kind,
                default,
            });
        }
        Ok(Catalogue { families })
    }
}

/// README defaults are written as C++ enumerators (`BF16`) or integers; store them as tokens.
fn normalize_default(ty: FieldType, d: &str) -> Option<String> {
    match ty {
        FieldType::Int => d.parse::<i64>().ok().map(|v| v.to_string()),
        _ => {
            let last = d.rsplit("::").next().unwrap_or(d);
            ty.tokens()
                .into_iter()
                .find(|t| t.eq_ignore_ascii_case(last) || crate::spec::type_prefix(t) == last)
                .map(str::to_string)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const README: &str = "# t\n\nintro | not a table\n\n## rmsnorm\n\ntext\n\n| field | type | kind | default | meaning |\n|---|---|---|---|---|\n| N | int | dim | — | row length |\n| THREADS | int | tune | 256 | threads |\n\n## qk_norm_rope\n\n| field | type | kind | default | meaning |\n|---|---|---|---|---|\n| HEAD_DIM | int | dim | — | hd |\n| ROPE_MODE | memra::RopeMode | enum | — | mode |\n| CACHE_T | memra::CacheType | enum | BF16 | cache |\n\n## matvec\n\nOwned by someone (placeholder).\n";

    #[test]
    fn parses_fields_in_order_with_kinds_and_defaults() {
        let c = Catalogue::parse(Path::new("README.md"), README).unwrap();
        let names: Vec<_> = c.families.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["rmsnorm", "qk_norm_rope", "matvec"]);
        let r = c.family("rmsnorm").unwrap();
        assert_eq!(
            r.fields[0],
            Field {
                name: "N".into(),
                ty: FieldType::Int,
                kind: FieldKind::Dim,
                default: None
            }
        );
        assert_eq!(r.fields[1].default.as_deref(), Some("256"));
        let q = c.family("qk_norm_rope").unwrap();
        assert_eq!(
            q.fields.iter().map(|f| f.key()).collect::<Vec<_>>(),
            ["head_dim", "rope_mode", "cache_t"]
        );
        assert_eq!(q.field("cache_t").unwrap().default.as_deref(), Some("bf16"));
        assert!(
            c.family("matvec").unwrap().fields.is_empty(),
            "a placeholder section has no fields"
        );
    }

    #[test]
    fn bad_rows_are_reported_with_line_numbers() {
        let bad = README.replace("| THREADS | int | tune |", "| THREADS | int | knob |");
        let e = Catalogue::parse(Path::new("templates/README.md"), &bad)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("templates/README.md:12:"), "{e}");
        assert!(e.contains("unknown kind `knob`"), "{e}");
        let bad = README.replace("| N | int | dim | — |", "| N | float | dim | — |");
        assert!(
            Catalogue::parse(Path::new("r"), &bad)
                .unwrap_err()
                .0
                .contains("unknown type `float`")
        );
    }

    #[test]
    fn enum_tokens_render_as_cpp_enumerators() {
        assert_eq!(
            FieldType::QType.cpp("q4_k").as_deref(),
            Some("memra::QType::Q4_K")
        );
        assert_eq!(
            FieldType::QType.cpp("iq4_nl").as_deref(),
            Some("memra::QType::IQ4_NL")
        );
        assert_eq!(
            FieldType::RopeMode.cpp("neox").as_deref(),
            Some("memra::RopeMode::Neox")
        );
        assert_eq!(
            FieldType::QkNorm.cpp("per_head").as_deref(),
            Some("memra::QkNorm::PerHead")
        );
        assert_eq!(
            FieldType::CacheType.cpp("bf16").as_deref(),
            Some("memra::CacheType::BF16")
        );
        assert_eq!(
            FieldType::MoeMode.cpp("swiglu").as_deref(),
            Some("memra::MoeMode::Swiglu")
        );
        assert_eq!(
            FieldType::MoeMode.cpp("geglu").as_deref(),
            Some("memra::MoeMode::Geglu")
        );
        assert_eq!(
            FieldType::Gating.cpp("sigmoid").as_deref(),
            Some("memra::Gating::Sigmoid")
        );
        assert_eq!(FieldType::QType.cpp("q2_k"), None);
        assert_eq!(FieldType::QType.tokens().len(), 13);
    }
}
