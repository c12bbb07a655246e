//! The report of a `memra bench` run: specialized vs generic vs the copy roofline vs peers
//! (scripts/peers.py: torch eager, torch.compile, cuBLAS), as a table, a report JSON and an SVG
//! chart. Needs no GPU: `memra bench --report RUN.json [--peers PEERS.json] [--svg OUT.svg]
//! [--json OUT.json]` works from files; a measuring run with `--svg`/`--peers` calls the same code.
//!
//! Also the schema checker of benches/results/SCHEMA.md (required keys and their JSON types) for
//! bench, `--model`, peers and report files.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;

use serde_json::{Value, json};

/// Fastest peer of one (family, shape, dtype): (impl, median µs, the dtype torch ran, its bytes).
pub type Peer = (String, f64, String, u64);
/// Geometric means: per architecture (arch, mean, shapes) and per (arch, family, mean, shapes).
pub type Geomeans = (Vec<(String, f64, usize)>, Vec<(String, String, f64, usize)>);

/// Specialized/generic speedup the kernels aim for (geometric mean per architecture).
pub const GOAL_SPEEDUP: f64 = 1.25;

fn read_json(path: &Path) -> Result<Value, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", path.display()))
}

fn write_text(path: &Path, text: &str) -> Result<(), String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// `memra bench --report RUN.json`: no measuring, the report of an earlier run.
pub fn run_report(args: &super::BenchArgs, run: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let doc = read_json(run)?;
    let kind = doc_kind(&doc);
    if kind != Doc::Bench {
        return Err(format!(
            "{}: a {kind:?} file; --report takes the JSON of a kernel run (`memra bench --json`)",
            run.display()
        )
        .into());
    }
    validate(&doc, Doc::Bench).map_err(|e| {
        format!(
            "{}: does not match benches/results/SCHEMA.md: {}",
            run.display(),
            e.join("; ")
        )
    })?;
    emit(args, doc)
}

/// Merge `--peers`, print the comparison, write `--json` (the report JSON) and `--svg`.
pub fn emit(args: &super::BenchArgs, mut doc: Value) -> Result<(), Box<dyn std::error::Error>> {
    if let Some(path) = &args.peers {
        let peers = read_json(path)?;
        validate(&peers, Doc::Peers).map_err(|e| {
            format!(
                "{}: not a peers file (scripts/peers.py): {}",
                path.display(),
                e.join("; ")
            )
        })?;
        doc["peers"] = peers;
    }
    let rows = compare(&doc);
    if args.peers.is_some() || args.report.is_some() {
        print!("{}", comparison_table(&doc, &rows));
        doc["comparison"] = Value::Array(rows.iter().map(CompareRow::to_json).collect());
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&doc)? + "\n";
        write_text(path, &text)?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.svg {
        write_text(path, &svg(&doc, &rows))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Comparison rows: one per (arch, family, shape, dtype).

/// The figures of one (arch, family, shape, dtype) of a run, with its best peer.
#[derive(Clone, Debug, PartialEq)]
pub struct CompareRow {
    pub arch: String,
    pub family: String,
    pub shape: String,
    pub dtype: String,
    pub bytes: u64,
    pub specialized_us: Option<f64>,
    pub generic_us: Option<f64>,
    /// Time to move `bytes` at the measured copy bandwidth.
    pub roofline_us: f64,
    /// Fastest non-skipped peer: (impl, median µs, its dtype, its bytes).
    pub peer: Option<Peer>,
}

impl CompareRow {
    pub fn speedup(&self) -> Option<f64> {
        Some(self.generic_us? / self.specialized_us?)
    }
    /// Percent of copy bandwidth the specialized variant reaches.
    pub fn pct_copy(&self) -> Option<f64> {
        self.specialized_us.map(|s| 100.0 * self.roofline_us / s)
    }
    fn to_json(&self) -> Value {
        json!({
            "arch": self.arch, "family": self.family, "shape": self.shape, "dtype": self.dtype,
            "bytes": self.bytes, "specialized_us": self.specialized_us, "generic_us": self.generic_us,
            "speedup_vs_generic": self.speedup(), "roofline_us": self.roofline_us, "pct_copy": self.pct_copy(),
            "peer_impl": self.peer.as_ref().map(|p| p.0.clone()), "peer_us": self.peer.as_ref().map(|p| p.1),
            "peer_dtype": self.peer.as_ref().map(|p| p.2.clone()), "peer_bytes": self.peer.as_ref().map(|p| p.3),
        })
    }
}

fn s(v: &Value, key: &str) -> String {
    v.get(key)
        .and_then(Value::as_str)
        .unwrap_or("?")
        .to_string()
}

/// The comparison rows of a bench document (with `peers` merged in or not), in run order.
pub fn compare(doc: &Value) -> Vec<CompareRow> {
    let copy_gbps = doc
        .get("copy_gbps")
        .and_then(Value::as_f64)
        .unwrap_or(f64::NAN);
    let mut peers: HashMap<(String, String, String), Peer> = HashMap::new();
    for p in doc
        .pointer("/peers/results")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let Some(us) = p.get("median_us").and_then(Value::as_f64) else {
            continue;
        };
        let key = (s(p, "family"), s(p, "shape"), s(p, "dtype"));
        let cand = (
            s(p, "impl"),
            us,
            p.get("peer_dtype")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string(),
            p.get("bytes").and_then(Value::as_u64).unwrap_or(0),
        );
        if peers.get(&key).is_none_or(|best| us < best.1) {
            peers.insert(key, cand);
        }
    }
    let mut rows: Vec<CompareRow> = Vec::new();
    for r in doc
        .get("results")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let (arch, family, shape, dtype) =
            (s(r, "arch"), s(r, "family"), s(r, "shape"), s(r, "dtype"));
        let us = r.get("median_us").and_then(Value::as_f64);
        let bytes = r.get("bytes").and_then(Value::as_u64).unwrap_or(0);
        let at = match rows.iter().position(|c| {
            c.arch == arch && c.family == family && c.shape == shape && c.dtype == dtype
        }) {
            Some(i) => i,
            None => {
                let peer = peers
                    .get(&(family.clone(), shape.clone(), dtype.clone()))
                    .cloned();
                rows.push(CompareRow {
                    arch,
                    family,
                    shape,
                    dtype,
                    bytes,
                    specialized_us: None,
                    generic_us: None,
                    roofline_us: bytes as f64 / (copy_gbps * 1e3),
                    peer,
                });
                rows.len() - 1
            }
        };
        match r.get("kind").and_then(Value::as_str) {
            Some("specialized") => rows[at].specialized_us = us,
            Some("generic") => rows[at].generic_us = us,
            _ => {}
        }
    }
    // Peer figures for shapes memra did not run (e.g. attn_decode from benches/peers-attention.json):
    // shown as baselines under their own heading, in the peers file's order.
    let mut extra: Vec<CompareRow> = Vec::new();
    for p in doc
        .pointer("/peers/results")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let (family, shape, dtype) = (s(p, "family"), s(p, "shape"), s(p, "dtype"));
        let known = |c: &CompareRow| c.family == family && c.shape == shape && c.dtype == dtype;
        if rows.iter().any(known) || extra.iter().any(known) {
            continue;
        }
        let Some(peer) = peers
            .get(&(family.clone(), shape.clone(), dtype.clone()))
            .cloned()
        else {
            continue;
        };
        let bytes = peer.3;
        extra.push(CompareRow {
            arch: PEER_ONLY.into(),
            family,
            shape,
            dtype,
            bytes,
            specialized_us: None,
            generic_us: None,
            roofline_us: bytes as f64 / (copy_gbps * 1e3),
            peer: Some(peer),
        });
    }
    rows.extend(extra);
    rows
}

/// The `arch` of comparison rows that only a peer measured (memra bench has no such shape).
pub const PEER_ONLY: &str = "peer only";

/// Geometric mean of specialized/generic per architecture, and per (architecture, family).
pub fn geomeans(rows: &[CompareRow]) -> Geomeans {
    let mut arch: Vec<(String, f64, usize)> = Vec::new();
    let mut fam: Vec<(String, String, f64, usize)> = Vec::new();
    for r in rows {
        let Some(x) = r.speedup() else { continue };
        match arch.iter_mut().find(|a| a.0 == r.arch) {
            Some(a) => (a.1, a.2) = (a.1 + x.ln(), a.2 + 1),
            None => arch.push((r.arch.clone(), x.ln(), 1)),
        }
        match fam.iter_mut().find(|f| f.0 == r.arch && f.1 == r.family) {
            Some(f) => (f.2, f.3) = (f.2 + x.ln(), f.3 + 1),
            None => fam.push((r.arch.clone(), r.family.clone(), x.ln(), 1)),
        }
    }
    (
        arch.into_iter()
            .map(|(a, l, n)| (a, (l / n as f64).exp(), n))
            .collect(),
        fam.into_iter()
            .map(|(a, f, l, n)| (a, f, (l / n as f64).exp(), n))
            .collect(),
    )
}

fn us(x: Option<f64>) -> String {
    x.map(|v| format!("{v:.2}")).unwrap_or_else(|| "-".into())
}

/// The human table: per architecture, one line per (family, shape, dtype), then the verdicts.
pub fn comparison_table(doc: &Value, rows: &[CompareRow]) -> String {
    let mut t = String::new();
    let copy = doc
        .get("copy_gbps")
        .and_then(Value::as_f64)
        .unwrap_or(f64::NAN);
    let _ = writeln!(
        t,
        "\nmemra bench report: {} ({}), {}, commit {}",
        s(doc, "device"),
        s(doc, "driver"),
        s(doc, "date"),
        s(doc, "commit")
    );
    let _ = writeln!(
        t,
        "copy bandwidth {copy:.0} GB/s; roofline = bytes / copy bandwidth; %copy = roofline / specialized time"
    );
    match doc.get("peers") {
        Some(p) => {
            let _ = writeln!(
                t,
                "peers: torch {} on {} (torch.compile mode {}), copy {:.0} GB/s; quantized weights run as dequantized bf16 in torch{}",
                s(p, "torch"),
                s(p, "device"),
                p.get("compile_mode")
                    .and_then(Value::as_str)
                    .unwrap_or("off"),
                p.get("copy_gbps")
                    .and_then(Value::as_f64)
                    .unwrap_or(f64::NAN),
                if p.get("complete") == Some(&Value::Bool(false)) {
                    "\nWARNING: the peers file is incomplete (scripts/peers.py stopped early; see its log)"
                } else {
                    ""
                }
            );
        }
        None => {
            let _ = writeln!(t, "peers: none (run scripts/peers.py and pass --peers)");
        }
    }
    let mut arch_order: Vec<&str> = Vec::new();
    for r in rows {
        if !arch_order.contains(&r.arch.as_str()) {
            arch_order.push(&r.arch);
        }
    }
    let (by_arch, by_fam) = geomeans(rows);
    for arch in arch_order {
        let _ = writeln!(t, "\n== {arch}");
        let _ = writeln!(
            t,
            "{:<17} {:<34} {:<6} {:>10} {:>10} {:>9} {:>7} {:>11} {:>10}  peer (impl, dtype)",
            "family",
            "shape",
            "dtype",
            "spec_us",
            "gen_us",
            "spec/gen",
            "%copy",
            "roofline_us",
            "peer_us"
        );
        for r in rows.iter().filter(|r| r.arch == arch) {
            let _ = writeln!(
                t,
                "{:<17} {:<34} {:<6} {:>10} {:>10} {:>9} {:>7} {:>11.2} {:>10}  {}",
                r.family,
                r.shape,
                r.dtype,
                us(r.specialized_us),
                us(r.generic_us),
                r.speedup()
                    .map(|x| format!("{x:.2}x"))
                    .unwrap_or_else(|| "-".into()),
                r.pct_copy()
                    .map(|x| format!("{x:.1}%"))
                    .unwrap_or_else(|| "-".into()),
                r.roofline_us,
                us(r.peer.as_ref().map(|p| p.1)),
                r.peer
                    .as_ref()
                    .map(|p| format!("{}, {}", p.0, p.2))
                    .unwrap_or_else(|| "-".into()),
            );
        }
        for (a, g, n) in by_arch.iter().filter(|a| a.0 == arch) {
            let slow: Vec<String> = by_fam
                .iter()
                .filter(|f| f.0 == *a && f.2 < 1.0)
                .map(|f| format!("{} {:.2}x", f.1, f.2))
                .collect();
            let _ = writeln!(
                t,
                "geomean specialized/generic, {a}: {g:.3}x over {n} shapes — goal >= {GOAL_SPEEDUP:.2}x: {}; families slower than generic: {}",
                if *g >= GOAL_SPEEDUP { "met" } else { "NOT met" },
                if slow.is_empty() {
                    "none".to_string()
                } else {
                    slow.join(", ")
                }
            );
        }
    }
    t
}

// ---------------------------------------------------------------------------------------------
// SVG: one horizontal group of bars per (family, shape, dtype), sections per architecture,
// log-scale time axis; bars: specialized, generic, peer; roofline as a black tick.

const COLOR_SPEC: &str = "#1f77b4";
const COLOR_GEN: &str = "#ff7f0e";
const COLOR_PEER: &str = "#2ca02c";

fn esc(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The chart as a standalone SVG document.
pub fn svg(doc: &Value, rows: &[CompareRow]) -> String {
    const W: f64 = 1200.0;
    const LABEL_W: f64 = 360.0;
    const RIGHT_W: f64 = 170.0;
    const BAR_H: f64 = 5.0;
    const GROUP_GAP: f64 = 6.0;
    const SECTION_H: f64 = 34.0;
    const TOP: f64 = 128.0;
    let plot_x0 = LABEL_W;
    let plot_x1 = W - RIGHT_W;

    // Axis range: decades around every measured time (rooflines below it are clamped and drawn hollow).
    let times: Vec<f64> = rows
        .iter()
        .flat_map(|r| [r.specialized_us, r.generic_us, r.peer.as_ref().map(|p| p.1)])
        .flatten()
        .filter(|x| x.is_finite() && *x > 0.0)
        .collect();
    let lo_t = times.iter().copied().fold(f64::INFINITY, f64::min);
    let hi_t = times.iter().copied().fold(0.0, f64::max);
    let (lo, hi) = if times.is_empty() {
        (0.0, 3.0)
    } else {
        (
            lo_t.log10().floor() - 0.0,
            hi_t.log10().ceil().max(lo_t.log10().floor() + 1.0),
        )
    };
    let x_of = |t: f64| plot_x0 + (t.log10().clamp(lo, hi) - lo) / (hi - lo) * (plot_x1 - plot_x0);

    let mut arch_order: Vec<&str> = Vec::new();
    for r in rows {
        if !arch_order.contains(&r.arch.as_str()) {
            arch_order.push(&r.arch);
        }
    }
    let has_peers = rows.iter().any(|r| r.peer.is_some());
    let bars = if has_peers { 3.0 } else { 2.0 };
    let group_h = bars * BAR_H + GROUP_GAP;
    let height = TOP + arch_order.len() as f64 * SECTION_H + rows.len() as f64 * group_h + 60.0;
    let (by_arch, _) = geomeans(rows);

    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height:.0}" viewBox="0 0 {W} {height:.0}" font-family="DejaVu Sans, Arial, sans-serif" font-size="11">"#
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let commit: String = s(doc, "commit").chars().take(12).collect();
    let _ = writeln!(
        o,
        r#"<text x="{}" y="24" font-size="17" font-weight="bold" text-anchor="middle">{}</text>"#,
        W / 2.0,
        esc(&format!(
            "memra kernels: specialized vs generic vs roofline{} — {} — {} — commit {}",
            if has_peers { " vs peers" } else { "" },
            s(doc, "device"),
            s(doc, "date"),
            commit
        ))
    );
    let copy = doc
        .get("copy_gbps")
        .and_then(Value::as_f64)
        .unwrap_or(f64::NAN);
    let peer_note = match doc.get("peers") {
        Some(p) => format!(
            "peer = fastest of torch {} eager / torch.compile ({}) / cuBLAS; quantized weights run dequantized to bf16 in torch",
            s(p, "torch"),
            p.get("compile_mode")
                .and_then(Value::as_str)
                .unwrap_or("off")
        ),
        None => "no peer figures in this report (scripts/peers.py)".to_string(),
    };
    for (y, line) in [
        (
            42,
            format!(
                "median device time per launch, log scale, shorter is better; roofline = bytes / copy bandwidth ({copy:.0} GB/s)"
            ),
        ),
        (56, peer_note),
    ] {
        let _ = writeln!(
            o,
            r##"<text x="{}" y="{y}" font-size="11" text-anchor="middle" fill="#444">{}</text>"##,
            W / 2.0,
            esc(&line)
        );
    }

    // Legend.
    let mut lx = plot_x0;
    let mut legend = vec![(COLOR_SPEC, "specialized"), (COLOR_GEN, "generic")];
    if has_peers {
        legend.push((COLOR_PEER, "peer (best torch)"));
    }
    for (color, name) in legend {
        let _ = writeln!(
            o,
            r#"<rect x="{lx}" y="66" width="14" height="10" fill="{color}"/><text x="{}" y="75">{name}</text>"#,
            lx + 18.0
        );
        lx += 30.0 + 7.0 * name.len() as f64;
    }
    let _ = writeln!(
        o,
        r#"<line x1="{lx}" y1="64" x2="{lx}" y2="78" stroke="black" stroke-width="2"/><text x="{}" y="75">roofline (hollow: below the axis)</text>"#,
        lx + 6.0
    );
    let _ = writeln!(
        o,
        r#"<text x="{}" y="75" text-anchor="end">spec/gen · peer/spec</text>"#,
        W - 10.0
    );

    // Axis ticks (1-2-5 per decade) with grid lines over the whole plot.
    let plot_y0 = TOP - 14.0;
    let plot_y1 = height - 50.0;
    let mut decade = lo as i32;
    while decade as f64 <= hi {
        for m in [1.0, 2.0, 5.0] {
            let t = m * 10f64.powi(decade);
            if t.log10() > hi + 1e-9 {
                break;
            }
            let x = x_of(t);
            let major = m == 1.0;
            let _ = writeln!(
                o,
                r#"<line x1="{x:.1}" y1="{plot_y0}" x2="{x:.1}" y2="{plot_y1}" stroke="{}" stroke-width="1"/>"#,
                if major { "#bbb" } else { "#e6e6e6" }
            );
            // Minor tick labels only where a decade is wide enough to hold them.
            if !major && (plot_x1 - plot_x0) / (hi - lo) < 160.0 {
                continue;
            }
            let label = match t {
                t if t >= 1e6 => format!("{} s", t / 1e6),
                t if t >= 1e3 => format!("{} ms", t / 1e3),
                t => format!("{t} µs"),
            };
            for y in [plot_y0 - 4.0, plot_y1 + 14.0] {
                let _ = writeln!(
                    o,
                    r##"<text x="{x:.1}" y="{y}" text-anchor="middle" fill="#333" font-size="10">{}</text>"##,
                    esc(&label)
                );
            }
        }
        decade += 1;
    }

    let mut y = TOP;
    for arch in &arch_order {
        let mean = by_arch.iter().find(|a| a.0 == *arch);
        let verdict = match mean {
            Some((_, g, n)) => format!(
                "geomean specialized/generic {g:.3}x over {n} shapes (goal ≥ {GOAL_SPEEDUP:.2}x: {})",
                if *g >= GOAL_SPEEDUP { "met" } else { "not met" }
            ),
            None if *arch == PEER_ONLY => {
                "torch baselines for shapes memra bench does not run yet".to_string()
            }
            None => "no specialized/generic pairs".to_string(),
        };
        let _ = writeln!(
            o,
            r##"<rect x="0" y="{}" width="{W}" height="22" fill="#f0f0f0"/>"##,
            y + 4.0
        );
        let _ = writeln!(
            o,
            r#"<text x="10" y="{}" font-size="13" font-weight="bold">{} <tspan font-weight="normal" font-size="11">— {}</tspan></text>"#,
            y + 20.0,
            esc(arch),
            esc(&verdict)
        );
        y += SECTION_H;
        for r in rows.iter().filter(|r| r.arch == *arch) {
            let mid = y + bars * BAR_H / 2.0;
            let _ = writeln!(
                o,
                r#"<text x="{}" y="{:.1}" text-anchor="end" font-size="10">{}</text>"#,
                plot_x0 - 6.0,
                mid + 3.5,
                esc(&format!("{} {} {}", r.family, r.shape, r.dtype))
            );
            let mut by = y;
            let mut series = vec![(COLOR_SPEC, r.specialized_us), (COLOR_GEN, r.generic_us)];
            if has_peers {
                series.push((COLOR_PEER, r.peer.as_ref().map(|p| p.1)));
            }
            for (color, t) in series {
                if let Some(t) = t.filter(|t| t.is_finite() && *t > 0.0) {
                    let _ = writeln!(
                        o,
                        r#"<rect x="{plot_x0}" y="{by:.1}" width="{:.1}" height="{BAR_H}" fill="{color}"><title>{}</title></rect>"#,
                        (x_of(t) - plot_x0).max(1.0),
                        esc(&format!("{t:.2} µs"))
                    );
                }
                by += BAR_H;
            }
            if r.roofline_us.is_finite() && r.roofline_us > 0.0 {
                let x = x_of(r.roofline_us);
                let clipped = r.roofline_us.log10() < lo;
                let _ = writeln!(
                    o,
                    r#"<rect x="{:.1}" y="{:.1}" width="3" height="{:.1}" fill="{}" stroke="black" stroke-width="1"><title>{}</title></rect>"#,
                    x - 1.5,
                    y - 1.0,
                    bars * BAR_H + 2.0,
                    if clipped { "white" } else { "black" },
                    esc(&format!(
                        "roofline {:.3} µs ({} bytes)",
                        r.roofline_us, r.bytes
                    ))
                );
            }
            // Green where memra wins (specialized over generic; memra over the peer), red where it loses.
            let color = |x: Option<f64>| match x {
                Some(x) if x >= 1.0 => "#17692a",
                Some(_) => "#b00020",
                None => "#333",
            };
            let mut right = format!(
                r#"<tspan fill="{}">{}</tspan>"#,
                color(r.speedup()),
                r.speedup()
                    .map(|x| format!("{x:.2}x"))
                    .unwrap_or_else(|| "-".into())
            );
            if let (Some(p), Some(sp)) = (&r.peer, r.specialized_us) {
                let ratio = p.1 / sp;
                let _ = write!(
                    right,
                    r#" · <tspan fill="{}">{ratio:.2}x {}</tspan>"#,
                    color(Some(ratio)),
                    esc(p.0.trim_start_matches("torch_"))
                );
            }
            let _ = writeln!(
                o,
                r#"<text x="{}" y="{:.1}" font-size="10">{right}</text>"#,
                plot_x1 + 8.0,
                mid + 3.5
            );
            y += group_h;
        }
    }
    let _ = writeln!(
        o,
        r##"<text x="10" y="{:.0}" font-size="10" fill="#444">{}</text>"##,
        height - 12.0,
        esc(
            "spec/gen = generic time / specialized time (> 1: specialization pays); peer/spec = peer time / specialized time (> 1: memra faster). Bytes per family: benches/results/SCHEMA.md."
        )
    );
    o.push_str("</svg>\n");
    o
}

// ---------------------------------------------------------------------------------------------
// Schema checker (benches/results/SCHEMA.md): required keys and their JSON types.

/// Which kind of document.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Doc {
    /// `memra bench --json` (kernel families), optionally with `peers` and `comparison` (a report).
    Bench,
    /// `memra bench --model FILE --json`.
    Model,
    /// scripts/peers.py output.
    Peers,
    /// `memra bench --sweep matvec --json` (bench/sweep.rs).
    Sweep,
    /// `memra bench --synthetic PRESET --json` (bench_synthetic.rs).
    Synthetic,
    /// `memra bench --synthetic PRESET --gpus N --json` (bench_synthetic.rs).
    SyntheticGpus,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ty {
    Int,
    Float,
    Str,
    Array,
    Object,
    IntOrNull,
    FloatOrNull,
    StrOrNull,
    Bool,
    ObjectOrNull,
    /// Keys added after files were committed without them: absent, or an int / float or null.
    IntOrAbsent,
    FloatOrNullOrAbsent,
}

impl Ty {
    fn matches(self, v: &Value) -> bool {
        match self {
            Ty::Int => v.is_i64() || v.is_u64(),
            Ty::Float => v.is_number(),
            Ty::Str => v.is_string(),
            Ty::Array => v.is_array(),
            Ty::Object => v.is_object(),
            Ty::IntOrNull => v.is_null() || v.is_i64() || v.is_u64(),
            Ty::FloatOrNull => v.is_null() || v.is_number(),
            Ty::StrOrNull => v.is_null() || v.is_string(),
            Ty::Bool => v.is_boolean(),
            Ty::ObjectOrNull => v.is_null() || v.is_object(),
            Ty::IntOrAbsent => v.is_i64() || v.is_u64(),
            Ty::FloatOrNullOrAbsent => v.is_null() || v.is_number(),
        }
    }
}

/// Top-level keys every bench, model and report file has.
pub const COMMON: &[(&str, Ty)] = &[
    ("schema", Ty::Int),
    ("device", Ty::Str),
    ("sm", Ty::Str),
    ("driver", Ty::Str),
    ("date", Ty::Str),
    ("commit", Ty::Str),
    ("memra_version", Ty::Str),
    ("copy_bytes", Ty::Int),
    ("copy_gbps", Ty::Float),
];
pub const BENCH_TOP: &[(&str, Ty)] = &[
    ("iters", Ty::Int),
    ("warmup", Ty::Int),
    ("l2_bytes", Ty::Int),
    ("geomean_speedup", Ty::Array),
    ("results", Ty::Array),
];
pub const GEOMEAN: &[(&str, Ty)] = &[
    ("arch", Ty::Str),
    ("speedup", Ty::Float),
    ("shapes", Ty::Int),
];
pub const RESULT: &[(&str, Ty)] = &[
    ("family", Ty::Str),
    ("variant", Ty::Str),
    ("kind", Ty::Str),
    ("arch", Ty::Str),
    ("origin", Ty::Str),
    ("shape", Ty::Str),
    ("dtype", Ty::Str),
    ("median_us", Ty::Float),
    ("min_us", Ty::Float),
    ("max_us", Ty::Float),
    ("reps", Ty::Int),
    ("buffer_sets", Ty::Int),
    ("bytes", Ty::Int),
    ("gbps", Ty::Float),
    ("pct_copy", Ty::Float),
    ("flops", Ty::IntOrNull),
    ("tflops", Ty::FloatOrNull),
    ("speedup_vs_generic", Ty::FloatOrNull),
    ("stream_us", Ty::FloatOrNullOrAbsent),
    ("stream_pct_copy", Ty::FloatOrNullOrAbsent),
];
pub const MODEL: &[(&str, Ty)] = &[
    ("model", Ty::Str),
    ("kernels", Ty::Str),
    ("prefill_tokens", Ty::Int),
    ("prefill_tok_s", Ty::Float),
    ("decode_tokens", Ty::Int),
    ("decode_tok_s", Ty::Float),
    ("decode_step_us", Ty::Float),
    ("weight_bytes", Ty::Int),
    ("decode_floor_us", Ty::Float),
];
/// `synthetic` of a `--synthetic` run, its `last_layer` (when not null) and `layer_bytes[]`.
pub const SYNTHETIC: &[(&str, Ty)] = &[
    ("preset", Ty::Str),
    ("arch", Ty::Str),
    ("layers", Ty::Int),
    ("ctx", Ty::Int),
    ("decode_steps", Ty::Int),
    ("seed", Ty::Int),
    ("weight_bytes", Ty::Int),
    ("generate_s", Ty::Float),
    ("step_median_us", Ty::Float),
    ("step_min_us", Ty::Float),
    ("step_bytes", Ty::Int),
    ("step_floor_us", Ty::Float),
    ("step_ratio_to_floor", Ty::Float),
    ("per_layer_us", Ty::Float),
    ("last_layer", Ty::ObjectOrNull),
    ("logits_finite", Ty::Bool),
    ("prompt_tokens", Ty::IntOrAbsent),
    ("prefill_tok_s", Ty::FloatOrNullOrAbsent),
    ("layer_bytes", Ty::Array),
];
/// `synthetic_gpus` of a `--synthetic --gpus N` run and its `runs[]`.
pub const SYNTHETIC_GPUS: &[(&str, Ty)] = &[
    ("preset", Ty::Str),
    ("arch", Ty::Str),
    ("layers", Ty::Int),
    ("ctx", Ty::Int),
    ("decode_steps", Ty::Int),
    ("prompt_tokens", Ty::Int),
    ("seed", Ty::Int),
    ("weight_bytes", Ty::Int),
    ("runs", Ty::Array),
];
pub const SYNTHETIC_GPU_RUN: &[(&str, Ty)] = &[
    ("gpus", Ty::Int),
    ("measured", Ty::Bool),
    ("note", Ty::StrOrNull),
    ("generate_s", Ty::FloatOrNull),
    ("step_median_us", Ty::FloatOrNull),
    ("step_min_us", Ty::FloatOrNull),
    ("decode_tok_s", Ty::FloatOrNull),
    ("per_layer_us", Ty::FloatOrNull),
    ("last_layer_us", Ty::FloatOrNull),
    ("prefill_tok_s", Ty::FloatOrNull),
    ("speedup_vs_1_gpu", Ty::FloatOrNull),
    ("step_bytes_per_gpu", Ty::Int),
    ("step_floor_us", Ty::Float),
    ("decode_tok_s_floor", Ty::Float),
    ("step_ratio_to_floor", Ty::FloatOrNull),
];
pub const SYNTHETIC_LAST_LAYER: &[(&str, Ty)] = &[
    ("layer", Ty::Int),
    ("us", Ty::Float),
    ("bytes", Ty::Int),
    ("floor_us", Ty::Float),
    ("ratio_to_floor", Ty::Float),
];
pub const SYNTHETIC_LAYER: &[(&str, Ty)] = &[
    ("layer", Ty::Int),
    ("ffn", Ty::Str),
    ("weight_bytes", Ty::Int),
    ("decode_weight_bytes", Ty::Int),
    ("decode_cache_bytes", Ty::Int),
];
pub const PEERS_TOP: &[(&str, Ty)] = &[
    ("schema", Ty::Int),
    ("device", Ty::Str),
    ("torch", Ty::Str),
    ("cuda", Ty::StrOrNull),
    ("date", Ty::Str),
    ("compile_mode", Ty::StrOrNull),
    ("iters", Ty::Int),
    ("warmup", Ty::Int),
    ("l2_bytes", Ty::Int),
    ("copy_bytes", Ty::Int),
    ("copy_gbps", Ty::Float),
    ("results", Ty::Array),
];
pub const PEER_RESULT: &[(&str, Ty)] = &[
    ("family", Ty::Str),
    ("shape", Ty::Str),
    ("dtype", Ty::Str),
    ("impl", Ty::Str),
    ("peer_dtype", Ty::StrOrNull),
    ("median_us", Ty::FloatOrNull),
    ("bytes", Ty::IntOrNull),
    ("flops", Ty::IntOrNull),
];
pub const COMPARISON: &[(&str, Ty)] = &[
    ("arch", Ty::Str),
    ("family", Ty::Str),
    ("shape", Ty::Str),
    ("dtype", Ty::Str),
    ("bytes", Ty::Int),
    ("specialized_us", Ty::FloatOrNull),
    ("generic_us", Ty::FloatOrNull),
    ("speedup_vs_generic", Ty::FloatOrNull),
    ("roofline_us", Ty::Float),
    ("pct_copy", Ty::FloatOrNull),
    ("peer_impl", Ty::StrOrNull),
    ("peer_us", Ty::FloatOrNull),
    ("peer_dtype", Ty::StrOrNull),
    ("peer_bytes", Ty::IntOrNull),
];
pub const SWEEP_TOP: &[(&str, Ty)] = &[
    ("tool", Ty::Str),
    ("commit", Ty::Str),
    ("date", Ty::Str),
    ("device", Ty::Str),
    ("sm", Ty::Str),
    ("driver", Ty::Str),
    ("copy_gbps", Ty::Float),
    ("iters", Ty::Int),
    ("warmup", Ty::Int),
    ("l2_flushed", Ty::Bool),
    ("cases_planned", Ty::Int),
    ("cases_done", Ty::Int),
    ("tolerance_rel_l2", Ty::Float),
    ("pattern_rows", Ty::Int),
    ("cases", Ty::Array),
];
pub const SWEEP_CASE: &[(&str, Ty)] = &[
    ("model", Ty::Str),
    ("tensor", Ty::Str),
    ("k", Ty::Int),
    ("n", Ty::Int),
    ("dtype", Ty::Str),
    ("batch", Ty::Int),
    ("bytes", Ty::Int),
    ("best_specialized", Ty::ObjectOrNull),
    ("best_generic", Ty::ObjectOrNull),
    ("baseline_default_per_tile", Ty::ObjectOrNull),
    ("candidates", Ty::Array),
];
pub const SWEEP_CANDIDATE: &[(&str, Ty)] = &[
    ("variant", Ty::Str),
    ("kind", Ty::Str),
    ("tuning", Ty::Object),
    ("grid", Ty::Str),
    ("blocks", Ty::Int),
    ("ok", Ty::Bool),
    ("rel_err", Ty::FloatOrNull),
    ("median_us", Ty::FloatOrNull),
    ("min_us", Ty::FloatOrNull),
    ("gbps", Ty::FloatOrNull),
    ("pct_copy", Ty::FloatOrNull),
];
/// Every key table, for the test that SCHEMA.md documents each key.
pub const ALL_TABLES: &[&[(&str, Ty)]] = &[
    COMMON,
    BENCH_TOP,
    GEOMEAN,
    RESULT,
    MODEL,
    PEERS_TOP,
    PEER_RESULT,
    COMPARISON,
    SWEEP_TOP,
    SWEEP_CASE,
    SWEEP_CANDIDATE,
    SYNTHETIC,
    SYNTHETIC_LAST_LAYER,
    SYNTHETIC_LAYER,
];

fn check(v: &Value, keys: &[(&str, Ty)], at: &str, errs: &mut Vec<String>) {
    let Some(obj) = v.as_object() else {
        errs.push(format!("{at}: not an object"));
        return;
    };
    for (key, ty) in keys {
        match obj.get(*key) {
            None if matches!(ty, Ty::IntOrAbsent | Ty::FloatOrNullOrAbsent) => {}
            None => errs.push(format!("{at}: missing `{key}`")),
            Some(x) if !ty.matches(x) => {
                errs.push(format!("{at}.{key}: expected {ty:?}, found {x}"))
            }
            _ => {}
        }
    }
}

fn check_each(v: &Value, key: &str, keys: &[(&str, Ty)], at: &str, errs: &mut Vec<String>) {
    for (i, item) in v
        .get(key)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        check(item, keys, &format!("{at}{key}[{i}]"), errs);
    }
}

fn one_of(v: &Value, key: &str, allowed: &[&str], at: &str, errs: &mut Vec<String>) {
    if let Some(x) = v
        .get(key)
        .and_then(Value::as_str)
        .filter(|x| !allowed.contains(x))
    {
        errs.push(format!("{at}.{key}: `{x}` is not one of {allowed:?}"));
    }
}

/// All the ways `v` departs from the documented schema (empty: it conforms).
pub fn validate(v: &Value, doc: Doc) -> Result<(), Vec<String>> {
    let mut errs = Vec::new();
    match doc {
        Doc::Bench | Doc::Model => {
            check(v, COMMON, "$", &mut errs);
            if v.get("schema")
                .and_then(Value::as_u64)
                .is_some_and(|s| s != 1)
            {
                errs.push("$.schema: only schema 1 is known".into());
            }
            if doc == Doc::Bench {
                check(v, BENCH_TOP, "$", &mut errs);
                check_each(v, "geomean_speedup", GEOMEAN, "$.", &mut errs);
                check_each(v, "results", RESULT, "$.", &mut errs);
                for (i, r) in v
                    .get("results")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .enumerate()
                {
                    one_of(
                        r,
                        "kind",
                        &["specialized", "generic"],
                        &format!("$.results[{i}]"),
                        &mut errs,
                    );
                    one_of(
                        r,
                        "origin",
                        &["registry", "rendered"],
                        &format!("$.results[{i}]"),
                        &mut errs,
                    );
                }
                if let Some(Err(e)) = v.get("peers").map(|p| validate(p, Doc::Peers)) {
                    errs.extend(e.into_iter().map(|e| e.replacen('$', "$.peers", 1)));
                }
                if v.get("comparison").is_some() {
                    if !v["comparison"].is_array() {
                        errs.push("$.comparison: expected Array".into());
                    }
                    check_each(v, "comparison", COMPARISON, "$.", &mut errs);
                }
            } else {
                match v.get("models") {
                    Some(Value::Array(_)) => check_each(v, "models", MODEL, "$.", &mut errs),
                    _ => errs.push("$: missing array `models`".into()),
                }
            }
        }
        Doc::Synthetic => {
            check(v, COMMON, "$", &mut errs);
            let syn = &v["synthetic"];
            check(syn, SYNTHETIC, "$.synthetic", &mut errs);
            if syn.get("last_layer").is_some_and(Value::is_object) {
                check(&syn["last_layer"], SYNTHETIC_LAST_LAYER, "$.synthetic.last_layer", &mut errs);
            }
            check_each(syn, "layer_bytes", SYNTHETIC_LAYER, "$.synthetic.", &mut errs);
            for (i, l) in syn.get("layer_bytes").and_then(Value::as_array).into_iter().flatten().enumerate() {
                one_of(l, "ffn", &["dense", "moe"], &format!("$.synthetic.layer_bytes[{i}]"), &mut errs);
            }
        }
        Doc::SyntheticGpus => {
            check(v, COMMON, "$", &mut errs);
            let syn = &v["synthetic_gpus"];
            check(syn, SYNTHETIC_GPUS, "$.synthetic_gpus", &mut errs);
            check_each(syn, "runs", SYNTHETIC_GPU_RUN, "$.synthetic_gpus.", &mut errs);
            for (i, r) in syn.get("runs").and_then(Value::as_array).into_iter().flatten().enumerate() {
                // A measured run has its step time; one not measured says why.
                let measured = r.get("measured") == Some(&Value::Bool(true));
                if measured != r.get("step_median_us").is_some_and(Value::is_number) {
                    errs.push(format!("$.synthetic_gpus.runs[{i}]: `measured` disagrees with step_median_us"));
                }
                if !measured && !r.get("note").is_some_and(Value::is_string) {
                    errs.push(format!("$.synthetic_gpus.runs[{i}]: not measured and no `note`"));
                }
            }
        }
        Doc::Sweep => {
            check(v, SWEEP_TOP, "$", &mut errs);
            check_each(v, "cases", SWEEP_CASE, "$.", &mut errs);
            for (i, c) in v
                .get("cases")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .enumerate()
            {
                check_each(
                    c,
                    "candidates",
                    SWEEP_CANDIDATE,
                    &format!("$.cases[{i}]."),
                    &mut errs,
                );
                for (j, r) in c
                    .get("candidates")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .enumerate()
                {
                    let at = format!("$.cases[{i}].candidates[{j}]");
                    one_of(r, "kind", &["specialized", "generic"], &at, &mut errs);
                    // A candidate that passed the oracle check has its time.
                    if r.get("ok") == Some(&Value::Bool(true))
                        && !r.get("median_us").is_some_and(Value::is_number)
                    {
                        errs.push(format!("{at}: ok but median_us is not a number"));
                    }
                }
            }
        }
        Doc::Peers => {
            check(v, PEERS_TOP, "$", &mut errs);
            check_each(v, "results", PEER_RESULT, "$.", &mut errs);
            for (i, r) in v
                .get("results")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .enumerate()
            {
                let at = format!("$.results[{i}]");
                one_of(
                    r,
                    "impl",
                    &["torch_eager", "torch_compile", "cublas"],
                    &at,
                    &mut errs,
                );
                // A row has a time or says why not.
                if r.get("median_us").is_some_and(Value::is_null)
                    && !r.get("skipped").is_some_and(Value::is_string)
                {
                    errs.push(format!(
                        "{at}: median_us is null without a `skipped` reason"
                    ));
                }
            }
        }
    }
    if errs.is_empty() { Ok(()) } else { Err(errs) }
}

/// Which kind a file is: `models` → Model, `synthetic` → Synthetic, `synthetic_gpus` →
/// SyntheticGpus, `torch` → Peers, a `--sweep` tool → Sweep, else Bench.
pub fn doc_kind(v: &Value) -> Doc {
    if v.get("tool")
        .and_then(Value::as_str)
        .is_some_and(|t| t.starts_with("memra bench --sweep"))
    {
        Doc::Sweep
    } else if v.get("models").is_some() {
        Doc::Model
    } else if v.get("synthetic").is_some() {
        Doc::Synthetic
    } else if v.get("synthetic_gpus").is_some() {
        Doc::SyntheticGpus
    } else if v.get("torch").is_some() {
        Doc::Peers
    } else {
        Doc::Bench
    }
}
