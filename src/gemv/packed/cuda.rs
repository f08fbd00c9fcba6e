//! CUDA forward of the packed-NVFP4 GEMV (`kernels/gemv_packed.cu`): [`plan`] resolves the
//! kernel, its geometry and its split-K workspace once per layer and token tile, so that
//! [`forward`] only checks the storages and launches. The packer and the dequantizer
//! (`kernels/gemv_pack.cu`) are in `cuda_pack.rs`, the norm variants' plan and launch in
//! `cuda_norm.rs`.

use super::geometry::{
    depth_suits, packed_geometry, pair_suits, stage_suits, staged_max_m, staged_slice_k,
    staged_smem, PACKED_WARPS,
};
use super::layout::PackedLayout;
use crate::cuda::{cuda_err, facts, launch, module, Image, KernelFile, Launch};
use crate::kernel_params::PackedGemvParams;
use crate::layout::contiguous_range;
use crate::variants::{
    pgemv_depths, pgemv_kernel_name, pgemv_pair_kernel_name, pgemv_staged_kernel_name, PGEMV_NTS,
    PGEMV_PAIR_U, PGEMV_STAGED_U,
};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop,
};
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result, Shape};
use half::bf16;

unsafe impl DeviceRepr for PackedGemvParams {}

/// The smallest token tile covering `m` tokens.
pub(crate) fn tile_for(m: usize) -> usize {
    PGEMV_NTS
        .into_iter()
        .find(|nt| 8 * nt >= m)
        .unwrap_or(PGEMV_NTS[PGEMV_NTS.len() - 1])
}

/// The device address of an optional workspace (0 when there is none) and the guard that
/// must outlive the launch reading it.
pub(super) fn opt_ptr<'a, T>(
    s: &'a Option<CudaSlice<T>>,
    stream: &'a CudaStream,
) -> (u64, Option<SyncOnDrop<'a>>) {
    match s {
        Some(w) => {
            let (p, g) = w.device_ptr(stream);
            (p, Some(g))
        }
        None => (0, None),
    }
}

/// One packed GEMV kernel resolved for one device, layer and token tile: function, grid,
/// block, split and (split > 1) its workspace, made once and launched without lookups.
/// The workspace makes a plan serve one stream at a time (candle runs one per device).
#[derive(Debug)]
pub(crate) struct PackedPlan {
    pub(super) f: CudaFunction,
    /// The kernel's name (for tests and `tune`'s tables; never read per call).
    name: String,
    pub(super) launch: Launch,
    /// The staged kernel (same geometry, x of each CTA's K slice in shared memory) for
    /// up to its `max_m` tokens, where `stage_suits`.
    staged: Option<StagedKernel>,
    pub(super) layout: PackedLayout,
    pub(super) silu_mul: bool,
    max_m: usize,
    /// CTA groups (each `split` CTAs): row tiles, tile pairs (silu_mul, or the pair
    /// kernel).
    groups: usize,
    split: usize,
    /// Split > 1: partial sums and the per-group arrival counters (zero between calls).
    pub(super) partial: Option<CudaSlice<f32>>,
    pub(super) counters: Option<CudaSlice<u32>>,
}

/// The staged twin of a plain one-tile plan: its function, the most tokens whose x rows
/// fit its shared memory, and the shared memory of one token's row (`staged_smem(1, ·)`;
/// a launch of `m ≤ max_m` tokens takes `m` of them, which the plan checked fits).
#[derive(Debug)]
struct StagedKernel {
    f: CudaFunction,
    name: String,
    max_m: usize,
    row_bytes: u32,
}

/// CTAs of `w` warps of kernel `f` that fit on one SM, for every warp count the planner
/// considers, with `smem` bytes of dynamic shared memory per CTA.
pub(super) fn occupancies(f: &CudaFunction, name: &str, smem: usize) -> Result<[usize; 9]> {
    let mut occ = [0usize; 9];
    for w in PACKED_WARPS {
        occ[w] = f
            .occupancy_max_active_blocks_per_multiprocessor(32 * w as u32, smem, None)
            .map_err(|e| cuda_err(&format!("occupancy of {name}"), e))? as usize;
    }
    Ok(occ)
}

/// The grid of `groups · split` CTAs and, for a split, its workspace: partial sums of
/// `tiles · nt` MMA tiles per CTA and one arrival counter per group (zeroed).
type Workspace = (Option<CudaSlice<f32>>, Option<CudaSlice<u32>>);
pub(super) fn grid_and_workspace(
    dev: &CudaDevice,
    groups: usize,
    split: usize,
    tiles: usize,
    nt: usize,
) -> Result<(usize, Workspace)> {
    let ctas = groups * split;
    if ctas > i32::MAX as usize {
        bail!("packed GEMV: {ctas} CTAs are too many for one launch");
    }
    let ws = if split > 1 {
        let per = tiles * nt * 32 * 4;
        (
            Some(dev.alloc_zeros::<f32>(ctas * per)?),
            Some(dev.alloc_zeros::<u32>(groups)?),
        )
    } else {
        (None, None)
    };
    Ok((ctas, ws))
}

/// Plans the packed GEMV of layout `l` for token tile `nt` on `dev` (a lock and occupancy
/// queries: call it at load); `sm80`: the sm_80 code (JIT from PTX) instead of the
/// device's image.
pub(crate) fn plan(
    dev: &CudaDevice,
    l: &PackedLayout,
    silu_mul: bool,
    nt: usize,
    pdl: bool,
    sm80: bool,
) -> Result<PackedPlan> {
    if !PGEMV_NTS.contains(&nt) {
        bail!("packed NVFP4 GEMV: token tile {nt} is not one of {PGEMV_NTS:?}");
    }
    if silu_mul && !l.n.is_multiple_of(2) {
        bail!("packed NVFP4 GEMV: silu_mul needs an even N, got {}", l.n);
    }
    let fa = facts(dev)?;
    let image = if sm80 { Image::Compute80Ptx } else { fa.image };
    let loaded = module(dev, KernelFile::GemvPacked, image)?;
    // Plain, one token tile, many row tiles per SM: two tiles per group.
    if !silu_mul && nt == 1 && pair_suits(l.tiles, fa.sms) {
        let name = pgemv_pair_kernel_name(PGEMV_PAIR_U);
        let (f, _) = loaded.function(&name)?;
        let occ = occupancies(&f, &name, 0)?;
        let (warps, split) = packed_geometry(l.pair_groups(), l.npairs, fa.sms, &occ);
        let pdl = pdl && image.has_sm90_features();
        return finish_plan(dev, (f, name), l, silu_mul, nt, (warps, split, true), pdl);
    }
    let groups = l.groups(silu_mul);
    let depths = pgemv_depths(nt, silu_mul);
    let mut chosen = None;
    for (i, &u) in depths.iter().enumerate() {
        let name = pgemv_kernel_name(silu_mul, nt, u);
        let (f, _) = loaded.function(&name)?;
        let occ = occupancies(&f, &name, 0)?;
        let (warps, split) = packed_geometry(groups, l.npairs, fa.sms, &occ);
        if i + 1 == depths.len() || depth_suits(l.npairs, warps, split, u) {
            chosen = Some((f, name, u, warps, split));
            break;
        }
    }
    let Some((f, name, u, warps, split)) = chosen else {
        bail!("packed NVFP4 GEMV: no kernel for token tile {nt} (silu_mul {silu_mul})");
    };
    let pdl = pdl && image.has_sm90_features();
    let mut p = finish_plan(dev, (f, name), l, silu_mul, nt, (warps, split, false), pdl)?;
    if !silu_mul && nt == 1 && stage_suits(groups * split, fa.sms) {
        p.staged = plan_staged(
            &loaded,
            l,
            u,
            warps,
            split,
            groups * split,
            fa.sms,
            fa.smem_optin,
        )?;
    }
    Ok(p)
}

/// The staged twin of a plain one-tile plan of depth `u` and geometry `(warps, split)`
/// over `ctas` CTAs: allows the kernel all the shared memory a CTA may have, then serves
/// as many tokens as fit in what the device leaves each CTA when `ceil(ctas / sms)` of
/// them share an SM (the plan's occupancy). `None` when no staged kernel has depth `u` or
/// not even one token fits.
#[allow(clippy::too_many_arguments)]
fn plan_staged(
    loaded: &crate::cuda::Loaded,
    l: &PackedLayout,
    u: usize,
    warps: usize,
    split: usize,
    ctas: usize,
    sms: usize,
    smem_optin: usize,
) -> Result<Option<StagedKernel>> {
    if !PGEMV_STAGED_U.contains(&u) {
        return Ok(None);
    }
    let name = pgemv_staged_kernel_name(u);
    let (f, _) = loaded.function(&name)?;
    let fixed = f
        .shared_size_bytes()
        .map_err(|e| cuda_err(&format!("static shared memory of {name}"), e))?
        .max(0) as usize;
    let cap = smem_optin.saturating_sub(fixed);
    let f = loaded.function_with_smem(&name, cap)?;
    let per_sm = ctas.div_ceil(sms.max(1)) as u32;
    let avail = f
        .occupancy_available_dynamic_smem_per_block(per_sm, 32 * warps as u32)
        .map_err(|e| cuda_err(&format!("shared memory per CTA of {name}"), e))?;
    let slice_k = staged_slice_k(l.k, l.npairs, split);
    let max_m = staged_max_m(slice_k, avail.min(cap));
    // max_m > 0: one row fits the device's shared memory per CTA, so it fits u32.
    let row_bytes = staged_smem(1, slice_k).and_then(|b| u32::try_from(b).ok());
    Ok(match row_bytes {
        Some(row_bytes) if max_m > 0 => Some(StagedKernel {
            f,
            name,
            max_m,
            row_bytes,
        }),
        _ => None,
    })
}

/// The plan of kernel `f` with its geometry `(warps, split, pair)` (`pair`: the pair
/// kernel, two row tiles per group): grid, block and (split > 1) the split-K workspace.
pub(super) fn finish_plan(
    dev: &CudaDevice,
    (f, name): (CudaFunction, String),
    l: &PackedLayout,
    silu_mul: bool,
    nt: usize,
    (warps, split, pair): (usize, usize, bool),
    pdl: bool,
) -> Result<PackedPlan> {
    let groups = if pair {
        l.pair_groups()
    } else {
        l.groups(silu_mul)
    };
    let tiles = if silu_mul || pair { 2 } else { 1 };
    let (ctas, (partial, counters)) = grid_and_workspace(dev, groups, split, tiles, nt)?;
    Ok(PackedPlan {
        f,
        name,
        staged: None,
        launch: Launch {
            grid: (ctas as u32, 1, 1),
            block: 32 * warps as u32,
            cluster: 1,
            pdl,
            smem: 0,
        },
        layout: *l,
        silu_mul,
        max_m: 8 * nt,
        groups,
        split,
        partial,
        counters,
    })
}

impl PackedPlan {
    /// The kernel that serves `m` tokens under this plan (the staged one up to its token
    /// count), or `None` past the plan's tokens.
    pub(crate) fn kernel_for(&self, m: usize) -> Option<&str> {
        match &self.staged {
            _ if m == 0 || m > self.max_m => None,
            Some(s) if m <= s.max_m => Some(&s.name),
            _ => Some(&self.name),
        }
    }

    /// The function and launch for `m` tokens (`1 ≤ m ≤ max_m`, checked by the caller):
    /// the staged kernel with its shared memory up to its token count, else the plan's.
    fn launch_for(&self, m: usize) -> (&CudaFunction, Launch) {
        match &self.staged {
            Some(s) if m <= s.max_m => (
                &s.f,
                Launch {
                    // m ≤ max_m rows: planned to fit the device's shared memory per CTA.
                    smem: m as u32 * s.row_bytes,
                    ..self.launch
                },
            ),
            _ => (&self.f, self.launch),
        }
    }

    /// The parameter block for `m` tokens of `x` rows `x_stride` apart, with every pointer
    /// 0 (the caller sets them) and the norm fields off.
    pub(super) fn params(&self, m: usize, x_stride: usize, global_scale: f32) -> PackedGemvParams {
        let l = &self.layout;
        PackedGemvParams {
            w: 0,
            scales: 0,
            x: 0,
            out: 0,
            partial: 0,
            counters: 0,
            // The kernel's dequantized weights carry 2^-8 (gemv_packed.cu).
            out_scale: global_scale * 256.0,
            m: m as i32,
            n: l.n as i32,
            k: l.k as i32,
            x_stride: x_stride as i32,
            half_pad: l.half_pad as i32,
            groups: self.groups as i32,
            split: self.split as i32,
            npairs: l.npairs as i32,
            pad: 0,
            delta: 0,
            norm_w: 0,
            sum: 0,
            eps: 0.0,
            pad2: 0,
        }
    }
}

/// Launches `plan` on `x` and the packed weight: checks the storages against the plan,
/// allocates the output and launches; no lookup, lock or device query.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    plan: &PackedPlan,
    global_scale: f32,
    x: &CudaStorage,
    lx: &Layout,
    c: &CudaStorage,
    lc: &Layout,
    s: &CudaStorage,
    ls: &Layout,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "packed_nvfp4_gemv";
    let l = &plan.layout;
    let dev = x.device().clone();
    let stream = dev.cuda_stream();
    let (m, k, rs) = crate::gemv::checks::x_rows(OP, lx)?;
    if k != l.k || m == 0 || m > plan.max_m {
        bail!(
            "{OP}: the launch plan is for K = {} and up to {} tokens, the call has K = {k} and {m}",
            l.k,
            plan.max_m
        );
    }
    let (c0, c1) = contiguous_range(OP, "packed codes", lc)?;
    let (s0, s1) = contiguous_range(OP, "packed scales", ls)?;
    if c1 - c0 != l.code_bytes() || s1 - s0 != l.scale_words() || c0 % 16 != 0 {
        bail!(
            "{OP}: the packed storages do not match the [{}, {}] layout",
            l.n,
            l.k
        );
    }
    let n_out = if plan.silu_mul { l.n / 2 } else { l.n };
    let xsl = x.as_cuda_slice::<bf16>()?.slice(lx.start_offset()..);
    let cs = c.as_cuda_slice::<u8>()?.slice(c0..c1);
    let ss = s.as_cuda_slice::<u32>()?.slice(s0..s1);
    let mut out = unsafe { dev.alloc::<bf16>(m * n_out)? };
    {
        let (xp, _gx) = xsl.device_ptr(&stream);
        let (cp, _gc) = cs.device_ptr(&stream);
        let (sp, _gs) = ss.device_ptr(&stream);
        let (op_, _go) = out.device_ptr_mut(&stream);
        let (pp, _gp) = opt_ptr(&plan.partial, &stream);
        let (cnt, _gn) = opt_ptr(&plan.counters, &stream);
        let p = PackedGemvParams {
            w: cp,
            scales: sp,
            x: xp,
            out: op_,
            partial: pp,
            counters: cnt,
            ..plan.params(m, rs, global_scale)
        };
        let (f, how) = plan.launch_for(m);
        unsafe { launch(&stream, f, how, &p)? };
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from((m, n_out)),
    ))
}
