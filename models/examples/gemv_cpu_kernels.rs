//! The CPU GEMV kernels side by side on SmolLM2's decode shapes: the scalar oracle
//! (`CpuKernel::Scalar`) and every SIMD kernel this CPU runs, for the NVFP4 projections
//! and the BF16 `lm_head`, at M = 1 and M = 8. Prints the median time per call of
//! `reps` calls (run back to back, so both see the same machine load), weights/s, the
//! speed-up and how many outputs differ from the oracle (only the FP32 summation order
//! differs, so a few 1-ulp BF16 flips are expected; `tests/gemv_cpu_simd.rs` checks
//! the bound).
//!
//! ```sh
//! cargo run --release -p candle-fp4-models --example gemv_cpu_kernels [-- --threads 2]
//! ```

use candle_fp4::gemv::{gemv_cpu_with, CpuKernel, WeightRows};
use candle_fp4::nvfp4::{quantize_nvfp4_slice, swizzle_blockscale_bytes, swizzled_shape};
use half::bf16;
use std::time::Instant;

/// Median wall time of `reps` calls, in ms.
fn median_ms(reps: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    f()?;
    let mut ts = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        ts.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ts.sort_by(f64::total_cmp);
    Ok(ts[reps / 2])
}

/// Deterministic pseudo-random values in [-1, 1) (xorshift), no extra dependency.
fn pseudo_random(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--threads") {
        let t: usize = args.get(i + 1).map_or(Ok(1), |v| v.parse())?;
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()?;
    }
    let kernels: Vec<CpuKernel> = CpuKernel::ALL
        .into_iter()
        .filter(|k| k.is_available())
        .collect();
    println!(
        "kernels on this CPU: {kernels:?}; rayon threads: {}",
        rayon::current_num_threads()
    );
    // (name, N, K, NVFP4?, layers per step)
    let shapes = [
        ("q|k|v", 960, 576, true, 30),
        ("o", 576, 576, true, 30),
        ("gate|up", 3072, 576, true, 30),
        ("down", 576, 1536, true, 30),
        ("lm_head", 49152, 576, false, 1),
    ];
    for m in [1usize, 8] {
        let mut step = vec![0f64; kernels.len()];
        for (si, &(name, n, k, nvfp4, layers)) in shapes.iter().enumerate() {
            let w: Vec<f32> = pseudo_random(n * k, 1 + si as u64)
                .iter()
                .map(|v| v * 0.02)
                .collect();
            let q = quantize_nvfp4_slice(&w, n, k, None)?;
            let swz = swizzle_blockscale_bytes(&q.weight_scale, n, k / 16)?;
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let rows = if nvfp4 {
                WeightRows::Nvfp4 {
                    codes: &q.weight,
                    scales: &swz,
                    sp: swizzled_shape(n, k / 16).1,
                }
            } else {
                WeightRows::Bf16 { w: &wb }
            };
            let gs = if nvfp4 { q.global_scale } else { 1.0 };
            let x: Vec<bf16> = pseudo_random(m * k, 99)
                .iter()
                .map(|&v| bf16::from_f32(v))
                .collect();
            let run = |kern| gemv_cpu_with(kern, &x, k, m, k, n, &rows, gs, false);
            let want = run(CpuKernel::Scalar)?;
            let reps = if n * k > 10_000_000 { 20 } else { 100 };
            let mut line = format!("M={m} {name:>8} [{n}x{k}]:");
            let mut base = 0.0;
            for (ki, &kern) in kernels.iter().enumerate() {
                let ms = median_ms(reps, || {
                    std::hint::black_box(run(kern)?);
                    Ok(())
                })?;
                let got = run(kern)?;
                let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
                if ki == 0 {
                    base = ms;
                }
                step[ki] += ms * layers as f64;
                line += &format!(
                    "  {kern:?} {ms:.3} ms ({:.2} G weights/s, {:.1}x, {differ} of {} differ)",
                    (n * k * m) as f64 / ms / 1e6,
                    base / ms,
                    got.len()
                );
            }
            println!("{line}");
        }
        let totals: Vec<String> = kernels
            .iter()
            .zip(&step)
            .map(|(k, t)| format!("{k:?} {t:.1} ms"))
            .collect();
        println!(
            "M={m}: one SmolLM2 step's GEMVs (30 layers + lm_head): {}",
            totals.join(", ")
        );
    }
    Ok(())
}
