//! GPU tests of the H-dense kernel families (embed, rmsnorm, add_rmsnorm, qk_norm_rope, swiglu,
//! geglu, argmax, topk) against memra-reference: specialized variants at real model shapes and
//! generic variants, plus awkward sizes; fresh random inputs (seed printed, replay with
//! `MEMRA_SEED=<seed>`), outputs NaN-poisoned before every launch. Tolerances (DESIGN.md):
//! f32 paths <= 1e-4 relative L2, bf16 caches <= 1e-2; NaN never passes.
//!
//! Run on a GPU machine: `cargo test -p memra-engine --test gpu_dense -- --ignored`.

mod dense_common;
mod gpu_common;

use cudarc::driver::{CudaSlice, ValidAsZeroBits};
use dense_common::{V, bf16_to_f32, variant};
use gpu_common::{down, gpu, load, nan_buf, up};
use memra_engine::cuda::{Gpu, Kernel};
use memra_engine::kernels::qk_norm_rope::{CacheElem, QkNormRopeParams};
use memra_engine::kernels::swiglu::GluLayout;
use memra_engine::kernels::{add_rmsnorm, argmax, embed, geglu, qk_norm_rope, rmsnorm, swiglu, topk};
use memra_gguf::GgmlType;
use memra_reference::rope::{Rope, RopeMode, rope_tokens};
use memra_reference::{Rng, act, dsa, norm, rel_err};

const F32_TOL: f64 = 1e-4;
const BF16_TOL: f64 = 1e-2;

// ---------------------------------------------------------------------------------------------
// Harness.

#[track_caller]
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64, rng: &Rng) {
    let err = rel_err(got, want);
    assert!(
        err <= tol,
        "{what}: relative L2 error {err:e} > {tol:e} (MEMRA_SEED={}); first mismatches: {:?}",
        rng.seed(),
        got.iter().zip(want).enumerate().filter(|(_, (a, b))| !(((**a - **b).abs() as f64) <= tol * (b.abs() as f64 + 1e-3))).take(5).collect::<Vec<_>>()
    );
}

/// Specialized variant `dims` (real shapes) and the family's generic twin, both loaded.
fn both(gpu: &Gpu, family: &str, dims: &[(&str, V)], choices: &[(&str, V)]) -> [Kernel; 2] {
    let spec: Vec<(&str, V)> = dims.iter().chain(choices).copied().collect();
    [load(gpu, variant(family, &spec)), load(gpu, variant(family, choices))]
}

// ---------------------------------------------------------------------------------------------
// rmsnorm / add_rmsnorm.

fn check_rmsnorm(gpu: &Gpu, k: &Kernel, rows: usize, n: usize, rng: &mut Rng) {
    let s = gpu.stream();
    let x = rng.normal_vec(rows * n, 2.0);
    let w = rng.uniform_vec(n, 0.5, 1.5);
    let eps = 1e-6;
    let (dx, dw) = (up(s, &x), up(s, &w));
    let mut dout = nan_buf(s, rows * n);
    rmsnorm::rmsnorm(k, &dx.as_view(), &dw.as_view(), &mut dout.as_view_mut(), rows, n, eps).unwrap_or_else(|e| panic!("{e}"));
    let got = down(s, &dout);
    assert_close(&format!("{} rows={rows} n={n}", k.name()), &got[..rows * n], &norm::rms_norm(&x, &w, eps), F32_TOL, rng);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_rmsnorm_model_shapes() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_rmsnorm_model_shapes");
    // GLM-5 6144 (prefill batch and decode), Qwen3-8B 4096, Qwen3-4B 2560, gemma3 640, head 256.
    for (n, rows_list) in [(6144usize, vec![1, 3, 4096]), (4096, vec![1, 129]), (2560, vec![7]), (640, vec![1, 3, 129]), (256, vec![33])] {
        for kernel in both(&gpu, "rmsnorm", &[("n", V::I(n as i64))], &[]) {
            for &rows in &rows_list {
                check_rmsnorm(&gpu, &kernel, rows, n, &mut rng);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_rmsnorm_awkward_sizes() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_rmsnorm_awkward_sizes");
    // Scalar paths (n % 4 != 0), the warp/block boundary (1024/1025), the streaming path (> 8192).
    for n in [1usize, 7, 33, 1024, 1025, 4097, 9000, 20000] {
        for kernel in both(&gpu, "rmsnorm", &[("n", V::I(n as i64))], &[]) {
            for rows in [1, 3, 129] {
                check_rmsnorm(&gpu, &kernel, rows, n, &mut rng);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_rmsnorm_refuses_a_shape_it_was_not_built_for() {
    let gpu = gpu();
    let s = gpu.stream();
    let k = load(&gpu, variant("rmsnorm", &[("n", V::I(640))]));
    let (x, w) = (up(s, &vec![1.0f32; 1024]), up(s, &vec![1.0f32; 1024]));
    let mut out = nan_buf(s, 1024);
    let e = rmsnorm::rmsnorm(&k, &x.as_view(), &w.as_view(), &mut out.as_view_mut(), 1, 1024, 1e-6).unwrap_err().to_string();
    assert!(e.contains("specialized for n=640"), "{e}");
    let e = rmsnorm::rmsnorm(&k, &x.as_view(), &w.as_view(), &mut out.as_view_mut(), 2, 640, 1e-6).unwrap_err().to_string();
    assert!(e.contains("w holds 1024") || e.contains("x holds 1024 elements, needs 1280"), "{e}");
    assert!(down(s, &out).iter().all(|v| v.is_nan()), "a refused launch must not write");
}

fn check_add_rmsnorm(gpu: &Gpu, k: &Kernel, rows: usize, n: usize, rng: &mut Rng) {
    let s = gpu.stream();
    let residual = rng.normal_vec(rows * n, 3.0);
    let delta = rng.normal_vec(rows * n, 1.0);
    let w = rng.uniform_vec(n, 0.5, 1.5);
    let dw = rng.uniform_vec(n, 0.5, 1.5);
    let eps = 1e-6;
    let with_norm = add_rmsnorm::delta_norm(k);
    let (d_delta, d_w, d_dw) = (up(s, &delta), up(s, &w), up(s, &dw));
    let mut d_res = up(s, &residual);
    let mut d_out = nan_buf(s, rows * n);
    let dw_view = d_dw.as_view();
    add_rmsnorm::add_rmsnorm(k, &mut d_res.as_view_mut(), &d_delta.as_view(), with_norm.then_some(&dw_view), &d_w.as_view(), &mut d_out.as_view_mut(), rows, n, eps)
        .unwrap_or_else(|e| panic!("{e}"));
    let added = if with_norm { norm::rms_norm(&delta, &dw, eps) } else { delta.clone() };
    let (want_res, want_out) = norm::add_rms_norm(&residual, &added, &w, eps);
    let what = format!("{} rows={rows} n={n}", k.name());
    assert_close(&format!("{what}: residual"), &down(s, &d_res), &want_res, F32_TOL, rng);
    assert_close(&format!("{what}: out"), &down(s, &d_out)[..rows * n], &want_out, F32_TOL, rng);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_add_rmsnorm_model_shapes() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_add_rmsnorm_model_shapes");
    for dn in [0, 1] {
        for (n, rows_list) in [(6144usize, vec![1, 4096]), (4096, vec![1, 129]), (640, vec![1, 3, 129])] {
            for kernel in both(&gpu, "add_rmsnorm", &[("n", V::I(n as i64))], &[("delta_norm", V::I(dn))]) {
                for &rows in &rows_list {
                    check_add_rmsnorm(&gpu, &kernel, rows, n, &mut rng);
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_add_rmsnorm_awkward_sizes() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_add_rmsnorm_awkward_sizes");
    for dn in [0, 1] {
        for n in [1usize, 7, 33, 1025, 4097, 7000, 20000] {
            for kernel in both(&gpu, "add_rmsnorm", &[("n", V::I(n as i64))], &[("delta_norm", V::I(dn))]) {
                for rows in [1, 3, 129] {
                    check_add_rmsnorm(&gpu, &kernel, rows, n, &mut rng);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// embed.

fn check_embed(gpu: &Gpu, k: &Kernel, ty: GgmlType, n_embd: usize, n_vocab: usize, n_tokens: usize, rng: &mut Rng) {
    let s = gpu.stream();
    let values = rng.normal_vec(n_vocab * n_embd, 1.0);
    let table = memra_gguf::quant::quantize(ty, &values).unwrap_or_else(|e| panic!("{e}"));
    let row_bytes = table.len() / n_vocab;
    // Both ends of the table always, the rest random.
    let mut tokens: Vec<i32> = (0..n_tokens).map(|_| rng.below(n_vocab) as i32).collect();
    tokens[0] = (n_vocab - 1) as i32;
    if n_tokens > 1 {
        tokens[1] = 0;
    }
    let scale = (n_embd as f32).sqrt();
    let mut want = Vec::with_capacity(n_tokens * n_embd);
    for &t in &tokens {
        let t = t as usize;
        let row = memra_gguf::quant::dequantize(ty, &table[t * row_bytes..(t + 1) * row_bytes], n_embd).unwrap();
        want.extend(row.iter().map(|v| v * scale));
    }
    let (d_tok, d_table) = (up(s, &tokens), up(s, &table));
    let mut d_out = nan_buf(s, n_tokens * n_embd);
    embed::embed(k, &d_tok.as_view(), &d_table.as_view(), &mut d_out.as_view_mut(), n_tokens, n_embd, n_vocab, scale).unwrap_or_else(|e| panic!("{e}"));
    let got = down(s, &d_out);
    assert_close(&format!("{} n_embd={n_embd} tokens={n_tokens}", k.name()), &got[..n_tokens * n_embd], &want, F32_TOL, rng);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_embed_every_qtype() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_embed_every_qtype");
    for token in ["f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"] {
        let ty = GgmlType::from_name(token).unwrap();
        // gemma3 640 (32-element blocks), Qwen3-8B 4096, GLM-5 6144.
        let dims: &[usize] = if ty.block_size() == 256 { &[4096, 6144] } else { &[640, 4096, 6144] };
        for &n_embd in dims {
            for kernel in both(&gpu, "embed", &[("n_embd", V::I(n_embd as i64))], &[("qtype", V::S(token))]) {
                for n_tokens in [1, 3, 129] {
                    check_embed(&gpu, &kernel, ty, n_embd, 300, n_tokens, &mut rng);
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_embed_awkward_sizes_and_bad_tokens() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_embed_awkward_sizes_and_bad_tokens");
    for token in ["f32", "f16", "bf16"] {
        let ty = GgmlType::from_name(token).unwrap();
        for n_embd in [1, 7, 33, 4097] {
            for kernel in both(&gpu, "embed", &[("n_embd", V::I(n_embd as i64))], &[("qtype", V::S(token))]) {
                for n_tokens in [1, 3, 129] {
                    check_embed(&gpu, &kernel, ty, n_embd, 50, n_tokens, &mut rng);
                }
            }
        }
    }
    // A token outside [0, n_vocab) gets a NaN row; its neighbours are gathered normally.
    let s = gpu.stream();
    let k = load(&gpu, variant("embed", &[("qtype", V::S("q8_0"))]));
    let (n_embd, n_vocab) = (64, 10);
    let values = rng.normal_vec(n_vocab * n_embd, 1.0);
    let table = memra_gguf::quant::quantize(GgmlType::Q8_0, &values).unwrap();
    let tokens = [3i32, -1, 10, 9];
    let (d_tok, d_table) = (up(s, &tokens), up(s, &table));
    let mut d_out = up(s, &vec![0.0f32; 4 * n_embd]);
    embed::embed(&k, &d_tok.as_view(), &d_table.as_view(), &mut d_out.as_view_mut(), 4, n_embd, n_vocab, 1.0).unwrap();
    let got = down(s, &d_out);
    assert!(got[..n_embd].iter().all(|v| v.is_finite()));
    assert!(got[n_embd..3 * n_embd].iter().all(|v| v.is_nan()), "tokens -1 and n_vocab must give NaN rows");
    assert!(got[3 * n_embd..].iter().all(|v| v.is_finite()));
}

// ---------------------------------------------------------------------------------------------
// qk_norm_rope.

#[derive(Clone, Copy, Debug)]
struct AttnCase {
    hd: usize,
    n_head: usize,
    n_kv: usize,
    n_rot: usize,
    mode: &'static str,
    norm: &'static str,
}

impl AttnCase {
    fn dims(&self) -> Vec<(&'static str, V)> {
        vec![("head_dim", V::I(self.hd as i64)), ("n_head", V::I(self.n_head as i64)), ("n_kv", V::I(self.n_kv as i64)), ("n_rot", V::I(self.n_rot as i64))]
    }
    fn choices(&self, cache: &'static str) -> Vec<(&'static str, V)> {
        vec![("rope_mode", V::S(self.mode)), ("qk_norm", V::S(self.norm)), ("cache_t", V::S(cache))]
    }
}

/// Reference for one case: norm (per head / full / none) then RoPE; returns (q, k), packed.
fn reference_qk(c: &AttnCase, q: &[f32], k: &[f32], qw: &[f32], kw: &[f32], positions: &[usize], p: &QkNormRopeParams) -> (Vec<f32>, Vec<f32>) {
    let (mut q, mut k) = match c.norm {
        "per_head" => (norm::rms_norm(q, qw, p.eps), norm::rms_norm(k, kw, p.eps)),
        "full" => (norm::rms_norm(q, qw, p.eps), norm::rms_norm(k, kw, p.eps)),
        _ => (q.to_vec(), k.to_vec()),
    };
    let mode = match c.mode {
        "neox" => Some(RopeMode::Neox),
        "interleaved" => Some(RopeMode::Norm),
        _ => None,
    };
    if let Some(mode) = mode {
        let rope = Rope { mode, n_rot: c.n_rot, base: p.freq_base, freq_scale: p.freq_scale };
        rope_tokens(&mut q, c.n_head, c.hd, positions, &rope);
        rope_tokens(&mut k, c.n_kv, c.hd, positions, &rope);
    }
    (q, k)
}

/// Packs `rows` rows of `row` floats from a buffer with `stride` floats per row.
fn unstride(x: &[f32], rows: usize, row: usize, stride: usize) -> Vec<f32> {
    (0..rows).flat_map(|t| x[t * stride..t * stride + row].iter().copied()).collect()
}

trait HostCache: CacheElem + BitsEq + Copy + PartialEq + std::fmt::Debug + ValidAsZeroBits + Default {
    const POISON: Self;
    fn to_f32(self) -> f32;
    const TOL: f64;
}

impl HostCache for f32 {
    const POISON: f32 = f32::NAN;
    fn to_f32(self) -> f32 {
        self
    }
    const TOL: f64 = F32_TOL;
}

impl HostCache for u16 {
    const POISON: u16 = 0x7fc1; // a bf16 NaN
    fn to_f32(self) -> f32 {
        bf16_to_f32(self)
    }
    const TOL: f64 = BF16_TOL;
}

#[allow(clippy::too_many_arguments)]
fn check_qk<C: HostCache>(gpu: &Gpu, kernel: &Kernel, c: &AttnCase, n_tokens: usize, max_ctx: usize, pad: usize, freq_base: f32, freq_scale: f32, rng: &mut Rng) {
    let s = gpu.stream();
    let (q_row, kv_row) = (c.n_head * c.hd, c.n_kv * c.hd);
    let mut p = QkNormRopeParams::packed(n_tokens, c.hd, c.n_head, c.n_kv, c.n_rot, max_ctx, freq_base, 1e-6);
    p.freq_scale = freq_scale;
    p.q_stride += pad;
    p.k_stride += pad;
    p.v_stride += 2 * pad;
    // Distinct random positions in [0, max_ctx), the last one near the end; with 3+ tokens one
    // position lies past max_ctx (roped, but no cache write).
    let mut positions: Vec<usize> = Vec::new();
    while positions.len() < n_tokens {
        let cand = if positions.is_empty() { max_ctx - 1 } else { rng.below(max_ctx) };
        if !positions.contains(&cand) {
            positions.push(cand);
        }
    }
    if n_tokens >= 3 {
        positions[2] = max_ctx + 5;
    }
    let q = rng.normal_vec((n_tokens - 1) * p.q_stride + q_row, 1.5);
    let k = rng.normal_vec((n_tokens - 1) * p.k_stride + kv_row, 1.5);
    let v = rng.normal_vec((n_tokens - 1) * p.v_stride + kv_row, 1.0);
    let (wq_len, wk_len) = if c.norm == "full" { (q_row, kv_row) } else { (c.hd, c.hd) };
    let qw = rng.uniform_vec(wq_len, 0.5, 1.5);
    let kw = rng.uniform_vec(wk_len, 0.5, 1.5);

    let q_packed = unstride(&q, n_tokens, q_row, p.q_stride);
    let k_packed = unstride(&k, n_tokens, kv_row, p.k_stride);
    let v_packed = unstride(&v, n_tokens, kv_row, p.v_stride);
    let (want_q, want_k) = reference_qk(c, &q_packed, &k_packed, &qw, &kw, &positions, &p);

    let pos_i32: Vec<i32> = positions.iter().map(|&x| x as i32).collect();
    let (mut dq, mut dk, dv) = (up(s, &q), up(s, &k), up(s, &v));
    let (dqw, dkw, dpos) = (up(s, &qw), up(s, &kw), up(s, &pos_i32));
    let mut kc = up(s, &vec![C::POISON; max_ctx * kv_row]);
    let mut vc = up(s, &vec![C::POISON; max_ctx * kv_row]);
    let (qw_view, kw_view) = (dqw.as_view(), dkw.as_view());
    let norm_w = (c.norm != "none").then_some((&qw_view, &kw_view));
    qk_norm_rope::qk_norm_rope(kernel, &mut dq.as_view_mut(), &mut dk.as_view_mut(), &dv.as_view(), norm_w, &dpos.as_view(), &mut kc.as_view_mut(), &mut vc.as_view_mut(), &p)
        .unwrap_or_else(|e| panic!("{e}"));

    let what = format!("{} T={n_tokens} pad={pad} base={freq_base} scale={freq_scale}", kernel.name());
    let got_q = down(s, &dq);
    let got_k = down(s, &dk);
    assert_close(&format!("{what}: q"), &unstride(&got_q, n_tokens, q_row, p.q_stride), &want_q, F32_TOL, rng);
    assert_close(&format!("{what}: k"), &unstride(&got_k, n_tokens, kv_row, p.k_stride), &want_k, F32_TOL, rng);
    // Padding between token rows is untouched.
    for t in 0..n_tokens.saturating_sub(1) {
        assert_eq!(&got_q[t * p.q_stride + q_row..(t + 1) * p.q_stride], &q[t * p.q_stride + q_row..(t + 1) * p.q_stride], "{what}: q padding written");
    }
    let kc_host = down(s, &kc);
    let vc_host = down(s, &vc);
    let mut got_kc = Vec::new();
    let mut got_vc = Vec::new();
    let mut want_kc = Vec::new();
    let mut want_vc = Vec::new();
    for (t, &pos) in positions.iter().enumerate() {
        if pos >= max_ctx {
            continue;
        }
        got_kc.extend(kc_host[pos * kv_row..(pos + 1) * kv_row].iter().map(|e| e.to_f32()));
        got_vc.extend(vc_host[pos * kv_row..(pos + 1) * kv_row].iter().map(|e| e.to_f32()));
        want_kc.extend_from_slice(&want_k[t * kv_row..(t + 1) * kv_row]);
        want_vc.extend_from_slice(&v_packed[t * kv_row..(t + 1) * kv_row]);
    }
    assert_close(&format!("{what}: k cache"), &got_kc, &want_kc, C::TOL, rng);
    assert_close(&format!("{what}: v cache"), &got_vc, &want_vc, C::TOL, rng);
    for row in 0..max_ctx {
        if positions.contains(&row) {
            continue;
        }
        let untouched = |cache: &[C]| cache[row * kv_row..(row + 1) * kv_row].iter().all(|e| e.to_bits_eq(C::POISON));
        assert!(untouched(&kc_host) && untouched(&vc_host), "{what}: cache row {row} written but no token is at that position");
    }
}

trait BitsEq {
    fn to_bits_eq(&self, other: Self) -> bool;
}
impl BitsEq for f32 {
    fn to_bits_eq(&self, other: f32) -> bool {
        self.to_bits() == other.to_bits()
    }
}
impl BitsEq for u16 {
    fn to_bits_eq(&self, other: u16) -> bool {
        *self == other
    }
}

fn qk_cases() -> Vec<(AttnCase, f32)> {
    vec![
        (AttnCase { hd: 128, n_head: 32, n_kv: 8, n_rot: 128, mode: "neox", norm: "per_head" }, 1e6), // qwen3-8B
        (AttnCase { hd: 256, n_head: 4, n_kv: 1, n_rot: 256, mode: "neox", norm: "per_head" }, 1e4),  // gemma3 local
        (AttnCase { hd: 256, n_head: 4, n_kv: 1, n_rot: 256, mode: "neox", norm: "per_head" }, 1e6),  // gemma3 global
        (AttnCase { hd: 128, n_head: 16, n_kv: 16, n_rot: 128, mode: "neox", norm: "full" }, 1e4),    // olmoe
        (AttnCase { hd: 128, n_head: 8, n_kv: 8, n_rot: 64, mode: "interleaved", norm: "none" }, 1e6), // partial interleaved
        (AttnCase { hd: 64, n_head: 16, n_kv: 4, n_rot: 64, mode: "interleaved", norm: "per_head" }, 1e4),
    ]
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_qk_norm_rope_model_shapes() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_qk_norm_rope_model_shapes");
    for (c, base) in qk_cases() {
        for kernel in both(&gpu, "qk_norm_rope", &c.dims(), &c.choices("bf16")) {
            for t in [1, 3, 129] {
                check_qk::<u16>(&gpu, &kernel, &c, t, 4096, 0, base, 1.0, &mut rng);
            }
        }
        for kernel in both(&gpu, "qk_norm_rope", &c.dims(), &c.choices("f32")) {
            for t in [1, 3, 129] {
                check_qk::<f32>(&gpu, &kernel, &c, t, 4096, 0, base, 1.0, &mut rng);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_qk_norm_rope_large_positions_scaling_strides() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_qk_norm_rope_large_positions_scaling_strides");
    // Positions up to 131071 (gemma3 dims keep the cache small): θ is reduced in f64, so the
    // high-frequency pairs stay accurate.
    let g = AttnCase { hd: 256, n_head: 4, n_kv: 1, n_rot: 256, mode: "neox", norm: "per_head" };
    for kernel in both(&gpu, "qk_norm_rope", &g.dims(), &g.choices("f32")) {
        check_qk::<f32>(&gpu, &kernel, &g, 3, 131072, 0, 1e6, 1.0, &mut rng);
        check_qk::<f32>(&gpu, &kernel, &g, 129, 131072, 0, 1e4, 1.0, &mut rng);
    }
    let c = AttnCase { hd: 128, n_head: 32, n_kv: 8, n_rot: 128, mode: "neox", norm: "per_head" };
    for kernel in both(&gpu, "qk_norm_rope", &c.dims(), &c.choices("f32")) {
        check_qk::<f32>(&gpu, &kernel, &c, 3, 8192, 0, 5e6, 0.25, &mut rng);
        // Rows padded between tokens (as in a merged QKV buffer).
        check_qk::<f32>(&gpu, &kernel, &c, 129, 4096, 24, 1e6, 1.0, &mut rng);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_qk_norm_rope_awkward_shapes() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_qk_norm_rope_awkward_shapes");
    let cases = [
        AttnCase { hd: 80, n_head: 5, n_kv: 1, n_rot: 32, mode: "neox", norm: "per_head" }, // hd not a multiple of 32, partial
        AttnCase { hd: 2, n_head: 3, n_kv: 3, n_rot: 2, mode: "interleaved", norm: "full" },
        AttnCase { hd: 96, n_head: 7, n_kv: 7, n_rot: 96, mode: "none", norm: "per_head" },
        AttnCase { hd: 512, n_head: 2, n_kv: 1, n_rot: 200, mode: "neox", norm: "full" },
        AttnCase { hd: 64, n_head: 33, n_kv: 11, n_rot: 48, mode: "interleaved", norm: "none" },
    ];
    for c in cases {
        for kernel in both(&gpu, "qk_norm_rope", &c.dims(), &c.choices("bf16")) {
            for t in [1, 3, 129] {
                check_qk::<u16>(&gpu, &kernel, &c, t, 300, 3, 1e4, 1.0, &mut rng);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// swiglu / geglu.

#[derive(Clone, Copy, PartialEq)]
enum Glu {
    Swi,
    Ge,
}

fn check_glu(gpu: &Gpu, k: &Kernel, which: Glu, rows: usize, n_ff: usize, merged: bool, extra: usize, rng: &mut Rng) {
    let s = gpu.stream();
    // `merged`: one [gate | up] row per token; `extra` pads rows (odd = scalar path).
    let layout = if merged { GluLayout { gate_stride: 2 * n_ff + extra, up_stride: 2 * n_ff + extra } } else { GluLayout { gate_stride: n_ff + extra, up_stride: n_ff + extra } };
    let len = (rows - 1) * layout.gate_stride + if merged { 2 * n_ff } else { n_ff };
    let mut a = rng.normal_vec(len, 3.0);
    // Tails of the activations: large positive and negative gates.
    for (i, v) in a.iter_mut().enumerate().take(8) {
        *v = if i % 2 == 0 { 25.0 * (i as f32 + 1.0) } else { -25.0 * i as f32 };
    }
    let b = rng.normal_vec(len, 1.0);
    let gate = unstride(&a, rows, n_ff, layout.gate_stride);
    let upv = if merged { (0..rows).flat_map(|t| a[t * layout.gate_stride + n_ff..t * layout.gate_stride + 2 * n_ff].to_vec()).collect::<Vec<_>>() } else { unstride(&b, rows, n_ff, layout.up_stride) };
    let want = if which == Glu::Swi { act::swiglu(&gate, &upv) } else { act::geglu(&gate, &upv) };
    let (da, db) = (up(s, &a), up(s, &b));
    let mut dout = nan_buf(s, rows * n_ff);
    let gate_view = da.as_view();
    let up_view = if merged { da.slice(n_ff..) } else { db.as_view() };
    let r = match which {
        Glu::Swi => swiglu::swiglu(k, &gate_view, &up_view, &mut dout.as_view_mut(), rows, n_ff, layout),
        Glu::Ge => geglu::geglu(k, &gate_view, &up_view, &mut dout.as_view_mut(), rows, n_ff, layout),
    };
    r.unwrap_or_else(|e| panic!("{e}"));
    let got = down(s, &dout);
    assert_close(&format!("{} rows={rows} n_ff={n_ff} merged={merged} extra={extra}", k.name()), &got[..rows * n_ff], &want, F32_TOL, rng);
}

fn glu_family(which: Glu) -> &'static str {
    if which == Glu::Swi { "swiglu" } else { "geglu" }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_swiglu_geglu_model_shapes() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_swiglu_geglu_model_shapes");
    // Qwen3-8B / GLM-5 dense 12288, Qwen3-4B 9728, olmoe expert 1024; gemma3 2048 (GeGLU).
    for (which, n_ff) in [(Glu::Swi, 12288), (Glu::Swi, 9728), (Glu::Swi, 1024), (Glu::Ge, 2048)] {
        for kernel in both(&gpu, glu_family(which), &[("n_ff", V::I(n_ff as i64))], &[]) {
            for rows in [1, 7, 129] {
                check_glu(&gpu, &kernel, which, rows, n_ff, false, 0, &mut rng);
                check_glu(&gpu, &kernel, which, rows, n_ff, true, 0, &mut rng);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_swiglu_geglu_awkward_sizes() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_swiglu_geglu_awkward_sizes");
    for which in [Glu::Swi, Glu::Ge] {
        for n_ff in [1, 7, 33, 4097, 1024] {
            for kernel in both(&gpu, glu_family(which), &[("n_ff", V::I(n_ff as i64))], &[]) {
                for rows in [1, 3, 129] {
                    check_glu(&gpu, &kernel, which, rows, n_ff, false, 0, &mut rng);
                    check_glu(&gpu, &kernel, which, rows, n_ff, true, 1, &mut rng); // unaligned rows
                    check_glu(&gpu, &kernel, which, rows, n_ff, false, 4, &mut rng);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// argmax / topk.

/// Logit rows with planted ties at the maximum (and elsewhere) to exercise lowest-index-first.
fn logits(rng: &mut Rng, rows: usize, n_vocab: usize) -> Vec<f32> {
    let mut x = rng.normal_vec(rows * n_vocab, 4.0);
    for r in 0..rows {
        let row = &mut x[r * n_vocab..(r + 1) * n_vocab];
        let top = 40.0 + rng.uniform();
        for _ in 0..3 {
            let i = rng.below(n_vocab);
            row[i] = top;
        }
        let tie = row[rng.below(n_vocab)];
        for _ in 0..4 {
            let i = rng.below(n_vocab);
            row[i] = tie;
        }
    }
    x
}

/// memra-reference's top-k set, sorted by (value desc, index asc) as the kernel returns it.
fn want_topk(row: &[f32], k: usize) -> Vec<usize> {
    let mut idx = dsa::top_k(row, k);
    idx.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
    idx
}

fn check_argmax(gpu: &Gpu, k: &Kernel, rows: usize, n_vocab: usize, rng: &mut Rng) {
    let s = gpu.stream();
    let x = logits(rng, rows, n_vocab);
    let dx = up(s, &x);
    let mut scratch = argmax::alloc_scratch(k, rows, n_vocab).unwrap();
    let mut idx = up(s, &vec![i32::MIN; rows]);
    let mut val = nan_buf(s, rows);
    // Twice: the scratch counters must be back at zero after a launch.
    for round in 0..2 {
        argmax::argmax(k, &dx.as_view(), &mut idx.as_view_mut(), &mut val.as_view_mut(), &mut scratch.as_view_mut(), rows, n_vocab, None).unwrap_or_else(|e| panic!("{e}"));
        let (gi, gv) = (down(s, &idx), down(s, &val));
        for r in 0..rows {
            let row = &x[r * n_vocab..(r + 1) * n_vocab];
            let want = want_topk(row, 1)[0];
            assert_eq!(gi[r], want as i32, "{} n_vocab={n_vocab} row {r} round {round} (MEMRA_SEED={})", k.name(), rng.seed());
            assert_eq!(gv[r].to_bits(), row[want].to_bits(), "{} value of row {r}", k.name());
        }
    }
    if rows == 1 {
        check_decode_feed(gpu, k, &x, &dx, &mut scratch, rng);
    }
}

/// argmax's decode feed: the token becomes the next step's input, the position advances, and
/// the history gets the token at the new position (only inside it: the last position's step
/// writes no history); every other history entry is left alone.
fn check_decode_feed(gpu: &Gpu, k: &Kernel, x: &[f32], dx: &CudaSlice<f32>, scratch: &mut CudaSlice<u8>, rng: &mut Rng) {
    let s = gpu.stream();
    let n_vocab = x.len();
    let want = want_topk(x, 1)[0] as i32;
    let len = 1 + rng.below(40);
    for p in [0, rng.below(len), len.saturating_sub(2), len - 1] {
        let poison = vec![i32::MIN; len];
        let (mut token, mut pos, mut history) = (up(s, &[-7i32]), up(s, &[p as i32]), up(s, &poison));
        let (mut idx, mut val) = (up(s, &[i32::MIN]), nan_buf(s, 1));
        let feed = argmax::DecodeFeed { token: &mut token, pos: &mut pos, history: &mut history };
        argmax::argmax(k, &dx.as_view(), &mut idx.as_view_mut(), &mut val.as_view_mut(), &mut scratch.as_view_mut(), 1, n_vocab, Some(feed)).unwrap_or_else(|e| panic!("{e}"));
        let what = format!("{} n_vocab={n_vocab} feed at position {p} of {len} (MEMRA_SEED={})", k.name(), rng.seed());
        assert_eq!(down(s, &idx), vec![want], "{what}: out_idx");
        assert_eq!(down(s, &token), vec![want], "{what}: next token");
        assert_eq!(down(s, &pos), vec![p as i32 + 1], "{what}: next position");
        let mut want_hist = poison.clone();
        if p + 1 < len {
            want_hist[p + 1] = want;
        }
        assert_eq!(down(s, &history), want_hist, "{what}: history");
    }
}

fn check_topk(gpu: &Gpu, kern: &Kernel, rows: usize, n_vocab: usize, k: usize, rng: &mut Rng) {
    let s = gpu.stream();
    let x = logits(rng, rows, n_vocab);
    let dx = up(s, &x);
    let mut scratch = topk::alloc_scratch(kern, rows, n_vocab, k).unwrap();
    let mut idx = up(s, &vec![i32::MIN; rows * k]);
    let mut val = nan_buf(s, rows * k);
    for round in 0..2 {
        topk::topk(kern, &dx.as_view(), &mut val.as_view_mut(), &mut idx.as_view_mut(), &mut scratch.as_view_mut(), rows, n_vocab, k).unwrap_or_else(|e| panic!("{e}"));
        let (gi, gv) = (down(s, &idx), down(s, &val));
        for r in 0..rows {
            let row = &x[r * n_vocab..(r + 1) * n_vocab];
            let want = want_topk(row, k);
            let got: Vec<usize> = gi[r * k..(r + 1) * k].iter().map(|&i| i as usize).collect();
            assert_eq!(got, want, "{} n_vocab={n_vocab} k={k} row {r} round {round} (MEMRA_SEED={})", kern.name(), rng.seed());
            for (j, &i) in want.iter().enumerate() {
                assert_eq!(gv[r * k + j].to_bits(), row[i].to_bits(), "{} value {j} of row {r}", kern.name());
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_argmax_vocab_sizes() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_argmax_vocab_sizes");
    // gemma3 262144, Qwen3 151936, GLM-5 154880, olmoe 50304; awkward 1, 7, 33, 2049, 4097.
    for n_vocab in [262144, 151936, 154880, 50304, 1, 7, 33, 2049, 4097] {
        for kernel in both(&gpu, "argmax", &[("n_vocab", V::I(n_vocab as i64))], &[]) {
            for rows in [1, 3, 7] {
                check_argmax(&gpu, &kernel, rows, n_vocab, &mut rng);
            }
        }
    }
}

/// One-warp blocks (`threads = 32`: the glm-dsa and olmoe router top-k in their specs), from one
/// row to a prefill batch.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_topk_one_warp() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_topk_one_warp");
    for (n_vocab, k) in [(256, 8), (64, 8), (200, 8), (256, 1), (33, 5)] {
        for kernel in both(&gpu, "topk", &[("n_vocab", V::I(n_vocab)), ("k", V::I(k))], &[("threads", V::I(32))]) {
            for rows in [1, 3, 4096] {
                check_topk(&gpu, &kernel, rows, n_vocab as usize, k as usize, &mut rng);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_topk_vocab_sizes() {
    let gpu = gpu();
    let mut rng = Rng::from_env_or_time("gpu_topk_vocab_sizes");
    for (n_vocab, ks) in [(262144, vec![64, 40, 1]), (151936, vec![64, 20]), (50304, vec![50]), (4097, vec![64, 3]), (33, vec![33, 5]), (7, vec![7, 1]), (1, vec![1])] {
        for k in ks {
            for kernel in both(&gpu, "topk", &[("n_vocab", V::I(n_vocab as i64)), ("k", V::I(k as i64))], &[]) {
                for rows in [1, 3] {
                    check_topk(&gpu, &kernel, rows, n_vocab, k, &mut rng);
                }
            }
        }
    }
}
