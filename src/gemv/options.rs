//! Launch knobs of the GEMV ops, and (CUDA) the launch plan made from them once.

use candle_core::{bail, Result};

/// Which compiled kernel image the CUDA forward uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum KernelImage {
    /// The image built for the device: sm_90a cubin on Hopper, sm_100a on B200, sm_80
    /// on Ampere/Ada, compute_90 PTX on other GPUs of compute capability ≥ 9.0.
    #[default]
    Auto,
    /// The sm_80 code path (no clusters, no PDL), JIT-compiled from PTX: lets a Hopper
    /// run and test what A100 / RTX 40xx users get.
    Sm80,
}

/// The GEMV's launch knobs (part of [`Knobs`](crate::knobs::Knobs)): they choose among
/// kernels that give the same result (CUDA only; the CPU ignores them), for the tests,
/// benchmarks and `tune`. The default is automatic everywhere, without PDL.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GemvKnobs {
    /// Programmatic dependent launch: weight loads overlap the previous kernel's tail.
    pub pdl: bool,
    /// Token tiles (8·nt tokens, nt ∈ [`GEMV_NTS`](crate::variants::GEMV_NTS), 8·nt ≥ M);
    /// `None` = smallest that fits.
    pub nt: Option<usize>,
    /// CTAs of a thread-block cluster that split K
    /// ([`GEMV_SPLITS`](crate::variants::GEMV_SPLITS)); `None` = heuristic.
    pub split: Option<usize>,
    /// Kernel image.
    pub image: KernelImage,
    /// BF16 weights at one token tile: the ModelOpt-layout GEMV (`kernels/gemv.cu`) instead
    /// of the packed kernel over the natural layout (an A/B for benchmarks).
    pub bf16_legacy: bool,
}

impl GemvKnobs {
    /// Knobs with PDL on or off, everything else automatic.
    pub fn with_pdl(pdl: bool) -> Self {
        Self {
            pdl,
            ..Default::default()
        }
    }

    /// Checks the options for `m` tokens.
    pub(crate) fn check(&self, op: &str, m: usize) -> Result<()> {
        use crate::variants::{GEMV_NTS, GEMV_SPLITS};
        if let Some(nt) = self.nt {
            if !GEMV_NTS.contains(&nt) || 8 * nt < m {
                bail!("{op}: nt = {nt} must be one of {GEMV_NTS:?} with 8·nt ≥ M = {m}");
            }
        }
        if let Some(s) = self.split {
            if !GEMV_SPLITS.contains(&s) {
                bail!("{op}: split = {s} must be one of {GEMV_SPLITS:?}");
            }
            if s > 1 && self.image == KernelImage::Sm80 {
                bail!("{op}: the sm_80 image has no clusters, split must be 1");
            }
        }
        Ok(())
    }

    /// The token tile for `m` tokens: the one asked for, else the smallest that fits.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn tile(&self, m: usize) -> usize {
        use crate::variants::GEMV_NTS;
        self.nt.unwrap_or_else(|| {
            GEMV_NTS
                .into_iter()
                .find(|nt| 8 * nt >= m)
                .unwrap_or(GEMV_NTS[GEMV_NTS.len() - 1])
        })
    }
}

/// One GEMV kernel resolved for one device and weight shape, with its launch geometry:
/// made once (when a [`QuantLinear`](crate::quant_linear::QuantLinear) is built on a GPU,
/// or per call by the plain `nvfp4_gemv` / `bf16_gemv` functions), then launched without
/// any lookup.
#[cfg(feature = "cuda")]
#[derive(Debug, Clone)]
pub struct GemvPlan {
    pub(crate) f: candle_core::cuda_backend::cudarc::driver::CudaFunction,
    pub(crate) launch: crate::cuda::Launch,
    pub(crate) fp4: bool,
    pub(crate) silu_mul: bool,
    pub(crate) n: usize,
    pub(crate) k: usize,
    /// Largest M the tile serves (8·nt).
    pub(crate) max_m: usize,
    pub(crate) n_tiles: usize,
    pub(crate) sp: usize,
}

#[cfg(feature = "cuda")]
impl GemvPlan {
    /// Tokens per tile times tiles: the largest `M` this plan serves.
    pub fn max_m(&self) -> usize {
        self.max_m
    }

    /// CTAs of the cluster that split K.
    pub fn split(&self) -> usize {
        self.launch.cluster as usize
    }
}

/// What an op carries of its plan: on CUDA builds the plan made once for its weight, or
/// `None` (planned per call); nothing without CUDA.
#[derive(Debug, Clone, Default)]
pub(crate) struct Plan {
    #[cfg(feature = "cuda")]
    pub(crate) cuda: Option<std::sync::Arc<GemvPlan>>,
}
