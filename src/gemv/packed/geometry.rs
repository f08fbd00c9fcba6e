//! The launch geometry rule of the packed GEMV (pure; the CUDA planner calls it once per
//! layer and token tile).

/// Warp counts the planner considers for one CTA (the one list, `variants::PGEMV_WARPS`).
pub use crate::variants::PGEMV_WARPS as PACKED_WARPS;

/// Warps per CTA and K split of the packed GEMV for `groups` work groups of `npairs`
/// 128-wide K steps on `sms` SMs, where `occ[w]` CTAs of `w` warps fit on one SM
/// (entries past the slice count as 0). Pure: the planner calls it once per layer and
/// token tile.
///
/// Estimated time = waves of CTAs × (K steps per warp + 2 steps of fixed cost per CTA) ×
/// (1 + w/80) for the longer reduction of wider CTAs; the smallest wins (ties: fewer
/// warps). This picks the measured-best warp count (or one within 5 % of it) on every
/// Llama-3.1-8B / 70B and SmolLM2 shape of the H200 sweep (docs/benchmarks.md, tenth
/// session): the waves term is what makes a 384-tile layer want 5 warps (3 CTAs per SM
/// cover it in one wave) and a 640-tile one 3. A K split (partial sums through global
/// memory, 2–3 µs of latency) only pays for very few groups with long K.
pub fn packed_geometry(groups: usize, npairs: usize, sms: usize, occ: &[usize]) -> (usize, usize) {
    let occ_of = |w: usize| occ.get(w).copied().unwrap_or(0);
    let cost = |w: usize| -> f64 {
        let slots = sms.saturating_mul(occ_of(w)).max(1);
        let waves = groups.div_ceil(slots);
        (waves * (npairs.div_ceil(w) + 2)) as f64 * (1.0 + w as f64 / 80.0)
    };
    let mut warps = 4;
    let mut best = f64::INFINITY;
    for w in PACKED_WARPS {
        if occ_of(w) == 0 {
            continue;
        }
        let c = cost(w);
        if c < best {
            best = c;
            warps = w;
        }
    }
    (warps, k_split(warps, groups, npairs, sms, occ_of(8)))
}

/// The K split of both geometry rules: 4 or 2 CTAs per group (partial sums through global
/// memory) only for a grid of eight-warp CTAs covering at most half the SMs, where the
/// split grid still fits one wave (`occ8` eight-warp CTAs per SM) and each CTA keeps at
/// least 8 K steps.
fn k_split(warps: usize, groups: usize, steps: usize, sms: usize, occ8: usize) -> usize {
    if warps != 8 || groups.saturating_mul(2) > sms {
        return 1;
    }
    [4, 2]
        .into_iter()
        .find(|&s| {
            groups.saturating_mul(s) <= sms.saturating_mul(occ8.max(1))
                && steps >= s.saturating_mul(8)
        })
        .unwrap_or(1)
}

/// Weight bytes in flight per SM that [`bw_geometry`] asks of a BF16-weight GEMV's grid.
/// By Little's law an SM streams its share of the H200's ~4.2 TB/s (32 GB/s over 132 SMs)
/// with ~1 µs of DRAM latency from ~32 KB in flight. Set so that the rule gives the
/// harness's best configurations on the 8B q|k|v, o and down (thirty-first session, spacer
/// protocol, M = 1). In the decode step (H100, thirty-fourth session) it tied the NVFP4
/// kernel's rule at batch 1 and won at batch 8 (all-BF16 8B: 6.16 → 6.13 ms), so the planner
/// uses it for every BF16 layer; not yet checked against the full sweep
/// (`scripts/proto/fit-bw-rule.py`).
pub const BW_INFLIGHT_PER_SM: usize = 40 * 1024;

/// Warp runs (64-wide K steps per warp) from which [`bw_geometry`]'s caller keeps four
/// steps in flight per warp rather than two: the harness's best on 8B down (a 75-step run)
/// was u4, on q|k|v and o (11–16 steps) u2.
pub const BW_DEEP_RUN: usize = 48;

/// Warps per CTA and K split of the packed GEMV over BF16 weights (`kernels/gemv_packed.cu`,
/// `BW`) for `groups` work groups of `steps` 64-wide K steps, each step `group_step_bytes`
/// of weights (2 KiB for one 16-row tile, 4 KiB for the pair and silu groups), `u` steps in
/// flight per warp, on `sms` SMs where `occ[w]` CTAs of `w` warps fit on one SM.
///
/// The kernel is bound by bytes in flight, not by instructions (~0.015 warp-instructions
/// per byte), so unlike [`packed_geometry`] (whose CTA time shrinks with its warps) its time
/// is the bytes over the bandwidth once enough of them are in flight, plus the CTA's
/// reduction across its warps (longer with more warps) and the grid's tail. The rule: the
/// fewest warps whose grid fits in one wave with [`BW_INFLIGHT_PER_SM`] in flight; where no
/// count reaches it, the one-wave count with the most in flight; where no count fits one
/// wave, two warps (the most CTAs per wave). The K split is [`packed_geometry`]'s: only for
/// a grid of eight-warp CTAs covering at most half the SMs. Pure: the planner calls it once
/// per layer.
pub fn bw_geometry(
    groups: usize,
    steps: usize,
    group_step_bytes: usize,
    u: usize,
    sms: usize,
    occ: &[usize],
) -> (usize, usize) {
    let occ_of = |w: usize| occ.get(w).copied().unwrap_or(0);
    let sms = sms.max(1);
    let inflight = |w: usize| {
        groups
            .saturating_mul(w)
            .saturating_mul(u)
            .saturating_mul(group_step_bytes)
            / sms
    };
    let one_wave: Vec<usize> = PACKED_WARPS
        .filter(|&w| occ_of(w) > 0 && groups <= sms.saturating_mul(occ_of(w)))
        .collect();
    let warps = one_wave
        .iter()
        .copied()
        .find(|&w| inflight(w) >= BW_INFLIGHT_PER_SM)
        .or_else(|| one_wave.iter().copied().max_by_key(|&w| inflight(w)))
        .unwrap_or_else(|| {
            PACKED_WARPS
                .clone()
                .find(|&w| occ_of(w) > 0)
                .unwrap_or(*PACKED_WARPS.start())
        });
    (warps, k_split(warps, groups, steps, sms, occ_of(8)))
}

/// Does a kernel keeping `u` K pairs in flight per warp suit this launch? Only when each
/// warp's run (of `npairs` split over `split` CTAs and `warps` warps) is at least `u`
/// pairs: shorter runs never reach the main loop, and the deeper kernel's longer prologue
/// and epilogue cost time there (SmolLM2's one-pair runs: 1.96 → 2.13 µs on the H200).
/// Pure: the planner tries the depths deepest first and keeps the first that suits (the
/// shallowest always does).
pub fn depth_suits(npairs: usize, warps: usize, split: usize, u: usize) -> bool {
    npairs.div_ceil((warps * split).max(1)) >= u
}

/// Whether the plain one-token-tile GEMV of a layer with `tiles` packed row tiles should
/// run the pair kernel (two row tiles per group, one x fragment for both): only when the
/// grid has at least 3.5 tiles per SM. Measured on the H200 (132 SMs, sixteenth session,
/// M = 1): faster from 512 tiles up (70B o 14.02 → 12.94 µs, 70B down 40.27 → 36.03, 8B
/// lm_head 82.00 → 77.29), slower at 384 and below (8B q|k|v 6.83 → 7.00, 8B down
/// 13.27 → 13.91, 8B o 5.31 → 6.27), where half the groups leave the SMs short of CTAs.
/// Pure: the planner asks it once per layer.
pub fn pair_suits(tiles: usize, sms: usize) -> bool {
    sms > 0 && 2 * tiles >= 7 * sms
}

/// Whether the plain one-tile GEMV launched as `ctas` CTAs on `sms` SMs should run the
/// staged kernel (each CTA copies the x rows of its K slice into shared memory before its
/// main loop): only when the grid is at most two CTAs per SM. There no other CTA's weight
/// stream covers the wait for x, which the staged copy takes off the main loop. Measured
/// on the H200 (132 SMs, sixteenth session, M = 1): faster at 256 CTAs (8B o 5.32 → 5.10 µs,
/// 8B down 13.29 → 11.73), 252 (1000 × 4032, split 4: 4.02 → 3.78) and SmolLM2's 36–60
/// (−6 to −9 %), slower at 384 (8B q|k|v 6.79 → 6.99), where three CTAs per SM already
/// overlap and the copy's barrier only delays the first MMA. Pure: the planner asks it once
/// per layer.
pub fn stage_suits(ctas: usize, sms: usize) -> bool {
    sms > 0 && ctas > 0 && ctas <= 2 * sms
}

/// Most tokens the staged kernels serve. One: on the H200 (seventeenth session, same call)
/// staging won only at M = 1 (8B down 13.29 → 11.56 µs, 8B o 5.30 → 5.21, SmolLM2's
/// q|k|v / o / down −4 to −10 %) and lost at M = 4 and 8 (8B o 5.56 → 7.46 and
/// 5.69 → 9.60 µs, SmolLM2 down 2.79 → 2.97 at M = 8): the copy of M rows before the
/// first MMA grows with M while the weight stream it hides does not.
pub const STAGED_MAX_M: usize = 1;

/// K elements of the longest CTA slice of a staged GEMV (`npairs` 128-wide K steps of a
/// `k`-wide layer over `split` CTAs): what each CTA's shared x rows must hold.
pub fn staged_slice_k(k: usize, npairs: usize, split: usize) -> usize {
    (128 * npairs.div_ceil(split.max(1))).min(k)
}

/// Dynamic shared memory of a staged GEMV of `m` tokens over slices of `slice_k`: `m` rows
/// of `slice_k + 8` BF16 (the 16-byte pad puts the token rows of one load on distinct
/// banks), or `None` when that overflows.
pub fn staged_smem(m: usize, slice_k: usize) -> Option<usize> {
    m.checked_mul(slice_k.checked_add(8)?)?.checked_mul(2)
}

/// The most tokens (≤ [`STAGED_MAX_M`]) whose staged x rows fit in `limit` bytes of
/// dynamic shared memory, 0 when not even one does. Pure: the planner calls it once per
/// layer with what the device leaves each CTA at the grid's occupancy.
pub fn staged_max_m(slice_k: usize, limit: usize) -> usize {
    (1..=STAGED_MAX_M)
        .rev()
        .find(|&m| staged_smem(m, slice_k).is_some_and(|b| b <= limit))
        .unwrap_or(0)
}

/// Whether the RMSNorm in front of a packed layer of `k` input features asks L2 for its
/// first weights on a device of peak DRAM bandwidth `mem_bw` (bytes/s; `None`: unknown,
/// prefetch as before). Measured with the decode step's knob (`CFP4_DECODE_NO_L2_PREFETCH`,
/// same binary, alternating rounds; docs/benchmarks.md, twenty-sixth and thirtieth
/// sessions):
/// - H100 (3.35 TB/s peak): the prefetch wins everywhere: 8B b1 −10 to −31 µs per step,
///   b8 −20 to −27, 70B b1 −124 to −157.
/// - H200 (4.92 TB/s peak): it loses on the 8B (k = 4096): b1 +35 to +37 µs in five rounds,
///   its UltraQuant row +36 to +43, b8 +15 to +20; it still wins on the 70B (k = 8192):
///   −48 to −60 µs. SmolLM2's norms run in its GEMVs' prologue (no norm kernel to ask).
///
/// So on a device with [`PREFETCH_FAST_DRAM`] or more, only layers wider than
/// [`PREFETCH_FAST_DRAM_MIN_K`] are prefetched: there the norm kernel's extra microsecond
/// (4.68 against 3.49 µs alone on the H200) costs more than an 8B layer's weights gain from
/// an L2 head start, which shrinks as DRAM gets faster. Only these two widths were measured
/// on the faster card; the threshold sits between them. Pure: the planner asks once per layer.
pub fn prefetch_suits(mem_bw: Option<u64>, k: usize) -> bool {
    match mem_bw {
        Some(bw) if bw >= PREFETCH_FAST_DRAM => k > PREFETCH_FAST_DRAM_MIN_K,
        _ => true,
    }
}

/// Peak DRAM bandwidth (bytes/s) from which [`prefetch_suits`] keeps the prefetch to wide
/// layers: between the H100's 3.35 and the H200's 4.92 TB/s.
pub const PREFETCH_FAST_DRAM: u64 = 4_000_000_000_000;

/// Widest layer input (`k`) that a fast-DRAM device does not prefetch: the 8B's 4096.
pub const PREFETCH_FAST_DRAM_MIN_K: usize = 4096;

/// Bytes of a device's L2 that the prefetch ahead of one GEMV may fill: two fifths (20 MB of
/// the H100's and H200's 50 MB). In the harness on the H100 (twenty-second session,
/// docs/benchmarks.md; a one-CTA spacer between calls with a 6 µs DRAM-idle window), 20 MB
/// prefetched took 8B down from 14.12 to 11.70 µs and 70B o from 16.51 to 12.91, while the
/// whole weight (33 and 67 MB) gained nothing on down and less on 70B o (13.72): lines
/// fetched past about half the L2 are evicted before their loads.
pub fn l2_prefetch_budget(l2_bytes: usize) -> usize {
    l2_bytes / 5 * 2
}

/// Packed bytes of one row tile (codes and scales of its `npairs` K pairs): a layout's
/// `tile_code_bytes() + tile_scale_bytes()`, for the pure rules.
pub fn packed_tile_bytes(npairs: usize) -> usize {
    npairs.saturating_mul(1024 + 128)
}

/// The packed row tiles worth asking L2 for ahead of a GEMV, as `(first tile, tiles)` runs:
/// the tiles its CTAs start on. Plain: from tile 0. `silu_mul`: the gate tiles from 0 and
/// the up tiles from `half_pad / 16`, half the budget each (each CTA reads one of each).
/// Whole tiles within `budget` bytes ([`packed_tile_bytes`]); no run of zero tiles.
/// Pure: the planner calls it once per layer.
pub fn prefetch_tiles(
    tiles: usize,
    half_pad: usize,
    npairs: usize,
    silu_mul: bool,
    budget: usize,
) -> Vec<(usize, usize)> {
    let per_tile = packed_tile_bytes(npairs).max(1);
    let runs: Vec<(usize, usize)> = if silu_mul {
        let half = half_pad / 16;
        if half == 0 || 2 * half > tiles {
            return Vec::new();
        }
        let take = (budget / 2 / per_tile).min(half);
        vec![(0, take), (half, take)]
    } else {
        vec![(0, (budget / per_tile).min(tiles))]
    };
    runs.into_iter().filter(|r| r.1 > 0).collect()
}

/// Most tokens the GEMVs with the RMSNorm prologue serve (one token tile).
pub const NORM_MAX_M: usize = 8;

// The largest shared-memory need of the norm prologue stays under the 48 KiB default.
const _: () = assert!(NORM_MAX_M * (NORM_K_MAX + 8) * 2 <= 48 * 1024);

/// Longest K the GEMVs with the RMSNorm prologue serve. Every CTA repeats the norm over
/// all of K before its main loop, which pays only where K is small: on the H200
/// (docs/benchmarks.md, thirteenth session) it took SmolLM2 (K = 576) from 1358 to 1402
/// tok/s, but the Llama-3.1-8B step (K = 4096) from 434.9 to 388.1 tok/s at batch 1 and
/// from 2983 to 1694 at batch 8, so the 8B keeps the norm kernel.
pub const NORM_K_MAX: usize = 1024;

/// Whether a projection of `m` tokens with in-features `k` can take the RMSNorm in front
/// of it into its prologue (the packed GEMV's norm variants): `1 ≤ m ≤ 8`, `k ≤ 1024`.
/// Pure: the layer asks it per call, the planner once per layer.
pub fn use_norm_prologue(m: usize, k: usize) -> bool {
    (1..=NORM_MAX_M).contains(&m) && k > 0 && k <= NORM_K_MAX
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CTAs per SM of the H200 nt = 1 kernel by warps (ptxas: 106 registers, 128 cap).
    const H200: [usize; 9] = [0, 16, 8, 5, 4, 3, 2, 2, 2];

    #[test]
    fn geometry_rule_on_the_measured_shapes() {
        let g = |groups, pairs| packed_geometry(groups, pairs, 132, &H200);
        // (groups, K steps) -> measured best of 2..=8 warps, m = 1 (tenth session sweep)
        assert_eq!(g(384, 32), (5, 1)); // 8B qkv: w5 7.15 µs, w4 7.79
        assert_eq!(g(256, 32), (8, 1)); // 8B o: w8 5.43
        assert_eq!(g(896, 32), (2, 1)); // 8B gate|up: w2 23.03, w4 23.81
        assert_eq!(g(256, 112), (8, 1)); // 8B down: w8 13.71
        assert_eq!(g(8016, 32), (2, 1)); // 8B lm_head: w2 93.6, w4 99.5
        assert_eq!(g(640, 64), (3, 1)); // 70B qkv: w3 18.47, w8 22.45
        assert_eq!(g(512, 64), (4, 1)); // 70B o: w4 14.74
        assert_eq!(g(512, 224), (4, 1)); // 70B down: w4 45.86
        assert_eq!(g(60, 5), (5, 1)); // SmolLM2 qkv: w5 1.94
        assert_eq!(g(36, 12), (6, 1)); // SmolLM2 down: w6 2.45
        assert_eq!(g(3072, 5), (2, 1)); // SmolLM2 lm_head: w2 10.20, w4 12.83
        assert_eq!(g(64, 32), (8, 4)); // few groups, long K: the split
                                       // 70B gate|up: w2 79.9 µs, best w3 78.9 (within 2 %)
        assert_eq!(g(1792, 64).0, 2);
    }

    #[test]
    fn prefetch_by_bandwidth() {
        let (h100, h200) = (Some(3_352_320_000_000), Some(4_916_736_000_000));
        // H100: every layer (8B and 70B widths, SmolLM2's).
        for k in [576, 4096, 8192, 14336] {
            assert!(prefetch_suits(h100, k), "{k}");
            assert!(prefetch_suits(None, k), "{k}");
        }
        // H200: the 70B's q|k|v and gate|up (k = 8192), not the 8B's (4096).
        assert!(!prefetch_suits(h200, 4096));
        assert!(!prefetch_suits(h200, 576));
        assert!(prefetch_suits(h200, 4160));
        assert!(prefetch_suits(h200, 8192));
        // The threshold itself.
        assert!(!prefetch_suits(Some(PREFETCH_FAST_DRAM), 4096));
        assert!(prefetch_suits(Some(PREFETCH_FAST_DRAM - 1), 4096));
    }

    #[test]
    fn prefetch_rule() {
        let mb = 1_000_000;
        // H100 / H200: 50 MiB of L2.
        let budget = l2_prefetch_budget(50 * 1024 * 1024);
        assert_eq!(budget, 20_971_520);
        assert!((20 * mb..21 * mb).contains(&budget));
        assert_eq!(packed_tile_bytes(32), 36864);
        for (n, k) in [(6144, 4096), (4096, 14336), (28672, 4096), (1007, 1024)] {
            let l = super::super::layout::PackedLayout::new(n, k).unwrap();
            let per_tile = l.tile_code_bytes() + l.tile_scale_bytes();
            assert_eq!(packed_tile_bytes(l.npairs), per_tile, "[{n}, {k}]");
            assert_eq!(l.tiles * l.tile_code_bytes(), l.code_bytes());
            assert_eq!(l.tiles * l.tile_scale_bytes(), 4 * l.scale_words());
        }
        // 8B q|k|v (384 tiles, 32 pairs, 14.2 MB): all of it.
        assert_eq!(prefetch_tiles(384, 192, 32, false, budget), vec![(0, 384)]);
        // 8B down (256 tiles of 112 pairs, 33 MB): the first 162 tiles (20.9 MB).
        let down = prefetch_tiles(256, 128, 112, false, budget);
        assert_eq!(down, vec![(0, budget / packed_tile_bytes(112))]);
        assert!(down[0].1 * packed_tile_bytes(112) <= budget);
        // 8B gate|up (1792 tiles, half 896): equal runs at the gate and up tiles.
        let gu = prefetch_tiles(1792, 14336, 32, true, budget);
        let half_take = budget / 2 / packed_tile_bytes(32);
        assert_eq!(gu, vec![(0, half_take), (896, half_take)]);
        assert!(2 * half_take * packed_tile_bytes(32) <= budget);
        // Small layers, tiny budgets, odd N (no halves), degenerate inputs.
        assert_eq!(prefetch_tiles(4, 32, 1, true, budget), vec![(0, 2), (2, 2)]);
        assert!(prefetch_tiles(384, 192, 32, false, 1000).is_empty());
        assert!(prefetch_tiles(63, 0, 8, true, budget).is_empty());
        assert!(prefetch_tiles(0, 0, 8, false, budget).is_empty());
        assert_eq!(prefetch_tiles(5, 0, 0, false, budget), vec![(0, 5)]);
        assert_eq!(l2_prefetch_budget(0), 0);
    }

    #[test]
    fn norm_prologue_rule() {
        assert!(use_norm_prologue(1, 576)); // SmolLM2
        assert!(use_norm_prologue(8, 576)); // SmolLM2, batch 8
        assert!(!use_norm_prologue(9, 576)); // past one token tile
        assert!(!use_norm_prologue(0, 576));
        assert!(!use_norm_prologue(1, 4096)); // 8B: slower than the norm kernel (measured)
        assert!(use_norm_prologue(1, NORM_K_MAX) && !use_norm_prologue(1, NORM_K_MAX + 64));
    }

    #[test]
    fn degenerate_inputs_do_not_divide_by_zero() {
        assert_eq!(packed_geometry(1, 1, 0, &[]), (4, 1));
        assert_eq!(packed_geometry(0, 0, 132, &H200).1, 1);
    }

    #[test]
    fn pair_kernel_only_for_many_tiles_per_sm() {
        // Row tiles of the H200 measurements (132 SMs).
        for tiles in [512, 640, 3072, 8016] {
            assert!(pair_suits(tiles, 132), "{tiles} tiles"); // 70B o / down, q|k|v, lm_heads
        }
        for tiles in [384, 256, 60, 36] {
            assert!(!pair_suits(tiles, 132), "{tiles} tiles"); // 8B q|k|v, o / down, SmolLM2
        }
        assert!(pair_suits(462, 132) && !pair_suits(461, 132)); // the threshold, 3.5 per SM
        assert!(!pair_suits(1000, 0));
    }

    #[test]
    fn staged_kernel_only_for_short_grids() {
        // CTAs of the H200 plans (geometry_rule_on_the_measured_shapes, 132 SMs).
        for ctas in [256, 252, 60, 36, 264] {
            assert!(stage_suits(ctas, 132), "{ctas} CTAs"); // 8B o / down, odd split 4, SmolLM2
        }
        for ctas in [384, 265, 896] {
            assert!(!stage_suits(ctas, 132), "{ctas} CTAs"); // 8B q|k|v (measured slower)
        }
        assert!(!stage_suits(10, 0) && !stage_suits(0, 132));
    }

    #[test]
    fn staged_shared_memory_sizes() {
        assert_eq!(staged_slice_k(4096, 32, 1), 4096);
        assert_eq!(staged_slice_k(4032, 32, 4), 1024); // 8 pairs of the 4 slices
        assert_eq!(staged_slice_k(320, 3, 2), 256); // the longest slice: 2 pairs
        assert_eq!(staged_slice_k(64, 1, 0), 64);
        assert_eq!(staged_smem(1, 4096), Some(8208));
        assert_eq!(staged_smem(8, 14336), Some(8 * 14344 * 2));
        assert_eq!(staged_smem(usize::MAX, 64), None);
        assert_eq!(staged_smem(2, usize::MAX), None);
        // 8B down (K = 14336, split 1): 28.7 KB a token.
        assert_eq!(staged_max_m(14336, 100 * 1024), STAGED_MAX_M);
        assert_eq!(staged_max_m(4096, 227 * 1024), STAGED_MAX_M);
        assert_eq!(staged_max_m(14336, 28_687), 0);
        assert_eq!(staged_max_m(14336, 28_688), 1);
        assert_eq!(staged_max_m(usize::MAX, usize::MAX), 0);
    }

    /// CTAs per SM of the H200 BF16-weight kernels by warps (ptxas: 124-128 registers).
    const H200_BW: [usize; 9] = [0, 16, 8, 5, 4, 3, 2, 2, 2];

    #[test]
    fn bw_rule_on_the_8b_shapes() {
        let g = |groups, steps, bytes, u| bw_geometry(groups, steps, bytes, u, 132, &H200_BW);
        // The spacer protocol's best of 2..=8 warps (thirty-first session, M = 1):
        assert_eq!(g(384, 64, 2048, 2), (4, 1)); // 8B q|k|v: plain u2 w4 14.22 µs
        assert_eq!(g(256, 64, 2048, 2), (6, 1)); // 8B o: plain u2 w6 10.05
        assert_eq!(g(256, 224, 2048, 4), (3, 1)); // 8B down: plain u4 w3 36.63
                                                  // Fewest warps with 40 KiB in flight: the silu groups carry 4 KiB a step.
        assert_eq!(g(896, 64, 4096, 2), (2, 1)); // 8B gate|up
                                                 // No count reaches the target in one wave: the one with the most in flight, and a
                                                 // split for few groups with long K.
        assert_eq!(g(36, 9, 2048, 2), (8, 1)); // SmolLM2 o: 36 groups, 9 steps
        assert_eq!(g(36, 224, 2048, 2), (8, 4));
        // No count fits one wave: two warps, the most CTAs per wave.
        assert_eq!(g(4008, 64, 4096, 2), (2, 1)); // 8B lm_head (pair groups)
    }

    #[test]
    fn bw_rule_degenerate_inputs() {
        assert_eq!(bw_geometry(0, 0, 0, 0, 0, &[]), (2, 1));
        assert_eq!(bw_geometry(10, 64, 2048, 2, 132, &[0; 9]), (2, 1));
        assert_eq!(
            bw_geometry(usize::MAX, usize::MAX, usize::MAX, 4, 132, &H200_BW),
            (2, 1)
        );
        // SM and occupancy counts that overflow a product: saturated, no panic.
        let huge = [usize::MAX; 9];
        // (With that many SMs every count fits one wave and none reaches the in-flight
        // target: eight warps, split 4, as for any grid covering under half the SMs.)
        assert_eq!(bw_geometry(64, 1 << 20, 2048, 2, usize::MAX, &huge), (8, 4));
        assert_eq!(packed_geometry(64, 1 << 20, usize::MAX, &huge), (8, 4));
        assert_eq!(
            packed_geometry(usize::MAX, usize::MAX, usize::MAX, &huge),
            (8, 4)
        );
    }

    #[test]
    fn deep_kernel_only_for_long_warp_runs() {
        // (npairs, warps, split) of the H200 plans (twelfth session), u = 5.
        assert!(depth_suits(32, 5, 1, 5)); // 8B q|k|v: 7 pairs per warp (deep 6.76 vs 7.18 µs)
        assert!(!depth_suits(32, 8, 1, 5)); // 8B o: 4 per warp (5.41 vs 5.35: no gain)
        assert!(depth_suits(112, 8, 1, 5)); // 8B down: 14
        assert!(depth_suits(32, 2, 1, 5)); // 8B lm_head: 16
        assert!(!depth_suits(5, 5, 1, 5)); // SmolLM2 q|k|v: 1 (deep 2.13 vs 1.96 µs)
        assert!(!depth_suits(32, 8, 4, 5)); // a split of 4: 1 per warp
        assert!(depth_suits(1, 8, 1, 1)); // the shallowest always suits a non-empty run
        assert!(!depth_suits(0, 0, 0, 1));
    }
}
