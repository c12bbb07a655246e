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
//   q, cache, out, work, scale, phase (0–3), n_q as mla_decode. idx [n_q, idx_cap] i32 cache
//   rows (each in [0, max_ctx); an index outside reads as a zero row), count [n_q] on the device
//   (dsa_topk's counts): query j attends over idx[j][0..count[j]); count[j] ∉ [1, min(max_ctx,
//   idx_cap)] writes NaN to out[j].
// Geometry: as mla_decode (grid (n_split, ceil(n_head / 64), n_q), block 256, the same dynamic shared
//   memory; the rows split over n_split are the count selected ones).
#pragma once
#include "memra/mla_decode.cuh"

namespace memra {

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
    if (fused) mla_detail::barrier_then_merge(out, work, n_head, kvl, n_split);
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
