// Fake cuda_bf16.h for the host emulator.
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>
struct __nv_bfloat16 { uint16_t x; };
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    __nv_bfloat16 r;
    if (std::isnan(f)) { r.x = 0x7fc0; return r; }
    uint32_t lsb = (u >> 16) & 1u;
    u += 0x7fffu + lsb;
    r.x = uint16_t(u >> 16);
    return r;
}
inline float __bfloat162float(__nv_bfloat16 b) { uint32_t u = uint32_t(b.x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.x; }
// bf16 arithmetic rounded once (the operands are bf16, so a product is exact in float; the
// sums the emulated kernels form are of identity-table products, also exact).
inline __nv_bfloat16 __hmul_rn(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn(__bfloat162float(a) * __bfloat162float(b)); }
inline __nv_bfloat16 __hadd_rn(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn(__bfloat162float(a) + __bfloat162float(b)); }
inline __nv_bfloat16 __hsub_rn(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn(__bfloat162float(a) - __bfloat162float(b)); }
