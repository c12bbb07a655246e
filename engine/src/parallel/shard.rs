//! Which part of each MLA-model tensor a rank holds, and weight sources that upload exactly that
//! part (a GGUF file's bytes, or the synthetic generator's window of the 1-GPU tensor).
//!
//! Rank r of N holds (GGUF names; rows = the product of the dims after ne0):
//! - heads `r·H/N ..`: `attn_q_b`, `attn_k_b`, `attn_v_b` row blocks (their rows are head-major),
//!   `attn_output` column block (its row length is n_head · v_head_dim, head-major);
//! - experts `r·E/N ..`: `ffn_{gate,up,down}_exps` row blocks (expert-major rows);
//! - dense FFN and shared expert: `ffn_gate`/`ffn_up` (and `_shexp`) row blocks,
//!   `ffn_down` (and `_shexp`) column block;
//! - vocabulary rows `r·V/N ..` of `output.weight` (the LM head; its logits are all-gathered);
//! - everything else whole: norms, `attn_q_a`, `attn_kv_a_mqa` (the latent cache is
//!   replicated), the indexer, the router and its bias, the embedding (a tied LM head too).
//!
//! A row block makes a partial output with whole rows (heads, experts, FFN columns); a column
//! block a partial sum of the full output. The decoder all-reduces the attention output and the
//! FFN output, the only places a partial result meets the residual stream, and all-gathers the
//! logits.

use std::ops::Range;

use cudarc::driver::CudaSlice;
use memra_gguf::{Gguf, TensorInfo};

use crate::cuda::Gpu;
use crate::models::gpu::{DeviceTensor, Result, WeightSource, alloc, err};
use crate::models::mla::MlaConfig;
use crate::synthetic::SyntheticWeights;

/// How a tensor is split across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    Whole,
    /// Equal row blocks.
    Rows,
    /// Equal column blocks (each row's elements), whole quant blocks.
    Cols,
}

/// The rule above, by tensor name.
pub fn cut_of(name: &str) -> Cut {
    if name == "output.weight" {
        return Cut::Rows;
    }
    let Some(rest) = name
        .strip_prefix("blk.")
        .and_then(|r| r.split_once('.'))
        .map(|(_, r)| r)
    else {
        return Cut::Whole;
    };
    match rest {
        "attn_q_b.weight" | "attn_k_b.weight" | "attn_v_b.weight" => Cut::Rows,
        "attn_output.weight" => Cut::Cols,
        "ffn_gate.weight" | "ffn_up.weight" | "ffn_gate_shexp.weight" | "ffn_up_shexp.weight" => {
            Cut::Rows
        }
        "ffn_down.weight" | "ffn_down_shexp.weight" => Cut::Cols,
        "ffn_gate_exps.weight" | "ffn_up_exps.weight" | "ffn_down_exps.weight" => Cut::Rows,
        _ => Cut::Whole,
    }
}

/// Rank `rank` of `n_ranks`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub n_ranks: usize,
}

impl Shard {
    /// The `rank`-th of `n_ranks` equal parts of `0..total`; an error when they are not equal.
    pub fn part(&self, total: usize, what: &dyn Fn() -> String) -> Result<Range<usize>> {
        if self.n_ranks == 0 || total % self.n_ranks != 0 {
            return Err(err(format!(
                "{}: {total} does not split into {} equal parts (--gpus must divide it)",
                what(),
                self.n_ranks
            )));
        }
        let per = total / self.n_ranks;
        Ok(self.rank * per..(self.rank + 1) * per)
    }

    /// `(rows, cols)` of `t` this rank holds, as `(start, count)` pairs.
    pub fn window(&self, t: &TensorInfo<'_>) -> Result<((usize, usize), (usize, usize))> {
        let (k, n) = (t.row_len() as usize, t.n_rows() as usize);
        let name = || format!("tensor '{}' ({})", t.name, cut_name(cut_of(t.name)));
        Ok(match cut_of(t.name) {
            Cut::Whole => ((0, n), (0, k)),
            Cut::Rows => {
                let r = self.part(n, &|| format!("{} rows", name()))?;
                ((r.start, r.len()), (0, k))
            }
            Cut::Cols => {
                let c = self.part(k, &|| format!("{} row length", name()))?;
                let bs = t.ggml_type.block_size() as usize;
                if c.len() % bs != 0 {
                    return Err(err(format!(
                        "{}: {} of {k} elements per rank is not whole {} blocks of {bs}",
                        name(),
                        c.len(),
                        t.ggml_type.name()
                    )));
                }
                ((0, n), (c.start, c.len()))
            }
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
    for rank in [0, n_ranks.saturating_sub(1)] {
        let s = Shard { rank, n_ranks };
        s.config(&spec.config)?;
        for t in file.tensors() {
            s.window(&t)?;
        }
    }
    Ok(())
}

fn cut_name(c: Cut) -> &'static str {
    match c {
        Cut::Whole => "whole",
        Cut::Rows => "row blocks per GPU",
        Cut::Cols => "column blocks per GPU",
    }
}

/// A weight source that can upload a window of a tensor.
pub trait SliceSource: WeightSource {
    /// Rows `(start, count)` and columns `(start, count)` (elements; whole quant blocks).
    fn upload_window(
        &self,
        gpu: &Gpu,
        t: &TensorInfo<'_>,
        rows: (usize, usize),
        cols: (usize, usize),
    ) -> Result<DeviceTensor>;
}

impl<B: AsRef<[u8]>> SliceSource for Gguf<B> {
    fn upload_window(
        &self,
        gpu: &Gpu,
        t: &TensorInfo<'_>,
        (row0, rows): (usize, usize),
        (col0, cols): (usize, usize),
    ) -> Result<DeviceTensor> {
        let bytes = window_bytes(self.tensor_data(*t), t, (row0, rows), (col0, cols))?;
        let what = format!(
            "tensor '{}' (rows {row0}+{rows}, cols {col0}+{cols})",
            t.name
        );
        let mut data = alloc::<u8>(gpu, bytes.len(), &what)?;
        gpu.stream()
            .memcpy_htod(&bytes, &mut data)
            .map_err(|e| err(format!("copying {what} to the GPU: {e:?}")))?;
        Ok(DeviceTensor {
            name: t.name.to_string(),
            ty: t.ggml_type,
            k: cols,
            n: rows,
            data,
        })
    }
}

impl SliceSource for SyntheticWeights {
    fn upload_window(
        &self,
        gpu: &Gpu,
        t: &TensorInfo<'_>,
        rows: (usize, usize),
        cols: (usize, usize),
    ) -> Result<DeviceTensor> {
        self.upload_slice(gpu, t, rows, cols)
    }
}

/// The bytes of a window of a tensor's data (`data`: the whole tensor as stored).
pub fn window_bytes(
    data: &[u8],
    t: &TensorInfo<'_>,
    (row0, rows): (usize, usize),
    (col0, cols): (usize, usize),
) -> Result<Vec<u8>> {
    let ty = t.ggml_type;
    let (k, n) = (t.row_len(), t.n_rows() as usize);
    let bs = ty.block_size() as usize;
    let bad = || {
        err(format!(
            "tensor '{}': window rows {row0}+{rows} cols {col0}+{cols} is not whole {} blocks inside [{n} × {k}]",
            t.name,
            ty.name()
        ))
    };
    if col0 % bs != 0 || cols % bs != 0 || col0 + cols > k as usize || row0 + rows > n {
        return Err(bad());
    }
    let row_bytes = ty.row_bytes(k).ok_or_else(bad)? as usize;
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
        if cut_of(t.name) == Cut::Whole {
            return self.src.upload(gpu, t);
        }
        let (rows, cols) = self.shard.window(t)?;
        self.src.upload_window(gpu, t, rows, cols)
    }

    fn upload_f32(&self, gpu: &Gpu, t: &TensorInfo<'_>) -> Result<CudaSlice<f32>> {
        if cut_of(t.name) != Cut::Whole {
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
    use memra_reference::models::GlmDsa;

    use super::*;

    fn micro() -> Gguf<Vec<u8>> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let spec = ArchSpec::load(&root.join("specs/glm-dsa.toml")).unwrap();
        Gguf::parse(fixture::micro_model(&spec, 3).unwrap()).unwrap()
    }

    #[test]
    fn cuts_follow_the_tensor_roles() {
        assert_eq!(cut_of("blk.3.attn_q_b.weight"), Cut::Rows);
        assert_eq!(
            cut_of("blk.3.indexer.attn_q_b.weight"),
            Cut::Whole,
            "the indexer is replicated"
        );
        assert_eq!(cut_of("blk.0.attn_output.weight"), Cut::Cols);
        assert_eq!(cut_of("blk.7.ffn_down_exps.weight"), Cut::Rows);
        assert_eq!(cut_of("blk.7.ffn_down_shexp.weight"), Cut::Cols);
        assert_eq!(
            cut_of("blk.0.attn_kv_a_mqa.weight"),
            Cut::Whole,
            "the latent cache is replicated"
        );
        assert_eq!(cut_of("output.weight"), Cut::Rows, "vocab-parallel LM head");
        assert_eq!(cut_of("token_embd.weight"), Cut::Whole);
        assert_eq!(cut_of("blk.7.ffn_gate_inp.weight"), Cut::Whole);
    }

    /// The windows of two ranks, dequantized, are the 1-GPU tensor's rows / columns, for every
    /// split tensor of the micro model; the concatenation covers it exactly.
    #[test]
    fn windows_of_the_ranks_tile_the_tensor() {
        let file = micro();
        let mut checked = 0;
        for t in file.tensors() {
            let cut = cut_of(t.name);
            if cut == Cut::Whole {
                continue;
            }
            let (k, n) = (t.row_len() as usize, t.n_rows() as usize);
            let full = quant::dequantize(t.ggml_type, file.tensor_data(t), k * n).unwrap();
            let n_ranks = 2;
            for rank in 0..n_ranks {
                let s = Shard { rank, n_ranks };
                let ((r0, rows), (c0, cols)) = match s.window(&t) {
                    Ok(w) => w,
                    // Micro dims may not split into whole blocks; that must be an error naming the tensor.
                    Err(e) => {
                        assert!(e.to_string().contains(t.name), "{e}");
                        continue;
                    }
                };
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
                let bytes = window_bytes(file.tensor_data(t), &t, (r0, rows), (c0, cols)).unwrap();
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
        let hp = GlmDsa::hparams_from_gguf(&micro()).unwrap();
        let cfg = crate::models::mla::config_from("glm-dsa", "interleaved", &hp);
        let two = Shard {
            rank: 1,
            n_ranks: 2,
        }
        .config(&cfg)
        .unwrap();
        assert_eq!(two.n_head, cfg.n_head / 2);
        assert_eq!(
            two.moe.as_ref().unwrap().n_expert,
            cfg.moe.as_ref().unwrap().n_expert,
            "the router keeps every expert"
        );
        assert_eq!(
            Shard {
                rank: 1,
                n_ranks: 2
            }
            .experts(&cfg)
            .unwrap(),
            Some(2..4)
        );
        let e = Shard {
            rank: 0,
            n_ranks: 3,
        }
        .config(&cfg)
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("attention heads") && e.contains("3 equal parts"),
            "{e}"
        );
        let mut odd = cfg.clone();
        odd.moe.as_mut().unwrap().n_expert = 6;
        let e = Shard {
            rank: 0,
            n_ranks: 4,
        }
        .config(&odd)
        .unwrap_err()
        .to_string();
        assert!(e.contains("routed experts"), "{e}");
    }
}
