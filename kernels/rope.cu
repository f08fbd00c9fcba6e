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
//
// The decode step over a BF16 cache does not run this kernel: its attention rotates q and k
// itself (kv_attention.cu). This one serves the UltraQuant cache's step (whose append
// quantizes) and any caller of QkvRope::forward.
#include <stdint.h>
#include <cuda_bf16.h>
#include "rope.cuh"
#include "rope_math.cuh"

// Wide CTAs: the row's last CTA covers up to 1024 k/v pairs (8 KV heads of 128) in one pass.
constexpr int ROPE_THREADS = 1024;

// Grid (q CTAs + 1, batch): CTA x < gridDim.x − 1 of row b rotates ROPE_THREADS (q head, i < d/2)
// pairs; the row's last CTA loops over its k and v heads (rotating k, copying v).
extern "C" __global__ void __launch_bounds__(ROPE_THREADS) cfp4_qkv_rope(const __grid_constant__ QkvRopeParams p) {
    const int half = p.d / 2;
    const int kv_heads = p.heads - p.rot_heads;
    const int q_heads = p.rot_heads - kv_heads;
    const int b = blockIdx.y;
    const size_t row_base = size_t(b) * p.heads * p.d;
    const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(p.qkv) + row_base;
    __nv_bfloat16* y = static_cast<__nv_bfloat16*>(p.out) + row_base;
    const uint32_t pos = min(p.positions[b], uint32_t(p.max_pos - 1));
    const __nv_bfloat16* cos = static_cast<const __nv_bfloat16*>(p.cos) + size_t(pos) * half;
    const __nv_bfloat16* sin = static_cast<const __nv_bfloat16*>(p.sin) + size_t(pos) * half;
    // Head h, pair i: rotated (h < rot_heads) or copied; returns the two outputs.
    auto one = [&](int h, int i, __nv_bfloat16& y1, __nv_bfloat16& y2) {
        const __nv_bfloat16 x1 = x[h * p.d + i], x2 = x[h * p.d + i + half];
        y1 = x1;
        y2 = x2;
        if (h < p.rot_heads) {
            const __nv_bfloat16 c = cos[i], s = sin[i];
            y1 = cfp4::rope_first(x1, x2, c, s);
            y2 = cfp4::rope_second(x1, x2, c, s);
        }
        y[h * p.d + i] = y1;
        y[h * p.d + i + half] = y2;
    };
    if (blockIdx.x + 1 < gridDim.x) {
        const int item = blockIdx.x * ROPE_THREADS + threadIdx.x;
        if (item < q_heads * half) {
            __nv_bfloat16 y1, y2;
            one(item / half, item % half, y1, y2);
        }
        return;
    }
    for (int item = threadIdx.x; item < 2 * kv_heads * half; item += ROPE_THREADS) {
        __nv_bfloat16 y1, y2;
        one(q_heads + item / half, item % half, y1, y2);
    }
}
