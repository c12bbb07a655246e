//! benches/results/*.json and the report `memra bench --report` writes conform to the schema in
//! benches/results/SCHEMA.md (engine/src/bench/report.rs holds the checker); the report merges
//! peers correctly and the SVG is complete. No GPU needed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use memra_engine::bench::report::{self, ALL_TABLES, Doc};
use memra_reference::Rng;
use serde_json::{Value, json};

fn results_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../benches/results")
}

fn committed() -> Vec<(PathBuf, Value)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(results_dir())
        .expect("benches/results exists")
        .map(|e| e.expect("readable dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no JSON files in benches/results");
    files
        .into_iter()
        .map(|p| {
            let text =
                std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            let v = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{}: not JSON: {e}", p.display()));
            (p, v)
        })
        .collect()
}

/// The first committed kernel-bench file (the report inputs).
fn committed_bench() -> (PathBuf, Value) {
    committed()
        .into_iter()
        .find(|(_, v)| report::doc_kind(v) == Doc::Bench)
        .expect("a committed memra bench JSON")
}

fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("memra-bench-schema-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

#[test]
fn committed_results_validate() {
    for (path, v) in committed() {
        if let Err(errs) = report::validate(&v, report::doc_kind(&v)) {
            panic!(
                "{} does not match benches/results/SCHEMA.md:\n  {}",
                path.display(),
                errs.join("\n  ")
            );
        }
    }
}

#[test]
fn schema_md_documents_every_checked_key() {
    let md = std::fs::read_to_string(results_dir().join("SCHEMA.md"))
        .expect("benches/results/SCHEMA.md");
    let missing: Vec<&str> = ALL_TABLES
        .iter()
        .flat_map(|t| t.iter().map(|(k, _)| *k))
        .filter(|k| !md.contains(&format!("`{k}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "keys the checker requires but SCHEMA.md does not document: {missing:?}"
    );
}

/// A peers file for every (family, shape, dtype) of `bench`: three impls with random times, one in
/// five torch_compile rows skipped. Returns it and the fastest time per key.
fn synthetic_peers(
    bench: &Value,
    rng: &mut Rng,
) -> (Value, HashMap<(String, String, String), f64>) {
    let mut rows = Vec::new();
    let mut best: HashMap<(String, String, String), f64> = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for r in bench["results"].as_array().expect("results") {
        let key = (
            r["family"].as_str().unwrap().to_string(),
            r["shape"].as_str().unwrap().to_string(),
            r["dtype"].as_str().unwrap().to_string(),
        );
        if !seen.insert(key.clone()) {
            continue;
        }
        let impls: &[&str] = if key.0 == "matvec" || key.0 == "matmul" {
            &["cublas", "torch_compile"]
        } else {
            &["torch_eager", "torch_compile"]
        };
        for imp in impls {
            let skipped = *imp == "torch_compile" && rng.below(5) == 0;
            let us = 1.0 + 1000.0 * rng.uniform_f64();
            let mut row = json!({"family": key.0, "shape": key.1, "dtype": key.2, "impl": imp, "peer_dtype": "bf16",
                "median_us": if skipped { Value::Null } else { json!(us) }, "bytes": 1000, "flops": Value::Null});
            if skipped {
                row["skipped"] = json!("synthetic: compile failed");
            } else {
                let b = best.entry(key.clone()).or_insert(f64::INFINITY);
                *b = b.min(us);
            }
            rows.push(row);
        }
    }
    // A shape memra bench does not run: reported as a `peer only` row.
    let attn_us = 1.0 + 100.0 * rng.uniform_f64();
    rows.push(json!({"family": "attn_decode", "shape": "h64_kv1_d576_dv512_c4096", "dtype": "bf16", "impl": "torch_eager",
        "peer_dtype": "bf16", "median_us": attn_us, "bytes": 9052160, "flops": 570425344}));
    best.insert(
        (
            "attn_decode".into(),
            "h64_kv1_d576_dv512_c4096".into(),
            "bf16".into(),
        ),
        attn_us,
    );
    let peers = json!({"schema": 1, "device": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0", "date": "2026-11-30T00:00:00Z",
        "compile_mode": "default", "iters": 30, "warmup": 5, "l2_bytes": 62914560, "copy_bytes": 2147483648u64,
        "copy_gbps": 4200.0, "results": rows});
    (peers, best)
}

fn memra_report(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_memra"))
        .arg("bench")
        .args(args)
        .output()
        .expect("run memra");
    assert!(
        out.status.success(),
        "memra bench {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn check_svg(svg: &str, peer_bars: usize, groups: usize) {
    assert!(
        svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""),
        "svg header: {}",
        &svg[..svg.len().min(80)]
    );
    assert!(svg.trim_end().ends_with("</svg>"), "svg not closed");
    assert_eq!(
        svg.matches("<text").count(),
        svg.matches("</text>").count(),
        "unbalanced <text>"
    );
    assert_eq!(
        svg.matches("<title>").count(),
        svg.matches("</title>").count(),
        "unbalanced <title>"
    );
    assert_eq!(
        svg.matches("fill=\"#2ca02c\"><title>").count(),
        peer_bars,
        "peer bars"
    );
    assert_eq!(
        svg.matches("<title>roofline ").count(),
        groups,
        "one roofline marker per group"
    );
    assert!(
        !svg.contains("NaN") && !svg.contains("inf\""),
        "non-finite coordinate in the svg"
    );
}

#[test]
fn report_without_peers_validates_and_charts() {
    let (path, bench) = committed_bench();
    let dir = scratch("nopeers");
    let (out_json, out_svg) = (dir.join("report.json"), dir.join("chart.svg"));
    let table = memra_report(&[
        "--report",
        path.to_str().unwrap(),
        "--json",
        out_json.to_str().unwrap(),
        "--svg",
        out_svg.to_str().unwrap(),
    ]);
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&out_json).unwrap()).unwrap();
    if let Err(errs) = report::validate(&doc, Doc::Bench) {
        panic!(
            "fresh report JSON does not match SCHEMA.md:\n  {}",
            errs.join("\n  ")
        );
    }
    let comparison = doc["comparison"].as_array().expect("comparison array");
    let mut keys: Vec<String> = bench["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            format!(
                "{}|{}|{}|{}",
                r["arch"], r["family"], r["shape"], r["dtype"]
            )
        })
        .collect();
    keys.sort();
    keys.dedup();
    assert_eq!(
        comparison.len(),
        keys.len(),
        "one comparison row per (arch, family, shape, dtype)"
    );
    assert!(
        comparison.iter().all(|c| c["peer_us"].is_null()),
        "no peers given, yet a peer figure appeared"
    );
    for g in bench["geomean_speedup"].as_array().unwrap() {
        let line = format!(
            "geomean specialized/generic, {}: {:.3}x",
            g["arch"].as_str().unwrap(),
            g["speedup"].as_f64().unwrap()
        );
        assert!(
            table.contains(&line),
            "report table lacks `{line}` (the run's own geomean)"
        );
    }
    check_svg(&std::fs::read_to_string(&out_svg).unwrap(), 0, keys.len());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn report_with_peers_picks_the_fastest_peer() {
    let (path, bench) = committed_bench();
    let mut rng = Rng::from_env_or_time("report_with_peers_picks_the_fastest_peer");
    let seed = rng.seed();
    let (peers, best) = synthetic_peers(&bench, &mut rng);
    report::validate(&peers, Doc::Peers)
        .unwrap_or_else(|e| panic!("seed {seed}: synthetic peers invalid: {e:?}"));
    let dir = scratch("peers");
    let peers_path = dir.join("peers.json");
    std::fs::write(&peers_path, serde_json::to_string(&peers).unwrap()).unwrap();
    let (out_json, out_svg) = (dir.join("report.json"), dir.join("chart.svg"));
    let table = memra_report(&[
        "--report",
        path.to_str().unwrap(),
        "--peers",
        peers_path.to_str().unwrap(),
        "--json",
        out_json.to_str().unwrap(),
        "--svg",
        out_svg.to_str().unwrap(),
    ]);
    assert!(
        table.contains("peers: torch 2.11.0"),
        "seed {seed}: table does not name the peer"
    );
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&out_json).unwrap()).unwrap();
    if let Err(errs) = report::validate(&doc, Doc::Bench) {
        panic!(
            "seed {seed}: fresh report JSON does not match SCHEMA.md:\n  {}",
            errs.join("\n  ")
        );
    }
    let comparison = doc["comparison"].as_array().unwrap();
    for c in comparison {
        let key = (
            c["family"].as_str().unwrap().to_string(),
            c["shape"].as_str().unwrap().to_string(),
            c["dtype"].as_str().unwrap().to_string(),
        );
        // serde_json's default float parsing may differ from the written value in the last ulp.
        let same = match (c["peer_us"].as_f64(), best.get(&key)) {
            (Some(got), Some(want)) => (got - want).abs() <= 1e-12 * want,
            (None, None) => true,
            _ => false,
        };
        assert!(
            same,
            "seed {seed}: peer of {key:?} is {} but the fastest non-skipped one is {:?}",
            c["peer_us"],
            best.get(&key)
        );
        let spec = bench["results"].as_array().unwrap().iter().find(|r| {
            r["kind"] == "specialized"
                && r["arch"] == c["arch"]
                && r["family"] == c["family"]
                && r["shape"] == c["shape"]
                && r["dtype"] == c["dtype"]
        });
        assert_eq!(
            c["specialized_us"].as_f64(),
            spec.and_then(|r| r["median_us"].as_f64()),
            "seed {seed}: specialized time of {key:?}"
        );
    }
    let peer_only: Vec<&Value> = comparison
        .iter()
        .filter(|c| c["arch"] == report::PEER_ONLY)
        .collect();
    assert_eq!(
        peer_only.len(),
        1,
        "seed {seed}: the attn_decode peer should be the one `peer only` row"
    );
    assert_eq!(peer_only[0]["family"], "attn_decode");
    assert_eq!(
        peer_only[0]["bytes"], 9052160,
        "peer-only rows carry the peer's bytes"
    );
    let with_peer = comparison
        .iter()
        .filter(|c| !c["peer_us"].is_null())
        .count();
    check_svg(
        &std::fs::read_to_string(&out_svg).unwrap(),
        with_peer,
        comparison.len(),
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn checker_rejects_what_the_schema_forbids() {
    let (_, bench) = committed_bench();
    type Mutation = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(&str, Mutation)> = vec![
        (
            "missing `median_us`",
            Box::new(|v| _ = v["results"][0].as_object_mut().unwrap().remove("median_us")),
        ),
        (
            "results[0].bytes: expected Int",
            Box::new(|v| v["results"][0]["bytes"] = json!("3244")),
        ),
        (
            "`fast` is not one of",
            Box::new(|v| v["results"][1]["kind"] = json!("fast")),
        ),
        (
            "missing `copy_gbps`",
            Box::new(|v| _ = v.as_object_mut().unwrap().remove("copy_gbps")),
        ),
        (
            "$.peers: missing `torch`",
            Box::new(|v| v["peers"] = json!({"schema": 1})),
        ),
        (
            "without a `skipped` reason",
            Box::new(|v| {
                v["peers"] = json!({"schema": 1, "device": "d", "torch": "t", "cuda": null, "date": "x", "compile_mode": null, "iters": 30,
                "warmup": 5, "l2_bytes": 1, "copy_bytes": 2, "copy_gbps": 1.0,
                "results": [{"family": "argmax", "shape": "1x8", "dtype": "f32", "impl": "torch_eager", "peer_dtype": "f32",
                             "median_us": null, "bytes": 32, "flops": null}]});
            }),
        ),
    ];
    for (expect, mutate) in cases {
        let mut v = bench.clone();
        mutate(&mut v);
        match report::validate(&v, Doc::Bench) {
            Ok(()) => panic!("checker accepted a document with {expect}"),
            Err(errs) => assert!(
                errs.iter().any(|e| e.contains(expect)),
                "expected an error containing {expect:?}, got {errs:?}"
            ),
        }
    }
}

#[test]
fn model_documents_validate() {
    let (_, bench) = committed_bench();
    let mut doc = json!({});
    for key in [
        "schema",
        "device",
        "sm",
        "driver",
        "date",
        "commit",
        "memra_version",
        "copy_bytes",
        "copy_gbps",
    ] {
        doc[key] = bench[key].clone();
    }
    doc["models"] = json!([{"model": "gemma-3-270m-it-Q4_K_M.gguf", "kernels": "specialized", "prefill_tokens": 512,
        "prefill_tok_s": 25000.0, "decode_tokens": 128, "decode_tok_s": 900.5, "decode_step_us": 1110.5,
        "weight_bytes": 253000000u64, "decode_floor_us": 59.4}]);
    assert_eq!(report::doc_kind(&doc), Doc::Model);
    report::validate(&doc, Doc::Model).unwrap_or_else(|e| panic!("model doc rejected: {e:?}"));
    doc["models"][0]
        .as_object_mut()
        .unwrap()
        .remove("decode_tok_s");
    let errs =
        report::validate(&doc, Doc::Model).expect_err("accepted a model row without decode_tok_s");
    assert!(errs.iter().any(|e| e.contains("decode_tok_s")), "{errs:?}");
}

/// `word` in `text` as a whole name (`topk` does not count inside `dsa_topk`).
fn has_word(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(i, _)| {
        let name_char = |c: char| c.is_ascii_alphanumeric() || c == '_';
        !text[..i].chars().next_back().is_some_and(name_char)
            && !text[i + word.len()..].chars().next().is_some_and(name_char)
    })
}

/// One shape of every `memra bench` family (the match below fails to compile when a family is
/// added, so it lands here, in SCHEMA.md and in peers.py together).
fn one_shape_per_family() -> Vec<memra_engine::bench::Shape> {
    use memra_engine::bench::Shape;
    use memra_engine::kernels::moe_matvec::Mode;
    use memra_gguf::GgmlType;
    let shapes = vec![
        Shape::Matvec {
            ty: GgmlType::Q8_0,
            k: 6144,
            n: 2048,
        },
        Shape::Matmul {
            ty: GgmlType::Q8_0,
            t: 4096,
            k: 6144,
            n: 2048,
        },
        Shape::Rmsnorm { rows: 1, n: 6144 },
        Shape::AddRmsnorm {
            rows: 1,
            n: 6144,
            delta_norm: false,
        },
        Shape::Glu {
            family: "swiglu",
            rows: 1,
            n_ff: 2048,
        },
        Shape::Glu {
            family: "geglu",
            rows: 1,
            n_ff: 2048,
        },
        Shape::Argmax {
            rows: 1,
            n_vocab: 154_880,
        },
        Shape::Topk {
            rows: 1,
            n_vocab: 256,
            k: 8,
        },
        Shape::Embed {
            ty: GgmlType::Q8_0,
            t: 1,
            n_embd: 6144,
            n_vocab: 154_880,
        },
        Shape::AttnDecode {
            n_head: 32,
            n_kv: 8,
            head_dim: 128,
            ctx: 4096,
        },
        Shape::AttnDecodeRope {
            n_head: 4,
            n_kv: 1,
            head_dim: 256,
            n_rot: 256,
            ctx: 4096,
        },
        Shape::AttnPrefill {
            t: 4096,
            n_head: 32,
            n_kv: 8,
            head_dim: 128,
        },
        Shape::QkNormRope {
            t: 1,
            n_head: 32,
            n_kv: 8,
            head_dim: 128,
            n_rot: 128,
        },
        Shape::MlaDecode {
            n_head: 64,
            kv_lora: 512,
            rope: 64,
            ctx: 32_768,
        },
        Shape::DsaIndexKey {
            t: 1,
            head_dim: 128,
            n_rot: 64,
        },
        Shape::DsaIndexer {
            n_head: 32,
            head_dim: 128,
            ctx: 131_072,
        },
        Shape::DsaTopk {
            ctx: 131_072,
            k: 2048,
        },
        Shape::MlaSparseDecode {
            n_head: 64,
            kv_lora: 512,
            rope: 64,
            ctx: 131_072,
            k: 2048,
        },
        Shape::MoeRouter {
            t: 1,
            n_expert: 256,
            n_used: 8,
            sigmoid: true,
        },
        Shape::MoeMatvec {
            ty: GgmlType::Q4_K,
            mode: Mode::Swiglu,
            t: 1,
            k: 6144,
            n: 2048,
            n_expert: 256,
            n_used: 8,
        },
        Shape::MoeMatvec {
            ty: GgmlType::Q8_0,
            mode: Mode::Plain,
            t: 64,
            k: 192,
            n: 512,
            n_expert: 64,
            n_used: 1,
        },
        Shape::NormMatvec {
            ty: GgmlType::Q5_0,
            glu: memra_engine::kernels::norm_matvec::Glu::Geglu,
            k: 640,
            n: 2048,
        },
        Shape::CombineMatvec {
            ty: GgmlType::Q4_K,
            k: 1024,
            n: 640,
            head_dim: 256,
            n_split: 8,
        },
    ];
    for s in &shapes {
        match s {
            Shape::Matvec { .. }
            | Shape::Matmul { .. }
            | Shape::Rmsnorm { .. }
            | Shape::AddRmsnorm { .. }
            | Shape::Glu { .. }
            | Shape::Argmax { .. }
            | Shape::Topk { .. }
            | Shape::Embed { .. }
            | Shape::AttnDecode { .. }
            | Shape::AttnDecodeRope { .. }
            | Shape::AttnPrefill { .. }
            | Shape::QkNormRope { .. }
            | Shape::MlaDecode { .. }
            | Shape::DsaIndexKey { .. }
            | Shape::DsaIndexer { .. }
            | Shape::DsaTopk { .. }
            | Shape::MlaSparseDecode { .. }
            | Shape::MoeRouter { .. }
            | Shape::MoeMatvec { .. }
            | Shape::NormMatvec { .. }
            | Shape::CombineMatvec { .. } => {}
        }
    }
    shapes
}

#[test]
fn every_bench_family_has_its_shape_bytes_and_peer_documented() {
    let md = std::fs::read_to_string(results_dir().join("SCHEMA.md")).expect("SCHEMA.md");
    let bytes_section = md
        .split("## Bytes per family")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("SCHEMA.md has a `## Bytes per family` section");
    let shape_row = md
        .lines()
        .find(|l| l.starts_with("| `shape` |"))
        .expect("SCHEMA.md documents `shape`");
    let peers = std::fs::read_to_string(results_dir().join("../../scripts/peers.py"))
        .expect("scripts/peers.py");
    for s in one_shape_per_family() {
        let fam = s.family();
        assert!(
            has_word(bytes_section, fam),
            "SCHEMA.md: no bytes for {fam}"
        );
        assert!(
            has_word(shape_row, fam),
            "SCHEMA.md: the `shape` row does not name {fam}"
        );
        assert!(
            peers.contains(&format!("\"{fam}\"")),
            "scripts/peers.py has no peer for {fam}"
        );
        assert!(s.bytes() > 0, "{fam} {}: zero bytes", s.label());
    }
}

/// peers.py parses every family's label as memra writes it (its `--list` needs no torch).
#[test]
fn peers_script_parses_every_bench_label() {
    let dir = scratch("labels");
    let results: Vec<Value> = one_shape_per_family()
        .iter()
        .map(|s| json!({"family": s.family(), "shape": s.label(), "dtype": s.dtype()}))
        .collect();
    let run = dir.join("run.json");
    std::fs::write(&run, json!({ "results": results }).to_string()).expect("write run.json");
    let script = results_dir().join("../../scripts/peers.py");
    let out = match Command::new("python3")
        .arg(&script)
        .arg("--from")
        .arg(&run)
        .arg("--list")
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            eprintln!("SKIP peers_script_parses_every_bench_label: python3 not runnable ({e})");
            return;
        }
    };
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "peers.py --list failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        text.lines().count(),
        results.len(),
        "one plan line per shape:\n{text}"
    );
    let skipped: Vec<&str> = text.lines().filter(|l| l.contains("skipped")).collect();
    assert!(
        skipped.is_empty(),
        "peers.py cannot express:\n{}",
        skipped.join("\n")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// scripts/bench-ab pools each build's runs per (variant, shape) and reports time(a) / time(b)
/// per pair and as geometric means; a file that is not a run is refused with status 2.
#[test]
fn bench_ab_compares_two_builds_runs() {
    let dir = scratch("bench-ab");
    let run = |name: &str, commit: &str, times: &[(&str, f64)]| -> PathBuf {
        let results: Vec<Value> = times
            .iter()
            .map(|(variant, us)| json!({"family": "matvec", "variant": variant, "shape": "k64_n64", "median_us": us}))
            .collect();
        let p = dir.join(name);
        std::fs::write(&p, json!({"commit": commit, "results": results}).to_string()).unwrap();
        p
    };
    // a: 10 and 30 us (mean 20) for x, 8 for y; b: 10 for x, 16 for y, z only in b.
    let a1 = run("a1.json", "aaaa", &[("x", 10.0), ("y", 8.0)]);
    let a2 = run("a2.json", "aaaa", &[("x", 30.0)]);
    let b1 = run("b1.json", "bbbb", &[("x", 10.0), ("y", 16.0), ("z", 1.0)]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/bench-ab");
    let out = Command::new("python3").arg(&script).arg("--a").args([&a1, &a2]).arg("--b").arg(&b1).output().expect("python3 runs");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("2.000") && text.contains("0.500"), "{text}");
    assert!(text.contains("geomean a/b, all: 1.000 over 2"), "{text}");
    assert!(text.contains("0 pairs only in a, 1 only in b"), "{text}");
    let bad = Command::new("python3").arg(&script).arg("--a").arg(dir.join("missing.json")).arg("--b").arg(&b1).output().expect("python3 runs");
    assert_eq!(bad.status.code(), Some(2), "{}", String::from_utf8_lossy(&bad.stderr));
    // --by-shape pairs differently named variants of one shape (a dim baked in a, at run time in
    // b); the kind keeps specialized and generic apart.
    let row = |variant: &str, kind: &str, us: f64| json!({"family": "matmul", "variant": variant, "kind": kind, "arch": "glm-dsa", "dtype": "q8_0", "shape": "t4096_k64_n64", "median_us": us});
    let (c, d) = (dir.join("c.json"), dir.join("d.json"));
    std::fs::write(&c, json!({"commit": "cccc", "results": [row("mm__k64_n64", "specialized", 30.0), row("mm__generic", "generic", 40.0)]}).to_string()).unwrap();
    std::fs::write(&d, json!({"commit": "dddd", "results": [row("mm__k64", "specialized", 20.0), row("mm__generic", "generic", 40.0)]}).to_string()).unwrap();
    let by_name = Command::new("python3").arg(&script).arg("--a").arg(&c).arg("--b").arg(&d).output().expect("python3 runs");
    assert!(String::from_utf8_lossy(&by_name.stdout).contains("geomean a/b, all: 1.000 over 1"), "{}", String::from_utf8_lossy(&by_name.stdout));
    let by_shape = Command::new("python3").arg(&script).arg("--by-shape").arg("--a").arg(&c).arg("--b").arg(&d).output().expect("python3 runs");
    let text = String::from_utf8_lossy(&by_shape.stdout).to_string();
    assert!(by_shape.status.success() && text.contains("1.500") && text.contains("geomean a/b, all: 1.225 over 2"), "{text}");
}
