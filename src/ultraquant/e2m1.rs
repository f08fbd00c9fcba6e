//! E2M1 (FP4) codes with UltraQuant's rounding rule.
//!
//! A code is 4 bits: bit 3 = sign, bits 0–2 index the magnitude `[0, 0.5, 1, 1.5, 2, 3, 4, 6]`.
//!
//! # Rounding rule (vLLM `bucketize` / Triton store kernel, bit for bit)
//!
//! The 15 distinct levels `−6 … 6` are sorted ascending and the encoder counts the 14 sorted
//! midpoints that `x` is strictly greater than (`x > mid`); that count is the level index.
//! Consequences, all deliberate:
//!
//! * Nearest level; a value exactly on a midpoint goes to the **lower** (more negative)
//!   level. For positive values that is toward zero (0.25 → 0, 0.75 → 0.5, …, 5 → 4); for
//!   negative values it is **away from zero** (−0.25 → −0.5, −0.75 → −1, …, −5 → −6). The
//!   rule is not sign-symmetric; vLLM's reference and kernel behave exactly like this.
//! * Saturation: anything above 5 encodes as +6 (code 7), anything at or below −5 as −6
//!   (code 15), including ±∞.
//! * Zero: every `x` in `(−0.25, 0.25]`, including −0.0 and tiny negatives, encodes as code 0
//!   (+0). Code 8 (−0) is never produced by the encoder; [`decode_e2m1`] still decodes it to
//!   −0.0 as the E2M1 definition says.
//! * NaN encodes as code 0. (The bare `>` count would give −6; the group encoder never
//!   reaches that case because a NaN anywhere in a group gives the whole group the NaN scale
//!   byte and zero codes, see [`crate::ultraquant::group::encode_group`].)

/// E2M1 magnitudes indexed by the low 3 bits of a code.
pub const E2M1_MAGNITUDES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// The 15 distinct E2M1 values in ascending order.
pub const E2M1_LEVELS_SORTED: [f32; 15] = [
    -6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
];

/// Midpoints between consecutive [`E2M1_LEVELS_SORTED`] entries (all exact in f32).
pub const E2M1_MIDPOINTS_SORTED: [f32; 14] = [
    -5.0, -3.5, -2.5, -1.75, -1.25, -0.75, -0.25, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0,
];

/// Value of each 4-bit code (code 8 is −0.0).
const CODE_TO_VALUE: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Encode an already scaled value (`x / s`) to a 4-bit E2M1 code (the upper nibble is 0).
///
/// Nearest level, midpoint ties to the lower (more negative) level, saturating at ±6, zero
/// always as code 0, NaN as code 0; see the module docs.
pub fn encode_e2m1(x: f32) -> u8 {
    if x.is_nan() {
        return 0;
    }
    let sorted_index = E2M1_MIDPOINTS_SORTED.iter().filter(|&&m| x > m).count() as u8;
    // Sorted index → code: 0..=6 are −6..−0.5 (codes 15..9), 7..=14 are 0..6 (codes 0..7).
    if sorted_index < 7 {
        15 - sorted_index
    } else {
        sorted_index - 7
    }
}

/// Decode a 4-bit E2M1 code (only the low nibble of `code` is read).
pub fn decode_e2m1(code: u8) -> f32 {
    CODE_TO_VALUE[usize::from(code & 0xF)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_agree() {
        for (i, w) in E2M1_LEVELS_SORTED.windows(2).enumerate() {
            assert_eq!(E2M1_MIDPOINTS_SORTED[i], (w[0] + w[1]) / 2.0);
        }
        for (i, &l) in E2M1_LEVELS_SORTED.iter().enumerate() {
            assert_eq!(decode_e2m1(encode_e2m1(l)), l, "level index {i}");
        }
        for code in 0..8u8 {
            assert_eq!(decode_e2m1(code), E2M1_MAGNITUDES[code as usize]);
            assert_eq!(decode_e2m1(code | 8), -E2M1_MAGNITUDES[code as usize]);
        }
    }
}
