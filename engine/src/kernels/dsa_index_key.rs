//! dsa_index_key: the DSA index-key producer — LayerNorm of the `indexer.attn_k` projection,
//! RoPE on its leading rope dims, write to the index-key cache `[max_ctx, d_I]` at each token's
//! position (model-specs §8.4 steps 3 and 5; templates/memra/dsa_index_key.cuh).

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks;
use crate::kernels::launch::{KernelArgs, launch};
use crate::kernels::qk_norm_rope::CacheElem;

pub const FAMILY: &str = "dsa_index_key";
/// README default block size.
pub const THREADS: u32 = 128;
/// Template limit (`CAP`).
pub const MAX_HEAD_DIM: usize = 256;

/// Kernel parameters in order (see the template's header comment).
#[derive(KernelArgs)]
#[kernel_args(family = "dsa_index_key")]
pub struct DsaIndexKeyArgs<'a, C: CacheElem> {
    pub k: CudaView<'a, f32>,
    pub weight: CudaView<'a, f32>,
    pub bias: CudaView<'a, f32>,
    pub pos: CudaView<'a, i32>,
    pub kcache: CudaViewMut<'a, C>,
    pub n_tokens: i32,
    pub head_dim: i32,
    pub n_rot: i32,
    pub k_stride: i32,
    pub max_ctx: i32,
    pub freq_base: f32,
    pub freq_scale: f32,
    pub eps: f32,
}

/// The run-time numbers of one launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DsaIndexKeyParams {
    pub n_tokens: usize,
    pub head_dim: usize,
    /// Roped dims (ignored by ROPE_MODE none variants).
    pub n_rot: usize,
    /// Floats between token rows of `k` (≥ head_dim).
    pub k_stride: usize,
    pub max_ctx: usize,
    pub freq_base: f32,
    pub freq_scale: f32,
    /// LayerNorm eps (1e-6 for the DeepSeek / GLM indexer).
    pub eps: f32,
}

/// Blocks for `n_tokens` tokens, a warp each, at most 65535.
pub fn blocks_for(n_tokens: usize, threads: u32) -> u32 {
    checks::grid_dim(n_tokens, threads as usize / 32, 65_535)
}

/// Normalizes, ropes and caches `n_tokens` index keys: `k` rows of `k_stride` floats,
/// `weight` / `bias` `[head_dim]`, `pos` `[n_tokens]` (device), `kcache` `[max_ctx, head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn dsa_index_key<C: CacheElem>(
    kernel: &Kernel,
    k: &CudaView<'_, f32>,
    weight: &CudaView<'_, f32>,
    bias: &CudaView<'_, f32>,
    pos: &CudaView<'_, i32>,
    kcache: &mut CudaViewMut<'_, C>,
    p: &DsaIndexKeyParams,
) -> Result<(), Error> {
    let threads = checks::threads(kernel, THREADS)?;
    checks::cache_type::<C>(kernel, "key cache buffer")?;
    let roped = checks::required_sym(kernel, "rope_mode")? != "none";
    if p.head_dim == 0 || p.head_dim > MAX_HEAD_DIM {
        return Err(checks::invalid(
            kernel,
            format!("head_dim={} (needs 1..={MAX_HEAD_DIM})", p.head_dim),
        ));
    }
    if roped && (p.n_rot == 0 || !p.n_rot.is_multiple_of(2) || p.n_rot > p.head_dim) {
        return Err(checks::invalid(
            kernel,
            format!(
                "n_rot={} (needs an even count in 2..=head_dim {})",
                p.n_rot, p.head_dim
            ),
        ));
    }
    if p.n_tokens == 0 || p.max_ctx == 0 || p.k_stride < p.head_dim {
        return Err(checks::invalid(
            kernel,
            format!(
                "n_tokens={}, max_ctx={} must be positive, k_stride={} >= head_dim={}",
                p.n_tokens, p.max_ctx, p.k_stride, p.head_dim
            ),
        ));
    }
    checks::check_dim(kernel, "head_dim", p.head_dim)?;
    if roped {
        checks::check_dim(kernel, "n_rot", p.n_rot)?;
    }
    checks::check_len(
        kernel,
        "k",
        k.len(),
        (p.n_tokens - 1) * p.k_stride + p.head_dim,
    )?;
    checks::check_len(kernel, "weight", weight.len(), p.head_dim)?;
    checks::check_len(kernel, "bias", bias.len(), p.head_dim)?;
    checks::check_len(kernel, "pos", pos.len(), p.n_tokens)?;
    let kc_n = p
        .max_ctx
        .checked_mul(p.head_dim)
        .ok_or_else(|| checks::invalid(kernel, "key cache size overflows"))?;
    checks::check_len(kernel, "kcache", kcache.len(), kc_n)?;
    checks::to_i32(kernel, "n_tokens·k_stride", p.n_tokens * p.k_stride)?;
    let mut args = DsaIndexKeyArgs {
        k: k.slice(..),
        weight: weight.slice(..),
        bias: bias.slice(..),
        pos: pos.slice(..),
        kcache: kcache.slice_mut(..),
        n_tokens: checks::to_i32(kernel, "n_tokens", p.n_tokens)?,
        head_dim: checks::to_i32(kernel, "head_dim", p.head_dim)?,
        n_rot: checks::to_i32(kernel, "n_rot", p.n_rot)?,
        k_stride: checks::to_i32(kernel, "k_stride", p.k_stride)?,
        max_ctx: checks::to_i32(kernel, "max_ctx", p.max_ctx)?,
        freq_base: p.freq_base,
        freq_scale: p.freq_scale,
        eps: p.eps,
    };
    let cfg = LaunchConfig {
        grid_dim: (blocks_for(p.n_tokens, threads), 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: k holds (n_tokens − 1)·k_stride + head_dim floats, weight / bias head_dim, pos
    // n_tokens ints, kcache max_ctx·head_dim elements of the variant's type; the kernel writes
    // only rows pos[t] ∈ [0, max_ctx).
    unsafe { launch(kernel, cfg, &mut args) }
}
