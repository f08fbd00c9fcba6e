//! Checks on NVFP4 data read from files: E4M3 block scales must be finite and
//! non-negative (ModelOpt writes positive finite scales only; a negative scale flips a
//! block's signs and a NaN one poisons every output it touches).

use super::codec::e4m3_decode;

/// The first E4M3 block scale byte in `bytes` that is NaN (`0x7F`, `0xFF`) or negative
/// (sign bit set, `-0` = `0x80` excepted), as `(index, byte, value)`.
pub fn first_bad_block_scale(bytes: &[u8]) -> Option<(usize, u8, f32)> {
    bytes.iter().enumerate().find_map(|(i, &b)| {
        let nan = b & 0x7F == 0x7F;
        let negative = b & 0x80 != 0 && b != 0x80;
        (nan || negative).then(|| (i, b, e4m3_decode(b)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nan_and_negative_scales_only() {
        // Every byte: bad iff its value is NaN or < 0.
        for b in 0..=255u8 {
            let v = e4m3_decode(b);
            let bad = v.is_nan() || v < 0.0;
            assert_eq!(
                first_bad_block_scale(&[b]).is_some(),
                bad,
                "byte {b:#04x} = {v}"
            );
        }
        assert_eq!(
            first_bad_block_scale(&[0x38, 0x00, 0x80, 0xB8, 0x7F]).map(|x| x.0),
            Some(3)
        );
    }
}
