//! Scalar codecs: E2M1 (FP4) and E4M3 (FP8, `float8_e4m3fn`).

/// Number of weights that share one E4M3 block scale.
pub const BLOCK_SIZE: usize = 16;

/// The eight E2M1 magnitudes, indexed by bits 0–2 of a code (bit 3 is the sign).
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// Decodes a 4-bit E2M1 code (the low nibble of `code`; higher bits are ignored).
#[inline]
pub fn e2m1_decode(code: u8) -> f32 {
    let mag = E2M1_VALUES[(code & 7) as usize];
    if code & 8 != 0 {
        -mag
    } else {
        mag
    }
}

/// Encodes `x` to E2M1 exactly as ModelOpt's `NVFP4QTensor._cast_fp4` does: nearest
/// level, a tie goes to the level with an even code (0.25→0, 0.75→1, 1.25→1, 1.75→2,
/// 2.5→2, 3.5→4, 5→4), magnitudes above 6 saturate to 6, and the sign bit is set for
/// every `x < 0` (so a tiny negative value becomes code `0x8`, negative zero).
///
/// NaN follows `torch.searchsorted` (NaN sorts above everything) and encodes to `0x7`;
/// ModelOpt produces it for the zeros of a nonzero block whose E4M3 scale underflowed
/// to 0 (`0 / 0`), where it dequantizes to 0 like every other code.
#[inline]
pub fn e2m1_encode(x: f32) -> u8 {
    // searchsorted(bounds, |x|, left) counts the bounds b with !(b >= |x|); a value
    // equal to a bound at an odd index (0.75, 1.75, 3.5) rounds up.
    const BOUNDS: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    let a = x.abs();
    let mut ord = 0u8;
    for b in BOUNDS {
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        if !(b >= a) {
            ord += 1;
        }
    }
    if a == 0.75 || a == 1.75 || a == 3.5 {
        ord += 1;
    }
    let sign = if x < 0.0 { 8 } else { 0 };
    sign | ord
}

/// Decodes an E4M3 (`float8_e4m3fn`) byte: bias 7, 3 mantissa bits, subnormals down to
/// 2^-9, no infinities, `0x7F`/`0xFF` are NaN.
#[inline]
pub fn e4m3_decode(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((b >> 3) & 0xF) as i32;
    let m = (b & 7) as f32;
    if e == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m * (2.0f32).powi(-9)
    } else {
        (1.0 + m / 8.0) * (2.0f32).powi(e - 7)
    };
    sign * mag
}

/// Encodes `x` to E4M3 with round-to-nearest-even, subnormals included (as PyTorch's
/// `.to(torch.float8_e4m3fn)` does for values in range). Finite values beyond ±448
/// saturate to ±448; NaN encodes to `0x7F`.
pub fn e4m3_encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    let bits = a.to_bits();
    let exp = ((bits >> 23) & 0xFF) as i32 - 127;
    if exp < -126 {
        // f32 subnormal or zero: far below half of the smallest E4M3 subnormal (2^-10).
        return sign;
    }
    let full = (bits & 0x7F_FFFF) | 0x80_0000; // 24-bit significand, value = full · 2^(exp-23)
    let round_shift = |v: u32, shift: u32| -> u32 {
        if shift >= 32 {
            return 0;
        }
        let q = v >> shift;
        let rem = v & ((1u32 << shift) - 1);
        let half = 1u32 << (shift - 1);
        if rem > half || (rem == half && q & 1 == 1) {
            q + 1
        } else {
            q
        }
    };
    if exp < -6 {
        // Subnormal target: units of 2^-9. q = 8 lands exactly on the smallest normal
        // (exponent field 1, mantissa 0), which is the right encoding too.
        let shift = (14 - exp) as u32; // full · 2^(exp-23) / 2^-9 = full >> (14 - exp)
        let q = round_shift(full, shift);
        return sign | q as u8;
    }
    // Normal: keep 3 of the 23 fraction bits.
    let q = round_shift(full, 20); // in [8, 16]
    let (e, m) = if q == 16 { (exp + 1, 0) } else { (exp, q - 8) };
    let field = e + 7;
    if field > 15 || (field == 15 && m == 7) {
        return sign | 0x7E;
    }
    sign | ((field as u8) << 3) | m as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_all_codes_round_trip() {
        for b in 0u8..=255 {
            let v = e4m3_decode(b);
            if v.is_nan() {
                assert!(b & 0x7F == 0x7F);
                continue;
            }
            let back = e4m3_encode(v);
            // +0 and -0 both decode to zero; the sign survives.
            assert_eq!(back, b, "code {b:#04x} value {v}");
        }
    }

    #[test]
    fn e2m1_all_codes_round_trip() {
        for c in 0u8..16 {
            let v = e2m1_decode(c);
            let back = e2m1_encode(v);
            if c == 8 {
                // -0.0 is not < 0, so it encodes to +0.
                assert_eq!(back, 0);
            } else {
                assert_eq!(back, c);
            }
        }
    }
}
