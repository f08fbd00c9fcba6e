//! Module and function cache per device, and `cuLaunchKernelEx` with cluster and PDL
//! attributes (cudarc's launch builder has neither). The caches take a lock: they are for
//! planning (at load); a planned launch holds its `CudaFunction` and calls [`launch`] only.

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

/// The key of `dev`'s CUDA context in the per-device caches.
pub(super) fn ctx_key(dev: &CudaDevice) -> usize {
    dev.cuda_stream().context().cu_ctx() as usize
}

/// What one device has loaded of one kernel file in one image.
pub(crate) struct Loaded {
    pub image: Image,
    pub module: Arc<CudaModule>,
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

impl Loaded {
    /// [`Loaded::function`], with `smem` bytes of dynamic shared memory allowed on it.
    pub(crate) fn function_with_smem(&self, name: &str, smem: usize) -> Result<CudaFunction> {
        let (f, _) = self.function(name)?;
        f.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(|e| {
            cuda_err(
                &format!("cuFuncSetAttribute(max dynamic shared memory) of {name}"),
                e,
            )
        })?;
        Ok(f)
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
    let bytes = super::images::image_bytes(file, image);
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
    let l = Arc::new(Loaded {
        image,
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

impl Launch {
    /// One thread per item for `threads` items: blocks of 256, no cluster, no PDL, no
    /// shared memory (the load-time kernels: packing, dequantizing). `op` names the caller
    /// in the error when the grid would not fit a launch.
    pub(crate) fn one_d(op: &str, threads: usize) -> Result<Self> {
        let blocks = threads.div_ceil(256);
        let Ok(blocks) = u32::try_from(blocks) else {
            candle_core::bail!("{op}: {threads} threads are too many for one launch");
        };
        Ok(Self {
            grid: (blocks, 1, 1),
            block: 256,
            cluster: 1,
            pdl: false,
            smem: 0,
        })
    }
}

/// Launches `f(params)` on `stream` with `cuLaunchKernelEx`, the kernel taking one
/// `__grid_constant__` parameter block `P`. Dynamic shared memory above 48 KiB must have
/// been allowed on `f` when it was planned ([`Loaded::function_with_smem`]).
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
    // On the stack: a launch allocates nothing.
    let mut attrs: [sys::CUlaunchAttribute; 2] = [std::mem::zeroed(), std::mem::zeroed()];
    let mut n_attrs = 0;
    if l.cluster > 1 {
        let a = &mut attrs[n_attrs];
        a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        a.value.clusterDim.x = l.cluster;
        a.value.clusterDim.y = 1;
        a.value.clusterDim.z = 1;
        n_attrs += 1;
    }
    if l.pdl {
        let a = &mut attrs[n_attrs];
        a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        a.value.programmaticStreamSerializationAllowed = 1;
        n_attrs += 1;
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
        attrs: if n_attrs == 0 {
            std::ptr::null_mut()
        } else {
            attrs.as_mut_ptr()
        },
        numAttrs: n_attrs as u32,
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
