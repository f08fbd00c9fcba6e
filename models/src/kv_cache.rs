//! A preallocated per-layer KV cache: BF16, or UltraQuant FP4 (E2M1 codes + one UE8M0
//! scale per 32 values, K rotated by the Walsh–Hadamard transform).
//!
//! The model sees one small interface, so the storage is swappable:
//!
//! * [`LayerCache::append`] stores the new tokens' K and V (`[n_kv, t, head_dim]`) and
//!   returns the whole cache so far, `[n_kv, len, head_dim]`, ready for attention;
//! * [`LayerCache::q_rotation`] is the transform the query must go through first (the
//!   Walsh–Hadamard matrix for UltraQuant, whose K is stored rotated; none for BF16).
//!
//! The UltraQuant variant here is the numerical reference on any device: every (token,
//! head) slot is encoded with `candle_fp4::ultraquant::encode_slot` on the host (the
//! exact vLLM format, kept in [`LayerCache::ultraquant_slots`]), and its decoded values
//! (exact in BF16: `e2m1 · 2^e`) are what attention reads. It measures the format's
//! accuracy; it is not a fast FP4 attention kernel.

use candle_core::{bail, DType, Device, Result, Tensor};
use candle_fp4::ultraquant;

/// Which KV cache to allocate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheKind {
    /// BF16 K and V.
    #[default]
    Bf16,
    /// UltraQuant FP4 (vLLM PR #57057 format).
    UltraQuant,
}

impl std::str::FromStr for KvCacheKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" => Ok(Self::Bf16),
            "ultraquant" | "uq" | "fp4" => Ok(Self::UltraQuant),
            _ => Err(format!("unknown KV cache `{s}` (bf16 or ultraquant)")),
        }
    }
}

impl std::fmt::Display for KvCacheKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Bf16 => "bf16",
            Self::UltraQuant => "ultraquant",
        })
    }
}

/// The normalized Sylvester Walsh–Hadamard matrix `H_d / √d` as `[d, d]` F32: `x · H`
/// is `wht(x)` for a row vector `x` (H is symmetric and orthogonal).
pub fn hadamard_matrix(d: usize) -> Result<Vec<f32>> {
    let mut h = vec![0f32; d * d];
    for i in 0..d {
        let row = &mut h[i * d..(i + 1) * d];
        row[i] = 1.0;
        ultraquant::wht_inplace(row)?;
    }
    Ok(h)
}

/// One layer's cache.
#[derive(Debug)]
pub struct LayerCache {
    kind: KvCacheKind,
    /// `[n_kv, capacity, head_dim]`: BF16 K/V, or the decoded UltraQuant values (K rotated).
    k: Tensor,
    v: Tensor,
    len: usize,
    capacity: usize,
    n_kv: usize,
    head_dim: usize,
    /// UltraQuant only: slots `[capacity, n_kv, slot_size]` and the rotation `[d, d]`.
    slots: Vec<u8>,
    rotation: Option<Tensor>,
}

impl LayerCache {
    /// A cache for `capacity` tokens of `n_kv` heads of `head_dim`, on `device`.
    pub fn new(
        kind: KvCacheKind,
        n_kv: usize,
        head_dim: usize,
        capacity: usize,
        device: &Device,
    ) -> Result<Self> {
        let k = Tensor::zeros((n_kv, capacity, head_dim), DType::BF16, device)?;
        let v = k.zeros_like()?;
        let (slots, rotation) = match kind {
            KvCacheKind::Bf16 => (vec![], None),
            KvCacheKind::UltraQuant => {
                if !head_dim.is_power_of_two() || !head_dim.is_multiple_of(ultraquant::GROUP_SIZE) {
                    bail!("the UltraQuant KV cache needs a power-of-two head_dim that is a multiple of {}, got {head_dim}", ultraquant::GROUP_SIZE);
                }
                let s = ultraquant::slot_size(head_dim, None)?;
                let h = Tensor::from_vec(hadamard_matrix(head_dim)?, (head_dim, head_dim), device)?;
                (vec![0u8; capacity * n_kv * s], Some(h))
            }
        };
        Ok(Self {
            kind,
            k,
            v,
            len: 0,
            capacity,
            n_kv,
            head_dim,
            slots,
            rotation,
        })
    }

    pub fn kind(&self) -> KvCacheKind {
        self.kind
    }

    /// Tokens stored.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets everything from token `len` on.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// The matrix the query is multiplied by before `q · kᵀ` (F32 `[d, d]`), if any.
    pub fn q_rotation(&self) -> Option<&Tensor> {
        self.rotation.as_ref()
    }

    /// The raw UltraQuant slots `[len, n_kv, slot_size]` stored so far (empty for BF16).
    pub fn ultraquant_slots(&self) -> &[u8] {
        match self.kind {
            KvCacheKind::Bf16 => &[],
            KvCacheKind::UltraQuant => {
                let s = self.slots.len() / self.capacity.max(1) / self.n_kv.max(1);
                &self.slots[..self.len * self.n_kv * s]
            }
        }
    }

    /// Bytes per token of the stored format (all heads, K and V).
    pub fn bytes_per_token(&self) -> usize {
        match self.kind {
            KvCacheKind::Bf16 => 2 * 2 * self.n_kv * self.head_dim,
            KvCacheKind::UltraQuant => {
                self.n_kv * ultraquant::slot_size(self.head_dim, None).unwrap_or(0)
            }
        }
    }

    /// Stores `k`, `v` (`[n_kv, t, head_dim]`, any float dtype) after the cached tokens
    /// and returns the cache so far, `[n_kv, len, head_dim]` (BF16).
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
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
        if self.len + t > self.capacity {
            bail!(
                "KV cache full: {} tokens cached + {t} new > capacity {}",
                self.len,
                self.capacity
            );
        }
        let (k, v) = match self.kind {
            KvCacheKind::Bf16 => (k.to_dtype(DType::BF16)?, v.to_dtype(DType::BF16)?),
            KvCacheKind::UltraQuant => self.encode_ultraquant(k, v)?,
        };
        self.k.slice_set(&k.contiguous()?, 1, self.len)?;
        self.v.slice_set(&v.contiguous()?, 1, self.len)?;
        self.len += t;
        Ok((
            self.k.narrow(1, 0, self.len)?,
            self.v.narrow(1, 0, self.len)?,
        ))
    }

    /// Encodes the new tokens into slots and returns their decoded (rotated K, V) values.
    fn encode_ultraquant(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (n_kv, t, d) = k.dims3()?;
        let dev = k.device().clone();
        let kh = k.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let vh = v.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let s = ultraquant::slot_size(d, None)?;
        let mut kd = vec![0f32; n_kv * t * d];
        let mut vd = vec![0f32; n_kv * t * d];
        for h in 0..n_kv {
            for j in 0..t {
                let src = (h * t + j) * d;
                let slot_i = ((self.len + j) * n_kv + h) * s;
                let slot = &mut self.slots[slot_i..slot_i + s];
                ultraquant::encode_slot(&kh[src..src + d], &vh[src..src + d], slot)?;
                // Rotated K and V as the attention kernel would see them.
                let (kr, vr) = ultraquant::decode_slot(slot, d)?;
                kd[src..src + d].copy_from_slice(&kr);
                vd[src..src + d].copy_from_slice(&vr);
            }
        }
        let kd = Tensor::from_vec(kd, (n_kv, t, d), &dev)?.to_dtype(DType::BF16)?;
        let vd = Tensor::from_vec(vd, (n_kv, t, d), &dev)?.to_dtype(DType::BF16)?;
        Ok((kd, vd))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hadamard_is_the_wht_and_orthogonal() {
        let d = 64;
        let h = hadamard_matrix(d).unwrap();
        let x: Vec<f32> = (0..d).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3).collect();
        let mut w = x.clone();
        ultraquant::wht_inplace(&mut w).unwrap();
        for j in 0..d {
            let xh: f32 = (0..d).map(|i| x[i] * h[i * d + j]).sum();
            assert!((xh - w[j]).abs() < 1e-5);
            for i in 0..d {
                let hh: f32 = (0..d).map(|k| h[i * d + k] * h[k * d + j]).sum();
                assert!((hh - if i == j { 1.0 } else { 0.0 }).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn ultraquant_cache_keeps_q_dot_k() {
        // q·H · (decoded rotated K) equals q · (decoded K rotated back), and the slots
        // are the reference encoder's bytes.
        let dev = Device::Cpu;
        let (n_kv, t, d) = (2, 3, 64);
        let k = Tensor::randn(0f32, 1.0, (n_kv, t, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (n_kv, t, d), &dev).unwrap();
        let mut c = LayerCache::new(KvCacheKind::UltraQuant, n_kv, d, 8, &dev).unwrap();
        let (ka, _) = c.append(&k, &v).unwrap();
        assert_eq!(ka.dims(), [n_kv, t, d]);
        let s = ultraquant::slot_size(d, None).unwrap();
        let slots = c.ultraquant_slots().to_vec();
        assert_eq!(slots.len(), t * n_kv * s);
        let kh = k.to_vec3::<f32>().unwrap();
        let vh = v.to_vec3::<f32>().unwrap();
        let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.7).sin()).collect();
        let qt = Tensor::from_slice(&q, (1, d), &dev).unwrap();
        let qr = qt.matmul(c.q_rotation().unwrap()).unwrap();
        let ka = ka.to_dtype(DType::F32).unwrap().to_vec3::<f32>().unwrap();
        let qr = qr.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for h in 0..n_kv {
            for j in 0..t {
                let mut want = vec![0u8; s];
                ultraquant::encode_slot(&kh[h][j], &vh[h][j], &mut want).unwrap();
                let slot = &slots[(j * n_kv + h) * s..(j * n_kv + h + 1) * s];
                assert_eq!(slot, &want[..]);
                let (k_unrot, _) = ultraquant::decode_slot_unrotated(slot, d).unwrap();
                let a: f32 = q.iter().zip(&k_unrot).map(|(x, y)| x * y).sum();
                let b: f32 = qr.iter().zip(&ka[h][j]).map(|(x, y)| x * y).sum();
                assert!((a - b).abs() < 1e-3 * (1.0 + a.abs()), "{a} vs {b}");
            }
        }
    }
}
