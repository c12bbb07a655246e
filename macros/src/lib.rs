//! memra-macros: thin proc-macro entry points; the logic lives in modules beside this file.

mod kernel_args;

/// `#[derive(KernelArgs)]` with `#[kernel_args(family = "<family>")]`: the struct's fields, in
/// order, are the kernel's parameters (see `memra_engine::kernels::launch`).
#[proc_macro_derive(KernelArgs, attributes(kernel_args))]
pub fn derive_kernel_args(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    kernel_args::expand(&input).unwrap_or_else(syn::Error::into_compile_error).into()
}

mod spec_arch;
mod spec_gen;

/// `arch!("glm-dsa")` reads `specs/glm-dsa.toml` at compile time (found from
/// `CARGO_MANIFEST_DIR` upwards; or `arch!("glm-dsa", spec = "path.toml")`, relative to the
/// invoking file) and generates `GlmDsa` (arch id + capabilities), `GlmDsaHparams` with
/// `from_gguf`, `GlmDsaLayerWeights<T>` / `GlmDsaGlobalWeights<T>` / `GlmDsaWeights<T>` with a
/// shape-checking loader and `try_map`, and `GlmDsaLoadError`. Editing the spec rebuilds.
#[proc_macro]
pub fn arch(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    let input = syn::parse_macro_input!(input as spec_arch::ArchInput);
    let site = spec_arch::CallSite {
        manifest_dir: std::env::var_os("CARGO_MANIFEST_DIR").map(std::path::PathBuf::from),
        source_dir: proc_macro::Span::call_site().local_file().and_then(|f| f.parent().map(std::path::Path::to_path_buf)),
    };
    spec_arch::expand(input, site).unwrap_or_else(syn::Error::into_compile_error).into()
}
