//! The weight a [`QuantLinear`](super::QuantLinear) keeps, in the form its device runs.

use crate::gemv::PackedNvfp4;
use candle_core::{Result, Tensor};

/// The weight of a [`QuantLinear`].
#[derive(Debug, Clone)]
pub(crate) enum Weight {
    Nvfp4 {
        /// U8 `[N, K/2]` packed E2M1 codes.
        codes: Tensor,
        /// U8 `[Np, Sp]` 128×4-swizzled E4M3 block scales.
        scales: Tensor,
        global_scale: f32,
    },
    /// NVFP4 repacked for the CUDA GEMV (what a layer on a GPU keeps).
    Packed(PackedNvfp4),
    /// BF16 `[N, K]`.
    Bf16(Tensor),
}

/// The NVFP4 weight as the layer keeps it on `codes`' device: repacked on a GPU, the
/// ModelOpt layout on the CPU (whose kernels read it directly) and for a `K` the packed
/// GEMV does not take (not a multiple of 64: those layers run the matmul).
pub(super) fn nvfp4_weight(codes: Tensor, scales: Tensor, global_scale: f32) -> Result<Weight> {
    let k = 2 * codes.dim(1)?;
    if codes.device().is_cpu() || !k.is_multiple_of(crate::gemv::packed::PACKED_K_ALIGN) {
        return Ok(Weight::Nvfp4 {
            codes,
            scales,
            global_scale,
        });
    }
    Ok(Weight::Packed(PackedNvfp4::pack(
        &codes,
        &scales,
        global_scale,
    )?))
}
