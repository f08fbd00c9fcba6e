//! CUDA forward of the packed-NVFP4 ops (`kernels/gemv_packed.cu`): the packer and the
//! dequantizer (planned per call: they run at load), and the GEMV, whose [`plan`] resolves
//! the kernel, its geometry and its split-K workspace once per layer and token tile, so
//! that [`forward`] only checks the storages and launches.

use super::geometry::{depth_suits, packed_geometry, PACKED_WARPS};
use super::layout::PackedLayout;
use crate::cuda::{cuda_err, facts, launch, module, Image, KernelFile, Launch};
use crate::kernel_params::{PackParams, PackedDequantParams, PackedGemvParams};
use crate::layout::contiguous_range;
use crate::nvfp4::{swizzled_shape, BLOCK_SIZE};
use crate::variants::{pgemv_depths, pgemv_kernel_name, PGEMV_NTS};
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
    launch: Launch,
    layout: PackedLayout,
    silu_mul: bool,
    max_m: usize,
    split: usize,
    /// Split > 1: partial sums and the per-group arrival counters (zero between calls).
    partial: Option<CudaSlice<f32>>,
    counters: Option<CudaSlice<u32>>,
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
    let groups = l.groups(silu_mul);
    let depths = pgemv_depths(nt, silu_mul);
    let mut chosen = None;
    for (i, &u) in depths.iter().enumerate() {
        let name = pgemv_kernel_name(silu_mul, nt, u);
        let (f, _) = loaded.function(&name)?;
        let mut occ = [0usize; 9];
        for w in PACKED_WARPS {
            occ[w] = f
                .occupancy_max_active_blocks_per_multiprocessor(32 * w as u32, 0, None)
                .map_err(|e| cuda_err(&format!("occupancy of {name}"), e))?
                as usize;
        }
        let (warps, split) = packed_geometry(groups, l.npairs, fa.sms, &occ);
        if i + 1 == depths.len() || depth_suits(l.npairs, warps, split, u) {
            chosen = Some((f, warps, split));
            break;
        }
    }
    let Some((f, warps, split)) = chosen else {
        bail!("packed NVFP4 GEMV: no kernel for token tile {nt} (silu_mul {silu_mul})");
    };
    let ctas = groups * split;
    if ctas > i32::MAX as usize {
        bail!("packed NVFP4 GEMV: {ctas} CTAs are too many for one launch");
    }
    let (partial, counters) = if split > 1 {
        let per = (if silu_mul { 2 } else { 1 }) * nt * 32 * 4;
        (
            Some(dev.alloc_zeros::<f32>(ctas * per)?),
            Some(dev.alloc_zeros::<u32>(groups)?),
        )
    } else {
        (None, None)
    };
    Ok(PackedPlan {
        f,
        launch: Launch {
            grid: (ctas as u32, 1, 1),
            block: 32 * warps as u32,
            cluster: 1,
            pdl: pdl && image.has_sm90_features(),
            smem: 0,
        },
        layout: *l,
        silu_mul,
        max_m: 8 * nt,
        split,
        partial,
        counters,
    })
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
            // The kernel's dequantized weights carry 2^-8 (gemv_packed.cu).
            out_scale: global_scale * 256.0,
            m: m as i32,
            n: l.n as i32,
            k: k as i32,
            x_stride: rs as i32,
            half_pad: l.half_pad as i32,
            groups: l.groups(plan.silu_mul) as i32,
            split: plan.split as i32,
            npairs: l.npairs as i32,
            pad: 0,
        };
        unsafe { launch(&stream, &plan.f, plan.launch, &p)? };
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from((m, n_out)),
    ))
}
