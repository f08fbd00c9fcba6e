//! CUDA forwards of the ops (feature `cuda`).

use crate::gemv::{Bf16Gemv, Nvfp4Gemv};
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result, Shape};

/// Architecture tag (`sm90`, `sm100`, ...) of a CUDA device.
pub fn arch_tag(_dev: &CudaDevice) -> Result<String> {
    bail!("candle-fp4: CUDA kernels are not built yet")
}

pub(crate) fn nvfp4_gemv_cuda(
    _op: &Nvfp4Gemv,
    _x: &CudaStorage,
    _lx: &Layout,
    _w: &CudaStorage,
    _lw: &Layout,
    _s: &CudaStorage,
    _ls: &Layout,
) -> Result<(CudaStorage, Shape)> {
    bail!("nvfp4_gemv: the CUDA kernel is not implemented yet")
}

pub(crate) fn bf16_gemv_cuda(
    _op: &Bf16Gemv,
    _x: &CudaStorage,
    _lx: &Layout,
    _w: &CudaStorage,
    _lw: &Layout,
) -> Result<(CudaStorage, Shape)> {
    bail!("bf16_gemv: the CUDA kernel is not implemented yet")
}

pub(crate) fn dequantize_rows_cuda(
    _w: &CudaStorage,
    _lw: &Layout,
    _s: &CudaStorage,
    _ls: &Layout,
) -> Result<(CudaStorage, Shape)> {
    bail!("dequantize_rows: the CUDA kernel is not implemented yet")
}
