// memra/combine_matvec.cuh — a decode output projection with the attention's split combine
// fused in (one token). attn_decode / attn_decode_rope launched with out = null leave every
// split's partials in their workspace and no block combines them; each block of this kernel
// combines them itself, into shared memory, while its first weight chunks load, then runs
// matvec.cuh's streaming core over the row. The attention's hand-off (a ticket a block, then a
// last block reading every partial) and its wait disappear from the step.
//
//   x[h·hd + d] = Σ_s acc[h][s][d]·2^(m[h][s] − M_h) / L_h      (0 when L_h = 0)
//   M_h = max_s m[h][s],  L_h = Σ_s l[h][s]·2^(m[h][s] − M_h)    (one online pass over s)
//   y[n] = Σ_k W[n][k]·x[k]
//
// Cfg fields (static constexpr):
//   int    K, N        row length (n_head·head_dim) and rows; 0 = run time (kernel parameters k, n)
//   int    HEAD_DIM    0 = run time (head_dim); K is a multiple of it
//   QType  QTYPE       weight type
//   int    THREADS, LANES, ROWS_PER_GROUP, STAGES   as matvec (BATCH 1, f32 x)
//   int    MAX_SPLITS  host side only: the most splits the engine combines here (every block
//                      reads all n_head·n_split·(hd + 2) partial floats; past this the
//                      attention's own last-block combine is cheaper)
//
// Kernel parameters, in order:
//   (const unsigned char* w, const float* work, float* y, int k, int n, int head_dim, int n_split)
//   w: N·row_bytes(K) bytes, 16-byte aligned; work: attn_decode's workspace of one sequence with
//   n_head = K / head_dim heads and n_split splits, as a launch with out = null leaves it:
//   counters (n_head rounded up to 4 u32), acc [n_head][n_split][hd], (m, l) [n_head][n_split][2];
//   y: N floats.
//
// Launch geometry: norm_matvec's with GLU None — matvec's with BATCH 1 over N tile rows, any
//   grid 1 ≤ G ≤ tiles, dynamic shared memory MatvecGeometry::SMEM + the f32 row
//   (NormMatvecGeometry::xrow_bytes(K); the kernel traps if less).
#pragma once
#include "memra/attn_decode.cuh"
#include "memra/norm_matvec.cuh"

namespace memra {
namespace combine_matvec_detail {

// The plain matvec's rows (DenseRows), its x built in shared memory from the partials.
template <class Cfg> struct CombineRows : matvec_detail::DenseRows<NormMatvecGeometryCfg<Cfg>> {
    enum : bool { X_IN_SMEM = true };
    enum : int { THREADS = Cfg::THREADS };
    const float* acc;
    const float2* ml;
    int hd;
    int n_split;

    // A thread takes 4 adjacent elements (float4 partials) of a head and merges the splits in
    // one online pass, all of a step's loads independent of its math. The partials come from
    // the previous kernel: read at L2 (ld.global.cg).
    template <class G, class Preload> __device__ __forceinline__ void prologue(const Preload&, float* x, int K) const {
        constexpr int UE = G::U::UE;
        // Splits whose loads are in flight at once. The generic variants, with more live
        // registers (dims at run time) under the same register cap, spill at 8.
        constexpr int UNROLL = Cfg::K != 0 ? 8 : 4;
        static_assert(UE % 4 == 0, "4 adjacent elements share a padded unit");
        for (int i = 4 * threadIdx.x; i < K; i += 4 * THREADS) {
            const int h = i / hd, d = i - h * hd;
            const float4* a = reinterpret_cast<const float4*>(acc + (i64)h * n_split * hd + d);
            const float2* m = ml + (i64)h * n_split;
            float M = attn_detail::neg_inf(), L = 0.0f;
            float4 A = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll UNROLL
            for (int s = 0; s < n_split; ++s) {
                const float2 pm = __ldcg(m + s);
                const float4 pa = __ldcg(a + (i64)s * (hd / 4));
                const float Mn = fmaxf(M, pm.x);
                const float keep = attn_detail::merge_w(M, Mn), take = attn_detail::merge_w(pm.x, Mn);  // 0 while both are −inf
                L = fmaf(L, keep, pm.y * take);
                A = attn_detail::fma4(pa, take, make_float4(A.x * keep, A.y * keep, A.z * keep, A.w * keep));
                M = Mn;
            }
            const float inv = L > 0.0f ? 1.0f / L : 0.0f;
            *reinterpret_cast<float4*>(x + (i / UE) * G::XS_UNIT + i % UE) = make_float4(A.x * inv, A.y * inv, A.z * inv, A.w * inv);
        }
    }
};

}  // namespace combine_matvec_detail

template <class Cfg>
__device__ __forceinline__ void combine_matvec_impl(const unsigned char* __restrict__ w, const float* work, float* __restrict__ y,
                                                    int k, int n, int head_dim, int n_split) {
    using GC = NormMatvecGeometryCfg<Cfg>;
    using G = MatvecGeometry<GC>;
    using U = qunit::Unit<Cfg::QTYPE>;
    static_assert(CfgXq8<Cfg>::value == 0, "combine_matvec builds an f32 row");
    const int K = dim_or<Cfg::K>(k), N = dim_or<Cfg::N>(n), hd = dim_or<Cfg::HEAD_DIM>(head_dim);
    if (async::dynamic_smem_bytes() < (u32)G::SMEM + (u32)NormMatvecGeometry<Cfg>::xrow_bytes(K)) __trap();
    if (hd <= 0 || hd % 4 != 0 || K % hd != 0 || n_split < 1) __trap();  // the host refuses these
    const int n_head = K / hd;
    const float* acc = work + (n_head + 3) / 4 * 4;  // after the counters, as attn_decode lays them out
    const float2* ml = reinterpret_cast<const float2*>(acc + (i64)n_head * n_split * hd);
    const i64 w_total = (i64)N * ((i64)(K / U::BLOCK) * U::BYTES);
    const combine_matvec_detail::CombineRows<Cfg> src{{w, nullptr, y, w_total, N, 0, 0}, acc, ml, hd, n_split};
    matvec_detail::run<GC, 1>(1, src, k, N, gridDim.x);
}

}  // namespace memra

#define MEMRA_DEFINE_COMBINE_MATVEC(SYMBOL, CFG)                                                                       \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS,                                                           \
                                                 memra::MatvecGeometry<memra::NormMatvecGeometryCfg<CFG>>::MIN_BLOCKS)   \
        SYMBOL(const unsigned char* __restrict__ w, const float* work, float* __restrict__ y, int k, int n,               \
               int head_dim, int n_split) {                                                                              \
        memra::combine_matvec_impl<CFG>(w, work, y, k, n, head_dim, n_split);                                            \
    }
