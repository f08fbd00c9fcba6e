// Host emulation harness of kernels/gemv_packed.cu (driven by tests/gemv_packed_emu.rs):
// for each case directory the Rust test wrote (cases.txt: one per line), reads the kernel's
// name, launch and scalar parameters (params.txt) and its input buffers (*.bin), runs the
// kernel under emu.h, and writes what it produced (out.bin) for the Rust test to compare
// with the CPU.
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>
#include "emu.h"
#include "emu_gemv.h"
#include "gemv_packed_emu.cu"

// Every kernel of the instances file, by name (registry.inc is written by the Rust test
// from the same variant lists).
static const std::map<std::string, void (*)(PackedGemvParams)> kKernels = {
#include "registry.inc"
};

int main() {
    return emu_cases([](const std::string& dir, std::ifstream& pf) {
        std::string name;
        long grid, block, smem, out_elems, partial_floats, m, n, k, x_stride, half_pad, groups, split, npairs;
        float out_scale, eps;
        int has_delta, has_norm;
        pf >> name >> grid >> block >> smem >> out_elems >> partial_floats >> m >> n >> k >> x_stride >> half_pad >> groups >>
            split >> npairs >> out_scale >> eps >> has_delta >> has_norm;
        if (const int rc = emu_bad_params(pf, dir)) return rc;
        auto it = kKernels.find(name);
        if (it == kKernels.end()) { std::fprintf(stderr, "%s: no kernel %s\n", dir.c_str(), name.c_str()); return 2; }
        std::vector<uint8_t> w = emu_read(dir + "/w.bin"), s = emu_read(dir + "/scales.bin"), x = emu_read(dir + "/x.bin");
        std::vector<uint8_t> delta, norm_w;
        if (has_delta) delta = emu_read(dir + "/delta.bin");
        if (has_norm) norm_w = emu_read(dir + "/norm_w.bin");
        // Poisoned outputs: every element the kernel must write is checked by the Rust test.
        std::vector<uint16_t> out(size_t(out_elems), 0x7fa5);
        std::vector<float> partial(size_t(partial_floats > 0 ? partial_floats : 4), std::nanf(""));
        std::vector<uint32_t> counters(size_t(groups), 0u);
        const long sums = has_delta ? m * k : 0;
        PackedGemvParams p{};
        p.w = w.data();
        p.scales = reinterpret_cast<const uint32_t*>(s.data());
        p.x = x.data();
        p.out = out.data() + sums;
        p.partial = partial.data();
        p.counters = counters.data();
        p.out_scale = out_scale;
        p.m = int(m); p.n = int(n); p.k = int(k); p.x_stride = int(x_stride); p.half_pad = int(half_pad);
        p.groups = int(groups); p.split = int(split); p.npairs = int(npairs);
        p.delta = has_delta ? delta.data() : nullptr;
        p.norm_w = has_norm ? norm_w.data() : nullptr;
        p.sum = has_delta ? out.data() : nullptr;
        p.eps = eps;
        dim3 g; g.x = unsigned(grid);
        emu_launch(it->second, g, unsigned(block), size_t(smem), p);
        for (long i = 0; i < groups; ++i)
            if (counters[size_t(i)] != 0) { std::fprintf(stderr, "%s: counter %ld left at %u\n", dir.c_str(), i, counters[size_t(i)]); return 3; }
        emu_write(dir + "/out.bin", out.data(), out.size() * 2);
        return 0;
    });
}
