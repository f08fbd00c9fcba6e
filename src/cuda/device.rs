//! What the planners need to know about a device, queried once per CUDA context.

use super::images::Image;
use super::launch::cuda_err;
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
    /// The image the device loads by default.
    pub image: Image,
    /// The tuned-table tag, `sm90`, `sm100`, ...
    pub arch: String,
}

fn attribute(dev: &CudaDevice, a: sys::CUdevice_attribute) -> Result<i32> {
    dev.cuda_stream()
        .context()
        .attribute(a)
        .map_err(|e| cuda_err("cuDeviceGetAttribute", e))
}

/// The facts of `dev`, queried on the first call per CUDA context (a lock and a map
/// lookup: for planning, at load; never on a per-call path).
pub(crate) fn facts(dev: &CudaDevice) -> Result<Arc<DeviceFacts>> {
    use sys::CUdevice_attribute::*;
    type Table = Mutex<HashMap<usize, Arc<DeviceFacts>>>;
    static FACTS: OnceLock<Table> = OnceLock::new();
    let key = dev.cuda_stream().context().cu_ctx() as usize;
    let table = FACTS.get_or_init(|| Mutex::new(HashMap::new()));
    let mut t = table
        .lock()
        .map_err(|_| cuda_err("device facts", "poisoned lock"))?;
    if let Some(f) = t.get(&key) {
        return Ok(f.clone());
    }
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
    let f = Arc::new(DeviceFacts {
        cc,
        sms: attribute(dev, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as usize,
        smem_optin: attribute(dev, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?.max(0)
            as usize,
        l2_bytes: attribute(dev, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?.max(0) as usize,
        image,
        arch: format!("sm{}{}", cc.0, cc.1),
    });
    t.insert(key, f.clone());
    Ok(f)
}
