//! CPU GEMV vs candle's CPU matmul.
//!
//! For each weight shape `N×K` and token count `M`:
//! * `nvfp4_gemv`: the NVFP4 CPU op (packed codes + swizzled scales, global scale);
//! * `bf16_gemv`: the BF16 CPU op on the dequantized weight;
//! * `matmul_bf16`: `x.matmul(&w.t())` with `x`, `w` BF16 (`w` = the dequantized weight);
//! * `matmul_f32`: the same in F32.
//!
//! Throughput is reported as the bytes of the weight each variant reads per call (NVFP4:
//! `N·K/2` code bytes + the swizzled scales; BF16: `2·N·K`; F32: `4·N·K`), so the
//! numbers are effective weight bandwidths, not comparable speeds; compare the times.
//!
//! Run: `cargo bench --bench gemv_cpu` (results in `target/criterion/`).

use candle_core::{DType, Device, Tensor};
use candle_fp4::gemv::{bf16_gemv, nvfp4_gemv};
use candle_fp4::nvfp4::{dequantize_nvfp4, quantize_nvfp4_slice, swizzle_blockscale};
use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use std::time::Duration;

const SHAPES: [(usize, usize); 3] = [(576, 576), (1536, 576), (4096, 4096)];
const MS: [usize; 3] = [1, 8, 32];

fn bench(c: &mut Criterion) {
    let dev = Device::Cpu;
    let mut rng = StdRng::seed_from_u64(2026);
    for (n, k) in SHAPES {
        let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-0.1f32..0.1)).collect();
        let q = quantize_nvfp4_slice(&w, n, k, None).unwrap();
        let (codes, scales) = q.to_tensors(&dev).unwrap();
        let swizzled = swizzle_blockscale(&scales).unwrap();
        let w_f32 = dequantize_nvfp4(&codes, &scales, q.global_scale).unwrap();
        let w_bf16 = w_f32.to_dtype(DType::BF16).unwrap();
        let nvfp4_bytes = (codes.elem_count() + swizzled.elem_count()) as u64;

        let mut g = c.benchmark_group(format!("gemv_cpu/{n}x{k}"));
        g.sample_size(10)
            .sampling_mode(SamplingMode::Flat)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        for m in MS {
            let xs: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let x_f32 = Tensor::from_vec(xs, (m, k), &dev).unwrap();
            let x = x_f32.to_dtype(DType::BF16).unwrap();

            g.throughput(Throughput::Bytes(nvfp4_bytes));
            g.bench_with_input(BenchmarkId::new("nvfp4_gemv", m), &m, |b, _| {
                b.iter(|| {
                    black_box(
                        nvfp4_gemv(&x, &codes, &swizzled, q.global_scale, false, false).unwrap(),
                    )
                })
            });
            g.throughput(Throughput::Bytes((2 * n * k) as u64));
            g.bench_with_input(BenchmarkId::new("bf16_gemv", m), &m, |b, _| {
                b.iter(|| black_box(bf16_gemv(&x, &w_bf16, false, false).unwrap()))
            });
            g.bench_with_input(BenchmarkId::new("matmul_bf16", m), &m, |b, _| {
                b.iter(|| black_box(x.matmul(&w_bf16.t().unwrap()).unwrap()))
            });
            g.throughput(Throughput::Bytes((4 * n * k) as u64));
            g.bench_with_input(BenchmarkId::new("matmul_f32", m), &m, |b, _| {
                b.iter(|| black_box(x_f32.matmul(&w_f32.t().unwrap()).unwrap()))
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
