//! CUDA forward of the KV caches' format ops (`kernels/ultraquant.cu`): UltraQuant store and
//! read-back, the decode append and the lengths update (the attention is in
//! `attention_cuda.rs`). Every kernel comes from the cache's [`AttnPlan`] (made once); a
//! call does arithmetic, checks its storages and launches.

use super::ops::{range, KvAppend, UqRead, UqStore};
use super::plan::{launch_grid, AttnPlan};
use super::shape::{CacheShape, KvCacheKind, SLOT_PADDING};
use crate::cuda::{launch, Launch};
use crate::kernel_params::{KvAppendParams, KvLensParams, UqReadParams, UqStoreParams};
use crate::ultraquant::{slot_size, DEFAULT_CONSTANT_C};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::{bail, CudaStorage, Layout, Result, Shape, Storage};
use half::bf16;

unsafe impl DeviceRepr for UqStoreParams {}
unsafe impl DeviceRepr for UqReadParams {}
unsafe impl DeviceRepr for KvLensParams {}
unsafe impl DeviceRepr for KvAppendParams {}
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
pub(super) fn check_slots(op: &str, shape: &CacheShape, l: &Layout) -> Result<(usize, usize)> {
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
    unsafe { launch_lens_update(&stream, plan, &p) }
}

/// Launches `cfp4_kv_lens_update` over `p.n_seq` lengths (one thread each; with PDL it
/// waits on the device for the kernel before it).
///
/// # Safety
/// As [`launch`]: `p.lens` must be valid for `p.seq_base + p.n_seq` lengths until the
/// launch is queued.
pub(super) unsafe fn launch_lens_update(
    stream: &CudaStream,
    plan: &AttnPlan,
    p: &KvLensParams,
) -> Result<()> {
    let l = Launch {
        grid: ((p.n_seq.max(0) as usize).div_ceil(32) as u32, 1, 1),
        block: 32,
        cluster: 1,
        pdl: plan.sm90,
        smem: 0,
    };
    launch(stream, &plan.lens_update, l, p)
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
