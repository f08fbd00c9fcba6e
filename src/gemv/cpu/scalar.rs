//! The scalar CPU GEMV kernel, the numerical oracle: each weight row is decoded into an
//! FP32 buffer, then dotted with every token (eight interleaved FP32 sums).

use super::layout::WeightRows;
use crate::nvfp4::{e2m1_decode, e4m3_decode, swizzled_offset, BLOCK_SIZE};

/// `[e2m1(low nibble), e2m1(high nibble)]` of every code byte.
pub(super) fn e2m1_pair_table() -> [[f32; 2]; 256] {
    let mut t = [[0f32; 2]; 256];
    for (b, e) in t.iter_mut().enumerate() {
        *e = [e2m1_decode(b as u8 & 0xF), e2m1_decode(b as u8 >> 4)];
    }
    t
}

impl WeightRows<'_> {
    /// Row `row` decoded exactly to FP32 into `dst`.
    pub(super) fn decode_row(
        &self,
        row: usize,
        k: usize,
        pairs: &[[f32; 2]; 256],
        dst: &mut [f32],
    ) {
        match *self {
            WeightRows::Nvfp4 { codes, scales, sp } => {
                let src = &codes[row * k / 2..(row + 1) * k / 2];
                for (blk, (d, c)) in dst
                    .chunks_exact_mut(BLOCK_SIZE)
                    .zip(src.chunks_exact(BLOCK_SIZE / 2))
                    .enumerate()
                {
                    let s = e4m3_decode(scales[swizzled_offset(row, blk, sp)]);
                    for (dd, &byte) in d.chunks_exact_mut(2).zip(c) {
                        let [lo, hi] = pairs[byte as usize];
                        // Exact in FP32 (and in BF16): e2m1 · e4m3.
                        dd[0] = lo * s;
                        dd[1] = hi * s;
                    }
                }
            }
            WeightRows::Bf16 { w } => {
                for (d, v) in dst.iter_mut().zip(&w[row * k..(row + 1) * k]) {
                    *d = v.to_f32();
                }
            }
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent FP32 accumulators so the compiler vectorizes.
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum()
}

/// Accumulators of rows `row0..row0 + out.len() / m` into `out` (`[row][token]`).
pub(super) fn rows_scalar(
    rows: &WeightRows<'_>,
    xf: &[f32],
    m: usize,
    k: usize,
    row0: usize,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    let pairs = e2m1_pair_table();
    scratch.resize(k, 0.0);
    for (r, o) in out.chunks_exact_mut(m).enumerate() {
        rows.decode_row(row0 + r, k, &pairs, scratch);
        for (t, v) in o.iter_mut().enumerate() {
            *v = dot(&xf[t * k..(t + 1) * k], scratch);
        }
    }
}
