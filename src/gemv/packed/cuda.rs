//! CUDA forward of the packed-NVFP4 ops (`kernels/gemv_packed.cu`): the packer and the
//! dequantizer (planned per call: they run at load), and the GEMV, whose [`plan`] resolves
//! the kernel, its geometry and its split-K workspace once per layer and token tile, so
//! that [`forward`] only checks the storages and launches.

use super::geometry::{
    depth_suits, packed_geometry, pair_suits, stage_suits, staged_max_m, staged_slice_k,
    staged_smem, use_norm_prologue, NORM_K_MAX, NORM_MAX_M, PACKED_WARPS,
};
use super::layout::PackedLayout;
use crate::cuda::{cuda_err, facts, launch, module, Image, KernelFile, Launch};
use crate::kernel_params::{PackParams, PackedDequantParams, PackedGemvParams};
use crate::layout::contiguous_range;
use crate::nvfp4::{swizzled_shape, BLOCK_SIZE};
use crate::variants::{
    pgemv_depths, pgemv_kernel_name, pgemv_norm_kernel_name, pgemv_pair_kernel_name,
    pgemv_staged_kernel_name, PGEMV_NORM_KERNELS, PGEMV_NTS, PGEMV_PAIR_U, PGEMV_STAGED_U,
};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr,
};
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result, Shape};
use half::bf16;

unsafe impl DeviceRepr for PackedGemvParams {}
unsafe impl DeviceRepr for PackParams {}
unsafe impl DeviceRepr for PackedDequantParams {}

fn one_d(threads: usize) -> Result<Launch> {
    let blocks = threads.div_ceil(256);
    if blocks > u32::MAX as usize {
        bail!("packed NVFP4: {threads} threads are too many for one launch");
    }
    Ok(Launch {
        grid: (blocks as u32, 1, 1),
        block: 256,
        cluster: 1,
        pdl: false,
        smem: 0,
    })
}

/// Packs the codes (`codes` true: inputs codes + swizzled scales → U8 packed codes) or
/// the scales (inputs: the swizzled scales twice → U32 scale words).
pub(crate) fn pack(
    l: &PackedLayout,
    a: &CudaStorage,
    la: &Layout,
    b: &CudaStorage,
    lb: &Layout,
    codes: bool,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "nvfp4-pack";
    let dev = a.device().clone();
    let stream = dev.cuda_stream();
    let image = facts(&dev)?.image;
    let name = if codes {
        "cfp4_pack_codes"
    } else {
        "cfp4_pack_scales"
    };
    let (f, _) = module(&dev, KernelFile::GemvPacked, image)?.function(name)?;
    let (s0, s1) = contiguous_range(OP, "scales", lb)?;
    let scales = b.as_cuda_slice::<u8>()?.slice(s0..s1);
    let (sp_ptr, _gs) = scales.device_ptr(&stream);
    let mut p = PackParams {
        codes: 0,
        scales: sp_ptr,
        out_codes: 0,
        out_scales: 0,
        n: l.n as i32,
        k: l.k as i32,
        sp: swizzled_shape(l.n, l.k / BLOCK_SIZE).1 as i32,
        half_pad: l.half_pad as i32,
        tiles: l.tiles as i32,
        npairs: l.npairs as i32,
    };
    if codes {
        let (c0, c1) = contiguous_range(OP, "codes", la)?;
        let cs = a.as_cuda_slice::<u8>()?.slice(c0..c1);
        let mut out = dev.alloc_zeros::<u8>(l.code_bytes())?;
        {
            let (cp, _gc) = cs.device_ptr(&stream);
            let (op_, _go) = out.device_ptr_mut(&stream);
            p.codes = cp;
            p.out_codes = op_;
            unsafe { launch(&stream, &f, one_d(l.code_bytes() / 16)?, &p)? };
        }
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from(l.code_bytes()),
        ))
    } else {
        let mut out = dev.alloc_zeros::<u32>(l.scale_words())?;
        {
            let (op_, _go) = out.device_ptr_mut(&stream);
            p.out_scales = op_;
            unsafe { launch(&stream, &f, one_d(l.scale_words())?, &p)? };
        }
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from(l.scale_words()),
        ))
    }
}

/// Exact BF16 `[N, K]` from the packed codes and scale words.
pub(crate) fn dequantize(
    l: &PackedLayout,
    c: &CudaStorage,
    lc: &Layout,
    s: &CudaStorage,
    ls: &Layout,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "nvfp4-packed-dequantize";
    let dev = c.device().clone();
    let stream = dev.cuda_stream();
    let image = facts(&dev)?.image;
    let (f, _) = module(&dev, KernelFile::GemvPacked, image)?.function("cfp4_dequantize_packed")?;
    let (c0, c1) = contiguous_range(OP, "codes", lc)?;
    let (s0, s1) = contiguous_range(OP, "scales", ls)?;
    if c1 - c0 != l.code_bytes() || s1 - s0 != l.scale_words() {
        bail!("{OP}: storages do not match the [{}, {}] layout", l.n, l.k);
    }
    let cs = c.as_cuda_slice::<u8>()?.slice(c0..c1);
    let ss = s.as_cuda_slice::<u32>()?.slice(s0..s1);
    let mut out = unsafe { dev.alloc::<bf16>(l.n * l.k)? };
    {
        let (cp, _g1) = cs.device_ptr(&stream);
        let (sp, _g2) = ss.device_ptr(&stream);
        let (op_, _g3) = out.device_ptr_mut(&stream);
        let p = PackedDequantParams {
            w: cp,
            scales: sp,
            out: op_,
            n: l.n as i32,
            k: l.k as i32,
            half_pad: l.half_pad as i32,
            tiles: l.tiles as i32,
            npairs: l.npairs as i32,
            pad: 0,
        };
        unsafe { launch(&stream, &f, one_d(l.code_bytes() / 4)?, &p)? };
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from((l.n, l.k)),
    ))
}

/// The smallest token tile covering `m` tokens.
pub(crate) fn tile_for(m: usize) -> usize {
    PGEMV_NTS
        .into_iter()
        .find(|nt| 8 * nt >= m)
        .unwrap_or(PGEMV_NTS[PGEMV_NTS.len() - 1])
}

/// One packed GEMV kernel resolved for one device, layer and token tile: function, grid,
/// block, split and (split > 1) its workspace, made once and launched without lookups.
/// The workspace makes a plan serve one stream at a time (candle runs one per device).
#[derive(Debug)]
pub(crate) struct PackedPlan {
    f: CudaFunction,
    /// The kernel's name (for tests and `tune`'s tables; never read per call).
    name: String,
    launch: Launch,
    /// The staged kernel (same geometry, x of each CTA's K slice in shared memory) for
    /// up to its `max_m` tokens, where `stage_suits`.
    staged: Option<StagedKernel>,
    layout: PackedLayout,
    silu_mul: bool,
    max_m: usize,
    /// CTA groups (each `split` CTAs): row tiles, tile pairs (silu_mul, or the pair
    /// kernel).
    groups: usize,
    split: usize,
    /// Split > 1: partial sums and the per-group arrival counters (zero between calls).
    partial: Option<CudaSlice<f32>>,
    counters: Option<CudaSlice<u32>>,
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
fn occupancies(f: &CudaFunction, name: &str, smem: usize) -> Result<[usize; 9]> {
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
fn grid_and_workspace(
    dev: &CudaDevice,
    groups: usize,
    split: usize,
    tiles: usize,
    nt: usize,
) -> Result<(usize, Workspace)> {
    let ctas = groups * split;
    if ctas > i32::MAX as usize {
        bail!("packed NVFP4 GEMV: {ctas} CTAs are too many for one launch");
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
fn finish_plan(
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
    fn params(&self, m: usize, x_stride: usize, global_scale: f32) -> PackedGemvParams {
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
    let (m, k) = lx.shape().dims2()?;
    let st = lx.stride();
    let rs = if m == 1 { k } else { st[0] };
    if st[1] != 1 || !lx.start_offset().is_multiple_of(8) || rs % 8 != 0 {
        bail!("{OP}: x must have unit inner stride, a row stride and offset multiple of 8 (16-byte rows)");
    }
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
        let (pp, _gp) = match &plan.partial {
            Some(w) => {
                let (p, g) = w.device_ptr(&stream);
                (p, Some(g))
            }
            None => (0, None),
        };
        let (cnt, _gn) = match &plan.counters {
            Some(w) => {
                let (p, g) = w.device_ptr(&stream);
                (p, Some(g))
            }
            None => (0, None),
        };
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

/// Dynamic shared memory the norm variants may use (set once on the function, the same
/// value for every layer; under the 48 KiB default today, set anyway so a larger
/// [`NORM_K_MAX`] needs no other change).
const NORM_SMEM_MAX: usize = NORM_MAX_M * (NORM_K_MAX + 8) * 2;

/// The packed GEMV with the RMSNorm prologue, resolved for one layer (its weight's
/// pointers included: the layer owns the weight and this plan keeps it alive).
#[derive(Debug)]
pub(crate) struct NormGemvPlan {
    base: PackedPlan,
    w_ptr: u64,
    s_ptr: u64,
    global_scale: f32,
    _weight: (candle_core::Tensor, candle_core::Tensor),
}

/// The device pointer of the contiguous `T` tensor `t` (on the GPU).
fn tensor_ptr<T: candle_core::cuda_backend::CudaDType>(
    t: &candle_core::Tensor,
    what: &str,
    stream: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
) -> Result<u64> {
    const OP: &str = "packed NVFP4 GEMV (norm)";
    let (st, lay) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cs) = &*st else {
        bail!("{OP}: the {what} are not on the GPU")
    };
    let (a, b) = contiguous_range(OP, what, lay)?;
    let slice = cs.as_cuda_slice::<T>()?.slice(a..b);
    let (ptr, _guard) = slice.device_ptr(stream);
    Ok(ptr)
}

/// A packed weight as the norm plan needs it (the parts of `PackedNvfp4`, passed apart so
/// that this file does not import the op module above it).
pub(crate) struct PackedWeightRef<'a> {
    pub layout: &'a PackedLayout,
    pub codes: &'a candle_core::Tensor,
    pub scales: &'a candle_core::Tensor,
    pub global_scale: f32,
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
    let stream = dev.cuda_stream();
    let w_ptr = tensor_ptr::<u8>(w.codes, "codes", &stream)?;
    let s_ptr = tensor_ptr::<u32>(w.scales, "scales", &stream)?;
    if !w_ptr.is_multiple_of(16) {
        bail!("packed NVFP4 GEMV (norm): the packed codes are not 16-byte aligned");
    }
    Ok(Some(NormGemvPlan {
        base,
        w_ptr,
        s_ptr,
        global_scale: w.global_scale,
        _weight: (w.codes.clone(), w.scales.clone()),
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
            w: plan.w_ptr,
            scales: plan.s_ptr,
            x: xp,
            out: op_ + sums as u64 * elem,
            partial: pg.as_ref().map_or(0, |g| g.0),
            counters: cg.as_ref().map_or(0, |g| g.0),
            delta: dg.as_ref().map_or(0, |g| g.0),
            norm_w,
            sum: if sums > 0 { op_ } else { 0 },
            eps,
            ..base.params(m, k, plan.global_scale)
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
