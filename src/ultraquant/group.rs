//! Encode and decode scale groups: absmax → UE8M0 scale byte → packed E2M1 codes.
//!
//! For one group `x` (32 values in the format; any even length here):
//!
//! 1. If any value is NaN or ±∞ the group gets the NaN scale byte [`NAN_SCALE`] (255) and
//!    all codes 0, so that it decodes to 32 NaNs: a NaN in K or V propagates through
//!    attention as it does with the BF16 cache instead of vanishing. (vLLM's reference
//!    writes the zero sentinel there, which silently replaces the group by zeros; this is
//!    the one place where we deviate from it. See `docs/reliability.md`.)
//! 2. `byte = scale_for_absmax(max |x|, c)`; byte 0 (all-zero group, or scale below 2^-126)
//!    also writes all codes 0.
//! 3. Otherwise `s = 2^(byte − 127)` and each code is `encode_e2m1(x / s)`, the division in
//!    f32. `s` is a normal power of two (≥ 2^-126), so `x / s` is exact unless the quotient
//!    is subnormal, and such quotients are far below the first midpoint 0.25 and encode as 0
//!    either way; `x * (1 / s)` would give identical results.
//! 4. Two codes per byte: element `2j` in the low nibble of byte `j`, element `2j + 1` in the
//!    high nibble.
//!
//! Decoding is `decode_e2m1(code) · ue8m0_decode(byte)`, exact in f32; a zero-sentinel group
//! decodes to zeros whatever its codes, a 255 scale byte ([`NAN_SCALE`]) to NaN.

use candle_core::{bail, Result};

use super::e2m1::{decode_e2m1, encode_e2m1};
use super::format::GROUP_SIZE;
use super::ue8m0::{scale_for_absmax, ue8m0_decode};

/// The scale byte of a group holding NaN or ±∞: UE8M0's NaN, so the group decodes to NaN.
pub const NAN_SCALE: u8 = 255;

/// Encode one group with constant `c`: write `group.len() / 2` packed code bytes to `codes`
/// and return the UE8M0 scale byte ([`NAN_SCALE`] with zero codes for a group holding NaN
/// or ±∞).
///
/// Errors when `group` is empty or of odd length, or `codes` is not `group.len() / 2` long.
pub fn encode_group(group: &[f32], c: f32, codes: &mut [u8]) -> Result<u8> {
    if group.is_empty() || !group.len().is_multiple_of(2) {
        bail!(
            "ultraquant encode_group: group length must be even and positive, got {}",
            group.len()
        )
    }
    if codes.len() * 2 != group.len() {
        bail!(
            "ultraquant encode_group: codes buffer holds {} bytes, a group of {} needs {}",
            codes.len(),
            group.len(),
            group.len() / 2
        )
    }
    if !group.iter().all(|x| x.is_finite()) {
        codes.fill(0);
        return Ok(NAN_SCALE);
    }
    let absmax = group.iter().fold(0f32, |m, x| m.max(x.abs()));
    let byte = scale_for_absmax(absmax, c);
    if byte == 0 {
        codes.fill(0);
        return Ok(0);
    }
    let s = ue8m0_decode(byte);
    for (out, pair) in codes.iter_mut().zip(group.chunks_exact(2)) {
        *out = encode_e2m1(pair[0] / s) | (encode_e2m1(pair[1] / s) << 4);
    }
    Ok(byte)
}

/// Decode one group: `out[2j]`, `out[2j + 1]` from the low and high nibble of `codes[j]`,
/// times the scale `ue8m0_decode(scale)`.
///
/// Errors when `out` is not `2 · codes.len()` long.
pub fn decode_group(codes: &[u8], scale: u8, out: &mut [f32]) -> Result<()> {
    if out.len() != codes.len() * 2 {
        bail!(
            "ultraquant decode_group: {} code bytes decode to {} values, output holds {}",
            codes.len(),
            codes.len() * 2,
            out.len()
        )
    }
    let s = ue8m0_decode(scale);
    for (pair, &b) in out.chunks_exact_mut(2).zip(codes) {
        pair[0] = decode_e2m1(b & 0xF) * s;
        pair[1] = decode_e2m1(b >> 4) * s;
    }
    Ok(())
}

/// Encode a row of `x.len()` values (a multiple of [`GROUP_SIZE`]) group by group:
/// `x.len() / 2` packed code bytes to `codes`, `x.len() / 32` scale bytes to `scales`.
///
/// Errors when the lengths do not fit.
pub fn encode_row(x: &[f32], c: f32, codes: &mut [u8], scales: &mut [u8]) -> Result<()> {
    check_row(x.len(), codes.len(), scales.len(), "encode_row")?;
    let groups = x.chunks_exact(GROUP_SIZE);
    let code_chunks = codes.chunks_exact_mut(GROUP_SIZE / 2);
    for ((g, cb), sb) in groups.zip(code_chunks).zip(scales.iter_mut()) {
        *sb = encode_group(g, c, cb)?;
    }
    Ok(())
}

/// Decode a row written by [`encode_row`] into `out` (`out.len()` values, a multiple of
/// [`GROUP_SIZE`]).
///
/// Errors when the lengths do not fit.
pub fn decode_row(codes: &[u8], scales: &[u8], out: &mut [f32]) -> Result<()> {
    check_row(out.len(), codes.len(), scales.len(), "decode_row")?;
    let groups = out.chunks_exact_mut(GROUP_SIZE);
    for ((g, cb), &sb) in groups.zip(codes.chunks_exact(GROUP_SIZE / 2)).zip(scales) {
        decode_group(cb, sb, g)?;
    }
    Ok(())
}

fn check_row(n: usize, n_codes: usize, n_scales: usize, what: &str) -> Result<()> {
    if n == 0 || !n.is_multiple_of(GROUP_SIZE) {
        bail!("ultraquant {what}: row length must be a positive multiple of {GROUP_SIZE}, got {n}")
    }
    if n_codes != n / 2 || n_scales != n / GROUP_SIZE {
        bail!(
            "ultraquant {what}: a row of {n} needs {} code bytes and {} scale bytes, got {n_codes} and {n_scales}",
            n / 2,
            n / GROUP_SIZE
        )
    }
    Ok(())
}
