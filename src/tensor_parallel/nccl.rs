//! [`NcclGroup`]: the [`AllReduce`] of a tensor-parallel decode on several GPUs, one rank
//! per device, through NCCL (cudarc's `nccl` module, candle's `nccl` feature). The sum runs
//! in place on the tensor's own buffer, on the device's candle stream, so a decode step
//! that calls it can be captured in a CUDA graph with the all-reduce inside (NCCL supports
//! stream capture; every rank must replay its graph for the collective to complete).

use super::error::ShardError;
use super::group::AllReduce;
use super::shard::Shard;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, ReduceOp};
use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice};
use candle_core::{bail, DType, Device, InplaceOp1, Layout, Result, Tensor};

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
}
