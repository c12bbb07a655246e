//! The MLA decoder stack on the GPU (model-specs §6, §8), shared by the architectures whose
//! attention is multi-head latent attention (glm-dsa, deepseek2): each `<arch>.rs` maps its
//! spec-generated weights and the file's semantics to an [`MlaSpec`]; this file uploads it, plans
//! the kernels and runs it. What differs between the architectures is data, not code: a q LoRA or
//! a direct `attn_q`, YaRN or plain RoPE, DSA indexer tensors or none, the router's gating.
//!
//! Per layer: `h = attn_norm(x)`; q through the q LoRA (`attn_q_a` → `attn_q_a_norm` →
//! `attn_q_b`) or `attn_q`; `[c | k_pe] = attn_kv_a_mqa·h` (a decode step runs every projection
//! of h in one matvec, and those of the normed q latent in another: `gpu::Stack`, the rows
//! stacked at load); one mla_rope launch normalizes the
//! latent, ropes k_pe into the bf16 latent cache row, ropes q_pe into the absorbed query's tail
//! (and the DSA indexer queries); one moe_matvec launch absorbs `q_nope·attn_k_b` for every head
//! (the head index is the "expert id"; a prefill chunk of 16 tokens or more runs one
//! strided-batch tensor-core matmul over the heads instead, also for `attn_v_b`); attention over
//! the latent cache — mla_decode, or for a
//! DSA layer with more than top_k visible keys the indexer (dsa_index_key, dsa_indexer,
//! dsa_topk) and mla_sparse_decode over the selected rows (a layer without indexer tensors after
//! one with them reuses its selection, as the CPU reference); `attn_v_b` per head (one
//! moe_matvec launch), `attn_output`, the residual add fused with `ffn_norm`; the FFN: dense
//! SwiGLU for the leading dense layers, else the shared expert plus the routed experts (router
//! matvec, moe_router, fused gate/up SwiGLU over the selected experts, down + weighted sum).
//!
//! Prefill runs the projections, norms, RoPE and FFNs batched (matmul), and the attention of the
//! chunk's tokens batched over the queries (mla/attend_batch.rs: one mla_decode launch for the
//! tokens that see at most top_k keys, then dsa_indexer, dsa_topk and mla_sparse_decode over the
//! rest, each token over the cache rows up to its position). Decode steps are captured as a CUDA
//! graph and replayed (re-captured when a split count or the dense/sparse choice changes).

use std::path::Path;
use std::time::Instant;

mod attend_batch;

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use memra_gguf::TensorInfo;
use memra_reference::models::mla_model::INDEXER_K_NORM_EPS;
use memra_reference::models::MlaModelHparams;
use memra_reference::moe::Gating;

use super::gpu::{
    self, err, DecoderStack, DeviceTensor, KernelPlan, Linear, LogitsState, Product, Result,
    Stack, StackState, StepGraph, WeightSource,
};
use super::moe_grouped::{self, GroupedMoe, GroupedScratch};
use super::GpuOptions;
use crate::cuda::{Gpu, Kernels};
use crate::parallel::rank::{Rank, RankSpec};
use crate::kernels::dsa_index_key::{self, DsaIndexKeyParams};
use crate::kernels::dsa_indexer::{self, DsaIndexerParams};
use crate::kernels::dsa_topk::{self, DsaTopkParams};
use crate::kernels::mla_decode::{self, MlaDecodeParams};
use crate::kernels::quantize_q8::Q8Activation;
use crate::kernels::mla_rope::{self, MlaRopeParams, RopeFreqs};
use crate::kernels::moe_matvec::{self, MoeDims, MoeMatvecInputs};
use crate::kernels::registry::Param;
use crate::kernels::swiglu::GluLayout;
use crate::kernels::{add_rmsnorm, argmax, embed, matmul, mla_sparse_decode, moe_router, rmsnorm, swiglu};

/// The DSA lightning indexer of the layers that carry one.
#[derive(Clone, Copy, Debug)]
pub struct IndexerConfig {
    pub n_head: usize,
    pub head_dim: usize,
    pub top_k: usize,
    /// LayerNorm eps of `indexer.k_norm`.
    pub k_norm_eps: f32,
}

/// Routed experts of the MoE layers.
#[derive(Clone, Debug)]
pub struct MlaMoeConfig {
    pub n_expert: usize,
    pub n_used: usize,
    pub n_ff_exp: usize,
    /// Shared-expert width (0 = none).
    pub n_ff_shexp: usize,
    /// `softmax` or `sigmoid` (the moe_router gating token).
    pub gating: &'static str,
    pub norm: bool,
    pub scale: f32,
}

/// The scalars and capabilities a forward needs, from the spec and the file.
#[derive(Clone, Debug)]
pub struct MlaConfig {
    pub arch: &'static str,
    pub n_embd: usize,
    pub n_head: usize,
    /// Per q head: `nope` then `rope` dims; values `v` dims; latent `kv_lora`.
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
    pub kv_lora: usize,
    /// q LoRA rank; `None` = a direct `attn_q`.
    pub q_lora: Option<usize>,
    pub n_ctx_train: usize,
    pub eps: f32,
    /// `interleaved` or `neox` (the spec's `rope` capability).
    pub rope_mode: &'static str,
    pub freqs: RopeFreqs,
    /// Softmax scale (YaRN's mscale² folded in, model-specs §6.4).
    pub kq_scale: f32,
    /// Width of the leading dense layers' FFN.
    pub n_ff: usize,
    pub moe: Option<MlaMoeConfig>,
    pub indexer: Option<IndexerConfig>,
}

/// The q projection of a layer.
pub enum QSpec<'f> {
    Lora {
        attn_q_a: TensorInfo<'f>,
        attn_q_a_norm: TensorInfo<'f>,
        attn_q_b: TensorInfo<'f>,
    },
    Direct {
        attn_q: TensorInfo<'f>,
    },
}

/// A layer's DSA indexer tensors.
pub struct IndexerSpec<'f> {
    pub attn_q_b: TensorInfo<'f>,
    pub attn_k: TensorInfo<'f>,
    pub k_norm: TensorInfo<'f>,
    pub k_norm_bias: TensorInfo<'f>,
    pub proj: TensorInfo<'f>,
}

/// A gated FFN's three matrices (dense layers, the shared expert).
pub struct GluSpec<'f> {
    pub gate: TensorInfo<'f>,
    pub up: TensorInfo<'f>,
    pub down: TensorInfo<'f>,
}

#[allow(clippy::large_enum_variant)]
pub enum MlaFfnSpec<'f> {
    Dense(GluSpec<'f>),
    Moe {
        gate_inp: TensorInfo<'f>,
        /// Selection bias (`exp_probs_b`), when the file has it.
        exp_probs_b: Option<TensorInfo<'f>>,
        gate_exps: TensorInfo<'f>,
        up_exps: TensorInfo<'f>,
        down_exps: TensorInfo<'f>,
        shared: Option<GluSpec<'f>>,
    },
}

pub struct MlaLayerSpec<'f> {
    pub attn_norm: TensorInfo<'f>,
    pub q: QSpec<'f>,
    pub attn_kv_a_mqa: TensorInfo<'f>,
    pub attn_kv_a_norm: TensorInfo<'f>,
    pub attn_k_b: TensorInfo<'f>,
    pub attn_v_b: TensorInfo<'f>,
    pub attn_output: TensorInfo<'f>,
    pub indexer: Option<IndexerSpec<'f>>,
    pub ffn_norm: TensorInfo<'f>,
    pub ffn: MlaFfnSpec<'f>,
}

/// Everything an architecture file hands over.
pub struct MlaSpec<'f> {
    pub config: MlaConfig,
    pub layers: Vec<MlaLayerSpec<'f>>,
    pub token_embd: TensorInfo<'f>,
    pub output_norm: TensorInfo<'f>,
    /// Untied LM head; `None` = logits through `token_embd`.
    pub output: Option<TensorInfo<'f>>,
}

/// The part indices of a layer's projections of `h` ([`Layer::h_proj`]): q (`attn_q_a`, or
/// `attn_q` without a q LoRA), `attn_kv_a_mqa`, then on indexer layers `indexer.attn_k` and
/// `indexer.proj`.
const H_Q: usize = 0;
const H_KV: usize = 1;
const H_IDX_K: usize = 2;
const H_IDX_W: usize = 3;
/// The part index of `indexer.attn_q_b` among a q LoRA's projections of the normed q latent
/// (`attn_q_b` is the first).
const Q_IDX_Q: usize = 1;

enum QProj {
    /// `attn_q_a` (in `h_proj`) → `attn_q_a_norm` → this stack (`attn_q_b`, [`Q_IDX_Q`]).
    Lora { norm: CudaSlice<f32>, b: Stack },
    /// `attn_q` is `h_proj`'s first part.
    Direct,
}

/// A per-head weight stack `[n_head][rows][k]` run as "experts" with its plain variant.
struct HeadStack {
    w: DeviceTensor,
    /// moe_matvec (the head index as the expert id): decode steps and short chunks.
    kernel: &'static str,
    /// The tensor-core matmul over every head in one strided-batch launch, for prefill chunks
    /// of [`HEAD_MATMUL_MIN_TOKENS`] tokens or more; `None` when a head's bytes or the row
    /// strides do not fit its loads or the policy gives no variant.
    prefill: Option<&'static str>,
}

/// Prefill chunks from this many tokens on absorb with the batched matmul: per token
/// moe_matvec re-reads every head's matrix (on the H200 it was 174 of a 342 ms GLM-5 prefill
/// of 512 tokens, 4 layers, session 6).
const HEAD_MATMUL_MIN_TOKENS: usize = 16;

impl HeadStack {
    /// `y[s] = w[h]·x[s]` for the `t·n_head` rows `s = token·n_head + h` (`ids[s] = h`): `x`
    /// rows of `ldx` floats (the first `k` read), `y` rows of `ldy` (the first `n` written).
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        kernels: &Kernels,
        ids: &CudaView<'_, i32>,
        x: &CudaView<'_, f32>,
        y: &mut CudaViewMut<'_, f32>,
        t: usize,
        n_head: usize,
        (k, n): (usize, usize),
        (ldx, ldy): (usize, usize),
    ) -> Result<()> {
        let w = self.w.data.slice(..);
        let done = match self.prefill.filter(|_| t >= HEAD_MATMUL_MIN_TOKENS) {
            Some(mm) => matmul::matmul_batched(kernels.get(mm)?, &w, x, y, n_head, t, k, n, (n_head * ldx, ldx), (n_head * ldy, ldy)),
            None => {
                let inp = MoeMatvecInputs { w: &w, w_up: None, ids, weights: None, x };
                let dims = MoeDims { k, n, n_tokens: t * n_head, n_used: 1, n_expert: n_head, ldx, ldy };
                moe_matvec::moe_matvec(kernels.get(self.kernel)?, &inp, y, dims)
            }
        };
        done.map_err(|e| err(format!("{}: {e}", self.w.name)))
    }
}

/// An indexer layer's key norm (its projections are parts of the layer's stacks).
struct Indexer {
    k_norm: CudaSlice<f32>,
    k_norm_bias: CudaSlice<f32>,
}

struct Glu {
    gate: Linear,
    up: Linear,
    down: Linear,
    /// The swiglu variant for this width.
    act: &'static str,
    /// Decode steps: gate, up and SwiGLU as one launch (the expert kernel in swiglu mode over a
    /// single "expert", as decoder.rs); `None` when off, or gate and up differ in type.
    fused: Option<Product>,
}

#[allow(clippy::large_enum_variant)]
enum Ffn {
    Dense(Glu),
    Moe {
        router: Linear,
        bias: Option<CudaSlice<f32>>,
        gate: DeviceTensor,
        up: DeviceTensor,
        down: DeviceTensor,
        swiglu: Product,
        down_kernel: Product,
        shared: Option<Glu>,
        /// Expert-grouped prefill (moe_grouped.rs); `None` runs moe_matvec for every chunk.
        grouped: Option<GroupedMoe>,
    },
}

struct Layer {
    attn_norm: CudaSlice<f32>,
    /// Every projection of `h` ([`H_Q`], [`H_KV`], [`H_IDX_K`], [`H_IDX_W`]): one launch a decode step.
    h_proj: Stack,
    q: QProj,
    attn_kv_a_norm: CudaSlice<f32>,
    k_b: HeadStack,
    v_b: HeadStack,
    attn_output: Linear,
    indexer: Option<Indexer>,
    /// The layer whose DSA selection this layer's sparse attention uses (itself when it has an
    /// indexer, else the last earlier indexer layer); `None` = always dense.
    selection_from: Option<usize>,
    ffn_norm: CudaSlice<f32>,
    ffn: Ffn,
}

/// Variant names of the non-linear kernels.
struct Names {
    embed: &'static str,
    rmsnorm: &'static str,
    /// The q LoRA norm (width q_lora).
    q_norm: Option<&'static str>,
    add_rmsnorm: &'static str,
    mla_rope: &'static str,
    mla_decode: &'static str,
    argmax: &'static str,
    moe_router: Option<&'static str>,
    /// dsa_index_key, dsa_indexer, dsa_topk, mla_sparse_decode.
    dsa: Option<[&'static str; 4]>,
    /// quantize_q8, when an FFN product reads x as q8 rows (a spec entry's `xq8 = 1`).
    quantize_q8: Option<&'static str>,
}

/// How one layer's attention runs in a decode step (what a captured graph bakes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AttnPlan {
    Dense { n_split: usize },
    Sparse { n_split: usize, n_blk: usize },
}

/// What a forward reads: weights, kernels, dims.
struct Net {
    cfg: MlaConfig,
    layers: Vec<Layer>,
    token_embd: Option<DeviceTensor>,
    lm_head: Linear,
    output_norm: CudaSlice<f32>,
    kernels: Kernels,
    names: Names,
    sm_count: usize,
    /// Multi-GPU: this rank's communicator and shard (crate::parallel); `None` on one GPU.
    rank: Option<Rank>,
}

/// Per layer bf16 latent caches `[max_ctx, kv_lora + rope]` and, for indexer layers, f32
/// index-key caches `[max_ctx, idx_head_dim]`: the top-k selection is discontinuous in the
/// scores, so keys rounded to bf16 would swap near-equal rows against the f32 oracle (the
/// latent cache only perturbs the attention output smoothly). Capacity and filled positions
/// are [`StackState`]'s.
pub struct Caches {
    latent: Vec<CudaSlice<u16>>,
    index_keys: Vec<Option<CudaSlice<f32>>>,
}

type State = StackState<Caches>;

/// Activations for a number of tokens.
struct Bufs {
    tokens: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    /// `0..n_head` once per token: the "expert" ids of the per-head products.
    head_ids: CudaSlice<i32>,
    x: CudaSlice<f32>,
    h: CudaSlice<f32>,
    /// Throwaway norm output of the shared expert's residual add.
    h_tmp: CudaSlice<f32>,
    o: CudaSlice<f32>,
    /// `h_proj`'s outputs (parts at [`Stack::at`]): the q latent or q, the kv latent, the
    /// indexer key and head weights.
    hp: CudaSlice<f32>,
    qr: CudaSlice<f32>,
    /// A q LoRA's `attn_q_b` outputs: q, then the indexer queries.
    qp: CudaSlice<f32>,
    q_abs: CudaSlice<f32>,
    lat: CudaSlice<f32>,
    att: CudaSlice<f32>,
    scores: CudaSlice<f32>,
    sel_idx: CudaSlice<i32>,
    sel_count: CudaSlice<i32>,
    /// dsa_topk's blocks per row and its zeroed scratch (sized in `with_cache`).
    topk_blk: usize,
    topk_scratch: CudaSlice<u32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    ff: CudaSlice<f32>,
    router: CudaSlice<f32>,
    ids: CudaSlice<i32>,
    wts: CudaSlice<f32>,
    work: CudaSlice<f32>,
    /// Expert-grouped MoE scratch, for prefill chunks that run grouped.
    grouped: Option<GroupedScratch>,
    /// q8 rows of `h` and of the routed experts' `ff`, for products that read q8 x (allocated
    /// when the plan has quantize_q8).
    q8_h: Option<Q8Activation>,
    q8_ff: Option<Q8Activation>,
}

/// An MLA model loaded on the GPU.
pub struct MlaDecoder {
    net: Net,
    state: State,
    step: Bufs,
    graph: StepGraph<Vec<AttnPlan>>,
}

fn int(v: usize) -> Param {
    Param::Int(v as i64)
}

impl MlaDecoder {
    pub fn load(
        path: &Path,
        file: &dyn WeightSource,
        spec: MlaSpec<'_>,
        opts: &GpuOptions,
    ) -> Result<MlaDecoder> {
        MlaDecoder::load_rank(path, file, spec, opts, None)
    }

    /// [`MlaDecoder::load`] as one rank of a multi-GPU model (`crate::parallel::sharded`):
    /// `file` uploads the rank's shard and `spec.config.n_head` is the rank's head count.
    pub fn load_rank(
        path: &Path,
        file: &dyn WeightSource,
        spec: MlaSpec<'_>,
        opts: &GpuOptions,
        rank: Option<RankSpec>,
    ) -> Result<MlaDecoder> {
        if let Some(role) = opts.omit {
            return Err(err(format!("{}: leaving out the {} launches (--breakdown) is for the GQA decoder's fused decode step, not MLA models", path.display(), role.label())));
        }
        let start = Instant::now();
        let cfg = spec.config;
        let e = cfg.n_embd;
        let max_ctx = opts
            .max_ctx
            .unwrap_or(cfg.n_ctx_train)
            .min(cfg.n_ctx_train)
            .max(1);
        let gpu = Gpu::new(opts.device)?;
        let sm_count = gpu.sm_count()?;
        let rank = rank.map(|r| r.attach(&gpu)).transpose()?;
        let mut plan = KernelPlan::new(opts.policy);
        let mut bytes = 0usize;
        let mut upload = |t: &TensorInfo<'_>| -> Result<DeviceTensor> {
            let d = file.upload(&gpu, t)?;
            bytes += d.bytes();
            Ok(d)
        };
        let f32s = |t: &TensorInfo<'_>| file.upload_f32(&gpu, t);
        // The moe_matvec request for the stacked tensor `t` of `rows`-row experts in `mode`.
        let expert_req = |t: &DeviceTensor, rows: usize, mode: &'static str| -> Result<[(&'static str, Param); 4]> {
            let qtype = gpu::qtype_token(moe_matvec::FAMILY, t.ty)
                .map_err(|e| err(format!("tensor '{}': {e}", t.name)))?;
            Ok([
                ("k", int(t.k)),
                ("n", int(rows)),
                ("qtype", Param::Sym(qtype)),
                ("mode", Param::Sym(mode)),
            ])
        };
        let expert_kernel = |plan: &mut KernelPlan,
                             t: &DeviceTensor,
                             rows: usize,
                             mode: &'static str|
         -> Result<Product> {
            plan.product(moe_matvec::FAMILY, &expert_req(t, rows, mode)?)
                .map_err(|e| err(format!("tensor '{}': {e}", t.name)))
        };
        // The per-head stacks pass f32 x (HeadStack::forward).
        let head_kernel = |plan: &mut KernelPlan, t: &DeviceTensor, rows: usize| -> Result<&'static str> {
            plan.want_f32_x(moe_matvec::FAMILY, &expert_req(t, rows, "plain")?)
                .map_err(|e| err(format!("tensor '{}': {e}", t.name)))
        };
        // A head stack `[heads][rows][k]` as one strided-batch matmul: each head's matrix and
        // the `x_batch`-float offsets between heads' input rows keep the 16-byte loads aligned.
        let head_matmul = |plan: &mut KernelPlan, t: &DeviceTensor, rows: usize, x_batch: usize| -> Option<&'static str> {
            let heads = t.n.checked_div(rows)?;
            let head_bytes = rows * t.ty.row_bytes(t.k as u64)? as usize;
            if heads * rows != t.n || !head_bytes.is_multiple_of(16) || !x_batch.is_multiple_of(4) {
                return None;
            }
            let qtype = gpu::qtype_token(matmul::FAMILY, t.ty).ok()?;
            plan.want(matmul::FAMILY, &[("k", int(t.k)), ("n", int(rows)), ("qtype", Param::Sym(qtype))]).ok()
        };
        let mut layers = Vec::with_capacity(spec.layers.len());
        let mut last_indexer = None;
        for (il, l) in spec.layers.iter().enumerate() {
            let mut lin = |t: &TensorInfo<'_>| -> Result<Linear> { plan.linear(upload(t)?) };
            let attn_output = lin(&l.attn_output)?;
            let indexer = match (&l.indexer, &cfg.indexer, &l.q) {
                (Some(i), Some(_), QSpec::Lora { .. }) => Some(i),
                (Some(i), _, _) => {
                    return Err(err(format!(
                        "{}: {} without an indexer config or a q LoRA",
                        path.display(),
                        i.attn_q_b.name
                    )));
                }
                _ => None,
            };
            // The projections of h, and of the normed q latent, stacked (one launch each a
            // decode step); the part order is H_* / Q_*.
            let (h_first, q_lora) = match &l.q {
                QSpec::Lora { attn_q_a, attn_q_a_norm, attn_q_b } => (attn_q_a, Some((attn_q_a_norm, attn_q_b))),
                QSpec::Direct { attn_q } => (attn_q, None),
            };
            let mut h_parts = vec![upload(h_first)?, upload(&l.attn_kv_a_mqa)?];
            if let Some(i) = indexer {
                h_parts.extend([upload(&i.attn_k)?, upload(&i.proj)?]);
            }
            let h_proj = Stack::new(&gpu, &mut plan, h_parts)?;
            let q = match q_lora {
                Some((norm, q_b)) => {
                    let mut parts = vec![upload(q_b)?];
                    if let Some(i) = indexer {
                        parts.push(upload(&i.attn_q_b)?);
                    }
                    QProj::Lora { norm: f32s(norm)?, b: Stack::new(&gpu, &mut plan, parts)? }
                }
                None => QProj::Direct,
            };
            let indexer = match indexer {
                Some(i) => Some(Indexer { k_norm: f32s(&i.k_norm)?, k_norm_bias: f32s(&i.k_norm_bias)? }),
                None => None,
            };
            let glu = |plan: &mut KernelPlan,
                       g: &GluSpec<'_>,
                       upload: &mut dyn FnMut(&TensorInfo<'_>) -> Result<DeviceTensor>|
             -> Result<Glu> {
                let (gate, up, down) = (
                    plan.linear(upload(&g.gate)?)?,
                    plan.linear(upload(&g.up)?)?,
                    plan.linear(upload(&g.down)?)?,
                );
                let act = plan.want(swiglu::FAMILY, &[("n_ff", int(gate.w.n))])?;
                let fused = if gate.w.ty == up.w.ty && opts.fuse_ffn {
                    Some(expert_kernel(plan, &gate.w, gate.w.n, "swiglu")?)
                } else {
                    None
                };
                Ok(Glu {
                    gate,
                    up,
                    down,
                    act,
                    fused,
                })
            };
            let ffn = match &l.ffn {
                MlaFfnSpec::Dense(g) => Ffn::Dense(glu(&mut plan, g, &mut upload)?),
                MlaFfnSpec::Moe {
                    gate_inp,
                    exp_probs_b,
                    gate_exps,
                    up_exps,
                    down_exps,
                    shared,
                } => {
                    let moe = cfg.moe.as_ref().ok_or_else(|| {
                        err(format!("{}: MoE tensors but no MoE config", gate_exps.name))
                    })?;
                    let router = plan.linear(upload(gate_inp)?)?;
                    let (gate, up, down) =
                        (upload(gate_exps)?, upload(up_exps)?, upload(down_exps)?);
                    if up.ty != gate.ty {
                        return Err(err(format!(
                            "{}: {} and {} differ in type; the fused gate/up kernel needs one",
                            path.display(),
                            gate.name,
                            up.name
                        )));
                    }
                    let swiglu = expert_kernel(&mut plan, &gate, moe.n_ff_exp, "swiglu")?;
                    let down_kernel = expert_kernel(&mut plan, &down, e, "down")?;
                    // The tensors hold this rank's whole experts (all of them on one GPU).
                    let n_local = gate.n / moe.n_ff_exp.max(1);
                    let grouped =
                        GroupedMoe::plan(&mut plan, &gate, &up, &down, n_local, moe.n_ff_exp);
                    let shared = shared
                        .as_ref()
                        .map(|g| glu(&mut plan, g, &mut upload))
                        .transpose()?;
                    Ffn::Moe {
                        router,
                        bias: exp_probs_b.as_ref().map(f32s).transpose()?,
                        gate,
                        up,
                        down,
                        swiglu,
                        down_kernel,
                        shared,
                        grouped,
                    }
                }
            };
            let k_b = upload(&l.attn_k_b)?;
            let v_b = upload(&l.attn_v_b)?;
            let k_b = HeadStack {
                kernel: head_kernel(&mut plan, &k_b, cfg.kv_lora)?,
                prefill: head_matmul(&mut plan, &k_b, cfg.kv_lora, cfg.nope + cfg.rope),
                w: k_b,
            };
            let v_b = HeadStack {
                kernel: head_kernel(&mut plan, &v_b, cfg.v)?,
                prefill: head_matmul(&mut plan, &v_b, cfg.v, cfg.kv_lora),
                w: v_b,
            };
            if indexer.is_some() {
                last_indexer = Some(il);
            }
            layers.push(Layer {
                attn_norm: f32s(&l.attn_norm)?,
                h_proj,
                q,
                attn_kv_a_norm: f32s(&l.attn_kv_a_norm)?,
                k_b,
                v_b,
                attn_output,
                indexer,
                selection_from: last_indexer,
                ffn_norm: f32s(&l.ffn_norm)?,
                ffn,
            });
        }
        let embd = upload(&spec.token_embd)?;
        let embd_qtype = gpu::qtype_token(embed::FAMILY, embd.ty)
            .map_err(|e| err(format!("token_embd.weight: {e}")))?;
        let n_vocab = embd.n;
        let (token_embd, lm_head) = match &spec.output {
            Some(out) => (Some(embd), plan.linear(upload(out)?)?),
            None => (None, plan.linear(embd)?),
        };
        // Multi-GPU: each rank holds a row block of output.weight (parallel::shard).
        let head_rows = match (&rank, &spec.output) {
            (Some(r), Some(_)) => n_vocab / r.shard.n_ranks,
            _ => n_vocab,
        };
        if lm_head.w.n != head_rows {
            return Err(err(format!(
                "{}: output.weight has {} rows, token_embd.weight {n_vocab}",
                path.display(),
                lm_head.w.n
            )));
        }
        let output_norm = f32s(&spec.output_norm)?;

        let bf16 = Param::Sym("bf16");
        let mla_dims = [
            ("n_head", int(cfg.n_head)),
            ("kv_lora", int(cfg.kv_lora)),
            ("rope", int(cfg.rope)),
            ("cache_t", bf16),
        ];
        let has_indexer = layers.iter().any(|l| l.indexer.is_some());
        let names = Names {
            embed: plan.want(
                embed::FAMILY,
                &[("n_embd", int(e)), ("qtype", Param::Sym(embd_qtype))],
            )?,
            rmsnorm: plan.want(rmsnorm::FAMILY, &[("n", int(e))])?,
            q_norm: cfg
                .q_lora
                .map(|r| plan.want(rmsnorm::FAMILY, &[("n", int(r))]))
                .transpose()?,
            add_rmsnorm: plan.want(
                add_rmsnorm::FAMILY,
                &[("n", int(e)), ("delta_norm", Param::Int(0))],
            )?,
            mla_rope: plan.want(
                mla_rope::FAMILY,
                &[
                    ("n_head", int(cfg.n_head)),
                    ("nope", int(cfg.nope)),
                    ("rope", int(cfg.rope)),
                    ("kv_lora", int(cfg.kv_lora)),
                    ("rope_mode", Param::Sym(cfg.rope_mode)),
                    ("cache_t", bf16),
                ],
            )?,
            mla_decode: plan.want(mla_decode::FAMILY, &mla_dims)?,
            argmax: plan.want(argmax::FAMILY, &[("n_vocab", int(n_vocab))])?,
            moe_router: match &cfg.moe {
                Some(m) => Some(plan.want(
                    moe_router::FAMILY,
                    &[
                        ("n_expert", int(m.n_expert)),
                        ("n_used", int(m.n_used)),
                        ("gating", Param::Sym(m.gating)),
                    ],
                )?),
                None => None,
            },
            dsa: match (&cfg.indexer, has_indexer) {
                (Some(i), true) => Some([
                    plan.want(
                        dsa_index_key::FAMILY,
                        &[
                            ("head_dim", int(i.head_dim)),
                            ("n_rot", int(cfg.rope)),
                            ("rope_mode", Param::Sym(cfg.rope_mode)),
                            ("cache_t", Param::Sym("f32")),
                        ],
                    )?,
                    plan.want(
                        dsa_indexer::FAMILY,
                        &[
                            ("n_idx_head", int(i.n_head)),
                            ("idx_head_dim", int(i.head_dim)),
                            ("cache_t", Param::Sym("f32")),
                        ],
                    )?,
                    plan.want(dsa_topk::FAMILY, &[("k", int(i.top_k))])?,
                    plan.want(mla_sparse_decode::FAMILY, &mla_dims)?,
                ]),
                _ => None,
            },
            // After every product is planned.
            quantize_q8: plan.quantizer()?,
        };
        let mut report = vec![format!(
            "{}: {}, {} layers, n_embd {e}, {} MLA heads (nope {} + rope {}, v {}), latent {}{}, vocab {n_vocab}; weights {} on {}",
            path.display(),
            cfg.arch,
            layers.len(),
            cfg.n_head,
            cfg.nope,
            cfg.rope,
            cfg.v,
            cfg.kv_lora,
            match &cfg.indexer {
                Some(i) if has_indexer => format!(", DSA top-{} ({} × {} indexer heads)", i.top_k, i.n_head, i.head_dim),
                _ => String::new(),
            },
            gpu::mib(bytes),
            gpu.name()
        )];
        report.extend(plan.report());
        report.extend(rank.as_ref().map(|r| r.describe(cfg.n_head)));
        let compile = Instant::now();
        let kernels = plan.load(&gpu)?;
        report.push(format!(
            "kernels ready in {:.2} s",
            compile.elapsed().as_secs_f64()
        ));

        let dk = cfg.kv_lora + cfg.rope;
        let what = |kind: &str| {
            format!(
                "the {kind} cache ({} layers × {max_ctx} positions; lower it with --ctx)",
                layers.len()
            )
        };
        let cache = Caches {
            latent: (0..layers.len())
                .map(|_| gpu::alloc::<u16>(&gpu, max_ctx * dk, &what("latent")))
                .collect::<Result<_>>()?,
            index_keys: layers
                .iter()
                .map(|l| match (&l.indexer, &cfg.indexer) {
                    (Some(_), Some(i)) => {
                        gpu::alloc::<f32>(&gpu, max_ctx * i.head_dim, &what("index-key")).map(Some)
                    }
                    _ => Ok(None),
                })
                .collect::<Result<_>>()?,
        };
        let cache_bytes: usize = cache.latent.iter().map(|b| b.len() * 2).sum::<usize>()
            + cache
                .index_keys
                .iter()
                .flatten()
                .map(|b| b.len() * 4)
                .sum::<usize>();
        report.push(format!(
            "latent cache: {max_ctx} positions, bf16 (index keys f32), {}",
            gpu::mib(cache_bytes)
        ));
        let out = LogitsState::new(&gpu, kernels.get(names.argmax)?, n_vocab, max_ctx)?;
        let n_ctx_train = cfg.n_ctx_train;
        let net = Net {
            cfg,
            layers,
            token_embd,
            lm_head,
            output_norm,
            kernels,
            names,
            sm_count,
            rank,
        };
        let step = Bufs::new(&gpu, &net, 1)?.with_cache(&gpu, &net, max_ctx)?;
        report.push(format!("loaded in {:.2} s", start.elapsed().as_secs_f64()));
        let state = State {
            gpu,
            cache,
            out,
            len: 0,
            max_ctx,
            n_ctx_train,
            n_vocab,
            weight_bytes: bytes,
            report,
        };
        Ok(MlaDecoder {
            net,
            state,
            step,
            graph: StepGraph::new(opts.graphs, opts.pdl),
        })
    }
}

impl Net {
    /// Multi-GPU: a partial output summed over the ranks, in place (nothing on one GPU).
    fn all_reduce(&self, buf: &mut CudaSlice<f32>, n: usize) -> Result<()> {
        self.rank.as_ref().map_or(Ok(()), |r| r.all_reduce(buf, n))
    }

    fn n_vocab(&self) -> usize {
        self.embd_table().n
    }

    fn embd_table(&self) -> &DeviceTensor {
        self.token_embd.as_ref().unwrap_or(&self.lm_head.w)
    }

    /// Most attention splits any launch uses (sizes the workspace).
    fn max_split(&self, max_ctx: usize) -> usize {
        let c = &self.cfg;
        let dense = mla_decode::splits_for(max_ctx.next_power_of_two(), c.n_head, self.sm_count);
        let sparse = c.indexer.map_or(1, |i| {
            mla_sparse_decode::splits_for(i.top_k, c.n_head, self.sm_count)
        });
        dense.max(sparse).max(2)
    }

    /// The attention of layer `il` for a query at position `pos`: sparse over the DSA selection
    /// when the layer has one and more than top_k keys are visible (below that the selection is
    /// every visible key, i.e. dense), else dense; split counts for the next power of two of the
    /// visible keys, so a captured graph changes only log2(context) times.
    fn attn_plan(&self, il: usize, pos: usize) -> AttnPlan {
        let c = &self.cfg;
        let visible = pos + 1;
        match (self.layers[il].selection_from, c.indexer) {
            (Some(_), Some(i)) if visible > i.top_k => AttnPlan::Sparse {
                n_split: mla_sparse_decode::splits_for(i.top_k, c.n_head, self.sm_count),
                n_blk: dsa_indexer::blocks_for(
                    visible.next_power_of_two(),
                    2,
                    dsa_indexer::THREADS,
                    self.sm_count,
                ),
            },
            _ => AttnPlan::Dense {
                n_split: mla_decode::splits_for(
                    visible.next_power_of_two(),
                    c.n_head,
                    self.sm_count,
                ),
            },
        }
    }

    fn plans(&self, pos: usize) -> Vec<AttnPlan> {
        (0..self.layers.len())
            .map(|il| self.attn_plan(il, pos))
            .collect()
    }

    /// Enqueues the forward of `t` tokens (ids and positions `pos0..pos0+t` already in `bufs`),
    /// leaving the last token's logits and argmax in `state.out`.
    fn enqueue(&self, state: &mut State, b: &mut Bufs, t: usize, pos0: usize) -> Result<()> {
        let c = &self.cfg;
        let (e, nh, eps) = (c.n_embd, c.n_head, c.eps);
        let (dq, dk) = (c.nope + c.rope, c.kv_lora + c.rope);
        let k = &self.kernels;
        let n_vocab = self.n_vocab();
        let te = t * e;

        embed::embed(
            k.get(self.names.embed)?,
            &b.tokens.slice(..t),
            &self.embd_table().data.slice(..),
            &mut b.x.slice_mut(..te),
            t,
            e,
            n_vocab,
            1.0,
        )?;
        rmsnorm::rmsnorm(
            k.get(self.names.rmsnorm)?,
            &b.x.slice(..te),
            &self.layers[0].attn_norm.slice(..),
            &mut b.h.slice_mut(..te),
            t,
            e,
            eps,
        )?;
        for (il, l) in self.layers.iter().enumerate() {
            // q, [c | k_pe], the indexer key and head weights: h_proj's parts in b.hp; with a q
            // LoRA, q [t, n_head, nope + rope] and the indexer queries in b.qp.
            let hw = l.h_proj.width();
            l.h_proj.forward(k, &b.h.slice(..te), &mut b.hp.slice_mut(..t * hw), t)?;
            if let QProj::Lora { norm, b: qb } = &l.q {
                let (r, at) = (l.h_proj.rows(H_Q), l.h_proj.at(H_Q, t));
                let q_norm = self
                    .names
                    .q_norm
                    .ok_or_else(|| err("a q LoRA layer but no q-norm kernel planned"))?;
                rmsnorm::rmsnorm(
                    k.get(q_norm)?,
                    &b.hp.slice(at..at + t * r),
                    &norm.slice(..),
                    &mut b.qr.slice_mut(..t * r),
                    t,
                    r,
                    eps,
                )?;
                let qw = qb.width();
                qb.forward(k, &b.qr.slice(..t * r), &mut b.qp.slice_mut(..t * qw), t)?;
            }
            let idx = l.indexer.as_ref().zip(c.indexer);
            let p = MlaRopeParams {
                n_tokens: t,
                n_head: nh,
                nope: c.nope,
                rope: c.rope,
                kv_lora: c.kv_lora,
                n_idx_head: idx.map_or(0, |(_, ic)| ic.n_head),
                idx_head_dim: idx.map_or(0, |(_, ic)| ic.head_dim),
                max_ctx: state.max_ctx,
                freqs: c.freqs,
                // The indexer head weights' 1/sqrt(d_I·H_I) (model-specs §8.4 step 6), on q.
                idx_q_scale: idx.map_or(1.0, |(_, ic)| {
                    (1.0 / ((ic.head_dim * ic.n_head) as f64).sqrt()) as f32
                }),
                eps,
            };
            {
                let kv_at = l.h_proj.at(H_KV, t);
                let Bufs { hp, qp, q_abs, pos, .. } = &mut *b;
                let kv = hp.slice(kv_at..kv_at + t * dk);
                let kernel = k.get(self.names.mla_rope)?;
                let mut rope = |q: &CudaView<'_, f32>, iq: &mut CudaViewMut<'_, f32>| {
                    mla_rope::mla_rope(
                        kernel,
                        q,
                        &mut q_abs.slice_mut(..t * nh * dk),
                        &kv,
                        &l.attn_kv_a_norm.slice(..),
                        &pos.slice(..t),
                        &mut state.cache.latent[il].slice_mut(..),
                        iq,
                        &p,
                    )
                };
                // q is the first part of qp (q LoRA) or of hp; the indexer queries follow q in qp.
                let qd = t * nh * dq;
                match &l.q {
                    QProj::Lora { b: qb, .. } => {
                        let (q, mut iq) = qp.split_at_mut(qd);
                        debug_assert!(l.indexer.is_none() || qb.at(Q_IDX_Q, t) == qd);
                        rope(&q.slice(..), &mut iq)?;
                    }
                    QProj::Direct => rope(&hp.slice(..qd), &mut qp.slice_mut(..))?,
                }
            }
            if let Some((ix, ic)) = idx {
                let key = self
                    .names
                    .dsa
                    .ok_or_else(|| err("an indexer layer but no DSA kernels planned"))?[0];
                let kc = state.cache.index_keys[il]
                    .as_mut()
                    .ok_or_else(|| err("an indexer layer without an index-key cache"))?;
                let p = DsaIndexKeyParams {
                    n_tokens: t,
                    head_dim: ic.head_dim,
                    n_rot: c.rope,
                    k_stride: ic.head_dim,
                    max_ctx: state.max_ctx,
                    freq_base: c.freqs.base,
                    freq_scale: 1.0,
                    eps: ic.k_norm_eps,
                };
                let at = l.h_proj.at(H_IDX_K, t);
                dsa_index_key::dsa_index_key(
                    k.get(key)?,
                    &b.hp.slice(at..at + t * ic.head_dim),
                    &ix.k_norm.slice(..),
                    &ix.k_norm_bias.slice(..),
                    &b.pos.slice(..t),
                    &mut kc.slice_mut(..),
                    &p,
                )?;
            }
            // Absorption: q_abs[s][0..kv_lora) = attn_k_b[h]·q_nope[s] for s = (token, head h).
            let rows = t * nh;
            let ids = b.head_ids.slice(..rows);
            let mut qa = b.q_abs.slice_mut(..rows * dk);
            let q = match &l.q {
                QProj::Lora { .. } => b.qp.slice(..rows * dq),
                QProj::Direct => b.hp.slice(..rows * dq),
            };
            l.k_b.forward(k, &ids, &q, &mut qa, t, nh, (c.nope, c.kv_lora), (dq, dk))?;

            // Every token over the cache rows up to its position, batched (see the module doc).
            self.attend_rows(state, b, il, t, pos0, idx.map(|(_, ic)| ic))?;

            // o[s] = attn_v_b[h]·lat[s], then attn_output.
            let (kv, v) = (c.kv_lora, c.v);
            let mut att = b.att.slice_mut(..rows * v);
            l.v_b.forward(k, &b.head_ids.slice(..rows), &b.lat.slice(..rows * kv), &mut att, t, nh, (kv, v), (kv, v))?;
            l.attn_output
                .forward(k, &b.att.slice(..rows * c.v), &mut b.o.slice_mut(..te), t)?;
            self.all_reduce(&mut b.o, te)?;
            add_rmsnorm::add_rmsnorm(
                k.get(self.names.add_rmsnorm)?,
                &mut b.x.slice_mut(..te),
                &b.o.slice(..te),
                None,
                &l.ffn_norm.slice(..),
                &mut b.h.slice_mut(..te),
                t,
                e,
                eps,
            )?;

            match &l.ffn {
                Ffn::Dense(g) => {
                    self.glu(g, b, t)?;
                    self.all_reduce(&mut b.o, te)?;
                }
                Ffn::Moe {
                    router: wr,
                    bias,
                    gate: wg,
                    up: wu,
                    down: wd,
                    swiglu,
                    down_kernel,
                    shared,
                    grouped,
                } => {
                    if let Some(g) = shared {
                        // x += shared(h) now (its norm output is not needed), the routed sum below.
                        self.glu(g, b, t)?;
                        self.all_reduce(&mut b.o, te)?;
                        add_rmsnorm::add_rmsnorm(
                            k.get(self.names.add_rmsnorm)?,
                            &mut b.x.slice_mut(..te),
                            &b.o.slice(..te),
                            None,
                            &l.ffn_norm.slice(..),
                            &mut b.h_tmp.slice_mut(..te),
                            t,
                            e,
                            eps,
                        )?;
                    }
                    let m = c
                        .moe
                        .as_ref()
                        .expect("MoE layers have a MoE config (checked at load)");
                    let (ne, nu, nf) = (m.n_expert, m.n_used, m.n_ff_exp);
                    wr.forward(k, &b.h.slice(..te), &mut b.router.slice_mut(..t * ne), t)?;
                    let name = self.names.moe_router.expect("planned with the MoE config");
                    let bias = bias.as_ref().map(|v| v.slice(..));
                    moe_router::moe_router(
                        k.get(name)?,
                        &b.router.slice(..t * ne),
                        bias.as_ref(),
                        &mut b.ids.slice_mut(..t * nu),
                        &mut b.wts.slice_mut(..t * nu),
                        t,
                        ne,
                        nu,
                        m.norm,
                        m.scale,
                    )?;
                    // Multi-GPU: the selected ids as this rank's expert indices (parallel::rank).
                    let ne = match &self.rank {
                        Some(r) => {
                            r.localize(&mut b.ids, &mut b.wts, t * nu)?;
                            r.local_experts()
                        }
                        None => ne,
                    };
                    if let (Some(gm), Some(scratch)) = (grouped, b.grouped.as_mut()) {
                        let (hv, ids_v, wts_v) = (
                            b.h.slice(..te),
                            b.ids.slice(..t * nu),
                            b.wts.slice(..t * nu),
                        );
                        let mut ov = b.o.slice_mut(..te);
                        let w = (wg, wu, wd);
                        gm.forward(
                            &state.gpu, k, w, scratch, &hv, &ids_v, &wts_v, &mut ov, t, nu, ne,
                        )?;
                        self.all_reduce(&mut b.o, te)?;
                    } else {
                        let (gv, uv, ids_v, wts_v) = (
                            wg.data.slice(..),
                            wu.data.slice(..),
                            b.ids.slice(..t * nu),
                            b.wts.slice(..t * nu),
                        );
                        let q8 = self.names.quantize_q8;
                        let (hv, ldx) = gpu::product_x(k, *swiglu, q8, &mut b.q8_h, b.h.slice(..te), t, e)?;
                        let inp = MoeMatvecInputs {
                            w: &gv,
                            w_up: Some(&uv),
                            ids: &ids_v,
                            weights: None,
                            x: &hv,
                        };
                        let dims = MoeDims {
                            k: e,
                            n: nf,
                            n_tokens: t,
                            n_used: nu,
                            n_expert: ne,
                            ldx,
                            ldy: nf,
                        };
                        moe_matvec::moe_matvec(
                            k.get(swiglu.name)?,
                            &inp,
                            &mut b.ff.slice_mut(..t * nu * nf),
                            dims,
                        )?;
                        let dv = wd.data.slice(..);
                        let (ffv, ldx) = gpu::product_x(k, *down_kernel, q8, &mut b.q8_ff, b.ff.slice(..t * nu * nf), t * nu, nf)?;
                        let inp = MoeMatvecInputs {
                            w: &dv,
                            w_up: None,
                            ids: &ids_v,
                            weights: Some(&wts_v),
                            x: &ffv,
                        };
                        let dims = MoeDims {
                            k: nf,
                            n: e,
                            n_tokens: t,
                            n_used: nu,
                            n_expert: ne,
                            ldx,
                            ldy: e,
                        };
                        moe_matvec::moe_matvec(
                            k.get(down_kernel.name)?,
                            &inp,
                            &mut b.o.slice_mut(..te),
                            dims,
                        )?;
                        self.all_reduce(&mut b.o, te)?;
                    }
                }
            }
            let next_norm = self
                .layers
                .get(il + 1)
                .map_or(&self.output_norm, |n| &n.attn_norm);
            add_rmsnorm::add_rmsnorm(
                k.get(self.names.add_rmsnorm)?,
                &mut b.x.slice_mut(..te),
                &b.o.slice(..te),
                None,
                &next_norm.slice(..),
                &mut b.h.slice_mut(..te),
                t,
                e,
                eps,
            )?;
        }
        let last = (t - 1) * e;
        // Multi-GPU: this rank's row block of the logits, then all ranks' blocks gathered.
        let rows = self.lm_head.w.n;
        let at = (self.rank.as_ref())
            .filter(|_| rows != n_vocab)
            .map_or(0, |r| r.shard.rank * rows);
        self.lm_head.forward(
            k,
            &b.h.slice(last..last + e),
            &mut state.out.logits.slice_mut(at..at + rows),
            1,
        )?;
        if let (Some(r), true) = (&self.rank, rows != n_vocab) {
            r.gather_rows(&mut state.out.logits)?;
        }
        let feed = (t == 1).then_some((&mut b.tokens, &mut b.pos));
        state.out.enqueue_argmax(k.get(self.names.argmax)?, feed)
    }

    /// `o = down(silu(gate h) ⊙ up h)` for `t` rows of `h`.
    fn glu(&self, g: &Glu, b: &mut Bufs, t: usize) -> Result<()> {
        let (k, e, n) = (&self.kernels, self.cfg.n_embd, g.gate.w.n);
        if let (Some(fused), 1) = (g.fused, t) {
            let (gv, uv, id0) = (
                g.gate.w.data.slice(..),
                g.up.w.data.slice(..),
                b.head_ids.slice(..1),
            );
            let (hv, ldx) = gpu::product_x(k, fused, self.names.quantize_q8, &mut b.q8_h, b.h.slice(..e), 1, e)?;
            let inp = MoeMatvecInputs {
                w: &gv,
                w_up: Some(&uv),
                ids: &id0,
                weights: None,
                x: &hv,
            };
            let dims = MoeDims {
                k: e,
                n,
                n_tokens: 1,
                n_used: 1,
                n_expert: 1,
                ldx,
                ldy: n,
            };
            moe_matvec::moe_matvec(k.get(fused.name)?, &inp, &mut b.ff.slice_mut(..n), dims)?;
            return g
                .down
                .forward(k, &b.ff.slice(..n), &mut b.o.slice_mut(..e), 1);
        }
        g.gate
            .forward(k, &b.h.slice(..t * e), &mut b.gate.slice_mut(..t * n), t)?;
        g.up.forward(k, &b.h.slice(..t * e), &mut b.up.slice_mut(..t * n), t)?;
        swiglu::swiglu(
            k.get(g.act)?,
            &b.gate.slice(..t * n),
            &b.up.slice(..t * n),
            &mut b.ff.slice_mut(..t * n),
            t,
            n,
            GluLayout::separate(n),
        )?;
        g.down
            .forward(k, &b.ff.slice(..t * n), &mut b.o.slice_mut(..t * e), t)
    }

    /// Attention of row `i` (position `pos`) of layer `il`: `lat[i] = softmax(q_abs[i]·K)·C` over
    /// the latent cache, dense or over the DSA selection (computed here for indexer layers).
    /// Where layer `il`'s indexer queries (in `Bufs::qp`) and head weights (in `Bufs::hp`) for
    /// `t` tokens start (an indexer layer's).
    fn indexer_at(&self, il: usize, t: usize) -> (usize, usize) {
        let l = &self.layers[il];
        let iq = match &l.q {
            QProj::Lora { b, .. } => b.at(Q_IDX_Q, t),
            QProj::Direct => 0,
        };
        (iq, l.h_proj.at(H_IDX_W, t))
    }

    fn attend(
        &self,
        state: &mut State,
        b: &mut Bufs,
        il: usize,
        i: usize,
        pos: usize,
        idx: Option<IndexerConfig>,
    ) -> Result<()> {
        let c = &self.cfg;
        let (nh, dk) = (c.n_head, c.kv_lora + c.rope);
        let k = &self.kernels;
        let max_ctx = state.max_ctx;
        let q = b.q_abs.slice(i * nh * dk..(i + 1) * nh * dk);
        let pos_i = b.pos.slice(i..i + 1);
        let mut out = b
            .lat
            .slice_mut(i * nh * c.kv_lora..(i + 1) * nh * c.kv_lora);
        let cache = state.cache.latent[il].slice(..);
        match self.attn_plan(il, pos) {
            AttnPlan::Dense { n_split } => {
                let p = MlaDecodeParams {
                    n_head: nh,
                    kv_lora: c.kv_lora,
                    rope: c.rope,
                    max_ctx,
                    n_split,
                    scale: c.kq_scale,
                };
                mla_decode::mla_decode(
                    k.get(self.names.mla_decode)?,
                    &q,
                    &cache,
                    &pos_i,
                    &mut out,
                    &mut b.work.slice_mut(..),
                    &p,
                )?;
            }
            AttnPlan::Sparse { n_split, n_blk } => {
                let [_, indexer, topk, sparse] = self
                    .names
                    .dsa
                    .ok_or_else(|| err("a DSA layer but no DSA kernels planned"))?;
                let top_k = c
                    .indexer
                    .expect("sparse plans need an indexer config")
                    .top_k;
                if let Some(ic) = idx {
                    // This layer's own selection for row i (a later layer without indexer reuses it).
                    let kc = state.cache.index_keys[il]
                        .as_ref()
                        .ok_or_else(|| err("an indexer layer without an index-key cache"))?;
                    let (hq, nq) = (ic.n_head * ic.head_dim, ic.n_head);
                    let (iq_at, iw_at) = self.indexer_at(il, 1);
                    let p = DsaIndexerParams {
                        n_q: 1,
                        n_idx_head: ic.n_head,
                        idx_head_dim: ic.head_dim,
                        max_ctx,
                        ld_scores: max_ctx,
                        n_blk,
                    };
                    dsa_indexer::dsa_indexer(
                        k.get(indexer)?,
                        &b.qp.slice(iq_at + i * hq..iq_at + (i + 1) * hq),
                        &b.hp.slice(iw_at + i * nq..iw_at + (i + 1) * nq),
                        &kc.slice(..),
                        &pos_i,
                        &mut b.scores.slice_mut(..max_ctx),
                        &p,
                    )?;
                    let p = DsaTopkParams {
                        n_q: 1,
                        ld_scores: max_ctx,
                        k: top_k,
                        n_blk: b.topk_blk,
                    };
                    dsa_topk::dsa_topk(
                        k.get(topk)?,
                        &b.scores.slice(..max_ctx),
                        &pos_i,
                        &mut b.sel_idx.slice_mut(i * top_k..(i + 1) * top_k),
                        &mut b.sel_count.slice_mut(i..i + 1),
                        &mut b.topk_scratch.slice_mut(..),
                        &p,
                    )?;
                }
                let p = MlaDecodeParams {
                    n_head: nh,
                    kv_lora: c.kv_lora,
                    rope: c.rope,
                    max_ctx,
                    n_split,
                    scale: c.kq_scale,
                };
                mla_sparse_decode::mla_sparse_decode(
                    k.get(sparse)?,
                    &q,
                    &cache,
                    &b.sel_idx.slice(i * top_k..(i + 1) * top_k),
                    &b.sel_count.slice(i..i + 1),
                    &mut out,
                    &mut b.work.slice_mut(..),
                    top_k,
                    &p,
                )?;
            }
        }
        Ok(())
    }
}

impl Bufs {
    fn new(gpu: &Gpu, net: &Net, t: usize) -> Result<Bufs> {
        let c = &net.cfg;
        let (e, nh) = (c.n_embd, c.n_head);
        let dk = c.kv_lora + c.rope;
        let a = |n: usize, what: &str| {
            gpu::alloc::<f32>(gpu, t * n, &format!("activations ({what}, {t} tokens)"))
        };
        let q_lora = c.q_lora.unwrap_or(1);
        let top_k = c.indexer.map_or(1, |i| i.top_k);
        // The widest layer's stacked outputs (q, when a direct attn_q, is hp's first part).
        let hp_width = net.layers.iter().map(|l| l.h_proj.width()).max().unwrap_or(1);
        let qp_width = net
            .layers
            .iter()
            .map(|l| match &l.q {
                QProj::Lora { b, .. } => b.width(),
                QProj::Direct => 1,
            })
            .max()
            .unwrap_or(1);
        let n_ff = net
            .layers
            .iter()
            .flat_map(|l| match &l.ffn {
                Ffn::Dense(g) => vec![g.gate.w.n],
                Ffn::Moe { shared, .. } => vec![shared.as_ref().map_or(0, |g| g.gate.w.n)],
            })
            .max()
            .unwrap_or(1);
        let (ne, nu, nf) = c
            .moe
            .as_ref()
            .map_or((1, 1, 1), |m| (m.n_expert, m.n_used, m.n_ff_exp));
        let q8 = |k: usize, rows: usize| -> Result<Option<Q8Activation>> {
            match net.names.quantize_q8 {
                Some(_) => Ok(Some(Q8Activation::new(gpu.stream(), k, rows)?)),
                None => Ok(None),
            }
        };
        let mut head_ids = gpu::alloc::<i32>(gpu, t * nh, "head ids")?;
        let ids: Vec<i32> = (0..t * nh).map(|s| (s % nh) as i32).collect();
        gpu.stream()
            .memcpy_htod(&ids, &mut head_ids)
            .map_err(|e| err(format!("copying head ids to the GPU: {e:?}")))?;
        Ok(Bufs {
            tokens: gpu::alloc(gpu, t, "token ids")?,
            pos: gpu::alloc(gpu, t, "positions")?,
            head_ids,
            x: a(e, "residual")?,
            h: a(e, "normed")?,
            h_tmp: a(e, "normed")?,
            o: a(e, "projection")?,
            hp: a(hp_width, "projections of h")?,
            qr: a(q_lora, "q latent")?,
            qp: a(qp_width, "q and indexer queries")?,
            q_abs: a(nh * dk, "absorbed q")?,
            lat: a(nh * c.kv_lora, "attention latent")?,
            att: a(nh * c.v, "attention")?,
            scores: gpu::alloc(gpu, 1, "index scores")?,
            sel_idx: gpu::alloc(gpu, t * top_k, "DSA selection")?,
            sel_count: gpu::alloc(gpu, t, "DSA selection")?,
            topk_blk: 1,
            topk_scratch: gpu::alloc(gpu, 1, "DSA top-k scratch")?,
            gate: a(n_ff, "gate")?,
            up: a(n_ff, "up")?,
            ff: a(n_ff.max(nu * nf), "ffn")?,
            router: a(ne, "router logits")?,
            ids: gpu::alloc(gpu, t * nu, "expert ids")?,
            wts: a(nu, "expert weights")?,
            work: gpu::alloc(gpu, 1, "attention workspace")?,
            grouped: match &c.moe {
                Some(m) if moe_grouped::use_grouped(t, m.n_used, m.n_expert) => {
                    Some(GroupedScratch::new(gpu, t, m.n_used, m.n_expert, e, m.n_ff_exp)?)
                }
                _ => None,
            },
            q8_h: q8(e, t)?,
            q8_ff: q8(nf, t * nu)?,
        })
    }

    /// Sizes the buffers that depend on the cache: index scores (rows of the batched prefill
    /// indexer, capped by attend_batch::SCORES_CAP; one row for decode) and the attention
    /// workspace.
    fn with_cache(mut self, gpu: &Gpu, net: &Net, max_ctx: usize) -> Result<Bufs> {
        let c = &net.cfg;
        if c.indexer.is_some() {
            // `pos` holds one entry per token of the chunk.
            let rows = attend_batch::score_rows(self.pos.len(), max_ctx);
            self.scores = gpu::alloc(gpu, rows * max_ctx, "index scores")?;
            // One query row per launch; the blocks adapt their chunks to the visible keys.
            self.topk_blk = dsa_topk::blocks_for(1, max_ctx, net.sm_count);
            self.topk_scratch = gpu::alloc(
                gpu,
                dsa_topk::scratch_words(1, self.topk_blk),
                "DSA top-k scratch",
            )?;
        }
        self.work = gpu::alloc(
            gpu,
            mla_decode::work_floats(c.n_head, c.kv_lora, net.max_split(max_ctx)),
            "attention workspace",
        )?;
        Ok(self)
    }
}

impl DecoderStack for MlaDecoder {
    type Cache = Caches;
    const PREFILL_CHUNK: usize = 512;

    fn state(&self) -> &State {
        &self.state
    }

    fn state_mut(&mut self) -> &mut State {
        &mut self.state
    }

    fn decode_step(&mut self, token: Option<u32>) -> Result<()> {
        let pos0 = self.state.len;
        let s = &mut self.state;
        if let Some(token) = token {
            gpu::upload_tokens(&s.gpu, &[token], pos0, &mut self.step.tokens, &mut self.step.pos)?;
        }
        // Token and position live in device buffers; the graph bakes the attention plans.
        let stream = s.gpu.stream().clone();
        let (net, step) = (&self.net, &mut self.step);
        self.graph
            .run(&stream, net.plans(pos0), || net.enqueue(s, step, 1, pos0))
    }

    fn prefill_chunk(&mut self, tokens: &[u32]) -> Result<()> {
        let (t, pos0) = (tokens.len(), self.state.len);
        let (gpu, net) = (&self.state.gpu, &self.net);
        let mut bufs = Bufs::new(gpu, net, t)?.with_cache(gpu, net, self.state.max_ctx)?;
        gpu::upload_tokens(gpu, tokens, pos0, &mut bufs.tokens, &mut bufs.pos)?;
        self.net.enqueue(&mut self.state, &mut bufs, t, pos0)
    }
}

impl MlaDecoder {
    /// Multi-GPU: one eager round of the step's collectives on this rank (parallel::rank), so
    /// that none runs first inside a graph capture; every rank calls it together.
    pub fn warm_up_rank(&self) -> Result<()> {
        match &self.net.rank {
            Some(r) => {
                let (e, v) = (self.net.cfg.n_embd, self.net.n_vocab());
                r.warm_up(&self.state.gpu, e, Self::PREFILL_CHUNK, v)
            }
            None => Ok(()),
        }
    }

    /// Long-context benchmarks without a prefill: `fill(gpu, layer, latent, index_keys)` writes
    /// each layer's cache rows (latent bf16 bits `[max_ctx, kv_lora + rope]`; f32 index keys
    /// `[max_ctx, idx_head_dim]` on indexer layers), then `len` positions count as cached.
    pub fn assume_cached(
        &mut self,
        len: usize,
        fill: &mut dyn FnMut(&Gpu, usize, &mut CudaSlice<u16>, Option<&mut CudaSlice<f32>>) -> Result<()>,
    ) -> Result<()> {
        let s = &mut self.state;
        if len > s.max_ctx {
            return Err(err(format!("{len} cached positions > the cache's {}", s.max_ctx)));
        }
        let c = &mut s.cache;
        for (il, (latent, keys)) in c.latent.iter_mut().zip(c.index_keys.iter_mut()).enumerate() {
            fill(&s.gpu, il, latent, keys.as_mut())?;
        }
        s.len = len;
        Ok(())
    }
}

/// The [`MlaConfig`] of a file from the CPU reference's reading of its metadata (router gating
/// and scaling, YaRN, the softmax scale with YaRN's mscale, the indexer), so that the GPU and the
/// oracle share one interpretation; `arch` and `rope_mode` are the spec's.
pub fn config_from(arch: &'static str, rope_mode: &'static str, hp: &MlaModelHparams) -> MlaConfig {
    let m = &hp.moe;
    MlaConfig {
        arch,
        n_embd: hp.n_embd,
        n_head: hp.mla.n_head,
        nope: hp.mla.nope,
        rope: hp.mla.rope,
        v: hp.mla.v,
        kv_lora: hp.mla.kv_lora,
        q_lora: hp.q_lora,
        n_ctx_train: hp.n_ctx_train,
        eps: hp.eps,
        rope_mode,
        freqs: RopeFreqs {
            base: hp.rope.base,
            freq_scale: hp.rope.freq_scale,
            ext_factor: hp.rope.ext_factor,
            corr_low: hp.rope.corr_dims[0],
            corr_high: hp.rope.corr_dims[1],
        },
        kq_scale: hp.kq_scale,
        n_ff: hp.n_ff,
        moe: Some(MlaMoeConfig {
            n_expert: m.n_expert,
            n_used: m.n_expert_used,
            n_ff_exp: m.n_ff_exp,
            n_ff_shexp: m.n_ff_shexp,
            gating: match m.router.gating {
                Gating::Softmax => "softmax",
                Gating::Sigmoid => "sigmoid",
            },
            norm: m.router.norm,
            scale: m.router.scale,
        }),
        indexer: hp.indexer.map(|i| IndexerConfig {
            n_head: i.n_head,
            head_dim: i.head_dim,
            top_k: i.top_k,
            k_norm_eps: INDEXER_K_NORM_EPS,
        }),
    }
}

/// A layer's FFN from the spec's optional tensors: routed experts when the layer has a router
/// (`ffn_gate_inp`), else the dense gated FFN; names the missing tensor otherwise.
pub fn ffn_from<'f>(
    il: usize,
    dense: [Option<TensorInfo<'f>>; 3],
    gate_inp: Option<TensorInfo<'f>>,
    exp_probs_b: Option<TensorInfo<'f>>,
    experts: [Option<TensorInfo<'f>>; 3],
    shared: [Option<TensorInfo<'f>>; 3],
) -> Result<MlaFfnSpec<'f>> {
    let missing = |what: &str| err(format!("layer {il}: blk.{il}.{what}.weight is missing"));
    match gate_inp {
        Some(gate_inp) => {
            let [g, u, d] = experts;
            Ok(MlaFfnSpec::Moe {
                gate_inp,
                exp_probs_b,
                gate_exps: g.ok_or_else(|| missing("ffn_gate_exps"))?,
                up_exps: u.ok_or_else(|| missing("ffn_up_exps"))?,
                down_exps: d.ok_or_else(|| missing("ffn_down_exps"))?,
                shared: match shared {
                    [Some(gate), Some(up), Some(down)] => Some(GluSpec { gate, up, down }),
                    _ => None,
                },
            })
        }
        None => match dense {
            [Some(gate), Some(up), Some(down)] => Ok(MlaFfnSpec::Dense(GluSpec { gate, up, down })),
            _ => Err(missing("ffn_gate / ffn_up / ffn_down (a dense layer)")),
        },
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use memra_codegen::fixture;
    use memra_codegen::spec::ArchSpec;
    use memra_gguf::Gguf;
    use memra_reference::models::MlaModelHparams;

    use super::config_from;

    fn micro(arch: &str) -> Gguf<Vec<u8>> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let spec = ArchSpec::load(&root.join(format!("specs/{arch}.toml"))).unwrap();
        Gguf::parse(fixture::micro_model(&spec, 3).unwrap()).unwrap()
    }

    #[test]
    fn configs_follow_the_files_semantics() {
        let g = config_from(
            "glm-dsa",
            "interleaved",
            &MlaModelHparams::from_gguf(&micro("glm-dsa")).unwrap(),
        );
        assert_eq!(
            (g.n_head, g.nope, g.rope, g.v, g.kv_lora, g.q_lora),
            (4, 32, 16, 32, 128, Some(64))
        );
        assert_eq!(g.freqs.ext_factor, 0.0, "glm-dsa: plain RoPE");
        assert!(
            (g.kq_scale - 1.0 / 48f32.sqrt()).abs() < 1e-7,
            "{}",
            g.kq_scale
        );
        let i = g.indexer.expect("glm-dsa has an indexer");
        assert_eq!((i.n_head, i.head_dim, i.top_k), (8, 32, 4));
        let m = g.moe.as_ref().unwrap();
        assert_eq!(
            (m.gating, m.n_expert, m.n_used, m.n_ff_shexp),
            ("sigmoid", 4, 2, 256)
        );

        let d = config_from(
            "deepseek2",
            "interleaved",
            &MlaModelHparams::from_gguf(&micro("deepseek2")).unwrap(),
        );
        assert_eq!(d.q_lora, None, "V2-Lite: a direct attn_q");
        assert!(d.indexer.is_none());
        assert_eq!(d.freqs.ext_factor, 1.0, "deepseek2 micro: YaRN");
        assert!((d.freqs.freq_scale - 1.0 / 40.0).abs() < 1e-9);
        assert!(
            0.0 < d.freqs.corr_low && d.freqs.corr_low < d.freqs.corr_high,
            "{:?}",
            d.freqs
        );
        // mscale = 1 + 0.0707·ln 40 enters the softmax scale squared (model-specs §6.4).
        let mscale = 1.0 + 0.0707f64 * 40f64.ln();
        let want = (mscale * mscale / 48f64.sqrt()) as f32;
        assert!((d.kq_scale - want).abs() < 1e-5, "{} vs {want}", d.kq_scale);
        assert_eq!(d.moe.as_ref().unwrap().gating, "softmax");
    }
}
