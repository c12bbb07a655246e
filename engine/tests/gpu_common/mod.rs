//! Shared by the `gpu_*.rs` tests (each also includes `dense_common`): the device, kernel
//! compile-and-load, host <-> device copies, NaN-poisoned outputs and random quantized weights.
#![allow(dead_code)]

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use memra_engine::cuda::module::load_modules;
use memra_engine::cuda::{Gpu, Kernel, compile_variants};
use memra_engine::kernels::registry::KernelVariant;
use memra_gguf::{GgmlType, quant};
use memra_reference::{Rng, rel_err};

use crate::dense_common::headers;

pub mod shard;

/// Every weight type the dense kernels take.
pub const QTYPES: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
];

pub fn gpu() -> Gpu {
    Gpu::new(0).unwrap_or_else(|e| panic!("{e}"))
}

pub fn load(gpu: &Gpu, v: &'static KernelVariant) -> Kernel {
    let compiled = compile_variants(gpu.cache(), &[v], headers(), gpu.arch())
        .pop()
        .expect("one result")
        .unwrap_or_else(|e| panic!("{e}"));
    let mut kernels =
        load_modules(gpu.ctx(), gpu.stream(), &[compiled]).unwrap_or_else(|e| panic!("{e}"));
    kernels.remove(v.name).expect("loaded kernel")
}

/// Compiles (in parallel) and loads every variant.
pub fn load_all(gpu: &Gpu, vs: &[&'static KernelVariant]) -> Vec<Kernel> {
    let compiled: Vec<_> = compile_variants(gpu.cache(), vs, headers(), gpu.arch())
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
        .collect();
    let mut kernels =
        load_modules(gpu.ctx(), gpu.stream(), &compiled).unwrap_or_else(|e| panic!("{e}"));
    vs.iter()
        .map(|v| kernels.remove(v.name).expect("loaded kernel"))
        .collect()
}

pub fn up<T: DeviceRepr>(s: &Arc<CudaStream>, host: &[T]) -> CudaSlice<T> {
    s.clone_htod(host).expect("upload")
}

pub fn down<T: DeviceRepr + ValidAsZeroBits + Clone + Default>(
    s: &Arc<CudaStream>,
    dev: &CudaSlice<T>,
) -> Vec<T> {
    s.clone_dtoh(dev).expect("download")
}

/// An output buffer of NaN, so an element the kernel fails to write fails the comparison.
pub fn nan_buf(s: &Arc<CudaStream>, n: usize) -> CudaSlice<f32> {
    up(s, &vec![f32::NAN; n.max(1)])
}

/// The lowercase type name the kernel templates take as `qtype`.
pub fn token(ty: GgmlType) -> &'static str {
    Box::leak(ty.name().to_ascii_lowercase().into_boxed_str())
}

/// Random weights of type `ty`: N(0, 1) values quantized by memra-gguf (the test input is the
/// quantized bytes; the oracle dequantizes the same bytes).
pub fn random_weight(ty: GgmlType, k: usize, n: usize, rng: &mut Rng) -> Vec<u8> {
    let w = rng.normal_vec(k * n, 1.0);
    quant::quantize(ty, &w).unwrap_or_else(|e| panic!("quantize {ty:?} {k}x{n}: {e}"))
}

/// Σ_k |w_jk·x_bk| for every output (b, j) of y = W·x (packed `[b][j]`, `rows` x rows of `k`),
/// plus |y0[b][j]| when the launch adds to y0 (`acc`: y0 and its row stride): the size of the
/// terms each output sums, from the dequantized weights. f32 rounding errors of the sum scale
/// with it, not with |y|, which cancellation can make arbitrarily small.
pub fn dot_terms(
    ty: GgmlType,
    w: &[u8],
    k: usize,
    n: usize,
    x: &[f32],
    rows: usize,
    acc: Option<(&[f32], usize)>,
) -> Vec<f32> {
    let dense =
        quant::dequantize(ty, w, k * n).unwrap_or_else(|e| panic!("dequantize {ty:?}: {e}"));
    // Output rows spread over the host's cores: at real shapes (t = 256, 2048 -> 16384) one
    // thread took minutes per launch checked (gpu_matmul_real_shapes ran past 200 s).
    let mut terms = vec![0f32; rows * n];
    let threads = std::thread::available_parallelism().map_or(1, |c| c.get());
    let rows_per_task = rows.div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        for (chunk, out) in terms.chunks_mut(rows_per_task * n).enumerate() {
            let dense = &dense;
            scope.spawn(move || {
                for (r, orow) in out.chunks_mut(n).enumerate() {
                    let b = chunk * rows_per_task + r;
                    let xs = &x[b * k..][..k];
                    for (j, o) in orow.iter_mut().enumerate() {
                        let base = acc.map_or(0.0, |(y0, ld)| (y0[b * ld + j] as f64).abs());
                        let sum: f64 = dense[j * k..][..k].iter().zip(xs).map(|(w, x)| (*w as f64 * *x as f64).abs()).sum();
                        *o = (base + sum) as f32;
                    }
                }
            });
        }
    });
    terms
}

/// Worst cancellation (‖terms‖ / ‖want‖) at which [`assert_dot_close`] still holds the error to
/// `tol` of ‖want‖. Random N(0, 1) inputs give about 0.64·√K (≤ 100 up to K ≈ 24 000).
pub const MAX_CANCELLATION: f64 = 100.0;

/// The rows of a strided output: `got` and `y0` (its contents before the launch) hold `rows` rows
/// of `n`, `ld` apart; `want` the oracle's, packed. Returns (got, want) packed, `want` added to
/// y0 when `accumulate`; asserts that the padding between rows still holds y0's bits.
#[allow(clippy::too_many_arguments)]
pub fn output_rows(
    name: &str,
    got: &[f32],
    y0: &[f32],
    want: &[f32],
    rows: usize,
    n: usize,
    ld: usize,
    accumulate: bool,
    rng: &Rng,
) -> (Vec<f32>, Vec<f32>) {
    let mut got_rows = Vec::with_capacity(rows * n);
    let mut want_rows = Vec::with_capacity(rows * n);
    for b in 0..rows {
        for j in 0..n {
            got_rows.push(got[b * ld + j]);
            let base = if accumulate { y0[b * ld + j] } else { 0.0 };
            want_rows.push(base + want[b * n + j]);
        }
        if b + 1 < rows {
            for j in n..ld {
                assert!(
                    got[b * ld + j].to_bits() == y0[b * ld + j].to_bits(),
                    "{name}: y padding [{b}][{j}] was written (MEMRA_SEED={})",
                    rng.seed()
                );
            }
        }
    }
    (got_rows, want_rows)
}

/// The error [`assert_dot_close`] bounds: ‖got − want‖ / max(‖want‖, ‖terms‖ / 100), L2 over
/// the outputs (infinite when an output is not finite).
pub fn dot_error(got: &[f32], want: &[f32], terms: &[f32]) -> f64 {
    let l2 = |v: &mut dyn Iterator<Item = f64>| v.map(|e| e * e).sum::<f64>().sqrt();
    let diff = l2(&mut got.iter().zip(want).map(|(g, w)| *g as f64 - *w as f64));
    let size = l2(&mut want.iter().map(|w| *w as f64));
    let scale = size.max(l2(&mut terms.iter().map(|t| *t as f64)) / MAX_CANCELLATION);
    match (diff, scale) {
        (d, _) if !d.is_finite() => f64::INFINITY,
        (d, _) if d == 0.0 => 0.0,
        (d, s) if s > 0.0 => d / s,
        _ => f64::INFINITY,
    }
}

/// A matvec / matmul output against its oracle: ‖got − want‖ ≤ tol · max(‖want‖, ‖terms‖ / 100)
/// (L2 over the outputs; `terms` from [`dot_terms`]). That is the relative L2 check while the
/// outputs cancel no more than [`MAX_CANCELLATION`]-fold (every random case but rare draws at
/// small N); beyond, the error is held to tol / 100 of the terms' size, as tight as the relative
/// check is at that cancellation (an n = 1 dot product of 288 terms summing to 0.17 has a
/// relative error that its f32 sum's rounding does not bound).
pub fn assert_dot_close(what: &str, got: &[f32], want: &[f32], terms: &[f32], tol: f64, rng: &Rng) {
    let err = dot_error(got, want, terms);
    let l2 = |v: &[f32]| v.iter().map(|e| (*e as f64).powi(2)).sum::<f64>().sqrt();
    assert!(
        err <= tol,
        "{what}: L2 error {err:e} of max(‖want‖, ‖Σ|w·x|‖ / {MAX_CANCELLATION}) > {tol:e} (relative L2 {:e}, cancellation ‖Σ|w·x|‖ / ‖want‖ = {:.1}) (MEMRA_SEED={}); first values got {:?} want {:?}",
        rel_err(got, want),
        l2(terms) / l2(want),
        rng.seed(),
        &got[..got.len().min(4)],
        &want[..want.len().min(4)]
    );
}
