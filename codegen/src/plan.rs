//! Planning: spec `[[kernels]]` + resolved model dims + the family catalogue -> the list of
//! kernel variants to emit. Specialized variants bake dims; generic variants (every family,
//! every enum value) leave dims to run time so each specialization has a generic twin.

use std::fmt;
use std::ops::Range;

use memra_gguf::GgmlType;
use memra_gguf::quant::common_lossless_type;

use crate::dims::{ModelDims, TensorInstance};
use crate::expr::NameValue;
use crate::families::{Catalogue, Family, FieldKind, FieldType, QTYPES, has_int_path, qtype_token};
use crate::source::Loc;
use crate::spec::{
    ArchSpec, KernelParam, KernelSpec, LM_HEAD, ParamValue, Router, TiedEmbeddings,
};
use crate::variant::{KernelVariant, Param, ParamVal};

/// What planning one architecture produced.
#[derive(Clone, Debug, Default)]
pub struct ArchPlan {
    pub variants: Vec<KernelVariant>,
    /// Entries marked `pending` (documented needs without a template yet).
    pub notes: Vec<String>,
    /// Entries whose family has no Cfg table yet in templates/README.md.
    pub warnings: Vec<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct PlanError(pub Vec<String>);

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join("\n"))
    }
}

impl std::error::Error for PlanError {}

/// Plans the specialized variants of one architecture.
pub fn plan_arch(
    spec: &ArchSpec,
    dims: &ModelDims,
    catalogue: &Catalogue,
) -> Result<ArchPlan, PlanError> {
    let mut plan = ArchPlan::default();
    let mut errors = Vec::new();
    let dims = &stored_types(spec, dims, &mut errors);
    for k in &spec.kernels {
        let fam_loc = Loc {
            key: format!("{}.family", k.loc.key),
            ..k.loc.clone()
        };
        if let Some(why) = &k.pending {
            plan.notes.push(format!(
                "{}: `{}` planned nothing: pending ({why})",
                k.loc, k.family
            ));
            continue;
        }
        let Some(family) = catalogue.family(&k.family) else {
            let known: Vec<_> = catalogue.families.iter().map(|f| f.name.as_str()).collect();
            errors.push(format!("{fam_loc}: unknown kernel family `{}` (templates/README.md has: {}); mark the entry `pending = \"why\"` if its template is still to be written", k.family, known.join(", ")));
            continue;
        };
        if family.fields.is_empty() {
            plan.warnings.push(format!(
                "{}: `{}` planned nothing: templates/README.md has no Cfg table for it yet",
                k.loc, k.family
            ));
            continue;
        }
        for p in &k.params {
            if family.field(&p.key).is_none() {
                let keys: Vec<_> = family.fields.iter().map(|f| f.key()).collect();
                errors.push(format!(
                    "{}: `{}` has no Cfg field `{}` (fields: {})",
                    p.loc,
                    k.family,
                    p.key,
                    keys.join(", ")
                ));
            }
        }
        for (key, loc) in &k.at_run_time {
            match family.field(key) {
                Some(f) if f.kind == FieldKind::Dim => {
                    if !k.params.iter().any(|p| &p.key == key) {
                        errors.push(format!("{loc}: `{key}` is passed at run time but has no value in the entry (give it, e.g. `{key} = \"ne1\"`: it is still checked and names the shapes served)"));
                    }
                }
                Some(_) => errors.push(format!("{loc}: `{key}` of `{}` is not a dim; only dims can be passed at run time", k.family)),
                None => {
                    let dims: Vec<_> = family.fields.iter().filter(|f| f.kind == FieldKind::Dim).map(|f| f.key()).collect();
                    errors.push(format!("{loc}: `{}` has no dim `{key}` (dims: {})", k.family, dims.join(", ")));
                }
            }
        }
        if !k.at_run_time.is_empty()
            && family.fields.iter().filter(|f| f.kind == FieldKind::Dim).all(|f| k.at_run_time.iter().any(|(r, _)| *r == f.key()))
        {
            errors.push(format!("{}: `at_run_time` leaves no dim of `{}` baked: its generic twin already serves every shape", k.loc, k.family));
        }
        let instances = scopes(spec, dims, k, &mut errors);
        for scope in instances.iter().map(Option::as_ref) {
            match bake(spec, dims, k, family, scope) {
                Ok(v) => push_unique(&mut plan.variants, v),
                Err(e) => {
                    if !errors.contains(&e) {
                        errors.push(e)
                    }
                }
            }
        }
    }
    if errors.is_empty() {
        Ok(plan)
    } else {
        Err(PlanError(errors))
    }
}

/// Adds `v` unless a variant of the same name exists, in which case its archs and served
/// shapes are merged.
pub fn push_unique(list: &mut Vec<KernelVariant>, v: KernelVariant) {
    let name = v.name();
    match list.iter_mut().find(|x| x.name() == name) {
        Some(existing) => {
            for a in v.archs {
                if !existing.archs.contains(&a) {
                    existing.archs.push(a);
                }
            }
            for s in v.served {
                if !existing.served.contains(&s) {
                    existing.served.push(s);
                }
            }
        }
        None => list.push(v),
    }
}

/// The tensor a per-tensor entry is baked for, if any.
type Scope<'a> = Option<&'a TensorInstance>;

/// Runs of consecutive matrices that stack into one (`stack = true`), each with the type its
/// rows are stored in: equal row length and equal type, or with `widen` a type every part is
/// exact in ([`common_lossless_type`]: Q4_0 / Q5_0 → Q8_0). `parts` are (type, row length) in
/// order; each run is a range of indices into them. The engine stacks (and re-encodes) a layer's
/// weights by the same rule, so the planned shapes and types are the ones it launches.
pub fn stack_runs(parts: &[(GgmlType, u64)], widen: bool) -> Vec<(Range<usize>, GgmlType)> {
    let mut runs: Vec<(Range<usize>, GgmlType)> = Vec::new();
    for (i, &(ty, k)) in parts.iter().enumerate() {
        if let Some((run, run_ty)) = runs.last_mut()
            && parts[run.start].1 == k
        {
            let common = if widen { common_lossless_type(*run_ty, ty) } else { (*run_ty == ty).then_some(ty) };
            if let Some(common) = common {
                run.end = i + 1;
                *run_ty = common;
                continue;
            }
        }
        runs.push((i..i + 1, ty));
    }
    runs
}

/// The tensors a per-tensor entry is baked for (owned: a stacked entry's are made up, the
/// rows of a run of its tensors).
fn scopes(
    spec: &ArchSpec,
    dims: &ModelDims,
    k: &KernelSpec,
    errors: &mut Vec<String>,
) -> Vec<Option<TensorInstance>> {
    if k.tensors.is_empty() {
        return vec![None];
    }
    if k.stack {
        return stacked(spec, dims, k, errors).into_iter().map(Some).collect();
    }
    let mut out = Vec::new();
    for (name, loc) in &k.tensors {
        let name = if name == LM_HEAD {
            lm_head(spec, dims)
        } else {
            name.as_str()
        };
        let Some(index) = spec.tensors.iter().position(|t| t.name == name) else {
            errors.push(format!("{loc}: `{name}` is not in [tensors]"));
            continue;
        };
        out.extend(
            dims.tensors
                .iter()
                .filter(|t| t.spec_index == index)
                .cloned()
                .map(Some),
        );
    }
    out
}

/// Per layer, the indices into `dims.tensors` of a stacked entry's tensors present in it, in the
/// entry's order.
fn stacked_parts(spec: &ArchSpec, dims: &ModelDims, k: &KernelSpec, errors: &mut Vec<String>) -> Vec<Vec<usize>> {
    let mut indices = Vec::new();
    for (name, loc) in &k.tensors {
        match spec.tensors.iter().position(|t| t.name == *name) {
            Some(i) => indices.push(i),
            None => {
                let e = format!("{loc}: `{name}` is not in [tensors]");
                if !errors.contains(&e) {
                    errors.push(e);
                }
            }
        }
    }
    let mut layers: Vec<usize> = dims.tensors.iter().filter(|t| indices.contains(&t.spec_index)).filter_map(|t| t.layer).collect();
    layers.sort_unstable();
    layers.dedup();
    layers
        .into_iter()
        .map(|layer| indices.iter().filter_map(|&i| dims.tensors.iter().position(|t| t.spec_index == i && t.layer == Some(layer))).collect())
        .collect()
}

/// `dims` with the tensors of every `widen = true` stacked entry in the type their run is stored
/// in ([`stack_runs`]; the engine re-encodes them at load), so every entry plans for the types
/// the kernels read.
fn stored_types(spec: &ArchSpec, dims: &ModelDims, errors: &mut Vec<String>) -> ModelDims {
    let mut out = dims.clone();
    for k in spec.kernels.iter().filter(|k| k.stack && k.widen && k.pending.is_none()) {
        for parts in stacked_parts(spec, dims, k, errors) {
            let keys: Vec<_> = parts.iter().map(|&p| (dims.tensors[p].ggml_type, dims.tensors[p].shape[0])).collect();
            for (run, ty) in stack_runs(&keys, true) {
                for &p in &parts[run] {
                    out.tensors[p].ggml_type = ty;
                }
            }
        }
    }
    out
}

/// Per layer, the listed tensors present in it, stacked by [`stack_runs`] (in their stored
/// types: [`stored_types`] has applied any widening): shape `[ne0, Σ rows]`, named `a+b+…`.
fn stacked(spec: &ArchSpec, dims: &ModelDims, k: &KernelSpec, errors: &mut Vec<String>) -> Vec<TensorInstance> {
    let mut out = Vec::new();
    for parts in stacked_parts(spec, dims, k, errors) {
        let parts: Vec<&TensorInstance> = parts.iter().map(|&p| &dims.tensors[p]).collect();
        let keys: Vec<_> = parts.iter().map(|t| (t.ggml_type, t.shape[0])).collect();
        for (run, ty) in stack_runs(&keys, false) {
            let run = &parts[run];
            let rows: u64 = run.iter().map(|t| t.shape[1..].iter().product::<u64>()).sum();
            out.push(TensorInstance {
                spec_index: run[0].spec_index,
                layer: run[0].layer,
                name: run.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join("+"),
                shape: vec![run[0].shape[0], rows],
                ggml_type: ty,
            });
        }
    }
    out
}

/// The LM head: `output.weight`, or the embedding when the model ties them.
fn lm_head<'a>(spec: &ArchSpec, dims: &ModelDims) -> &'a str {
    match spec.caps.tied_embeddings {
        TiedEmbeddings::Always => "token_embd.weight",
        TiedEmbeddings::Never => "output.weight",
        TiedEmbeddings::Optional if dims.tensor("output.weight").is_some() => "output.weight",
        TiedEmbeddings::Optional => "token_embd.weight",
    }
}

fn bake(
    spec: &ArchSpec,
    dims: &ModelDims,
    k: &KernelSpec,
    family: &Family,
    scope: Scope<'_>,
) -> Result<KernelVariant, String> {
    let lookup = |n: &str| -> Option<NameValue> {
        if let (Some(t), Some(i)) = (
            scope,
            n.strip_prefix("ne").and_then(|d| d.parse::<usize>().ok()),
        ) {
            return t.shape.get(i).map(|&d| NameValue::Int(d as i64));
        }
        dims.lookup(n)
    };
    let at = |p: Option<&KernelParam>| {
        p.map(|p| p.loc.to_string())
            .unwrap_or_else(|| k.loc.to_string())
    };
    let for_tensor = scope
        .map(|t| format!(" (for `{}`)", t.name))
        .unwrap_or_default();
    let mut params = Vec::new();
    let mut run_time = Vec::new();
    for f in &family.fields {
        let key = f.key();
        let given = k.params.iter().find(|p| p.key == key);
        let value = match (f.ty, given.map(|p| &p.value)) {
            (FieldType::Int, Some(ParamValue::Expr(e))) => {
                let v = e
                    .eval(&lookup)
                    .map_err(|e| format!("{}: {e}{for_tensor}", at(given)))?;
                if f.kind == FieldKind::Dim && v <= 0 {
                    return Err(format!(
                        "{}: dim `{key}` = `{e}` evaluates to {v}{for_tensor}; dims must be positive (0 means generic)",
                        at(given)
                    ));
                }
                ParamVal::Int(v)
            }
            (FieldType::Int, Some(ParamValue::Bool(b))) if f.kind != FieldKind::Dim => {
                ParamVal::Int(*b as i64)
            }
            (FieldType::Int, Some(other)) => {
                let shown = match other {
                    ParamValue::Sym(s) => format!("`{s}`"),
                    _ => "a boolean".into(),
                };
                return Err(format!(
                    "{}: `{key}` of `{}` is an int {}, not {shown}",
                    at(given),
                    k.family,
                    kind_word(f.kind)
                ));
            }
            (ty, Some(ParamValue::Sym(s))) => ParamVal::Sym(
                symbol(ty, s, scope).map_err(|e| format!("{}: `{key}`: {e}", at(given)))?,
            ),
            (ty, Some(_)) => {
                return Err(format!(
                    "{}: `{key}` takes one of: {}",
                    at(given),
                    ty.tokens().join(", ")
                ));
            }
            (ty, None) => match auto_value(spec, ty, scope) {
                Some(tok) => {
                    ParamVal::Sym(tok.map_err(|e| format!("{}: `{key}`: {e}{for_tensor}", k.loc))?)
                }
                None => match &f.default {
                    Some(d) if ty == FieldType::Int => {
                        ParamVal::Int(d.parse().expect("catalogue normalizes int defaults"))
                    }
                    Some(d) => ParamVal::Sym(d.clone()),
                    None => {
                        return Err(format!(
                            "{}: `{}` needs `{key}` ({} {}, no default in templates/README.md)",
                            k.loc,
                            k.family,
                            ty.cpp_type(),
                            kind_word(f.kind)
                        ));
                    }
                },
            },
        };
        let default = match (&f.default, f.ty) {
            (Some(d), FieldType::Int) => d.parse().ok().map(ParamVal::Int),
            _ => None,
        };
        if f.kind == FieldKind::Dim
            && let ParamVal::Int(v) = value
            && k.at_run_time.iter().any(|(r, _)| *r == key)
        {
            run_time.push((key, v));
            continue;
        }
        params.push(Param {
            key,
            value,
            kind: f.kind,
            default,
        });
    }
    without_xq8_where_off(&mut params, k.xq8_types.as_deref());
    Ok(KernelVariant {
        family: family.name.clone(),
        archs: vec![spec.arch.clone()],
        params,
        served: if run_time.is_empty() { Vec::new() } else { vec![(spec.arch.clone(), run_time)] },
    })
}

/// A kernel entry's tuning covers all its tensors, whatever their type; the integer path (`xq8`,
/// or its tuning spelling `fuse_x`) exists only for [`crate::families::INT_DOT_QTYPES`], so a variant of another
/// type keeps the f32 path (its kernel would trap, the engine refuse it at launch). An entry's
/// `xq8_types` (when given) narrows the path further to the listed types.
fn without_xq8_where_off(params: &mut [Param], xq8_types: Option<&[(String, Loc)]>) {
    let on = match params.iter().find(|p| p.key == "qtype").map(|p| &p.value) {
        Some(ParamVal::Sym(q)) => has_int_path(q) && xq8_types.is_none_or(|types| types.iter().any(|(t, _)| t == q)),
        _ => return,
    };
    for p in params.iter_mut().filter(|p| !on && (p.key == "xq8" || p.key == "fuse_x")) {
        p.value = ParamVal::Int(0);
    }
}

fn kind_word(kind: FieldKind) -> &'static str {
    match kind {
        FieldKind::Dim => "dim",
        FieldKind::Enum => "enum",
        FieldKind::Tune => "tuning constant",
    }
}

/// Enum values a spec need not write: RoPE, QK-norm and MoE gating come from the
/// capabilities, a per-tensor kernel's QType from the tensor.
fn auto_value(spec: &ArchSpec, ty: FieldType, scope: Scope<'_>) -> Option<Result<String, String>> {
    match ty {
        FieldType::RopeMode => Some(Ok(spec.caps.rope.token().to_string())),
        FieldType::QkNorm => Some(Ok(spec.caps.qk_norm.token().to_string())),
        FieldType::Gating => match spec.caps.router {
            Router::Softmax => Some(Ok("softmax".to_string())),
            Router::SigmoidBias => Some(Ok("sigmoid".to_string())),
            Router::None => None,
        },
        FieldType::QType => scope.map(|_| symbol(ty, "type", scope)),
        _ => None,
    }
}

fn symbol(ty: FieldType, s: &str, scope: Scope<'_>) -> Result<String, String> {
    let token = if s == "type" {
        let Some(t) = scope else {
            return Err("`type` needs a `tensors` list".into());
        };
        if !QTYPES.contains(&t.ggml_type) {
            return Err(format!(
                "tensor `{}` is {}, which memra::QType does not support",
                t.name, t.ggml_type
            ));
        }
        qtype_token(t.ggml_type).to_string()
    } else {
        s.to_ascii_lowercase()
    };
    if ty.tokens().contains(&token.as_str()) {
        Ok(token)
    } else {
        Err(format!(
            "`{s}` is not a {}; expected one of: {}",
            ty.cpp_type(),
            ty.tokens().join(", ")
        ))
    }
}

/// Generic variants: every family with a Cfg table, every value of its typed enum fields;
/// integer enum fields take their default plus every value a specialized variant uses.
pub fn plan_generic(
    catalogue: &Catalogue,
    specialized: &[KernelVariant],
) -> (Vec<KernelVariant>, Vec<String>) {
    let mut out = Vec::new();
    let mut notes = Vec::new();
    for fam in &catalogue.families {
        if fam.fields.is_empty() {
            notes.push(format!(
                "templates/README.md: `{}` has no Cfg table yet; no generic variants",
                fam.name
            ));
            continue;
        }
        let mut combos: Vec<Vec<Param>> = vec![Vec::new()];
        let mut ok = true;
        for f in fam.fields.iter().filter(|f| f.kind != FieldKind::Dim) {
            let key = f.key();
            let mut values: Vec<ParamVal> = match f.ty {
                FieldType::Int => f
                    .default
                    .iter()
                    .filter_map(|d| d.parse().ok())
                    .map(ParamVal::Int)
                    .collect(),
                ty => ty
                    .tokens()
                    .into_iter()
                    .map(|t| ParamVal::Sym(t.to_string()))
                    .collect(),
            };
            if f.ty == FieldType::Int && f.kind == FieldKind::Enum {
                for v in specialized.iter().filter(|v| v.family == fam.name) {
                    if let Some(x) = v.param(&key)
                        && !values.contains(x) {
                            values.push(x.clone());
                        }
                }
                values.sort();
            }
            if values.is_empty() {
                notes.push(format!(
                    "templates/README.md: `{}`.{} has no default; no generic variants",
                    fam.name, f.name
                ));
                ok = false;
                break;
            }
            let default = match (&f.default, f.ty) {
                (Some(d), FieldType::Int) => d.parse().ok().map(ParamVal::Int),
                _ => None,
            };
            let mut next = Vec::new();
            for c in &combos {
                for v in &values {
                    let mut c = c.clone();
                    c.push(Param {
                        key: key.clone(),
                        value: v.clone(),
                        kind: f.kind,
                        default: default.clone(),
                    });
                    next.push(c);
                }
            }
            combos = next;
        }
        if ok {
            // A specialized variant with a non-default tuning (e.g. a one-warp topk) gets a
            // generic twin with the same tuning, so "specialized vs generic" compares baked dims
            // alone.
            let twins = specialized.iter().filter(|v| v.family == fam.name).map(|v| {
                v.params
                    .iter()
                    .filter(|p| p.kind != FieldKind::Dim)
                    .cloned()
                    .collect::<Vec<Param>>()
            });
            for mut params in combos.into_iter().chain(twins) {
                without_xq8_where_off(&mut params, None);
                push_unique(
                    &mut out,
                    KernelVariant {
                        family: fam.name.clone(),
                        archs: Vec::new(),
                        params,
                        served: Vec::new(),
                    },
                );
            }
        }
    }
    (out, notes)
}
