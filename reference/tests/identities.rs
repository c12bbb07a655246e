//! Identities of the elementwise ops, norms, RoPE and attention masks.

use memra_reference::act::{geglu, gelu_tanh, silu, softmax, softmax_rows, swiglu};
use memra_reference::attention::{AttnShape, Mask, attention};
use memra_reference::norm::{add_rms_norm, layer_norm, rms_norm};
use memra_reference::rope::{Rope, RopeMode, rope_head, rope_heads, rope_tokens};
use memra_reference::{Rng, max_abs_diff, rel_err};

fn norm2(x: &[f32]) -> f64 {
    x.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt()
}

#[test]
fn rms_norm_unit_weight_gives_unit_rms() {
    let mut rng = Rng::from_env_or_time("rms_norm_unit_weight_gives_unit_rms");
    let dim = 640;
    let x = rng.normal_vec(4 * dim, 3.0);
    let y = rms_norm(&x, &vec![1.0; dim], 1e-6);
    for (r, row) in y.chunks_exact(dim).enumerate() {
        let rms = (row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64).sqrt();
        assert!(
            (rms - 1.0).abs() < 1e-5,
            "row {r}: rms {rms} (seed {})",
            rng.seed()
        );
    }
}

#[test]
fn rms_norm_hand_values() {
    // rms([3, 4]) = sqrt(12.5); y = [3, 4·2] / sqrt(12.5).
    let y = rms_norm(&[3.0, 4.0], &[1.0, 2.0], 0.0);
    assert!((y[0] - 0.848_528_14).abs() < 1e-6, "{y:?}");
    assert!((y[1] - 2.262_741_7).abs() < 1e-6, "{y:?}");
    // eps enters under the root: mean(x²) = 0.5, eps 0.5 -> divide by 1.
    let y = rms_norm(&[1.0, 0.0], &[1.0, 1.0], 0.5);
    assert!((y[0] - 1.0).abs() < 1e-7, "{y:?}");
}

#[test]
fn add_rms_norm_returns_sum_and_its_norm() {
    let mut rng = Rng::from_env_or_time("add_rms_norm_returns_sum_and_its_norm");
    let dim = 64;
    let r = rng.normal_vec(3 * dim, 1.0);
    let x = rng.normal_vec(3 * dim, 1.0);
    let w = rng.uniform_vec(dim, 0.5, 1.5);
    let (sum, y) = add_rms_norm(&r, &x, &w, 1e-5);
    for i in 0..sum.len() {
        assert_eq!(sum[i], r[i] + x[i], "residual {i} (seed {})", rng.seed());
    }
    assert_eq!(y, rms_norm(&sum, &w, 1e-5), "seed {}", rng.seed());
}

#[test]
fn layer_norm_standardizes_then_applies_weight_and_bias() {
    let mut rng = Rng::from_env_or_time("layer_norm_standardizes_then_applies_weight_and_bias");
    let dim = 128;
    let x: Vec<f32> = rng
        .normal_vec(2 * dim, 2.0)
        .iter()
        .map(|v| v + 5.0)
        .collect();
    let z = layer_norm(&x, &vec![1.0; dim], &vec![0.0; dim], 1e-6);
    for row in z.chunks_exact(dim) {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / dim as f64;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / dim as f64;
        assert!(mean.abs() < 1e-6, "mean {mean} (seed {})", rng.seed());
        assert!((var - 1.0).abs() < 1e-5, "var {var} (seed {})", rng.seed());
    }
    let w = rng.normal_vec(dim, 1.0);
    let b = rng.normal_vec(dim, 1.0);
    let y = layer_norm(&x, &w, &b, 1e-6);
    for i in 0..y.len() {
        let expect = z[i] * w[i % dim] + b[i % dim];
        assert!(
            (y[i] - expect).abs() < 1e-5,
            "elem {i}: {} vs {expect} (seed {})",
            y[i],
            rng.seed()
        );
    }
}

#[test]
fn softmax_sums_to_one_and_ignores_shift() {
    let mut rng = Rng::from_env_or_time("softmax_sums_to_one_and_ignores_shift");
    let x = rng.normal_vec(3 * 50, 10.0);
    let p = softmax_rows(&x, 50);
    for row in p.chunks_exact(50) {
        let s: f64 = row.iter().map(|&v| v as f64).sum();
        assert!((s - 1.0).abs() < 1e-6, "sum {s} (seed {})", rng.seed());
        assert!(row.iter().all(|&v| v >= 0.0));
    }
    // Values on a 2^-8 grid, so adding 1000 is exact in f32 and only the softmax can differ.
    let grid: Vec<f32> = x[..50]
        .iter()
        .map(|v| (v * 256.0).round() / 256.0)
        .collect();
    let shifted: Vec<f32> = grid.iter().map(|v| v + 1000.0).collect();
    assert!(
        max_abs_diff(&softmax(&shifted), &softmax(&grid)) < 1e-7,
        "seed {}",
        rng.seed()
    );
    // Large logits must not overflow: softmax([1000, 1001]) = [1, e] / (1 + e).
    let p = softmax(&[1000.0, 1001.0]);
    let e = std::f32::consts::E;
    assert!(
        (p[0] - 1.0 / (1.0 + e)).abs() < 1e-7 && (p[1] - e / (1.0 + e)).abs() < 1e-7,
        "{p:?}"
    );
    // Hand case: softmax([0, ln 3, −∞]) = [1/4, 3/4, 0].
    let p = softmax(&[0.0, 3f32.ln(), f32::NEG_INFINITY]);
    assert!(
        (p[0] - 0.25).abs() < 1e-7 && (p[1] - 0.75).abs() < 1e-7 && p[2] == 0.0,
        "{p:?}"
    );
    assert_eq!(softmax(&[f32::NEG_INFINITY; 3]), vec![0.0; 3]);
}

#[test]
fn activations_hand_values() {
    // silu(1) = 1/(1+e^-1); gelu_tanh(1) = 0.5(1 + tanh(sqrt(2/π)·1.044715)).
    assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
    assert_eq!(silu(0.0), 0.0);
    assert!(
        (gelu_tanh(1.0) - 0.841_192).abs() < 1e-6,
        "{}",
        gelu_tanh(1.0)
    );
    assert!(
        (gelu_tanh(-1.0) + 0.158_808).abs() < 1e-6,
        "{}",
        gelu_tanh(-1.0)
    );
    assert!(gelu_tanh(-12.0).abs() < 1e-30 && (gelu_tanh(12.0) - 12.0).abs() < 1e-6);
    let g = [1.0, -1.0, 2.0];
    let u = [2.0, 3.0, -0.5];
    let s = swiglu(&g, &u);
    let e = geglu(&g, &u);
    for i in 0..3 {
        assert!((s[i] - silu(g[i]) * u[i]).abs() < 1e-6);
        assert!((e[i] - gelu_tanh(g[i]) * u[i]).abs() < 1e-6);
    }
}

#[test]
fn rope_preserves_norm_and_is_identity_at_position_zero() {
    let mut rng = Rng::from_env_or_time("rope_preserves_norm_and_is_identity_at_position_zero");
    for mode in [RopeMode::Norm, RopeMode::Neox] {
        let rope = Rope::new(mode, 128, 1e6);
        let x = rng.normal_vec(4 * 128, 1.0);
        let mut y = x.clone();
        rope_heads(&mut y, 4, 128, 0, &rope);
        assert_eq!(y, x, "{mode:?}: position 0 must be the identity");
        let pos = 1 + rng.below(40_000);
        rope_heads(&mut y, 4, 128, pos, &rope);
        assert_ne!(y, x, "{mode:?}: position {pos} left x unchanged");
        for h in 0..4 {
            let (a, b) = (norm2(&x[h * 128..][..128]), norm2(&y[h * 128..][..128]));
            assert!(
                (a - b).abs() < 1e-5 * a,
                "{mode:?} pos {pos} head {h}: {a} vs {b} (seed {})",
                rng.seed()
            );
        }
    }
}

#[test]
fn rope_hand_values_and_linear_scaling() {
    // n_rot 4, base 10000: θ_0 = pos, θ_1 = pos·0.01. NORM pairs (0,1), (2,3).
    let rope = Rope::new(RopeMode::Norm, 4, 10_000.0);
    let mut x = [1.0f32, 0.0, 1.0, 0.0];
    rope_head(&mut x, 1, &rope);
    let want = [1f32.cos(), 1f32.sin(), 0.01f32.cos(), 0.01f32.sin()];
    assert!(max_abs_diff(&x, &want) < 1e-6, "{x:?} vs {want:?}");
    // NEOX pairs (0,2), (1,3).
    let rope = Rope::new(RopeMode::Neox, 4, 10_000.0);
    let mut x = [1.0f32, 1.0, 0.0, 0.0];
    rope_head(&mut x, 1, &rope);
    let want = [1f32.cos(), 0.01f32.cos(), 1f32.sin(), 0.01f32.sin()];
    assert!(max_abs_diff(&x, &want) < 1e-6, "{x:?} vs {want:?}");
    // freq_scale 0.5 at position 6 equals no scaling at position 3.
    let mut scaled = Rope::new(RopeMode::Neox, 64, 1e4);
    scaled.freq_scale = 0.5;
    let mut rng = Rng::from_env_or_time("rope_hand_values_and_linear_scaling");
    let x = rng.normal_vec(64, 1.0);
    let (mut a, mut b) = (x.clone(), x.clone());
    rope_head(&mut a, 6, &scaled);
    rope_head(&mut b, 3, &Rope::new(RopeMode::Neox, 64, 1e4));
    assert!(max_abs_diff(&a, &b) < 1e-6, "seed {}", rng.seed());
}

#[test]
fn rope_scores_depend_only_on_relative_position() {
    let mut rng = Rng::from_env_or_time("rope_scores_depend_only_on_relative_position");
    for mode in [RopeMode::Norm, RopeMode::Neox] {
        let rope = Rope::new(mode, 64, 1e4);
        let q = rng.normal_vec(64, 1.0);
        let k = rng.normal_vec(64, 1.0);
        let score = |pq: usize, pk: usize| {
            let (mut a, mut b) = (q.clone(), k.clone());
            rope_head(&mut a, pq, &rope);
            rope_head(&mut b, pk, &rope);
            a.iter()
                .zip(&b)
                .map(|(&x, &y)| x as f64 * y as f64)
                .sum::<f64>()
        };
        let s0 = score(10, 3);
        let s1 = score(510, 503);
        assert!(
            (s0 - s1).abs() < 1e-4,
            "{mode:?}: {s0} vs {s1} (seed {})",
            rng.seed()
        );
        assert!(
            (s0 - score(10, 4)).abs() > 1e-4,
            "{mode:?}: score ignores position"
        );
    }
}

#[test]
fn neox_equals_interleaved_after_dim_permutation() {
    // Interleaved pair (2i, 2i+1) is NeoX pair (i, i + n_rot/2): P maps x[2i] -> i,
    // x[2i+1] -> i + n_rot/2, tail fixed. Then neox(P x) = P norm(x).
    let mut rng = Rng::from_env_or_time("neox_equals_interleaved_after_dim_permutation");
    let (hd, n_rot) = (96, 64);
    let perm = |x: &[f32]| {
        let mut y = x.to_vec();
        for i in 0..n_rot / 2 {
            y[i] = x[2 * i];
            y[i + n_rot / 2] = x[2 * i + 1];
        }
        y
    };
    let x = rng.normal_vec(hd, 1.0);
    let pos = rng.below(100_000);
    let mut interleaved = x.clone();
    rope_head(
        &mut interleaved,
        pos,
        &Rope::new(RopeMode::Norm, n_rot, 1e6),
    );
    let mut neox = perm(&x);
    rope_head(&mut neox, pos, &Rope::new(RopeMode::Neox, n_rot, 1e6));
    assert_eq!(neox, perm(&interleaved), "pos {pos} (seed {})", rng.seed());
}

#[test]
fn partial_rotary_leaves_tail_untouched() {
    let mut rng = Rng::from_env_or_time("partial_rotary_leaves_tail_untouched");
    for mode in [RopeMode::Norm, RopeMode::Neox] {
        let (t, heads, hd, n_rot) = (3, 2, 80, 32);
        let x = rng.normal_vec(t * heads * hd, 1.0);
        let mut y = x.clone();
        rope_tokens(
            &mut y,
            heads,
            hd,
            &[5, 17, 999],
            &Rope::new(mode, n_rot, 1e4),
        );
        for th in 0..t * heads {
            assert_eq!(
                y[th * hd + n_rot..(th + 1) * hd],
                x[th * hd + n_rot..(th + 1) * hd],
                "{mode:?} head {th}"
            );
            assert_ne!(
                y[th * hd..th * hd + n_rot],
                x[th * hd..th * hd + n_rot],
                "{mode:?} head {th} not rotated"
            );
        }
    }
}

struct AttnCase {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    t_kv: usize,
}

fn attn_case(rng: &mut Rng, t_q: usize, t_kv: usize, shape: AttnShape) -> AttnCase {
    AttnCase {
        q: rng.normal_vec(t_q * shape.n_head * shape.head_dim_k, 1.0),
        k: rng.normal_vec(t_kv * shape.n_kv_head * shape.head_dim_k, 1.0),
        v: rng.normal_vec(t_kv * shape.n_kv_head * shape.head_dim_v, 1.0),
        t_kv,
    }
}

#[test]
fn attention_two_keys_by_hand() {
    // p(key 1) = e/(1+e) for scores [0, 1]; output = 10 + 10·e/(1+e).
    let shape = AttnShape {
        n_head: 1,
        n_kv_head: 1,
        head_dim_k: 1,
        head_dim_v: 1,
    };
    let o = attention(
        &[1.0],
        &[0.0, 1.0],
        &[10.0, 20.0],
        2,
        shape,
        &Mask::causal(&[1]),
        1.0,
    );
    let e = std::f64::consts::E;
    assert!(
        (o[0] as f64 - (10.0 + 10.0 * e / (1.0 + e))).abs() < 1e-5,
        "{o:?}"
    );
    // At position 0 only key 0 is visible.
    let o = attention(
        &[1.0],
        &[0.0, 1.0],
        &[10.0, 20.0],
        2,
        shape,
        &Mask::causal(&[0]),
        1.0,
    );
    assert_eq!(o, vec![10.0]);
}

#[test]
fn sliding_window_rule_and_wide_window_equals_causal() {
    let mut rng = Rng::from_env_or_time("sliding_window_rule_and_wide_window_equals_causal");
    let q_pos: Vec<usize> = (0..20).collect();
    let win = Mask {
        q_pos: &q_pos,
        window: Some(3),
        allowed: None,
    };
    assert_eq!(win.visible_keys(5, 20), vec![3, 4, 5]);
    assert_eq!(win.visible_keys(1, 20), vec![0, 1]);

    let shape = AttnShape {
        n_head: 4,
        n_kv_head: 2,
        head_dim_k: 32,
        head_dim_v: 16,
    };
    let c = attn_case(&mut rng, 20, 20, shape);
    let causal = attention(&c.q, &c.k, &c.v, c.t_kv, shape, &Mask::causal(&q_pos), 0.3);
    for w in [20, 21, 1000] {
        let m = Mask {
            q_pos: &q_pos,
            window: Some(w),
            allowed: None,
        };
        assert_eq!(
            attention(&c.q, &c.k, &c.v, c.t_kv, shape, &m, 0.3),
            causal,
            "window {w}"
        );
    }
    let m = Mask {
        q_pos: &q_pos,
        window: Some(19),
        allowed: None,
    };
    assert_ne!(
        attention(&c.q, &c.k, &c.v, c.t_kv, shape, &m, 0.3),
        causal,
        "window 19 must hide key 0 from query 19"
    );
    // Window 1: each query sees only itself, so the output is its own v.
    let m = Mask {
        q_pos: &q_pos,
        window: Some(1),
        allowed: None,
    };
    let o = attention(&c.q, &c.k, &c.v, c.t_kv, shape, &m, 0.3);
    for t in 0..20 {
        for h in 0..4 {
            let own = &c.v[(t * 2 + h / 2) * 16..][..16];
            assert!(
                max_abs_diff(&o[(t * 4 + h) * 16..][..16], own) < 1e-6,
                "t {t} h {h} (seed {})",
                rng.seed()
            );
        }
    }
}

#[test]
fn gqa_equals_mha_with_repeated_kv_heads() {
    let mut rng = Rng::from_env_or_time("gqa_equals_mha_with_repeated_kv_heads");
    let gqa = AttnShape {
        n_head: 8,
        n_kv_head: 2,
        head_dim_k: 64,
        head_dim_v: 64,
    };
    let (t_q, t_kv) = (3, 9);
    let c = attn_case(&mut rng, t_q, t_kv, gqa);
    let repeat = |x: &[f32]| {
        let mut y = Vec::new();
        for s in 0..t_kv {
            for h in 0..8 {
                y.extend_from_slice(&x[(s * 2 + h / 4) * 64..][..64]);
            }
        }
        y
    };
    let mha = AttnShape {
        n_kv_head: 8,
        ..gqa
    };
    let pos = [6, 7, 8];
    let a = attention(&c.q, &c.k, &c.v, t_kv, gqa, &Mask::causal(&pos), 0.125);
    let b = attention(
        &c.q,
        &repeat(&c.k),
        &repeat(&c.v),
        t_kv,
        mha,
        &Mask::causal(&pos),
        0.125,
    );
    assert_eq!(a, b, "seed {}", rng.seed());
}

#[test]
fn decode_over_40k_tokens_with_zero_scale_averages_values() {
    // Scale 0 makes the softmax uniform: the output is the mean of the visible v rows.
    let mut rng = Rng::from_env_or_time("decode_over_40k_tokens_with_zero_scale_averages_values");
    let shape = AttnShape {
        n_head: 8,
        n_kv_head: 2,
        head_dim_k: 128,
        head_dim_v: 128,
    };
    let t_kv = 40_000;
    let c = attn_case(&mut rng, 1, t_kv, shape);
    let start = std::time::Instant::now();
    let o = attention(
        &c.q,
        &c.k,
        &c.v,
        t_kv,
        shape,
        &Mask::causal(&[t_kv - 1]),
        0.0,
    );
    eprintln!("attention decode over {t_kv} tokens: {:?}", start.elapsed());
    let mut mean = vec![0.0f64; 2 * 128];
    for row in c.v.chunks_exact(256) {
        for (m, &v) in mean.iter_mut().zip(row) {
            *m += v as f64 / t_kv as f64;
        }
    }
    for h in 0..8 {
        let want: Vec<f32> = mean[(h / 4) * 128..][..128]
            .iter()
            .map(|&v| v as f32)
            .collect();
        assert!(
            rel_err(&o[h * 128..][..128], &want) < 1e-5,
            "head {h} (seed {})",
            rng.seed()
        );
    }
    // A real scale on the same data must not average.
    let o = attention(
        &c.q,
        &c.k,
        &c.v,
        t_kv,
        shape,
        &Mask::causal(&[t_kv - 1]),
        0.1,
    );
    let want: Vec<f32> = mean[..128].iter().map(|&v| v as f32).collect();
    assert!(rel_err(&o[..128], &want) > 1e-3, "seed {}", rng.seed());
}
