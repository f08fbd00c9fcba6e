//! [`AppendTarget`]: where the rope fused with the decode append stores the k and v heads
//! (its own file, so `cuda.rs` and `mod.rs` both import it without a child → parent edge).

use candle_core::Tensor;

/// Where [`QkvRope::forward_append`](super::QkvRope::forward_append) stores the k and v
/// heads (a BF16 KV cache's parts, see
/// [`Bf16Cache::append_decode_rope`](crate::kv_cache::Bf16Cache::append_decode_rope)).
#[derive(Debug, Clone, Copy)]
pub struct AppendTarget<'a> {
    /// BF16 `[2, batch, rows, kv_heads, head_dim]`: K, then V.
    pub kv: &'a Tensor,
    /// U32 `[batch]`: each sequence's length on the device (its next row, mod `rows`).
    pub lens: &'a Tensor,
    /// A sequence at this length or beyond is not written.
    pub limit: usize,
}
