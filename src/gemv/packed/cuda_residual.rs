//! The packed GEMV with the residual epilogue on the GPU (`kernels/gemv_packed.cu`,
//! `resid` / `ss_out`): `s = resid + bf16(x · Wᵀ)` and each token's f32 sums of squares of
//! `s` per CTA group, which the next layer's norm prologue takes instead of a norm kernel.
//! The launch reuses the layer's packed plan for `m` tokens; the weight's pointers are
//! resolved once, at load ([`WeightPtrs`]).

use super::cuda::PackedPlan;
use super::cuda_weight::WeightPtrs;
use crate::cuda::launch;
use crate::kernel_params::PackedGemvParams;
use crate::layout::contiguous_range;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
use candle_core::{bail, CudaStorage, Layout, Result, Shape};
use half::bf16;

/// Where the sums of squares start in the residual op's BF16 buffer (in elements): after
/// the `m·n` sums, rounded up to a 4-byte boundary.
pub(crate) fn sums_offset(m: usize, n: usize) -> Result<usize> {
    m.checked_mul(n)
        .and_then(|e| e.checked_add(e % 2))
        .ok_or_else(|| candle_core::Error::Msg(format!("residual GEMV: {m} × {n} overflows")))
}

/// Where `x · w_norm` starts in the residual op's buffer (in elements): after the sums of
/// squares (`2·m·groups` BF16 from [`sums_offset`]).
pub(crate) fn xw_offset(m: usize, n: usize, groups: usize) -> Result<usize> {
    m.checked_mul(groups)
        .and_then(|g| g.checked_mul(2))
        .and_then(|g| g.checked_add(sums_offset(m, n).ok()?))
        .ok_or_else(|| {
            candle_core::Error::Msg(format!("residual GEMV: {m} × {groups} sums overflow"))
        })
}

/// The norm on the accumulator: `bf16(x · Wᵀ · out_scale / m_tok)` (with `silu_mul`, each
/// half so, then `silu(gate) · up`) for `xw` BF16 `[m, K]` (a residual epilogue's stream
/// times the norm weight) and `sums` (its `m × parts` f32 sums of squares as BF16 bits),
/// `m_tok = bf16(sqrt(Σ parts / K + eps))` as the norm kernel rounds it, under the layer's
/// packed plan for `m`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_scaled(
    plan: &PackedPlan,
    w: &WeightPtrs,
    xw: &CudaStorage,
    lx: &Layout,
    sums: &CudaStorage,
    ls: &Layout,
    parts: usize,
    eps: f32,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "packed_nvfp4_gemv (norm on the accumulator)";
    let l = &plan.layout;
    let (m, rs) = plan.check_x(OP, lx)?;
    let (s0, s1) = contiguous_range(OP, "sums of squares", ls)?;
    if !super::geometry::accumulator_norm_serves(m, parts)
        || s1 - s0 != 2 * m * parts
        || !s0.is_multiple_of(2)
    {
        bail!(
            "{OP}: {m} tokens of {parts} parts (at most {} f32) in {} BF16 at {s0}",
            super::geometry::SS_MAX,
            s1 - s0
        );
    }
    let n_out = if plan.silu_mul { l.n / 2 } else { l.n };
    let dev = xw.device().clone();
    let stream = dev.cuda_stream();
    let xsl = xw.as_cuda_slice::<bf16>()?.slice(lx.start_offset()..);
    let ssl = sums.as_cuda_slice::<bf16>()?.slice(s0..s1);
    let mut out = unsafe { dev.alloc::<bf16>(m * n_out)? };
    {
        let (xp, _gx) = xsl.device_ptr(&stream);
        let (sp, _gs) = ssl.device_ptr(&stream);
        let (op_, _go) = out.device_ptr_mut(&stream);
        let pg = plan.partial.as_ref().map(|b| b.device_ptr(&stream));
        let cg = plan.counters.as_ref().map(|b| b.device_ptr(&stream));
        let p = PackedGemvParams {
            w: w.w,
            scales: w.s,
            x: xp,
            out: op_,
            partial: pg.as_ref().map_or(0, |g| g.0),
            counters: cg.as_ref().map_or(0, |g| g.0),
            eps,
            ss_in: sp,
            ss_parts: parts as i32,
            ..plan.params(m, rs, w.global_scale)
        };
        let Some((f, how)) = plan.launch_fs(m) else {
            bail!("{OP}: the plan's kernel has no fused-stream twin");
        };
        unsafe { launch(&stream, f, how, &p)? };
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from(m * n_out),
    ))
}

/// `resid + x · Wᵀ` for `x` BF16 `[m, K]` and `resid` BF16 `[m, N]` (contiguous) under
/// `plan` (a plain or pair plan, no `silu_mul`). Returns one BF16 buffer:
/// `[m·N sums | pad to 4 bytes | m·groups f32 sums of squares as 2·m·groups BF16 | m·N
/// sums times xw_w]`, the last part only where `xw_w` (the next norm's bf16 `[N]` weight,
/// a device pointer) is non-zero.
pub(crate) fn forward_residual(
    plan: &PackedPlan,
    w: &WeightPtrs,
    x: &CudaStorage,
    lx: &Layout,
    resid: &CudaStorage,
    lr: &Layout,
    xw_w: u64,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "packed_nvfp4_gemv (residual)";
    if plan.silu_mul {
        bail!("{OP}: the residual epilogue has no silu_mul form");
    }
    let l = &plan.layout;
    let (m, rs) = plan.check_x(OP, lx)?;
    let (r0, r1) = contiguous_range(OP, "resid", lr)?;
    if r1 - r0 != m * l.n || lr.shape().dims() != [m, l.n] {
        bail!(
            "{OP}: resid must be BF16 [{m}, {}], got {:?}",
            l.n,
            lr.shape().dims()
        );
    }
    let groups = plan.groups();
    let off = sums_offset(m, l.n)?;
    let xw_at = xw_offset(m, l.n, groups)?;
    let total = if xw_w != 0 {
        xw_at.checked_add(m * l.n)
    } else {
        Some(xw_at)
    }
    .ok_or_else(|| candle_core::Error::Msg(format!("{OP}: output size overflows")))?;
    let dev = x.device().clone();
    let stream = dev.cuda_stream();
    let xsl = x.as_cuda_slice::<bf16>()?.slice(lx.start_offset()..);
    let rsl = resid.as_cuda_slice::<bf16>()?.slice(r0..r1);
    let mut out = unsafe { dev.alloc::<bf16>(total)? };
    {
        let (xp, _gx) = xsl.device_ptr(&stream);
        let (rp, _gr) = rsl.device_ptr(&stream);
        let (op_, _go) = out.device_ptr_mut(&stream);
        let pg = plan.partial.as_ref().map(|b| b.device_ptr(&stream));
        let cg = plan.counters.as_ref().map(|b| b.device_ptr(&stream));
        let elem = std::mem::size_of::<bf16>() as u64;
        let p = PackedGemvParams {
            w: w.w,
            scales: w.s,
            x: xp,
            out: op_,
            partial: pg.as_ref().map_or(0, |g| g.0),
            counters: cg.as_ref().map_or(0, |g| g.0),
            resid: rp,
            ss_out: op_ + off as u64 * elem,
            xw_w,
            xw_out: if xw_w != 0 {
                op_ + xw_at as u64 * elem
            } else {
                0
            },
            ..plan.params(m, rs, w.global_scale)
        };
        let Some((f, how)) = plan.launch_fs(m) else {
            bail!("{OP}: the plan's kernel has no fused-stream twin");
        };
        unsafe { launch(&stream, f, how, &p)? };
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(total)))
}
