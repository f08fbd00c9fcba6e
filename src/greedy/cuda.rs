//! CUDA forward of [`GreedyStep`](super::GreedyStep) (`kernels/greedy.cu`): the kernel, its
//! grid and its zeroed scratch made once ([`plan`]), then launched without a lookup.

use crate::cuda::{facts, launch, module, KernelFile, Launch};
use crate::kernel_params::GreedyParams;
use crate::layout::contiguous_range;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr,
};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result};

unsafe impl DeviceRepr for GreedyParams {}

/// Logits per CTA: 16 per thread of 256, ~32 CTAs per row at a 128k vocabulary.
const CHUNK: usize = 4096;
const THREADS: u32 = 256;

/// The kernel, PDL, and the scratch the kernel keeps zeroed between calls: the best key and
/// the CTA ticket of each row (their pointers resolved here; calls on one stream run in
/// order, so they never overlap on it).
#[derive(Debug)]
pub(super) struct GreedyPlan {
    f: CudaFunction,
    pdl: bool,
    _best: CudaSlice<u64>,
    _done: CudaSlice<u32>,
    best_ptr: u64,
    done_ptr: u64,
}

pub(super) fn plan(dev: &CudaDevice, rows: usize) -> Result<GreedyPlan> {
    let fx = facts(dev)?;
    let (f, _) = module(dev, KernelFile::Greedy, fx.image)?.function("cfp4_greedy")?;
    let stream = dev.cuda_stream();
    let best = stream
        .alloc_zeros::<u64>(rows)
        .map_err(|e| crate::cuda::cuda_err("GreedyStep scratch", e))?;
    let done = stream
        .alloc_zeros::<u32>(rows)
        .map_err(|e| crate::cuda::cuda_err("GreedyStep scratch", e))?;
    let best_ptr = best.device_ptr(&stream).0;
    let done_ptr = done.device_ptr(&stream).0;
    Ok(GreedyPlan {
        f,
        pdl: fx.cc.0 >= 9,
        _best: best,
        _done: done,
        best_ptr,
        done_ptr,
    })
}

/// The op's `rows × vocab` call.
pub(super) fn forward(
    plan: &GreedyPlan,
    (r, n): (usize, usize),
    st: &mut CudaStorage,
    lst: &Layout,
    logits: &CudaStorage,
    ll: &Layout,
) -> Result<()> {
    const OP: &str = "GreedyStep (cuda)";
    let (sa, sb) = contiguous_range(OP, "state", lst)?;
    let (la, lb) = contiguous_range(OP, "logits", ll)?;
    if sb - sa != 2 * r || lb - la != r * n {
        bail!(
            "{OP}: state of {} and logits of {} values for {r} rows of {n}",
            sb - sa,
            lb - la
        )
    }
    let dev = logits.device().clone();
    let stream = dev.cuda_stream();
    let f32 = logits.dtype() == DType::F32;
    let mut state = st.as_cuda_slice_mut::<u32>()?.slice_mut(sa..sb);
    let lp = if f32 {
        logits
            .as_cuda_slice::<f32>()?
            .slice(la..lb)
            .device_ptr(&stream)
            .0
    } else {
        logits
            .as_cuda_slice::<half::bf16>()?
            .slice(la..lb)
            .device_ptr(&stream)
            .0
    };
    let (sp, _g) = state.device_ptr_mut(&stream);
    let p = GreedyParams {
        logits: lp,
        ids: sp,
        positions: sp + 4 * r as u64,
        best: plan.best_ptr,
        done: plan.done_ptr,
        rows: r as i32,
        n: n as i32,
        chunk: CHUNK as i32,
        f32: i32::from(f32),
    };
    let l = Launch {
        grid: (n.div_ceil(CHUNK) as u32, r as u32, 1),
        block: THREADS,
        cluster: 1,
        pdl: plan.pdl,
        smem: 0,
    };
    unsafe { launch(&stream, &plan.f, l, &p) }
}
