// gemv_common.cuh: device helpers shared by the GEMV kernels (gemv.cu, gemv_packed.cu):
// programmatic dependent launch (pdl.cuh), cp.async (cp_async.cuh), streaming loads that skip L1,
// the bf16 tensor-core MMA, shared-memory loads and the bf16x2 pack.
#pragma once
#include <stdint.h>

#include "cp_async.cuh"
#include "pdl.cuh"

namespace cfp4 {

// The PTX wrappers below; the host emulation (tests/gemv_packed_emu.rs) defines
// CFP4_HOST_EMU and brings its own, by the PTX semantics.
#ifndef CFP4_HOST_EMU
__device__ __forceinline__ uint4 ld_stream_v4(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ uint2 ld_stream_v2(const void* p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

__device__ __forceinline__ uint32_t ld_stream_u32(const void* p) {
    uint32_t v;
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// c += a (16x16 bf16, row) . b (16x8 bf16, col), FP32 accumulate.
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes from shared memory (a generic pointer into it).
__device__ __forceinline__ uint4 ld_shared_v4(const void* p) {
    uint4 v;
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}

// bf16x2 {lo, hi} of two f32, each rounded to nearest (cvt.rn.bf16x2.f32, sm_80+).
__device__ __forceinline__ uint32_t pack_bf16x2_rn(float lo, float hi) {
    uint32_t d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
#endif  // CFP4_HOST_EMU

}  // namespace cfp4
