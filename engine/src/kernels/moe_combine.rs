//! moe_combine: the weighted sum that ends expert-grouped MoE prefill (templates/memra/moe_combine.cuh):
//! `out[t] = Σ_s weights[t, s] · y[rows[t, s]]`, in slot order.

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks::{self, GRID_Y_MAX};
use crate::kernels::launch::{KernelArgs, launch};

pub const FAMILY: &str = "moe_combine";
pub const DEFAULT_THREADS: u32 = 256;

/// Kernel parameters in order: `(const float* y, const int* rows, const float* weights,
/// float* out, int n_tokens, int n_used, int n, int y_rows)`.
#[derive(KernelArgs)]
#[kernel_args(family = "moe_combine")]
pub struct MoeCombineArgs<'a> {
    pub y: CudaView<'a, f32>,
    pub rows: CudaView<'a, i32>,
    pub weights: CudaView<'a, f32>,
    pub out: CudaViewMut<'a, f32>,
    pub n_tokens: i32,
    pub n_used: i32,
    pub n: i32,
    pub y_rows: i32,
}

pub fn launch_config(threads: u32, n_tokens: usize, n: usize) -> LaunchConfig {
    checks::config((checks::grid_dim(n, 4 * threads as usize, i32::MAX as u32), checks::grid_dim(n_tokens, 1, GRID_Y_MAX)), threads)
}

/// `out[t·n + i] = Σ_{s < n_used} weights[t·n_used + s] · y[rows[t·n_used + s]·n + i]` for
/// `t < n_tokens`; `y` holds `y.len() / n` rows and a row index outside them makes the token's
/// row NaN.
#[allow(clippy::too_many_arguments)]
pub fn moe_combine(
    kernel: &Kernel,
    y: &CudaView<'_, f32>,
    rows: &CudaView<'_, i32>,
    weights: &CudaView<'_, f32>,
    out: &mut CudaViewMut<'_, f32>,
    n_tokens: usize,
    n_used: usize,
    n: usize,
) -> Result<(), Error> {
    let threads = checks::threads(kernel, DEFAULT_THREADS)?;
    if n == 0 || n_used == 0 {
        return Err(checks::invalid(kernel, format!("n={n}, n_used={n_used}: both must be > 0")));
    }
    checks::check_dim(kernel, "n", n)?;
    if n_tokens == 0 {
        return Ok(());
    }
    let overflow = || checks::invalid(kernel, "sizes overflow");
    let pairs = n_tokens.checked_mul(n_used).ok_or_else(overflow)?;
    checks::check_len(kernel, "rows", rows.len(), pairs)?;
    checks::check_len(kernel, "weights", weights.len(), pairs)?;
    checks::check_len(kernel, "out", out.len(), n_tokens.checked_mul(n).ok_or_else(overflow)?)?;
    let y_rows = y.len() / n;
    let mut args = MoeCombineArgs {
        y: y.slice(..),
        rows: rows.slice(..),
        weights: weights.slice(..),
        out: out.slice_mut(..),
        n_tokens: checks::to_i32(kernel, "n_tokens", n_tokens)?,
        n_used: checks::to_i32(kernel, "n_used", n_used)?,
        n: checks::to_i32(kernel, "n", n)?,
        y_rows: checks::to_i32(kernel, "y rows", y_rows)?,
    };
    // SAFETY: rows / weights hold n_tokens·n_used entries and out n_tokens·n floats (checked);
    // y is read only at rows the kernel has checked against y_rows = y.len() / n.
    unsafe { launch(kernel, launch_config(threads, n_tokens, n), &mut args) }
}
