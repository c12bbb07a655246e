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
//    int kv_lora, int rope, int max_ctx, int n_split, float scale, int phase, int n_q)
//   D = kv_lora + rope. n_q query tokens (grid.z), each over its own causal prefix of the same
//   cache: q [n_q, n_head, D] f32 (absorbed q̃ then roped q_pe per head); cache [max_ctx, D]
//   CACHE_T (row s = [c_s | k_pe_s]); out [n_q, n_head, kv_lora] f32:
//   out[j]_h = Σ_{s ≤ p} softmax_s(scale·q[j]_h·row_s)·c_s with p = pos[j] (device, [n_q]).
//   p ∉ [0, max_ctx) writes NaN to out[j].
// Work split: a block owns a chunk of the rows (grid.x = n_split, chunks of ceil(T / n_split)
//   rows, rounded up to 8 on the f32 path) and HB = 64 heads (grid.y = ceil(n_head / 64)), so
//   each row is read once per 64 heads.
//   n_split = 1 writes out directly (work unused, may be null); n_split > 1 writes partials to
//   work and the last block of a head block (atomic counter) combines them, then resets the
//   counter to 0.
//   phase (how a split launch combines): 0 = as just said; 1 = write the partials only (no
//   counter, no combine; n_split > 1); 2 = combine only, after a phase-1 launch with the same
//   n_split: grid (any X, ceil(n_head / 64), n_q), dynamic shared memory (2·n_split + 16)·4 bytes
//   (merge_smem_bytes), the X blocks of y take turns over head block y's (head, 256-column)
//   units; 3 (n_split > 1, n_q = 1) = partials, then the n_split blocks of a head block meet at a
//   barrier (the head block's counter, left at zero) and merge the units spread over all of them:
//   phases 1 + 2 in one launch, which needs every block of the grid resident at once
//   (n_split · ceil(n_head / 64) ≤ the multiprocessor count: the tensor-core form's shared memory
//   allows one block per multiprocessor). The last-block combine reads every partial
//   (n_split · 64 · kv_lora · 4 bytes: 17 MB at 132 splits) through one multiprocessor; phases 3
//   or 1 + 2 spread that over the grid (memra_engine::kernels::mla_decode::phases_batch picks).
//   work (f32 units): u32 counters [ceil(n_head / 64)] padded to a multiple of 4 (zeroed once when
//   allocated), then acc [n_q, n_head, n_split, kv_lora] and (m, l) [n_q, n_head, n_split, 2].
//   The counters belong to query 0 only: n_q > 1 with n_split > 1 takes phases 1 + 2 (no
//   counters; phase 0 there writes NaN). The counters
//   come first so that their place does not depend on n_split: a workspace sized for S splits
//   serves every n_split ≤ S (with counters after the partials, a launch with more splits wrote
//   partials over the counters of one with fewer, whose combine then never ran).
// Tensor-core path (CACHE_T = BF16, any n_head, kv_lora a multiple of 128 ≤ 512, D a multiple of
//   8): the 64 heads of a block are the M dimension of both products (heads past n_head are zero
//   rows). Q = q·scale·log2(e) in bf16 [64][D] stays in shared memory; 64-row tiles of the cache
//   stream in with a two-stage cp.async pipeline (16-byte chunks, XOR-swizzled rows, zero past the
//   chunk's rows and past D). Per tile: S = Q·Kᵀ on mma.sync m16n8k16 bf16 → f32 (warps 0..3 =
//   2 groups of 32 heads × 2 halves of 32 rows, K = D in 16-steps), online softmax in base 2 (tile
//   max of a head over both halves through shared memory), P rounded to bf16 into shared memory,
//   then O += P·V with V = the first kv_lora columns of the same tile (one load serves K and V):
//   warp w owns O columns [w·kv_lora/8, (w+1)·kv_lora/8) for all 64 heads (128 f32 accumulators
//   per thread at kv_lora 512), V fragments by ldmatrix.trans.
//   On sm_90a (Hopper, NVRTC's arch-specific target) the same tiles go through warpgroup MMAs
//   instead (namespace mla_wg): S by wgmma m64n32k16 (warpgroup w = tile rows 32w..), O by
//   m64n64k16 (warpgroup w = O columns [w·kv_lora/2, (w+1)·kv_lora/2)), operands read from shared
//   memory in the 128-byte-swizzle layout, O staged through shared memory for 16-byte stores.
//   Same inputs, roundings and outputs; mma.sync remains for other targets.
//   Numerics: q·scale·log2(e) and P are rounded to bf16 (±2^-9 relative each); the softmax
//   statistics, row sums (of the rounded P) and O are f32. ≈ 2e-3 relative L2 against an f64
//   attention on N(0, 1) inputs at GLM-5 dims.
// CUDA-core path (CACHE_T = F32): rows stream through shared memory in tiles of 8 with a
//   two-stage cp.async pipeline; per tile: scores S[h][r] in f32 (a thread per (head, row
//   quarter)), online softmax (base 2), then O[h][:] += P[h][r]·c_r (a warp per 8 heads, a lane
//   per 16 latent dims). f32 arithmetic throughout (compute-bound: the f32 cache doubles the bytes
//   and is a debugging/reference option).
// Geometry: grid (n_split, ceil(n_head / 64), n_q), block 256, dynamic shared memory
//   BF16: (64 + 2·64)·P + 64·64·2 + 6·64·4 bytes with P = ceil(D / 64)·128 (230 912 at D = 576);
//   F32: min(64, n_head)·(D + 4)·4 + 2·8·(D·4 + 16) + 8·64·4 + 3·64·4 bytes.
//   BF16 takes 1 KiB more: the sm_90a form aligns its base to 1024 bytes.
//   Above 48 KiB: raise the function's limit (memra_engine::kernels::mla_decode::smem_bytes).
#pragma once
#include "memra/common.cuh"
#include "memra/mma.cuh"

namespace memra {
namespace mla_detail {

constexpr float LOG2E = 1.4426950408889634f;
constexpr int HB = 64;        // heads per block
constexpr int HPW = 8;        // heads per warp in the PV product
constexpr int MAX_NJ = 4;     // 128-dim slices of the latent per lane (kv_lora ≤ 512)

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float merge_w(float m, float M) { return m == neg_inf() ? 0.0f : exp2f(m - M); }

// Global loads through L2 only: the partials other blocks of this launch wrote (L1 is not
// coherent across multiprocessors).
__device__ __forceinline__ float2 ldcg2(const float* p) {
    float2 v;
    asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ float4 ldcg4(const float* p) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

template <CacheType C> struct Elem;
template <> struct Elem<CacheType::BF16> { enum : int { BYTES = 2 }; enum : int { TR = 16 }; };
template <> struct Elem<CacheType::F32> { enum : int { BYTES = 4 }; enum : int { TR = 8 }; };

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

// Columns of out one merge unit covers.
constexpr int MERGE_COLS = 256;
// Partial loads a thread has in flight before it uses any.
constexpr int MERGE_BATCH = 12;

// Dynamic shared memory a merge needs (phase 2 launches with it; phases 0 and 3 reuse the
// block's own): each split's weight and l, and 16 reduction slots.
__host__ __device__ constexpr unsigned merge_smem_bytes(int n_split) { return (unsigned)(2 * n_split + 16) * 4u; }

// The block's dynamic shared memory as floats (the same declaration as `run`'s).
__device__ __forceinline__ float* merge_smem() {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    return reinterpret_cast<float*>(smem_raw);
}

// Merges the n_split partials (acc, m, l) of global head hg into out[hg][c0 .. c0 + 256) ∩ [.., KVL).
// Warp w takes float4 columns 8w .. 8w + 7, its lanes = 4 split groups (lane / 8: splits
// s ≡ lane / 8 mod 4) × 8 columns (a group's loads are 128 contiguous bytes). Each thread's first
// MERGE_BATCH partial loads go out before anything else (they do not depend on the weights); then
// the split weights w_s = 2^(m_s − M) (M = max m_s; 0 for an empty split) and L = Σ w_s·l_s
// through shared memory ws (each split's (m, l) read once, the reads overlapping the partials'),
// then the rest of the partials, MERGE_BATCH loads in flight a thread (the merge is bound by
// loads in flight: one at a time per thread ran at a quarter of L2 bandwidth), summed across the
// groups by shuffles. Every thread of the block calls it with the same arguments; ws
// (merge_smem_bytes) is free again on return.
__device__ __forceinline__ void merge_unit(float* __restrict__ out, const float* work_acc, const float* work_ml,
                                           int hg, int c0, int KVL, int n_split, float* ws) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float* ls = ws + n_split;       // [n_split] each split's l
    float* red = ls + n_split;      // [2][8]: per-warp maxima, then per-warp sums
    const i64 part0 = (i64)hg * n_split;
    const int sg = lane >> 3;
    const int col = c0 + 4 * (8 * warp + (lane & 7));
    const bool live = col < KVL;
    const float* base = work_acc + part0 * KVL + col;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 a[MERGE_BATCH];
#pragma unroll
    for (int b = 0; b < MERGE_BATCH; ++b) a[b] = live && sg + 4 * b < n_split ? ldcg4(base + (i64)(sg + 4 * b) * KVL) : zero;

    float mx = neg_inf();
    for (int s = tid; s < n_split; s += 256) {
        const float2 ml = ldcg2(work_ml + (part0 + s) * 2);
        ws[s] = ml.x;
        ls[s] = ml.y;
        mx = fmaxf(mx, ml.x);
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o));
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    float M = red[0];
#pragma unroll
    for (int w = 1; w < 8; ++w) M = fmaxf(M, red[w]);
    float l = 0.0f;
    for (int s = tid; s < n_split; s += 256) {  // each thread rewrites its own slots
        const float wt = merge_w(ws[s], M);
        ws[s] = wt;
        l = fmaf(ls[s], wt, l);
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) l += __shfl_xor_sync(FULL_MASK, l, o);
    if (lane == 0) red[8 + warp] = l;
    __syncthreads();  // the weights and the sums
    float L = 0.0f;
#pragma unroll
    for (int w = 0; w < 8; ++w) L += red[8 + w];

    float4 A = zero;
    auto add = [&](const float4& v, float wt) {
        A.x = fmaf(v.x, wt, A.x);
        A.y = fmaf(v.y, wt, A.y);
        A.z = fmaf(v.z, wt, A.z);
        A.w = fmaf(v.w, wt, A.w);
    };
    if (M != neg_inf() && live) {
#pragma unroll
        for (int b = 0; b < MERGE_BATCH; ++b)
            if (sg + 4 * b < n_split) add(a[b], ws[sg + 4 * b]);
        int s = sg + 4 * MERGE_BATCH;
        for (; s + 4 * (MERGE_BATCH - 1) < n_split; s += 4 * MERGE_BATCH) {
#pragma unroll
            for (int b = 0; b < MERGE_BATCH; ++b) a[b] = ldcg4(base + (i64)(s + 4 * b) * KVL);
#pragma unroll
            for (int b = 0; b < MERGE_BATCH; ++b) add(a[b], ws[s + 4 * b]);
        }
        for (; s < n_split; s += 4) add(ldcg4(base + (i64)s * KVL), ws[s]);
    }
#pragma unroll
    for (int o = 8; o < 32; o <<= 1) {
        A.x += __shfl_xor_sync(FULL_MASK, A.x, o);
        A.y += __shfl_xor_sync(FULL_MASK, A.y, o);
        A.z += __shfl_xor_sync(FULL_MASK, A.z, o);
        A.w += __shfl_xor_sync(FULL_MASK, A.w, o);
    }
    if (sg == 0 && live) {
        const float inv = L > 0.0f ? 1.0f / L : 0.0f;
        *reinterpret_cast<float4*>(out + (i64)hg * KVL + col) = make_float4(A.x * inv, A.y * inv, A.z * inv, A.w * inv);
    }
    __syncthreads();  // ws and red are reused by the next unit
}

// Merge units of a head: 256-column slices of its kv_lora outputs.
__device__ __forceinline__ int merge_units_per_head(int KVL) { return (KVL + MERGE_COLS - 1) / MERGE_COLS; }

// Where the partials sit in work: after the counters (16-byte aligned).
__device__ __forceinline__ i64 partials_offset(int n_head) { return ((n_head + HB - 1) / HB + 3) / 4 * 4; }

// Query blockIdx.z's partials: acc [n_head, n_split, KVL] and (m, l) [n_head, n_split, 2] (the
// arrays of all n_q queries follow each other).
__device__ __forceinline__ float* work_acc_of(float* work, int n_head, int KVL, int n_split) {
    return work + partials_offset(n_head) + (i64)blockIdx.z * n_head * n_split * KVL;
}
__device__ __forceinline__ float* work_ml_of(float* work, int n_head, int KVL, int n_split, int n_q) {
    return work + partials_offset(n_head) + (i64)n_q * n_head * n_split * KVL + (i64)blockIdx.z * n_head * n_split * 2;
}

// Phase 0 epilogue (n_split > 1): the partials of this block are in work; the last block of head
// block hblk (atomic counter at the front of work) merges every split's (acc, m, l) into out
// and resets the counter to 0. Every thread of the block calls it.
__device__ __forceinline__ void combine_last(float* __restrict__ out, float* work, int n_head, int h_base, int hb,
                                             int KVL, int n_split, int hblk) {
    u32* counters = reinterpret_cast<u32*>(work);
    const float* work_acc = work_acc_of(work, n_head, KVL, n_split);  // n_q = 1 (header)
    const float* work_ml = work_ml_of(work, n_head, KVL, n_split, 1);
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(&counters[hblk], 1u) == (u32)(n_split - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const int units = merge_units_per_head(KVL);
    for (int u = 0; u < hb * units; ++u)
        merge_unit(out, work_acc, work_ml, h_base + u / units, u % units * MERGE_COLS, KVL, n_split, merge_smem());
    if (threadIdx.x == 0) counters[hblk] = 0u;
}

// Phase 2: the blocks of grid.x take turns over head block y's (head, 256-column) units (a
// phase-1 launch wrote the partials; the launch boundary orders them). Dynamic shared memory:
// merge_smem_bytes(n_split).
__device__ __forceinline__ void combine_slice(float* __restrict__ out, float* work, int n_head, int KVL,
                                              int n_split, int n_q) {
    const int h_base = blockIdx.y * HB, hb = min(HB, n_head - h_base);
    const int units = merge_units_per_head(KVL);
    const float* work_acc = work_acc_of(work, n_head, KVL, n_split);
    const float* work_ml = work_ml_of(work, n_head, KVL, n_split, n_q);
    for (int u = blockIdx.x; u < hb * units; u += gridDim.x)
        merge_unit(out, work_acc, work_ml, h_base + u / units, u % units * MERGE_COLS, KVL, n_split, merge_smem());
}

// Phase 3 after the partials (n_q = 1): the n_split blocks of head block y arrive on its counter,
// wait for all, merge their share of the (head, 256 columns) units, then depart on the same
// counter; the last to depart (counter 2·n_split − 1) sets it back to zero.
__device__ __forceinline__ void barrier_then_merge(float* __restrict__ out, float* work, int n_head, int kvl,
                                                   int n_split) {
    u32* counter = reinterpret_cast<u32*>(work) + blockIdx.y;
    grid::barrier(counter, (u32)n_split);
    combine_slice(out, work, n_head, kvl, n_split, 1);
    __syncthreads();
    if (threadIdx.x == 0 && grid::fetch_add(counter, 1u) == 2u * (u32)n_split - 1u) grid::store_zero(counter);
}

// T rows: cache rows 0..T (dense) or idx[0..T) (SPARSE, each index in [0, max_ctx); others read
// as zero rows).
template <CacheType C, int DC, int KVLC, bool SPARSE>
__device__ __forceinline__ void run(const float* __restrict__ q, const void* __restrict__ cache,
                                    const int* __restrict__ idx, float* __restrict__ out, float* work, int n_head,
                                    int kvl_rt, int d_rt, int T, int max_ctx, int n_split, float scale, int phase,
                                    int n_q) {
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
            ptx::cp16(dst + r * RS + c * 16, cb + (ok ? (i64)row * D * EB + c * 16 : 0), ok ? 16 : 0);
        }
        ptx::commit();
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
            ptx::wait<1>();
        } else {
            ptx::wait<0>();
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

    float* work_acc = work_acc_of(work, n_head, KVL, n_split);
    float* work_ml = work_ml_of(work, n_head, KVL, n_split, n_q);
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
    if (n_split == 1 || phase == 1) return;
    combine_last(out, work, n_head, h_base, hb, KVL, n_split, hblk);
}

}  // namespace mla_detail

// Shared by the two tensor-core forms (mla_tc, mla_wg), which differ in their shared-memory
// layouts: `at(r, c)` is the byte offset of 16-byte chunk c of row r there.
namespace mla_tile {

// Tile rows [g0, g0 + TN) ∩ [.., c1) of the cache (SPARSE: rows idx[g], an index outside
// [0, max_ctx) reading as zeros) → shared address dst + at(r, c), KC 16-byte chunks a row (zeros
// past D), one cp.async group. Warp w copies rows w, w + 8, ..: the row numbers first, all at
// once, so no copy waits on an index load; a row's chunks are consecutive lanes.
template <int TN, bool SPARSE, class At>
__device__ __forceinline__ void copy_rows(u32 dst, At at, const char* cb, const int* __restrict__ idx, int g0, int c1,
                                          int max_ctx, int D, int KC) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int rid[TN / 8];
#pragma unroll
    for (int k = 0; k < TN / 8; ++k) {
        const int gr = g0 + warp + 8 * k;
        int row = gr < c1 ? gr : -1;
        if constexpr (SPARSE) row = gr < c1 ? idx[gr] : -1;
        rid[k] = row >= 0 && row < max_ctx ? row : -1;
    }
#pragma unroll
    for (int k = 0; k < TN / 8; ++k) {
        const int r = warp + 8 * k;
        for (int c = lane; c < KC; c += 32) {
            const bool ok = rid[k] >= 0 && c * 8 < D;
            ptx::cp16(dst + at(r, c), cb + (ok ? ((i64)rid[k] * D + c * 8) * 2 : 0), ok ? 16 : 0);
        }
    }
    ptx::commit();
}

// The block's q rows [hb][D] f32 → bf16 at dst + at(h, c) for HB rows × KC chunks, pre-scaled by
// sl2; rows past hb and dims past D are zeros. The f32 rows (each block reads all of q, 147 KB at
// GLM-5 dims) land first in the two tile buffers (shared address s_tiles, `tile_bytes` each, each
// holding HB / 2 rows of f32) by cp.async; the block's first tile (`load_tile(0)`, one cp.async
// group; an empty group when the split has no tile) is issued here too. OVERLAP (dense splits,
// several tiles each): q goes through the second buffer half the heads at a time, the first tile
// issued after the first half, so that it streams in while q is staged (2-5 % faster at
// T = 32k-128k). Otherwise (sparse splits, one tile
// of a few selected rows each, where halves measured 3 % slower) q is staged at once and the tile
// issued after it. Every thread calls it; the tile buffers are free again on return but for the
// first tile's group, possibly still in flight.
template <bool OVERLAP, class At, class LoadTile>
__device__ __forceinline__ void stage_q(unsigned char* dst, At at, u32 s_tiles, const unsigned char* tiles,
                                        u32 tile_bytes, const float* __restrict__ q, int hb, int D, int KC, float sl2,
                                        int n_tiles, LoadTile load_tile) {
    auto first_tile = [&] {
        if (n_tiles > 0) load_tile(0);
        else ptx::commit();  // an empty group: the OVERLAP path waits on one
    };
    constexpr int PART = OVERLAP ? mla_detail::HB / 2 : mla_detail::HB;  // heads staged at once
    const u32 off = OVERLAP ? tile_bytes : 0u;
    const float* qf = reinterpret_cast<const float*>(tiles + off);
#pragma unroll 1
    for (int h0 = 0; h0 < mla_detail::HB; h0 += PART) {
        const int q_chunks = max(0, min(PART, hb - h0)) * D / 4;  // D % 4 == 0 (the wrapper checks)
        for (int i = threadIdx.x; i < q_chunks; i += 256) ptx::cp16(s_tiles + off + 16 * i, q + (i64)h0 * D + 4 * i, 16);
        ptx::commit();
        if (OVERLAP && h0 == 0) {
            first_tile();
            ptx::wait<1>();  // this half of q; the tile may still be on its way
        } else {
            ptx::wait_all();
        }
        __syncthreads();
        for (int i = threadIdx.x; i < PART * KC; i += 256) {
            const int h = h0 + i / KC, c = i % KC;
            // Two 16-byte halves (D % 4 == 0: each is wholly inside the row or past it).
            const float* src = qf + (h - h0) * D + c * 8;
            const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            const float4 a = h < hb && c * 8 < D ? *reinterpret_cast<const float4*>(src) : z;
            const float4 b = h < hb && c * 8 + 4 < D ? *reinterpret_cast<const float4*>(src + 4) : z;
            uint4 w;
            w.x = ptx::pack_bf16x2(a.x * sl2, a.y * sl2);
            w.y = ptx::pack_bf16x2(a.z * sl2, a.w * sl2);
            w.z = ptx::pack_bf16x2(b.x * sl2, b.y * sl2);
            w.w = ptx::pack_bf16x2(b.z * sl2, b.w * sl2);
            *reinterpret_cast<uint4*>(dst + at(h, c)) = w;
        }
        __syncthreads();  // the stage is free again
    }
    if (!OVERLAP) first_tile();
}

// A split's epilogue after its acc partials are written: (m, l) of each head (m_s [HB], row sums
// of the two halves lsum_s [2][HB], visible to every thread), then the phase-0 combine.
__device__ __forceinline__ void finish_split(float* out, float* work, float* work_ml, const float* m_s,
                                             const float* lsum_s, int n_head, int h_base, int hb, int KVL,
                                             int n_split, int phase) {
    const int tid = threadIdx.x, HB = mla_detail::HB;
    if (tid < hb) {
        const i64 part = (h_base + tid) * (i64)n_split + blockIdx.x;
        work_ml[part * 2] = m_s[tid];
        work_ml[part * 2 + 1] = lsum_s[tid] + lsum_s[HB + tid];
    }
    if (phase == 1) return;
    mla_detail::combine_last(out, work, n_head, h_base, hb, KVL, n_split, blockIdx.y);
}

}  // namespace mla_tile

// Tensor-core form for bf16 caches (the header's "Tensor-core path").
namespace mla_tc {

using mla_detail::HB;
using mla_detail::LOG2E;
using mla_detail::neg_inf;
constexpr int TN = 64;          // cache rows per tile
constexpr int P_PITCH = TN * 2; // bytes per row of the bf16 P tile [HB][TN]

// Byte offset of 16-byte chunk c of row r in a tile of `pitch`-byte rows (pitch a multiple of
// 128): the chunk index is XORed with r mod 8, so the 8 rows an ldmatrix reads at one chunk
// land on 8 distinct 16-byte bank groups.
__device__ __forceinline__ u32 swz(int r, int c, int pitch) { return (u32)(r * pitch + ((c ^ (r & 7)) << 4)); }

// Dense: cache rows 0..T; SPARSE: rows idx[0..T) (an index outside [0, max_ctx) reads as zeros).
template <int DC, int KVLC, bool SPARSE>
__device__ __forceinline__ void run(const float* __restrict__ q, const void* __restrict__ cache,
                                    const int* __restrict__ idx, float* __restrict__ out, float* work, int n_head,
                                    int kvl_rt, int d_rt, int T, int max_ctx, int n_split, float scale, int phase,
                                    int n_q) {
    const int D = DC != 0 ? DC : d_rt;
    const int KVL = KVLC != 0 ? KVLC : kvl_rt;
    const int KS = (D + 15) / 16;            // k-steps of Q·Kᵀ
    const int KC = 2 * KS;                   // 16-byte chunks staged per row (zeros past D)
    const int PITCH = (D + 63) / 64 * 128;   // smem row bytes: whole 128-byte swizzle groups
    const int NT = KVL / 64;                 // n8-tiles of O per warp (8 warps split the columns)
    const int hblk = blockIdx.y, sp = blockIdx.x;
    const int h_base = hblk * HB;
    const int hb = min(HB, n_head - h_base);

    extern __shared__ __align__(128) unsigned char mla_tc_smem[];
    unsigned char* const sm = mla_tc_smem;
    const u32 s_q = ptx::smem_addr(sm);
    const u32 s_k = s_q + HB * PITCH;        // two K/V tiles [TN][PITCH]
    const int p_off = (HB + 2 * TN) * PITCH;  // P [HB][TN] bf16
    const u32 s_p = s_q + p_off;
    float* mx_s = reinterpret_cast<float*>(sm + p_off + HB * P_PITCH);  // [2][HB] tile max per row half
    float* lsum_s = mx_s + 2 * HB;                                        // [2][HB] row sums per half
    float* corr_s = lsum_s + 2 * HB;                                      // [HB]
    float* m_s = corr_s + HB;                                             // [HB]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;

    const int chunk = (T + n_split - 1) / n_split;
    const int c0 = min(sp * chunk, T);
    const int c1 = min(c0 + chunk, T);
    const int n_tiles = (c1 - c0 + TN - 1) / TN;
    const char* cb = static_cast<const char*>(cache);

    auto at = [&](int r, int c) { return swz(r, c, PITCH); };
    auto load_tile = [&](int t) {
        mla_tile::copy_rows<TN, SPARSE>(s_k + (t & 1) * TN * PITCH, at, cb, idx, c0 + t * TN, c1, max_ctx, D, KC);
    };

    // Q·Kᵀ roles: warps 0..3 = (32 heads 32mh.., 32-row half of the tile): each A (Q) fragment
    // feeds 4 mma and each B (K) fragment 2, so Q·Kᵀ reads ~295 KB of shared memory per tile
    // (8 warps of 16 heads × 32 rows would read 442 KB); warps 4..7 wait for P.
    const bool s_warp = warp < 4;
    const int mh = warp & 1, half = (warp >> 1) & 1;
    // ldmatrix row / chunk per lane: A (16 rows × 2 chunks), B from K rows (2 n8-tiles × 2 chunks),
    // V transposed (16 k-rows × 2 n8-tiles).
    const int a_row = lane & 15, a_chunk = lane >> 4;
    const int b_row = ((lane >> 4) << 3) + (lane & 7), b_chunk = (lane >> 3) & 1;
    const int v_row = (((lane >> 3) & 1) << 3) + (lane & 7), v_chunk = lane >> 4;
    const int col_chunk0 = warp * (KVL / 64);  // this warp's first O column / 8

    // Score rows of this thread (S warps): heads 32mh + 16i + g + 8k.
    float m_run[2][2], l_run[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            m_run[i][k] = neg_inf();
            l_run[i][k] = 0.0f;
        }
    float acc[4][8][4];
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.0f;

    // Q → bf16 rows pre-scaled by scale·log2(e), staged through the K/V tile buffers (64 rows of
    // PITCH ≥ 2·D bytes each), the first tile streaming in meanwhile on the dense path.
    mla_tile::stage_q<!SPARSE>(sm, at, s_k, sm + HB * PITCH, TN * PITCH, q + (i64)h_base * D, hb, D, KC,
                               scale * LOG2E, n_tiles, load_tile);

    for (int t = 0; t < n_tiles; ++t) {
        ptx::wait_all();
        __syncthreads();  // tile t (and Q) visible; every warp is done with tile t − 1 and its P
        if (t + 1 < n_tiles) load_tile(t + 1);
        const u32 kt = s_k + (t & 1) * TN * PITCH;
        const int rows = min(TN, c1 - (c0 + t * TN));

        // S = Q·Kᵀ: heads 32mh.. (2 m-tiles), tile rows 32half.. (4 n8-tiles).
        float s[2][4][4];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[i][j][e] = 0.0f;
        if (s_warp) {
            const int qr = 32 * mh + a_row, kr = 32 * half + b_row;
#pragma unroll 2
            for (int ks = 0; ks < KS; ++ks) {
                u32 a0[4], a1[4], b0[4], b1[4];
                ptx::ldmatrix_x4(a0, s_q + swz(qr, 2 * ks + a_chunk, PITCH));
                ptx::ldmatrix_x4(a1, s_q + swz(qr + 16, 2 * ks + a_chunk, PITCH));
                ptx::ldmatrix_x4(b0, kt + swz(kr, 2 * ks + b_chunk, PITCH));
                ptx::ldmatrix_x4(b1, kt + swz(kr + 16, 2 * ks + b_chunk, PITCH));
                ptx::bf16_16816(s[0][0], a0, b0[0], b0[1]);
                ptx::bf16_16816(s[0][1], a0, b0[2], b0[3]);
                ptx::bf16_16816(s[0][2], a0, b1[0], b1[1]);
                ptx::bf16_16816(s[0][3], a0, b1[2], b1[3]);
                ptx::bf16_16816(s[1][0], a1, b0[0], b0[1]);
                ptx::bf16_16816(s[1][1], a1, b0[2], b0[3]);
                ptx::bf16_16816(s[1][2], a1, b1[0], b1[1]);
                ptx::bf16_16816(s[1][3], a1, b1[2], b1[3]);
            }
            // Online softmax (base 2): the tile max of a head over both halves, via shared memory.
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float mx0 = neg_inf(), mx1 = neg_inf();
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        if (32 * half + 8 * j + 2 * t4 + (e & 1) >= rows) s[i][j][e] = neg_inf();
                        if (e < 2) mx0 = fmaxf(mx0, s[i][j][e]);
                        else mx1 = fmaxf(mx1, s[i][j][e]);
                    }
                mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 1));
                mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 2));
                mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 1));
                mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 2));
                if (t4 == 0) {
                    mx_s[half * HB + 32 * mh + 16 * i + g] = mx0;
                    mx_s[half * HB + 32 * mh + 16 * i + g + 8] = mx1;
                }
            }
        }
        __syncthreads();
        if (s_warp) {
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    const int h = 32 * mh + 16 * i + g + 8 * k;
                    // Finite: row 0 of the tile is valid (both halves compute the same maxima).
                    const float mn = fmaxf(m_run[i][k], fmaxf(mx_s[h], mx_s[HB + h]));
                    const float cr = exp2f(m_run[i][k] - mn);
                    m_run[i][k] = mn;
                    float ps = 0.0f;
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        // P in bf16 as P·V reads it; the row sums add the same rounded values.
                        const u32 pk = ptx::pack_bf16x2(exp2f(s[i][j][2 * k] - mn), exp2f(s[i][j][2 * k + 1] - mn));
                        ps += __uint_as_float(pk << 16) + __uint_as_float(pk & 0xffff0000u);
                        *reinterpret_cast<u32*>(sm + p_off + swz(h, 4 * half + j, P_PITCH) + 4 * t4) = pk;
                    }
                    l_run[i][k] = l_run[i][k] * cr + ps;
                    if (half == 0 && t4 == 0) corr_s[h] = cr;
                }
        }
        __syncthreads();  // P and corr visible

        // O[:, this warp's columns] = O·corr + P·V, V = the first KVL columns of the tile rows.
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const float clo = corr_s[16 * m + g], chi = corr_s[16 * m + g + 8];
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                if (n < NT) {
                    acc[m][n][0] *= clo;
                    acc[m][n][1] *= clo;
                    acc[m][n][2] *= chi;
                    acc[m][n][3] *= chi;
                }
            }
        }
#pragma unroll
        for (int kk = 0; kk < TN / 16; ++kk) {
            u32 a[4][4];
#pragma unroll
            for (int m = 0; m < 4; ++m) ptx::ldmatrix_x4(a[m], s_p + swz(16 * m + a_row, 2 * kk + a_chunk, P_PITCH));
#pragma unroll
            for (int n2 = 0; n2 < 4; ++n2) {
                if (2 * n2 < NT) {
                    u32 b[4];
                    ptx::ldmatrix_x4_trans(b, kt + swz(16 * kk + v_row, col_chunk0 + 2 * n2 + v_chunk, PITCH));
#pragma unroll
                    for (int m = 0; m < 4; ++m) {
                        ptx::bf16_16816(acc[m][2 * n2], a[m], b[0], b[1]);
                        ptx::bf16_16816(acc[m][2 * n2 + 1], a[m], b[2], b[3]);
                    }
                }
            }
        }
    }

    // Row sums: the 4 lanes of a row, then the two halves through shared memory.
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            float l = l_run[i][k];
            l += __shfl_xor_sync(FULL_MASK, l, 1);
            l += __shfl_xor_sync(FULL_MASK, l, 2);
            const int h = 32 * mh + 16 * i + g + 8 * k;
            if (s_warp && t4 == 0) {
                lsum_s[half * HB + h] = l;
                if (half == 0) m_s[h] = m_run[i][k];
            }
        }
    __syncthreads();

    float* work_acc = mla_detail::work_acc_of(work, n_head, KVL, n_split);
    float* work_ml = mla_detail::work_ml_of(work, n_head, KVL, n_split, n_q);
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int h = 16 * m + g + 8 * hh;
            if (h >= hb) continue;
            const float L = lsum_s[h] + lsum_s[HB + h];
            const float inv = L > 0.0f ? 1.0f / L : 0.0f;
            const i64 hg = h_base + h;
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                if (n >= NT) continue;
                const int col = (col_chunk0 + n) * 8 + 2 * t4;
                if (n_split == 1) {
                    *reinterpret_cast<float2*>(out + hg * KVL + col) =
                        make_float2(acc[m][n][2 * hh] * inv, acc[m][n][2 * hh + 1] * inv);
                } else {
                    *reinterpret_cast<float2*>(work_acc + (hg * n_split + sp) * KVL + col) =
                        make_float2(acc[m][n][2 * hh], acc[m][n][2 * hh + 1]);
                }
            }
        }
    if (n_split > 1) mla_tile::finish_split(out, work, work_ml, m_s, lsum_s, n_head, h_base, hb, KVL, n_split, phase);
}

}  // namespace mla_tc

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Warpgroup-MMA form of the tensor-core path (sm_90a; the header's "Tensor-core path" with the
// same work split, workspace and numerics): warpgroup w (warps 4w..4w+3) computes S for tile rows
// [32w, 32w + 32) of all 64 heads (wgmma m64n32k16, A = Q and B = the K rows from shared memory),
// the two halves' row maxima meet in shared memory, P goes to shared memory in bf16, then
// warpgroup w computes O columns [w·KVL/2, (w+1)·KVL/2) over all 64 rows (m64n64k16, B = V read
// MN-major from the same tile). Shared memory (1024-byte aligned; KB = ceil(D / 64) blocks of 64
// columns, each [rows][128 bytes] in the 128-byte-swizzle layout): Q [KB][64][128], two tiles
// [KB][64][128], P [64][128], then the f32 row statistics.
namespace mla_wg {

using mla_detail::HB;
using mla_detail::LOG2E;
using mla_detail::neg_inf;
constexpr int TN = 64;        // cache rows per tile
constexpr int MAX_NB = 4;     // 64-column O blocks per warpgroup (KVL ≤ 512)

// Byte offset of 16-byte chunk c (of a row's 8·KB) of row r in a [KB][rows][128] region.
__device__ __forceinline__ u32 sw(int r, int c, int rows) {
    return (u32)((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

template <int DC, int KVLC, bool SPARSE>
__device__ __forceinline__ void run(const float* __restrict__ q, const void* __restrict__ cache,
                                    const int* __restrict__ idx, float* __restrict__ out, float* work, int n_head,
                                    int kvl_rt, int d_rt, int T, int max_ctx, int n_split, float scale, int phase,
                                    int n_q) {
    const int D = DC != 0 ? DC : d_rt;
    const int KVL = KVLC != 0 ? KVLC : kvl_rt;
    const int KB = (D + 63) / 64;          // 64-column blocks per row
    const int KS = (D + 15) / 16;          // k-steps of Q·Kᵀ
    const int KC = 2 * KS;                 // 16-byte chunks staged per row (zeros past D)
    const int NB = KVL / 128;              // O blocks per warpgroup
    const u32 BLK = TN * 128;              // bytes of one 64-column block of a 64-row region
    const int hblk = blockIdx.y, sp = blockIdx.x;
    const int h_base = hblk * HB;
    const int hb = min(HB, n_head - h_base);

    extern __shared__ __align__(128) unsigned char mla_wg_smem[];
    const u32 raw = ptx::smem_addr(mla_wg_smem);
    const u32 s_q = (raw + 1023u) & ~1023u;  // the swizzle is on absolute address bits 7..9
    unsigned char* const sm = mla_wg_smem + (s_q - raw);
    const u32 s_k = s_q + KB * BLK;          // two tiles
    const u32 p_off = 3 * KB * BLK;          // P [64][128]
    const u32 s_p = s_q + p_off;
    float* mx_s = reinterpret_cast<float*>(sm + p_off + HB * 128);  // [2][HB] tile max per half
    float* lsum_s = mx_s + 2 * HB;                                   // [2][HB] row sums per half
    float* m_s = lsum_s + 2 * HB;                                    // [HB]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wgi = warp >> 2, wi = warp & 3;  // warpgroup, warp within it (rows 16wi..)
    const int g = lane >> 2, t4 = lane & 3;

    const int chunk = (T + n_split - 1) / n_split;
    const int c0 = min(sp * chunk, T);
    const int c1 = min(c0 + chunk, T);
    const int n_tiles = (c1 - c0 + TN - 1) / TN;
    const char* cb = static_cast<const char*>(cache);

    auto at = [&](int r, int c) { return sw(r, c, TN); };  // tiles, Q and P all have 64 rows
    auto load_tile = [&](int t) {
        mla_tile::copy_rows<TN, SPARSE>(s_k + (t & 1) * KB * BLK, at, cb, idx, c0 + t * TN, c1, max_ctx, D, KC);
    };

    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.0f, 0.0f};  // heads 16wi + g (+ 8)
    float o[MAX_NB][32];
#pragma unroll
    for (int n = 0; n < MAX_NB; ++n)
#pragma unroll
        for (int e = 0; e < 32; ++e) o[n][e] = 0.0f;

    // Q → bf16 pre-scaled by scale·log2(e), staged through the tile buffers (KB·BLK ≥ 32·D·4 bytes
    // each), the first tile streaming in meanwhile on the dense path.
    mla_tile::stage_q<!SPARSE>(sm, at, s_k, sm + KB * BLK, KB * BLK, q + (i64)h_base * D, hb, D, 8 * KB,
                               scale * LOG2E, n_tiles, load_tile);

    for (int t = 0; t < n_tiles; ++t) {
        ptx::wait_all();
        wg::fence_proxy_async();  // this thread's Q / P / cp.async writes, seen by the MMAs
        __syncthreads();          // tile t visible; both warpgroups are done with tile t − 1 and P
        if (t + 1 < n_tiles) load_tile(t + 1);
        const u32 kt = s_k + (t & 1) * KB * BLK;
        const int rows = min(TN, c1 - (c0 + t * TN));

        // S = Q·Kᵀ for tile rows 32wgi.. (K-major A and B, 8-row groups 1024 bytes apart).
        float s[16];
        wg::fence();
        for (int ks = 0; ks < KS; ++ks) {
            const u32 koff = (ks >> 2) * BLK + (ks & 3) * 32;
            wg::mma_m64n32k16<0>(s, wg::desc_sw128(s_q + koff, 16, 1024),
                                 wg::desc_sw128(kt + koff + wgi * 32 * 128, 16, 1024), ks > 0);
        }
        wg::commit();
        wg::wait<0>();

        // Tile max of heads 16wi + g (+ 8) over this half, then over both halves.
        float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int e = 0; e < 16; ++e) {
            if (32 * wgi + 8 * (e >> 2) + 2 * t4 + (e & 1) >= rows) s[e] = neg_inf();
            mx[(e >> 1) & 1] = fmaxf(mx[(e >> 1) & 1], s[e]);
        }
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            mx[k] = fmaxf(mx[k], __shfl_xor_sync(FULL_MASK, mx[k], 1));
            mx[k] = fmaxf(mx[k], __shfl_xor_sync(FULL_MASK, mx[k], 2));
            if (t4 == 0) mx_s[wgi * HB + 16 * wi + g + 8 * k] = mx[k];
        }
        __syncthreads();
        float cr[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int h = 16 * wi + g + 8 * k;
            // Finite: row 0 of the tile is valid (both warpgroups compute the same maxima).
            const float mn = fmaxf(m_run[k], fmaxf(mx_s[h], mx_s[HB + h]));
            cr[k] = exp2f(m_run[k] - mn);
            m_run[k] = mn;
            float ps = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                // P in bf16 as P·V reads it; the row sums add the same rounded values.
                const u32 pk = ptx::pack_bf16x2(exp2f(s[4 * j + 2 * k] - mn), exp2f(s[4 * j + 2 * k + 1] - mn));
                ps += __uint_as_float(pk << 16) + __uint_as_float(pk & 0xffff0000u);
                *reinterpret_cast<u32*>(sm + p_off + sw(h, 4 * wgi + j, HB) + 4 * t4) = pk;
            }
            l_run[k] = l_run[k] * cr[k] + ps;
        }
#pragma unroll
        for (int n = 0; n < MAX_NB; ++n)
#pragma unroll
            for (int e = 0; e < 32; ++e) o[n][e] *= cr[(e >> 1) & 1];
        wg::fence_proxy_async();
        __syncthreads();  // P complete

        // O[:, this warpgroup's columns] += P·V: A = P (K-major), B = V = the tile's first KVL
        // columns read MN-major (64-column blocks BLK apart, 8-row groups 1024 bytes apart).
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < TN / 16; ++kk) {
            const u64 a = wg::desc_sw128(s_p + kk * 32, 16, 1024);
#pragma unroll
            for (int n = 0; n < MAX_NB; ++n)
                if (n < NB)
                    wg::mma_m64n64k16<1>(o[n], a, wg::desc_sw128(kt + (wgi * NB + n) * BLK + kk * 16 * 128, BLK, 1024),
                                         1);
        }
        wg::commit();
        wg::wait<0>();
    }

    // Row sums: the 4 lanes of a row, then the two halves through shared memory.
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        float l = l_run[k];
        l += __shfl_xor_sync(FULL_MASK, l, 1);
        l += __shfl_xor_sync(FULL_MASK, l, 2);
        const int h = 16 * wi + g + 8 * k;
        if (t4 == 0) {
            lsum_s[wgi * HB + h] = l;
            if (wgi == 0) m_s[h] = m_run[k];
        }
    }
    __syncthreads();

    // O (normalized when n_split = 1) → shared memory [64][OP] f32 over the free tile buffers,
    // then out to global in 16-byte stores, a warp per head row: the fragments' 8-byte stores to
    // global touch 8 rows each and throttled the store queue (a third of the time at T = 32768).
    const int OP = 64 * (KVL + 8) * 4 <= (int)(2 * KB * BLK) ? KVL + 8 : KVL;  // + 8: no bank conflicts
    float* os = reinterpret_cast<float*>(sm + KB * BLK);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int h = 16 * wi + g + 8 * k;
        const float L = lsum_s[h] + lsum_s[HB + h];
        const float f = n_split > 1 ? 1.0f : (L > 0.0f ? 1.0f / L : 0.0f);
#pragma unroll
        for (int n = 0; n < MAX_NB; ++n) {
            if (n >= NB) continue;
#pragma unroll
            for (int j = 0; j < 8; ++j)
                *reinterpret_cast<float2*>(os + h * OP + (wgi * NB + n) * 64 + 8 * j + 2 * t4) =
                    make_float2(o[n][4 * j + 2 * k] * f, o[n][4 * j + 2 * k + 1] * f);
        }
    }
    __syncthreads();
    float* work_acc = mla_detail::work_acc_of(work, n_head, KVL, n_split);
    float* work_ml = mla_detail::work_ml_of(work, n_head, KVL, n_split, n_q);
    for (int h = warp; h < hb; h += 8) {
        const i64 hg = h_base + h;
        float* dst = n_split == 1 ? out + hg * KVL : work_acc + (hg * n_split + sp) * KVL;
        for (int c = 4 * lane; c < KVL; c += 128)
            *reinterpret_cast<float4*>(dst + c) = *reinterpret_cast<const float4*>(os + h * OP + c);
    }
    if (n_split > 1) mla_tile::finish_split(out, work, work_ml, m_s, lsum_s, n_head, h_base, hb, KVL, n_split, phase);
}

}  // namespace mla_wg
#endif

// The tensor-core path for this target: warpgroup MMAs on sm_90a, mma.sync elsewhere.
template <int DC, int KVLC, bool SPARSE>
__device__ __forceinline__ void run_tensor_cores(const float* q, const void* cache, const int* idx, float* out,
                                                 float* work, int n_head, int kvl, int d, int T, int max_ctx,
                                                 int n_split, float scale, int phase, int n_q) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    mla_wg::run<DC, KVLC, SPARSE>(q, cache, idx, out, work, n_head, kvl, d, T, max_ctx, n_split, scale, phase, n_q);
#else
    mla_tc::run<DC, KVLC, SPARSE>(q, cache, idx, out, work, n_head, kvl, d, T, max_ctx, n_split, scale, phase, n_q);
#endif
}

namespace mla_detail {

// Per-query setup shared with mla_sparse_decode: moves q and out to query blockIdx.z. False when
// this block has nothing to do (past n_head or n_q).
__device__ __forceinline__ bool select_query(const float*& q, float*& out, int n_head, int kvl, int D, int n_q) {
    if ((int)blockIdx.y * HB >= n_head || (int)blockIdx.z >= n_q) return false;
    q += (i64)blockIdx.z * n_head * D;
    out += (i64)blockIdx.z * n_head * kvl;
    return true;
}

// NaN over this head block of out (already at its query), from the blocks with blockIdx.x = 0.
__device__ __forceinline__ void write_nan(float* out, int n_head, int kvl) {
    if (blockIdx.x != 0) return;
    const int h0 = blockIdx.y * HB;
    const int hb = min(HB, n_head - h0);
    for (int i = threadIdx.x; i < hb * kvl; i += 256) out[(i64)h0 * kvl + i] = __int_as_float(0x7fc00000);
}

}  // namespace mla_detail

template <class Cfg>
__device__ __forceinline__ void mla_decode_impl(const float* q, const void* cache, const int* pos, float* out, float* work,
                                                int n_head_rt, int kv_lora_rt, int rope_rt, int max_ctx, int n_split,
                                                float scale, int phase, int n_q) {
    static_assert(Cfg::THREADS == 256, "mla_decode needs THREADS = 256 (64 heads x 4 row quarters)");
    static_assert(Cfg::KV_LORA % 128 == 0 && Cfg::KV_LORA <= 512, "KV_LORA must be a multiple of 128, <= 512");
    const int n_head = dim_or<Cfg::N_HEAD>(n_head_rt);
    const int kvl = dim_or<Cfg::KV_LORA>(kv_lora_rt);
    const int rope = dim_or<Cfg::ROPE>(rope_rt);
    if (!mla_detail::select_query(q, out, n_head, kvl, kvl + rope, n_q)) return;
    const int p = pos[blockIdx.z];
    // The counters serve query 0 only (header): a counter phase over several queries is refused.
    if (p < 0 || p >= max_ctx || (n_q > 1 && n_split > 1 && (phase == 0 || phase == 3))) {
        mla_detail::write_nan(out, n_head, kvl);
        return;
    }
    if (phase == 2) {
        mla_detail::combine_slice(out, work, n_head, kvl, n_split, n_q);
        return;
    }
    constexpr int DC = (Cfg::KV_LORA != 0 && Cfg::ROPE != 0) ? Cfg::KV_LORA + Cfg::ROPE : 0;
    const bool fused = phase == 3 && n_split > 1;
    const int run_phase = fused ? 1 : phase;
    if constexpr (Cfg::CACHE_T == CacheType::BF16) {
        run_tensor_cores<DC, Cfg::KV_LORA, false>(q, cache, nullptr, out, work, n_head, kvl, kvl + rope, p + 1,
                                                  max_ctx, n_split, scale, run_phase, n_q);
    } else {
        mla_detail::run<Cfg::CACHE_T, DC, Cfg::KV_LORA, false>(q, cache, nullptr, out, work, n_head, kvl, kvl + rope,
                                                                p + 1, max_ctx, n_split, scale, run_phase, n_q);
    }
    if (fused) mla_detail::barrier_then_merge(out, work, n_head, kvl, n_split);
}

}  // namespace memra

#define MEMRA_DEFINE_MLA_DECODE(SYMBOL, CFG)                                                                  \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                                \
        SYMBOL(const float* q, const void* cache, const int* pos, float* out, float* work, int n_head,         \
               int kv_lora, int rope, int max_ctx, int n_split, float scale, int phase, int n_q) {             \
        memra::pdl_entry();                                                                                    \
        memra::mla_decode_impl<CFG>(q, cache, pos, out, work, n_head, kv_lora, rope, max_ctx, n_split, scale,  \
                                    phase, n_q);                                                               \
    }
