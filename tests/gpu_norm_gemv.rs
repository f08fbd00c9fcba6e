//! The packed NVFP4 GEMV with the RMSNorm in its prologue (`QuantLinear::forward_add_norm`
//! on a GPU: one kernel) against the CPU reference (feature `cuda`, needs an NVIDIA GPU).
//!
//! Inputs are chosen so that the norm is exact on both sides whatever the order of its sum
//! of squares: x and delta are multiples of 1/4 in [-2, 2], so s = x + delta is an exact
//! BF16 multiple of 1/4 in [-4, 4], each s² a multiple of 1/16 at most 16, and every partial
//! sum of up to 1024 of them (≤ 2^14, step 2^-4: 18 bits) is exact in f32. Then the sum
//! `s` must equal the CPU's bit for bit, the normalized row `h` is the CPU's `h`, and the
//! output is checked against the FP64 product `h · Wᵀ · gs` with the GEMV's derived bound
//! (`gemv_gpu_common::check`: FP32 sums in another order, one BF16 rounding). Shapes reach
//! odd row tiles, an odd number of 64-wide K chunks, the silu epilogue, M = 1, 3, 8, with
//! and without a delta, and K at the prologue's limit (1024); a second call must give the same
//! bits (split-K counters reset), and the fused path must be the one taken.
#![cfg(feature = "cuda")]

mod gemv_gpu_common;

use candle_core::{DType, Device, Tensor};
use candle_fp4::norm::AddRmsNorm;
use candle_fp4::nvfp4::dequantize_rows;
use candle_fp4::quant_linear::QuantLinear;
use gemv_gpu_common::{abs_dot, bits, check, gpu, layer, quarters, test_tables, R};

/// The test's untuned shapes, given table entries so the layer plans the packed GEMV.
const TABLE_EXTRA: &[(usize, usize, bool)] = &[
    (200, 320, false),
    (272, 1024, true),
    (64, 4096, false),
    (64, 8192, false),
    (14336, 8192, true),
];
use rand::{rngs::StdRng, Rng, SeedableRng};

fn run(n: usize, k: usize, silu: bool, seed: u64) -> R<()> {
    test_tables(TABLE_EXTRA);
    let dev = gpu();
    let mut rng = StdRng::seed_from_u64(seed);
    let l = layer(n, k, &mut rng)?;
    let ql = QuantLinear::from_nvfp4_parts(
        l.codes.to_device(&dev)?,
        l.scales.to_device(&dev)?,
        l.gs,
        None,
    )?;
    let wv: Vec<f32> = (0..k).map(|_| rng.random_range(0.5f32..1.5)).collect();
    let w = Tensor::from_vec(wv, k, &Device::Cpu)?.to_dtype(DType::BF16)?;
    let (norm_cpu, norm_gpu) = (
        AddRmsNorm::new(&w, 1e-5)?,
        AddRmsNorm::new(&w.to_device(&dev)?, 1e-5)?,
    );
    let deq = dequantize_rows(&l.codes, &l.scales)?;
    let deq_gpu = deq.to_device(&dev)?;
    for m in [1usize, 3, 8] {
        assert!(
            ql.fuses_norm(m, silu),
            "{n}x{k} m={m} silu={silu}: not fused"
        );
        let x = quarters(m, k, &mut rng)?;
        let d = quarters(m, k, &mut rng)?;
        let (xg, dg) = (x.to_device(&dev)?, d.to_device(&dev)?);
        for with_delta in [true, false] {
            let what = format!("norm gemv {n}x{k} m={m} silu={silu} delta={with_delta}");
            let (cs, ch) = norm_cpu.forward(&x, with_delta.then_some(&d))?;
            drop(Tensor::full(f32::NAN, (2 * m, n + k), &dev)?.to_dtype(DType::BF16)?);
            let (gs, y) = ql.forward_add_norm(&xg, with_delta.then_some(&dg), &norm_gpu, silu)?;
            assert_eq!(bits(&gs)?, bits(&cs)?, "{what}: x + delta");
            let pre = (ch
                .to_dtype(DType::F64)?
                .matmul(&deq.to_dtype(DType::F64)?.t()?)?
                * l.gs as f64)?
                .to_dtype(DType::F32)?
                .to_vec2::<f32>()?;
            let absd = abs_dot(&ch.to_device(&dev)?, &deq_gpu, l.gs)?;
            check(&what, &y, &pre, &absd, k, silu, false)?;
            let (_, again) =
                ql.forward_add_norm(&xg, with_delta.then_some(&dg), &norm_gpu, silu)?;
            assert_eq!(bits(&again)?, bits(&y)?, "{what}: a second call differs");
        }
    }
    // Past one token tile the layer runs the norm, then the GEMV: same values.
    assert!(!ql.fuses_norm(9, silu));
    Ok(())
}

#[test]
fn smollm2_shapes() -> R<()> {
    run(960, 576, false, 1)?;
    run(3072, 576, true, 2)
}

#[test]
fn awkward_shapes() -> R<()> {
    run(200, 320, false, 4)?; // 13 row tiles, the last partial; K = 5 chunks of 64
    run(2 * 136, 1024, true, 5) // halves of 136 rows; K at the prologue's limit
}

#[test]
fn wide_k_is_not_fused() -> R<()> {
    test_tables(TABLE_EXTRA);
    let dev = gpu();
    let mut rng = StdRng::seed_from_u64(6);
    let l = layer(64, 4096, &mut rng)?;
    let ql = QuantLinear::from_nvfp4_parts(
        l.codes.to_device(&dev)?,
        l.scales.to_device(&dev)?,
        l.gs,
        None,
    )?;
    assert!(!ql.fuses_norm(1, false));
    // It still gives the composition's values (the norm kernel, then the GEMV).
    let x = quarters(2, 4096, &mut rng)?.to_device(&dev)?;
    let w = Tensor::ones(4096, DType::BF16, &dev)?;
    let norm = AddRmsNorm::new(&w, 1e-5)?;
    let (s, y) = ql.forward_add_norm(&x, Some(&x), &norm, false)?;
    let (s2, h) = norm.forward(&x, Some(&x))?;
    assert_eq!(bits(&s)?, bits(&s2)?);
    assert_eq!(bits(&y)?, bits(&candle_core::Module::forward(&ql, &h)?)?);
    Ok(())
}

/// Behind a norm kernel (K > 1024) the norm asks L2 for the first of the layer's weights
/// (whole tiles within two fifths of the L2; with silu_mul the gate and the up tiles): a
/// hint that must not change a bit. 8B down (33 MB, more than the budget), a gate|up of
/// 8B size at the 70B's width (14336 × 8192, 58 MB, two runs) and a small layer (all of
/// it), M = 1 and 3, twice each; and the same bits with the prefetch turned off
/// (`set_l2_prefetch`). Every K is wider than 4096, so the planner prefetches on every
/// card (`prefetch_suits`: fast-DRAM devices skip the 8B's 4096-wide layers).
#[test]
fn prefetching_norm_gives_the_composition() -> R<()> {
    test_tables(TABLE_EXTRA);
    let dev = gpu();
    let mut rng = StdRng::seed_from_u64(7);
    for (n, k, silu) in [(64, 8192, false), (4096, 14336, false), (14336, 8192, true)] {
        let l = layer(n, k, &mut rng)?;
        let mut ql = QuantLinear::from_nvfp4_parts(
            l.codes.to_device(&dev)?,
            l.scales.to_device(&dev)?,
            l.gs,
            None,
        )?;
        let w = quarters(1, k, &mut rng)?.reshape(k)?.to_device(&dev)?;
        let norm = AddRmsNorm::new(&w, 1e-5)?;
        for m in [1, 3] {
            assert!(!ql.fuses_norm(m, silu));
            assert!(
                ql.prefetches_weights(m, silu),
                "[{n}, {k}] silu {silu} m {m}"
            );
            let x = quarters(m, k, &mut rng)?.to_device(&dev)?;
            let d = quarters(m, k, &mut rng)?.to_device(&dev)?;
            for _ in 0..2 {
                let (s, y) = ql.forward_add_norm(&x, Some(&d), &norm, silu)?;
                let (s2, h) = norm.forward(&x, Some(&d))?;
                let y2 = if silu {
                    ql.forward_silu_mul(&h)?
                } else {
                    candle_core::Module::forward(&ql, &h)?
                };
                assert_eq!(bits(&s)?, bits(&s2)?, "[{n}, {k}] m {m}: sum");
                assert_eq!(bits(&y)?, bits(&y2)?, "[{n}, {k}] m {m}: output");
            }
        }
        // The knob turns it off (and the values stay).
        ql.set_l2_prefetch(false);
        assert!(!ql.prefetches_weights(1, silu));
        let x = quarters(1, k, &mut rng)?.to_device(&dev)?;
        let (_, y) = ql.forward_add_norm(&x, None, &norm, silu)?;
        ql.set_l2_prefetch(true);
        let (_, y2) = ql.forward_add_norm(&x, None, &norm, silu)?;
        assert_eq!(
            bits(&y)?,
            bits(&y2)?,
            "[{n}, {k}]: with and without the prefetch"
        );
    }
    Ok(())
}
