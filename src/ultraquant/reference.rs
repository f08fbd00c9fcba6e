//! CPU reference for one (token, head) slot: encode K and V into the slot bytes, decode them.
//!
//! `head_dim` must be a power of two and a multiple of [`GROUP_SIZE`] (32, 64, 128, 256, …).
//! Inputs are f32 (a caller holding bf16 converts exactly with `f32::from`).

use candle_core::{bail, Result};

use super::format::{slot_size, DEFAULT_CONSTANT_C, GROUP_SIZE};
use super::group::{decode_row, encode_row};
use super::hadamard::wht_inplace;

/// Encode one slot with the default constant: K is rotated by the normalized Walsh–Hadamard
/// transform, then K and V are quantized per group of 32 and written to `out` as
/// `[K codes D/2][K scales D/32][V codes D/2][V scales D/32]`.
///
/// `out.len()` must be exactly [`slot_size`]`(D, None)`. See [`encode_slot_with_c`].
pub fn encode_slot(k: &[f32], v: &[f32], out: &mut [u8]) -> Result<()> {
    encode_slot_with_c(k, v, DEFAULT_CONSTANT_C, out)
}

/// [`encode_slot`] with an explicit scale constant `c` (finite and positive).
///
/// Errors when K and V lengths differ, the head_dim is not a power of two and a multiple of
/// 32, `out` is not exactly one slot long, or `c` is not finite and positive.
pub fn encode_slot_with_c(k: &[f32], v: &[f32], c: f32, out: &mut [u8]) -> Result<()> {
    let d = k.len();
    if v.len() != d {
        bail!(
            "ultraquant encode_slot: K has {d} values but V has {}",
            v.len()
        )
    }
    let size = check_slot(d, out.len(), "encode_slot")?;
    if !(c.is_finite() && c > 0.0) {
        bail!("ultraquant encode_slot: constant c must be finite and positive, got {c}")
    }
    let mut k_rot = k.to_vec();
    wht_inplace(&mut k_rot)?;
    let (k_part, v_part) = out.split_at_mut(size / 2);
    let (k_codes, k_scales) = k_part.split_at_mut(d / 2);
    encode_row(&k_rot, c, k_codes, k_scales)?;
    let (v_codes, v_scales) = v_part.split_at_mut(d / 2);
    encode_row(v, c, v_codes, v_scales)
}

/// Decode one slot: `(K in the rotated basis, V)`, each `head_dim` long.
///
/// The rotated K is what attention uses against a query rotated by the same transform. Errors
/// when `head_dim` is not a power of two and a multiple of 32 or `slot` is not exactly
/// [`slot_size`]`(head_dim, None)` bytes.
pub fn decode_slot(slot: &[u8], head_dim: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    let size = check_slot(head_dim, slot.len(), "decode_slot")?;
    let (k_part, v_part) = slot.split_at(size / 2);
    let (k_codes, k_scales) = k_part.split_at(head_dim / 2);
    let (v_codes, v_scales) = v_part.split_at(head_dim / 2);
    let mut k = vec![0f32; head_dim];
    let mut v = vec![0f32; head_dim];
    decode_row(k_codes, k_scales, &mut k)?;
    decode_row(v_codes, v_scales, &mut v)?;
    Ok((k, v))
}

/// [`decode_slot`] followed by the inverse rotation of K (the normalized Walsh–Hadamard
/// transform is its own inverse), giving `(K, V)` in the original basis.
pub fn decode_slot_unrotated(slot: &[u8], head_dim: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    let (mut k, v) = decode_slot(slot, head_dim)?;
    wht_inplace(&mut k)?;
    Ok((k, v))
}

/// Validate head_dim and the slot buffer length; return the slot size.
fn check_slot(head_dim: usize, len: usize, what: &str) -> Result<usize> {
    if !head_dim.is_power_of_two() || !head_dim.is_multiple_of(GROUP_SIZE) {
        bail!(
            "ultraquant {what}: head_dim must be a power of two and a multiple of {GROUP_SIZE}, got {head_dim}"
        )
    }
    let size = slot_size(head_dim, None)?;
    if len != size {
        bail!("ultraquant {what}: slot buffer is {len} bytes, head_dim {head_dim} needs {size}")
    }
    Ok(size)
}
