//! The packed GEMV kernel over a BF16 weight in its natural `[N, K]` layout, as a public op:
//! a plan made once per weight shape and epilogue ([`plan_bf16_gemv`], [`plan_bf16_gemv_with`]) and its launch
//! ([`bf16_gemv_planned_packed`]). CUDA only; the CPU runs [`bf16_gemv`](crate::gemv::bf16_gemv).

#[cfg(feature = "cuda")]
use super::cuda_bf16::{bf16_gemv_packed_planned, plan_bf16, Bf16Plan};
use crate::gemv::checks::check_x;
use crate::gemv::options::GemvKnobs;
use candle_core::{bail, DType, Result, Tensor};

/// A launch of the packed GEMV kernel over a BF16 weight in its natural `[N, K]` layout,
/// planned once for one weight shape and epilogue (CUDA, up to 8 tokens): what
/// [`QuantLinear`](crate::quant_linear::QuantLinear) runs for a BF16 layer at one token
/// tile, for benchmarks, `tune` and tests.
#[derive(Debug, Clone)]
pub struct Bf16GemvPlan {
    #[cfg(feature = "cuda")]
    plan: std::sync::Arc<Bf16Plan>,
}

impl Bf16GemvPlan {
    /// The CUDA kernel this plan launches for `m` tokens (`None` outside `1..=8`).
    pub fn kernel_for(&self, m: usize) -> Option<&str> {
        #[cfg(feature = "cuda")]
        return self.plan.kernel_for(m);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = m;
            None
        }
    }
}

/// Plans the BF16-weight GEMV of `w` (BF16 `[N, K]` on a CUDA device) with or without the
/// `silu_mul` epilogue; `pdl`: programmatic dependent launch. `None` on the CPU and where
/// the kernels do not serve the shape (`K` not a multiple of 64, odd `N` with `silu_mul`).
pub fn plan_bf16_gemv(w: &Tensor, silu_mul: bool, pdl: bool) -> Result<Option<Bf16GemvPlan>> {
    plan_bf16_gemv_with(w, silu_mul, &GemvKnobs::with_pdl(pdl))
}

/// [`plan_bf16_gemv`] with the launch knobs: `pdl`, the kernel image (`Sm80`: the sm_80
/// code); the token tile and split knobs do not apply (one token tile, the rule's split).
pub fn plan_bf16_gemv_with(
    w: &Tensor,
    silu_mul: bool,
    knobs: &GemvKnobs,
) -> Result<Option<Bf16GemvPlan>> {
    let (n, k) = w.dims2()?;
    if w.dtype() != DType::BF16 {
        bail!(
            "plan_bf16_gemv: the weight must be BF16, got {:?}",
            w.dtype()
        );
    }
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = w.device() {
        let sm80 = knobs.image == crate::gemv::options::KernelImage::Sm80;
        return Ok(
            plan_bf16(d, n, k, silu_mul, knobs.pdl, sm80)?.map(|p| Bf16GemvPlan {
                plan: std::sync::Arc::new(p),
            }),
        );
    }
    let _ = (n, k, silu_mul, knobs);
    Ok(None)
}

/// `x` BF16 `[M, K]` (M ≤ 8) times `w` (BF16 `[N, K]`, contiguous) transposed by `plan`
/// (made by [`plan_bf16_gemv`] for `w`'s shape): BF16 `[M, N]`, or `[M, N/2]` =
/// `silu(gate)·up` for a `silu_mul` plan. FP32 accumulation, one rounding.
pub fn bf16_gemv_planned_packed(x: &Tensor, w: &Tensor, plan: &Bf16GemvPlan) -> Result<Tensor> {
    const OP: &str = "bf16_gemv_planned_packed";
    let (_, k) = check_x(OP, x)?;
    if w.dtype() != DType::BF16 {
        bail!("{OP}: the weight must be BF16, got {:?}", w.dtype());
    }
    if w.dims2()?.1 != k {
        bail!("{OP}: x has K = {k}, the weight is {:?}", w.dims());
    }
    if !x.device().same_device(w.device()) {
        bail!("{OP}: x and the weight are on different devices");
    }
    #[cfg(feature = "cuda")]
    return bf16_gemv_packed_planned(x, w, plan.plan.clone());
    #[cfg(not(feature = "cuda"))]
    {
        let _ = plan;
        bail!("{OP}: built without the cuda feature")
    }
}
