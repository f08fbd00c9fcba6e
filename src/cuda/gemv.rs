//! Launches of `kernels/gemv.cu`: thin wrappers that check preconditions, then launch.

use super::images::{Image, KernelFile};
use super::launch::{launch, module, Launch, GEMV_BLOCK};
use crate::gemv::{Bf16Gemv, GemvOptions, Nvfp4Gemv};
use crate::kernel_params::{DequantParams, GemvParams};
use crate::nvfp4::{swizzled_shape, BLOCK_SIZE};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::{bail, CudaStorage, Layout, Result, Shape};
use half::bf16;

unsafe impl DeviceRepr for GemvParams {}
unsafe impl DeviceRepr for DequantParams {}

const THREADS: u32 = GEMV_BLOCK;
/// Largest x staging buffer (dynamic shared memory) of the `_xs` kernels.
const XS_MAX: usize = 96 * 1024;

fn contiguous_range(op: &str, what: &str, l: &Layout) -> Result<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(r) => Ok(r),
        None => bail!("{op}: {what} must be contiguous"),
    }
}

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

enum W<'a> {
    Fp4 {
        codes: &'a CudaStorage,
        lc: &'a Layout,
        scales: &'a CudaStorage,
        ls: &'a Layout,
        gs: f32,
    },
    Bf16 {
        w: &'a CudaStorage,
        lw: &'a Layout,
    },
}

fn run(
    op: &str,
    x: &CudaStorage,
    lx: &Layout,
    w: W<'_>,
    opts: &GemvOptions,
) -> Result<(CudaStorage, Shape)> {
    let dev = x.device().clone();
    let stream = dev.cuda_stream();
    let (m, k) = lx.shape().dims2()?;
    let st = lx.stride();
    let rs = if m == 1 { k } else { st[0] };
    if st[1] != 1 || !lx.start_offset().is_multiple_of(8) || rs % 8 != 0 {
        bail!("{op}: x must have unit inner stride, a row stride and offset multiple of 8 (16-byte rows)");
    }
    let cc = super::compute_capability(&dev)?;
    let image = Image::select(cc, opts.image)?;
    let loaded = module(&dev, KernelFile::Gemv, image)?;
    let silu = opts.silu_mul;
    let nt = match opts.nt {
        Some(nt) => nt,
        None => crate::tables::NT_CHOICES
            .into_iter()
            .find(|nt| 8 * nt >= m)
            .unwrap_or(4),
    };
    let xsl = x.as_cuda_slice::<bf16>()?.slice(lx.start_offset()..);
    let (fp4, n, out_scale) = match &w {
        W::Fp4 { lc, gs, .. } => (true, lc.shape().dims2()?.0, gs * 256.0),
        W::Bf16 { lw, .. } => (false, lw.shape().dims2()?.0, 1.0f32),
    };
    let n_out = if silu { n / 2 } else { n };
    let tiles = if silu {
        (n / 2).div_ceil(8)
    } else {
        n.div_ceil(16)
    };
    let nchunks = k.div_ceil(128);
    let split = if image.has_sm90_features() {
        opts.split
            .unwrap_or_else(|| auto_split(tiles, nchunks, loaded.sms))
    } else {
        1
    };
    let tag = match (fp4, silu) {
        (true, false) => "fp4",
        (true, true) => "fp4silu",
        (false, false) => "bf16",
        (false, true) => "bf16silu",
    };
    // x in shared memory (split-1 kernels): every token's K values, 256 B per chunk.
    let xs_bytes = m * nchunks * 256;
    let xs_fits = split == 1 && nt <= 2 && xs_bytes <= XS_MAX;
    let xs = match opts.x_in_smem {
        Some(true) if !xs_fits => {
            bail!("{op}: x ({xs_bytes} B) cannot be staged in shared memory with nt = {nt}, split = {split}")
        }
        Some(v) => v,
        // Off unless asked: slower on the H200 at every measured shape (docs/benchmarks.md).
        None => false,
    };
    let suffix = if xs { "_xs" } else { "" };
    let (f, occ) = loaded.function(&format!("cfp4_gemv_{tag}_nt{nt}_s{split}{suffix}"))?;
    // Split 1 is persistent: as many CTAs as fit at once, each looping over row tiles.
    let grid = if split == 1 {
        tiles.min(loaded.sms * occ as usize)
    } else {
        tiles * split
    };
    let mut out = unsafe { dev.alloc::<bf16>(m * n_out)? };
    let (xp, _gx) = xsl.device_ptr(&stream);
    let (op_, _go) = out.device_ptr_mut(&stream);
    let mut params = GemvParams {
        w: 0,
        scales: 0,
        x: xp,
        out: op_,
        out_scale,
        m: m as i32,
        n: n as i32,
        k: k as i32,
        x_stride: rs as i32,
        sp: swizzled_shape(n, k / BLOCK_SIZE).1 as i32,
        n_tiles: tiles as i32,
        pad: 0,
    };
    let l = Launch {
        grid: (grid as u32, 1, 1),
        block: THREADS,
        cluster: split as u32,
        pdl: opts.pdl && image.has_sm90_features(),
        smem: if xs { xs_bytes as u32 } else { 0 },
    };
    match w {
        W::Fp4 {
            codes,
            lc,
            scales,
            ls,
            ..
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
            unsafe { launch(&stream, &f, l, &params)? };
        }
        W::Bf16 { w, lw } => {
            let (a, b) = contiguous_range(op, "weight", lw)?;
            if a % 8 != 0 {
                bail!("{op}: weight must start 16-byte aligned (element offset {a})");
            }
            let ws = w.as_cuda_slice::<bf16>()?.slice(a..b);
            let (wp, _gw) = ws.device_ptr(&stream);
            params.w = wp;
            unsafe { launch(&stream, &f, l, &params)? };
        }
    }
    drop((_gx, _go));
    let shape = Shape::from((m, n_out));
    Ok((CudaStorage::wrap_cuda_slice(out, dev), shape))
}

pub(crate) fn nvfp4_gemv_cuda(
    op: &Nvfp4Gemv,
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    s: &CudaStorage,
    ls: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let wt = W::Fp4 {
        codes: w,
        lc: lw,
        scales: s,
        ls,
        gs: op.global_scale,
    };
    run("nvfp4_gemv", x, lx, wt, &op.opts)
}

pub(crate) fn bf16_gemv_cuda(
    op: &Bf16Gemv,
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
) -> Result<(CudaStorage, Shape)> {
    run("bf16_gemv", x, lx, W::Bf16 { w, lw }, &op.opts)
}

pub(crate) fn dequantize_rows_cuda(
    w: &CudaStorage,
    lw: &Layout,
    s: &CudaStorage,
    ls: &Layout,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "dequantize_rows";
    let dev = w.device().clone();
    let stream = dev.cuda_stream();
    let (n, k2) = lw.shape().dims2()?;
    let k = 2 * k2;
    let (a, b) = contiguous_range(OP, "weight", lw)?;
    let (sa, sb) = contiguous_range(OP, "weight_scale", ls)?;
    if a % 4 != 0 {
        bail!("{OP}: weight must start 4-byte aligned (offset {a})");
    }
    let image = Image::select(
        super::compute_capability(&dev)?,
        crate::gemv::KernelImage::Auto,
    )?;
    let (f, _) = module(&dev, KernelFile::Gemv, image)?.function("cfp4_dequantize_rows")?;
    let cs = w.as_cuda_slice::<u8>()?.slice(a..b);
    let ss = s.as_cuda_slice::<u8>()?.slice(sa..sb);
    let mut out = unsafe { dev.alloc::<bf16>(n * k)? };
    {
        let (cp, _g1) = cs.device_ptr(&stream);
        let (sp, _g2) = ss.device_ptr(&stream);
        let (op_, _g3) = out.device_ptr_mut(&stream);
        let params = DequantParams {
            codes: cp,
            scales: sp,
            out: op_,
            n: n as i32,
            k: k as i32,
            sp: swizzled_shape(n, k / BLOCK_SIZE).1 as i32,
            pad: 0,
        };
        let words = (n * k / 8) as u32;
        let l = Launch {
            grid: (words.div_ceil(256), 1, 1),
            block: 256,
            cluster: 1,
            pdl: false,
            smem: 0,
        };
        unsafe { launch(&stream, &f, l, &params)? };
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((n, k))))
}
