//! CPU forward of the GEMV ops: the oracle for the CUDA kernels.
//!
//! Rows of the weight are dequantized on the fly (one row of K FP32 values per worker
//! thread, never a full copy of the weight), then dotted with every token.

use crate::nvfp4::{e2m1_decode, e4m3_decode, swizzled_offset, BLOCK_SIZE};
use candle_core::{bail, Result};
use half::bf16;
use rayon::prelude::*;

/// Where the weight rows come from.
#[derive(Debug, Clone, Copy)]
pub enum WeightRows<'a> {
    /// NVFP4: packed codes `[N, K/2]` and swizzled scales with `sp` padded columns.
    Nvfp4 {
        /// Packed E2M1 codes.
        codes: &'a [u8],
        /// Swizzled E4M3 block scales.
        scales: &'a [u8],
        /// Padded scale-column count of the swizzled layout.
        sp: usize,
    },
    /// Plain BF16 rows `[N, K]`.
    Bf16 {
        /// The weight.
        w: &'a [bf16],
    },
}

fn e2m1_pair_table() -> [[f32; 2]; 256] {
    let mut t = [[0f32; 2]; 256];
    for (b, e) in t.iter_mut().enumerate() {
        *e = [e2m1_decode(b as u8 & 0xF), e2m1_decode(b as u8 >> 4)];
    }
    t
}

impl WeightRows<'_> {
    fn decode_row(&self, row: usize, k: usize, pairs: &[[f32; 2]; 256], dst: &mut [f32]) {
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

    fn check(&self, n: usize, k: usize) -> Result<()> {
        match *self {
            WeightRows::Nvfp4 { codes, scales, sp } => {
                let np = n.div_ceil(128) * 128;
                if codes.len() != n * k / 2 || scales.len() != np * sp || sp < k / BLOCK_SIZE {
                    bail!("gemv: NVFP4 weight buffers do not match N = {n}, K = {k}");
                }
            }
            WeightRows::Bf16 { w } => {
                if w.len() != n * k {
                    bail!("gemv: BF16 weight has {} values, expected {n}x{k}", w.len());
                }
            }
        }
        Ok(())
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

/// SiLU in FP32: `g / (1 + e^-g)`.
#[inline]
pub(crate) fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// The CPU GEMV. `x` holds `m` rows of `k` BF16 values with row stride `rs`; returns
/// BF16 `[m, n]` (or `[m, n/2]` with `silu_mul`) with the numerics of the module docs.
#[allow(clippy::too_many_arguments)]
pub fn gemv_cpu(
    x: &[bf16],
    rs: usize,
    m: usize,
    k: usize,
    n: usize,
    rows: &WeightRows<'_>,
    global_scale: f32,
    silu_mul: bool,
) -> Result<Vec<bf16>> {
    rows.check(n, k)?;
    if m == 0 || x.len() < (m - 1) * rs + k {
        bail!(
            "gemv: x has {} values, too few for {m} rows of {k} (stride {rs})",
            x.len()
        );
    }
    if silu_mul && !n.is_multiple_of(2) {
        bail!("gemv: silu_mul needs an even N, got {n}");
    }
    let xf: Vec<f32> = (0..m)
        .flat_map(|i| x[i * rs..i * rs + k].iter().map(|v| v.to_f32()))
        .collect();
    let pairs = e2m1_pair_table();
    // acc[row * m + token], rows split across threads in chunks.
    let mut acc = vec![0f32; n * m];
    const ROWS_PER_TASK: usize = 16;
    acc.par_chunks_mut(ROWS_PER_TASK * m)
        .enumerate()
        .for_each_init(
            || vec![0f32; k],
            |wrow, (task, out)| {
                for (r, o) in out.chunks_exact_mut(m).enumerate() {
                    let row = task * ROWS_PER_TASK + r;
                    rows.decode_row(row, k, &pairs, wrow);
                    for (t, v) in o.iter_mut().enumerate() {
                        *v = dot(&xf[t * k..(t + 1) * k], wrow);
                    }
                }
            },
        );
    let round = |v: f32| bf16::from_f32(v * global_scale);
    let mut out;
    if silu_mul {
        let h = n / 2;
        out = vec![bf16::ZERO; m * h];
        for t in 0..m {
            for j in 0..h {
                let g = round(acc[j * m + t]).to_f32();
                let u = round(acc[(j + h) * m + t]).to_f32();
                out[t * h + j] = bf16::from_f32(silu(g) * u);
            }
        }
    } else {
        out = vec![bf16::ZERO; m * n];
        for t in 0..m {
            for j in 0..n {
                out[t * n + j] = round(acc[j * m + t]);
            }
        }
    }
    Ok(out)
}
