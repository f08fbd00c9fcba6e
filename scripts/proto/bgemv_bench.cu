// bgemv_bench.cu: stand-alone harness for the packed GEMV kernel over BF16 weights in their
// natural [N, K] layout (kernels/gemv_packed.cu, "BF16 weights": the BW kernels) against
// cuBLAS (cublasGemmEx, BF16 in and out, FP32 compute: what candle's matmul calls) and the
// ModelOpt-layout GEMV's BF16 kernel (kernels/gemv.cu), with the copy bandwidth, same run.
// Built here by scripts/proto/build-bgemv-bench.sh, run on the device: ./bgemv_bench.
// Each BW variant is swept over warps per CTA and K splits; the best is reported with its
// configuration (the data a planner rule is fitted to). Timing as scripts/proto/pgemv_bench.cu
// with CFP4_PGEMV_SPACER=1: CUDA-graph replays of 32 calls rotating among weight copies of
// >= 256 MiB, a one-CTA spacer kernel after each call (as the decode step's norm), the
// spacers' chain alone subtracted; median of 15 replays. Every reported BW result is checked
// against an FP64 reference: |got - ref| <= 2^-8 |ref| + 2^-23 K sum|terms| (FP32 sums of K
// exact bf16 products in any order are within (K - 1) 2^-24 sum|terms|, one bf16 rounding
// within 2^-9 |ref|; both doubled); silu rows against silu(bf16(g)) * bf16(u) of the
// reference within 2^-6 relative (the expf and the two roundings) plus the sums' error
// carried through silu and the product (a harness check; tests/gpu_gemv_bf16.rs is the test).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include "gemv.cuh"
#include "gemv_packed.cuh"

#include "proto_cuda.cuh"
#ifdef CFP4_PGEMV_TIMELINE
#include "timeline.cuh"
#endif

#define BW(NAME) extern "C" __global__ void NAME(const __grid_constant__ PackedGemvParams p);
BW(bw_plain_u2) BW(bw_plain_u3) BW(bw_plain_u4) BW(bw_plain_u6) BW(bw_pair_u2) BW(bw_pair_u3) BW(bw_staged_u4) BW(bw_silu_u2)
BW(bw_silu_u3)
extern "C" __global__ void cfp4_gemv_bf16_nt1_s1(const __grid_constant__ GemvParams p);
extern "C" __global__ void cfp4_gemv_bf16silu_nt1_s1(const __grid_constant__ GemvParams p);

typedef void (*PgFn)(PackedGemvParams);
struct Variant {
    const char* name;
    PgFn fn;
    bool pair, staged, silu;
};
static const Variant kVariants[] = {
    {"plain u2", bw_plain_u2, false, false, false}, {"plain u3", bw_plain_u3, false, false, false},
    {"plain u4", bw_plain_u4, false, false, false},
    {"plain u6", bw_plain_u6, false, false, false}, {"pair u2", bw_pair_u2, true, false, false},
    {"pair u3", bw_pair_u3, true, false, false},    {"staged u4", bw_staged_u4, false, true, false},
    {"silu u2", bw_silu_u2, false, false, true},    {"silu u3", bw_silu_u3, false, false, true},
};

struct Shape {
    const char* name;
    int n, k;
    bool silu;
};

static int sms = 0;

// Spacer: wait for the GEMV, let the next launch, rewrite x's first row in place.
static __nv_bfloat16* g_x = nullptr;
static int g_k = 0;
__global__ void __launch_bounds__(256) spacer_kernel(__nv_bfloat16* x, int k) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    volatile unsigned short* v = reinterpret_cast<volatile unsigned short*>(x);
    for (int i = threadIdx.x; i < k; i += blockDim.x) v[i] = v[i];
}

// Median µs per call of 32 launches in one graph, each followed by the spacer, less the
// spacers' chain alone.
struct NoLaunch {
    void operator()(cudaStream_t, int) const {}
};
template <class F>
static double time_graph(F launch, bool spacers_only = false) {
    const int calls = 32;
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    // CFP4_BW_NO_SPACER=1: back-to-back calls (tune's protocol), nothing subtracted.
    static const bool no_spacer = getenv("CFP4_BW_NO_SPACER") != nullptr;
    auto one = [&](int i) {
        if (!spacers_only) launch(st, i);
        if (!no_spacer) launch_pdl(spacer_kernel, 1, 256, 0, st, g_x, g_k);
    };
    const float ms = graph_ms_per_replay(st, calls, one);
    cudaStreamDestroy(st);
    const double us = double(ms) * 1000.0 / calls;
    if (spacers_only || no_spacer) return us;
    static double alone = -1;
    if (alone < 0) alone = time_graph(NoLaunch{}, true);
    return us - alone;
}

__global__ void ref_gemv(const __nv_bfloat16* w, const __nv_bfloat16* x, int m, int n, int k, double* ref, double* absr) {
    const int row = blockIdx.x;
    __shared__ double red[2][128];
    for (int i = 0; i < m; ++i) {
        double s = 0, a = 0;
        for (int kk = threadIdx.x; kk < k; kk += blockDim.x) {
            const double p = double(__bfloat162float(w[size_t(row) * k + kk])) * double(__bfloat162float(x[size_t(i) * k + kk]));
            s += p;
            a += fabs(p);
        }
        red[0][threadIdx.x] = s;
        red[1][threadIdx.x] = a;
        __syncthreads();
        if (threadIdx.x == 0) {
            double ts = 0, ta = 0;
            for (int j = 0; j < 128; ++j) {
                ts += red[0][j];
                ta += red[1][j];
            }
            ref[size_t(i) * n + row] = ts;
            absr[size_t(i) * n + row] = ta;
        }
        __syncthreads();
    }
}

static double copy_bw() {
    const size_t bytes = size_t(2) << 30;
    void *a, *b;
    CK(cudaMalloc(&a, bytes));
    CK(cudaMalloc(&b, bytes));
    CK(cudaMemset(a, 1, bytes));
    const float ms = median_ms(0, 9, 1, [&](cudaStream_t st) { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st)); });
    cudaFree(a);
    cudaFree(b);
    return 2.0 * bytes / (ms * 1e-3) / 1e9;
}

static float bf2f(uint16_t h) {
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

int main() {
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const double copy = copy_bw();
    printf("copy %.0f GB/s (read + write), %d SMs\n", copy, sms);
    cublasHandle_t hb;
    if (cublasCreate(&hb) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cublasCreate failed\n");
        return 1;
    }
    const Shape shapes[] = {
        {"8B q|k|v", 6144, 4096, false},   {"8B o", 4096, 4096, false},        {"8B gate|up", 28672, 4096, true},
        {"8B down", 4096, 14336, false},   {"70B q|k|v", 10240, 8192, false},  {"70B o", 8192, 8192, false},
        {"70B gate|up", 57344, 8192, true}, {"70B down", 8192, 28672, false}, {"S q|k|v", 960, 576, false},
        {"S o", 576, 576, false},          {"S gate|up", 3072, 576, true},     {"S down", 576, 1536, false},
    };
    std::mt19937 rng(1234);
    std::uniform_real_distribution<float> ud(-1.f, 1.f);
    const int MAXM = 8;
    printf("\n| shape | N x K | M | best BW (variant, warps, split) | BW us | %% copy | cuBLAS us | %% copy | gemv.cu bf16 us | cuBLAS / BW | check |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const Shape& s : shapes) {
        const size_t wbytes = size_t(s.n) * s.k * 2;
        const int copies = int(std::max<size_t>(2, (size_t(256) << 20) / wbytes + 1));
        std::vector<uint16_t> hw(size_t(s.n) * s.k);
        for (auto& v : hw) {
            const float f = ud(rng) * 0.05f;
            uint32_t u;
            memcpy(&u, &f, 4);
            v = uint16_t(u >> 16);
        }
        std::vector<__nv_bfloat16*> ws;
        for (int c = 0; c < copies; ++c) {
            __nv_bfloat16* w;
            CK(cudaMalloc(&w, wbytes));
            CK(cudaMemcpy(w, hw.data(), wbytes, cudaMemcpyHostToDevice));
            ws.push_back(w);
        }
        std::vector<uint16_t> hx(size_t(MAXM) * s.k);
        for (auto& v : hx) {
            const float f = ud(rng);
            uint32_t u;
            memcpy(&u, &f, 4);
            v = uint16_t(u >> 16);
        }
        __nv_bfloat16 *x, *y;
        CK(cudaMalloc(&x, hx.size() * 2));
        CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&y, size_t(MAXM) * s.n * 2));
        g_x = x;
        g_k = s.k;
        double *ref, *absr;
        CK(cudaMalloc(&ref, size_t(MAXM) * s.n * 8));
        CK(cudaMalloc(&absr, size_t(MAXM) * s.n * 8));
        ref_gemv<<<s.n, 128>>>(ws[0], x, MAXM, s.n, s.k, ref, absr);
        CK(cudaDeviceSynchronize());
        std::vector<double> href(size_t(MAXM) * s.n), habs(href.size());
        CK(cudaMemcpy(href.data(), ref, href.size() * 8, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(habs.data(), absr, habs.size() * 8, cudaMemcpyDeviceToHost));
        float* partial;
        uint32_t* counters;
        CK(cudaMalloc(&partial, size_t(64) << 20));
        CK(cudaMalloc(&counters, 1 << 20));
        CK(cudaMemset(counters, 0, 1 << 20));
        const int n_out = s.silu ? s.n / 2 : s.n;
        // The parameter block of one BW launch on weight copy `w`.
        auto params = [&](const __nv_bfloat16* w, int m, int groups, int split) {
            PackedGemvParams p{};
            p.w = reinterpret_cast<const uint8_t*>(w);
            p.x = x;
            p.out = y;
            p.partial = partial;
            p.counters = counters;
            p.out_scale = 1.f;
            p.m = m;
            p.n = s.n;
            p.k = s.k;
            p.x_stride = s.k;
            p.groups = groups;
            p.split = split;
            p.npairs = s.k / 64;
            return p;
        };
        for (int m : {1, 8}) {
            // Best BW configuration.
            double best = 1e30;
            char best_cfg[64] = "none";
            const Variant* bv = nullptr;
            int bw_ = 0, bs_ = 0;
            const int tiles = (s.n + 15) / 16;
            for (const Variant& v : kVariants) {
                if (v.silu != s.silu) continue;
                const int groups = v.silu ? (s.n / 2 + 15) / 16 : v.pair ? (tiles + 1) / 2 : tiles;
                const int nsteps = s.k / 64;
                if (m == 1) printf("  sweep %s m=1 %s:", s.name, v.name);
                for (int warps : {2, 3, 4, 5, 6, 8})
                    for (int split : {1, 2, 4}) {
                        if (nsteps < warps * split) continue;
                        const int per_slice = (nsteps + split - 1) / split;
                        const size_t smem = v.staged ? size_t(m) * (std::min(64 * per_slice, s.k) + 8) * 2 : 0;
                        if (v.staged && split * groups > 2 * sms) continue;
                        if (smem > 48 * 1024) continue;
                        const size_t need = size_t(groups) * split * (v.pair || v.silu ? 2 : 1) * 32 * 16;
                        if (split > 1 && need > (size_t(64) << 20)) continue;
                        auto launch = [&](cudaStream_t st, int i) {
                            const PackedGemvParams p = params(ws[size_t(i) % ws.size()], m, groups, split);
                            launch_pdl(v.fn, unsigned(groups * split), unsigned(32 * warps), smem, st, p);
                        };
                        const double us = time_graph(launch);
                        if (m == 1) printf(" w%d/s%d %.2f", warps, split, us);
                        if (us < best) {
                            best = us;
                            bv = &v;
                            bw_ = warps;
                            bs_ = split;
                            snprintf(best_cfg, sizeof best_cfg, "%s, %d, %d", v.name, warps, split);
                        }
                    }
                if (m == 1) printf("\n");
            }
            // The best configuration's launch on weight copy i (bv set).
            auto best_launch = [&](cudaStream_t st, int i) {
                const int groups = bv->silu ? (s.n / 2 + 15) / 16 : bv->pair ? (tiles + 1) / 2 : tiles;
                const int per_slice = (s.k / 64 + bs_ - 1) / bs_;
                const size_t smem = bv->staged ? size_t(m) * (std::min(64 * per_slice, s.k) + 8) * 2 : 0;
                const PackedGemvParams p = params(ws[size_t(i) % ws.size()], m, groups, bs_);
                launch_pdl(bv->fn, unsigned(groups * bs_), unsigned(32 * bw_), smem, st, p);
            };
            // Check the best configuration once on copy 0.
            int bad = 0;
            if (bv) {
                CK(cudaMemset(y, 0xff, size_t(MAXM) * s.n * 2));  // poison
                best_launch(0, 0);
                CK(cudaDeviceSynchronize());
                std::vector<uint16_t> hy(size_t(m) * n_out);
                CK(cudaMemcpy(hy.data(), y, hy.size() * 2, cudaMemcpyDeviceToHost));
                for (int t = 0; t < m; ++t)
                    for (int r = 0; r < n_out; ++r) {
                        const double got = bf2f(hy[size_t(t) * n_out + r]);
                        bool ok;
                        if (s.silu) {
                            const float gg = round_bf(float(href[size_t(t) * s.n + r]));
                            const float uu = round_bf(float(href[size_t(t) * s.n + r + n_out]));
                            const double want = double(gg) / (1.0 + exp(-double(gg))) * double(uu);
                            // The sums' error (K 2^-24 sum|terms| each, doubled) carried
                            // through silu (slope <= 1.1) and the product, plus 2^-6 relative.
                            const double eg = s.k * ldexp(1.0, -23) * habs[size_t(t) * s.n + r];
                            const double eu = s.k * ldexp(1.0, -23) * habs[size_t(t) * s.n + r + n_out];
                            const double sg = double(gg) / (1.0 + exp(-double(gg)));
                            const double tol = fabs(want) / 64.0 + 1.1 * eg * fabs(double(uu)) + fabs(sg) * eu + 1e-30;
                            ok = std::isfinite(got) && fabs(got - want) <= tol;
                        } else {
                            const double want = href[size_t(t) * s.n + r], a = habs[size_t(t) * s.n + r];
                            ok = std::isfinite(got) && fabs(got - want) <= fabs(want) / 256.0 + a * s.k * ldexp(1.0, -23);
                        }
                        if (!ok && ++bad <= 3)
                            printf("  mismatch %s m=%d tok %d row %d: got %g\n", s.name, m, t, r, got);
                    }
            }
#ifdef CFP4_PGEMV_TIMELINE
            if (bv && m == 1) {  // the best configuration's stamps (last call of the last replay)
                Timeline tl;
                tl.arm(size_t(tiles) * bs_, 8);  // at least the grid's CTAs (groups <= tiles)
                time_graph(best_launch);
                tl.report(s.name, double(s.n) * s.k * 2);
            }
#endif
            // cuBLAS: y^T [N, M] = W [N, K] . x^T (column-major view: W^T is K x N).
            const float one = 1.f, zero = 0.f;
            auto cub = [&](cudaStream_t st, int i) {
                cublasSetStream(hb, st);
                const cublasStatus_t r = cublasGemmEx(hb, CUBLAS_OP_T, CUBLAS_OP_N, s.n, m, s.k, &one, ws[size_t(i) % ws.size()],
                                                      CUDA_R_16BF, s.k, x, CUDA_R_16BF, s.k, &zero, y, CUDA_R_16BF, s.n,
                                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
                if (r != CUBLAS_STATUS_SUCCESS) {
                    fprintf(stderr, "cublasGemmEx failed: %d\n", int(r));
                    exit(1);
                }
            };
            const double tc = time_graph(cub);
            // gemv.cu's BF16 kernel (one token tile, no cluster split).
            const int otiles = s.silu ? (s.n / 2 + 7) / 8 : (s.n + 15) / 16;
            void (*ofn)(GemvParams) = s.silu ? cfp4_gemv_bf16silu_nt1_s1 : cfp4_gemv_bf16_nt1_s1;
            int occ = 0;
            CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, (const void*)ofn, 128, 0));
            const double to = time_graph([&](cudaStream_t st, int i) {
                GemvParams p{ws[size_t(i) % ws.size()], nullptr, x, y, 1.f, m, s.n, s.k, s.k, 0, otiles, 0};
                launch_pdl(ofn, unsigned(std::min(otiles, sms * std::max(occ, 1))), 128, 0, st, p);
            });
            printf("| %s | %dx%d | %d | %s | %.2f | %.0f%% | %.2f | %.0f%% | %.2f | %.2fx | %s |\n", s.name, s.n, s.k, m, best_cfg, best,
                   100.0 * wbytes / best / 1e3 / copy, tc, 100.0 * wbytes / tc / 1e3 / copy, to, tc / best, bad ? "FAIL" : "ok");
            fflush(stdout);
        }
        for (auto w : ws) cudaFree(w);
        cudaFree(x);
        cudaFree(y);
        cudaFree(ref);
        cudaFree(absr);
        cudaFree(partial);
        cudaFree(counters);
    }
    cublasDestroy(hb);
    return 0;
}
