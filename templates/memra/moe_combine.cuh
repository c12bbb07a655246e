// memra/moe_combine.cuh — the last step of expert-grouped MoE prefill: each token's output row is
// the routing-weighted sum of the rows its experts produced for it.
//
//   out[t][i] = Σ_{s < n_used} weights[t·n_used + s] · y[rows[t·n_used + s]][i]
//
// y holds the down projections of all (token, expert) pairs grouped by expert (row r of y is one
// pair); rows maps a token's slot s to its row. Summed in slot order, so the result does not
// depend on how tokens were grouped or scheduled.
//
// Cfg fields:
//   N        int  row length n (n_embd); 0 = run time (kernel parameter n)
//   THREADS  int  threads per block (multiple of 32)
// Kernel parameters: (const float* y, const int* rows, const float* weights, float* out,
//                     int n_tokens, int n_used, int n, int y_rows)
//   y: [y_rows][n] f32; rows, weights: [n_tokens][n_used]; out: [n_tokens][n] packed, must not
//   alias y. A row index outside [0, y_rows) writes NaN across the token's row (a grouping slip
//   shows instead of reading out of bounds).
// Geometry: grid (ceil(n / (4·THREADS)), min(n_tokens, 65535)), block THREADS, no dynamic smem.
//   Grid strides in both dimensions: any grid >= 1 is correct.
//   float4 path when n % 4 == 0 and y, out are 16-byte aligned; scalar otherwise.
#pragma once
#include "memra/common.cuh"

namespace memra {

template <class Cfg>
__device__ __forceinline__ void moe_combine_impl(const float* __restrict__ y, const int* __restrict__ rows,
                                                 const float* __restrict__ weights, float* __restrict__ out,
                                                 int n_tokens, int n_used, int n_rt, int y_rows) {
    constexpr int THREADS = Cfg::THREADS;
    const int n = dim_or<Cfg::N>(n_rt);
    const bool vec = n % 4 == 0 && ((unsigned long long)y % 16 | (unsigned long long)out % 16) == 0;
    const int first = blockIdx.x * THREADS + threadIdx.x, step = gridDim.x * THREADS;
    for (int tok = blockIdx.y; tok < n_tokens; tok += gridDim.y) {
        const int* r = rows + (i64)tok * n_used;
        const float* w = weights + (i64)tok * n_used;
        float* o = out + (i64)tok * n;
        bool bad = false;
        for (int s = 0; s < n_used; ++s) bad |= (unsigned)__ldg(r + s) >= (unsigned)y_rows;
        if (vec) {
            for (int i = first; i < n / 4; i += step) {
                float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
                for (int s = 0; s < n_used && !bad; ++s) {
                    const float ws = __ldg(w + s);
                    const float4 v = __ldg(reinterpret_cast<const float4*>(y + (i64)__ldg(r + s) * n) + i);
                    acc.x = fmaf(ws, v.x, acc.x);
                    acc.y = fmaf(ws, v.y, acc.y);
                    acc.z = fmaf(ws, v.z, acc.z);
                    acc.w = fmaf(ws, v.w, acc.w);
                }
                if (bad) acc = make_float4(__int_as_float(0x7fc00000), __int_as_float(0x7fc00000),
                                           __int_as_float(0x7fc00000), __int_as_float(0x7fc00000));
                store_f4(o + 4 * i, acc);
            }
        } else {
            for (int i = first; i < n; i += step) {
                float acc = 0.f;
                for (int s = 0; s < n_used && !bad; ++s) acc = fmaf(__ldg(w + s), __ldg(y + (i64)__ldg(r + s) * n + i), acc);
                o[i] = bad ? __int_as_float(0x7fc00000) : acc;
            }
        }
    }
}

}  // namespace memra

#define MEMRA_DEFINE_MOE_COMBINE(SYMBOL, CFG)                                                          \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                         \
        SYMBOL(const float* y, const int* rows, const float* weights, float* out, int n_tokens,        \
               int n_used, int n, int y_rows) {                                                        \
        memra::pdl_entry();                                                                            \
        memra::moe_combine_impl<CFG>(y, rows, weights, out, n_tokens, n_used, n, y_rows);              \
    }
