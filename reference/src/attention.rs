//! Scaled dot-product attention with GQA, causal mask, optional sliding window and optional
//! per-query allow-lists (model-specs §2 soft_max_ext, §5.1 sliding window, §8.2 index mask).
//!
//! For query token `t`, head `h` (kv head `h / (n_head / n_kv_head)`, ggml's broadcast):
//! `o = Σ_s p_s·v_s`, `p = softmax_s(scale · q·k_s)` over the visible keys `s` only.
//! Scores, softmax and the weighted sum are f64; the output is rounded to f32.

use crate::act::softmax_f64;

/// Head counts and head sizes. `n_head` must be a multiple of `n_kv_head`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub n_head: usize,
    pub n_kv_head: usize,
    /// Length of q and k head vectors.
    pub head_dim_k: usize,
    /// Length of v head vectors (and of the output per head).
    pub head_dim_v: usize,
}

/// Which keys each query sees. KV row `s` has position `s`.
///
/// Key `s` is visible to query `t` iff all of:
/// - causal: `s ≤ q_pos[t]`;
/// - sliding window `W` (if set): `q_pos[t] − s < W`, i.e. `q_pos[t] − W < s`. This is
///   llama.cpp's `is_masked_swa` (STANDARD): masked iff `p1 − p0 ≥ n_swa`, so a query sees
///   itself and the `W − 1` previous positions (§5.1);
/// - allow-list (if set): `s ∈ allowed[t]` (DSA top-k, §8.2 step 9).
#[derive(Copy, Clone, Debug)]
pub struct Mask<'a> {
    /// Position of each query token; `q_pos.len()` is the number of queries.
    pub q_pos: &'a [usize],
    pub window: Option<usize>,
    pub allowed: Option<&'a [Vec<usize>]>,
}

impl<'a> Mask<'a> {
    /// Plain causal mask.
    pub fn causal(q_pos: &'a [usize]) -> Self {
        Mask {
            q_pos,
            window: None,
            allowed: None,
        }
    }

    pub fn is_visible(&self, t: usize, s: usize) -> bool {
        self.in_window(t, s) && self.allowed.is_none_or(|allowed| allowed[t].contains(&s))
    }

    /// Causal and sliding-window part of the rule.
    fn in_window(&self, t: usize, s: usize) -> bool {
        let p = self.q_pos[t];
        s <= p && self.window.is_none_or(|w| p - s < w)
    }

    /// Visible kv rows of query `t` among `0..t_kv`, ascending, without duplicates.
    pub fn visible_keys(&self, t: usize, t_kv: usize) -> Vec<usize> {
        match self.allowed {
            Some(allowed) => {
                let mut keys: Vec<usize> = allowed[t]
                    .iter()
                    .copied()
                    .filter(|&s| s < t_kv && self.in_window(t, s))
                    .collect();
                keys.sort_unstable();
                keys.dedup();
                keys
            }
            None => (0..t_kv).filter(|&s| self.in_window(t, s)).collect(),
        }
    }

    pub(crate) fn check(&self, t_q: usize, t_kv: usize, what: &str) {
        assert_eq!(
            self.q_pos.len(),
            t_q,
            "{what}: q_pos.len() {} != t_q {t_q}",
            self.q_pos.len()
        );
        for (t, &p) in self.q_pos.iter().enumerate() {
            assert!(
                p < t_kv,
                "{what}: query {t} at position {p} but the kv cache has {t_kv} rows"
            );
        }
        if let Some(allowed) = self.allowed {
            assert_eq!(
                allowed.len(),
                t_q,
                "{what}: allowed.len() {} != t_q {t_q}",
                allowed.len()
            );
            for (t, list) in allowed.iter().enumerate() {
                if let Some(&s) = list.iter().find(|&&s| s >= t_kv) {
                    panic!(
                        "{what}: allowed[{t}] holds kv row {s} but the kv cache has {t_kv} rows"
                    );
                }
            }
        }
        if let Some(w) = self.window {
            assert!(w > 0, "{what}: sliding window 0 hides every key");
        }
    }
}

/// Attention of one query head over the visible keys: returns `Σ_s p_s·v_s` in f64.
/// `key(s)` and `value(s)` give the head vectors of kv row `s`.
pub(crate) fn attend_one<'k>(
    q: &[f32],
    visible: &[usize],
    scale: f32,
    key: impl Fn(usize) -> &'k [f32],
    value: impl Fn(usize) -> &'k [f32],
    head_dim_v: usize,
) -> Vec<f64> {
    let scores: Vec<f64> = visible
        .iter()
        .map(|&s| scale as f64 * crate::linear::dot(q, key(s)))
        .collect();
    let p = softmax_f64(&scores);
    let mut o = vec![0.0f64; head_dim_v];
    for (&s, &ps) in visible.iter().zip(&p) {
        let v = value(s);
        for e in 0..head_dim_v {
            o[e] += ps * v[e] as f64;
        }
    }
    o
}

/// GQA attention.
/// - `q`: `[t_q, n_head, head_dim_k]`
/// - `k`: `[t_kv, n_kv_head, head_dim_k]`, `v`: `[t_kv, n_kv_head, head_dim_v]`
/// - returns `[t_q, n_head, head_dim_v]`.
///
/// A query with no visible key (only possible with an empty allow-list) gets zeros.
///
/// # Panics
/// On shape mismatches, or a query position `≥ t_kv`.
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    t_kv: usize,
    shape: AttnShape,
    mask: &Mask,
    scale: f32,
) -> Vec<f32> {
    let AttnShape {
        n_head,
        n_kv_head,
        head_dim_k: dk,
        head_dim_v: dv,
    } = shape;
    assert!(
        n_kv_head > 0 && n_head % n_kv_head == 0,
        "attention: n_head {n_head} not a multiple of n_kv_head {n_kv_head}"
    );
    let t_q = mask.q_pos.len();
    assert_eq!(
        q.len(),
        t_q * n_head * dk,
        "attention: q.len() != t_q·n_head·head_dim_k"
    );
    assert_eq!(
        k.len(),
        t_kv * n_kv_head * dk,
        "attention: k.len() != t_kv·n_kv_head·head_dim_k"
    );
    assert_eq!(
        v.len(),
        t_kv * n_kv_head * dv,
        "attention: v.len() != t_kv·n_kv_head·head_dim_v"
    );
    mask.check(t_q, t_kv, "attention");
    let group = n_head / n_kv_head;

    // Query rows are independent: split them over threads (same arithmetic per row).
    crate::models::par_rows(t_q, n_head * t_kv * (dk + dv), |first, rows| {
        let mut out = vec![0.0f32; rows * n_head * dv];
        for t in first..first + rows {
            let visible = mask.visible_keys(t, t_kv);
            for h in 0..n_head {
                let kvh = h / group;
                let qh = &q[(t * n_head + h) * dk..][..dk];
                let o = attend_one(
                    qh,
                    &visible,
                    scale,
                    |s| &k[(s * n_kv_head + kvh) * dk..][..dk],
                    |s| &v[(s * n_kv_head + kvh) * dv..][..dv],
                    dv,
                );
                for (dst, src) in out[((t - first) * n_head + h) * dv..][..dv]
                    .iter_mut()
                    .zip(o)
                {
                    *dst = src as f32;
                }
            }
        }
        out
    })
}
