// memra/dsa_topk.cuh — exact top-k selection of DSA index scores (model-specs §8.4 step 8), one
// block per query row: indices of the min(k, pos + 1) largest of scores[t][0..=pos[t]], in
// ascending index order, ties broken toward the lower index (memra_reference::dsa::top_k's rule:
// i is kept iff fewer than k indices j have s_j > s_i, or s_j == s_i and j < i; −0 == +0).
//
// Cfg fields:
//   K        int  k (≥ 1); 0 = run time
//   THREADS  int  threads per block (multiple of 32, 256 ≤ THREADS ≤ 1024)
// Kernel parameters:
//   (const float* scores, const int* pos, int* idx, int* count, int n_q, int ld_scores, int k)
//   scores [n_q, ld_scores] f32, pos [n_q] on the device, idx [n_q, k] i32, count [n_q] i32.
//   count[t] = min(k, pos[t] + 1) and idx[t][0..count) the selected keys; when pos[t] + 1 < k the
//   tail idx[t][count..k) is −1. pos[t] ∉ [0, ld_scores): count[t] = −1 and idx[t][..] = −1.
//   NaN scores order above +∞ (the reference refuses them).
// Scheme (radix select on the order-preserving u32 keys of the floats, −0 folded into +0):
//   up to 4 passes of 8 bits from the top, each a shared-memory histogram (warp-aggregated with
//   __match_any_sync) of the keys that match the prefix chosen so far, then a suffix scan picks
//   the digit that holds the k-th largest key; a pass whose chosen bin is taken whole ends the
//   search. Compaction: each warp owns a contiguous range of the row; one pass counts keys above
//   the threshold and equal to it, a scan over warps hands the equal keys' quota to the lowest
//   indices, a second pass writes the kept indices in ascending order (ballot ranks).
//   Reads the row (n + 1)·4 bytes up to 6 times (from L2 when the indexer just wrote it).
// Geometry: grid (n_q), block THREADS, static shared memory about 1.3 KiB.
#pragma once
#include "memra/common.cuh"

namespace memra {
namespace dsa_topk_detail {

constexpr int BINS = 256;
constexpr u32 NO_BIN = 0xffffffffu;

__device__ __forceinline__ u32 key_of(float v) { return float_order_bits(v == 0.0f ? 0.0f : v); }

template <int THREADS> struct Smem {
    u32 hist[BINS];
    u32 warp_sum[THREADS / WARP_SIZE];
    u32 warp_gt[THREADS / WARP_SIZE];
    u32 warp_eq[THREADS / WARP_SIZE];
    u32 digit, remaining, done;
};

template <int THREADS>
__device__ __forceinline__ void topk_row(const float* __restrict__ row, int n, int* __restrict__ out, int k) {
    constexpr int WARPS = THREADS / WARP_SIZE;
    __shared__ Smem<THREADS> s;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const u32 lt_mask = (1u << lane) - 1u;

    u32 prefix = 0, mask = 0, rem = (u32)k;
    for (int pass = 0; pass < 4; ++pass) {
        const int shift = 24 - 8 * pass;
        for (int i = tid; i < BINS; i += THREADS) s.hist[i] = 0;
        __syncthreads();
        for (int base = 0; base < n; base += THREADS) {
            const int i = base + tid;
            u32 d = NO_BIN;
            if (i < n) {
                const u32 key = key_of(row[i]);
                if ((key & mask) == prefix) d = (key >> shift) & (BINS - 1);
            }
            const u32 peers = __match_any_sync(FULL_MASK, d);
            if (d != NO_BIN && lane == __ffs(peers) - 1) atomicAdd(&s.hist[d], (u32)__popc(peers));
        }
        __syncthreads();
        // Threads 0..255 take the bins in descending digit order; inclusive scan = count of keys
        // (with this prefix) whose digit is ≥ the thread's.
        const u32 bin = BINS - 1 - tid;
        u32 v = 0, incl = 0;
        if (tid < BINS) {  // whole warps: BINS is a multiple of 32
            v = s.hist[bin];
            incl = v;
#pragma unroll
            for (int o = 1; o < WARP_SIZE; o <<= 1) {
                const u32 x = __shfl_up_sync(FULL_MASK, incl, o);
                if (lane >= o) incl += x;
            }
            if (lane == WARP_SIZE - 1) s.warp_sum[warp] = incl;
        }
        __syncthreads();
        if (tid < BINS) {
            for (int w2 = 0; w2 < warp; ++w2) incl += s.warp_sum[w2];
            const u32 excl = incl - v;
            if (excl < rem && incl >= rem) {
                s.digit = bin;
                s.remaining = rem - excl;
                s.done = v == rem - excl;
            }
        }
        __syncthreads();
        prefix |= s.digit << shift;
        mask |= (u32)(BINS - 1) << shift;
        rem = s.remaining;
        const bool done = s.done;
        __syncthreads();  // s.digit / s.remaining are rewritten by the next pass
        if (done) break;
    }

    // Compaction over contiguous warp ranges (multiples of 32).
    const int chunk = ((n + WARPS - 1) / WARPS + WARP_SIZE - 1) / WARP_SIZE * WARP_SIZE;
    const int w0 = min(warp * chunk, n), w1 = min(w0 + chunk, n);
    u32 n_gt = 0, n_eq = 0;
    for (int base = w0; base < w1; base += WARP_SIZE) {
        const int i = base + lane;
        const u32 key = i < w1 ? key_of(row[i]) & mask : 0u;
        n_gt += __popc(__ballot_sync(FULL_MASK, i < w1 && key > prefix));
        n_eq += __popc(__ballot_sync(FULL_MASK, i < w1 && key == prefix));
    }
    if (lane == 0) {
        s.warp_gt[warp] = n_gt;
        s.warp_eq[warp] = n_eq;
    }
    __syncthreads();
    // Equal keys before this warp's range, and outputs of the warps before it.
    u32 eq_before = 0, out_base = 0;
    for (int w2 = 0; w2 < warp; ++w2) {
        const u32 e = s.warp_eq[w2];
        const u32 take = eq_before < rem ? min(e, rem - eq_before) : 0u;
        out_base += s.warp_gt[w2] + take;
        eq_before += e;
    }
    u32 eq_seen = eq_before, o = out_base;
    for (int base = w0; base < w1; base += WARP_SIZE) {
        const int i = base + lane;
        const u32 key = i < w1 ? key_of(row[i]) & mask : 0u;
        const bool is_eq = i < w1 && key == prefix;
        const u32 b_eq = __ballot_sync(FULL_MASK, is_eq);
        const bool take = (i < w1 && key > prefix) || (is_eq && eq_seen + __popc(b_eq & lt_mask) < rem);
        const u32 b_take = __ballot_sync(FULL_MASK, take);
        if (take) out[o + __popc(b_take & lt_mask)] = i;
        o += __popc(b_take);
        eq_seen += __popc(b_eq);
    }
}

}  // namespace dsa_topk_detail

template <class Cfg>
__device__ __forceinline__ void dsa_topk_impl(const float* scores, const int* pos, int* idx, int* count, int n_q,
                                              int ld_scores, int k_rt) {
    static_assert(Cfg::THREADS % WARP_SIZE == 0 && Cfg::THREADS >= 256 && Cfg::THREADS <= 1024,
                  "THREADS must be a multiple of 32 in [256, 1024]");
    const int k = dim_or<Cfg::K>(k_rt);
    const int t = blockIdx.x;
    if (t >= n_q) return;
    int* out = idx + (i64)t * k;
    const int p = pos[t];
    if (p < 0 || p >= ld_scores) {
        for (int i = threadIdx.x; i < k; i += Cfg::THREADS) out[i] = -1;
        if (threadIdx.x == 0) count[t] = -1;
        return;
    }
    const int n = p + 1;
    if (n <= k) {
        for (int i = threadIdx.x; i < k; i += Cfg::THREADS) out[i] = i < n ? i : -1;
        if (threadIdx.x == 0) count[t] = n;
        return;
    }
    dsa_topk_detail::topk_row<Cfg::THREADS>(scores + (i64)t * ld_scores, n, out, k);
    if (threadIdx.x == 0) count[t] = k;
}

}  // namespace memra

#define MEMRA_DEFINE_DSA_TOPK(SYMBOL, CFG)                                                                   \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                               \
        SYMBOL(const float* scores, const int* pos, int* idx, int* count, int n_q, int ld_scores, int k) {   \
        memra::pdl_entry();                                                                                 \
        memra::dsa_topk_impl<CFG>(scores, pos, idx, count, n_q, ld_scores, k);                              \
    }
