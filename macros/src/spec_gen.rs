//! Token generation for `arch!`: from a validated `ArchSpec`, the marker type with the
//! capabilities, the typed hparams struct with `from_gguf`, the weight structs (generic over
//! the tensor handle) with a loader that collects every missing or mis-shaped tensor, and the
//! error type. Names follow the spec: `glm-dsa` -> `GlmDsa`, `GlmDsaHparams`, ...

use std::path::Path;

use memra_codegen::expr::{Expr, Node, Op};
use memra_codegen::spec::{
    ArchSpec, HParam, HParamDefault, HParamSource, HParamType, TensorSpec, Value,
};
use proc_macro2::{Literal, Span, TokenStream};
use quote::{format_ident, quote};
use syn::Ident;

struct Names {
    marker: Ident,
    hparams: Ident,
    layer: Ident,
    global: Ident,
    weights: Ident,
    error: Ident,
}

pub fn generate(spec: &ArchSpec, spec_path: &Path, span: Span) -> TokenStream {
    let prefix = spec.type_prefix();
    let n = Names {
        marker: Ident::new(&prefix, span),
        hparams: format_ident!("{prefix}Hparams", span = span),
        layer: format_ident!("{prefix}LayerWeights", span = span),
        global: format_ident!("{prefix}GlobalWeights", span = span),
        weights: format_ident!("{prefix}Weights", span = span),
        error: format_ident!("{prefix}LoadError", span = span),
    };
    let marker = gen_marker(spec, spec_path, &n);
    let error = gen_error(spec, &n);
    let hparams = gen_hparams(spec, &n, span);
    let weights = gen_weights(spec, &n, span);
    quote! { #marker #error #hparams #weights }
}

fn ident(name: &str, span: Span) -> Ident {
    Ident::new(name, span)
}

fn file_name(spec: &ArchSpec) -> String {
    format!("specs/{}.toml", spec.arch)
}

/// Expands to `pub struct GlmDsa;` with `ARCH`, `SPEC` (an `include_str!` of the spec, so editing
/// it rebuilds the crate) and one constant per capability.
fn gen_marker(spec: &ArchSpec, spec_path: &Path, n: &Names) -> TokenStream {
    let Names { marker, .. } = n;
    let arch = &spec.arch;
    let path = spec_path.display().to_string();
    let c = &spec.caps;
    let (attention, qk_norm, rope, ffn, norm, router, tied, scale) = (
        c.attention.token(),
        c.qk_norm.token(),
        c.rope.token(),
        c.ffn.token(),
        c.norm.token(),
        c.router.token(),
        c.tied_embeddings.token(),
        c.embedding_scale.token(),
    );
    let shared = c.shared_expert;
    let widen = spec.kernels.iter().any(|k| k.stack && k.widen && k.pending.is_none());
    let pattern = c
        .sliding_window
        .as_ref()
        .map(|s| s.pattern as u32)
        .unwrap_or(0);
    let doc = format!(
        "The `{arch}` architecture as `{}` describes it (capabilities are spec fields).",
        file_name(spec)
    );
    quote! {
        #[doc = #doc]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct #marker;

        impl #marker {
            /// GGUF `general.architecture`.
            pub const ARCH: &'static str = #arch;
            /// The spec text; `include_str!` makes cargo rebuild when the spec changes.
            pub const SPEC: &'static str = include_str!(#path);
            /// `gqa`, `mla` or `mla_dsa`.
            pub const ATTENTION: &'static str = #attention;
            /// `per_head`, `full` or `none`.
            pub const QK_NORM: &'static str = #qk_norm;
            /// `neox` or `interleaved`.
            pub const ROPE: &'static str = #rope;
            /// `swiglu`, `geglu` or `moe`.
            pub const FFN: &'static str = #ffn;
            /// `pre` or `sandwich`.
            pub const NORM: &'static str = #norm;
            /// `none`, `softmax` or `sigmoid_bias`.
            pub const ROUTER: &'static str = #router;
            /// `never`, `always` or `optional`.
            pub const TIED_EMBEDDINGS: &'static str = #tied;
            /// `none` or `sqrt_n_embd`.
            pub const EMBEDDING_SCALE: &'static str = #scale;
            pub const SHARED_EXPERT: bool = #shared;
            /// Every `SLIDING_WINDOW_PATTERN`-th layer is global, the others windowed; 0 = none.
            pub const SLIDING_WINDOW_PATTERN: u32 = #pattern;
            /// A stacked `[[kernels]]` entry has `widen = true`: neighbours whose types differ
            /// stack in a type all of them are exact in (re-encoded at load; codegen plans them so).
            pub const WIDEN_STACKS: bool = #widen;
        }
    }
}

/// Expands to the error type listing every problem found while reading a file.
fn gen_error(spec: &ArchSpec, n: &Names) -> TokenStream {
    let Names { error, .. } = n;
    let what = format!("{} model does not match {}", spec.arch, file_name(spec));
    let doc = format!(
        "Everything wrong with a GGUF read as `{}`: missing or mistyped keys, missing or mis-shaped tensors.",
        spec.arch
    );
    quote! {
        #[doc = #doc]
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub struct #error {
            pub file: ::core::option::Option<::std::path::PathBuf>,
            pub problems: ::std::vec::Vec<::std::string::String>,
        }

        impl ::core::fmt::Display for #error {
            fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                if let ::core::option::Option::Some(file) = &self.file {
                    write!(f, "{}: ", file.display())?;
                }
                write!(f, "{} ({} problem(s)):", #what, self.problems.len())?;
                for p in &self.problems {
                    write!(f, "\n  {p}")?;
                }
                ::core::result::Result::Ok(())
            }
        }

        impl ::std::error::Error for #error {}
    }
}

fn rust_type(ty: HParamType) -> TokenStream {
    match ty {
        HParamType::U32 => quote!(u32),
        HParamType::F32 => quote!(f32),
        HParamType::Bool => quote!(bool),
    }
}

/// An expression as Rust code of type `Result<i64, String>`; names are `u32` locals in scope.
/// Expands to e.g. `GlmDsaHparams::__op(Ok(n_head as i64), Ok(qk_head_dim as i64), '*', "n_head * qk_head_dim")`.
fn expr_code(e: &Expr, hp: &Ident, span: Span) -> TokenStream {
    fn node(x: &Node, text: &str, hp: &Ident, span: Span) -> TokenStream {
        match x {
            Node::Int(v) => {
                let v = Literal::i64_suffixed(*v);
                quote!(::core::result::Result::<i64, ::std::string::String>::Ok(#v))
            }
            Node::Name(name) => {
                let id = ident(name, span);
                quote!(::core::result::Result::<i64, ::std::string::String>::Ok(#id as i64))
            }
            Node::Neg(a) => {
                let a = node(a, text, hp, span);
                quote!(#hp::__op(::core::result::Result::Ok(0i64), #a, '-', #text))
            }
            Node::Bin(a, op, b) => {
                let (a, b) = (node(a, text, hp, span), node(b, text, hp, span));
                let c = op_char(*op);
                quote!(#hp::__op(#a, #b, #c, #text))
            }
        }
    }
    node(e.node(), e.text(), hp, span)
}

fn op_char(op: Op) -> char {
    op.symbol()
}

/// Wraps `body` (using the expression's names as `u32`) so it runs only when every name it
/// uses resolved. Expands to `match (a, b,) { (Some(a), Some(b),) => body, _ => None }`.
fn with_names(e: &Expr, body: TokenStream, span: Span) -> TokenStream {
    let names: Vec<Ident> = e.names().iter().map(|n| ident(n, span)).collect();
    quote! {
        match (#(#names,)*) {
            (#(::core::option::Option::Some(#names),)*) => #body,
            #[allow(unreachable_patterns)]
            _ => ::core::option::Option::None,
        }
    }
}

fn value_literal(v: &Value, ty: HParamType) -> TokenStream {
    match (v, ty) {
        (Value::Int(i), HParamType::U32) => {
            let l = Literal::u32_suffixed(*i as u32);
            quote!(#l)
        }
        (Value::Float(f), _) => {
            let l = Literal::f32_suffixed(*f as f32);
            quote!(#l)
        }
        (Value::Int(i), _) => {
            let l = Literal::f32_suffixed(*i as f32);
            quote!(#l)
        }
        (Value::Bool(b), _) => quote!(#b),
    }
}

fn hparam_doc(spec: &ArchSpec, h: &HParam) -> String {
    let from = match &h.from {
        HParamSource::Key(_) => format!("`{}`", h.gguf_key(&spec.arch).unwrap_or_default()),
        HParamSource::TensorDim { tensor, dim } => format!("ne[{dim}] of `{tensor}`"),
    };
    let default = match &h.default {
        None => String::new(),
        Some(HParamDefault::Value(v)) => format!(" (default {v})"),
        Some(HParamDefault::Expr(e)) => format!(" (default `{e}`)"),
    };
    format!("{from}{default}: {}", h.source)
}

/// Expands to `pub struct XHparams { pub n_embd: u32, ... }` and `XHparams::from_gguf`, which
/// reads every key (any integer width for u32, f32/f64 for f32), applies defaults, evaluates
/// derived values with checked arithmetic, and reports every problem at once.
fn gen_hparams(spec: &ArchSpec, n: &Names, span: Span) -> TokenStream {
    let Names {
        hparams: hp, error, ..
    } = n;
    let arch = &spec.arch;
    let mut fields = Vec::new();
    let mut reads = Vec::new();
    let mut names = Vec::new();
    for h in &spec.hparams {
        let id = ident(&h.name, span);
        let ty = rust_type(h.ty);
        let doc = hparam_doc(spec, h);
        fields.push(quote!(#[doc = #doc] pub #id: #ty,));
        let name = &h.name;
        let read = match &h.from {
            HParamSource::Key(_) => {
                let key = h.gguf_key(arch).unwrap_or_default();
                let getter = match h.ty {
                    HParamType::U32 => quote!(__get_u32),
                    HParamType::F32 => quote!(__get_f32),
                    HParamType::Bool => quote!(__get_bool),
                };
                let absent = match &h.default {
                    None => quote!({
                        problems.push(::std::format!("metadata key '{}' is missing (hparam `{}`)", #key, #name));
                        ::core::option::Option::None
                    }),
                    Some(HParamDefault::Value(v)) => {
                        let l = value_literal(v, h.ty);
                        quote!(::core::option::Option::Some(#l))
                    }
                    Some(HParamDefault::Expr(e)) => {
                        let code = expr_code(e, hp, span);
                        with_names(e, quote!(#hp::__u32_of(#code, #name, &mut problems)), span)
                    }
                };
                quote! {
                    let #id: ::core::option::Option<#ty> = match #hp::#getter(file, #key, #name, &mut problems) {
                        ::core::option::Option::Some(::core::option::Option::Some(v)) => ::core::option::Option::Some(v),
                        ::core::option::Option::Some(::core::option::Option::None) => #absent,
                        ::core::option::Option::None => ::core::option::Option::None,
                    };
                }
            }
            HParamSource::TensorDim { tensor, dim } => {
                let dim = *dim;
                quote! {
                    let #id: ::core::option::Option<u32> = #hp::__tensor_dim(file, #tensor, #dim, #name, &mut problems);
                }
            }
        };
        reads.push(read);
        names.push(id);
    }
    for d in &spec.derived {
        let id = ident(&d.name, span);
        let doc = format!("Derived: `{}` ({}).", d.expr, d.source);
        fields.push(quote!(#[doc = #doc] pub #id: u32,));
        let code = expr_code(&d.expr, hp, span);
        let name = &d.name;
        let body = with_names(
            &d.expr,
            quote!(#hp::__u32_of(#code, #name, &mut problems)),
            span,
        );
        reads.push(quote!(let #id: ::core::option::Option<u32> = #body;));
        names.push(id);
    }
    let (key_names, key_keys): (Vec<&str>, Vec<String>) = spec
        .hparams
        .iter()
        .filter_map(|h| Some((h.name.as_str(), h.gguf_key(arch)?)))
        .unzip();
    let doc = format!(
        "Hyperparameters of a `{arch}` model, read from GGUF metadata as `{}` says.",
        file_name(spec)
    );
    let swa = spec.caps.sliding_window.as_ref().map(|s| {
        let pattern = s.pattern as usize;
        let window = ident(&s.window, span);
        quote! {
            /// Whether layer `il` attends within the sliding window (local) rather than globally:
            /// `il % pattern < pattern - 1`, and only when the model has a window.
            pub fn is_sliding_window_layer(&self, il: usize) -> bool {
                self.#window > 0 && il % #pattern < #pattern - 1
            }
        }
    });
    let dense = spec.caps.dense_layers.as_ref().map(|r| {
        let (s_code, e_code) = (expr_code(&r.start, hp, span), expr_code(&r.end, hp, span));
        let bind: Vec<Ident> = spec.hparams.iter().filter(|h| h.ty == HParamType::U32).map(|h| ident(&h.name, span)).chain(spec.derived.iter().map(|d| ident(&d.name, span))).collect();
        let doc = format!("Whether layer `il` uses a dense FFN instead of the MoE (`dense_layers = \"{}\"`).", r.text);
        quote! {
            #[doc = #doc]
            #[allow(unused_variables)]
            pub fn is_dense_layer(&self, il: usize) -> bool {
                #(let #bind = self.#bind;)*
                match (#s_code, #e_code) {
                    (::core::result::Result::Ok(a), ::core::result::Result::Ok(b)) => (a..b).contains(&(il as i64)),
                    _ => false,
                }
            }
        }
    });
    quote! {
        #[doc = #doc]
        #[derive(Clone, Debug, PartialEq)]
        pub struct #hp {
            #(#fields)*
        }

        impl #hp {
            /// The GGUF metadata key of every key-sourced hparam, by hparam name (for messages).
            pub const GGUF_KEYS: &'static [(&'static str, &'static str)] = &[#((#key_names, #key_keys)),*];

            /// Reads every hparam; the error lists every missing or unusable key.
            pub fn from_gguf<B: ::core::convert::AsRef<[u8]>>(file: &::memra_gguf::Gguf<B>) -> ::core::result::Result<Self, #error> {
                let mut problems: ::std::vec::Vec<::std::string::String> = ::std::vec::Vec::new();
                match file.architecture() {
                    ::core::result::Result::Ok(a) if a == #arch => {}
                    ::core::result::Result::Ok(a) => problems.push(::std::format!("general.architecture is `{}`, expected `{}`", a, #arch)),
                    ::core::result::Result::Err(e) => problems.push(e.to_string()),
                }
                #(#reads)*
                if !problems.is_empty() {
                    return ::core::result::Result::Err(#error { file: file.path().map(::std::path::Path::to_path_buf), problems });
                }
                ::core::result::Result::Ok(Self { #(#names: #names.unwrap_or_default(),)* })
            }

            #swa
            #dense

            #[doc(hidden)]
            pub fn __op(a: ::core::result::Result<i64, ::std::string::String>, b: ::core::result::Result<i64, ::std::string::String>, op: char, e: &str) -> ::core::result::Result<i64, ::std::string::String> {
                let (a, b) = (a?, b?);
                let r = match op {
                    '+' => a.checked_add(b),
                    '-' => a.checked_sub(b),
                    '*' => a.checked_mul(b),
                    _ if b == 0 => return ::core::result::Result::Err(::std::format!("expression `{e}`: {a} / 0 divides by zero")),
                    _ if a % b != 0 => return ::core::result::Result::Err(::std::format!("expression `{e}`: {a} / {b} is not exact")),
                    _ => a.checked_div(b),
                };
                r.ok_or_else(|| ::std::format!("expression `{e}`: {a} {op} {b} overflows"))
            }

            #[doc(hidden)]
            pub fn __u32_of(v: ::core::result::Result<i64, ::std::string::String>, name: &str, problems: &mut ::std::vec::Vec<::std::string::String>) -> ::core::option::Option<u32> {
                match v {
                    ::core::result::Result::Ok(v) => match u32::try_from(v) {
                        ::core::result::Result::Ok(v) => ::core::option::Option::Some(v),
                        ::core::result::Result::Err(_) => {
                            problems.push(::std::format!("`{name}` = {v} does not fit in u32"));
                            ::core::option::Option::None
                        }
                    },
                    ::core::result::Result::Err(e) => {
                        problems.push(::std::format!("`{name}`: {e}"));
                        ::core::option::Option::None
                    }
                }
            }

            /// `None`: an error was recorded; `Some(None)`: the key is absent.
            #[doc(hidden)]
            pub fn __get_u32<B: ::core::convert::AsRef<[u8]>>(file: &::memra_gguf::Gguf<B>, key: &str, name: &str, problems: &mut ::std::vec::Vec<::std::string::String>) -> ::core::option::Option<::core::option::Option<u32>> {
                let ::core::option::Option::Some(v) = file.get(key) else { return ::core::option::Option::Some(::core::option::Option::None) };
                match v.as_integer().and_then(|i| u32::try_from(i).ok()) {
                    ::core::option::Option::Some(x) => ::core::option::Option::Some(::core::option::Option::Some(x)),
                    ::core::option::Option::None => {
                        problems.push(::std::format!("metadata key '{key}' = {v} ({}) is not a u32 (hparam `{name}`)", v.type_description()));
                        ::core::option::Option::None
                    }
                }
            }

            #[doc(hidden)]
            pub fn __get_f32<B: ::core::convert::AsRef<[u8]>>(file: &::memra_gguf::Gguf<B>, key: &str, name: &str, problems: &mut ::std::vec::Vec<::std::string::String>) -> ::core::option::Option<::core::option::Option<f32>> {
                let ::core::option::Option::Some(v) = file.get(key) else { return ::core::option::Option::Some(::core::option::Option::None) };
                match v.as_f64() {
                    ::core::option::Option::Some(x) => ::core::option::Option::Some(::core::option::Option::Some(x as f32)),
                    ::core::option::Option::None => {
                        problems.push(::std::format!("metadata key '{key}' = {v} ({}) is not a number (hparam `{name}`)", v.type_description()));
                        ::core::option::Option::None
                    }
                }
            }

            #[doc(hidden)]
            pub fn __get_bool<B: ::core::convert::AsRef<[u8]>>(file: &::memra_gguf::Gguf<B>, key: &str, name: &str, problems: &mut ::std::vec::Vec<::std::string::String>) -> ::core::option::Option<::core::option::Option<bool>> {
                let ::core::option::Option::Some(v) = file.get(key) else { return ::core::option::Option::Some(::core::option::Option::None) };
                match v.as_bool() {
                    ::core::option::Option::Some(x) => ::core::option::Option::Some(::core::option::Option::Some(x)),
                    ::core::option::Option::None => {
                        problems.push(::std::format!("metadata key '{key}' = {v} ({}) is not a bool (hparam `{name}`)", v.type_description()));
                        ::core::option::Option::None
                    }
                }
            }

            #[doc(hidden)]
            pub fn __tensor_dim<B: ::core::convert::AsRef<[u8]>>(file: &::memra_gguf::Gguf<B>, tensor: &str, dim: usize, name: &str, problems: &mut ::std::vec::Vec<::std::string::String>) -> ::core::option::Option<u32> {
                match file.tensor(tensor) {
                    ::core::option::Option::None => {
                        problems.push(::std::format!("tensor '{tensor}' is missing (hparam `{name}` is its ne[{dim}])"));
                        ::core::option::Option::None
                    }
                    ::core::option::Option::Some(t) => match t.dims.get(dim).and_then(|&d| u32::try_from(d).ok()) {
                        ::core::option::Option::Some(d) => ::core::option::Option::Some(d),
                        ::core::option::Option::None => {
                            problems.push(::std::format!("tensor '{tensor}' has dims {:?}; hparam `{name}` needs ne[{dim}]", t.dims));
                            ::core::option::Option::None
                        }
                    },
                }
            }

            /// Looks a tensor up and checks its shape; records a problem and returns `None` when
            /// it is missing (and `required`) or mis-shaped.
            #[doc(hidden)]
            pub fn __tensor<'f, B: ::core::convert::AsRef<[u8]>>(file: &'f ::memra_gguf::Gguf<B>, name: &str, shape: &[::core::result::Result<i64, ::std::string::String>], shape_text: &str, required: bool, problems: &mut ::std::vec::Vec<::std::string::String>) -> ::core::option::Option<::memra_gguf::TensorInfo<'f>> {
                let mut expected: ::std::vec::Vec<u64> = ::std::vec::Vec::new();
                for d in shape {
                    match d {
                        ::core::result::Result::Ok(v) => expected.push(*v as u64),
                        ::core::result::Result::Err(e) => {
                            problems.push(::std::format!("tensor '{name}': {e}"));
                            return ::core::option::Option::None;
                        }
                    }
                }
                match file.tensor(name) {
                    ::core::option::Option::None => {
                        if required {
                            problems.push(::std::format!("tensor '{name}' is missing"));
                        }
                        ::core::option::Option::None
                    }
                    ::core::option::Option::Some(t) if t.dims != expected => {
                        problems.push(::std::format!("tensor '{name}' has shape {:?}, expected {:?} = [{shape_text}]", t.dims, expected));
                        ::core::option::Option::None
                    }
                    ::core::option::Option::Some(t) => ::core::option::Option::Some(t),
                }
            }
        }
    }
}

/// A tensor field is an `Option` when the tensor is optional or only in some layers.
fn is_option(t: &TensorSpec) -> bool {
    t.optional || t.explicit_layers()
}

/// `blk.{i}.attn_q.weight` -> a `format!` template `blk.{}.attn_q.weight`.
fn name_template(t: &TensorSpec) -> String {
    t.name.replace("{i}", "{}")
}

/// Expands to the weight structs, generic over the tensor handle `T`:
/// `XLayerWeights<T> { pub attn_q: T, pub indexer_attn_k: Option<T>, ... }`, `XGlobalWeights<T>`,
/// `XWeights<T> { global, layers }`, `try_map` to turn handles into device buffers, and
/// `XWeights::<TensorInfo>::from_gguf`, which checks every tensor's presence and shape.
fn gen_weights(spec: &ArchSpec, n: &Names, span: Span) -> TokenStream {
    let Names {
        hparams: hp,
        layer,
        global,
        weights,
        error,
        ..
    } = n;
    let arch = &spec.arch;
    let per_layer: Vec<&TensorSpec> = spec.tensors.iter().filter(|t| t.per_layer()).collect();
    let globals: Vec<&TensorSpec> = spec.tensors.iter().filter(|t| !t.per_layer()).collect();

    let field_decl = |t: &TensorSpec| {
        let id = ident(&t.field, span);
        let shape: Vec<String> = t.shape.iter().map(|e| e.text().to_string()).collect();
        let mut doc = format!("`{}` [{}]", t.name, shape.join(", "));
        if t.optional {
            doc.push_str(", optional");
        }
        if t.explicit_layers() {
            doc.push_str(&format!(
                ", layers {}",
                t.layers.as_ref().map(|r| r.text.as_str()).unwrap_or("")
            ));
        }
        if is_option(t) {
            quote!(#[doc = #doc] pub #id: ::core::option::Option<T>,)
        } else {
            quote!(#[doc = #doc] pub #id: T,)
        }
    };
    let layer_fields: Vec<TokenStream> = per_layer.iter().map(|t| field_decl(t)).collect();
    let global_fields: Vec<TokenStream> = globals.iter().map(|t| field_decl(t)).collect();

    // try_map bodies: each field through `f` with its GGUF name.
    let map_field = |t: &TensorSpec, layer_index: bool| {
        let id = ident(&t.field, span);
        let template = name_template(t);
        let name = if layer_index {
            quote!(::std::format!(#template, i))
        } else {
            quote!(::std::string::String::from(#template))
        };
        if is_option(t) {
            quote!(#id: match self.#id { ::core::option::Option::Some(x) => ::core::option::Option::Some(f(&#name, x)?), ::core::option::Option::None => ::core::option::Option::None },)
        } else {
            quote!(#id: f(&#name, self.#id)?,)
        }
    };
    let layer_maps: Vec<TokenStream> = per_layer.iter().map(|t| map_field(t, true)).collect();
    let global_maps: Vec<TokenStream> = globals.iter().map(|t| map_field(t, false)).collect();

    // Loader: names bound from the hparams, shapes evaluated once, ranges once.
    let bind: Vec<Ident> = spec
        .hparams
        .iter()
        .filter(|h| h.ty == HParamType::U32)
        .map(|h| ident(&h.name, span))
        .chain(spec.derived.iter().map(|d| ident(&d.name, span)))
        .collect();
    let mut prelude = Vec::new();
    let load_one = |t: &TensorSpec, prelude: &mut Vec<TokenStream>, layer_index: bool| {
        let id = ident(&t.field, span);
        let shape_id = format_ident!("__shape_{}", t.field, span = span);
        let dims: Vec<TokenStream> = t.shape.iter().map(|e| expr_code(e, hp, span)).collect();
        let shape_text = t
            .shape
            .iter()
            .map(|e| e.text().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        prelude.push(quote!(let #shape_id: ::std::vec::Vec<::core::result::Result<i64, ::std::string::String>> = ::std::vec![#(#dims),*];));
        let template = name_template(t);
        let name = if layer_index {
            quote!(::std::format!(#template, i))
        } else {
            quote!(::std::string::String::from(#template))
        };
        let required = !t.optional;
        let lookup =
            quote!(#hp::__tensor(file, &#name, &#shape_id, #shape_text, #required, &mut problems));
        let in_range = if t.explicit_layers() {
            let range_id = format_ident!("__range_{}", t.field, span = span);
            let r = t.layers.as_ref().expect("per-layer tensors have a range");
            let (s, e) = (expr_code(&r.start, hp, span), expr_code(&r.end, hp, span));
            let text = &r.text;
            prelude.push(quote! {
                let #range_id: ::core::option::Option<::core::ops::Range<usize>> = match (#s, #e) {
                    (::core::result::Result::Ok(a), ::core::result::Result::Ok(b)) if 0 <= a && a <= b => ::core::option::Option::Some(a as usize..b as usize),
                    (::core::result::Result::Err(err), _) | (_, ::core::result::Result::Err(err)) => {
                        problems.push(::std::format!("layer range `{}` of `{}`: {err}", #text, #template));
                        ::core::option::Option::None
                    }
                    (::core::result::Result::Ok(a), ::core::result::Result::Ok(b)) => {
                        problems.push(::std::format!("layer range `{}` of `{}` is {a}..{b}", #text, #template));
                        ::core::option::Option::None
                    }
                };
            });
            Some(quote!(#range_id.as_ref().is_some_and(|r| r.contains(&i))))
        } else {
            None
        };
        // Required fields hold `Option<TensorInfo>` (None = missing, reported); optional ones
        // `Option<Option<..>>` (outer None = absent or out of range).
        match (is_option(t), in_range) {
            (false, _) => quote!(#id: #lookup,),
            (true, None) => quote!(#id: #lookup.map(::core::option::Option::Some),),
            (true, Some(cond)) => {
                quote!(#id: if #cond { #lookup.map(::core::option::Option::Some) } else { ::core::option::Option::None },)
            }
        }
    };
    let global_loads: Vec<TokenStream> = globals
        .iter()
        .map(|t| load_one(t, &mut prelude, false))
        .collect();
    let layer_loads: Vec<TokenStream> = per_layer
        .iter()
        .map(|t| load_one(t, &mut prelude, true))
        .collect();

    let layer_doc = format!(
        "The per-layer tensors of a `{arch}` model (`{}` [tensors]); `T` is the tensor handle.",
        file_name(spec)
    );
    let global_doc = format!("The global tensors of a `{arch}` model; `T` is the tensor handle.");
    let weights_doc =
        format!("Every tensor of a `{arch}` model: `layers[i]` holds `blk.i.*` for i < n_layer.");
    quote! {
        #[doc = #layer_doc]
        #[derive(Clone, Debug, PartialEq)]
        pub struct #layer<T> {
            #(#layer_fields)*
        }

        #[doc = #global_doc]
        #[derive(Clone, Debug, PartialEq)]
        pub struct #global<T> {
            #(#global_fields)*
        }

        #[doc = #weights_doc]
        #[derive(Clone, Debug, PartialEq)]
        pub struct #weights<T> {
            pub global: #global<T>,
            pub layers: ::std::vec::Vec<#layer<T>>,
        }

        impl<T> #weights<T> {
            /// Turns every handle into another (e.g. a device buffer); `f` gets the GGUF name.
            pub fn try_map<U, E>(self, mut f: impl FnMut(&str, T) -> ::core::result::Result<U, E>) -> ::core::result::Result<#weights<U>, E> {
                let global = self.global.try_map(&mut f)?;
                let mut layers = ::std::vec::Vec::with_capacity(self.layers.len());
                for (i, l) in self.layers.into_iter().enumerate() {
                    layers.push(l.try_map(i, &mut f)?);
                }
                ::core::result::Result::Ok(#weights { global, layers })
            }
        }

        impl<T> #global<T> {
            fn try_map<U, E>(self, mut f: impl FnMut(&str, T) -> ::core::result::Result<U, E>) -> ::core::result::Result<#global<U>, E> {
                ::core::result::Result::Ok(#global { #(#global_maps)* })
            }
        }

        impl<T> #layer<T> {
            /// As [`try_map`](Self::try_map) on the whole model, for layer `i`.
            pub fn try_map<U, E>(self, i: usize, mut f: impl FnMut(&str, T) -> ::core::result::Result<U, E>) -> ::core::result::Result<#layer<U>, E> {
                ::core::result::Result::Ok(#layer { #(#layer_maps)* })
            }
        }

        impl<'f> #weights<::memra_gguf::TensorInfo<'f>> {
            /// Maps every tensor the spec lists to its GGUF tensor info, checking shapes against
            /// the spec's expressions; the error lists every missing or mis-shaped tensor.
            #[allow(unused_variables)]
            pub fn from_gguf<B: ::core::convert::AsRef<[u8]>>(file: &'f ::memra_gguf::Gguf<B>, hparams: &#hp) -> ::core::result::Result<Self, #error> {
                let mut problems: ::std::vec::Vec<::std::string::String> = ::std::vec::Vec::new();
                #(let #bind = hparams.#bind;)*
                #(#prelude)*
                let global = #global { #(#global_loads)* };
                // Every layer has tensors: a larger count is a corrupt block_count, refused
                // before the per-layer tables (and a message per missing tensor) are built.
                if hparams.n_layer as usize > file.tensors().len() {
                    return ::core::result::Result::Err(#error { file: file.path().map(::std::path::Path::to_path_buf), problems: ::std::vec![::std::format!("n_layer = {} exceeds the file's {} tensors", hparams.n_layer, file.tensors().len())] });
                }
                let mut layers = ::std::vec::Vec::with_capacity(hparams.n_layer as usize);
                for i in 0..hparams.n_layer as usize {
                    layers.push(#layer { #(#layer_loads)* });
                }
                if !problems.is_empty() {
                    return ::core::result::Result::Err(#error { file: file.path().map(::std::path::Path::to_path_buf), problems });
                }
                // Every required handle is present once no problem was recorded.
                let found = #weights { global, layers };
                found.try_map(|name, t: ::core::option::Option<::memra_gguf::TensorInfo<'f>>| {
                    t.ok_or_else(|| ::std::format!("tensor '{name}' is missing"))
                })
                .map_err(|p| #error { file: file.path().map(::std::path::Path::to_path_buf), problems: ::std::vec![p] })
            }
        }
    }
}
