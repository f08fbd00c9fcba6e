// pdl.cuh: programmatic dependent launch for every kernel family (GEMVs, RMSNorm, greedy
// argmax, and the KV-cache kernels through kv_common.cuh).
#pragma once

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

}  // namespace cfp4
