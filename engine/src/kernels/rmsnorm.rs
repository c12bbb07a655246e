//! rmsnorm: `out = x / sqrt(mean(x²) + eps) · w` over rows of `n` f32 (templates/memra/rmsnorm.cuh).

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks;
use crate::kernels::launch::{KernelArgs, launch};

pub const FAMILY: &str = "rmsnorm";
/// templates/README.md default of `THREADS`.
pub const DEFAULT_THREADS: u32 = 256;

/// Kernel parameters in order: `(const float* x, const float* w, float* out, int n_rows, int n, float eps)`.
#[derive(KernelArgs)]
#[kernel_args(family = "rmsnorm")]
pub struct RmsnormArgs<'a> {
    pub x: CudaView<'a, f32>,
    pub w: CudaView<'a, f32>,
    pub out: CudaViewMut<'a, f32>,
    pub n_rows: i32,
    pub n: i32,
    pub eps: f32,
}

/// Rows one block normalizes: a warp per row up to 1024 floats, a block per row beyond.
/// Shared with add_rmsnorm (same row engine).
pub fn rows_per_block(n: usize, threads: u32) -> usize {
    if n <= 1024 { threads as usize / 32 } else { 1 }
}

pub fn launch_config(threads: u32, n_rows: usize, n: usize) -> LaunchConfig {
    checks::config((checks::grid_dim(n_rows, rows_per_block(n, threads), i32::MAX as u32), 1), threads)
}

/// Normalizes `n_rows` rows of `x` (`[n_rows, n]`, packed) into `out` with weight `w` (`[n]`).
pub fn rmsnorm(
    kernel: &Kernel,
    x: &CudaView<'_, f32>,
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
    checks::check_len(kernel, "x", x.len(), total)?;
    checks::check_len(kernel, "w", w.len(), n)?;
    checks::check_len(kernel, "out", out.len(), total)?;
    checks::check_aligned16(kernel, "x", x)?;
    checks::check_aligned16(kernel, "w", w)?;
    checks::check_aligned16(kernel, "out", out)?;
    if n_rows == 0 {
        return Ok(());
    }
    let mut args = RmsnormArgs {
        x: x.slice(..),
        w: w.slice(..),
        out: out.slice_mut(..),
        n_rows: checks::to_i32(kernel, "n_rows", n_rows)?,
        n: checks::to_i32(kernel, "n", n)?,
        eps,
    };
    // SAFETY: x and out hold n_rows·n floats and w holds n (checked above); the kernel reads and
    // writes only rows < n_rows of length n (its baked n equals n, checked); the block size is
    // the variant's THREADS, as __launch_bounds__ requires.
    unsafe { launch(kernel, launch_config(threads, n_rows, n), &mut args) }
}
