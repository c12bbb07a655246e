//! mla_sparse_decode: absorbed MLA decode over the DSA-selected latent rows `idx[0..count)`
//! (model-specs §8.4 step 9); mla_decode's kernel body with a row list
//! (templates/memra/mla_sparse_decode.cuh). Shapes, workspace and shared memory as mla_decode.

use cudarc::driver::{CudaView, CudaViewMut};

use crate::cuda::{Error, Kernel};
use crate::kernels::checks;
use crate::kernels::launch::{KernelArgs, launch};
use crate::kernels::mla_decode::{self, MlaDecodeParams};
use crate::kernels::qk_norm_rope::CacheElem;

pub const FAMILY: &str = "mla_sparse_decode";

/// Kernel parameters in order (see the template's header comment).
#[derive(KernelArgs)]
#[kernel_args(family = "mla_sparse_decode")]
pub struct MlaSparseDecodeArgs<'a, C: CacheElem> {
    pub q: CudaView<'a, f32>,
    pub cache: CudaView<'a, C>,
    pub idx: CudaView<'a, i32>,
    pub count: CudaView<'a, i32>,
    pub out: CudaViewMut<'a, f32>,
    pub work: CudaViewMut<'a, f32>,
    pub n_head: i32,
    pub kv_lora: i32,
    pub rope: i32,
    pub max_ctx: i32,
    pub idx_cap: i32,
    pub n_split: i32,
    pub scale: f32,
    /// As mla_decode's: 0 = last-block merge, 1 = partials only, 2 = merge only, 3 = fused.
    pub phase: i32,
    /// Query tokens (grid.z), each with its own idx row and count.
    pub n_q: i32,
}

/// Fewest selected rows one split handles. Half of dense decode's: the gathered rows are few
/// (2048 at GLM-5), so more splits hide the gather latency. The H200 block-count sweep at
/// T = 131072, k = 2048 (benches/results/h200-2026-11-30-s4-final-2b78117.txt): 33.4 µs at 32
/// splits (64 rows each), 31.7 µs at 64, 35.9 µs at 128.
pub const MIN_SPLIT_ROWS: usize = 32;

/// A split count for up to `top_k` selected rows (mla_decode's rule, [`MIN_SPLIT_ROWS`] rows).
pub fn splits_for(top_k: usize, n_head: usize, sm_count: usize) -> usize {
    mla_decode::splits_with(top_k, n_head, sm_count, MIN_SPLIT_ROWS)
}

/// [`splits_for`] for `n_q` query tokens (mla_decode::splits_with_batch's rule).
pub fn splits_for_batch(top_k: usize, n_head: usize, sm_count: usize, n_q: usize) -> usize {
    mla_decode::splits_with_batch(top_k, n_head, sm_count, MIN_SPLIT_ROWS, n_q)
}

/// Absorbed MLA decode for one token over the rows `idx[0..count[0])` (dsa_topk's outputs):
/// `q` `[n_head, kv_lora + rope]`, `cache` `[max_ctx, kv_lora + rope]`, `idx` at least `top_k`
/// ints (the selection capacity; a count above it gives NaN), `out` `[n_head, kv_lora]`; `work` as mla_decode.
#[allow(clippy::too_many_arguments)]
pub fn mla_sparse_decode<C: CacheElem>(
    kernel: &Kernel,
    q: &CudaView<'_, f32>,
    cache: &CudaView<'_, C>,
    idx: &CudaView<'_, i32>,
    count: &CudaView<'_, i32>,
    out: &mut CudaViewMut<'_, f32>,
    work: &mut CudaViewMut<'_, f32>,
    top_k: usize,
    p: &MlaDecodeParams,
) -> Result<(), Error> {
    mla_sparse_decode_batch(kernel, q, cache, idx, count, out, work, top_k, 1, p)
}

/// [`mla_sparse_decode`] for `n_q` query tokens in one launch (prefill): query j attends over
/// `idx[j·top_k ..][..count[j]]` (dsa_topk's rows for `n_q` queries); `q`, `out`, `work` as
/// mla_decode::mla_decode_batch. Splits: [`splits_for_batch`].
#[allow(clippy::too_many_arguments)]
pub fn mla_sparse_decode_batch<C: CacheElem>(
    kernel: &Kernel,
    q: &CudaView<'_, f32>,
    cache: &CudaView<'_, C>,
    idx: &CudaView<'_, i32>,
    count: &CudaView<'_, i32>,
    out: &mut CudaViewMut<'_, f32>,
    work: &mut CudaViewMut<'_, f32>,
    top_k: usize,
    n_q: usize,
    p: &MlaDecodeParams,
) -> Result<(), Error> {
    if top_k == 0 {
        return Err(checks::invalid(kernel, "top_k=0"));
    }
    let smem = mla_decode::check_launch(kernel, q, cache, out, work, p, n_q)?;
    checks::check_len(kernel, "count", count.len(), n_q)?;
    checks::check_len(kernel, "idx", idx.len(), n_q * top_k)?;
    for (phase, cfg) in mla_decode::phases_batch(p, smem, mla_decode::sm_count(kernel)?, n_q) {
        let mut args = MlaSparseDecodeArgs {
            q: q.slice(..),
            cache: cache.slice(..),
            idx: idx.slice(..),
            count: count.slice(..),
            out: out.slice_mut(..),
            work: work.slice_mut(..),
            n_head: checks::to_i32(kernel, "n_head", p.n_head)?,
            kv_lora: checks::to_i32(kernel, "kv_lora", p.kv_lora)?,
            rope: checks::to_i32(kernel, "rope", p.rope)?,
            max_ctx: checks::to_i32(kernel, "max_ctx", p.max_ctx)?,
            idx_cap: checks::to_i32(kernel, "top_k", top_k)?,
            n_split: checks::to_i32(kernel, "n_split", p.n_split)?,
            scale: p.scale,
            phase,
            n_q: checks::to_i32(kernel, "n_q", n_q)?,
        };
        // SAFETY: as mla_decode (phase 3: n_q = 1 and all blocks resident, `phases_batch`
        // checked); query j reads idx[j·top_k ..][..count[j]] only for count[j] ≤ idx_cap = top_k
        // (idx holds n_q·top_k; else it writes NaN without reading), and no cache row outside
        // [0, max_ctx).
        unsafe { launch(kernel, cfg, &mut args)? }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(n_head: usize, n_split: usize) -> MlaDecodeParams {
        MlaDecodeParams {
            n_head,
            kv_lora: 512,
            rope: 64,
            max_ctx: 131_072,
            n_split,
            scale: 0.0625,
        }
    }

    #[test]
    fn phase_rule() {
        let ph = |n_head, n_split, sms| {
            mla_decode::phases_batch(&p(n_head, n_split), 0, sms, 1)
                .iter()
                .map(|x| x.0)
                .collect::<Vec<_>>()
        };
        // GLM-5 decode: 2048 selected rows in 64 splits, one launch with the spread merge.
        assert_eq!(splits_for(2048, 64, 132), 64);
        assert_eq!(ph(64, 64, 132), vec![3]);
        assert_eq!(ph(64, 32, 132), vec![3]);
        assert_eq!(ph(64, 4, 132), vec![0]);
        assert_eq!(ph(64, 1, 132), vec![0]);
        // More blocks than multiprocessors: partials, then a merge launch.
        assert_eq!(ph(64, 133, 132), vec![1, 2]);
        assert_eq!(ph(128, 70, 132), vec![1, 2]);
        assert_eq!(ph(128, 66, 132), vec![3]);
    }

    #[test]
    fn phase_rule_counts_every_query() {
        let ph = |n_head, n_split, sms, n_q| {
            mla_decode::phases_batch(&p(n_head, n_split), 0, sms, n_q)
                .iter()
                .map(|x| (x.0, x.1.grid_dim))
                .collect::<Vec<_>>()
        };
        // One query: the single-token rule, grid z = 1.
        assert_eq!(ph(64, 64, 132, 1), vec![(3, (64, 1, 1))]);
        // 2 queries in 64 splits would fit 132 multiprocessors, but phase 3's counters serve
        // one query: phases 1 + 2 over both.
        assert_eq!(
            ph(64, 64, 132, 2),
            vec![(1, (64, 1, 2)), (2, (128, 1, 2))]
        );
        assert_eq!(ph(64, 3, 132, 5), vec![(1, (3, 1, 5)), (2, (128, 1, 5))]);
        assert_eq!(ph(64, 1, 132, 500), vec![(0, (1, 1, 500))]);
        // The batched split count: 132 multiprocessors over 3 queries, 44 each (≥ 32 rows).
        assert_eq!(splits_for_batch(2048, 64, 132, 3), 44);
        assert_eq!(splits_for_batch(2048, 64, 132, 1), splits_for(2048, 64, 132));
        assert_eq!(splits_for_batch(2048, 64, 132, 200), 1);
    }
}
