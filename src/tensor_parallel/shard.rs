//! [`Shard`]: one rank of a tensor-parallel group, and the even index ranges it owns.

use super::error::ShardError;
use std::ops::Range;

/// One rank of a tensor-parallel group of `ranks` ranks (`rank < ranks`, `ranks ≥ 1`).
///
/// The fields are private so that every `Shard` went through [`Shard::new`]; read them
/// with [`rank`](Self::rank) and [`ranks`](Self::ranks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shard {
    rank: usize,
    ranks: usize,
}

impl Shard {
    /// Rank `rank` of `ranks`: an error for `ranks = 0` or `rank ≥ ranks` (naming both).
    pub fn new(rank: usize, ranks: usize) -> Result<Self, ShardError> {
        if ranks == 0 {
            return Err(ShardError::NoRanks { rank });
        }
        if rank >= ranks {
            return Err(ShardError::RankOutOfRange { rank, ranks });
        }
        Ok(Self { rank, ranks })
    }

    /// The only rank of a group of one (no tensor parallelism).
    pub fn single() -> Self {
        Self { rank: 0, ranks: 1 }
    }

    /// Every rank of a group of `ranks`, in rank order (an error for `ranks = 0`).
    pub fn all(ranks: usize) -> Result<Vec<Self>, ShardError> {
        if ranks == 0 {
            return Err(ShardError::NoRanks { rank: 0 });
        }
        (0..ranks).map(|r| Self::new(r, ranks)).collect()
    }

    /// This rank's index, `0..ranks`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks in the group.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Whether this is rank 0 (the rank that keeps a row-parallel layer's bias).
    pub fn is_first(&self) -> bool {
        self.rank == 0
    }

    /// `total / ranks`, or [`ShardError::NotDivisible`] naming `what`, `total` and `ranks`.
    pub fn per_rank(&self, what: &str, total: usize) -> Result<usize, ShardError> {
        if !total.is_multiple_of(self.ranks) {
            return Err(ShardError::NotDivisible {
                what: what.to_string(),
                size: total,
                ranks: self.ranks,
            });
        }
        Ok(total / self.ranks)
    }

    /// This rank's part of `0..total` split evenly: `[rank·total/ranks, (rank+1)·total/ranks)`;
    /// `total` must divide by `ranks` (the error names `what`, `total` and `ranks`).
    pub fn split(&self, what: &str, total: usize) -> Result<Range<usize>, ShardError> {
        let per = self.per_rank(what, total)?;
        // rank < ranks, so (rank + 1)·per ≤ total: neither product overflows.
        let overflow = || ShardError::NotDivisible {
            what: what.to_string(),
            size: total,
            ranks: self.ranks,
        };
        let start = self.rank.checked_mul(per).ok_or_else(overflow)?;
        let end = start.checked_add(per).ok_or_else(overflow)?;
        Ok(start..end)
    }

    /// This rank's rows of a fused layer `[m₀ | m₁ | …]` with member row counts `members`
    /// (summing to `n`): each member split evenly on its own ([`split`](Self::split)), as
    /// ranges of the fused layer's rows in member order. Each member must divide by
    /// `ranks`; `members` must be non-empty and sum to `n`.
    pub fn split_fused(
        &self,
        members: &[usize],
        n: usize,
    ) -> Result<Vec<Range<usize>>, ShardError> {
        let bad = || ShardError::BadMembers {
            members: members.to_vec(),
            n,
        };
        if members.is_empty() {
            return Err(bad());
        }
        let mut offset = 0usize;
        let mut out = Vec::with_capacity(members.len());
        for (i, &rows) in members.iter().enumerate() {
            let r = self.split(&format!("fused member {i} rows"), rows)?;
            let next = offset.checked_add(rows).ok_or_else(bad)?;
            // r.end ≤ rows, so offset + r.end ≤ next: no overflow.
            out.push(offset + r.start..offset + r.end);
            offset = next;
        }
        if offset != n {
            return Err(bad());
        }
        Ok(out)
    }
}
