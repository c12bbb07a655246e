// memra/topk.cuh — top-k of f32 logit rows (sorted descending, ties: lower index first), and
// the two-stage selection engine shared with argmax.cuh.
//
// Cfg fields:
//   N_VOCAB  int  row length n_vocab; 0 = run time
//   K        int  k (1 <= k <= 64, k <= n_vocab); 0 = run time
//   THREADS  int  threads per block (multiple of 32)
// Kernel parameters: (const float* logits, float* out_val, int* out_idx, void* scratch,
//                     int n_rows, int n_vocab, int k)
//   logits [n_rows, n_vocab]; out_val / out_idx [n_rows, k].
// Geometry: B = ceil(n_vocab / (8·THREADS)) blocks per row, grid (B, min(n_rows, 65535)) —
//   grid.x must be exactly B (rows use a grid stride) — block THREADS, no dynamic smem;
//   requires B·k <= 32·THREADS.
// Scratch: n_rows·B·k u64 partials, then n_rows u32 counters (n_rows·B·k·8 + n_rows·4 bytes),
//   zeroed once at allocation; the kernel returns every counter to zero.
// Scheme: stage 1, each block takes the top-k of its 8·THREADS logits (8 per thread, in
//   registers) by k rounds of a block-wide max over per-thread bests, and writes them to the
//   scratch; stage 2, the block that finishes a row last (atomic counter) does the same over
//   the B·k partials (up to 32 per thread) and writes the outputs.
// Values and indices travel as arg-keys (common.cuh): u64 max = larger value, then lower index.
#pragma once
#include "memra/common.cuh"

namespace memra {
namespace topk_detail {

constexpr int ITEMS = 8;          // logits per thread in stage 1
constexpr int MERGE_ITEMS = 32;   // partials per thread in stage 2
constexpr int MAX_K = 64;

template <int THREADS> struct Shared {
    u64 slots[2][THREADS / WARP_SIZE];  // block max, double-buffered by round parity
    int is_last;
};

template <int THREADS> __device__ __forceinline__ u64 block_max_key(u64 v, Shared<THREADS>& sh, int round) {
    v = warp_max_u64(v);
    if constexpr (THREADS == WARP_SIZE) {
        return v;
    } else {
        const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
        if (lane == 0) sh.slots[round & 1][warp] = v;
        __syncthreads();
        return warp_max_u64(lane < THREADS / WARP_SIZE ? sh.slots[round & 1][lane] : 0ull);
    }
}

template <int NI> __device__ __forceinline__ u64 max_item(const u64 (&items)[NI]) {
    u64 m = items[0];
#pragma unroll
    for (int i = 1; i < NI; ++i) m = items[i] > m ? items[i] : m;
    return m;
}

// k rounds of block-wide max; emit(r, key) is called by thread 0 with the r-th largest key
// (0 once the block's items are exhausted). Keys are unique, so exactly one thread owns a winner.
template <int THREADS, int NI, class Emit>
__device__ __forceinline__ void select(u64 (&items)[NI], int k, Shared<THREADS>& sh, Emit emit) {
    u64 best = max_item(items);
    for (int r = 0; r < k; ++r) {
        const u64 win = block_max_key<THREADS>(best, sh, r);
        if (threadIdx.x == 0) emit(r, win);
        if (win != 0 && best == win) {
#pragma unroll
            for (int i = 0; i < NI; ++i) items[i] = items[i] == win ? 0ull : items[i];
            best = max_item(items);
        }
    }
}

// Runs both stages for every row; finish(row, r, key) writes the final r-th key (thread 0).
template <int NV, int KC, int THREADS, class Finish>
__device__ __forceinline__ void run(const float* __restrict__ logits, void* scratch, int n_rows, int n_vocab_rt,
                                    int k_rt, Finish finish) {
    static_assert(THREADS % WARP_SIZE == 0 && THREADS <= 1024, "THREADS must be a multiple of 32, <= 1024");
    static_assert(KC >= 0 && KC <= MAX_K, "K must be <= 64");
    constexpr int CHUNK = ITEMS * THREADS;
    __shared__ Shared<THREADS> sh;

    const int n_vocab = dim_or<NV>(n_vocab_rt);
    const int k = dim_or<KC>(k_rt);
    const int nb = gridDim.x;
    const int m = nb * k;  // partials per row
    u64* partials = static_cast<u64*>(scratch);
    u32* counters = reinterpret_cast<u32*>(partials + (i64)n_rows * m);
    const int tid = threadIdx.x;

    for (int row = blockIdx.y; row < n_rows; row += gridDim.y) {
        // Stage 1: this block's chunk, two float4 (or 8 scalars) per thread, coalesced.
        const float* x = logits + (i64)row * n_vocab;
        const int base = blockIdx.x * CHUNK;
        u64 items[ITEMS];
        const bool vec = (NV != 0 ? NV % 4 == 0 : n_vocab % 4 == 0) && (unsigned long long)logits % 16 == 0;
        if (vec) {
#pragma unroll
            for (int j = 0; j < ITEMS / 4; ++j) {
                const int i = base + (j * THREADS + tid) * 4;
                if ((NV != 0 && NV % CHUNK == 0) || i < n_vocab) {
                    const float4 v = __ldg(reinterpret_cast<const float4*>(x + i));
                    items[4 * j + 0] = make_arg_key(v.x, i + 0);
                    items[4 * j + 1] = make_arg_key(v.y, i + 1);
                    items[4 * j + 2] = make_arg_key(v.z, i + 2);
                    items[4 * j + 3] = make_arg_key(v.w, i + 3);
                } else {
#pragma unroll
                    for (int c = 0; c < 4; ++c) items[4 * j + c] = 0ull;
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < ITEMS; ++j) {
                const int i = base + j * THREADS + tid;
                items[j] = i < n_vocab ? make_arg_key(__ldg(x + i), i) : 0ull;
            }
        }
        u64* part = partials + (i64)row * m + (i64)blockIdx.x * k;
        select<THREADS>(items, k, sh, [&](int r, u64 key) { part[r] = key; });

        // Hand-off: the last block of this row merges.
        if (tid == 0) {
            __threadfence();
            const u32 ticket = atomicAdd(counters + row, 1u);
            sh.is_last = ticket == (u32)(nb - 1);
        }
        __syncthreads();
        const bool last = sh.is_last;
        __syncthreads();    // every thread has read is_last before it can be rewritten
        if (!last) continue;  // uniform across the block
        __threadfence();

        // Stage 2: merge the nb·k partials of this row.
        const u64* all = partials + (i64)row * m;
        u64 cand[MERGE_ITEMS];
#pragma unroll
        for (int j = 0; j < MERGE_ITEMS; ++j) {
            const int i = j * THREADS + tid;
            cand[j] = i < m ? __ldcg(all + i) : 0ull;
        }
        const bool fits = m <= MERGE_ITEMS * THREADS;
        select<THREADS>(cand, k, sh, [&](int r, u64 key) { finish(row, r, fits ? key : 0ull); });
        if (tid == 0) counters[row] = 0;  // ready for the next launch
        __syncthreads();                  // sh.is_last is rewritten for the next row
    }
}

}  // namespace topk_detail

template <class Cfg>
__device__ __forceinline__ void topk_impl(const float* logits, float* out_val, int* out_idx, void* scratch, int n_rows,
                                          int n_vocab, int k) {
    const int kk = dim_or<Cfg::K>(k);
    topk_detail::run<Cfg::N_VOCAB, Cfg::K, Cfg::THREADS>(logits, scratch, n_rows, n_vocab, k,
                                                         [&](int row, int r, u64 key) {
        const i64 o = (i64)row * kk + r;
        out_val[o] = key != 0 ? arg_key_value(key) : __int_as_float(0x7fc00000);
        out_idx[o] = key != 0 ? (int)arg_key_index(key) : -1;
    });
}

}  // namespace memra

#define MEMRA_DEFINE_TOPK(SYMBOL, CFG)                                                                 \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                         \
        SYMBOL(const float* logits, float* out_val, int* out_idx, void* scratch, int n_rows,           \
               int n_vocab, int k) {                                                                   \
        memra::pdl_entry();                                                                            \
        memra::topk_impl<CFG>(logits, out_val, out_idx, scratch, n_rows, n_vocab, k);                  \
    }
