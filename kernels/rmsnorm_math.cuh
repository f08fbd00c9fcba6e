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

// What norm_quot multiplies by: 1 / m rounded, for a normal m (whose reciprocal keeps at
// least 21 significant bits even where it is subnormal), else 0 (norm_quot divides).
__device__ __forceinline__ float norm_rcp(float m) { return m >= 0x1p-126f ? __frcp_rn(m) : 0.f; }

// bf16(s / m) for a bf16 value s and a bf16-rounded m, as f32, rm = norm_rcp(m). s · rm
// is within 2^-20 (relative) of s / m, and the exact quotient of two 8-bit significands a,
// b is never within 2^-16 (relative) of a bf16 rounding midpoint (a / b = odd / 2^j with a
// 9-bit odd numerator would need a >= 257), so both round to the same bf16 wherever the
// product is a normal f32; below 2^-120 (among subnormals a midpoint can be exact) and for
// NaN (m zero, subnormal, infinite or NaN included) it divides. One multiply instead of an IEEE
// division per element: tests/rmsnorm_emu.rs checks it against the division for every bf16
// s over every significand of m at the exponents where the paths switch. norm_quot_fast:
// whether s · rm is the answer.
__device__ __forceinline__ bool norm_quot_fast(float q) { return fabsf(q) >= 0x1p-120f; }
__device__ __forceinline__ float norm_quot(float s, float m, float rm) {
    const float q = __fmul_rn(s, rm);
    return norm_quot_fast(q) ? q : __fdiv_rn(s, m);
}

// bf16(bf16(s / m) * w), rm = norm_rcp(m).
__device__ __forceinline__ __nv_bfloat16 norm_one(__nv_bfloat16 s, float m, float rm, __nv_bfloat16 w) {
    const __nv_bfloat16 q = __float2bfloat16_rn(norm_quot(__bfloat162float(s), m, rm));
    return __float2bfloat16_rn(__fmul_rn(__bfloat162float(q), __bfloat162float(w)));
}

// acc + f * f, without contraction.
__device__ __forceinline__ float add_square(float acc, float f) { return __fadd_rn(acc, __fmul_rn(f, f)); }

}  // namespace cfp4
