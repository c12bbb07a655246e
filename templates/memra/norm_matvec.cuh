// memra/norm_matvec.cuh — a decode projection with the residual add and RMSNorm before it fused
// in (one token). Each block normalizes the row itself, into shared memory, while its first
// weight chunks load, then runs matvec.cuh's streaming core over it: the add_rmsnorm launch
// between two decode matvecs disappears.
//
//   r = x + (flags & ADD ? (flags & DELTA_NORM ? rmsnorm(delta)·delta_w : delta) : 0)
//   x_out = r                       (flags & WRITE_X; block 0 writes it)
//   h = rmsnorm(r)·norm_w           rmsnorm(v) = v / sqrt(mean(v²) + eps), as rmsnorm.cuh
//   GLU None:           y[n] = Σ_k W[n][k]·h[k]
//   GLU Swiglu / Geglu: y[n] = act(Σ_k Wg[n][k]·h[k]) · Σ_k Wu[n][k]·h[k]   (act: silu / gelu_tanh,
//                       moe_matvec's paired rows and swiglu.cuh's formulas)
//
// Cfg fields (static constexpr):
//   int       K, N      row length (n_embd) and rows; 0 = run time (kernel parameters k, n)
//   QType     QTYPE     weight type (W, and Wu when paired)
//   Glu       GLU       None / Swiglu / Geglu
//   int       THREADS, LANES, ROWS_PER_GROUP, STAGES   as matvec (paired: ROWS_PER_GROUP even)
//   int       XQ8       optional (absent = 0). 1: h is quantized to int8 blocks of 32 in shared
//                       memory after the norm and the products run on the integer path
//                       (matvec's XQ8 = 2 numerics; integer-path weight types only)
//
// Kernel parameters, in order:
//   (const unsigned char* w, const unsigned char* w_up, const float* x, const float* delta,
//    const float* delta_w, const float* norm_w, float* x_out, float* y, int k, int n, int flags,
//    float eps)
//   flags: ADD 1, DELTA_NORM 2 (with ADD), WRITE_X 4 (NormFlags below); a pointer whose flag is
//   clear is never read or written (any valid pointer fills its slot).
//   w, w_up: N·row_bytes(K) bytes, 16-byte aligned (w_up paired only, else unread); x, delta,
//   delta_w, norm_w, x_out: K floats; with WRITE_X, x_out is neither x nor delta (the kernel
//   traps: other blocks still read them); y: N floats.
//
// Launch geometry: matvec's with BATCH 1 — R = THREADS / LANES · ROWS_PER_GROUP tile rows,
//   T = ceil(N / R) tiles (paired: ceil(2N / R), tile row 2n = gate row n, 2n + 1 = up row n),
//   grid (G) for any 1 ≤ G ≤ T, block THREADS, dynamic shared memory
//   MatvecGeometry::SMEM + xrow_bytes(K) (NormMatvecGeometry below; the kernel traps if less).
#pragma once
#include "memra/moe_matvec.cuh"

namespace memra {

enum class Glu : int { None = 0, Swiglu = 1, Geglu = 2 };

// The run-time choices of one launch (kernel parameter `flags`).
struct NormFlags {
    enum : int { ADD = 1, DELTA_NORM = 2, WRITE_X = 4 };
};

// matvec's Cfg view of a norm_matvec Cfg: one x row, built in shared memory (f32, or with
// Cfg::XQ8 = 1 quantized to q8 there: matvec's XQ8 = 2).
template <class Cfg> struct NormMatvecGeometryCfg {
    enum : int { K = Cfg::K, N = Cfg::N, BATCH = 1, THREADS = Cfg::THREADS, LANES = Cfg::LANES };
    enum : int { ROWS_PER_GROUP = Cfg::ROWS_PER_GROUP, STAGES = Cfg::STAGES, ACCUMULATE = 0 };
    enum : int { XQ8 = CfgXq8<Cfg>::value != 0 ? 2 : 0 };
    static constexpr QType QTYPE = Cfg::QTYPE;
    static_assert(CfgXq8<Cfg>::value == 0 || CfgXq8<Cfg>::value == 1, "norm_matvec XQ8 is 0 or 1");
    static_assert(XQ8 == 0 || qunit::Unit<QTYPE>::INT_DOT, "XQ8 = 1 needs a weight type with an integer path");
};

template <class Cfg> struct NormMatvecGeometry {
    using G = MatvecGeometry<NormMatvecGeometryCfg<Cfg>>;
    // The normalized row: K / UE units of XS_UNIT floats (the staged x chunk's padded layout);
    // XQ8: its q8 form (xf_row), then the K floats unpadded.
    __host__ __device__ static constexpr int xrow_bytes(int k) {
        return G::XQ8_FUSED ? G::xf_row(k) + (k * 4 + 15) / 16 * 16 : (k / G::U::UE * G::XS_UNIT * 4 + 15) / 16 * 16;
    }
};

namespace norm_matvec_detail {

template <Glu A> constexpr MoeMode PAIR_MODE = A == Glu::Geglu ? MoeMode::Geglu : MoeMode::Swiglu;

template <class Cfg> struct NormRows {
    enum : bool { SEGMENTED = false, WEIGHTED = false, X_IN_SMEM = true, EARLY_WEIGHTS = true };
    enum : bool { PAIRED = bool(Cfg::GLU != Glu::None) };
    enum : int { LANES = Cfg::LANES, THREADS = Cfg::THREADS };
    const u8* w;
    const u8* w_up;
    float* y;
    i64 w_total;
    int n;
    const float* x;
    const float* delta;
    const float* delta_w;
    const float* norm_w;
    float* x_out;
    int flags;
    float eps;
    int k_len;

    __device__ __forceinline__ int segments() const { return 1; }
    __device__ __forceinline__ i64 row(int, int r, const u8*& base) const {
        if constexpr (PAIRED) {
            base = (r & 1) ? w_up : w;
            return r >> 1;
        } else {
            base = w;
            return r;
        }
    }
    __device__ __forceinline__ const float* xrow(int, int) const { return x; }  // unread: X_IN_SMEM
    __device__ __forceinline__ float weight(int) const { return 1.0f; }

    // Elements of the row per thread in the prologue's one-pass form (K ≤ PER · THREADS).
    enum : int { PER = Cfg::K != 0 ? (Cfg::K + THREADS - 1) / THREADS : 8 };
    // The norm weights of this thread's elements, loaded before the wait for the previous kernel
    // (they are constants): the prologue then waits only on x and delta.
    struct Preload {
        float nw[PER], dw[PER];
    };
    __device__ __forceinline__ Preload before_wait() const {
        Preload pre;
        const bool delta_norm = (flags & NormFlags::ADD) && (flags & NormFlags::DELTA_NORM);
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = threadIdx.x + j * THREADS;
            pre.nw[j] = i < k_len ? __ldg(norm_w + i) : 0.0f;
            pre.dw[j] = i < k_len && delta_norm ? __ldg(delta_w + i) : 0.0f;
        }
        if (PER > 8 || k_len > PER * THREADS) {
            // The three-pass form: the weights into L2 instead (addresses 128 bytes apart, the
            // last one K − 1: every line of the K floats, none past them).
            for (int i = threadIdx.x; i <= k_len / 32; i += THREADS) {
                const int e = min(32 * i, k_len - 1);
                prefetch_l2(norm_w + e);
                if (delta_norm) prefetch_l2(delta_w + e);
            }
        }
        return pre;
    }

    // h into the padded unit layout (element i at unit i / UE, slot i % UE). Every operand is
    // loaded before the first reduction, so the prologue costs one memory latency (which the
    // weight chunks issued before it share) and two block sums; rows longer than PER elements
    // per thread take three passes (each element re-read only by the thread that wrote it).
    template <class G> __device__ __forceinline__ void prologue(const Preload& pre, float* h, int K) const {
        constexpr int UE = G::U::UE;
        const int tid = threadIdx.x;
        const bool add = (flags & NormFlags::ADD) != 0, delta_norm = add && (flags & NormFlags::DELTA_NORM) != 0;
        const bool write_x = (flags & NormFlags::WRITE_X) != 0 && blockIdx.x == 0;
        auto slot = [&](int i) -> float& { return G::XQ8_FUSED ? h[i] : h[(i / UE) * G::XS_UNIT + i % UE]; };
        if (PER <= 8 && K <= PER * THREADS) {
            float r[PER], d[PER];
            const float(&dw)[PER] = pre.dw;
            const float(&nw)[PER] = pre.nw;
#pragma unroll
            for (int j = 0; j < PER; ++j) {
                const int i = tid + j * THREADS;
                const bool in = i < K;
                r[j] = in ? x[i] : 0.0f;
                d[j] = in && add ? delta[i] : 0.0f;
            }
            if (add) {
                float inv_d = 1.0f;
                if (delta_norm) {
                    float ss = 0.0f;
#pragma unroll
                    for (int j = 0; j < PER; ++j) ss = fmaf(d[j], d[j], ss);
                    inv_d = rsqrtf(block_sum<THREADS>(ss) / (float)K + eps);
                }
#pragma unroll
                for (int j = 0; j < PER; ++j) r[j] += delta_norm ? d[j] * inv_d * dw[j] : d[j];
            }
            float ss = 0.0f;
#pragma unroll
            for (int j = 0; j < PER; ++j) ss = fmaf(r[j], r[j], ss);
            const float inv = rsqrtf(block_sum<THREADS>(ss) / (float)K + eps);
#pragma unroll
            for (int j = 0; j < PER; ++j) {
                const int i = tid + j * THREADS;
                if (i < K) {
                    if (write_x) x_out[i] = r[j];
                    slot(i) = r[j] * inv * nw[j];
                }
            }
            return;
        }
        float inv_d = 1.0f;
        if (delta_norm) {
            float ss = 0.0f;
            for (int i = tid; i < K; i += THREADS) ss = fmaf(delta[i], delta[i], ss);
            inv_d = rsqrtf(block_sum<THREADS>(ss) / (float)K + eps);
        }
        float ss = 0.0f;
        for (int i = tid; i < K; i += THREADS) {
            float r = x[i];
            if (add) r += delta_norm ? delta[i] * inv_d * __ldg(delta_w + i) : delta[i];
            if (write_x) x_out[i] = r;
            slot(i) = r;
            ss = fmaf(r, r, ss);
        }
        const float inv = rsqrtf(block_sum<THREADS>(ss) / (float)K + eps);
        for (int i = tid; i < K; i += THREADS) {
            float& v = slot(i);
            v = v * inv * __ldg(norm_w + i);
        }
    }

    template <int RPG, int NB>
    __device__ __forceinline__ void store(int lane, int first_row, const float (&sums)[RPG][NB], int) const {
        if constexpr (PAIRED) {
            static_assert(RPG % 2 == 0, "GLU Swiglu / Geglu needs an even ROWS_PER_GROUP (gate and up rows pair up)");
#pragma unroll
            for (int i = 0; i < RPG / 2; ++i) {
                const int row = first_row / 2 + i;
                if (lane == i % LANES && row < n) y[row] = moe_detail::gate_act<PAIR_MODE<Cfg::GLU>>(sums[2 * i][0]) * sums[2 * i + 1][0];
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

}  // namespace norm_matvec_detail

template <class Cfg>
__device__ __forceinline__ void norm_matvec_impl(const unsigned char* __restrict__ w, const unsigned char* __restrict__ w_up,
                                                 const float* x, const float* delta, const float* __restrict__ delta_w,
                                                 const float* __restrict__ norm_w, float* x_out, float* __restrict__ y,
                                                 int k, int n, int flags, float eps) {
    using GC = NormMatvecGeometryCfg<Cfg>;
    using G = MatvecGeometry<GC>;
    using U = qunit::Unit<Cfg::QTYPE>;
    const int K = dim_or<Cfg::K>(k), N = dim_or<Cfg::N>(n);
    if (async::dynamic_smem_bytes() < (u32)G::SMEM + (u32)NormMatvecGeometry<Cfg>::xrow_bytes(K)) __trap();
    // Other blocks read x and delta while block 0 writes x_out.
    if ((flags & NormFlags::WRITE_X) && (x_out == x || ((flags & NormFlags::ADD) && x_out == delta))) __trap();
    const i64 w_total = (i64)N * ((i64)(K / U::BLOCK) * U::BYTES);
    const norm_matvec_detail::NormRows<Cfg> src{w, w_up, y, w_total, N, x, delta, delta_w, norm_w, x_out, flags, eps, K};
    matvec_detail::run<GC, 1>(1, src, k, Cfg::GLU != Glu::None ? 2 * N : N, gridDim.x);
}

}  // namespace memra

#define MEMRA_DEFINE_NORM_MATVEC(SYMBOL, CFG)                                                                         \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS,                                                          \
                                                 memra::MatvecGeometry<memra::NormMatvecGeometryCfg<CFG>>::MIN_BLOCKS)  \
        SYMBOL(const unsigned char* __restrict__ w, const unsigned char* __restrict__ w_up, const float* x,             \
               const float* delta, const float* __restrict__ delta_w, const float* __restrict__ norm_w, float* x_out,   \
               float* __restrict__ y, int k, int n, int flags, float eps) {                                             \
        memra::norm_matvec_impl<CFG>(w, w_up, x, delta, delta_w, norm_w, x_out, y, k, n, flags, eps);                   \
    }
