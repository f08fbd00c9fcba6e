// kv_attention.cuh: the decode-attention kernels' configuration (Cfg), fragment layouts,
// stage copies and the split merge (included by kv_attention.cu; layout notes there).
#pragma once
#include <stdint.h>
#include <cuda_bf16.h>
#include "ultraquant.cuh"
#include "kv_common.cuh"

namespace {

// ---------------------------------------------------------------- attention helpers

// 32-bit shared load at a known-at-compile-time alignment (2 or 4).
template <int ALIGN>
__device__ __forceinline__ uint32_t lds32(const uint8_t* p) {
    if constexpr (ALIGN % 4 == 0) {
        return *reinterpret_cast<const uint32_t*>(p);
    } else {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
        return uint32_t(h[0]) | (uint32_t(h[1]) << 16);
    }
}

// The G UE8M0 bytes of one (token, K or V) at p, as (G + 3) / 4 words (byte i = group i).
template <int G>
__device__ __forceinline__ void load_scale_words(const uint8_t* p, uint32_t (&w)[(G + 3) / 4]) {
    if constexpr (G == 2) {
        w[0] = *reinterpret_cast<const uint16_t*>(p);
    } else {
#pragma unroll
        for (int j = 0; j < G / 4; ++j) w[j] = *reinterpret_cast<const uint32_t*>(p + 4 * j);
    }
}

// Scale of group i as an FP32 2^(byte - 127) (byte 0 -> +0, the zero sentinel).
template <int G>
__device__ __forceinline__ float scale_f32(const uint32_t (&w)[(G + 3) / 4], int i) {
    return __uint_as_float(__byte_perm(w[i >> 2], 0u, 0x4440u | uint32_t(i & 3)) << 23);
}

// Scales of group i of two tokens as bf16x2 (a in the low half): bits byte << 7.
template <int G>
__device__ __forceinline__ uint32_t scale_pair_bf16(const uint32_t (&wa)[(G + 3) / 4],
                                                    const uint32_t (&wb)[(G + 3) / 4], int i) {
    const uint32_t b = uint32_t(i & 3);
    const uint32_t x = __byte_perm(wa[i >> 2], wb[i >> 2], b | (b << 4) | ((b + 4) << 8) | ((b + 4) << 12));
    return (x << 7) & 0x7f807f80u;
}

__device__ __forceinline__ uint32_t bf16_bits(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }

// The hi (lo = false) or lo (lo = true) bf16 part of x, x ~= hi + lo.
__device__ __forceinline__ uint32_t split_part(float x, bool lo) {
    const __nv_bfloat16 hi = __float2bfloat16_rn(x);
    return lo ? bf16_bits(x - __bfloat162float(hi)) : uint32_t(__bfloat16_as_ushort(hi));
}

template <bool FP4, int D, int NT>
struct Cfg {
    static constexpr int NW = FP4 ? (D == 256 ? 4 : (NT == 1 ? 16 : 8)) : (D == 256 ? 2 : 4);  // warps per CTA
    static constexpr int MINB = (FP4 && NW == 16) ? 1 : (NT == 1 ? 2 : 1);  // launch bounds
    static constexpr int THREADS = NW * 32;
    static constexpr int NSTAGE = FP4 ? (NW == 16 ? 2 : 3) : 2;
    // 16-token tiles per loop iteration and stage buffer: UltraQuant takes two, so each warp
    // has two independent S / softmax / O chains in flight (it is latency-bound at one).
    static constexpr int TPI = FP4 ? 2 : 1;
    static constexpr int SLOT = D + D / 16;
    static constexpr int GCD16 = SLOT % 16 == 0 ? 16 : SLOT % 8 == 0 ? 8 : 4;
    // 16-byte chunks per token row: a slot starts at a multiple of GCD16 within its chunk.
    static constexpr int CH = FP4 ? (SLOT + (16 - GCD16) + 15) / 16 : D / 4;
    // Shared bytes per token row (row stride / 4 = 4 mod 8 words: conflict-free loads).
    static constexpr int SROW = FP4 ? CH * 16 : 4 * D + 16;
    static constexpr int STAGE = 16 * TPI * SROW;
    static constexpr int HC = 4 * NT;  // query heads per CTA
    static constexpr int KS = D / 16;  // k-steps of S = K . Q
    static constexpr int MT = D / 16;  // m-tiles of O^T
    static constexpr int STAGES_BYTES = NW * NSTAGE * STAGE;
    static constexpr int REDO_BYTES = NW * HC * D * 4;
    static constexpr int QS_OFF = STAGES_BYTES > REDO_BYTES ? STAGES_BYTES : REDO_BYTES;
    static constexpr int RED_OFF = QS_OFF + HC * D * 4;
    static constexpr int SMEM = RED_OFF + 2 * NW * HC * 4;  // read by the host through cfp4_kv_attn_configs
};

// V codes / V scales offsets in an UltraQuant slot.
template <int D> constexpr int kVC = D / 2 + D / 32;
template <int D> constexpr int kVS = D + D / 32;

// First d of k-slot pair (2t, 2t+1) in k-step ks; the pair is (d, d + E1), and the pair of
// k-slots (2t+8, 2t+9) is (d + H1, d + H1 + E1).
template <bool FP4>
__device__ __forceinline__ int kd0(int ks, int t) {
    return FP4 ? 8 * t + 32 * (ks >> 1) + 2 * (ks & 1) : 16 * ks + 2 * t;
}
template <bool FP4> constexpr int kE1 = FP4 ? 4 : 1;
template <bool FP4> constexpr int kH1 = FP4 ? 1 : 8;

// d of O^T row g in m-tile i (row g + 8 is d + 1). UltraQuant: m-tiles 2j and 2j + 1 hold
// the 32 d of scale group j (so one V scale per (token, m-tile)), thread g the four d
// 32j + 4g .. 32j + 4g + 3 (one 16-bit load of codes per token and group).
template <bool FP4>
__device__ __forceinline__ int vd(int i, int g) {
    return FP4 ? 32 * (i >> 1) + 4 * g + 2 * (i & 1) : 16 * i + 2 * g;
}

// One warp's cp.async of a 16 * TPI-token stage (tokens tb ..; those >= t1 zero-filled).
template <bool FP4, int D, int NT>
__device__ __forceinline__ void load_tile(uint8_t* buf, const uint8_t* kb, const uint8_t* vb, size_t row0,
                                          int kv_heads, int tb, int t1, int lane) {
    using C = Cfg<FP4, D, NT>;
#pragma unroll 1
    for (int c = lane; c < 16 * C::TPI * C::CH; c += 32) {
        const int i = c / C::CH, k = c - i * C::CH;
        const int tok = tb + i;
        const bool ok = tok < t1;
        const size_t idx = row0 + size_t(tok) * kv_heads;  // (b * capacity + tok) * kv_heads + head
        const uint8_t* src;
        uint8_t* dst;
        if constexpr (FP4) {
            const uintptr_t a = reinterpret_cast<uintptr_t>(kb + idx * C::SLOT) & ~uintptr_t(15);
            src = reinterpret_cast<const uint8_t*>(a) + 16 * k;
            dst = buf + i * C::SROW + 16 * k;
        } else {
            const bool isv = k >= D / 8;
            const int kk = isv ? k - D / 8 : k;
            src = (isv ? vb : kb) + idx * (2 * D) + 16 * kk;
            dst = buf + i * C::SROW + (isv ? 2 * D : 0) + 16 * kk;
        }
        cp_async_16_zfill(dst, ok ? src : kb, ok ? 16u : 0u);
    }
}

// UltraQuant full-stage copy, the chunks of load_tile (the aligned 16-byte chunks that
// cover each slot) with every address precomputed per lane:
//   main part: chunks 0 .. LPR - 1 of every row (LPR = the largest power of 2 <= CH), lane
//     (r, k) = (lane / LPR, lane % LPR) copying chunk k of rows RPI * m + r, m = 0 .. LPR - 1
//     (RPI = 32 / LPR rows per instruction, each row LPR * 16 contiguous bytes);
//   rest: chunks LPR .. CH - 1 (one at every D), lane = row.
// Row i's slot starts (its address & 15) bytes into its smem row. That offset is the same in
// every stage of a warp (stages are 32 * NW * kv_heads slots apart: a multiple of 16 bytes,
// since 32 * SLOT is) and for rows RPI (and 8) apart (RPI * SLOT and 8 * SLOT are multiples of 16).
template <bool FP4, int D, int NT>
struct StageCopy {
    using C = Cfg<FP4, D, NT>;
    static_assert(16 * C::TPI == 32, "StageCopy assumes 32-token stages");
    static constexpr int LPR = C::CH >= 16 ? 16 : C::CH >= 8 ? 8 : 4;
    static constexpr int RPI = 32 / LPR;
    static_assert(C::CH - LPR == 1 && (RPI * C::SLOT) % 16 == 0 && (8 * C::SLOT) % 16 == 0, "chunk plan");
    int32_t src_main;  // row r's chunk k (aligned), from the stage's first slot
    int32_t src_rest;  // row lane's chunk LPR (aligned)
    uint32_t stride;   // bytes from row i to row i + RPI
    uint32_t dst_main;  // r * SROW + 16 k
    // Offset of row i's slot within its 16-byte chunk (the same in every stage); first0:
    // the first slot of any stage of this warp (only its address is used).
    static __device__ __forceinline__ uint32_t slot_mis(const uint8_t* first0, int i, int kv_heads) {
        return (uint32_t(reinterpret_cast<uintptr_t>(first0)) + uint32_t(i * kv_heads * C::SLOT)) & 15u;
    }
    __device__ __forceinline__ StageCopy(const uint8_t* first0, int kv_heads, int lane) {
        const uint32_t rowb = uint32_t(kv_heads * C::SLOT);
        const int r = lane / LPR, k = lane % LPR;
        const uint32_t mis_r = slot_mis(first0, r, kv_heads);
        const uint32_t mis_l = slot_mis(first0, lane, kv_heads);
        src_main = int32_t(opaque(uint32_t(r) * rowb - mis_r + 16u * uint32_t(k)));
        src_rest = int32_t(opaque(uint32_t(lane) * rowb - mis_l + 16u * LPR));
        stride = opaque(uint32_t(RPI) * rowb);
        dst_main = opaque(uint32_t(r * C::SROW + 16 * k));
    }
    // A full stage (all 32 tokens valid) whose first slot is at `first`.
    __device__ __forceinline__ void load(uint8_t* buf, const uint8_t* first, int lane) const {
        const uint8_t* s = first + src_main;
        uint8_t* d = buf + dst_main;
#pragma unroll
        for (int m = 0; m < LPR; ++m) cp_async_16(d + m * RPI * C::SROW, s + size_t(m) * stride);
        cp_async_16(buf + lane * C::SROW + 16 * LPR, first + src_rest);
    }
};

// BF16 caches copy plain rows (load_tile).
template <int D, int NT>
struct StageCopy<false, D, NT> {
    __device__ __forceinline__ StageCopy(const uint8_t*, int, int) {}
};

// a += f * v per component (the merges' weighted sum of one split's 4 values).
__device__ __forceinline__ void axpy4(float4& a, float f, const float4& v) {
    a.x += f * v.x;
    a.y += f * v.y;
    a.z += f * v.z;
    a.w += f * v.w;
}

// out[0..4) = t / l rounded to bf16 (0 where l is not positive: a head with no token).
__device__ __forceinline__ void store_normalized4(__nv_bfloat16* out, const float4& t, float l) {
    out[0] = __float2bfloat16_rn(l > 0.f ? t.x / l : 0.f);
    out[1] = __float2bfloat16_rn(l > 0.f ? t.y / l : 0.f);
    out[2] = __float2bfloat16_rn(l > 0.f ? t.z / l : 0.f);
    out[3] = __float2bfloat16_rn(l > 0.f ? t.w / l : 0.f);
}

// One warp: the weights w[s] = 2^(m_s - max_s m_s) of the S splits' (m, l) pairs `ml` (0 for
// an empty split), returned with sum_s w[s] l_s to every lane. Each lane keeps the pairs it
// read (the first 64 splits), so one L2 round trip for both passes.
__device__ __forceinline__ float split_weights(const float2* ml, int S, int lane, float* w) {
    float2 c[2];
    float mm = neg_inf();
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int s = lane + 32 * i;
        c[i] = s < S ? __ldcg(ml + s) : make_float2(neg_inf(), 0.f);
        mm = fmaxf(mm, c[i].x);
    }
    for (int s = lane + 64; s < S; s += 32) mm = fmaxf(mm, __ldcg(ml + s).x);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mm = fmaxf(mm, __shfl_xor_sync(FULL, mm, o));
    float ll = 0.f;
    for (int s = lane, i = 0; s < S; s += 32, ++i) {
        const float2 v = i < 2 ? c[i] : __ldcg(ml + s);
        const float f = (v.x == neg_inf() || mm == neg_inf()) ? 0.f : exp2f(v.x - mm);
        w[s] = f;
        ll += f * v.y;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ll += __shfl_xor_sync(FULL, ll, o);
    return ll;
}

// Merge of the `splits` partials of heads qh0 .. qh0 + nh - 1 (global q-head index incl.
// the batch) into out, by one CTA of THREADS threads: warp j finds head j's max and the
// weights w_s = 2^(m_s - max) (into w[nh][splits] in shared memory; split_weights), then
// every thread owns 4 consecutive d of one
// head and sums them over the splits, MU splits' float4 loads in flight at once (one round
// trip for up to MU splits; the merge is the tail of one CTA per head group, so each round
// trip is on the step's critical path).
// Shared memory: (nh * splits + nh) floats (the host checks it fits the kernel's SMEM).
// CFP4_MERGE_BATCH = MU; the host emulation (tests/kv_cache_emu) builds with a smaller one so
// its short sequences' non-empty splits reach a second batch.
#ifndef CFP4_MERGE_BATCH
#define CFP4_MERGE_BATCH 12
#endif
template <int D, int HC, int THREADS>
__device__ __forceinline__ void merge_splits(const KvAttnParams& p, size_t qh0, int nh, float* w) {
    static_assert(D % 4 == 0, "float4 rows");
    constexpr int MU = CFP4_MERGE_BATCH, Q = D / 4;
    const int S = p.part_splits;
    float* lsum = w + nh * S;  // nh <= HC
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int j = warp; j < nh; j += THREADS / 32) {
        const float2* ml = reinterpret_cast<const float2*>(p.part_ml) + (qh0 + j) * S;
        const float ll = split_weights(ml, S, lane, w + j * S);
        if (lane == 0) lsum[j] = ll;
    }
    __syncthreads();
    const float4* po = reinterpret_cast<const float4*>(p.part_o);
    for (int it = threadIdx.x; it < nh * Q; it += THREADS) {
        const int j = it / Q, q = it - j * Q;
        const float4* src = po + (qh0 + j) * S * Q + q;  // split s at src[s * Q]
        const float* wj = w + j * S;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s0 = 0; s0 < S; s0 += MU) {
            float4 v[MU];
#pragma unroll
            for (int u = 0; u < MU; ++u)
                v[u] = s0 + u < S ? __ldcg(src + size_t(s0 + u) * Q) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int u = 0; u < MU; ++u) {
                if (s0 + u < S) axpy4(a, wj[s0 + u], v[u]);
            }
        }
        store_normalized4(static_cast<__nv_bfloat16*>(p.out) + (qh0 + j) * D + 4 * q, a, lsum[j]);
    }
}

}  // namespace
