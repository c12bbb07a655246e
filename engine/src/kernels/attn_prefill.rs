//! attn_prefill: causal GQA prefill attention of a chunk of tokens over the KV cache
//! `[max_ctx, n_kv, head_dim]` of one sequence, with an optional sliding window, on tensor cores
//! (FlashAttention-2 structure; templates/memra/attn_prefill.cuh). bf16 products: q, an f32
//! cache and the softmax weights are rounded to bf16 for the mma; softmax and sums are f32.

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::attn_decode::check_gqa;
use crate::kernels::checks::{self, GRID_Y_MAX};
use crate::kernels::launch::{KernelArgs, launch};
use crate::kernels::qk_norm_rope::CacheElem;

pub const FAMILY: &str = "attn_prefill";
/// The template's only block size (4 warps × 16 query rows).
pub const THREADS: u32 = 128;
/// Keys per tile (`BN`), and the padding of a shared-memory row (`PAD`, bf16 elements).
pub const KEYS_PER_TILE: usize = 64;
const PAD: usize = 8;
/// Head sizes the template implements.
pub const HEAD_DIMS: [usize; 3] = crate::kernels::attn_decode::HEAD_DIMS;
/// Largest dynamic shared memory per block on sm_90 (227 KiB).
pub const MAX_SMEM: usize = 232_448;
const GRID_X_MAX: usize = i32::MAX as usize;

/// Kernel parameters in order (see the template's header comment).
#[derive(KernelArgs)]
#[kernel_args(family = "attn_prefill")]
pub struct AttnPrefillArgs<'a, C: CacheElem> {
    pub q: CudaView<'a, f32>,
    pub k_cache: CudaView<'a, C>,
    pub v_cache: CudaView<'a, C>,
    pub out: CudaViewMut<'a, f32>,
    pub n_tokens: i32,
    pub head_dim: i32,
    pub n_head: i32,
    pub n_kv: i32,
    pub max_ctx: i32,
    pub pos0: i32,
    pub window: i32,
    pub scale: f32,
}

/// The run-time numbers of one launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnPrefillParams {
    /// Query tokens T of this chunk.
    pub n_tokens: usize,
    pub head_dim: usize,
    pub n_head: usize,
    pub n_kv: usize,
    /// Rows of each cache.
    pub max_ctx: usize,
    /// Position of the first query token (query t is at pos0 + t; rows before pos0 hold the
    /// earlier chunks).
    pub pos0: usize,
    /// Sliding window (key `s` is visible to position `p` iff `s ≤ p` and `p − s < window`);
    /// `None` = causal only.
    pub window: Option<usize>,
    /// Softmax scale applied to q·k (1.0 when q was pre-scaled, as gemma3 does).
    pub scale: f32,
}

/// Query rows (token, head-of-group pairs) per block (`BM` in the template): 128 up to head_dim
/// 128 (two 16-row m-tiles per warp), 64 at 256.
pub fn rows_per_block(head_dim: usize) -> usize {
    if head_dim <= 128 { 128 } else { 64 }
}

/// Dynamic shared memory of one block: Q, K and V bf16 tiles with padded rows.
pub fn smem_bytes(head_dim: usize) -> usize {
    (rows_per_block(head_dim) + 2 * KEYS_PER_TILE) * (head_dim + PAD) * 2
}

/// Blocks along grid.x: tiles of [`rows_per_block`] of the `n_tokens · G` (token,
/// head-of-group) rows.
pub fn row_tiles(n_tokens: usize, head_dim: usize, n_head: usize, n_kv: usize) -> usize {
    (n_tokens * (n_head / n_kv.max(1))).div_ceil(rows_per_block(head_dim))
}

/// Keys query `t` of the chunk sees.
pub fn visible_keys(p: &AttnPrefillParams, t: usize) -> usize {
    let pos = p.pos0 + t;
    p.window.map_or(pos + 1, |w| w.min(pos + 1))
}

/// Useful floating-point operations of one launch: 2·hd for q·k and 2·hd for p·v per visible
/// (query head, key) pair (masked work the kernel skips or wastes on diagonal tiles not counted).
pub fn flops(p: &AttnPrefillParams) -> u64 {
    let pairs: u64 = (0..p.n_tokens).map(|t| visible_keys(p, t) as u64).sum();
    4 * p.head_dim as u64 * p.n_head as u64 * pairs
}

pub fn launch_config(p: &AttnPrefillParams) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            row_tiles(p.n_tokens, p.head_dim, p.n_head, p.n_kv) as u32,
            p.n_kv as u32,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem_bytes(p.head_dim) as u32,
    }
}

/// Prefill attention: `q` / `out` `[n_tokens, n_head, hd]` f32, caches `[max_ctx, n_kv, hd]`
/// of the variant's `cache_t` with rows `0 .. pos0 + n_tokens` filled (this chunk's rows written
/// by qk_norm_rope). Every length, alignment and dim is checked; errors name the kernel and the
/// argument.
#[allow(clippy::too_many_arguments)]
pub fn attn_prefill<C: CacheElem>(
    kernel: &Kernel,
    q: &CudaView<'_, f32>,
    k_cache: &CudaView<'_, C>,
    v_cache: &CudaView<'_, C>,
    out: &mut CudaViewMut<'_, f32>,
    p: &AttnPrefillParams,
) -> Result<(), Error> {
    let threads = checks::threads(kernel, THREADS)?;
    if threads != THREADS {
        return Err(checks::invalid(
            kernel,
            format!("threads={threads} (the template needs {THREADS})"),
        ));
    }
    check_gqa::<C>(kernel, p.head_dim, p.n_head, p.n_kv, p.window)?;
    if p.max_ctx == 0 {
        return Err(checks::invalid(kernel, "max_ctx = 0"));
    }
    let end = p
        .pos0
        .checked_add(p.n_tokens)
        .ok_or_else(|| checks::invalid(kernel, "pos0 + n_tokens overflows"))?;
    if end > p.max_ctx {
        return Err(checks::invalid(
            kernel,
            format!(
                "pos0={} + n_tokens={} runs past max_ctx={}",
                p.pos0, p.n_tokens, p.max_ctx
            ),
        ));
    }
    if p.n_kv > GRID_Y_MAX as usize {
        return Err(checks::invalid(
            kernel,
            format!("n_kv={} > {GRID_Y_MAX} (grid.y)", p.n_kv),
        ));
    }
    checks::check_dim(kernel, "head_dim", p.head_dim)?;
    checks::check_dim(kernel, "n_head", p.n_head)?;
    checks::check_dim(kernel, "n_kv", p.n_kv)?;
    // The kernel indexes the n_tokens·G rows of a kv head with an int.
    let rows = p.n_tokens.checked_mul(p.n_head / p.n_kv);
    if rows.is_none_or(|r| r + rows_per_block(p.head_dim) > GRID_X_MAX) {
        return Err(checks::invalid(
            kernel,
            format!(
                "n_tokens={} × {} heads per kv head does not fit the kernel's int rows",
                p.n_tokens,
                p.n_head / p.n_kv
            ),
        ));
    }
    let smem = smem_bytes(p.head_dim);
    if smem > MAX_SMEM {
        return Err(checks::invalid(
            kernel,
            format!("needs {smem} bytes of shared memory (> {MAX_SMEM})"),
        ));
    }
    let qn = p
        .n_tokens
        .checked_mul(p.n_head * p.head_dim)
        .ok_or_else(|| checks::invalid(kernel, "q size overflows"))?;
    let cache_n = p
        .max_ctx
        .checked_mul(p.n_kv * p.head_dim)
        .ok_or_else(|| checks::invalid(kernel, "cache size overflows"))?;
    checks::check_len(kernel, "q", q.len(), qn)?;
    checks::check_len(kernel, "out", out.len(), qn)?;
    checks::check_len(kernel, "k_cache", k_cache.len(), cache_n)?;
    checks::check_len(kernel, "v_cache", v_cache.len(), cache_n)?;
    checks::check_aligned16(kernel, "q", q)?;
    checks::check_aligned16(kernel, "out", out)?;
    checks::check_aligned16(kernel, "k_cache", k_cache)?;
    checks::check_aligned16(kernel, "v_cache", v_cache)?;
    if p.n_tokens == 0 {
        return Ok(());
    }
    crate::kernels::matvec::allow_smem(kernel, smem as u32)?;
    let mut args = AttnPrefillArgs {
        q: q.slice(..),
        k_cache: k_cache.slice(..),
        v_cache: v_cache.slice(..),
        out: out.slice_mut(..),
        n_tokens: checks::to_i32(kernel, "n_tokens", p.n_tokens)?,
        head_dim: checks::to_i32(kernel, "head_dim", p.head_dim)?,
        n_head: checks::to_i32(kernel, "n_head", p.n_head)?,
        n_kv: checks::to_i32(kernel, "n_kv", p.n_kv)?,
        max_ctx: checks::to_i32(kernel, "max_ctx", p.max_ctx)?,
        pos0: checks::to_i32(kernel, "pos0", p.pos0)?,
        window: checks::to_i32(kernel, "window", p.window.unwrap_or(0))?,
        scale: p.scale,
    };
    // SAFETY: q/out hold n_tokens·n_head·hd floats and the caches max_ctx·n_kv·hd elements of the
    // variant's cache type, all 16-byte aligned (checked above); the kernel reads cache rows
    // < pos0 + n_tokens ≤ max_ctx only; the dims match the baked ones; the block size is 128 and
    // the dynamic shared memory is the template's formula with the function's limit raised to it.
    unsafe { launch(kernel, launch_config(p), &mut args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smem_and_grid_match_the_template_formulas() {
        assert_eq!(smem_bytes(64), 36_864);
        assert_eq!(smem_bytes(128), 69_632);
        assert_eq!(smem_bytes(256), 101_376);
        // gemma3 (hd 256, G = 4): 16 tokens per block; Qwen3-8B (hd 128, G = 4): 32; G = 8: 16.
        assert_eq!(row_tiles(512, 256, 4, 1), 32);
        assert_eq!(row_tiles(4096, 128, 32, 8), 128);
        assert_eq!(row_tiles(7, 128, 32, 8), 1);
        assert_eq!(row_tiles(2049, 128, 64, 8), 129);
    }

    #[test]
    fn flops_count_visible_pairs() {
        let p = AttnPrefillParams {
            n_tokens: 3,
            head_dim: 128,
            n_head: 2,
            n_kv: 1,
            max_ctx: 16,
            pos0: 4,
            window: Some(6),
            scale: 1.0,
        };
        // positions 4, 5, 6 see 5, 6, 6 keys.
        assert_eq!(flops(&p), 4 * 128 * 2 * (5 + 6 + 6));
        assert_eq!(
            flops(&AttnPrefillParams { window: None, ..p }),
            4 * 128 * 2 * (5 + 6 + 7)
        );
    }
}
