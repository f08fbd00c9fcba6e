//! `tune`: writes the tuned table of the GPU it runs on (feature `cuda`).
//!
//! For every GEMV shape of the given models (`--config config.json`, repeatable, each also
//! as its `--tp` shards) and of `--shapes NxK[s],...`, and every M in `--ms` (default
//! 1..=32): the packed NVFP4 GEMV (the token tile planned for M, PDL on and off, the faster
//! kept) against NVFP4's own matmul path (packed dequantize + cuBLAS), and the BF16 GEMV
//! against cuBLAS on the BF16 weight; a `silu_mul` shape's matmul paths include the separate
//! epilogue ops a layer on the matmul path runs ([`silu_mul_halves`]); CUDA-graph replays of ≥ 32 calls rotating among
//! weight sets totalling ≥ 256 MiB (larger than L2), median of 9; each call takes its input
//! from an add + RMSNorm of the same shape, as in the decode step, whose chain alone is
//! subtracted (`--back-to-back`: calls back to back, where a GEMV's early weight loads
//! overlap the previous call). The BF16 GEMV is what a layer runs: the packed kernel over the
//! natural layout up to 8 tokens, `kernels/gemv.cu`'s beyond. The table lists, per
//! shape, the token tiles whose geometric-mean speedup across the M they serve is above 1,
//! with that margin (`candle_fp4_models::tune::table_entry`); everything else runs the
//! matmul. Load it with `CANDLE_FP4_TABLES=DIR` or commit it as `tables/<arch>.json`.
//!
//! ```sh
//! tune --config llama-8b/config.json --config llama-70b/config.json --tp 2 --out sm90.json
//! ```

use anyhow::{bail, Context, Result};
use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::{DType, Device, Tensor};
use candle_fp4::gemv::{
    bf16_gemv_planned_packed, bf16_gemv_with, packed_nvfp4_gemv_planned, plan_bf16_gemv_with,
    GemvKnobs, PackedNvfp4,
};
use candle_fp4::norm::AddRmsNorm;
use candle_fp4::nvfp4::swizzled_shape;
use candle_fp4::quant_linear::silu_mul_halves;
use candle_fp4::tables::TunedTable;
use candle_fp4_models::config::LlamaConfig;
use candle_fp4_models::tune::{gemv_shapes, parse_shapes, table_entry, GemvShape};
use clap::Parser;
use std::path::PathBuf;

#[derive(Parser)]
#[command(about = "Measure the GEMV against the matmul path on this GPU and write its tuned table")]
struct Args {
    /// A model's config.json (repeatable): its q|k|v, o, gate|up, down and lm_head shapes.
    #[arg(long)]
    config: Vec<PathBuf>,
    /// Also each config's tensor-parallel shards of this size (1: whole layers only).
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// More shapes, `NxK[s],...` (`s`: the silu_mul epilogue).
    #[arg(long)]
    shapes: Option<String>,
    /// The M to measure, comma-separated (default 1..=32).
    #[arg(long)]
    ms: Option<String>,
    /// Where to write the table (default: print it).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Time the calls back to back. By default each call takes its input from an add +
    /// RMSNorm of the same M × K (the decode step's order: a norm or the attention's small
    /// kernels run between two projections) and the norms' chain alone is subtracted.
    #[arg(long)]
    back_to_back: bool,
}

fn err(e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("{e:?}"))
}

/// Median GPU µs per call of `f` (`calls` calls in one CUDA graph, 9 timed replays).
fn gpu_us(
    dev: &Device,
    calls: usize,
    f: impl FnMut(usize) -> candle_core::Result<()>,
) -> Result<f64> {
    Ok(candle_fp4::timing::graph_ms_per_call(dev, calls, 4, 9, f)? * 1e3)
}

/// (m, GEMV µs, matmul-path µs) of NVFP4 and of BF16 for one shape.
type Rows = Vec<(usize, f64, f64)>;

fn measure(dev: &Device, s: &GemvShape, ms: &[usize], back_to_back: bool) -> Result<(Rows, Rows)> {
    let (n, k) = (s.n, s.k);
    let (np, sp) = swizzled_shape(n, k / 16);
    let fp4_bytes = n * k / 2 + np * sp;
    let sets4 = (256usize << 20).div_ceil(fp4_bytes).clamp(2, 64);
    let sets16 = (256usize << 20).div_ceil(2 * n * k).clamp(2, 16);
    let mut packed = vec![];
    for _ in 0..sets4 {
        let c = Tensor::rand(0f32, 255.99, (n, k / 2), dev)?.to_dtype(DType::U8)?;
        let sc = Tensor::rand(40f32, 72.0, (np, sp), dev)?.to_dtype(DType::U8)?;
        packed.push(PackedNvfp4::pack(&c, &sc, 0.01)?);
    }
    let wb: Vec<Tensor> = (0..sets16)
        .map(|_| Tensor::randn(0f32, 0.02, (n, k), dev)?.to_dtype(DType::BF16))
        .collect::<candle_core::Result<_>>()?;
    // The matmul path's output as the layer would return it: the silu_mul epilogue as ops.
    let epi = |y: Tensor| -> candle_core::Result<()> {
        if s.silu_mul {
            silu_mul_halves(&y)?;
        }
        Ok(())
    };
    let norm = AddRmsNorm::new(&Tensor::ones(k, DType::BF16, dev)?, 1e-5)?;
    // The BF16-weight kernel is planned once per shape, as a layer plans it at load.
    let opts = GemvKnobs::with_pdl(true);
    let bf16_plan = plan_bf16_gemv_with(&wb[0], s.silu_mul, &opts)?;
    let (mut fp4, mut bf16) = (vec![], vec![]);
    for &m in ms {
        let x0 = Tensor::randn(0f32, 1.0, (m, k), dev)?.to_dtype(DType::BF16)?;
        let d = Tensor::randn(0f32, 0.1, (m, k), dev)?.to_dtype(DType::BF16)?;
        // Each call's input: the norm's output (its chain alone subtracted), or x itself.
        let input = || -> candle_core::Result<Tensor> {
            if back_to_back {
                Ok(x0.clone())
            } else {
                Ok(norm.forward(&x0, Some(&d))?.1)
            }
        };
        let c4 = (sets4 * 4).max(32);
        let c16 = (sets16 * 4).max(32);
        let base = |calls: usize| -> Result<f64> {
            if back_to_back {
                Ok(0.0)
            } else {
                gpu_us(dev, calls, |_| input().map(|_| ()))
            }
        };
        let (b4, b64, b16) = (base(c4)?, base(c4.min(64))?, base(c16)?);
        let mut g = f64::INFINITY;
        for pdl in [false, true] {
            let plan = packed[0].plan(s.silu_mul, m, pdl)?;
            g = g.min(
                gpu_us(dev, c4, |i| {
                    packed_nvfp4_gemv_planned(&input()?, &packed[i % sets4], &plan).map(|_| ())
                })? - b4,
            );
        }
        let dq = gpu_us(dev, c4.min(64), |i| {
            let w = packed[i % sets4].dequantize_bf16()?;
            epi(input()?.matmul(&w.t()?)?)
        })? - b64;
        // What a BF16 layer runs: up to 8 tokens the packed kernel over the natural layout
        // (where it serves the shape), else gemv.cu's kernel.
        let gb = match &bf16_plan {
            Some(plan) if m <= 8 => gpu_us(dev, c16, |i| {
                bf16_gemv_planned_packed(&input()?, &wb[i % sets16], plan).map(|_| ())
            })?,
            _ => gpu_us(dev, c16, |i| {
                bf16_gemv_with(&input()?, &wb[i % sets16], s.silu_mul, &opts).map(|_| ())
            })?,
        } - b16;
        let mm = gpu_us(dev, c16, |i| epi(input()?.matmul(&wb[i % sets16].t()?)?))? - b16;
        println!(
            "{:>10} {:>7}x{:<6} m={m:>2}: packed {g:>8.2} us, dequant+matmul {dq:>8.2} ({:.2}x); bf16 gemv {gb:>8.2}, matmul {mm:>8.2} ({:.2}x)",
            s.name,
            n,
            k,
            dq / g,
            mm / gb
        );
        fp4.push((m, g, dq));
        bf16.push((m, gb, mm));
    }
    Ok((fp4, bf16))
}

fn main() -> Result<()> {
    let a = Args::parse();
    let mut shapes: Vec<GemvShape> = vec![];
    for p in &a.config {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        let cfg = LlamaConfig::from_json_str(&text, &p.display().to_string())?;
        for tp in if a.tp > 1 { vec![1, a.tp] } else { vec![1] } {
            shapes.extend(
                gemv_shapes(&cfg, tp).with_context(|| format!("{}: --tp {tp}", p.display()))?,
            );
        }
    }
    if let Some(list) = &a.shapes {
        shapes.extend(parse_shapes(list)?);
    }
    // Each shape once (a shard list repeats the whole lm_head where the vocabulary does not split).
    let mut seen = std::collections::HashSet::new();
    shapes.retain(|s| seen.insert((s.n, s.k, s.silu_mul)));
    if shapes.is_empty() {
        bail!("nothing to measure: give --config and/or --shapes");
    }
    let ms: Vec<usize> = match &a.ms {
        Some(s) => s
            .split(',')
            .map(|v| {
                v.trim()
                    .parse::<usize>()
                    .with_context(|| format!("--ms: `{v}`"))
            })
            .collect::<Result<_>>()?,
        None => (1..=32).collect(),
    };
    if ms.iter().any(|&m| m == 0 || m > 32) {
        bail!("--ms: every M must be in 1..=32");
    }
    let dev = Device::new_cuda(0)?;
    let Device::Cuda(d) = &dev else {
        bail!("no CUDA device")
    };
    let stream = d.cuda_stream();
    let ctx = stream.context();
    let major = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .map_err(err)?;
    let minor = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        .map_err(err)?;
    let mut entries = vec![];
    for s in &shapes {
        let (fp4, bf16) = measure(&dev, s, &ms, a.back_to_back)?;
        entries.extend(table_entry(s, false, &fp4));
        entries.extend(table_entry(s, true, &bf16));
    }
    let table = TunedTable {
        arch: format!("sm{major}{minor}"),
        device: format!("compute capability {major}.{minor}"),
        measured: format!(
            "tune: packed NVFP4 GEMV vs packed dequantize + cuBLAS, BF16 GEMV vs cuBLAS, M in {ms:?}, {}; nt listed when its geometric-mean speedup over the M it serves is > 1 (margins)",
            if a.back_to_back {
                "calls back to back"
            } else {
                "each call after an add + RMSNorm (its chain subtracted)"
            }
        ),
        entries,
    };
    let text = serde_json::to_string_pretty(&table)? + "\n";
    // What is written must load.
    TunedTable::from_json(&text, "tune output")?;
    match &a.out {
        Some(p) => {
            std::fs::write(p, &text).with_context(|| format!("writing {}", p.display()))?;
            println!("tuned table written to {}", p.display());
        }
        None => print!("{text}"),
    }
    Ok(())
}
