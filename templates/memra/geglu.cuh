// memra/geglu.cuh — gated FFN activation: out = gelu_tanh(gate) · up (gemma3), rows of n_ff (f32).
// gelu_tanh(x) = 0.5·x·(1 + tanh(0.79788456·(x + 0.044715·x³))), the exact formula (model-specs §2),
// evaluated as x / (1 + e^(−2u)) — the same function, no table.
//
// Cfg fields, kernel parameters and geometry: exactly as memra/swiglu.cuh.
//   N_FF     int  row length n_ff; 0 = run time
//   THREADS  int  threads per block (multiple of 32)
// Kernel parameters: (const float* gate, const float* up, float* out, int n_rows, int n_ff,
//                     int gate_stride, int up_stride)
// Geometry: grid (ceil(n_ff / (4·THREADS)), min(n_rows, 65535)), block THREADS.
#pragma once
#include "memra/swiglu.cuh"

namespace memra {

template <class Cfg>
__device__ __forceinline__ void geglu_impl(const float* gate, const float* up, float* out, int n_rows, int n_ff,
                                           int gate_stride, int up_stride) {
    glu_detail::glu_impl<glu_detail::Act::GeluTanh, Cfg>(gate, up, out, n_rows, n_ff, gate_stride, up_stride);
}

}  // namespace memra

#define MEMRA_DEFINE_GEGLU(SYMBOL, CFG)                                                                \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                         \
        SYMBOL(const float* gate, const float* up, float* out, int n_rows, int n_ff, int gate_stride,  \
               int up_stride) {                                                                        \
        memra::pdl_entry();                                                                            \
        memra::geglu_impl<CFG>(gate, up, out, n_rows, n_ff, gate_stride, up_stride);                   \
    }
