//! UltraQuant format: scale bytes and E2M1 rounding (the rotation and whole slots:
//! `ultraquant_slots.rs`).
//!
//! The "slow" references here are written independently of the crate (f64, brute force).

use candle_fp4::ultraquant::{
    decode_e2m1, decode_group, encode_e2m1, encode_group, k_codes_bytes, n_groups,
    round_log2_half_up, scale_for_absmax, slot_size, ue8m0_decode, ue8m0_encode, GROUP_SIZE,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod ultraquant_common;
use ultraquant_common::*;

#[test]
fn slot_sizes() {
    assert_eq!(slot_size(64, None).unwrap(), 68);
    assert_eq!(slot_size(128, None).unwrap(), 136);
    assert_eq!(slot_size(256, None).unwrap(), 272);
    assert_eq!(slot_size(128, Some(16)).unwrap(), 128 + 16);
    assert!(k_codes_bytes(127).is_err());
    assert!(slot_size(100, None).is_err());
    assert!(slot_size(0, None).is_err());
    assert_eq!(n_groups(256, None).unwrap(), 8);
    assert_eq!(GROUP_SIZE, 32);
}

#[test]
fn ue8m0_round_trip_all_bytes() {
    for b in 1..=254u8 {
        let s = ue8m0_decode(b);
        assert_eq!(f64::from(s), 2f64.powi(i32::from(b) - 127), "byte {b}");
        assert_eq!(ue8m0_encode(s), b, "byte {b}");
    }
    assert_eq!(ue8m0_decode(0), 0.0);
    assert!(ue8m0_decode(255).is_nan());
}

#[test]
fn ue8m0_zero_sentinel_and_clamp() {
    let tiny = [
        0.0,
        -0.0,
        -1.0,
        -f32::MIN_POSITIVE,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::from_bits(1),     // smallest subnormal
        2f32.powi(-127),       // exp −127: below the minimum
        2f32.powi(-126) * 0.7, // log2 = −126.51: exp −127
    ];
    for s in tiny {
        assert_eq!(ue8m0_encode(s), 0, "{s:e}");
    }
    assert_eq!(ue8m0_encode(f32::MIN_POSITIVE), 1);
    assert_eq!(ue8m0_encode(2f32.powi(-126) * 0.7072), 1); // just above 2^-126.5
    assert_eq!(ue8m0_encode(2f32.powi(127)), 254);
    assert_eq!(ue8m0_encode(f32::MAX), 254); // exp 128 clamps to 127, never 255
    assert_eq!(ue8m0_encode(1.0), 127);
    assert_eq!(ue8m0_encode(1.41), 127);
    assert_eq!(ue8m0_encode(1.42), 128);
    assert_eq!(ue8m0_encode(0.7), 126); // log2 0.7 = −0.51 → −1
    assert_eq!(ue8m0_encode(0.71), 127); // log2 0.71 = −0.49 → 0
}

#[test]
fn scale_for_absmax_cases() {
    for a in [0.0, -0.0, -1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        assert_eq!(scale_for_absmax(a, C), 0, "{a}");
    }
    assert_eq!(scale_for_absmax(1.0, 0.0), 0);
    assert_eq!(scale_for_absmax(1.0, -C), 0);
    assert_eq!(scale_for_absmax(-1.0, -C), 0);
    // 0.156 → log2 = −2.68 → −3.
    assert_eq!(scale_for_absmax(1.0, C), 124);
    let mut rng = StdRng::seed_from_u64(1);
    for _ in 0..100_000 {
        let a = f32::from_bits(rng.random_range(1..0x7f80_0000u32));
        assert_eq!(scale_for_absmax(a, C), ue8m0_encode(C * a), "{a:e}");
    }
}

/// The exact integer form equals `floor(log2f(p) + 0.5)` near every rounding boundary of every
/// binade (where they could differ) and on random f32 values.
#[test]
fn round_log2_matches_libm_near_boundaries() {
    let mut rng = StdRng::seed_from_u64(2);
    let check = |bits: u32| {
        let p = f32::from_bits(bits);
        assert_eq!(
            round_log2_half_up(p),
            Some(libm_exp(p)),
            "p = {p:e} ({bits:#x})"
        );
    };
    for biased in 0..=254u32 {
        for m in (0x3504F4 - 400..0x3504F4 + 400).chain([0, 1, 0x7f_ffff]) {
            if biased == 0 && m == 0 {
                continue;
            }
            check((biased << 23) | m);
        }
    }
    for _ in 0..1_000_000 {
        check(rng.random_range(1..0x7f80_0000u32));
    }
    for p in [0.0, -0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert_eq!(round_log2_half_up(p), None);
    }
}

/// Every positive finite f32 (about 2.1e9 values), against glibc's `log2f` and against f64
/// `log2` rounded to f32. Slow (about 50 s on 2 cores):
/// `cargo test --test ultraquant_format -- --ignored`.
#[test]
#[ignore]
fn round_log2_matches_libm_exhaustive() {
    use rayon::prelude::*;
    let mismatches: u64 = (0u32..0x7f80)
        .into_par_iter()
        .map(|hi| {
            let mut n = 0;
            for lo in 0..0x1_0000u32 {
                let bits = (hi << 16) | lo;
                if bits == 0 {
                    continue;
                }
                let p = f32::from_bits(bits);
                let libm = libm_exp(p);
                let f64_cr = (((f64::from(p)).log2() as f32) + 0.5).floor() as i32;
                let exact = round_log2_half_up(p);
                if exact != Some(libm) || exact != Some(f64_cr) {
                    n += 1;
                }
            }
            n
        })
        .sum();
    assert_eq!(mismatches, 0);
}

#[test]
fn e2m1_round_trip_all_codes() {
    for code in 0..16u8 {
        let v = decode_e2m1(code);
        let expected = if code == 8 { 0 } else { code }; // −0 encodes as +0
        assert_eq!(encode_e2m1(v), expected, "code {code}");
    }
    assert!(decode_e2m1(8).is_sign_negative() && decode_e2m1(8) == 0.0);
    assert_eq!(decode_e2m1(7), 6.0);
    assert_eq!(decode_e2m1(15), -6.0);
    assert_eq!(decode_e2m1(0x17), 6.0); // high nibble ignored
}

#[test]
fn e2m1_midpoint_ties_go_to_the_lower_level() {
    // Positive ties go toward zero.
    let pos = [
        (0.25, 0.0),
        (0.75, 0.5),
        (1.25, 1.0),
        (1.75, 1.5),
        (2.5, 2.0),
        (3.5, 3.0),
        (5.0, 4.0),
    ];
    for (x, level) in pos {
        assert_eq!(decode_e2m1(encode_e2m1(x)), level, "{x}");
        // Just above the midpoint goes up.
        let up = f32::from_bits(f32::to_bits(x) + 1);
        assert!(decode_e2m1(encode_e2m1(up)) > level, "{up}");
    }
    // Negative ties go to the lower (more negative) level, i.e. away from zero: vLLM's
    // `x > midpoint` count over the sorted midpoints.
    let neg = [
        (-0.25, -0.5),
        (-0.75, -1.0),
        (-1.25, -1.5),
        (-1.75, -2.0),
        (-2.5, -3.0),
        (-3.5, -4.0),
        (-5.0, -6.0),
    ];
    for (x, level) in neg {
        assert_eq!(decode_e2m1(encode_e2m1(x)), level, "{x}");
        // Just above the midpoint (toward zero) goes to the upper level.
        let up = f32::from_bits(f32::to_bits(x) - 1);
        assert!(decode_e2m1(encode_e2m1(up)) > level, "{up}");
    }
}

#[test]
fn e2m1_saturation_zero_and_nan() {
    for x in [6.0, 7.0, 100.0, f32::MAX, f32::INFINITY] {
        assert_eq!(encode_e2m1(x), 7, "{x}");
    }
    for x in [-6.0, -7.0, -100.0, f32::MIN, f32::NEG_INFINITY] {
        assert_eq!(encode_e2m1(x), 15, "{x}");
    }
    for x in [0.0, -0.0, 1e-30, -1e-30, 0.2499, -0.2499, f32::NAN] {
        assert_eq!(encode_e2m1(x), 0, "{x}");
    }
}

#[test]
fn e2m1_matches_slow_reference() {
    let mut rng = StdRng::seed_from_u64(3);
    let mids = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    let mut values: Vec<f32> = Vec::new();
    for m in mids {
        for x in [m, -m] {
            let b = x.to_bits();
            values.extend([x, f32::from_bits(b + 1), f32::from_bits(b - 1)]);
        }
    }
    values.extend((0..500_000).map(|_| rng.random_range(-8.0f32..8.0)));
    values.extend((0..500_000).map(|_| f32::from_bits(rng.random::<u32>())));
    for x in values {
        assert_eq!(encode_e2m1(x), slow_e2m1(x), "x = {x:e}");
    }
}

#[test]
fn zero_groups_are_the_sentinel_and_non_finite_ones_nan() {
    let mut codes = [0xAAu8; 16];
    assert_eq!(encode_group(&[0.0; 32], C, &mut codes).unwrap(), 0);
    assert_eq!(codes, [0; 16]);
    let mut out = [1.0f32; 32];
    decode_group(&codes, 0, &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 0.0));

    let mut g = [1.0f32; 32];
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        // A non-finite value poisons its group (NaN scale), as it would a BF16 cache.
        g[5] = bad;
        codes.fill(0xAA);
        assert_eq!(encode_group(&g, C, &mut codes).unwrap(), 255);
        assert_eq!(codes, [0; 16]);
        let mut out = [1.0f32; 32];
        decode_group(&codes, 255, &mut out).unwrap();
        assert!(out.iter().all(|x| x.is_nan()), "{bad}: {out:?}");
    }
    // A scale below 2^-126 is the sentinel too: the group decodes to zeros.
    let g = [1e-38f32; 32];
    assert_eq!(encode_group(&g, C, &mut codes).unwrap(), 0);
    // Nonzero codes with the sentinel byte still decode to zeros.
    decode_group(&[0x77; 16], 0, &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 0.0));
    assert!(encode_group(&[1.0; 31], C, &mut codes).is_err());
    assert!(encode_group(&[1.0; 32], C, &mut codes[..15]).is_err());
    assert!(decode_group(&codes, 127, &mut out[..31]).is_err());
}

#[test]
fn clipping_top_of_group() {
    // absmax 1 → 0.156 → s = 2^-3, absmax / s = 8 > 6: the top clips to ±6·s = ±0.75.
    let mut g = vec![0.1f32; 32];
    g[3] = 1.0;
    g[9] = -1.0;
    g[10] = -0.9;
    let mut codes = [0u8; 16];
    let byte = encode_group(&g, C, &mut codes).unwrap();
    assert_eq!(byte, 124);
    let mut out = [0f32; 32];
    decode_group(&codes, byte, &mut out).unwrap();
    assert_eq!(out[3], 0.75);
    assert_eq!(out[9], -0.75);
    assert_eq!(out[10], -0.75);
    assert_eq!(out[0], 0.125); // 0.1 / 0.125 = 0.8 → 1
}

#[test]
fn absmax_over_scale_range() {
    // In exact math absmax / s ∈ [1/(c√2), √2/c] = [4.533, 9.066]; f32 rounding of c·absmax
    // and of log2 widens that by at most ~2^-17 relative.
    let (lo, hi) = (
        1.0 / (f64::from(C) * 2f64.sqrt()),
        2f64.sqrt() / f64::from(C),
    );
    let mut rng = StdRng::seed_from_u64(4);
    let (mut seen_lo, mut seen_hi) = (f64::MAX, 0f64);
    let mut codes = [0u8; 16];
    for _ in 0..50_000 {
        let sigma = 2f32.powf(rng.random_range(-30.0..30.0));
        let g = gaussian_vec(&mut rng, 32, sigma);
        let absmax = g.iter().fold(0f32, |m, x| m.max(x.abs()));
        let byte = encode_group(&g, C, &mut codes).unwrap();
        let r = f64::from(absmax) / scale_of(byte);
        assert!(
            r >= lo * (1.0 - 2e-5) && r <= hi * (1.0 + 2e-5),
            "absmax/s = {r}"
        );
        assert!((4.49..=9.13).contains(&r));
        seen_lo = seen_lo.min(r);
        seen_hi = seen_hi.max(r);
    }
    // The range is actually covered (clipping happens, and so does headroom).
    assert!(seen_lo < 4.6 && seen_hi > 9.0, "{seen_lo} .. {seen_hi}");
}
