//! A kernel variant (family + baked parameters) and THE naming function. The name is the
//! `.cu` file name, the `extern "C"` symbol, the cache-key prefix and the bench label.
//!
//! Name form (keys in the family's Cfg field order from `templates/README.md`):
//! - specialized: `<family>__<dims>[__<choices>]`, dims as `<key><value>` joined by `_`
//!   (`matvec__k6144_n2048__q4_k`, `rmsnorm__n6144`);
//! - generic: `<family>__generic[__<choices>]` (`matvec__generic__q4_k`, `rmsnorm__generic`).
//!
//! Choices are enum tokens (`q4_k`, `neox`, `per_head`, `bf16`) in field order, then integer
//! enum/tune fields as `<key><value>` only when they differ from the README default, so the
//! common case stays short and a non-default tuning still gets its own name.

use std::fmt;

use crate::families::FieldKind;

/// A baked parameter value; `Sym` holds an enum token (`q4_k`, `neox`, `bf16`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ParamVal {
    Int(i64),
    Sym(String),
}

impl fmt::Display for ParamVal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParamVal::Int(v) => write!(f, "{v}"),
            ParamVal::Sym(s) => f.write_str(s),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Param {
    /// Lower-case Cfg field name (`n_embd`).
    pub key: String,
    pub value: ParamVal,
    pub kind: FieldKind,
    /// README default of an integer enum/tune field; decides whether the name shows it.
    pub default: Option<ParamVal>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelVariant {
    pub family: String,
    /// Architectures whose specs asked for it, in request order; empty = generic.
    pub archs: Vec<String>,
    /// In the family's field order. Generic variants carry no dims.
    pub params: Vec<Param>,
    /// The dims a spec entry passes at run time (`at_run_time`): per distinct shape the variant
    /// was planned for, the architecture and those dims (`("glm-dsa", [("n", 2048)])`), in plan
    /// order; empty when every dim is baked. `memra bench` measures those shapes.
    pub served: Vec<(String, Vec<(String, i64)>)>,
}

impl KernelVariant {
    pub fn is_generic(&self) -> bool {
        self.archs.is_empty()
    }

    pub fn param(&self, key: &str) -> Option<&ParamVal> {
        self.params.iter().find(|p| p.key == key).map(|p| &p.value)
    }

    /// The variant name (see the module doc).
    pub fn name(&self) -> String {
        let mut dims = Vec::new();
        let mut choices = Vec::new();
        for p in &self.params {
            match (p.kind, &p.value) {
                (FieldKind::Dim, v) => dims.push(format!("{}{v}", p.key)),
                (_, ParamVal::Sym(s)) => choices.push(s.clone()),
                (_, v @ ParamVal::Int(_)) if p.default.as_ref() != Some(v) => {
                    choices.push(format!("{}{v}", p.key))
                }
                _ => {}
            }
        }
        let mut name = self.family.clone();
        if self.is_generic() {
            name.push_str("__generic");
        } else if !dims.is_empty() {
            name.push_str("__");
            name.push_str(&dims.join("_"));
        }
        if !choices.is_empty() {
            name.push_str("__");
            name.push_str(&choices.join("_"));
        }
        name
    }
}

impl fmt::Display for KernelVariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(key: &str, value: ParamVal, kind: FieldKind, default: Option<i64>) -> Param {
        Param {
            key: key.into(),
            value,
            kind,
            default: default.map(ParamVal::Int),
        }
    }

    fn matvec(k: i64, n: i64, q: &str, threads: i64) -> KernelVariant {
        KernelVariant {
            family: "matvec".into(),
            archs: vec!["glm-dsa".into()],
            params: vec![
                p("k", ParamVal::Int(k), FieldKind::Dim, None),
                p("n", ParamVal::Int(n), FieldKind::Dim, None),
                p("qtype", ParamVal::Sym(q.into()), FieldKind::Enum, None),
                p(
                    "threads",
                    ParamVal::Int(threads),
                    FieldKind::Tune,
                    Some(256),
                ),
            ],
            served: Vec::new(),
        }
    }

    #[test]
    fn specialized_names_follow_field_order() {
        assert_eq!(
            matvec(6144, 2048, "q4_k", 256).name(),
            "matvec__k6144_n2048__q4_k"
        );
        // Same dims in the other order is another shape, and another name.
        assert_eq!(
            matvec(2048, 6144, "q4_k", 256).name(),
            "matvec__k2048_n6144__q4_k"
        );
        let rms = KernelVariant {
            family: "rmsnorm".into(),
            archs: vec!["glm-dsa".into()],
            params: vec![
                p("n", ParamVal::Int(6144), FieldKind::Dim, None),
                p("threads", ParamVal::Int(256), FieldKind::Tune, Some(256)),
            ],
            served: Vec::new(),
        };
        assert_eq!(rms.name(), "rmsnorm__n6144");
        assert_eq!(rms.to_string(), rms.name());
    }

    #[test]
    fn non_default_tuning_shows_in_the_name() {
        assert_eq!(
            matvec(6144, 2048, "q8_0", 128).name(),
            "matvec__k6144_n2048__q8_0_threads128"
        );
    }

    #[test]
    fn generic_names_drop_dims_and_keep_choices() {
        let g = KernelVariant {
            family: "matvec".into(),
            archs: vec![],
            params: vec![
                p("qtype", ParamVal::Sym("q4_k".into()), FieldKind::Enum, None),
                p("threads", ParamVal::Int(256), FieldKind::Tune, Some(256)),
            ],
            served: Vec::new(),
        };
        assert_eq!(g.name(), "matvec__generic__q4_k");
        let r = KernelVariant {
            family: "rmsnorm".into(),
            archs: vec![],
            params: vec![p("threads", ParamVal::Int(256), FieldKind::Tune, Some(256))],
            served: Vec::new(),
        };
        assert_eq!(r.name(), "rmsnorm__generic");
        let a = KernelVariant {
            family: "add_rmsnorm".into(),
            archs: vec![],
            params: vec![p("delta_norm", ParamVal::Int(1), FieldKind::Enum, Some(0))],
            served: Vec::new(),
        };
        assert_eq!(a.name(), "add_rmsnorm__generic__delta_norm1");
    }

    #[test]
    fn names_are_stable_and_ignore_which_arch_asked() {
        let a = matvec(640, 1024, "q5_0", 256);
        let mut b = a.clone();
        b.archs = vec!["gemma3".into(), "qwen3".into()];
        assert_eq!(a.name(), b.name());
        assert_eq!(a.name(), matvec(640, 1024, "q5_0", 256).name());
    }
}
