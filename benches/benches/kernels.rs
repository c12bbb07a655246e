//! criterion benches of the kernels and the steps that build them.
//!
//! GPU groups `<family>/<specialized|generic>/<shape>`: every case `memra bench` plans (the
//! built architectures' preset shapes, `memra_engine::bench::plan`), throughput in bytes (the
//! family's minimal traffic, engine/src/bench.rs), timed on the device: each criterion batch is
//! `iters` back-to-back launches rotating among buffer sets larger than L2 together, between two
//! CUDA events. Without a GPU these groups print that they were skipped; the bench still exits 0.
//!
//! CPU groups: `nvrtc/cold/<variant>` (NVRTC → CUBIN with no cache), `nvrtc/warm/<variant>`
//! (a disk-cache hit through a fresh `KernelCache`) for one glm-dsa variant per family, and
//! `codegen/generate/glm-dsa` (spec + preset → every variant's CUDA and the registry, in memory).
//!
//! Filters: criterion's own name filter, plus `MEMRA_BENCH_ARCH` / `MEMRA_BENCH_FAMILY` to plan
//! fewer GPU cases. Specialized variants exist only with `--features model-<arch>`:
//! `cargo bench -p memra-benches --features model-glm-dsa,model-qwen3 --bench kernels`.

use std::path::PathBuf;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use memra_engine::bench::{self, Prepared};
use memra_engine::cuda::{CacheConfig, Gpu, HeaderSet, KernelCache, SmArch, compile_cubin, library};
use memra_engine::cuda::cache::CompileJob;
use memra_engine::kernels::registry::{self, KernelVariant};
use memra_reference::Rng;

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn gpu_kernels(c: &mut Criterion) {
    if Gpu::device_count() == 0 {
        eprintln!("kernels: GPU groups SKIPPED (no CUDA device or driver on this machine)");
        return;
    }
    let gpu = match Gpu::new(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("kernels: GPU groups SKIPPED ({e})");
            return;
        }
    };
    let cases = bench::plan(env("MEMRA_BENCH_ARCH").as_deref(), env("MEMRA_BENCH_FAMILY").as_deref());
    if cases.is_empty() {
        eprintln!("kernels: GPU groups SKIPPED (no specialized variants in this build; enable --features model-<arch>)");
        return;
    }
    let mut all: Vec<&'static KernelVariant> = cases.iter().flat_map(|c| c.variants().map(|(v, _)| v)).collect();
    all.sort_by_key(|v| v.name);
    all.dedup_by_key(|v| v.name);
    let kernels = gpu.load(&all).unwrap_or_else(|e| panic!("loading the bench kernels: {e}"));
    let l2 = bench::l2_bytes(&gpu);
    let mut rng = Rng::from_env_or_time("kernels bench");
    for case in &cases {
        let shape = case.shape;
        let mut prepared = Prepared::new(&gpu, shape, bench::sets_for(&shape, l2), Rng::new(rng.next_u64()))
            .unwrap_or_else(|e| panic!("{} {}: {e}", shape.family(), shape.label()));
        for (variant, kind) in case.variants() {
            let kernel = kernels.get(variant.name).unwrap_or_else(|e| panic!("{e}"));
            let mut group = c.benchmark_group(format!("{}/{}", shape.family(), kind.label()));
            group.throughput(Throughput::Bytes(shape.bytes()));
            group.sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
            group.bench_function(format!("{}_{}", shape.label(), shape.dtype()), |b| {
                b.iter_custom(|iters| {
                    let secs = prepared
                        .time_batch(&gpu, kernel, iters)
                        .unwrap_or_else(|e| panic!("{} {}: {e}", variant.name, shape.label()));
                    Duration::from_secs_f64(secs)
                })
            });
            group.finish();
        }
    }
}

/// One glm-dsa variant per family (the first the registry lists).
fn glm_dsa_representatives() -> Vec<&'static KernelVariant> {
    let mut seen: Vec<&str> = Vec::new();
    registry::variants()
        .iter()
        .filter(|v| v.arch == Some("glm-dsa"))
        .filter(|v| {
            let new = !seen.contains(&v.family);
            seen.push(v.family);
            new
        })
        .collect()
}

fn nvrtc_compile(c: &mut Criterion) {
    if let Err(e) = library::nvrtc() {
        eprintln!("nvrtc: SKIPPED (NVRTC not found: {})", e.to_string().lines().next().unwrap_or(""));
        return;
    }
    let variants = glm_dsa_representatives();
    if variants.is_empty() {
        eprintln!("nvrtc: SKIPPED (no glm-dsa variants in this build; enable --features model-glm-dsa)");
        return;
    }
    let headers = HeaderSet::registry();
    let arch = SmArch(90);
    let mut cold = c.benchmark_group("nvrtc/cold");
    cold.sample_size(10).warm_up_time(Duration::from_millis(100)).measurement_time(Duration::from_secs(3));
    for v in &variants {
        cold.bench_function(v.name, |b| b.iter(|| compile_cubin(v.name, v.source, &headers, arch).unwrap_or_else(|e| panic!("{e}"))));
    }
    cold.finish();

    let dir: PathBuf = std::env::temp_dir().join(format!("memra-bench-nvrtc-{}", std::process::id()));
    let job = |v: &'static KernelVariant| CompileJob { name: v.name, source: v.source, headers: &headers, arch };
    let fill = KernelCache::new(CacheConfig::at(&dir));
    for v in &variants {
        fill.get_or_compile(&job(v)).unwrap_or_else(|e| panic!("{e}"));
    }
    let mut warm = c.benchmark_group("nvrtc/warm");
    for v in &variants {
        warm.bench_function(v.name, |b| {
            b.iter(|| {
                // A fresh handle each time: its in-memory map is empty, so this is a disk hit.
                let cache = KernelCache::new(CacheConfig::at(&dir));
                let (cubin, outcome) = cache.lookup(&job(v)).unwrap_or_else(|e| panic!("{e}")).expect("filled above");
                assert!(outcome.is_hit());
                cubin
            })
        });
    }
    warm.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

fn codegen_generate(c: &mut Criterion) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("benches/ has a parent").to_path_buf();
    let req = memra_codegen::build::BuildRequest {
        specs_dir: root.join("specs"),
        templates_dir: root.join("templates"),
        out_dir: std::env::temp_dir().join("memra-bench-codegen-unused"),
        archs: vec!["glm-dsa".to_string()],
        model: None,
    };
    if let Err(e) = memra_codegen::build::generate(&req) {
        eprintln!("codegen/generate: SKIPPED ({e})");
        return;
    }
    c.bench_function("codegen/generate/glm-dsa", |b| {
        b.iter(|| memra_codegen::build::generate(&req).unwrap_or_else(|e| panic!("{e}")).files.len())
    });
}

criterion_group!(gpu, gpu_kernels);
criterion_group!(cpu, nvrtc_compile, codegen_generate);
criterion_main!(gpu, cpu);
