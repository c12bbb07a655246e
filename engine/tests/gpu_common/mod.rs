//! Shared by the `gpu_*.rs` tests (each also includes `dense_common`): the device, kernel
//! compile-and-load, host <-> device copies, NaN-poisoned outputs and random quantized weights.
#![allow(dead_code)]

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use memra_engine::cuda::module::load_modules;
use memra_engine::cuda::{Gpu, Kernel, compile_variants};
use memra_engine::kernels::registry::KernelVariant;
use memra_gguf::{GgmlType, quant};
use memra_reference::Rng;

use crate::dense_common::headers;

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
