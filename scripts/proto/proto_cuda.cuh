// proto_cuda.cuh: what the stand-alone harnesses of scripts/proto share: CK and CU_CK (exit
// on a CUDA runtime / driver error, naming the call), median event timings (of any work, of graph replays, of a graph
// captured from calls) and a launch with programmatic dependent launch allowed.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

#define CU_CK(x)                                                                      \
    do {                                                                              \
        CUresult r_ = (x);                                                            \
        if (r_ != CUDA_SUCCESS) {                                                     \
            const char* s_ = nullptr;                                                 \
            cuGetErrorString(r_, &s_);                                                \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_ ? s_ : "?"); \
            exit(1);                                                                  \
        }                                                                             \
    } while (0)

// Median milliseconds of `reps` calls of `work(st)` on `st`, each timed alone with CUDA
// events, after `warm` untimed calls.
template <class F>
static inline float median_ms(cudaStream_t st, int reps, int warm, F work) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < warm; ++i) work(st);
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
        CK(cudaEventRecord(e0, st));
        work(st);
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return t[t.size() / 2];
}

// Median milliseconds of `reps` replays of `ge` on `st`, after `warm` untimed replays.
static inline float median_replay_ms(cudaGraphExec_t ge, cudaStream_t st, int reps, int warm) {
    return median_ms(st, reps, warm, [&](cudaStream_t s) { CK(cudaGraphLaunch(ge, s)); });
}

// Median milliseconds of one replay of a graph of `calls` calls `one(i)` captured on `st`,
// after three eager calls (module loads) and one untimed replay; median of 15 replays.
template <class F>
static inline float graph_ms_per_replay(cudaStream_t st, int calls, F one) {
    for (int i = 0; i < 3; ++i) one(i);
    CK(cudaStreamSynchronize(st));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < calls; ++i) one(i);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    const float ms = median_replay_ms(ge, st, 15, 1);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    return ms;
}

// One launch of `kernel` with programmatic dependent launch allowed.
template <class... P, class... A>
static void launch_pdl(void (*kernel)(P...), unsigned grid, unsigned block, size_t smem, cudaStream_t st, A... args) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(block);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}
