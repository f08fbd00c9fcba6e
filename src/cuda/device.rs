//! What the planners need to know about a device, queried once per CUDA context.

use super::images::Image;
use super::launch::{ctx_key, cuda_err};
use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::{bail, CudaDevice, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Facts of one device (one CUDA context), fixed for its life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeviceFacts {
    /// `(major, minor)` compute capability.
    pub cc: (i32, i32),
    /// Streaming multiprocessors.
    pub sms: usize,
    /// Largest dynamic shared memory a kernel may opt in to.
    pub smem_optin: usize,
    /// L2 cache bytes.
    pub l2_bytes: usize,
    /// Peak DRAM bandwidth in bytes per second (memory clock × bus width × 2, as the
    /// driver reports them), `None` where the driver does not report them.
    pub mem_bw: Option<u64>,
    /// The image the device loads by default.
    pub image: Image,
    /// The tuned-table tag, `sm90`, `sm100`, ...
    pub arch: String,
}

/// One attribute of `dev` as the driver reports it (an error names the attribute).
pub(crate) fn attribute(dev: &CudaDevice, a: sys::CUdevice_attribute) -> Result<i32> {
    dev.cuda_stream()
        .context()
        .attribute(a)
        .map_err(|e| cuda_err(&format!("cuDeviceGetAttribute({a:?})"), e))
}

/// Peak DRAM bytes per second from the driver's memory clock (kHz) and bus width (bits),
/// double data rate: `None` when either is missing or not positive (a planner then keeps
/// its bandwidth-blind default). From the data sheets: H100 SXM 2,619 MHz × 5,120 bits →
/// 3.35 TB/s; H200 3,201 MHz × 6,144 bits → 4.92 TB/s.
fn peak_bandwidth(clock_khz: Option<i32>, bus_bits: Option<i32>) -> Option<u64> {
    let khz = u64::try_from(clock_khz?).ok().filter(|&v| v > 0)?;
    let bits = u64::try_from(bus_bits?).ok().filter(|&v| v > 0)?;
    khz.checked_mul(1000)?.checked_mul(2)?.checked_mul(bits / 8)
}

type Table = HashMap<usize, Arc<DeviceFacts>>;

/// Facts per CUDA context (`ctx_key`), locked.
fn facts_table() -> Result<std::sync::MutexGuard<'static, Table>> {
    static FACTS: OnceLock<Mutex<Table>> = OnceLock::new();
    FACTS
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .map_err(|_| cuda_err("device facts", "poisoned lock"))
}

/// The facts of `dev`, queried on the first call per CUDA context (a lock and a map
/// lookup: for planning, at load; never on a per-call path).
pub(crate) fn facts(dev: &CudaDevice) -> Result<Arc<DeviceFacts>> {
    let key = ctx_key(dev);
    let mut t = facts_table()?;
    if let Some(f) = t.get(&key) {
        return Ok(f.clone());
    }
    let f = Arc::new(query(dev)?);
    t.insert(key, f.clone());
    Ok(f)
}

/// The facts of `dev` as its driver reports them.
fn query(dev: &CudaDevice) -> Result<DeviceFacts> {
    use sys::CUdevice_attribute::*;
    let cc = (
        attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    );
    let Some(image) = Image::for_device(cc, false) else {
        bail!(
            "candle-fp4: compute capability {}.{} is too old (the kernels need sm_80 or newer)",
            cc.0,
            cc.1
        )
    };
    Ok(DeviceFacts {
        cc,
        sms: attribute(dev, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as usize,
        smem_optin: attribute(dev, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?.max(0)
            as usize,
        l2_bytes: attribute(dev, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?.max(0) as usize,
        mem_bw: peak_bandwidth(
            attribute(dev, CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE).ok(),
            attribute(dev, CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH).ok(),
        ),
        image,
        arch: format!("sm{}{}", cc.0, cc.1),
    })
}

/// Plans made on `dev` from now on (not those already made) see `sms` SMs and, where
/// `mem_bw` is `Some`, that peak DRAM bandwidth instead of the device's own: for measuring
/// the decode on part of a GPU (`crate::partition`). Always relative to what the driver
/// reports (so `sms` = all of them and `mem_bw` = `None` restore the device's own facts).
/// Errors when `sms` is 0 or more than the device has.
pub(crate) fn override_facts(dev: &CudaDevice, sms: usize, mem_bw: Option<u64>) -> Result<()> {
    let real = query(dev)?;
    if sms == 0 || sms > real.sms {
        bail!(
            "candle-fp4: cannot plan for {sms} SMs on a device with {}",
            real.sms
        )
    }
    let f = Arc::new(DeviceFacts {
        sms,
        mem_bw: mem_bw.or(real.mem_bw),
        ..real
    });
    facts_table()?.insert(ctx_key(dev), f);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::peak_bandwidth;

    #[test]
    fn peak_bandwidth_from_clock_and_bus() {
        // H100 SXM (HBM3) and H200 (HBM3e), their data sheets' memory clocks and buses.
        assert_eq!(
            peak_bandwidth(Some(2_619_000), Some(5120)),
            Some(3_352_320_000_000)
        );
        assert_eq!(
            peak_bandwidth(Some(3_201_000), Some(6144)),
            Some(4_916_736_000_000)
        );
        assert_eq!(peak_bandwidth(None, Some(6144)), None);
        assert_eq!(peak_bandwidth(Some(3_201_000), None), None);
        assert_eq!(peak_bandwidth(Some(0), Some(6144)), None);
        assert_eq!(peak_bandwidth(Some(-1), Some(6144)), None);
        assert_eq!(peak_bandwidth(Some(i32::MAX), Some(i32::MAX)), None); // overflows u64
    }
}
