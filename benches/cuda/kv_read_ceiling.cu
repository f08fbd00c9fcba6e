// kv_read_ceiling.cu: how fast can a kernel *read* the UltraQuant FP4 KV cache's bytes?
// A standalone microbenchmark (no Rust, no math): each variant only moves the cache bytes of
// a decode-attention call into shared memory (or registers) and XORs them, so its time is
// the ceiling of an attention kernel built on that copy.
//
// Layout assumed (kernels/ultraquant.cu): cache bytes [batch][ctx][kv_heads = 8][slot],
// slot = 136 B at D = 128 (K codes 64, K scales 4, V codes 64, V scales 4); a token row of
// all 8 heads is 1,088 contiguous bytes, one head's slot is 8-byte but not 16-byte aligned.
// A decode call for batch B reads B x ctx x 1,088 bytes.
//
// Variants (grid = splits x kv_heads x batch for per-head ones, splits x batch for rows):
//   stream     grid-stride 16-byte loads over the call's bytes (the plain read ceiling)
//   cpasync    the committed kernel's stage copy: per warp a 2-stage pipeline of 32-token
//              stages, each slot fetched as the 9 aligned 16-byte chunks covering it
//   tma-head   per warp: one cp.async.bulk.tensor (3-D tensor map over [batch][ctx][1088 B],
//              box 144 B x 32 tokens from the 16-byte boundary below byte h*136: the chunks the
//              cp.async copy reads) per 32-token stage, mbarrier
//   bulk-rows  per CTA: one cp.async.bulk of TR whole token rows (all heads, contiguous)
//              per stage, NST stages, every thread consuming
// Build and run (GPU machine): nvcc -O3 -std=c++17 -arch=sm_90a -o kvr kv_read_ceiling.cu -lcuda && ./kvr
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            return 1;                                                                          \
        }                                                                                      \
    } while (0)

constexpr int H = 8, SLOT = 136, ROW = H * SLOT;  // 1088 B per token row
constexpr int CTX_MAX = 131072, BMAX = 8;

struct Args {
    const uint8_t* base;  // cache of sequence 0 of this call
    int ctx;              // tokens per sequence (all full)
    int splits;
    size_t seq_stride;    // bytes between sequences
    uint32_t* sink;
};

__device__ __forceinline__ void sink_if(uint32_t acc, uint32_t* sink) {
    if (acc == 0x9e3779b9u) sink[0] = acc;  // never (random data), keeps the loads
}

// ---------------------------------------------------------------- stream
__global__ void __launch_bounds__(512) k_stream(const uint4* p, size_t n16, uint32_t* sink) {
    uint32_t acc = 0;
    const size_t stride = size_t(gridDim.x) * blockDim.x;
    size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a = __ldg(p + i), b = __ldg(p + i + stride), c = __ldg(p + i + 2 * stride), d = __ldg(p + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n16; i += stride) {
        uint4 a = __ldg(p + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    sink_if(acc, sink);
}

// ---------------------------------------------------------------- cp.async per head
__device__ __forceinline__ void cp16(void* smem, const void* g) {
    uint32_t s = uint32_t(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

constexpr int SROW = 144, TT = 32, STAGE = TT * SROW;  // 4608 B per warp stage

// XOR of one 144-byte stage row (the consumer of the per-head variants).
__device__ __forceinline__ uint32_t xor_slot_row(const uint8_t* p) {
    const uint4* row = reinterpret_cast<const uint4*>(p);
    uint32_t acc = 0;
#pragma unroll
    for (int c = 0; c < 9; ++c) {
        uint4 v = row[c];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    return acc;
}

template <int NW, int NST>
__global__ void __launch_bounds__(NW * 32, 1) k_cpasync(Args a) {
    extern __shared__ __align__(128) uint8_t smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int per = (a.ctx / a.splits + TT - 1) / TT * TT;
    const int t0 = min(split * per, a.ctx), t1 = min(t0 + per, a.ctx);
    const int ntiles = (t1 - t0) / TT;
    const int cnt = warp < ntiles ? (ntiles - 1 - warp) / NW + 1 : 0;
    const uint8_t* seq = a.base + size_t(b) * a.seq_stride + size_t(h) * SLOT;
    uint8_t* st = smem + warp * NST * STAGE;
    auto issue = [&](int it) {
        const int tb = t0 + TT * (warp + it * NW);
        uint8_t* buf = st + (it % NST) * STAGE;
        // 8 instructions of 4 rows x 128 contiguous bytes, then chunk 8 of row `lane`
#pragma unroll
        for (int m = 0; m < 8; ++m) {
            const int r = 4 * m + (lane >> 3), k = lane & 7;
            const uint8_t* s = seq + size_t(tb + r) * ROW;
            const uint8_t* al = reinterpret_cast<const uint8_t*>(uintptr_t(s) & ~uintptr_t(15));
            cp16(buf + r * SROW + 16 * k, al + 16 * k);
        }
        const uint8_t* s = seq + size_t(tb + lane) * ROW;
        const uint8_t* al = reinterpret_cast<const uint8_t*>(uintptr_t(s) & ~uintptr_t(15));
        cp16(buf + lane * SROW + 128, al + 128);
    };
#pragma unroll
    for (int s = 0; s < NST - 1; ++s) {
        if (s < cnt) issue(s);
        cp_commit();
    }
    uint32_t acc = 0;
    for (int it = 0; it < cnt; ++it) {
        if (it + NST - 1 < cnt) issue(it + NST - 1);
        cp_commit();
        cp_wait<NST - 1>();
        __syncwarp();
        acc ^= xor_slot_row(st + (it % NST) * STAGE + lane * SROW);
        __syncwarp();
    }
    sink_if(acc, a.sink);
}

// ---------------------------------------------------------------- mbarrier / TMA helpers
__device__ __forceinline__ void mbar_init(uint64_t* m, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(uint32_t(__cvta_generic_to_shared(m))), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* m, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(uint32_t(__cvta_generic_to_shared(m))),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* m, uint32_t parity) {
    const uint32_t a = uint32_t(__cvta_generic_to_shared(m));
    asm volatile(
        "{\n .reg .pred p;\n WAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        " @!p bra WAIT_%=;\n}\n" ::"r"(a),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void tma_3d(void* dst, const CUtensorMap* map, int x, int y, int z, uint64_t* m) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(
            uint32_t(__cvta_generic_to_shared(dst))),
        "l"(map), "r"(x), "r"(y), "r"(z), "r"(uint32_t(__cvta_generic_to_shared(m)))
        : "memory");
}
__device__ __forceinline__ void bulk_1d(void* dst, const void* src, uint32_t bytes, uint64_t* m) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            uint32_t(__cvta_generic_to_shared(dst))),
        "l"(src), "r"(bytes), "r"(uint32_t(__cvta_generic_to_shared(m)))
        : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ---------------------------------------------------------------- TMA per head (per warp)
template <int NW, int NST>
__global__ void __launch_bounds__(NW * 32, 1) k_tma_head(const __grid_constant__ CUtensorMap map, Args a, int b0) {
    extern __shared__ __align__(128) uint8_t smem[];
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + NW * NST * STAGE);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z + b0;
    const int per = (a.ctx / a.splits + TT - 1) / TT * TT;
    const int t0 = min(split * per, a.ctx), t1 = min(t0 + per, a.ctx);
    const int ntiles = (t1 - t0) / TT;
    const int cnt = warp < ntiles ? (ntiles - 1 - warp) / NW + 1 : 0;
    uint8_t* st = smem + warp * NST * STAGE;
    uint64_t* wb = bars + warp * NST;
    if (lane == 0) {
        for (int s = 0; s < NST; ++s) mbar_init(wb + s, 1);
        fence_proxy_async();
    }
    __syncwarp();
    auto issue = [&](int it) {
        const int s = it % NST;
        mbar_expect_tx(wb + s, STAGE);
        tma_3d(st + s * STAGE, &map, (h * SLOT) & ~15, t0 + TT * (warp + it * NW), b, wb + s);
    };
    if (lane == 0)
        for (int s = 0; s < NST - 1 && s < cnt; ++s) issue(s);
    uint32_t acc = 0;
    for (int it = 0; it < cnt; ++it) {
        if (lane == 0 && it + NST - 1 < cnt) issue(it + NST - 1);
        mbar_wait(wb + it % NST, (it / NST) & 1);
        acc ^= xor_slot_row(st + (it % NST) * STAGE + lane * SROW);
        __syncwarp();
    }
    sink_if(acc, a.sink);
}

// ---------------------------------------------------------------- bulk rows (per CTA)
template <int TR, int NST>
__global__ void __launch_bounds__(512, 1) k_bulk_rows(Args a) {
    extern __shared__ __align__(128) uint8_t smem[];
    constexpr int SB = TR * ROW;
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + NST * SB);
    const int split = blockIdx.x, b = blockIdx.y;
    const int per = (a.ctx / a.splits + TR - 1) / TR * TR;
    const int t0 = min(split * per, a.ctx), t1 = min(t0 + per, a.ctx);
    const int cnt = (t1 - t0) / TR;
    const uint8_t* seq = a.base + size_t(b) * a.seq_stride;
    if (threadIdx.x == 0) {
        for (int s = 0; s < NST; ++s) mbar_init(bars + s, 1);
        fence_proxy_async();
    }
    __syncthreads();
    auto issue = [&](int it) {
        const int s = it % NST;
        mbar_expect_tx(bars + s, SB);
        bulk_1d(smem + s * SB, seq + size_t(t0 + it * TR) * ROW, SB, bars + s);
    };
    if (threadIdx.x == 0)
        for (int s = 0; s < NST - 1 && s < cnt; ++s) issue(s);
    uint32_t acc = 0;
    for (int it = 0; it < cnt; ++it) {
        if (threadIdx.x == 0 && it + NST - 1 < cnt) issue(it + NST - 1);
        mbar_wait(bars + it % NST, (it / NST) & 1);
        const uint4* p = reinterpret_cast<const uint4*>(smem + (it % NST) * SB);
        for (int i = threadIdx.x; i < SB / 16; i += 512) {
            uint4 v = p[i];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        __syncthreads();  // the stage is free before it is refilled (next iteration's issue)
    }
    sink_if(acc, a.sink);
}

// ---------------------------------------------------------------- bulk per row, 2 warp groups
// The structure of the row-streaming attention kernel without its math: 16 warps in 2 groups;
// group w's first warp copies each 32-row stage with one 1,088-byte bulk copy per row (lane =
// row) into rows padded to 1,104 bytes; warp h of the group reads head h's 136 bytes of every
// row; full / empty mbarriers per stage.
constexpr int PSRS = ROW + 16;
template <int NST>
__global__ void __launch_bounds__(512, 1) k_bulk_perrow(Args a) {
    extern __shared__ __align__(128) uint8_t smem[];
    constexpr int GST = 32 * PSRS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, hw = warp % 8, wh = warp / 8;
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + 2 * NST * GST) + wh * NST;
    uint64_t* empty = reinterpret_cast<uint64_t*>(smem + 2 * NST * GST) + (2 + wh) * NST;
    const int split = blockIdx.x, b = blockIdx.y;
    const int per = (a.ctx / a.splits + 63) / 64 * 64;
    const int t0 = min(split * per, a.ctx), t1 = min(t0 + per, a.ctx);
    const int ntiles = (t1 - t0) / 32;
    const int cnt = wh < ntiles ? (ntiles - 1 - wh) / 2 + 1 : 0;
    const uint8_t* seq = a.base + size_t(b) * a.seq_stride;
    uint8_t* gst = smem + wh * NST * GST;
    if (threadIdx.x == 0) {
        uint64_t* bars = reinterpret_cast<uint64_t*>(smem + 2 * NST * GST);
        for (int i = 0; i < 4 * NST; ++i) mbar_init(bars + i, i < 2 * NST ? 1 : 8);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto produce = [&](int it) {
        const int s = it % NST;
        const int tb = t0 + 32 * (wh + 2 * it);
        if (lane == 0) mbar_expect_tx(full + s, 32 * ROW);
        __syncwarp();
        bulk_1d(gst + s * GST + lane * PSRS, seq + size_t(tb + lane) * ROW, ROW, full + s);
    };
    if (hw == 0)
        for (int s = 0; s < NST - 1 && s < cnt; ++s) produce(s);
    uint32_t acc = 0;
    for (int it = 0; it < cnt; ++it) {
        const int nx = it + NST - 1;
        if (hw == 0 && nx < cnt) {
            if (nx >= NST) mbar_wait(empty + nx % NST, uint32_t(nx / NST - 1) & 1u);
            produce(nx);
        }
        mbar_wait(full + it % NST, uint32_t(it / NST) & 1u);
        const uint8_t* row = gst + (it % NST) * GST + lane * PSRS + hw * SLOT;
#pragma unroll
        for (int c = 0; c < 17; ++c) {
            uint2 v = reinterpret_cast<const uint2*>(row)[c];
            acc ^= v.x ^ v.y;
        }
        __syncwarp();
        if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(uint32_t(__cvta_generic_to_shared(empty + it % NST))) : "memory");
    }
    sink_if(acc, a.sink);
}

// ---------------------------------------------------------------- host
static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

template <typename L>
static float time_us(L launch, int reps = 25) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int i = 0; i < 3; ++i) launch(i);
    cudaDeviceSynchronize();
    std::vector<float> ts;
    for (int r = 0; r < reps; ++r) {
        cudaEventRecord(e0);
        for (int i = 0; i < 8; ++i) launch(r * 8 + i);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        ts.push_back(ms * 1e3f / 8);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return median(ts);
}

int main() {
    setvbuf(stdout, nullptr, _IONBF, 0);
    const size_t seq_bytes = size_t(CTX_MAX) * ROW;
    const size_t total = size_t(BMAX) * seq_bytes + 4096;  // 1.1 GiB
    uint8_t* buf;
    uint32_t* sink;
    CK(cudaMalloc(&buf, total));
    CK(cudaMalloc(&sink, 64));
    {
        std::vector<uint32_t> h(total / 4);
        uint32_t x = 12345;
        for (auto& v : h) {
            x ^= x << 13, x ^= x >> 17, x ^= x << 5;
            v = x;
        }
        CK(cudaMemcpy(buf, h.data(), total / 4 * 4, cudaMemcpyHostToDevice));
    }
    // copy bandwidth (read + write) of 2 GiB... use 1 GiB halves of a fresh buffer
    float copy_gbs;
    {
        uint8_t *s, *d;
        const size_t n = size_t(1) << 30;
        CK(cudaMalloc(&s, n));
        CK(cudaMalloc(&d, n));
        float us = time_us([&](int) { cudaMemcpyAsync(d, s, n, cudaMemcpyDeviceToDevice); }, 10);
        copy_gbs = 2.0f * n / us * 1e-3f;
        cudaFree(s);
        cudaFree(d);
    }
    int sms;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    printf("copy bandwidth (D2D, read+write): %.0f GB/s, %d SMs\n", copy_gbs, sms);

    // tensor map over [BMAX][CTX_MAX][ROW] bytes, box 144 x 32 x 1
    CUtensorMap map;
    {
        cuuint64_t dims[3] = {ROW, CTX_MAX, BMAX};
        cuuint64_t strides[2] = {ROW, seq_bytes};
        cuuint32_t box[3] = {SROW, TT, 1};
        cuuint32_t es[3] = {1, 1, 1};
        CUresult r = cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, buf, dims, strides, box, es,
                                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
        if (r != CUDA_SUCCESS) {
            fprintf(stderr, "cuTensorMapEncodeTiled: %d\n", int(r));
            return 1;
        }
    }

    struct Pt {
        int ctx, batch;
    };
    const Pt pts[] = {{32768, 8}, {131072, 8}, {32768, 1}, {131072, 1}, {1024, 1}};
    printf("%-34s %8s %8s %8s %8s %8s\n", "variant", "32kx8", "128kx8", "32kx1", "128kx1", "1kx1");
    auto row = [&](const char* name, auto run) {
        printf("%-34s", name);
        for (const Pt& pt : pts) {
            const double bytes = double(pt.batch) * pt.ctx * ROW;
            // batch 1: rotate over the 8 sequences so the bytes come from HBM
            float us = time_us([&](int i) { run(pt, pt.batch == 1 ? i % BMAX : 0); });
            cudaError_t e = cudaGetLastError();
            if (e != cudaSuccess) {
                printf(" err:%s", cudaGetErrorString(e));
                return;
            }
            printf(" %5.1f/%2.0f%%", us, 100.0 * bytes / (us * 1e-6) / (copy_gbs * 1e9));
        }
        printf("\n");
    };
    auto args = [&](const Pt& pt, int b0, int splits) {
        Args a;
        a.base = buf + size_t(b0) * seq_bytes;
        a.ctx = pt.ctx;
        a.splits = splits;
        a.seq_stride = seq_bytes;
        a.sink = sink;
        return a;
    };
    // splits so that heads x batch x splits ~ ctas
    auto splits_for = [&](const Pt& pt, int ctas_per_seq_head) { return std::max(1, ctas_per_seq_head / pt.batch); };

    row("stream (grid-stride 16 B loads)", [&](const Pt& pt, int b0) {
        const size_t n16 = size_t(pt.batch) * pt.ctx * ROW / 16;
        // batch 8 reads sequences 0..7 contiguous only if ctx == CTX_MAX; use the first ctx rows of seq b0.. as
        // one stream of the same byte count (layout doesn't matter for this ceiling)
        k_stream<<<sms * 4, 512>>>(reinterpret_cast<const uint4*>(buf + size_t(b0) * seq_bytes), n16, sink);
    });
    for (int sp : {16, 32, 64}) {
        char name[64];
        snprintf(name, sizeof name, "cpasync NW16 NST2, %d CTA/seq-head", sp);
        auto* k = k_cpasync<16, 2>;
        const int smem = 16 * 2 * STAGE;
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        row(name, [&](const Pt& pt, int b0) {
            const int s = splits_for(pt, sp);
            k<<<dim3(s, H, pt.batch), 512, smem>>>(args(pt, b0, s));
        });
    }
    {
        auto* k = k_cpasync<16, 3>;
        const int smem = 16 * 3 * STAGE;
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        row("cpasync NW16 NST3, 16", [&](const Pt& pt, int b0) {
            const int s = splits_for(pt, 16);
            k<<<dim3(s, H, pt.batch), 512, smem>>>(args(pt, b0, s));
        });
    }
    auto rows = [&](auto* k, int tr, int nst, int ctas_per_seq, const char* name) {
        const int smem = nst * tr * ROW + nst * 8;
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        row(name, [&](const Pt& pt, int b0) {
            const int s = std::max(1, ctas_per_seq / pt.batch);
            k<<<dim3(s, pt.batch), 512, smem>>>(args(pt, b0, s));
        });
    };
    rows(k_bulk_rows<32, 4>, 32, 4, 128, "bulk-rows TR32 NST4, 128 CTA");
    rows(k_bulk_rows<16, 8>, 16, 8, 128, "bulk-rows TR16 NST8, 128 CTA");
    rows(k_bulk_rows<16, 4>, 16, 4, 256, "bulk-rows TR16 NST4, 256 CTA");
    rows(k_bulk_rows<64, 3>, 64, 3, 128, "bulk-rows TR64 NST3, 128 CTA");
    auto perrow = [&](auto* k, int nst, const char* name) {
        const int smem = 2 * nst * 32 * PSRS + 4 * nst * 8;
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        row(name, [&](const Pt& pt, int b0) {
            const int s = std::max(1, 128 / pt.batch);
            k<<<dim3(s, pt.batch), 512, smem>>>(args(pt, b0, s));
        });
    };
    perrow(k_bulk_perrow<2>, 2, "bulk-perrow 2 groups NST2, 128 CTA");
    perrow(k_bulk_perrow<3>, 3, "bulk-perrow 2 groups NST3, 128 CTA");
    auto tma = [&](auto* k, int nw, int nst, int sp, const char* name) {
        const int smem = nw * nst * STAGE + nw * nst * 8;
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        row(name, [&](const Pt& pt, int b0) {
            const int s = splits_for(pt, sp);
            Args a = args(pt, 0, s);
            k<<<dim3(s, H, pt.batch), nw * 32, smem>>>(map, a, b0);
        });
    };
    tma(k_tma_head<16, 2>, 16, 2, 16, "tma-head NW16 NST2, 16");
    tma(k_tma_head<16, 3>, 16, 3, 16, "tma-head NW16 NST3, 16");
    tma(k_tma_head<8, 4>, 8, 4, 16, "tma-head NW8 NST4, 16");
    tma(k_tma_head<8, 4>, 8, 4, 32, "tma-head NW8 NST4, 32");
    tma(k_tma_head<16, 3>, 16, 3, 32, "tma-head NW16 NST3, 32");
    tma(k_tma_head<4, 8>, 4, 8, 32, "tma-head NW4 NST8, 32");
    CK(cudaDeviceSynchronize());
    printf("(GPU us per call, averaged over 8 back-to-back launches, median of 25; %% of copy bandwidth)\n");
    return 0;
}
