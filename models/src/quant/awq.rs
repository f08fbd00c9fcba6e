//! Activation-aware channel scaling (AWQ, Lin et al. 2023, "AWQ: Activation-aware Weight
//! Quantization for LLM Compression and Acceleration") ahead of GPTQ, folded so that the
//! checkpoint stays an ordinary ModelOpt NVFP4 one.
//!
//! For a Linear group `W` with input `x`, `W·x = (W·diag(s))·(x/s)` for any positive `s`:
//! the weights are quantized as `W·diag(s)` and the `1/s` goes into whatever produces `x`
//! (the RMSNorm weight `γ` before q/k/v and gate/up, the rows of up_proj before down_proj;
//! o_proj is left alone: the v_proj → o_proj fold was tried and removed, see
//! `docs/accuracy.md`).
//! Large `s_j` on the channels with large activations give their weights more of the
//! NVFP4 grid. `s_j = a_j^α / √(max a^α · min a^α)` with `a_j = √H_jj` (the channel's RMS
//! over the calibration inputs), `α` from a small grid by the lowest round-to-nearest loss
//! `tr(E H Eᵀ)`, `E = W − dequant(quant(W·diag(s)))·diag(1/s)`. GPTQ then quantizes
//! `W·diag(s)` with the scaled inputs' Hessian `diag(1/s) H diag(1/s)`, dampened as the
//! unscaled problem would be (`λ = damp · mean(diag H)` on `H`, so `λ/s_j²` on the scaled
//! diagonal): dampening uniformly in the scaled space instead measured worse on the
//! tuning split (`docs/accuracy.md`). The calibration driver (`quant/calib.rs`) applies
//! it in its sequential mode.

use super::hessian::Hessian;
use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use candle_fp4::nvfp4::{global_scale_for_amax, quantize_nvfp4_slice};

/// The α grid searched per group (α = 0 is "no scaling").
pub const AWQ_ALPHAS: [f64; 4] = [0.0, 0.25, 0.5, 0.75];

/// Per-channel scales `s_j = a_j^α` normalized by `√(max·min)` over the live channels, `a`
/// the channel RMS (`√H_jj`). Dead channels (`a_j = 0`) get 1.
pub fn awq_scales(rms: &[f64], alpha: f64) -> Result<Vec<f32>> {
    if !(alpha.is_finite() && alpha >= 0.0) {
        bail!("awq: α = {alpha} must be a finite number ≥ 0");
    }
    if let Some(v) = rms.iter().find(|v| !(v.is_finite() && **v >= 0.0)) {
        bail!("awq: channel RMS {v} must be finite and ≥ 0");
    }
    let live = || rms.iter().filter(|v| **v > 0.0).map(|v| v.powf(alpha));
    let (lo, hi) = live().fold((f64::INFINITY, 0f64), |(l, h), v| (l.min(v), h.max(v)));
    if hi == 0.0 || alpha == 0.0 {
        return Ok(vec![1.0; rms.len()]);
    }
    let norm = (lo * hi).sqrt();
    let s: Vec<f32> = rms
        .iter()
        .map(|&v| {
            if v > 0.0 {
                (v.powf(alpha) / norm) as f32
            } else {
                1.0
            }
        })
        .collect();
    if let Some(v) = s.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
        bail!("awq: scale {v} out of range (the channel RMS spread is too wide for f32)");
    }
    Ok(s)
}

/// `W·diag(s)` for a row-major `[n, k]` weight.
pub fn scale_columns(w: &[f32], k: usize, s: &[f32]) -> Vec<f32> {
    w.chunks_exact(k)
        .flat_map(|r| r.iter().zip(s).map(|(a, b)| a * b))
        .collect()
}

/// Round-to-nearest loss `Σ_groups tr(E H Eᵀ)` of a Linear group quantized as
/// `W·diag(s)` (one global scale shared over the group, as ModelOpt's), measured against
/// the unscaled `W` with the unscaled input Hessian `h`.
pub fn rtn_loss(weights: &[(Vec<f32>, usize, usize)], s: &[f32], h: &[f64]) -> Result<f64> {
    let k = s.len();
    if h.len() != k * k {
        bail!("awq: Hessian of {} values for K = {k}", h.len());
    }
    let scaled: Vec<Vec<f32>> = weights
        .iter()
        .map(|(w, _, wk)| {
            if *wk != k || w.len() % k != 0 {
                bail!(
                    "awq: weight [{}, {wk}] does not match K = {k}",
                    w.len() / k.max(1)
                );
            }
            Ok(scale_columns(w, k, s))
        })
        .collect::<Result<_>>()?;
    let gs = scaled
        .iter()
        .map(|w| global_scale_for_amax(w.iter().fold(0f32, |m, v| m.max(v.abs()))))
        .fold(0f32, f32::max);
    if gs == 0.0 {
        return Ok(0.0);
    }
    let deqs = weights
        .iter()
        .zip(&scaled)
        .map(|((_, n, _), ws)| Ok(quantize_nvfp4_slice(ws, *n, k, Some(gs))?.dequantize()))
        .collect::<Result<Vec<_>>>()?;
    fold_loss(weights, s, h, &deqs)
}

/// `Σ tr(E H Eᵀ)` with `E = W − Q·diag(1/s)` for the dequantized scaled weights `deqs`.
pub fn fold_loss(
    weights: &[(Vec<f32>, usize, usize)],
    s: &[f32],
    h: &[f64],
    deqs: &[Vec<f32>],
) -> Result<f64> {
    let k = s.len();
    let ht = Tensor::from_slice(h, (k, k), &Device::Cpu)?;
    let mut loss = 0.0;
    for ((w, n, _), deq) in weights.iter().zip(deqs) {
        let e: Vec<f64> = w
            .iter()
            .zip(deq)
            .enumerate()
            .map(|(i, (a, q))| *a as f64 - *q as f64 / s[i % k] as f64)
            .collect();
        let et = Tensor::from_vec(e, (*n, k), &Device::Cpu)?;
        loss += (et.matmul(&ht)? * &et)?.sum_all()?.to_scalar::<f64>()?;
    }
    Ok(loss)
}

/// The scales of the α in `alphas` with the lowest [`rtn_loss`], with that α.
pub fn search_scales(
    weights: &[(Vec<f32>, usize, usize)],
    h: &Hessian,
    alphas: &[f64],
) -> Result<(f64, Vec<f32>)> {
    let m = h.matrix()?;
    let k = h.k();
    let rms: Vec<f64> = (0..k).map(|i| m[i * k + i].max(0.0).sqrt()).collect();
    let mut best: Option<(f64, f64, Vec<f32>)> = None;
    for &a in alphas {
        let s = awq_scales(&rms, a)?;
        let l = rtn_loss(weights, &s, &m)?;
        if best.as_ref().is_none_or(|b| l < b.0) {
            best = Some((l, a, s));
        }
    }
    match best {
        Some((_, a, s)) => Ok((a, s)),
        None => bail!("awq: empty α grid"),
    }
}

/// Divides row `r` of the row-major `[n, k]` weight `w` by `s[r]` (`diag(1/s)·W`: the
/// producer's side of a fold).
pub fn divide_rows(w: &mut [f32], k: usize, s: &[f32]) -> Result<()> {
    if k == 0 || w.len() != s.len() * k {
        bail!(
            "awq: {} row scales for a weight of {} values with {k} columns",
            s.len(),
            w.len()
        );
    }
    for (row, v) in w.chunks_exact_mut(k).zip(s) {
        row.iter_mut().for_each(|x| *x /= v);
    }
    Ok(())
}
