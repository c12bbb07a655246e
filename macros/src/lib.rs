//! memra-macros: thin proc-macro entry points; the logic lives in modules beside this file.

mod kernel_args;

/// `#[derive(KernelArgs)]` with `#[kernel_args(family = "<family>")]`: the struct's fields, in
/// order, are the kernel's parameters (see `memra_engine::kernels::launch`).
#[proc_macro_derive(KernelArgs, attributes(kernel_args))]
pub fn derive_kernel_args(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    kernel_args::expand(&input).unwrap_or_else(syn::Error::into_compile_error).into()
}
