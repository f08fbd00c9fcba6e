//! Small-M GEMV ops: `y = x · Wᵀ` for `M ≤ 32` tokens, BF16 activations, NVFP4 or BF16
//! weights, as candle custom ops.
//!
//! Numerics (identical on every backend up to FP32 summation order): every weight is
//! dequantized exactly to BF16 (`e2m1 · e4m3` for NVFP4), products are accumulated in
//! FP32, the FP32 global scale multiplies the accumulator, and the result is rounded to
//! BF16 once. With `silu_mul` the `N` outputs are the halves `[gate | up]` and the op
//! returns `[M, N/2]` = BF16 of `silu(gate) · up`, computed in FP32 from the
//! BF16-rounded gate and up.
//!
//! `pdl` asks the CUDA kernel for programmatic dependent launch (its weight loads overlap
//! the previous kernel's tail); it has no effect on the CPU.

mod checks;
mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod options;
pub mod packed;

use checks::{check_x, contiguous_u8, x_view};
pub use checks::{K_ALIGN, MAX_M};
pub use cpu::{gemv_cpu, gemv_cpu_scalar, gemv_cpu_with, CpuKernel, WeightRows};
#[cfg(feature = "cuda")]
pub use options::GemvPlan;
pub(crate) use options::Plan;
pub use options::{GemvKnobs, KernelImage};
pub use packed::{
    bf16_gemv_planned_packed, packed_nvfp4_gemv, packed_nvfp4_gemv_planned, plan_bf16_gemv,
    plan_bf16_gemv_with, Bf16GemvPlan, PackedGemvPlan, PackedNvfp4,
};

use crate::nvfp4::{swizzled_shape, BLOCK_SIZE};
#[cfg(feature = "cuda")]
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

fn check_n(op: &str, n: usize, silu_mul: bool) -> Result<()> {
    if n == 0 {
        bail!("{op}: the weight has no rows");
    }
    if silu_mul && !n.is_multiple_of(2) {
        bail!("{op}: silu_mul needs an even N ([gate | up] halves), got N = {n}");
    }
    Ok(())
}

fn out_shape(m: usize, n: usize, silu_mul: bool) -> Shape {
    Shape::from((m, if silu_mul { n / 2 } else { n }))
}

/// The NVFP4 GEMV as a candle op: inputs `x`, `weight`, swizzled `weight_scale`.
#[derive(Debug, Clone)]
pub struct Nvfp4Gemv {
    /// FP32 per-tensor global scale (`weight_scale_2`).
    pub global_scale: f32,
    /// Fused `silu(gate)·up` epilogue over `[gate | up]` output halves.
    pub silu_mul: bool,
    /// Launch knobs.
    pub knobs: GemvKnobs,
    /// CUDA: the launch planned once for this weight (else planned per call).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) plan: Plan,
}

impl CustomOp3 for Nvfp4Gemv {
    fn name(&self) -> &'static str {
        "nvfp4-gemv"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "nvfp4_gemv";
        let (m, k) = l1.shape().dims2()?;
        let (n, _) = l2.shape().dims2()?;
        let (x, rs) = x_view(OP, s1, l1)?;
        let codes = contiguous_u8(OP, "weight", s2, l2)?;
        let scales = contiguous_u8(OP, "weight_scale", s3, l3)?;
        let sp = swizzled_shape(n, k / BLOCK_SIZE).1;
        let rows = WeightRows::Nvfp4 { codes, scales, sp };
        let silu = self.silu_mul;
        let out = gemv_cpu(x, rs, m, k, n, &rows, self.global_scale, silu)?;
        Ok((CpuStorage::BF16(out), out_shape(m, n, silu)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        const OP: &str = "nvfp4_gemv";
        let w = cuda::Weights::Fp4 {
            codes: s2,
            lc: l2,
            scales: s3,
            ls: l3,
            gs: self.global_scale,
        };
        match &self.plan.cuda {
            Some(p) => cuda::forward(OP, p, s1, l1, w),
            None => {
                let (m, k) = l1.shape().dims2()?;
                let n = l2.shape().dims2()?.0;
                let p = cuda::plan(
                    s1.device(),
                    true,
                    n,
                    k,
                    self.knobs.tile(m),
                    self.silu_mul,
                    &self.knobs,
                )?;
                cuda::forward(OP, &p, s1, l1, w)
            }
        }
    }
}

/// The BF16 GEMV as a candle op: inputs `x`, `weight`.
#[derive(Debug, Clone)]
pub struct Bf16Gemv {
    /// Fused `silu(gate)·up` epilogue over `[gate | up]` output halves.
    pub silu_mul: bool,
    /// Launch knobs.
    pub knobs: GemvKnobs,
    /// CUDA: the launch planned once for this weight (else planned per call).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) plan: Plan,
}

impl CustomOp2 for Bf16Gemv {
    fn name(&self) -> &'static str {
        "bf16-gemv"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "bf16_gemv";
        let (m, k) = l1.shape().dims2()?;
        let (n, _) = l2.shape().dims2()?;
        let (x, rs) = x_view(OP, s1, l1)?;
        let w = match (s2, l2.contiguous_offsets()) {
            (CpuStorage::BF16(v), Some((a, b))) => &v[a..b],
            _ => bail!("{OP}: weight must be a contiguous BF16 tensor"),
        };
        let rows = WeightRows::Bf16 { w };
        let silu = self.silu_mul;
        let out = gemv_cpu(x, rs, m, k, n, &rows, 1.0, silu)?;
        Ok((CpuStorage::BF16(out), out_shape(m, n, silu)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        const OP: &str = "bf16_gemv";
        let w = cuda::Weights::Bf16 { w: s2, lw: l2 };
        match &self.plan.cuda {
            Some(p) => cuda::forward(OP, p, s1, l1, w),
            None => {
                let (m, k) = l1.shape().dims2()?;
                let n = l2.shape().dims2()?.0;
                let p = cuda::plan(
                    s1.device(),
                    false,
                    n,
                    k,
                    self.knobs.tile(m),
                    self.silu_mul,
                    &self.knobs,
                )?;
                cuda::forward(OP, &p, s1, l1, w)
            }
        }
    }
}

/// NVFP4 W4A16 GEMV: `x` BF16 `[M, K]` (M ≤ 32, K % 64 == 0, unit inner stride) times
/// the NVFP4 weight (`weight` U8 `[N, K/2]`, `weight_scale` swizzled U8 `[Np, Sp]` as
/// made by [`swizzle_blockscale`](crate::nvfp4::swizzle_blockscale)), scaled by
/// `global_scale`. Returns BF16 `[M, N]`, or `[M, N/2]` with `silu_mul`.
pub fn nvfp4_gemv(
    x: &Tensor,
    weight: &Tensor,
    weight_scale: &Tensor,
    global_scale: f32,
    silu_mul: bool,
    pdl: bool,
) -> Result<Tensor> {
    nvfp4_gemv_with(
        x,
        weight,
        weight_scale,
        global_scale,
        silu_mul,
        &GemvKnobs::with_pdl(pdl),
    )
}

/// [`nvfp4_gemv`] with explicit launch knobs (kernel variant selection for tests and
/// benchmarks).
#[doc(hidden)]
pub fn nvfp4_gemv_with(
    x: &Tensor,
    weight: &Tensor,
    weight_scale: &Tensor,
    global_scale: f32,
    silu_mul: bool,
    knobs: &GemvKnobs,
) -> Result<Tensor> {
    nvfp4_gemv_planned(
        x,
        weight,
        weight_scale,
        global_scale,
        silu_mul,
        knobs,
        Plan::default(),
    )
}

/// [`nvfp4_gemv_with`] launching `plan` (CUDA; made once for the weight) when given.
pub(crate) fn nvfp4_gemv_planned(
    x: &Tensor,
    weight: &Tensor,
    weight_scale: &Tensor,
    global_scale: f32,
    silu_mul: bool,
    knobs: &GemvKnobs,
    plan: Plan,
) -> Result<Tensor> {
    const OP: &str = "nvfp4_gemv";
    let (m, k) = check_x(OP, x)?;
    knobs.check(OP, m)?;
    let n = match weight.dims() {
        [n, k2] if *k2 * 2 == k && weight.dtype() == DType::U8 => *n,
        d => bail!(
            "{OP}: weight must be U8 [N, K/2] = [N, {}], got {:?} {d:?}",
            k / 2,
            weight.dtype()
        ),
    };
    check_n(OP, n, silu_mul)?;
    let (np, sp) = swizzled_shape(n, k / BLOCK_SIZE);
    if weight_scale.dtype() != DType::U8 || weight_scale.elem_count() != np * sp {
        bail!(
            "{OP}: weight_scale must be the swizzled U8 scales [{np}, {sp}] of a [{n}, {k}] weight, got {:?} {:?}",
            weight_scale.dtype(),
            weight_scale.dims()
        );
    }
    if !(global_scale.is_finite() && global_scale > 0.0) {
        bail!("{OP}: global scale {global_scale} must be a positive finite number");
    }
    if !x.device().same_device(weight.device()) || !x.device().same_device(weight_scale.device()) {
        bail!("{OP}: x, weight and weight_scale must be on the same device");
    }
    let weight = weight.contiguous()?;
    let weight_scale = weight_scale.contiguous()?;
    let op = Nvfp4Gemv {
        global_scale,
        silu_mul,
        knobs: *knobs,
        plan,
    };
    x.apply_op3_no_bwd(&weight, &weight_scale, &op)
}

/// BF16 GEMV: `x` BF16 `[M, K]` (M ≤ 32, K % 64 == 0, unit inner stride) times
/// `weight` BF16 `[N, K]`. Returns BF16 `[M, N]`, or `[M, N/2]` with `silu_mul`.
pub fn bf16_gemv(x: &Tensor, weight: &Tensor, silu_mul: bool, pdl: bool) -> Result<Tensor> {
    bf16_gemv_with(x, weight, silu_mul, &GemvKnobs::with_pdl(pdl))
}

/// [`bf16_gemv`] with explicit launch knobs.
#[doc(hidden)]
pub fn bf16_gemv_with(
    x: &Tensor,
    weight: &Tensor,
    silu_mul: bool,
    knobs: &GemvKnobs,
) -> Result<Tensor> {
    bf16_gemv_planned(x, weight, silu_mul, knobs, Plan::default())
}

/// [`bf16_gemv_with`] launching `plan` (CUDA; made once for the weight) when given.
pub(crate) fn bf16_gemv_planned(
    x: &Tensor,
    weight: &Tensor,
    silu_mul: bool,
    knobs: &GemvKnobs,
    plan: Plan,
) -> Result<Tensor> {
    const OP: &str = "bf16_gemv";
    let (m, k) = check_x(OP, x)?;
    knobs.check(OP, m)?;
    let n = match weight.dims() {
        [n, kk] if *kk == k && weight.dtype() == DType::BF16 => *n,
        d => bail!(
            "{OP}: weight must be BF16 [N, K] = [N, {k}], got {:?} {d:?}",
            weight.dtype()
        ),
    };
    check_n(OP, n, silu_mul)?;
    if !x.device().same_device(weight.device()) {
        bail!("{OP}: x and weight must be on the same device");
    }
    let weight = weight.contiguous()?;
    let op = Bf16Gemv {
        silu_mul,
        knobs: *knobs,
        plan,
    };
    x.apply_op2_no_bwd(&weight, &op)
}
