//! Launches of `kernels/ultraquant.cu`: UltraQuant store and read-back, split-KV decode
//! attention (UltraQuant or BF16 cache) and the combine of its splits.

use super::images::{Image, KernelFile};
use super::launch::{cuda_err, launch, module, Launch, Loaded};
use super::scratch::kv_scratch;
use crate::gemv::KernelImage;
use crate::kernel_params::{KvAttnParams, KvCombineParams, UqReadParams, UqStoreParams};
use crate::kv_cache::ops::{range, KvAttention, UqRead, UqStore};
use crate::kv_cache::{
    cuda_head_dims, ring_first_default, row_stream_supported, CacheShape, KvCacheKind,
    ROW_STREAM_HEADS, SLOT_PADDING,
};
use crate::ultraquant::{slot_size, DEFAULT_CONSTANT_C};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
};
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result, Shape, Storage};
use half::bf16;
use std::sync::Arc;

unsafe impl DeviceRepr for UqStoreParams {}
unsafe impl DeviceRepr for UqReadParams {}
unsafe impl DeviceRepr for KvAttnParams {}
unsafe impl DeviceRepr for KvCombineParams {}

/// Largest split count `cfp4_kv_combine` takes (`CFP4_KV_MAX_SPLITS` in the .cu).
const MAX_SPLITS: usize = 1024;
/// Whether the splits are merged in the attention kernel when [`DecodeOptions`] leaves it
/// open. Measured on the H200 (docs/benchmarks.md): the same GPU time either way for
/// UltraQuant (16-warp CTAs, one (head, d) per thread in the merge) and one kernel launch and
/// two allocations less per call; the BF16 kernel's 4-warp CTAs merge 4 values per thread
/// over twice the splits and are 1–2 µs slower fused, so it keeps the combine kernel.
///
/// [`DecodeOptions`]: crate::kv_cache::DecodeOptions
fn fused_merge_default(fp4: bool) -> bool {
    fp4
}

/// Threads of the store / read kernels (one warp per (token, head)).
const FORMAT_THREADS: u32 = 256;

fn loaded(dev: &CudaDevice) -> Result<Arc<Loaded>> {
    let image = Image::select(super::compute_capability(dev)?, KernelImage::Auto)?;
    module(dev, KernelFile::Ultraquant, image)
}

fn check_head_dim(op: &str, kind: KvCacheKind, d: usize) -> Result<()> {
    let dims = cuda_head_dims(kind);
    if !dims.contains(&d) {
        bail!("{op}: the CUDA kernels of the {kind:?} cache support head_dim {dims:?}, got {d}")
    }
    Ok(())
}

/// A plain launch (no cluster, no PDL) of a 3-d grid of 1-d blocks with `smem` bytes of
/// dynamic shared memory, through the crate's one `cuLaunchKernelEx` wrapper.
///
/// # Safety
/// `P` must be the kernel's parameter type and its pointers valid until the launch is queued.
unsafe fn launch_grid<P: DeviceRepr + Copy>(
    stream: &CudaStream,
    f: &CudaFunction,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    params: &P,
) -> Result<()> {
    let l = Launch {
        grid,
        block,
        cluster: 1,
        pdl: false,
        smem,
    };
    launch(stream, f, l, params)
}

/// Blocks of `FORMAT_THREADS` for one warp per item.
fn warp_grid(op: &str, items: usize) -> Result<u32> {
    let blocks = items.div_ceil(FORMAT_THREADS as usize / 32);
    if blocks > i32::MAX as usize {
        bail!("{op}: {items} (token, head) slots are too many for one launch")
    }
    Ok(blocks as u32)
}

/// Checks the slot storage range: 16-byte aligned start, slots and padding inside.
fn check_slots(op: &str, shape: &CacheShape, l: &Layout) -> Result<(usize, usize)> {
    let (a, b) = range(op, "cache", l)?;
    let need = shape.elems(op, slot_size(shape.head_dim, None)?)? + SLOT_PADDING;
    if !a.is_multiple_of(16) || b - a < need {
        bail!("{op}: the cache must start 16-byte aligned and hold {need} bytes (offset {a}, {} bytes)", b - a)
    }
    Ok((a, b))
}

pub(crate) fn uq_store_cuda(
    op: &UqStore,
    cache: &mut CudaStorage,
    lc: &Layout,
    k: &CudaStorage,
    lk: &Layout,
    v: &CudaStorage,
    lv: &Layout,
) -> Result<()> {
    const OP: &str = "ultraquant store (cuda)";
    let sh = op.shape;
    check_head_dim(OP, KvCacheKind::UltraQuant, sh.head_dim)?;
    let dev = cache.device().clone();
    let stream = dev.cuda_stream();
    let (ca, cb) = check_slots(OP, &sh, lc)?;
    let (ka, kb) = range(OP, "k", lk)?;
    let (va, vb) = range(OP, "v", lv)?;
    let n = op.starts.len() * op.tokens * sh.kv_heads * sh.head_dim;
    if kb - ka != n || vb - va != n {
        bail!(
            "{OP}: k/v hold {} / {} values, expected {n}",
            kb - ka,
            vb - va
        )
    }
    let (lens_guard, ll) = op.lens_dev.storage_and_layout();
    let lens = match &*lens_guard {
        Storage::Cuda(s) => s.as_cuda_slice::<u32>()?,
        _ => bail!("{OP}: the lengths tensor must be on the GPU"),
    };
    let (la, lb) = range(OP, "lens", ll)?;
    if lb - la != sh.batch {
        bail!("{OP}: {} lengths for batch {}", lb - la, sh.batch)
    }
    let f = loaded(&dev)?
        .function(&format!("cfp4_uq_store_d{}", sh.head_dim))?
        .0;
    let grid = warp_grid(OP, op.starts.len() * op.tokens * sh.kv_heads)?;
    let ks = k.as_cuda_slice::<bf16>()?.slice(ka..kb);
    let vs = v.as_cuda_slice::<bf16>()?.slice(va..vb);
    let lsl = lens.slice(la..lb);
    let mut cs = cache.as_cuda_slice_mut::<u8>()?.slice_mut(ca..cb);
    let (cp, _g0) = cs.device_ptr_mut(&stream);
    let (kp, _g1) = ks.device_ptr(&stream);
    let (vp, _g2) = vs.device_ptr(&stream);
    let (lp, _g3) = lsl.device_ptr(&stream);
    if !cp.is_multiple_of(16) {
        bail!("{OP}: the cache must be 16-byte aligned in device memory")
    }
    let params = UqStoreParams {
        cache: cp,
        k: kp,
        v: vp,
        lens: lp,
        c: DEFAULT_CONSTANT_C,
        seq_base: op.seq_base as i32,
        n_seq: op.starts.len() as i32,
        tokens: op.tokens as i32,
        kv_heads: sh.kv_heads as i32,
        capacity: sh.capacity as i32,
        head_dim: sh.head_dim as i32,
        pad: 0,
    };
    unsafe { launch_grid(&stream, &f, (grid, 1, 1), FORMAT_THREADS, 0, &params) }
}

pub(crate) fn uq_read_cuda(
    op: &UqRead,
    cache: &CudaStorage,
    lc: &Layout,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "ultraquant read (cuda)";
    let sh = op.shape;
    check_head_dim(OP, KvCacheKind::UltraQuant, sh.head_dim)?;
    if op.seq >= sh.batch || op.start + op.count > sh.capacity || op.count == 0 {
        bail!(
            "{OP}: sequence {}, tokens {}..{} outside the cache",
            op.seq,
            op.start,
            op.start + op.count
        )
    }
    let dev = cache.device().clone();
    let stream = dev.cuda_stream();
    let (ca, cb) = check_slots(OP, &sh, lc)?;
    let f = loaded(&dev)?
        .function(&format!("cfp4_uq_read_d{}", sh.head_dim))?
        .0;
    let grid = warp_grid(OP, op.count * sh.kv_heads)?;
    let mut out = unsafe { dev.alloc::<bf16>(2 * op.count * sh.kv_heads * sh.head_dim)? };
    {
        let cs = cache.as_cuda_slice::<u8>()?.slice(ca..cb);
        let (cp, _g0) = cs.device_ptr(&stream);
        let (outp, _g1) = out.device_ptr_mut(&stream);
        let params = UqReadParams {
            cache: cp,
            out: outp,
            seq: op.seq as i32,
            start: op.start as i32,
            count: op.count as i32,
            kv_heads: sh.kv_heads as i32,
            capacity: sh.capacity as i32,
            head_dim: sh.head_dim as i32,
        };
        unsafe { launch_grid(&stream, &f, (grid, 1, 1), FORMAT_THREADS, 0, &params)? };
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), op.out_shape()))
}

/// Warps per CTA and dynamic shared memory of one attention kernel: mirrors `Cfg` (and with
/// `rows`, `RowsCfg`) in kernels/ultraquant.cu (the kernel traps when it gets less than it
/// needs).
fn attn_config(fp4: bool, d: usize, nt: usize, rows: bool) -> (usize, usize) {
    let nw = match (fp4, d) {
        (true, 256) => 4,
        (true, _) if nt == 1 => 16,
        (true, _) => 8,
        (false, 256) => 2,
        (false, _) => 4,
    };
    let nstage = if fp4 && nw != 16 { 3 } else { 2 };
    let slot = d + d / 16;
    let gcd16 = if slot.is_multiple_of(16) {
        16
    } else if slot.is_multiple_of(8) {
        8
    } else {
        4
    };
    let srow = if fp4 {
        (slot + (16 - gcd16)).div_ceil(16) * 16
    } else {
        4 * d + 16
    };
    let hc = 4 * nt;
    let tpi = if fp4 { 2 } else { 1 }; // 16-token tiles per stage buffer
    let red_o = nw * hc * d * 4;
    if rows {
        // RowsCfg: NWH = nw / HB warp groups, each with NST = 3 stages of 16 · tpi token rows
        // of HB slots (+ 16 bytes), the queries of HB KV heads, and 2 mbarriers per stage.
        let (hb, nst) = (ROW_STREAM_HEADS, 3);
        let nwh = nw / hb;
        let stages = nwh * nst * 16 * tpi * (hb * slot + 16);
        let bar_off = stages.max(red_o) + hb * hc * d * 4 + 2 * nw * hc * 4;
        return (nw, bar_off + 2 * nwh * nst * 8);
    }
    let stages = nw * nstage * 16 * tpi * srow;
    let smem = stages.max(red_o) + hc * d * 4 + 2 * nw * hc * 4;
    (nw, smem)
}

/// Splits per (sequence, KV head): `floor(resident / base)` (one wave of `resident` CTAs),
/// but at least one 16-token tile per warp.
fn auto_splits(max_len: usize, base_ctas: usize, resident_ctas: usize, nw: usize) -> usize {
    let target = resident_ctas / base_ctas.max(1);
    let by_len = max_len.div_ceil(16 * nw);
    target.min(by_len).clamp(1, MAX_SPLITS)
}

/// Launches attention kernel `f` on BF16 K and V held as `s[a..a + half]` and
/// `s[a + half..a + 2·half]` (`what` names them in errors), keeping both pointers' stream
/// guards alive across the launch.
///
/// # Safety
/// As [`launch`]: `params` must be valid for `f` apart from its `k` and `v`.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_bf16_kv(
    stream: &Arc<CudaStream>,
    what: &str,
    s: &CudaSlice<bf16>,
    a: usize,
    half: usize,
    f: &CudaFunction,
    l: Launch,
    params: KvAttnParams,
) -> Result<()> {
    let (ks, vs) = (s.slice(a..a + half), s.slice(a + half..a + 2 * half));
    let (kp, _gk) = ks.device_ptr(stream);
    let (vp, _gv) = vs.device_ptr(stream);
    if !kp.is_multiple_of(16) || !vp.is_multiple_of(16) {
        bail!("decode attention (cuda): the {what} must be 16-byte aligned in device memory")
    }
    let p = KvAttnParams {
        k: kp,
        v: vp,
        ..params
    };
    launch(stream, f, l, &p)
}

/// One attention kernel with its warps per CTA and dynamic shared memory.
struct AttnKernel {
    f: CudaFunction,
    nw: usize,
    smem: usize,
}

impl AttnKernel {
    fn get(
        loaded: &Loaded,
        stream: &CudaStream,
        fp4: bool,
        d: usize,
        nt: usize,
        rows: bool,
    ) -> Result<Self> {
        const OP: &str = "decode attention (cuda)";
        let (nw, smem) = attn_config(fp4, d, nt, rows);
        let optin = stream
            .context()
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(|e| cuda_err("cuDeviceGetAttribute", e))?;
        if smem > optin as usize {
            bail!("{OP}: the head_dim {d} kernel needs {smem} bytes of shared memory, this GPU allows {optin}")
        }
        let tag = match (fp4, rows) {
            (true, true) => "uqrows",
            (true, false) => "uq",
            (false, _) => "bf16",
        };
        let f = loaded
            .function(&format!("cfp4_kv_attn_{tag}_d{d}_nt{nt}"))?
            .0;
        f.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(|e| cuda_err("cuFuncSetAttribute(max dynamic shared memory)", e))?;
        Ok(Self { f, nw, smem })
    }

    fn launch(&self, grid: (u32, u32, u32), pdl: bool) -> Launch {
        Launch {
            grid,
            block: (self.nw * 32) as u32,
            cluster: 1,
            pdl,
            smem: self.smem as u32,
        }
    }
}

pub(crate) fn kv_attention_cuda(
    op: &KvAttention,
    q: &CudaStorage,
    lq: &Layout,
    kv: &CudaStorage,
    lkv: &Layout,
    lens: &CudaStorage,
    ll: &Layout,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "decode attention (cuda)";
    let sh = op.shape;
    let d = sh.head_dim;
    check_head_dim(OP, op.kind, d)?;
    let fp4 = op.kind == KvCacheKind::UltraQuant;
    let group = op.q_heads / sh.kv_heads;
    let nt = if group <= 4 || d == 256 { 1 } else { 2 };
    let chunks = group.div_ceil(4 * nt);
    if sh.kv_heads * chunks > 65535 || sh.batch > 65535 {
        bail!(
            "{OP}: kv_heads · head chunks ({}) and batch ({}) must be at most 65535",
            sh.kv_heads * chunks,
            sh.batch
        )
    }
    let dev = q.device().clone();
    let stream = dev.cuda_stream();
    let loaded = loaded(&dev)?;
    // The row-streaming UltraQuant kernel (HB KV heads per CTA, whole token rows by bulk
    // copies) when the options ask for it.
    let rows_ok =
        row_stream_supported(fp4, d, group, sh.kv_heads, loaded.image.has_sm90_features());
    let rows = match op.opts.row_stream {
        Some(true) if !rows_ok => bail!(
            "{OP}: row_stream needs an UltraQuant cache with head_dim 128, at most 4 query heads per KV head, a multiple of {ROW_STREAM_HEADS} KV heads and an sm_90+ GPU; here head_dim {d}, {group} query heads per KV head, {} KV heads",
            sh.kv_heads
        ),
        Some(r) => r,
        // Opt-in: on the H200 it is slower than the per-head kernel at every measured point
        // (its copy alone runs at 82 % of copy bandwidth at 32k × 8, but its math alone takes
        // 93 µs there: docs/benchmarks.md).
        None => false,
    };
    // KV heads per CTA of the main kernel, and its grid's y extent.
    let hb = if rows { ROW_STREAM_HEADS } else { 1 };
    let main_y = sh.kv_heads / hb * chunks;
    let main = AttnKernel::get(&loaded, &stream, fp4, d, nt, rows)?;
    // Exact window: the UltraQuant kernel over the older tokens, then the BF16 kernel over
    // the ring, both writing partials of one merge.
    let win = match (&op.window, fp4) {
        (Some(w), true) => Some(w),
        _ => None,
    };
    let ring_kernel = match win {
        Some(_) => Some(AttnKernel::get(&loaded, &stream, false, d, nt, false)?),
        None => None,
    };
    let w = win.map_or(0, |w| w.size);
    let max_len = op
        .lens
        .iter()
        .map(|&n| n.saturating_sub(w))
        .max()
        .unwrap_or(0);
    let splits = match op.opts.splits {
        Some(s) => s.clamp(1, MAX_SPLITS),
        None => {
            let per_sm = main
                .f
                .occupancy_max_active_blocks_per_multiprocessor(
                    (main.nw * 32) as u32,
                    main.smem,
                    None,
                )
                .map_err(|e| cuda_err("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))?
                .max(1) as usize;
            // UltraQuant: one CTA per SM. Measured on the H200 (docs/benchmarks.md, split
            // sweep): its warps then run twice as many iterations, which amortizes the
            // per-CTA query rotation and warp merge, and beat two CTAs per SM at batch 1
            // (32k: 25.8 vs 28.9 us). BF16: a full wave of resident CTAs.
            let resident = if fp4 { loaded.sms } else { per_sm * loaded.sms };
            auto_splits(max_len, sh.batch * main_y, resident, main.nw / hb)
        }
    };
    // The ring's splits: one per 16-token tile per warp of the BF16 kernel.
    let ring_splits = match &ring_kernel {
        Some(rk) => w.div_ceil(16 * rk.nw).clamp(1, MAX_SPLITS),
        None => 0,
    };
    let total = splits + ring_splits;
    if total > MAX_SPLITS {
        bail!("{OP}: {total} splits exceed {MAX_SPLITS}")
    }

    // The exact window's ring, checked before anything is launched (a launch that fails
    // halfway would leave the merge counters of the fused merge counting).
    let ring_storage = win.map(|wd| wd.ring.storage_and_layout());
    let ring_args = match &ring_storage {
        Some((st, l)) => {
            let Storage::Cuda(rs) = &**st else {
                bail!("{OP}: the exact window ring is not on the GPU")
            };
            let (a, b) = range(OP, "exact window ring", l)?;
            let half = sh.batch * w * sh.kv_heads * d;
            if b - a != 2 * half {
                bail!(
                    "{OP}: the exact window ring holds {} values, expected {}",
                    b - a,
                    2 * half
                )
            }
            let ring = rs.as_cuda_slice::<bf16>()?;
            let base = ring.device_ptr(&stream).0;
            if !(base + 2 * a as u64).is_multiple_of(16) || !(2 * half).is_multiple_of(16) {
                bail!("{OP}: the exact window ring must be 16-byte aligned in device memory")
            }
            Some((ring, a, half))
        }
        _ => None,
    };
    let (qa, qb) = range(OP, "q", lq)?;
    if qb - qa != sh.batch * op.q_heads * d {
        bail!(
            "{OP}: q holds {} values, expected {}",
            qb - qa,
            sh.batch * op.q_heads * d
        )
    }
    let (la, lb) = range(OP, "lens", ll)?;
    if lb - la != sh.batch {
        bail!("{OP}: {} lengths for batch {}", lb - la, sh.batch)
    }
    let n_out = sh.batch * op.q_heads * d;
    let mut out = unsafe { dev.alloc::<bf16>(n_out)? };
    // Merge of the splits: in the attention kernel's last CTA per head group (needs its
    // weights in every launching kernel's shared memory), or by cfp4_kv_combine.
    // With row streaming the last CTA merges the heads of its HB KV heads, and the ring's
    // grid (one KV head per CTA) counts differently, so a ring means the combine kernel.
    let nh = hb * 4 * nt;
    let fits = |k: &AttnKernel| (nh * total + nh) * 4 <= k.smem;
    let fused = total > 1
        && (!rows || ring_kernel.is_none())
        && op
            .opts
            .fused_merge
            .unwrap_or(fused_merge_default(fp4) && !rows)
        && fits(&main)
        && ring_kernel.as_ref().is_none_or(fits);
    let pdl = op.opts.pdl.unwrap_or(true) && loaded.image.has_sm90_features();
    let scratch = if total > 1 {
        Some(kv_scratch(
            &stream,
            n_out * total,
            2 * sh.batch * op.q_heads * total,
            sh.batch * sh.kv_heads * chunks,
        )?)
    } else {
        None
    };
    let qs = q.as_cuda_slice::<bf16>()?.slice(qa..qb);
    let lsl = lens.as_cuda_slice::<u32>()?.slice(la..lb);
    let (qp, _g0) = qs.device_ptr(&stream);
    let (lp, _g1) = lsl.device_ptr(&stream);
    let (outp, _g2) = out.device_ptr_mut(&stream);
    let params = KvAttnParams {
        q: qp,
        k: 0,
        v: 0,
        lens: lp,
        out: outp,
        part_o: scratch.map_or(0, |s| s.part_o),
        part_ml: scratch.map_or(0, |s| s.part_ml),
        scale_log2: std::f32::consts::LOG2_E / (d as f32).sqrt(),
        q_heads: op.q_heads as i32,
        kv_heads: sh.kv_heads as i32,
        group: group as i32,
        capacity: sh.capacity as i32,
        splits: splits as i32,
        head_dim: d as i32,
        win: w as i32,
        counters: match scratch {
            Some(s) if fused => s.counters,
            _ => 0,
        },
        split_base: ring_splits as i32,
        part_splits: total as i32,
        late_wait: 0,
        pad: 0,
    };
    let grid = |s: usize, y: usize| (s as u32, y as u32, sh.batch as u32);
    // The exact window's ring: before the UltraQuant launch, or after it (late_wait: under
    // PDL it then overlaps it, see attn_body in kernels/ultraquant.cu).
    let ring_first = match (op.opts.ring_first, &ring_kernel) {
        (Some(f), _) => f,
        (None, None) => true, // no ring
        (None, Some(rk)) => {
            let base = sh.batch * sh.kv_heads * chunks;
            let ring_per_sm = rk
                .f
                .occupancy_max_active_blocks_per_multiprocessor((rk.nw * 32) as u32, rk.smem, None)
                .map_err(|e| cuda_err("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))?
                as usize;
            ring_first_default(
                splits * sh.batch * main_y,
                ring_splits * base,
                ring_per_sm,
                loaded.sms,
                max_len.div_ceil(splits),
            )
        }
    };
    let launch_ring = |late: bool| -> Result<()> {
        if let (Some((ring, a, half)), Some(rk)) = (&ring_args, &ring_kernel) {
            let p = KvAttnParams {
                capacity: w as i32,
                splits: ring_splits as i32,
                split_base: 0,
                late_wait: i32::from(late),
                ..params
            };
            let l = rk.launch(grid(ring_splits, sh.kv_heads * chunks), pdl);
            unsafe { launch_bf16_kv(&stream, "exact window ring", ring, *a, *half, &rk.f, l, p)? };
        }
        Ok(())
    };
    if ring_first {
        launch_ring(false)?;
    }
    if fp4 {
        let (a, b) = check_slots(OP, &sh, lkv)?;
        let ks = kv.as_cuda_slice::<u8>()?.slice(a..b);
        let (kp, _gk) = ks.device_ptr(&stream);
        if !kp.is_multiple_of(16) {
            bail!("{OP}: the cache must be 16-byte aligned in device memory")
        }
        let p = KvAttnParams { k: kp, ..params };
        unsafe { launch(&stream, &main.f, main.launch(grid(splits, main_y), pdl), &p)? };
    } else {
        let (a, b) = range(OP, "cache", lkv)?;
        let half = sh.elems(OP, d)?;
        if b - a != 2 * half || !a.is_multiple_of(8) {
            bail!(
                "{OP}: the BF16 cache must be [2, {}, {}, {}, {d}] starting 16-byte aligned",
                sh.batch,
                sh.capacity,
                sh.kv_heads
            )
        }
        let s = kv.as_cuda_slice::<bf16>()?;
        let l = main.launch(grid(splits, main_y), pdl);
        unsafe { launch_bf16_kv(&stream, "BF16 cache", s, a, half, &main.f, l, params)? };
    }
    if !ring_first {
        launch_ring(true)?;
    }
    if let (Some(sc), false) = (scratch, fused) {
        let fc = loaded.function("cfp4_kv_combine")?.0;
        let cp = KvCombineParams {
            part_o: sc.part_o,
            part_ml: sc.part_ml,
            out: outp,
            q_heads: op.q_heads as i32,
            splits: total as i32,
            head_dim: d as i32,
            pad: 0,
        };
        let l = Launch {
            grid: (op.q_heads as u32, sh.batch as u32, 1),
            block: 128,
            cluster: 1,
            pdl,
            smem: 0,
        };
        unsafe { launch(&stream, &fc, l, &cp)? };
    }
    drop((_g0, _g1, _g2));
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from((sh.batch, op.q_heads, d)),
    ))
}
