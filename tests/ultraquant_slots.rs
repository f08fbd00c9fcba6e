//! UltraQuant format: the Walsh–Hadamard rotation and whole slots (encode / decode, ties,
//! error bounds, argument errors) against the independent references of `ultraquant_common`.

use candle_fp4::ultraquant::{
    decode_group, decode_slot, decode_slot_unrotated, encode_group, encode_row, encode_slot,
    encode_slot_with_c, slot_size, wht_inplace,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod ultraquant_common;
use ultraquant_common::*;

#[test]
fn wht_is_orthonormal_and_self_inverse() {
    let mut rng = StdRng::seed_from_u64(5);
    for d in [32usize, 64, 128, 256] {
        for _ in 0..200 {
            let x = gaussian_vec(&mut rng, d, 1.0);
            let y = gaussian_vec(&mut rng, d, 1.0);
            let (mut hx, mut hy) = (x.clone(), y.clone());
            wht_inplace(&mut hx).unwrap();
            wht_inplace(&mut hy).unwrap();
            let dot = |a: &[f32], b: &[f32]| -> f64 {
                a.iter()
                    .zip(b)
                    .map(|(&p, &q)| f64::from(p) * f64::from(q))
                    .sum()
            };
            let (nx, nhx) = (dot(&x, &x).sqrt(), dot(&hx, &hx).sqrt());
            assert!(
                (nhx / nx - 1.0).abs() < 1e-6,
                "D={d}: norm ratio {}",
                nhx / nx
            );
            let (dxy, dhxy) = (dot(&x, &y), dot(&hx, &hy));
            assert!(
                (dxy - dhxy).abs() < 1e-6 * nx * dot(&y, &y).sqrt(),
                "D={d}: dot"
            );
            let mut back = hx.clone();
            wht_inplace(&mut back).unwrap();
            let err: f64 = x
                .iter()
                .zip(&back)
                .map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2))
                .sum::<f64>()
                .sqrt();
            assert!(err < 1e-6 * nx, "D={d}: H·H·x differs by {err}");
        }
    }
}

#[test]
fn wht_of_unit_vector_is_a_sylvester_row() {
    for d in [32usize, 64, 128, 256] {
        let inv_sqrt_d = 1.0 / (d as f64).sqrt();
        for j in [0, 1, 5, d - 1] {
            let mut e = vec![0f32; d];
            e[j] = 1.0;
            wht_inplace(&mut e).unwrap();
            for (i, &v) in e.iter().enumerate() {
                let sign = if (i & j).count_ones() % 2 == 0 {
                    1.0
                } else {
                    -1.0
                };
                let want = sign * inv_sqrt_d;
                assert!(
                    (f64::from(v) - want).abs() < 1e-6 * inv_sqrt_d,
                    "D={d} e{j}[{i}]"
                );
            }
        }
    }
    assert!(wht_inplace(&mut [0.0; 96]).is_err());
}

/// Per-element error bound, from the E2M1 grid: with `y = x / s`, the gap between levels is
/// 0.5 below 2, 1 in [2, 4], 2 in [4, 6], so nearest rounding is off by at most half a gap:
/// `|x − x̂| ≤ s · {0.25 if |y| ≤ 2; 0.5 if |y| ≤ 4; 1 if |y| ≤ 6}`, and clipped values are off
/// by `(|y| − 6) · s` (≤ (√2/c − 6) · s ≈ 3.07 s). Checked exactly in f64.
#[test]
fn encode_decode_error_bound() {
    let mut rng = StdRng::seed_from_u64(6);
    let mut codes = [0u8; 16];
    let mut out = [0f32; 32];
    let mut worst = 0f64; // worst |x − x̂| / bound
    for _ in 0..20_000 {
        let sigma = 2f32.powf(rng.random_range(-10.0..10.0));
        let mut g = bf16_round(&gaussian_vec(&mut rng, 32, sigma));
        if rng.random::<bool>() {
            // Heavy tail: one outlier.
            let i = rng.random_range(0..32);
            g[i] *= 8.0;
        }
        let byte = encode_group(&g, C, &mut codes).unwrap();
        decode_group(&codes, byte, &mut out).unwrap();
        let s = scale_of(byte);
        for (&x, &xh) in g.iter().zip(&out) {
            let y = f64::from(x).abs() / s;
            let bound = s * if y <= 2.0 {
                0.25
            } else if y <= 4.0 {
                0.5
            } else if y <= 6.0 {
                1.0
            } else {
                y - 6.0
            };
            let err = (f64::from(x) - f64::from(xh)).abs();
            assert!(err <= bound, "x={x} x̂={xh} s={s}: {err} > {bound}");
            assert!(err <= (2f64.sqrt() / f64::from(C) - 6.0) * s * (1.0 + 1e-5));
            if bound > 0.0 {
                worst = worst.max(err / bound);
            }
        }
    }
    assert!(worst > 0.99, "bound is tight: worst ratio {worst}");
}

/// Slot = `[K codes][K scales][V codes][V scales]`, K rotated; checked byte for byte against
/// the slow encoder on bf16 data.
#[test]
fn slot_bytes_match_slow_encoder() {
    let mut rng = StdRng::seed_from_u64(7);
    for d in [32usize, 64, 128, 256] {
        let g = d / 32;
        for _ in 0..300 {
            let k = bf16_round(&gaussian_vec(&mut rng, d, 2.0));
            let v = bf16_round(&gaussian_vec(&mut rng, d, 0.5));
            let mut slot = vec![0u8; slot_size(d, None).unwrap()];
            encode_slot(&k, &v, &mut slot).unwrap();
            let mut k_rot = k.clone();
            wht_inplace(&mut k_rot).unwrap();
            for (half, x) in [(0usize, &k_rot), (1, &v)] {
                let base = half * (d / 2 + g);
                for (gi, grp) in x.chunks(32).enumerate() {
                    let (byte, codes) = slow_encode_group(grp);
                    assert_eq!(
                        slot[base + d / 2 + gi],
                        byte,
                        "D={d} half {half} group {gi}"
                    );
                    assert_eq!(&slot[base + gi * 16..base + gi * 16 + 16], &codes[..]);
                }
            }
        }
    }
}

/// bf16 V values that land exactly on midpoints follow the tie rule through the whole slot.
#[test]
fn slot_ties_with_bf16_values() {
    let d = 64;
    let mut v = vec![0f32; d];
    v[0] = 1.0; // absmax 1 → s = 1/8 in both V groups
    v[32] = -1.0;
    v[1] = 0.25 / 8.0; // +0.25 → 0
    v[2] = -0.25 / 8.0; // −0.25 → −0.5
    v[3] = 5.0 / 8.0; // +5 → 4
    v[4] = -5.0 / 8.0; // −5 → −6
    let k = vec![0f32; d];
    let mut slot = vec![0u8; 68];
    encode_slot(&k, &v, &mut slot).unwrap();
    assert!(
        slot[..34].iter().all(|&b| b == 0),
        "zero K: sentinel scales and zero codes"
    );
    let (k_dec, v_dec) = decode_slot(&slot, d).unwrap();
    assert!(k_dec.iter().all(|&x| x == 0.0));
    assert_eq!(&v_dec[..5], &[0.75, 0.0, -0.0625, 0.5, -0.75]);
    assert_eq!(v_dec[32], -0.75);
    assert_eq!(slot[66..68], [124, 124]); // V scales: 2^-3
    assert_eq!(slot[34], 0x07); // v[0] → +6 (code 7, clipped) low nibble, v[1] → 0 high nibble
    assert_eq!(slot[35], 0x69); // v[2] → −0.5 (code 9) low, v[3] → 4 (code 6) high
    assert_eq!(slot[36] & 0xF, 15); // v[4] → −6
}

/// Relative L2 error of the decoded (un-rotated) K and of V for Gaussian data.
///
/// The WHT is orthonormal, so the K error in the original basis equals the quantization error
/// in the rotated basis (up to f32 rounding, ~1e-7); Gaussian rows stay Gaussian under the
/// rotation, so K and V behave alike. With c = 0.156, a group's values divided by `s` spread
/// over the grid with a standard deviation of roughly 2–4 units, where the gaps are 0.5–2:
/// the mean-square error is about 1.7% of the variance, i.e. a relative L2 error of ≈ 0.13
/// (measured 0.1296–0.1305 for K and V at D = 64, 128, 256; single rows vary, up to ≈ 0.2).
#[test]
fn slot_round_trip_relative_error() {
    let mut rng = StdRng::seed_from_u64(8);
    for d in [64usize, 128, 256] {
        let (mut ek, mut ev, mut nk, mut nv) = (0f64, 0f64, 0f64, 0f64);
        let mut slot = vec![0u8; slot_size(d, None).unwrap()];
        for _ in 0..2000 {
            let sigma = 2f32.powf(rng.random_range(-8.0..8.0));
            let k = bf16_round(&gaussian_vec(&mut rng, d, sigma));
            let v = bf16_round(&gaussian_vec(&mut rng, d, sigma));
            encode_slot(&k, &v, &mut slot).unwrap();
            let (k_dec, v_dec) = decode_slot_unrotated(&slot, d).unwrap();
            let sq = |a: &[f32], b: &[f32]| -> f64 {
                a.iter()
                    .zip(b)
                    .map(|(&p, &q)| (f64::from(p) - f64::from(q)).powi(2))
                    .sum()
            };
            let zeros = vec![0f32; d];
            let (rk, rv) = (sq(&k, &k_dec), sq(&v, &v_dec));
            let (sk, sv) = (sq(&k, &zeros), sq(&v, &zeros));
            assert!(
                (rk / sk).sqrt() < 0.3 && (rv / sv).sqrt() < 0.3,
                "D={d}: one row"
            );
            ek += rk / sk;
            ev += rv / sv;
            nk += 1.0;
            nv += 1.0;
        }
        let (rel_k, rel_v) = ((ek / nk).sqrt(), (ev / nv).sqrt());
        assert!(rel_k > 0.10 && rel_k < 0.15, "D={d}: K relative L2 {rel_k}");
        assert!(rel_v > 0.10 && rel_v < 0.15, "D={d}: V relative L2 {rel_v}");
    }
}

#[test]
fn rotated_decode_preserves_attention_scores() {
    // q·k in the original basis ≈ (Hq)·decode_slot(K) in the rotated basis.
    let mut rng = StdRng::seed_from_u64(9);
    let d = 128;
    let q = gaussian_vec(&mut rng, d, 1.0);
    let k = bf16_round(&gaussian_vec(&mut rng, d, 1.0));
    let v = vec![0f32; d];
    let mut slot = vec![0u8; 136];
    encode_slot(&k, &v, &mut slot).unwrap();
    let (k_rot, _) = decode_slot(&slot, d).unwrap();
    let (k_unrot, _) = decode_slot_unrotated(&slot, d).unwrap();
    let mut q_rot = q.clone();
    wht_inplace(&mut q_rot).unwrap();
    let dot = |a: &[f32], b: &[f32]| -> f64 {
        a.iter()
            .zip(b)
            .map(|(&p, &r)| f64::from(p) * f64::from(r))
            .sum()
    };
    assert!((dot(&q_rot, &k_rot) - dot(&q, &k_unrot)).abs() < 1e-4);
}

#[test]
fn slot_argument_errors() {
    let k = vec![0f32; 128];
    let mut slot = vec![0u8; 136];
    assert!(encode_slot(&k, &k[..64], &mut slot).is_err());
    assert!(encode_slot(&k, &k, &mut slot[..135]).is_err());
    assert!(encode_slot(&k[..96], &k[..96], &mut [0u8; 102]).is_err());
    assert!(encode_slot(&k[..16], &k[..16], &mut [0u8; 17]).is_err());
    for c in [0.0, -0.156, f32::NAN, f32::INFINITY] {
        assert!(encode_slot_with_c(&k, &k, c, &mut slot).is_err());
    }
    assert!(decode_slot(&slot, 64).is_err());
    assert!(decode_slot(&slot[..100], 128).is_err());
    let msg = encode_slot(&k, &k, &mut slot[..10])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("slot buffer is 10 bytes"), "{msg}");
    assert!(encode_row(&k[..48], C, &mut [0u8; 24], &mut [0u8; 1]).is_err());
}
