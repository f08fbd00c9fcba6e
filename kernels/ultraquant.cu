// ultraquant.cu: UltraQuant FP4 KV cache: store, read-back, split-KV decode attention.
//
// Format (vLLM PR #57057 "UltraQuant"; src/ultraquant/ is the CPU reference):
//   cache bytes [batch][capacity][kv_heads][slot], one slot per (token, head):
//     [K codes D/2][K scales D/32][V codes D/2][V scales D/32]   (68 / 136 / 272 B at D = 64 / 128 / 256)
//   codes: E2M1, two per byte, even element in the low nibble; scales: UE8M0 per group of
//   32 values, s = 2^(byte - 127), byte 0 = zero sentinel, byte 255 = NaN (a group holding
//   NaN/Inf, so it propagates as in the BF16 cache). K is stored rotated by the
//   normalized Walsh-Hadamard transform H_D / sqrt(D); V is not rotated. The allocation is
//   16-byte aligned and has at least 15 bytes of padding after the last slot (the attention
//   kernel copies whole 16-byte chunks around each slot).
//   BF16 cache (same attention kernel, FP4 = false): K and V bf16 [batch][capacity][kv_heads][D],
//   D in {64, 80, 96, 128, 256}.
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
// K and V codes go into the MMA as raw bits: nibble s e1 e0 m -> bf16 bits s 0000000e1 e0m000000
// = e2m1 * 2^-126 exactly (a bf16 subnormal for +-0.5; mma.sync keeps subnormal inputs and
// products, checked on the H200), 3.25 integer ops per pair of codes (e2m1_raw_pairs). The UE8M0
// scales (exact powers of 2) never touch the codes:
//   K: each k-step pair lies in one 32-value scale group, so S is summed per group in FP32 and
//      each group sum is multiplied by its scale (2^(byte-127), byte 0 -> 0);
//   V: the 16 d of an O^T m-tile lie in one group, so the scale of (token, group) multiplies
//      that token's P (a bf16 times a power of 2: exact).
// q and P carry 2^64 (so products stay far from the FP32 subnormal range), hence S and O are
// 2^-62 times the true values; sl and the output fold the 2^62 back. Supported range: |q| <
// 2^63, V scales 2^-64 <= s <= 2^63 (beyond: V flushed / saturated); any K scale. Online
// softmax in the log2 domain (ex2.approx.ftz), FP32. The warps of a CTA merge their (max, sum, O) in
// shared memory; with splits > 1 the CTA writes an unnormalized partial and cfp4_kv_combine
// merges the splits.
// k-order freedom: inside one MMA the k index may be permuted as long as A and B agree; the
// fragments below use the orders that make the decode and the shared-memory loads cheap
// (and bank-conflict free): see kd0() and vd().
#include <stdint.h>
#include <cuda_bf16.h>
#include "nvfp4_decode.cuh"  // e2m1_raw_pairs, bf16x2_mul (shared with the GEMV)
#include "ultraquant.cuh"

namespace {

constexpr unsigned FULL = 0xffffffffu;

// Programmatic dependent launch (sm_90+; no-ops in the sm_80 image). Every attention and
// combine CTA waits before its first global access, so a PDL launch only overlaps the
// launch and the register/shared setup with the previous kernel's tail.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

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
    // A group holding NaN/Inf gets the NaN scale 255 and zero codes (decodes to NaN, as
    // encode_group in src/ultraquant/group.rs).
    const uint32_t byte = bad ? 255u : scale_byte(am, c);
    uint32_t packed = 0;
    if (byte != 0u && byte != 255u) {
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
// Row streaming (sm_90+; the kernels that use these trap in the sm_80 image): mbarriers and
// the bulk (TMA) global -> shared copy, completion counted in bytes on an mbarrier.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CFP4_BULK 1
#else
#define CFP4_BULK 0
#endif
#if CFP4_BULK
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
#endif
__device__ __forceinline__ void mbar_init(uint64_t* m, uint32_t count) {
#if CFP4_BULK
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(m)), "r"(count) : "memory");
#endif
}
// Makes initialized mbarriers visible to the async proxy (the bulk copies).
__device__ __forceinline__ void mbar_init_fence() {
#if CFP4_BULK
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint64_t* m) {
#if CFP4_BULK
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(m)) : "memory");
#endif
}
// One arrival that also expects `bytes` more transaction bytes in the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* m, uint32_t bytes) {
#if CFP4_BULK
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(m)), "r"(bytes) : "memory");
#endif
}
// Waits until the phase with parity `parity` of m has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* m, uint32_t parity) {
#if CFP4_BULK
    asm volatile(
        "{\n .reg .pred done;\n WAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(m)),
        "r"(parity)
        : "memory");
#endif
}
// Bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to
// this CTA's shared memory, completing `bytes` transaction bytes on m.
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* m) {
#if CFP4_BULK
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(m))
        : "memory");
#endif
}
// x, opaque to the compiler: a loop-invariant it can no longer rematerialize inside the
// loop from the thread index (it did, at 40 instructions per iteration).
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
    asm volatile("" : "+r"(x));
    return x;
}
__device__ __forceinline__ const uint8_t* opaque(const uint8_t* x) {
    asm volatile("" : "+l"(x));
    return x;
}

// lo | hi << 16 for 16-bit lo, hi, as one multiply-add: on the FMA pipe instead of the
// logic pipe (a PRMT), which the E2M1 decode keeps busier.
__device__ __forceinline__ uint32_t pack_u16(uint32_t lo, uint32_t hi) {
    uint32_t d;
    asm("mad.lo.u32 %0, %1, 0x10000, %2;" : "=r"(d) : "r"(hi), "r"(lo));
    return d;
}

// 2^x with subnormal results flushed to 0 (one MUFU.EX2, without exp2f's subnormal
// fix-up): softmax weights below 2^-126 of the running max (2^-190 with the 2^64 bias)
// do not matter. 2^-inf = 0.
__device__ __forceinline__ float ex2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
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
    static constexpr int SMEM = RED_OFF + 2 * NW * HC * 4;  // mirrored by src/cuda/kv.rs
};

// Row streaming (UltraQuant, D = 128, one head chunk, kv_heads a multiple of 8; sm_90+): a CTA
// serves HB = 8 adjacent KV heads, so per token it needs HB adjacent slots, HB * SLOT
// contiguous bytes (1,088 at D = 128) of the token row. Its 16 warps form NWH = 2 groups;
// group w streams 32-token stages (tiles w, w + 2, ... of the CTA's range) of those row
// chunks with one bulk copy per token row (issued by the group's first warp, one row per
// lane) into shared rows of SRS bytes (row stride / 4 = 20 mod 32 words: the same
// conflict-free loads as SROW), and warp w * HB + h consumes head h's slots of each stage.
// Stages are handed over by mbarriers: full[w][s] (one arrival with the bytes expected,
// completed by the copies) and empty[w][s] (one arrival per consuming warp). The per-head
// strided gather of the other kernels reaches ~70 % of copy bandwidth on the H200, whole-row
// streams ~100 % (benches/cuda/kv_read_ceiling.cu). Opt-in (DecodeOptions::row_stream): on
// the H200 its copy alone reaches 82 % of copy bandwidth at 32k x 8, but its math alone takes
// 93 us there (the per-head kernel, whose copy hides the same math, 99 us in full), and both
// together 124 us (docs/benchmarks.md).
template <int D, int NT>
struct RowsCfg {
    using C = Cfg<true, D, NT>;
    static_assert(D == 128 && NT == 1 && C::NW == 16 && C::TPI == 2, "row streaming: D = 128, NT = 1");
    static constexpr int HB = 8;                   // KV heads per CTA
    static constexpr int NWH = C::NW / HB;         // warps per head = warp groups
    static constexpr int RB = HB * C::SLOT;        // bytes of a token row chunk
    static constexpr int SRS = RB + 16;            // shared row stride
    static constexpr int TT = 16 * C::TPI;         // tokens per stage
    static constexpr int GSTAGE = TT * SRS;        // one group's stage
    // Stages per group: 3, so two are in flight while one is consumed (the group's warps
    // release a stage together; with 2 the copy of the next stage started only when the
    // slowest warp was done with the previous one).
    static constexpr int NST = 3;
    static constexpr int STAGES_BYTES = NWH * NST * GSTAGE;
    static constexpr int REDO_BYTES = C::NW * C::HC * D * 4;
    static constexpr int QS_OFF = STAGES_BYTES > REDO_BYTES ? STAGES_BYTES : REDO_BYTES;
    static constexpr int RED_OFF = QS_OFF + HB * C::HC * D * 4;
    static constexpr int BAR_OFF = RED_OFF + 2 * C::NW * C::HC * 4;
    static constexpr int SMEM = BAR_OFF + 2 * NWH * NST * 8;  // mirrored by src/cuda/kv.rs
    static_assert(RB % 16 == 0 && SRS % 16 == 0 && (SRS / 4) % 8 == 4 && BAR_OFF % 8 == 0, "row layout");
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
        cp_async16(dst, ok ? src : kb, ok ? 16u : 0u);
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
        for (int m = 0; m < LPR; ++m) cp_async16(d + m * RPI * C::SROW, s + size_t(m) * stride, 16u);
        cp_async16(buf + lane * C::SROW + 16 * LPR, first + src_rest, 16u);
    }
};

// BF16 caches copy plain rows (load_tile).
template <int D, int NT>
struct StageCopy<false, D, NT> {
    __device__ __forceinline__ StageCopy(const uint8_t*, int, int) {}
};

// Merge of the `splits` partials of heads qh0 .. qh0 + nh - 1 (global q-head index incl.
// the batch) into out, by one CTA of THREADS threads: warp j finds head j's max and the
// weights w_s = 2^(m_s - max) (into w[nh][splits] in shared memory), then every thread sums
// one (head, d) over the splits with 8 independent L2 loads in flight.
// Shared memory: (nh * splits + nh) floats (the host checks it fits the kernel's SMEM).
template <int D, int HC, int THREADS>
__device__ __forceinline__ void merge_splits(const KvAttnParams& p, size_t qh0, int nh, float* w) {
    const int S = p.part_splits;
    float* lsum = w + nh * S;  // nh <= HC, or HB * group with row streaming
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int j = warp; j < nh; j += THREADS / 32) {
        const float* ml = p.part_ml + 2 * (qh0 + j) * S;
        float mm = neg_inf();
        for (int s = lane; s < S; s += 32) mm = fmaxf(mm, __ldcg(ml + 2 * s));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mm = fmaxf(mm, __shfl_xor_sync(FULL, mm, o));
        float ll = 0.f;
        for (int s = lane; s < S; s += 32) {
            const float ms = __ldcg(ml + 2 * s);
            const float f = (ms == neg_inf() || mm == neg_inf()) ? 0.f : exp2f(ms - mm);
            w[j * S + s] = f;
            ll += f * __ldcg(ml + 2 * s + 1);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ll += __shfl_xor_sync(FULL, ll, o);
        if (lane == 0) lsum[j] = ll;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < nh * D; idx += THREADS) {
        const int j = idx / D, d = idx - j * D;
        const float* po = p.part_o + (qh0 + j) * S * D + d;
        const float* wj = w + j * S;
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        int s = 0;
        for (; s + 8 <= S; s += 8) {
#pragma unroll
            for (int u = 0; u < 8; ++u) acc[u] += wj[s + u] * __ldcg(po + size_t(s + u) * D);
        }
        for (; s < S; ++s) acc[0] += wj[s] * __ldcg(po + size_t(s) * D);
        const float a = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        const float ll = lsum[j];
        static_cast<__nv_bfloat16*>(p.out)[(qh0 + j) * D + d] = __float2bfloat16_rn(ll > 0.f ? a / ll : 0.f);
    }
}

template <bool FP4, int D, int NT, bool ROWS = false>
__device__ __forceinline__ void attn_body(const KvAttnParams& p) {
    using C = Cfg<FP4, D, NT>;
    // Row streaming (see RowsCfg): HB KV heads per CTA; otherwise one.
    using R = RowsCfg<ROWS ? D : 128, 1>;
    static_assert(!ROWS || (FP4 && D == 128 && NT == 1), "row streaming: UltraQuant, D = 128, NT = 1");
    constexpr int HB = ROWS ? R::HB : 1;
    constexpr int NWH = C::NW / HB;                   // warps per KV head
    constexpr int RS = ROWS ? R::SRS : C::SROW;       // shared bytes per stage row
    constexpr int SMEM = ROWS ? R::SMEM : C::SMEM;
    constexpr int QS_OFF = ROWS ? R::QS_OFF : C::QS_OFF;
    constexpr int RED_OFF = ROWS ? R::RED_OFF : C::RED_OFF;
    extern __shared__ __align__(16) uint8_t smem[];
    if (dynamic_smem_size() < uint32_t(SMEM) || p.head_dim != D || blockDim.x != C::THREADS) __trap();
    if constexpr (ROWS) {
        // sm_90+ only; HB heads of one head chunk per CTA.
        if (!CFP4_BULK || p.kv_heads % HB != 0 || p.group > C::HC || int(gridDim.y) * HB != p.kv_heads) __trap();
    }
    // q, lens and the newest slots come from the previous kernels. A late_wait launch (the
    // exact window's ring, queued after the UltraQuant launch of the same call) overlaps the
    // launch before it: it starts once every CTA of that launch is running, i.e. past its
    // griddep_wait, so everything the ring reads is complete; it waits for that launch only
    // before exiting (the kernel wrapper), so that its own dependents see both.
    if (!p.late_wait) griddep_wait();
    griddep_launch_dependents();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int split = blockIdx.x;
    // KV heads kvb .. kvb + HB - 1; warp = wh * HB + hw serves head kvb + hw as the wh-th of
    // its NWH warps (HB = 1: wh = warp).
    const int hw = ROWS ? warp % HB : 0, wh = ROWS ? warp / HB : warp;
    const int kvb = ROWS ? int(blockIdx.y) * HB : int(blockIdx.y) % p.kv_heads;
    const int hc = ROWS ? 0 : int(blockIdx.y) / p.kv_heads;
    const int kvh = kvb + hw;
    const int b = blockIdx.z;
    // Tokens this launch attends over: all, or with an exact window of the last `win` tokens
    // in a BF16 ring, the UltraQuant slots before it / the ring rows.
    const int len_all = int(p.lens[b]);
    const int len = p.win <= 0 ? len_all : FP4 ? max(len_all - p.win, 0) : min(len_all, p.win);
    constexpr int TT = 16 * C::TPI;  // tokens per stage
    const int per = (((len + p.splits - 1) / p.splits) + TT - 1) / TT * TT;
    const int t0 = min(split * per, len), t1 = min(t0 + per, len);
    const int ntiles = (t1 - t0 + TT - 1) / TT;
    const int cnt = wh < ntiles ? (ntiles - 1 - wh) / NWH + 1 : 0;
    const uint8_t* kb = static_cast<const uint8_t*>(p.k);
    const uint8_t* vb = static_cast<const uint8_t*>(p.v);
    const size_t row0 = size_t(b) * p.capacity * p.kv_heads + kvh;
    uint8_t* stages = smem + warp * C::NSTAGE * C::STAGE;
    // This warp's first slot; later stages are `step` bytes apart (UltraQuant).
    const uint8_t* first0 = opaque(kb + (row0 + size_t(t0 + TT * warp) * p.kv_heads) * C::SLOT);
    const size_t step = size_t(TT) * C::NW * p.kv_heads * C::SLOT;
    const StageCopy<FP4, D, NT> copy(first0, p.kv_heads, lane);
    // cp.async of this warp's stage `it` into stage buffer `buf`.
    auto issue = [&](uint8_t* buf, int it) {
        const int tb = t0 + TT * (wh + it * NWH);
        if constexpr (FP4) {
            if (tb + TT <= t1) {
                copy.load(buf, first0 + size_t(it) * step, lane);
                return;
            }
        }
        load_tile<FP4, D, NT>(buf, kb, vb, row0, p.kv_heads, tb, t1, lane);
    };

    // Row streaming: stage s of group wh, its mbarriers, and the bulk copy of a stage by the
    // group's first warp (hw == 0): lane i copies token row i's chunk of heads kvb .. (rows
    // past t1 are zero-filled instead: stale bytes could hold a V scale of 2^128).
    uint8_t* const gst = smem + wh * R::NST * R::GSTAGE;
    uint64_t* const bar_full = reinterpret_cast<uint64_t*>(smem + R::BAR_OFF) + wh * R::NST;
    uint64_t* const bar_empty = reinterpret_cast<uint64_t*>(smem + R::BAR_OFF) + (R::NWH + wh) * R::NST;
    auto produce = [&](int it) {
        const int s = it % R::NST;
        const int tb = t0 + TT * (wh + it * NWH);
        const int nvalid = min(max(t1 - tb, 0), TT);
        uint8_t* row = gst + s * R::GSTAGE + lane * R::SRS;
        if (lane >= nvalid) {
            for (int c = 0; c < R::RB / 16; ++c) reinterpret_cast<uint4*>(row)[c] = make_uint4(0u, 0u, 0u, 0u);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive_expect_tx(bar_full + s, uint32_t(nvalid * R::RB));
        __syncwarp();
        if (lane < nvalid) {
            const size_t slot = (size_t(b) * p.capacity + size_t(tb + lane)) * p.kv_heads + kvb;
            bulk_g2s(row, kb + slot * C::SLOT, uint32_t(R::RB), bar_full + s);
        }
    };
    if constexpr (ROWS) {
        if (threadIdx.x == 0) {
            uint64_t* bars = reinterpret_cast<uint64_t*>(smem + R::BAR_OFF);  // full[NWH][NST], empty[NWH][NST]
            for (int i = 0; i < 2 * R::NWH * R::NST; ++i) mbar_init(bars + i, i < R::NWH * R::NST ? 1u : uint32_t(HB));
            mbar_init_fence();
        }
        __syncthreads();
    }

    // Start streaming before the query is prepared.
#pragma unroll
    for (int s = 0; s < (ROWS ? R::NST : C::NSTAGE) - 1; ++s) {
        if constexpr (ROWS) {
            if (hw == 0 && s < cnt) produce(s);
        } else {
            if (s < cnt) issue(stages + s * C::STAGE, s);
            cp_async_commit();
        }
    }

    // Queries of this CTA's heads (zeros past the group), rotated like K for UltraQuant.
    // Row r = HC * (head of the CTA) + j.
    float* qs = reinterpret_cast<float*>(smem + QS_OFF);
    const int head0 = hc * C::HC;
    for (int idx = threadIdx.x; idx < HB * C::HC * D; idx += C::THREADS) {
        const int r = idx / D, d = idx - r * D;
        const int j = ROWS ? r % C::HC : r;
        float x = 0.f;
        if (head0 + j < p.group) {
            const size_t qh = size_t(kvb + (ROWS ? r / C::HC : 0)) * p.group + head0 + j;
            x = __bfloat162float(static_cast<const __nv_bfloat16*>(p.q)[(size_t(b) * p.q_heads + qh) * D + d]);
        }
        qs[idx] = x;
    }
    __syncthreads();
    if constexpr (FP4) {
        const float r = inv_sqrt2();
#pragma unroll 1
        for (int h = 1; h < D; h <<= 1) {
            for (int idx = threadIdx.x; idx < HB * C::HC * D / 2; idx += C::THREADS) {
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
    // UltraQuant: q carries 2^64 and the raw K codes 2^-126 (e2m1_raw_pairs), so S is 2^-62
    // times the true scores (folded into sl); V codes 2^-126 and P 2^64: O is 2^-62 times (unbias).
    const float qbias = FP4 ? 0x1p64f : 1.f;
    uint32_t qb[C::KS][NT][2];
    {
        const bool lo = (g & 1) != 0;
#pragma unroll
        for (int ks = 0; ks < C::KS; ++ks) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const float* row = qs + (hw * C::HC + 4 * nt + (g >> 1)) * D;
                const int d0 = kd0<FP4>(ks, t);
                const int d1 = d0 + kH1<FP4>;
                qb[ks][nt][0] = split_part(row[d0] * qbias, lo) | (split_part(row[d0 + kE1<FP4>] * qbias, lo) << 16);
                qb[ks][nt][1] = split_part(row[d1] * qbias, lo) | (split_part(row[d1 + kE1<FP4>] * qbias, lo) << 16);
            }
        }
    }
    // Scores in the log2 domain; P (and so l) carries 2^pbias: 2^64 for UltraQuant.
    const float sl = FP4 ? p.scale_log2 * 0x1p62f : p.scale_log2;
    const float pbias = FP4 ? 64.f : 0.f;

    float o[C::MT][NT][4];
    float m[NT], l[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        m[nt] = neg_inf();
        l[nt] = 0.f;
#pragma unroll
        for (int i = 0; i < C::MT; ++i) o[i][nt][0] = o[i][nt][1] = o[i][nt][2] = o[i][nt][3] = 0.f;
    }

    // Shared-memory offsets of the stage rows this thread reads (slot offset within the row
    // included; the same in every stage, see StageCopy): rows g, 2t and 2t + 1 (their + 8,
    // + 16 and + 24 rows have the same slot offsets).
    auto row_off = [&](int i) -> uint32_t {
        if constexpr (ROWS) {
            return uint32_t(i * RS + hw * C::SLOT);  // rows are 16-byte aligned, slots 8-byte
        } else if constexpr (FP4) {
            return uint32_t(i * C::SROW) + StageCopy<FP4, D, NT>::slot_mis(first0, i, p.kv_heads);
        } else {
            return uint32_t(i * C::SROW);
        }
    };
    const uint32_t off_g = opaque(row_off(g)), off_a = opaque(row_off(2 * t)), off_b = opaque(row_off(2 * t + 1));

#pragma unroll 1
    for (int it = 0; it < cnt; ++it) {
        const uint8_t* buf;
        if constexpr (ROWS) {
            const int nx = it + R::NST - 1;
            if (hw == 0 && nx < cnt) {
                // its previous use, iteration nx - NST, is consumed by every warp of the group
                if (nx >= R::NST) mbar_wait(bar_empty + nx % R::NST, uint32_t(nx / R::NST - 1) & 1u);
                produce(nx);
            }
            mbar_wait(bar_full + it % R::NST, uint32_t(it / R::NST) & 1u);
            buf = gst + (it % R::NST) * R::GSTAGE;
        } else {
            const int nx = it + C::NSTAGE - 1;
            if (nx < cnt) issue(stages + (nx % C::NSTAGE) * C::STAGE, nx);
            cp_async_commit();
            cp_async_wait<C::NSTAGE - 1>();
            __syncwarp();
            buf = stages + (it % C::NSTAGE) * C::STAGE;
        }
        const int tb0 = t0 + TT * (wh + it * NWH);
        const bool full = tb0 + TT <= t1;  // warp-uniform: no token of the stage is masked
        const uint8_t* bg = buf + off_g;  // rows g (+ 8, + 16, + 24)
        const uint8_t* ba = buf + off_a;  // rows 2t (+ 8, + 16, + 24)
        const uint8_t* bb = buf + off_b;  // rows 2t + 1 (+ 8, + 16, + 24)

        // ---- S = K . Q per tile e (rows: tokens 16e + g, 16e + g + 8)
        float sa_[C::TPI][NT][4];
#pragma unroll
        for (int e = 0; e < C::TPI; ++e) {
            float (&s)[NT][4] = sa_[e];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
            const uint8_t* rg = bg + 16 * e * RS;
            const uint8_t* rg8 = bg + (16 * e + 8) * RS;
            if constexpr (FP4) {
                // Thread t reads K-code words t + 4w (group w); word -> 2 k-steps, summed per
                // group in FP32 and then scaled by the group's UE8M0 scale (exact power of 2).
                constexpr int G = D / 32;
                uint32_t sg[(G + 3) / 4], sg8[(G + 3) / 4];
                load_scale_words<G>(rg + D / 2, sg);
                load_scale_words<G>(rg8 + D / 2, sg8);
#pragma unroll
                for (int w = 0; w < G; ++w) {
                    float acc[NT][4];
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
                    uint32_t a0[4], a1[4];
                    e2m1_raw_pairs<true>(lds32<4>(rg + 4 * (t + 4 * w)), a0);
                    e2m1_raw_pairs<true>(lds32<4>(rg8 + 4 * (t + 4 * w)), a1);
#pragma unroll
                    for (int kl = 0; kl < 2; ++kl) {
                        const uint32_t a[4] = {a0[2 * kl], a1[2 * kl], a0[2 * kl + 1], a1[2 * kl + 1]};
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) mma_bf16(acc[nt], a, qb[2 * w + kl][nt][0], qb[2 * w + kl][nt][1]);
                    }
                    const float f0 = scale_f32<G>(sg, w), f1 = scale_f32<G>(sg8, w);
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        s[nt][0] = fmaf(f0, acc[nt][0], s[nt][0]);
                        s[nt][1] = fmaf(f0, acc[nt][1], s[nt][1]);
                        s[nt][2] = fmaf(f1, acc[nt][2], s[nt][2]);
                        s[nt][3] = fmaf(f1, acc[nt][3], s[nt][3]);
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

        // ---- online softmax over the TPI tiles; P operand (B of O^T += V^T . P) by shuffles
        uint32_t pb[C::TPI][NT][2];
        bool rescale = false;
        float alpha[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            // x: S in the scaled domain (score * log2(e) / sqrt(D) = x * sl), token tb + g (and
            // + 8), head 4nt + t.
            float x[C::TPI][2];
            float mx = neg_inf();
#pragma unroll
            for (int e = 0; e < C::TPI; ++e) {
                x[e][0] = sa_[e][nt][0] + sa_[e][nt][1];
                x[e][1] = sa_[e][nt][2] + sa_[e][nt][3];
                if (!full) {
                    const int tb = tb0 + 16 * e;
                    if (tb + g >= t1) x[e][0] = neg_inf();
                    if (tb + g + 8 >= t1) x[e][1] = neg_inf();
                }
                mx = fmaxf(mx, fmaxf(x[e][0], x[e][1]));
            }
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 16));
            // sl > 0, so the max commutes with the scale; finite: a stage has >= 1 token.
            const float mn = fmaxf(m[nt], mx * sl);
            alpha[nt] = ex2_ftz(m[nt] - mn);
            rescale |= alpha[nt] != 1.f;
            const float mb = mn - pbias;  // P carries 2^pbias
            float lsum = 0.f;
            const int src = 8 * t + (g >> 1);
            const uint32_t sel = (g & 1) ? 0x7632u : 0x5410u;
#pragma unroll
            for (int e = 0; e < C::TPI; ++e) {
                const float p0 = ex2_ftz(fmaf(x[e][0], sl, -mb)), p1 = ex2_ftz(fmaf(x[e][1], sl, -mb));
                lsum += p0 + p1;
                const uint32_t k0 = split_part(p0, false) | (split_part(p0, true) << 16);
                const uint32_t k1 = split_part(p1, false) | (split_part(p1, true) << 16);
                // B fragment of thread (g, t): tokens 2t, 2t+1 (and +8) of column g.
                const uint32_t x0a = __shfl_sync(FULL, k0, src), x0b = __shfl_sync(FULL, k0, src + 4);
                const uint32_t x1a = __shfl_sync(FULL, k1, src), x1b = __shfl_sync(FULL, k1, src + 4);
                pb[e][nt][0] = __byte_perm(x0a, x0b, sel);
                pb[e][nt][1] = __byte_perm(x1a, x1b, sel);
            }
            l[nt] = l[nt] * alpha[nt] + lsum;
            m[nt] = mn;
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
#pragma unroll
        for (int e = 0; e < C::TPI; ++e) {
            const uint8_t* ra = ba + 16 * e * RS;
            const uint8_t* rb = bb + 16 * e * RS;
            const uint8_t* rc = ba + (16 * e + 8) * RS;
            const uint8_t* rd = bb + (16 * e + 8) * RS;
            if constexpr (FP4) {
                // Group j: thread g reads the codes of d = 32j + 4g .. +3 (16 bits) of its four
                // tokens; m-tiles 2j, 2j + 1 (see vd). The V scale of (token, group) is
                // folded into P (exact: a power of 2 times a bf16), per token pair.
                constexpr int G = D / 32;
                uint32_t sa[(G + 3) / 4], sb[(G + 3) / 4], sc[(G + 3) / 4], sd[(G + 3) / 4];
                load_scale_words<G>(ra + kVS<D>, sa);
                load_scale_words<G>(rb + kVS<D>, sb);
                load_scale_words<G>(rc + kVS<D>, sc);
                load_scale_words<G>(rd + kVS<D>, sd);
#pragma unroll
                for (int j = 0; j < G; ++j) {
                    const int wo = kVC<D> + 16 * j + 2 * g;
                    const uint32_t ha = *reinterpret_cast<const uint16_t*>(ra + wo);
                    const uint32_t hb = *reinterpret_cast<const uint16_t*>(rb + wo);
                    const uint32_t hc = *reinterpret_cast<const uint16_t*>(rc + wo);
                    const uint32_t hd = *reinterpret_cast<const uint16_t*>(rd + wo);
                    uint32_t ab[4], cd[4];  // [r] = (token a/c, token b/d) at d = 32j + 4g + r
                    e2m1_raw_pairs<true>(pack_u16(ha, hb), ab);
                    e2m1_raw_pairs<true>(pack_u16(hc, hd), cd);
                    const uint32_t fab = scale_pair_bf16<G>(sa, sb, j), fcd = scale_pair_bf16<G>(sc, sd, j);
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        const uint32_t b0 = bf16x2_mul(pb[e][nt][0], fab), b1 = bf16x2_mul(pb[e][nt][1], fcd);
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const uint32_t a[4] = {ab[2 * h], ab[2 * h + 1], cd[2 * h], cd[2 * h + 1]};
                            mma_bf16(o[2 * j + h][nt], a, b0, b1);
                        }
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
                    for (int nt = 0; nt < NT; ++nt) mma_bf16(o[i][nt], a, pb[e][nt][0], pb[e][nt][1]);
                }
            }
        }
        __syncwarp();  // the buffer is refilled next iteration
        if constexpr (ROWS) {
            if (lane == 0) mbar_arrive(bar_empty + it % R::NST);
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the stage buffers (reused below)

    // ---- merge the warps
    float* red_o = reinterpret_cast<float*>(smem);
    float* red_m = reinterpret_cast<float*>(smem + RED_OFF);
    float* red_l = red_m + C::NW * C::HC;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        float lt = l[nt] * (FP4 ? 0x1p-64f : 1.f);  // drop P's 2^pbias (exact)
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
    const float unbias = FP4 ? 0x1p62f : 1.f;
    for (int idx = threadIdx.x; idx < HB * C::HC * D; idx += C::THREADS) {
        const int r = idx / D, d = idx - r * D;
        const int j = ROWS ? r % C::HC : r, hh = ROWS ? r / C::HC : 0;  // head kvb + hh: warps hh, hh + HB, ...
        if (head0 + j >= p.group) continue;
        float mm = neg_inf();
#pragma unroll
        for (int w = hh; w < C::NW; w += HB) mm = fmaxf(mm, red_m[w * C::HC + j]);
        float ll = 0.f, acc = 0.f;
        if (mm != neg_inf()) {
#pragma unroll
            for (int w = hh; w < C::NW; w += HB) {
                const float mw = red_m[w * C::HC + j];
                const float f = mw == neg_inf() ? 0.f : exp2f(mw - mm);
                ll += f * red_l[w * C::HC + j];
                acc += f * red_o[(w * C::HC + j) * D + d];
            }
        }
        acc *= unbias;
        const size_t qh = size_t(b) * p.q_heads + size_t(kvb + hh) * p.group + head0 + j;
        if (p.part_splits == 1) {
            static_cast<__nv_bfloat16*>(p.out)[qh * D + d] = __float2bfloat16_rn(ll > 0.f ? acc / ll : 0.f);
        } else {
            const size_t ps = qh * p.part_splits + p.split_base + split;
            p.part_o[ps * D + d] = acc;
            if (d == 0) {
                p.part_ml[2 * ps] = mm;
                p.part_ml[2 * ps + 1] = ll;
            }
        }
    }
    if (p.part_splits > 1 && p.counters != nullptr) {
        // The last CTA of this (sequence, head group) to finish, over every launch writing
        // these partials, merges all of them.
        __shared__ bool last;
        __threadfence();  // this CTA's partials are visible before its count is
        __syncthreads();
        if (threadIdx.x == 0) {
            uint32_t* ctr = p.counters + size_t(b) * gridDim.y + blockIdx.y;
            last = atomicAdd(ctr, 1u) == uint32_t(p.part_splits - 1);
            if (last) *ctr = 0u;  // every split has counted: ready for the next launch
        }
        __syncthreads();
        if (!last) return;
        __threadfence();
        // Row streaming: the HB heads' groups are consecutive (head0 = 0, group <= HC).
        merge_splits<D, HB * C::HC, C::THREADS>(p, size_t(b) * p.q_heads + size_t(kvb) * p.group + head0,
                                                ROWS ? HB * p.group : min(C::HC, p.group - head0),
                                                reinterpret_cast<float*>(smem));
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
    extern "C" __global__ void __launch_bounds__(Cfg<FP4, D, NT>::THREADS, Cfg<FP4, D, NT>::MINB)           \
        cfp4_kv_attn_##TAG##_d##D##_nt##NT(const __grid_constant__ KvAttnParams p) {                    \
        attn_body<FP4, D, NT>(p);                                                                       \
        if (p.late_wait) griddep_wait();                                                                \
    }

CFP4_KV_ATTN(true, uq, 64, 1)
CFP4_KV_ATTN(true, uq, 64, 2)
CFP4_KV_ATTN(true, uq, 128, 1)
CFP4_KV_ATTN(true, uq, 128, 2)
CFP4_KV_ATTN(true, uq, 256, 1)
// Row streaming (RowsCfg): UltraQuant, D = 128, up to 4 query heads per KV head.
extern "C" __global__ void __launch_bounds__(Cfg<true, 128, 1>::THREADS, 1)
    cfp4_kv_attn_uqrows_d128_nt1(const __grid_constant__ KvAttnParams p) {
    attn_body<true, 128, 1, true>(p);
    if (p.late_wait) griddep_wait();
}
CFP4_KV_ATTN(false, bf16, 64, 1)
CFP4_KV_ATTN(false, bf16, 64, 2)
CFP4_KV_ATTN(false, bf16, 80, 1)
CFP4_KV_ATTN(false, bf16, 80, 2)
CFP4_KV_ATTN(false, bf16, 96, 1)
CFP4_KV_ATTN(false, bf16, 96, 2)
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
    griddep_wait();  // the partials come from the attention kernel
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
    // Thread (d, j) sums splits j, j + J, ... of element d (J = blockDim / head_dim lanes per
    // d, 8 independent loads in flight each), then the J partial sums meet in shared memory.
    __shared__ float part[128];
    const int J = max(1, int(blockDim.x) / p.head_dim);
    const int d0 = threadIdx.x % p.head_dim, j0 = threadIdx.x / p.head_dim;
    // (threads past J * head_dim, e.g. 80..127 at head_dim 80, have nothing to do)
    for (int d = d0; j0 < J && d < p.head_dim; d += blockDim.x) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        int s = j0;
        for (; s + 7 * J < p.splits; s += 8 * J) {
#pragma unroll
            for (int u = 0; u < 8; ++u) acc[u] += ws[s + u * J] * __ldcg(p.part_o + (base + s + u * J) * p.head_dim + d);
        }
        for (; s < p.splits; s += J) acc[0] += ws[s] * __ldcg(p.part_o + (base + s) * p.head_dim + d);
        const float a = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        if (J == 1) {
            out[d] = __float2bfloat16_rn(ll > 0.f ? a / ll : 0.f);
        } else {
            part[threadIdx.x] = a;
        }
    }
    if (J > 1) {
        __syncthreads();
        if (threadIdx.x < p.head_dim) {
            float a = 0.f;
            for (int j = 0; j < J; ++j) a += part[j * p.head_dim + threadIdx.x];
            out[threadIdx.x] = __float2bfloat16_rn(ll > 0.f ? a / ll : 0.f);
        }
    }
}
