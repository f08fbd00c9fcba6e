//! CUDA forward of the GEMV ops (`kernels/gemv.cu`): [`plan`] resolves the kernel and its
//! launch geometry once; [`forward`] checks the call's storages and launches the plan.

use super::options::{GemvKnobs, GemvPlan, KernelImage};
use crate::cuda::{facts, launch, module, Image, KernelFile, Launch};
use crate::kernel_params::GemvParams;
use crate::layout::contiguous_range;
use crate::nvfp4::{swizzled_shape, BLOCK_SIZE};
use crate::variants::gemv_kernel_name;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result, Shape};
use half::bf16;

unsafe impl DeviceRepr for GemvParams {}

/// Threads per CTA of every GEMV kernel (4 warps; the kernels' `THREADS`).
const THREADS: u32 = 128;

/// Cluster split: the persistent split-1 kernel wins whenever there are enough row tiles
/// to go around (bench sweep, docs/benchmarks.md); only layers with fewer tiles than
/// half the SMs split K across a cluster, while each warp keeps ≥ 1 chunk.
fn auto_split(tiles: usize, nchunks: usize, sms: usize) -> usize {
    let mut s = 1;
    while s < 8 && tiles * s * 2 <= sms && nchunks >= 4 * 2 * s {
        s *= 2;
    }
    s
}

/// The plan of the GEMV kernel for an `[n, k]` weight (`fp4`: NVFP4, else BF16) with token
/// tile `nt` on `dev`: the function, its grid (split 1 is persistent: as many CTAs as fit
/// at once, each looping over row tiles), cluster split and PDL. Takes the module cache's
/// lock: call it when planning, not per token.
pub(crate) fn plan(
    dev: &CudaDevice,
    fp4: bool,
    n: usize,
    k: usize,
    nt: usize,
    silu: bool,
    opts: &GemvKnobs,
) -> Result<GemvPlan> {
    let f = facts(dev)?;
    let image = match opts.image {
        KernelImage::Auto => f.image,
        KernelImage::Sm80 => Image::Compute80Ptx,
    };
    let loaded = module(dev, KernelFile::Gemv, image)?;
    let tiles = if silu {
        (n / 2).div_ceil(8)
    } else {
        n.div_ceil(16)
    };
    let nchunks = k.div_ceil(128);
    let split = if image.has_sm90_features() {
        opts.split
            .unwrap_or_else(|| auto_split(tiles, nchunks, f.sms))
    } else {
        1
    };
    let (func, occ) = loaded.function(&gemv_kernel_name(fp4, silu, nt, split))?;
    let grid = if split == 1 {
        tiles.min(f.sms * occ as usize)
    } else {
        tiles * split
    };
    if grid > i32::MAX as usize {
        bail!("GEMV: {tiles} row tiles are too many for one launch");
    }
    Ok(GemvPlan {
        f: func,
        launch: Launch {
            grid: (grid as u32, 1, 1),
            block: THREADS,
            cluster: split as u32,
            pdl: opts.pdl && image.has_sm90_features(),
            smem: 0,
        },
        fp4,
        silu_mul: silu,
        n,
        k,
        max_m: 8 * nt,
        n_tiles: tiles,
        sp: swizzled_shape(n, k / BLOCK_SIZE).1,
    })
}

/// The weight operands of one call.
pub(crate) enum Weights<'a> {
    /// NVFP4 codes and swizzled scales, and the global scale.
    Fp4 {
        codes: &'a CudaStorage,
        lc: &'a Layout,
        scales: &'a CudaStorage,
        ls: &'a Layout,
        gs: f32,
    },
    /// BF16 rows.
    Bf16 { w: &'a CudaStorage, lw: &'a Layout },
}

/// Launches `plan` on `x` and the weights: checks the storages against the plan (shape,
/// alignment), allocates the output and launches; no lookup, lock or device query.
pub(crate) fn forward(
    op: &str,
    plan: &GemvPlan,
    x: &CudaStorage,
    lx: &Layout,
    w: Weights<'_>,
) -> Result<(CudaStorage, Shape)> {
    let dev = x.device().clone();
    let stream = dev.cuda_stream();
    let (m, k, rs) = super::checks::x_rows(op, lx)?;
    let fp4 = matches!(w, Weights::Fp4 { .. });
    let n = match &w {
        Weights::Fp4 { lc, .. } => lc.shape().dims2()?.0,
        Weights::Bf16 { lw, .. } => lw.shape().dims2()?.0,
    };
    if fp4 != plan.fp4 || n != plan.n || k != plan.k || m == 0 || m > plan.max_m {
        bail!(
            "{op}: the launch plan is for a [{}, {}] weight and up to {} tokens, the call is [{n}, {k}] with {m}",
            plan.n,
            plan.k,
            plan.max_m
        );
    }
    let n_out = if plan.silu_mul { n / 2 } else { n };
    let xsl = x.as_cuda_slice::<bf16>()?.slice(lx.start_offset()..);
    let mut out = unsafe { dev.alloc::<bf16>(m * n_out)? };
    let (xp, _gx) = xsl.device_ptr(&stream);
    let (op_, _go) = out.device_ptr_mut(&stream);
    let mut params = GemvParams {
        w: 0,
        scales: 0,
        x: xp,
        out: op_,
        out_scale: 1.0,
        m: m as i32,
        n: n as i32,
        k: k as i32,
        x_stride: rs as i32,
        sp: plan.sp as i32,
        n_tiles: plan.n_tiles as i32,
        pad: 0,
    };
    match w {
        Weights::Fp4 {
            codes,
            lc,
            scales,
            ls,
            gs,
        } => {
            let (a, b) = contiguous_range(op, "weight", lc)?;
            let (sa, sb) = contiguous_range(op, "weight_scale", ls)?;
            if a % 16 != 0 || sa % 2 != 0 {
                bail!("{op}: weight must start 16-byte aligned and weight_scale 2-byte aligned (offsets {a}, {sa})");
            }
            let cs = codes.as_cuda_slice::<u8>()?.slice(a..b);
            let ss = scales.as_cuda_slice::<u8>()?.slice(sa..sb);
            let (wp, _gw) = cs.device_ptr(&stream);
            let (sp, _gs) = ss.device_ptr(&stream);
            params.w = wp;
            params.scales = sp;
            // The kernel's dequantized weights carry 2^-8 (gemv.cuh).
            params.out_scale = gs * 256.0;
            unsafe { launch(&stream, &plan.f, plan.launch, &params)? };
        }
        Weights::Bf16 { w, lw } => {
            let (a, b) = contiguous_range(op, "weight", lw)?;
            if a % 8 != 0 {
                bail!("{op}: weight must start 16-byte aligned (element offset {a})");
            }
            let ws = w.as_cuda_slice::<bf16>()?.slice(a..b);
            let (wp, _gw) = ws.device_ptr(&stream);
            params.w = wp;
            unsafe { launch(&stream, &plan.f, plan.launch, &params)? };
        }
    }
    drop((_gx, _go));
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from((m, n_out)),
    ))
}
