//! The forwards of the caches' ops (`ops.rs`): each validates its storages, then runs the
//! CPU reference (`cpu.rs`) or the CUDA kernels (`cuda.rs`) with the cache's plan.

use super::cpu::{self, KvSource};
use super::ops::{range, KvAppend, KvAttention, LensUpdate, UqRead, UqStore};
use super::shape::KvCacheKind;
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp3, InplaceOp1, InplaceOp3, Layout, Result, Shape, Storage,
};
use half::bf16;

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

#[cfg(feature = "cuda")]
fn plan_of<'a>(op: &str, p: &'a super::ops::PlanRef) -> Result<&'a super::plan::AttnPlan> {
    match &p.cuda {
        Some(p) => Ok(p),
        None => bail!("{op}: the cache has no CUDA plan (it was made on another device)"),
    }
}

impl InplaceOp1 for LensUpdate {
    fn name(&self) -> &'static str {
        "kv-lens-update"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        const OP: &str = "KV cache lengths";
        let (a, b) = range(OP, "lens", l)?;
        let CpuStorage::U32(v) = s else {
            bail!("{OP}: lens must be U32, got {:?}", s.dtype())
        };
        let Some(lens) = v[a..b].get_mut(self.seq_base..self.seq_base + self.n_seq) else {
            bail!(
                "{OP}: sequences {}..{} outside the batch {}",
                self.seq_base,
                self.seq_base + self.n_seq,
                b - a
            )
        };
        let value = u32::try_from(self.value).map_err(|_| {
            candle_core::Error::Msg(format!("{OP}: length {} exceeds u32", self.value))
        })?;
        for n in lens {
            *n = if self.add {
                n.saturating_add(value)
            } else {
                value
            };
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        let plan = plan_of("KV cache lengths (cuda)", &self.plan)?;
        super::cuda::lens_update_cuda(plan, s, l, self.seq_base, self.n_seq, self.value, self.add)
    }
}

impl InplaceOp3 for KvAppend {
    fn name(&self) -> &'static str {
        "kv-decode-append"
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
        const OP: &str = "KV decode append";
        let k = cpu_bf16(OP, "k", s2, l2)?;
        let v = cpu_bf16(OP, "v", s3, l3)?;
        let (st, ll) = self.lens_dev.storage_and_layout();
        let lens = match &*st {
            Storage::Cpu(c) => cpu_lens(OP, c, ll)?,
            _ => bail!("{OP}: the lengths are not on the CPU"),
        };
        let (a, b) = range(OP, "destination", l1)?;
        let dst = match s1 {
            CpuStorage::BF16(d) => &mut d[a..b],
            s => bail!("{OP}: the destination must be BF16, got {:?}", s.dtype()),
        };
        cpu::append_rows(dst, k, v, &lens, self)
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
        let plan = plan_of("KV decode append (cuda)", &self.plan)?;
        super::cuda::kv_append_cuda(plan, self, s1, l1, s2, l2, s3, l3)
    }
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
        let plan = plan_of("ultraquant store (cuda)", &self.plan)?;
        super::cuda::uq_store_cuda(plan, self, s1, l1, s2, l2, s3, l3)
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
        let plan = plan_of("ultraquant read (cuda)", &self.plan)?;
        super::cuda::uq_read_cuda(plan, self, s, l)
    }
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
        if self.rope.is_some() {
            bail!("{OP}: the rope and append inside the attention run on CUDA only")
        }
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
        let plan = plan_of("decode attention (cuda)", &self.plan)?;
        super::attention_cuda::kv_attention_cuda(plan, self, s1, l1, s2, l2, s3, l3)
    }
}
