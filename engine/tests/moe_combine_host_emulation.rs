//! CPU emulation of moe_combine (templates/memra/moe_combine.cuh) as the end of expert-grouped
//! MoE prefill: random MoE layers (f32 experts) routed by memra-reference `moe::route`, each
//! (token, slot)'s expert output (`moe::ffn_gated`) placed at its row of
//! `models::moe_grouped::group_by_expert`, the template compiled as host C++ on std::threads
//! (emu_common) combines them, compared with memra-reference `moe::moe_ffn`. Fresh seed per
//! run (printed; replay with `MEMRA_SEED=<seed>`); NaN-poisoned outputs; float4 and scalar
//! paths, specialized and generic variants, small grids (grid strides), a row index out of range
//! (NaN row), a multi-GPU rank's share (slots of other ranks' experts at weight 0: no row, the
//! zero row). Skips (one SKIP line) without a C++20 compiler.

mod emu_common;

use emu_common::{f32_bytes, i32_bytes, read_f32, template, Builder};
use memra_engine::models::moe_grouped::group_by_expert;
use memra_reference::moe::{
    ffn_gated, moe_ffn, route, FfnAct, FfnWeights, Gating, MoeConfig, MoeWeights, RouterConfig,
};
use memra_reference::linear::matvec;
use memra_reference::{rel_err, Rng};

const EXTRA: &str = r#"
#define __global__
#define __launch_bounds__(x)
namespace memra { inline void store_f4(float* p, float4 v) { memcpy(p, &v, 16); } }
"#;

const MAIN: &str = r#"
using namespace memra;
template <int N_, int TH> struct CCfg { static constexpr int N = N_, THREADS = TH; };
// args: cfg n_tokens n_used n y_rows grid_x grid_y out_offset | y rows weights | out
template <class K> void run(int* a, char** f) {
    int T = a[0], nu = a[1], n = a[2], y_rows = a[3], gx = a[4], gy = a[5], off = a[6];
    auto y = slurp(f[0]), rows = slurp(f[1]), w = slurp(f[2]);
    float* yp = aligned_copy<float>(y);
    std::vector<float> out((size_t)T * n + off, NAN);
    run_grid({(unsigned)gx, (unsigned)gy, 1}, K::THREADS, 0, [&] {
        moe_combine_impl<K>(yp, (const int*)rows.data(), (const float*)w.data(), out.data() + off, T, nu, n, y_rows); });
    spit(f[3], out.data() + off, (size_t)T * n * 4);
}
int main(int argc, char** argv) {
    int cfg = atoi(argv[1]);
    int a[7]; for (int i = 0; i < 7; ++i) a[i] = atoi(argv[2 + i]);
    char** f = argv + 9;
    switch (cfg) {
    case 0: run<CCfg<0, 64>>(a, f); break;
    case 1: run<CCfg<64, 32>>(a, f); break;
    case 2: run<CCfg<0, 32>>(a, f); break;
    default: return 4;
    }
    return 0;
}
"#;

fn emulator_source() -> String {
    let combine = template("moe_combine.cuh")
        .replace("#pragma once", "")
        .replace("#include \"memra/common.cuh\"", "");
    format!(
        "{}\n{EXTRA}\n{}\n{combine}\n{MAIN}",
        emu_common::PRELUDE,
        emu_common::GRID_RUNNER
    )
}

struct Case {
    cfg: usize,
    t: usize,
    n_embd: usize,
    n_ff: usize,
    n_expert: usize,
    n_used: usize,
    grid: (usize, usize),
    /// Floats the output starts past a 16-byte boundary (1: the scalar path).
    out_offset: usize,
    /// Route every token to expert 0 first (one expert used by all tokens).
    all_on_zero: bool,
    /// A multi-GPU rank holding experts `lo..hi`: the others' slots become local expert 0 at
    /// weight 0 (as ep_localize leaves them) and the rank's output is its experts' share.
    rank_experts: Option<(usize, usize)>,
}

fn run_case(b: &mut Builder, rng: &mut Rng, c: &Case, n: usize) {
    let bin = b.get(Vec::new());
    let (e, nf, ne, nu, t) = (c.n_embd, c.n_ff, c.n_expert, c.n_used, c.t);
    let what = format!(
        "moe_combine emulation case {n} (t {t}, {nu} of {ne}, n_embd {e}; MEMRA_SEED={})",
        rng.seed()
    );
    let mut gate_inp = rng.normal_vec(e * ne, 1.0);
    if c.all_on_zero {
        // Expert 0 wins every token by construction, not by likelihood: x is positive (below),
        // row 0 is 4.0 and the other rows lie in [-1, 1], so expert 0's logit 4·Σx exceeds any
        // other's Σ g·x ≤ Σx. (A row of 4.0 against unbounded rows lost on some seeds.)
        gate_inp.iter_mut().for_each(|v| *v = v.clamp(-1.0, 1.0));
        gate_inp[..e].iter_mut().for_each(|v| *v = 4.0);
    }
    let gate = rng.normal_vec(ne * nf * e, 0.3);
    let up = rng.normal_vec(ne * nf * e, 0.3);
    let down = rng.normal_vec(ne * e * nf, 0.3);
    let x: Vec<f32> = rng
        .normal_vec(t * e, 1.0)
        .iter()
        .map(|v| if c.all_on_zero { v.abs() + 0.1 } else { v + 0.5 })
        .collect();
    let router = RouterConfig {
        gating: Gating::Softmax,
        n_used: nu,
        norm: true,
        scale: 1.0,
    };
    let cfg = MoeConfig {
        n_embd: e,
        n_ff: nf,
        n_expert: ne,
        n_ff_shared: 0,
        router,
    };
    let w = MoeWeights {
        ffn_gate_inp: &gate_inp,
        exp_probs_b: None,
        ffn_gate_exps: &gate,
        ffn_up_exps: &up,
        ffn_down_exps: &down,
        shared: None,
    };
    let want = moe_ffn(&w, &cfg, &x);

    let (mut ids, mut wts) = (Vec::new(), Vec::new());
    let mut pair_out = Vec::new();
    for xt in x.chunks_exact(e) {
        // The reference's own router product: routing on other roundings of the same logits
        // could pick another expert at a near-tie and part from `want`.
        let logits = matvec(&gate_inp, e, ne, xt);
        for (id, wt) in route(&logits, None, &router) {
            ids.push(id as i32);
            wts.push(wt);
            let one = |m: &[f32], len: usize| m[id * len..(id + 1) * len].to_vec();
            let (g, u, d) = (one(&gate, nf * e), one(&up, nf * e), one(&down, e * nf));
            let fw = FfnWeights { ffn_gate: &g, ffn_up: &u, ffn_down: &d };
            pair_out.push(ffn_gated(&fw, e, nf, FfnAct::Silu, xt));
        }
    }
    if c.all_on_zero {
        assert!(ids.chunks_exact(nu).all(|r| r[0] == 0), "{what}: the routing does not put every token on expert 0");
    }
    let mut want = want;
    let mut n_local = ne;
    if let Some((lo, hi)) = c.rank_experts {
        n_local = hi - lo;
        for (id, wt) in ids.iter_mut().zip(wts.iter_mut()) {
            if (lo..hi).contains(&(*id as usize)) {
                *id -= lo as i32;
            } else {
                (*id, *wt) = (0, 0.0);
            }
        }
        // The rank's share: Σ over its own experts' slots only.
        want = vec![0.0; t * e];
        for (slot, out) in pair_out.iter().enumerate() {
            let acc = &mut want[slot / nu * e..][..e];
            acc.iter_mut().zip(out).for_each(|(a, v)| *a += wts[slot] * v);
        }
    }
    let groups = group_by_expert(&ids, Some(&wts), nu, n_local).unwrap_or_else(|m| panic!("{what}: {m}"));
    let empty = (0..n_local).filter(|&x| groups.rows(x).is_empty()).count();
    let dropped = wts.iter().filter(|&&w| w == 0.0).count();
    assert_eq!(groups.kept(), t * nu - dropped, "{what}: kept rows");
    // The grouped down outputs: each kept pair's row at its grouped position, then the zero row
    // of the dropped ones (the rest stays NaN: a dropped slot reading anything else shows).
    let mut y = vec![f32::NAN; t * nu * e];
    for (slot, out) in pair_out.iter().enumerate() {
        if wts[slot] != 0.0 {
            let r = groups.row_of_slot[slot] as usize;
            y[r * e..(r + 1) * e].copy_from_slice(out);
        }
    }
    if dropped > 0 {
        let r = groups.kept();
        y[r * e..(r + 1) * e].iter_mut().for_each(|v| *v = 0.0);
    }
    let mut rows = groups.row_of_slot.clone();
    // The last token reads a row past the end: its output must be NaN, the others unaffected.
    let bad_token = (t > 1).then(|| {
        rows[(t - 1) * nu] = (t * nu) as i32;
        t - 1
    });

    let dir = b.dir().join(format!("case{n}"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut args: Vec<String> = [c.cfg, t, nu, e, t * nu, c.grid.0, c.grid.1, c.out_offset]
        .iter()
        .map(|v| v.to_string())
        .collect();
    for (i, data) in [f32_bytes(&y), i32_bytes(&rows), f32_bytes(&wts)].iter().enumerate() {
        let p = dir.join(format!("in{i}.bin"));
        std::fs::write(&p, data).unwrap();
        args.push(p.display().to_string());
    }
    let out_path = dir.join("out.bin");
    args.push(out_path.display().to_string());
    emu_common::run(&bin, &args);
    let got = read_f32(&out_path);
    assert_eq!(got.len(), t * e, "{what}: output size");
    for tok in 0..t {
        let row = &got[tok * e..(tok + 1) * e];
        if Some(tok) == bad_token {
            assert!(row.iter().all(|v| v.is_nan()), "{what}: token {tok} with a row out of range is not NaN");
            continue;
        }
        let err = rel_err(row, &want[tok * e..(tok + 1) * e]);
        assert!(err <= 1e-5, "{what}: token {tok}: relative L2 {err:e} vs moe_ffn");
    }
    println!("{what}: pass ({empty} experts without tokens, {dropped} slots without a row)");
}

#[test]
fn moe_combine_matches_the_reference_moe() {
    let Some(mut b) = Builder::new(
        "moe_combine_matches_the_reference_moe",
        "moe-combine",
        &emulator_source(),
    ) else {
        return;
    };
    let mut rng = Rng::from_env_or_time("moe_combine_host_emulation");
    println!("seed {} (MEMRA_SEED to replay)", rng.seed());
    let cases = [
        // Generic, float4 path, t = 7: most of 16 experts get no token.
        Case { cfg: 0, t: 7, n_embd: 64, n_ff: 32, n_expert: 16, n_used: 4, grid: (1, 3), out_offset: 0, all_on_zero: false, rank_experts: None },
        // Specialized n = 64, a grid wider than the rows.
        Case { cfg: 1, t: 9, n_embd: 64, n_ff: 16, n_expert: 8, n_used: 2, grid: (2, 9), out_offset: 0, all_on_zero: false, rank_experts: None },
        // Every token on expert 0 (slot 0).
        Case { cfg: 0, t: 12, n_embd: 32, n_ff: 16, n_expert: 8, n_used: 2, grid: (1, 5), out_offset: 0, all_on_zero: true, rank_experts: None },
        // Scalar path by alignment: the output one float past a 16-byte boundary.
        Case { cfg: 2, t: 5, n_embd: 36, n_ff: 8, n_expert: 4, n_used: 3, grid: (1, 2), out_offset: 1, all_on_zero: false, rank_experts: None },
        // Scalar path by width: n_embd 30.
        Case { cfg: 2, t: 6, n_embd: 30, n_ff: 8, n_expert: 6, n_used: 2, grid: (2, 4), out_offset: 0, all_on_zero: false, rank_experts: None },
        // Rank 1 of 2 (experts 8..16 of 16): about half the slots are another rank's.
        Case { cfg: 0, t: 11, n_embd: 64, n_ff: 16, n_expert: 16, n_used: 4, grid: (1, 4), out_offset: 0, all_on_zero: false, rank_experts: Some((8, 16)) },
        // Rank 0 of 4 with every token on expert 0 first: that slot is the rank's, most are not.
        Case { cfg: 1, t: 6, n_embd: 64, n_ff: 8, n_expert: 8, n_used: 3, grid: (2, 3), out_offset: 0, all_on_zero: true, rank_experts: Some((0, 2)) },
        // One token, one expert of one.
        Case { cfg: 0, t: 1, n_embd: 16, n_ff: 8, n_expert: 1, n_used: 1, grid: (1, 1), out_offset: 0, all_on_zero: false, rank_experts: None },
    ];
    for (n, c) in cases.iter().enumerate() {
        run_case(&mut b, &mut rng, c, n);
    }
}
