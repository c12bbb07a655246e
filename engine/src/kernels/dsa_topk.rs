//! dsa_topk: exact top-k of DSA index scores per query row, ascending indices, ties toward the
//! lower index (memra_reference::dsa::top_k's rule), radix select in one block per row
//! (templates/memra/dsa_topk.cuh).

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks;
use crate::kernels::launch::{KernelArgs, launch};

pub const FAMILY: &str = "dsa_topk";
/// README default block size.
pub const THREADS: u32 = 1024;

/// Kernel parameters in order (see the template's header comment).
#[derive(KernelArgs)]
#[kernel_args(family = "dsa_topk")]
pub struct DsaTopkArgs<'a> {
    pub scores: CudaView<'a, f32>,
    pub pos: CudaView<'a, i32>,
    pub idx: CudaViewMut<'a, i32>,
    pub count: CudaViewMut<'a, i32>,
    pub n_q: i32,
    pub ld_scores: i32,
    pub k: i32,
}

/// The run-time numbers of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DsaTopkParams {
    pub n_q: usize,
    /// Row stride of `scores`.
    pub ld_scores: usize,
    /// k (GLM-5: `attention.indexer.top_k` = 2048).
    pub k: usize,
}

pub fn launch_config(p: &DsaTopkParams, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (p.n_q as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Per query row t: `idx[t][0..count[t])` = the `count[t] = min(k, pos[t] + 1)` selected keys of
/// `scores[t][0..=pos[t]]`, ascending; `idx` `[n_q, k]`, `count` `[n_q]`.
pub fn dsa_topk(
    kernel: &Kernel,
    scores: &CudaView<'_, f32>,
    pos: &CudaView<'_, i32>,
    idx: &mut CudaViewMut<'_, i32>,
    count: &mut CudaViewMut<'_, i32>,
    p: &DsaTopkParams,
) -> Result<(), Error> {
    let threads = checks::threads(kernel, THREADS)?;
    if threads < 256 {
        return Err(checks::invalid(
            kernel,
            format!("threads={threads}, the template needs >= 256"),
        ));
    }
    if p.n_q == 0 || p.n_q > i32::MAX as usize || p.k == 0 || p.ld_scores == 0 {
        return Err(checks::invalid(
            kernel,
            format!(
                "n_q={}, k={}, ld_scores={} must be positive",
                p.n_q, p.k, p.ld_scores
            ),
        ));
    }
    checks::check_dim(kernel, "k", p.k)?;
    let sc_n = p
        .n_q
        .checked_mul(p.ld_scores)
        .ok_or_else(|| checks::invalid(kernel, "scores size overflows"))?;
    checks::check_len(kernel, "scores", scores.len(), sc_n)?;
    checks::check_len(kernel, "pos", pos.len(), p.n_q)?;
    let idx_n = p
        .n_q
        .checked_mul(p.k)
        .ok_or_else(|| checks::invalid(kernel, "idx size overflows"))?;
    checks::check_len(kernel, "idx", idx.len(), idx_n)?;
    checks::check_len(kernel, "count", count.len(), p.n_q)?;
    let mut args = DsaTopkArgs {
        scores: scores.slice(..),
        pos: pos.slice(..),
        idx: idx.slice_mut(..),
        count: count.slice_mut(..),
        n_q: checks::to_i32(kernel, "n_q", p.n_q)?,
        ld_scores: checks::to_i32(kernel, "ld_scores", p.ld_scores)?,
        k: checks::to_i32(kernel, "k", p.k)?,
    };
    checks::to_i32(kernel, "n_q·k", idx_n)?;
    // SAFETY: scores holds n_q·ld_scores floats, idx n_q·k and count n_q ints; the kernel reads
    // scores[t][0..=pos[t]] only when pos[t] < ld_scores and writes idx[t][0..k), count[t].
    unsafe { launch(kernel, launch_config(p, threads), &mut args) }
}
