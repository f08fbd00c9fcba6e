// pdl.cuh: programmatic dependent launch for the kernels outside the KV cache (GEMVs,
// RMSNorm, greedy argmax); kv_common.cuh keeps its own copy inside the section the host
// emulation of the KV kernels replaces.
#pragma once
#include <stdint.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CFP4_SM90 1
#else
#define CFP4_SM90 0
#endif

namespace cfp4 {

// Waits until the kernel this one depends on has finished (its writes are visible).
// griddepcontrol needs sm_90; on older images these are no-ops.
__device__ __forceinline__ void griddep_wait() {
#if CFP4_SM90
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel of the stream launch now (it still waits in its griddep_wait).
__device__ __forceinline__ void griddep_launch_dependents() {
#if CFP4_SM90
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Inside a captured decode graph, a kernel can wait for its predecessor's CTAs to arrive
// on a counter instead of for the predecessor's completion (src/cuda/dep.rs plans it at
// capture, only between two kernels that take a Dep; elsewhere every field is null).
// Mirrored by `Dep` in src/cuda/dep.rs (layout-tested). Change both or neither.
struct Dep {
    uint32_t* wait;      // offset  0: the previous kernel's arrival counter, or null:
                         //            griddepcontrol.wait (the previous grid's completion)
    uint32_t* arrive;    // offset  8: this kernel's arrival counter, or null
    uint32_t wait_ctas;  // offset 16: CTAs of the previous kernel (its arrivals to wait for)
    uint32_t _pad;       // offset 20
};                       // size 24

// Called by every thread of the CTA where it would call griddep_wait. With a counter,
// thread 0 polls it with gpu-scope acquire loads until every CTA of the previous kernel
// has arrived (each after all of its writes), counts this CTA in, and the last CTA of
// this grid to pass zeroes it for the next replay; the barrier then orders the CTA's
// reads after the acquire. The previous kernel's CTAs are all resident or done by then:
// this grid launched only after each of them triggered (griddepcontrol.launch_dependents)
// or exited, so the poll cannot wait on a CTA that has no SM.
__device__ __forceinline__ void dep_wait(const Dep& d) {
    if (d.wait == nullptr) {
        griddep_wait();
        return;
    }
    if (threadIdx.x == 0) {
        uint32_t c;
        for (;;) {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(d.wait) : "memory");
            if (c >= d.wait_ctas) break;
        }
        if (atomicAdd(d.wait, 1u) == d.wait_ctas + gridDim.x - 1) atomicExch(d.wait, 0u);
    }
    __syncthreads();
}

// Called by every thread of the CTA when it is done (after its last global write): thread
// 0 releases the CTA's arrival, ordered after every thread's writes by the barrier.
__device__ __forceinline__ void dep_arrive(const Dep& d) {
    if (d.arrive == nullptr) return;
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(d.arrive), "r"(1u) : "memory");
}

}  // namespace cfp4
