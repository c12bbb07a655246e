//! add_rmsnorm: `residual += d; out = rmsnorm(residual) · w` in one pass, with
//! `d = delta` or (DELTA_NORM = 1, gemma3 post-norms) `d = rmsnorm(delta) · delta_w`
//! (templates/memra/add_rmsnorm.cuh).

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks;
use crate::kernels::launch::{KernelArgs, launch};

pub const FAMILY: &str = "add_rmsnorm";
pub const DEFAULT_THREADS: u32 = 256;

/// Kernel parameters in order: `(float* residual, const float* delta, const float* delta_w,
/// const float* w, float* out, int n_rows, int n, float eps)`.
#[derive(KernelArgs)]
#[kernel_args(family = "add_rmsnorm")]
pub struct AddRmsnormArgs<'a> {
    pub residual: CudaViewMut<'a, f32>,
    pub delta: CudaView<'a, f32>,
    pub delta_w: CudaView<'a, f32>,
    pub w: CudaView<'a, f32>,
    pub out: CudaViewMut<'a, f32>,
    pub n_rows: i32,
    pub n: i32,
    pub eps: f32,
}

/// Same row engine and geometry as rmsnorm.
pub fn launch_config(threads: u32, n_rows: usize, n: usize) -> LaunchConfig {
    crate::kernels::rmsnorm::launch_config(threads, n_rows, n)
}

/// Whether the variant normalizes delta before the add (`delta_norm = 1`).
pub fn delta_norm(kernel: &Kernel) -> bool {
    checks::baked_int(kernel.variant(), "delta_norm").unwrap_or(0) != 0
}

/// `residual` and `delta`, `out`: `[n_rows, n]` packed; `w`: `[n]`; `delta_w`: `[n]`, required
/// exactly when the variant has `delta_norm = 1`.
#[allow(clippy::too_many_arguments)]
pub fn add_rmsnorm(
    kernel: &Kernel,
    residual: &mut CudaViewMut<'_, f32>,
    delta: &CudaView<'_, f32>,
    delta_w: Option<&CudaView<'_, f32>>,
    w: &CudaView<'_, f32>,
    out: &mut CudaViewMut<'_, f32>,
    n_rows: usize,
    n: usize,
    eps: f32,
) -> Result<(), Error> {
    let threads = checks::threads(kernel, DEFAULT_THREADS)?;
    if n == 0 {
        return Err(checks::invalid(kernel, "n = 0"));
    }
    checks::check_dim(kernel, "n", n)?;
    let total = n_rows.checked_mul(n).ok_or_else(|| checks::invalid(kernel, "n_rows·n overflows"))?;
    checks::check_len(kernel, "residual", residual.len(), total)?;
    checks::check_len(kernel, "delta", delta.len(), total)?;
    checks::check_len(kernel, "w", w.len(), n)?;
    checks::check_len(kernel, "out", out.len(), total)?;
    let delta_w = match (delta_norm(kernel), delta_w) {
        (true, Some(dw)) => {
            checks::check_len(kernel, "delta_w", dw.len(), n)?;
            checks::check_aligned16(kernel, "delta_w", dw)?;
            dw.slice(..)
        }
        (true, None) => return Err(checks::invalid(kernel, "delta_norm = 1 needs delta_w")),
        (false, Some(_)) => return Err(checks::invalid(kernel, "delta_w given but the variant has delta_norm = 0")),
        // Not read by the kernel; any valid pointer fills the slot.
        (false, None) => w.slice(..),
    };
    checks::check_aligned16(kernel, "residual", residual)?;
    checks::check_aligned16(kernel, "delta", delta)?;
    checks::check_aligned16(kernel, "w", w)?;
    checks::check_aligned16(kernel, "out", out)?;
    if n_rows == 0 {
        return Ok(());
    }
    let mut args = AddRmsnormArgs {
        residual: residual.slice_mut(..),
        delta: delta.slice(..),
        delta_w,
        w: w.slice(..),
        out: out.slice_mut(..),
        n_rows: checks::to_i32(kernel, "n_rows", n_rows)?,
        n: checks::to_i32(kernel, "n", n)?,
        eps,
    };
    // SAFETY: residual, delta and out hold n_rows·n floats, w (and delta_w when read) n floats
    // (checked); the kernel touches rows < n_rows of its baked n = n (checked); block = THREADS.
    unsafe { launch(kernel, launch_config(threads, n_rows, n), &mut args) }
}
