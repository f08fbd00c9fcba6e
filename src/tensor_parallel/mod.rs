//! Tensor parallelism, the CPU half: how a Megatron-style split shards each layer of a
//! Llama block over `ranks` GPUs, and CPU references of the collectives it needs. No
//! communication happens here; a decode over NCCL builds its layers with these functions
//! and checks its numerics against [`all_reduce_sum`].
//!
//! # The split (Megatron-LM)
//!
//! A block is two pairs of layers, each a column-parallel layer followed by a row-parallel
//! one, so that activations between them never leave their rank:
//!
//! ```text
//!            x (replicated)                              h (replicated)
//!               │                                           │
//!    q|k|v  column-parallel: rank r keeps        gate|up  column-parallel: rank r keeps
//!           its heads' rows [q_r | k_r | v_r]             [gate_r | up_r] (+ silu·mul)
//!               │  attention over the rank's                │
//!               │  heads only (whole GQA groups)            │
//!    o_proj row-parallel: K columns of the       down_proj row-parallel: K columns
//!           rank's heads, bias on rank 0                  [r·i/ranks, …), bias on rank 0
//!               │                                           │
//!          all-reduce (sum) ──► x + attn             all-reduce (sum) ──► h + mlp
//! ```
//!
//! * **Column-parallel** ([`column_nvfp4`], [`column_tensor`], [`column_parallel`]): the
//!   output rows `N` are split, rank `r` keeps rows `[r·N/ranks, (r+1)·N/ranks)`. Every
//!   output element comes from one row, so the ranks' outputs side by side
//!   ([`all_gather_columns`]) are the unsharded layer's output: bit for bit where the
//!   kernel's summation order depends on K alone (the CPU GEMV), within the layer's
//!   rounding bound where it also depends on N (candle's CPU matmul blocks K by M and N;
//!   on a GPU the tuned table picks the path, tile and K split per N). Fused layers
//!   ([`fused_column_nvfp4`], [`fused_column_parallel`]) split each member on its own and
//!   fuse the rank's slices again: `q | k | v` by [`HeadSplit`] (a rank keeps whole KV
//!   heads and the query heads that read them), `gate | up` as `[gate_r | up_r]`, which
//!   keeps the GEMV's `silu_mul` epilogue.
//! * **Row-parallel** ([`row_nvfp4`], [`row_tensor`], [`row_parallel`]): the input
//!   columns `K` are split, each rank computes a partial sum of the full output over its
//!   columns, and an all-reduce adds them. The bias stays on rank 0 so it is added once.
//!   NVFP4 splits on whole 16-value scale blocks (`K` a multiple of `ranks·16`); the
//!   global scale is shared. Each partial is rounded to BF16 by its GEMV and the sum once
//!   more, so a row-parallel output differs from the unsharded one by a few BF16
//!   roundings (the bound is derived in `tests/tensor_parallel.rs`).
//!
//! * **Vocabulary-parallel `lm_head`** ([`vocab_parallel`]): where the vocabulary divides by
//!   the ranks, each rank keeps its slice of the `lm_head` rows (a column-parallel layer),
//!   computes that slice of the logits, and an all-gather
//!   ([`AllReduce::all_gather_last`]) joins them, so each rank reads `1/ranks` of the
//!   largest single weight per token; otherwise the `lm_head` is replicated. The
//!   embeddings stay replicated (the gather of a token's row needs the whole table).
//!
//! Sizes that do not split (rows, heads, blocks) are a [`ShardError`], never a panic.
//!
//! # The collectives
//!
//! A model holds one [`AllReduce`] per rank and calls it after each row-parallel layer
//! (and after a vocabulary-parallel `lm_head`):
//! [`ThreadGroup`] (ranks as threads meeting in host memory: the CPU tests and
//! simulations) or, with the `nccl` feature, `NcclGroup` (one GPU per rank, NCCL's sum in
//! place on the candle stream, capturable in a CUDA graph).

mod collective;
mod error;
mod group;
mod heads;
mod layer;
#[cfg(feature = "nccl")]
mod nccl;
mod shard;
mod slice;

pub use collective::{all_gather_columns, all_reduce_sum};
pub use error::ShardError;
pub use group::{AllReduce, ThreadGroup};
pub use heads::HeadSplit;
pub use layer::{
    column_parallel, column_parallel_parts, fused_column_parallel, fused_column_parallel_parts,
    replicate, row_parallel, row_parallel_parts, vocab_parallel, FullWeight,
};
#[cfg(feature = "nccl")]
pub use nccl::{NcclGroup, NcclId};
pub use shard::Shard;
pub use slice::{
    column_nvfp4, column_tensor, fused_column_nvfp4, fused_column_tensor, row_nvfp4, row_tensor,
};
