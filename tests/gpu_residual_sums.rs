//! The residual epilogue and the norm prologue that takes its sums of squares, on a GPU
//! (feature `cuda`, needs an NVIDIA GPU): `QuantLinear::forward_residual` (o_proj /
//! down_proj) and `QuantLinear::forward_add_norm_stream` (q|k|v / gate|up).
//!
//! - The epilogue: `s` must equal `resid + forward(x)` bit for bit (the same GEMV, the same
//!   BF16 add), and the sums of squares must add up to Σ s² per token within the f32
//!   summation bound (N terms, all positive: N·2⁻²⁴ relative).
//! - The prologue: the producer's x is zero, so s = resid, multiples of 1/4 in [-2, 2]:
//!   each s² is a multiple of 1/16 at most 4 and every partial sum of up to 4096 of them is
//!   exact in f32 in any order, so the normalized row is the CPU norm's `h` bit for bit and
//!   the output is checked against the FP64 product `h · Wᵀ · gs` with the GEMV's derived
//!   bound (`gemv_gpu_common::check`). A second call must give the same bits.
//! - Shapes: the Llama-3.1-8B o → q|k|v and down's K (4096: one and two tokens fused, three
//!   not), SmolLM2's o → gate|up with silu (K = 576: up to 8 tokens), and an awkward
//!   producer [1024, 320] (5 chunks of 64) feeding a [272, 1024] silu layer (up to 7
//!   tokens); where the prologue does not serve M the stream falls back to the norm kernel
//!   with the same values.
#![cfg(feature = "cuda")]

mod gemv_gpu_common;

use candle_core::{DType, Device, Module, Tensor};
use candle_fp4::gemv::packed::sums_max_m;
use candle_fp4::norm::AddRmsNorm;
use candle_fp4::nvfp4::dequantize_rows;
use candle_fp4::quant_linear::{QuantLinear, ResidualStream};
use gemv_gpu_common::{abs_dot, bits, check, gpu, layer, quarters, test_tables, R};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// The awkward shapes, given table entries so the layers plan the packed GEMV (the 8B and
/// SmolLM2 shapes are in the shipped table).
const TABLE_EXTRA: &[(usize, usize, bool)] = &[(1024, 320, false), (272, 1024, true)];

fn packed(n: usize, k: usize, rng: &mut StdRng) -> R<(QuantLinear, Tensor, f32)> {
    let dev = gpu();
    let l = layer(n, k, rng)?;
    let ql = QuantLinear::from_nvfp4_parts(
        l.codes.to_device(&dev)?,
        l.scales.to_device(&dev)?,
        l.gs,
        None,
    )?;
    Ok((ql, dequantize_rows(&l.codes, &l.scales)?, l.gs))
}

/// Producer `[hidden, k_in]` feeding a consumer `[n2, hidden]` (`silu`: gate|up).
fn run(hidden: usize, k_in: usize, n2: usize, silu: bool, seed: u64) -> R<()> {
    test_tables(TABLE_EXTRA);
    let dev = gpu();
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut prod, _, _) = packed(hidden, k_in, &mut rng)?;
    let (cons, deq, gs) = packed(n2, hidden, &mut rng)?;
    prod.set_residual_sums(true);
    let wv: Vec<f32> = (0..hidden).map(|_| rng.random_range(0.5f32..1.5)).collect();
    let w = Tensor::from_vec(wv, hidden, &Device::Cpu)?.to_dtype(DType::BF16)?;
    let (norm_cpu, norm_gpu) = (
        AddRmsNorm::new(&w, 1e-5)?,
        AddRmsNorm::new(&w.to_device(&dev)?, 1e-5)?,
    );
    let max_m = sums_max_m(hidden);
    for m in [1usize, 2, 3, max_m, max_m + 1] {
        let what = format!("[{hidden}, {k_in}] -> [{n2}, {hidden}] silu {silu} m {m}");
        let (writes, _) = prod.fuses_residual(m, false);
        let (_, takes) = cons.fuses_residual(m, silu);
        assert_eq!(writes, m <= max_m, "{what}: which M the producer adds for");
        assert_eq!(takes, m <= max_m, "{what}: which M the prologue serves");
        if !writes {
            // Past the prologue's tokens the stream keeps the delta (the norm kernel adds).
            let x = quarters(m, k_in, &mut rng)?.to_device(&dev)?;
            let resid = quarters(m, hidden, &mut rng)?.to_device(&dev)?;
            let r = prod.forward_residual(&x, &resid, None)?;
            assert!(r.sums.is_none(), "{what}: sums past the prologue's tokens");
            assert_eq!(bits(r.delta.as_ref().unwrap())?, bits(&prod.forward(&x)?)?);
            continue;
        }
        // The epilogue, random x: s bit for bit, the sums within the f32 bound.
        let x = quarters(m, k_in, &mut rng)?.to_device(&dev)?;
        let resid = quarters(m, hidden, &mut rng)?.to_device(&dev)?;
        let r = prod.forward_residual(&x, &resid, None)?;
        let Some(sums) = &r.sums else {
            panic!("{what}: no sums")
        };
        assert!(r.delta.is_none());
        let want = (&resid + prod.forward(&x)?)?;
        assert_eq!(bits(&r.x)?, bits(&want)?, "{what}: resid + y");
        let sv = sums.to_vec()?;
        let parts = sums.parts();
        assert_eq!(
            (sums.tokens(), sv.len()),
            (m, m * parts),
            "{what}: sums shape"
        );
        let s64 =
            r.x.to_dtype(DType::F64)?
                .to_device(&Device::Cpu)?
                .to_vec2::<f64>()?;
        for t in 0..m {
            let exact: f64 = s64[t].iter().map(|v| v * v).sum();
            let got: f64 = sv[t * parts..(t + 1) * parts]
                .iter()
                .map(|&v| f64::from(v))
                .sum();
            let tol = exact * hidden as f64 * 2f64.powi(-24);
            assert!(
                (got - exact).abs() <= tol,
                "{what}: token {t}: Σ s² {got} vs {exact}"
            );
        }
        // The prologue, x = 0: s = resid, the norm exact (module docs).
        let zero = Tensor::zeros((m, k_in), DType::BF16, &dev)?;
        let r = prod.forward_residual(&zero, &resid, None)?;
        assert_eq!(bits(&r.x)?, bits(&resid)?, "{what}: resid + 0");
        let (s, y) = cons.forward_add_norm_stream(&r, &norm_gpu, silu)?;
        assert_eq!(bits(&s)?, bits(&resid)?, "{what}: the stream passes on");
        let (_, h) = norm_cpu.forward(&resid.to_device(&Device::Cpu)?, None)?;
        let pre = (h
            .to_dtype(DType::F64)?
            .matmul(&deq.to_dtype(DType::F64)?.t()?)?
            * gs as f64)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        let absd = abs_dot(&h.to_device(&dev)?, &deq.to_device(&dev)?, gs)?;
        check(&what, &y, &pre, &absd, hidden, silu, false)?;
        let (_, again) = cons.forward_add_norm_stream(&r, &norm_gpu, silu)?;
        assert_eq!(bits(&again)?, bits(&y)?, "{what}: a second call differs");
        // A stream with both a delta and sums is a caller's error, not a silent choice.
        let both = ResidualStream {
            delta: Some(resid.clone()),
            ..r.clone()
        };
        assert!(cons
            .forward_add_norm_stream(&both, &norm_gpu, silu)
            .is_err());
        // The same stream as a delta (resid + 0) gives the same s and, through the norm
        // kernel, the same exact h: the output within the same bound.
        let no_delta = Tensor::zeros((m, hidden), DType::BF16, &dev)?;
        let d = ResidualStream::with_delta(resid.clone(), no_delta);
        let (s2, y2) = cons.forward_add_norm_stream(&d, &norm_gpu, silu)?;
        assert_eq!(bits(&s2)?, bits(&resid)?, "{what}: the delta form's sum");
        check(
            &format!("{what} (delta form)"),
            &y2,
            &pre,
            &absd,
            hidden,
            silu,
            false,
        )?;
    }
    Ok(())
}

#[test]
fn llama8b_shapes() -> R<()> {
    run(4096, 4096, 6144, false, 1)?;
    run(4096, 14336, 28672, true, 2)
}

#[test]
fn smollm2_shapes() -> R<()> {
    run(576, 576, 3072, true, 3)
}

#[test]
fn awkward_shapes() -> R<()> {
    run(1024, 320, 2 * 136, true, 4)
}

/// With the knob off (the default) the stream carries the delta and no sums.
#[test]
fn off_by_default() -> R<()> {
    test_tables(TABLE_EXTRA);
    let dev = gpu();
    let mut rng = StdRng::seed_from_u64(5);
    let (prod, _, _) = packed(576, 576, &mut rng)?;
    assert!(!prod.fuses_residual(1, false).0);
    let x = quarters(1, 576, &mut rng)?.to_device(&dev)?;
    let resid = quarters(1, 576, &mut rng)?.to_device(&dev)?;
    let r = prod.forward_residual(&x, &resid, None)?;
    assert!(r.sums.is_none());
    assert_eq!(bits(&r.x)?, bits(&resid)?);
    assert_eq!(bits(r.delta.as_ref().unwrap())?, bits(&prod.forward(&x)?)?);
    Ok(())
}
