//! [`QuantLinear`] builders for one rank: column-parallel (plain or fused) and
//! row-parallel layers, from an unsharded layer or from checkpoint parts.

use super::error::ShardError;
use super::shard::Shard;
use super::slice::{fused_column_nvfp4, fused_column_tensor, row_nvfp4, row_tensor};
use crate::nvfp4::Nvfp4Quantized;
use crate::quant_linear::QuantLinear;
use candle_core::{Device, Result, Tensor};

/// An unsharded weight as a checkpoint (or the quantizer) gives it.
#[derive(Debug, Clone, Copy)]
pub enum FullWeight<'a> {
    /// NVFP4 in the checkpoint layout (row-major, unswizzled block scales).
    Nvfp4(&'a Nvfp4Quantized),
    /// A float weight `[n, k]` (the layer keeps it as BF16).
    Float(&'a Tensor),
}

impl FullWeight<'_> {
    /// Output features `n` of the weight (an error for a float tensor that is not 2-d).
    pub fn rows(&self) -> Result<usize> {
        match self {
            FullWeight::Nvfp4(q) => Ok(q.n),
            FullWeight::Float(w) => match w.dims() {
                [n, _] => Ok(*n),
                d => Err(ShardError::BadInput {
                    what: "FullWeight::rows",
                    reason: format!("a float weight must be 2-d [n, k], got shape {d:?}"),
                })?,
            },
        }
    }
}

/// The weight of an unsharded layer, read back on the host (NVFP4) or as FP32 (BF16,
/// exact).
enum OwnedWeight {
    Nvfp4(Nvfp4Quantized),
    Float(Tensor),
}

impl OwnedWeight {
    fn of(layer: &QuantLinear) -> Result<Self> {
        Ok(match layer.to_nvfp4()? {
            Some(q) => OwnedWeight::Nvfp4(q),
            None => OwnedWeight::Float(layer.dequantize()?),
        })
    }

    fn full(&self) -> FullWeight<'_> {
        match self {
            OwnedWeight::Nvfp4(q) => FullWeight::Nvfp4(q),
            OwnedWeight::Float(w) => FullWeight::Float(w),
        }
    }
}

/// `bias` checked to be `[n]`.
fn check_bias(bias: Option<&Tensor>, n: usize, what: &'static str) -> Result<()> {
    match bias {
        Some(b) if b.dims() != [n] => Err(ShardError::BadInput {
            what,
            reason: format!("bias has shape {:?}, the weight has n = {n} rows", b.dims()),
        })?,
        _ => Ok(()),
    }
}

/// The layer of a sliced weight on `device`.
fn build(weight: FullWeight<'_>, bias: Option<Tensor>, device: &Device) -> Result<QuantLinear> {
    match weight {
        FullWeight::Nvfp4(q) => QuantLinear::from_nvfp4(q, bias, device),
        FullWeight::Float(w) => QuantLinear::from_bf16(w.to_device(device)?, bias),
    }
}

/// Rank `shard`'s column-parallel layer of an unsharded `layer`: output rows
/// `[r·n/ranks, (r+1)·n/ranks)` and their bias entries. `n` must
/// divide by the ranks. The ranks' outputs side by side are `layer`'s output (bit for bit
/// on the CPU GEMV; see the [module docs](super) for the other paths). The rank's layer is
/// built on `device` (the rank's GPU; `layer` may live on the CPU).
pub fn column_parallel(layer: &QuantLinear, shard: Shard, device: &Device) -> Result<QuantLinear> {
    fused_column_parallel(layer, &[layer.out_features()], shard, device)
}

/// Rank `shard`'s part of a fused layer `[m₀ | m₁ | …]` (`q | k | v` with
/// [`HeadSplit::qkv_members`](super::HeadSplit::qkv_members), or `gate | up` with
/// `[i, i]`): each member split on its own, the rank's slices fused again in member order
/// (so a `gate | up` rank layer is `[gate_r | up_r]` and keeps
/// [`forward_silu_mul`](QuantLinear::forward_silu_mul)). Bias entries follow their rows.
pub fn fused_column_parallel(
    layer: &QuantLinear,
    members: &[usize],
    shard: Shard,
    device: &Device,
) -> Result<QuantLinear> {
    let w = OwnedWeight::of(layer)?;
    fused_column_parallel_parts(w.full(), layer.bias(), members, shard, device)
}

/// Rank `shard`'s row-parallel layer of an unsharded `layer`: input columns
/// `[r·k/ranks, (r+1)·k/ranks)` (NVFP4: whole 16-value blocks, see
/// [`row_nvfp4`](super::row_nvfp4)); the bias only on rank 0, so that the all-reduce of the
/// ranks' outputs adds it once. Built on `device`.
pub fn row_parallel(layer: &QuantLinear, shard: Shard, device: &Device) -> Result<QuantLinear> {
    let w = OwnedWeight::of(layer)?;
    row_parallel_parts(w.full(), layer.bias(), shard, device)
}

/// Whether a `ranks`-way group splits an `lm_head` of `vocab` rows (vocabulary-parallel:
/// rank `r` keeps rows `[r·vocab/ranks, (r+1)·vocab/ranks)` as a [`column_parallel`]
/// layer and the ranks' logit slices are joined by
/// [`AllReduce::all_gather_last`](super::AllReduce::all_gather_last)) rather than
/// replicating it: with several ranks and rows that divide evenly (NCCL's all-gather moves
/// equal parts). Each rank then reads `1/ranks` of the `lm_head` per token instead of all
/// of it; the logits are the replicated layer's bit for bit where the GEMV's summation
/// order depends on K alone (see the [module docs](super)).
pub fn vocab_parallel(vocab: usize, ranks: usize) -> bool {
    ranks > 1 && vocab > 0 && vocab.is_multiple_of(ranks)
}

/// A replicated layer (every rank holds all of it, e.g. an `lm_head` whose rows do not
/// divide by the ranks, see [`vocab_parallel`]): `layer` rebuilt on `device`, bias included.
pub fn replicate(layer: &QuantLinear, device: &Device) -> Result<QuantLinear> {
    column_parallel(layer, Shard::single(), device)
}

/// [`column_parallel`] from checkpoint parts: an unsharded weight and bias `[n]`, the rank's
/// layer built on `device`.
pub fn column_parallel_parts(
    weight: FullWeight<'_>,
    bias: Option<&Tensor>,
    shard: Shard,
    device: &Device,
) -> Result<QuantLinear> {
    let n = weight.rows()?;
    fused_column_parallel_parts(weight, bias, &[n], shard, device)
}

/// [`fused_column_parallel`] from checkpoint parts (the fused weight `[Σ members, k]` and
/// bias), the rank's layer built on `device`.
pub fn fused_column_parallel_parts(
    weight: FullWeight<'_>,
    bias: Option<&Tensor>,
    members: &[usize],
    shard: Shard,
    device: &Device,
) -> Result<QuantLinear> {
    check_bias(bias, weight.rows()?, "fused_column_parallel")?;
    let bias = bias
        .map(|b| fused_column_tensor(b, members, shard))
        .transpose()?;
    match weight {
        FullWeight::Nvfp4(q) => {
            let q = fused_column_nvfp4(q, members, shard)?;
            build(FullWeight::Nvfp4(&q), bias, device)
        }
        FullWeight::Float(w) => {
            let w = fused_column_tensor(w, members, shard)?;
            build(FullWeight::Float(&w), bias, device)
        }
    }
}

/// [`row_parallel`] from checkpoint parts: an unsharded weight and bias `[n]`, the rank's
/// layer built on `device` (the bias on rank 0 only).
pub fn row_parallel_parts(
    weight: FullWeight<'_>,
    bias: Option<&Tensor>,
    shard: Shard,
    device: &Device,
) -> Result<QuantLinear> {
    check_bias(bias, weight.rows()?, "row_parallel")?;
    let bias = bias.filter(|_| shard.is_first()).cloned();
    match weight {
        FullWeight::Nvfp4(q) => {
            let q = row_nvfp4(q, shard)?;
            build(FullWeight::Nvfp4(&q), bias, device)
        }
        FullWeight::Float(w) => {
            let w = row_tensor(w, shard)?;
            build(FullWeight::Float(&w), bias, device)
        }
    }
}
