// green_ctx.cuh: the harnesses' SM-partition proxy (CFP4_PGEMV_SMS=N). An H100 with N of its
// SMs asks each SM for the bytes per second an H200 asks of each of its 132 (H100 at 96 SMs:
// ~31.5 GB/s per SM of its full-chip copy bandwidth; H200 at 132: ~32.1), so a kernel whose
// limit is per SM (loads in flight, issue) should stream at the H200's fraction of copy there.
// make_green_ctx makes the device's primary context with only N SMs (a green context,
// rounded up to the architecture's granularity: 8 on sm_90) current to this thread; every
// later runtime call (allocations, launches, graphs) goes to it. Returns the SMs it has.
#pragma once
#include <cuda.h>
#include "proto_cuda.cuh"  // CU_CK

static int make_green_ctx(unsigned want) {
    CU_CK(cuInit(0));
    CUdevice dev;
    CU_CK(cuDeviceGet(&dev, 0));
    CUdevResource all{}, part{}, rest{};
    CU_CK(cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM));
    unsigned groups = 1;
    CU_CK(cuDevSmResourceSplitByCount(&part, &groups, &all, &rest, 0, want));
    CUdevResourceDesc desc;
    CU_CK(cuDevResourceGenerateDesc(&desc, &part, 1));
    CUgreenCtx g;
    CU_CK(cuGreenCtxCreate(&g, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM));
    CUcontext ctx;
    CU_CK(cuCtxFromGreenCtx(&ctx, g));
    CU_CK(cuCtxSetCurrent(ctx));
    return int(part.sm.smCount);
}
