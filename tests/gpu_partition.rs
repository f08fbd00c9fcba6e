//! GPU test of `candle_fp4::partition` (feature `cuda`, needs an NVIDIA GPU): `plan_for`
//! refuses 0 SMs and more than the device has; the blocker holds a quarter of the SMs, one
//! CTA on each of distinct SMs with no other CTA beside it (`SmBlocker::hold` probes that
//! itself); a BF16 GEMV planned for the SMs left, its kernels loaded before the hold, runs
//! beside the blocker and matches the FP64 product within the bound of `gpu_gemv_bf16.rs`;
//! at the release every blocker CTA leaves by the release word, none by its time limit.
#![cfg(feature = "cuda")]

mod gemv_gpu_common;

use candle_core::{DType, Tensor};
use candle_fp4::gemv::{bf16_gemv_planned_packed, plan_bf16_gemv_with, GemvKnobs};
use candle_fp4::partition::{device_sms, plan_for, SmBlocker};
use gemv_gpu_common::{abs_dot, bf16_weight, check, fp64_reference, gpu, rand_x, R};
use rand::{rngs::StdRng, SeedableRng};
use std::time::Duration;

#[test]
fn a_gemv_planned_for_the_sms_left_runs_beside_the_blocker() -> R<()> {
    let dev = gpu();
    let total = device_sms(&dev)?;
    assert!(plan_for(&dev, 0, None).is_err(), "0 SMs accepted");
    assert!(
        plan_for(&dev, total + 1, None).is_err(),
        "too many SMs accepted"
    );
    let held = total / 4;
    plan_for(&dev, total - held, None)?;

    // Rows past the last whole tile; one token.
    let (n, k) = (4096 + 40, 4096);
    let mut rng = StdRng::seed_from_u64(11);
    let w = bf16_weight(n, k, &mut rng)?;
    let x = rand_x(1, k, &mut rng)?;
    let (wg, xg) = (w.to_device(&dev)?, x.to_device(&dev)?);
    let pre = fp64_reference(&x, &w)?;
    let absd = abs_dot(&xg, &wg, 1.0)?;
    let plan = plan_bf16_gemv_with(&wg, false, &GemvKnobs::with_pdl(false))?
        .expect("the BF16 kernels serve this shape");
    // Everything the held section runs, once before the blocker: a kernel loaded for the
    // first time beside it (lazy module loading) would wait for its time limit.
    drop(Tensor::full(f32::NAN, (1, n), &dev)?.to_dtype(DType::BF16)?);
    bf16_gemv_planned_packed(&xg, &wg, &plan)?;
    dev.synchronize()?;

    let b = SmBlocker::hold(&dev, held, Duration::from_secs(60))?;
    let r = b.report();
    assert!(r.holds(held), "the blocker does not hold {held} SMs: {r:?}");
    // Poison: a NaN buffer of the output's size freed just before the call.
    drop(Tensor::full(f32::NAN, (1, n), &dev)?.to_dtype(DType::BF16)?);
    let y = bf16_gemv_planned_packed(&xg, &wg, &plan)?;
    dev.synchronize()?;
    let r = b.release()?;
    assert_eq!(
        (r.released, r.timed_out),
        (held, 0),
        "blocker at its release: {r:?}"
    );
    plan_for(&dev, total, None)?;
    check(
        &format!("bf16 {n}x{k} on {} SMs", total - held),
        &y,
        &pre,
        &absd,
        k,
        false,
        false,
    )
}
