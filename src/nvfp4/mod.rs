//! NVFP4 weights as NVIDIA ModelOpt writes them.
//!
//! Per quantized `Linear` with `out_features = N`, `in_features = K` (K a multiple of 16):
//!
//! | tensor | dtype, shape | meaning |
//! |---|---|---|
//! | `weight` | U8 `[N, K/2]` | byte `j` of row `n` holds `k = 2j` in the low nibble, `k = 2j+1` in the high nibble (E2M1 codes) |
//! | `weight_scale` | F8_E4M3 `[N, K/16]` | one block scale per 16 values, row-major in the checkpoint |
//! | `weight_scale_2` | F32 `[]` | per-tensor global scale, `amax / (6·448)` |
//!
//! Dequantization (ModelOpt's order): `w = e2m1 · (f32(e4m3) · weight_scale_2)`.
//! `e2m1 · e4m3` alone is exact in BF16, which is what the GEMV kernels multiply; they
//! apply the global scale to the FP32 accumulator.
//!
//! The kernels read the block scales in the 128×4-swizzled layout of CUTLASS's SM100
//! block-scaled MMA ([`swizzle_blockscale`]).

mod codec;
mod dequant;
#[cfg(feature = "cuda")]
mod dequant_cuda;
mod quantize;
mod swizzle;
mod validate;

pub use codec::{
    e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, BLOCK_SIZE, E2M1_VALUES, E4M3_MAX,
};
pub use dequant::{dequantize_nvfp4, dequantize_rows, dequantize_rows_cpu};
pub use quantize::{
    block_scale_e4m3, global_scale_for_amax, quantize_nvfp4, quantize_nvfp4_slice,
    quantize_nvfp4_with_global_scale, Nvfp4Quantized, MIN_BLOCK_SCALE,
};
pub use swizzle::{
    swizzle_blockscale, swizzle_blockscale_bytes, swizzled_offset, swizzled_shape,
    unswizzle_blockscale, unswizzle_blockscale_bytes,
};
pub use validate::first_bad_block_scale;
