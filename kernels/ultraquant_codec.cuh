// ultraquant_codec.cuh: the UltraQuant slot codec of one (token, head) in one warp, bit for bit
// the CPU's (src/ultraquant/): the Walsh-Hadamard rotation, UE8M0 scales, E2M1 codes.
// Slot layout (ultraquant.cu): [K codes D/2][K scales D/32][V codes D/2][V scales D/32], D/32
// values per lane (lane l holds elements l*E .. l*E + E - 1, E = D/32). Used by the store
// kernel (ultraquant.cu) and by the decode attention's in-kernel store (kv_attention.cu).
#pragma once
#include <stdint.h>
#include "kv_common.cuh"

namespace {

// Normalized Walsh-Hadamard transform of D values held D/32 per lane (lane l holds elements
// l*E .. l*E + E - 1). Stage order and rounding as the CPU (src/ultraquant/hadamard.rs):
// strides 1, 2, 4, ... (the in-lane strides first, then lane strides), each pair
// (u = x[i], v = x[i + h]) -> ((u + v) * r, (u - v) * r).
template <int D>
__device__ __forceinline__ void wht_warp(float (&x)[D / 32], int lane) {
    constexpr int E = D / 32;
    const float r = inv_sqrt2();
#pragma unroll
    for (int h = 1; h < E; h <<= 1) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            if (e & h) continue;
            const float u = x[e], v = x[e + h];
            x[e] = __fmul_rn(__fadd_rn(u, v), r);
            x[e + h] = __fmul_rn(__fsub_rn(u, v), r);
        }
    }
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
        const bool upper = (lane & m) != 0;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const float y = __shfl_xor_sync(FULL, x[e], m);
            x[e] = upper ? __fmul_rn(__fsub_rn(y, x[e]), r) : __fmul_rn(__fadd_rn(x[e], y), r);
        }
    }
}

// ROUND_UP_SIGNIFICAND of src/ultraquant/ue8m0.rs.
__constant__ uint32_t kRoundUp[9] = {3474675u, 3474675u, 3474675u, 3474674u, 3474672u,
                                     3474668u, 3474660u, 3474644u, 3474613u};

// E2M1 values of the 16 codes (code 8 = -0.0).
__constant__ float kE2m1[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// UE8M0 byte of a group with maximum magnitude absmax (scale_for_absmax in ue8m0.rs):
// exp = floor(RN_f32(log2(p)) + 0.5), p = c * absmax rounded to f32, from the bits of p.
__device__ __forceinline__ uint32_t scale_byte(float absmax, float c) {
    if (!(isfinite(absmax) && absmax > 0.f) || !(isfinite(c) && c > 0.f)) return 0u;
    const float p = __fmul_rn(c, absmax);
    if (!(p > 0.f) || isinf(p)) return 0u;
    const uint32_t bits = __float_as_uint(p);
    int e;
    uint32_t m;
    if ((bits >> 23) == 0u) {  // subnormal: normalize to 1.m * 2^e
        const int h = 31 - __clz(int(bits));
        e = h - 149;
        m = (bits << (23 - h)) & 0x7fffffu;
    } else {
        e = int(bits >> 23) - 127;
        m = bits & 0x7fffffu;
    }
    const int k = min(31 - __clz(abs(2 * e + 1)), 8);
    const int ex = e + (m >= kRoundUp[k] ? 1 : 0);
    if (ex < -126) return 0u;
    return uint32_t(min(ex, 127) + 127);
}

// E2M1 code of an already scaled value: count of sorted midpoints below x (a value on a
// midpoint goes to the lower level), as sign-magnitude; NaN -> 0 (e2m1.rs).
__device__ __forceinline__ uint32_t e2m1_encode(float x) {
    if (isnan(x)) return 0u;
    const int i = (x > -5.f) + (x > -3.5f) + (x > -2.5f) + (x > -1.75f) + (x > -1.25f) + (x > -0.75f) +
                  (x > -0.25f) + (x > 0.25f) + (x > 0.75f) + (x > 1.25f) + (x > 1.75f) + (x > 2.5f) +
                  (x > 3.5f) + (x > 5.f);
    return i < 7 ? uint32_t(15 - i) : uint32_t(i - 7);
}

// Quantize D values (E per lane) into `codes` (D/2 bytes) and `scales` (D/32 bytes).
template <int D>
__device__ __forceinline__ void encode_part(const float (&x)[D / 32], uint8_t* codes, uint8_t* scales, float c,
                                            int lane) {
    constexpr int E = D / 32, GL = 32 / E;  // lanes per group of 32 values
    float am = 0.f;
    int bad = 0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        am = fmaxf(am, fabsf(x[e]));
        bad |= isfinite(x[e]) ? 0 : 1;
    }
#pragma unroll
    for (int m = 1; m < GL; m <<= 1) {
        am = fmaxf(am, __shfl_xor_sync(FULL, am, m));
        bad |= __shfl_xor_sync(FULL, bad, m);
    }
    // A group holding NaN/Inf gets the NaN scale 255 and zero codes (decodes to NaN, as
    // encode_group in src/ultraquant/group.rs).
    const uint32_t byte = bad ? 255u : scale_byte(am, c);
    uint32_t packed = 0;
    if (byte != 0u && byte != 255u) {
        const float s = __uint_as_float(byte << 23);
#pragma unroll
        for (int e = 0; e < E; ++e) packed |= e2m1_encode(__fdiv_rn(x[e], s)) << (4 * e);
    }
    if constexpr (E == 2) {
        codes[lane] = uint8_t(packed);
    } else if constexpr (E == 4) {
        reinterpret_cast<uint16_t*>(codes)[lane] = uint16_t(packed);
    } else {
        reinterpret_cast<uint32_t*>(codes)[lane] = packed;
    }
    if (lane % GL == 0) scales[lane / GL] = uint8_t(byte);
}

__device__ __forceinline__ float ue8m0_value(uint32_t b) {
    return b == 0u ? 0.f : (b == 255u ? __int_as_float(0x7fc00000) : __uint_as_float(b << 23));
}

// x[e] = e2m1(code of element l*E + e) * s, exact (decode_row in group.rs).
template <int D>
__device__ __forceinline__ void decode_part(const uint8_t* codes, const uint8_t* scales, float (&x)[D / 32],
                                            int lane) {
    constexpr int E = D / 32;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = lane * E + e;
        const uint32_t b = codes[d >> 1];
        const uint32_t code = (d & 1) ? (b >> 4) : (b & 15u);
        x[e] = __fmul_rn(kE2m1[code], ue8m0_value(scales[d >> 5]));
    }
}

// The slot of one (token, head) from its K (rotated here, in place) and V, E values per lane.
template <int D>
__device__ __forceinline__ void encode_slot(float (&k)[D / 32], const float (&v)[D / 32], uint8_t* slot, float c,
                                            int lane) {
    wht_warp<D>(k, lane);
    encode_part<D>(k, slot, slot + D / 2, c, lane);
    encode_part<D>(v, slot + D / 2 + D / 32, slot + D + D / 32, c, lane);
}

}  // namespace
