//! CUDA forward of [`AddRmsNorm`](super::AddRmsNorm) (`kernels/rmsnorm.cu`): the kernel and
//! the weight's device pointer resolved once ([`plan`]), then launched without a lookup.

use crate::cuda::{facts, launch, module, KernelFile, Launch};
use crate::kernel_params::{AddRmsNormParams, L2Prefetch};
use crate::layout::contiguous_range;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, DevicePtr, DevicePtrMut, DeviceRepr,
};
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result, Storage, Tensor};
use half::bf16;

unsafe impl DeviceRepr for AddRmsNormParams {}

/// Threads per CTA (`NORM_THREADS` of the kernel).
const THREADS: u32 = 256;
/// Longest row of the kernel's vector path (8 values per load, `NORM_VITERS` = 8 loads
/// per thread).
const VEC_MAX: usize = 8 * THREADS as usize * 8;

/// The resolved kernel and the weight's device pointer (the plan holds the weight).
#[derive(Debug, Clone)]
pub(super) struct NormPlan {
    f: CudaFunction,
    w_ptr: u64,
    pdl: bool,
    /// SMs: a launch with an L2 prefetch has one CTA per SM at least (the rows' and
    /// prefetch-only ones).
    sms: u32,
    _weight: Tensor,
}

impl NormPlan {
    /// The weight's device pointer (16-byte aligned: a fresh contiguous allocation).
    pub(super) fn w_ptr(&self) -> u64 {
        self.w_ptr
    }
}

/// Resolves the kernel on `dev` and the weight's pointer (a lock: at model load). PDL on
/// the devices that have it (sm_90 and newer).
pub(super) fn plan(dev: &CudaDevice, w: &Tensor) -> Result<NormPlan> {
    const OP: &str = "AddRmsNorm (cuda)";
    let fx = facts(dev)?;
    let (f, _) = module(dev, KernelFile::Rmsnorm, fx.image)?.function("cfp4_add_rmsnorm")?;
    let stream = dev.cuda_stream();
    let w_ptr = {
        let (st, l) = w.storage_and_layout();
        let Storage::Cuda(cs) = &*st else {
            bail!("{OP}: the weight is not on the GPU")
        };
        let (a, b) = contiguous_range(OP, "weight", l)?;
        let sl = cs.as_cuda_slice::<bf16>()?.slice(a..b);
        let (p, _g) = sl.device_ptr(&stream);
        p
    };
    Ok(NormPlan {
        f,
        w_ptr,
        pdl: fx.cc.0 >= 9,
        sms: u32::try_from(fx.sms).unwrap_or(u32::MAX),
        _weight: w.clone(),
    })
}

/// `x` (and `delta`) `[rows, n]` → `[rows, n]` (no delta) or `[2, rows, n]`; the CTAs also
/// ask L2 for `prefetch`'s ranges (on sm_90 and newer).
pub(super) fn forward(
    plan: &NormPlan,
    n: usize,
    eps: f32,
    x: &CudaStorage,
    lx: &Layout,
    delta: Option<(&CudaStorage, &Layout)>,
    prefetch: &L2Prefetch,
) -> Result<CudaStorage> {
    const OP: &str = "AddRmsNorm (cuda)";
    let (xa, xb) = contiguous_range(OP, "x", lx)?;
    let len = xb - xa;
    let rows = len / n;
    if rows * n != len || rows > i32::MAX as usize {
        bail!("{OP}: x has {len} values, not whole rows of {n}")
    }
    let dev = x.device().clone();
    let stream = dev.cuda_stream();
    let xs = x.as_cuda_slice::<bf16>()?.slice(xa..xb);
    let parts = if delta.is_some() { 2 } else { 1 };
    let mut out = unsafe { dev.alloc::<bf16>(parts * len)? };
    let ds = match delta {
        Some((d, ld)) => {
            let (da, db) = contiguous_range(OP, "delta", ld)?;
            if db - da != len {
                bail!("{OP}: delta has {} values, x {len}", db - da)
            }
            Some(d.as_cuda_slice::<bf16>()?.slice(da..db))
        }
        None => None,
    };
    if rows > 0 {
        let (xp, _g0) = xs.device_ptr(&stream);
        let dg = ds.as_ref().map(|d| d.device_ptr(&stream));
        let (op_, _g2) = out.device_ptr_mut(&stream);
        let elem = std::mem::size_of::<bf16>() as u64;
        // With a delta the sum is the first half of `out` and the norm the second.
        let (sum, norm) = match &dg {
            Some(_) => (op_, op_ + (len as u64) * elem),
            None => (0, op_),
        };
        let delta = dg.as_ref().map_or(0, |(p, _)| *p);
        let aligned = [xp, delta, plan.w_ptr, sum, norm]
            .iter()
            .all(|a| a.is_multiple_of(16));
        let p = AddRmsNormParams {
            x: xp,
            delta,
            weight: plan.w_ptr,
            sum,
            out: norm,
            rows: rows as i32,
            n: n as i32,
            eps,
            vec: i32::from(aligned && n.is_multiple_of(8) && n <= VEC_MAX),
            prefetch: *prefetch,
        };
        // With a prefetch, CTAs past the rows up to one per SM issue it (the kernel's
        // prefetch-only CTAs).
        let prefetching = prefetch.ptr.iter().any(|&p| p != 0);
        let grid = if prefetching {
            (rows as u32).max(plan.sms)
        } else {
            rows as u32
        };
        let l = Launch {
            grid: (grid, 1, 1),
            block: THREADS,
            cluster: 1,
            pdl: plan.pdl,
            smem: 0,
        };
        unsafe { launch(&stream, &plan.f, l, &p)? };
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
