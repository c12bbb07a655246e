//! Gemma 3 on the GPU (model-specs §5): embedding × sqrt(n_embd), per layer
//! `h = attn_norm(x)`, q/k/v projections, per-head QK-norm + NEOX RoPE (local base on
//! sliding-window layers) written into the bf16 KV cache, GQA attention (window on local layers),
//! output projection, sandwich norm + residual (fused with the next pre-norm), GeGLU FFN likewise,
//! tied LM head. Batched prefill (matmul + tensor-core prefill attention) and token-by-token
//! decode (matvec + split-K decode attention); a decode step is captured as a CUDA graph and
//! replayed.

use std::path::Path;
use std::time::Instant;

use cudarc::driver::{CudaGraph, CudaSlice, sys};
use memra_gguf::GgufFile;
use memra_reference::models::Gemma3Hparams as Semantics;

use super::gpu::{self, DeviceTensor, GpuModelError, KernelPlan, KvCache, Linear, Result, err, upload_f32};
use super::spec::gemma3::{Gemma3Hparams, Gemma3Weights};
use super::{GpuModel, GpuOptions};
use crate::cuda::{Gpu, Kernels};
use crate::kernels::attn_decode::{self, AttnDecodeParams};
use crate::kernels::attn_prefill::{self, AttnPrefillParams};
use crate::kernels::qk_norm_rope::{self, QkNormRopeParams};
use crate::kernels::registry::Param;
use crate::kernels::swiglu::GluLayout;
use crate::kernels::{add_rmsnorm, argmax, embed, geglu, rmsnorm};

/// Prompt tokens per prefill pass (bounds the activation buffers).
const PREFILL_CHUNK: usize = 2048;

struct Layer {
    attn_norm: CudaSlice<f32>,
    attn_q: Linear,
    attn_k: Linear,
    attn_v: Linear,
    attn_q_norm: CudaSlice<f32>,
    attn_k_norm: CudaSlice<f32>,
    attn_output: Linear,
    post_attention_norm: CudaSlice<f32>,
    ffn_norm: CudaSlice<f32>,
    ffn_gate: Linear,
    ffn_up: Linear,
    ffn_down: Linear,
    post_ffw_norm: CudaSlice<f32>,
    rope_base: f32,
    rope_scale: f32,
    window: Option<usize>,
}

/// Variant names of the non-linear kernels.
struct Names {
    embed: &'static str,
    rmsnorm: &'static str,
    add_rmsnorm: &'static str,
    qk_norm_rope: &'static str,
    attn_decode: &'static str,
    attn_prefill: &'static str,
    geglu: &'static str,
    argmax: &'static str,
}

/// Activations for up to `t` tokens.
struct Bufs {
    tokens: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    x: CudaSlice<f32>,
    h: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    att: CudaSlice<f32>,
    o: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    ff: CudaSlice<f32>,
    work: CudaSlice<f32>,
}

/// What a forward reads: weights, kernels, dims.
struct Net {
    hp: Gemma3Hparams,
    sem: Semantics,
    layers: Vec<Layer>,
    lm_head: Linear,
    output_norm: CudaSlice<f32>,
    kernels: Kernels,
    names: Names,
    sm_count: usize,
    weight_bytes: usize,
}

/// What a forward writes besides the activations: the KV cache and the last logits.
struct State {
    cache: KvCache,
    logits: CudaSlice<f32>,
    best_idx: CudaSlice<i32>,
    best_val: CudaSlice<f32>,
    argmax_scratch: CudaSlice<u8>,
}

pub struct Gemma3Gpu {
    gpu: Gpu,
    net: Net,
    state: State,
    /// Decode activations (one token), reused by every step and the captured graph.
    step: Bufs,
    use_graphs: bool,
    /// The captured decode step and the split counts it was captured with.
    graph: Option<(CudaGraph, Vec<usize>)>,
    report: Vec<String>,
}

fn hparam(v: u32) -> usize {
    v as usize
}

impl Gemma3Gpu {
    pub fn load(path: &Path, opts: &GpuOptions) -> Result<Gemma3Gpu> {
        let start = Instant::now();
        let file = GgufFile::open(path).map_err(|e| err(e.to_string()))?;
        let hp = Gemma3Hparams::from_gguf(&file).map_err(|e| err(e.to_string()))?;
        // Per-layer RoPE base/scale, window pattern and attention scale as the CPU reference
        // reads them (one interpretation of the metadata for both paths).
        let sem = Semantics::from_gguf(&file).map_err(|e| err(e.to_string()))?;
        let handles = Gemma3Weights::from_gguf(&file, &hp).map_err(|e| err(e.to_string()))?;
        let (e, n_head, n_kv, hd) = (hparam(hp.n_embd), hparam(hp.n_head), hparam(hp.n_head_kv), hparam(hp.head_dim));
        if hparam(hp.head_dim_v) != hd {
            return Err(err(format!("{}: key length {hd} != value length {} (the GPU attention needs them equal)", path.display(), hp.head_dim_v)));
        }
        if sem.final_logit_softcap.is_some() {
            return Err(err(format!("{}: final logit soft-capping is not implemented on the GPU path (use --cpu)", path.display())));
        }
        let max_ctx = opts.max_ctx.unwrap_or(hparam(hp.n_ctx_train)).min(hparam(hp.n_ctx_train)).max(1);

        let gpu = Gpu::new(opts.device)?;
        let sm_count = gpu.sm_count()?;
        let mut plan = KernelPlan::new(opts.policy);
        let mut bytes = 0usize;
        let mut layers = Vec::with_capacity(handles.layers.len());
        for (il, l) in handles.layers.iter().enumerate() {
            let mut lin = |t| -> Result<Linear> {
                let d = DeviceTensor::upload(&gpu, &file, t)?;
                bytes += d.bytes();
                plan.linear(d)
            };
            let (attn_q, attn_k, attn_v, attn_output) = (lin(&l.attn_q)?, lin(&l.attn_k)?, lin(&l.attn_v)?, lin(&l.attn_output)?);
            let (ffn_gate, ffn_up, ffn_down) = (lin(&l.ffn_gate)?, lin(&l.ffn_up)?, lin(&l.ffn_down)?);
            let rope = sem.rope(il);
            layers.push(Layer {
                attn_norm: upload_f32(&gpu, &file, &l.attn_norm)?,
                attn_q,
                attn_k,
                attn_v,
                attn_q_norm: upload_f32(&gpu, &file, &l.attn_q_norm)?,
                attn_k_norm: upload_f32(&gpu, &file, &l.attn_k_norm)?,
                attn_output,
                post_attention_norm: upload_f32(&gpu, &file, &l.post_attention_norm)?,
                ffn_norm: upload_f32(&gpu, &file, &l.ffn_norm)?,
                ffn_gate,
                ffn_up,
                ffn_down,
                post_ffw_norm: upload_f32(&gpu, &file, &l.post_ffw_norm)?,
                rope_base: rope.base,
                rope_scale: rope.freq_scale,
                window: sem.window(il),
            });
        }
        let embd = DeviceTensor::upload(&gpu, &file, &handles.global.token_embd)?;
        bytes += embd.bytes();
        let embd_qtype = gpu::qtype_token(embed::FAMILY, embd.ty).map_err(|e| err(format!("token_embd.weight: {e}")))?;
        let n_vocab = embd.n;
        let lm_head = plan.linear(embd)?;
        let output_norm = upload_f32(&gpu, &file, &handles.global.output_norm)?;

        let int = |v: usize| Param::Int(v as i64);
        let names = Names {
            embed: plan.want(embed::FAMILY, &[("n_embd", int(e)), ("qtype", Param::Sym(embd_qtype))])?,
            rmsnorm: plan.want(rmsnorm::FAMILY, &[("n", int(e))])?,
            add_rmsnorm: plan.want(add_rmsnorm::FAMILY, &[("n", int(e)), ("delta_norm", Param::Int(1))])?,
            qk_norm_rope: plan.want(
                qk_norm_rope::FAMILY,
                &[
                    ("head_dim", int(hd)),
                    ("n_head", int(n_head)),
                    ("n_kv", int(n_kv)),
                    ("n_rot", int(hparam(hp.n_rot))),
                    ("rope_mode", Param::Sym("neox")),
                    ("qk_norm", Param::Sym("per_head")),
                    ("cache_t", Param::Sym("bf16")),
                ],
            )?,
            attn_decode: plan.want(
                attn_decode::FAMILY,
                &[("head_dim", int(hd)), ("n_head", int(n_head)), ("n_kv", int(n_kv)), ("cache_t", Param::Sym("bf16"))],
            )?,
            attn_prefill: plan.want(
                attn_prefill::FAMILY,
                &[("head_dim", int(hd)), ("n_head", int(n_head)), ("n_kv", int(n_kv)), ("cache_t", Param::Sym("bf16"))],
            )?,
            geglu: plan.want(geglu::FAMILY, &[("n_ff", int(hparam(hp.n_ff)))])?,
            argmax: plan.want(argmax::FAMILY, &[("n_vocab", int(n_vocab))])?,
        };
        let mut report = vec![format!(
            "{}: gemma3, {} layers, n_embd {e}, {n_head} q / {n_kv} kv heads × {hd}, vocab {n_vocab}; weights {} on {}",
            path.display(),
            layers.len(),
            gpu::mib(bytes),
            gpu.name()
        )];
        report.extend(plan.report());
        let compile = Instant::now();
        let kernels = plan.load(&gpu)?;
        report.push(format!("kernels ready in {:.2} s", compile.elapsed().as_secs_f64()));
        let cache = KvCache::new(&gpu, layers.len(), max_ctx, n_kv, hd)?;
        report.push(format!("KV cache: {max_ctx} positions, bf16, {}", gpu::mib(cache.bytes())));

        let step = Bufs::new(&gpu, &hp, 1, n_splits_cap(max_ctx, n_head, n_kv, sm_count, &kernels, names.attn_decode)?)?;
        let argmax_scratch = argmax::alloc_scratch(kernels.get(names.argmax)?, 1, n_vocab)?;
        let state = State {
            cache,
            logits: gpu::alloc(&gpu, n_vocab, "the logits")?,
            best_idx: gpu::alloc(&gpu, 1, "argmax")?,
            best_val: gpu::alloc(&gpu, 1, "argmax")?,
            argmax_scratch,
        };
        let net = Net { hp, sem, layers, lm_head, output_norm, kernels, names, sm_count, weight_bytes: bytes };
        report.push(format!("loaded in {:.2} s", start.elapsed().as_secs_f64()));
        Ok(Gemma3Gpu { gpu, net, state, step, use_graphs: opts.graphs, graph: None, report })
    }
}

impl Net {
    fn n_vocab(&self) -> usize {
        self.lm_head.w.n
    }

    /// The attention split count per layer for keys up to `len`.
    fn splits(&self, len: usize) -> Result<Vec<usize>> {
        let kernel = self.kernels.get(self.names.attn_decode)?;
        let min_rows = attn_decode::min_split_rows(kernel);
        let (n_head, n_kv) = (hparam(self.hp.n_head), hparam(self.hp.n_head_kv));
        Ok(self
            .layers
            .iter()
            .map(|l| {
                let visible = l.window.map_or(len, |w| w.min(len));
                attn_decode::splits_for(visible.max(1), 1, n_head, n_kv, self.sm_count, min_rows)
            })
            .collect())
    }

    /// Enqueues the whole forward for `bufs.t`-token rows already holding tokens and positions
    /// (`t` ≤ bufs.t tokens at positions `pos0..pos0+t`), leaving the last token's logits in
    /// `state.logits` and its argmax in `state.best_idx`.
    fn enqueue(&self, state: &mut State, bufs: &mut Bufs, t: usize, pos0: usize, splits: &[usize]) -> Result<()> {
        let hp = &self.hp;
        let (e, n_head, n_kv, hd, n_ff) = (hparam(hp.n_embd), hparam(hp.n_head), hparam(hp.n_head_kv), hparam(hp.head_dim), hparam(hp.n_ff));
        let eps = hp.rms_eps;
        let k = &self.kernels;
        let (qd, kvd) = (n_head * hd, n_kv * hd);
        let n_vocab = self.n_vocab();
        let Bufs { tokens, pos, x, h, q, k: kb, v, att, o, gate, up, ff, work, .. } = bufs;

        embed::embed(
            k.get(self.names.embed)?,
            &tokens.slice(..t),
            &self.lm_head.w.data.slice(..),
            &mut x.slice_mut(..t * e),
            t,
            e,
            n_vocab,
            (e as f32).sqrt(),
        )?;
        rmsnorm::rmsnorm(k.get(self.names.rmsnorm)?, &x.slice(..t * e), &self.layers[0].attn_norm.slice(..), &mut h.slice_mut(..t * e), t, e, eps)?;
        for (il, l) in self.layers.iter().enumerate() {
            l.attn_q.forward(k, &h.slice(..t * e), &mut q.slice_mut(..t * qd), t)?;
            l.attn_k.forward(k, &h.slice(..t * e), &mut kb.slice_mut(..t * kvd), t)?;
            l.attn_v.forward(k, &h.slice(..t * e), &mut v.slice_mut(..t * kvd), t)?;
            let mut p = QkNormRopeParams::packed(t, hd, n_head, n_kv, hparam(hp.n_rot), state.cache.max_ctx, l.rope_base, eps);
            p.freq_scale = l.rope_scale;
            qk_norm_rope::qk_norm_rope(
                k.get(self.names.qk_norm_rope)?,
                &mut q.slice_mut(..t * qd),
                &mut kb.slice_mut(..t * kvd),
                &v.slice(..t * kvd),
                Some((&l.attn_q_norm.slice(..), &l.attn_k_norm.slice(..))),
                &pos.slice(..t),
                &mut state.cache.k[il].slice_mut(..),
                &mut state.cache.v[il].slice_mut(..),
                &p,
            )?;
            self.attend(&state.cache, l, il, q, pos, att, work, t, pos0, splits[il])?;
            l.attn_output.forward(k, &att.slice(..t * qd), &mut o.slice_mut(..t * e), t)?;
            add_rmsnorm::add_rmsnorm(
                k.get(self.names.add_rmsnorm)?,
                &mut x.slice_mut(..t * e),
                &o.slice(..t * e),
                Some(&l.post_attention_norm.slice(..)),
                &l.ffn_norm.slice(..),
                &mut h.slice_mut(..t * e),
                t,
                e,
                eps,
            )?;
            l.ffn_gate.forward(k, &h.slice(..t * e), &mut gate.slice_mut(..t * n_ff), t)?;
            l.ffn_up.forward(k, &h.slice(..t * e), &mut up.slice_mut(..t * n_ff), t)?;
            geglu::geglu(k.get(self.names.geglu)?, &gate.slice(..t * n_ff), &up.slice(..t * n_ff), &mut ff.slice_mut(..t * n_ff), t, n_ff, GluLayout::separate(n_ff))?;
            l.ffn_down.forward(k, &ff.slice(..t * n_ff), &mut o.slice_mut(..t * e), t)?;
            let next_norm = self.layers.get(il + 1).map_or(&self.output_norm, |n| &n.attn_norm);
            add_rmsnorm::add_rmsnorm(
                k.get(self.names.add_rmsnorm)?,
                &mut x.slice_mut(..t * e),
                &o.slice(..t * e),
                Some(&l.post_ffw_norm.slice(..)),
                &next_norm.slice(..),
                &mut h.slice_mut(..t * e),
                t,
                e,
                eps,
            )?;
        }
        let last = (t - 1) * e;
        self.lm_head.forward(k, &h.slice(last..last + e), &mut state.logits.slice_mut(..), 1)?;
        argmax::argmax(
            k.get(self.names.argmax)?,
            &state.logits.slice(..),
            &mut state.best_idx.slice_mut(..),
            &mut state.best_val.slice_mut(..),
            &mut state.argmax_scratch.slice_mut(..),
            1,
            n_vocab,
        )?;
        Ok(())
    }

    /// Attention of `t` query rows at positions `pos0..` over the layer's cache: the split-K
    /// decode kernel for one row, the tensor-core prefill kernel for more.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        cache: &KvCache,
        l: &Layer,
        il: usize,
        q: &CudaSlice<f32>,
        pos: &CudaSlice<i32>,
        att: &mut CudaSlice<f32>,
        work: &mut CudaSlice<f32>,
        t: usize,
        pos0: usize,
        n_split: usize,
    ) -> Result<()> {
        let hp = &self.hp;
        let (n_head, n_kv, hd) = (hparam(hp.n_head), hparam(hp.n_head_kv), hparam(hp.head_dim));
        let qd = n_head * hd;
        let (kc, vc) = (cache.k[il].slice(..), cache.v[il].slice(..));
        let scale = self.sem.attn_scale;
        if t > 1 {
            let p = AttnPrefillParams { n_tokens: t, head_dim: hd, n_head, n_kv, max_ctx: cache.max_ctx, pos0, window: l.window, scale };
            attn_prefill::attn_prefill(self.kernels.get(self.names.attn_prefill)?, &q.slice(..t * qd), &kc, &vc, &mut att.slice_mut(..t * qd), &p)?;
            return Ok(());
        }
        let p = AttnDecodeParams { n_seq: 1, head_dim: hd, n_head, n_kv, max_ctx: cache.max_ctx, window: l.window, n_split, scale };
        attn_decode::attn_decode(self.kernels.get(self.names.attn_decode)?, &q.slice(..qd), &kc, &vc, &pos.slice(..1), &mut att.slice_mut(..qd), &mut work.slice_mut(..), &p)?;
        Ok(())
    }
}

impl Gemma3Gpu {
    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let n_vocab = self.net.n_vocab();
        if tokens.is_empty() {
            return Err(err("forward: no tokens"));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(err(format!("token id {bad} is out of range (n_vocab {n_vocab})")));
        }
        let cache = &self.state.cache;
        if cache.len + tokens.len() > cache.max_ctx {
            return Err(err(format!(
                "context full: {} cached + {} new positions > {} (the KV cache size; --ctx raises it up to the model's {})",
                cache.len,
                tokens.len(),
                cache.max_ctx,
                self.net.hp.n_ctx_train
            )));
        }
        Ok(())
    }

    fn decode_step(&mut self, token: u32) -> Result<()> {
        let pos0 = self.state.cache.len;
        let stream = self.gpu.stream().clone();
        let copy = |what: &str, e: cudarc::driver::DriverError| err(format!("copying {what} to the GPU: {e:?}"));
        stream.memcpy_htod(&[token as i32], &mut self.step.tokens).map_err(|e| copy("the token", e))?;
        stream.memcpy_htod(&[pos0 as i32], &mut self.step.pos).map_err(|e| copy("the position", e))?;
        let splits = self.net.splits(pos0 + 1)?;
        if !self.use_graphs {
            return self.net.enqueue(&mut self.state, &mut self.step, 1, pos0, &splits);
        }
        // The graph bakes every pointer and scalar; token and position live in device buffers,
        // so only a change of split counts (every few hundred positions) needs a new capture.
        if self.graph.as_ref().is_none_or(|(_, s)| *s != splits) {
            self.graph = None;
            stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| err(format!("cuStreamBeginCapture: {e:?}")))?;
            let r = self.net.enqueue(&mut self.state, &mut self.step, 1, pos0, &splits);
            let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
            r?;
            let graph = graph.map_err(|e| err(format!("capturing the decode step as a CUDA graph: {e:?}")))?;
            let graph = graph.ok_or_else(|| err("capturing the decode step produced an empty graph"))?;
            self.graph = Some((graph, splits));
        }
        let (graph, _) = self.graph.as_ref().expect("captured above");
        graph.launch().map_err(|e| err(format!("cuGraphLaunch: {e:?}")))
    }

    fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        let hp = &self.net.hp;
        for chunk in tokens.chunks(PREFILL_CHUNK) {
            let t = chunk.len();
            let pos0 = self.state.cache.len;
            let mut bufs = Bufs::new(&self.gpu, hp, t, 1)?;
            let ids: Vec<i32> = chunk.iter().map(|&v| v as i32).collect();
            let positions: Vec<i32> = (pos0..pos0 + t).map(|p| p as i32).collect();
            let stream = self.gpu.stream().clone();
            stream.memcpy_htod(&ids, &mut bufs.tokens).map_err(|e| err(format!("copying the prompt to the GPU: {e:?}")))?;
            stream.memcpy_htod(&positions, &mut bufs.pos).map_err(|e| err(format!("copying positions to the GPU: {e:?}")))?;
            self.net.enqueue(&mut self.state, &mut bufs, t, pos0, &vec![1; self.net.layers.len()])?;
            self.state.cache.len += t;
            // `bufs` is freed on return; its frees are stream-ordered after the work.
        }
        Ok(())
    }
}

/// The largest split count decode will use (sizes the decode workspace once).
fn n_splits_cap(max_ctx: usize, n_head: usize, n_kv: usize, sm_count: usize, kernels: &Kernels, name: &str) -> Result<usize> {
    let min_rows = attn_decode::min_split_rows(kernels.get(name)?);
    Ok(attn_decode::splits_for(max_ctx, 1, n_head, n_kv, sm_count, min_rows).max(2))
}

impl Bufs {
    fn new(gpu: &Gpu, hp: &Gemma3Hparams, t: usize, max_split: usize) -> Result<Bufs> {
        let (e, qd, kvd, n_ff) = (
            hparam(hp.n_embd),
            hparam(hp.n_head) * hparam(hp.head_dim),
            hparam(hp.n_head_kv) * hparam(hp.head_dim),
            hparam(hp.n_ff),
        );
        let a = |n: usize, what: &str| gpu::alloc::<f32>(gpu, t * n, &format!("activations ({what}, {t} tokens)"));
        Ok(Bufs {
            tokens: gpu::alloc(gpu, t, "token ids")?,
            pos: gpu::alloc(gpu, t, "positions")?,
            x: a(e, "residual")?,
            h: a(e, "normed")?,
            q: a(qd, "q")?,
            k: a(kvd, "k")?,
            v: a(kvd, "v")?,
            att: a(qd, "attention")?,
            o: a(e, "projection")?,
            gate: a(n_ff, "gate")?,
            up: a(n_ff, "up")?,
            ff: a(n_ff, "ffn")?,
            work: gpu::alloc(gpu, attn_decode::work_floats(1, hparam(hp.n_head), hparam(hp.head_dim), max_split), "attention workspace")?,
        })
    }
}

impl GpuModel for Gemma3Gpu {
    fn forward(&mut self, tokens: &[u32]) -> Result<()> {
        self.check_tokens(tokens)?;
        if tokens.len() == 1 {
            self.decode_step(tokens[0])?;
            self.state.cache.len += 1;
            Ok(())
        } else {
            self.prefill(tokens)
        }
    }

    fn logits(&self) -> Result<Vec<f32>> {
        self.gpu.stream().clone_dtoh(&self.state.logits).map_err(|e| GpuModelError(format!("copying the logits to the host: {e:?}")))
    }

    fn argmax(&self) -> Result<u32> {
        let v = self.gpu.stream().clone_dtoh(&self.state.best_idx).map_err(|e| GpuModelError(format!("copying the argmax to the host: {e:?}")))?;
        Ok(v[0].max(0) as u32)
    }

    fn sync(&self) -> Result<()> {
        Ok(self.gpu.sync()?)
    }

    fn len(&self) -> usize {
        self.state.cache.len
    }

    fn max_ctx(&self) -> usize {
        self.state.cache.max_ctx
    }

    fn n_vocab(&self) -> usize {
        self.net.n_vocab()
    }

    fn weight_bytes(&self) -> usize {
        self.net.weight_bytes
    }

    fn reset(&mut self) {
        self.state.cache.len = 0;
    }

    fn report(&self) -> &[String] {
        &self.report
    }
}
