//! The decode step's fused residual add + RMSNorm and greedy tail on the GPU against their
//! CPU references (feature `cuda`, needs an NVIDIA GPU). Seeded inputs.
//!
//! * `AddRmsNorm`: the sum `x + delta` is one BF16 rounding of an exact sum on both sides,
//!   so it must agree bit for bit. The norm performs the same IEEE operations in the same
//!   order except the f32 sum of squares (a tree on the GPU, sequential on the CPU): that
//!   can move `m = bf16(sqrt(mean + eps))` by one BF16 ulp in rare rows, which moves
//!   `bf16(s / m)` by at most one ulp and then the product with the weight by at most one
//!   more. Bound: every output within 2 BF16 ulps of the CPU's (2⁻⁷ relative at the larger
//!   magnitude), and at least 90 % of the rows bit-identical (a flip needs the two sums to
//!   straddle a rounding boundary of m, ~1e-3 of rows at these lengths).
//! * `GreedyStep`: a maximum and its index do not depend on the reduction order, so the ids
//!   must agree exactly, ties (planted across CTA boundaries) included; the positions
//!   advance by one per call; repeated calls check that the kernel leaves its scratch zeroed.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Result, Tensor};
use candle_fp4::greedy::GreedyStep;
use candle_fp4::norm::AddRmsNorm;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn uniform(rng: &mut StdRng, shape: &[usize], lo: f32, hi: f32, dt: DType) -> Result<Tensor> {
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(lo..hi)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dt)
}

fn bf16_bits(t: &Tensor) -> Result<Vec<half::bf16>> {
    t.to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<half::bf16>()
}

#[test]
fn add_rms_norm_gpu_matches_cpu() -> Result<()> {
    let gpu = Device::new_cuda(0)?;
    let mut rng = StdRng::seed_from_u64(21);
    for (rows, n) in [(1usize, 576usize), (32, 4096), (7, 8192), (3, 577), (5, 1)] {
        let x = uniform(&mut rng, &[rows, n], -4.0, 4.0, DType::BF16)?;
        let d = uniform(&mut rng, &[rows, n], -1.0, 1.0, DType::BF16)?;
        let w = uniform(&mut rng, &[n], 0.25, 2.0, DType::BF16)?;
        let cpu = AddRmsNorm::new(&w, 1e-5)?;
        let op = AddRmsNorm::new(&w.to_device(&gpu)?, 1e-5)?;
        let (xg, dg) = (x.to_device(&gpu)?, d.to_device(&gpu)?);
        for with_delta in [true, false] {
            let (cs, co) = cpu.forward(&x, with_delta.then_some(&d))?;
            // Poison: a fresh output buffer each call, so stale values cannot pass.
            let (gs, go) = op.forward(&xg, with_delta.then_some(&dg))?;
            assert_eq!(bf16_bits(&cs)?, bf16_bits(&gs)?, "sum, {rows}x{n}");
            let (a, b) = (bf16_bits(&co)?, bf16_bits(&go)?);
            let mut identical_rows = 0;
            for (r, (ra, rb)) in a.chunks(n).zip(b.chunks(n)).enumerate() {
                if ra == rb {
                    identical_rows += 1;
                    continue;
                }
                for (i, (p, q)) in ra.iter().zip(rb).enumerate() {
                    let (p, q) = (p.to_f32(), q.to_f32());
                    let tol = 2.0 * p.abs().max(q.abs()) / 128.0;
                    assert!((p - q).abs() <= tol, "{rows}x{n} row {r} [{i}]: {p} vs {q}");
                }
            }
            assert!(
                identical_rows * 10 >= rows * 9,
                "{rows}x{n}: only {identical_rows} of {rows} rows bit-identical"
            );
        }
        // Mixed devices are an error.
        assert!(op.forward(&x, None).is_err());
    }
    Ok(())
}

#[test]
fn greedy_gpu_matches_cpu() -> Result<()> {
    let gpu = Device::new_cuda(0)?;
    let mut rng = StdRng::seed_from_u64(5);
    for (rows, vocab) in [(1usize, 128_256usize), (3, 49_153), (32, 4096), (2, 1)] {
        for dt in [DType::BF16, DType::F32] {
            let cpu = GreedyStep::new(rows, vocab, &Device::Cpu)?;
            let op = GreedyStep::new(rows, vocab, &gpu)?;
            let st_c =
                Tensor::new(vec![0u32; 2 * rows].as_slice(), &Device::Cpu)?.reshape((2, rows))?;
            let st_g = st_c.to_device(&gpu)?;
            for call in 0..3 {
                let mut v = uniform(&mut rng, &[rows, vocab], -8.0, 8.0, DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                // Row r: a tie of the maximum across a CTA boundary (4096 logits per CTA)
                // on even calls, a NaN at the front on odd ones.
                for r in 0..rows {
                    let row = &mut v[r * vocab..(r + 1) * vocab];
                    if call % 2 == 0 && vocab > 4097 {
                        let (i, j) = (4095 - r % 7, vocab - 1 - r);
                        row[i] = 20.0;
                        row[j] = 20.0;
                    } else {
                        row[0] = f32::NAN;
                    }
                }
                let l = Tensor::from_vec(v, (rows, vocab), &Device::Cpu)?.to_dtype(dt)?;
                cpu.apply(&st_c, &l)?;
                op.apply(&st_g, &l.to_device(&gpu)?)?;
                let (a, b) = (
                    st_c.to_vec2::<u32>()?,
                    st_g.to_device(&Device::Cpu)?.to_vec2::<u32>()?,
                );
                assert_eq!(a, b, "{rows}x{vocab} {dt:?} call {call}");
                assert_eq!(
                    a[1],
                    vec![call + 1; rows],
                    "positions advance once per call"
                );
            }
        }
    }
    Ok(())
}
