//! The MLA + MoE model body shared by glm-dsa and deepseek2 (model-specs §6, §7, §8): hparams,
//! weights, cache and forward. [`super::glm_dsa`] and [`super::deepseek2`] wrap it with their
//! architecture name and defaults.
//!
//! Per layer `il`: `h = rms(x)·attn_norm`; MLA attention (§6.3) over the latent cache — with
//! the DSA indexer's top-k keys when the layer has indexer tensors (§8.4; a layer without them
//! reuses the previous indexer layer's selection, GLM-5.2 "shared" layers); `x += attn`;
//! `h' = rms(x)·ffn_norm`; `x += ` dense SwiGLU for `il < leading_dense_block_count`, else the
//! routed experts plus the shared expert (§6.5). `logits = output · (rms(x)·output_norm)`.
//! MTP (nextn) layers after `n_layer` are loaded when the file has them and never run.

use memra_gguf::Gguf;

use super::common::{
    DenseFfn, Head, Meta, MoeHparams, MoeLayer, Yarn, add_in_place, check_forward, layer_tensor,
    opt_layer_tensor,
};
use super::{ModelError, load_f32, par_matmul};
use crate::dsa::{
    IndexerCache, IndexerConfig, IndexerDims, IndexerWeights, dsa_mla_block, indexer_k,
};
use crate::mla::{
    MlaCache, MlaConfig, MlaDims, MlaMode, MlaProjection, MlaWeights, mla_attend_output, mla_block,
};
use crate::moe::{Gating, RouterConfig};
use crate::norm::rms_norm;
use crate::rope::{Rope, RopeMode};

/// LayerNorm eps of the indexer's `k_norm` (DeepSeek reference value, model-specs §8.2 step 3).
pub const INDEXER_K_NORM_EPS: f32 = 1e-6;

/// Per-architecture defaults of the shared body.
#[derive(Copy, Clone, Debug)]
pub(crate) struct MlaArch {
    pub name: &'static str,
    /// `expert_gating_func` when absent.
    pub default_gating: Gating,
    /// Reads the `attention.indexer.*` keys and indexer tensors (glm-dsa).
    pub dsa: bool,
}

/// DSA indexer hyper-parameters.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct IndexerHparams {
    pub n_head: usize,
    pub head_dim: usize,
    pub top_k: usize,
}

/// Hyper-parameters of an MLA + MoE model.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaModelHparams {
    pub n_vocab: usize,
    pub n_embd: usize,
    /// Blocks run by the forward: `block_count − nextn_predict_layers`.
    pub n_layer: usize,
    /// `nextn_predict_layers` (MTP blocks after `n_layer`, loaded if present, not run).
    pub n_nextn: usize,
    /// Dense FFN width (layers `< n_leading_dense`).
    pub n_ff: usize,
    pub n_leading_dense: usize,
    pub n_ctx_train: usize,
    pub eps: f32,
    pub mla: MlaDims,
    /// `attention.q_lora_rank`; `None` = a direct `attn_q` (DeepSeek-V2-Lite).
    pub q_lora: Option<usize>,
    /// RoPE of q_pe / k_pe (interleaved; YaRN when the file says so, else plain).
    pub rope: Yarn,
    /// Softmax scale: `mscale² / sqrt(nope + rope)` (§6.4).
    pub kq_scale: f32,
    pub moe: MoeHparams,
    pub indexer: Option<IndexerHparams>,
}

impl MlaModelHparams {
    pub(crate) fn from_gguf<B: AsRef<[u8]>>(
        gguf: &Gguf<B>,
        arch: MlaArch,
    ) -> Result<Self, ModelError> {
        let m = Meta::new(gguf, arch.name)?;
        let n_embd = m.usize("embedding_length")?;
        let block_count = m.usize("block_count")?;
        let n_nextn = m.opt_usize("nextn_predict_layers")?.unwrap_or(0);
        if n_nextn >= block_count {
            return Err(m.err(format!(
                "nextn_predict_layers {n_nextn} leaves no layer of block_count {block_count}"
            )));
        }
        let n_head = m.usize("attention.head_count")?;
        let kv_lora = m.usize("attention.kv_lora_rank")?;
        let n_rot = m.usize("rope.dimension_count")?;
        // Files from before the k_b/v_b split only have key_length / value_length (llama.cpp
        // falls back the same way).
        let qk_head = match m.opt_usize("attention.key_length_mla")? {
            Some(v) => v,
            None => m.usize("attention.key_length")?,
        };
        let v_head = match m.opt_usize("attention.value_length_mla")? {
            Some(v) => v,
            None => m.usize("attention.value_length")?,
        };
        if n_rot % 2 != 0 || n_rot >= qk_head {
            return Err(m.err(format!(
                "rope.dimension_count {n_rot} must be even and below key_length_mla {qk_head}"
            )));
        }
        let q_lora = m.opt_usize("attention.q_lora_rank")?.filter(|&r| r > 0);

        let rope_base = m.opt_f32("rope.freq_base")?.unwrap_or(10_000.0);
        let (rope, mscale) = match m.opt_str("rope.scaling.type")? {
            Some("yarn") if arch.dsa => {
                return Err(m.err(format!(
                    "metadata key '{}' = \"yarn\": YaRN with the DSA indexer is not modelled",
                    m.key("rope.scaling.type")
                )));
            }
            Some("yarn") => {
                let factor = m.f32("rope.scaling.factor")?;
                if factor <= 0.0 {
                    return Err(m.err(format!("rope.scaling.factor {factor} must be positive")));
                }
                let n_ctx_orig = m.usize("rope.scaling.original_context_length")?;
                let log_mul = m
                    .opt_f32("rope.scaling.yarn_log_multiplier")?
                    .unwrap_or(0.0);
                let freq_scale = 1.0 / factor;
                let mscale = 1.0 + log_mul as f64 * (1.0 / freq_scale as f64).ln();
                (Yarn::new(n_rot, rope_base, freq_scale, n_ctx_orig), mscale)
            }
            _ => {
                let freq_scale = m.linear_rope_scale()?;
                let mut y = Yarn::new(n_rot, rope_base, freq_scale, 1);
                y.ext_factor = 0.0;
                (y, 1.0)
            }
        };
        let kq_scale = (mscale * mscale / (qk_head as f64).sqrt()) as f32;

        let n_expert = m.usize("expert_count")?;
        let n_ff_exp = m.usize("expert_feed_forward_length")?;
        let n_shared = m.opt_usize("expert_shared_count")?.unwrap_or(0);
        if m.opt_usize("expert_group_count")?.unwrap_or(1) > 1 {
            return Err(m.err(format!(
                "metadata key '{}' > 1: group-limited routing is not modelled",
                m.key("expert_group_count")
            )));
        }
        let moe = MoeHparams {
            n_expert,
            n_expert_used: m.usize("expert_used_count")?,
            n_ff_exp,
            n_ff_shexp: n_shared * n_ff_exp,
            router: RouterConfig {
                gating: MoeHparams::gating(&m, arch.default_gating)?,
                n_used: m.usize("expert_used_count")?,
                norm: m.opt_bool("expert_weights_norm")?.unwrap_or(false),
                scale: m.opt_f32("expert_weights_scale")?.unwrap_or(1.0),
            },
        };
        moe.check(&m)?;
        let indexer = if arch.dsa {
            Some(IndexerHparams {
                n_head: m.usize("attention.indexer.head_count")?,
                head_dim: m.usize("attention.indexer.key_length")?,
                top_k: m.usize("attention.indexer.top_k")?,
            })
            .filter(|i| i.head_dim >= n_rot)
            .ok_or_else(|| m.err("attention.indexer.key_length is below rope.dimension_count"))
            .map(Some)?
        } else {
            None
        };
        let n_layer = block_count - n_nextn;
        let n_leading_dense = m.opt_usize("leading_dense_block_count")?.unwrap_or(0);
        if n_leading_dense > n_layer {
            return Err(m.err(format!(
                "leading_dense_block_count {n_leading_dense} > {n_layer} layers"
            )));
        }
        Ok(MlaModelHparams {
            n_vocab: m.n_vocab(n_embd)?,
            n_embd,
            n_layer,
            n_nextn,
            n_ff: if n_leading_dense > 0 {
                m.usize("feed_forward_length")?
            } else {
                0
            },
            n_leading_dense,
            n_ctx_train: m.usize("context_length")?,
            eps: m.f32("attention.layer_norm_rms_epsilon")?,
            mla: MlaDims {
                n_head,
                kv_lora,
                nope: qk_head - n_rot,
                rope: n_rot,
                v: v_head,
            },
            q_lora,
            rope,
            kq_scale,
            moe,
            indexer,
        })
    }

    fn mla_config(&self) -> MlaConfig {
        MlaConfig {
            dims: self.mla,
            n_embd: self.n_embd,
            q_lora: self.q_lora.unwrap_or(0),
            eps: self.eps,
            rope: Rope {
                mode: RopeMode::Norm,
                n_rot: self.mla.rope,
                base: self.rope.base,
                freq_scale: self.rope.freq_scale,
            },
            kq_scale: self.kq_scale,
        }
    }

    fn indexer_config(&self) -> Option<IndexerConfig> {
        let i = self.indexer?;
        Some(IndexerConfig {
            dims: IndexerDims {
                n_head: i.n_head,
                head_dim: i.head_dim,
                rope: self.mla.rope,
            },
            n_embd: self.n_embd,
            q_lora: self.q_lora.unwrap_or(0),
            // GLM-5: interleaved indexer RoPE (§8.3).
            rope: Rope::new(RopeMode::Norm, self.mla.rope, self.rope.base),
            k_norm_eps: INDEXER_K_NORM_EPS,
            top_k: i.top_k,
        })
    }
}

enum QProj {
    Lora {
        attn_q_a: Vec<f32>,
        attn_q_a_norm: Vec<f32>,
        attn_q_b: Vec<f32>,
    },
    Direct {
        attn_q: Vec<f32>,
    },
}

struct Indexer {
    attn_q_b: Vec<f32>,
    attn_k: Vec<f32>,
    k_norm_weight: Vec<f32>,
    k_norm_bias: Vec<f32>,
    proj: Vec<f32>,
}

impl Indexer {
    fn weights(&self) -> IndexerWeights<'_> {
        IndexerWeights {
            attn_q_b: &self.attn_q_b,
            attn_k: &self.attn_k,
            k_norm_weight: &self.k_norm_weight,
            k_norm_bias: &self.k_norm_bias,
            proj: &self.proj,
        }
    }
}

enum Ffn {
    Dense(DenseFfn),
    Moe(MoeLayer),
}

struct Layer {
    attn_norm: Vec<f32>,
    q: QProj,
    attn_kv_a_mqa: Vec<f32>,
    attn_kv_a_norm: Vec<f32>,
    attn_k_b: Vec<f32>,
    attn_v_b: Vec<f32>,
    attn_output: Vec<f32>,
    indexer: Option<Indexer>,
    ffn_norm: Vec<f32>,
    ffn: Ffn,
}

impl Layer {
    fn mla_weights(&self) -> MlaWeights<'_> {
        let (attn_q_a, attn_q_a_norm, attn_q_b): (&[f32], &[f32], &[f32]) = match &self.q {
            QProj::Lora {
                attn_q_a,
                attn_q_a_norm,
                attn_q_b,
            } => (attn_q_a, attn_q_a_norm, attn_q_b),
            QProj::Direct { .. } => (&[], &[], &[]),
        };
        MlaWeights {
            attn_q_a,
            attn_q_a_norm,
            attn_q_b,
            attn_kv_a_mqa: &self.attn_kv_a_mqa,
            attn_kv_a_norm: &self.attn_kv_a_norm,
            attn_k_b: &self.attn_k_b,
            attn_v_b: &self.attn_v_b,
            attn_output: &self.attn_output,
        }
    }

    fn load<B: AsRef<[u8]>>(
        gguf: &Gguf<B>,
        hp: &MlaModelHparams,
        il: usize,
    ) -> Result<Self, ModelError> {
        let e = hp.n_embd;
        let MlaDims {
            n_head,
            kv_lora,
            nope,
            rope,
            v,
        } = hp.mla;
        let t = |name: &str, dims: &[usize]| layer_tensor(gguf, il, name, dims);
        let q = match hp.q_lora {
            Some(r) => QProj::Lora {
                attn_q_a: t("attn_q_a", &[e, r])?,
                attn_q_a_norm: t("attn_q_a_norm", &[r])?,
                attn_q_b: t("attn_q_b", &[r, n_head * (nope + rope)])?,
            },
            None => QProj::Direct {
                attn_q: t("attn_q", &[e, n_head * (nope + rope)])?,
            },
        };
        // Indexer tensors are optional per layer (GLM-5.2 has them on "full" layers only).
        let indexer = match (hp.indexer, hp.q_lora) {
            (Some(i), Some(r)) => {
                match opt_layer_tensor(gguf, il, "indexer.attn_q_b", &[r, i.n_head * i.head_dim])? {
                    None => None,
                    Some(attn_q_b) => Some(Indexer {
                        attn_q_b,
                        attn_k: t("indexer.attn_k", &[e, i.head_dim])?,
                        k_norm_weight: t("indexer.k_norm.weight", &[i.head_dim])?,
                        k_norm_bias: t("indexer.k_norm.bias", &[i.head_dim])?,
                        proj: t("indexer.proj", &[e, i.n_head])?,
                    }),
                }
            }
            _ => None,
        };
        let ffn = if il < hp.n_leading_dense {
            Ffn::Dense(DenseFfn::load(gguf, il, "", e, hp.n_ff)?)
        } else {
            let bias_required = false;
            Ffn::Moe(MoeLayer::load(gguf, il, e, &hp.moe, bias_required)?)
        };
        Ok(Layer {
            attn_norm: t("attn_norm", &[e])?,
            q,
            attn_kv_a_mqa: t("attn_kv_a_mqa", &[e, kv_lora + rope])?,
            attn_kv_a_norm: t("attn_kv_a_norm", &[kv_lora])?,
            attn_k_b: t("attn_k_b", &[nope, kv_lora, n_head])?,
            attn_v_b: t("attn_v_b", &[kv_lora, v, n_head])?,
            attn_output: t("attn_output", &[n_head * v, e])?,
            indexer,
            ffn_norm: t("ffn_norm", &[e])?,
            ffn,
        })
    }
}

/// DeepSeek-style MTP tensors of one nextn block (model-specs §7.3).
struct Nextn {
    _eh_proj: Vec<f32>,
    _enorm: Vec<f32>,
    _hnorm: Vec<f32>,
    _shared_head_norm: Vec<f32>,
    _block: Layer,
}

/// The shared MLA + MoE model body, f32 weights.
pub struct MlaModel {
    pub hparams: MlaModelHparams,
    head: Head,
    layers: Vec<Layer>,
    nextn: Vec<Nextn>,
    /// Test hook: run every layer as dense MLA (the indexer cache is still filled).
    dense_attention: bool,
    /// Absorbed (llama.cpp's form, the default) or naive (decompressed) attention core.
    mode: MlaMode,
}

/// Per-layer latent caches (and indexer key caches) of an [`MlaModel`].
#[derive(Clone, Debug)]
pub struct MlaModelCache {
    pub(crate) mla: Vec<MlaCache>,
    pub(crate) idx: Vec<IndexerCache>,
    pub(crate) len: usize,
}

impl MlaModelCache {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// What a forward call selected: per indexer layer, per query token, the kv rows kept.
pub type DsaSelections = Vec<(usize, Vec<Vec<usize>>)>;

impl MlaModel {
    pub(crate) fn from_gguf<B: AsRef<[u8]>>(
        gguf: &Gguf<B>,
        arch: MlaArch,
    ) -> Result<Self, ModelError> {
        let hp = MlaModelHparams::from_gguf(gguf, arch)?;
        let layers = (0..hp.n_layer)
            .map(|il| Layer::load(gguf, &hp, il))
            .collect::<Result<Vec<_>, _>>()?;
        let e = hp.n_embd;
        let mut nextn = Vec::new();
        for il in hp.n_layer..hp.n_layer + hp.n_nextn {
            // llama.cpp skips MTP blocks; load them only when the file carries them.
            if gguf
                .tensor(&format!("blk.{il}.nextn.eh_proj.weight"))
                .is_none()
            {
                continue;
            }
            let t = |name: &str, dims: &[usize]| load_f32(gguf, &format!("blk.{il}.{name}"), dims);
            nextn.push(Nextn {
                _eh_proj: t("nextn.eh_proj.weight", &[2 * e, e])?,
                _enorm: t("nextn.enorm.weight", &[e])?,
                _hnorm: t("nextn.hnorm.weight", &[e])?,
                _shared_head_norm: t("nextn.shared_head_norm.weight", &[e])?,
                _block: Layer::load(gguf, &hp, il)?,
            });
        }
        let head = Head::load(gguf, e, hp.n_vocab, false)?;
        Ok(MlaModel {
            hparams: hp,
            head,
            layers,
            nextn,
            dense_attention: false,
            mode: MlaMode::Absorbed,
        })
    }

    /// MTP blocks loaded from the file (never run).
    pub fn n_nextn_loaded(&self) -> usize {
        self.nextn.len()
    }

    /// Layers carrying DSA indexer tensors.
    pub fn indexer_layers(&self) -> Vec<usize> {
        (0..self.layers.len())
            .filter(|&il| self.layers[il].indexer.is_some())
            .collect()
    }

    pub fn set_dense_attention(&mut self, dense: bool) {
        self.dense_attention = dense;
    }

    /// Test hook: the naive (decompressed K/V) or absorbed evaluation of MLA (§6.3); equal in
    /// exact arithmetic.
    pub fn set_mla_mode(&mut self, mode: MlaMode) {
        self.mode = mode;
    }

    pub fn new_cache(&self) -> MlaModelCache {
        let n = self.hparams.n_layer;
        MlaModelCache {
            mla: vec![MlaCache::new(self.hparams.mla); n],
            idx: vec![IndexerCache::default(); n],
            len: 0,
        }
    }

    /// Forward over `tokens` at positions `cache.len()..`; see the module doc. Also returns the
    /// DSA selections made (empty for models without an indexer).
    pub fn forward_traced(
        &self,
        cache: &mut MlaModelCache,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<(Vec<f32>, DsaSelections), ModelError> {
        let hp = &self.hparams;
        let start = cache.len;
        check_forward(
            tokens,
            hp.n_vocab,
            cache.mla.len(),
            hp.n_layer,
            start,
            hp.n_ctx_train,
        )?;
        let t = tokens.len();
        let positions: Vec<usize> = (start..start + t).collect();
        let cfg = hp.mla_config();
        let idx_cfg = hp.indexer_config();
        let mut selections: DsaSelections = Vec::new();
        let mut x = self.head.embed(tokens, 1.0);
        for (il, w) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &w.attn_norm, hp.eps);
            let mw = w.mla_weights();
            let a = match (&w.q, &w.indexer, idx_cfg) {
                (QProj::Lora { .. }, Some(iw), Some(ic)) if !self.dense_attention => {
                    let (out, sel) = dsa_mla_block(
                        &mw,
                        &cfg,
                        &iw.weights(),
                        &ic,
                        &h,
                        &mut cache.mla[il],
                        &mut cache.idx[il],
                        self.mode,
                    );
                    selections.push((il, sel));
                    out
                }
                (QProj::Lora { .. }, iw, ic) if hp.rope.ext_factor == 0.0 => {
                    if let (Some(iw), Some(ic)) = (iw, ic) {
                        cache.idx[il]
                            .k
                            .extend(indexer_k(&iw.weights(), &ic, &h, &positions));
                    }
                    // A layer without indexer reuses the last indexer layer's selection.
                    let reuse = selections
                        .last()
                        .filter(|_| !self.dense_attention)
                        .map(|(_, s)| s.as_slice());
                    mla_block(&mw, &cfg, &h, &mut cache.mla[il], reuse, self.mode)
                }
                _ => self.mla_own_projection(w, &cfg, &h, &positions, &mut cache.mla[il]),
            };
            add_in_place(&mut x, &a);
            let h = rms_norm(&x, &w.ffn_norm, hp.eps);
            let f = match &w.ffn {
                Ffn::Dense(d) => d.swiglu(hp.n_embd, &h),
                Ffn::Moe(moe) => moe.forward(&hp.moe, hp.n_embd, &h),
            };
            add_in_place(&mut x, &f);
        }
        cache.len = start + t;
        Ok((self.head.logits(&x, all_logits, hp.eps), selections))
    }

    /// MLA with a direct `attn_q` and/or YaRN RoPE (deepseek2), §6.3 steps 1-4 written out,
    /// then the shared attention core.
    fn mla_own_projection(
        &self,
        w: &Layer,
        cfg: &MlaConfig,
        h: &[f32],
        positions: &[usize],
        cache: &mut MlaCache,
    ) -> Vec<f32> {
        let hp = &self.hparams;
        let MlaDims {
            n_head,
            kv_lora,
            nope,
            rope,
            ..
        } = hp.mla;
        let (e, t) = (hp.n_embd, positions.len());
        let dq = nope + rope;
        let mut q = match &w.q {
            QProj::Lora {
                attn_q_a,
                attn_q_a_norm,
                attn_q_b,
            } => {
                let r = attn_q_a_norm.len();
                let qr = rms_norm(&par_matmul(attn_q_a, e, r, h, t), attn_q_a_norm, hp.eps);
                par_matmul(attn_q_b, r, n_head * dq, &qr, t)
            }
            QProj::Direct { attn_q } => par_matmul(attn_q, e, n_head * dq, h, t),
        };
        for (ti, &pos) in positions.iter().enumerate() {
            for hh in 0..n_head {
                hp.rope
                    .apply(&mut q[(ti * n_head + hh) * dq + nope..][..rope], pos);
            }
        }
        let ckv = par_matmul(&w.attn_kv_a_mqa, e, kv_lora + rope, h, t);
        let mut c = Vec::with_capacity(t * kv_lora);
        let mut k_pe = Vec::with_capacity(t * rope);
        for (row, &pos) in ckv.chunks_exact(kv_lora + rope).zip(positions) {
            c.extend_from_slice(&row[..kv_lora]);
            let mut kp = row[kv_lora..].to_vec();
            hp.rope.apply(&mut kp, pos);
            k_pe.extend(kp);
        }
        let c = rms_norm(&c, &w.attn_kv_a_norm, hp.eps);
        cache.append(&MlaProjection {
            qr: Vec::new(),
            q: Vec::new(),
            c,
            k_pe,
        });
        let mask = crate::attention::Mask::causal(positions);
        mla_attend_output(&w.mla_weights(), cfg, &q, cache, &mask, self.mode)
    }
}
