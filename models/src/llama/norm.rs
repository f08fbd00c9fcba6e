//! The Llama's RMSNorm: for BF16 activations `candle_fp4`'s [`AddRmsNorm`] (the residual add
//! in front of a norm fused into its kernel), on every path (prefill, `forward` and the
//! decode step), so they all round alike; candle's `rms_norm` (and add) otherwise. On the
//! CPU both give the same bits (`AddRmsNorm`'s reference is candle's CPU arithmetic).

use anyhow::Result;
use candle_core::{DType, Tensor};
use candle_fp4::norm::AddRmsNorm;

/// One norm weight `[hidden]` (in the activation dtype) and its epsilon.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f32,
    /// The fused op, for a BF16 weight.
    fused: Option<AddRmsNorm>,
}

impl RmsNorm {
    /// The norm of `weight` (on the device it runs on) and `eps`; a BF16 weight gets the
    /// fused kernel, planned here.
    pub fn new(weight: Tensor, eps: f32) -> Result<Self> {
        let fused = match weight.dtype() {
            DType::BF16 => Some(AddRmsNorm::new(&weight, eps)?),
            _ => None,
        };
        Ok(Self { weight, eps, fused })
    }

    /// The weight.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The epsilon.
    pub fn eps(&self) -> f32 {
        self.eps
    }

    /// The fused op, when it serves `x` (BF16 `[rows, hidden]`).
    pub fn fused_for(&self, x: &Tensor) -> Option<&AddRmsNorm> {
        self.fused
            .as_ref()
            .filter(|_| x.dtype() == DType::BF16 && x.rank() == 2)
    }

    /// `rms_norm(x) · weight` over the last dimension of `x` `[rows, hidden]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match &self.fused {
            Some(f) if x.dtype() == DType::BF16 && x.rank() == 2 => Ok(f.forward(x, None)?.1),
            _ => candle_nn::ops::rms_norm(x, &self.weight, self.eps),
        }
    }

    /// The residual stream `x + delta` (`delta` `None`: `x`) and its norm, in one kernel
    /// where the fused op runs.
    pub fn add_forward(
        &self,
        x: &Tensor,
        delta: Option<&Tensor>,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        match &self.fused {
            Some(f) if x.dtype() == DType::BF16 && x.rank() == 2 => f.forward(x, delta),
            _ => {
                let x = match delta {
                    Some(d) => (x + d)?,
                    None => x.clone(),
                };
                let h = candle_nn::ops::rms_norm(&x, &self.weight, self.eps)?;
                Ok((x, h))
            }
        }
    }
}
