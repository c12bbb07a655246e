// memra/dsa_indexer.cuh — DeepSeek Sparse Attention lightning indexer scores (model-specs §8.1,
// §8.4 step 7): score[t][s] = Σ_h w[t][h]·ReLU(q[t][h]·k[s]) for every visible key s ≤ pos[t],
// one key per token shared by all indexer heads.
//
// Cfg fields:
//   N_IDX_HEAD    int              indexer heads H_I (multiple of 8, ≤ 64); 0 = run time
//   IDX_HEAD_DIM  int              indexer head dim d_I (multiple of 32, ≤ 128); 0 = run time
//   CACHE_T       memra::CacheType index-key cache element type (BF16 or F32)
//   THREADS       int              threads per block (multiple of 32, ≤ 1024)
// Kernel parameters:
//   (const float* q, const float* w, const void* kcache, const int* pos, float* scores,
//    int n_q, int n_idx_head, int idx_head_dim, int max_ctx, int ld_scores)
//   q [n_q, H_I, d_I] f32 (16-byte aligned), w [n_q, H_I] f32 (the head weights, already scaled),
//   kcache [max_ctx, d_I] CACHE_T (16-byte aligned), pos [n_q] on the device, scores
//   [n_q, ld_scores] f32 (ld_scores ≥ max_ctx). Row t gets scores[t][0..=pos[t]]; the rest of
//   the row is not written. pos[t] ∉ [0, max_ctx) writes NaN to scores[t][0..max_ctx).
// Scheme: tensor cores (mma.sync m16n8k16 bf16 → f32) with tokens as M, heads as N, d_I as K.
//   A warp owns tiles of 16·MT tokens (MT = 2 for bf16, 1 for f32) and loads each key row once
//   with 16-byte loads straight into A fragments — the K order inside a k-step is permuted so
//   that a lane's four A elements of a row are contiguous, and q is staged in the same order —
//   then runs every head over it. q is split into bf16 hi + lo (2 MMAs per k-step, products
//   exact up to the 2^-16 relative size of the lo residual); an f32 key is split the same way
//   (3 MMAs: hi·hi, lo·hi, hi·lo). Accumulation is f32 in the MMA; ReLU and the head weights are
//   applied per 8-head tile, the 4 lanes of a token are reduced by shuffles. Software pipeline:
//   a warp's first tile is loaded before q is staged, and each tile's successor is loaded
//   before the tile is multiplied (two tiles of fragments in registers).
// Geometry: grid (n_blk, n_q) — any n_blk ≥ 1 (warps stride over the tiles; the wrapper uses
//   min(ceil(max_ctx / (16·MT·THREADS/32)), SMs): one block fills a multiprocessor's registers) — block THREADS, static shared memory
//   2·8·8·32·8 + 64·4 bytes (q fragments hi/lo, weights); no dynamic shared memory.
#pragma once
#include "memra/common.cuh"

namespace memra {
namespace dsa_detail {

constexpr int MAX_HEADS = 64;
constexpr int MAX_HD = 128;
constexpr int MAX_KS = MAX_HD / 16;   // k-steps of 16 dims
constexpr int MAX_NT = MAX_HEADS / 8;  // n-tiles of 8 heads

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// (x, y) -> bf16x2 hi and the bf16x2 of the residuals.
__device__ __forceinline__ void split2(float x, float y, u32& hi, u32& lo) {
    hi = pack_bf16x2(x, y);
    lo = pack_bf16x2(x - __uint_as_float(hi << 16), y - __uint_as_float(hi & 0xffff0000u));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// First of the four contiguous dims lane-in-group c holds in k-step ks. bf16: one 16-byte load
// (8 dims) serves k-steps 2L and 2L+1; f32: one load (4 dims) per k-step.
template <CacheType C> __device__ __forceinline__ int dim_of(int ks, int c) {
    if constexpr (C == CacheType::BF16) {
        return (ks >> 1) * 32 + c * 8 + (ks & 1) * 4;
    } else {
        return ks * 16 + c * 4;
    }
}

template <CacheType C, int NHC, int HDC, int THREADS>
__device__ __forceinline__ void indexer(const float* __restrict__ q, const float* __restrict__ w,
                                        const void* __restrict__ kcache, const int* __restrict__ pos,
                                        float* __restrict__ scores, int nh_rt, int hd_rt, int max_ctx, int ld) {
    constexpr bool BF = C == CacheType::BF16;
    constexpr int MT = BF ? 2 : 1;         // 16-token m-tiles per warp tile
    constexpr int LPR = BF ? MAX_KS / 2 : MAX_KS;  // 16-byte loads per row and lane
    constexpr int WARPS = THREADS / WARP_SIZE;
    constexpr int EB = BF ? 2 : 4;
    const int nh = dim_or<NHC>(nh_rt), hd = dim_or<HDC>(hd_rt);
    const int KS = hd / 16, NT = nh / 8;
    const int t = blockIdx.y;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int g = lane >> 2, c = lane & 3;

    __shared__ __align__(16) uint2 q_hi[MAX_KS * MAX_NT * WARP_SIZE];
    __shared__ __align__(16) uint2 q_lo[MAX_KS * MAX_NT * WARP_SIZE];
    __shared__ float w_s[MAX_HEADS];

    float* row_out = scores + (i64)t * ld;
    const int p = pos[t];
    if (p < 0 || p >= max_ctx) {
        for (i64 i = (i64)blockIdx.x * THREADS + tid; i < max_ctx; i += (i64)gridDim.x * THREADS)
            row_out[i] = __int_as_float(0x7fc00000);
        return;
    }
    const int n_rows = p + 1;
    constexpr int RPT = 16 * MT;  // rows per warp tile
    const int n_tiles = (n_rows + RPT - 1) / RPT;
    if ((int)blockIdx.x * WARPS >= n_tiles) return;  // no tile for this block: skip the q staging

    const char* kb = static_cast<const char*>(kcache);
    // A fragments of tile `tl`: rows tl·RPT + mt·16 + {g, g + 8}, rows past n_rows (and tiles past
    // the last) as zeros; every load is issued before any use.
    auto load_tile = [&](int tl, uint4 (&a)[MT][2][LPR]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int r = tl * RPT + mt * 16 + hf * 8 + g;
                const char* src = kb + (i64)r * hd * EB;
#pragma unroll
                for (int l = 0; l < LPR; ++l) {
                    const int ks = BF ? 2 * l : l;
                    if (ks < KS && r < n_rows) {
                        a[mt][hf][l] = ldg16(src + dim_of<C>(ks, c) * EB);
                    } else {
                        a[mt][hf][l] = make_uint4(0u, 0u, 0u, 0u);
                    }
                }
            }
    };
    // The first tile's keys are in flight while q is staged.
    const int stride = gridDim.x * WARPS;
    int tile = blockIdx.x * WARPS + warp;
    uint4 a[MT][2][LPR];
    load_tile(tile, a);

    // q in B-fragment order: [ks][nt][lane] → dims dim_of(ks, c)..+3 of head nt·8 + g.
    const float* qt = q + (i64)t * nh * hd;
    for (int i = tid; i < KS * NT * WARP_SIZE; i += THREADS) {
        const int ln = i % WARP_SIZE, nt = (i / WARP_SIZE) % NT, ks = i / (WARP_SIZE * NT);
        const float4 v = *reinterpret_cast<const float4*>(qt + (i64)(nt * 8 + (ln >> 2)) * hd + dim_of<C>(ks, ln & 3));
        uint2 hi, lo;
        split2(v.x, v.y, hi.x, lo.x);
        split2(v.z, v.w, hi.y, lo.y);
        q_hi[i] = hi;
        q_lo[i] = lo;
    }
    for (int i = tid; i < nh; i += THREADS) w_s[i] = w[(i64)t * nh + i];
    __syncthreads();

    for (; tile < n_tiles; tile += stride) {
        // The next tile's keys stream in while this one is multiplied.
        uint4 nx[MT][2][LPR];
        load_tile(tile + stride < n_tiles ? tile + stride : n_tiles, nx);
        const int r0 = tile * RPT;
        float sc[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) sc[mt][0] = sc[mt][1] = 0.0f;
        for (int nt = 0; nt < NT; ++nt) {
            float acc[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < MAX_KS; ++ks) {
                if (ks >= KS) break;
                const uint2 bh = q_hi[(ks * NT + nt) * WARP_SIZE + lane];
                const uint2 bl = q_lo[(ks * NT + nt) * WARP_SIZE + lane];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    if constexpr (BF) {
                        const uint4 u = a[mt][0][ks >> 1], v = a[mt][1][ks >> 1];
                        const u32 a0 = (ks & 1) ? u.z : u.x, a2 = (ks & 1) ? u.w : u.y;
                        const u32 a1 = (ks & 1) ? v.z : v.x, a3 = (ks & 1) ? v.w : v.y;
                        mma_bf16(acc[mt], a0, a1, a2, a3, bh.x, bh.y);
                        mma_bf16(acc[mt], a0, a1, a2, a3, bl.x, bl.y);
                    } else {
                        const uint4 u = a[mt][0][ks], v = a[mt][1][ks];
                        u32 h0, l0, h1, l1, h2, l2, h3, l3;
                        split2(__uint_as_float(u.x), __uint_as_float(u.y), h0, l0);
                        split2(__uint_as_float(v.x), __uint_as_float(v.y), h1, l1);
                        split2(__uint_as_float(u.z), __uint_as_float(u.w), h2, l2);
                        split2(__uint_as_float(v.z), __uint_as_float(v.w), h3, l3);
                        mma_bf16(acc[mt], h0, h1, h2, h3, bh.x, bh.y);
                        mma_bf16(acc[mt], h0, h1, h2, h3, bl.x, bl.y);
                        mma_bf16(acc[mt], l0, l1, l2, l3, bh.x, bh.y);
                    }
                }
            }
            // acc: (token g, heads 2c, 2c+1), (token g + 8, same heads) of this 8-head tile.
            const float w0 = w_s[nt * 8 + 2 * c], w1 = w_s[nt * 8 + 2 * c + 1];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                sc[mt][0] = fmaf(w0, fmaxf(acc[mt][0], 0.0f), fmaf(w1, fmaxf(acc[mt][1], 0.0f), sc[mt][0]));
                sc[mt][1] = fmaf(w0, fmaxf(acc[mt][2], 0.0f), fmaf(w1, fmaxf(acc[mt][3], 0.0f), sc[mt][1]));
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                float v = sc[mt][hf];
                v += __shfl_xor_sync(FULL_MASK, v, 1);
                v += __shfl_xor_sync(FULL_MASK, v, 2);
                const int r = r0 + mt * 16 + hf * 8 + g;
                if (c == 0 && r < n_rows) row_out[r] = v;
            }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
#pragma unroll
                for (int l = 0; l < LPR; ++l) a[mt][hf][l] = nx[mt][hf][l];
    }
}

}  // namespace dsa_detail

template <class Cfg>
__device__ __forceinline__ void dsa_indexer_impl(const float* q, const float* w, const void* kcache, const int* pos,
                                                 float* scores, int n_q, int n_idx_head, int idx_head_dim,
                                                 int max_ctx, int ld_scores) {
    static_assert(Cfg::THREADS % WARP_SIZE == 0 && Cfg::THREADS <= 1024, "THREADS must be a multiple of 32, <= 1024");
    static_assert(Cfg::N_IDX_HEAD % 8 == 0 && Cfg::N_IDX_HEAD <= dsa_detail::MAX_HEADS,
                  "N_IDX_HEAD must be a multiple of 8, <= 64");
    static_assert(Cfg::IDX_HEAD_DIM % 32 == 0 && Cfg::IDX_HEAD_DIM <= dsa_detail::MAX_HD,
                  "IDX_HEAD_DIM must be a multiple of 32, <= 128");
    if ((int)blockIdx.y >= n_q) return;
    dsa_detail::indexer<Cfg::CACHE_T, Cfg::N_IDX_HEAD, Cfg::IDX_HEAD_DIM, Cfg::THREADS>(
        q, w, kcache, pos, scores, n_idx_head, idx_head_dim, max_ctx, ld_scores);
}

}  // namespace memra

#define MEMRA_DEFINE_DSA_INDEXER(SYMBOL, CFG)                                                                     \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                                    \
        SYMBOL(const float* q, const float* w, const void* kcache, const int* pos, float* scores, int n_q,         \
               int n_idx_head, int idx_head_dim, int max_ctx, int ld_scores) {                                     \
        memra::pdl_entry();                                                                                         \
        memra::dsa_indexer_impl<CFG>(q, w, kcache, pos, scores, n_q, n_idx_head, idx_head_dim, max_ctx, ld_scores); \
    }
