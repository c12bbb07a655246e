//! argmax over logit rows, lowest index on ties (templates/memra/argmax.cuh: the top-k engine
//! with k = 1). Scratch and geometry as in [`crate::kernels::topk`].

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks;
use crate::kernels::launch::{KernelArgs, launch};
use crate::kernels::topk;

pub const FAMILY: &str = "argmax";
pub const DEFAULT_THREADS: u32 = 256;

/// Kernel parameters in order: `(const float* logits, int* out_idx, float* out_val,
/// void* scratch, int n_rows, int n_vocab)`.
#[derive(KernelArgs)]
#[kernel_args(family = "argmax")]
pub struct ArgmaxArgs<'a> {
    pub logits: CudaView<'a, f32>,
    pub out_idx: CudaViewMut<'a, i32>,
    pub out_val: CudaViewMut<'a, f32>,
    pub scratch: CudaViewMut<'a, u8>,
    pub n_rows: i32,
    pub n_vocab: i32,
}

pub fn launch_config(threads: u32, n_rows: usize, n_vocab: usize) -> LaunchConfig {
    topk::launch_config(threads, n_rows, n_vocab)
}

/// A zeroed scratch buffer for `n_rows` rows.
pub fn alloc_scratch(kernel: &Kernel, n_rows: usize, n_vocab: usize) -> Result<CudaSlice<u8>, Error> {
    topk::alloc_scratch(kernel, n_rows, n_vocab, 1)
}

/// Per row: `out_idx[r]` = index of the largest logit (lowest on ties), `out_val[r]` its value.
#[allow(clippy::too_many_arguments)]
pub fn argmax(
    kernel: &Kernel,
    logits: &CudaView<'_, f32>,
    out_idx: &mut CudaViewMut<'_, i32>,
    out_val: &mut CudaViewMut<'_, f32>,
    scratch: &mut CudaViewMut<'_, u8>,
    n_rows: usize,
    n_vocab: usize,
) -> Result<(), Error> {
    let threads = topk::check(kernel, logits.len(), scratch.len(), n_rows, n_vocab, 1)?;
    checks::check_len(kernel, "out_idx", out_idx.len(), n_rows)?;
    checks::check_len(kernel, "out_val", out_val.len(), n_rows)?;
    if n_rows == 0 {
        return Ok(());
    }
    let mut args = ArgmaxArgs {
        logits: logits.slice(..),
        out_idx: out_idx.slice_mut(..),
        out_val: out_val.slice_mut(..),
        scratch: scratch.slice_mut(..),
        n_rows: checks::to_i32(kernel, "n_rows", n_rows)?,
        n_vocab: checks::to_i32(kernel, "n_vocab", n_vocab)?,
    };
    // SAFETY: as topk with k = 1 (sizes, scratch and merge capacity checked; grid.x exact).
    unsafe { launch(kernel, launch_config(threads, n_rows, n_vocab), &mut args) }
}
