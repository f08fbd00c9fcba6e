// Host stand-ins for kernels/cp_async.cuh (which CFP4_HOST_EMU empties), by the PTX
// semantics as the hardware may realise them: a thread's copies land only when it waits for
// them (its committed groups in order, or all at wait_all), so a read before the wait, or of
// another thread's copy before that thread's wait and a barrier, sees whatever the shared
// memory held before. Forced into every emulator build by tests/kv_cache_emu/emu.h.
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>

namespace cfp4 {
struct CpAsyncCopy {
    void* dst;
    const void* src;
    uint32_t src_bytes;  // the rest of the 16 bytes zero-filled
};
struct CpAsyncQueue {
    std::vector<CpAsyncCopy> copies;  // issued, not yet landed
    std::vector<size_t> group_ends;   // end of each committed group in `copies`
};
inline thread_local CpAsyncQueue t_cp_async;
// Lands the first n copies of this thread.
inline void cp_async_land(size_t n) {
    auto& q = t_cp_async;
    for (size_t i = 0; i < n; ++i) {
        const CpAsyncCopy& c = q.copies[i];
        std::memset(c.dst, 0, 16);
        if (c.src_bytes) std::memcpy(c.dst, c.src, c.src_bytes);
    }
    q.copies.erase(q.copies.begin(), q.copies.begin() + long(n));
    std::vector<size_t> ends;
    for (size_t e : q.group_ends)
        if (e > n) ends.push_back(e - n);
    q.group_ends = ends;
}
inline void cp_async_16(void* smem, const void* gmem) { t_cp_async.copies.push_back({smem, gmem, 16}); }
inline void cp_async_16_zfill(void* smem, const void* gmem, uint32_t src_bytes) {
    t_cp_async.copies.push_back({smem, gmem, src_bytes});
}
inline void cp_async_commit() { t_cp_async.group_ends.push_back(t_cp_async.copies.size()); }
inline void cp_async_wait_all() { cp_async_land(t_cp_async.copies.size()); }
template <int N>
inline void cp_async_wait_group() {
    const auto& e = t_cp_async.group_ends;
    if (e.size() > size_t(N)) cp_async_land(e[e.size() - 1 - N]);
}
}  // namespace cfp4
