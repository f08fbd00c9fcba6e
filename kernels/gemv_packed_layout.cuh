// gemv_packed_layout.cuh: the packed NVFP4 layout, shared by the GEMV (gemv_packed.cu) and
// its packer / dequantizer (gemv_pack.cu): the scale word's T encoding and the row map.
//
// Packed layout (made by gemv_pack.cu's cfp4_pack_codes / cfp4_pack_scales from the
// ModelOpt layout: codes uint8 [N, K/2], low nibble = even k; E4M3 scales per 16 k,
// 128x4-swizzled; src/gemv/packed/layout.rs is the CPU reference of both):
//   Packed rows: N padded to 16-row tiles; when N is even, in two segments of
//   half_pad = round_up(N/2, 16) rows (packed row p < half_pad is row p, else row
//   N/2 + p - half_pad), so the gate and up halves of a [gate | up] layer start on tile
//   bounds. Padding rows are zero codes with zero scales.
//   Codes: [tile][chunk c < 2*npairs][lane][16 bytes], chunk c = k 64c .. 64c+63 (chunks
//   past K are zero). Lane (g = lane/4, t = lane%4) holds rows r0 = 16*tile + g and
//   r1 = r0 + 8 at k = 64c + 16t .. +15 as 4 words; word j holds kj .. kj+3
//   (kj = 64c + 16t + 4j) of both rows, its bits placed so that packed_word_pairs
//   (nvfp4_decode.cuh: 2 integer ops per pair on the software path; bytes through the
//   E2M1 convert on sm_100a) yields the mma.m16n8k16 A fragment in order:
//   out[0] = r0 (kj, kj+1), out[1] = r1 (kj, kj+1), out[2] = r0 (kj+2, kj+3),
//   out[3] = r1 (kj+2, kj+3). The MMA's k order is free as long as x agrees: lane t's x
//   for word j is x[kj .. kj+3], natural bf16 pairs (no permute).
//   Scales: [tile][pair p < npairs][lane][u32], pair p = chunks 2p, 2p+1. Lane t's 16 k of
//   a chunk are exactly one 16-block, so a lane needs one scale per row per chunk; the
//   word packs four bytes T: bits 4..11 T(r0, 2p), 20..27 T(r1, 2p), 12..19 T(r0, 2p+1),
//   and T(r1, 2p+1) low nibble at 28..31, high nibble at 0..3. Then
//   (w & 0x0ff00ff0) | base and (rotr(w, 8) & 0x0ff00ff0) | base (chunk 2p+1) are the
//   bf16x2 (s(r0), s(r1)) = e4m3 * 2^(kRawLog2 - 8): T = ((E - kTBase) << 3) | m3 with E,
//   m3 the biased exponent and top 3 mantissa bits of that bf16 (E4M3 subnormals
//   normalised). A zero scale gives T = 0 and its block's codes are zeroed when packing.
//
#pragma once
#include <stdint.h>
#include <cuda_bf16.h>
#include "nvfp4_decode.cuh"

constexpr uint32_t kScaleMask = 0x0ff00ff0u;
// Exponent base of T: its bits start above bit 11 on the software path, so "| base" is
// one LOP3; the hardware path's scales sit 14 binades lower and add it.
constexpr int kTBase = CFP4_HW_E2M1 ? 208 : 224;
constexpr uint32_t kScaleBase = uint32_t(kTBase << 7) * 0x10001u;

// bf16x2 (s(r0), s(r1)) of chunk 2p + h from the pair's scale word.
__device__ __forceinline__ uint32_t scale_regs(uint32_t w, int h) {
    const uint32_t v = h == 0 ? w : __funnelshift_r(w, w, 8);
#if CFP4_HW_E2M1
    return (v & kScaleMask) + kScaleBase;
#else
    return (v & kScaleMask) | kScaleBase;
#endif
}

// T of an E4M3 scale byte (finite, sign ignored: the loaders reject negative scales and
// -0 is a zero scale).
__device__ __forceinline__ uint32_t scale_t(uint32_t b) {
    b &= 0x7fu;
    if (b == 0) return 0;
    const int e = int(b >> 3), m = int(b & 7u);
    int E, m3;
    if (e > 0) {
        E = e + (kRawLog2 - 8) + 120;  // (1 + m/8) 2^(e-7) * 2^(kRawLog2-8), bias 127
        m3 = m;
    } else {
        const int lead = 31 - __clz(m);  // m * 2^-9 = 2^(lead-9) * (m / 2^lead)
        E = lead + (kRawLog2 - 8) + 118;
        m3 = (m << (3 - lead)) & 7;
    }
    return uint32_t(((E - kTBase) << 3) | m3);
}

// Packed row -> weight row, or -1 for a padding row.
__device__ __forceinline__ int real_row(int prow, int n, int half_pad) {
    if (half_pad == 0) return prow < n ? prow : -1;
    const int half = n / 2;
    if (prow < half_pad) return prow < half ? prow : -1;
    const int q = prow - half_pad;
    return q < half ? half + q : -1;
}
