// memra/mla_sparse_decode.cuh — MLA absorbed decode attention restricted to the DSA-selected
// rows (model-specs §8.1, §8.4 step 9): mla_decode's kernel (mla_decode.cuh) with the row list
// idx[0..count) in place of rows 0..=pos. Every selected latent row is read once per 64 heads.
// With idx = 0..count (all visible rows, as dsa_topk gives for ≤ k visible) it is mla_decode.
//
// Cfg fields: as mla_decode (N_HEAD, KV_LORA, ROPE, CACHE_T, THREADS = 256).
// Kernel parameters:
//   (const float* q, const void* cache, const int* idx, const int* count, float* out, float* work,
//    int n_head, int kv_lora, int rope, int max_ctx, int idx_cap, int n_split, float scale, int phase,
//    int n_q)
//   q, cache, out, work, scale, phase, n_q as mla_decode, plus phase 3 (n_split > 1, n_q = 1: the
//   counters serve query 0 only, as phase 0's): partials, then
//   the n_split blocks of a head block meet at a barrier (the head block's counter at the front
//   of work, left at zero) and merge the partials spread over all of them (phases 1 + 2 in one
//   launch; needs every block of the grid resident at once: n_split · ceil(n_head / 64) ≤ the
//   multiprocessor count, as the tensor-core form's shared memory allows one block per
//   multiprocessor). idx [n_q, idx_cap] i32 cache rows (each in [0, max_ctx); an index outside
//   reads as a zero row), count [n_q] on the device (dsa_topk's counts): query j attends over
//   idx[j][0..count[j]); count[j] ∉ [1, min(max_ctx, idx_cap)] writes NaN to out[j].
// Geometry: as mla_decode (grid (n_split, ceil(n_head / 64), n_q), block 256, the same dynamic shared
//   memory; the rows split over n_split are the count selected ones).
#pragma once
#include "memra/mla_decode.cuh"

namespace memra {
namespace mla_sparse_detail {

// Grid-scope primitives (the counter lives in L2; loads bypass L1).
__device__ __forceinline__ u32 load_volatile(const u32* p) { return *(const volatile u32*)p; }
__device__ __forceinline__ u32 fetch_add(u32* p, u32 v) { return atomicAdd(p, v); }
__device__ __forceinline__ void store_zero(u32* p) { *(volatile u32*)p = 0u; }
// end of grid-scope primitives

// Phase 3 after the partials: the n_split blocks of head block y arrive on its counter, wait for
// all, merge their share of the (head, 128 columns) units, then depart on the same counter; the
// last to depart (counter 2·n_split − 1) sets it back to zero.
__device__ __forceinline__ void barrier_then_merge(float* __restrict__ out, float* work, int n_head, int kvl,
                                                   int n_split) {  // n_q = 1
    u32* counter = reinterpret_cast<u32*>(work) + blockIdx.y;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        fetch_add(counter, 1u);
        while (load_volatile(counter) < (u32)n_split) {
        }
        __threadfence();
    }
    __syncthreads();
    mla_detail::combine_slice(out, work, n_head, kvl, n_split, 1);
    __syncthreads();
    if (threadIdx.x == 0 && fetch_add(counter, 1u) == 2u * (u32)n_split - 1u) store_zero(counter);
}

}  // namespace mla_sparse_detail

template <class Cfg>
__device__ __forceinline__ void mla_sparse_decode_impl(const float* q, const void* cache, const int* idx,
                                                       const int* count, float* out, float* work, int n_head_rt,
                                                       int kv_lora_rt, int rope_rt, int max_ctx, int idx_cap,
                                                       int n_split, float scale, int phase, int n_q) {
    static_assert(Cfg::THREADS == 256, "mla_sparse_decode needs THREADS = 256 (64 heads x 4 row quarters)");
    static_assert(Cfg::KV_LORA % 128 == 0 && Cfg::KV_LORA <= 512, "KV_LORA must be a multiple of 128, <= 512");
    const int n_head = dim_or<Cfg::N_HEAD>(n_head_rt);
    const int kvl = dim_or<Cfg::KV_LORA>(kv_lora_rt);
    const int rope = dim_or<Cfg::ROPE>(rope_rt);
    if (!mla_detail::select_query(q, out, n_head, kvl, kvl + rope, n_q)) return;
    const int n = count[blockIdx.z];
    idx += (i64)blockIdx.z * idx_cap;
    // The counters serve query 0 only (mla_decode's header): counter phases over several queries
    // are refused.
    if (n < 1 || n > max_ctx || n > idx_cap || (n_q > 1 && n_split > 1 && (phase == 0 || phase == 3))) {
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
        run_tensor_cores<DC, Cfg::KV_LORA, true>(q, cache, idx, out, work, n_head, kvl, kvl + rope, n, max_ctx,
                                                 n_split, scale, run_phase, n_q);
    } else {
        mla_detail::run<Cfg::CACHE_T, DC, Cfg::KV_LORA, true>(q, cache, idx, out, work, n_head, kvl, kvl + rope, n,
                                                               max_ctx, n_split, scale, run_phase, n_q);
    }
    if (fused) mla_sparse_detail::barrier_then_merge(out, work, n_head, kvl, n_split);
}

}  // namespace memra

#define MEMRA_DEFINE_MLA_SPARSE_DECODE(SYMBOL, CFG)                                                              \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                                   \
        SYMBOL(const float* q, const void* cache, const int* idx, const int* count, float* out, float* work,      \
               int n_head, int kv_lora, int rope, int max_ctx, int idx_cap, int n_split, float scale, int phase,  \
               int n_q) {                                                                                        \
        memra::pdl_entry();                                                                                      \
        memra::mla_sparse_decode_impl<CFG>(q, cache, idx, count, out, work, n_head, kv_lora, rope, max_ctx,      \
                                           idx_cap, n_split, scale, phase, n_q);                                  \
    }
