//! Quantizes a random seeded layer to NVFP4, runs `nvfp4_gemv`, and compares it with
//! candle's matmul on the dequantized weight.
//!
//! ```text
//! cargo run --release --example gemv_random -- [--n 1536] [--k 576] [--m 1] [--seed 0]
//!     [--silu-mul] [--iters 20] [--device cpu|cuda]
//! ```
//!
//! `--device cuda` needs the `cuda` feature (`--features cuda`) and uses GPU 0.

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_fp4::gemv::nvfp4_gemv;
use candle_fp4::nvfp4::{dequantize_nvfp4, quantize_nvfp4_slice, swizzle_blockscale};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Instant;

struct Args {
    n: usize,
    k: usize,
    m: usize,
    seed: u64,
    silu_mul: bool,
    iters: usize,
    device: String,
}

const USAGE: &str = "usage: gemv_random [--n N] [--k K] [--m M] [--seed S] [--silu-mul] \
                     [--iters I] [--device cpu|cuda]";

fn parse_args() -> Result<Args> {
    let mut a = Args {
        n: 1536,
        k: 576,
        m: 1,
        seed: 0,
        silu_mul: false,
        iters: 20,
        device: "cpu".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| -> Result<String> {
            it.next()
                .ok_or_else(|| anyhow!("{name} needs a value\n{USAGE}"))
        };
        match flag.as_str() {
            "--n" => a.n = value("--n")?.parse().context("--n")?,
            "--k" => a.k = value("--k")?.parse().context("--k")?,
            "--m" => a.m = value("--m")?.parse().context("--m")?,
            "--seed" => a.seed = value("--seed")?.parse().context("--seed")?,
            "--iters" => a.iters = value("--iters")?.parse().context("--iters")?,
            "--device" => a.device = value("--device")?,
            "--silu-mul" => a.silu_mul = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    if a.iters == 0 {
        bail!("--iters must be at least 1");
    }
    Ok(a)
}

fn device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        #[cfg(feature = "cuda")]
        "cuda" => Ok(Device::new_cuda(0)?),
        #[cfg(not(feature = "cuda"))]
        "cuda" => bail!("this build has no CUDA support: rebuild with --features cuda"),
        other => bail!("--device must be cpu or cuda, got {other:?}"),
    }
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let dev = device(&args.device)?;
    let (n, k, m) = (args.n, args.k, args.m);
    let mut rng = StdRng::seed_from_u64(args.seed);

    // A random layer with a spread of row amplitudes, quantized on the CPU.
    let mut w = vec![0f32; n * k];
    for row in w.chunks_exact_mut(k.max(1)) {
        let amp = 10f32.powf(rng.random_range(-1.5..0.0));
        for v in row.iter_mut() {
            *v = amp * rng.random_range(-1.0f32..1.0);
        }
    }
    let q = quantize_nvfp4_slice(&w, n, k, None)?;
    let (codes, scales) = q.to_tensors(&Device::Cpu)?;
    let swizzled = swizzle_blockscale(&scales)?.to_device(&dev)?;
    let codes_dev = codes.to_device(&dev)?;
    let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let x = Tensor::from_vec(x, (m, k), &dev)?.to_dtype(DType::BF16)?;

    // Reference: candle matmul in F32 on the dequantized weight (ModelOpt's order).
    let w_deq = dequantize_nvfp4(&codes, &scales, q.global_scale)?.to_device(&dev)?;
    let mut reference = x.to_dtype(DType::F32)?.matmul(&w_deq.t()?)?;
    if args.silu_mul {
        let h = n / 2;
        let gate = reference.narrow(1, 0, h)?.to_dtype(DType::BF16)?;
        let up = reference.narrow(1, h, h)?.to_dtype(DType::BF16)?;
        reference =
            (candle_nn::ops::silu(&gate.to_dtype(DType::F32)?)? * up.to_dtype(DType::F32)?)?;
    }

    let run = || {
        nvfp4_gemv(
            &x,
            &codes_dev,
            &swizzled,
            q.global_scale,
            args.silu_mul,
            false,
        )
    };
    let y = run()?; // warm-up (and the result we check)
    dev.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..args.iters {
        run()?;
    }
    dev.synchronize()?;
    let per_call = t0.elapsed().as_secs_f64() / args.iters as f64;

    let y = y.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
    let r = reference.to_device(&Device::Cpu)?;
    let diff = (&y - &r)?.abs()?;
    let max_abs = diff.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let max_ref = r.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let l2 = |t: &Tensor| -> Result<f32> { Ok(t.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt()) };
    let rel_l2 = l2(&(&y - &r)?)? / l2(&r)?;

    println!(
        "nvfp4_gemv on {:?}: M={m} N={n} K={k} silu_mul={} global_scale={:e}",
        args.device, args.silu_mul, q.global_scale
    );
    println!(
        "vs candle F32 matmul on the dequantized weight: max |err| = {max_abs:.3e} \
         (max |ref| = {max_ref:.3e}, relative {:.3e}), relative L2 = {rel_l2:.3e}",
        max_abs / max_ref
    );
    let weight_bytes = (codes.elem_count() + swizzled.elem_count()) as f64;
    println!(
        "time: {:.1} µs per call over {} calls ({:.2} GB/s of weight)",
        per_call * 1e6,
        args.iters,
        weight_bytes / per_call / 1e9
    );
    // BF16 output: the relative L2 error is about the BF16 rounding, ~2^-9.
    if rel_l2.is_nan() || rel_l2 >= 1.0 / 128.0 {
        bail!("relative L2 error {rel_l2:e} is larger than expected for BF16 output");
    }
    Ok(())
}
