//! The caches' candle ops: the in-place UltraQuant store, the read-back and decode
//! attention. Each validates its storages, then runs the CPU forward (`cpu.rs`) or the CUDA
//! kernels (`src/cuda/kv.rs`).

use super::cpu::{self, KvSource};
use super::{CacheShape, DecodeOptions, KvCacheKind};
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp3, InplaceOp3, Layout, Result, Shape, Storage, Tensor,
};
use half::bf16;

/// Contiguous `[start, end)` element range of a layout, or an error naming `what`.
pub(crate) fn range(op: &str, what: &str, l: &Layout) -> Result<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(r) => Ok(r),
        None => bail!("{op}: {what} must be contiguous"),
    }
}

fn cpu_u8<'a>(op: &str, what: &str, s: &'a CpuStorage, l: &Layout) -> Result<&'a [u8]> {
    let (a, b) = range(op, what, l)?;
    match s {
        CpuStorage::U8(v) => Ok(&v[a..b]),
        s => bail!("{op}: {what} must be U8, got {:?}", s.dtype()),
    }
}

fn cpu_bf16<'a>(op: &str, what: &str, s: &'a CpuStorage, l: &Layout) -> Result<&'a [bf16]> {
    let (a, b) = range(op, what, l)?;
    match s {
        CpuStorage::BF16(v) => Ok(&v[a..b]),
        s => bail!("{op}: {what} must be BF16, got {:?}", s.dtype()),
    }
}

fn cpu_lens(op: &str, s: &CpuStorage, l: &Layout) -> Result<Vec<usize>> {
    let (a, b) = range(op, "lens", l)?;
    match s {
        CpuStorage::U32(v) => Ok(v[a..b].iter().map(|&n| n as usize).collect()),
        s => bail!("{op}: lens must be U32, got {:?}", s.dtype()),
    }
}

/// In-place store of new K/V into the UltraQuant slots (`cache.inplace_op3(k, v, op)`).
#[derive(Debug, Clone)]
pub(crate) struct UqStore {
    pub shape: CacheShape,
    /// First sequence written; sequence `seq_base + i` writes at `starts[i]`.
    pub seq_base: usize,
    pub starts: Vec<usize>,
    pub tokens: usize,
    /// The lengths on the device before this append (`starts` as U32 `[batch]`); the CUDA
    /// kernel reads its write positions from it.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub lens_dev: Tensor,
}

impl InplaceOp3 for UqStore {
    fn name(&self) -> &'static str {
        "ultraquant-store"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<()> {
        const OP: &str = "ultraquant store";
        let k = cpu_bf16(OP, "k", s2, l2)?;
        let v = cpu_bf16(OP, "v", s3, l3)?;
        let (a, b) = range(OP, "cache", l1)?;
        let data = match s1 {
            CpuStorage::U8(d) => &mut d[a..b],
            s => bail!("{OP}: cache must be U8, got {:?}", s.dtype()),
        };
        cpu::store(
            data,
            &self.shape,
            self.seq_base,
            &self.starts,
            self.tokens,
            k,
            v,
        )
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<()> {
        crate::cuda::uq_store_cuda(self, s1, l1, s2, l2, s3, l3)
    }
}

/// Read-back of tokens `start..start + count` of sequence `seq`: BF16 `[2, count, kv_heads,
/// head_dim]` (K un-rotated, V).
#[derive(Debug, Clone, Copy)]
pub(crate) struct UqRead {
    pub shape: CacheShape,
    pub seq: usize,
    pub start: usize,
    pub count: usize,
}

impl UqRead {
    pub(crate) fn out_shape(&self) -> Shape {
        Shape::from((2, self.count, self.shape.kv_heads, self.shape.head_dim))
    }
}

impl CustomOp1 for UqRead {
    fn name(&self) -> &'static str {
        "ultraquant-read"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let data = cpu_u8("ultraquant read", "cache", s, l)?;
        let out = cpu::read(data, &self.shape, self.seq, self.start, self.count)?;
        Ok((CpuStorage::BF16(out), self.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::uq_read_cuda(self, s, l)
    }
}

/// Decode attention: inputs `q` BF16 `[batch, q_heads, head_dim]`, the cache storage (U8
/// slots, or BF16 `[2, batch, capacity, kv_heads, head_dim]`), lengths U32 `[batch]`.
#[derive(Debug, Clone)]
pub(crate) struct KvAttention {
    pub kind: KvCacheKind,
    pub shape: CacheShape,
    pub q_heads: usize,
    /// Host copy of the lengths (split heuristics on CUDA).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub lens: Vec<usize>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub opts: DecodeOptions,
    /// UltraQuant only: the last `size` tokens of each sequence read exact from `ring`.
    pub window: Option<ExactWindow>,
}

/// The BF16 ring of an UltraQuant cache's exact window: `[2, batch, size, kv_heads,
/// head_dim]` (K unrotated, then V), token `t` of a sequence in row `t % size`.
#[derive(Debug, Clone)]
pub(crate) struct ExactWindow {
    pub size: usize,
    pub ring: Tensor,
}

impl CustomOp3 for KvAttention {
    fn name(&self) -> &'static str {
        match self.kind {
            KvCacheKind::Bf16 => "bf16-kv-attention",
            KvCacheKind::UltraQuant => "ultraquant-attention",
        }
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        const OP: &str = "decode attention";
        let q = cpu_bf16(OP, "q", s1, l1)?;
        let lens = cpu_lens(OP, s3, l3)?;
        let ring_guard;
        let src = match (self.kind, &self.window) {
            (KvCacheKind::UltraQuant, Some(w)) => {
                let (st, l) = w.ring.storage_and_layout();
                ring_guard = st;
                let kv = match &*ring_guard {
                    Storage::Cpu(c) => cpu_bf16(OP, "exact window ring", c, l)?,
                    _ => bail!("{OP}: the exact window ring is not on the CPU"),
                };
                let (k, v) = kv.split_at(kv.len() / 2);
                KvSource::UltraQuantWindow {
                    slots: cpu_u8(OP, "cache", s2, l2)?,
                    k,
                    v,
                    window: w.size,
                }
            }
            (KvCacheKind::UltraQuant, None) => KvSource::UltraQuant(cpu_u8(OP, "cache", s2, l2)?),
            (KvCacheKind::Bf16, _) => {
                let kv = cpu_bf16(OP, "cache", s2, l2)?;
                let (k, v) = kv.split_at(kv.len() / 2);
                KvSource::Bf16 { k, v }
            }
        };
        let out = cpu::attention_cpu(q, self.q_heads, &self.shape, &lens, src)?;
        let shape = Shape::from((self.shape.batch, self.q_heads, self.shape.head_dim));
        Ok((CpuStorage::BF16(out), shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::kv_attention_cuda(self, s1, l1, s2, l2, s3, l3)
    }
}
