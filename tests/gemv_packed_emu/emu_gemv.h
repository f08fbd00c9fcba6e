// Host stand-ins for what kernels/gemv_packed.cu uses beyond tests/kv_cache_emu/emu.h
// (included after it, driven by tests/gemv_packed_emu.rs): the vector types, the read-only
// and L2-only loads and stores as plain memory accesses (float4 and its __ldcg are emu.h's),
// the funnel shift, the IEEE intrinsics, and the PTX wrappers of kernels/gemv_common.cuh
// (CFP4_HOST_EMU, defined by emu.h, drops the device ones) by their PTX semantics: the loads
// read; mma_bf16 is emu.h's (FP32 accumulation in k order, not the tensor cores' order);
// cp.async is tests/emu_common/cp_async_emu.h's (a thread's copies land at its wait).
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>

struct alignas(8) uint2 { uint32_t x, y; };
inline uint32_t __funnelshift_r(uint32_t lo, uint32_t hi, uint32_t s) {
    const uint64_t v = (uint64_t(hi) << 32) | lo;
    return uint32_t(v >> (s & 31));
}
template <class T> inline T __ldg(const T* p) { return *p; }
inline void __stcg(float4* p, float4 v) { *p = v; }
inline uint32_t __cvta_generic_to_shared(const void* p) { return uint32_t(reinterpret_cast<uintptr_t>(p)); }

namespace cfp4 {
inline uint4 ld_stream_v4(const void* p) { uint4 v; std::memcpy(&v, p, 16); return v; }
inline uint2 ld_stream_v2(const void* p) { uint2 v; std::memcpy(&v, p, 8); return v; }
inline uint32_t ld_stream_u32(const void* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline uint4 ld_shared_v4(const void* p) { uint4 v; std::memcpy(&v, p, 16); return v; }
inline uint32_t pack_bf16x2_rn(float lo, float hi) {
    return uint32_t(__float2bfloat16_rn(lo).x) | (uint32_t(__float2bfloat16_rn(hi).x) << 16);
}
using ::mma_bf16;
}  // namespace cfp4
