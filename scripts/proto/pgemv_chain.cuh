// pgemv_chain.cuh: pgemv_bench's chain mode (CFP4_PGEMV_CHAIN=8B or 70B): one decoder
// layer's four NVFP4 GEMVs at M = 1 in the decode step's order, each planned as the library
// plans it, with one-CTA spacers where the step has its small kernels:
//   spacer (add + RMSNorm) -> q|k|v -> spacer (attention + combine, CFP4_PGEMV_CHAIN_ATTN_NS
//   of DRAM-idle spin, default 3000) -> o -> spacer (add + RMSNorm) -> gate|up -> down
// captured `iters` times per graph (weight copies rotating). Prints the chain's µs per layer
// minus the spacers' chain alone, and (timeline builds) where each kernel's CTAs enter, are
// released by their wait, finish their first chunk and end, relative to the end of the GEMV
// before it: the boundary cost the decode step pays four times per layer. (The thirty-fourth
// session's first version also planned one-wave grids leaving warps per SM to the next
// kernel: slower; docs/logs/s34/reserve-warps.patch.)
// Included by pgemv_bench.cu after its helpers; not a separate program.
#pragma once

struct ChainLayer {
    Shape s;
    Layer L;
    Plan pl;
    __nv_bfloat16* out;
};

#ifdef CFP4_PGEMV_TIMELINE
// One line per kernel of the chain's last iteration: times in µs from the first entry of the
// chain's first GEMV; "after prev" columns from the last warp end of the GEMV before it.
static void chain_report(const std::vector<ChainLayer>& ch, const std::vector<unsigned long long>& h, size_t stride) {
    const auto pct = tl_pct;
    unsigned long long t0 = ~0ull;
    for (size_t r = 0; r < stride; ++r)
        if (h[r * TL_SLOTS] && h[r * TL_SLOTS + 4]) t0 = std::min(t0, h[r * TL_SLOTS]);
    double prev_end = -1;
    for (size_t i = 0; i < ch.size(); ++i) {
        std::vector<double> entry, rel, first, loop_end, end;
        for (size_t r = 0; r < stride; ++r) {
            const unsigned long long* s = &h[(i * stride + r) * TL_SLOTS];
            if (s[0] == 0 || s[4] == 0 || s[0] < t0) continue;
            entry.push_back((s[0] - t0) * 1e-3);
            rel.push_back((s[1] - t0) * 1e-3);
            if (s[2]) first.push_back((s[2] - t0) * 1e-3);
            if (s[3]) loop_end.push_back((s[3] - t0) * 1e-3);
            end.push_back((s[4] - t0) * 1e-3);
        }
        if (end.empty()) {
            printf("    chain %s: no stamps\n", ch[i].s.name);
            continue;
        }
        const double e_max = pct(end, 1.0);
        printf("    chain %-11s w%d s%d%s: entry p0 %.2f p50 %.2f p100 %.2f | released p50 %.2f | first chunk p50 %.2f p90 %.2f | "
               "loop end p50 %.2f | end p10 %.2f p50 %.2f p100 %.2f",
               ch[i].s.name, ch[i].pl.warps, ch[i].pl.split, ch[i].pl.pair ? " pair" : ch[i].pl.xs_smem ? " xs" : "",
               pct(entry, 0), pct(entry, 0.5), pct(entry, 1), pct(rel, 0.5), pct(first, 0.5), pct(first, 0.9),
               pct(loop_end, 0.5), pct(end, 0.1), pct(end, 0.5), e_max);
        if (prev_end >= 0)
            printf(" | after prev: entry p0 %+.2f p50 %+.2f, released %+.2f, first chunk p50 %+.2f", pct(entry, 0) - prev_end,
                   pct(entry, 0.5) - prev_end, pct(rel, 0.5) - prev_end, pct(first, 0.5) - prev_end);
        printf("\n");
        prev_end = e_max;
    }
}
#endif

static void run_chain(const char* which, double copy, __nv_bfloat16* x, float* partial, uint32_t* counters,
                      std::mt19937& rng, int smem_optin) {
    const bool b70 = !strcmp(which, "70B");
    const Shape shapes[4] = {
        {b70 ? "70B qkv" : "8B qkv", b70 ? 10240 : 6144, b70 ? 8192 : 4096, false},
        {b70 ? "70B o" : "8B o", b70 ? 8192 : 4096, b70 ? 8192 : 4096, false},
        {b70 ? "70B gate|up" : "8B gate|up", b70 ? 57344 : 28672, b70 ? 8192 : 4096, true},
        {b70 ? "70B down" : "8B down", b70 ? 8192 : 4096, b70 ? 28672 : 14336, false},
    };
    const long attn_ns = getenv("CFP4_PGEMV_CHAIN_ATTN_NS") ? atol(getenv("CFP4_PGEMV_CHAIN_ATTN_NS")) : 3000;
    std::vector<ChainLayer> ch;
    double bytes = 0;
    for (const Shape& s : shapes) {
        ChainLayer c{s, make_layer(s, rng), Plan{}, nullptr};
        CK(cudaMalloc(&c.out, size_t(s.n) * 2));
        bytes += double(c.L.code_bytes) + double(size_t(s.n) * (s.k / 16));
        ch.push_back(c);
    }
    g_spacer_x = x;
    g_spacer_k = 4096;
    g_pf.clear();
    printf("\nchain %s (M = 1; spacer, qkv, spacer %ld ns, o, spacer, gate|up, down), %.1f MB of weights, copy %.0f GB/s\n",
           which, attn_ns, bytes / 1e6, copy);
    const int iters = 8;
    auto launch_chain = [&](cudaStream_t st, int it, bool gemvs) {
        auto spacer = [&](long ns) {
            const long keep = g_spacer_ns;
            g_spacer_ns = ns;
            launch_spacer(st, it);
            g_spacer_ns = keep;
        };
        auto gemv = [&](ChainLayer& c) {
            if (!gemvs) return;
            const int cp = it % int(c.L.pcodes.size());
            PackedGemvParams p{c.L.pcodes[cp], c.L.pscales[cp], x, c.out, partial, counters, 0.0123f * 256.f, 1, c.s.n,
                               c.s.k, c.s.k, c.L.half_pad, c.pl.groups, c.pl.split, c.L.npairs, 0};
            launch_pdl(c.pl.kfn, unsigned(c.pl.groups * c.pl.split), unsigned(32 * c.pl.warps), c.pl.xs_smem, st, p);
        };
        spacer(0);
        gemv(ch[0]);
        spacer(attn_ns);
        gemv(ch[1]);
        spacer(0);
        gemv(ch[2]);
        gemv(ch[3]);
    };
    auto time_chain = [&](bool gemvs) {
        cudaStream_t st;
        CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        const float ms = graph_ms_per_replay(st, iters, [&](int it) { launch_chain(st, it, gemvs); });
        cudaStreamDestroy(st);
        return double(ms) * 1000.0 / iters;
    };
    const double spacers_us = time_chain(false);
    {
        for (auto& c : ch) c.pl = plan_shape(c.s, c.L, 1, false, false, smem_optin);
        const double us = time_chain(true);
        printf("| chain %s | %s | %.2f us per layer (spacers alone %.2f) | %.0f GB/s | %.0f%% of copy |\n", which,
               (std::to_string(ch[0].pl.warps) + "/" + std::to_string(ch[1].pl.warps) + "/" +
                std::to_string(ch[2].pl.warps) + "/" + std::to_string(ch[3].pl.warps) + " warps")
                   .c_str(),
               us - spacers_us, spacers_us, bytes / (us - spacers_us) / 1e3, 100.0 * bytes / (us - spacers_us) / 1e3 / copy);
#ifdef CFP4_PGEMV_TIMELINE
        size_t stride = 0;
        for (auto& c : ch) stride = std::max(stride, size_t(c.pl.groups) * c.pl.split * 8);
        unsigned long long* dev = nullptr;
        CK(cudaMalloc(&dev, stride * ch.size() * TL_SLOTS * 8));
        CK(cudaMemset(dev, 0, stride * ch.size() * TL_SLOTS * 8));
        const void* keys[4] = {ch[0].out, ch[1].out, ch[2].out, ch[3].out};
        cfp4_pgemv_set_timeline_keys(keys, 4, stride);
        cfp4_pgemv_set_timeline(dev);
        time_chain(true);
        cfp4_pgemv_set_timeline(nullptr);
        cfp4_pgemv_set_timeline_keys(keys, 0, 0);
        std::vector<unsigned long long> h(stride * ch.size() * TL_SLOTS);
        CK(cudaMemcpy(h.data(), dev, h.size() * 8, cudaMemcpyDeviceToHost));
        cudaFree(dev);
        chain_report(ch, h, stride);
#endif
    }
    for (auto& c : ch) {
        free_layer(c.L);
        cudaFree(c.out);
    }
    g_spacer_x = nullptr;
}
