// Host stand-in for kernels/nvfp4_decode.cuh in the emulator (tests/kv_cache_emu.rs): the
// pieces of it that kernels/ultraquant.cu uses, without inline asm (bf16x2_mul is in emu.h).
#pragma once
#include <cstdint>

// 8 E2M1 codes -> 4 bf16x2 of the raw bits, out[r] = (code r, code r + 4): nibble s e1 e0 m
// -> bf16 bits s 0000000e1 e0m000000 (e2m1 * 2^-126), as the device version.
template <bool HI_MUL = false>
inline void e2m1_raw_pairs(uint32_t q, uint32_t out[4]) {
    for (int r = 0; r < 4; ++r) {
        uint32_t v = 0;
        for (int h = 0; h < 2; ++h) {
            const uint32_t c = (q >> (4 * (r + 4 * h))) & 0xfu;
            v |= (((c & 8u) << 12) | ((c & 7u) << 6)) << (16 * h);
        }
        out[r] = v;
    }
}
