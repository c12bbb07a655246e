//! CPU emulation of the MoE kernels (moe_router, moe_matvec in its four modes): the templates
//! compiled as host C++ on std::threads (engine/tests/emu_common: barriers, shuffles,
//! synchronous cp.async), blocks run one after another, compared with memra-reference on fresh
//! random inputs (seed printed; replay with `MEMRA_SEED=<seed>`), NaN-poisoned outputs, padded
//! strides, fewer grid rows than slots and (generic variants) fewer grid columns than tiles
//! (grid-stride paths: a block walks several tiles with one pipeline) and an out-of-range expert id (its
//! outputs must be NaN, nothing else touched). Every QType generic; Q4_K, Q8_0 and Q6_K also
//! specialized. Dense gated FFNs as one expert (n_expert = n_used = 1, ids = [0]): Gemma 3's
//! geglu at 640 → 2048 Q5_0 and swiglu, specialized and generic. LANES 16 (the specs' variants
//! use 32): 32-row tiles, half-size chunks. Router ids must equal `moe::route`'s exactly (the
//! kernel computes the probabilities in f64 as the reference does); weights ≤ 1e-6 relative. Products: relative L2
//! ≤ 1e-4 (f32 arithmetic on the same dequantized values). Says nothing about speed. Skips
//! (one SKIP line) without a C++20 compiler.

mod emu_common;

use emu_common::{
    Builder, GRID_RUNNER, PRELUDE, cut, f32_bytes, i32_bytes, read_f32, read_i32, template,
};
use memra_gguf::{GgmlType, quant};
use memra_reference::moe::{Gating, RouterConfig, route};
use memra_reference::{Rng, act, linear, q8, rel_err};

const TOL: f64 = 1e-4;

const DRIVER: &str = r#"
using namespace memra;
#ifndef SPEC
#define SPEC 0
#endif
#ifndef XQ8V
#define XQ8V 0
#endif
template <int KD, int ND, MoeMode M, int A> struct MCfg {
    static constexpr int K = KD, N = ND; static constexpr QType QTYPE = QType::QT; static constexpr MoeMode MODE = M;
    static constexpr int THREADS = 256, LANES = 16, ROWS_PER_GROUP = 2, STAGES = 3, ACCUMULATE = A, XQ8 = XQ8V; };
template <int NE, int NU, Gating G> struct RCfg { static constexpr int N_EXPERT = NE, N_USED = NU; static constexpr Gating GATING = G; static constexpr int THREADS = 64; };
// args: k n n_tokens n_used n_expert ldx ldy grid_y_max grid_x_max w w_up ids weights x y(in/out)
template <class C> int moe(char** a) {
    int k = atoi(a[0]), n = atoi(a[1]), nt = atoi(a[2]), nu = atoi(a[3]), ne = atoi(a[4]), ldx = atoi(a[5]), ldy = atoi(a[6]), gy_max = atoi(a[7]), gx_max = atoi(a[8]);
    auto w = slurp(a[9]), wu = slurp(a[10]), ids = slurp(a[11]), wts = slurp(a[12]), x = slurp(a[13]), y = slurp(a[14]);
    auto* wp = aligned_copy<unsigned char>(w); auto* wup = aligned_copy<unsigned char>(wu);
    auto* xp = aligned_copy<float>(x); auto* yp = aligned_copy<float>(y);
    using G = MatvecGeometry<MoeMatvecGeometryCfg<C>>;
    int tile_rows = moe_detail::PAIRED_MODE<C::MODE> ? 2 * n : n, slots = C::MODE == MoeMode::Down ? nt : nt * nu;
    // gx_max < tiles: each block walks several tiles of its slot (the resident grid's path).
    Dim3 grid{(unsigned)std::min((tile_rows + G::ROWS - 1) / G::ROWS, gx_max), (unsigned)std::min(slots, gy_max), 1};
    const int xf_rows = C::MODE == MoeMode::Down ? nu : 1;  // XQ8 = 2: Down quantizes a row per slot
    run_grid(grid, C::THREADS, G::SMEM + (G::XQ8_FUSED ? xf_rows * G::xf_row(k) : 0), [&] {
        moe_matvec_impl<C>(wp, wup, (const int*)ids.data(), (const float*)wts.data(), xp, yp, k, n, nt, nu, ne, ldx, ldy); });
    spit(a[14], yp, y.size());
    return 0; }
// args: n_tokens n_expert n_used norm scale logits bias|- ids_out weights_out
template <class C> int router(char** a) {
    int nt = atoi(a[0]), ne = atoi(a[1]), nu = atoi(a[2]), norm = atoi(a[3]); float scale = (float)atof(a[4]);
    auto logits = slurp(a[5]); std::vector<unsigned char> bias; if (strcmp(a[6], "-") != 0) bias = slurp(a[6]);
    std::vector<int> ids(nt * nu, 12345); std::vector<float> wts(nt * nu, NAN);
    Dim3 grid{(unsigned)std::max(1, (nt + 1) / 2 / 2), 1, 1};  // fewer blocks than tokens: grid stride
    run_grid(grid, C::THREADS, 0, [&] {
        moe_router_impl<C>((const float*)logits.data(), bias.empty() ? nullptr : (const float*)bias.data(), ids.data(), wts.data(), nt, ne, nu, norm, scale); });
    spit(a[7], ids.data(), ids.size() * 4); spit(a[8], wts.data(), wts.size() * 4);
    return 0; }
int main(int argc, char** argv) {
    std::string what = argv[1]; bool spec = std::string(argv[2]) == "spec"; char** a = argv + 3;
    if (what == "router") {
        if (spec) return std::string(argv[3]) == "2" ? router<RCfg<NEXP, NUSED, Gating::Sigmoid>>(a + 1) : router<RCfg<NEXP, NUSED, Gating::Softmax>>(a + 1);
        return std::string(argv[3]) == "2" ? router<RCfg<0, 0, Gating::Sigmoid>>(a + 1) : router<RCfg<0, 0, Gating::Softmax>>(a + 1);
    }
#if SPEC
    if (spec) {
        if (what == "plain") return moe<MCfg<KDIM, NDIM, MoeMode::Plain, 0>>(a);
        if (what == "swiglu") return moe<MCfg<KDIM, NDIM, MoeMode::Swiglu, 0>>(a);
        if (what == "geglu") return moe<MCfg<KDIM, NDIM, MoeMode::Geglu, 0>>(a);
        if (what == "down") return moe<MCfg<NDIM, KDIM, MoeMode::Down, 0>>(a);
    }
#endif
    if (what == "plain") return moe<MCfg<0, 0, MoeMode::Plain, 0>>(a);
    if (what == "swiglu") return moe<MCfg<0, 0, MoeMode::Swiglu, 0>>(a);
    if (what == "geglu") return moe<MCfg<0, 0, MoeMode::Geglu, 0>>(a);
    if (what == "down") return moe<MCfg<0, 0, MoeMode::Down, 0>>(a);
    if (what == "down_acc") return moe<MCfg<0, 0, MoeMode::Down, 1>>(a);
    return 9; }
"#;

fn emulator_source() -> String {
    let common = template("common.cuh");
    let keys = cut(
        &common,
        "__device__ __forceinline__ u32 float_order_bits",
        "// Loads.",
        "common.cuh",
    );
    let reductions = emu_common::warp_reductions();
    // The gated activations moe_matvec shares with swiglu.cuh / geglu.cuh (not the row kernel).
    let glu = emu_common::glu_activations();
    let moe_body = emu_common::template_body("moe_matvec.cuh", "#define MEMRA_DEFINE_MOE_MATVEC");
    let router_body = emu_common::template_body("moe_router.cuh", "#define MEMRA_DEFINE_MOE_ROUTER");
    format!(
        "{PRELUDE}#include <algorithm>\n#include <string>\nnamespace memra {{\n{reductions}\n{keys}\n{glu}\n}}\n{}{moe_body}{router_body}{GRID_RUNNER}{DRIVER}",
        emu_common::matvec_host_body()
    )
}

const QTYPES: [GgmlType; 13] = [
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

const SPECIALIZED: [GgmlType; 3] = [GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::Q6_K];

/// Expert row lengths: whole blocks but not whole chunks, so rows start misaligned.
fn dims(ty: GgmlType) -> (usize, usize) {
    match ty.block_size() as usize {
        256 => (9 * 256, 256),
        32 => (33 * 32, 3 * 32),
        _ => (296, 104),
    }
}

struct Case {
    n_tokens: usize,
    n_used: usize,
    n_expert: usize,
    grid_y_max: usize,
}

/// `n_tokens·n_used` distinct-per-token ids in [0, n_expert).
fn random_ids(rng: &mut Rng, c: &Case) -> Vec<i32> {
    let mut ids = Vec::new();
    for _ in 0..c.n_tokens {
        let mut pool: Vec<i32> = (0..c.n_expert as i32).collect();
        for j in 0..c.n_used {
            let i = j + rng.below(c.n_expert - j);
            pool.swap(j, i);
            ids.push(pool[j]);
        }
    }
    ids
}

/// One expert's bytes of a stacked tensor.
fn expert(w: &[u8], e: usize, n: usize, rb: usize) -> &[u8] {
    &w[e * n * rb..][..n * rb]
}

#[allow(clippy::too_many_arguments)]
fn launch(
    b: &mut Builder,
    defines: &[String],
    mode: &str,
    spec: bool,
    d: [usize; 9],
    w: &[u8],
    w_up: &[u8],
    ids: &[i32],
    wts: &[f32],
    x: &[f32],
    y0: &[f32],
) -> Vec<f32> {
    let bin = b.get(defines.to_vec());
    let dir = b.dir().to_path_buf();
    let files = ["w", "wu", "ids", "wts", "x", "y"].map(|f| dir.join(format!("{f}.bin")));
    std::fs::write(&files[0], w).unwrap();
    std::fs::write(&files[1], w_up).unwrap();
    std::fs::write(&files[2], i32_bytes(ids)).unwrap();
    std::fs::write(&files[3], f32_bytes(wts)).unwrap();
    std::fs::write(&files[4], f32_bytes(x)).unwrap();
    std::fs::write(&files[5], f32_bytes(y0)).unwrap();
    let mut args: Vec<String> = vec![mode.into(), if spec { "spec" } else { "gen" }.into()];
    args.extend(d.iter().map(|v| v.to_string()));
    args.extend(files.iter().map(|f| f.display().to_string()));
    emu_common::run(&bin, &args);
    read_f32(&files[5])
}

/// Every QType × mode against per-expert `linear::matmul_gguf` (+ `act::swiglu`, + the f64
/// weighted sum), with one token's slot pointing at expert n_expert (out of range).
#[test]
fn moe_matvec_emulated_on_host_threads_matches_reference() {
    moe_modes_match_reference("moe_matvec_emulated_on_host_threads_matches_reference", 0);
}

/// The integer path (XQ8 = 1) for every type that has it: x and h as q8 rows (the layout
/// quantize_q8 writes, from `memra_reference::q8`, padded strides), every mode against
/// `q8::matmul_gguf_q8` per expert (x quantized the same way, per-block integer products in
/// f64). Only f32 rounding of scale products and accumulation order differ: the same 1e-4.
#[test]
fn moe_matvec_xq8_emulated_on_host_threads_matches_q8_reference() {
    moe_modes_match_reference(
        "moe_matvec_xq8_emulated_on_host_threads_matches_q8_reference",
        1,
    );
}

/// XQ8 = 2: f32 x, each block quantizes its slot's x row (down: its token's n_used h rows)
/// into shared memory, against the same q8 oracle and tolerance.
#[test]
fn moe_matvec_xq8_fused_emulated_on_host_threads_matches_q8_reference() {
    moe_modes_match_reference(
        "moe_matvec_xq8_fused_emulated_on_host_threads_matches_q8_reference",
        2,
    );
}

/// Rows `[rows][ld]` (`k` used) for the kernel's x: as they are, or (xq8) as q8 rows
/// `[rows][row_floats(k) + 4]`; returns the buffer and its stride in floats.
fn device_rows(xq8: bool, v: &[f32], rows: usize, k: usize, ld: usize) -> (Vec<f32>, usize) {
    if !xq8 {
        return (v.to_vec(), ld);
    }
    let ldq = q8::q8_row_bytes(k) / 4 + 4;
    let mut out = vec![f32::NAN; (rows - 1) * ldq + q8::q8_row_bytes(k) / 4];
    for r in 0..rows {
        let bytes = q8::quantize_q8_blocks(&v[r * ld..][..k]).to_gpu_bytes();
        for (i, c) in bytes.chunks_exact(4).enumerate() {
            out[r * ldq + i] = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
    (out, ldq)
}

/// `xq8_cfg`: the Cfg's XQ8 (0 f32 path; 1 x as q8 rows; 2 f32 x quantized in the block).
fn moe_modes_match_reference(test: &str, xq8_cfg: u8) {
    let name = ["moe", "moe-q8", "moe-q8f"][xq8_cfg as usize];
    let Some(mut b) = Builder::new(test, name, &emulator_source()) else {
        return;
    };
    let xq8 = xq8_cfg != 0; // the q8 oracle
    let q8_rows = xq8_cfg == 1; // x passed as q8 rows
    let mut rng = Rng::from_env_or_time(test);
    let seed = rng.seed();
    // The oracle's matvec: f32 x, or x quantized as quantize_q8 does (xq8).
    let mv = |ty: GgmlType, w: &[u8], k: usize, n: usize, x: &[f32]| {
        if xq8 {
            q8::matmul_gguf_q8(ty, w, k, n, x, 1).unwrap()
        } else {
            linear::matvec_gguf(ty, w, k, n, x).unwrap()
        }
    };
    for ty in QTYPES.into_iter().filter(|&t| !xq8 || q8::has_int_dot(t)) {
        let (kk, nn) = dims(ty);
        let spec = SPECIALIZED.contains(&ty);
        let mut defines = vec![
            format!("QT={}", ty.name()),
            format!("KDIM={kk}"),
            format!("NDIM={nn}"),
            "NEXP=64".into(),
            "NUSED=8".into(),
        ];
        if spec {
            defines.push("SPEC=1".into());
        }
        if xq8 {
            defines.push(format!("XQ8V={xq8_cfg}"));
        }
        let c = Case {
            n_tokens: 2,
            n_used: 3,
            n_expert: 5,
            grid_y_max: 4,
        };
        let slots = c.n_tokens * c.n_used;
        let rb_gu = ty.row_bytes(kk as u64).unwrap() as usize;
        let rb_d = ty.row_bytes(nn as u64).unwrap() as usize;
        let wg = quant::quantize(ty, &rng.normal_vec(c.n_expert * nn * kk, 1.0)).unwrap();
        let wu = quant::quantize(ty, &rng.normal_vec(c.n_expert * nn * kk, 1.0)).unwrap();
        let wd = quant::quantize(ty, &rng.normal_vec(c.n_expert * kk * nn, 1.0)).unwrap();
        let mut ids = random_ids(&mut rng, &c);
        let bad_slot = 4; // token 1, slot 1
        ids[bad_slot] = c.n_expert as i32;
        let wts: Vec<f32> = (0..slots).map(|_| rng.uniform_in(0.05, 1.0)).collect();
        let ldx = kk + 4;
        let ldy = nn + 3;
        let x = rng.normal_vec((c.n_tokens - 1) * ldx + kk, 1.0);
        let (x_dev, ldx_dev) = device_rows(q8_rows, &x, c.n_tokens, kk, ldx);
        for variant_spec in if spec { vec![true, false] } else { vec![false] } {
            // Specialized: one block per tile; generic: two blocks per slot walk its tiles.
            let grid_x_max = if variant_spec { 1 << 20 } else { 2 };
            let what = |m: &str| {
                format!(
                    "{m} {ty:?} k={kk} n={nn} spec={variant_spec} grid.x<={grid_x_max} (MEMRA_SEED={seed})"
                )
            };
            // plain and swiglu: y[s] over slots.
            let y0 = vec![f32::NAN; (slots - 1) * ldy + nn];
            let d = [
                kk,
                nn,
                c.n_tokens,
                c.n_used,
                c.n_expert,
                ldx_dev,
                ldy,
                c.grid_y_max,
                grid_x_max,
            ];
            let plain = launch(
                &mut b,
                &defines,
                "plain",
                variant_spec,
                d,
                &wg,
                &wg,
                &ids,
                &wts,
                &x_dev,
                &y0,
            );
            let swi = launch(
                &mut b,
                &defines,
                "swiglu",
                variant_spec,
                d,
                &wg,
                &wu,
                &ids,
                &wts,
                &x_dev,
                &y0,
            );
            let geg = launch(
                &mut b,
                &defines,
                "geglu",
                variant_spec,
                d,
                &wg,
                &wu,
                &ids,
                &wts,
                &x_dev,
                &y0,
            );
            let (mut got_p, mut want_p, mut got_s, mut want_s) = (vec![], vec![], vec![], vec![]);
            let (mut got_g, mut want_g) = (vec![], vec![]);
            for s in 0..slots {
                let row = |v: &[f32]| v[s * ldy..s * ldy + nn].to_vec();
                if s + 1 < slots {
                    assert!(
                        plain[s * ldy + nn..(s + 1) * ldy]
                            .iter()
                            .all(|v| v.is_nan()),
                        "{}: row padding written",
                        what("plain")
                    );
                }
                if s == bad_slot {
                    assert!(
                        row(&plain).iter().all(|v| v.is_nan()),
                        "{}: bad id slot not NaN",
                        what("plain")
                    );
                    assert!(
                        row(&swi).iter().all(|v| v.is_nan()),
                        "{}: bad id slot not NaN",
                        what("swiglu")
                    );
                    assert!(
                        row(&geg).iter().all(|v| v.is_nan()),
                        "{}: bad id slot not NaN",
                        what("geglu")
                    );
                    continue;
                }
                let e = ids[s] as usize;
                let xt = &x[(s / c.n_used) * ldx..][..kk];
                let g = mv(ty, expert(&wg, e, nn, rb_gu), kk, nn, xt);
                let u = mv(ty, expert(&wu, e, nn, rb_gu), kk, nn, xt);
                got_p.extend(row(&plain));
                want_p.extend(&g);
                got_s.extend(row(&swi));
                want_s.extend(act::swiglu(&g, &u));
                got_g.extend(row(&geg));
                want_g.extend(act::geglu(&g, &u));
            }
            let err = rel_err(&got_p, &want_p);
            assert!(err <= TOL, "{}: rel L2 {err:e} > {TOL:e}", what("plain"));
            let err = rel_err(&got_s, &want_s);
            assert!(err <= TOL, "{}: rel L2 {err:e} > {TOL:e}", what("swiglu"));
            let err = rel_err(&got_g, &want_g);
            assert!(err <= TOL, "{}: rel L2 {err:e} > {TOL:e}", what("geglu"));

            // down: y[b] = Σ_j wt·W_down[e]·h[s], h random [slots][ldh].
            let ldh = nn + 8;
            let h = rng.normal_vec((slots - 1) * ldh + nn, 1.0);
            let (h_dev, ldh_dev) = device_rows(q8_rows, &h, slots, nn, ldh);
            let ldo = kk + 1;
            let dd = [
                nn, kk, c.n_tokens, c.n_used, c.n_expert, ldh_dev, ldo, 2, grid_x_max,
            ];
            let modes: &[&str] = if variant_spec {
                &["down"]
            } else {
                &["down", "down_acc"]
            };
            for &mode in modes {
                let acc = mode == "down_acc";
                let y0: Vec<f32> = if acc {
                    rng.normal_vec((c.n_tokens - 1) * ldo + kk, 1.0)
                } else {
                    vec![f32::NAN; (c.n_tokens - 1) * ldo + kk]
                };
                let got = launch(
                    &mut b,
                    &defines,
                    mode,
                    variant_spec,
                    dd,
                    &wd,
                    &wd,
                    &ids,
                    &wts,
                    &h_dev,
                    &y0,
                );
                let (mut g, mut want) = (vec![], vec![]);
                for t in 0..c.n_tokens {
                    let out = &got[t * ldo..t * ldo + kk];
                    if t + 1 < c.n_tokens {
                        for i in kk..ldo {
                            assert_eq!(
                                got[t * ldo + i].to_bits(),
                                y0[t * ldo + i].to_bits(),
                                "{}: padding written",
                                what(mode)
                            );
                        }
                    }
                    if (t * c.n_used..(t + 1) * c.n_used).contains(&bad_slot) {
                        assert!(
                            out.iter().all(|v| v.is_nan()),
                            "{}: token with a bad id not NaN",
                            what(mode)
                        );
                        continue;
                    }
                    let mut sum = vec![0.0f64; kk];
                    for j in 0..c.n_used {
                        let s = t * c.n_used + j;
                        let e = ids[s] as usize;
                        let y = mv(ty, expert(&wd, e, kk, rb_d), nn, kk, &h[s * ldh..][..nn]);
                        for i in 0..kk {
                            sum[i] += wts[s] as f64 * y[i] as f64;
                        }
                    }
                    g.extend_from_slice(out);
                    want.extend(sum.iter().enumerate().map(|(i, &v)| {
                        (v + if acc { y0[t * ldo + i] as f64 } else { 0.0 }) as f32
                    }));
                }
                let err = rel_err(&g, &want);
                assert!(err <= TOL, "{}: rel L2 {err:e} > {TOL:e}", what(mode));
                eprintln!("{}: ok", what(mode));
            }
        }
    }
}

/// A dense gated FFN as one expert: n_expert = n_used = 1, ids = [0], the 2-D gate and up
/// tensors as w / w_up, one decode token (and a 3-token batch, every slot expert 0). Gemma 3's
/// shape (640 → 2048, Q5_0) in geglu and swiglu, specialized and generic, against
/// `act::geglu` / `act::swiglu` of two `linear::matvec_gguf`. Row padding must stay NaN.
#[test]
fn dense_gated_ffn_as_one_expert_matches_reference() {
    let test = "dense_gated_ffn_as_one_expert_matches_reference";
    let Some(mut b) = Builder::new(test, "moe-dense", &emulator_source()) else {
        return;
    };
    let mut rng = Rng::from_env_or_time(test);
    let seed = rng.seed();
    let (ty, kk, nn) = (GgmlType::Q5_0, 640usize, 2048usize);
    let defines = vec![
        format!("QT={}", ty.name()),
        format!("KDIM={kk}"),
        format!("NDIM={nn}"),
        "NEXP=64".into(),
        "NUSED=8".into(),
        "SPEC=1".into(),
    ];
    let wg = quant::quantize(ty, &rng.normal_vec(nn * kk, 1.0)).unwrap();
    let wu = quant::quantize(ty, &rng.normal_vec(nn * kk, 1.0)).unwrap();
    for n_tokens in [1usize, 3] {
        let ldx = kk + 4 * (n_tokens - 1);
        let ldy = nn + (n_tokens - 1);
        let x = rng.normal_vec((n_tokens - 1) * ldx + kk, 1.0);
        let ids = vec![0i32; n_tokens];
        let y0 = vec![f32::NAN; (n_tokens - 1) * ldy + nn];
        // Three blocks per slot walk its 2·2048 / 32 = 128 tiles.
        let d = [kk, nn, n_tokens, 1, 1, ldx, ldy, 2, 3];
        for spec in [true, false] {
            for mode in ["geglu", "swiglu"] {
                let what = format!(
                    "{mode} {ty:?} k={kk} n={nn} n_tokens={n_tokens} spec={spec} (MEMRA_SEED={seed})"
                );
                let got = launch(
                    &mut b,
                    &defines,
                    mode,
                    spec,
                    d,
                    &wg,
                    &wu,
                    &ids,
                    &[0.0],
                    &x,
                    &y0,
                );
                let (mut g_all, mut want) = (vec![], vec![]);
                for t in 0..n_tokens {
                    let xt = &x[t * ldx..][..kk];
                    let g = linear::matvec_gguf(ty, &wg, kk, nn, xt).unwrap();
                    let u = linear::matvec_gguf(ty, &wu, kk, nn, xt).unwrap();
                    want.extend(if mode == "geglu" {
                        act::geglu(&g, &u)
                    } else {
                        act::swiglu(&g, &u)
                    });
                    g_all.extend_from_slice(&got[t * ldy..t * ldy + nn]);
                    if t + 1 < n_tokens {
                        assert!(
                            got[t * ldy + nn..(t + 1) * ldy].iter().all(|v| v.is_nan()),
                            "{what}: row padding written"
                        );
                    }
                }
                let err = rel_err(&g_all, &want);
                assert!(err <= TOL, "{what}: rel L2 {err:e} > {TOL:e}");
                eprintln!("{what}: ok (rel L2 {err:e})");
            }
        }
    }
}

/// Softmax (OLMoE: 64 experts, top 8, no norm) and sigmoid + bias + norm + ×2.5 (GLM-5: 256,
/// top 8), specialized and generic, plus a generic run at 37 experts / top 5; ids must equal
/// `moe::route`'s, weights within 1e-6 relative. Ties: logits are drawn from a grid of 1/8
/// steps so exact score ties occur and the lower-index rule is exercised.
#[test]
fn moe_router_emulated_on_host_threads_matches_reference() {
    let test = "moe_router_emulated_on_host_threads_matches_reference";
    let Some(mut b) = Builder::new(test, "moe-router", &emulator_source()) else {
        return;
    };
    let mut rng = Rng::from_env_or_time(test);
    let seed = rng.seed();
    // (n_expert, n_used, gating, bias, norm, scale, specialized at NEXP/NUSED)
    let cases = [
        (64usize, 8usize, Gating::Softmax, false, false, 1.0f32, true),
        (64, 8, Gating::Softmax, false, false, 1.0, false),
        (256, 8, Gating::Sigmoid, true, true, 2.5, true),
        (256, 8, Gating::Sigmoid, true, true, 2.5, false),
        (37, 5, Gating::Softmax, true, true, 0.5, false),
    ];
    for (ne, nu, gating, with_bias, norm, scale, spec) in cases {
        let nt = 7;
        let defines = vec![
            "QT=F32".into(),
            "KDIM=256".into(),
            "NDIM=256".into(),
            format!("NEXP={}", if spec { ne } else { 64 }),
            format!("NUSED={nu}"),
        ];
        let logits: Vec<f32> = (0..nt * ne)
            .map(|_| (rng.below(48) as f32 - 24.0) / 8.0)
            .collect();
        let bias: Vec<f32> = (0..ne).map(|_| rng.uniform_in(-0.05, 0.05)).collect();
        let dir = b.dir().to_path_buf();
        let (lf, bf, idf, wf) = (
            dir.join("logits.bin"),
            dir.join("bias.bin"),
            dir.join("ids.bin"),
            dir.join("wts.bin"),
        );
        std::fs::write(&lf, f32_bytes(&logits)).unwrap();
        std::fs::write(&bf, f32_bytes(&bias)).unwrap();
        let bin = b.get(defines);
        let g = if gating == Gating::Softmax { "1" } else { "2" };
        let args: Vec<String> = vec![
            "router".into(),
            if spec { "spec" } else { "gen" }.into(),
            g.into(),
            nt.to_string(),
            ne.to_string(),
            nu.to_string(),
            (norm as i32).to_string(),
            scale.to_string(),
            lf.display().to_string(),
            if with_bias {
                bf.display().to_string()
            } else {
                "-".into()
            },
            idf.display().to_string(),
            wf.display().to_string(),
        ];
        emu_common::run(&bin, &args);
        let (ids, wts) = (read_i32(&idf), read_f32(&wf));
        let cfg = RouterConfig {
            gating,
            n_used: nu,
            norm,
            scale,
        };
        for t in 0..nt {
            let want = route(
                &logits[t * ne..][..ne],
                with_bias.then_some(&bias[..]),
                &cfg,
            );
            let what = format!(
                "router {gating:?} n_expert={ne} n_used={nu} spec={spec} token {t} (MEMRA_SEED={seed})"
            );
            let got_ids: Vec<i32> = ids[t * nu..][..nu].to_vec();
            let want_ids: Vec<i32> = want.iter().map(|&(e, _)| e as i32).collect();
            assert_eq!(got_ids, want_ids, "{what}: ids");
            let got_w = &wts[t * nu..][..nu];
            let want_w: Vec<f32> = want.iter().map(|&(_, w)| w).collect();
            let err = rel_err(got_w, &want_w);
            assert!(
                err <= 1e-6,
                "{what}: weights {got_w:?} vs {want_w:?} (rel {err:e})"
            );
        }
        eprintln!("router {gating:?} n_expert={ne} n_used={nu} spec={spec}: ok");
    }
}
