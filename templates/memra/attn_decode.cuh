// memra/attn_decode.cuh — GQA decode attention (one query token per sequence) over a KV cache,
// flash-decoding split over the keys with a last-block-combines step.
//
// Cfg fields:
//   HEAD_DIM        int              head_dim (q/k/v); 0 = run time (64, 128 or 256 supported)
//   N_HEAD          int              query heads; 0 = run time
//   N_KV            int              key/value heads (N_HEAD % N_KV == 0); 0 = run time
//   CACHE_T         memra::CacheType cache element type (BF16 or F32)
//   THREADS         int              threads per block (multiple of 32; 128 recommended)
//   MIN_SPLIT_ROWS  int              host-side split rule only: the fewest keys per split the
//                                    wrapper chooses (the kernel takes n_split at run time)
//   HEADS_PER_BLOCK int              most q heads a block carries: 1, 2 or 4 (below)
// Kernel parameters:
//   (const float* q, const void* k_cache, const void* v_cache, const int* pos, float* out,
//    float* work, int n_seq, int head_dim, int n_head, int n_kv, int max_ctx, int window,
//    int n_split, float scale)
//   q [n_seq, n_head, hd] f32; caches [n_seq, max_ctx, n_kv, hd] CACHE_T; pos [n_seq] (device);
//   out [n_seq, n_head, hd] f32. Sequence b attends with query position p = pos[b] to keys
//   s ∈ [0, p] with p − s < window (window 0 = no window): out = Σ_s softmax(scale·q·k_s)·v_s.
//   p ∉ [0, max_ctx) writes NaN to that sequence's output (a visible slip, never a fault).
//   out = null: every block leaves its split's partials in `work` (n_split = 1 too) and none
//   combines them; the o-projection does (combine_matvec.cuh). p ∉ [0, max_ctx) then leaves NaN
//   partials (acc NaN, m 0, l 1), so the combined row is NaN.
// Work split: G = n_head / n_kv q heads share a kv head; a block processes HP = min(G, HPB)
//   heads (HPB = HEADS_PER_BLOCK; generic: rounded up to 1, 2, 4) of one kv head, so each K/V
//   row is read once per head group. Fewer heads a block: more blocks re-read the rows (from L2)
//   but each one's chain of instructions is shorter. The visible keys are cut into n_split equal chunks (grid.y). n_split = 1:
//   the block writes out directly and `work` is unused (may be null). n_split > 1: each block
//   writes (max, sum, unnormalized accumulator) to `work`; the last block of a head group (an
//   atomic counter) combines them and resets the counter to 0.
//   work (f32 units): u32 counters [n_seq, n_head] padded to a multiple of 4 (zeroed once when
//   allocated; the kernel leaves them 0), then acc [n_seq, n_head, n_split, hd] and (m, l)
//   [n_seq, n_head, n_split, 2]. The counters come first so that their place does not depend on
//   n_split: a workspace sized for S splits serves every n_split ≤ S at the same n_seq and n_head
//   (with counters after the partials, a launch with more splits wrote partials over the
//   counters of one with fewer, whose combine then never ran or ran early).
// Geometry: n_hg = ceil(G / HPB); grid (n_kv · n_hg, n_split, n_seq), block THREADS, no dynamic
//   shared memory (static: (THREADS/32)·HP·(hd + 2)·4 bytes ≤ 40 KiB, e.g. THREADS 128 at hd 256).
// Inside a block: K and V rows are read with 16-byte loads; a row is split over LPR = min(32,
// hd/VEC) lanes (VEC = 8 bf16 or 4 f32), so a warp takes 32/LPR rows at once, two such rows per
// lane group per step (loads in flight before the math). Online softmax in base 2 per lane group,
// then merged across lane groups (shuffles) and warps (shared memory).
#pragma once
#include "memra/common.cuh"

namespace memra {
namespace attn_detail {

constexpr float LOG2E = 1.4426950408889634f;
// Most q heads one block can carry in registers (q and accumulator: 2·HP·hd/LPR floats a lane);
// a Cfg's HEADS_PER_BLOCK (1, 2 or 4) sets its own cap; larger groups are split over blocks
// that re-read K/V (from L2).
constexpr int HP_CAP = 4;
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

template <CacheType C> struct CacheTraits;
template <> struct CacheTraits<CacheType::BF16> {
    enum : int { VEC = 8 };   // elements per 16-byte chunk
    enum : int { BYTES = 2 };
};
template <> struct CacheTraits<CacheType::F32> {
    enum : int { VEC = 4 };
    enum : int { BYTES = 4 };
};

__device__ __forceinline__ float4 ld16(const void* p) { return __ldg(reinterpret_cast<const float4*>(p)); }

// The i-th element (0 ≤ i < VEC) of a raw 16-byte chunk.
template <CacheType C> __device__ __forceinline__ float elem(const float4& raw, int i) {
    if constexpr (C == CacheType::F32) {
        return i == 0 ? raw.x : i == 1 ? raw.y : i == 2 ? raw.z : raw.w;
    } else {
        const float w = i < 2 ? raw.x : i < 4 ? raw.y : i < 6 ? raw.z : raw.w;
        const u32 bits = __float_as_uint(w);
        return __uint_as_float((i & 1) ? (bits & 0xffff0000u) : (bits << 16));
    }
}

// a·w + c, per component.
__device__ __forceinline__ float4 fma4(const float4& a, float w, const float4& c) {
    return make_float4(fmaf(a.x, w, c.x), fmaf(a.y, w, c.y), fmaf(a.z, w, c.z), fmaf(a.w, w, c.w));
}

// *p += v at GPU scope with acquire-release order; returns the old value. The split hand-off:
// after a __syncthreads() over the block's partial writes, one thread's release publishes them
// all (release is cumulative), and the block drawing the last ticket acquires every other
// block's (its threads read them after a __syncthreads()). One ordered atomic a block in place of
// a __threadfence() in every thread. (Host emulation: std::atomic, sequentially consistent.)
__device__ __forceinline__ u32 atomic_add_acq_rel(u32* p, u32 v) {
#if defined(__CUDA_ARCH__)
    u32 old;
    asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
#else
    return atomicAdd(p, v);
#endif
}

// Weight of a partial with running max m in a merge whose max is M (M finite).
__device__ __forceinline__ float merge_w(float m, float M) { return m == neg_inf() ? 0.0f : exp2f(m - M); }

// Up to PREFETCH_ROWS of the block's first key and value rows (element offset `first`, rows
// `stride` elements apart) are asked into L2 before anything else: the key loop's first loads
// then wait on L2 rather than DRAM, and q (and attn_decode_rope's prologue) load meanwhile.
constexpr int PREFETCH_ROWS = 64;
template <CacheType C, int THREADS>
__device__ __forceinline__ void prefetch_rows(const void* k, const void* v, i64 first, i64 stride, int rows, int hd) {
    constexpr int BYTES = CacheTraits<C>::BYTES;
    const int lines = hd * BYTES / 128;  // hd ≥ 64: whole 128-byte lines
    const char* kb = static_cast<const char*>(k);
    const char* vb = static_cast<const char*>(v);
    for (int i = threadIdx.x; i < rows * lines; i += THREADS) {
        const i64 at = (first + (i / lines) * stride) * BYTES + (i % lines) * 128;
        prefetch_l2(kb + at);
        prefetch_l2(vb + at);
    }
}

// The new key row of attn_decode_rope.cuh: the token's own k and v (raw CACHE_T chunks), written
// to the cache by this very launch, so the block reads them from shared memory, not the cache.
struct SmemNewRow {
    const float4* k;
    const float4* v;
    int s;  // its row, −1 when not in the block's keys
};

// attn_decode's own prologue: none; q is read from global memory.
struct NoPrologue {
    enum : bool { ON = false };
    __device__ __forceinline__ void before_wait(int, int, int, int) const {}
};

// What a block attends with, as a prologue sees it (attn_decode_rope.cuh): the sequence, the
// q heads [h0, h0 + nh) of kv head kvh (head group hg), the position p, and whether the block's
// key range [c0, c1) holds p.
struct BlockAt {
    int b, kvh, hg, h0, nh, p;
    bool holds_p;
};

// What a prologue leaves: the block's q heads (head h at q + h·hd, shared memory) and the new row.
struct Prepared {
    const float* q;
    SmemNewRow new_row;
};

// The K and V chunks of one step of the key loop: U rows per lane group, raw CACHE_T.
template <int U, int CPL> struct Rows {
    float4 k[U][CPL], v[U][CPL];
};

// One block's attention: its q heads [h0, h0 + nh) of kv head kvh over keys [c0, c1). HP / HD are
// this instantiation's (generic: dispatched), HP_MAX / HD_MAX the kernel's largest, which size
// `smem` and the prologue's tables. Order: the first key rows are loaded into registers and the
// prologue's constant work done, then the wait for the previous kernel (pdl_entry), then q (the
// prologue's normed, rotated heads, or global memory), then the key loop with the next rows'
// loads in flight while a step's math runs.
template <CacheType C, int HD, int HP, int HP_MAX, int HD_MAX, int THREADS, class Pre>
__device__ __forceinline__ void block(const float* __restrict__ q_glob, const Pre& pre, const BlockAt& at,
                                      const void* __restrict__ k_cache, const void* __restrict__ v_cache, float* __restrict__ out,
                                      float* work_acc, float* work_ml, u32* counters, float* smem, int n_head, int n_kv, int max_ctx,
                                      int c0, int c1, int n_split, int sp, float scale_log2) {
    using T = CacheTraits<C>;
    constexpr int VEC = T::VEC;
    constexpr int CH = HD / VEC;
    constexpr int LPR = CH < WARP_SIZE ? CH : WARP_SIZE;
    constexpr int CPL = CH / LPR;
    constexpr int RPW = WARP_SIZE / LPR;
    constexpr int W = THREADS / WARP_SIZE;
    constexpr int U = 2;
    constexpr int STEP = W * RPW;
    static_assert(HD % VEC == 0 && CH % LPR == 0 && (LPR & (LPR - 1)) == 0, "head_dim must be 16-byte chunks, a power of two or a multiple of 32");
    static_assert(HP <= HP_MAX && HD <= HD_MAX, "an instantiation within the kernel's maxima");
    // smem: acc [W][HP][HD], then m [W][HP], l [W][HP] (sized by the caller for HP_MAX / HD_MAX).
    constexpr int SMEM_FLOATS = W * HP_MAX * (HD_MAX + 2);
    float* s_acc = smem;
    float* s_m = smem + W * HP * HD;
    float* s_l = s_m + W * HP;
    __shared__ float s_ml[2][HP];  // a head's (max, sum) after a merge

    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int sub = lane / LPR, li = lane % LPR;
    const int nh = at.nh, p = at.p;
    const i64 row_stride = (i64)n_kv * HD;  // elements between cache rows
    const i64 seq_base = ((i64)at.b * max_ctx) * row_stride + (i64)at.kvh * HD;
    const char* kb = static_cast<const char*>(k_cache);
    const char* vb = static_cast<const char*>(v_cache);
    // This lane's chunks of key row s into slot u of r (zeros unless `ld`).
    auto load = [&](Rows<U, CPL>& r, int u, int s, bool ld) {
        const i64 off = seq_base + (i64)s * row_stride;
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
            const i64 e_off = (off + (li + j * LPR) * VEC) * T::BYTES;
            r.k[u][j] = ld ? ld16(kb + e_off) : make_float4(0.f, 0.f, 0.f, 0.f);
            r.v[u][j] = ld ? ld16(vb + e_off) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    // The key row of slot u in this lane group's step from `base`.
    auto row_at = [&](int base, int u) { return base + u * STEP + warp * RPW + sub; };
    // Rows row_at(base, u) of [c0, c1), except `skip` (zeros), into r.
    auto issue = [&](Rows<U, CPL>& r, int base, int skip) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int s = row_at(base, u);
            load(r, u, s, s < c1 && s != skip);
        }
    };

    // Before the wait: row p is written during this step (by the previous kernel, or by this
    // launch's prologue), every other visible row by earlier steps.
    Rows<U, CPL> cur;
    issue(cur, c0, p);
    prefetch_rows<C, THREADS>(k_cache, v_cache, seq_base + (i64)c0 * row_stride, row_stride, min(c1 - c0, PREFETCH_ROWS), HD);
    pre.before_wait(p, HD, n_head, n_kv);
    pdl_entry();

    const float* q;
    int new_s = -1;  // the key row that comes from shared memory (the prologue's), not the cache
    const float4* new_k = nullptr;
    const float4* new_v = nullptr;
    if constexpr (Pre::ON) {
        const Prepared r = pre.template run<HP_MAX, HD_MAX>(at, HD, n_head, n_kv, max_ctx);
        q = r.q;
        new_s = r.new_row.s;
        new_k = r.new_row.k;
        new_v = r.new_row.v;
    } else {
        q = q_glob + ((i64)at.b * n_head + at.h0) * HD;
        if (at.holds_p) {  // row p, left out before the wait, is now in the cache
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int s = row_at(c0, u);
                if (s == p) load(cur, u, s, true);
            }
        }
    }

    float qr[HP][CPL][VEC];
#pragma unroll
    for (int h = 0; h < HP; ++h) {
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) qr[h][j][e] = h < nh ? q[h * HD + (li + j * LPR) * VEC + e] * scale_log2 : 0.0f;
        }
    }
    float acc[HP][CPL][VEC], m[HP], l[HP];
#pragma unroll
    for (int h = 0; h < HP; ++h) {
        m[h] = neg_inf();
        l[h] = 0.0f;
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[h][j][e] = 0.0f;
        }
    }

    for (int base = c0; base < c1; base += U * STEP) {
        Rows<U, CPL> nxt;
        const int next = base + U * STEP;
        if (next < c1) {
            issue(nxt, next, new_s);
        } else {
            nxt = Rows<U, CPL>{};
        }
        bool ok[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int s = row_at(base, u);
            ok[u] = s < c1;
            if constexpr (Pre::ON) {
                if (ok[u] && s == new_s) {
#pragma unroll
                    for (int j = 0; j < CPL; ++j) {
                        cur.k[u][j] = new_k[li + j * LPR];
                        cur.v[u][j] = new_v[li + j * LPR];
                    }
                }
            }
        }
        float sc[U][HP];
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int h = 0; h < HP; ++h) {
                float d = 0.0f;
#pragma unroll
                for (int j = 0; j < CPL; ++j) {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) d = fmaf(qr[h][j][e], elem<C>(cur.k[u][j], e), d);
                }
#pragma unroll
                for (int o = LPR / 2; o > 0; o >>= 1) d += __shfl_xor_sync(FULL_MASK, d, o);
                sc[u][h] = ok[u] ? d : neg_inf();
            }
        }
        if (ok[0]) {  // ok[1] implies ok[0]
#pragma unroll
            for (int h = 0; h < HP; ++h) {
                float mx = sc[0][h];
#pragma unroll
                for (int u = 1; u < U; ++u) mx = fmaxf(mx, sc[u][h]);
                const float mn = fmaxf(m[h], mx);
                const float corr = exp2f(m[h] - mn);  // m = −inf → 0
                float pr[U];
                float ps = 0.0f;
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    pr[u] = exp2f(sc[u][h] - mn);  // −inf → 0
                    ps += pr[u];
                }
                l[h] = l[h] * corr + ps;
                m[h] = mn;
#pragma unroll
                for (int j = 0; j < CPL; ++j) {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) {
                        float a = acc[h][j][e] * corr;
#pragma unroll
                        for (int u = 0; u < U; ++u) a = fmaf(pr[u], elem<C>(cur.v[u][j], e), a);
                        acc[h][j][e] = a;
                    }
                }
            }
        }
        cur = nxt;
    }

    // Merge the lane groups of a warp (rows were interleaved across them).
#pragma unroll
    for (int o = LPR; o < WARP_SIZE; o <<= 1) {
#pragma unroll
        for (int h = 0; h < HP; ++h) {
            const float mo = __shfl_xor_sync(FULL_MASK, m[h], o);
            const float lo = __shfl_xor_sync(FULL_MASK, l[h], o);
            const float M = fmaxf(m[h], mo);
            const float a = merge_w(m[h], M), c = merge_w(mo, M);  // 0 while both are −inf
            l[h] = l[h] * a + lo * c;
            m[h] = M;
#pragma unroll
            for (int j = 0; j < CPL; ++j) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    const float ao = __shfl_xor_sync(FULL_MASK, acc[h][j][e], o);
                    acc[h][j][e] = acc[h][j][e] * a + ao * c;
                }
            }
        }
    }

    if (sub == 0) {
        // float4 stores: a lane's VEC floats are contiguous, lanes VEC floats apart (scalar
        // stores hit each bank 8 ways for bf16; ncu counted 80 % of the store wavefronts).
        static_assert(VEC % 4 == 0 && HD % 4 == 0, "whole float4 runs");
#pragma unroll
        for (int h = 0; h < HP; ++h) {
#pragma unroll
            for (int j = 0; j < CPL; ++j) {
#pragma unroll
                for (int e = 0; e < VEC; e += 4)
                    *reinterpret_cast<float4*>(s_acc + (warp * HP + h) * HD + (li + j * LPR) * VEC + e) =
                        make_float4(acc[h][j][e], acc[h][j][e + 1], acc[h][j][e + 2], acc[h][j][e + 3]);
            }
            if (li == 0) {
                s_m[warp * HP + h] = m[h];
                s_l[warp * HP + h] = l[h];
            }
        }
    }
    __syncthreads();
    // Each warp's weight in its head's merge, once per (warp, head) rather than per element:
    // thread h turns column h of s_m into weights and leaves the head's (max, sum) in s_ml.
    if (threadIdx.x < nh) {
        const int h = threadIdx.x;
        float M = neg_inf(), L = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) M = fmaxf(M, s_m[w * HP + h]);
#pragma unroll
        for (int w = 0; w < W; ++w) {
            const float wt = merge_w(s_m[w * HP + h], M);  // 0 for a warp that saw no key
            s_m[w * HP + h] = wt;
            L = fmaf(s_l[w * HP + h], wt, L);
        }
        s_ml[0][h] = M;
        s_ml[1][h] = L;
    }
    __syncthreads();

    const i64 head_base = (i64)at.b * n_head + at.h0;  // row of out / work for head 0 of this block
    // out = null: every split's partials stay in work for the o-projection (combine_matvec.cuh)
    // to combine, even with one split; no ticket, no combine here.
    const bool direct = n_split == 1 && out != nullptr;
    for (int idx = threadIdx.x; idx < nh * HD; idx += THREADS) {
        const int h = idx / HD, d = idx % HD;
        float A = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) A = fmaf(s_acc[(w * HP + h) * HD + d], s_m[w * HP + h], A);
        const float L = s_ml[1][h];
        if (direct) {
            out[(head_base + h) * HD + d] = L > 0.0f ? A / L : 0.0f;
        } else {
            const i64 part = (head_base + h) * n_split + sp;
            work_acc[part * HD + d] = A;
            if (d == 0) {
                work_ml[part * 2] = s_ml[0][h];
                work_ml[part * 2 + 1] = L;
            }
        }
    }
    if (direct || out == nullptr) return;

    // Last block of this head group combines every split (the partials handed over by one
    // acquire-release ticket a block: atomic_add_acq_rel).
    __shared__ int s_last;
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomic_add_acq_rel(&counters[head_base], 1u) == (u32)(n_split - 1);
    __syncthreads();
    if (!s_last) return;
    // The partials come from other blocks (each released by its ticket): read them at L2
    // (ld.global.cg), never through a possibly stale L1 line. First a warp per head finds the
    // head's max and sum over the splits (one online pass per lane, then a butterfly) and, when
    // they fit in `smem` (free now), each split's weight; then a thread takes 4 adjacent
    // elements (float4 partials) and sums the splits' weighted partials, the loads independent.
    const float2* ml = reinterpret_cast<const float2*>(work_ml);
    float* s_sw = smem;  // [nh][n_split] weights
    const bool table = nh * n_split <= SMEM_FLOATS;
    for (int h = warp; h < nh; h += W) {
        const i64 part0 = (head_base + h) * n_split;
        float M = neg_inf(), L = 0.0f;
        for (int s = lane; s < n_split; s += WARP_SIZE) {
            const float2 pm = __ldcg(ml + part0 + s);
            const float Mn = fmaxf(M, pm.x);
            L = fmaf(L, merge_w(M, Mn), pm.y * merge_w(pm.x, Mn));
            M = Mn;
        }
#pragma unroll
        for (int o = WARP_SIZE / 2; o > 0; o >>= 1) {
            const float Mo = __shfl_xor_sync(FULL_MASK, M, o), Lo = __shfl_xor_sync(FULL_MASK, L, o);
            const float Mn = fmaxf(M, Mo);
            L = fmaf(L, merge_w(M, Mn), Lo * merge_w(Mo, Mn));
            M = Mn;
        }
        if (table) {
            for (int s = lane; s < n_split; s += WARP_SIZE) s_sw[h * n_split + s] = merge_w(__ldcg(ml + part0 + s).x, M);
        }
        if (lane == 0) {
            s_ml[0][h] = M;
            s_ml[1][h] = L;
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < nh * HD / 4; idx += THREADS) {
        const int h = idx / (HD / 4), d = idx % (HD / 4) * 4;
        const i64 part0 = (head_base + h) * n_split;
        const float M = s_ml[0][h], L = s_ml[1][h];
        float4 A = make_float4(0.f, 0.f, 0.f, 0.f);
        const float4* a = reinterpret_cast<const float4*>(work_acc + part0 * HD + d);
        if (table) {
#pragma unroll 8
            for (int s = 0; s < n_split; ++s) A = fma4(__ldcg(a + s * (HD / 4)), s_sw[h * n_split + s], A);
        } else {
#pragma unroll 8
            for (int s = 0; s < n_split; ++s) A = fma4(__ldcg(a + s * (HD / 4)), merge_w(__ldcg(ml + part0 + s).x, M), A);
        }
        float* o = out + (head_base + h) * HD + d;
        o[0] = L > 0.0f ? A.x / L : 0.0f;
        o[1] = L > 0.0f ? A.y / L : 0.0f;
        o[2] = L > 0.0f ? A.z / L : 0.0f;
        o[3] = L > 0.0f ? A.w / L : 0.0f;
    }
    if (threadIdx.x == 0) counters[head_base] = 0u;
}

template <CacheType C, int HD, int HP_SPEC, int HP_MAX, int HD_MAX, int THREADS, class Pre>
__device__ __forceinline__ void dispatch_hp(const float* q, const Pre& pre, const BlockAt& at, const void* kc, const void* vc,
                                            float* out, float* wa, float* wm, u32* ctr, float* smem, int n_head, int n_kv,
                                            int max_ctx, int c0, int c1, int n_split, int sp, float sl2) {
#define MEMRA_ATTN_BLOCK(HPV) \
    block<C, HD, HPV, HP_MAX, HD_MAX, THREADS>(q, pre, at, kc, vc, out, wa, wm, ctr, smem, n_head, n_kv, max_ctx, c0, c1, n_split, sp, sl2)
    if constexpr (HP_SPEC != 0) {
        MEMRA_ATTN_BLOCK(HP_SPEC);
    } else if (HP_MAX == 1 || at.nh <= 1) {
        MEMRA_ATTN_BLOCK(1);
    } else if constexpr (HP_MAX >= 2) {
        if (HP_MAX == 2 || at.nh <= 2) {
            MEMRA_ATTN_BLOCK(2);
        } else if constexpr (HP_MAX >= 4) {
            MEMRA_ATTN_BLOCK(4);
        }
    }
#undef MEMRA_ATTN_BLOCK
}

}  // namespace attn_detail

// The kernel body. `pre` (attn_decode_rope.cuh) runs after the wait for the previous kernel and
// before the key loop: it leaves the block's q heads in shared memory and the new key row with them.
template <class Cfg, class Pre = attn_detail::NoPrologue>
__device__ __forceinline__ void attn_decode_impl(const float* q, const void* k_cache, const void* v_cache, const int* pos,
                                                 float* out, float* work, int n_seq, int head_dim_rt, int n_head_rt,
                                                 int n_kv_rt, int max_ctx, int window, int n_split, float scale,
                                                 const Pre& pre = Pre{}) {
    constexpr CacheType C = Cfg::CACHE_T;
    constexpr bool G_FIXED = Cfg::N_HEAD != 0 && Cfg::N_KV != 0;
    static_assert(!G_FIXED || Cfg::N_HEAD % (Cfg::N_KV == 0 ? 1 : Cfg::N_KV) == 0, "N_HEAD must be a multiple of N_KV");
    constexpr int G_SPEC = G_FIXED ? Cfg::N_HEAD / Cfg::N_KV : 0;
    constexpr int HP_CAP = Cfg::HEADS_PER_BLOCK;
    static_assert(HP_CAP == 1 || HP_CAP == 2 || HP_CAP == attn_detail::HP_CAP, "HEADS_PER_BLOCK is 1, 2 or 4");
    constexpr int HP_SPEC = G_SPEC == 0 ? 0 : (G_SPEC < HP_CAP ? G_SPEC : HP_CAP);
    const int hd = dim_or<Cfg::HEAD_DIM>(head_dim_rt);
    const int n_head = dim_or<Cfg::N_HEAD>(n_head_rt), n_kv = dim_or<Cfg::N_KV>(n_kv_rt);
    const int G = n_head / n_kv;
    const int n_hg = (G + HP_CAP - 1) / HP_CAP;
    const int b = blockIdx.z, sp = blockIdx.y;
    const int kvh = blockIdx.x / n_hg, hg = blockIdx.x % n_hg;
    // Until pdl_entry() (attn_detail::block) the block reads only the positions (no kernel of the step writes them) and
    // the key rows no kernel of this step writes, and does the prologue's constant work.
    if (b >= n_seq || kvh >= n_kv) {
        pdl_entry();
        return;
    }
    const int h0 = kvh * G + hg * HP_CAP;
    const int nh = min(HP_CAP, G - hg * HP_CAP);

    const i64 n_part = (i64)n_seq * n_head * n_split;
    u32* counters = reinterpret_cast<u32*>(work);
    float* work_acc = work + ((i64)n_seq * n_head + 3) / 4 * 4;  // 16-byte aligned partials
    float* work_ml = work_acc + n_part * hd;
    const int p = pos[b];
    if (p < 0 || p >= max_ctx) {
        pdl_entry();
        const float nan = __int_as_float(0x7fc00000);
        if (out == nullptr) {  // a NaN partial of every split (m 0, l 1): the combined row is NaN
            const i64 part0 = ((i64)b * n_head + h0) * n_split + sp;
            for (int i = threadIdx.x; i < nh * hd; i += Cfg::THREADS) {
                const i64 part = part0 + (i64)(i / hd) * n_split;
                work_acc[part * hd + i % hd] = nan;
                if (i % hd == 0) {
                    work_ml[part * 2] = 0.0f;
                    work_ml[part * 2 + 1] = 1.0f;
                }
            }
        } else if (sp == 0) {
            for (int i = threadIdx.x; i < nh * hd; i += Cfg::THREADS) out[((i64)b * n_head + h0) * hd + i] = nan;
        }
        return;
    }
    const int lo = window > 0 ? max(0, p - window + 1) : 0;
    const int len = p - lo + 1;
    const int chunk = (len + n_split - 1) / n_split;
    const int c0 = lo + sp * chunk;
    const int c1 = min(c0 + chunk, p + 1);
    const float sl2 = scale * attn_detail::LOG2E;
    // One merge buffer for every instantiation (separate __shared__ arrays would add up).
    constexpr int W = Cfg::THREADS / WARP_SIZE;
    constexpr int HP_MAX = HP_SPEC != 0 ? HP_SPEC : HP_CAP;
    constexpr int HD_MAX = Cfg::HEAD_DIM != 0 ? Cfg::HEAD_DIM : 256;
    static_assert(W * HP_MAX * (HD_MAX + 2) * 4 <= 40960, "shared merge buffer too large: lower THREADS");
    __shared__ __align__(16) float smem[W * HP_MAX * (HD_MAX + 2)];
    const attn_detail::BlockAt at{b, kvh, hg, h0, nh, p, c0 <= p && p < c1};

#define MEMRA_ATTN_HD(HDV)                                                                                              \
    attn_detail::dispatch_hp<C, HDV, HP_SPEC, HP_MAX, HD_MAX, Cfg::THREADS>(q, pre, at, k_cache, v_cache, out, work_acc, \
                                                                            work_ml, counters, smem, n_head, n_kv,     \
                                                                            max_ctx, c0, c1, n_split, sp, sl2)
    if constexpr (Cfg::HEAD_DIM != 0) {
        MEMRA_ATTN_HD(Cfg::HEAD_DIM);
    } else if (hd == 128) {
        MEMRA_ATTN_HD(128);
    } else if (hd == 256) {
        MEMRA_ATTN_HD(256);
    } else if (hd == 64) {
        MEMRA_ATTN_HD(64);
    } else {
        pdl_entry();  // a head_dim the host refuses: no block may skip the wait
    }
#undef MEMRA_ATTN_HD
}

}  // namespace memra

// __launch_bounds__(THREADS, 1): with the thread count alone ptxas may hold the generic variants
// (nine attention bodies) to 128 registers and spill.
#define MEMRA_DEFINE_ATTN_DECODE(SYMBOL, CFG)                                                                   \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS, 1)                                               \
        SYMBOL(const float* q, const void* k_cache, const void* v_cache, const int* pos, float* out, float* work, \
               int n_seq, int head_dim, int n_head, int n_kv, int max_ctx, int window, int n_split, float scale) { \
        memra::attn_decode_impl<CFG>(q, k_cache, v_cache, pos, out, work, n_seq, head_dim, n_head, n_kv, max_ctx, \
                                     window, n_split, scale);                                                  \
    }
