// gemv_packed.cu: small-M (M <= 32) NVFP4 GEMV over weights repacked once at load, its
// packer and its dequantizer. y = epilogue(out_scale * x . W^T) on tensor cores, with
// the numerics of gemv.cu: exact bf16 weights e2m1 * e4m3 * 2^-8, FP32 accumulation,
// out_scale = global_scale * 2^8 on the accumulator, one rounding to bf16.
//
// Packed layout (made here by cfp4_pack_codes / cfp4_pack_scales from the ModelOpt
// layout: codes uint8 [N, K/2], low nibble = even k; E4M3 scales per 16 k, 128x4-swizzled;
// src/gemv/packed.rs is the CPU reference of both):
//   Packed rows: N padded to 16-row tiles; when N is even, in two segments of
//   half_pad = round_up(N/2, 16) rows (packed row p < half_pad is row p, else row
//   N/2 + p - half_pad), so the gate and up halves of a [gate | up] layer start on tile
//   bounds. Padding rows are zero codes with zero scales.
//   Codes: [tile][chunk c < 2*npairs][lane][16 bytes], chunk c = k 64c .. 64c+63 (chunks
//   past K are zero). Lane (g = lane/4, t = lane%4) holds rows r0 = 16*tile + g and
//   r1 = r0 + 8 at k = 64c + 16t .. +15 as 4 words; word j holds kj .. kj+3
//   (kj = 64c + 16t + 4j) of both rows, its bits placed so that packed_word_pairs
//   (nvfp4_decode.cuh: 2 integer ops per pair on the software path; bytes through the
//   E2M1 convert on sm_100a) yields the mma.m16n8k16 A fragment in order:
//   out[0] = r0 (kj, kj+1), out[1] = r1 (kj, kj+1), out[2] = r0 (kj+2, kj+3),
//   out[3] = r1 (kj+2, kj+3). The MMA's k order is free as long as x agrees: lane t's x
//   for word j is x[kj .. kj+3], natural bf16 pairs (no permute).
//   Scales: [tile][pair p < npairs][lane][u32], pair p = chunks 2p, 2p+1. Lane t's 16 k of
//   a chunk are exactly one 16-block, so a lane needs one scale per row per chunk; the
//   word packs four bytes T: bits 4..11 T(r0, 2p), 20..27 T(r1, 2p), 12..19 T(r0, 2p+1),
//   and T(r1, 2p+1) low nibble at 28..31, high nibble at 0..3. Then
//   (w & 0x0ff00ff0) | base and (rotr(w, 8) & 0x0ff00ff0) | base (chunk 2p+1) are the
//   bf16x2 (s(r0), s(r1)) = e4m3 * 2^(kRawLog2 - 8): T = ((E - kTBase) << 3) | m3 with E,
//   m3 the biased exponent and top 3 mantissa bits of that bf16 (E4M3 subnormals
//   normalised). A zero scale gives T = 0 and its block's codes are zeroed when packing.
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
// (programmatic dependent launch, sm_90+); x, partial and counters only after it.
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
// Staged variants (plain, one token tile, one row tile per group): right after
// griddepcontrol.wait each CTA copies the M rows of x over its own K slice
// [128 s0, 128 s0 + len) into dynamic shared memory ([M][len + 8] bf16, len a multiple of
// 64) with cp.async, and the main loop reads x there with ld.shared instead of from L2.
// The launch gives M * (len + 8) * 2 bytes (the planner's `staged_smem`).
#include <stdint.h>
#include <cuda_bf16.h>
#include "gemv_packed.cuh"
#include "gemv_common.cuh"
#include "nvfp4_decode.cuh"
#include "rmsnorm_math.cuh"

namespace {

// Warps per CTA: a launch parameter (blockDim.x = 32 * warps), at most MAX_WARPS (from
// PGEMV_WARPS of src/variants.rs, through the generated instances file).
#define CFP4_PGEMV_CONFIG
#include "gemv_packed_instances.inc"
#undef CFP4_PGEMV_CONFIG
constexpr int MAX_THREADS = MAX_WARPS * 32;
constexpr uint32_t kScaleMask = 0x0ff00ff0u;
// Exponent base of T: its bits start above bit 11 on the software path, so "| base" is
// one LOP3; the hardware path's scales sit 14 binades lower and add it.
constexpr int kTBase = CFP4_HW_E2M1 ? 208 : 224;
constexpr uint32_t kScaleBase = uint32_t(kTBase << 7) * 0x10001u;

using cfp4::griddep_launch_dependents;
using cfp4::griddep_wait;
using cfp4::ld_stream_u32;
using cfp4::ld_stream_v4;
using cfp4::mma_bf16;

// bf16x2 (s(r0), s(r1)) of chunk 2p + h from the pair's scale word.
__device__ __forceinline__ uint32_t scale_regs(uint32_t w, int h) {
    const uint32_t v = h == 0 ? w : __funnelshift_r(w, w, 8);
#if CFP4_HW_E2M1
    return (v & kScaleMask) + kScaleBase;
#else
    return (v & kScaleMask) | kScaleBase;
#endif
}

// T of an E4M3 scale byte (finite, sign ignored: the loaders reject negative scales and
// -0 is a zero scale).
__device__ __forceinline__ uint32_t scale_t(uint32_t b) {
    b &= 0x7fu;
    if (b == 0) return 0;
    const int e = int(b >> 3), m = int(b & 7u);
    int E, m3;
    if (e > 0) {
        E = e + (kRawLog2 - 8) + 120;  // (1 + m/8) 2^(e-7) * 2^(kRawLog2-8), bias 127
        m3 = m;
    } else {
        const int lead = 31 - __clz(m);  // m * 2^-9 = 2^(lead-9) * (m / 2^lead)
        E = lead + (kRawLog2 - 8) + 118;
        m3 = (m << (3 - lead)) & 7;
    }
    return uint32_t(((E - kTBase) << 3) | m3);
}

// Packed row tiles of the layer (both segments when N is even).
__device__ __forceinline__ int packed_tiles(const PackedGemvParams& p) {
    return p.half_pad ? p.half_pad / 8 : (p.n + 15) / 16;
}

// Packed row -> weight row, or -1 for a padding row.
__device__ __forceinline__ int real_row(int prow, int n, int half_pad) {
    if (half_pad == 0) return prow < n ? prow : -1;
    const int half = n / 2;
    if (prow < half_pad) return prow < half ? prow : -1;
    const int q = prow - half_pad;
    return q < half ? half + q : -1;
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

template <int NT, bool SILU, bool PAIR>
struct Stage {
    uint4 w[Cfg<NT, SILU, PAIR>::TILES][2];
    uint32_t s[Cfg<NT, SILU, PAIR>::TILES];
};

// 8 bf16 of x: from global memory (read-only path) or, in the norm variants, from the
// normalized rows in shared memory.
template <bool SMEM>
__device__ __forceinline__ uint4 load_x(const __nv_bfloat16* p) {
    if constexpr (SMEM) {
        uint4 v;
        const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
        return v;
    } else {
        return __ldg(reinterpret_cast<const uint4*>(p));
    }
}

// acc += chunk h of stage s (4 A fragments per tile) times x from `xo` elements past the
// token rows' cursors xr.
template <int NT, bool SILU, bool PAIR, bool XS>
__device__ __forceinline__ void compute_chunk(float (&acc)[Cfg<NT, SILU, PAIR>::TILES][NT][Cfg<NT, SILU, PAIR>::SETS][4],
                                              const Stage<NT, SILU, PAIR>& s, int h, const __nv_bfloat16* const* xr, int xo) {
    constexpr int TILES = Cfg<NT, SILU, PAIR>::TILES, SETS = Cfg<NT, SILU, PAIR>::SETS;
    uint4 xv[NT][2];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        xv[j][0] = load_x<XS>(xr[j] + xo);
        xv[j][1] = load_x<XS>(xr[j] + xo + 8);
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

// Norm variants: the normalized token rows into xs ([m][k + 8] bf16), CTA 0 writing the
// sums x + delta; ends with a barrier. Called after griddep_wait by every thread; nw0 is
// this thread's first 8 norm weights, loaded before the wait (no kernel writes them). Rows go
// two at a time (4 loads in flight per thread, few registers beside the weight stages
// already in flight).
template <int NT>
__device__ __forceinline__ void norm_prologue(const PackedGemvParams& p, __nv_bfloat16* __restrict__ xs, uint4 nw0) {
    constexpr int ROWS = 8 * NT, RB = 2;
    __shared__ float part[MAX_WARPS][ROWS];
    __shared__ float mrow[ROWS];
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
    }
    __syncthreads();
    const __nv_bfloat16* __restrict__ nw = static_cast<const __nv_bfloat16*>(p.norm_w);
    for (int v = tid; v < nv; v += nth) {
        const uint4 wv = v == tid ? nw0 : __ldg(reinterpret_cast<const uint4*>(nw) + v);
        const __nv_bfloat16* ww = reinterpret_cast<const __nv_bfloat16*>(&wv);
        for (int r = 0; r < p.m; ++r) {
            uint4* q = reinterpret_cast<uint4*>(xs + r * ld + 8 * v);
            uint4 sv = *q;
            __nv_bfloat16* s = reinterpret_cast<__nv_bfloat16*>(&sv);
            const float m = mrow[r];
#pragma unroll
            for (int j = 0; j < 8; ++j) s[j] = cfp4::norm_one(s[j], m, ww[j]);
            *q = sv;
        }
    }
    __syncthreads();
}

// Staged variants: the m token rows of x over K [k0, k0 + len) into xs ([m][len + 8]
// bf16), 16 bytes per cp.async; ends with a barrier. Called after griddep_wait by every
// thread (x is written by the previous kernel).
__device__ __forceinline__ void stage_x(const PackedGemvParams& p, __nv_bfloat16* __restrict__ xs, int k0, int len) {
    const int pieces = len / 8, ld = len + 8;
    const __nv_bfloat16* __restrict__ x = static_cast<const __nv_bfloat16*>(p.x);
    for (int i = threadIdx.x; i < p.m * pieces; i += blockDim.x) {
        const int r = i / pieces, c = i - r * pieces;
        const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(xs + r * ld + 8 * c));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(x + size_t(r) * p.x_stride + k0 + 8 * c)
                     : "memory");
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
}

// U: K pairs (1 KB of codes per tile) in flight per warp in registers (a variant
// parameter, src/variants.rs).
template <int NT, bool SILU, int U, XSrc XS, bool PAIR>
__device__ __forceinline__ void pgemv(const PackedGemvParams& p) {
    static_assert(XS != XSrc::Staged || (NT == 1 && !SILU && !PAIR), "the staged kernels are plain, one tile");
    constexpr bool NORM = XS == XSrc::Norm;
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

    // Cursors at this warp's first pair; the loop advances them by U pairs.
    const uint8_t* wp[TILES];
    const uint32_t* sp[TILES];
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
        // Pair: tiles 2g and 2g + 1 (an odd last tile computed twice, written once).
        const size_t tile = PAIR ? size_t(min(2 * group + i, packed_tiles(p) - 1))
                                 : size_t(i == 0 ? group : p.half_pad / 16 + group);
        wp[i] = p.w + ((tile * size_t(2 * p.npairs) + size_t(2 * w0)) * 32 + lane) * 16;
        sp[i] = p.scales + (tile * size_t(p.npairs) + size_t(w0)) * 32 + lane;
    }
    // Stage u of the pipeline from pair `i` past the cursors.
    auto load = [&](Stage<NT, SILU, PAIR>& st, int i) {
#pragma unroll
        for (int ti = 0; ti < TILES; ++ti) {
            st.w[ti][0] = ld_stream_v4(wp[ti] + i * 1024);
            st.w[ti][1] = ld_stream_v4(wp[ti] + i * 1024 + 512);
            st.s[ti] = ld_stream_u32(sp[ti] + i * 32);
        }
    };

    griddep_launch_dependents();
    Stage<NT, SILU, PAIR> st[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (u < np) load(st[u], u);
    uint4 nw0 = make_uint4(0, 0, 0, 0);
    if constexpr (NORM) {
        if (int(threadIdx.x) < p.k / 8) nw0 = __ldg(static_cast<const uint4*>(p.norm_w) + threadIdx.x);
    }
    griddep_wait();  // x is written by the previous kernel

    const __nv_bfloat16* xb = static_cast<const __nv_bfloat16*>(p.x);
    size_t xstride = size_t(p.x_stride);
    if constexpr (NORM) {
        extern __shared__ __align__(16) unsigned char pgemv_dyn[];
        __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(pgemv_dyn);
        norm_prologue<NT>(p, xs, nw0);
        xb = xs;
        xstride = size_t(p.k + 8);
    }
    int xcol = 128 * w0;  // this warp's first x column in xb
    if constexpr (XS == XSrc::Staged) {
        extern __shared__ __align__(16) unsigned char pgemv_dyn[];
        __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(pgemv_dyn);
        const int k0 = 128 * s0, len = max(0, min(128 * (s1 - s0), p.k - k0));
        stage_x(p, xs, k0, len);
        xb = xs;
        xstride = size_t(len + 8);
        xcol = 128 * (w0 - s0);
    }
    const __nv_bfloat16* xr[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) xr[j] = xb + size_t(min(g + 8 * j, p.m - 1)) * xstride + xcol + 16 * t;

    float acc[TILES][NT][SETS][4];
#pragma unroll
    for (int ti = 0; ti < TILES; ++ti)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int q = 0; q < SETS; ++q) acc[ti][j][q][0] = acc[ti][j][q][1] = acc[ti][j][q][2] = acc[ti][j][q][3] = 0.f;

    auto compute = [&](const Stage<NT, SILU, PAIR>& s, int h, int xo) { compute_chunk<NT, SILU, PAIR, XS != XSrc::Global>(acc, s, h, xr, xo); };
    auto advance = [&]() {
#pragma unroll
        for (int ti = 0; ti < TILES; ++ti) {
            wp[ti] += U * 1024;
            sp[ti] += U * 32;
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) xr[j] += U * 128;
    };

    // The warp's last pair has one chunk when it ends an odd K / 64.
    const int full = (w1 == p.npairs && (nchunks & 1)) ? np - 1 : np;
    int i0 = 0;
    for (; i0 + U <= np; i0 += U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            compute(st[u], 0, 128 * u);
            if (i0 + u < full) compute(st[u], 1, 128 * u + 64);
            if (i0 + u + U < np) load(st[u], u + U);
        }
        advance();
    }
#pragma unroll
    for (int u = 0; u < U - 1; ++u) {
        if (i0 + u < np) {
            compute(st[u], 0, 128 * u);
            if (i0 + u < full) compute(st[u], 1, 128 * u + 64);
        }
    }

    pgemv_finish<NT, SILU, PAIR>(p, acc, &red[0][0][0][0], group, slice);
}

// Software decode: bit of the packed word that holds bit b (0 = m, 1 = e0, 2 = e1, 3 = s)
// of half h's code of pair r (packed_word_pairs in nvfp4_decode.cuh inverts this).
__device__ __forceinline__ int code_bit_pos(int r, int h, int b) {
    const int out = (b == 3 ? 15 : 6 + b) + 16 * h;  // where packed_word_pairs puts it
    if (r < 3) return (out + 3 * r) & 31;            // rotated right by 3r
    const int low[4] = {3, 4, 0, 1};                 // pair 3: the multiply's sources
    return low[b] + 16 * h;
}

// Packed word j of lane (g, t) of chunk c of `tile`, from the ModelOpt layout (see top).
__device__ __forceinline__ uint32_t pack_word(const PackParams& p, int tile, int c, int lane, int j) {
    const int g = lane >> 2, t = lane & 3;
    const int kj = 64 * c + 16 * t + 4 * j;
    uint32_t v[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};  // [row][k - kj]
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int row = real_row(16 * tile + g + 8 * rr, p.n, p.half_pad);
        if (row < 0 || kj >= p.k) continue;
        if ((p.scales[swizzled_offset(uint32_t(row), uint32_t(kj / 16), uint32_t(p.sp))] & 0x7fu) == 0) continue;
        const uint8_t* src = p.codes + size_t(row) * (p.k / 2) + kj / 2;
        v[rr][0] = src[0] & 15u;
        v[rr][1] = src[0] >> 4;
        v[rr][2] = src[1] & 15u;
        v[rr][3] = src[1] >> 4;
    }
    // pair r of the A fragment: (first, second) k of (row, k offset)
    const uint32_t pr[4][2] = {{v[0][0], v[0][1]}, {v[1][0], v[1][1]}, {v[0][2], v[0][3]}, {v[1][2], v[1][3]}};
    uint32_t word = 0;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        if (CFP4_HW_E2M1) {
            word |= (pr[r][0] << (8 * r)) | (pr[r][1] << (8 * r + 4));
        } else {
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int b = 0; b < 4; ++b)
                    if ((pr[r][h] >> b) & 1u) word |= 1u << code_bit_pos(r, h, b);
        }
    }
    return word;
}

}  // namespace

// Register caps without spills (ptxas -v): 16 warps per SM (8 for the widest variant).
constexpr int pgemv_min_blocks(int nt, bool silu) { return nt * (silu ? 2 : 1) >= 8 ? 1 : 2; }

// XS: Global, Norm or Staged (XSrc).
#define CFP4_PGEMV(NT, SILU, U, XS, NAME)                                                                  \
    extern "C" __global__ void __launch_bounds__(MAX_THREADS, pgemv_min_blocks(NT, SILU)) NAME(const __grid_constant__ PackedGemvParams p) { \
        pgemv<NT, SILU, U, XSrc::XS, false>(p);                                                            \
    }
// Plain, one token tile, two row tiles per group (groups = ceil(tiles / 2)).
#define CFP4_PGEMV_PAIR(U, NAME)                                                                           \
    extern "C" __global__ void __launch_bounds__(MAX_THREADS, 2) NAME(const __grid_constant__ PackedGemvParams p) { \
        pgemv<1, false, U, XSrc::Global, true>(p);                                                                \
    }

// Every variant of src/variants.rs (generated by build.rs).
#include "gemv_packed_instances.inc"

// One thread per 16-byte lane record of the packed codes.
extern "C" __global__ void __launch_bounds__(256) cfp4_pack_codes(const __grid_constant__ PackParams p) {
    const size_t nch = size_t(2 * p.npairs);
    const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= size_t(p.tiles) * nch * 32) return;
    const int lane = int(i % 32), c = int((i / 32) % nch), tile = int(i / 32 / nch);
    uint4 v;
    v.x = pack_word(p, tile, c, lane, 0);
    v.y = pack_word(p, tile, c, lane, 1);
    v.z = pack_word(p, tile, c, lane, 2);
    v.w = pack_word(p, tile, c, lane, 3);
    reinterpret_cast<uint4*>(p.out_codes)[i] = v;
}

// One thread per packed scale word.
extern "C" __global__ void __launch_bounds__(256) cfp4_pack_scales(const __grid_constant__ PackParams p) {
    const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= size_t(p.tiles) * p.npairs * 32) return;
    const int lane = int(i % 32), pair = int((i / 32) % p.npairs), tile = int(i / 32 / p.npairs);
    const int g = lane >> 2, t = lane & 3;
    uint32_t T[2][2] = {{0, 0}, {0, 0}};  // [row][chunk of the pair]
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int row = real_row(16 * tile + g + 8 * rr, p.n, p.half_pad);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = 2 * pair + h;
            if (row < 0 || 64 * c >= p.k) continue;
            T[rr][h] = scale_t(p.scales[swizzled_offset(uint32_t(row), uint32_t(4 * c + t), uint32_t(p.sp))]);
        }
    }
    p.out_scales[i] = (T[0][0] << 4) | (T[1][0] << 20) | (T[0][1] << 12) | ((T[1][1] & 15u) << 28) | (T[1][1] >> 4);
}

// Exact BF16 rows from the packed layout: one thread per packed word (4 k of two rows).
extern "C" __global__ void __launch_bounds__(256) cfp4_dequantize_packed(const __grid_constant__ PackedDequantParams p) {
    const size_t nch = size_t(2 * p.npairs);
    const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= size_t(p.tiles) * nch * 128) return;
    const int j = int(i % 4), lane = int((i / 4) % 32), c = int((i / 128) % nch), tile = int(i / 128 / nch);
    const int g = lane >> 2, t = lane & 3;
    const int kj = 64 * c + 16 * t + 4 * j;
    if (kj >= p.k) return;
    const uint32_t word = reinterpret_cast<const uint32_t*>(p.w)[i];
    const uint32_t S = scale_regs(p.scales[(size_t(tile) * p.npairs + c / 2) * 32 + lane], c & 1);
    uint32_t r[4];
    packed_word_pairs(word, r);
    const uint32_t sa = __byte_perm(S, 0, 0x1010), sb = __byte_perm(S, 0, 0x3232);
    // bf16x2 (256, 256) undoes the decode's 2^-8, exactly (|e2m1 * e4m3| <= 2688).
    constexpr uint32_t two8 = 0x43804380u;
    const uint32_t a0 = bf16x2_mul(bf16x2_mul(r[0], sa), two8), a1 = bf16x2_mul(bf16x2_mul(r[1], sb), two8);
    const uint32_t a2 = bf16x2_mul(bf16x2_mul(r[2], sa), two8), a3 = bf16x2_mul(bf16x2_mul(r[3], sb), two8);
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out);
    const int row0 = real_row(16 * tile + g, p.n, p.half_pad), row1 = real_row(16 * tile + g + 8, p.n, p.half_pad);
    if (row0 >= 0) *reinterpret_cast<uint2*>(out + size_t(row0) * p.k + kj) = make_uint2(a0, a2);
    if (row1 >= 0) *reinterpret_cast<uint2*>(out + size_t(row1) * p.k + kj) = make_uint2(a1, a3);
}
