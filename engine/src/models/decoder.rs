//! The GQA decoder stack on the GPU, shared by the architectures whose attention is GQA
//! (gemma3, qwen3, ...): each `<arch>.rs` maps its spec-generated weights and capabilities to a
//! [`DecoderSpec`]; this file uploads it, plans the kernels and runs it.
//!
//! Per layer: `h = attn_norm(x)`, q/k/v projections, QK-norm (per head, full or none) + RoPE
//! fused with the bf16 KV-cache write, attention (split-K decode kernel for one token,
//! tensor-core prefill kernel for many; sliding window per layer), output projection, then the
//! residual add fused with the next pre-norm — with the branch RMS-normalized first for sandwich
//! norms — and the gated FFN likewise. Logits of the last token through the LM head, argmax on
//! the device. A decode step is captured as a CUDA graph and replayed (re-captured only when the
//! attention split counts change, every few hundred positions).
//!
//! Decode steps fuse by default (`GpuOptions::fuse_norm`): each residual add + RMSNorm runs
//! inside the projection after it (norm_matvec: q/k/v, the dense gated FFN, the LM head), the
//! residual alternating between two buffers, and q/k/v go in one launch per run of equal-typed
//! neighbours, their rows stacked in one buffer (`QkvRun`). Prefill and unfused steps run
//! each part with its own matvec / matmul. A decode step's QK-norm + RoPE + KV-cache write runs
//! in its attention launch's prologue (attn_decode_rope, `GpuOptions::fuse_rope`); prefill keeps
//! qk_norm_rope before the tensor-core attention.

use std::path::Path;
use std::time::Instant;

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use memra_gguf::{GgmlType, Gguf, TensorInfo};

use super::{GpuOptions, StepRole};
use super::moe_grouped::{self, GroupedMoe, GroupedScratch};
use super::gpu::{self, DecoderStack, DeviceTensor, KernelPlan, KvCache, Linear, LogitsState, Result, StackState, StepGraph, err, upload_f32};
use crate::cuda::{Gpu, Kernel, Kernels};
use crate::kernels::attn_decode::{self, AttnDecodeParams, SplitRule};
use crate::kernels::attn_decode_rope::{self, AttnDecodeRopeParams, NewTokens};
use crate::kernels::attn_prefill::{self, AttnPrefillParams};
use crate::kernels::qk_norm_rope::{self, QkNormRopeParams};
use crate::kernels::registry::Param;
use crate::kernels::swiglu::GluLayout;
use crate::kernels::moe_matvec::{self, MoeDims, MoeMatvecInputs};
use crate::kernels::norm_matvec::{self, NormMatvecWeights, Residual};
use crate::kernels::{add_rmsnorm, argmax, combine_matvec, embed, geglu, moe_router, rmsnorm, swiglu};

/// Where the norms sit (spec capability `norm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormPlacement {
    /// `x += f(norm(x))`.
    Pre,
    /// `x += post_norm(f(norm(x)))` (gemma3).
    Sandwich,
}

/// The gated activation of the FFN (spec capability `ffn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Glu {
    Swiglu,
    Geglu,
}

impl NormPlacement {
    /// From the spec's `norm` capability token.
    pub fn from_token(token: &str) -> Result<NormPlacement> {
        match token {
            "pre" => Ok(NormPlacement::Pre),
            "sandwich" => Ok(NormPlacement::Sandwich),
            other => Err(err(format!("norm placement `{other}` has no GPU decoder path"))),
        }
    }
}

impl Glu {
    /// From the spec's `ffn` capability token (dense gated FFNs).
    pub fn from_token(token: &str) -> Result<Glu> {
        match token {
            "swiglu" => Ok(Glu::Swiglu),
            "geglu" => Ok(Glu::Geglu),
            other => Err(err(format!("ffn `{other}` has no dense GPU decoder path"))),
        }
    }

    fn family(self) -> &'static str {
        match self {
            Glu::Swiglu => swiglu::FAMILY,
            Glu::Geglu => geglu::FAMILY,
        }
    }

    fn norm_matvec(self) -> norm_matvec::Glu {
        match self {
            Glu::Swiglu => norm_matvec::Glu::Swiglu,
            Glu::Geglu => norm_matvec::Glu::Geglu,
        }
    }
}

/// The embedding multiplier of the spec's `embedding_scale` capability token.
pub fn embed_scale(token: &str, n_embd: usize) -> Result<f32> {
    match token {
        "none" => Ok(1.0),
        "sqrt_n_embd" => Ok((n_embd as f32).sqrt()),
        other => Err(err(format!("embedding scale `{other}` has no GPU decoder path"))),
    }
}

/// The capabilities and scalars a forward needs, from the spec and the file.
#[derive(Clone, Debug)]
pub struct DecoderConfig {
    pub arch: &'static str,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    pub n_ff: usize,
    pub n_ctx_train: usize,
    pub eps: f32,
    /// `per_head`, `full` or `none` (the qk_norm_rope enum token).
    pub qk_norm: &'static str,
    /// `neox` or `interleaved`.
    pub rope_mode: &'static str,
    pub norm: NormPlacement,
    pub glu: Glu,
    /// Multiplies the embedding rows (gemma3: sqrt(n_embd)).
    pub embed_scale: f32,
    /// Softmax scale of q·k.
    pub attn_scale: f32,
    /// The routed-expert FFN, for layers whose spec gives [`FfnSpec::Moe`].
    pub moe: Option<MoeConfig>,
    /// q/k/v neighbours of different types stack in a type all of them are exact in (the spec's
    /// `widen = true`: `<Arch>::WIDEN_STACKS`), re-encoded at load.
    pub widen_qkv: bool,
}

/// Routing of a MoE FFN (spec capability `router` and the expert hparams).
#[derive(Clone, Debug)]
pub struct MoeConfig {
    pub n_expert: usize,
    pub n_used: usize,
    /// Width of one expert's FFN.
    pub n_ff_exp: usize,
    /// `softmax` or `sigmoid` (the moe_router gating token).
    pub gating: &'static str,
    /// Renormalize the selected weights to sum 1.
    pub norm: bool,
    /// Multiplies the weights (1 = none).
    pub scale: f32,
}

/// The FFN of one layer in the file.
pub enum FfnSpec<'f> {
    /// `down(act(gate h) ⊙ up h)` with the config's GLU.
    Dense { ffn_gate: TensorInfo<'f>, ffn_up: TensorInfo<'f>, ffn_down: TensorInfo<'f> },
    /// Router logits, then the selected experts' SwiGLU FFNs, weighted and summed.
    Moe {
        ffn_gate_inp: TensorInfo<'f>,
        ffn_gate_exps: TensorInfo<'f>,
        ffn_up_exps: TensorInfo<'f>,
        ffn_down_exps: TensorInfo<'f>,
    },
}

/// One layer's tensors in the file plus its RoPE and window.
pub struct LayerSpec<'f> {
    pub attn_norm: TensorInfo<'f>,
    pub attn_q: TensorInfo<'f>,
    pub attn_k: TensorInfo<'f>,
    pub attn_v: TensorInfo<'f>,
    /// QK-norm weights (`[head_dim]` per head or the full width), absent for `none`.
    pub attn_q_norm: Option<TensorInfo<'f>>,
    pub attn_k_norm: Option<TensorInfo<'f>>,
    pub attn_output: TensorInfo<'f>,
    /// Sandwich norms only.
    pub post_attention_norm: Option<TensorInfo<'f>>,
    pub ffn_norm: TensorInfo<'f>,
    pub ffn: FfnSpec<'f>,
    pub post_ffw_norm: Option<TensorInfo<'f>>,
    pub rope_base: f32,
    /// Linear RoPE scaling as 1/factor.
    pub rope_scale: f32,
    pub window: Option<usize>,
}

/// Everything an architecture file hands over.
pub struct DecoderSpec<'f> {
    pub config: DecoderConfig,
    pub layers: Vec<LayerSpec<'f>>,
    pub token_embd: TensorInfo<'f>,
    pub output_norm: TensorInfo<'f>,
    /// Untied LM head; `None` = logits through `token_embd`.
    pub output: Option<TensorInfo<'f>>,
}

/// A combine_matvec variant and the most splits it combines: decode steps with more leave the
/// combine to the attention's last block.
struct Combine {
    kernel: &'static str,
    /// The variant's `max_splits`, read once its module is loaded (0 until then).
    max_splits: usize,
}

struct Layer {
    attn_norm: CudaSlice<f32>,
    /// q, k and v, stacked by runs of equal type.
    qkv: Vec<QkvRun>,
    qk_norm: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    attn_output: Linear,
    /// The o-projection's combine_matvec variant (`GpuOptions::fuse_combine`).
    combine: Option<Combine>,
    post_attention_norm: Option<CudaSlice<f32>>,
    ffn_norm: CudaSlice<f32>,
    ffn: Ffn,
    post_ffw_norm: Option<CudaSlice<f32>>,
    rope_base: f32,
    rope_scale: f32,
    window: Option<usize>,
    /// Decode steps with the residual add + norm fused into the projections after it
    /// (`GpuOptions::fuse_norm`); `None` runs add_rmsnorm launches.
    norm_fused: Option<NormFused>,
}

/// A layer's decode step with fused norms: q/k/v through each run's norm_matvec
/// ([`QkvRun::norm`]), and this norm_matvec for the dense gated FFN (`None` for MoE FFNs or
/// gate/up of different types: their norm stays a launch of its own).
struct NormFused {
    ffn: Option<&'static str>,
}

/// A run of a layer's q, k, v projections with one type and row length (neighbours in that
/// order, `memra_codegen::plan::stack_runs`, as the specs' `stack = true` entries plan them):
/// their rows in one buffer, so a fused decode step projects the run in one launch into the
/// adjacent q | k | v rows of `Bufs::qkv`. Prefill and unfused steps project each part alone.
struct QkvRun {
    w: DeviceTensor,
    parts: Vec<QkvPart>,
    /// The norm_matvec variant over the whole run (fused decode steps).
    norm: Option<&'static str>,
}

struct QkvPart {
    /// 0 = q, 1 = k, 2 = v.
    which: usize,
    name: String,
    n: usize,
    /// First byte in the run's buffer (16-byte aligned).
    offset: usize,
    bytes: usize,
    /// (matvec, matmul) variants.
    variants: (&'static str, &'static str),
}

enum Ffn {
    /// `fused`: the expert kernel in `geglu`/`swiglu` mode over this one "expert" (gate and up in
    /// one launch with the activation), for decode steps; `None` when the build has no such
    /// variant or gate and up differ in type (three launches then).
    Dense { gate: Linear, up: Linear, down: Linear, fused: Option<&'static str> },
    Moe {
        router: Linear,
        /// Stacked experts `[n_expert][rows][k]` in their GGUF type, with their variants.
        gate: DeviceTensor,
        up: DeviceTensor,
        down: DeviceTensor,
        swiglu: &'static str,
        down_kernel: &'static str,
        /// Expert-grouped prefill (moe_grouped.rs); `None` runs moe_matvec for every chunk.
        grouped: Option<GroupedMoe>,
    },
}

/// Variant names of the non-linear kernels.
struct Names {
    embed: &'static str,
    rmsnorm: &'static str,
    add_rmsnorm: &'static str,
    qk_norm_rope: &'static str,
    attn_decode: &'static str,
    /// Decode steps' attention with QK-norm + RoPE + KV write in its prologue
    /// (`GpuOptions::fuse_rope`); `None` runs qk_norm_rope then attn_decode.
    attn_decode_rope: Option<&'static str>,
    attn_prefill: &'static str,
    glu: &'static str,
    argmax: &'static str,
    /// Present when some layer is MoE.
    moe_router: Option<&'static str>,
}

/// What a forward reads: weights, kernels, dims.
struct Net {
    cfg: DecoderConfig,
    layers: Vec<Layer>,
    /// The embedding table when the LM head is untied (else `lm_head.w` is the table).
    token_embd: Option<DeviceTensor>,
    lm_head: Linear,
    output_norm: CudaSlice<f32>,
    kernels: Kernels,
    names: Names,
    sm_count: usize,
    /// How decode steps split their attention: the decode attention variant's rule.
    split_rule: SplitRule,
    /// One expert id 0: the fused dense FFN runs the expert kernel on a single "expert".
    zero_id: CudaSlice<i32>,
    /// The LM head's norm_matvec variant when decode steps fuse the norms.
    lm_head_norm: Option<&'static str>,
    /// Launches left out of decode steps ([`GpuOptions::omit`]: timing only).
    omit: Option<StepRole>,
}

/// What a forward writes besides the activations: the KV cache and the last logits.
type State = StackState<KvCache>;

/// Activations for a number of tokens.
struct Bufs {
    tokens: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    x: CudaSlice<f32>,
    /// The residual's second buffer: a fused decode step's norm_matvec reads one and writes the
    /// other (its blocks all read x while one writes the sum).
    x_alt: CudaSlice<f32>,
    h: CudaSlice<f32>,
    /// q `[t, n_head·hd]`, then k and v `[t, n_kv·hd]` each: for one token the rows of q, k and
    /// v are adjacent, as a stacked run's launch writes them.
    qkv: CudaSlice<f32>,
    att: CudaSlice<f32>,
    o: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    ff: CudaSlice<f32>,
    work: CudaSlice<f32>,
    /// MoE routing: logits `[t, n_expert]`, selected ids and weights `[t, n_used]`.
    router: CudaSlice<f32>,
    ids: CudaSlice<i32>,
    wts: CudaSlice<f32>,
    /// Expert-grouped MoE scratch, for prefill chunks that run grouped.
    grouped: Option<GroupedScratch>,
}

/// A GQA decoder model loaded on the GPU.
pub struct Decoder {
    net: Net,
    state: State,
    /// Decode activations (one token), reused by every step and the captured graph.
    step: Bufs,
    /// The captured decode step, keyed by the split counts it was captured with.
    graph: StepGraph<Vec<usize>>,
}

impl Decoder {
    pub fn load<B: AsRef<[u8]>>(path: &Path, file: &Gguf<B>, spec: DecoderSpec<'_>, opts: &GpuOptions) -> Result<Decoder> {
        let start = Instant::now();
        let cfg = spec.config;
        let (e, n_head, n_kv, hd) = (cfg.n_embd, cfg.n_head, cfg.n_kv, cfg.head_dim);
        let max_ctx = opts.max_ctx.unwrap_or(cfg.n_ctx_train).min(cfg.n_ctx_train).max(1);

        let gpu = Gpu::new(opts.device)?;
        let sm_count = gpu.sm_count()?;
        let mut plan = KernelPlan::new(opts.policy);
        let mut bytes = 0usize;
        let mut upload = |t: &TensorInfo<'_>| -> Result<DeviceTensor> {
            let d = DeviceTensor::upload(&gpu, file, t)?;
            bytes += d.bytes();
            Ok(d)
        };
        let f32s = |t: &TensorInfo<'_>| upload_f32(&gpu, file, t);
        let mut layers = Vec::with_capacity(spec.layers.len());
        // Bytes of the stacked q/k/v buffers (uploaded beside `upload`).
        let mut stacked = 0usize;
        for l in &spec.layers {
            let mut lin = |t: &TensorInfo<'_>| -> Result<Linear> { plan.linear(upload(t)?) };
            let attn_output = lin(&l.attn_output)?;
            let ffn = match &l.ffn {
                FfnSpec::Dense { ffn_gate, ffn_up, ffn_down } => {
                    let (gate, up, down) = (lin(ffn_gate)?, lin(ffn_up)?, lin(ffn_down)?);
                    let fused = if gate.w.ty == up.w.ty && opts.fuse_ffn {
                        let mode = match cfg.glu {
                            Glu::Swiglu => "swiglu",
                            Glu::Geglu => "geglu",
                        };
                        gpu::qtype_token(moe_matvec::FAMILY, gate.w.ty).ok().and_then(|q| {
                            let req = [("k", Param::Int(gate.w.k as i64)), ("n", Param::Int(gate.w.n as i64)), ("qtype", Param::Sym(q)), ("mode", Param::Sym(mode))];
                            plan.want_f32_x(moe_matvec::FAMILY, &req).ok()
                        })
                    } else {
                        None
                    };
                    Ffn::Dense { gate, up, down, fused }
                }
                FfnSpec::Moe { ffn_gate_inp, ffn_gate_exps, ffn_up_exps, ffn_down_exps } => {
                    let router = lin(ffn_gate_inp)?;
                    let (gate, up, down) = (upload(ffn_gate_exps)?, upload(ffn_up_exps)?, upload(ffn_down_exps)?);
                    let moe = cfg.moe.as_ref().ok_or_else(|| err(format!("{}: MoE tensors but no MoE config", ffn_gate_exps.name)))?;
                    let want = |plan: &mut KernelPlan, t: &DeviceTensor, rows: usize, mode: &'static str| -> Result<&'static str> {
                        let qtype = gpu::qtype_token(moe_matvec::FAMILY, t.ty).map_err(|e| err(format!("tensor '{}': {e}", t.name)))?;
                        let req = [("k", Param::Int(t.k as i64)), ("n", Param::Int(rows as i64)), ("qtype", Param::Sym(qtype)), ("mode", Param::Sym(mode))];
                        plan.want_f32_x(moe_matvec::FAMILY, &req).map_err(|e| err(format!("tensor '{}': {e}", t.name)))
                    };
                    if up.ty != gate.ty {
                        return Err(err(format!("{}: {} and {} differ in type; the fused gate/up kernel needs one", path.display(), gate.name, up.name)));
                    }
                    let swiglu = want(&mut plan, &gate, moe.n_ff_exp, "swiglu")?;
                    let down_kernel = want(&mut plan, &down, e, "down")?;
                    let grouped = GroupedMoe::plan(&mut plan, &gate, &up, &down, moe.n_expert, moe.n_ff_exp);
                    Ffn::Moe { router, gate, up, down, swiglu, down_kernel, grouped }
                }
            };
            let combine = match opts.fuse_combine {
                true => Some(Combine { kernel: plan_combine(&mut plan, &attn_output.w, hd)?, max_splits: 0 }),
                false => None,
            };
            let mut qkv = Vec::new();
            for (run, ty) in qkv_runs(&[l.attn_q, l.attn_k, l.attn_v], cfg.widen_qkv) {
                let infos: Vec<TensorInfo<'_>> = run.iter().map(|&(_, t)| t).collect();
                let (w, offsets) = DeviceTensor::upload_stacked(&gpu, file, &infos, ty)?;
                stacked += w.bytes();
                let mut parts = Vec::new();
                for (i, ((which, t), offset)) in run.into_iter().zip(offsets.iter().copied()).enumerate() {
                    let (k, n) = (t.row_len() as usize, t.n_rows() as usize);
                    // Prefill and unfused steps project the part from the run's buffer, in its type.
                    let variants = plan.projection(t.name, ty, k, n)?;
                    let end = offsets.get(i + 1).copied().unwrap_or(w.bytes());
                    parts.push(QkvPart { which, name: t.name.to_string(), n, offset, bytes: end - offset, variants });
                }
                let norm = if opts.fuse_norm { Some(plan.norm_matvec(&w, norm_matvec::Glu::None)?) } else { None };
                qkv.push(QkvRun { w, parts, norm });
            }
            let norm_fused = if opts.fuse_norm {
                let ffn = match &ffn {
                    Ffn::Dense { gate, up, .. } if gate.w.ty == up.w.ty => Some(plan.norm_matvec(&gate.w, cfg.glu.norm_matvec())?),
                    _ => None,
                };
                Some(NormFused { ffn })
            } else {
                None
            };
            let qk_norm = match (&l.attn_q_norm, &l.attn_k_norm) {
                (Some(q), Some(k)) => Some((f32s(q)?, f32s(k)?)),
                _ => None,
            };
            layers.push(Layer {
                attn_norm: f32s(&l.attn_norm)?,
                qkv,
                qk_norm,
                attn_output,
                combine,
                post_attention_norm: l.post_attention_norm.as_ref().map(f32s).transpose()?,
                ffn_norm: f32s(&l.ffn_norm)?,
                ffn,
                post_ffw_norm: l.post_ffw_norm.as_ref().map(f32s).transpose()?,
                rope_base: l.rope_base,
                rope_scale: l.rope_scale,
                window: l.window,
                norm_fused,
            });
        }
        let embd = upload(&spec.token_embd)?;
        let embd_qtype = gpu::qtype_token(embed::FAMILY, embd.ty).map_err(|e| err(format!("token_embd.weight: {e}")))?;
        let n_vocab = embd.n;
        let (token_embd, lm_head) = match &spec.output {
            Some(out) => (Some(embd), plan.linear(upload(out)?)?),
            None => (None, plan.linear(embd)?),
        };
        if lm_head.w.n != n_vocab {
            return Err(err(format!("{}: output.weight has {} rows, token_embd.weight {n_vocab}", path.display(), lm_head.w.n)));
        }
        let output_norm = f32s(&spec.output_norm)?;
        let bytes = bytes + stacked;
        let lm_head_norm = if opts.fuse_norm { Some(plan.norm_matvec(&lm_head.w, norm_matvec::Glu::None)?) } else { None };

        let int = |v: usize| Param::Int(v as i64);
        let sandwich = cfg.norm == NormPlacement::Sandwich;
        let attn_dims = [("head_dim", int(hd)), ("n_head", int(n_head)), ("n_kv", int(n_kv)), ("cache_t", Param::Sym("bf16"))];
        // qk_norm_rope's and attn_decode_rope's request: the attention's dims and the RoPE / QK-norm.
        let rope_req = [attn_dims.as_slice(), &[("n_rot", int(cfg.n_rot)), ("rope_mode", Param::Sym(cfg.rope_mode)), ("qk_norm", Param::Sym(cfg.qk_norm))]].concat();
        let names = Names {
            embed: plan.want(embed::FAMILY, &[("n_embd", int(e)), ("qtype", Param::Sym(embd_qtype))])?,
            rmsnorm: plan.want(rmsnorm::FAMILY, &[("n", int(e))])?,
            add_rmsnorm: plan.want(add_rmsnorm::FAMILY, &[("n", int(e)), ("delta_norm", Param::Int(sandwich as i64))])?,
            qk_norm_rope: plan.want(qk_norm_rope::FAMILY, &rope_req)?,
            attn_decode: plan.want(attn_decode::FAMILY, &attn_dims)?,
            attn_decode_rope: match opts.fuse_rope {
                true => Some(plan.want(attn_decode_rope::FAMILY, &rope_req)?),
                false => None,
            },
            attn_prefill: plan.want(attn_prefill::FAMILY, &attn_dims)?,
            glu: plan.want(cfg.glu.family(), &[("n_ff", int(cfg.n_ff))])?,
            argmax: plan.want(argmax::FAMILY, &[("n_vocab", int(n_vocab))])?,
            moe_router: match &cfg.moe {
                Some(m) => Some(plan.want(
                    moe_router::FAMILY,
                    &[("n_expert", int(m.n_expert)), ("n_used", int(m.n_used)), ("gating", Param::Sym(m.gating))],
                )?),
                None => None,
            },
        };
        let mut report = vec![format!(
            "{}: {}, {} layers, n_embd {e}, {n_head} q / {n_kv} kv heads × {hd}, vocab {n_vocab}; weights {} on {}",
            path.display(),
            cfg.arch,
            layers.len(),
            gpu::mib(bytes),
            gpu.name()
        )];
        report.extend(plan.report());
        let compile = Instant::now();
        let kernels = plan.load(&gpu)?;
        for c in layers.iter_mut().filter_map(|l| l.combine.as_mut()) {
            c.max_splits = combine_matvec::max_splits(kernels.get(c.kernel)?)?;
        }
        report.push(format!("kernels ready in {:.2} s", compile.elapsed().as_secs_f64()));
        let cache = KvCache::new(&gpu, layers.len(), max_ctx, n_kv, hd)?;
        report.push(format!("KV cache: {max_ctx} positions, bf16, {}", gpu::mib(cache.bytes())));

        let split_rule = SplitRule::of(kernels.get(names.attn_decode_rope.unwrap_or(names.attn_decode))?)?;
        let max_split = split_rule.splits(max_ctx.next_power_of_two(), 1, n_head, n_kv, sm_count).max(2);
        let step = Bufs::new(&gpu, &cfg, 1, layers.len(), max_split)?;
        let out = LogitsState::new(&gpu, kernels.get(names.argmax)?, n_vocab, max_ctx)?;
        let zero_id = gpu::alloc(&gpu, 1, "expert id")?;
        let n_ctx_train = cfg.n_ctx_train;
        if let Some(role) = opts.omit {
            // Every role must be one set of launches of the fused decode step.
            let fused = lm_head_norm.is_some() && names.attn_decode_rope.is_some() && opts.graphs;
            let dense = layers.iter().all(|l| matches!((&l.ffn, &l.norm_fused), (Ffn::Dense { .. }, Some(NormFused { ffn: Some(_) }))));
            if !(fused && dense) {
                return Err(err(format!(
                    "{}: leaving out the {} launches needs the fused decode step of a dense model (norm and RoPE fusion and graphs on)",
                    path.display(),
                    role.label()
                )));
            }
        }
        let net = Net { cfg, layers, token_embd, lm_head, output_norm, kernels, names, sm_count, split_rule, zero_id, lm_head_norm, omit: opts.omit };
        report.push(format!("loaded in {:.2} s", start.elapsed().as_secs_f64()));
        let state = State { gpu, cache, out, len: 0, max_ctx, n_ctx_train, n_vocab, weight_bytes: bytes, report };
        Ok(Decoder { net, state, step, graph: StepGraph::new(opts.graphs, opts.pdl) })
    }
}

impl Net {
    /// Whether decode steps launch `role`'s kernels ([`GpuOptions::omit`] leaves one out).
    fn runs(&self, role: StepRole) -> bool {
        self.omit != Some(role)
    }

    fn n_vocab(&self) -> usize {
        self.lm_head.w.n
    }

    fn embd_table(&self) -> &DeviceTensor {
        self.token_embd.as_ref().unwrap_or(&self.lm_head.w)
    }

    /// The attention split count per layer for keys up to `len`.
    fn splits(&self, len: usize) -> Result<Vec<usize>> {
        let c = &self.cfg;
        Ok(self
            .layers
            .iter()
            .map(|l| {
                // Split for the next power of two of the visible keys: the count then changes
                // (and a captured decode graph is re-captured) only log2(context) times.
                let visible = l.window.map_or(len, |w| w.min(len)).max(1).next_power_of_two();
                self.split_rule.splits(visible, 1, c.n_head, c.n_kv, self.sm_count)
            })
            .collect())
    }

    /// Enqueues the forward of `t` tokens (ids and positions `pos0..pos0+t` already in `bufs`),
    /// leaving the last token's logits in `state.logits` and its argmax in `state.best_idx`.
    fn enqueue(&self, state: &mut State, bufs: &mut Bufs, t: usize, pos0: usize, splits: &[usize]) -> Result<()> {
        if t == 1 && self.lm_head_norm.is_some() {
            return self.enqueue_decode_fused(state, bufs, pos0, splits);
        }
        let c = &self.cfg;
        let (e, eps) = (c.n_embd, c.eps);
        let k = &self.kernels;
        self.embed(bufs, t)?;
        let Bufs { x, h, .. } = &mut *bufs;
        rmsnorm::rmsnorm(k.get(self.names.rmsnorm)?, &x.slice(..t * e), &self.layers[0].attn_norm.slice(..), &mut h.slice_mut(..t * e), t, e, eps)?;
        for (il, l) in self.layers.iter().enumerate() {
            self.project_qkv(bufs, l, t)?;
            self.attention(state, bufs, l, il, t, pos0, splits[il])?;
            let Bufs { x, h, o, .. } = &mut *bufs;
            self.add_norm(x, o, l.post_attention_norm.as_ref(), &l.ffn_norm, h, t)?;
            self.ffn(state, bufs, l, t)?;
            let Bufs { x, h, o, .. } = &mut *bufs;
            let next_norm = self.layers.get(il + 1).map_or(&self.output_norm, |n| &n.attn_norm);
            self.add_norm(x, o, l.post_ffw_norm.as_ref(), next_norm, h, t)?;
        }
        let last = (t - 1) * e;
        self.lm_head.forward(k, &bufs.h.slice(last..last + e), &mut state.out.logits.slice_mut(..), 1)?;
        let feed = (t == 1).then_some((&mut bufs.tokens, &mut bufs.pos));
        state.out.enqueue_argmax(k.get(self.names.argmax)?, feed)
    }

    /// A decode step with each residual add + RMSNorm fused into the projection after it
    /// (norm_matvec): the residual alternates between `x` and `x_alt`, the launch that first
    /// reads an owed add writing the sum into the other buffer. Norms before a MoE FFN (its
    /// router and experts read `h`) stay add_rmsnorm launches.
    fn enqueue_decode_fused(&self, state: &mut State, bufs: &mut Bufs, pos0: usize, splits: &[usize]) -> Result<()> {
        let c = &self.cfg;
        let (e, qd, kvd, n_ff, eps) = (c.n_embd, c.n_head * c.head_dim, c.n_kv * c.head_dim, c.n_ff, c.eps);
        let k = &self.kernels;
        self.embed(bufs, 1)?;
        // The residual is in x (cur = 0) or x_alt (1); `owed` = Some(post-norm): x += post(o)
        // is still to be applied (None inside: o is added as it is).
        let mut cur = 0;
        let mut owed: Option<Option<&CudaSlice<f32>>> = None;
        for (il, l) in self.layers.iter().enumerate() {
            match &l.norm_fused {
                Some(_) => {
                    let Bufs { x, x_alt, o, qkv, .. } = &mut *bufs;
                    let (res, res_next) = residuals(x, x_alt, cur);
                    let ov = o.slice(..e);
                    let post = owed.map(|p| p.map(|w| w.slice(..)));
                    let add = owed.map(|_| Residual { delta: &ov, delta_w: post.as_ref().and_then(|p| p.as_ref()) });
                    let mut next = res_next.slice_mut(..e);
                    for (i, run) in l.qkv.iter().enumerate() {
                        let name = run.norm.expect("fused layers plan every run's norm_matvec");
                        let wv = run.w.data.slice(..);
                        let weights = NormMatvecWeights { w: &wv, w_up: None };
                        // The first launch writes the new residual; the others read the old one.
                        let x_out = if i == 0 && add.is_some() { Some(&mut next) } else { None };
                        let at = qkv_offset(run.parts[0].which, 1, qd, kvd);
                        if self.runs(StepRole::Qkv) {
                            norm_matvec::norm_matvec(k.get(name)?, &weights, &res.slice(..e), add, &l.attn_norm.slice(..), x_out, &mut qkv.slice_mut(at..at + run.w.n), e, run.w.n, eps)
                                .map_err(|er| err(format!("tensor '{}': {er}", run.w.name)))?;
                        }
                    }
                    if add.is_some() {
                        cur ^= 1;
                    }
                }
                None => {
                    self.settle(bufs, cur, owed, &l.attn_norm)?;
                    self.project_qkv(bufs, l, 1)?;
                }
            }
            self.attention(state, bufs, l, il, 1, pos0, splits[il])?;
            let post_attn = Some(l.post_attention_norm.as_ref());
            match (&l.ffn, l.norm_fused.as_ref().and_then(|nf| nf.ffn)) {
                (Ffn::Dense { gate, up, down, .. }, Some(name)) => {
                    let Bufs { x, x_alt, o, ff, .. } = &mut *bufs;
                    let (res, res_next) = residuals(x, x_alt, cur);
                    let (gv, uv, ov) = (gate.w.data.slice(..), up.w.data.slice(..), o.slice(..e));
                    let pw = l.post_attention_norm.as_ref().map(|w| w.slice(..));
                    let add = Residual { delta: &ov, delta_w: pw.as_ref() };
                    let weights = NormMatvecWeights { w: &gv, w_up: Some(&uv) };
                    if self.runs(StepRole::GateUp) {
                        norm_matvec::norm_matvec(k.get(name)?, &weights, &res.slice(..e), Some(add), &l.ffn_norm.slice(..), Some(&mut res_next.slice_mut(..e)), &mut ff.slice_mut(..n_ff), e, n_ff, eps)
                            .map_err(|er| err(format!("tensor '{}': {er}", gate.w.name)))?;
                    }
                    cur ^= 1;
                    if self.runs(StepRole::Down) {
                        down.forward(k, &ff.slice(..n_ff), &mut o.slice_mut(..e), 1)?;
                    }
                }
                _ => {
                    self.settle(bufs, cur, post_attn, &l.ffn_norm)?;
                    self.ffn(state, bufs, l, 1)?;
                }
            }
            owed = Some(l.post_ffw_norm.as_ref());
        }
        let name = self.lm_head_norm.expect("checked by enqueue");
        let Bufs { x, x_alt, o, .. } = &mut *bufs;
        let (res, _) = residuals(x, x_alt, cur);
        let (wv, ov) = (self.lm_head.w.data.slice(..), o.slice(..e));
        let post = owed.flatten().map(|w| w.slice(..));
        let add = owed.map(|_| Residual { delta: &ov, delta_w: post.as_ref() });
        let n_vocab = self.n_vocab();
        if self.runs(StepRole::LmHead) {
            norm_matvec::norm_matvec(k.get(name)?, &NormMatvecWeights { w: &wv, w_up: None }, &res.slice(..e), add, &self.output_norm.slice(..), None, &mut state.out.logits.slice_mut(..), e, n_vocab, eps)
                .map_err(|er| err(format!("tensor '{}': {er}", self.lm_head.w.name)))?;
        }
        if self.runs(StepRole::Argmax) {
            state.out.enqueue_argmax(k.get(self.names.argmax)?, Some((&mut bufs.tokens, &mut bufs.pos)))?;
        }
        Ok(())
    }

    /// q, k and v of `t` rows of `h`, each part of each run on its own (prefill, unfused steps).
    fn project_qkv(&self, bufs: &mut Bufs, l: &Layer, t: usize) -> Result<()> {
        let c = &self.cfg;
        let (e, qd, kvd) = (c.n_embd, c.n_head * c.head_dim, c.n_kv * c.head_dim);
        let Bufs { h, qkv, .. } = &mut *bufs;
        for run in &l.qkv {
            for p in &run.parts {
                let at = qkv_offset(p.which, t, qd, kvd);
                let w = run.w.data.slice(p.offset..p.offset + p.bytes);
                gpu::project(&self.kernels, p.variants, &p.name, &w, e, p.n, &h.slice(..t * e), &mut qkv.slice_mut(at..at + t * p.n), t)?;
            }
        }
        Ok(())
    }

    /// Token embeddings of `bufs.tokens[..t]` into `bufs.x`.
    fn embed(&self, bufs: &mut Bufs, t: usize) -> Result<()> {
        let (e, n_vocab) = (self.cfg.n_embd, self.n_vocab());
        let table = self.embd_table();
        embed::embed(self.kernels.get(self.names.embed)?, &bufs.tokens.slice(..t), &table.data.slice(..), &mut bufs.x.slice_mut(..t * e), t, e, n_vocab, self.cfg.embed_scale)
            .map_err(Into::into)
    }

    /// `x += post(o)` (post-norm when given), then `h = norm(x)·norm_w`, for `t` rows.
    fn add_norm(&self, x: &mut CudaSlice<f32>, o: &CudaSlice<f32>, post: Option<&CudaSlice<f32>>, norm_w: &CudaSlice<f32>, h: &mut CudaSlice<f32>, t: usize) -> Result<()> {
        let e = self.cfg.n_embd;
        add_rmsnorm::add_rmsnorm(
            self.kernels.get(self.names.add_rmsnorm)?,
            &mut x.slice_mut(..t * e),
            &o.slice(..t * e),
            post.map(|w| w.slice(..)).as_ref(),
            &norm_w.slice(..),
            &mut h.slice_mut(..t * e),
            t,
            e,
            self.cfg.eps,
        )?;
        Ok(())
    }

    /// A fused decode step's norm as a launch of its own (before a MoE FFN or an unfused
    /// layer): the owed add into the current residual buffer, then `h = norm(x)·norm_w`.
    fn settle(&self, bufs: &mut Bufs, cur: usize, owed: Option<Option<&CudaSlice<f32>>>, norm_w: &CudaSlice<f32>) -> Result<()> {
        let (e, eps) = (self.cfg.n_embd, self.cfg.eps);
        let Bufs { x, x_alt, o, h, .. } = &mut *bufs;
        let res = if cur == 0 { x } else { x_alt };
        match owed {
            Some(post) => self.add_norm(res, o, post, norm_w, h, 1),
            None => Ok(rmsnorm::rmsnorm(self.kernels.get(self.names.rmsnorm)?, &res.slice(..e), &norm_w.slice(..), &mut h.slice_mut(..e), 1, e, eps)?),
        }
    }

    /// QK-norm + RoPE + the KV-cache write of `q`, `k`, `v`, attention over the cache, and the
    /// output projection into `o`, for `t` tokens. A decode step with few enough splits leaves
    /// them to the projection (combine_matvec) instead of the attention's last block.
    #[allow(clippy::too_many_arguments)]
    fn attention(&self, state: &mut State, bufs: &mut Bufs, l: &Layer, il: usize, t: usize, pos0: usize, n_split: usize) -> Result<()> {
        let c = &self.cfg;
        let (e, hd, eps) = (c.n_embd, c.head_dim, c.eps);
        let (qd, kvd) = (c.n_head * hd, c.n_kv * hd);
        let k = &self.kernels;
        let combine = match &l.combine {
            Some(c) if t == 1 && n_split <= c.max_splits => Some(k.get(c.kernel)?),
            _ => None,
        };
        if let (1, Some(name)) = (t, self.names.attn_decode_rope) {
            if self.runs(StepRole::Attention) {
                self.attend_step(k.get(name)?, state, bufs, l, il, n_split, combine.is_some())?;
            }
        } else {
            let Bufs { pos, qkv, att, work, .. } = &mut *bufs;
            let (mut q, mut kv) = qkv.split_at_mut(t * qd);
            let (mut kb, v) = kv.split_at_mut(t * kvd);
            let mut p = QkNormRopeParams::packed(t, hd, c.n_head, c.n_kv, c.n_rot, state.cache.max_ctx, l.rope_base, eps);
            p.freq_scale = l.rope_scale;
            let norm_w = l.qk_norm.as_ref().map(|(qw, kw)| (qw.slice(..), kw.slice(..)));
            qk_norm_rope::qk_norm_rope(
                k.get(self.names.qk_norm_rope)?,
                &mut q,
                &mut kb,
                &v.slice(..t * kvd),
                norm_w.as_ref().map(|(a, b)| (a, b)),
                &pos.slice(..t),
                &mut state.cache.k[il].slice_mut(..),
                &mut state.cache.v[il].slice_mut(..),
                &p,
            )?;
            let att = if combine.is_some() { None } else { Some(att) };
            self.attend(&state.cache, l, il, &q.slice(..), pos, att, work, t, pos0, n_split)?;
        }
        if !self.runs(StepRole::OutProj) {
            return Ok(());
        }
        let Bufs { att, o, work, .. } = &mut *bufs;
        match combine {
            Some(kernel) => {
                let (w, work) = (l.attn_output.w.data.slice(..), self.layer_work(work, il));
                Ok(combine_matvec::combine_matvec(kernel, &w, &work.slice(..), &mut o.slice_mut(..e), qd, e, hd, n_split)?)
            }
            None => l.attn_output.forward(k, &att.slice(..t * qd), &mut o.slice_mut(..t * e), t),
        }
    }

    /// The FFN of `t` rows of `h` into `o`.
    fn ffn(&self, state: &mut State, bufs: &mut Bufs, l: &Layer, t: usize) -> Result<()> {
        let c = &self.cfg;
        let (e, n_ff) = (c.n_embd, c.n_ff);
        let k = &self.kernels;
        let Bufs { h, o, gate, up, ff, router, ids, wts, grouped: grouped_scratch, .. } = &mut *bufs;
        match &l.ffn {
            Ffn::Dense { gate: wg, up: wu, down: wd, fused: Some(fused) } if t == 1 => {
                let (gv, uv, id0, hv) = (wg.w.data.slice(..), wu.w.data.slice(..), self.zero_id.slice(..), h.slice(..e));
                let inp = MoeMatvecInputs { w: &gv, w_up: Some(&uv), ids: &id0, weights: None, x: &hv };
                let dims = MoeDims { k: e, n: n_ff, n_tokens: 1, n_used: 1, n_expert: 1, ldx: e, ldy: n_ff };
                moe_matvec::moe_matvec(k.get(fused)?, &inp, &mut ff.slice_mut(..n_ff), dims)?;
                wd.forward(k, &ff.slice(..n_ff), &mut o.slice_mut(..e), 1)?;
            }
            Ffn::Dense { gate: wg, up: wu, down: wd, .. } => {
                wg.forward(k, &h.slice(..t * e), &mut gate.slice_mut(..t * n_ff), t)?;
                wu.forward(k, &h.slice(..t * e), &mut up.slice_mut(..t * n_ff), t)?;
                let glu = match c.glu {
                    Glu::Swiglu => swiglu::swiglu,
                    Glu::Geglu => geglu::geglu,
                };
                glu(k.get(self.names.glu)?, &gate.slice(..t * n_ff), &up.slice(..t * n_ff), &mut ff.slice_mut(..t * n_ff), t, n_ff, GluLayout::separate(n_ff))?;
                wd.forward(k, &ff.slice(..t * n_ff), &mut o.slice_mut(..t * e), t)?;
            }
            Ffn::Moe { router: wr, gate: wg, up: wu, down: wd, swiglu, down_kernel, grouped } => {
                let m = c.moe.as_ref().expect("MoE layers have a MoE config (checked at load)");
                let (ne, nu, nf) = (m.n_expert, m.n_used, m.n_ff_exp);
                wr.forward(k, &h.slice(..t * e), &mut router.slice_mut(..t * ne), t)?;
                let name = self.names.moe_router.expect("planned with the MoE config");
                moe_router::moe_router(k.get(name)?, &router.slice(..t * ne), None, &mut ids.slice_mut(..t * nu), &mut wts.slice_mut(..t * nu), t, ne, nu, m.norm, m.scale)?;
                if let (Some(gm), Some(scratch)) = (grouped, grouped_scratch.as_mut()) {
                    let (hv, ids_v, wts_v) = (h.slice(..t * e), ids.slice(..t * nu), wts.slice(..t * nu));
                    gm.forward(&state.gpu, k, (wg, wu, wd), scratch, &hv, &ids_v, &wts_v, &mut o.slice_mut(..t * e), t, nu, ne)?;
                } else {
                    let (gv, uv, ids_v, wts_v) = (wg.data.slice(..), wu.data.slice(..), ids.slice(..t * nu), wts.slice(..t * nu));
                    let hv = h.slice(..t * e);
                    let inp = MoeMatvecInputs { w: &gv, w_up: Some(&uv), ids: &ids_v, weights: None, x: &hv };
                    let dims = MoeDims { k: e, n: nf, n_tokens: t, n_used: nu, n_expert: ne, ldx: e, ldy: nf };
                    moe_matvec::moe_matvec(k.get(swiglu)?, &inp, &mut ff.slice_mut(..t * nu * nf), dims)?;
                    let (dv, ffv) = (wd.data.slice(..), ff.slice(..t * nu * nf));
                    let inp = MoeMatvecInputs { w: &dv, w_up: None, ids: &ids_v, weights: Some(&wts_v), x: &ffv };
                    let dims = MoeDims { k: nf, n: e, n_tokens: t, n_used: nu, n_expert: ne, ldx: nf, ldy: e };
                    moe_matvec::moe_matvec(k.get(down_kernel)?, &inp, &mut o.slice_mut(..t * e), dims)?;
                }
            }
        }
        Ok(())
    }

    /// A decode step's QK-norm + RoPE, KV-cache write and attention in one launch
    /// (attn_decode_rope), from the raw q, k, v rows in `bufs.qkv` into `bufs.att`, or with
    /// `partials` into the layer's workspace only (combine_matvec combines them).
    #[allow(clippy::too_many_arguments)]
    fn attend_step(&self, kernel: &Kernel, state: &mut State, bufs: &mut Bufs, l: &Layer, il: usize, n_split: usize, partials: bool) -> Result<()> {
        let c = &self.cfg;
        let (hd, qd, kvd) = (c.head_dim, c.n_head * c.head_dim, c.n_kv * c.head_dim);
        let Bufs { pos, qkv, att, work, .. } = &mut *bufs;
        let (q, k, v) = (qkv.slice(..qd), qkv.slice(qd..qd + kvd), qkv.slice(qd + kvd..qd + 2 * kvd));
        let norm_w = l.qk_norm.as_ref().map(|(qw, kw)| (qw.slice(..), kw.slice(..)));
        let new = NewTokens { q: &q, k: &k, v: &v, norm_w: norm_w.as_ref().map(|(a, b)| (a, b)) };
        let attn = AttnDecodeParams { n_seq: 1, head_dim: hd, n_head: c.n_head, n_kv: c.n_kv, max_ctx: state.cache.max_ctx, window: l.window, n_split, scale: c.attn_scale };
        let p = AttnDecodeRopeParams { attn, n_rot: c.n_rot, freq_base: l.rope_base, freq_scale: l.rope_scale, eps: c.eps };
        let mut work = self.layer_work(work, il);
        let cache = &mut state.cache;
        let (kc, vc, pos) = (&mut cache.k[il].slice_mut(..), &mut cache.v[il].slice_mut(..), &pos.slice(..1));
        match partials {
            true => attn_decode_rope::attn_decode_rope_partials(kernel, &new, kc, vc, pos, &mut work, &p)?,
            false => attn_decode_rope::attn_decode_rope(kernel, &new, kc, vc, pos, &mut att.slice_mut(..qd), &mut work, &p)?,
        }
        Ok(())
    }

    /// Layer `il`'s slice of the decode-attention workspace: layers split differently (window
    /// vs global) and a split's counters must not meet another split count's partials.
    fn layer_work<'a>(&self, work: &'a mut CudaSlice<f32>, il: usize) -> CudaViewMut<'a, f32> {
        let per_layer = work.len() / self.layers.len();
        work.slice_mut(il * per_layer..(il + 1) * per_layer)
    }

    /// Attention of `t` query rows at positions `pos0..` over the layer's cache: the split-K
    /// decode kernel for one row, the tensor-core prefill kernel for more. `att: None` (one row)
    /// leaves the splits' partials in the layer's workspace for combine_matvec.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        cache: &KvCache,
        l: &Layer,
        il: usize,
        q: &CudaView<'_, f32>,
        pos: &CudaSlice<i32>,
        att: Option<&mut CudaSlice<f32>>,
        work: &mut CudaSlice<f32>,
        t: usize,
        pos0: usize,
        n_split: usize,
    ) -> Result<()> {
        let c = &self.cfg;
        let (n_head, n_kv, hd) = (c.n_head, c.n_kv, c.head_dim);
        let qd = n_head * hd;
        let (kc, vc) = (cache.k[il].slice(..), cache.v[il].slice(..));
        let scale = c.attn_scale;
        let q = q.slice(..t * qd);
        if t > 1 {
            let att = att.ok_or_else(|| err("attention partials are a decode step's (one token)"))?;
            let p = AttnPrefillParams { n_tokens: t, head_dim: hd, n_head, n_kv, max_ctx: cache.max_ctx, pos0, window: l.window, scale };
            return Ok(attn_prefill::attn_prefill(self.kernels.get(self.names.attn_prefill)?, &q, &kc, &vc, &mut att.slice_mut(..t * qd), &p)?);
        }
        let p = AttnDecodeParams { n_seq: 1, head_dim: hd, n_head, n_kv, max_ctx: cache.max_ctx, window: l.window, n_split, scale };
        let (kernel, mut work, pos) = (self.kernels.get(self.names.attn_decode)?, self.layer_work(work, il), pos.slice(..1));
        match att {
            Some(att) => attn_decode::attn_decode(kernel, &q, &kc, &vc, &pos, &mut att.slice_mut(..qd), &mut work, &p)?,
            None => attn_decode::attn_decode_partials(kernel, &q, &kc, &vc, &pos, &mut work, &p)?,
        }
        Ok(())
    }
}

impl DecoderStack for Decoder {
    type Cache = KvCache;
    const PREFILL_CHUNK: usize = 2048;

    fn state(&self) -> &State {
        &self.state
    }

    fn state_mut(&mut self) -> &mut State {
        &mut self.state
    }

    fn decode_step(&mut self, token: Option<u32>) -> Result<()> {
        let pos0 = self.state.len;
        if let Some(token) = token {
            gpu::upload_tokens(&self.state.gpu, &[token], pos0, &mut self.step.tokens, &mut self.step.pos)?;
        }
        let splits = self.net.splits(pos0 + 1)?;
        // The graph bakes every pointer and scalar; token and position live in device buffers,
        // so only a change of split counts needs a new capture.
        let stream = self.state.gpu.stream().clone();
        let (net, state, step) = (&self.net, &mut self.state, &mut self.step);
        self.graph.run(&stream, splits.clone(), || net.enqueue(state, step, 1, pos0, &splits))
    }

    fn prefill_chunk(&mut self, tokens: &[u32]) -> Result<()> {
        let (t, pos0) = (tokens.len(), self.state.len);
        let mut bufs = Bufs::new(&self.state.gpu, &self.net.cfg, t, self.net.layers.len(), 1)?;
        gpu::upload_tokens(&self.state.gpu, tokens, pos0, &mut bufs.tokens, &mut bufs.pos)?;
        self.net.enqueue(&mut self.state, &mut bufs, t, pos0, &vec![1; self.net.layers.len()])
        // `bufs` is freed on return; its frees are stream-ordered after the work.
    }
}

impl Bufs {
    /// Activations for `t` tokens; the decode-attention workspace holds `n_layer` slices for up
    /// to `max_split` splits.
    fn new(gpu: &Gpu, c: &DecoderConfig, t: usize, n_layer: usize, max_split: usize) -> Result<Bufs> {
        let (e, qd, kvd) = (c.n_embd, c.n_head * c.head_dim, c.n_kv * c.head_dim);
        let a = |n: usize, what: &str| gpu::alloc::<f32>(gpu, t * n, &format!("activations ({what}, {t} tokens)"));
        Ok(Bufs {
            tokens: gpu::alloc(gpu, t, "token ids")?,
            pos: gpu::alloc(gpu, t, "positions")?,
            x: a(e, "residual")?,
            // Decode steps only (one token).
            x_alt: gpu::alloc(gpu, e, "activations (second residual buffer)")?,
            h: a(e, "normed")?,
            qkv: a(qd + 2 * kvd, "q, k, v")?,
            att: a(qd, "attention")?,
            o: a(e, "projection")?,
            gate: a(c.n_ff, "gate")?,
            up: a(c.n_ff, "up")?,
            ff: a(c.n_ff.max(c.moe.as_ref().map_or(0, |m| m.n_used * m.n_ff_exp)), "ffn")?,
            router: a(c.moe.as_ref().map_or(1, |m| m.n_expert), "router logits")?,
            ids: gpu::alloc(gpu, t * c.moe.as_ref().map_or(1, |m| m.n_used), "expert ids")?,
            wts: a(c.moe.as_ref().map_or(1, |m| m.n_used), "expert weights")?,
            grouped: match &c.moe {
                Some(m) if moe_grouped::use_grouped(t, m.n_used, m.n_expert) => Some(GroupedScratch::new(gpu, t, m.n_used, m.n_expert, e, m.n_ff_exp)?),
                _ => None,
            },
            work: gpu::alloc(gpu, n_layer * attn_decode::work_floats(1, c.n_head, c.head_dim, max_split).next_multiple_of(4), "attention workspace")?,
        })
    }
}

/// The residual buffer `cur` (0: `x`, 1: `x_alt`) to read and the other one to write.
fn residuals<'a>(x: &'a mut CudaSlice<f32>, x_alt: &'a mut CudaSlice<f32>, cur: usize) -> (&'a CudaSlice<f32>, &'a mut CudaSlice<f32>) {
    if cur == 0 { (x, x_alt) } else { (x_alt, x) }
}

/// Where part `which` (0 q, 1 k, 2 v) of `t` rows starts in `Bufs::qkv`.
fn qkv_offset(which: usize, t: usize, qd: usize, kvd: usize) -> usize {
    [0, t * qd, t * (qd + kvd)][which]
}

/// q, k, v as [`gpu::aligned_runs`] groups them (neighbours of one row length and type, or with
/// `widen` of a type all of them are exact in; a part off a 16-byte boundary starts a run), each
/// part tagged 0 / 1 / 2, with the run's stored type.
fn qkv_runs<'f>(parts: &[TensorInfo<'f>; 3], widen: bool) -> Vec<(Vec<(usize, TensorInfo<'f>)>, GgmlType)> {
    let keys: Vec<_> = parts.iter().map(|t| (t.ggml_type, t.row_len(), t.n_elements())).collect();
    gpu::aligned_runs(&keys, widen).into_iter().map(|(run, ty)| (run.into_iter().map(|i| (i, parts[i])).collect(), ty)).collect()
}

/// The combine_matvec variant for the o-projection `w` (`head_dim`-wide heads).
fn plan_combine(plan: &mut KernelPlan, w: &DeviceTensor, head_dim: usize) -> Result<&'static str> {
    let named = |e: String| err(format!("tensor '{}': {e}", w.name));
    let qtype = gpu::qtype_token(combine_matvec::FAMILY, w.ty).map_err(|e| named(e.to_string()))?;
    let int = |v: usize| Param::Int(v as i64);
    let req = [("k", int(w.k)), ("n", int(w.n)), ("head_dim", int(head_dim)), ("qtype", Param::Sym(qtype))];
    plan.want(combine_matvec::FAMILY, &req).map_err(|e| named(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use memra_gguf::Dims;

    fn info(name: &'static str, ty: GgmlType, n: u64) -> TensorInfo<'static> {
        let dims = Dims::new(&[640, n]).unwrap();
        TensorInfo { name, dims, ggml_type: ty, offset: 0, n_bytes: ty.row_bytes(640).unwrap() * n }
    }

    fn shape(runs: &[(Vec<(usize, TensorInfo<'_>)>, GgmlType)]) -> Vec<(Vec<usize>, GgmlType)> {
        runs.iter().map(|(r, ty)| (r.iter().map(|&(i, _)| i).collect(), *ty)).collect()
    }

    /// Gemma 3's layers with a Q8_0 v: q + k and v without widening, all three as Q8_0 with it;
    /// an all-Q5_0 layer stays Q5_0 either way.
    #[test]
    fn qkv_runs_stack_equal_types_and_widen_only_when_asked() {
        use GgmlType::{Q5_0, Q8_0};
        let mixed = [info("q", Q5_0, 1024), info("k", Q5_0, 256), info("v", Q8_0, 256)];
        assert_eq!(shape(&qkv_runs(&mixed, false)), vec![(vec![0, 1], Q5_0), (vec![2], Q8_0)]);
        assert_eq!(shape(&qkv_runs(&mixed, true)), vec![(vec![0, 1, 2], Q8_0)]);
        let same = [info("q", Q5_0, 1024), info("k", Q5_0, 256), info("v", Q5_0, 256)];
        assert_eq!(shape(&qkv_runs(&same, true)), vec![(vec![0, 1, 2], Q5_0)]);
        // 640 Q8_0 rows of 680 bytes: 3 rows end off a 16-byte boundary, so the next part starts a run.
        let odd = [info("q", Q5_0, 3), info("k", Q8_0, 256), info("v", Q8_0, 256)];
        assert_eq!(shape(&qkv_runs(&odd, true)), vec![(vec![0], Q8_0), (vec![1, 2], Q8_0)]);
    }
}

