//! CPU forwards: UltraQuant store and read-back, and decode attention (the reference the
//! CUDA kernels are tested against).
//!
//! # Attention numerics (the oracle)
//!
//! Per (sequence `b`, query head `h`, KV head `h / G`), all in f32:
//! 1. `q = f32(q_bf16)`; UltraQuant: `q̃ = WHT(q)` ([`wht_inplace`], the store's rotation).
//! 2. K, V rows decoded exactly (UltraQuant: `e2m1 · s`, K left in the rotated basis; BF16:
//!    the stored values; UltraQuant with an exact window: the last `window` tokens are the
//!    BF16 ring's values, K unrotated).
//! 3. `s_t = (Σ_d q_d k_{t,d}) · f32(1/√D)`, the sum in ascending `d`, with `q̃` for rotated
//!    rows and `q` for unrotated ones.
//! 4. `m = max_t s_t`, `p_t = exp(s_t − m)`, `l = Σ_t p_t` (ascending `t`).
//! 5. `o_d = (Σ_t p_t v_{t,d}) / l`, rounded once to BF16 (nearest even).

use super::shape::CacheShape;
use crate::ultraquant::{decode_row, encode_slot, slot_size, wht_inplace};
use candle_core::{bail, Result};
use half::bf16;
use rayon::prelude::*;

/// Where [`attention_cpu`] reads K and V.
#[derive(Debug, Clone, Copy)]
pub enum KvSource<'a> {
    /// UltraQuant slot bytes `[batch][capacity][kv_heads][slot]` (K rotated; trailing
    /// padding allowed).
    UltraQuant(&'a [u8]),
    /// BF16 K and V, each `[batch][capacity][kv_heads][head_dim]`.
    Bf16 {
        /// K values.
        k: &'a [bf16],
        /// V values.
        v: &'a [bf16],
    },
    /// UltraQuant slots for all but the last `window` tokens of each sequence, which come
    /// exact from a BF16 ring (token `t` in row `t % window`).
    UltraQuantWindow {
        /// Slot bytes as in [`KvSource::UltraQuant`].
        slots: &'a [u8],
        /// Ring K (unrotated), `[batch][window][kv_heads][head_dim]`.
        k: &'a [bf16],
        /// Ring V, same shape.
        v: &'a [bf16],
        /// Ring rows per sequence (≥ 1).
        window: usize,
    },
}

/// Encodes `tokens` new tokens of sequences `seq_base + i` (`i < starts.len()`) at
/// positions `starts[i]..`: `k`, `v` BF16 `[starts.len()][tokens][kv_heads][head_dim]`.
pub(crate) fn store(
    data: &mut [u8],
    shape: &CacheShape,
    seq_base: usize,
    starts: &[usize],
    tokens: usize,
    k: &[bf16],
    v: &[bf16],
) -> Result<()> {
    let (kvh, d, cap) = (shape.kv_heads, shape.head_dim, shape.capacity);
    let slot = slot_size(d, None)?;
    let row_elems = tokens * kvh * d;
    if k.len() != starts.len() * row_elems || v.len() != k.len() {
        bail!(
            "kv_cache store: k/v hold {} / {} values, expected {}",
            k.len(),
            v.len(),
            starts.len() * row_elems
        )
    }
    for (i, &start) in starts.iter().enumerate() {
        let seq = seq_base + i;
        if seq >= shape.batch || start + tokens > cap {
            bail!(
                "kv_cache store: sequence {seq}, tokens {start}..{} outside the cache",
                start + tokens
            )
        }
        let a = (seq * cap + start) * kvh * slot;
        let b = a + tokens * kvh * slot;
        if b > data.len() {
            bail!(
                "kv_cache store: cache buffer of {} bytes is too small",
                data.len()
            )
        }
        let (ki, vi) = (
            &k[i * row_elems..(i + 1) * row_elems],
            &v[i * row_elems..(i + 1) * row_elems],
        );
        data[a..b]
            .par_chunks_mut(slot)
            .enumerate()
            .try_for_each(|(r, out)| {
                let kf: Vec<f32> = ki[r * d..(r + 1) * d].iter().map(|x| x.to_f32()).collect();
                let vf: Vec<f32> = vi[r * d..(r + 1) * d].iter().map(|x| x.to_f32()).collect();
                encode_slot(&kf, &vf, out)
            })?;
    }
    Ok(())
}

/// The CPU forward of [`KvAppend`](super::ops::KvAppend): sequence `b`'s row of `k`, `v`
/// (`[batch, row_elems]`) into row `lens[b] % rows` of `dst` (`[2, batch, rows, row_elems]`),
/// skipping sequences at `limit` or beyond (as the CUDA kernel).
pub(crate) fn append_rows(
    dst: &mut [bf16],
    k: &[bf16],
    v: &[bf16],
    lens: &[usize],
    op: &super::ops::KvAppend,
) -> Result<()> {
    const OP: &str = "KV decode append";
    let (batch, rows, re) = (op.batch, op.rows, op.row_elems);
    let half = batch * rows * re;
    if k.len() != batch * re || v.len() != batch * re || dst.len() != 2 * half {
        bail!(
            "{OP}: k {} / v {} / destination {} values, expected {} / {} / {}",
            k.len(),
            v.len(),
            dst.len(),
            batch * re,
            batch * re,
            2 * half
        )
    }
    if lens.len() != batch || rows == 0 {
        bail!(
            "{OP}: {} lengths for batch {batch}, {rows} rows",
            lens.len()
        )
    }
    for (b, &len) in lens.iter().enumerate() {
        if len >= op.limit {
            continue;
        }
        let at = (b * rows + len % rows) * re;
        dst[at..at + re].copy_from_slice(&k[b * re..(b + 1) * re]);
        dst[half + at..half + at + re].copy_from_slice(&v[b * re..(b + 1) * re]);
    }
    Ok(())
}

/// Decodes tokens `start..start + count` of sequence `seq` to BF16 `[2][count][kv_heads]
/// [head_dim]` (K un-rotated, then V).
pub(crate) fn read(
    data: &[u8],
    shape: &CacheShape,
    seq: usize,
    start: usize,
    count: usize,
) -> Result<Vec<bf16>> {
    let (kvh, d, cap) = (shape.kv_heads, shape.head_dim, shape.capacity);
    let slot = slot_size(d, None)?;
    if seq >= shape.batch || start + count > cap {
        bail!(
            "kv_cache read: sequence {seq}, tokens {start}..{} outside the cache",
            start + count
        )
    }
    let first = (seq * cap + start) * kvh;
    if (first + count * kvh) * slot > data.len() {
        bail!(
            "kv_cache read: cache buffer of {} bytes is too small",
            data.len()
        )
    }
    let n = count * kvh * d;
    let mut out = vec![bf16::ZERO; 2 * n];
    let (ok, ov) = out.split_at_mut(n);
    ok.par_chunks_mut(d)
        .zip(ov.par_chunks_mut(d))
        .enumerate()
        .try_for_each(|(r, (kr, vr))| {
            let s = &data[(first + r) * slot..(first + r + 1) * slot];
            let (mut kf, vf) = decode_halves(s, d)?;
            wht_inplace(&mut kf)?;
            for (o, x) in kr.iter_mut().zip(&kf) {
                *o = bf16::from_f32(*x);
            }
            for (o, x) in vr.iter_mut().zip(&vf) {
                *o = bf16::from_f32(*x);
            }
            Ok::<(), candle_core::Error>(())
        })?;
    Ok(out)
}

/// `(K rotated, V)` of one slot, exact.
fn decode_halves(slot: &[u8], d: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    let mut k = vec![0f32; d];
    let mut v = vec![0f32; d];
    decode_into(slot, d, &mut k, &mut v)?;
    Ok((k, v))
}

fn decode_into(slot: &[u8], d: usize, k: &mut [f32], v: &mut [f32]) -> Result<()> {
    let g = d / 32;
    let (kpart, vpart) = slot.split_at(d / 2 + g);
    decode_row(&kpart[..d / 2], &kpart[d / 2..], k)?;
    decode_row(&vpart[..d / 2], &vpart[d / 2..d / 2 + g], v)
}

/// Reference decode attention (numerics in the module docs): `q` BF16 `[batch][q_heads]
/// [head_dim]`, K/V from `src` with `lens[b]` tokens in sequence `b`; returns BF16
/// `[batch][q_heads][head_dim]`.
///
/// Errors when the sizes do not fit, `q_heads` is not a multiple of `kv_heads`, or a
/// sequence is empty or longer than the capacity.
pub fn attention_cpu(
    q: &[bf16],
    q_heads: usize,
    shape: &CacheShape,
    lens: &[usize],
    src: KvSource<'_>,
) -> Result<Vec<bf16>> {
    let CacheShape {
        batch,
        capacity,
        kv_heads,
        head_dim: d,
    } = *shape;
    if q_heads == 0 || kv_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
        bail!("attention_cpu: q_heads ({q_heads}) must be a positive multiple of kv_heads ({kv_heads})")
    }
    if q.len() != batch * q_heads * d || lens.len() != batch {
        bail!("attention_cpu: q has {} values and lens {} entries for batch {batch}, {q_heads} heads of {d}", q.len(), lens.len())
    }
    if let Some(b) = lens.iter().position(|&n| n == 0 || n > capacity) {
        bail!(
            "attention_cpu: sequence {b} has {} tokens (must be 1..={capacity})",
            lens[b]
        )
    }
    let n_rows = batch * capacity * kv_heads;
    let check_slots = |data: &[u8]| -> Result<()> {
        if data.len() < n_rows * slot_size(d, None)? {
            bail!(
                "attention_cpu: {} slot bytes are too few for {shape:?}",
                data.len()
            )
        }
        Ok(())
    };
    let rotate = match src {
        KvSource::UltraQuant(data) => {
            check_slots(data)?;
            true
        }
        KvSource::UltraQuantWindow {
            slots,
            k,
            v,
            window,
        } => {
            check_slots(slots)?;
            let ring = batch * window * kv_heads * d;
            if window == 0 || k.len() != ring || v.len() != ring {
                bail!(
                    "attention_cpu: the exact window ring holds {} / {} values, a window of \
                     {window} tokens for {shape:?} needs {ring} (window ≥ 1)",
                    k.len(),
                    v.len()
                )
            }
            true
        }
        KvSource::Bf16 { k, v } => {
            if k.len() != n_rows * d || v.len() != n_rows * d {
                bail!(
                    "attention_cpu: BF16 K/V hold {} / {} values, {shape:?} needs {}",
                    k.len(),
                    v.len(),
                    n_rows * d
                )
            }
            false
        }
    };
    let group = q_heads / kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let tasks: Vec<(usize, usize)> = (0..batch)
        .flat_map(|b| (0..kv_heads).map(move |h| (b, h)))
        .collect();
    let outs: Vec<Vec<bf16>> = tasks
        .par_iter()
        .map(|&(b, kh)| {
            let n = lens[b];
            let (kr, vr, n_rot) = gather_rows(src, shape, b, kh, n)?;
            let mut out = Vec::with_capacity(group * d);
            for gi in 0..group {
                let qh = kh * group + gi;
                let qv: Vec<f32> = q[(b * q_heads + qh) * d..][..d]
                    .iter()
                    .map(|x| x.to_f32())
                    .collect();
                let mut qr = qv.clone();
                if rotate {
                    wht_inplace(&mut qr)?;
                }
                out.extend(attend_one(&qr, &qv, n_rot, &kr, &vr, n, d, scale));
            }
            Ok(out)
        })
        .collect::<Result<_>>()?;
    let mut out = vec![bf16::ZERO; batch * q_heads * d];
    for ((b, kh), o) in tasks.into_iter().zip(outs) {
        let at = (b * q_heads + kh * group) * d;
        out[at..at + group * d].copy_from_slice(&o);
    }
    Ok(out)
}

/// K and V rows (f32, `[n][d]` each) of KV head `kh` of sequence `b`, and how many of the
/// first rows hold K in the rotated basis (the rest are unrotated).
fn gather_rows(
    src: KvSource<'_>,
    shape: &CacheShape,
    b: usize,
    kh: usize,
    n: usize,
) -> Result<(Vec<f32>, Vec<f32>, usize)> {
    let d = shape.head_dim;
    let row = |t: usize| (b * shape.capacity + t) * shape.kv_heads + kh;
    let mut kr = vec![0f32; n * d];
    let mut vr = vec![0f32; n * d];
    let bf16_rows = |k: &[bf16],
                     v: &[bf16],
                     at: &dyn Fn(usize) -> usize,
                     kr: &mut [f32],
                     vr: &mut [f32],
                     t0: usize| {
        for (i, (kt, vt)) in kr
            .chunks_exact_mut(d)
            .zip(vr.chunks_exact_mut(d))
            .enumerate()
        {
            let r = at(t0 + i);
            for (o, x) in kt.iter_mut().zip(&k[r * d..][..d]) {
                *o = x.to_f32();
            }
            for (o, x) in vt.iter_mut().zip(&v[r * d..][..d]) {
                *o = x.to_f32();
            }
        }
    };
    let slot_rows = |data: &[u8], kr: &mut [f32], vr: &mut [f32]| -> Result<()> {
        let slot = slot_size(d, None)?;
        for (t, (kt, vt)) in kr
            .chunks_exact_mut(d)
            .zip(vr.chunks_exact_mut(d))
            .enumerate()
        {
            decode_into(&data[row(t) * slot..][..slot], d, kt, vt)?;
        }
        Ok(())
    };
    let n_rot = match src {
        KvSource::UltraQuant(data) => {
            slot_rows(data, &mut kr, &mut vr)?;
            n
        }
        KvSource::Bf16 { k, v } => {
            bf16_rows(k, v, &row, &mut kr, &mut vr, 0);
            0
        }
        KvSource::UltraQuantWindow {
            slots,
            k,
            v,
            window,
        } => {
            let n_rot = n.saturating_sub(window);
            let (kq, ke) = kr.split_at_mut(n_rot * d);
            let (vq, ve) = vr.split_at_mut(n_rot * d);
            slot_rows(slots, kq, vq)?;
            let ring = |t: usize| (b * window + t % window) * shape.kv_heads + kh;
            bf16_rows(k, v, &ring, ke, ve, n_rot);
            n_rot
        }
    };
    Ok((kr, vr, n_rot))
}

/// Steps 3–5 of the module docs for one query: `q_rot` against the first `n_rot` rows of
/// `k` (rotated basis), `q` against the rest.
#[allow(clippy::too_many_arguments)]
fn attend_one(
    q_rot: &[f32],
    q: &[f32],
    n_rot: usize,
    k: &[f32],
    v: &[f32],
    n: usize,
    d: usize,
    scale: f32,
) -> Vec<bf16> {
    let s: Vec<f32> = k
        .chunks_exact(d)
        .enumerate()
        .map(|(t, kt)| {
            let qq = if t < n_rot { q_rot } else { q };
            kt.iter().zip(qq).fold(0f32, |acc, (a, b)| acc + a * b) * scale
        })
        .collect();
    let m = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let p: Vec<f32> = s.iter().map(|&x| (x - m).exp()).collect();
    let l: f32 = p.iter().sum();
    let mut o = vec![0f32; d];
    for (pt, vt) in p.iter().zip(v.chunks_exact(d)).take(n) {
        for (oi, vi) in o.iter_mut().zip(vt) {
            *oi += pt * vi;
        }
    }
    o.iter().map(|x| bf16::from_f32(x / l)).collect()
}
