//! CPU emulation of norm_matvec (templates/memra/norm_matvec.cuh on matvec.cuh's streaming core):
//! the template compiled as host C++ on std::threads (engine/tests/emu_common), blocks one after
//! another, against memra-reference on fresh random inputs (seed printed; replay with
//! `MEMRA_SEED=<seed>`), NaN-poisoned outputs and output padding. For each weight type: the
//! three GLU modes (none, swiglu, geglu) × the three residual forms (no add, `x + delta`,
//! `x + rmsnorm(delta)·delta_w`), x_out written or left alone, specialized (K, N baked, one block
//! per tile) and generic (two blocks walking every tile: the resident grid's path); three cases
//! on the integer path (XQ8 = 1: h quantized in shared memory; the oracle on h's q8 round trip,
//! either rounding accepted for elements within f32 rounding of a half step). `y` within
//! 1e-4 relative L2 of `matvec(W, rms_norm(r)·norm_w)` (f64 norms in the oracle, f32 in the
//! kernel); `x_out` within 1e-6 of `r`, and untouched (still NaN) when not asked for. Says
//! nothing about speed. Skips (one SKIP line) without a C++20 compiler.

mod emu_common;

use emu_common::{Builder, GRID_RUNNER, NORM_HOST, PRELUDE, f32_bytes, read_f32};
use memra_gguf::{GgmlType, quant};
use memra_reference::{Rng, act, linear, norm, q8, rel_err};

const TOL: f64 = 1e-4;
const EPS: f32 = 1e-6;

const DRIVER: &str = r#"
using namespace memra;
#ifndef SPEC
#define SPEC 0
#endif
#ifndef XQ8V
#define XQ8V 0
#endif
template <int KD, int ND, Glu A> struct NCfg {
    static constexpr int K = KD, N = ND; static constexpr QType QTYPE = QType::QT; static constexpr Glu GLU = A;
    static constexpr int THREADS = 128, LANES = 16, ROWS_PER_GROUP = 2, STAGES = 3, XQ8 = XQ8V; };
// args: k n flags grid_x_max eps w w_up x delta delta_w norm_w x_out(in/out) y(in/out)
template <class C> int nm(char** a) {
    int k = atoi(a[0]), n = atoi(a[1]), flags = atoi(a[2]), gx_max = atoi(a[3]); float eps = (float)atof(a[4]);
    auto w = slurp(a[5]), wu = slurp(a[6]), x = slurp(a[7]), d = slurp(a[8]), dw = slurp(a[9]), nw = slurp(a[10]);
    auto xo = slurp(a[11]), y = slurp(a[12]);
    auto* wp = aligned_copy<unsigned char>(w); auto* wup = aligned_copy<unsigned char>(wu);
    auto* xp = aligned_copy<float>(x); auto* dp = aligned_copy<float>(d); auto* dwp = aligned_copy<float>(dw);
    auto* nwp = aligned_copy<float>(nw); auto* xop = aligned_copy<float>(xo); auto* yp = aligned_copy<float>(y);
    using G = MatvecGeometry<NormMatvecGeometryCfg<C>>;
    const int tile_rows = C::GLU != Glu::None ? 2 * n : n;
    Dim3 grid{(unsigned)std::min((tile_rows + G::ROWS - 1) / G::ROWS, gx_max), 1, 1};
    run_grid(grid, C::THREADS, G::SMEM + NormMatvecGeometry<C>::xrow_bytes(k), [&] {
        norm_matvec_impl<C>(wp, wup, xp, dp, dwp, nwp, xop, yp, k, n, flags, eps); });
    spit(a[11], xop, xo.size());
    spit(a[12], yp, y.size());
    return 0; }
int main(int argc, char** argv) {
    std::string what = argv[1]; bool spec = std::string(argv[2]) == "spec"; char** a = argv + 3;
#if SPEC
    if (spec) {
        if (what == "none") return nm<NCfg<KDIM, NDIM, Glu::None>>(a);
        if (what == "swiglu") return nm<NCfg<KDIM, NDIM, Glu::Swiglu>>(a);
        if (what == "geglu") return nm<NCfg<KDIM, NDIM, Glu::Geglu>>(a);
    }
#endif
    if (what == "none") return nm<NCfg<0, 0, Glu::None>>(a);
    if (what == "swiglu") return nm<NCfg<0, 0, Glu::Swiglu>>(a);
    if (what == "geglu") return nm<NCfg<0, 0, Glu::Geglu>>(a);
    return 9; }
"#;


fn emulator_source() -> String {
    let reductions = emu_common::warp_reductions();
    let glu = emu_common::glu_activations();
    let moe_body = emu_common::template_body("moe_matvec.cuh", "#define MEMRA_DEFINE_MOE_MATVEC");
    let nm_body = emu_common::template_body("norm_matvec.cuh", "#define MEMRA_DEFINE_NORM_MATVEC");
    format!(
        "{PRELUDE}#include <algorithm>\n#include <string>\nnamespace memra {{\n{reductions}\n{glu}\n}}\n{NORM_HOST}{}{moe_body}{nm_body}{GRID_RUNNER}{DRIVER}",
        emu_common::matvec_host_body()
    )
}

/// Types and their (K, N): K whole blocks but not whole chunks (rows start misaligned), N not a
/// multiple of the 16-row tile. Q5_0 and Q8_0 also at Gemma 3's K = 640, specialized. The last
/// field: XQ8 = 1 (h quantized to q8 in shared memory, the integer path).
const CASES: [(GgmlType, usize, usize, bool, bool); 10] = [
    (GgmlType::Q5_0, 640, 72, true, false),
    (GgmlType::Q8_0, 640, 40, true, false),
    (GgmlType::Q4_K, 3 * 256, 56, true, false),
    (GgmlType::Q6_K, 3 * 256, 24, false, false),
    (GgmlType::Q4_0, 33 * 32, 40, false, false),
    (GgmlType::BF16, 296, 40, false, false),
    (GgmlType::F32, 296, 24, false, false),
    (GgmlType::Q8_0, 640, 40, true, true),
    (GgmlType::Q4_K, 3 * 256, 56, true, true),
    (GgmlType::Q6_K, 3 * 256, 24, false, true),
];

struct Run<'a> {
    glu: &'a str,
    spec: bool,
    k: usize,
    n: usize,
    flags: i32,
    grid_x_max: usize,
}

#[allow(clippy::too_many_arguments)]
fn launch(b: &mut Builder, defines: &[String], r: &Run<'_>, w: &[u8], w_up: &[u8], vecs: [&[f32]; 4], x_out: &[f32], y: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let bin = b.get(defines.to_vec());
    let dir = b.dir().to_path_buf();
    let files = ["w", "wu", "x", "d", "dw", "nw", "xo", "y"].map(|f| dir.join(format!("{f}.bin")));
    std::fs::write(&files[0], w).unwrap();
    std::fs::write(&files[1], w_up).unwrap();
    for (i, v) in vecs.iter().enumerate() {
        std::fs::write(&files[2 + i], f32_bytes(v)).unwrap();
    }
    std::fs::write(&files[6], f32_bytes(x_out)).unwrap();
    std::fs::write(&files[7], f32_bytes(y)).unwrap();
    let mut args: Vec<String> = vec![r.glu.into(), if r.spec { "spec" } else { "gen" }.into()];
    args.extend([r.k.to_string(), r.n.to_string(), r.flags.to_string(), r.grid_x_max.to_string(), format!("{EPS:e}")]);
    args.extend(files.iter().map(|f| f.display().to_string()));
    emu_common::run(&bin, &args);
    (read_f32(&files[6]), read_f32(&files[7]))
}

#[test]
fn norm_matvec_emulated_on_host_threads_matches_reference() {
    let test = "norm_matvec_emulated_on_host_threads_matches_reference";
    let Some(mut b) = Builder::new(test, "norm-matvec", &emulator_source()) else {
        return;
    };
    let mut rng = Rng::from_env_or_time(test);
    let seed = rng.seed();
    for (ty, k, n, spec, xq8) in CASES {
        let mut defines = vec![format!("QT={}", ty.name()), format!("KDIM={k}"), format!("NDIM={n}"), format!("XQ8V={}", xq8 as i32)];
        if spec {
            defines.push("SPEC=1".into());
        }
        let wg = quant::quantize(ty, &rng.normal_vec(n * k, 1.0)).unwrap();
        let wu = quant::quantize(ty, &rng.normal_vec(n * k, 1.0)).unwrap();
        // The residual stream is large next to a branch output, as in a model.
        let x = rng.normal_vec(k, 4.0);
        let delta = rng.normal_vec(k, 0.5);
        let delta_w: Vec<f32> = (0..k).map(|_| rng.uniform_in(0.5, 1.5)).collect();
        let norm_w: Vec<f32> = (0..k).map(|_| rng.uniform_in(0.5, 1.5)).collect();
        // (flags, the residual the kernel must see)
        let forms: [(i32, Vec<f32>); 3] = [
            (0, x.clone()),
            (1, x.iter().zip(&delta).map(|(a, d)| a + d).collect()),
            (3, {
                let dn = norm::rms_norm(&delta, &delta_w, EPS);
                x.iter().zip(&dn).map(|(a, d)| a + d).collect()
            }),
        ];
        for spec_run in if spec { vec![true, false] } else { vec![false] } {
            let grid_x_max = if spec_run { 1 << 20 } else { 2 };
            for (fi, (flags, r)) in forms.iter().enumerate() {
                let h_f32 = norm::rms_norm(r, &norm_w, EPS);
                let h = if xq8 { q8::quantize_q8_blocks(&h_f32).dequantize() } else { h_f32.clone() };
                let g = linear::matvec_gguf(ty, &wg, k, n, &h).unwrap();
                let u = linear::matvec_gguf(ty, &wu, k, n, &h).unwrap();
                // XQ8: the kernel's h is not bit-equal to ours; either q8 rounding of the elements
                // within f32 rounding of a half step is accepted (q8::near_half_steps).
                let flips = if xq8 { q8::near_half_steps(&h_f32) } else { Vec::new() };
                let cols: Vec<usize> = flips.iter().map(|f| f.0).collect();
                let cs = [linear::columns_gguf(ty, &wg, k, n, &cols).unwrap(), linear::columns_gguf(ty, &wu, k, n, &cols).unwrap()];
                for glu in ["none", "swiglu", "geglu"] {
                    // Alternate writing x_out so that every residual form is seen both ways.
                    let write_x = (fi + glu.len()) % 2 == 0 || *flags == 3;
                    let flags = flags | if write_x { 4 } else { 0 };
                    let what = format!("{glu} {ty:?} k={k} n={n} flags={flags} spec={spec_run} grid.x<={grid_x_max} (MEMRA_SEED={seed})");
                    let run = Run { glu, spec: spec_run, k, n, flags, grid_x_max };
                    let y0 = vec![f32::NAN; n + 5];
                    let xo0 = vec![f32::NAN; k + 3];
                    let (xo, y) = launch(&mut b, &defines, &run, &wg, &wu, [&x, &delta, &delta_w, &norm_w], &xo0, &y0);
                    let out = |o: &[Vec<f32>]| match glu {
                        "none" => o[0].clone(),
                        "swiglu" => act::swiglu(&o[0], &o[1]),
                        _ => act::geglu(&o[0], &o[1]),
                    };
                    let err = q8::min_over_flips(&[g.clone(), u.clone()], &cs, &flips, |o| rel_err(&y[..n], &out(o)));
                    let what = format!("{what} xq8={xq8}");
                    assert!(err <= TOL, "{what}: y rel L2 {err:e} > {TOL:e}");
                    assert!(y[n..].iter().all(|v| v.is_nan()), "{what}: y written past n");
                    assert!(xo[k..].iter().all(|v| v.is_nan()), "{what}: x_out written past k");
                    if write_x {
                        let err = rel_err(&xo[..k], r);
                        assert!(err <= 1e-6, "{what}: x_out rel L2 {err:e} > 1e-6");
                    } else {
                        assert!(xo.iter().all(|v| v.is_nan()), "{what}: x_out written without the flag");
                    }
                }
            }
        }
    }
}
