//! Gemma 3 CPU reference forward (model-specs §5; llama.cpp `src/models/gemma3-iswa.cpp`).
//!
//! Per token: `x = E[tok]·sqrt(n_embd)`; per layer `l`:
//! - `h = rms(x)·attn_norm`; `q, k, v = Wq h, Wk h, Wv h`; `q, k` get a per-head RMSNorm with
//!   `attn_q_norm` / `attn_k_norm` (the GGUF stores `1 + w`, so the weight is used as is), then
//!   NEOX RoPE with the layer's base; `q *= attn_scale`; softmax attention with scale 1,
//!   causal, and on sliding-window layers limited to the last `sliding_window` positions.
//! - `x += rms(Wo·attn)·post_attention_norm`;
//!   `x += rms(down(gelu_tanh(gate h') ⊙ up h'))·post_ffw_norm` with `h' = rms(x)·ffn_norm`.
//!
//! Then `logits = E · (rms(x)·output_norm)` (tied head unless `output.weight` exists).
//! Weights are dequantized to f32 at load; matmuls accumulate in f64 (this crate's `dot`).

use std::path::Path;

use memra_gguf::{Gguf, GgufFile};

use super::common::{
    GqaParams, GqaWeights, Head, KvCache, QkNorm, add_in_place, check_forward, gqa_block,
    layer_tensor,
};
use super::{ModelError, par_matmul};
use crate::act::geglu;
use crate::attention::AttnShape;
use crate::norm::rms_norm;
use crate::rope::{Rope, RopeMode};

/// llama.cpp `set_swa_pattern(6)` for gemma3: five sliding-window layers, then one global.
pub const DEFAULT_SWA_PERIOD: usize = 6;
/// llama.cpp `rope_freq_base_train_swa` for gemma3 (hard-coded there; newer converters may
/// write `gemma3.rope.freq_base_swa`).
pub const DEFAULT_ROPE_BASE_SWA: f32 = 10_000.0;

/// Hyper-parameters from the `gemma3.*` keys.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma3Hparams {
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// Rotated dims per head (`rope.dimension_count`, default `head_dim_k`).
    pub n_rot: usize,
    /// `context_length`: the most positions the KV cache holds.
    pub n_ctx_train: usize,
    pub eps: f32,
    /// Global layers: `rope.freq_base` and linear scaling `1/rope.scaling.factor`.
    pub rope_base: f32,
    pub rope_freq_scale: f32,
    /// Sliding-window layers: `rope.freq_base_swa` (default 10000), no scaling.
    pub rope_base_swa: f32,
    /// `attention.sliding_window`; `None` means every layer is global.
    pub sliding_window: Option<usize>,
    /// Per layer: true if it uses the sliding window (and the local rope base).
    pub is_swa: Vec<bool>,
    /// Multiplies q before attention (llama.cpp `f_attention_scale`).
    pub attn_scale: f32,
    /// `final_logit_softcapping` if present and non-zero (null for Gemma 3).
    pub final_logit_softcap: Option<f32>,
}

impl Gemma3Hparams {
    pub fn from_gguf<B: AsRef<[u8]>>(gguf: &Gguf<B>) -> Result<Self, ModelError> {
        let path = gguf.path();
        let arch = gguf.architecture()?;
        if arch != "gemma3" {
            return Err(ModelError::new(
                path,
                format!("general.architecture is \"{arch}\", expected \"gemma3\""),
            ));
        }
        let key = |s: &str| format!("gemma3.{s}");
        let opt = |r: memra_gguf::Result<usize>| -> Result<Option<usize>, ModelError> {
            match r {
                Ok(v) => Ok(Some(v)),
                Err(e) if e.is_missing_key() => Ok(None),
                Err(e) => Err(e.into()),
            }
        };
        let opt_f32 = |k: &str| -> Result<Option<f32>, ModelError> {
            match gguf.get_f32(k) {
                Ok(v) => Ok(Some(v)),
                Err(e) if e.is_missing_key() => Ok(None),
                Err(e) => Err(e.into()),
            }
        };
        let positive = |k: &str, v: usize| -> Result<usize, ModelError> {
            if v == 0 {
                Err(ModelError::new(path, format!("metadata key '{k}' is 0")))
            } else {
                Ok(v)
            }
        };

        let n_embd = positive(
            &key("embedding_length"),
            gguf.get_usize(&key("embedding_length"))?,
        )?;
        let n_layer = positive(&key("block_count"), gguf.get_usize(&key("block_count"))?)?;
        let n_ff = positive(
            &key("feed_forward_length"),
            gguf.get_usize(&key("feed_forward_length"))?,
        )?;
        let n_head = positive(
            &key("attention.head_count"),
            gguf.get_usize(&key("attention.head_count"))?,
        )?;
        let n_head_kv = opt(gguf.get_usize(&key("attention.head_count_kv")))?.unwrap_or(n_head);
        if n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(ModelError::new(
                path,
                format!(
                    "attention.head_count {n_head} is not a multiple of attention.head_count_kv {n_head_kv}"
                ),
            ));
        }
        let head_dim_k =
            opt(gguf.get_usize(&key("attention.key_length")))?.unwrap_or(n_embd / n_head);
        let head_dim_v =
            opt(gguf.get_usize(&key("attention.value_length")))?.unwrap_or(n_embd / n_head);
        let n_rot = opt(gguf.get_usize(&key("rope.dimension_count")))?.unwrap_or(head_dim_k);
        if head_dim_k == 0 || head_dim_v == 0 || n_rot % 2 != 0 || n_rot > head_dim_k {
            return Err(ModelError::new(
                path,
                format!(
                    "head dims k {head_dim_k} / v {head_dim_v} with rope.dimension_count {n_rot} are not usable"
                ),
            ));
        }
        let n_ctx_train = positive(
            &key("context_length"),
            gguf.get_usize(&key("context_length"))?,
        )?;
        let eps = gguf.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
        let rope_base = opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0);
        let rope_base_swa = opt_f32(&key("rope.freq_base_swa"))?.unwrap_or(DEFAULT_ROPE_BASE_SWA);

        // Linear scaling on global layers only (4B/12B/27B use ×8; the 270M none).
        let scaling_type = match gguf.get_str(&key("rope.scaling.type")) {
            Ok(t) => Some(t.to_string()),
            Err(e) if e.is_missing_key() => None,
            Err(e) => return Err(e.into()),
        };
        let factor = match opt_f32(&key("rope.scaling.factor"))? {
            Some(f) => Some(f),
            None => opt_f32(&key("rope.scale_linear"))?,
        };
        let rope_freq_scale = match (scaling_type.as_deref(), factor) {
            (Some("none"), _) | (None | Some("linear"), None) => 1.0,
            (None | Some("linear"), Some(f)) if f > 0.0 => 1.0 / f,
            (None | Some("linear"), Some(f)) => {
                return Err(ModelError::new(
                    path,
                    format!("rope scaling factor {f} must be positive"),
                ));
            }
            (Some(other), _) => {
                return Err(ModelError::new(
                    path,
                    format!(
                        "metadata key 'gemma3.rope.scaling.type' = \"{other}\" is not supported (linear or none)"
                    ),
                ));
            }
        };

        let sliding_window =
            opt(gguf.get_usize(&key("attention.sliding_window")))?.filter(|&w| w > 0);
        let is_swa = match sliding_window {
            None => vec![false; n_layer],
            Some(_) => swa_layers(gguf, &key("attention.sliding_window_pattern"), n_layer)?,
        };

        // llama.cpp: 1/sqrt(head_dim) except for the 27B (62 layers), which uses
        // query_pre_attn_scalar = n_embd / n_head.
        let attn_scale = if n_layer == 62 {
            1.0 / ((n_embd / n_head) as f32).sqrt()
        } else {
            1.0 / (head_dim_k as f32).sqrt()
        };
        let final_logit_softcap = opt_f32(&key("final_logit_softcapping"))?.filter(|&c| c != 0.0);

        let embd = super::tensor_info(gguf, "token_embd.weight")?;
        if embd.dims.len() != 2 || embd.dims[0] != n_embd as u64 {
            return Err(ModelError::new(
                path,
                format!(
                    "tensor 'token_embd.weight' has shape {:?}, expected [{n_embd}, n_vocab]",
                    embd.dims
                ),
            ));
        }
        let n_vocab = embd.dims[1] as usize;

        Ok(Gemma3Hparams {
            n_vocab,
            n_embd,
            n_layer,
            n_ff,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            n_rot,
            n_ctx_train,
            eps,
            rope_base,
            rope_freq_scale,
            rope_base_swa,
            sliding_window,
            is_swa,
            attn_scale,
            final_logit_softcap,
        })
    }

    /// The RoPE of layer `il`: local base on sliding-window layers, global base and scaling
    /// elsewhere (llama.cpp `get_rope_freq_base` / `get_rope_freq_scale`).
    pub fn rope(&self, il: usize) -> Rope {
        if self.is_swa[il] {
            Rope::new(RopeMode::Neox, self.n_rot, self.rope_base_swa)
        } else {
            Rope {
                mode: RopeMode::Neox,
                n_rot: self.n_rot,
                base: self.rope_base,
                freq_scale: self.rope_freq_scale,
            }
        }
    }

    pub fn shape(&self) -> AttnShape {
        AttnShape {
            n_head: self.n_head,
            n_kv_head: self.n_head_kv,
            head_dim_k: self.head_dim_k,
            head_dim_v: self.head_dim_v,
        }
    }

    /// The sliding window of layer `il`, `None` on global layers.
    pub fn window(&self, il: usize) -> Option<usize> {
        self.sliding_window.filter(|_| self.is_swa[il])
    }
}

/// Which layers use the sliding window. `key` (optional) is either a period `p` (layer `il`
/// is local iff `il % p < p − 1`, llama.cpp `set_swa_pattern`) or one bool per layer; absent,
/// gemma3's period 6 applies.
fn swa_layers<B: AsRef<[u8]>>(
    gguf: &Gguf<B>,
    key: &str,
    n_layer: usize,
) -> Result<Vec<bool>, ModelError> {
    use memra_gguf::{MetaArrayRef, MetaValueRef};
    let by_period = |p: usize| (0..n_layer).map(|il| p == 0 || il % p < p - 1).collect();
    match gguf.get(key) {
        None => Ok(by_period(DEFAULT_SWA_PERIOD)),
        Some(MetaValueRef::Array(MetaArrayRef::Bool(v))) if v.len() == n_layer => Ok(v.to_vec()),
        Some(MetaValueRef::Array(a)) => {
            let ints = gguf.get_u64_array(key)?;
            if ints.len() != n_layer {
                return Err(ModelError::new(
                    gguf.path(),
                    format!(
                        "metadata key '{key}' has {} entries, expected one per layer ({n_layer})",
                        a.len()
                    ),
                ));
            }
            Ok(ints.iter().map(|&v| v != 0).collect())
        }
        Some(_) => Ok(by_period(gguf.get_usize(key)?)),
    }
}

/// One layer's weights, f32, named after their GGUF tensors (`blk.{i}.<name>.weight`).
struct Layer {
    attn_norm: Vec<f32>,
    attn: GqaWeights,
    post_attention_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    ffn_gate: Vec<f32>,
    ffn_up: Vec<f32>,
    ffn_down: Vec<f32>,
    post_ffw_norm: Vec<f32>,
}

/// The Gemma 3 model with f32 weights.
pub struct Gemma3 {
    pub hparams: Gemma3Hparams,
    /// Tied to `token_embd` unless the file has `output.weight`.
    head: Head,
    layers: Vec<Layer>,
}

/// KV cache: per layer, `[len, n_head_kv, head_dim]` rows for positions `0..len`.
pub type Gemma3Cache = KvCache;

impl Gemma3 {
    /// Opens `path` and loads it (see [`Gemma3::from_gguf`]).
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        let gguf = GgufFile::open(path.as_ref())?;
        Self::from_gguf(&gguf)
    }

    /// Reads the hparams and dequantizes every weight to f32 (rows split over threads).
    pub fn from_gguf<B: AsRef<[u8]>>(gguf: &Gguf<B>) -> Result<Self, ModelError> {
        let hp = Gemma3Hparams::from_gguf(gguf)?;
        let (e, ff) = (hp.n_embd, hp.n_ff);
        let mut layers = Vec::with_capacity(hp.n_layer);
        for il in 0..hp.n_layer {
            let t = |name: &str, dims: &[usize]| layer_tensor(gguf, il, name, dims);
            layers.push(Layer {
                attn_norm: t("attn_norm", &[e])?,
                attn: GqaWeights::load(gguf, il, e, hp.shape(), QkNorm::PerHead)?,
                post_attention_norm: t("post_attention_norm", &[e])?,
                ffn_norm: t("ffn_norm", &[e])?,
                ffn_gate: t("ffn_gate", &[e, ff])?,
                ffn_up: t("ffn_up", &[e, ff])?,
                ffn_down: t("ffn_down", &[ff, e])?,
                post_ffw_norm: t("post_ffw_norm", &[e])?,
            });
        }
        let head = Head::load(gguf, e, hp.n_vocab, false)?;
        Ok(Gemma3 {
            hparams: hp,
            head,
            layers,
        })
    }

    pub fn new_cache(&self) -> Gemma3Cache {
        KvCache::new(self.hparams.n_layer)
    }

    /// Runs `tokens` at positions `cache.len()..`, appending their K/V to `cache`: one call
    /// with the whole prompt is a batched prefill, calls with one token are decode steps.
    /// Returns the logits `[n_out, n_vocab]`: every position if `all_logits`, else the last.
    pub fn forward(
        &self,
        cache: &mut Gemma3Cache,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, ModelError> {
        let hp = &self.hparams;
        let start = cache.len;
        check_forward(
            tokens,
            hp.n_vocab,
            cache.k.len(),
            hp.n_layer,
            start,
            hp.n_ctx_train,
        )?;
        let t = tokens.len();
        let positions: Vec<usize> = (start..start + t).collect();
        let e = hp.n_embd;
        let mut x = self.head.embed(tokens, (e as f32).sqrt());
        for (il, w) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &w.attn_norm, hp.eps);
            let rope = hp.rope(il);
            let params = GqaParams {
                shape: hp.shape(),
                n_embd: e,
                eps: hp.eps,
                rope: &rope,
                q_scale: hp.attn_scale,
                kq_scale: 1.0,
                window: hp.window(il),
            };
            let o = gqa_block(
                &w.attn,
                &params,
                QkNorm::PerHead,
                &h,
                &positions,
                &mut cache.k[il],
                &mut cache.v[il],
            );
            let o = rms_norm(&o, &w.post_attention_norm, hp.eps);
            add_in_place(&mut x, &o);

            let h = rms_norm(&x, &w.ffn_norm, hp.eps);
            let gate = par_matmul(&w.ffn_gate, e, hp.n_ff, &h, t);
            let up = par_matmul(&w.ffn_up, e, hp.n_ff, &h, t);
            let f = par_matmul(&w.ffn_down, hp.n_ff, e, &geglu(&gate, &up), t);
            let f = rms_norm(&f, &w.post_ffw_norm, hp.eps);
            add_in_place(&mut x, &f);
        }
        cache.len = start + t;

        let mut logits = self.head.logits(&x, all_logits, hp.eps);
        if let Some(cap) = hp.final_logit_softcap {
            for l in &mut logits {
                *l = cap * (*l / cap).tanh();
            }
        }
        Ok(logits)
    }

    /// Test hook: changes the sliding window (e.g. to a few positions, so that short
    /// sequences exercise the window mask). `None` makes every layer attend globally.
    pub fn set_sliding_window(&mut self, window: Option<usize>) {
        self.hparams.sliding_window = window.filter(|&w| w > 0);
    }
}
