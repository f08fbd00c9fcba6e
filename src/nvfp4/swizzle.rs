//! The 128×4 block-scale swizzle of CUTLASS's SM100 block-scaled MMA (`SfKMajorAtom`;
//! vLLM/FlashInfer `swizzle_blockscale`).
//!
//! Rows `N` are padded to a multiple of 128 (`Np`), scale columns `S = K/16` to a
//! multiple of 4 (`Sp`), padding bytes are 0, and each 128×4 atom is 512 contiguous
//! bytes: `reshape(Np/128, 4, 32, Sp/4, 4).permute(0, 3, 2, 1, 4)`.

use candle_core::{bail, DType, Device, Result, Tensor};

/// `(Np, Sp)`: `n` rounded up to 128 and `s` rounded up to 4 (saturating at `usize::MAX`
/// for sizes no buffer can have; the crate checks sizes read from files before using them).
pub fn swizzled_shape(n: usize, s: usize) -> (usize, usize) {
    (
        n.div_ceil(128).saturating_mul(128),
        s.div_ceil(4).saturating_mul(4),
    )
}

/// `(Np, Sp, Np·Sp)` for `[n, s]` scales, or an overflow error.
pub(crate) fn swizzled_len(what: &str, n: usize, s: usize) -> Result<(usize, usize, usize)> {
    let np = n.div_ceil(128).checked_mul(128);
    let sp = s.div_ceil(4).checked_mul(4);
    match (np, sp) {
        (Some(np), Some(sp)) => Ok((np, sp, crate::error::checked_product(what, &[np, sp])?)),
        _ => Err(crate::error::SizeError::Overflow {
            what: what.to_string(),
            expr: format!("[{n}, {s}] padded to 128 × 4"),
        }
        .into()),
    }
}

/// Byte offset of scale `(m, s)` in the swizzled buffer whose padded column count is `sp`:
/// `((m/128)·(sp/4) + s/4)·512 + (m%32)·16 + ((m%128)/32)·4 + s%4`.
#[inline]
pub fn swizzled_offset(m: usize, s: usize, sp: usize) -> usize {
    ((m / 128) * (sp / 4) + s / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 + (s % 4)
}

/// Swizzles row-major scales `[n, s]` into the padded 128×4 layout (`Np·Sp` bytes).
pub fn swizzle_blockscale_bytes(scales: &[u8], n: usize, s: usize) -> Result<Vec<u8>> {
    if Some(scales.len()) != n.checked_mul(s) {
        bail!(
            "swizzle_blockscale: got {} bytes for [{n}, {s}] scales",
            scales.len()
        );
    }
    let (_, sp, len) = swizzled_len("swizzle_blockscale", n, s)?;
    let mut out = vec![0u8; len];
    for m in 0..n {
        for c in 0..s {
            out[swizzled_offset(m, c, sp)] = scales[m * s + c];
        }
    }
    Ok(out)
}

/// Inverse of [`swizzle_blockscale_bytes`]: recovers row-major `[n, s]` scales.
pub fn unswizzle_blockscale_bytes(swizzled: &[u8], n: usize, s: usize) -> Result<Vec<u8>> {
    let (np, sp, len) = swizzled_len("unswizzle_blockscale", n, s)?;
    if swizzled.len() != len {
        bail!(
            "unswizzle_blockscale: got {} bytes, [{n}, {s}] scales swizzle to {np}x{sp} = {len}",
            swizzled.len(),
        );
    }
    // n·s ≤ np·sp, which fits.
    let mut out = vec![0u8; n * s];
    for m in 0..n {
        for c in 0..s {
            out[m * s + c] = swizzled[swizzled_offset(m, c, sp)];
        }
    }
    Ok(out)
}

/// Raw bytes of a scale tensor (U8, or F8E4M3 bit patterns), flattened.
pub(crate) fn scale_bytes(t: &Tensor, what: &str) -> Result<Vec<u8>> {
    let t = t.to_device(&Device::Cpu)?.flatten_all()?;
    match t.dtype() {
        DType::U8 => t.to_vec1::<u8>(),
        DType::F8E4M3 => Ok(t
            .to_vec1::<float8::F8E4M3>()?
            .into_iter()
            .map(|v| v.to_bits())
            .collect()),
        dt => bail!("{what}: block scales must be U8 or F8E4M3 bytes, got {dt:?}"),
    }
}

/// Swizzles a row-major scale tensor `[N, S]` (U8 or F8E4M3) into a U8 tensor `[Np, Sp]`
/// in the 128×4 layout, on the same device.
pub fn swizzle_blockscale(scales: &Tensor) -> Result<Tensor> {
    let (n, s) = match scales.dims() {
        [n, s] => (*n, *s),
        d => bail!("swizzle_blockscale: expected 2-d scales [N, K/16], got shape {d:?}"),
    };
    let bytes = scale_bytes(scales, "swizzle_blockscale")?;
    let out = swizzle_blockscale_bytes(&bytes, n, s)?;
    let (np, sp) = swizzled_shape(n, s);
    Tensor::from_vec(out, (np, sp), scales.device())
}

/// Recovers row-major U8 scales `[n, s]` from a swizzled scale tensor (`Np·Sp` bytes).
pub fn unswizzle_blockscale(swizzled: &Tensor, n: usize, s: usize) -> Result<Tensor> {
    let bytes = scale_bytes(swizzled, "unswizzle_blockscale")?;
    let out = unswizzle_blockscale_bytes(&bytes, n, s)?;
    Tensor::from_vec(out, (n, s), swizzled.device())
}
