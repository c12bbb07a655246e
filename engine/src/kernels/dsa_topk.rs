//! dsa_topk: exact top-k of DSA index scores per query row, ascending indices, ties toward the
//! lower index (memra_reference::dsa::top_k's rule), radix select by `n_blk` blocks per row that
//! meet at grid barriers (templates/memra/dsa_topk.cuh).

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks::{self, GRID_Y_MAX};
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
    pub scratch: CudaViewMut<'a, u32>,
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
    /// Blocks per row (grid.x), from [`blocks_for`]; 1 = one block per row, no scratch.
    pub n_blk: usize,
}

/// Candidate list capacity per row (`CAND_CAP` in the template).
pub const CAND_CAP: usize = 4096;

/// Words of one row's scratch (`row_words` in the template): counters, three histograms of
/// 2048 bins, two counts per block, the candidate list (keys and indices).
pub fn row_words(n_blk: usize) -> usize {
    32 + 3 * 2048 + 2 * n_blk + 2 * CAND_CAP
}

/// u32 words of the scratch a launch with `n_blk > 1` needs (0 for `n_blk == 1`). Allocate it
/// zeroed once: every launch leaves it zero, so one buffer serves every later launch with at
/// most `n_q` rows and `n_blk` blocks per row (on one stream).
pub fn scratch_words(n_q: usize, n_blk: usize) -> usize {
    if n_blk <= 1 {
        0
    } else {
        n_q * row_words(n_blk)
    }
}

/// Keys a block of a multi-block row takes at least.
pub const MIN_KEYS_PER_BLOCK: usize = 1024;

/// Blocks per row for `n_q` rows of up to `max_visible` keys on `sm_count` multiprocessors: the
/// rows' blocks wait for each other, so all `n_blk · n_q` must be resident at once (at most one
/// per multiprocessor); many rows (prefill) get one block each.
pub fn blocks_for(n_q: usize, max_visible: usize, sm_count: usize) -> usize {
    if n_q == 0 || 2 * n_q > sm_count {
        return 1;
    }
    (sm_count / n_q)
        .min(max_visible.div_ceil(MIN_KEYS_PER_BLOCK))
        .max(1)
}

pub fn launch_config(p: &DsaTopkParams, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (p.n_blk as u32, p.n_q.min(GRID_Y_MAX as usize) as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Per query row t: `idx[t][0..count[t])` = the `count[t] = min(k, pos[t] + 1)` selected keys of
/// `scores[t][0..=pos[t]]`, ascending; `idx` `[n_q, k]`, `count` `[n_q]`; `scratch` at least
/// [`scratch_words`]`(n_q, n_blk)` words, zeroed when allocated (may be empty for `n_blk == 1`).
/// With `n_blk > 1` the caller guarantees `n_blk · n_q` ≤ the multiprocessor count
/// ([`blocks_for`]) and no concurrent launch sharing `scratch`.
pub fn dsa_topk(
    kernel: &Kernel,
    scores: &CudaView<'_, f32>,
    pos: &CudaView<'_, i32>,
    idx: &mut CudaViewMut<'_, i32>,
    count: &mut CudaViewMut<'_, i32>,
    scratch: &mut CudaViewMut<'_, u32>,
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
    if p.n_blk == 0 || p.n_blk > i32::MAX as usize || (p.n_blk > 1 && p.n_q > GRID_Y_MAX as usize) {
        return Err(checks::invalid(
            kernel,
            format!(
                "n_blk={} (n_q={}): must be >= 1, and several blocks per row need n_q <= {GRID_Y_MAX}",
                p.n_blk, p.n_q
            ),
        ));
    }
    if p.n_blk > 1 {
        // The blocks of a row wait for each other: all must be resident at once.
        let sms = crate::kernels::mla_decode::sm_count(kernel)?;
        if p.n_blk.saturating_mul(p.n_q) > sms {
            return Err(checks::invalid(
                kernel,
                format!(
                    "n_blk={} x n_q={} blocks exceed the {sms} multiprocessors (they must all be resident: use blocks_for)",
                    p.n_blk, p.n_q
                ),
            ));
        }
    }
    checks::check_len(
        kernel,
        "scratch",
        scratch.len(),
        scratch_words(p.n_q, p.n_blk),
    )?;
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
        scratch: scratch.slice_mut(..),
        n_q: checks::to_i32(kernel, "n_q", p.n_q)?,
        ld_scores: checks::to_i32(kernel, "ld_scores", p.ld_scores)?,
        k: checks::to_i32(kernel, "k", p.k)?,
    };
    checks::to_i32(kernel, "n_q·k", idx_n)?;
    // SAFETY: scores holds n_q·ld_scores floats, idx n_q·k and count n_q ints, scratch
    // scratch_words(n_q, n_blk) words; the kernel reads scores[t][0..=pos[t]] only when pos[t] <
    // ld_scores, writes idx[t][0..k), count[t], and touches scratch only when n_blk > 1.
    unsafe { launch(kernel, launch_config(p, threads), &mut args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_rule_and_scratch() {
        // One decode row of 131072 keys: 128 blocks of 1024 keys; a 40000-key row: 40.
        assert_eq!(blocks_for(1, 131_072, 132), 128);
        assert_eq!(blocks_for(1, 40_000, 132), 40);
        assert_eq!(blocks_for(1, 5_000_000, 132), 132);
        // Rows share the multiprocessors; many rows get one block each.
        assert_eq!(blocks_for(4, 131_072, 132), 33);
        assert_eq!(blocks_for(67, 131_072, 132), 1);
        assert_eq!(blocks_for(1, 100, 132), 1);
        assert_eq!(scratch_words(1, 1), 0);
        assert_eq!(scratch_words(2, 128), 2 * (32 + 3 * 2048 + 256 + 8192));
    }
}
