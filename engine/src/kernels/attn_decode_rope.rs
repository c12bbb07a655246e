//! attn_decode_rope: a decode step's attention with qk_norm_rope's work in its prologue
//! (templates/memra/attn_decode_rope.cuh). From the new token's raw q, k, v projections: QK-norm
//! and RoPE of q and k, k and v written into the caches at `pos`, then attn_decode's attention
//! over rows `0..=pos` (window, split): one launch where qk_norm_rope + attn_decode take two.

use cudarc::driver::{CudaView, CudaViewMut};

use crate::cuda::{Error, Kernel};
use crate::kernels::attn_decode::{AttnDecodeParams, LaunchBuffers, SplitRule, check_gqa, check_launch, launch_config, out_ptr};
use crate::kernels::checks;
use crate::kernels::launch::{KernelArgs, launch};
use crate::kernels::qk_norm_rope::{CacheElem, check_n_rot, norm_weights};

pub const FAMILY: &str = "attn_decode_rope";
/// templates/README.md default.
pub const DEFAULT_THREADS: u32 = 256;

/// Kernel parameters in order (see the template's header comment).
#[derive(KernelArgs)]
#[kernel_args(family = "attn_decode_rope")]
pub struct AttnDecodeRopeArgs<'a, C: CacheElem> {
    pub q: CudaView<'a, f32>,
    pub k: CudaView<'a, f32>,
    pub v: CudaView<'a, f32>,
    pub q_norm_w: CudaView<'a, f32>,
    pub k_norm_w: CudaView<'a, f32>,
    pub k_cache: CudaViewMut<'a, C>,
    pub v_cache: CudaViewMut<'a, C>,
    pub pos: CudaView<'a, i32>,
    /// Device address of the output rows; 0 (null) leaves the partials in `work` ([`attn_decode_rope_partials`]).
    pub out: u64,
    pub work: CudaViewMut<'a, f32>,
    pub n_seq: i32,
    pub head_dim: i32,
    pub n_head: i32,
    pub n_kv: i32,
    pub n_rot: i32,
    pub max_ctx: i32,
    pub window: i32,
    pub n_split: i32,
    pub scale: f32,
    pub freq_base: f32,
    pub freq_scale: f32,
    pub eps: f32,
}

/// The run-time numbers of one launch: attn_decode's, plus the RoPE and norm scalars.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnDecodeRopeParams {
    pub attn: AttnDecodeParams,
    /// Rotated dims per head (even, <= head_dim; ignored when the variant's rope_mode is none).
    pub n_rot: usize,
    pub freq_base: f32,
    /// Linear RoPE scaling, 1/factor (1.0 = none).
    pub freq_scale: f32,
    pub eps: f32,
}

/// The new tokens' projections of one launch: q `[n_seq, n_head, hd]`, k and v `[n_seq, n_kv, hd]`,
/// before the QK-norm; read only.
pub struct NewTokens<'a, 'b> {
    pub q: &'a CudaView<'b, f32>,
    pub k: &'a CudaView<'b, f32>,
    pub v: &'a CudaView<'b, f32>,
    /// (q weight, k weight) as qk_norm_rope takes them; `None` for `qk_norm = none`.
    pub norm_w: Option<(&'a CudaView<'b, f32>, &'a CudaView<'b, f32>)>,
}

/// One decode step's attention for `n_seq` sequences from their raw projections: k and v go to
/// the caches `[n_seq, max_ctx, n_kv, hd]` at row `pos[b]` (rows below must be filled), the
/// attention output `[n_seq, n_head, hd]` to `out`. `work` as [`crate::kernels::attn_decode::attn_decode`]'s.
#[allow(clippy::too_many_arguments)]
pub fn attn_decode_rope<C: CacheElem>(
    kernel: &Kernel,
    new: &NewTokens<'_, '_>,
    k_cache: &mut CudaViewMut<'_, C>,
    v_cache: &mut CudaViewMut<'_, C>,
    pos: &CudaView<'_, i32>,
    out: &mut CudaViewMut<'_, f32>,
    work: &mut CudaViewMut<'_, f32>,
    p: &AttnDecodeRopeParams,
) -> Result<(), Error> {
    launch_decode_rope(kernel, new, k_cache, v_cache, pos, Some(out), work, p)
}

/// [`attn_decode_rope`] that leaves every split's partials in `work` (`n_split = 1` too) and
/// combines none: the o-projection does ([`crate::kernels::combine_matvec`]). The caches are
/// written as by [`attn_decode_rope`]; no output rows are.
pub fn attn_decode_rope_partials<C: CacheElem>(
    kernel: &Kernel,
    new: &NewTokens<'_, '_>,
    k_cache: &mut CudaViewMut<'_, C>,
    v_cache: &mut CudaViewMut<'_, C>,
    pos: &CudaView<'_, i32>,
    work: &mut CudaViewMut<'_, f32>,
    p: &AttnDecodeRopeParams,
) -> Result<(), Error> {
    launch_decode_rope(kernel, new, k_cache, v_cache, pos, None, work, p)
}

#[allow(clippy::too_many_arguments)]
fn launch_decode_rope<C: CacheElem>(
    kernel: &Kernel,
    new: &NewTokens<'_, '_>,
    k_cache: &mut CudaViewMut<'_, C>,
    v_cache: &mut CudaViewMut<'_, C>,
    pos: &CudaView<'_, i32>,
    out: Option<&mut CudaViewMut<'_, f32>>,
    work: &mut CudaViewMut<'_, f32>,
    p: &AttnDecodeRopeParams,
) -> Result<(), Error> {
    let threads = checks::threads(kernel, DEFAULT_THREADS)?;
    let a = &p.attn;
    let hd = a.head_dim;
    check_gqa::<C>(kernel, hd, a.n_head, a.n_kv, a.window)?;
    check_n_rot(kernel, p.n_rot, hd)?;
    checks::check_dim(kernel, "n_rot", p.n_rot)?;
    check_launch(kernel, a, &LaunchBuffers { out: out.as_ref().map(|o| o.len()), k_cache: &*k_cache, v_cache: &*v_cache, pos: pos.len(), work: work.len() })?;
    let (q_row, kv_row) = (a.n_head * hd, a.n_kv * hd);
    checks::check_len(kernel, "q", new.q.len(), a.n_seq * q_row)?;
    checks::check_len(kernel, "k", new.k.len(), a.n_seq * kv_row)?;
    checks::check_len(kernel, "v", new.v.len(), a.n_seq * kv_row)?;
    let (q_norm_w, k_norm_w) = norm_weights(kernel, new.norm_w, new.v, hd, q_row, kv_row)?;
    if a.n_seq == 0 {
        return Ok(());
    }
    let (out, _out_guard) = out_ptr(kernel, out);
    let i = |what: &str, v: usize| checks::to_i32(kernel, what, v);
    let mut args = AttnDecodeRopeArgs {
        q: new.q.slice(..),
        k: new.k.slice(..),
        v: new.v.slice(..),
        q_norm_w,
        k_norm_w,
        k_cache: k_cache.slice_mut(..),
        v_cache: v_cache.slice_mut(..),
        pos: pos.slice(..),
        out,
        work: work.slice_mut(..),
        n_seq: i("n_seq", a.n_seq)?,
        head_dim: i("head_dim", hd)?,
        n_head: i("n_head", a.n_head)?,
        n_kv: i("n_kv", a.n_kv)?,
        n_rot: i("n_rot", p.n_rot)?,
        max_ctx: i("max_ctx", a.max_ctx)?,
        window: i("window", a.window.unwrap_or(0))?,
        n_split: i("n_split", a.n_split)?,
        scale: a.scale,
        freq_base: p.freq_base,
        freq_scale: p.freq_scale,
        eps: p.eps,
    };
    // SAFETY: q, k, v (and out when given; its guard lives past the launch) hold n_seq rows of
    // their widths, the caches n_seq·max_ctx·n_kv·hd elements of the variant's cache type, pos
    // n_seq ints, work the partials + counters when n_split > 1 or out is null, norm weights their mode's length (all checked above); the kernel reads and
    // writes cache rows < max_ctx only (positions outside [0, max_ctx) produce NaN, no access);
    // the dims match the baked ones; the block size is THREADS.
    unsafe { launch(kernel, launch_config(threads, SplitRule::of(kernel)?, a), &mut args) }
}
