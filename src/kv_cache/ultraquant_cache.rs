//! [`UltraQuantCache`]: one layer's FP4 KV cache in the UltraQuant slot layout.

use super::lengths::Lengths;
use super::ops::{make_plan, ExactWindow, KvAppend, KvAttention, PlanRef, UqRead, UqStore};
use super::rope_append;
use super::shape::{
    check_new_kv, check_query, check_room, AttnKnobs, CacheShape, KvCacheKind, SLOT_PADDING,
};
use crate::ultraquant::slot_size;
use candle_core::{bail, DType, Device, Result, Tensor};

/// UltraQuant FP4 KV cache of one layer: slots `[batch][capacity][kv_heads][slot]` in one
/// preallocated U8 tensor (see the [module docs](super)).
///
/// Optionally with an **exact window** ([`UltraQuantCache::with_window`]): the last `window`
/// tokens of each sequence are also kept in BF16 (a preallocated ring of `window` rows), and
/// attention and read-back use those exact values for them, the FP4 slots for older tokens.
/// Every token is still written to its slot at append, so the slots always hold the whole
/// sequence in the format.
///
/// No `Clone`: the storage is written in place, a shallow copy would alias it; see
/// [`try_clone`](Self::try_clone) and [`copy_seq`](Self::copy_seq).
#[derive(Debug)]
pub struct UltraQuantCache {
    pub(super) shape: CacheShape,
    pub(super) slot: usize,
    /// U8 `[batch · capacity · kv_heads · slot + SLOT_PADDING]`.
    pub(super) data: Tensor,
    pub(super) lens: Lengths,
    /// The kernels its ops launch (CUDA), resolved at construction.
    pub(super) plan: PlanRef,
    pub(super) window: Option<ExactWindow>,
}

impl UltraQuantCache {
    /// A zeroed cache with all lengths 0.
    ///
    /// Errors when a dimension is zero, `head_dim` is not a power of two and a multiple of
    /// 32 (on CUDA: not 64, 128 or 256), or the size overflows.
    pub fn new(shape: CacheShape, device: &Device) -> Result<Self> {
        const WHAT: &str = "UltraQuantCache::new";
        shape.check(WHAT, KvCacheKind::UltraQuant, device)?;
        let slot = slot_size(shape.head_dim, None)?;
        let bytes = shape.elems(WHAT, slot)?.checked_add(SLOT_PADDING);
        let Some(bytes) = bytes else {
            bail!("{WHAT}: cache size overflows usize")
        };
        super::shape::check_alloc(WHAT, bytes, 1, device)?;
        let data = Tensor::zeros(bytes, DType::U8, device)?;
        Ok(Self {
            shape,
            slot,
            data,
            lens: Lengths::zeros(shape.batch, device)?,
            plan: make_plan(KvCacheKind::UltraQuant, &shape, false, device)?,
            window: None,
        })
    }

    /// A cache whose last `window` tokens per sequence are kept exact in BF16 (see the type
    /// docs); `window = 0` is [`UltraQuantCache::new`]. Costs `4 · window · kv_heads ·
    /// head_dim` bytes per sequence more. Errors as `new`, and when `window` exceeds the
    /// capacity.
    pub fn with_window(shape: CacheShape, window: usize, device: &Device) -> Result<Self> {
        const WHAT_W: &str = "UltraQuantCache::with_window";
        let mut c = Self::new(shape, device)?;
        if window > shape.capacity {
            bail!(
                "UltraQuantCache::with_window: window {window} exceeds the capacity {}",
                shape.capacity
            )
        }
        if window > 0 {
            let ring_elems = crate::error::checked_product(
                WHAT_W,
                &[2, shape.batch, window, shape.kv_heads, shape.head_dim],
            )?;
            super::shape::check_alloc(WHAT_W, ring_elems, 2, device)?;
            let ring = Tensor::zeros(
                (2, shape.batch, window, shape.kv_heads, shape.head_dim),
                DType::BF16,
                device,
            )?;
            c.window = Some(ExactWindow { size: window, ring });
            c.plan = make_plan(KvCacheKind::UltraQuant, &shape, true, device)?;
        }
        Ok(c)
    }

    /// Tokens per sequence kept exact in BF16 (0: none).
    pub fn window(&self) -> usize {
        self.window.as_ref().map_or(0, |w| w.size)
    }
    /// The cache's dimensions.
    pub fn shape(&self) -> CacheShape {
        self.shape
    }

    /// Bytes per (token, head) slot: 68, 136, 272 at head_dim 64, 128, 256.
    pub fn slot_size(&self) -> usize {
        self.slot
    }

    /// Cache bytes per token per layer: `kv_heads · slot` (the exact window's fixed
    /// `4 · window · kv_heads · head_dim` bytes per sequence not included).
    pub fn bytes_per_token(&self) -> usize {
        self.shape.kv_heads * self.slot
    }

    /// The device the cache lives on.
    pub fn device(&self) -> &Device {
        self.data.device()
    }

    /// Tokens held by each sequence.
    pub fn lens(&self) -> &[usize] {
        &self.lens.host
    }

    /// The lengths as a U32 `[batch]` tensor on the cache's device (what the kernels read).
    pub fn lens_tensor(&self) -> &Tensor {
        &self.lens.dev
    }

    /// The slot bytes as a U8 `[batch, capacity, kv_heads, slot]` view (no copy).
    pub fn slots(&self) -> Result<Tensor> {
        let CacheShape {
            batch,
            capacity,
            kv_heads,
            ..
        } = self.shape;
        self.data
            .narrow(0, 0, batch * capacity * kv_heads * self.slot)?
            .reshape((batch, capacity, kv_heads, self.slot))
    }

    /// Appends BF16 `k`, `v` `[batch, tokens, kv_heads, head_dim]` (or `[tokens, kv_heads,
    /// head_dim]` for batch 1) to every sequence: K rotated, K and V quantized, written at
    /// each sequence's length. Errors, writing nothing, on overflow or bad inputs.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        const WHAT: &str = "UltraQuantCache::append";
        let tokens = check_new_kv(WHAT, k, v, &self.shape, self.shape.batch, self.device())?;
        check_room(WHAT, &self.lens.host, 0, tokens, self.shape.capacity)?;
        self.store(0, self.lens.host.clone(), tokens, k, v)
    }

    /// Appends BF16 `k`, `v` `[tokens, kv_heads, head_dim]` to sequence `seq` only.
    pub fn append_seq(&mut self, seq: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        const WHAT: &str = "UltraQuantCache::append_seq";
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
        self.store(seq, vec![self.lens.host[seq]], tokens, k, v)
    }

    fn store(
        &mut self,
        seq_base: usize,
        starts: Vec<usize>,
        tokens: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        let op = UqStore {
            shape: self.shape,
            seq_base,
            starts: starts.clone(),
            tokens,
            lens_dev: self.lens.dev.clone(),
            plan: self.plan.clone(),
        };
        self.data.inplace_op3(&k, &v, &op)?;
        if let Some(w) = &self.window {
            for (i, &start) in starts.iter().enumerate() {
                let per_seq = |t: &Tensor| {
                    if t.rank() == 4 {
                        t.get(i)
                    } else {
                        Ok(t.clone())
                    }
                };
                write_ring(w, seq_base + i, start, &per_seq(&k)?, &per_seq(&v)?)?;
            }
        }
        self.lens
            .advance(&self.plan, seq_base, starts.len(), tokens)
    }

    /// Empties every sequence (the slots are overwritten by later appends).
    pub fn reset(&mut self) -> Result<()> {
        self.lens.reset(&self.plan)
    }

    /// Empties sequence `seq`.
    pub fn reset_seq(&mut self, seq: usize) -> Result<()> {
        self.lens
            .reset_seq(&self.plan, "UltraQuantCache::reset_seq", seq)
    }

    /// Sequence `seq` as BF16 `(k, v)`, each `[len, kv_heads, head_dim]`: dequantized, K
    /// rotated back (bit for bit `ultraquant::decode_slot_unrotated` rounded to BF16), but
    /// the exact window's tokens as stored.
    pub fn read_bf16(&self, seq: usize) -> Result<(Tensor, Tensor)> {
        if seq >= self.shape.batch {
            bail!(
                "UltraQuantCache::read_bf16: sequence {seq} out of range (batch {})",
                self.shape.batch
            )
        }
        let len = self.lens.host[seq];
        let Some(w) = &self.window else {
            return self.read_slots(seq, len);
        };
        let n_exact = len.min(w.size);
        let (kq, vq) = self.read_slots(seq, len - n_exact)?;
        let mut ks = vec![kq];
        let mut vs = vec![vq];
        // Ring rows of tokens len - n_exact .. len, in token order (at most two runs).
        let mut t = len - n_exact;
        while t < len {
            let row = t % w.size;
            let n = (w.size - row).min(len - t);
            ks.push(w.ring.get(0)?.get(seq)?.narrow(0, row, n)?);
            vs.push(w.ring.get(1)?.get(seq)?.narrow(0, row, n)?);
            t += n;
        }
        Ok((Tensor::cat(&ks, 0)?, Tensor::cat(&vs, 0)?))
    }

    /// Tokens `0..count` of sequence `seq` decoded from the slots.
    fn read_slots(&self, seq: usize, count: usize) -> Result<(Tensor, Tensor)> {
        let kv = if count == 0 {
            Tensor::zeros(
                (2, 0, self.shape.kv_heads, self.shape.head_dim),
                DType::BF16,
                self.device(),
            )?
        } else {
            self.data.apply_op1_no_bwd(&UqRead {
                shape: self.shape,
                seq,
                start: 0,
                count,
                plan: self.plan.clone(),
            })?
        };
        Ok((kv.get(0)?, kv.get(1)?))
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

    /// Appends one token per sequence, BF16 `k`, `v` `[batch, kv_heads, head_dim]`, at the
    /// lengths **on the device**: the store kernel (which reads its rows from the device
    /// lengths), the exact window's ring row by the decode-append kernel, then the lengths'
    /// in-place update; what a captured CUDA graph replays at every step. Errors, writing
    /// nothing, when a sequence is full (by the host lengths).
    pub fn append_decode(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        const WHAT: &str = "UltraQuantCache::append_decode";
        let sh = self.shape;
        super::shape::check_decode_kv(WHAT, k, v, &sh, self.device())?;
        check_room(WHAT, &self.lens.host, 0, 1, sh.capacity)?;
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        let op = UqStore {
            shape: sh,
            seq_base: 0,
            starts: self.lens.host.clone(),
            tokens: 1,
            lens_dev: self.lens.dev.clone(),
            plan: self.plan.clone(),
        };
        self.data.inplace_op3(&k, &v, &op)?;
        if let Some(w) = &self.window {
            let op = KvAppend {
                batch: sh.batch,
                rows: w.size,
                row_elems: sh.kv_heads * sh.head_dim,
                limit: sh.capacity,
                lens_dev: self.lens.dev.clone(),
                plan: self.plan.clone(),
            };
            w.ring.inplace_op3(&k, &v, &op)?;
        }
        self.lens.advance(&self.plan, 0, sh.batch, 1)
    }

    /// The decode step after the q|k|v projection in the attention launches (CUDA, a cache
    /// with an exact window): `qkv` BF16 `[batch, (q_heads + 2 · kv_heads) · head_dim]` at
    /// `positions` U32 `[batch]` → BF16 `[batch, q_heads, head_dim]`. The ring's kernel
    /// rotates q and k as `rope` does (bit for bit), writes the new k and v into the ring and
    /// attends over it; the UltraQuant kernel rotates q likewise, encodes the new token's slot
    /// as the store kernel does (bit for bit; no CTA of this step reads it, the ring holds
    /// the token) and attends over the tokens before the window; then the lengths advance.
    /// The same output, cache contents and lengths as [`QkvRope::forward`],
    /// [`append_decode`](Self::append_decode) of its k and v heads and
    /// [`decode_attention_with`](Self::decode_attention_with) on its q heads (or
    /// [`decode_attention_capacity_with`](Self::decode_attention_capacity_with) when
    /// `capacity_splits`), bit for bit, in two or three kernels (the two attention launches,
    /// and the combine kernel where it merges the splits) instead of six or seven. Errors,
    /// writing nothing, when a sequence is full or the cache has no exact window.
    ///
    /// [`QkvRope::forward`]: crate::rope::QkvRope::forward
    pub fn decode_rope_attention(
        &mut self,
        rope: &crate::rope::QkvRope,
        qkv: &Tensor,
        positions: &Tensor,
        opts: &AttnKnobs,
        capacity_splits: bool,
    ) -> Result<Tensor> {
        const WHAT: &str = "UltraQuantCache::decode_rope_attention";
        let sh = self.shape;
        if self.window.is_none() {
            bail!("{WHAT}: needs an exact window (the new token is attended from its ring)")
        }
        let (q_heads, rope) = rope_append::prepare(WHAT, rope, qkv, positions, &sh, &self.lens)?;
        let op = KvAttention {
            kind: KvCacheKind::UltraQuant,
            shape: sh,
            q_heads,
            max_len: rope_append::max_len(&sh, &self.lens, capacity_splits),
            opts: *opts,
            window: self.window.clone(),
            rope: Some(rope),
            plan: self.plan.clone(),
        };
        rope_append::run(&op, qkv, &self.data, &mut self.lens)
    }

    /// Sets the host copy of the lengths only (see [`Bf16Cache::set_host_lens`](super::Bf16Cache::set_host_lens)).
    pub fn set_host_lens(&mut self, lens: &[usize]) -> Result<()> {
        self.lens
            .set_host("UltraQuantCache::set_host_lens", lens, self.shape.capacity)
    }

    fn attention(&self, q: &Tensor, opts: &AttnKnobs, max_len: usize) -> Result<Tensor> {
        let q_heads = check_query(
            "UltraQuantCache::decode_attention",
            q,
            &self.shape,
            &self.lens.host,
            self.device(),
        )?;
        let op = KvAttention {
            kind: KvCacheKind::UltraQuant,
            shape: self.shape,
            q_heads,
            max_len,
            opts: *opts,
            window: self.window.clone(),
            rope: None,
            plan: self.plan.clone(),
        };
        q.contiguous()?
            .apply_op3_no_bwd(&self.data, &self.lens.dev, &op)
    }
}

/// Writes the last `min(tokens, size)` of `k`, `v` `[tokens, kv_heads, head_dim]`
/// (contiguous), tokens `start..start + tokens` of sequence `seq`, into the ring rows
/// `t % size` (at most two contiguous runs).
fn write_ring(w: &ExactWindow, seq: usize, start: usize, k: &Tensor, v: &Tensor) -> Result<()> {
    let tokens = k.dim(0)?;
    let skip = tokens.saturating_sub(w.size);
    let (rk, rv) = (w.ring.get(0)?.get(seq)?, w.ring.get(1)?.get(seq)?);
    let mut j = skip;
    while j < tokens {
        let row = (start + j) % w.size;
        let n = (w.size - row).min(tokens - j);
        rk.slice_set(&k.narrow(0, j, n)?.contiguous()?, 0, row)?;
        rv.slice_set(&v.narrow(0, j, n)?.contiguous()?, 0, row)?;
        j += n;
    }
    Ok(())
}
