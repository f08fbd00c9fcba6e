//! A packed weight as the CUDA plans bind it: its tensors' device pointers, resolved once
//! at load (a storage lock), kept alive with the plan that launches on them.

use super::layout::PackedLayout;
use crate::layout::contiguous_range;
use candle_core::cuda_backend::cudarc::driver::DevicePtr;
use candle_core::{bail, CudaDevice, Result};

/// The device pointer of the contiguous `T` tensor `t` (on the GPU).
pub(super) fn tensor_ptr<T: candle_core::cuda_backend::CudaDType>(
    t: &candle_core::Tensor,
    what: &str,
    stream: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
) -> Result<u64> {
    const OP: &str = "packed NVFP4 GEMV";
    let (st, lay) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cs) = &*st else {
        bail!("{OP}: the {what} are not on the GPU")
    };
    let (a, b) = contiguous_range(OP, what, lay)?;
    let slice = cs.as_cuda_slice::<T>()?.slice(a..b);
    let (ptr, _guard) = slice.device_ptr(stream);
    Ok(ptr)
}

/// A packed weight as the plans need it (the parts of `PackedNvfp4`, passed apart so
/// that this file does not import the op module above it).
pub(crate) struct PackedWeightRef<'a> {
    pub layout: &'a PackedLayout,
    pub codes: &'a candle_core::Tensor,
    pub scales: &'a candle_core::Tensor,
    pub global_scale: f32,
}

/// A packed weight's device pointers, resolved once (the plan keeps the tensors alive).
#[derive(Debug)]
pub(super) struct WeightPtrs {
    pub(super) w: u64,
    pub(super) s: u64,
    pub(super) global_scale: f32,
    _keep: (candle_core::Tensor, candle_core::Tensor),
}

impl WeightPtrs {
    /// The pointers of `w` on `dev` (a storage lock: call it at load).
    pub(super) fn bind(dev: &CudaDevice, w: &PackedWeightRef<'_>) -> Result<Self> {
        let stream = dev.cuda_stream();
        let wp = tensor_ptr::<u8>(w.codes, "codes", &stream)?;
        let sp = tensor_ptr::<u32>(w.scales, "scales", &stream)?;
        if !wp.is_multiple_of(16) {
            bail!("packed NVFP4 GEMV: the packed codes are not 16-byte aligned");
        }
        Ok(Self {
            w: wp,
            s: sp,
            global_scale: w.global_scale,
            _keep: (w.codes.clone(), w.scales.clone()),
        })
    }
}
