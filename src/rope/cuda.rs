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

/// The resolved kernel.
#[derive(Debug, Clone)]
pub(super) struct RopePlan {
    f: CudaFunction,
}

/// Resolves the kernel on `dev` (a lock: at model load).
pub(super) fn plan(dev: &CudaDevice) -> Result<RopePlan> {
    let image = facts(dev)?.image;
    let (f, _) = module(dev, KernelFile::Rope, image)?.function("cfp4_qkv_rope")?;
    Ok(RopePlan { f })
}

/// The call's dimensions.
pub(super) struct Shape {
    pub batch: usize,
    pub rot_heads: usize,
    pub heads: usize,
    pub d: usize,
}

#[allow(clippy::too_many_arguments)]
pub(super) fn forward(
    plan: &RopePlan,
    s: &Shape,
    x: &CudaStorage,
    lx: &Layout,
    pos: &CudaStorage,
    lp: &Layout,
    cos: &Tensor,
    sin: &Tensor,
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
    let (cst, cl) = cos.storage_and_layout();
    let (sst, sl) = sin.storage_and_layout();
    let (Storage::Cuda(cs), Storage::Cuda(ss)) = (&*cst, &*sst) else {
        bail!("{OP}: the tables are not on the GPU")
    };
    let (ca, cb) = contiguous_range(OP, "cos", cl)?;
    let (sa, sb) = contiguous_range(OP, "sin", sl)?;
    let max_pos = (cb - ca) / (s.d / 2);
    if max_pos == 0 || sb - sa != cb - ca {
        bail!("{OP}: tables of {} and {} values", cb - ca, sb - sa)
    }
    let dev = x.device().clone();
    let stream = dev.cuda_stream();
    let xs = x.as_cuda_slice::<bf16>()?.slice(xa..xb);
    let ps = pos.as_cuda_slice::<u32>()?.slice(pa..pb);
    let csl = cs.as_cuda_slice::<bf16>()?.slice(ca..cb);
    let ssl = ss.as_cuda_slice::<bf16>()?.slice(sa..sb);
    let mut out = unsafe { dev.alloc::<bf16>(n)? };
    {
        let (xp, _g0) = xs.device_ptr(&stream);
        let (pp, _g1) = ps.device_ptr(&stream);
        let (cp, _g2) = csl.device_ptr(&stream);
        let (sp, _g3) = ssl.device_ptr(&stream);
        let (op_, _g4) = out.device_ptr_mut(&stream);
        let p = QkvRopeParams {
            qkv: xp,
            positions: pp,
            cos: cp,
            sin: sp,
            out: op_,
            batch: s.batch as i32,
            rot_heads: s.rot_heads as i32,
            heads: s.heads as i32,
            d: s.d as i32,
            max_pos: max_pos as i32,
            pad: 0,
        };
        let threads = n / 2;
        let l = Launch {
            grid: (threads.div_ceil(256) as u32, 1, 1),
            block: 256,
            cluster: 1,
            pdl: false,
            smem: 0,
        };
        unsafe { launch(&stream, &plan.f, l, &p)? };
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
