// gemv.cuh: parameter blocks of the GEMV and dequantize kernels.
//
// Mirrored field for field by `#[repr(C)]` structs in src/cuda/params.rs, whose layout
// test pins every offset below. Change both or neither.
#pragma once
#include <stdint.h>

// y[M, N_out] = epilogue(out_scale * x[M, K] . W[N, K]^T)
//   w:      NVFP4: uint8 [N, K/2] (two E2M1 codes per byte, low nibble = even k)
//           BF16:  bf16  [N, K]
//   scales: NVFP4 only: E4M3 bytes in the 128x4-swizzled layout, [Np, Sp]
//           (Np = N rounded up to 128, Sp = K/16 rounded up to 4); null for BF16
//   x:      bf16 [M, K], row stride x_stride elements (x_stride % 8 == 0, 16-byte aligned)
//   out:    bf16 [M, N] (N_out = N), or [M, N/2] with the silu_mul epilogue
//   out_scale: FP32 factor on the FP32 accumulator (NVFP4: global_scale * 2^8, since the
//           kernel's dequantized weights carry a factor 2^-8; BF16: 1)
struct GemvParams {
    const void* w;           // offset  0
    const uint8_t* scales;   // offset  8
    const void* x;           // offset 16
    void* out;               // offset 24
    float out_scale;         // offset 32
    int m;                   // offset 36: tokens, 1..=32
    int n;                   // offset 40: weight rows
    int k;                   // offset 44: multiple of 64
    int x_stride;            // offset 48: elements between rows of x
    int sp;                  // offset 52: padded scale columns
    int n_tiles;             // offset 56: CTA row tiles (16 rows; silu_mul: 8 gate + 8 up)
    int _pad;                // offset 60
};                           // size 64

// out[N, K] bf16 = e2m1 * e4m3 (exact), from codes uint8 [N, K/2] and swizzled scales.
struct DequantParams {
    const uint8_t* codes;    // offset  0
    const uint8_t* scales;   // offset  8
    void* out;               // offset 16
    int n;                   // offset 24
    int k;                   // offset 28: multiple of 16
    int sp;                  // offset 32
    int _pad;                // offset 36
};                           // size 40
