//! The NVFP4 quantizer against ModelOpt's rules (see `tests/data/modelopt_tiny/README.md`),
//! the 128×4 swizzle against FORMATS.md's reshape/permute done as explicit index loops, and
//! the exact BF16 row dequantization, with the independent decoders of `nvfp4_common`.

use candle_core::{DType, Device, Tensor};
use candle_fp4::nvfp4::{
    dequantize_nvfp4, dequantize_rows, dequantize_rows_cpu, e4m3_decode, global_scale_for_amax,
    quantize_nvfp4, quantize_nvfp4_slice, quantize_nvfp4_with_global_scale, swizzle_blockscale,
    swizzle_blockscale_bytes, swizzled_offset, swizzled_shape, unswizzle_blockscale,
    unswizzle_blockscale_bytes, MIN_BLOCK_SCALE,
};
use float8::F8E4M3;
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod nvfp4_common;
use nvfp4_common::*;

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
