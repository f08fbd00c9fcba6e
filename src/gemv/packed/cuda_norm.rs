//! The packed GEMV with the RMSNorm prologue on the GPU: its plan (made once per layer,
//! holding the weight's pointers) and its launch (`kernels/gemv_packed.cu`, the norm
//! variants).

use super::cuda::{finish_plan, occupancies, PackedPlan};
use super::cuda_weight::{PackedWeightRef, WeightPtrs};
use super::geometry::{packed_geometry, use_norm_prologue, NORM_K_MAX, NORM_MAX_M};
use crate::cuda::{facts, launch, module, Image, KernelFile, Launch};
use crate::kernel_params::PackedGemvParams;
use crate::layout::contiguous_range;
use crate::variants::{pgemv_norm_kernel_name, PGEMV_NORM_KERNELS};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result, Shape};
use half::bf16;

/// Dynamic shared memory the norm variants may use (set once on the function, the same
/// value for every layer; under the 48 KiB default today, set anyway so a larger
/// [`NORM_K_MAX`] needs no other change).
const NORM_SMEM_MAX: usize = NORM_MAX_M * (NORM_K_MAX + 8) * 2;

/// The packed GEMV with the RMSNorm prologue, resolved for one layer (its weight's
/// pointers included: the layer owns the weight and this plan keeps it alive).
#[derive(Debug)]
pub(crate) struct NormGemvPlan {
    base: PackedPlan,
    w: WeightPtrs,
}

/// Plans the norm variant of the packed GEMV of `w` (token tile 1, up to 8 tokens), or
/// `None` when K is above [`NORM_K_MAX`] or no variant exists for `silu_mul`.
pub(crate) fn plan_norm(
    dev: &CudaDevice,
    w: &PackedWeightRef<'_>,
    silu_mul: bool,
    pdl: bool,
    sm80: bool,
) -> Result<Option<NormGemvPlan>> {
    let l = w.layout;
    let Some(&(nt, _, u)) = PGEMV_NORM_KERNELS.iter().find(|v| v.1 == silu_mul) else {
        return Ok(None);
    };
    if 8 * nt != NORM_MAX_M || l.k > NORM_K_MAX || (silu_mul && !l.n.is_multiple_of(2)) {
        return Ok(None);
    }
    let fa = facts(dev)?;
    let image = if sm80 { Image::Compute80Ptx } else { fa.image };
    let loaded = module(dev, KernelFile::GemvPacked, image)?;
    let name = pgemv_norm_kernel_name(silu_mul, nt, u);
    let f = loaded.function_with_smem(&name, NORM_SMEM_MAX)?;
    let smem = 8 * nt * (l.k + 8) * 2;
    let occ = occupancies(&f, &name, smem)?;
    let (warps, split) = packed_geometry(l.groups(silu_mul), l.npairs, fa.sms, &occ);
    let pdl = pdl && image.has_sm90_features();
    let base = finish_plan(dev, (f, name), l, silu_mul, nt, (warps, split, false), pdl)?;
    Ok(Some(NormGemvPlan {
        base,
        w: WeightPtrs::bind(dev, w)?,
    }))
}

/// The fused `(x + delta, gemv(rms_norm(x + delta) · norm_w))` on the GPU: `x` the residual
/// stream BF16 `[m, K]` (m ≤ 8), `delta` the same shape or `None`, `norm_w` the norm
/// weight's device pointer (BF16 `[K]`). Returns one BF16 buffer: with a delta
/// `[m·K sums | m·N_out outputs]`, else the outputs alone.
pub(crate) fn forward_norm(
    plan: &NormGemvPlan,
    norm_w: u64,
    eps: f32,
    x: &CudaStorage,
    lx: &Layout,
    delta: Option<(&CudaStorage, &Layout)>,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "packed_nvfp4_gemv (norm)";
    let base = &plan.base;
    let l = &base.layout;
    let (m, k) = lx.shape().dims2()?;
    if k != l.k || !use_norm_prologue(m, k) {
        bail!(
            "{OP}: the launch plan is for K = {} and up to {NORM_MAX_M} tokens, the call has K = {k} and {m}",
            l.k
        );
    }
    let (x0, x1) = contiguous_range(OP, "x", lx)?;
    if !x0.is_multiple_of(8) || !norm_w.is_multiple_of(16) {
        bail!("{OP}: x and the norm weight must be 16-byte aligned");
    }
    let dev = x.device().clone();
    let stream = dev.cuda_stream();
    let xs = x.as_cuda_slice::<bf16>()?.slice(x0..x1);
    let ds = match delta {
        Some((d, ld)) => {
            let (d0, d1) = contiguous_range(OP, "delta", ld)?;
            if d1 - d0 != m * k || !d0.is_multiple_of(8) {
                bail!("{OP}: delta must be a 16-byte aligned [{m}, {k}] like x");
            }
            Some(d.as_cuda_slice::<bf16>()?.slice(d0..d1))
        }
        None => None,
    };
    let n_out = if base.silu_mul { l.n / 2 } else { l.n };
    let sums = if ds.is_some() { m * k } else { 0 };
    let mut out = unsafe { dev.alloc::<bf16>(sums + m * n_out)? };
    {
        let (xp, _gx) = xs.device_ptr(&stream);
        let dg = ds.as_ref().map(|d| d.device_ptr(&stream));
        let (op_, _go) = out.device_ptr_mut(&stream);
        let elem = std::mem::size_of::<bf16>() as u64;
        let pg = base.partial.as_ref().map(|w| w.device_ptr(&stream));
        let cg = base.counters.as_ref().map(|w| w.device_ptr(&stream));
        let p = PackedGemvParams {
            w: plan.w.w,
            scales: plan.w.s,
            x: xp,
            out: op_ + sums as u64 * elem,
            partial: pg.as_ref().map_or(0, |g| g.0),
            counters: cg.as_ref().map_or(0, |g| g.0),
            delta: dg.as_ref().map_or(0, |g| g.0),
            norm_w,
            sum: if sums > 0 { op_ } else { 0 },
            eps,
            ..base.params(m, k, plan.w.global_scale)
        };
        let launch_m = Launch {
            smem: (m * (k + 8) * 2) as u32,
            ..base.launch
        };
        unsafe { launch(&stream, &base.f, launch_m, &p)? };
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from(sums + m * n_out),
    ))
}
