//! `memra bench` buffers and launches of the attention, DSA and MoE families (planned in
//! bench.rs). Every launch goes through the family's own wrapper and split/block rules
//! (`splits_for`, `blocks_for`, `work_floats`), as the decoder calls them.
//!
//! Tensors read sparsely (the latent cache of the sparse MLA, the stacked expert tensors, the
//! index-key cache written at a few positions) are allocated once and shared by every buffer set;
//! the sets rotate the small inputs and the selections (row lists, expert ids), so consecutive
//! launches read different rows.

use std::collections::HashMap;

use cudarc::driver::CudaSlice;
use memra_reference::Rng;

use super::{Filler, Shape, alloc, drv};
use crate::cuda::{Error, Gpu, Kernel};
use crate::kernels::dsa_index_key::{self, DsaIndexKeyParams};
use crate::kernels::dsa_indexer::{self, DsaIndexerParams};
use crate::kernels::dsa_topk::{self, DsaTopkParams};
use crate::kernels::mla_decode::{self, MlaDecodeParams};
use crate::kernels::moe_matvec::{self, Mode, MoeDims, MoeMatvecInputs};
use crate::kernels::attn_decode_rope::{self, AttnDecodeRopeParams, NewTokens};
use crate::kernels::qk_norm_rope::{self, QkNormRopeParams};
use crate::kernels::registry;
use crate::kernels::{attn_decode, attn_prefill, checks, matvec, mla_sparse_decode, moe_router, quantize_q8};

/// The quantize_q8 variant the moe_matvec cases on the integer path launch before the product.
const QUANTIZE_Q8: &str = "quantize_q8__generic";

/// RoPE base of the index keys (GLM-5: 1e6); the speed does not depend on it.
const FREQ_BASE: f32 = 1.0e6;

/// Tensors shared by every buffer set of a case.
#[derive(Default)]
pub(super) struct Shared {
    latent: Option<CudaSlice<u16>>,
    index_keys: Option<CudaSlice<u16>>,
    experts: Option<CudaSlice<u8>>,
    experts_up: Option<CudaSlice<u8>>,
    ln: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// quantize_q8, for the moe_matvec variants that read x as q8 rows (timed with them, as the
    /// forward launches it before them).
    quantize: Option<Kernel>,
    /// The q8 row a matvec case on the integer path quantizes its x into (every set's x in turn).
    xq: Option<CudaSlice<f32>>,
}

fn load_quantize(gpu: &Gpu) -> Result<Kernel, Error> {
    let q = registry::find(QUANTIZE_Q8).ok_or_else(|| Error::Selection { detail: format!("{QUANTIZE_Q8} is not in this build") })?;
    gpu.load_one(q)
}

impl Shared {
    /// `x` as the matvec `kernel` reads it: as given (stride k), or, for a variant on the integer
    /// path, quantized into the case's q8 row first (that launch timed with the product, as the
    /// forward runs it: models::gpu::Linear).
    pub(super) fn matvec_x(&mut self, kernel: &Kernel, x: &CudaSlice<f32>, k: usize) -> Result<(Option<&CudaSlice<f32>>, usize), Error> {
        if !matvec::reads_q8(kernel)? {
            return Ok((None, k));
        }
        let (Some(q), Some(xq)) = (self.quantize.as_ref(), self.xq.as_mut()) else {
            return Err(checks::invalid(kernel, "reads q8 x but the case has no quantize_q8 (a type without the integer path)"));
        };
        let ldq = quantize_q8::row_floats(k);
        quantize_q8::quantize_q8(q, &x.slice(..), &mut xq.slice_mut(..), k, 1, k, ldq)?;
        Ok((Some(&*xq), ldq))
    }
}

/// One buffer set of an attention / DSA / MoE case.
pub(super) enum ExtraSet {
    Attn { q: CudaSlice<f32>, k: CudaSlice<u16>, v: CudaSlice<u16>, pos: CudaSlice<i32>, out: CudaSlice<f32> },
    /// attn_decode_rope: the raw q/k/v rows and QK-norm weights (sized for `full`), the caches.
    AttnRope { q: CudaSlice<f32>, k: CudaSlice<f32>, v: CudaSlice<f32>, w: CudaSlice<f32>, kc: CudaSlice<u16>, vc: CudaSlice<u16>, pos: CudaSlice<i32>, out: CudaSlice<f32> },
    QkRope { q: CudaSlice<f32>, k: CudaSlice<f32>, v: CudaSlice<f32>, w: CudaSlice<f32>, kc: CudaSlice<u16>, vc: CudaSlice<u16>, pos: CudaSlice<i32> },
    Mla { q: CudaSlice<f32>, cache: CudaSlice<u16>, pos: CudaSlice<i32>, out: CudaSlice<f32> },
    IndexKey { k: CudaSlice<f32>, pos: CudaSlice<i32> },
    Indexer { q: CudaSlice<f32>, w: CudaSlice<f32>, keys: CudaSlice<u16>, pos: CudaSlice<i32>, scores: CudaSlice<f32> },
    Topk { scores: CudaSlice<f32>, pos: CudaSlice<i32>, idx: CudaSlice<i32>, count: CudaSlice<i32>, scratch: CudaSlice<u32> },
    Sparse { q: CudaSlice<f32>, idx: CudaSlice<i32>, count: CudaSlice<i32>, out: CudaSlice<f32> },
    Router { logits: CudaSlice<f32>, bias: CudaSlice<f32>, ids: CudaSlice<i32>, weights: CudaSlice<f32> },
    /// `xq`: x as q8 rows, written by quantize_q8 for variants that read them.
    Moe { ids: CudaSlice<i32>, weights: CudaSlice<f32>, x: CudaSlice<f32>, xq: CudaSlice<f32>, y: CudaSlice<f32> },
}

/// `count` distinct values below `n`, ascending (dsa_topk's output order).
pub(super) fn distinct_sorted(rng: &mut Rng, count: usize, n: usize) -> Vec<i32> {
    let count = count.min(n);
    let mut seen = vec![false; n];
    let mut out = Vec::with_capacity(count);
    while out.len() < count {
        let i = rng.below(n);
        if !seen[i] {
            seen[i] = true;
            out.push(i as i32);
        }
    }
    out.sort_unstable();
    out
}

fn upload<T: cudarc::driver::DeviceRepr>(fill: &Filler, host: &[T]) -> Result<CudaSlice<T>, Error> {
    fill.stream.clone_htod(host).map_err(drv("cuMemcpyHtoD (bench inputs)"))
}

impl Shared {
    /// The shared tensors of `shape` (none for most shapes).
    pub(super) fn new(gpu: &Gpu, fill: &mut Filler, shape: &Shape) -> Result<Shared, Error> {
        let mut sh = Shared::default();
        match *shape {
            Shape::MlaSparseDecode { kv_lora, rope, ctx, .. } => sh.latent = Some(fill.bf16s(ctx * (kv_lora + rope))?),
            Shape::DsaIndexKey { head_dim, .. } => {
                sh.index_keys = Some(fill.bf16s(super::DSA_CTX * head_dim)?);
                sh.ln = Some((fill.f32s(head_dim)?, fill.f32s(head_dim)?));
            }
            Shape::MoeMatvec { ty, mode, k, n, n_expert, .. } => {
                sh.experts = Some(fill.weights(ty, k, n_expert * n)?);
                if mode.is_paired() {
                    sh.experts_up = Some(fill.weights(ty, k, n_expert * n)?);
                }
                sh.quantize = Some(load_quantize(gpu)?);
            }
            // A matvec variant on the integer path (a spec entry's xq8 = 1) reads q8 x.
            Shape::Matvec { ty, k, .. } if matvec::int_dot(ty) => {
                sh.quantize = Some(load_quantize(gpu)?);
                sh.xq = Some(alloc(gpu.stream(), quantize_q8::row_floats(k))?);
            }
            _ => {}
        }
        Ok(sh)
    }
}

/// One buffer set of `shape`, or None for the dense families (bench.rs builds those).
pub(super) fn make_set(fill: &mut Filler, shape: &Shape) -> Result<Option<ExtraSet>, Error> {
    let s = fill.stream.clone();
    Ok(Some(match *shape {
        Shape::AttnDecode { n_head, n_kv, head_dim, ctx } => ExtraSet::Attn {
            q: fill.f32s(n_head * head_dim)?,
            k: fill.bf16s(ctx * n_kv * head_dim)?,
            v: fill.bf16s(ctx * n_kv * head_dim)?,
            pos: upload(fill, &[(ctx - 1) as i32])?,
            out: alloc(&s, n_head * head_dim)?,
        },
        Shape::AttnDecodeRope { n_head, n_kv, head_dim, ctx, .. } => ExtraSet::AttnRope {
            q: fill.f32s(n_head * head_dim)?,
            k: fill.f32s(n_kv * head_dim)?,
            v: fill.f32s(n_kv * head_dim)?,
            w: fill.f32s(n_head * head_dim)?,
            kc: fill.bf16s(ctx * n_kv * head_dim)?,
            vc: fill.bf16s(ctx * n_kv * head_dim)?,
            pos: upload(fill, &[(ctx - 1) as i32])?,
            out: alloc(&s, n_head * head_dim)?,
        },
        Shape::QkNormRope { t, n_head, n_kv, head_dim, .. } => ExtraSet::QkRope {
            q: fill.f32s(t * n_head * head_dim)?,
            k: fill.f32s(t * n_kv * head_dim)?,
            v: fill.f32s(t * n_kv * head_dim)?,
            // Per-head norms read hd weights, full ones a row's (q: n_head·hd, k: n_kv·hd).
            w: fill.f32s(n_head.max(n_kv) * head_dim)?,
            kc: fill.bf16s(t * n_kv * head_dim)?,
            vc: fill.bf16s(t * n_kv * head_dim)?,
            pos: upload(fill, &(0..t as i32).collect::<Vec<_>>())?,
        },
        Shape::AttnPrefill { t, n_head, n_kv, head_dim } => ExtraSet::Attn {
            q: fill.f32s(t * n_head * head_dim)?,
            k: fill.bf16s(t * n_kv * head_dim)?,
            v: fill.bf16s(t * n_kv * head_dim)?,
            pos: upload(fill, &[0])?,
            out: alloc(&s, t * n_head * head_dim)?,
        },
        Shape::MlaDecode { n_head, kv_lora, rope, ctx } => ExtraSet::Mla {
            q: fill.f32s(n_head * (kv_lora + rope))?,
            cache: fill.bf16s(ctx * (kv_lora + rope))?,
            pos: upload(fill, &[(ctx - 1) as i32])?,
            out: alloc(&s, n_head * kv_lora)?,
        },
        Shape::DsaIndexKey { t, head_dim, .. } => {
            // Consecutive positions from a random start, as a prefill chunk or a decode step writes.
            let start = fill.rng.below(super::DSA_CTX - t + 1);
            let pos: Vec<i32> = (start..start + t).map(|p| p as i32).collect();
            ExtraSet::IndexKey { k: fill.f32s(t * head_dim)?, pos: upload(fill, &pos)? }
        }
        Shape::DsaIndexer { n_head, head_dim, ctx } => ExtraSet::Indexer {
            q: fill.f32s(n_head * head_dim)?,
            w: fill.f32s(n_head)?,
            keys: fill.bf16s(ctx * head_dim)?,
            pos: upload(fill, &[(ctx - 1) as i32])?,
            scores: alloc(&s, ctx)?,
        },
        Shape::DsaTopk { ctx, k } => {
            // Enough for any multiprocessor count: blocks_for never exceeds this.
            let most = ctx.div_ceil(dsa_topk::MIN_KEYS_PER_BLOCK).max(2);
            let scratch = alloc(&s, dsa_topk::scratch_words(1, most))?;
            ExtraSet::Topk { scores: fill.f32s(ctx)?, pos: upload(fill, &[(ctx - 1) as i32])?, idx: alloc(&s, k)?, count: alloc(&s, 1)?, scratch }
        }
        Shape::MlaSparseDecode { n_head, kv_lora, rope, ctx, k } => {
            let rows = distinct_sorted(&mut fill.rng, k, ctx);
            ExtraSet::Sparse {
                q: fill.f32s(n_head * (kv_lora + rope))?,
                idx: upload(fill, &rows)?,
                count: upload(fill, &[rows.len() as i32])?,
                out: alloc(&s, n_head * kv_lora)?,
            }
        }
        Shape::MoeRouter { t, n_expert, n_used, .. } => {
            let bias = fill.rng.normal_vec(n_expert, 0.01);
            ExtraSet::Router {
                logits: fill.f32s(t * n_expert)?,
                bias: upload(fill, &bias)?,
                ids: alloc(&s, t * n_used)?,
                weights: alloc(&s, t * n_used)?,
            }
        }
        Shape::MoeMatvec { mode, t, k, n, n_expert, n_used, .. } => {
            let slots = t * n_used;
            let mut ids = distinct_sorted(&mut fill.rng, slots, n_expert);
            // Slot order as a router leaves it (not sorted).
            for i in (1..ids.len()).rev() {
                ids.swap(i, fill.rng.below(i + 1));
            }
            let wts: Vec<f32> = (0..slots).map(|_| fill.rng.uniform_in(0.05, 0.5)).collect();
            let (x_rows, y_rows) = if mode == Mode::Down { (slots, t) } else { (t, slots) };
            let xq = alloc(&s, x_rows * quantize_q8::row_floats(k))?;
            ExtraSet::Moe { ids: upload(fill, &ids)?, weights: upload(fill, &wts)?, x: fill.f32s(x_rows * k)?, xq, y: alloc(&s, y_rows * n)? }
        }
        _ => return Ok(None),
    }))
}

/// A zeroed f32 workspace of `floats` slots for `kernel`, kept across launches (the split
/// kernels leave their counters at zero).
fn workspace<'w>(work: &'w mut HashMap<&'static str, CudaSlice<f32>>, kernel: &Kernel, floats: usize) -> Result<&'w mut CudaSlice<f32>, Error> {
    if work.get(kernel.name()).is_none_or(|w| w.len() < floats) {
        work.insert(kernel.name(), alloc::<f32>(kernel.stream(), floats)?);
    }
    Ok(work.get_mut(kernel.name()).expect("inserted above"))
}

/// One launch of `kernel` on `set`.
pub(super) fn launch(
    kernel: &Kernel,
    shape: &Shape,
    set: &mut ExtraSet,
    shared: &mut Shared,
    work: &mut HashMap<&'static str, CudaSlice<f32>>,
    sms: usize,
) -> Result<(), Error> {
    match (*shape, set) {
        (Shape::AttnDecode { n_head, n_kv, head_dim, ctx }, ExtraSet::Attn { q, k, v, pos, out }) => {
            let n_split = attn_decode::SplitRule::of(kernel)?.splits(ctx, 1, n_head, n_kv, sms);
            let p = attn_decode::AttnDecodeParams {
                n_seq: 1,
                head_dim,
                n_head,
                n_kv,
                max_ctx: ctx,
                window: None,
                n_split,
                scale: 1.0 / (head_dim as f32).sqrt(),
            };
            let w = workspace(work, kernel, attn_decode::work_floats(1, n_head, head_dim, n_split))?;
            attn_decode::attn_decode(
                kernel,
                &q.slice(..),
                &k.slice(..),
                &v.slice(..),
                &pos.slice(..),
                &mut out.slice_mut(..),
                &mut w.slice_mut(..),
                &p,
            )
        }
        (Shape::AttnDecodeRope { n_head, n_kv, head_dim, n_rot, ctx }, ExtraSet::AttnRope { q, k, v, w, kc, vc, pos, out }) => {
            let n_split = attn_decode::SplitRule::of(kernel)?.splits(ctx, 1, n_head, n_kv, sms);
            let attn = attn_decode::AttnDecodeParams { n_seq: 1, head_dim, n_head, n_kv, max_ctx: ctx, window: None, n_split, scale: 1.0 / (head_dim as f32).sqrt() };
            let p = AttnDecodeRopeParams { attn, n_rot, freq_base: FREQ_BASE, freq_scale: 1.0, eps: 1e-6 };
            let ws = workspace(work, kernel, attn_decode::work_floats(1, n_head, head_dim, n_split))?;
            let (qv, kv, vv, wv) = (q.slice(..), k.slice(..), v.slice(..), w.slice(..));
            let norm_w = (checks::baked_sym(kernel.variant(), "qk_norm") != Some("none")).then_some((&wv, &wv));
            let new = NewTokens { q: &qv, k: &kv, v: &vv, norm_w };
            attn_decode_rope::attn_decode_rope(kernel, &new, &mut kc.slice_mut(..), &mut vc.slice_mut(..), &pos.slice(..), &mut out.slice_mut(..), &mut ws.slice_mut(..), &p)
        }
        // q and k are normalized and rotated in place: each launch reads what the last wrote
        // (finite, the same amount of work).
        (Shape::QkNormRope { t, n_head, n_kv, head_dim, n_rot }, ExtraSet::QkRope { q, k, v, w, kc, vc, pos }) => {
            let p = QkNormRopeParams::packed(t, head_dim, n_head, n_kv, n_rot, t, FREQ_BASE, 1e-6);
            let wv = w.slice(..);
            let norm_w = (qk_norm_rope::qk_norm(kernel)? != "none").then_some((&wv, &wv));
            qk_norm_rope::qk_norm_rope(kernel, &mut q.slice_mut(..), &mut k.slice_mut(..), &v.slice(..), norm_w, &pos.slice(..), &mut kc.slice_mut(..), &mut vc.slice_mut(..), &p)
        }
        (Shape::AttnPrefill { t, n_head, n_kv, head_dim }, ExtraSet::Attn { q, k, v, out, .. }) => {
            let p = super::prefill_params(t, n_head, n_kv, head_dim);
            attn_prefill::attn_prefill(kernel, &q.slice(..), &k.slice(..), &v.slice(..), &mut out.slice_mut(..), &p)
        }
        (Shape::MlaDecode { n_head, kv_lora, rope, ctx }, ExtraSet::Mla { q, cache, pos, out }) => {
            let n_split = mla_decode::splits_for(ctx, n_head, sms);
            let p = MlaDecodeParams { n_head, kv_lora, rope, max_ctx: ctx, n_split, scale: 1.0 / 16.0 };
            let w = workspace(work, kernel, mla_decode::work_floats(n_head, kv_lora, n_split))?;
            mla_decode::mla_decode(kernel, &q.slice(..), &cache.slice(..), &pos.slice(..), &mut out.slice_mut(..), &mut w.slice_mut(..), &p)
        }
        (Shape::MlaSparseDecode { n_head, kv_lora, rope, ctx, k }, ExtraSet::Sparse { q, idx, count, out }) => {
            let n_split = mla_sparse_decode::splits_for(k, n_head, sms);
            let p = MlaDecodeParams { n_head, kv_lora, rope, max_ctx: ctx, n_split, scale: 1.0 / 16.0 };
            let w = workspace(work, kernel, mla_decode::work_floats(n_head, kv_lora, n_split))?;
            let latent = shared.latent.as_ref().expect("Shared::new made the latent cache");
            mla_sparse_decode::mla_sparse_decode(
                kernel,
                &q.slice(..),
                &latent.slice(..),
                &idx.slice(..),
                &count.slice(..),
                &mut out.slice_mut(..),
                &mut w.slice_mut(..),
                k,
                &p,
            )
        }
        (Shape::DsaIndexKey { t, head_dim, n_rot }, ExtraSet::IndexKey { k, pos }) => {
            let p = DsaIndexKeyParams {
                n_tokens: t,
                head_dim,
                n_rot,
                k_stride: head_dim,
                max_ctx: super::DSA_CTX,
                freq_base: FREQ_BASE,
                freq_scale: 1.0,
                eps: 1e-6,
            };
            let (weight, bias) = shared.ln.as_ref().expect("Shared::new made the LayerNorm weights");
            let cache = shared.index_keys.as_mut().expect("Shared::new made the key cache");
            dsa_index_key::dsa_index_key(kernel, &k.slice(..), &weight.slice(..), &bias.slice(..), &pos.slice(..), &mut cache.slice_mut(..), &p)
        }
        (Shape::DsaIndexer { n_head, head_dim, ctx }, ExtraSet::Indexer { q, w, keys, pos, scores }) => {
            let threads = crate::kernels::checks::threads(kernel, dsa_indexer::THREADS)?;
            let p = DsaIndexerParams {
                n_q: 1,
                n_idx_head: n_head,
                idx_head_dim: head_dim,
                max_ctx: ctx,
                ld_scores: ctx,
                n_blk: dsa_indexer::blocks_for(ctx, 2, threads, sms),
            };
            dsa_indexer::dsa_indexer(kernel, &q.slice(..), &w.slice(..), &keys.slice(..), &pos.slice(..), &mut scores.slice_mut(..), &p)
        }
        (Shape::DsaTopk { ctx, k }, ExtraSet::Topk { scores, pos, idx, count, scratch }) => {
            let p = DsaTopkParams { n_q: 1, ld_scores: ctx, k, n_blk: dsa_topk::blocks_for(1, ctx, sms) };
            dsa_topk::dsa_topk(kernel, &scores.slice(..), &pos.slice(..), &mut idx.slice_mut(..), &mut count.slice_mut(..), &mut scratch.slice_mut(..), &p)
        }
        (Shape::MoeRouter { t, n_expert, n_used, sigmoid }, ExtraSet::Router { logits, bias, ids, weights }) => {
            let b = bias.slice(..);
            // GLM-5: sigmoid + exp_probs_b, renormalized, × 2.5; OLMoE: softmax, no renorm.
            let (bias, norm, scale) = if sigmoid { (Some(&b), true, 2.5) } else { (None, false, 1.0) };
            moe_router::moe_router(
                kernel,
                &logits.slice(..),
                bias,
                &mut ids.slice_mut(..),
                &mut weights.slice_mut(..),
                t,
                n_expert,
                n_used,
                norm,
                scale,
            )
        }
        (Shape::MoeMatvec { mode, t, k, n, n_expert, n_used, .. }, ExtraSet::Moe { ids, weights, x, xq, y }) => {
            let w = shared.experts.as_ref().expect("Shared::new made the expert tensor").slice(..);
            let up = shared.experts_up.as_ref().map(|u| u.slice(..));
            let down = mode == Mode::Down;
            // Variants on the integer path read x quantized by quantize_q8 first, as in the forward.
            let (xv, ldx) = if matvec::reads_q8(kernel)? {
                let q = shared.quantize.as_ref().expect("Shared::new loads quantize_q8 for moe shapes");
                let (rows, ldq) = (if down { t * n_used } else { t }, quantize_q8::row_floats(k));
                quantize_q8::quantize_q8(q, &x.slice(..), &mut xq.slice_mut(..), k, rows, k, ldq)?;
                (xq.slice(..), ldq)
            } else {
                (x.slice(..), k)
            };
            let (iv, wv) = (ids.slice(..), weights.slice(..));
            let inp = MoeMatvecInputs { w: &w, w_up: up.as_ref(), ids: &iv, weights: down.then_some(&wv), x: &xv };
            let dims = MoeDims { k, n, n_tokens: t, n_used, n_expert, ldx, ldy: n };
            moe_matvec::moe_matvec(kernel, &inp, &mut y.slice_mut(..), dims)
        }
        _ => unreachable!("make_set builds the set that matches its shape"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selections_are_distinct_and_ascending() {
        let mut rng = Rng::from_env_or_time("bench selections");
        for (count, n) in [(8, 256), (2048, 131_072), (8, 8), (1, 1)] {
            let v = distinct_sorted(&mut rng, count, n);
            assert_eq!(v.len(), count);
            assert!(v.windows(2).all(|w| w[0] < w[1]), "{v:?}");
            assert!(v.iter().all(|&i| (i as usize) < n));
        }
    }
}
