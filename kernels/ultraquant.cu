// ultraquant.cu: UltraQuant FP4 KV cache: store, read-back, split-KV decode attention.
//
// Format (vLLM PR #57057 "UltraQuant"; src/ultraquant/ is the CPU reference):
//   cache bytes [batch][capacity][kv_heads][slot], one slot per (token, head):
//     [K codes D/2][K scales D/32][V codes D/2][V scales D/32]   (68 / 136 / 272 B at D = 64 / 128 / 256)
//   codes: E2M1, two per byte, even element in the low nibble; scales: UE8M0 per group of
//   32 values, s = 2^(byte - 127), byte 0 = zero sentinel. K is stored rotated by the
//   normalized Walsh-Hadamard transform H_D / sqrt(D); V is not rotated. The allocation is
//   16-byte aligned and has at least 15 bytes of padding after the last slot (the attention
//   kernel copies whole 16-byte chunks around each slot).
//   BF16 cache (same attention kernel, FP4 = false): K and V bf16 [batch][capacity][kv_heads][D].
//
// Store (cfp4_uq_store_d*): one warp per (token, head), lane l holding elements
// l*D/32 .. of K (then V). Bit for bit the CPU encoder: the Walsh-Hadamard butterfly in the
// CPU's stage order with r = f32(1/sqrt 2) and __fadd_rn / __fsub_rn / __fmul_rn (no FMA);
// group absmax by max (exact in any order); the scale exponent floor(RN_f32(log2(c*absmax))
// + 0.5) computed exactly from the bits of c*absmax (src/ultraquant/ue8m0.rs thresholds);
// codes of x / s (IEEE division) by counting midpoints (ties to the lower level).
//
// Read (cfp4_uq_read_d*): decode e2m1 * s in f32, un-rotate K with the same butterfly,
// round to bf16: bit for bit the CPU's decode_slot_unrotated.
//
// Attention (cfp4_kv_attn_{uq,bf16}_d*_nt*): flash decoding. Grid (splits, kv_heads *
// head_chunks, batch); a CTA owns one token range of one (sequence, kv head) and the
// HC = 4*NT query heads of that KV group (so every byte read serves all of them). Each warp
// streams 16-token tiles of that range (tiles warp, warp + NW, ...) through its own
// NSTAGE-deep cp.async pipeline: the bytes of each slot are fetched as the 16-byte-aligned
// chunks that cover it (slots are 136 B = 8 * 17 at D = 128, so a slot starts 8-byte but not
// always 16-byte aligned; the smem copy keeps the slot's offset within its first chunk).
// Math on tensor cores (mma.m16n8k16 bf16, FP32 accumulate), tokens on M:
//   S[16 tok x 8] = K[16 x D] . Qcols[D x 8]; columns 2j / 2j+1 = head j's query split into
//     bf16 hi + lo (q = hi + lo to ~2^-17 relative), so S_hi + S_lo is q.k at ~FP32 accuracy;
//   O^T[16 d x 8] += V^T[16 d x 16 tok] . P[16 tok x 8], P likewise split into hi + lo.
// K and V are dequantized in registers: nibble s e1 e0 m -> bf16 bits s 0000000e1 e0m000000
// (= e2m1 * 2^-126, a subnormal for e = 0) times bf16x2 2^(E + 62) -> e2m1 * s * 2^-64,
// exact; the 2^64 is folded into the softmax scale and the output. Supported scale range:
// 2^-61 <= s <= 2^65 (values beyond are flushed / saturated; bf16 activations never get
// near). Online softmax in the log2 domain (exp2f), FP32. The warps of a CTA merge their
// (max, sum, O) in shared memory; with splits > 1 the CTA writes an unnormalized partial
// and cfp4_kv_combine merges the splits.
// k-order freedom: inside one MMA the k index may be permuted as long as A and B agree; the
// fragments below use the orders that make the decode and the shared-memory loads cheap
// (and bank-conflict free): see kd0() and vd().
#include <stdint.h>
#include <cuda_bf16.h>
#include "ultraquant.cuh"

namespace {

constexpr unsigned FULL = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ---------------------------------------------------------------- format (store / read)

// f32(1/sqrt(2)) = 0x3F3504F3, the CPU's std::f32::consts::FRAC_1_SQRT_2.
__device__ __forceinline__ float inv_sqrt2() { return __uint_as_float(0x3f3504f3u); }

// Normalized Walsh-Hadamard transform of D values held D/32 per lane (lane l holds elements
// l*E .. l*E + E - 1). Stage order and rounding as the CPU (src/ultraquant/hadamard.rs):
// strides 1, 2, 4, ... (the in-lane strides first, then lane strides), each pair
// (u = x[i], v = x[i + h]) -> ((u + v) * r, (u - v) * r).
template <int D>
__device__ __forceinline__ void wht_warp(float (&x)[D / 32], int lane) {
    constexpr int E = D / 32;
    const float r = inv_sqrt2();
#pragma unroll
    for (int h = 1; h < E; h <<= 1) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            if (e & h) continue;
            const float u = x[e], v = x[e + h];
            x[e] = __fmul_rn(__fadd_rn(u, v), r);
            x[e + h] = __fmul_rn(__fsub_rn(u, v), r);
        }
    }
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
        const bool upper = (lane & m) != 0;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const float y = __shfl_xor_sync(FULL, x[e], m);
            x[e] = upper ? __fmul_rn(__fsub_rn(y, x[e]), r) : __fmul_rn(__fadd_rn(x[e], y), r);
        }
    }
}

// ROUND_UP_SIGNIFICAND of src/ultraquant/ue8m0.rs.
__constant__ uint32_t kRoundUp[9] = {3474675u, 3474675u, 3474675u, 3474674u, 3474672u,
                                     3474668u, 3474660u, 3474644u, 3474613u};

// E2M1 values of the 16 codes (code 8 = -0.0).
__constant__ float kE2m1[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// UE8M0 byte of a group with maximum magnitude absmax (scale_for_absmax in ue8m0.rs):
// exp = floor(RN_f32(log2(p)) + 0.5), p = c * absmax rounded to f32, from the bits of p.
__device__ __forceinline__ uint32_t scale_byte(float absmax, float c) {
    if (!(isfinite(absmax) && absmax > 0.f) || !(isfinite(c) && c > 0.f)) return 0u;
    const float p = __fmul_rn(c, absmax);
    if (!(p > 0.f) || isinf(p)) return 0u;
    const uint32_t bits = __float_as_uint(p);
    int e;
    uint32_t m;
    if ((bits >> 23) == 0u) {  // subnormal: normalize to 1.m * 2^e
        const int h = 31 - __clz(int(bits));
        e = h - 149;
        m = (bits << (23 - h)) & 0x7fffffu;
    } else {
        e = int(bits >> 23) - 127;
        m = bits & 0x7fffffu;
    }
    const int k = min(31 - __clz(abs(2 * e + 1)), 8);
    const int ex = e + (m >= kRoundUp[k] ? 1 : 0);
    if (ex < -126) return 0u;
    return uint32_t(min(ex, 127) + 127);
}

// E2M1 code of an already scaled value: count of sorted midpoints below x (a value on a
// midpoint goes to the lower level), as sign-magnitude; NaN -> 0 (e2m1.rs).
__device__ __forceinline__ uint32_t e2m1_encode(float x) {
    if (isnan(x)) return 0u;
    const int i = (x > -5.f) + (x > -3.5f) + (x > -2.5f) + (x > -1.75f) + (x > -1.25f) + (x > -0.75f) +
                  (x > -0.25f) + (x > 0.25f) + (x > 0.75f) + (x > 1.25f) + (x > 1.75f) + (x > 2.5f) +
                  (x > 3.5f) + (x > 5.f);
    return i < 7 ? uint32_t(15 - i) : uint32_t(i - 7);
}

// Quantize D values (E per lane) into `codes` (D/2 bytes) and `scales` (D/32 bytes).
template <int D>
__device__ __forceinline__ void encode_part(const float (&x)[D / 32], uint8_t* codes, uint8_t* scales, float c,
                                            int lane) {
    constexpr int E = D / 32, GL = 32 / E;  // lanes per group of 32 values
    float am = 0.f;
    int bad = 0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        am = fmaxf(am, fabsf(x[e]));
        bad |= isfinite(x[e]) ? 0 : 1;
    }
#pragma unroll
    for (int m = 1; m < GL; m <<= 1) {
        am = fmaxf(am, __shfl_xor_sync(FULL, am, m));
        bad |= __shfl_xor_sync(FULL, bad, m);
    }
    const uint32_t byte = bad ? 0u : scale_byte(am, c);
    uint32_t packed = 0;
    if (byte != 0u) {
        const float s = __uint_as_float(byte << 23);
#pragma unroll
        for (int e = 0; e < E; ++e) packed |= e2m1_encode(__fdiv_rn(x[e], s)) << (4 * e);
    }
    if constexpr (E == 2) {
        codes[lane] = uint8_t(packed);
    } else if constexpr (E == 4) {
        reinterpret_cast<uint16_t*>(codes)[lane] = uint16_t(packed);
    } else {
        reinterpret_cast<uint32_t*>(codes)[lane] = packed;
    }
    if (lane % GL == 0) scales[lane / GL] = uint8_t(byte);
}

__device__ __forceinline__ float ue8m0_value(uint32_t b) {
    return b == 0u ? 0.f : (b == 255u ? __int_as_float(0x7fc00000) : __uint_as_float(b << 23));
}

// x[e] = e2m1(code of element l*E + e) * s, exact (decode_row in group.rs).
template <int D>
__device__ __forceinline__ void decode_part(const uint8_t* codes, const uint8_t* scales, float (&x)[D / 32],
                                            int lane) {
    constexpr int E = D / 32;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = lane * E + e;
        const uint32_t b = codes[d >> 1];
        const uint32_t code = (d & 1) ? (b >> 4) : (b & 15u);
        x[e] = __fmul_rn(kE2m1[code], ue8m0_value(scales[d >> 5]));
    }
}

template <int D>
__device__ __forceinline__ void store_body(const UqStoreParams& p) {
    constexpr int E = D / 32, SLOT = D + D / 16;
    if (p.head_dim != D) __trap();
    const int lane = threadIdx.x & 31;
    const long long wid = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const long long total = (long long)p.n_seq * p.tokens * p.kv_heads;
    if (wid >= total) return;  // whole warps only
    const int h = int(wid % p.kv_heads);
    const long long r = wid / p.kv_heads;
    const int j = int(r % p.tokens);
    const int i = int(r / p.tokens);
    const int seq = p.seq_base + i;
    const size_t pos = size_t(p.lens[seq]) + size_t(j);
    uint8_t* slot = p.cache + ((size_t(seq) * p.capacity + pos) * p.kv_heads + h) * SLOT;
    const size_t row = ((size_t(i) * p.tokens + j) * p.kv_heads + h) * D + size_t(lane) * E;
    const __nv_bfloat16* k = static_cast<const __nv_bfloat16*>(p.k) + row;
    const __nv_bfloat16* v = static_cast<const __nv_bfloat16*>(p.v) + row;
    float x[E];
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = __bfloat162float(k[e]);
    wht_warp<D>(x, lane);
    encode_part<D>(x, slot, slot + D / 2, p.c, lane);
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = __bfloat162float(v[e]);
    encode_part<D>(x, slot + D / 2 + D / 32, slot + D + D / 32, p.c, lane);
}

template <int D>
__device__ __forceinline__ void read_body(const UqReadParams& p) {
    constexpr int E = D / 32, SLOT = D + D / 16;
    if (p.head_dim != D) __trap();
    const int lane = threadIdx.x & 31;
    const long long wid = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (wid >= (long long)p.count * p.kv_heads) return;
    const int h = int(wid % p.kv_heads);
    const int j = int(wid / p.kv_heads);
    const uint8_t* slot = p.cache + ((size_t(p.seq) * p.capacity + size_t(p.start) + j) * p.kv_heads + h) * SLOT;
    __nv_bfloat16* ok = static_cast<__nv_bfloat16*>(p.out) + (size_t(j) * p.kv_heads + h) * D + size_t(lane) * E;
    __nv_bfloat16* ov = ok + size_t(p.count) * p.kv_heads * D;
    float x[E];
    decode_part<D>(slot, slot + D / 2, x, lane);
    wht_warp<D>(x, lane);
#pragma unroll
    for (int e = 0; e < E; ++e) ok[e] = __float2bfloat16_rn(x[e]);
    decode_part<D>(slot + D / 2 + D / 32, slot + D + D / 32, x, lane);
#pragma unroll
    for (int e = 0; e < E; ++e) ov[e] = __float2bfloat16_rn(x[e]);
}

// ---------------------------------------------------------------- PTX wrappers
// (every inline asm of this file is in this section)

// a * b per bf16 half, round to nearest (exact for every product formed here; subnormal
// inputs are kept). sm_80/89 have no mul.bf16x2: a * b + (-0) is the same value.
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
    uint32_t d;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
#else
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#endif
    return d;
}

__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16-byte global -> shared copy; src_bytes = 0 zero-fills without reading.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, uint32_t src_bytes) {
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Bytes of dynamic shared memory this launch has.
__device__ __forceinline__ uint32_t dynamic_smem_size() {
    uint32_t dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    return dyn;
}

// ---------------------------------------------------------------- end of PTX wrappers

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

// UE8M0 byte -> bf16 bits of 2^(E + 62) (E = byte - 127), the factor that turns the decode's
// e2m1 * 2^-126 into e2m1 * s * 2^-64; 0 (zero sentinel) -> 0; bytes above 192 saturate.
__device__ __forceinline__ uint32_t uq_factor(uint32_t byte) {
    return byte == 0u ? 0u : (min(byte, 192u) + 62u) << 7;
}

// 8 E2M1 codes (nibble j = code j) -> 4 bf16x2, out[r] = (code r, code r+4) * sc, exact.
__device__ __forceinline__ void decode_word(uint32_t q, uint32_t sc, uint32_t out[4]) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const uint32_t v = q << (12 - 4 * r);  // nibble r -> bits 15..12, nibble r+4 -> 31..28
        const uint32_t bf = (v & 0x80008000u) | ((v >> 6) & 0x01c001c0u);
        out[r] = bf16x2_mul(bf, sc);
    }
}

__device__ __forceinline__ uint32_t bf16_bits(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }

// The hi (lo = false) or lo (lo = true) bf16 part of x, x ~= hi + lo.
__device__ __forceinline__ uint32_t split_part(float x, bool lo) {
    const __nv_bfloat16 hi = __float2bfloat16_rn(x);
    return lo ? bf16_bits(x - __bfloat162float(hi)) : uint32_t(__bfloat16_as_ushort(hi));
}

template <bool FP4, int D, int NT>
struct Cfg {
    static constexpr int NW = FP4 ? (D == 256 ? 4 : 8) : (D == 256 ? 2 : 4);  // warps per CTA
    static constexpr int THREADS = NW * 32;
    static constexpr int NSTAGE = FP4 ? 3 : 2;
    static constexpr int SLOT = D + D / 16;
    static constexpr int GCD16 = SLOT % 16 == 0 ? 16 : SLOT % 8 == 0 ? 8 : 4;
    // 16-byte chunks per token row: a slot starts at a multiple of GCD16 within its chunk.
    static constexpr int CH = FP4 ? (SLOT + (16 - GCD16) + 15) / 16 : D / 4;
    // Shared bytes per token row (row stride / 4 = 4 mod 8 words: conflict-free loads).
    static constexpr int SROW = FP4 ? CH * 16 : 4 * D + 16;
    static constexpr int STAGE = 16 * SROW;
    static constexpr int HC = 4 * NT;  // query heads per CTA
    static constexpr int KS = D / 16;  // k-steps of S = K . Q
    static constexpr int MT = D / 16;  // m-tiles of O^T
    static constexpr int STAGES_BYTES = NW * NSTAGE * STAGE;
    static constexpr int REDO_BYTES = NW * HC * D * 4;
    static constexpr int QS_OFF = STAGES_BYTES > REDO_BYTES ? STAGES_BYTES : REDO_BYTES;
    static constexpr int RED_OFF = QS_OFF + HC * D * 4;
    static constexpr int SMEM = RED_OFF + 2 * NW * HC * 4;  // mirrored by src/cuda/kv.rs
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

// d of O^T row g in m-tile i (row g + 8 is d + 1).
template <bool FP4>
__device__ __forceinline__ int vd(int i, int g) {
    return FP4 ? 8 * g + 64 * (i >> 2) + 2 * (i & 3) : 16 * i + 2 * g;
}

// One warp's cp.async of a 16-token tile (tokens tb .. tb+15; those >= t1 zero-filled).
template <bool FP4, int D, int NT>
__device__ __forceinline__ void load_tile(uint8_t* buf, const uint8_t* kb, const uint8_t* vb, size_t row0,
                                          int kv_heads, int tb, int t1, int lane) {
    using C = Cfg<FP4, D, NT>;
#pragma unroll 1
    for (int c = lane; c < 16 * C::CH; c += 32) {
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
        cp_async16(dst, ok ? src : kb, ok ? 16u : 0u);
    }
}

template <bool FP4, int D, int NT>
__device__ __forceinline__ void attn_body(const KvAttnParams& p) {
    using C = Cfg<FP4, D, NT>;
    extern __shared__ __align__(16) uint8_t smem[];
    if (dynamic_smem_size() < uint32_t(C::SMEM) || p.head_dim != D || blockDim.x != C::THREADS) __trap();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int split = blockIdx.x;
    const int kvh = blockIdx.y % p.kv_heads, hc = blockIdx.y / p.kv_heads;
    const int b = blockIdx.z;
    const int len = int(p.lens[b]);
    const int per = (((len + p.splits - 1) / p.splits) + 15) & ~15;
    const int t0 = min(split * per, len), t1 = min(t0 + per, len);
    const int ntiles = (t1 - t0 + 15) / 16;
    const int cnt = warp < ntiles ? (ntiles - 1 - warp) / C::NW + 1 : 0;
    const uint8_t* kb = static_cast<const uint8_t*>(p.k);
    const uint8_t* vb = static_cast<const uint8_t*>(p.v);
    const size_t row0 = size_t(b) * p.capacity * p.kv_heads + kvh;
    uint8_t* stages = smem + warp * C::NSTAGE * C::STAGE;

    // Start streaming before the query is prepared.
#pragma unroll
    for (int s = 0; s < C::NSTAGE - 1; ++s) {
        if (s < cnt) load_tile<FP4, D, NT>(stages + s * C::STAGE, kb, vb, row0, p.kv_heads, t0 + 16 * (warp + s * C::NW), t1, lane);
        cp_async_commit();
    }

    // Queries of this CTA's heads (zeros past the group), rotated like K for UltraQuant.
    float* qs = reinterpret_cast<float*>(smem + C::QS_OFF);
    const int head0 = hc * C::HC;
    for (int idx = threadIdx.x; idx < C::HC * D; idx += C::THREADS) {
        const int j = idx / D, d = idx - j * D;
        float x = 0.f;
        if (head0 + j < p.group) {
            const size_t qh = size_t(kvh) * p.group + head0 + j;
            x = __bfloat162float(static_cast<const __nv_bfloat16*>(p.q)[(size_t(b) * p.q_heads + qh) * D + d]);
        }
        qs[idx] = x;
    }
    __syncthreads();
    if constexpr (FP4) {
        const float r = inv_sqrt2();
#pragma unroll 1
        for (int h = 1; h < D; h <<= 1) {
            for (int idx = threadIdx.x; idx < C::HC * D / 2; idx += C::THREADS) {
                const int j = idx / (D / 2), pi = idx - j * (D / 2);
                const int lo = (pi / h) * 2 * h + (pi % h);
                float* row = qs + j * D;
                const float u = row[lo], v = row[lo + h];
                row[lo] = __fmul_rn(__fadd_rn(u, v), r);
                row[lo + h] = __fmul_rn(__fsub_rn(u, v), r);
            }
            __syncthreads();
        }
    }
    // Q operand (B of S = K . Q): column g = head 4nt + g/2, part hi (g even) or lo (g odd).
    uint32_t qb[C::KS][NT][2];
    {
        const bool lo = (g & 1) != 0;
#pragma unroll
        for (int ks = 0; ks < C::KS; ++ks) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const float* row = qs + (4 * nt + (g >> 1)) * D;
                const int d0 = kd0<FP4>(ks, t);
                qb[ks][nt][0] = split_part(row[d0], lo) | (split_part(row[d0 + kE1<FP4>], lo) << 16);
                const int d1 = d0 + kH1<FP4>;
                qb[ks][nt][1] = split_part(row[d1], lo) | (split_part(row[d1 + kE1<FP4>], lo) << 16);
            }
        }
    }
    // Scores in the log2 domain; UltraQuant K carries 2^-64 (see decode_word).
    const float sl = FP4 ? p.scale_log2 * 0x1p64f : p.scale_log2;

    float o[C::MT][NT][4];
    float m[NT], l[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        m[nt] = neg_inf();
        l[nt] = 0.f;
#pragma unroll
        for (int i = 0; i < C::MT; ++i) o[i][nt][0] = o[i][nt][1] = o[i][nt][2] = o[i][nt][3] = 0.f;
    }

#pragma unroll 1
    for (int it = 0; it < cnt; ++it) {
        {
            const int nx = it + C::NSTAGE - 1;
            if (nx < cnt)
                load_tile<FP4, D, NT>(stages + (nx % C::NSTAGE) * C::STAGE, kb, vb, row0, p.kv_heads,
                                      t0 + 16 * (warp + nx * C::NW), t1, lane);
            cp_async_commit();
        }
        cp_async_wait<C::NSTAGE - 1>();
        __syncwarp();
        const uint8_t* buf = stages + (it % C::NSTAGE) * C::STAGE;
        const int tb = t0 + 16 * (warp + it * C::NW);
        auto rowp = [&](int i) -> const uint8_t* {
            if constexpr (FP4) {
                const uint32_t idx = uint32_t(row0 + size_t(tb + i) * p.kv_heads);
                return buf + i * C::SROW + ((idx * uint32_t(C::SLOT)) & 15u);
            } else {
                return buf + i * C::SROW;
            }
        };

        // ---- S = K . Q (rows: tokens g, g + 8)
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        {
            const uint8_t* rg = rowp(g);
            const uint8_t* rg8 = rowp(g + 8);
            if constexpr (FP4) {
                // Thread t reads K-code words t + 4w (group w); word -> 2 k-steps.
#pragma unroll
                for (int w = 0; w < D / 32; ++w) {
                    const uint32_t f0 = uq_factor(rg[D / 2 + w]), f1 = uq_factor(rg8[D / 2 + w]);
                    uint32_t a0[4], a1[4];
                    decode_word(lds32<4>(rg + 4 * (t + 4 * w)), f0 | (f0 << 16), a0);
                    decode_word(lds32<4>(rg8 + 4 * (t + 4 * w)), f1 | (f1 << 16), a1);
#pragma unroll
                    for (int kl = 0; kl < 2; ++kl) {
                        const uint32_t a[4] = {a0[2 * kl], a1[2 * kl], a0[2 * kl + 1], a1[2 * kl + 1]};
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) mma_bf16(s[nt], a, qb[2 * w + kl][nt][0], qb[2 * w + kl][nt][1]);
                    }
                }
            } else {
                const uint32_t* kg = reinterpret_cast<const uint32_t*>(rg);
                const uint32_t* kg8 = reinterpret_cast<const uint32_t*>(rg8);
#pragma unroll
                for (int ks = 0; ks < C::KS; ++ks) {
                    const uint32_t a[4] = {kg[8 * ks + t], kg8[8 * ks + t], kg[8 * ks + 4 + t], kg8[8 * ks + 4 + t]};
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) mma_bf16(s[nt], a, qb[ks][nt][0], qb[ks][nt][1]);
                }
            }
        }

        // ---- online softmax; P operand (B of O^T += V^T . P) by shuffles
        uint32_t pb[NT][2];
        bool rescale = false;
        float alpha[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            float x0 = (s[nt][0] + s[nt][1]) * sl;  // token tb + g, head 4nt + t
            float x1 = (s[nt][2] + s[nt][3]) * sl;  // token tb + g + 8
            if (tb + g >= t1) x0 = neg_inf();
            if (tb + g + 8 >= t1) x1 = neg_inf();
            float mx = fmaxf(x0, x1);
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 16));
            const float mn = fmaxf(m[nt], mx);  // finite: a tile has >= 1 token
            alpha[nt] = exp2f(m[nt] - mn);
            rescale |= alpha[nt] != 1.f;
            const float p0 = exp2f(x0 - mn), p1 = exp2f(x1 - mn);
            l[nt] = l[nt] * alpha[nt] + (p0 + p1);
            m[nt] = mn;
            const uint32_t k0 = split_part(p0, false) | (split_part(p0, true) << 16);
            const uint32_t k1 = split_part(p1, false) | (split_part(p1, true) << 16);
            // B fragment of thread (g, t): tokens 2t, 2t+1 (and +8) of column g.
            const int src = 8 * t + (g >> 1);
            const uint32_t x0a = __shfl_sync(FULL, k0, src), x0b = __shfl_sync(FULL, k0, src + 4);
            const uint32_t x1a = __shfl_sync(FULL, k1, src), x1b = __shfl_sync(FULL, k1, src + 4);
            const uint32_t sel = (g & 1) ? 0x7632u : 0x5410u;
            pb[nt][0] = __byte_perm(x0a, x0b, sel);
            pb[nt][1] = __byte_perm(x1a, x1b, sel);
        }
        if (__any_sync(FULL, rescale)) {
#pragma unroll
            for (int i = 0; i < C::MT; ++i)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int r = 0; r < 4; ++r) o[i][nt][r] *= alpha[nt];
        }

        // ---- O^T += V^T . P (rows: d; A pairs = two tokens of one d)
        {
            const uint8_t* ra = rowp(2 * t);
            const uint8_t* rb = rowp(2 * t + 1);
            const uint8_t* rc = rowp(2 * t + 8);
            const uint8_t* rd = rowp(2 * t + 9);
            if constexpr (FP4) {
                // Thread g reads V-code words g + 8w (m-tiles 4w .. 4w + 3).
#pragma unroll
                for (int w = 0; w < D / 64; ++w) {
                    const int wo = kVC<D> + 4 * (g + 8 * w);
                    const uint32_t wa = lds32<kVC<D>>(ra + wo), wb = lds32<kVC<D>>(rb + wo);
                    const uint32_t wc = lds32<kVC<D>>(rc + wo), wd = lds32<kVC<D>>(rd + wo);
                    const int grp = (g >> 2) + 2 * w;
                    const uint32_t sab = uq_factor(ra[kVS<D> + grp]) | (uq_factor(rb[kVS<D> + grp]) << 16);
                    const uint32_t scd = uq_factor(rc[kVS<D> + grp]) | (uq_factor(rd[kVS<D> + grp]) << 16);
                    uint32_t ab[8], cd[8];  // [n] = (token a/c nibble n, token b/d nibble n)
                    decode_word(__byte_perm(wa, wb, 0x5410), sab, ab);
                    decode_word(__byte_perm(wa, wb, 0x7632), sab, ab + 4);
                    decode_word(__byte_perm(wc, wd, 0x5410), scd, cd);
                    decode_word(__byte_perm(wc, wd, 0x7632), scd, cd + 4);
#pragma unroll
                    for (int il = 0; il < 4; ++il) {
                        const uint32_t a[4] = {ab[2 * il], ab[2 * il + 1], cd[2 * il], cd[2 * il + 1]};
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) mma_bf16(o[4 * w + il][nt], a, pb[nt][0], pb[nt][1]);
                    }
                }
            } else {
                const uint32_t* va = reinterpret_cast<const uint32_t*>(ra + 2 * D);
                const uint32_t* vbp = reinterpret_cast<const uint32_t*>(rb + 2 * D);
                const uint32_t* vc = reinterpret_cast<const uint32_t*>(rc + 2 * D);
                const uint32_t* vdp = reinterpret_cast<const uint32_t*>(rd + 2 * D);
#pragma unroll
                for (int i = 0; i < C::MT; ++i) {
                    const uint32_t wa = va[g + 8 * i], wb = vbp[g + 8 * i], wc = vc[g + 8 * i], wd = vdp[g + 8 * i];
                    const uint32_t a[4] = {__byte_perm(wa, wb, 0x5410), __byte_perm(wa, wb, 0x7632),
                                           __byte_perm(wc, wd, 0x5410), __byte_perm(wc, wd, 0x7632)};
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) mma_bf16(o[i][nt], a, pb[nt][0], pb[nt][1]);
                }
            }
        }
        __syncwarp();  // the buffer is refilled next iteration
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the stage buffers (reused below)

    // ---- merge the warps
    float* red_o = reinterpret_cast<float*>(smem);
    float* red_m = reinterpret_cast<float*>(smem + C::RED_OFF);
    float* red_l = red_m + C::NW * C::HC;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        float lt = l[nt];
        lt += __shfl_xor_sync(FULL, lt, 4);
        lt += __shfl_xor_sync(FULL, lt, 8);
        lt += __shfl_xor_sync(FULL, lt, 16);
        const int j = 4 * nt + t;
        if (g == 0) {
            red_m[warp * C::HC + j] = m[nt];
            red_l[warp * C::HC + j] = lt;
        }
        float* orow = red_o + (warp * C::HC + j) * D;
#pragma unroll
        for (int i = 0; i < C::MT; ++i) {
            const int d = vd<FP4>(i, g);
            *reinterpret_cast<float2*>(orow + d) = make_float2(o[i][nt][0] + o[i][nt][1], o[i][nt][2] + o[i][nt][3]);
        }
    }
    __syncthreads();
    const float unbias = FP4 ? 0x1p64f : 1.f;
    for (int idx = threadIdx.x; idx < C::HC * D; idx += C::THREADS) {
        const int j = idx / D, d = idx - j * D;
        if (head0 + j >= p.group) continue;
        float mm = neg_inf();
#pragma unroll
        for (int w = 0; w < C::NW; ++w) mm = fmaxf(mm, red_m[w * C::HC + j]);
        float ll = 0.f, acc = 0.f;
        if (mm != neg_inf()) {
#pragma unroll
            for (int w = 0; w < C::NW; ++w) {
                const float mw = red_m[w * C::HC + j];
                const float f = mw == neg_inf() ? 0.f : exp2f(mw - mm);
                ll += f * red_l[w * C::HC + j];
                acc += f * red_o[(w * C::HC + j) * D + d];
            }
        }
        acc *= unbias;
        const size_t qh = size_t(b) * p.q_heads + size_t(kvh) * p.group + head0 + j;
        if (p.splits == 1) {
            static_cast<__nv_bfloat16*>(p.out)[qh * D + d] = __float2bfloat16_rn(ll > 0.f ? acc / ll : 0.f);
        } else {
            const size_t ps = qh * p.splits + split;
            p.part_o[ps * D + d] = acc;
            if (d == 0) {
                p.part_ml[2 * ps] = mm;
                p.part_ml[2 * ps + 1] = ll;
            }
        }
    }
}

}  // namespace

#define CFP4_UQ_FORMAT(D)                                                                               \
    extern "C" __global__ void __launch_bounds__(256) cfp4_uq_store_d##D(const __grid_constant__ UqStoreParams p) { \
        store_body<D>(p);                                                                               \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) cfp4_uq_read_d##D(const __grid_constant__ UqReadParams p) {   \
        read_body<D>(p);                                                                                \
    }

CFP4_UQ_FORMAT(64)
CFP4_UQ_FORMAT(128)
CFP4_UQ_FORMAT(256)

#define CFP4_KV_ATTN(FP4, TAG, D, NT)                                                                   \
    extern "C" __global__ void __launch_bounds__(Cfg<FP4, D, NT>::THREADS, NT == 1 ? 2 : 1)           \
        cfp4_kv_attn_##TAG##_d##D##_nt##NT(const __grid_constant__ KvAttnParams p) {                    \
        attn_body<FP4, D, NT>(p);                                                                       \
    }

CFP4_KV_ATTN(true, uq, 64, 1)
CFP4_KV_ATTN(true, uq, 64, 2)
CFP4_KV_ATTN(true, uq, 128, 1)
CFP4_KV_ATTN(true, uq, 128, 2)
CFP4_KV_ATTN(true, uq, 256, 1)
CFP4_KV_ATTN(false, bf16, 64, 1)
CFP4_KV_ATTN(false, bf16, 64, 2)
CFP4_KV_ATTN(false, bf16, 128, 1)
CFP4_KV_ATTN(false, bf16, 128, 2)
CFP4_KV_ATTN(false, bf16, 256, 1)

// Largest split count the combine kernel takes (host clamps to it).
#define CFP4_KV_MAX_SPLITS 1024

extern "C" __global__ void __launch_bounds__(128) cfp4_kv_combine(const __grid_constant__ KvCombineParams p) {
    __shared__ float ws[CFP4_KV_MAX_SPLITS];
    __shared__ float lsum;
    const int qh = blockIdx.x, b = blockIdx.y;
    const size_t base = (size_t(b) * p.q_heads + qh) * p.splits;
    const float* ml = p.part_ml + 2 * base;
    if (p.splits > CFP4_KV_MAX_SPLITS) __trap();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        float mm = neg_inf();
        for (int s = lane; s < p.splits; s += 32) mm = fmaxf(mm, ml[2 * s]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mm = fmaxf(mm, __shfl_xor_sync(FULL, mm, o));
        float ll = 0.f;
        for (int s = lane; s < p.splits; s += 32) {
            const float ms = ml[2 * s];
            const float f = (ms == neg_inf() || mm == neg_inf()) ? 0.f : exp2f(ms - mm);
            ws[s] = f;
            ll += f * ml[2 * s + 1];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ll += __shfl_xor_sync(FULL, ll, o);
        if (lane == 0) lsum = ll;
    }
    __syncthreads();
    const float ll = lsum;
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + (size_t(b) * p.q_heads + qh) * p.head_dim;
    for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < p.splits; ++s) acc += ws[s] * p.part_o[(base + s) * p.head_dim + d];
        out[d] = __float2bfloat16_rn(ll > 0.f ? acc / ll : 0.f);
    }
}
