// memra/argmax.cuh — argmax of f32 logit rows (lowest index on ties): the top-k engine of
// memra/topk.cuh with k = 1.
//
// Cfg fields:
//   N_VOCAB  int  row length n_vocab; 0 = run time
//   THREADS  int  threads per block (multiple of 32)
// Kernel parameters: (const float* logits, int* out_idx, float* out_val, void* scratch,
//                     int n_rows, int n_vocab)
//   out_idx [n_rows]; out_val [n_rows] or null.
// Geometry: B = ceil(n_vocab / (8·THREADS)), grid (B, min(n_rows, 65535)) with grid.x exactly B,
//   block THREADS; requires B <= 32·THREADS.
// Scratch: n_rows·B u64 partials then n_rows u32 counters (n_rows·B·8 + n_rows·4 bytes), zeroed
//   once at allocation; the kernel returns every counter to zero.
#pragma once
#include "memra/topk.cuh"

namespace memra {

template <class Cfg>
__device__ __forceinline__ void argmax_impl(const float* logits, int* out_idx, float* out_val, void* scratch,
                                            int n_rows, int n_vocab) {
    topk_detail::run<Cfg::N_VOCAB, 1, Cfg::THREADS>(logits, scratch, n_rows, n_vocab, 1, [&](int row, int, u64 key) {
        out_idx[row] = key != 0 ? (int)arg_key_index(key) : -1;
        if (out_val != nullptr) out_val[row] = key != 0 ? arg_key_value(key) : __int_as_float(0x7fc00000);
    });
}

}  // namespace memra

#define MEMRA_DEFINE_ARGMAX(SYMBOL, CFG)                                                               \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                         \
        SYMBOL(const float* logits, int* out_idx, float* out_val, void* scratch, int n_rows,           \
               int n_vocab) {                                                                          \
        memra::pdl_entry();                                                                            \
        memra::argmax_impl<CFG>(logits, out_idx, out_val, scratch, n_rows, n_vocab);                   \
    }
