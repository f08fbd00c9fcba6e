//! The launch geometry rule of the packed GEMV (pure; the CUDA planner calls it once per
//! layer and token tile).

/// Warps per CTA and K split of the packed GEMV for `groups` work groups of `npairs`
/// 128-wide K steps on `sms` SMs, where `occ4` / `occ8` CTAs of 4 / 8 warps fit on one
/// SM. Pure: the planner calls it once per layer and token tile.
///
/// Waves of CTAs times the K steps each warp walks, 8-warp CTAs charged 10 % for their
/// longer reduction (ties go to 4 warps); measured on the H200 over the Llama-3.1-8B / 70B
/// and SmolLM2 shapes (docs/benchmarks.md, tenth session). A K split (partial sums
/// through global memory, ~2–3 µs of latency) only pays for very few groups with long K.
pub fn packed_geometry(
    groups: usize,
    npairs: usize,
    sms: usize,
    occ4: usize,
    occ8: usize,
) -> (usize, usize) {
    let cost = |w: usize, occ: usize| -> f64 {
        let waves = groups.div_ceil((sms * occ.max(1)).max(1));
        let per_warp = npairs.div_ceil(w);
        (waves * per_warp) as f64 * if w == 8 { 1.1 } else { 1.0 }
    };
    let warps = if cost(8, occ8) < cost(4, occ4) { 8 } else { 4 };
    let mut split = 1;
    if warps == 8 && 2 * groups <= sms {
        for s in [4, 2] {
            if groups * s <= sms * occ8.max(1) && npairs >= 8 * s {
                split = s;
                break;
            }
        }
    }
    (warps, split)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_rule_on_the_measured_shapes() {
        // (groups, pairs) -> (warps, split) on 132 SMs, 4 / 2 CTAs of 4 / 8 warps.
        let g = |groups, pairs| packed_geometry(groups, pairs, 132, 4, 2);
        assert_eq!(g(384, 32), (4, 1)); // 8B qkv
        assert_eq!(g(256, 32), (8, 1)); // 8B o
        assert_eq!(g(896, 32), (4, 1)); // 8B gate|up
        assert_eq!(g(256, 112), (8, 1)); // 8B down
        assert_eq!(g(8016, 32), (4, 1)); // 8B lm_head
        assert_eq!(g(640, 64), (8, 1)); // 70B qkv
        assert_eq!(g(512, 224), (4, 1)); // 70B down
        assert_eq!(g(36, 5), (8, 1)); // SmolLM2 o
        assert_eq!(g(3072, 5), (4, 1)); // SmolLM2 lm_head
        assert_eq!(g(64, 32), (8, 4)); // few groups, long K
        assert_eq!(g(36, 12), (8, 1));
        // degenerate inputs do not divide by zero
        assert_eq!(packed_geometry(1, 1, 0, 0, 0).1, 1);
    }
}
