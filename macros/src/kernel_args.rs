//! `#[derive(KernelArgs)]`: a struct's fields, in order, become a kernel's parameters.
//!
//! Checks here (spanned errors): a struct with named fields, and a
//! `#[kernel_args(family = "...")]` attribute naming the kernel family. Each field's type must
//! implement `memra_engine::kernels::launch::KernelArg`; that check is the compiler's, spanned at
//! the field's type.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Fields, LitStr};

pub fn expand(input: &DeriveInput) -> syn::Result<TokenStream> {
    let family = family_attr(input)?;
    let fields = match &input.data {
        Data::Struct(s) => match &s.fields {
            Fields::Named(named) => &named.named,
            Fields::Unnamed(f) => {
                return Err(syn::Error::new(f.span(), "KernelArgs needs named fields: the names appear in parameter-mismatch errors"));
            }
            Fields::Unit => {
                return Err(syn::Error::new(input.ident.span(), "KernelArgs needs a struct with one field per kernel parameter"));
            }
        },
        Data::Enum(e) => return Err(syn::Error::new(e.enum_token.span, "KernelArgs can only be derived for structs")),
        Data::Union(u) => return Err(syn::Error::new(u.union_token.span, "KernelArgs can only be derived for structs")),
    };

    let krate = quote!(::memra_engine::kernels::launch);
    let name = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();

    // Expands to a list like `("x", <&'a CudaSlice<f32> as KernelArg>::KIND), ("n", <i32 as KernelArg>::KIND)`;
    // the span puts "`String` is not a kernel argument" on the offending field's type.
    let params = fields.iter().map(|f| {
        let ident = f.ident.as_ref().expect("named field");
        let label = ident.to_string();
        let ty = &f.ty;
        quote_spanned!(ty.span()=> (#label, <#ty as #krate::KernelArg>::KIND))
    });
    // Expands to `KernelArg::push(&mut self.x, launch); KernelArg::push(&mut self.n, launch); …`.
    let pushes = fields.iter().map(|f| {
        let ident = f.ident.as_ref().expect("named field");
        let ty = &f.ty;
        quote_spanned!(ty.span()=> <#ty as #krate::KernelArg>::push(&mut self.#ident, launch);)
    });

    // Expands to:
    // impl<'a> KernelArgs for RmsnormArgs<'a> {
    //     const FAMILY: &str = "rmsnorm";
    //     const PARAMS: &[(&str, ArgKind)] = &[("x", …KIND), …];
    //     fn push_args<'s>(&'s mut self, launch: &mut LaunchArgs<'s>) { …pushes in field order… }
    // }
    Ok(quote! {
        impl #impl_generics #krate::KernelArgs for #name #ty_generics #where_clause {
            const FAMILY: &'static str = #family;
            const PARAMS: &'static [(&'static str, #krate::ArgKind)] = &[#(#params),*];
            fn push_args<'memra_launch>(&'memra_launch mut self, launch: &mut #krate::LaunchArgs<'memra_launch>) {
                #(#pushes)*
            }
        }
    })
}

/// The `family = "..."` of the one `#[kernel_args(...)]` attribute.
fn family_attr(input: &DeriveInput) -> syn::Result<LitStr> {
    let mut family: Option<LitStr> = None;
    for attr in input.attrs.iter().filter(|a| a.path().is_ident("kernel_args")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("family") {
                let value: LitStr = meta.value()?.parse()?;
                if value.value().is_empty() {
                    return Err(syn::Error::new(value.span(), "the family name must not be empty"));
                }
                if family.is_some() {
                    return Err(meta.error("`family` is given twice"));
                }
                family = Some(value);
                Ok(())
            } else {
                Err(meta.error("unknown kernel_args key; expected `family = \"<kernel family>\"`"))
            }
        })?;
    }
    family.ok_or_else(|| {
        syn::Error::new(
            input.ident.span(),
            "missing #[kernel_args(family = \"...\")]: name the kernel family these arguments launch",
        )
    })
}
