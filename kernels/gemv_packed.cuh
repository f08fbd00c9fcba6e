// gemv_packed.cuh: parameter blocks of the packed-NVFP4 kernels in gemv_packed.cu.
//
// Mirrored field for field by `#[repr(C)]` structs in src/kernel_params.rs, whose layout
// tests pin every offset below. Change both or neither.
#pragma once
#include <stdint.h>

// y[M, N_out] = epilogue(out_scale * x[M, K] . W[N, K]^T) over the packed layout
// (gemv_packed.cu, "Packed layout"); the norm variants take x = rms_norm(x + delta) * norm_w
// (rmsnorm_math.cuh) and write x + delta.
struct PackedGemvParams {
    const uint8_t* w;         // offset  0: packed codes (BW kernels: the bf16 [N, K] weight), 16-byte aligned
    const uint32_t* scales;   // offset  8: packed scale words (BW kernels: unused)
    const void* x;            // offset 16: bf16 [M, K], row stride x_stride
    void* out;                // offset 24: bf16 [M, N] or [M, N/2] (silu_mul)
    float* partial;           // offset 32: split > 1: [groups][split][TILES*NT*32] float4
    uint32_t* counters;       // offset 40: split > 1: [groups] arrivals, 0 between calls
    float out_scale;          // offset 48: global_scale * 2^8 (decoded weights carry 2^-8)
    int m;                    // offset 52: tokens, 1..=8*NT
    int n;                    // offset 56: weight rows N (silu_mul: [gate | up])
    int k;                    // offset 60: multiple of 64
    int x_stride;             // offset 64: elements between rows of x (multiple of 8)
    int half_pad;             // offset 68: packed rows of one half (two segments), or 0
    int groups;               // offset 72: CTA work groups (plain: row tiles; silu: tile pairs)
    int split;                // offset 76: CTAs per group, each a slice of K
    int npairs;               // offset 80: K steps per tile: ceil(K / 128) (NVFP4), K / 64 (BF16 weights)
    int _pad;                 // offset 84
    // The norm variants only (x is then the residual stream; the others ignore these):
    const void* delta;        // offset 88: bf16 [M, K] contiguous added to x, or null
    const void* norm_w;       // offset 96: bf16 [K], the RMSNorm weight
    void* sum;                // offset 104: bf16 [M, K] contiguous: x + delta (CTA 0 writes
                              //             it; unused when delta is null)
    float eps;                // offset 112
    int _pad2;                // offset 116
};                            // size 120

// Packs ModelOpt codes [N, K/2] and 128x4-swizzled E4M3 scales [Np, Sp] into the packed
// layout (codes: one thread per 16-byte lane record; scales: one thread per word).
struct PackParams {
    const uint8_t* codes;     // offset  0: ModelOpt codes [N, K/2]
    const uint8_t* scales;    // offset  8: swizzled E4M3 [Np, Sp]
    uint8_t* out_codes;       // offset 16: [tiles][2*npairs][32][16]
    uint32_t* out_scales;     // offset 24: [tiles][npairs][32]
    int n;                    // offset 32
    int k;                    // offset 36
    int sp;                   // offset 40: swizzled scale columns
    int half_pad;             // offset 44: as PackedGemvParams
    int tiles;                // offset 48: packed row tiles (packed rows / 16)
    int npairs;               // offset 52
};                            // size 56

// out[N, K] bf16 = e2m1 * e4m3 (exact) from the packed layout (the matmul path).
struct PackedDequantParams {
    const uint8_t* w;         // offset  0
    const uint32_t* scales;   // offset  8
    void* out;                // offset 16: bf16 [N, K]
    int n;                    // offset 24
    int k;                    // offset 28
    int half_pad;             // offset 32
    int tiles;                // offset 36
    int npairs;               // offset 40
    int _pad;                 // offset 44
};                            // size 48
