// gemv.cu: small-M (M <= 32) GEMV, y = epilogue(out_scale * x . W^T), on tensor cores.
//
// Formats (see gemv.cuh for the parameter block):
//   NVFP4 weight: uint8 [N, K/2], byte j of row n = codes of k = 2j (low nibble), 2j+1
//   (high nibble); E4M3 block scales, one per 16 k, in the 128x4-swizzled layout of
//   CUTLASS's SM100 block-scaled MMA (offset formula in nvfp4_decode.cuh); FP32 global
//   scale applied to the FP32 accumulator (out_scale). BF16 weight: bf16 [N, K].
//   x: bf16 [M, K]; out: bf16 [M, N], or [M, N/2] = silu(gate) * up over [gate | up].
//
// Work split (swap-AB): mma.sync.m16n8k16 with the weight as A (16 rows = 16 output
// features) and x^T as B (8 tokens); NT token tiles cover 8*NT tokens. One CTA owns one
// 16-row tile (silu_mul: 8 gate rows n and the 8 up rows N/2 + n, so the epilogue has
// both in one thread). K is cut into 128-wide chunks (a 64-wide tail when K % 128 == 64);
// the WARPS warps of a CTA, and with SPLIT > 1 the SPLIT CTAs of a thread-block cluster,
// take chunks round-robin; partial sums meet in shared memory, then (clusters) in rank
// 0's shared memory through DSMEM. Inside a chunk, thread (g = lane/4, t = lane%4) holds
// k = chunk*128 + 32t .. +32 of rows g and g+8 (the k order inside an MMA is free as
// long as A and B agree, so loads stay 16 bytes wide).
//
// Every weight and scale load of the first stages is issued before griddepcontrol.wait,
// so under programmatic dependent launch they overlap the previous kernel's tail; x is
// read only after it. griddepcontrol and clusters need sm_90; the sm_80 build has SPLIT
// = 1 only and no PDL.
#include <stdint.h>
#include <cuda_bf16.h>
#include "gemv.cuh"
#include "nvfp4_decode.cuh"

#include "gemv_common.cuh"
#if CFP4_SM90
#include <cooperative_groups.h>
#endif

namespace {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int CHUNK = 128;

using cfp4::griddep_launch_dependents;
using cfp4::griddep_wait;
using cfp4::ld_stream_v2;
using cfp4::ld_stream_v4;
using cfp4::mma_bf16;

// Raw weight bytes of one chunk for rows g and g+8 (this thread's 32 k of each).
template <bool FP4>
struct Stage {
    // FP4: 16 bytes (32 codes) per row; BF16: 64 bytes per row.
    uint4 w[2][FP4 ? 1 : 4];
    uint32_t sc[2];  // FP4: two scale bytes per row (blocks 2t, 2t+1 of the chunk)
};

template <bool FP4, bool SILU>
struct Rows {
    int row[2];
    bool ok[2];
    __device__ __forceinline__ Rows(const GemvParams& p, int tile, int g) {
        if (SILU) {
            const int half = p.n / 2;
            row[0] = tile * 8 + g;
            row[1] = half + tile * 8 + g;
            ok[0] = ok[1] = tile * 8 + g < half;
        } else {
            row[0] = tile * 16 + g;
            row[1] = tile * 16 + g + 8;
            ok[0] = row[0] < p.n;
            ok[1] = row[1] < p.n;
        }
    }
};

// Per-tile row pointers of this thread, so a stage load is one add per address.
template <bool FP4>
struct RowPtrs {
    const uint8_t* w[2];  // start of row g / g+8 (bytes)
    const uint8_t* s[2];  // FP4: this row's scale bytes of chunk 0 (add chunk * 1024)
    bool ok[2];
};

template <bool FP4, bool SILU>
__device__ __forceinline__ RowPtrs<FP4> row_ptrs(const GemvParams& p, int tile, int g) {
    const Rows<FP4, SILU> rows(p, tile, g);
    RowPtrs<FP4> rp;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const uint32_t row = uint32_t(rows.row[r]);
        rp.ok[r] = rows.ok[r];
        if (FP4) {
            rp.w[r] = static_cast<const uint8_t*>(p.w) + size_t(row) * (p.k / 2);
            // swizzled_offset(row, s, sp) with the s-dependent part added per chunk:
            // s = 8*chunk + 2t -> (s/4)*512 = chunk*1024 + (t/2)*512, s%4 = 2*(t%2).
            rp.s[r] = p.scales + size_t((row >> 7) * uint32_t(p.sp >> 2)) * 512u + (row & 31u) * 16u + ((row & 127u) >> 5) * 4u;
        } else {
            rp.w[r] = static_cast<const uint8_t*>(p.w) + size_t(row) * p.k * 2;
            rp.s[r] = nullptr;
        }
    }
    return rp;
}

template <bool FP4>
__device__ __forceinline__ void load_stage(const RowPtrs<FP4>& rp, int chunk, bool tail, int t, Stage<FP4>& st) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (FP4) {
            const uint8_t* base = rp.w[r] + chunk * (CHUNK / 2);
            const uint8_t* sb = rp.s[r] + chunk * 1024;
            st.w[r][0] = make_uint4(0, 0, 0, 0);
            st.sc[r] = 0;
            if (rp.ok[r]) {
                if (!tail) {
                    st.w[r][0] = ld_stream_v4(base + t * 16);
                    st.sc[r] = __ldg(reinterpret_cast<const unsigned short*>(sb + (t >> 1) * 512 + (t & 1) * 2));
                } else {
                    // 64-wide tail: thread t holds k = 16t .. 16t+15, scale column 8*chunk + t.
                    const uint2 v = ld_stream_v2(base + t * 8);
                    st.w[r][0] = make_uint4(v.x, v.y, 0, 0);
                    st.sc[r] = __ldg(sb + t);
                }
            }
        } else {
            const uint8_t* base = rp.w[r] + chunk * (CHUNK * 2);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                st.w[r][q] = make_uint4(0, 0, 0, 0);
                const bool in = rp.ok[r] && (!tail || q < 2);
                // tail: 16 bf16 of this thread at k = chunk*128 + 16t
                const int off = tail ? t * 32 + q * 16 : t * 64 + q * 16;
                if (in) st.w[r][q] = ld_stream_v4(base + off);
            }
        }
    }
}

// Accumulator sets: NT tiles x SETS chains, so 4 independent MMA chains per thread.
template <int NT>
struct Acc {
    static constexpr int SETS = 4 / NT;
    float v[SETS][NT][4];
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int q = 0; q < SETS; ++q)
#pragma unroll
            for (int j = 0; j < NT; ++j) v[q][j][0] = v[q][j][1] = v[q][j][2] = v[q][j][3] = 0.f;
    }
    __device__ __forceinline__ float4 sum(int j) const {
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int q = 0; q < SETS; ++q) {
            s.x += v[q][j][0]; s.y += v[q][j][1]; s.z += v[q][j][2]; s.w += v[q][j][3];
        }
        return s;
    }
};

// Multiplies one stage into the accumulators. Word w (8 k values) of a row gives 4 A
// registers (pairs), feeding two MMAs; x is read (L1-resident after the first CTA on
// the SM) for the same k in the same pairing, all loads of the chunk issued first.
template <int NT, bool FP4>
__device__ __forceinline__ void compute_stage(const GemvParams& p, int chunk, bool tail, const Stage<FP4>& st,
                                              Acc<NT>& acc, int set0, int g, int t) {
    const int nwords = tail ? 2 : 4;
    uint4 xl[NT][4];
    const __nv_bfloat16* xb = static_cast<const __nv_bfloat16*>(p.x);
    const int kbase = chunk * CHUNK + (tail ? t * 16 : t * 32);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int tok = j * 8 + g;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            xl[j][w] = make_uint4(0, 0, 0, 0);
            if (tok < p.m && (!tail || w < 2))
                xl[j][w] = __ldg(reinterpret_cast<const uint4*>(xb + size_t(tok) * p.x_stride + kbase + w * 8));
        }
    }
    uint32_t sc[2][2];
    if (FP4) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            sc[r][0] = scale_pair(st.sc[r] & 0xffu);
            sc[r][1] = scale_pair((st.sc[r] >> 8) & 0xffu);
        }
    }
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        if (w >= nwords) break;
        uint32_t a[2][4];  // [row][pair]
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (FP4) {
                const uint32_t word = w == 0 ? st.w[r][0].x : w == 1 ? st.w[r][0].y : w == 2 ? st.w[r][0].z : st.w[r][0].w;
                decode_word(word, sc[r][w / 2], a[r]);
            } else {
                const uint4 v = st.w[r][w];
                a[r][0] = v.x; a[r][1] = v.y; a[r][2] = v.z; a[r][3] = v.w;
            }
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            uint32_t b[4];
            const uint32_t nat[4] = {xl[j][w].x, xl[j][w].y, xl[j][w].z, xl[j][w].w};
            if (FP4) {
                pair_like_weights(nat, b);
            } else {
#pragma unroll
                for (int q = 0; q < 4; ++q) b[q] = nat[q];
            }
            const uint32_t a0[4] = {a[0][0], a[1][0], a[0][1], a[1][1]};
            const uint32_t a1[4] = {a[0][2], a[1][2], a[0][3], a[1][3]};
            constexpr int S = Acc<NT>::SETS;
            mma_bf16(acc.v[(set0 + 0) % S][j], a0, b[0], b[1]);
            mma_bf16(acc.v[(set0 + (S > 1 ? 1 : 0)) % S][j], a1, b[2], b[3]);
        }
    }
}

// Rounds (and with SILU combines) one finished tile; red0[j][lane] holds the CTA's sums
// in the mma C layout: (row g, tok 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
template <int NT, bool SILU, bool FP4>
__device__ __forceinline__ void epilogue(const GemvParams& p, const Rows<FP4, SILU>& rows, const float4 (*red0)[32],
                                         int lane, int t) {
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const float4 s = red0[j][lane];
        const float v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int tok = j * 8 + 2 * t + e;
            if (tok >= p.m) continue;
            if (SILU) {
                if (!rows.ok[0]) continue;
                const int half = p.n / 2;
                const float gate = __bfloat162float(__float2bfloat16_rn(v[e] * p.out_scale));
                const float up = __bfloat162float(__float2bfloat16_rn(v[2 + e] * p.out_scale));
                const float silu = gate / (1.0f + expf(-gate));
                out[size_t(tok) * half + rows.row[0]] = __float2bfloat16_rn(silu * up);
            } else {
#pragma unroll
                for (int r = 0; r < 2; ++r)
                    if (rows.ok[r]) out[size_t(tok) * p.n + rows.row[r]] = __float2bfloat16_rn(v[2 * r + e] * p.out_scale);
            }
        }
    }
}

// Chunks in flight per warp.
template <int NT, bool FP4>
__host__ __device__ constexpr int stages() { return FP4 ? (NT == 4 ? 3 : 6) : (NT == 4 ? 2 : 3); }

// SPLIT == 1: persistent CTAs (grid = min(tiles, resident CTAs)); CTA b owns tiles b,
// b + grid, ... Each warp walks a flat list of (tile, chunk) items, `per` per tile
// (chunks w, w + WARPS, ...; items past the last chunk are empty), keeping U items in
// flight across tile boundaries so the pipeline never drains between tiles. At the end
// of a tile the warps meet in shared memory (double-buffered) and warp 0 writes it.
template <int NT, bool SILU, bool FP4>
__device__ __forceinline__ void gemv_persistent(const GemvParams& p) {
    constexpr int U = stages<NT, FP4>();
    __shared__ float4 red[2][WARPS][NT][32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, t = lane & 3;
    const int nfull = p.k / CHUNK;
    const int nchunks = nfull + ((p.k % CHUNK) != 0 ? 1 : 0);
    const int per = (nchunks + WARPS - 1) / WARPS;
    const int my_tiles = int(blockIdx.x) < p.n_tiles ? (p.n_tiles - 1 - int(blockIdx.x)) / int(gridDim.x) + 1 : 0;
    const int items = my_tiles * per;

    // Load cursor (tile, local item li, chunk = warp + li*WARPS), advanced without division.
    int lt = blockIdx.x, li = 0;
    RowPtrs<FP4> lrp = row_ptrs<FP4, SILU>(p, lt, g);
    auto advance_load = [&]() {
        if (++li == per) {
            li = 0;
            lt += gridDim.x;
            lrp = row_ptrs<FP4, SILU>(p, lt, g);
        }
    };

    griddep_launch_dependents();
    Stage<FP4> st[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int c = warp + li * WARPS;
        if (u < items && c < nchunks) load_stage<FP4>(lrp, c, c == nfull, t, st[u]);
        advance_load();
    }
    griddep_wait();  // x is written by the previous kernel

    Acc<NT> acc;
    acc.zero();
    int ct = blockIdx.x, ci = 0, tile_no = 0;  // compute cursor
    for (int i0 = 0; i0 < items; i0 += U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (i0 + u >= items) break;
            const int c = warp + ci * WARPS;
            if (c < nchunks)
                compute_stage<NT, FP4>(p, c, c == nfull, st[u], acc, (2 * u) % Acc<NT>::SETS, g, t);
            const int cn = warp + li * WARPS;
            if (i0 + u + U < items && cn < nchunks) load_stage<FP4>(lrp, cn, cn == nfull, t, st[u]);
            advance_load();
            if (++ci == per) {  // this warp's share of tile ct is done
                const int buf = tile_no & 1;
#pragma unroll
                for (int j = 0; j < NT; ++j) red[buf][warp][j][lane] = acc.sum(j);
                acc.zero();
                __syncthreads();
                if (warp == 0) {
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        float4 s = red[buf][0][j][lane];
#pragma unroll
                        for (int w = 1; w < WARPS; ++w) {
                            const float4 v = red[buf][w][j][lane];
                            s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
                        }
                        red[buf][0][j][lane] = s;
                    }
                    __syncwarp();
                    epilogue<NT, SILU, FP4>(p, Rows<FP4, SILU>(p, ct, g), red[buf][0], lane, t);
                }
                ci = 0;
                ct += gridDim.x;
                ++tile_no;
            }
        }
    }
}

// SPLIT > 1 (few row tiles): one tile per CTA, the SPLIT CTAs of a cluster split K and
// reduce through distributed shared memory into rank 0.
template <int NT, int SPLIT, bool SILU, bool FP4>
__device__ __forceinline__ void gemv_split(const GemvParams& p) {
    constexpr int U = stages<NT, FP4>();
    __shared__ float4 red[WARPS][NT][32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x / SPLIT;
    const int rank = int(blockIdx.x % SPLIT);
    const Rows<FP4, SILU> rows(p, tile, g);
    const RowPtrs<FP4> rp = row_ptrs<FP4, SILU>(p, tile, g);
    const int nfull = p.k / CHUNK;
    const int nchunks = nfull + ((p.k % CHUNK) != 0 ? 1 : 0);
    constexpr int NW = SPLIT * WARPS;
    const int worker = rank * WARPS + warp;

    griddep_launch_dependents();
    Stage<FP4> st[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int c = worker + u * NW;
        if (c < nchunks) load_stage<FP4>(rp, c, c == nfull, t, st[u]);
    }
    griddep_wait();

    Acc<NT> acc;
    acc.zero();
    for (int c0 = worker; c0 < nchunks; c0 += U * NW) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * NW;
            if (c < nchunks) {
                compute_stage<NT, FP4>(p, c, c == nfull, st[u], acc, (2 * u) % Acc<NT>::SETS, g, t);
                const int cn = c + U * NW;
                if (cn < nchunks) load_stage<FP4>(rp, cn, cn == nfull, t, st[u]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) red[warp][j][lane] = acc.sum(j);
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            float4 s = red[0][j][lane];
#pragma unroll
            for (int w = 1; w < WARPS; ++w) {
                const float4 v = red[w][j][lane];
                s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
            }
            red[0][j][lane] = s;
        }
    }
#if CFP4_SM90
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every rank's red[0] is final
    if (rank == 0 && warp == 0) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            float4 s = red[0][j][lane];
#pragma unroll
            for (int r = 1; r < SPLIT; ++r) {
                const float4 v = *cluster.map_shared_rank(&red[0][j][lane], r);
                s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
            }
            red[0][j][lane] = s;
        }
    }
    cluster.sync();  // keep the other ranks' shared memory alive until read
#endif
    if (rank == 0 && warp == 0) epilogue<NT, SILU, FP4>(p, rows, red[0], lane, t);
}

template <int NT, int SPLIT, bool SILU, bool FP4>
__device__ __forceinline__ void gemv_body(const GemvParams& p) {
    if constexpr (SPLIT == 1) {
        gemv_persistent<NT, SILU, FP4>(p);
    } else {
        gemv_split<NT, SPLIT, SILU, FP4>(p);
    }
}

}  // namespace

// Register caps chosen so the pipelines do not spill (ptxas -v): 4 CTAs (16 warps) per
// SM for the light variants, 3 or 2 for the heavier ones.
constexpr int min_blocks(int nt, bool fp4) { return fp4 ? (nt <= 2 ? 4 : 2) : (nt <= 2 ? 3 : 2); }

#define CFP4_GEMV(NT, SPLIT, SILU, FP4, NAME)                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS, min_blocks(NT, FP4)) NAME(const __grid_constant__ GemvParams p) { \
        gemv_body<NT, SPLIT, SILU, FP4>(p);                                                                      \
    }

// sm_80/sm_89 have no clusters: only split 1 exists in those images.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define CFP4_CLUSTERS 1
#else
#define CFP4_CLUSTERS 0
#endif

// Every variant of src/variants.rs (generated by build.rs).
#include "gemv_instances.inc"

// Exact BF16 rows: out[n, k] = e2m1 * e4m3. One thread per 8 codes (one 32-bit word).
extern "C" __global__ void __launch_bounds__(256) cfp4_dequantize_rows(const __grid_constant__ DequantParams p) {
    const size_t words_per_row = size_t(p.k) / 8;
    const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= size_t(p.n) * words_per_row) return;
    const uint32_t row = uint32_t(i / words_per_row);
    const uint32_t wcol = uint32_t(i % words_per_row);
    const uint32_t q = *reinterpret_cast<const uint32_t*>(p.codes + size_t(row) * (p.k / 2) + wcol * 4);
    const uint32_t s = p.scales[swizzled_offset(row, wcol / 2, p.sp)];
    uint32_t pairs[4], nat[4];
    decode_word(q, scale_pair(s), pairs);
    const uint32_t two8 = 0x43804380u;  // bf16x2 (256, 256): undoes the decode's 2^-8, exactly
#pragma unroll
    for (int r = 0; r < 4; ++r) pairs[r] = bf16x2_mul(pairs[r], two8);
    pairs_to_natural(pairs, nat);
    *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.out) + size_t(row) * p.k + wcol * 8) =
        make_uint4(nat[0], nat[1], nat[2], nat[3]);
}
