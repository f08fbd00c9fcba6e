//! CUDA forward of the packer and the dequantizer of the packed-NVFP4 layout
//! (`kernels/gemv_pack.cu`). Planned per call: they run once, when a layer is loaded.

use super::layout::PackedLayout;
use crate::cuda::{facts, launch, module, KernelFile, Launch};
use crate::kernel_params::{PackParams, PackedDequantParams};
use crate::layout::contiguous_range;
use crate::nvfp4::{swizzled_shape, BLOCK_SIZE};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::{bail, CudaStorage, Layout, Result, Shape};
use half::bf16;

unsafe impl DeviceRepr for PackParams {}
unsafe impl DeviceRepr for PackedDequantParams {}

/// Packs the codes (`codes` true: inputs codes + swizzled scales → U8 packed codes) or
/// the scales (inputs: the swizzled scales twice → U32 scale words).
pub(crate) fn pack(
    l: &PackedLayout,
    a: &CudaStorage,
    la: &Layout,
    b: &CudaStorage,
    lb: &Layout,
    codes: bool,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "nvfp4-pack";
    let dev = a.device().clone();
    let stream = dev.cuda_stream();
    let image = facts(&dev)?.image;
    let name = if codes {
        "cfp4_pack_codes"
    } else {
        "cfp4_pack_scales"
    };
    let (f, _) = module(&dev, KernelFile::GemvPack, image)?.function(name)?;
    let (s0, s1) = contiguous_range(OP, "scales", lb)?;
    let scales = b.as_cuda_slice::<u8>()?.slice(s0..s1);
    let (sp_ptr, _gs) = scales.device_ptr(&stream);
    let mut p = PackParams {
        codes: 0,
        scales: sp_ptr,
        out_codes: 0,
        out_scales: 0,
        n: l.n as i32,
        k: l.k as i32,
        sp: swizzled_shape(l.n, l.k / BLOCK_SIZE).1 as i32,
        half_pad: l.half_pad as i32,
        tiles: l.tiles as i32,
        npairs: l.npairs as i32,
    };
    if codes {
        let (c0, c1) = contiguous_range(OP, "codes", la)?;
        let cs = a.as_cuda_slice::<u8>()?.slice(c0..c1);
        let mut out = dev.alloc_zeros::<u8>(l.code_bytes())?;
        {
            let (cp, _gc) = cs.device_ptr(&stream);
            let (op_, _go) = out.device_ptr_mut(&stream);
            p.codes = cp;
            p.out_codes = op_;
            unsafe { launch(&stream, &f, Launch::one_d(OP, l.code_bytes() / 16)?, &p)? };
        }
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from(l.code_bytes()),
        ))
    } else {
        let mut out = dev.alloc_zeros::<u32>(l.scale_words())?;
        {
            let (op_, _go) = out.device_ptr_mut(&stream);
            p.out_scales = op_;
            unsafe { launch(&stream, &f, Launch::one_d(OP, l.scale_words())?, &p)? };
        }
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from(l.scale_words()),
        ))
    }
}

/// Exact BF16 `[N, K]` from the packed codes and scale words.
pub(crate) fn dequantize(
    l: &PackedLayout,
    c: &CudaStorage,
    lc: &Layout,
    s: &CudaStorage,
    ls: &Layout,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "nvfp4-packed-dequantize";
    let dev = c.device().clone();
    let stream = dev.cuda_stream();
    let image = facts(&dev)?.image;
    let (f, _) = module(&dev, KernelFile::GemvPack, image)?.function("cfp4_dequantize_packed")?;
    let (c0, c1) = contiguous_range(OP, "codes", lc)?;
    let (s0, s1) = contiguous_range(OP, "scales", ls)?;
    if c1 - c0 != l.code_bytes() || s1 - s0 != l.scale_words() {
        bail!("{OP}: storages do not match the [{}, {}] layout", l.n, l.k);
    }
    let cs = c.as_cuda_slice::<u8>()?.slice(c0..c1);
    let ss = s.as_cuda_slice::<u32>()?.slice(s0..s1);
    let mut out = unsafe { dev.alloc::<bf16>(l.n * l.k)? };
    {
        let (cp, _g1) = cs.device_ptr(&stream);
        let (sp, _g2) = ss.device_ptr(&stream);
        let (op_, _g3) = out.device_ptr_mut(&stream);
        let p = PackedDequantParams {
            w: cp,
            scales: sp,
            out: op_,
            n: l.n as i32,
            k: l.k as i32,
            half_pad: l.half_pad as i32,
            tiles: l.tiles as i32,
            npairs: l.npairs as i32,
            pad: 0,
        };
        unsafe { launch(&stream, &f, Launch::one_d(OP, l.code_bytes() / 4)?, &p)? };
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from((l.n, l.k)),
    ))
}
