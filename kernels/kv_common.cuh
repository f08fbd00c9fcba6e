// kv_common.cuh: what the KV-cache kernels (ultraquant.cu, kv_attention.cu) share: PDL and
// cp.async (pdl.cuh, cp_async.cuh, shared with the GEMVs), constants, and their other
// inline-asm wrappers (the PTX section, which the host emulation in tests/kv_cache_emu
// replaces with its own).
#pragma once
#include <stdint.h>
#include <cuda_bf16.h>
#include "cp_async.cuh"
#include "pdl.cuh"

namespace {

constexpr unsigned FULL = 0xffffffffu;

// Programmatic dependent launch (pdl.cuh; sm_90+, no-ops in the sm_80 image). Every
// attention and combine CTA waits before its first global access, so a PDL launch only
// overlaps the launch and the register/shared setup with the previous kernel's tail.
using cfp4::griddep_launch_dependents;
using cfp4::griddep_wait;
// cp.async (cp_async.cuh): the slot pipeline's copies (zero-filled past a sequence's end).
using cfp4::cp_async_16;
using cfp4::cp_async_16_zfill;
using cfp4::cp_async_commit;
using cfp4::cp_async_wait_group;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// f32(1/sqrt(2)) = 0x3F3504F3, the CPU's std::f32::consts::FRAC_1_SQRT_2.
__device__ __forceinline__ float inv_sqrt2() { return __uint_as_float(0x3f3504f3u); }

// ---------------------------------------------------------------- PTX wrappers
// (every inline asm of this file is in this section)

__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// x, opaque to the compiler: a loop-invariant it can no longer rematerialize inside the
// loop from the thread index (it did, at 40 instructions per iteration).
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
    asm volatile("" : "+r"(x));
    return x;
}
__device__ __forceinline__ const uint8_t* opaque(const uint8_t* x) {
    asm volatile("" : "+l"(x));
    return x;
}

// lo | hi << 16 for 16-bit lo, hi, as one multiply-add: on the FMA pipe instead of the
// logic pipe (a PRMT), which the E2M1 decode keeps busier.
__device__ __forceinline__ uint32_t pack_u16(uint32_t lo, uint32_t hi) {
    uint32_t d;
    asm("mad.lo.u32 %0, %1, 0x10000, %2;" : "=r"(d) : "r"(hi), "r"(lo));
    return d;
}

// 2^x with subnormal results flushed to 0 (one MUFU.EX2, without exp2f's subnormal
// fix-up): softmax weights below 2^-126 of the running max (2^-190 with the 2^64 bias)
// do not matter. 2^-inf = 0.
__device__ __forceinline__ float ex2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// Bytes of dynamic shared memory this launch has.
__device__ __forceinline__ uint32_t dynamic_smem_size() {
    uint32_t dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    return dyn;
}

// ---------------------------------------------------------------- end of PTX wrappers

}  // namespace
