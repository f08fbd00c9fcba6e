// timeline.cuh: the proto harnesses' report of kernels/gemv_packed.cu's per-warp %globaltimer
// stamps (built with -DCFP4_PGEMV_TIMELINE: slots 0 entry, 1 after griddepcontrol.wait,
// 2 after the first chunk's MMAs, 3 after the main loop, 4 end of the finish, 5 SM id, 6 and
// 7 clock64 beside 2 and 3: the SM clock over the loop).
// Diagnostic only: where a GEMV's time goes between its launch ramp, its first data, its
// stream and its tail.
#pragma once
#include <algorithm>
#include <cstdio>
#include <map>
#include <vector>

void cfp4_pgemv_set_timeline(unsigned long long* p);
void cfp4_pgemv_set_timeline_keys(const void* const* keys, int n, unsigned long long stride);

// The q-quantile (0..1, nearest rank) of v; 0 when v is empty.
static double tl_pct(std::vector<double> v, double q) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, size_t(q * (v.size() - 1) + 0.5))];
}

// Words per warp record: TL_SLOTS of kernels/gemv_packed_timeline.cuh.
constexpr int TL_SLOTS = 8;

struct Timeline {
    unsigned long long* dev = nullptr;
    size_t recs = 0;
    void arm(size_t ctas, int max_warps) {
        recs = ctas * size_t(max_warps);
        CK(cudaMalloc(&dev, recs * TL_SLOTS * 8));
        CK(cudaMemset(dev, 0, recs * TL_SLOTS * 8));
        cfp4_pgemv_set_timeline(dev);
    }
    // Prints one line: percentiles (µs) of each phase, the span and the SMs' end spread.
    void report(const char* name, double bytes) {
        cfp4_pgemv_set_timeline(nullptr);
        std::vector<unsigned long long> h(recs * TL_SLOTS);
        CK(cudaMemcpy(h.data(), dev, h.size() * 8, cudaMemcpyDeviceToHost));
        cudaFree(dev);
        dev = nullptr;
        unsigned long long t0 = ~0ull, t4 = 0;
        std::vector<double> start, wait, first, loop, fin, end, mhz;
        std::map<unsigned long long, std::pair<unsigned long long, unsigned long long>> sm;  // first start, last end
        for (size_t r = 0; r < recs; ++r) {
            const unsigned long long* s = &h[r * TL_SLOTS];
            if (s[0] == 0 || s[4] == 0) continue;
            t0 = std::min(t0, s[0]);
            t4 = std::max(t4, s[4]);
        }
        if (t0 == ~0ull) {
            printf("    timeline %s: no stamps\n", name);
            return;
        }
        for (size_t r = 0; r < recs; ++r) {
            const unsigned long long* s = &h[r * TL_SLOTS];
            if (s[0] == 0 || s[4] == 0) continue;
            start.push_back((s[0] - t0) * 1e-3);
            wait.push_back((s[1] - s[0]) * 1e-3);
            if (s[2]) first.push_back((s[2] - s[1]) * 1e-3);
            if (s[2] && s[3]) loop.push_back((s[3] - s[2]) * 1e-3);
            if (s[3] > s[2] && s[7] > s[6]) mhz.push_back(double(s[7] - s[6]) / double(s[3] - s[2]) * 1e3);
            if (s[3]) fin.push_back((s[4] - s[3]) * 1e-3);
            end.push_back((s[4] - t0) * 1e-3);
            auto it = sm.find(s[5]);
            if (it == sm.end()) sm[s[5]] = {s[0], s[4]};
            else it->second = {std::min(it->second.first, s[0]), std::max(it->second.second, s[4])};
        }
        const auto pct = tl_pct;
        std::vector<double> smend;
        double busy = 0;
        for (auto& kv : sm) {
            smend.push_back((kv.second.second - t0) * 1e-3);
            busy += (kv.second.second - kv.second.first) * 1e-3;
        }
        const double span = (t4 - t0) * 1e-3;
        printf("    timeline %s: warps %zu, SMs %zu, span %.2f us (%.0f GB/s) | start p50 %.2f max %.2f | wait p50 %.2f | "
               "first chunk p50 %.2f p90 %.2f | loop p50 %.2f p90 %.2f | finish p50 %.2f | warp end p10 %.2f p50 %.2f | "
               "SM end p10 %.2f p50 %.2f max %.2f | SM busy %.0f%% | loop SM clock p10 %.0f p50 %.0f MHz\n",
               name, end.size(), sm.size(), span, bytes / span / 1e3, pct(start, 0.5), pct(start, 1.0), pct(wait, 0.5),
               pct(first, 0.5), pct(first, 0.9), pct(loop, 0.5), pct(loop, 0.9), pct(fin, 0.5), pct(end, 0.1),
               pct(end, 0.5), pct(smend, 0.1), pct(smend, 0.5), pct(smend, 1.0),
               sm.empty() ? 0.0 : 100.0 * busy / (double(sm.size()) * span), pct(mhz, 0.1), pct(mhz, 0.5));
    }
};
