// memra/swiglu.cuh — gated FFN activation: out = silu(gate) · up, rows of n_ff (f32).
// The row engine is shared with geglu.cuh.
//
// Cfg fields:
//   N_FF     int  row length n_ff; 0 = run time (kernel parameter n_ff)
//   THREADS  int  threads per block (multiple of 32)
// Kernel parameters: (const float* gate, const float* up, float* out, int n_rows, int n_ff,
//                     int gate_stride, int up_stride)
//   Row r of gate / up starts at r·gate_stride / r·up_stride floats (a merged [gate | up] row:
//   up = gate + n_ff, both strides 2·n_ff); out is packed [n_rows, n_ff].
// Geometry: grid (ceil(n_ff / (4·THREADS)), min(n_rows, 65535)), block THREADS, no dynamic smem.
//   Grid strides in both dimensions: any grid >= 1 is correct.
//   float4 path when n_ff, both strides and the three pointers allow it; scalar otherwise.
#pragma once
#include "memra/common.cuh"

namespace memra {
namespace glu_detail {

enum class Act { Silu, GeluTanh };

template <Act A> __device__ __forceinline__ float act(float x) {
    if constexpr (A == Act::Silu) {
        return x / (1.0f + __expf(-x));
    } else {
        // 0.5·x·(1 + tanh(u)) == x · sigmoid(2u), u = sqrt(2/π)·(x + 0.044715·x³) (model-specs §2).
        const float u = 0.7978845608028654f * fmaf(0.044715f * x, x * x, x);
        return x / (1.0f + __expf(-2.0f * u));
    }
}

template <Act A, class Cfg>
__device__ __forceinline__ void glu_impl(const float* __restrict__ gate, const float* __restrict__ up,
                                         float* __restrict__ out, int n_rows, int n_ff_rt, int gate_stride,
                                         int up_stride) {
    constexpr int THREADS = Cfg::THREADS;
    const int n_ff = dim_or<Cfg::N_FF>(n_ff_rt);
    const bool vec = (Cfg::N_FF != 0 ? Cfg::N_FF % 4 == 0 : n_ff % 4 == 0) && gate_stride % 4 == 0 &&
                     up_stride % 4 == 0 && ((unsigned long long)gate % 16 | (unsigned long long)up % 16 |
                                            (unsigned long long)out % 16) == 0;
    const int first = blockIdx.x * THREADS + threadIdx.x, step = gridDim.x * THREADS;
    for (int row = blockIdx.y; row < n_rows; row += gridDim.y) {
        const float* g = gate + (i64)row * gate_stride;
        const float* u = up + (i64)row * up_stride;
        float* o = out + (i64)row * n_ff;
        if (vec) {
            for (int i = first; i < n_ff / 4; i += step) {
                const float4 gv = __ldg(reinterpret_cast<const float4*>(g) + i);
                const float4 uv = __ldg(reinterpret_cast<const float4*>(u) + i);
                store_f4(o + 4 * i, make_float4(act<A>(gv.x) * uv.x, act<A>(gv.y) * uv.y, act<A>(gv.z) * uv.z,
                                                act<A>(gv.w) * uv.w));
            }
        } else {
            for (int i = first; i < n_ff; i += step) o[i] = act<A>(__ldg(g + i)) * __ldg(u + i);
        }
    }
}

}  // namespace glu_detail

template <class Cfg>
__device__ __forceinline__ void swiglu_impl(const float* gate, const float* up, float* out, int n_rows, int n_ff,
                                            int gate_stride, int up_stride) {
    glu_detail::glu_impl<glu_detail::Act::Silu, Cfg>(gate, up, out, n_rows, n_ff, gate_stride, up_stride);
}

}  // namespace memra

#define MEMRA_DEFINE_SWIGLU(SYMBOL, CFG)                                                               \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                         \
        SYMBOL(const float* gate, const float* up, float* out, int n_rows, int n_ff, int gate_stride,  \
               int up_stride) {                                                                        \
        memra::pdl_entry();                                                                            \
        memra::swiglu_impl<CFG>(gate, up, out, n_rows, n_ff, gate_stride, up_stride);                  \
    }
