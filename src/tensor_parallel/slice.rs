//! One rank's slice of a weight: column-parallel (output rows) and row-parallel (input
//! columns), for NVFP4 weights in the checkpoint layout and for float tensors.

use super::error::ShardError;
use super::shard::Shard;
use crate::nvfp4::{Nvfp4Quantized, BLOCK_SIZE};
use candle_core::{Result, Tensor};
use std::ops::Range;

/// Checks that `q`'s buffers are an NVFP4 weight `[n, k]` in the checkpoint layout:
/// `n, k > 0`, `k` a multiple of 16, `n·k/2` code bytes and `n·k/16` scale bytes.
fn check_nvfp4(q: &Nvfp4Quantized, what: &'static str) -> Result<()> {
    let (n, k) = (q.n, q.k);
    if n == 0 || k == 0 || !k.is_multiple_of(BLOCK_SIZE) {
        Err(ShardError::BadInput {
            what,
            reason: format!(
                "NVFP4 weight [{n}, {k}] needs n > 0 and k a positive multiple of {BLOCK_SIZE}"
            ),
        })?
    }
    let codes = crate::error::checked_product(what, &[n, k / 2])?;
    let scales = crate::error::checked_product(what, &[n, k / BLOCK_SIZE])?;
    if q.weight.len() != codes || q.weight_scale.len() != scales {
        Err(ShardError::BadInput {
            what,
            reason: format!(
                "NVFP4 weight [{n}, {k}] needs {codes} code bytes and {scales} scale bytes, got {} and {}",
                q.weight.len(),
                q.weight_scale.len()
            ),
        })?
    }
    Ok(())
}

/// The rows `ranges` (in order) of a checked NVFP4 weight; the global scale is kept.
fn take_rows_nvfp4(q: &Nvfp4Quantized, ranges: &[Range<usize>]) -> Nvfp4Quantized {
    let (half, s) = (q.k / 2, q.k / BLOCK_SIZE);
    let n: usize = ranges.iter().map(|r| r.len()).sum();
    // Every range lies inside 0..q.n (checked by the split), so these products fit.
    let mut weight = Vec::with_capacity(n * half);
    let mut weight_scale = Vec::with_capacity(n * s);
    for r in ranges {
        weight.extend_from_slice(&q.weight[r.start * half..r.end * half]);
        weight_scale.extend_from_slice(&q.weight_scale[r.start * s..r.end * s]);
    }
    Nvfp4Quantized {
        n,
        k: q.k,
        weight,
        weight_scale,
        global_scale: q.global_scale,
    }
}

/// Column-parallel slice of an NVFP4 weight `[n, k]` (checkpoint layout): rank `r` keeps
/// output rows `[r·n/ranks, (r+1)·n/ranks)` with their codes and block scales, and the
/// shared global scale. `n` must divide by the ranks (the error names `n` and `ranks`).
pub fn column_nvfp4(q: &Nvfp4Quantized, shard: Shard) -> Result<Nvfp4Quantized> {
    check_nvfp4(q, "column_nvfp4")?;
    let rows = shard.split("column-parallel rows n", q.n)?;
    Ok(take_rows_nvfp4(q, &[rows]))
}

/// Column-parallel slice of a fused NVFP4 layer `[m₀ | m₁ | …]` (`q | k | v`,
/// `gate | up`) with member row counts `members` (summing to `n`): each member is split
/// evenly on its own and the rank's slices are concatenated in member order, so the rank
/// keeps one fused layer `[m₀_r | m₁_r | …]`. Each member must divide by the ranks.
pub fn fused_column_nvfp4(
    q: &Nvfp4Quantized,
    members: &[usize],
    shard: Shard,
) -> Result<Nvfp4Quantized> {
    check_nvfp4(q, "fused_column_nvfp4")?;
    let ranges = shard.split_fused(members, q.n)?;
    Ok(take_rows_nvfp4(q, &ranges))
}

/// Row-parallel slice of an NVFP4 weight `[n, k]` (checkpoint layout): rank `r` keeps
/// input columns `[r·k/ranks, (r+1)·k/ranks)` of every row, which must be whole 16-value
/// scale blocks (`k` a multiple of `ranks·16`; the error names `k`, `ranks` and the block
/// size). At such a boundary the codes split on a byte (two values a byte) and the scales
/// on a column; the global scale is shared by all ranks. A slice whose block count is not
/// a multiple of 4 is still a valid layer: [`QuantLinear::from_nvfp4`] pads when it
/// swizzles.
///
/// [`QuantLinear::from_nvfp4`]: crate::quant_linear::QuantLinear::from_nvfp4
pub fn row_nvfp4(q: &Nvfp4Quantized, shard: Shard) -> Result<Nvfp4Quantized> {
    check_nvfp4(q, "row_nvfp4")?;
    let not_aligned = ShardError::NotBlockAligned {
        k: q.k,
        ranks: shard.ranks(),
        block: BLOCK_SIZE,
    };
    let blocks = q.k / BLOCK_SIZE;
    if !blocks.is_multiple_of(shard.ranks()) {
        Err(not_aligned)?
    }
    let cols = shard.split("row-parallel scale blocks", blocks)?;
    let (half, s) = (q.k / 2, blocks);
    let (b0, b1) = (cols.start * BLOCK_SIZE / 2, cols.end * BLOCK_SIZE / 2);
    let mut weight = Vec::with_capacity(q.n * (b1 - b0));
    let mut weight_scale = Vec::with_capacity(q.n * cols.len());
    for row in 0..q.n {
        weight.extend_from_slice(&q.weight[row * half + b0..row * half + b1]);
        weight_scale.extend_from_slice(&q.weight_scale[row * s + cols.start..row * s + cols.end]);
    }
    Ok(Nvfp4Quantized {
        n: q.n,
        k: cols.len() * BLOCK_SIZE,
        weight,
        weight_scale,
        global_scale: q.global_scale,
    })
}

/// The rows `ranges` of `t` along dim 0, in order, as one compact tensor (not a view of
/// `t`'s storage).
fn take_rows_tensor(t: &Tensor, ranges: &[Range<usize>]) -> Result<Tensor> {
    let parts = ranges
        .iter()
        .map(|r| t.narrow(0, r.start, r.len())?.force_contiguous())
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&parts, 0)
}

/// The leading dim of a tensor of at least one dim.
fn rows_of(t: &Tensor, what: &'static str) -> Result<usize> {
    match t.dims().first() {
        Some(&n) if n > 0 => Ok(n),
        _ => Err(ShardError::BadInput {
            what,
            reason: format!(
                "expected a weight [n, k] or a bias [n] with n > 0, got shape {:?}",
                t.dims()
            ),
        })?,
    }
}

/// Column-parallel slice of a float weight `[n, k]` (or a bias `[n]`): rank `r` keeps
/// rows `[r·n/ranks, (r+1)·n/ranks)`, any dtype kept. `n` must divide by the ranks.
pub fn column_tensor(w: &Tensor, shard: Shard) -> Result<Tensor> {
    let n = rows_of(w, "column_tensor")?;
    let rows = shard.split("column-parallel rows n", n)?;
    take_rows_tensor(w, &[rows])
}

/// Column-parallel slice of a fused float weight `[m₀ | m₁ | …]` `[n, k]` (or its bias
/// `[n]`) with member row counts `members`: as [`fused_column_nvfp4`].
pub fn fused_column_tensor(w: &Tensor, members: &[usize], shard: Shard) -> Result<Tensor> {
    let n = rows_of(w, "fused_column_tensor")?;
    let ranges = shard.split_fused(members, n)?;
    take_rows_tensor(w, &ranges)
}

/// Row-parallel slice of a float weight `[n, k]`: rank `r` keeps columns
/// `[r·k/ranks, (r+1)·k/ranks)`; `k` must divide by the ranks.
pub fn row_tensor(w: &Tensor, shard: Shard) -> Result<Tensor> {
    let k = match w.dims() {
        [n, k] if *n > 0 && *k > 0 => *k,
        d => Err(ShardError::BadInput {
            what: "row_tensor",
            reason: format!("expected a non-empty 2-d weight [n, k], got shape {d:?}"),
        })?,
    };
    let cols = shard.split("row-parallel columns k", k)?;
    w.narrow(1, cols.start, cols.len())?.force_contiguous()
}
