//! Shard-shape specialization: the spec's `[parallel] shards` (or `MEMRA_SHARDS`) plans the
//! per-rank shapes of each GPU count at the split rules of `memra_codegen::shard`.

use std::path::{Path, PathBuf};

use memra_codegen::build::{self, BuildRequest, Generated};
use memra_codegen::spec::ArchSpec;
use memra_codegen::variant::{KernelVariant, ParamVal};
use memra_codegen::{dims, shard};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn generate(shards: Option<Vec<usize>>) -> Generated {
    build::generate(&BuildRequest {
        specs_dir: root().join("specs"),
        templates_dir: root().join("templates"),
        out_dir: std::env::temp_dir().join("memra-codegen-shards-unused"),
        archs: vec!["glm-dsa".into()],
        model: None,
        shards,
    })
    .unwrap()
}

fn specialized(g: &Generated) -> Vec<&KernelVariant> {
    g.variants.iter().filter(|v| !v.is_generic()).collect()
}

/// A specialized variant of `family` that serves every `(key, value)` of `want`: baked, or
/// passed at run time (`at_run_time`) in one of the shapes it was planned for.
fn has(g: &Generated, family: &str, want: &[(&str, i64)]) -> bool {
    specialized(g).iter().any(|v| {
        let baked = |k: &str, x: i64| v.param(k) == Some(&ParamVal::Int(x));
        v.family == family
            && (want.iter().all(|(k, x)| baked(k, *x))
                || v.served.iter().any(|(_, s)| {
                    want.iter().all(|(k, x)| baked(k, *x) || s.iter().any(|(sk, sx)| sk == k && sx == x))
                }))
    })
}

fn int(d: &dims::ModelDims, name: &str) -> i64 {
    d.int(name).unwrap_or_else(|| panic!("{name}"))
}

#[test]
fn two_gpu_plan_holds_the_per_rank_dims() {
    let g = generate(Some(vec![2]));
    assert_eq!(g.sharded, vec![("glm-dsa".to_string(), vec![2])]);
    // GLM-5 preset: 64 heads · 256 = 16384 q_b rows, n_ff 12288, shared expert 2048, vocab 154880.
    for (family, want) in [
        ("mla_decode", &[("n_head", 32)][..]),
        ("mla_sparse_decode", &[("n_head", 32)]),
        ("mla_rope", &[("n_head", 32)]),
        ("matvec", &[("k", 2048), ("n", 12288)]), // attn_q_b rows / 2 stacked with the replicated indexer.attn_q_b
        ("matmul", &[("k", 2048), ("n", 8192)]),
        ("matvec", &[("k", 8192), ("n", 6144)]), // attn_output columns / 2
        ("matvec", &[("k", 6144), ("n", 6144)]), // ffn_gate / ffn_up rows / 2
        ("matvec", &[("k", 6144), ("n", 1024)]), // shared expert gate / up rows / 2
        ("matvec", &[("k", 1024), ("n", 6144)]), // shared expert down columns / 2
        ("matvec", &[("k", 6144), ("n", 77440)]), // LM head vocabulary rows / 2
        ("matmul", &[("k", 6144), ("n", 77440)]),
        ("swiglu", &[("n_ff", 6144)]),
        ("swiglu", &[("n_ff", 1024)]),
        ("moe_matvec", &[("k", 6144), ("n", 6144)]), // fused dense gate/up
        ("moe_matvec", &[("k", 6144), ("n", 1024)]), // fused shared-expert gate/up
    ] {
        assert!(
            has(&g, family, want),
            "no specialized {family} {want:?} in the 2-GPU plan"
        );
    }
    // What the ranks keep global is not planned again at a divided size.
    assert!(
        !has(&g, "argmax", &[("n_vocab", 77440)]),
        "argmax reads the gathered logits"
    );
    assert!(
        !has(&g, "moe_router", &[("n_expert", 128)]),
        "every rank routes over all experts"
    );
    assert!(
        !has(&g, "dsa_indexer", &[("n_idx_head", 16)]),
        "the indexer is replicated"
    );
    // The 1-GPU variants are all still there.
    let one = generate(Some(vec![]));
    assert!(one.sharded.is_empty());
    let names: Vec<String> = g.variants.iter().map(|v| v.name()).collect();
    for v in &one.variants {
        assert!(names.contains(&v.name()), "{} lost", v.name());
    }
    // The names show the shard dims (the one naming function).
    assert!(
        names.iter().any(|n| n.starts_with("mla_decode__n_head32_")),
        "{names:?}"
    );
}

/// How many variants each shard count adds (printed: the compile-time cost), and that only the
/// families whose shapes change per rank grow.
#[test]
fn shard_counts_add_only_the_changed_shapes() {
    let base = specialized(&generate(Some(vec![]))).len();
    let mut added = Vec::new();
    for n in [2, 4, 8] {
        let g = generate(Some(vec![n]));
        let extra: Vec<&KernelVariant> = specialized(&g).into_iter().skip(base).collect();
        let (matmuls, rest): (Vec<&KernelVariant>, Vec<&KernelVariant>) = extra.iter().partition(|v| v.family == "matmul");
        let mut families: Vec<&str> = rest.iter().map(|v| v.family.as_str()).collect();
        families.sort_unstable();
        families.dedup();
        println!(
            "{n} GPUs: +{} specialized variants ({} matmul, {families:?})",
            extra.len(),
            matmuls.len()
        );
        assert_eq!(
            families,
            ["matvec", "mla_decode", "mla_rope", "mla_sparse_decode", "moe_matvec", "swiglu"],
            "{n} GPUs"
        );
        // matvec at up to 7 shapes (q_b stacked with the indexer's q_b, attn_output, ffn gate/up,
        // ffn down, shexp gate/up, shexp down, LM head; fewer where a per-rank shape is another's,
        // e.g. ffn gate/up and down at 2 GPUs), 3 MLA (heads), 2 swiglu and 2 fused gate/up
        // (dense and shared-expert widths).
        let matvecs = rest.iter().filter(|v| v.family == "matvec").count();
        assert!(matvecs <= 7, "{n} GPUs: {matvecs} new matvec shapes");
        assert_eq!(rest.len(), matvecs + 3 + 2 + 2, "{n} GPUs");
        let n = n as i64;
        let per_rank_matvec = [(2048, 16384 / n + 4096), (16384 / n, 6144), (6144, 12288 / n), (12288 / n, 6144), (6144, 2048 / n), (2048 / n, 6144), (6144, 154880 / n)];
        for (k, rows) in per_rank_matvec {
            assert!(has(&g, "matvec", &[("k", k), ("n", rows)]), "{n} GPUs: no matvec at k {k} n {rows}");
        }
        // matmul takes N at run time (the spec's `at_run_time`): a shard count adds a variant
        // only for a new K, and every per-rank shape is served.
        let per_rank = [(2048, 16384 / n), (16384 / n, 6144), (6144, 12288 / n), (12288 / n, 6144), (6144, 2048 / n), (2048 / n, 6144), (6144, 154880 / n)];
        for (k, rows) in per_rank {
            assert!(has(&g, "matmul", &[("k", k), ("n", rows)]), "{n} GPUs: no matmul serves k {k} n {rows}");
        }
        assert!(matmuls.len() <= 3, "{n} GPUs: {} new matmul K values", matmuls.len());
        added.push(extra.len());
    }
    let default = generate(None);
    assert_eq!(default.sharded, vec![("glm-dsa".to_string(), vec![2, 8])]);
    assert_eq!(specialized(&default).len(), base + added[0] + added[2]);
}

#[test]
fn rank_dims_follow_the_split_rules() {
    let spec = ArchSpec::load(&root().join("specs/glm-dsa.toml")).unwrap();
    assert_eq!(
        spec.parallel.as_ref().map(|p| p.shards.clone()),
        Some(vec![2, 8])
    );
    let d = dims::from_preset(&spec, None).unwrap();
    let r = shard::rank_dims(&spec, &d, 8).unwrap();
    assert_eq!(int(&r, "n_head"), int(&d, "n_head") / 8);
    assert_eq!(int(&r, "n_ff"), int(&d, "n_ff") / 8);
    assert_eq!(int(&r, "n_ff_shexp"), int(&d, "n_ff_shexp") / 8);
    for kept in [
        "n_expert",
        "n_vocab",
        "indexer_n_head",
        "kv_lora_rank",
        "n_embd",
    ] {
        assert_eq!(int(&r, kept), int(&d, kept), "{kept}");
    }
    let shape = |dd: &dims::ModelDims, n: &str| dd.tensor(n).unwrap().shape.clone();
    assert_eq!(shape(&r, "blk.0.attn_k_b.weight"), vec![192, 512, 8]);
    assert_eq!(shape(&r, "blk.0.attn_output.weight"), vec![2048, 6144]);
    assert_eq!(
        shape(&r, "blk.5.ffn_gate_exps.weight"),
        vec![6144, 2048, 32]
    );
    assert_eq!(shape(&r, "output.weight"), vec![6144, 19360]);
    assert_eq!(
        shape(&r, "blk.5.ffn_gate_inp.weight"),
        shape(&d, "blk.5.ffn_gate_inp.weight")
    );
    let e = shard::rank_dims(&spec, &d, 3).unwrap_err();
    assert!(e.contains("3 equal parts"), "{e}");
    // A count the preset does not split into is a warning, not a failed build.
    let g = generate(Some(vec![3, 2]));
    assert_eq!(g.sharded, vec![("glm-dsa".to_string(), vec![2])]);
    assert!(
        g.warnings
            .iter()
            .any(|w| w.contains("no 3-GPU shard variants")),
        "{:?}",
        g.warnings
    );
}

#[test]
fn specs_without_a_parallel_table_are_not_split() {
    let g = build::generate(&BuildRequest {
        specs_dir: root().join("specs"),
        templates_dir: root().join("templates"),
        out_dir: std::env::temp_dir().join("memra-codegen-shards-unused"),
        archs: vec!["qwen3".into()],
        model: None,
        shards: Some(vec![2]),
    })
    .unwrap();
    assert!(g.sharded.is_empty());
    let reg = &g.files.last().unwrap().1;
    assert!(
        reg.contains("pub static SHARDS_FOR: &[(&str, &[usize])] = &[\n];"),
        "{reg}"
    );
}

#[test]
fn bad_shard_lists_are_located_errors() {
    let text = std::fs::read_to_string(root().join("specs/glm-dsa.toml")).unwrap();
    let bad = text.replace("shards = [2, 8]", "shards = [2, 0, \"x\"]");
    assert_ne!(bad, text);
    let e = ArchSpec::parse(Path::new("glm-dsa.toml"), &bad)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("parallel.shards[1]") && e.contains("parallel.shards[2]"),
        "{e}"
    );
    let e = ArchSpec::parse(
        Path::new("glm-dsa.toml"),
        &text.replace("shards = [2, 8]", "shard = 2"),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("parallel.shard") && e.contains("unknown key"),
        "{e}"
    );
}
