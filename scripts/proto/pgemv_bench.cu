// pgemv_bench.cu: stand-alone H200 harness for the packed NVFP4 GEMV (kernels/gemv_packed.cu)
// against the ModelOpt-layout GEMV (kernels/gemv.cu) and the copy bandwidth, same run.
// Built here by scripts/proto/build-pgemv-bench.sh (nvcc; no Rust on the GPU machine), run
// on the device: ./pgemv_bench [--sweep]. Checks every packed result against an FP64
// reference of the exact dequantized weight; times CUDA-graph replays of 32 calls rotating
// among weight copies totalling >= 256 MiB (median of 15), like benches/gemv_cuda.rs;
// CFP4_PGEMV_SPACER=1 puts a one-CTA kernel between the calls, as in the decode step;
// CFP4_PGEMV_CHAIN=8B|70B times a layer's four GEMVs in the step's order (pgemv_chain.cuh);
// CFP4_PGEMV_SMS=N runs on N SMs (the H200 proxy of green_ctx.cuh).
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>
#include "gemv.cuh"
#include "gemv_packed.cuh"
#include "l2_prefetch.cuh"

#include "green_ctx.cuh"
#include "proto_cuda.cuh"
#ifdef CFP4_PGEMV_TIMELINE
#include "timeline.cuh"
#endif

#define PG(NAME) extern "C" __global__ void NAME(const __grid_constant__ PackedGemvParams p);
PG(cfp4_pgemv_fp4_nt1_u3) PG(cfp4_pgemv_fp4_nt1_u5) PG(cfp4_pgemv_fp4_nt1_deep) PG(cfp4_pgemv_fp4pair_nt1_u3) PG(cfp4_pgemv_fp4silu_nt1_u3) PG(cfp4_pgemv_fp4_nt2_u3)
PG(cfp4_pgemv_fp4silu_nt2_u2) PG(cfp4_pgemv_fp4_nt4_u2) PG(cfp4_pgemv_fp4silu_nt4_u2)
PG(cfp4_pgemv_fp4xs_nt1_u3) PG(cfp4_pgemv_fp4xs_nt1_deep)
#define OG(NAME) extern "C" __global__ void NAME(const __grid_constant__ GemvParams p);
OG(cfp4_gemv_fp4_nt1_s1) OG(cfp4_gemv_fp4silu_nt1_s1) OG(cfp4_gemv_fp4_nt2_s1) OG(cfp4_gemv_fp4silu_nt2_s1)
OG(cfp4_gemv_fp4_nt4_s1) OG(cfp4_gemv_fp4silu_nt4_s1)
extern "C" __global__ void cfp4_pack_codes(const __grid_constant__ PackParams p);
extern "C" __global__ void cfp4_pack_scales(const __grid_constant__ PackParams p);


// Read-only probes of the packed codes (no decode): the memory side's ceiling.
// probe_tile: the GEMV's grid and per-warp pair runs, D pairs (1 KB each) of 16-byte loads
// in flight per warp. probe_flat: a grid-stride read of the whole buffer.
template <int D>
__global__ void probe_tile(const uint8_t* w, int npairs, int split_warps, uint32_t* sink) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const int per_warp = (npairs + warps - 1) / warps;
    const int w0 = min(warp * per_warp, npairs), w1 = min(w0 + per_warp, npairs);
    const uint8_t* base = w + (size_t(blockIdx.x) * size_t(2 * npairs) + size_t(2 * w0)) * 512 + lane * 16;
    uint32_t acc = 0;
    int i = 0;
    for (; i + D <= w1 - w0; i += D) {
        uint4 v[D][2];
#pragma unroll
        for (int u = 0; u < D; ++u) {
            v[u][0] = __ldcs(reinterpret_cast<const uint4*>(base + size_t(i + u) * 1024));
            v[u][1] = __ldcs(reinterpret_cast<const uint4*>(base + size_t(i + u) * 1024 + 512));
        }
#pragma unroll
        for (int u = 0; u < D; ++u) acc ^= v[u][0].x ^ v[u][0].y ^ v[u][0].z ^ v[u][0].w ^ v[u][1].x ^ v[u][1].w;
    }
    for (; i < w1 - w0; ++i) {
        const uint4 a = __ldcs(reinterpret_cast<const uint4*>(base + size_t(i) * 1024));
        acc ^= a.x;
    }
    if (acc == 0x12345678u) sink[0] = acc + split_warps;
}
__global__ void __launch_bounds__(1024) probe_flat(const uint4* w, size_t n16, uint32_t* sink) {
    uint32_t acc = 0;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        const uint4 a = __ldcs(w + i), b = __ldcs(w + i + stride), c = __ldcs(w + i + 2 * stride), d = __ldcs(w + i + 3 * stride);
        acc ^= a.x ^ b.y ^ c.z ^ d.w;
    }
    for (; i < n16; i += stride) acc ^= __ldcs(w + i).x;
    if (acc == 0x12345678u) sink[0] = acc;
}

typedef void (*PgFn)(PackedGemvParams);
typedef void (*OgFn)(GemvParams);

// deep: the u = 5 kernel where it exists (plain, one token tile).
static PgFn pg_fn(int nt, bool silu, bool deep = false) {
    if (nt == 1) return silu ? cfp4_pgemv_fp4silu_nt1_u3 : deep ? cfp4_pgemv_fp4_nt1_deep : cfp4_pgemv_fp4_nt1_u3;
    if (nt == 2) return silu ? cfp4_pgemv_fp4silu_nt2_u2 : cfp4_pgemv_fp4_nt2_u3;
    return silu ? cfp4_pgemv_fp4silu_nt4_u2 : cfp4_pgemv_fp4_nt4_u2;
}
static OgFn og_fn(int nt, bool silu) {
    if (nt == 1) return silu ? cfp4_gemv_fp4silu_nt1_s1 : cfp4_gemv_fp4_nt1_s1;
    if (nt == 2) return silu ? cfp4_gemv_fp4silu_nt2_s1 : cfp4_gemv_fp4_nt2_s1;
    return silu ? cfp4_gemv_fp4silu_nt4_s1 : cfp4_gemv_fp4_nt4_s1;
}

__host__ __device__ static uint32_t swz(uint32_t m, uint32_t s, uint32_t sp) {
    return ((m >> 7) * (sp >> 2) + (s >> 2)) * 512u + (m & 31u) * 16u + ((m & 127u) >> 5) * 4u + (s & 3u);
}

__device__ float e2m1_val(uint32_t c) {
    const float mag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    return (c & 8) ? -mag[c & 7] : mag[c & 7];
}
__device__ float e4m3_val(uint32_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float v = e == 0 ? ldexpf(float(m), -9) : ldexpf(1.f + m / 8.f, e - 7);
    return (b & 0x80) ? -v : v;
}

// FP64 reference: ref[tok][row] = gs * sum_k x * e2m1 * e4m3, and sum |.|.
__global__ void ref_gemv(const uint8_t* codes, const uint8_t* sc, int sp, const __nv_bfloat16* x, int m, int n, int k,
                         float gs, double* ref, double* absr) {
    const int row = blockIdx.x;
    __shared__ double red[2][32][128];
    double acc[32], ab[32];
    for (int i = 0; i < m; ++i) acc[i] = ab[i] = 0;
    for (int kk = threadIdx.x; kk < k; kk += blockDim.x) {
        const uint8_t byte = codes[size_t(row) * (k / 2) + kk / 2];
        const float w = e2m1_val((kk & 1) ? byte >> 4 : byte & 15) * e4m3_val(sc[swz(row, kk / 16, sp)]);
        for (int i = 0; i < m; ++i) {
            const double p = double(w) * double(__bfloat162float(x[size_t(i) * k + kk]));
            acc[i] += p;
            ab[i] += fabs(p);
        }
    }
    for (int i = 0; i < m; ++i) {
        red[0][i][threadIdx.x] = acc[i];
        red[1][i][threadIdx.x] = ab[i];
    }
    __syncthreads();
    if (threadIdx.x < m) {
        double s = 0, a = 0;
        for (int j = 0; j < 128; ++j) {
            s += red[0][threadIdx.x][j];
            a += red[1][threadIdx.x][j];
        }
        ref[size_t(threadIdx.x) * n + row] = s * gs;
        absr[size_t(threadIdx.x) * n + row] = a * gs;
    }
}

static float bf(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static float round_bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

struct Shape {
    const char* name;
    int n, k;
    bool silu;
};

struct Layer {
    int n, k, sp, np_, tiles, npairs, half_pad, groups;
    bool silu;
    size_t code_bytes, scale_bytes, pc_bytes, ps_bytes;
    std::vector<uint8_t*> codes, scales, pcodes;
    std::vector<uint32_t*> pscales;
};

static int sms = 0;

static Layer make_layer(const Shape& s, std::mt19937& rng) {
    Layer L{};
    L.n = s.n;
    L.k = s.k;
    L.silu = s.silu;
    const int sc = s.k / 16;
    L.sp = (sc + 3) / 4 * 4;
    L.np_ = (s.n + 127) / 128 * 128;
    L.half_pad = (s.n % 2 == 0) ? ((s.n / 2 + 15) / 16) * 16 : 0;
    const int prow = L.half_pad ? 2 * L.half_pad : (s.n + 15) / 16 * 16;
    L.tiles = prow / 16;
    L.npairs = (s.k + 127) / 128;
    L.groups = s.silu ? L.half_pad / 16 : L.tiles;
    L.code_bytes = size_t(s.n) * s.k / 2;
    L.scale_bytes = size_t(L.np_) * L.sp;
    L.pc_bytes = size_t(L.tiles) * 2 * L.npairs * 512;
    L.ps_bytes = size_t(L.tiles) * L.npairs * 32 * 4;
    std::vector<uint8_t> hc(L.code_bytes), hs(L.scale_bytes, 0);
    std::uniform_int_distribution<int> byte(0, 255), pct(0, 99), sub(1, 7), nrm(0x28, 0x5f);
    for (auto& b : hc) b = uint8_t(byte(rng));
    for (int r = 0; r < s.n; ++r)
        for (int c = 0; c < sc; ++c) {
            const int q = pct(rng);
            const uint8_t v = q < 3 ? 0 : q < 8 ? uint8_t(sub(rng)) : uint8_t(nrm(rng));
            hs[swz(r, c, L.sp)] = v;
        }
    const size_t per = L.code_bytes + L.scale_bytes;
    const int copies = int(std::max<size_t>(1, (size_t(256) << 20) / per + 1));
    for (int i = 0; i < copies; ++i) {
        uint8_t *c, *sc_, *pc;
        uint32_t* ps;
        CK(cudaMalloc(&c, L.code_bytes));
        CK(cudaMalloc(&sc_, L.scale_bytes));
        CK(cudaMalloc(&pc, L.pc_bytes));
        CK(cudaMalloc(&ps, L.ps_bytes));
        CK(cudaMemcpy(c, hc.data(), L.code_bytes, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(sc_, hs.data(), L.scale_bytes, cudaMemcpyHostToDevice));
        PackParams pp{c, sc_, pc, ps, s.n, s.k, L.sp, L.half_pad, L.tiles, L.npairs};
        const size_t nc = size_t(L.tiles) * 2 * L.npairs * 32, ns = size_t(L.tiles) * L.npairs * 32;
        cfp4_pack_codes<<<unsigned((nc + 255) / 256), 256>>>(pp);
        cfp4_pack_scales<<<unsigned((ns + 255) / 256), 256>>>(pp);
        CK(cudaGetLastError());
        L.codes.push_back(c);
        L.scales.push_back(sc_);
        L.pcodes.push_back(pc);
        L.pscales.push_back(ps);
    }
    CK(cudaDeviceSynchronize());
    return L;
}

static void free_layer(Layer& L) {
    for (size_t i = 0; i < L.codes.size(); ++i) {
        cudaFree(L.codes[i]);
        cudaFree(L.scales[i]);
        cudaFree(L.pcodes[i]);
        cudaFree(L.pscales[i]);
    }
}

#include "pgemv_plan.cuh"

// CFP4_PGEMV_SPACER=1: each timed call is followed by a one-CTA kernel that waits for it
// (griddepcontrol.wait, then launch_dependents) and rewrites the first row of x in place
// (same values), as the decode step's add + RMSNorm does between two GEMVs. Back-to-back
// replays of one kernel let call i + 1 stream its weights while call i still computes; the
// decode step has no such overlap, and a kernel that won only through it lost in the step
// (twenty-first session, docs/benchmarks.md). time_graph then returns the chain's time per
// call minus the spacers' chain alone. Not yet run on a GPU when written.
static __nv_bfloat16* g_spacer_x = nullptr;
static int g_spacer_k = 0;
// CFP4_PGEMV_SPACER_NS=<ns>: the spacer spins that long after its wait, before it lets the
// next GEMV launch (a DRAM-idle window, as the decode step's attention and its combine).
// CFP4_PGEMV_SPACER_PF=<MB>: the spacer launch adds prefetch-only CTAs (one per SM), as
// the library's norm kernel does (kernels/rmsnorm.cu): after their wait they ask L2 for the
// next call's weights (kernels/l2_prefetch.cuh), at most <MB> MB of codes and the matching
// scales, a silu layer's gate and up halves in equal shares, and exit. (The twenty-second
// session's first version issued them from the one spacer CTA: one SM's copy engine
// issues about 0.3 TB/s, so that spacer ran until the weights were in L2 and the
// subtraction of the spacers' chain hid it; its rows said what a GEMV gains with its
// weights in L2, not what a prefetch gives; docs/benchmarks.md. This version has not run
// on a GPU yet.)
static long g_spacer_ns = 0;
static double g_spacer_pf_mb = 0;
static std::vector<L2Prefetch> g_pf;  // per weight copy
// The spacers' chain alone (per shape: its prefetch differs).
static bool g_alone_valid = false;
static double g_alone_us = 0;
__global__ void __launch_bounds__(256) spacer_kernel(__nv_bfloat16* x, int k, long ns, L2Prefetch pf) {
    // As kernels/rmsnorm.cu: wait for the GEMV, then let the next one launch (its weight
    // loads overlap this kernel, never the previous GEMV). CTAs past the first only prefetch.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (blockIdx.x > 0) {
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        cfp4::l2_prefetch(pf, blockIdx.x - 1, gridDim.x - 1);
        return;
    }
    if (ns > 0) {
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do {
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        } while (t - t0 < (unsigned long long)ns);
        __syncthreads();
    }
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    volatile unsigned short* v = reinterpret_cast<volatile unsigned short*>(x);
    for (int i = threadIdx.x; i < k; i += blockDim.x) v[i] = v[i];
}
// The spacer after call i: it prefetches call i + 1's weights (CFP4_PGEMV_SPACER_PF).
static void launch_spacer(cudaStream_t st, int i) {
    const L2Prefetch pf = g_pf.empty() ? L2Prefetch{} : g_pf[size_t(i + 1) % g_pf.size()];
    launch_pdl(spacer_kernel, g_pf.empty() ? 1u : unsigned(1 + sms), 256, 0, st, g_spacer_x, g_spacer_k, g_spacer_ns, pf);
}

// The spacers' chain alone: time_graph(NoLaunch{}, calls, true).
struct NoLaunch {
    void operator()(cudaStream_t, int) const {}
};

// Median µs per call of `calls` launches captured in one graph (with CFP4_PGEMV_SPACER, the
// spacers' share taken out).
template <class F>
static double time_graph(F launch, int calls = 32, bool spacers_only = false) {
    const bool spacer = g_spacer_x != nullptr;
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    auto one = [&](int i) {
        if (!spacers_only) launch(st, i);
        if (spacer) launch_spacer(st, i);
    };
    const float ms = graph_ms_per_replay(st, calls, one);
    cudaStreamDestroy(st);
    const double us = double(ms) * 1000.0 / calls;
    if (!spacer || spacers_only) return us;
    if (!g_alone_valid) {
        g_alone_us = time_graph(NoLaunch{}, calls, true);
        g_alone_valid = true;
    }
    const double alone_us = g_alone_us;
    return us - alone_us;
}

static double copy_bw() {
    const size_t bytes = size_t(2) << 30;
    void *a, *b;
    CK(cudaMalloc(&a, bytes));
    CK(cudaMalloc(&b, bytes));
    CK(cudaMemset(a, 1, bytes));
    const float ms = median_ms(0, 9, 1, [&](cudaStream_t st) {
        CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st));
    });
    cudaFree(a);
    cudaFree(b);
    return 2.0 * bytes / (ms * 1e-3) / 1e9;
}

#include "pgemv_chain.cuh"

int main(int argc, char** argv) {
    const bool sweep = argc > 1 && !strcmp(argv[1], "--sweep");
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const double copy = copy_bw();
    printf("copy %.0f GB/s (read + write), %d SMs\n", copy, sms);
    // CFP4_PGEMV_SMS=N: everything after the full-chip copy runs on N SMs (green_ctx.cuh), and
    // every % of copy below is of the full chip's.
    if (const char* e = getenv("CFP4_PGEMV_SMS")) {
        sms = make_green_ctx(unsigned(atoi(e)));
        printf("green context: %d SMs; copy on them %.0f GB/s\n", sms, copy_bw());
    }
    const Shape shapes[] = {
        {"8B qkv", 6144, 4096, false},     {"8B o", 4096, 4096, false},       {"8B gate|up", 28672, 4096, true},
        {"8B down", 4096, 14336, false},   {"8B lm_head", 128256, 4096, false}, {"70B qkv", 10240, 8192, false},
        {"70B o", 8192, 8192, false},      {"70B gate|up", 57344, 8192, true}, {"70B down", 8192, 28672, false},
        {"S qkv", 960, 576, false},        {"S o", 576, 576, false},          {"S gate|up", 3072, 576, true},
        {"S down", 576, 1536, false},      {"S lm_head", 49152, 576, false},  {"odd", 1000, 4032, false},
        {"odd silu", 200, 960, true},
    };
    std::mt19937 rng(1234);
    __nv_bfloat16* x;
    const int maxk = 28672;
    CK(cudaMalloc(&x, size_t(32) * maxk * 2));
    {
        std::vector<uint16_t> hx(size_t(32) * maxk);
        std::uniform_real_distribution<float> u(-1.f, 1.f);
        for (auto& v : hx) {
            float f = round_bf(u(rng));
            uint32_t w;
            memcpy(&w, &f, 4);
            v = uint16_t(w >> 16);
        }
        CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    }
    __nv_bfloat16* out;
    CK(cudaMalloc(&out, size_t(32) * 128256 * 2));
    float* partial;
    uint32_t* counters;
    CK(cudaMalloc(&partial, size_t(64) << 20));
    CK(cudaMalloc(&counters, 1 << 20));
    CK(cudaMemset(counters, 0, 1 << 20));
    double *ref, *absr;
    CK(cudaMalloc(&ref, size_t(32) * 128256 * 8));
    CK(cudaMalloc(&absr, size_t(32) * 128256 * 8));
    const float gs = 0.0123f;
    int bad = 0;
    printf("\n| shape | N x K | M | warps/split | packed us | packed GB/s | %% copy | old us | packed/old |\n|---|---|---|---|---|---|---|---|---|\n");
    // CFP4_PGEMV_ONLY=<shape name>[,<shape name>...]: those shapes only.
    const char* only = getenv("CFP4_PGEMV_ONLY");
    const bool nopair = getenv("CFP4_PGEMV_NOPAIR") != nullptr;
    // CFP4_PGEMV_NOSTAGE=1: never the staged kernels (x of the CTA's K slice in shared memory).
    const bool nostage = getenv("CFP4_PGEMV_NOSTAGE") != nullptr;
    int smem_optin = 0;
    CK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    for (PgFn f : {cfp4_pgemv_fp4xs_nt1_u3, cfp4_pgemv_fp4xs_nt1_deep}) {
        cudaFuncAttributes fa{};
        CK(cudaFuncGetAttributes(&fa, (const void*)f));
        CK(cudaFuncSetAttribute((const void*)f, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin - int(fa.sharedSizeBytes)));
    }
    // CFP4_PGEMV_CHAIN=8B|70B: a layer's four GEMVs in the step's order (pgemv_chain.cuh), only.
    if (const char* c = getenv("CFP4_PGEMV_CHAIN")) {
        run_chain(c, copy, x, partial, counters, rng, smem_optin);
        return 0;
    }
    const bool spacers = getenv("CFP4_PGEMV_SPACER") != nullptr;
    if (spacers) {
        if (const char* e = getenv("CFP4_PGEMV_SPACER_NS")) g_spacer_ns = atol(e);
        if (const char* e = getenv("CFP4_PGEMV_SPACER_PF")) g_spacer_pf_mb = atof(e);
        printf("spacers on: each call followed by a one-CTA kernel on x (CFP4_PGEMV_SPACER), window %ld ns, "
               "prefetch %.1f MB\n", g_spacer_ns, g_spacer_pf_mb);
    }
    for (const Shape& s : shapes) {
        if (only && !strstr((std::string(",") + only + ",").c_str(), (std::string(",") + s.name + ",").c_str())) continue;
        if (spacers) {
            g_spacer_x = x;
            g_spacer_k = s.k;
        }
        Layer L = make_layer(s, rng);
        g_pf.clear();
        g_alone_valid = false;
        if (spacers && g_spacer_pf_mb > 0)
            for (size_t c = 0; c < L.pcodes.size(); ++c) {
                // Codes: [tile][2 npairs][32 lanes][16 B]; scales: [tile][npairs][32] u32.
                const size_t tb = size_t(2) * L.npairs * 512, sb = size_t(L.npairs) * 128;
                const int segs = s.silu ? 2 : 1, seg_tiles = L.tiles / segs;
                const size_t want = size_t(g_spacer_pf_mb * 1e6 / segs);
                const int nt_pf = int(std::min<size_t>(size_t(seg_tiles), (want + tb - 1) / tb));
                L2Prefetch pf{};
                for (int g = 0; g < segs; ++g) {
                    pf.ptr[2 * g] = L.pcodes[c] + size_t(g) * seg_tiles * tb;
                    pf.bytes[2 * g] = uint64_t(nt_pf) * tb;
                    pf.ptr[2 * g + 1] = reinterpret_cast<const uint8_t*>(L.pscales[c]) + size_t(g) * seg_tiles * sb;
                    pf.bytes[2 * g + 1] = uint64_t(nt_pf) * sb;
                }
                g_pf.push_back(pf);
            }
        const double wbytes = double(L.code_bytes) + double(size_t(s.n) * (s.k / 16));
        // CFP4_PGEMV_M1=1: M = 1 only.
        const std::vector<int> ms = getenv("CFP4_PGEMV_M1") ? std::vector<int>{1} : std::vector<int>{1, 4, 8, 16, 32};
        for (int m : ms) {
            const Plan pl = plan_shape(s, L, m, nopair, nostage, smem_optin);
            const int nt = pl.nt, groups = pl.groups, warps = pl.warps, split = pl.split;
            const bool pair = pl.pair, deep = pl.deep;
            const PgFn kfn = pl.kfn;
            const size_t xs_smem = pl.xs_smem;
            const int nout = s.silu ? s.n / 2 : s.n;
            auto pg_launch = [&](cudaStream_t st, int i, int sp_, int wp_) {
                const int c = i % int(L.codes.size());
                PackedGemvParams p{L.pcodes[c], L.pscales[c], x, out, partial, counters, gs * 256.f, m, s.n, s.k, s.k,
                                   L.half_pad, groups, sp_, L.npairs, 0};
                launch_pdl(kfn, unsigned(groups * sp_), unsigned(32 * wp_), xs_smem, st, p);
            };
            // correctness (copy 0)
            CK(cudaMemset(out, 0xff, size_t(m) * nout * 2));
            pg_launch(0, 0, split, warps);
            CK(cudaDeviceSynchronize());
            ref_gemv<<<s.n, 128>>>(L.codes[0], L.scales[0], L.sp, x, m, s.n, s.k, gs, ref, absr);
            CK(cudaDeviceSynchronize());
            std::vector<uint16_t> hy(size_t(m) * nout);
            std::vector<double> hr(size_t(m) * s.n), ha(size_t(m) * s.n);
            CK(cudaMemcpy(hy.data(), out, hy.size() * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(hr.data(), ref, hr.size() * 8, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(ha.data(), absr, ha.size() * 8, cudaMemcpyDeviceToHost));
            double worst = 0;
            for (int t = 0; t < m; ++t)
                for (int r = 0; r < nout; ++r) {
                    const double y = bf(hy[size_t(t) * nout + r]);
                    double want, tol;
                    if (s.silu) {
                        const double g = hr[size_t(t) * s.n + r], u = hr[size_t(t) * s.n + nout + r];
                        const double gb = round_bf(float(g)), ub = round_bf(float(u));
                        want = gb / (1 + exp(-gb)) * ub;
                        tol = (fabs(want) + fabs(ub) * 1.1 * fabs(g) * 0.01 + 1e-30) * 0.02 +
                              (ha[size_t(t) * s.n + r] + ha[size_t(t) * s.n + nout + r]) * 1e-6;
                    } else {
                        want = hr[size_t(t) * s.n + r];
                        tol = fabs(want) * (1.0 / 256) + ha[size_t(t) * s.n + r] * s.k * 1.2e-7 + 1e-30;
                    }
                    const double e = fabs(y - want) / tol;
                    if (!(e <= worst)) worst = std::isnan(e) ? 1e30 : std::max(worst, e);
                }
            if (!(worst <= 1.0)) {
                printf("FAIL %s m=%d: worst error / tolerance %.3g\n", s.name, m, worst);
                ++bad;
            }
            const double tp = time_graph([&](cudaStream_t st, int i) { pg_launch(st, i, split, warps); });
#ifdef CFP4_PGEMV_TIMELINE
            if (m == 1) {  // the stamps of the last call of the last replay
                Timeline tl;
                tl.arm(size_t(groups) * split, 8);
                time_graph([&](cudaStream_t st, int i) { pg_launch(st, i, split, warps); });
                tl.report(s.name, wbytes);
            }
#endif
            int occ_o = 0;
            CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_o, (const void*)og_fn(nt, s.silu), 128, 0));
            const int otiles = s.silu ? (s.n / 2 + 7) / 8 : (s.n + 15) / 16;
            const double to = time_graph([&](cudaStream_t st, int i) {
                const int c = i % int(L.codes.size());
                GemvParams p{L.codes[c], L.scales[c], x, out, gs * 256.f, m, s.n, s.k, s.k, L.sp, otiles, 0};
                og_fn(nt, s.silu)<<<unsigned(std::min(otiles, sms * std::max(occ_o, 1))), 128, 0, st>>>(p);
            });
            printf("| %s | %dx%d | %d | %d/%d%s | %.2f | %.0f | %.0f%% | %.2f | %.2fx |\n", s.name, s.n, s.k, m, warps, split, pair ? " pair" : deep ? (xs_smem ? " deep xs" : " deep") : xs_smem ? " xs" : "", tp,
                   wbytes / tp / 1e3, 100.0 * wbytes / tp / 1e3 / copy, to, to / tp);
            if (m == 1 && !s.silu) {
                uint32_t* sink = counters + 1000;
                const double t3 = time_graph([&](cudaStream_t st, int i) {
                    const int c = i % int(L.codes.size());
                    probe_tile<3><<<L.groups, 32 * warps, 0, st>>>(L.pcodes[c], L.npairs, warps, sink);
                });
                const double t8 = time_graph([&](cudaStream_t st, int i) {
                    const int c = i % int(L.codes.size());
                    probe_tile<8><<<L.groups, 32 * warps, 0, st>>>(L.pcodes[c], L.npairs, warps, sink);
                });
                const double tf = time_graph([&](cudaStream_t st, int i) {
                    const int c = i % int(L.codes.size());
                    probe_flat<<<sms * 2, 1024, 0, st>>>(reinterpret_cast<const uint4*>(L.pcodes[c]), L.pc_bytes / 16, sink);
                });
                const double cb = double(L.pc_bytes);
                printf("|   read-only codes | %dx%d | tile D3 %.2f us (%.0f%%), D8 %.2f (%.0f%%), flat %.2f (%.0f%%); gemv on codes+scales %.0f%% |\n",
                       s.n, s.k, t3, 100.0 * cb / t3 / 1e3 / copy, t8, 100.0 * cb / t8 / 1e3 / copy, tf,
                       100.0 * cb / tf / 1e3 / copy, 100.0 * wbytes / tp / 1e3 / copy);
            }
            if (sweep && pair && (m == 1 || m == 8)) {
                printf("    pair sweep m=%d (groups %d):", m, groups);
                for (int sp_ : {1, 2, 4})
                    for (int wp_ : {4, 8}) {
                        CK(cudaMemset(counters, 0, 1 << 20));
                        const double t2 = time_graph([&](cudaStream_t st, int i) { pg_launch(st, i, sp_, wp_); });
                        printf(" s%d w%d %.2f", sp_, wp_, t2);
                    }
                printf("\n");
            }
            if (sweep && !xs_smem && (m == 1 || m == 8)) {  // the staged smem is for the planned split
                printf("    sweep m=%d:", m);
                for (int wp_ : {2, 3, 4, 5, 6, 8}) {
                    const double t2 = time_graph([&](cudaStream_t st, int i) { pg_launch(st, i, 1, wp_); });
                    printf(" w%d(o%d) %.2f", wp_, occ_pg(nt, s.silu, wp_, deep), t2);
                }
                printf("  (groups %d, pairs %d)\n", L.groups, L.npairs);
            }
        }
        free_layer(L);
    }
    printf("\n%s: %d failures\n", bad ? "FAILED" : "ok", bad);
    return bad ? 1 : 0;
}
