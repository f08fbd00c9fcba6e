// kv_attention.cu: split-KV decode attention over an UltraQuant or BF16 KV cache, and the
// combine of its splits. Cache layouts: ultraquant.cu (UltraQuant slots), KvAttnParams in
// ultraquant.cuh.
//
// Attention (cfp4_kv_attn_{uq,bf16}_d*_nt*): flash decoding. Grid (splits, kv_heads *
// head_chunks, batch); a CTA owns one token range of one (sequence, kv head) and the
// HC = 4*NT query heads of that KV group (so every byte read serves all of them). Each warp
// streams 16-token tiles of that range (tiles warp, warp + NW, ...) through its own
// NSTAGE-deep cp.async pipeline: the bytes of each slot are fetched as the 16-byte-aligned
// chunks that cover it (slots are 136 B = 8 * 17 at D = 128, so a slot starts 8-byte but not
// always 16-byte aligned; the smem copy keeps the slot's offset within its first chunk).
// Math on tensor cores (mma.m16n8k16 bf16, FP32 accumulate), tokens on M:
//   S[16 tok x 8] = K[16 x D] . Qcols[D x 8]; columns 2j / 2j+1 = head j's query split into
//     bf16 hi + lo (q = hi + lo to ~2^-17 relative), so S_hi + S_lo is q.k at ~FP32 accuracy;
//   O^T[16 d x 8] += V^T[16 d x 16 tok] . P[16 tok x 8], P likewise split into hi + lo.
// K and V codes go into the MMA as raw bits: nibble s e1 e0 m -> bf16 bits s 0000000e1 e0m000000
// = e2m1 * 2^-126 exactly (a bf16 subnormal for +-0.5; mma.sync keeps subnormal inputs and
// products, checked on the H200), 3.25 integer ops per pair of codes (e2m1_raw_pairs). The UE8M0
// scales (exact powers of 2) never touch the codes:
//   K: each k-step pair lies in one 32-value scale group, so S is summed per group in FP32 and
//      each group sum is multiplied by its scale (2^(byte-127), byte 0 -> 0);
//   V: the 16 d of an O^T m-tile lie in one group, so the scale of (token, group) multiplies
//      that token's P (a bf16 times a power of 2: exact).
// q and P carry 2^64 (so products stay far from the FP32 subnormal range), hence S and O are
// 2^-62 times the true values; sl and the output fold the 2^62 back. Supported range: |q| <
// 2^63, V scales 2^-64 <= s <= 2^63 (beyond: V flushed / saturated); any K scale. Online
// softmax in the log2 domain (ex2.approx.ftz), FP32. The warps of a CTA merge their (max, sum, O) in
// shared memory; with splits > 1 the CTA writes an unnormalized partial and cfp4_kv_combine
// merges the splits.
// k-order freedom: inside one MMA the k index may be permuted as long as A and B agree; the
// fragments below use the orders that make the decode and the shared-memory loads cheap
// (and bank-conflict free): see kd0() and vd().
#include <stdint.h>
#include <cuda_bf16.h>
#include "nvfp4_decode.cuh"  // e2m1_raw_pairs, bf16x2_mul (shared with the GEMV)
#include "ultraquant.cuh"
#include "kv_common.cuh"
#include "ultraquant_codec.cuh"  // encode_slot (the in-kernel store of the fused decode step)
#include "kv_attention.cuh"
#include "rope_math.cuh"  // rope_first, rope_second (shared with rope.cu)

namespace {

// The UltraQuant slot of one (token, KV head) from its raw k and v rows of the q|k|v
// projection: k rotated by the rope (rope.cu's arithmetic, bit for bit, rounded to bf16 as
// the rope kernel writes it), then encoded as the store kernel does (bit for bit).
template <int D>
__device__ __forceinline__ void store_rope_slot(const __nv_bfloat16* kr, const __nv_bfloat16* vr,
                                                const __nv_bfloat16* cs, const __nv_bfloat16* sn, uint8_t* slot,
                                                float c, int lane) {
    constexpr int E = D / 32, HALF = D / 2;
    float x[E], y[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = lane * E + e, i = d < HALF ? d : d - HALF;
        const __nv_bfloat16 k1 = kr[i], k2 = kr[i + HALF], co = cs[i], si = sn[i];
        x[e] = __bfloat162float(d < HALF ? cfp4::rope_first(k1, k2, co, si) : cfp4::rope_second(k1, k2, co, si));
        y[e] = __bfloat162float(vr[d]);
    }
    encode_slot<D>(x, y, slot, c, lane);
}

template <bool FP4, int D, int NT>
__device__ __forceinline__ void attn_body(const KvAttnParams& p) {
    using C = Cfg<FP4, D, NT>;
    constexpr int RS = C::SROW;  // shared bytes per stage row
    extern __shared__ __align__(16) uint8_t smem[];
    if (dynamic_smem_size() < uint32_t(C::SMEM) || p.head_dim != D || blockDim.x != C::THREADS) __trap();
    // q, lens and the newest slots come from the previous kernels. A late_wait launch (the
    // exact window's ring, queued after the UltraQuant launch of the same call) overlaps the
    // launch before it: it starts once every CTA of that launch is running, i.e. past its
    // griddep_wait, so everything the ring reads is complete; it waits for that launch only
    // before exiting (the kernel wrapper), so that its own dependents see both.
    // Rope + append fused (positions set; see KvAttnParams): q is the raw q|k|v projection and
    // lens the lengths before this token. A BF16 launch (the cache, or the exact window's
    // ring) then reads lens and the cached rows (< lens) before griddepcontrol.wait: the
    // decode step writes neither before this kernel (the layer's combine or lengths kernel
    // advances lens after it; the host launches without PDL when its own calls wrote them
    // since), so only q|k|v waits for the previous kernel. The UltraQuant launch waits first,
    // as unfused (a late ring after it relies on that).
    const bool fuse = p.positions != nullptr;
    if (!p.late_wait && (FP4 || !fuse)) griddep_wait();
    griddep_launch_dependents();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int split = blockIdx.x;
    const int kvh = int(blockIdx.y) % p.kv_heads;
    const int hc = int(blockIdx.y) / p.kv_heads;
    const int b = blockIdx.z;
    // Tokens this launch attends over: all, or with an exact window of the last `win` tokens
    // in a BF16 ring, the UltraQuant slots before it / the ring rows.
    const int len_old = int(p.lens[b]);  // fused: the new token's row
    const int len_all = fuse ? min(len_old + 1, p.capacity) : len_old;
    const int len = p.win <= 0 ? len_all : FP4 ? max(len_all - p.win, 0) : min(len_all, p.win);
    constexpr int TT = 16 * C::TPI;  // tokens per stage
    const int per = (((len + p.splits - 1) / p.splits) + TT - 1) / TT * TT;
    const int t0 = min(split * per, len), t1 = min(t0 + per, len);
    const int ntiles = (t1 - t0 + TT - 1) / TT;
    const int cnt = warp < ntiles ? (ntiles - 1 - warp) / C::NW + 1 : 0;
    // Fused: tokens from tcopy on are not in the cache yet (zero-filled in the stages); the
    // new token's stage row is written from registers by warp new_warp at iteration new_it.
    // Its row: lens[b] in the BF16 cache, lens[b] % window in the exact window's ring (whose
    // rows are attended in any order: the softmax sum does not care). The UltraQuant launch
    // attends none of it (the ring holds it until it leaves the window) and stores its slot.
    const int new_row = p.win > 0 ? len_old % p.capacity : len_old;
    const int tcopy = fuse ? min(t1, len_old) : t1;
    const bool owns_new = fuse && !FP4 && t0 <= new_row && new_row < t1;
    const int new_tile = owns_new ? (new_row - t0) / TT : 0;
    const bool new_here = owns_new && warp == new_tile % C::NW;
    const int new_it = new_tile / C::NW;
    const uint8_t* kb = static_cast<const uint8_t*>(p.k);
    const uint8_t* vb = static_cast<const uint8_t*>(p.v);
    const size_t row0 = size_t(b) * p.capacity * p.kv_heads + kvh;
    uint8_t* stages = smem + warp * C::NSTAGE * C::STAGE;
    // This warp's first slot; later stages are `step` bytes apart (UltraQuant).
    const uint8_t* first0 = opaque(kb + (row0 + size_t(t0 + TT * warp) * p.kv_heads) * C::SLOT);
    const size_t step = size_t(TT) * C::NW * p.kv_heads * C::SLOT;
    const StageCopy<FP4, D, NT> copy(first0, p.kv_heads, lane);
    // cp.async of this warp's stage `it` into stage buffer `buf`.
    auto issue = [&](uint8_t* buf, int it) {
        const int tb = t0 + TT * (warp + it * C::NW);
        if constexpr (FP4) {
            if (tb + TT <= t1) {
                copy.load(buf, first0 + size_t(it) * step, lane);
                return;
            }
        }
        load_tile<FP4, D, NT>(buf, kb, vb, row0, p.kv_heads, tb, tcopy, lane);
    };

    // Start streaming before the query is prepared.
#pragma unroll
    for (int s = 0; s < C::NSTAGE - 1; ++s) {
        if (s < cnt) issue(stages + s * C::STAGE, s);
        cp_async_commit();
    }

    // Fused: the rope tables' row of this sequence's position, the new token's rotated k and
    // its v (bf16 pairs (i, i + D/2), i = lane + 32 r) in the owning warp, stored in the cache
    // by head chunk 0's CTA; then every rope and load of q|k|v after the wait.
    constexpr int HALF = D / 2, NP = (HALF + 31) / 32;
    const __nv_bfloat16* qkv = static_cast<const __nv_bfloat16*>(p.q) + size_t(b) * p.q_row;
    const __nv_bfloat16* cs = nullptr;
    const __nv_bfloat16* sn = nullptr;
    uint32_t newk[NP] = {}, newv[NP] = {};
    if (fuse) {
        const size_t pos = size_t(min(p.positions[b], uint32_t(p.max_pos - 1)));
        cs = static_cast<const __nv_bfloat16*>(p.cos) + pos * HALF;
        sn = static_cast<const __nv_bfloat16*>(p.sin) + pos * HALF;
        // q|k|v comes from the previous kernel (a late ring's launch waited for it).
        if (!FP4 && !p.late_wait) griddep_wait();
        if (new_here) {
            const __nv_bfloat16* kr = qkv + size_t(p.q_heads + kvh) * D;
            const __nv_bfloat16* vr = qkv + size_t(p.q_heads + p.kv_heads + kvh) * D;
            const size_t at = (row0 + size_t(new_row) * p.kv_heads) * D;
#pragma unroll
            for (int r = 0; r < NP; ++r) {
                const int i = lane + 32 * r;
                if (i < HALF) {
                    const __nv_bfloat16 k1 = kr[i], k2 = kr[i + HALF], c = cs[i], s = sn[i];
                    const __nv_bfloat16 y1 = cfp4::rope_first(k1, k2, c, s);
                    const __nv_bfloat16 y2 = cfp4::rope_second(k1, k2, c, s);
                    const __nv_bfloat16 v1 = vr[i], v2 = vr[i + HALF];
                    newk[r] = uint32_t(__bfloat16_as_ushort(y1)) | (uint32_t(__bfloat16_as_ushort(y2)) << 16);
                    newv[r] = uint32_t(__bfloat16_as_ushort(v1)) | (uint32_t(__bfloat16_as_ushort(v2)) << 16);
                    if (hc == 0) {
                        __nv_bfloat16* kc = static_cast<__nv_bfloat16*>(const_cast<void*>(p.k)) + at;
                        __nv_bfloat16* vc = static_cast<__nv_bfloat16*>(const_cast<void*>(p.v)) + at;
                        kc[i] = y1;
                        kc[i + HALF] = y2;
                        vc[i] = v1;
                        vc[i + HALF] = v2;
                    }
                }
            }
        }
    }

    // Queries of this CTA's heads (zeros past the group), rotated like K for UltraQuant.
    // Row r = HC * (head of the CTA) + j.
    float* qs = reinterpret_cast<float*>(smem + C::QS_OFF);
    const int head0 = hc * C::HC;
    for (int idx = threadIdx.x; idx < C::HC * D; idx += C::THREADS) {
        const int j = idx / D, d = idx - j * D;
        float x = 0.f;
        if (head0 + j < p.group) {
            const __nv_bfloat16* row = qkv + (size_t(kvh) * p.group + head0 + j) * D;
            if (fuse) {
                // rope.cu's arithmetic, bit for bit
                const int i = d < HALF ? d : d - HALF;
                const __nv_bfloat16 x1 = row[i], x2 = row[i + HALF], c = cs[i], s = sn[i];
                x = __bfloat162float(d < HALF ? cfp4::rope_first(x1, x2, c, s) : cfp4::rope_second(x1, x2, c, s));
            } else {
                x = __bfloat162float(row[d]);
            }
        }
        qs[idx] = x;
    }
    __syncthreads();
    if constexpr (FP4) {
        // Each query row rotated like K by one warp in registers (wht_warp: the store's
        // butterflies, in its order and rounding), one barrier instead of one per stage.
        static_assert(C::NW >= C::HC, "a warp per query row");
        if (warp < C::HC) {
            constexpr int E = D / 32;
            float* row = qs + warp * D + lane * E;
            float x[E];
#pragma unroll
            for (int e = 0; e < E; ++e) x[e] = row[e];
            wht_warp<D>(x, lane);
#pragma unroll
            for (int e = 0; e < E; ++e) row[e] = x[e];
        }
        __syncthreads();
    }
    // Q operand (B of S = K . Q): column g = head 4nt + g/2, part hi (g even) or lo (g odd).
    // UltraQuant: q carries 2^64 and the raw K codes 2^-126 (e2m1_raw_pairs), so S is 2^-62
    // times the true scores (folded into sl); V codes 2^-126 and P 2^64: O is 2^-62 times (unbias).
    const float qbias = FP4 ? 0x1p64f : 1.f;
    uint32_t qb[C::KS][NT][2];
    {
        const bool lo = (g & 1) != 0;
#pragma unroll
        for (int ks = 0; ks < C::KS; ++ks) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const float* row = qs + (4 * nt + (g >> 1)) * D;
                const int d0 = kd0<FP4>(ks, t);
                const int d1 = d0 + kH1<FP4>;
                qb[ks][nt][0] = split_part(row[d0] * qbias, lo) | (split_part(row[d0 + kE1<FP4>] * qbias, lo) << 16);
                qb[ks][nt][1] = split_part(row[d1] * qbias, lo) | (split_part(row[d1 + kE1<FP4>] * qbias, lo) << 16);
            }
        }
    }
    // Scores in the log2 domain; P (and so l) carries 2^pbias: 2^64 for UltraQuant.
    const float sl = FP4 ? p.scale_log2 * 0x1p62f : p.scale_log2;
    const float pbias = FP4 ? 64.f : 0.f;

    float o[C::MT][NT][4];
    float m[NT], l[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        m[nt] = neg_inf();
        l[nt] = 0.f;
#pragma unroll
        for (int i = 0; i < C::MT; ++i) o[i][nt][0] = o[i][nt][1] = o[i][nt][2] = o[i][nt][3] = 0.f;
    }

    // Shared-memory offsets of the stage rows this thread reads (slot offset within the row
    // included; the same in every stage, see StageCopy): rows g, 2t and 2t + 1 (their + 8,
    // + 16 and + 24 rows have the same slot offsets).
    auto row_off = [&](int i) -> uint32_t {
        if constexpr (FP4) {
            return uint32_t(i * C::SROW) + StageCopy<FP4, D, NT>::slot_mis(first0, i, p.kv_heads);
        } else {
            return uint32_t(i * C::SROW);
        }
    };
    const uint32_t off_g = opaque(row_off(g)), off_a = opaque(row_off(2 * t)), off_b = opaque(row_off(2 * t + 1));

#pragma unroll 1
    for (int it = 0; it < cnt; ++it) {
        const int nx = it + C::NSTAGE - 1;
        if (nx < cnt) issue(stages + (nx % C::NSTAGE) * C::STAGE, nx);
        cp_async_commit();
        cp_async_wait_group<C::NSTAGE - 1>();
        __syncwarp();
        uint8_t* buf = stages + (it % C::NSTAGE) * C::STAGE;
        const int tb0 = t0 + TT * (warp + it * C::NW);
        if constexpr (!FP4) {
            if (new_here && it == new_it) {  // the new token's row (zeros, or the ring's old row, in the copy)
                uint8_t* row = buf + (new_row - tb0) * RS;
#pragma unroll
                for (int r = 0; r < NP; ++r) {
                    const int i = lane + 32 * r;
                    if (i < HALF) {
                        uint16_t* kr = reinterpret_cast<uint16_t*>(row);
                        uint16_t* vr = reinterpret_cast<uint16_t*>(row + 2 * D);
                        kr[i] = uint16_t(newk[r]);
                        kr[i + HALF] = uint16_t(newk[r] >> 16);
                        vr[i] = uint16_t(newv[r]);
                        vr[i + HALF] = uint16_t(newv[r] >> 16);
                    }
                }
                __syncwarp();
            }
        }
        const bool full = tb0 + TT <= t1;  // warp-uniform: no token of the stage is masked
        const uint8_t* bg = buf + off_g;  // rows g (+ 8, + 16, + 24)
        const uint8_t* ba = buf + off_a;  // rows 2t (+ 8, + 16, + 24)
        const uint8_t* bb = buf + off_b;  // rows 2t + 1 (+ 8, + 16, + 24)

        // ---- S = K . Q per tile e (rows: tokens 16e + g, 16e + g + 8)
        float sa_[C::TPI][NT][4];
#pragma unroll
        for (int e = 0; e < C::TPI; ++e) {
            float (&s)[NT][4] = sa_[e];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
            const uint8_t* rg = bg + 16 * e * RS;
            const uint8_t* rg8 = bg + (16 * e + 8) * RS;
            if constexpr (FP4) {
                // Thread t reads K-code words t + 4w (group w); word -> 2 k-steps, summed per
                // group in FP32 and then scaled by the group's UE8M0 scale (exact power of 2).
                constexpr int G = D / 32;
                uint32_t sg[(G + 3) / 4], sg8[(G + 3) / 4];
                load_scale_words<G>(rg + D / 2, sg);
                load_scale_words<G>(rg8 + D / 2, sg8);
#pragma unroll
                for (int w = 0; w < G; ++w) {
                    float acc[NT][4];
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
                    uint32_t a0[4], a1[4];
                    e2m1_raw_pairs<true>(lds32<4>(rg + 4 * (t + 4 * w)), a0);
                    e2m1_raw_pairs<true>(lds32<4>(rg8 + 4 * (t + 4 * w)), a1);
#pragma unroll
                    for (int kl = 0; kl < 2; ++kl) {
                        const uint32_t a[4] = {a0[2 * kl], a1[2 * kl], a0[2 * kl + 1], a1[2 * kl + 1]};
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) mma_bf16(acc[nt], a, qb[2 * w + kl][nt][0], qb[2 * w + kl][nt][1]);
                    }
                    const float f0 = scale_f32<G>(sg, w), f1 = scale_f32<G>(sg8, w);
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        s[nt][0] = fmaf(f0, acc[nt][0], s[nt][0]);
                        s[nt][1] = fmaf(f0, acc[nt][1], s[nt][1]);
                        s[nt][2] = fmaf(f1, acc[nt][2], s[nt][2]);
                        s[nt][3] = fmaf(f1, acc[nt][3], s[nt][3]);
                    }
                }
            } else {
                const uint32_t* kg = reinterpret_cast<const uint32_t*>(rg);
                const uint32_t* kg8 = reinterpret_cast<const uint32_t*>(rg8);
#pragma unroll
                for (int ks = 0; ks < C::KS; ++ks) {
                    const uint32_t a[4] = {kg[8 * ks + t], kg8[8 * ks + t], kg[8 * ks + 4 + t], kg8[8 * ks + 4 + t]};
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) mma_bf16(s[nt], a, qb[ks][nt][0], qb[ks][nt][1]);
                }
            }
        }

        // ---- online softmax over the TPI tiles; P operand (B of O^T += V^T . P) by shuffles
        uint32_t pb[C::TPI][NT][2];
        bool rescale = false;
        float alpha[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            // x: S in the scaled domain (score * log2(e) / sqrt(D) = x * sl), token tb + g (and
            // + 8), head 4nt + t.
            float x[C::TPI][2];
            float mx = neg_inf();
#pragma unroll
            for (int e = 0; e < C::TPI; ++e) {
                x[e][0] = sa_[e][nt][0] + sa_[e][nt][1];
                x[e][1] = sa_[e][nt][2] + sa_[e][nt][3];
                if (!full) {
                    const int tb = tb0 + 16 * e;
                    if (tb + g >= t1) x[e][0] = neg_inf();
                    if (tb + g + 8 >= t1) x[e][1] = neg_inf();
                }
                mx = fmaxf(mx, fmaxf(x[e][0], x[e][1]));
            }
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 16));
            // sl > 0, so the max commutes with the scale; finite: a stage has >= 1 token.
            const float mn = fmaxf(m[nt], mx * sl);
            alpha[nt] = ex2_ftz(m[nt] - mn);
            rescale |= alpha[nt] != 1.f;
            const float mb = mn - pbias;  // P carries 2^pbias
            float lsum = 0.f;
            const int src = 8 * t + (g >> 1);
            const uint32_t sel = (g & 1) ? 0x7632u : 0x5410u;
#pragma unroll
            for (int e = 0; e < C::TPI; ++e) {
                const float p0 = ex2_ftz(fmaf(x[e][0], sl, -mb)), p1 = ex2_ftz(fmaf(x[e][1], sl, -mb));
                lsum += p0 + p1;
                const uint32_t k0 = split_part(p0, false) | (split_part(p0, true) << 16);
                const uint32_t k1 = split_part(p1, false) | (split_part(p1, true) << 16);
                // B fragment of thread (g, t): tokens 2t, 2t+1 (and +8) of column g.
                const uint32_t x0a = __shfl_sync(FULL, k0, src), x0b = __shfl_sync(FULL, k0, src + 4);
                const uint32_t x1a = __shfl_sync(FULL, k1, src), x1b = __shfl_sync(FULL, k1, src + 4);
                pb[e][nt][0] = __byte_perm(x0a, x0b, sel);
                pb[e][nt][1] = __byte_perm(x1a, x1b, sel);
            }
            l[nt] = l[nt] * alpha[nt] + lsum;
            m[nt] = mn;
        }
        if (__any_sync(FULL, rescale)) {
#pragma unroll
            for (int i = 0; i < C::MT; ++i)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int r = 0; r < 4; ++r) o[i][nt][r] *= alpha[nt];
        }

        // ---- O^T += V^T . P (rows: d; A pairs = two tokens of one d)
#pragma unroll
        for (int e = 0; e < C::TPI; ++e) {
            const uint8_t* ra = ba + 16 * e * RS;
            const uint8_t* rb = bb + 16 * e * RS;
            const uint8_t* rc = ba + (16 * e + 8) * RS;
            const uint8_t* rd = bb + (16 * e + 8) * RS;
            if constexpr (FP4) {
                // Group j: thread g reads the codes of d = 32j + 4g .. +3 (16 bits) of its four
                // tokens; m-tiles 2j, 2j + 1 (see vd). The V scale of (token, group) is
                // folded into P (exact: a power of 2 times a bf16), per token pair.
                constexpr int G = D / 32;
                uint32_t sa[(G + 3) / 4], sb[(G + 3) / 4], sc[(G + 3) / 4], sd[(G + 3) / 4];
                load_scale_words<G>(ra + kVS<D>, sa);
                load_scale_words<G>(rb + kVS<D>, sb);
                load_scale_words<G>(rc + kVS<D>, sc);
                load_scale_words<G>(rd + kVS<D>, sd);
#pragma unroll
                for (int j = 0; j < G; ++j) {
                    const int wo = kVC<D> + 16 * j + 2 * g;
                    const uint32_t ha = *reinterpret_cast<const uint16_t*>(ra + wo);
                    const uint32_t hb = *reinterpret_cast<const uint16_t*>(rb + wo);
                    const uint32_t hc = *reinterpret_cast<const uint16_t*>(rc + wo);
                    const uint32_t hd = *reinterpret_cast<const uint16_t*>(rd + wo);
                    uint32_t ab[4], cd[4];  // [r] = (token a/c, token b/d) at d = 32j + 4g + r
                    e2m1_raw_pairs<true>(pack_u16(ha, hb), ab);
                    e2m1_raw_pairs<true>(pack_u16(hc, hd), cd);
                    const uint32_t fab = scale_pair_bf16<G>(sa, sb, j), fcd = scale_pair_bf16<G>(sc, sd, j);
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        const uint32_t b0 = bf16x2_mul(pb[e][nt][0], fab), b1 = bf16x2_mul(pb[e][nt][1], fcd);
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const uint32_t a[4] = {ab[2 * h], ab[2 * h + 1], cd[2 * h], cd[2 * h + 1]};
                            mma_bf16(o[2 * j + h][nt], a, b0, b1);
                        }
                    }
                }
            } else {
                const uint32_t* va = reinterpret_cast<const uint32_t*>(ra + 2 * D);
                const uint32_t* vbp = reinterpret_cast<const uint32_t*>(rb + 2 * D);
                const uint32_t* vc = reinterpret_cast<const uint32_t*>(rc + 2 * D);
                const uint32_t* vdp = reinterpret_cast<const uint32_t*>(rd + 2 * D);
#pragma unroll
                for (int i = 0; i < C::MT; ++i) {
                    const uint32_t wa = va[g + 8 * i], wb = vbp[g + 8 * i], wc = vc[g + 8 * i], wd = vdp[g + 8 * i];
                    const uint32_t a[4] = {__byte_perm(wa, wb, 0x5410), __byte_perm(wa, wb, 0x7632),
                                           __byte_perm(wc, wd, 0x5410), __byte_perm(wc, wd, 0x7632)};
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) mma_bf16(o[i][nt], a, pb[e][nt][0], pb[e][nt][1]);
                }
            }
        }
        __syncwarp();  // the buffer is refilled next iteration
    }
    if constexpr (FP4) {
        // Fused: the new token's slot, by the last warp (the fewest tiles) of split 0's first
        // head chunk per (sequence, KV head), after its tiles: off the CTA's critical path
        // (before its tiles, the query's preparation would wait for it). No CTA of this step
        // reads the slot. Its inputs are read again here rather than kept across the loop.
        if (fuse && split == 0 && hc == 0 && warp == C::NW - 1 && len_old < p.capacity) {
            const size_t pos = size_t(min(p.positions[b], uint32_t(p.max_pos - 1)));
            uint8_t* slot = const_cast<uint8_t*>(kb) + (row0 + size_t(len_old) * p.kv_heads) * C::SLOT;
            store_rope_slot<D>(qkv + size_t(p.q_heads + kvh) * D, qkv + size_t(p.q_heads + p.kv_heads + kvh) * D,
                               static_cast<const __nv_bfloat16*>(p.cos) + pos * HALF,
                               static_cast<const __nv_bfloat16*>(p.sin) + pos * HALF, slot, p.store_c, lane);
        }
    }
    cp_async_wait_group<0>();
    __syncthreads();  // every warp is done with the stage buffers (reused below)

    // ---- merge the warps
    float* red_o = reinterpret_cast<float*>(smem);
    float* red_m = reinterpret_cast<float*>(smem + C::RED_OFF);
    float* red_l = red_m + C::NW * C::HC;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        float lt = l[nt] * (FP4 ? 0x1p-64f : 1.f);  // drop P's 2^pbias (exact)
        lt += __shfl_xor_sync(FULL, lt, 4);
        lt += __shfl_xor_sync(FULL, lt, 8);
        lt += __shfl_xor_sync(FULL, lt, 16);
        const int j = 4 * nt + t;
        if (g == 0) {
            red_m[warp * C::HC + j] = m[nt];
            red_l[warp * C::HC + j] = lt;
        }
        float* orow = red_o + (warp * C::HC + j) * D;
#pragma unroll
        for (int i = 0; i < C::MT; ++i) {
            const int d = vd<FP4>(i, g);
            *reinterpret_cast<float2*>(orow + d) = make_float2(o[i][nt][0] + o[i][nt][1], o[i][nt][2] + o[i][nt][3]);
        }
    }
    __syncthreads();
    const float unbias = FP4 ? 0x1p62f : 1.f;
    for (int idx = threadIdx.x; idx < C::HC * D; idx += C::THREADS) {
        const int j = idx / D, d = idx - j * D;
        if (head0 + j >= p.group) continue;
        float mm = neg_inf();
#pragma unroll
        for (int w = 0; w < C::NW; ++w) mm = fmaxf(mm, red_m[w * C::HC + j]);
        float ll = 0.f, acc = 0.f;
        if (mm != neg_inf()) {
#pragma unroll
            for (int w = 0; w < C::NW; ++w) {
                const float mw = red_m[w * C::HC + j];
                const float f = mw == neg_inf() ? 0.f : exp2f(mw - mm);
                ll += f * red_l[w * C::HC + j];
                acc += f * red_o[(w * C::HC + j) * D + d];
            }
        }
        acc *= unbias;
        const size_t qh = size_t(b) * p.q_heads + size_t(kvh) * p.group + head0 + j;
        if (p.part_splits == 1) {
            static_cast<__nv_bfloat16*>(p.out)[qh * D + d] = __float2bfloat16_rn(ll > 0.f ? acc / ll : 0.f);
        } else {
            const size_t ps = qh * p.part_splits + p.split_base + split;
            p.part_o[ps * D + d] = acc;
            if (d == 0) {
                p.part_ml[2 * ps] = mm;
                p.part_ml[2 * ps + 1] = ll;
            }
        }
    }
    if (p.part_splits > 1 && p.counters != nullptr) {
        // The last CTA of this (sequence, head group) to finish, over every launch writing
        // these partials, merges all of them.
        __shared__ bool last;
        __threadfence();  // this CTA's partials are visible before its count is
        __syncthreads();
        if (threadIdx.x == 0) {
            uint32_t* ctr = p.counters + size_t(b) * gridDim.y + blockIdx.y;
            last = atomicAdd(ctr, 1u) == uint32_t(p.part_splits - 1);
            if (last) *ctr = 0u;  // every split has counted: ready for the next launch
        }
        __syncthreads();
        if (!last) return;
        __threadfence();
        merge_splits<D, C::HC, C::THREADS>(p, size_t(b) * p.q_heads + size_t(kvh) * p.group + head0,
                                           min(C::HC, p.group - head0), reinterpret_cast<float*>(smem));
        if (fuse && threadIdx.x == 0) {
            // The fused step's lengths: every CTA of this sequence's groups, in every launch,
            // read them before it counted, so the last group to merge advances them (its
            // counter sits after the groups': counters [batch][gridDim.y], then [batch]).
            uint32_t* seq = p.counters + size_t(gridDim.z) * gridDim.y + b;
            if (atomicAdd(seq, 1u) == gridDim.y - 1) {
                *seq = 0u;
                const_cast<uint32_t*>(p.lens)[b] = uint32_t(len_old + 1);
            }
        }
    }
}


}  // namespace

#define CFP4_KV_ATTN(FP4, NAME, D, NT)                                                                  \
    extern "C" __global__ void __launch_bounds__(Cfg<FP4, D, NT>::THREADS, Cfg<FP4, D, NT>::MINB)           \
        NAME(const __grid_constant__ KvAttnParams p) {                                                  \
        attn_body<FP4, D, NT>(p);                                                                       \
        if (p.late_wait) griddep_wait();                                                                \
    }

// Every attention kernel of src/variants.rs (generated by build.rs), and
// cfp4_kv_attn_configs, which hands each one's Cfg (warps, shared memory) to the host.
#include "kv_attention_instances.inc"

// Largest split count the combine kernel takes (host clamps to it).
#define CFP4_KV_MAX_SPLITS 1024

extern "C" __global__ void __launch_bounds__(128) cfp4_kv_combine(const __grid_constant__ KvCombineParams p) {
    constexpr int MU = 8;  // splits whose float4 partials a thread has in flight at once
    __shared__ float ws[CFP4_KV_MAX_SPLITS];
    __shared__ float lsum;
    __shared__ float4 part[128];
    const int qh = blockIdx.x, b = blockIdx.y, S = p.splits;
    const size_t base = (size_t(b) * p.q_heads + qh) * S;
    const int Q = p.head_dim / 4;
    if (S > CFP4_KV_MAX_SPLITS || p.head_dim % 4 != 0 || Q > int(blockDim.x) || blockDim.x > 128) __trap();
    griddep_wait();  // the partials come from the attention kernel
    // The fused rope + append's attention read the lengths before its token: advance them,
    // now that every CTA of it has finished.
    if (p.lens != nullptr && qh == 0 && threadIdx.x == 0) p.lens[b] += 1u;
    // Thread (q, j) owns d = 4q .. 4q + 3 and splits j, j + J, ... (J = blockDim / Q groups;
    // threads past J * Q, e.g. 120..127 at head_dim 80, idle). Its first MU loads go out now,
    // before the weights are known, so their L2 round trip overlaps warp 0's (m, l) reads.
    const int J = int(blockDim.x) / Q, q = threadIdx.x % Q, j0 = threadIdx.x / Q;
    const bool active = j0 < J;
    const float4* po = reinterpret_cast<const float4*>(p.part_o) + base * Q + q;  // split s at po[s * Q]
    float4 v[MU];
#pragma unroll
    for (int u = 0; u < MU; ++u) {
        const int s = j0 + u * J;
        v[u] = active && s < S ? __ldcg(po + size_t(s) * Q) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const float ll = split_weights(reinterpret_cast<const float2*>(p.part_ml) + base, S, lane, ws);
        if (lane == 0) lsum = ll;
    }
    __syncthreads();
    if (active) {
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s0 = 0; s0 < S; s0 += MU * J) {
            if (s0 > 0) {
#pragma unroll
                for (int u = 0; u < MU; ++u) {
                    const int s = j0 + s0 + u * J;
                    v[u] = s < S ? __ldcg(po + size_t(s) * Q) : make_float4(0.f, 0.f, 0.f, 0.f);
                }
            }
#pragma unroll
            for (int u = 0; u < MU; ++u) {
                const int s = j0 + s0 + u * J;
                if (s < S) axpy4(a, ws[s], v[u]);
            }
        }
        part[threadIdx.x] = a;
    }
    __syncthreads();
    if (int(threadIdx.x) < Q) {
        float4 t = part[threadIdx.x];
        for (int j = 1; j < J; ++j) {
            const float4 x = part[j * Q + threadIdx.x];
            t.x += x.x;
            t.y += x.y;
            t.z += x.z;
            t.w += x.w;
        }
        store_normalized4(static_cast<__nv_bfloat16*>(p.out) + (size_t(b) * p.q_heads + qh) * p.head_dim + 4 * threadIdx.x,
                          t, lsum);
    }
}
