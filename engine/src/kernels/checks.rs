//! Argument checks shared by the family wrappers (H-dense families; others may use them):
//! baked dims and thread counts of a variant, buffer lengths, alignment, i32 ranges. Every
//! failure is an [`Error::InvalidArgs`] naming the kernel and the argument.

use cudarc::driver::{DevicePtr, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::qk_norm_rope::CacheElem;
use crate::kernels::registry::{KernelVariant, Param};

pub fn invalid(kernel: &Kernel, detail: impl Into<String>) -> Error {
    Error::InvalidArgs { kernel: kernel.name().to_string(), detail: detail.into() }
}

/// A baked integer parameter (a specialized variant's dim, an integer enum or tuning field).
pub fn baked_int(v: &KernelVariant, key: &str) -> Option<i64> {
    match v.param(key) {
        Some(Param::Int(i)) => Some(i),
        _ => None,
    }
}

/// A baked enum token (`q4_k`, `neox`, `bf16`).
pub fn baked_sym(v: &KernelVariant, key: &str) -> Option<&'static str> {
    match v.param(key) {
        Some(Param::Sym(s)) => Some(s),
        _ => None,
    }
}

/// The variant's block size: its `threads` param, else the README default. A multiple of 32, <= 1024.
pub fn threads(kernel: &Kernel, default: u32) -> Result<u32, Error> {
    let t = baked_int(kernel.variant(), "threads").unwrap_or(default as i64);
    if t <= 0 || t > 1024 || t % 32 != 0 {
        return Err(invalid(kernel, format!("threads={t} is not a multiple of 32 in 32..=1024")));
    }
    Ok(t as u32)
}

/// A specialized variant ignores the run-time dim and uses its baked one; refuse a mismatch
/// rather than compute with the wrong shape.
pub fn check_dim(kernel: &Kernel, key: &str, value: usize) -> Result<(), Error> {
    match baked_int(kernel.variant(), key) {
        Some(baked) if baked != value as i64 => {
            Err(invalid(kernel, format!("{key}={value} but this variant is specialized for {key}={baked}")))
        }
        _ => Ok(()),
    }
}

/// The baked enum token of `key`, required.
pub fn required_sym(kernel: &Kernel, key: &str) -> Result<&'static str, Error> {
    baked_sym(kernel.variant(), key).ok_or_else(|| invalid(kernel, format!("the variant bakes no `{key}`")))
}

/// The variant's baked `cache_t` is the element type `C` of the cache buffers it is handed
/// (`what` names them in the error: "key cache buffer").
pub fn cache_type<C: CacheElem>(kernel: &Kernel, what: &str) -> Result<(), Error> {
    let cache_t = required_sym(kernel, "cache_t")?;
    if cache_t != C::CACHE_T {
        return Err(invalid(kernel, format!("{what} is {} but the variant has cache_t={cache_t}", C::CACHE_T)));
    }
    Ok(())
}

pub fn to_i32(kernel: &Kernel, what: &str, value: usize) -> Result<i32, Error> {
    i32::try_from(value).map_err(|_| invalid(kernel, format!("{what}={value} does not fit the kernel's int")))
}

/// `have >= need` elements.
pub fn check_len(kernel: &Kernel, what: &str, have: usize, need: usize) -> Result<(), Error> {
    if have < need {
        return Err(invalid(kernel, format!("{what} holds {have} elements, needs {need}")));
    }
    Ok(())
}

/// The device address a buffer starts at (for alignment and overlap checks, and pointer
/// parameters that may be null).
pub fn device_addr<T, B: DevicePtr<T>>(kernel: &Kernel, buf: &B) -> u64 {
    let (ptr, _sync) = buf.device_ptr(kernel.stream());
    ptr
}

/// float4 paths need 16-byte aligned starts.
pub fn check_aligned16<T, B: DevicePtr<T>>(kernel: &Kernel, what: &str, buf: &B) -> Result<(), Error> {
    let ptr = device_addr(kernel, buf);
    if ptr % 16 != 0 {
        return Err(invalid(kernel, format!("{what} starts at 0x{ptr:x}, not 16-byte aligned")));
    }
    Ok(())
}

/// `n.div_ceil(d)` as a grid dimension, at least 1 and at most `cap`.
pub fn grid_dim(n: usize, d: usize, cap: u32) -> u32 {
    n.div_ceil(d).clamp(1, cap as usize) as u32
}

pub fn config(grid: (u32, u32), threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (grid.0, grid.1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// Largest gridDim.y / z.
pub const GRID_Y_MAX: u32 = 65535;
