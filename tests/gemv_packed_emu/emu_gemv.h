// Host stand-ins for what kernels/gemv_packed.cu uses beyond tests/kv_cache_emu/emu.h
// (included after it, driven by tests/gemv_packed_emu.rs): the vector types, the read-only
// and L2-only loads and stores as plain memory accesses (float4 and its __ldcg are emu.h's),
// the funnel shift, the IEEE intrinsics, and the PTX wrappers of kernels/gemv_common.cuh
// (CFP4_HOST_EMU drops the device ones) by their PTX semantics: the loads read, cp.async copies land at the thread's wait, mma_bf16 is
// emu.h's (FP32 accumulation in k order, not the tensor cores' order).
#pragma once
#define CFP4_HOST_EMU 1
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>
#include <cmath>

struct alignas(8) uint2 { uint32_t x, y; };
inline uint32_t __funnelshift_r(uint32_t lo, uint32_t hi, uint32_t s) {
    const uint64_t v = (uint64_t(hi) << 32) | lo;
    return uint32_t(v >> (s & 31));
}
template <class T> inline T __ldg(const T* p) { return *p; }
inline void __stcg(float4* p, float4 v) { *p = v; }
inline uint32_t __cvta_generic_to_shared(const void* p) { return uint32_t(reinterpret_cast<uintptr_t>(p)); }

namespace cfp4 {
inline uint4 ld_stream_v4(const void* p) { uint4 v; std::memcpy(&v, p, 16); return v; }
inline uint2 ld_stream_v2(const void* p) { uint2 v; std::memcpy(&v, p, 8); return v; }
inline uint32_t ld_stream_u32(const void* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline uint4 ld_shared_v4(const void* p) { uint4 v; std::memcpy(&v, p, 16); return v; }
// cp.async as the hardware may do it: a thread's copies land only when it waits for them
// (its committed groups in order), so a read before the wait (or of another lane's copy
// before the warp's barrier) sees the launch's garbage shared memory.
struct CpAsyncQueue {
    std::vector<std::pair<void*, const void*>> copies;  // issued, not yet landed
    std::vector<size_t> group_ends;                     // end of each committed group
};
inline thread_local CpAsyncQueue t_cp_async;
inline void cp_async_land(size_t n) {
    auto& q = t_cp_async;
    for (size_t i = 0; i < n; ++i) std::memcpy(q.copies[i].first, q.copies[i].second, 16);
    q.copies.erase(q.copies.begin(), q.copies.begin() + long(n));
    std::vector<size_t> ends;
    for (size_t e : q.group_ends)
        if (e > n) ends.push_back(e - n);
    q.group_ends = ends;
}
inline void cp_async_16(void* smem, const void* gmem) { t_cp_async.copies.emplace_back(smem, gmem); }
inline void cp_async_commit() { t_cp_async.group_ends.push_back(t_cp_async.copies.size()); }
inline void cp_async_wait_all() { cp_async_land(t_cp_async.copies.size()); }
template <int N>
inline void cp_async_wait_group() {
    const auto& e = t_cp_async.group_ends;
    if (e.size() > size_t(N)) cp_async_land(e[e.size() - 1 - N]);
}
inline uint32_t pack_bf16x2_rn(float lo, float hi) {
    return uint32_t(__float2bfloat16_rn(lo).x) | (uint32_t(__float2bfloat16_rn(hi).x) << 16);
}
using ::mma_bf16;
}  // namespace cfp4
