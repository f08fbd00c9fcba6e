//! [`Knobs`]: every launch choice the tests, benchmarks and `tune` set, in one struct. None
//! changes a result beyond the FP32 order of a split merge, and each default is the
//! choice the H200 measurements made (docs/benchmarks.md), so the whole module is hidden
//! from the docs: a user never needs to set one.

pub use crate::gemv::{GemvKnobs, KernelImage};
pub use crate::kv_cache::AttnKnobs;

/// The tuning knobs: the GEMVs' ([`GemvKnobs`]: PDL, forced token tile or cluster split,
/// the sm_80 image), decode attention's ([`AttnKnobs`]: forced splits, the merge in the
/// kernel, PDL, the exact window's ring order) and the norms' L2 prefetch. [`Default`] is the measured choice of a
/// model's layers (the GEMVs with PDL); the ops' own defaults (`GemvKnobs::default()`) are
/// all-automatic without PDL.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Knobs {
    /// GEMV launches.
    pub gemv: GemvKnobs,
    /// Decode-attention launches.
    pub attention: AttnKnobs,
    /// The RMSNorm kernel in front of a packed layer may ask L2 for its first weights
    /// ([`QuantLinear::set_l2_prefetch`](crate::quant_linear::QuantLinear::set_l2_prefetch));
    /// where it does is the planner's rule per device and layer width
    /// ([`prefetch_suits`](crate::gemv::packed::prefetch_suits)). `false` turns it off.
    pub l2_prefetch: bool,
}

impl Default for Knobs {
    fn default() -> Self {
        Self {
            gemv: GemvKnobs::with_pdl(true),
            attention: AttnKnobs::default(),
            l2_prefetch: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The model default launches the GEMVs with PDL (measured neutral-to-better on the
    /// H200, and every kernel of the step supports it); everything else is automatic.
    #[test]
    fn default_is_the_measured_choice() {
        let k = Knobs::default();
        assert!(k.gemv.pdl);
        assert_eq!(
            k.gemv,
            GemvKnobs {
                pdl: true,
                ..GemvKnobs::default()
            }
        );
        assert_eq!(k.attention, AttnKnobs::default());
        assert!(k.l2_prefetch);
        assert!(!GemvKnobs::default().pdl);
    }
}
