//! # candle-fp4
//!
//! FP4 LLM inference for [Candle](https://github.com/huggingface/candle):
//!
//! * [`nvfp4`]: the NVFP4 weight format as NVIDIA ModelOpt writes it (E2M1 codes,
//!   E4M3 block scales per 16 values, FP32 global scale), a quantizer that reproduces
//!   ModelOpt bit for bit, and the 128×4 block-scale swizzle that the kernels read.
//! * [`gemv`]: small-M (M ≤ 32) GEMV ops for NVFP4 and BF16 weights, with an optional
//!   fused `silu(gate)·up` epilogue, as candle custom ops (CPU oracle, CUDA kernels).
//! * [`tables`]: per-GPU tuned tables saying when the GEMV beats candle's matmul.
//! * [`quant_linear`] / [`quant_config`]: a candle `Module` that loads ModelOpt NVFP4
//!   (or BF16) layers and dispatches between GEMV and matmul.
//! * [`ultraquant`]: the UltraQuant FP4 KV-cache format (E2M1 + UE8M0 per 32, K
//!   Walsh–Hadamard rotated).
//! * [`rope`]: rotary embedding fused over a `q|k|v` projection at device-side positions
//!   (the decode step's one kernel for it).
//! * [`kv_cache`]: per-layer KV caches (UltraQuant FP4 or BF16, one enum) with decode
//!   attention (CPU reference, CUDA split-KV flash decoding).
//! * [`tensor_parallel`]: Megatron-style layer sharding over ranks and CPU collectives.

pub mod checkpoint;
#[cfg(feature = "cuda")]
mod cuda;
pub mod error;
pub mod gemv;
pub mod greedy;
mod kernel_params;
pub mod knobs;
pub mod kv_cache;
mod layout;
pub mod norm;
pub mod nvfp4;
pub mod partition;
pub mod quant_config;
pub mod quant_linear;
pub mod rope;
pub mod tables;
pub mod tensor_parallel;
#[cfg(feature = "cuda")]
pub mod timing;
pub mod ultraquant;
/// The one list of compiled kernel variants and kernel images: GEMV token tiles and cluster
/// splits, decode-attention head_dims and query-head tiles, GPU architectures. `build.rs`
/// generates every `extern "C"` instantiation of `kernels/*.cu` and the image embedding
/// from it, and the planners read the same constants: adding a tile, a head_dim or an
/// architecture is one edit there.
pub mod variants;
