//! The residual epilogue and the norm on the accumulator that takes what it writes, on a GPU
//! (feature `cuda`, needs an NVIDIA GPU): `QuantLinear::forward_residual` (o_proj /
//! down_proj) and `QuantLinear::forward_add_norm_stream` (q|k|v / gate|up).
//!
//! - The epilogue: `s` must equal `resid + forward(x)` bit for bit (the same GEMV, the same
//!   BF16 add); the sums of squares must add up to Σ s² per token within the f32 summation
//!   bound (N terms, all positive: N·2⁻²⁴ relative); `xw` must be `bf16(s · w)` bit for
//!   bit (the f32 product of two BF16 is exact, then one rounding).
//! - The consumer: its output against the FP64 product `xw · Wᵀ · gs / m` with the GEMV's
//!   derived bound (`gemv_gpu_common::check`: FP32 accumulation of K terms, one BF16
//!   rounding; the f32 division adds 2⁻²⁴ relative, inside it), where `m` is computed from
//!   the kernel's own f32 parts in the kernel's order and rounding (`kernel_m`). A second
//!   call must give the same bits; a stream with both a delta and sums is an error; a norm
//!   other than the one `xw` was made for falls back to the norm kernel, bit for bit.
//! - Which calls are served: the producer where `accumulator_norm_serves(m, its parts)`,
//!   the consumer up to one token tile; past them the stream keeps the delta.
//! - Shapes: the Llama-3.1-8B o → q|k|v and down's K, SmolLM2's o → gate|up with silu
//!   (K = 576), and an awkward producer [1024, 320] (5 chunks of 64) feeding a [272, 1024]
//!   silu layer.
#![cfg(feature = "cuda")]

mod gemv_gpu_common;

use candle_core::{DType, Device, Module, Tensor};
use candle_fp4::gemv::packed::{accumulator_norm_serves, NORM_MAX_M};
use candle_fp4::norm::AddRmsNorm;
use candle_fp4::nvfp4::dequantize_rows;
use candle_fp4::quant_linear::{QuantLinear, ResidualStream};
use gemv_gpu_common::{abs_dot, bits, check, gpu, layer, quarters, test_tables, R};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// The awkward shapes, given table entries so the layers plan the packed GEMV (the 8B and
/// SmolLM2 shapes are in the shipped table).
const TABLE_EXTRA: &[(usize, usize, bool)] = &[(1024, 320, false), (272, 1024, true)];

const EPS: f32 = 1e-5;

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

/// The consumer kernel's `m` for one token's parts (`kernels/gemv_packed.cu`,
/// `pgemv_finish`): f32 sums in its exact order, then the norm kernel's rounding of m.
fn kernel_m(parts: &[f32], k: usize) -> f32 {
    let mut lanes = [0f32; 32];
    for (q, &v) in parts.iter().enumerate() {
        lanes[q % 32] += v;
    }
    for o in [16, 8, 4, 2, 1] {
        let prev = lanes;
        for (i, l) in lanes.iter_mut().enumerate() {
            *l = prev[i] + prev[i ^ o];
        }
    }
    half::bf16::from_f32((lanes[0] / k as f32 + EPS).sqrt()).to_f32()
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
    let norm_gpu = AddRmsNorm::new(&w.to_device(&dev)?, EPS)?;
    let wf = w.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    // The producer's parts (its CTA groups), from a call the rule serves.
    let parts1 = {
        let resid = Tensor::zeros((1, hidden), DType::BF16, &dev)?;
        let x = quarters(1, k_in, &mut rng)?.to_device(&dev)?;
        let r = prod.forward_residual(&x, &resid, Some(&norm_gpu))?;
        r.sums
            .as_ref()
            .map(|s| s.parts())
            .expect("one token is always served")
    };
    for m in [1usize, 2, 3, 4, 5, NORM_MAX_M, NORM_MAX_M + 1] {
        let what = format!("[{hidden}, {k_in}] -> [{n2}, {hidden}] silu {silu} m {m}");
        let (writes, _) = prod.fuses_residual(m, false);
        let (_, takes) = cons.fuses_residual(m, silu);
        let served = accumulator_norm_serves(m, parts1);
        assert_eq!(
            writes, served,
            "{what}: which M the producer adds for ({parts1} parts)"
        );
        assert_eq!(
            takes,
            m <= NORM_MAX_M,
            "{what}: which M the consumer serves"
        );
        let x = quarters(m, k_in, &mut rng)?.to_device(&dev)?;
        let resid = quarters(m, hidden, &mut rng)?.to_device(&dev)?;
        let r = prod.forward_residual(&x, &resid, Some(&norm_gpu))?;
        if !writes {
            // Past the rule the stream keeps the delta (the norm kernel adds).
            assert!(
                r.sums.is_none() && r.xw.is_none(),
                "{what}: sums past the rule"
            );
            assert_eq!(bits(r.delta.as_ref().unwrap())?, bits(&prod.forward(&x)?)?);
            continue;
        }
        // The epilogue: s bit for bit, the sums within the f32 bound, x · w bit for bit.
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
        let s32 =
            r.x.to_dtype(DType::F32)?
                .to_device(&Device::Cpu)?
                .to_vec2::<f32>()?;
        let mut m_tok = Vec::with_capacity(m);
        for t in 0..m {
            let exact: f64 = s32[t].iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            let got: f64 = sv[t * parts..(t + 1) * parts]
                .iter()
                .map(|&v| f64::from(v))
                .sum();
            let tol = exact * hidden as f64 * 2f64.powi(-24);
            assert!(
                (got - exact).abs() <= tol,
                "{what}: token {t}: Σ s² {got} vs {exact}"
            );
            // The kernel's m: the parts summed in its order (lane q adds parts q, q + 32, ...,
            // then an xor-shuffle tree), then bf16(sqrt(Σ / K + eps)) in f32 steps.
            m_tok.push(kernel_m(&sv[t * parts..(t + 1) * parts], hidden));
        }
        let Some((xw, _)) = &r.xw else {
            panic!("{what}: no x · w")
        };
        let xw_want: Vec<u16> = s32
            .iter()
            .flat_map(|row| {
                row.iter()
                    .zip(&wf)
                    .map(|(&a, &b)| half::bf16::from_f32(a * b).to_bits())
            })
            .collect();
        assert_eq!(bits(xw)?, xw_want, "{what}: bf16(s · w)");
        // The consumer: (xw · Wᵀ · gs) / m_tok, one BF16 rounding, FP32 accumulation.
        let (s, y) = cons.forward_add_norm_stream(&r, &norm_gpu, silu)?;
        assert_eq!(bits(&s)?, bits(&r.x)?, "{what}: the stream passes on");
        let xw_cpu = xw.to_device(&Device::Cpu)?;
        let pre = (xw_cpu
            .to_dtype(DType::F64)?
            .matmul(&deq.to_dtype(DType::F64)?.t()?)?
            * gs as f64)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        let absd = abs_dot(xw, &deq.to_device(&dev)?, gs)?;
        let scaled = |v: &[Vec<f32>]| -> Vec<Vec<f32>> {
            v.iter()
                .zip(&m_tok)
                .map(|(row, &mt)| row.iter().map(|&a| a / mt).collect())
                .collect()
        };
        check(
            &what,
            &y,
            &scaled(&pre),
            &scaled(&absd),
            hidden,
            silu,
            false,
        )?;
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
        // x · w of another norm's weight is not taken: the norm kernel reduces s instead.
        let other = AddRmsNorm::new(&(w.to_device(&dev)? * 2.0)?, EPS)?;
        let (_, y_other) = cons.forward_add_norm_stream(&r, &other, silu)?;
        let (_, y_ref) = cons.forward_add_norm(&r.x, None, &other, silu)?;
        assert_eq!(
            bits(&y_other)?,
            bits(&y_ref)?,
            "{what}: another norm's weight"
        );
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
    assert!(r.sums.is_none() && r.xw.is_none());
    assert_eq!(bits(&r.x)?, bits(&resid)?);
    assert_eq!(bits(r.delta.as_ref().unwrap())?, bits(&prod.forward(&x)?)?);
    Ok(())
}
