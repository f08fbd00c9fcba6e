//! CUDA forward of [`dequantize_rows`](super::dequantize_rows) (`cfp4_dequantize_rows` in
//! `kernels/gemv.cu`). Model loading and the matmul path call it, so it looks its kernel
//! up per call (a cache lookup under a lock).

use super::codec::BLOCK_SIZE;
use super::swizzle::swizzled_shape;
use crate::cuda::{facts, launch, module, KernelFile, Launch};
use crate::kernel_params::DequantParams;
use crate::layout::contiguous_range;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::{bail, CudaStorage, Layout, Result, Shape};
use half::bf16;

unsafe impl DeviceRepr for DequantParams {}

pub(crate) fn dequantize_rows_cuda(
    w: &CudaStorage,
    lw: &Layout,
    s: &CudaStorage,
    ls: &Layout,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "dequantize_rows";
    let dev = w.device().clone();
    let stream = dev.cuda_stream();
    let (n, k2) = lw.shape().dims2()?;
    let k = 2 * k2;
    let (a, b) = contiguous_range(OP, "weight", lw)?;
    let (sa, sb) = contiguous_range(OP, "weight_scale", ls)?;
    if a % 4 != 0 {
        bail!("{OP}: weight must start 4-byte aligned (offset {a})");
    }
    let image = facts(&dev)?.image;
    let (f, _) = module(&dev, KernelFile::Gemv, image)?.function("cfp4_dequantize_rows")?;
    let cs = w.as_cuda_slice::<u8>()?.slice(a..b);
    let ss = s.as_cuda_slice::<u8>()?.slice(sa..sb);
    let mut out = unsafe { dev.alloc::<bf16>(n * k)? };
    {
        let (cp, _g1) = cs.device_ptr(&stream);
        let (sp, _g2) = ss.device_ptr(&stream);
        let (op_, _g3) = out.device_ptr_mut(&stream);
        let params = DequantParams {
            codes: cp,
            scales: sp,
            out: op_,
            n: n as i32,
            k: k as i32,
            sp: swizzled_shape(n, k / BLOCK_SIZE).1 as i32,
            pad: 0,
        };
        let l = Launch::one_d(OP, n * k / 8)?;
        unsafe { launch(&stream, &f, l, &params)? };
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((n, k))))
}
