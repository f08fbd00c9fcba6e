//! Host cost of one call on the CPU: wall µs per `QuantLinear::forward` at M = 1 (NVFP4,
//! 576×576 and 4096×4096) and per `KvCache::decode_attention` call (UltraQuant and BF16,
//! ctx 4096, 32/8 heads, d 128), against the lowest-level CPU kernel entry point the op
//! calls: `gemv::gemv_cpu` on the layer's codes and swizzled scales, and
//! `kv_cache::attention_cpu` on the cache's bytes. `op − kernel` is what the candle op
//! dispatch and our wrappers add on the host per call (tensor checks, storage access, output
//! allocation). Uses only APIs that also existed before the restructuring, so the same file
//! builds against the old tree (same-run before/after).
//!
//! Per case: warm-up (≥ 5 calls and ≥ 200 ms), then `--rounds` rounds (default 11) of as
//! many calls as fill ~25 ms (at least 3), op and kernel rounds interleaved; each round
//! gives µs per call; the median and the minimum round are printed. Weights, activations and the cache contents are seeded.
//!
//! Run: the built binary with `--bench [--threads N] [--ctx N] [--rounds N]`; `--threads`
//! builds rayon's global pool with N threads (also the size of the GEMV's single-token
//! spinning pool); without it rayon's default (`RAYON_NUM_THREADS` or the core count).
//! Prints the table last.

use candle_core::{DType, Device, Tensor};
use candle_fp4::gemv::{gemv_cpu, CpuKernel, WeightRows};
use candle_fp4::kv_cache::{attention_cpu, CacheShape, KvCache, KvCacheKind, KvSource};
use candle_fp4::nvfp4::{quantize_nvfp4, swizzle_blockscale_bytes, swizzled_shape};
use candle_fp4::quant_linear::QuantLinear;
use candle_nn::Module;
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use std::time::{Duration, Instant};

type R<T> = candle_core::Result<T>;

/// Seeded N(≈0, `scale`) values (sum of uniforms; only the scale matters here).
fn seeded(rng: &mut StdRng, len: usize, scale: f32) -> Vec<f32> {
    (0..len)
        .map(|_| (rng.random_range(-1f32..1.0) + rng.random_range(-1f32..1.0)) * scale)
        .collect()
}

fn bf16_tensor(rng: &mut StdRng, shape: &[usize], scale: f32) -> R<Tensor> {
    let len = shape.iter().product();
    Tensor::from_vec(seeded(rng, len, scale), shape, &Device::Cpu)?.to_dtype(DType::BF16)
}

/// Calls per round so that one round of `f` takes ~25 ms (at least 3), after a warm-up of
/// at least 5 calls and 200 ms.
fn calibrate<T>(f: &mut dyn FnMut() -> R<T>) -> R<usize> {
    let t = Instant::now();
    let mut warm = 0usize;
    while warm < 5 || t.elapsed() < Duration::from_millis(200) {
        black_box(f()?);
        warm += 1;
    }
    let est = t.elapsed().as_secs_f64() / warm as f64;
    Ok(((0.025 / est).ceil() as usize).max(3))
}

/// µs per call of one round of `calls` calls.
fn round_us<T>(calls: usize, f: &mut dyn FnMut() -> R<T>) -> R<f64> {
    let t = Instant::now();
    for _ in 0..calls {
        black_box(f()?);
    }
    Ok(t.elapsed().as_secs_f64() * 1e6 / calls as f64)
}

/// (median, min) µs per call of `op` and of `kernel` over `rounds` rounds each, the two
/// interleaved round by round (alternating which goes first) so drift hits both alike.
fn time_pair<A, B>(
    rounds: usize,
    op: &mut dyn FnMut() -> R<A>,
    kernel: &mut dyn FnMut() -> R<B>,
) -> R<((f64, f64), (f64, f64))> {
    let (co, ck) = (calibrate(op)?, calibrate(kernel)?);
    let (mut uo, mut uk) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for r in 0..rounds {
        if r % 2 == 0 {
            uo.push(round_us(co, op)?);
            uk.push(round_us(ck, kernel)?);
        } else {
            uk.push(round_us(ck, kernel)?);
            uo.push(round_us(co, op)?);
        }
    }
    let stat = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[0])
    };
    Ok((stat(uo), stat(uk)))
}

struct Row {
    what: String,
    op: (f64, f64),
    kernel: (f64, f64),
}

fn arg(name: &str) -> Option<usize> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == name)?;
    Some(
        args.get(i + 1)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} needs a number")),
    )
}

fn main() -> R<()> {
    if !std::env::args().any(|a| a == "--bench") {
        return Ok(());
    }
    if let Some(t) = arg("--threads") {
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
            .map_err(|e| candle_core::Error::Msg(format!("rayon pool: {e}")))?;
    }
    let ctx = arg("--ctx").unwrap_or(4096);
    let rounds = arg("--rounds").unwrap_or(11).max(1);
    let dev = Device::Cpu;
    let mut rng = StdRng::seed_from_u64(2026);
    let mut rows = Vec::new();
    for (n, k) in [(576usize, 576usize), (4096, 4096)] {
        let w = bf16_tensor(&mut rng, &[n, k], 0.02)?;
        let q = quantize_nvfp4(&w)?;
        let layer = QuantLinear::from_nvfp4(&q, None, &dev)?;
        let x = bf16_tensor(&mut rng, &[1, k], 1.0)?;
        let xs = x.flatten_all()?.to_vec1::<bf16>()?;
        let swz = swizzle_blockscale_bytes(&q.weight_scale, n, k / 16)?;
        let wr = WeightRows::Nvfp4 {
            codes: &q.weight,
            scales: &swz,
            sp: swizzled_shape(n, k / 16).1,
        };
        // Same result through both paths (the op adds no arithmetic).
        let a = layer.forward(&x)?.flatten_all()?.to_vec1::<bf16>()?;
        let b = gemv_cpu(&xs, k, 1, k, n, &wr, q.global_scale, false)?;
        assert_eq!(a, b, "QuantLinear vs gemv_cpu differ for {n}x{k}");
        let (op, kernel) = time_pair(rounds, &mut || layer.forward(&x), &mut || {
            gemv_cpu(&xs, k, 1, k, n, &wr, q.global_scale, false)
        })?;
        rows.push(Row {
            what: format!("QuantLinear NVFP4 {n}x{k}, M = 1"),
            op,
            kernel,
        });
    }
    for kind in [KvCacheKind::UltraQuant, KvCacheKind::Bf16] {
        let sh = CacheShape {
            batch: 1,
            capacity: ctx,
            kv_heads: 8,
            head_dim: 128,
        };
        let mut c = KvCache::new(kind, sh, &dev)?;
        let kv = bf16_tensor(&mut rng, &[1, ctx, 8, 128], 1.0)?;
        c.append(&kv, &kv)?;
        let q = bf16_tensor(&mut rng, &[1, 32, 128], 1.0)?;
        let qs = q.flatten_all()?.to_vec1::<bf16>()?;
        let lens = c.lens().to_vec();
        let shape = c.shape();
        let (bytes, kvs) = match &c {
            KvCache::UltraQuant(u) => (u.slots()?.flatten_all()?.to_vec1::<u8>()?, Vec::new()),
            KvCache::Bf16(b) => (Vec::new(), b.storage().flatten_all()?.to_vec1::<bf16>()?),
        };
        let src = || match kind {
            KvCacheKind::UltraQuant => KvSource::UltraQuant(&bytes),
            KvCacheKind::Bf16 => {
                let (k, v) = kvs.split_at(kvs.len() / 2);
                KvSource::Bf16 { k, v }
            }
        };
        let a = c.decode_attention(&q)?.flatten_all()?.to_vec1::<bf16>()?;
        let b = attention_cpu(&qs, 32, &shape, &lens, src())?;
        assert_eq!(
            a, b,
            "decode_attention vs attention_cpu differ for {kind:?}"
        );
        let (op, kernel) = time_pair(rounds, &mut || c.decode_attention(&q), &mut || {
            attention_cpu(&qs, 32, &shape, &lens, src())
        })?;
        rows.push(Row {
            what: format!("decode attention {kind:?} ctx {ctx}, 32/8 heads, d 128"),
            op,
            kernel,
        });
    }
    println!(
        "rayon threads {}, CPU GEMV kernel {:?}, {rounds} rounds",
        rayon::current_num_threads(),
        CpuKernel::detect()
    );
    println!("| call | op µs (median) | op µs (min) | kernel µs (median) | kernel µs (min) | op − kernel µs (medians) |");
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            r.what,
            r.op.0,
            r.op.1,
            r.kernel.0,
            r.kernel.1,
            r.op.0 - r.kernel.0
        );
    }
    Ok(())
}
