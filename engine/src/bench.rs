//! `memra bench`: specialized vs generic vs the memory roofline, on the GPU.
//!
//! First the copy bandwidth of this device, measured now (a 1 GiB device-to-device copy, bytes
//! read + written). Then, for every specialized variant of each built architecture (or one
//! `--arch`), its family at that variant's baked shape, run with the specialized variant and with
//! its generic twin on the same buffers. Each timing: `--warmup` rounds, then `--iters` (≥ 20)
//! rounds; a round launches the specialized and the generic variant once each, alternating which
//! goes first, each launch between its own two CUDA events (medians reported). Measuring the two
//! back to back in one loop keeps order effects (clocks ramping up after the host-side buffer
//! setup, drift over a case) out of the ratio; the earlier version timed all specialized
//! launches first. Before every timed launch a read pass over a never-written buffer of twice
//! the L2 size runs (outside the events, [`L2Flush`]): it evicts L2 without leaving dirty lines
//! (the memset used until session 4 left L2 full of them, so every miss of the timed kernel also
//! wrote a line back) and keeps the GPU busy while the host enqueues the launch, so host
//! launch latency stays out of the events. Inputs also rotate among several buffer sets when one
//! set is smaller than twice L2 (criterion batches rely on it).
//!
//! Each row also has a back-to-back figure (`stream_us`, [`time_streamed`]): 8 launches on
//! consecutive buffer sets captured as one CUDA graph with programmatic dependent launch, as a
//! decode step runs them, timed per replay. A launch's ramp then overlaps the previous one's tail,
//! which is what a kernel costs inside a step; the per-launch median pays it every time (the
//! harness floor alone, one block moving 16 bytes, is ~5.7 µs on the H200).
//!
//! Bytes moved per launch (the fewest: each input read once, each output written once):
//! - matvec (batch 1): weight bytes (GGUF row bytes × N) + x (4K) + y (4N); FLOPs 2·K·N.
//! - matmul: weight bytes + X (4·T·K) + Y (4·T·N); FLOPs 2·T·K·N (T = 4096).
//! - rmsnorm: x + out (2 · 4·rows·n) + w (4n).
//! - add_rmsnorm: residual read and written, delta read, out written (4 · 4·rows·n) + w (4n)
//!   (+ delta_w when the variant normalizes delta).
//! - swiglu / geglu: gate + up + out (3 · 4·rows·n_ff).
//! - argmax / topk: logits (4·rows·n_vocab); the outputs are negligible and not counted.
//! - embed: gathered table rows (T · row bytes) + out (4·T·n_embd) + tokens (4T).
//! - attn_decode (one token at position ctx − 1): K and V cache rows (2 · 2·ctx·n_kv·hd, bf16)
//!   + q + out (2 · 4·H·hd) + pos; FLOPs 4·H·hd·ctx.
//! - attn_decode_rope (one token at position ctx − 1, from its raw q/k/v): the K and V rows before
//!   it (2 · 2·(ctx − 1)·n_kv·hd) + the new K and V row written (2 · 2·n_kv·hd) + q, k, v in and
//!   out (4·(2·H + 2·n_kv)·hd) + pos (the QK-norm weights, ≤ 4·(H + n_kv)·hd, not counted); FLOPs
//!   as attn_decode's.
//! - qk_norm_rope (T tokens at positions 0..T): q and k read and written in place (2 · 4·T·(H +
//!   n_kv)·hd) + v read (4·T·n_kv·hd) + the K and V cache rows written (2 · 2·T·n_kv·hd, bf16) +
//!   pos (4T) (the QK-norm weights, 4·2·hd, not counted).
//! - attn_prefill (T tokens from position 0, causal): K, V (2 · 2·T·n_kv·hd) + q + out
//!   (2 · 4·T·H·hd); FLOPs `attn_prefill::flops` (visible pairs only).
//! - mla_decode: the latent rows (2·ctx·(kv_lora + rope)) + q (4·H·(kv_lora + rope)) + out
//!   (4·H·kv_lora); FLOPs 2·H·ctx·(2·kv_lora + rope).
//! - mla_sparse_decode: only the k selected latent rows (2·k·(kv_lora + rope)) + idx + q + out;
//!   FLOPs 2·H·k·(2·kv_lora + rope).
//! - dsa_index_key: k rows in (4·T·hd) + LayerNorm weight and bias + pos + cache rows out (2·T·hd).
//! - dsa_indexer (one query): keys (2·ctx·hd) + q + w + scores out (4·ctx); FLOPs 2·H·hd·ctx.
//! - dsa_topk (one query): scores (4·ctx) + the k indices out.
//! - moe_router: logits (4·T·n_expert) + bias (sigmoid gating) + ids and weights out.
//! - moe_matvec: only the selected experts' rows (`moe_matvec::selected_bytes` over the T·n_used
//!   distinct ids; gate and up both in swiglu/geglu) + x + y + ids (+ routing weights in down
//!   mode); FLOPs 2·K·N per selected expert (twice when paired).
//! - norm_matvec (one token, as a decode step launches it: post-normed delta, new residual
//!   written): W (twice when gate/up are paired) + x, delta, delta_w, norm_w and x_out (5 · 4K)
//!   + y (4N); FLOPs 2·K·N (twice when paired).
//! - combine_matvec (one token, the o-projection with the attention's split combine): W + the
//!   partials (4·H·n_split·(hd + 2), H = K / hd) + y (4N); FLOPs 2·K·N. Split counts 8 and 32
//!   (the most the engine hands it, `combine_matvec::DEFAULT_MAX_SPLITS`).
//!
//! Shapes come from the registry: a specialized variant's baked params (k/n/qtype for matvec and
//! matmul — matmul's n, passed at run time, from the shapes its spec entry planned it for —, n for the norms, n_ff, n_vocab, n_embd, heads and head sizes, k of the DSA top-k,
//! n_expert/n_used of the router). Contexts: GQA decode at 4k and 32k, dense MLA decode at 32k
//! and 128k, the DSA step at 128k visible keys (k = the arch's top-k); prefill chunks of 4096
//! tokens; moe_matvec at one decode token (routed: n_used distinct experts of the router's
//! n_expert; no router: the dense FFN as one expert; plain: MLA's per-head absorption, one row
//! per head). Only bf16-cache attention variants are planned. matvec also runs each specialized
//! shape in Q8_0, Q4_K and BF16: where the registry has no specialized variant of that type, one
//! is rendered here with `matvec::render_source` (same tuning; `origin: "rendered"` in the JSON).
//! Not measured: qk_norm_rope (no bench wiring yet; `--model` times the steps that use it), batch > 1 matvec, matmul in types other than
//! the baked one, sliding-window attention.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use memra_gguf::{GgmlType, quant};
use memra_reference::Rng;
use serde_json::{Value, json};

use crate::cuda::graph::Graph;
use crate::cuda::{Error, Gpu, Kernel, Kernels};
use crate::kernels::registry::{self, KernelVariant, Param};
use crate::kernels::swiglu::GluLayout;
use crate::kernels::{
    add_rmsnorm, argmax, attn_decode, attn_decode_rope, attn_prefill, combine_matvec, dsa_index_key, dsa_indexer, dsa_topk, embed, geglu, matmul, matvec, mla_decode,
    mla_sparse_decode, moe_matvec, moe_router, norm_matvec, qk_norm_rope, rmsnorm, swiglu, topk,
};

mod attn_moe;
pub mod report;
pub mod sweep;

/// Tokens of the prefill matmul and of the "prefill" row counts of the row-wise families.
pub const PREFILL_T: usize = 4096;
/// The copy used for the bandwidth ceiling.
pub const COPY_BYTES: usize = 1 << 30;
/// Fallback when the driver does not report the L2 size (H200: 60 MiB).
const DEFAULT_L2: usize = 60 << 20;
/// Most buffer sets one case rotates among.
const MAX_SETS: usize = 64;
/// The extra weight types every specialized matvec shape also runs in.
const MATVEC_EXTRA_TYPES: [GgmlType; 3] = [GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::BF16];

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Only variants specialized for this architecture (e.g. glm-dsa); default: every built one.
    #[arg(long, value_name = "ARCH")]
    pub arch: Option<String>,
    /// Only this kernel family (e.g. matvec).
    #[arg(long, value_name = "FAMILY")]
    pub family: Option<String>,
    /// Also write the results as JSON (schema: benches/results/SCHEMA.md).
    #[arg(long, value_name = "OUT")]
    pub json: Option<PathBuf>,
    /// Timed launches per variant (median reported); at least 20.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u32).range(20..))]
    pub iters: u32,
    /// Untimed launches before the timed ones.
    #[arg(long, default_value_t = 5)]
    pub warmup: u32,
    /// The commit to record (default: $MEMRA_COMMIT at run or build time, else `git rev-parse HEAD`).
    #[arg(long)]
    pub commit: Option<String>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Print the planned cases and exit (no GPU needed).
    #[arg(long)]
    pub list: bool,
    /// Instead of the built variants: sweep candidate tunings of this family (`matvec`), each
    /// checked against the CPU oracle, then timed (bench/sweep.rs).
    #[arg(long, value_name = "FAMILY")]
    pub sweep: Option<String>,
    /// `--sweep matvec`: only the shapes whose tensor label contains this text (e.g.
    /// `attn_output`; `--list` shows the labels).
    #[arg(long, value_name = "TEXT", requires = "sweep")]
    pub tensor: Option<String>,
    /// Measure this whole model end to end (prefill and decode tokens/s, specialized and
    /// generic kernels) instead of the kernel families.
    #[arg(long, value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// Prompt tokens of the `--model` prefill, and of the `--synthetic` one (0: no prefill
    /// measured there).
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Greedy decode steps of the `--model` run.
    #[arg(long, default_value_t = 128)]
    pub decode_tokens: usize,
    /// `--model`: also time the decode step with each role's launches (q/k/v, attention,
    /// o-projection, gate/up, down, LM head, argmax) left out of the captured step: what each
    /// costs inside the graph, where kernels overlap (a profiler times them one by one). Printed
    /// only; dense GQA models (gemma3, qwen3).
    #[arg(long, requires = "model")]
    pub breakdown: bool,
    /// Measure a preset's real shapes with random weights generated on the GPU, no file
    /// (`glm-5`): decode step time at `--ctx` cached positions vs its bandwidth floor
    /// (bench_synthetic.rs).
    #[arg(long, value_name = "PRESET")]
    pub synthetic: Option<String>,
    /// Layers of the `--synthetic` model (the preset's first N: dense layers first, then MoE).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub layers: u32,
    /// Cached positions before the `--synthetic` decode steps (random cache rows, no prefill).
    #[arg(long, default_value_t = 32768)]
    pub ctx: usize,
    /// GPUs for the `--synthetic` model (NCCL, heads / experts / FFN split, parallel/); above 1
    /// it is also measured on one GPU for the comparison, decode and a `--prompt-tokens`
    /// prefill (printed; `--json`: the `synthetic_gpus` object of benches/results/SCHEMA.md).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub gpus: u32,
    /// `--synthetic`: fail unless every kernel (each GPU's, with `--gpus`) is specialized.
    #[arg(long)]
    pub require_specialized: bool,
    /// Measure nothing: report on this earlier `--json` output (no GPU needed; bench/report.rs).
    #[arg(long, value_name = "RUN_JSON")]
    pub report: Option<PathBuf>,
    /// Merge these peer figures (scripts/peers.py output) into the report.
    #[arg(long, value_name = "PEERS_JSON")]
    pub peers: Option<PathBuf>,
    /// Also write the chart (specialized, generic, peer, roofline per shape) as SVG.
    #[arg(long, value_name = "OUT")]
    pub svg: Option<PathBuf>,
}

// ---------------------------------------------------------------------------------------------
// Plan: which shapes, which variants.

/// One launch shape of one family.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Shape {
    Matvec {
        ty: GgmlType,
        k: usize,
        n: usize,
    },
    Matmul {
        ty: GgmlType,
        t: usize,
        k: usize,
        n: usize,
    },
    Rmsnorm {
        rows: usize,
        n: usize,
    },
    AddRmsnorm {
        rows: usize,
        n: usize,
        delta_norm: bool,
    },
    Glu {
        family: &'static str,
        rows: usize,
        n_ff: usize,
    },
    Argmax {
        rows: usize,
        n_vocab: usize,
    },
    Topk {
        rows: usize,
        n_vocab: usize,
        k: usize,
    },
    Embed {
        ty: GgmlType,
        t: usize,
        n_embd: usize,
        n_vocab: usize,
    },
    /// QK-norm + RoPE of `t` tokens' q and k (in place) and their K/V cache write (bf16).
    QkNormRope {
        t: usize,
        n_head: usize,
        n_kv: usize,
        head_dim: usize,
        n_rot: usize,
    },
    /// GQA decode, one sequence, one query token at position `ctx − 1`, bf16 cache.
    AttnDecode {
        n_head: usize,
        n_kv: usize,
        head_dim: usize,
        ctx: usize,
    },
    /// [`Shape::AttnDecode`] from the token's raw q/k/v: QK-norm + RoPE + the cache write first.
    AttnDecodeRope {
        n_head: usize,
        n_kv: usize,
        head_dim: usize,
        n_rot: usize,
        ctx: usize,
    },
    /// Causal GQA prefill of `t` tokens from position 0, bf16 cache.
    AttnPrefill {
        t: usize,
        n_head: usize,
        n_kv: usize,
        head_dim: usize,
    },
    /// Absorbed MLA decode over `ctx` latent rows (bf16).
    MlaDecode {
        n_head: usize,
        kv_lora: usize,
        rope: usize,
        ctx: usize,
    },
    /// DSA index keys of `t` tokens: LayerNorm + RoPE + bf16 cache write.
    DsaIndexKey {
        t: usize,
        head_dim: usize,
        n_rot: usize,
    },
    /// DSA indexer scores of one query over `ctx` bf16 keys.
    DsaIndexer {
        n_head: usize,
        head_dim: usize,
        ctx: usize,
    },
    /// Top-`k` of one query's `ctx` index scores.
    DsaTopk {
        ctx: usize,
        k: usize,
    },
    /// Absorbed MLA decode over `k` selected rows of a `ctx`-row latent cache.
    MlaSparseDecode {
        n_head: usize,
        kv_lora: usize,
        rope: usize,
        ctx: usize,
        k: usize,
    },
    /// Router of `t` tokens: top `n_used` of `n_expert` (sigmoid + bias, or softmax).
    MoeRouter {
        t: usize,
        n_expert: usize,
        n_used: usize,
        sigmoid: bool,
    },
    /// A decode projection with the residual add + RMSNorm fused in, as a decode step launches it
    /// (post-normed delta, the new residual written): `glu` none, or gate/up pairs + activation.
    NormMatvec {
        ty: GgmlType,
        glu: norm_matvec::Glu,
        k: usize,
        n: usize,
    },
    /// A decode output projection combining the attention's `n_split` splits of `k / head_dim`
    /// heads in its prologue (random partials).
    CombineMatvec {
        ty: GgmlType,
        k: usize,
        n: usize,
        head_dim: usize,
        n_split: usize,
    },
    /// `t` tokens' products over `n_used` experts each of `n_expert` (all `t·n_used` distinct).
    MoeMatvec {
        ty: GgmlType,
        mode: moe_matvec::Mode,
        t: usize,
        k: usize,
        n: usize,
        n_expert: usize,
        n_used: usize,
    },
}

/// Bytes of one bf16 cache element.
const BF16: u64 = 2;

/// The prefill launch of an [`Shape::AttnPrefill`]: causal from position 0, scale 1/√hd.
pub fn prefill_params(t: usize, n_head: usize, n_kv: usize, head_dim: usize) -> attn_prefill::AttnPrefillParams {
    attn_prefill::AttnPrefillParams { n_tokens: t, head_dim, n_head, n_kv, max_ctx: t, pos0: 0, window: None, scale: 1.0 / (head_dim as f32).sqrt() }
}

fn weight_bytes(ty: GgmlType, k: usize, n: usize) -> u64 {
    ty.row_bytes(k as u64).unwrap_or(0) * n as u64
}

impl Shape {
    pub fn family(&self) -> &'static str {
        match self {
            Shape::Matvec { .. } => matvec::FAMILY,
            Shape::Matmul { .. } => matmul::FAMILY,
            Shape::Rmsnorm { .. } => rmsnorm::FAMILY,
            Shape::AddRmsnorm { .. } => add_rmsnorm::FAMILY,
            Shape::Glu { family, .. } => family,
            Shape::Argmax { .. } => argmax::FAMILY,
            Shape::Topk { .. } => topk::FAMILY,
            Shape::Embed { .. } => embed::FAMILY,
            Shape::AttnDecode { .. } => attn_decode::FAMILY,
            Shape::AttnDecodeRope { .. } => attn_decode_rope::FAMILY,
            Shape::QkNormRope { .. } => qk_norm_rope::FAMILY,
            Shape::AttnPrefill { .. } => attn_prefill::FAMILY,
            Shape::MlaDecode { .. } => mla_decode::FAMILY,
            Shape::DsaIndexKey { .. } => dsa_index_key::FAMILY,
            Shape::DsaIndexer { .. } => dsa_indexer::FAMILY,
            Shape::DsaTopk { .. } => dsa_topk::FAMILY,
            Shape::MlaSparseDecode { .. } => mla_sparse_decode::FAMILY,
            Shape::MoeRouter { .. } => moe_router::FAMILY,
            Shape::MoeMatvec { .. } => moe_matvec::FAMILY,
            Shape::NormMatvec { .. } => norm_matvec::FAMILY,
            Shape::CombineMatvec { .. } => combine_matvec::FAMILY,
        }
    }

    /// `k6144_n2048`, `4096x6144`, `t4096_k6144_n2048`, …
    pub fn label(&self) -> String {
        match *self {
            Shape::Matvec { k, n, .. } => format!("k{k}_n{n}"),
            Shape::Matmul { t, k, n, .. } => format!("t{t}_k{k}_n{n}"),
            Shape::Rmsnorm { rows, n } | Shape::AddRmsnorm { rows, n, .. } => format!("{rows}x{n}"),
            Shape::Glu { rows, n_ff, .. } => format!("{rows}x{n_ff}"),
            Shape::Argmax { rows, n_vocab } => format!("{rows}x{n_vocab}"),
            Shape::Topk { rows, n_vocab, k } => format!("{rows}x{n_vocab}_k{k}"),
            Shape::Embed { t, n_embd, n_vocab, .. } => format!("t{t}_e{n_embd}_v{n_vocab}"),
            // The attention labels are peers-attention.json's: q heads, kv heads, qk dim, v dim.
            Shape::QkNormRope { t, n_head, n_kv, head_dim, n_rot } => format!("t{t}_h{n_head}_kv{n_kv}_d{head_dim}_r{n_rot}"),
            Shape::AttnDecode { n_head, n_kv, head_dim, ctx } | Shape::AttnDecodeRope { n_head, n_kv, head_dim, ctx, .. } => {
                format!("h{n_head}_kv{n_kv}_d{head_dim}_dv{head_dim}_c{ctx}")
            }
            Shape::MlaDecode { n_head, kv_lora, rope, ctx } => format!("h{n_head}_kv1_d{}_dv{kv_lora}_c{ctx}", kv_lora + rope),
            Shape::MlaSparseDecode { n_head, kv_lora, rope, ctx, k } => {
                format!("h{n_head}_kv1_d{}_dv{kv_lora}_k{k}_c{ctx}", kv_lora + rope)
            }
            Shape::AttnPrefill { t, n_head, n_kv, head_dim } => format!("t{t}_h{n_head}_kv{n_kv}_d{head_dim}"),
            Shape::DsaIndexKey { t, head_dim, n_rot } => format!("t{t}_d{head_dim}_r{n_rot}"),
            Shape::DsaIndexer { n_head, head_dim, ctx } => format!("q1_h{n_head}_d{head_dim}_c{ctx}"),
            Shape::DsaTopk { ctx, k } => format!("q1_c{ctx}_k{k}"),
            Shape::MoeRouter { t, n_expert, n_used, sigmoid } => {
                format!("t{t}_e{n_expert}_k{n_used}_{}", if sigmoid { "sigmoid" } else { "softmax" })
            }
            Shape::MoeMatvec { mode, t, k, n, n_expert, n_used, .. } => format!("t{t}_k{k}_n{n}_e{n_expert}_u{n_used}_{}", mode.token()),
            Shape::NormMatvec { glu, k, n, .. } => format!("k{k}_n{n}_{}", glu.token()),
            Shape::CombineMatvec { k, n, head_dim, n_split, .. } => format!("k{k}_n{n}_d{head_dim}_s{n_split}"),
        }
    }

    /// The weight type for matvec/matmul/embed, `f32` for the activation-only families.
    pub fn dtype(&self) -> String {
        match self {
            Shape::Matvec { ty, .. } | Shape::Matmul { ty, .. } | Shape::Embed { ty, .. } | Shape::MoeMatvec { ty, .. }
            | Shape::NormMatvec { ty, .. }
            | Shape::CombineMatvec { ty, .. } => {
                ty.name().to_ascii_lowercase()
            }
            // The cache type of the attention / DSA families (the benched variants read bf16).
            Shape::AttnDecode { .. }
            | Shape::AttnDecodeRope { .. }
            | Shape::QkNormRope { .. }
            | Shape::AttnPrefill { .. }
            | Shape::MlaDecode { .. }
            | Shape::MlaSparseDecode { .. }
            | Shape::DsaIndexKey { .. }
            | Shape::DsaIndexer { .. } => "bf16".into(),
            _ => "f32".into(),
        }
    }

    /// Fewest bytes one launch must move (module doc).
    pub fn bytes(&self) -> u64 {
        let f = 4u64;
        match *self {
            Shape::Matvec { ty, k, n } => weight_bytes(ty, k, n) + f * (k + n) as u64,
            Shape::Matmul { ty, t, k, n } => weight_bytes(ty, k, n) + f * (t * k + t * n) as u64,
            Shape::Rmsnorm { rows, n } => f * (2 * rows * n + n) as u64,
            Shape::AddRmsnorm { rows, n, delta_norm } => f * (4 * rows * n + n * (1 + delta_norm as usize)) as u64,
            Shape::Glu { rows, n_ff, .. } => f * (3 * rows * n_ff) as u64,
            Shape::Argmax { rows, n_vocab } | Shape::Topk { rows, n_vocab, .. } => f * (rows * n_vocab) as u64,
            Shape::Embed { ty, t, n_embd, .. } => weight_bytes(ty, n_embd, t) + f * (t * n_embd + t) as u64,
            Shape::AttnDecode { n_head, n_kv, head_dim, ctx } => BF16 * (2 * ctx * n_kv * head_dim) as u64 + f * (2 * n_head * head_dim + 1) as u64,
            Shape::QkNormRope { t, n_head, n_kv, head_dim, .. } => {
                f * (2 * t * (n_head + n_kv) * head_dim + t * n_kv * head_dim + t) as u64 + BF16 * (2 * t * n_kv * head_dim) as u64
            }
            // Rows before the new one read, the new row written: 2·ctx rows of K and V either way.
            Shape::AttnDecodeRope { n_head, n_kv, head_dim, ctx, .. } => {
                BF16 * (2 * ctx * n_kv * head_dim) as u64 + f * ((2 * n_head + 2 * n_kv) * head_dim + 1) as u64
            }
            Shape::AttnPrefill { t, n_head, n_kv, head_dim } => BF16 * (2 * t * n_kv * head_dim) as u64 + f * (2 * t * n_head * head_dim) as u64,
            Shape::MlaDecode { n_head, kv_lora, rope, ctx } => {
                BF16 * (ctx * (kv_lora + rope)) as u64 + f * (n_head * (2 * kv_lora + rope) + 1) as u64
            }
            // Only the selected rows are read.
            Shape::MlaSparseDecode { n_head, kv_lora, rope, k, .. } => {
                BF16 * (k * (kv_lora + rope)) as u64 + f * (n_head * (2 * kv_lora + rope) + k + 1) as u64
            }
            // k rows in, LayerNorm weight + bias, positions, cache rows out.
            Shape::DsaIndexKey { t, head_dim, .. } => f * (t * head_dim + 2 * head_dim + t) as u64 + BF16 * (t * head_dim) as u64,
            Shape::DsaIndexer { n_head, head_dim, ctx } => BF16 * (ctx * head_dim) as u64 + f * (n_head * head_dim + n_head + 1 + ctx) as u64,
            Shape::DsaTopk { ctx, k } => f * (ctx + 1 + k + 1) as u64,
            Shape::MoeRouter { t, n_expert, n_used, sigmoid } => f * (t * n_expert + if sigmoid { n_expert } else { 0 } + 2 * t * n_used) as u64,
            // Only the selected experts' rows (twice when gate and up are paired) + x, y, ids
            // (and the routing weights in down mode).
            Shape::MoeMatvec { ty, mode, t, k, n, n_used, .. } => {
                let slots = t * n_used;
                let w = moe_matvec::selected_bytes(ty, mode, k, n, slots).unwrap_or(0) as u64;
                let (x_rows, y_rows, wts) = if mode == moe_matvec::Mode::Down { (slots, t, slots) } else { (t, slots, 0) };
                w + f * (x_rows * k + y_rows * n + slots + wts) as u64
            }
            // W (and Wu), then x, delta, delta_w, norm_w read and the residual written: 5 rows of k.
            Shape::NormMatvec { ty, glu, k, n } => {
                weight_bytes(ty, k, n) * if glu == norm_matvec::Glu::None { 1 } else { 2 } + f * (5 * k + n) as u64
            }
            // W, every split's partials (acc and m, l per head) read once, y.
            Shape::CombineMatvec { ty, k, n, head_dim, n_split } => {
                weight_bytes(ty, k, n) + f * ((k / head_dim.max(1)) * n_split * (head_dim + 2) + n) as u64
            }
        }
    }

    /// Floating-point operations of one launch where they matter (the matrix families).
    pub fn flops(&self) -> Option<u64> {
        match *self {
            Shape::Matvec { k, n, .. } | Shape::CombineMatvec { k, n, .. } => Some(2 * (k * n) as u64),
            Shape::Matmul { t, k, n, .. } => Some(2 * (t * k) as u64 * n as u64),
            // q·k and p·v per (head, visible key).
            Shape::AttnDecode { n_head, head_dim, ctx, .. } | Shape::AttnDecodeRope { n_head, head_dim, ctx, .. } => {
                Some(4 * (n_head * head_dim * ctx) as u64)
            }
            Shape::AttnPrefill { t, n_head, n_kv, head_dim } => Some(attn_prefill::flops(&prefill_params(t, n_head, n_kv, head_dim))),
            Shape::MlaDecode { n_head, kv_lora, rope, ctx } => Some(2 * (n_head * ctx) as u64 * (2 * kv_lora + rope) as u64),
            Shape::MlaSparseDecode { n_head, kv_lora, rope, k, .. } => Some(2 * (n_head * k) as u64 * (2 * kv_lora + rope) as u64),
            Shape::DsaIndexer { n_head, head_dim, ctx } => Some(2 * (n_head * head_dim) as u64 * ctx as u64),
            Shape::MoeMatvec { mode, t, k, n, n_used, .. } => Some(2 * (k * n * t * n_used) as u64 * if mode.is_paired() { 2 } else { 1 }),
            Shape::NormMatvec { glu, k, n, .. } => Some(2 * (k * n) as u64 * if glu == norm_matvec::Glu::None { 1 } else { 2 }),
            _ => None,
        }
    }
}

/// One shape with the variants to compare on it.
#[derive(Clone, Debug)]
pub struct Case {
    pub shape: Shape,
    /// The architecture whose preset gave the shape.
    pub arch: &'static str,
    pub specialized: Option<&'static KernelVariant>,
    pub generic: Option<&'static KernelVariant>,
    /// The specialized variant was rendered by the bench (no registry variant of this dtype).
    pub rendered: bool,
}

impl Case {
    pub fn variants(&self) -> impl Iterator<Item = (&'static KernelVariant, Kind)> + '_ {
        self.specialized.map(|v| (v, Kind::Specialized)).into_iter().chain(self.generic.map(|v| (v, Kind::Generic)))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Specialized,
    Generic,
}

impl Kind {
    pub fn label(self) -> &'static str {
        match self {
            Kind::Specialized => "specialized",
            Kind::Generic => "generic",
        }
    }
}

fn int(v: &KernelVariant, key: &str) -> Option<usize> {
    match v.param(key) {
        Some(Param::Int(i)) if i >= 0 => Some(i as usize),
        _ => None,
    }
}

fn sym_type(v: &KernelVariant) -> Option<GgmlType> {
    match v.param("qtype") {
        Some(Param::Sym(s)) => GgmlType::from_name(s),
        _ => None,
    }
}

fn token(ty: GgmlType) -> &'static str {
    // The registry's dtype tokens are ggml names in lower case (KERNEL-CONTRACT §2).
    Box::leak(ty.name().to_ascii_lowercase().into_boxed_str())
}

/// The generic variant of `v`'s family with the same non-dim choices (qtype, delta_norm, batch,
/// accumulate, …); among several, the one sharing most tuning knobs.
pub fn generic_twin(v: &KernelVariant) -> Option<&'static KernelVariant> {
    let wanted = |key: &str| v.param(key);
    // Keys that change what is computed must match; the rest are tuning and only rank candidates.
    const SEMANTIC: [&str; 10] = ["qtype", "delta_norm", "batch", "accumulate", "rope_mode", "cache_t", "mode", "gating", "qk_norm", "xq8"];
    registry::variants()
        .iter()
        .filter(|g| g.is_generic() && g.family == v.family)
        .filter(|g| SEMANTIC.iter().all(|k| g.param(k).is_none() || g.param(k) == wanted(k)))
        .max_by_key(|g| g.params.iter().filter(|(k, val)| wanted(k) == Some(*val)).count())
}

/// A specialized matvec variant of `base`'s shape and tuning in weight type `ty`: the registry's
/// if it has one (its generic twin is then the registry's too: `None`), else one rendered here
/// with its generic twin (the same tuning, dims at run time) rendered beside it, so the pair
/// differs in the baked dims alone (leaked: they live as long as the process, like the registry).
/// `n` is the case's N; the rendered variant bakes it only where `base` does (a spec entry's
/// `at_run_time = ["n"]` keeps N a kernel argument).
fn matvec_in_type(base: &'static KernelVariant, ty: GgmlType, k: usize, n: usize) -> (&'static KernelVariant, Option<&'static KernelVariant>) {
    let baked_n = int(base, "n").map(|_| n);
    if sym_type(base) == Some(ty) {
        return (base, None);
    }
    let tok = token(ty);
    if let Some(found) = registry::variants().iter().find(|v| {
        v.family == matvec::FAMILY
            && !v.is_generic()
            && int(v, "k") == Some(k)
            && int(v, "n") == baked_n
            && v.param("qtype") == Some(Param::Sym(tok))
            && v.params.iter().filter(|(key, _)| *key != "qtype").all(|(key, val)| base.param(key) == Some(*val))
    }) {
        return (found, None);
    }
    // The integer path exists for some types only: the others keep the f32 path, as codegen
    // plans an entry's tensors of such types (plan::without_xq8_where_no_int_path).
    let int_dot = matvec::int_dot(ty);
    let xq8 = if int_dot { int(base, "xq8").unwrap_or(0) } else { 0 };
    let fuse_x = if int_dot { int(base, "fuse_x").unwrap_or(0) } else { 0 };
    let mut tune = matvec::tuning_of(base).unwrap_or_else(|e| panic!("{}: {e}", base.name));
    if !int_dot {
        (tune.xq8, tune.fuse_x) = (false, false);
    }
    // The base's name with the type swapped: its tuning suffix (`_rows_per_group1_stages4`,
    // `_xq82`) stays, less an xq8 this type cannot take.
    let base_tok = sym_type(base).map_or("", token);
    let suffix = base.name.split_once(&format!("__{base_tok}")).map_or("", |(_, rest)| rest);
    let mut suffix = suffix.to_string();
    for (key, kept) in [("xq8", xq8), ("fuse_x", fuse_x)] {
        if let Some(x) = int(base, key).filter(|&x| x != kept) {
            suffix = suffix.replace(&format!("_{key}{x}"), "");
        }
    }
    let params: Vec<(&'static str, Param)> = base
        .params
        .iter()
        .map(|&(key, val)| match key {
            "qtype" => (key, Param::Sym(tok)),
            "xq8" => (key, Param::Int(xq8 as i64)),
            "fuse_x" => (key, Param::Int(fuse_x as i64)),
            _ => (key, val),
        })
        .collect();
    let render = |name: String, arch: Option<&'static str>, dims: (usize, usize), params: Vec<(&'static str, Param)>| -> &'static KernelVariant {
        let name: &'static str = Box::leak(name.into_boxed_str());
        let source: &'static str = Box::leak(matvec::render_source(name, ty, dims.0, dims.1, &tune).into_boxed_str());
        Box::leak(Box::new(KernelVariant { name, family: matvec::FAMILY, arch, params: Box::leak(params.into_boxed_slice()), source }))
    };
    let generic_params = params.iter().copied().filter(|(key, _)| *key != "k" && *key != "n").collect();
    let generic = render(format!("matvec__generic__{tok}{suffix}"), None, (0, 0), generic_params);
    let dims = match baked_n {
        Some(n) => format!("k{k}_n{n}"),
        None => format!("k{k}"),
    };
    (render(format!("matvec__{dims}__{tok}{suffix}"), base.arch, (k, baked_n.unwrap_or(0)), params), Some(generic))
}

/// The N a product variant is timed at for `arch`: its baked N, or, passed at run time, each N
/// this arch's spec planned it for.
fn served_n(v: &KernelVariant, arch: &str) -> Vec<usize> {
    let served = registry::served(v.name).iter().filter(|(sa, _)| *sa == arch).filter_map(|(_, s)| s.iter().find(|(d, _)| *d == "n")).map(|&(_, n)| n as usize);
    int(v, "n").into_iter().chain(served).collect()
}

/// The n_vocab of an architecture's preset as far as the registry shows it (its argmax variant).
fn arch_vocab(arch: &str) -> usize {
    registry::variants().iter().find(|v| v.is_for(arch) && v.family == argmax::FAMILY).and_then(|v| int(v, "n_vocab")).unwrap_or(32000)
}

/// A baked int of `arch`'s first specialized variant of `family` (e.g. the router's n_expert).
fn arch_int(arch: &str, family: &str, key: &str) -> Option<usize> {
    registry::variants().iter().filter(|v| v.is_for(arch) && v.family == family).find_map(|v| int(v, key))
}

/// Decode contexts of GQA attention (640: `memra bench --model`'s decode steps, where a step is
/// latency-bound; 4096 and 32768: peers-attention.json's), of dense MLA (GLM-5 at 32k and 128k),
/// and of the DSA step (128k visible keys).
pub const ATTN_DECODE_CTX: [usize; 3] = [640, 4096, 32768];
/// Split counts of the combine_matvec cases: a short context's and the most the engine hands
/// the projection.
pub const COMBINE_SPLITS: [usize; 2] = [8, combine_matvec::DEFAULT_MAX_SPLITS];
pub const MLA_DECODE_CTX: [usize; 2] = [32768, 131072];
pub const DSA_CTX: usize = 131072;

/// The cases for the built architectures (or `arch`), optionally one family.
pub fn plan(arch: Option<&str>, family: Option<&str>) -> Vec<Case> {
    let mut cases: Vec<Case> = Vec::new();
    // `generic`: the twin when the caller rendered one, else the registry's (generic_twin).
    let push = |cases: &mut Vec<Case>, shape: Shape, arch: &'static str, spec: &'static KernelVariant, generic: Option<&'static KernelVariant>, rendered: bool| {
        if family.is_some_and(|f| f != shape.family()) {
            return;
        }
        if cases.iter().any(|c| c.shape == shape && c.arch == arch && c.specialized.map(|s| s.name) == Some(spec.name)) {
            return;
        }
        cases.push(Case { shape, arch, specialized: Some(spec), generic: generic.or_else(|| generic_twin(spec)), rendered });
    };
    // A variant two specs plan alike counts for each of them (each arch's geomean has it).
    let pairs = registry::variants().iter().filter(|v| !v.is_generic()).flat_map(|v| v.archs().into_iter().map(move |a| (v, a)));
    for (v, a) in pairs {
        if arch.is_some_and(|want| want != a) {
            continue;
        }
        match v.family {
            "matvec" => {
                let (Some(k), Some(baked)) = (int(v, "k"), sym_type(v)) else {
                    continue;
                };
                if int(v, "batch").unwrap_or(1) != 1 {
                    continue;
                }
                let mut types = vec![baked];
                types.extend(MATVEC_EXTRA_TYPES.iter().copied().filter(|t| *t != baked));
                for n in served_n(v, a) {
                    for &ty in &types {
                        if matvec::k_multiple(ty).is_none_or(|m| !k.is_multiple_of(m)) {
                            continue;
                        }
                        let (spec, generic) = matvec_in_type(v, ty, k, n);
                        push(&mut cases, Shape::Matvec { ty, k, n }, a, spec, generic, generic.is_some());
                    }
                }
            }
            "matmul" => {
                let (Some(k), Some(ty)) = (int(v, "k"), sym_type(v)) else {
                    continue;
                };
                for n in served_n(v, a) {
                    push(&mut cases, Shape::Matmul { ty, t: PREFILL_T, k, n }, a, v, None, false);
                }
            }
            "rmsnorm" => {
                let Some(n) = int(v, "n") else { continue };
                for rows in [PREFILL_T, 1] {
                    push(&mut cases, Shape::Rmsnorm { rows, n }, a, v, None, false);
                }
            }
            "add_rmsnorm" => {
                let Some(n) = int(v, "n") else { continue };
                let delta_norm = int(v, "delta_norm").unwrap_or(0) == 1;
                for rows in [PREFILL_T, 1] {
                    push(&mut cases, Shape::AddRmsnorm { rows, n, delta_norm }, a, v, None, false);
                }
            }
            "swiglu" | "geglu" => {
                let Some(n_ff) = int(v, "n_ff") else { continue };
                let fam: &'static str = if v.family == "swiglu" { swiglu::FAMILY } else { geglu::FAMILY };
                for rows in [PREFILL_T, 1] {
                    push(&mut cases, Shape::Glu { family: fam, rows, n_ff }, a, v, None, false);
                }
            }
            "argmax" => {
                let Some(n_vocab) = int(v, "n_vocab") else {
                    continue;
                };
                push(&mut cases, Shape::Argmax { rows: 1, n_vocab }, a, v, None, false);
            }
            "topk" => {
                let (Some(n_vocab), Some(k)) = (int(v, "n_vocab"), int(v, "k")) else {
                    continue;
                };
                for rows in [1, PREFILL_T] {
                    push(&mut cases, Shape::Topk { rows, n_vocab, k }, a, v, None, false);
                }
            }
            "embed" => {
                let (Some(n_embd), Some(ty)) = (int(v, "n_embd"), sym_type(v)) else {
                    continue;
                };
                for t in [1, PREFILL_T] {
                    push(&mut cases, Shape::Embed { ty, t, n_embd, n_vocab: arch_vocab(a) }, a, v, None, false);
                }
            }
            // The attention and DSA variants benched read a bf16 cache (f32 ones are not planned).
            _ if v.param("cache_t").is_some_and(|c| c != Param::Sym("bf16")) => {}
            "attn_decode" => {
                let (Some(n_head), Some(n_kv), Some(head_dim)) = (int(v, "n_head"), int(v, "n_kv"), int(v, "head_dim")) else {
                    continue;
                };
                for ctx in ATTN_DECODE_CTX {
                    push(&mut cases, Shape::AttnDecode { n_head, n_kv, head_dim, ctx }, a, v, None, false);
                }
            }
            "attn_decode_rope" => {
                let (Some(n_head), Some(n_kv), Some(head_dim), Some(n_rot)) = (int(v, "n_head"), int(v, "n_kv"), int(v, "head_dim"), int(v, "n_rot")) else {
                    continue;
                };
                for ctx in ATTN_DECODE_CTX {
                    push(&mut cases, Shape::AttnDecodeRope { n_head, n_kv, head_dim, n_rot, ctx }, a, v, None, false);
                }
            }
            "qk_norm_rope" => {
                let (Some(n_head), Some(n_kv), Some(head_dim), Some(n_rot)) = (int(v, "n_head"), int(v, "n_kv"), int(v, "head_dim"), int(v, "n_rot")) else {
                    continue;
                };
                for t in [1, PREFILL_T] {
                    push(&mut cases, Shape::QkNormRope { t, n_head, n_kv, head_dim, n_rot }, a, v, None, false);
                }
            }
            "attn_prefill" => {
                let (Some(n_head), Some(n_kv), Some(head_dim)) = (int(v, "n_head"), int(v, "n_kv"), int(v, "head_dim")) else {
                    continue;
                };
                push(&mut cases, Shape::AttnPrefill { t: PREFILL_T, n_head, n_kv, head_dim }, a, v, None, false);
            }
            "mla_decode" => {
                let (Some(n_head), Some(kv_lora), Some(rope)) = (int(v, "n_head"), int(v, "kv_lora"), int(v, "rope")) else {
                    continue;
                };
                for ctx in MLA_DECODE_CTX {
                    push(&mut cases, Shape::MlaDecode { n_head, kv_lora, rope, ctx }, a, v, None, false);
                }
            }
            "mla_sparse_decode" => {
                let (Some(n_head), Some(kv_lora), Some(rope)) = (int(v, "n_head"), int(v, "kv_lora"), int(v, "rope")) else {
                    continue;
                };
                let k = arch_int(a, dsa_topk::FAMILY, "k").unwrap_or(2048);
                push(&mut cases, Shape::MlaSparseDecode { n_head, kv_lora, rope, ctx: DSA_CTX, k }, a, v, None, false);
            }
            "dsa_index_key" => {
                let (Some(head_dim), Some(n_rot)) = (int(v, "head_dim"), int(v, "n_rot")) else {
                    continue;
                };
                for t in [1, PREFILL_T] {
                    push(&mut cases, Shape::DsaIndexKey { t, head_dim, n_rot }, a, v, None, false);
                }
            }
            "dsa_indexer" => {
                let (Some(n_head), Some(head_dim)) = (int(v, "n_idx_head"), int(v, "idx_head_dim")) else {
                    continue;
                };
                push(&mut cases, Shape::DsaIndexer { n_head, head_dim, ctx: DSA_CTX }, a, v, None, false);
            }
            "dsa_topk" => {
                let Some(k) = int(v, "k") else { continue };
                push(&mut cases, Shape::DsaTopk { ctx: DSA_CTX, k }, a, v, None, false);
            }
            "moe_router" => {
                let (Some(n_expert), Some(n_used)) = (int(v, "n_expert"), int(v, "n_used")) else {
                    continue;
                };
                let sigmoid = v.param("gating") == Some(Param::Sym("sigmoid"));
                for t in [1, PREFILL_T] {
                    push(&mut cases, Shape::MoeRouter { t, n_expert, n_used, sigmoid }, a, v, None, false);
                }
            }
            "moe_matvec" => {
                let (Some(k), Some(n), Some(ty)) = (int(v, "k"), int(v, "n"), sym_type(v)) else {
                    continue;
                };
                let mode = match v.param("mode") {
                    Some(Param::Sym("plain")) => moe_matvec::Mode::Plain,
                    Some(Param::Sym("swiglu")) => moe_matvec::Mode::Swiglu,
                    Some(Param::Sym("geglu")) => moe_matvec::Mode::Geglu,
                    Some(Param::Sym("down")) => moe_matvec::Mode::Down,
                    _ => continue,
                };
                let router = (arch_int(a, moe_router::FAMILY, "n_expert"), arch_int(a, moe_router::FAMILY, "n_used"));
                let heads = arch_int(a, mla_decode::FAMILY, "n_head").or(arch_int(a, mla_sparse_decode::FAMILY, "n_head"));
                // Routed experts come as a gate/up + down pair of one type; a gate/up variant with
                // no down partner is a dense FFN or shared expert run as one expert (moe_matvec.rs).
                let has_down_partner = registry::variants().iter().any(|d| {
                    d.is_for(a)
                        && d.family == moe_matvec::FAMILY
                        && d.param("mode") == Some(Param::Sym("down"))
                        && d.param("qtype") == v.param("qtype")
                        && int(d, "k") == Some(n)
                        && int(d, "n") == Some(k)
                });
                let (t, n_expert, n_used) = match (mode, router, heads) {
                    // Plain: MLA's per-head absorption, the head as the expert, one row per head.
                    (moe_matvec::Mode::Plain, _, Some(h)) => (h, h, 1),
                    (moe_matvec::Mode::Plain, ..) => continue,
                    // Routed experts of one decode token.
                    (moe_matvec::Mode::Down, (Some(e), Some(u)), _) => (1, e, u),
                    (_, (Some(e), Some(u)), _) if has_down_partner => (1, e, u),
                    _ => (1, 1, 1),
                };
                push(&mut cases, Shape::MoeMatvec { ty, mode, t, k, n, n_expert, n_used }, a, v, None, false);
            }
            "norm_matvec" => {
                let (Some(k), Some(n), Some(ty)) = (int(v, "k"), int(v, "n"), sym_type(v)) else {
                    continue;
                };
                let Some(glu) = v.param("glu").and_then(|g| match g {
                    Param::Sym(t) => norm_matvec::Glu::from_token(t),
                    _ => None,
                }) else {
                    continue;
                };
                push(&mut cases, Shape::NormMatvec { ty, glu, k, n }, a, v, None, false);
            }
            "combine_matvec" => {
                let (Some(k), Some(n), Some(head_dim), Some(ty)) = (int(v, "k"), int(v, "n"), int(v, "head_dim"), sym_type(v)) else {
                    continue;
                };
                for n_split in COMBINE_SPLITS {
                    push(&mut cases, Shape::CombineMatvec { ty, k, n, head_dim, n_split }, a, v, None, false);
                }
            }
            // Not wired yet (module doc): qk_norm_rope.
            _ => {}
        }
    }
    cases
}

// ---------------------------------------------------------------------------------------------
// Buffers and timing.

fn drv(call: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Driver { call: call.to_string(), detail: format!("{e:?}") }
}

/// Fills `dst` by repeating `pattern` (whole copies, then a prefix).
fn tile<T: DeviceRepr>(s: &Arc<CudaStream>, dst: &mut CudaSlice<T>, pattern: &CudaSlice<T>) -> Result<(), Error> {
    let (len, p) = (dst.len(), pattern.len());
    let mut at = 0;
    while at < len {
        let m = p.min(len - at);
        s.memcpy_dtod(&pattern.slice(..m), &mut dst.slice_mut(at..at + m)).map_err(drv("cuMemcpyDtoDAsync (fill)"))?;
        at += m;
    }
    Ok(())
}

fn alloc<T: DeviceRepr + ValidAsZeroBits>(s: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<T>, Error> {
    s.alloc_zeros::<T>(n.max(1)).map_err(|e| Error::Driver { call: format!("cuMemAlloc({} bytes)", n * size_of::<T>()), detail: format!("{e:?}") })
}

/// Random data sources: one small random pattern per element kind, tiled into every buffer
/// (random values, never zeros; repeating a few MiB does not change a kernel's speed).
struct Filler {
    stream: Arc<CudaStream>,
    rng: Rng,
    floats: CudaSlice<f32>,
}

impl Filler {
    fn new(stream: &Arc<CudaStream>, rng: Rng) -> Result<Filler, Error> {
        let mut rng = rng;
        let host = rng.normal_vec(1 << 20, 1.0);
        let floats = stream.clone_htod(&host).map_err(drv("cuMemcpyHtoD (pattern)"))?;
        Ok(Filler { stream: stream.clone(), rng, floats })
    }

    fn f32s(&self, n: usize) -> Result<CudaSlice<f32>, Error> {
        let mut b = alloc::<f32>(&self.stream, n)?;
        tile(&self.stream, &mut b, &self.floats)?;
        Ok(b)
    }

    /// `n` bf16 values (the f32 pattern's upper halves), for the bf16 caches.
    fn bf16s(&mut self, n: usize) -> Result<CudaSlice<u16>, Error> {
        let host: Vec<u16> = self.rng.normal_vec(1 << 20, 1.0).iter().map(|x| (x.to_bits() >> 16) as u16).collect();
        let pattern = self.stream.clone_htod(&host).map_err(drv("cuMemcpyHtoD (bf16 pattern)"))?;
        let mut b = alloc::<u16>(&self.stream, n)?;
        tile(&self.stream, &mut b, &pattern)?;
        Ok(b)
    }

    /// `n` rows of `ty` at `k` elements: 64 random rows quantized, repeated.
    fn weights(&mut self, ty: GgmlType, k: usize, n: usize) -> Result<CudaSlice<u8>, Error> {
        let rows = n.clamp(1, 64);
        let host = quant::quantize(ty, &self.rng.normal_vec(rows * k, 1.0))
            .map_err(|e| Error::Selection { detail: format!("quantize {} {k}x{rows} for the bench: {e}", ty.name()) })?;
        let pattern = self.stream.clone_htod(&host).map_err(drv("cuMemcpyHtoD (weights)"))?;
        let mut b = alloc::<u8>(&self.stream, weight_bytes(ty, k, n) as usize)?;
        tile(&self.stream, &mut b, &pattern)?;
        Ok(b)
    }

    fn tokens(&mut self, t: usize, n_vocab: usize) -> Result<CudaSlice<i32>, Error> {
        let host: Vec<i32> = (0..t).map(|_| self.rng.below(n_vocab) as i32).collect();
        self.stream.clone_htod(&host).map_err(drv("cuMemcpyHtoD (tokens)"))
    }
}

/// One set of buffers a launch reads and writes.
enum Set {
    Matrix {
        w: CudaSlice<u8>,
        x: CudaSlice<f32>,
        y: CudaSlice<f32>,
    },
    Norm {
        x: CudaSlice<f32>,
        w: CudaSlice<f32>,
        out: CudaSlice<f32>,
        residual: CudaSlice<f32>,
    },
    Glu {
        gate: CudaSlice<f32>,
        up: CudaSlice<f32>,
        out: CudaSlice<f32>,
    },
    Logits {
        logits: CudaSlice<f32>,
        idx: CudaSlice<i32>,
        val: CudaSlice<f32>,
    },
    Embed {
        tokens: CudaSlice<i32>,
        table: Arc<CudaSlice<u8>>,
        out: CudaSlice<f32>,
    },
    /// norm_matvec: W (and Wu), the residual x and branch delta, the two norms' weights, the
    /// new residual and y.
    NormMatvec {
        w: CudaSlice<u8>,
        w_up: Option<CudaSlice<u8>>,
        vecs: [CudaSlice<f32>; 4],
        x_out: CudaSlice<f32>,
        y: CudaSlice<f32>,
    },
    /// combine_matvec: W, attn_decode's workspace with random partials, y.
    Combine {
        w: CudaSlice<u8>,
        work: CudaSlice<f32>,
        y: CudaSlice<f32>,
    },
    /// Attention, DSA and MoE families (bench/attn_moe.rs).
    Extra(attn_moe::ExtraSet),
}

/// A case's buffers on the device, ready to launch any of its variants.
pub struct Prepared {
    pub shape: Shape,
    sets: Vec<Set>,
    scratch: HashMap<&'static str, CudaSlice<u8>>,
    /// Split-kernel workspaces per variant (attn_decode, mla_decode, mla_sparse_decode).
    work: HashMap<&'static str, CudaSlice<f32>>,
    shared: attn_moe::Shared,
    sm_count: usize,
}

impl Prepared {
    /// Allocates and fills `sets` buffer sets (see [`sets_for`]).
    pub fn new(gpu: &Gpu, shape: Shape, sets: usize, rng: Rng) -> Result<Prepared, Error> {
        let s = gpu.stream();
        let mut fill = Filler::new(s, rng)?;
        let mut out = Vec::with_capacity(sets);
        // The embedding table is large and read sparsely: one copy shared by every set.
        let table = match shape {
            Shape::Embed { ty, n_embd, n_vocab, .. } => Some(Arc::new(fill.weights(ty, n_embd, n_vocab)?)),
            _ => None,
        };
        let shared = attn_moe::Shared::new(gpu, &mut fill, &shape)?;
        for _ in 0..sets.max(1) {
            if let Some(set) = attn_moe::make_set(&mut fill, &shape)? {
                out.push(Set::Extra(set));
                continue;
            }
            out.push(match shape {
                Shape::Matvec { ty, k, n } => Set::Matrix { w: fill.weights(ty, k, n)?, x: fill.f32s(k)?, y: alloc(s, n)? },
                Shape::Matmul { ty, t, k, n } => Set::Matrix { w: fill.weights(ty, k, n)?, x: fill.f32s(t * k)?, y: alloc(s, t * n)? },
                Shape::Rmsnorm { rows, n } => {
                    Set::Norm { x: fill.f32s(rows * n)?, w: fill.f32s(n)?, out: alloc(s, rows * n)?, residual: alloc(s, 1)? }
                }
                Shape::AddRmsnorm { rows, n, .. } => {
                    Set::Norm { x: fill.f32s(rows * n)?, w: fill.f32s(n)?, out: alloc(s, rows * n)?, residual: fill.f32s(rows * n)? }
                }
                Shape::Glu { rows, n_ff, .. } => Set::Glu { gate: fill.f32s(rows * n_ff)?, up: fill.f32s(rows * n_ff)?, out: alloc(s, rows * n_ff)? },
                Shape::Argmax { rows, n_vocab } | Shape::Topk { rows, n_vocab, .. } => {
                    Set::Logits { logits: fill.f32s(rows * n_vocab)?, idx: alloc(s, rows * topk::MAX_K)?, val: alloc(s, rows * topk::MAX_K)? }
                }
                Shape::Embed { t, n_embd, n_vocab, .. } => {
                    Set::Embed { tokens: fill.tokens(t, n_vocab)?, table: table.clone().expect("made above"), out: alloc(s, t * n_embd)? }
                }
                Shape::NormMatvec { ty, glu, k, n } => Set::NormMatvec {
                    w: fill.weights(ty, k, n)?,
                    w_up: if glu == norm_matvec::Glu::None { None } else { Some(fill.weights(ty, k, n)?) },
                    vecs: [fill.f32s(k)?, fill.f32s(k)?, fill.f32s(k)?, fill.f32s(k)?],
                    x_out: alloc(s, k)?,
                    y: alloc(s, n)?,
                },
                Shape::CombineMatvec { ty, k, n, head_dim, n_split } => {
                    let floats = attn_decode::work_floats(1, k / head_dim.max(1), head_dim, n_split);
                    Set::Combine { w: fill.weights(ty, k, n)?, work: fill.f32s(floats)?, y: alloc(s, n)? }
                }
                _ => unreachable!("attn_moe::make_set builds the sets of the other shapes"),
            });
        }
        gpu.sync()?;
        let sm_count = gpu.sm_count()?;
        Ok(Prepared { shape, sets: out, scratch: HashMap::new(), work: HashMap::new(), shared, sm_count })
    }

    pub fn sets(&self) -> usize {
        self.sets.len()
    }

    /// One launch of `kernel` on buffer set `i % sets`.
    pub fn launch(&mut self, kernel: &Kernel, i: usize) -> Result<(), Error> {
        let n_sets = self.sets.len();
        let set = &mut self.sets[i % n_sets];
        match (self.shape, set) {
            (Shape::Matvec { k, n, .. }, Set::Matrix { w, x, y }) => {
                let (xq, ldx) = self.shared.matvec_x(kernel, x, k)?;
                let xv = xq.unwrap_or(x).slice(..);
                matvec::matvec(kernel, &w.slice(..), &xv, &mut y.slice_mut(..), k, n, 1, ldx, n)
            }
            (Shape::Matmul { t, k, n, .. }, Set::Matrix { w, x, y }) => {
                matmul::matmul(kernel, &w.slice(..), &x.slice(..), &mut y.slice_mut(..), t, k, n, k, n)
            }
            (Shape::Rmsnorm { rows, n }, Set::Norm { x, w, out, .. }) => {
                rmsnorm::rmsnorm(kernel, &x.slice(..), &w.slice(..), &mut out.slice_mut(..), rows, n, 1e-6)
            }
            (Shape::AddRmsnorm { rows, n, delta_norm }, Set::Norm { x, w, out, residual }) => {
                let w = w.slice(..);
                let dw = delta_norm.then_some(&w);
                add_rmsnorm::add_rmsnorm(kernel, &mut residual.slice_mut(..), &x.slice(..), dw, &w, &mut out.slice_mut(..), rows, n, 1e-6)
            }
            (Shape::Glu { family, rows, n_ff }, Set::Glu { gate, up, out }) => {
                let layout = GluLayout::separate(n_ff);
                if family == swiglu::FAMILY {
                    swiglu::swiglu(kernel, &gate.slice(..), &up.slice(..), &mut out.slice_mut(..), rows, n_ff, layout)
                } else {
                    geglu::geglu(kernel, &gate.slice(..), &up.slice(..), &mut out.slice_mut(..), rows, n_ff, layout)
                }
            }
            (Shape::Argmax { rows, n_vocab }, Set::Logits { logits, idx, val }) => {
                let scratch = match self.scratch.entry(kernel.name()) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(e) => e.insert(argmax::alloc_scratch(kernel, rows, n_vocab)?),
                };
                argmax::argmax(kernel, &logits.slice(..), &mut idx.slice_mut(..), &mut val.slice_mut(..), &mut scratch.slice_mut(..), rows, n_vocab, None)
            }
            (Shape::Topk { rows, n_vocab, k }, Set::Logits { logits, idx, val }) => {
                let scratch = match self.scratch.entry(kernel.name()) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(e) => e.insert(topk::alloc_scratch(kernel, rows, n_vocab, k)?),
                };
                topk::topk(kernel, &logits.slice(..), &mut val.slice_mut(..), &mut idx.slice_mut(..), &mut scratch.slice_mut(..), rows, n_vocab, k)
            }
            (Shape::Embed { t, n_embd, n_vocab, .. }, Set::Embed { tokens, table, out }) => {
                embed::embed(kernel, &tokens.slice(..), &table.slice(..), &mut out.slice_mut(..), t, n_embd, n_vocab, 1.0)
            }
            (Shape::NormMatvec { k, n, .. }, Set::NormMatvec { w, w_up, vecs: [x, delta, delta_w, norm_w], x_out, y }) => {
                let (wv, uv) = (w.slice(..), w_up.as_ref().map(|u| u.slice(..)));
                let (dv, dwv) = (delta.slice(..), delta_w.slice(..));
                let weights = norm_matvec::NormMatvecWeights { w: &wv, w_up: uv.as_ref() };
                let add = norm_matvec::Residual { delta: &dv, delta_w: Some(&dwv) };
                norm_matvec::norm_matvec(kernel, &weights, &x.slice(..), Some(add), &norm_w.slice(..), Some(&mut x_out.slice_mut(..)), &mut y.slice_mut(..), k, n, 1e-6)
            }
            (Shape::CombineMatvec { k, n, head_dim, n_split, .. }, Set::Combine { w, work, y }) => {
                combine_matvec::combine_matvec(kernel, &w.slice(..), &work.slice(..), &mut y.slice_mut(..), k, n, head_dim, n_split)
            }
            (shape, Set::Extra(set)) => attn_moe::launch(kernel, &shape, set, &mut self.shared, &mut self.work, self.sm_count),
            _ => unreachable!("Prepared::new builds the set that matches its shape"),
        }
    }

    /// Device time of `n` back-to-back launches (rotating sets), in seconds (criterion's batches).
    pub fn time_batch(&mut self, gpu: &Gpu, kernel: &Kernel, n: u64) -> Result<f64, Error> {
        let s = gpu.stream();
        let start = record(s)?;
        for i in 0..n {
            self.launch(kernel, i as usize)?;
        }
        let end = record(s)?;
        Ok(start.elapsed_ms(&end).map_err(drv("cuEventElapsedTime"))? as f64 / 1e3)
    }
}

fn record(s: &Arc<CudaStream>) -> Result<CudaEvent, Error> {
    s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("cuEventRecord"))
}

/// The device's L2 size in bytes.
pub fn l2_bytes(gpu: &Gpu) -> usize {
    let dev_attr = gpu.ctx().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE);
    dev_attr.ok().filter(|v| *v > 0).map(|v| v as usize).unwrap_or(DEFAULT_L2)
}

/// Buffer sets for a working set of `bytes`: enough that the sets together exceed twice L2.
pub fn sets_for(shape: &Shape, l2: usize) -> usize {
    if matches!(shape, Shape::Embed { .. }) {
        return 1;
    }
    let ws = shape.bytes().max(1) as usize;
    (2 * l2).div_ceil(ws).clamp(1, MAX_SETS)
}

/// The L2 flush before each timed launch of `memra bench` and its sweeps (outside the events):
/// a read pass — a bf16 matvec (default tuning, generic) over a buffer of 2 × L2 that nothing
/// writes after setup — so the timed kernel finds L2 full of clean lines and its misses write
/// nothing back. (A memset of 2 × L2, the flush before session 4 and still [`time_launches`]'s,
/// leaves L2 full of dirty lines: the timed kernel's misses also write them back, 5-20 % slower
/// on the H200 at tens of MB.) It writes one float per 16 KiB row.
pub struct L2Flush {
    kernel: Kernel,
    w: CudaSlice<u8>,
    x: CudaSlice<f32>,
    y: CudaSlice<f32>,
    rows: usize,
}

impl L2Flush {
    /// Row length of the read pass (bf16: 16 KiB per row).
    const K: usize = 8192;

    /// The bf16 matvec the read pass launches (leaked once, as the sweeps' variants).
    pub fn variant() -> &'static KernelVariant {
        use std::sync::OnceLock;
        static V: OnceLock<&'static KernelVariant> = OnceLock::new();
        V.get_or_init(|| {
            let name = "matvec__generic__bf16_l2_flush";
            let t = matvec::MatvecTuning::default();
            Box::leak(Box::new(KernelVariant {
                name,
                family: matvec::FAMILY,
                arch: None,
                params: &[("qtype", Param::Sym("bf16"))],
                source: Box::leak(matvec::render_source(name, GgmlType::BF16, 0, 0, &t).into_boxed_str()),
            }))
        })
    }

    /// Compiles its kernel, allocates `2 · l2` bytes and runs two passes (the zeroing left dirty lines).
    pub fn new(gpu: &Gpu, l2: usize) -> Result<L2Flush, Error> {
        let v = L2Flush::variant();
        let kernel = gpu.load(&[v])?.remove(v.name).ok_or_else(|| Error::Driver {
            call: format!("load {}", v.name),
            detail: "kernel missing after load".into(),
        })?;
        let s = gpu.stream();
        let rows = (2 * l2).div_ceil(2 * L2Flush::K);
        let mut f = L2Flush { kernel, w: alloc::<u8>(s, rows * 2 * L2Flush::K)?, x: alloc::<f32>(s, L2Flush::K)?, y: alloc::<f32>(s, rows)?, rows };
        f.run()?;
        f.run()?;
        gpu.sync()?;
        Ok(f)
    }

    /// One read pass over the whole buffer.
    pub fn run(&mut self) -> Result<(), Error> {
        let (k, n) = (L2Flush::K, self.rows);
        matvec::matvec_with(&self.kernel, &self.w.slice(..), &self.x.slice(..), &mut self.y.slice_mut(..), k, n, 1, k, n, matvec::GridPolicy::Resident)
    }

    /// Bytes one pass reads.
    pub fn bytes(&self) -> usize {
        self.rows * 2 * L2Flush::K
    }

    /// The bf16 matvec kernel (generic, default tuning) the pass launches.
    pub fn kernel(&self) -> &Kernel {
        &self.kernel
    }
}

/// Per-launch times: `warmup` untimed launches, then `iters` launches each between two events,
/// each preceded by a memset of `flush` (outside the events; L2 left dirty, see [`L2Flush`]; the
/// criterion benches use this). Returns microseconds, sorted.
pub fn time_launches(
    gpu: &Gpu,
    warmup: u32,
    iters: u32,
    flush: &mut CudaSlice<u8>,
    f: &mut dyn FnMut(usize) -> Result<(), Error>,
) -> Result<Vec<f64>, Error> {
    let s = gpu.stream();
    for i in 0..warmup as usize {
        f(i)?;
    }
    let mut events = Vec::with_capacity(iters as usize);
    for i in 0..iters as usize {
        s.memset_zeros(flush).map_err(drv("cuMemsetD8Async (L2 flush)"))?;
        let start = record(s)?;
        f(warmup as usize + i)?;
        events.push((start, record(s)?));
    }
    let mut us = Vec::with_capacity(events.len());
    for (start, end) in &events {
        us.push(start.elapsed_ms(end).map_err(drv("cuEventElapsedTime (a launch failed?)"))? as f64 * 1e3);
    }
    us.sort_by(f64::total_cmp);
    Ok(us)
}

/// The kernels of round `i` of [`time_interleaved`] in launch order: each once, the first
/// rotating with `i` (specialized first in even rounds, generic first in odd ones).
pub fn round_order(i: usize, n: usize) -> impl Iterator<Item = usize> {
    (0..n).map(move |r| (i + r) % n)
}

/// Per-launch times of `n` kernels on the same buffers, interleaved: `warmup` untimed rounds,
/// then `iters` rounds; in round `i` every kernel `j` runs once (`f(j, i)`, the same buffer set
/// for all), in an order that rotates with `i`, each launch after its own clean L2 flush
/// ([`L2Flush`]) and between its own two events. Returns microseconds per kernel, sorted.
pub fn time_interleaved(
    gpu: &Gpu,
    warmup: u32,
    iters: u32,
    flush: &mut L2Flush,
    n: usize,
    f: &mut dyn FnMut(usize, usize) -> Result<(), Error>,
) -> Result<Vec<Vec<f64>>, Error> {
    let s = gpu.stream();
    for i in 0..warmup as usize {
        for j in 0..n {
            f(j, i)?;
        }
    }
    let mut events: Vec<Vec<(CudaEvent, CudaEvent)>> = (0..n).map(|_| Vec::with_capacity(iters as usize)).collect();
    for i in 0..iters as usize {
        for j in round_order(i, n) {
            flush.run()?;
            let start = record(s)?;
            f(j, warmup as usize + i)?;
            events[j].push((start, record(s)?));
        }
    }
    let mut out = Vec::with_capacity(n);
    for ev in &events {
        let mut us = Vec::with_capacity(ev.len());
        for (start, end) in ev {
            us.push(start.elapsed_ms(end).map_err(drv("cuEventElapsedTime (a launch failed?)"))? as f64 * 1e3);
        }
        us.sort_by(f64::total_cmp);
        out.push(us);
    }
    Ok(out)
}

/// Per-launch times of `n` kernels launched back to back, as a decode step runs its kernels:
/// kernel `j`'s [`STREAM_LAUNCHES`] launches on consecutive buffer sets (`f(j, c)`, `c` counting
/// up, so the rotation keeps each launch's inputs out of L2 as in [`time_interleaved`]) are
/// captured once as a CUDA graph with programmatic dependent launch (cuda::graph, as
/// models::gpu::StepGraph runs a decode step); the graphs are then timed by
/// [`time_interleaved`] (one untimed replay each first, which uploads the graph), each replay
/// after its clean L2 flush. One launch's start overlaps the previous one's tail here, which a
/// per-launch event pair cannot show. Returns µs per launch per kernel, sorted.
pub fn time_streamed(
    gpu: &Gpu,
    iters: u32,
    flush: &mut L2Flush,
    n: usize,
    f: &mut dyn FnMut(usize, usize) -> Result<(), Error>,
) -> Result<Vec<Vec<f64>>, Error> {
    let mut graphs = Vec::with_capacity(n);
    for j in 0..n {
        graphs.push(Graph::capture(gpu.stream(), true, || (0..STREAM_LAUNCHES).try_for_each(|c| f(j, c)))?);
    }
    let per_replay = time_interleaved(gpu, 1, iters, flush, n, &mut |j, _| graphs[j].launch())?;
    Ok(per_replay.into_iter().map(|us| us.into_iter().map(|t| t / STREAM_LAUNCHES as f64).collect()).collect())
}

/// Launches per timed batch of [`time_streamed`].
pub const STREAM_LAUNCHES: usize = 8;

fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 { sorted[n / 2] } else { 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]) }
}

/// Copy bandwidth in GB/s (bytes read + written), median of `iters` 1 GiB device-to-device copies.
pub fn copy_bandwidth(gpu: &Gpu, warmup: u32, iters: u32) -> Result<f64, Error> {
    let s = gpu.stream();
    let n = COPY_BYTES / 4;
    let filler = Filler::new(s, Rng::new(7))?;
    let src = filler.f32s(n)?;
    let mut dst = alloc::<f32>(s, n)?;
    let mut times = Vec::new();
    for i in 0..(warmup + iters) {
        let start = record(s)?;
        s.memcpy_dtod(&src, &mut dst).map_err(drv("cuMemcpyDtoDAsync (copy bandwidth)"))?;
        let end = record(s)?;
        if i >= warmup {
            times.push((start, end));
        }
    }
    let mut ms: Vec<f64> =
        times.iter().map(|(a, b)| a.elapsed_ms(b).map(|v| v as f64)).collect::<Result<_, _>>().map_err(drv("cuEventElapsedTime"))?;
    ms.sort_by(f64::total_cmp);
    Ok(2.0 * COPY_BYTES as f64 / (median(&ms) * 1e-3) / 1e9)
}

// ---------------------------------------------------------------------------------------------
// The command.

/// One measured (variant, shape) row; serialized as described in benches/results/SCHEMA.md.
#[derive(Clone, Debug)]
pub struct Row {
    pub family: &'static str,
    pub variant: &'static str,
    pub kind: Kind,
    pub arch: &'static str,
    pub origin: &'static str,
    pub shape: String,
    pub dtype: String,
    pub median_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    pub reps: usize,
    pub buffer_sets: usize,
    pub bytes: u64,
    pub flops: Option<u64>,
    pub speedup_vs_generic: Option<f64>,
    /// Per-launch time in back-to-back batches ([`time_streamed`]), µs.
    pub stream_us: Option<f64>,
}

impl Row {
    fn gbps(&self) -> f64 {
        self.bytes as f64 / (self.median_us * 1e-6) / 1e9
    }
    /// `bytes / stream_us` as % of the copy bandwidth.
    fn stream_pct_copy(&self, copy_gbps: f64) -> Option<f64> {
        self.stream_us.map(|us| 100.0 * self.bytes as f64 / (us * 1e-6) / 1e9 / copy_gbps)
    }
    fn tflops(&self) -> Option<f64> {
        self.flops.map(|f| f as f64 / (self.median_us * 1e-6) / 1e12)
    }
    fn to_json(&self, copy_gbps: f64) -> Value {
        json!({
            "family": self.family, "variant": self.variant, "kind": self.kind.label(), "arch": self.arch,
            "origin": self.origin, "shape": self.shape, "dtype": self.dtype,
            "median_us": self.median_us, "min_us": self.min_us, "max_us": self.max_us, "reps": self.reps,
            "buffer_sets": self.buffer_sets, "bytes": self.bytes, "gbps": self.gbps(),
            "pct_copy": 100.0 * self.gbps() / copy_gbps, "flops": self.flops, "tflops": self.tflops(),
            "speedup_vs_generic": self.speedup_vs_generic,
            "stream_us": self.stream_us,
            "stream_pct_copy": self.stream_pct_copy(copy_gbps),
        })
    }
}

/// Where the commit id comes from, first found: `--commit`, `$MEMRA_COMMIT` now, `MEMRA_COMMIT`
/// at build time, `git rev-parse HEAD` in the current directory.
fn commit(args: &BenchArgs) -> String {
    if let Some(c) = &args.commit {
        return c.clone();
    }
    if let Some(c) = std::env::var("MEMRA_COMMIT").ok().filter(|c| !c.is_empty()) {
        return c;
    }
    if let Some(c) = option_env!("MEMRA_COMMIT").filter(|c| !c.is_empty()) {
        return c.to_string();
    }
    std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// `YYYY-MM-DDTHH:MM:SSZ` from the system clock (UTC; civil-from-days, no date crate).
fn utc_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem / 60 % 60, rem % 60)
}

fn driver_version() -> Option<String> {
    let mut v: std::ffi::c_int = 0;
    // SAFETY: libcuda is loaded (Gpu::new succeeded before this is called); the call writes one int.
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    (r == cudarc::driver::sys::CUresult::CUDA_SUCCESS).then(|| format!("CUDA {}.{}", v / 1000, v % 1000 / 10))
}

fn list(cases: &[Case]) {
    println!("{:<17} {:<8} {:<33} {:<6} {:<54} generic", "family", "arch", "shape", "dtype", "specialized");
    for c in cases {
        let spec = c.specialized.map(|v| format!("{}{}", v.name, if c.rendered { " (rendered)" } else { "" })).unwrap_or_else(|| "-".into());
        println!(
            "{:<17} {:<8} {:<33} {:<6} {:<54} {}",
            c.shape.family(),
            c.arch,
            c.shape.label(),
            c.shape.dtype(),
            spec,
            c.generic.map(|v| v.name).unwrap_or("- (none in registry)")
        );
    }
}

/// Geometric mean of specialized/generic per architecture (rows with both measured).
pub fn geomeans(rows: &[Row]) -> Vec<(&'static str, f64, usize)> {
    let mut by_arch: Vec<(&'static str, f64, usize)> = Vec::new();
    for r in rows.iter().filter(|r| r.kind == Kind::Specialized) {
        let Some(x) = r.speedup_vs_generic else {
            continue;
        };
        match by_arch.iter_mut().find(|(a, ..)| *a == r.arch) {
            Some((_, sum, n)) => {
                *sum += x.ln();
                *n += 1;
            }
            None => by_arch.push((r.arch, x.ln(), 1)),
        }
    }
    by_arch.into_iter().map(|(a, sum, n)| (a, (sum / n as f64).exp(), n)).collect()
}

pub fn run(args: &BenchArgs) -> Result<(), Box<dyn std::error::Error>> {
    if let Some(family) = &args.sweep {
        return sweep::run(args, family);
    }
    if let Some(model) = &args.model {
        return run_model(args, model);
    }
    if let Some(preset) = &args.synthetic {
        return run_synthetic(args, preset);
    }
    if let Some(run) = &args.report {
        return report::run_report(args, run);
    }
    let cases = plan(args.arch.as_deref(), args.family.as_deref());
    if args.list && !cases.is_empty() {
        list(&cases);
        return Ok(());
    }
    if cases.is_empty() {
        let built: Vec<&str> = registry::SPECIALIZED_FOR.iter().map(|(a, _)| *a).collect();
        return Err(format!(
            "no specialized variants to measure (built for: {}; --arch {}, --family {}); build with --features model-<arch>",
            if built.is_empty() { "none".to_string() } else { built.join(", ") },
            args.arch.as_deref().unwrap_or("any"),
            args.family.as_deref().unwrap_or("any")
        )
        .into());
    }
    let gpu = Gpu::new(args.device).map_err(|e| format!("memra bench needs a CUDA GPU: {e}"))?;
    let driver = driver_version().unwrap_or_else(|| "unknown".into());
    let l2 = l2_bytes(&gpu);
    eprintln!("memra bench: {} ({}), {driver}, L2 {} MiB, {} cases", gpu.name(), gpu.arch(), l2 >> 20, cases.len());

    let mut all: Vec<&'static KernelVariant> = cases.iter().flat_map(|c| c.variants().map(|(v, _)| v)).collect();
    all.sort_by_key(|v| v.name);
    all.dedup_by_key(|v| v.name);
    let kernels: Kernels = gpu.load(&all)?;

    let copy_gbps = copy_bandwidth(&gpu, 3, args.iters)?;
    eprintln!("copy bandwidth (1 GiB device-to-device, read + write): {copy_gbps:.0} GB/s");

    let mut flush = L2Flush::new(&gpu, l2)?;
    let mut rng = Rng::from_env_or_time("memra bench");
    let mut rows: Vec<Row> = Vec::new();
    // A case that fails (a refused shape, a launch error) is reported and the run goes on: the
    // others are still measured and written; the command fails at the end.
    let mut failed: Vec<String> = Vec::new();
    for case in &cases {
        match measure_case(&gpu, &kernels, case, args, l2, &mut flush, Rng::new(rng.next_u64())) {
            Ok(measured) => {
                for r in &measured {
                    eprintln!("  {:<54} {:<33} {:>10.2} us", r.variant, r.shape, r.median_us);
                }
                rows.extend(measured);
            }
            Err(e) => {
                eprintln!("  FAILED {} {}: {e}", case.shape.family(), case.shape.label());
                failed.push(format!("{} {} ({}): {e}", case.shape.family(), case.shape.label(), case.arch));
            }
        }
    }
    drop(flush);

    print!("{}", table(&rows, copy_gbps));
    let means = geomeans(&rows);
    for (arch, g, n) in &means {
        println!("geomean specialized/generic speedup, {arch}: {g:.3}x over {n} shapes");
    }

    if args.json.is_some() || args.svg.is_some() || args.peers.is_some() {
        let doc = json!({
            "schema": 1,
            "device": gpu.name(),
            "sm": gpu.arch().to_string(),
            "driver": driver,
            "date": utc_now(),
            "commit": commit(args),
            "memra_version": env!("CARGO_PKG_VERSION"),
            "iters": args.iters,
            "warmup": args.warmup,
            "l2_bytes": l2,
            "copy_bytes": 2 * COPY_BYTES,
            "copy_gbps": copy_gbps,
            "geomean_speedup": means.iter().map(|(a, g, n)| json!({"arch": a, "speedup": g, "shapes": n})).collect::<Vec<_>>(),
            "results": rows.iter().map(|r| r.to_json(copy_gbps)).collect::<Vec<_>>(),
        });
        report::emit(args, doc)?;
    }
    if !failed.is_empty() {
        println!("{} of {} cases FAILED:", failed.len(), cases.len());
        for f in &failed {
            println!("  {f}");
        }
        return Err(format!("{} of {} cases failed (the others are in the table and the JSON)", failed.len(), cases.len()).into());
    }
    Ok(())
}

/// Both variants of one case on the same buffers, interleaved (module doc).
fn measure_case(
    gpu: &Gpu,
    kernels: &Kernels,
    case: &Case,
    args: &BenchArgs,
    l2: usize,
    flush: &mut L2Flush,
    rng: Rng,
) -> Result<Vec<Row>, Error> {
    let mut prepared = Prepared::new(gpu, case.shape, sets_for(&case.shape, l2), rng)?;
    let variants: Vec<(&'static KernelVariant, Kind)> = case.variants().collect();
    let launched: Vec<&Kernel> = variants.iter().map(|(v, _)| kernels.get(v.name)).collect::<Result<_, _>>()?;
    let times = time_interleaved(gpu, args.warmup, args.iters, flush, launched.len(), &mut |j, i| prepared.launch(launched[j], i))?;
    // A case whose launches cannot be captured (none known) keeps its per-launch figures.
    let streamed = match time_streamed(gpu, args.iters, flush, launched.len(), &mut |j, c| prepared.launch(launched[j], c)) {
        Ok(t) => t.into_iter().map(|us| Some(median(&us))).collect(),
        Err(e) => {
            eprintln!("  {} {}: no back-to-back figure ({e})", case.shape.family(), case.shape.label());
            vec![None; launched.len()]
        }
    };
    let mut measured: Vec<Row> = Vec::new();
    for (((v, kind), us), stream) in variants.into_iter().zip(times).zip(streamed) {
        measured.push(Row {
            family: case.shape.family(),
            variant: v.name,
            kind,
            arch: case.arch,
            origin: if kind == Kind::Specialized && case.rendered { "rendered" } else { "registry" },
            shape: case.shape.label(),
            dtype: case.shape.dtype(),
            median_us: median(&us),
            min_us: us[0],
            max_us: us[us.len() - 1],
            reps: us.len(),
            buffer_sets: prepared.sets(),
            bytes: case.shape.bytes(),
            flops: case.shape.flops(),
            speedup_vs_generic: None,
            stream_us: stream,
        });
    }
    let generic_us = measured.iter().find(|r| r.kind == Kind::Generic).map(|r| r.median_us);
    for r in measured.iter_mut().filter(|r| r.kind == Kind::Specialized) {
        r.speedup_vs_generic = generic_us.map(|g| g / r.median_us);
    }
    Ok(measured)
}

/// `--model`: copy bandwidth, then the model end to end (crate::bench_model).
fn run_model(args: &BenchArgs, model: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    if args.prompt_tokens == 0 || args.decode_tokens == 0 {
        return Err("--prompt-tokens and --decode-tokens must be at least 1".into());
    }
    let run = RunHeader::measure(args)?;
    let models = crate::bench_model::run(model, args.device, run.copy_gbps, args.prompt_tokens, args.decode_tokens)?;
    if args.breakdown {
        crate::bench_model::breakdown(model, args.device, args.prompt_tokens, args.decode_tokens)?;
    }
    run.write(args, "models", json!(models))
}

/// The device and the copy bandwidth of a whole-model run (`--model`, `--synthetic`), measured
/// before the model is loaded (the GPU handle is released).
struct RunHeader {
    name: String,
    sm: String,
    driver: String,
    copy_gbps: f64,
}

impl RunHeader {
    fn measure(args: &BenchArgs) -> Result<RunHeader, Box<dyn std::error::Error>> {
        let gpu = Gpu::new(args.device).map_err(|e| format!("memra bench needs a CUDA GPU: {e}"))?;
        let driver = driver_version().unwrap_or_else(|| "unknown".into());
        let copy_gbps = copy_bandwidth(&gpu, 3, args.iters)?;
        eprintln!("memra bench: {} ({}), {driver}; copy bandwidth {copy_gbps:.0} GB/s", gpu.name(), gpu.arch());
        Ok(RunHeader { name: gpu.name().to_string(), sm: gpu.arch().to_string(), driver, copy_gbps })
    }

    /// Writes `--json` (if given): the top-level keys (SCHEMA.md) and `key: value`.
    fn write(&self, args: &BenchArgs, key: &str, value: Value) -> Result<(), Box<dyn std::error::Error>> {
        let Some(path) = &args.json else { return Ok(()) };
        let mut doc = json!({
            "schema": 1,
            "device": self.name,
            "sm": self.sm,
            "driver": self.driver,
            "date": utc_now(),
            "commit": commit(args),
            "memra_version": env!("CARGO_PKG_VERSION"),
            "copy_bytes": 2 * COPY_BYTES,
            "copy_gbps": self.copy_gbps,
        });
        doc[key] = value;
        let text = serde_json::to_string_pretty(&doc)?;
        std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
        eprintln!("wrote {}", path.display());
        Ok(())
    }
}

/// `--synthetic PRESET`: the N-layer model, then the (N−1)-layer one for the last layer's time.
fn run_synthetic(args: &BenchArgs, preset: &str) -> Result<(), Box<dyn std::error::Error>> {
    use crate::bench_synthetic as bs;
    let layers = args.layers as usize;
    let desc = crate::synthetic::describe(preset, layers)?;
    if args.list {
        print!("{}", bs::plan_table(&desc, args.ctx));
        return Ok(());
    }
    if args.decode_tokens == 0 {
        return Err("--decode-tokens must be at least 1".into());
    }
    if args.gpus > 1 {
        // Heads, experts and split tensors must divide by --gpus: refused before any GPU work.
        let file = desc.open()?;
        crate::parallel::shard::check_split(std::path::Path::new(preset), &file, args.gpus as usize)?;
    }
    let run = RunHeader::measure(args)?;
    let copy_gbps = run.copy_gbps;
    let seed = Rng::from_env_or_time("memra bench --synthetic").seed();
    let policy = match args.require_specialized {
        true => crate::kernels::registry::Policy::RequireSpecialized,
        false => crate::kernels::registry::Policy::Best,
    };
    eprintln!(
        "memra bench: synthetic {preset}, {layers} layers ({:.1} GB of weights), ctx {}",
        desc.total_bytes() as f64 / 1e9,
        args.ctx
    );
    if args.gpus > 1 {
        let (gpus, steps, prompt) = (args.gpus as usize, args.decode_tokens, args.prompt_tokens);
        let (table, runs) = bs::compare_gpus(&desc, gpus, args.ctx, steps, prompt, seed, policy)?;
        print!("{table}");
        let v = bs::gpus_to_json(&desc, args.ctx, steps, prompt, seed, copy_gbps, &runs)?;
        return run.write(args, "synthetic_gpus", v);
    }
    let full = bs::measure_with(&desc, args.device, args.ctx, args.decode_tokens, seed, policy)?;
    let fewer = if layers > 1 {
        let d = crate::synthetic::describe(preset, layers - 1)?;
        Some(bs::measure_with(&d, args.device, args.ctx, args.decode_tokens, seed, policy)?)
    } else {
        None
    };
    let prefill = match args.prompt_tokens {
        0 => None,
        n => Some(bs::prefill_gpus(&desc, 1, args.device, n, seed, policy)?),
    };
    let v = bs::to_json(&desc, args.ctx, args.decode_tokens, seed, copy_gbps, full, fewer, (args.prompt_tokens, prefill));
    let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    println!(
        "\nsynthetic {preset}: {layers} layers, ctx {}: decode step {:.1} us (min {:.1}), reads {:.1} MB, floor {:.1} us, {:.2}x the floor; {:.1} us per layer",
        args.ctx,
        f("step_median_us"),
        f("step_min_us"),
        f("step_bytes") / 1e6,
        f("step_floor_us"),
        f("step_ratio_to_floor"),
        f("per_layer_us")
    );
    if let Some(l) = v["last_layer"].as_object() {
        let g = |k: &str| l[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "last layer ({}, {} FFN): {:.1} us, reads {:.1} MB, floor {:.1} us, {:.2}x the floor",
            l["layer"],
            v["layer_bytes"][layers - 1]["ffn"].as_str().unwrap_or("?"),
            g("us"),
            g("bytes") / 1e6,
            g("floor_us"),
            g("ratio_to_floor")
        );
    }
    if let Some(tok_s) = prefill {
        println!(
            "prefill of {} tokens from position 0: {tok_s:.0} tok/s (median of 3)",
            args.prompt_tokens
        );
    }
    if v["logits_finite"] != true {
        return Err("synthetic model: non-finite logits".into());
    }
    run.write(args, "synthetic", v)
}

/// The printed table: one line per (variant, shape).
pub fn table(rows: &[Row], copy_gbps: f64) -> String {
    let mut t = String::new();
    let _ = writeln!(t, "copy bandwidth: {copy_gbps:.0} GB/s");
    let _ = writeln!(
        t,
        "{:<17} {:<54} {:<11} {:<33} {:<7} {:>10} {:>8} {:>7} {:>8} {:>9} {:>10} {:>7}",
        "family", "variant", "kind", "shape", "dtype", "median_us", "GB/s", "%copy", "TFLOP/s", "spec/gen", "stream_us", "%copy"
    );
    for r in rows {
        let _ = writeln!(
            t,
            "{:<17} {:<54} {:<11} {:<33} {:<7} {:>10.2} {:>8.0} {:>6.1}% {:>8} {:>9} {:>10} {:>7}",
            r.family,
            r.variant,
            r.kind.label(),
            r.shape,
            r.dtype,
            r.median_us,
            r.gbps(),
            100.0 * r.gbps() / copy_gbps,
            r.tflops().map(|x| format!("{x:.1}")).unwrap_or_else(|| "-".into()),
            r.speedup_vs_generic.map(|x| format!("{x:.2}x")).unwrap_or_else(|| "-".into()),
            r.stream_us.map(|x| format!("{x:.2}")).unwrap_or_else(|| "-".into()),
            r.stream_pct_copy(copy_gbps).map(|x| format!("{x:.1}%")).unwrap_or_else(|| "-".into()),
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_count_each_input_and_output_once() {
        // Q8_0 row of 6144 = 192 blocks × 34 B.
        let mv = Shape::Matvec { ty: GgmlType::Q8_0, k: 6144, n: 2048 };
        assert_eq!(mv.bytes(), 192 * 34 * 2048 + 4 * (6144 + 2048));
        assert_eq!(mv.flops(), Some(2 * 6144 * 2048));
        assert_eq!(Shape::Rmsnorm { rows: 4096, n: 6144 }.bytes(), 4 * (2 * 4096 * 6144 + 6144));
        // Gemma 3 decode: q (4 heads) and k (1) in and out, v in, one K and one V row of 256 bf16 out, pos.
        assert_eq!(Shape::QkNormRope { t: 1, n_head: 4, n_kv: 1, head_dim: 256, n_rot: 256 }.bytes(), 4 * (2 * 5 * 256 + 256 + 1) + 2 * 2 * 256);
        assert_eq!(Shape::AddRmsnorm { rows: 2, n: 8, delta_norm: false }.bytes(), 4 * (4 * 16 + 8));
        let mm = Shape::Matmul { ty: GgmlType::BF16, t: 4096, k: 6144, n: 6144 };
        assert_eq!(mm.bytes(), 2 * 6144 * 6144 + 4 * 2 * 4096 * 6144);
        assert_eq!(mm.flops(), Some(2 * 4096 * 6144 * 6144));
    }

    #[test]
    fn rotation_covers_twice_l2_and_is_capped() {
        let l2 = 60 << 20;
        assert_eq!(sets_for(&Shape::Rmsnorm { rows: 4096, n: 6144 }, l2), 1);
        // 48 MiB per set: three sets exceed 120 MiB.
        assert_eq!(sets_for(&Shape::Rmsnorm { rows: 1024, n: 6144 }, l2), 3);
        assert_eq!(sets_for(&Shape::Rmsnorm { rows: 1, n: 6144 }, l2), MAX_SETS);
        assert_eq!(sets_for(&Shape::Matvec { ty: GgmlType::BF16, k: 6144, n: 154880 }, l2), 1);
    }

    #[test]
    fn utc_date_is_well_formed() {
        let d = utc_now();
        assert_eq!(d.len(), 20, "{d}");
        assert!(d.starts_with("20") && d.ends_with('Z'), "{d}");
    }

    #[test]
    fn every_planned_case_has_a_generic_twin_of_its_dtype() {
        for c in plan(None, None) {
            let g = c.generic.unwrap_or_else(|| panic!("{:?} has no generic twin", c.shape));
            assert!(g.is_generic());
            assert_eq!(g.family, c.shape.family());
            if let Some(Param::Sym(q)) = g.param("qtype") {
                assert_eq!(q, c.shape.dtype(), "{:?}: {}", c.shape, g.name);
            }
            let s = c.specialized.expect("planned from a specialized variant");
            assert!(!s.is_generic(), "{}", s.name);
        }
    }

    #[test]
    fn moe_and_sparse_bytes_count_only_what_is_read() {
        use moe_matvec::Mode;
        let row = |k: u64| GgmlType::Q4_K.row_bytes(k).unwrap();
        // GLM-5 routed experts, one token: 8 of 256 experts, gate and up of 2048 rows each.
        let gate_up = Shape::MoeMatvec { ty: GgmlType::Q4_K, mode: Mode::Swiglu, t: 1, k: 6144, n: 2048, n_expert: 256, n_used: 8 };
        assert_eq!(row(6144), 3456);
        assert_eq!(gate_up.bytes(), 8 * 2 * 2048 * 3456 + 4 * (6144 + 8 * 2048 + 8));
        assert_eq!(gate_up.flops(), Some(2 * 2 * 6144 * 2048 * 8));
        let down = Shape::MoeMatvec { ty: GgmlType::Q4_K, mode: Mode::Down, t: 1, k: 2048, n: 6144, n_expert: 256, n_used: 8 };
        assert_eq!(down.bytes(), 8 * 6144 * row(2048) + 4 * (8 * 2048 + 6144 + 8 + 8));
        // The expert count changes nothing: unselected experts are not read.
        let down64 = Shape::MoeMatvec { ty: GgmlType::Q4_K, mode: Mode::Down, t: 1, k: 2048, n: 6144, n_expert: 64, n_used: 8 };
        assert_eq!(down64.bytes(), down.bytes());
        // DSA sparse MLA: the 2048 selected latent rows, whatever the context.
        let sparse = Shape::MlaSparseDecode { n_head: 64, kv_lora: 512, rope: 64, ctx: 131_072, k: 2048 };
        assert_eq!(sparse.bytes(), 2 * 2048 * 576 + 4 * (64 * (1024 + 64) + 2048 + 1));
        assert_eq!(Shape::MlaSparseDecode { n_head: 64, kv_lora: 512, rope: 64, ctx: 32_768, k: 2048 }.bytes(), sparse.bytes());
        assert_eq!(sparse.flops(), Some(2 * 64 * 2048 * (1024 + 64)));
        // Dense MLA reads every row.
        let dense = Shape::MlaDecode { n_head: 64, kv_lora: 512, rope: 64, ctx: 131_072 };
        assert_eq!(dense.bytes(), 2 * 131_072 * 576 + 4 * (64 * (1024 + 64) + 1));
        let gqa = Shape::AttnDecode { n_head: 32, n_kv: 8, head_dim: 128, ctx: 4096 };
        assert_eq!(gqa.bytes(), 2 * 2 * 4096 * 8 * 128 + 4 * (2 * 32 * 128 + 1));
        assert_eq!(gqa.flops(), Some(4 * 32 * 128 * 4096));
        assert_eq!(Shape::DsaIndexer { n_head: 32, head_dim: 128, ctx: 131_072 }.bytes(), (32 << 20) + 4 * (32 * 128 + 32 + 1 + 131_072));
        assert_eq!(Shape::DsaTopk { ctx: 131_072, k: 2048 }.bytes(), 4 * (131_072 + 2 + 2048));
    }

    #[test]
    fn labels_match_the_peer_files() {
        // benches/peers-attention.json names these shapes; the report joins on the label.
        let peers = include_str!("../../benches/peers-attention.json");
        for shape in [
            Shape::AttnDecode { n_head: 32, n_kv: 8, head_dim: 128, ctx: 4096 },
            Shape::AttnDecode { n_head: 4, n_kv: 1, head_dim: 256, ctx: 32_768 },
        ] {
            assert!(peers.contains(&format!("\"{}\"", shape.label())), "{}", shape.label());
        }
        let mla = Shape::MlaDecode { n_head: 64, kv_lora: 512, rope: 64, ctx: 32_768 };
        assert_eq!(mla.label(), "h64_kv1_d576_dv512_c32768");
        assert!(peers.contains("\"mla_decode\"") && peers.contains(&format!("\"{}\"", mla.label())));
        assert_eq!(mla.dtype(), "bf16");
    }

    #[test]
    fn rounds_alternate_which_variant_goes_first() {
        for i in 0..6 {
            let order: Vec<usize> = round_order(i, 2).collect();
            assert_eq!(order, if i % 2 == 0 { vec![0, 1] } else { vec![1, 0] });
        }
        let mut three: Vec<usize> = round_order(4, 3).collect();
        assert_eq!(three[0], 1);
        three.sort();
        assert_eq!(three, [0, 1, 2]);
    }

    /// With `--features model-glm-dsa`: the GLM-5 attention, DSA and MoE cases at the preset's
    /// shapes, each with a generic twin of its family.
    #[test]
    fn glm5_plan_covers_attention_dsa_and_moe() {
        if !registry::SPECIALIZED_FOR.iter().any(|(a, _)| *a == "glm-dsa") {
            eprintln!("built without model-glm-dsa: nothing to check");
            return;
        }
        let cases = plan(Some("glm-dsa"), None);
        let mut want = vec![
            ("mla_sparse_decode", "h64_kv1_d576_dv512_k2048_c131072"),
            ("dsa_indexer", "q1_h32_d128_c131072"),
            ("dsa_topk", "q1_c131072_k2048"),
            ("dsa_index_key", "t1_d128_r64"),
            ("dsa_index_key", "t4096_d128_r64"),
            ("moe_router", "t1_e256_k8_sigmoid"),
            ("moe_router", "t4096_e256_k8_sigmoid"),
            ("moe_matvec", "t1_k6144_n2048_e256_u8_swiglu"),
            ("moe_matvec", "t1_k2048_n6144_e256_u8_down"),
            // matmul takes N at run time: one variant per (K, type) times each shape it serves.
            ("matmul", "t4096_k16384_n6144"),
            ("matmul", "t4096_k6144_n2048"),
            ("matmul", "t4096_k2048_n16384"),
        ];
        // The dense FFN / shared expert (Q8_0, no down partner) run as one expert, not routed.
        for c in cases.iter().filter(|c| c.shape.family() == "moe_matvec" && c.shape.dtype() == "q8_0") {
            let Shape::MoeMatvec { mode, n_expert, n_used, .. } = c.shape else { unreachable!() };
            if mode != moe_matvec::Mode::Plain {
                assert_eq!((n_expert, n_used), (1, 1), "{}", c.shape.label());
            }
        }
        if registry::variants().iter().any(|v| v.is_for("glm-dsa") && v.family == "mla_decode") {
            want.push(("mla_decode", "h64_kv1_d576_dv512_c32768"));
            want.push(("mla_decode", "h64_kv1_d576_dv512_c131072"));
        }
        let k6144 = cases.iter().filter(|c| c.specialized.is_some_and(|s| s.name == "matmul__k6144__q8_0")).count();
        assert!(k6144 >= 4, "matmul__k6144__q8_0 timed at {k6144} shapes");
        for (family, label) in want {
            let c = cases
                .iter()
                .find(|c| c.shape.family() == family && c.shape.label() == label)
                .unwrap_or_else(|| panic!("glm-dsa plan lacks {family} {label}"));
            let (s, g) = (c.specialized.unwrap(), c.generic.unwrap_or_else(|| panic!("{family} {label}: no generic twin")));
            assert!(!s.is_generic() && g.is_generic() && g.family == family, "{} / {}", s.name, g.name);
            for key in ["qtype", "mode", "gating", "cache_t", "rope_mode"] {
                assert!(g.param(key).is_none() || g.param(key) == s.param(key), "{}: {key} differs from {}", g.name, s.name);
            }
        }
    }

    #[test]
    fn gemma3_plan_times_the_fused_decode_projections() {
        if !registry::SPECIALIZED_FOR.iter().any(|(a, _)| *a == "gemma3") {
            eprintln!("built without model-gemma3: nothing to check");
            return;
        }
        let cases = plan(Some("gemma3"), Some(norm_matvec::FAMILY));
        // q/k/v stacked into one launch per layer: Q5_0, and Q8_0 where v is (the spec's `widen`).
        let qkv: Vec<GgmlType> = cases
            .iter()
            .filter_map(|c| match c.shape {
                Shape::NormMatvec { ty, k: 640, n: 1536, .. } => Some(ty),
                _ => None,
            })
            .collect();
        assert!(qkv.contains(&GgmlType::Q5_0) && qkv.contains(&GgmlType::Q8_0), "{qkv:?}");
        for label in ["k640_n1536_none", "k640_n2048_geglu", "k640_n262144_none"] {
            let c = cases.iter().find(|c| c.shape.label() == label).unwrap_or_else(|| panic!("gemma3 plan lacks norm_matvec {label}"));
            let g = c.generic.unwrap_or_else(|| panic!("{label}: no generic twin"));
            assert_eq!(g.param("glu"), c.specialized.unwrap().param("glu"), "{label}");
        }
        let geglu = Shape::NormMatvec { ty: GgmlType::Q5_0, glu: norm_matvec::Glu::Geglu, k: 640, n: 2048 };
        // Q5_0 rows of 640 = 20 blocks × 22 B; gate and up.
        assert_eq!(geglu.bytes(), 2 * 20 * 22 * 2048 + 4 * (5 * 640 + 2048));
        assert_eq!(geglu.flops(), Some(2 * 2 * 640 * 2048));
    }

    #[test]
    fn a_matvec_rendered_in_another_type_keeps_the_tuning_it_can_run() {
        static BASE: KernelVariant = KernelVariant {
            name: "matvec__k4096_n4096__q8_0_rows_per_group1_xq82",
            family: "matvec",
            arch: Some("test"),
            params: &[("k", Param::Int(4096)), ("n", Param::Int(4096)), ("qtype", Param::Sym("q8_0")), ("rows_per_group", Param::Int(1)), ("xq8", Param::Int(2))],
            source: "",
        };
        // The tuning spelling of XQ8 = 2.
        static FUSED: KernelVariant = KernelVariant {
            name: "matvec__k4096_n4096__q8_0_fuse_x1",
            family: "matvec",
            arch: Some("test"),
            params: &[("k", Param::Int(4096)), ("n", Param::Int(4096)), ("qtype", Param::Sym("q8_0")), ("xq8", Param::Int(0)), ("fuse_x", Param::Int(1))],
            source: "",
        };
        // (base, type, rendered name, the base's integer-path key and the value it keeps, the source's XQ8)
        let cases = [
            (&BASE, GgmlType::Q4_K, "matvec__k4096_n4096__q4_k_rows_per_group1_xq82", "xq8", 2, 2),
            (&BASE, GgmlType::BF16, "matvec__k4096_n4096__bf16_rows_per_group1", "xq8", 0, 0),
            (&FUSED, GgmlType::Q4_K, "matvec__k4096_n4096__q4_k_fuse_x1", "fuse_x", 1, 2),
            (&FUSED, GgmlType::BF16, "matvec__k4096_n4096__bf16", "fuse_x", 0, 0),
        ];
        for (base, ty, name, key, kept, xq8_src) in cases {
            let (v, generic) = matvec_in_type(base, ty, 4096, 4096);
            let g = generic.unwrap_or_else(|| panic!("{name}: rendered without its generic twin"));
            assert_eq!(g.name, name.replace("k4096_n4096", "generic"));
            assert!(g.source.contains("K = 0;") && g.source.contains(&format!("XQ8 = {xq8_src};")), "{}", g.source);
            assert_eq!((v.name, v.param(key), v.param("rows_per_group")), (name, Some(Param::Int(kept)), base.param("rows_per_group")));
            assert!(v.source.contains(&format!("XQ8 = {xq8_src};")), "{name}: {}", v.source);
        }
    }

    #[test]
    fn a_matvec_with_n_at_run_time_is_rendered_with_n_at_run_time() {
        static BASE: KernelVariant = KernelVariant {
            name: "matvec__k4096__q8_0",
            family: "matvec",
            arch: Some("test"),
            params: &[("k", Param::Int(4096)), ("qtype", Param::Sym("q8_0"))],
            source: "",
        };
        let (v, generic) = matvec_in_type(&BASE, GgmlType::Q4_K, 4096, 12288);
        assert_eq!(v.name, "matvec__k4096__q4_k");
        assert!(v.source.contains("K = 4096;") && v.source.contains("N = 0;"), "{}", v.source);
        assert_eq!((v.param("k"), v.param("n")), (Some(Param::Int(4096)), None));
        assert_eq!(generic.map(|g| g.name), Some("matvec__generic__q4_k"));
    }

    #[test]
    fn gemma3_plan_times_the_combining_o_projection() {
        if !registry::SPECIALIZED_FOR.iter().any(|(a, _)| *a == "gemma3") {
            eprintln!("built without model-gemma3: nothing to check");
            return;
        }
        let cases = plan(Some("gemma3"), Some(combine_matvec::FAMILY));
        for n_split in COMBINE_SPLITS {
            let label = format!("k1024_n640_d256_s{n_split}");
            let c = cases.iter().find(|c| c.shape.label() == label).unwrap_or_else(|| panic!("gemma3 plan lacks combine_matvec {label}"));
            let (s, g) = (c.specialized.unwrap(), c.generic.unwrap_or_else(|| panic!("{label}: no generic twin")));
            // The twin runs the same tuning with the dims at run time.
            assert_eq!((g.param("rows_per_group"), g.param("stages")), (s.param("rows_per_group"), s.param("stages")), "{label}");
        }
        let shape = Shape::CombineMatvec { ty: GgmlType::Q4_K, k: 1024, n: 640, head_dim: 256, n_split: 8 };
        // Q4_K rows of 1024 = 4 blocks × 144 B; 4 heads × 8 splits × (256 + 2) partial floats.
        assert_eq!(shape.bytes(), 4 * 144 * 640 + 4 * (4 * 8 * 258 + 640));
        assert_eq!(shape.flops(), Some(2 * 1024 * 640));
    }

    #[test]
    fn geomean_is_per_arch() {
        let row = |arch, s| Row {
            family: "rmsnorm",
            variant: "v",
            kind: Kind::Specialized,
            arch,
            origin: "registry",
            shape: String::new(),
            dtype: String::new(),
            median_us: 1.0,
            min_us: 1.0,
            max_us: 1.0,
            reps: 20,
            buffer_sets: 1,
            bytes: 1,
            flops: None,
            speedup_vs_generic: Some(s),
            stream_us: None,
        };
        let g = geomeans(&[row("a", 2.0), row("a", 8.0), row("b", 1.5)]);
        assert_eq!(g.len(), 2);
        assert!((g[0].1 - 4.0).abs() < 1e-12 && g[0].2 == 2);
        assert!((g[1].1 - 1.5).abs() < 1e-12);
    }
}
