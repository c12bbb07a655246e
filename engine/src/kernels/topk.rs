//! topk / argmax over logit rows (templates/memra/topk.cuh, argmax.cuh): two stages in one
//! launch, block partials in a scratch buffer, the last block of a row merges.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks::{self, GRID_Y_MAX};
use crate::kernels::launch::{KernelArgs, launch};

pub const FAMILY: &str = "topk";
pub const DEFAULT_THREADS: u32 = 256;
/// Logits per thread in stage 1 (`topk_detail::ITEMS`).
pub const ITEMS: usize = 8;
/// Partials per thread in stage 2 (`topk_detail::MERGE_ITEMS`).
pub const MERGE_ITEMS: usize = 32;
pub const MAX_K: usize = 64;

/// Kernel parameters in order: `(const float* logits, float* out_val, int* out_idx,
/// void* scratch, int n_rows, int n_vocab, int k)`.
#[derive(KernelArgs)]
#[kernel_args(family = "topk")]
pub struct TopkArgs<'a> {
    pub logits: CudaView<'a, f32>,
    pub out_val: CudaViewMut<'a, f32>,
    pub out_idx: CudaViewMut<'a, i32>,
    pub scratch: CudaViewMut<'a, u8>,
    pub n_rows: i32,
    pub n_vocab: i32,
    pub k: i32,
}

/// Blocks per row.
pub fn blocks_per_row(threads: u32, n_vocab: usize) -> usize {
    n_vocab.div_ceil(ITEMS * threads as usize).max(1)
}

/// Scratch bytes for `n_rows` rows: u64 partials then u32 counters. Zero it once when allocated
/// ([`alloc_scratch`]); the kernel leaves the counters at zero.
pub fn scratch_bytes(threads: u32, n_rows: usize, n_vocab: usize, k: usize) -> usize {
    n_rows * blocks_per_row(threads, n_vocab) * k * 8 + n_rows * 4
}

/// A zeroed scratch buffer for `kernel` (topk or argmax; `k` = 1 for argmax).
pub fn alloc_scratch(kernel: &Kernel, n_rows: usize, n_vocab: usize, k: usize) -> Result<CudaSlice<u8>, Error> {
    let threads = checks::threads(kernel, DEFAULT_THREADS)?;
    kernel
        .stream()
        .alloc_zeros::<u8>(scratch_bytes(threads, n_rows, n_vocab, k).max(1))
        .map_err(|e| Error::Driver { call: "cuMemAlloc(topk scratch)".into(), detail: format!("{e:?}") })
}

pub fn launch_config(threads: u32, n_rows: usize, n_vocab: usize) -> LaunchConfig {
    let b = blocks_per_row(threads, n_vocab);
    checks::config((b as u32, checks::grid_dim(n_rows, 1, GRID_Y_MAX)), threads)
}

/// Shared checks of topk and argmax; returns the block size.
pub(crate) fn check(kernel: &Kernel, logits: usize, scratch: usize, n_rows: usize, n_vocab: usize, k: usize) -> Result<u32, Error> {
    let threads = checks::threads(kernel, DEFAULT_THREADS)?;
    checks::check_dim(kernel, "n_vocab", n_vocab)?;
    if n_vocab == 0 || k == 0 || k > MAX_K || k > n_vocab {
        return Err(checks::invalid(kernel, format!("need 1 <= k={k} <= min({MAX_K}, n_vocab={n_vocab})")));
    }
    let b = blocks_per_row(threads, n_vocab);
    if b * k > MERGE_ITEMS * threads as usize {
        return Err(checks::invalid(
            kernel,
            format!("n_vocab={n_vocab}, k={k}: {b} blocks × k partials exceed the merge capacity {}·threads", MERGE_ITEMS),
        ));
    }
    checks::check_len(kernel, "logits", logits, n_rows.checked_mul(n_vocab).ok_or_else(|| checks::invalid(kernel, "logits size overflows"))?)?;
    checks::check_len(kernel, "scratch (bytes)", scratch, scratch_bytes(threads, n_rows, n_vocab, k))?;
    Ok(threads)
}

/// The `k` largest logits of each row, descending (ties: lower index first): `out_val`,
/// `out_idx` are `[n_rows, k]`. `scratch` from [`alloc_scratch`] (zeroed once).
#[allow(clippy::too_many_arguments)]
pub fn topk(
    kernel: &Kernel,
    logits: &CudaView<'_, f32>,
    out_val: &mut CudaViewMut<'_, f32>,
    out_idx: &mut CudaViewMut<'_, i32>,
    scratch: &mut CudaViewMut<'_, u8>,
    n_rows: usize,
    n_vocab: usize,
    k: usize,
) -> Result<(), Error> {
    checks::check_dim(kernel, "k", k)?;
    let threads = check(kernel, logits.len(), scratch.len(), n_rows, n_vocab, k)?;
    checks::check_len(kernel, "out_val", out_val.len(), n_rows * k)?;
    checks::check_len(kernel, "out_idx", out_idx.len(), n_rows * k)?;
    if n_rows == 0 {
        return Ok(());
    }
    let mut args = TopkArgs {
        logits: logits.slice(..),
        out_val: out_val.slice_mut(..),
        out_idx: out_idx.slice_mut(..),
        scratch: scratch.slice_mut(..),
        n_rows: checks::to_i32(kernel, "n_rows", n_rows)?,
        n_vocab: checks::to_i32(kernel, "n_vocab", n_vocab)?,
        k: checks::to_i32(kernel, "k", k)?,
    };
    // SAFETY: logits hold n_rows·n_vocab floats, outputs n_rows·k, scratch the partials and
    // counters for this grid (checked, grid.x = blocks_per_row exactly as the kernel requires);
    // the merge capacity is checked; block = THREADS.
    unsafe { launch(kernel, launch_config(threads, n_rows, n_vocab), &mut args) }
}
