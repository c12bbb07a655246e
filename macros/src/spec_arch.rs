//! `arch!("<arch>")`: input parsing and spec lookup. Generation lives in `spec_gen.rs`.
//!
//! Input: `arch!("glm-dsa")`, or `arch!("glm-dsa", spec = "path/to/glm-dsa.toml")` with the
//! path relative to the invoking source file (like `include_str!`). Without `spec`, the macro
//! looks for `specs/<arch>.toml` in `CARGO_MANIFEST_DIR` and its ancestors, then in the
//! invoking file's directory and its ancestors.

use std::path::{Path, PathBuf};

use memra_codegen::spec::ArchSpec;
use proc_macro2::{Span, TokenStream};
use syn::parse::{Parse, ParseStream};
use syn::{LitStr, Token};

pub struct ArchInput {
    pub arch: LitStr,
    pub spec: Option<LitStr>,
}

impl Parse for ArchInput {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let arch: LitStr = input.parse().map_err(|e| {
            syn::Error::new(
                e.span(),
                "expected the architecture as a string literal, e.g. arch!(\"glm-dsa\")",
            )
        })?;
        let mut spec = None;
        if input.parse::<Option<Token![,]>>()?.is_some() && !input.is_empty() {
            let key: syn::Ident = input.parse()?;
            if key != "spec" {
                return Err(syn::Error::new(
                    key.span(),
                    format!(
                        "unknown option `{key}`; the only option is `spec = \"path/to/<arch>.toml\"`"
                    ),
                ));
            }
            input.parse::<Token![=]>()?;
            spec = Some(input.parse()?);
            input.parse::<Option<Token![,]>>()?;
        }
        if !input.is_empty() {
            return Err(input.error("unexpected tokens after the arguments"));
        }
        Ok(ArchInput { arch, spec })
    }
}

/// Where the invocation is: the manifest dir and the invoking file's directory.
pub struct CallSite {
    pub manifest_dir: Option<PathBuf>,
    pub source_dir: Option<PathBuf>,
}

/// Parses, locates and loads the spec, then generates the items.
pub fn expand(input: ArchInput, site: CallSite) -> syn::Result<TokenStream> {
    let arch = input.arch.value();
    let path = match &input.spec {
        Some(lit) => {
            let rel = PathBuf::from(lit.value());
            let base = site
                .source_dir
                .clone()
                .or_else(|| site.manifest_dir.clone())
                .unwrap_or_default();
            let path = if rel.is_absolute() {
                rel
            } else {
                base.join(rel)
            };
            match path.canonicalize() {
                Ok(p) if p.is_file() => p,
                _ => {
                    return Err(syn::Error::new(
                        lit.span(),
                        format!(
                            "spec file `{}` not found (paths are relative to the invoking source file)",
                            lit.value()
                        ),
                    ));
                }
            }
        }
        None => locate(&arch, &site).map_err(|msg| syn::Error::new(input.arch.span(), msg))?,
    };
    let span = input
        .spec
        .as_ref()
        .map(LitStr::span)
        .unwrap_or_else(|| input.arch.span());
    let spec = ArchSpec::load(&path)
        .map_err(|e| syn::Error::new(span, format!("invalid spec {}:\n{e}", path.display())))?;
    if spec.arch != arch {
        return Err(syn::Error::new(
            input.arch.span(),
            format!("{} describes `{}`, not `{arch}`", path.display(), spec.arch),
        ));
    }
    Ok(crate::spec_gen::generate(&spec, &path, Span::call_site()))
}

fn locate(arch: &str, site: &CallSite) -> Result<PathBuf, String> {
    if arch.is_empty()
        || !arch
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(format!(
            "`{arch}` is not an architecture id (GGUF spelling: lower case, digits, '-', e.g. \"glm-dsa\")"
        ));
    }
    let roots = [site.manifest_dir.as_deref(), site.source_dir.as_deref()];
    let mut specs_dirs: Vec<&Path> = Vec::new();
    for root in roots.into_iter().flatten() {
        for dir in root.ancestors() {
            let candidate = dir.join("specs").join(format!("{arch}.toml"));
            if candidate.is_file() {
                return Ok(candidate.canonicalize().unwrap_or(candidate));
            }
            if dir.join("specs").is_dir() && !specs_dirs.contains(&dir) {
                specs_dirs.push(dir);
            }
        }
    }
    let mut known: Vec<String> = Vec::new();
    for dir in &specs_dirs {
        if let Ok(entries) = std::fs::read_dir(dir.join("specs")) {
            for e in entries.flatten() {
                if let Some(name) = e.file_name().to_str().and_then(|n| n.strip_suffix(".toml"))
                    && !known.iter().any(|k| k == name) {
                        known.push(name.to_string());
                    }
            }
        }
    }
    known.sort();
    if known.is_empty() {
        Err(format!(
            "unknown architecture `{arch}`: no specs/ directory above the crate or the invoking file"
        ))
    } else {
        Err(format!(
            "unknown architecture `{arch}`: there is no specs/{arch}.toml (known: {})",
            known.join(", ")
        ))
    }
}
