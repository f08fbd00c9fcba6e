//! CUDA forward of the KV caches' ops (`kernels/ultraquant.cu`): UltraQuant store and
//! read-back, the lengths update, split-KV decode attention (UltraQuant or BF16 cache) and
//! the combine of its splits. Every kernel comes from the cache's [`AttnPlan`] (made once);
//! a call does arithmetic, checks its storages and launches.

use super::ops::{range, ExactWindow, KvAppend, KvAttention, UqRead, UqStore};
use super::plan::{launch_grid, AttnKernel, AttnPlan};
use super::shape::{ring_first_default, CacheShape, KvCacheKind, SLOT_PADDING};
use crate::cuda::{launch, Launch};
use crate::kernel_params::{
    KvAppendParams, KvAttnParams, KvCombineParams, KvLensParams, UqReadParams, UqStoreParams,
};
use crate::ultraquant::{slot_size, DEFAULT_CONSTANT_C};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
};
use candle_core::{bail, CudaStorage, Layout, Result, Shape, Storage};
use half::bf16;
use std::sync::Arc;

unsafe impl DeviceRepr for UqStoreParams {}
unsafe impl DeviceRepr for UqReadParams {}
unsafe impl DeviceRepr for KvAttnParams {}
unsafe impl DeviceRepr for KvCombineParams {}
unsafe impl DeviceRepr for KvLensParams {}
unsafe impl DeviceRepr for KvAppendParams {}

/// Largest split count `cfp4_kv_combine` takes (`CFP4_KV_MAX_SPLITS` in the .cu).
const MAX_SPLITS: usize = 1024;
/// Whether the splits are merged in the attention kernel when [`DecodeOptions`] leaves it
/// open. Measured on the H200 (docs/benchmarks.md): the same GPU time either way for
/// UltraQuant (16-warp CTAs, one (head, d) per thread in the merge) and one kernel launch and
/// two allocations less per call; the BF16 kernel's 4-warp CTAs merge 4 values per thread
/// over twice the splits and are 1–2 µs slower fused, so it keeps the combine kernel.
///
/// [`DecodeOptions`]: super::DecodeOptions
fn fused_merge_default(fp4: bool) -> bool {
    fp4
}

/// Threads of the store / read kernels (one warp per (token, head)).
const FORMAT_THREADS: u32 = 256;

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

/// `lens[seq_base .. seq_base + n_seq] = (add ? lens : 0) + value`, in place on the device.
pub(crate) fn lens_update_cuda(
    plan: &AttnPlan,
    lens: &mut CudaStorage,
    ll: &Layout,
    seq_base: usize,
    n_seq: usize,
    value: usize,
    add: bool,
) -> Result<()> {
    const OP: &str = "KV cache lengths (cuda)";
    let (a, b) = range(OP, "lens", ll)?;
    if seq_base + n_seq > b - a || value > i32::MAX as usize {
        bail!(
            "{OP}: sequences {seq_base}..{} or length {value} outside the cache",
            seq_base + n_seq
        )
    }
    let stream = lens.device().cuda_stream();
    let mut s = lens.as_cuda_slice_mut::<u32>()?.slice_mut(a..b);
    let (lp, _g) = s.device_ptr_mut(&stream);
    let p = KvLensParams {
        lens: lp,
        seq_base: seq_base as i32,
        n_seq: n_seq as i32,
        value: value as i32,
        add: i32::from(add),
    };
    let l = Launch {
        grid: (n_seq.div_ceil(32) as u32, 1, 1),
        block: 32,
        cluster: 1,
        pdl: plan.sm90,
        smem: 0,
    };
    unsafe { launch(&stream, &plan.lens_update, l, &p) }
}

/// The decode append ([`KvAppend`]): one launch, rows from the device lengths.
#[allow(clippy::too_many_arguments)]
pub(crate) fn kv_append_cuda(
    plan: &AttnPlan,
    op: &KvAppend,
    dst: &mut CudaStorage,
    ld: &Layout,
    k: &CudaStorage,
    lk: &Layout,
    v: &CudaStorage,
    lv: &Layout,
) -> Result<()> {
    const OP: &str = "KV decode append (cuda)";
    let (batch, rows, re) = (op.batch, op.rows, op.row_elems);
    let (da, db) = range(OP, "destination", ld)?;
    let (ka, kb) = range(OP, "k", lk)?;
    let (va, vb) = range(OP, "v", lv)?;
    let half = batch * rows * re;
    if db - da != 2 * half || kb - ka != batch * re || vb - va != batch * re {
        bail!(
            "{OP}: destination {} / k {} / v {} values, expected {} / {} / {}",
            db - da,
            kb - ka,
            vb - va,
            2 * half,
            batch * re,
            batch * re
        )
    }
    if !re.is_multiple_of(8) || rows == 0 || batch > 65535 || op.limit > i32::MAX as usize {
        bail!(
            "{OP}: row of {re} values (a multiple of 8), {rows} rows, batch {batch}, limit {}",
            op.limit
        )
    }
    let (st, ll) = op.lens_dev.storage_and_layout();
    let Storage::Cuda(lens) = &*st else {
        bail!("{OP}: the lengths are not on the GPU")
    };
    let (la, lb) = range(OP, "lens", ll)?;
    if lb - la != batch {
        bail!("{OP}: {} lengths for batch {batch}", lb - la)
    }
    let stream = dst.device().cuda_stream();
    let lsl = lens.as_cuda_slice::<u32>()?.slice(la..lb);
    let ks = k.as_cuda_slice::<bf16>()?.slice(ka..kb);
    let vs = v.as_cuda_slice::<bf16>()?.slice(va..vb);
    let mut ds = dst.as_cuda_slice_mut::<bf16>()?.slice_mut(da..db);
    let (lp, _g0) = lsl.device_ptr(&stream);
    let (kp, _g1) = ks.device_ptr(&stream);
    let (vp, _g2) = vs.device_ptr(&stream);
    let (dp, _g3) = ds.device_ptr_mut(&stream);
    if !(kp | vp | dp).is_multiple_of(16) {
        bail!("{OP}: k, v and the destination must be 16-byte aligned in device memory")
    }
    let p = KvAppendParams {
        k: kp,
        v: vp,
        dst: dp,
        lens: lp,
        batch: batch as i32,
        rows: rows as i32,
        row_elems: re as i32,
        limit: op.limit as i32,
    };
    let l = Launch {
        grid: ((re / 8).div_ceil(256) as u32, batch as u32, 2),
        block: 256,
        cluster: 1,
        pdl: plan.sm90,
        smem: 0,
    };
    unsafe { launch(&stream, &plan.append, l, &p) }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn uq_store_cuda(
    plan: &AttnPlan,
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
    plan.check(OP, KvCacheKind::UltraQuant, &sh)?;
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
    let f = &plan.store;
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
    unsafe { launch_grid(&stream, f, (grid, 1, 1), FORMAT_THREADS, 0, &params) }
}

pub(crate) fn uq_read_cuda(
    plan: &AttnPlan,
    op: &UqRead,
    cache: &CudaStorage,
    lc: &Layout,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "ultraquant read (cuda)";
    let sh = op.shape;
    plan.check(OP, KvCacheKind::UltraQuant, &sh)?;
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
    let f = &plan.read;
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
        unsafe { launch_grid(&stream, f, (grid, 1, 1), FORMAT_THREADS, 0, &params)? };
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev), op.out_shape()))
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

#[allow(clippy::too_many_arguments)]
pub(crate) fn kv_attention_cuda(
    plan: &AttnPlan,
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
    plan.check(OP, op.kind, &sh)?;
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
    // Exact window: the UltraQuant kernel over the older tokens, then the BF16 kernel over
    // the ring, both writing partials of one merge.
    let Some(main) = &plan.main[nt - 1] else {
        bail!("{OP}: no head_dim {d} kernel for {group} query heads per KV head")
    };
    let win: Option<&ExactWindow> = match (&op.window, fp4) {
        (Some(w), true) => Some(w),
        _ => None,
    };
    let ring_kernel = match win {
        Some(_) => match &plan.ring[nt - 1] {
            Some(k) => Some(k),
            None => bail!("{OP}: the cache was planned without an exact window"),
        },
        None => None,
    };
    let main_y = sh.kv_heads * chunks;
    let w = win.map_or(0, |w| w.size);
    let max_len = op.max_len.saturating_sub(w);
    let splits = match op.opts.splits {
        Some(s) => s.clamp(1, MAX_SPLITS),
        None => {
            // UltraQuant: one CTA per SM. Measured on the H200 (docs/benchmarks.md, split
            // sweep): its warps then run twice as many iterations, which amortizes the
            // per-CTA query rotation and warp merge, and beat two CTAs per SM at batch 1
            // (32k: 25.8 vs 28.9 us). BF16: a full wave of resident CTAs.
            let resident = if fp4 {
                plan.sms
            } else {
                main.per_sm * plan.sms
            };
            auto_splits(max_len, sh.batch * main_y, resident, main.nw)
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
    let nh = 4 * nt;
    let fits = |k: &AttnKernel| (nh * total + nh) * 4 <= k.smem;
    let fused = total > 1
        && op.opts.fused_merge.unwrap_or(fused_merge_default(fp4))
        && fits(main)
        && ring_kernel.is_none_or(fits);
    let pdl = op.opts.pdl.unwrap_or(true) && plan.sm90;
    let scratch = if total > 1 {
        Some(plan.scratch(
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
            ring_first_default(
                splits * sh.batch * main_y,
                ring_splits * base,
                rk.per_sm,
                plan.sms,
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
        let fc = &plan.combine;
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
        unsafe { launch(&stream, fc, l, &cp)? };
    }
    drop((_g0, _g1, _g2));
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from((sh.batch, op.q_heads, d)),
    ))
}
