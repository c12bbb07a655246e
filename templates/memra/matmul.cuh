// memra/matmul.cuh — quantized matrix product for prefill on tensor cores (owned by H-gemv).
//
//   Y[t][n] (+)= Σ_k X[t][k] · W[n][k]      t < T, n < N, k < K
//
// W is a GGUF weight (ne = [K, N], quant blocks along K) dequantized tile by tile into bf16 in
// shared memory; X is f32 in global memory, rounded to bf16 as it is staged; products on tensor
// cores (warpgroup MMAs on sm_90a, mma.sync m16n8k16 elsewhere; bf16 → f32, inline PTX), f32
// accumulation, f32 Y.
//
// Cfg fields (static constexpr):
//   int   K           row length of W and X (input dim); 0 = run time (kernel parameter `k`)
//   int   N           rows of W (output dim); 0 = run time (`n`)
//   QType QTYPE       element / block type of W
//   int   BM          tokens per block tile: 64 or 128
//   int   BN          W rows per block tile: 128 or 256 (F32 weights: 128 whatever is set). X, the
//                     larger operand per element (f32 from L2), is re-read N / BN times
//   int   THREADS     256 (8 warps: 2 along T × 4 along N)
//   int   ACCUMULATE  0: Y = X·Wᵀ; 1: Y += X·Wᵀ
//
// Kernel parameters, in order:
//   (const unsigned char* w, const float* x, float* y, int t, int k, int n, int ldx, int ldy,
//    const int* offsets, long long expert_bytes, long long x_batch, long long y_batch)
//   w: N·row_bytes(K) bytes, 16-byte aligned; x: [t][ldx] f32, 16-byte aligned, ldx % 4 == 0;
//   y: [t][ldy] f32. K is a multiple of the block size (32 or 256; 8 for F32/F16/BF16).
//   expert_bytes == 0: one product (offsets, x_batch, y_batch not read). expert_bytes > 0 (a
//   multiple of 16): one launch for a stack of matrices, matrix z = blockIdx.z at
//   w + z·expert_bytes, and either
//   - x_batch == 0: rows offsets[z] .. offsets[z+1] of x and y (an MoE prefill's tokens grouped
//     by expert; grid.y covers the largest group, blocks past their expert's rows exit), or
//   - x_batch > 0: t rows of x + z·x_batch and y + z·y_batch (floats; x_batch % 4 == 0): MLA's
//     per-head absorption of a prefill chunk, head z's rows interleaved with the others'.
//   One launch keeps every SM busy where one launch per matrix ran a few blocks each.
//
// __launch_bounds__(256, 1): one block per SM (BM · BN / 256 accumulators per thread plus the
// dequant and X prefetch registers), no spills.
//
// Launch geometry (MatmulGeometry<Cfg> below; the Rust wrapper mirrors it):
//   grid (ceil(N / BN), ceil(T / BM), experts or 1), block (THREADS), dynamic shared memory
//   2 · BN · RAW_ROW + 2 · (BM + BN) · 128 + 1024 bytes, RAW_ROW = 16 · (the odd number at or
//   above ceil((KR / BLOCK · BYTES + 16) / 16)), KR (elements of a raw super-tile) = 64 for F32;
//   F16 / BF16 128 (BN = 128) or 64; 32-element blocks 256 (BN = 128) or 128; 256-element
//   blocks 256. The kernel traps if launched with less.
//
// Structure: K runs in "super-tiles" of KR elements (whole quant blocks for every type); the raw
// bytes of the BN W rows of a super-tile are copied with 16-byte cp.async (aligned-floor
// addresses, as in matvec), one super-tile ahead. Each 64-wide k-tile is dequantized by all
// threads (the matvec unit decoders; BN / 128 × 32 elements of a row a thread; 16-byte shared
// loads and stores where the layout allows, see REG_RAW and put_runs) into a bf16 [BN][64] tile;
// X's k-tile is loaded one tile ahead into registers, rounded and stored as bf16 [BM][64]. Both
// tiles are 128-byte rows in the 128-byte-swizzle layout, double-buffered, one barrier per k-tile.
// sm_90a (NVRTC's target on Hopper) multiplies with warpgroup MMAs: warpgroup g takes tokens
// [64g, 64g + 64) × all BN W rows (BM = 128) or all 64 tokens × half the W rows (BM = 64), wgmma
// m64nNk16 with N = BM · BN / 128, issued asynchronously: the same threads produce tile kt + 1
// while the tensor cores run tile kt (the "SS" form). For 8- and
// 32-element units at K ≤ 2048 (and F32 / F16 / BF16 weights at any K) sm_90a runs the register-A
// ("RS") form instead: D = W·Xᵀ, each thread dequantizes its rows straight into wgmma's A
// fragments, only X goes through shared memory (in a k order permuted to match; see the use_rs
// block).
// Elsewhere warps run ldmatrix + mma.sync on tile kt, then produce kt + 1.
#pragma once
#include "memra/matvec.cuh"
#include "memra/mma.cuh"

namespace memra {

template <class Cfg> struct MatmulGeometry {
    using U = qunit::Unit<Cfg::QTYPE>;
    enum : int { WIDE_ROWS = Cfg::QTYPE == QType::F32 || Cfg::QTYPE == QType::F16 || Cfg::QTYPE == QType::BF16 };
    // F32 rows (4 bytes an element) do not fit 256 a tile twice: 128 whatever the tuning says.
    enum : int { BM = Cfg::BM, BN = Cfg::QTYPE == QType::F32 ? 128 : Cfg::BN, BK = 64 };
    enum : int { TPR = Cfg::THREADS / BN };                  // threads per W row (copy and dequant)
    // Elements per raw super-tile: whole blocks, as long as shared memory allows (the next one's
    // copy lands during the super-tile's k-tiles of MMA time).
    enum : int { KR = Cfg::QTYPE == QType::F32 ? 64 : WIDE_ROWS ? (BN == 128 ? 128 : 64) : (U::BLOCK == 256 || BN == 128) ? 256 : 128 };
    enum : int { SB = KR / U::BLOCK * U::BYTES };            // raw bytes of one row's super-tile
    // A baked K that is a whole number of super-tiles: no ragged last tile, its checks compiled out.
    enum : int { WHOLE_SUPER = Cfg::K != 0 && Cfg::K % KR == 0 };
    // A raw row: the super-tile's bytes from a 16-byte floor (+ up to 15), an odd number of 16-byte
    // chunks: the 32 rows a warp's lanes read then fall on 8 distinct 16-byte bank groups (an even
    // count gave 4 or fewer: 8-way conflicts on every 4-byte load of the dequantization).
    enum : int { RAW_ROW = ((SB + 31) / 16 | 1) * 16 };
    enum : int { RAW_BYTES = BN * RAW_ROW };
    // 32-element blocks at a baked K whose rows are whole 16-byte chunks: a k-tile (TB bytes of a
    // row) starts at the same offset in its chunk in every row, a multiple of 4, so a thread
    // reads its blocks as aligned 16-byte loads (conflict-free, rows an odd number of chunks
    // apart) and decodes them from registers, where 2- and 4-byte loads of the 32 rows a warp
    // reads fell on 8 bank groups (4-way conflicts).
    enum : int { TB = BK / U::BLOCK * U::BYTES };
    enum : int { REG_RAW = U::REG_BYTES && U::BLOCK == 32 && WHOLE_SUPER && Cfg::K / 32 * U::BYTES % 16 == 0 };
    static_assert(!REG_RAW || (TB % 4 == 0 && SB % 4 == 0), "word-aligned k-tiles");
    // bf16 tiles: rows of exactly 128 bytes (BK = 64) in the 128-byte-swizzle layout (16-byte
    // chunk c of row r at chunk c ^ (r mod 8)), 1024-byte aligned: what wgmma reads, and
    // conflict-free for ldmatrix and the producers' 16-byte stores (put_runs).
    enum : int { XT_BYTES = BM * 128, WT_BYTES = BN * 128, TILE_BYTES = XT_BYTES + WT_BYTES };  // a k-tile's pair
    enum : int { SMEM = 2 * RAW_BYTES + 2 * TILE_BYTES + 1024 };  // raw and bf16 tiles double-buffered
    enum : int { WARPS_M = 2, WARPS_N = 4, WM = BM / WARPS_M, WN = BN / WARPS_N };
    enum : int { MT = WM / 16, NT = WN / 8 };                // mma.sync tiles per warp
    enum : int { ACCS = BM * BN / 256 };                     // accumulators per thread (both forms)
    // sm_90a: W dequantized into the MMA's register A fragments for units of ≤ 32 elements (64-element
    // K-quant units would be loaded once per octet instead of once per 4) up to K = 2048; H200,
    // session 33: 1.04-1.8x faster than the shared-memory form at K ≤ 2048, 2-8 % slower at K ≥ 4096.
    enum : int { REG_A_UNITS = U::UE <= 32, REG_A_MAX_K = 2048 };

    // Byte offset of bf16 element (r, k) of a tile, k < BK; 8 elements from a multiple of 8 share
    // one 16-byte chunk.
    __host__ __device__ static constexpr int at(int r, int k) { return r * 128 + ((((k >> 3) ^ r) & 7) << 4) + (k & 7) * 2; }

    static_assert(Cfg::THREADS == 256, "matmul uses 8 warps");
    static_assert(BM == 64 || BM == 128, "BM must be 64 or 128");
    static_assert(BN == 128 || BN == 256, "BN must be 128 or 256");
    static_assert(KR % U::BLOCK == 0 && KR % BK == 0, "a super-tile holds whole blocks and k-tiles");
    static_assert(SMEM <= 232448, "shared memory past the 227 KiB a block can have");
    static_assert(Cfg::K == 0 || Cfg::K % U::BLOCK == 0, "K must be a multiple of the block size");
};

template <class Cfg>
__device__ __forceinline__ void matmul_impl(const unsigned char* __restrict__ w, const float* __restrict__ x,
                                            float* __restrict__ y, const int t_rows, const int k, const int n,
                                            const int ldx, const int ldy) {
    using G = MatmulGeometry<Cfg>;
    using U = qunit::Unit<Cfg::QTYPE>;
    constexpr int BM = G::BM, BN = G::BN, BK = G::BK, KR = G::KR, UE = U::UE, TPR = G::TPR;
    constexpr int OCTS = UE / 8;
    constexpr int TILES_PER_SUPER = KR / BK;
    const int K = dim_or<Cfg::K>(k), N = dim_or<Cfg::N>(n), T = t_rows;

    if (async::dynamic_smem_bytes() < (u32)G::SMEM) __trap();
    extern __shared__ __align__(16) u8 matmul_smem[];
    u8* raw_buf = matmul_smem;  // 2 × RAW_BYTES, super-tile s in slot s & 1
    // bf16 tiles for k-tile kt in buffer kt & 1: xs [BM] rows, then ws [BN] rows (G::at).
    u8* tiles = matmul_smem + 2 * G::RAW_BYTES;
    tiles += (1024u - (ptx::smem_addr(tiles) & 1023u)) & 1023u;  // the swizzle is on address bits 4..9
    auto xs_buf = [&](int b) { return tiles + b * G::TILE_BYTES; };
    auto ws_buf = [&](int b) { return tiles + b * G::TILE_BYTES + G::XT_BYTES; };

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int n0 = blockIdx.x * BN, t0 = blockIdx.y * BM;
    const i64 rb = (i64)(K / U::BLOCK) * U::BYTES;
    const i64 w_total = (i64)N * rb;
    const int n_super = (K + KR - 1) / KR;
    const int n_ktiles = (K + BK - 1) / BK;

    // Raw copy / dequant role: TPR threads per W row (2 or 1), each 64 / TPR elements of a k-tile.
    const int my_row = tid / TPR, half = tid % TPR;

    // Copy super-tile s of W row `row` (of the block's BN) into its raw slot: pieces part,
    // part + parts, … of the row (the threads that dequantize a row copy it).
    auto issue_raw_row = [&](int s, int row, int part, int parts) {
        const int nrow = n0 + row;
        if (nrow >= N) return;
        const i64 start = (i64)nrow * rb + (i64)s * G::SB;
        const int off = (int)(start & 15);
        const i64 left = rb - (i64)s * G::SB;
        const int len = G::WHOLE_SUPER || left >= G::SB ? G::SB : (int)left;
        const u8* src = w + (start - off);
        const i64 avail = w_total - (start - off);
        u8* dst = raw_buf + (s & 1) * G::RAW_BYTES + row * G::RAW_ROW;
        const int pieces = (off + len + 15) >> 4;
        if (avail >= 16 * pieces) {
            // Every piece inside the tensor (all but its last rows): unrolled plain copies.
#pragma unroll
            for (int i = part; i < G::RAW_ROW / 16; i += parts)
                if (i < pieces) async::cp16(dst + 16 * i, src + 16 * i, 16);
        } else {
            for (int i = part; i < pieces; i += parts) async::cp16_tail(dst + 16 * i, src + 16 * i, avail - 16 * i);
        }
    };
    // Row `row`'s raw bytes of super-tile s in shared memory (its first block).
    auto raw_row = [&](int s, int row) -> const u8* {
        return raw_buf + (s & 1) * G::RAW_BYTES + row * G::RAW_ROW + (int)(((i64)(n0 + row) * rb + (i64)s * G::SB) & 15);
    };
    // Octet o of a unit decoded into v (8 floats, the unit's elements xa(o)..+3, xb(o)..+3), the
    // scale groups applied.
    auto decode_oct = [&](const typename U::Raw& raw, int sub, int o, float (&v)[8]) {
        if constexpr (U::FOLDED) {
            U::oct_scaled(raw, sub, o, v);
        } else if constexpr (U::SCALED) {
            U::oct(raw, sub, o, v);
            const float sa = U::scale(raw, U::ga(o)), ma = U::minv(raw, U::ga(o));
            const float sb = U::scale(raw, U::gb(o)), mb = U::minv(raw, U::gb(o));
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                v[j] = fmaf(sa, v[j], ma);
                v[4 + j] = fmaf(sb, v[4 + j], mb);
            }
        } else {
            U::oct(raw, sub, o, v);
        }
    };

    // The 8 runs of 4 bf16 of a row's 4 octets into ws (run r < 4: octet r's xa run, r ≥ 4: octet
    // r - 4's xb run; col: each run's first column, constants after unrolling). Two runs that fill
    // one 16-byte chunk go out as one 16-byte store: a warp's 32 rows then write 8 distinct chunks
    // a quarter-warp (conflict-free), where 8-byte stores put rows r and r + 8 of a half-warp on
    // the same banks. Every unit type pairs all its runs.
    auto put_runs = [&](const uint2 (&run)[8], const int (&col)[8], u8* ws) {
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            int next = -1, prev = -1;
#pragma unroll
            for (int r2 = 0; r2 < 8; ++r2) {
                if (col[r] % 8 == 0 && col[r2] == col[r] + 4) next = r2;
                if (col[r] % 8 == 4 && col[r2] == col[r] - 4) prev = r2;
            }
            if (next >= 0) {
                *reinterpret_cast<uint4*>(ws + G::at(my_row, col[r])) = make_uint4(run[r].x, run[r].y, run[next].x, run[next].y);
            } else if (prev < 0) {
                *reinterpret_cast<uint2*>(ws + G::at(my_row, col[r])) = run[r];
            }
        }
    };
    auto pack_oct = [&](const float (&v)[8], int i, int u_tile, int o, uint2 (&run)[8], int (&col)[8]) {
        run[i] = make_uint2(ptx::pack_bf16x2(v[0], v[1]), ptx::pack_bf16x2(v[2], v[3]));
        run[4 + i] = make_uint2(ptx::pack_bf16x2(v[4], v[5]), ptx::pack_bf16x2(v[6], v[7]));
        col[i] = u_tile * UE + U::xa(o);
        col[4 + i] = u_tile * UE + U::xb(o);
    };

    // Dequantize k-tile `tt` of super-tile `s` (raw in slot s & 1) into ws: octets 4·H .. 4·H+3
    // of the row's 8 (ordered unit, octet). It is called with literal H values, so after inlining
    // every register index is a constant.
    // full: the whole k-tile lies below K (every tile but a ragged last one); called with a
    // literal, so that branch has no bounds checks left.
    auto dequant_half = [&](const int H, const bool full, int s, int tt, u8* ws) {
        const u8* rowp = raw_row(s, my_row);
        constexpr int OCTS_PER_LOAD = OCTS < 4 ? OCTS : 4;
        typename U::Raw raw;
        uint2 run[8];
        int col[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int q = 4 * H + i;
            const int u_tile = q / OCTS, o = q % OCTS;
            const int u = tt * (BK / UE) + u_tile;  // unit inside the super-tile
            const int bi = u / U::UPB, sub = u % U::UPB;
            const bool inside = full || s * KR + u * UE < K;
            if (i % OCTS_PER_LOAD == 0 && inside) U::load(rowp + bi * U::BYTES, sub, raw);
            float v[8];
            if (inside) {
                decode_oct(raw, sub, o, v);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) v[j] = 0.0f;
            }
            pack_oct(v, i, u_tile, o, run, col);
        }
        put_runs(run, col, ws);
    };
    // G::REG_RAW: block H of the k-tile (32-element blocks: octets 4·H .. 4·H+3 are block H) from
    // the 16-byte chunks at `chunk`, the k-tile's first byte at 4·PH in the first. PH (a literal)
    // fixes every offset, so the chunks are read as aligned 16-byte loads into registers.
    auto dequant_block_reg = [&](const int H, const int PH, const u8* chunk, u8* ws) {
        if constexpr (G::REG_RAW) {  // instantiated only where it runs
            // The block's first byte, and its chunks (to 2 bytes past it, which a 2-aligned tail
            // word reads).
            const int b0 = 4 * PH + H * U::BYTES;
            const int c0 = b0 / 16, n = (b0 + U::BYTES + 1) / 16 - c0 + 1;
            qunit::RegBytes<16> bytes;
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (c < n) {
                    const uint4 t = *reinterpret_cast<const uint4*>(chunk + 16 * (c0 + c));
                    bytes.w[4 * c] = t.x, bytes.w[4 * c + 1] = t.y, bytes.w[4 * c + 2] = t.z, bytes.w[4 * c + 3] = t.w;
                }
            typename U::Raw raw;
            U::load_from(bytes, b0 - 16 * c0, 0, raw);
            uint2 run[8];
            int col[8];
#pragma unroll
            for (int o = 0; o < 4; ++o) {
                float v[8];
                decode_oct(raw, 0, o, v);
                pack_oct(v, o, H, o, run, col);
            }
            put_runs(run, col, ws);
        }
    };
    auto dequant = [&](int s, int tt, u8* ws) {
        if constexpr (G::REG_RAW) {
            // The k-tile's first byte from the row's 16-byte-aligned slot start (rows whole chunks
            // long: the same for every row), and its word phase in its chunk.
            const int d = ((s * G::SB) & 15) + tt * G::TB;
            const u8* chunk = raw_buf + (s & 1) * G::RAW_BYTES + my_row * G::RAW_ROW + (d & ~15);
            auto blocks = [&](const int PH) {
                if (TPR == 1 || half == 0) dequant_block_reg(0, PH, chunk, ws);
                if (TPR == 1 || half == 1) dequant_block_reg(1, PH, chunk, ws);
            };
            switch ((d >> 2) & 3) {
                case 0: blocks(0); break;
                case 1: blocks(1); break;
                case 2: blocks(2); break;
                default: blocks(3); break;
            }
        } else {
            auto halves = [&](const bool full) {
                if (TPR == 1 || half == 0) dequant_half(0, full, s, tt, ws);
                if (TPR == 1 || half == 1) dequant_half(1, full, s, tt, ws);
            };
            if (G::WHOLE_SUPER || s * KR + (tt + 1) * BK <= K) {
                halves(true);
            } else {
                halves(false);
            }
        }
    };

    // X k-tile: BM rows × 64 floats; thread reads float4 (row tid/16 + 16j, col 4·(tid%16)).
    constexpr int XJ = BM * BK / 4 / Cfg::THREADS;
    float4 xr[XJ];
    const bool x_rows_full = t0 + BM <= T;
    // kk: the thread's first column; cols_inside: every column the block loads with it is < K.
    auto load_x_at = [&](int kk, bool cols_inside) {
        const float* xp = x + (i64)(t0 + tid / 16) * ldx + kk;
        if (x_rows_full && (G::WHOLE_SUPER || cols_inside)) {
#pragma unroll
            for (int j = 0; j < XJ; ++j) xr[j] = load_f4(xp + (i64)16 * j * ldx);
        } else {
#pragma unroll
            for (int j = 0; j < XJ; ++j) {
                const int t = t0 + tid / 16 + 16 * j;
                xr[j] = (t < T && kk < K) ? load_f4(xp + (i64)16 * j * ldx) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        }
    };
    auto load_x = [&](int kt) { load_x_at(kt * BK + 4 * (tid % 16), (kt + 1) * BK <= K); };
    auto store_x = [&](u8* xs) {
#pragma unroll
        for (int j = 0; j < XJ; ++j) {
            const int r = tid / 16 + 16 * j;
            *reinterpret_cast<uint2*>(xs + G::at(r, 4 * (tid % 16))) =
                make_uint2(ptx::pack_bf16x2(xr[j].x, xr[j].y), ptx::pack_bf16x2(xr[j].z, xr[j].w));
        }
    };

    // mma.sync form: acc[4·(i·NT + j) + e] is fragment e of m-tile i, n-tile j. Warpgroup form:
    // acc[4j + e] is row 16·(warp % 4) + lane / 4 + 8·(e / 2), column 8j + 2·(lane % 4) + e % 2 of the
    // warpgroup's 64 × (256, 128 or 64) tile.
    float acc[G::ACCS];
#pragma unroll
    for (int i = 0; i < G::ACCS; ++i) acc[i] = 0.0f;

    // Produce k-tile kp (dequantized W, rounded X) into buffer kp & 1. The raw rows the TPR threads
    // of a row dequantize are the rows they copied, so a super-tile only needs their own cp.async
    // wait plus __syncwarp, and the next super-tile's copy starts right after it.
    auto produce = [&](int kp) {
        const int sp = kp / TILES_PER_SUPER, tt = kp % TILES_PER_SUPER;
        if (tt == 0) {
            async::wait<0>();
            __syncwarp();  // the row partner's pieces of super-tile sp are visible; slot (sp+1)&1 is free
            if (sp + 1 < n_super) issue_raw_row(sp + 1, my_row, half, TPR);
            async::commit();
        }
        dequant(sp, tt, ws_buf(kp & 1));
        store_x(xs_buf(kp & 1));
        if (kp + 1 < n_ktiles) load_x(kp + 1);  // in flight during the next mma tile
    };

    auto store = [&](int t, int nn, float v) {
        if (t < T && nn < N) {
            float* dst = y + (i64)t * ldy + nn;
            if constexpr (Cfg::ACCUMULATE != 0) {
                *dst += v;
            } else {
                *dst = v;
            }
        }
    };

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    // Two forms: register-A (RS) for 8- and 32-element units at K ≤ REG_A_MAX_K and for float
    // weights (measured faster there), shared-memory operands (SS) otherwise; a constant where K is
    // baked, a run-time choice in generic variants.
    const bool use_rs = G::REG_A_UNITS && (G::WIDE_ROWS || (Cfg::K != 0 ? Cfg::K : K) <= G::REG_A_MAX_K);
    if (use_rs) {
        if constexpr (G::REG_A_UNITS) {  // instantiated only where it runs
            // Register-A warpgroup MMAs: D = W·Xᵀ (M = W rows, N = tokens). Warpgroup g owns W rows
            // [g·BN/2, (g+1)·BN/2) — MB m64 blocks — times all BM tokens; each thread dequantizes straight
            // into its A fragments (rows 16·(warp % 4) + lane / 4 (+8) of each m64 block), so W never goes
            // through shared memory as bf16. The 4 lanes of a row's quad split each k-tile; the MMA's k
            // order is a permutation of W's, and X's bf16 tile is stored in the same order.
            // The permutation: K runs in periods of PT k-tiles (PER = 64·PT elements; 4 units for 32- and
            // 64-element units, 8 for 8-element ones). In k-tile τ of a period, lane c = lane % 4 takes
            // octets 2(PT·c + τ) + P, P = 0, 1 (octets ordered (unit, octet)): so for 32/64-element units
            // the lane reads its own unit c and the octet index 2τ + P is a compile-time constant (no
            // indexed registers). Octet P feeds k-steps 2P (its xa run) and 2P + 1 (its xb run): the run's
            // 4 elements go to logical columns 16s + 2c (+1) and 16s + 2c + 8 (+9) of step s.
            // Pipeline per k-tile kt, MMAs asynchronous: [MMA pair 0 (steps 0-1)] → dequant pair 1 →
            // [MMA pair 1] → store X of kt + 1, dequant pair 0 of kt + 1 → barrier. Two A register sets;
            // three X tiles (a warpgroup may still read tile kt - 1 while the other stores kt + 1).
            constexpr int MB = BN / 128;
            constexpr int PT = UE >= 32 ? UE / 16 : 1, PER = 64 * PT;
            constexpr int UPP = PER / UE;  // units per period: 4 or 8
            static_assert(KR % PER == 0, "a raw super-tile holds whole periods");
            const int n_rs_tiles = (K + PER - 1) / PER * PT;
            const int wgi = warp >> 2, w4 = warp & 3, quad = lane >> 2, c = lane & 3;
            auto row_of = [&](int i, int h) { return wgi * (BN / 2) + 64 * i + 16 * w4 + quad + 8 * h; };
            auto x_tile = [&](int kt) { return tiles + (kt % 3) * G::XT_BYTES; };
            // Where K is baked, raw_row in 32-bit arithmetic (only the start's offset mod 16 matters;
            // wrapping keeps it): the 64-bit form left those variants a register short (a spill), while
            // the generic Q6_K one spills with the 32-bit form. ptxas's choices, measured by NVRTC.
            auto raw_row_rs = [&](int s, int row) -> const u8* {
                if constexpr (Cfg::K != 0) {
                    return raw_buf + (s & 1) * G::RAW_BYTES + row * G::RAW_ROW +
                           (int)(((u32)(n0 + row) * (u32)rb + (u32)s * (u32)G::SB) & 15u);
                } else {
                    return raw_row(s, row);
                }
            };
            // Octet 2(PT·cc + τ) + P of a period, the one lane cc takes: its unit in the period. The A
            // side (lane c) and the X side (the lane a run feeds) both place octets with it.
            auto period_unit = [&](int cc, int tau, int P) { return cc * (2 * PT / OCTS) + (2 * tau + P) / OCTS; };
            auto oct_unit = [&](int tau, int P) { return period_unit(c, tau, P); };
            // X: thread run ρ = tid % 16 = 4c' + 2P + half of each of its rows (c' the lane it feeds).
            const int x_rho = tid % 16, x_c = x_rho >> 2, x_p = (x_rho >> 1) & 1, x_half = x_rho & 1;
            const int x_col = 2 * (8 * (2 * x_p + x_half) + x_c);  // logical column of its first pair
            auto x_phys = [&](int kt) {  // physical element (from k-tile kt's period start) of its run
                const int tau = kt % PT, o = (2 * tau + x_p) % OCTS;
                return (kt - tau) * BK + period_unit(x_c, tau, x_p) * UE + (x_half ? U::xb(o) : U::xa(o));
            };
            auto issue_raw_rs = [&](int s) {
#pragma unroll
                for (int i = 0; i < MB; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) issue_raw_row(s, row_of(i, h), c, 4);
            };
            auto store_x_rs = [&](u8* xs) {
#pragma unroll
                for (int j = 0; j < XJ; ++j) {
                    const int r = tid / 16 + 16 * j;
                    *reinterpret_cast<u32*>(xs + G::at(r, x_col)) = ptx::pack_bf16x2(xr[j].x, xr[j].y);
                    *reinterpret_cast<u32*>(xs + G::at(r, x_col + 8)) = ptx::pack_bf16x2(xr[j].z, xr[j].w);
                }
            };
            // A fragments of pair P of k-tile kt (τ = kt % PT, a constant): a[i][st] for m64 block i,
            // step 2P + st.
            auto dequant_pair = [&](const int tau, const int P, int kt, u32 (&a)[MB][2][4]) {
                const int s = kt / TILES_PER_SUPER;
                const int u = (kt % TILES_PER_SUPER - tau) / PT * UPP + oct_unit(tau, P);  // unit in the super-tile
                const int o = (2 * tau + P) % OCTS, bi = u / U::UPB, sub = u % U::UPB;
                const bool inside = G::WHOLE_SUPER || s * KR + u * UE < K;
#pragma unroll
                for (int i = 0; i < MB; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float v[8];
                        if (inside) {
                            typename U::Raw raw;
                            U::load(raw_row_rs(s, row_of(i, h)) + bi * U::BYTES, sub, raw);
                            decode_oct(raw, sub, o, v);
                        } else {
#pragma unroll
                            for (int j = 0; j < 8; ++j) v[j] = 0.0f;
                        }
                        a[i][0][h] = ptx::pack_bf16x2(v[0], v[1]);
                        a[i][0][2 + h] = ptx::pack_bf16x2(v[2], v[3]);
                        a[i][1][h] = ptx::pack_bf16x2(v[4], v[5]);
                        a[i][1][2 + h] = ptx::pack_bf16x2(v[6], v[7]);
                    }
            };
            auto mma_pair = [&](const int P, const u32 (&a)[MB][2][4], int kt) {
                const u64 b0 = wg::desc_sw128(ptx::smem_addr(x_tile(kt)), 16, 1024);
                wg::fence();
#pragma unroll
                for (int st = 0; st < 2; ++st) {
                    const u64 b = wg::desc_plus(b0, 32 * (2 * P + st));
#pragma unroll
                    for (int i = 0; i < MB; ++i) {
                        if constexpr (BM == 128) {
                            wg::mma_rs_m64n128k16(*reinterpret_cast<float(*)[64]>(acc + 64 * i), a[i][st], b, 1);
                        } else {
                            wg::mma_rs_m64n64k16(*reinterpret_cast<float(*)[32]>(acc + 32 * i), a[i][st], b, 1);
                        }
                    }
                }
                wg::commit();
            };
            // X of k-tile kt: the thread's run of each row, zero past K.
            auto load_x_rs = [&](int kt) { load_x_at(x_phys(kt), (kt - kt % PT + PT) * BK <= K); };

            u32 a0[MB][2][4], a1[MB][2][4];
            issue_raw_rs(0);
            async::commit();
            load_x_rs(0);
            async::wait<0>();
            __syncwarp();  // the quad's pieces of super-tile 0 are visible
            if (1 < n_super) issue_raw_rs(1);
            async::commit();
            store_x_rs(x_tile(0));
            if (1 < n_rs_tiles) load_x_rs(1);
            dequant_pair(0, 0, 0, a0);
            wg::fence_proxy_async();  // this thread's X tile writes, seen by the MMAs
            __syncthreads();
#pragma unroll 1
            for (int kb = 0; kb < n_rs_tiles; kb += PT) {
#pragma unroll
                for (int tau = 0; tau < PT; ++tau) {
                    const int kt = kb + tau;
                    mma_pair(0, a0, kt);
                    wg::wait<1>();  // tile kt - 1's pair 1 done: a1 is free
                    dequant_pair(tau, 1, kt, a1);
                    mma_pair(1, a1, kt);
                    if (kt + 1 < n_rs_tiles) {
                        const int sp = (kt + 1) / TILES_PER_SUPER;
                        if ((kt + 1) % TILES_PER_SUPER == 0) {
                            async::wait<0>();
                            __syncwarp();  // super-tile sp landed (the quad's copies); slot (sp + 1) & 1 read out
                            if (sp + 1 < n_super) issue_raw_rs(sp + 1);
                            async::commit();
                        }
                        store_x_rs(x_tile(kt + 1));  // last read by tile kt - 2, finished before the last barrier
                        if (kt + 2 < n_rs_tiles) load_x_rs(kt + 2);
                        wg::wait<1>();  // pair 0 of tile kt done: a0 is free
                        dequant_pair((tau + 1) % PT, 0, kt + 1, a0);
                    }
                    wg::fence_proxy_async();
                    __syncthreads();  // X tile kt + 1 complete
                }
            }
            wg::wait<0>();
            wg::fence_operand(acc);

            // acc[BM/2 · i + 4j + e]: W row 64i + 16·(warp % 4) + lane / 4 + 8·(e / 2) of the warpgroup's
            // rows, token 8j + 2·(lane % 4) + e % 2.
#pragma unroll
            for (int i = 0; i < MB; ++i) {
                const int nn = n0 + row_of(i, 0);
#pragma unroll
                for (int j = 0; j < BM / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) store(t0 + 8 * j + 2 * c + (e % 2), nn + 8 * (e / 2), acc[BM / 2 * i + 4 * j + e]);
            }
        }
    } else {
        if constexpr (!G::WIDE_ROWS) {  // instantiated only where it runs
            issue_raw_row(0, my_row, half, TPR);
            async::commit();
            load_x(0);
            produce(0);
            // Warpgroup g multiplies tokens [64g, 64g + 64) by all BN W rows (BM = 128), or all 64
            // tokens by W rows [g·BN/2, (g+1)·BN/2) (BM = 64). The MMAs of k-tile kt run asynchronously
            // while the same threads produce kt + 1; one barrier per k-tile.
            constexpr int WGN = G::ACCS * 2;  // columns per warpgroup: 256, 128 or 64
            const int wgi = warp >> 2;
            const int wg_m = BM == 128 ? 64 * wgi : 0, wg_n = BM == 128 ? 0 : WGN * wgi;
            const u32 tiles_s = ptx::smem_addr(tiles);
            wg::fence_proxy_async();  // this thread's tile writes, seen by the MMAs
            __syncthreads();
#pragma unroll 1
            for (int kt = 0; kt < n_ktiles; ++kt) {
                const u32 buf = tiles_s + (kt & 1) * G::TILE_BYTES;  // xs_buf(kt & 1), as a shared address
                const u32 xs = buf + wg_m * 128, ws = buf + G::XT_BYTES + wg_n * 128;
                const u64 a0 = wg::desc_sw128(xs, 16, 1024), b0 = wg::desc_sw128(ws, 16, 1024);
                wg::fence();
#pragma unroll
                for (int ks = 0; ks < BK / 16; ++ks) {
                    const u64 a = wg::desc_plus(a0, 32 * ks), b = wg::desc_plus(b0, 32 * ks);
                    if constexpr (WGN == 256) {
                        wg::mma_m64n256k16<0>(acc, a, b, 1);
                    } else if constexpr (WGN == 128) {
                        wg::mma_m64n128k16<0>(acc, a, b, 1);
                    } else {
                        wg::mma_m64n64k16<0>(acc, a, b, 1);
                    }
                }
                wg::commit();
                if (kt + 1 < n_ktiles) produce(kt + 1);
                wg::wait<0>();
                wg::fence_operand(acc);
                wg::fence_proxy_async();
                __syncthreads();  // tile kt + 1 complete; both warpgroups done reading buffer kt & 1
            }

            const int row0 = t0 + wg_m + 16 * (warp & 3) + lane / 4, col0 = n0 + wg_n + 2 * (lane % 4);
#pragma unroll
            for (int j = 0; j < WGN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) store(row0 + 8 * (e / 2), col0 + 8 * j + (e % 2), acc[4 * j + e]);
        }
    }
#else
    const int wm = warp / G::WARPS_N, wn = warp % G::WARPS_N;
    // ldmatrix source rows/cols for this lane (see the fragment layouts of mma.m16n8k16).
    const int a_row = wm * G::WM + (lane % 16), a_col = (lane / 16) * 8;
    const int b_row = wn * G::WN + (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;

    auto mma_tile = [&](const u8* xs, const u8* ws) {
#pragma unroll
        for (int kq = 0; kq < BK; kq += 16) {
            u32 a[G::MT][4];
#pragma unroll
            for (int i = 0; i < G::MT; ++i) ptx::ldmatrix_x4(a[i], xs + G::at(a_row + 16 * i, kq + a_col));
#pragma unroll
            for (int jj = 0; jj < G::NT / 2; ++jj) {
                u32 b[4];
                ptx::ldmatrix_x4(b, ws + G::at(b_row + 16 * jj, kq + b_col));
#pragma unroll
                for (int i = 0; i < G::MT; ++i) {
                    ptx::bf16_16816(*reinterpret_cast<float(*)[4]>(acc + 4 * (i * G::NT + 2 * jj)), a[i], b[0], b[1]);
                    ptx::bf16_16816(*reinterpret_cast<float(*)[4]>(acc + 4 * (i * G::NT + 2 * jj + 1)), a[i], b[2], b[3]);
                }
            }
        }
    };

    issue_raw_row(0, my_row, half, TPR);
    async::commit();
    load_x(0);
    produce(0);
    __syncthreads();
    // One barrier per k-tile: consume buffer kt & 1 while producing kt + 1 into the other.
#pragma unroll 1
    for (int kt = 0; kt < n_ktiles; ++kt) {
        mma_tile(xs_buf(kt & 1), ws_buf(kt & 1));
        if (kt + 1 < n_ktiles) produce(kt + 1);
        __syncthreads();
    }

    // acc[4·(i·NT + j) + e]: rows (lane/4, +8) of m-tile i, cols 2·(lane%4) + {0,1} of n-tile j.
#pragma unroll
    for (int i = 0; i < G::MT; ++i)
#pragma unroll
        for (int j = 0; j < G::NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                store(t0 + wm * G::WM + 16 * i + lane / 4 + (e / 2) * 8, n0 + wn * G::WN + 8 * j + 2 * (lane % 4) + (e % 2),
                      acc[4 * (i * G::NT + j) + e]);
#endif
}

// The kernel body: one product, or expert blockIdx.z's rows of a grouped launch.
template <class Cfg>
__device__ __forceinline__ void matmul_entry(const unsigned char* __restrict__ w, const float* __restrict__ x,
                                             float* __restrict__ y, int t, const int k, const int n, const int ldx,
                                             const int ldy, const int* __restrict__ offsets, const i64 expert_bytes,
                                             const i64 x_batch, const i64 y_batch) {
    if (expert_bytes > 0) {
        const int z = blockIdx.z;
        w += (i64)z * expert_bytes;
        if (x_batch > 0) {
            x += (i64)z * x_batch;
            y += (i64)z * y_batch;
        } else {
            const int r0 = offsets[z];
            t = offsets[z + 1] - r0;
            if ((int)blockIdx.y * MatmulGeometry<Cfg>::BM >= t) return;  // the whole block: no barrier skipped
            x += (i64)r0 * ldx;
            y += (i64)r0 * ldy;
        }
    }
    matmul_impl<Cfg>(w, x, y, t, k, n, ldx, ldy);
}

}  // namespace memra

#define MEMRA_DEFINE_MATMUL(SYMBOL, CFG)                                                                        \
    extern "C" __global__ void __launch_bounds__(CFG::THREADS, 1)                                               \
        SYMBOL(const unsigned char* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int t, \
               int k, int n, int ldx, int ldy, const int* __restrict__ offsets, long long expert_bytes,       \
               long long x_batch, long long y_batch) {                                                          \
        memra::pdl_entry();                                                                                     \
        memra::matmul_entry<CFG>(w, x, y, t, k, n, ldx, ldy, offsets, expert_bytes, x_batch, y_batch);         \
    }
