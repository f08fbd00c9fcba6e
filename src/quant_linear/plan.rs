//! Which path a [`QuantLinear`](super::QuantLinear) runs for `m` tokens: the rule
//! ([`use_gemv`], pure) and the per-M choices made from it once, when the layer is built on
//! its device (on a GPU: that device's tuned table and a resolved kernel launch per tile).

use super::weight::Weight;
use crate::gemv::{GemvKnobs, Plan, K_ALIGN, MAX_M};
use candle_core::{Device, Result};

/// Whether a projection of `m` tokens with in-features `k` should run the GEMV rather
/// than a matmul.
///
/// * never for `m = 0`, `m > 32` ([`MAX_M`]) or `k` not a multiple of 64 ([`K_ALIGN`]);
/// * on CPU always otherwise: the GEMV dequantizes rows on the fly, a matmul would need a
///   full dequantized copy of the weight per call;
/// * on a GPU only when the tuned table has a tile for this shape (`tuned_nt`, from
///   [`TunedTable::pick_nt`](crate::tables::TunedTable::pick_nt)).
pub fn use_gemv(on_cpu: bool, tuned_nt: Option<usize>, m: usize, k: usize) -> bool {
    if m == 0 || m > MAX_M || k == 0 || !k.is_multiple_of(K_ALIGN) {
        return false;
    }
    on_cpu || tuned_nt.is_some()
}

/// What runs for one `m` (and epilogue).
#[derive(Debug, Clone)]
pub(crate) enum Choice {
    /// Dequantize (NVFP4) and matmul.
    Matmul,
    /// The GEMV with these knobs (token tile set) and, on CUDA, its planned launch (the
    /// epilogue is the slot's: `Plans` keeps one choice per `silu_mul`).
    Gemv(GemvKnobs, Plan),
    /// The packed NVFP4 GEMV with its planned launch (CUDA).
    #[cfg(feature = "cuda")]
    Packed(std::sync::Arc<crate::gemv::packed::cuda::PackedPlan>),
    /// The packed GEMV kernel over the BF16 weight in its natural layout (CUDA, one token
    /// tile), with its planned launch.
    #[cfg(feature = "cuda")]
    PackedBf16(std::sync::Arc<crate::gemv::packed::cuda_bf16::Bf16Plan>),
}

/// The choice for every `m` in `1..=MAX_M`, without and with the `silu_mul` epilogue.
#[derive(Debug, Clone)]
pub(crate) struct Plans {
    by_m: Vec<[Choice; 2]>,
    /// CUDA, packed NVFP4 weights with K ≤ `NORM_K_MAX`: the GEMV with the RMSNorm prologue
    /// (without and with `silu_mul`), for the `m` whose choice is the one-tile packed GEMV.
    #[cfg(feature = "cuda")]
    norm: [Option<std::sync::Arc<crate::gemv::packed::cuda_norm::NormGemvPlan>>; 2],
    /// CUDA, packed NVFP4 weights: what the RMSNorm kernel in front of the layer asks L2
    /// for (without and with `silu_mul`), for the `m` whose choice is the packed GEMV.
    #[cfg(feature = "cuda")]
    prefetch: [Option<std::sync::Arc<crate::kernel_params::L2Prefetch>>; 2],
}

impl Plans {
    /// The plans of an `[n, k]` layer with `weight` on `device`, without PDL.
    pub(crate) fn new(device: &Device, n: usize, k: usize, weight: &Weight) -> Result<Self> {
        Self::with_knobs(device, n, k, weight, &GemvKnobs::default())
    }

    /// [`new`](Self::new) with the launch knobs `knobs`: PDL, the kernel image and the
    /// kernel A/B switch (`bf16_legacy`). The token tile and the split come from the
    /// device's table, not from `knobs`.
    pub(crate) fn with_knobs(
        device: &Device,
        n: usize,
        k: usize,
        weight: &Weight,
        knobs: &GemvKnobs,
    ) -> Result<Self> {
        // PDL exists from sm_90 on (the sm_80 image's griddepcontrol is a no-op, but the
        // launch attribute is not accepted there).
        let pdl = knobs.pdl;
        #[cfg(feature = "cuda")]
        let pdl = pdl
            && match device {
                Device::Cuda(d) => crate::cuda::facts(d)?.cc.0 >= 9,
                _ => false,
            };
        let fp4 = !matches!(weight, Weight::Bf16(_));
        let table = crate::tables::for_device(device)?;
        let mut made: Vec<(usize, bool, Choice)> = Vec::new();
        let mut by_m = Vec::with_capacity(MAX_M);
        for m in 1..=MAX_M {
            let mut pair = [Choice::Matmul, Choice::Matmul];
            for (slot, silu) in pair.iter_mut().zip([false, true]) {
                if silu && !n.is_multiple_of(2) {
                    continue;
                }
                let nt = if device.is_cpu() {
                    None
                } else {
                    table.pick_nt(n, k, m, silu, !fp4)
                };
                if !use_gemv(device.is_cpu(), nt, m, k) {
                    continue;
                }
                // The tile the table measured as faster (it may skip a smaller one).
                let knobs = GemvKnobs {
                    nt,
                    split: None,
                    pdl,
                    ..*knobs
                };
                *slot = match made.iter().find(|(t, s, _)| Some(*t) == nt && *s == silu) {
                    Some((_, _, c)) => c.clone(),
                    None => {
                        let c = make_choice(device, weight, n, k, nt, silu, &knobs)?;
                        if let Some(t) = nt {
                            made.push((t, silu, c.clone()));
                        }
                        c
                    }
                };
            }
            by_m.push(pair);
        }
        #[cfg(feature = "cuda")]
        let (norm, prefetch) = match (device, weight) {
            (Device::Cuda(d), Weight::Packed(p)) => {
                use crate::gemv::packed::{cuda_norm, cuda_prefetch, cuda_weight};
                use std::sync::Arc;
                let w = cuda_weight::PackedWeightRef {
                    layout: p.layout(),
                    codes: p.codes(),
                    scales: p.scales(),
                    global_scale: p.global_scale(),
                };
                let (mut v, mut f) = ([None, None], [None, None]);
                for (i, silu) in [false, true].into_iter().enumerate() {
                    if silu && !n.is_multiple_of(2) {
                        continue;
                    }
                    v[i] = cuda_norm::plan_norm(d, &w, silu, pdl, false)?.map(Arc::new);
                    f[i] = cuda_prefetch::plan_prefetch(d, &w, silu)?.map(Arc::new);
                }
                (v, f)
            }
            _ => ([None, None], [None, None]),
        };
        Ok(Self {
            by_m,
            #[cfg(feature = "cuda")]
            norm,
            #[cfg(feature = "cuda")]
            prefetch,
        })
    }

    /// The GEMV with the RMSNorm prologue for `m` tokens, where the table runs the packed
    /// GEMV for `m` and the prologue serves it ([`use_norm_prologue`]).
    ///
    /// [`use_norm_prologue`]: crate::gemv::packed::use_norm_prologue
    #[cfg(feature = "cuda")]
    pub(crate) fn norm_plan(
        &self,
        m: usize,
        k: usize,
        silu_mul: bool,
    ) -> Option<&std::sync::Arc<crate::gemv::packed::cuda_norm::NormGemvPlan>> {
        let packed = matches!(self.choice(m, silu_mul), Choice::Packed(_));
        if packed && crate::gemv::packed::use_norm_prologue(m, k) {
            self.norm[usize::from(silu_mul)].as_ref()
        } else {
            None
        }
    }

    /// What the norm kernel in front of the layer asks L2 for when `m` tokens run the
    /// packed GEMV (`None` otherwise).
    #[cfg(feature = "cuda")]
    pub(crate) fn l2_prefetch(
        &self,
        m: usize,
        silu_mul: bool,
    ) -> Option<&crate::kernel_params::L2Prefetch> {
        match self.choice(m, silu_mul) {
            Choice::Packed(_) => self.prefetch[usize::from(silu_mul)].as_deref(),
            _ => None,
        }
    }

    /// The choice for `m` tokens (matmul outside `1..=MAX_M`).
    pub(crate) fn choice(&self, m: usize, silu_mul: bool) -> &Choice {
        const MATMUL: Choice = Choice::Matmul;
        match m.checked_sub(1).and_then(|i| self.by_m.get(i)) {
            Some(pair) => &pair[usize::from(silu_mul)],
            None => &MATMUL,
        }
    }
}

/// The GEMV choice for token tile `nt` (`None`: planned per call, the CPU).
#[cfg(feature = "cuda")]
fn make_choice(
    device: &Device,
    weight: &Weight,
    n: usize,
    k: usize,
    nt: Option<usize>,
    silu: bool,
    opts: &GemvKnobs,
) -> Result<Choice> {
    use std::sync::Arc;
    let fp4 = !matches!(weight, Weight::Bf16(_));
    match (device, nt, weight) {
        (Device::Cuda(d), Some(nt), Weight::Packed(p)) => {
            // The packed kernel's tiles are the same list's first entries (1, 2, 4).
            p.check_image("QuantLinear", opts.image)?;
            let sm80 = opts.image == crate::gemv::KernelImage::Sm80;
            let plan = crate::gemv::packed::cuda::plan(d, p.layout(), silu, nt, opts.pdl, sm80)?;
            Ok(Choice::Packed(Arc::new(plan)))
        }
        (Device::Cuda(d), Some(1), Weight::Bf16(_)) if !opts.bf16_legacy => {
            let sm80 = opts.image == crate::gemv::KernelImage::Sm80;
            match crate::gemv::packed::cuda_bf16::plan_bf16(d, n, k, silu, opts.pdl, sm80)? {
                Some(p) => Ok(Choice::PackedBf16(Arc::new(p))),
                None => legacy_choice(d, fp4, n, k, 1, silu, opts),
            }
        }
        (Device::Cuda(d), Some(nt), _) => legacy_choice(d, fp4, n, k, nt, silu, opts),
        _ => Ok(Choice::Gemv(*opts, Plan::default())),
    }
}

/// The ModelOpt-layout GEMV (`kernels/gemv.cu`) planned for token tile `nt`.
#[cfg(feature = "cuda")]
fn legacy_choice(
    d: &candle_core::CudaDevice,
    fp4: bool,
    n: usize,
    k: usize,
    nt: usize,
    silu: bool,
    opts: &GemvKnobs,
) -> Result<Choice> {
    use std::sync::Arc;
    Ok(Choice::Gemv(
        *opts,
        Plan {
            cuda: Some(Arc::new(crate::gemv::cuda::plan(
                d, fp4, n, k, nt, silu, opts,
            )?)),
        },
    ))
}

#[cfg(not(feature = "cuda"))]
fn make_choice(
    _device: &Device,
    _weight: &Weight,
    _n: usize,
    _k: usize,
    _nt: Option<usize>,
    _silu: bool,
    opts: &GemvKnobs,
) -> Result<Choice> {
    Ok(Choice::Gemv(*opts, Plan::default()))
}
