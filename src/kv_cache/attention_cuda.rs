//! CUDA forward of split-KV decode attention (`kernels/kv_attention.cu`; UltraQuant or
//! BF16 cache, with the exact window's ring, and optionally the decode step's rope and KV
//! append inside: BF16 cache, or UltraQuant with an exact window) and the combine of its
//! splits. Every kernel comes from
//! the cache's [`AttnPlan`] (made once); a call does arithmetic, checks its storages and
//! launches.

use super::cuda::{check_slots, launch_lens_update};
use super::ops::{range, ExactWindow, KvAttention};
use super::plan::{AttnKernel, AttnPlan};
use super::shape::{auto_splits, fused_merge_default, ring_first_default, KvCacheKind};
use crate::cuda::{launch, Launch};
use crate::kernel_params::{KvAttnParams, KvCombineParams, KvLensParams};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
};
use candle_core::{bail, CudaStorage, Layout, Result, Shape, Storage};
use half::bf16;
use std::sync::Arc;

unsafe impl DeviceRepr for KvAttnParams {}
unsafe impl DeviceRepr for KvCombineParams {}

/// Largest split count `cfp4_kv_combine` takes (`CFP4_KV_MAX_SPLITS` in the .cu).
const MAX_SPLITS: usize = 1024;

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

/// The device pointer of the rope positions (U32 `[batch]`, contiguous; the op holds the
/// tensor, so its storage outlives the launch).
fn positions_ptr(op: &str, t: &candle_core::Tensor, batch: usize) -> Result<u64> {
    let (st, l) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*st else {
        bail!("{op}: the rope positions are not on the GPU")
    };
    let (a, b) = range(op, "positions", l)?;
    if b - a != batch {
        bail!("{op}: {} rope positions for batch {batch}", b - a)
    }
    let sl = cs.as_cuda_slice::<u32>()?.slice(a..b);
    let p = sl.device_ptr(&cs.device().cuda_stream()).0;
    Ok(p)
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
            auto_splits(max_len, sh.batch * main_y, resident, main.nw, fp4).min(MAX_SPLITS)
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
    // The rope and append inside the kernels: q is the raw q|k|v projection.
    let q_row = match &op.rope {
        Some(_) if fp4 && win.is_none() => {
            bail!("{OP}: the rope and append inside the UltraQuant attention need an exact window")
        }
        Some(_) => (op.q_heads + 2 * sh.kv_heads) * d,
        None => op.q_heads * d,
    };
    let (qa, qb) = range(OP, "q", lq)?;
    if qb - qa != sh.batch * q_row || q_row > i32::MAX as usize {
        bail!(
            "{OP}: q holds {} values, expected {}",
            qb - qa,
            sh.batch * q_row
        )
    }
    let positions = match &op.rope {
        Some(r) => Some(positions_ptr(OP, &r.positions, sh.batch)?),
        None => None,
    };
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
        && op
            .opts
            .fused_merge
            .unwrap_or(fused_merge_default(fp4, total))
        && fits(main)
        && ring_kernel.is_none_or(fits);
    let pdl = op.opts.pdl.unwrap_or(true) && plan.sm90;
    // A fused BF16 launch (the cache, or the ring launched first) reads the lengths and rows
    // before waiting for the previous kernel: without PDL when a host call wrote them since
    // the last fused step. The UltraQuant launch waits first; a late ring relies on it.
    let early_pdl = pdl && op.rope.as_ref().is_none_or(|r| r.pdl);
    let main_pdl = if fp4 { pdl } else { early_pdl };
    let scratch = if total > 1 {
        // The in-kernel merge's counters per head group, then (fused rope and append: the
        // merge advances the lengths) per sequence.
        let seq_counters = if op.rope.is_some() { sh.batch } else { 0 };
        Some(plan.scratch(
            &stream,
            n_out * total,
            2 * sh.batch * op.q_heads * total,
            sh.batch * sh.kv_heads * chunks + seq_counters,
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
        q_row: q_row as i32,
        positions: positions.unwrap_or(0),
        cos: op.rope.as_ref().map_or(0, |r| r.cos),
        sin: op.rope.as_ref().map_or(0, |r| r.sin),
        max_pos: op.rope.as_ref().map_or(1, |r| r.max_pos) as i32,
        store_c: crate::ultraquant::DEFAULT_CONSTANT_C,
    };
    let grid = |s: usize, y: usize| (s as u32, y as u32, sh.batch as u32);
    // The exact window's ring: before the UltraQuant launch, or after it (late_wait: under
    // PDL it then overlaps it, see attn_body in kernels/ultraquant.cu).
    let ring_first = match (op.opts.ring_first, &ring_kernel) {
        (Some(f), _) => f,
        (None, None) => true, // no ring
        // The rope and append inside: after. The ring's launch then waits for the previous
        // kernel and ropes and appends before its attention; first, all of that is on the
        // path to the UltraQuant launch (H100, 8B b1 512: 2.91–2.92 ms per step against
        // 2.75 after; docs/logs/s27/README.md).
        (None, Some(_)) if op.rope.is_some() => false,
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
            let l = rk.launch(
                grid(ring_splits, sh.kv_heads * chunks),
                if late { pdl } else { early_pdl },
            );
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
        unsafe {
            launch(
                &stream,
                &main.f,
                main.launch(grid(splits, main_y), main_pdl),
                &p,
            )?
        };
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
        let l = main.launch(grid(splits, main_y), main_pdl);
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
            lens: if op.rope.is_some() { lp } else { 0 },
        };
        let l = Launch {
            grid: (op.q_heads as u32, sh.batch as u32, 1),
            block: 128,
            cluster: 1,
            pdl,
            smem: 0,
        };
        unsafe { launch(&stream, fc, l, &cp)? };
    } else if op.rope.is_some() && scratch.is_none() {
        // One split, no merge: the lengths kernel advances them (it waits for the attention).
        let lp_ = KvLensParams {
            lens: lp,
            seq_base: 0,
            n_seq: sh.batch as i32,
            value: 1,
            add: 1,
        };
        unsafe { launch_lens_update(&stream, plan, &lp_)? };
    }
    drop((_g0, _g1, _g2));
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from((sh.batch, op.q_heads, d)),
    ))
}
