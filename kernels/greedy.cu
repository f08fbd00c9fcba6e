// greedy.cu: the greedy tail of the decode step in one kernel: the argmax of each row of
// the logits written into the step's token ids, and each row's position advanced by one
// (what took a cast to f32, candle's single-CTA argmax, two copies and an affine).
//
// Layout: logits bf16 or f32 [rows][n] contiguous; ids, positions u32 [rows]; best u64
// [rows] and done u32 [rows] are scratch the op owns, zero before and after every call.
// Grid (ceil(n / chunk), rows), 256 threads.
//
// Result: the smallest index of the row's largest value (candle's argmax keeps the first
// maximum); NaN is skipped, an all-NaN row gives 0. Each CTA reduces its chunk to one key,
// (order-preserving bits of the value) << 32 | (0xffffffff − index), whose maximum is that
// element, and atomicMax-es it into best[row]; the row's last CTA (a ticket in done[row])
// writes the id, advances the position and zeroes the scratch for the next call.
#include <stdint.h>
#include <cuda_bf16.h>
#include "greedy.cuh"
#include "pdl.cuh"

constexpr int GREEDY_THREADS = 256;

__device__ __forceinline__ unsigned long long greedy_key(float v, uint32_t i) {
    const uint32_t u = __float_as_uint(v);
    const uint32_t ord = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return (static_cast<unsigned long long>(ord) << 32) | (0xffffffffu - i);
}

__device__ __forceinline__ unsigned long long max_u64(unsigned long long a, unsigned long long b) {
    return a > b ? a : b;
}

extern "C" __global__ void __launch_bounds__(GREEDY_THREADS)
cfp4_greedy(const __grid_constant__ GreedyParams p) {
    cfp4::griddep_wait();
    cfp4::griddep_launch_dependents();
    const int row = blockIdx.y;
    const size_t base = size_t(row) * p.n;
    const int lo = blockIdx.x * p.chunk;
    const int hi = min(p.n, lo + p.chunk);
    unsigned long long key = 0;
    if (p.f32) {
        const float* x = static_cast<const float*>(p.logits) + base;
        for (int i = lo + threadIdx.x; i < hi; i += GREEDY_THREADS) {
            const float v = x[i];
            if (v == v) key = max_u64(key, greedy_key(v, i));
        }
    } else {
        const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(p.logits) + base;
        for (int i = lo + threadIdx.x; i < hi; i += GREEDY_THREADS) {
            const float v = __bfloat162float(x[i]);
            if (v == v) key = max_u64(key, greedy_key(v, i));
        }
    }
    for (int o = 16; o > 0; o >>= 1) key = max_u64(key, __shfl_xor_sync(0xffffffffu, key, o));
    __shared__ unsigned long long part[GREEDY_THREADS / 32];
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = key;
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int w = 1; w < GREEDY_THREADS / 32; ++w) key = max_u64(key, part[w]);
    if (key) atomicMax(&p.best[row], key);
    __threadfence();
    if (atomicAdd(&p.done[row], 1u) != gridDim.x - 1) return;
    // The last CTA of the row: every other CTA's atomicMax is visible (fence, then ticket).
    __threadfence();
    const unsigned long long b = atomicExch(&p.best[row], 0ull);
    p.ids[row] = b ? 0xffffffffu - static_cast<uint32_t>(b & 0xffffffffu) : 0u;
    if (p.positions) p.positions[row] += 1;
    p.done[row] = 0;
}
