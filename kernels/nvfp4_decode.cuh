// nvfp4_decode.cuh: exact E2M1 x E4M3 -> BF16 decode, two values per 32-bit register.
//
// Every dequantized weight leaves here as bf16 `e2m1 * e4m3 * 2^-8`, exactly (at most
// 2 + 4 significant bits, exponent inside bf16's normal range: 2^-18 .. 10.5); the
// caller folds 2^8 into the FP32 global scale.
//
// Hopper and older (no E2M1 convert): a nibble `s e1 e0 m` becomes the bf16 bit pattern
// `s 0000000e1 e0m000000`, i.e. e2m1 * 2^-126 (a subnormal for e = 0, which bf16 mul keeps),
// with a mask, a multiply and a mask per pair; `mul.rn.bf16x2` by `e4m3 * 2^118` rescales it.
// Pairs are (nibble i, nibble i+4) of each 32-bit word: x must be permuted the same way.
//
// SM100 (sm_100a): `cvt.rn.f16x2.e2m1x2` decodes a byte (low nibble -> low half) to
// f16x2; moving sign/exponent/mantissa bits gives bf16 e2m1 * 2^-112 exactly (a value of
// at most 3 significant bits); `mul.rn.bf16x2` by `e4m3 * 2^104`. Pairs are natural
// (nibble 2i, nibble 2i+1).
#pragma once
#include <stdint.h>
#include <cuda_bf16.h>

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 1000) && defined(__CUDA_ARCH_FEAT_SM100_ALL)
#define CFP4_HW_E2M1 1
#else
#define CFP4_HW_E2M1 0
#endif

// Register pairs of weights: does pair r of a word hold nibbles (r, r+4) (software decode)
// or (2r, 2r+1) (hardware convert)?
constexpr bool kPermutedPairs = !CFP4_HW_E2M1;

// a * b per bf16 half, rounded to nearest (exact for every product made here). The host
// emulation (CFP4_HOST_EMU) brings its own.
#ifndef CFP4_HOST_EMU
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
    uint32_t d;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    // sm_80/sm_89 have no mul.bf16x2: a * b + (-0) is the same value, signed zeros included.
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
#else
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#endif
    return d;
}
#endif

// E4M3 byte -> f32 value * 2^bias_log2, exact (any e4m3 value times 2^104..2^118 is a
// normal f32, and an exact bf16).
template <int BIAS_LOG2>
__device__ __forceinline__ float e4m3_to_f32_scaled(uint32_t b) {
    // (b & 0x7f) << 20 puts eeee.mmm in the low exponent / top mantissa bits: value * 2^-120
    // (an f32 subnormal for e4m3 subnormals; the multiply below keeps them: no -ftz).
    const float v = __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20));
    return __fmul_rn(__fmul_rn(v, 0x1p120f), __uint_as_float(uint32_t(127 + BIAS_LOG2) << 23));
}

// bf16x2 with both halves = e4m3 scale times the factor that the decode below needs.
__device__ __forceinline__ uint32_t scale_pair(uint32_t e4m3_byte) {
#if CFP4_HW_E2M1
    const float s = e4m3_to_f32_scaled<104>(e4m3_byte);
#else
    const float s = e4m3_to_f32_scaled<118>(e4m3_byte);
#endif
    const uint32_t h = __bfloat16_as_ushort(__float2bfloat16_rn(s));
    return h | (h << 16);
}

// 8 E2M1 codes (nibble j = code j) -> 4 bf16x2 of the raw bits, out[r] = (code r, code r+4):
// nibble s e1 e0 m -> bf16 bits s 0000000e1 e0m000000 = e2m1 * 2^-126 exactly (a subnormal
// for the codes +-0.5; bf16 mul and mma.sync both keep subnormals). Per pair: isolate
// nibbles r and r+4 (one per 16-bit half, at bits 0..3 or 4..7); one multiply makes two
// copies, (x << 12) + (x << 6) (or << 8, << 2), that cannot carry into each other; the
// mask keeps the sign of one and e1 e0 m of the other. 3.25 integer ops per pair, and the
// multiply runs on the FMA pipe. Also used by kernels/ultraquant.cu (K/V codes), with
// HI_MUL: q >> 8 as the high word of a multiply (FMA pipe) instead of a shift (logic pipe),
// since the attention kernel's logic pipe is its busiest (ncu: 68% against FMA's 25%).
template <bool HI_MUL = false>
__device__ __forceinline__ void e2m1_raw_pairs(uint32_t q, uint32_t out[4]) {
    constexpr uint32_t M = 0x81c081c0u;  // bits 15 (sign) and 8..6 (e1 e0 m) per half
    uint32_t q8;                         // nibbles 2, 3 -> 0, 1 and 6, 7 -> 4, 5
    if constexpr (HI_MUL) {
        asm("mul.hi.u32 %0, %1, 0x1000000;" : "=r"(q8) : "r"(q));
    } else {
        q8 = q >> 8;
    }
    out[0] = ((q & 0x000f000fu) * 0x1040u) & M;
    out[1] = ((q & 0x00f000f0u) * 0x0104u) & M;
    out[2] = ((q8 & 0x000f000fu) * 0x1040u) & M;
    out[3] = ((q8 & 0x00f000f0u) * 0x0104u) & M;
}

// Power of two that the raw pairs below carry (e2m1 * 2^-kRawLog2), so a scale pair
// multiplied in must carry 2^(kRawLog2 - 8) for the decode's overall 2^-8.
constexpr int kRawLog2 = CFP4_HW_E2M1 ? 112 : 126;

// The packed GEMV's word (kernels/gemv_packed.cu, "Packed layout") as 4 bf16x2 of
// e2m1 * 2^-kRawLog2, exactly, no scale: out[r] = pair r (first code in the low half).
//
// Software decode, 2 integer ops per pair: the packer places each code's four bits where
// the decode finds them. Output pair r needs, per half h, the sign at bit 15 + 16h and
// e1 e0 m at bits 8..6 + 16h (mask M = 0x81c081c0): pair 0 is q & M; pairs 1 and 2 are
// q rotated right by 3 and 6, & M (the three rotations of M are disjoint); pair 3 takes
// the 8 bits left, {0, 1, 3, 4, 16, 17, 19, 20}, and one multiply by 2^3 + 2^8 + 2^14
// moves them into M (copies that never overlap, so no carries): m <- bit 3, e0 <- 4,
// e1 <- 0, s <- 1 (and +16 for the high half). 8 ops per word: 5 LOP3, 2 SHF, 1 IMAD.
//
// Hardware decode (sm_100a): pair r = byte r, low nibble first, through the E2M1 convert.
__device__ __forceinline__ void packed_word_pairs(uint32_t q, uint32_t out[4]) {
#if CFP4_HW_E2M1
    uint32_t h[4];
    asm("{\n\t.reg .b8 b0, b1, b2, b3;\n\t"
        "mov.b32 {b0, b1, b2, b3}, %4;\n\t"
        "cvt.rn.f16x2.e2m1x2 %0, b0;\n\t"
        "cvt.rn.f16x2.e2m1x2 %1, b1;\n\t"
        "cvt.rn.f16x2.e2m1x2 %2, b2;\n\t"
        "cvt.rn.f16x2.e2m1x2 %3, b3;\n\t}"
        : "=r"(h[0]), "=r"(h[1]), "=r"(h[2]), "=r"(h[3])
        : "r"(q));
#pragma unroll
    for (int r = 0; r < 4; ++r) out[r] = (h[r] & 0x80008000u) | ((h[r] >> 3) & 0x0fff0fffu);
#else
    constexpr uint32_t M = 0x81c081c0u;
    out[0] = q & M;
    out[1] = __funnelshift_r(q, q, 3) & M;
    out[2] = __funnelshift_r(q, q, 6) & M;
    out[3] = ((q & 0x001b001bu) * 0x4108u) & M;
#endif
}

// Decodes one 32-bit word (8 E2M1 codes, code j = nibble j) times a scale pair into 4
// bf16x2 registers. Software order: out[r] = (code r, code r+4); hardware order:
// out[r] = (code 2r, code 2r+1).
__device__ __forceinline__ void decode_word(uint32_t q, uint32_t sc, uint32_t out[4]) {
#if CFP4_HW_E2M1
    uint32_t h[4];
    asm("{\n\t.reg .b8 b0, b1, b2, b3;\n\t"
        "mov.b32 {b0, b1, b2, b3}, %4;\n\t"
        "cvt.rn.f16x2.e2m1x2 %0, b0;\n\t"
        "cvt.rn.f16x2.e2m1x2 %1, b1;\n\t"
        "cvt.rn.f16x2.e2m1x2 %2, b2;\n\t"
        "cvt.rn.f16x2.e2m1x2 %3, b3;\n\t}"
        : "=r"(h[0]), "=r"(h[1]), "=r"(h[2]), "=r"(h[3])
        : "r"(q));
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        // f16 s eeeee mmmmmmmmmm -> bf16 s 000eeeee mmmmmmm: value * 2^-112 (exact, 0 -> 0).
        const uint32_t bf = (h[r] & 0x80008000u) | ((h[r] >> 3) & 0x0fff0fffu);
        out[r] = bf16x2_mul(bf, sc);
    }
#else
    e2m1_raw_pairs(q, out);
#pragma unroll
    for (int r = 0; r < 4; ++r) out[r] = bf16x2_mul(out[r], sc);
#endif
}

// Rearranges 8 consecutive bf16 values (4 natural pairs) into the pair order of decode_word.
__device__ __forceinline__ void pair_like_weights(const uint32_t nat[4], uint32_t out[4]) {
    if constexpr (kPermutedPairs) {
        out[0] = __byte_perm(nat[0], nat[2], 0x5410);  // (v0, v4)
        out[1] = __byte_perm(nat[0], nat[2], 0x7632);  // (v1, v5)
        out[2] = __byte_perm(nat[1], nat[3], 0x5410);  // (v2, v6)
        out[3] = __byte_perm(nat[1], nat[3], 0x7632);  // (v3, v7)
    } else {
#pragma unroll
        for (int r = 0; r < 4; ++r) out[r] = nat[r];
    }
}

// Inverse of pair_like_weights.
__device__ __forceinline__ void pairs_to_natural(const uint32_t p[4], uint32_t nat[4]) {
    if constexpr (kPermutedPairs) {
        nat[0] = __byte_perm(p[0], p[1], 0x5410);  // (v0, v1)
        nat[1] = __byte_perm(p[2], p[3], 0x5410);  // (v2, v3)
        nat[2] = __byte_perm(p[0], p[1], 0x7632);  // (v4, v5)
        nat[3] = __byte_perm(p[2], p[3], 0x7632);  // (v6, v7)
    } else {
#pragma unroll
        for (int r = 0; r < 4; ++r) nat[r] = p[r];
    }
}

// Byte offset of scale (row m, column s) in the 128x4-swizzled layout with sp columns.
__device__ __forceinline__ uint32_t swizzled_offset(uint32_t m, uint32_t s, uint32_t sp) {
    return ((m >> 7) * (sp >> 2) + (s >> 2)) * 512u + (m & 31u) * 16u + ((m & 127u) >> 5) * 4u + (s & 3u);
}
