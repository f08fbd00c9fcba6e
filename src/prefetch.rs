//! [`WeightPrefetch`]: byte ranges of a layer's weights that a kernel running before the
//! layer's GEMV asks L2 for, so the GEMV finds them there. Planned once per layer
//! ([`QuantLinear::weight_prefetch`](crate::quant_linear::QuantLinear::weight_prefetch)) and
//! handed to the kernel that runs while DRAM would otherwise wait (the decode attention:
//! [`KvCache::decode_rope_attention`](crate::kv_cache::KvCache::decode_rope_attention)).
//! A hint only: no value depends on it.

use crate::kernel_params::L2Prefetch;

/// The first weights of a packed layer, as whole row tiles within two fifths of the
/// device's L2 (the planner's rule, `gemv::packed` `prefetch_tiles`). Opaque: it holds
/// device pointers into the layer's weight, valid while the layer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightPrefetch(pub(crate) L2Prefetch);

impl WeightPrefetch {
    /// Bytes asked for in all.
    pub fn bytes(&self) -> u64 {
        self.0.bytes.iter().sum()
    }
}
