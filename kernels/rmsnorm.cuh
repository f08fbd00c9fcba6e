// rmsnorm.cuh: parameter block of the fused residual add + RMSNorm (rmsnorm.cu).
//
// Mirrored field for field by a `#[repr(C)]` struct in src/kernel_params.rs, whose layout
// test pins every offset below. Change both or neither.
#pragma once
#include <stdint.h>
#include "l2_prefetch.cuh"

struct AddRmsNormParams {
    const void* x;        // offset  0: bf16 [rows][n], contiguous
    const void* delta;    // offset  8: bf16 [rows][n], or null (no residual add)
    const void* weight;   // offset 16: bf16 [n]
    void* sum;            // offset 24: bf16 [rows][n]: x + delta (unused when delta is null)
    void* out;            // offset 32: bf16 [rows][n]: rms_norm(x + delta) · weight
    int rows;             // offset 40
    int n;                // offset 44: row length
    float eps;            // offset 48
    int vec;              // offset 52: 1 = n % 8 == 0, n ≤ 16384 and every pointer 16-byte aligned
    L2Prefetch prefetch;  // offset 56: the next GEMV's weights, asked of L2 after the wait
};                        // size 120
