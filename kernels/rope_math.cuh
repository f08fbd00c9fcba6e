// rope_math.cuh: the rotary embedding of one (x[i], x[i + d/2]) pair, shared by the rope
// kernel (rope.cu) and the decode attention that rotates q and k itself (kv_attention.cu),
// so both round exactly as candle_nn::rotary_emb::rope on the CPU: every product and sum
// rounded to bf16 (__hmul_rn, __hsub_rn, __hadd_rn: the _rn forms keep nvcc from
// contracting a product and a sum into one fma).
#pragma once
#include <cuda_bf16.h>

namespace cfp4 {

// x1·c − x2·s: the pair's first output.
__device__ __forceinline__ __nv_bfloat16 rope_first(__nv_bfloat16 x1, __nv_bfloat16 x2, __nv_bfloat16 c,
                                                    __nv_bfloat16 s) {
    return __hsub_rn(__hmul_rn(x1, c), __hmul_rn(x2, s));
}

// x1·s + x2·c: the pair's second output.
__device__ __forceinline__ __nv_bfloat16 rope_second(__nv_bfloat16 x1, __nv_bfloat16 x2, __nv_bfloat16 c,
                                                     __nv_bfloat16 s) {
    return __hadd_rn(__hmul_rn(x1, s), __hmul_rn(x2, c));
}

}  // namespace cfp4
