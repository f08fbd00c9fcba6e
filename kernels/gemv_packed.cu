// gemv_packed.cu: small-M (M <= 32) NVFP4 GEMV over weights repacked once at load
// (gemv_pack.cu packs them). y = epilogue(out_scale * x . W^T) on tensor cores, with
// the numerics of gemv.cu: exact bf16 weights e2m1 * e4m3 * 2^-8, FP32 accumulation,
// out_scale = global_scale * 2^8 on the accumulator, one rounding to bf16.
//
// Packed layout: gemv_packed_layout.cuh (made by gemv_pack.cu's packer; src/gemv/packed/layout.rs
// is the CPU reference).
//
// Work split: a CTA of WARPS warps serves one group (plain: one row tile; pair: row tiles
// 2i and 2i + 1; silu_mul: gate tile i and up tile half_pad/16 + i, so the epilogue has both) and one of `split` slices
// of K; its warps take contiguous runs of 128-wide K pairs (no predicates in the loop:
// padded rows, clamped token rows whose columns are dropped), keeping U pairs of weight
// loads in flight in registers (U per variant: the deep one for long per-warp runs).
// Warps meet in shared memory; with split > 1 each CTA
// writes its sum to `partial` and the last to arrive (a counter per group, reset by it)
// adds the slices in order (deterministic) and writes the output.
//
// Weight and scale loads of the first stages are issued before griddepcontrol.wait
// (programmatic dependent launch, sm_90+); x, partial and counters only after it. The
// dependents are released right after the wait, so the next kernel's CTAs do not take
// SM slots while this one still waits on its own predecessor.
//
// Norm variants (NORM): the RMSNorm in front of the layer runs in every CTA's prologue,
// so the decode step needs no norm kernel. x is then the residual stream [M, K]; each CTA
// reads it and delta (bf16 [M, K] contiguous, or null), forms s = bf16(x + delta) and the
// f32 sum of squares of each token row over all K, and keeps bf16 rows
// rms_norm(s) * norm_w (rmsnorm_math.cuh, the norm kernel's arithmetic) in dynamic shared
// memory ([M][K + 8]: the 16-byte pad puts the 8 token rows of one load on distinct banks),
// which the main loop reads instead of x. CTA 0 also writes s to `sum` (the residual
// stream after the add). Only the order of the sum of squares differs from the norm
// kernel's (a warp tree here, over another thread count).
//
// BF16 weights (the BW kernels, CFP4_PGEMV_BW): the same kernel over a BF16 weight in its
// natural layout, bf16 [N, K] row-major (silu_mul: [gate | up], N even), K a multiple of 64,
// 16-byte aligned rows: no packing and no scales (out_scale 1, `scales` unused, half_pad
// 0). A K step is one 64-wide chunk (npairs = K / 64 steps); row tile i is rows 16i ..
// 16i + 15 (silu: gate rows 16i + r and up rows N/2 + 16i + r), rows past the end clamped
// to the last one and their outputs dropped. Lane (g, t) reads rows g and g + 8 at k = 8t ..
// 8t + 7 and 32 + 8t .. 32 + 8t + 7 of each chunk: 16 bytes per load, so the 4 lanes of a
// row read 64 contiguous bytes (two whole 32-byte sectors) per instruction. The products
// of two bf16 are exact in FP32, so the numerics are the NVFP4 kernels': FP32
// accumulation, one rounding to bf16.
//
// Staged variants (plain, one token tile, one row tile per group): right after
// griddepcontrol.wait each warp copies the M rows of x over its own K run into the CTA's
// dynamic shared memory ([M][len + 8] bf16 over the CTA's K slice [128 s0, 128 s0 + len),
// len a multiple of 64) with cp.async, in two groups: the columns of its first U steps, then
// the rest. It waits for the first group only (and its warp, no CTA barrier: no warp reads
// another's columns) before its first MMAs, for the rest after its first U steps; the main
// loop reads x there with ld.shared instead of from L2. The launch gives M * (len + 8) * 2
// bytes (the planner's `staged_smem`).
#include <stdint.h>
#include <cuda_bf16.h>
#include "gemv_packed.cuh"
#include "gemv_common.cuh"
#include "nvfp4_decode.cuh"
#include "rmsnorm_math.cuh"
#include "gemv_packed_layout.cuh"

namespace {

// Warps per CTA: a launch parameter (blockDim.x = 32 * warps), at most MAX_WARPS (from
// PGEMV_WARPS of src/variants.rs, through the generated instances file).
#define CFP4_PGEMV_CONFIG
#include "gemv_packed_instances.inc"
#undef CFP4_PGEMV_CONFIG
constexpr int MAX_THREADS = MAX_WARPS * 32;
using cfp4::griddep_launch_dependents;
using cfp4::griddep_wait;
using cfp4::ld_stream_u32;
using cfp4::ld_stream_v4;
using cfp4::mma_bf16;

// Packed row tiles of the layer (both segments when N is even).
__device__ __forceinline__ int packed_tiles(const PackedGemvParams& p) {
    return p.half_pad ? p.half_pad / 8 : (p.n + 15) / 16;
}

// Where the main loop reads x: global memory, the normalized rows (norm variants) or the
// CTA's K slice of x copied into shared memory (staged variants); both of the latter in
// dynamic shared memory.
enum class XSrc { Global, Norm, Staged };

template <int NT, bool SILU, bool PAIR>
struct Cfg {
    // PAIR (plain, one token tile): each group is two adjacent row tiles, so one x
    // fragment feeds two tiles' MMAs.
    static_assert(!PAIR || (!SILU && NT == 1), "the pair kernels are plain, one token tile");
    static constexpr int TILES = (SILU || PAIR) ? 2 : 1;
    // Independent accumulator chains per (tile, token tile).
    static constexpr int SETS = NT * TILES == 1 ? 2 : 1;
};

// One K step of a warp's weights in registers: NVFP4, a 128-wide pair (two chunks of 64 k:
// 16 bytes of codes per chunk per lane, and the pair's scale word); BF16 weights (BW), one
// 64-wide chunk (rows g and g + 8, two 16-byte pieces each; no scales).
template <int NT, bool SILU, bool PAIR, bool BW>
struct Stage {
    uint4 w[Cfg<NT, SILU, PAIR>::TILES][BW ? 4 : 2];
    uint32_t s[Cfg<NT, SILU, PAIR>::TILES];
};

// 8 bf16 of x: from global memory (read-only path) or, in the norm variants, from the
// normalized rows in shared memory.
template <bool SMEM>
__device__ __forceinline__ uint4 load_x(const __nv_bfloat16* p) {
    if constexpr (SMEM) {
        return cfp4::ld_shared_v4(p);
    } else {
        return __ldg(reinterpret_cast<const uint4*>(p));
    }
}

// acc += chunk h of stage s (4 A fragments per tile) times x from `xo` elements past the
// token rows' cursors xr. Lane t's k of the chunk: NVFP4, 16t .. 16t + 15 (x at +0 and +8);
// BF16 weights, 8t .. 8t + 7 and 32 + 8t .. 32 + 8t + 7 (x at +0 and +32), so each 16-byte
// weight load of 8 rows reads 64 contiguous bytes of each row (whole 32-byte sectors).
template <int NT, bool SILU, bool PAIR, bool XS, bool BW>
__device__ __forceinline__ void compute_chunk(float (&acc)[Cfg<NT, SILU, PAIR>::TILES][NT][Cfg<NT, SILU, PAIR>::SETS][4],
                                              const Stage<NT, SILU, PAIR, BW>& s, int h, const __nv_bfloat16* const* xr, int xo) {
    constexpr int TILES = Cfg<NT, SILU, PAIR>::TILES, SETS = Cfg<NT, SILU, PAIR>::SETS;
    uint4 xv[NT][2];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        xv[j][0] = load_x<XS>(xr[j] + xo);
        xv[j][1] = load_x<XS>(xr[j] + xo + (BW ? 32 : 8));
    }
    if constexpr (BW) {
        // Word jw: k 8t + 4jw .. +3 (jw < 2) or 32 + 8t + 4(jw - 2) .. +3 of rows g (w[0..1])
        // and g + 8 (w[2..3]): the A fragment (r0 lo, r1 lo, r0 hi, r1 hi) as bf16 pairs.
#pragma unroll
        for (int ti = 0; ti < TILES; ++ti) {
            const uint4 r0a = s.w[ti][0], r0b = s.w[ti][1], r1a = s.w[ti][2], r1b = s.w[ti][3];
            const uint32_t a[4][4] = {{r0a.x, r1a.x, r0a.y, r1a.y},
                                      {r0a.z, r1a.z, r0a.w, r1a.w},
                                      {r0b.x, r1b.x, r0b.y, r1b.y},
                                      {r0b.z, r1b.z, r0b.w, r1b.w}};
#pragma unroll
            for (int jw = 0; jw < 4; ++jw)
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const uint4 xx = xv[j][jw >> 1];
                    const uint32_t b0 = (jw & 1) ? xx.z : xx.x, b1 = (jw & 1) ? xx.w : xx.y;
                    mma_bf16(acc[ti][j][jw % SETS], a[jw], b0, b1);
                }
        }
        return;
    }
#pragma unroll
    for (int ti = 0; ti < TILES; ++ti) {
        const uint32_t S = scale_regs(s.s[ti], h);
        const uint32_t sa = __byte_perm(S, 0, 0x1010), sb = __byte_perm(S, 0, 0x3232);
        const uint4 wv = s.w[ti][h];
        const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
        for (int jw = 0; jw < 4; ++jw) {
            uint32_t r[4];
            packed_word_pairs(words[jw], r);
            const uint32_t a[4] = {bf16x2_mul(r[0], sa), bf16x2_mul(r[1], sb), bf16x2_mul(r[2], sa),
                                   bf16x2_mul(r[3], sb)};
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const uint4 xx = xv[j][jw >> 1];
                const uint32_t b0 = (jw & 1) ? xx.z : xx.x, b1 = (jw & 1) ? xx.w : xx.y;
                mma_bf16(acc[ti][j][jw % SETS], a, b0, b1);
            }
        }
    }
}

// Sums the warps' accumulators through shared memory `red` ([warps][TILES][NT][32]
// float4), adds the K slices when split > 1 and writes the output with the epilogue.
template <int NT, bool SILU, bool PAIR>
__device__ __forceinline__ void pgemv_finish(const PackedGemvParams& p,
                                             const float (&acc)[Cfg<NT, SILU, PAIR>::TILES][NT][Cfg<NT, SILU, PAIR>::SETS][4],
                                             float4* red, int group, int slice) {
    using C = Cfg<NT, SILU, PAIR>;
    constexpr int TILES = C::TILES, SETS = C::SETS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const int g = lane >> 2, t = lane & 3;
    auto R = [&](int w, int ti, int j) -> float4& { return red[((w * TILES + ti) * NT + j) * 32 + lane]; };
#pragma unroll
    for (int ti = 0; ti < TILES; ++ti)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int q = 0; q < SETS; ++q) {
                v.x += acc[ti][j][q][0]; v.y += acc[ti][j][q][1]; v.z += acc[ti][j][q][2]; v.w += acc[ti][j][q][3];
            }
            R(warp, ti, j) = v;
        }
    __syncthreads();
    if (warp != 0) return;
    float4 tot[TILES][NT];
#pragma unroll
    for (int ti = 0; ti < TILES; ++ti)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            float4 s = R(0, ti, j);
#pragma unroll
            for (int w = 1; w < warps; ++w) {
                const float4 v = R(w, ti, j);
                s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
            }
            tot[ti][j] = s;
        }
    if (p.split > 1) {
        constexpr int PER = TILES * NT * 32;  // float4 per CTA slice
        float4* base = reinterpret_cast<float4*>(p.partial) + size_t(group) * p.split * PER;
#pragma unroll
        for (int ti = 0; ti < TILES; ++ti)
#pragma unroll
            for (int j = 0; j < NT; ++j) __stcg(base + size_t(slice) * PER + (ti * NT + j) * 32 + lane, tot[ti][j]);
        __threadfence();
        uint32_t prev = 0;
        if (lane == 0) prev = atomicAdd(p.counters + group, 1u);
        prev = __shfl_sync(0xffffffffu, prev, 0);
        if (prev != uint32_t(p.split - 1)) return;
        __threadfence();
#pragma unroll
        for (int ti = 0; ti < TILES; ++ti)
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
                for (int q = 0; q < p.split; ++q) {
                    const float4 v = __ldcg(base + size_t(q) * PER + (ti * NT + j) * 32 + lane);
                    s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
                }
                tot[ti][j] = s;
            }
        if (lane == 0) p.counters[group] = 0;  // ready for the next call
    }

    // tot[ti][j] in the mma C layout: (row g, tok 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int tok = 8 * j + 2 * t + e;
            if (tok >= p.m) continue;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float v0 = e == 0 ? (r == 0 ? tot[0][j].x : tot[0][j].z) : (r == 0 ? tot[0][j].y : tot[0][j].w);
                const int q = 16 * group + g + 8 * r;
                if (SILU) {
                    const int half = p.n / 2;
                    if (q >= half) continue;
                    const float v1 = e == 0 ? (r == 0 ? tot[TILES - 1][j].x : tot[TILES - 1][j].z)
                                            : (r == 0 ? tot[TILES - 1][j].y : tot[TILES - 1][j].w);
                    const float gate = __bfloat162float(__float2bfloat16_rn(v0 * p.out_scale));
                    const float up = __bfloat162float(__float2bfloat16_rn(v1 * p.out_scale));
                    const float silu = gate / (1.0f + expf(-gate));
                    out[size_t(tok) * half + q] = __float2bfloat16_rn(silu * up);
                } else {
                    // Plain: the group's tile; pair: tiles 2g and 2g + 1 (no partner past
                    // the last tile).
#pragma unroll
                    for (int ti = 0; ti < TILES; ++ti) {
                        const int tl = PAIR ? 2 * group + ti : group;
                        if (PAIR && tl >= packed_tiles(p)) continue;
                        const float4 v = tot[ti][j];
                        const float vv = e == 0 ? (r == 0 ? v.x : v.z) : (r == 0 ? v.y : v.w);
                        const int row = real_row(16 * tl + g + 8 * r, p.n, p.half_pad);
                        if (row >= 0) out[size_t(tok) * p.n + row] = __float2bfloat16_rn(vv * p.out_scale);
                    }
                }
            }
        }
    }
}

// cfp4::norm_one on the two bf16 of s2 with the two of w2 (low halves first), the same
// bits: the quotients s * rm (norm_quot's fast path, both checked at once) packed by one
// cvt, the weight by one bf16x2 multiply (a product of two bf16 is exact in f32, so its one
// rounding is norm_one's).
__device__ __forceinline__ uint32_t norm_two(uint32_t s2, float m, float rm, uint32_t w2) {
    const float s0 = __uint_as_float(s2 << 16), s1 = __uint_as_float(s2 & 0xffff0000u);
    float q0 = __fmul_rn(s0, rm), q1 = __fmul_rn(s1, rm);
    if (!(cfp4::norm_quot_fast(q0) && cfp4::norm_quot_fast(q1))) {
        q0 = cfp4::norm_quot(s0, m, rm);
        q1 = cfp4::norm_quot(s1, m, rm);
    }
    return bf16x2_mul(cfp4::pack_bf16x2_rn(q0, q1), w2);
}

// Norm variants: the normalized token rows into xs ([m][k + 8] bf16), CTA 0 writing the
// sums x + delta; ends with a barrier. Called after griddep_wait by every thread; nw0 is
// this thread's first 8 norm weights, loaded before the wait (no kernel writes them). Rows go
// two at a time (4 loads in flight per thread, few registers beside the weight stages
// already in flight).
template <int NT>
__device__ __forceinline__ void norm_prologue(const PackedGemvParams& p, __nv_bfloat16* __restrict__ xs, uint4 nw0) {
    constexpr int ROWS = 8 * NT, RB = 2;
    __shared__ float part[MAX_WARPS][ROWS];
    __shared__ float mrow[ROWS], rrow[ROWS];  // m and norm_rcp(m) per token
    const int tid = threadIdx.x, nth = blockDim.x, lane = tid & 31, warp = tid >> 5;
    const int nv = p.k / 8, ld = p.k + 8;
    const __nv_bfloat16* __restrict__ x = static_cast<const __nv_bfloat16*>(p.x);
    const __nv_bfloat16* __restrict__ d = static_cast<const __nv_bfloat16*>(p.delta);
    __nv_bfloat16* __restrict__ sum = static_cast<__nv_bfloat16*>(p.sum);
    const bool write_sum = d != nullptr && blockIdx.x == 0;
    for (int r0 = 0; r0 < p.m; r0 += RB) {
        float acc[RB] = {0.f, 0.f};
        for (int v = tid; v < nv; v += nth) {
            uint4 xv[RB], dv[RB];
#pragma unroll
            for (int i = 0; i < RB; ++i)
                if (r0 + i < p.m) {
                    xv[i] = *reinterpret_cast<const uint4*>(x + size_t(r0 + i) * p.x_stride + 8 * v);
                    if (d) dv[i] = *reinterpret_cast<const uint4*>(d + size_t(r0 + i) * p.k + 8 * v);
                }
#pragma unroll
            for (int i = 0; i < RB; ++i)
                if (r0 + i < p.m) {
                    __nv_bfloat16* s = reinterpret_cast<__nv_bfloat16*>(&xv[i]);
                    if (d) {
                        const __nv_bfloat16* dd = reinterpret_cast<const __nv_bfloat16*>(&dv[i]);
#pragma unroll
                        for (int j = 0; j < 8; ++j) s[j] = __hadd_rn(s[j], dd[j]);
                        if (write_sum) *reinterpret_cast<uint4*>(sum + size_t(r0 + i) * p.k + 8 * v) = xv[i];
                    }
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[i] = cfp4::add_square(acc[i], __bfloat162float(s[j]));
                    *reinterpret_cast<uint4*>(xs + (r0 + i) * ld + 8 * v) = xv[i];
                }
        }
#pragma unroll
        for (int i = 0; i < RB; ++i) {
            float a = acc[i];
            for (int o = 16; o > 0; o >>= 1) a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, o));
            if (lane == 0 && r0 + i < ROWS) part[warp][r0 + i] = a;
        }
    }
    __syncthreads();
    if (tid < p.m) {
        float tot = 0.f;
        for (int w = 0; w < nth / 32; ++w) tot = __fadd_rn(tot, part[w][tid]);
        mrow[tid] = cfp4::norm_m(tot, p.k, p.eps);
        rrow[tid] = cfp4::norm_rcp(mrow[tid]);
    }
    __syncthreads();
    const __nv_bfloat16* __restrict__ nw = static_cast<const __nv_bfloat16*>(p.norm_w);
    for (int v = tid; v < nv; v += nth) {
        const uint4 wv = v == tid ? nw0 : __ldg(reinterpret_cast<const uint4*>(nw) + v);
        const uint32_t ww[4] = {wv.x, wv.y, wv.z, wv.w};
        for (int r = 0; r < p.m; ++r) {
            uint4* q = reinterpret_cast<uint4*>(xs + r * ld + 8 * v);
            const uint4 sv = *q;
            const uint32_t ss[4] = {sv.x, sv.y, sv.z, sv.w};
            const float m = mrow[r], rm = rrow[r];
            uint32_t o[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) o[j] = norm_two(ss[j], m, rm, ww[j]);
            *q = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
    __syncthreads();
}

// Staged variants: one warp's part of the m token rows of x, columns [c0, c1) of the CTA's
// slice starting at K k0, into xs ([m][ld] bf16), 16 bytes per cp.async by the warp's lanes,
// as one committed cp.async group. Called after griddep_wait (x is written by the previous
// kernel); the caller waits for the group (cp_async_wait_group) and the warp (__syncwarp).
__device__ __forceinline__ void stage_x_cols(const PackedGemvParams& p, __nv_bfloat16* __restrict__ xs, int ld,
                                             int k0, int c0, int c1) {
    const int pieces = max(0, c1 - c0) / 8, lane = threadIdx.x & 31;
    const __nv_bfloat16* __restrict__ x = static_cast<const __nv_bfloat16*>(p.x);
    for (int i = lane; i < p.m * pieces; i += 32) {
        const int r = i / pieces, c = c0 + 8 * (i - r * pieces);
        cfp4::cp_async_16(xs + r * ld + c, x + size_t(r) * p.x_stride + k0 + c);
    }
    cfp4::cp_async_commit();
}

#include "gemv_packed_timeline.cuh"  // tl_stamp: the harnesses' per-warp timeline

// U: K steps in flight per warp in registers (a variant parameter, src/variants.rs): NVFP4
// pairs (1 KB of codes per tile), or with BW (BF16 weights [N, K], "BF16 weights" at the
// top) 64-wide chunks (2 KB per tile).
template <int NT, bool SILU, int U, XSrc XS, bool PAIR, bool BW>
__device__ __forceinline__ void pgemv(const PackedGemvParams& p) {
    static_assert(XS != XSrc::Staged || (NT == 1 && !SILU && !PAIR), "the staged kernels are plain, one tile");
    static_assert(!BW || XS != XSrc::Norm, "no norm prologue on BF16 weights");
    constexpr bool NORM = XS == XSrc::Norm;
    constexpr int STEP = BW ? 64 : 128;  // K per step
    using C = Cfg<NT, SILU, PAIR>;
    constexpr int TILES = C::TILES, SETS = C::SETS;
    __shared__ float4 red[MAX_WARPS][TILES][NT][32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const int g = lane >> 2, t = lane & 3;
    const int group = int(blockIdx.x) / p.split, slice = int(blockIdx.x) % p.split;
    const int per_slice = (p.npairs + p.split - 1) / p.split;
    const int s0 = min(slice * per_slice, p.npairs), s1 = min(s0 + per_slice, p.npairs);
    const int per_warp = (s1 - s0 + warps - 1) / warps;
    const int w0 = min(s0 + warp * per_warp, s1), w1 = min(w0 + per_warp, s1);
    const int np = w1 - w0;
    const int nchunks = p.k / 64;
    tl_stamp(p, 0);

    // Cursors at this warp's first step; the loop advances them by U steps.
    const uint8_t* wp[TILES];  // NVFP4: the codes; BW: row g
    const uint32_t* sp[TILES];  // NVFP4: the scale words
    const uint8_t* wq[TILES];   // BW: row g + 8
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
        if constexpr (BW) {
            // Rows past N (or past the gate half) read a valid row; their outputs are dropped.
            const int half = p.n / 2;
            const int r0 = PAIR ? 16 * min(2 * group + i, packed_tiles(p) - 1) : 16 * group;
            const int lim = SILU ? half : p.n, base = (SILU && i == 1) ? half : 0;
            const int ra = base + min(r0 + g, lim - 1), rb = base + min(r0 + g + 8, lim - 1);
            wp[i] = p.w + (size_t(ra) * size_t(p.k) + size_t(STEP) * size_t(w0) + size_t(8 * t)) * 2;
            wq[i] = p.w + (size_t(rb) * size_t(p.k) + size_t(STEP) * size_t(w0) + size_t(8 * t)) * 2;
            sp[i] = nullptr;
        } else {
            // Pair: tiles 2g and 2g + 1 (an odd last tile computed twice, written once).
            const size_t tile = PAIR ? size_t(min(2 * group + i, packed_tiles(p) - 1))
                                     : size_t(i == 0 ? group : p.half_pad / 16 + group);
            wp[i] = p.w + ((tile * size_t(2 * p.npairs) + size_t(2 * w0)) * 32 + lane) * 16;
            sp[i] = p.scales + (tile * size_t(p.npairs) + size_t(w0)) * 32 + lane;
            wq[i] = nullptr;
        }
    }
    // Stage u of the pipeline from step `i` past the cursors.
    auto load = [&](Stage<NT, SILU, PAIR, BW>& st, int i) {
#pragma unroll
        for (int ti = 0; ti < TILES; ++ti) {
            if constexpr (BW) {
                st.w[ti][0] = ld_stream_v4(wp[ti] + i * 128);
                st.w[ti][1] = ld_stream_v4(wp[ti] + i * 128 + 64);
                st.w[ti][2] = ld_stream_v4(wq[ti] + i * 128);
                st.w[ti][3] = ld_stream_v4(wq[ti] + i * 128 + 64);
            } else {
                st.w[ti][0] = ld_stream_v4(wp[ti] + i * 1024);
                st.w[ti][1] = ld_stream_v4(wp[ti] + i * 1024 + 512);
                st.s[ti] = ld_stream_u32(sp[ti] + i * 32);
            }
        }
    };

    Stage<NT, SILU, PAIR, BW> st[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (u < np) load(st[u], u);
    uint4 nw0 = make_uint4(0, 0, 0, 0);
    if constexpr (NORM) {
        if (int(threadIdx.x) < p.k / 8) nw0 = __ldg(static_cast<const uint4*>(p.norm_w) + threadIdx.x);
    }
    griddep_wait();  // x is written by the previous kernel
    tl_stamp(p, 1);
    // The trigger after the wait, not at the start: measured on the H100 (twenty-fifth
    // session, docs/logs/s25/), 5 to 13 µs less per decode step on every row.
    griddep_launch_dependents();

    const __nv_bfloat16* xb = static_cast<const __nv_bfloat16*>(p.x);
    size_t xstride = size_t(p.x_stride);
    if constexpr (NORM) {
        extern __shared__ __align__(16) unsigned char pgemv_dyn[];
        __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(pgemv_dyn);
        norm_prologue<NT>(p, xs, nw0);
        xb = xs;
        xstride = size_t(p.k + 8);
    }
    int xcol = STEP * w0;  // this warp's first x column in xb
    if constexpr (XS == XSrc::Staged) {
        // This warp's columns of the CTA's slice: its first U steps' first, then the rest
        // (waited for after the first U steps, below); only the first group before its MMAs.
        extern __shared__ __align__(16) unsigned char pgemv_dyn[];
        __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(pgemv_dyn);
        const int k0 = STEP * s0, len = max(0, min(STEP * (s1 - s0), p.k - k0));
        const int c0 = STEP * (w0 - s0), c1 = min(STEP * (w1 - s0), len), cu = min(c0 + STEP * U, c1);
        stage_x_cols(p, xs, len + 8, k0, c0, cu);
        stage_x_cols(p, xs, len + 8, k0, cu, c1);
        cfp4::cp_async_wait_group<1>();
        __syncwarp();
        xb = xs;
        xstride = size_t(len + 8);
        xcol = c0;
    }
    const __nv_bfloat16* xr[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) xr[j] = xb + size_t(min(g + 8 * j, p.m - 1)) * xstride + xcol + (BW ? 8 : 16) * t;

    float acc[TILES][NT][SETS][4];
#pragma unroll
    for (int ti = 0; ti < TILES; ++ti)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int q = 0; q < SETS; ++q) acc[ti][j][q][0] = acc[ti][j][q][1] = acc[ti][j][q][2] = acc[ti][j][q][3] = 0.f;

#ifdef CFP4_PGEMV_TIMELINE
    bool first_chunk = true;
#endif
    auto compute = [&](const Stage<NT, SILU, PAIR, BW>& s, int h, int xo) {
        compute_chunk<NT, SILU, PAIR, XS != XSrc::Global, BW>(acc, s, h, xr, xo);
#ifdef CFP4_PGEMV_TIMELINE
        if (first_chunk) {
            // The stamp waits for the chunk's MMAs (they read the loaded stage).
            asm volatile("" ::: "memory");
            if (acc[0][0][0][0] != 12345.f) tl_stamp(p, 2);
            first_chunk = false;
        }
#endif
    };
    auto advance = [&]() {
#pragma unroll
        for (int ti = 0; ti < TILES; ++ti) {
            if constexpr (BW) {
                wp[ti] += U * 128;
                wq[ti] += U * 128;
            } else {
                wp[ti] += U * 1024;
                sp[ti] += U * 32;
            }
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) xr[j] += U * STEP;
    };

    // NVFP4: the warp's last pair has one chunk when it ends an odd K / 64. BW: one chunk
    // per step.
    const int full = BW ? 0 : (w1 == p.npairs && (nchunks & 1)) ? np - 1 : np;
    int i0 = 0;
    // Staged: x past the first U steps (the second cp.async group) before they are read.
    auto staged_rest = [&]() {
        if constexpr (XS == XSrc::Staged) {
            cfp4::cp_async_wait_all();
            __syncwarp();
        }
    };
    for (; i0 + U <= np; i0 += U) {
        if (i0 == U) staged_rest();
#pragma unroll
        for (int u = 0; u < U; ++u) {
            compute(st[u], 0, STEP * u);
            if (i0 + u < full) compute(st[u], 1, STEP * u + 64);
            if (i0 + u + U < np) load(st[u], u + U);
        }
        advance();
    }
    staged_rest();
#pragma unroll
    for (int u = 0; u < U - 1; ++u) {
        if (i0 + u < np) {
            compute(st[u], 0, STEP * u);
            if (i0 + u < full) compute(st[u], 1, STEP * u + 64);
        }
    }

#ifdef CFP4_PGEMV_TIMELINE
    if (acc[0][0][0][0] != 12345.f) tl_stamp(p, 3);  // after the last MMAs
#endif
    pgemv_finish<NT, SILU, PAIR>(p, acc, &red[0][0][0][0], group, slice);
    tl_stamp(p, 4);
}

}  // namespace

// Register caps without spills (ptxas -v): 16 warps per SM (8 for the widest variant).
constexpr int pgemv_min_blocks(int nt, bool silu) { return nt * (silu ? 2 : 1) >= 8 ? 1 : 2; }

// XS: Global, Norm or Staged (XSrc).
#define CFP4_PGEMV(NT, SILU, U, XS, NAME)                                                                  \
    extern "C" __global__ void __launch_bounds__(MAX_THREADS, pgemv_min_blocks(NT, SILU)) NAME(const __grid_constant__ PackedGemvParams p) { \
        pgemv<NT, SILU, U, XSrc::XS, false, false>(p);                                                     \
    }
// Plain, one token tile, two row tiles per group (groups = ceil(tiles / 2)).
#define CFP4_PGEMV_PAIR(U, NAME)                                                                           \
    extern "C" __global__ void __launch_bounds__(MAX_THREADS, 2) NAME(const __grid_constant__ PackedGemvParams p) { \
        pgemv<1, false, U, XSrc::Global, true, false>(p);                                                         \
    }
// BF16 weights (natural [N, K] layout): PAIR true for two row tiles per group (plain).
#define CFP4_PGEMV_BW(NT, SILU, PAIR, U, XS, NAME)                                                         \
    extern "C" __global__ void __launch_bounds__(MAX_THREADS, pgemv_min_blocks(NT, SILU || PAIR)) NAME(const __grid_constant__ PackedGemvParams p) { \
        pgemv<NT, SILU, U, XSrc::XS, PAIR, true>(p);                                                       \
    }

// Every variant of src/variants.rs (generated by build.rs).
#include "gemv_packed_instances.inc"

#ifdef CFP4_PGEMV_TIMELINE
// Host side of the diagnostic (harness builds only): where the stamps go (null: off).
void cfp4_pgemv_set_timeline(unsigned long long* p) { cudaMemcpyToSymbol(cfp4_pgemv_timeline, &p, sizeof p); }
// The chain's keys (output pointers, at most 8; n = 0: none) and the records per key.
void cfp4_pgemv_set_timeline_keys(const void* const* keys, int n, unsigned long long stride) {
    cudaMemcpyToSymbol(cfp4_pgemv_tl_keys, keys, sizeof(void*) * size_t(n < 8 ? n : 8));
    const int nk = n < 8 ? n : 8;
    cudaMemcpyToSymbol(cfp4_pgemv_tl_nkeys, &nk, sizeof nk);
    cudaMemcpyToSymbol(cfp4_pgemv_tl_stride, &stride, sizeof stride);
}
#endif
