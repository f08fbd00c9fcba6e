//! Probe: how fast could the CPU NVFP4 GEMV be with SIMD? An AVX-512 row kernel (16
//! E2M1 codes → 16 lanes, one `vpermps` lookup in a per-block scaled table, one FMA per
//! token) against `candle_fp4::gemv::nvfp4_gemv` (the oracle) on SmolLM2's decode
//! shapes, M = 1. Same numerics contract (exact `e2m1·e4m3` weights, FP32 accumulation,
//! global scale on the accumulator, one BF16 rounding); only the summation order differs.
//! Not used by the models: a measurement for the GEMV's owners.
//!
//! ```sh
//! cargo run --release -p candle-fp4-models --example gemv_simd_probe
//! ```

#[cfg(target_arch = "x86_64")]
mod x86 {
    use candle_core::{DType, Device, Tensor};
    use candle_fp4::gemv::nvfp4_gemv;
    use candle_fp4::nvfp4::{e2m1_decode, e4m3_decode, quantize_nvfp4, swizzle_blockscale};
    use rayon::prelude::*;
    use std::time::Instant;

    /// One output row: Σ_k e2m1(code_k)·scale_blk(k)·x_k, FP32.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn row_dot_avx512(codes: &[u8], scales: &[f32], x: &[f32], lut: &[f32; 16]) -> f32 {
        use std::arch::x86_64::*;
        let lut_v = _mm512_loadu_ps(lut.as_ptr());
        let mask = _mm_set1_epi8(0x0F);
        let mut acc = _mm512_setzero_ps();
        for (b, &s) in scales.iter().enumerate() {
            let c8 = std::ptr::read_unaligned(codes.as_ptr().add(b * 8) as *const u64);
            let v = _mm_cvtsi64_si128(c8 as i64);
            let lo = _mm_and_si128(v, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
            let nib = _mm_unpacklo_epi8(lo, hi); // k order: even k = low nibble
            let idx = _mm512_cvtepu8_epi32(nib);
            let w = _mm512_permutexvar_ps(idx, _mm512_mul_ps(lut_v, _mm512_set1_ps(s)));
            acc = _mm512_fmadd_ps(w, _mm512_loadu_ps(x.as_ptr().add(b * 16)), acc);
        }
        _mm512_reduce_add_ps(acc)
    }

    /// The probe GEMV for M = 1: row-major codes `[n, k/2]`, row-major decoded scales.
    fn gemv_probe(
        codes: &[u8],
        scales: &[f32],
        x: &[f32],
        n: usize,
        k: usize,
        gs: f32,
    ) -> Vec<f32> {
        let mut lut = [0f32; 16];
        for (i, l) in lut.iter_mut().enumerate() {
            *l = e2m1_decode(i as u8);
        }
        let mut y = vec![0f32; n];
        y.par_chunks_mut(64).enumerate().for_each(|(t, out)| {
            for (r, o) in out.iter_mut().enumerate() {
                let row = t * 64 + r;
                let c = &codes[row * k / 2..(row + 1) * k / 2];
                let s = &scales[row * k / 16..(row + 1) * k / 16];
                // SAFETY: checked for AVX-512 in main; slices hold k/2 codes, k/16 scales, k x.
                *o = unsafe { row_dot_avx512(c, s, x, &lut) } * gs;
            }
        });
        y
    }

    pub fn run() -> anyhow::Result<()> {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")) {
            println!("no AVX-512 on this CPU");
            return Ok(());
        }
        let dev = Device::Cpu;
        let mut total = (0.0, 0.0);
        for (name, n, k, layers) in [
            ("q|k|v", 960, 576, 30),
            ("o", 576, 576, 30),
            ("gate|up", 3072, 576, 30),
            ("down", 576, 1536, 30),
        ] {
            let w = Tensor::randn(0f32, 0.02, (n, k), &dev)?;
            let q = quantize_nvfp4(&w)?;
            let (codes_t, scales_t) = q.to_tensors(&dev)?;
            let swz = swizzle_blockscale(&scales_t)?;
            let xf = Tensor::randn(0f32, 1.0, (1, k), &dev)?.to_dtype(DType::BF16)?;
            let x: Vec<f32> = xf.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            let scales: Vec<f32> = q.weight_scale.iter().map(|&b| e4m3_decode(b)).collect();
            let reps = 200;
            let want = nvfp4_gemv(&xf, &codes_t, &swz, q.global_scale, false, false)?;
            let t = Instant::now();
            for _ in 0..reps {
                nvfp4_gemv(&xf, &codes_t, &swz, q.global_scale, false, false)?;
            }
            let oracle_ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
            let got = gemv_probe(&q.weight, &scales, &x, n, k, q.global_scale);
            let t = Instant::now();
            for _ in 0..reps {
                std::hint::black_box(gemv_probe(&q.weight, &scales, &x, n, k, q.global_scale));
            }
            let probe_ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
            // Compare after the single BF16 rounding both apply.
            let want: Vec<f32> = want.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            let max_ulps = want
                .iter()
                .zip(&got)
                .map(|(a, b)| {
                    let b = half::bf16::from_f32(*b).to_f32();
                    ((a - b).abs() / (a.abs().max(1e-30) * 2f32.powi(-7))).round()
                })
                .fold(0f32, f32::max);
            println!(
                "{name:>8} [{n}x{k}]: oracle {oracle_ms:.3} ms ({:.2} G weights/s), AVX-512 probe {probe_ms:.3} ms ({:.2} G/s), {:.1}x; max diff {max_ulps} BF16 ulp",
                (n * k) as f64 / oracle_ms / 1e6,
                (n * k) as f64 / probe_ms / 1e6,
                oracle_ms / probe_ms
            );
            total.0 += oracle_ms * layers as f64;
            total.1 += probe_ms * layers as f64;
        }
        println!(
            "SmolLM2 decode step, 30 layers of projections: oracle {:.1} ms, probe {:.1} ms",
            total.0, total.1
        );
        Ok(())
    }
}

#[cfg(target_arch = "x86_64")]
fn main() -> anyhow::Result<()> {
    x86::run()
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("x86_64 (AVX-512) only");
}
