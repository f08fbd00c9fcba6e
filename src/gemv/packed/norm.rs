//! The packed NVFP4 GEMV with the RMSNorm in front of it run in its prologue (CUDA only;
//! `kernels/gemv_packed.cu`, the norm variants): `(s, y) = (x + delta, gemv(rms_norm(s) ·
//! w_norm))` in one kernel, where the decode step ran the fused add + norm kernel and then
//! the GEMV. The CPU (and every shape this does not serve) runs that composition itself:
//! [`AddRmsNorm::forward`](crate::norm::AddRmsNorm::forward), then the GEMV; the numerics
//! are the same but for the order of the norm's f32 sum of squares.

use super::cuda_norm::{forward_norm, NormGemvPlan};
use crate::norm::AddRmsNorm;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use std::sync::Arc;

/// The op: inputs the residual stream `x` (and `delta`); output one BF16 buffer,
/// `[m·K sums | m·N_out outputs]` (without a delta: the outputs alone).
struct PackedNormGemv<'a> {
    plan: &'a NormGemvPlan,
    norm_w: u64,
    eps: f32,
}

impl CustomOp1 for PackedNormGemv<'_> {
    fn name(&self) -> &'static str {
        "nvfp4-packed-norm-gemv"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("packed NVFP4 GEMV (norm): CUDA only (the CPU runs the norm, then the GEMV)")
    }

    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        forward_norm(self.plan, self.norm_w, self.eps, s, l, None)
    }
}

impl CustomOp2 for PackedNormGemv<'_> {
    fn name(&self) -> &'static str {
        "nvfp4-packed-add-norm-gemv"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("packed NVFP4 GEMV (norm): CUDA only (the CPU runs the norm, then the GEMV)")
    }

    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        forward_norm(self.plan, self.norm_w, self.eps, s1, l1, Some((s2, l2)))
    }
}

/// `(x + delta, gemv(rms_norm(x + delta) · w_norm))` for BF16 `x` `[m, K]` on the GPU (and
/// `delta` of the same shape, or `None`: then the first output is `x`), `norm` on the same
/// GPU, through `plan` (the layer's; `n_out` its output width).
pub(crate) fn packed_norm_gemv(
    x: &Tensor,
    delta: Option<&Tensor>,
    norm: &AddRmsNorm,
    plan: &Arc<NormGemvPlan>,
    n_out: usize,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "packed NVFP4 GEMV (norm)";
    let (m, k) = x.dims2()?;
    if x.dtype() != DType::BF16 || norm.dim() != k {
        bail!(
            "{OP}: x must be BF16 [m, {}], got {:?} {:?}",
            norm.dim(),
            x.dtype(),
            x.dims()
        );
    }
    let Some(norm_w) = norm.cuda_weight_ptr() else {
        bail!("{OP}: the norm weight is not on the GPU");
    };
    let op = PackedNormGemv {
        plan,
        norm_w,
        eps: norm.eps(),
    };
    let x = x.contiguous()?;
    match delta {
        None => {
            let y = x.apply_op1_no_bwd(&op)?.reshape((m, n_out))?;
            Ok((x, y))
        }
        Some(d) => {
            if d.dims() != x.dims() || d.dtype() != DType::BF16 {
                bail!(
                    "{OP}: delta must be BF16 {:?} like x, got {:?} {:?}",
                    x.dims(),
                    d.dtype(),
                    d.dims()
                );
            }
            let both = x.apply_op2_no_bwd(&d.contiguous()?, &op)?;
            let s = both.narrow(0, 0, m * k)?.reshape((m, k))?;
            let y = both.narrow(0, m * k, m * n_out)?.reshape((m, n_out))?;
            Ok((s, y))
        }
    }
}
