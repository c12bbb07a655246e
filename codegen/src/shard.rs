//! The split rules of a model run on N GPUs (tensor and expert parallel), in one place: the
//! engine's ranks apply them to the weights at run time (`engine/src/parallel/shard.rs`) and the
//! planner applies them to the dims at build time, so that each rank's kernels are specialized
//! for the per-GPU shapes ([`rank_dims`]). The shard counts to plan for come from the spec's
//! `[parallel] shards` or the `MEMRA_SHARDS` build override ([`SHARDS_ENV`]).
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
//! Of the hparams, [`PER_RANK_HPARAMS`] become the rank's share: the kernels that name them
//! (`mla_*`'s heads, `swiglu`'s widths) run on it. The expert count stays global (every rank
//! runs the whole router) and so does the vocabulary (argmax reads the gathered logits).

use std::ops::Range;

use crate::dims::ModelDims;
use crate::spec::Value;

/// The build-time override of the spec's `[parallel] shards`: `MEMRA_SHARDS=2,8` (GPU counts),
/// `MEMRA_SHARDS=1` for none.
pub const SHARDS_ENV: &str = "MEMRA_SHARDS";

/// How a tensor is split across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    Whole,
    /// Equal row blocks.
    Rows,
    /// Equal column blocks (each row's elements), whole quant blocks.
    Cols,
}

impl Cut {
    pub fn describe(self) -> &'static str {
        match self {
            Cut::Whole => "whole",
            Cut::Rows => "row blocks per GPU",
            Cut::Cols => "column blocks per GPU",
        }
    }
}

/// The rule above, by GGUF tensor name.
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

/// Hparams (and derived values) whose per-rank value is the global one / N: attention heads,
/// the dense FFN width and the shared expert's width.
pub const PER_RANK_HPARAMS: &[&str] = &["n_head", "n_ff", "n_ff_shexp"];

/// The `rank`-th of `n_ranks` equal parts of `0..total`; `what` names it in the error when the
/// parts are not equal.
pub fn part(total: u64, rank: usize, n_ranks: usize, what: &str) -> Result<Range<u64>, String> {
    if n_ranks == 0 || total % n_ranks as u64 != 0 {
        return Err(format!(
            "{what}: {total} does not split into {n_ranks} equal parts (--gpus must divide it)"
        ));
    }
    let per = total / n_ranks as u64;
    Ok(rank as u64 * per..(rank as u64 + 1) * per)
}

/// The rows and columns (elements) of tensor `name` (`n_rows` rows of `row_len` elements,
/// quant blocks of `block` elements) that rank `rank` of `n_ranks` holds.
pub fn window(
    name: &str,
    row_len: u64,
    n_rows: u64,
    block: u64,
    rank: usize,
    n_ranks: usize,
) -> Result<(Range<u64>, Range<u64>), String> {
    let cut = cut_of(name);
    let what = |dim: &str| format!("tensor '{name}' ({}) {dim}", cut.describe());
    Ok(match cut {
        Cut::Whole => (0..n_rows, 0..row_len),
        Cut::Rows => (part(n_rows, rank, n_ranks, &what("rows"))?, 0..row_len),
        Cut::Cols => {
            let c = part(row_len, rank, n_ranks, &what("row length"))?;
            let per = c.end - c.start;
            if block == 0 || per % block != 0 {
                return Err(format!(
                    "{}: {per} of {row_len} elements per rank is not whole blocks of {block}",
                    what("row length")
                ));
            }
            (0..n_rows, c)
        }
    })
}

/// Parses a shard list (`"2,8"`, `"1"` = none): GPU counts ≥ 1, sorted, without repeats; 1
/// (the unsplit model, always planned) is dropped.
pub fn parse_shards(text: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match item.parse::<usize>() {
            Ok(n) if n >= 1 => out.push(n),
            _ => {
                return Err(format!(
                    "{SHARDS_ENV}={text:?}: `{item}` is not a GPU count (a list like 2,8; 1 for none)"
                ));
            }
        }
    }
    Ok(normalize(out))
}

/// Sorted, de-duplicated, without 1.
pub fn normalize(mut shards: Vec<usize>) -> Vec<usize> {
    shards.retain(|&n| n > 1);
    shards.sort_unstable();
    shards.dedup();
    shards
}

/// `dims` as one rank of `n_ranks` sees them: every tensor's shape its window (row blocks cut
/// the outermost dim, column blocks ne0) and [`PER_RANK_HPARAMS`] divided. The planner run on
/// these gives the variants a rank's launches ask for. An error names what does not split.
pub fn rank_dims(dims: &ModelDims, n_ranks: usize) -> Result<ModelDims, String> {
    let mut out = dims.clone();
    for (name, v) in &mut out.values {
        if PER_RANK_HPARAMS.contains(&name.as_str())
            && let Value::Int(i) = v
        {
            let p = part(*i as u64, 0, n_ranks, name)?;
            *v = Value::Int((p.end - p.start) as i64);
        }
    }
    for t in &mut out.tensors {
        let (row_len, n_rows) = match t.shape.split_first() {
            Some((&k, rest)) => (k, rest.iter().product::<u64>()),
            None => continue,
        };
        let (rows, cols) = window(
            &t.name,
            row_len,
            n_rows,
            t.ggml_type.block_size(),
            0,
            n_ranks,
        )?;
        let (rows, cols) = (rows.end - rows.start, cols.end - cols.start);
        if let Some(k) = t.shape.first_mut() {
            *k = cols;
        }
        if rows != n_rows {
            // Row blocks are whole slices of the outermost dim (heads, experts, vocabulary).
            let outer = t.shape.len() - 1;
            let inner: u64 = t.shape[1..outer].iter().product();
            if outer == 0 || inner == 0 || rows % inner != 0 {
                return Err(format!(
                    "tensor '{}' {:?}: a block of {rows} rows is not whole slices of its last dim",
                    t.name, t.shape
                ));
            }
            t.shape[outer] = rows / inner;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn windows_and_their_errors() {
        let w = window("blk.0.attn_output.weight", 16384, 6144, 32, 1, 2).unwrap();
        assert_eq!(w, (0..6144, 8192..16384));
        let w = window("output.weight", 6144, 154880, 32, 3, 8).unwrap();
        assert_eq!(w, (3 * 19360..4 * 19360, 0..6144));
        let w = window("blk.0.attn_q_a.weight", 6144, 2048, 32, 1, 2).unwrap();
        assert_eq!(w, (0..2048, 0..6144), "whole");
        let e = window("blk.0.ffn_down.weight", 96, 8, 32, 0, 2).unwrap_err();
        assert!(e.contains("48 of 96") && e.contains("blocks of 32"), "{e}");
        let e = window("blk.0.ffn_gate.weight", 64, 9, 32, 0, 2).unwrap_err();
        assert!(
            e.contains("'blk.0.ffn_gate.weight'") && e.contains("2 equal parts"),
            "{e}"
        );
    }

    #[test]
    fn shard_lists_parse_and_refuse_junk() {
        assert_eq!(parse_shards("8, 2,2").unwrap(), vec![2, 8]);
        assert_eq!(parse_shards("1").unwrap(), Vec::<usize>::new());
        assert_eq!(parse_shards("").unwrap(), Vec::<usize>::new());
        for bad in ["two", "0", "2;4", "-2"] {
            let e = parse_shards(bad).unwrap_err();
            assert!(e.contains(SHARDS_ENV), "{bad}: {e}");
        }
    }
}
