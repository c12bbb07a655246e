//! Prefill attention of an MLA layer: the `t` query tokens of a chunk in batched launches
//! (mla_decode / mla_sparse_decode with `n_q` queries, dsa_indexer and dsa_topk over `n_q` rows)
//! instead of one decode launch per token. Each token keeps its own dense/sparse choice
//! ([`Net::attn_plan`], the CPU reference's rule): positions grow along the chunk, so the dense
//! tokens (at most top_k keys visible) come first and the chunk splits once at that boundary.

use std::ops::Range;

use super::{AttnPlan, Bufs, IndexerConfig, Net, State};
use crate::kernels::dsa_indexer::{self, DsaIndexerParams};
use crate::kernels::dsa_topk::{self, DsaTopkParams};
use crate::kernels::mla_decode::{self, MlaDecodeParams};
use crate::kernels::mla_sparse_decode;
use crate::models::gpu::{err, Result};

/// Floats of index scores a prefill buffer holds at most (64 MiB): rows of a long context are
/// scored in sub-batches of `SCORES_CAP / visible` queries.
pub(super) const SCORES_CAP: usize = 1 << 24;

/// Query rows of index scores for a chunk of `t` tokens and a cache of `max_ctx` rows (the
/// buffer holds `rows · max_ctx` floats; at least one row, as decode needs).
pub(super) fn score_rows(t: usize, max_ctx: usize) -> usize {
    t.min(SCORES_CAP / max_ctx.max(1)).max(1)
}

/// The largest split count up to `want` whose workspace for `n_q` queries fits `work_len` floats
/// (1 needs none).
fn fitting_splits(
    want: usize,
    n_head: usize,
    kv_lora: usize,
    n_q: usize,
    work_len: usize,
) -> usize {
    (1..=want.max(1))
        .rev()
        .find(|&s| s == 1 || mla_decode::work_floats_batch(n_head, kv_lora, s, n_q) <= work_len)
        .unwrap_or(1)
}

impl Net {
    /// Attention of rows `0..t` (positions `pos0..pos0 + t`) of layer `il`:
    /// `lat[i] = softmax(q_abs[i]·K)·C` over the latent cache rows visible to row i, dense or
    /// over the DSA selection (computed here for indexer layers). One row is the decode path
    /// ([`Net::attend`], unchanged).
    pub(super) fn attend_rows(
        &self,
        state: &mut State,
        b: &mut Bufs,
        il: usize,
        t: usize,
        pos0: usize,
        idx: Option<IndexerConfig>,
    ) -> Result<()> {
        if t == 1 {
            return self.attend(state, b, il, 0, pos0, idx);
        }
        let first_sparse = (0..t)
            .find(|&i| matches!(self.attn_plan(il, pos0 + i), AttnPlan::Sparse { .. }))
            .unwrap_or(t);
        if first_sparse > 0 {
            self.attend_dense(state, b, il, 0..first_sparse, pos0)?;
        }
        if first_sparse < t {
            self.attend_sparse(state, b, il, first_sparse..t, pos0, idx)?;
        }
        Ok(())
    }

    fn mla_params(
        &self,
        max_ctx: usize,
        want: usize,
        n_q: usize,
        work_len: usize,
    ) -> MlaDecodeParams {
        let c = &self.cfg;
        MlaDecodeParams {
            n_head: c.n_head,
            kv_lora: c.kv_lora,
            rope: c.rope,
            max_ctx,
            n_split: fitting_splits(want, c.n_head, c.kv_lora, n_q, work_len),
            scale: c.kq_scale,
        }
    }

    /// Dense attention of `rows`, at most [`mla_decode::MAX_QUERIES`] per launch.
    fn attend_dense(
        &self,
        state: &mut State,
        b: &mut Bufs,
        il: usize,
        rows: Range<usize>,
        pos0: usize,
    ) -> Result<()> {
        let c = &self.cfg;
        let (nh, dk, kvl) = (c.n_head, c.kv_lora + c.rope, c.kv_lora);
        let kernel = self.kernels.get(self.names.mla_decode)?;
        let cache = state.cache.latent[il].slice(..);
        for s in rows.clone().step_by(mla_decode::MAX_QUERIES) {
            let e = (s + mla_decode::MAX_QUERIES).min(rows.end);
            let n_q = e - s;
            // Splits for the longest row of the batch (its last).
            let want = mla_decode::splits_for_batch(pos0 + e, nh, self.sm_count, n_q);
            let p = self.mla_params(state.max_ctx, want, n_q, b.work.len());
            mla_decode::mla_decode_batch(
                kernel,
                &b.q_abs.slice(s * nh * dk..e * nh * dk),
                &cache,
                &b.pos.slice(s..e),
                &mut b.lat.slice_mut(s * nh * kvl..e * nh * kvl),
                &mut b.work.slice_mut(..),
                n_q,
                &p,
            )?;
        }
        Ok(())
    }

    /// Sparse attention of `rows` (all past top_k visible keys): for an indexer layer its scores
    /// and top-k selection first (sub-batches of as many query rows as the scores buffer holds,
    /// rows of `ld` = the last row's visible keys), then mla_sparse_decode over the selections.
    fn attend_sparse(
        &self,
        state: &mut State,
        b: &mut Bufs,
        il: usize,
        rows: Range<usize>,
        pos0: usize,
        idx: Option<IndexerConfig>,
    ) -> Result<()> {
        let c = &self.cfg;
        let (nh, dk, kvl) = (c.n_head, c.kv_lora + c.rope, c.kv_lora);
        let [_, indexer, topk, sparse] = self
            .names
            .dsa
            .ok_or_else(|| err("a DSA layer but no DSA kernels planned"))?;
        let top_k = c
            .indexer
            .ok_or_else(|| err("sparse attention without an indexer config"))?
            .top_k;
        let k = &self.kernels;
        let ld = pos0 + rows.end;
        if b.scores.len() < ld {
            return Err(err(format!(
                "index scores hold {} floats, a row needs {ld}",
                b.scores.len()
            )));
        }
        let per_batch = (b.scores.len() / ld).clamp(1, mla_decode::MAX_QUERIES);
        for s in rows.clone().step_by(per_batch) {
            let e = (s + per_batch).min(rows.end);
            let n_q = e - s;
            if let Some(ic) = idx {
                // This layer's own selection for rows s..e (a later layer without indexer reuses it).
                let kc = state.cache.index_keys[il]
                    .as_ref()
                    .ok_or_else(|| err("an indexer layer without an index-key cache"))?;
                let (hq, nqh) = (ic.n_head * ic.head_dim, ic.n_head);
                // This chunk's (t = rows.end) queries and head weights in the stacked outputs.
                let (iq_at, iw_at) = self.indexer_at(il, rows.end);
                // Key rows past `ld` are never visible to these rows: score rows of `ld` floats.
                let p = DsaIndexerParams {
                    n_q,
                    n_idx_head: ic.n_head,
                    idx_head_dim: ic.head_dim,
                    max_ctx: ld,
                    ld_scores: ld,
                    n_blk: dsa_indexer::blocks_for(
                        ld,
                        2,
                        dsa_indexer::THREADS,
                        self.sm_count.div_ceil(n_q),
                    ),
                };
                dsa_indexer::dsa_indexer(
                    k.get(indexer)?,
                    &b.qp.slice(iq_at + s * hq..iq_at + e * hq),
                    &b.hp.slice(iw_at + s * nqh..iw_at + e * nqh),
                    &kc.slice(..),
                    &b.pos.slice(s..e),
                    &mut b.scores.slice_mut(..n_q * ld),
                    &p,
                )?;
                // Several blocks per row only while the zeroed scratch (sized for one row) holds them.
                let n_blk = match n_q {
                    1 => b.topk_blk,
                    _ => Some(dsa_topk::blocks_for(n_q, ld, self.sm_count))
                        .filter(|&nb| dsa_topk::scratch_words(n_q, nb) <= b.topk_scratch.len())
                        .unwrap_or(1),
                };
                let p = DsaTopkParams {
                    n_q,
                    ld_scores: ld,
                    k: top_k,
                    n_blk,
                };
                dsa_topk::dsa_topk(
                    k.get(topk)?,
                    &b.scores.slice(..n_q * ld),
                    &b.pos.slice(s..e),
                    &mut b.sel_idx.slice_mut(s * top_k..e * top_k),
                    &mut b.sel_count.slice_mut(s..e),
                    &mut b.topk_scratch.slice_mut(..),
                    &p,
                )?;
            }
            let want = mla_sparse_decode::splits_for_batch(top_k, nh, self.sm_count, n_q);
            let p = self.mla_params(state.max_ctx, want, n_q, b.work.len());
            mla_sparse_decode::mla_sparse_decode_batch(
                k.get(sparse)?,
                &b.q_abs.slice(s * nh * dk..e * nh * dk),
                &state.cache.latent[il].slice(..),
                &b.sel_idx.slice(s * top_k..e * top_k),
                &b.sel_count.slice(s..e),
                &mut b.lat.slice_mut(s * nh * kvl..e * nh * kvl),
                &mut b.work.slice_mut(..),
                top_k,
                n_q,
                &p,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn score_rows_cap_the_buffer_and_keep_one_row() {
        assert_eq!(score_rows(1, 131_072), 1);
        assert_eq!(score_rows(512, 131_072), 128);
        assert_eq!(score_rows(512, 4096), 512);
        assert_eq!(score_rows(512, SCORES_CAP * 2), 1);
        assert!(score_rows(512, 131_072) * 131_072 <= SCORES_CAP);
    }

    #[test]
    fn splits_shrink_to_the_workspace() {
        // GLM-5 heads: a workspace sized for 132 splits of one query.
        let work = mla_decode::work_floats(64, 512, 132);
        assert_eq!(fitting_splits(132, 64, 512, 1, work), 132);
        assert_eq!(fitting_splits(44, 64, 512, 3, work), 44);
        assert_eq!(fitting_splits(40, 64, 512, 4, work), 33);
        assert!(mla_decode::work_floats_batch(64, 512, 33, 4) <= work);
        assert!(mla_decode::work_floats_batch(64, 512, 34, 4) > work);
        assert_eq!(fitting_splits(8, 64, 512, 512, work), 1);
        assert_eq!(fitting_splits(1, 64, 512, 512, 0), 1);
    }
}
