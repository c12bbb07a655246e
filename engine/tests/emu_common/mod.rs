//! Host C++ emulation of the matvec-core kernels (matvec.cuh and the families built on its
//! streaming core): the template text compiled as host C++ with stand-ins for the CUDA features
//! it uses — one std::thread per CUDA thread, std::barrier for __syncthreads / __syncwarp, a
//! per-warp exchange for shuffles, synchronous copies for cp.async — plus the helpers to cut
//! template text, find a C++20 compiler, build one emulator per set of -D flags and pass
//! buffers through files; common.cuh's grid-scope primitives on the host (`grid_scope`) and the
//! random caches the attention emulations feed. Shared by every `*_host_emulation.rs` test.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Host stand-ins for the CUDA built-ins and the `memra` basics of common.cuh / quant.cuh that
/// matvec.cuh uses (the emulators cut matvec.cuh's body, not common.cuh).
pub const PRELUDE: &str = r#"
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
std::vector<uint64_t> g_xchg;  // per thread slot
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
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
#define __expf(x) ::expf(x)
template <class T> static inline T __ldg(const T* p) { return *p; }
// Any 4- or 8-byte value through the per-thread exchange slots.
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int o) {
    static_assert(sizeof(T) <= 8, "exchange slots are 8 bytes");
    int t = threadIdx.x; uint64_t s = 0; memcpy(&s, &v, sizeof(T)); g_xchg[t] = s; __syncwarp();
    uint64_t r = g_xchg[(t & ~31) | ((t & 31) ^ o)]; __syncwarp(); T out; memcpy(&out, &r, sizeof(T)); return out; }
namespace memra {
inline uint2 make_uint2(unsigned a, unsigned b) { return uint2{a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
typedef unsigned char u8; typedef signed char i8; typedef unsigned short u16; typedef unsigned int u32; typedef unsigned long long u64; typedef long long i64;
enum class QType : int { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30 };
enum class MoeMode : int { Plain = 0, Swiglu = 1, Down = 2, Geglu = 3 };
enum class Gating : int { Softmax = 1, Sigmoid = 2 };
constexpr unsigned FULL_MASK = 0xffffffffu;
constexpr int WARP_SIZE = 32;
template <int CT> inline int dim_or(int rt) { return CT != 0 ? CT : rt; }
inline void pdl_entry() {}  // programmatic dependent launch: nothing to wait for on the host
inline void prefetch_l2(const void*) {}
using std::min; using std::max;
inline float4 load_f4(const float* p) { float4 r; memcpy(&r, p, 16); return r; }
inline uint4 ldg16(const void* p) { uint4 r; memcpy(&r, p, 16); return r; }
inline float f16_to_f32(u16 h) { unsigned s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023; float v;
  if (e == 0) v = std::ldexp((float)m, -24); else if (e == 31) v = m ? NAN : INFINITY; else v = std::ldexp((float)(m | 1024), (int)e - 25);
  return s ? -v : v; }
inline u16 load_u16(const u8* p) { u16 v; memcpy(&v, p, 2); return v; }
}
"#;

/// `namespace async` of matvec.cuh on the host: synchronous copies.
pub const ASYNC_HOST: &str = r#"namespace async {
inline void cp16(void* smem, const void* gmem, int src_bytes) { memset(smem, 0, 16); memcpy(smem, gmem, src_bytes); }
inline void cp16_tail(void* smem, const void* gmem, long long rest) { cp16(smem, gmem, rest >= 16 ? 16 : (int)rest); }
inline void commit() {}
template <int P> inline void wait() {}
inline u32 dynamic_smem_bytes() { return g_smem_bytes; }
inline const float* after_wait(const float* p) { return p; }
}  // namespace async"#;

/// Host stand-ins norm_matvec.cuh's prologue needs beyond the prelude: a block-wide sum through a
/// shared array (one block runs at a time) and rsqrtf.
pub const NORM_HOST: &str = r#"
namespace memra {
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
template <int THREADS> inline float block_sum(float v) {
    static float partial[1024];
    __syncthreads();
    partial[threadIdx.x] = v;
    __syncthreads();
    float s = 0.0f;
    for (int i = 0; i < THREADS; ++i) s += partial[i];
    return s;
}
}
"#;

/// `run_grid`: `body` as a grid of `grid` blocks of `threads` threads, blocks one after another,
/// with `smem` bytes of (0xCD-filled) dynamic shared memory per block; and file helpers.
pub const GRID_RUNNER: &str = r#"
static void run_grid(Dim3 grid, int threads, unsigned smem, const std::function<void()>& body) {
    // grid.z 0 (left out of a {x, y} initializer) counts as 1.
    for (unsigned bz = 0; bz < (grid.z ? grid.z : 1u); ++bz) for (unsigned by = 0; by < grid.y; ++by) for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::vector<unsigned char> sm(smem + 64, 0xCD);
        std::barrier<> block_bar(threads); g_block_barrier = &block_bar;
        std::vector<std::barrier<>*> wb; for (int i = 0; i < threads / 32; ++i) wb.push_back(new std::barrier<>(32));
        g_warp_barriers = wb; g_xchg.assign(threads, 0);
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] {
            threadIdx = {(unsigned)t, 0, 0}; blockIdx = {bx, by, bz}; gridDim = grid;
            g_smem = sm.data(); g_smem_bytes = smem; body(); });
        for (auto& th : ts) th.join();
        for (auto* b : wb) delete b;
    }
}
static std::vector<unsigned char> slurp(const char* f) {
    FILE* fp = fopen(f, "rb"); if (!fp) { perror(f); exit(2); }
    fseek(fp, 0, SEEK_END); long n = ftell(fp); fseek(fp, 0, SEEK_SET);
    std::vector<unsigned char> v(n); if (n > 0 && fread(v.data(), 1, n, fp) != (size_t)n) exit(2); fclose(fp); return v; }
// 256-byte aligned copy with zeroed slack (the copy engine may clamp reads near a tensor's end).
template <class T> static T* aligned_copy(const std::vector<unsigned char>& v) {
    void* p = aligned_alloc(256, (v.size() + 511) / 256 * 256); memset(p, 0, (v.size() + 511) / 256 * 256); memcpy(p, v.data(), v.size()); return (T*)p; }
static void spit(const char* f, const void* p, size_t n) { FILE* fo = fopen(f, "wb"); fwrite(p, 1, n, fo); fclose(fo); }
"#;

pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("engine/ has a parent")
        .to_path_buf()
}

/// `text` with `[from, to)` replaced by `with`, `to` being the first one after `from`; panics
/// naming the marker that is absent.
pub fn splice(text: &str, from: &str, to: &str, with: &str, file: &str) -> String {
    let a = text
        .find(from)
        .unwrap_or_else(|| panic!("{file}: no `{from}`"));
    let b = a + text[a..]
        .find(to)
        .unwrap_or_else(|| panic!("{file}: no `{to}` after `{from}`"));
    format!("{}{with}{}", &text[..a], &text[b..])
}

/// `text` from `from` up to (not including) `to`.
pub fn cut<'a>(text: &'a str, from: &str, to: &str, file: &str) -> &'a str {
    let a = text
        .find(from)
        .unwrap_or_else(|| panic!("{file}: no `{from}`"));
    let b = text.find(to).unwrap_or_else(|| panic!("{file}: no `{to}`"));
    &text[a..b]
}

/// Replaces the block `namespace NAME { … }  // namespace NAME` with `host`.
pub fn replace_namespace(text: &str, name: &str, host: &str, file: &str) -> String {
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

pub fn template(name: &str) -> String {
    let path = workspace_root().join("templates/memra").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// matvec.cuh's `namespace memra` body on the host (units, geometry, streaming core).
pub fn matvec_host_body() -> String {
    let mv = template("matvec.cuh");
    let body = cut(
        &mv,
        "namespace memra {",
        "#define MEMRA_DEFINE_MATVEC",
        "matvec.cuh",
    );
    replace_namespace(body, "async", ASYNC_HOST, "matvec.cuh").replace(
        "extern __shared__ __align__(16) u8 matvec_smem[];",
        "u8* matvec_smem = g_smem;",
    )
}

/// common.cuh's `namespace grid` on the host: its primitives as atomics on memory that every
/// block's thread (or process: a `MAP_SHARED` mapping) sees; a spinning load yields, since the
/// blocks of a grid share the machine's few cores. The barrier is the template's own text.
pub fn grid_scope() -> String {
    const PRIMITIVES: &str = r#"
inline u32 load_volatile(const u32* p) { std::this_thread::yield(); return std::atomic_ref<u32>(*const_cast<u32*>(p)).load(); }
inline void red_add(u32* p, u32 v) { std::atomic_ref<u32>(*p).fetch_add(v); }
inline u32 fetch_add(u32* p, u32 v) { return std::atomic_ref<u32>(*p).fetch_add(v); }
inline void store_zero(u32* p) { std::atomic_ref<u32>(*p).store(0u); }
"#;
    let common = template("common.cuh");
    let primitives = cut(&common, "__device__ __forceinline__ u32 load_volatile(", "// end of grid-scope primitives", "common.cuh");
    let grid = cut(&common, "namespace grid {", "}  // namespace grid", "common.cuh").replacen(primitives, PRIMITIVES, 1);
    format!("{grid}}}  // namespace grid\n")
}

/// common.cuh's warp reductions (warp_max … up to the block-wide sum, which needs __shared__).
pub fn warp_reductions() -> String {
    let common = template("common.cuh");
    cut(&common, "__device__ __forceinline__ float warp_max(float v)", "// Block-wide sum", "common.cuh").to_string()
}

/// swiglu.cuh's gated activations as `namespace glu_detail` (what moe_matvec's paired rows use).
pub fn glu_activations() -> String {
    let glu = template("swiglu.cuh");
    let act = cut(&glu, "enum class Act", "template <Act A, class Cfg>", "swiglu.cuh");
    format!("namespace glu_detail {{\n{act}\n}}")
}

/// `name`'s `namespace memra` body: from its first `namespace memra {` to its `#define`.
pub fn template_body(name: &str, define: &str) -> String {
    let text = template(name);
    cut(&text, "namespace memra {", define, name).to_string()
}

pub fn compiler() -> Option<String> {
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

/// Compiles one emulator source per set of -D flags (cached), in a temp dir removed on drop.
pub struct Builder {
    cxx: String,
    dir: PathBuf,
    source: PathBuf,
    built: HashMap<Vec<String>, PathBuf>,
}

impl Builder {
    /// `None` (after one SKIP line naming `test`) without a C++ compiler.
    pub fn new(test: &str, tag: &str, source: &str) -> Option<Builder> {
        let Some(cxx) = compiler() else {
            eprintln!("SKIP {test}: no C++ compiler (set CXX)");
            return None;
        };
        let dir = std::env::temp_dir().join(format!("memra-emu-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("emu.cpp");
        std::fs::write(&path, source).expect("write emulator source");
        Some(Builder {
            cxx,
            dir,
            source: path,
            built: HashMap::new(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn get(&mut self, defines: Vec<String>) -> PathBuf {
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

/// f32 → bf16 bits, rounding to nearest even (what the kernels' stores do).
pub fn to_bf16(f: f32) -> u16 {
    let b = f.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// `n` random N(0, 1) cache values as the kernel reads them (bf16 bits or f32, as bytes) and the
/// f32 values they stand for.
pub fn random_cache(rng: &mut memra_reference::Rng, n: usize, f32_cache: bool) -> (Vec<u8>, Vec<f32>) {
    let v = rng.normal_vec(n, 1.0);
    if f32_cache {
        (f32_bytes(&v), v)
    } else {
        let bits: Vec<u16> = v.iter().map(|&x| to_bf16(x)).collect();
        let vals = bits.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect();
        (bits.iter().flat_map(|b| b.to_le_bytes()).collect(), vals)
    }
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

pub fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

pub fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn read_i32(path: &Path) -> Vec<i32> {
    std::fs::read(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Runs `bin` with `args`; panics with its stderr on failure.
pub fn run(bin: &Path, args: &[String]) {
    let out = Command::new(bin).args(args).output().expect("run emulator");
    assert!(
        out.status.success(),
        "emulator {} {args:?} failed: {:?}\n{}",
        bin.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
