//! The NVFP4 format pieces against independent references.
//!
//! * E4M3: the `float8` crate (a port of CUDA's `cuda_fp8.hpp` conversions) and a
//!   brute-force nearest-value search written here.
//! * E2M1: a brute-force nearest-level search written here.
//! * Quantizer: ModelOpt's rules (see `tests/data/modelopt_tiny/README.md`), re-derived
//!   from the stored codes and scales with the decoders of this file.
//! * Swizzle: the `reshape(Mp/128, 4, 32, Sp/4, 4).permute(0, 3, 2, 1, 4)` of
//!   FORMATS.md done as explicit index loops.

use candle_core::{DType, Device, Tensor};
use candle_fp4::nvfp4::{
    dequantize_nvfp4, dequantize_rows, dequantize_rows_cpu, e2m1_decode, e2m1_encode, e4m3_decode,
    e4m3_encode, global_scale_for_amax, quantize_nvfp4, quantize_nvfp4_slice,
    quantize_nvfp4_with_global_scale, swizzle_blockscale, swizzle_blockscale_bytes,
    swizzled_offset, swizzled_shape, unswizzle_blockscale, unswizzle_blockscale_bytes,
    Nvfp4Quantized, E2M1_VALUES, E4M3_MAX, MIN_BLOCK_SCALE,
};
use float8::F8E4M3;
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

// ---------------------------------------------------------------------------------
// Independent references
// ---------------------------------------------------------------------------------

/// E2M1 magnitudes by code, written out from the format definition (bit 3 = sign).
const E2M1_REF: [f64; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

fn e2m1_ref_decode(code: u8) -> f64 {
    let m = E2M1_REF[(code & 7) as usize];
    if code & 8 != 0 {
        -m
    } else {
        m
    }
}

/// Nearest E2M1 level to `x` (in f64), ties to the even code, saturating at ±6; the
/// sign bit is set for every `x < 0` (ModelOpt's `sign_bit = weight < 0`).
fn e2m1_ref_encode(x: f64) -> u8 {
    let a = x.abs().min(6.0);
    let mut best = 0u8;
    for c in 1..8u8 {
        let d_new = (E2M1_REF[c as usize] - a).abs();
        let d_best = (E2M1_REF[best as usize] - a).abs();
        if d_new < d_best || (d_new == d_best && c.is_multiple_of(2)) {
            best = c;
        }
    }
    best | if x < 0.0 { 8 } else { 0 }
}

/// All finite non-negative E4M3 values, by code 0x00..=0x7E, from the format
/// definition (bias 7, 3 mantissa bits, subnormals `m·2^-9`).
fn e4m3_ref_table() -> Vec<f64> {
    (0u8..=0x7E)
        .map(|b| {
            let e = (b >> 3) as i32;
            let m = (b & 7) as f64;
            if e == 0 {
                m * 2f64.powi(-9)
            } else {
                (1.0 + m / 8.0) * 2f64.powi(e - 7)
            }
        })
        .collect()
}

/// Brute-force E4M3 encode: nearest finite value, ties to the even code, values beyond
/// 448 saturate (the `satfinite` convention).
fn e4m3_ref_encode(table: &[f64], x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = (x as f64).abs();
    if a >= 448.0 {
        return sign | 0x7E;
    }
    // The table is increasing: find the first value >= a.
    let hi = table.partition_point(|&v| v < a);
    let code = if hi == 0 {
        0
    } else {
        let lo = hi - 1;
        let (dl, dh) = (a - table[lo], table[hi] - a);
        if dl < dh || (dl == dh && lo.is_multiple_of(2)) {
            lo
        } else {
            hi
        }
    };
    sign | code as u8
}

fn f8_ref(b: u8) -> f32 {
    F8E4M3::from_bits(b).to_f32()
}

/// Independent decode of a row-major `Nvfp4Quantized` to the exact `e2m1 · e4m3`
/// products (no global scale), in f64.
fn ref_rows(q: &Nvfp4Quantized) -> Vec<f64> {
    let s_cols = q.k / 16;
    let mut out = Vec::with_capacity(q.n * q.k);
    for r in 0..q.n {
        for c in 0..q.k {
            let byte = q.weight[r * q.k / 2 + c / 2];
            let code = if c.is_multiple_of(2) {
                byte & 0xF
            } else {
                byte >> 4
            };
            let s = f8_ref(q.weight_scale[r * s_cols + c / 16]) as f64;
            out.push(e2m1_ref_decode(code) * s);
        }
    }
    out
}

fn code_at(q: &Nvfp4Quantized, r: usize, c: usize) -> u8 {
    let byte = q.weight[r * q.k / 2 + c / 2];
    if c.is_multiple_of(2) {
        byte & 0xF
    } else {
        byte >> 4
    }
}

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

// ---------------------------------------------------------------------------------
// Quantizer
// ---------------------------------------------------------------------------------

/// A random `[n, k]` matrix whose 16-blocks have log-uniform amplitudes over about
/// eight decades (so block scales span normals, subnormals and the 2^-9 clamp), with
/// a few all-zero blocks and one planted outlier of magnitude `outlier`.
fn random_matrix(rng: &mut StdRng, n: usize, k: usize, outlier: f32) -> Vec<f32> {
    let mut w = vec![0f32; n * k];
    for block in w.chunks_exact_mut(16) {
        let p: f32 = rng.random_range(0.0..1.0);
        if p < 0.03 {
            continue; // all-zero block
        }
        let amp = 10f32.powf(rng.random_range(-8.0..0.0));
        for v in block.iter_mut() {
            *v = amp * rng.random_range(-1.0..1.0);
        }
    }
    let at = rng.random_range(0..n * k);
    w[at] = -outlier;
    w
}

#[test]
fn quantizer_planted_blocks() {
    // Row 0: outlier block; row 1: zero block then tiny block then a subnormal-scale
    // block; everything else small.
    let (n, k) = (2, 64);
    let mut rng = StdRng::seed_from_u64(7);
    let mut w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-0.01..0.01)).collect();
    w[5] = -0.75; // the matrix amax, in block (0, 0)
    for v in &mut w[64..80] {
        *v = 0.0;
    }
    for v in &mut w[80..96] {
        *v = rng.random_range(-1e-6..1e-6);
    }
    w[81] = 1e-6;
    let q = quantize_nvfp4_slice(&w, n, k, None).unwrap();
    let gs = 0.75f32 / 2688.0; // amax / (6·448), in f32 as ModelOpt does
    assert_eq!(q.global_scale, gs);
    // Outlier block: scale amax/(6·gs) = 448 → 0x7E, and the outlier itself is -6.
    assert_eq!(q.weight_scale[0], 0x7E);
    assert_eq!(code_at(&q, 0, 5), 0xF);
    // All-zero block: scale 1.0 (0x38), codes 0.
    assert_eq!(q.weight_scale[4], 0x38);
    assert!(q.weight[64 / 2..80 / 2].iter().all(|&b| b == 0));
    // Tiny block: wants 1e-6/(6·gs) ≈ 4.5e-4 < 2^-9, clamped to the smallest subnormal
    // 0x01; its codes are then the E2M1 of w / (2^-9·gs), up to ±1.5 here.
    assert_eq!(q.weight_scale[5], 0x01);
    let d = MIN_BLOCK_SCALE * gs;
    for j in 16..32 {
        let expect = e2m1_ref_encode((w[64 + j] / d) as f64);
        assert_eq!(code_at(&q, 1, j), expect, "tiny block element {j}");
    }
    assert_ne!(code_at(&q, 1, 17), 0, "the clamp leaves non-zero codes");
    // A block whose amax is exactly 5·2^-9·6·gs gets the subnormal scale 0x05.
    let mut w2 = w.clone();
    let target = 5.0 * 2f32.powi(-9) * (6.0 * gs);
    for v in &mut w2[96..112] {
        *v = target * 0.5;
    }
    w2[100] = target;
    let q2 = quantize_nvfp4_slice(&w2, n, k, None).unwrap();
    assert_eq!(q2.weight_scale[6], 0x05);
    assert_eq!(e4m3_decode(0x05) as f64, 5.0 * 2f64.powi(-9));
}

#[test]
fn quantizer_scales_and_codes_follow_modelopt_rules() {
    let mut rng = StdRng::seed_from_u64(0x0DE1);
    let (n, k) = (96, 512);
    let w = random_matrix(&mut rng, n, k, 2.5);
    let q = quantize_nvfp4_slice(&w, n, k, None).unwrap();
    let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert_eq!(q.global_scale, amax / 2688.0);
    let gs = q.global_scale;
    let (mut subnormal, mut clamped, mut zero, mut outlier) = (0, 0, 0, 0);
    for (b, block) in w.chunks_exact(16).enumerate() {
        let bamax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        // Per ModelOpt 0.47: amax/(6·gs) in f32, 0 → 1, clamp [2^-9, 448], RNE to E4M3
        // (float8 as the independent cast).
        let want = bamax / (6.0 * gs);
        let want = if want == 0.0 {
            1.0
        } else {
            want.clamp(2f32.powi(-9), 448.0)
        };
        let sbyte = F8E4M3::from_f32(want).to_bits();
        assert_eq!(q.weight_scale[b], sbyte, "block {b}: amax {bamax:e}");
        match sbyte {
            0x01 if bamax / (6.0 * gs) < 2f32.powi(-9) => clamped += 1,
            0x01..=0x07 => subnormal += 1,
            0x38 if bamax == 0.0 => zero += 1,
            0x7E => outlier += 1,
            _ => {}
        }
        // Codes: E2M1 of w / (f32(scale)·gs), division in f32.
        let d = f8_ref(sbyte) * gs;
        for (j, &v) in block.iter().enumerate() {
            let idx = b * 16 + j;
            let c = code_at(&q, idx / k, idx % k);
            assert_eq!(c, e2m1_ref_encode((v / d) as f64), "element {idx}");
        }
    }
    assert!(subnormal > 10 && clamped > 10 && zero > 5 && outlier >= 1);
    // Subnormal scales decode exactly to m·2^-9.
    for m in 1u8..8 {
        assert_eq!(e4m3_decode(m) as f64, m as f64 / 512.0);
    }
}

#[test]
fn dequantize_matches_modelopt_order_and_error_is_bounded() {
    let mut rng = StdRng::seed_from_u64(0xDE0);
    let (n, k) = (80, 384);
    let w = random_matrix(&mut rng, n, k, 1.0);
    let q = quantize_nvfp4_slice(&w, n, k, None).unwrap();
    let gs = q.global_scale;
    let deq = q.dequantize();
    // The tensor API gives the same numbers (F8E4M3 scales accepted as well as U8).
    let (wt, st) = q.to_tensors(&Device::Cpu).unwrap();
    let st_f8 = Tensor::from_vec(
        q.weight_scale
            .iter()
            .map(|&b| F8E4M3::from_bits(b))
            .collect::<Vec<_>>(),
        (n, k / 16),
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(st_f8.dtype(), DType::F8E4M3);
    for s in [&st, &st_f8] {
        let t = dequantize_nvfp4(&wt, s, gs).unwrap();
        let t: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(t, deq);
    }
    let mut saturated = 0;
    for r in 0..n {
        for c in 0..k {
            let i = r * k + c;
            let code = code_at(&q, r, c);
            let sbyte = q.weight_scale[r * (k / 16) + c / 16];
            // ModelOpt's order e2m1·(f32(scale)·gs) with each product rounded to f32: a
            // product of two f32 is exact in f64, so f64-then-f32 is the f32 product.
            let d = ((f8_ref(sbyte) as f64) * (gs as f64)) as f32;
            let expect = (e2m1_ref_decode(code) * d as f64) as f32;
            assert_eq!(deq[i].to_bits(), expect.to_bits(), "({r}, {c})");
            // Error bound. The code is the nearest E2M1 level to t = fl(w/d); E2M1 steps
            // are 0.5 on [0, 2], 1 on [2, 4], 2 on [4, 6], so for |t| ≤ 6 the rounding
            // error is at most half the step at |t|: |q - t| ≤ h(|t|) with h = 0.25,
            // 0.5, 1. In w units that is h·d, plus the f32 roundings of w/d and of q·d
            // (each ≤ 2^-24 relative): |deq - w| ≤ h·d + 2^-23·(|w| + |deq|).
            // Saturated elements (|t| > 6, possible when the E4M3 scale rounded down,
            // by up to 2^-4 for normal scales and far more for subnormal ones) instead
            // have |deq| = 6d and error |w| - 6d.
            let t = (w[i] / d).abs();
            let err = (deq[i] - w[i]).abs() as f64;
            let slack = 2f64.powi(-23) * (w[i].abs() as f64 + deq[i].abs() as f64);
            if t > 6.0 {
                saturated += 1;
                assert_eq!(code & 7, 7, "saturated ({r}, {c}) must be ±6");
                // Only where the block scale rounded down: the block wanted
                // s_exact = amax_blk/(6·gs), got s < s_exact, so |t| ≤ 6·s_exact/s
                // (≤ 6·(1 + 2^-4) for normal scales), up to the f32 roundings.
                let blk = &w[i - c % 16..i - c % 16 + 16];
                let s_exact =
                    blk.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / (6.0 * gs as f64);
                let s = f8_ref(sbyte) as f64;
                assert!(s < s_exact, "({r}, {c}) saturated but its scale rounded up");
                let limit = if sbyte >= 0x08 {
                    6.0 * (1.0 + 1.0 / 16.0)
                } else {
                    6.0 * s_exact / s
                };
                assert!(
                    t as f64 <= limit * (1.0 + 2f64.powi(-20)),
                    "({r}, {c}): t = {t}"
                );
                assert!(
                    (err - (w[i].abs() as f64 - 6.0 * d as f64)).abs() <= slack,
                    "saturated ({r}, {c})"
                );
                continue;
            }
            let h = if t <= 2.0 {
                0.25
            } else if t <= 4.0 {
                0.5
            } else {
                1.0
            };
            assert!(
                err <= h * d as f64 + slack,
                "({r}, {c}): w {} deq {} err {err:e} > {h}·{d:e}",
                w[i],
                deq[i]
            );
        }
    }
    // The sample does exercise the saturated case.
    assert!(saturated > 0);
}

#[test]
fn quantizer_error_cases() {
    let good = vec![0.5f32; 4 * 32];
    assert!(quantize_nvfp4_slice(&good, 4, 32, None).is_ok());
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut w = good.clone();
        w[37] = bad;
        assert!(quantize_nvfp4_slice(&w, 4, 32, None).is_err(), "{bad}");
        assert!(quantize_nvfp4_slice(&w, 4, 32, Some(1.0)).is_err(), "{bad}");
    }
    // K not a multiple of 16, K = 0, wrong length.
    assert!(quantize_nvfp4_slice(&[0.5; 4 * 24], 4, 24, None).is_err());
    assert!(quantize_nvfp4_slice(&[0.5; 8], 1, 8, None).is_err());
    assert!(quantize_nvfp4_slice(&[], 4, 0, None).is_err());
    assert!(quantize_nvfp4_slice(&good, 4, 16, None).is_err());
    // All zeros: global scale would be 0.
    assert!(quantize_nvfp4_slice(&[0.0; 64], 2, 32, None).is_err());
    // A given global scale below amax/(6·448), or not positive finite.
    let own = global_scale_for_amax(0.5);
    assert!(quantize_nvfp4_slice(&good, 4, 32, Some(own)).is_ok());
    let smaller = f32::from_bits(own.to_bits() - 1);
    assert!(quantize_nvfp4_slice(&good, 4, 32, Some(smaller)).is_err());
    for g in [0.0f32, -1.0, f32::NAN, f32::INFINITY] {
        assert!(quantize_nvfp4_slice(&good, 4, 32, Some(g)).is_err(), "{g}");
    }
    // Tensor entry points: not 2-d, not float.
    let t1 = Tensor::new(&[0.5f32; 32], &Device::Cpu).unwrap();
    assert!(quantize_nvfp4(&t1).is_err());
    let tu8 = Tensor::zeros((2, 32), DType::U8, &Device::Cpu).unwrap();
    assert!(quantize_nvfp4(&tu8).is_err());
    let tz = Tensor::zeros((2, 32), DType::F32, &Device::Cpu).unwrap();
    assert!(quantize_nvfp4(&tz).is_err());
    assert!(quantize_nvfp4_with_global_scale(&tz, 1.0).is_ok());
}

#[test]
fn shared_global_scale_equals_quantizing_the_fused_matrix() {
    // q/k/v style: three matrices, one shared global scale = the max of their own.
    let mut rng = StdRng::seed_from_u64(0x5A);
    let k = 192;
    let parts: Vec<(usize, Vec<f32>)> = [(64usize, 0.3f32), (32, 1.7), (48, 0.9)]
        .iter()
        .map(|&(n, amp)| (n, random_matrix(&mut rng, n, k, amp)))
        .collect();
    let amax = |w: &[f32]| w.iter().fold(0f32, |m, v| m.max(v.abs()));
    let shared = parts
        .iter()
        .map(|(_, w)| global_scale_for_amax(amax(w)))
        .fold(0f32, f32::max);
    let mut fused_w = Vec::new();
    let mut cat_codes = Vec::new();
    let mut cat_scales = Vec::new();
    for (n, w) in &parts {
        let wt = Tensor::from_slice(w, (*n, k), &Device::Cpu).unwrap();
        let q = quantize_nvfp4_with_global_scale(&wt, shared).unwrap();
        assert_eq!(q.global_scale, shared);
        cat_codes.extend_from_slice(&q.weight);
        cat_scales.extend_from_slice(&q.weight_scale);
        fused_w.extend_from_slice(w);
    }
    let n_total: usize = parts.iter().map(|(n, _)| n).sum();
    let fused = quantize_nvfp4_slice(&fused_w, n_total, k, None).unwrap();
    assert_eq!(fused.global_scale, shared);
    assert_eq!(fused.weight, cat_codes);
    assert_eq!(fused.weight_scale, cat_scales);
    // The part that owns the max quantizes identically on its own.
    let (n1, w1) = &parts[1];
    let own = quantize_nvfp4_slice(w1, *n1, k, None).unwrap();
    let with = quantize_nvfp4_slice(w1, *n1, k, Some(shared)).unwrap();
    assert_eq!(own, with);
    // A part with a smaller amax gets different (smaller) scales under the shared one.
    let (n0, w0) = &parts[0];
    let own0 = quantize_nvfp4_slice(w0, *n0, k, None).unwrap();
    let with0 = quantize_nvfp4_slice(w0, *n0, k, Some(shared)).unwrap();
    assert_ne!(own0.weight_scale, with0.weight_scale);
}

#[test]
fn bf16_and_f64_tensors_quantize_like_their_f32_values() {
    let mut rng = StdRng::seed_from_u64(0xBF);
    let w: Vec<f32> = (0..32 * 64)
        .map(|_| bf16::from_f32(rng.random_range(-2.0..2.0)).to_f32())
        .collect();
    let base = quantize_nvfp4_slice(&w, 32, 64, None).unwrap();
    let t = Tensor::from_slice(&w, (32, 64), &Device::Cpu).unwrap();
    for dt in [DType::BF16, DType::F32, DType::F64] {
        let q = quantize_nvfp4(&t.to_dtype(dt).unwrap()).unwrap();
        assert_eq!(q, base, "{dt:?}");
    }
}

// ---------------------------------------------------------------------------------
// Swizzle
// ---------------------------------------------------------------------------------

/// `reshape(Mp/128, 4, 32, Sp/4, 4).permute(0, 3, 2, 1, 4)` of the zero-padded
/// row-major `[Mp, Sp]` matrix, as explicit loops over the five source indices.
fn swizzle_by_permute(scales: &[u8], n: usize, s: usize) -> Vec<u8> {
    let mp = n.div_ceil(128) * 128;
    let sp = s.div_ceil(4) * 4;
    let src = |m: usize, c: usize| if m < n && c < s { scales[m * s + c] } else { 0 };
    // Source view shape (A, B, C, D, E) = (Mp/128, 4, 32, Sp/4, 4): m = 128a + 32b + c,
    // col = 4d + e. Permuted shape (A, D, C, B, E); row-major output offset of
    // (a, d, c, b, e).
    let (na, nd) = (mp / 128, sp / 4);
    let mut out = vec![0xAAu8; mp * sp];
    for a in 0..na {
        for b in 0..4 {
            for c in 0..32 {
                for d in 0..nd {
                    for e in 0..4 {
                        let off = (((a * nd + d) * 32 + c) * 4 + b) * 4 + e;
                        out[off] = src(128 * a + 32 * b + c, 4 * d + e);
                    }
                }
            }
        }
    }
    out
}

#[test]
fn swizzle_matches_reshape_permute_and_round_trips() {
    let mut rng = StdRng::seed_from_u64(0x5_1772);
    for (n, s) in [
        (576, 36),
        (1, 1),
        (127, 5),
        (129, 4),
        (1536, 36),
        (200, 12),
        (128, 4),
        (33, 7),
    ] {
        // Non-zero bytes, so a zero in the output can only be padding.
        let scales: Vec<u8> = (0..n * s).map(|_| rng.random_range(1..=255)).collect();
        let expect = swizzle_by_permute(&scales, n, s);
        let (mp, sp) = swizzled_shape(n, s);
        assert_eq!(
            (mp, sp),
            (n.div_ceil(128) * 128, s.div_ceil(4) * 4),
            "{n}x{s}"
        );
        let got = swizzle_blockscale_bytes(&scales, n, s).unwrap();
        assert_eq!(got, expect, "swizzle {n}x{s}");
        // Padding bytes are zero and only padding is zero.
        let zeros = got.iter().filter(|&&b| b == 0).count();
        assert_eq!(zeros, mp * sp - n * s, "{n}x{s} padding");
        // swizzled_offset agrees entry by entry.
        for m in 0..n {
            for c in 0..s {
                assert_eq!(got[swizzled_offset(m, c, sp)], scales[m * s + c]);
            }
        }
        // Tensor API (U8 and F8E4M3 input) gives the same bytes, shape [Mp, Sp].
        let t = Tensor::from_slice(&scales, (n, s), &Device::Cpu).unwrap();
        let tf8 = Tensor::from_vec(
            scales
                .iter()
                .map(|&b| F8E4M3::from_bits(b))
                .collect::<Vec<_>>(),
            (n, s),
            &Device::Cpu,
        )
        .unwrap();
        for input in [&t, &tf8] {
            let sw = swizzle_blockscale(input).unwrap();
            assert_eq!(sw.dims(), [mp, sp]);
            assert_eq!(sw.dtype(), DType::U8);
            let v: Vec<u8> = sw.flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(v, expect);
            let back = unswizzle_blockscale(&sw, n, s).unwrap();
            assert_eq!(back.dims(), [n, s]);
            let back: Vec<u8> = back.flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(back, scales, "unswizzle {n}x{s}");
        }
        assert_eq!(unswizzle_blockscale_bytes(&got, n, s).unwrap(), scales);
        // Wrong sizes are errors.
        assert!(swizzle_blockscale_bytes(&scales[1..], n, s).is_err());
        assert!(unswizzle_blockscale_bytes(&got[1..], n, s).is_err());
    }
    let t1 = Tensor::zeros(16, DType::U8, &Device::Cpu).unwrap();
    assert!(swizzle_blockscale(&t1).is_err());
    let tf = Tensor::zeros((4, 4), DType::F32, &Device::Cpu).unwrap();
    assert!(swizzle_blockscale(&tf).is_err());
}

// ---------------------------------------------------------------------------------
// dequantize_rows
// ---------------------------------------------------------------------------------

#[test]
fn dequantize_rows_equals_independent_bf16_decode() {
    let mut rng = StdRng::seed_from_u64(0xD0);
    for (n, k) in [
        (1, 16),
        (127, 80),
        (129, 48),
        (200, 192),
        (3, 1040),
        (130, 320),
    ] {
        let w = random_matrix(&mut rng, n, k, 3.0);
        let q = quantize_nvfp4_slice(&w, n, k, None).unwrap();
        let expect: Vec<bf16> = ref_rows(&q)
            .into_iter()
            .map(|v| {
                // e2m1·e4m3 has at most 2 + 4 significant bits: exact in BF16.
                let b = bf16::from_f64(v);
                assert_eq!(b.to_f64(), v);
                b
            })
            .collect();
        let (wt, st) = q.to_tensors(&Device::Cpu).unwrap();
        let sw = swizzle_blockscale(&st).unwrap();
        let got = dequantize_rows(&wt, &sw).unwrap();
        assert_eq!(got.dims(), [n, k]);
        assert_eq!(got.dtype(), DType::BF16);
        let got: Vec<bf16> = got.flatten_all().unwrap().to_vec1().unwrap();
        let bits = |v: &[bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&expect), "{n}x{k}");
        let sw_bytes: Vec<u8> = sw.flatten_all().unwrap().to_vec1().unwrap();
        let cpu = dequantize_rows_cpu(&q.weight, &sw_bytes, n, k).unwrap();
        assert_eq!(bits(&cpu), bits(&expect), "cpu {n}x{k}");
        // A non-contiguous (but equal) weight view is accepted.
        let wide = Tensor::cat(&[&wt, &wt], 1)
            .unwrap()
            .narrow(1, k / 2, k / 2)
            .unwrap();
        let got2 = dequantize_rows(&wide, &sw).unwrap();
        let got2: Vec<bf16> = got2.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(bits(&got2), bits(&expect));
    }
}

#[test]
fn dequantize_rows_error_cases() {
    let dev = Device::Cpu;
    let (n, k) = (5, 64);
    let w = Tensor::zeros((n, k / 2), DType::U8, &dev).unwrap();
    let (mp, sp) = swizzled_shape(n, k / 16);
    let s = Tensor::zeros((mp, sp), DType::U8, &dev).unwrap();
    assert!(dequantize_rows(&w, &s).is_ok());
    // Weight not U8, not 2-d.
    let wbf = Tensor::zeros((n, k / 2), DType::BF16, &dev).unwrap();
    assert!(dequantize_rows(&wbf, &s).is_err());
    let w1 = Tensor::zeros(n * k / 2, DType::U8, &dev).unwrap();
    assert!(dequantize_rows(&w1, &s).is_err());
    let w3 = Tensor::zeros((1, n, k / 2), DType::U8, &dev).unwrap();
    assert!(dequantize_rows(&w3, &s).is_err());
    // K = 8·2 = 16 ok, K = 2·4 = 8 not a multiple of 16.
    let wk = Tensor::zeros((n, 4), DType::U8, &dev).unwrap();
    let (mp8, sp8) = swizzled_shape(n, 1);
    let s8 = Tensor::zeros((mp8, sp8), DType::U8, &dev).unwrap();
    assert!(dequantize_rows(&wk, &s8).is_err());
    // Unswizzled (unpadded) scales, scales of another shape, F8E4M3 scales.
    let s_raw = Tensor::zeros((n, k / 16), DType::U8, &dev).unwrap();
    assert!(dequantize_rows(&w, &s_raw).is_err());
    let s_big = Tensor::zeros((mp + 128, sp), DType::U8, &dev).unwrap();
    assert!(dequantize_rows(&w, &s_big).is_err());
    let s_f8 = Tensor::zeros((mp, sp), DType::F8E4M3, &dev).unwrap();
    assert!(dequantize_rows(&w, &s_f8).is_err());
    // The slice API checks sizes too.
    let codes = vec![0u8; n * k / 2];
    let sc = vec![0u8; mp * sp];
    assert!(dequantize_rows_cpu(&codes, &sc, n, k).is_ok());
    assert!(dequantize_rows_cpu(&codes[1..], &sc, n, k).is_err());
    assert!(dequantize_rows_cpu(&codes, &sc[1..], n, k).is_err());
    assert!(dequantize_rows_cpu(&codes, &sc, n, k + 8).is_err());
    // dequantize_nvfp4 checks its shapes as well.
    let s_rm = Tensor::zeros((n, k / 16 + 1), DType::U8, &dev).unwrap();
    assert!(dequantize_nvfp4(&w, &s_rm, 1.0).is_err());
    assert!(dequantize_nvfp4(&wbf, &s_raw, 1.0).is_err());
    assert!(dequantize_nvfp4(&wk, &s_raw, 1.0).is_err());
}
