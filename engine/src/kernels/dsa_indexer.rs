//! dsa_indexer: DeepSeek Sparse Attention lightning-indexer scores over the index-key cache
//! `[max_ctx, d_I]` (model-specs §8.1, §8.4 step 7), tensor-core form
//! (templates/memra/dsa_indexer.cuh).

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks::{self, GRID_Y_MAX};
use crate::kernels::launch::{KernelArgs, launch};
use crate::kernels::qk_norm_rope::CacheElem;

pub const FAMILY: &str = "dsa_indexer";
/// README default block size.
pub const THREADS: u32 = 256;
/// Template limits (`dsa_detail::MAX_HEADS`, `MAX_HD`).
pub const MAX_HEADS: usize = 64;
pub const MAX_HEAD_DIM: usize = 128;

/// Kernel parameters in order (see the template's header comment).
#[derive(KernelArgs)]
#[kernel_args(family = "dsa_indexer")]
pub struct DsaIndexerArgs<'a, C: CacheElem> {
    pub q: CudaView<'a, f32>,
    pub w: CudaView<'a, f32>,
    pub kcache: CudaView<'a, C>,
    pub pos: CudaView<'a, i32>,
    pub scores: CudaViewMut<'a, f32>,
    pub n_q: i32,
    pub n_idx_head: i32,
    pub idx_head_dim: i32,
    pub max_ctx: i32,
    pub ld_scores: i32,
}

/// The run-time numbers of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DsaIndexerParams {
    /// Query rows (1 for decode).
    pub n_q: usize,
    pub n_idx_head: usize,
    pub idx_head_dim: usize,
    /// Rows of the index-key cache.
    pub max_ctx: usize,
    /// Row stride of `scores` (≥ max_ctx).
    pub ld_scores: usize,
    /// Blocks per query row (grid.x), see [`blocks_for`].
    pub n_blk: usize,
}

/// Tokens one warp scores per tile: 32 for a bf16 cache, 16 for f32.
pub fn tile_tokens(elem_bytes: usize) -> usize {
    if elem_bytes == 2 { 32 } else { 16 }
}

/// Blocks per query for up to `max_len` visible keys: enough for one tile per warp, at most
/// one per multiprocessor (one block fills one: its warps keep the next tile's keys in flight
/// while multiplying the current one, and stride over the tiles).
pub fn blocks_for(max_len: usize, elem_bytes: usize, threads: u32, sm_count: usize) -> usize {
    let per_block = tile_tokens(elem_bytes) * (threads as usize / 32);
    max_len.div_ceil(per_block).clamp(1, sm_count.max(1))
}

/// Bytes of index keys one query reads for `visible` keys (the bandwidth figure).
pub fn key_bytes(visible: usize, head_dim: usize, elem_bytes: usize) -> usize {
    visible * head_dim * elem_bytes
}

pub fn launch_config(p: &DsaIndexerParams, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (p.n_blk as u32, p.n_q as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Index scores for `n_q` queries at device positions `pos[t]`: `q` `[n_q, H_I, d_I]`, `w`
/// `[n_q, H_I]`, `kcache` `[max_ctx, d_I]`, `scores` `[n_q, ld_scores]` (row t written on
/// `[0, pos[t]]`).
pub fn dsa_indexer<C: CacheElem>(
    kernel: &Kernel,
    q: &CudaView<'_, f32>,
    w: &CudaView<'_, f32>,
    kcache: &CudaView<'_, C>,
    pos: &CudaView<'_, i32>,
    scores: &mut CudaViewMut<'_, f32>,
    p: &DsaIndexerParams,
) -> Result<(), Error> {
    let threads = checks::threads(kernel, THREADS)?;
    checks::cache_type::<C>(kernel, "key cache buffer")?;
    if p.n_idx_head == 0 || !p.n_idx_head.is_multiple_of(8) || p.n_idx_head > MAX_HEADS {
        return Err(checks::invalid(
            kernel,
            format!(
                "n_idx_head={} (needs a multiple of 8, <= {MAX_HEADS})",
                p.n_idx_head
            ),
        ));
    }
    if p.idx_head_dim == 0 || !p.idx_head_dim.is_multiple_of(32) || p.idx_head_dim > MAX_HEAD_DIM {
        return Err(checks::invalid(
            kernel,
            format!(
                "idx_head_dim={} (needs a multiple of 32, <= {MAX_HEAD_DIM})",
                p.idx_head_dim
            ),
        ));
    }
    if p.n_q == 0 || p.n_q > GRID_Y_MAX as usize || p.max_ctx == 0 || p.n_blk == 0 {
        return Err(checks::invalid(
            kernel,
            format!(
                "n_q={} (1..={GRID_Y_MAX}), max_ctx={}, n_blk={} must be positive",
                p.n_q, p.max_ctx, p.n_blk
            ),
        ));
    }
    if p.ld_scores < p.max_ctx {
        return Err(checks::invalid(
            kernel,
            format!("ld_scores={} < max_ctx={}", p.ld_scores, p.max_ctx),
        ));
    }
    checks::check_dim(kernel, "n_idx_head", p.n_idx_head)?;
    checks::check_dim(kernel, "idx_head_dim", p.idx_head_dim)?;
    let (nh, hd) = (p.n_idx_head, p.idx_head_dim);
    checks::check_len(kernel, "q", q.len(), p.n_q * nh * hd)?;
    checks::check_len(kernel, "w", w.len(), p.n_q * nh)?;
    checks::check_len(kernel, "pos", pos.len(), p.n_q)?;
    let kc_n = p
        .max_ctx
        .checked_mul(hd)
        .ok_or_else(|| checks::invalid(kernel, "key cache size overflows"))?;
    checks::check_len(kernel, "kcache", kcache.len(), kc_n)?;
    let sc_n = p
        .n_q
        .checked_mul(p.ld_scores)
        .ok_or_else(|| checks::invalid(kernel, "scores size overflows"))?;
    checks::check_len(kernel, "scores", scores.len(), sc_n)?;
    checks::check_aligned16(kernel, "q", q)?;
    checks::check_aligned16(kernel, "kcache", kcache)?;
    let mut args = DsaIndexerArgs {
        q: q.slice(..),
        w: w.slice(..),
        kcache: kcache.slice(..),
        pos: pos.slice(..),
        scores: scores.slice_mut(..),
        n_q: checks::to_i32(kernel, "n_q", p.n_q)?,
        n_idx_head: checks::to_i32(kernel, "n_idx_head", nh)?,
        idx_head_dim: checks::to_i32(kernel, "idx_head_dim", hd)?,
        max_ctx: checks::to_i32(kernel, "max_ctx", p.max_ctx)?,
        ld_scores: checks::to_i32(kernel, "ld_scores", p.ld_scores)?,
    };
    let cfg = launch_config(p, threads);
    if cfg.grid_dim.0 as usize != p.n_blk {
        return Err(checks::invalid(
            kernel,
            format!("n_blk={} too large", p.n_blk),
        ));
    }
    // SAFETY: q holds n_q·H_I·d_I floats and w n_q·H_I (16-byte aligned q), kcache max_ctx·d_I
    // elements of the variant's type (aligned), scores n_q·ld_scores with ld_scores ≥ max_ctx;
    // the kernel reads key rows ≤ pos[t] < max_ctx and writes scores[t][0..max_ctx) at most.
    unsafe { launch(kernel, cfg, &mut args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_rule() {
        // 131072 keys, bf16: 4096 tiles of 32 over 8 warps = 512 blocks, capped at one per SM.
        assert_eq!(blocks_for(131_072, 2, 256, 132), 132);
        assert_eq!(blocks_for(2000, 2, 256, 132), 8);
        assert_eq!(blocks_for(1, 4, 256, 132), 1);
        assert_eq!(key_bytes(131_072, 128, 2), 32 << 20);
    }
}
