// rmsnorm_math.cuh: the RMSNorm arithmetic shared by the norm kernel (rmsnorm.cu) and the
// packed GEMV's norm prologue (gemv_packed.cu), so both round exactly as
// candle_nn::ops::rms_norm on the CPU: m = bf16(sqrt(sum / n + eps)) from the f32 sum of
// squares, out = bf16(bf16(s / m) * w). Every operation is an IEEE _rn intrinsic so nvcc
// cannot contract or approximate it.
#pragma once
#include <cuda_bf16.h>

namespace cfp4 {

// m = bf16(sqrt(sum / n + eps)), as f32.
__device__ __forceinline__ float norm_m(float sum, int n, float eps) {
    return __bfloat162float(
        __float2bfloat16_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(sum, float(n)), eps))));
}

// bf16(bf16(s / m) * w).
__device__ __forceinline__ __nv_bfloat16 norm_one(__nv_bfloat16 s, float m, __nv_bfloat16 w) {
    const __nv_bfloat16 q = __float2bfloat16_rn(__fdiv_rn(__bfloat162float(s), m));
    return __float2bfloat16_rn(__fmul_rn(__bfloat162float(q), __bfloat162float(w)));
}

// acc + f * f, without contraction.
__device__ __forceinline__ float add_square(float acc, float f) { return __fadd_rn(acc, __fmul_rn(f, f)); }

}  // namespace cfp4
