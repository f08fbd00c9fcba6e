//! The packed NVFP4 GEMV that ends with the residual add (`kernels/gemv_packed.cu`, the
//! residual epilogue): `s = resid + x · Wᵀ` for a decode step's o_proj and down_proj, with
//! each token's f32 sums of squares of `s` over each CTA group's rows ([`NormSums`]), so
//! the next layer's q|k|v or gate|up GEMV can run the RMSNorm in its prologue without
//! reducing `s` again and the step needs no norm kernel. CUDA only: the CPU (and every
//! layer this does not serve) adds after the GEMV and lets the norm reduce.

use candle_core::Tensor;

/// Per-token sums of squares of a residual stream `s` `[m, N]`, in `parts` partial sums
/// (one per CTA group of the GEMV that wrote `s`), as the norm prologue takes them. Only
/// the residual epilogue makes one; it holds f32 bits in a BF16 view of that op's output
/// (`[2·m·parts]`), which keeps the buffer alive.
#[derive(Debug, Clone)]
pub struct NormSums {
    buf: Tensor,
    m: usize,
    parts: usize,
}

impl NormSums {
    /// Tokens (rows of `s`).
    pub fn tokens(&self) -> usize {
        self.m
    }

    /// Partial sums per token.
    pub fn parts(&self) -> usize {
        self.parts
    }

    /// The buffer (f32 bits in a BF16 view).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn buffer(&self) -> &Tensor {
        &self.buf
    }

    /// The sums as f32 `[m, parts]` (a copy; for tests).
    pub fn to_vec(&self) -> candle_core::Result<Vec<f32>> {
        let bits = self
            .buf
            .to_device(&candle_core::Device::Cpu)?
            .to_vec1::<half::bf16>()?;
        Ok(bits
            .chunks_exact(2)
            .map(|p| f32::from_bits(u32::from(p[0].to_bits()) | (u32::from(p[1].to_bits()) << 16)))
            .collect())
    }
}

#[cfg(feature = "cuda")]
mod op {
    use crate::gemv::packed::cuda::PackedPlan;
    use crate::gemv::packed::cuda_residual::{
        forward_residual, forward_scaled, sums_offset, xw_offset,
    };
    use crate::gemv::packed::cuda_weight::WeightPtrs;
    use crate::gemv::packed::residual::NormSums;
    use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

    /// The op: inputs `x` `[m, K]` and `resid` `[m, N]`; output one BF16 buffer (see
    /// [`forward_residual`]).
    struct PackedResidualGemv<'a> {
        plan: &'a PackedPlan,
        w: &'a WeightPtrs,
        xw_w: u64,
    }

    impl CustomOp2 for PackedResidualGemv<'_> {
        fn name(&self) -> &'static str {
            "nvfp4-packed-residual-gemv"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            bail!("packed NVFP4 GEMV (residual): CUDA only (the CPU adds after the GEMV)")
        }

        fn cuda_fwd(
            &self,
            s1: &candle_core::CudaStorage,
            l1: &Layout,
            s2: &candle_core::CudaStorage,
            l2: &Layout,
        ) -> Result<(candle_core::CudaStorage, Shape)> {
            forward_residual(self.plan, self.w, s1, l1, s2, l2, self.xw_w)
        }
    }

    /// The norm on the accumulator: inputs `xw` `[m, K]` and the sums buffer.
    struct PackedScaledGemv<'a> {
        plan: &'a PackedPlan,
        w: &'a WeightPtrs,
        parts: usize,
        eps: f32,
    }

    impl CustomOp2 for PackedScaledGemv<'_> {
        fn name(&self) -> &'static str {
            "nvfp4-packed-scaled-gemv"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            bail!("packed NVFP4 GEMV (norm on the accumulator): CUDA only")
        }

        fn cuda_fwd(
            &self,
            s1: &candle_core::CudaStorage,
            l1: &Layout,
            s2: &candle_core::CudaStorage,
            l2: &Layout,
        ) -> Result<(candle_core::CudaStorage, Shape)> {
            forward_scaled(self.plan, self.w, s1, l1, s2, l2, self.parts, self.eps)
        }
    }

    /// `gemv(rms_norm(s) · w_norm)` from `xw = bf16(s · w_norm)` and `s`'s sums of squares
    /// (a residual epilogue's), the RMS divided out of the accumulator: `[m, n_out]`.
    pub(crate) fn packed_scaled_gemv(
        xw: &Tensor,
        sums: &NormSums,
        eps: f32,
        plan: &PackedPlan,
        w: &WeightPtrs,
    ) -> Result<Tensor> {
        let (m, _) = xw.dims2()?;
        if xw.dtype() != DType::BF16 || sums.tokens() != m {
            bail!(
                "packed NVFP4 GEMV (norm on the accumulator): xw must be BF16 [{}, K], got {:?} {:?}",
                sums.tokens(),
                xw.dtype(),
                xw.dims()
            );
        }
        let n_out = if plan.silu_mul {
            plan.layout.n / 2
        } else {
            plan.layout.n
        };
        let op = PackedScaledGemv {
            plan,
            w,
            parts: sums.parts(),
            eps,
        };
        xw.contiguous()?
            .apply_op2_no_bwd(sums.buffer(), &op)?
            .reshape((m, n_out))
    }

    /// `(resid + x · Wᵀ, its sums of squares)` for BF16 `x` `[m, K]` and `resid` `[m, N]`
    /// on the GPU, through `plan` (the layer's packed plan for `m`, no `silu_mul`) and the
    /// weight's pointers.
    pub(crate) fn packed_residual_gemv(
        x: &Tensor,
        resid: &Tensor,
        plan: &PackedPlan,
        w: &WeightPtrs,
        xw_w: Option<u64>,
    ) -> Result<(Tensor, NormSums, Option<Tensor>)> {
        const OP: &str = "packed NVFP4 GEMV (residual)";
        let (m, _) = x.dims2()?;
        let n = plan.layout.n;
        if x.dtype() != DType::BF16 || resid.dtype() != DType::BF16 || resid.dims() != [m, n] {
            bail!(
                "{OP}: x must be BF16 [m, K] and resid BF16 [m, {n}], got {:?} {:?} and {:?} {:?}",
                x.dtype(),
                x.dims(),
                resid.dtype(),
                resid.dims()
            );
        }
        let resid = resid.contiguous()?;
        let xw_w = xw_w.unwrap_or(0);
        let both = x.apply_op2_no_bwd(&resid, &PackedResidualGemv { plan, w, xw_w })?;
        let off = sums_offset(m, n)?;
        let parts = plan.groups();
        let s = both.narrow(0, 0, m * n)?.reshape((m, n))?;
        let buf = both.narrow(0, off, 2 * m * parts)?;
        let xw = if xw_w != 0 {
            Some(
                both.narrow(0, xw_offset(m, n, parts)?, m * n)?
                    .reshape((m, n))?,
            )
        } else {
            None
        };
        Ok((s, NormSums { buf, m, parts }, xw))
    }
}
#[cfg(feature = "cuda")]
pub(crate) use op::{packed_residual_gemv, packed_scaled_gemv};
