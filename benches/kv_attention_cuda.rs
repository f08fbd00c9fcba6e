//! Decode attention on the GPU: UltraQuant FP4 KV cache against BF16 KV of the same shape.
//!
//! Shape: head_dim 128, 8 KV heads, 32 query heads (GQA 4:1), batch 1 and 8, contexts 1k to
//! 128k (every sequence full). For each point:
//! * `fp4`: `UltraQuantCache::decode_attention` (split-KV flash decoding + combine);
//! * `bf16 kernel`: `Bf16Cache::decode_attention`, the same kernel reading BF16 K/V;
//! * `candle`: candle's matmul + softmax path on a BF16 cache in the layout candle models
//!   use (`[batch, kv_heads, ctx, 128]`, q grouped per KV head so no K/V repeat):
//!   `softmax_last_dim(q·Kᵀ · scale) · V`.
//!
//! Times are CUDA-event GPU times around one call (allocations and launches included),
//! median of 30 after 5 warm-up calls. GB/s counts the cache bytes read (FP4: slots;
//! BF16: K and V); "copy" is a 2 GiB device-to-device copy timed in the same run, counting
//! read + write bytes. The short table is printed last.
//!
//! Run: `cargo bench --features cuda --bench kv_attention_cuda`

use anyhow::{Context, Result};
use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::{DType, Device, Tensor};
use candle_fp4::kv_cache::{CacheShape, KvCache, KvCacheKind};

const KV_HEADS: usize = 8;
const Q_HEADS: usize = 32;
const HEAD_DIM: usize = 128;
const CONTEXTS: [usize; 6] = [1 << 10, 1 << 12, 1 << 14, 1 << 15, 1 << 16, 1 << 17];
const BATCHES: [usize; 2] = [1, 8];
const WARMUP: usize = 5;
const RUNS: usize = 30;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median GPU microseconds of `f` (CUDA events around each call).
fn time_us(dev: &Device, mut f: impl FnMut() -> Result<Tensor>) -> Result<f64> {
    let stream = dev.as_cuda_device()?.cuda_stream();
    for _ in 0..WARMUP {
        f()?;
    }
    dev.synchronize()?;
    let mut ts = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let e0 = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let out = f()?;
        let e1 = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        ts.push(f64::from(e0.elapsed_ms(&e1)?) * 1e3);
        drop(out);
    }
    Ok(median(ts))
}

/// Device-to-device copy bandwidth (read + write bytes per second) of a 2 GiB buffer.
fn copy_bandwidth(dev: &Device) -> Result<f64> {
    let stream = dev.as_cuda_device()?.cuda_stream();
    let n = 1usize << 31;
    let src = stream.alloc_zeros::<u8>(n)?;
    let mut dst = stream.alloc_zeros::<u8>(n)?;
    for _ in 0..3 {
        stream.memcpy_dtod(&src, &mut dst)?;
    }
    stream.synchronize()?;
    let mut ts = Vec::new();
    for _ in 0..10 {
        let e0 = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        stream.memcpy_dtod(&src, &mut dst)?;
        let e1 = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        ts.push(f64::from(e0.elapsed_ms(&e1)?) * 1e-3);
    }
    Ok(2.0 * n as f64 / median(ts))
}

fn cosine(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_dtype(DType::F64)?.flatten_all()?;
    let b = b.to_dtype(DType::F64)?.flatten_all()?;
    let ab = (&a * &b)?.sum_all()?.to_scalar::<f64>()?;
    let aa = a.sqr()?.sum_all()?.to_scalar::<f64>()?;
    let bb = b.sqr()?.sum_all()?.to_scalar::<f64>()?;
    Ok(ab / (aa.sqrt() * bb.sqrt()))
}

struct Row {
    ctx: usize,
    batch: usize,
    fp4_us: f64,
    fp4_gbs: f64,
    bf16k_us: f64,
    candle_us: f64,
}

fn run_point(dev: &Device, ctx: usize, batch: usize) -> Result<Row> {
    let shape = CacheShape {
        batch,
        capacity: ctx,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
    };
    let mut fp4 = KvCache::new(KvCacheKind::UltraQuant, shape, dev)?;
    let mut bf16 = KvCache::new(KvCacheKind::Bf16, shape, dev)?;
    let chunk = ctx.min(8192);
    let mut done = 0;
    while done < ctx {
        let n = chunk.min(ctx - done);
        let k =
            Tensor::randn(0f32, 1.0, (batch, n, KV_HEADS, HEAD_DIM), dev)?.to_dtype(DType::BF16)?;
        let v =
            Tensor::randn(0f32, 1.0, (batch, n, KV_HEADS, HEAD_DIM), dev)?.to_dtype(DType::BF16)?;
        fp4.append(&k, &v)?;
        bf16.append(&k, &v)?;
        done += n;
    }
    let q = Tensor::randn(0f32, 1.0, (batch, Q_HEADS, HEAD_DIM), dev)?.to_dtype(DType::BF16)?;

    // candle's path on [batch, kv_heads, ctx, d] K/V, q grouped per KV head.
    let KvCache::Bf16(b16) = &bf16 else {
        anyhow::bail!("expected a BF16 cache")
    };
    let kc = b16.storage().get(0)?.transpose(1, 2)?.contiguous()?;
    let vc = b16.storage().get(1)?.transpose(1, 2)?.contiguous()?;
    let qc = q.reshape((batch, KV_HEADS, Q_HEADS / KV_HEADS, HEAD_DIM))?;
    let scale = 1.0 / (HEAD_DIM as f64).sqrt();
    let candle_path = || -> Result<Tensor> {
        let s = (qc.matmul(&kc.t()?)? * scale)?;
        let p = candle_nn::ops::softmax_last_dim(&s)?;
        Ok(p.matmul(&vc)?)
    };

    let fp4_us = time_us(dev, || Ok(fp4.decode_attention(&q)?))?;
    let bf16k_us = time_us(dev, || Ok(bf16.decode_attention(&q)?))?;
    let candle_us = time_us(dev, candle_path)?;

    let o4 = fp4.decode_attention(&q)?;
    let o16 = bf16.decode_attention(&q)?;
    let oc = candle_path()?.reshape((batch, Q_HEADS, HEAD_DIM))?;
    println!(
        "ctx {ctx:6} batch {batch}: fp4 {fp4_us:8.1} us  bf16 kernel {bf16k_us:8.1} us  candle {candle_us:8.1} us  \
         cos(fp4, bf16 kernel) {:.4}  cos(bf16 kernel, candle) {:.5}",
        cosine(&o4, &o16)?,
        cosine(&o16, &oc)?
    );
    let bytes = (batch * ctx * fp4.bytes_per_token()) as f64;
    Ok(Row {
        ctx,
        batch,
        fp4_us,
        fp4_gbs: bytes / (fp4_us * 1e-6) / 1e9,
        bf16k_us,
        candle_us,
    })
}

fn main() -> Result<()> {
    let dev = Device::new_cuda(0).context("a CUDA device is needed")?;
    let copy = copy_bandwidth(&dev)? / 1e9;
    println!("device-to-device copy, 2 GiB: {copy:.0} GB/s (read + write)");
    let mut rows = Vec::new();
    for batch in BATCHES {
        for ctx in CONTEXTS {
            rows.push(run_point(&dev, ctx, batch)?);
        }
    }
    let fp4_bpt = KV_HEADS * (HEAD_DIM + HEAD_DIM / 16);
    let bf16_bpt = KV_HEADS * HEAD_DIM * 2 * 2;
    println!();
    println!("decode attention, head_dim {HEAD_DIM}, {KV_HEADS} KV heads, {Q_HEADS} q heads; copy bandwidth {copy:.0} GB/s");
    println!(
        "bytes per token per layer: FP4 {fp4_bpt}, BF16 {bf16_bpt} ({:.2}x smaller)",
        bf16_bpt as f64 / fp4_bpt as f64
    );
    println!(
        "| ctx | batch | FP4 us | FP4 GB/s | % copy | BF16 kernel us | x | candle BF16 us | x |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} | {:.1} | {:.0} | {:.0}% | {:.1} | {:.2} | {:.1} | {:.2} |",
            r.ctx,
            r.batch,
            r.fp4_us,
            r.fp4_gbs,
            100.0 * r.fp4_gbs / copy,
            r.bf16k_us,
            r.bf16k_us / r.fp4_us,
            r.candle_us,
            r.candle_us / r.fp4_us
        );
    }
    Ok(())
}
