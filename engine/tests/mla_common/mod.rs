//! Shared by the MLA attention tests (attn_host_emulation, dsa_host_emulation, gpu_attention,
//! gpu_dsa): the reference output of several query tokens over one latent cache, each at its own
//! position, dense or over its own selection of rows.
#![allow(dead_code)]

use memra_reference::attention::{attention, AttnShape, Mask};
use memra_reference::Rng;

/// One query token: its position and, for sparse attention, the rows it attends over.
pub struct Query<'a> {
    pub pos: usize,
    pub rows: Option<&'a [usize]>,
}

/// `out[j] = softmax(scale·q[j]·rowᵀ)·c` over the cache rows query j sees (`0..=pos`, or its
/// selection), MQA over the latent rows `[c | k_pe]` of width `kvl + rope` with `c` as the
/// value: `q` `[queries, n_head, kvl + rope]`, `cache` `[≥ max pos + 1, kvl + rope]` (host
/// values), result `[queries, n_head, kvl]`.
pub fn mla_reference(
    q: &[f32],
    cache: &[f32],
    n_head: usize,
    kvl: usize,
    rope: usize,
    queries: &[Query],
    scale: f32,
) -> Vec<f32> {
    let d = kvl + rope;
    let rows = queries.iter().map(|x| x.pos + 1).max().unwrap_or(0);
    let latent: Vec<f32> = (0..rows)
        .flat_map(|r| cache[r * d..][..kvl].iter().copied())
        .collect();
    let shape = AttnShape {
        n_head,
        n_kv_head: 1,
        head_dim_k: d,
        head_dim_v: kvl,
    };
    let mut out = Vec::with_capacity(queries.len() * n_head * kvl);
    for (j, x) in queries.iter().enumerate() {
        let (p, q_pos) = (x.pos, [x.pos]);
        let allowed = x.rows.map(|r| [r.to_vec()]);
        let mask = Mask {
            q_pos: &q_pos,
            window: None,
            allowed: allowed.as_ref().map(|a| &a[..]),
        };
        out.extend(attention(
            &q[j * n_head * d..][..n_head * d],
            &cache[..(p + 1) * d],
            &latent[..(p + 1) * kvl],
            p + 1,
            shape,
            &mask,
            scale,
        ));
    }
    out
}

/// `n` distinct rows of `0..=pos` in a random order.
pub fn random_rows(rng: &mut Rng, pos: usize, n: usize) -> Vec<usize> {
    let mut all: Vec<usize> = (0..=pos).collect();
    for i in (1..all.len()).rev() {
        all.swap(i, rng.below(i + 1));
    }
    all.truncate(n);
    all
}

/// Host stand-ins for mla_decode.cuh's L2 loads (the text from its `ldcg2(` up to `struct
/// Elem`), for the host emulations that compile the template as C++.
#[allow(dead_code)] // each test binary uses what it needs
pub const LOADS_HOST: &str = "inline float2 ldcg2(const float* p) { float2 v; memcpy(&v, p, 8); return v; }
inline float4 ldcg4(const float* p) { float4 v; memcpy(&v, p, 16); return v; }
";
