//! CPU references of the collectives a tensor-parallel decode runs: the all-reduce after
//! each row-parallel layer ([`all_reduce_sum`]) and the all-gather that puts a
//! column-parallel output back in the unsharded layout ([`all_gather_columns`]); and the
//! re-layout of an all-gather's rank-major result ([`rank_major_to_last`]).

use super::error::ShardError;
use super::shard::Shard;
use candle_core::{DType, Result, Tensor};

/// Checks that `parts` is non-empty and that every part has part 0's shape, dtype and
/// device (shapes compared on all dims, or on all but the last with `all_but_last`).
fn check_parts<'a>(
    parts: &'a [Tensor],
    what: &'static str,
    all_but_last: bool,
) -> Result<&'a Tensor> {
    let Some(first) = parts.first() else {
        Err(ShardError::BadInput {
            what,
            reason: "no parts (one per rank expected)".to_string(),
        })?
    };
    let lead = |t: &Tensor| -> Vec<usize> {
        let d = t.dims();
        match (all_but_last, d.split_last()) {
            (true, Some((_, lead))) => lead.to_vec(),
            _ => d.to_vec(),
        }
    };
    for (i, p) in parts.iter().enumerate().skip(1) {
        let same = lead(p) == lead(first) && p.rank() == first.rank();
        if !same || p.dtype() != first.dtype() || !p.device().same_device(first.device()) {
            Err(ShardError::BadInput {
                what,
                reason: format!(
                    "part {i} is {:?} {:?} on {:?}, part 0 is {:?} {:?} on {:?}",
                    p.dtype(),
                    p.dims(),
                    p.device().location(),
                    first.dtype(),
                    first.dims(),
                    first.device().location()
                ),
            })?
        }
    }
    Ok(first)
}

/// The element-wise sum of one tensor per rank, in rank order, as NCCL's sum all-reduce
/// gives it: every part must have the same shape, float dtype and device; BF16, F16 and
/// F32 parts are summed in FP32 (F64 ones in F64), adding part 1, 2, … to part 0 in
/// order, and the sum is rounded once to the parts' dtype. For two BF16 parts this is
/// exactly one rounding of `a + b` (their FP32 sum is exact, or the smaller part is below
/// a BF16 half-ulp of the larger one).
pub fn all_reduce_sum(parts: &[Tensor]) -> Result<Tensor> {
    const WHAT: &str = "all_reduce_sum";
    let first = check_parts(parts, WHAT, false)?;
    let dtype = first.dtype();
    let acc_dtype = match dtype {
        DType::BF16 | DType::F16 | DType::F32 => DType::F32,
        DType::F64 => DType::F64,
        dt => Err(ShardError::BadInput {
            what: WHAT,
            reason: format!("parts of dtype {dt:?}: a float dtype is expected"),
        })?,
    };
    let mut acc = first.to_dtype(acc_dtype)?;
    for p in &parts[1..] {
        acc = (acc + p.to_dtype(acc_dtype)?)?;
    }
    acc.to_dtype(dtype)
}

/// The unsharded output of a column-parallel layer from its ranks' outputs (part `r` =
/// rank `r`'s `[..., n_r]`), with member row counts `members` of the unsharded fused layer
/// (`&[n]` for a plain layer): for each member in order, the ranks' slices of it in rank
/// order, concatenated on the last dim. Every member must divide by the ranks, the parts
/// must agree on all but the last dim (and dtype, device), and each part's last dim must
/// be `Σ members / ranks`.
pub fn all_gather_columns(parts: &[Tensor], members: &[usize]) -> Result<Tensor> {
    const WHAT: &str = "all_gather_columns";
    let first = check_parts(parts, WHAT, true)?;
    let last = first
        .rank()
        .checked_sub(1)
        .ok_or_else(|| ShardError::BadInput {
            what: WHAT,
            reason: "parts are scalars; expected [..., n_r]".to_string(),
        })?;
    let shard = Shard::new(parts.len() - 1, parts.len())?;
    let mut per = Vec::with_capacity(members.len());
    for (i, &m) in members.iter().enumerate() {
        per.push(shard.per_rank(&format!("fused member {i} rows"), m)?);
    }
    let width = per
        .iter()
        .try_fold(0usize, |a, &p| a.checked_add(p))
        .ok_or_else(|| ShardError::BadInput {
            what: WHAT,
            reason: format!("member row counts {members:?} overflow"),
        })?;
    for (r, p) in parts.iter().enumerate() {
        if p.dim(last)? != width || members.is_empty() {
            Err(ShardError::BadInput {
                what: WHAT,
                reason: format!(
                    "part {r} has shape {:?}; members {members:?} over {} ranks need a last dim of {width}",
                    p.dims(),
                    parts.len()
                ),
            })?
        }
    }
    let mut pieces = Vec::with_capacity(members.len() * parts.len());
    let mut offset = 0;
    for &w in &per {
        for p in parts {
            pieces.push(p.narrow(last, offset, w)?);
        }
        offset += w;
    }
    Tensor::cat(&pieces, last)
}

/// The ranks' `[..., n]` tensors side by side on the last dim (`[..., ranks·n]`) from an
/// all-gather's rank-major result `g` (`[ranks, ..., n]`, what NCCL writes): a reshape for
/// a single row, else one copy that puts each row's slices together.
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) fn rank_major_to_last(g: &Tensor) -> Result<Tensor> {
    let (ranks, part) = match g.dims().split_first() {
        Some((&r, part)) if !part.is_empty() => (r, part.to_vec()),
        _ => Err(ShardError::BadInput {
            what: "rank_major_to_last",
            reason: format!("shape {:?}: [ranks, ..., n] expected", g.dims()),
        })?,
    };
    let n = part[part.len() - 1];
    let rows = part[..part.len() - 1].iter().product::<usize>();
    let mut dims = part;
    let last = dims.len() - 1;
    dims[last] = n * ranks;
    if rows <= 1 || ranks == 1 {
        return g.reshape(dims);
    }
    g.reshape((ranks, rows, n))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape(dims)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn rank_major_result_is_laid_out_row_by_row() -> Result<()> {
        // Rank r's [2, 3, 4] holds 1000·r + its flat index; the joined [2, 3, 4·ranks]
        // row i must read rank 0's row i, then rank 1's, ...
        for ranks in 1..=3usize {
            let vals: Vec<f32> = (0..ranks)
                .flat_map(|r| (0..24).map(move |i| (1000 * r + i) as f32))
                .collect();
            let g = Tensor::from_vec(vals, (ranks, 2, 3, 4), &Device::Cpu)?;
            let got = rank_major_to_last(&g)?;
            assert_eq!(got.dims(), [2, 3, 4 * ranks]);
            let v = got.flatten_all()?.to_vec1::<f32>()?;
            let want: Vec<f32> = (0..6)
                .flat_map(|row| {
                    (0..ranks)
                        .flat_map(move |r| (0..4).map(move |j| (1000 * r + 4 * row + j) as f32))
                })
                .collect();
            assert_eq!(v, want, "{ranks} ranks");
        }
        // One row: a plain reshape; a rank-major tensor without parts is an error.
        let g = Tensor::from_vec(vec![1f32, 2., 3., 4.], (2, 1, 2), &Device::Cpu)?;
        assert_eq!(
            rank_major_to_last(&g)?.to_vec2::<f32>()?,
            [[1., 2., 3., 4.]]
        );
        assert!(rank_major_to_last(&Tensor::zeros(3, DType::F32, &Device::Cpu)?).is_err());
        Ok(())
    }
}
