//! `memra kernels`: list this build's kernel variants; compile them (cache-aware) for the GPU's
//! architecture or for `--sm` without a GPU; report ptxas registers and spills; `--load` times
//! a start-up (cache or NVRTC, then module load on the GPU).

use std::process::ExitCode;
use std::time::Instant;

use serde_json::{Value, json};

use crate::cuda::cache::KernelCache;
use crate::cuda::device::Gpu;
use crate::cuda::module::{CompiledVariant, compile_variants, load_modules};
use crate::cuda::nvrtc::HeaderSet;
use crate::cuda::{Error, SmArch, device, library};
use crate::kernels::registry::{self, KernelVariant};

#[derive(clap::Args, Debug, Clone, Default)]
pub struct KernelsCommand {
    /// Only variants specialized for this model architecture (e.g. glm-dsa), or `generic`.
    #[arg(long, value_name = "ARCH")]
    pub arch: Option<String>,
    /// Only this kernel family (e.g. rmsnorm).
    #[arg(long, value_name = "FAMILY")]
    pub family: Option<String>,
    /// Compile the listed variants with NVRTC (cache-aware), with per-variant time and cache hit/miss.
    #[arg(long)]
    pub compile: bool,
    /// Target GPU architecture (90, sm_90); without it the GPU's own (needs a GPU). NVRTC only.
    #[arg(long, value_name = "SM")]
    pub sm: Option<String>,
    /// Add registers and spills from ptxas -v (implies --compile).
    #[arg(long)]
    pub report: bool,
    /// Also load every listed variant onto GPU 0 (implies --compile; needs a GPU) and time the
    /// start-up: cache reads or NVRTC compiles, then module loads. With --clear-cache: a cold start.
    #[arg(long, conflicts_with = "sm")]
    pub load: bool,
    /// Remove the compiled-kernel cache (all memra versions and archs) first.
    #[arg(long)]
    pub clear_cache: bool,
    /// Machine-readable output on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(cmd: &KernelsCommand) -> ExitCode {
    match run_inner(cmd) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_inner(cmd: &KernelsCommand) -> Result<bool, Error> {
    let cache = KernelCache::from_env();
    if cmd.clear_cache {
        match cache.clear()? {
            Some(dir) => eprintln!("memra: removed kernel cache {}", dir.display()),
            None => eprintln!("memra: kernel cache is already empty"),
        }
        if !(cmd.compile || cmd.report || cmd.load) {
            return Ok(true);
        }
    }
    let variants: Vec<&'static KernelVariant> = registry::variants()
        .iter()
        .filter(|v| match cmd.arch.as_deref() {
            None => true,
            Some("generic") => v.is_generic(),
            Some(a) => v.is_for(a),
        })
        .filter(|v| cmd.family.as_deref().is_none_or(|f| v.family == f))
        .collect();
    if variants.is_empty() {
        // A filter that matches nothing is a mistake to name, not an empty table.
        let built: Vec<&str> = registry::SPECIALIZED_FOR.iter().map(|(a, _)| *a).collect();
        let families: std::collections::BTreeSet<&str> = registry::variants().iter().map(|v| v.family).collect();
        return Err(Error::Selection {
            detail: format!(
                "no variant matches --arch {} --family {} (this build: --arch generic{}; families {}); an architecture's specialized variants come with --features model-<arch>",
                cmd.arch.as_deref().unwrap_or("(any)"),
                cmd.family.as_deref().unwrap_or("(any)"),
                built.iter().map(|a| format!(", {a}")).collect::<String>(),
                families.into_iter().collect::<Vec<_>>().join(", ")
            ),
        });
    }
    if !(cmd.compile || cmd.report || cmd.load) {
        print_list(&variants, cmd.json);
        return Ok(true);
    }
    if cmd.load {
        return load(&variants, cmd);
    }

    let arch = match &cmd.sm {
        Some(text) => SmArch::parse(text).ok_or_else(|| Error::Selection {
            detail: format!("--sm {text}: expected a compute capability such as 90 or sm_90"),
        })?,
        None => device::device_arch(0).map_err(|e| Error::Selection {
            detail: format!("no GPU to take the architecture from ({e}); pass --sm 90 to compile with NVRTC only"),
        })?,
    };
    let nvrtc = library::nvrtc()?;
    let supported = crate::cuda::nvrtc::supported_archs()?;
    if !supported.contains(&arch.0) {
        return Err(Error::Selection { detail: format!("NVRTC {}.{} cannot target {arch} (it supports {supported:?})", nvrtc.version.0, nvrtc.version.1) });
    }
    let cache_dir = cache.config().dir.as_ref().map(|d| d.display().to_string()).unwrap_or_else(|| "memory only".into());
    eprintln!(
        "memra: NVRTC {}.{} from {}; target {arch}; cache {cache_dir}{}",
        nvrtc.version.0,
        nvrtc.version.1,
        nvrtc.lib.describe(),
        if cache.config().allow_compile { "" } else { " (MEMRA_NO_NVRTC=1: no compiling)" }
    );
    let headers = HeaderSet::registry();
    let start = Instant::now();
    let results = compile_variants(&cache, &variants, &headers, arch);
    let seconds = start.elapsed().as_secs_f64();
    let failures = results.iter().filter(|r| r.is_err()).count();
    if cmd.json {
        let rows: Vec<Value> = variants.iter().zip(&results).map(|(v, r)| json_row(v, Some(r), arch)).collect();
        println!("{}", serde_json::to_string_pretty(&Value::Array(rows)).unwrap_or_default());
    } else {
        print_compiled(&variants, &results, cmd.report, seconds);
    }
    for e in results.iter().filter_map(|r| r.as_ref().err()) {
        eprintln!("error: {e}");
    }
    if failures > 0 {
        eprintln!("memra: {failures} of {} kernels failed to compile for {arch}", variants.len());
    }
    Ok(failures == 0)
}

/// `--load`: what a model's start-up does with its kernels, timed in two parts on the GPU's own
/// architecture (the context is created first and not counted).
fn load(variants: &[&'static KernelVariant], cmd: &KernelsCommand) -> Result<bool, Error> {
    let start = Instant::now();
    let gpu = Gpu::new(0)?;
    let context = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let results = compile_variants(gpu.cache(), variants, &HeaderSet::registry(), gpu.arch());
    let fetch = start.elapsed().as_secs_f64();
    let failures = results.iter().filter(|r| r.is_err()).count();
    let compiled: Vec<CompiledVariant> = results.iter().filter_map(|r| r.as_ref().ok().cloned()).collect();
    let start = Instant::now();
    let kernels = load_modules(gpu.ctx(), gpu.stream(), &compiled)?;
    let module_load = start.elapsed().as_secs_f64();
    if cmd.json {
        let rows: Vec<Value> = variants.iter().zip(&results).map(|(v, r)| json_row(v, Some(r), gpu.arch())).collect();
        println!("{}", serde_json::to_string_pretty(&Value::Array(rows)).unwrap_or_default());
    } else {
        print_compiled(variants, &results, cmd.report, fetch);
    }
    for e in results.iter().filter_map(|r| r.as_ref().err()) {
        eprintln!("error: {e}");
    }
    let hits = compiled.iter().filter(|c| c.outcome.is_hit()).count();
    eprintln!(
        "memra: {} of {} variants ready on {} ({}) in {:.1} ms: cache reads and compiles {:.1} ms ({hits} hits, {} compiled), module loads {:.1} ms; context creation {:.1} ms not counted",
        kernels.len(),
        variants.len(),
        gpu.name(),
        gpu.arch(),
        (fetch + module_load) * 1e3,
        fetch * 1e3,
        compiled.len() - hits,
        module_load * 1e3,
        context * 1e3
    );
    Ok(failures == 0)
}

/// `glm-dsa`, `deepseek2,glm-dsa` for a variant two specs plan alike, or `generic`.
fn arch_label(v: &KernelVariant) -> String {
    if v.is_generic() { "generic".into() } else { v.archs().join(",") }
}

fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let last = cells.len() - 1;
        let text: Vec<String> =
            cells.iter().enumerate().map(|(i, c)| if i == last { c.clone() } else { format!("{c:<w$}", w = widths[i]) }).collect();
        println!("{}", text.join("  ").trim_end());
    };
    line(header.iter().map(|h| h.to_string()).collect());
    for row in rows {
        line(row.clone());
    }
}

fn print_list(variants: &[&'static KernelVariant], as_json: bool) {
    if as_json {
        let rows: Vec<Value> = variants.iter().map(|v| json_row(v, None, SmArch(0))).collect();
        println!("{}", serde_json::to_string_pretty(&Value::Array(rows)).unwrap_or_default());
        return;
    }
    let rows: Vec<Vec<String>> =
        variants.iter().map(|v| vec![v.name.to_string(), v.family.to_string(), arch_label(v), v.params_text()]).collect();
    print_table(&["variant", "family", "arch", "params"], &rows);
    let generic = variants.iter().filter(|v| v.is_generic()).count();
    println!("{} variants ({} specialized, {generic} generic)", variants.len(), variants.len() - generic);
}

fn print_compiled(variants: &[&'static KernelVariant], results: &[Result<CompiledVariant, Error>], report: bool, seconds: f64) {
    let mut header = vec!["variant", "family", "arch", "cache", "ms"];
    if report {
        header.extend(["regs", "spill st/ld", "stack"]);
    }
    let opt = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_else(|| "?".into());
    let rows: Vec<Vec<String>> = variants
        .iter()
        .zip(results)
        .map(|(v, r)| {
            let mut row = vec![v.name.to_string(), v.family.to_string(), arch_label(v)];
            match r {
                Ok(c) => {
                    row.push(if c.by_worker { "miss (worker)".to_string() } else { c.outcome.label().to_string() });
                    row.push(format!("{:.1}", c.seconds * 1e3));
                    if report {
                        let p = c.cubin.report();
                        row.push(opt(p.registers.map(u64::from)));
                        row.push(format!("{}/{}", opt(p.spill_stores), opt(p.spill_loads)));
                        row.push(opt(p.stack_frame));
                    }
                }
                Err(_) => row.extend(["FAILED".to_string(), "-".to_string()]),
            }
            row
        })
        .collect();
    print_table(&header, &rows);
    let ok: Vec<&CompiledVariant> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    let hits = ok.iter().filter(|c| c.outcome.is_hit()).count();
    let by_worker = ok.iter().filter(|c| c.by_worker).count();
    let workers = if by_worker > 0 { format!(" ({by_worker} in worker processes)") } else { String::new() };
    let mut summary = format!("{} variants: {hits} cache hits, {} compiled{workers}, {:.2} s in all", variants.len(), ok.len() - hits, seconds);
    if report {
        let spilling: Vec<&str> = ok.iter().filter(|c| c.cubin.report().spills()).map(|c| c.variant.name).collect();
        let max_regs = ok.iter().filter_map(|c| c.cubin.report().registers).max();
        summary.push_str(&format!("; max registers {}", opt(max_regs.map(u64::from))));
        if spilling.is_empty() {
            summary.push_str("; no spills");
        } else {
            summary.push_str(&format!("; spilling: {}", spilling.join(", ")));
        }
    }
    println!("{summary}");
}

fn json_row(v: &KernelVariant, result: Option<&Result<CompiledVariant, Error>>, arch: SmArch) -> Value {
    let params: serde_json::Map<String, Value> = v
        .params
        .iter()
        .map(|(k, p)| {
            let value = match p {
                registry::Param::Int(i) => json!(i),
                registry::Param::Sym(s) => json!(s),
            };
            (k.to_string(), value)
        })
        .collect();
    let mut row = json!({ "name": v.name, "family": v.family, "arch": v.arch, "archs": v.archs(), "params": params });
    if let Some(result) = result {
        row["sm"] = json!(arch.to_string());
        match result {
            Ok(c) => {
                let p = c.cubin.report();
                row["cache"] = json!(if c.outcome.is_hit() { "hit" } else { "miss" });
                row["ms"] = json!(c.seconds * 1e3);
                if !c.outcome.is_hit() {
                    row["compiled_by"] = json!(if c.by_worker { "worker" } else { "this process" });
                }
                row["cubin_bytes"] = json!(c.cubin.bytes.len());
                row["registers"] = json!(p.registers);
                row["spill_stores"] = json!(p.spill_stores);
                row["spill_loads"] = json!(p.spill_loads);
                row["stack_frame"] = json!(p.stack_frame);
            }
            Err(e) => row["error"] = json!(e.to_string()),
        }
    }
    row
}
