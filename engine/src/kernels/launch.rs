//! Typed launches. Each family has an argument struct deriving [`KernelArgs`] whose fields, in
//! order, are the kernel's parameters:
//!
//! ```ignore
//! #[derive(KernelArgs)]
//! #[kernel_args(family = "rmsnorm")]
//! pub struct RmsnormArgs<'a> {
//!     pub x: &'a CudaSlice<f32>,
//!     pub out: &'a mut CudaSlice<f32>,
//!     pub n: i32,
//!     pub eps: f32,
//! }
//! // SAFETY: out holds rows * n floats, x as many, and the grid covers `rows` rows.
//! unsafe { launch(kernel, cfg, &mut RmsnormArgs { x: &x, out: &mut out, n, eps }) }?;
//! ```
//!
//! A field whose type is not a kernel argument does not compile, a struct of another family is
//! refused at launch, and [`check_params`] compares every variant's compiled parameter list with
//! the struct (run it in a CPU test per family).

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PushKernelArg as _};

pub use cudarc::driver::{LaunchArgs, LaunchConfig};
pub use memra_macros::KernelArgs;

use crate::cuda::nvrtc::{self, HeaderSet};
use crate::cuda::{Error, Kernel, SmArch};
use crate::kernels::registry::KernelVariant;

/// How a parameter is passed, as far as the kernel's ABI can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgKind {
    /// A device pointer (`T*`, `const T*`).
    Ptr,
    I32,
    U32,
    F32,
    I64,
    U64,
}

impl ArgKind {
    /// Whether a PTX `.param` of this type (`.u64`, `.s32`, `.f32`, …) can receive this kind.
    /// PTX does not record signedness reliably, nor distinguish a 64-bit integer from a pointer.
    fn accepts_ptx(self, ptx_type: &str) -> bool {
        match self {
            ArgKind::Ptr | ArgKind::I64 | ArgKind::U64 => matches!(ptx_type, ".u64" | ".s64" | ".b64"),
            ArgKind::I32 | ArgKind::U32 => matches!(ptx_type, ".u32" | ".s32" | ".b32"),
            ArgKind::F32 => ptx_type == ".f32",
        }
    }

    pub fn c_type(self) -> &'static str {
        match self {
            ArgKind::Ptr => "pointer",
            ArgKind::I32 => "int",
            ArgKind::U32 => "unsigned",
            ArgKind::F32 => "float",
            ArgKind::I64 => "long long",
            ArgKind::U64 => "unsigned long long",
        }
    }
}

/// A type that can be one kernel parameter. Implemented for device buffers (`&CudaSlice<T>`,
/// `&mut CudaSlice<T>`, views) and the scalars i32, u32, f32, i64, u64.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a kernel argument",
    label = "not a kernel argument",
    note = "kernel arguments are &CudaSlice<T>, &mut CudaSlice<T>, CudaView<T>, CudaViewMut<T> (or references to them), i32, u32, f32, i64, u64"
)]
pub trait KernelArg {
    const KIND: ArgKind;
    fn push<'a>(&'a mut self, launch: &mut LaunchArgs<'a>);
}

/// An argument struct (derive it). Field order = kernel parameter order.
pub trait KernelArgs {
    /// The kernel family these arguments belong to (`#[kernel_args(family = "...")]`).
    const FAMILY: &'static str;
    /// Field names and kinds, in order.
    const PARAMS: &'static [(&'static str, ArgKind)];
    /// Pushes every field, in order.
    fn push_args<'a>(&'a mut self, launch: &mut LaunchArgs<'a>);
}

impl<T> KernelArg for &CudaSlice<T> {
    const KIND: ArgKind = ArgKind::Ptr;
    fn push<'a>(&'a mut self, launch: &mut LaunchArgs<'a>) {
        launch.arg(*self);
    }
}

impl<T> KernelArg for &mut CudaSlice<T> {
    const KIND: ArgKind = ArgKind::Ptr;
    fn push<'a>(&'a mut self, launch: &mut LaunchArgs<'a>) {
        launch.arg(&mut **self);
    }
}

impl<T> KernelArg for CudaView<'_, T> {
    const KIND: ArgKind = ArgKind::Ptr;
    fn push<'a>(&'a mut self, launch: &mut LaunchArgs<'a>) {
        launch.arg(&*self);
    }
}

impl<T> KernelArg for &CudaView<'_, T> {
    const KIND: ArgKind = ArgKind::Ptr;
    fn push<'a>(&'a mut self, launch: &mut LaunchArgs<'a>) {
        launch.arg(*self);
    }
}

impl<T> KernelArg for CudaViewMut<'_, T> {
    const KIND: ArgKind = ArgKind::Ptr;
    fn push<'a>(&'a mut self, launch: &mut LaunchArgs<'a>) {
        launch.arg(self);
    }
}

impl<T> KernelArg for &mut CudaViewMut<'_, T> {
    const KIND: ArgKind = ArgKind::Ptr;
    fn push<'a>(&'a mut self, launch: &mut LaunchArgs<'a>) {
        launch.arg(&mut **self);
    }
}

macro_rules! scalar_arg {
    ($($ty:ty => $kind:ident),*) => {$(
        impl KernelArg for $ty {
            const KIND: ArgKind = ArgKind::$kind;
            fn push<'a>(&'a mut self, launch: &mut LaunchArgs<'a>) {
                launch.arg(&*self);
            }
        }
    )*};
}
scalar_arg!(i32 => I32, u32 => U32, f32 => F32, i64 => I64, u64 => U64);

/// Launches `kernel` on its stream with `args`.
///
/// Fails without launching if `args` belongs to another family than the kernel.
///
/// # Safety
/// The caller guarantees what types cannot: every buffer is large enough for the dims passed in
/// `args` and for the grid in `config`, and `config` is the family's launch geometry
/// (block size = the variant's `THREADS`). Family wrappers check this and are safe to call.
pub unsafe fn launch<A: KernelArgs>(kernel: &Kernel, config: LaunchConfig, args: &mut A) -> Result<(), Error> {
    let variant = kernel.variant();
    if variant.family != A::FAMILY {
        return Err(Error::WrongArgs {
            kernel: variant.name.to_string(),
            kernel_family: variant.family.to_string(),
            args_family: A::FAMILY.to_string(),
        });
    }
    let mut builder = kernel.stream().launch_builder(kernel.function());
    args.push_args(&mut builder);
    // SAFETY: the argument list matches the kernel's parameter list: `A` is the argument struct
    // of this kernel's family (checked above), its fields mirror the family template's parameter
    // list in order and ABI kind (`check_params` compiles every variant of the family and
    // compares; each family runs it in a CPU test), and specialized and generic variants share one
    // parameter list (KERNEL-CONTRACT §1). Buffer sizes and geometry are the caller's contract.
    unsafe { builder.launch(config) }.map_err(|e| Error::driver(format!("cuLaunchKernel({})", variant.name), e))?;
    Ok(())
}

/// One `.param` of a PTX `.entry`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PtxParam {
    /// `.u64`, `.u32`, `.f32`, `.b8` (by-value struct), …
    pub ty: String,
    /// Array length for by-value aggregates (`.b8 p[16]`).
    pub array: Option<usize>,
}

/// The parameter list of `.entry <name>(...)` in PTX text.
pub fn ptx_entry_params(ptx: &str, name: &str) -> Option<Vec<PtxParam>> {
    let start = ptx.find(&format!(".entry {name}("))? + ".entry ".len() + name.len() + 1;
    let end = start + ptx[start..].find(')')?;
    let body = ptx[start..end].trim();
    if body.is_empty() {
        return Some(Vec::new());
    }
    Some(
        body.split(',')
            .map(|decl| {
                let words: Vec<&str> = decl.split_whitespace().collect();
                const ATTRS: [&str; 6] = [".param", ".ptr", ".global", ".shared", ".const", ".local"];
                let mut it = words.iter().copied().filter(|w| !ATTRS.contains(w));
                let mut ty = String::new();
                while let Some(w) = it.next() {
                    if w == ".align" {
                        it.next();
                    } else if w.starts_with('.') {
                        ty = w.to_string();
                        break;
                    }
                }
                let array = words
                    .last()
                    .and_then(|w| w.strip_suffix(']'))
                    .and_then(|w| w.rsplit('[').next())
                    .and_then(|n| n.parse().ok());
                PtxParam { ty, array }
            })
            .collect(),
    )
}

/// Compiles each of `variants` to PTX for `arch` and checks its parameter list against
/// `A::PARAMS` (count, and kind of each). Returns how many variants were checked. Needs NVRTC,
/// not a GPU.
pub fn check_params<A: KernelArgs>(variants: &[&KernelVariant], headers: &HeaderSet, arch: SmArch) -> Result<usize, Error> {
    for v in variants {
        if v.family != A::FAMILY {
            return Err(Error::WrongArgs { kernel: v.name.to_string(), kernel_family: v.family.to_string(), args_family: A::FAMILY.to_string() });
        }
        let ptx = nvrtc::compile_ptx(v.name, v.source, headers, arch)?;
        let mismatch = |detail: String| Error::ParamMismatch { variant: v.name.to_string(), detail };
        let params = ptx_entry_params(&ptx, v.name).ok_or_else(|| mismatch(format!("no `.entry {}` in its PTX", v.name)))?;
        if params.len() != A::PARAMS.len() {
            let fields: Vec<&str> = A::PARAMS.iter().map(|(n, _)| *n).collect();
            return Err(mismatch(format!(
                "the kernel takes {} parameters, the struct has {} fields ({})",
                params.len(),
                A::PARAMS.len(),
                fields.join(", ")
            )));
        }
        for (i, (p, (field, kind))) in params.iter().zip(A::PARAMS).enumerate() {
            if p.array.is_some() || !kind.accepts_ptx(&p.ty) {
                let shown = match p.array {
                    Some(n) => format!("{}[{n}]", p.ty),
                    None => p.ty.clone(),
                };
                return Err(mismatch(format!("parameter {i} is PTX `{shown}` but field `{field}` is {}", kind.c_type())));
            }
        }
    }
    Ok(variants.len())
}

/// [`check_params`] for every variant of `A`'s family in this build's registry, for `sm_90`.
pub fn check_family_params<A: KernelArgs>() -> Result<usize, Error> {
    let variants = crate::kernels::registry::family(A::FAMILY);
    check_params::<A>(&variants, &HeaderSet::registry(), SmArch(90))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_entry_params_reads_types_and_aggregates() {
        let ptx = ".visible .entry add_one(\n\t.param .u64 .ptr .align 1 add_one_param_0,\n\t.param .u32 add_one_param_1,\n\
                   \t.param .f32 add_one_param_2,\n\t.param .align 4 .b8 add_one_param_3[16]\n)\n{\n ret;\n}";
        let p = ptx_entry_params(ptx, "add_one").unwrap();
        let tys: Vec<&str> = p.iter().map(|p| p.ty.as_str()).collect();
        assert_eq!(tys, [".u64", ".u32", ".f32", ".b8"]);
        assert_eq!(p[3].array, Some(16));
        assert_eq!(p[0].array, None);
        assert!(ptx_entry_params(ptx, "other").is_none());
        assert_eq!(ptx_entry_params(".entry e(\n)\n", "e"), Some(vec![]));
    }
}
