//! GPU GEMV tests (feature `cuda`, needs an NVIDIA GPU): every kernel variant against the
//! CPU oracle and against cuBLAS (candle's matmul) on the dequantized weight.
//!
//! Tolerance, derived once: the kernel and the oracle both sum exact products (BF16
//! weight × BF16 activation is exact in FP32) in FP32, in different orders, so before
//! rounding they differ by at most `e = γ·Σ|x·w|·gs` with `γ = K·2^-24` (the classic
//! bound for any summation order); each then rounds once to BF16 (half an ulp, 2^-9
//! relative), so `|gpu − cpu| ≤ e + 2^-8·max(|gpu|, |cpu|)`. cuBLAS returns BF16
//! before the global scale, one more rounding: its bound adds `2^-8·|ref|`.
//! With `silu_mul`, gate and up are each rounded (propagated through silu·up: at most
//! `2^-8·(|silu'(g)·g·u| + |silu(g)·u|)` + their `e`), then one final rounding.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use candle_fp4::gemv::{bf16_gemv_with, nvfp4_gemv_with, GemvKnobs, KernelImage};
use candle_fp4::nvfp4::dequantize_rows;
use rand::{rngs::StdRng, SeedableRng};

mod gemv_gpu_common;
use gemv_gpu_common::{abs_dot, check, gpu, layer, rand_x, R};

fn variants(m: usize, small: bool) -> Vec<GemvKnobs> {
    let mut v = Vec::new();
    for nt in [1usize, 2, 4].into_iter().filter(|nt| 8 * nt >= m) {
        let splits: &[usize] = if small { &[1, 2, 4, 8] } else { &[1, 2, 8] };
        for &s in splits {
            v.push(GemvKnobs {
                nt: Some(nt),
                split: Some(s),
                pdl: s % 4 == 0,
                ..Default::default()
            });
        }
        v.push(GemvKnobs {
            nt: Some(nt),
            split: Some(1),
            image: KernelImage::Sm80,
            ..Default::default()
        });
    }
    v
}

fn run_shape(n: usize, k: usize, ms: &[usize], silus: &[bool], small: bool, seed: u64) -> R<()> {
    let dev = gpu();
    let mut rng = StdRng::seed_from_u64(seed);
    let l = layer(n, k, &mut rng)?;
    let (cg, sg) = (l.codes.to_device(&dev)?, l.scales.to_device(&dev)?);
    // Dequantized rows on the GPU must equal the CPU's bit for bit.
    let deq_gpu = dequantize_rows(&cg, &sg)?;
    let deq_cpu = dequantize_rows(&l.codes, &l.scales)?;
    let a = deq_gpu
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .to_vec2::<f32>()?;
    let b = deq_cpu.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    assert!(a == b, "dequantize_rows: GPU and CPU differ for {n}x{k}");
    let w_bf16 = deq_gpu.clone();
    for &m in ms {
        let x = rand_x(m, k, &mut rng)?;
        let xg = x.to_device(&dev)?;
        // CPU oracle pre-activation (no epilogue), as F32 before rounding is not exposed:
        // use the exact F64 product instead (FP32 order effects are inside the bound).
        let pre = (x
            .to_dtype(DType::F64)?
            .matmul(&deq_cpu.to_dtype(DType::F64)?.t()?)?
            * l.gs as f64)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        let absd = abs_dot(&xg, &w_bf16, l.gs)?;
        // cuBLAS on the dequantized weight (BF16 out), then the global scale in F32.
        let cublas = (xg.matmul(&w_bf16.t()?)?.to_dtype(DType::F32)? * l.gs as f64)?
            .to_device(&Device::Cpu)?
            .to_vec2::<f32>()?;
        for &silu_mul in silus {
            let cpu = nvfp4_gemv_with(
                &x,
                &l.codes,
                &l.scales,
                l.gs,
                silu_mul,
                &GemvKnobs::default(),
            )?;
            check(
                &format!("cpu oracle {n}x{k} m={m} silu={silu_mul}"),
                &cpu,
                &pre,
                &absd,
                k,
                silu_mul,
                false,
            )?;
            for o in variants(m, small) {
                // Poison: free a NaN buffer of the output's size just before the call so
                // the stream-ordered allocator hands it back; unwritten outputs show as NaN.
                drop(Tensor::full(f32::NAN, (m, n), &dev)?.to_dtype(DType::BF16)?);
                let y = nvfp4_gemv_with(&xg, &cg, &sg, l.gs, silu_mul, &o)?;
                let what = format!("nvfp4 {n}x{k} m={m} silu={silu_mul} {o:?}");
                check(&what, &y, &pre, &absd, k, silu_mul, false)?;
                check(
                    &format!("{what} vs cublas"),
                    &y,
                    &cublas,
                    &absd,
                    k,
                    silu_mul,
                    true,
                )?;
                // BF16 GEMV on the same (dequantized, unscaled) weight.
                let yb = bf16_gemv_with(&xg, &w_bf16, silu_mul, &o)?;
                let pre1: Vec<Vec<f32>> = pre
                    .iter()
                    .map(|r| r.iter().map(|v| v / l.gs).collect())
                    .collect();
                let abs1: Vec<Vec<f32>> = absd
                    .iter()
                    .map(|r| r.iter().map(|v| v / l.gs).collect())
                    .collect();
                check(
                    &format!("bf16 {what}"),
                    &yb,
                    &pre1,
                    &abs1,
                    k,
                    silu_mul,
                    false,
                )?;
            }
        }
    }
    Ok(())
}

#[test]
fn smollm2_shapes_every_m_every_variant() -> R<()> {
    let all: Vec<usize> = (1..=32).collect();
    run_shape(576, 576, &all, &[false, true], true, 1)?;
    run_shape(1536, 576, &all, &[false, true], true, 2)?;
    run_shape(576, 1536, &[1, 8, 9, 31, 32], &[false], true, 3)
}

#[test]
fn awkward_shapes() -> R<()> {
    // N not a multiple of 16 (partial row tiles), K % 128 == 64 (tail chunk).
    run_shape(200, 192, &[1, 3, 8, 13, 32], &[false, true], true, 4)?;
    run_shape(130, 320, &[1, 2, 17, 32], &[false, true], true, 5)?;
    run_shape(16, 64, &[1, 32], &[false, true], true, 6)
}

#[test]
fn llama_8b_shapes() -> R<()> {
    let ms = [1, 5, 8, 16, 32];
    run_shape(4096, 4096, &ms, &[false], false, 7)?;
    run_shape(6144, 4096, &[1, 32], &[false], false, 8)?;
    run_shape(28672, 4096, &[1, 9, 32], &[true], false, 9)?;
    run_shape(4096, 14336, &[1, 32], &[false], false, 10)
}

#[test]
fn lm_head_shape() -> R<()> {
    run_shape(128256, 4096, &[1, 32], &[false], false, 11)
}

#[test]
fn strided_x_and_errors() -> R<()> {
    let dev = gpu();
    let mut rng = StdRng::seed_from_u64(12);
    let l = layer(256, 512, &mut rng)?;
    let (cg, sg) = (l.codes.to_device(&dev)?, l.scales.to_device(&dev)?);
    let wide = rand_x(4, 1024, &mut rng)?.to_device(&dev)?;
    let x = wide.narrow(1, 512, 512)?; // row stride 1024, unit inner stride
    let y = nvfp4_gemv_with(&x, &cg, &sg, l.gs, false, &GemvKnobs::default())?;
    let y2 = nvfp4_gemv_with(
        &x.contiguous()?,
        &cg,
        &sg,
        l.gs,
        false,
        &GemvKnobs::default(),
    )?;
    let (a, b) = (
        y.to_dtype(DType::F32)?.to_vec2::<f32>()?,
        y2.to_dtype(DType::F32)?.to_vec2::<f32>()?,
    );
    assert_eq!(a, b);
    assert!(nvfp4_gemv_with(
        &x,
        &cg,
        &sg,
        l.gs,
        false,
        &GemvKnobs {
            split: Some(3),
            ..Default::default()
        }
    )
    .is_err());
    assert!(nvfp4_gemv_with(
        &x,
        &cg,
        &sg,
        l.gs,
        false,
        &GemvKnobs {
            nt: Some(2),
            split: Some(2),
            image: KernelImage::Sm80,
            ..Default::default()
        }
    )
    .is_err());
    let x33 = rand_x(33, 512, &mut rng)?.to_device(&dev)?;
    assert!(nvfp4_gemv_with(&x33, &cg, &sg, l.gs, false, &GemvKnobs::default()).is_err());
    Ok(())
}
