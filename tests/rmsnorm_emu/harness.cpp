// Host emulation harness of kernels/rmsnorm.cu (driven by tests/rmsnorm_emu.rs): for each
// case directory in cases.txt, reads params.txt (rows, n, eps, vec, delta?, extra CTAs)
// and x.bin, delta.bin, w.bin, runs cfp4_add_rmsnorm over rows + extra CTAs, and writes
// sum.bin and out.bin (both poisoned first) for the Rust test to compare with the CPU.
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>
#include "emu.h"
#include "rmsnorm_emu.cu"

int main() {
    return emu_cases([](const std::string& dir, std::ifstream& pf) {
        long rows, n, extra;
        float eps;
        int vec, has_delta;
        pf >> rows >> n >> eps >> vec >> has_delta >> extra;
        if (const int rc = emu_bad_params(pf, dir)) return rc;
        std::vector<uint8_t> x = emu_read(dir + "/x.bin"), w = emu_read(dir + "/w.bin"), d;
        if (has_delta) d = emu_read(dir + "/delta.bin");
        std::vector<uint16_t> sum(size_t(rows * n), 0x7fa5), out(size_t(rows * n), 0x7fa5);
        AddRmsNormParams p{};
        p.x = x.data();
        p.delta = has_delta ? d.data() : nullptr;
        p.weight = w.data();
        p.sum = sum.data();
        p.out = out.data();
        p.rows = int(rows); p.n = int(n); p.eps = eps; p.vec = vec;
        dim3 g; g.x = unsigned(rows + extra);
        emu_launch(cfp4_add_rmsnorm, g, NORM_THREADS, 0, p);
        emu_write(dir + "/sum.bin", sum.data(), sum.size() * 2);
        emu_write(dir + "/out.bin", out.data(), out.size() * 2);
        return 0;
    });
}
