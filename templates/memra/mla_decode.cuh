// memra/mla_decode.cuh — MLA absorbed decode attention (model-specs §6.3 steps 6–7): every head
// attends over the shared latent cache rows [c | k_pe]; the value is c.
//
// Cfg fields:
//   N_HEAD   int              query heads; 0 = run time
//   KV_LORA  int              latent width (multiple of 128, ≤ 512); 0 = run time
//   ROPE     int              rope dims appended to each row; 0 = run time
//   CACHE_T  memra::CacheType cache element type (BF16 or F32)
//   THREADS  int              must be 256
// Kernel parameters:
//   (const float* q, const void* cache, const int* pos, float* out, float* work, int n_head,
//    int kv_lora, int rope, int max_ctx, int n_split, float scale)
//   D = kv_lora + rope. q [n_head, D] f32 (absorbed q̃ then roped q_pe per head); cache
//   [max_ctx, D] CACHE_T (row s = [c_s | k_pe_s]); out [n_head, kv_lora] f32:
//   out_h = Σ_{s ≤ p} softmax_s(scale·q_h·row_s)·c_s with p = pos[0] (device). p ∉ [0, max_ctx)
//   writes NaN to out.
// Work split: a block owns a chunk of the rows (grid.x = n_split, chunks of equal length,
//   multiples of the tile) and HB = min(64, n_head) heads (grid.y = ceil(n_head / 64)), so each
//   row is read once per 64 heads. Rows stream through shared memory in tiles of TR rows (16 for
//   bf16, 8 for f32) with a two-stage cp.async pipeline; per tile: scores S[h][r] (a thread per
//   (head, row quarter)), online softmax (base 2), then O[h][:] += P[h][r]·c_r (a warp per 8
//   heads, a lane per 16 latent dims). n_split = 1 writes out directly (work unused, may be null);
//   n_split > 1 writes partials to work and the last block of a head block (atomic counter)
//   combines them, then resets the counter to 0.
//   work (f32 units): u32 counters [ceil(n_head / 64)] padded to a multiple of 4 (zeroed once when
//   allocated), then acc [n_head, n_split, kv_lora] and (m, l) [n_head, n_split, 2]. The counters
//   come first so that their place does not depend on n_split: a workspace sized for S splits
//   serves every n_split ≤ S (with counters after the partials, a launch with more splits wrote
//   partials over the counters of one with fewer, whose combine then never ran).
// Geometry: grid (n_split, ceil(n_head / 64)), block 256, dynamic shared memory
//   HB·(D + 4)·4 + 2·TR·(D·e + 16) + TR·64·4 + 3·64·4 bytes (e = element bytes), above 48 KiB:
//   raise the function's limit (memra_engine::kernels::mla_decode::smem_bytes).
// Performance note: this is the CUDA-core form (f32 FMAs, ~2.2 MFLOP per 16 rows for 64 heads),
//   compute-bound well below the copy bandwidth; the bandwidth target needs tensor cores.
#pragma once
#include "memra/common.cuh"

namespace memra {
namespace mla_detail {

constexpr float LOG2E = 1.4426950408889634f;
constexpr int HB = 64;        // heads per block
constexpr int HPW = 8;        // heads per warp in the PV product
constexpr int MAX_NJ = 4;     // 128-dim slices of the latent per lane (kv_lora ≤ 512)

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float merge_w(float m, float M) { return m == neg_inf() ? 0.0f : exp2f(m - M); }

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}
// 16 bytes to shared memory; src_bytes 0 zero-fills.
__device__ __forceinline__ void cp16(void* smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

template <CacheType C> struct Elem;
template <> struct Elem<CacheType::BF16> { static constexpr int BYTES = 2; static constexpr int TR = 16; };
template <> struct Elem<CacheType::F32> { static constexpr int BYTES = 4; static constexpr int TR = 8; };

// Four consecutive cache elements from shared memory as floats.
template <CacheType C> __device__ __forceinline__ float4 ld4(const char* p) {
    if constexpr (C == CacheType::F32) {
        return *reinterpret_cast<const float4*>(p);
    } else {
        const uint2 w = *reinterpret_cast<const uint2*>(p);
        return make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u),
                           __uint_as_float(w.y << 16), __uint_as_float(w.y & 0xffff0000u));
    }
}

// T rows: cache rows 0..T (dense) or idx[0..T) (SPARSE, each index in [0, max_ctx); others read
// as zero rows).
template <CacheType C, int DC, int KVLC, bool SPARSE>
__device__ __forceinline__ void run(const float* __restrict__ q, const void* __restrict__ cache,
                                    const int* __restrict__ idx, float* __restrict__ out, float* work, int n_head,
                                    int kvl_rt, int d_rt, int T, int max_ctx, int n_split, float scale) {
    constexpr int TR = Elem<C>::TR;
    constexpr int EB = Elem<C>::BYTES;
    constexpr int RPT = TR / 4;  // rows per thread in the score phase
    const int D = DC != 0 ? DC : d_rt;
    const int KVL = KVLC != 0 ? KVLC : kvl_rt;
    const int QS = D + 4;                 // padded q row (floats): heads land on distinct banks
    const int RS = D * EB + 16;           // padded cache row in shared memory (bytes)
    const int CPR = D * EB / 16;          // 16-byte chunks per cache row
    const int hblk = blockIdx.y, sp = blockIdx.x;
    const int h_base = hblk * HB;
    const int hb = min(HB, n_head - h_base);

    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* qs = reinterpret_cast<float*>(smem_raw);
    char* ks = reinterpret_cast<char*>(qs + hb * QS);
    float* ps = reinterpret_cast<float*>(ks + 2 * TR * RS);   // P^T [TR][64]
    float* corr_s = ps + TR * HB;                              // [64]
    float* m_s = corr_s + HB;                                  // [64]
    float* l_s = m_s + HB;                                     // [64]

    const int tid = threadIdx.x;
    const float sl2 = scale * LOG2E;
    for (int i = tid; i < hb * (D / 4); i += 256) {
        const int h = i / (D / 4), k4 = i % (D / 4);
        float4 v = *reinterpret_cast<const float4*>(q + (i64)(h_base + h) * D + k4 * 4);
        v.x *= sl2; v.y *= sl2; v.z *= sl2; v.w *= sl2;
        *reinterpret_cast<float4*>(qs + h * QS + k4 * 4) = v;
    }

    int chunk = (T + n_split - 1) / n_split;
    chunk = (chunk + TR - 1) / TR * TR;
    const int c0 = min(sp * chunk, T);
    const int c1 = min(c0 + chunk, T);
    const int n_tiles = (c1 - c0 + TR - 1) / TR;
    const char* cb = static_cast<const char*>(cache);

    auto load_tile = [&](int t) {
        char* dst = ks + (t & 1) * TR * RS;
        const int g0 = c0 + t * TR;
        for (int i = tid; i < TR * CPR; i += 256) {
            const int r = i / CPR, c = i % CPR;
            const int g = g0 + r;
            int row = g;
            if constexpr (SPARSE) row = g < c1 ? idx[g] : -1;
            const bool ok = g < c1 && (!SPARSE || (row >= 0 && row < max_ctx));
            cp16(dst + r * RS + c * 16, cb + (ok ? (i64)row * D * EB + c * 16 : 0), ok ? 16 : 0);
        }
        commit();
    };

    // Score-phase roles.
    const int sh = tid >> 2, r0 = tid & 3;
    float m_run = neg_inf(), l_run = 0.0f;
    // PV roles.
    const int warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int NJ = KVL / 128;
    float acc[HPW][MAX_NJ][4];
#pragma unroll
    for (int a = 0; a < HPW; ++a)
#pragma unroll
        for (int j = 0; j < MAX_NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[a][j][e] = 0.0f;

    if (n_tiles > 0) load_tile(0);
    for (int t = 0; t < n_tiles; ++t) {
        if (t + 1 < n_tiles) {
            load_tile(t + 1);
            wait<1>();
        } else {
            wait<0>();
        }
        __syncthreads();  // tile t (and q on the first pass) visible to all
        const char* kt = ks + (t & 1) * TR * RS;
        const int g0 = c0 + t * TR;
        const int rows = min(TR, c1 - g0);

        // Scores for head sh, rows r0 + 4i.
        float s[RPT];
#pragma unroll
        for (int i = 0; i < RPT; ++i) s[i] = 0.0f;
        if (sh < hb) {
            const float* qh = qs + sh * QS;
#pragma unroll 4
            for (int k = 0; k < D; k += 4) {
                const float4 qv = *reinterpret_cast<const float4*>(qh + k);
#pragma unroll
                for (int i = 0; i < RPT; ++i) {
                    const float4 kv = ld4<C>(kt + (r0 + 4 * i) * RS + k * EB);
                    s[i] = fmaf(qv.x, kv.x, fmaf(qv.y, kv.y, fmaf(qv.z, kv.z, fmaf(qv.w, kv.w, s[i]))));
                }
            }
        }
        float mt = neg_inf();
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            if (r0 + 4 * i >= rows) s[i] = neg_inf();
            mt = fmaxf(mt, s[i]);
        }
        mt = fmaxf(mt, __shfl_xor_sync(FULL_MASK, mt, 1));
        mt = fmaxf(mt, __shfl_xor_sync(FULL_MASK, mt, 2));
        const float mn = fmaxf(m_run, mt);  // finite: row 0 of the tile is valid
        const float corr = exp2f(m_run - mn);
        float psum = 0.0f;
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const float pv = sh < hb ? exp2f(s[i] - mn) : 0.0f;
            psum += pv;
            ps[(r0 + 4 * i) * HB + sh] = pv;
        }
        psum += __shfl_xor_sync(FULL_MASK, psum, 1);
        psum += __shfl_xor_sync(FULL_MASK, psum, 2);
        l_run = l_run * corr + psum;
        m_run = mn;
        if (r0 == 0) corr_s[sh] = corr;
        __syncthreads();

        // O[h] = O[h]·corr[h] + Σ_r P[r][h]·c_r for this warp's 8 heads.
        float cw[HPW];
#pragma unroll
        for (int a = 0; a < HPW; ++a) cw[a] = corr_s[warp * HPW + a];
#pragma unroll
        for (int a = 0; a < HPW; ++a)
#pragma unroll
            for (int j = 0; j < MAX_NJ; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[a][j][e] *= cw[a];
        for (int r = 0; r < rows; ++r) {
            const float4 p0 = *reinterpret_cast<const float4*>(ps + r * HB + warp * HPW);
            const float4 p1 = *reinterpret_cast<const float4*>(ps + r * HB + warp * HPW + 4);
            const float pw[HPW] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
#pragma unroll
            for (int j = 0; j < MAX_NJ; ++j) {
                if (j < NJ) {
                    const float4 c = ld4<C>(kt + r * RS + (lane * 4 + j * 128) * EB);
#pragma unroll
                    for (int a = 0; a < HPW; ++a) {
                        acc[a][j][0] = fmaf(pw[a], c.x, acc[a][j][0]);
                        acc[a][j][1] = fmaf(pw[a], c.y, acc[a][j][1]);
                        acc[a][j][2] = fmaf(pw[a], c.z, acc[a][j][2]);
                        acc[a][j][3] = fmaf(pw[a], c.w, acc[a][j][3]);
                    }
                }
            }
        }
        __syncthreads();  // ps, corr_s and this tile's buffer are reused next
    }

    if (r0 == 0) {
        m_s[sh] = m_run;
        l_s[sh] = l_run;
    }
    __syncthreads();

    const i64 n_part = (i64)n_head * n_split;
    u32* counters = reinterpret_cast<u32*>(work);
    float* work_acc = work + ((n_head + HB - 1) / HB + 3) / 4 * 4;  // 16-byte aligned partials
    float* work_ml = work_acc + n_part * KVL;
#pragma unroll
    for (int a = 0; a < HPW; ++a) {
        const int h = warp * HPW + a;
        if (h >= hb) continue;
        const float L = l_s[h];
        const i64 hg = h_base + h;
#pragma unroll
        for (int j = 0; j < MAX_NJ; ++j) {
            if (j >= NJ) continue;
            const int d = lane * 4 + j * 128;
            if (n_split == 1) {
                const float inv = L > 0.0f ? 1.0f / L : 0.0f;
                *reinterpret_cast<float4*>(out + hg * KVL + d) =
                    make_float4(acc[a][j][0] * inv, acc[a][j][1] * inv, acc[a][j][2] * inv, acc[a][j][3] * inv);
            } else {
                *reinterpret_cast<float4*>(work_acc + (hg * n_split + sp) * KVL + d) =
                    make_float4(acc[a][j][0], acc[a][j][1], acc[a][j][2], acc[a][j][3]);
            }
        }
        if (n_split > 1 && lane == 0) {
            work_ml[(hg * n_split + sp) * 2] = m_s[h];
            work_ml[(hg * n_split + sp) * 2 + 1] = L;
        }
    }
    if (n_split == 1) return;

    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(&counters[hblk], 1u) == (u32)(n_split - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const volatile float* vacc = work_acc;
    const volatile float* vml = work_ml;
    for (int idx = tid; idx < hb * KVL; idx += 256) {
        const int h = idx / KVL, d = idx % KVL;
        const i64 part0 = (h_base + h) * (i64)n_split;
        float M = neg_inf();
        for (int s2 = 0; s2 < n_split; ++s2) M = fmaxf(M, vml[(part0 + s2) * 2]);
        float L = 0.0f, A = 0.0f;
        if (M != neg_inf()) {
            for (int s2 = 0; s2 < n_split; ++s2) {
                const float wt = merge_w(vml[(part0 + s2) * 2], M);
                L = fmaf(vml[(part0 + s2) * 2 + 1], wt, L);
                A = fmaf(vacc[(part0 + s2) * KVL + d], wt, A);
            }
        }
        out[(h_base + h) * (i64)KVL + d] = L > 0.0f ? A / L : 0.0f;
    }
    if (tid == 0) counters[hblk] = 0u;
}

}  // namespace mla_detail

template <class Cfg>
__device__ __forceinline__ void mla_decode_impl(const float* q, const void* cache, const int* pos, float* out, float* work,
                                                int n_head_rt, int kv_lora_rt, int rope_rt, int max_ctx, int n_split,
                                                float scale) {
    static_assert(Cfg::THREADS == 256, "mla_decode needs THREADS = 256 (64 heads x 4 row quarters)");
    static_assert(Cfg::KV_LORA % 128 == 0 && Cfg::KV_LORA <= 512, "KV_LORA must be a multiple of 128, <= 512");
    const int n_head = dim_or<Cfg::N_HEAD>(n_head_rt);
    const int kvl = dim_or<Cfg::KV_LORA>(kv_lora_rt);
    const int rope = dim_or<Cfg::ROPE>(rope_rt);
    if ((int)blockIdx.y * mla_detail::HB >= n_head) return;
    const int p = pos[0];
    if (p < 0 || p >= max_ctx) {
        if (blockIdx.x == 0) {
            const int h0 = blockIdx.y * mla_detail::HB;
            const int hb = min(mla_detail::HB, n_head - h0);
            for (int i = threadIdx.x; i < hb * kvl; i += 256) out[(i64)h0 * kvl + i] = __int_as_float(0x7fc00000);
        }
        return;
    }
    constexpr int DC = (Cfg::KV_LORA != 0 && Cfg::ROPE != 0) ? Cfg::KV_LORA + Cfg::ROPE : 0;
    mla_detail::run<Cfg::CACHE_T, DC, Cfg::KV_LORA, false>(q, cache, nullptr, out, work, n_head, kvl, kvl + rope, p + 1,
                                                            max_ctx, n_split, scale);
}

}  // namespace memra

#define MEMRA_DEFINE_MLA_DECODE(SYMBOL, CFG)                                                                  \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                                \
        SYMBOL(const float* q, const void* cache, const int* pos, float* out, float* work, int n_head,         \
               int kv_lora, int rope, int max_ctx, int n_split, float scale) {                                 \
        memra::mla_decode_impl<CFG>(q, cache, pos, out, work, n_head, kv_lora, rope, max_ctx, n_split, scale); \
    }
