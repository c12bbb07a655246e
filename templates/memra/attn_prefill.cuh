// memra/attn_prefill.cuh — causal GQA prefill attention over the KV cache on tensor cores
// (FlashAttention-2 structure): T query tokens of one sequence in one launch per layer.
//
// Cfg fields:
//   HEAD_DIM   int              head_dim of q/k/v; 0 = run time (64, 128 or 256 supported)
//   N_HEAD     int              query heads; 0 = run time
//   N_KV       int              key/value heads (N_HEAD % N_KV == 0); 0 = run time
//   CACHE_T    memra::CacheType cache element type (BF16 or F32)
//   THREADS    int              must be 128 (4 warps × 16 query rows)
// Kernel parameters:
//   (const float* q, const void* k_cache, const void* v_cache, float* out, int n_tokens,
//    int head_dim, int n_head, int n_kv, int max_ctx, int pos0, int window, float scale)
//   q / out [n_tokens, n_head, hd] f32; caches [max_ctx, n_kv, hd] CACHE_T (16-byte aligned),
//   rows 0 .. pos0 + n_tokens − 1 filled (qk_norm_rope wrote this chunk's rows). Query t sits at
//   position p = pos0 + t and attends to cache rows s ≤ p with p − s < window (window 0 = none):
//   out = Σ_s softmax_s(scale · q·k_s) · v_s. pos0 < 0 or pos0 + n_tokens > max_ctx writes NaN
//   (a visible slip, never an out-of-bounds read).
// Numerics ("bf16 products"): q is rounded to bf16 as it is staged, f32 caches are rounded to
//   bf16 as they are staged (bf16 caches are used as stored), and the softmax weights P are
//   rounded to bf16 for P·V; Q·Kᵀ and P·V run on mma.sync.m16n8k16 bf16 → f32, the softmax
//   (running max, exp2, row sums) and the output accumulator are f32. Expect ≈ 1e-3 relative
//   L2 against an f32/f64 attention of the same inputs (dominated by the bf16 rounding of q
//   and P); compare at ≤ 1e-2.
// Work split: G = n_head / n_kv q heads share a kv head. The query rows of one kv head are the
//   (token, head-of-group) pairs flattened as r = t·G + g, so the G heads of a token sit in
//   consecutive rows and a K/V tile loaded once serves all of them (any G, no padding). A block
//   owns BM consecutive rows of one kv head (grid.x, heaviest causal tiles first): BM = 128 for
//   hd ≤ 128 (each warp two 16-row m-tiles, so a K/V fragment feeds two mma), 64 for hd 256. It
//   loops over 64-key tiles from its window start to its last token's position; tiles fully
//   visible to all its rows skip the mask.
// Geometry: grid (ceil(n_tokens·G / BM), n_kv), block 128, dynamic shared memory
//   (BM + 2·64)·(hd + 8)·2 bytes (Q, K and V tiles in bf16, rows padded by 8 elements):
//   36 864 (hd 64), 69 632 (hd 128), 101 376 (hd 256). The kernel traps if launched with less.
// Inside a block: Q tile staged once (f32 → bf16); K and V tiles single-buffered, bf16 caches
//   copied with 16-byte cp.async (V(j) lands during Q·K(j)ᵀ, K(j+1) during P·V(j)), f32 caches
//   loaded as float4 pairs and rounded. Each warp: S = Q·Kᵀ (16·MT × 64) with ldmatrix
//   fragments, mask, online softmax in base 2 (row max/sum over the 4 lanes of a row), P
//   repacked from the S accumulators as the A operand, O += P·V with V fragments from
//   ldmatrix.trans.
#pragma once
#include "memra/common.cuh"
#include "memra/mma.cuh"

namespace memra {
namespace prefill_detail {

constexpr int BN = 64;  // keys per tile
constexpr int PAD = 8;  // bf16 elements of padding per smem row: ldmatrix rows hit distinct banks
constexpr float LOG2E = 1.4426950408889634f;

template <int HD> struct Geometry {
    // 16-row m-tiles per warp: two up to hd 128, so each K / V fragment a warp loads from shared
    // memory feeds two mma (half the ldmatrix traffic per flop); one at hd 256, where two would
    // need 256 accumulator registers.
    enum : int { MT = HD <= 128 ? 2 : 1 };
    enum : int { BM = 4 * 16 * MT };  // query rows per block (4 warps)
    enum : int { LD = HD + PAD };     // smem row stride, bf16 elements
    enum : int { SMEM = (BM + 2 * BN) * LD * 2 };
};

// Rows per block for a run-time head_dim (the generic variant's grid rule).
__device__ __forceinline__ int rows_per_block(int hd) { return hd <= 128 ? 128 : 64; }

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// 8 f32 (two float4) rounded to 8 bf16 and stored as one 16-byte chunk.
__device__ __forceinline__ void store8_bf16(u16* dst, float4 a, float4 b) {
    uint4 w;
    w.x = ptx::pack_bf16x2(a.x, a.y);
    w.y = ptx::pack_bf16x2(a.z, a.w);
    w.z = ptx::pack_bf16x2(b.x, b.y);
    w.w = ptx::pack_bf16x2(b.z, b.w);
    *reinterpret_cast<uint4*>(dst) = w;
}

// Cache rows k0 .. k0 + BN − 1 of one kv head into a bf16 [BN][LD] tile; rows at or past
// k0 + n_valid are zero (their scores are masked; zero V keeps 0·V finite).
// The thread copies chunk ch = tid % CH of rows tid / CH + i·(THREADS / CH).
template <CacheType C, int HD, int THREADS>
__device__ __forceinline__ void load_kv_tile(u16* dst, const void* cache, i64 row_stride, i64 head_off, int k0,
                                             int n_valid, int tid) {
    constexpr int LD = Geometry<HD>::LD;
    constexpr int CH = HD / 8;            // 16-byte bf16 chunks per row
    constexpr int RS = THREADS / CH;      // rows per pass
    static_assert(THREADS % CH == 0 && BN % RS == 0, "whole rows per pass");
    const int r0 = tid / CH, ch = tid % CH;
    if constexpr (C == CacheType::BF16) {
        const u16* src = static_cast<const u16*>(cache) + ((i64)(k0 + r0) * row_stride + head_off + ch * 8);
        const u32 d = ptx::opaque(ptx::smem_addr(dst + r0 * LD + ch * 8));
#pragma unroll
        for (int i = 0; i < BN / RS; ++i) {
            const bool ok = r0 + i * RS < n_valid;
            ptx::cp16(d + i * RS * LD * 2, ok ? src + (i64)i * RS * row_stride : src, ok ? 16 : 0);
        }
    } else {
        const float* src = static_cast<const float*>(cache) + ((i64)(k0 + r0) * row_stride + head_off + ch * 8);
        u16* d = dst + r0 * LD + ch * 8;
#pragma unroll 1  // the caller holds S and O in registers; one chunk in flight
        for (int i = 0; i < BN / RS; ++i) {
            const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            const bool ok = r0 + i * RS < n_valid;
            const float* sp = src + (i64)i * RS * row_stride;
            store8_bf16(d + i * RS * LD, ok ? load_f4(sp) : z, ok ? load_f4(sp + 4) : z);
        }
    }
}

template <CacheType C, int HD, int THREADS>
__device__ __forceinline__ void block(const float* __restrict__ q, const void* __restrict__ k_cache,
                                      const void* __restrict__ v_cache, float* __restrict__ out, u16* smem, int T,
                                      int n_head, int n_kv, int G, int pos0, int window, float sl2, int mt, int kvh) {
    using Geo = Geometry<HD>;
    constexpr int LD = Geo::LD, MT = Geo::MT, BM = Geo::BM;
    constexpr int CH = HD / 8;
    constexpr int NT_S = BN / 8;   // n-tiles of S per m-tile
    constexpr int NT_O = HD / 8;   // n-tiles of O per m-tile
    static_assert(THREADS == 128, "attn_prefill uses 4 warps");
    static_assert(HD % 16 == 0, "head_dim must be a multiple of 16");
    u16* qs = smem;
    u16* ks = qs + BM * LD;
    u16* vs = ks + BN * LD;

    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int g8 = lane / 4, tq = lane % 4;
    const int rows = T * G;  // flattened (token, head-of-group) rows of this kv head
    const int m0 = mt * BM;
    const int t_first = m0 / G;
    const int t_last = (min(m0 + BM, rows) - 1) / G;
    const int key_hi = pos0 + t_last;  // inclusive
    const int key_lo = window > 0 ? max(0, pos0 + t_first - window + 1) : 0;
    const int tile_lo = key_lo / BN, tile_hi = key_hi / BN;
    // This thread's rows: g8 and g8 + 8 of each of its warp's MT m-tiles of 16 (row
    // r_base + 16·i + 8·h). Padding rows take the last valid row's position (not stored).
    const int r_base = m0 + warp * 16 * MT + g8;

    // Q tile: row r = t·G + g → q[t, kvh·G + g, :], rounded to bf16.
#pragma unroll 4
    for (int i = 0; i < BM * CH / THREADS; ++i) {
        const int c = tid + i * THREADS;
        const int r = c / CH, ch = c % CH;
        const int m = m0 + r;
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = a;
        if (m < rows) {
            const int t = m / G, g = m % G;
            const float* src = q + ((i64)t * n_head + (i64)kvh * G + g) * HD + ch * 8;
            a = load_f4(src);
            b = load_f4(src + 4);
        }
        store8_bf16(qs + r * LD + ch * 8, a, b);
    }

    const i64 row_stride = (i64)n_kv * HD, head_off = (i64)kvh * HD;
    load_kv_tile<C, HD, THREADS>(ks, k_cache, row_stride, head_off, tile_lo * BN, key_hi + 1 - tile_lo * BN, tid);
    ptx::commit();

    float acc[MT][NT_O][4];
    float m_run[MT][2], l_run[MT][2];
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int j = 0; j < NT_O; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
        m_run[i][0] = m_run[i][1] = neg_inf();
        l_run[i][0] = l_run[i][1] = 0.0f;
    }

    // ldmatrix source rows/cols of this lane (fragment layouts of mma.m16n8k16).
    const int a_row = warp * 16 * MT + lane % 16, a_col = (lane / 16) * 8;         // Q (A, row-major)
    const int b_row = lane % 8 + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;  // K rows as B columns
    const int v_row = lane % 8 + ((lane / 8) % 2) * 8, v_col = (lane / 16) * 8;  // V via .trans
    const u32 q_frag = ptx::smem_addr(qs + a_row * LD + a_col);
    const u32 k_frag = ptx::smem_addr(ks + b_row * LD + b_col);
    const u32 v_frag = ptx::smem_addr(vs + v_row * LD + v_col);

#pragma unroll 1
    for (int tile = tile_lo; tile <= tile_hi; ++tile) {
        const int k0 = tile * BN;
        ptx::wait_all();
        __syncthreads();  // K(tile) visible; every warp is done with V(tile − 1)
        load_kv_tile<C, HD, THREADS>(vs, v_cache, row_stride, head_off, k0, key_hi + 1 - k0, tid);
        ptx::commit();

        // S = Q·Kᵀ: each K fragment serves the warp's MT m-tiles.
        float s[MT][NT_S][4];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
#pragma unroll
            for (int j = 0; j < NT_S; ++j) s[i][j][0] = s[i][j][1] = s[i][j][2] = s[i][j][3] = 0.0f;
        }
        const u32 qa = ptx::opaque(q_frag), ka = ptx::opaque(k_frag);
#pragma unroll
        for (int kq = 0; kq < HD; kq += 16) {
            u32 a[MT][4];
#pragma unroll
            for (int i = 0; i < MT; ++i) ptx::ldmatrix_x4(a[i], qa + (16 * i * LD + kq) * 2);
#pragma unroll
            for (int jj = 0; jj < NT_S / 2; ++jj) {
                u32 b[4];
                ptx::ldmatrix_x4(b, ka + (16 * jj * LD + kq) * 2);
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    ptx::bf16_16816(s[i][2 * jj], a[i], b[0], b[1]);
                    ptx::bf16_16816(s[i][2 * jj + 1], a[i], b[2], b[3]);
                }
            }
        }

        // Scale to base 2; mask unless every row of the block sees every key of the tile.
        const bool full = k0 + BN - 1 <= pos0 + t_first && (window <= 0 || k0 > pos0 + t_last - window);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
#pragma unroll
            for (int j = 0; j < NT_S; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) s[i][j][e] *= sl2;
            }
        }
        if (!full) {
            // Row positions recomputed here (opaque: not hoisted into registers held by the loop).
            const int rb = (int)ptx::opaque((u32)r_base);
#pragma unroll
            for (int i = 0; i < MT; ++i) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int p = pos0 + min(rb + 16 * i + 8 * h, rows - 1) / G;
#pragma unroll
                    for (int j = 0; j < NT_S; ++j) {
#pragma unroll
                        for (int e = 2 * h; e < 2 * h + 2; ++e) {
                            const int key = k0 + 8 * j + 2 * tq + (e & 1);
                            if (key > p || (window > 0 && p - key >= window)) s[i][j][e] = neg_inf();
                        }
                    }
                }
            }
        }
        // Online softmax per row (e = 0, 1: row g8; e = 2, 3: row g8 + 8 of m-tile i).
#pragma unroll
        for (int i = 0; i < MT; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = neg_inf();
#pragma unroll
                for (int j = 0; j < NT_S; ++j) mx = fmaxf(mx, fmaxf(s[i][j][2 * h], s[i][j][2 * h + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
                const float m_new = fmaxf(m_run[i][h], mx);
                const float m_use = m_new == neg_inf() ? 0.0f : m_new;  // a row with nothing visible yet
                const float corr = exp2f(m_run[i][h] - m_use);
                m_run[i][h] = m_new;
                float sum = 0.0f;
#pragma unroll
                for (int j = 0; j < NT_S; ++j) {
                    s[i][j][2 * h] = exp2f(s[i][j][2 * h] - m_use);
                    s[i][j][2 * h + 1] = exp2f(s[i][j][2 * h + 1] - m_use);
                    sum += s[i][j][2 * h] + s[i][j][2 * h + 1];
                }
                l_run[i][h] = l_run[i][h] * corr + sum;  // this lane's partial; the 4 lanes are summed at the end
#pragma unroll
                for (int j = 0; j < NT_O; ++j) {
                    acc[i][j][2 * h] *= corr;
                    acc[i][j][2 * h + 1] *= corr;
                }
            }
        }

        ptx::wait_all();
        __syncthreads();  // V(tile) visible; every warp is done with K(tile)
        if (tile < tile_hi) {
            load_kv_tile<C, HD, THREADS>(ks, k_cache, row_stride, head_off, k0 + BN, key_hi + 1 - (k0 + BN), tid);
        }
        ptx::commit();

        // O += P·V: P (16 × 64 keys per m-tile) from the S accumulators, 16 keys per mma; each V
        // fragment serves the MT m-tiles.
        const u32 va = ptx::opaque(v_frag);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                a[i][0] = ptx::pack_bf16x2(s[i][2 * kk][0], s[i][2 * kk][1]);
                a[i][1] = ptx::pack_bf16x2(s[i][2 * kk][2], s[i][2 * kk][3]);
                a[i][2] = ptx::pack_bf16x2(s[i][2 * kk + 1][0], s[i][2 * kk + 1][1]);
                a[i][3] = ptx::pack_bf16x2(s[i][2 * kk + 1][2], s[i][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dd = 0; dd < NT_O / 2; ++dd) {
                u32 b[4];
                ptx::ldmatrix_x4_trans(b, va + (16 * kk * LD + 16 * dd) * 2);
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    ptx::bf16_16816(acc[i][2 * dd], a[i], b[0], b[1]);
                    ptx::bf16_16816(acc[i][2 * dd + 1], a[i], b[2], b[3]);
                }
            }
        }
    }

    // Row sums over the 4 lanes of a row, normalize, store f32 pairs.
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_run[i][h];
            l += __shfl_xor_sync(FULL_MASK, l, 1);
            l += __shfl_xor_sync(FULL_MASK, l, 2);
            const int r = r_base + 16 * i + 8 * h;
            if (r >= rows) continue;
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            const int t = r / G, g = r % G;
            float* dst = out + ((i64)t * n_head + (i64)kvh * G + g) * HD + 2 * tq;
#pragma unroll
            for (int j = 0; j < NT_O; ++j) {
                *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(acc[i][j][2 * h] * inv, acc[i][j][2 * h + 1] * inv);
            }
        }
    }
}

}  // namespace prefill_detail

template <class Cfg>
__device__ __forceinline__ void attn_prefill_impl(const float* q, const void* k_cache, const void* v_cache,
                                                  float* out, int n_tokens, int head_dim_rt, int n_head_rt,
                                                  int n_kv_rt, int max_ctx, int pos0, int window, float scale) {
    using namespace prefill_detail;
    constexpr CacheType C = Cfg::CACHE_T;
    static_assert(Cfg::THREADS == 128, "attn_prefill uses 4 warps");
    static_assert(Cfg::N_HEAD == 0 || Cfg::N_KV == 0 || Cfg::N_HEAD % Cfg::N_KV == 0, "N_HEAD must be a multiple of N_KV");
    const int hd = dim_or<Cfg::HEAD_DIM>(head_dim_rt);
    const int n_head = dim_or<Cfg::N_HEAD>(n_head_rt), n_kv = dim_or<Cfg::N_KV>(n_kv_rt);
    const int G = (Cfg::N_HEAD != 0 && Cfg::N_KV != 0) ? Cfg::N_HEAD / Cfg::N_KV : n_head / n_kv;
    const int kvh = blockIdx.y;
    const int BM = rows_per_block(hd);
    const int n_mt = (n_tokens * G + BM - 1) / BM;
    if (kvh >= n_kv || (int)blockIdx.x >= n_mt) return;
    const int mt = n_mt - 1 - (int)blockIdx.x;  // the rows with the most keys start first
    extern __shared__ __align__(16) u16 attn_prefill_smem[];

    const bool hd_ok = hd == 64 || hd == 128 || hd == 256;
    if (!hd_ok || pos0 < 0 || pos0 + n_tokens > max_ctx) {
        // Unsupported head size or rows outside the cache: NaN, never a stray read.
        const int rows = n_tokens * G;
        for (int i = threadIdx.x; i < BM * hd; i += Cfg::THREADS) {
            const int m = mt * BM + i / hd;
            if (m < rows) out[((i64)(m / G) * n_head + (i64)kvh * G + m % G) * hd + i % hd] = __int_as_float(0x7fc00000);
        }
        return;
    }
    const float sl2 = scale * LOG2E;

#define MEMRA_PREFILL_HD(HDV)                                                                                         \
    do {                                                                                                             \
        if (ptx::dynamic_smem_bytes() < (u32)Geometry<HDV>::SMEM) __trap();                                          \
        block<C, HDV, Cfg::THREADS>(q, k_cache, v_cache, out, attn_prefill_smem, n_tokens, n_head, n_kv, G, pos0,     \
                                    window, sl2, mt, kvh);                                                           \
    } while (0)
    if constexpr (Cfg::HEAD_DIM != 0) {
        MEMRA_PREFILL_HD(Cfg::HEAD_DIM);
    } else if (hd == 128) {
        MEMRA_PREFILL_HD(128);
    } else if (hd == 256) {
        MEMRA_PREFILL_HD(256);
    } else {
        MEMRA_PREFILL_HD(64);
    }
#undef MEMRA_PREFILL_HD
}

}  // namespace memra

#define MEMRA_DEFINE_ATTN_PREFILL(SYMBOL, CFG)                                                                      \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                                      \
        SYMBOL(const float* q, const void* k_cache, const void* v_cache, float* out, int n_tokens, int head_dim,     \
               int n_head, int n_kv, int max_ctx, int pos0, int window, float scale) {                               \
        memra::pdl_entry();                                                                                          \
        memra::attn_prefill_impl<CFG>(q, k_cache, v_cache, out, n_tokens, head_dim, n_head, n_kv, max_ctx, pos0,     \
                                      window, scale);                                                               \
    }
