//! Normalized Sylvester Walsh–Hadamard transform, `x ← (H_D / √D) · x`.
//!
//! `H_D[i][j] = (−1)^popcount(i & j)`; `H_D / √D` is orthonormal and symmetric, hence its own
//! inverse. UltraQuant rotates K by it at store time and the query by it at decode time, so
//! `q · k` is unchanged.
//!
//! # f32 evaluation order
//!
//! Fast butterfly, `log2 D` stages with stride 1, 2, 4, …, D/2 (lowest bit first); each stage
//! maps a pair `(a, b) = (x[i], x[i + h])` (`i & h == 0`) to `((a + b) · r, (a − b) · r)` with
//! `r = f32(1/√2)` = 0x3F3504F3, each operation rounded to f32 (no FMA). This is bit for bit
//! the butterfly in vLLM's Triton store kernel (`(±x + partner) · INV_SQRT2` per stage).
//! vLLM's PyTorch reference multiplies by the dense f32 matrix instead, which differs in the
//! last bits. Because `r` is rounded and applied once per stage, applying the transform twice
//! gives the identity only to about `2 log2(D) · 2^-24` relative.

use candle_core::{bail, Result};

/// Apply the normalized Walsh–Hadamard transform `H_D / √D` to `x` in place, `D = x.len()`.
///
/// Errors when the length is zero or not a power of two.
pub fn wht_inplace(x: &mut [f32]) -> Result<()> {
    let d = x.len();
    if !d.is_power_of_two() {
        bail!("ultraquant wht_inplace: length must be a power of two, got {d}")
    }
    let r = std::f32::consts::FRAC_1_SQRT_2;
    let mut h = 1;
    while h < d {
        for block in x.chunks_exact_mut(2 * h) {
            let (lo, hi) = block.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (u, v) = (*a, *b);
                *a = (u + v) * r;
                *b = (u - v) * r;
            }
        }
        h *= 2;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_dense_sylvester_matrix() {
        let d = 16;
        let x: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut y = x.clone();
        wht_inplace(&mut y).unwrap();
        for (i, &yi) in y.iter().enumerate() {
            let dense: f64 = (0..d)
                .map(|j| {
                    let sign = if (i & j).count_ones() % 2 == 0 {
                        1.0
                    } else {
                        -1.0
                    };
                    sign * f64::from(x[j])
                })
                .sum::<f64>()
                / (d as f64).sqrt();
            assert!(
                (f64::from(yi) - dense).abs() < 1e-6,
                "row {i}: {yi} vs {dense}"
            );
        }
        assert!(wht_inplace(&mut [0.0; 3]).is_err());
        assert!(wht_inplace(&mut []).is_err());
    }
}
