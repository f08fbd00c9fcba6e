// pgemv_plan.cuh: pgemv_bench's restatement of the library's plan of a packed GEMV layer
// (src/gemv/packed/geometry.rs and cuda.rs): occupancy, the geometry rule, the pair, deep
// and staged choices. Included by pgemv_bench.cu after its kernels, Shape, Layer and `sms`;
// not a separate program.
#pragma once

static int occ_pg(int nt, bool silu, int warps, bool deep = false) {
    int o = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, (const void*)pg_fn(nt, silu, deep), 32 * warps, 0));
    return std::max(o, 1);
}

// The library's rule (src/gemv/packed/geometry.rs, packed_geometry), restated for the
// harness: (warps, split).
static std::pair<int, int> geometry(int groups, int npairs, const int* occ) {
    int warps = 4;
    double best = 1e300;
    for (int w = 2; w <= 8; ++w) {
        if (occ[w] == 0) continue;
        const int slots = std::max(sms * occ[w], 1);
        const int waves = (groups + slots - 1) / slots;
        const double c = double(waves) * double((npairs + w - 1) / w + 2) * (1.0 + w / 80.0);
        if (c < best) {
            best = c;
            warps = w;
        }
    }
    int split = 1;
    if (warps == 8 && 2 * groups <= sms)
        for (int s : {4, 2})
            if (groups * s <= sms * std::max(occ[8], 1) && npairs >= 8 * s) {
                split = s;
                break;
            }
    return {warps, split};
}

// The library's plan of one layer for M tokens (src/gemv/packed/cuda.rs), restated for the
// harness: kernel, groups, geometry and the staged x's shared memory.
struct Plan {
    PgFn kfn;
    int nt, groups, warps, split;
    bool pair, deep;
    size_t xs_smem;
};
static Plan plan_shape(const Shape& s, const Layer& L, int m, bool nopair, bool nostage, int smem_optin) {
    const int nt = m <= 8 ? 1 : m <= 16 ? 2 : 4;
    // The deep kernel where it exists and each warp's run is at least its 5 pairs, else
    // the shallow one.
    int occ[9] = {0}, occd[9] = {0};
    for (int w = 2; w <= 8; ++w) occ[w] = occ_pg(nt, s.silu, w);
    for (int w = 2; w <= 8; ++w) occd[w] = occ_pg(nt, s.silu, w, true);
    // The pair kernel where the library's rule takes it (pair_suits: >= 3.5 row tiles
    // per SM); CFP4_PGEMV_NOPAIR=1: the one-tile kernels everywhere.
    const bool pair = !nopair && nt == 1 && !s.silu && 2 * L.tiles >= 7 * sms;
    const int groups = pair ? (L.tiles + 1) / 2 : L.groups;
    int occp[9] = {0};
    for (int w = 2; w <= 8; ++w) {
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occp[w], (const void*)cfp4_pgemv_fp4pair_nt1_u3, 32 * w, 0));
        occp[w] = std::max(occp[w], 1);
    }
    auto [warps, split] = geometry(groups, L.npairs, pair ? occp : occ);
    bool deep = false;
    if (nt == 1 && !s.silu && !pair) {
        const auto [wd, sd] = geometry(groups, L.npairs, occd);
        if ((L.npairs + wd * sd - 1) / (wd * sd) >= 5) {
            deep = true;
            warps = wd;
            split = sd;
        }
    }
    PgFn kfn = pair ? cfp4_pgemv_fp4pair_nt1_u3 : pg_fn(nt, s.silu, deep);
    // The library's staged rule (geometry.rs stage_suits, cuda.rs plan_staged): plain
    // one-tile grids of at most 2 CTAs per SM, up to the tokens whose x rows over the
    // longest K slice fit what a CTA may have at that occupancy.
    size_t xs_smem = 0;
    if (!nostage && m == 1 && !s.silu && !pair && groups * split <= 2 * sms) {  // STAGED_MAX_M = 1
        const PgFn xf = deep ? cfp4_pgemv_fp4xs_nt1_deep : cfp4_pgemv_fp4xs_nt1_u3;
        cudaFuncAttributes fa{};
        CK(cudaFuncGetAttributes(&fa, (const void*)xf));
        size_t avail = 0;
        CK(cudaOccupancyAvailableDynamicSMemPerBlock(&avail, (const void*)xf, (groups * split + sms - 1) / sms, 32 * warps));
        const size_t cap = std::min(avail, size_t(smem_optin) - fa.sharedSizeBytes);
        const int slice_k = std::min(128 * ((L.npairs + split - 1) / split), s.k);
        const size_t need = size_t(m) * (slice_k + 8) * 2;
        if (need <= cap) {
            kfn = xf;
            xs_smem = need;
        }
    }
    return Plan{kfn, nt, groups, warps, split, pair, deep, xs_smem};
}
