//! `QuantLinear::forward` and `forward_silu_mul`.

use super::layer::QuantLinear;
use super::plan::Choice;
use super::weight::Weight;
use crate::gemv::{bf16_gemv_planned, nvfp4_gemv_planned};
use crate::nvfp4::dequantize_rows;
use candle_core::{bail, DType, Module, Result, Tensor};

/// `silu(g) · u` over the halves `[g | u]` of a BF16 `[M, N]`: FP32 from the BF16 values,
/// rounded to BF16 once (the GEMV's `silu_mul` epilogue, as separate ops: what a layer whose
/// table entry says matmul runs after the matmul, and what `tune` times with it).
pub fn silu_mul_halves(y: &Tensor) -> Result<Tensor> {
    let h = y.dim(1)? / 2;
    let g = y.narrow(1, 0, h)?.to_dtype(DType::F32)?;
    let u = y.narrow(1, h, h)?.to_dtype(DType::F32)?;
    (g.silu()? * u)?.to_dtype(DType::BF16)
}

impl QuantLinear {
    /// Checks `x` (`[..., K]`, float) and returns it as contiguous BF16 `[M, K]` and its
    /// leading dims.
    fn flatten(&self, x: &Tensor) -> Result<(Tensor, Vec<usize>)> {
        let Some((&k, lead)) = x.dims().split_last() else {
            bail!(
                "QuantLinear: input must have at least one dim [..., {}], got a scalar",
                self.k
            );
        };
        if k != self.k {
            bail!(
                "QuantLinear: input shape {:?} does not end in in_features = {}",
                x.dims(),
                self.k
            );
        }
        if !x.dtype().is_float() {
            bail!(
                "QuantLinear: input dtype {:?} is not a float type",
                x.dtype()
            );
        }
        let m = lead.iter().product::<usize>();
        let x2 = x.reshape((m, k))?.to_dtype(DType::BF16)?.contiguous()?;
        Ok((x2, lead.to_vec()))
    }

    /// `[M, K]` BF16 → BF16 `[M, N]` (or `[M, N/2]` with `silu_mul`), no bias.
    fn project(&self, x: &Tensor, silu_mul: bool) -> Result<Tensor> {
        let m = x.dim(0)?;
        let n_out = if silu_mul { self.n / 2 } else { self.n };
        if m == 0 {
            return Tensor::zeros((0, n_out), DType::BF16, x.device());
        }
        match (self.plans.choice(m, silu_mul), &self.weight) {
            (Choice::Matmul, _) => {}
            #[cfg(feature = "cuda")]
            (Choice::Packed(plan), Weight::Packed(p)) => {
                return crate::gemv::packed::packed_gemv_planned(x, p, silu_mul, plan.clone());
            }
            #[cfg(feature = "cuda")]
            (Choice::Packed(_), _) => {
                bail!("QuantLinear: internal error, a packed plan for an unpacked weight")
            }
            #[cfg(feature = "cuda")]
            (Choice::PackedBf16(plan), Weight::Bf16(w)) => {
                return crate::gemv::packed::cuda_bf16::bf16_gemv_packed_planned(
                    x,
                    w,
                    plan.clone(),
                );
            }
            #[cfg(feature = "cuda")]
            (Choice::PackedBf16(_), _) => {
                bail!("QuantLinear: internal error, a BF16 plan for a quantized weight")
            }
            (Choice::Gemv(knobs, plan), w) => {
                return match w {
                    Weight::Nvfp4 {
                        codes,
                        scales,
                        global_scale,
                    } => nvfp4_gemv_planned(
                        x,
                        codes,
                        scales,
                        *global_scale,
                        silu_mul,
                        knobs,
                        plan.clone(),
                    ),
                    Weight::Packed(p) => crate::gemv::packed_nvfp4_gemv(x, p, silu_mul, knobs.pdl),
                    Weight::Bf16(w) => bf16_gemv_planned(x, w, silu_mul, knobs, plan.clone()),
                };
            }
        }
        let y = match &self.weight {
            Weight::Nvfp4 {
                codes,
                scales,
                global_scale,
            } => {
                let w = dequantize_rows(codes, scales)?;
                x.matmul(&w.t()?)?
                    .to_dtype(DType::F32)?
                    .affine(*global_scale as f64, 0.0)?
                    .to_dtype(DType::BF16)?
            }
            Weight::Packed(p) => x
                .matmul(&p.dequantize_bf16()?.t()?)?
                .to_dtype(DType::F32)?
                .affine(p.global_scale() as f64, 0.0)?
                .to_dtype(DType::BF16)?,
            Weight::Bf16(w) => x.matmul(&w.t()?)?,
        };
        if silu_mul {
            silu_mul_halves(&y)
        } else {
            Ok(y)
        }
    }

    fn finish(&self, y: Tensor, lead: &[usize], dtype: DType) -> Result<Tensor> {
        let mut shape = lead.to_vec();
        shape.push(y.dim(1)?);
        y.reshape(shape)?.to_dtype(dtype)
    }

    /// For a fused `[gate | up]` layer (`N` even): `silu(x·Wgᵀ + bg) · (x·Wuᵀ + bu)`,
    /// `[..., K]` → `[..., N/2]`. The gate and up outputs are rounded to BF16 (as
    /// `forward` would return them), then `silu(g)·u` is computed in FP32 and rounded once;
    /// without a bias the GEMV path fuses this epilogue.
    pub fn forward_silu_mul(&self, x: &Tensor) -> Result<Tensor> {
        if !self.n.is_multiple_of(2) {
            bail!(
                "QuantLinear::forward_silu_mul: needs an even out_features ([gate | up]), got {}",
                self.n
            );
        }
        let (x2, lead) = self.flatten(x)?;
        let y = match &self.bias {
            None => self.project(&x2, true)?,
            Some(b) => silu_mul_halves(&self.project(&x2, false)?.broadcast_add(b)?)?,
        };
        self.finish(y, &lead, x.dtype())
    }
}

impl QuantLinear {
    /// The layer behind the RMSNorm in front of it, with the residual add before that:
    /// `x` `[M, K]` (the residual stream) and `delta` (the same shape, or `None`) →
    /// `(s, y)` with `s = x + delta` (or `x`) and `y` = this layer (`silu_mul`: its
    /// [`forward_silu_mul`](Self::forward_silu_mul)) of `norm.forward(x, delta)`'s output.
    ///
    /// On a GPU, for a packed NVFP4 weight without bias, BF16 input, `M ≤ 8` and
    /// `K ≤ 1024` ([`use_norm_prologue`](crate::gemv::packed::use_norm_prologue)), this is
    /// one kernel: the GEMV runs the norm in its prologue. Otherwise (and on the CPU) it is
    /// the norm, then the layer; both give the same values but for the order of the norm's
    /// f32 sum of squares (which can move a row's norm by one BF16 rounding). There, on
    /// sm_90 and newer, the norm kernel also asks L2 for the first of this layer's packed
    /// weights (planned at load: whole tiles within two fifths of the L2), so DRAM streams
    /// them while the norm runs.
    pub fn forward_add_norm(
        &self,
        x: &Tensor,
        delta: Option<&Tensor>,
        norm: &crate::norm::AddRmsNorm,
        silu_mul: bool,
    ) -> Result<(Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if let (Weight::Packed(_), None, [m, k], DType::BF16) =
            (&self.weight, &self.bias, x.dims(), x.dtype())
        {
            if let Some(plan) = self.plans.norm_plan(*m, *k, silu_mul) {
                let n_out = if silu_mul { self.n / 2 } else { self.n };
                return crate::gemv::packed::norm::packed_norm_gemv(x, delta, norm, plan, n_out);
            }
        }
        // The norm kernel asks L2 for the first of this layer's weights meanwhile.
        let prefetch = match x.dims() {
            [m, _] => self.norm_prefetch(*m, silu_mul),
            _ => None,
        };
        let (s, h) = norm.forward_prefetch(x, delta, prefetch)?;
        let y = if silu_mul {
            self.forward_silu_mul(&h)?
        } else {
            self.forward(&h)?
        };
        Ok((s, y))
    }
}

impl QuantLinear {
    /// The CUDA kernel the planned packed GEMV (NVFP4, or the BF16 weight's natural-layout
    /// kernel) launches for `m` tokens, `None` for any other path: for tests and benchmarks.
    #[doc(hidden)]
    pub fn packed_kernel_for(&self, m: usize, silu_mul: bool) -> Option<&str> {
        #[cfg(feature = "cuda")]
        match self.plans.choice(m, silu_mul) {
            Choice::Packed(p) => return p.kernel_for(m),
            Choice::PackedBf16(p) => return p.kernel_for(m),
            _ => {}
        }
        let _ = (m, silu_mul);
        None
    }

    /// Whether [`forward_add_norm`](Self::forward_add_norm) of `m` BF16 tokens runs as one
    /// kernel (the GEMV with the norm in its prologue) rather than the norm, then the layer:
    /// for tests and benchmarks.
    #[doc(hidden)]
    pub fn fuses_norm(&self, m: usize, silu_mul: bool) -> bool {
        #[cfg(feature = "cuda")]
        if matches!(self.weight, Weight::Packed(_)) && self.bias.is_none() {
            return self.plans.norm_plan(m, self.k, silu_mul).is_some();
        }
        let _ = (m, silu_mul);
        false
    }
}

impl QuantLinear {
    /// What the norm kernel in front of this layer asks L2 for when `m` tokens run
    /// [`forward_add_norm`](Self::forward_add_norm) unfused: the planned ranges of a packed
    /// weight without bias, unless [`set_l2_prefetch`](Self::set_l2_prefetch) turned it off.
    fn norm_prefetch(&self, m: usize, silu_mul: bool) -> Option<&crate::kernel_params::L2Prefetch> {
        #[cfg(feature = "cuda")]
        if self.bias.is_none() && self.l2_prefetch {
            return self.plans.l2_prefetch(m, silu_mul);
        }
        let _ = (m, silu_mul);
        None
    }

    /// Whether the norm kernel in front of this layer asks L2 for its weights when `m`
    /// tokens run [`forward_add_norm`](Self::forward_add_norm) unfused: for tests.
    #[doc(hidden)]
    pub fn prefetches_weights(&self, m: usize, silu_mul: bool) -> bool {
        self.norm_prefetch(m, silu_mul).is_some()
    }
}

impl Module for QuantLinear {
    /// `x·Wᵀ + b` for `x` of shape `[..., K]` → `[..., N]`, in `x`'s dtype (computed in
    /// BF16; see the module docs for the rounding).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (x2, lead) = self.flatten(x)?;
        let mut y = self.project(&x2, false)?;
        if let Some(b) = &self.bias {
            y = y.broadcast_add(b)?;
        }
        self.finish(y, &lead, x.dtype())
    }
}
