// greedy.cuh: parameter block of the decode step's greedy tail (greedy.cu).
//
// Mirrored field for field by a `#[repr(C)]` struct in src/kernel_params.rs, whose layout
// test pins every offset below. Change both or neither.
#pragma once
#include <stdint.h>

struct GreedyParams {
    const void* logits;          // offset  0: bf16 or f32 [rows][n], contiguous
    uint32_t* ids;               // offset  8: [rows] <- argmax of each row
    uint32_t* positions;         // offset 16: [rows] += 1, or null
    unsigned long long* best;    // offset 24: [rows] scratch, zero between calls
    uint32_t* done;              // offset 32: [rows] scratch, zero between calls
    int rows;                    // offset 40
    int n;                       // offset 44: values per row
    int chunk;                   // offset 48: values per CTA (gridDim.x = ceil(n / chunk))
    int f32;                     // offset 52: 1 = f32 logits, 0 = bf16
};                               // size 56
