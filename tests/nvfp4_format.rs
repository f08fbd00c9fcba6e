//! The NVFP4 codecs against independent references (the quantizer, swizzle and row
//! dequantization: `nvfp4_quantizer.rs`).
//!
//! * E4M3: the `float8` crate (a port of CUDA's `cuda_fp8.hpp` conversions) and a
//!   brute-force nearest-value search written here.
//! * E2M1: a brute-force nearest-level search written here.
//! * Quantizer: ModelOpt's rules (see `tests/data/modelopt_tiny/README.md`), re-derived
//!   from the stored codes and scales with the decoders of this file.
//! * Swizzle: the `reshape(Mp/128, 4, 32, Sp/4, 4).permute(0, 3, 2, 1, 4)` of
//!   FORMATS.md done as explicit index loops.

use candle_fp4::nvfp4::{
    e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, E2M1_VALUES, E4M3_MAX,
};
use float8::F8E4M3;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod nvfp4_common;
use nvfp4_common::*;

// ---------------------------------------------------------------------------------
// E4M3
// ---------------------------------------------------------------------------------

#[test]
fn e4m3_decode_all_256_codes_match_float8() {
    let table = e4m3_ref_table();
    for b in 0u8..=255 {
        let ours = e4m3_decode(b);
        let theirs = f8_ref(b);
        if b & 0x7F == 0x7F {
            assert!(
                ours.is_nan() && theirs.is_nan(),
                "code {b:#04x} must be NaN"
            );
            continue;
        }
        assert_eq!(
            ours.to_bits(),
            theirs.to_bits(),
            "code {b:#04x}: ours {ours}, float8 {theirs}"
        );
        let mag = table[(b & 0x7F) as usize];
        let expect = if b & 0x80 != 0 { -mag } else { mag };
        assert_eq!(
            ours as f64, expect,
            "code {b:#04x} vs the format definition"
        );
        // Every code is its own encoding (including -0 = 0x80), in both codecs.
        assert_eq!(e4m3_encode(ours), b, "encode(decode({b:#04x}))");
        assert_eq!(
            F8E4M3::from_f32(ours).to_bits(),
            b,
            "float8 round trip {b:#04x}"
        );
    }
    assert_eq!(e4m3_decode(0x01), 2f32.powi(-9));
    assert_eq!(e4m3_decode(0x7E), E4M3_MAX);
    assert_eq!(e4m3_decode(0x38), 1.0);
}

/// A random f32 whose magnitude is log-uniform over [2^-14, 2^11): below half the
/// smallest subnormal (2^-10, rounds to 0), subnormals, normals, and beyond 448; plus
/// random sign and all 23 fraction bits random.
fn random_f32_e4m3_range(rng: &mut StdRng) -> f32 {
    let e: i32 = rng.random_range(-14..11);
    let frac: u32 = rng.random_range(0..(1u32 << 23));
    let sign: u32 = rng.random_range(0..2);
    f32::from_bits((sign << 31) | (((e + 127) as u32) << 23) | frac)
}

#[test]
fn e4m3_encode_matches_float8_and_brute_force_on_1e6_random_values() {
    let table = e4m3_ref_table();
    let mut rng = StdRng::seed_from_u64(0xE4_03);
    let mut by_class = [0usize; 4]; // zero-rounded, subnormal, normal, saturated
    for i in 0..1_000_000usize {
        let x = if i.is_multiple_of(50) {
            // Some f32 subnormals and values near the f32 extremes too.
            let bits: u32 = rng.random_range(0..0x0080_0000);
            let huge = f32::from_bits(0x7F00_0000 | bits);
            let tiny = f32::from_bits(bits);
            if i.is_multiple_of(100) {
                huge
            } else {
                -tiny
            }
        } else {
            random_f32_e4m3_range(&mut rng)
        };
        let ours = e4m3_encode(x);
        let theirs = F8E4M3::from_f32(x).to_bits();
        let brute = e4m3_ref_encode(&table, x);
        assert_eq!(ours, brute, "x = {x:e} ({:#010x})", x.to_bits());
        assert_eq!(
            ours, theirs,
            "x = {x:e}: ours {ours:#04x}, float8 {theirs:#04x}"
        );
        let mag = ours & 0x7F;
        by_class[match mag {
            0 => 0,
            1..=7 => 1,
            0x7E if x.abs() > 448.0 => 3,
            _ => 2,
        }] += 1;
    }
    // The sample really covers every regime.
    assert!(by_class.iter().all(|&c| c > 10_000), "{by_class:?}");
}

#[test]
fn e4m3_exact_midpoints_round_to_even() {
    let table = e4m3_ref_table();
    for c in 0..0x7Eusize {
        let (lo, hi) = (table[c] as f32, table[c + 1] as f32);
        // Two adjacent E4M3 values have at most 5 significant bits between them: the
        // midpoint is exact in f32.
        let mid = (lo + hi) / 2.0;
        assert_eq!(mid as f64, (table[c] + table[c + 1]) / 2.0);
        let even = if c.is_multiple_of(2) { c } else { c + 1 } as u8;
        for (x, sign) in [(mid, 0u8), (-mid, 0x80)] {
            assert_eq!(
                e4m3_encode(x),
                sign | even,
                "midpoint {x:e} of codes {c:#04x}/{:#04x}",
                c + 1
            );
            assert_eq!(
                F8E4M3::from_f32(x).to_bits(),
                sign | even,
                "float8 at {x:e}"
            );
        }
        // One f32 ulp either side decides.
        let below = f32::from_bits(mid.to_bits() - 1);
        let above = f32::from_bits(mid.to_bits() + 1);
        assert_eq!(e4m3_encode(below), c as u8, "just below {mid:e}");
        assert_eq!(e4m3_encode(above), c as u8 + 1, "just above {mid:e}");
    }
    // The subnormal/normal seam: 7.5·2^-9 is the midpoint of 0x07 and 0x08 (= 2^-6).
    assert_eq!(e4m3_encode(7.5 * 2f32.powi(-9)), 0x08);
    // Half the smallest subnormal goes to (signed) zero, anything above it to 0x01.
    assert_eq!(e4m3_encode(2f32.powi(-10)), 0x00);
    assert_eq!(e4m3_encode(-(2f32.powi(-10))), 0x80);
    assert_eq!(
        e4m3_encode(f32::from_bits(2f32.powi(-10).to_bits() + 1)),
        0x01
    );
}

#[test]
fn e4m3_saturation_and_special_values_vs_float8() {
    // Ours saturates every finite magnitude >= 448 to 0x7E (±448), as torch's cast of
    // ModelOpt's clamped scales never sees them anyway.
    for x in [
        448.0f32,
        448.5,
        463.9,
        464.0,
        464.1,
        480.0,
        1000.0,
        1e30,
        f32::MAX,
    ] {
        assert_eq!(e4m3_encode(x), 0x7E, "{x:e}");
        assert_eq!(e4m3_encode(-x), 0xFE, "-{x:e}");
        // float8 (CUDA's __nv_cvt_double_to_fp8 with satfinite) agrees: values in
        // (448, 464] round to 448 (464 is the tie with the would-be 480, even mantissa
        // wins), and everything above 464 saturates.
        assert_eq!(F8E4M3::from_f32(x).to_bits(), 0x7E, "float8 {x:e}");
        assert_eq!(F8E4M3::from_f32(-x).to_bits(), 0xFE, "float8 -{x:e}");
    }
    // Infinities: both saturate to ±448 (float8's "±∞ will result" doc is not what it
    // does with its default SatFinite mode; checked here, not assumed).
    assert_eq!(e4m3_encode(f32::INFINITY), 0x7E);
    assert_eq!(e4m3_encode(f32::NEG_INFINITY), 0xFE);
    assert_eq!(F8E4M3::from_f32(f32::INFINITY).to_bits(), 0x7E);
    assert_eq!(F8E4M3::from_f32(f32::NEG_INFINITY).to_bits(), 0xFE);
    // NaN: ours always gives 0x7F; float8 keeps the sign bit (0xFF for a negative NaN).
    // Both bytes are NaN in E4M3. This is the one documented difference.
    assert_eq!(e4m3_encode(f32::NAN), 0x7F);
    assert_eq!(e4m3_encode(-f32::NAN), 0x7F);
    assert_eq!(F8E4M3::from_f32(f32::NAN).to_bits(), 0x7F);
    assert_eq!(F8E4M3::from_f32(-f32::NAN).to_bits(), 0xFF);
    // Signed zeros.
    assert_eq!(e4m3_encode(0.0), 0x00);
    assert_eq!(e4m3_encode(-0.0), 0x80);
    assert_eq!(F8E4M3::from_f32(-0.0).to_bits(), 0x80);
}

// ---------------------------------------------------------------------------------
// E2M1
// ---------------------------------------------------------------------------------

#[test]
fn e2m1_all_16_codes() {
    for c in 0u8..16 {
        let v = e2m1_decode(c);
        assert_eq!(v as f64, e2m1_ref_decode(c), "code {c:#x}");
        // Bits above the nibble are ignored.
        assert_eq!(e2m1_decode(c | 0xA0).to_bits(), v.to_bits());
        // 0x8 decodes to -0.0 (== 0), and -0.0 is not < 0 so it encodes to 0x0.
        let expect = if c == 8 { 0 } else { c };
        assert_eq!(e2m1_encode(v), expect, "encode(decode({c:#x}))");
    }
    assert_eq!(E2M1_VALUES.map(|v| v as f64), E2M1_REF);
    assert_eq!(e2m1_decode(0x8), 0.0);
}

#[test]
fn e2m1_ties_to_even_at_every_midpoint() {
    // (midpoint, expected magnitude code): the even code of the two neighbours.
    let cases = [
        (0.25f32, 0u8), // 0 | 0.5  -> 0
        (0.75, 2),      // 0.5 | 1  -> 1.0
        (1.25, 2),      // 1 | 1.5  -> 1.0
        (1.75, 4),      // 1.5 | 2  -> 2.0
        (2.5, 4),       // 2 | 3    -> 2.0
        (3.5, 6),       // 3 | 4    -> 4.0
        (5.0, 6),       // 4 | 6    -> 4.0
    ];
    for (mid, code) in cases {
        assert_eq!(e2m1_encode(mid), code, "{mid}");
        assert_eq!(e2m1_ref_encode(mid as f64), code, "reference at {mid}");
        let neg = if code == 0 { 8 } else { code | 8 };
        assert_eq!(e2m1_encode(-mid), neg, "-{mid}");
        let below = f32::from_bits(mid.to_bits() - 1);
        let above = f32::from_bits(mid.to_bits() + 1);
        let lo = E2M1_REF.iter().rposition(|&v| v < mid as f64).unwrap() as u8;
        assert_eq!(e2m1_encode(below), lo, "just below {mid}");
        assert_eq!(e2m1_encode(above), lo + 1, "just above {mid}");
    }
}

#[test]
fn e2m1_saturation_negative_tiny_and_random_values() {
    for x in [6.0f32, 6.5, 7.0, 100.0, 1e30, f32::INFINITY] {
        assert_eq!(e2m1_encode(x), 0x7, "{x}");
        assert_eq!(e2m1_encode(-x), 0xF, "-{x}");
    }
    for x in [-1e-30f32, -1e-7, -0.1, -0.25, -f32::from_bits(1)] {
        assert_eq!(e2m1_encode(x), 0x8, "negative tiny {x:e} -> -0");
    }
    assert_eq!(e2m1_encode(1e-30), 0x0);
    let mut rng = StdRng::seed_from_u64(0xE2_01);
    for _ in 0..200_000 {
        let x: f32 = rng.random_range(-8.0..8.0);
        assert_eq!(e2m1_encode(x), e2m1_ref_encode(x as f64), "x = {x}");
    }
}
