//! Multi-head latent attention (model-specs §6, GLM-5 dims §7): the naive (decompressed) and
//! the absorbed form of the attention core, and a whole MLA attention block from the normed
//! hidden state to `attn_output`.
//!
//! Tensor layouts (row-major, GGUF ne reversed):
//! - `q`: `[t_q, n_head, nope + rope]`, each head `[q_nope | q_pe]`, already projected and
//!   roped (§7.4: nope first, rope last).
//! - latent cache `c`: `[t_kv, kv_lora]` (already `attn_kv_a_norm`ed), `k_pe`: `[t_kv, rope]`
//!   (roped, one copy shared by all heads).
//! - `attn_k_b`: `[n_head, kv_lora, nope]` (GGUF ne `{nope, kv_lora, n_head}`, §6.2).
//! - `attn_v_b`: `[n_head, v, kv_lora]` (GGUF ne `{kv_lora, v, n_head}`, §6.2).
//! - output of the core: `[t_q, n_head, v]` (= `concat_h(o_h)`, the input of `attn_output`).

use crate::attention::{AttnShape, Mask, attention};
use crate::linear::dot;
// `linear::matmul`'s arithmetic with the rows split over threads (GLM-5-dim prefills).
use crate::models::par_matmul;
use crate::norm::rms_norm;
use crate::rope::{Rope, RopeMode, rope_head};

/// MLA head geometry.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct MlaDims {
    pub n_head: usize,
    /// Latent width (`attention.kv_lora_rank`).
    pub kv_lora: usize,
    /// `qk_nope_head_dim`.
    pub nope: usize,
    /// `qk_rope_head_dim` (= `rope.dimension_count`).
    pub rope: usize,
    /// `v_head_dim` (= `value_length_mla`).
    pub v: usize,
}

impl MlaDims {
    /// GLM-5 / 5.1 (§7.1): 64 heads, kv_lora 512, nope 192, rope 64, v 256.
    pub const GLM5: MlaDims = MlaDims {
        n_head: 64,
        kv_lora: 512,
        nope: 192,
        rope: 64,
        v: 256,
    };

    /// `nope + rope`, the real q/k head size (`key_length_mla`); the softmax scale uses it.
    pub fn qk_head_dim(&self) -> usize {
        self.nope + self.rope
    }
}

/// Naive or absorbed evaluation of the same attention.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum MlaMode {
    /// Decompress `k_nope = W_UK·c`, `v = W_UV·c` per head, then standard MHA (§6.3 last line).
    Naive,
    /// llama.cpp's form (§6.3 steps 5-8): MQA over the cached `[c | k_pe]`.
    Absorbed,
}

/// Inputs of the attention core (see the module doc for layouts).
#[derive(Copy, Clone, Debug)]
pub struct MlaAttnInputs<'a> {
    pub dims: MlaDims,
    pub q: &'a [f32],
    pub c: &'a [f32],
    pub k_pe: &'a [f32],
    pub attn_k_b: &'a [f32],
    pub attn_v_b: &'a [f32],
}

impl MlaAttnInputs<'_> {
    /// Checks every length; returns `(t_q, t_kv)`.
    fn check(&self, mask: &Mask) -> (usize, usize) {
        let MlaDims {
            n_head,
            kv_lora,
            nope,
            rope,
            v,
        } = self.dims;
        let t_q = mask.q_pos.len();
        assert!(
            kv_lora > 0 && self.c.len().is_multiple_of(kv_lora),
            "mla: c.len() {} not a multiple of kv_lora {kv_lora}",
            self.c.len()
        );
        let t_kv = self.c.len() / kv_lora;
        assert_eq!(
            self.q.len(),
            t_q * n_head * (nope + rope),
            "mla: q.len() != t_q·n_head·(nope+rope)"
        );
        assert_eq!(self.k_pe.len(), t_kv * rope, "mla: k_pe.len() != t_kv·rope");
        assert_eq!(
            self.attn_k_b.len(),
            n_head * kv_lora * nope,
            "mla: attn_k_b.len() != n_head·kv_lora·nope"
        );
        assert_eq!(
            self.attn_v_b.len(),
            n_head * v * kv_lora,
            "mla: attn_v_b.len() != n_head·v·kv_lora"
        );
        mask.check(t_q, t_kv, "mla");
        (t_q, t_kv)
    }
}

/// [`mla_attention_naive`] or [`mla_attention_absorbed`].
pub fn mla_attention(inp: &MlaAttnInputs, mask: &Mask, scale: f32, mode: MlaMode) -> Vec<f32> {
    match mode {
        MlaMode::Naive => mla_attention_naive(inp, mask, scale),
        MlaMode::Absorbed => mla_attention_absorbed(inp, mask, scale),
    }
}

/// Naive MLA: per kv row `s` and head `h`,
/// `k_nope[s,h,d] = Σ_c attn_k_b[h][c][d]·c_s[c]`, `K[s,h] = [k_nope[s,h] | k_pe_s]`,
/// `V[s,h,e] = Σ_c attn_v_b[h][e][c]·c_s[c]`; then MHA `o = Σ_s softmax(scale·q·K_s)·V_s`.
/// Returns `[t_q, n_head, v]`.
pub fn mla_attention_naive(inp: &MlaAttnInputs, mask: &Mask, scale: f32) -> Vec<f32> {
    let (_, t_kv) = inp.check(mask);
    let MlaDims {
        n_head,
        kv_lora,
        nope,
        rope,
        v,
    } = inp.dims;
    let dk = nope + rope;
    let mut k = vec![0.0f32; t_kv * n_head * dk];
    let mut val = vec![0.0f32; t_kv * n_head * v];
    for s in 0..t_kv {
        let cs = &inp.c[s * kv_lora..][..kv_lora];
        for h in 0..n_head {
            let mut k_nope = vec![0.0f64; nope];
            for c in 0..kv_lora {
                let w_row = &inp.attn_k_b[(h * kv_lora + c) * nope..][..nope];
                for d in 0..nope {
                    k_nope[d] += w_row[d] as f64 * cs[c] as f64;
                }
            }
            let kh = &mut k[(s * n_head + h) * dk..][..dk];
            for d in 0..nope {
                kh[d] = k_nope[d] as f32;
            }
            kh[nope..].copy_from_slice(&inp.k_pe[s * rope..][..rope]);
            for e in 0..v {
                val[(s * n_head + h) * v + e] =
                    dot(&inp.attn_v_b[(h * v + e) * kv_lora..][..kv_lora], cs) as f32;
            }
        }
    }
    let shape = AttnShape {
        n_head,
        n_kv_head: n_head,
        head_dim_k: dk,
        head_dim_v: v,
    };
    attention(inp.q, &k, &val, t_kv, shape, mask, scale)
}

/// Absorbed MLA (§6.3, llama.cpp): `q̃_h[c] = Σ_d attn_k_b[h][c][d]·q_nope_h[d]`,
/// `Q_h = [q̃_h | q_pe_h]`, `K_s = [c_s | k_pe_s]`, `V_s = c_s` shared by all heads (MQA);
/// `o_lat_h = Σ_s softmax(scale·Q_h·K_s)·c_s`; `o_h[e] = Σ_c attn_v_b[h][e][c]·o_lat_h[c]`.
/// Returns `[t_q, n_head, v]`; equals [`mla_attention_naive`] in exact arithmetic.
pub fn mla_attention_absorbed(inp: &MlaAttnInputs, mask: &Mask, scale: f32) -> Vec<f32> {
    let (t_q, t_kv) = inp.check(mask);
    let MlaDims {
        n_head,
        kv_lora,
        nope,
        rope,
        v,
    } = inp.dims;
    let dq = nope + rope;
    let dk = kv_lora + rope;

    // Query rows are independent: split them over threads (same arithmetic per row).
    let q_abs = crate::models::par_rows(t_q, n_head * kv_lora * nope, |first, rows| {
        let mut q_abs = vec![0.0f32; rows * n_head * dk];
        for t in first..first + rows {
            for h in 0..n_head {
                let qh = &inp.q[(t * n_head + h) * dq..][..dq];
                let dst = &mut q_abs[((t - first) * n_head + h) * dk..][..dk];
                for c in 0..kv_lora {
                    dst[c] = dot(
                        &inp.attn_k_b[(h * kv_lora + c) * nope..][..nope],
                        &qh[..nope],
                    ) as f32;
                }
                dst[kv_lora..].copy_from_slice(&qh[nope..]);
            }
        }
        q_abs
    });
    let mut k_cache = vec![0.0f32; t_kv * dk];
    for s in 0..t_kv {
        k_cache[s * dk..][..kv_lora].copy_from_slice(&inp.c[s * kv_lora..][..kv_lora]);
        k_cache[s * dk + kv_lora..][..rope].copy_from_slice(&inp.k_pe[s * rope..][..rope]);
    }
    let shape = AttnShape {
        n_head,
        n_kv_head: 1,
        head_dim_k: dk,
        head_dim_v: kv_lora,
    };
    let o_lat = attention(&q_abs, &k_cache, inp.c, t_kv, shape, mask, scale);

    crate::models::par_rows(t_q, n_head * v * kv_lora, |first, rows| {
        let mut out = vec![0.0f32; rows * n_head * v];
        for t in first..first + rows {
            for h in 0..n_head {
                let lat = &o_lat[(t * n_head + h) * kv_lora..][..kv_lora];
                for e in 0..v {
                    out[((t - first) * n_head + h) * v + e] =
                        dot(&inp.attn_v_b[(h * v + e) * kv_lora..][..kv_lora], lat) as f32;
                }
            }
        }
        out
    })
}

/// Weights of one MLA attention block, f32 rows, named as in GGUF (`blk.i.<name>.weight`).
#[derive(Copy, Clone, Debug)]
pub struct MlaWeights<'a> {
    /// ne `{n_embd, q_lora}`.
    pub attn_q_a: &'a [f32],
    /// `[q_lora]`.
    pub attn_q_a_norm: &'a [f32],
    /// ne `{q_lora, n_head·(nope+rope)}`.
    pub attn_q_b: &'a [f32],
    /// ne `{n_embd, kv_lora+rope}`; output is `[c | k_pe]`.
    pub attn_kv_a_mqa: &'a [f32],
    /// `[kv_lora]`.
    pub attn_kv_a_norm: &'a [f32],
    /// ne `{nope, kv_lora, n_head}`.
    pub attn_k_b: &'a [f32],
    /// ne `{kv_lora, v, n_head}`.
    pub attn_v_b: &'a [f32],
    /// ne `{n_head·v, n_embd}`.
    pub attn_output: &'a [f32],
}

/// Hyper-parameters of an MLA block.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct MlaConfig {
    pub dims: MlaDims,
    pub n_embd: usize,
    pub q_lora: usize,
    /// RMSNorm eps for `attn_q_a_norm` and `attn_kv_a_norm`.
    pub eps: f32,
    /// RoPE for q_pe and k_pe; `n_rot` must equal `dims.rope`.
    pub rope: Rope,
    /// Softmax scale (§6.4): `1/sqrt(nope+rope)` without YaRN.
    pub kq_scale: f32,
}

impl MlaConfig {
    /// GLM-5 (§7.1, §7.4): n_embd 6144, q_lora 2048, eps 1e-5, NORM rope 64 dims base 1e6,
    /// kq_scale 1/16.
    pub fn glm5() -> Self {
        MlaConfig {
            dims: MlaDims::GLM5,
            n_embd: 6144,
            q_lora: 2048,
            eps: 1e-5,
            rope: Rope::new(RopeMode::Norm, 64, 1e6),
            kq_scale: 1.0 / 16.0,
        }
    }
}

/// Per-token projections of an MLA block (§6.3 steps 1-4).
#[derive(Clone, Debug)]
pub struct MlaProjection {
    /// `RMS(attn_q_a·x)·attn_q_a_norm`, `[t, q_lora]`; the DSA indexer's query input too.
    pub qr: Vec<f32>,
    /// `attn_q_b·qr` with q_pe roped, `[t, n_head, nope+rope]`.
    pub q: Vec<f32>,
    /// `RMS(c)·attn_kv_a_norm`, `[t, kv_lora]`.
    pub c: Vec<f32>,
    /// Roped, not normed, `[t, rope]`.
    pub k_pe: Vec<f32>,
}

/// §6.3 steps 1-4 for `t` tokens `x` (`[t, n_embd]`, the `attn_norm` output) at `positions`.
pub fn mla_project(
    w: &MlaWeights,
    cfg: &MlaConfig,
    x: &[f32],
    positions: &[usize],
) -> MlaProjection {
    let MlaDims {
        n_head,
        kv_lora,
        nope,
        rope,
        ..
    } = cfg.dims;
    let (n_embd, q_lora) = (cfg.n_embd, cfg.q_lora);
    let t = positions.len();
    assert_eq!(x.len(), t * n_embd, "mla_project: x.len() != t·n_embd");
    assert_eq!(cfg.rope.n_rot, rope, "mla_project: rope.n_rot != dims.rope");
    assert_eq!(
        w.attn_q_a_norm.len(),
        q_lora,
        "mla_project: attn_q_a_norm.len() != q_lora"
    );
    assert_eq!(
        w.attn_kv_a_norm.len(),
        kv_lora,
        "mla_project: attn_kv_a_norm.len() != kv_lora"
    );
    let dq = nope + rope;

    let qr = rms_norm(
        &par_matmul(w.attn_q_a, n_embd, q_lora, x, t),
        w.attn_q_a_norm,
        cfg.eps,
    );
    let mut q = par_matmul(w.attn_q_b, q_lora, n_head * dq, &qr, t);
    for (ti, &pos) in positions.iter().enumerate() {
        for h in 0..n_head {
            rope_head(
                &mut q[(ti * n_head + h) * dq + nope..][..rope],
                pos,
                &cfg.rope,
            );
        }
    }
    let ckv = par_matmul(w.attn_kv_a_mqa, n_embd, kv_lora + rope, x, t);
    let mut c_raw = Vec::with_capacity(t * kv_lora);
    let mut k_pe = Vec::with_capacity(t * rope);
    for row in ckv.chunks_exact(kv_lora + rope) {
        c_raw.extend_from_slice(&row[..kv_lora]);
        k_pe.extend_from_slice(&row[kv_lora..]);
    }
    let c = rms_norm(&c_raw, w.attn_kv_a_norm, cfg.eps);
    for (ti, &pos) in positions.iter().enumerate() {
        rope_head(&mut k_pe[ti * rope..][..rope], pos, &cfg.rope);
    }
    MlaProjection { qr, q, c, k_pe }
}

/// The MLA KV cache: `[c | k_pe]` per token (§6.3 step 4). Row `s` has position `s`.
#[derive(Clone, Debug)]
pub struct MlaCache {
    pub dims: MlaDims,
    /// `[len, kv_lora]`.
    pub c: Vec<f32>,
    /// `[len, rope]`.
    pub k_pe: Vec<f32>,
}

impl MlaCache {
    pub fn new(dims: MlaDims) -> Self {
        MlaCache {
            dims,
            c: Vec::new(),
            k_pe: Vec::new(),
        }
    }

    /// Number of cached tokens.
    pub fn len(&self) -> usize {
        self.c.len() / self.dims.kv_lora
    }

    pub fn is_empty(&self) -> bool {
        self.c.is_empty()
    }

    /// Appends the projected tokens' `c` and `k_pe`.
    pub fn append(&mut self, proj: &MlaProjection) {
        assert_eq!(
            proj.c.len() / self.dims.kv_lora,
            proj.k_pe.len() / self.dims.rope,
            "MlaCache::append: c and k_pe token counts differ"
        );
        self.c.extend_from_slice(&proj.c);
        self.k_pe.extend_from_slice(&proj.k_pe);
    }
}

/// Attention of projected queries `q` (`[t, n_head, nope+rope]`) over the whole `cache`, then
/// `attn_output`: returns `[t, n_embd]` (§6.3 steps 5-9).
pub fn mla_attend_output(
    w: &MlaWeights,
    cfg: &MlaConfig,
    q: &[f32],
    cache: &MlaCache,
    mask: &Mask,
    mode: MlaMode,
) -> Vec<f32> {
    let dims = cfg.dims;
    let inp = MlaAttnInputs {
        dims,
        q,
        c: &cache.c,
        k_pe: &cache.k_pe,
        attn_k_b: w.attn_k_b,
        attn_v_b: w.attn_v_b,
    };
    let o = mla_attention(&inp, mask, cfg.kq_scale, mode);
    par_matmul(
        w.attn_output,
        dims.n_head * dims.v,
        cfg.n_embd,
        &o,
        mask.q_pos.len(),
    )
}

/// Whole MLA attention block for `t` new tokens `x` (`[t, n_embd]`, the `attn_norm` output; no
/// residual add): project at positions `cache.len()..`, append to `cache`, attend causally
/// (restricted to `allowed[t]` if given, e.g. DSA top-k), `attn_output`. Returns `[t, n_embd]`.
pub fn mla_block(
    w: &MlaWeights,
    cfg: &MlaConfig,
    x: &[f32],
    cache: &mut MlaCache,
    allowed: Option<&[Vec<usize>]>,
    mode: MlaMode,
) -> Vec<f32> {
    assert_eq!(
        cache.dims, cfg.dims,
        "mla_block: cache dims differ from the config"
    );
    assert!(
        x.len().is_multiple_of(cfg.n_embd),
        "mla_block: x.len() not a multiple of n_embd"
    );
    let positions: Vec<usize> = (cache.len()..cache.len() + x.len() / cfg.n_embd).collect();
    let proj = mla_project(w, cfg, x, &positions);
    cache.append(&proj);
    let mask = Mask {
        q_pos: &positions,
        window: None,
        allowed,
    };
    mla_attend_output(w, cfg, &proj.q, cache, &mask, mode)
}
