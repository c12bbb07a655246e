//! CPU emulation of the whole matvec and matmul kernels: the templates are compiled as host C++
//! (the same cut as `gemv_host_units.rs`, plus stand-ins for the block-level CUDA features: one
//! std::thread per CUDA thread, std::barrier for __syncthreads/__syncwarp, a per-warp exchange for
//! shuffles, synchronous copies for cp.async, and ldmatrix / mma.sync m16n8k16 from the shared
//! `mma_host` module, bf16 round-to-nearest-even; with `__CUDA_ARCH_FEAT_SM90_ALL` defined, the
//! matmul's sm_90a forms on mma_host's warpgroup MMAs), run block by block, and compared with
//! memra-reference (f32 path ≤ 1e-4, bf16 products ≤ 1e-2) on fresh random quantized weights,
//! NaN-poisoned outputs and padded strides. It checks the pipeline, indexing and reduction logic
//! that the GPU tests check, without a GPU; it says nothing about speed. Skips (one SKIP line)
//! without a C++20 compiler.

mod mma_host;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use memra_engine::kernels::matvec;
use memra_gguf::{GgmlType, quant};
use memra_reference::{Rng, linear, q8, rel_err};

const PRELUDE: &str = r#"
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <thread>
#include <barrier>
#include <vector>
#include <functional>
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __align__(x)
#define __trap() abort()
#define __syncthreads() g_block_barrier->arrive_and_wait()
#define __syncwarp() g_warp_barriers[threadIdx.x / 32]->arrive_and_wait()
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
struct Dim3 { unsigned x, y, z; };
thread_local Dim3 threadIdx, blockIdx, gridDim;
thread_local unsigned char* g_smem;
thread_local unsigned g_smem_bytes;
std::barrier<>* g_block_barrier;
std::vector<std::barrier<>*> g_warp_barriers;
std::vector<float> g_xchg;  // per thread slot
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    uint64_t v = ((uint64_t)y << 32) | x; unsigned r = 0;
    for (int i = 0; i < 4; ++i) { unsigned sel = (s >> (4 * i)) & 0xF, byte = (v >> (8 * (sel & 7))) & 0xFF;
        if (sel & 8) byte = (byte & 0x80) ? 0xFF : 0; r |= byte << (8 * i); }
    return r; }
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned sh) { return (unsigned)((((uint64_t)hi << 32) | lo) >> (sh & 31)); }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c; }
static inline float __shfl_xor_sync(unsigned, float v, int o) {
    int t = threadIdx.x; g_xchg[t] = v; __syncwarp(); float r = g_xchg[(t & ~31) | ((t & 31) ^ o)]; __syncwarp(); return r; }
namespace memra {
inline uint2 make_uint2(unsigned a, unsigned b) { return uint2{a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
typedef unsigned char u8; typedef signed char i8; typedef unsigned short u16; typedef unsigned int u32; typedef unsigned long long u64; typedef long long i64;
enum class QType : int { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30 };
constexpr unsigned FULL_MASK = 0xffffffffu;
template <int CT> inline int dim_or(int rt) { return CT != 0 ? CT : rt; }
inline void pdl_entry() {}  // programmatic dependent launch: nothing to wait for on the host
inline void prefetch_l2(const void*) {}
inline float4 load_f4(const float* p) { float4 r; memcpy(&r, p, 16); return r; }
inline uint4 ldg16(const void* p) { uint4 r; memcpy(&r, p, 16); return r; }
inline float f16_to_f32(u16 h) { unsigned s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023; float v;
  if (e == 0) v = std::ldexp((float)m, -24); else if (e == 31) v = m ? NAN : INFINITY; else v = std::ldexp((float)(m | 1024), (int)e - 25);
  return s ? -v : v; }
inline u16 load_u16(const u8* p) { u16 v; memcpy(&v, p, 2); return v; }
}
"#;

const ASYNC_HOST: &str = r#"namespace async {
inline void cp16(void* smem, const void* gmem, int src_bytes) { memset(smem, 0, 16); memcpy(smem, gmem, src_bytes); }
inline void cp16_tail(void* smem, const void* gmem, long long rest) { cp16(smem, gmem, rest >= 16 ? 16 : (int)rest); }
inline void commit() {}
template <int P> inline void wait() {}
inline u32 dynamic_smem_bytes() { return g_smem_bytes; }
inline const float* after_wait(const float* p) { return p; }
}  // namespace async"#;

const MATVEC_DRIVER: &str = r#"
struct Cfg { static constexpr int K = KDIM; static constexpr int N = NDIM; static constexpr memra::QType QTYPE = memra::QType::QT;
  static constexpr int BATCH = BATCHMAX; static constexpr int THREADS = THR; static constexpr int LANES = LN;
  static constexpr int ROWS_PER_GROUP = RPGV; static constexpr int STAGES = STG; static constexpr int ACCUMULATE = ACC;
  static constexpr int XQ8 = XQ8V; };
int main(int argc, char** argv) {
    // args: k n batch ldx ldy max_blocks wfile xfile yfile(in/out)
    int k = atoi(argv[1]), n = atoi(argv[2]), batch = atoi(argv[3]), ldx = atoi(argv[4]), ldy = atoi(argv[5]);
    int max_blocks = atoi(argv[6]); argv += 1;
    auto rd = [](const char* f, std::vector<unsigned char>& v) { FILE* fp = fopen(f, "rb"); fseek(fp, 0, SEEK_END); long n = ftell(fp); fseek(fp, 0, SEEK_SET); v.resize(n + 64); fread(v.data(), 1, n, fp); fclose(fp); return n; };
    std::vector<unsigned char> w, x, y; rd(argv[6], w); rd(argv[7], x); long ny = rd(argv[8], y);
    // 16-byte aligned copies
    unsigned char* wa = (unsigned char*)aligned_alloc(256, (w.size() + 255) / 256 * 256); memcpy(wa, w.data(), w.size());
    float* xa = (float*)aligned_alloc(256, (x.size() + 255) / 256 * 256); memcpy(xa, x.data(), x.size());
    float* ya = (float*)y.data();
    using G = memra::MatvecGeometry<Cfg>;
    // Balanced grid of at most max_blocks blocks (memra_engine::kernels::matvec::balanced_blocks);
    // blocks run one after another (they share nothing), each striding over the tiles.
    int tiles = (n + G::ROWS - 1) / G::ROWS; if (tiles < 1) tiles = 1;
    int waves = (tiles + max_blocks - 1) / max_blocks, grid = (tiles + waves - 1) / waves;
    for (int bx = 0; bx < grid; ++bx) {
        // XQ8 = 2: the block's whole q8 x after the stages.
        const unsigned smem_bytes = memra::MatvecLaunch<Cfg>::LAUNCH_SMEM + (G::XQ8_FUSED ? Cfg::BATCH * G::xf_row(k) : 0);
        std::vector<unsigned char> smem(smem_bytes + 64, 0xCD);
        std::barrier<> block_bar(Cfg::THREADS);
        g_block_barrier = &block_bar;
        std::vector<std::barrier<>*> wb; for (int i = 0; i < Cfg::THREADS / 32; ++i) wb.push_back(new std::barrier<>(32));
        g_warp_barriers = wb; g_xchg.assign(Cfg::THREADS, 0.f);
        std::vector<std::thread> ts;
        for (int t = 0; t < Cfg::THREADS; ++t) ts.emplace_back([&, t] {
            threadIdx = {(unsigned)t, 0, 0}; blockIdx = {(unsigned)bx, 0, 0}; gridDim = {(unsigned)grid, 1, 1};
            g_smem = smem.data(); g_smem_bytes = smem_bytes;
            memra::matvec_impl<Cfg>(wa, xa, ya, k, n, batch, ldx, ldy); });
        for (auto& th : ts) th.join();
        for (auto* b : wb) delete b;
    }
    FILE* fo = fopen(argv[8], "wb"); fwrite(ya, 1, ny, fo); fclose(fo);
    return 0; }
"#;

const MATMUL_DRIVER: &str = r#"
struct Cfg { static constexpr int K = KDIM; static constexpr int N = NDIM; static constexpr memra::QType QTYPE = memra::QType::QT;
  static constexpr int BM = BMV; static constexpr int BN = BNV; static constexpr int THREADS = 256; static constexpr int ACCUMULATE = ACC; };
int main(int argc, char** argv) {
    int t = atoi(argv[1]), k = atoi(argv[2]), n = atoi(argv[3]), ldx = atoi(argv[4]), ldy = atoi(argv[5]);
    auto rd = [](const char* f, std::vector<unsigned char>& v) { FILE* fp = fopen(f, "rb"); fseek(fp, 0, SEEK_END); long n = ftell(fp); fseek(fp, 0, SEEK_SET); v.resize(n + 64); fread(v.data(), 1, n, fp); fclose(fp); return n; };
    std::vector<unsigned char> w, x, y; rd(argv[6], w); rd(argv[7], x); long ny = rd(argv[8], y);
    unsigned char* wa = (unsigned char*)aligned_alloc(256, (w.size() + 255) / 256 * 256); memcpy(wa, w.data(), w.size());
    float* xa = (float*)aligned_alloc(256, (x.size() + 255) / 256 * 256); memcpy(xa, x.data(), x.size());
    float* ya = (float*)y.data();
    // Optional: argv[9] the offsets of a grouped launch (int32, experts + 1), argv[10] expert_bytes;
    // t is then the largest group (grid.y) and grid.z the experts. With argv[11] x_batch and
    // argv[12] y_batch (> 0): a strided batch of as many matrices as offsets has groups.
    std::vector<unsigned char> off_raw; long long eb = 0, xb = 0, yb = 0; int groups = 1;
    if (argc > 10) { long no = rd(argv[9], off_raw); groups = (int)(no / 4) - 1; eb = atoll(argv[10]); }
    if (argc > 12) { xb = atoll(argv[11]); yb = atoll(argv[12]); }
    const int* offs = argc > 10 ? (const int*)off_raw.data() : nullptr;
    using G = memra::MatmulGeometry<Cfg>;
    for (int bz = 0; bz < groups; ++bz)
    for (int by = 0; by < (t + G::BM - 1) / G::BM; ++by)
    for (int bx = 0; bx < (n + G::BN - 1) / G::BN; ++bx) {
        std::vector<unsigned char> smem(G::SMEM + 64, 0xCD);
        std::barrier<> block_bar(Cfg::THREADS); g_block_barrier = &block_bar;
        std::vector<std::barrier<>*> wb; for (int i = 0; i < Cfg::THREADS / 32; ++i) wb.push_back(new std::barrier<>(32));
        g_warp_barriers = wb; g_xchg.assign(Cfg::THREADS, 0.f);
        std::vector<std::thread> ts;
        for (int th = 0; th < Cfg::THREADS; ++th) ts.emplace_back([&, th] {
            threadIdx = {(unsigned)th, 0, 0}; blockIdx = {(unsigned)bx, (unsigned)by, (unsigned)bz}; g_smem = smem.data(); g_smem_bytes = G::SMEM;
            memra::matmul_entry<Cfg>(wa, xa, ya, t, k, n, ldx, ldy, offs, eb, xb, yb); });
        for (auto& x : ts) x.join();
        for (auto* b : wb) delete b;
    }
    FILE* fo = fopen(argv[8], "wb"); fwrite(ya, 1, ny, fo); fclose(fo);
    return 0; }
"#;

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("engine/ has a parent")
        .to_path_buf()
}

/// `text` from `from` up to (not including) `to`.
fn cut<'a>(text: &'a str, from: &str, to: &str, file: &str) -> &'a str {
    let a = text
        .find(from)
        .unwrap_or_else(|| panic!("{file}: no `{from}`"));
    let b = text.find(to).unwrap_or_else(|| panic!("{file}: no `{to}`"));
    &text[a..b]
}

/// Replaces the block `namespace NAME { … }  // namespace NAME` with `host`.
fn replace_namespace(text: &str, name: &str, host: &str, file: &str) -> String {
    let open = format!("namespace {name} {{");
    let close = format!("}}  // namespace {name}");
    let a = text
        .find(&open)
        .unwrap_or_else(|| panic!("{file}: no `{open}`"));
    let b = text
        .find(&close)
        .unwrap_or_else(|| panic!("{file}: no `{close}`"))
        + close.len();
    format!("{}{host}{}", &text[..a], &text[b..])
}

fn template(name: &str) -> String {
    let path = workspace_root().join("templates/memra").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn emulator_source(matmul: bool) -> String {
    let mv = template("matvec.cuh");
    let mv_body = cut(
        &mv,
        "namespace memra {",
        "#define MEMRA_DEFINE_MATVEC",
        "matvec.cuh",
    );
    let mv_body = replace_namespace(mv_body, "async", ASYNC_HOST, "matvec.cuh").replace(
        "extern __shared__ __align__(16) u8 matvec_smem[];",
        "u8* matvec_smem = g_smem;",
    );
    let mut src = format!("{PRELUDE}{mv_body}");
    if matmul {
        let mm = template("matmul.cuh");
        let mm_body = cut(
            &mm,
            "namespace memra {",
            "#define MEMRA_DEFINE_MATMUL",
            "matmul.cuh",
        );
        let mm_body = mma_host::with_host_ptx_wg(mm_body).replace(
            "extern __shared__ __align__(16) u8 matmul_smem[];",
            "u8* matmul_smem = g_smem;",
        );
        src.push_str(&mm_body);
        src.push_str(MATMUL_DRIVER);
    } else {
        src.push_str(MATVEC_DRIVER);
    }
    src
}

fn compiler() -> Option<String> {
    let candidates = [
        std::env::var("CXX").ok(),
        Some("c++".into()),
        Some("g++".into()),
        Some("clang++".into()),
    ];
    candidates.into_iter().flatten().find(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// Compiles emulators per Cfg (cached by its -D flags).
struct Builder {
    cxx: String,
    dir: PathBuf,
    source: PathBuf,
    built: HashMap<Vec<String>, PathBuf>,
}

impl Builder {
    fn new(test: &str, matmul: bool) -> Option<Builder> {
        let Some(cxx) = compiler() else {
            eprintln!("SKIP {test}: no C++ compiler (set CXX)");
            return None;
        };
        // One directory per test: tests run in parallel threads of one process, and each
        // writes its own emulator binaries and input files.
        let dir = std::env::temp_dir().join(format!(
            "memra-gemv-emu-{}-{}-{test}",
            std::process::id(),
            matmul as u8
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let source = dir.join("emu.cpp");
        std::fs::write(&source, emulator_source(matmul)).expect("write emulator source");
        Some(Builder {
            cxx,
            dir,
            source,
            built: HashMap::new(),
        })
    }

    fn get(&mut self, defines: Vec<String>) -> PathBuf {
        if let Some(p) = self.built.get(&defines) {
            return p.clone();
        }
        let bin = self.dir.join(format!("emu{}", self.built.len()));
        let out = Command::new(&self.cxx)
            .args(["-std=c++20", "-O1", "-pthread", "-o"])
            .arg(&bin)
            .args(defines.iter().map(|d| format!("-D{d}")))
            .arg(&self.source)
            .output()
            .expect("run the C++ compiler");
        assert!(
            out.status.success(),
            "{} {defines:?} failed:\n{}",
            self.cxx,
            String::from_utf8_lossy(&out.stderr)
        );
        self.built.insert(defines, bin.clone());
        bin
    }
}

impl Drop for Builder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

/// Runs an emulator on (w, x, y0) and returns y.
fn run(bin: &Path, dims: &[usize], w: &[u8], x: &[f32], y0: &[f32]) -> Vec<f32> {
    run_with(bin, dims, w, x, y0, None)
}

/// [`run`], for matmul optionally as a stacked launch: (offsets, expert_bytes, [x_batch,
/// y_batch]); batch strides of 0 group rows by the offsets, else the offsets only count the
/// matrices of a strided batch.
fn run_with(
    bin: &Path,
    dims: &[usize],
    w: &[u8],
    x: &[f32],
    y0: &[f32],
    grouped: Option<(&[i32], usize, [usize; 2])>,
) -> Vec<f32> {
    let dir = bin.parent().unwrap();
    let (wf, xf, yf, of) = (
        dir.join("w.bin"),
        dir.join("x.bin"),
        dir.join("y.bin"),
        dir.join("offsets.bin"),
    );
    std::fs::write(&wf, w).unwrap();
    std::fs::write(&xf, f32_bytes(x)).unwrap();
    std::fs::write(&yf, f32_bytes(y0)).unwrap();
    let mut cmd = Command::new(bin);
    cmd.args(dims.iter().map(|d| d.to_string()))
        .arg(&wf)
        .arg(&xf)
        .arg(&yf);
    if let Some((offsets, expert_bytes, batch)) = grouped {
        std::fs::write(
            &of,
            offsets
                .iter()
                .flat_map(|o| o.to_le_bytes())
                .collect::<Vec<u8>>(),
        )
        .unwrap();
        cmd.arg(&of).arg(expert_bytes.to_string());
        cmd.args(batch.iter().map(|b| b.to_string()));
    }
    let out = cmd.output().expect("run emulator");
    assert!(
        out.status.success(),
        "emulator {} failed: {:?}\n{}",
        bin.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(&yf)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

const QTYPES: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
];

fn awkward_k(ty: GgmlType) -> usize {
    match matvec::k_multiple(ty).unwrap() {
        256 => 9 * 256,
        32 => 9 * 32,
        m => 37 * m,
    }
}

/// rows × ld buffer: y (random if accumulate, NaN otherwise), the packed oracle added on top.
#[allow(clippy::too_many_arguments)]
fn compare(
    what: &str,
    got: &[f32],
    y0: &[f32],
    want_packed: &[f32],
    rows: usize,
    n: usize,
    ld: usize,
    accumulate: bool,
    tol: f64,
    rng: &Rng,
) {
    let mut g = Vec::new();
    let mut w = Vec::new();
    for r in 0..rows {
        for j in 0..n {
            g.push(got[r * ld + j]);
            w.push(if accumulate { y0[r * ld + j] } else { 0.0 } + want_packed[r * n + j]);
        }
        if r + 1 < rows {
            for j in n..ld {
                assert_eq!(
                    got[r * ld + j].to_bits(),
                    y0[r * ld + j].to_bits(),
                    "{what}: padding [{r}][{j}] written (MEMRA_SEED={})",
                    rng.seed()
                );
            }
        }
    }
    let err = rel_err(&g, &w);
    assert!(
        err <= tol,
        "{what}: relative L2 error {err:e} > {tol:e} (MEMRA_SEED={})",
        rng.seed()
    );
}

#[test]
fn matvec_kernel_emulated_on_host_threads_matches_reference() {
    matvec_emulated(
        "matvec_kernel_emulated_on_host_threads_matches_reference",
        0,
    );
}

/// The integer path (XQ8 = 1): x as q8 rows (memra_reference::q8's bytes, the layout
/// quantize_q8.cuh writes), compared with `q8::matmul_gguf_q8`, which quantizes x the same way
/// and sums the same per-block integer products in f64. The two differ only in the f32 rounding
/// of the per-block scale products and the order of the f32 accumulation (per lane, then the
/// shuffle tree), the same error sources as the f32 path: the same 1e-4.
#[test]
fn matvec_q8_kernel_emulated_on_host_threads_matches_reference() {
    matvec_emulated(
        "matvec_q8_kernel_emulated_on_host_threads_matches_reference",
        1,
    );
}

/// XQ8 = 2: f32 x, quantized by each block into shared memory (the same numerics), against
/// the same q8 oracle and tolerance. The types with the most distinct unit shapes (64-element
/// Q4_K units, 2-byte-aligned Q8_0 / Q6_K blocks, Q6_K's two scale groups).
#[test]
fn matvec_q8_fused_kernel_emulated_on_host_threads_matches_reference() {
    matvec_emulated(
        "matvec_q8_fused_kernel_emulated_on_host_threads_matches_reference",
        2,
    );
}

/// Every type (xq8: every integer-path type) at awkward and batched cases, specialized and
/// Every type (XQ8 = 1: every integer-path type; 2: Q4_K, Q8_0, Q6_K) at awkward and batched
/// cases, specialized and generic, against the f32 or the q8 oracle. `xq8_cfg`: the Cfg's XQ8.
fn matvec_emulated(test: &str, xq8_cfg: u8) {
    let xq8 = xq8_cfg == 1; // x passed as q8 rows
    let q8_oracle = xq8_cfg != 0;
    let Some(mut b) = Builder::new(test, false) else {
        return;
    };
    let mut rng = Rng::from_env_or_time(test);
    for ty in QTYPES.into_iter().filter(|&t| match xq8_cfg {
        0 => true,
        1 => q8::has_int_dot(t),
        _ => matches!(t, GgmlType::Q4_K | GgmlType::Q8_0 | GgmlType::Q6_K),
    }) {
        let k_aw = awkward_k(ty);
        // (k, n, batch, BATCH, LANES, ROWS_PER_GROUP, ACCUMULATE, ldx pad, ldy pad); the ldx
        // pad (floats) goes after the f32 row or the q8 row.
        let mut cases = vec![
            (k_aw, 33, 1, 1, 32, 2, 0, 0, 0),
            (2048, 17, 3, 8, 8, 1, 0, 12, 5),
            (k_aw, 9, 2, 2, 16, 2, 1, 0, 0),
            // 5 tiles of 16 rows: with 2 blocks, block 0 walks tiles 0, 2, 4 (pipeline across tiles).
            (k_aw, 70, 2, 2, 16, 1, 1, 4, 3),
        ];
        if xq8_cfg == 1 && matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_K) {
            // The integer path's direct form (LANES = 32, q8 rows): batched with padded strides,
            // tiles walked by 2 blocks, the tensor's last block through the over-read guard.
            cases.push((2048, 21, 3, 4, 32, 1, 0, 12, 5));
            cases.push((k_aw, 70, 2, 2, 32, 2, 1, 4, 3));
        }
        if matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            // The direct path (LANES = 32, f32 x): 185 units a row = one whole step of 4 units a
            // lane and a ragged rest; batched with padded strides; tiles walked by 2 blocks.
            cases.push((1480, 21, 3, 4, 32, 1, 0, 12, 5));
            cases.push((1480, 70, 2, 2, 32, 2, 1, 4, 3));
        }
        for (k, n, batch, bmax, lanes, rpg, acc, px, py) in cases {
            let w = quant::quantize(ty, &rng.normal_vec(k * n, 1.0)).unwrap();
            let ldy = n + py;
            let (x, ldx, want) = if xq8 {
                let ldx = q8::q8_row_bytes(k) / 4 + px;
                let xf = rng.normal_vec(batch * k, 1.0);
                // q8 rows at a stride of ldx floats; the padding between rows is garbage.
                let mut xq = vec![0xA5u8; ((batch - 1) * ldx) * 4 + q8::q8_row_bytes(k)];
                for i in 0..batch {
                    let row = q8::quantize_q8_blocks(&xf[i * k..][..k]).to_gpu_bytes();
                    xq[i * ldx * 4..][..row.len()].copy_from_slice(&row);
                }
                let x: Vec<f32> = xq
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                (
                    x,
                    ldx,
                    q8::matmul_gguf_q8(ty, &w, k, n, &xf, batch).unwrap(),
                )
            } else {
                let ldx = k + px;
                let x = rng.normal_vec((batch - 1) * ldx + k, 1.0);
                let packed: Vec<f32> = (0..batch)
                    .flat_map(|i| x[i * ldx..i * ldx + k].to_vec())
                    .collect();
                let want = if q8_oracle {
                    q8::matmul_gguf_q8(ty, &w, k, n, &packed, batch).unwrap()
                } else {
                    linear::matmul_gguf(ty, &w, k, n, &packed, batch).unwrap()
                };
                (x, ldx, want)
            };
            let y_len = (batch - 1) * ldy + n;
            let y0 = if acc == 1 {
                rng.normal_vec(y_len, 1.0)
            } else {
                vec![f32::NAN; y_len]
            };
            for spec in [true, false] {
                let (kd, nd) = if spec { (k, n) } else { (0, 0) };
                let bin = b.get(vec![
                    format!("KDIM={kd}"),
                    format!("NDIM={nd}"),
                    format!("QT={}", ty.name()),
                    format!("BATCHMAX={bmax}"),
                    "THR=256".into(),
                    format!("LN={lanes}"),
                    format!("RPGV={rpg}"),
                    "STG=3".into(),
                    format!("ACC={acc}"),
                    format!("XQ8V={xq8_cfg}"),
                ]);
                // Specialized: at most 2 blocks, so blocks walk several tiles (the resident-grid
                // path); generic: one block per tile.
                let max_blocks = if spec { 2 } else { usize::MAX >> 34 };
                let got = run(&bin, &[k, n, batch, ldx, ldy, max_blocks], &w, &x, &y0);
                let what = format!(
                    "matvec{} {ty:?} k={k} n={n} batch={batch}/{bmax} lanes={lanes} spec={spec} acc={acc} max_blocks={max_blocks}",
                    ["", " xq8", " xq8 fused"][xq8_cfg as usize]
                );
                compare(&what, &got, &y0, &want, batch, n, ldy, acc == 1, 1e-4, &rng);
            }
        }
    }
}

#[test]
fn matmul_kernel_emulated_on_host_threads_matches_reference() {
    matmul_cases("matmul_kernel_emulated_on_host_threads_matches_reference", false);
}

/// The sm_90a forms (warpgroup MMAs: register-A where matmul.cuh picks it, shared-memory
/// operands otherwise), with `namespace wg` emulated (mma_host::WG_FNS): the cases above plus
/// K = 2304, where 8- and 32-element units switch to the shared-memory form.
#[test]
fn matmul_sm90a_forms_emulated_on_host_threads_match_reference() {
    matmul_cases("matmul_sm90a_forms_emulated_on_host_threads_match_reference", true);
}

fn matmul_cases(test: &str, sm90a: bool) {
    let Some(mut b) = Builder::new(test, true) else {
        return;
    };
    let mut rng = Rng::from_env_or_time(test);
    for ty in QTYPES {
        let k_aw = awkward_k(ty);
        // (t, k, n, BM, BN, ACCUMULATE, ldx pad, ldy pad)
        // K = 512 and 2304: baked rows of whole 16-byte chunks for 32-element blocks (matmul's
        // aligned raw reads, every word phase), at 2 and 1 threads a row; 2304 > 2048 also puts
        // sm_90a on the shared-memory form.
        let cases = [
            (17, k_aw, 33, 64, 256, 0, 4, 3),
            (130, 512, 130, 128, 128, 1, 0, 0),
            (9, 2304, 40, 128, 256, 0, 4, 0),
        ];
        for (t, k, n, bm, bn, acc, px, py) in cases {
            let (ldx, ldy) = (k + px, n + py);
            let w = quant::quantize(ty, &rng.normal_vec(k * n, 1.0)).unwrap();
            let x = rng.normal_vec((t - 1) * ldx + k, 1.0);
            let packed: Vec<f32> = (0..t)
                .flat_map(|i| x[i * ldx..i * ldx + k].to_vec())
                .collect();
            let want = linear::matmul_gguf(ty, &w, k, n, &packed, t).unwrap();
            let y_len = (t - 1) * ldy + n;
            let y0 = if acc == 1 {
                rng.normal_vec(y_len, 1.0)
            } else {
                vec![f32::NAN; y_len]
            };
            for spec in [true, false] {
                let (kd, nd) = if spec { (k, n) } else { (0, 0) };
                let mut defines = vec![
                    format!("KDIM={kd}"),
                    format!("NDIM={nd}"),
                    format!("QT={}", ty.name()),
                    format!("BMV={bm}"),
                    format!("BNV={bn}"),
                    format!("ACC={acc}"),
                ];
                if sm90a {
                    defines.push("__CUDA_ARCH_FEAT_SM90_ALL".into());
                }
                let bin = b.get(defines);
                let got = run(&bin, &[t, k, n, ldx, ldy], &w, &x, &y0);
                let what = format!("matmul {ty:?} t={t} k={k} n={n} bm={bm} bn={bn} spec={spec} acc={acc} sm90a={sm90a}");
                compare(&what, &got, &y0, &want, t, n, ldy, acc == 1, 1e-2, &rng);
            }
        }
    }
}

/// A grouped launch (MoE prefill grouped by expert): grid.z over a stack of experts, expert z's
/// rows offsets[z]..offsets[z+1] of x and y against its own weights, an empty expert and groups
/// that are not multiples of BM among them; every row compared with that expert's product.
#[test]
fn matmul_grouped_launch_emulated_on_host_threads_matches_reference() {
    let test = "matmul_grouped_launch_emulated_on_host_threads_matches_reference";
    let Some(mut b) = Builder::new(test, true) else {
        return;
    };
    let mut rng = Rng::from_env_or_time(test);
    for (ty, k, n) in [(GgmlType::Q4_K, 256, 33), (GgmlType::Q8_0, 96, 136)] {
        let rows = [5usize, 0, 70, 1];
        let mut offsets = vec![0i32];
        for r in rows {
            offsets.push(offsets.last().unwrap() + r as i32);
        }
        let total = *offsets.last().unwrap() as usize;
        let (ldx, ldy) = (k + 4, n + 3);
        let experts: Vec<Vec<u8>> = rows
            .iter()
            .map(|_| quant::quantize(ty, &rng.normal_vec(k * n, 1.0)).unwrap())
            .collect();
        let expert_bytes = experts[0].len();
        assert_eq!(
            expert_bytes % 16,
            0,
            "{ty:?} k={k} n={n}: expert bytes must be 16-byte multiples"
        );
        let w: Vec<u8> = experts.concat();
        let x = rng.normal_vec((total - 1) * ldx + k, 1.0);
        let mut want = Vec::with_capacity(total * n);
        for (z, ew) in experts.iter().enumerate() {
            let (r0, r1) = (offsets[z] as usize, offsets[z + 1] as usize);
            if r0 == r1 {
                continue;
            }
            let packed: Vec<f32> = (r0..r1)
                .flat_map(|i| x[i * ldx..i * ldx + k].to_vec())
                .collect();
            want.extend(linear::matmul_gguf(ty, ew, k, n, &packed, r1 - r0).unwrap());
        }
        let y0 = vec![f32::NAN; (total - 1) * ldy + n];
        let bin = b.get(vec![
            format!("KDIM={k}"),
            format!("NDIM={n}"),
            format!("QT={}", ty.name()),
            "BMV=64".into(),
            "BNV=256".into(),
            "ACC=0".into(),
        ]);
        let max_rows = *rows.iter().max().unwrap();
        let got = run_with(
            &bin,
            &[max_rows, k, n, ldx, ldy],
            &w,
            &x,
            &y0,
            Some((&offsets, expert_bytes, [0, 0])),
        );
        compare(
            &format!("grouped matmul {ty:?} k={k} n={n} rows {rows:?}"),
            &got,
            &y0,
            &want,
            total,
            n,
            ldy,
            false,
            1e-2,
            &rng,
        );
    }
}

/// The strided batch of MLA's per-head absorption: head z reads t rows of x at x + z·x_batch
/// (row stride n_head·row) and writes y + z·y_batch (row stride n_head·out), its own weights at
/// w + z·expert_bytes; the rows of the heads interleave, as q_nope / q_abs do per token.
#[test]
fn matmul_strided_batch_emulated_on_host_threads_matches_reference() {
    let test = "matmul_strided_batch_emulated_on_host_threads_matches_reference";
    let Some(mut b) = Builder::new(test, true) else {
        return;
    };
    let mut rng = Rng::from_env_or_time(test);
    // (type, k, n, heads, t, x row per head (≥ k), y row per head (≥ n)): GLM-5's k_b shape
    // cut down (nope 192 of a 256-float q row into 576-float absorbed rows), a v_b-like one.
    for (ty, k, n, heads, t, xr, yr) in [(GgmlType::Q8_0, 192, 40, 3, 70, 256, 48), (GgmlType::Q4_K, 256, 33, 2, 5, 256, 33)] {
        let (ldx, ldy) = (heads * xr, heads * yr);
        let experts: Vec<Vec<u8>> = (0..heads).map(|_| quant::quantize(ty, &rng.normal_vec(k * n, 1.0)).unwrap()).collect();
        let expert_bytes = experts[0].len();
        assert_eq!(expert_bytes % 16, 0, "{ty:?} k={k} n={n}");
        let x = rng.normal_vec(t * ldx, 1.0);
        let y0 = vec![f32::NAN; t * ldy];
        let mut want = y0.clone();
        for (z, ew) in experts.iter().enumerate() {
            let packed: Vec<f32> = (0..t).flat_map(|i| x[i * ldx + z * xr..][..k].to_vec()).collect();
            let yz = linear::matmul_gguf(ty, ew, k, n, &packed, t).unwrap();
            for i in 0..t {
                want[i * ldy + z * yr..][..n].copy_from_slice(&yz[i * n..][..n]);
            }
        }
        let bin = b.get(vec![format!("KDIM={k}"), format!("NDIM={n}"), format!("QT={}", ty.name()), "BMV=64".into(), "BNV=128".into(), "ACC=0".into()]);
        let counts = vec![0i32; heads + 1];
        let got = run_with(&bin, &[t, k, n, ldx, ldy], &experts.concat(), &x, &y0, Some((&counts, expert_bytes, [xr, yr])));
        let what = format!("strided batch matmul {ty:?} k={k} n={n} heads={heads} t={t} (MEMRA_SEED={})", rng.seed());
        let written = |i: usize| (i % ldy) % yr < n;
        for (i, g) in got.iter().enumerate() {
            if !written(i) {
                assert!(g.is_nan(), "{what}: y[{i}] between heads' columns written");
            }
        }
        let (g, w): (Vec<f32>, Vec<f32>) = got.iter().zip(&want).enumerate().filter(|(i, _)| written(*i)).map(|(_, (g, w))| (*g, *w)).unzip();
        let err = rel_err(&g, &w);
        assert!(err <= 1e-2, "{what}: relative L2 error {err:e}");
    }
}
