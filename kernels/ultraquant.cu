// ultraquant.cu: UltraQuant FP4 KV cache: store, read-back, the lengths update and the BF16
// decode append at the device lengths (decode attention over the slots: kv_attention.cu).
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
#include <stdint.h>
#include <cuda_bf16.h>
#include "ultraquant.cuh"
#include "kv_common.cuh"

namespace {

// ---------------------------------------------------------------- format (store / read)


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


}  // namespace

#define CFP4_UQ_FORMAT(D)                                                                               \
    extern "C" __global__ void __launch_bounds__(256) cfp4_uq_store_d##D(const __grid_constant__ UqStoreParams p) { \
        store_body<D>(p);                                                                               \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) cfp4_uq_read_d##D(const __grid_constant__ UqReadParams p) {   \
        read_body<D>(p);                                                                                \
    }

// Every store / read-back of src/variants.rs (generated by build.rs).
#include "ultraquant_instances.inc"

// Lengths update (KvLensParams): after the store, so the store reads the old lengths. It
// waits for the kernel before it (PDL) and lets the next one start early.
extern "C" __global__ void __launch_bounds__(32) cfp4_kv_lens_update(const __grid_constant__ KvLensParams p) {
    griddep_wait();
    griddep_launch_dependents();
    const int i = int(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= p.n_seq) return;
    uint32_t* l = p.lens + p.seq_base + i;
    *l = (p.add ? *l : 0u) + uint32_t(p.value);
}


// Decode append (KvAppendParams, layout in ultraquant.cuh): grid (chunks, batch, 2), z = 0
// K and z = 1 V, one 16-byte chunk per thread. Reads its row from the device lengths, so a
// captured CUDA graph appends at the right row at every replay. Before the lengths update.
extern "C" __global__ void __launch_bounds__(256) cfp4_kv_append(const __grid_constant__ KvAppendParams p) {
    griddep_wait();
    griddep_launch_dependents();
    const int c = int(blockIdx.x) * blockDim.x + threadIdx.x;  // chunk of 8 values
    const int b = int(blockIdx.y);
    if (c * 8 >= p.row_elems || b >= p.batch) return;
    const uint32_t len = p.lens[b];
    if (len >= uint32_t(p.limit)) return;
    const size_t row = size_t(len % uint32_t(p.rows));
    const __nv_bfloat16* src =
        static_cast<const __nv_bfloat16*>(blockIdx.z == 0 ? p.k : p.v) + size_t(b) * p.row_elems;
    const size_t half = size_t(p.batch) * p.rows * p.row_elems;
    __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.dst) + blockIdx.z * half +
                         (size_t(b) * p.rows + row) * p.row_elems;
    reinterpret_cast<uint4*>(dst)[c] = reinterpret_cast<const uint4*>(src)[c];
}
