// memra/argmax.cuh — argmax of f32 logit rows (lowest index on ties): the top-k engine of
// memra/topk.cuh with k = 1.
//
// Cfg fields:
//   N_VOCAB  int  row length n_vocab; 0 = run time
//   THREADS  int  threads per block (multiple of 32)
// Kernel parameters: (const float* logits, int* out_idx, float* out_val, void* scratch,
//                     int n_rows, int n_vocab, int* next_token, int* next_pos, int* history,
//                     int history_len)
//   out_idx [n_rows]; out_val [n_rows] or null.
//   Decode feed (n_rows = 1; next_token, next_pos and history all null, or all set): the result
//   also becomes the next decode step's input on the device, as the host would upload it, so a
//   greedy step can be enqueued before the host has read the previous one's token:
//   p = next_pos[0] + 1, next_pos[0] = p, next_token[0] = the index (0 when every logit is NaN,
//   as the host-side argmax reports it), and history[p] = the same when 0 <= p < history_len (one
//   token per position; the host reads runs of it at once).
// Geometry: B = ceil(n_vocab / (8·THREADS)), grid (B, min(n_rows, 65535)) with grid.x exactly B,
//   block THREADS; requires B <= 32·THREADS.
// Scratch: n_rows·B u64 partials then n_rows u32 counters (n_rows·B·8 + n_rows·4 bytes), zeroed
//   once at allocation; the kernel returns every counter to zero.
#pragma once
#include "memra/topk.cuh"

namespace memra {

template <class Cfg>
__device__ __forceinline__ void argmax_impl(const float* logits, int* out_idx, float* out_val, void* scratch,
                                            int n_rows, int n_vocab, int* next_token, int* next_pos, int* history,
                                            int history_len) {
    topk_detail::run<Cfg::N_VOCAB, 1, Cfg::THREADS>(logits, scratch, n_rows, n_vocab, 1, [&](int row, int, u64 key) {
        const int idx = key != 0 ? (int)arg_key_index(key) : -1;
        out_idx[row] = idx;
        if (out_val != nullptr) out_val[row] = key != 0 ? arg_key_value(key) : __int_as_float(0x7fc00000);
        if (next_token != nullptr && row == 0) {
            const int p = next_pos[0] + 1;
            next_pos[0] = p;
            next_token[0] = max(idx, 0);
            if (p >= 0 && p < history_len) history[p] = max(idx, 0);
        }
    });
}

}  // namespace memra

#define MEMRA_DEFINE_ARGMAX(SYMBOL, CFG)                                                               \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS)                                         \
        SYMBOL(const float* logits, int* out_idx, float* out_val, void* scratch, int n_rows,           \
               int n_vocab, int* next_token, int* next_pos, int* history, int history_len) {           \
        memra::pdl_entry();                                                                            \
        memra::argmax_impl<CFG>(logits, out_idx, out_val, scratch, n_rows, n_vocab, next_token,        \
                                next_pos, history, history_len);                                       \
    }
