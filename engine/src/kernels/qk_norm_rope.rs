//! qk_norm_rope: per token, QK RMS-norm (per head or over the whole vector) then RoPE (NeoX or
//! interleaved, partial n_rot) on q and k in place, and k (after RoPE) and v written into the KV
//! caches `[max_ctx, n_kv, head_dim]` at the token positions (templates/memra/qk_norm_rope.cuh).

use cudarc::driver::{CudaView, CudaViewMut, DeviceRepr, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks::{self, GRID_Y_MAX};
use crate::kernels::launch::{KernelArgs, launch};

pub const FAMILY: &str = "qk_norm_rope";
pub const DEFAULT_THREADS: u32 = 256;
/// Largest head_dim the template supports.
pub const MAX_HEAD_DIM: usize = 512;

/// A KV-cache element type and its `cache_t` token. bf16 caches are `u16` buffers of bf16 bits
/// (cudarc's `half` feature is off in this workspace).
pub trait CacheElem: DeviceRepr {
    const CACHE_T: &'static str;
}

impl CacheElem for f32 {
    const CACHE_T: &'static str = "f32";
}

impl CacheElem for u16 {
    const CACHE_T: &'static str = "bf16";
}

/// Kernel parameters in order (see the template's header comment).
#[derive(KernelArgs)]
#[kernel_args(family = "qk_norm_rope")]
pub struct QkNormRopeArgs<'a, C: CacheElem> {
    pub q: CudaViewMut<'a, f32>,
    pub k: CudaViewMut<'a, f32>,
    pub v: CudaView<'a, f32>,
    pub q_norm_w: CudaView<'a, f32>,
    pub k_norm_w: CudaView<'a, f32>,
    pub pos: CudaView<'a, i32>,
    pub k_cache: CudaViewMut<'a, C>,
    pub v_cache: CudaViewMut<'a, C>,
    pub n_tokens: i32,
    pub head_dim: i32,
    pub n_head: i32,
    pub n_kv: i32,
    pub n_rot: i32,
    pub q_stride: i32,
    pub k_stride: i32,
    pub v_stride: i32,
    pub max_ctx: i32,
    pub freq_base: f32,
    pub freq_scale: f32,
    pub eps: f32,
}

/// The run-time numbers of one launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QkNormRopeParams {
    pub n_tokens: usize,
    pub head_dim: usize,
    pub n_head: usize,
    pub n_kv: usize,
    /// Rotated dims per head (even, <= head_dim).
    pub n_rot: usize,
    /// Floats between consecutive tokens of q, k, v.
    pub q_stride: usize,
    pub k_stride: usize,
    pub v_stride: usize,
    /// Rows of each cache; a position outside `[0, max_ctx)` skips its cache write.
    pub max_ctx: usize,
    pub freq_base: f32,
    /// Linear RoPE scaling, 1/factor (1.0 = none).
    pub freq_scale: f32,
    pub eps: f32,
}

impl QkNormRopeParams {
    /// Packed q `[T, n_head, hd]`, k and v `[T, n_kv, hd]`, no RoPE scaling.
    #[allow(clippy::too_many_arguments)]
    pub fn packed(n_tokens: usize, head_dim: usize, n_head: usize, n_kv: usize, n_rot: usize, max_ctx: usize, freq_base: f32, eps: f32) -> Self {
        QkNormRopeParams {
            n_tokens,
            head_dim,
            n_head,
            n_kv,
            n_rot,
            q_stride: n_head * head_dim,
            k_stride: n_kv * head_dim,
            v_stride: n_kv * head_dim,
            max_ctx,
            freq_base,
            freq_scale: 1.0,
            eps,
        }
    }
}

/// The variant's QK-norm choice (`none`, `per_head`, `full`).
pub fn qk_norm(kernel: &Kernel) -> Result<&'static str, Error> {
    checks::required_sym(kernel, "qk_norm")
}

/// With the variant's RoPE on, `n_rot` must be even and at most `head_dim` (qk_norm_rope and
/// attn_decode_rope alike).
pub(crate) fn check_n_rot(kernel: &Kernel, n_rot: usize, hd: usize) -> Result<(), Error> {
    if checks::required_sym(kernel, "rope_mode")? != "none" && (!n_rot.is_multiple_of(2) || n_rot > hd) {
        return Err(checks::invalid(kernel, format!("n_rot={n_rot} must be even and <= head_dim={hd}")));
    }
    Ok(())
}

/// The (q, k) norm weights a launch passes, checked against the variant's `qk_norm`: `[hd]` each
/// for `per_head`, `[q_row]` / `[kv_row]` for `full`, none for `none` (then `unused` stands in;
/// the kernel does not read it).
pub(crate) fn norm_weights<'a>(
    kernel: &Kernel,
    norm_w: Option<(&'a CudaView<'_, f32>, &'a CudaView<'_, f32>)>,
    unused: &'a CudaView<'_, f32>,
    hd: usize,
    q_row: usize,
    kv_row: usize,
) -> Result<(CudaView<'a, f32>, CudaView<'a, f32>), Error> {
    let bad = |detail: String| checks::invalid(kernel, detail);
    match (qk_norm(kernel)?, norm_w) {
        ("none", None) => Ok((unused.slice(..), unused.slice(..))),
        ("none", Some(_)) => Err(bad("norm weights given but the variant has qk_norm = none".into())),
        (norm, None) => Err(bad(format!("qk_norm = {norm} needs the q and k norm weights"))),
        (norm, Some((qw, kw))) => {
            let (need_q, need_k) = if norm == "full" { (q_row, kv_row) } else { (hd, hd) };
            checks::check_len(kernel, "q_norm_w", qw.len(), need_q)?;
            checks::check_len(kernel, "k_norm_w", kw.len(), need_k)?;
            Ok((qw.slice(..), kw.slice(..)))
        }
    }
}

pub fn launch_config(threads: u32, full_norm: bool, p: &QkNormRopeParams) -> LaunchConfig {
    let units = p.n_head + 2 * p.n_kv;
    let warps = threads as usize / 32;
    let grid_x = if full_norm { 1 } else { checks::grid_dim(units, warps, i32::MAX as u32) };
    checks::config((grid_x, checks::grid_dim(p.n_tokens, 1, GRID_Y_MAX)), threads)
}

/// Applies QK-norm + RoPE to q and k in place and writes k, v into the caches at `pos[t]`.
/// `norm_w` = (q weight, k weight): `[head_dim]` each for `per_head`, `[n_head·hd]` and
/// `[n_kv·hd]` for `full`, `None` for `none`.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope<C: CacheElem>(
    kernel: &Kernel,
    q: &mut CudaViewMut<'_, f32>,
    k: &mut CudaViewMut<'_, f32>,
    v: &CudaView<'_, f32>,
    norm_w: Option<(&CudaView<'_, f32>, &CudaView<'_, f32>)>,
    pos: &CudaView<'_, i32>,
    k_cache: &mut CudaViewMut<'_, C>,
    v_cache: &mut CudaViewMut<'_, C>,
    p: &QkNormRopeParams,
) -> Result<(), Error> {
    let threads = checks::threads(kernel, DEFAULT_THREADS)?;
    let bad = |detail: String| checks::invalid(kernel, detail);
    let hd = p.head_dim;
    if hd == 0 || hd % 2 != 0 || hd > MAX_HEAD_DIM {
        return Err(bad(format!("head_dim={hd} must be even and in 2..={MAX_HEAD_DIM}")));
    }
    check_n_rot(kernel, p.n_rot, hd)?;
    if p.n_head == 0 || p.n_kv == 0 {
        return Err(bad(format!("n_head={} and n_kv={} must be positive", p.n_head, p.n_kv)));
    }
    for (key, value) in [("head_dim", hd), ("n_head", p.n_head), ("n_kv", p.n_kv), ("n_rot", p.n_rot)] {
        checks::check_dim(kernel, key, value)?;
    }
    checks::cache_type::<C>(kernel, "k_cache/v_cache")?;
    let (q_row, kv_row) = (p.n_head * hd, p.n_kv * hd);
    for (what, stride, row) in [("q_stride", p.q_stride, q_row), ("k_stride", p.k_stride, kv_row), ("v_stride", p.v_stride, kv_row)] {
        if stride < row {
            return Err(bad(format!("{what}={stride} is shorter than a token's row of {row}")));
        }
    }
    let extent = |stride: usize, row: usize| -> Result<usize, Error> {
        if p.n_tokens == 0 {
            return Ok(0);
        }
        (p.n_tokens - 1).checked_mul(stride).and_then(|v| v.checked_add(row)).ok_or_else(|| bad("extent overflows".into()))
    };
    checks::check_len(kernel, "q", q.len(), extent(p.q_stride, q_row)?)?;
    checks::check_len(kernel, "k", k.len(), extent(p.k_stride, kv_row)?)?;
    checks::check_len(kernel, "v", v.len(), extent(p.v_stride, kv_row)?)?;
    checks::check_len(kernel, "pos", pos.len(), p.n_tokens)?;
    let cache_len = p.max_ctx.checked_mul(kv_row).ok_or_else(|| bad("cache size overflows".into()))?;
    checks::check_len(kernel, "k_cache", k_cache.len(), cache_len)?;
    checks::check_len(kernel, "v_cache", v_cache.len(), cache_len)?;
    let norm = qk_norm(kernel)?;
    let (q_norm_w, k_norm_w) = norm_weights(kernel, norm_w, v, hd, q_row, kv_row)?;
    if p.n_tokens == 0 {
        return Ok(());
    }
    let i = |what: &str, v: usize| checks::to_i32(kernel, what, v);
    let mut args = QkNormRopeArgs {
        q: q.slice_mut(..),
        k: k.slice_mut(..),
        v: v.slice(..),
        q_norm_w,
        k_norm_w,
        pos: pos.slice(..),
        k_cache: k_cache.slice_mut(..),
        v_cache: v_cache.slice_mut(..),
        n_tokens: i("n_tokens", p.n_tokens)?,
        head_dim: i("head_dim", hd)?,
        n_head: i("n_head", p.n_head)?,
        n_kv: i("n_kv", p.n_kv)?,
        n_rot: i("n_rot", p.n_rot)?,
        q_stride: i("q_stride", p.q_stride)?,
        k_stride: i("k_stride", p.k_stride)?,
        v_stride: i("v_stride", p.v_stride)?,
        max_ctx: i("max_ctx", p.max_ctx)?,
        freq_base: p.freq_base,
        freq_scale: p.freq_scale,
        eps: p.eps,
    };
    // SAFETY: q, k, v cover n_tokens rows at their strides, pos n_tokens ints, the caches
    // max_ctx·n_kv·hd elements of the variant's cache type, norm weights their mode's length
    // (all checked); the kernel writes cache rows only for positions in [0, max_ctx); the baked
    // dims equal the run-time ones (checked); block = THREADS.
    unsafe { launch(kernel, launch_config(threads, norm == "full", p), &mut args) }
}
