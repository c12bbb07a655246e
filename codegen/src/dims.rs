//! Concrete model dims for one architecture: from a spec preset, or from the header of the
//! GGUF named by `MEMRA_MODEL`. Output: every hparam and derived value, and every tensor
//! instance (per layer) with its shape and ggml type. Errors name the spec line, GGUF key or
//! tensor involved; all problems are collected.

use std::fmt;
use std::path::PathBuf;

use memra_gguf::{GgmlType, Gguf};

use crate::expr::NameValue;
use crate::spec::{
    ArchSpec, HParam, HParamDefault, HParamSource, HParamType, LayerRange, TensorSpec, TypeChoice,
    Value,
};

/// Where the dims came from.
#[derive(Clone, Debug, PartialEq)]
pub enum Origin {
    Preset(String),
    Gguf(PathBuf),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Preset(p) => write!(f, "preset `{p}`"),
            Origin::Gguf(p) => write!(f, "GGUF {}", p.display()),
        }
    }
}

/// One tensor of the model: a spec entry at one layer (or the global one).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInstance {
    /// Index into `ArchSpec::tensors`.
    pub spec_index: usize,
    pub layer: Option<usize>,
    /// GGUF name, e.g. `blk.3.attn_q.weight`.
    pub name: String,
    pub shape: Vec<u64>,
    pub ggml_type: GgmlType,
}

/// Resolved dims of one model.
#[derive(Clone, Debug)]
pub struct ModelDims {
    pub arch: String,
    pub origin: Origin,
    /// hparams then derived values, in spec order.
    pub values: Vec<(String, Value)>,
    /// Present tensors, in spec order then layer order.
    pub tensors: Vec<TensorInstance>,
}

impl ModelDims {
    pub fn value(&self, name: &str) -> Option<Value> {
        self.values.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }

    pub fn int(&self, name: &str) -> Option<i64> {
        match self.value(name)? {
            Value::Int(i) => Some(i),
            _ => None,
        }
    }

    /// For expression evaluation.
    pub fn lookup(&self, name: &str) -> Option<NameValue> {
        self.value(name).map(|v| match v {
            Value::Int(i) => NameValue::Int(i),
            Value::Float(_) => NameValue::NotInteger("f32"),
            Value::Bool(_) => NameValue::NotInteger("bool"),
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInstance> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// Everything wrong with one resolution, one line each.
#[derive(Clone, Debug, PartialEq)]
pub struct DimsError {
    pub origin: String,
    pub problems: Vec<String>,
}

impl fmt::Display for DimsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} problem(s):", self.origin, self.problems.len())?;
        for p in &self.problems {
            write!(f, "\n  {p}")?;
        }
        Ok(())
    }
}

impl std::error::Error for DimsError {}

/// Dims of a named preset of `spec` (`None` = the spec's default preset).
pub fn from_preset(spec: &ArchSpec, preset: Option<&str>) -> Result<ModelDims, DimsError> {
    from_preset_with(spec, preset, &[])
}

/// A preset with some hparams replaced, for micro models in tests (`block_count = 2`,
/// `n_vocab = 512`). Per-layer type lists are cut to the (smaller) layer count.
pub fn from_preset_with(
    spec: &ArchSpec,
    preset: Option<&str>,
    overrides: &[(&str, Value)],
) -> Result<ModelDims, DimsError> {
    let name = preset.unwrap_or(&spec.default_preset);
    let origin = Origin::Preset(name.to_string());
    let mut problems = Vec::new();
    for (n, _) in overrides {
        if spec.hparam(n).is_none() {
            problems.push(format!(
                "override `{n}` is not an hparam of {}",
                spec.loc.file.display()
            ));
        }
    }
    let Some(preset) = spec.preset(name) else {
        let known: Vec<_> = spec.presets.iter().map(|p| p.name.as_str()).collect();
        problems.push(format!(
            "{}: no preset `{name}` (presets: {})",
            spec.loc,
            known.join(", ")
        ));
        return Err(DimsError {
            origin: origin.to_string(),
            problems,
        });
    };
    let mut values: Vec<(String, Value)> = Vec::new();
    for h in &spec.hparams {
        let given = overrides
            .iter()
            .find(|(n, _)| *n == h.name)
            .map(|(_, v)| *v)
            .or_else(|| {
                preset
                    .hparams
                    .iter()
                    .find(|(n, _, _)| n == &h.name)
                    .map(|(_, v, _)| *v)
            });
        let got = match given {
            Some(v) => Ok(v),
            None => default_value(h, &values).unwrap_or_else(|| {
                Err(format!(
                    "{}: preset `{name}` lacks `{}`",
                    preset.loc, h.name
                ))
            }),
        };
        match got {
            Ok(v) => values.push((h.name.clone(), normalize(h.ty, v))),
            Err(p) => problems.push(p),
        }
    }
    let mut dims = ModelDims {
        arch: spec.arch.clone(),
        origin,
        values,
        tensors: Vec::new(),
    };
    if problems.is_empty() {
        derive(spec, &mut dims, &mut problems);
    }
    if problems.is_empty() {
        for (i, t) in spec.tensors.iter().enumerate() {
            if preset.absent.contains(&t.name) {
                continue;
            }
            let choice = preset.types.iter().find(|(f, _, _)| f == &t.field);
            let Some(layers) = layers_of(t, &dims, &mut problems) else {
                continue;
            };
            let Some(shape) = eval_shape(t, &dims, &mut problems) else {
                continue;
            };
            for (pos, layer) in layers.iter().enumerate() {
                let name = t.gguf_name(layer.unwrap_or(0));
                let ty = match choice {
                    Some((_, TypeChoice::All(ty), _)) => *ty,
                    Some((_, TypeChoice::PerLayer(list), loc)) => match list.get(pos) {
                        Some(ty)
                            if list.len() == layers.len()
                                || (!overrides.is_empty() && list.len() > layers.len()) =>
                        {
                            *ty
                        }
                        _ => {
                            problems.push(format!(
                                "{loc}: {} types listed but `{}` has {} layer(s)",
                                list.len(),
                                t.name,
                                layers.len()
                            ));
                            break;
                        }
                    },
                    // The converter keeps 1-D tensors (norms, biases) in F32.
                    None if shape.len() == 1 => GgmlType::F32,
                    None => preset.default_type,
                };
                if ty.row_bytes(shape[0]).is_none() {
                    problems.push(format!(
                        "{}: `{name}` is {ty} but its row length ne0 = {} is not a multiple of {ty}'s block size {}",
                        choice.map(|c| &c.2).unwrap_or(&preset.loc),
                        shape[0],
                        ty.block_size()
                    ));
                }
                dims.tensors.push(TensorInstance {
                    spec_index: i,
                    layer: *layer,
                    name,
                    shape: shape.clone(),
                    ggml_type: ty,
                });
            }
        }
    }
    if problems.is_empty() {
        Ok(dims)
    } else {
        Err(DimsError {
            origin: dims.origin.to_string(),
            problems,
        })
    }
}

/// Dims read from a GGUF header: hparams from metadata (defaults applied), tensors from the
/// tensor infos, checked against the spec's shapes.
pub fn from_gguf<B: AsRef<[u8]>>(spec: &ArchSpec, file: &Gguf<B>) -> Result<ModelDims, DimsError> {
    let origin = match file.path() {
        Some(p) => Origin::Gguf(p.to_path_buf()),
        None => Origin::Gguf(PathBuf::from("<memory>")),
    };
    let mut problems = Vec::new();
    match file.architecture() {
        Ok(a) if a == spec.arch => {}
        Ok(a) => problems.push(format!(
            "general.architecture is `{a}`, but {} describes `{}`",
            spec.loc.file.display(),
            spec.arch
        )),
        Err(e) => problems.push(e.to_string()),
    }
    if !problems.is_empty() {
        return Err(DimsError {
            origin: origin.to_string(),
            problems,
        });
    }
    let mut values = Vec::new();
    for h in &spec.hparams {
        let got = match &h.from {
            HParamSource::Key(suffix) => {
                let key = format!("{}.{suffix}", spec.arch);
                match file.get(&key) {
                    None => default_value(h, &values).unwrap_or_else(|| {
                        Err(format!(
                            "metadata key '{key}' is missing (hparam `{}`, {})",
                            h.name, h.loc
                        ))
                    }),
                    Some(v) => {
                        let conv = match h.ty {
                            HParamType::U32 => v
                                .as_integer()
                                .filter(|i| (0..=u32::MAX as i128).contains(i))
                                .map(|i| Value::Int(i as i64)),
                            HParamType::F32 => v.as_f64().map(Value::Float),
                            HParamType::Bool => v.as_bool().map(Value::Bool),
                        };
                        conv.ok_or_else(|| {
                            format!(
                                "metadata key '{key}' = {v} ({}) is not a {} (hparam `{}`, {})",
                                v.type_description(),
                                h.ty.name(),
                                h.name,
                                h.loc
                            )
                        })
                    }
                }
            }
            HParamSource::TensorDim { tensor, dim } => match file.tensor(tensor) {
                Some(t) => match t.dims.get(*dim) {
                    Some(&d) if d <= u32::MAX as u64 => Ok(Value::Int(d as i64)),
                    _ => Err(format!(
                        "tensor '{tensor}' has dims {:?}; hparam `{}` needs ne{dim} ({})",
                        t.dims, h.name, h.loc
                    )),
                },
                None => Err(format!(
                    "tensor '{tensor}' is missing (hparam `{}` reads its ne{dim}, {})",
                    h.name, h.loc
                )),
            },
        };
        match got {
            Ok(v) => values.push((h.name.clone(), normalize(h.ty, v))),
            Err(p) => problems.push(p),
        }
    }
    let mut dims = ModelDims {
        arch: spec.arch.clone(),
        origin,
        values,
        tensors: Vec::new(),
    };
    if problems.is_empty() {
        derive(spec, &mut dims, &mut problems);
    }
    if problems.is_empty() {
        for (i, t) in spec.tensors.iter().enumerate() {
            let Some(layers) = layers_of(t, &dims, &mut problems) else {
                continue;
            };
            let Some(shape) = eval_shape(t, &dims, &mut problems) else {
                continue;
            };
            for layer in layers {
                let name = t.gguf_name(layer.unwrap_or(0));
                match file.tensor(&name) {
                    None if t.optional => {}
                    None => problems.push(format!("tensor '{name}' is missing ({})", t.loc)),
                    Some(info) if info.dims != shape => problems.push(format!(
                        "tensor '{name}' has shape {:?}, expected {:?} = [{}] ({})",
                        info.dims,
                        shape,
                        shape_text(t),
                        t.loc
                    )),
                    Some(info) => dims.tensors.push(TensorInstance {
                        spec_index: i,
                        layer,
                        name,
                        shape: shape.clone(),
                        ggml_type: info.ggml_type,
                    }),
                }
            }
        }
    }
    if problems.is_empty() {
        Ok(dims)
    } else {
        Err(DimsError {
            origin: dims.origin.to_string(),
            problems,
        })
    }
}

/// The default of `h` given the hparams resolved so far; `None` if it has none.
fn default_value(h: &HParam, earlier: &[(String, Value)]) -> Option<Result<Value, String>> {
    match h.default.as_ref()? {
        HParamDefault::Value(v) => Some(Ok(*v)),
        HParamDefault::Expr(e) => {
            let lookup = |n: &str| {
                earlier.iter().find(|(k, _)| k == n).map(|(_, v)| match v {
                    Value::Int(i) => NameValue::Int(*i),
                    Value::Float(_) => NameValue::NotInteger("f32"),
                    Value::Bool(_) => NameValue::NotInteger("bool"),
                })
            };
            Some(
                e.eval(&lookup)
                    .map(Value::Int)
                    .map_err(|err| format!("{}: default of `{}`: {err}", h.loc, h.name)),
            )
        }
    }
}

fn normalize(ty: HParamType, v: Value) -> Value {
    match (ty, v) {
        (HParamType::F32, Value::Int(i)) => Value::Float(i as f64),
        // Store f32 hparams at f32 precision, as the file and the engine see them.
        (HParamType::F32, Value::Float(f)) => Value::Float(f as f32 as f64),
        _ => v,
    }
}

fn derive(spec: &ArchSpec, dims: &mut ModelDims, problems: &mut Vec<String>) {
    for d in &spec.derived {
        match d.expr.eval(&|n| dims.lookup(n)) {
            Ok(v) if v >= 0 => dims.values.push((d.name.clone(), Value::Int(v))),
            Ok(v) => problems.push(format!(
                "{}: {} = `{}` evaluates to {v}, which is negative",
                d.loc, d.name, d.expr
            )),
            Err(e) => problems.push(format!("{}: {e}", d.loc)),
        }
    }
}

/// Evaluates a layer range to its indices.
pub fn eval_range(r: &LayerRange, dims: &ModelDims) -> Result<std::ops::Range<usize>, String> {
    let a = r
        .start
        .eval(&|n| dims.lookup(n))
        .map_err(|e| e.to_string())?;
    let b = r.end.eval(&|n| dims.lookup(n)).map_err(|e| e.to_string())?;
    if a < 0 || b < a {
        return Err(format!(
            "layer range `{}` evaluates to {a}..{b}, which is not a valid range",
            r.text
        ));
    }
    Ok(a as usize..b as usize)
}

/// `[None]` for a global tensor, `[Some(i), ...]` for a per-layer one.
fn layers_of(
    t: &TensorSpec,
    dims: &ModelDims,
    problems: &mut Vec<String>,
) -> Option<Vec<Option<usize>>> {
    match &t.layers {
        None => Some(vec![None]),
        Some(r) => match eval_range(r, dims) {
            Ok(range) => {
                let n_layer = dims.int("n_layer").unwrap_or(0) as usize;
                if range.end > n_layer {
                    problems.push(format!(
                        "{}: layer range `{}` = {range:?} goes past n_layer = {n_layer}",
                        t.loc, r.text
                    ));
                    return None;
                }
                Some(range.map(Some).collect())
            }
            Err(e) => {
                problems.push(format!("{}: {e}", t.loc));
                None
            }
        },
    }
}

fn eval_shape(t: &TensorSpec, dims: &ModelDims, problems: &mut Vec<String>) -> Option<Vec<u64>> {
    let mut out = Vec::new();
    for e in &t.shape {
        match e.eval(&|n| dims.lookup(n)) {
            Ok(v) if v > 0 => out.push(v as u64),
            Ok(v) => {
                problems.push(format!(
                    "{}: expression `{e}` of `{}` evaluates to {v}; dimensions must be positive",
                    t.loc, t.name
                ));
                return None;
            }
            Err(err) => {
                problems.push(format!("{}: {err}", t.loc));
                return None;
            }
        }
    }
    Some(out)
}

fn shape_text(t: &TensorSpec) -> String {
    t.shape
        .iter()
        .map(|e| e.text().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
