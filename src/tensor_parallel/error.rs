//! [`ShardError`]: why a tensor-parallel split or a CPU collective was refused.

/// Why a tensor-parallel split (or a CPU collective) was refused. Every message names the
/// offending values as given. Through a function returning `candle_core::Result` it travels
/// boxed as `candle_core::Error::Io` (as the crate's other typed errors do) and
/// [`crate::error::find`] digs it out again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShardError {
    /// `ranks = 0`.
    #[error("tensor parallel: ranks = 0 (rank {rank}); a split needs at least one rank")]
    NoRanks {
        /// The rank given with it.
        rank: usize,
    },
    /// `rank >= ranks`.
    #[error(
        "tensor parallel: rank {rank} is out of range for ranks = {ranks} (need rank < ranks)"
    )]
    RankOutOfRange {
        /// The rank given.
        rank: usize,
        /// The number of ranks given.
        ranks: usize,
    },
    /// A size split evenly over the ranks does not divide by them.
    #[error("tensor parallel: {what} = {size} does not divide by ranks = {ranks}")]
    NotDivisible {
        /// Which size, e.g. `column-parallel rows n`.
        what: String,
        /// The size.
        size: usize,
        /// The number of ranks.
        ranks: usize,
    },
    /// An NVFP4 row-parallel split whose per-rank K slice is not a whole number of scale
    /// blocks (`k` not a multiple of `ranks · block`).
    #[error(
        "tensor parallel: row-parallel NVFP4 split of k = {k} over ranks = {ranks}: each rank's \
         K slice must be a whole number of {block}-value scale blocks (k a multiple of {ranks}·{block})"
    )]
    NotBlockAligned {
        /// In-features of the layer.
        k: usize,
        /// The number of ranks.
        ranks: usize,
        /// The NVFP4 block size (16).
        block: usize,
    },
    /// Fused member row counts that are empty or do not add up to the layer's rows.
    #[error(
        "tensor parallel: fused member row counts {members:?} must be non-empty and sum to the layer's n = {n}"
    )]
    BadMembers {
        /// The member row counts given.
        members: Vec<usize>,
        /// Rows of the fused layer.
        n: usize,
    },
    /// Attention head counts that do not form GQA groups.
    #[error(
        "tensor parallel: attention num_heads = {num_heads}, num_kv_heads = {num_kv_heads}, \
         head_dim = {head_dim}: all must be positive and num_heads a multiple of num_kv_heads"
    )]
    BadHeads {
        /// Query heads.
        num_heads: usize,
        /// Key/value heads.
        num_kv_heads: usize,
        /// Values per head.
        head_dim: usize,
    },
    /// A weight, bias or tensor whose shape, dtype or buffer lengths do not fit the split.
    #[error("tensor parallel: {what}: {reason}")]
    BadInput {
        /// The function and argument.
        what: &'static str,
        /// What is wrong, with the values.
        reason: String,
    },
}

impl From<ShardError> for candle_core::Error {
    fn from(e: ShardError) -> Self {
        candle_core::Error::Io(std::io::Error::other(e))
    }
}
