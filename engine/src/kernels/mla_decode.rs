//! mla_decode: MLA absorbed decode attention over the latent cache `[max_ctx, kv_lora + rope]`
//! (model-specs §6.3 steps 6–7), split over the rows with a last-block combine
//! (templates/memra/mla_decode.cuh).

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks::{self, GRID_Y_MAX};
use crate::kernels::launch::{KernelArgs, launch};
use crate::kernels::qk_norm_rope::CacheElem;

pub const FAMILY: &str = "mla_decode";
pub const THREADS: u32 = 256;
/// Heads one block carries (`HB` in the template).
pub const HEADS_PER_BLOCK: usize = 64;
/// Largest dynamic shared memory per block on sm_90 (227 KiB).
pub const MAX_SMEM: usize = 232_448;

/// Kernel parameters in order (see the template's header comment).
#[derive(KernelArgs)]
#[kernel_args(family = "mla_decode")]
pub struct MlaDecodeArgs<'a, C: CacheElem> {
    pub q: CudaView<'a, f32>,
    pub cache: CudaView<'a, C>,
    pub pos: CudaView<'a, i32>,
    pub out: CudaViewMut<'a, f32>,
    pub work: CudaViewMut<'a, f32>,
    pub n_head: i32,
    pub kv_lora: i32,
    pub rope: i32,
    pub max_ctx: i32,
    pub n_split: i32,
    pub scale: f32,
    /// How a split launch combines (template header): 0 = the last block merges (counters),
    /// 1 = partials only, 2 = merge only (after a phase-1 launch).
    pub phase: i32,
    /// Query tokens (grid.z), each with its own position.
    pub n_q: i32,
}

/// The run-time numbers of one launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaDecodeParams {
    pub n_head: usize,
    pub kv_lora: usize,
    pub rope: usize,
    /// Rows of the cache.
    pub max_ctx: usize,
    /// Row chunks (grid.x); 1 = no workspace.
    pub n_split: usize,
    /// Softmax scale (model-specs §6.4: 1/16 for GLM-5).
    pub scale: f32,
}

/// Rows per shared-memory tile for a cache element size.
pub fn tile_rows(elem_bytes: usize) -> usize {
    if elem_bytes == 2 { TC_TILE_ROWS } else { 8 }
}

/// Rows per tile of the tensor-core form (bf16 caches).
pub const TC_TILE_ROWS: usize = 64;

/// Dynamic shared memory of one block (formulas in the template's header): bf16 caches take the
/// tensor-core form (Q, two K/V tiles and P in bf16, rows of `kv_lora + rope` rounded up to 64
/// elements), f32 caches the CUDA-core form.
pub fn smem_bytes(n_head: usize, kv_lora: usize, rope: usize, elem_bytes: usize) -> usize {
    let d = kv_lora + rope;
    if elem_bytes == 2 {
        let pitch = d.div_ceil(64) * 128;
        let (hb, tn) = (HEADS_PER_BLOCK, TC_TILE_ROWS);
        // + 1 KiB: the sm_90a form aligns its base to 1024 bytes (128-byte-swizzle layouts).
        return (hb + 2 * tn) * pitch + hb * tn * 2 + 6 * hb * 4 + 1024;
    }
    let tr = tile_rows(elem_bytes);
    n_head.min(HEADS_PER_BLOCK) * (d + 4) * 4
        + 2 * tr * (d * elem_bytes + 16)
        + tr * HEADS_PER_BLOCK * 4
        + 3 * HEADS_PER_BLOCK * 4
}

/// f32 slots of the workspace for `n_split > 1`: u32 counters (padded to 16 bytes) then partials.
/// Allocate it zeroed; it serves every split count up to `n_split` for these `n_head`/`kv_lora`
/// (the counters sit at the front, and each launch leaves them at zero).
pub fn work_floats(n_head: usize, kv_lora: usize, n_split: usize) -> usize {
    work_floats_batch(n_head, kv_lora, n_split, 1)
}

/// As [`work_floats`] for `n_q` query tokens: the counters (query 0's only) then every query's
/// partials. Serves every `n_q' ≤ n_q` and `n_split' ≤ n_split` (the counters stay in front).
pub fn work_floats_batch(n_head: usize, kv_lora: usize, n_split: usize, n_q: usize) -> usize {
    n_head.div_ceil(HEADS_PER_BLOCK).next_multiple_of(4) + n_q * n_head * n_split * (kv_lora + 2)
}

/// Largest query count of one launch (grid.z).
pub const MAX_QUERIES: usize = 65_535;

/// Up to this many splits the last block of a launch merges the partials (phase 0: it reads
/// `n_split` · 128 KiB at GLM-5 dims through one multiprocessor); above, the merge is spread over
/// the grid: phase 3 (one launch, a barrier) or phases 1 + 2 ([`phases_batch`]).
pub const LAST_BLOCK_COMBINE_MAX: usize = 4;

/// Latent columns one merge unit covers (`MERGE_COLS` in the template).
pub const MERGE_COLS: usize = 256;

/// Phase-2 blocks per head block: one per (head, 256 latent columns).
pub fn combine_blocks(n_head: usize, kv_lora: usize) -> usize {
    n_head.min(HEADS_PER_BLOCK) * kv_lora.div_ceil(MERGE_COLS)
}

/// Dynamic shared memory of a merge (the template's `merge_smem_bytes`): each split's weight and
/// l, and 16 reduction slots. Phase 2 launches with it; phases 0 and 3 merge in the split blocks'
/// own.
pub fn combine_smem_bytes(n_split: usize) -> usize {
    (2 * n_split + 16) * 4
}

/// The phases a wrapper launches for `n_split` splits and `n_q` query tokens (grid.z), each with
/// its grid (template header): phase 0 up to [`LAST_BLOCK_COMBINE_MAX`] splits; above, one
/// phase-3 launch (partials, a barrier per head block, the merge spread over the blocks) when
/// every block fits on the device at once (`sms` multiprocessors, one block each: the shared
/// memory allows no more), else phases 1 + 2 (a second launch merges). The counters (phases 0
/// and 3) serve one query, so several queries with splits take phases 1 + 2.
pub fn phases_batch(p: &MlaDecodeParams, smem: usize, sms: usize, n_q: usize) -> Vec<(i32, LaunchConfig)> {
    if p.n_split == 1 || (n_q == 1 && p.n_split <= LAST_BLOCK_COMBINE_MAX) {
        return vec![(0, launch_config_batch(p, smem, n_q))];
    }
    let blocks = p.n_split * p.n_head.div_ceil(HEADS_PER_BLOCK);
    if n_q == 1 && blocks <= sms {
        return vec![(3, launch_config_batch(p, smem, 1))];
    }
    let merge = LaunchConfig {
        grid_dim: (
            combine_blocks(p.n_head, p.kv_lora) as u32,
            p.n_head.div_ceil(HEADS_PER_BLOCK) as u32,
            n_q as u32,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: combine_smem_bytes(p.n_split) as u32,
    };
    vec![(1, launch_config_batch(p, smem, n_q)), (2, merge)]
}

/// Multiprocessors of the device a kernel runs on.
pub(crate) fn sm_count(kernel: &Kernel) -> Result<usize, Error> {
    use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
    let n = kernel
        .stream()
        .context()
        .attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| Error::driver("cuDeviceGetAttribute(multiprocessor count)", e))?;
    Ok(n.max(1) as usize)
}

/// Fewest cache rows one split of dense decode handles.
pub const MIN_SPLIT_ROWS: usize = 64;

/// A split count for up to `max_len` rows: one block per multiprocessor per head block, at least
/// [`MIN_SPLIT_ROWS`] rows per split.
pub fn splits_for(max_len: usize, n_head: usize, sm_count: usize) -> usize {
    splits_with(max_len, n_head, sm_count, MIN_SPLIT_ROWS)
}

/// As [`splits_for`] with at least `min_rows` rows per split.
pub fn splits_with(max_len: usize, n_head: usize, sm_count: usize, min_rows: usize) -> usize {
    splits_with_batch(max_len, n_head, sm_count, min_rows, 1)
}

/// As [`splits_with`] for `n_q` query tokens: the grid already has `n_q` blocks per head block,
/// so a query gets `ceil(sm_count / (head blocks · n_q))` splits (1 once the queries fill the
/// multiprocessors).
pub fn splits_with_batch(
    max_len: usize,
    n_head: usize,
    sm_count: usize,
    min_rows: usize,
    n_q: usize,
) -> usize {
    let blocks = n_head.div_ceil(HEADS_PER_BLOCK).max(1) * n_q.max(1);
    let want = sm_count.div_ceil(blocks);
    want.min(max_len.div_ceil(min_rows.max(1)))
        .clamp(1, i32::MAX as usize)
}

/// [`splits_for`] for `n_q` query tokens ([`splits_with_batch`]).
pub fn splits_for_batch(max_len: usize, n_head: usize, sm_count: usize, n_q: usize) -> usize {
    splits_with_batch(max_len, n_head, sm_count, MIN_SPLIT_ROWS, n_q)
}

pub fn launch_config(p: &MlaDecodeParams, smem: usize) -> LaunchConfig {
    launch_config_batch(p, smem, 1)
}

/// Grid `(n_split, ceil(n_head / 64), n_q)`.
pub fn launch_config_batch(p: &MlaDecodeParams, smem: usize, n_q: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            p.n_split as u32,
            p.n_head.div_ceil(HEADS_PER_BLOCK) as u32,
            n_q as u32,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

/// Checks shared with mla_sparse_decode: the variant, shapes, buffer lengths and alignment.
/// Returns the dynamic shared memory, with the function's limit raised to it.
pub(crate) fn check_launch<C: CacheElem>(
    kernel: &Kernel,
    q: &CudaView<'_, f32>,
    cache: &CudaView<'_, C>,
    out: &CudaViewMut<'_, f32>,
    work: &CudaViewMut<'_, f32>,
    p: &MlaDecodeParams,
    n_q: usize,
) -> Result<usize, Error> {
    if n_q == 0 || n_q > MAX_QUERIES {
        return Err(checks::invalid(
            kernel,
            format!("n_q={n_q} (needs 1..={MAX_QUERIES})"),
        ));
    }
    let threads = checks::threads(kernel, THREADS)?;
    if threads != THREADS {
        return Err(checks::invalid(
            kernel,
            format!("threads={threads}, the template needs {THREADS}"),
        ));
    }
    checks::cache_type::<C>(kernel, "cache buffer")?;
    let elem = std::mem::size_of::<C>();
    let d = p.kv_lora + p.rope;
    if p.kv_lora == 0 || !p.kv_lora.is_multiple_of(128) || p.kv_lora > 512 {
        return Err(checks::invalid(
            kernel,
            format!("kv_lora={} (needs a multiple of 128, <= 512)", p.kv_lora),
        ));
    }
    if !(d * elem).is_multiple_of(16) || !d.is_multiple_of(4) {
        return Err(checks::invalid(
            kernel,
            format!("row of kv_lora + rope = {d} elements is not 16-byte chunks"),
        ));
    }
    if p.n_head == 0 || p.max_ctx == 0 || p.n_split == 0 || p.n_split > i32::MAX as usize {
        return Err(checks::invalid(
            kernel,
            format!(
                "n_head={}, max_ctx={}, n_split={} must be positive",
                p.n_head, p.max_ctx, p.n_split
            ),
        ));
    }
    if p.n_head.div_ceil(HEADS_PER_BLOCK) > GRID_Y_MAX as usize {
        return Err(checks::invalid(
            kernel,
            format!("n_head={} too large", p.n_head),
        ));
    }
    checks::check_dim(kernel, "n_head", p.n_head)?;
    checks::check_dim(kernel, "kv_lora", p.kv_lora)?;
    checks::check_dim(kernel, "rope", p.rope)?;
    // A split launch merges in its blocks' shared memory (phases 0 and 3): at least the merge's.
    let mut smem = smem_bytes(p.n_head, p.kv_lora, p.rope, elem);
    if p.n_split > 1 {
        smem = smem.max(combine_smem_bytes(p.n_split));
    }
    if smem > MAX_SMEM {
        return Err(checks::invalid(
            kernel,
            format!("needs {smem} bytes of shared memory (> {MAX_SMEM})"),
        ));
    }
    checks::check_len(kernel, "q", q.len(), n_q * p.n_head * d)?;
    checks::check_len(kernel, "out", out.len(), n_q * p.n_head * p.kv_lora)?;
    let cache_n = p
        .max_ctx
        .checked_mul(d)
        .ok_or_else(|| checks::invalid(kernel, "cache size overflows"))?;
    checks::check_len(kernel, "cache", cache.len(), cache_n)?;
    if p.n_split > 1 {
        checks::check_len(
            kernel,
            "work",
            work.len(),
            work_floats_batch(p.n_head, p.kv_lora, p.n_split, n_q),
        )?;
    }
    checks::check_aligned16(kernel, "q", q)?;
    checks::check_aligned16(kernel, "cache", cache)?;
    checks::check_aligned16(kernel, "out", out)?;
    if p.n_split > 1 {
        checks::check_aligned16(kernel, "work", work)?;
    }
    crate::kernels::matvec::allow_smem(kernel, smem as u32)?;
    Ok(smem)
}

/// Absorbed MLA decode for one token at device position `pos[0]` (rows `0..=pos` filled):
/// `q` `[n_head, kv_lora + rope]`, `cache` `[max_ctx, kv_lora + rope]`, `out` `[n_head, kv_lora]`.
/// `work`: at least [`work_floats`] slots, zeroed once when allocated, when `n_split > 1`.
#[allow(clippy::too_many_arguments)]
pub fn mla_decode<C: CacheElem>(
    kernel: &Kernel,
    q: &CudaView<'_, f32>,
    cache: &CudaView<'_, C>,
    pos: &CudaView<'_, i32>,
    out: &mut CudaViewMut<'_, f32>,
    work: &mut CudaViewMut<'_, f32>,
    p: &MlaDecodeParams,
) -> Result<(), Error> {
    mla_decode_batch(kernel, q, cache, pos, out, work, 1, p)
}

/// [`mla_decode`] for `n_q` query tokens in one launch (prefill): query j at device position
/// `pos[j]` attends over rows `0..=pos[j]`; `q` `[n_q, n_head, kv_lora + rope]`, `out`
/// `[n_q, n_head, kv_lora]`, `pos` `[n_q]`, `work` at least [`work_floats_batch`] slots (zeroed
/// once) when `n_split > 1`. Splits: [`splits_for_batch`].
#[allow(clippy::too_many_arguments)]
pub fn mla_decode_batch<C: CacheElem>(
    kernel: &Kernel,
    q: &CudaView<'_, f32>,
    cache: &CudaView<'_, C>,
    pos: &CudaView<'_, i32>,
    out: &mut CudaViewMut<'_, f32>,
    work: &mut CudaViewMut<'_, f32>,
    n_q: usize,
    p: &MlaDecodeParams,
) -> Result<(), Error> {
    let smem = check_launch(kernel, q, cache, out, work, p, n_q)?;
    checks::check_len(kernel, "pos", pos.len(), n_q)?;
    for (phase, cfg) in phases_batch(p, smem, sm_count(kernel)?, n_q) {
        let mut args = MlaDecodeArgs {
            q: q.slice(..),
            cache: cache.slice(..),
            pos: pos.slice(..),
            out: out.slice_mut(..),
            work: work.slice_mut(..),
            n_head: checks::to_i32(kernel, "n_head", p.n_head)?,
            kv_lora: checks::to_i32(kernel, "kv_lora", p.kv_lora)?,
            rope: checks::to_i32(kernel, "rope", p.rope)?,
            max_ctx: checks::to_i32(kernel, "max_ctx", p.max_ctx)?,
            n_split: checks::to_i32(kernel, "n_split", p.n_split)?,
            scale: p.scale,
            phase,
            n_q: checks::to_i32(kernel, "n_q", n_q)?,
        };
        // SAFETY: q holds n_q·n_head·D floats, cache max_ctx·D elements of the variant's type, out
        // n_q·n_head·kv_lora floats, pos n_q ints, work the counters + n_q queries' partials when
        // n_split > 1 (checked above; the counter phases 0 and 3 only for n_q = 1, phase 3 only
        // with every block resident, `phases_batch`);
        // rows read are < pos + 1 ≤ max_ctx (other positions write NaN without reading); the
        // dynamic shared memory is the template's formula and the function's limit was raised
        // to it (phase 2's merge needs less); phase 2 follows phase 1 on the same stream.
        unsafe { launch(kernel, cfg, &mut args)? }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glm5_block_fits_in_shared_memory() {
        // bf16 (tensor cores): (64 + 2 · 64) rows of 1152 bytes + P 64 · 128 + 6 · 64 floats
        // + the 1 KiB alignment slack
        assert_eq!(smem_bytes(64, 512, 64, 2), 221_184 + 8192 + 1536 + 1024);
        assert!(smem_bytes(64, 512, 64, 2) <= MAX_SMEM);
        // f32: 64 heads · 580 · 4 + 2 · 8 · 2320 + 8 · 256 + 768
        assert_eq!(smem_bytes(64, 512, 64, 4), 148_480 + 37_120 + 2048 + 768);
        assert!(smem_bytes(64, 512, 64, 4) <= MAX_SMEM);
        assert_eq!(splits_for(131_072, 64, 132), 132);
        assert_eq!(splits_for(7, 64, 132), 1);
        assert_eq!(work_floats(64, 512, 2), 4 + 64 * 2 * 514);
        assert_eq!(work_floats(320, 512, 3), 8 + 320 * 3 * 514);
        assert_eq!(combine_blocks(64, 512), 128);
        assert_eq!(combine_blocks(3, 384), 6);
        assert_eq!(combine_smem_bytes(132), 1120);
        let p = MlaDecodeParams {
            n_head: 64,
            kv_lora: 512,
            rope: 64,
            max_ctx: 10,
            n_split: 4,
            scale: 1.0,
        };
        assert_eq!(
            phases_batch(&p, 0, 132, 1).iter().map(|(ph, _)| *ph).collect::<Vec<_>>(),
            [0]
        );
        // 132 splits on 132 multiprocessors: one launch with the barrier; on fewer, two.
        let p = MlaDecodeParams { n_split: 132, ..p };
        let one = phases_batch(&p, 7, 132, 1);
        assert_eq!(one.iter().map(|(ph, c)| (*ph, c.grid_dim)).collect::<Vec<_>>(), [(3, (132, 1, 1))]);
        let two = phases_batch(&p, 0, 131, 1);
        assert_eq!(two.iter().map(|(ph, _)| *ph).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(two[1].1.grid_dim, (128, 1, 1));
        assert_eq!(two[1].1.shared_mem_bytes, 1120);
    }

    #[test]
    fn batched_queries_split_less_and_never_use_the_counters() {
        // n_q = 1 is the single-token rule.
        for (len, nh, sms) in [(131_072, 64, 132), (7, 64, 132), (5000, 128, 132), (300, 16, 78)] {
            assert_eq!(splits_for_batch(len, nh, sms, 1), splits_for(len, nh, sms));
        }
        // 3 queries of 64 heads on 132 multiprocessors: 44 splits each; 132 or more queries: one.
        assert_eq!(splits_for_batch(131_072, 64, 132, 3), 44);
        assert_eq!(splits_for_batch(131_072, 128, 132, 3), 22);
        assert_eq!(splits_for_batch(131_072, 64, 132, 132), 1);
        assert_eq!(splits_for_batch(131_072, 64, 132, 2100), 1);
        assert_eq!(splits_for_batch(100, 64, 132, 3), 2); // at least 64 rows a split
        // Every query's partials after the one set of counters.
        assert_eq!(work_floats_batch(64, 512, 2, 1), work_floats(64, 512, 2));
        assert_eq!(work_floats_batch(64, 512, 2, 3), 4 + 3 * 64 * 2 * 514);
        assert_eq!(work_floats_batch(320, 512, 3, 5), 8 + 5 * 320 * 3 * 514);
        let p = MlaDecodeParams {
            n_head: 128,
            kv_lora: 512,
            rope: 64,
            max_ctx: 10,
            n_split: 2,
            scale: 1.0,
        };
        let ph = |p: &MlaDecodeParams, n_q| {
            phases_batch(p, 7, 132, n_q)
                .iter()
                .map(|(ph, c)| (*ph, c.grid_dim, c.shared_mem_bytes))
                .collect::<Vec<_>>()
        };
        assert_eq!(ph(&p, 1), [(0, (2, 2, 1), 7)]);
        assert_eq!(ph(&p, 3), [(1, (2, 2, 3), 7), (2, (128, 2, 3), 80)]);
        let one = MlaDecodeParams { n_split: 1, ..p };
        assert_eq!(ph(&one, 40), [(0, (1, 2, 40), 7)]);
        let many = MlaDecodeParams { n_split: 9, ..p };
        assert_eq!(ph(&many, 1), [(3, (9, 2, 1), 7)]);
        assert_eq!(ph(&many, 2), [(1, (9, 2, 2), 7), (2, (128, 2, 2), 136)]);
        let wide = MlaDecodeParams { n_split: 67, ..p };
        assert_eq!(ph(&wide, 1), [(1, (67, 2, 1), 7), (2, (128, 2, 1), 600)]);
    }
}
