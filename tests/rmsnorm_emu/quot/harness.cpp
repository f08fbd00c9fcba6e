// norm_quot (rmsnorm_math.cuh) against the IEEE division it replaces: bf16(s * norm_rcp(m))
// (or the division's fallback) must round to bf16(s / m) for every bf16 s (subnormals,
// infinities and NaN included) and every significand of m across the exponents where the
// reciprocal turns subnormal or infinite and where quotients turn subnormal, and for m
// zero, infinite, NaN or subnormal.
#include "rmsnorm_math.cuh"
#include <cmath>
#include <cstdio>
#include <vector>

int main() {
    const int exps[] = {-127, -126, -110, -101, -100, -99, -60, -20, -1, 0, 1, 7, 60, 99, 100, 101, 110, 126, 127};
    long checked = 0, differ = 0;
    // m = (1 + mant / 128) * 2^e, rounded to bf16 like norm_m's result; then zero,
    // infinity, NaN and two subnormals.
    std::vector<float> ms;
    for (int e : exps)
        for (uint32_t mant = 0; mant < 128; ++mant)
            ms.push_back(__bfloat162float(__float2bfloat16_rn(std::ldexp(1.0f + float(mant) / 128.0f, e))));
    for (float m : {0.0f, INFINITY, NAN, 0x1p-130f, 0x1p-149f}) ms.push_back(m);
    for (float m : ms) {
            const float rm = cfp4::norm_rcp(m);
            for (uint32_t bits = 0; bits < 65536; ++bits) {
                __nv_bfloat16 sb;
                sb.x = uint16_t(bits);
                const float s = __bfloat162float(sb);
                const uint16_t got = __float2bfloat16_rn(cfp4::norm_quot(s, m, rm)).x;
                const uint16_t want = __float2bfloat16_rn(__fdiv_rn(s, m)).x;
                const bool nan_both = (got & 0x7fff) > 0x7f80 && (want & 0x7fff) > 0x7f80;
                ++checked;
                if (got != want && !nan_both) {
                    if (++differ <= 5)
                        std::printf("s %#06x m %a: got %#06x want %#06x\n", bits, double(m), got, want);
                }
            }
    }
    std::printf("checked %ld, differ %ld\n", checked, differ);
    return differ == 0 ? 0 : 1;
}
