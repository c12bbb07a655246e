//! mla_rope: the per-token RoPE work of an MLA layer in one launch (templates/memra/mla_rope.cuh):
//! the latent cache row `[RMSNorm(c)·w | RoPE(k_pe)]`, the roped `q_pe` of every head into the
//! absorbed query's tail, and (DSA layers) the indexer queries roped and scaled in place.

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks;
use crate::kernels::launch::{launch, KernelArgs};
use crate::kernels::qk_norm_rope::CacheElem;

pub const FAMILY: &str = "mla_rope";
/// README default block size.
pub const THREADS: u32 = 128;
/// Template limits (`MLA_ROPE_MAX_ROPE`, `MLA_ROPE_MAX_KV_LORA`).
pub const MAX_ROPE: usize = 128;
pub const MAX_KV_LORA: usize = 1024;

/// Kernel parameters in order (see the template's header comment).
#[derive(KernelArgs)]
#[kernel_args(family = "mla_rope")]
pub struct MlaRopeArgs<'a, C: CacheElem> {
    pub q: CudaView<'a, f32>,
    pub q_out: CudaViewMut<'a, f32>,
    pub kv: CudaView<'a, f32>,
    pub kv_norm_w: CudaView<'a, f32>,
    pub pos: CudaView<'a, i32>,
    pub cache: CudaViewMut<'a, C>,
    pub iq: CudaViewMut<'a, f32>,
    pub n_tokens: i32,
    pub n_head: i32,
    pub nope: i32,
    pub rope: i32,
    pub kv_lora: i32,
    pub n_idx_head: i32,
    pub idx_head_dim: i32,
    pub max_ctx: i32,
    pub freq_base: f32,
    pub freq_scale: f32,
    pub ext_factor: f32,
    pub corr_low: f32,
    pub corr_high: f32,
    pub idx_q_scale: f32,
    pub eps: f32,
}

/// RoPE frequencies of the MLA heads: `freq_scale` (1/factor) and, for YaRN, the extrapolation
/// mix (`ext_factor` 0 = plain linear scaling) between the correction dims.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeFreqs {
    pub base: f32,
    pub freq_scale: f32,
    pub ext_factor: f32,
    pub corr_low: f32,
    pub corr_high: f32,
}

/// The run-time numbers of one launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaRopeParams {
    pub n_tokens: usize,
    pub n_head: usize,
    pub nope: usize,
    pub rope: usize,
    pub kv_lora: usize,
    /// Indexer heads (0 = no indexer job) and their size.
    pub n_idx_head: usize,
    pub idx_head_dim: usize,
    pub max_ctx: usize,
    pub freqs: RopeFreqs,
    /// Multiplies the roped indexer queries.
    pub idx_q_scale: f32,
    /// RMSNorm eps of the latent.
    pub eps: f32,
}

/// Most blocks a token's per-head work is spread over (grid y).
pub const MAX_PARTS: usize = 16;

/// Blocks per token: enough that each thread takes about one q_pe pair of `n_head` heads.
pub fn parts(threads: u32, n_head: usize, rope: usize) -> usize {
    (n_head * (rope / 2)).div_ceil(threads.max(1) as usize).clamp(1, MAX_PARTS)
}

pub fn launch_config(threads: u32, n_tokens: usize, parts: usize) -> LaunchConfig {
    checks::config((checks::grid_dim(n_tokens, 1, 65_535), parts.clamp(1, MAX_PARTS) as u32), threads)
}

/// One launch for `n_tokens` tokens at device positions `pos`: `q` `[T, n_head, nope + rope]`,
/// `q_out` `[T, n_head, kv_lora + rope]` (its tails written), `kv` `[T, kv_lora + rope]` (the
/// `attn_kv_a_mqa` output), `kv_norm_w` `[kv_lora]`, `cache` `[max_ctx, kv_lora + rope]`, `iq`
/// `[T, n_idx_head, idx_head_dim]` when `n_idx_head > 0` (else unread: any buffer).
#[allow(clippy::too_many_arguments)]
pub fn mla_rope<C: CacheElem>(
    kernel: &Kernel,
    q: &CudaView<'_, f32>,
    q_out: &mut CudaViewMut<'_, f32>,
    kv: &CudaView<'_, f32>,
    kv_norm_w: &CudaView<'_, f32>,
    pos: &CudaView<'_, i32>,
    cache: &mut CudaViewMut<'_, C>,
    iq: &mut CudaViewMut<'_, f32>,
    p: &MlaRopeParams,
) -> Result<(), Error> {
    let threads = checks::threads(kernel, THREADS)?;
    checks::cache_type::<C>(kernel, "cache buffer")?;
    if p.rope == 0 || !p.rope.is_multiple_of(2) || p.rope > MAX_ROPE {
        return Err(checks::invalid(
            kernel,
            format!("rope={} (needs an even count in 2..={MAX_ROPE})", p.rope),
        ));
    }
    if p.kv_lora == 0 || p.kv_lora > MAX_KV_LORA {
        return Err(checks::invalid(
            kernel,
            format!("kv_lora={} (needs 1..={MAX_KV_LORA})", p.kv_lora),
        ));
    }
    if p.n_tokens == 0 || p.n_head == 0 || p.max_ctx == 0 {
        return Err(checks::invalid(
            kernel,
            format!(
                "n_tokens={}, n_head={}, max_ctx={} must be positive",
                p.n_tokens, p.n_head, p.max_ctx
            ),
        ));
    }
    if p.n_idx_head > 0 && p.idx_head_dim < p.rope {
        return Err(checks::invalid(
            kernel,
            format!("idx_head_dim={} is below rope={}", p.idx_head_dim, p.rope),
        ));
    }
    checks::check_dim(kernel, "n_head", p.n_head)?;
    checks::check_dim(kernel, "nope", p.nope)?;
    checks::check_dim(kernel, "rope", p.rope)?;
    checks::check_dim(kernel, "kv_lora", p.kv_lora)?;
    let overflow = || checks::invalid(kernel, "sizes overflow");
    let (dq, dk) = (p.nope + p.rope, p.kv_lora + p.rope);
    let rows = p.n_tokens.checked_mul(p.n_head).ok_or_else(overflow)?;
    checks::check_len(
        kernel,
        "q",
        q.len(),
        rows.checked_mul(dq).ok_or_else(overflow)?,
    )?;
    checks::check_len(
        kernel,
        "q_out",
        q_out.len(),
        rows.checked_mul(dk).ok_or_else(overflow)?,
    )?;
    checks::check_len(
        kernel,
        "kv",
        kv.len(),
        p.n_tokens.checked_mul(dk).ok_or_else(overflow)?,
    )?;
    checks::check_len(kernel, "kv_norm_w", kv_norm_w.len(), p.kv_lora)?;
    checks::check_len(kernel, "pos", pos.len(), p.n_tokens)?;
    checks::check_len(
        kernel,
        "cache",
        cache.len(),
        p.max_ctx.checked_mul(dk).ok_or_else(overflow)?,
    )?;
    if p.n_idx_head > 0 {
        let n = rows_of(p.n_tokens, p.n_idx_head, p.idx_head_dim).ok_or_else(overflow)?;
        checks::check_len(kernel, "iq", iq.len(), n)?;
        checks::to_i32(kernel, "n_tokens·n_idx_head·idx_head_dim", n)?;
    }
    checks::to_i32(kernel, "n_tokens·n_head·(kv_lora + rope)", rows * dk)?;
    checks::to_i32(kernel, "max_ctx·(kv_lora + rope)", p.max_ctx * dk)?;
    let f = p.freqs;
    let mut args = MlaRopeArgs {
        q: q.slice(..),
        q_out: q_out.slice_mut(..),
        kv: kv.slice(..),
        kv_norm_w: kv_norm_w.slice(..),
        pos: pos.slice(..),
        cache: cache.slice_mut(..),
        iq: iq.slice_mut(..),
        n_tokens: checks::to_i32(kernel, "n_tokens", p.n_tokens)?,
        n_head: checks::to_i32(kernel, "n_head", p.n_head)?,
        nope: checks::to_i32(kernel, "nope", p.nope)?,
        rope: checks::to_i32(kernel, "rope", p.rope)?,
        kv_lora: checks::to_i32(kernel, "kv_lora", p.kv_lora)?,
        n_idx_head: checks::to_i32(kernel, "n_idx_head", p.n_idx_head)?,
        idx_head_dim: checks::to_i32(kernel, "idx_head_dim", p.idx_head_dim)?,
        max_ctx: checks::to_i32(kernel, "max_ctx", p.max_ctx)?,
        freq_base: f.base,
        freq_scale: f.freq_scale,
        ext_factor: f.ext_factor,
        corr_low: f.corr_low,
        corr_high: f.corr_high,
        idx_q_scale: p.idx_q_scale,
        eps: p.eps,
    };
    // SAFETY: q, q_out, kv, kv_norm_w, pos and cache hold the rows above (checked), iq the
    // indexer rows when n_idx_head > 0 (else unread); cache rows are written only for positions
    // in [0, max_ctx); no dynamic shared memory.
    let parts = parts(threads, p.n_head, p.rope);
    unsafe { launch(kernel, launch_config(threads, p.n_tokens, parts), &mut args) }
}

fn rows_of(n_tokens: usize, n_idx_head: usize, idx_head_dim: usize) -> Option<usize> {
    n_tokens.checked_mul(n_idx_head)?.checked_mul(idx_head_dim)
}
