//! GPU tests of the packed GEMV kernel over BF16 weights in their natural layout (feature
//! `cuda`, needs an NVIDIA GPU; `kernels/gemv_packed.cu`, "BF16 weights"): the output
//! against the FP64 product with the tolerance derived in `gpu_gemv.rs` (products of two
//! BF16 are exact in FP32, so only the FP32 sum's order, `K·2^-24·Σ|x·w|`, and one BF16
//! rounding, `2^-8·|y|`, separate them), on shapes that reach every plan: rows past the last
//! whole tile, `silu_mul` halves that are not whole tiles, the pair kernel (many row tiles),
//! the staged kernel (few CTAs), the split-K path (few row tiles, long K), 1 to 8 tokens, PDL
//! on and off, and a second call (the split-K counters reset). Outputs are poisoned first.
#![cfg(feature = "cuda")]

mod gemv_gpu_common;

use candle_core::{DType, Module, Tensor};
use candle_fp4::gemv::{bf16_gemv_planned_packed, plan_bf16_gemv, plan_bf16_gemv_with, GemvKnobs};
use candle_fp4::quant_linear::QuantLinear;
use gemv_gpu_common::{abs_dot, bf16_weight, check, fp64_reference, gpu, gpu_sms, rand_x, R};
use rand::{rngs::StdRng, SeedableRng};

/// Runs every `m` and epilogue on an `[n, k]` weight; returns the kernels the plans chose.
fn run(n: usize, k: usize, ms: &[usize], silus: &[bool], seed: u64) -> R<Vec<String>> {
    let dev = gpu();
    let mut rng = StdRng::seed_from_u64(seed);
    let w = bf16_weight(n, k, &mut rng)?;
    let wg = w.to_device(&dev)?;
    let mut kernels = Vec::new();
    for &m in ms {
        let x = rand_x(m, k, &mut rng)?;
        let xg = x.to_device(&dev)?;
        let pre = fp64_reference(&x, &w)?;
        let absd = abs_dot(&xg, &wg, 1.0)?;
        for &silu in silus {
            for pdl in [false, true] {
                let knobs = GemvKnobs::with_pdl(pdl);
                let plan = plan_bf16_gemv_with(&wg, silu, &knobs)?
                    .expect("the BF16 kernels serve this shape");
                kernels.push(plan.kernel_for(m).unwrap_or("none").to_string());
                // Poison: a NaN buffer of the output's size freed just before the call.
                drop(Tensor::full(f32::NAN, (m, n), &dev)?.to_dtype(DType::BF16)?);
                let y = bf16_gemv_planned_packed(&xg, &wg, &plan)?;
                let what = format!(
                    "bf16 {n}x{k} m={m} silu={silu} pdl={pdl} ({})",
                    kernels.last().unwrap()
                );
                check(&what, &y, &pre, &absd, k, silu, false)?;
                let again = bf16_gemv_planned_packed(&xg, &wg, &plan)?;
                let (y1, y2) = (
                    y.to_dtype(DType::F32)?.to_vec2::<f32>()?,
                    again.to_dtype(DType::F32)?.to_vec2::<f32>()?,
                );
                assert!(
                    y1 == y2,
                    "{what}: a second call differs (split-K state not reset?)"
                );
            }
        }
    }
    Ok(kernels)
}

#[test]
fn awkward_shapes() -> R<()> {
    // Rows past the last whole tile, odd halves, K with an odd number of 64-wide chunks.
    run(37, 576, &[1, 3, 8], &[false], 1)?;
    run(70, 320, &[1, 5, 8], &[false, true], 2)?;
    // Few row tiles and a long K: the planner splits K.
    let ks = run(32, 8192, &[1, 8], &[false, true], 3)?;
    assert!(!ks.is_empty());
    Ok(())
}

#[test]
fn pair_and_staged_kernels() -> R<()> {
    // 7400 rows: more than 3.5 tiles per SM on a 132-SM GPU (the pair kernel).
    let pair = run(7400, 256, &[1, 8], &[false], 4)?;
    assert!(
        pair.iter().any(|k| k.contains("bf16pair")) || gpu_sms()? < 132,
        "7400 rows should take the pair kernel: {pair:?}"
    );
    // 1000 rows, long K: at most two CTAs per SM, so one token takes the staged kernel.
    let staged = run(1000, 4032, &[1, 2], &[false], 5)?;
    assert!(
        staged.iter().any(|k| k.contains("bf16xs")),
        "a one-token call of a 63-tile layer should take the staged kernel: {staged:?}"
    );
    Ok(())
}

#[test]
fn llama_8b_shapes() -> R<()> {
    run(6144, 4096, &[1, 8], &[false], 6)?;
    run(4096, 4096, &[1, 4], &[false], 7)?;
    run(28672, 4096, &[1, 8], &[true], 8)?;
    run(4096, 14336, &[1, 8], &[false], 9)?;
    Ok(())
}

/// The GEMV knobs reach a layer's plans through `QuantLinear::set_gemv_knobs`, the path
/// `Llama`'s loader takes for `knobs.gemv` (before the thirty-fourth session only PDL did, so
/// decode_bench's A/B knobs measured the shipped path): a BF16 8B o layer (4096×4096, the
/// shipped sm90 table's GEMV at M = 1) runs the packed BF16-weight kernel by default and
/// gemv.cu's kernel under `bf16_legacy`, and both meet the bound.
#[test]
fn gemv_knobs_reach_the_layer() -> R<()> {
    let dev = gpu();
    let (n, k) = (4096, 4096);
    let mut rng = StdRng::seed_from_u64(21);
    let w = bf16_weight(n, k, &mut rng)?;
    let x = rand_x(1, k, &mut rng)?;
    let pre = fp64_reference(&x, &w)?;
    let (xg, wg) = (x.to_device(&dev)?, w.to_device(&dev)?);
    let absd = abs_dot(&xg, &wg, 1.0)?;
    let mut q = QuantLinear::from_bf16(wg, None)?;
    for legacy in [false, true] {
        q.set_gemv_knobs(&GemvKnobs {
            bf16_legacy: legacy,
            ..GemvKnobs::with_pdl(true)
        })?;
        let kernel = q.packed_kernel_for(1, false);
        assert_eq!(
            kernel.is_some(),
            !legacy,
            "bf16_legacy {legacy}: planned packed kernel {kernel:?}"
        );
        drop(Tensor::full(f32::NAN, (1, n), &dev)?.to_dtype(DType::BF16)?);
        let y = q.forward(&xg)?;
        let what = format!("layer {n}x{k} legacy={legacy} ({kernel:?})");
        check(&what, &y, &pre, &absd, k, false, false)?;
    }
    Ok(())
}

#[test]
fn errors_are_errors() -> R<()> {
    let dev = gpu();
    let w = Tensor::zeros((64, 128), DType::BF16, &dev)?;
    // K not a multiple of 64: no plan, not a panic.
    let odd = Tensor::zeros((64, 96), DType::BF16, &dev)?;
    assert!(plan_bf16_gemv(&odd, false, false)?.is_none());
    // silu_mul needs an even N.
    assert!(plan_bf16_gemv(&Tensor::zeros((65, 128), DType::BF16, &dev)?, true, false)?.is_none());
    // A non-BF16 weight is an error.
    assert!(plan_bf16_gemv(&w.to_dtype(DType::F32)?, false, false).is_err());
    let plan = plan_bf16_gemv(&w, false, false)?.expect("plan");
    // More tokens than the plan serves, the wrong K, a strided weight.
    let x9 = Tensor::zeros((9, 128), DType::BF16, &dev)?;
    assert!(bf16_gemv_planned_packed(&x9, &w, &plan).is_err());
    let xk = Tensor::zeros((1, 64), DType::BF16, &dev)?;
    assert!(bf16_gemv_planned_packed(&xk, &w, &plan).is_err());
    let wide = Tensor::zeros((64, 256), DType::BF16, &dev)?;
    let x1 = Tensor::zeros((1, 128), DType::BF16, &dev)?;
    assert!(bf16_gemv_planned_packed(&x1, &wide.narrow(1, 0, 128)?, &plan).is_err());
    // A weight of another dtype.
    assert!(bf16_gemv_planned_packed(&x1, &w.to_dtype(DType::F32)?, &plan).is_err());
    Ok(())
}
