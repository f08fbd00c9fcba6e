//! Decode attention on the GPU: UltraQuant FP4 KV cache against BF16 KV of the same shape.
//!
//! Shape: head_dim 128, 8 KV heads, 32 query heads (GQA 4:1), batch 1 and 8, contexts 1k to
//! 128k (every sequence full). For each point:
//! * `fp4`: `UltraQuantCache::decode_attention` (split-KV flash decoding, a CTA per KV head,
//!   splits merged by the attention kernel's last CTA per head group);
//! * `bf16 kernel`: `Bf16Cache::decode_attention`, the same kernel reading BF16 K/V;
//! * `candle`: candle's matmul + softmax path on a BF16 cache in the layout candle models
//!   use (`[batch, kv_heads, ctx, 128]`, q grouped per KV head so no K/V repeat):
//!   `softmax_last_dim(q·Kᵀ · scale) · V`.
//!
//! Times: GPU time from CUDA events around CUDA-graph replays of the calls (allocations
//! included, host dispatch excluded), median of 30 replays after a warm-up; each replay
//! rotates over enough cache replicas to exceed the L2 cache (≥ 256 MiB of FP4 cache, at most
//! 64 replicas), so bytes come from HBM. "eager" is the CUDA-event time around one eager
//! call (host dispatch included, median of 30 after 5 warm-up calls). GB/s counts the cache
//! bytes read (FP4: slots; BF16: K and V); "copy" is a 2 GiB device-to-device copy timed in
//! the same run, counting read + write bytes. The short table is printed last.
//!
//! Run: `cargo bench --features cuda --bench kv_attention_cuda`
//! (`CFP4_KV_BENCH_WINDOW=64`: the FP4 cache with an exact window of 64 tokens;
//! `CFP4_KV_BENCH_RING=1` with it: also both launch orders of the window's ring kernel;
//! `CFP4_KV_BENCH_POINTS=32768x8,...`, `CFP4_KV_BENCH_SPLITS=8,16`,
//! `CFP4_KV_BENCH_VARIANTS=1`: selected points, forced splits, merge / PDL variants.)

use anyhow::{anyhow, Context, Result};
use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::{DType, Device, Tensor};
use candle_fp4::kv_cache::{AttnKnobs, CacheShape, KvCache, KvCacheKind};

const KV_HEADS: usize = 8;
const Q_HEADS: usize = 32;
const HEAD_DIM: usize = 128;
const CONTEXTS: [usize; 6] = [1 << 10, 1 << 12, 1 << 14, 1 << 15, 1 << 16, 1 << 17];
const BATCHES: [usize; 2] = [1, 8];
const WARMUP: usize = 5;
const RUNS: usize = 30;
/// FP4 cache bytes the replicas of one point add up to (beyond the 50 MB L2).
const ROTATE_BYTES: usize = 256 << 20;
const MAX_REPLICAS: usize = 64;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn drv(e: impl std::fmt::Debug) -> anyhow::Error {
    anyhow!("{e:?}")
}

/// Median GPU microseconds per call of `f(i)`, `i` cycling over `replicas`, from CUDA-graph
/// replays of `calls` captured calls.
fn graph_us(
    dev: &Device,
    replicas: usize,
    mut f: impl FnMut(usize) -> Result<Tensor>,
) -> Result<f64> {
    let stream = dev.as_cuda_device()?.cuda_stream();
    let calls = replicas.max(8);
    for i in 0..calls {
        f(i % replicas)?; // warm-up: module loads, cuBLAS handles, allocator pools
    }
    dev.synchronize()?;
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(drv)?;
    let mut res = Ok(());
    for i in 0..calls {
        if let Err(e) = f(i % replicas) {
            res = Err(e);
            break;
        }
    }
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .map_err(drv)?;
    res?;
    let graph = graph.ok_or_else(|| anyhow!("empty CUDA graph"))?;
    graph.upload().map_err(drv)?;
    for _ in 0..2 {
        graph.launch().map_err(drv)?;
    }
    dev.synchronize()?;
    let mut ts = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let e0 = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        graph.launch().map_err(drv)?;
        let e1 = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        ts.push(f64::from(e0.elapsed_ms(&e1)?) * 1e3 / calls as f64);
    }
    Ok(median(ts))
}

/// Median microseconds of one eager call (CUDA events around it, host dispatch included).
fn eager_us(dev: &Device, mut f: impl FnMut() -> Result<Tensor>) -> Result<f64> {
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
    fp4_eager_us: f64,
    bf16k_us: f64,
    candle_us: f64,
    candle_eager_us: f64,
}

/// One replica: the FP4 and BF16 caches holding the same random K/V, and the candle-layout
/// copies of the BF16 K and V.
struct Replica {
    fp4: KvCache,
    bf16: KvCache,
    kc: Tensor,
    vc: Tensor,
}

fn replica(dev: &Device, ctx: usize, batch: usize) -> Result<Replica> {
    let shape = CacheShape {
        batch,
        capacity: ctx,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
    };
    // CFP4_KV_BENCH_WINDOW=64: the FP4 cache keeps its last 64 tokens exact (BF16 ring).
    let window = match std::env::var("CFP4_KV_BENCH_WINDOW") {
        Ok(w) => w.trim().parse()?,
        Err(_) => 0,
    };
    let mut fp4 = KvCache::with_window(KvCacheKind::UltraQuant, shape, window, dev)?;
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
    let KvCache::Bf16(b16) = &bf16 else {
        anyhow::bail!("expected a BF16 cache")
    };
    let kc = b16.storage().get(0)?.transpose(1, 2)?.contiguous()?;
    let vc = b16.storage().get(1)?.transpose(1, 2)?.contiguous()?;
    Ok(Replica { fp4, bf16, kc, vc })
}

/// candle's matmul + softmax decode attention on `[batch, kv_heads, ctx, d]` K/V.
fn candle_attention(q: &Tensor, r: &Replica, batch: usize) -> Result<Tensor> {
    let qc = q.reshape((batch, KV_HEADS, Q_HEADS / KV_HEADS, HEAD_DIM))?;
    let s = (qc.matmul(&r.kc.t()?)? * (1.0 / (HEAD_DIM as f64).sqrt()))?;
    let p = candle_nn::ops::softmax_last_dim(&s)?;
    Ok(p.matmul(&r.vc)?.reshape((batch, Q_HEADS, HEAD_DIM))?)
}

fn run_point(dev: &Device, ctx: usize, batch: usize) -> Result<Row> {
    let bytes = batch * ctx * KV_HEADS * (HEAD_DIM + HEAD_DIM / 16);
    let n_rep = ROTATE_BYTES.div_ceil(bytes).clamp(1, MAX_REPLICAS);
    let reps = (0..n_rep)
        .map(|_| replica(dev, ctx, batch))
        .collect::<Result<Vec<_>>>()?;
    let q = Tensor::randn(0f32, 1.0, (batch, Q_HEADS, HEAD_DIM), dev)?.to_dtype(DType::BF16)?;

    let fp4_us = graph_us(dev, n_rep, |i| Ok(reps[i].fp4.decode_attention(&q)?))?;
    // (FP4, BF16 kernel) GPU µs with launch options `opts`.
    let both_us = |opts: &AttnKnobs| -> Result<(f64, f64)> {
        let us = graph_us(dev, n_rep, |i| {
            Ok(reps[i].fp4.decode_attention_with(&q, opts)?)
        })?;
        let bf = graph_us(dev, n_rep, |i| {
            Ok(reps[i].bf16.decode_attention_with(&q, opts)?)
        })?;
        Ok((us, bf))
    };
    // CFP4_KV_BENCH_SPLITS="8,16,33,66": also time forced split counts (heuristic tuning).
    if let Ok(list) = std::env::var("CFP4_KV_BENCH_SPLITS") {
        for sp in list.split(',') {
            let splits: usize = sp.trim().parse()?;
            let (us, bf) = both_us(&AttnKnobs {
                splits: Some(splits),
                ..Default::default()
            })?;
            println!(
                "ctx {ctx} batch {batch} splits {splits}: fp4 {us:.1} us, bf16 kernel {bf:.1} us"
            );
        }
    }
    // CFP4_KV_BENCH_VARIANTS=1: also time the merge (fused in the attention kernel, or the
    // combine kernel) and PDL on / off (the defaults' A/B).
    if std::env::var("CFP4_KV_BENCH_VARIANTS").is_ok() {
        for (fused, pdl) in [(false, false), (false, true), (true, false), (true, true)] {
            let (us, bf) = both_us(&AttnKnobs {
                fused_merge: Some(fused),
                pdl: Some(pdl),
                ..Default::default()
            })?;
            println!(
                "ctx {ctx} batch {batch} fused_merge {fused} pdl {pdl}: fp4 {us:.1} us, bf16 kernel {bf:.1} us"
            );
        }
    }
    // CFP4_KV_BENCH_RING=1 (with CFP4_KV_BENCH_WINDOW): the exact window's ring kernel
    // before / after the UltraQuant kernel.
    if std::env::var("CFP4_KV_BENCH_RING").is_ok() {
        for ring_first in [true, false] {
            let us = graph_us(dev, n_rep, |i| {
                Ok(reps[i].fp4.decode_attention_with(
                    &q,
                    &AttnKnobs {
                        ring_first: Some(ring_first),
                        ..Default::default()
                    },
                )?)
            })?;
            println!("ctx {ctx} batch {batch} ring_first {ring_first}: fp4 {us:.1} us");
        }
    }
    let bf16k_us = graph_us(dev, n_rep, |i| Ok(reps[i].bf16.decode_attention(&q)?))?;
    let candle_us = graph_us(dev, n_rep, |i| candle_attention(&q, &reps[i], batch))?;
    let fp4_eager_us = eager_us(dev, || Ok(reps[0].fp4.decode_attention(&q)?))?;
    let candle_eager_us = eager_us(dev, || candle_attention(&q, &reps[0], batch))?;

    let o4 = reps[0].fp4.decode_attention(&q)?;
    let o16 = reps[0].bf16.decode_attention(&q)?;
    let oc = candle_attention(&q, &reps[0], batch)?;
    println!(
        "ctx {ctx:6} batch {batch} ({n_rep} replicas): fp4 {fp4_us:8.1} us (eager {fp4_eager_us:8.1})  \
         bf16 kernel {bf16k_us:8.1} us  candle {candle_us:8.1} us (eager {candle_eager_us:8.1})  \
         cos(fp4, bf16) {:.4}  cos(bf16 kernel, candle) {:.5}",
        cosine(&o4, &o16)?,
        cosine(&o16, &oc)?
    );
    Ok(Row {
        ctx,
        batch,
        fp4_us,
        fp4_gbs: bytes as f64 / (fp4_us * 1e-6) / 1e9,
        fp4_eager_us,
        bf16k_us,
        candle_us,
        candle_eager_us,
    })
}

fn main() -> Result<()> {
    let dev = Device::new_cuda(0).context("a CUDA device is needed")?;
    let copy = copy_bandwidth(&dev)? / 1e9;
    println!("device-to-device copy, 2 GiB: {copy:.0} GB/s (read + write)");
    // CFP4_KV_BENCH_POINTS="32768x1,32768x8" runs only those (ctx x batch) points (profiling).
    let points: Vec<(usize, usize)> = match std::env::var("CFP4_KV_BENCH_POINTS") {
        Ok(s) => s
            .split(',')
            .map(|p| {
                let (c, b) = p
                    .split_once('x')
                    .ok_or_else(|| anyhow!("CFP4_KV_BENCH_POINTS: `{p}` is not CTXxBATCH"))?;
                Ok((c.trim().parse()?, b.trim().parse()?))
            })
            .collect::<Result<_>>()?,
        Err(_) => BATCHES
            .iter()
            .flat_map(|&b| CONTEXTS.iter().map(move |&c| (c, b)))
            .collect(),
    };
    let mut rows = Vec::new();
    for (ctx, batch) in points {
        rows.push(run_point(&dev, ctx, batch)?);
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
        "GPU us from graph replays (eager: one call incl. host dispatch); x = BF16 time / FP4 time"
    );
    println!(
        "| ctx | batch | FP4 us | FP4 GB/s | % copy | FP4 eager us | BF16 kernel us | x | candle BF16 us | x | candle eager us |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} | {:.1} | {:.0} | {:.0}% | {:.1} | {:.1} | {:.2} | {:.1} | {:.2} | {:.1} |",
            r.ctx,
            r.batch,
            r.fp4_us,
            r.fp4_gbs,
            100.0 * r.fp4_gbs / copy,
            r.fp4_eager_us,
            r.bf16k_us,
            r.bf16k_us / r.fp4_us,
            r.candle_us,
            r.candle_us / r.fp4_us,
            r.candle_eager_us
        );
    }
    Ok(())
}
