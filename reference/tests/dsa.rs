//! DSA lightning indexer, exact top-k and sparse MLA (GLM-5 head dims, small n_embd).

mod common;

use common::{OwnedIndexer, OwnedMla, small_glm5_config, small_glm5_indexer};
use memra_reference::attention::Mask;
use memra_reference::dsa::{
    IndexerCache, dsa_mla_block, indexer_k, indexer_q, indexer_scores, indexer_weights,
    select_top_k, top_k,
};
use memra_reference::linear::matmul;
use memra_reference::mla::{
    MlaAttnInputs, MlaCache, MlaMode, mla_attention_absorbed, mla_block, mla_project,
};
use memra_reference::norm::layer_norm;
use memra_reference::rope::{Rope, RopeMode};
use memra_reference::{Rng, rel_err};

/// Independent definition of the selected set: `i` is kept iff fewer than `k` indices rank
/// above it (higher score, or equal score and lower index).
fn brute_force_top_k(scores: &[f32], k: usize) -> Vec<usize> {
    (0..scores.len())
        .filter(|&i| {
            let above = (0..scores.len())
                .filter(|&j| scores[j] > scores[i] || (scores[j] == scores[i] && j < i))
                .count();
            above < k
        })
        .collect()
}

#[test]
fn top_k_hand_cases_and_tie_break() {
    let s = [0.5, 2.0, 2.0, -1.0, 3.0];
    assert_eq!(top_k(&s, 2), vec![1, 4]);
    assert_eq!(top_k(&s, 3), vec![1, 2, 4]);
    assert_eq!(top_k(&s, 0), Vec::<usize>::new());
    assert_eq!(top_k(&s, 9), vec![0, 1, 2, 3, 4]);
    // -0 ties with +0: the lower index wins.
    assert_eq!(top_k(&[0.0, -0.0, 0.0, 1.0], 2), vec![0, 3]);
    assert_eq!(top_k(&[-0.0, 0.0, 1.0], 2), vec![0, 2]);
    assert_eq!(top_k(&[1.0; 6], 4), vec![0, 1, 2, 3]);
}

#[test]
fn top_k_matches_brute_force_on_random_scores_with_ties() {
    let mut rng = Rng::from_env_or_time("top_k_matches_brute_force_on_random_scores_with_ties");
    for _ in 0..200 {
        let n = 1 + rng.below(300);
        // Coarse values so that ties are frequent.
        let scores: Vec<f32> = (0..n)
            .map(|_| (rng.below(20) as f32 - 10.0) * 0.25)
            .collect();
        let k = rng.below(n + 3);
        assert_eq!(
            top_k(&scores, k),
            brute_force_top_k(&scores, k),
            "n {n} k {k} (seed {})",
            rng.seed()
        );
    }
}

#[test]
fn indexer_keys_rope_the_leading_dims_only() {
    let mut rng = Rng::from_env_or_time("indexer_keys_rope_the_leading_dims_only");
    let mla_cfg = small_glm5_config(2);
    let cfg = small_glm5_indexer(&mla_cfg, 2048);
    let owned = OwnedIndexer::random(&mut rng, &cfg);
    let w = owned.view();
    let x = rng.normal_vec(3 * cfg.n_embd, 1.0);
    let k = indexer_k(&w, &cfg, &x, &[0, 7, 300]);
    let normed = layer_norm(
        &matmul(w.attn_k, cfg.n_embd, 128, &x, 3),
        w.k_norm_weight,
        w.k_norm_bias,
        cfg.k_norm_eps,
    );
    assert_eq!(
        k[..128],
        normed[..128],
        "position 0 must leave the key unchanged"
    );
    for t in 1..3 {
        assert_eq!(
            k[t * 128 + 64..][..64],
            normed[t * 128 + 64..][..64],
            "token {t}: nope part changed"
        );
        assert_ne!(
            k[t * 128..][..64],
            normed[t * 128..][..64],
            "token {t}: rope part unchanged"
        );
    }
    // NeoX is selectable and differs from interleaved away from position 0.
    let neox = indexer_k(&w, &small_cfg_with(cfg, RopeMode::Neox), &x, &[0, 7, 300]);
    assert_eq!(neox[..128], k[..128]);
    assert_ne!(neox[128..], k[128..]);
}

fn small_cfg_with(
    cfg: memra_reference::dsa::IndexerConfig,
    mode: RopeMode,
) -> memra_reference::dsa::IndexerConfig {
    memra_reference::dsa::IndexerConfig {
        rope: Rope { mode, ..cfg.rope },
        ..cfg
    }
}

#[test]
fn indexer_scores_match_formula_and_are_hadamard_invariant() {
    let mut rng = Rng::from_env_or_time("indexer_scores_match_formula_and_are_hadamard_invariant");
    let mla_cfg = small_glm5_config(2);
    let cfg = small_glm5_indexer(&mla_cfg, 2048);
    let owned = OwnedIndexer::random(&mut rng, &cfg);
    let w = owned.view();
    let t = 9;
    let pos: Vec<usize> = (0..t).collect();
    let x = rng.normal_vec(t * cfg.n_embd, 1.0);
    let qr = rng.normal_vec(t * cfg.q_lora, 1.0);
    let q = indexer_q(&w, &cfg, &qr, &pos);
    let k = indexer_k(&w, &cfg, &x, &pos);
    let iw = indexer_weights(&w, &cfg, &x, t);
    let scores = indexer_scores(&q, &iw, &k, cfg.dims, &pos);

    // Weights are proj·x / sqrt(128·32).
    let raw = matmul(w.proj, cfg.n_embd, 32, &x, t);
    for i in 0..raw.len() {
        assert!((iw[i] - raw[i] / 64.0).abs() <= 1e-6 * raw[i].abs().max(1.0));
    }
    // Direct f32 evaluation of Σ_h w_h·relu(q_h·k_s), and −∞ above the diagonal.
    for tq in 0..t {
        for s in 0..t {
            let got = scores[tq * t + s];
            if s > tq {
                assert_eq!(got, f32::NEG_INFINITY, "({tq}, {s}) must be masked");
                continue;
            }
            let mut want = 0.0f32;
            for h in 0..32 {
                let qk: f32 = (0..128)
                    .map(|d| q[(tq * 32 + h) * 128 + d] * k[s * 128 + d])
                    .sum();
                want += iw[tq * 32 + h] * qk.max(0.0);
            }
            assert!(
                (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                "({tq}, {s}): {got} vs {want} (seed {})",
                rng.seed()
            );
        }
    }

    // An orthonormal Hadamard rotation of q and k (what llama.cpp applies) changes nothing.
    let hadamard = |v: &[f32]| -> Vec<f32> {
        v.chunks_exact(128)
            .flat_map(|row| {
                (0..128usize).map(move |i| {
                    let s: f32 = (0..128)
                        .map(|j| {
                            if (i & j).count_ones() % 2 == 0 {
                                row[j]
                            } else {
                                -row[j]
                            }
                        })
                        .sum();
                    s / 128f32.sqrt()
                })
            })
            .collect()
    };
    let rotated = indexer_scores(&hadamard(&q), &iw, &hadamard(&k), cfg.dims, &pos);
    let finite = |v: &[f32]| {
        v.iter()
            .map(|&x| if x.is_finite() { x } else { 0.0 })
            .collect::<Vec<_>>()
    };
    let err = rel_err(&finite(&rotated), &finite(&scores));
    assert!(
        err < 1e-5,
        "Hadamard changed the scores: {err:e} (seed {})",
        rng.seed()
    );
}

#[test]
fn dsa_equals_dense_mla_when_visible_fits_top_k() {
    let mut rng = Rng::from_env_or_time("dsa_equals_dense_mla_when_visible_fits_top_k");
    let mla_cfg = small_glm5_config(8);
    let mla_owned = OwnedMla::random(&mut rng, &mla_cfg);
    let t = 16;
    let x = rng.normal_vec(t * mla_cfg.n_embd, 1.0);
    let mut dense_cache = MlaCache::new(mla_cfg.dims);
    let dense = mla_block(
        &mla_owned.view(),
        &mla_cfg,
        &x,
        &mut dense_cache,
        None,
        MlaMode::Absorbed,
    );

    // top_k = 2048 (GLM-5) and top_k = t (boundary) both select every visible key.
    for top in [2048, t] {
        let cfg = small_glm5_indexer(&mla_cfg, top);
        let idx_owned = OwnedIndexer::random(&mut rng, &cfg);
        let n = mla_cfg.n_embd;
        let mut cache = MlaCache::new(mla_cfg.dims);
        let mut idx_cache = IndexerCache::default();
        // Prefill 11, then a chunk of 5: exercises the caches too.
        let (a, sel_a) = dsa_mla_block(
            &mla_owned.view(),
            &mla_cfg,
            &idx_owned.view(),
            &cfg,
            &x[..11 * n],
            &mut cache,
            &mut idx_cache,
            MlaMode::Absorbed,
        );
        let (b, sel_b) = dsa_mla_block(
            &mla_owned.view(),
            &mla_cfg,
            &idx_owned.view(),
            &cfg,
            &x[11 * n..],
            &mut cache,
            &mut idx_cache,
            MlaMode::Absorbed,
        );
        for (t, sel) in sel_a.iter().chain(&sel_b).enumerate() {
            assert_eq!(*sel, (0..=t).collect::<Vec<_>>(), "top {top}: query {t}");
        }
        let sparse: Vec<f32> = a.into_iter().chain(b).collect();
        assert_eq!(
            sparse,
            dense,
            "top {top}: DSA output differs from dense MLA (seed {})",
            rng.seed()
        );
    }
}

#[test]
fn dsa_selects_exactly_top_k_visible_keys_when_more_are_visible() {
    let mut rng =
        Rng::from_env_or_time("dsa_selects_exactly_top_k_visible_keys_when_more_are_visible");
    let mla_cfg = small_glm5_config(4);
    let top = 5;
    let cfg = small_glm5_indexer(&mla_cfg, top);
    let mla_owned = OwnedMla::random(&mut rng, &mla_cfg);
    let idx_owned = OwnedIndexer::random(&mut rng, &cfg);
    let t = 24;
    let x = rng.normal_vec(t * mla_cfg.n_embd, 1.0);
    let mut cache = MlaCache::new(mla_cfg.dims);
    let mut idx_cache = IndexerCache::default();
    let (out, selected) = dsa_mla_block(
        &mla_owned.view(),
        &mla_cfg,
        &idx_owned.view(),
        &cfg,
        &x,
        &mut cache,
        &mut idx_cache,
        MlaMode::Naive,
    );

    // Recompute the scores from the public pieces and check every selection against brute force.
    let pos: Vec<usize> = (0..t).collect();
    let proj = mla_project(&mla_owned.view(), &mla_cfg, &x, &pos);
    let iq = indexer_q(&idx_owned.view(), &cfg, &proj.qr, &pos);
    let ik = indexer_k(&idx_owned.view(), &cfg, &x, &pos);
    assert_eq!(ik, idx_cache.k);
    let iw = indexer_weights(&idx_owned.view(), &cfg, &x, t);
    let scores = indexer_scores(&iq, &iw, &ik, cfg.dims, &pos);
    assert_eq!(selected, select_top_k(&scores, &pos, t, top));
    for (tq, sel) in selected.iter().enumerate() {
        assert_eq!(sel.len(), top.min(tq + 1), "query {tq}: {sel:?}");
        assert!(
            sel.iter().all(|&s| s <= tq),
            "query {tq} selected a future key: {sel:?}"
        );
        assert_eq!(
            *sel,
            brute_force_top_k(&scores[tq * t..][..=tq], top),
            "query {tq} (seed {})",
            rng.seed()
        );
    }

    // Sparse MLA over the selection equals dense MLA over a cache holding only those rows.
    let n = mla_cfg.n_embd;
    let dims = mla_cfg.dims;
    for tq in [7, 23] {
        let sel = &selected[tq];
        let c: Vec<f32> = sel
            .iter()
            .flat_map(|&s| cache.c[s * dims.kv_lora..][..dims.kv_lora].to_vec())
            .collect();
        let k_pe: Vec<f32> = sel
            .iter()
            .flat_map(|&s| cache.k_pe[s * dims.rope..][..dims.rope].to_vec())
            .collect();
        let dq = dims.nope + dims.rope;
        let inp = MlaAttnInputs {
            dims,
            q: &proj.q[tq * dims.n_head * dq..][..dims.n_head * dq],
            c: &c,
            k_pe: &k_pe,
            attn_k_b: &mla_owned.attn_k_b,
            attn_v_b: &mla_owned.attn_v_b,
        };
        let o = mla_attention_absorbed(&inp, &Mask::causal(&[sel.len() - 1]), mla_cfg.kq_scale);
        let want = matmul(&mla_owned.attn_output, dims.n_head * dims.v, n, &o, 1);
        let err = rel_err(&out[tq * n..][..n], &want);
        assert!(
            err <= 1e-5,
            "query {tq}: rel err {err:e} (seed {})",
            rng.seed()
        );
    }
    // And the restriction matters: dense attention differs for the last query.
    let mut dense_cache = MlaCache::new(dims);
    let dense = mla_block(
        &mla_owned.view(),
        &mla_cfg,
        &x,
        &mut dense_cache,
        None,
        MlaMode::Naive,
    );
    assert!(
        rel_err(&out[23 * n..], &dense[23 * n..]) > 1e-3,
        "seed {}",
        rng.seed()
    );
}

#[test]
fn zero_indexer_weights_tie_everywhere_and_keep_the_earliest_keys() {
    let mut rng =
        Rng::from_env_or_time("zero_indexer_weights_tie_everywhere_and_keep_the_earliest_keys");
    let mla_cfg = small_glm5_config(2);
    let cfg = small_glm5_indexer(&mla_cfg, 3);
    let owned = OwnedIndexer::random(&mut rng, &cfg);
    let t = 8;
    let pos: Vec<usize> = (0..t).collect();
    let x = rng.normal_vec(t * cfg.n_embd, 1.0);
    let qr = rng.normal_vec(t * cfg.q_lora, 1.0);
    let q = indexer_q(&owned.view(), &cfg, &qr, &pos);
    let k = indexer_k(&owned.view(), &cfg, &x, &pos);
    let zero = vec![0.0f32; t * 32];
    let scores = indexer_scores(&q, &zero, &k, cfg.dims, &pos);
    let sel = select_top_k(&scores, &pos, t, 3);
    for (tq, s) in sel.iter().enumerate() {
        assert_eq!(*s, (0..=tq.min(2)).collect::<Vec<_>>(), "query {tq}");
    }
}
