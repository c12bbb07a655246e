//! MLA: absorbed (llama.cpp) vs naive (decompressed MHA) at GLM-5 head dims.

mod common;

use common::{OwnedMla, small_glm5_config};
use memra_reference::attention::Mask;
use memra_reference::mla::{
    MlaAttnInputs, MlaCache, MlaDims, MlaMode, mla_attention_absorbed, mla_attention_naive,
    mla_block,
};
use memra_reference::{Rng, rel_err};

/// The acceptance tolerance: ‖absorbed − naive‖ / ‖naive‖.
const TOL: f64 = 1e-5;

struct CoreCase {
    q: Vec<f32>,
    c: Vec<f32>,
    k_pe: Vec<f32>,
    attn_k_b: Vec<f32>,
    attn_v_b: Vec<f32>,
}

impl CoreCase {
    /// Full GLM-5 dims; q, c, k_pe ~ N(0,1) (c is RMS-normed in the model, so O(1)), and the
    /// absorption matrices scaled so that scale·q·k is O(1): the softmax is neither flat nor
    /// one-hot.
    fn random(rng: &mut Rng, t_q: usize, t_kv: usize) -> Self {
        let MlaDims {
            n_head,
            kv_lora,
            nope,
            rope,
            v,
        } = MlaDims::GLM5;
        CoreCase {
            q: rng.normal_vec(t_q * n_head * (nope + rope), 1.0),
            c: rng.normal_vec(t_kv * kv_lora, 1.0),
            k_pe: rng.normal_vec(t_kv * rope, 1.0),
            attn_k_b: rng.normal_vec(n_head * kv_lora * nope, 1.0 / (nope as f32).sqrt()),
            attn_v_b: rng.normal_vec(n_head * v * kv_lora, 1.0 / (kv_lora as f32).sqrt()),
        }
    }

    fn inputs(&self) -> MlaAttnInputs<'_> {
        MlaAttnInputs {
            dims: MlaDims::GLM5,
            q: &self.q,
            c: &self.c,
            k_pe: &self.k_pe,
            attn_k_b: &self.attn_k_b,
            attn_v_b: &self.attn_v_b,
        }
    }
}

fn check_absorbed_matches_naive(
    name: &str,
    t_q: usize,
    t_kv: usize,
    scale: f32,
) -> (Vec<f32>, CoreCase) {
    let mut rng = Rng::from_env_or_time(name);
    let case = CoreCase::random(&mut rng, t_q, t_kv);
    let q_pos: Vec<usize> = (t_kv - t_q..t_kv).collect();
    let mask = Mask::causal(&q_pos);
    let naive = mla_attention_naive(&case.inputs(), &mask, scale);
    let absorbed = mla_attention_absorbed(&case.inputs(), &mask, scale);
    let err = rel_err(&absorbed, &naive);
    eprintln!("{name}: t_q {t_q}, t_kv {t_kv}, scale {scale}: rel err {err:e}");
    assert_eq!(naive.len(), t_q * 64 * 256);
    assert!(naive.iter().any(|&v| v != 0.0), "naive output is all zeros");
    assert!(
        err <= TOL,
        "{name}: rel err {err:e} > {TOL:e} (seed {})",
        rng.seed()
    );
    (naive, case)
}

#[test]
fn absorbed_matches_naive_prefill() {
    let (naive, case) =
        check_absorbed_matches_naive("absorbed_matches_naive_prefill", 16, 16, 1.0 / 16.0);
    // Chunk t_q = 5 appended to a cache of 11 sees the same keys as prefill rows 11..16.
    let q_pos: Vec<usize> = (11..16).collect();
    let chunk_q = &case.q[11 * 64 * 256..];
    let inp = MlaAttnInputs {
        q: chunk_q,
        ..case.inputs()
    };
    let chunk = mla_attention_naive(&inp, &Mask::causal(&q_pos), 1.0 / 16.0);
    assert_eq!(
        chunk,
        naive[11 * 64 * 256..],
        "chunk rows differ from the prefill rows"
    );
}

#[test]
fn absorbed_matches_naive_decode() {
    check_absorbed_matches_naive("absorbed_matches_naive_decode", 1, 23, 1.0 / 256f32.sqrt());
}

#[test]
fn absorbed_matches_naive_chunked() {
    check_absorbed_matches_naive("absorbed_matches_naive_chunked", 5, 16, 1.0 / 16.0);
}

#[test]
fn attention_is_not_uniform_at_these_scales() {
    // Guards the acceptance tests against a degenerate setup: with scale 0 (uniform softmax)
    // the output must differ clearly from the scale-1/16 output.
    let mut rng = Rng::from_env_or_time("attention_is_not_uniform_at_these_scales");
    let case = CoreCase::random(&mut rng, 1, 12);
    let mask = Mask::causal(&[11]);
    let a = mla_attention_absorbed(&case.inputs(), &mask, 1.0 / 16.0);
    let b = mla_attention_absorbed(&case.inputs(), &mask, 0.0);
    assert!(rel_err(&a, &b) > 0.1, "seed {}", rng.seed());
}

#[test]
fn mla_block_absorbed_matches_naive_and_chunks_match_prefill() {
    let mut rng =
        Rng::from_env_or_time("mla_block_absorbed_matches_naive_and_chunks_match_prefill");
    let cfg = small_glm5_config(8);
    let owned = OwnedMla::random(&mut rng, &cfg);
    let w = owned.view();
    let t = 16;
    let x = rng.normal_vec(t * cfg.n_embd, 1.0);

    let mut cache_naive = MlaCache::new(cfg.dims);
    let naive = mla_block(&w, &cfg, &x, &mut cache_naive, None, MlaMode::Naive);
    let mut cache_abs = MlaCache::new(cfg.dims);
    let absorbed = mla_block(&w, &cfg, &x, &mut cache_abs, None, MlaMode::Absorbed);
    assert_eq!(cache_abs.len(), t);
    let err = rel_err(&absorbed, &naive);
    eprintln!("block prefill rel err {err:e}");
    assert!(
        err <= TOL,
        "block prefill rel err {err:e} (seed {})",
        rng.seed()
    );

    // Prefill 11 then a chunk of 5 reproduces rows 11..16 of the 16-token prefill exactly.
    let n = cfg.n_embd;
    let mut cache = MlaCache::new(cfg.dims);
    let first = mla_block(&w, &cfg, &x[..11 * n], &mut cache, None, MlaMode::Absorbed);
    let chunk = mla_block(&w, &cfg, &x[11 * n..], &mut cache, None, MlaMode::Absorbed);
    assert_eq!(first, absorbed[..11 * n], "seed {}", rng.seed());
    assert_eq!(chunk, absorbed[11 * n..], "seed {}", rng.seed());

    // Token-by-token decode too, in naive mode.
    let mut cache = MlaCache::new(cfg.dims);
    for ti in 0..t {
        let row = mla_block(
            &w,
            &cfg,
            &x[ti * n..][..n],
            &mut cache,
            None,
            MlaMode::Naive,
        );
        assert_eq!(
            row,
            naive[ti * n..][..n],
            "decode token {ti} (seed {})",
            rng.seed()
        );
    }
}
