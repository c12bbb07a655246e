//! CPU emulation of combine_matvec (templates/memra/combine_matvec.cuh on matvec.cuh's
//! streaming core): the template compiled as host C++ on std::threads (engine/tests/emu_common),
//! blocks one after another, against memra-reference on fresh random split partials (seed
//! printed; replay with `MEMRA_SEED=<seed>`), NaN-poisoned outputs and output padding. Partials
//! as attn_decode leaves them for one sequence: per head and split an unnormalized accumulator,
//! a running max in base 2 and a sum, with splits that saw no key (max −inf, sum 0, accumulator
//! 0) mixed in, and heads with no key at all (their combined row is 0). For several weight types,
//! head sizes and split counts (1, awkward, up to 40): specialized (K, N, HEAD_DIM baked, one
//! block per tile) and generic (two blocks walking every tile). `y` within 1e-4 relative L2 of
//! `matvec(W, combine(partials))` (the combine in f64). Says nothing about speed. Skips (one SKIP
//! line) without a C++20 compiler.

mod emu_common;

use emu_common::{Builder, GRID_RUNNER, NORM_HOST, PRELUDE, f32_bytes, read_f32};
use memra_engine::kernels::attn_decode;
use memra_gguf::{GgmlType, quant};
use memra_reference::{Rng, linear, rel_err};

const TOL: f64 = 1e-4;

const DRIVER: &str = r#"
using namespace memra;
#ifndef SPEC
#define SPEC 0
#endif
template <int KD, int ND, int HDD> struct CCfg {
    static constexpr int K = KD, N = ND, HEAD_DIM = HDD; static constexpr QType QTYPE = QType::QT;
    static constexpr int THREADS = 128, LANES = 16, ROWS_PER_GROUP = 2, STAGES = 3, MAX_SPLITS = 32; };
// args: k n head_dim n_split grid_x_max w work y(in/out)
template <class C> int cm(char** a) {
    int k = atoi(a[0]), n = atoi(a[1]), hd = atoi(a[2]), n_split = atoi(a[3]), gx_max = atoi(a[4]);
    auto w = slurp(a[5]), work = slurp(a[6]), y = slurp(a[7]);
    auto* wp = aligned_copy<unsigned char>(w); auto* workp = aligned_copy<float>(work); auto* yp = aligned_copy<float>(y);
    using G = MatvecGeometry<NormMatvecGeometryCfg<C>>;
    Dim3 grid{(unsigned)std::min((n + G::ROWS - 1) / G::ROWS, gx_max), 1, 1};
    run_grid(grid, C::THREADS, G::SMEM + NormMatvecGeometry<C>::xrow_bytes(k), [&] {
        combine_matvec_impl<C>(wp, workp, yp, k, n, hd, n_split); });
    spit(a[7], yp, y.size());
    return 0; }
int main(int argc, char** argv) {
    bool spec = std::string(argv[1]) == "spec"; char** a = argv + 2;
#if SPEC
    if (spec) return cm<CCfg<KDIM, NDIM, HDIM>>(a);
#endif
    return cm<CCfg<0, 0, 0>>(a); }
"#;

/// Host stand-ins beyond emu_common's prelude (and its NORM_HOST, which norm_matvec.cuh's
/// prologue names): L2 loads and the atomic that attn_decode.cuh's helpers name.
const HOST_EXTRA: &str = r#"
struct float2 { float x, y; };
template <class T> inline T __ldcg(const T* p) { return *p; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p = o + v; return o; }
"#;

fn emulator_source() -> String {
    let attn = emu_common::template("attn_decode.cuh");
    let neg_inf = emu_common::cut(&attn, "__device__ __forceinline__ float neg_inf()", "template <CacheType C> struct CacheTraits;", "attn_decode.cuh");
    let merge = emu_common::cut(&attn, "// a·w + c, per component.", "// Up to PREFETCH_ROWS", "attn_decode.cuh");
    let attn_helpers = format!("namespace memra {{ namespace attn_detail {{\n{neg_inf}\n{merge}\n}} }}\n");
    let reductions = emu_common::warp_reductions();
    let glu = emu_common::glu_activations();
    let moe_body = emu_common::template_body("moe_matvec.cuh", "#define MEMRA_DEFINE_MOE_MATVEC");
    let nm_body = emu_common::template_body("norm_matvec.cuh", "#define MEMRA_DEFINE_NORM_MATVEC");
    let cm_body = emu_common::template_body("combine_matvec.cuh", "#define MEMRA_DEFINE_COMBINE_MATVEC");
    format!(
        "{PRELUDE}#include <algorithm>\n#include <string>\n{HOST_EXTRA}{NORM_HOST}namespace memra {{\n{reductions}\n{glu}\n}}\n{}{moe_body}{nm_body}{attn_helpers}{cm_body}{GRID_RUNNER}{DRIVER}",
        emu_common::matvec_host_body()
    )
}

/// (type, head_dim, n_head, N, specialized): K = n_head·head_dim whole blocks; N not a multiple
/// of the 16-row tile. Gemma 3's o-projection (4 heads of 256 → 640) among them.
const CASES: [(GgmlType, usize, usize, usize, bool); 6] = [
    (GgmlType::Q5_0, 256, 4, 72, true),
    (GgmlType::Q8_0, 128, 3, 40, true),
    (GgmlType::Q4_K, 256, 3, 56, false),
    (GgmlType::Q6_K, 64, 4, 24, false),
    (GgmlType::BF16, 64, 5, 40, false),
    (GgmlType::F32, 128, 2, 24, true),
];

/// attn_decode's workspace of one sequence after a launch for partials: counters (left at 0),
/// acc `[n_head][n_split][hd]`, (m, l) `[n_head][n_split][2]`; and the rows they combine to.
fn partials(rng: &mut Rng, n_head: usize, hd: usize, n_split: usize) -> (Vec<f32>, Vec<f32>) {
    let ctr = n_head.next_multiple_of(4);
    let mut work = vec![0.0f32; attn_decode::work_floats(1, n_head, hd, n_split)];
    let ml0 = ctr + n_head * n_split * hd;
    let mut rows = vec![0.0f32; n_head * hd];
    for h in 0..n_head {
        // The last head of a few cases saw no key in any split.
        let blind = h == n_head - 1 && n_split % 3 == 1;
        let mut ms = Vec::new();
        for s in 0..n_split {
            let part = h * n_split + s;
            let empty = blind || (n_split > 2 && rng.uniform_in(0.0, 1.0) < 0.2);
            let (m, l) = if empty { (f32::NEG_INFINITY, 0.0) } else { (rng.uniform_in(-30.0, 30.0), rng.uniform_in(0.5, 40.0)) };
            work[ml0 + 2 * part] = m;
            work[ml0 + 2 * part + 1] = l;
            for d in 0..hd {
                work[ctr + part * hd + d] = if empty { 0.0 } else { rng.uniform_in(-1.0, 1.0) * l };
            }
            ms.push(m);
        }
        let big = ms.iter().copied().fold(f64::NEG_INFINITY, |a, m| a.max(m as f64));
        let wts: Vec<f64> = ms.iter().map(|&m| if m == f32::NEG_INFINITY { 0.0 } else { (m as f64 - big).exp2() }).collect();
        let sum: f64 = (0..n_split).map(|s| wts[s] * work[ml0 + 2 * (h * n_split + s) + 1] as f64).sum();
        for d in 0..hd {
            let a: f64 = (0..n_split).map(|s| wts[s] * work[ctr + (h * n_split + s) * hd + d] as f64).sum();
            rows[h * hd + d] = if sum > 0.0 { (a / sum) as f32 } else { 0.0 };
        }
    }
    (work, rows)
}

#[test]
fn combine_matvec_emulated_on_host_threads_matches_reference() {
    let test = "combine_matvec_emulated_on_host_threads_matches_reference";
    let Some(mut b) = Builder::new(test, "combine-matvec", &emulator_source()) else {
        return;
    };
    let mut rng = Rng::from_env_or_time(test);
    let seed = rng.seed();
    for (ty, hd, n_head, n, spec) in CASES {
        let k = n_head * hd;
        let mut defines = vec![format!("QT={}", ty.name()), format!("KDIM={k}"), format!("NDIM={n}"), format!("HDIM={hd}")];
        if spec {
            defines.push("SPEC=1".into());
        }
        let bin = b.get(defines);
        let w = quant::quantize(ty, &rng.normal_vec(n * k, 1.0)).unwrap();
        for n_split in [1, 4, 7, 16, 40] {
            let (work, rows) = partials(&mut rng, n_head, hd, n_split);
            let want = linear::matvec_gguf(ty, &w, k, n, &rows).unwrap();
            for spec_run in if spec { vec![true, false] } else { vec![false] } {
                let grid_x_max = if spec_run { 1 << 20 } else { 2 };
                let what = format!("{ty:?} hd={hd} heads={n_head} n={n} n_split={n_split} spec={spec_run} grid.x<={grid_x_max} (MEMRA_SEED={seed})");
                let dir = b.dir().to_path_buf();
                let files = ["w", "work", "y"].map(|f| dir.join(format!("{f}.bin")));
                std::fs::write(&files[0], &w).unwrap();
                std::fs::write(&files[1], f32_bytes(&work)).unwrap();
                std::fs::write(&files[2], f32_bytes(&vec![f32::NAN; n + 5])).unwrap();
                let mut args: Vec<String> = vec![if spec_run { "spec" } else { "gen" }.into()];
                args.extend([k, n, hd, n_split, grid_x_max].map(|v| v.to_string()));
                args.extend(files.iter().map(|f| f.display().to_string()));
                emu_common::run(&bin, &args);
                let y = read_f32(&files[2]);
                let err = rel_err(&y[..n], &want);
                assert!(err <= TOL, "{what}: y rel L2 {err:e} > {TOL:e}");
                assert!(y[n..].iter().all(|v| v.is_nan()), "{what}: y written past n");
            }
        }
    }
}
