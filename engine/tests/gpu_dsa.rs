//! GPU tests of the DeepSeek Sparse Attention kernels (dsa_indexer, dsa_topk, mla_sparse_decode)
//! against memra-reference at GLM-5 dims (indexer 32 heads × 128, top-k 2048, MLA 64 heads over
//! the 512 + 64 latent cache, scale 1/16), specialized and generic variants, for contexts 1, 7,
//! 2047, 2048, 2049, 40000 (and 131072 for indexer + top-k). Fresh random inputs (seed printed;
//! replay with `MEMRA_SEED=<seed>`), outputs NaN-poisoned before every launch.
//!
//! Checks, per context:
//! - indexer scores vs `dsa::indexer_scores` on the same bf16-rounded keys: L2 error ≤ 1e-5 of the
//!   L2 size of the summed terms Σ|w|·ReLU(q·k) (a score can cancel; its error scales with its terms)
//!   (the kernel's products keep ~16 bits of q, f32 accumulation);
//! - top-k: the kernel's index list equals `dsa::top_k` run on the kernel's own scores (exact,
//!   same tie rule), count = min(2048, visible), tail −1;
//! - sparse attention vs `attention::attention` with the allow-list mask (the reference DSA path)
//!   over the kernel's selection: relative L2 ≤ 1e-2 (bf16 latent cache: the tensor-core path
//!   rounds q and the softmax weights to bf16, ≈ 2e-3 expected; gpu_attention's MLA_TC_TOL);
//! - ≤ 2048 visible: sparse output bit-identical to dense mla_decode with the same split.
//!
//! Run on a GPU machine: `cargo test -p memra-engine --test gpu_dsa -- --ignored`.

mod dense_common;
mod gpu_common;
mod mla_common;

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use dense_common::{V, bf16_to_f32, variant};
use gpu_common::{down, gpu, load_all, up};
use memra_engine::cuda::{Error, Gpu, Kernel};
use memra_engine::kernels::dsa_index_key::{self, DsaIndexKeyParams};
use memra_engine::kernels::dsa_indexer::{self, DsaIndexerParams};
use memra_engine::kernels::dsa_topk::{self, DsaTopkParams};
use memra_engine::kernels::mla_decode::{self, MlaDecodeParams};
use memra_engine::kernels::mla_sparse_decode;
use memra_engine::kernels::registry::KernelVariant;
use memra_reference::attention::{AttnShape, Mask, attention};
use memra_reference::dsa::{IndexerDims, indexer_scores, top_k};
use memra_reference::norm::layer_norm;
use memra_reference::rope::{Rope, RopeMode, rope_head};
use memra_reference::{Rng, rel_err};
use mla_common::{Query, mla_reference, random_rows};

const SMS: usize = 132;
const IDX: IndexerDims = IndexerDims::GLM5;
const TOP_K: usize = 2048;
const N_HEAD: usize = 64;
const KV_LORA: usize = 512;
const ROPE: usize = 64;
const SCALE: f32 = 1.0 / 16.0;
const LENGTHS: [usize; 6] = [1, 7, 2047, 2048, 2049, 40000];
const SCORE_TOL: f64 = 1e-5;
const ATTN_TOL: f64 = 1e-2;
/// Score values with exact ties for dsa_topk (−0 and +0 compare equal; ±∞).
const PALETTE: [f32; 7] = [-1.0, -0.0, 0.0, 0.5, 2.0, f32::INFINITY, f32::NEG_INFINITY];

// ---------------------------------------------------------------------------------------------
// Harness.

fn to_bf16(f: f32) -> u16 {
    let b = f.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// Random values rounded to bf16: (device bits, the f32 values they stand for).
fn bf16_vals(rng: &mut Rng, n: usize) -> (Vec<u16>, Vec<f32>) {
    let bits: Vec<u16> = rng.normal_vec(n, 1.0).iter().map(|&x| to_bf16(x)).collect();
    let vals = bits.iter().map(|&b| bf16_to_f32(b)).collect();
    (bits, vals)
}

/// `v` sorted, without repeats.
fn sorted(mut v: Vec<usize>) -> Vec<usize> {
    v.sort_unstable();
    v.dedup();
    v
}

/// Indexer head weights as glm-dsa scales them (1/sqrt(d_I·H_I)), both signs.
fn head_weights(rng: &mut Rng) -> Vec<f32> {
    let (nh, hd) = (IDX.n_head, IDX.head_dim);
    rng.normal_vec(nh, 1.0)
        .iter()
        .map(|v| v / ((hd * nh) as f32).sqrt())
        .collect()
}

/// Indexer parameters at GLM-5 dims: `n_q` queries over `max_ctx` cached keys, score rows
/// `max_ctx` apart.
fn indexer_params(n_q: usize, max_ctx: usize, n_blk: usize) -> DsaIndexerParams {
    DsaIndexerParams {
        n_q,
        n_idx_head: IDX.n_head,
        idx_head_dim: IDX.head_dim,
        max_ctx,
        ld_scores: max_ctx,
        n_blk,
    }
}

/// MLA decode parameters at GLM-5 dims.
fn mla_params(max_ctx: usize, n_split: usize) -> MlaDecodeParams {
    MlaDecodeParams {
        n_head: N_HEAD,
        kv_lora: KV_LORA,
        rope: ROPE,
        max_ctx,
        n_split,
        scale: SCALE,
    }
}

/// The split counts sorted without repeats, and a zeroed work buffer for the largest.
fn splits_and_work(s: &Arc<CudaStream>, splits: Vec<usize>) -> (Vec<usize>, CudaSlice<f32>) {
    let splits = sorted(splits);
    let largest = *splits.last().expect("a split count");
    let work = s
        .alloc_zeros::<f32>(mla_decode::work_floats(N_HEAD, KV_LORA, largest))
        .expect("alloc");
    (splits, work)
}

/// dsa_indexer on whole device buffers.
fn indexer<C: KeyElem>(
    k: &Kernel,
    q: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    keys: &CudaSlice<C>,
    pos: &CudaSlice<i32>,
    scores: &mut CudaSlice<f32>,
    p: &DsaIndexerParams,
) -> Result<(), Error> {
    dsa_indexer::dsa_indexer(
        k,
        &q.as_view(),
        &w.as_view(),
        &keys.as_view(),
        &pos.as_view(),
        &mut scores.as_view_mut(),
        p,
    )
}

/// dsa_topk on whole device buffers.
fn topk(
    k: &Kernel,
    scores: &CudaSlice<f32>,
    pos: &CudaSlice<i32>,
    idx: &mut CudaSlice<i32>,
    count: &mut CudaSlice<i32>,
    scratch: &mut CudaSlice<u32>,
    p: &DsaTopkParams,
) -> Result<(), Error> {
    dsa_topk::dsa_topk(
        k,
        &scores.as_view(),
        &pos.as_view(),
        &mut idx.as_view_mut(),
        &mut count.as_view_mut(),
        &mut scratch.as_view_mut(),
        p,
    )
}

/// mla_sparse_decode over the TOP_K-long selection, on whole device buffers.
#[allow(clippy::too_many_arguments)]
fn sparse(
    k: &Kernel,
    q: &CudaSlice<f32>,
    cache: &CudaSlice<u16>,
    idx: &CudaSlice<i32>,
    count: &CudaSlice<i32>,
    out: &mut CudaSlice<f32>,
    work: &mut CudaSlice<f32>,
    p: &MlaDecodeParams,
) -> Result<(), Error> {
    mla_sparse_decode::mla_sparse_decode(
        k,
        &q.as_view(),
        &cache.as_view(),
        &idx.as_view(),
        &count.as_view(),
        &mut out.as_view_mut(),
        &mut work.as_view_mut(),
        TOP_K,
        p,
    )
}

/// dsa_index_key of `(k rows, LayerNorm weight, bias)` into a cache filled with `nan` (a NaN of
/// its type, so a row written by mistake shows), read back.
fn index_key_cache<C: KeyElem>(
    s: &Arc<CudaStream>,
    k: &Kernel,
    [raw, w, b]: [&CudaSlice<f32>; 3],
    pos: &CudaSlice<i32>,
    nan: C,
    p: &DsaIndexKeyParams,
) -> Vec<C> {
    let mut cache = up(s, &vec![nan; p.max_ctx * p.head_dim]);
    dsa_index_key::dsa_index_key(
        k,
        &raw.as_view(),
        &w.as_view(),
        &b.as_view(),
        &pos.as_view(),
        &mut cache.as_view_mut(),
        p,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    down(s, &cache)
}

/// Score rows for dsa_topk: 0 = normal, 1 = a palette of exact ties (±0, ±∞, `extra`),
/// else all `equal`.
fn fill_row(row: &mut [f32], kind: u8, extra: &[f32], equal: f32, rng: &mut Rng) {
    let palette: Vec<f32> = PALETTE.iter().chain(extra).copied().collect();
    match kind {
        0 => row.copy_from_slice(&rng.normal_vec(row.len(), 1.0)),
        1 => row
            .iter_mut()
            .for_each(|v| *v = palette[rng.below(palette.len())]),
        _ => row.iter_mut().for_each(|v| *v = equal),
    }
}

#[track_caller]
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64, rng: &Rng) {
    let err = rel_err(got, want);
    let bad: Vec<_> = got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (a, b))| !(((**a - **b).abs() as f64) <= tol * (b.abs() as f64 + 1e-2)))
        .take(5)
        .collect();
    assert!(
        err <= tol,
        "{what}: relative L2 error {err:e} > {tol:e} (MEMRA_SEED={}); first mismatches (index, (got, want)): {bad:?}",
        rng.seed()
    );
    eprintln!("ok {what}: relative L2 {err:.2e}");
}

/// As [`assert_close`] with the error measured against the size of the summed terms:
/// ‖got − want‖ / ‖magnitude‖ ≤ tol, where magnitude[i] ≥ |want[i]| is Σ|term| of score i.
fn assert_close_scaled(
    what: &str,
    got: &[f32],
    want: &[f32],
    magnitude: &[f32],
    tol: f64,
    rng: &Rng,
) {
    let diff: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let size: f64 = magnitude
        .iter()
        .map(|m| (*m as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let err = if size > 0.0 { diff / size } else { diff };
    let bad: Vec<_> = got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (a, b))| a != b)
        .take(5)
        .collect();
    assert!(
        err <= tol && got.iter().all(|v| v.is_finite()),
        "{what}: error {err:e} of the summed terms' size > {tol:e} (MEMRA_SEED={}); first differences (index, (got, want)): {bad:?}",
        rng.seed()
    );
    eprintln!(
        "ok {what}: error {err:.2e} of the summed terms' size (relative L2 {:.2e})",
        rel_err(got, want)
    );
}

/// Reference index scores for keys `0..n` (query at position n − 1), spread over the host's cores.
fn ref_scores(q: &[f32], w: &[f32], k: &[f32], n: usize) -> Vec<f32> {
    let hd = IDX.head_dim;
    let threads = std::thread::available_parallelism().map_or(4, |p| p.get());
    let chunk = n.div_ceil(threads).max(1);
    std::thread::scope(|sc| {
        let parts: Vec<_> = (0..n)
            .step_by(chunk)
            .map(|s0| {
                let len = chunk.min(n - s0);
                let ks = &k[s0 * hd..(s0 + len) * hd];
                sc.spawn(move || indexer_scores(q, w, ks, IDX, &[len - 1]))
            })
            .collect();
        parts
            .into_iter()
            .flat_map(|h| h.join().expect("reference thread"))
            .collect()
    })
}

struct Kernels {
    indexer: Vec<Kernel>,
    topk: Vec<Kernel>,
    sparse: Vec<Kernel>,
    dense: Vec<Kernel>,
}

fn kernels(gpu: &Gpu, cache_t: &'static str) -> Kernels {
    let mla = |family: &str| {
        [
            variant(
                family,
                &[
                    ("n_head", V::I(N_HEAD as i64)),
                    ("kv_lora", V::I(KV_LORA as i64)),
                    ("rope", V::I(ROPE as i64)),
                ],
            ),
            variant(family, &[]),
        ]
    };
    let vs = [
        variant(
            "dsa_indexer",
            &[
                ("n_idx_head", V::I(IDX.n_head as i64)),
                ("idx_head_dim", V::I(IDX.head_dim as i64)),
                ("cache_t", V::S(cache_t)),
            ],
        ),
        variant("dsa_indexer", &[("cache_t", V::S(cache_t))]),
        variant("dsa_topk", &[("k", V::I(TOP_K as i64))]),
        variant("dsa_topk", &[]),
    ];
    let mut all: Vec<&'static KernelVariant> = vs.to_vec();
    all.extend(mla("mla_sparse_decode"));
    all.extend(mla("mla_decode"));
    let mut k = load_all(gpu, &all).into_iter();
    let mut take = |n: usize| (&mut k).take(n).collect::<Vec<_>>();
    Kernels {
        indexer: take(2),
        topk: take(2),
        sparse: take(2),
        dense: take(2),
    }
}

/// Index-key cache element on the host.
trait KeyElem:
    DeviceRepr
    + ValidAsZeroBits
    + Clone
    + Default
    + Copy
    + memra_engine::kernels::qk_norm_rope::CacheElem
{
    fn encode(rng: &mut Rng, n: usize) -> (Vec<Self>, Vec<f32>);
}
impl KeyElem for u16 {
    fn encode(rng: &mut Rng, n: usize) -> (Vec<u16>, Vec<f32>) {
        bf16_vals(rng, n)
    }
}
impl KeyElem for f32 {
    fn encode(rng: &mut Rng, n: usize) -> (Vec<f32>, Vec<f32>) {
        let v = rng.normal_vec(n, 1.0);
        (v.clone(), v)
    }
}

/// Indexer (every variant) then top-k (every variant) for one query at position n − 1 over
/// `keys` (device) / `kvals` (host values). Returns the last selection (idx, count) on the
/// device and on the host.
#[allow(clippy::too_many_arguments)]
fn indexer_and_topk<C: KeyElem>(
    gpu: &Gpu,
    ks: &Kernels,
    keys: &CudaSlice<C>,
    kvals: &[f32],
    max_ctx: usize,
    n: usize,
    rng: &mut Rng,
) -> (CudaSlice<i32>, CudaSlice<i32>, Vec<usize>) {
    let s = gpu.stream();
    let (nh, hd) = (IDX.n_head, IDX.head_dim);
    let q = rng.normal_vec(nh * hd, 1.0);
    let w = head_weights(rng);
    let want = ref_scores(&q, &w, kvals, n);
    // Σ_h |w_h|·ReLU(q_h·k): the size of the terms each score sums. The kernel's rounding error
    // scales with it, not with the signed sum, which can cancel (a single visible key makes the
    // relative L2 of the scores that one value's relative error).
    let w_abs: Vec<f32> = w.iter().map(|v| v.abs()).collect();
    let magnitude = ref_scores(&q, &w_abs, kvals, n);
    let (dq, dw, dpos) = (up(s, &q), up(s, &w), up(s, &[(n - 1) as i32]));
    let mut dscores = up(s, &vec![f32::NAN; max_ctx]);
    let auto_blk = dsa_indexer::blocks_for(n, std::mem::size_of::<C>(), 256, SMS);
    // The wrapper's block count, then 5 blocks (many tiles per warp: the prefetch pipeline).
    for (k, n_blk) in ks.indexer.iter().flat_map(|k| [(k, auto_blk), (k, 5)]) {
        let p = indexer_params(1, max_ctx, n_blk);
        dscores = up(s, &vec![f32::NAN; max_ctx]);
        indexer(k, &dq, &dw, keys, &dpos, &mut dscores, &p).unwrap_or_else(|e| panic!("{e}"));
        let got = down(s, &dscores);
        assert_close_scaled(
            &format!("{} n={n} n_blk={n_blk}", k.name()),
            &got[..n],
            &want,
            &magnitude,
            SCORE_TOL,
            rng,
        );
        assert!(
            got[n..].iter().all(|v| v.is_nan()),
            "{} n={n}: wrote past the visible keys (MEMRA_SEED={})",
            k.name(),
            rng.seed()
        );
    }
    let scores = down(s, &dscores);
    let want_sel = top_k(&scores[..n], TOP_K);
    let mut last = None;
    for k in &ks.topk {
        for n_blk in topk_blocks(gpu, 1, n) {
            let (didx, dcount) = run_topk(gpu, k, &dscores, &dpos, 1, max_ctx, n_blk, rng);
            check_selection(
                &format!("{} n={n} n_blk={n_blk}", k.name()),
                &down(s, &didx),
                down(s, &dcount)[0],
                &want_sel,
                rng,
            );
            last = Some((didx, dcount));
        }
    }
    let (didx, dcount) = last.expect("top-k kernels");
    (didx, dcount, want_sel)
}

/// dsa_topk with `n_blk` blocks per row on a fresh zeroed scratch, launched twice with poisoned
/// outputs (the second launch must find the scratch as the first left it: zero, and give the
/// same lists); returns the second launch's (idx, count) on the device.
#[allow(clippy::too_many_arguments)]
fn run_topk(
    gpu: &Gpu,
    k: &Kernel,
    scores: &CudaSlice<f32>,
    pos: &CudaSlice<i32>,
    n_q: usize,
    ld: usize,
    n_blk: usize,
    rng: &Rng,
) -> (CudaSlice<i32>, CudaSlice<i32>) {
    let s = gpu.stream();
    let words = dsa_topk::scratch_words(n_q, n_blk);
    let mut scratch = s.alloc_zeros::<u32>(words.max(1)).expect("alloc scratch");
    let p = DsaTopkParams {
        n_q,
        ld_scores: ld,
        k: TOP_K,
        n_blk,
    };
    let mut first = None;
    for launch in 0..2 {
        let mut didx = up(s, &vec![i32::MIN; n_q * TOP_K]);
        let mut dcount = up(s, &vec![i32::MIN; n_q]);
        topk(k, scores, pos, &mut didx, &mut dcount, &mut scratch, &p)
            .unwrap_or_else(|e| panic!("{e}"));
        let left = down(s, &scratch);
        if let Some(i) = left.iter().position(|&w| w != 0) {
            panic!(
                "{} n_blk {n_blk}: launch {launch} left scratch[{i}] = {} (MEMRA_SEED={})",
                k.name(),
                left[i],
                rng.seed()
            );
        }
        let got = (down(s, &didx), down(s, &dcount));
        match &first {
            None => first = Some(got),
            Some(f) => assert!(
                *f == got,
                "{} n_blk {n_blk}: a second launch on the same scratch gave other lists (MEMRA_SEED={})",
                k.name(),
                rng.seed()
            ),
        }
        if launch == 1 {
            return (didx, dcount);
        }
    }
    unreachable!()
}

/// Blocks-per-row counts to try: one block, the wrappers' choice, and a few awkward ones.
fn topk_blocks(gpu: &Gpu, n_q: usize, n: usize) -> Vec<usize> {
    let sms = gpu.sm_count().expect("sm count");
    let mut v = vec![1, dsa_topk::blocks_for(n_q, n, sms), 3, sms / n_q];
    v.retain(|&b| b >= 1 && b * n_q <= sms);
    sorted(v)
}

#[track_caller]
fn check_selection(name: &str, got: &[i32], count: i32, want: &[usize], rng: &Rng) {
    assert_eq!(
        count as usize,
        want.len(),
        "{name}: count (MEMRA_SEED={})",
        rng.seed()
    );
    let sel: Vec<usize> = got[..want.len()].iter().map(|&i| i as usize).collect();
    if sel != want {
        let first = sel.iter().zip(want).position(|(a, b)| a != b);
        panic!(
            "{name}: top-{TOP_K} differs from dsa::top_k on the kernel's scores at list position {first:?} (of {}) (MEMRA_SEED={})",
            want.len(),
            rng.seed()
        );
    }
    assert!(
        got[want.len()..].iter().all(|&i| i == -1),
        "{name}: tail of idx is not -1 (MEMRA_SEED={})",
        rng.seed()
    );
    eprintln!("ok {name}: {} indices", want.len());
}

/// Sparse MLA over the selection vs the reference allow-list attention; for ≤ TOP_K visible
/// keys also bit-equality with dense mla_decode at every split count.
#[allow(clippy::too_many_arguments)]
fn check_sparse(
    gpu: &Gpu,
    ks: &Kernels,
    didx: &CudaSlice<i32>,
    dcount: &CudaSlice<i32>,
    sel: &[usize],
    n: usize,
    max_ctx: usize,
    rng: &mut Rng,
) {
    let s = gpu.stream();
    let d = KV_LORA + ROPE;
    let q = rng.normal_vec(N_HEAD * d, 1.0);
    let (c_bits, c_vals) = bf16_vals(rng, max_ctx * d);
    let latent: Vec<f32> = (0..n)
        .flat_map(|r| c_vals[r * d..][..KV_LORA].iter().copied())
        .collect();
    let allowed = [sel.to_vec()];
    let p_last = [n - 1];
    let mask = Mask {
        q_pos: &p_last,
        window: None,
        allowed: Some(&allowed),
    };
    let shape = AttnShape {
        n_head: N_HEAD,
        n_kv_head: 1,
        head_dim_k: d,
        head_dim_v: KV_LORA,
    };
    let want = attention(&q, &c_vals[..n * d], &latent, n, shape, &mask, SCALE);
    let (dq, dc, dpos) = (up(s, &q), up(s, &c_bits), up(s, &[(n - 1) as i32]));
    let sms = gpu.sm_count().expect("sm count");
    let auto = mla_sparse_decode::splits_for(sel.len(), N_HEAD, sms);
    // 1: direct; 3: last-block merge; 8 and auto: one launch with a barrier and a spread merge
    // (phase 3); sms + 1 (more blocks than fit at once): partials then a merge launch.
    let (splits, mut work) = splits_and_work(s, vec![1, 3, 8, auto, sms + 1]);
    for (ki, k) in ks.sparse.iter().enumerate() {
        for &n_split in &splits {
            let p = mla_params(max_ctx, n_split);
            let mut dout = up(s, &vec![f32::NAN; N_HEAD * KV_LORA]);
            sparse(k, &dq, &dc, didx, dcount, &mut dout, &mut work, &p)
                .unwrap_or_else(|e| panic!("{e}"));
            let got = down(s, &dout);
            assert_close(
                &format!("{} n={n} n_split={n_split}", k.name()),
                &got,
                &want,
                ATTN_TOL,
                rng,
            );
            if n <= TOP_K {
                let dk = &ks.dense[ki];
                let mut dense = up(s, &vec![f32::NAN; N_HEAD * KV_LORA]);
                mla_decode::mla_decode(
                    dk,
                    &dq.as_view(),
                    &dc.as_view(),
                    &dpos.as_view(),
                    &mut dense.as_view_mut(),
                    &mut work.as_view_mut(),
                    &p,
                )
                .unwrap_or_else(|e| panic!("{e}"));
                let dense = down(s, &dense);
                let same = got
                    .iter()
                    .zip(&dense)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{} vs {} n={n} n_split={n_split}: sparse over all visible rows is not bit-equal to dense (rel L2 {:e}, MEMRA_SEED={})",
                    k.name(),
                    dk.name(),
                    rel_err(&got, &dense),
                    rng.seed()
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tests.

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_dsa_glm5_indexer_topk_sparse_attention() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_dsa_glm5_indexer_topk_sparse_attention");
    let ks = kernels(&gpu, "bf16");
    for n in LENGTHS {
        let max_ctx = n + 37;
        let (kbits, kvals) = bf16_vals(&mut rng, max_ctx * IDX.head_dim);
        let keys = up(gpu.stream(), &kbits);
        let (didx, dcount, sel) = indexer_and_topk(&gpu, &ks, &keys, &kvals, max_ctx, n, &mut rng);
        check_sparse(&gpu, &ks, &didx, &dcount, &sel, n, max_ctx, &mut rng);
    }
    eprintln!("PASS gpu_dsa_glm5_indexer_topk_sparse_attention");
}

/// mla_sparse_decode over several queries in one launch (batched prefill): query j at
/// `queries[j].0` attends over a random `queries[j].1` of its visible rows (its own idx row of
/// TOP_K, −1 past the count, and count), against the reference per query; split counts 1, 3 and
/// the batched rule on one workspace.
fn check_sparse_batch(gpu: &Gpu, ks: &Kernels, queries: &[(usize, usize)], rng: &mut Rng) {
    let s = gpu.stream();
    let (d, n_q) = (KV_LORA + ROPE, queries.len());
    let max_ctx = queries.iter().map(|q| q.0).max().unwrap() + 9;
    let q = rng.normal_vec(n_q * N_HEAD * d, 1.0);
    let (c_bits, c_vals) = bf16_vals(rng, max_ctx * d);
    // Ascending rows, as dsa_topk gives them.
    let sels: Vec<Vec<usize>> = queries
        .iter()
        .map(|&(p, n_sel)| sorted(random_rows(rng, p, n_sel)))
        .collect();
    let mut idx = vec![-1i32; n_q * TOP_K];
    for (j, sel) in sels.iter().enumerate() {
        for (k, &r) in sel.iter().enumerate() {
            idx[j * TOP_K + k] = r as i32;
        }
    }
    let refs: Vec<Query> = queries
        .iter()
        .zip(&sels)
        .map(|(&(pos, _), sel)| Query {
            pos,
            rows: Some(sel),
        })
        .collect();
    let want = mla_reference(&q, &c_vals, N_HEAD, KV_LORA, ROPE, &refs, SCALE);
    let counts: Vec<i32> = queries.iter().map(|q| q.1 as i32).collect();
    let (dq, dc, didx, dcount) = (up(s, &q), up(s, &c_bits), up(s, &idx), up(s, &counts));
    let sms = gpu.sm_count().expect("sm count");
    let auto = mla_sparse_decode::splits_for_batch(TOP_K, N_HEAD, sms, n_q);
    let splits = sorted(vec![1, 3, auto]);
    let most = *splits.last().unwrap();
    let mut work = s
        .alloc_zeros::<f32>(mla_decode::work_floats_batch(N_HEAD, KV_LORA, most, n_q))
        .expect("alloc");
    for k in &ks.sparse {
        for &n_split in &splits {
            let p = mla_params(max_ctx, n_split);
            let mut dout = up(s, &vec![f32::NAN; n_q * N_HEAD * KV_LORA]);
            mla_sparse_decode::mla_sparse_decode_batch(
                k,
                &dq.as_view(),
                &dc.as_view(),
                &didx.as_view(),
                &dcount.as_view(),
                &mut dout.as_view_mut(),
                &mut work.as_view_mut(),
                TOP_K,
                n_q,
                &p,
            )
            .unwrap_or_else(|e| panic!("{e}"));
            let got = down(s, &dout);
            let what = format!("{} batch n_q={n_q} n_split={n_split}", k.name());
            eprintln!("{what}: relative L2 {:.2e} (tolerance {ATTN_TOL:e})", rel_err(&got, &want));
            assert_close(&what, &got, &want, ATTN_TOL, rng);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_dsa_sparse_batched_queries() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_dsa_sparse_batched_queries");
    let ks = kernels(&gpu, "bf16");
    // Position 0, a full selection, fewer rows than visible, past top_k: per-query counts.
    check_sparse_batch(&gpu, &ks, &[(0, 1), (2047, 2048), (40000, TOP_K), (5000, 777)], &mut rng);
    // A prefill chunk past top_k: 200 consecutive positions, each with TOP_K rows.
    let chunk: Vec<(usize, usize)> = (3000..3200).map(|p| (p, TOP_K)).collect();
    check_sparse_batch(&gpu, &ks, &chunk, &mut rng);
    eprintln!("PASS gpu_dsa_sparse_batched_queries (MEMRA_SEED={})", rng.seed());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_dsa_indexer_topk_131072() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_dsa_indexer_topk_131072");
    let ks = kernels(&gpu, "bf16");
    let n = 131_072;
    let (kbits, kvals) = bf16_vals(&mut rng, n * IDX.head_dim);
    let keys = up(gpu.stream(), &kbits);
    indexer_and_topk(&gpu, &ks, &keys, &kvals, n, n, &mut rng);
    eprintln!("PASS gpu_dsa_indexer_topk_131072");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_dsa_indexer_f32_cache() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_dsa_indexer_f32_cache");
    let ks = kernels(&gpu, "f32");
    for n in [1, 33, 2049, 40000] {
        let max_ctx = n + 5;
        let (kv, kvals) = <f32 as KeyElem>::encode(&mut rng, max_ctx * IDX.head_dim);
        let keys = up(gpu.stream(), &kv);
        indexer_and_topk(&gpu, &ks, &keys, &kvals, max_ctx, n, &mut rng);
    }
    eprintln!("PASS gpu_dsa_indexer_f32_cache");
}

/// dsa_topk on hand-made rows full of exact ties (a few distinct values, −0 and +0, ±∞) and on
/// random rows, up to 200 000 keys, several query rows per launch with their own positions.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_dsa_topk_ties_and_batches() {
    let gpu = gpu();
    let s = gpu.stream();
    let mut rng = Rng::from_env_or_time("gpu_dsa_topk_ties_and_batches");
    let topk = load_all(
        &gpu,
        &[
            variant("dsa_topk", &[("k", V::I(TOP_K as i64))]),
            variant("dsa_topk", &[]),
            variant(
                "dsa_topk",
                &[("k", V::I(TOP_K as i64)), ("threads", V::I(256))],
            ),
        ],
    );
    let ld = 200_000;
    // Rows: (position, kind) with kind 0 = random, 1 = palette ties, 2 = all equal.
    let rows: [(usize, u8); 7] = [
        (199_999, 1),
        (150_000, 0),
        (2048, 1),
        (2047, 0),
        (5000, 2),
        (65_536, 1),
        (0, 0),
    ];
    let mut scores = vec![f32::NAN; rows.len() * ld];
    for (t, &(p, kind)) in rows.iter().enumerate() {
        fill_row(&mut scores[t * ld..][..=p], kind, &[1e-30], 0.25, &mut rng);
    }
    let pos: Vec<i32> = rows.iter().map(|&(p, _)| p as i32).collect();
    let (dsc, dpos) = (up(s, &scores), up(s, &pos));
    for k in &topk {
        for n_blk in topk_blocks(&gpu, rows.len(), ld) {
            let (didx, dcount) = run_topk(&gpu, k, &dsc, &dpos, rows.len(), ld, n_blk, &rng);
            let (idx, count) = (down(s, &didx), down(s, &dcount));
            for (t, &(p, kind)) in rows.iter().enumerate() {
                let want = top_k(&scores[t * ld..][..=p], TOP_K);
                check_selection(
                    &format!("{} n_blk {n_blk} row {t} (pos {p}, kind {kind})", k.name()),
                    &idx[t * TOP_K..][..TOP_K],
                    count[t],
                    &want,
                    &rng,
                );
            }
        }
    }
    eprintln!("PASS gpu_dsa_topk_ties_and_batches");
}

/// Median launch time (µs) of `f` over 50 timed launches after 5 warm-up ones (no L2 flush: in
/// a decode step each kernel reads what the previous one just wrote); one launch under a sanitizer.
fn median_us(gpu: &Gpu, f: &mut dyn FnMut(usize) -> Result<(), Error>) -> f64 {
    let mut no_flush = gpu.stream().alloc_zeros::<u8>(1).expect("alloc");
    // Under compute-sanitizer (scripts/gpu-sanitize sets MEMRA_SANITIZER) 55 launches per case
    // would repeat one launch at the tool's slowdown (racecheck ran this test past 1,150 s):
    // one launch, whose result is checked the same way; the time printed is then meaningless.
    let (warmup, iters) = if std::env::var_os("MEMRA_SANITIZER").is_some() { (0, 1) } else { (5, 50) };
    let us = memra_engine::bench::time_launches(gpu, warmup, iters, &mut no_flush, f)
        .unwrap_or_else(|e| panic!("{e}"));
    us[us.len() / 2]
}

/// Block-count sweep at GLM-5 decode dims, T = 131072, k = 2048 (the specialized bf16 variants):
/// launch times are printed (`sweep ...` lines, informative: they pick blocks_for / splits_for),
/// and every result is checked — indexer scores bit-equal across block counts, top-k lists equal
/// to dsa::top_k of those scores, sparse attention within ATTN_TOL of the one-split output.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_dsa_block_count_sweep() {
    let gpu = gpu();
    let s = gpu.stream();
    let sms = gpu.sm_count().expect("sm count");
    let mut rng = Rng::from_env_or_time("gpu_dsa_block_count_sweep");
    let ks = kernels(&gpu, "bf16");
    let (ki, kt, kp) = (&ks.indexer[0], &ks.topk[0], &ks.sparse[0]);
    let n = 131_072;
    let (nh, hd) = (IDX.n_head, IDX.head_dim);
    let (kbits, _) = bf16_vals(&mut rng, n * hd);
    let keys = up(s, &kbits);
    let q = rng.normal_vec(nh * hd, 1.0);
    let w = head_weights(&mut rng);
    let (dq, dw, dpos) = (up(s, &q), up(s, &w), up(s, &[(n - 1) as i32]));
    let mut dscores = up(s, &vec![f32::NAN; n]);
    let mut first: Option<Vec<f32>> = None;
    for n_blk in [sms / 2, sms, 2 * sms, 4 * sms] {
        let p = indexer_params(1, n, n_blk);
        let us = median_us(&gpu, &mut |_| {
            indexer(ki, &dq, &dw, &keys, &dpos, &mut dscores, &p)
        });
        eprintln!("sweep dsa_indexer {} n_blk {n_blk}: {us:.2} us", ki.name());
        let got = down(s, &dscores);
        match &first {
            None => first = Some(got),
            Some(f) => assert!(
                f.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
                "dsa_indexer n_blk {n_blk}: scores differ from n_blk {} (MEMRA_SEED={})",
                sms / 2,
                rng.seed()
            ),
        }
    }
    let scores = first.expect("indexer ran");
    let want = top_k(&scores, TOP_K);
    let mut didx = s.alloc_zeros::<i32>(TOP_K).expect("alloc");
    let mut dcount = s.alloc_zeros::<i32>(1).expect("alloc");
    let mut blocks = vec![
        1,
        8,
        16,
        32,
        48,
        64,
        96,
        128,
        sms,
        dsa_topk::blocks_for(1, n, sms),
    ];
    blocks.retain(|&b| b <= sms);
    for n_blk in sorted(blocks) {
        let mut scratch = s
            .alloc_zeros::<u32>(dsa_topk::scratch_words(1, n_blk).max(1))
            .expect("alloc");
        let p = DsaTopkParams {
            n_q: 1,
            ld_scores: n,
            k: TOP_K,
            n_blk,
        };
        let us = median_us(&gpu, &mut |_| {
            topk(
                kt,
                &dscores,
                &dpos,
                &mut didx,
                &mut dcount,
                &mut scratch,
                &p,
            )
        });
        eprintln!("sweep dsa_topk {} n_blk {n_blk}: {us:.2} us", kt.name());
        check_selection(
            &format!("{} n_blk {n_blk}", kt.name()),
            &down(s, &didx),
            down(s, &dcount)[0],
            &want,
            &rng,
        );
    }
    let d = KV_LORA + ROPE;
    let (cbits, _) = bf16_vals(&mut rng, n * d);
    let (dc, dqm) = (up(s, &cbits), up(s, &rng.normal_vec(N_HEAD * d, 1.0)));
    let (splits, mut work) = splits_and_work(
        s,
        vec![
            1,
            4,
            8,
            16,
            32,
            64,
            128,
            sms,
            mla_sparse_decode::splits_for(TOP_K, N_HEAD, sms),
        ],
    );
    let mut dout = s.alloc_zeros::<f32>(N_HEAD * KV_LORA).expect("alloc");
    let mut one: Option<Vec<f32>> = None;
    for n_split in splits {
        let p = mla_params(n, n_split);
        let us = median_us(&gpu, &mut |_| {
            sparse(kp, &dqm, &dc, &didx, &dcount, &mut dout, &mut work, &p)
        });
        eprintln!(
            "sweep mla_sparse_decode {} n_split {n_split}: {us:.2} us",
            kp.name()
        );
        let got = down(s, &dout);
        match &one {
            None => one = Some(got),
            Some(o) => assert_close(
                &format!("{} n_split {n_split} vs 1", kp.name()),
                &got,
                o,
                ATTN_TOL,
                &rng,
            ),
        }
    }
    eprintln!("PASS gpu_dsa_block_count_sweep (MEMRA_SEED={})", rng.seed());
}

/// dsa_topk alone at k = 2048 over 1, 7, 2047, 2048, 2049, 40000 and 131072 visible keys (the
/// last three in a longer row), random scores, palette ties (±0, ±∞), all-equal rows and rows
/// of distinct values in one top-11-bit bin (more candidates than the list holds), with
/// one block per row, the wrapper's block count and awkward ones (3, one per multiprocessor).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_dsa_topk_multiblock_lengths() {
    let gpu = gpu();
    let s = gpu.stream();
    let mut rng = Rng::from_env_or_time("gpu_dsa_topk_multiblock_lengths");
    let topk = load_all(
        &gpu,
        &[
            variant("dsa_topk", &[("k", V::I(TOP_K as i64))]),
            variant("dsa_topk", &[]),
        ],
    );
    for n in [1usize, 7, 2047, 2048, 2049, 40_000, 131_072] {
        let ld = n + 17;
        for kind in 0..4u8 {
            let mut row = vec![f32::NAN; ld];
            match kind {
                // Distinct values in one top-11-bit bin: the candidate list overflows.
                3 => row[..n]
                    .iter_mut()
                    .for_each(|v| *v = 1.0 + rng.below(1 << 20) as f32 / (1u32 << 23) as f32),
                _ => fill_row(&mut row[..n], kind, &[], -3.5, &mut rng),
            }
            let want = top_k(&row[..n], TOP_K);
            let (dsc, dpos) = (up(s, &row), up(s, &[(n - 1) as i32]));
            for k in &topk {
                for n_blk in topk_blocks(&gpu, 1, n) {
                    let (didx, dcount) = run_topk(&gpu, k, &dsc, &dpos, 1, ld, n_blk, &rng);
                    check_selection(
                        &format!("{} n={n} kind {kind} n_blk={n_blk}", k.name()),
                        &down(s, &didx),
                        down(s, &dcount)[0],
                        &want,
                        &rng,
                    );
                }
            }
        }
    }
    eprintln!(
        "PASS gpu_dsa_topk_multiblock_lengths (MEMRA_SEED={})",
        rng.seed()
    );
}

/// Bad device positions / counts give NaN scores, count −1 and NaN attention; bad shapes are
/// refused by the wrappers before launch.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_dsa_bad_positions_and_shapes() {
    let gpu = gpu();
    let s = gpu.stream();
    let ks = kernels(&gpu, "bf16");
    let (nh, hd) = (IDX.n_head, IDX.head_dim);
    let max_ctx = 100;
    let keys = up(s, &vec![0u16; max_ctx * hd]);
    let dw = up(s, &vec![1.0f32; nh]);
    let p = indexer_params(2, max_ctx, 2);
    let dq2 = up(s, &vec![1.0f32; 2 * nh * hd]);
    let dw2 = up(s, &vec![1.0f32; 2 * nh]);
    for bad in [-1i32, max_ctx as i32] {
        let dpos = up(s, &[5, bad]);
        let mut dsc = up(s, &vec![7.0f32; 2 * max_ctx]);
        indexer(&ks.indexer[0], &dq2, &dw2, &keys, &dpos, &mut dsc, &p)
            .unwrap_or_else(|e| panic!("{e}"));
        let sc = down(s, &dsc);
        assert!(
            sc[..6].iter().all(|&v| v == 0.0),
            "row 0 (pos 5): {:?}",
            &sc[..6]
        );
        assert!(
            sc[6..max_ctx].iter().all(|&v| v == 7.0),
            "row 0 written past pos"
        );
        assert!(
            sc[max_ctx..].iter().all(|v| v.is_nan()),
            "row 1 (pos {bad}) not NaN"
        );
        for n_blk in [1, 4] {
            let (didx, dcount) = run_topk(
                &gpu,
                &ks.topk[0],
                &dsc,
                &dpos,
                2,
                max_ctx,
                n_blk,
                &Rng::new(0),
            );
            assert_eq!(down(s, &dcount), vec![6, -1], "n_blk {n_blk}");
            assert!(
                down(s, &didx)[TOP_K..].iter().all(|&i| i == -1),
                "n_blk {n_blk}"
            );
        }
    }
    // Sparse attention with a count outside [1, min(max_ctx, top_k)].
    let d = KV_LORA + ROPE;
    let (dq, dc) = (
        up(s, &vec![0.1f32; N_HEAD * d]),
        up(s, &vec![0u16; max_ctx * d]),
    );
    let didx = up(s, &(0..TOP_K as i32).collect::<Vec<_>>());
    let mut work = s.alloc_zeros::<f32>(1).expect("alloc");
    let mp = mla_params(max_ctx, 1);
    for bad in [0i32, -1, max_ctx as i32 + 1] {
        let dcount = up(s, &[bad]);
        let mut dout = up(s, &vec![0.0f32; N_HEAD * KV_LORA]);
        sparse(
            &ks.sparse[0],
            &dq,
            &dc,
            &didx,
            &dcount,
            &mut dout,
            &mut work,
            &mp,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            down(s, &dout).iter().all(|v| v.is_nan()),
            "count {bad}: out not NaN"
        );
    }
    // Refused shapes.
    let dpos = up(s, &[0i32]);
    let mut dsc = up(s, &vec![0.0f32; max_ctx]);
    let refused = |r: Result<(), Error>, what: &str| {
        let e = r.expect_err(what);
        eprintln!("refused ({what}): {e}");
    };
    for bad in [
        DsaIndexerParams {
            n_idx_head: 16,
            n_q: 1,
            ..p
        }, // baked 32
        DsaIndexerParams {
            ld_scores: max_ctx - 1,
            n_q: 1,
            ..p
        },
        DsaIndexerParams {
            idx_head_dim: 100,
            n_q: 1,
            ..p
        },
    ] {
        refused(
            indexer(&ks.indexer[0], &dq, &dw, &keys, &dpos, &mut dsc, &bad),
            &format!("{bad:?}"),
        );
    }
    let mut didx1 = up(s, &vec![0i32; TOP_K - 1]);
    let mut dcount1 = up(s, &[0i32]);
    let mut scratch = s
        .alloc_zeros::<u32>(dsa_topk::scratch_words(1, 4))
        .expect("alloc");
    let one = DsaTopkParams {
        n_q: 1,
        ld_scores: max_ctx,
        k: TOP_K,
        n_blk: 1,
    };
    refused(
        topk(
            &ks.topk[0],
            &dsc,
            &dpos,
            &mut didx1,
            &mut dcount1,
            &mut scratch,
            &one,
        ),
        "idx shorter than k",
    );
    let mut didx = up(s, &vec![0i32; TOP_K]);
    let too_many = gpu.sm_count().expect("sm count") + 1;
    let mut big = s
        .alloc_zeros::<u32>(dsa_topk::scratch_words(1, too_many))
        .expect("alloc");
    refused(
        topk(
            &ks.topk[0],
            &dsc,
            &dpos,
            &mut didx,
            &mut dcount1,
            &mut big,
            &DsaTopkParams {
                n_blk: too_many,
                ..one
            },
        ),
        "more blocks than multiprocessors",
    );
    for (bad, what) in [(0, "n_blk 0"), (5, "scratch for 4 blocks, 5 asked")] {
        refused(
            topk(
                &ks.topk[0],
                &dsc,
                &dpos,
                &mut didx,
                &mut dcount1,
                &mut scratch,
                &DsaTopkParams { n_blk: bad, ..one },
            ),
            what,
        );
    }
    eprintln!("PASS gpu_dsa_bad_positions_and_shapes");
}

/// The index-key producer (LayerNorm + RoPE + cache write) vs `norm::layer_norm` + `rope::rope_head`
/// at GLM-5 dims (128, rope 64 interleaved, base 1e6, eps 1e-6) over a 128k cache: positions 0 to
/// 131071, one out of range (writes nothing); the specialized and generic bf16 variants (bf16
/// rounding of the output: relative L2 ≤ 4e-3) and a generic NeoX f32 one (≤ 1e-5).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_dsa_index_key_glm5() {
    let gpu = gpu();
    let s = gpu.stream();
    let mut rng = Rng::from_env_or_time("gpu_dsa_index_key_glm5");
    let (hd, n_rot, max_ctx) = (IDX.head_dim, IDX.rope, 131_072usize);
    let key = |cache: &'static str, mode: &'static str, baked: bool| {
        let mut p = vec![("cache_t", V::S(cache)), ("rope_mode", V::S(mode))];
        if baked {
            p.extend([("head_dim", V::I(hd as i64)), ("n_rot", V::I(n_rot as i64))]);
        }
        variant("dsa_index_key", &p)
    };
    let ks = load_all(
        &gpu,
        &[
            key("bf16", "interleaved", true),
            key("bf16", "interleaved", false),
            key("f32", "neox", false),
        ],
    );
    let positions: [i64; 8] = [0, 1, 5, 2047, 131_071, 40_000, -1, 77_777];
    let n = positions.len();
    let k_stride = hd + 4;
    let raw: Vec<f32> = rng
        .normal_vec(n * k_stride, 1.0)
        .iter()
        .map(|v| v + 0.5)
        .collect();
    let (w, b) = (rng.normal_vec(hd, 1.0), rng.normal_vec(hd, 0.5));
    let p = DsaIndexKeyParams {
        n_tokens: n,
        head_dim: hd,
        n_rot,
        k_stride,
        max_ctx,
        freq_base: 1e6,
        freq_scale: 1.0,
        eps: 1e-6,
    };
    let pos: Vec<i32> = positions.iter().map(|&x| x as i32).collect();
    let (draw, dw, db, dpos) = (up(s, &raw), up(s, &w), up(s, &b), up(s, &pos));
    for (ki, k) in ks.iter().enumerate() {
        let (mode, f32_cache) = if ki < 2 {
            (RopeMode::Norm, false)
        } else {
            (RopeMode::Neox, true)
        };
        let inputs = [&draw, &dw, &db];
        let rows: Vec<f32> = if f32_cache {
            index_key_cache(s, k, inputs, &dpos, f32::NAN, &p)
        } else {
            // 0x7fc0: a bf16 NaN.
            index_key_cache(s, k, inputs, &dpos, 0x7fc0u16, &p)
                .into_iter()
                .map(bf16_to_f32)
                .collect()
        };
        let tol = if f32_cache { 1e-5 } else { 4e-3 };
        let rope = Rope::new(mode, n_rot, 1e6);
        for (t, &ps) in positions.iter().enumerate() {
            if ps < 0 {
                continue;
            }
            let ps = ps as usize;
            let mut want = layer_norm(&raw[t * k_stride..][..hd], &w, &b, 1e-6);
            rope_head(&mut want, ps, &rope);
            assert_close(
                &format!("{} token {t} pos {ps}", k.name()),
                &rows[ps * hd..][..hd],
                &want,
                tol,
                &rng,
            );
        }
        assert!(
            rows[2 * hd..5 * hd].iter().all(|v| v.is_nan()),
            "{}: rows no token maps to were written",
            k.name()
        );
    }
    eprintln!("PASS gpu_dsa_index_key_glm5");
}
