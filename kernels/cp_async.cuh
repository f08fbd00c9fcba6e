// cp_async.cuh: the cp.async wrappers of every kernel family (the GEMVs' staged x copy in
// gemv_packed.cu, the KV attention's slot pipeline in kv_attention.cu): 16-byte
// global -> shared copies through L2 only (.cg), their groups and waits. A copy is visible
// to its own thread after the wait that covers it, to other threads after that wait and a
// barrier. The host emulations (CFP4_HOST_EMU) bring their own by the same semantics
// (tests/emu_common/cp_async_emu.h: a thread's copies land at its wait).
#pragma once
#include <stdint.h>

namespace cfp4 {
#ifndef CFP4_HOST_EMU
// 16 bytes global -> shared, asynchronously.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(gmem) : "memory");
}

// 16 bytes to shared: the first src_bytes read from gmem, the rest zero (src_bytes = 0
// zero-fills without reading gmem).
__device__ __forceinline__ void cp_async_16_zfill(void* smem, const void* gmem, uint32_t src_bytes) {
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(gmem), "r"(src_bytes) : "memory");
}

// Closes this thread's current group of copies.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Waits for every copy of this thread, committed or not.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
#endif  // CFP4_HOST_EMU
}  // namespace cfp4
