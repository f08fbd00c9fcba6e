//! Host cost of one call (feature `cuda`): what our dispatch adds on the CPU per
//! `QuantLinear::forward` at M = 1 and per decode-attention call, against candle's bare
//! CustomOp dispatch (a CustomOp that allocates the same output and launches an empty
//! kernel through candle's `get_or_load_custom_func`, the pattern candle ops use).
//!
//! Per case: `gpu` = GPU µs per call from CUDA-graph replays (the same call captured);
//! `issue` = host µs per call while issuing 200 calls back to back without a sync (the GPU
//! queue never fills: the calls return as soon as they are queued), median of 9 rounds;
//! `eager` = wall µs per call of 2,000 calls and one sync. `ours − bare` is the host work our
//! op adds above candle's dispatch. Uses only APIs that also existed before the restructuring,
//! so the same file builds against the old tree (same-run before/after).
//!
//! Run: the built binary with `--bench`. Prints the table last.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{sys, LaunchConfig, PushKernelArg};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};
use candle_fp4::kv_cache::{CacheShape, KvCache, KvCacheKind};
use candle_fp4::nvfp4::quantize_nvfp4;
use candle_fp4::quant_linear::QuantLinear;
use candle_nn::Module;
use std::time::Instant;

type R<T> = candle_core::Result<T>;

fn err(e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("{e:?}"))
}

const NOOP_PTX: &str = r#"
.version 8.0
.target sm_80
.address_size 64
.visible .entry cfp4_bench_noop(.param .u64 p) { ret; }
"#;

/// candle's bare CustomOp dispatch: allocate `[m, n]` BF16, launch an empty kernel.
struct Bare {
    n: usize,
}

impl CustomOp1 for Bare {
    fn name(&self) -> &'static str {
        "bare"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> R<(CpuStorage, Shape)> {
        candle_core::bail!("bare: CUDA only")
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> R<(CudaStorage, Shape)> {
        let dev = s.device().clone();
        let m = l.shape().dims()[0];
        let f = dev.get_or_load_custom_func("cfp4_bench_noop", "cfp4_bench_noop", NOOP_PTX)?;
        let out = unsafe { dev.alloc::<half::bf16>(m * self.n)? };
        let x = s.as_cuda_slice::<half::bf16>()?;
        let mut b = f.builder();
        b.arg(x);
        unsafe { b.launch(LaunchConfig::for_num_elems(1)) }.map_err(err)?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((m, self.n)),
        ))
    }
}

fn stream(dev: &Device) -> std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream> {
    match dev {
        Device::Cuda(d) => d.cuda_stream(),
        _ => unreachable!("the bench runs on CUDA"),
    }
}

/// GPU µs per call from graph replays of `calls` calls (median of 9).
fn gpu_us(dev: &Device, calls: usize, f: &dyn Fn() -> R<Tensor>) -> R<f64> {
    let st = stream(dev);
    for _ in 0..8 {
        f()?;
    }
    dev.synchronize()?;
    st.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(err)?;
    let mut res = Ok(());
    for _ in 0..calls {
        if let Err(e) = f() {
            res = Err(e);
            break;
        }
    }
    let g = st
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .map_err(err)?;
    res?;
    let g = g.ok_or_else(|| err("empty graph"))?;
    g.upload().map_err(err)?;
    g.launch().map_err(err)?;
    dev.synchronize()?;
    let mut t = Vec::new();
    for _ in 0..9 {
        let a = st
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(err)?;
        g.launch().map_err(err)?;
        let b = st
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(err)?;
        b.synchronize().map_err(err)?;
        t.push(a.elapsed_ms(&b).map_err(err)? as f64 * 1e3 / calls as f64);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// (issue µs per call: 200 calls without a sync, median of 9 rounds; eager wall µs per call:
/// 2,000 calls, one sync).
fn host_us(dev: &Device, f: &dyn Fn() -> R<Tensor>) -> R<(f64, f64)> {
    for _ in 0..50 {
        f()?;
    }
    dev.synchronize()?;
    let mut issue = Vec::new();
    for _ in 0..9 {
        let t = Instant::now();
        for _ in 0..200 {
            f()?;
        }
        issue.push(t.elapsed().as_secs_f64() * 1e6 / 200.0);
        dev.synchronize()?;
    }
    issue.sort_by(f64::total_cmp);
    let t = Instant::now();
    for _ in 0..2000 {
        f()?;
    }
    dev.synchronize()?;
    Ok((issue[4], t.elapsed().as_secs_f64() * 1e6 / 2000.0))
}

struct Row {
    what: String,
    gpu: f64,
    issue: f64,
    eager: f64,
    bare_issue: f64,
}

fn main() -> R<()> {
    if !std::env::args().any(|a| a == "--bench") {
        return Ok(());
    }
    let dev = Device::new_cuda(0)?;
    let mut rows = Vec::new();
    for (n, k) in [(576usize, 576usize), (4096, 4096)] {
        let w = Tensor::randn(0f32, 0.02, (n, k), &Device::Cpu)?;
        let q = quantize_nvfp4(&w)?;
        let layer = QuantLinear::from_nvfp4(&q, None, &dev)?;
        let x = Tensor::randn(0f32, 1.0, (1, k), &dev)?.to_dtype(DType::BF16)?;
        let f = || layer.forward(&x);
        let bare = Bare { n };
        let fb = || x.apply_op1_no_bwd(&bare);
        let gpu = gpu_us(&dev, 64, &f)?;
        let (issue, eager) = host_us(&dev, &f)?;
        let (bare_issue, _) = host_us(&dev, &fb)?;
        rows.push(Row {
            what: format!("QuantLinear NVFP4 {n}x{k}, M = 1"),
            gpu,
            issue,
            eager,
            bare_issue,
        });
    }
    for (kind, ctx) in [
        (KvCacheKind::UltraQuant, 4096usize),
        (KvCacheKind::Bf16, 4096),
    ] {
        let sh = CacheShape {
            batch: 1,
            capacity: ctx,
            kv_heads: 8,
            head_dim: 128,
        };
        let mut c = KvCache::new(kind, sh, &dev)?;
        let kv = Tensor::randn(0f32, 1.0, (1, ctx, 8, 128), &dev)?.to_dtype(DType::BF16)?;
        c.append(&kv, &kv)?;
        let q = Tensor::randn(0f32, 1.0, (1, 32, 128), &dev)?.to_dtype(DType::BF16)?;
        let f = || c.decode_attention(&q);
        let bare = Bare { n: 32 * 128 };
        let q2 = q.reshape((1, 32 * 128))?;
        let fb = || q2.apply_op1_no_bwd(&bare);
        let gpu = gpu_us(&dev, 64, &f)?;
        let (issue, eager) = host_us(&dev, &f)?;
        let (bare_issue, _) = host_us(&dev, &fb)?;
        rows.push(Row {
            what: format!("decode attention {kind:?} ctx {ctx}, 32/8 heads, d 128"),
            gpu,
            issue,
            eager,
            bare_issue,
        });
    }
    println!(
        "| call | GPU µs (graph) | issue µs | eager µs | bare CustomOp issue µs | ours − bare µs |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            r.what,
            r.gpu,
            r.issue,
            r.eager,
            r.bare_issue,
            r.issue - r.bare_issue
        );
    }
    Ok(())
}
