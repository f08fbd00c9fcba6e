//! GPU GEMV benchmark (feature `cuda`): the packed NVFP4 GEMV (what `QuantLinear` runs on
//! a GPU) and the BF16 GEMV vs candle's BF16 matmul (cuBLAS on a resident BF16 weight) on
//! the same logical shapes, in the same run (the tuned table comes from the `tune` binary of
//! the models crate, which owns the rule).
//!
//! * GPU time: CUDA events around CUDA-graph replays of R calls that rotate among weight
//!   sets larger than L2 together (≥ 256 MiB); median over replays.
//! * Host time: wall time per eager call through candle's dispatch (R calls, one sync).
//! * GB/s = (weight + scales + x + out bytes) / GPU time, and its share of the
//!   device-to-device copy bandwidth measured first in the same run.
//! * A chain of dependent 4096×4096 NVFP4 GEMVs (each output is the next input) with
//!   PDL on and off.
//! * `CFP4_BENCH_OLD_SWEEP=1`: the cluster-split sweep of the ModelOpt-layout kernel.
//!
//! Run: `cargo bench --features cuda --bench gemv_cuda` (or the built binary with
//! `--bench`); `CFP4_BENCH_QUICK=1` runs fewer shapes. Prints the summary table last.

use candle_core::{DType, Device, Tensor};
use candle_fp4::gemv::{
    bf16_gemv_with, nvfp4_gemv_with, packed_nvfp4_gemv_planned, GemvKnobs, PackedNvfp4,
};
use candle_fp4::nvfp4::swizzled_shape;
use std::time::Instant;

type R<T> = candle_core::Result<T>;

/// Median GPU milliseconds per call of `f` (called `calls` times per graph replay).
fn gpu_time(dev: &Device, calls: usize, replays: usize, f: impl FnMut(usize) -> R<()>) -> R<f64> {
    candle_fp4::timing::graph_ms_per_call(dev, calls, 8, replays, f)
}

/// Wall microseconds per eager call (host dispatch included).
fn wall_time(dev: &Device, calls: usize, mut f: impl FnMut(usize) -> R<()>) -> R<f64> {
    for i in 0..calls.min(8) {
        f(i)?;
    }
    dev.synchronize()?;
    let t = Instant::now();
    for i in 0..calls {
        f(i)?;
    }
    dev.synchronize()?;
    Ok(t.elapsed().as_secs_f64() * 1e6 / calls as f64)
}

/// Device-to-device copy bandwidth, GB/s (read + written).
fn copy_bandwidth(dev: &Device) -> R<f64> {
    Ok(candle_fp4::timing::copy_bandwidth(dev)? / 1e9)
}

struct Row {
    shape: String,
    m: usize,
    fp4_us: f64,
    fp4_gbs: f64,
    fp4_pct: f64,
    bf16_us: f64,
    bf16_pct: f64,
    mm_us: f64,
    /// NVFP4's own matmul path: dequantize (packed → BF16) + cuBLAS, what `QuantLinear`
    /// runs where the table says matmul.
    dqmm_us: f64,
    fp4_vs_mm: f64,
    bf16_vs_mm: f64,
    fp4_wall: f64,
    mm_wall: f64,
}

fn main() -> R<()> {
    let dev = Device::new_cuda(0)?;
    let quick = std::env::var("CFP4_BENCH_QUICK").is_ok();
    if std::env::var("CFP4_BENCH_PROBE").is_ok() {
        // One shape, eager, for profilers (ncu): 28672x4096 silu, M = 1.
        let (n, k) = (28672, 4096);
        let (np, sp) = swizzled_shape(n, k / 16);
        let c = Tensor::rand(0f32, 255.99, (n, k / 2), &dev)?.to_dtype(DType::U8)?;
        let s = Tensor::rand(40f32, 72.0, (np, sp), &dev)?.to_dtype(DType::U8)?;
        let x = Tensor::randn(0f32, 1.0, (1, k), &dev)?.to_dtype(DType::BF16)?;
        for _ in 0..5 {
            nvfp4_gemv_with(&x, &c, &s, 0.01, true, &GemvKnobs::default())?;
            let w = Tensor::randn(0f32, 0.02, (n, k), &dev)?.to_dtype(DType::BF16)?;
            bf16_gemv_with(&x, &w, true, &GemvKnobs::default())?;
        }
        dev.synchronize()?;
        return Ok(());
    }
    let copy = copy_bandwidth(&dev)?;
    println!("device-to-device copy: {copy:.0} GB/s (read + write)");
    let shapes: Vec<(usize, usize, bool)> = if quick {
        vec![(4096, 4096, false), (28672, 4096, true)]
    } else {
        vec![
            (576, 576, false),
            (1536, 576, true),
            // SmolLM2-135M as the model port fuses it: q|k|v, gate|up, down, lm_head.
            (960, 576, false),
            (3072, 576, true),
            (576, 1536, false),
            (49152, 576, false),
            (4096, 4096, false),
            (6144, 4096, false),
            (28672, 4096, true),
            (4096, 14336, false),
            (128256, 4096, false),
            // Llama-3.1-70B: q|k|v, o, gate|up, down, and their tensor-parallel-2 shards.
            (10240, 8192, false),
            (8192, 8192, false),
            (57344, 8192, true),
            (8192, 28672, false),
            (5120, 8192, false),
            (8192, 4096, false),
            (28672, 8192, true),
            (8192, 14336, false),
        ]
    };
    let ms_list = [1usize, 2, 4, 8, 16, 32];
    let mut rows = Vec::new();
    for &(n, k, silu) in &shapes {
        let (np, sp) = swizzled_shape(n, k / 16);
        let fp4_bytes = n * k / 2 + np * sp;
        let bf16_bytes = n * k * 2;
        let sets_fp4 = (256usize << 20).div_ceil(fp4_bytes).clamp(2, 64);
        let sets_bf16 = (256usize << 20).div_ceil(bf16_bytes).clamp(2, 16);
        let mut packed = Vec::new();
        for _ in 0..sets_fp4 {
            let c = Tensor::rand(0f32, 255.99, (n, k / 2), &dev)?.to_dtype(DType::U8)?;
            let s = Tensor::rand(40f32, 72.0, (np, sp), &dev)?.to_dtype(DType::U8)?;
            packed.push(PackedNvfp4::pack(&c, &s, 0.01)?);
        }
        let mut wb = Vec::new();
        for _ in 0..sets_bf16 {
            wb.push(Tensor::randn(0f32, 0.02, (n, k), &dev)?.to_dtype(DType::BF16)?);
        }
        for &m in &ms_list {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?.to_dtype(DType::BF16)?;
            let opts = GemvKnobs::with_pdl(true);
            let calls_fp4 = (sets_fp4 * 4).max(32);
            let calls_bf16 = (sets_bf16 * 4).max(32);
            // One plan serves every set: it holds the layout and geometry, not the weight.
            let plan = packed[0].plan(silu, m, true)?;
            let fp4 =
                |i: usize| packed_nvfp4_gemv_planned(&x, &packed[i % sets_fp4], &plan).map(|_| ());
            let bf = |i: usize| bf16_gemv_with(&x, &wb[i % sets_bf16], silu, &opts).map(|_| ());
            let mm = |i: usize| x.matmul(&wb[i % sets_bf16].t()?).map(|_| ());
            let dqmm = |i: usize| {
                let w = packed[i % sets_fp4].dequantize_bf16()?;
                x.matmul(&w.t()?).map(|_| ())
            };
            let fp4_ms = gpu_time(&dev, calls_fp4, 15, fp4)?;
            let bf16_ms = gpu_time(&dev, calls_bf16, 15, bf)?;
            let mm_ms = gpu_time(&dev, calls_bf16, 15, mm)?;
            let dqmm_ms = gpu_time(&dev, calls_fp4.min(64), 9, dqmm)?;
            let fp4_wall = wall_time(&dev, 200, fp4)?;
            let mm_wall = wall_time(&dev, 200, mm)?;
            let n_out = if silu { n / 2 } else { n };
            let io = m * k * 2 + m * n_out * 2;
            let fp4_gbs = (fp4_bytes + io) as f64 / (fp4_ms * 1e-3) / 1e9;
            let bf16_gbs = (bf16_bytes + io) as f64 / (bf16_ms * 1e-3) / 1e9;
            let row = Row {
                shape: format!("{n}x{k}{}", if silu { " silu" } else { "" }),
                m,
                fp4_us: fp4_ms * 1e3,
                fp4_gbs,
                fp4_pct: 100.0 * fp4_gbs / copy,
                bf16_us: bf16_ms * 1e3,
                bf16_pct: 100.0 * bf16_gbs / copy,
                mm_us: mm_ms * 1e3,
                dqmm_us: dqmm_ms * 1e3,
                fp4_vs_mm: mm_ms / fp4_ms,
                bf16_vs_mm: mm_ms / bf16_ms,
                fp4_wall,
                mm_wall,
            };
            println!(
                "{:>16} m={:>2}: fp4 {:>7.2} us {:>6.0} GB/s ({:>3.0}%)  bf16 {:>7.2} us ({:>3.0}%)  matmul {:>7.2} us  fp4 x{:.2} bf16 x{:.2}  wall fp4 {:.1} us matmul {:.1} us",
                row.shape, m, row.fp4_us, row.fp4_gbs, row.fp4_pct, row.bf16_us, row.bf16_pct, row.mm_us, row.fp4_vs_mm, row.bf16_vs_mm, fp4_wall, mm_wall
            );
            rows.push(row);
        }
    }
    // Variant sweep of the ModelOpt-layout kernel: cluster split, a few shapes.
    let mut sweep = Vec::new();
    let old_sweep: &[(usize, usize, bool)] = if std::env::var("CFP4_BENCH_OLD_SWEEP").is_ok() {
        &[
            (4096, 4096, false),
            (28672, 4096, true),
            (128256, 4096, false),
        ]
    } else {
        &[]
    };
    for &(n, k, silu) in old_sweep {
        let (np, sp) = swizzled_shape(n, k / 16);
        let fp4_bytes = n * k / 2 + np * sp;
        let sets = (256usize << 20).div_ceil(fp4_bytes).clamp(2, 64);
        let codes: Vec<Tensor> = (0..sets)
            .map(|_| Tensor::rand(0f32, 255.99, (n, k / 2), &dev)?.to_dtype(DType::U8))
            .collect::<R<_>>()?;
        let scales: Vec<Tensor> = (0..sets)
            .map(|_| Tensor::rand(40f32, 72.0, (np, sp), &dev)?.to_dtype(DType::U8))
            .collect::<R<_>>()?;
        for m in [1usize, 8] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?.to_dtype(DType::BF16)?;
            for split in [1usize, 2, 4] {
                let o = GemvKnobs {
                    pdl: true,
                    split: Some(split),
                    ..Default::default()
                };
                let f = |i: usize| {
                    nvfp4_gemv_with(&x, &codes[i % sets], &scales[i % sets], 0.01, silu, &o)
                        .map(|_| ())
                };
                match gpu_time(&dev, (sets * 4).max(32), 9, f) {
                    Ok(ms) => sweep.push(format!(
                        "{n}x{k} m={m} split={split}: {:.2} us ({:.0} GB/s)",
                        ms * 1e3,
                        fp4_bytes as f64 / (ms * 1e-3) / 1e9
                    )),
                    Err(e) => sweep.push(format!("{n}x{k} m={m} split={split}: {e}")),
                }
            }
        }
    }
    for l in &sweep {
        println!("sweep {l}");
    }

    // Dependent chain with PDL on/off: y_{i+1} = gemv(y_i), 4096×4096, M = 1.
    let (n, k) = (4096, 4096);
    let (np, sp) = swizzled_shape(n, k / 16);
    let sets = 32;
    let packed: Vec<PackedNvfp4> = (0..sets)
        .map(|_| {
            let c = Tensor::rand(0f32, 255.99, (n, k / 2), &dev)?.to_dtype(DType::U8)?;
            let s = Tensor::rand(40f32, 72.0, (np, sp), &dev)?.to_dtype(DType::U8)?;
            PackedNvfp4::pack(&c, &s, 1e-3)
        })
        .collect::<R<_>>()?;
    let x0 = Tensor::randn(0f32, 1.0, (1, k), &dev)?.to_dtype(DType::BF16)?;
    let mut chain = Vec::new();
    for pdl in [false, true] {
        let plan = packed[0].plan(false, 1, pdl)?;
        let ms = gpu_time(&dev, 1, 15, |_| {
            let mut y = x0.clone();
            for i in 0..128 {
                y = packed_nvfp4_gemv_planned(&y, &packed[i % sets], &plan)?;
            }
            Ok(())
        })?;
        chain.push((pdl, ms * 1e3 / 128.0));
    }

    println!("\n| shape | M | NVFP4 µs | NVFP4 GB/s | % copy | BF16 GEMV µs | % copy | matmul µs | dequant+matmul µs | NVFP4 vs matmul | BF16 vs matmul | wall NVFP4 µs | wall matmul µs |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {:.2} | {:.0} | {:.0}% | {:.2} | {:.0}% | {:.2} | {:.2} | {:.2}x | {:.2}x | {:.1} | {:.1} |",
            r.shape, r.m, r.fp4_us, r.fp4_gbs, r.fp4_pct, r.bf16_us, r.bf16_pct, r.mm_us, r.dqmm_us, r.fp4_vs_mm, r.bf16_vs_mm, r.fp4_wall, r.mm_wall
        );
    }
    for (pdl, us) in chain {
        println!("chain 4096x4096 NVFP4 M=1, pdl={pdl}: {us:.2} us per GEMV");
    }
    println!("copy bandwidth {copy:.0} GB/s");
    Ok(())
}
