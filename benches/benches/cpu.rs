//! CPU-side benchmarks that run on any machine: GGUF open + parse (the real gemma3 file when it
//! has been fetched) and CPU dequantization per block format. The GPU groups live in
//! `kernels.rs` and report themselves skipped where no GPU is present.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use memra_gguf::{GgmlType, GgufFile, quant};
use std::hint::black_box;
use std::path::PathBuf;

fn real_model() -> Option<PathBuf> {
    let path = std::env::var_os("MEMRA_GEMMA3_GGUF").map(PathBuf::from).or_else(|| {
        let cache = std::env::var_os("MEMRA_CACHE")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/memra")))?;
        Some(cache.join("models/gemma-3-270m-q4_k_m.gguf"))
    })?;
    path.exists().then_some(path)
}

fn gguf_open(c: &mut Criterion) {
    let Some(path) = real_model() else {
        eprintln!("gguf/open: SKIPPED (no gemma3 file; run scripts/fetch-gemma3-270m)");
        return;
    };
    c.bench_function("gguf/open/gemma3-270m", |b| {
        b.iter(|| black_box(GgufFile::open(&path).expect("open real model").tensors().len()))
    });
}

/// Deterministic pseudo-random bytes that are valid blocks: f16 scale fields stay finite
/// because every type's scales are re-written by quantizing real floats.
fn blocks_of(ty: GgmlType, n: usize) -> Vec<u8> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let xs: Vec<f32> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    quant::quantize(ty, &xs).expect("quantize bench input")
}

fn dequantize(c: &mut Criterion) {
    const N: usize = 1 << 20;
    let mut group = c.benchmark_group("quant/dequantize");
    for ty in GgmlType::all().filter(|t| t.is_supported()) {
        let src = blocks_of(ty, N);
        let mut dst = vec![0f32; N];
        group.throughput(Throughput::Bytes(src.len() as u64));
        group.bench_function(ty.name(), |b| {
            b.iter(|| quant::dequantize_row(ty, black_box(&src), &mut dst).expect("dequantize"))
        });
    }
    group.finish();
}

criterion_group!(benches, gguf_open, dequantize);
criterion_main!(benches);
