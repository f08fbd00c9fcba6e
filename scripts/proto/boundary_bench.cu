// boundary_bench.cu: what one kernel boundary costs inside a CUDA graph on this GPU, five
// ways, for chains of kernels shaped like the decode step's GEMVs (G CTAs of 256 threads,
// each busy for W ns after its dependency is met):
//   plain: stream order only (no PDL);
//   pdl:   the library's protocol (kernels/pdl.cuh): launch_dependents at the start, then
//          griddepcontrol.wait (the previous grid complete and its writes visible);
//   pdl-late: griddepcontrol.wait first, launch_dependents after it (the next kernel's
//          CTAs cannot launch before this one's predecessor is complete: at most two
//          kernels resident, where pdl lets a third take slots while it waits);
//   flag:  launch_dependents at the start, then thread 0 of each CTA spins (ld.acquire.gpu)
//          until every CTA of the previous kernel has released its arrival on a counter
//          (red.release.gpu), instead of waiting for the grid's completion. The last CTA to
//          pass (a 1-D grid: gridDim.x CTAs) zeroes the counter for the next replay;
//   flag+sleep: flag with a 64 ns __nanosleep between polls (fewer L2 requests on the
//          counter's line while the producers arrive).
// Each CTA reads one word the previous kernel wrote and writes its own, so the chain
// carries a data dependency; the result is checked after the timing (flag mode must see
// every write of its predecessor).
// µs per kernel = median graph replay time / chain length; the boundary = that minus W.
// Built by scripts/proto/build-boundary-bench.sh; run on the device: ./boundary_bench.
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "proto_cuda.cuh"

enum Mode { PLAIN = 0, PDL = 1, FLAG = 2, FLAG_SLEEP = 3, PDL_LATE = 4 };

__device__ __forceinline__ void spin_ns(long ns) {
    if (ns <= 0) return;
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < (unsigned long long)ns);
}

struct Link {
    const unsigned* prev_vals;  // the previous kernel's per-CTA words (null: first kernel)
    unsigned* vals;             // this kernel's per-CTA words
    unsigned* prev_count;       // FLAG: the previous kernel's arrival counter
    unsigned* count;            // FLAG: this kernel's arrival counter
    int prev_ctas;              // CTAs of the previous kernel
    int step;                   // position in the chain
    long work_ns;
    int mode;
    unsigned* bad;              // incremented when a read saw a stale word
    const unsigned* epoch;      // the replay's number (bumped by the graph's first node)
};

__global__ void __launch_bounds__(256) link_kernel(Link l) {
    if (l.mode != PLAIN && l.mode != PDL_LATE) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (l.mode == PDL_LATE) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    const bool flag = l.mode == FLAG || l.mode == FLAG_SLEEP;
    if (l.mode == PDL || (flag && l.prev_vals == nullptr)) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
    } else if (flag) {
        if (threadIdx.x == 0) {
            unsigned c;
            for (;;) {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(l.prev_count) : "memory");
                if (c >= unsigned(l.prev_ctas)) break;
                if (l.mode == FLAG_SLEEP) __nanosleep(64);
            }
            // This CTA has passed: count it; the last of this grid resets for the next replay.
            const unsigned old = atomicAdd(l.prev_count, 1u);
            if (old == unsigned(l.prev_ctas) + gridDim.x - 1) atomicExch(l.prev_count, 0u);
        }
        __syncthreads();
    }
    // The check reads with a plain load (L1-cached) from another warp than the one that
    // acquired: what the GEMV's x loads would do.
    const unsigned tag = *l.epoch * 1024u;
    if (threadIdx.x == 32 && l.prev_vals) {
        const unsigned v = l.prev_vals[blockIdx.x % l.prev_ctas];
        if (v != tag + unsigned(l.step - 1)) atomicAdd(l.bad, 1u);
    }
    spin_ns(l.work_ns);
    __syncthreads();
    if (threadIdx.x == 0) {
        __stcg(l.vals + blockIdx.x, tag + unsigned(l.step));
        if (l.mode >= FLAG) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(l.count), "r"(1u) : "memory");
    }
}

// The graph's first node: a new replay number, so a word left by an earlier replay reads
// as stale.
__global__ void epoch_kernel(unsigned* epoch) { *epoch += 1; }

static double time_chain(int mode, int ctas, int len, long work_ns, unsigned* vals, unsigned* counts, unsigned* bad,
                         unsigned* epoch, unsigned* bad_host) {
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CK(cudaMemset(counts, 0, sizeof(unsigned) * (len + 1)));
    CK(cudaMemset(bad, 0, sizeof(unsigned)));
    auto launch = [&]() {
        epoch_kernel<<<1, 1, 0, st>>>(epoch);
        for (int i = 0; i < len; ++i) {
            Link l{};
            l.prev_vals = i ? vals + size_t(i - 1) * ctas : nullptr;
            l.vals = vals + size_t(i) * ctas;
            l.prev_count = i ? counts + (i - 1) : nullptr;
            l.count = counts + i;
            l.prev_ctas = ctas;
            l.step = i;
            l.work_ns = work_ns;
            l.mode = mode;
            l.bad = bad;
            l.epoch = epoch;
            cudaLaunchConfig_t cfg{};
            cfg.gridDim = dim3(ctas);
            cfg.blockDim = dim3(256);
            cfg.stream = st;
            cudaLaunchAttribute at[1];
            at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            at[0].val.programmaticStreamSerializationAllowed = 1;
            cfg.attrs = at;
            cfg.numAttrs = mode == PLAIN ? 0 : 1;
            CK(cudaLaunchKernelEx(&cfg, link_kernel, l));
        }
    };
    // The last kernel's counter is never consumed: zero it in the graph (a memset node
    // after the chain) so it cannot overflow over replays.
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    launch();
    CK(cudaMemsetAsync(counts + (len - 1), 0, sizeof(unsigned), st));
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    const float ms = median_replay_ms(ge, st, 21, 3);
    CK(cudaStreamSynchronize(st));
    CK(cudaMemcpy(bad_host, bad, sizeof(unsigned), cudaMemcpyDeviceToHost));
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaStreamDestroy(st);
    return double(ms) * 1000.0 / len;
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs\n", prop.name, sms);
    const int len = 64;
    unsigned *vals, *counts, *bad, *epoch;
    CK(cudaMalloc(&vals, sizeof(unsigned) * size_t(len) * 8 * sms));
    CK(cudaMalloc(&counts, sizeof(unsigned) * (len + 1)));
    CK(cudaMalloc(&bad, sizeof(unsigned)));
    CK(cudaMalloc(&epoch, sizeof(unsigned)));
    CK(cudaMemset(epoch, 0, sizeof(unsigned)));
    printf("\n| CTAs | work ns | plain us/kernel | pdl | pdl-late | flag | flag+sleep | pdl boundary | flag boundary | stale reads |\n|---|---|---|---|---|---|---|---|---|---|\n");
    int failures = 0;
    for (int per_sm : {1, 2, 3}) {
        for (long w : {0L, 2000L, 5000L}) {
            const int ctas = per_sm * sms;
            double us[5];
            unsigned stale[5];
            for (int m = 0; m < 5; ++m) us[m] = time_chain(m, ctas, len, w, vals, counts, bad, epoch, &stale[m]);
            printf("| %d | %ld | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %u/%u/%u/%u/%u |\n", ctas, w, us[0], us[1], us[4],
                   us[2], us[3], us[1] - w / 1000.0, std::min(us[2], us[3]) - w / 1000.0, stale[0], stale[1], stale[2], stale[3],
                   stale[4]);
            failures += stale[0] + stale[1] + stale[2] + stale[3] + stale[4];
        }
    }
    printf("\nstale reads: %d (must be 0)\n", failures);
    return failures ? 1 : 0;
}
