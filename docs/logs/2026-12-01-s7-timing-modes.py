# Applies a timing-only mode to kernels/ultraquant.cu (per-head kernel). MODE 2: math only
# (no copies; stage buffers zeroed once); MODE 3: math only and no E2M1 decode (raw code
# words go into the MMAs).
import sys
mode=int(sys.argv[1])
p='kernels/ultraquant.cu'
s=open(p).read()
s=s.replace("namespace {\n","namespace {\n#define CFP4_KV_TIMING %d\n"%mode,1)
old="            if (s < cnt) issue(stages + s * C::STAGE, s);"
assert old in s
s=s.replace(old,"            if (s < cnt && CFP4_KV_TIMING < 2) issue(stages + s * C::STAGE, s);",1)
old="            if (nx < cnt) issue(stages + (nx % C::NSTAGE) * C::STAGE, nx);"
assert old in s
s=s.replace(old,"            if (nx < cnt && CFP4_KV_TIMING < 2) issue(stages + (nx % C::NSTAGE) * C::STAGE, nx);",1)
# zero the stage buffers once in math-only modes (before the query prep's __syncthreads)
old="    // Queries of this CTA's heads (zeros past the group), rotated like K for UltraQuant."
assert old in s
s=s.replace(old,"""    if (CFP4_KV_TIMING >= 2 && !ROWS) {
        for (int i = threadIdx.x; i < C::NW * C::NSTAGE * C::STAGE / 16; i += C::THREADS)
            reinterpret_cast<uint4*>(smem)[i] = make_uint4(0u, 0u, 0u, 0u);
    }
"""+old,1)
if mode==3:
    for a,b in [("e2m1_raw_pairs<true>(lds32<4>(rg + 4 * (t + 4 * w)), a0);","{ const uint32_t w_ = lds32<4>(rg + 4 * (t + 4 * w)); a0[0] = w_; a0[1] = w_ ^ 1u; a0[2] = w_ ^ 2u; a0[3] = w_ ^ 3u; }"),
                ("e2m1_raw_pairs<true>(lds32<4>(rg8 + 4 * (t + 4 * w)), a1);","{ const uint32_t w_ = lds32<4>(rg8 + 4 * (t + 4 * w)); a1[0] = w_; a1[1] = w_ ^ 1u; a1[2] = w_ ^ 2u; a1[3] = w_ ^ 3u; }"),
                ("e2m1_raw_pairs<true>(pack_u16(ha, hb), ab);","{ const uint32_t w_ = pack_u16(ha, hb); ab[0] = w_; ab[1] = w_ ^ 1u; ab[2] = w_ ^ 2u; ab[3] = w_ ^ 3u; }"),
                ("e2m1_raw_pairs<true>(pack_u16(hc, hd), cd);","{ const uint32_t w_ = pack_u16(hc, hd); cd[0] = w_; cd[1] = w_ ^ 1u; cd[2] = w_ ^ 2u; cd[3] = w_ ^ 3u; }")]:
        assert a in s; s=s.replace(a,b,1)
open(p,'w').write(s)
