//! A cache's dimensions and kind, the launch options of decode attention, and the checks
//! every cache runs on its inputs.

use crate::variants::kv_head_dims;
use candle_core::{bail, DType, Device, Result, Tensor};

/// Padding bytes after the last UltraQuant slot (the CUDA kernels read whole 16-byte chunks).
pub const SLOT_PADDING: usize = 16;

/// Which storage a [`KvCache`](super::KvCache) uses.
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

/// The exact window's launch order on the GPU ([`AttnKnobs::ring_first`] = `None`):
/// `true` = the BF16 ring kernel before the UltraQuant kernel, `false` = after it, where
/// (under PDL) its CTAs run beside the UltraQuant ones. That pays when they have room: on
/// the SMs the UltraQuant grid leaves free (`(sms - fp4_ctas) · ring_per_sm` CTAs), or in the
/// tail of a long UltraQuant launch (`fp4_tokens_per_cta`, the tokens of one split). Measured
/// on the H200 (docs/benchmarks.md, window 64, head_dim 128, 8 KV heads, 128 UltraQuant
/// CTAs): after is 4 µs faster at batch 1 (every context: 8 ring CTAs fit the 4 free SMs) and
/// 3–5 µs faster with ~8k tokens per split (batch 4 × 32k, batch 8 × 16k; 8,160–8,176
/// tokens); before is 1–2.5 µs faster at batch 4–8 with up to 2k tokens per split; ~4k per
/// split (batch 8 × 8k) is a tie. The threshold sits between the tie and the gain.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by kv_cache/attention_cuda.rs and the tests
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

/// Splits per (sequence, KV head) when the call does not force them: `floor(resident / base)`
/// (one wave of `resident` CTAs), but at most one per 16-token tile per warp (`by_len`). On
/// an UltraQuant cache (`fp4`), where that tile bound is at most 12: `min(cap, one wave, one
/// 64-token range each)`, `cap` 6 up to a bound of 8 and 7 from 9 to 12. Measured on the
/// H100, 8B b1 (docs/logs/s27/README.md call 10, docs/logs/s28/ call 2, docs/logs/s29/ call
/// 6, docs/logs/s30/ calls 1–2): six splits beat the tile bound's 2 at 512 context by
/// 18–39 µs per step, its 4 at 1k by 9–12 µs and its 8 at 2k by 18–33 µs (six splits and the
/// ring make 7 partials, merged by the combine kernel; 8 splits make 9, merged in the
/// kernel; seven tie with six at 2k, 1–7 µs apart). At 3k (bound 12) seven beat the bound's
/// 12 by 10–34 µs in four rounds, where six lose to it by 9–41 and eight by 6–13: seven
/// splits are the most whose partials (with the ring's: 8) still go to the combine kernel.
/// At 4k the tile bound's 16 beats 6, 7 and 12 (by 25–45, 25–45 and 5–19 µs): there the
/// wider grid wins, so the rule keeps it from a bound of 13 up (13–15 unmeasured). Batch 8
/// and up: one wave is at most 2 splits, unchanged. Measured at head_dim 128 (16 warps);
/// the 4- and 8-warp UltraQuant kernels (head_dim 256, wider token tiles) reach a bound of
/// 8 at shorter contexts and take the same rule unmeasured. With ≥ 4 warps the tile bound
/// never exceeds the 64-token ranges, so the rule only lowers bounds 7 and 8 (to six) and
/// 9 to 12 (to seven).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by kv_cache/attention_cuda.rs and the tests
pub(crate) fn auto_splits(
    max_len: usize,
    base_ctas: usize,
    resident_ctas: usize,
    nw: usize,
    fp4: bool,
) -> usize {
    let target = resident_ctas / base_ctas.max(1);
    let by_len = max_len.div_ceil(16 * nw);
    if fp4 && by_len <= 12 {
        let cap = if by_len <= 8 { 6 } else { 7 };
        return cap.min(target).min(max_len.div_ceil(64)).max(1);
    }
    target.min(by_len).max(1)
}

/// Whether the attention merges its splits in its own last CTA per head group (`true`) or
/// leaves them to `cfp4_kv_combine` when [`AttnKnobs::fused_merge`] is `None`, for a call
/// with `total` partials per head (its splits plus the exact window's ring's). Measured on
/// the H100 (docs/logs/s27/README.md, call 7): on an UltraQuant cache the combine kernel is
/// faster with 3–4 partials (8B b1 512 −16 µs per step, b8 512 −30 µs, SmolLM2 −2.4 %) and
/// slower with 17 (8B b1 32k +38 to +60 µs); the threshold sits between. On a BF16 cache the
/// combine kernel at every count measured (in-kernel: 8B b1 +50 to +60 µs per step,
/// twenty-sixth session; the 4-warp CTAs merge slowly).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by kv_cache/attention_cuda.rs and the tests
pub(crate) fn fused_merge_default(fp4: bool, total: usize) -> bool {
    fp4 && total > 8
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
        let fp4 = kind == KvCacheKind::UltraQuant;
        if device.is_cuda() && !kv_head_dims(fp4).any(|d| d == head_dim) {
            bail!(
                "{what}: the CUDA kernels of the {kind:?} cache support head_dim {:?}, got {head_dim}",
                kv_head_dims(fp4).collect::<Vec<_>>()
            )
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

/// Launch knobs of decode attention (part of [`Knobs`](crate::knobs::Knobs); CUDA only, the
/// CPU ignores them): they choose among launches that give the same result up to the FP32
/// order of the split merge, for the tests and benchmarks. The default is the measured
/// choice.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttnKnobs {
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
    /// The decode step's rope and KV append inside the attention launches
    /// ([`KvCache::decode_rope_attention`](super::KvCache::decode_rope_attention)) where the
    /// cache supports it; `Some(false)`: the rope kernel, the append and the attention one op
    /// each. Read by the callers that choose between the two (the models' decode step);
    /// `None` = fused.
    pub rope_append: Option<bool>,
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
/// Checks one decode token per sequence: BF16 `k`, `v` `[batch, kv_heads, head_dim]` on the
/// cache's device.
pub(crate) fn check_decode_kv(
    what: &str,
    k: &Tensor,
    v: &Tensor,
    shape: &CacheShape,
    device: &Device,
) -> Result<()> {
    let want = [shape.batch, shape.kv_heads, shape.head_dim];
    for (name, t) in [("k", k), ("v", v)] {
        if t.dtype() != DType::BF16 || t.dims() != want {
            bail!(
                "{what}: {name} must be BF16 {want:?}, got {:?} {:?}",
                t.dtype(),
                t.dims()
            )
        }
        if !t.device().same_device(device) {
            bail!(
                "{what}: {name} is on {:?} but the cache is on {:?}",
                t.device().location(),
                device.location()
            )
        }
    }
    Ok(())
}

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

#[cfg(test)]
mod tests {
    use super::{auto_splits, fused_merge_default, ring_first_default};

    #[test]
    fn split_rule() {
        // BF16 cache (4 warps, 3 CTAs per SM on 132 SMs), 8 KV heads: the tile bound at b1.
        assert_eq!(auto_splits(513, 8, 396, 4, false), 9);
        assert_eq!(auto_splits(32768, 8, 396, 4, false), 49);
        assert_eq!(auto_splits(513, 64, 396, 4, false), 6); // b8: one wave

        // UltraQuant (16 warps, one CTA per SM), exact window of 64: at least 6 at b1.
        assert_eq!(auto_splits(449, 8, 132, 16, true), 6); // 512: the tile bound says 2
        assert_eq!(auto_splits(961, 8, 132, 16, true), 6); // 1k: 4
        assert_eq!(auto_splits(1985, 8, 132, 16, true), 6); // 2k: the tile bound says 8
        assert_eq!(auto_splits(2048, 8, 132, 16, true), 6); // the bound's last 8
        assert_eq!(auto_splits(2049, 8, 132, 16, true), 7); // bound 9: seven
        assert_eq!(auto_splits(3009, 8, 132, 16, true), 7); // 3k: the tile bound says 12
        assert_eq!(auto_splits(3072, 8, 132, 16, true), 7); // the bound's last 12
        assert_eq!(auto_splits(3073, 8, 132, 16, true), 13); // past it: the tile bound
        assert_eq!(auto_splits(2049, 8, 48, 16, true), 6); // one wave caps seven too
        assert_eq!(auto_splits(4033, 8, 132, 16, true), 16); // 4k: the tile bound
        assert_eq!(auto_splits(32705, 8, 132, 16, true), 16); // 32k: one wave
        assert_eq!(auto_splits(449, 64, 132, 16, true), 2); // b8: one wave caps the floor
        assert_eq!(auto_splits(449, 256, 132, 16, true), 1); // b32
        assert_eq!(auto_splits(100, 8, 132, 16, true), 2); // 64-token ranges
        assert_eq!(auto_splits(0, 8, 132, 16, true), 1); // nothing before the window
        assert_eq!(auto_splits(10, 1000, 132, 16, false), 1);
    }

    #[test]
    fn merge_rule() {
        assert!(!fused_merge_default(true, 3)); // 8B b8 512: 2 splits + the ring
        assert!(!fused_merge_default(true, 4)); // 8B / SmolLM2 b1 512: 3 + 1
        assert!(!fused_merge_default(true, 8));
        assert!(fused_merge_default(true, 9));
        assert!(fused_merge_default(true, 17)); // 8B b1 32k: 16 + 1
        assert!(!fused_merge_default(false, 17)); // BF16: always the combine kernel
        assert!(!fused_merge_default(false, 1024));
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
