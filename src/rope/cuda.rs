//! CUDA forward of [`QkvRope`](super::QkvRope) (`kernels/rope.cu`): the kernel resolved
//! once when the op is made ([`plan`]), then launched without a lookup.

use crate::cuda::{facts, launch, module, KernelFile, Launch};
use crate::kernel_params::QkvRopeParams;
use crate::layout::contiguous_range;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, DevicePtr, DevicePtrMut, DeviceRepr,
};
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result, Storage, Tensor};
use half::bf16;

unsafe impl DeviceRepr for QkvRopeParams {}

/// Threads per CTA (`ROPE_THREADS` of the kernel).
const THREADS: u32 = 1024;

/// The resolved kernel and the tables' device pointers, made once per op (the plan holds
/// the tables, so the pointers stay valid).
#[derive(Debug, Clone)]
pub(super) struct RopePlan {
    f: CudaFunction,
    cos_ptr: u64,
    sin_ptr: u64,
    max_pos: usize,
    _tables: (Tensor, Tensor),
}

impl RopePlan {
    /// The tables' device pointers (cos, sin) and rows.
    pub(super) fn tables(&self) -> (u64, u64, usize) {
        (self.cos_ptr, self.sin_ptr, self.max_pos)
    }
}

/// Resolves the kernel on `dev` and the tables' pointers (a lock: at model load).
pub(super) fn plan(dev: &CudaDevice, cos: &Tensor, sin: &Tensor, d: usize) -> Result<RopePlan> {
    const OP: &str = "QkvRope (cuda)";
    let image = facts(dev)?.image;
    let (f, _) = module(dev, KernelFile::Rope, image)?.function("cfp4_qkv_rope")?;
    let stream = dev.cuda_stream();
    let ptr = |t: &Tensor, what: &str| -> Result<(u64, usize)> {
        let (st, l) = t.storage_and_layout();
        let Storage::Cuda(cs) = &*st else {
            bail!("{OP}: the {what} table is not on the GPU")
        };
        let (a, b) = contiguous_range(OP, what, l)?;
        let sl = cs.as_cuda_slice::<bf16>()?.slice(a..b);
        let (p, _g) = sl.device_ptr(&stream);
        Ok((p, b - a))
    };
    let (cos_ptr, nc) = ptr(cos, "cos")?;
    let (sin_ptr, ns) = ptr(sin, "sin")?;
    let max_pos = nc / (d / 2);
    if max_pos == 0 || ns != nc {
        bail!("{OP}: tables of {nc} and {ns} values")
    }
    Ok(RopePlan {
        f,
        cos_ptr,
        sin_ptr,
        max_pos,
        _tables: (cos.clone(), sin.clone()),
    })
}

/// The call's dimensions.
pub(super) struct Shape {
    pub batch: usize,
    pub rot_heads: usize,
    pub heads: usize,
    pub d: usize,
}

pub(super) fn forward(
    plan: &RopePlan,
    s: &Shape,
    x: &CudaStorage,
    lx: &Layout,
    pos: &CudaStorage,
    lp: &Layout,
) -> Result<CudaStorage> {
    const OP: &str = "QkvRope (cuda)";
    let (xa, xb) = contiguous_range(OP, "qkv", lx)?;
    let (pa, pb) = contiguous_range(OP, "positions", lp)?;
    let n = s.batch * s.heads * s.d;
    if xb - xa != n || pb - pa != s.batch {
        bail!(
            "{OP}: qkv has {} values and positions {}, expected {n} and {}",
            xb - xa,
            pb - pa,
            s.batch
        )
    }
    let dev = x.device().clone();
    let stream = dev.cuda_stream();
    let xs = x.as_cuda_slice::<bf16>()?.slice(xa..xb);
    let ps = pos.as_cuda_slice::<u32>()?.slice(pa..pb);
    let mut out = unsafe { dev.alloc::<bf16>(n)? };
    {
        let (xp, _g0) = xs.device_ptr(&stream);
        let (pp, _g1) = ps.device_ptr(&stream);
        let (op_, _g4) = out.device_ptr_mut(&stream);
        let p = QkvRopeParams {
            qkv: xp,
            positions: pp,
            cos: plan.cos_ptr,
            sin: plan.sin_ptr,
            out: op_,
            batch: s.batch as i32,
            rot_heads: s.rot_heads as i32,
            heads: s.heads as i32,
            d: s.d as i32,
            max_pos: plan.max_pos as i32,
            pad: 0,
        };
        // The q heads' CTAs, then one CTA for the k and v heads, per row (rope.cu).
        let q_items = (s.rot_heads - (s.heads - s.rot_heads)) * (s.d / 2);
        let l = Launch {
            grid: (
                (q_items.div_ceil(THREADS as usize) + 1) as u32,
                s.batch as u32,
                1,
            ),
            block: THREADS,
            cluster: 1,
            pdl: false,
            smem: 0,
        };
        unsafe { launch(&stream, &plan.f, l, &p)? };
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
