//! [`LmHead`]: the model's last projection, final hidden states → logits. On one rank of a
//! tensor-parallel group whose vocabulary divides by the ranks it is vocabulary-parallel
//! ([`tp::vocab_parallel`]): the rank keeps its slice of the rows, computes that slice of
//! the logits, and an all-gather joins the ranks' slices, so each rank reads `1/ranks` of
//! the model's largest single weight per token; every rank then holds the whole logits
//! (the greedy choice and sampling run on each rank alike).

use anyhow::Result;
use candle_core::{Device, Module, Tensor};
use candle_fp4::quant_linear::QuantLinear;
use candle_fp4::tensor_parallel::{self as tp, AllReduce, FullWeight};
use std::sync::Arc;

/// The `lm_head`: one layer, and the group that joins its logit slices when it is split.
#[derive(Debug)]
pub struct LmHead {
    linear: QuantLinear,
    /// Set when `linear` holds this rank's slice of the rows.
    gather: Option<Arc<dyn AllReduce>>,
}

impl LmHead {
    /// A whole `lm_head` (one GPU, or a group whose vocabulary does not split).
    pub fn whole(linear: QuantLinear) -> Self {
        Self {
            linear,
            gather: None,
        }
    }

    /// Rank `reduce.shard()`'s head of a model whose whole `lm_head` is `full` (tied: the
    /// embeddings `tied`, `[vocab, hidden]`, instead; already on `device`, a whole head
    /// shares their storage): its slice of the rows when [`tp::vocab_parallel`] says so,
    /// else all of it; built on `device`.
    pub fn shard(
        full: &QuantLinear,
        tied: Option<&Tensor>,
        reduce: Arc<dyn AllReduce>,
        device: &Device,
    ) -> Result<Self> {
        let shard = reduce.shard();
        let split = tp::vocab_parallel(full.out_features(), shard.ranks());
        let linear = match (tied, split) {
            (Some(e), true) => {
                tp::column_parallel_parts(FullWeight::Float(e), None, shard, device)?
            }
            (Some(e), false) => QuantLinear::from_bf16(e.to_device(device)?, None)?,
            (None, true) => tp::column_parallel(full, shard, device)?,
            (None, false) => tp::replicate(full, device)?,
        };
        Ok(Self {
            linear,
            gather: split.then_some(reduce),
        })
    }

    /// A head whose `linear` already is this rank's slice of the rows (a rank that draws
    /// its own shard, `Llama::random_rank`), its logits joined by `reduce`.
    pub(super) fn from_slice(linear: QuantLinear, reduce: Arc<dyn AllReduce>) -> Self {
        Self {
            linear,
            gather: Some(reduce),
        }
    }

    /// The layer this rank runs (its slice of the rows when split).
    pub fn linear(&self) -> &QuantLinear {
        &self.linear
    }

    /// The layer this rank runs, to set its options.
    pub fn linear_mut(&mut self) -> &mut QuantLinear {
        &mut self.linear
    }

    /// Whether this rank holds a slice of the rows (the logits are then all-gathered).
    pub fn is_split(&self) -> bool {
        self.gather.is_some()
    }
}

impl Module for LmHead {
    /// The logits of `x` `[..., hidden]`: `[..., vocab]` on every rank.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = self.linear.forward(x)?;
        match &self.gather {
            Some(g) => g.all_gather_last(&y),
            None => Ok(y),
        }
    }
}
