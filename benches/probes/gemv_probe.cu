// gemv_probe.cu — how close can a batch-1 matrix-vector product get to the copy bandwidth on
// this GPU? A standalone probe (nvcc on the GPU machine), not part of the engine:
//
//   nvcc -O3 -arch=sm_90a -std=c++17 -o gemv_probe benches/probes/gemv_probe.cu && ./gemv_probe
//
// Prints, in one process: the 1 GiB float4 copy bandwidth (bytes read + written); a read-only
// pass (float4 sum) over 50 / 100 / 200 / 1024 MB; and weight-streaming matvecs that load the
// weights straight into registers (no shared-memory staging) for BF16 and Q8_0 at GLM-5 /
// Qwen3-8B shapes, each checked against a naive kernel. Each figure per launch (an L2-evicting
// read pass before it, outside the events; median of 30) and back to back (8 launches on 8
// weight copies between two events, per launch).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define CK(x)                                                                                    \
    do {                                                                                         \
        cudaError_t e_ = (x);                                                                    \
        if (e_ != cudaSuccess) {                                                                 \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)

typedef unsigned int u32;

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

__global__ void copy_f4(const float4* __restrict__ a, float4* __restrict__ b, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) b[i] = a[i];
}

// Read-only pass: every uint4 once, 4 in flight per thread; one float per block out.
template <int U>
__global__ void read_sum(const uint4* __restrict__ a, size_t n, float* out) {
    u32 acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (; i + (U - 1) * stride < n; i += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = ld_stream(a + i + u * stride);
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += stride) {
        uint4 v = ld_stream(a + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[blockIdx.x] = 1.0f;  // keeps the loads alive
}

// BF16 W [N][K], a warp per R rows, each lane U·R uint4 (8 weights each) in flight.
template <int K, int R, int U>
__global__ void gemv_bf16(const uint4* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int n) {
    constexpr int V = K / 8;  // uint4 per row
    static_assert(V % (32 * U) == 0, "K must be a multiple of 256·U");
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    const int row0 = warp * R;
    if (row0 >= n) return;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    const float4* x4 = reinterpret_cast<const float4*>(x);
#pragma unroll 1
    for (int it = 0; it < V; it += 32 * U) {
        uint4 q[U][R];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r) q[u][r] = ld_stream(w + (size_t)min(row0 + r, n - 1) * V + it + u * 32 + lane);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = it + u * 32 + lane;
            const float4 xa = __ldg(x4 + 2 * c), xb = __ldg(x4 + 2 * c + 1);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const uint4 t = q[u][r];
                float s = acc[r];
                s = fmaf(__uint_as_float(t.x << 16), xa.x, s);
                s = fmaf(__uint_as_float(t.x & 0xFFFF0000u), xa.y, s);
                s = fmaf(__uint_as_float(t.y << 16), xa.z, s);
                s = fmaf(__uint_as_float(t.y & 0xFFFF0000u), xa.w, s);
                s = fmaf(__uint_as_float(t.z << 16), xb.x, s);
                s = fmaf(__uint_as_float(t.z & 0xFFFF0000u), xb.y, s);
                s = fmaf(__uint_as_float(t.w << 16), xb.z, s);
                s = fmaf(__uint_as_float(t.w & 0xFFFF0000u), xb.w, s);
                acc[r] = s;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        float s = acc[r];
#pragma unroll
        for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0 && row0 + r < n) y[row0 + r] = s;
    }
}

// Q8_0 W: rows of K/32 blocks of 34 bytes (f16 d, 32 × i8). Eight blocks = 272 bytes = 17
// uint4, 16-byte aligned when K % 256 == 0: a lane loads one such group (17 uint4, consecutive)
// and decodes it from registers. A warp owns R rows and deals their R·G groups round robin
// (R·G a multiple of 32 keeps every lane busy); quant bytes become floats by PRMT + FADD.
__device__ __forceinline__ float sbyte(u32 w, int j) {
    return __uint_as_float(__byte_perm(w ^ 0x80808080u, 0x4B000000u, 0x7440u | (u32)j)) - 8388736.0f;
}

template <int K, int R>
__global__ void gemv_q8_0(const uint4* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int n) {
    constexpr int G = K / 256;   // groups per row
    constexpr int VR = G * 17;   // uint4 per row
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    const int row0 = warp * R;
    if (row0 >= n) return;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    const float4* x4 = reinterpret_cast<const float4*>(x);
#pragma unroll 1
    for (int f = lane; f < R * G; f += 32) {
        const int rr = f / G, g = f - rr * G;
        uint4 q[17];
        const uint4* p = w + (size_t)min(row0 + rr, n - 1) * VR + g * 17;
#pragma unroll
        for (int i = 0; i < 17; ++i) q[i] = __ldg(p + i);
        const u32* wd = reinterpret_cast<const u32*>(q);
        float part = 0.f;
#pragma unroll
        for (int b = 0; b < 8; ++b) {
            const int off = 34 * b;  // byte offset of block b in the group
            float d;
            u32 qs[8];
            if ((off & 3) == 0) {
                d = __half2float(__ushort_as_half((unsigned short)(wd[off / 4] & 0xFFFFu)));
#pragma unroll
                for (int j = 0; j < 8; ++j) qs[j] = __funnelshift_r(wd[off / 4 + j], wd[off / 4 + j + 1], 16);
            } else {
                d = __half2float(__ushort_as_half((unsigned short)(wd[off / 4] >> 16)));
#pragma unroll
                for (int j = 0; j < 8; ++j) qs[j] = wd[off / 4 + 1 + j];
            }
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float4 xx = __ldg(x4 + (g * 256 + b * 32) / 4 + j);
                s = fmaf(sbyte(qs[j], 0), xx.x, s);
                s = fmaf(sbyte(qs[j], 1), xx.y, s);
                s = fmaf(sbyte(qs[j], 2), xx.z, s);
                s = fmaf(sbyte(qs[j], 3), xx.w, s);
            }
            part = fmaf(d, s, part);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] += rr == r ? part : 0.f;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        float s = acc[r];
#pragma unroll
        for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0 && row0 + r < n) y[row0 + r] = s;
    }
}

constexpr int gcd_c(int a, int b) { return b ? gcd_c(b, a % b) : a; }
// Rows per warp that keep all 32 lanes busy at this K.
template <int K> constexpr int q8_rows() { return 32 / gcd_c(K / 256, 32); }

// Naive references: one thread per row.
__global__ void ref_bf16(const unsigned short* w, const float* x, float* y, int k, int n) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n) return;
    double s = 0;
    for (int i = 0; i < k; ++i) s += (double)__uint_as_float((u32)w[(size_t)r * k + i] << 16) * x[i];
    y[r] = (float)s;
}
__global__ void ref_q8_0(const unsigned char* w, const float* x, float* y, int k, int n) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n) return;
    double s = 0;
    const unsigned char* row = w + (size_t)r * (k / 32) * 34;
    for (int b = 0; b < k / 32; ++b) {
        const unsigned char* blk = row + 34 * b;
        float d = __half2float(__ushort_as_half((unsigned short)(blk[0] | (blk[1] << 8))));
        for (int i = 0; i < 32; ++i) s += (double)d * (signed char)blk[2 + i] * x[32 * b + i];
    }
    y[r] = (float)s;
}

__global__ void fill_bytes(unsigned char* p, size_t n, u32 seed, int q8) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        u32 h = (u32)i * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        unsigned char b = (unsigned char)h;
        if (q8) {
            size_t o = i % 34;  // keep d a small normal f16: 0x2Axx ≈ 0.03..0.06
            if (o == 1) b = 0x2A;
        } else if (i & 1) {
            b = (unsigned char)(0x3C + (h >> 8) % 3) ^ ((h >> 16) & 0x80);  // bf16 high byte: |v| ≈ 0.01..0.1
        }
        p[i] = b;
    }
}

struct Timer {
    cudaEvent_t a, b;
    Timer() { CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b)); }
};

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

static uint4* g_flush;
static size_t g_flush_n;
static float* g_dummy;
static void flush() { read_sum<4><<<132 * 8, 256>>>(g_flush, g_flush_n, g_dummy); }

// (per-launch median µs, back-to-back µs per launch); launch(c) runs on weight copy c.
static std::pair<double, double> timeit(const std::function<void(int)>& launch, int copies) {
    Timer t;
    for (int i = 0; i < 3; ++i) launch(i % copies);
    std::vector<double> per, b2b;
    for (int i = 0; i < 30; ++i) {
        flush();
        CK(cudaEventRecord(t.a));
        launch(i % copies);
        CK(cudaEventRecord(t.b));
        CK(cudaEventSynchronize(t.b));
        float ms;
        CK(cudaEventElapsedTime(&ms, t.a, t.b));
        per.push_back(ms * 1e3);
    }
    for (int i = 0; i < 15; ++i) {
        flush();
        CK(cudaEventRecord(t.a));
        for (int c = 0; c < 8; ++c) launch(c % copies);
        CK(cudaEventRecord(t.b));
        CK(cudaEventSynchronize(t.b));
        float ms;
        CK(cudaEventElapsedTime(&ms, t.a, t.b));
        b2b.push_back(ms * 1e3 / 8);
    }
    CK(cudaGetLastError());
    return {median(per), median(b2b)};
}

static double g_copy;  // GB/s

static void report(const char* what, double bytes, std::pair<double, double> t) {
    double gp = bytes / t.first / 1e3, gb = bytes / t.second / 1e3;
    printf("%-44s %8.1f MB  per launch %8.2f us %6.0f GB/s %5.1f %%   back to back %8.2f us %6.0f GB/s %5.1f %%\n", what,
           bytes / 1e6, t.first, gp, 100 * gp / g_copy, t.second, gb, 100 * gb / g_copy);
    fflush(stdout);
}

template <typename F>
static void check(const char* what, const float* dy, const float* dref, int n, F) {
    std::vector<float> a(n), b(n);
    CK(cudaMemcpy(a.data(), dy, n * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data(), dref, n * 4, cudaMemcpyDeviceToHost));
    double worst = 0, scale = 0;
    for (int i = 0; i < n; ++i) scale = std::max(scale, (double)std::fabs(b[i]));
    for (int i = 0; i < n; ++i) worst = std::max(worst, (double)std::fabs(a[i] - b[i]) / (scale + 1e-30));
    if (!(worst < 1e-4)) {
        printf("CHECK FAILED %s: max |diff| / max |ref| = %g\n", what, worst);
        exit(3);
    }
}

template <int K, int R, int U>
static void bf16_case(unsigned char* const* w, const float* x, float* y, const float* ref, int n, int copies, int threads) {
    const int warps = (n + R - 1) / R, blocks = (warps * 32 + threads - 1) / threads;
    auto launch = [&](int c) { gemv_bf16<K, R, U><<<blocks, threads>>>((const uint4*)w[c], x, y, n); };
    CK(cudaMemset(y, 0xFF, n * 4));
    launch(0);
    CK(cudaDeviceSynchronize());
    char name[128];
    snprintf(name, sizeof name, "bf16 %5dx%-6d R%d U%d T%d", K, n, R, U, threads);
    check(name, y, ref, n, 0);
    report(name, (double)K * n * 2 + 4.0 * K + 4.0 * n, timeit(launch, copies));
}

template <int K, int R>
static void q8_case(unsigned char* const* w, const float* x, float* y, const float* ref, int n, int copies, int threads) {
    const int warps = (n + R - 1) / R, blocks = (warps * 32 + threads - 1) / threads;
    auto launch = [&](int c) { gemv_q8_0<K, R><<<blocks, threads>>>((const uint4*)w[c], x, y, n); };
    CK(cudaMemset(y, 0xFF, n * 4));
    launch(0);
    CK(cudaDeviceSynchronize());
    char name[128];
    snprintf(name, sizeof name, "q8_0 %5dx%-6d R%d T%d", K, n, R, threads);
    check(name, y, ref, n, 0);
    report(name, (double)K / 32 * 34 * n + 4.0 * K + 4.0 * n, timeit(launch, copies));
}

// One shape: 8 weight copies (fewer when large), x, the reference, then the variants.
template <int K>
static void shape(int n) {
    const size_t bf = (size_t)K * n * 2, q8 = (size_t)K / 32 * 34 * n;
    const int copies = bf > 400e6 ? 2 : 8;
    unsigned char *wb[8], *wq[8];
    for (int c = 0; c < copies; ++c) {
        CK(cudaMalloc(&wb[c], bf));
        CK(cudaMalloc(&wq[c], q8));
        fill_bytes<<<1024, 256>>>(wb[c], bf, 17, 0);
        fill_bytes<<<1024, 256>>>(wq[c], q8, 29, 1);
    }
    for (int c = copies; c < 8; ++c) wb[c] = wb[c % copies], wq[c] = wq[c % copies];
    float *x, *y, *rb, *rq;
    CK(cudaMalloc(&x, K * 4));
    CK(cudaMalloc(&y, n * 4));
    CK(cudaMalloc(&rb, n * 4));
    CK(cudaMalloc(&rq, n * 4));
    std::vector<float> hx(K);
    for (int i = 0; i < K; ++i) hx[i] = std::sin(0.37f * i) + 0.25f;
    CK(cudaMemcpy(x, hx.data(), K * 4, cudaMemcpyHostToDevice));
    ref_bf16<<<(n + 127) / 128, 128>>>((const unsigned short*)wb[0], x, rb, K, n);
    ref_q8_0<<<(n + 127) / 128, 128>>>(wq[0], x, rq, K, n);
    CK(cudaDeviceSynchronize());
    bf16_case<K, 1, 4>(wb, x, y, rb, n, copies, 256);
    bf16_case<K, 2, 4>(wb, x, y, rb, n, copies, 256);
    bf16_case<K, 1, 8>(wb, x, y, rb, n, copies, 256);
    bf16_case<K, 2, 2>(wb, x, y, rb, n, copies, 256);
    bf16_case<K, 4, 2>(wb, x, y, rb, n, copies, 128);
    bf16_case<K, 1, 4>(wb, x, y, rb, n, copies, 128);
    q8_case<K, q8_rows<K>()>(wq, x, y, rq, n, copies, 256);
    q8_case<K, 2 * q8_rows<K>()>(wq, x, y, rq, n, copies, 256);
    q8_case<K, q8_rows<K>()>(wq, x, y, rq, n, copies, 128);
    for (int c = 0; c < copies; ++c) {
        CK(cudaFree(wb[c]));
        CK(cudaFree(wq[c]));
    }
    CK(cudaFree(x));
    CK(cudaFree(y));
    CK(cudaFree(rb));
    CK(cudaFree(rq));
}

int main() {
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    printf("gemv_probe: %s, %d SMs, L2 %d MB\n", p.name, p.multiProcessorCount, p.l2CacheSize >> 20);
    g_flush_n = (size_t)2 * p.l2CacheSize / 16;
    CK(cudaMalloc(&g_flush, g_flush_n * 16));
    CK(cudaMemset(g_flush, 1, g_flush_n * 16));
    CK(cudaMalloc(&g_dummy, 1 << 20));
    {
        const size_t bytes = 1ull << 30;
        float4 *a, *b;
        CK(cudaMalloc(&a, bytes));
        CK(cudaMalloc(&b, bytes));
        CK(cudaMemset(a, 0, bytes));
        auto t = timeit([&](int) { copy_f4<<<132 * 16, 256>>>(a, b, bytes / 16); }, 1);
        g_copy = 2.0 * bytes / t.first / 1e3;
        printf("copy 1 GiB float4 (read + write): per launch %.1f us = %.0f GB/s (the 100 %% below); back to back %.0f GB/s\n",
               t.first, g_copy, 2.0 * bytes / t.second / 1e3);
        CK(cudaFree(a));
        CK(cudaFree(b));
    }
    for (double mb : {50.0, 100.0, 200.0, 1024.0}) {
        const size_t bytes = (size_t)(mb * 1e6) / 16 * 16;
        const int copies = mb > 400 ? 2 : 8;
        uint4* a[8];
        for (int c = 0; c < copies; ++c) {
            CK(cudaMalloc(&a[c], bytes));
            CK(cudaMemset(a[c], 3, bytes));
        }
        for (int grid_mult : {4, 8, 32}) {
            auto t = timeit([&](int c) { read_sum<4><<<132 * grid_mult, 256>>>(a[c % copies], bytes / 16, g_dummy); }, copies);
            char name[96];
            snprintf(name, sizeof name, "read-only %6.0f MB, %d blocks/SM", mb, grid_mult);
            report(name, (double)bytes, t);
        }
        for (int c = 0; c < copies; ++c) CK(cudaFree(a[c]));
    }
    shape<16384>(6144);
    shape<6144>(12288);
    shape<12288>(6144);
    shape<6144>(24576);
    shape<4096>(12288);
    shape<12288>(4096);
    shape<6144>(6144);
    shape<4096>(151936);
    printf("done\n");
    return 0;
}
