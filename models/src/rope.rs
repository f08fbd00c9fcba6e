//! Rotary position embeddings (the "rotate half" form of transformers' Llama), with
//! linear and Llama 3.1 (`llama3`) frequency scaling.

use crate::config::{LlamaConfig, RopeScaling};
use candle_core::{DType, Device, Result, Tensor};
use candle_fp4::rope::QkvRope;

/// The inverse frequencies `1 / theta^(2i/d)`, `i < d/2`, computed in FP32 as
/// transformers does, then scaled.
pub fn inv_freq(cfg: &LlamaConfig) -> Vec<f32> {
    let d = cfg.head_dim;
    let base = cfg.rope_theta as f32;
    let mut f: Vec<f32> = (0..d)
        .step_by(2)
        .map(|i| 1.0 / base.powf(i as f32 / d as f32))
        .collect();
    match cfg.rope_scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => f.iter_mut().for_each(|x| *x /= factor as f32),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old = original_max_position_embeddings as f64;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            for x in f.iter_mut() {
                let inv = *x as f64;
                let wavelen = 2.0 * std::f64::consts::PI / inv;
                *x = if wavelen < high_wavelen {
                    inv
                } else if wavelen > low_wavelen {
                    inv / factor
                } else {
                    let smooth =
                        (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * inv / factor + smooth * inv
                } as f32;
            }
        }
    }
    f
}

/// `cos` and `sin` tables `[max_len, head_dim / 2]` in `dtype`: angle `pos · inv_freq`
/// computed in FP32 (transformers' order).
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    /// BF16 tables: the decode step's fused q|k|v rope (one kernel on a GPU).
    fused: Option<QkvRope>,
}

impl Rope {
    /// The tables for positions `0..max_len` of `cfg`'s head dimension and frequencies.
    /// Errors (rather than aborting) when `max_len · head_dim / 2` overflows or cannot be
    /// allocated.
    pub fn new(cfg: &LlamaConfig, max_len: usize, dtype: DType, device: &Device) -> Result<Self> {
        const WHAT: &str = "Rope::new: max_len × head_dim/2";
        let f = inv_freq(cfg);
        let h = f.len();
        let n = candle_fp4::error::checked_product(WHAT, &[max_len, h])?;
        let bytes = candle_fp4::error::checked_mul(WHAT, n as u64, 8)?;
        candle_fp4::error::check_host_alloc(WHAT, bytes)?;
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        for v in [&mut cos, &mut sin] {
            v.try_reserve_exact(n)
                .map_err(|_| candle_fp4::error::SizeError::Alloc {
                    what: WHAT.into(),
                    bytes,
                })?;
        }
        for p in 0..max_len {
            for &w in &f {
                let a = p as f32 * w;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let cos = Tensor::from_vec(cos, (max_len, h), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (max_len, h), device)?.to_dtype(dtype)?;
        let fused = if dtype == DType::BF16 && cfg.head_dim.is_multiple_of(2) {
            Some(QkvRope::new(
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                &cos,
                &sin,
            )?)
        } else {
            None
        };
        Ok(Self { cos, sin, fused })
    }

    /// The fused q|k|v rope of the decode step (BF16 tables only): bit-identical to
    /// [`apply_at`](Self::apply_at) on the split heads.
    pub fn fused(&self) -> Option<&QkvRope> {
        self.fused.as_ref()
    }

    /// Rotates `x` `[1, heads, t, head_dim]` (contiguous) for positions `pos..pos + t`.
    pub fn apply(&self, x: &Tensor, pos: usize) -> Result<Tensor> {
        let t = x.dim(2)?;
        let cos = self.cos.narrow(0, pos, t)?;
        let sin = self.sin.narrow(0, pos, t)?;
        candle_nn::rotary_emb::rope(&x.contiguous()?, &cos, &sin)
    }

    /// Rotates `x` `[batch, heads, 1, head_dim]` (one token per sequence), sequence `b` at
    /// position `positions[b]` (U32 `[batch]` on the tables' device): the table rows are
    /// gathered on the device, so a captured CUDA graph rotates for the positions written
    /// before each replay. Same kernel and values as [`apply`](Self::apply) at batch 1.
    /// A position past the tables is the caller's to prevent (the decode driver checks it
    /// against the KV cache's capacity, which the tables cover).
    pub fn apply_at(&self, x: &Tensor, positions: &Tensor) -> Result<Tensor> {
        let (b, _, t, d) = x.dims4()?;
        if t != 1 || positions.dims() != [b] || positions.dtype() != DType::U32 {
            candle_core::bail!(
                "Rope::apply_at: x {:?} must be [batch, heads, 1, head_dim] and positions U32 [batch], got {:?} {:?}",
                x.dims(),
                positions.dtype(),
                positions.dims()
            )
        }
        let cos = self
            .cos
            .index_select(positions, 0)?
            .reshape((b, 1, d / 2))?;
        let sin = self
            .sin
            .index_select(positions, 0)?
            .reshape((b, 1, d / 2))?;
        candle_nn::rotary_emb::rope(&x.contiguous()?, &cos, &sin)
    }
}
