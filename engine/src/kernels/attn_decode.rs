//! attn_decode: GQA decode attention (one query token per sequence) over a KV cache
//! `[n_seq, max_ctx, n_kv, head_dim]`, causal with an optional sliding window, split over the keys
//! (flash-decoding) with a last-block combine (templates/memra/attn_decode.cuh).

use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, LaunchConfig, SyncOnDrop};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks::{self, GRID_Y_MAX};
use crate::kernels::launch::{KernelArgs, launch};
use crate::kernels::qk_norm_rope::CacheElem;

pub const FAMILY: &str = "attn_decode";
/// templates/README.md defaults.
pub const DEFAULT_THREADS: u32 = 128;
pub const DEFAULT_MIN_SPLIT_ROWS: usize = 32;
pub const DEFAULT_HEADS_PER_BLOCK: usize = 4;
/// Head sizes the template implements.
pub const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Kernel parameters in order (see the template's header comment).
#[derive(KernelArgs)]
#[kernel_args(family = "attn_decode")]
pub struct AttnDecodeArgs<'a, C: CacheElem> {
    pub q: CudaView<'a, f32>,
    pub k_cache: CudaView<'a, C>,
    pub v_cache: CudaView<'a, C>,
    pub pos: CudaView<'a, i32>,
    /// Device address of the output rows; 0 (null) leaves the partials in `work` ([`attn_decode_partials`]).
    pub out: u64,
    pub work: CudaViewMut<'a, f32>,
    pub n_seq: i32,
    pub head_dim: i32,
    pub n_head: i32,
    pub n_kv: i32,
    pub max_ctx: i32,
    pub window: i32,
    pub n_split: i32,
    pub scale: f32,
}

/// The run-time numbers of one launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnDecodeParams {
    pub n_seq: usize,
    pub head_dim: usize,
    pub n_head: usize,
    pub n_kv: usize,
    /// Rows per sequence in the caches.
    pub max_ctx: usize,
    /// Sliding window (a key `s` is visible iff `pos − s < window`); `None` = causal only.
    pub window: Option<usize>,
    /// Key chunks per head group (grid.y); 1 = no workspace.
    pub n_split: usize,
    pub scale: f32,
}

/// f32 slots of the workspace for `n_split > 1` (or a launch for partials): u32 counters (padded to 16 bytes) then partials.
/// Allocate it zeroed; it serves every split count up to `n_split` at these `n_seq`/`n_head`/
/// `head_dim` (the counters sit at the front, and each launch leaves them at zero).
pub fn work_floats(n_seq: usize, n_head: usize, head_dim: usize, n_split: usize) -> usize {
    (n_seq * n_head).next_multiple_of(4) + n_seq * n_head * n_split * (head_dim + 2)
}

/// Most splits the split rule picks: the last block reads every split's partials (n_split · heads ·
/// (hd + 2) floats) alone, so past ~100 splits the combine outweighs the keys. Gemma 3 at 32k keys
/// (one kv head; H200): 39 µs with 128 splits, 48 µs with 264.
pub const MAX_SPLITS: usize = 128;

/// How a decode-attention variant (attn_decode, attn_decode_rope) cuts its work, on the host:
/// its tune fields `min_split_rows` and `heads_per_block` (README defaults when not baked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitRule {
    /// The fewest keys per split.
    pub min_split_rows: usize,
    /// The most q heads a block carries (1, 2 or 4).
    pub heads_per_block: usize,
}

impl SplitRule {
    pub const DEFAULT: SplitRule = SplitRule { min_split_rows: DEFAULT_MIN_SPLIT_ROWS, heads_per_block: DEFAULT_HEADS_PER_BLOCK };

    /// The rule `kernel` was built with.
    pub fn of(kernel: &Kernel) -> Result<SplitRule, Error> {
        let v = kernel.variant();
        let min_split_rows = checks::baked_int(v, "min_split_rows").map_or(DEFAULT_MIN_SPLIT_ROWS, |r| r.max(1) as usize);
        let heads_per_block = match checks::baked_int(v, "heads_per_block") {
            None => DEFAULT_HEADS_PER_BLOCK,
            Some(h @ (1 | 2 | 4)) => h as usize,
            Some(h) => return Err(checks::invalid(kernel, format!("heads_per_block={h} is not 1, 2 or 4"))),
        };
        Ok(SplitRule { min_split_rows, heads_per_block })
    }

    /// Head groups per kv head (blocks along grid.x per kv head).
    pub fn head_groups(self, n_head: usize, n_kv: usize) -> usize {
        (n_head / n_kv.max(1)).div_ceil(self.heads_per_block.max(1)).max(1)
    }

    /// A split count for keys up to `max_len`: enough blocks for ~2 waves on `sm_count`
    /// multiprocessors, at least `min_split_rows` keys per split, at most [`MAX_SPLITS`].
    pub fn splits(self, max_len: usize, n_seq: usize, n_head: usize, n_kv: usize, sm_count: usize) -> usize {
        let groups = (n_seq * n_kv * self.head_groups(n_head, n_kv)).max(1);
        let want = (2 * sm_count).div_ceil(groups);
        let most = max_len.div_ceil(self.min_split_rows.max(1));
        want.min(most).min(MAX_SPLITS).clamp(1, GRID_Y_MAX as usize)
    }
}

pub fn launch_config(threads: u32, rule: SplitRule, p: &AttnDecodeParams) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            (p.n_kv * rule.head_groups(p.n_head, p.n_kv)) as u32,
            p.n_split as u32,
            p.n_seq as u32,
        ),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Decode attention for `p.n_seq` sequences: `q` / `out` `[n_seq, n_head, hd]`, caches
/// `[n_seq, max_ctx, n_kv, hd]`, `pos` `[n_seq]` (device; rows `0..=pos` must be filled).
/// `work`: at least [`work_floats`] slots, zeroed once when allocated, when `n_split > 1`
/// (any buffer otherwise).
#[allow(clippy::too_many_arguments)]
pub fn attn_decode<C: CacheElem>(
    kernel: &Kernel,
    q: &CudaView<'_, f32>,
    k_cache: &CudaView<'_, C>,
    v_cache: &CudaView<'_, C>,
    pos: &CudaView<'_, i32>,
    out: &mut CudaViewMut<'_, f32>,
    work: &mut CudaViewMut<'_, f32>,
    p: &AttnDecodeParams,
) -> Result<(), Error> {
    launch_decode(kernel, q, k_cache, v_cache, pos, Some(out), work, p)
}

/// [`attn_decode`] that leaves every split's partials in `work` (at least [`work_floats`] slots,
/// `n_split = 1` too) and combines none: the o-projection does
/// ([`crate::kernels::combine_matvec`]). No output rows are written.
pub fn attn_decode_partials<C: CacheElem>(
    kernel: &Kernel,
    q: &CudaView<'_, f32>,
    k_cache: &CudaView<'_, C>,
    v_cache: &CudaView<'_, C>,
    pos: &CudaView<'_, i32>,
    work: &mut CudaViewMut<'_, f32>,
    p: &AttnDecodeParams,
) -> Result<(), Error> {
    launch_decode(kernel, q, k_cache, v_cache, pos, None, work, p)
}

#[allow(clippy::too_many_arguments)]
fn launch_decode<C: CacheElem>(
    kernel: &Kernel,
    q: &CudaView<'_, f32>,
    k_cache: &CudaView<'_, C>,
    v_cache: &CudaView<'_, C>,
    pos: &CudaView<'_, i32>,
    out: Option<&mut CudaViewMut<'_, f32>>,
    work: &mut CudaViewMut<'_, f32>,
    p: &AttnDecodeParams,
) -> Result<(), Error> {
    let threads = checks::threads(kernel, DEFAULT_THREADS)?;
    check_gqa::<C>(kernel, p.head_dim, p.n_head, p.n_kv, p.window)?;
    check_launch(kernel, p, &LaunchBuffers { out: out.as_ref().map(|o| o.len()), k_cache, v_cache, pos: pos.len(), work: work.len() })?;
    checks::check_len(kernel, "q", q.len(), p.n_seq * p.n_head * p.head_dim)?;
    if p.n_seq == 0 {
        return Ok(());
    }
    let (out, _out_guard) = out_ptr(kernel, out);
    let mut args = AttnDecodeArgs {
        q: q.slice(..),
        k_cache: k_cache.slice(..),
        v_cache: v_cache.slice(..),
        pos: pos.slice(..),
        out,
        work: work.slice_mut(..),
        n_seq: checks::to_i32(kernel, "n_seq", p.n_seq)?,
        head_dim: checks::to_i32(kernel, "head_dim", p.head_dim)?,
        n_head: checks::to_i32(kernel, "n_head", p.n_head)?,
        n_kv: checks::to_i32(kernel, "n_kv", p.n_kv)?,
        max_ctx: checks::to_i32(kernel, "max_ctx", p.max_ctx)?,
        window: checks::to_i32(kernel, "window", p.window.unwrap_or(0))?,
        n_split: checks::to_i32(kernel, "n_split", p.n_split)?,
        scale: p.scale,
    };
    // SAFETY: q (and out when given) hold n_seq·n_head·hd floats, the caches n_seq·max_ctx·n_kv·hd
    // elements of the variant's cache type, pos n_seq ints, and work the partials + counters
    // when n_split > 1 or out is null (all checked above; out's guard lives past the launch);
    // the kernel reads cache rows < max_ctx only (positions outside [0, max_ctx) produce NaN,
    // not a read); the dims match the baked ones; the block size is THREADS.
    unsafe { launch(kernel, launch_config(threads, SplitRule::of(kernel)?, p), &mut args) }
}

/// The `out` kernel argument: the rows' device address (with the guard that must outlive the
/// launch), or null for a launch that leaves its partials in `work`.
pub(crate) fn out_ptr<'g>(kernel: &'g Kernel, out: Option<&'g mut CudaViewMut<'_, f32>>) -> (u64, Option<SyncOnDrop<'g>>) {
    match out {
        Some(o) => {
            let (ptr, guard) = o.device_ptr_mut(kernel.stream());
            (ptr, Some(guard))
        }
        None => (0, None),
    }
}

/// A decode launch's caches (their lengths and alignment are checked) and its other buffers' lengths.
pub(crate) struct LaunchBuffers<'a, K, V> {
    /// `None`: a launch for partials (no output rows).
    pub out: Option<usize>,
    pub k_cache: &'a K,
    pub v_cache: &'a V,
    pub pos: usize,
    pub work: usize,
}

/// What attn_decode and attn_decode_rope check alike: the grid's split and sequence counts, the
/// baked dims, the lengths of out, the caches, pos and (split) the workspace, aligned caches.
pub(crate) fn check_launch<C: CacheElem, K: DevicePtr<C> + DeviceSlice<C>, V: DevicePtr<C> + DeviceSlice<C>>(kernel: &Kernel, p: &AttnDecodeParams, b: &LaunchBuffers<'_, K, V>) -> Result<(), Error> {
    if p.n_split == 0 || p.n_split > GRID_Y_MAX as usize || p.n_seq > GRID_Y_MAX as usize {
        return Err(checks::invalid(kernel, format!("n_split={} / n_seq={} outside 1..={GRID_Y_MAX}", p.n_split, p.n_seq)));
    }
    if p.max_ctx == 0 {
        return Err(checks::invalid(kernel, "max_ctx = 0"));
    }
    checks::check_dim(kernel, "head_dim", p.head_dim)?;
    checks::check_dim(kernel, "n_head", p.n_head)?;
    checks::check_dim(kernel, "n_kv", p.n_kv)?;
    let cache_n = p
        .n_seq
        .checked_mul(p.max_ctx)
        .and_then(|v| v.checked_mul(p.n_kv * p.head_dim))
        .ok_or_else(|| checks::invalid(kernel, "cache size overflows"))?;
    if let Some(out) = b.out {
        checks::check_len(kernel, "out", out, p.n_seq * p.n_head * p.head_dim)?;
    }
    checks::check_len(kernel, "k_cache", b.k_cache.len(), cache_n)?;
    checks::check_len(kernel, "v_cache", b.v_cache.len(), cache_n)?;
    checks::check_len(kernel, "pos", b.pos, p.n_seq)?;
    if p.n_split > 1 || b.out.is_none() {
        checks::check_len(kernel, "work", b.work, work_floats(p.n_seq, p.n_head, p.head_dim, p.n_split))?;
    }
    checks::check_aligned16(kernel, "k_cache", b.k_cache)?;
    checks::check_aligned16(kernel, "v_cache", b.v_cache)
}

/// The checks GQA attention launches share (decode and prefill): the cache buffers match the
/// variant's `cache_t`, a supported head size, `n_head` a positive multiple of `n_kv`, and a
/// window that shows at least one key.
pub(crate) fn check_gqa<C: CacheElem>(
    kernel: &Kernel,
    head_dim: usize,
    n_head: usize,
    n_kv: usize,
    window: Option<usize>,
) -> Result<(), Error> {
    checks::cache_type::<C>(kernel, "cache buffers")?;
    if !HEAD_DIMS.contains(&head_dim) {
        return Err(checks::invalid(
            kernel,
            format!("head_dim={head_dim} (supported: {HEAD_DIMS:?})"),
        ));
    }
    if n_kv == 0 || n_head == 0 || !n_head.is_multiple_of(n_kv) {
        return Err(checks::invalid(
            kernel,
            format!("n_head={n_head} is not a positive multiple of n_kv={n_kv}"),
        ));
    }
    if window == Some(0) {
        return Err(checks::invalid(
            kernel,
            "window = 0 hides every key (use None for no window)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_rule_fills_the_machine_but_keeps_chunks_long() {
        // gemma3: 1 kv head, 4 q heads -> 1 group; 264 blocks wanted, 40000 / 256 = 157 allowed,
        // MAX_SPLITS caps it.
        let r = SplitRule { min_split_rows: 256, ..SplitRule::DEFAULT };
        assert_eq!(r.splits(40000, 1, 4, 1, 132), MAX_SPLITS);
        assert_eq!(r.splits(4000, 1, 4, 1, 132), 16);
        // Qwen3-8B: 8 groups -> 33 splits.
        assert_eq!(r.splits(40000, 1, 32, 8, 132), 33);
        assert_eq!(r.splits(1, 1, 32, 8, 132), 1);
        assert_eq!(r.head_groups(32, 8), 1);
        assert_eq!(r.head_groups(64, 8), 2);
        // Two heads a block: gemma3's 4 q heads on 2 blocks, so half the splits fill the machine.
        let two = SplitRule { heads_per_block: 2, ..r };
        assert_eq!(two.head_groups(4, 1), 2);
        assert_eq!(two.head_groups(3, 1), 2);
        assert_eq!((r.splits(400_000, 1, 4, 1, 50), two.splits(400_000, 1, 4, 1, 50)), (100, 50));
        assert_eq!(SplitRule { heads_per_block: 1, ..r }.head_groups(32, 8), 4);
        assert_eq!(work_floats(1, 4, 256, 3), 4 + 4 * 3 * 258);
        assert_eq!(work_floats(2, 6, 128, 5), 12 + 2 * 6 * 5 * 130);
        assert_eq!(work_floats(1, 2, 64, 2), 4 + 2 * 2 * 66);
    }
}
