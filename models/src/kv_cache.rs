//! The model's per-layer KV cache: [`candle_fp4::kv_cache::KvCache`] (preallocated, BF16
//! or UltraQuant FP4, `batch` sequences), behind the calls attention needs:
//!
//! * [`LayerCache::prefill`]: a chunk of `t > 1` tokens attends over the cached prefix
//!   read back (`read_bf16`: dequantized, K un-rotated) followed by its own **exact** K/V;
//!   the chunk is stored afterwards (the prefill semantics `candle_fp4::kv_cache`
//!   specifies: the quantization error enters at decode);
//! * [`LayerCache::decode`]: one token is stored first, then its query attends over
//!   everything cached, itself included (`decode_attention`: the CPU reference or the
//!   CUDA split-KV kernel);
//! * [`LayerCache::decode_batch`]: one token of every sequence at once, stored at the
//!   lengths held on the device (`append_decode`), so the step can be captured in a CUDA
//!   graph and replayed at every position.
//!
//! `prefill` and `decode` work on one sequence, [`LayerCache::sequence`] (0 by default).

use candle_core::{bail, DType, Device, Result, Tensor};
use candle_fp4::kv_cache::{AttnKnobs, CacheShape, KvCache, KvCacheKind};
use candle_fp4::rope::QkvRope;

/// One layer's cache.
#[derive(Debug)]
pub struct LayerCache {
    kind: KvCacheKind,
    inner: KvCache,
    n_kv: usize,
    head_dim: usize,
    /// The sequence `prefill` and `decode` work on.
    seq: usize,
    /// Launch options of `decode_batch`'s attention.
    decode_opts: AttnKnobs,
}

/// `[n_kv, t, d]` (any float dtype) → BF16 `[t, n_kv, d]`, the cache's layout.
fn token_major(x: &Tensor) -> Result<Tensor> {
    x.to_dtype(DType::BF16)?.transpose(0, 1)?.contiguous()
}

impl LayerCache {
    /// A cache for `batch` sequences of `capacity` tokens of `n_kv` heads of `head_dim`, on
    /// `device`; UltraQuant keeps the last `window` tokens (at most `capacity`) exact as well.
    pub fn new(
        kind: KvCacheKind,
        shape: (usize, usize, usize),
        capacity: usize,
        window: usize,
        device: &Device,
    ) -> Result<Self> {
        let (batch, n_kv, head_dim) = shape;
        let shape = CacheShape {
            batch,
            capacity,
            kv_heads: n_kv,
            head_dim,
        };
        Ok(Self {
            kind,
            inner: KvCache::with_window(kind, shape, window.min(capacity), device)?,
            n_kv,
            head_dim,
            seq: 0,
            decode_opts: AttnKnobs::default(),
        })
    }

    /// Sets the launch options of [`decode_batch`](Self::decode_batch)'s attention (a
    /// tuning knob; the default is the measured choice).
    pub fn set_decode_options(&mut self, opts: AttnKnobs) {
        self.decode_opts = opts;
    }

    /// Selects the sequence later `prefill` and `decode` calls work on.
    pub fn set_sequence(&mut self, seq: usize) -> Result<()> {
        let b = self.inner.shape().batch;
        if seq >= b {
            bail!("KV cache: sequence {seq} out of range (batch {b})")
        }
        self.seq = seq;
        Ok(())
    }

    /// Sequences the cache holds.
    pub fn batch(&self) -> usize {
        self.inner.shape().batch
    }

    /// The sequence `prefill` and `decode` work on.
    pub fn sequence(&self) -> usize {
        self.seq
    }

    /// Tokens stored in every sequence.
    pub fn lens(&self) -> &[usize] {
        self.inner.lens()
    }

    /// Benchmarks only: every sequence's length set without writing tokens
    /// ([`KvCache::bench_set_lens`]).
    #[doc(hidden)]
    pub fn bench_set_lens(&mut self, lens: &[usize]) -> Result<()> {
        self.inner.bench_set_lens(lens)
    }

    /// Sets the host copy of the lengths only ([`KvCache::set_host_lens`]).
    pub fn set_host_lens(&mut self, lens: &[usize]) -> Result<()> {
        self.inner.set_host_lens(lens)
    }

    /// One decode token of every sequence: stores `k`, `v` `[batch, n_kv, head_dim]` at the
    /// lengths held on the device, then attends `q` `[batch, q_heads, head_dim]` over each
    /// sequence; BF16 `[batch, q_heads, head_dim]`. `for_graph`: the attention's splits are
    /// planned for the capacity (the same launches at every length, what a captured graph
    /// replays); otherwise for the longest sequence.
    pub fn decode_batch(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        q: &Tensor,
        for_graph: bool,
    ) -> Result<Tensor> {
        let bf = |t: &Tensor| t.to_dtype(DType::BF16);
        self.inner.append_decode(&bf(k)?, &bf(v)?)?;
        self.attend(&bf(q)?, for_graph)
    }

    /// The decode attention of `q` over every sequence (`for_graph`: splits planned for the
    /// capacity).
    fn attend(&self, q: &Tensor, for_graph: bool) -> Result<Tensor> {
        if for_graph {
            self.inner
                .decode_attention_capacity_with(q, &self.decode_opts)
        } else {
            self.inner.decode_attention_with(q, &self.decode_opts)
        }
    }

    /// Whether [`decode_batch_rope`](Self::decode_batch_rope) runs here (a BF16 cache on
    /// CUDA, or an UltraQuant one with an exact window; not when the attention knobs turn
    /// it off).
    pub fn fuses_rope_append(&self) -> bool {
        self.inner.fuses_rope_append() && self.decode_opts.rope_append != Some(false)
    }

    /// [`decode_batch`](Self::decode_batch) from the fused `q|k|v` projection in the attention
    /// launches: the rope, the append and the attention ([`KvCache::decode_rope_attention`]; its
    /// split merge advances the lengths). Where [`fuses_rope_append`](Self::fuses_rope_append).
    pub fn decode_batch_rope(
        &mut self,
        rope: &QkvRope,
        qkv: &Tensor,
        positions: &Tensor,
        for_graph: bool,
    ) -> Result<Tensor> {
        self.inner
            .decode_rope_attention(rope, qkv, positions, &self.decode_opts, for_graph)
    }

    /// The cache's storage.
    pub fn kind(&self) -> KvCacheKind {
        self.kind
    }

    /// Tokens stored in the selected sequence.
    pub fn len(&self) -> usize {
        self.inner.lens()[self.seq]
    }

    /// Whether no token is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Empties the cache (every sequence).
    pub fn reset(&mut self) -> Result<()> {
        self.inner.reset()
    }

    /// Empties the selected sequence.
    pub fn reset_sequence(&mut self) -> Result<()> {
        self.inner.reset_seq(self.seq)
    }

    /// Bytes per token of the stored format (all heads, K and V).
    pub fn bytes_per_token(&self) -> usize {
        self.inner.bytes_per_token()
    }

    /// The underlying `candle_fp4` cache.
    pub fn inner(&self) -> &KvCache {
        &self.inner
    }

    fn check(&self, k: &Tensor, v: &Tensor) -> Result<usize> {
        let (n_kv, t, d) = k.dims3()?;
        if (n_kv, d) != (self.n_kv, self.head_dim) || v.dims() != k.dims() {
            bail!(
                "KV cache: got K {:?} / V {:?}, expected [{}, t, {}]",
                k.dims(),
                v.dims(),
                self.n_kv,
                self.head_dim
            );
        }
        Ok(t)
    }

    /// Prefill chunk: returns the K/V to attend over, BF16 `[n_kv, len + t, head_dim]`
    /// (the cached prefix read back, then `k`, `v` themselves), and stores `k`, `v`
    /// (`[n_kv, t, head_dim]`).
    pub fn prefill(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        self.check(k, v)?;
        let (kn, vn) = (k.to_dtype(DType::BF16)?, v.to_dtype(DType::BF16)?);
        let out = if self.is_empty() {
            (kn.clone(), vn.clone())
        } else {
            let (kp, vp) = self.inner.read_bf16(self.seq)?; // [len, n_kv, d]
            (
                Tensor::cat(&[&kp.transpose(0, 1)?, &kn], 1)?,
                Tensor::cat(&[&vp.transpose(0, 1)?, &vn], 1)?,
            )
        };
        self.inner
            .append_seq(self.seq, &token_major(&kn)?, &token_major(&vn)?)?;
        Ok(out)
    }

    /// Decode step: stores one token's `k`, `v` (`[n_kv, 1, head_dim]`), then attends
    /// `q` (`[q_heads, 1, head_dim]`) over the whole cache; BF16 `[q_heads, head_dim]`.
    pub fn decode(&mut self, k: &Tensor, v: &Tensor, q: &Tensor) -> Result<Tensor> {
        if self.check(k, v)? != 1 {
            bail!("KV cache: decode takes one token, got {}", k.dim(1)?);
        }
        if self.inner.shape().batch != 1 {
            bail!("KV cache: a single-sequence decode needs batch 1 (use decode_batch)")
        }
        self.inner.append(&token_major(k)?, &token_major(v)?)?;
        let q = q.to_dtype(DType::BF16)?.transpose(0, 1)?.contiguous()?; // [1, q_heads, d]
        self.inner.decode_attention(&q)?.squeeze(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// max |a − b| over all elements, in F32.
    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        (f(a) - f(b))
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    #[test]
    fn prefill_reads_back_the_prefix_and_keeps_the_chunk_exact() {
        let dev = Device::Cpu;
        let k = Tensor::randn(0f32, 1.0, (1, 4, 64), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (1, 4, 64), &dev).unwrap();
        for kind in [KvCacheKind::Bf16, KvCacheKind::UltraQuant] {
            let mut c = LayerCache::new(kind, (1, 1, 64), 8, 0, &dev).unwrap();
            c.prefill(&k.narrow(1, 0, 2).unwrap(), &v.narrow(1, 0, 2).unwrap())
                .unwrap();
            let (ka, va) = c
                .prefill(&k.narrow(1, 2, 2).unwrap(), &v.narrow(1, 2, 2).unwrap())
                .unwrap();
            assert_eq!((ka.dims(), c.len()), (&[1, 4, 64][..], 4));
            let exact = v.to_dtype(DType::BF16).unwrap();
            let d = max_diff;
            // The chunk's own rows are exact; the prefix is exact only for BF16.
            assert_eq!(
                d(
                    &va.narrow(1, 2, 2).unwrap(),
                    &exact.narrow(1, 2, 2).unwrap()
                ),
                0.0
            );
            let prefix_err = d(
                &va.narrow(1, 0, 2).unwrap(),
                &exact.narrow(1, 0, 2).unwrap(),
            );
            match kind {
                KvCacheKind::Bf16 => assert_eq!(prefix_err, 0.0),
                KvCacheKind::UltraQuant => assert!(prefix_err > 0.0 && prefix_err < 1.5),
            }
            // Decode attends over all 5 tokens.
            let q = Tensor::randn(0f32, 1.0, (3, 1, 64), &dev).unwrap();
            let y = c
                .decode(&k.narrow(1, 0, 1).unwrap(), &v.narrow(1, 0, 1).unwrap(), &q)
                .unwrap();
            assert_eq!((y.dims(), c.len()), (&[3, 64][..], 5));
        }
    }

    #[test]
    fn exact_window_keeps_the_newest_prefix_tokens_exact() {
        let dev = Device::Cpu;
        let k = Tensor::randn(0f32, 1.0, (1, 4, 64), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (1, 4, 64), &dev).unwrap();
        let mut c = LayerCache::new(KvCacheKind::UltraQuant, (1, 1, 64), 8, 1, &dev).unwrap();
        c.prefill(&k.narrow(1, 0, 2).unwrap(), &v.narrow(1, 0, 2).unwrap())
            .unwrap();
        let (_, va) = c
            .prefill(&k.narrow(1, 2, 2).unwrap(), &v.narrow(1, 2, 2).unwrap())
            .unwrap();
        let exact = v.to_dtype(DType::BF16).unwrap();
        let err = |i: usize| {
            max_diff(
                &va.narrow(1, i, 1).unwrap(),
                &exact.narrow(1, i, 1).unwrap(),
            )
        };
        // Token 1 is the window (exact), token 0 comes from its FP4 slot.
        assert!(err(0) > 0.0);
        assert_eq!(err(1), 0.0);
    }
}
