//! GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative
//! Pre-trained Transformers") for NVFP4: an optional replacement for ModelOpt's
//! round-to-nearest that writes the same checkpoint format.
//!
//! For one Linear `W` `[N, K]` with calibration inputs `X` `[n, K]`, GPTQ minimizes
//! `‖(W − Ŵ)Xᵀ‖²` column by column: with `H = XᵀX/n + λI` ([`Hessian`]) and the upper
//! Cholesky factor `U` of `H⁻¹` (`H⁻¹ = UᵀU`, [`super::hessian::inverse_cholesky_upper`]),
//! column `j` is rounded and its error `e = (w_j − q_j)/U_jj` is spread over the columns
//! not yet rounded, `w_{>j} −= e · U_{j,>j}` (the Optimal-Brain-Surgeon update). Rows are
//! independent given `H`, so this runs row tile by row tile (rayon) with no lazy batching.
//!
//! What is NVFP4-specific: at the first column of every 16-column block, the block's E4M3
//! scale is computed per row from the *current* (error-updated) weights of that block with
//! ModelOpt's rule ([`candle_fp4::nvfp4::block_scale_e4m3`]) against the tensor's global
//! scale, which stays ModelOpt's (from the original weights' amax, shared over a group);
//! every column is then rounded with the same E2M1 code ModelOpt's quantizer picks for that
//! scale. The result is an ordinary [`Nvfp4Quantized`] that any NVFP4 loader decodes.
//! Optionally ([`GptqParams::scale_search`]) each block tries a few E4M3 scales next to
//! ModelOpt's and keeps the one with the lowest GPTQ loss over the block.
//!
//! With `H` a multiple of the identity, `U` is diagonal, no error is propagated, and the
//! result is RTN's (ModelOpt's) bit for bit.

use super::hessian::{prepare, Hessian};
use anyhow::{bail, Context, Result};
use candle_fp4::nvfp4::{
    block_scale_e4m3, e2m1_decode, e2m1_encode, e4m3_decode, global_scale_for_amax, Nvfp4Quantized,
    BLOCK_SIZE,
};
use rayon::prelude::*;

/// GPTQ settings.
#[derive(Debug, Clone, PartialEq)]
pub struct GptqParams {
    /// Dampening: `λ = damp · mean(diag H)` is added to the diagonal (GPTQ's `percdamp`).
    pub damp: f64,
    /// Per block, also try the E4M3 scales this many codes below ModelOpt's (and one
    /// above) and keep the one with the lowest GPTQ loss over the block. 0 = ModelOpt's
    /// scale rule on the updated weights.
    pub scale_search: u8,
    /// Block-level act-order: process the 16-column blocks in order of decreasing
    /// `Σ diag(H)` over the block (GPTQ's act-order, kept at block granularity so every
    /// NVFP4 block stays whole and gets its scale at its first column).
    pub act_order: bool,
}

impl Default for GptqParams {
    fn default() -> Self {
        Self {
            damp: 0.01,
            scale_search: 0,
            act_order: false,
        }
    }
}

/// Rounds `v` with the block scale byte `s` (ModelOpt's code choice); returns the code and
/// its dequantized value `e2m1 · (f32(e4m3) · global_scale)`.
#[inline]
fn round_nvfp4(v: f64, s: u8, gs: f32) -> (u8, f64) {
    let denom = e4m3_decode(s) * gs;
    let code = e2m1_encode(v as f32 / denom);
    (code, (e2m1_decode(code) * denom) as f64)
}

/// GPTQ's loss over one block `w` (columns `j0..j0+16`) rounded with scale `s`, updating
/// only within the block.
fn block_loss(w: &[f64], u: &[f64], k: usize, j0: usize, s: u8, gs: f32) -> f64 {
    let mut b = [0f64; BLOCK_SIZE];
    b.copy_from_slice(w);
    let mut loss = 0.0;
    for t in 0..BLOCK_SIZE {
        let j = j0 + t;
        let (_, q) = round_nvfp4(b[t], s, gs);
        let e = (b[t] - q) / u[j * k + j];
        loss += e * e;
        for (x, &c) in b[t + 1..]
            .iter_mut()
            .zip(&u[j * k + j + 1..j * k + j0 + BLOCK_SIZE])
        {
            *x -= e * c;
        }
    }
    loss
}

/// The block scale for one row's current block `w`: ModelOpt's rule, or the best of the
/// candidates around it when searching.
fn choose_scale(w: &[f64], u: &[f64], k: usize, j0: usize, gs: f32, search: u8) -> u8 {
    let bamax = w.iter().fold(0f32, |m, v| m.max((*v as f32).abs()));
    let nominal = block_scale_e4m3(bamax, gs);
    if search == 0 || bamax == 0.0 {
        return nominal;
    }
    let mut best = (block_loss(w, u, k, j0, nominal, gs), nominal);
    // Positive E4M3 bytes are ordered like their values: 0x01 (2^-9) ..= 0x7E (448).
    let lo = nominal.saturating_sub(search).max(1);
    let hi = nominal.saturating_add(1).min(0x7E);
    for s in lo..=hi {
        if s == nominal {
            continue;
        }
        let l = block_loss(w, u, k, j0, s, gs);
        if l < best.0 {
            best = (l, s);
        }
    }
    best.1
}

/// Rows processed together (each row of `U` read once per tile).
const ROW_TILE: usize = 8;

/// GPTQ of one row-major weight `[n, k]` against `global_scale` (which must be at least
/// `amax(|w|) / (6·448)`, as for RTN) with the calibration Hessian `h`.
pub fn gptq_quantize(
    w: &[f32],
    n: usize,
    k: usize,
    h: &Hessian,
    global_scale: f32,
    params: &GptqParams,
) -> Result<Nvfp4Quantized> {
    gptq_quantize_group(&[(w.to_vec(), n, k)], h, Some(global_scale), params)?
        .pop()
        .context("gptq: no output")
}

/// GPTQ of a group of Linears with the same input (q/k/v or gate/up): one Hessian, one
/// global scale shared as ModelOpt shares it (the largest of the members' own
/// `amax / (6·448)`, unless `global_scale` is given). Each `(values, n, k)` is a row-major
/// F32 weight with `k = h.k()`.
pub fn gptq_quantize_group(
    weights: &[(Vec<f32>, usize, usize)],
    h: &Hessian,
    global_scale: Option<f32>,
    params: &GptqParams,
) -> Result<Vec<Nvfp4Quantized>> {
    let k = h.k();
    if k == 0 || !k.is_multiple_of(BLOCK_SIZE) {
        bail!("gptq: in_features {k} must be a positive multiple of {BLOCK_SIZE}");
    }
    if !(params.damp.is_finite() && params.damp >= 0.0) {
        bail!(
            "gptq: dampening {} must be a finite number ≥ 0",
            params.damp
        );
    }
    let mut own = 0f32;
    for (w, n, wk) in weights {
        if *wk != k || w.len() != n * k {
            bail!(
                "gptq: a weight of {} values [{n}, {wk}] does not match the Hessian's K = {k}",
                w.len()
            );
        }
        if let Some(v) = w.iter().find(|v| !v.is_finite()) {
            bail!("gptq: non-finite weight {v}");
        }
        own = own.max(global_scale_for_amax(
            w.iter().fold(0f32, |m, v| m.max(v.abs())),
        ));
    }
    let gs = match global_scale {
        Some(g) if !(g.is_finite() && g > 0.0) => {
            bail!("gptq: global scale {g} must be a positive finite number")
        }
        Some(g) if g < own => {
            bail!("gptq: global scale {g} is below the weights' amax/(6*448) = {own}")
        }
        Some(g) => g,
        None if own == 0.0 => bail!("gptq: the weights are all zeros; the global scale would be 0"),
        None => own,
    };
    let s_cols = k / BLOCK_SIZE;
    // Column order: block permutation `order[b]` = the original block processed b-th.
    let mut order: Vec<usize> = (0..s_cols).collect();
    let mut h = h.clone();
    if params.act_order {
        let m = h.matrix()?;
        let weight = |b: usize| -> f64 {
            (b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE)
                .map(|i| m[i * k + i])
                .sum()
        };
        order.sort_by(|&a, &b| weight(b).total_cmp(&weight(a)));
        let col = |j: usize| order[j / BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE;
        h = Hessian::from_matrix(
            k,
            (0..k * k)
                .map(|idx| m[col(idx / k) * k + col(idx % k)])
                .collect(),
        )?;
    }
    let col = |j: usize| order[j / BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE;
    let (u, dead) = prepare(&h, params.damp)?;
    weights
        .iter()
        .map(|(w, n, _)| {
            // Row-major in processing order (column j of `rows` is original column col(j)).
            let mut rows: Vec<f64> = (0..n * k)
                .map(|idx| w[idx / k * k + col(idx % k)] as f64)
                .collect();
            for r in rows.chunks_exact_mut(k) {
                for (x, &d) in r.iter_mut().zip(&dead) {
                    if d {
                        *x = 0.0;
                    }
                }
            }
            let mut codes = vec![0u8; n * k];
            let mut scales = vec![0u8; n * s_cols];
            rows.par_chunks_mut(ROW_TILE * k)
                .zip(codes.par_chunks_mut(ROW_TILE * k))
                .zip(scales.par_chunks_mut(ROW_TILE * s_cols))
                .for_each(|((wt, ct), st)| {
                    quantize_tile(wt, ct, st, &u, k, gs, params.scale_search)
                });
            if params.act_order {
                // Back to the original column order.
                let mut c = vec![0u8; n * k];
                let mut sc = vec![0u8; n * s_cols];
                for r in 0..*n {
                    for j in 0..k {
                        c[r * k + col(j)] = codes[r * k + j];
                    }
                    for (b, &ob) in order.iter().enumerate() {
                        sc[r * s_cols + ob] = scales[r * s_cols + b];
                    }
                }
                codes = c;
                scales = sc;
            }
            let weight = codes.chunks_exact(2).map(|c| c[0] | (c[1] << 4)).collect();
            Ok(Nvfp4Quantized {
                n: *n,
                k,
                weight,
                weight_scale: scales,
                global_scale: gs,
            })
        })
        .collect()
}

/// GPTQ over a tile of rows `w` (`[r, k]`, updated in place), writing one code per weight
/// and one scale byte per block.
fn quantize_tile(
    w: &mut [f64],
    codes: &mut [u8],
    scales: &mut [u8],
    u: &[f64],
    k: usize,
    gs: f32,
    search: u8,
) {
    let rows = w.len() / k;
    let s_cols = k / BLOCK_SIZE;
    let mut err = [0f64; ROW_TILE];
    let mut sb = [0u8; ROW_TILE];
    for blk in 0..s_cols {
        let j0 = blk * BLOCK_SIZE;
        for r in 0..rows {
            let s = choose_scale(
                &w[r * k + j0..r * k + j0 + BLOCK_SIZE],
                u,
                k,
                j0,
                gs,
                search,
            );
            scales[r * s_cols + blk] = s;
            sb[r] = s;
        }
        for j in j0..j0 + BLOCK_SIZE {
            let d = u[j * k + j];
            for r in 0..rows {
                let v = w[r * k + j];
                let (code, q) = round_nvfp4(v, sb[r], gs);
                codes[r * k + j] = code;
                err[r] = (v - q) / d;
            }
            let urow = &u[j * k + j + 1..(j + 1) * k];
            for r in 0..rows {
                let e = err[r];
                if e != 0.0 {
                    for (x, &c) in w[r * k + j + 1..(r + 1) * k].iter_mut().zip(urow) {
                        *x -= e * c;
                    }
                }
            }
        }
    }
}
