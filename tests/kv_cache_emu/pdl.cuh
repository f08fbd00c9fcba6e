// The host emulation's kernels/pdl.cuh: the arrival-counter block the attention and
// combine kernels take (cfp4::Dep), always null here (no graph, one launch at a time), so
// dep_wait is the emulated griddepcontrol.wait (nothing) and dep_arrive nothing.
#pragma once
#include <stdint.h>

namespace cfp4 {
struct Dep {
    uint32_t* wait;
    uint32_t* arrive;
    uint32_t wait_ctas;
    uint32_t _pad;
};
inline void dep_wait(const Dep&) {}
inline void dep_arrive(const Dep&) {}
}  // namespace cfp4
