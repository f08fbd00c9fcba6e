//! The all-reduce a tensor-parallel model calls after each row-parallel layer
//! ([`AllReduce`]), and [`ThreadGroup`]: ranks as threads of one process meeting in host
//! memory, what the CPU tests run (and a reference for the NCCL group of `nccl.rs`).

use super::collective::all_reduce_sum;
use super::error::ShardError;
use super::shard::Shard;
use candle_core::{Result, Tensor};
use std::fmt::Debug;
use std::sync::{Arc, Barrier, Mutex};

/// A sum all-reduce over the ranks of one tensor-parallel group, as seen by one rank.
///
/// Every rank calls [`all_reduce`](Self::all_reduce) with a tensor of the same shape and
/// dtype, in the same order; each gets the element-wise sum over the ranks. A model holds
/// it as `Arc<dyn AllReduce>` in every layer that ends a row-parallel pair.
pub trait AllReduce: Send + Sync + Debug {
    /// This rank and the group size.
    fn shard(&self) -> Shard;

    /// The sum of `x` over the ranks, in `x`'s dtype and shape, on `x`'s device.
    fn all_reduce(&self, x: &Tensor) -> Result<Tensor>;
}

/// What the ranks of a [`ThreadGroup`] share.
#[derive(Debug)]
struct Shared {
    /// One slot per rank: that rank's contribution to the current all-reduce.
    slots: Mutex<Vec<Option<Tensor>>>,
    barrier: Barrier,
}

/// One rank of a group of threads that all-reduce through host memory: each rank puts its
/// tensor (copied to the CPU) in its slot, waits for the others, and every rank computes
/// the same sum in rank order ([`all_reduce_sum`]: FP32, one rounding), so the ranks stay
/// bit-identical. For tests and CPU simulations: it blocks and synchronises the device.
#[derive(Debug, Clone)]
pub struct ThreadGroup {
    shard: Shard,
    shared: Arc<Shared>,
}

impl ThreadGroup {
    /// The `ranks` members of a new group, rank `r` at index `r` (hand one to each thread).
    pub fn new(ranks: usize) -> std::result::Result<Vec<Self>, ShardError> {
        let shards = Shard::all(ranks)?;
        let shared = Arc::new(Shared {
            slots: Mutex::new(vec![None; ranks]),
            barrier: Barrier::new(ranks),
        });
        Ok(shards
            .into_iter()
            .map(|shard| Self {
                shard,
                shared: shared.clone(),
            })
            .collect())
    }
}

impl AllReduce for ThreadGroup {
    fn shard(&self) -> Shard {
        self.shard
    }

    fn all_reduce(&self, x: &Tensor) -> Result<Tensor> {
        let ranks = self.shard.ranks();
        if ranks == 1 {
            return Ok(x.clone());
        }
        let host = x.to_device(&candle_core::Device::Cpu)?;
        let poisoned = || candle_core::Error::Msg("ThreadGroup: a rank panicked".into());
        {
            let mut slots = self.shared.slots.lock().map_err(|_| poisoned())?;
            slots[self.shard.rank()] = Some(host);
        }
        self.shared.barrier.wait();
        let parts: Option<Vec<Tensor>> = {
            let slots = self.shared.slots.lock().map_err(|_| poisoned())?;
            slots.iter().cloned().collect()
        };
        // Everyone has read the slots before any rank may refill them.
        self.shared.barrier.wait();
        let parts =
            parts.ok_or_else(|| candle_core::Error::Msg("ThreadGroup: a slot is empty".into()))?;
        all_reduce_sum(&parts)?.to_device(x.device())
    }
}
