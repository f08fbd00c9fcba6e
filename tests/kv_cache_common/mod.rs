//! Helpers shared by the kv_cache tests: seeded data, an f64 attention reference written
//! independently of the crate, and error metrics.
#![allow(dead_code)]

use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

/// Standard normal sample (Box–Muller in f64).
pub fn gaussian(rng: &mut StdRng) -> f32 {
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

/// `n` BF16 values `σ · N(0, 1)`.
pub fn gaussian_bf16(rng: &mut StdRng, n: usize, sigma: f32) -> Vec<bf16> {
    (0..n)
        .map(|_| bf16::from_f32(gaussian(rng) * sigma))
        .collect()
}

pub fn to_f32(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// Exact-as-possible attention in f64 for one query head: `q` `[d]`, `k`, `v` rows
/// `[n][d]`; returns `[d]`.
pub fn attend_f64(q: &[f32], k: &[f32], v: &[f32], d: usize) -> Vec<f64> {
    let scale = 1.0 / (d as f64).sqrt();
    let s: Vec<f64> = k
        .chunks_exact(d)
        .map(|kt| {
            kt.iter()
                .zip(q)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum::<f64>()
                * scale
        })
        .collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let l: f64 = p.iter().sum();
    let mut o = vec![0f64; d];
    for (pt, vt) in p.iter().zip(v.chunks_exact(d)) {
        for (oi, vi) in o.iter_mut().zip(vt) {
            *oi += pt * f64::from(*vi);
        }
    }
    o.iter().map(|x| x / l).collect()
}

/// Normalized Sylvester Walsh–Hadamard transform in f64 (dense, independent of the crate).
pub fn wht_f64(x: &[f32]) -> Vec<f32> {
    let d = x.len();
    let norm = (d as f64).sqrt();
    (0..d)
        .map(|i| {
            let s: f64 = (0..d)
                .map(|j| {
                    if (i & j).count_ones().is_multiple_of(2) {
                        f64::from(x[j])
                    } else {
                        -f64::from(x[j])
                    }
                })
                .sum();
            (s / norm) as f32
        })
        .collect()
}

/// One BF16 ulp at |x|: 2^(floor(log2 |x|) − 7) (2^-133 below the normal range).
pub fn bf16_ulp(x: f64) -> f64 {
    let a = x.abs();
    if a < f64::from(f32::MIN_POSITIVE) {
        return 2f64.powi(-133);
    }
    2f64.powi(a.log2().floor() as i32 - 7)
}

/// Largest |got − want| / (ulp_bf16(want) + abs) over all elements (≤ 1 passes).
pub fn worst_ulp_ratio(got: &[bf16], want: &[f64], abs: f64) -> (f64, usize) {
    let mut worst = (0.0, 0);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let r = (f64::from(g.to_f32()) - w).abs() / (bf16_ulp(*w) + abs);
        if r > worst.0 {
            worst = (r, i);
        }
    }
    worst
}

/// ‖got − want‖₂ / ‖want‖₂ and the cosine similarity.
pub fn rel_l2_and_cos(got: &[f64], want: &[f64]) -> (f64, f64) {
    let (mut e, mut w2, mut g2, mut gw) = (0.0, 0.0, 0.0, 0.0);
    for (g, w) in got.iter().zip(want) {
        e += (g - w) * (g - w);
        w2 += w * w;
        g2 += g * g;
        gw += g * w;
    }
    ((e / w2).sqrt(), gw / (g2.sqrt() * w2.sqrt()))
}

/// Relative RMS error ‖a − b‖ / ‖b‖.
pub fn rel_rms(a: &[f32], b: &[f32]) -> f64 {
    let (mut e, mut n) = (0.0, 0.0);
    for (x, y) in a.iter().zip(b) {
        e += (f64::from(*x) - f64::from(*y)).powi(2);
        n += f64::from(*y).powi(2);
    }
    (e / n).sqrt()
}

pub fn rms(a: &[f32]) -> f64 {
    (a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>() / a.len() as f64).sqrt()
}
