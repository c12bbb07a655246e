//! CPU emulation of the DeepSeek Sparse Attention kernels (dsa_indexer, dsa_topk,
//! mla_sparse_decode): the templates compiled as host C++ on std::threads with the shared
//! stand-ins (emu_common: barriers, warp exchange; mma_host: mma.sync m16n8k16 fragments) plus
//! the few built-ins only these kernels use (ballot, match_any, shfl_up), compared with
//! memra-reference on fresh random inputs (seed printed; replay with `MEMRA_SEED=<seed>`),
//! NaN-poisoned outputs. Checks the fragment layouts and K-permutation of the indexer, the radix
//! select and ordered compaction of top-k (exact list equality with `dsa::top_k`, ties
//! included), and the row list of the sparse attention; nothing about speed or memory ordering.
//! Skips (one SKIP line) without a C++20 compiler.

mod emu_common;
mod mla_common;
mod mma_host;

use emu_common::{Builder, cut, f32_bytes, i32_bytes, random_cache, read_f32, read_i32, splice, template};
use memra_engine::kernels::mla_decode;
use memra_reference::attention::{AttnShape, Mask, attention};
use memra_reference::dsa::{IndexerDims, indexer_scores, top_k};
use memra_reference::norm::layer_norm;
use memra_reference::rope::{Rope, RopeMode, rope_head};
use memra_reference::{Rng, rel_err};
use mla_common::{Query, mla_reference, random_rows};

/// Built-ins the DSA kernels use beyond emu_common's prelude.
const EXTRA: &str = r#"
#include <atomic>
#include <algorithm>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#define __shared__ static
#define __global__
#define __launch_bounds__(x)
using std::min; using std::max;
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return float2{a, b}; }
static inline unsigned __ballot_sync(unsigned, int pred) {
    int t = threadIdx.x; g_xchg[t] = pred != 0; __syncwarp(); unsigned r = 0;
    for (int l = 0; l < 32; ++l) if (g_xchg[(t & ~31) | l]) r |= 1u << l; __syncwarp(); return r; }
static inline unsigned __match_any_sync(unsigned, unsigned v) {
    int t = threadIdx.x; g_xchg[t] = v; __syncwarp(); unsigned r = 0;
    for (int l = 0; l < 32; ++l) if (g_xchg[(t & ~31) | l] == v) r |= 1u << l; __syncwarp(); return r; }
static inline unsigned __shfl_sync(unsigned, unsigned v, int src) {
    int t = threadIdx.x; g_xchg[t] = v; __syncwarp(); unsigned r = (unsigned)g_xchg[(t & ~31) | (src & 31)]; __syncwarp(); return r; }
static inline unsigned __shfl_up_sync(unsigned, unsigned v, int o) {
    int t = threadIdx.x; g_xchg[t] = v; __syncwarp(); unsigned r = (t & 31) >= o ? (unsigned)g_xchg[t - o] : v; __syncwarp(); return r; }
static inline int __popc(unsigned v) { return __builtin_popcount(v); }
static inline int __ffs(unsigned v) { return __builtin_ffs((int)v); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
// glibc's math.h declares __sincosf (extern, noexcept): define that declaration.
void __sincosf(float x, float* s, float* c) noexcept { *s = std::sin(x); *c = std::cos(x); }
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
static inline double __hiloint2double(int hi, int lo) { uint64_t b = ((uint64_t)(unsigned)hi << 32) | (unsigned)lo; double d; memcpy(&d, &b, 8); return d; }
namespace memra {
enum class CacheType : int { F32 = 0, BF16 = 1 };
enum class RopeMode : int { None = 0, Interleaved = 1, Neox = 2 };
inline u16 f32_to_bf16(float f) { u32 u; memcpy(&u, &f, 4); return (u16)((u + 0x7fff + ((u >> 16) & 1)) >> 16); }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
}
"#;

const MAIN: &str = r#"
using namespace memra;
template <int NH, int HD, CacheType C, int TH> struct ICfg { static constexpr int N_IDX_HEAD = NH, IDX_HEAD_DIM = HD; static constexpr CacheType CACHE_T = C; static constexpr int THREADS = TH; };
template <int KK, int TH> struct TCfg { static constexpr int K = KK; static constexpr int THREADS = TH; };
template <int NH, int KVL, int RP, CacheType C> struct MCfg { static constexpr int N_HEAD = NH, KV_LORA = KVL, ROPE = RP; static constexpr CacheType CACHE_T = C; static constexpr int THREADS = 256; };
// idx:    0 cfg n_q nh hd max_ctx ld n_blk | q w k pos out
// topk:   1 cfg n_q ld k n_blk             | scores pos idx count
// sparse: 2 cfg nh kvl rope max_ctx idx_cap n_split work_split work_floats scale | q c idx count out
// key:    3 cfg n_tokens hd n_rot k_stride max_ctx freq_base freq_scale eps | k w b pos cache(out)
template <int HD, int NR, RopeMode M, CacheType C, int TH> struct KCfg { static constexpr int HEAD_DIM = HD, N_ROT = NR; static constexpr RopeMode ROPE_MODE = M; static constexpr CacheType CACHE_T = C; static constexpr int THREADS = TH; };
template <class K> void run_key(int n_tokens, int hd, int n_rot, int k_stride, int max_ctx, float base, float fscale, float eps, int eb, char** f) {
    auto k = slurp(f[0]), w = slurp(f[1]), b = slurp(f[2]), pos = slurp(f[3]);
    std::vector<unsigned char> cache((size_t)max_ctx * hd * eb, 0xff);
    int warps = K::THREADS / 32, blocks = std::max(1, std::min(3, (n_tokens + warps - 1) / warps));
    run_grid({(unsigned)blocks, 1, 1}, K::THREADS, 0, [&] {
        dsa_index_key_impl<K>((const float*)k.data(), (const float*)w.data(), (const float*)b.data(), (const int*)pos.data(), cache.data(), n_tokens, hd, n_rot, k_stride, max_ctx, base, fscale, eps); });
    spit(f[4], cache.data(), cache.size());
}
template <class K> void run_idx(int n_q, int nh, int hd, int max_ctx, int ld, int n_blk, char** f) {
    auto q = slurp(f[0]), w = slurp(f[1]), k = slurp(f[2]), pos = slurp(f[3]);
    std::vector<float> out((size_t)n_q * ld, NAN);
    run_grid({(unsigned)n_blk, (unsigned)n_q, 1}, K::THREADS, 0, [&] {
        dsa_indexer_impl<K>((const float*)q.data(), (const float*)w.data(), k.data(), (const int*)pos.data(), out.data(), n_q, nh, hd, max_ctx, ld); });
    spit(f[4], out.data(), out.size() * 4);
}
// Memory every block process sees (outputs, scratch): MAP_SHARED, poisoned with `fill`.
template <class T> static T* shared_buf(size_t n, unsigned char fill) {
    void* p = mmap(nullptr, n * sizeof(T) + 64, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) { perror("mmap"); exit(2); }
    memset(p, fill, n * sizeof(T) + 64); return (T*)p; }
// A grid whose blocks wait for each other (dsa_topk's row barrier): every block runs at once, in
// its own process (the template's __shared__ statics and the block barriers stay per block).
static void run_grid_concurrent(Dim3 grid, int threads, unsigned smem, const std::function<void()>& body) {
    std::vector<pid_t> kids;
    for (unsigned by = 0; by < grid.y; ++by) for (unsigned bx = 0; bx < grid.x; ++bx) {
        fflush(nullptr);
        pid_t pid = fork();
        if (pid < 0) { perror("fork"); exit(2); }
        if (pid == 0) {
            std::vector<unsigned char> sm(smem + 64, 0xCD);
            std::barrier<> block_bar(threads); g_block_barrier = &block_bar;
            std::vector<std::barrier<>*> wb; for (int i = 0; i < threads / 32; ++i) wb.push_back(new std::barrier<>(32));
            g_warp_barriers = wb; g_xchg.assign(threads, 0);
            std::vector<std::thread> ts;
            for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] {
                threadIdx = {(unsigned)t, 0, 0}; blockIdx = {bx, by, 0}; gridDim = grid; g_smem = sm.data(); g_smem_bytes = smem; body(); });
            for (auto& th : ts) th.join();
            _exit(0);
        }
        kids.push_back(pid);
    }
    for (pid_t pid : kids) { int st = 0; waitpid(pid, &st, 0); if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) { fprintf(stderr, "block process failed (%d)\n", st); exit(3); } }
}
// Two launches on one scratch (zeroed once): the second must find it as the first left it (zero)
// and give the same lists.
template <class K> void run_topk(int n_q, int ld, int k, int n_blk, char** f) {
    auto sc = slurp(f[0]), pos = slurp(f[1]);
    const size_t sw = n_blk > 1 ? (size_t)n_q * dsa_topk_detail::row_words(n_blk) : 0;
    unsigned* scratch = shared_buf<unsigned>(sw + 16, 0);
    for (size_t i = sw; i < sw + 16; ++i) scratch[i] = 0xdeadbeefu;  // guard words
    int* idx = shared_buf<int>((size_t)n_q * k, 0);
    int* count = shared_buf<int>(n_q, 0);
    std::vector<int> first;
    for (int launch = 0; launch < 2; ++launch) {
        std::fill(idx, idx + (size_t)n_q * k, -7);
        std::fill(count, count + n_q, -7);
        auto body = [&] { dsa_topk_impl<K>((const float*)sc.data(), (const int*)pos.data(), idx, count, n_blk > 1 ? scratch : nullptr, n_q, ld, k); };
        if (n_blk > 1) run_grid_concurrent({(unsigned)n_blk, (unsigned)n_q, 1}, K::THREADS, 0, body);
        else run_grid({1, (unsigned)n_q, 1}, K::THREADS, 0, body);
        for (size_t i = 0; i < sw; ++i) if (scratch[i] != 0) { fprintf(stderr, "launch %d left scratch[%zu] = %u\n", launch, i, scratch[i]); exit(3); }
        for (size_t i = sw; i < sw + 16; ++i) if (scratch[i] != 0xdeadbeefu) { fprintf(stderr, "scratch written past its size\n"); exit(3); }
        std::vector<int> all(idx, idx + (size_t)n_q * k); all.insert(all.end(), count, count + n_q);
        if (launch == 0) first = all;
        else if (all != first) { fprintf(stderr, "the second launch gave other lists\n"); exit(3); }
    }
    spit(f[2], idx, (size_t)n_q * k * 4);
    spit(f[3], count, (size_t)n_q * 4);
}
// The workspace (work_floats slots, the wrapper's size for work_split) is first used by a launch
// with work_split splits, then by two with n_split: one workspace serves every split count up to
// the one it was sized for, as callers reuse it.
template <class K> void run_sparse(int nh, int kvl, int rope, int max_ctx, int idx_cap, int n_split, int work_split, int work_floats, float scale, int eb, char** f) {
    auto q = slurp(f[0]), c = slurp(f[1]), ix = slurp(f[2]), cnt = slurp(f[3]);
    // 16 guard slots past the wrapper's size: the kernel must not touch them.
    std::vector<float> out((size_t)nh * kvl);
    // Shared with the block processes of the phase-3 launch.
    float* work = shared_buf<float>((size_t)work_floats + 16, 0);
    std::fill(work + work_floats, work + work_floats + 16, -7.0f);
    int D = kvl + rope;
    // bf16: the tensor-core form (Q, two 64-row tiles, P; rows of D rounded up to 64); f32: CUDA cores.
    unsigned smem = eb == 2 ? (64 + 128) * ((D + 63) / 64 * 128) + 64 * 128 + 1536
                            : std::min(nh, 64) * (D + 4) * 4 + 2 * 8 * (D * eb + 16) + 8 * 256 + 768;
    const int splits[3] = {work_split, n_split, n_split};
    for (int s : splits) {
        std::fill(out.begin(), out.end(), NAN);
        run_grid({(unsigned)s, (unsigned)((nh + 63) / 64), 1}, 256, smem, [&] {
            mla_sparse_decode_impl<K>((const float*)q.data(), c.data(), (const int*)ix.data(), (const int*)cnt.data(), out.data(), work, nh, kvl, rope, max_ctx, idx_cap, s, scale, 0, 1); });
    }
    // Phases 1 (partials) + 2 (merge over 3 blocks per head block): the same bits as phase 0.
    if (n_split > 1) {
        std::vector<float> two(out.size(), NAN);
        run_grid({(unsigned)n_split, (unsigned)((nh + 63) / 64), 1}, 256, smem, [&] {
            mla_sparse_decode_impl<K>((const float*)q.data(), c.data(), (const int*)ix.data(), (const int*)cnt.data(), two.data(), work, nh, kvl, rope, max_ctx, idx_cap, n_split, scale, 1, 1); });
        run_grid({3, (unsigned)((nh + 63) / 64), 1}, 256, mla_detail::merge_smem_bytes(n_split), [&] {
            mla_sparse_decode_impl<K>((const float*)q.data(), c.data(), (const int*)ix.data(), (const int*)cnt.data(), two.data(), work, nh, kvl, rope, max_ctx, idx_cap, n_split, scale, 2, 1); });
        if (memcmp(two.data(), out.data(), out.size() * 4) != 0) { fprintf(stderr, "phases 1 + 2 differ from phase 0\n"); exit(3); }
        // Phase 3: partials, a barrier per head block, the merge spread over the blocks (which
        // therefore run at once), in one launch: the same bits again.
        float* three = shared_buf<float>(out.size(), 0);
        std::fill(three, three + out.size(), NAN);
        run_grid_concurrent({(unsigned)n_split, (unsigned)((nh + 63) / 64), 1}, 256, smem, [&] {
            mla_sparse_decode_impl<K>((const float*)q.data(), c.data(), (const int*)ix.data(), (const int*)cnt.data(), three, work, nh, kvl, rope, max_ctx, idx_cap, n_split, scale, 3, 1); });
        if (memcmp(three, out.data(), out.size() * 4) != 0) { fprintf(stderr, "phase 3 differs from phase 0\n"); exit(3); }
    }
    // Counters (and their padding) at the front, back at zero.
    const unsigned* ctr = (const unsigned*)work;
    for (int i = 0; i < ((nh + 63) / 64 + 3) / 4 * 4; ++i) if (ctr[i] != 0) { fprintf(stderr, "counter %d left at %u\n", i, ctr[i]); exit(3); }
    for (int i = work_floats; i < work_floats + 16; ++i) if (work[i] != -7.0f) { fprintf(stderr, "work[%d] written past the wrapper's size\n", i); exit(3); }
    spit(f[4], out.data(), out.size() * 4);
}
// n_q queries, query j over idx[j·idx_cap ..][..cnt[j]], in one launch (phase 0 when n_split = 1,
// else phases 1 + 2 with grid z = n_q) must give the bits of n_q one-query launches; phases 0
// and 3 with several queries and splits (the counters serve one query) must write NaN.
template <class K> void sparse_batch(int nh, int kvl, int rope, int max_ctx, int idx_cap, int n_split, int n_q, int work_floats, float scale, int eb, char** f) {
    auto q = slurp(f[0]), c = slurp(f[1]), ix = slurp(f[2]), cn = slurp(f[3]);
    const int* idx = (const int*)ix.data();
    const int* cnt = (const int*)cn.data();
    const size_t per_q = (size_t)nh * kvl, D = kvl + rope;
    std::vector<float> out(n_q * per_q, NAN), one(n_q * per_q, NAN), work((size_t)work_floats + 16, 0.0f);
    std::fill(work.begin() + work_floats, work.end(), -7.0f);
    unsigned smem = eb == 2 ? (64 + 128) * ((D + 63) / 64 * 128) + 64 * 128 + 1536
                            : std::min(nh, 64) * (D + 4) * 4 + 2 * 8 * (D * eb + 16) + 8 * 256 + 768;
    const unsigned hbs = (nh + 63) / 64;
    auto launch = [&](const float* qq, const int* ii, const int* cc, float* o, int nq) {
        if (n_split == 1) {
            run_grid({1, hbs, (unsigned)nq}, 256, smem, [&] { mla_sparse_decode_impl<K>(qq, c.data(), ii, cc, o, work.data(), nh, kvl, rope, max_ctx, idx_cap, 1, scale, 0, nq); });
            return;
        }
        run_grid({(unsigned)n_split, hbs, (unsigned)nq}, 256, smem, [&] { mla_sparse_decode_impl<K>(qq, c.data(), ii, cc, o, work.data(), nh, kvl, rope, max_ctx, idx_cap, n_split, scale, 1, nq); });
        run_grid({3, hbs, (unsigned)nq}, 256, mla_detail::merge_smem_bytes(n_split), [&] { mla_sparse_decode_impl<K>(qq, c.data(), ii, cc, o, work.data(), nh, kvl, rope, max_ctx, idx_cap, n_split, scale, 2, nq); });
    };
    launch((const float*)q.data(), idx, cnt, out.data(), n_q);
    for (int j = 0; j < n_q; ++j) launch((const float*)q.data() + j * nh * D, idx + j * idx_cap, cnt + j, one.data() + j * per_q, 1);
    if (memcmp(one.data(), out.data(), out.size() * 4) != 0) { fprintf(stderr, "batched launch differs from one launch per query\n"); exit(3); }
    if (n_split > 1 && n_q > 1) {
        for (int ph : {0, 3}) {
            std::vector<float> refused(out.size(), 0.0f);
            run_grid({(unsigned)n_split, hbs, (unsigned)n_q}, 256, smem, [&] {
                mla_sparse_decode_impl<K>((const float*)q.data(), c.data(), idx, cnt, refused.data(), work.data(), nh, kvl, rope, max_ctx, idx_cap, n_split, scale, ph, n_q); });
            for (float v : refused) if (!std::isnan(v)) { fprintf(stderr, "phase %d over several queries did not write NaN\n", ph); exit(3); }
        }
    }
    const unsigned* ctr = (const unsigned*)work.data();
    for (int i = 0; i < ((nh + 63) / 64 + 3) / 4 * 4; ++i) if (ctr[i] != 0) { fprintf(stderr, "counter %d left at %u\n", i, ctr[i]); exit(3); }
    for (int i = work_floats; i < work_floats + 16; ++i) if (work[i] != -7.0f) { fprintf(stderr, "work[%d] written past the wrapper's size\n", i); exit(3); }
    spit(f[4], out.data(), out.size() * 4);
}
int main(int argc, char** argv) {
    using B = CacheType;
    int kind = atoi(argv[1]), cfg = atoi(argv[2]);
    int a[8] = {0}; for (int i = 0; i < 8 && 3 + i < argc; ++i) a[i] = atoi(argv[3 + i]);
    if (kind == 0) {
        char** f = argv + 9;
        switch (cfg) {
        case 0: run_idx<ICfg<32, 128, B::BF16, 256>>(a[0], a[1], a[2], a[3], a[4], a[5], f); break;
        case 1: run_idx<ICfg<0, 0, B::BF16, 256>>(a[0], a[1], a[2], a[3], a[4], a[5], f); break;
        case 2: run_idx<ICfg<0, 0, B::F32, 256>>(a[0], a[1], a[2], a[3], a[4], a[5], f); break;
        case 3: run_idx<ICfg<32, 128, B::F32, 64>>(a[0], a[1], a[2], a[3], a[4], a[5], f); break;
        default: return 4;
        }
    } else if (kind == 1) {
        char** f = argv + 7;
        switch (cfg) {
        case 0: run_topk<TCfg<0, 256>>(a[0], a[1], a[2], a[3], f); break;
        case 1: run_topk<TCfg<0, 1024>>(a[0], a[1], a[2], a[3], f); break;
        case 2: run_topk<TCfg<64, 256>>(a[0], a[1], a[2], a[3], f); break;
        case 3: run_topk<TCfg<0, 512>>(a[0], a[1], a[2], a[3], f); break;
        default: return 4;
        }
    } else if (kind == 3) {
        float base = (float)atof(argv[8]), fs = (float)atof(argv[9]), eps = (float)atof(argv[10]);
        char** f = argv + 11;
        using R = RopeMode;
        switch (cfg) {
        case 0: run_key<KCfg<128, 64, R::Interleaved, B::F32, 128>>(a[0], a[1], a[2], a[3], a[4], base, fs, eps, 4, f); break;
        case 1: run_key<KCfg<0, 0, R::Neox, B::F32, 64>>(a[0], a[1], a[2], a[3], a[4], base, fs, eps, 4, f); break;
        case 2: run_key<KCfg<128, 64, R::Interleaved, B::BF16, 128>>(a[0], a[1], a[2], a[3], a[4], base, fs, eps, 2, f); break;
        default: return 4;
        }
    } else if (kind == 4) {
        // kind=4 cfg nh kvl rope max_ctx idx_cap n_split n_q work_floats scale q c idx cnt out
        int b[8]; for (int i = 0; i < 8; ++i) b[i] = atoi(argv[3 + i]);
        float scale = (float)atof(argv[11]);
        char** f = argv + 12;
        switch (cfg) {
        case 0: sparse_batch<MCfg<64, 512, 64, B::BF16>>(b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], scale, 2, f); break;
        case 1: sparse_batch<MCfg<0, 0, 0, B::BF16>>(b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], scale, 2, f); break;
        case 2: sparse_batch<MCfg<0, 0, 0, B::F32>>(b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], scale, 4, f); break;
        default: return 4;
        }
    } else {
        float scale = (float)atof(argv[11]);
        char** f = argv + 12;
        switch (cfg) {
        case 0: run_sparse<MCfg<64, 512, 64, B::BF16>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], scale, 2, f); break;
        case 1: run_sparse<MCfg<0, 0, 0, B::BF16>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], scale, 2, f); break;
        case 2: run_sparse<MCfg<0, 0, 0, B::F32>>(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], scale, 4, f); break;
        default: return 4;
        }
    }
    return 0;
}
"#;

fn strip(t: String) -> String {
    t.replace("#pragma once", "")
        .replace("#include \"memra/common.cuh\"", "")
        .replace("#include \"memra/mla_decode.cuh\"", "")
}

fn emulator_source() -> String {
    let common = template("common.cuh");
    let order_bits = cut(
        &common,
        "__device__ __forceinline__ u32 float_order_bits(",
        "__device__ __forceinline__ float order_bits_float(",
        "common.cuh",
    );
    let mut indexer = strip(template("dsa_indexer.cuh"));
    let host_ptx = format!(
        "{}\ninline void mma_bf16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {{ const u32 a[4] = {{a0, a1, a2, a3}}; bf16_16816(d, a, b0, b1); }}\ninline uint4 ldg16(const void* p) {{ uint4 r; memcpy(&r, p, 16); return r; }}\n",
        mma_host::FNS
    );
    indexer = splice(
        &indexer,
        "__device__ __forceinline__ u32 pack_bf16x2(",
        "// (x, y) -> bf16x2",
        &host_ptx,
        "dsa_indexer.cuh",
    );
    indexer = splice(
        &indexer,
        "__device__ __forceinline__ void mma_bf16(",
        "// First of the four contiguous dims",
        "",
        "dsa_indexer.cuh",
    );
    let topk = strip(template("dsa_topk.cuh"));
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
    let sparse = strip(template("mla_sparse_decode.cuh"));
    let common_parts = [
        (
            "// Store one f32 as the cache element type.",
            "// Compile-time-or-run-time dims",
        ),
        ("// 2^x in f64", "// Reductions."),
        (
            "__device__ __forceinline__ float warp_sum(",
            "__device__ __forceinline__ float warp_max(",
        ),
    ]
    .map(|(a, b)| cut(&common, a, b, "common.cuh"))
    .join("\n");
    let key = strip(template("dsa_index_key.cuh"));
    // glibc 2.36's math.h declares __expf extern, so g++ 12 rejects a static one; unused here.
    let prelude = emu_common::PRELUDE.replace(
        "static inline float __expf(float x) { return std::exp(x); }",
        "",
    );
    format!(
        "{prelude}\n{EXTRA}\n{}\nnamespace memra {{\n{order_bits}\n{common_parts}\n{}}}\n{indexer}\n{topk}\n{mla}\n{sparse}\n{key}\n{MAIN}",
        emu_common::GRID_RUNNER,
        emu_common::grid_scope()
    )
}

struct Emu {
    builder: Builder,
    bin: std::path::PathBuf,
    n: usize,
}

impl Emu {
    fn new(test: &str) -> Option<Emu> {
        let mut builder = Builder::new(test, "dsa", &emulator_source())?;
        let bin = builder.get(Vec::new());
        Some(Emu { builder, bin, n: 0 })
    }

    /// Writes `inputs` to files, runs the emulator with `args` + input paths + `outputs` paths.
    fn run(
        &mut self,
        args: &[String],
        inputs: &[Vec<u8>],
        outputs: usize,
    ) -> Vec<std::path::PathBuf> {
        self.n += 1;
        let dir = self.builder.dir().join(format!("case{}", self.n));
        std::fs::create_dir_all(&dir).expect("case dir");
        let mut all = args.to_vec();
        for (i, data) in inputs.iter().enumerate() {
            let p = dir.join(format!("in{i}.bin"));
            std::fs::write(&p, data).expect("write input");
            all.push(p.display().to_string());
        }
        let outs: Vec<_> = (0..outputs)
            .map(|i| dir.join(format!("out{i}.bin")))
            .collect();
        all.extend(outs.iter().map(|p| p.display().to_string()));
        emu_common::run(&self.bin, &all);
        outs
    }
}

fn strs(v: &[usize]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

#[allow(clippy::too_many_arguments)]
fn indexer_case(
    emu: &mut Emu,
    rng: &mut Rng,
    cfg: usize,
    nh: usize,
    hd: usize,
    positions: &[i64],
    max_ctx: usize,
    n_blk: usize,
    f32_cache: bool,
) {
    let n_q = positions.len();
    let ld = max_ctx + 3;
    let q = rng.normal_vec(n_q * nh * hd, 1.0);
    let w = rng.normal_vec(n_q * nh, 0.1);
    let (kb, kv) = random_cache(rng, max_ctx * hd, f32_cache);
    let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    let outs = emu.run(
        &strs(&[0, cfg, n_q, nh, hd, max_ctx, ld, n_blk]),
        &[f32_bytes(&q), f32_bytes(&w), kb, i32_bytes(&pos)],
        1,
    );
    let got = read_f32(&outs[0]);
    let dims = IndexerDims {
        n_head: nh,
        head_dim: hd,
        rope: 0,
    };
    for (t, &p) in positions.iter().enumerate() {
        let row = &got[t * ld..][..ld];
        let what = format!("dsa_indexer emulation cfg {cfg} {nh}x{hd} query {t} pos {p}");
        if p < 0 || p as usize >= max_ctx {
            assert!(row[..max_ctx].iter().all(|v| v.is_nan()), "{what}: not NaN");
            continue;
        }
        let n = p as usize + 1;
        let want = indexer_scores(
            &q[t * nh * hd..][..nh * hd],
            &w[t * nh..][..nh],
            &kv[..n * hd],
            dims,
            &[p as usize],
        );
        // Measured against the size of the summed terms Σ|w|·ReLU(q·k): a score's rounding
        // error scales with its terms, and a sum over signed head weights can cancel (one
        // visible key makes the relative L2 that single value's relative error).
        let w_abs: Vec<f32> = w[t * nh..][..nh].iter().map(|v| v.abs()).collect();
        let size = indexer_scores(
            &q[t * nh * hd..][..nh * hd],
            &w_abs,
            &kv[..n * hd],
            dims,
            &[p as usize],
        );
        let diff: f64 = row[..n]
            .iter()
            .zip(&want)
            .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let norm: f64 = size.iter().map(|m| (*m as f64).powi(2)).sum::<f64>().sqrt();
        let err = if norm > 0.0 { diff / norm } else { diff };
        assert!(
            err <= 1e-5 && row[..n].iter().all(|v| v.is_finite()),
            "{what}: error {err:e} of the summed terms' size (relative L2 {:e}) (MEMRA_SEED={})",
            rel_err(&row[..n], &want),
            rng.seed()
        );
        assert!(
            row[n..].iter().all(|v| v.is_nan()),
            "{what}: wrote past pos (MEMRA_SEED={})",
            rng.seed()
        );
    }
}

/// `rows`: (position, kind) with kind 0 normal scores, 1 a palette of exact ties (±0, ±∞), 2 all
/// equal, 3 distinct values in one top-11-bit bin; `n_blk` blocks per row (> 1: the blocks run concurrently and meet at barriers).
fn topk_case(emu: &mut Emu, rng: &mut Rng, cfg: usize, k: usize, n_blk: usize, rows: &[(i64, u8)]) {
    let ld = rows.iter().map(|r| r.0.max(0) as usize).max().unwrap() + 2;
    let palette = [
        -1.0f32,
        -0.0,
        0.0,
        0.5,
        2.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ];
    let mut scores = vec![f32::NAN; rows.len() * ld];
    for (t, &(p, kind)) in rows.iter().enumerate() {
        if p < 0 || p as usize >= ld {
            continue;
        }
        let row = &mut scores[t * ld..][..=p as usize];
        match kind {
            0 => row.copy_from_slice(&rng.normal_vec(p as usize + 1, 1.0)),
            1 => row
                .iter_mut()
                .for_each(|v| *v = palette[rng.below(palette.len())]),
            // All in one top-11-bit bin ([1, 1.125)): more candidates than the list holds.
            3 => row
                .iter_mut()
                .for_each(|v| *v = 1.0 + rng.below(1 << 20) as f32 / (1u32 << 23) as f32),
            _ => row.iter_mut().for_each(|v| *v = 3.0),
        }
    }
    let pos: Vec<i32> = rows.iter().map(|r| r.0 as i32).collect();
    let outs = emu.run(
        &strs(&[1, cfg, rows.len(), ld, k, n_blk]),
        &[f32_bytes(&scores), i32_bytes(&pos)],
        2,
    );
    let (idx, count) = (read_i32(&outs[0]), read_i32(&outs[1]));
    for (t, &(p, kind)) in rows.iter().enumerate() {
        let what =
            format!("dsa_topk emulation cfg {cfg} k {k} n_blk {n_blk} row {t} pos {p} kind {kind}");
        let got = &idx[t * k..][..k];
        if p < 0 || p as usize >= ld {
            assert_eq!(count[t], -1, "{what}");
            assert!(got.iter().all(|&i| i == -1), "{what}");
            continue;
        }
        let want = top_k(&scores[t * ld..][..=p as usize], k);
        assert_eq!(count[t] as usize, want.len(), "{what}: count");
        let sel: Vec<usize> = got[..want.len()].iter().map(|&i| i as usize).collect();
        assert_eq!(sel, want, "{what} (MEMRA_SEED={})", rng.seed());
        assert!(got[want.len()..].iter().all(|&i| i == -1), "{what}: tail");
    }
}

#[allow(clippy::too_many_arguments)]
fn sparse_case(
    emu: &mut Emu,
    rng: &mut Rng,
    cfg: usize,
    nh: usize,
    kvl: usize,
    rope: usize,
    p: usize,
    n_sel: usize,
    n_split: usize,
    work_split: usize,
    f32_cache: bool,
) {
    let d = kvl + rope;
    let max_ctx = p + 4;
    let q = rng.normal_vec(nh * d, 1.0);
    let (cb, cv) = random_cache(rng, max_ctx * d, f32_cache);
    // A random subset of 0..=p, in a random order (the kernel needs no order).
    let mut all: Vec<usize> = (0..=p).collect();
    for i in (1..all.len()).rev() {
        all.swap(i, rng.below(i + 1));
    }
    let sel: Vec<usize> = all[..n_sel].to_vec();
    let idx_cap = n_sel + 5;
    let mut idx: Vec<i32> = sel.iter().map(|&s| s as i32).collect();
    idx.resize(idx_cap, -1);
    let scale = 1.0f32 / 16.0;
    let work = mla_decode::work_floats(nh, kvl, n_split.max(work_split));
    let mut args = strs(&[
        2, cfg, nh, kvl, rope, max_ctx, idx_cap, n_split, work_split, work,
    ]);
    args.push(format!("{scale:e}"));
    let outs = emu.run(
        &args,
        &[
            f32_bytes(&q),
            cb,
            i32_bytes(&idx),
            i32_bytes(&[n_sel as i32]),
        ],
        1,
    );
    let got = read_f32(&outs[0]);
    let latent: Vec<f32> = (0..=p)
        .flat_map(|r| cv[r * d..][..kvl].iter().copied())
        .collect();
    let allowed = [sel];
    let q_pos = [p];
    let mask = Mask {
        q_pos: &q_pos,
        window: None,
        allowed: Some(&allowed),
    };
    let shape = AttnShape {
        n_head: nh,
        n_kv_head: 1,
        head_dim_k: d,
        head_dim_v: kvl,
    };
    let want = attention(&q, &cv[..(p + 1) * d], &latent, p + 1, shape, &mask, scale);
    let err = rel_err(&got, &want);
    // bf16 caches take the tensor-core path: q and P rounded to bf16, ≈ 2e-3 expected (the
    // argument at attn_host_emulation's TOL_TENSOR_CORES); f32 caches: f32 arithmetic.
    let tol = if f32_cache { 1e-5 } else { 1e-2 };
    eprintln!(
        "mla_sparse_decode emulation cfg {cfg} nh {nh} p {p} sel {n_sel}: relative L2 {err:.2e} (tolerance {tol:e})"
    );
    assert!(
        err <= tol,
        "mla_sparse_decode emulation cfg {cfg} nh {nh} p {p} sel {n_sel} split {n_split} (workspace first used by {work_split}): relative L2 {err:e} (MEMRA_SEED={})",
        rng.seed()
    );
}

/// Several query tokens in one sparse launch: query j at position `queries[j].0` over a random
/// `queries[j].1` of its visible rows (its own idx row and count).
#[allow(clippy::too_many_arguments)]
fn sparse_batch_case(
    emu: &mut Emu,
    rng: &mut Rng,
    cfg: usize,
    nh: usize,
    kvl: usize,
    rope: usize,
    queries: &[(usize, usize)],
    n_split: usize,
    f32_cache: bool,
) {
    let (d, n_q) = (kvl + rope, queries.len());
    let max_ctx = queries.iter().map(|q| q.0).max().unwrap() + 4;
    let q = rng.normal_vec(n_q * nh * d, 1.0);
    let (cb, cv) = random_cache(rng, max_ctx * d, f32_cache);
    let idx_cap = queries.iter().map(|q| q.1).max().unwrap() + 3;
    // Each query's rows in a random order (the kernel needs no order).
    let sels: Vec<Vec<usize>> = queries
        .iter()
        .map(|&(p, n_sel)| random_rows(rng, p, n_sel))
        .collect();
    let mut idx = vec![-1i32; n_q * idx_cap];
    for (j, sel) in sels.iter().enumerate() {
        for (k, &s) in sel.iter().enumerate() {
            idx[j * idx_cap + k] = s as i32;
        }
    }
    let counts: Vec<i32> = queries.iter().map(|q| q.1 as i32).collect();
    let scale = 1.0f32 / 16.0;
    let work = mla_decode::work_floats_batch(nh, kvl, n_split, n_q);
    let mut args = strs(&[
        4, cfg, nh, kvl, rope, max_ctx, idx_cap, n_split, n_q, work,
    ]);
    args.push(format!("{scale:e}"));
    let outs = emu.run(
        &args,
        &[
            f32_bytes(&q),
            cb,
            i32_bytes(&idx),
            i32_bytes(&counts),
        ],
        1,
    );
    let got = read_f32(&outs[0]);
    let refs: Vec<Query> = queries
        .iter()
        .zip(&sels)
        .map(|(&(pos, _), sel)| Query {
            pos,
            rows: Some(sel),
        })
        .collect();
    let want = mla_reference(&q, &cv, nh, kvl, rope, &refs, scale);
    let err = rel_err(&got, &want);
    let tol = if f32_cache { 1e-5 } else { 1e-2 };
    eprintln!(
        "mla_sparse_decode batch emulation cfg {cfg} nh {nh} queries {queries:?} split {n_split}: relative L2 {err:.2e} (tolerance {tol:e})"
    );
    assert!(
        err <= tol,
        "mla_sparse_decode batch emulation cfg {cfg} nh {nh} queries {queries:?} split {n_split}: relative L2 {err:e} (MEMRA_SEED={})",
        rng.seed()
    );
}

#[allow(clippy::too_many_arguments)]
fn key_case(
    emu: &mut Emu,
    rng: &mut Rng,
    cfg: usize,
    hd: usize,
    n_rot: usize,
    mode: RopeMode,
    positions: &[i64],
    max_ctx: usize,
    f32_cache: bool,
) {
    let n = positions.len();
    let k_stride = hd + 8;
    // An offset so that the mean subtraction matters.
    let k: Vec<f32> = rng
        .normal_vec(n * k_stride, 1.0)
        .iter()
        .map(|v| v + 0.7)
        .collect();
    let w = rng.normal_vec(hd, 1.0);
    let b = rng.normal_vec(hd, 0.5);
    let (base, eps) = (1e6f32, 1e-6f32);
    let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    let mut args = strs(&[3, cfg, n, hd, n_rot, k_stride, max_ctx]);
    args.extend([format!("{base:e}"), "1".to_string(), format!("{eps:e}")]);
    let outs = emu.run(
        &args,
        &[f32_bytes(&k), f32_bytes(&w), f32_bytes(&b), i32_bytes(&pos)],
        1,
    );
    let raw = std::fs::read(&outs[0]).expect("emulator output");
    let eb = if f32_cache { 4 } else { 2 };
    assert_eq!(
        raw.len(),
        max_ctx * hd * eb,
        "dsa_index_key emulation: cache size"
    );
    let row = |r: usize| -> Vec<f32> {
        raw[r * hd * eb..(r + 1) * hd * eb]
            .chunks_exact(eb)
            .map(|c| {
                if f32_cache {
                    f32::from_le_bytes([c[0], c[1], c[2], c[3]])
                } else {
                    f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)
                }
            })
            .collect()
    };
    let rope = Rope::new(mode, n_rot, base);
    let tol = if f32_cache { 1e-5 } else { 4e-3 };
    let mut written = vec![false; max_ctx];
    for (t, &p) in positions.iter().enumerate() {
        if p < 0 || p as usize >= max_ctx {
            continue;
        }
        let p = p as usize;
        written[p] = true;
        let mut want = layer_norm(&k[t * k_stride..][..hd], &w, &b, eps);
        rope_head(&mut want, p, &rope);
        let err = rel_err(&row(p), &want);
        assert!(
            err <= tol,
            "dsa_index_key emulation cfg {cfg} hd {hd} n_rot {n_rot} token {t} pos {p}: relative L2 {err:e} (MEMRA_SEED={})",
            rng.seed()
        );
    }
    for (r, _) in written.iter().enumerate().filter(|(_, w)| !**w) {
        assert!(
            raw[r * hd * eb..(r + 1) * hd * eb]
                .iter()
                .all(|&x| x == 0xff),
            "dsa_index_key emulation cfg {cfg}: row {r} written but no token has that position"
        );
    }
}

fn emulator(test: &str) -> Option<Emu> {
    let e = Emu::new(test);
    if e.is_some() {
        eprintln!("{test}: emulator built");
    }
    e
}

#[test]
fn dsa_kernels_emulated_on_host_threads_match_reference() {
    let test = "dsa_kernels_emulated_on_host_threads_match_reference";
    let Some(mut emu) = emulator(test) else {
        return;
    };
    let mut rng = Rng::from_env_or_time(test);
    let e = &mut emu;
    // Indexer. cfg 0: GLM-5 32×128 bf16; 1: generic bf16; 2: generic f32; 3: 32×128 f32, 2 warps.
    indexer_case(e, &mut rng, 0, 32, 128, &[69, 0, -1], 80, 2, false); // a batch, a bad position
    indexer_case(e, &mut rng, 0, 32, 128, &[100], 101, 1, false);
    indexer_case(e, &mut rng, 0, 32, 128, &[599, 300], 600, 1, false); // 19 tiles over 8 warps: the prefetch pipeline
    indexer_case(e, &mut rng, 1, 16, 64, &[40, 7], 41, 1, false);
    indexer_case(e, &mut rng, 2, 8, 32, &[50], 60, 1, true);
    indexer_case(e, &mut rng, 3, 32, 128, &[45, 80], 81, 1, true); // 64 threads: striding
    // Top-k. cfg 0: generic, 256 threads; 1: generic, 1024 threads; 2: k = 64, 256 threads;
    // 3: generic, 512 threads. One block per row, then several meeting at barriers.
    topk_case(
        e,
        &mut rng,
        2,
        64,
        1,
        &[(3000, 0), (3000, 1), (500, 2), (63, 0), (64, 1), (-1, 0)],
    );
    topk_case(
        e,
        &mut rng,
        0,
        100,
        1,
        &[(4999, 1), (2000, 0), (99, 1), (100, 2)],
    );
    topk_case(e, &mut rng, 1, 37, 1, &[(2500, 1), (1500, 0), (40, 2)]);
    topk_case(e, &mut rng, 2, 64, 3, &[(6000, 0), (5000, 1)]);
    topk_case(e, &mut rng, 0, 300, 4, &[(7000, 2)]); // ties across every block
    topk_case(e, &mut rng, 0, 300, 4, &[(9000, 1), (200, 0), (-1, 0)]);
    topk_case(e, &mut rng, 3, 2048, 3, &[(2048, 0), (2047, 1)]); // 2049 keys; all visible
    topk_case(e, &mut rng, 2, 64, 5, &[(100, 0)]); // blocks with empty chunks
    topk_case(e, &mut rng, 0, 300, 3, &[(9000, 3), (5000, 3)]); // candidate list overflows
    topk_case(e, &mut rng, 0, 300, 2, &[(20_000, 0)]); // one block's candidates alone
    // Sparse MLA. cfg 0: GLM-5 64 × (512 + 64) bf16; 1: generic bf16; 2: generic f32.
    // The last argument but one: the split count that first uses the workspace (sized for it).
    sparse_case(e, &mut rng, 0, 64, 512, 64, 90, 37, 2, 2, false);
    sparse_case(e, &mut rng, 0, 64, 512, 64, 20, 21, 3, 3, false); // every row, an empty split
    sparse_case(e, &mut rng, 1, 16, 256, 32, 60, 1, 1, 1, false);
    sparse_case(e, &mut rng, 2, 64, 256, 32, 40, 17, 2, 2, true);
    // A workspace sized for and used by more splits first (as the GPU test's split sweep does).
    sparse_case(e, &mut rng, 1, 64, 512, 64, 100, 80, 3, 7, false);
    sparse_case(e, &mut rng, 0, 64, 512, 64, 100, 80, 2, 5, false);
    sparse_case(e, &mut rng, 2, 128, 128, 32, 50, 40, 2, 3, true); // two head blocks
    sparse_case(e, &mut rng, 0, 64, 512, 64, 300, 150, 1, 1, false); // three 64-row tiles in one block
    // Several queries in one launch, each with its own idx row and count (prefill).
    sparse_batch_case(e, &mut rng, 0, 64, 512, 64, &[(0, 1), (80, 37), (40, 41)], 2, false);
    sparse_batch_case(e, &mut rng, 1, 40, 128, 8, &[(70, 65), (3, 2), (20, 9)], 1, false);
    sparse_batch_case(e, &mut rng, 2, 80, 128, 32, &[(30, 12), (9, 10)], 3, true); // two head blocks
    // Index-key producer. cfg 0: 128/64 interleaved f32; 1: generic NeoX f32 (2 warps); 2: bf16.
    let ri = RopeMode::Norm;
    key_case(
        e,
        &mut rng,
        0,
        128,
        64,
        ri,
        &[5, 0, 100_000, -1, 9],
        100_001,
        true,
    );
    key_case(
        e,
        &mut rng,
        1,
        96,
        32,
        RopeMode::Neox,
        &[3, 7, 2, 11, 4],
        12,
        true,
    );
    key_case(
        e,
        &mut rng,
        1,
        256,
        256,
        RopeMode::Neox,
        &[1000],
        1001,
        true,
    );
    key_case(e, &mut rng, 2, 128, 64, ri, &[40, 41, 12], 50, false);
    eprintln!("PASS {test} (MEMRA_SEED={})", rng.seed());
}
