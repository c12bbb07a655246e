//! CPU emulation of mla_rope (templates/memra/mla_rope.cuh): the template compiled as host C++ on
//! std::threads (emu_common), run on fresh random inputs (seed printed; replay with
//! `MEMRA_SEED=<seed>`) and compared with memra-reference: the latent row with `rms_norm`, k_pe
//! and q_pe with `models::Yarn` (plain and YaRN frequencies, interleaved and NeoX pairs), the
//! indexer queries with `rope_head` then the scale; NaN-poisoned outputs, rows of positions no
//! token has left untouched, an out-of-range position writing no row and NaN q tails.
//! Specialized (micro and GLM-5 dims) and generic variants, bf16 and f32 caches. Skips (one SKIP
//! line) without a C++20 compiler.

mod emu_common;

use emu_common::{cut, f32_bytes, i32_bytes, read_f32, template, Builder};
use memra_reference::models::Yarn;
use memra_reference::norm::rms_norm;
use memra_reference::rope::{rope_head, Rope, RopeMode};
use memra_reference::{rel_err, Rng};

const EXTRA: &str = r#"
#define __shared__ static
#define __global__
#define __launch_bounds__(x)
struct float2 { float x, y; };
static inline float2 make_float2(float a, float b) { return float2{a, b}; }
// glibc's math.h declares __sincosf (extern, noexcept): define that declaration.
void __sincosf(float x, float* s, float* c) noexcept { *s = std::sin(x); *c = std::cos(x); }
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
static inline double __hiloint2double(int hi, int lo) { uint64_t b = ((uint64_t)(unsigned)hi << 32) | (unsigned)lo; double d; memcpy(&d, &b, 8); return d; }
namespace memra {
enum class CacheType : int { F32 = 0, BF16 = 1 };
enum class RopeMode : int { None = 0, Interleaved = 1, Neox = 2 };
inline u16 f32_to_bf16(float f) { u32 u; memcpy(&u, &f, 4); return (u16)((u + 0x7fff + ((u >> 16) & 1)) >> 16); }
constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
}
"#;

const MAIN: &str = r#"
using namespace memra;
template <int NH, int NOPE_, int RP, int KVL, RopeMode M, CacheType C, int TH> struct RCfg {
    static constexpr int N_HEAD = NH, NOPE = NOPE_, ROPE = RP, KV_LORA = KVL;
    static constexpr RopeMode ROPE_MODE = M; static constexpr CacheType CACHE_T = C; static constexpr int THREADS = TH; };
// args: cfg n_tokens n_head nope rope kv_lora n_idx_head idx_head_dim max_ctx grid parts
//       base freq_scale ext_factor corr_low corr_high idx_q_scale eps | q kv w pos iq | q_out cache iq_out
template <class K> void run(int* a, float* s, int eb, char** f) {
    int T = a[0], nh = a[1], nope = a[2], rope = a[3], kvl = a[4], nih = a[5], dih = a[6], max_ctx = a[7], grid = a[8], parts = a[9];
    auto q = slurp(f[0]), kv = slurp(f[1]), w = slurp(f[2]), pos = slurp(f[3]), iq = slurp(f[4]);
    std::vector<float> q_out((size_t)T * nh * (kvl + rope), NAN);
    std::vector<unsigned char> cache((size_t)max_ctx * (kvl + rope) * eb, 0xff);
    run_grid({(unsigned)grid, (unsigned)parts, 1}, K::THREADS, 0, [&] {
        mla_rope_impl<K>((const float*)q.data(), q_out.data(), (const float*)kv.data(), (const float*)w.data(),
                         (const int*)pos.data(), cache.data(), (float*)iq.data(), T, nh, nope, rope, kvl, nih, dih,
                         max_ctx, s[0], s[1], s[2], s[3], s[4], s[5], s[6]); });
    spit(f[5], q_out.data(), q_out.size() * 4);
    spit(f[6], cache.data(), cache.size());
    spit(f[7], iq.data(), iq.size());
}
int main(int argc, char** argv) {
    using B = CacheType; using R = RopeMode;
    int cfg = atoi(argv[1]);
    int a[10]; for (int i = 0; i < 10; ++i) a[i] = atoi(argv[2 + i]);
    float s[7]; for (int i = 0; i < 7; ++i) s[i] = (float)atof(argv[12 + i]);
    char** f = argv + 19;
    switch (cfg) {
    case 0: run<RCfg<4, 32, 16, 128, R::Interleaved, B::BF16, 128>>(a, s, 2, f); break;
    case 1: run<RCfg<0, 0, 0, 0, R::Interleaved, B::F32, 128>>(a, s, 4, f); break;
    case 2: run<RCfg<0, 0, 0, 0, R::Neox, B::BF16, 64>>(a, s, 2, f); break;
    case 3: run<RCfg<64, 192, 64, 512, R::Interleaved, B::BF16, 128>>(a, s, 2, f); break;
    default: return 4;
    }
    return 0;
}
"#;

fn emulator_source() -> String {
    let common = template("common.cuh");
    let parts = [
        (
            "// Store one f32 as the cache element type.",
            "// Compile-time-or-run-time dims",
        ),
        ("// 2^x in f64", "// Reductions."),
        (
            "__device__ __forceinline__ float warp_sum(",
            "__device__ __forceinline__ float warp_max(",
        ),
        ("// Block-wide sum over THREADS threads", "// Arg-keys:"),
    ]
    .map(|(a, b)| cut(&common, a, b, "common.cuh"))
    .join("\n");
    let rope = template("mla_rope.cuh")
        .replace("#pragma once", "")
        .replace("#include \"memra/common.cuh\"", "");
    let prelude = emu_common::PRELUDE.replace(
        "static inline float __expf(float x) { return std::exp(x); }",
        "",
    );
    format!(
        "{prelude}\n{EXTRA}\n{}\nnamespace memra {{\n{parts}\n}}\n{rope}\n{MAIN}",
        emu_common::GRID_RUNNER
    )
}

/// The RoPE frequencies of one case: plain (linear scale) or YaRN.
#[derive(Clone, Copy)]
struct Freqs {
    base: f32,
    freq_scale: f32,
    yarn_ctx: Option<usize>,
}

impl Freqs {
    fn reference(&self, rope: usize, neox: bool) -> Yarn {
        let mut y = Yarn::new(rope, self.base, self.freq_scale, self.yarn_ctx.unwrap_or(1));
        if self.yarn_ctx.is_none() {
            y.ext_factor = 0.0;
        }
        y.interleaved = !neox;
        y
    }
}

struct Case {
    cfg: usize,
    n_head: usize,
    nope: usize,
    rope: usize,
    kv_lora: usize,
    n_idx_head: usize,
    idx_head_dim: usize,
    max_ctx: usize,
    grid: usize,
    /// Blocks per token (grid y).
    parts: usize,
    positions: Vec<i32>,
    freqs: Freqs,
    neox: bool,
    f32_cache: bool,
}

fn run_case(b: &mut Builder, rng: &mut Rng, c: &Case, n: usize) {
    let bin = b.get(Vec::new());
    let t = c.positions.len();
    let (dq, dk) = (c.nope + c.rope, c.kv_lora + c.rope);
    let q = rng.normal_vec(t * c.n_head * dq, 1.0);
    // An offset so that the RMS matters.
    let kv: Vec<f32> = rng
        .normal_vec(t * dk, 1.0)
        .iter()
        .map(|v| v + 0.3)
        .collect();
    let w: Vec<f32> = rng
        .normal_vec(c.kv_lora, 0.2)
        .iter()
        .map(|v| v + 1.0)
        .collect();
    let iq = rng.normal_vec((t * c.n_idx_head * c.idx_head_dim).max(1), 1.0);
    let (eps, idx_scale) = (1e-5f32, 0.125f32);
    let y = c.freqs.reference(c.rope, c.neox);
    let dir = b.dir().join(format!("case{n}"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut args: Vec<String> = [
        c.cfg,
        t,
        c.n_head,
        c.nope,
        c.rope,
        c.kv_lora,
        c.n_idx_head,
        c.idx_head_dim,
        c.max_ctx,
        c.grid,
        c.parts,
    ]
    .iter()
    .map(|v| v.to_string())
    .collect();
    args.extend(
        [
            c.freqs.base,
            c.freqs.freq_scale,
            y.ext_factor,
            y.corr_dims[0],
            y.corr_dims[1],
            idx_scale,
            eps,
        ]
        .iter()
        .map(|v| format!("{v:e}")),
    );
    let inputs = [
        f32_bytes(&q),
        f32_bytes(&kv),
        f32_bytes(&w),
        i32_bytes(&c.positions),
        f32_bytes(&iq),
    ];
    for (i, data) in inputs.iter().enumerate() {
        let p = dir.join(format!("in{i}.bin"));
        std::fs::write(&p, data).unwrap();
        args.push(p.display().to_string());
    }
    let outs: Vec<_> = (0..3).map(|i| dir.join(format!("out{i}.bin"))).collect();
    args.extend(outs.iter().map(|p| p.display().to_string()));
    emu_common::run(&bin, &args);

    let q_out = read_f32(&outs[0]);
    let raw = std::fs::read(&outs[1]).unwrap();
    let iq_out = read_f32(&outs[2]);
    let eb = if c.f32_cache { 4 } else { 2 };
    assert_eq!(raw.len(), c.max_ctx * dk * eb, "cache size");
    let row = |r: usize| -> Vec<f32> {
        raw[r * dk * eb..(r + 1) * dk * eb]
            .chunks_exact(eb)
            .map(|x| {
                if eb == 4 {
                    f32::from_le_bytes([x[0], x[1], x[2], x[3]])
                } else {
                    f32::from_bits((u16::from_le_bytes([x[0], x[1]]) as u32) << 16)
                }
            })
            .collect()
    };
    let what = format!(
        "mla_rope emulation cfg {} (MEMRA_SEED={})",
        c.cfg,
        rng.seed()
    );
    let tol = if c.f32_cache { 2e-6 } else { 4e-3 };
    let mut written = vec![false; c.max_ctx];
    for (ti, &p) in c.positions.iter().enumerate() {
        let tail = |h: usize| &q_out[(ti * c.n_head + h) * dk + c.kv_lora..][..c.rope];
        if p < 0 || p as usize >= c.max_ctx {
            assert!(
                (0..c.n_head).all(|h| tail(h).iter().all(|v| v.is_nan())),
                "{what}: token {ti} at invalid position {p}: q tails not NaN"
            );
            continue;
        }
        let p = p as usize;
        written[p] = true;
        let mut want = rms_norm(&kv[ti * dk..][..c.kv_lora], &w, eps);
        let mut k_pe = kv[ti * dk + c.kv_lora..][..c.rope].to_vec();
        y.apply(&mut k_pe, p);
        want.extend(k_pe);
        let err = rel_err(&row(p), &want);
        assert!(
            err <= tol,
            "{what}: token {ti} pos {p}: cache row relative L2 {err:e}"
        );
        for h in 0..c.n_head {
            let mut want = q[(ti * c.n_head + h) * dq + c.nope..][..c.rope].to_vec();
            y.apply(&mut want, p);
            let err = rel_err(tail(h), &want);
            assert!(
                err <= 2e-6,
                "{what}: token {ti} head {h}: q_pe relative L2 {err:e}"
            );
            assert!(
                q_out[(ti * c.n_head + h) * dk..][..c.kv_lora]
                    .iter()
                    .all(|v| v.is_nan()),
                "{what}: q_out's absorbed part written"
            );
        }
        let mode = if c.neox {
            RopeMode::Neox
        } else {
            RopeMode::Norm
        };
        for h in 0..c.n_idx_head {
            let at = (ti * c.n_idx_head + h) * c.idx_head_dim;
            let mut want = iq[at..][..c.idx_head_dim].to_vec();
            rope_head(
                &mut want[..c.rope],
                p,
                &Rope::new(mode, c.rope, c.freqs.base),
            );
            want.iter_mut().for_each(|v| *v *= idx_scale);
            let err = rel_err(&iq_out[at..][..c.idx_head_dim], &want);
            assert!(
                err <= 2e-6,
                "{what}: token {ti} indexer head {h}: relative L2 {err:e}"
            );
        }
    }
    for r in (0..c.max_ctx).filter(|&r| !written[r]) {
        assert!(
            raw[r * dk * eb..(r + 1) * dk * eb]
                .iter()
                .all(|&x| x == 0xff),
            "{what}: row {r} written but no token has that position"
        );
    }
}

#[test]
fn mla_rope_matches_the_reference() {
    let Some(mut b) = Builder::new(
        "mla_rope_matches_the_reference",
        "mla-rope",
        &emulator_source(),
    ) else {
        return;
    };
    let mut rng = Rng::from_env_or_time("mla_rope_matches_the_reference");
    eprintln!("mla_rope_matches_the_reference: seed {}", rng.seed());
    let plain = Freqs {
        base: 1e6,
        freq_scale: 1.0,
        yarn_ctx: None,
    };
    let yarn = Freqs {
        base: 1e4,
        freq_scale: 1.0 / 40.0,
        yarn_ctx: Some(4096),
    };
    let cases = [
        // Micro glm-dsa dims: indexer 8 × 32, a token past max_ctx, more tokens than blocks.
        Case {
            cfg: 0,
            n_head: 4,
            nope: 32,
            rope: 16,
            kv_lora: 128,
            n_idx_head: 8,
            idx_head_dim: 32,
            max_ctx: 12,
            grid: 2,
            parts: 3,
            positions: vec![0, 5, 11, 12, 3],
            freqs: plain,
            neox: false,
            f32_cache: false,
        },
        // Generic, f32 cache, deepseek2-like YaRN, no indexer, awkward sizes.
        Case {
            cfg: 1,
            n_head: 3,
            nope: 20,
            rope: 12,
            kv_lora: 200,
            n_idx_head: 0,
            idx_head_dim: 0,
            max_ctx: 9000,
            grid: 3,
            parts: 1,
            positions: vec![7, 4095, 8191, 8999],
            freqs: yarn,
            neox: false,
            f32_cache: true,
        },
        // Generic NeoX pairs, bf16, indexer with a nope tail, large positions.
        Case {
            cfg: 2,
            n_head: 5,
            nope: 16,
            rope: 8,
            kv_lora: 96,
            n_idx_head: 2,
            idx_head_dim: 24,
            max_ctx: 70_000,
            grid: 1,
            parts: 4,
            positions: vec![69_999, 65_537, -1],
            freqs: plain,
            neox: true,
            f32_cache: false,
        },
        // GLM-5 dims (specialized), plain RoPE base 1e6, indexer 32 × 128.
        Case {
            cfg: 3,
            n_head: 64,
            nope: 192,
            rope: 64,
            kv_lora: 512,
            n_idx_head: 32,
            idx_head_dim: 128,
            max_ctx: 3000,
            grid: 2,
            // The launcher's count at 128 threads: 64 heads · 32 pairs / 128.
            parts: memra_engine::kernels::mla_rope::parts(128, 64, 64),
            positions: vec![2047, 2999],
            freqs: plain,
            neox: false,
            f32_cache: false,
        },
    ];
    for (n, c) in cases.iter().enumerate() {
        run_case(&mut b, &mut rng, c, n);
        eprintln!(
            "mla_rope emulation cfg {}: {} tokens pass",
            c.cfg,
            c.positions.len()
        );
    }
}
