//! Module cache per device, device facts, and `cuLaunchKernelEx` with cluster and PDL
//! attributes (cudarc's launch builder has neither).

use super::images::{Image, KernelFile};
use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaFunction, CudaModule, CudaStream, DeviceRepr,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::{CudaDevice, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

pub(crate) fn cuda_err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Cuda(format!("{what}: {e:?}").into())
}

fn ctx_key(dev: &CudaDevice) -> usize {
    dev.cuda_stream().context().cu_ctx() as usize
}

fn attribute(dev: &CudaDevice, a: sys::CUdevice_attribute) -> Result<i32> {
    dev.cuda_stream()
        .context()
        .attribute(a)
        .map_err(|e| cuda_err("cuDeviceGetAttribute", e))
}

/// `(major, minor)` compute capability of the device, queried once per context (every
/// op launch needs it to pick the kernel image).
pub(crate) fn compute_capability(dev: &CudaDevice) -> Result<(i32, i32)> {
    use sys::CUdevice_attribute::*;
    static CC: OnceLock<Mutex<HashMap<usize, (i32, i32)>>> = OnceLock::new();
    let cache = CC.get_or_init(|| Mutex::new(HashMap::new()));
    let key = ctx_key(dev);
    if let Some(cc) = cache
        .lock()
        .map_err(|_| cuda_err("compute capability cache", "poisoned lock"))?
        .get(&key)
    {
        return Ok(*cc);
    }
    let cc = (
        attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    );
    cache
        .lock()
        .map_err(|_| cuda_err("compute capability cache", "poisoned lock"))?
        .insert(key, cc);
    Ok(cc)
}

/// `sm90`, `sm100`, `sm89`, ...: the tuned-table tag of the device.
pub fn arch_tag(dev: &CudaDevice) -> Result<String> {
    let (ma, mi) = compute_capability(dev)?;
    Ok(format!("sm{ma}{mi}"))
}

/// What one device has loaded of one kernel file in one image.
pub(crate) struct Loaded {
    pub image: Image,
    pub sms: usize,
    module: Arc<CudaModule>,
    funcs: Mutex<HashMap<String, (CudaFunction, u32)>>,
}

/// Block size the GEMV kernels are launched with (their occupancy is cached for it).
pub(crate) const GEMV_BLOCK: u32 = 128;

impl Loaded {
    /// The kernel `name`, and how many of its CTAs of [`GEMV_BLOCK`] threads fit on one SM.
    pub(crate) fn function(&self, name: &str) -> Result<(CudaFunction, u32)> {
        let mut funcs = self
            .funcs
            .lock()
            .map_err(|_| cuda_err("kernel cache", "poisoned lock"))?;
        if let Some(f) = funcs.get(name) {
            return Ok(f.clone());
        }
        let f = self
            .module
            .load_function(name)
            .map_err(|e| cuda_err(&format!("loading kernel {name} ({:?})", self.image), e))?;
        let occ = f
            .occupancy_max_active_blocks_per_multiprocessor(GEMV_BLOCK, 0, None)
            .map_err(|e| cuda_err(&format!("occupancy of {name}"), e))?
            .max(1);
        funcs.insert(name.to_string(), (f.clone(), occ));
        Ok((f, occ))
    }
}

type Cache = Mutex<HashMap<(usize, Image, KernelFile), Arc<Loaded>>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The module of `file` in `image` on `dev`, loaded once per device.
pub(crate) fn module(dev: &CudaDevice, file: KernelFile, image: Image) -> Result<Arc<Loaded>> {
    let key = (ctx_key(dev), image, file);
    let mut c = cache()
        .lock()
        .map_err(|_| cuda_err("kernel cache", "poisoned lock"))?;
    if let Some(l) = c.get(&key) {
        return Ok(l.clone());
    }
    let bytes = image.bytes(file);
    let ptx = if image.is_ptx() {
        let text =
            std::str::from_utf8(bytes).map_err(|e| cuda_err("kernel PTX is not UTF-8", e))?;
        Ptx::from_src(text.trim_end_matches('\0'))
    } else {
        Ptx::from_binary(bytes.to_vec())
    };
    let module = dev
        .cuda_stream()
        .context()
        .load_module(ptx)
        .map_err(|e| cuda_err(&format!("loading {} ({image:?})", file.name()), e))?;
    let sms = attribute(
        dev,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )? as usize;
    let l = Arc::new(Loaded {
        image,
        sms,
        module,
        funcs: Mutex::new(HashMap::new()),
    });
    c.insert(key, l.clone());
    Ok(l)
}

/// Grid, block, cluster and PDL of one launch (3-d grid, 1-d block; the cluster spans x).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Launch {
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub cluster: u32,
    pub pdl: bool,
    /// Dynamic shared memory bytes.
    pub smem: u32,
}

/// Launches `f(params)` on `stream` with `cuLaunchKernelEx`, the kernel taking one
/// `__grid_constant__` parameter block `P`.
///
/// # Safety
/// `P` must match the kernel's parameter type, and every pointer in it must stay valid
/// (its guards alive) until the launch is enqueued.
pub(crate) unsafe fn launch<P: DeviceRepr + Copy>(
    stream: &CudaStream,
    f: &CudaFunction,
    l: Launch,
    params: &P,
) -> Result<()> {
    let mut attrs: Vec<sys::CUlaunchAttribute> = Vec::with_capacity(2);
    if l.cluster > 1 {
        let mut a: sys::CUlaunchAttribute = std::mem::zeroed();
        a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        a.value.clusterDim.x = l.cluster;
        a.value.clusterDim.y = 1;
        a.value.clusterDim.z = 1;
        attrs.push(a);
    }
    if l.pdl {
        let mut a: sys::CUlaunchAttribute = std::mem::zeroed();
        a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        a.value.programmaticStreamSerializationAllowed = 1;
        attrs.push(a);
    }
    if l.smem > 48 * 1024 {
        sys::cuFuncSetAttribute(
            f.cu_function(),
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            l.smem as i32,
        )
        .result()
        .map_err(|e| cuda_err("cuFuncSetAttribute(max dynamic shared memory)", e))?;
    }
    let cfg = sys::CUlaunchConfig {
        gridDimX: l.grid.0,
        gridDimY: l.grid.1,
        gridDimZ: l.grid.2,
        blockDimX: l.block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: l.smem,
        hStream: stream.cu_stream(),
        attrs: if attrs.is_empty() {
            std::ptr::null_mut()
        } else {
            attrs.as_mut_ptr()
        },
        numAttrs: attrs.len() as u32,
    };
    let mut p = *params;
    let mut args = [&mut p as *mut P as *mut std::ffi::c_void];
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| cuda_err("binding the CUDA context", e))?;
    sys::cuLaunchKernelEx(
        &cfg,
        f.cu_function(),
        args.as_mut_ptr(),
        std::ptr::null_mut(),
    )
    .result()
    .map_err(|e| cuda_err("cuLaunchKernelEx", e))
}
