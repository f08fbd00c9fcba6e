// l2_prefetch.cuh: up to four byte ranges (the next GEMV's weights) asked of L2 by a
// kernel that runs while DRAM is idle, so the GEMV after it finds them there.
//
// Layout: mirrored field for field by `L2Prefetch` in src/kernel_params.rs (layout test);
// it sits inside the parameter block of each kernel that issues it. A null pointer or a
// zero length is an unused range; lengths are multiples of 16 bytes and pointers
// 16-byte aligned (cp.async.bulk.prefetch's rules; the planner, src/gemv/packed/
// geometry.rs `prefetch_tiles`, gives whole packed tiles, which are).
//
// The prefetch is a hint: no value depends on it, and images below sm_90 (no
// cp.async.bulk) skip it.
#pragma once
#include <stdint.h>

struct L2Prefetch {
    const void* ptr[4];  // offsets 0, 8, 16, 24
    uint64_t bytes[4];   // offsets 32, 40, 48, 56
};                       // size 64

namespace cfp4 {

// Bytes per prefetch instruction (the harness's, docs/benchmarks.md, twenty-second session).
constexpr uint64_t L2_PREFETCH_CHUNK = 32768;

// Issues the ranges of `pf` as 32 KB chunks, chunk g to CTA g % parts (this CTA is
// `part`), and within a CTA one chunk per thread in turn. Spread the chunks over many
// CTAs: each SM's copy engine works through its prefetches one by one, at about 0.3 TB/s
// on the H100 (twenty-second session: 21 MB from one CTA per norm made the 8B step 2.6×
// slower).
__device__ __forceinline__ void l2_prefetch(const L2Prefetch& pf, uint32_t part, uint32_t parts) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint64_t nch[4], total = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        nch[i] = pf.ptr[i] ? (pf.bytes[i] + L2_PREFETCH_CHUNK - 1) / L2_PREFETCH_CHUNK : 0;
        total += nch[i];
    }
    for (uint64_t g = part + uint64_t(parts) * threadIdx.x; g < total; g += uint64_t(parts) * blockDim.x) {
        uint64_t c = g;
        int i = 0;
        while (i < 3 && c >= nch[i]) c -= nch[i++];
        const uint64_t off = c * L2_PREFETCH_CHUNK, left = pf.bytes[i] - off;
        const uint32_t n = uint32_t(left < L2_PREFETCH_CHUNK ? left : L2_PREFETCH_CHUNK) & ~15u;
        if (n) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(static_cast<const uint8_t*>(pf.ptr[i]) + off), "r"(n) : "memory");
    }
#else
    (void)pf;
    (void)part;
    (void)parts;
#endif
}

}  // namespace cfp4
