//! The launch plan of one KV cache on one device ([`AttnPlan`]): every kernel the cache's
//! ops launch, resolved once when the cache is made, with each attention kernel's warps and
//! shared memory as its own `Cfg` says (`cfp4_kv_attn_configs`) and its occupancy.

use super::scratch::{kv_scratch, KvScratch};
use super::shape::{CacheShape, KvCacheKind};
use crate::cuda::{cuda_err, facts, launch, module, KernelFile, Launch, Loaded};
use crate::variants::{
    kv_attn_count, kv_attn_has, kv_attn_index, kv_attn_kernel_name, kv_head_dims,
};
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaStream, DevicePtrMut, DeviceRepr,
};
use candle_core::{bail, CudaDevice, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// A plain launch (no cluster, no PDL) of a 3-d grid of 1-d blocks with `smem` bytes of
/// dynamic shared memory, through the crate's one `cuLaunchKernelEx` wrapper.
///
/// # Safety
/// `P` must be the kernel's parameter type and its pointers valid until the launch is queued.
pub(crate) unsafe fn launch_grid<P: DeviceRepr + Copy>(
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

/// Each attention kernel's `[warps, dynamic shared bytes]` as its `Cfg` says, read once
/// per device from `cfp4_kv_attn_configs` (indexed by [`kv_attn_index`]).
fn kernel_configs(dev: &CudaDevice, loaded: &Loaded) -> Result<Arc<Vec<i32>>> {
    type Table = Mutex<HashMap<usize, Arc<Vec<i32>>>>;
    static CONFIGS: OnceLock<Table> = OnceLock::new();
    let key = dev.cuda_stream().context().cu_ctx() as usize;
    let table = CONFIGS.get_or_init(|| Mutex::new(HashMap::new()));
    let mut t = table
        .lock()
        .map_err(|_| cuda_err("attention kernel configs", "poisoned lock"))?;
    if let Some(c) = t.get(&key) {
        return Ok(c.clone());
    }
    let stream = dev.cuda_stream();
    let n = 2 * kv_attn_count();
    let mut buf = stream
        .alloc_zeros::<i32>(n)
        .map_err(|e| cuda_err("allocating the attention kernel configs", e))?;
    let (f, _) = loaded.function("cfp4_kv_attn_configs")?;
    {
        let (p, _g) = buf.device_ptr_mut(&stream);
        unsafe { launch_grid(&stream, &f, (1, 1, 1), 32, 0, &p)? };
    }
    let v = stream
        .clone_dtoh(&buf)
        .map_err(|e| cuda_err("reading the attention kernel configs", e))?;
    let c = Arc::new(v);
    t.insert(key, c.clone());
    Ok(c)
}

/// One attention kernel with its warps per CTA, dynamic shared memory and resident CTAs
/// per SM.
#[derive(Debug, Clone)]
pub(crate) struct AttnKernel {
    pub f: CudaFunction,
    pub nw: usize,
    pub smem: usize,
    pub per_sm: usize,
}

impl AttnKernel {
    fn new(
        loaded: &Loaded,
        configs: &[i32],
        smem_optin: usize,
        fp4: bool,
        d: usize,
        nt: usize,
    ) -> Result<Self> {
        const OP: &str = "decode attention (cuda)";
        let Some(i) = kv_attn_index(fp4, d, nt) else {
            bail!("{OP}: no kernel for head_dim {d}, tile {nt}")
        };
        let (nw, smem) = (
            configs[2 * i].max(1) as usize,
            configs[2 * i + 1].max(0) as usize,
        );
        if smem > smem_optin {
            bail!("{OP}: the head_dim {d} kernel needs {smem} bytes of shared memory, this GPU allows {smem_optin}")
        }
        let f = loaded.function_with_smem(&kv_attn_kernel_name(fp4, d, nt), smem)?;
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor((nw * 32) as u32, smem, None)
            .map_err(|e| cuda_err("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))?
            .max(1) as usize;
        Ok(Self {
            f,
            nw,
            smem,
            per_sm,
        })
    }

    pub(crate) fn launch(&self, grid: (u32, u32, u32), pdl: bool) -> Launch {
        Launch {
            grid,
            block: (self.nw * 32) as u32,
            cluster: 1,
            pdl,
            smem: self.smem as u32,
        }
    }
}

/// Every kernel one cache's ops launch on its device, resolved once (when the cache is
/// made): the attention kernels of its head_dim for both query-head tiles (`[nt − 1]`; the
/// group size is known only at the call), the BF16 ring kernels of the exact window, the
/// combine, store, read-back, decode-append and lengths kernels, and the device facts the split rule needs.
#[derive(Debug)]
pub(crate) struct AttnPlan {
    kind: KvCacheKind,
    head_dim: usize,
    pub main: [Option<AttnKernel>; 2],
    pub ring: [Option<AttnKernel>; 2],
    pub combine: CudaFunction,
    pub store: CudaFunction,
    pub read: CudaFunction,
    pub lens_update: CudaFunction,
    pub append: CudaFunction,
    pub sms: usize,
    pub sm90: bool,
    /// The per-stream scratch this cache's calls used last and what it holds
    /// (`part_o`, `part_ml`, `counters`): later calls that fit reuse it without a lock.
    scratch: OnceLock<(usize, usize, usize, KvScratch)>,
}

impl AttnPlan {
    /// The plan of a cache of `kind` and `shape` on `dev`, with an exact window or not.
    pub(crate) fn new(
        dev: &CudaDevice,
        kind: KvCacheKind,
        shape: &CacheShape,
        window: bool,
    ) -> Result<Self> {
        const OP: &str = "KV cache (cuda)";
        let d = shape.head_dim;
        let fp4 = kind == KvCacheKind::UltraQuant;
        if !kv_head_dims(fp4).any(|x| x == d) {
            bail!(
                "{OP}: the CUDA kernels of the {kind:?} cache support head_dim {:?}, got {d}",
                kv_head_dims(fp4).collect::<Vec<_>>()
            )
        }
        let f = facts(dev)?;
        let loaded = module(dev, KernelFile::KvAttention, f.image)?;
        let format = module(dev, KernelFile::Ultraquant, f.image)?;
        let configs = kernel_configs(dev, &loaded)?;
        let get = |fp4: bool, nt: usize| -> Result<Option<AttnKernel>> {
            if !kv_attn_has(fp4, d, nt) {
                return Ok(None);
            }
            AttnKernel::new(&loaded, &configs, f.smem_optin, fp4, d, nt).map(Some)
        };
        let ring = if fp4 && window {
            [get(false, 1)?, get(false, 2)?]
        } else {
            [None, None]
        };
        // The store and read-back exist for UltraQuant head_dims only.
        let (store, read) = if fp4 {
            (
                format.function(&format!("cfp4_uq_store_d{d}"))?.0,
                format.function(&format!("cfp4_uq_read_d{d}"))?.0,
            )
        } else {
            let f = loaded.function("cfp4_kv_combine")?.0;
            (f.clone(), f)
        };
        Ok(Self {
            kind,
            head_dim: d,
            main: [get(fp4, 1)?, get(fp4, 2)?],
            ring,
            combine: loaded.function("cfp4_kv_combine")?.0,
            store,
            read,
            lens_update: format.function("cfp4_kv_lens_update")?.0,
            append: format.function("cfp4_kv_append")?.0,
            sms: f.sms,
            sm90: loaded.image.has_sm90_features(),
            scratch: OnceLock::new(),
        })
    }

    pub(crate) fn check(&self, op: &str, kind: KvCacheKind, shape: &CacheShape) -> Result<()> {
        if kind != self.kind || shape.head_dim != self.head_dim {
            bail!(
                "{op}: the cache's plan is for a {:?} cache of head_dim {}, the call is {kind:?} / {}",
                self.kind,
                self.head_dim,
                shape.head_dim
            )
        }
        Ok(())
    }

    /// Scratch of at least the given sizes: this cache's last one if it fits (no lock),
    /// else from the per-stream table (a lock; it grows outside graph capture only).
    pub(crate) fn scratch(
        &self,
        stream: &Arc<CudaStream>,
        part_o: usize,
        part_ml: usize,
        counters: usize,
    ) -> Result<KvScratch> {
        if let Some((o, ml, c, s)) = self.scratch.get() {
            if *o >= part_o && *ml >= part_ml && *c >= counters {
                return Ok(*s);
            }
        }
        let s = kv_scratch(stream, part_o, part_ml, counters)?;
        let _ = self.scratch.set((part_o, part_ml, counters, s));
        Ok(s)
    }
}
