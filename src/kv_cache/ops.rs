//! The caches' candle ops as data: the in-place UltraQuant store, the read-back, the
//! lengths update and decode attention, each with the cache's launch plan (CUDA). Their
//! forwards are in `backends.rs` (CPU: `cpu.rs`, CUDA: `cuda.rs`).

use super::shape::{AttnKnobs, CacheShape, KvCacheKind};
use candle_core::{Shape, Tensor};

/// What an op carries of its cache's plan: the CUDA kernels resolved when the cache was
/// made (`None` on the CPU); nothing without CUDA.
#[derive(Debug, Clone, Default)]
pub(crate) struct PlanRef {
    #[cfg(feature = "cuda")]
    pub(crate) cuda: Option<std::sync::Arc<super::plan::AttnPlan>>,
}

/// The plan of a cache of `kind` and `shape` on `device` (with an exact window or not):
/// on a GPU every kernel it will launch, resolved now.
#[cfg(feature = "cuda")]
pub(crate) fn make_plan(
    kind: KvCacheKind,
    shape: &CacheShape,
    window: bool,
    device: &candle_core::Device,
) -> candle_core::Result<PlanRef> {
    match device {
        candle_core::Device::Cuda(d) => Ok(PlanRef {
            cuda: Some(std::sync::Arc::new(super::plan::AttnPlan::new(
                d, kind, shape, window,
            )?)),
        }),
        _ => Ok(PlanRef::default()),
    }
}

/// The plan of a cache: nothing without CUDA.
#[cfg(not(feature = "cuda"))]
pub(crate) fn make_plan(
    _kind: KvCacheKind,
    _shape: &CacheShape,
    _window: bool,
    _device: &candle_core::Device,
) -> candle_core::Result<PlanRef> {
    Ok(PlanRef::default())
}

pub(crate) use crate::layout::contiguous_range as range;

/// In-place store of new K/V into the UltraQuant slots (`cache.inplace_op3(k, v, op)`).
#[derive(Debug, Clone)]
pub(crate) struct UqStore {
    pub shape: CacheShape,
    /// First sequence written; sequence `seq_base + i` writes at `starts[i]`.
    pub seq_base: usize,
    pub starts: Vec<usize>,
    pub tokens: usize,
    /// The lengths on the device before this append (`starts` as U32 `[batch]`); the CUDA
    /// kernel reads its write positions from it.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub lens_dev: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub plan: PlanRef,
}

/// Read-back of tokens `start..start + count` of sequence `seq`: BF16 `[2, count, kv_heads,
/// head_dim]` (K un-rotated, V).
#[derive(Debug, Clone)]
pub(crate) struct UqRead {
    pub shape: CacheShape,
    pub seq: usize,
    pub start: usize,
    pub count: usize,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub plan: PlanRef,
}

impl UqRead {
    pub(crate) fn out_shape(&self) -> Shape {
        Shape::from((2, self.count, self.shape.kv_heads, self.shape.head_dim))
    }
}

/// Decode attention: inputs `q` BF16 `[batch, q_heads, head_dim]`, the cache storage (U8
/// slots, or BF16 `[2, batch, capacity, kv_heads, head_dim]`), lengths U32 `[batch]`.
#[derive(Debug, Clone)]
pub(crate) struct KvAttention {
    pub kind: KvCacheKind,
    pub shape: CacheShape,
    pub q_heads: usize,
    /// The longest sequence (split heuristics on CUDA).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub max_len: usize,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub opts: AttnKnobs,
    /// UltraQuant only: the last `size` tokens of each sequence read exact from `ring`.
    pub window: Option<ExactWindow>,
    /// CUDA only (BF16 cache, or UltraQuant with an exact window): the decode step's rope
    /// and KV append done by the attention kernels themselves (`q` is then the raw q|k|v
    /// projection).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub rope: Option<RopeAppend>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub plan: PlanRef,
}

/// The rope and KV append inside the decode attention (`KvAttnParams` in
/// `kernels/ultraquant.cuh`): `q` is the raw q|k|v projection BF16 `[batch, (q_heads + 2 ·
/// kv_heads) · head_dim]`, the device lengths are those before the new token, and the
/// split merge (the combine kernel or the attention's last CTA; one split: the lengths kernel)
/// advances them after the attention.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct RopeAppend {
    /// U32 `[batch]`: each sequence's rope position.
    pub positions: Tensor,
    /// Device pointers of the rope's BF16 tables `[max_pos, head_dim / 2]` (held by its
    /// [`QkvRope`](crate::rope::QkvRope), which outlives the call).
    pub cos: u64,
    pub sin: u64,
    pub max_pos: usize,
    /// Launch with PDL: no host call wrote the cache's lengths or rows since the last
    /// fused step, so the kernel may read them before waiting for the previous kernel.
    pub pdl: bool,
}

/// In-place decode append (`dst.inplace_op3(k, v, op)`): one token per sequence, BF16 `k`,
/// `v` `[batch, kv_heads, head_dim]` into row `lens[b] % rows` of `dst` BF16 `[2, batch,
/// rows, kv_heads, head_dim]` (the BF16 cache: `rows = capacity`; the exact window's ring:
/// `rows = window`), rows read from the device lengths (`lens_dev`, before their update), so
/// a captured CUDA graph writes the right row at every replay. A sequence holding `limit`
/// tokens or more is not written.
#[derive(Debug, Clone)]
pub(crate) struct KvAppend {
    pub batch: usize,
    pub rows: usize,
    /// `kv_heads · head_dim`.
    pub row_elems: usize,
    pub limit: usize,
    pub lens_dev: Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub plan: PlanRef,
}

/// In-place update of the lengths tensor U32 `[batch]`: `lens[seq_base + i] = (add ? lens :
/// 0) + value` for `i < n_seq`.
#[derive(Debug, Clone)]
pub(crate) struct LensUpdate {
    pub seq_base: usize,
    pub n_seq: usize,
    pub value: usize,
    pub add: bool,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub plan: PlanRef,
}

/// The BF16 ring of an UltraQuant cache's exact window: `[2, batch, size, kv_heads,
/// head_dim]` (K unrotated, then V), token `t` of a sequence in row `t % size`.
#[derive(Debug, Clone)]
pub(crate) struct ExactWindow {
    pub size: usize,
    pub ring: Tensor,
}
