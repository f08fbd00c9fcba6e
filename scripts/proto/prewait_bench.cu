// prewait_bench.cu: does a deeper pre-wait prefetch shorten the GEMV boundary of the decode
// step? A question the packed GEMV's timelines left (thirty-fourth session's chain: 8B down,
// released 4.35 us after gate|up's last warp ended with no kernel between; the eighteenth
// session's step: 4.6 us per GEMV above its bytes).
//
// Stand-ins, no decode arithmetic: a "layer" is a pure streaming kernel (2 CTAs of 256
// threads per SM, one wave) that reads its weight bytes once with 16-byte non-allocating
// loads, D per thread in flight, and xors them into one word per CTA; a "norm" is a one-CTA
// kernel that spins S ns after its wait. The 8B chain per layer is the decode step's order:
// norm, q|k|v (13.4 MB with scales), attention (a 5 us spacer), o (8.9 MB), norm, gate|up
// (62.4 MB), down (31.2 MB, no kernel before it); 8 layers with their own buffers (920 MB,
// far past L2). The 70B chain: the same with 70B sizes, 2 layers. All under PDL, the
// library's protocol: a layer issues its pre-wait loads, waits (griddepcontrol.wait), then
// releases its dependents; a norm releases its dependents at its start.
//
// Pre-wait modes of the layer kernel (what each CTA has asked DRAM for while it waits):
//   none:   nothing; every load after the wait;
//   regD:   the first D loads per thread into registers (D x 4 KB per CTA: the library's
//           register stages, about what the packed GEMV holds);
//   smemP:  the first P KB of the CTA's range copied into shared memory with cp.async
//           (then read back after the streaming loop).
// Reported per mode: us per layer with the spacers' chain alone taken out, its GB/s and %
// of the copy bandwidth measured in the same run, and from one replay's per-CTA
// %globaltimer stamps: each layer kernel's release (p50 over CTAs) after the previous
// kernel's last CTA end, and its last CTA end after its release.
// Then the same chains as one persistent kernel (fused-none / fused-reg4 / fused-reg8): grid
// barriers instead of kernel boundaries, the next layer's first loads asked for before the
// barrier: what a step of fewer kernels could save at each boundary.
// Built by scripts/proto/build-prewait-bench.sh; run on the device: ./prewait_bench.
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "proto_cuda.cuh"

namespace {

constexpr int THREADS = 256;
constexpr int CTAS_PER_SM = 2;

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ unsigned fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// The streaming part of a CTA's slice, this thread's words from i (its first) to hi: the D
// words prefetched into `pre` first when `have`, then D loads in flight per step, then the
// tail; their xor.
template <int D>
__device__ __forceinline__ unsigned stream_rest(const uint4* w, unsigned long long i, unsigned long long hi,
                                                const uint4 (&pre)[D], bool have) {
    unsigned acc = 0;
    if (have) {
#pragma unroll
        for (int d = 0; d < D; ++d) acc ^= fold(pre[d]);
        i += (unsigned long long)D * THREADS;
    }
    uint4 r[D];
    for (; i + (unsigned long long)(D - 1) * THREADS < hi; i += (unsigned long long)D * THREADS) {
#pragma unroll
        for (int d = 0; d < D; ++d) r[d] = ld_stream(w + i + (unsigned long long)d * THREADS);
#pragma unroll
        for (int d = 0; d < D; ++d) acc ^= fold(r[d]);
    }
    for (; i < hi; i += THREADS) acc ^= fold(ld_stream(w + i));
    return acc;
}

struct LayerParams {
    const uint4* w;            // this layer's bytes, 16-byte words
    unsigned long long words;  // how many
    unsigned* out;             // one word per CTA
    int pre_regs;              // 1: the first D loads per thread issued before the wait
    int pre_words;             // words per CTA copied to shared memory before the wait
    unsigned long long* tl;    // 3 stamps per CTA (entry, released, end), or null
};

template <int D>
__global__ void __launch_bounds__(THREADS) layer_kernel(LayerParams p) {
    extern __shared__ uint4 smem[];
    const unsigned long long t0 = now_ns();
    const unsigned long long g = gridDim.x, b = blockIdx.x;
    const unsigned long long lo = p.words * b / g, hi = p.words * (b + 1) / g;
    const unsigned long long pre_hi = min(hi, lo + (unsigned long long)p.pre_words);
    // Shared-memory stages: thread t copies words lo + t, lo + t + 256, ...
    for (unsigned long long i = lo + threadIdx.x; i < pre_hi; i += THREADS) {
        const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem + (i - lo)));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(p.w + i) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    // Register stages: the first D words of the streaming part per thread.
    unsigned long long i = pre_hi + threadIdx.x;
    uint4 r[D];
    bool have = false;
    if (p.pre_regs && i + (unsigned long long)(D - 1) * THREADS < hi) {
#pragma unroll
        for (int d = 0; d < D; ++d) r[d] = ld_stream(p.w + i + (unsigned long long)d * THREADS);
        have = true;
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const unsigned long long t1 = now_ns();
    unsigned acc = stream_rest<D>(p.w, i, hi, r, have);
    asm volatile("cp.async.wait_all;" ::: "memory");
    for (unsigned long long j = lo + threadIdx.x; j < pre_hi; j += THREADS) acc ^= fold(smem[j - lo]);
    // One word per CTA: a warp xor, then lane 0 of each warp.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) atomicXor(p.out + b, acc);
    __syncthreads();
    if (p.tl && threadIdx.x == 0) {
        p.tl[3 * b] = t0;
        p.tl[3 * b + 1] = t1;
        p.tl[3 * b + 2] = now_ns();
    }
}

struct SpacerParams {
    unsigned* word;
    long ns;
    unsigned long long* tl;  // 3 stamps, or null
};

// The norm / attention stand-in: releases its dependents at its start (the library's norm
// and combine kernels do), waits, spins.
__global__ void __launch_bounds__(THREADS) spacer_kernel(SpacerParams p) {
    const unsigned long long t0 = now_ns();
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const unsigned long long t1 = now_ns();
    if (threadIdx.x == 0) {
        while (now_ns() - t1 < (unsigned long long)p.ns) {
        }
        *p.word += 1;
        if (p.tl) {
            p.tl[0] = t0;
            p.tl[1] = t1;
            p.tl[2] = now_ns();
        }
    }
}

// The same chain as one persistent kernel (the "fewer kernels" alternative): every CTA walks
// the nodes; a layer node streams the CTA's slice as layer_kernel does, a spacer node spins on
// CTA 0; between nodes a grid barrier (one counter, release/acquire) stands in for the kernel
// boundary. With `pre`, a CTA that has finished a layer asks for the next layer's first D
// words per thread before it enters the barrier (the PDL chain's register stages).
struct FusedNode {
    const uint4* w;
    unsigned long long words;  // 0: a spacer
    unsigned* out;             // one word per CTA (a spacer: one word)
    long ns;                   // spacer spin
};

struct FusedParams {
    const FusedNode* nodes;
    int count;
    unsigned* bar;  // zeroed before each launch
    int pre;
};

__device__ __forceinline__ void grid_sync(unsigned* bar, unsigned& target) {
    __syncthreads();
    target += gridDim.x;
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(bar, 1u);
        unsigned v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(bar) : "memory");
        } while (static_cast<int>(v - target) < 0);
    }
    __syncthreads();
}

template <int D>
__global__ void __launch_bounds__(THREADS) fused_kernel(FusedParams p) {
    const unsigned long long g = gridDim.x, b = blockIdx.x;
    unsigned target = 0;
    uint4 r[D];
    bool have = false;
    for (int n = 0; n < p.count; ++n) {
        const FusedNode nd = p.nodes[n];
        if (nd.words == 0) {
            if (b == 0 && threadIdx.x == 0) {
                const unsigned long long t1 = now_ns();
                while (now_ns() - t1 < (unsigned long long)nd.ns) {
                }
                *nd.out += 1;
            }
            grid_sync(p.bar, target);
            continue;
        }
        const unsigned long long lo = nd.words * b / g, hi = nd.words * (b + 1) / g;
        unsigned acc = stream_rest<D>(nd.w, lo + threadIdx.x, hi, r, have);
        have = false;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
        if ((threadIdx.x & 31) == 0) atomicXor(nd.out + b, acc);
        if (p.pre) {
            int m = n + 1;
            while (m < p.count && p.nodes[m].words == 0) ++m;
            if (m < p.count) {
                const FusedNode nx = p.nodes[m];
                const unsigned long long nlo = nx.words * b / g, nhi = nx.words * (b + 1) / g;
                const unsigned long long j = nlo + threadIdx.x;
                if (j + (unsigned long long)(D - 1) * THREADS < nhi) {
#pragma unroll
                    for (int d = 0; d < D; ++d) r[d] = ld_stream(nx.w + j + (unsigned long long)d * THREADS);
                    have = true;
                }
            }
        }
        grid_sync(p.bar, target);
    }
}

struct Mode {
    const char* name;
    int d;          // loads in flight per thread in the loop (4 or 8)
    int pre_regs;   // register stages before the wait
    int pre_kb;     // KB per CTA into shared memory before the wait
};

// One kernel of the chain: a layer (bytes > 0) or a spacer (ns).
struct Node {
    const char* name;
    double mb;  // layer bytes, MB (0: spacer)
    long ns;    // spacer spin
};

struct Chain {
    const char* name;
    std::vector<Node> layer;
    int layers;
};

struct Launch {
    bool spacer;
    const char* name;
    LayerParams lp;
    SpacerParams sp;
};

template <int D>
void launch_layer(cudaStream_t st, const LayerParams& lp, int grid, size_t smem) {
    launch_pdl(layer_kernel<D>, unsigned(grid), THREADS, smem, st, lp);
}

double median_chain_us(const std::vector<Launch>& ls, const Mode& m, int grid, cudaStream_t st, bool spacers_only) {
    const size_t smem = size_t(m.pre_kb) * 1024;
    return 1000.0 * graph_ms_per_replay(st, 1, [&](int) {
        for (const Launch& l : ls) {
            if (l.spacer) {
                launch_pdl(spacer_kernel, 1u, THREADS, 0, st, l.sp);
            } else if (!spacers_only) {
                if (m.d == 8) launch_layer<8>(st, l.lp, grid, smem);
                else launch_layer<4>(st, l.lp, grid, smem);
            }
        }
    });
}

double pct(std::vector<double> v, double q) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, size_t(q * double(v.size())))];
}

}  // namespace

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, 0));
    const int grid = CTAS_PER_SM * sms;
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

    // Copy bandwidth, read + write, 512 MB.
    const size_t copy_bytes = size_t(512) << 20;
    void *ca, *cb;
    CK(cudaMalloc(&ca, copy_bytes));
    CK(cudaMalloc(&cb, copy_bytes));
    CK(cudaMemset(ca, 1, copy_bytes));
    const float copy_ms = median_ms(st, 9, 2, [&](cudaStream_t s) { CK(cudaMemcpyAsync(cb, ca, copy_bytes, cudaMemcpyDeviceToDevice, s)); });
    const double copy_gbs = 2.0 * double(copy_bytes) / (copy_ms * 1e-3) / 1e9;
    CK(cudaFree(ca));
    CK(cudaFree(cb));
    printf("%s, %d SMs, copy %.0f GB/s (read + write), layer grid %d x %d threads\n", prop.name, sms, copy_gbs, grid, THREADS);

    const std::vector<Chain> chains = {
        {"8B", {{"norm", 0, 1500}, {"q|k|v", 13.37, 0}, {"attn", 0, 5000}, {"o", 8.91, 0}, {"norm", 0, 1500},
                {"gate|up", 62.39, 0}, {"down", 31.19, 0}}, 8},
        {"70B", {{"norm", 0, 1500}, {"q|k|v", 44.56, 0}, {"attn", 0, 5000}, {"o", 35.65, 0}, {"norm", 0, 1500},
                 {"gate|up", 249.56, 0}, {"down", 124.78, 0}}, 2},
    };
    const std::vector<Mode> modes = {
        {"none", 4, 0, 0},      {"reg4", 4, 1, 0},       {"reg8", 8, 1, 0},      {"smem16", 4, 1, 16},
        {"smem32", 4, 1, 32},   {"smem64", 4, 1, 64},    {"smem96", 4, 1, 96},
    };
    struct FusedMode {
        const char* name;
        int d, pre;
    };
    const std::vector<FusedMode> fused_modes = {{"fused-none", 4, 0}, {"fused-reg4", 4, 1}, {"fused-reg8", 8, 1}};
    // The barrier needs every CTA resident at once.
    for (int d : {4, 8}) {
        int per_sm = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, d == 8 ? fused_kernel<8> : fused_kernel<4>, THREADS, 0));
        if (per_sm < CTAS_PER_SM) {
            fprintf(stderr, "fused_kernel<%d>: %d CTAs per SM resident, need %d\n", d, per_sm, CTAS_PER_SM);
            return 1;
        }
    }
    unsigned* bar;
    CK(cudaMalloc(&bar, sizeof(unsigned)));
    int max_kb = 0;
    for (const Mode& m : modes) max_kb = std::max(max_kb, m.pre_kb);
    CK(cudaFuncSetAttribute(layer_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, max_kb * 1024));
    CK(cudaFuncSetAttribute(layer_kernel<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, max_kb * 1024));

    unsigned* outs;
    CK(cudaMalloc(&outs, sizeof(unsigned) * size_t(grid) * 64));
    unsigned* words;
    CK(cudaMalloc(&words, sizeof(unsigned) * 64));
    CK(cudaMemset(words, 0, sizeof(unsigned) * 64));
    unsigned long long* tl;
    const size_t tl_slots = size_t(64) * 3 * grid;
    CK(cudaMalloc(&tl, sizeof(unsigned long long) * tl_slots));

    printf("\n| chain | mode | us per layer | spacers alone | GB/s | %% copy | release after prev end p50 (us, per kernel) | end after release max |\n|---|---|---|---|---|---|---|---|\n");
    for (const Chain& c : chains) {
        // Buffers: every layer of the chain its own bytes.
        std::vector<Launch> ls;
        double layer_bytes = 0;
        size_t total_words = 0;
        for (int l = 0; l < c.layers; ++l)
            for (const Node& n : c.layer)
                if (n.mb > 0) total_words += size_t(n.mb * 1e6 / 16);
        uint4* w;
        CK(cudaMalloc(&w, total_words * 16));
        CK(cudaMemset(w, 0x5a, total_words * 16));
        size_t at = 0;
        int k = 0;
        for (int l = 0; l < c.layers; ++l) {
            for (const Node& n : c.layer) {
                Launch x{};
                x.name = n.name;
                x.spacer = n.mb == 0;
                if (x.spacer) {
                    x.sp = SpacerParams{words + (k % 64), n.ns, nullptr};
                } else {
                    const size_t nw = size_t(n.mb * 1e6 / 16);
                    x.lp = LayerParams{w + at, nw, outs + size_t(k % 64) * grid, 0, 0, nullptr};
                    at += nw;
                    if (l == 0) layer_bytes += double(nw) * 16;
                }
                ls.push_back(x);
                ++k;
            }
        }
        for (const Mode& m : modes) {
            const int pre_words = m.pre_kb * 1024 / 16;
            for (Launch& x : ls)
                if (!x.spacer) {
                    x.lp.pre_regs = m.pre_regs;
                    x.lp.pre_words = pre_words;
                    x.lp.tl = nullptr;
                }
            const double us = median_chain_us(ls, m, grid, st, false);
            const double sp = median_chain_us(ls, m, grid, st, true);
            const double per_layer = (us - sp) / c.layers;
            const double gbs = layer_bytes / (per_layer * 1e-6) / 1e9;
            // One replay with stamps.
            CK(cudaMemset(tl, 0, sizeof(unsigned long long) * tl_slots));
            for (size_t j = 0; j < ls.size(); ++j) {
                if (ls[j].spacer) ls[j].sp.tl = tl + j * 3 * grid;
                else ls[j].lp.tl = tl + j * 3 * grid;
            }
            median_chain_us(ls, m, grid, st, false);
            CK(cudaStreamSynchronize(st));
            std::vector<unsigned long long> h(tl_slots);
            CK(cudaMemcpy(h.data(), tl, sizeof(unsigned long long) * tl_slots, cudaMemcpyDeviceToHost));
            for (Launch& x : ls) {
                x.sp.tl = nullptr;
                x.lp.tl = nullptr;
            }
            // Per kernel type (layer nodes of layers >= 1 and of layer 0 after its first),
            // medians over the chain's layers.
            std::string rel, end;
            for (size_t n = 0; n < c.layer.size(); ++n) {
                if (c.layer[n].mb == 0) continue;
                std::vector<double> gaps, ends;
                for (int l = 0; l < c.layers; ++l) {
                    const size_t j = size_t(l) * c.layer.size() + n;
                    if (j == 0) continue;
                    const size_t pj = j - 1;
                    const int pctas = ls[pj].spacer ? 1 : grid;
                    unsigned long long prev_end = 0;
                    for (int b = 0; b < pctas; ++b) prev_end = std::max(prev_end, h[pj * 3 * grid + 3 * b + 2]);
                    std::vector<double> rels;
                    unsigned long long last = 0;
                    for (int b = 0; b < grid; ++b) {
                        rels.push_back(double(h[j * 3 * grid + 3 * b + 1]) - double(prev_end));
                        last = std::max(last, h[j * 3 * grid + 3 * b + 2]);
                    }
                    const double r50 = pct(rels, 0.5);
                    gaps.push_back(r50 / 1000.0);
                    ends.push_back((double(last) - double(prev_end) - r50) / 1000.0);
                }
                char buf[96];
                snprintf(buf, sizeof buf, "%s%s %.2f", rel.empty() ? "" : ", ", c.layer[n].name, pct(gaps, 0.5));
                rel += buf;
                snprintf(buf, sizeof buf, "%s%s %.2f", end.empty() ? "" : ", ", c.layer[n].name, pct(ends, 0.5));
                end += buf;
            }
            printf("| %s | %s | %.2f | %.2f | %.0f | %.1f%% | %s | %s |\n", c.name, m.name, per_layer, sp / c.layers, gbs,
                   100.0 * gbs / copy_gbs, rel.c_str(), end.c_str());
            fflush(stdout);
        }
        // The persistent kernel over the same nodes and buffers, and over the spacers alone
        // (layer nodes as 0 ns spacers: the same barriers) to take out.
        std::vector<FusedNode> fn, fs;
        for (const Launch& x : ls) {
            if (x.spacer) {
                fn.push_back(FusedNode{nullptr, 0, x.sp.word, x.sp.ns});
                fs.push_back(fn.back());
            } else {
                fn.push_back(FusedNode{x.lp.w, x.lp.words, x.lp.out, 0});
                fs.push_back(FusedNode{nullptr, 0, x.lp.out, 0});
            }
        }
        FusedNode *dfn, *dfs;
        CK(cudaMalloc(&dfn, sizeof(FusedNode) * fn.size()));
        CK(cudaMalloc(&dfs, sizeof(FusedNode) * fs.size()));
        CK(cudaMemcpy(dfn, fn.data(), sizeof(FusedNode) * fn.size(), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dfs, fs.data(), sizeof(FusedNode) * fs.size(), cudaMemcpyHostToDevice));
        for (const FusedMode& m : fused_modes) {
            auto run = [&](const FusedNode* nodes) {
                const FusedParams fp{nodes, int(fn.size()), bar, m.pre};
                return 1000.0 * graph_ms_per_replay(st, 1, [&](int) {
                    CK(cudaMemsetAsync(bar, 0, sizeof(unsigned), st));
                    if (m.d == 8) fused_kernel<8><<<grid, THREADS, 0, st>>>(fp);
                    else fused_kernel<4><<<grid, THREADS, 0, st>>>(fp);
                    CK(cudaGetLastError());
                });
            };
            const double us = run(dfn), sp = run(dfs);
            const double per_layer = (us - sp) / c.layers;
            const double gbs = layer_bytes / (per_layer * 1e-6) / 1e9;
            printf("| %s | %s | %.2f | %.2f | %.0f | %.1f%% | (one kernel) | |\n", c.name, m.name, per_layer, sp / c.layers, gbs,
                   100.0 * gbs / copy_gbs);
            fflush(stdout);
        }
        CK(cudaFree(dfn));
        CK(cudaFree(dfs));
        CK(cudaFree(w));
    }
    CK(cudaGetLastError());
    printf("\nok\n");
    return 0;
}
