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

#[cfg(feature = "cuda")]
mod attention_cuda;
mod backends;
mod bf16_cache;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod fork;
mod lengths;
mod ops;
#[cfg(feature = "cuda")]
mod plan;
mod rope_append;
#[cfg(feature = "cuda")]
mod scratch;
mod shape;
mod ultraquant_cache;

pub use bf16_cache::Bf16Cache;
pub use cpu::{attention_cpu, KvSource};
pub use shape::{AttnKnobs, CacheShape, KvCacheKind, SLOT_PADDING};
pub use ultraquant_cache::UltraQuantCache;

use candle_core::{Device, Result, Tensor};

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

    /// Whether [`decode_rope_attention`](Self::decode_rope_attention) runs here: a cache on
    /// a CUDA device, BF16 or UltraQuant with an exact window (without one, the new token
    /// would be attended from the slot being written).
    pub fn fuses_rope_append(&self) -> bool {
        match self {
            Self::Bf16(c) => c.kv.device().is_cuda(),
            Self::UltraQuant(c) => c.data.device().is_cuda() && c.window.is_some(),
        }
    }

    /// [`Bf16Cache::decode_rope_attention`] or [`UltraQuantCache::decode_rope_attention`];
    /// an error where [`fuses_rope_append`](Self::fuses_rope_append) is false.
    pub fn decode_rope_attention(
        &mut self,
        rope: &crate::rope::QkvRope,
        qkv: &Tensor,
        positions: &Tensor,
        opts: &AttnKnobs,
        capacity_splits: bool,
    ) -> Result<Tensor> {
        match self {
            Self::Bf16(c) if c.kv.device().is_cuda() => {
                c.decode_rope_attention(rope, qkv, positions, opts, capacity_splits)
            }
            Self::UltraQuant(c) if c.data.device().is_cuda() => {
                c.decode_rope_attention(rope, qkv, positions, opts, capacity_splits)
            }
            _ => candle_core::bail!(
                "KvCache::decode_rope_attention: a cache on CUDA only (this is {:?} on {:?})",
                self.kind(),
                match self {
                    Self::Bf16(c) => c.device().location(),
                    Self::UltraQuant(c) => c.device().location(),
                }
            ),
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
        self.decode_attention_with(q, &AttnKnobs::default())
    }

    /// [`decode_attention`](Self::decode_attention) with launch options.
    #[doc(hidden)]
    pub fn decode_attention_with(&self, q: &Tensor, opts: &AttnKnobs) -> Result<Tensor> {
        match self {
            Self::Bf16(c) => c.decode_attention_with(q, opts),
            Self::UltraQuant(c) => c.decode_attention_with(q, opts),
        }
    }

    /// Appends one token per sequence, BF16 `k`, `v` `[batch, kv_heads, head_dim]`, at each
    /// sequence's length **as held on the device**: the kernels read their rows from the
    /// device lengths and update them in place, so the same launches, captured once in a
    /// CUDA graph, append at the right place at every replay. Same result as
    /// [`append`](Self::append) of one token. Errors, writing nothing, when a sequence is
    /// full by the host lengths (a graph's driver keeps those right with
    /// [`set_host_lens`](Self::set_host_lens)).
    pub fn append_decode(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        match self {
            Self::Bf16(c) => c.append_decode(k, v),
            Self::UltraQuant(c) => c.append_decode(k, v),
        }
    }

    /// [`decode_attention`](Self::decode_attention) with its split-KV plan made for the
    /// cache's **capacity** rather than the longest sequence: the kernels divide each
    /// sequence's actual length (read on the device) among the splits, so the same launches
    /// serve every length, which is what a captured CUDA graph replays. Same result up to the
    /// FP32 summation order of the split merge; at short lengths some splits are empty.
    pub fn decode_attention_capacity(&self, q: &Tensor) -> Result<Tensor> {
        self.decode_attention_capacity_with(q, &AttnKnobs::default())
    }

    /// [`decode_attention_capacity`](Self::decode_attention_capacity) with launch options.
    #[doc(hidden)]
    pub fn decode_attention_capacity_with(&self, q: &Tensor, opts: &AttnKnobs) -> Result<Tensor> {
        match self {
            Self::Bf16(c) => c.decode_attention_capacity_with(q, opts),
            Self::UltraQuant(c) => c.decode_attention_capacity_with(q, opts),
        }
    }

    /// Sets the host copy of the lengths, leaving the device's as they are: for the driver of
    /// a captured CUDA graph (recording a step runs no kernel, though the host lengths
    /// advanced; a replay runs no host code, though the device lengths advanced). Errors on
    /// a wrong count or a length beyond the capacity.
    pub fn set_host_lens(&mut self, lens: &[usize]) -> Result<()> {
        match self {
            Self::Bf16(c) => c.set_host_lens(lens),
            Self::UltraQuant(c) => c.set_host_lens(lens),
        }
    }

    /// Benchmarks only: sets every sequence's length to `lens` (device and host) without
    /// writing any token, so a decode benchmark runs at a long context without prefilling
    /// it; the tokens in between read as whatever the storage holds (zeros in a new cache).
    /// Not a rewind: the exact window's ring is left as it is. Errors on a wrong count or a
    /// length beyond the capacity.
    #[doc(hidden)]
    pub fn bench_set_lens(&mut self, lens: &[usize]) -> Result<()> {
        let cap = self.shape().capacity;
        self.set_host_lens(lens)?;
        for (seq, &n) in lens.iter().enumerate() {
            debug_assert!(n <= cap);
            match self {
                Self::Bf16(c) => c.lens.set_dev(&c.plan, seq, n)?,
                Self::UltraQuant(c) => c.lens.set_dev(&c.plan, seq, n)?,
            }
        }
        Ok(())
    }

    /// A deep copy of the cache (see [`Bf16Cache::try_clone`]); the cache types implement
    /// no `Clone`, which would share the storage.
    pub fn try_clone(&self) -> Result<Self> {
        Ok(match self {
            Self::Bf16(c) => Self::Bf16(c.try_clone()?),
            Self::UltraQuant(c) => Self::UltraQuant(c.try_clone()?),
        })
    }

    /// Makes sequence `dst` a copy of sequence `src` (beam search, a shared prefix); see
    /// [`Bf16Cache::copy_seq`].
    pub fn copy_seq(&mut self, src: usize, dst: usize) -> Result<()> {
        match self {
            Self::Bf16(c) => c.copy_seq(src, dst),
            Self::UltraQuant(c) => c.copy_seq(src, dst),
        }
    }
}
