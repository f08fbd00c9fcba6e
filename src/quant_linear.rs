//! [`QuantLinear`]: a drop-in for `candle_nn::Linear` holding an NVFP4 (ModelOpt) or a
//! BF16 weight, dispatching between the small-M GEMV and a matmul.
//!
//! Numerics of `forward` (BF16 activations; `x` of another float dtype is converted to
//! BF16 first and the result converted back to `x`'s dtype):
//!
//! * **GEMV** ([`nvfp4_gemv`](crate::gemv::nvfp4_gemv) / [`bf16_gemv`](crate::gemv::bf16_gemv)):
//!   FP32 accumulation of `x · (e2m1·e4m3)`, times the FP32 global scale, **one** BF16
//!   rounding.
//! * **matmul**: the weight is dequantized exactly to BF16 `e2m1·e4m3`
//!   ([`dequantize_rows`](crate::nvfp4::dequantize_rows)), `x · wᵀ` is rounded to BF16,
//!   multiplied by the global scale in FP32 and rounded to BF16 again: **two** roundings
//!   (relative error up to about 2·2⁻⁸ instead of 2⁻⁸). BF16 weights: one rounding.
//! * a bias is added in BF16 after either (one more rounding).
//!
//! NVFP4 layers load from ModelOpt checkpoints with [`QuantLinear::load`] /
//! [`QuantLinear::load_fused`] (tensors read through [`Checkpoint`](crate::checkpoint::Checkpoint),
//! quantized modules chosen by [`QuantConfig`](crate::quant_config::QuantConfig)).
//!
//! Which path runs is decided by [`use_gemv`].

mod forward;
mod layer;
mod load;
mod plan;
mod weight;

pub use forward::silu_mul_halves;
pub use layer::QuantLinear;
pub use plan::use_gemv;
