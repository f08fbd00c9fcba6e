// rope.cuh: parameter block of the fused q|k|v rotary embedding (rope.cu).
//
// Mirrored field for field by a `#[repr(C)]` struct in src/kernel_params.rs, whose layout
// test pins every offset below. Change both or neither.
#pragma once
#include <stdint.h>

struct QkvRopeParams {
    const void* qkv;              // offset  0: bf16 [batch][heads][d], contiguous
    const uint32_t* positions;    // offset  8: [batch] position of each row
    const void* cos;              // offset 16: bf16 [max_pos][d/2]
    const void* sin;              // offset 24: bf16 [max_pos][d/2]
    void* out;                    // offset 32: bf16, like qkv
    int batch;                    // offset 40
    int rot_heads;                // offset 44: leading heads rotated (q and k); the rest copied (v)
    int heads;                    // offset 48: heads per row
    int d;                        // offset 52: head_dim, even
    int max_pos;                  // offset 56: rows of cos / sin
    int _pad;                     // offset 60
};                                // size 64
