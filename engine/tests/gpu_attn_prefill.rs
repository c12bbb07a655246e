//! GPU tests of attn_prefill (causal GQA prefill over the KV cache on tensor cores) against
//! memra-reference's attention: specialized variants at real model shapes (gemma3-270M 4q/1kv/
//! hd 256 with window 512 on local layers and none on global ones, Qwen3-8B 32q/8kv/hd 128) and
//! their generic twins, bf16 and f32 caches, awkward chunk lengths T = 1, 7, 2047, 2048, 2049,
//! 8192, chunks that continue a cache (pos0 > 0), other group sizes (1, 3, 8, 16) and head_dim 64
//! on the generic variant, a prompt run whole vs in two chunks, and the wrapper's refusals. Fresh
//! random inputs (seed printed; replay with `MEMRA_SEED=<seed>`), outputs NaN-poisoned before
//! every launch, cache rows past the chunk filled with NaN (a kernel that reads them fails).
//!
//! Oracle cost: query rows are subsampled for T > 320 (the first 64, the last 64 and 192 random
//! ones: tile edges at both ends), and the reference runs on every core.
//!
//! Tolerance ("bf16 products": q, an f32 cache and the softmax weights are rounded to bf16 for
//! the mma): relative L2 ≤ 5e-3 against the reference fed the same bf16-rounded q, k, v (what is
//! left is the rounding of P, ≈ 1e-3 in the host emulation, and ex2.approx), and ≤ 1e-2
//! (DESIGN.md's bf16 bound) against the reference on the unrounded f32 inputs.
//!
//! Run on a GPU machine: `cargo test -p memra-engine --test gpu_attn_prefill -- --ignored`.

mod dense_common;
mod gpu_common;

use cudarc::driver::ValidAsZeroBits;
use dense_common::{V, variant};
use gpu_common::{down, gpu, load_all, shard, up};
use memra_engine::cuda::{Gpu, Kernel};
use memra_engine::kernels::attn_prefill::{self, AttnPrefillParams};
use memra_engine::kernels::qk_norm_rope::CacheElem;
use memra_reference::attention::{AttnShape, Mask, attention};
use memra_reference::{Rng, rel_err};

const TOL_ROUNDED: f64 = 5e-3;
const TOL_F32: f64 = 1e-2;
const LENGTHS: [usize; 6] = [1, 7, 2047, 2048, 2049, 8192];
/// Rows past the chunk in each cache (NaN-filled: never keys).
const SPARE_ROWS: usize = 5;

// ---------------------------------------------------------------------------------------------
// Harness.

fn bf16_round(f: f32) -> f32 {
    if f.is_nan() {
        return f;
    }
    let b = f.to_bits();
    f32::from_bits(((b + 0x7fff + ((b >> 16) & 1)) >> 16) << 16)
}

/// A cache element type on the host: device values from f32 values.
trait HostCache: CacheElem + ValidAsZeroBits + Clone + Default + Copy {
    const ROUNDS: bool;
    fn encode(v: &[f32]) -> Vec<Self>;
}

impl HostCache for u16 {
    const ROUNDS: bool = true;
    fn encode(v: &[f32]) -> Vec<u16> {
        v.iter()
            .map(|&x| (bf16_round(x).to_bits() >> 16) as u16)
            .collect()
    }
}

impl HostCache for f32 {
    const ROUNDS: bool = false;
    fn encode(v: &[f32]) -> Vec<f32> {
        v.to_vec()
    }
}

#[derive(Clone, Copy, Debug)]
struct Gqa {
    n_head: usize,
    n_kv: usize,
    hd: usize,
    window: Option<usize>,
}

const GEMMA3: Gqa = Gqa {
    n_head: 4,
    n_kv: 1,
    hd: 256,
    window: Some(512),
};
const QWEN3_8B: Gqa = Gqa {
    n_head: 32,
    n_kv: 8,
    hd: 128,
    window: None,
};

fn kernels(gpu: &Gpu, g: Gqa, cache_t: &'static str) -> Vec<Kernel> {
    load_all(
        gpu,
        &[
            variant(
                "attn_prefill",
                &[
                    ("head_dim", V::I(g.hd as i64)),
                    ("n_head", V::I(g.n_head as i64)),
                    ("n_kv", V::I(g.n_kv as i64)),
                    ("cache_t", V::S(cache_t)),
                ],
            ),
            variant("attn_prefill", &[("cache_t", V::S(cache_t))]),
        ],
    )
}

/// Query rows the oracle checks: all for short chunks, else both ends and random ones.
fn rows_to_check(t: usize, rng: &mut Rng) -> Vec<usize> {
    if t <= 320 {
        return (0..t).collect();
    }
    let mut rows: Vec<usize> = (0..64).chain(t - 64..t).collect();
    for _ in 0..192 {
        rows.push(64 + rng.below(t - 128));
    }
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// memra-reference attention of the query rows `rows` (chunk-relative), on every core.
#[allow(clippy::too_many_arguments)]
fn oracle(
    g: Gqa,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pos0: usize,
    t_kv: usize,
    rows: &[usize],
    scale: f32,
) -> Vec<f32> {
    let per_q = g.n_head * g.hd;
    let kv = t_kv * g.n_kv * g.hd;
    let shape = AttnShape {
        n_head: g.n_head,
        n_kv_head: g.n_kv,
        head_dim_k: g.hd,
        head_dim_v: g.hd,
    };
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let chunk = rows.len().div_ceil(threads).max(1);
    std::thread::scope(|sc| {
        let handles: Vec<_> = rows
            .chunks(chunk)
            .map(|part| {
                sc.spawn(move || {
                    let qs: Vec<f32> = part
                        .iter()
                        .flat_map(|&t| q[t * per_q..][..per_q].iter().copied())
                        .collect();
                    let q_pos: Vec<usize> = part.iter().map(|&t| pos0 + t).collect();
                    let mask = Mask {
                        q_pos: &q_pos,
                        window: g.window,
                        allowed: None,
                    };
                    attention(&qs, &k[..kv], &v[..kv], t_kv, shape, &mask, scale)
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("oracle thread"))
            .collect()
    })
}

fn pick(out: &[f32], rows: &[usize], per_q: usize) -> Vec<f32> {
    rows.iter()
        .flat_map(|&t| out[t * per_q..][..per_q].iter().copied())
        .collect()
}

#[track_caller]
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64, rng: &Rng) {
    let err = rel_err(got, want);
    assert!(
        err <= tol,
        "{what}: relative L2 error {err:e} > {tol:e} (MEMRA_SEED={}); first mismatches (index, (got, want)): {:?}",
        rng.seed(),
        got.iter()
            .zip(want)
            .enumerate()
            .filter(|(_, (a, b))| ((**a - **b).abs() as f64)
                .partial_cmp(&(tol * 10.0 * (b.abs() as f64 + 1e-1)))
                != Some(std::cmp::Ordering::Less))
            .take(5)
            .collect::<Vec<_>>()
    );
}

/// Runs every kernel on a chunk of `t` tokens at `pos0` (cache of pos0 + t + SPARE_ROWS rows,
/// rows before pos0 random as earlier chunks would have left them, rows past the chunk NaN) and
/// compares the checked rows with the reference on rounded and on f32 inputs. Returns the last
/// kernel's output.
fn check<C: HostCache>(
    gpu: &Gpu,
    kernels: &[Kernel],
    g: Gqa,
    t: usize,
    pos0: usize,
    rng: &mut Rng,
) -> Vec<f32> {
    let s = gpu.stream();
    let t_kv = pos0 + t;
    let max_ctx = t_kv + SPARE_ROWS;
    let row = g.n_kv * g.hd;
    let per_q = g.n_head * g.hd;
    let q = rng.normal_vec(t * per_q, 1.0);
    let mut k = rng.normal_vec(max_ctx * row, 1.0);
    let mut v = rng.normal_vec(max_ctx * row, 1.0);
    k[t_kv * row..].fill(f32::NAN);
    v[t_kv * row..].fill(f32::NAN);
    let scale = 1.0 / (g.hd as f32).sqrt();
    let rows = rows_to_check(t, rng);
    let round = |x: &[f32]| -> Vec<f32> { x.iter().map(|&f| bf16_round(f)).collect() };
    let (q_r, k_r, v_r) = (round(&q), round(&k), round(&v));
    let want_r = oracle(g, &q_r, &k_r, &v_r, pos0, t_kv, &rows, scale);
    let (k_f, v_f) = if C::ROUNDS { (&k_r, &v_r) } else { (&k, &v) };
    let want_f = oracle(g, &q, k_f, v_f, pos0, t_kv, &rows, scale);

    let (dq, dk, dv) = (up(s, &q), up(s, &C::encode(&k)), up(s, &C::encode(&v)));
    let p = AttnPrefillParams {
        n_tokens: t,
        head_dim: g.hd,
        n_head: g.n_head,
        n_kv: g.n_kv,
        max_ctx,
        pos0,
        window: g.window,
        scale,
    };
    let mut last = Vec::new();
    for kern in kernels {
        let mut dout = up(s, &vec![f32::NAN; q.len()]);
        attn_prefill::attn_prefill(
            kern,
            &dq.as_view(),
            &dk.as_view(),
            &dv.as_view(),
            &mut dout.as_view_mut(),
            &p,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let out = down(s, &dout);
        let nan = out.iter().filter(|x| !x.is_finite()).count();
        let got = pick(&out, &rows, per_q);
        let (e_r, e_f) = (rel_err(&got, &want_r), rel_err(&got, &want_f));
        let what = format!(
            "{} {g:?} T={t} pos0={pos0} cache={} ({} of {t} rows checked)",
            kern.name(),
            C::CACHE_T,
            rows.len()
        );
        eprintln!(
            "{what}: rel L2 {e_r:.2e} (rounded inputs), {e_f:.2e} (f32 inputs), {nan} non-finite"
        );
        assert_eq!(
            nan,
            0,
            "{what}: {nan} outputs not written or not finite (MEMRA_SEED={})",
            rng.seed()
        );
        assert_close(
            &format!("{what} vs rounded-input reference"),
            &got,
            &want_r,
            TOL_ROUNDED,
            rng,
        );
        assert_close(
            &format!("{what} vs f32-input reference"),
            &got,
            &want_f,
            TOL_F32,
            rng,
        );
        last = out;
    }
    last
}

// ---------------------------------------------------------------------------------------------
// Tests.

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_attn_prefill_gemma3_sliding_window() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_attn_prefill_gemma3_sliding_window");
    let ks = kernels(&gpu, GEMMA3, "bf16");
    for t in LENGTHS {
        check::<u16>(&gpu, &ks, GEMMA3, t, 0, &mut rng);
    }
    // Chunks continuing a cache, the window reaching back into the earlier chunk.
    check::<u16>(&gpu, &ks, GEMMA3, 513, 1000, &mut rng);
    check::<u16>(&gpu, &ks, GEMMA3, 7, 4093, &mut rng);
    // Global layers of the same model: no window.
    let global = Gqa {
        window: None,
        ..GEMMA3
    };
    for t in [7, 2049] {
        check::<u16>(&gpu, &ks, global, t, 0, &mut rng);
    }
    check::<u16>(&gpu, &ks, global, 1000, 1049, &mut rng);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_attn_prefill_qwen3_8b() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_attn_prefill_qwen3_8b");
    let ks = kernels(&gpu, QWEN3_8B, "bf16");
    // (new tokens, first position); each one case of `MEMRA_TEST_SHARD` (racecheck is slow).
    let cases = LENGTHS.iter().map(|&t| (t, 0)).chain([(2048, 2048), (7, 4000)]);
    for (t, pos0) in cases {
        if shard::mine() {
            check::<u16>(&gpu, &ks, QWEN3_8B, t, pos0, &mut rng);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_attn_prefill_f32_cache_and_other_groups() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_attn_prefill_f32_cache_and_other_groups");
    let ks = kernels(&gpu, QWEN3_8B, "f32");
    for t in [1, 2049] {
        check::<f32>(&gpu, &ks, QWEN3_8B, t, 0, &mut rng);
    }
    let ks = kernels(&gpu, GEMMA3, "f32");
    check::<f32>(&gpu, &ks, GEMMA3, 700, 100, &mut rng);
    // Generic only: G = 1 (MHA, OLMoE-like), 3 with a short window, 8, 16 at head_dim 64.
    let generic = load_all(&gpu, &[variant("attn_prefill", &[])]);
    for g in [
        Gqa {
            n_head: 16,
            n_kv: 16,
            hd: 128,
            window: None,
        },
        Gqa {
            n_head: 6,
            n_kv: 2,
            hd: 256,
            window: Some(33),
        },
        Gqa {
            n_head: 64,
            n_kv: 8,
            hd: 128,
            window: None,
        },
        Gqa {
            n_head: 16,
            n_kv: 1,
            hd: 64,
            window: Some(100),
        },
    ] {
        check::<u16>(&gpu, &generic, g, 333, 100, &mut rng);
        check::<u16>(&gpu, &generic, g, 1, 0, &mut rng);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_attn_prefill_two_chunks_equal_one_prompt() {
    // A prompt attended whole and as two chunks (the second at pos0 = 1000) must agree: each
    // query row sees the same keys in the same tile order (tiles past a row's limit add exact
    // zeros), so only row-to-block placement differs.
    let gpu = gpu();
    let s = gpu.stream();
    let mut rng = Rng::from_env_or_time("gpu_attn_prefill_two_chunks_equal_one_prompt");
    for (g, cache_t) in [(GEMMA3, "bf16"), (QWEN3_8B, "bf16")] {
        let ks = kernels(&gpu, g, cache_t);
        let (t, split) = (2049, 1000);
        let row = g.n_kv * g.hd;
        let per_q = g.n_head * g.hd;
        let q = rng.normal_vec(t * per_q, 1.0);
        let k = u16::encode(&rng.normal_vec(t * row, 1.0));
        let v = u16::encode(&rng.normal_vec(t * row, 1.0));
        let (dk, dv) = (up(s, &k), up(s, &v));
        let scale = 1.0 / (g.hd as f32).sqrt();
        for kern in &ks {
            let run = |pos0: usize, n: usize| {
                let dq = up(s, &q[pos0 * per_q..(pos0 + n) * per_q]);
                let mut dout = up(s, &vec![f32::NAN; n * per_q]);
                let p = AttnPrefillParams {
                    n_tokens: n,
                    head_dim: g.hd,
                    n_head: g.n_head,
                    n_kv: g.n_kv,
                    max_ctx: t,
                    pos0,
                    window: g.window,
                    scale,
                };
                attn_prefill::attn_prefill(
                    kern,
                    &dq.as_view(),
                    &dk.as_view(),
                    &dv.as_view(),
                    &mut dout.as_view_mut(),
                    &p,
                )
                .unwrap_or_else(|e| panic!("{e}"));
                down(s, &dout)
            };
            let whole = run(0, t);
            let mut chunked = run(0, split);
            chunked.extend(run(split, t - split));
            let err = rel_err(&chunked, &whole);
            eprintln!("{} {g:?}: chunked vs whole rel L2 {err:e}", kern.name());
            assert!(
                err <= 1e-6,
                "{} {g:?}: two chunks differ from one prompt by {err:e} (MEMRA_SEED={})",
                kern.name(),
                rng.seed()
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_attn_prefill_bad_shapes_are_refused() {
    let gpu = gpu();
    let s = gpu.stream();
    let ks = kernels(&gpu, QWEN3_8B, "bf16");
    let g = QWEN3_8B;
    let (t, max_ctx) = (4, 16);
    let q = up(s, &vec![0.5f32; t * g.n_head * g.hd]);
    let cache = up(s, &vec![0u16; max_ctx * g.n_kv * g.hd]);
    let mut out = up(s, &vec![0.0f32; t * g.n_head * g.hd]);
    let good = AttnPrefillParams {
        n_tokens: t,
        head_dim: g.hd,
        n_head: g.n_head,
        n_kv: g.n_kv,
        max_ctx,
        pos0: 0,
        window: None,
        scale: 1.0,
    };
    let mut refuse = |k: &Kernel, p: AttnPrefillParams, needle: &str| {
        let err = attn_prefill::attn_prefill(
            k,
            &q.as_view(),
            &cache.as_view(),
            &cache.as_view(),
            &mut out.as_view_mut(),
            &p,
        )
        .expect_err(needle);
        let msg = err.to_string();
        assert!(
            msg.contains(needle) && msg.contains(k.name()),
            "expected an error naming `{needle}` and the kernel, got: {msg}"
        );
    };
    for k in &ks {
        refuse(k, AttnPrefillParams { pos0: 13, ..good }, "max_ctx");
        refuse(
            k,
            AttnPrefillParams {
                head_dim: 96,
                ..good
            },
            "head_dim",
        );
        refuse(k, AttnPrefillParams { n_head: 12, ..good }, "n_head");
        refuse(
            k,
            AttnPrefillParams {
                window: Some(0),
                ..good
            },
            "window",
        );
        refuse(
            k,
            AttnPrefillParams {
                n_tokens: 5,
                ..good
            },
            "q",
        );
    }
    // The specialized variant refuses another group shape the generic one would take.
    refuse(&ks[0], AttnPrefillParams { n_head: 16, ..good }, "n_head");
    // A short cache buffer.
    let small = up(s, &vec![0u16; (max_ctx - 1) * g.n_kv * g.hd]);
    let err = attn_prefill::attn_prefill(
        &ks[1],
        &q.as_view(),
        &small.as_view(),
        &cache.as_view(),
        &mut out.as_view_mut(),
        &good,
    )
    .expect_err("short k_cache");
    assert!(err.to_string().contains("k_cache"), "{err}");
    // f32 buffers on a bf16 variant.
    let f = up(s, &vec![0.0f32; max_ctx * g.n_kv * g.hd]);
    let err = attn_prefill::attn_prefill(
        &ks[1],
        &q.as_view(),
        &f.as_view(),
        &f.as_view(),
        &mut out.as_view_mut(),
        &good,
    )
    .expect_err("cache type");
    assert!(err.to_string().contains("cache_t"), "{err}");
    // The good shape runs.
    attn_prefill::attn_prefill(
        &ks[0],
        &q.as_view(),
        &cache.as_view(),
        &cache.as_view(),
        &mut out.as_view_mut(),
        &good,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(down(s, &out).iter().all(|x| x.is_finite()));
}
