// memra/dsa_topk.cuh — exact top-k selection of DSA index scores (model-specs §8.4 step 8): per
// query row t the indices of the min(k, pos + 1) largest of scores[t][0..=pos[t]], in ascending
// index order, ties broken toward the lower index (memra_reference::dsa::top_k's rule: i is kept
// iff fewer than k indices j have s_j > s_i, or s_j == s_i and j < i; −0 == +0).
//
// Cfg fields:
//   K        int  k (≥ 1); 0 = run time
//   THREADS  int  threads per block (256, 512 or 1024)
// Kernel parameters:
//   (const float* scores, const int* pos, int* idx, int* count, unsigned* scratch, int n_q,
//    int ld_scores, int k)
//   scores [n_q, ld_scores] f32, pos [n_q] on the device, idx [n_q, k] i32, count [n_q] i32.
//   count[t] = min(k, pos[t] + 1) and idx[t][0..count) the selected keys; when pos[t] + 1 < k the
//   tail idx[t][count..k) is −1. pos[t] ∉ [0, ld_scores): count[t] = −1 and idx[t][..] = −1.
//   NaN scores order above +∞ (the reference refuses them).
//   scratch: n_q · dsa_topk_detail::row_words(gridDim.x) u32, zeroed once when allocated (each
//   launch leaves it zero); unused (may be null) when gridDim.x == 1.
// Scheme (radix select on the order-preserving u32 keys of the floats, −0 folded into +0): the
//   gridDim.x blocks of a row split it into contiguous chunks. Three passes of 11, 11 and 10 bits
//   from the top: each block histograms (shared memory, warp-aggregated with __match_any_sync)
//   the keys of its chunk that match the prefix chosen so far; with several blocks the nonzero
//   bins are added into the row's histogram in scratch and the blocks meet at a grid barrier,
//   then every block reads the whole histogram and picks, by the same suffix scan, the digit that
//   holds the k-th largest key (a pass whose chosen bin is taken whole ends the search). Ordered
//   compaction: each block counts its keys above the threshold and equal to it, the blocks meet
//   again and each derives its output offset and its share of the equal keys (the lowest indices
//   win) from the counts of the blocks before it; inside a block, warps own contiguous ranges
//   and write with ballot ranks. Chunks are re-read from L1/L2 on every pass.
// Geometry: grid (n_blk, n_q) with n_blk ≥ 1 blocks per row; with n_blk > 1 ALL n_blk · n_q blocks
//   must be resident at once (they wait for each other): n_blk · n_q ≤ the multiprocessor count
//   (memra_engine::kernels::dsa_topk::blocks_for). Block THREADS, static shared memory ~8.6 KiB.
#pragma once
#include "memra/common.cuh"

namespace memra {
namespace dsa_topk_detail {

constexpr int BINS = 2048;  // 11-bit digits (the last pass uses 10)
constexpr u32 NO_BIN = 0xffffffffu;
constexpr int UNROLL = 4;
// Per-row scratch: [0] barrier arrivals, [1] departures (row padded to 128 bytes), then one
// histogram per pass, then (above, equal) counts per block.
constexpr int CTRL_WORDS = 32;
constexpr int PASSES = 3;
__host__ __device__ constexpr int row_words(int n_blk) { return CTRL_WORDS + PASSES * BINS + 2 * n_blk; }

__device__ __forceinline__ u32 key_of(float v) { return float_order_bits(v == 0.0f ? 0.0f : v); }

// Grid-scope primitives (scratch lives in L2; loads bypass L1, which is not coherent across SMs).
__device__ __forceinline__ u32 load_volatile(const u32* p) { return *(const volatile u32*)p; }
__device__ __forceinline__ void red_add(u32* p, u32 v) { atomicAdd(p, v); }
__device__ __forceinline__ u32 fetch_add(u32* p, u32 v) { return atomicAdd(p, v); }
__device__ __forceinline__ void store_zero(u32* p) { *(volatile u32*)p = 0u; }
// All blocks of the row arrive; returns when `target` arrivals have been counted.
__device__ __forceinline__ void row_barrier(u32* arrive, u32 target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        red_add(arrive, 1u);
        while (load_volatile(arrive) < target) {
        }
        __threadfence();
    }
    __syncthreads();
}
// end of grid-scope primitives

template <int THREADS> struct Smem {
    u32 hist[BINS];
    u32 warp_a[THREADS / WARP_SIZE];
    u32 warp_b[THREADS / WARP_SIZE];
    u32 red_a[THREADS / WARP_SIZE];
    u32 red_b[THREADS / WARP_SIZE];
    u32 digit, remaining, done, base_gt, base_eq;
};

// Block sums of a and b (every thread gets them), through s.red_a / red_b.
template <int THREADS>
__device__ __forceinline__ void block_sum2(Smem<THREADS>& s, u32& a, u32& b) {
    constexpr int WARPS = THREADS / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_xor_sync(FULL_MASK, a, o);
        b += __shfl_xor_sync(FULL_MASK, b, o);
    }
    if (lane == 0) {
        s.red_a[warp] = a;
        s.red_b[warp] = b;
    }
    __syncthreads();
    a = 0;
    b = 0;
    for (int w = 0; w < WARPS; ++w) {
        a += s.red_a[w];
        b += s.red_b[w];
    }
    __syncthreads();
}

// Selects idx of row[0..n) for the gridDim.x blocks of one row (this block: blockIdx.x).
template <int THREADS>
__device__ __forceinline__ void topk_row(const float* __restrict__ row, int n, int* __restrict__ out, int k,
                                         u32* scratch) {
    constexpr int WARPS = THREADS / WARP_SIZE;
    constexpr int PER = BINS / THREADS;  // bins per thread in the digit scan
    __shared__ Smem<THREADS> s;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const u32 lt_mask = (1u << lane) - 1u;
    const int n_blk = gridDim.x, b = blockIdx.x;
    const bool multi = n_blk > 1;
    // This block's chunk [c0, c1), a multiple of 32 long.
    const i64 chunk = ((i64)n / n_blk + (n % n_blk != 0) + WARP_SIZE - 1) / WARP_SIZE * WARP_SIZE;
    const i64 c0_ = (i64)b * chunk < n ? (i64)b * chunk : (i64)n;
    const int c0 = (int)c0_, c1 = (int)(c0_ + chunk < n ? c0_ + chunk : (i64)n);
    u32* arrive = scratch;
    u32* depart = scratch + 1;
    u32 barriers = 0;

    u32 prefix = 0, mask = 0, rem = (u32)k;
    int last_pass = 0;
#pragma unroll 1
    for (int pass = 0; pass < PASSES; ++pass) {
        const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0;
        const u32 dmask = pass == 2 ? 1023u : 2047u;
        last_pass = pass;
        for (int i = tid; i < BINS; i += THREADS) s.hist[i] = 0;
        __syncthreads();
        // UNROLL loads in flight per thread (a long single-block row is latency bound).
        for (int base = c0; base < c1; base += UNROLL * THREADS) {
            u32 keys[UNROLL];
#pragma unroll
            for (int j = 0; j < UNROLL; ++j) {
                const int i = base + j * THREADS + tid;
                keys[j] = i < c1 ? key_of(row[i]) : 0u;
            }
#pragma unroll
            for (int j = 0; j < UNROLL; ++j) {
                const int i = base + j * THREADS + tid;
                const u32 d = i < c1 && (keys[j] & mask) == prefix ? (keys[j] >> shift) & dmask : NO_BIN;
                const u32 peers = __match_any_sync(FULL_MASK, d);
                if (d != NO_BIN && lane == __ffs(peers) - 1) atomicAdd(&s.hist[d], (u32)__popc(peers));
            }
        }
        __syncthreads();
        if (multi) {
            u32* g = scratch + CTRL_WORDS + pass * BINS;
            for (int i = tid; i < BINS; i += THREADS)
                if (s.hist[i] != 0) red_add(&g[i], s.hist[i]);
            row_barrier(arrive, ++barriers * (u32)n_blk);
            for (int i = tid; i < BINS; i += THREADS) s.hist[i] = load_volatile(&g[i]);
            // Every block read the previous pass's histogram before this barrier: clear it.
            if (pass > 0 && b == 0)
                for (int i = tid; i < BINS; i += THREADS) store_zero(&g[i - BINS]);
            __syncthreads();
        }
        // Thread tid takes PER consecutive bins in descending digit order; the inclusive scan of
        // the per-thread sums counts the keys (with this prefix) whose digit is ≥ its bins'.
        const int hi = BINS - 1 - tid * PER;
        u32 mine = 0;
#pragma unroll
        for (int j = 0; j < PER; ++j) mine += s.hist[hi - j];
        u32 incl = mine;
#pragma unroll
        for (int o = 1; o < WARP_SIZE; o <<= 1) {
            const u32 x = __shfl_up_sync(FULL_MASK, incl, o);
            if (lane >= o) incl += x;
        }
        if (lane == WARP_SIZE - 1) s.warp_a[warp] = incl;
        __syncthreads();
        for (int w2 = 0; w2 < warp; ++w2) incl += s.warp_a[w2];
        u32 run = incl - mine;
        if (run < rem && incl >= rem) {
#pragma unroll 1
            for (int j = 0; j < PER; ++j) {
                const u32 v = s.hist[hi - j];
                if (run < rem && run + v >= rem) {
                    s.digit = (u32)(hi - j);
                    s.remaining = rem - run;
                    s.done = v == rem - run;
                }
                run += v;
            }
        }
        __syncthreads();
        prefix |= s.digit << shift;
        mask |= dmask << shift;
        rem = s.remaining;
        const bool done = s.done;
        __syncthreads();  // s.digit / s.remaining / warp_a are rewritten next
        if (done) break;
    }

    // Ordered compaction. Warp ranges inside the chunk are contiguous multiples of 32.
    const int wchunk = ((c1 - c0 + WARPS - 1) / WARPS + WARP_SIZE - 1) / WARP_SIZE * WARP_SIZE;
    const int w0 = min(c0 + warp * wchunk, c1), w1 = min(w0 + wchunk, c1);
    u32 n_gt = 0, n_eq = 0;
    for (int base = w0; base < w1; base += UNROLL * WARP_SIZE) {
        u32 keys[UNROLL];
#pragma unroll
        for (int j = 0; j < UNROLL; ++j) {
            const int i = base + j * WARP_SIZE + lane;
            keys[j] = i < w1 ? key_of(row[i]) & mask : 0u;
        }
#pragma unroll
        for (int j = 0; j < UNROLL; ++j) {
            const int i = base + j * WARP_SIZE + lane;
            n_gt += __popc(__ballot_sync(FULL_MASK, i < w1 && keys[j] > prefix));
            n_eq += __popc(__ballot_sync(FULL_MASK, i < w1 && keys[j] == prefix));
        }
    }
    if (lane == 0) {
        s.warp_a[warp] = n_gt;
        s.warp_b[warp] = n_eq;
    }
    __syncthreads();
    // Above-threshold and equal keys of the blocks before this one (a grid exchange).
    u32 gt_before = 0, eq_before = 0;
    if (multi) {
        u32* counts = scratch + CTRL_WORDS + PASSES * BINS;
        if (tid == 0) {
            u32 a = 0, e = 0;
            for (int w2 = 0; w2 < WARPS; ++w2) {
                a += s.warp_a[w2];
                e += s.warp_b[w2];
            }
            counts[2 * b] = a;
            counts[2 * b + 1] = e;
        }
        row_barrier(arrive, ++barriers * (u32)n_blk);
        if (b == 0)
            for (int i = tid; i < BINS; i += THREADS) store_zero(&scratch[CTRL_WORDS + last_pass * BINS + i]);
        u32 a = 0, e = 0;
        for (int b2 = tid; b2 < b; b2 += THREADS) {
            a += load_volatile(&counts[2 * b2]);
            e += load_volatile(&counts[2 * b2 + 1]);
        }
        block_sum2<THREADS>(s, a, e);
        gt_before = a;
        eq_before = e;
        // The last block to leave (every block has read the counts) leaves the row's scratch zero.
        if (tid == 0 && fetch_add(depart, 1u) == (u32)n_blk - 1u) {
            for (int i = 0; i < 2 * n_blk; ++i) store_zero(&counts[i]);
            store_zero(arrive);
            store_zero(depart);
        }
    }
    __syncthreads();
    // Output offset of this warp's range: keys above before it, plus the equal keys before it
    // that fit the quota (the lowest indices take it).
    for (int w2 = 0; w2 < warp; ++w2) {
        gt_before += s.warp_a[w2];
        eq_before += s.warp_b[w2];
    }
    u32 eq_seen = eq_before, o = gt_before + min(eq_before, rem);
    for (int base = w0; base < w1; base += UNROLL * WARP_SIZE) {
        u32 keys[UNROLL];
#pragma unroll
        for (int j = 0; j < UNROLL; ++j) {
            const int i = base + j * WARP_SIZE + lane;
            keys[j] = i < w1 ? key_of(row[i]) & mask : 0u;
        }
#pragma unroll
        for (int j = 0; j < UNROLL; ++j) {
            const int i = base + j * WARP_SIZE + lane;
            const bool is_eq = i < w1 && keys[j] == prefix;
            const u32 b_eq = __ballot_sync(FULL_MASK, is_eq);
            const bool take = (i < w1 && keys[j] > prefix) || (is_eq && eq_seen + __popc(b_eq & lt_mask) < rem);
            const u32 b_take = __ballot_sync(FULL_MASK, take);
            if (take) out[o + __popc(b_take & lt_mask)] = i;
            o += __popc(b_take);
            eq_seen += __popc(b_eq);
        }
    }
}

}  // namespace dsa_topk_detail

template <class Cfg>
__device__ __forceinline__ void dsa_topk_impl(const float* scores, const int* pos, int* idx, int* count,
                                              unsigned* scratch, int n_q, int ld_scores, int k_rt) {
    static_assert(Cfg::THREADS == 256 || Cfg::THREADS == 512 || Cfg::THREADS == 1024,
                  "THREADS must be 256, 512 or 1024");
    const int k = dim_or<Cfg::K>(k_rt);
    for (int t = blockIdx.y; t < n_q; t += gridDim.y) {
        int* out = idx + (i64)t * k;
        const int p = pos[t];
        // Blocks of a row split the writes of the short cases.
        const int first = blockIdx.x * Cfg::THREADS + threadIdx.x, stride = gridDim.x * Cfg::THREADS;
        const bool lead = blockIdx.x == 0 && threadIdx.x == 0;
        if (p < 0 || p >= ld_scores) {
            for (int i = first; i < k; i += stride) out[i] = -1;
            if (lead) count[t] = -1;
            continue;
        }
        const int n = p + 1;
        if (n <= k) {
            for (int i = first; i < k; i += stride) out[i] = i < n ? i : -1;
            if (lead) count[t] = n;
            continue;
        }
        u32* rs = gridDim.x > 1 ? scratch + (i64)t * dsa_topk_detail::row_words(gridDim.x) : nullptr;
        dsa_topk_detail::topk_row<Cfg::THREADS>(scores + (i64)t * ld_scores, n, out, k, rs);
        if (lead) count[t] = k;
    }
}

}  // namespace memra

#define MEMRA_DEFINE_DSA_TOPK(SYMBOL, CFG)                                                                   \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                               \
        SYMBOL(const float* scores, const int* pos, int* idx, int* count, unsigned* scratch, int n_q,         \
               int ld_scores, int k) {                                                                       \
        memra::pdl_entry();                                                                                 \
        memra::dsa_topk_impl<CFG>(scores, pos, idx, count, scratch, n_q, ld_scores, k);                     \
    }
