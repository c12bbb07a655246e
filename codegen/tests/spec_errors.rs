//! Spec validation: every mistake is reported with `file:line:col: key `path`` and all
//! mistakes of a file come back together.

use std::path::Path;

use memra_codegen::spec::{ArchSpec, HParamDefault, HParamSource, Value};

/// A small but complete spec; tests break one thing at a time.
const BASE: &str = r#"[arch]
name = "tiny"
preset = "small"
sources = ["test fixture"]

[hparams]
block_count = { key = "block_count", type = "u32", source = "s" }
n_embd = { key = "embedding_length", type = "u32", source = "s" }
n_head = { key = "attention.head_count", type = "u32", source = "s" }
n_head_kv = { key = "attention.head_count_kv", type = "u32", default = "n_head", source = "s" }
head_dim = { key = "attention.key_length", type = "u32", default = "n_embd / n_head", source = "s" }
rms_eps = { key = "attention.layer_norm_rms_epsilon", type = "f32", default = 1e-6, source = "s" }
n_vocab = { tensor = "token_embd.weight", dim = 1, source = "s" }

[derived]
n_layer = { expr = "block_count", source = "s" }

[capabilities]
attention = "gqa"
qk_norm = "none"
rope = "neox"
ffn = "swiglu"
norm = "pre"
tied_embeddings = "always"

[tensors]
"token_embd.weight" = { shape = ["n_embd", "n_vocab"] }
"blk.{i}.attn_q.weight" = { shape = ["n_embd", "n_head * head_dim"] }

[presets.small]
source = "s"
hparams = { block_count = 2, n_embd = 64, n_head = 2, n_vocab = 100 }
types = { default = "Q8_0" }

[[kernels]]
family = "rmsnorm"
n = "n_embd"
"#;

fn parse(text: &str) -> Result<ArchSpec, String> {
    ArchSpec::parse(Path::new("specs/tiny.toml"), text).map_err(|e| e.to_string())
}

/// The 1-based line of the first occurrence of `needle` in `text`.
fn line_of(text: &str, needle: &str) -> usize {
    text.lines()
        .position(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("{needle:?} not in text"))
        + 1
}

fn expect_error(text: &str, line_needle: &str, key: &str, message: &str) {
    let err = parse(text).expect_err("spec should be rejected");
    let line = line_of(text, line_needle);
    let prefix = format!("specs/tiny.toml:{line}:");
    let found = err.lines().any(|l| {
        l.starts_with(&prefix) && l.contains(&format!("key `{key}`")) && l.contains(message)
    });
    assert!(
        found,
        "expected a line starting {prefix:?} naming key `{key}` with {message:?}; got:\n{err}"
    );
}

#[test]
fn base_fixture_is_valid() {
    let spec = parse(BASE).unwrap();
    assert_eq!(spec.arch, "tiny");
    assert_eq!(spec.hparams.len(), 7);
    assert_eq!(
        spec.hparams[0].name, "block_count",
        "declaration order is kept"
    );
    assert_eq!(
        spec.hparam("n_vocab").unwrap().from,
        HParamSource::TensorDim {
            tensor: "token_embd.weight".into(),
            dim: 1
        }
    );
    assert!(matches!(
        spec.hparam("head_dim").unwrap().default,
        Some(HParamDefault::Expr(_))
    ));
    assert_eq!(
        spec.hparam("rms_eps").unwrap().default,
        Some(HParamDefault::Value(Value::Float(1e-6)))
    );
    assert_eq!(spec.tensors[1].field, "attn_q");
    assert!(spec.tensors[1].per_layer());
    assert_eq!(spec.hparams[0].loc.line, 7);
}

#[test]
fn syntax_errors_have_a_line() {
    let text = BASE.replace("norm = \"pre\"", "norm = \"pre");
    let err = parse(&text).unwrap_err();
    assert!(
        err.starts_with(&format!(
            "specs/tiny.toml:{}:",
            line_of(&text, "norm = \"pre")
        )),
        "{err}"
    );
    assert!(err.contains("TOML syntax"), "{err}");
}

#[test]
fn unknown_keys_are_named() {
    let text = BASE.replace("norm = \"pre\"", "norm = \"pre\"\nmla = true");
    expect_error(&text, "mla = true", "capabilities.mla", "unknown key");
    let text = BASE.replace(
        "type = \"u32\", source = \"s\" }\nn_embd",
        "type = \"u32\", sauce = \"s\" }\nn_embd",
    );
    expect_error(&text, "sauce", "hparams.block_count.sauce", "unknown key");
}

#[test]
fn bad_values_are_named() {
    let text = BASE.replace("attention = \"gqa\"", "attention = \"mha\"");
    expect_error(
        &text,
        "attention = \"mha\"",
        "capabilities.attention",
        "unknown value `mha`; expected one of: gqa, mla, mla_dsa",
    );
    let text = BASE.replace("type = \"f32\"", "type = \"f16\"");
    expect_error(
        &text,
        "type = \"f16\"",
        "hparams.rms_eps.type",
        "unknown type `f16`",
    );
    let text = BASE.replace("default = \"Q8_0\"", "default = \"Q4_KM\"");
    expect_error(
        &text,
        "Q4_KM",
        "presets.small.types.default",
        "unknown ggml type `Q4_KM`",
    );
}

#[test]
fn expression_errors_name_the_expression_and_key() {
    let text = BASE.replace("\"n_head * head_dim\"", "\"n_head * head_dimm\"");
    expect_error(
        &text,
        "head_dimm",
        "tensors.\"blk.{i}.attn_q.weight\"",
        "expression `n_head * head_dimm`: unknown name `head_dimm`",
    );
    let text = BASE.replace("\"n_head * head_dim\"", "\"n_head * (head_dim\"");
    expect_error(
        &text,
        "(head_dim",
        "tensors.\"blk.{i}.attn_q.weight\".shape[1]",
        "unclosed `(`",
    );
    let text = BASE.replace("\"n_head * head_dim\"", "\"n_head * rms_eps\"");
    expect_error(
        &text,
        "rms_eps\"",
        "tensors.\"blk.{i}.attn_q.weight\"",
        "`rms_eps` is a f32 hparam",
    );
    let text = BASE.replace("n = \"n_embd\"", "n = \"n_embd +\"");
    expect_error(&text, "n_embd +", "kernels[0].n", "expression `n_embd +`");
}

#[test]
fn missing_required_keys_are_named() {
    let text = BASE.replace("tied_embeddings = \"always\"\n", "");
    expect_error(
        &text,
        "[capabilities]",
        "capabilities.tied_embeddings",
        "missing required key",
    );
    let text = BASE.replace(", source = \"s\" }\nn_head =", " }\nn_head =");
    expect_error(
        &text,
        "n_embd = { key",
        "hparams.n_embd.source",
        "missing required key",
    );
}

#[test]
fn cross_references_are_checked() {
    let text = BASE.replace("preset = \"small\"", "preset = \"large\"");
    expect_error(
        &text,
        "preset = \"large\"",
        "arch.preset",
        "no [presets.large]",
    );
    let text = BASE.replace("n_vocab = 100 }", "n_vocab = 100, n_layer = 2 }");
    expect_error(
        &text,
        "n_layer = 2",
        "presets.small.hparams.n_layer",
        "`n_layer` is derived",
    );
    let text = BASE.replace("hparams = { block_count = 2, ", "hparams = { ");
    expect_error(
        &text,
        "[presets.small]",
        "presets.small",
        "preset lacks hparam `block_count`",
    );
    let text = BASE.replace("ffn = \"swiglu\"", "ffn = \"moe\"");
    expect_error(
        &text,
        "[capabilities]",
        "capabilities.router",
        "needs a router",
    );
    let text = BASE.replace(
        "default = \"n_embd / n_head\"",
        "default = \"n_embd / n_ff\"",
    );
    expect_error(
        &text,
        "n_embd / n_ff",
        "hparams.head_dim",
        "`n_ff` is not an hparam declared before `head_dim`",
    );
}

#[test]
fn capabilities_require_their_hparams() {
    let text = BASE.replace("n_head_kv = {", "n_kv_heads = {");
    expect_error(
        &text,
        "[arch]",
        "arch",
        "hparam `n_head_kv` is required (attention = gqa)",
    );
}

#[test]
fn tensor_table_rules() {
    let text = BASE.replace(
        "\"blk.{i}.attn_q.weight\" = { shape",
        "\"layer.{i}.attn_q.weight\" = { shape",
    );
    expect_error(
        &text,
        "layer.{i}",
        "tensors.\"layer.{i}.attn_q.weight\"",
        "start with `blk.{i}.`",
    );
    let text = BASE.replace(
        "shape = [\"n_embd\", \"n_vocab\"] }",
        "shape = [\"n_embd\", \"n_vocab\"], layers = \"0..2\" }",
    );
    expect_error(
        &text,
        "layers = \"0..2\"",
        "tensors.\"token_embd.weight\".layers",
        "only per-layer tensors",
    );
    let text = BASE.replace(
        "\"n_head * head_dim\"] }",
        "\"n_head * head_dim\"], layers = \"0:2\" }",
    );
    expect_error(
        &text,
        "0:2",
        "tensors.\"blk.{i}.attn_q.weight\".layers",
        "must look like `start..end`",
    );
}

#[test]
fn all_errors_are_reported_together() {
    let text = BASE
        .replace("attention = \"gqa\"", "attention = \"mha\"")
        .replace("rope = \"neox\"", "rope = \"yarn\"");
    let err = parse(&text).unwrap_err();
    assert!(
        err.contains("capabilities.attention") && err.contains("capabilities.rope"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 2, "{err}");
}

/// BASE split over GPUs: attn_q's rows (64 = 2 heads of 32) and `n_head` per rank.
fn split_base(split: &str, shards: &str, per_rank: &str) -> String {
    BASE.replace(
        "\"n_head * head_dim\"] }",
        &format!("\"n_head * head_dim\"], split = \"{split}\" }}"),
    ) + &format!("\n[parallel]\nshards = [{shards}]\nper_rank = [{per_rank}]\n")
}

#[test]
fn splits_parse_into_the_tensor_table() {
    use memra_codegen::shard::{Cut, cut_of, splits};
    let spec = parse(&split_base("rows", "2", "\"n_head\"")).unwrap();
    let p = spec.parallel.as_ref().unwrap();
    assert_eq!(p.shards, [2]);
    assert_eq!(p.per_rank.len(), 1);
    assert_eq!(p.per_rank[0].0, "n_head");
    assert_eq!(splits(&spec), [("blk.{i}.attn_q.weight", Cut::Rows)]);
    assert_eq!(cut_of(&splits(&spec), "blk.1.attn_q.weight"), Cut::Rows);
    assert_eq!(cut_of(&splits(&spec), "token_embd.weight"), Cut::Whole);
    let spec = parse(&split_base("cols", "2", "")).unwrap();
    assert_eq!(
        spec.tensor("blk.{i}.attn_q.weight").unwrap().split,
        Cut::Cols
    );
    assert!(parse(BASE).unwrap().parallel.is_none());
}

#[test]
fn bad_split_values_and_per_rank_names_are_named() {
    let text = split_base("heads", "2", "\"n_head\"");
    expect_error(
        &text,
        "split = \"heads\"",
        "tensors.\"blk.{i}.attn_q.weight\".split",
        "unknown value `heads`; expected one of: rows, cols",
    );
    let text = split_base("rows", "2", "\"n_head\", \"n_heads\", \"rms_eps\", 4");
    expect_error(
        &text,
        "per_rank =",
        "parallel.per_rank[1]",
        "`n_heads` is not an integer hparam or derived value",
    );
    expect_error(
        &text,
        "per_rank =",
        "parallel.per_rank[2]",
        "`rms_eps` is not an integer hparam",
    );
    expect_error(
        &text,
        "per_rank =",
        "parallel.per_rank[3]",
        "expected an hparam or derived name",
    );
    let text = split_base("rows", "2", "\"n_head\"").replace("per_rank = [\"n_head\"]\n", "");
    expect_error(
        &text,
        "[parallel]",
        "parallel.per_rank",
        "missing required key",
    );
    let text = BASE.replace(
        "\"n_embd\", \"n_vocab\"] }",
        "\"n_embd\", \"n_vocab\"] }\n\"output_norm.weight\" = { shape = [\"n_embd\"], split = \"cols\" }",
    ) + "\n[parallel]\nshards = [2]\nper_rank = []\n";
    expect_error(
        &text,
        "output_norm",
        "tensors.\"output_norm.weight\".split",
        "only matrices (2 to 4 dims) are split",
    );
}

#[test]
fn splits_and_the_parallel_table_need_each_other() {
    let text = BASE.replace(
        "\"n_head * head_dim\"] }",
        "\"n_head * head_dim\"], split = \"rows\" }",
    );
    expect_error(
        &text,
        "split = \"rows\"",
        "tensors.\"blk.{i}.attn_q.weight\"",
        "`split` needs a [parallel] table",
    );
    let text = format!("{BASE}\n[parallel]\nshards = [2]\nper_rank = [\"n_head\"]\n");
    expect_error(
        &text,
        "[parallel]",
        "parallel",
        "no [tensors] entry has a `split`",
    );
}

/// A planned GPU count the default preset does not split into is an error at the tensor entry
/// (or the per_rank name) naming the tensor, the count and the preset, by `shard::part`'s rule.
#[test]
fn indivisible_splits_name_the_tensor_and_the_count() {
    // 64 rows of 2 heads: 3 GPUs split neither the rows nor the heads.
    let text = split_base("rows", "2, 3", "\"n_head\"");
    let line = "split = \"rows\"";
    let key = "tensors.\"blk.{i}.attn_q.weight\"";
    expect_error(
        &text,
        line,
        key,
        "3 GPUs ([parallel] shards) at preset `small`: tensor 'blk.0.attn_q.weight' (row blocks per GPU) rows: 64 does not split into 3 equal parts",
    );
    expect_error(
        &text,
        "per_rank =",
        "parallel.per_rank[0]",
        "3 GPUs ([parallel] shards) at preset `small`: n_head: 2 does not split into 3 equal parts",
    );
    let err = parse(&text).unwrap_err();
    assert_eq!(
        err.lines().count(),
        2,
        "one error per entry and count, none for 2 GPUs: {err}"
    );
    // 4 GPUs: 16 of 64 elements per row is not whole Q8_0 blocks of 32.
    let text = split_base("cols", "4", "");
    expect_error(
        &text,
        "split = \"cols\"",
        key,
        "4 GPUs ([parallel] shards) at preset `small`: tensor 'blk.0.attn_q.weight' (column blocks per GPU) row length: 16 of 64 elements per rank is not whole blocks of 32",
    );
    // [32, 2, 2]: 4 rows in 2 slices of the last dim; 4 GPUs get 1 row each, not whole slices.
    let text = split_base("rows", "4", "").replace(
        "[\"n_embd\", \"n_head * head_dim\"]",
        "[\"head_dim\", 2, \"n_head\"]",
    );
    expect_error(
        &text,
        "split = \"rows\"",
        key,
        "tensor 'blk.0.attn_q.weight' [32, 2, 2]: a block of 1 rows is not whole slices of its last dim",
    );
}

#[test]
fn stack_needs_several_per_layer_tensors() {
    let entry = "[[kernels]]\nfamily = \"matvec\"\ntensors = [\"token_embd.weight\"]\nstack = true\nk = \"ne0\"\nn = \"ne1\"\n";
    let text = format!("{BASE}\n{entry}");
    expect_error(&text, "stack = true", "kernels[1].stack", "two or more per-layer tensors");
    let text = format!("{BASE}\n[[kernels]]\nfamily = \"matvec\"\ntensors = [\"blk.{{i}}.attn_q.weight\"]\nstack = \"yes\"\n");
    expect_error(&text, "stack = \"yes\"", "kernels[1].stack", "expected true or false");
}

#[test]
fn widen_needs_a_stacked_entry() {
    let text = BASE.replace("family = \"rmsnorm\"\n", "family = \"rmsnorm\"\nwiden = true\n");
    expect_error(&text, "widen = true", "kernels[0].widen", "add stack = true");
}

#[test]
fn xq8_types_names_integer_path_types_and_needs_the_integer_path() {
    let entry = "[[kernels]]\nfamily = \"matvec\"\ntensors = [\"blk.{i}.attn_q.weight\"]\nk = \"ne0\"\nn = \"ne1\"\nxq8 = 1\nxq8_types = [\"q4_k\", \"bf16\"]\n";
    let text = format!("{BASE}\n{entry}");
    expect_error(&text, "xq8_types", "kernels[1].xq8_types[1]", "expected a weight type with the integer path");
    let entry = "[[kernels]]\nfamily = \"matvec\"\ntensors = [\"blk.{i}.attn_q.weight\"]\nk = \"ne0\"\nn = \"ne1\"\nxq8_types = [\"q4_k\"]\n";
    let text = format!("{BASE}\n{entry}");
    expect_error(&text, "xq8_types", "kernels[1].xq8_types", "add xq8 = 1");
    // An integer path that is off however it is written.
    for off in ["xq8 = 0", "xq8 = \"1 - 1\"", "xq8 = false\nfuse_x = \"0 * 4\""] {
        let entry = format!("[[kernels]]\nfamily = \"matvec\"\ntensors = [\"blk.{{i}}.attn_q.weight\"]\nk = \"ne0\"\nn = \"ne1\"\n{off}\nxq8_types = [\"q4_k\"]\n");
        expect_error(&format!("{BASE}\n{entry}"), "xq8_types", "kernels[1].xq8_types", "add xq8 = 1");
    }
    let entry = "[[kernels]]\nfamily = \"matvec\"\ntensors = [\"blk.{i}.attn_q.weight\"]\nk = \"ne0\"\nn = \"ne1\"\nxq8 = 1\nxq8_types = [\"q4_k\", \"q6_k\"]\n";
    assert!(parse(&format!("{BASE}\n{entry}")).is_ok());
}
