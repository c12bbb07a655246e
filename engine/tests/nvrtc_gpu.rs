//! GPU tests of the runtime (run by the lead on the H200: `cargo test -- --ignored gpu_`):
//! load + typed launch of a tiny kernel, argument-family checks, warm-cache load of every variant.

use std::time::Instant;

use memra_engine::cuda::cudarc::driver::{CudaSlice, LaunchConfig};
use memra_engine::cuda::{CacheOutcome, Error, Gpu};
use memra_engine::kernels::launch::{KernelArgs, launch};
use memra_engine::kernels::registry::{self, KernelVariant};

static DEMO_ADD: KernelVariant = KernelVariant {
    name: "gpu_demo_add__k3",
    family: "gpu_demo_add",
    arch: None,
    params: &[],
    source: "extern \"C\" __global__ void __launch_bounds__(128) gpu_demo_add__k3(const float* x, float* y, int n, float a) {\n\
               int i = blockIdx.x * blockDim.x + threadIdx.x;\n\
               if (i < n) y[i] = 3.0f * x[i] + a;\n\
             }\n",
};

#[derive(KernelArgs)]
#[kernel_args(family = "gpu_demo_add")]
struct DemoAddArgs<'a> {
    x: &'a CudaSlice<f32>,
    y: &'a mut CudaSlice<f32>,
    n: i32,
    a: f32,
}

#[derive(KernelArgs)]
#[kernel_args(family = "rmsnorm")]
struct OtherFamilyArgs<'a> {
    y: &'a mut CudaSlice<f32>,
}

fn gpu() -> Gpu {
    Gpu::new(0).unwrap_or_else(|e| panic!("needs a CUDA GPU: {e}"))
}

/// xorshift64*, seeded per run; the seed is printed so a failure can be replayed.
fn random_f32s(n: usize) -> (u64, Vec<f32>) {
    let seed = std::env::var("MEMRA_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1) | 1
    });
    let mut state = seed;
    let values = (0..n)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let bits = state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
            bits as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect();
    (seed, values)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_launch_trivial_kernel_writes_exactly_its_range() {
    let gpu = gpu();
    eprintln!("device: {} ({})", gpu.name(), gpu.arch());
    let kernel = gpu.load_one(&DEMO_ADD).expect("compiles and loads");
    let n = 1000; // not a multiple of the block size
    let (seed, x_host) = random_f32s(n);
    eprintln!("seed {seed} (MEMRA_SEED={seed} replays it)");
    let a = 0.25f32;
    let stream = gpu.stream();
    let x = stream.clone_htod(&x_host).unwrap();
    // NaN-poisoned, with 7 elements past n that the kernel must not touch.
    let mut y = stream.clone_htod(&vec![f32::NAN; n + 7]).unwrap();
    let cfg = LaunchConfig { grid_dim: ((n as u32).div_ceil(128), 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: x holds n floats, y n + 7, and the grid covers n threads with an `i < n` guard.
    unsafe { launch(&kernel, cfg, &mut DemoAddArgs { x: &x, y: &mut y, n: n as i32, a }) }.expect("launches");
    let out = stream.clone_dtoh(&y).unwrap();
    for (i, (&got, &xi)) in out[..n].iter().zip(&x_host).enumerate() {
        let want = 3.0f32 * xi + a;
        assert!((got - want).abs() <= 1e-6 * want.abs().max(1.0), "y[{i}] = {got}, want {want} (seed {seed})");
    }
    assert!(out[n..].iter().all(|v| v.is_nan()), "wrote past n (seed {seed})");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_arguments_of_another_family_are_refused() {
    let gpu = gpu();
    let kernel = gpu.load_one(&DEMO_ADD).unwrap();
    let mut y = gpu.stream().clone_htod(&[0.0f32; 4]).unwrap();
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: refused before any launch (the check under test).
    let err = unsafe { launch(&kernel, cfg, &mut OtherFamilyArgs { y: &mut y }) }.unwrap_err();
    assert!(matches!(err, Error::WrongArgs { .. }), "{err}");
    assert_eq!(OtherFamilyArgs::FAMILY, "rmsnorm");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_load_every_variant_from_a_warm_cache() {
    let all: Vec<&'static KernelVariant> = registry::variants().iter().collect();
    let cold = gpu();
    let start = Instant::now();
    cold.load(&all).expect("every variant compiles and loads");
    eprintln!("first load of {} variants: {:.1} ms (compiles whatever the cache missed)", all.len(), start.elapsed().as_secs_f64() * 1e3);

    // A new Gpu has an empty in-memory cache: everything comes from disk.
    let warm = gpu();
    let start = Instant::now();
    let (kernels, report) = warm.load_reporting(&all).unwrap();
    let ms = start.elapsed().as_secs_f64() * 1e3;
    eprintln!("warm-cache load of {} variants on {} ({}): {ms:.1} ms", kernels.len(), warm.name(), warm.arch());
    assert_eq!(kernels.len(), all.len());
    let misses: Vec<&str> = report.iter().filter(|c| c.outcome != CacheOutcome::Disk).map(|c| c.variant.name).collect();
    assert!(misses.is_empty(), "not served from disk: {misses:?}");
    for v in &all {
        kernels.get(v.name).expect("loaded under its variant name");
    }
}
