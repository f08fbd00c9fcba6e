//! Norm tweaking (Li et al. 2023, "Norm Tweaking: High-performance Low-bit Quantization of
//! Large Language Models") after GPTQ: once a decoder block's Linears are quantized, its two
//! RMSNorm weights `γ` (`input_layernorm`, `post_attention_layernorm`) are adjusted so that
//! the quantized block's output matches the unquantized block's on the calibration tokens.
//! The norms are unquantized tensors of the checkpoint, so the output stays a plain
//! ModelOpt NVFP4 checkpoint.
//!
//! Objective: the mean squared error between the block's output with the quantized
//! Linears and the tweaked norms, and the unquantized block's output, both fed the same
//! input (the partly quantized model's hidden states, as sequential GPTQ calibrates each
//! group on them). Only `γ` moves, multiplicatively: `γ = γ₀ ∘ (1 + δ)`, `δ` from 0 by
//! full-batch Adam ([`NormTweakParams`]); the result is rounded to BF16 once, and kept only
//! if its loss (with the rounded values) is below the untweaked block's.
//!
//! The loss is computed by [`BlockParams::forward`], a block forward built from candle's
//! differentiable tensor ops (the inference path's fused RMSNorm and RoPE kernels have no
//! backward): RMSNorm, q/k/v, RoPE, causal grouped-query attention, o_proj, residual,
//! RMSNorm, gate/up, SiLU, down_proj, residual, all in F32 on the dequantized weights. With
//! `round_bf16` it rounds to BF16 where `QuantLinear`'s matmul path and the KV cache do
//! (projection inputs and outputs, the global-scale product, K after RoPE, `silu(g)·u`),
//! so that it computes what the inference forward computes; the gradient passes through
//! the roundings unchanged (straight-through).

use crate::config::LlamaConfig;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, Var, D};
use candle_fp4::nvfp4::Nvfp4Quantized;
use candle_fp4::quant_linear::QuantLinear;
use candle_nn::optim::{AdamW, Optimizer, ParamsAdamW};

/// Norm-tweaking settings.
#[derive(Debug, Clone, PartialEq)]
pub struct NormTweakParams {
    /// Full-batch Adam steps per block.
    pub steps: usize,
    /// Adam's learning rate on the relative change `δ` of `γ` (so about the largest
    /// relative change per step).
    pub lr: f64,
}

impl Default for NormTweakParams {
    fn default() -> Self {
        Self {
            steps: 20,
            lr: 2e-3,
        }
    }
}

impl NormTweakParams {
    /// Rejects settings that cannot work: no steps, too many, or a learning rate that is
    /// not in (0, 1].
    pub fn check(&self) -> Result<()> {
        if self.steps == 0 || self.steps > 10_000 {
            bail!("norm tweaking: {} steps, expected 1 to 10000", self.steps);
        }
        if !(self.lr.is_finite() && self.lr > 0.0 && self.lr <= 1.0) {
            bail!(
                "norm tweaking: learning rate {} must be a number in (0, 1]",
                self.lr
            );
        }
        Ok(())
    }
}

/// `x` rounded to BF16 and back (when `round`).
fn bf16(x: &Tensor, round: bool) -> candle_core::Result<Tensor> {
    if round {
        x.to_dtype(DType::BF16)?.to_dtype(DType::F32)
    } else {
        Ok(x.clone())
    }
}

/// A projection as `QuantLinear`'s matmul path computes it: BF16 input; NVFP4: the
/// product with `e2m1·e4m3` rounded to BF16, times the global scale, rounded again; BF16
/// weights: one rounding; a bias added in BF16 (one more rounding).
#[derive(Debug, Clone)]
pub struct DiffLinear {
    /// F32 `[N, K]`: `e2m1·e4m3` (NVFP4, exact) or the BF16 weight.
    w: Tensor,
    global_scale: Option<f32>,
    bias: Option<Tensor>,
}

impl DiffLinear {
    /// The layer's weights, dequantized without the global scale (exact).
    pub fn from_quant_linear(l: &QuantLinear) -> Result<Self> {
        let dev = l.device().clone();
        let (w, global_scale) = match l.to_nvfp4()? {
            Some(q) => {
                let gs = q.global_scale;
                let unit = Nvfp4Quantized {
                    global_scale: 1.0,
                    ..q
                };
                let w =
                    Tensor::from_vec(unit.dequantize(), (l.out_features(), l.in_features()), &dev)?;
                (w, Some(gs))
            }
            None => (l.dequantize()?, None),
        };
        let bias = l.bias().map(|b| b.to_dtype(DType::F32)).transpose()?;
        Ok(Self {
            w,
            global_scale,
            bias,
        })
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.w.dims()[0]
    }

    fn forward(&self, x: &Tensor, round: bool) -> candle_core::Result<Tensor> {
        let x = bf16(x, round)?;
        let mut y = bf16(&x.matmul(&self.w.t()?)?, round)?;
        if let Some(g) = self.global_scale {
            y = bf16(&y.affine(g as f64, 0.0)?, round)?;
        }
        if let Some(b) = &self.bias {
            y = bf16(&y.broadcast_add(b)?, round)?;
        }
        Ok(y)
    }
}

/// The outputs of `ls` on `x`, concatenated along the features (q|k|v, gate|up).
fn forward_cat(ls: &[DiffLinear], x: &Tensor, round: bool) -> candle_core::Result<Tensor> {
    let ys = ls
        .iter()
        .map(|l| l.forward(x, round))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Tensor::cat(&ys, D::Minus1)
}

/// One decoder block's weights for the differentiable forward.
#[derive(Debug, Clone)]
pub struct BlockParams {
    /// `input_layernorm`'s weight, F32 values.
    pub attn_norm: Vec<f32>,
    /// `post_attention_layernorm`'s weight, F32 values.
    pub mlp_norm: Vec<f32>,
    /// q, k, v (or one fused layer), outputs concatenated.
    qkv: Vec<DiffLinear>,
    o: DiffLinear,
    /// gate, up (or one fused `[gate | up]` layer), outputs concatenated.
    gate_up: Vec<DiffLinear>,
    down: DiffLinear,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    eps: f64,
    inv_freq: Vec<f32>,
}

impl BlockParams {
    /// A block of the model `cfg` from its norms and projections.
    pub fn new(
        cfg: &LlamaConfig,
        attn_norm: Vec<f32>,
        mlp_norm: Vec<f32>,
        qkv: Vec<DiffLinear>,
        o: DiffLinear,
        gate_up: Vec<DiffLinear>,
        down: DiffLinear,
    ) -> Result<Self> {
        let h = cfg.hidden_size;
        if attn_norm.len() != h || mlp_norm.len() != h {
            bail!(
                "norm tweaking: norms of {} and {} values, hidden size {h}",
                attn_norm.len(),
                mlp_norm.len()
            );
        }
        let (nh, nkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let qkv_n: usize = qkv.iter().map(DiffLinear::out_features).sum();
        let gu_n: usize = gate_up.iter().map(DiffLinear::out_features).sum();
        if qkv_n != (nh + 2 * nkv) * hd || gu_n != 2 * cfg.intermediate_size {
            bail!("norm tweaking: q/k/v give {qkv_n} outputs, gate/up {gu_n}: not the config's");
        }
        if nkv == 0 || !nh.is_multiple_of(nkv) || !hd.is_multiple_of(2) {
            bail!("norm tweaking: {nh} heads over {nkv} KV heads of {hd}");
        }
        Ok(Self {
            attn_norm,
            mlp_norm,
            qkv,
            o,
            gate_up,
            down,
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
            eps: cfg.rms_norm_eps,
            inv_freq: crate::rope::inv_freq(cfg),
        })
    }

    /// The block over `x` (F32 `[t, hidden]`, one sequence from position 0) with the norm
    /// weights `attn_norm`, `mlp_norm` (F32 `[hidden]`, possibly tracked for gradients).
    /// See the module docs for `round_bf16`.
    pub fn forward(
        &self,
        x: &Tensor,
        attn_norm: &Tensor,
        mlp_norm: &Tensor,
        round_bf16: bool,
    ) -> Result<Tensor> {
        let r = round_bf16;
        let t = x.dim(0)?;
        let (nh, nkv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let n_rep = nh / nkv;
        let dev = x.device();
        let h = self.rms_norm(x, attn_norm)?;
        let qkv = forward_cat(&self.qkv, &h, r)?;
        let heads = |start: usize, n: usize| -> candle_core::Result<Tensor> {
            qkv.narrow(1, start * hd, n * hd)?
                .reshape((t, n, hd))?
                .transpose(0, 1)?
                .contiguous()
        };
        // RoPE tables as `Rope::new` computes them (FP32 angle `pos · inv_freq`).
        let half = hd / 2;
        let (mut cos, mut sin) = (Vec::with_capacity(t * half), Vec::with_capacity(t * half));
        for p in 0..t {
            for &w in &self.inv_freq {
                let a = p as f32 * w;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let cos = Tensor::from_vec(cos, (1, t, half), dev)?;
        let sin = Tensor::from_vec(sin, (1, t, half), dev)?;
        let rope = |x: &Tensor| -> candle_core::Result<Tensor> {
            let x1 = x.narrow(2, 0, half)?;
            let x2 = x.narrow(2, half, half)?;
            let a = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
            let b = (x1.broadcast_mul(&sin)? + x2.broadcast_mul(&cos)?)?;
            Tensor::cat(&[a, b], 2)
        };
        let q = rope(&heads(0, nh)?)?;
        // The KV cache holds K (after RoPE) and V in BF16.
        let k = bf16(&rope(&heads(nh, nkv)?)?, r)?;
        let v = bf16(&heads(nh + nkv, nkv)?, r)?;
        let q = q.reshape((nkv, n_rep * t, hd))?;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut att = (q.matmul(&k.t()?.contiguous()?)? * scale)?;
        if t > 1 {
            let m: Vec<f32> = (0..t)
                .flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
                .collect();
            let mask = Tensor::from_vec(m, (t, t), dev)?;
            att = att
                .reshape((nkv, n_rep, t, t))?
                .broadcast_add(&mask)?
                .reshape((nkv, n_rep * t, t))?;
        }
        let att = candle_nn::ops::softmax(&att, D::Minus1)?;
        let y = att
            .matmul(&v)?
            .reshape((nh, t, hd))?
            .transpose(0, 1)?
            .reshape((t, nh * hd))?;
        let x = (x + self.o.forward(&y, r)?)?;
        let h = self.rms_norm(&x, mlp_norm)?;
        let gu = forward_cat(&self.gate_up, &h, r)?;
        let i = gu.dim(1)? / 2;
        let m = bf16(&(gu.narrow(1, 0, i)?.silu()? * gu.narrow(1, i, i)?)?, r)?;
        Ok((x + self.down.forward(&m, r)?)?)
    }

    fn rms_norm(&self, x: &Tensor, g: &Tensor) -> candle_core::Result<Tensor> {
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        x.broadcast_div(&(ms + self.eps)?.sqrt()?)?.broadcast_mul(g)
    }

    /// The mean squared error of the block's output against `targets` over the windows
    /// `inputs` (each `[t, hidden]`, F32), with the norm weights given.
    pub fn loss(
        &self,
        inputs: &[Tensor],
        targets: &[Tensor],
        attn_norm: &Tensor,
        mlp_norm: &Tensor,
        round_bf16: bool,
    ) -> Result<Tensor> {
        if inputs.len() != targets.len() || inputs.is_empty() {
            bail!(
                "norm tweaking: {} input windows, {} targets",
                inputs.len(),
                targets.len()
            );
        }
        let mut total: Option<Tensor> = None;
        let mut count = 0usize;
        for (x, y) in inputs.iter().zip(targets) {
            if x.dims() != y.dims() {
                bail!(
                    "norm tweaking: input {:?} and target {:?} differ in shape",
                    x.dims(),
                    y.dims()
                );
            }
            let out = self.forward(x, attn_norm, mlp_norm, round_bf16)?;
            let se = (out - y)?.sqr()?.sum_all()?;
            count += y.elem_count();
            total = Some(match total {
                None => se,
                Some(s) => (s + se)?,
            });
        }
        let total = total.context("norm tweaking: no windows")?;
        Ok((total / count as f64)?)
    }
}

/// What [`tweak_norms`] did for one block.
#[derive(Debug, Clone)]
pub struct NormTweakResult {
    /// The new `input_layernorm` and `post_attention_layernorm` weights (BF16 values);
    /// the block's own if tweaking did not lower the loss.
    pub attn_norm: Vec<f32>,
    pub mlp_norm: Vec<f32>,
    /// The loss with the block's own norms and with the returned ones (BF16-rounded
    /// forward, [`BlockParams::loss`]).
    pub loss_before: f64,
    pub loss_after: f64,
    /// Whether the tweaked norms were kept.
    pub kept: bool,
}

fn round_vec(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|x| half::bf16::from_f32(*x).to_f32())
        .collect()
}

/// Tunes the block's two norm weights so that its output on `inputs` matches `targets`
/// (mean squared error), by `params.steps` full-batch Adam steps on the relative change
/// `δ` (`γ = γ₀ ∘ (1 + δ)`), then rounds them to BF16 once. Returns the block's own norms
/// unchanged unless the rounded result has a lower loss.
pub fn tweak_norms(
    block: &BlockParams,
    inputs: &[Tensor],
    targets: &[Tensor],
    params: &NormTweakParams,
) -> Result<NormTweakResult> {
    params.check()?;
    let h = block.attn_norm.len();
    let dev = inputs
        .first()
        .context("norm tweaking: no windows")?
        .device();
    let g_a = Tensor::from_slice(&block.attn_norm, h, dev)?;
    let g_m = Tensor::from_slice(&block.mlp_norm, h, dev)?;
    let loss_before = block
        .loss(inputs, targets, &g_a, &g_m, true)?
        .to_scalar::<f32>()? as f64;
    let d_a = Var::zeros(h, DType::F32, dev)?;
    let d_m = Var::zeros(h, DType::F32, dev)?;
    let mut opt = AdamW::new(
        vec![d_a.clone(), d_m.clone()],
        ParamsAdamW {
            lr: params.lr,
            weight_decay: 0.0,
            ..Default::default()
        },
    )?;
    for _ in 0..params.steps {
        let a = (g_a.clone() * (d_a.as_tensor() + 1.0)?)?;
        let m = (g_m.clone() * (d_m.as_tensor() + 1.0)?)?;
        let loss = block.loss(inputs, targets, &a, &m, true)?;
        opt.backward_step(&loss)?;
    }
    let a = round_vec(&(g_a * (d_a.as_tensor() + 1.0)?)?.to_vec1::<f32>()?);
    let m = round_vec(&(g_m * (d_m.as_tensor() + 1.0)?)?.to_vec1::<f32>()?);
    if a.iter().chain(&m).any(|v| !v.is_finite()) {
        bail!("norm tweaking: non-finite norm weights (learning rate too high?)");
    }
    let ta = Tensor::from_slice(&a, h, dev)?;
    let tm = Tensor::from_slice(&m, h, dev)?;
    let loss_after = block
        .loss(inputs, targets, &ta, &tm, true)?
        .to_scalar::<f32>()? as f64;
    Ok(if loss_after < loss_before {
        NormTweakResult {
            attn_norm: a,
            mlp_norm: m,
            loss_before,
            loss_after,
            kept: true,
        }
    } else {
        NormTweakResult {
            attn_norm: block.attn_norm.clone(),
            mlp_norm: block.mlp_norm.clone(),
            loss_before,
            loss_after: loss_before,
            kept: false,
        }
    })
}
