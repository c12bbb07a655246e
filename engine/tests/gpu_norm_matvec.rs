//! GPU tests of norm_matvec (a decode projection with the residual add + RMSNorm fused in)
//! against memra-reference: specialized variants at real model shapes (Gemma 3 270M's q/k/v,
//! gate/up + GeGLU and tied LM head; a Qwen3-8B gate/up + SwiGLU) and their generic twins, plus
//! awkward sizes, on the f32 path and on the integer path (`xq8`: h quantized in shared memory,
//! the oracle multiplying by h's q8 round trip, and accepting either rounding of the elements
//! that lie within f32 rounding of a half step: the kernel's h is not bit-equal to ours); each launch with no add, `x + delta` and `x + rmsnorm(delta)·delta_w`, x_out
//! written or not. Fresh random weights and inputs (seed printed, replay with
//! `MEMRA_SEED=<seed>`), y and x_out NaN-poisoned (with padding past their ends) before every
//! launch. y: matvec's tolerance (1e-4 relative L2, or 1e-6 of Σ|w·h| where outputs cancel);
//! x_out: 1e-6 relative L2 of the f32 sum. Speed: `memra bench --model` (decode tokens/s).
//!
//! Run on a GPU machine: `cargo test --release -p memra-engine --test gpu_norm_matvec -- --ignored --nocapture`.

mod dense_common;
mod gpu_common;

use dense_common::{V, variant};
use gpu_common::{dot_error, dot_terms, down, gpu, load, random_weight, shard, token, up};
use memra_engine::cuda::Gpu;
use memra_engine::kernels::norm_matvec::{self, NormMatvecWeights, Residual};
use memra_engine::kernels::registry::KernelVariant;
use memra_gguf::GgmlType;
use memra_reference::{Rng, act, linear, norm, q8, rel_err};

const TOL: f64 = 1e-4;
const EPS: f32 = 1e-6;

fn nm_variant(ty: GgmlType, glu: &'static str, dims: Option<(usize, usize)>, xq8: bool) -> &'static KernelVariant {
    let mut p: Vec<(&str, V)> = vec![("qtype", V::S(token(ty))), ("glu", V::S(glu)), ("xq8", V::I(xq8 as i64))];
    if let Some((k, n)) = dims {
        p.push(("k", V::I(k as i64)));
        p.push(("n", V::I(n as i64)));
    }
    variant("norm_matvec", &p)
}

/// Every residual form × x_out on/off for the specialized (k × n) and generic variants. With
/// `xq8` the oracle multiplies by h's q8 round trip (memra_reference::q8, the kernel's numerics).
fn check(gpu: &Gpu, ty: GgmlType, glu: &'static str, k: usize, n: usize, xq8: bool, rng: &mut Rng) {
    let s = gpu.stream();
    let paired = glu != "none";
    let wg = random_weight(ty, k, n, rng);
    let wu = if paired { random_weight(ty, k, n, rng) } else { Vec::new() };
    let (dwg, dwu) = (up(s, &wg), up(s, if paired { &wu } else { &wg }));
    let x = rng.normal_vec(k, 4.0);
    let delta = rng.normal_vec(k, 0.5);
    let delta_w: Vec<f32> = (0..k).map(|_| rng.uniform_in(0.5, 1.5)).collect();
    let norm_w: Vec<f32> = (0..k).map(|_| rng.uniform_in(0.5, 1.5)).collect();
    let (dx, dd, ddw, dnw) = (up(s, &x), up(s, &delta), up(s, &delta_w), up(s, &norm_w));
    for dims in [Some((k, n)), None] {
        let kernel = load(gpu, nm_variant(ty, glu, dims, xq8));
        for form in 0..3 {
            for write_x in [false, true] {
                if !shard::mine() {
                    continue;
                }
                let r: Vec<f32> = match form {
                    0 => x.clone(),
                    1 => x.iter().zip(&delta).map(|(a, d)| a + d).collect(),
                    _ => x.iter().zip(norm::rms_norm(&delta, &delta_w, EPS)).map(|(a, d)| a + d).collect(),
                };
                let h_f32 = norm::rms_norm(&r, &norm_w, EPS);
                let h = if xq8 { q8::quantize_q8_blocks(&h_f32).dequantize() } else { h_f32.clone() };
                let g = linear::matvec_gguf(ty, &wg, k, n, &h).unwrap_or_else(|e| panic!("{e}"));
                let (want, terms) = if paired {
                    let u = linear::matvec_gguf(ty, &wu, k, n, &h).unwrap_or_else(|e| panic!("{e}"));
                    // The activation scales the error of both sums: compare the gated output by
                    // rel L2 below instead of per-term bounds.
                    let want = if glu == "swiglu" { act::swiglu(&g, &u) } else { act::geglu(&g, &u) };
                    (want, None)
                } else {
                    (g.clone(), Some(dot_terms(ty, &wg, k, n, &h, 1, None)))
                };
                let mut dy = up(s, &vec![f32::NAN; n + 7]);
                let mut dxo = up(s, &vec![f32::NAN; k + 5]);
                let dd_v = dd.slice(..);
                let ddw_v = ddw.slice(..);
                let add = match form {
                    0 => None,
                    1 => Some(Residual { delta: &dd_v, delta_w: None }),
                    _ => Some(Residual { delta: &dd_v, delta_w: Some(&ddw_v) }),
                };
                let (wv, uv) = (dwg.slice(..), dwu.slice(..));
                let weights = NormMatvecWeights { w: &wv, w_up: paired.then_some(&uv) };
                let mut xo_view = dxo.slice_mut(..k);
                norm_matvec::norm_matvec(&kernel, &weights, &dx.slice(..), add, &dnw.slice(..), write_x.then_some(&mut xo_view), &mut dy.slice_mut(..n), k, n, EPS)
                    .unwrap_or_else(|e| panic!("{e}"));
                let (y, xo) = (down(s, &dy), down(s, &dxo));
                let what = format!("{} {ty:?} k={k} n={n} form={form} write_x={write_x}", kernel.name());
                let error = |want: &[f32]| match &terms {
                    Some(t) => dot_error(&y[..n], want, t),
                    None => rel_err(&y[..n], want),
                };
                let err = if xq8 {
                    // The kernel's h is not bit-equal to ours: accept either q8 rounding of the
                    // elements within f32 rounding of a half step (outputs are linear in h
                    // before the activation).
                    let flips = q8::near_half_steps(&h_f32);
                    assert!(flips.len() <= 10, "{what}: {} elements of h within rounding of a half step (MEMRA_SEED={})", flips.len(), rng.seed());
                    let cols: Vec<usize> = flips.iter().map(|f| f.0).collect();
                    let mut base = vec![g.clone()];
                    let mut cs = vec![linear::columns_gguf(ty, &wg, k, n, &cols).unwrap_or_else(|e| panic!("{e}"))];
                    if paired {
                        base.push(linear::matvec_gguf(ty, &wu, k, n, &h).unwrap_or_else(|e| panic!("{e}")));
                        cs.push(linear::columns_gguf(ty, &wu, k, n, &cols).unwrap_or_else(|e| panic!("{e}")));
                    }
                    q8::min_over_flips(&base, &cs, &flips, |o| match glu {
                        "swiglu" => error(&act::swiglu(&o[0], &o[1])),
                        "geglu" => error(&act::geglu(&o[0], &o[1])),
                        _ => error(&o[0]),
                    })
                } else {
                    error(&want)
                };
                assert!(
                    err <= TOL,
                    "{what}: y error {err:e} > {TOL:e} (relative L2 {:e}; first values got {:?} want {:?}) (MEMRA_SEED={})",
                    rel_err(&y[..n], &want),
                    &y[..n.min(4)],
                    &want[..n.min(4)],
                    rng.seed()
                );
                assert!(y[n..].iter().all(|v| v.is_nan()), "{what}: y written past n");
                assert!(xo[k..].iter().all(|v| v.is_nan()), "{what}: x_out written past k");
                if write_x {
                    let err = rel_err(&xo[..k], &r);
                    assert!(err <= 1e-6, "{what}: x_out rel L2 {err:e} > 1e-6 (MEMRA_SEED={})", rng.seed());
                } else {
                    assert!(xo.iter().all(|v| v.is_nan()), "{what}: x_out written without being asked");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_norm_matvec_real_shapes() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_norm_matvec_real_shapes");
    use GgmlType::*;
    for (ty, glu, k, n, xq8) in [
        (Q5_0, "none", 640, 1024, false),    // gemma3-270M attn_q
        (Q5_0, "none", 640, 256, false),     // gemma3-270M attn_k / attn_v
        (Q8_0, "none", 640, 256, false),     // gemma3-270M attn_v (use_more_bits layers)
        (Q5_0, "geglu", 640, 2048, false),   // gemma3-270M ffn_gate + ffn_up + GELU-tanh
        (Q8_0, "none", 640, 262144, false),  // gemma3-270M tied LM head, f32 h
        (Q8_0, "none", 640, 262144, true),   // the same on the integer path (the spec's choice)
        (Q4_K, "swiglu", 4096, 12288, false), // Qwen3-8B ffn_gate + ffn_up + SwiGLU
        (Q4_K, "none", 4096, 4096, false),   // Qwen3-8B attn_q
    ] {
        check(&gpu, ty, glu, k, n, xq8, &mut rng);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_norm_matvec_awkward_sizes() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_norm_matvec_awkward_sizes");
    use GgmlType::*;
    // K an odd number of blocks (rows start misaligned), N of 1, 7, 33, 4097 rows.
    // The integer path: K past one block per thread (the three-pass prologue in the generic
    // variant), paired rows, Q4_K's mins.
    for (ty, glu, k, n, xq8) in [
        (Q6_K, "none", 3 * 256, 33, false),
        (Q4_0, "geglu", 33 * 32, 7, false),
        (BF16, "swiglu", 296, 4097, false),
        (F32, "none", 8, 1, false),
        (IQ4_XS, "none", 9 * 256, 40, false),
        (Q5_K, "swiglu", 256, 100, false),
        (Q6_K, "none", 3 * 256, 33, true),
        (Q4_0, "geglu", 33 * 32, 7, true),
        (Q4_K, "swiglu", 9 * 256, 45, true),
        (Q8_0, "none", 97 * 32, 130, true),
    ] {
        check(&gpu, ty, glu, k, n, xq8, &mut rng);
    }
}

/// A launch the kernel would get wrong is refused before it starts: a paired variant without
/// w_up, a plain one with it, a short x. (x_out overlapping x or delta is refused too, but safe
/// Rust cannot even express that call: the borrows conflict.)
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_norm_matvec_refuses_bad_arguments() {
    let gpu = gpu();
    let s = gpu.stream();
    let mut rng = Rng::from_env_or_time("gpu_norm_matvec_refuses_bad_arguments");
    let (k, n) = (640, 64);
    let w = up(s, &random_weight(GgmlType::Q8_0, k, n, &mut rng));
    let (x, delta, norm_w) = (up(s, &rng.normal_vec(k, 1.0)), up(s, &rng.normal_vec(k, 1.0)), up(s, &vec![1.0f32; k]));
    let mut y = up(s, &vec![0.0f32; n]);
    let plain = load(&gpu, nm_variant(GgmlType::Q8_0, "none", None, false));
    let paired = load(&gpu, nm_variant(GgmlType::Q8_0, "geglu", None, false));
    let (wv, xv, dv, nv) = (w.slice(..), x.slice(..), delta.slice(..), norm_w.slice(..));
    let add = Some(Residual { delta: &dv, delta_w: None });
    let one = NormMatvecWeights { w: &wv, w_up: None };
    let both = NormMatvecWeights { w: &wv, w_up: Some(&wv) };
    let mut yv = y.slice_mut(..);
    let msg = |r: Result<(), memra_engine::cuda::Error>| r.expect_err("refused").to_string();
    let e = msg(norm_matvec::norm_matvec(&paired, &one, &xv, add, &nv, None, &mut yv, k, n, EPS));
    assert!(e.contains("w_up"), "{e}");
    let e = msg(norm_matvec::norm_matvec(&plain, &both, &xv, add, &nv, None, &mut yv, k, n, EPS));
    assert!(e.contains("w_up"), "{e}");
    let e = msg(norm_matvec::norm_matvec(&plain, &one, &xv.slice(..k - 32), add, &nv, None, &mut yv, k, n, EPS));
    assert!(e.contains("x holds"), "{e}");
}
