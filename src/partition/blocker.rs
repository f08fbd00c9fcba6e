//! The blocker grid and the planner's SM override (feature `cuda`).

use super::report::BlockerReport;
use crate::cuda::{attribute, cuda_err, override_facts};
use candle_core::cuda_backend::cudarc::driver::{result, sys};
use candle_core::{bail, Device, Result};
use std::time::{Duration, Instant};

/// Plans made on `dev` after this call see `sms` SMs and, where `mem_bw` is given, that
/// peak DRAM bandwidth in bytes per second (layers planned before keep their plans). Call
/// it before loading the model, and hold the other SMs with [`SmBlocker::hold`].
/// `plan_for(dev, device_sms(dev)?, None)` restores the device's own facts.
pub fn plan_for(dev: &Device, sms: usize, mem_bw: Option<u64>) -> Result<()> {
    let Device::Cuda(d) = dev else {
        bail!("partition::plan_for needs a CUDA device")
    };
    override_facts(d, sms, mem_bw)
}

/// The SMs of `dev` (the driver's count, whatever [`plan_for`] was told).
pub fn device_sms(dev: &Device) -> Result<usize> {
    let Device::Cuda(d) = dev else {
        bail!("partition::device_sms needs a CUDA device")
    };
    let sms = attribute(
        d,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )?;
    Ok(sms.max(0) as usize)
}

/// `words` zeroed u32 of pinned host memory mapped into the device: the host pointer and
/// the device's. Freed with `cuMemFreeHost` (the caller owns it, also on error: the host
/// pointer is returned through `host` as soon as it exists).
///
/// # Safety
/// The current context must be the device's.
unsafe fn host_mapped(words: usize, host: &mut *mut u32) -> Result<sys::CUdeviceptr> {
    let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
    sys::cuMemHostAlloc(&mut p, words * 4, sys::CU_MEMHOSTALLOC_DEVICEMAP)
        .result()
        .map_err(|e| cuda_err("SmBlocker: cuMemHostAlloc", e))?;
    *host = p.cast();
    std::ptr::write_bytes(*host, 0, words);
    let mut dptr: sys::CUdeviceptr = 0;
    sys::cuMemHostGetDevicePointer_v2(&mut dptr, p, 0)
        .result()
        .map_err(|e| cuda_err("SmBlocker: cuMemHostGetDevicePointer", e))?;
    Ok(dptr)
}

/// Launches `f` on `stream` as `ctas` one-warp CTAs with `smem` bytes of dynamic shared
/// memory.
///
/// # Safety
/// `args` must match `f`'s parameters and outlive the call; `f` and `stream` must be live.
unsafe fn launch_warps(
    f: sys::CUfunction,
    ctas: usize,
    smem: u32,
    stream: sys::CUstream,
    args: &mut [*mut std::ffi::c_void],
) -> Result<()> {
    let Ok(grid) = u32::try_from(ctas) else {
        bail!("SmBlocker: {ctas} CTAs are too many for one launch")
    };
    sys::cuLaunchKernel(
        f,
        grid,
        1,
        1,
        32,
        1,
        1,
        smem,
        stream,
        args.as_mut_ptr(),
        std::ptr::null_mut(),
    )
    .result()
    .map_err(|e| cuda_err("SmBlocker: launch", e))
}

/// The function `name` of the blocker's module.
///
/// # Safety
/// `module` must be live.
unsafe fn function(module: sys::CUmodule, name: &str) -> Result<sys::CUfunction> {
    let c = std::ffi::CString::new(name).map_err(|e| cuda_err("SmBlocker", e))?;
    result::module::get_function(module, c).map_err(|e| cuda_err(&format!("SmBlocker: {name}"), e))
}

/// The blocker (`cfp4_sm_blocker`): thread 0 of each CTA writes `smid + 1` to its slot
/// (`ctl[4 + cta]`, u32, in host-mapped memory), then polls the word `flag` in device
/// memory every ~20 µs until it is non-zero (slot |= 1 << 30) or `max_ns` of `%globaltimer`
/// pass (slot |= 1 << 31). The flag is device memory, set by a host-to-device copy: with
/// 36 CTAs polling a host-mapped word instead, the decode step beside them ran 4–13×
/// slower on an H100 (thirty-sixth session, call 2; the suspected cause: those PCIe reads
/// delay the GPU's own fetches from host memory). Not yet measured with the device word.
/// The probe (`cfp4_sm_probe`): thread 0 of each CTA writes `smid + 1` to `out[cta]`.
/// Hand-written PTX (sm_70: `nanosleep`), JIT-compiled by the driver for any card.
const BLOCKER_PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry cfp4_sm_blocker(.param .u64 ctl, .param .u64 flag, .param .u64 max_ns)
{
    .reg .pred %p<4>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<10>;
    mov.u32 %r1, %tid.x;
    setp.ne.u32 %p1, %r1, 0;
    @%p1 bra DONE;
    ld.param.u64 %rd8, [flag];
    ld.param.u64 %rd1, [ctl];
    ld.param.u64 %rd2, [max_ns];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %smid;
    add.u32 %r4, %r3, 1;
    mul.wide.u32 %rd3, %r2, 4;
    add.u64 %rd4, %rd1, %rd3;
    add.u64 %rd4, %rd4, 16;
    st.volatile.global.u32 [%rd4], %r4;
    membar.sys;
    mov.u64 %rd5, %globaltimer;
SPIN:
    nanosleep.u32 20000;
    ld.volatile.global.u32 %r5, [%rd8];
    setp.ne.u32 %p2, %r5, 0;
    @%p2 bra RELEASED;
    mov.u64 %rd6, %globaltimer;
    sub.u64 %rd7, %rd6, %rd5;
    setp.lt.u64 %p3, %rd7, %rd2;
    @%p3 bra SPIN;
    or.b32 %r6, %r4, -2147483648;
    st.volatile.global.u32 [%rd4], %r6;
    membar.sys;
    bra DONE;
RELEASED:
    or.b32 %r6, %r4, 1073741824;
    st.volatile.global.u32 [%rd4], %r6;
    membar.sys;
DONE:
    ret;
}

.visible .entry cfp4_sm_probe(.param .u64 out)
{
    .reg .pred %p<2>;
    .reg .b32 %r<4>;
    .reg .b64 %rd<4>;
    mov.u32 %r1, %tid.x;
    setp.ne.u32 %p1, %r1, 0;
    @%p1 bra PDONE;
    ld.param.u64 %rd1, [out];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %smid;
    add.u32 %r3, %r3, 1;
    mul.wide.u32 %rd2, %r2, 4;
    add.u64 %rd3, %rd1, %rd2;
    st.volatile.global.u32 [%rd3], %r3;
    membar.sys;
PDONE:
    ret;
}
"#;

/// One CTA with all of an SM's shared memory on each of `ctas` SMs, resident until dropped
/// (or until its time limit). Hold it only around work whose kernels are all loaded (a
/// timed loop after its warm-up): with CUDA's lazy module loading (the default), a kernel
/// loaded for the first time while the blocker spins waits for the context to go idle,
/// i.e. for the blocker's time limit. Its stream, module and control words are its own (raw driver
/// objects, so cudarc's cross-stream event tracking never sees them).
pub struct SmBlocker {
    ctas: usize,
    ctl: *mut u32,
    /// The release word the blocker polls (device memory).
    flag: sys::CUdeviceptr,
    stream: sys::CUstream,
    module: sys::CUmodule,
    /// The probe's function, stream and output (host-mapped, 8 words per SM), all made
    /// before the blocker starts: under lazy module loading a function first fetched while
    /// the blocker spins waits for the context to go idle, which it never does.
    probe_fn: sys::CUfunction,
    probe_stream: sys::CUstream,
    probe_out: *mut u32,
    probe_dptr: sys::CUdeviceptr,
}

impl SmBlocker {
    /// Launches the blocker on `ctas` SMs of `dev`, waits (up to 2 s) until every CTA has
    /// started, and checks its hold: the CTAs on distinct SMs, and no CTA of a probe grid
    /// beside them on those SMs (errors otherwise). `limit`: how long its CTAs stay if
    /// never released.
    pub fn hold(dev: &Device, ctas: usize, limit: Duration) -> Result<Self> {
        let Device::Cuda(d) = dev else {
            bail!("SmBlocker needs a CUDA device")
        };
        let ctx = d.cuda_stream().context().clone();
        ctx.bind_to_thread()
            .map_err(|e| cuda_err("SmBlocker: binding the context", e))?;
        let total = device_sms(dev)?;
        if ctas == 0 || ctas >= total {
            bail!("SmBlocker: cannot hold {ctas} of the device's {total} SMs")
        }
        let smem = attribute(
            d,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )?;
        let words = 4 + ctas;
        let mut b = SmBlocker {
            ctas,
            ctl: std::ptr::null_mut(),
            flag: 0,
            stream: std::ptr::null_mut(),
            module: std::ptr::null_mut(),
            probe_fn: std::ptr::null_mut(),
            probe_stream: std::ptr::null_mut(),
            probe_out: std::ptr::null_mut(),
            probe_dptr: 0,
        };
        let probe_ctas = total.saturating_mul(8);
        // SAFETY: plain driver calls on the context bound above; every object they create
        // is owned by `b` and released in its `Drop` (also on the error paths below).
        unsafe {
            let ctl_dptr = host_mapped(words, &mut b.ctl)?;
            b.stream = result::stream::create(result::stream::StreamKind::NonBlocking)
                .map_err(|e| cuda_err("SmBlocker: stream", e))?;
            let src = std::ffi::CString::new(BLOCKER_PTX).map_err(|e| cuda_err("SmBlocker", e))?;
            b.module = result::module::load_data(src.as_ptr().cast())
                .map_err(|e| cuda_err("SmBlocker: loading its PTX", e))?;
            let f = function(b.module, "cfp4_sm_blocker")?;
            result::function::set_function_attribute(
                f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem,
            )
            .map_err(|e| cuda_err("SmBlocker: shared memory attribute", e))?;
            b.probe_fn = function(b.module, "cfp4_sm_probe")?;
            b.probe_stream = result::stream::create(result::stream::StreamKind::NonBlocking)
                .map_err(|e| cuda_err("SmBlocker: probe stream", e))?;
            b.probe_dptr = host_mapped(probe_ctas, &mut b.probe_out)?;
            // Once before the blocker, so the probe kernel is loaded whatever the loading
            // mode (its result is not looked at).
            b.launch_probe(probe_ctas)?;
            let mut flag: sys::CUdeviceptr = 0;
            sys::cuMemAlloc_v2(&mut flag, 4)
                .result()
                .map_err(|e| cuda_err("SmBlocker: cuMemAlloc (flag)", e))?;
            b.flag = flag;
            sys::cuMemsetD32_v2(flag, 0, 1)
                .result()
                .map_err(|e| cuda_err("SmBlocker: clearing the flag", e))?;
            let mut ctl_arg = ctl_dptr;
            let mut ns_arg = u64::try_from(limit.as_nanos()).unwrap_or(u64::MAX);
            let mut args = [
                (&mut ctl_arg as *mut u64).cast::<std::ffi::c_void>(),
                (&mut flag as *mut u64).cast::<std::ffi::c_void>(),
                (&mut ns_arg as *mut u64).cast::<std::ffi::c_void>(),
            ];
            launch_warps(f, ctas, smem.max(0) as u32, b.stream, &mut args)?;
        }
        let t0 = Instant::now();
        while b.report().sms.len() < ctas {
            if t0.elapsed() > Duration::from_secs(2) {
                let r = b.report();
                bail!(
                    "SmBlocker: {} of {ctas} CTAs started within 2 s (is the GPU busy?)",
                    r.sms.len()
                )
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let r = b.report();
        if !r.holds(ctas) {
            bail!("SmBlocker: its {ctas} CTAs do not hold {ctas} distinct SMs: {r:?}")
        }
        b.probe(probe_ctas)?;
        Ok(b)
    }

    /// Runs `ctas` CTAs (8 per SM of the device; no shared memory, one warp each) beside
    /// the blocker and fails if any of them ran on a held SM: then the blocker does not keep
    /// the smallest CTAs off its SMs and the partition would measure nothing.
    fn probe(&self, ctas: usize) -> Result<()> {
        let held: std::collections::HashSet<u32> = self.report().sms.into_iter().collect();
        let seen = self.launch_probe(ctas)?;
        let on_held = seen
            .iter()
            .filter(|&&v| v != 0 && held.contains(&(v - 1)))
            .count();
        let missing = seen.iter().filter(|&&v| v == 0).count();
        if on_held > 0 || missing > 0 {
            bail!(
                "SmBlocker: {on_held} of {ctas} probe CTAs ran on held SMs, {missing} did not run"
            )
        }
        Ok(())
    }

    /// Launches the probe's `ctas` CTAs, waits for them and returns each one's `smid + 1`
    /// (0: did not run).
    fn launch_probe(&self, ctas: usize) -> Result<Vec<u32>> {
        // SAFETY: the probe's function, stream and `ctas` words of output were made in
        // `hold` and live until Drop; the output is read after the stream is synchronized.
        unsafe {
            std::ptr::write_bytes(self.probe_out, 0, ctas);
            let mut dptr = self.probe_dptr;
            let mut args = [(&mut dptr as *mut u64).cast::<std::ffi::c_void>()];
            launch_warps(self.probe_fn, ctas, 0, self.probe_stream, &mut args)?;
            result::stream::synchronize(self.probe_stream)
                .map_err(|e| cuda_err("SmBlocker: probe", e))?;
            Ok((0..ctas)
                .map(|i| std::ptr::read_volatile(self.probe_out.add(i)))
                .collect())
        }
    }

    /// The CTAs' slots as they read now.
    pub fn report(&self) -> BlockerReport {
        let slots: Vec<u32> = (0..self.ctas)
            // SAFETY: `ctl` holds 4 + ctas words for the blocker's life; the device writes
            // them, so they are read volatile.
            .map(|i| unsafe { std::ptr::read_volatile(self.ctl.add(4 + i)) })
            .collect();
        BlockerReport::from_slots(&slots)
    }

    /// Releases the SMs, waits for the blocker to leave and returns what its CTAs reported.
    pub fn release(mut self) -> Result<BlockerReport> {
        self.stop()?;
        Ok(self.report())
    }

    fn stop(&mut self) -> Result<()> {
        if self.stream.is_null() {
            return Ok(());
        }
        if self.flag == 0 {
            // SAFETY: the blocker was never launched (the flag comes first); the stream is ours.
            let _ = unsafe { result::stream::destroy(self.stream) };
            self.stream = std::ptr::null_mut();
            return Ok(());
        }
        // SAFETY: `ctl` (pinned) and `flag` are live (freed only in Drop, after this); the
        // streams are ours. The copy engine sets the flag: no kernel is loaded for it.
        unsafe {
            std::ptr::write_volatile(self.ctl, 1);
            let r = sys::cuMemcpyHtoDAsync_v2(self.flag, self.ctl.cast(), 4, self.probe_stream)
                .result()
                .and_then(|_| result::stream::synchronize(self.stream));
            let _ = result::stream::destroy(self.stream);
            self.stream = std::ptr::null_mut();
            r.map_err(|e| cuda_err("SmBlocker: waiting for the release", e))
        }
    }
}

impl Drop for SmBlocker {
    fn drop(&mut self) {
        let _ = self.stop();
        // SAFETY: the objects were created in `hold` and the blocker's kernel has left.
        unsafe {
            if !self.probe_stream.is_null() {
                let _ = result::stream::destroy(self.probe_stream);
            }
            if !self.probe_out.is_null() {
                let _ = sys::cuMemFreeHost(self.probe_out.cast());
            }
            if !self.module.is_null() {
                let _ = result::module::unload(self.module);
            }
            if self.flag != 0 {
                let _ = sys::cuMemFree_v2(self.flag);
            }
            if !self.ctl.is_null() {
                let _ = sys::cuMemFreeHost(self.ctl.cast());
            }
        }
    }
}
