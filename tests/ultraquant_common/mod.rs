//! Independent (f64, brute-force) references of the UltraQuant format tests
//! (`ultraquant_format.rs`, `ultraquant_slots.rs`).
#![allow(dead_code)]

use candle_fp4::ultraquant::{ue8m0_decode, DEFAULT_CONSTANT_C};
use rand::rngs::StdRng;
use rand::Rng;

pub const C: f32 = DEFAULT_CONSTANT_C;

pub fn gaussian(rng: &mut StdRng) -> f32 {
    // Box–Muller in f64.
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

pub fn gaussian_vec(rng: &mut StdRng, n: usize, sigma: f32) -> Vec<f32> {
    (0..n).map(|_| gaussian(rng) * sigma).collect()
}

/// Round through bf16, as the cache's inputs are bf16.
pub fn bf16_round(x: &[f32]) -> Vec<f32> {
    x.iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect()
}

/// Slow E2M1: brute-force nearest of the 15 levels in f64; an exact tie goes to the lower
/// (more negative) level; NaN → 0; level 0 → code 0.
pub fn slow_e2m1(y: f32) -> u8 {
    if y.is_nan() {
        return 0;
    }
    const LEVELS: [f64; 15] = [
        -6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    ];
    // Clamping keeps the nearest level and avoids inf − inf / absorbed differences.
    let y = f64::from(y).clamp(-6.0, 6.0);
    let mut best = 0;
    for (i, &l) in LEVELS.iter().enumerate() {
        // Strictly closer wins; ties keep the earlier (lower) level.
        if (y - l).abs() < (y - LEVELS[best]).abs() {
            best = i;
        }
    }
    let level = LEVELS[best];
    let mag = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
        .iter()
        .position(|&m| m == level.abs())
        .unwrap() as u8;
    if level < 0.0 {
        mag | 8
    } else {
        mag
    }
}

/// Literal vLLM scale exponent: `floor(log2f(p) + 0.5)` with the platform's f32 `log2`.
pub fn libm_exp(p: f32) -> i32 {
    (p.log2() + 0.5).floor() as i32
}

/// Slow group encoder: scale from f32 `log2` (the literal vLLM formula), codes by brute force.
pub fn slow_encode_group(g: &[f32]) -> (u8, Vec<u8>) {
    let absmax = g.iter().fold(0f32, |m, x| m.max(x.abs()));
    let p = C * absmax;
    if p <= 0.0 || !p.is_finite() || libm_exp(p) < -126 {
        return (0, vec![0; g.len() / 2]);
    }
    let e = libm_exp(p).min(127);
    let s = 2f64.powi(e);
    let codes = g
        .chunks(2)
        .map(|pair| {
            let lo = slow_e2m1((f64::from(pair[0]) / s) as f32);
            let hi = slow_e2m1((f64::from(pair[1]) / s) as f32);
            lo | (hi << 4)
        })
        .collect();
    ((e + 127) as u8, codes)
}

pub fn scale_of(byte: u8) -> f64 {
    f64::from(ue8m0_decode(byte))
}
