//! QuantLinear: forward numerics on both paths, dispatch, bias, BF16 layers, the fused
//! silu·mul (checkpoint loading and quant configs: `quant_linear_load.rs`).
//!
//! Tolerance of a forward output against an FP32 matmul of `x` with `dequantize()`:
//! `r · 2⁻⁸ · (|ref| + e) + e` with `e = (2K + 4) · 2⁻²⁴ · Σ|x·w|` (FP32 summation-order
//! differences on both sides, plus the last-bit difference between ModelOpt's
//! dequantization order and the kernels' `(x·e2m1·e4m3)·gs`), and `r` the number of BF16
//! roundings on the path: 1 for the GEMV (and for BF16 weights), 2 for the NVFP4 matmul
//! path (BF16 product, then × global scale, rounded again), plus 1 for a bias add.

use candle_core::{DType, Device, IndexOp, Module, Result, Tensor};
use candle_fp4::gemv::nvfp4_gemv;
use candle_fp4::nvfp4::{dequantize_rows, swizzle_blockscale};
use candle_fp4::quant_linear::{use_gemv, QuantLinear};
use rand::rngs::StdRng;
use rand::SeedableRng;

mod quant_linear_common;
use quant_linear_common::*;

#[test]
fn use_gemv_dispatch() {
    // CPU: always for 1..=32 tokens with K % 64 == 0.
    for m in 1..=32 {
        assert!(use_gemv(true, None, m, 576), "cpu m = {m}");
    }
    assert!(!use_gemv(true, None, 0, 576));
    assert!(!use_gemv(true, None, 33, 576));
    assert!(!use_gemv(true, Some(4), 33, 576));
    assert!(!use_gemv(true, None, 1, 80), "K not a multiple of 64");
    assert!(!use_gemv(true, None, 1, 0));
    // GPU: only with a tuned tile.
    assert!(!use_gemv(false, None, 1, 4096));
    assert!(use_gemv(false, Some(1), 1, 4096));
    assert!(use_gemv(false, Some(4), 32, 4096));
    assert!(!use_gemv(false, Some(4), 33, 4096));
    assert!(!use_gemv(false, Some(1), 1, 4000));
}

#[test]
fn nvfp4_forward_matches_reference() -> Result<()> {
    // (N, K): square, awkward N, K not a multiple of 64 (always the matmul path).
    for (seed, (n, k)) in [(576, 576), (200, 192), (72, 80)].into_iter().enumerate() {
        let q = quantized(seed as u64, n, k);
        let layer = QuantLinear::from_nvfp4(&q, None, &Device::Cpu)?;
        assert!(layer.is_nvfp4());
        assert_eq!((layer.out_features(), layer.in_features()), (n, k));
        let w = layer.dequantize()?;
        for m in [1, 3, 32, 33, 70] {
            let x = rand_x(100 + m as u64, &[m, k]);
            let y = layer.forward(&x)?;
            assert_eq!(y.dims(), [m, n]);
            assert_eq!(y.dtype(), DType::BF16);
            let r = if use_gemv(true, None, m, k) { 1.0 } else { 2.0 };
            check_close(&y, &x, &w, None, r, &format!("N={n} K={k} M={m}"));
        }
    }
    Ok(())
}

#[test]
fn forward_takes_gemv_up_to_32_tokens_then_matmul() -> Result<()> {
    let (n, k) = (200, 192);
    let q = quantized(7, n, k);
    let layer = QuantLinear::from_nvfp4(&q, None, &Device::Cpu)?;
    let (codes, scales) = q.to_tensors(&Device::Cpu)?;
    let swz = swizzle_blockscale(&scales)?;
    for m in [1, 5, 32] {
        let x = rand_x(m as u64, &[m, k]);
        let want = nvfp4_gemv(&x, &codes, &swz, q.global_scale, false, false)?;
        assert_eq!(bits(&layer.forward(&x)?), bits(&want), "M = {m}");
    }
    for m in [33, 64] {
        let x = rand_x(m as u64, &[m, k]);
        let w = dequantize_rows(&codes, &swz)?;
        let want = x
            .matmul(&w.t()?)?
            .to_dtype(DType::F32)?
            .affine(q.global_scale as f64, 0.0)?
            .to_dtype(DType::BF16)?;
        assert_eq!(bits(&layer.forward(&x)?), bits(&want), "M = {m}");
    }
    Ok(())
}

#[test]
fn forward_3d_1d_and_non_contiguous_inputs() -> Result<()> {
    let (n, k) = (200, 192);
    let layer = QuantLinear::from_nvfp4(&quantized(3, n, k), None, &Device::Cpu)?;
    let w = layer.dequantize()?;
    for (b, s) in [(2, 3), (2, 20), (1, 1)] {
        let x = rand_x(b as u64 * 31 + s as u64, &[b, s, k]);
        let y = layer.forward(&x)?;
        assert_eq!(y.dims(), [b, s, n]);
        let r = if b * s <= 32 { 1.0 } else { 2.0 };
        check_close(&y, &x, &w, None, r, &format!("[{b}, {s}, {k}]"));
        // Each token's row equals the 2-d forward of the flattened input.
        let flat = layer.forward(&x.reshape((b * s, k))?)?;
        assert_eq!(bits(&y), bits(&flat));
    }
    let x1 = rand_x(9, &[k]);
    let y1 = layer.forward(&x1)?;
    assert_eq!(y1.dims(), [n]);
    assert_eq!(bits(&y1), bits(&layer.forward(&x1.unsqueeze(0)?)?));
    // Transposed (inner stride != 1) and narrowed (row stride > K) inputs.
    for m in [4, 40] {
        let xt = rand_x(50 + m as u64, &[k, m]).t()?;
        assert!(!xt.is_contiguous());
        assert_eq!(
            bits(&layer.forward(&xt)?),
            bits(&layer.forward(&xt.contiguous()?)?)
        );
        let wide = rand_x(60 + m as u64, &[m, k + 64]);
        let xn = wide.narrow(1, 32, k)?;
        assert!(!xn.is_contiguous());
        assert_eq!(
            bits(&layer.forward(&xn)?),
            bits(&layer.forward(&xn.contiguous()?)?)
        );
    }
    // F32 input: computed in BF16, returned as F32.
    let xf = rand_x(11, &[3, k]).to_dtype(DType::F32)?;
    let yf = layer.forward(&xf)?;
    assert_eq!(yf.dtype(), DType::F32);
    assert_eq!(bits(&yf), bits(&layer.forward(&xf.to_dtype(DType::BF16)?)?));
    // Wrong K is an error.
    assert!(layer.forward(&rand_x(1, &[2, k + 16])).is_err());
    Ok(())
}

#[test]
fn bias_is_added() -> Result<()> {
    let (n, k) = (200, 192);
    let q = quantized(5, n, k);
    let bias = rand_bias(6, n);
    let plain = QuantLinear::from_nvfp4(&q, None, &Device::Cpu)?;
    let layer = QuantLinear::from_nvfp4(&q, Some(bias.clone()), &Device::Cpu)?;
    assert_eq!(layer.bias().map(|b| b.dtype()), Some(DType::BF16));
    let w = layer.dequantize()?;
    for m in [1, 7, 33] {
        let x = rand_x(m as u64, &[m, k]);
        let y = layer.forward(&x)?;
        let r = if m <= 32 { 2.0 } else { 3.0 };
        check_close(&y, &x, &w, Some(&bias), r, &format!("bias M={m}"));
        let want = plain
            .forward(&x)?
            .broadcast_add(&bias.to_dtype(DType::BF16)?)?;
        assert_eq!(bits(&y), bits(&want));
    }
    assert!(QuantLinear::from_nvfp4(&q, Some(rand_bias(1, n + 1)), &Device::Cpu).is_err());
    Ok(())
}

#[test]
fn bf16_layers() -> Result<()> {
    let (n, k) = (200, 192);
    let mut rng = StdRng::seed_from_u64(21);
    let wv = rand_weights(&mut rng, n, k);
    let w = Tensor::from_vec(wv, (n, k), &Device::Cpu)?;
    let bias = rand_bias(22, n);
    for b in [None, Some(bias.clone())] {
        let layer = QuantLinear::from_bf16(w.clone(), b.clone())?;
        assert!(!layer.is_nvfp4());
        assert_eq!(layer.global_scale(), None);
        let wd = layer.dequantize()?;
        assert_eq!(wd.dtype(), DType::F32);
        // The stored weight is BF16-rounded.
        assert_eq!(bits(&wd), bits(&w));
        for m in [1, 5, 32, 33, 70] {
            let x = rand_x(m as u64, &[m, k]);
            let r = if b.is_some() { 2.0 } else { 1.0 };
            let what = format!("bf16 M={m} bias={}", b.is_some());
            check_close(&layer.forward(&x)?, &x, &wd, b.as_ref(), r, &what);
        }
    }
    assert!(QuantLinear::from_bf16(Tensor::zeros(5, DType::F32, &Device::Cpu)?, None).is_err());
    assert!(QuantLinear::from_bf16(Tensor::zeros((4, 4), DType::U8, &Device::Cpu)?, None).is_err());
    Ok(())
}

fn check_silu_mul(layer: &QuantLinear, bias: Option<&Tensor>, r: f32, what: &str) -> Result<()> {
    let (n2, k) = (layer.out_features(), layer.in_features());
    let h = n2 / 2;
    let w = layer.dequantize()?;
    for m in [1, 4, 32, 33, 40] {
        let x = rand_x(70 + m as u64, &[m, k]);
        let y = layer.forward_silu_mul(&x)?;
        assert_eq!(y.dims(), [m, h]);
        // On CPU the fused epilogue equals forward + the FP32 silu·mul bit for bit.
        assert_eq!(
            bits(&y),
            bits(&silu_mul_ref(&layer.forward(&x)?)?),
            "{what} M={m}"
        );
        // Against the FP32 reference: errors of g and u propagate through silu·mul.
        let rf = reference(&x, &w, bias);
        let yv = y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let rr = if m <= 32 { r } else { r + 1.0 };
        for t in 0..m {
            for j in 0..h {
                let (ig, iu) = (t * n2 + j, t * n2 + h + j);
                let (g, u) = (rf.y[ig], rf.y[iu]);
                let (tg, tu) = (rf.tol(rr, ig), rf.tol(rr, iu));
                let sg = g / (1.0 + (-g).exp());
                let want = sg * u;
                // |silu'| ≤ 1.1
                let tol = 1.1 * tg * (u.abs() + tu) + sg.abs() * tu + 1.01 * U * want.abs() + 1e-30;
                let got = yv[t * h + j];
                assert!(
                    (got - want).abs() <= tol,
                    "{what} M={m} ({t}, {j}): got {got}, reference {want}, tol {tol}"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn forward_silu_mul() -> Result<()> {
    let (h, k) = (160, 192);
    let q = quantized(31, 2 * h, k);
    check_silu_mul(
        &QuantLinear::from_nvfp4(&q, None, &Device::Cpu)?,
        None,
        1.0,
        "nvfp4",
    )?;
    let bias = rand_bias(32, 2 * h);
    let with_bias = QuantLinear::from_nvfp4(&q, Some(bias.clone()), &Device::Cpu)?;
    check_silu_mul(&with_bias, Some(&bias), 2.0, "nvfp4+bias")?;
    let w = QuantLinear::from_nvfp4(&q, None, &Device::Cpu)?.dequantize()?;
    check_silu_mul(&QuantLinear::from_bf16(w, None)?, None, 1.0, "bf16")?;
    // 3-d input.
    let layer = QuantLinear::from_nvfp4(&q, None, &Device::Cpu)?;
    let x = rand_x(3, &[2, 3, k]);
    let y = layer.forward_silu_mul(&x)?;
    assert_eq!(y.dims(), [2, 3, h]);
    assert_eq!(bits(&y.i(1)?), bits(&layer.forward_silu_mul(&x.i(1)?)?));
    // Odd N.
    let odd = QuantLinear::from_nvfp4(&quantized(1, 3, 64), None, &Device::Cpu)?;
    assert!(odd.forward_silu_mul(&rand_x(1, &[1, 64])).is_err());
    Ok(())
}

#[test]
fn from_nvfp4_round_trips() -> Result<()> {
    let q = quantized(41, 200, 192);
    let layer = QuantLinear::from_nvfp4(&q, None, &Device::Cpu)?;
    assert_eq!(layer.global_scale(), Some(q.global_scale));
    assert_eq!(layer.to_nvfp4()?.as_ref(), Some(&q));
    let d = layer.dequantize()?.flatten_all()?.to_vec1::<f32>()?;
    let want = q.dequantize();
    assert!(d.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
    for bad_gs in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let mut b = q.clone();
        b.global_scale = bad_gs;
        assert!(QuantLinear::from_nvfp4(&b, None, &Device::Cpu).is_err());
    }
    let mut short = q.clone();
    short.weight.pop();
    assert!(QuantLinear::from_nvfp4(&short, None, &Device::Cpu).is_err());
    Ok(())
}

/// `forward_add_norm` on the CPU is the add + norm, then the layer, bit for bit (with and
/// without a delta, plain and silu·mul), and never the fused kernel; a norm of another
/// width is an error.
#[test]
fn forward_add_norm_is_the_composition_on_cpu() -> Result<()> {
    use candle_fp4::norm::AddRmsNorm;
    let (n, k) = (272, 320);
    let layer = QuantLinear::from_nvfp4(&quantized(41, n, k), None, &Device::Cpu)?;
    let w = (rand_x(42, &[k]).abs()? + 0.5)?.to_dtype(DType::BF16)?;
    let norm = AddRmsNorm::new(&w, 1e-5)?;
    for m in [1, 5, 40] {
        let x = rand_x(43 + m as u64, &[m, k]).to_dtype(DType::BF16)?;
        let d = rand_x(44 + m as u64, &[m, k]).to_dtype(DType::BF16)?;
        for silu in [false, true] {
            assert!(!layer.fuses_norm(m, silu));
            for delta in [Some(&d), None] {
                let (s, y) = layer.forward_add_norm(&x, delta, &norm, silu)?;
                let (s2, h) = norm.forward(&x, delta)?;
                let y2 = if silu {
                    layer.forward_silu_mul(&h)?
                } else {
                    layer.forward(&h)?
                };
                let what = format!("m={m} silu={silu} delta={}", delta.is_some());
                assert_eq!(bits(&s), bits(&s2), "{what}: sum");
                assert_eq!(bits(&y), bits(&y2), "{what}: output");
                assert_eq!(y.dims(), [m, if silu { n / 2 } else { n }], "{what}");
            }
        }
    }
    let other = AddRmsNorm::new(&Tensor::ones(k + 64, DType::BF16, &Device::Cpu)?, 1e-5)?;
    let x = rand_x(50, &[1, k]).to_dtype(DType::BF16)?;
    assert!(layer.forward_add_norm(&x, None, &other, false).is_err());
    Ok(())
}
