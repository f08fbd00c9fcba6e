//! UE8M0 group scales: one unsigned exponent byte per group, `s = 2^(byte − 127)`.
//!
//! # Encoding rule
//!
//! A group's scale is `s = 2^exp` with `exp = floor(log2(p) + 0.5)` (round half up) and
//! `p = c · absmax` computed as one f32 multiplication. vLLM's PyTorch reference and Triton
//! kernel evaluate `log2` in **f32** (`torch.log2` / `tl.log2`, then `floor(x + 0.5)`), so
//! this module does too: `exp = floor(RN_f32(log2 p) + 0.5)`, where `RN_f32` is the
//! correctly rounded f32 logarithm.
//!
//! That is not the same as rounding the exact `log2 p`: `RN_f32(log2 p)` lands exactly on
//! `e + 0.5` for the few f32 `p` just below `√2 · 2^e` (about 1 to 32 significands per
//! binade, more for large `|e|` because `log2 p` has fewer fractional bits there), and
//! those then round **up**.
//!
//! [`round_log2_half_up`] computes this exactly from the bits of `p`, with no `log2` call:
//! write `p = 1.m · 2^e` (`m` the 23-bit significand; subnormals normalized); then
//! `exp = e + (m ≥ T[k])` with `k = floor(log2 |2e + 1|)` and the 9 thresholds
//! [`ROUND_UP_SIGNIFICAND`]. Derivation: for `x = log2 p = e + log2(1.m)`,
//! `RN_f32(x) ≥ e + 0.5` iff `x ≥ e + 0.5 − g/2`, where `g` is the spacing of the f32 values
//! just below `e + 0.5`: `g = 2^(k − 24)` since `|e + 0.5| ∈ [2^(k−1), 2^k)` (for `e ≠ 0`;
//! below 0.5 it is `2^-25`). Then `floor(r + 0.5)` evaluated in f32 equals the exact
//! `floor(r + 0.5)` for every f32 `r` in the range of `log2` except `r = 0.5 − 2^-25`, where
//! the f32 sum `1 − 2^-25` ties to even and rounds up to 1.0. So round-up happens iff
//! `log2(1.m) ≥ 0.5 − δ`, i.e. `m ≥ T[k] = ceil(2^23 · (2^(0.5 − δ) − 1))`, with
//! `δ = 2^(k − 25)` (and `δ = 2^-26 + 2^-25` for `e = 0`, which gives the same threshold as
//! the `k = 0` entry). `log2(1.m)` is transcendental for `m ≠ 0`, so
//! no value sits exactly on a boundary, and the thresholds were computed with 200-bit
//! arithmetic (the nearest one is 0.042 of a significand step from its boundary).
//! The formulation was checked against glibc 2.36's `log2f` (`floor(log2f(p) + 0.5)`) and
//! against f64 `log2` rounded to f32, for **every** positive finite f32: no difference (the
//! test `ultraquant_format::round_log2_matches_libm_exhaustive`, ignored by default, repeats
//! that check). GPU kernels should use this integer form rather than a hardware
//! `lg2.approx`, which is not correctly rounded.
//!
//! Byte 0 is the zero sentinel: `p ≤ 0`, NaN, ±∞, or `exp < −126` all give byte 0, which
//! decodes to 0.0. Exponents above 127 clamp to 127 (byte 254): byte 255 is NaN in OCP
//! UE8M0 and is never written (with `c = 0.156` and a finite absmax, `exp ≤ 126` anyway).
//! vLLM's `format.ue8m0_encode` rounds `log2` in f64 instead; it agrees with
//! [`ue8m0_encode`] on every power of two (its intended input) and differs only for `s`
//! within ~2^-17 relative of `√2 · 2^e`.

/// UE8M0 exponent bias: `byte = exp + 127`.
pub const UE8M0_BIAS: i32 = 127;

/// Smallest stored exponent (byte 1 = 2^-126, the smallest normal f32). Anything smaller
/// becomes the zero sentinel, byte 0.
pub const UE8M0_MIN_EXP: i32 = -126;

/// Largest stored exponent (byte 254 = 2^127). Larger exponents clamp to it; byte 255
/// (NaN in OCP UE8M0) is never written.
pub const UE8M0_MAX_EXP: i32 = 127;

/// Significand thresholds of [`round_log2_half_up`]: `p = 1.m · 2^e` rounds up to
/// `2^(e+1)` iff `m ≥ ROUND_UP_SIGNIFICAND[min(floor(log2 |2e + 1|), 8)]`. For comparison,
/// the exact `√2` threshold would be `0x3504F4` (3474676).
pub const ROUND_UP_SIGNIFICAND: [u32; 9] = [
    3_474_675, // |2e+1| = 1:        e ∈ {0, -1}
    3_474_675, // |2e+1| ∈ [2, 4):   e ∈ {1, -2}
    3_474_675, // |2e+1| ∈ [4, 8):   e ∈ {2, 3, -3, -4}
    3_474_674, // |2e+1| ∈ [8, 16)
    3_474_672, // |2e+1| ∈ [16, 32)
    3_474_668, // |2e+1| ∈ [32, 64)
    3_474_660, // |2e+1| ∈ [64, 128)
    3_474_644, // |2e+1| ∈ [128, 256)
    3_474_613, // |2e+1| ∈ [256, 512): only e ≤ -128, which encodes as the zero sentinel
];

const SIGNIFICAND_MASK: u32 = (1 << 23) - 1;

/// `floor(RN_f32(log2 p) + 0.5)` evaluated in f32 arithmetic (the vLLM scale rule), computed
/// exactly from the bits of `p`; `None` when `p` is not finite and positive.
///
/// Subnormal `p` are handled (they give exponents from −149 to −127). See the module docs
/// for the derivation and the exhaustive check against `log2f`.
pub fn round_log2_half_up(p: f32) -> Option<i32> {
    if p.is_nan() || p.is_infinite() || p <= 0.0 {
        return None;
    }
    let bits = p.to_bits();
    let (e, m) = if bits >> 23 == 0 {
        // Subnormal: value = bits · 2^-149; normalize to 1.m · 2^e.
        let h = 31 - bits.leading_zeros();
        (h as i32 - 149, (bits << (23 - h)) & SIGNIFICAND_MASK)
    } else {
        ((bits >> 23) as i32 - UE8M0_BIAS, bits & SIGNIFICAND_MASK)
    };
    let k = (31 - (2 * e + 1).unsigned_abs().leading_zeros()).min(8) as usize;
    Some(e + i32::from(m >= ROUND_UP_SIGNIFICAND[k]))
}

/// Snap a scale `s` to a power of two and encode it as a UE8M0 byte (`exp + 127`).
///
/// `exp` is [`round_log2_half_up`]`(s)`, so a power of two `2^e` (−126 ≤ e ≤ 127) encodes
/// exactly as `e + 127`. Returns the zero sentinel 0 for `s ≤ 0`, NaN, ±∞ and `exp < −126`;
/// clamps `exp > 127` to byte 254.
pub fn ue8m0_encode(s: f32) -> u8 {
    match round_log2_half_up(s) {
        None => 0,
        Some(exp) if exp < UE8M0_MIN_EXP => 0,
        Some(exp) => (exp.min(UE8M0_MAX_EXP) + UE8M0_BIAS) as u8,
    }
}

/// Decode a UE8M0 byte: 0 → 0.0 (zero sentinel), 1..=254 → `2^(byte − 127)` (exact),
/// 255 → NaN (OCP UE8M0; never written by [`ue8m0_encode`]).
pub fn ue8m0_decode(byte: u8) -> f32 {
    match byte {
        0 => 0.0,
        255 => f32::NAN,
        b => f32::from_bits(u32::from(b) << 23),
    }
}

/// The scale byte of a group with maximum magnitude `absmax`: [`ue8m0_encode`]`(c · absmax)`,
/// the product rounded to f32 first (as vLLM does).
///
/// Returns 0 (zero sentinel) when `absmax` or `c` is not finite and positive (all-zero group,
/// NaN or ±∞ in the group), or when the scale is below 2^-126.
pub fn scale_for_absmax(absmax: f32, c: f32) -> u8 {
    let finite_positive = |x: f32| x.is_finite() && x > 0.0;
    if !finite_positive(absmax) || !finite_positive(c) {
        return 0;
    }
    ue8m0_encode(c * absmax)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Recompute the thresholds in f64: `2^23 · (2^(0.5 − δ) − 1)` is far enough from an
    /// integer (≥ 0.04) that f64's ~1e-9 absolute error cannot change the ceiling.
    #[test]
    fn thresholds_match_f64_recomputation() {
        for (k, &t) in ROUND_UP_SIGNIFICAND.iter().enumerate() {
            let delta = 2f64.powi(k as i32 - 25);
            let v = 8_388_608.0 * ((0.5 - delta).exp2() - 1.0);
            assert!((v - v.round()).abs() > 0.01, "k={k} too close: {v}");
            assert_eq!(v.ceil() as u32, t, "k={k}");
        }
        let v = 8_388_608.0 * ((0.5 - 3.0 * 2f64.powi(-26)).exp2() - 1.0);
        assert_eq!(v.ceil() as u32, ROUND_UP_SIGNIFICAND[0]);
    }

    #[test]
    fn subnormals_normalize() {
        assert_eq!(round_log2_half_up(f32::from_bits(1)), Some(-149));
        assert_eq!(round_log2_half_up(f32::from_bits(3)), Some(-147)); // log2 3 = 1.58
        assert_eq!(round_log2_half_up(f32::MIN_POSITIVE), Some(-126));
        assert_eq!(round_log2_half_up(f32::MAX), Some(128));
        assert_eq!(ue8m0_encode(f32::MAX), 254);
    }
}
