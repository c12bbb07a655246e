//! The split rules of a model run on N GPUs (tensor and expert parallel), applied in one place.
//! The rules are spec data (`specs/README.md`): each `[tensors]` entry's `split` and `[parallel]
//! per_rank`; no tensor name appears here. The engine's ranks apply them to the weights at run
//! time (`engine/src/parallel/shard.rs`, through the `SPLITS` table engine/build.rs writes from
//! the specs), the planner to the dims at build time, so that each rank's kernels are
//! specialized for the per-GPU shapes ([`rank_dims`]), and the spec parser to the default
//! preset, so that a `[parallel] shards` count the model does not split into is a spec error.
//! The shard counts to plan for come from the spec's `[parallel] shards` or the `MEMRA_SHARDS`
//! build override ([`SHARDS_ENV`]).
//!
//! Rank r of N holds, of a tensor of rows of ne0 elements (rows = the product of the dims after
//! ne0, the last dim slowest):
//! - `split = "rows"`: rows `r·R/N ..` — a block of whole slices of the last dim (heads, experts,
//!   vocabulary entries: the tensor's rows are head-major / expert-major), a partial output of
//!   whole rows;
//! - `split = "cols"`: elements `r·K/N ..` of every row (K = ne0), whole quant blocks — a
//!   partial sum of the full output;
//! - no `split`: all of it.
//!
//! Of the hparams and derived values, `per_rank` ones become the rank's share (global / N): the
//! kernels that name them run on it. The others stay global.

use std::ops::Range;

use crate::dims::ModelDims;
use crate::spec::{ArchSpec, Value, name_matches};

/// The build-time override of the spec's `[parallel] shards`: `MEMRA_SHARDS=2,8` (GPU counts),
/// `MEMRA_SHARDS=1` for none.
pub const SHARDS_ENV: &str = "MEMRA_SHARDS";

/// How a tensor is split across ranks (a `[tensors]` entry's `split`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// No `split`: every rank holds all of it.
    Whole,
    /// `split = "rows"`: equal row blocks.
    Rows,
    /// `split = "cols"`: equal column blocks (each row's elements), whole quant blocks.
    Cols,
}

impl Cut {
    /// The spec values of `split` (absent: [`Cut::Whole`]).
    pub const TOKENS: &'static [&'static str] = &["rows", "cols"];

    pub fn from_token(s: &str) -> Option<Cut> {
        match s {
            "rows" => Some(Cut::Rows),
            "cols" => Some(Cut::Cols),
            _ => None,
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Cut::Whole => "whole",
            Cut::Rows => "row blocks per GPU",
            Cut::Cols => "column blocks per GPU",
        }
    }
}

/// The split tensors of `spec`: (`[tensors]` name pattern, cut) of every entry with a `split`.
pub fn splits(spec: &ArchSpec) -> Vec<(&str, Cut)> {
    spec.tensors
        .iter()
        .filter(|t| t.split != Cut::Whole)
        .map(|t| (t.name.as_str(), t.split))
        .collect()
}

/// The cut of GGUF tensor `name` under `splits` (name patterns with `{i}`, as [`splits`] or the
/// engine's generated table give them); whole when no pattern matches.
pub fn cut_of<S: AsRef<str>>(splits: &[(S, Cut)], name: &str) -> Cut {
    splits
        .iter()
        .find(|(pattern, _)| name_matches(pattern.as_ref(), name))
        .map_or(Cut::Whole, |(_, cut)| *cut)
}

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

/// The rows and columns (elements) of tensor `name`, cut by `cut` (`n_rows` rows of `row_len`
/// elements, quant blocks of `block` elements), that rank `rank` of `n_ranks` holds.
pub fn window(
    cut: Cut,
    name: &str,
    row_len: u64,
    n_rows: u64,
    block: u64,
    rank: usize,
    n_ranks: usize,
) -> Result<(Range<u64>, Range<u64>), String> {
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

/// `dims` as one rank of `n_ranks` sees them: every tensor's shape its window by `spec`'s
/// `split`s ([`rank_shape`]) and `spec`'s `[parallel] per_rank` values divided ([`rank_value`]).
/// The planner run on these gives the variants a rank's launches ask for. An error names what
/// does not split.
pub fn rank_dims(spec: &ArchSpec, dims: &ModelDims, n_ranks: usize) -> Result<ModelDims, String> {
    let per_rank = spec.parallel.as_ref().map_or(&[][..], |p| &p.per_rank[..]);
    let mut out = dims.clone();
    for (name, v) in &mut out.values {
        if per_rank.iter().any(|(n, _)| n == name)
            && let Value::Int(i) = v
        {
            *v = Value::Int(rank_value(name, *i, n_ranks)?);
        }
    }
    for t in &mut out.tensors {
        let cut = spec
            .tensors
            .get(t.spec_index)
            .map_or(Cut::Whole, |s| s.split);
        t.shape = rank_shape(cut, &t.name, &t.shape, t.ggml_type.block_size(), n_ranks)?;
    }
    Ok(out)
}

/// A `per_rank` value (`name` = `global`) on one rank of `n_ranks`.
pub fn rank_value(name: &str, global: i64, n_ranks: usize) -> Result<i64, String> {
    let p = part(global as u64, 0, n_ranks, name)?;
    Ok((p.end - p.start) as i64)
}

/// One rank's shape of tensor `name` (`shape`: ggml ne, quant blocks of `block` elements) cut by
/// `cut`: row blocks cut the outermost dim, column blocks ne0. An error names the tensor when
/// the cut is not equal, whole blocks, or whole slices of the outermost dim.
pub fn rank_shape(
    cut: Cut,
    name: &str,
    shape: &[u64],
    block: u64,
    n_ranks: usize,
) -> Result<Vec<u64>, String> {
    let mut out = shape.to_vec();
    let Some((&row_len, outer_dims)) = shape.split_first() else {
        return Ok(out);
    };
    let n_rows = outer_dims
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .ok_or_else(|| format!("tensor '{name}' {shape:?}: the row count overflows"))?;
    let (rows, cols) = window(cut, name, row_len, n_rows, block, 0, n_ranks)?;
    let (rows, cols) = (rows.end - rows.start, cols.end - cols.start);
    out[0] = cols;
    if rows != n_rows {
        // Row blocks are whole slices of the outermost dim (heads, experts, vocabulary).
        let outer = out.len() - 1;
        let inner: u64 = out[1..outer.max(1)].iter().product();
        if outer == 0 || inner == 0 || rows % inner != 0 {
            return Err(format!(
                "tensor '{name}' {shape:?}: a block of {rows} rows is not whole slices of its last dim"
            ));
        }
        out[outer] = rows / inner;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn glm_dsa() -> ArchSpec {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        ArchSpec::load(&root.join("specs/glm-dsa.toml")).unwrap()
    }

    /// glm-dsa's `split`s are exactly the tensor-parallel layout the engine's MLA ranks run:
    /// heads (q_b, k_b, v_b rows; attn_output columns), experts, dense FFN and shared expert
    /// (gate/up rows, down columns), the LM head's vocabulary rows; everything else whole.
    #[test]
    fn glm_dsa_splits_are_the_mla_layout() {
        let spec = glm_dsa();
        let mut got = splits(&spec);
        got.sort_by_key(|(name, _)| *name);
        let mut want = vec![
            ("output.weight", Cut::Rows),
            ("blk.{i}.attn_q_b.weight", Cut::Rows),
            ("blk.{i}.attn_k_b.weight", Cut::Rows),
            ("blk.{i}.attn_v_b.weight", Cut::Rows),
            ("blk.{i}.attn_output.weight", Cut::Cols),
            ("blk.{i}.ffn_gate.weight", Cut::Rows),
            ("blk.{i}.ffn_up.weight", Cut::Rows),
            ("blk.{i}.ffn_down.weight", Cut::Cols),
            ("blk.{i}.ffn_gate_exps.weight", Cut::Rows),
            ("blk.{i}.ffn_up_exps.weight", Cut::Rows),
            ("blk.{i}.ffn_down_exps.weight", Cut::Rows),
            ("blk.{i}.ffn_gate_shexp.weight", Cut::Rows),
            ("blk.{i}.ffn_up_shexp.weight", Cut::Rows),
            ("blk.{i}.ffn_down_shexp.weight", Cut::Cols),
        ];
        want.sort_by_key(|(name, _)| *name);
        assert_eq!(got, want);
        let per_rank: Vec<&str> = spec
            .parallel
            .as_ref()
            .unwrap()
            .per_rank
            .iter()
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(per_rank, ["n_head", "n_ff", "n_ff_shexp"]);
    }

    #[test]
    fn cuts_follow_the_tensor_roles() {
        let spec = glm_dsa();
        let splits = splits(&spec);
        let cut_of = |name| cut_of(&splits, name);
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
        assert_eq!(
            cut_of("blk.x.attn_q_b.weight"),
            Cut::Whole,
            "not a layer index"
        );
        assert_eq!(cut_of("blk..attn_q_b.weight"), Cut::Whole, "no layer index");
        assert_eq!(cut_of("blk.1.attn_q_b.weight.x"), Cut::Whole);
    }

    /// The name patterns the engine matches give every tensor of the preset the cut of the
    /// `[tensors]` entry it was made from (what the planner uses).
    #[test]
    fn name_patterns_find_the_entry_of_every_preset_tensor() {
        let spec = glm_dsa();
        let splits = splits(&spec);
        let d = crate::dims::from_preset(&spec, None).unwrap();
        for t in &d.tensors {
            assert_eq!(
                cut_of(&splits, &t.name),
                spec.tensors[t.spec_index].split,
                "{}",
                t.name
            );
        }
    }

    #[test]
    fn windows_and_their_errors() {
        let w = window(Cut::Cols, "blk.0.attn_output.weight", 16384, 6144, 32, 1, 2).unwrap();
        assert_eq!(w, (0..6144, 8192..16384));
        let w = window(Cut::Rows, "output.weight", 6144, 154880, 32, 3, 8).unwrap();
        assert_eq!(w, (3 * 19360..4 * 19360, 0..6144));
        let w = window(Cut::Whole, "blk.0.attn_q_a.weight", 6144, 2048, 32, 1, 2).unwrap();
        assert_eq!(w, (0..2048, 0..6144), "whole");
        let e = window(Cut::Cols, "blk.0.ffn_down.weight", 96, 8, 32, 0, 2).unwrap_err();
        assert!(e.contains("48 of 96") && e.contains("blocks of 32"), "{e}");
        let e = window(Cut::Rows, "blk.0.ffn_gate.weight", 64, 9, 32, 0, 2).unwrap_err();
        assert!(
            e.contains("'blk.0.ffn_gate.weight'") && e.contains("2 equal parts"),
            "{e}"
        );
        let e = rank_shape(Cut::Rows, "blk.0.x.weight", &[32, 3, 4], 32, 6).unwrap_err();
        assert!(e.contains("not whole slices of its last dim"), "{e}");
        assert_eq!(
            rank_shape(Cut::Rows, "blk.0.x.weight", &[32, 3, 4], 32, 2).unwrap(),
            [32, 3, 2]
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
