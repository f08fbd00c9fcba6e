// Host emulation of the CUDA features kernels/ultraquant.cu uses (driven by
// tests/kv_cache_emu.rs): one std::thread per CUDA thread, one block at a time; barriers for
// __syncthreads and the warp collectives (shuffles, vote, mma); the PTX wrappers of the .cu
// (its "PTX wrappers" section is cut out) re-implemented from their PTX semantics:
// mma.m16n8k16 bf16 fragment layout with FP32 accumulation (sequential, not the tensor
// cores' order), mul.rn.bf16x2 keeping subnormals; cp.async lands at the thread's wait
// (tests/emu_common/cp_async_emu.h), so it checks indexing, data flow and the waits, not the
// pipeline's timing. It checks logic, not performance.
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <barrier>
#include <thread>
#include <vector>
#include <memory>
#include <functional>
#include <fstream>
#include <iterator>
#include <string>
#include <algorithm>
#include "cuda_bf16.h"

// The kernels' headers drop their device-only PTX wrappers (cp_async.cuh, gemv_common.cuh,
// nvfp4_decode.cuh); the stand-ins are here and in the emulators' own headers.
#define CFP4_HOST_EMU 1
#include "cp_async_emu.h"

using std::isfinite; using std::isnan; using std::isinf;
struct dim3 { unsigned x = 1, y = 1, z = 1; };
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
struct float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct alignas(16) uint4 { uint32_t x, y, z, w; };
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
inline float2 make_float2(float a, float b) { return {a, b}; }

#define __device__
#define __forceinline__ inline
#define __global__
#define __constant__
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static
#define __align__(n) alignas(n)

inline void __trap() { std::fprintf(stderr, "__trap()\n"); std::abort(); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(uint32_t(x)); }
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
    uint8_t b[8]; std::memcpy(b, &x, 4); std::memcpy(b + 4, &y, 4);
    uint32_t r = 0;
    for (int i = 0; i < 4; ++i) r |= uint32_t(b[(s >> (4 * i)) & 7]) << (8 * i);
    return r;
}

// ---- thread machinery
struct Warp {
    std::barrier<> bar{32};
    uint64_t slot[32];
    uint32_t a[32][4], b[32][2];
};
struct Block {
    std::unique_ptr<std::barrier<>> bar;
    std::vector<std::unique_ptr<Warp>> warps;
};
inline Block* g_block = nullptr;
inline std::vector<uint8_t> g_smem;
inline uint8_t* emu_dyn_smem() { return g_smem.data(); }
inline size_t g_dyn_bytes = 0;

inline int lane_id() { return threadIdx.x & 31; }
inline Warp& my_warp() { return *g_block->warps[threadIdx.x / 32]; }
inline void __syncthreads() { g_block->bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { my_warp().bar.arrive_and_wait(); }

template <class T> inline T shfl_raw(T v, int src) {
    Warp& w = my_warp();
    uint64_t r = 0; std::memcpy(&r, &v, sizeof(T));
    w.slot[lane_id()] = r;
    w.bar.arrive_and_wait();
    uint64_t o = w.slot[src & 31];
    w.bar.arrive_and_wait();
    T out; std::memcpy(&out, &o, sizeof(T));
    return out;
}
template <class T> inline T __shfl_sync(unsigned, T v, int src) { return shfl_raw(v, src); }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int m) { return shfl_raw(v, lane_id() ^ m); }
inline bool __any_sync(unsigned, bool p) {
    Warp& w = my_warp();
    w.slot[lane_id()] = p ? 1 : 0;
    w.bar.arrive_and_wait();
    bool any = false; for (int i = 0; i < 32; ++i) any |= w.slot[i] != 0;
    w.bar.arrive_and_wait();
    return any;
}

// ---- PTX wrappers, by their PTX semantics
inline float bf_lo(uint32_t v) { return __uint_as_float(v << 16); }
inline float bf_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
inline uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
    // mul.rn.bf16x2: product rounded to bf16 (subnormals kept)
    uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(bf_lo(a) * bf_lo(b)));
    uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(bf_hi(a) * bf_hi(b)));
    return lo | (hi << 16);
}
// mma.m16n8k16 row.col bf16 -> f32. Fragments: A a0=(g, 2t..2t+1) a1=(g+8, 2t..) a2=(g, 2t+8..) a3=(g+8, 2t+8..);
// B b0=(k 2t..2t+1, n g) b1=(k 2t+8.., n g); C c0,c1=(g, 2t..2t+1) c2,c3=(g+8, 2t..2t+1).
inline void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    Warp& w = my_warp();
    int l = lane_id();
    for (int i = 0; i < 4; ++i) w.a[l][i] = a[i];
    w.b[l][0] = b0; w.b[l][1] = b1;
    w.bar.arrive_and_wait();
    float A[16][16], B[16][8];
    for (int ln = 0; ln < 32; ++ln) {
        int g = ln >> 2, t = ln & 3;
        const uint32_t* f = w.a[ln];
        A[g][2*t] = bf_lo(f[0]); A[g][2*t+1] = bf_hi(f[0]);
        A[g+8][2*t] = bf_lo(f[1]); A[g+8][2*t+1] = bf_hi(f[1]);
        A[g][2*t+8] = bf_lo(f[2]); A[g][2*t+9] = bf_hi(f[2]);
        A[g+8][2*t+8] = bf_lo(f[3]); A[g+8][2*t+9] = bf_hi(f[3]);
        B[2*t][g] = bf_lo(w.b[ln][0]); B[2*t+1][g] = bf_hi(w.b[ln][0]);
        B[2*t+8][g] = bf_lo(w.b[ln][1]); B[2*t+9][g] = bf_hi(w.b[ln][1]);
    }
    w.bar.arrive_and_wait();
    int g = l >> 2, t = l & 3;
    int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2*t, 2*t+1, 2*t, 2*t+1};
    for (int r = 0; r < 4; ++r) {
        float s = c[r];
        for (int k = 0; k < 16; ++k) s += A[rows[r]][k] * B[k][cols[r]];
        c[r] = s;
    }
}
inline uint32_t opaque(uint32_t x) { return x; }
inline const uint8_t* opaque(const uint8_t* x) { return x; }
inline uint32_t pack_u16(uint32_t lo, uint32_t hi) { return lo + (hi << 16); }
// ex2.approx.ftz.f32: 2^x (exact here, not approximate), subnormal results flushed to +0.
inline float ex2_ftz(float x) {
    const float y = std::exp2(x);
    return std::fabs(y) < 1.17549435e-38f ? 0.f : y;
}
inline float __ldcg(const float* p) { return *p; }
inline float2 __ldcg(const float2* p) { return *p; }
inline float4 __ldcg(const float4* p) { return *p; }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline uint32_t dynamic_smem_size() { return uint32_t(g_dyn_bytes); }

// ---- case files (the harnesses read their inputs and write their outputs as raw bytes)
template <class T = uint8_t> std::vector<T> emu_read(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    std::vector<char> b((std::istreambuf_iterator<char>(f)), {});
    std::vector<T> v(b.size() / sizeof(T));
    std::memcpy(v.data(), b.data(), v.size() * sizeof(T));
    return v;
}
inline void emu_write(const std::string& path, const void* data, size_t bytes) {
    std::ofstream f(path, std::ios::binary);
    f.write(static_cast<const char*>(data), std::streamsize(bytes));
}

// The case loop of the directory-per-case harnesses (packed GEMV, norm): run(dir, params)
// for each case directory listed in cases.txt, params its params.txt opened; a nonzero
// return ends the loop with that exit code. Prints "ran N cases" (what the Rust tests look
// for) after the last.
template <class F> int emu_cases(F run) {
    std::ifstream cf("cases.txt");
    std::string dir;
    int ran = 0;
    while (std::getline(cf, dir)) {
        if (dir.empty()) continue;
        std::ifstream pf(dir + "/params.txt");
        if (const int rc = run(dir, pf)) return rc;
        ++ran;
    }
    std::printf("ran %d cases\n", ran);
    return 0;
}
// 2 with a message when a case's params.txt did not parse, else 0.
inline int emu_bad_params(const std::istream& pf, const std::string& dir) {
    if (pf) return 0;
    std::fprintf(stderr, "%s: bad params.txt\n", dir.c_str());
    return 2;
}

// ---- launch
template <class P>
void emu_launch(void (*k)(P), dim3 grid, unsigned block, size_t smem, const P& p) {
    gridDim = grid; blockDim.x = block; blockDim.y = 1; blockDim.z = 1;
    g_dyn_bytes = smem;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                Block b;
                b.bar = std::make_unique<std::barrier<>>(block);
                for (unsigned w = 0; w < (block + 31) / 32; ++w) b.warps.push_back(std::make_unique<Warp>());
                g_block = &b;
                g_smem.assign(smem + 16, 0xCD);  // garbage, like real smem
                std::vector<std::thread> th;
                for (unsigned t = 0; t < block; ++t)
                    th.emplace_back([=] { threadIdx.x = t; blockIdx.x = x; blockIdx.y = y; blockIdx.z = z; k(p); });
                for (auto& t : th) t.join();
            }
}
