//! GPU timing for the benchmarks and the `tune` binary (feature `cuda`): CUDA-graph replays
//! timed with CUDA events, and the device-to-device copy bandwidth they are compared with.
//! Not on any model path.

use candle_core::cuda_backend::cudarc::driver::{sys, CudaStream};
use candle_core::{bail, Device, Result};
use std::sync::Arc;

fn cuda_stream(dev: &Device, what: &str) -> Result<Arc<CudaStream>> {
    match dev {
        Device::Cuda(d) => Ok(d.cuda_stream()),
        _ => bail!("{what}: needs a CUDA device"),
    }
}

fn err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("{what}: {e:?}"))
}

/// Median milliseconds between two events around `f` on `st`, over `n` runs.
fn median_ms(st: &CudaStream, n: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    const WHAT: &str = "timing";
    let mut t = Vec::with_capacity(n);
    for _ in 0..n.max(1) {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let a = st.record_event(flags).map_err(|e| err(WHAT, e))?;
        f()?;
        let b = st.record_event(flags).map_err(|e| err(WHAT, e))?;
        b.synchronize().map_err(|e| err(WHAT, e))?;
        t.push(a.elapsed_ms(&b).map_err(|e| err(WHAT, e))? as f64);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// Median GPU milliseconds per call of `f`: `warmup` (at least one) eager calls (module
/// loads, cuBLAS handles, candle's layout uploads), then `calls` calls (`f(i)`, `i` the call's index) captured in one CUDA graph,
/// replayed once untimed and `replays` times between CUDA events.
pub fn graph_ms_per_call(
    dev: &Device,
    calls: usize,
    warmup: usize,
    replays: usize,
    mut f: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    const WHAT: &str = "graph_ms_per_call";
    let st = cuda_stream(dev, WHAT)?;
    // candle uploads a strided op's layout (dims, strides) from host memory per launch; its
    // htod cache keeps persistent device copies, filled by the warm-up and read by the
    // capture, so the graph never copies from freed host memory (as the decode step's graph).
    let _cache = match dev {
        Device::Cuda(d) => d.enable_cuda_graph_htod_cache(),
        _ => bail!("{WHAT}: needs a CUDA device"),
    };
    for i in 0..calls.min(warmup.max(1)) {
        f(i)?;
    }
    dev.synchronize()?;
    st.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| err(WHAT, e))?;
    let mut res = Ok(());
    for i in 0..calls {
        if let Err(e) = f(i) {
            res = Err(e);
            break;
        }
    }
    // End the capture whatever happened, so the stream is usable again.
    let graph = st
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .map_err(|e| err(WHAT, e))?;
    res?;
    let Some(graph) = graph else {
        bail!("{WHAT}: the capture recorded no work")
    };
    graph.upload().map_err(|e| err(WHAT, e))?;
    graph.launch().map_err(|e| err(WHAT, e))?;
    dev.synchronize()?;
    let ms = median_ms(&st, replays, || graph.launch().map_err(|e| err(WHAT, e)))?;
    Ok(ms / calls.max(1) as f64)
}

/// Device-to-device copy bandwidth, bytes read + written per second: a 2 GiB
/// `cuMemcpyDtoDAsync` (eager: a graph's memcpy node ran at ~2.7 TB/s on the H200), median
/// of 9 timed copies.
pub fn copy_bandwidth(dev: &Device) -> Result<f64> {
    const WHAT: &str = "copy_bandwidth";
    let st = cuda_stream(dev, WHAT)?;
    let bytes = 2usize << 30;
    let a = st.alloc_zeros::<u8>(bytes).map_err(|e| err(WHAT, e))?;
    let mut b = st.alloc_zeros::<u8>(bytes).map_err(|e| err(WHAT, e))?;
    st.memcpy_dtod(&a, &mut b).map_err(|e| err(WHAT, e))?;
    let ms = median_ms(&st, 9, || {
        st.memcpy_dtod(&a, &mut b).map_err(|e| err(WHAT, e))
    })?;
    Ok(2.0 * bytes as f64 / (ms * 1e-3))
}
