// gemv_pack.cu: the packer of the packed NVFP4 layout (ModelOpt layout -> packed codes and
// scale words) and its inverse to exact BF16 rows. Layout: gemv_packed_layout.cuh.
#include <stdint.h>
#include <cuda_bf16.h>
#include "gemv_packed.cuh"
#include "gemv_common.cuh"
#include "gemv_packed_layout.cuh"

namespace {

// Software decode: bit of the packed word that holds bit b (0 = m, 1 = e0, 2 = e1, 3 = s)
// of half h's code of pair r (packed_word_pairs in nvfp4_decode.cuh inverts this).
__device__ __forceinline__ int code_bit_pos(int r, int h, int b) {
    const int out = (b == 3 ? 15 : 6 + b) + 16 * h;  // where packed_word_pairs puts it
    if (r < 3) return (out + 3 * r) & 31;            // rotated right by 3r
    const int low[4] = {3, 4, 0, 1};                 // pair 3: the multiply's sources
    return low[b] + 16 * h;
}

// Packed word j of lane (g, t) of chunk c of `tile`, from the ModelOpt layout
// (gemv_packed_layout.cuh).
__device__ __forceinline__ uint32_t pack_word(const PackParams& p, int tile, int c, int lane, int j) {
    const int g = lane >> 2, t = lane & 3;
    const int kj = 64 * c + 16 * t + 4 * j;
    uint32_t v[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};  // [row][k - kj]
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int row = real_row(16 * tile + g + 8 * rr, p.n, p.half_pad);
        if (row < 0 || kj >= p.k) continue;
        if ((p.scales[swizzled_offset(uint32_t(row), uint32_t(kj / 16), uint32_t(p.sp))] & 0x7fu) == 0) continue;
        const uint8_t* src = p.codes + size_t(row) * (p.k / 2) + kj / 2;
        v[rr][0] = src[0] & 15u;
        v[rr][1] = src[0] >> 4;
        v[rr][2] = src[1] & 15u;
        v[rr][3] = src[1] >> 4;
    }
    // pair r of the A fragment: (first, second) k of (row, k offset)
    const uint32_t pr[4][2] = {{v[0][0], v[0][1]}, {v[1][0], v[1][1]}, {v[0][2], v[0][3]}, {v[1][2], v[1][3]}};
    uint32_t word = 0;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        if (CFP4_HW_E2M1) {
            word |= (pr[r][0] << (8 * r)) | (pr[r][1] << (8 * r + 4));
        } else {
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int b = 0; b < 4; ++b)
                    if ((pr[r][h] >> b) & 1u) word |= 1u << code_bit_pos(r, h, b);
        }
    }
    return word;
}

}  // namespace

// One thread per 16-byte lane record of the packed codes.
extern "C" __global__ void __launch_bounds__(256) cfp4_pack_codes(const __grid_constant__ PackParams p) {
    const size_t nch = size_t(2 * p.npairs);
    const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= size_t(p.tiles) * nch * 32) return;
    const int lane = int(i % 32), c = int((i / 32) % nch), tile = int(i / 32 / nch);
    uint4 v;
    v.x = pack_word(p, tile, c, lane, 0);
    v.y = pack_word(p, tile, c, lane, 1);
    v.z = pack_word(p, tile, c, lane, 2);
    v.w = pack_word(p, tile, c, lane, 3);
    reinterpret_cast<uint4*>(p.out_codes)[i] = v;
}

// One thread per packed scale word.
extern "C" __global__ void __launch_bounds__(256) cfp4_pack_scales(const __grid_constant__ PackParams p) {
    const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= size_t(p.tiles) * p.npairs * 32) return;
    const int lane = int(i % 32), pair = int((i / 32) % p.npairs), tile = int(i / 32 / p.npairs);
    const int g = lane >> 2, t = lane & 3;
    uint32_t T[2][2] = {{0, 0}, {0, 0}};  // [row][chunk of the pair]
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int row = real_row(16 * tile + g + 8 * rr, p.n, p.half_pad);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = 2 * pair + h;
            if (row < 0 || 64 * c >= p.k) continue;
            T[rr][h] = scale_t(p.scales[swizzled_offset(uint32_t(row), uint32_t(4 * c + t), uint32_t(p.sp))]);
        }
    }
    p.out_scales[i] = (T[0][0] << 4) | (T[1][0] << 20) | (T[0][1] << 12) | ((T[1][1] & 15u) << 28) | (T[1][1] >> 4);
}

// Exact BF16 rows from the packed layout: one thread per packed word (4 k of two rows).
extern "C" __global__ void __launch_bounds__(256) cfp4_dequantize_packed(const __grid_constant__ PackedDequantParams p) {
    const size_t nch = size_t(2 * p.npairs);
    const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= size_t(p.tiles) * nch * 128) return;
    const int j = int(i % 4), lane = int((i / 4) % 32), c = int((i / 128) % nch), tile = int(i / 128 / nch);
    const int g = lane >> 2, t = lane & 3;
    const int kj = 64 * c + 16 * t + 4 * j;
    if (kj >= p.k) return;
    const uint32_t word = reinterpret_cast<const uint32_t*>(p.w)[i];
    const uint32_t S = scale_regs(p.scales[(size_t(tile) * p.npairs + c / 2) * 32 + lane], c & 1);
    uint32_t r[4];
    packed_word_pairs(word, r);
    const uint32_t sa = __byte_perm(S, 0, 0x1010), sb = __byte_perm(S, 0, 0x3232);
    // bf16x2 (256, 256) undoes the decode's 2^-8, exactly (|e2m1 * e4m3| <= 2688).
    constexpr uint32_t two8 = 0x43804380u;
    const uint32_t a0 = bf16x2_mul(bf16x2_mul(r[0], sa), two8), a1 = bf16x2_mul(bf16x2_mul(r[1], sb), two8);
    const uint32_t a2 = bf16x2_mul(bf16x2_mul(r[2], sa), two8), a3 = bf16x2_mul(bf16x2_mul(r[3], sb), two8);
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out);
    const int row0 = real_row(16 * tile + g, p.n, p.half_pad), row1 = real_row(16 * tile + g + 8, p.n, p.half_pad);
    if (row0 >= 0) *reinterpret_cast<uint2*>(out + size_t(row0) * p.k + kj) = make_uint2(a0, a2);
    if (row1 >= 0) *reinterpret_cast<uint2*>(out + size_t(row1) * p.k + kj) = make_uint2(a1, a3);
}
