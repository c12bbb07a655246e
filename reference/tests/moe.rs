//! MoE routing on hand-checkable cases, and the MoE FFN against dense FFNs.

use memra_reference::act::sigmoid;
use memra_reference::moe::{
    FfnAct, FfnWeights, Gating, MoeConfig, MoeWeights, RouterConfig, ffn_gated, moe_ffn, route,
};
use memra_reference::{Rng, rel_err};

fn cfg(gating: Gating, n_used: usize, norm: bool, scale: f32) -> RouterConfig {
    RouterConfig {
        gating,
        n_used,
        norm,
        scale,
    }
}

fn close(a: f32, b: f64) -> bool {
    (a as f64 - b).abs() <= 1e-6 * b.abs().max(1.0)
}

#[test]
fn softmax_without_renorm_weights_are_the_probs() {
    // olmoe: softmax, top-2 of [1, 3, 2, 0] -> experts 1, 2 with e^3/S, e^2/S.
    let s: f64 = [1.0f64, 3.0, 2.0, 0.0].iter().map(|v| v.exp()).sum();
    let r = route(
        &[1.0, 3.0, 2.0, 0.0],
        None,
        &cfg(Gating::Softmax, 2, false, 1.0),
    );
    assert_eq!(r.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 2]);
    assert!(
        close(r[0].1, 3f64.exp() / s) && close(r[1].1, 2f64.exp() / s),
        "{r:?}"
    );
    // Scale 0 and 1 both mean "no scaling".
    assert_eq!(
        route(
            &[1.0, 3.0, 2.0, 0.0],
            None,
            &cfg(Gating::Softmax, 2, false, 0.0)
        ),
        r
    );
}

#[test]
fn bias_changes_selection_but_not_weights() {
    let logits = [0.0, 1.0, -1.0, 2.0];
    let plain = route(&logits, None, &cfg(Gating::Sigmoid, 2, false, 1.0));
    assert_eq!(plain.iter().map(|p| p.0).collect::<Vec<_>>(), vec![3, 1]);
    assert!(
        close(plain[0].1, 1.0 / (1.0 + (-2f64).exp()))
            && close(plain[1].1, 1.0 / (1.0 + (-1f64).exp()))
    );
    // A bias of +5 on expert 2 puts it first; its weight is still sigmoid(−1).
    let bias = [0.0, 0.0, 5.0, 0.0];
    let biased = route(&logits, Some(&bias), &cfg(Gating::Sigmoid, 2, false, 1.0));
    assert_eq!(biased.iter().map(|p| p.0).collect::<Vec<_>>(), vec![2, 3]);
    assert!(close(biased[0].1, 1.0 / (1.0 + 1f64.exp())), "{biased:?}");
    assert_eq!(biased[1].1, plain[0].1);
}

#[test]
fn renorm_sums_to_scale() {
    let mut rng = Rng::from_env_or_time("renorm_sums_to_scale");
    let logits = rng.normal_vec(256, 2.0);
    let bias = rng.normal_vec(256, 0.1);
    // glm-dsa: sigmoid, bias, top-8, renorm, ×2.5.
    let r = route(&logits, Some(&bias), &cfg(Gating::Sigmoid, 8, true, 2.5));
    assert_eq!(r.len(), 8);
    let sum: f64 = r.iter().map(|p| p.1 as f64).sum();
    assert!((sum - 2.5).abs() < 1e-5, "sum {sum} (seed {})", rng.seed());
    // The ratios are those of the unbiased sigmoids.
    for p in &r {
        let ratio = p.1 as f64 / r[0].1 as f64;
        let want = sigmoid(logits[p.0]) as f64 / sigmoid(logits[r[0].0]) as f64;
        assert!((ratio - want).abs() < 1e-5, "seed {}", rng.seed());
    }
    // Selection order: biased score descending.
    for pair in r.windows(2) {
        let score = |e: usize| sigmoid(logits[e]) + bias[e];
        assert!(score(pair[0].0) >= score(pair[1].0), "seed {}", rng.seed());
    }
    // Without renorm, scale 2 doubles the probs.
    let r2 = route(&[0.0, 1.0], None, &cfg(Gating::Sigmoid, 1, false, 2.0));
    assert!(close(r2[0].1, 2.0 / (1.0 + (-1f64).exp())), "{r2:?}");
}

#[test]
fn renorm_denominator_is_clamped() {
    // sigmoid(−20)·2 ≈ 4.1e-9 < 6.103515625e-5: the weights are p / 6.103515625e-5, not 1/2.
    let r = route(
        &[-20.0, -20.0, -30.0],
        None,
        &cfg(Gating::Sigmoid, 2, true, 1.0),
    );
    let p = 1.0 / (1.0 + 20f64.exp());
    assert!(close(r[0].1, p / 6.103515625e-5), "{r:?}");
    assert!(r[0].1 < 1e-3);
}

#[test]
fn equal_scores_prefer_the_lower_expert() {
    let r = route(
        &[0.5, 1.0, 1.0, 1.0],
        None,
        &cfg(Gating::Softmax, 2, false, 1.0),
    );
    assert_eq!(r.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 2]);
}

struct Experts {
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
}

fn random_ffn(rng: &mut Rng, n_embd: usize, n_ff: usize) -> Experts {
    Experts {
        gate: rng.normal_vec(n_embd * n_ff, 1.0 / (n_embd as f32).sqrt()),
        up: rng.normal_vec(n_embd * n_ff, 1.0 / (n_embd as f32).sqrt()),
        down: rng.normal_vec(n_ff * n_embd, 1.0 / (n_ff as f32).sqrt()),
    }
}

impl Experts {
    fn view(&self) -> FfnWeights<'_> {
        FfnWeights {
            ffn_gate: &self.gate,
            ffn_up: &self.up,
            ffn_down: &self.down,
        }
    }
}

#[test]
fn moe_of_identical_experts_with_all_weights_equals_dense_plus_shared() {
    let mut rng =
        Rng::from_env_or_time("moe_of_identical_experts_with_all_weights_equals_dense_plus_shared");
    let (n_embd, n_ff, n_expert, t) = (48, 32, 4, 3);
    let one = random_ffn(&mut rng, n_embd, n_ff);
    let shared = random_ffn(&mut rng, n_embd, 16);
    let rep = |v: &Vec<f32>| v.repeat(n_expert);
    let (gate, up, down) = (rep(&one.gate), rep(&one.up), rep(&one.down));
    let router = rng.normal_vec(n_embd * n_expert, 1.0);
    let x = rng.normal_vec(t * n_embd, 1.0);
    // Softmax over every expert, no renorm: the weights sum to 1.
    let moe_cfg = MoeConfig {
        n_embd,
        n_ff,
        n_expert,
        n_ff_shared: 16,
        router: cfg(Gating::Softmax, n_expert, false, 1.0),
    };
    let mut w = MoeWeights {
        ffn_gate_inp: &router,
        exp_probs_b: None,
        ffn_gate_exps: &gate,
        ffn_up_exps: &up,
        ffn_down_exps: &down,
        shared: None,
    };
    let dense = ffn_gated(&one.view(), n_embd, n_ff, FfnAct::Silu, &x);
    let err = rel_err(&moe_ffn(&w, &moe_cfg, &x), &dense);
    assert!(err < 1e-6, "routed: {err:e} (seed {})", rng.seed());

    w.shared = Some(shared.view());
    let shared_out = ffn_gated(&shared.view(), n_embd, 16, FfnAct::Silu, &x);
    let want: Vec<f32> = dense.iter().zip(&shared_out).map(|(a, b)| a + b).collect();
    let err = rel_err(&moe_ffn(&w, &moe_cfg, &x), &want);
    assert!(err < 1e-6, "routed + shared: {err:e} (seed {})", rng.seed());
}

#[test]
fn moe_top1_renorm_picks_one_expert_with_weight_scale() {
    let mut rng = Rng::from_env_or_time("moe_top1_renorm_picks_one_expert_with_weight_scale");
    let (n_embd, n_ff, n_expert) = (40, 24, 5);
    let experts: Vec<Experts> = (0..n_expert)
        .map(|_| random_ffn(&mut rng, n_embd, n_ff))
        .collect();
    let cat = |f: fn(&Experts) -> &Vec<f32>| {
        experts
            .iter()
            .flat_map(|e| f(e).clone())
            .collect::<Vec<f32>>()
    };
    let (gate, up, down) = (cat(|e| &e.gate), cat(|e| &e.up), cat(|e| &e.down));
    // Logits ~ N(0, 1): sigmoid stays far above the 6.1e-5 renorm clamp.
    let router = rng.normal_vec(n_embd * n_expert, 1.0 / (n_embd as f32).sqrt());
    let x = rng.normal_vec(n_embd, 1.0);
    // The bias forces expert 3; renorm makes its weight 1, then ×2.5.
    let mut bias = vec![0.0f32; n_expert];
    bias[3] = 10.0;
    let moe_cfg = MoeConfig {
        n_embd,
        n_ff,
        n_expert,
        n_ff_shared: 0,
        router: cfg(Gating::Sigmoid, 1, true, 2.5),
    };
    let w = MoeWeights {
        ffn_gate_inp: &router,
        exp_probs_b: Some(&bias),
        ffn_gate_exps: &gate,
        ffn_up_exps: &up,
        ffn_down_exps: &down,
        shared: None,
    };
    let want: Vec<f32> = ffn_gated(&experts[3].view(), n_embd, n_ff, FfnAct::Silu, &x)
        .iter()
        .map(|v| v * 2.5)
        .collect();
    let err = rel_err(&moe_ffn(&w, &moe_cfg, &x), &want);
    assert!(err < 1e-6, "{err:e} (seed {})", rng.seed());
}
