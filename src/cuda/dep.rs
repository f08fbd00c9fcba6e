//! The CUDA side of [`crate::graph_chain`]: [`ArrivalChain`] arms the pure rule on one
//! stream of this thread while a graph is recorded, and [`before_launch`] /
//! [`after_launch`] fill a kernel's `cfp4::Dep` (kernels/pdl.cuh) from it. Outside an armed
//! recording (eager steps, other streams, other threads) they cost one thread-local
//! lookup and leave the block null. [`launch_dep`] launches a kernel with its block.

use super::launch::{cuda_err, launch_args, Launch};
use crate::graph_chain::{ChainPlan, Planned};
pub(crate) use crate::kernel_params::Dep;
use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
};
use candle_core::{CudaDevice, Result};
use std::cell::RefCell;

unsafe impl DeviceRepr for Dep {}

/// The armed recording of this thread.
struct Armed {
    stream: usize,
    base: u64,
    plan: ChainPlan,
}

thread_local! {
    static ARMED: RefCell<Option<Armed>> = const { RefCell::new(None) };
}

/// The device counters of one recorded graph: keep them as long as the graph.
pub struct ArrivalCounters {
    _buf: CudaSlice<u32>,
    used: usize,
    waits: usize,
}

impl ArrivalCounters {
    /// Counters the recording handed out (kernels that arrive).
    pub fn used(&self) -> usize {
        self.used
    }

    /// Kernels of the recording that wait on a counter instead of their predecessor's
    /// completion.
    pub fn waits(&self) -> usize {
        self.waits
    }
}

impl std::fmt::Debug for ArrivalCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArrivalCounters")
            .field("used", &self.used)
            .field("waits", &self.waits)
            .finish()
    }
}

/// Arrival counters armed on a device's stream for this thread while a graph is recorded:
/// [`begin`](Self::begin) before `begin_capture`, [`end`](Self::end) after `end_capture`.
/// The crate's kernels recorded in between wait on their predecessor's counter where the
/// predecessor is one of them ([`crate::graph_chain`]).
pub struct ArrivalChain {
    buf: CudaSlice<u32>,
    guard: ArmGuard,
}

/// Disarms the chain of its stream when dropped (an error during the recording included).
struct ArmGuard(usize);

impl Drop for ArmGuard {
    fn drop(&mut self) {
        disarm(self.0);
    }
}

impl ArrivalChain {
    /// Arms `capacity` zeroed counters on `dev`'s stream for this thread. Errors if this
    /// thread already has a chain armed.
    pub fn begin(dev: &CudaDevice, capacity: usize) -> Result<Self> {
        let stream = dev.cuda_stream();
        let buf = stream
            .alloc_zeros::<u32>(capacity.max(1))
            .map_err(|e| cuda_err("allocating the arrival counters", e))?;
        let base = buf.device_ptr(&stream).0;
        let key = stream.cu_stream() as usize;
        ARMED.with(|a| {
            let mut a = a.borrow_mut();
            if a.is_some() {
                candle_core::bail!("an arrival chain is already armed on this thread");
            }
            *a = Some(Armed {
                stream: key,
                base,
                plan: ChainPlan::new(capacity),
            });
            Ok(())
        })?;
        Ok(Self {
            buf,
            guard: ArmGuard(key),
        })
    }

    /// Disarms the chain; the counters go with the recorded graph.
    pub fn end(self) -> ArrivalCounters {
        let ArrivalChain { buf, guard } = self;
        let (used, waits) = disarm(guard.0);
        ArrivalCounters {
            _buf: buf,
            used,
            waits,
        }
    }
}

/// Disarms this thread's chain on `stream`: the counters it handed out and the waits it
/// planned.
fn disarm(stream: usize) -> (usize, usize) {
    ARMED.with(|a| {
        let mut a = a.borrow_mut();
        match a.as_ref() {
            Some(x) if x.stream == stream => {
                a.take().map_or((0, 0), |x| (x.plan.used(), x.plan.waits()))
            }
            _ => (0, 0),
        }
    })
}

/// The capture's dependency set on `stream`: `None` when the stream is not recording,
/// else the one node it has (`Some(None)` for none or several).
fn only_dependency(stream: &CudaStream) -> Result<Option<Option<usize>>> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut deps: *const sys::CUgraphNode = std::ptr::null();
    let mut n: usize = 0;
    // SAFETY: out-pointers to locals; the id, graph and edge data outputs are optional.
    unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream.cu_stream(),
            &mut status,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut deps,
            std::ptr::null_mut(),
            &mut n,
        )
        .result()
        .map_err(|e| cuda_err("cuStreamGetCaptureInfo", e))?;
    }
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE {
        return Ok(None);
    }
    // SAFETY: the driver returned `n` nodes at `deps`, valid until the next capture call.
    let only = (n == 1 && !deps.is_null()).then(|| unsafe { *deps } as usize);
    Ok(Some(only))
}

/// The `Dep` block of a launch about to be enqueued on `stream`, and its plan (`None`
/// outside an armed recording).
fn before_launch(stream: &CudaStream) -> Result<(Dep, Option<Planned>)> {
    let key = stream.cu_stream() as usize;
    ARMED.with(|a| {
        let mut a = a.borrow_mut();
        let Some(armed) = a.as_mut().filter(|x| x.stream == key) else {
            return Ok((Dep::default(), None));
        };
        let Some(only) = only_dependency(stream)? else {
            return Ok((Dep::default(), None));
        };
        let p = armed.plan.plan(only);
        let at = |slot: usize| armed.base + 4 * slot as u64;
        let dep = Dep {
            wait: p.wait.map_or(0, |(s, _)| at(s)),
            arrive: p.arrive.map_or(0, at),
            wait_ctas: p.wait.map_or(0, |(_, c)| c),
            _pad: 0,
        };
        Ok((dep, Some(p)))
    })
}

/// Records the launch planned as `p` (of `ctas` CTAs) as the chain's last.
fn after_launch(stream: &CudaStream, p: Option<Planned>, ctas: u32) -> Result<()> {
    let Some(p) = p else { return Ok(()) };
    let node = only_dependency(stream)?.flatten();
    let key = stream.cu_stream() as usize;
    ARMED.with(|a| {
        if let Some(armed) = a.borrow_mut().as_mut().filter(|x| x.stream == key) {
            armed.plan.launched(p, node, ctas);
        }
    });
    Ok(())
}

/// [`launch`](super::launch) for a kernel taking a second `__grid_constant__` block, `cfp4::Dep`
/// (kernels/pdl.cuh): inside an armed recording ([`ArrivalChain`]) the wait on the
/// previous kernel and this kernel's arrival are planned here, once, while recording;
/// elsewhere the block is null (griddepcontrol.wait, no arrival).
///
/// # Safety
/// As [`launch`](super::launch); the kernel's second parameter must be `cfp4::Dep`.
pub(crate) unsafe fn launch_dep<P: DeviceRepr + Copy>(
    stream: &CudaStream,
    f: &CudaFunction,
    l: Launch,
    params: &P,
) -> Result<()> {
    let ctas = l.grid.0.saturating_mul(l.grid.1).saturating_mul(l.grid.2);
    let (mut dep, slot) = before_launch(stream)?;
    let mut p = *params;
    let mut args = [
        &mut p as *mut P as *mut std::ffi::c_void,
        &mut dep as *mut Dep as *mut std::ffi::c_void,
    ];
    launch_args(stream, f, l, &mut args)?;
    after_launch(stream, slot, ctas)
}

/// [`launch_dep`]'s kernels launched outside the chain: a null `Dep` block (the kernel
/// waits for its predecessor's completion and arrives nowhere), for launches whose wait is
/// not at their start (the exact window's late-waiting ring) or that the chain leaves out.
///
/// # Safety
/// As [`launch`](super::launch); the kernel's second parameter must be `cfp4::Dep`.
pub(crate) unsafe fn launch_null_dep<P: DeviceRepr + Copy>(
    stream: &CudaStream,
    f: &CudaFunction,
    l: Launch,
    params: &P,
) -> Result<()> {
    let mut dep = Dep::default();
    let mut p = *params;
    let mut args = [
        &mut p as *mut P as *mut std::ffi::c_void,
        &mut dep as *mut Dep as *mut std::ffi::c_void,
    ];
    launch_args(stream, f, l, &mut args)
}
