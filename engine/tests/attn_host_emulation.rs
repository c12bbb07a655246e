//! CPU emulation of the attention kernels (attn_decode, attn_decode_rope, mla_decode): the templates are compiled
//! as host C++ with stand-ins for the CUDA features they use (one std::thread per CUDA thread,
//! std::barrier for __syncthreads and for the warp exchange behind __shfl_xor_sync, synchronous
//! copies for cp.async, blocks run one after another) and compared with memra-reference on fresh
//! random inputs (seed printed; replay with `MEMRA_SEED=<seed>`), bf16-rounded caches, NaN-poisoned
//! outputs, three launches per case on one workspace sized for the first one's split count, then
//! two with the case's (as callers reuse a workspace for every split count up to its size; the
//! split counters must be back at zero and nothing past the wrapper's size written: the harness
//! exits 3 otherwise). It checks indexing, masking, the online softmax and the split combine without a
//! GPU; it says nothing about speed or memory ordering. Tolerance: relative L2 ≤ 1e-5 (f32
//! arithmetic on the values the reference reads). attn_decode_rope starts from the raw q/k/v and
//! is checked against the reference QK-norm + RoPE, the rounded new cache row (written at the
//! position, nothing after it; element by element) and attention over the cache as it wrote it,
//! at 1e-4 (`TOL_ROPE`). Skips (one SKIP line)
//! without a C++20 compiler.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

mod emu_common;
mod mla_common;
mod mma_host;

use emu_common::{random_cache, splice, template, to_bf16};
use memra_engine::kernels::{attn_decode, mla_decode};
use memra_reference::attention::{AttnShape, Mask, attention};
use memra_reference::rope::{Rope, RopeMode, rope_heads};
use memra_reference::{Rng, norm, rel_err};
use mla_common::{Query, mla_reference};

const TOL: f64 = 1e-5;
/// attn_decode_rope: RoPE in f32 (the reference rotates in f64) before the new key's rounding
/// into the cache, so a few of its elements may land one bf16 step apart. The new rows are checked
/// element by element (below); the attention is then checked against the reference run over the
/// rows the kernel wrote, so such a step cannot move the output. 1e-4 relative L2 of the output.
const TOL_ROPE: f64 = 1e-4;
/// mla_decode over a bf16 cache runs on tensor cores: q·(scale·log2 e) and the softmax weights P
/// are rounded to bf16 (relative rounding error uniform in ±2^-9, std 2^-8/√12 ≈ 1.1e-3). With
/// N(0, 1) q and cache rows of 576 and scale 1/16, a score's error is ≈ 1.1e-3 · √576 · 1.44/16
/// ≈ 2.4e-3 in log2 units, ≈ 1.7e-3 relative on its weight; P's rounding adds ≈ 1.1e-3: the
/// output's relative L2 error is expected near 2e-3. Checked at 1e-2 (DESIGN's bf16 paths).
const TOL_TENSOR_CORES: f64 = 1e-2;

const PRELUDE: &str = r#"#include <cstdint>
#include <cstring>
#include <cmath>
#include <algorithm>
#include <thread>
#include <barrier>
#include <vector>
#include <atomic>
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __align__(x)
#define __global__
#define __launch_bounds__(x)
#define __shared__ static thread_local_block
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct Dim3 { unsigned x, y, z; };
inline thread_local Dim3 threadIdx, blockIdx, gridDim;
inline std::barrier<>* g_block_barrier;
inline std::vector<std::barrier<>*> g_warp_barriers;
inline std::vector<float> g_xchg(1024);
inline unsigned char* g_smem;
inline unsigned g_smem_bytes;
#define thread_local_block
#define __syncthreads() g_block_barrier->arrive_and_wait()
#define __syncwarp() g_warp_barriers[threadIdx.x / 32]->arrive_and_wait()
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline float4 __ldg(const float4* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
inline float2 make_float2(float a, float b) { return float2{a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    int t = threadIdx.x; g_warp_barriers[t / 32]->arrive_and_wait(); g_xchg[t] = v; g_warp_barriers[t / 32]->arrive_and_wait();
    float r = g_xchg[(t & ~31) | ((t & 31) ^ o)]; return r; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline void __threadfence() {}
using std::min; using std::max;
namespace memra {
typedef unsigned char u8; typedef unsigned short u16; typedef unsigned int u32; typedef unsigned long long u64; typedef long long i64;
enum class CacheType : int { F32 = 0, BF16 = 1 };
constexpr int WARP_SIZE = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;
template <int CT> inline int dim_or(int rt) { return CT != 0 ? CT : rt; }
inline void prefetch_l2(const void*) {}
inline void pdl_entry() {}  // programmatic dependent launch: nothing to wait for on the host
// attn_decode_rope.cuh and the qk_norm_rope.cuh helpers it shares.
enum class RopeMode : int { None = 0, Interleaved = 1, Neox = 2 };
enum class QkNorm : int { None = 0, PerHead = 1, Full = 2 };
inline u16 f32_to_bf16(float f) { unsigned b = __float_as_uint(f); return (u16)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16); }
template <CacheType C> inline void store_as(void* base, i64 i, float v) {
    if constexpr (C == CacheType::F32) static_cast<float*>(base)[i] = v; else static_cast<u16*>(base)[i] = f32_to_bf16(v); }
inline double exp2_f64(double x) { return std::exp2(x); }
inline float warp_sum(float v) { for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o); return v; }
template <int THREADS> inline float block_sum(float v) {
    static float partial[THREADS / WARP_SIZE];
    v = warp_sum(v);
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    return warp_sum(lane < THREADS / WARP_SIZE ? partial[lane] : 0.0f); }
}
inline void __sincosf(float x, float* s, float* c) { *s = std::sin(x); *c = std::cos(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __ldg(const float* p) { return *p; }
"#;

const MAIN: &str = r#"
#include <cstdio>
#include <functional>
using namespace memra;
static void run_grid(Dim3 grid, int threads, size_t smem, std::function<void()> body) {
    std::vector<unsigned char> sm(smem + 16);
    g_smem = sm.data();
    for (unsigned z = 0; z < grid.z; ++z) for (unsigned y = 0; y < grid.y; ++y) for (unsigned x = 0; x < grid.x; ++x) {
        std::barrier<> bb(threads);
        std::vector<std::barrier<>*> wb; for (int w = 0; w < threads / 32; ++w) wb.push_back(new std::barrier<>(32));
        g_block_barrier = &bb; g_warp_barriers = wb;
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] { threadIdx = {(unsigned)t, 0, 0}; blockIdx = {x, y, z}; gridDim = grid; body(); });
        for (auto& t : ts) t.join();
        for (auto p : wb) delete p;
    }
}
static std::vector<unsigned char> slurp(const char* path) {
    FILE* f = fopen(path, "rb"); if (!f) { perror(path); exit(2); }
    fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
    std::vector<unsigned char> v(n + 16); if (fread(v.data(), 1, n, f) != (size_t)n) exit(2); fclose(f); return v; }
template <int HD, int NH, int NKV, CacheType C, int HPB = 4> struct ACfg { static constexpr int HEAD_DIM = HD, N_HEAD = NH, N_KV = NKV; static constexpr CacheType CACHE_T = C; static constexpr int THREADS = 128, HEADS_PER_BLOCK = HPB; };
template <int NH, int KVL, int RP, CacheType C> struct MCfg { static constexpr int N_HEAD = NH, KV_LORA = KVL, ROPE = RP; static constexpr CacheType CACHE_T = C; static constexpr int THREADS = 256; };
// attn: kind=0 cfg n_seq hd nh nkv window n_split max_ctx work_split work_floats q k v pos out
// mla:  kind=1 cfg nh kvl rope max_ctx n_split pos work_split work_floats q c out
// attn and mla alike: the workspace (work_floats slots: the wrapper's size for work_split, 16
// guard slots after) is first used by a launch with work_split splits, then by two with n_split
// (callers reuse one workspace for every split count up to its size).
template <class K> void attn(int n_seq, int hd, int nh, int nkv, int window, int n_split, int max_ctx, int work_split, int work_floats, float scale, char** f) {
    auto q = slurp(f[0]), k = slurp(f[1]), v = slurp(f[2]), pos = slurp(f[3]);
    std::vector<float> out(n_seq * nh * hd), work((size_t)work_floats + 16, 0.0f);
    std::fill(work.begin() + work_floats, work.end(), -7.0f);
    int G = nh / nkv, nhg = (G + K::HEADS_PER_BLOCK - 1) / K::HEADS_PER_BLOCK;
    const int splits[3] = {work_split, n_split, n_split};
    for (int s : splits) {
        std::fill(out.begin(), out.end(), NAN);
        run_grid({(unsigned)(nkv * nhg), (unsigned)s, (unsigned)n_seq}, K::THREADS, 0, [&] {
            attn_decode_impl<K>((const float*)q.data(), k.data(), v.data(), (const int*)pos.data(), out.data(), work.data(), n_seq, hd, nh, nkv, max_ctx, window, s, scale); });
    }
    // Counters (and their padding) at the front, back at zero; nothing past the wrapper's size.
    const unsigned* ctr = (const unsigned*)work.data();
    for (int i = 0; i < (n_seq * nh + 3) / 4 * 4; ++i) if (ctr[i] != 0) { fprintf(stderr, "counter %d left at %u\n", i, ctr[i]); exit(3); }
    for (int i = work_floats; i < work_floats + 16; ++i) if (work[i] != -7.0f) { fprintf(stderr, "work[%d] written past the wrapper's size\n", i); exit(3); }
    // out = null (combine_matvec's input): the partials alone, every split's, combined here in
    // double must give the launch's own output. The partials are poisoned first.
    if (work_floats >= (n_seq * nh + 3) / 4 * 4 + n_seq * nh * n_split * (hd + 2)) {
        const int c0 = (n_seq * nh + 3) / 4 * 4;
        std::fill(work.begin() + c0, work.begin() + work_floats, NAN);
        run_grid({(unsigned)(nkv * nhg), (unsigned)n_split, (unsigned)n_seq}, K::THREADS, 0, [&] {
            attn_decode_impl<K>((const float*)q.data(), k.data(), v.data(), (const int*)pos.data(), nullptr, work.data(), n_seq, hd, nh, nkv, max_ctx, window, n_split, scale); });
        const float* acc = work.data() + c0;
        const float* ml = acc + (size_t)n_seq * nh * n_split * hd;
        for (int r = 0; r < n_seq * nh; ++r) {
            double M = -INFINITY;
            for (int s = 0; s < n_split; ++s) M = std::max(M, (double)ml[2 * (r * n_split + s)]);
            for (int d = 0; d < hd; ++d) {
                double A = 0.0, L = 0.0;
                for (int s = 0; s < n_split; ++s) {
                    const double m = ml[2 * (r * n_split + s)], w = m == -INFINITY ? 0.0 : std::exp2(m - M);
                    A += w * acc[(size_t)(r * n_split + s) * hd + d];
                    L += w * ml[2 * (r * n_split + s) + 1];
                }
                const double got = L > 0.0 ? A / L : (L == 0.0 ? 0.0 : NAN), want = out[(size_t)r * hd + d];
                const bool ok = std::isnan(want) ? std::isnan(got) : std::fabs(got - want) <= 1e-5 * (1.0 + std::fabs(want));
                if (!ok) { fprintf(stderr, "partials of row %d elem %d combine to %g, the launch wrote %g\n", r, d, got, want); exit(3); }
            }
        }
        for (int i = work_floats; i < work_floats + 16; ++i) if (work[i] != -7.0f) { fprintf(stderr, "work[%d] written past the wrapper's size (partials)\n", i); exit(3); }
    }
    FILE* fo = fopen(f[4], "wb"); fwrite(out.data(), 4, out.size(), fo); fclose(fo);
}
template <class K> void mla(int nh, int kvl, int rope, int max_ctx, int n_split, int pos, int work_split, int work_floats, float scale, int eb, char** f) {
    auto q = slurp(f[0]), c = slurp(f[1]);
    std::vector<float> out(nh * kvl), work((size_t)work_floats + 16, 0.0f);
    std::fill(work.begin() + work_floats, work.end(), -7.0f);
    int D = kvl + rope;
    // bf16: the tensor-core form (Q, two 64-row tiles, P; rows of D rounded up to 64); f32: CUDA cores.
    size_t smem = eb == 2 ? (size_t)(64 + 128) * ((D + 63) / 64 * 128) + 64 * 128 + 1536
                          : std::min(nh, 64) * (D + 4) * 4 + 2 * 8 * (D * eb + 16) + 8 * 256 + 768;
    const int splits[3] = {work_split, n_split, n_split};
    for (int s : splits) {
        std::fill(out.begin(), out.end(), NAN);
        run_grid({(unsigned)s, (unsigned)((nh + 63) / 64), 1}, 256, smem, [&] {
            mla_decode_impl<K>((const float*)q.data(), c.data(), &pos, out.data(), work.data(), nh, kvl, rope, max_ctx, s, scale, 0, 1); });
    }
    // Phases 1 (partials) + 2 (merge over 3 blocks per head block): the same bits as phase 0.
    if (n_split > 1) {
        std::vector<float> two(out.size(), NAN);
        run_grid({(unsigned)n_split, (unsigned)((nh + 63) / 64), 1}, 256, smem, [&] {
            mla_decode_impl<K>((const float*)q.data(), c.data(), &pos, two.data(), work.data(), nh, kvl, rope, max_ctx, n_split, scale, 1, 1); });
        run_grid({3, (unsigned)((nh + 63) / 64), 1}, 256, mla_detail::merge_smem_bytes(n_split), [&] {
            mla_decode_impl<K>((const float*)q.data(), c.data(), &pos, two.data(), work.data(), nh, kvl, rope, max_ctx, n_split, scale, 2, 1); });
        if (memcmp(two.data(), out.data(), out.size() * 4) != 0) { fprintf(stderr, "phases 1 + 2 differ from phase 0\n"); exit(3); }
    }
    // Counters (and their padding) at the front, back at zero; nothing past the wrapper's size.
    const unsigned* ctr = (const unsigned*)work.data();
    for (int i = 0; i < ((nh + 63) / 64 + 3) / 4 * 4; ++i) if (ctr[i] != 0) { fprintf(stderr, "counter %d left at %u\n", i, ctr[i]); exit(3); }
    for (int i = work_floats; i < work_floats + 16; ++i) if (work[i] != -7.0f) { fprintf(stderr, "work[%d] written past the wrapper's size\n", i); exit(3); }
    FILE* fo = fopen(f[2], "wb"); fwrite(out.data(), 4, out.size(), fo); fclose(fo);
}
// n_q queries at positions pos[0..n_q) in one launch (phase 0 when n_split = 1, else phases 1 +
// 2 with grid z = n_q) must give the bits of n_q one-query launches; phase 0 with several
// queries and splits (the counters serve one query) must write NaN.
template <class K> void mla_batch(int nh, int kvl, int rope, int max_ctx, int n_split, int n_q, int work_floats, float scale, int eb, char** f) {
    auto q = slurp(f[0]), c = slurp(f[1]), pv = slurp(f[2]);
    const int* pos = (const int*)pv.data();
    const size_t per_q = (size_t)nh * kvl, D = kvl + rope;
    std::vector<float> out(n_q * per_q, NAN), one(n_q * per_q, NAN), work((size_t)work_floats + 16, 0.0f);
    std::fill(work.begin() + work_floats, work.end(), -7.0f);
    size_t smem = eb == 2 ? (size_t)(64 + 128) * ((D + 63) / 64 * 128) + 64 * 128 + 1536
                          : std::min(nh, 64) * (D + 4) * 4 + 2 * 8 * (D * eb + 16) + 8 * 256 + 768;
    const unsigned hbs = (nh + 63) / 64;
    auto launch = [&](const float* qq, const int* pp, float* o, int nq) {
        if (n_split == 1) {
            run_grid({1, hbs, (unsigned)nq}, 256, smem, [&] { mla_decode_impl<K>(qq, c.data(), pp, o, work.data(), nh, kvl, rope, max_ctx, 1, scale, 0, nq); });
            return;
        }
        run_grid({(unsigned)n_split, hbs, (unsigned)nq}, 256, smem, [&] { mla_decode_impl<K>(qq, c.data(), pp, o, work.data(), nh, kvl, rope, max_ctx, n_split, scale, 1, nq); });
        run_grid({3, hbs, (unsigned)nq}, 256, mla_detail::merge_smem_bytes(n_split), [&] { mla_decode_impl<K>(qq, c.data(), pp, o, work.data(), nh, kvl, rope, max_ctx, n_split, scale, 2, nq); });
    };
    launch((const float*)q.data(), pos, out.data(), n_q);
    for (int j = 0; j < n_q; ++j) launch((const float*)q.data() + j * nh * D, pos + j, one.data() + j * per_q, 1);
    if (memcmp(one.data(), out.data(), out.size() * 4) != 0) { fprintf(stderr, "batched launch differs from one launch per query\n"); exit(3); }
    if (n_split > 1 && n_q > 1) {
        std::vector<float> refused(out.size(), 0.0f);
        run_grid({(unsigned)n_split, hbs, (unsigned)n_q}, 256, smem, [&] {
            mla_decode_impl<K>((const float*)q.data(), c.data(), pos, refused.data(), work.data(), nh, kvl, rope, max_ctx, n_split, scale, 0, n_q); });
        for (float v : refused) if (!std::isnan(v)) { fprintf(stderr, "phase 0 over several queries did not write NaN\n"); exit(3); }
    }
    const unsigned* ctr = (const unsigned*)work.data();
    for (int i = 0; i < ((nh + 63) / 64 + 3) / 4 * 4; ++i) if (ctr[i] != 0) { fprintf(stderr, "counter %d left at %u\n", i, ctr[i]); exit(3); }
    for (int i = work_floats; i < work_floats + 16; ++i) if (work[i] != -7.0f) { fprintf(stderr, "work[%d] written past the wrapper's size\n", i); exit(3); }
    FILE* fo = fopen(f[3], "wb"); fwrite(out.data(), 4, out.size(), fo); fclose(fo);
}
template <int HD, int NH, int NKV, int NR, RopeMode M, QkNorm N, CacheType C, int HPB = 4> struct RCfg {
    static constexpr int HEAD_DIM = HD, N_HEAD = NH, N_KV = NKV, N_ROT = NR;
    static constexpr RopeMode ROPE_MODE = M; static constexpr QkNorm QK_NORM = N; static constexpr CacheType CACHE_T = C;
    static constexpr int THREADS = 256, MIN_SPLIT_ROWS = 32, HEADS_PER_BLOCK = HPB; };
// rope: kind=3 cfg n_seq hd nh nkv n_rot window n_split max_ctx work_floats scale base eps
//       q k v qw kw kc vc pos out; out = the attention output, then both caches as f32 values.
template <class K> void rope(int n_seq, int hd, int nh, int nkv, int n_rot, int window, int n_split, int max_ctx, int work_floats,
                             float scale, float base, float eps, char** f) {
    auto q = slurp(f[0]), k = slurp(f[1]), v = slurp(f[2]), qw = slurp(f[3]), kw = slurp(f[4]), kc = slurp(f[5]), vc = slurp(f[6]), pos = slurp(f[7]);
    std::vector<float> out(n_seq * nh * hd, NAN), work((size_t)work_floats + 16, 0.0f);
    int G = nh / nkv, nhg = (G + K::HEADS_PER_BLOCK - 1) / K::HEADS_PER_BLOCK;
    run_grid({(unsigned)(nkv * nhg), (unsigned)n_split, (unsigned)n_seq}, K::THREADS, 0, [&] {
        const attn_detail::RopePrologue<K> pre{(const float*)q.data(), (const float*)k.data(), (const float*)v.data(), (const float*)qw.data(),
                                               (const float*)kw.data(), kc.data(), vc.data(), n_rot, base, 1.0f, eps};
        attn_decode_impl<K>(nullptr, kc.data(), vc.data(), (const int*)pos.data(), out.data(), work.data(), n_seq, hd, nh, nkv, max_ctx, window,
                            n_split, scale, pre); });
    FILE* fo = fopen(f[8], "wb"); fwrite(out.data(), 4, out.size(), fo);
    const size_t n = (size_t)n_seq * max_ctx * nkv * hd;
    for (auto* c : {&kc, &vc}) for (size_t i = 0; i < n; ++i) {
        float x;
        if constexpr (K::CACHE_T == CacheType::F32) memcpy(&x, c->data() + 4 * i, 4);
        else { u16 b; memcpy(&b, c->data() + 2 * i, 2); x = __uint_as_float((unsigned)b << 16); }
        fwrite(&x, 4, 1, fo); }
    fclose(fo);
}
int main(int argc, char** argv) {
    using B = CacheType;
    if (atoi(argv[1]) == 3) {
        int cfg = atoi(argv[2]), a[9]; for (int i = 0; i < 9; ++i) a[i] = atoi(argv[3 + i]);
        float scale = (float)atof(argv[12]), base = (float)atof(argv[13]), eps = (float)atof(argv[14]);
        char** f = argv + 15;
        using RM = RopeMode; using QN = QkNorm;
        switch (cfg) {
        case 0: rope<RCfg<256, 4, 1, 256, RM::Neox, QN::PerHead, B::BF16>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], scale, base, eps, f); break;
        case 1: rope<RCfg<0, 0, 0, 0, RM::Neox, QN::Full, B::BF16>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], scale, base, eps, f); break;
        case 2: rope<RCfg<0, 0, 0, 0, RM::Interleaved, QN::None, B::F32>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], scale, base, eps, f); break;
        case 3: rope<RCfg<256, 4, 1, 256, RM::Neox, QN::PerHead, B::BF16, 2>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], scale, base, eps, f); break;
        case 4: rope<RCfg<0, 0, 0, 0, RM::Neox, QN::Full, B::BF16, 1>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], scale, base, eps, f); break;
        default: return 4;
        }
        return 0;
    }
    int kind = atoi(argv[1]), cfg = atoi(argv[2]);
    if (kind == 0) {
        int a[9]; for (int i = 0; i < 9; ++i) a[i] = atoi(argv[3 + i]);
        float scale = (float)atof(argv[12]);
        char** f = argv + 13;
        switch (cfg) {
        case 0: attn<ACfg<256, 4, 1, B::BF16>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], scale, f); break;
        case 1: attn<ACfg<0, 0, 0, B::BF16>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], scale, f); break;
        case 2: attn<ACfg<128, 32, 8, B::BF16>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], scale, f); break;
        case 3: attn<ACfg<0, 0, 0, B::F32>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], scale, f); break;
        case 4: attn<ACfg<256, 4, 1, B::BF16, 2>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], scale, f); break;
        case 5: attn<ACfg<0, 0, 0, B::BF16, 2>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], scale, f); break;
        case 6: attn<ACfg<0, 0, 0, B::BF16, 1>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], scale, f); break;
        default: return 4;
        }
    } else if (kind == 2) {
        // mla batch: kind=2 cfg nh kvl rope max_ctx n_split n_q work_floats scale q c pos out
        int a[7]; for (int i = 0; i < 7; ++i) a[i] = atoi(argv[3 + i]);
        float scale = (float)atof(argv[10]);
        char** f = argv + 11;
        switch (cfg) {
        case 0: mla_batch<MCfg<64, 512, 64, B::BF16>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], scale, 2, f); break;
        case 1: mla_batch<MCfg<0, 0, 0, B::BF16>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], scale, 2, f); break;
        case 2: mla_batch<MCfg<0, 0, 0, B::F32>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], scale, 4, f); break;
        default: return 4;
        }
    } else {
        int a[8]; for (int i = 0; i < 8; ++i) a[i] = atoi(argv[3 + i]);
        float scale = (float)atof(argv[11]);
        char** f = argv + 12;
        switch (cfg) {
        case 0: mla<MCfg<64, 512, 64, B::BF16>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], scale, 2, f); break;
        case 1: mla<MCfg<0, 0, 0, B::BF16>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], scale, 2, f); break;
        case 2: mla<MCfg<0, 0, 0, B::F32>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], scale, 4, f); break;
        default: return 4;
        }
    }
    return 0;
}
"#;

fn emulator_source() -> String {
    let strip = |t: String| {
        t.replace("#pragma once", "")
            .replace("#include \"memra/common.cuh\"", "")
    };
    let attn = strip(template("attn_decode.cuh"));
    let qk = template("qk_norm_rope.cuh");
    let from = qk.find("__device__ __forceinline__ float2 rope_cos_sin(").expect("qk_norm_rope.cuh: no rope_cos_sin");
    let to = qk.find("template <class Cfg>\n__device__ __forceinline__ void qk_norm_rope_impl(").expect("qk_norm_rope.cuh: no qk_norm_rope_impl");
    let helpers = format!("namespace memra {{\n{}\n}}\n", &qk[from..to]);
    let rope = template("attn_decode_rope.cuh").replace("#pragma once", "").replace("#include \"memra/attn_decode.cuh\"", "").replace("#include \"memra/qk_norm_rope.cuh\"", "");
    let mut mla = strip(template("mla_decode.cuh"));
    mla = splice(
        &mla,
        "__device__ __forceinline__ float2 ldcg2(",
        "template <CacheType C> struct Elem;",
        mla_common::LOADS_HOST,
        "mla_decode.cuh",
    );
    let decl = "extern __shared__ __align__(16) unsigned char smem_raw[];";
    assert!(mla.contains(decl), "mla_decode.cuh: no `{decl}`");
    mla = mla.replace(decl, "unsigned char* smem_raw = g_smem;");
    let mla = mma_host::with_host_ptx(&mma_host::host_mla_tensor_core_path(&mla));
    let grid = format!("namespace memra {{\n{}}}\n", emu_common::grid_scope());
    format!("{PRELUDE}\n{grid}\n{attn}\n{helpers}\n{rope}\n{mla}\n{MAIN}")
}

/// The emulator binary, built once per test process (None = no compiler).
fn emulator() -> Option<&'static Path> {
    static BIN: OnceLock<Option<PathBuf>> = OnceLock::new();
    BIN.get_or_init(|| {
        let cxx = emu_common::compiler()?;
        let dir = std::env::temp_dir().join(format!("memra-attn-emu-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let src = dir.join("emu.cpp");
        std::fs::write(&src, emulator_source())
            .unwrap_or_else(|e| panic!("{}: {e}", src.display()));
        let bin = dir.join("emu");
        let out = Command::new(&cxx)
            .args(["-std=c++20", "-O1", "-pthread", "-o"])
            .arg(&bin)
            .arg(&src)
            .output()
            .unwrap_or_else(|e| panic!("{cxx}: {e}"));
        assert!(
            out.status.success(),
            "{cxx} failed on {}:\n{}",
            src.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Some(bin)
    })
    .as_deref()
}

fn bytes<T: Copy>(v: &[T]) -> Vec<u8> {
    // SAFETY: plain-old-data slices (f32, u16, i32) viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
        .to_vec()
}

/// Writes `files`, runs the emulator with `args` + their paths + the output path, reads floats.
fn run(
    bin: &Path,
    tag: &str,
    args: &[String],
    files: &[(&str, Vec<u8>)],
    n_out: usize,
) -> Vec<f32> {
    let dir = bin.parent().unwrap().join(tag);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let mut cmd = Command::new(bin);
    cmd.args(args);
    for (name, data) in files {
        let p = dir.join(name);
        std::fs::write(&p, data).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        cmd.arg(p);
    }
    let out_path = dir.join("out.bin");
    cmd.arg(&out_path);
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    assert!(
        out.status.success(),
        "emulator {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let raw = std::fs::read(&out_path).unwrap_or_else(|e| panic!("{}: {e}", out_path.display()));
    assert_eq!(raw.len(), n_out * 4, "emulator output size");
    raw.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn attn_case(
    bin: &Path,
    rng: &mut Rng,
    cfg: usize,
    hd: usize,
    nh: usize,
    nkv: usize,
    window: usize,
    n_split: usize,
    work_split: usize,
    positions: &[usize],
    f32_cache: bool,
) {
    let n_seq = positions.len();
    let max_ctx = positions.iter().max().unwrap() + 3;
    let row = nkv * hd;
    let q = rng.normal_vec(n_seq * nh * hd, 1.0);
    let (kb, kv) = random_cache(rng, n_seq * max_ctx * row, f32_cache);
    let (vb, vv) = random_cache(rng, n_seq * max_ctx * row, f32_cache);
    let scale = 1.0 / (hd as f32).sqrt();
    let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    let work = attn_decode::work_floats(n_seq, nh, hd, n_split.max(work_split));
    let args: Vec<String> = [
        0, cfg, n_seq, hd, nh, nkv, window, n_split, max_ctx, work_split, work,
    ]
    .iter()
    .map(|v| v.to_string())
    .chain([format!("{scale:e}")])
    .collect();
    let tag = format!("attn-{cfg}-{hd}-{nh}-{nkv}-{window}-{n_split}-{n_seq}-after-{work_split}");
    let got = run(
        bin,
        &tag,
        &args,
        &[
            ("q.bin", bytes(&q)),
            ("k.bin", kb),
            ("v.bin", vb),
            ("pos.bin", bytes(&pos)),
        ],
        q.len(),
    );
    let mut want = Vec::new();
    for (b, &p) in positions.iter().enumerate() {
        let base = b * max_ctx * row;
        let mask = Mask {
            q_pos: &[p],
            window: (window > 0).then_some(window),
            allowed: None,
        };
        let shape = AttnShape {
            n_head: nh,
            n_kv_head: nkv,
            head_dim_k: hd,
            head_dim_v: hd,
        };
        want.extend(attention(
            &q[b * nh * hd..][..nh * hd],
            &kv[base..][..(p + 1) * row],
            &vv[base..][..(p + 1) * row],
            p + 1,
            shape,
            &mask,
            scale,
        ));
    }
    let err = rel_err(&got, &want);
    assert!(
        err <= TOL,
        "attn_decode emulation {tag} positions={positions:?}: relative L2 {err:e} > {TOL:e} (MEMRA_SEED={})",
        rng.seed()
    );
}

/// An attn_decode_rope case: the rotation and QK-norm of the emulated variant (cfg).
struct RopeCase {
    cfg: usize,
    hd: usize,
    nh: usize,
    nkv: usize,
    n_rot: usize,
    mode: Option<RopeMode>,
    /// None, per head (`[hd]` weights) or full (`[nh·hd]`, `[nkv·hd]`).
    norm: &'static str,
    f32_cache: bool,
}

/// attn_decode_rope on the host threads against the composition it replaces: the reference
/// QK-norm + RoPE of the raw q/k, k and v rounded into the cache at each position, attention over
/// the rounded cache. The cache rows from the position on start NaN; afterwards the position's
/// row holds the new k / v and the rows after it are still NaN.
fn rope_case(bin: &Path, rng: &mut Rng, c: &RopeCase, window: usize, n_split: usize, positions: &[usize]) {
    let (hd, nh, nkv) = (c.hd, c.nh, c.nkv);
    let n_seq = positions.len();
    let max_ctx = positions.iter().max().unwrap() + 3;
    let (q_row, row) = (nh * hd, nkv * hd);
    let q = rng.normal_vec(n_seq * q_row, 1.5);
    let k = rng.normal_vec(n_seq * row, 1.5);
    let v = rng.normal_vec(n_seq * row, 1.0);
    let (wq_len, wk_len) = if c.norm == "full" { (q_row, row) } else { (hd, hd) };
    let (qw, kw) = (rng.uniform_vec(wq_len, 0.5, 1.5), rng.uniform_vec(wk_len, 0.5, 1.5));
    let round = |x: f32| if c.f32_cache { x } else { f32::from_bits((to_bf16(x) as u32) << 16) };
    let (mut kb, mut kvals) = random_cache(rng, n_seq * max_ctx * row, c.f32_cache);
    let (mut vb, mut vvals) = random_cache(rng, n_seq * max_ctx * row, c.f32_cache);
    let eb = if c.f32_cache { 4 } else { 2 };
    let nan: Vec<u8> = if c.f32_cache { f32::NAN.to_le_bytes().to_vec() } else { to_bf16(f32::NAN).to_le_bytes().to_vec() };
    let (base, eps) = (1.0e4f32, 1e-6f32);
    let scale = 1.0 / (hd as f32).sqrt();
    let (mut want_q, mut want_k, mut want_v) = (Vec::new(), Vec::new(), Vec::new());
    for (b, &p) in positions.iter().enumerate() {
        let normed = |x: &[f32], w: &[f32], heads: usize| {
            let mut y = if c.norm == "none" { x.to_vec() } else { norm::rms_norm(x, w, eps) };
            if let Some(mode) = c.mode {
                rope_heads(&mut y, heads, hd, p, &Rope { mode, n_rot: c.n_rot, base, freq_scale: 1.0 });
            }
            y
        };
        let qn = normed(&q[b * q_row..][..q_row], &qw, nh);
        let kn: Vec<f32> = normed(&k[b * row..][..row], &kw, nkv).into_iter().map(round).collect();
        let vn: Vec<f32> = v[b * row..][..row].iter().map(|&x| round(x)).collect();
        let at = b * max_ctx * row;
        kvals[at + p * row..][..row].copy_from_slice(&kn);
        vvals[at + p * row..][..row].copy_from_slice(&vn);
        for cache in [&mut kb, &mut vb] {
            for e in (at + p * row)..(b + 1) * max_ctx * row {
                cache[e * eb..(e + 1) * eb].copy_from_slice(&nan);
            }
        }
        want_q.push(qn);
        want_k.extend(kn);
        want_v.extend(vn);
    }
    let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    let work = attn_decode::work_floats(n_seq, nh, hd, n_split);
    let args: Vec<String> = [3, c.cfg, n_seq, hd, nh, nkv, c.n_rot, window, n_split, max_ctx, work]
        .iter()
        .map(|v| v.to_string())
        .chain([format!("{scale:e}"), format!("{base:e}"), format!("{eps:e}")])
        .collect();
    let tag = format!("rope-{}-{hd}-{nh}-{nkv}-{window}-{n_split}-{n_seq}", c.cfg);
    let files = [
        ("q.bin", bytes(&q)),
        ("k.bin", bytes(&k)),
        ("v.bin", bytes(&v)),
        ("qw.bin", bytes(&qw)),
        ("kw.bin", bytes(&kw)),
        ("kc.bin", kb),
        ("vc.bin", vb),
        ("pos.bin", bytes(&pos)),
    ];
    let cache_n = n_seq * max_ctx * row;
    let got = run(bin, &tag, &args, &files, q.len() + 2 * cache_n);
    let (out, caches) = got.split_at(q.len());
    let (kc, vc) = caches.split_at(cache_n);
    let what = format!("attn_decode_rope emulation {tag} positions={positions:?} (MEMRA_SEED={})", rng.seed());
    let (mut got_k, mut got_v) = (Vec::new(), Vec::new());
    for (b, &p) in positions.iter().enumerate() {
        let at = b * max_ctx * row + p * row;
        got_k.extend_from_slice(&kc[at..at + row]);
        got_v.extend_from_slice(&vc[at..at + row]);
        let after = at + row..(b + 1) * max_ctx * row;
        assert!(kc[after.clone()].iter().chain(&vc[after]).all(|x| x.is_nan()), "{what}: a row after position {p} was written");
    }
    // The new k. In an f32 cache: the emulation's f32 rotation within 1e-5 of the f64 reference.
    // In a bf16 cache: each element the reference's rounding or, where the two rotations fall
    // either side of a rounding midpoint, one bf16 step next to it; such elements are rare (a
    // few in 10^5), so more than 1 % of them is a bug (truncation instead of rounding, say).
    // A rotated element near zero comes from cancellation, so the f32 rotation's error there is
    // a few f32 ulps of the head's magnitude, not of the element (2.35e-6 vs 2.31e-6 in a head
    // of magnitude ~1 was seen): that error is allowed on top of the step.
    if c.f32_cache {
        let err_k = rel_err(&got_k, &want_k);
        assert!(err_k <= 1e-5, "{what}: new k rows relative L2 {err_k:e}");
    } else {
        let bf16_step = |x: f32| 2f32.powi(x.abs().max(f32::MIN_POSITIVE).log2().floor() as i32 - 7);
        let head_max: Vec<f32> = want_k.chunks(hd).map(|h| h.iter().fold(0f32, |m, x| m.max(x.abs()))).collect();
        let mut off = 0;
        for (i, (&g, &w)) in got_k.iter().zip(&want_k).enumerate() {
            let f32_rotation = 16.0 * f32::EPSILON * head_max[i / hd];
            assert!(
                g == w || (g - w).abs() <= bf16_step(w) + f32_rotation,
                "{what}: new k element {i}: {g} vs reference {w}"
            );
            off += usize::from(g != w);
        }
        assert!(off <= 2 + got_k.len() / 100, "{what}: {off} of {} new k elements a bf16 step off the reference", got_k.len());
    }
    // v is copied and rounded alike.
    assert_eq!(got_v, want_v, "{what}: new v rows");
    // The attention over the cache as the kernel left it (its own rounding of the new k).
    let mut want = Vec::new();
    for (b, &p) in positions.iter().enumerate() {
        let at = b * max_ctx * row;
        kvals[at + p * row..][..row].copy_from_slice(&got_k[b * row..][..row]);
        let mask = Mask { q_pos: &[p], window: (window > 0).then_some(window), allowed: None };
        let shape = AttnShape { n_head: nh, n_kv_head: nkv, head_dim_k: hd, head_dim_v: hd };
        want.extend(attention(&want_q[b], &kvals[at..][..(p + 1) * row], &vvals[at..][..(p + 1) * row], p + 1, shape, &mask, scale));
    }
    let err = rel_err(out, &want);
    assert!(err <= TOL_ROPE, "{what}: output relative L2 {err:e} > {TOL_ROPE:e}");
}

#[allow(clippy::too_many_arguments)]
fn mla_case(
    bin: &Path,
    rng: &mut Rng,
    cfg: usize,
    nh: usize,
    kvl: usize,
    rope: usize,
    t_kv: usize,
    n_split: usize,
    work_split: usize,
    f32_cache: bool,
) {
    let d = kvl + rope;
    let max_ctx = t_kv + 3;
    let q = rng.normal_vec(nh * d, 1.0);
    let (cb, cv) = random_cache(rng, max_ctx * d, f32_cache);
    let scale = 1.0f32 / 16.0;
    let work = mla_decode::work_floats(nh, kvl, n_split.max(work_split));
    let args: Vec<String> = [
        1,
        cfg,
        nh,
        kvl,
        rope,
        max_ctx,
        n_split,
        t_kv - 1,
        work_split,
        work,
    ]
    .iter()
    .map(|v| v.to_string())
    .chain([format!("{scale:e}")])
    .collect();
    let tag = format!("mla-{cfg}-{nh}-{kvl}-{rope}-{t_kv}-{n_split}-after-{work_split}");
    let got = run(
        bin,
        &tag,
        &args,
        &[("q.bin", bytes(&q)), ("c.bin", cb)],
        nh * kvl,
    );
    let latent: Vec<f32> = (0..t_kv)
        .flat_map(|r| cv[r * d..][..kvl].iter().copied())
        .collect();
    let shape = AttnShape {
        n_head: nh,
        n_kv_head: 1,
        head_dim_k: d,
        head_dim_v: kvl,
    };
    let want = attention(
        &q,
        &cv[..t_kv * d],
        &latent,
        t_kv,
        shape,
        &Mask::causal(&[t_kv - 1]),
        scale,
    );
    let err = rel_err(&got, &want);
    let tol = if f32_cache { TOL } else { TOL_TENSOR_CORES };
    eprintln!("mla_decode emulation {tag}: relative L2 {err:.2e} (tolerance {tol:e})");
    assert!(
        err <= tol,
        "mla_decode emulation {tag}: relative L2 {err:e} > {tol:e} (MEMRA_SEED={})",
        rng.seed()
    );
}

/// Several query tokens in one launch, each at its own position over the same latent cache.
#[allow(clippy::too_many_arguments)]
fn mla_batch_case(
    bin: &Path,
    rng: &mut Rng,
    cfg: usize,
    nh: usize,
    kvl: usize,
    rope: usize,
    positions: &[usize],
    n_split: usize,
    f32_cache: bool,
) {
    let (d, n_q) = (kvl + rope, positions.len());
    let max_ctx = positions.iter().max().unwrap() + 3;
    let q = rng.normal_vec(n_q * nh * d, 1.0);
    let (cb, cv) = random_cache(rng, max_ctx * d, f32_cache);
    let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    let scale = 1.0f32 / 16.0;
    let work = mla_decode::work_floats_batch(nh, kvl, n_split, n_q);
    let args: Vec<String> = [2, cfg, nh, kvl, rope, max_ctx, n_split, n_q, work]
        .iter()
        .map(|v| v.to_string())
        .chain([format!("{scale:e}")])
        .collect();
    let tag = format!("mla-batch-{cfg}-{nh}-{kvl}-{rope}-{n_split}-{positions:?}");
    let got = run(
        bin,
        &tag.replace([' ', ',', '[', ']'], "_"),
        &args,
        &[("q.bin", bytes(&q)), ("c.bin", cb), ("pos.bin", bytes(&pos))],
        n_q * nh * kvl,
    );
    let queries: Vec<Query> = positions
        .iter()
        .map(|&pos| Query { pos, rows: None })
        .collect();
    let want = mla_reference(&q, &cv, nh, kvl, rope, &queries, scale);
    let err = rel_err(&got, &want);
    let tol = if f32_cache { TOL } else { TOL_TENSOR_CORES };
    eprintln!("mla_decode batch emulation {tag}: relative L2 {err:.2e} (tolerance {tol:e})");
    assert!(
        err <= tol,
        "mla_decode batch emulation {tag}: relative L2 {err:e} > {tol:e} (MEMRA_SEED={})",
        rng.seed()
    );
}

#[test]
fn mla_decode_batched_queries_emulated_on_host_threads_match_reference() {
    let test = "mla_decode_batched_queries_emulated_on_host_threads_match_reference";
    let Some(bin) = emulator() else {
        eprintln!("SKIP {test}: no C++20 compiler");
        return;
    };
    let mut rng = Rng::from_env_or_time(test);
    // Prefill: query j at its own position (0 included), one launch; splits take phases 1 + 2.
    mla_batch_case(bin, &mut rng, 0, 64, 512, 64, &[0, 70, 9], 2, false);
    mla_batch_case(bin, &mut rng, 1, 40, 128, 8, &[66, 0, 13], 1, false);
    mla_batch_case(bin, &mut rng, 1, 80, 256, 32, &[5, 31], 3, false); // two head blocks
    mla_batch_case(bin, &mut rng, 2, 16, 128, 32, &[19, 0, 8], 2, true);
    mla_batch_case(bin, &mut rng, 2, 64, 256, 32, &[23, 22], 1, true);
    eprintln!("PASS {test} (MEMRA_SEED={})", rng.seed());
}

#[test]
fn attn_decode_emulated_on_host_threads_matches_reference() {
    let Some(bin) = emulator() else {
        eprintln!("SKIP attn_decode_emulated_on_host_threads_matches_reference: no C++20 compiler");
        return;
    };
    let mut rng = Rng::from_env_or_time("attn_decode_emulated_on_host_threads_matches_reference");
    // cfg 0: gemma3 4/1/256 bf16; 1: generic bf16; 2: Qwen3-8B 32/8/128 bf16; 3: generic f32.
    // The argument after n_split: the split count that first uses the workspace (sized for it).
    attn_case(bin, &mut rng, 0, 256, 4, 1, 16, 3, 3, &[49], false); // window, splits
    attn_case(bin, &mut rng, 0, 256, 4, 1, 0, 3, 3, &[0], false); // one key, empty splits
    attn_case(bin, &mut rng, 1, 256, 4, 1, 512, 2, 2, &[70], false); // window longer than the context
    attn_case(bin, &mut rng, 2, 128, 32, 8, 0, 1, 1, &[69], false);
    attn_case(bin, &mut rng, 2, 128, 32, 8, 0, 2, 2, &[37, 3], false); // a batch
    attn_case(bin, &mut rng, 1, 256, 6, 2, 5, 2, 2, &[20], false); // group of 3
    attn_case(bin, &mut rng, 1, 128, 16, 2, 0, 1, 1, &[30], false); // group of 8: two head groups
    attn_case(bin, &mut rng, 1, 64, 16, 1, 0, 2, 2, &[40], false);
    attn_case(bin, &mut rng, 3, 256, 4, 1, 0, 1, 1, &[40], true);
    attn_case(bin, &mut rng, 3, 64, 2, 1, 0, 3, 3, &[40], true);
    // A workspace sized for and first used by more splits (the decoder's global layers before
    // its sliding-window ones; the GPU tests' split sweeps).
    attn_case(bin, &mut rng, 0, 256, 4, 1, 0, 2, 5, &[60], false);
    attn_case(bin, &mut rng, 0, 256, 4, 1, 16, 1, 4, &[45], false); // then a single split
    attn_case(bin, &mut rng, 2, 128, 32, 8, 0, 2, 3, &[37, 11], false); // a batch
    attn_case(bin, &mut rng, 1, 128, 16, 2, 0, 3, 6, &[50], false); // two head groups
    attn_case(bin, &mut rng, 3, 64, 2, 1, 0, 2, 4, &[33], true);
    // Fewer heads a block (HEADS_PER_BLOCK): 4: gemma3 on 2 blocks; 5: generic, 2 a block
    // (groups of 3 and 4: a block of 2 and one of 1 or 2); 6: generic, 1 a block.
    attn_case(bin, &mut rng, 4, 256, 4, 1, 16, 3, 3, &[49], false);
    attn_case(bin, &mut rng, 5, 256, 6, 2, 5, 2, 2, &[20], false);
    attn_case(bin, &mut rng, 5, 128, 32, 8, 0, 2, 3, &[37, 11], false);
    attn_case(bin, &mut rng, 6, 64, 16, 1, 0, 2, 2, &[40], false);
}

#[test]
fn attn_decode_rope_emulated_on_host_threads_matches_reference() {
    let Some(bin) = emulator() else {
        eprintln!("SKIP attn_decode_rope_emulated_on_host_threads_matches_reference: no C++20 compiler");
        return;
    };
    let mut rng = Rng::from_env_or_time("attn_decode_rope_emulated_on_host_threads_matches_reference");
    // cfg 0: gemma3 4/1/256 NeoX, per-head norm, bf16; 1: generic NeoX, full norm, bf16;
    // 2: generic interleaved, no norm, f32 cache; 3 and 4: below.
    let gemma = RopeCase { cfg: 0, hd: 256, nh: 4, nkv: 1, n_rot: 256, mode: Some(RopeMode::Neox), norm: "per_head", f32_cache: false };
    rope_case(bin, &mut rng, &gemma, 16, 3, &[49]); // window; the new row in the last split
    rope_case(bin, &mut rng, &gemma, 0, 3, &[0]); // the new row is the only key; empty splits
    rope_case(bin, &mut rng, &gemma, 0, 1, &[21, 5]); // a batch, one split
    let full = RopeCase { cfg: 1, hd: 128, nh: 16, nkv: 2, n_rot: 64, mode: Some(RopeMode::Neox), norm: "full", f32_cache: false };
    rope_case(bin, &mut rng, &full, 0, 2, &[30]); // two head groups: group 0 writes the row
    let full_small = RopeCase { cfg: 1, hd: 64, nh: 6, nkv: 2, n_rot: 64, ..full };
    rope_case(bin, &mut rng, &full_small, 7, 2, &[12, 40]); // group of 3, a window
    let plain = RopeCase { cfg: 2, hd: 128, nh: 8, nkv: 8, n_rot: 32, mode: Some(RopeMode::Norm), norm: "none", f32_cache: true };
    rope_case(bin, &mut rng, &plain, 0, 2, &[17]);
    // Fewer heads a block: 3: gemma3 on 2 blocks (only head group 0's block writes the new row);
    // 4: generic, 1 head a block.
    let gemma_two = RopeCase { cfg: 3, ..gemma };
    rope_case(bin, &mut rng, &gemma_two, 16, 3, &[49]);
    rope_case(bin, &mut rng, &gemma_two, 0, 1, &[21, 5]);
    let full_one = RopeCase { cfg: 4, ..full };
    rope_case(bin, &mut rng, &full_one, 0, 2, &[30]);
}

#[test]
fn mla_decode_emulated_on_host_threads_matches_reference() {
    let Some(bin) = emulator() else {
        eprintln!("SKIP mla_decode_emulated_on_host_threads_matches_reference: no C++20 compiler");
        return;
    };
    let mut rng = Rng::from_env_or_time("mla_decode_emulated_on_host_threads_matches_reference");
    // cfg 0: GLM-5 64 heads 512 + 64 bf16; 1: generic bf16; 2: generic f32.
    // The last argument but one: the split count that first uses the workspace (sized for it).
    mla_case(bin, &mut rng, 0, 64, 512, 64, 40, 2, 2, false); // a partial last tile, two splits
    mla_case(bin, &mut rng, 0, 64, 512, 64, 1, 3, 3, false); // one row, empty splits
    mla_case(bin, &mut rng, 1, 16, 512, 64, 37, 1, 1, false); // fewer heads than a block
    mla_case(bin, &mut rng, 1, 128, 512, 64, 20, 2, 2, false); // two head blocks
    mla_case(bin, &mut rng, 2, 64, 256, 32, 19, 2, 2, true);
    // A workspace sized for and first used by more splits (the GPU tests' split sweeps).
    mla_case(bin, &mut rng, 1, 64, 512, 64, 90, 3, 6, false);
    mla_case(bin, &mut rng, 0, 64, 512, 64, 50, 2, 4, false);
    mla_case(bin, &mut rng, 2, 128, 128, 32, 30, 2, 3, true); // two head blocks
    // Tensor-core path: several 64-row tiles per block (the last partial), run-time dims with a
    // row of 288 (pitch 320) and of 136 (a half k-step of zeros), 40 heads (zero-padded m-tiles).
    mla_case(bin, &mut rng, 0, 64, 512, 64, 150, 1, 1, false);
    mla_case(bin, &mut rng, 1, 64, 256, 32, 130, 2, 2, false);
    mla_case(bin, &mut rng, 1, 40, 128, 8, 70, 1, 2, false);
}
