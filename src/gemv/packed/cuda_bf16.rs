//! CUDA forward of the packed GEMV kernel over a BF16 weight in its natural `[N, K]` layout
//! (`kernels/gemv_packed.cu`, "BF16 weights"): [`plan_bf16`] resolves the kernel, geometry
//! and split-K workspace once per layer (one token tile: up to 8 tokens), [`forward_bf16`]
//! checks the storages and launches. The weight is the tensor a matmul would use: no
//! repacking, no second copy.

use super::cuda::{grid_and_workspace, occupancies, opt_ptr};
use super::geometry::{
    bw_geometry, depth_suits, pair_suits, stage_suits, staged_smem, BW_DEEP_RUN, STAGED_MAX_M,
};
use crate::cuda::{facts, launch, module, Image, KernelFile, Launch};
use crate::gemv::checks::x_rows;
use crate::kernel_params::PackedGemvParams;
use crate::layout::contiguous_range;
use crate::variants::{pgemv_bw_kernel_name, BwKind, PGEMV_BW_KERNELS};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, DevicePtrMut};
use candle_core::{
    bail, CpuStorage, CudaDevice, CudaStorage, CustomOp2, Layout, Result, Shape, Tensor,
};
use half::bf16;
use std::sync::Arc;

/// K steps of the BF16-weight kernels: 64-wide chunks.
pub(crate) const BW_STEP: usize = 64;

/// Most tokens the BF16-weight kernels serve (one token tile).
pub(crate) const BW_MAX_M: usize = 8;

/// One BF16-weight GEMV kernel resolved for one device and layer.
#[derive(Debug)]
pub(crate) struct Bf16Plan {
    f: CudaFunction,
    /// The kernel's name (for tests; never read per call).
    name: String,
    launch: Launch,
    /// The staged kernel for one token, with its dynamic shared memory, where
    /// `stage_suits` and the CTA's x slice fits the default 48 KiB.
    staged: Option<(CudaFunction, String, u32)>,
    n: usize,
    k: usize,
    silu_mul: bool,
    groups: usize,
    split: usize,
    partial: Option<CudaSlice<f32>>,
    counters: Option<CudaSlice<u32>>,
}

/// The depths `u` compiled for `kind`, deepest first.
fn depths(kind: BwKind) -> Vec<usize> {
    let mut us: Vec<usize> = PGEMV_BW_KERNELS
        .iter()
        .filter(|(k, _)| *k == kind)
        .map(|&(_, u)| u)
        .collect();
    us.sort_unstable_by(|a, b| b.cmp(a));
    us
}

/// Plans the GEMV of a BF16 `[n, k]` weight on `dev` (a lock and occupancy queries: call it
/// at load); `sm80`: the sm_80 code (JIT from PTX) instead of the device's image. The
/// geometry is the BF16 kernel's own rule (`bw_geometry`; the NVFP4 kernel's rule it
/// replaced: docs/benchmarks.md, thirty-fourth session). `None` when the kernels cannot
/// serve the shape (`k` not a multiple of 64, an odd `n` with `silu_mul`).
pub(crate) fn plan_bf16(
    dev: &CudaDevice,
    n: usize,
    k: usize,
    silu_mul: bool,
    pdl: bool,
    sm80: bool,
) -> Result<Option<Bf16Plan>> {
    if n == 0 || k == 0 || !k.is_multiple_of(BW_STEP) || (silu_mul && !n.is_multiple_of(2)) {
        return Ok(None);
    }
    if n > i32::MAX as usize || k > i32::MAX as usize {
        bail!("BF16 GEMV: [{n}, {k}] does not fit the kernel's 32-bit sizes");
    }
    let fa = facts(dev)?;
    let image = if sm80 { Image::Compute80Ptx } else { fa.image };
    let loaded = module(dev, KernelFile::GemvPacked, image)?;
    let steps = k / BW_STEP;
    let tiles = n.div_ceil(16);
    let (kind, groups) = if silu_mul {
        (BwKind::Silu, (n / 2).div_ceil(16))
    } else if pair_suits(tiles, fa.sms) {
        (BwKind::Pair, tiles.div_ceil(2))
    } else {
        (BwKind::Plain, tiles)
    };
    let tiles_per_group = if matches!(kind, BwKind::Pair | BwKind::Silu) {
        2
    } else {
        1
    };
    let us = depths(kind);
    let mut chosen = None;
    for (i, &u) in us.iter().enumerate() {
        let name = pgemv_bw_kernel_name(kind, u);
        let (f, _) = loaded.function(&name)?;
        let occ = occupancies(&f, &name, 0)?;
        // The geometry, and the warp run from which depth `u` serves.
        let step_bytes = tiles_per_group * 16 * BW_STEP * 2;
        let (warps, split) = bw_geometry(groups, steps, step_bytes, u, fa.sms, &occ);
        if i + 1 == us.len() || depth_suits(steps, warps, split, BW_DEEP_RUN.max(u)) {
            chosen = Some((f, name, u, warps, split));
            break;
        }
    }
    let Some((f, name, u, warps, split)) = chosen else {
        bail!("BF16 GEMV: no kernel of kind {kind:?} is compiled");
    };
    let (ctas, (partial, counters)) = grid_and_workspace(dev, groups, split, tiles_per_group, 1)?;
    let mut staged = None;
    if kind == BwKind::Plain && stage_suits(ctas, fa.sms) {
        // One token's x rows over the CTA's K slice, within the default 48 KiB.
        let slice_k = (BW_STEP * steps.div_ceil(split)).min(k);
        let bytes = staged_smem(1, slice_k).filter(|&b| b <= 48 * 1024);
        if let (Some(bytes), true) = (bytes, PGEMV_BW_KERNELS.contains(&(BwKind::Staged, u))) {
            let sname = pgemv_bw_kernel_name(BwKind::Staged, u);
            let (sf, _) = loaded.function(&sname)?;
            staged = Some((sf, sname, bytes as u32));
        }
    }
    Ok(Some(Bf16Plan {
        f,
        name,
        launch: Launch {
            grid: (ctas as u32, 1, 1),
            block: 32 * warps as u32,
            cluster: 1,
            pdl: pdl && image.has_sm90_features(),
            smem: 0,
        },
        staged,
        n,
        k,
        silu_mul,
        groups,
        split,
        partial,
        counters,
    }))
}

impl Bf16Plan {
    /// The kernel this plan launches for `m` tokens (`None` outside `1..=8`).
    pub(crate) fn kernel_for(&self, m: usize) -> Option<&str> {
        match &self.staged {
            _ if m == 0 || m > BW_MAX_M => None,
            Some((_, s, _)) if m <= STAGED_MAX_M => Some(s),
            _ => Some(&self.name),
        }
    }
}

/// Launches `plan` on `x` (BF16 `[M, K]`, unit inner stride) and the BF16 weight `[N, K]`
/// (contiguous, 16-byte aligned rows): checks the storages against the plan, allocates the
/// output and launches; no lookup, lock or device query.
pub(crate) fn forward_bf16(
    plan: &Bf16Plan,
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "bf16_gemv (packed kernel)";
    let dev = x.device().clone();
    let stream = dev.cuda_stream();
    let (m, k, rs) = x_rows(OP, lx)?;
    if k != plan.k || m == 0 || m > BW_MAX_M {
        bail!(
            "{OP}: the launch plan is for K = {} and up to {BW_MAX_M} tokens, the call has K = {k} and {m}",
            plan.k
        );
    }
    let (w0, w1) = contiguous_range(OP, "weight", lw)?;
    if w1 - w0 != plan.n * plan.k || w0 % 8 != 0 {
        bail!(
            "{OP}: the weight must be a contiguous [{}, {}] BF16 tensor at a 16-byte offset",
            plan.n,
            plan.k
        );
    }
    let n_out = if plan.silu_mul { plan.n / 2 } else { plan.n };
    let xsl = x.as_cuda_slice::<bf16>()?.slice(lx.start_offset()..);
    let ws = w.as_cuda_slice::<bf16>()?.slice(w0..w1);
    let mut out = unsafe { dev.alloc::<bf16>(m * n_out)? };
    {
        let (xp, _gx) = xsl.device_ptr(&stream);
        let (wp, _gw) = ws.device_ptr(&stream);
        let (op_, _go) = out.device_ptr_mut(&stream);
        let (pp, _gp) = opt_ptr(&plan.partial, &stream);
        let (cnt, _gn) = opt_ptr(&plan.counters, &stream);
        let p = PackedGemvParams {
            w: wp,
            scales: 0,
            x: xp,
            out: op_,
            partial: pp,
            counters: cnt,
            out_scale: 1.0,
            m: m as i32,
            n: plan.n as i32,
            k: plan.k as i32,
            x_stride: rs as i32,
            half_pad: 0,
            groups: plan.groups as i32,
            split: plan.split as i32,
            npairs: (plan.k / BW_STEP) as i32,
            pad: 0,
            delta: 0,
            norm_w: 0,
            sum: 0,
            eps: 0.0,
            pad2: 0,
        };
        let (f, how) = match &plan.staged {
            Some((sf, _, bytes)) if m <= STAGED_MAX_M => (
                sf,
                Launch {
                    smem: m as u32 * bytes,
                    ..plan.launch
                },
            ),
            _ => (&plan.f, plan.launch),
        };
        unsafe { launch(&stream, f, how, &p)? };
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from((m, n_out)),
    ))
}

/// The BF16-weight GEMV as a candle op (inputs `x`, the weight), launching a plan made at
/// load. CUDA only: on the CPU the BF16 GEMV is `gemv::bf16_gemv`.
struct Bf16Gemv(Arc<Bf16Plan>);

impl CustomOp2 for Bf16Gemv {
    fn name(&self) -> &'static str {
        "bf16-gemv-packed-kernel"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("bf16_gemv (packed kernel): a CUDA plan cannot run on the CPU")
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        w: &CudaStorage,
        lw: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        forward_bf16(&self.0, x, lx, w, lw)
    }
}

/// `x` BF16 `[M, K]` (M ≤ 8) times the BF16 weight `w` `[N, K]` transposed, by `plan` (made
/// for `w`'s shape and epilogue).
pub(crate) fn bf16_gemv_packed_planned(
    x: &Tensor,
    w: &Tensor,
    plan: Arc<Bf16Plan>,
) -> Result<Tensor> {
    x.apply_op2_no_bwd(w, &Bf16Gemv(plan))
}
