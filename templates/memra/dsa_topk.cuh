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
//   gridDim.x blocks of a row split it into contiguous chunks. Pass 0 (top 11 bits): each block
//   histograms its chunk (shared memory, warp-aggregated with __match_any_sync); with several
//   blocks the nonzero bins are added into the row's histogram in scratch and the blocks meet at
//   a grid barrier; every block then reads the whole histogram and picks, by the same suffix
//   scan, the digit holding the k-th largest key (a bin taken whole ends the search). Several
//   blocks: the keys in that bin are gathered into a candidate list in scratch (with each
//   block's count of keys above the bin); after a second barrier, if the list holds them all
//   (≤ CAND_CAP), every block finishes the select (11- and 10-bit passes) on it in shared
//   memory and derives its output offset from it and the counts — 2 barriers in all. Otherwise
//   (and with one block) passes 1 and 2 follow as histograms, then a count exchange. Ordered
//   compaction: warps own contiguous ranges of the chunk and write with ballot ranks, the equal
//   keys' quota going to the lowest indices. Chunks are re-read from L1/L2 on every pass.
// Geometry: grid (n_blk, n_q) with n_blk ≥ 1 blocks per row; with n_blk > 1 ALL n_blk · n_q blocks
//   must be resident at once (they wait for each other): n_blk · n_q ≤ the multiprocessor count
//   (memra_engine::kernels::dsa_topk::blocks_for). Block THREADS, static shared memory ~41 KiB.
#pragma once
#include "memra/common.cuh"

namespace memra {
namespace dsa_topk_detail {

constexpr int BINS = 2048;  // 11-bit digits (the last pass uses 10)
constexpr u32 NO_BIN = 0xffffffffu;
constexpr int UNROLL = 4;
// Per-row scratch: [0] barrier arrivals, [1] departures, [2] candidates (row padded to 128
// bytes), then one histogram per pass, (above, equal) counts per block, candidate keys and
// indices.
constexpr int CTRL_WORDS = 32;
constexpr int PASSES = 3;
constexpr int CAND_CAP = 4096;  // candidate list capacity (keys in pass 0's threshold bin)
__host__ __device__ constexpr int row_words(int n_blk) { return CTRL_WORDS + PASSES * BINS + 2 * n_blk + 2 * CAND_CAP; }

__device__ __forceinline__ u32 key_of(float v) { return float_order_bits(v == 0.0f ? 0.0f : v); }

template <int THREADS> struct Smem {
    u32 hist[BINS];
    u32 warp_a[THREADS / WARP_SIZE];
    u32 warp_b[THREADS / WARP_SIZE];
    u32 red_a[THREADS / WARP_SIZE];
    u32 red_b[THREADS / WARP_SIZE];
    u32 digit, remaining, done, base, flag;
    u32 cand_key[CAND_CAP];  // the row's candidates (keys in the threshold bin of pass 0)
    int cand_idx[CAND_CAP];
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

// Warp-aggregated shared-memory histogram update of digit d (NO_BIN: none); all lanes call it.
template <int THREADS>
__device__ __forceinline__ void hist_add(Smem<THREADS>& s, u32 d) {
    const u32 peers = __match_any_sync(FULL_MASK, d);
    if (d != NO_BIN && (int)(threadIdx.x % WARP_SIZE) == __ffs(peers) - 1) atomicAdd(&s.hist[d], (u32)__popc(peers));
}

// Picks the digit of s.hist holding the rem-th largest key: updates prefix / mask / rem, returns
// whether that digit's bin is taken whole. Every thread calls it (s.hist complete and visible).
template <int THREADS>
__device__ __forceinline__ bool pick_digit(Smem<THREADS>& s, int shift, u32 dmask, u32& prefix, u32& mask, u32& rem) {
    constexpr int PER = BINS / THREADS;  // bins per thread
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    // Thread tid takes PER consecutive bins in descending digit order; the inclusive scan of the
    // per-thread sums counts the keys (with this prefix) whose digit is ≥ its bins'.
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
    return done;
}

// Selects idx of row[0..n) for the gridDim.x blocks of one row (this block: blockIdx.x).
// Several blocks: pass 0 (top 11 bits) is a grid histogram; then, when the keys in its
// threshold bin number at most CAND_CAP, they are gathered into scratch with each block's count
// of keys above the bin, and after one more barrier every block finishes the select on that
// candidate list in shared memory and derives its output offset from it (2 barriers in all);
// otherwise passes 1 and 2 run as grid histograms and a count exchange orders the output.
template <int THREADS>
__device__ __forceinline__ void topk_row(const float* __restrict__ row, int n, int* __restrict__ out, int k,
                                         u32* scratch) {
    constexpr int WARPS = THREADS / WARP_SIZE;
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
    u32* cand_n = scratch + 2;
    u32* counts = scratch + CTRL_WORDS + PASSES * BINS;
    u32* cand_key = counts + 2 * n_blk;
    u32* cand_idx = cand_key + CAND_CAP;
    u32 barriers = 0;

    u32 prefix = 0, mask = 0, rem = (u32)k;
    int last_pass = 0;
    bool from_cands = false;  // the select finished on the candidate list
    u32 m = 0;                // candidates
    u32 gt_before = 0, eq_before = 0;
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
                hist_add(s, i < c1 && (keys[j] & mask) == prefix ? (keys[j] >> shift) & dmask : NO_BIN);
            }
        }
        __syncthreads();
        if (multi) {
            u32* g = scratch + CTRL_WORDS + pass * BINS;
            for (int i = tid; i < BINS; i += THREADS)
                if (s.hist[i] != 0) grid::red_add(&g[i], s.hist[i]);
            grid::barrier(arrive, ++barriers * (u32)n_blk);
            for (int i = tid; i < BINS; i += THREADS) s.hist[i] = grid::load_volatile(&g[i]);
            // Every block read the previous pass's histogram before this barrier: clear it.
            if (pass > 0 && b == 0)
                for (int i = tid; i < BINS; i += THREADS) grid::store_zero(&g[i - BINS]);
            __syncthreads();
        }
        if (pick_digit(s, shift, dmask, prefix, mask, rem)) break;
        if (!(multi && pass == 0)) continue;

        // Candidate round: keys above the bin are counted, keys in it gathered.
        if (tid == 0) s.base = 0;
        __syncthreads();
        u32 above = 0;
        for (int base = c0; base < c1; base += THREADS) {
            const int i = base + tid;
            const u32 key = i < c1 ? key_of(row[i]) : 0u;
            above += i < c1 && (key & mask) > prefix;
            const bool in_bin = i < c1 && (key & mask) == prefix;
            const u32 bal = __ballot_sync(FULL_MASK, in_bin);
            u32 slot = 0;
            if (lane == 0 && bal != 0) slot = atomicAdd(&s.base, (u32)__popc(bal));
            slot = __shfl_sync(FULL_MASK, slot, 0) + __popc(bal & lt_mask);
            if (in_bin && slot < CAND_CAP) {
                s.cand_key[slot] = key;
                s.cand_idx[slot] = i;
            }
        }
        u32 zero = 0;
        block_sum2<THREADS>(s, above, zero);
        // This block's candidates go to [at, at + mine) of the row's list.
        const u32 mine = s.base;
        if (tid == 0) {
            s.flag = grid::fetch_add(cand_n, mine);
            counts[2 * b] = above;
        }
        __syncthreads();
        const u32 at = s.flag;
        for (u32 j = tid; j < mine && at + j < CAND_CAP && j < CAND_CAP; j += THREADS) {
            cand_key[at + j] = s.cand_key[j];
            cand_idx[at + j] = (u32)s.cand_idx[j];
        }
        grid::barrier(arrive, ++barriers * (u32)n_blk);
        m = grid::load_volatile(cand_n);
        if (b == 0)  // every block read hist 0 before this barrier
            for (int i = tid; i < BINS; i += THREADS) grid::store_zero(&scratch[CTRL_WORDS + i]);
        if (m > (u32)CAND_CAP) continue;  // too many: passes 1 and 2 as grid histograms
        from_cands = true;
        for (u32 j = tid; j < m; j += THREADS) {
            s.cand_key[j] = grid::load_volatile(&cand_key[j]);
            s.cand_idx[j] = (int)grid::load_volatile(&cand_idx[j]);
        }
        u32 a = 0;
        for (int b2 = tid; b2 < b; b2 += THREADS) a += grid::load_volatile(&counts[2 * b2]);
        block_sum2<THREADS>(s, a, zero);  // its barriers publish the candidates too
        gt_before = a;
        // Passes 1 and 2 on the candidates, in this block alone.
#pragma unroll 1
        for (int p2 = 1; p2 < PASSES; ++p2) {
            const int sh = p2 == 1 ? 10 : 0;
            const u32 dm = p2 == 2 ? 1023u : 2047u;
            for (int i = tid; i < BINS; i += THREADS) s.hist[i] = 0;
            __syncthreads();
            for (u32 base = 0; base < m; base += THREADS) {
                const u32 j = base + tid;
                const u32 key = j < m ? s.cand_key[j] : 0u;
                hist_add(s, j < m && (key & mask) == prefix ? (key >> sh) & dm : NO_BIN);
            }
            __syncthreads();
            if (pick_digit(s, sh, dm, prefix, mask, rem)) break;
        }
        // Candidates before this chunk: above the threshold, and equal to it.
        u32 cg = 0, ce = 0;
        for (u32 j = tid; j < m; j += THREADS) {
            const u32 key = s.cand_key[j] & mask;
            if (s.cand_idx[j] < c0) {
                cg += key > prefix;
                ce += key == prefix;
            }
        }
        block_sum2<THREADS>(s, cg, ce);
        gt_before += cg;
        eq_before = ce;
        break;
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
    if (multi && !from_cands) {
        // Above-threshold and equal keys of the blocks before this one (a grid exchange).
        if (tid == 0) {
            u32 a = 0, e = 0;
            for (int w2 = 0; w2 < WARPS; ++w2) {
                a += s.warp_a[w2];
                e += s.warp_b[w2];
            }
            counts[2 * b] = a;
            counts[2 * b + 1] = e;
        }
        grid::barrier(arrive, ++barriers * (u32)n_blk);
        if (b == 0)
            for (int i = tid; i < BINS; i += THREADS) grid::store_zero(&scratch[CTRL_WORDS + last_pass * BINS + i]);
        u32 a = 0, e = 0;
        for (int b2 = tid; b2 < b; b2 += THREADS) {
            a += grid::load_volatile(&counts[2 * b2]);
            e += grid::load_volatile(&counts[2 * b2 + 1]);
        }
        block_sum2<THREADS>(s, a, e);
        gt_before = a;
        eq_before = e;
    }
    if (multi) {
        // The last block to leave (every block has read the exchanged data) leaves the row's
        // scratch zero, with all its threads.
        if (tid == 0) s.flag = grid::fetch_add(depart, 1u) == (u32)n_blk - 1u;
        __syncthreads();
        if (s.flag) {
            const u32 nc = m < (u32)CAND_CAP ? m : (u32)CAND_CAP;
            for (u32 i = tid; i < nc; i += THREADS) {
                grid::store_zero(&cand_key[i]);
                grid::store_zero(&cand_idx[i]);
            }
            for (int i = tid; i < 2 * n_blk; i += THREADS) grid::store_zero(&counts[i]);
            if (tid == 0) {
                grid::store_zero(cand_n);
                grid::store_zero(arrive);
                grid::store_zero(depart);
            }
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
    extern "C" __global__ void __launch_bounds__(CFG::THREADS, 1)                                            \
        SYMBOL(const float* scores, const int* pos, int* idx, int* count, unsigned* scratch, int n_q,         \
               int ld_scores, int k) {                                                                       \
        memra::pdl_entry();                                                                                 \
        memra::dsa_topk_impl<CFG>(scores, pos, idx, count, scratch, n_q, ld_scores, k);                     \
    }
