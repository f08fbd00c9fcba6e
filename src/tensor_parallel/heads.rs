//! [`HeadSplit`]: the attention heads one rank keeps, whole GQA groups.

use super::error::ShardError;
use super::shard::Shard;
use std::ops::Range;

/// The attention heads of one rank: `num_kv_heads / ranks` whole KV heads
/// (`[rank·kv/ranks, (rank+1)·kv/ranks)`) and exactly the query heads that attend to them
/// (query head `h` reads KV head `h / (num_heads / num_kv_heads)`), which is the even
/// split of the query heads. The row counts feed [`fused_column_nvfp4`] and the builders
/// (`q | k | v` members) and the rank's `o_proj` in-features.
///
/// [`fused_column_nvfp4`]: super::fused_column_nvfp4
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeadSplit {
    shard: Shard,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    q_rows: usize,
    kv_rows: usize,
}

impl HeadSplit {
    /// The split of `num_heads` query and `num_kv_heads` KV heads of `head_dim` values over
    /// `shard`'s group. Errors: a zero count, `num_heads` not a multiple of `num_kv_heads`
    /// ([`ShardError::BadHeads`]), `num_kv_heads` not divisible by the ranks
    /// ([`ShardError::NotDivisible`]: a rank must keep whole GQA groups), or a row count
    /// that overflows.
    pub fn new(
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        shard: Shard,
    ) -> Result<Self, ShardError> {
        let bad = || ShardError::BadHeads {
            num_heads,
            num_kv_heads,
            head_dim,
        };
        if num_heads == 0
            || num_kv_heads == 0
            || head_dim == 0
            || !num_heads.is_multiple_of(num_kv_heads)
        {
            return Err(bad());
        }
        shard.per_rank(
            "attention num_kv_heads (each rank keeps whole GQA groups)",
            num_kv_heads,
        )?;
        let q_rows = num_heads.checked_mul(head_dim).ok_or_else(bad)?;
        // num_kv_heads ≤ num_heads, so this fits when q_rows does.
        let kv_rows = num_kv_heads * head_dim;
        Ok(Self {
            shard,
            num_heads,
            num_kv_heads,
            head_dim,
            q_rows,
            kv_rows,
        })
    }

    /// The rank this split is for.
    pub fn shard(&self) -> Shard {
        self.shard
    }

    /// Values per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Query heads per KV head (the GQA group size).
    pub fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// The rank's query heads (`num_heads / ranks`).
    pub fn heads(&self) -> usize {
        self.num_heads / self.shard.ranks()
    }

    /// The rank's KV heads (`num_kv_heads / ranks`).
    pub fn kv_heads(&self) -> usize {
        self.num_kv_heads / self.shard.ranks()
    }

    /// The rank's query heads as indices of the unsharded model's heads.
    pub fn q_head_range(&self) -> Range<usize> {
        let per = self.heads();
        self.shard.rank() * per..(self.shard.rank() + 1) * per
    }

    /// The rank's KV heads as indices of the unsharded model's KV heads.
    pub fn kv_head_range(&self) -> Range<usize> {
        let per = self.kv_heads();
        self.shard.rank() * per..(self.shard.rank() + 1) * per
    }

    /// Row counts of the unsharded fused `q | k | v` layer's members:
    /// `[num_heads·head_dim, num_kv_heads·head_dim, num_kv_heads·head_dim]` (the `members`
    /// argument of the fused column split).
    pub fn qkv_members(&self) -> [usize; 3] {
        [self.q_rows, self.kv_rows, self.kv_rows]
    }

    /// Row counts of this rank's `q | k | v` layer's members:
    /// `[heads·head_dim, kv_heads·head_dim, kv_heads·head_dim]`.
    pub fn rank_qkv_rows(&self) -> [usize; 3] {
        let r = self.shard.ranks();
        [self.q_rows / r, self.kv_rows / r, self.kv_rows / r]
    }

    /// In-features of this rank's row-parallel `o_proj`: its query heads' values,
    /// `heads·head_dim` (the K columns `[rank·that, (rank+1)·that)` of the unsharded one).
    pub fn o_proj_in_features(&self) -> usize {
        self.q_rows / self.shard.ranks()
    }
}
