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
/// void* scratch, int n_rows, int n_vocab, int* next_token, int* next_pos, int* history, int history_len)`;
/// the last four are a [`DecodeFeed`] (its three buffers and the history's length), or null and 0.
#[derive(KernelArgs)]
#[kernel_args(family = "argmax")]
pub struct ArgmaxArgs<'a> {
    pub logits: CudaView<'a, f32>,
    pub out_idx: CudaViewMut<'a, i32>,
    pub out_val: CudaViewMut<'a, f32>,
    pub scratch: CudaViewMut<'a, u8>,
    pub n_rows: i32,
    pub n_vocab: i32,
    pub next_token: u64,
    pub next_pos: u64,
    pub history: u64,
    pub history_len: i32,
}

/// Where a decode step's argmax also goes, so that the next greedy step can be enqueued before
/// the host has read this one's token: the step's token and position buffers (one element each)
/// and a token history (one entry per position). The kernel sets p = pos + 1, pos = p,
/// token = the argmax (0 when every logit is NaN) and, when 0 ≤ p < history.len(), history[p] = the
/// same.
pub struct DecodeFeed<'a> {
    pub token: &'a mut CudaSlice<i32>,
    pub pos: &'a mut CudaSlice<i32>,
    pub history: &'a mut CudaSlice<i32>,
}

pub fn launch_config(threads: u32, n_rows: usize, n_vocab: usize) -> LaunchConfig {
    topk::launch_config(threads, n_rows, n_vocab)
}

/// A zeroed scratch buffer for `n_rows` rows.
pub fn alloc_scratch(kernel: &Kernel, n_rows: usize, n_vocab: usize) -> Result<CudaSlice<u8>, Error> {
    topk::alloc_scratch(kernel, n_rows, n_vocab, 1)
}

/// Per row: `out_idx[r]` = index of the largest logit (lowest on ties), `out_val[r]` its value;
/// with a `feed` (one row only), row 0's index also feeds the next decode step.
#[allow(clippy::too_many_arguments)]
pub fn argmax(
    kernel: &Kernel,
    logits: &CudaView<'_, f32>,
    out_idx: &mut CudaViewMut<'_, i32>,
    out_val: &mut CudaViewMut<'_, f32>,
    scratch: &mut CudaViewMut<'_, u8>,
    n_rows: usize,
    n_vocab: usize,
    feed: Option<DecodeFeed<'_>>,
) -> Result<(), Error> {
    let threads = topk::check(kernel, logits.len(), scratch.len(), n_rows, n_vocab, 1)?;
    checks::check_len(kernel, "out_idx", out_idx.len(), n_rows)?;
    checks::check_len(kernel, "out_val", out_val.len(), n_rows)?;
    let (next_token, next_pos, history, history_len) = match &feed {
        Some(f) => {
            if n_rows != 1 {
                return Err(checks::invalid(kernel, format!("a decode feed takes one row, not {n_rows}")));
            }
            checks::check_len(kernel, "next_token", f.token.len(), 1)?;
            checks::check_len(kernel, "next_pos", f.pos.len(), 1)?;
            let token = checks::device_addr(kernel, &*f.token);
            let (pos, history) = (checks::device_addr(kernel, &*f.pos), checks::device_addr(kernel, &*f.history));
            (token, pos, history, checks::to_i32(kernel, "history length", f.history.len())?)
        }
        None => (0, 0, 0, 0),
    };
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
        next_token,
        next_pos,
        history,
        history_len,
    };
    // SAFETY: as topk with k = 1 (sizes, scratch and merge capacity checked; grid.x exact). A
    // feed's token and position hold an element each (checked) and the kernel writes the history
    // only below history_len; all three are device buffers of this context.
    unsafe { launch(kernel, launch_config(threads, n_rows, n_vocab), &mut args) }
}
