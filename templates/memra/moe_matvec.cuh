// memra/moe_matvec.cuh — expert-indexed decode products over stacked GGUF expert tensors
// (model-specs §1.5: ne = [in, out, n_expert], memory [expert][out rows][in]), reading only the
// selected experts' rows. The streaming core, quant units and geometry are matvec.cuh's; this
// file only supplies row sources (matvec_detail::run's interface) that pick expert rows.
//
//   MODE Plain:   y[s, n]  = Σ_k W[e_s][n][k] · x[s / n_used, k]
//   MODE Swiglu:  y[s, n]  = silu(Σ_k Wg[e_s][n][k]·x[b, k]) · Σ_k Wu[e_s][n][k]·x[b, k]
//                    (gate and up rows n of the same expert sit in one lane group, so the
//                    gated activation is applied where both sums meet)
//   MODE Geglu:   as Swiglu with gelu_tanh for silu (swiglu.cuh's formula, geglu's; Gemma 3).
//                    A dense gated FFN is the n_expert = 1, n_used = 1, ids = [0] case.
//   MODE Down:    y[b, n] (+)= Σ_j wt[b, j] · Σ_k W[e_bj][n][k] · x[b·n_used + j, k]
//                    (the n_used matrices concatenate along K into one accumulator per row,
//                    scaled per segment by the routing weight: the combine is fused, no atomics)
//   with s = b·n_used + j a (token, slot) pair and e_s = ids[s].
//
// Cfg fields (static constexpr):
//   int   K               expert row length (n_embd for gate/up, n_ff_exp for down); 0 = run time
//   int   N               expert rows (n_ff_exp for gate/up, n_embd for down); 0 = run time
//   QType QTYPE           expert tensor type
//   MoeMode MODE          Plain, Swiglu (gate + up tensors, SwiGLU fused), Geglu (same, GELU-tanh),
//                         Down (weighted combine)
//   int   THREADS, LANES, ROWS_PER_GROUP, STAGES   as matvec (Swiglu / Geglu: ROWS_PER_GROUP even)
//   int   ACCUMULATE      Down only: 1 = y += combine (residual fusion)
//   int   XQ8             optional (absent = 0), as matvec: 1 = x rows are quantize_q8 rows
//                         (ldx in floats of those rows), products by __dp4a; 2 = x is f32 and each
//                         block quantizes its slot's x row (Down: its token's n_used h rows) into
//                         shared memory (dynamic shared memory + xf_row(K), Down n_used · xf_row(K);
//                         matvec.cuh), no quantize_q8 launch
//
// Kernel parameters, in order:
//   (const unsigned char* w, const unsigned char* w_up, const int* ids, const float* weights,
//    const float* x, float* y, int k, int n, int n_tokens, int n_used, int n_expert, int ldx, int ldy)
//   w, w_up: n_expert·N·row_bytes(K) bytes each, 16-byte aligned (w_up: Swiglu / Geglu only, else unread);
//   ids [n_tokens·n_used] i32; weights [n_tokens·n_used] f32 (Down only, else unread);
//   x: Plain/Swiglu/Geglu [n_tokens][ldx], Down [n_tokens·n_used][ldx] (16-byte aligned, ldx % 4 == 0);
//   y: Plain/Swiglu/Geglu [n_tokens·n_used][ldy], Down [n_tokens][ldy].
//   An id outside [0, n_expert) makes the outputs it feeds NaN (ids come from the device).
//
// Launch geometry: R = THREADS / LANES · ROWS_PER_GROUP tile rows per block; tiles per slot
//   T = ceil(N / R) (Plain, Down) or ceil(2N / R) (Swiglu / Geglu: tile row 2n = gate row n,
//   2n + 1 = up row n); grid (G, S) for any 1 ≤ G ≤ T and 1 ≤ S ≤ slots (n_tokens·n_used;
//   Down: n_tokens), S ≤ 65535: block (x, y) computes tiles x, x + G, … of slots y, y + S, …,
//   its cp.async pipeline running across the tiles of a slot as in matvec (G = T: one tile per
//   block; the wrapper's resident policy launches G = balanced resident blocks / S). Block
//   THREADS, dynamic shared memory = matvec's with BATCH 1 (MatvecGeometry<MoeMatvecGeometryCfg<Cfg>>::SMEM,
//   + xf_row(K) with XQ8 = 2, n_used · xf_row(K) in Down).
#pragma once
#include "memra/matvec.cuh"
#include "memra/swiglu.cuh"

namespace memra {

// matvec's Cfg view of a moe_matvec Cfg: one x row per launch slot.
template <class Cfg> struct MoeMatvecGeometryCfg {
    enum : int { K = Cfg::K, N = Cfg::N, BATCH = 1, THREADS = Cfg::THREADS, LANES = Cfg::LANES };
    enum : int { ROWS_PER_GROUP = Cfg::ROWS_PER_GROUP, STAGES = Cfg::STAGES, ACCUMULATE = Cfg::ACCUMULATE };
    enum : int { XQ8 = CfgXq8<Cfg>::value };
    static constexpr QType QTYPE = Cfg::QTYPE;
};

namespace moe_detail {

// Gate and up rows interleaved, the activation applied where both sums meet.
template <MoeMode M> constexpr bool PAIRED_MODE = M == MoeMode::Swiglu || M == MoeMode::Geglu;

// The gated activation of a paired mode: glu_detail's, so the fused and unfused paths agree.
template <MoeMode M> __device__ __forceinline__ float gate_act(float g) {
    return glu_detail::act<M == MoeMode::Geglu ? glu_detail::Act::GeluTanh : glu_detail::Act::Silu>(g);
}

// Plain / Swiglu / Geglu: one (token, slot) per grid.y; tile rows of expert e (paired modes:
// gate/up interleaved).
template <class Cfg> struct ExpertRows {
    enum : bool { SEGMENTED = false, WEIGHTED = false };
    enum : bool { PAIRED = bool(PAIRED_MODE<Cfg::MODE>) };
    enum : int { LANES = Cfg::LANES };
    const u8* w;
    const u8* w_up;
    const float* x;
    float* y;  // row of this slot
    i64 w_total;
    i64 first;  // e · N: the expert's first row in the stacked tensor
    int n;
    __device__ __forceinline__ int segments() const { return 1; }
    __device__ __forceinline__ i64 row(int, int r, const u8*& base) const {
        if constexpr (PAIRED) {
            base = (r & 1) ? w_up : w;
            return first + (r >> 1);
        } else {
            base = w;
            return first + r;
        }
    }
    __device__ __forceinline__ const float* xrow(int, int) const { return x; }
    __device__ __forceinline__ float weight(int) const { return 1.0f; }
    template <int RPG, int NB>
    __device__ __forceinline__ void store(int lane, int first_row, const float (&sums)[RPG][NB], int) const {
        if constexpr (PAIRED) {
            static_assert(RPG % 2 == 0, "MODE Swiglu / Geglu needs an even ROWS_PER_GROUP (gate and up rows pair up)");
#pragma unroll
            for (int i = 0; i < RPG / 2; ++i) {
                const int row = first_row / 2 + i;
                if (lane == i % LANES && row < n) y[row] = gate_act<Cfg::MODE>(sums[2 * i][0]) * sums[2 * i + 1][0];
            }
        } else {
#pragma unroll
            for (int r = 0; r < RPG; ++r) {
                const int row = first_row + r;
                if (lane == r % LANES && row < n) y[row] = sums[r][0];
            }
        }
    }
};

// Down: one token per grid.y; segment j = slot j's expert row and h row, weighted.
template <class Cfg> struct CombineRows {
    enum : bool { SEGMENTED = true, WEIGHTED = true };
    enum : int { LANES = Cfg::LANES };
    const u8* w;
    const int* ids;      // this token's n_used ids (validated)
    const float* wts;    // this token's n_used weights
    const float* x;      // this token's first h row
    float* y;            // this token's output row
    i64 w_total;
    int n, n_used, ldx;
    __device__ __forceinline__ int segments() const { return n_used; }
    __device__ __forceinline__ i64 row(int seg, int r, const u8*& base) const {
        base = w;
        return (i64)__ldg(ids + seg) * n + r;
    }
    __device__ __forceinline__ const float* xrow(int seg, int) const { return x + (i64)seg * ldx; }
    __device__ __forceinline__ float weight(int seg) const { return __ldg(wts + seg); }
    template <int RPG, int NB>
    __device__ __forceinline__ void store(int lane, int first_row, const float (&sums)[RPG][NB], int) const {
#pragma unroll
        for (int r = 0; r < RPG; ++r) {
            const int row = first_row + r;
            if (lane == r % LANES && row < n) {
                if constexpr (Cfg::ACCUMULATE != 0) {
                    y[row] += sums[r][0];
                } else {
                    y[row] = sums[r][0];
                }
            }
        }
    }
};

// NaN into the outputs of this block's tiles (x, x + G, …; `per` output rows each) of y[0, n).
template <int THREADS> __device__ __forceinline__ void nan_tiles(float* y, int n, int per) {
    for (int t = blockIdx.x; t * per < n; t += gridDim.x)
        for (int r = t * per + (int)threadIdx.x; r < n && r < (t + 1) * per; r += THREADS) y[r] = __int_as_float(0x7fc00000);
}

}  // namespace moe_detail

template <class Cfg>
__device__ __forceinline__ void moe_matvec_impl(const unsigned char* __restrict__ w, const unsigned char* __restrict__ w_up,
                                                const int* __restrict__ ids, const float* __restrict__ weights,
                                                const float* __restrict__ x, float* __restrict__ y, int k, int n,
                                                int n_tokens, int n_used, int n_expert, int ldx, int ldy) {
    using GC = MoeMatvecGeometryCfg<Cfg>;
    using G = MatvecGeometry<GC>;
    using U = qunit::Unit<Cfg::QTYPE>;
    const int K = dim_or<Cfg::K>(k), N = dim_or<Cfg::N>(n);
    // XQ8 = 2: the slot's q8 x row; in Down one per segment (each slot's h row).
    const u32 xf_rows = Cfg::MODE == MoeMode::Down ? (u32)n_used : 1u;
    if (async::dynamic_smem_bytes() < (u32)G::SMEM + (G::XQ8_FUSED ? xf_rows * (u32)G::xf_row(K) : 0u)) __trap();
    if (G::XQ8 && !U::INT_DOT) __trap();  // the wrapper refuses these
    const i64 w_total = (i64)n_expert * N * ((i64)(K / U::BLOCK) * U::BYTES);
    if constexpr (Cfg::MODE == MoeMode::Down) {
        for (int b = blockIdx.y; b < n_tokens; b += gridDim.y) {
            const int* tid_ids = ids + (i64)b * n_used;
            float* yb = y + (i64)b * ldy;
            bool ok = true;
            for (int j = 0; j < n_used; ++j) {
                const int e = __ldg(tid_ids + j);
                ok = ok && e >= 0 && e < n_expert;
            }
            if (!ok) {  // block-uniform: NaN rows make a bad id visible
                moe_detail::nan_tiles<Cfg::THREADS>(yb, N, G::ROWS);
                continue;
            }
            const moe_detail::CombineRows<Cfg> src{w, tid_ids, weights + (i64)b * n_used, x + (i64)b * n_used * ldx, yb,
                                                   w_total, N, n_used, ldx};
            matvec_detail::run<GC, 1>(1, src, k, N, gridDim.x);
            __syncthreads();  // the next token's prologue reuses the stage slots
        }
    } else {
        const int tile_rows = moe_detail::PAIRED_MODE<Cfg::MODE> ? 2 * N : N;
        for (int s = blockIdx.y; s < n_tokens * n_used; s += gridDim.y) {
            const int e = __ldg(ids + s);
            float* ys = y + (i64)s * ldy;
            if (e < 0 || e >= n_expert) {
                moe_detail::nan_tiles<Cfg::THREADS>(ys, N, moe_detail::PAIRED_MODE<Cfg::MODE> ? G::ROWS / 2 : G::ROWS);
                continue;
            }
            const moe_detail::ExpertRows<Cfg> src{w, w_up, x + (i64)(s / n_used) * ldx, ys, w_total, (i64)e * N, N};
            matvec_detail::run<GC, 1>(1, src, k, tile_rows, gridDim.x);
            __syncthreads();
        }
    }
}

}  // namespace memra

#define MEMRA_DEFINE_MOE_MATVEC(SYMBOL, CFG)                                                                          \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS,                                                          \
                                                 memra::MatvecGeometry<memra::MoeMatvecGeometryCfg<CFG>>::MIN_BLOCKS)   \
        SYMBOL(const unsigned char* __restrict__ w, const unsigned char* __restrict__ w_up, const int* __restrict__ ids, \
               const float* __restrict__ weights, const float* __restrict__ x, float* __restrict__ y, int k, int n,     \
               int n_tokens, int n_used, int n_expert, int ldx, int ldy) {                                              \
        memra::pdl_entry();                                                                                             \
        memra::moe_matvec_impl<CFG>(w, w_up, ids, weights, x, y, k, n, n_tokens, n_used, n_expert, ldx, ldy);           \
    }
