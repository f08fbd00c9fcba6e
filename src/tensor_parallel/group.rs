//! The collectives a tensor-parallel model calls ([`AllReduce`]: the sum after each
//! row-parallel layer, the all-gather of a vocabulary-parallel `lm_head`'s logits), and
//! [`ThreadGroup`]: ranks as threads of one process meeting in host memory, what the CPU
//! tests run (and a reference for the NCCL group of `nccl.rs`).

use super::collective::{all_gather_columns, all_reduce_sum};
use super::error::ShardError;
use super::shard::Shard;
use candle_core::{Result, Tensor};
use std::fmt::Debug;
use std::sync::{Arc, Barrier, Mutex};

/// The collectives of one tensor-parallel group, as seen by one rank: a sum all-reduce,
/// and an all-gather on the last dim.
///
/// Every rank calls them with tensors of the same shape and dtype, in the same order (a
/// collective completes only when every rank has called it). A model holds the group as
/// `Arc<dyn AllReduce>` in every layer that ends a row-parallel pair, and in a
/// vocabulary-parallel `lm_head`.
pub trait AllReduce: Send + Sync + Debug {
    /// This rank and the group size.
    fn shard(&self) -> Shard;

    /// The sum of `x` over the ranks, in `x`'s dtype and shape, on `x`'s device.
    fn all_reduce(&self, x: &Tensor) -> Result<Tensor>;

    /// The ranks' `x` side by side on the last dim, in rank order: each rank passes its
    /// `[..., n]` and every rank gets `[..., ranks·n]` in `x`'s dtype, on `x`'s device
    /// (a vocabulary-parallel `lm_head`'s logit slices joined into the whole vocabulary).
    fn all_gather_last(&self, x: &Tensor) -> Result<Tensor>;
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

impl ThreadGroup {
    /// Every rank's `x` (on the host), in rank order: each rank puts its tensor in its
    /// slot, waits for the others and reads all the slots; a second wait keeps any rank
    /// from refilling its slot before every rank has read.
    fn exchange(&self, x: &Tensor) -> Result<Vec<Tensor>> {
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
        self.shared.barrier.wait();
        parts.ok_or_else(|| candle_core::Error::Msg("ThreadGroup: a slot is empty".into()))
    }
}

impl AllReduce for ThreadGroup {
    fn shard(&self) -> Shard {
        self.shard
    }

    fn all_reduce(&self, x: &Tensor) -> Result<Tensor> {
        if self.shard.ranks() == 1 {
            return Ok(x.clone());
        }
        all_reduce_sum(&self.exchange(x)?)?.to_device(x.device())
    }

    fn all_gather_last(&self, x: &Tensor) -> Result<Tensor> {
        if self.shard.ranks() == 1 {
            return Ok(x.clone());
        }
        let n = x.dims().last().copied().unwrap_or(0);
        let total = n.checked_mul(self.shard.ranks()).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "all_gather_last: {n} × {} ranks overflows",
                self.shard.ranks()
            ))
        })?;
        all_gather_columns(&self.exchange(x)?, &[total])?.to_device(x.device())
    }
}
