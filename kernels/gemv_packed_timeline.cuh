// gemv_packed_timeline.cuh: the per-warp %globaltimer stamps of kernels/gemv_packed.cu
// (included once, inside its anonymous namespace after MAX_WARPS; PackedGemvParams from
// gemv_packed.cuh; the host setters are at the end of gemv_packed.cu). Compiled in only
// with -DCFP4_PGEMV_TIMELINE, which the proto harnesses' diagnostic builds pass
// (scripts/proto/build-*-bench.sh with SUFFIX=-tl) and the library's never does: there
// tl_stamp is empty.
#pragma once

// Lane 0 of each warp writes %globaltimer at entry (slot 0), after griddepcontrol.wait (1),
// after its first chunk's MMAs (2), after its main loop (3) and at the end of the finish
// (4), its SM id (5), and clock64 beside stamps 2 and 3 (slots 6 and 7: the SM clock over
// the loop), to cfp4_pgemv_timeline[((launch * stride) + blockIdx.x * MAX_WARPS + warp) *
// TL_SLOTS + slot] when the harness has set that pointer
// (cfp4_pgemv_set_timeline). launch: the index of the launch's output pointer among the
// harness's keys (cfp4_pgemv_set_timeline_keys: a chain of layers, one key each), 0 when
// it set none; stride: records per key.
#ifdef CFP4_PGEMV_TIMELINE
// Words per warp record (scripts/proto/timeline.cuh reads the same).
constexpr int TL_SLOTS = 8;
__device__ unsigned long long* cfp4_pgemv_timeline;
__device__ const void* cfp4_pgemv_tl_keys[8];
__device__ int cfp4_pgemv_tl_nkeys;
__device__ unsigned long long cfp4_pgemv_tl_stride;
__device__ __forceinline__ void tl_stamp(const PackedGemvParams& p, int slot) {
    unsigned long long* b = cfp4_pgemv_timeline;
    if (b == nullptr || (threadIdx.x & 31) != 0) return;
    int key = 0;
    for (int i = 0; i < cfp4_pgemv_tl_nkeys; ++i)
        if (cfp4_pgemv_tl_keys[i] == p.out) key = i;
    unsigned long long* rec =
        b + (key * cfp4_pgemv_tl_stride + size_t(blockIdx.x) * MAX_WARPS + threadIdx.x / 32) * TL_SLOTS;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    rec[slot] = t;
    if (slot == 2 || slot == 3) rec[4 + slot] = clock64();
    if (slot == 0) {
        unsigned int sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        rec[5] = sm;
    }
}
#else
__device__ __forceinline__ void tl_stamp(const PackedGemvParams&, int) {}
#endif
