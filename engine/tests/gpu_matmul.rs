//! GPU tests of matmul (prefill on tensor cores, bf16 products) against memra-reference: every
//! QType, specialized variants at real model shapes (BM 128 and 64, BN 256 and 128) and their generic twins, awkward sizes
//! (T = 1, 17, 130; N = 1, 7, 33, 4097; odd block counts; padded strides), Y += X·Wᵀ; fresh
//! random weights quantized with `memra_gguf::quant::quantize` and fresh inputs (seed printed,
//! replay with `MEMRA_SEED=<seed>`), output NaN-poisoned before every launch; bf16 path:
//! ≤ 1e-2 relative L2. Speed is measured by `memra bench` and the criterion `kernels` bench.
//!
//! Run on a GPU machine: `cargo test --release -p memra-engine --test gpu_matmul -- --ignored --nocapture`.

mod dense_common;
mod gpu_common;

use dense_common::{V, variant};
use gpu_common::{
    QTYPES, assert_dot_close, dot_terms, down, gpu, load, output_rows, random_weight, shard, token,
    up,
};
use memra_engine::cuda::{Gpu, Kernel};
use memra_engine::kernels::registry::KernelVariant;
use memra_engine::kernels::{matmul, matvec};
use memra_gguf::GgmlType;
use memra_reference::{Rng, linear};

/// The kernel multiplies bf16-rounded X and bf16-rounded dequantized W with f32 accumulation, so
/// the oracle rounds the same operands and accumulates in f64: what remains is f32 summation
/// error and the odd 1-ulp f32 difference in dequantization flipping a bf16 rounding. Comparing
/// against unrounded f32 operands instead is ill-posed for tiny outputs (t = n = 1): one dot
/// product with cancellation can exceed any bf16 tolerance while the kernel is exactly right.
const BF16_OPERANDS_TOL: f64 = 1e-3;

/// Round to the nearest bf16 (ties to even), as `cvt.rn.bf16.f32` does.
fn bf16_round(v: f32) -> f32 {
    let b = v.to_bits();
    f32::from_bits(b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000)
}

/// y[t][n] = Σ_k bf16(W[n][k]) · bf16(x[t][k]), accumulated in f64.
fn matmul_bf16_operands(
    ty: GgmlType,
    w: &[u8],
    k: usize,
    n: usize,
    x: &[f32],
    t: usize,
) -> Vec<f32> {
    let wf: Vec<f32> = linear::dequantize_matrix(ty, w, k, n)
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .map(bf16_round)
        .collect();
    let xb: Vec<f32> = x.iter().copied().map(bf16_round).collect();
    // One output row per task, spread over the host's cores: at real shapes (T = 130,
    // 6144 -> 2048) a single-threaded f64 oracle dominated the test's time on the GPU machine.
    let mut y = vec![0f32; t * n];
    let threads = std::thread::available_parallelism().map_or(1, |c| c.get());
    let rows_per_task = t.div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        for (chunk, ys) in y.chunks_mut(rows_per_task * n).enumerate() {
            let (wf, xb) = (&wf, &xb);
            scope.spawn(move || {
                for (r, yrow) in ys.chunks_mut(n).enumerate() {
                    let i = chunk * rows_per_task + r;
                    let xs = &xb[i * k..(i + 1) * k];
                    for (j, out) in yrow.iter_mut().enumerate() {
                        let row = &wf[j * k..(j + 1) * k];
                        *out = row
                            .iter()
                            .zip(xs)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>() as f32;
                    }
                }
            });
        }
    });
    y
}

/// The baked (K, N) of a test variant: both (as specialized variants used to be), K alone (as
/// the specs plan matmul now: `at_run_time = ["n"]`), or neither (generic).
fn bakes(k: usize, n: usize) -> [(Option<usize>, Option<usize>); 3] {
    [(Some(k), Some(n)), (Some(k), None), (None, None)]
}

fn mm_variant(
    ty: GgmlType,
    dims: (Option<usize>, Option<usize>),
    tune: &[(&'static str, i64)],
) -> &'static KernelVariant {
    let mut p: Vec<(&str, V)> = vec![("qtype", V::S(token(ty)))];
    if let Some(k) = dims.0 {
        p.push(("k", V::I(k as i64)));
    }
    if let Some(n) = dims.1 {
        p.push(("n", V::I(n as i64)));
    }
    p.extend(tune.iter().map(|(key, v)| (*key, V::I(*v))));
    variant("matmul", &p)
}

struct Case {
    t: usize,
    k: usize,
    n: usize,
    ldx: usize,
    ldy: usize,
    accumulate: bool,
}

impl Case {
    fn plain(t: usize, k: usize, n: usize) -> Case {
        Case {
            t,
            k,
            n,
            ldx: k,
            ldy: n,
            accumulate: false,
        }
    }
}

fn check(gpu: &Gpu, kernel: &Kernel, ty: GgmlType, w: &[u8], c: &Case, rng: &mut Rng) {
    // Each call is one case of `MEMRA_TEST_SHARD` (gpu_common/shard.rs): racecheck is slow here.
    if !shard::mine() {
        return;
    }
    let s = gpu.stream();
    let Case {
        t,
        k,
        n,
        ldx,
        ldy,
        accumulate,
    } = *c;
    let x = rng.normal_vec((t - 1) * ldx + k, 1.0);
    let x_packed: Vec<f32> = (0..t)
        .flat_map(|i| x[i * ldx..i * ldx + k].iter().copied())
        .collect();
    let want_packed = matmul_bf16_operands(ty, w, k, n, &x_packed, t);
    let y_len = (t - 1) * ldy + n;
    let y0: Vec<f32> = if accumulate {
        rng.normal_vec(y_len, 1.0)
    } else {
        vec![f32::NAN; y_len]
    };
    let dw = up(s, w);
    let dx = up(s, &x);
    let mut dy = up(s, &y0);
    matmul::matmul(
        kernel,
        &dw.slice(..),
        &dx.slice(..),
        &mut dy.slice_mut(..),
        t,
        k,
        n,
        ldx,
        ldy,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let got = down(s, &dy);
    let (got_rows, want_rows) = output_rows(
        kernel.name(),
        &got,
        &y0,
        &want_packed,
        t,
        n,
        ldy,
        accumulate,
        rng,
    );
    // The bf16 rounding of the operands and the f32 sum both err in proportion to Σ|w·x|.
    let terms = dot_terms(
        ty,
        w,
        k,
        n,
        &x_packed,
        t,
        accumulate.then_some((&y0[..], ldy)),
    );
    assert_dot_close(
        &format!(
            "{} {ty:?} t={t} k={k} n={n} ldx={ldx} ldy={ldy} acc={accumulate}",
            kernel.name()
        ),
        &got_rows,
        &want_rows,
        &terms,
        BF16_OPERANDS_TOL,
        rng,
    );
}

fn awkward_k(ty: GgmlType) -> usize {
    match matvec::k_multiple(ty).expect("supported") {
        256 => 9 * 256,
        32 => 9 * 32,
        m => 37 * m,
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_every_qtype_real_shape() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_matmul_every_qtype_real_shape");
    for ty in QTYPES {
        let (k, n) = (6144, 2048); // GLM-5 attn_q_a
        let w = random_weight(ty, k, n, &mut rng);
        for dims in bakes(k, n) {
            let kernel = load(&gpu, mm_variant(ty, dims, &[]));
            check(&gpu, &kernel, ty, &w, &Case::plain(130, k, n), &mut rng);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_real_shapes() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_matmul_real_shapes");
    use GgmlType::*;
    let cases: &[(GgmlType, usize, usize, usize)] = &[
        (Q8_0, 2048, 16384, 256), // GLM-5 attn_q_b
        (Q8_0, 6144, 576, 300),   // GLM-5 attn_kv_a_mqa
        (Q4_K, 6144, 12288, 256), // GLM-5 dense ffn_gate/up
        (Q4_K, 12288, 6144, 200), // GLM-5 dense ffn_down
        (BF16, 4096, 12288, 129), // Qwen3-8B
        (Q5_0, 640, 2048, 512),   // gemma3-270M ffn_gate/up
        (Q6_K, 2048, 640, 512),   // gemma3-270M ffn_down
        (Q8_0, 640, 1024, 77),    // gemma3-270M attn_q
    ];
    for &(ty, k, n, t) in cases {
        let w = random_weight(ty, k, n, &mut rng);
        for dims in bakes(k, n) {
            for bm in [128, 64] {
                let kernel = load(&gpu, mm_variant(ty, dims, &[("bm", bm)]));
                check(&gpu, &kernel, ty, &w, &Case::plain(t, k, n), &mut rng);
            }
        }
        // 128 weight rows a block (the default is 256), in the form the specs plan (K baked).
        for bm in [128, 64] {
            let kernel = load(&gpu, mm_variant(ty, (Some(k), None), &[("bm", bm), ("bn", 128)]));
            check(&gpu, &kernel, ty, &w, &Case::plain(t, k, n), &mut rng);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_awkward_sizes_every_qtype() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_matmul_awkward_sizes_every_qtype");
    for ty in QTYPES {
        let k = awkward_k(ty);
        for n in [1, 7, 33, 4097] {
            let w = random_weight(ty, k, n, &mut rng);
            for dims in bakes(k, n) {
                let kernel = load(&gpu, mm_variant(ty, dims, &[]));
                for t in [1, 17, 130] {
                    check(&gpu, &kernel, ty, &w, &Case::plain(t, k, n), &mut rng);
                }
            }
        }
        // One block per row, padded strides.
        let k1 = matvec::k_multiple(ty).unwrap();
        let w = random_weight(ty, k1, 33, &mut rng);
        let kernel = load(&gpu, mm_variant(ty, (None, None), &[("bm", 64)]));
        check(
            &gpu,
            &kernel,
            ty,
            &w,
            &Case {
                t: 17,
                k: k1,
                n: 33,
                ldx: k1 + 4,
                ldy: 40,
                accumulate: false,
            },
            &mut rng,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_accumulate_adds_to_y() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_matmul_accumulate_adds_to_y");
    for ty in [GgmlType::Q8_0, GgmlType::Q4_K] {
        let (k, n) = (2048, 640);
        let w = random_weight(ty, k, n, &mut rng);
        for dims in bakes(k, n) {
            let kernel = load(&gpu, mm_variant(ty, dims, &[("accumulate", 1)]));
            check(
                &gpu,
                &kernel,
                ty,
                &w,
                &Case {
                    t: 130,
                    k,
                    n,
                    ldx: k,
                    ldy: n,
                    accumulate: true,
                },
                &mut rng,
            );
        }
    }
}

/// The grouped launch of an MoE prefill: a stack of experts, each with its own rows of x and y
/// (empty experts, groups of 1 and past two BM tiles, padded strides), in one launch; every row
/// against its expert's bf16-operand product. Bad offsets are refused before any launch.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_grouped_experts_match_each_experts_product() {
    let gpu = gpu();
    let s = gpu.stream();
    let mut rng = Rng::from_env_or_time("gpu_matmul_grouped_experts_match_each_experts_product");
    // (type, k, n, ldx pad, ldy pad): OLMoE-like gate/up, a down with n over two column tiles.
    for (ty, k, n, px, py) in [
        (GgmlType::Q4_K, 2048, 1024, 0, 0),
        (GgmlType::Q8_0, 1024, 2048, 4, 3),
        (GgmlType::Q6_K, 512, 264, 0, 5),
    ] {
        let (ldx, ldy) = (k + px, n + py);
        let rows: Vec<usize> = (0..12)
            .map(|i| match i {
                0 | 5 => 0,
                3 => 1,
                7 => 300,
                _ => rng.below(90),
            })
            .collect();
        let mut offsets = vec![0i32];
        for &r in &rows {
            offsets.push(offsets.last().unwrap() + r as i32);
        }
        let total = *offsets.last().unwrap() as usize;
        let experts: Vec<Vec<u8>> = rows
            .iter()
            .map(|_| random_weight(ty, k, n, &mut rng))
            .collect();
        let w = experts.concat();
        let x = rng.normal_vec((total - 1) * ldx + k, 1.0);
        let x_packed: Vec<f32> = (0..total)
            .flat_map(|i| x[i * ldx..i * ldx + k].iter().copied())
            .collect();
        let (mut want, mut terms) = (Vec::with_capacity(total * n), Vec::with_capacity(total * n));
        for (z, ew) in experts.iter().enumerate() {
            let (r0, r1) = (offsets[z] as usize, offsets[z + 1] as usize);
            if r0 < r1 {
                let xz = &x_packed[r0 * k..r1 * k];
                want.extend(matmul_bf16_operands(ty, ew, k, n, xz, r1 - r0));
                terms.extend(dot_terms(ty, ew, k, n, xz, r1 - r0, None));
            }
        }
        let y0 = vec![f32::NAN; (total - 1) * ldy + n];
        let (dw, dx) = (up(s, &w), up(s, &x));
        let mut doff = up(s, &vec![0i32; offsets.len()]);
        for dims in bakes(k, n) {
            let kernel = load(&gpu, mm_variant(ty, dims, &[("bm", 64)]));
            let mut dy = up(s, &y0);
            let dev_offsets = matmul::ExpertOffsets::upload(&kernel, &offsets, &mut doff).unwrap_or_else(|e| panic!("{e}"));
            matmul::matmul_grouped(&kernel, &dw.slice(..), &dx.slice(..), &mut dy.slice_mut(..), &dev_offsets, k, n, ldx, ldy)
                .unwrap_or_else(|e| panic!("{e}"));
            let got = down(s, &dy);
            let (got_rows, want_rows) =
                output_rows(kernel.name(), &got, &y0, &want, total, n, ldy, false, &rng);
            let what = format!(
                "{} grouped {ty:?} k={k} n={n} rows {rows:?} ldx={ldx} ldy={ldy}",
                kernel.name()
            );
            assert_dot_close(
                &what,
                &got_rows,
                &want_rows,
                &terms,
                BF16_OPERANDS_TOL,
                &rng,
            );
            // Refusals: offsets not from 0, decreasing, or more rows than x holds.
            let mut y = up(s, &y0);
            for bad in [vec![1, 2, 3], vec![0, 5, 4], vec![0, total as i32 + 1]] {
                let e = matmul::ExpertOffsets::upload(&kernel, &bad, &mut doff).and_then(|o| {
                    matmul::matmul_grouped(&kernel, &dw.slice(..), &dx.slice(..), &mut y.slice_mut(..), &o, k, n, ldx, ldy)
                });
                assert!(e.is_err(), "{what}: offsets {bad:?} accepted");
            }
        }
    }
}

/// The strided batch of MLA's per-head absorption at GLM-5's k_b and v_b shapes: head z reads
/// the t rows of x + z·x_batch (rows n_head·x_batch apart) and writes y + z·y_batch, its own
/// matrix at w + z·matrix_bytes; the columns between heads' outputs keep their poison.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_strided_batch_matches_each_heads_product() {
    let gpu = gpu();
    let s = gpu.stream();
    let mut rng = Rng::from_env_or_time("gpu_matmul_strided_batch_matches_each_heads_product");
    // (type, k, n, heads, t, x row per head, y row per head): k_b (nope 192 of a 256-float q
    // row into a 576-float absorbed row), v_b (512-float latent rows into 256-float outputs).
    for (ty, k, n, heads, t, xr, yr) in [(GgmlType::Q8_0, 192, 512, 8, 77, 256, 576), (GgmlType::Q8_0, 512, 256, 8, 130, 512, 256), (GgmlType::BF16, 128, 512, 4, 17, 192, 576)] {
        let (ldx, ldy) = (heads * xr, heads * yr);
        let mats: Vec<Vec<u8>> = (0..heads).map(|_| random_weight(ty, k, n, &mut rng)).collect();
        let x = rng.normal_vec(t * ldx, 1.0);
        let y0 = vec![f32::NAN; t * ldy];
        let (mut want, mut terms) = (Vec::new(), Vec::new());
        for (z, m) in mats.iter().enumerate() {
            let xz: Vec<f32> = (0..t).flat_map(|i| x[i * ldx + z * xr..][..k].iter().copied()).collect();
            want.push(matmul_bf16_operands(ty, m, k, n, &xz, t));
            terms.push(dot_terms(ty, m, k, n, &xz, t, None));
        }
        let (dw, dx) = (up(s, &mats.concat()), up(s, &x));
        for dims in bakes(k, n) {
            let kernel = load(&gpu, mm_variant(ty, dims, &[]));
            let mut dy = up(s, &y0);
            matmul::matmul_batched(&kernel, &dw.slice(..), &dx.slice(..), &mut dy.slice_mut(..), heads, t, k, n, (ldx, xr), (ldy, yr))
                .unwrap_or_else(|e| panic!("{e}"));
            let got = down(s, &dy);
            let what = format!("{} strided {ty:?} k={k} n={n} heads={heads} t={t}", kernel.name());
            for (i, g) in got.iter().enumerate() {
                if (i % ldy) % yr >= n {
                    assert!(g.is_nan(), "{what}: y[{i}] outside every head's columns written (MEMRA_SEED={})", rng.seed());
                }
            }
            for z in 0..heads {
                let gz: Vec<f32> = (0..t).flat_map(|i| got[i * ldy + z * yr..][..n].iter().copied()).collect();
                assert_dot_close(&format!("{what} head {z}"), &gz, &want[z], &terms[z], BF16_OPERANDS_TOL, &rng);
            }
            // Refusals: a batch stride that breaks the 16-byte loads, too short an x.
            let mut y = up(s, &y0);
            let odd = matmul::matmul_batched(&kernel, &dw.slice(..), &dx.slice(..), &mut y.slice_mut(..), heads, t, k, n, (ldx, xr + 1), (ldy, yr));
            assert!(odd.is_err(), "{what}: x_batch {} accepted", xr + 1);
            let short = matmul::matmul_batched(&kernel, &dw.slice(..), &dx.slice(..ldx), &mut y.slice_mut(..), heads, t, k, n, (ldx, xr), (ldy, yr));
            assert!(short.is_err(), "{what}: one row of x accepted for t={t}");
        }
    }
}
