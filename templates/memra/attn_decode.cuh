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
// Kernel parameters:
//   (const float* q, const void* k_cache, const void* v_cache, const int* pos, float* out,
//    float* work, int n_seq, int head_dim, int n_head, int n_kv, int max_ctx, int window,
//    int n_split, float scale)
//   q [n_seq, n_head, hd] f32; caches [n_seq, max_ctx, n_kv, hd] CACHE_T; pos [n_seq] (device);
//   out [n_seq, n_head, hd] f32. Sequence b attends with query position p = pos[b] to keys
//   s ∈ [0, p] with p − s < window (window 0 = no window): out = Σ_s softmax(scale·q·k_s)·v_s.
//   p ∉ [0, max_ctx) writes NaN to that sequence's output (a visible slip, never a fault).
// Work split: G = n_head / n_kv q heads share a kv head; a block processes HP = (G ≤ 4 ? G : 4)
//   heads (generic: G rounded up to 1, 2, 4) of one kv head, so each K/V row is read once
//   per head group. The visible keys are cut into n_split equal chunks (grid.y). n_split = 1:
//   the block writes out directly and `work` is unused (may be null). n_split > 1: each block
//   writes (max, sum, unnormalized accumulator) to `work`; the last block of a head group (an
//   atomic counter) combines them and resets the counter to 0.
//   work (f32 units): u32 counters [n_seq, n_head] padded to a multiple of 4 (zeroed once when
//   allocated; the kernel leaves them 0), then acc [n_seq, n_head, n_split, hd] and (m, l)
//   [n_seq, n_head, n_split, 2]. The counters come first so that their place does not depend on
//   n_split: a workspace sized for S splits serves every n_split ≤ S at the same n_seq and n_head
//   (with counters after the partials, a launch with more splits wrote partials over the
//   counters of one with fewer, whose combine then never ran or ran early).
// Geometry: n_hg = ceil(G / 4); grid (n_kv · n_hg, n_split, n_seq), block THREADS, no dynamic
//   shared memory (static: (THREADS/32)·HP·(hd + 2)·4 bytes ≤ 40 KiB, e.g. THREADS 128 at hd 256).
// Inside a block: K and V rows are read with 16-byte loads; a row is split over LPR = min(32,
// hd/VEC) lanes (VEC = 8 bf16 or 4 f32), so a warp takes 32/LPR rows at once, two such rows per
// lane group per step (loads in flight before the math). Online softmax in base 2 per lane group,
// then merged across lane groups (shuffles) and warps (shared memory).
#pragma once
#include "memra/common.cuh"
#include "memra/mma.cuh"

namespace memra {
namespace attn_detail {

constexpr float LOG2E = 1.4426950408889634f;
// Most q heads one block carries in registers (q and accumulator: 2·HP·hd/LPR floats a lane);
// larger groups are split over blocks that re-read K/V (from L2).
constexpr int HP_CAP = 4;
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

template <CacheType C> struct CacheTraits;
template <> struct CacheTraits<CacheType::BF16> {
    static constexpr int VEC = 8;   // elements per 16-byte chunk
    static constexpr int BYTES = 2;
};
template <> struct CacheTraits<CacheType::F32> {
    static constexpr int VEC = 4;
    static constexpr int BYTES = 4;
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
    static constexpr bool ON = false;
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

// Where a block's keys live: the caches, the first element of this sequence's kv head, the
// elements between rows, the block's rows [c0, c1) and the query position p.
struct Keys {
    const char* k;
    const char* v;
    i64 base, stride;
    int c0, c1, p;
};

// A warp's partial softmax over its keys, in shared memory [W][HP][HD] (acc, unnormalized) and
// [W][HP] (m, l); a warp that saw no key leaves m = −inf, l = 0, acc = 0.
struct Partials {
    float* acc;
    float* m;
    float* l;
};

// What the key loop has once the previous kernel is done: the block's q heads (head h at
// q + h·hd) and, with a prologue, its new key row p (raw CACHE_T chunks in shared memory).
struct AfterWait {
    const float* q;
    const float4* new_k;
    const float4* new_v;
};

// The wait for the previous kernel and what follows it. Before: the block's first key rows into
// L2 and the prologue's constant work (the caller has its first rows' loads in flight). After:
// the prologue (attn_decode_rope) or q from global memory.
template <CacheType C, int HD, int HP_MAX, int HD_MAX, int THREADS, class Pre>
__device__ __forceinline__ AfterWait enter(const float* q_glob, const Pre& pre, const BlockAt& at, const Keys& ks, int n_head,
                                           int n_kv, int max_ctx) {
    prefetch_rows<C, THREADS>(ks.k, ks.v, ks.base + (i64)ks.c0 * ks.stride, ks.stride, min(ks.c1 - ks.c0, PREFETCH_ROWS), HD);
    pre.before_wait(at.p, HD, n_head, n_kv);
    pdl_entry();
    if constexpr (Pre::ON) {
        const Prepared r = pre.template run<HP_MAX, HD_MAX>(at, HD, n_head, n_kv, max_ctx);
        return AfterWait{r.q, r.new_row.k, r.new_row.v};
    } else {
        return AfterWait{q_glob + ((i64)at.b * n_head + at.h0) * HD, nullptr, nullptr};
    }
}

// The K and V chunks of one step of the key loop: U rows per lane group, raw CACHE_T.
template <int U, int CPL> struct Rows {
    float4 k[U][CPL], v[U][CPL];
};

// The key loop on CUDA cores (any CACHE_T): a K/V row is split over LPR = min(32, hd/VEC) lanes
// (16-byte chunks), a warp takes 32/LPR rows at once, two such rows per lane group per step
// with the next step's loads in flight during the math; f32 dot products reduced by shuffles,
// online softmax in base 2 per lane group, then merged across the lane groups.
template <CacheType C, int HD, int HP, int HP_MAX, int HD_MAX, int THREADS, class Pre>
__device__ __forceinline__ void keys_simt(const float* __restrict__ q_glob, const Pre& pre, const BlockAt& at, const Keys& ks,
                                          const Partials& part, int n_head, int n_kv, int max_ctx, float scale_log2) {
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

    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int sub = lane / LPR, li = lane % LPR;
    const int nh = at.nh, p = at.p, c0 = ks.c0, c1 = ks.c1;
    // This lane's chunks of key row s into slot u of r (zeros unless `ld`).
    auto load = [&](Rows<U, CPL>& r, int u, int s, bool ld) {
        const i64 off = ks.base + (i64)s * ks.stride;
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
            const i64 e_off = (off + (li + j * LPR) * VEC) * T::BYTES;
            r.k[u][j] = ld ? ld16(ks.k + e_off) : make_float4(0.f, 0.f, 0.f, 0.f);
            r.v[u][j] = ld ? ld16(ks.v + e_off) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    // Rows base + u·STEP + warp·RPW + sub of [c0, c1), except `skip` (zeros), into r.
    auto issue = [&](Rows<U, CPL>& r, int base, int skip) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int s = base + u * STEP + warp * RPW + sub;
            load(r, u, s, s < c1 && s != skip);
        }
    };

    // Before the wait: row p is written during this step (by the previous kernel, or by this
    // launch's prologue), every other visible row by earlier steps.
    Rows<U, CPL> cur;
    issue(cur, c0, p);
    const AfterWait aw = enter<C, HD, HP_MAX, HD_MAX, THREADS>(q_glob, pre, at, ks, n_head, n_kv, max_ctx);
    const float* q = aw.q;
    const int new_s = Pre::ON && at.holds_p ? p : -1;  // the key row read from shared memory
    if constexpr (!Pre::ON) {
        if (at.holds_p) {  // row p, left out before the wait, is now in the cache
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int s = c0 + u * STEP + warp * RPW + sub;
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
            const int s = base + u * STEP + warp * RPW + sub;
            ok[u] = s < c1;
            if constexpr (Pre::ON) {
                if (ok[u] && s == new_s) {
#pragma unroll
                    for (int j = 0; j < CPL; ++j) {
                        cur.k[u][j] = aw.new_k[li + j * LPR];
                        cur.v[u][j] = aw.new_v[li + j * LPR];
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
                    *reinterpret_cast<float4*>(part.acc + (warp * HP + h) * HD + (li + j * LPR) * VEC + e) =
                        make_float4(acc[h][j][e], acc[h][j][e + 1], acc[h][j][e + 2], acc[h][j][e + 3]);
            }
            if (li == 0) {
                part.m[warp * HP + h] = m[h];
                part.l[warp * HP + h] = l[h];
            }
        }
    }
}

// One 16-key tile of the tensor-core loop in registers, raw bf16. Lane (g, t) = (lane / 4,
// lane % 4) holds K rows g and g + 8 (16-byte chunks at dims 32c + 8t: the A fragments of
// S^T = K·q^T, k-steps 2c and 2c + 1 taking words 0–1 and 2–3) and V rows 2t, 2t + 1, 2t + 8,
// 2t + 9 (chunks at dims (HD/8)·g + 8c: dims (HD/8)·g + 2i, + 1 are rows g, g + 8 of dim tile i's
// A fragment of O^T = V^T·P^T). The reduction order of both products is free, so the dims are
// permuted to match whole 16-byte loads: no shared-memory staging, no transposes.
template <int HD> struct TcTile {
    static constexpr int KC = HD / 32, VC = HD / 64;
    float4 k[2][KC];
    float4 v[4][VC];
};

__device__ __forceinline__ u32 word(const float4& c, int i) {
    return __float_as_uint(i == 0 ? c.x : i == 1 ? c.y : i == 2 ? c.z : c.w);
}
__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// (x0, x1) as bf16 hi + lo pairs: x ≈ hi + lo to ~2^-17 relative, so the tensor-core products
// of a two-term operand keep f32-like accuracy.
__device__ __forceinline__ uint2 split_bf16x2(float x0, float x1) {
    const u32 h = ptx::pack_bf16x2(x0, x1);
    return make_uint2(h, ptx::pack_bf16x2(x0 - bf16_lo(h), x1 - bf16_hi(h)));
}

// The key loop on tensor cores (CACHE_T = BF16): a warp takes 16-key tiles (warp, warp + W, …
// from c0); per tile S^T = K·q^T (m16n8k16: 16 keys × 8 heads, heads past nh zero) and
// O^T += V^T·P^T (16 dims × 8 heads per mma, dims in the tile's permuted order). q·scale·log2 e
// and P enter as bf16 hi + lo (two mma each), K and V are exact bf16, accumulation is f32: the
// products keep ~2^-17 relative accuracy. P^T's fragments come from S^T's accumulators by
// movmatrix.trans. Online softmax per head in base 2 (the tile max through shuffles over g; the
// sums stay per lane until the end). Registers hold O (64 at head_dim 256) and one of a tile's K
// or V (64 each): K is loaded first (the first tile's before the wait), V once S is done, the next
// tile's K once O is (ptx::after keeps the scheduler from hoisting them, which spilled); their rows
// were asked into L2 earlier (enter(): the block's first rows; the loop: the next tile's).
template <int HD, int HP, int HP_MAX, int HD_MAX, int THREADS, class Pre>
__device__ __forceinline__ void keys_tc(const float* __restrict__ q_glob, const Pre& pre, const BlockAt& at, const Keys& ks,
                                        uint4* qf, const Partials& part, int n_head, int n_kv, int max_ctx, float scale_log2) {
    using Tile = TcTile<HD>;
    constexpr int W = THREADS / WARP_SIZE;
    constexpr int KT = HD / 16;  // k-steps of S^T, dim tiles of O^T
    static_assert(HD % 64 == 0 && HP <= 8, "the tensor-core loop takes head_dim 64·k and up to 8 heads");
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    const int c1 = ks.c1, p = at.p;
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    // 16 bytes of row s at element e: zeros past c1; row p zeros before the wait (aw null), then
    // the prologue's row (from shared memory) or the cache's.
    auto chunk = [&](const char* cache, const float4* fresh, int s, int e, const AfterWait* aw) {
        if (s >= c1 || (s == p && aw == nullptr)) return zero;
        if (Pre::ON && s == p) return fresh[e / 8];
        return ld16(cache + (ks.base + (i64)s * ks.stride + e) * 2);
    };
    // The tile at `base` into r: K rows (parts & 1), V rows (parts & 2); only_p: row p alone.
    auto fill = [&](Tile& r, int base, const AfterWait* aw, int parts, bool only_p) {
        if (parts & 1) {
#pragma unroll
            for (int kr = 0; kr < 2; ++kr) {
                const int s = base + g + 8 * kr;
                if (only_p && s != p) continue;
#pragma unroll
                for (int c = 0; c < Tile::KC; ++c) r.k[kr][c] = chunk(ks.k, aw ? aw->new_k : nullptr, s, 32 * c + 8 * t, aw);
            }
        }
        if (parts & 2) {
#pragma unroll
            for (int vr = 0; vr < 4; ++vr) {
                const int s = base + 2 * t + (vr & 1) + 8 * (vr >> 1);
                if (only_p && s != p) continue;
#pragma unroll
                for (int c = 0; c < Tile::VC; ++c) r.v[vr][c] = chunk(ks.v, aw ? aw->new_v : nullptr, s, HD / 8 * g + 8 * c, aw);
            }
        }
    };

    // The K and V rows of the tile at `base` into L2.
    auto prefetch_rows16 = [&](int base) {
        constexpr int LINES = HD * 2 / 128;  // per row
        for (int i = lane; i < 16 * LINES; i += WARP_SIZE) {
            const int s = base + i / LINES;
            const i64 at = (ks.base + (i64)s * ks.stride) * 2 + (i % LINES) * 128;
            if (s < c1) {
                prefetch_l2(ks.k + at);
                prefetch_l2(ks.v + at);
            }
        }
    };

    const int first = ks.c0 + 16 * warp;
    Tile cur;
    if (first < c1) fill(cur, first, nullptr, 1, false);
    const AfterWait aw = enter<CacheType::BF16, HD, HP_MAX, HD_MAX, THREADS>(q_glob, pre, at, ks, n_head, n_kv, max_ctx);
    if (at.holds_p && first < c1) fill(cur, first, &aw, 1, true);

    // q's B fragments, once per block: k-step kk, lane (g, t) → head g's dims 32·(kk/2) + 8t +
    // 4·(kk%2) + 0..3 (K's permutation) as (hi b0, hi b1, lo b0, lo b1); lanes of heads ≥ HP
    // (zero fragments) have no entry.
    constexpr int QL = 4 * HP;  // lanes with an entry
    for (int i = threadIdx.x; i < KT * QL; i += THREADS) {
        const int kk = i / QL, hq = i % QL / 4, tq = i % 4;
        const float* src = aw.q + hq * HD + 32 * (kk / 2) + 8 * tq + 4 * (kk % 2);
        float x[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) x[e] = hq < at.nh ? src[e] * scale_log2 : 0.0f;
        const uint2 a = split_bf16x2(x[0], x[1]), b = split_bf16x2(x[2], x[3]);
        qf[i] = make_uint4(a.x, b.x, a.y, b.y);
    }
    __syncthreads();

    float o[KT][4];
#pragma unroll
    for (int i = 0; i < KT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.0f, 0.0f};  // heads 2t, 2t + 1
    for (int base = first; base < c1; base += 16 * W) {
        const int next = base + 16 * W;
        if (next < c1) prefetch_rows16(next);  // its loads wait for this tile's products
        // S^T: two independent accumulators (hi and lo parts of q).
        float sa[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j) sa[j][0] = sa[j][1] = sa[j][2] = sa[j][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
            const int c = kk / 2, w0 = 2 * (kk % 2);
            const u32 a[4] = {word(cur.k[0][c], w0), word(cur.k[1][c], w0), word(cur.k[0][c], w0 + 1), word(cur.k[1][c], w0 + 1)};
            const uint4 b = lane < QL ? qf[kk * QL + lane] : make_uint4(0u, 0u, 0u, 0u);
            ptx::bf16_16816(sa[0], a, b.x, b.y);
            ptx::bf16_16816(sa[1], a, b.z, b.w);
        }
        // sc: keys g (0, 1) and g + 8 (2, 3) × heads 2t (0, 2) and 2t + 1 (1, 3).
        float sc[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[e] = sa[0][e] + sa[1][e];
        // V into K's registers, now free (ptx::after: not hoisted above S).
        fill(cur, ptx::after(base, sc[0]), &aw, 2, false);
        if (base + g >= c1) sc[0] = sc[1] = neg_inf();
        if (base + g + 8 >= c1) sc[2] = sc[3] = neg_inf();
        float mx0 = fmaxf(sc[0], sc[2]), mx1 = fmaxf(sc[1], sc[3]);
#pragma unroll
        for (int off = 4; off < WARP_SIZE; off <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, off));
        }
        const float mn0 = fmaxf(m[0], mx0), mn1 = fmaxf(m[1], mx1);  // finite: key `base` is visible
        const float cr0 = exp2f(m[0] - mn0), cr1 = exp2f(m[1] - mn1);  // m = −inf → 0
        const float pr[4] = {exp2f(sc[0] - mn0), exp2f(sc[1] - mn1), exp2f(sc[2] - mn0), exp2f(sc[3] - mn1)};
        l[0] = fmaf(l[0], cr0, pr[0] + pr[2]);
        l[1] = fmaf(l[1], cr1, pr[1] + pr[3]);
        m[0] = mn0;
        m[1] = mn1;
#pragma unroll
        for (int i = 0; i < KT; ++i) {
            o[i][0] *= cr0;
            o[i][1] *= cr1;
            o[i][2] *= cr0;
            o[i][3] *= cr1;
        }
        // P (keys × heads, rows g and g + 8) as bf16 hi + lo, transposed into P^T's B fragments.
        const uint2 p0 = split_bf16x2(pr[0], pr[1]), p1 = split_bf16x2(pr[2], pr[3]);
        const u32 bh0 = ptx::movmatrix_trans(p0.x), bh1 = ptx::movmatrix_trans(p1.x);
        const u32 bl0 = ptx::movmatrix_trans(p0.y), bl1 = ptx::movmatrix_trans(p1.y);
#pragma unroll
        for (int i = 0; i < KT; ++i) {
            const int c = i / 4, wi = i % 4;  // dims (HD/8)·g + 2i, + 1: chunk i/4, word i%4
            const u32 v0 = word(cur.v[0][c], wi), v1 = word(cur.v[1][c], wi);
            const u32 v2 = word(cur.v[2][c], wi), v3 = word(cur.v[3][c], wi);
            const u32 a[4] = {__byte_perm(v0, v1, 0x5410), __byte_perm(v0, v1, 0x7632), __byte_perm(v2, v3, 0x5410),
                              __byte_perm(v2, v3, 0x7632)};
            ptx::bf16_16816(o[i], a, bh0, bh1);
            ptx::bf16_16816(o[i], a, bl0, bl1);
        }
        if (next < c1) fill(cur, ptx::after(next, o[KT - 1][0]), &aw, 1, false);  // into V's registers
    }

#pragma unroll
    for (int off = 4; off < WARP_SIZE; off <<= 1) {
        l[0] += __shfl_xor_sync(FULL_MASK, l[0], off);
        l[1] += __shfl_xor_sync(FULL_MASK, l[1], off);
    }
    // Dims in fragment order: element 16i + 2g + e of a head is dim (HD/8)·g + 2i + e (tc_dim).
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int h = 2 * t + hh;
        if (h < at.nh) {
            float* a = part.acc + (warp * HP + h) * HD + 2 * g;
#pragma unroll
            for (int i = 0; i < KT; ++i) *reinterpret_cast<float2*>(a + 16 * i) = make_float2(o[i][hh], o[i][2 + hh]);
            if (g == 0) {
                part.m[warp * HP + h] = m[hh];
                part.l[warp * HP + h] = l[hh];
            }
        }
    }
}

// The head dim of element d of keys_tc's partials.
template <int HD> __device__ __forceinline__ int tc_dim(int d) { return HD / 8 * (d % 16 / 2) + 2 * (d / 16) + d % 2; }

// One block's attention: its q heads [h0, h0 + nh) of kv head kvh over keys [c0, c1). HP / HD are
// this instantiation's (generic: dispatched), HP_MAX / HD_MAX the kernel's largest, which size
// `smem` and the prologue's tables. The key loop (tensor cores for a bf16 cache, else CUDA
// cores) leaves each warp's partials in `smem`; they are merged per head, then written out
// (n_split = 1) or to `work`, where the last block of the head group combines the splits.
template <CacheType C, int HD, int HP, int HP_MAX, int HD_MAX, int THREADS, class Pre>
__device__ __forceinline__ void block(const float* __restrict__ q_glob, const Pre& pre, const BlockAt& at,
                                      const void* __restrict__ k_cache, const void* __restrict__ v_cache, float* __restrict__ out,
                                      float* work_acc, float* work_ml, u32* counters, float* smem, uint4* qf, int n_head, int n_kv,
                                      int max_ctx, int c0, int c1, int n_split, int sp, float scale_log2) {
    constexpr int W = THREADS / WARP_SIZE;
    constexpr bool TC = C == CacheType::BF16;
    static_assert(HP <= HP_MAX && HD <= HD_MAX, "an instantiation within the kernel's maxima");
    // smem: acc [W][HP][HD], then m [W][HP], l [W][HP] (sized by the caller for HP_MAX / HD_MAX).
    constexpr int SMEM_FLOATS = W * HP_MAX * (HD_MAX + 2);
    const Partials part{smem, smem + W * HP * HD, smem + W * HP * HD + W * HP};
    __shared__ float s_ml[2][HP];  // a head's (max, sum) after a merge

    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int nh = at.nh;
    const i64 row_stride = (i64)n_kv * HD;  // elements between cache rows
    const Keys ks{static_cast<const char*>(k_cache), static_cast<const char*>(v_cache),
                  ((i64)at.b * max_ctx) * row_stride + (i64)at.kvh * HD, row_stride, c0, c1, at.p};
    if constexpr (TC) {
        keys_tc<HD, HP, HP_MAX, HD_MAX, THREADS>(q_glob, pre, at, ks, qf, part, n_head, n_kv, max_ctx, scale_log2);
    } else {
        keys_simt<C, HD, HP, HP_MAX, HD_MAX, THREADS>(q_glob, pre, at, ks, part, n_head, n_kv, max_ctx, scale_log2);
    }
    // Element d of a partial is out's dim_of(d).
    auto dim_of = [](int d) { return TC ? tc_dim<HD>(d) : d; };
    float* s_m = part.m;
    float* s_l = part.l;
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
    for (int idx = threadIdx.x; idx < nh * HD; idx += THREADS) {
        const int h = idx / HD, d = idx % HD;
        float A = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) A = fmaf(part.acc[(w * HP + h) * HD + d], s_m[w * HP + h], A);
        const float L = s_ml[1][h];
        if (n_split == 1) {
            out[(head_base + h) * HD + dim_of(d)] = L > 0.0f ? A / L : 0.0f;
        } else {
            const i64 part = (head_base + h) * n_split + sp;
            work_acc[part * HD + d] = A;
            if (d == 0) {
                work_ml[part * 2] = s_ml[0][h];
                work_ml[part * 2 + 1] = L;
            }
        }
    }
    if (n_split == 1) return;

    // Last block of this head group combines every split.
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(&counters[head_base], 1u) == (u32)(n_split - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    // The partials come from other blocks (each fenced before its counter add): read them at L2
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
        float* o = out + (head_base + h) * HD;
        o[dim_of(d)] = L > 0.0f ? A.x / L : 0.0f;
        o[dim_of(d + 1)] = L > 0.0f ? A.y / L : 0.0f;
        o[dim_of(d + 2)] = L > 0.0f ? A.z / L : 0.0f;
        o[dim_of(d + 3)] = L > 0.0f ? A.w / L : 0.0f;
    }
    if (threadIdx.x == 0) counters[head_base] = 0u;
}

template <CacheType C, int HD, int HP_SPEC, int HP_MAX, int HD_MAX, int THREADS, class Pre>
__device__ __forceinline__ void dispatch_hp(const float* q, const Pre& pre, const BlockAt& at, const void* kc, const void* vc,
                                            float* out, float* wa, float* wm, u32* ctr, float* smem, uint4* qf, int n_head, int n_kv,
                                            int max_ctx, int c0, int c1, int n_split, int sp, float sl2) {
#define MEMRA_ATTN_BLOCK(HPV) \
    block<C, HD, HPV, HP_MAX, HD_MAX, THREADS>(q, pre, at, kc, vc, out, wa, wm, ctr, smem, qf, n_head, n_kv, max_ctx, c0, c1, n_split, sp, sl2)
    if constexpr (HP_SPEC != 0) {
        MEMRA_ATTN_BLOCK(HP_SPEC);
    } else if (at.nh <= 1) {
        MEMRA_ATTN_BLOCK(1);
    } else if (at.nh <= 2) {
        MEMRA_ATTN_BLOCK(2);
    } else {
        MEMRA_ATTN_BLOCK(4);
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
    constexpr int HP_CAP = attn_detail::HP_CAP;
    constexpr int HP_SPEC = G_SPEC == 0 ? 0 : (G_SPEC < HP_CAP ? G_SPEC : HP_CAP);
    const int hd = dim_or<Cfg::HEAD_DIM>(head_dim_rt);
    const int n_head = dim_or<Cfg::N_HEAD>(n_head_rt), n_kv = dim_or<Cfg::N_KV>(n_kv_rt);
    const int G = n_head / n_kv;
    const int n_hg = (G + HP_CAP - 1) / HP_CAP;
    const int b = blockIdx.z, sp = blockIdx.y;
    const int kvh = blockIdx.x / n_hg, hg = blockIdx.x % n_hg;
    // Until pdl_entry() (attn_detail::block) the block reads only the host-written positions and
    // the key rows no kernel of this step writes, and does the prologue's constant work.
    if (b >= n_seq || kvh >= n_kv) {
        pdl_entry();
        return;
    }
    const int h0 = kvh * G + hg * HP_CAP;
    const int nh = min(HP_CAP, G - hg * HP_CAP);

    const int p = pos[b];
    if (p < 0 || p >= max_ctx) {
        pdl_entry();
        if (sp == 0) {
            for (int i = threadIdx.x; i < nh * hd; i += Cfg::THREADS) out[((i64)b * n_head + h0) * hd + i] = __int_as_float(0x7fc00000);
        }
        return;
    }
    const int lo = window > 0 ? max(0, p - window + 1) : 0;
    const int len = p - lo + 1;
    const int chunk = (len + n_split - 1) / n_split;
    const int c0 = lo + sp * chunk;
    const int c1 = min(c0 + chunk, p + 1);
    const float sl2 = scale * attn_detail::LOG2E;
    const i64 n_part = (i64)n_seq * n_head * n_split;
    u32* counters = reinterpret_cast<u32*>(work);
    float* work_acc = work + ((i64)n_seq * n_head + 3) / 4 * 4;  // 16-byte aligned partials
    float* work_ml = work_acc + n_part * hd;
    // One merge buffer for every instantiation (separate __shared__ arrays would add up).
    constexpr int W = Cfg::THREADS / WARP_SIZE;
    constexpr int HP_MAX = HP_SPEC != 0 ? HP_SPEC : HP_CAP;
    constexpr int HD_MAX = Cfg::HEAD_DIM != 0 ? Cfg::HEAD_DIM : 256;
    static_assert(W * HP_MAX * (HD_MAX + 2) * 4 <= 40960, "shared merge buffer too large: lower THREADS");
    __shared__ __align__(16) float smem[W * HP_MAX * (HD_MAX + 2)];
    // The tensor-core loop's q fragments (attn_detail::keys_tc), one table for every instantiation.
    __shared__ __align__(16) uint4 qf[C == CacheType::BF16 ? HD_MAX * HP_MAX / 4 : 1];
    const attn_detail::BlockAt at{b, kvh, hg, h0, nh, p, c0 <= p && p < c1};

#define MEMRA_ATTN_HD(HDV)                                                                                              \
    attn_detail::dispatch_hp<C, HDV, HP_SPEC, HP_MAX, HD_MAX, Cfg::THREADS>(q, pre, at, k_cache, v_cache, out, work_acc, \
                                                                            work_ml, counters, smem, qf, n_head, n_kv, \
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
