// rope.cu: rotary position embedding of the q and k heads of a fused q|k|v projection at
// per-row positions read on the device (the decode step, so a captured CUDA graph rotates
// for the positions written before each replay), v copied through: one kernel for what
// took a split, two gathers of the tables and a rope per head group.
//
// Layout: qkv bf16 [batch][heads][d] contiguous, heads = the q heads, then the k heads
// (together `rot_heads`), then the v heads; positions u32 [batch]; cos, sin bf16
// [max_pos][d/2]; out like qkv. Non-interleaved halves, as candle_nn::rotary_emb::rope:
// out[i] = x[i]·c − x[i + d/2]·s, out[i + d/2] = x[i]·s + x[i + d/2]·c for i < d/2, each
// product and sum rounded to bf16 (__hmul_rn, __hsub_rn, __hadd_rn: the _rn forms keep
// nvcc from contracting a product and a sum into one fma), so the result is bit-identical
// to candle's CPU rope and to src/rope's reference. (candle's own CUDA rope writes
// `a * c - b * s` on bf16 operators, which nvcc may contract: it can differ from both by
// one rounding.) A position past the tables reads the last row (the caller checks
// positions against the cache capacity the tables cover).
#include <stdint.h>
#include <cuda_bf16.h>
#include "rope.cuh"

// One thread per (row, head, i < d/2).
extern "C" __global__ void __launch_bounds__(256) cfp4_qkv_rope(const __grid_constant__ QkvRopeParams p) {
    const int half = p.d / 2;
    const size_t idx = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= size_t(p.batch) * p.heads * half) return;
    const int i = int(idx % half);
    const int h = int((idx / half) % p.heads);
    const int b = int(idx / half / p.heads);
    const size_t base = (size_t(b) * p.heads + h) * p.d;
    const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(p.qkv) + base;
    __nv_bfloat16* y = static_cast<__nv_bfloat16*>(p.out) + base;
    const __nv_bfloat16 x1 = x[i], x2 = x[i + half];
    if (h >= p.rot_heads) {
        y[i] = x1;
        y[i + half] = x2;
        return;
    }
    const uint32_t pos = min(p.positions[b], uint32_t(p.max_pos - 1));
    const __nv_bfloat16 c = static_cast<const __nv_bfloat16*>(p.cos)[size_t(pos) * half + i];
    const __nv_bfloat16 s = static_cast<const __nv_bfloat16*>(p.sin)[size_t(pos) * half + i];
    y[i] = __hsub_rn(__hmul_rn(x1, c), __hmul_rn(x2, s));
    y[i + half] = __hadd_rn(__hmul_rn(x1, s), __hmul_rn(x2, c));
}
