//! criterion benches of the kernels and the steps that build them.
//!
//! GPU groups `<family>/<specialized|generic>/<shape>`: every case `memra bench` plans (the
//! built architectures' preset shapes, `memra_engine::bench::plan`), throughput in bytes (the
//! family's minimal traffic, engine/src/bench.rs), timed on the device: each criterion batch is
//! `iters` back-to-back launches rotating among buffer sets larger than L2 together, between two
//! CUDA events. Without a GPU these groups print that they were skipped; the bench still exits 0.
//!
//! `attn_prefill/<specialized|generic>/<model>_t<T>_...`: prefill attention chunks (gemma3-270M
//! T = 512 with its window, Qwen3-8B T = 4096), throughput in useful FLOPs (criterion's elem/s).
//!
//! `dsa_decode/<specialized|generic>/<indexer|topk|sparse_mla|total>_t131072_k2048`: a GLM-5
//! DSA decode step at 128k tokens (indexer throughput in key bytes).
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

/// `attn_prefill/<specialized|generic>/<model>_t<T>`: one prefill chunk at pos0 = 0 (gemma3-270M
/// local layer T = 512, window 512; Qwen3-8B T = 4096), bf16 cache, per-launch CUDA events after
/// an L2 flush. Throughput in elements = useful FLOPs (4·hd per visible (q head, key) pair, masked
/// work not counted), so criterion's elem/s reads as FLOP/s. Specialized variants need
/// `--features model-gemma3,model-qwen3`; without them only the generic rows run.
fn attn_prefill_gpu(c: &mut Criterion) {
    use memra_engine::kernels::attn_prefill::{self, AttnPrefillParams};
    use memra_engine::kernels::registry::Param;
    let Ok(gpu) = Gpu::new(0) else {
        eprintln!("attn_prefill: SKIPPED (no CUDA device or driver on this machine)");
        return;
    };
    let bf16 = |v: &&KernelVariant| v.param("cache_t") == Some(Param::Sym("bf16"));
    let generic = registry::family(attn_prefill::FAMILY).into_iter().find(|v| v.arch.is_none() && bf16(v));
    let shapes = [("gemma3", 4, 1, 256, 512, Some(512)), ("qwen3", 32, 8, 128, 4096, None)];
    let mut rng = Rng::from_env_or_time("attn_prefill bench");
    let mut flush = gpu.stream().alloc_zeros::<u8>(2 * bench::l2_bytes(&gpu)).expect("L2 flush buffer");
    for (arch, n_head, n_kv, hd, t, window) in shapes {
        let p = AttnPrefillParams { n_tokens: t, head_dim: hd, n_head, n_kv, max_ctx: t, pos0: 0, window, scale: 1.0 / (hd as f32).sqrt() };
        let specialized = registry::family(attn_prefill::FAMILY).into_iter().find(|v| {
            v.is_for(arch) && bf16(v) && v.param("n_head") == Some(Param::Int(n_head as i64)) && v.param("head_dim") == Some(Param::Int(hd as i64))
        });
        let s = gpu.stream();
        let q = s.clone_htod(&rng.normal_vec(t * n_head * hd, 1.0)).expect("upload");
        let cache: Vec<u16> = rng.normal_vec(t * n_kv * hd, 1.0).iter().map(|x| (x.to_bits() >> 16) as u16).collect();
        let (k, v) = (s.clone_htod(&cache).expect("upload"), s.clone_htod(&cache).expect("upload"));
        let mut out = s.alloc_zeros::<f32>(t * n_head * hd).expect("alloc");
        for (kind, variant) in [("specialized", specialized), ("generic", generic)] {
            let Some(variant) = variant else {
                eprintln!("attn_prefill/{kind}/{arch}: SKIPPED (variant not in this build)");
                continue;
            };
            let kernels = gpu.load(&[variant]).unwrap_or_else(|e| panic!("{e}"));
            let kernel = kernels.get(variant.name).unwrap_or_else(|e| panic!("{e}"));
            let mut group = c.benchmark_group(format!("attn_prefill/{kind}"));
            group.throughput(Throughput::Elements(attn_prefill::flops(&p)));
            group.sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
            group.bench_function(format!("{arch}_t{t}_hd{hd}_{n_head}q{n_kv}kv"), |b| {
                b.iter_custom(|iters| {
                    let mut launch = |_| attn_prefill::attn_prefill(kernel, &q.as_view(), &k.as_view(), &v.as_view(), &mut out.as_view_mut(), &p);
                    let us = bench::time_launches(&gpu, 1, iters as u32, &mut flush, &mut launch).unwrap_or_else(|e| panic!("{}: {e}", variant.name));
                    Duration::from_secs_f64(us.iter().sum::<f64>() / 1e6)
                })
            });
            group.finish();
        }
    }
}

/// `dsa_decode/<specialized|generic>/<step>_t131072_k2048`: one GLM-5 DSA decode step at 128k
/// visible tokens — the indexer over the bf16 index-key cache (throughput = its key bytes,
/// 32 MiB), the top-2048 selection of its scores, the sparse MLA over the selected latent rows,
/// and the three back to back (`total`). Per-launch CUDA events after an L2 flush (so top-k reads
/// its scores from DRAM when timed alone). Specialized variants need `--features model-glm-dsa`.
fn dsa_decode_gpu(c: &mut Criterion) {
    use memra_engine::kernels::dsa_indexer::{self, DsaIndexerParams};
    use memra_engine::kernels::dsa_topk::{self, DsaTopkParams};
    use memra_engine::kernels::mla_decode::{self, MlaDecodeParams};
    use memra_engine::kernels::mla_sparse_decode;
    use memra_engine::kernels::registry::Param;
    let Ok(gpu) = Gpu::new(0) else {
        eprintln!("dsa_decode: SKIPPED (no CUDA device or driver on this machine)");
        return;
    };
    let (t, k, nh_i, hd_i, n_head, kvl, rope) = (131_072usize, 2048usize, 32usize, 128usize, 64usize, 512usize, 64usize);
    let d = kvl + rope;
    let sms = gpu.sm_count().unwrap_or(132);
    let bf16 = |v: &&KernelVariant| v.param("cache_t").is_none_or(|c| c == Param::Sym("bf16"));
    let pick = |family: &str, specialized: bool| registry::family(family).into_iter().find(|v| bf16(v) && (if specialized { v.is_for("glm-dsa") } else { v.is_generic() }));
    let mut rng = Rng::from_env_or_time("dsa_decode bench");
    let s = gpu.stream();
    let bits = |n: usize, rng: &mut Rng| -> Vec<u16> { rng.normal_vec(n, 1.0).iter().map(|x| (x.to_bits() >> 16) as u16).collect() };
    let iq = s.clone_htod(&rng.normal_vec(nh_i * hd_i, 1.0)).expect("upload");
    let iw = s.clone_htod(&rng.normal_vec(nh_i, 0.1)).expect("upload");
    let keys = s.clone_htod(&bits(t * hd_i, &mut rng)).expect("upload");
    let q = s.clone_htod(&rng.normal_vec(n_head * d, 1.0)).expect("upload");
    let latent = s.clone_htod(&bits(t * d, &mut rng)).expect("upload");
    let pos = s.clone_htod(&[(t - 1) as i32]).expect("upload");
    let mut scores = s.alloc_zeros::<f32>(t).expect("alloc");
    let mut idx = s.alloc_zeros::<i32>(k).expect("alloc");
    let mut count = s.alloc_zeros::<i32>(1).expect("alloc");
    let mut out = s.alloc_zeros::<f32>(n_head * kvl).expect("alloc");
    let n_split = mla_sparse_decode::splits_for(k, n_head, sms);
    let mut work = s.alloc_zeros::<f32>(mla_decode::work_floats(n_head, kvl, n_split)).expect("alloc");
    let mut flush = s.alloc_zeros::<u8>(2 * bench::l2_bytes(&gpu)).expect("L2 flush buffer");
    let ip = DsaIndexerParams { n_q: 1, n_idx_head: nh_i, idx_head_dim: hd_i, max_ctx: t, ld_scores: t, n_blk: dsa_indexer::blocks_for(t, 2, dsa_indexer::THREADS, sms) };
    let tp = DsaTopkParams { n_q: 1, ld_scores: t, k, n_blk: dsa_topk::blocks_for(1, t, sms) };
    let mut topk_scratch = s.alloc_zeros::<u32>(dsa_topk::scratch_words(1, tp.n_blk).max(1)).expect("alloc");
    let mp = MlaDecodeParams { n_head, kv_lora: kvl, rope, max_ctx: t, n_split, scale: 1.0 / 16.0 };
    for (kind, specialized) in [("specialized", true), ("generic", false)] {
        let (Some(vi), Some(vt), Some(vs)) = (pick(dsa_indexer::FAMILY, specialized), pick(dsa_topk::FAMILY, specialized), pick(mla_sparse_decode::FAMILY, specialized)) else {
            eprintln!("dsa_decode/{kind}: SKIPPED (variants not in this build)");
            continue;
        };
        let kernels = gpu.load(&[vi, vt, vs]).unwrap_or_else(|e| panic!("{e}"));
        let (ki, kt, ks) = (kernels.get(vi.name).expect("indexer"), kernels.get(vt.name).expect("top-k"), kernels.get(vs.name).expect("sparse mla"));
        let mut group = c.benchmark_group(format!("dsa_decode/{kind}"));
        group.sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
        for step in ["indexer", "topk", "sparse_mla", "total"] {
            if step == "indexer" {
                group.throughput(Throughput::Bytes(dsa_indexer::key_bytes(t, hd_i, 2) as u64));
            } else {
                group.throughput(Throughput::Elements(1));
            }
            group.bench_function(format!("{step}_t{t}_k{k}"), |b| {
                b.iter_custom(|iters| {
                    let mut launch = |_: usize| -> Result<(), memra_engine::cuda::Error> {
                        if step == "indexer" || step == "total" {
                            dsa_indexer::dsa_indexer(ki, &iq.as_view(), &iw.as_view(), &keys.as_view(), &pos.as_view(), &mut scores.as_view_mut(), &ip)?;
                        }
                        if step == "topk" || step == "total" {
                            dsa_topk::dsa_topk(kt, &scores.as_view(), &pos.as_view(), &mut idx.as_view_mut(), &mut count.as_view_mut(), &mut topk_scratch.as_view_mut(), &tp)?;
                        }
                        if step == "sparse_mla" || step == "total" {
                            mla_sparse_decode::mla_sparse_decode(ks, &q.as_view(), &latent.as_view(), &idx.as_view(), &count.as_view(), &mut out.as_view_mut(), &mut work.as_view_mut(), k, &mp)?;
                        }
                        Ok(())
                    };
                    let us = bench::time_launches(&gpu, 1, iters as u32, &mut flush, &mut launch).unwrap_or_else(|e| panic!("dsa_decode {step}: {e}"));
                    Duration::from_secs_f64(us.iter().sum::<f64>() / 1e6)
                })
            });
        }
        group.finish();
    }
}

/// One glm-dsa variant per family (the first the registry lists).
fn glm_dsa_representatives() -> Vec<&'static KernelVariant> {
    let mut seen: Vec<&str> = Vec::new();
    registry::variants()
        .iter()
        .filter(|v| v.is_for("glm-dsa"))
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
        shards: None,
    };
    if let Err(e) = memra_codegen::build::generate(&req) {
        eprintln!("codegen/generate: SKIPPED ({e})");
        return;
    }
    c.bench_function("codegen/generate/glm-dsa", |b| {
        b.iter(|| memra_codegen::build::generate(&req).unwrap_or_else(|e| panic!("{e}")).files.len())
    });
}

/// `moe_decode/<specialized|generic>/glm5_t1_q4_k`: one GLM-5 MoE layer decode step for one
/// token — moe_router (sigmoid + exp_probs_b, top 8 of 256, renorm, ×2.5) on given router
/// logits, gate + up + SwiGLU of the 8 selected Q4_K experts (moe_matvec swiglu), down + the
/// routing-weighted sum (moe_matvec down) — the three launches back to back, timed between CUDA
/// events after an L2 flush. Throughput in bytes = the selected experts' weight bytes (8 × 3 ×
/// 7.08 MB). The stacked tensors (256 experts, 5.4 GB) are zeros: the selection and the bytes
/// read do not depend on the values. Specialized variants need `--features model-glm-dsa`.
fn moe_decode_gpu(c: &mut Criterion) {
    moe_decode(c, false);
}

/// `moe_decode/xq8_<specialized|generic>/glm5_t1_q4_k`: the `moe_decode` step with the integer
/// path — moe_router, quantize_q8 of x, gate + up + SwiGLU (moe_matvec swiglu, XQ8 = 1),
/// quantize_q8 of h, down + combine (XQ8 = 1): five launches, the two quantizations included.
/// The xq8 moe_matvec variants are rendered here (default tuning, as the glm-dsa spec's) until a
/// spec plans them. Same bytes, flush and zero experts as `moe_decode`.
fn moe_decode_xq8_gpu(c: &mut Criterion) {
    moe_decode(c, true);
}

/// [`moe_decode_gpu`], or with `xq8` [`moe_decode_xq8_gpu`].
fn moe_decode(c: &mut Criterion, xq8: bool) {
    use memra_engine::kernels::matvec::MatvecTuning;
    use memra_engine::kernels::moe_matvec::{self, Mode, MoeDims, MoeMatvecInputs};
    use memra_engine::kernels::registry::Param;
    use memra_engine::kernels::{moe_router, quantize_q8};
    use memra_gguf::GgmlType;
    let bench = if xq8 { "moe_decode/xq8" } else { "moe_decode" };
    let Ok(gpu) = Gpu::new(0) else {
        eprintln!("{bench}: SKIPPED (no CUDA device or driver on this machine)");
        return;
    };
    let (n_embd, n_ff, n_expert, n_used) = (6144usize, 2048usize, 256usize, 8usize);
    let ty = GgmlType::Q4_K;
    let pick = |family: &str, specialized: bool, want: &[(&str, Param)]| {
        registry::family(family)
            .into_iter()
            // Specialized: GLM-5's own variant; generic: the twin with no baked dims (not another
            // architecture's specialization).
            .find(|v| (if specialized { v.is_for("glm-dsa") } else { v.is_generic() }) && want.iter().all(|(k, p)| v.param(k) == Some(*p)))
    };
    let s = gpu.stream();
    let mut rng = Rng::from_env_or_time(&format!("{} bench", bench.replace('/', " ")));
    let logits = s.clone_htod(&rng.normal_vec(n_expert, 2.0)).expect("upload");
    let bias = s.clone_htod(&rng.normal_vec(n_expert, 0.01)).expect("upload");
    let x = s.clone_htod(&rng.normal_vec(n_embd, 1.0)).expect("upload");
    let rb = |k: usize| ty.row_bytes(k as u64).expect("whole blocks") as usize;
    let gate = s.alloc_zeros::<u8>(n_expert * n_ff * rb(n_embd)).expect("alloc experts");
    let up = s.alloc_zeros::<u8>(n_expert * n_ff * rb(n_embd)).expect("alloc experts");
    let down = s.alloc_zeros::<u8>(n_expert * n_embd * rb(n_ff)).expect("alloc experts");
    let mut ids = s.alloc_zeros::<i32>(n_used).expect("alloc");
    let mut wts = s.alloc_zeros::<f32>(n_used).expect("alloc");
    let mut h = s.alloc_zeros::<f32>(n_used * n_ff).expect("alloc");
    let mut out = s.alloc_zeros::<f32>(n_embd).expect("alloc");
    // The integer path's q8 copies of x and h, and its quantize_q8 variant.
    let mut q8 = if xq8 {
        let Some(vq) = registry::family(quantize_q8::FAMILY).into_iter().find(|v| v.is_generic()) else {
            eprintln!("{bench}: SKIPPED (no quantize_q8 variant in this build)");
            return;
        };
        let xq = quantize_q8::Q8Activation::new(s, n_embd, 1).expect("alloc q8 x");
        let hq = quantize_q8::Q8Activation::new(s, n_ff, n_used).expect("alloc q8 h");
        Some((vq, xq, hq))
    } else {
        None
    };
    let mut flush = s.alloc_zeros::<u8>(2 * bench::l2_bytes(&gpu)).expect("L2 flush buffer");
    let bytes = moe_matvec::selected_bytes(ty, Mode::Swiglu, n_embd, n_ff, n_used).expect("q4_k") as u64
        + moe_matvec::selected_bytes(ty, Mode::Down, n_ff, n_embd, n_used).expect("q4_k") as u64;
    let tune = MatvecTuning { xq8: true, ..MatvecTuning::default() };
    let render = |mode: Mode, k: usize, n: usize| -> &'static KernelVariant {
        let name: &'static str = Box::leak(format!("moe_matvec__k{k}_n{n}__q4_k_{}_xq8_bench", mode.token()).into_boxed_str());
        let mut params = vec![("qtype", Param::Sym("q4_k")), ("mode", Param::Sym(mode.token())), ("xq8", Param::Int(1))];
        if k > 0 {
            params.extend([("k", Param::Int(k as i64)), ("n", Param::Int(n as i64))]);
        }
        let source = Box::leak(moe_matvec::render_source(name, ty, mode, k, n, &tune).into_boxed_str());
        Box::leak(Box::new(KernelVariant { name, family: moe_matvec::FAMILY, arch: None, params: Box::leak(params.into_boxed_slice()), source }))
    };
    let (q4k, sig) = (Param::Sym("q4_k"), Param::Sym("sigmoid"));
    let prefix = if xq8 { "xq8_" } else { "" };
    for (kind, specialized) in [("specialized", true), ("generic", false)] {
        let kind = format!("{prefix}{kind}");
        // The xq8 moe_matvec variants are rendered (no spec plans them yet).
        let experts = if xq8 {
            let (dk, dn) = if specialized { (n_embd, n_ff) } else { (0, 0) };
            Some((render(Mode::Swiglu, dk, dn), render(Mode::Down, dn, dk)))
        } else {
            let want = |mode| [("qtype", q4k), ("mode", Param::Sym(mode))];
            pick(moe_matvec::FAMILY, specialized, &want("swiglu")).zip(pick(moe_matvec::FAMILY, specialized, &want("down")))
        };
        let (Some(vr), Some((vg, vd))) = (pick(moe_router::FAMILY, specialized, &[("gating", sig)]), experts) else {
            eprintln!("moe_decode/{kind}: SKIPPED (variants not in this build)");
            continue;
        };
        let mut vs = vec![vr, vg, vd];
        vs.extend(q8.as_ref().map(|(vq, _, _)| *vq));
        let kernels = gpu.load(&vs).unwrap_or_else(|e| panic!("{e}"));
        let get = |v: &KernelVariant| kernels.get(v.name).unwrap_or_else(|e| panic!("{e}"));
        let (kr, kg, kd) = (get(vr), get(vg), get(vd));
        let kq = q8.as_ref().map(|(vq, _, _)| get(vq));
        let mut group = c.benchmark_group(format!("moe_decode/{kind}"));
        group.throughput(Throughput::Bytes(bytes));
        group.sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
        group.bench_function("glm5_t1_q4_k", |b| {
            b.iter_custom(|iters| {
                let mut launch = |_: usize| -> Result<(), memra_engine::cuda::Error> {
                    let bv = bias.as_view();
                    moe_router::moe_router(kr, &logits.as_view(), Some(&bv), &mut ids.as_view_mut(), &mut wts.as_view_mut(), 1, n_expert, n_used, true, 2.5)?;
                    if let (Some(kq), Some((_, xq, _))) = (kq, q8.as_mut()) {
                        xq.quantize(kq, &x.as_view(), 1, n_embd)?;
                    }
                    let (xv, ldx) = q8.as_ref().map_or((x.as_view(), n_embd), |(_, xq, _)| (xq.view(), xq.ld()));
                    let (iv, gv, uv) = (ids.as_view(), gate.as_view(), up.as_view());
                    let dims = MoeDims { k: n_embd, n: n_ff, n_tokens: 1, n_used, n_expert, ldx, ldy: n_ff };
                    let inp = MoeMatvecInputs { w: &gv, w_up: Some(&uv), ids: &iv, weights: None, x: &xv };
                    moe_matvec::moe_matvec(kg, &inp, &mut h.as_view_mut(), dims)?;
                    if let (Some(kq), Some((_, _, hq))) = (kq, q8.as_mut()) {
                        hq.quantize(kq, &h.as_view(), n_used, n_ff)?;
                    }
                    let (hv, ldh) = q8.as_ref().map_or((h.as_view(), n_ff), |(_, _, hq)| (hq.view(), hq.ld()));
                    let (dv, wv) = (down.as_view(), wts.as_view());
                    let inp = MoeMatvecInputs { w: &dv, w_up: None, ids: &iv, weights: Some(&wv), x: &hv };
                    let dims = MoeDims { k: n_ff, n: n_embd, ldx: ldh, ldy: n_embd, ..dims };
                    moe_matvec::moe_matvec(kd, &inp, &mut out.as_view_mut(), dims)
                };
                let us = bench::time_launches(&gpu, 1, iters as u32, &mut flush, &mut launch).unwrap_or_else(|e| panic!("moe_decode/{kind}: {e}"));
                Duration::from_secs_f64(us.iter().sum::<f64>() / 1e6)
            })
        });
        group.finish();
    }
}

criterion_group!(gpu, gpu_kernels, attn_prefill_gpu, dsa_decode_gpu, moe_decode_gpu, moe_decode_xq8_gpu);
criterion_group!(cpu, nvrtc_compile, codegen_generate);
criterion_main!(gpu, cpu);
