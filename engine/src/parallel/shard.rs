//! Which part of each tensor a rank holds, and weight sources that upload exactly that part (a
//! GGUF file's bytes, or the synthetic generator's window of the 1-GPU tensor).
//!
//! The split rules are spec data: each `[tensors]` entry's `split` (rows / cols / whole) of the
//! architecture's spec, here as the build's [`SPLITS`] table, applied by `memra_codegen::shard`
//! (the per-rank parts and windows), where the build also applies them to the dims to plan each
//! rank's specialized kernels (the spec's `[parallel] shards`); this file applies them to the
//! weights. For glm-dsa (specs/glm-dsa.toml): attention heads, routed experts, dense FFN and
//! shared expert and the LM head's vocabulary rows are split; norms, `attn_q_a`,
//! `attn_kv_a_mqa` (the latent cache is replicated), the indexer, the router and the embedding
//! are whole.
//!
//! A row block makes a partial output with whole rows (heads, experts, FFN columns); a column
//! block a partial sum of the full output. The decoder all-reduces the attention output and the
//! FFN output, the only places a partial result meets the residual stream, and all-gathers the
//! logits.

use std::fmt;
use std::ops::Range;

use cudarc::driver::CudaSlice;
use memra_codegen::shard as rules;
use memra_gguf::{Gguf, TensorInfo};

pub use memra_codegen::shard::{Cut, cut_of};

use crate::cuda::Gpu;
use crate::models::gpu::{DeviceTensor, Result, WeightSource, alloc, err};
use crate::models::mla::MlaConfig;

// `SPLITS`: (architecture, (tensor name pattern, cut) of its split tensors) of every spec with a
// `[parallel]` table, written by build.rs from specs/*.toml.
include!(concat!(env!("OUT_DIR"), "/splits.rs"));

/// The split tensors of `arch` ((GGUF name pattern with `{i}`, cut), from its spec); an error
/// naming the spec when the architecture does not split across GPUs.
pub fn splits(arch: &str) -> Result<&'static [(&'static str, Cut)]> {
    SPLITS
        .iter()
        .find(|(a, _)| *a == arch)
        .map(|(_, s)| *s)
        .ok_or_else(|| {
            err(format!(
                "architecture {arch} does not split across GPUs (specs/{arch}.toml has no [parallel] table)"
            ))
        })
}

/// Rank `rank` of `n_ranks`, and the architecture's split tensors ([`splits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub n_ranks: usize,
    pub splits: &'static [(&'static str, Cut)],
}

/// Rows `row0..row0 + rows` and elements `col0..col0 + cols` of each of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub row0: usize,
    pub rows: usize,
    pub col0: usize,
    pub cols: usize,
}

impl fmt::Display for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Window {
            row0,
            rows,
            col0,
            cols,
        } = self;
        write!(f, "rows {row0}+{rows} cols {col0}+{cols}")
    }
}

impl Window {
    /// An error naming `t` unless the window is whole quant blocks inside it.
    pub fn check(&self, t: &TensorInfo<'_>) -> Result<()> {
        let (k, n) = (t.row_len() as usize, t.n_rows() as usize);
        let bs = t.ggml_type.block_size() as usize;
        let Window {
            row0,
            rows,
            col0,
            cols,
        } = *self;
        if col0 % bs != 0 || cols % bs != 0 || col0 + cols > k || row0 + rows > n {
            return Err(err(format!(
                "tensor '{}': window {self} is not whole {} blocks of {bs} inside [{n} × {k}]",
                t.name,
                t.ggml_type.name()
            )));
        }
        Ok(())
    }
}

impl Shard {
    /// Rank `rank` of `n_ranks` of a model of architecture `arch`.
    pub fn new(arch: &str, rank: usize, n_ranks: usize) -> Result<Shard> {
        Ok(Shard {
            rank,
            n_ranks,
            splits: splits(arch)?,
        })
    }

    /// How tensor `name` is split.
    pub fn cut(&self, name: &str) -> Cut {
        cut_of(self.splits, name)
    }

    /// The `rank`-th of `n_ranks` equal parts of `0..total`; an error when they are not equal.
    pub fn part(&self, total: usize, what: &dyn Fn() -> String) -> Result<Range<usize>> {
        let r = rules::part(total as u64, self.rank, self.n_ranks, &what()).map_err(err)?;
        Ok(r.start as usize..r.end as usize)
    }

    /// The window of `t` this rank holds.
    pub fn window(&self, t: &TensorInfo<'_>) -> Result<Window> {
        let bs = t.ggml_type.block_size();
        let (r, c) = rules::window(
            self.cut(t.name),
            t.name,
            t.row_len(),
            t.n_rows(),
            bs,
            self.rank,
            self.n_ranks,
        )
        .map_err(err)?;
        let (row0, col0) = (r.start as usize, c.start as usize);
        let (rows, cols) = ((r.end - r.start) as usize, (c.end - c.start) as usize);
        Ok(Window {
            row0,
            rows,
            col0,
            cols,
        })
    }

    /// The per-rank config: `n_head / N` heads (the MoE config keeps the global expert count:
    /// the router scores all of them). Refuses head, expert and indexer-head counts that do
    /// not split evenly, naming them.
    pub fn config(&self, cfg: &MlaConfig) -> Result<MlaConfig> {
        let mut c = cfg.clone();
        let heads = self.part(cfg.n_head, &|| "attention heads".into())?;
        c.n_head = heads.len();
        if let Some(m) = &cfg.moe {
            self.part(m.n_expert, &|| "routed experts".into())?;
        }
        Ok(c)
    }

    /// The experts this rank holds (`None` without MoE).
    pub fn experts(&self, cfg: &MlaConfig) -> Result<Option<Range<usize>>> {
        cfg.moe
            .as_ref()
            .map(|m| self.part(m.n_expert, &|| "routed experts".into()))
            .transpose()
    }
}

/// Whether a glm-dsa file splits over `n_ranks` GPUs (heads, experts, every split tensor's rows
/// or whole-block columns), before any GPU work; the error names what does not divide.
pub fn check_split<B: AsRef<[u8]>>(
    path: &std::path::Path,
    file: &Gguf<B>,
    n_ranks: usize,
) -> Result<()> {
    let spec = crate::models::glm_dsa::mla_spec(path, file)?;
    let arch = file
        .architecture()
        .map_err(|e| err(format!("{}: {e}", path.display())))?;
    for rank in [0, n_ranks.saturating_sub(1)] {
        let s = Shard::new(arch, rank, n_ranks)?;
        s.config(&spec.config)?;
        for t in file.tensors() {
            s.window(&t)?;
        }
    }
    Ok(())
}

/// A weight source that can upload a window of a tensor.
pub trait SliceSource: WeightSource {
    /// The window `w` of `t` (whole quant blocks) as a tensor of `w.rows` rows of `w.cols`.
    fn upload_window(&self, gpu: &Gpu, t: &TensorInfo<'_>, w: Window) -> Result<DeviceTensor>;
}

impl<B: AsRef<[u8]>> SliceSource for Gguf<B> {
    fn upload_window(&self, gpu: &Gpu, t: &TensorInfo<'_>, w: Window) -> Result<DeviceTensor> {
        let bytes = window_bytes(self.tensor_data(*t), t, w)?;
        let what = format!("tensor '{}' ({w})", t.name);
        let mut data = alloc::<u8>(gpu, bytes.len(), &what)?;
        gpu.stream()
            .memcpy_htod(&bytes, &mut data)
            .map_err(|e| err(format!("copying {what} to the GPU: {e:?}")))?;
        let (name, ty) = (t.name.to_string(), t.ggml_type);
        Ok(DeviceTensor {
            name,
            ty,
            k: w.cols,
            n: w.rows,
            data,
        })
    }
}

/// The bytes of a window of a tensor's data (`data`: the whole tensor as stored).
pub fn window_bytes(data: &[u8], t: &TensorInfo<'_>, w: Window) -> Result<Vec<u8>> {
    w.check(t)?;
    let Window {
        row0,
        rows,
        col0,
        cols,
    } = w;
    let ty = t.ggml_type;
    let (k, n) = (t.row_len(), t.n_rows() as usize);
    let bs = ty.block_size() as usize;
    let row_bytes = ty.row_bytes(k).ok_or_else(|| {
        err(format!(
            "tensor '{}': rows of {k} are not whole {} blocks",
            t.name,
            ty.name()
        ))
    })? as usize;
    let (b0, nb) = (
        (col0 / bs) * ty.type_size() as usize,
        (cols / bs) * ty.type_size() as usize,
    );
    if data.len() < n * row_bytes {
        return Err(err(format!(
            "tensor '{}': {} data bytes, {} expected (truncated?)",
            t.name,
            data.len(),
            n * row_bytes
        )));
    }
    let mut out = Vec::with_capacity(rows * nb);
    for r in row0..row0 + rows {
        out.extend_from_slice(&data[r * row_bytes + b0..r * row_bytes + b0 + nb]);
    }
    Ok(out)
}

/// One rank's view of a [`SliceSource`]: uploads the rank's window of each tensor.
pub struct ShardSource<'a> {
    pub src: &'a dyn SliceSource,
    pub shard: Shard,
}

impl WeightSource for ShardSource<'_> {
    fn upload(&self, gpu: &Gpu, t: &TensorInfo<'_>) -> Result<DeviceTensor> {
        if self.shard.cut(t.name) == Cut::Whole {
            return self.src.upload(gpu, t);
        }
        let w = self.shard.window(t)?;
        self.src.upload_window(gpu, t, w)
    }

    fn upload_f32(&self, gpu: &Gpu, t: &TensorInfo<'_>) -> Result<CudaSlice<f32>> {
        if self.shard.cut(t.name) != Cut::Whole {
            return Err(err(format!(
                "tensor '{}' is split across GPUs but was asked for as f32",
                t.name
            )));
        }
        self.src.upload_f32(gpu, t)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use memra_codegen::fixture;
    use memra_codegen::spec::ArchSpec;
    use memra_gguf::{Gguf, quant};
    use memra_reference::models::MlaModelHparams;

    use super::*;
    #[cfg(feature = "model-glm-dsa")]
    use crate::kernels::registry::Param;
    #[cfg(feature = "model-glm-dsa")]
    use crate::models::gpu;

    fn shard(rank: usize, n_ranks: usize) -> Shard {
        Shard::new("glm-dsa", rank, n_ranks).unwrap()
    }

    fn micro() -> Gguf<Vec<u8>> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let spec = ArchSpec::load(&root.join("specs/glm-dsa.toml")).unwrap();
        Gguf::parse(fixture::micro_model(&spec, 3).unwrap()).unwrap()
    }

    /// The windows of two ranks, dequantized, are the 1-GPU tensor's rows / columns, for every
    /// split tensor of the micro model; the concatenation covers it exactly.
    #[test]
    fn windows_of_the_ranks_tile_the_tensor() {
        let file = micro();
        let mut checked = 0;
        for t in file.tensors() {
            let cut = shard(0, 2).cut(t.name);
            if cut == Cut::Whole {
                continue;
            }
            let (k, n) = (t.row_len() as usize, t.n_rows() as usize);
            let full = quant::dequantize(t.ggml_type, file.tensor_data(t), k * n).unwrap();
            let n_ranks = 2;
            for rank in 0..n_ranks {
                let s = shard(rank, n_ranks);
                let w = match s.window(&t) {
                    Ok(w) => w,
                    // Micro dims may not split into whole blocks; that must be an error naming the tensor.
                    Err(e) => {
                        assert!(e.to_string().contains(t.name), "{e}");
                        continue;
                    }
                };
                let (r0, rows, c0, cols) = (w.row0, w.rows, w.col0, w.cols);
                match cut {
                    Cut::Rows => assert_eq!(
                        (r0, rows, c0, cols),
                        (rank * n / 2, n / 2, 0, k),
                        "{}",
                        t.name
                    ),
                    Cut::Cols => assert_eq!(
                        (r0, rows, c0, cols),
                        (0, n, rank * k / 2, k / 2),
                        "{}",
                        t.name
                    ),
                    Cut::Whole => unreachable!(),
                }
                let bytes = window_bytes(file.tensor_data(t), &t, w).unwrap();
                let got = quant::dequantize(t.ggml_type, &bytes, rows * cols).unwrap();
                for r in 0..rows {
                    let want = &full[(r0 + r) * k + c0..(r0 + r) * k + c0 + cols];
                    assert_eq!(
                        &got[r * cols..(r + 1) * cols],
                        want,
                        "{} rank {rank} row {r}",
                        t.name
                    );
                }
                checked += 1;
            }
        }
        assert!(checked >= 8, "only {checked} windows checked");
    }

    /// The build's table is every spec's `split`s; an architecture without `[parallel]` is
    /// refused by name.
    #[test]
    fn split_table_is_the_specs() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let mut split_archs = 0;
        for entry in std::fs::read_dir(root.join("specs")).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "toml") {
                continue;
            }
            let spec = ArchSpec::load(&path).unwrap();
            match &spec.parallel {
                Some(_) => {
                    let want = memra_codegen::shard::splits(&spec);
                    assert_eq!(splits(&spec.arch).unwrap(), &want[..], "{}", spec.arch);
                    assert!(!want.is_empty(), "{}", spec.arch);
                    split_archs += 1;
                }
                None => {
                    let e = splits(&spec.arch).unwrap_err().to_string();
                    assert!(e.contains(&spec.arch) && e.contains("[parallel]"), "{e}");
                }
            }
        }
        assert!(split_archs >= 1, "no spec splits across GPUs");
        assert_eq!(SPLITS.len(), split_archs);
    }

    #[test]
    fn glm5_splits_over_2_4_8_gpus_but_not_3() {
        let desc = crate::synthetic::describe("glm-5", 4).unwrap();
        let file = desc.open().unwrap();
        let path = Path::new("glm-5");
        for n in [1, 2, 4, 8] {
            check_split(path, &file, n).unwrap_or_else(|e| panic!("{n} GPUs: {e}"));
        }
        let e = check_split(path, &file, 3).unwrap_err().to_string();
        assert!(e.contains("3 equal parts"), "{e}");
        let e = check_split(path, &file, 512).unwrap_err().to_string();
        assert!(e.contains("512 equal parts"), "{e}");
    }

    #[test]
    fn configs_that_do_not_split_are_refused() {
        let hp = MlaModelHparams::from_gguf(&micro()).unwrap();
        let cfg = crate::models::mla::config_from("glm-dsa", "interleaved", &hp);
        let two = shard(1, 2).config(&cfg).unwrap();
        assert_eq!(two.n_head, cfg.n_head / 2);
        assert_eq!(
            two.moe.as_ref().unwrap().n_expert,
            cfg.moe.as_ref().unwrap().n_expert,
            "the router keeps every expert"
        );
        assert_eq!(shard(1, 2).experts(&cfg).unwrap(), Some(2..4));
        let e = shard(0, 3).config(&cfg).unwrap_err().to_string();
        assert!(
            e.contains("attention heads") && e.contains("3 equal parts"),
            "{e}"
        );
        let mut odd = cfg.clone();
        odd.moe.as_mut().unwrap().n_expert = 6;
        let e = shard(0, 4).config(&odd).unwrap_err().to_string();
        assert!(e.contains("routed experts"), "{e}");
    }

    /// The kernel requests a rank of a GLM-5-dims model makes (models/mla.rs's `KernelPlan`
    /// calls) for every launch on a split tensor or a per-rank dim, from the rank's windows
    /// and config: (family, request, what).
    #[cfg(feature = "model-glm-dsa")]
    fn rank_requests(shard: Shard) -> Vec<(&'static str, Vec<(&'static str, Param)>, String)> {
        let desc = crate::synthetic::describe("glm-5", 4).unwrap(); // 3 dense + 1 MoE layer
        let file = desc.open().unwrap();
        let spec = crate::models::glm_dsa::mla_spec(Path::new("glm-5"), &file).unwrap();
        let cfg = shard.config(&spec.config).unwrap();
        let moe = cfg.moe.clone().unwrap();
        let int = |v: usize| Param::Int(v as i64);
        let sym = Param::Sym;
        let mut out = Vec::new();
        for t in file.tensors() {
            let role = t.name.rsplit_once("blk.").map_or(t.name, |(_, r)| {
                r.split_once('.').map_or(r, |(_, role)| role)
            });
            if shard.cut(t.name) == Cut::Whole {
                continue;
            }
            let w = shard.window(&t).unwrap();
            let q = |family| sym(gpu::qtype_token(family, t.ggml_type).unwrap());
            let what = format!("{} ({w})", t.name);
            let mut expert = |k: usize, n: usize, mode| {
                let req = [("k", int(k)), ("n", int(n))];
                let req = [&req[..], &[("qtype", q("moe_matvec")), ("mode", sym(mode))]].concat();
                out.push(("moe_matvec", req, what.clone()));
            };
            match role {
                "attn_k_b.weight" => expert(w.cols, cfg.kv_lora, "plain"),
                "attn_v_b.weight" => expert(w.cols, cfg.v, "plain"),
                "ffn_gate_exps.weight" => expert(w.cols, moe.n_ff_exp, "swiglu"),
                "ffn_down_exps.weight" => expert(w.cols, cfg.n_embd, "down"),
                "ffn_up_exps.weight" => {}
                // A decode step projects the rank's attn_q_b rows stacked with the layer's
                // replicated indexer.attn_q_b (gpu::Stack: one type and row length); prefill
                // each alone.
                "attn_q_b.weight" => {
                    let indexer = t.name.replace("attn_q_b", "indexer.attn_q_b");
                    let stacked = file
                        .tensor(&indexer)
                        .filter(|i| i.ggml_type == t.ggml_type && i.row_len() == t.row_len())
                        .map_or(0, |i| i.n_rows() as usize);
                    for (family, n) in [("matvec", w.rows + stacked), ("matmul", w.rows)] {
                        let req = vec![("k", int(w.cols)), ("n", int(n)), ("qtype", q(family))];
                        out.push((family, req, what.clone()));
                    }
                }
                _ => {
                    if role == "ffn_gate.weight" || role == "ffn_gate_shexp.weight" {
                        expert(w.cols, w.rows, "swiglu");
                        out.push(("swiglu", vec![("n_ff", int(w.rows))], what.clone()));
                    }
                    for family in ["matvec", "matmul"] {
                        let req =
                            vec![("k", int(w.cols)), ("n", int(w.rows)), ("qtype", q(family))];
                        out.push((family, req, what.clone()));
                    }
                }
            }
        }
        let mla = vec![
            ("n_head", int(cfg.n_head)),
            ("kv_lora", int(cfg.kv_lora)),
            ("rope", int(cfg.rope)),
            ("cache_t", sym("bf16")),
        ];
        let mut rope = mla.clone();
        rope.extend([("nope", int(cfg.nope)), ("rope_mode", sym(cfg.rope_mode))]);
        let heads = format!("{} heads", cfg.n_head);
        out.push(("mla_rope", rope, heads.clone()));
        out.push(("mla_decode", mla.clone(), heads.clone()));
        out.push(("mla_sparse_decode", mla, heads));
        out
    }

    /// Every such launch of every rank of each GPU count this build planned
    /// (`[parallel] shards` / `MEMRA_SHARDS`) finds a specialized variant, so
    /// `--require-specialized` holds on a sharded run; a count not planned does not.
    #[cfg(feature = "model-glm-dsa")]
    #[test]
    fn every_sharded_launch_of_glm5_has_a_specialized_variant() {
        use crate::kernels::registry::{Policy, SHARDS_FOR, select_with};
        let counts = SHARDS_FOR
            .iter()
            .find(|(a, _)| *a == "glm-dsa")
            .map_or(&[][..], |(_, c)| *c);
        assert!(
            !counts.is_empty(),
            "this build planned no glm-dsa shard shapes"
        );
        for &n_ranks in counts {
            for rank in [0, n_ranks - 1] {
                let reqs = rank_requests(shard(rank, n_ranks));
                // 4 layers: attention q_b, attn_output (matvec + matmul), k_b, v_b (6); dense
                // FFN gate (fused gate/up, swiglu, 2 linear), up, down (8); MoE experts (2),
                // shared expert like a dense FFN (8); the LM head (2); 3 MLA kernels.
                assert_eq!(
                    reqs.len(),
                    3 * (6 + 8) + (6 + 2 + 8) + 2 + 3,
                    "{n_ranks} GPUs"
                );
                for (family, req, what) in &reqs {
                    let s = select_with(family, req, Policy::RequireSpecialized)
                        .unwrap_or_else(|e| panic!("{n_ranks} GPUs rank {rank}, {what}: {e}"));
                    assert!(s.specialized, "{}", s.reason);
                }
            }
        }
        // A GPU count glm-dsa did not plan, whose per-rank head count no other built spec
        // specializes either (deepseek2's 16 heads are 4 ranks' share of 64).
        let other_heads = |h: usize| {
            crate::kernels::registry::family("mla_decode")
                .iter()
                .any(|v| !v.is_generic() && v.param("n_head") == Some(Param::Int(h as i64)))
        };
        let unplanned = (2..=64)
            .find(|n| 64 % n == 0 && !counts.contains(n) && !other_heads(64 / n))
            .unwrap();
        let reqs = rank_requests(shard(0, unplanned));
        let (family, req, _) = reqs.iter().find(|r| r.0 == "mla_decode").unwrap();
        let e = select_with(family, req, Policy::RequireSpecialized).unwrap_err();
        assert!(
            e.to_string().contains("specialized variant is required"),
            "{e}"
        );
    }
}
