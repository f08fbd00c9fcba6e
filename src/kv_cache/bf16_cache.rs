//! [`Bf16Cache`]: one layer's BF16 KV cache, the same interface as
//! [`UltraQuantCache`](super::UltraQuantCache).

use super::lengths::Lengths;
use super::ops::{make_plan, KvAppend, KvAttention, PlanRef};
use super::rope_append;
use super::shape::{
    check_decode_kv, check_new_kv, check_query, check_room, AttnKnobs, CacheShape, KvCacheKind,
};
use crate::rope::QkvRope;
use candle_core::{bail, DType, Device, Result, Tensor};

/// BF16 KV cache of one layer: K and V in one preallocated BF16 tensor
/// `[2, batch, capacity, kv_heads, head_dim]`, updated in place with `slice_set`.
///
/// No `Clone`: the storage is written in place, a shallow copy would alias it; see
/// [`try_clone`](Self::try_clone) and [`copy_seq`](Self::copy_seq).
#[derive(Debug)]
pub struct Bf16Cache {
    pub(super) shape: CacheShape,
    pub(super) kv: Tensor,
    pub(super) lens: Lengths,
    /// The kernels its ops launch (CUDA), resolved at construction.
    pub(super) plan: PlanRef,
}

impl Bf16Cache {
    /// A zeroed cache with all lengths 0. Errors when a dimension is zero, `head_dim` is odd
    /// (on CUDA: not 64, 80, 96, 128 or 256), or the size overflows.
    pub fn new(shape: CacheShape, device: &Device) -> Result<Self> {
        const WHAT: &str = "Bf16Cache::new";
        shape.check(WHAT, KvCacheKind::Bf16, device)?;
        let elems = shape.elems(WHAT, 2 * shape.head_dim)?;
        super::shape::check_alloc(WHAT, elems, 2, device)?;
        let CacheShape {
            batch,
            capacity,
            kv_heads,
            head_dim,
        } = shape;
        let kv = Tensor::zeros(
            (2, batch, capacity, kv_heads, head_dim),
            DType::BF16,
            device,
        )?;
        Ok(Self {
            shape,
            kv,
            lens: Lengths::zeros(batch, device)?,
            plan: make_plan(KvCacheKind::Bf16, &shape, false, device)?,
        })
    }

    /// The cache's dimensions.
    pub fn shape(&self) -> CacheShape {
        self.shape
    }

    /// Cache bytes per token per layer: `2 · kv_heads · head_dim · 2`.
    pub fn bytes_per_token(&self) -> usize {
        4 * self.shape.kv_heads * self.shape.head_dim
    }

    /// The device the cache lives on.
    pub fn device(&self) -> &Device {
        self.kv.device()
    }

    /// Tokens held by each sequence.
    pub fn lens(&self) -> &[usize] {
        &self.lens.host
    }

    /// The lengths as a U32 `[batch]` tensor on the cache's device.
    pub fn lens_tensor(&self) -> &Tensor {
        &self.lens.dev
    }

    /// The storage, BF16 `[2, batch, capacity, kv_heads, head_dim]` (K then V).
    pub fn storage(&self) -> &Tensor {
        &self.kv
    }

    /// Appends BF16 `k`, `v` `[batch, tokens, kv_heads, head_dim]` (or `[tokens, kv_heads,
    /// head_dim]` for batch 1) at each sequence's length. Errors, writing nothing, on
    /// overflow or bad inputs.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        const WHAT: &str = "Bf16Cache::append";
        let tokens = check_new_kv(WHAT, k, v, &self.shape, self.shape.batch, self.device())?;
        check_room(WHAT, &self.lens.host, 0, tokens, self.shape.capacity)?;
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        let per_seq = |t: &Tensor, b: usize| {
            if t.rank() == 4 {
                t.get(b)
            } else {
                Ok(t.clone())
            }
        };
        for b in 0..self.shape.batch {
            self.write(b, self.lens.host[b], &per_seq(&k, b)?, &per_seq(&v, b)?)?;
        }
        self.lens.advance(&self.plan, 0, self.shape.batch, tokens)
    }

    /// Appends BF16 `k`, `v` `[tokens, kv_heads, head_dim]` to sequence `seq` only.
    pub fn append_seq(&mut self, seq: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        const WHAT: &str = "Bf16Cache::append_seq";
        if seq >= self.shape.batch {
            bail!(
                "{WHAT}: sequence {seq} out of range (batch {})",
                self.shape.batch
            )
        }
        let tokens = check_new_kv(WHAT, k, v, &self.shape, 1, self.device())?;
        check_room(
            WHAT,
            &self.lens.host[seq..=seq],
            seq,
            tokens,
            self.shape.capacity,
        )?;
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        let (k, v) = if k.rank() == 4 {
            (k.get(0)?, v.get(0)?)
        } else {
            (k, v)
        };
        self.write(seq, self.lens.host[seq], &k, &v)?;
        self.lens.advance(&self.plan, seq, 1, tokens)
    }

    /// Appends one token per sequence, BF16 `k`, `v` `[batch, kv_heads, head_dim]`, at the
    /// lengths **on the device** (one kernel, then the lengths' in-place update): what a
    /// captured CUDA graph replays at every step. Errors, writing nothing, when a sequence is
    /// full (by the host lengths; see [`set_host_lens`](Self::set_host_lens)).
    pub fn append_decode(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        const WHAT: &str = "Bf16Cache::append_decode";
        let sh = self.shape;
        check_decode_kv(WHAT, k, v, &sh, self.device())?;
        check_room(WHAT, &self.lens.host, 0, 1, sh.capacity)?;
        let op = KvAppend {
            batch: sh.batch,
            rows: sh.capacity,
            row_elems: sh.kv_heads * sh.head_dim,
            limit: sh.capacity,
            lens_dev: self.lens.dev.clone(),
            plan: self.plan.clone(),
        };
        self.kv
            .inplace_op3(&k.contiguous()?, &v.contiguous()?, &op)?;
        self.lens.advance(&self.plan, 0, sh.batch, 1)
    }

    /// The decode step after the q|k|v projection in one attention launch (CUDA): `qkv`
    /// BF16 `[batch, (q_heads + 2 · kv_heads) · head_dim]` at `positions` U32 `[batch]` →
    /// BF16 `[batch, q_heads, head_dim]`. The attention kernel rotates q and k as `rope` does
    /// (bit for bit), stores the new k and v at the lengths on the device and attends over
    /// them; its split merge advances the lengths. The same output, cache contents and lengths
    /// as [`QkvRope::forward`], [`append_decode`](Self::append_decode) of its k and v heads
    /// and [`decode_attention_with`](Self::decode_attention_with) on its q heads (or
    /// [`decode_attention_capacity_with`](Self::decode_attention_capacity_with) when
    /// `capacity_splits`), bit for bit, in one kernel instead of four (measured on the H200
    /// against the rope with the append inside, the kernel before this one:
    /// docs/benchmarks.md, fourteenth session). Errors, writing nothing, when a sequence is
    /// full.
    pub fn decode_rope_attention(
        &mut self,
        rope: &QkvRope,
        qkv: &Tensor,
        positions: &Tensor,
        opts: &AttnKnobs,
        capacity_splits: bool,
    ) -> Result<Tensor> {
        const WHAT: &str = "Bf16Cache::decode_rope_attention";
        let sh = self.shape;
        let (q_heads, rope) = rope_append::prepare(WHAT, rope, qkv, positions, &sh, &self.lens)?;
        let op = KvAttention {
            kind: KvCacheKind::Bf16,
            shape: sh,
            q_heads,
            max_len: rope_append::max_len(&sh, &self.lens, capacity_splits),
            opts: *opts,
            window: None,
            rope: Some(rope),
            plan: self.plan.clone(),
        };
        rope_append::run(&op, qkv, &self.kv, &mut self.lens)
    }

    /// Sets the host copy of the lengths, leaving the device's as they are: after recording a
    /// CUDA graph that appends (recording runs no kernel, but the host copy advanced) and
    /// after each replay (a replay runs no host code, but the device lengths advanced).
    /// Errors on a wrong count or a length beyond the capacity.
    pub fn set_host_lens(&mut self, lens: &[usize]) -> Result<()> {
        self.lens
            .set_host("Bf16Cache::set_host_lens", lens, self.shape.capacity)
    }

    /// `k`, `v` `[tokens, kv_heads, head_dim]` (contiguous) into sequence `b` at `at`.
    fn write(&self, b: usize, at: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        self.kv.get(0)?.get(b)?.slice_set(k, 0, at)?;
        self.kv.get(1)?.get(b)?.slice_set(v, 0, at)
    }

    /// Empties every sequence.
    pub fn reset(&mut self) -> Result<()> {
        self.lens.reset(&self.plan)
    }

    /// Empties sequence `seq`.
    pub fn reset_seq(&mut self, seq: usize) -> Result<()> {
        self.lens.reset_seq(&self.plan, "Bf16Cache::reset_seq", seq)
    }

    /// Sequence `seq` as BF16 `(k, v)`, each `[len, kv_heads, head_dim]` (copies).
    pub fn read_bf16(&self, seq: usize) -> Result<(Tensor, Tensor)> {
        if seq >= self.shape.batch {
            bail!(
                "Bf16Cache::read_bf16: sequence {seq} out of range (batch {})",
                self.shape.batch
            )
        }
        let n = self.lens.host[seq];
        let k = self.kv.get(0)?.get(seq)?.narrow(0, 0, n)?.contiguous()?;
        let v = self.kv.get(1)?.get(seq)?.narrow(0, 0, n)?.contiguous()?;
        Ok((k, v))
    }

    /// Decode attention (see [`KvCache::decode_attention`](super::KvCache::decode_attention)).
    pub fn decode_attention(&self, q: &Tensor) -> Result<Tensor> {
        self.decode_attention_with(q, &AttnKnobs::default())
    }

    /// Decode attention with launch options.
    #[doc(hidden)]
    pub fn decode_attention_with(&self, q: &Tensor, opts: &AttnKnobs) -> Result<Tensor> {
        let max_len = self.lens.host.iter().copied().max().unwrap_or(0);
        self.attention(q, opts, max_len)
    }

    /// Decode attention whose splits are planned for the capacity (see
    /// [`KvCache::decode_attention_capacity`](super::KvCache::decode_attention_capacity)).
    pub fn decode_attention_capacity(&self, q: &Tensor) -> Result<Tensor> {
        self.decode_attention_capacity_with(q, &AttnKnobs::default())
    }

    /// [`decode_attention_capacity`](Self::decode_attention_capacity) with launch options.
    #[doc(hidden)]
    pub fn decode_attention_capacity_with(&self, q: &Tensor, opts: &AttnKnobs) -> Result<Tensor> {
        self.attention(q, opts, self.shape.capacity)
    }

    fn attention(&self, q: &Tensor, opts: &AttnKnobs, max_len: usize) -> Result<Tensor> {
        let q_heads = check_query(
            "Bf16Cache::decode_attention",
            q,
            &self.shape,
            &self.lens.host,
            self.device(),
        )?;
        let op = KvAttention {
            kind: KvCacheKind::Bf16,
            shape: self.shape,
            q_heads,
            max_len,
            opts: *opts,
            window: None,
            rope: None,
            plan: self.plan.clone(),
        };
        q.contiguous()?
            .apply_op3_no_bwd(&self.kv, &self.lens.dev, &op)
    }
}
