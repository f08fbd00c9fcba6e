//! Independent references of the NVFP4 tests (`nvfp4_format.rs`, `nvfp4_quantizer.rs`):
//! brute-force E2M1 / E4M3 decoders and encoders and the row decode of a quantized matrix.
#![allow(dead_code)]

use candle_fp4::nvfp4::Nvfp4Quantized;
use float8::F8E4M3;

// ---------------------------------------------------------------------------------
// Independent references
// ---------------------------------------------------------------------------------

/// E2M1 magnitudes by code, written out from the format definition (bit 3 = sign).
pub const E2M1_REF: [f64; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

pub fn e2m1_ref_decode(code: u8) -> f64 {
    let m = E2M1_REF[(code & 7) as usize];
    if code & 8 != 0 {
        -m
    } else {
        m
    }
}

/// Nearest E2M1 level to `x` (in f64), ties to the even code, saturating at ±6; the
/// sign bit is set for every `x < 0` (ModelOpt's `sign_bit = weight < 0`).
pub fn e2m1_ref_encode(x: f64) -> u8 {
    let a = x.abs().min(6.0);
    let mut best = 0u8;
    for c in 1..8u8 {
        let d_new = (E2M1_REF[c as usize] - a).abs();
        let d_best = (E2M1_REF[best as usize] - a).abs();
        if d_new < d_best || (d_new == d_best && c.is_multiple_of(2)) {
            best = c;
        }
    }
    best | if x < 0.0 { 8 } else { 0 }
}

/// All finite non-negative E4M3 values, by code 0x00..=0x7E, from the format
/// definition (bias 7, 3 mantissa bits, subnormals `m·2^-9`).
pub fn e4m3_ref_table() -> Vec<f64> {
    (0u8..=0x7E)
        .map(|b| {
            let e = (b >> 3) as i32;
            let m = (b & 7) as f64;
            if e == 0 {
                m * 2f64.powi(-9)
            } else {
                (1.0 + m / 8.0) * 2f64.powi(e - 7)
            }
        })
        .collect()
}

/// Brute-force E4M3 encode: nearest finite value, ties to the even code, values beyond
/// 448 saturate (the `satfinite` convention).
pub fn e4m3_ref_encode(table: &[f64], x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = (x as f64).abs();
    if a >= 448.0 {
        return sign | 0x7E;
    }
    // The table is increasing: find the first value >= a.
    let hi = table.partition_point(|&v| v < a);
    let code = if hi == 0 {
        0
    } else {
        let lo = hi - 1;
        let (dl, dh) = (a - table[lo], table[hi] - a);
        if dl < dh || (dl == dh && lo.is_multiple_of(2)) {
            lo
        } else {
            hi
        }
    };
    sign | code as u8
}

pub fn f8_ref(b: u8) -> f32 {
    F8E4M3::from_bits(b).to_f32()
}

/// Independent decode of a row-major `Nvfp4Quantized` to the exact `e2m1 · e4m3`
/// products (no global scale), in f64.
pub fn ref_rows(q: &Nvfp4Quantized) -> Vec<f64> {
    let s_cols = q.k / 16;
    let mut out = Vec::with_capacity(q.n * q.k);
    for r in 0..q.n {
        for c in 0..q.k {
            let byte = q.weight[r * q.k / 2 + c / 2];
            let code = if c.is_multiple_of(2) {
                byte & 0xF
            } else {
                byte >> 4
            };
            let s = f8_ref(q.weight_scale[r * s_cols + c / 16]) as f64;
            out.push(e2m1_ref_decode(code) * s);
        }
    }
    out
}

pub fn code_at(q: &Nvfp4Quantized, r: usize, c: usize) -> u8 {
    let byte = q.weight[r * q.k / 2 + c / 2];
    if c.is_multiple_of(2) {
        byte & 0xF
    } else {
        byte >> 4
    }
}
