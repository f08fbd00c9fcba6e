//! KV caches for candle models: UltraQuant FP4 ([`UltraQuantCache`]) or BF16
//! ([`Bf16Cache`]) behind one enum ([`KvCache`]), with decode attention.
//!
//! # Layout
//!
//! A cache holds one layer: `batch` sequences of up to `capacity` tokens, `kv_heads` heads of
//! `head_dim` values each, preallocated at construction and never reallocated. Each sequence
//! has its own length ([`KvCache::lens`]); appends write at each sequence's current length.
//!
//! * UltraQuant: one U8 tensor `[batch][capacity][kv_heads][slot]` (plus 16 padding bytes),
//!   one [`slot_size`](crate::ultraquant::slot_size) slot per (token, head) in the format of
//!   [`crate::ultraquant`]: K rotated by the normalized Walsh–Hadamard transform, then K and
//!   V quantized to E2M1 codes with one UE8M0 scale per 32 values. 136 bytes per (token,
//!   head) at `head_dim = 128`, against 512 for BF16 K+V (3.76× smaller).
//! * BF16: one BF16 tensor `[2][batch][capacity][kv_heads][head_dim]` (K then V).
//!
//! Both keep the lengths on the host and as a U32 tensor on the cache's device (the kernels
//! read it), refreshed after every append.
//!
//! # Decode attention
//!
//! [`KvCache::decode_attention`] takes `q` BF16 `[batch, q_heads, head_dim]` (`q_heads` a
//! multiple of `kv_heads`; query head `h` reads KV head `h / (q_heads / kv_heads)`) and
//! attends over each sequence's cached tokens with softmax scale `1/√head_dim`, FP32 math,
//! BF16 output `[batch, q_heads, head_dim]`. For UltraQuant the query is rotated by the same
//! transform as K, so `q·k` is unchanged. No mask beyond the lengths: a decode step appends
//! its token first, then attends over everything cached.
//!
//! # Exact window
//!
//! [`KvCache::with_window`] / [`UltraQuantCache::with_window`] keep the last `window` tokens
//! of each sequence in BF16 as well (a ring, like the recent-token window of KIVI): decode
//! attention and [`KvCache::read_bf16`] use those exact values and the FP4 slots only for
//! older tokens. A decode token then never attends over its own quantized K/V or its
//! neighbours', which is where FP4 costs the most quality (docs/accuracy.md: SmolLM2's
//! perplexity cost of the cache in pure decode). On CUDA the window is a second, small
//! launch of the BF16 kernel whose partials join the same split merge.
//!
//! The CPU forward is the reference the CUDA kernels are tested against (numerics in
//! `cpu.rs`); the CUDA forward is a split-KV flash-decoding kernel (`kernels/ultraquant.cu`).
//!
//! # Prefill
//!
//! Prefill attends over the **unquantized** K/V of the prompt (any causal attention, e.g.
//! candle's matmul + softmax or flash-attn) and then stores them with [`KvCache::append`]
//! (or [`KvCache::append_seq`] per sequence). Reasons: prefill is compute-bound, so FP4 K/V
//! would save no time there while a dedicated quantized prefill kernel would be a second
//! attention implementation to keep correct; and the prompt tokens then see exact K/V (the
//! quantization error enters only at decode, as with vLLM's FP8 KV caches). A chunked
//! prefill reads the cached prefix back with [`KvCache::read_bf16`] (dequantized, K
//! un-rotated) and attends over `[prefix; chunk]`.

mod bf16_cache;
mod cpu;
mod fork;
pub(crate) mod ops;
mod ultraquant_cache;

pub use bf16_cache::Bf16Cache;
pub use cpu::{attention_cpu, KvSource};
pub use ultraquant_cache::UltraQuantCache;

use candle_core::{bail, DType, Device, Result, Tensor};

/// Padding bytes after the last UltraQuant slot (the CUDA kernels read whole 16-byte chunks).
pub const SLOT_PADDING: usize = 16;

/// Which storage a [`KvCache`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvCacheKind {
    /// BF16 K and V.
    Bf16,
    /// UltraQuant FP4 slots (E2M1 + UE8M0 per 32, K Walsh–Hadamard rotated).
    UltraQuant,
}

/// Dimensions of one layer's cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheShape {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub capacity: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Values per head. UltraQuant: a power of two and a multiple of 32 (CUDA: 64, 128 or
    /// 256). BF16: even (CUDA: 64, 80, 96, 128 or 256).
    pub head_dim: usize,
}

/// The head_dims the CUDA kernels of a cache kind are compiled for (kernels/ultraquant.cu).
pub(crate) fn cuda_head_dims(kind: KvCacheKind) -> &'static [usize] {
    match kind {
        KvCacheKind::UltraQuant => &[64, 128, 256],
        KvCacheKind::Bf16 => &[64, 80, 96, 128, 256],
    }
}

/// The exact window's launch order on the GPU ([`DecodeOptions::ring_first`] = `None`):
/// `true` = the BF16 ring kernel before the UltraQuant kernel, `false` = after it, where
/// (under PDL) its CTAs run beside the UltraQuant ones. That pays when they have room: on
/// the SMs the UltraQuant grid leaves free (`(sms - fp4_ctas) · ring_per_sm` CTAs), or in the
/// tail of a long UltraQuant launch (`fp4_tokens_per_cta`, the tokens of one split). Measured
/// on the H200 (docs/benchmarks.md, window 64, head_dim 128, 8 KV heads, 128 UltraQuant
/// CTAs): after is 4 µs faster at batch 1 (every context: 8 ring CTAs fit the 4 free SMs) and
/// 3–5 µs faster with ~8k tokens per split (batch 4 × 32k, batch 8 × 16k; 8,160–8,176
/// tokens); before is 1–2.5 µs faster at batch 4–8 with up to 2k tokens per split; ~4k per
/// split (batch 8 × 8k) is a tie. The threshold sits between the tie and the gain.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by src/cuda/kv.rs and the tests
pub(crate) fn ring_first_default(
    fp4_ctas: usize,
    ring_ctas: usize,
    ring_per_sm: usize,
    sms: usize,
    fp4_tokens_per_cta: usize,
) -> bool {
    let free = sms.saturating_sub(fp4_ctas).saturating_mul(ring_per_sm);
    !(ring_ctas <= free || fp4_tokens_per_cta >= 6144)
}

/// KV heads per CTA of the row-streaming UltraQuant kernel (`RowsCfg::HB` in
/// kernels/ultraquant.cu).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by src/cuda/kv.rs and the tests
pub(crate) const ROW_STREAM_HEADS: usize = 8;

/// Whether decode attention can use the row-streaming UltraQuant kernel
/// ([`DecodeOptions::row_stream`]): an UltraQuant cache with head_dim 128, at most 4 query
/// heads per KV head (one head chunk), a multiple of [`ROW_STREAM_HEADS`] KV heads (a CTA
/// reads the contiguous slots of 8 adjacent heads of each token row), and an sm_90+ kernel
/// image (bulk copies and transaction-count mbarriers).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by src/cuda/kv.rs and the tests
pub(crate) fn row_stream_supported(
    ultraquant: bool,
    head_dim: usize,
    group: usize,
    kv_heads: usize,
    sm90: bool,
) -> bool {
    ultraquant
        && head_dim == 128
        && (1..=4).contains(&group)
        && kv_heads > 0
        && kv_heads.is_multiple_of(ROW_STREAM_HEADS)
        && sm90
}

impl CacheShape {
    /// Checks the dimensions for a cache of `kind` on `device` (`what` names the caller in
    /// errors).
    pub(crate) fn check(&self, what: &str, kind: KvCacheKind, device: &Device) -> Result<()> {
        let CacheShape {
            batch,
            capacity,
            kv_heads,
            head_dim,
        } = *self;
        if batch == 0 || capacity == 0 || kv_heads == 0 {
            bail!("{what}: batch ({batch}), capacity ({capacity}) and kv_heads ({kv_heads}) must be positive")
        }
        match kind {
            KvCacheKind::UltraQuant => {
                if !head_dim.is_power_of_two() || !head_dim.is_multiple_of(32) {
                    bail!("{what}: head_dim must be a power of two and a multiple of 32, got {head_dim}")
                }
            }
            KvCacheKind::Bf16 => {
                if head_dim == 0 || !head_dim.is_multiple_of(2) {
                    bail!("{what}: head_dim must be even and positive, got {head_dim}")
                }
            }
        }
        let cuda_dims = cuda_head_dims(kind);
        if device.is_cuda() && !cuda_dims.contains(&head_dim) {
            bail!("{what}: the CUDA kernels of the {kind:?} cache support head_dim {cuda_dims:?}, got {head_dim}")
        }
        let limit = i32::MAX as usize;
        if batch > limit || capacity > limit || kv_heads > limit {
            bail!("{what}: batch, capacity and kv_heads must fit in i32")
        }
        Ok(())
    }

    /// `batch · capacity · kv_heads · per_token_head`, or an error on overflow.
    pub(crate) fn elems(&self, what: &str, per_token_head: usize) -> Result<usize> {
        self.batch
            .checked_mul(self.capacity)
            .and_then(|n| n.checked_mul(self.kv_heads))
            .and_then(|n| n.checked_mul(per_token_head))
            .ok_or_else(|| candle_core::Error::Msg(format!("{what}: cache size overflows usize")))
    }
}

/// Checks that `elems` values of `elem_bytes` bytes can be allocated on the host before
/// an infallible allocation would abort (CPU only; CUDA allocations fail with an error).
pub(crate) fn check_alloc(
    what: &str,
    elems: usize,
    elem_bytes: u64,
    device: &Device,
) -> Result<()> {
    if device.is_cpu() {
        let bytes = crate::error::checked_mul(what, elems as u64, elem_bytes)?;
        crate::error::check_host_alloc(what, bytes)?;
    }
    Ok(())
}

/// Launch options of decode attention (CUDA only; the CPU ignores them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Token-range splits per (sequence, KV head); `None` = heuristic (as many CTAs as are
    /// resident at once on the GPU, at least two 16-token tiles per warp). Clamped to
    /// `1..=1024`.
    pub splits: Option<usize>,
    /// Merge the splits in the attention kernel (its last CTA per head group; no second
    /// kernel) instead of a separate combine kernel; `None` = the measured default.
    pub fused_merge: Option<bool>,
    /// Programmatic dependent launch (sm_90+): the kernels are queued while the previous
    /// kernel still runs and wait for it on the device; `None` = on.
    pub pdl: Option<bool>,
    /// UltraQuant cache with an exact window: launch the BF16 ring kernel before the
    /// UltraQuant kernel (`true`), or after it (`false`: under PDL it then runs beside the
    /// UltraQuant kernel on the SMs that kernel leaves free, and waits for it before
    /// exiting); `None` = the measured default.
    pub ring_first: Option<bool>,
    /// UltraQuant cache: `Some(true)` = the row-streaming kernel, where a CTA serves 8
    /// adjacent KV heads and streams their slots as whole token-row chunks with bulk copies
    /// (head_dim 128, at most 4 query heads per KV head, a multiple of 8 KV heads, sm_90+;
    /// elsewhere an error); its splits are merged by the combine kernel unless `fused_merge`
    /// asks otherwise (never with an exact window). `None` / `Some(false)` = the per-head
    /// kernel (one KV head per CTA), faster on the H200 at every measured point: the row
    /// stream's copy is faster, its math slower (docs/benchmarks.md).
    pub row_stream: Option<bool>,
}

/// Per-sequence lengths on the host and as a U32 tensor on the cache's device.
#[derive(Debug, Clone)]
pub(crate) struct Lengths {
    pub host: Vec<usize>,
    pub dev: Tensor,
}

impl Lengths {
    pub(crate) fn zeros(batch: usize, device: &Device) -> Result<Self> {
        Ok(Self {
            host: vec![0; batch],
            dev: Tensor::zeros(batch, DType::U32, device)?,
        })
    }

    /// Replaces the host lengths and refreshes the device copy.
    pub(crate) fn set(&mut self, host: Vec<usize>) -> Result<()> {
        let v: Vec<u32> = host.iter().map(|&n| n as u32).collect();
        self.dev = Tensor::from_vec(v, host.len(), self.dev.device())?;
        self.host = host;
        Ok(())
    }

    /// Empties every sequence.
    pub(crate) fn reset(&mut self) -> Result<()> {
        self.set(vec![0; self.host.len()])
    }

    /// Empties sequence `seq`; `what` names the caller in the out-of-range error.
    pub(crate) fn reset_seq(&mut self, what: &str, seq: usize) -> Result<()> {
        if seq >= self.host.len() {
            bail!(
                "{what}: sequence {seq} out of range (batch {})",
                self.host.len()
            )
        }
        let mut lens = self.host.clone();
        lens[seq] = 0;
        self.set(lens)
    }
}

/// Checks new K/V (`[batch, tokens, kv_heads, head_dim]`, or `[tokens, kv_heads, head_dim]`
/// when `n_seq == 1`) for an append of `n_seq` sequences; returns the token count.
pub(crate) fn check_new_kv(
    what: &str,
    k: &Tensor,
    v: &Tensor,
    shape: &CacheShape,
    n_seq: usize,
    device: &Device,
) -> Result<usize> {
    for (name, t) in [("k", k), ("v", v)] {
        if t.dtype() != DType::BF16 {
            bail!("{what}: {name} must be BF16, got {:?}", t.dtype())
        }
        if !t.device().same_device(device) {
            bail!(
                "{what}: {name} is on {:?} but the cache is on {:?}",
                t.device().location(),
                device.location()
            )
        }
    }
    if k.dims() != v.dims() {
        bail!(
            "{what}: k {:?} and v {:?} must have the same shape",
            k.dims(),
            v.dims()
        )
    }
    let (kh, d) = (shape.kv_heads, shape.head_dim);
    let tokens = match *k.dims() {
        [n, t, h, dd] if n == n_seq && h == kh && dd == d => t,
        [t, h, dd] if n_seq == 1 && h == kh && dd == d => t,
        ref dims => bail!("{what}: k/v must be [{n_seq}, tokens, {kh}, {d}] (or [tokens, {kh}, {d}] for one sequence), got {dims:?}"),
    };
    if tokens == 0 {
        bail!("{what}: k/v hold no tokens")
    }
    Ok(tokens)
}

/// Checks that `tokens` more fit after each of `lens` (capacity `cap`).
pub(crate) fn check_room(
    what: &str,
    lens: &[usize],
    first_seq: usize,
    tokens: usize,
    cap: usize,
) -> Result<()> {
    for (i, &n) in lens.iter().enumerate() {
        if n + tokens > cap {
            bail!(
                "{what}: sequence {} holds {n} tokens, {tokens} more exceed the capacity {cap}",
                first_seq + i
            )
        }
    }
    Ok(())
}

/// Checks `q` for decode attention; returns `q_heads`.
pub(crate) fn check_query(
    what: &str,
    q: &Tensor,
    shape: &CacheShape,
    lens: &[usize],
    device: &Device,
) -> Result<usize> {
    if q.dtype() != DType::BF16 {
        bail!("{what}: q must be BF16, got {:?}", q.dtype())
    }
    if !q.device().same_device(device) {
        bail!(
            "{what}: q is on {:?} but the cache is on {:?}",
            q.device().location(),
            device.location()
        )
    }
    let q_heads = match *q.dims() {
        [b, h, d] if b == shape.batch && d == shape.head_dim => h,
        ref dims => bail!(
            "{what}: q must be [{}, q_heads, {}], got {dims:?}",
            shape.batch,
            shape.head_dim
        ),
    };
    if q_heads == 0 || !q_heads.is_multiple_of(shape.kv_heads) {
        bail!(
            "{what}: q_heads ({q_heads}) must be a positive multiple of kv_heads ({})",
            shape.kv_heads
        )
    }
    if q_heads > i32::MAX as usize {
        bail!("{what}: q_heads must fit in i32")
    }
    if let Some(b) = lens.iter().position(|&n| n == 0) {
        bail!("{what}: sequence {b} is empty (append its K/V before attending)")
    }
    Ok(q_heads)
}

/// A KV cache of either kind, with the same interface, so models switch with one option.
/// No `Clone` (it would share storage written in place): [`KvCache::try_clone`].
#[derive(Debug)]
pub enum KvCache {
    /// BF16 storage.
    Bf16(Bf16Cache),
    /// UltraQuant FP4 storage.
    UltraQuant(UltraQuantCache),
}

impl KvCache {
    /// A zeroed cache of `kind` with `shape` on `device` (all lengths 0).
    pub fn new(kind: KvCacheKind, shape: CacheShape, device: &Device) -> Result<Self> {
        Ok(match kind {
            KvCacheKind::Bf16 => Self::Bf16(Bf16Cache::new(shape, device)?),
            KvCacheKind::UltraQuant => Self::UltraQuant(UltraQuantCache::new(shape, device)?),
        })
    }

    /// Like [`KvCache::new`], with an exact window of the last `window` tokens per sequence
    /// for UltraQuant ([`UltraQuantCache::with_window`]); the BF16 cache is exact already
    /// and ignores it.
    pub fn with_window(
        kind: KvCacheKind,
        shape: CacheShape,
        window: usize,
        device: &Device,
    ) -> Result<Self> {
        Ok(match kind {
            KvCacheKind::Bf16 => Self::Bf16(Bf16Cache::new(shape, device)?),
            KvCacheKind::UltraQuant => {
                Self::UltraQuant(UltraQuantCache::with_window(shape, window, device)?)
            }
        })
    }

    /// Tokens per sequence read exact although the cache is UltraQuant (0 for BF16).
    pub fn window(&self) -> usize {
        match self {
            Self::Bf16(_) => 0,
            Self::UltraQuant(c) => c.window(),
        }
    }

    /// The storage kind.
    pub fn kind(&self) -> KvCacheKind {
        match self {
            Self::Bf16(_) => KvCacheKind::Bf16,
            Self::UltraQuant(_) => KvCacheKind::UltraQuant,
        }
    }

    /// The cache's dimensions.
    pub fn shape(&self) -> CacheShape {
        match self {
            Self::Bf16(c) => c.shape(),
            Self::UltraQuant(c) => c.shape(),
        }
    }

    /// Tokens held by each sequence.
    pub fn lens(&self) -> &[usize] {
        match self {
            Self::Bf16(c) => c.lens(),
            Self::UltraQuant(c) => c.lens(),
        }
    }

    /// Cache bytes per token per layer (all KV heads, K and V).
    pub fn bytes_per_token(&self) -> usize {
        match self {
            Self::Bf16(c) => c.bytes_per_token(),
            Self::UltraQuant(c) => c.bytes_per_token(),
        }
    }

    /// Appends BF16 `k`, `v` `[batch, tokens, kv_heads, head_dim]` (or `[tokens, kv_heads,
    /// head_dim]` for batch 1) to every sequence at its current length. Errors (and writes
    /// nothing) when a sequence would overflow, or on a wrong dtype, shape or device.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        match self {
            Self::Bf16(c) => c.append(k, v),
            Self::UltraQuant(c) => c.append(k, v),
        }
    }

    /// Appends BF16 `k`, `v` `[tokens, kv_heads, head_dim]` to sequence `seq` only.
    pub fn append_seq(&mut self, seq: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        match self {
            Self::Bf16(c) => c.append_seq(seq, k, v),
            Self::UltraQuant(c) => c.append_seq(seq, k, v),
        }
    }

    /// Empties every sequence (the storage is kept and overwritten by later appends).
    pub fn reset(&mut self) -> Result<()> {
        match self {
            Self::Bf16(c) => c.reset(),
            Self::UltraQuant(c) => c.reset(),
        }
    }

    /// Empties sequence `seq`.
    pub fn reset_seq(&mut self, seq: usize) -> Result<()> {
        match self {
            Self::Bf16(c) => c.reset_seq(seq),
            Self::UltraQuant(c) => c.reset_seq(seq),
        }
    }

    /// Sequence `seq` read back as BF16 `(k, v)`, each `[len, kv_heads, head_dim]`
    /// (UltraQuant: dequantized, K un-rotated).
    pub fn read_bf16(&self, seq: usize) -> Result<(Tensor, Tensor)> {
        match self {
            Self::Bf16(c) => c.read_bf16(seq),
            Self::UltraQuant(c) => c.read_bf16(seq),
        }
    }

    /// Decode attention of `q` BF16 `[batch, q_heads, head_dim]` over the cached tokens;
    /// BF16 `[batch, q_heads, head_dim]`. See the module docs.
    pub fn decode_attention(&self, q: &Tensor) -> Result<Tensor> {
        self.decode_attention_with(q, &DecodeOptions::default())
    }

    /// [`decode_attention`](Self::decode_attention) with launch options.
    pub fn decode_attention_with(&self, q: &Tensor, opts: &DecodeOptions) -> Result<Tensor> {
        match self {
            Self::Bf16(c) => c.decode_attention_with(q, opts),
            Self::UltraQuant(c) => c.decode_attention_with(q, opts),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{ring_first_default, row_stream_supported};

    #[test]
    fn row_stream_rule() {
        assert!(row_stream_supported(true, 128, 4, 8, true)); // the benchmark shape
        assert!(row_stream_supported(true, 128, 1, 16, true));
        assert!(!row_stream_supported(false, 128, 4, 8, true)); // BF16 cache
        assert!(!row_stream_supported(true, 64, 4, 8, true)); // head_dim
        assert!(!row_stream_supported(true, 256, 4, 8, true));
        assert!(!row_stream_supported(true, 128, 5, 8, true)); // two head chunks
        assert!(!row_stream_supported(true, 128, 0, 8, true));
        assert!(!row_stream_supported(true, 128, 4, 4, true)); // KV heads
        assert!(!row_stream_supported(true, 128, 4, 12, true));
        assert!(!row_stream_supported(true, 128, 4, 0, true));
        assert!(!row_stream_supported(true, 128, 4, 8, false)); // sm_80 image
    }

    #[test]
    fn ring_order_rule() {
        // H200, 132 SMs, 128 UltraQuant CTAs, 3 ring CTAs per SM: 12 fit the free SMs.
        assert!(!ring_first_default(128, 8, 3, 132, 2048)); // batch 1: the ring fits
        assert!(!ring_first_default(128, 12, 3, 132, 256));
        assert!(ring_first_default(128, 13, 3, 132, 256)); // one CTA too many
        assert!(ring_first_default(128, 64, 3, 132, 512)); // batch 8, 1k
        assert!(ring_first_default(128, 64, 3, 132, 4064)); // batch 8, 8k: a tie, kept first
        assert!(!ring_first_default(128, 64, 3, 132, 8160)); // batch 8, 16k
        assert!(!ring_first_default(128, 32, 3, 132, 8176)); // batch 4, 32k
        assert!(ring_first_default(264, 8, 3, 132, 1024)); // no free SM (forced splits)
        assert!(!ring_first_default(264, 8, 3, 132, 1 << 20));
    }
}
