// rmsnorm.cu: the decode step's residual add fused with the RMSNorm that follows it, one
// CTA per row: s = x + delta (written out: the residual stream), out = rms_norm(s)·weight.
//
// Layout: x, delta, sum, out bf16 [rows][n] contiguous; weight bf16 [n]; delta may be null
// (the first layer: out = rms_norm(x)·weight, sum untouched).
//
// Numerics are those of candle_nn::ops::rms_norm on the CPU (the crate's reference, so the
// decode step equals the model's forward on the CPU and the GPU follows the same
// arithmetic): s = bf16(x + delta); m = bf16(sqrt(Σ s² / n + eps)) with the sum in f32;
// out = bf16(bf16(s / m) · w). Each operation is an IEEE _rn intrinsic so nvcc cannot
// contract or approximate it. Only the order of the f32 sum of squares differs from the
// CPU's sequential sum; it can move m by one bf16 rounding in rare rows (the tests' bound).
//
// PDL: the kernel loads the weight first (written at load, before the previous kernel of
// the stream), then waits for the previous kernel (which wrote x and delta) before reading
// them, and lets its dependent launch at once: the next GEMV issues its weight loads while
// this kernel runs, and its own griddepcontrol.wait holds it until this one has finished.
//
// L2 prefetch (p.prefetch, l2_prefetch.cuh): right after the wait, when the GEMV before
// has stopped streaming, the grid asks L2 for the first bytes of the GEMV after (its
// planner's ranges), so DRAM works during this kernel and the GEMV's launch. The launch
// adds CTAs past the rows (one per SM in all) that only prefetch, so the rows' CTAs keep
// their latency chain and the prefetches spread over the SMs' copy engines; with no extra
// CTAs (rows ≥ SMs) the rows' CTAs share them.
#include <stdint.h>
#include <cuda_bf16.h>
#include "rmsnorm.cuh"
#include "pdl.cuh"
#include "rmsnorm_math.cuh"

constexpr int NORM_THREADS = 256;
// The vector path: 8 bf16 (16 bytes) per load, up to NORM_VITERS loads per thread kept in
// registers between the two passes (rows of up to 8·256·8 = 16384 values).
constexpr int NORM_VITERS = 8;

__device__ __forceinline__ float block_sum(float acc) {
    __shared__ float part[NORM_THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, o));
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    float tot = 0.f;
    for (int i = 0; i < NORM_THREADS / 32; ++i) tot = __fadd_rn(tot, part[i]);
    return tot;
}

using cfp4::norm_m;
using cfp4::norm_one;

extern "C" __global__ void __launch_bounds__(NORM_THREADS)
cfp4_add_rmsnorm(const __grid_constant__ AddRmsNormParams p) {
    const int extra = int(gridDim.x) - p.rows;
    if (int(blockIdx.x) >= p.rows) {  // a prefetch-only CTA
        cfp4::griddep_wait();
        cfp4::griddep_launch_dependents();
        cfp4::l2_prefetch(p.prefetch, blockIdx.x - p.rows, extra);
        return;
    }
    const size_t base = size_t(blockIdx.x) * p.n;
    const __nv_bfloat16* __restrict__ x = static_cast<const __nv_bfloat16*>(p.x) + base;
    const __nv_bfloat16* __restrict__ d =
        p.delta ? static_cast<const __nv_bfloat16*>(p.delta) + base : nullptr;
    __nv_bfloat16* __restrict__ s_out = static_cast<__nv_bfloat16*>(p.sum) + base;
    __nv_bfloat16* __restrict__ out = static_cast<__nv_bfloat16*>(p.out) + base;
    const __nv_bfloat16* __restrict__ w = static_cast<const __nv_bfloat16*>(p.weight);

    if (p.vec) {
        // Every load first (independent): the weight before griddepcontrol.wait (it is no
        // kernel's output), x and delta after it; then the sums, the reduction, the outputs.
        const int nv = p.n / 8;
        uint4 xs[NORM_VITERS], ds[NORM_VITERS], ws[NORM_VITERS];
#pragma unroll
        for (int it = 0; it < NORM_VITERS; ++it) {
            const int v = it * NORM_THREADS + threadIdx.x;
            if (v < nv) ws[it] = reinterpret_cast<const uint4*>(w)[v];
        }
        cfp4::griddep_wait();
        cfp4::griddep_launch_dependents();
        if (extra == 0) cfp4::l2_prefetch(p.prefetch, blockIdx.x, gridDim.x);
#pragma unroll
        for (int it = 0; it < NORM_VITERS; ++it) {
            const int v = it * NORM_THREADS + threadIdx.x;
            if (v < nv) {
                xs[it] = reinterpret_cast<const uint4*>(x)[v];
                if (d) ds[it] = reinterpret_cast<const uint4*>(d)[v];
            }
        }
        float acc = 0.f;
#pragma unroll
        for (int it = 0; it < NORM_VITERS; ++it) {
            const int v = it * NORM_THREADS + threadIdx.x;
            if (v < nv) {
                __nv_bfloat16* s = reinterpret_cast<__nv_bfloat16*>(&xs[it]);
                if (d) {
                    const __nv_bfloat16* dd = reinterpret_cast<const __nv_bfloat16*>(&ds[it]);
#pragma unroll
                    for (int j = 0; j < 8; ++j) s[j] = __hadd_rn(s[j], dd[j]);
                    reinterpret_cast<uint4*>(s_out)[v] = xs[it];
                }
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float f = __bfloat162float(s[j]);
                    acc = cfp4::add_square(acc, f);
                }
            }
        }
        const float m = norm_m(block_sum(acc), p.n, p.eps);
        const float rm = cfp4::norm_rcp(m);
#pragma unroll
        for (int it = 0; it < NORM_VITERS; ++it) {
            const int v = it * NORM_THREADS + threadIdx.x;
            if (v < nv) {
                const __nv_bfloat16* s = reinterpret_cast<const __nv_bfloat16*>(&xs[it]);
                const __nv_bfloat16* ww = reinterpret_cast<const __nv_bfloat16*>(&ws[it]);
                uint4 o;
                __nv_bfloat16* oo = reinterpret_cast<__nv_bfloat16*>(&o);
#pragma unroll
                for (int j = 0; j < 8; ++j) oo[j] = norm_one(s[j], m, rm, ww[j]);
                reinterpret_cast<uint4*>(out)[v] = o;
            }
        }
        return;
    }
    // Any length or alignment: element by element, the sum re-read from this thread's own
    // stores.
    cfp4::griddep_wait();
    cfp4::griddep_launch_dependents();
    if (extra == 0) cfp4::l2_prefetch(p.prefetch, blockIdx.x, gridDim.x);
    float acc = 0.f;
    for (int c = threadIdx.x; c < p.n; c += NORM_THREADS) {
        __nv_bfloat16 s = x[c];
        if (d) {
            s = __hadd_rn(s, d[c]);
            s_out[c] = s;
        }
        const float f = __bfloat162float(s);
        acc = cfp4::add_square(acc, f);
    }
    const float m = norm_m(block_sum(acc), p.n, p.eps);
    const float rm = cfp4::norm_rcp(m);
    for (int c = threadIdx.x; c < p.n; c += NORM_THREADS) {
        const __nv_bfloat16 s = d ? s_out[c] : x[c];
        out[c] = norm_one(s, m, rm, w[c]);
    }
}
