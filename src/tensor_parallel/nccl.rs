//! [`NcclGroup`]: the [`AllReduce`] of a tensor-parallel decode on several GPUs, one rank
//! per device, through NCCL (cudarc's `nccl` module, candle's `nccl` feature). The sum runs
//! in place on the tensor's own buffer and the all-gather into a new one, both on the
//! device's candle stream, so a decode step that calls them can be captured in a CUDA
//! graph with the collectives inside (NCCL supports stream capture; every rank must replay
//! its graph for a collective to complete).

use super::collective::rank_major_to_last;
use super::error::ShardError;
use super::group::AllReduce;
use super::shard::Shard;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, ReduceOp};
use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice};
use candle_core::{bail, CustomOp1, DType, Device, InplaceOp1, Layout, Result, Shape, Tensor};

/// The unique id every rank of one group joins with (made once, by one thread or process,
/// and handed to the others: its 128 bytes are plain data).
#[derive(Debug, Clone, Copy)]
pub struct NcclId(Id);

impl NcclId {
    /// A new id (`ncclGetUniqueId`).
    pub fn new() -> Result<Self> {
        Id::new()
            .map(Self)
            .map_err(|e| candle_core::Error::Msg(format!("ncclGetUniqueId: {e:?}")))
    }
}

/// One rank of an NCCL group: its communicator, bound to the candle stream of its device.
#[derive(Debug)]
pub struct NcclGroup {
    shard: Shard,
    comm: Comm,
}

// SAFETY: the communicator is a handle that NCCL lets any thread use, one call at a time.
// A model calls `all_reduce` only from its decode step, which needs `&mut` access to the
// model (its KV caches), so two calls on one rank never run at once.
unsafe impl Send for NcclGroup {}
unsafe impl Sync for NcclGroup {}

impl NcclGroup {
    /// Joins rank `shard.rank()` of a group of `shard.ranks()` on `device` (a CUDA device;
    /// one rank per GPU). Blocks until every rank has joined with the same `id`.
    pub fn new(device: &Device, shard: Shard, id: NcclId) -> Result<Self> {
        let Device::Cuda(dev) = device else {
            bail!(
                "NcclGroup: rank {} needs a CUDA device, got {device:?}",
                shard.rank()
            )
        };
        let stream = dev.cuda_stream();
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| candle_core::Error::Msg(format!("NcclGroup: {e:?}")))?;
        let comm = Comm::from_rank(stream, shard.rank(), shard.ranks(), id.0).map_err(|e| {
            candle_core::Error::Msg(format!(
                "ncclCommInitRank (rank {} of {}): {e:?}",
                shard.rank(),
                shard.ranks()
            ))
        })?;
        Ok(Self { shard, comm })
    }
}

/// The in-place sum over the group's ranks.
struct SumInPlace<'a>(&'a Comm);

impl InplaceOp1 for SumInPlace<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-reduce-sum"
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> Result<()> {
        bail!("nccl-all-reduce-sum: the tensor is on the CPU")
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
        let Some((a, b)) = l.contiguous_offsets() else {
            bail!("nccl-all-reduce-sum: the tensor is not contiguous")
        };
        let err = |e| candle_core::Error::Msg(format!("ncclAllReduce: {e:?}"));
        match &mut s.slice {
            CudaStorageSlice::BF16(v) => {
                self.0
                    .all_reduce_in_place(&mut v.slice_mut(a..b), &ReduceOp::Sum)
                    .map_err(err)?;
            }
            CudaStorageSlice::F32(v) => {
                self.0
                    .all_reduce_in_place(&mut v.slice_mut(a..b), &ReduceOp::Sum)
                    .map_err(err)?;
            }
            _ => bail!(
                "nccl-all-reduce-sum: {:?} (BF16 or F32 expected)",
                s.dtype()
            ),
        }
        Ok(())
    }
}

/// NCCL's all-gather of a contiguous tensor: `[ranks, ...x's shape]`, rank `r`'s tensor
/// at index `r` (the rank-major order NCCL writes).
struct GatherRanks<'a>(&'a Comm, usize);

impl CustomOp1 for GatherRanks<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-gather"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        bail!("nccl-all-gather: the tensor is on the CPU")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let Some((a, b)) = l.contiguous_offsets() else {
            bail!("nccl-all-gather: the tensor is not contiguous")
        };
        let Some(total) = (b - a).checked_mul(self.1) else {
            bail!(
                "nccl-all-gather: {} values × {} ranks overflows",
                b - a,
                self.1
            )
        };
        let mut dims = vec![self.1];
        dims.extend_from_slice(l.dims());
        let dev = s.device().clone();
        let err = |e| candle_core::Error::Msg(format!("ncclAllGather: {e:?}"));
        let out = match &s.slice {
            CudaStorageSlice::BF16(v) => {
                let mut out = unsafe { dev.alloc::<half::bf16>(total)? };
                self.0.all_gather(&v.slice(a..b), &mut out).map_err(err)?;
                CudaStorage::wrap_cuda_slice(out, dev)
            }
            CudaStorageSlice::F32(v) => {
                let mut out = unsafe { dev.alloc::<f32>(total)? };
                self.0.all_gather(&v.slice(a..b), &mut out).map_err(err)?;
                CudaStorage::wrap_cuda_slice(out, dev)
            }
            _ => bail!("nccl-all-gather: {:?} (BF16 or F32 expected)", s.dtype()),
        };
        Ok((out, Shape::from(dims)))
    }
}

impl AllReduce for NcclGroup {
    fn shard(&self) -> Shard {
        self.shard
    }

    /// Sums `x` over the ranks **in place** (its buffer is the result; a contiguous
    /// BF16/F32 tensor that nothing else reads, such as a row-parallel layer's fresh
    /// output) and returns it. One rank still runs NCCL's (one-rank) sum, so that the
    /// path, graph capture included, runs on a single GPU too.
    fn all_reduce(&self, x: &Tensor) -> Result<Tensor> {
        if !matches!(x.dtype(), DType::BF16 | DType::F32) || !x.is_contiguous() {
            Err(ShardError::BadInput {
                what: "NcclGroup::all_reduce",
                reason: format!(
                    "{:?} {:?} (contiguous: {}): a contiguous BF16 or F32 tensor is expected",
                    x.dtype(),
                    x.dims(),
                    x.is_contiguous()
                ),
            })?
        }
        x.inplace_op1(&SumInPlace(&self.comm))?;
        Ok(x.clone())
    }

    /// Joins the ranks' `x` on the last dim with NCCL's all-gather (into a new buffer), then
    /// puts each row's slices side by side (one copy, skipped for a single row).
    fn all_gather_last(&self, x: &Tensor) -> Result<Tensor> {
        let ranks = self.shard.ranks();
        if x.dims().is_empty() {
            bail!("NcclGroup::all_gather_last: a scalar; [..., n] expected")
        }
        if !matches!(x.dtype(), DType::BF16 | DType::F32) {
            bail!(
                "NcclGroup::all_gather_last: {:?} {:?}: BF16 or F32 expected",
                x.dtype(),
                x.dims()
            )
        }
        let x = x.contiguous()?;
        let g = x.apply_op1_no_bwd(&GatherRanks(&self.comm, ranks))?;
        rank_major_to_last(&g)
    }
}
