// Host emulation harness of kernels/ultraquant.cu (driven by tests/kv_cache_emu.rs): runs the
// store, read-back, attention and combine kernels on reference cases dumped by the Rust test
// and compares with the CPU results (store/read bit for bit; attention within one BF16 ulp
// + 2^-13 max|o|, the tolerance of tests/kv_cache_gpu.rs).
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>
#include <map>
#include "emu.h"
#include "ultraquant.cuh"

// The in-kernel merge loads 2 splits per batch here instead of 12 (kv_attention.cuh), so the
// cases' 3–6 non-empty splits span several batches.
#define CFP4_MERGE_BATCH 2

// The kernels themselves (the emulated source, same translation unit: the harness takes the
// attention kernels' launch configuration from their Cfg instead of restating it).
#include "ultraquant_emu.cu"

float bf(uint16_t x) { uint32_t u = uint32_t(x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
double ulp(double x) { x = std::fabs(x); if (x < 1.17549435e-38) return std::ldexp(1.0, -133); return std::ldexp(1.0, int(std::floor(std::log2(x))) - 7); }

// The attention kernel for (fp4, d, nt), its warps and its dynamic shared memory (Cfg).
struct AttnKernel { void (*fn)(KvAttnParams); int nw; size_t smem; };
template <bool FP4, int D, int NT> AttnKernel attn_kernel(void (*fn)(KvAttnParams)) {
    return {fn, Cfg<FP4, D, NT>::NW, size_t(Cfg<FP4, D, NT>::SMEM)};
}
AttnKernel attn_kernel(bool fp4, int d, int nt) {
    if (fp4) { if (d == 64) return nt == 1 ? attn_kernel<true, 64, 1>(cfp4_kv_attn_uq_d64_nt1) : attn_kernel<true, 64, 2>(cfp4_kv_attn_uq_d64_nt2);
               if (d == 128) return nt == 1 ? attn_kernel<true, 128, 1>(cfp4_kv_attn_uq_d128_nt1) : attn_kernel<true, 128, 2>(cfp4_kv_attn_uq_d128_nt2);
               return attn_kernel<true, 256, 1>(cfp4_kv_attn_uq_d256_nt1); }
    if (d == 64) return nt == 1 ? attn_kernel<false, 64, 1>(cfp4_kv_attn_bf16_d64_nt1) : attn_kernel<false, 64, 2>(cfp4_kv_attn_bf16_d64_nt2);
    if (d == 128) return nt == 1 ? attn_kernel<false, 128, 1>(cfp4_kv_attn_bf16_d128_nt1) : attn_kernel<false, 128, 2>(cfp4_kv_attn_bf16_d128_nt2);
    return attn_kernel<false, 256, 1>(cfp4_kv_attn_bf16_d256_nt1);
}

int failures = 0;
// Non-finite expected values (case 0's V holds a NaN and a +inf) must come out non-finite
// (the BF16 kernel's P = hi + lo split turns inf · 0 into NaN where the CPU sums +inf), and
// finite ones finite; the tolerance's max|o| is over the finite ones, so that one infinite
// head does not make every other comparison pass.
void compare_out(const char* what, const std::vector<uint16_t>& got, const std::vector<uint16_t>& want) {
    double omax = 0; for (auto w : want) if (std::isfinite(bf(w))) omax = std::max(omax, (double)std::fabs(bf(w)));
    double worst = 0; size_t wi = 0; int exact = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        double x = bf(got[i]), y = bf(want[i]);
        double r;
        if (!std::isfinite(y) || !std::isfinite(x)) {
            r = !std::isfinite(x) && !std::isfinite(y) ? 0.0 : INFINITY;
        } else {
            double tol = ulp(std::max(std::fabs(x), std::fabs(y))) + omax * std::ldexp(1.0, -13);
            r = std::fabs(x - y) / tol;
        }
        if (r > worst) { worst = r; wi = i; } exact += got[i] == want[i];
    }
    printf("  %-28s worst %.3f of tolerance (elem %zu: %g vs %g), %d/%zu bit-equal%s\n", what, worst, wi, bf(got[wi]), bf(want[wi]), exact, want.size(), worst > 1 ? "  <-- FAIL" : "");
    if (worst > 1) failures++;
}

// The exact window's ring of w rows [2][batch][w][kh][d] holding tokens max(n - w, 0) .. n - 1
// of each sequence (n = lens[b]) at rows t % w, from the BF16 cache kvb [2][batch][cap][kh][d];
// other rows NaN.
std::vector<uint16_t> ring_of(const std::vector<uint16_t>& kvb, const std::vector<uint32_t>& lens, int batch, int cap,
                              int kh, int d, int w) {
    const size_t half = kvb.size() / 2, rhalf = size_t(batch) * w * kh * d, row = size_t(kh) * d;
    std::vector<uint16_t> ring(2 * rhalf, 0xFFFF);
    for (int z = 0; z < 2; ++z) for (int b = 0; b < batch; ++b)
        for (int t = std::max(int(lens[b]) - w, 0); t < int(lens[b]); ++t)
            std::memcpy(&ring[z * rhalf + (size_t(b) * w + t % w) * row], &kvb[z * half + (size_t(b) * cap + t) * row], row * 2);
    return ring;
}

// UltraQuant cache with an exact window of w tokens, the decode step's rope and append inside
// the ring's and the UltraQuant launches (identity rope tables: q|k|v rows built from q and
// each sequence's last token, which the cache, the ring and the lengths then do not hold yet:
// its slot and ring row poisoned) against the unfused launches on the cache that holds it.
// The ring `late` (after the UltraQuant launch) or first; splits merged by the combine
// kernel or in the kernel. Output, slots, ring rows and lengths must agree bit for bit.
void uq_fused(const std::vector<uint8_t>& cache, const std::vector<uint16_t>& kvb, const std::vector<uint16_t>& q,
              const std::vector<uint32_t>& lens, int batch, int cap, int kh, int d, int g, int w, bool late, bool fused,
              int splits) {
    const int qh = kh * g, nt = (g <= 4 || d == 256) ? 1 : 2, chunks = (g + 4 * nt - 1) / (4 * nt);
    const AttnKernel uk = attn_kernel(true, d, nt), rk = attn_kernel(false, d, nt);
    const int rs = (w + 16 * rk.nw - 1) / (16 * rk.nw), total = splits + rs, slot = d + d / 16;
    const size_t rhalf = size_t(batch) * w * kh * d;
    auto run = [&](const uint8_t* uq, uint16_t* ring, uint32_t* lb, const uint16_t* qq, int q_row, bool rope,
                   std::vector<uint16_t>& out) {
        std::vector<float> po(size_t(batch) * qh * total * d), pm(size_t(batch) * qh * total * 2);
        std::vector<uint32_t> ctr(size_t(batch) * kh * chunks + batch, 0);  // groups, then sequences
        std::vector<uint16_t> cs(d / 2, 0x3f80), sn(d / 2, 0);
        std::vector<uint32_t> pos(batch, 0);
        KvAttnParams up{qq, uq, nullptr, lb, out.data(), po.data(), pm.data(), 1.4426950408889634f / std::sqrt(float(d)), qh, kh, g,
                        cap, splits, d, w, fused ? ctr.data() : nullptr, rs, total, 0, q_row};
        if (rope) { up.positions = pos.data(); up.cos = cs.data(); up.sin = sn.data(); up.max_pos = 1; up.store_c = 0.156f; }
        KvAttnParams rp = up;
        rp.k = ring; rp.v = ring + rhalf; rp.capacity = w; rp.splits = rs; rp.split_base = 0; rp.late_wait = late;
        auto launch = [&](const AttnKernel& k, const KvAttnParams& p, int s) {
            emu_launch(k.fn, dim3{unsigned(s), unsigned(kh * chunks), unsigned(batch)}, unsigned(k.nw * 32), k.smem, p);
        };
        if (!late) launch(rk, rp, rs);
        launch(uk, up, splits);
        if (late) launch(rk, rp, rs);
        if (!fused) {  // (fused: the merge advances the lengths)
            KvCombineParams cp{po.data(), pm.data(), out.data(), qh, total, d, 0, rope ? lb : nullptr};
            emu_launch(cfp4_kv_combine, dim3{unsigned(qh), unsigned(batch), 1}, 128, 0, cp);
        }
    };
    // Unfused: the cache, ring and lengths after the append.
    std::vector<uint16_t> ring = ring_of(kvb, lens, batch, cap, kh, d, w), want(size_t(batch) * qh * d, 0xFFFF);
    std::vector<uint32_t> lw(lens.begin(), lens.begin() + batch);
    run(cache.data(), ring.data(), lw.data(), q.data(), qh * d, false, want);
    // Fused: one token less everywhere.
    const int row = (qh + 2 * kh) * d;
    std::vector<uint32_t> lb(batch);
    std::vector<uint16_t> qkv(size_t(batch) * row);
    std::vector<uint8_t> c2 = cache;
    const size_t half = kvb.size() / 2;
    for (int b = 0; b < batch; ++b) {
        lb[b] = lens[b] - 1;
        std::memcpy(&qkv[size_t(b) * row], &q[size_t(b) * qh * d], size_t(qh) * d * 2);
        for (int h = 0; h < kh; ++h) {
            const size_t at = ((size_t(b) * cap + lb[b]) * kh + h) * d;
            std::memcpy(&qkv[size_t(b) * row + size_t(qh + h) * d], &kvb[at], size_t(d) * 2);
            std::memcpy(&qkv[size_t(b) * row + size_t(qh + kh + h) * d], &kvb[half + at], size_t(d) * 2);
            std::memset(&c2[((size_t(b) * cap + lb[b]) * kh + h) * slot], 0xAB, slot);
        }
    }
    std::vector<uint16_t> r2 = ring_of(kvb, lb, batch, cap, kh, d, w), got(want.size(), 0xFFFF);
    run(c2.data(), r2.data(), lb.data(), qkv.data(), row, true, got);
    size_t dout = 0, dc = 0, dr = 0, dl = 0;
    for (size_t i = 0; i < got.size(); ++i) dout += got[i] != want[i];
    for (size_t i = 0; i < cache.size(); ++i) dc += c2[i] != cache[i];
    for (size_t i = 0; i < ring.size(); ++i) dr += r2[i] != ring[i];
    for (int b = 0; b < batch; ++b) dl += lb[b] != lens[b];
    char what[96];
    snprintf(what, 96, "uq window %d, ring %s, splits %d+%d %s", w, late ? "late" : "first", rs, splits, fused ? "fused" : "combined");
    printf("  %-44s rope/append inside: %zu output, %zu slot, %zu ring, %zu length differences%s\n", what, dout, dc, dr, dl,
           dout + dc + dr + dl ? "  <-- FAIL" : "");
    if (dout + dc + dr + dl) failures++;
}

int main(int argc, char** argv) {
    std::ifstream cf("cases.txt"); std::string line;
    std::map<int, std::vector<std::vector<int>>> calls;
    int only = argc > 1 ? atoi(argv[1]) : -1;
    while (std::getline(cf, line)) {
        std::istringstream ss(line); std::string kind; ss >> kind;
        if (kind == "call") { int id, ci, sb, ns, tok; ss >> id >> ci >> sb >> ns >> tok; calls[id].push_back({ci, sb, ns, tok}); continue; }
        int id, d, kh, g, batch, cap, nc; ss >> id >> d >> kh >> g >> batch >> cap >> nc;
        if (only >= 0 && id != only) continue;
        printf("case %d: d=%d kv_heads=%d group=%d\n", id, d, kh, g);
        std::string p = "c" + std::to_string(id);
        int slot = d + d / 16; size_t nbytes = size_t(batch) * cap * kh * slot;
        std::vector<uint8_t> cache(nbytes + 16, 0);
        for (auto& c : calls[id]) {
            auto k = emu_read<uint16_t>(p + "_call" + std::to_string(c[0]) + "_k.bin");
            auto v = emu_read<uint16_t>(p + "_call" + std::to_string(c[0]) + "_v.bin");
            auto lb = emu_read<uint32_t>(p + "_call" + std::to_string(c[0]) + "_lens.bin");
            UqStoreParams sp{cache.data(), k.data(), v.data(), lb.data(), 0.156f, c[1], c[2], c[3], kh, cap, d, 0};
            unsigned warps = c[2] * c[3] * kh; unsigned block = 64;
            auto fn = d == 64 ? cfp4_uq_store_d64 : d == 128 ? cfp4_uq_store_d128 : cfp4_uq_store_d256;
            emu_launch(fn, dim3{(warps + block / 32 - 1) / (block / 32), 1, 1}, block, 0, sp);
        }
        auto slots = emu_read<uint8_t>(p + "_slots.bin");
        size_t diff = 0; for (size_t i = 0; i < nbytes; ++i) diff += slots[i] != cache[i];
        printf("  store: %zu of %zu bytes differ%s\n", diff, nbytes, diff ? "  <-- FAIL" : ""); if (diff) failures++;
        auto lens = emu_read<uint32_t>(p + "_lens.bin");
        {
            int cnt = lens[1]; std::vector<uint16_t> out(2 * size_t(cnt) * kh * d);
            UqReadParams rp{cache.data(), out.data(), 1, 0, cnt, kh, cap, d};
            auto fn = d == 64 ? cfp4_uq_read_d64 : d == 128 ? cfp4_uq_read_d128 : cfp4_uq_read_d256;
            unsigned warps = cnt * kh; emu_launch(fn, dim3{(warps + 1) / 2, 1, 1}, 64, 0, rp);
            auto rk = emu_read<uint16_t>(p + "_rk.bin"), rv = emu_read<uint16_t>(p + "_rv.bin");
            size_t dk = 0, dv = 0; for (size_t i = 0; i < rk.size(); ++i) { dk += out[i] != rk[i]; dv += out[rk.size() + i] != rv[i]; }
            printf("  read: K %zu, V %zu of %zu differ%s\n", dk, dv, rk.size(), dk + dv ? "  <-- FAIL" : ""); if (dk + dv) failures++;
        }
        auto q = emu_read<uint16_t>(p + "_q.bin"); int qh = kh * g;
        auto kvb = emu_read<uint16_t>(p + "_kvbf16.bin");
        for (int fp4 = 1; fp4 >= 0; --fp4) {
            auto want = emu_read<uint16_t>(p + (fp4 ? "_ouq.bin" : "_obf.bin"));
            int nt = (g <= 4 || d == 256) ? 1 : 2; int chunks = (g + 4 * nt - 1) / (4 * nt);
            const AttnKernel ak = attn_kernel(fp4, d, nt);
            // splits merged by the combine kernel (counters null) or by the attention
            // kernel's last CTA per head group (counters zeroed, as the host does per call)
            for (int fused = 0; fused < 2; ++fused) for (int splits : {1, 2, 5, 13}) {
                if (fused && splits == 1) continue;
                // 13 (in-kernel merge only): more splits than tiles, so empty ranges in
                // the merge's later batches beside non-empty ones in its first three.
                if (!fused && splits == 13) continue;
                std::vector<uint16_t> out(size_t(batch) * qh * d, 0xFFFF);
                std::vector<float> po(size_t(batch) * qh * splits * d), pm(size_t(batch) * qh * splits * 2);
                std::vector<uint32_t> ctr(size_t(batch) * kh * chunks, 0);
                size_t half = kvb.size() / 2;
                KvAttnParams ap{q.data(), fp4 ? (const void*)cache.data() : (const void*)kvb.data(), fp4 ? nullptr : (const void*)(kvb.data() + half),
                                lens.data(), out.data(), po.data(), pm.data(), 1.4426950408889634f / std::sqrt(float(d)), qh, kh, g, cap, splits, d,
                                /*win*/ 0, fused ? ctr.data() : nullptr, /*split_base*/ 0, /*part_splits*/ splits, /*late_wait*/ 0,
                                /*q_row*/ qh * d};
                emu_launch(ak.fn, dim3{unsigned(splits), unsigned(kh * chunks), unsigned(batch)}, unsigned(ak.nw * 32), ak.smem, ap);
                if (splits > 1 && !fused) {
                    KvCombineParams cp{po.data(), pm.data(), out.data(), qh, splits, d, 0};
                    emu_launch(cfp4_kv_combine, dim3{unsigned(qh), unsigned(batch), 1}, 128, 0, cp);
                }
                char what[64]; snprintf(what, 64, "%s attention splits=%d%s", fp4 ? "uq" : "bf16", splits, fused ? " fused" : "");
                compare_out(what, out, want);
                if (!fp4) {
                    // Rope + append inside the attention, with identity tables (cos 1, sin 0: the
                    // rotation returns its input): q|k|v rows built from q and each sequence's
                    // last K/V row, that row poisoned in the cache and the lengths one shorter.
                    // Must give the bits above, restore the rows, and (combine) the lengths.
                    const int row = (qh + 2 * kh) * d;
                    std::vector<uint16_t> qkv(size_t(batch) * row), kv2 = kvb, out2(out.size(), 0xFFFF);
                    std::vector<uint32_t> lb(lens.begin(), lens.begin() + batch);
                    for (int b = 0; b < batch; ++b) {
                        const size_t last = size_t(lens[b]) - 1;
                        lb[b] = uint32_t(last);
                        std::memcpy(&qkv[size_t(b) * row], &q[size_t(b) * qh * d], size_t(qh) * d * 2);
                        for (int h = 0; h < kh; ++h) for (int i = 0; i < d; ++i) {
                            const size_t at = ((size_t(b) * cap + last) * kh + h) * d + i;
                            qkv[size_t(b) * row + size_t(qh + h) * d + i] = kvb[at];
                            qkv[size_t(b) * row + size_t(qh + kh + h) * d + i] = kvb[half + at];
                            kv2[at] = kv2[half + at] = 0xFFFF;
                        }
                    }
                    std::vector<uint16_t> cs(d / 2, 0x3f80), sn(d / 2, 0);
                    std::vector<uint32_t> pos(batch, 0);
                    std::vector<uint32_t> ctr2(ctr.size() + batch, 0);  // + the merge's per-sequence counters
                    KvAttnParams fp = ap;
                    fp.q = qkv.data(); fp.k = kv2.data(); fp.v = kv2.data() + half; fp.lens = lb.data(); fp.out = out2.data();
                    fp.counters = fused ? ctr2.data() : nullptr; fp.q_row = row;
                    fp.positions = pos.data(); fp.cos = cs.data(); fp.sin = sn.data(); fp.max_pos = 1;
                    emu_launch(ak.fn, dim3{unsigned(splits), unsigned(kh * chunks), unsigned(batch)}, unsigned(ak.nw * 32), ak.smem, fp);
                    const bool combined = splits > 1 && !fused;
                    if (combined) {
                        KvCombineParams cp{po.data(), pm.data(), out2.data(), qh, splits, d, 0, lb.data()};
                        emu_launch(cfp4_kv_combine, dim3{unsigned(qh), unsigned(batch), 1}, 128, 0, cp);
                    }
                    size_t dout = 0, dkv = 0, dl = 0;
                    for (size_t i = 0; i < out.size(); ++i) dout += out2[i] != out[i];
                    for (size_t i = 0; i < kvb.size(); ++i) dkv += kv2[i] != kvb[i];
                    // Advanced by the combine or the in-kernel merge; one split: by the lengths kernel (not run here).
                    for (int b = 0; b < batch; ++b) dl += lb[b] != lens[b] - (splits > 1 ? 0u : 1u);
                    printf("  %-28s %zu output, %zu cache, %zu length differences%s\n", "  + rope/append inside", dout, dkv, dl,
                           dout + dkv + dl ? "  <-- FAIL" : "");
                    if (dout + dkv + dl) failures++;
                }
            }
        }
        // The fused UltraQuant step with an exact window (on half of the cases: the emulation
        // is slow): windows shorter (16) and longer (64) than the first sequence.
        if (kh == 3 || kh == 2 && g == 9) {
            uq_fused(cache, kvb, q, lens, batch, cap, kh, d, g, 16, true, true, 5);
            uq_fused(cache, kvb, q, lens, batch, cap, kh, d, g, 16, false, false, 3);
            uq_fused(cache, kvb, q, lens, batch, cap, kh, d, g, 64, true, false, 2);
            uq_fused(cache, kvb, q, lens, batch, cap, kh, d, g, 64, false, true, 2);
        }
    }
    printf("%s (%d failures)\n", failures ? "FAILED" : "ALL OK", failures);
    return failures != 0;
}
