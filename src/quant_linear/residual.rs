//! The residual stream between two layers of a decode step, and the two
//! [`QuantLinear`] calls that pass it on: [`forward_residual`](QuantLinear::forward_residual)
//! (o_proj, down_proj: the add after the layer) and
//! [`forward_add_norm_stream`](QuantLinear::forward_add_norm_stream) (q|k|v, gate|up: the
//! add and the RMSNorm in front of the layer).
//!
//! On a GPU, with the norm on the accumulator turned on
//! ([`set_residual_sums`](QuantLinear::set_residual_sums)), a packed NVFP4 layer without
//! bias adds the residual in its GEMV's epilogue and writes each token's sums of squares
//! ([`NormSums`]) and `bf16(s · w)` for the next norm's weight `w`
//! ([`ResidualStream::xw`]); the next packed layer's GEMV takes that as its input and divides
//! each token's accumulator by its RMS (`kernels/gemv_packed.cu`), so the step runs no norm
//! kernel between them. The input differs from the norm kernel's `bf16(bf16(s / m) · w)` by
//! at most one BF16 rounding per element. Everywhere else (the CPU, biases, tensor-parallel
//! layers, token counts the plans do not serve, a next norm that is not the one `xw` was
//! made for) the stream carries `delta`, or `s` for the norm kernel to reduce again.

use super::layer::QuantLinear;
#[cfg(feature = "cuda")]
use super::weight::Weight;
use crate::gemv::packed::NormSums;
use crate::norm::AddRmsNorm;
use candle_core::{Module, Result, Tensor};

/// The residual stream `x + delta` as it leaves a layer: `delta` not yet added, or added
/// by the GEMV that produced it (`delta` `None`, `sums` its sums of squares). `delta` and
/// `sums` are never both set.
#[derive(Debug, Clone)]
pub struct ResidualStream {
    /// The stream before `delta` (or, with `sums`, after the add).
    pub x: Tensor,
    /// What the next norm adds first.
    pub delta: Option<Tensor>,
    /// The sums of squares of `x`'s rows, when the add ran in a GEMV's epilogue.
    pub sums: Option<NormSums>,
    /// `bf16(x · w)` for the next norm's weight `w` (its device pointer beside it), when
    /// the epilogue also wrote that: the next packed GEMV takes it as its input and divides
    /// its accumulator by each token's RMS (the norm on the accumulator).
    pub xw: Option<(Tensor, u64)>,
}

impl ResidualStream {
    /// `x` with nothing to add (a model's first layer).
    pub fn new(x: Tensor) -> Self {
        Self {
            x,
            delta: None,
            sums: None,
            xw: None,
        }
    }

    /// `x + delta`, the next norm to add.
    pub fn with_delta(x: Tensor, delta: Tensor) -> Self {
        Self {
            x,
            delta: Some(delta),
            sums: None,
            xw: None,
        }
    }
}

impl QuantLinear {
    /// Whether [`forward_residual`](Self::forward_residual) may add the residual in the
    /// GEMV's epilogue (and write the sums of squares the next norm takes): off by default;
    /// a tuning knob of the decode step (`Knobs::residual_sums`), the values are unchanged
    /// but for the norm's summation order.
    pub fn set_residual_sums(&mut self, on: bool) {
        self.residual_sums = on;
    }

    /// `resid + self.forward(x)` as the stream the next layer takes: `x` `[M, K]`, `resid`
    /// `[M, N]`. On a GPU with the residual epilogue on ([`set_residual_sums`](Self::set_residual_sums)),
    /// for a packed NVFP4 weight without bias, BF16 inputs and an `M` the table runs the
    /// packed GEMV for, one kernel adds and writes the sums of squares, where the next
    /// layer (in-features `N`) can take them
    /// ([`use_sums_prologue`](crate::gemv::packed::use_sums_prologue)`(M, N)`: the add
    /// alone gains nothing over the next norm kernel's); otherwise the stream is
    /// `(resid, delta = self.forward(x))`.
    ///
    /// `next`: the norm the stream meets next. Where it is on the GPU, the epilogue also
    /// writes `bf16(s · w_next)` ([`ResidualStream::xw`]) for the norm on the accumulator.
    pub fn forward_residual(
        &self,
        x: &Tensor,
        resid: &Tensor,
        next: Option<&AddRmsNorm>,
    ) -> Result<ResidualStream> {
        #[cfg(feature = "cuda")]
        if let Some((plan, w)) = self.residual_plan_for(x, resid) {
            let nw = next.and_then(|n| n.cuda_weight_ptr().filter(|_| n.dim() == self.n));
            let (s, sums, xw) = crate::gemv::packed::packed_residual_gemv(x, resid, plan, w, nw)?;
            return Ok(ResidualStream {
                x: s,
                delta: None,
                sums: Some(sums),
                xw: xw.zip(nw),
            });
        }
        let _ = next;
        Ok(ResidualStream::with_delta(resid.clone(), self.forward(x)?))
    }

    /// [`forward_add_norm`](Self::forward_add_norm) over a [`ResidualStream`]: `(x + delta,
    /// y)`. With `sums` and `xw` made for this `norm` (the stream already added by a
    /// residual epilogue) a packed layer runs the norm on its accumulator where
    /// [`accumulator_norm_serves`](crate::gemv::packed::accumulator_norm_serves) the
    /// tokens and parts; otherwise the norm kernel (or prologue) reduces the stream.
    pub fn forward_add_norm_stream(
        &self,
        r: &ResidualStream,
        norm: &AddRmsNorm,
        silu_mul: bool,
    ) -> Result<(Tensor, Tensor)> {
        let Some(sums) = &r.sums else {
            return self.forward_add_norm(&r.x, r.delta.as_ref(), norm, silu_mul);
        };
        if r.delta.is_some() {
            candle_core::bail!(
                "QuantLinear::forward_add_norm_stream: the stream carries both a delta and sums of squares (the sums are of x alone)"
            );
        }
        #[cfg(feature = "cuda")]
        if let (Weight::Packed(_), None, Some((xw, wptr))) = (&self.weight, &self.bias, &r.xw) {
            let m = sums.tokens();
            if norm.cuda_weight_ptr() == Some(*wptr)
                && xw.dims() == [m, self.k]
                && crate::gemv::packed::accumulator_norm_serves(m, sums.parts())
            {
                if let Some((plan, w)) = self
                    .plans
                    .packed_plan(m, silu_mul)
                    .filter(|(p, _)| p.has_fs(m))
                {
                    let y = crate::gemv::packed::packed_scaled_gemv(xw, sums, norm.eps(), plan, w)?;
                    return Ok((r.x.clone(), y));
                }
            }
        }
        let _ = sums;
        self.forward_add_norm(&r.x, None, norm, silu_mul)
    }

    /// The residual epilogue's plan for `x` and `resid`, where it serves them.
    #[cfg(feature = "cuda")]
    fn residual_plan_for(
        &self,
        x: &Tensor,
        resid: &Tensor,
    ) -> Option<(
        &std::sync::Arc<crate::gemv::packed::cuda::PackedPlan>,
        &crate::gemv::packed::cuda_weight::WeightPtrs,
    )> {
        use candle_core::DType;
        if !self.residual_sums || self.bias.is_some() || !matches!(self.weight, Weight::Packed(_)) {
            return None;
        }
        match (x.dims(), resid.dims()) {
            ([m, k], [mr, n])
                if *k == self.k
                    && *n == self.n
                    && m == mr
                    && x.dtype() == DType::BF16
                    && resid.dtype() == DType::BF16
                    && (1..=crate::gemv::packed::NORM_MAX_M).contains(m) =>
            {
                self.plans.packed_plan(*m, false).filter(|(p, _)| {
                    p.has_fs(*m) && crate::gemv::packed::accumulator_norm_serves(*m, p.groups())
                })
            }
            _ => None,
        }
    }

    /// Whether [`forward_residual`](Self::forward_residual) of `m` tokens adds in the GEMV's
    /// epilogue, and whether [`forward_add_norm_stream`](Self::forward_add_norm_stream) of
    /// `m` tokens can run the norm on its accumulator (given a stream whose parts
    /// [`accumulator_norm_serves`](crate::gemv::packed::accumulator_norm_serves) with `m`):
    /// for tests and benchmarks.
    #[doc(hidden)]
    pub fn fuses_residual(&self, m: usize, silu_mul: bool) -> (bool, bool) {
        #[cfg(feature = "cuda")]
        if matches!(self.weight, Weight::Packed(_)) && self.bias.is_none() {
            let writes = self.residual_sums
                && !silu_mul
                && self.plans.packed_plan(m, false).is_some_and(|(p, _)| {
                    p.has_fs(m) && crate::gemv::packed::accumulator_norm_serves(m, p.groups())
                });
            let takes = (1..=crate::gemv::packed::NORM_MAX_M).contains(&m)
                && self
                    .plans
                    .packed_plan(m, silu_mul)
                    .is_some_and(|(p, _)| p.has_fs(m));
            return (writes, takes);
        }
        let _ = (m, silu_mul);
        (false, false)
    }
}
