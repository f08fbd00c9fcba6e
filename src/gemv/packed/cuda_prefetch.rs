//! The L2 prefetch ahead of a packed GEMV on the GPU: the byte ranges of its weight that the
//! kernel before it (the RMSNorm in front of the layer) asks L2 for, planned once per layer
//! ([`plan_prefetch`]) from the pure rule [`prefetch_tiles`](super::prefetch_tiles).

use super::cuda_weight::{tensor_ptr, PackedWeightRef};
use super::geometry::{l2_prefetch_budget, prefetch_suits, prefetch_tiles};
use crate::cuda::facts;
use crate::kernel_params::L2Prefetch;
use candle_core::{CudaDevice, Result};

/// The ranges of `w`'s packed codes and scales that its CTAs read first (with `silu_mul`:
/// the gate and the up tiles), within [`l2_prefetch_budget`] of the device's L2; `None`
/// below sm_90 (no `cp.async.bulk`), where [`prefetch_suits`] says the device's DRAM is
/// fast enough for this layer's width to go without, or when not one tile fits. The
/// pointers stay valid while the layer holds its weight (the plans live beside it).
pub(crate) fn plan_prefetch(
    dev: &CudaDevice,
    w: &PackedWeightRef<'_>,
    silu_mul: bool,
) -> Result<Option<L2Prefetch>> {
    let fx = facts(dev)?;
    let l = w.layout;
    if fx.cc.0 < 9 || !prefetch_suits(fx.mem_bw, l.k) {
        return Ok(None);
    }
    let runs = prefetch_tiles(
        l.tiles,
        l.half_pad,
        l.npairs,
        silu_mul,
        l2_prefetch_budget(fx.l2_bytes),
    );
    if runs.is_empty() {
        return Ok(None);
    }
    let stream = dev.cuda_stream();
    let codes = tensor_ptr::<u8>(w.codes, "packed codes", &stream)?;
    let scales = tensor_ptr::<u32>(w.scales, "packed scales", &stream)?;
    // Codes [tiles][2·npairs][32][16 B], scales [tiles][npairs][32] u32: a run of tiles is
    // one range of each (16-byte multiples, as cp.async.bulk needs).
    let (code_tile, scale_tile) = (l.tile_code_bytes() as u64, l.tile_scale_bytes() as u64);
    let mut pf = L2Prefetch::default();
    for (i, &(t0, nt)) in runs.iter().enumerate() {
        let (t0, nt) = (t0 as u64, nt as u64);
        pf.ptr[2 * i] = codes + t0 * code_tile;
        pf.bytes[2 * i] = nt * code_tile;
        pf.ptr[2 * i + 1] = scales + t0 * scale_tile;
        pf.bytes[2 * i + 1] = nt * scale_tile;
    }
    Ok(Some(pf))
}
