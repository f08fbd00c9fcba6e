//! One decoder layer: RMSNorm → [`Attention`] → residual, RMSNorm → [`Mlp`] → residual.

use super::attention::Attention;
use super::capture::{LinearInputs, Site};
use super::linear::Loader;
use super::mlp::Mlp;
use super::norm::RmsNorm;
use crate::config::LlamaConfig;
use crate::kv_cache::LayerCache;
use crate::rope::Rope;
use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use candle_fp4::quant_linear::QuantLinear;
use candle_fp4::tensor_parallel::{AllReduce, HeadSplit};
use std::sync::Arc;

/// A decoder layer (`model.layers.{i}`).
#[derive(Debug)]
pub struct Block {
    attn_norm: RmsNorm,
    attn: Attention,
    mlp_norm: RmsNorm,
    mlp: Mlp,
}

impl Block {
    /// Loads layer `i`: its attention and MLP (shapes checked against `cfg`), then its two
    /// RMSNorm weights.
    pub fn load(ld: &Loader<'_>, cfg: &LlamaConfig, i: usize, rope: &Rope) -> Result<Self> {
        let p = format!("model.layers.{i}");
        let a = format!("{p}.self_attn");
        let attn = Attention::load(ld, cfg, &a, rope)?;
        let mlp = Mlp::load(ld, cfg, &format!("{p}.mlp"))?;
        // A bias the config promises must be there (never silently run without).
        let missing = |t: String| candle_fp4::error::CheckpointError::MissingTensor {
            file: ld.ckpt.origin().to_string(),
            tensor: t,
        };
        if cfg.attention_bias && !attn.has_qkv_bias() {
            return Err(missing(format!("{a}.q_proj.bias")).into());
        }
        if cfg.mlp_bias && !mlp.has_bias() {
            let m = format!("{p}.mlp");
            return Err(missing(format!(
                "{m}.gate_proj.bias / up_proj.bias / down_proj.bias"
            ))
            .into());
        }
        let h = cfg.hidden_size;
        let attn_norm = ld.vector(&format!("{p}.input_layernorm.weight"), h)?;
        let mlp_norm = ld.vector(&format!("{p}.post_attention_layernorm.weight"), h)?;
        let eps = cfg.rms_norm_eps as f32;
        Self::from_parts(attn_norm, attn, mlp_norm, mlp, eps)
    }

    /// A layer from its parts (norm weights `[hidden]` in the activation dtype).
    pub fn from_parts(
        attn_norm: Tensor,
        attn: Attention,
        mlp_norm: Tensor,
        mlp: Mlp,
        eps: f32,
    ) -> Result<Self> {
        Ok(Self {
            attn_norm: RmsNorm::new(attn_norm, eps)?,
            attn,
            mlp_norm: RmsNorm::new(mlp_norm, eps)?,
            mlp,
        })
    }

    /// Rank `split.shard()`'s part of the layer on `device`: attention and MLP sharded
    /// ([`Attention::shard`], [`Mlp::shard`]), the norms replicated.
    pub(super) fn shard(
        &self,
        split: &HeadSplit,
        reduce: Arc<dyn AllReduce>,
        rope: &Rope,
        device: &Device,
    ) -> Result<Self> {
        let norm = |n: &RmsNorm| -> Result<RmsNorm> {
            RmsNorm::new(n.weight().to_device(device)?, n.eps())
        };
        Ok(Self {
            attn_norm: norm(&self.attn_norm)?,
            attn: self.attn.shard(split, reduce.clone(), rope, device)?,
            mlp_norm: norm(&self.mlp_norm)?,
            mlp: self.mlp.shard(split.shard(), reduce, device)?,
        })
    }

    /// Sums the o_proj and down_proj outputs over the ranks with `reduce` (the layer's
    /// weights already being a rank's shard).
    pub(super) fn set_reduce(&mut self, reduce: Arc<dyn AllReduce>) {
        self.attn.set_reduce(reduce.clone());
        self.mlp.set_reduce(reduce);
    }

    /// The layer over `x` `[t, hidden]` at positions `pos..pos + t` (`mask`: the causal
    /// mask of a chunk, `None` for one token), storing the chunk's K/V in `cache`.
    pub fn forward(
        &self,
        x: &Tensor,
        pos: usize,
        mask: Option<&Tensor>,
        cache: &mut LayerCache,
    ) -> candle_core::Result<Tensor> {
        self.forward_captured(x, pos, mask, cache, &mut super::capture::ignore_inputs)
    }

    /// [`forward`](Self::forward), reporting the input of each Linear group to `hook`.
    pub fn forward_captured(
        &self,
        x: &Tensor,
        pos: usize,
        mask: Option<&Tensor>,
        cache: &mut LayerCache,
        hook: &mut LinearInputs<'_>,
    ) -> candle_core::Result<Tensor> {
        let h = self.attn_norm.forward(x)?;
        let a = self.attn.forward_captured(&h, pos, mask, cache, hook)?;
        let (x, h) = self.mlp_norm.add_forward(x, Some(&a))?;
        x + self.mlp.forward_captured(&h, hook)?
    }

    /// The layer's output over `x` from what its forward gives o_proj (`o_in`, the
    /// attention heads' output) and down_proj (`down_in`, `silu(gate)·up`): the same
    /// operations as the rest of [`forward_captured`](Self::forward_captured) after those
    /// points, so the same bits, without recomputing the attention and gate|up (the
    /// quantizer's calibration, which has both inputs already).
    pub fn output_from_captured(
        &self,
        x: &Tensor,
        o_in: &Tensor,
        down_in: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let a = self.attn.o_out(o_in)?;
        let (x, _) = self.mlp_norm.add_forward(x, Some(&a))?;
        x + self.mlp.down_out(down_in)?
    }

    /// One decode token of every sequence (see [`Attention::forward_decode`]): capturable
    /// in a CUDA graph. The residual stream arrives as `x + delta` (`x` `[batch, hidden]`,
    /// `delta` the previous layer's MLP output, `None` at the first layer) and leaves the
    /// same way, `(x', mlp output)`, so each residual add runs inside the next norm's kernel
    /// ([`AddRmsNorm`](candle_fp4::norm::AddRmsNorm)), or inside the q|k|v and gate|up GEMVs' kernels where they take it
    /// ([`QuantLinear::forward_add_norm`]); the result equals
    /// [`forward`](Self::forward)'s `x' + mlp output`.
    pub fn forward_decode(
        &self,
        x: &Tensor,
        delta: Option<&Tensor>,
        positions: &Tensor,
        cache: &mut LayerCache,
        for_graph: bool,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (x, a) = self.attn.forward_decode_add_norm(
            x,
            delta,
            &self.attn_norm,
            positions,
            cache,
            for_graph,
        )?;
        self.mlp.forward_add_norm(&x, Some(&a), &self.mlp_norm)
    }

    /// Every Linear of the layer: q/k/v (fused or not), o, gate/up, down.
    pub fn linears(&self) -> Vec<&QuantLinear> {
        Site::ALL
            .iter()
            .flat_map(|s| self.site_linears(*s))
            .collect()
    }

    /// Every Linear of the layer, mutably (attention's, then the MLP's).
    pub fn linears_mut(&mut self) -> Vec<&mut QuantLinear> {
        let mut v = self.attn.linears_mut();
        v.extend(self.mlp.linears_mut());
        v
    }

    /// The Linears of `site` (q, k, v or gate, up in that order when not fused).
    pub fn site_linears(&self, site: Site) -> Vec<&QuantLinear> {
        match site {
            Site::Qkv | Site::O => self.attn.linears(site),
            Site::GateUp | Site::Down => self.mlp.linears(site),
        }
    }

    /// Replaces the Linears of `site` by `layers` (q, k, v or gate, up in that order for
    /// the fused sites), which must have the old shapes; the old biases are kept.
    pub fn set_linears(&mut self, site: Site, layers: Vec<QuantLinear>) -> Result<()> {
        match site {
            Site::Qkv | Site::O => self.attn.set_linears(site, layers),
            Site::GateUp | Site::Down => self.mlp.set_linears(site, layers),
        }
    }

    /// The RMSNorm weight in front of `site` (q/k/v: the attention norm; gate/up: the MLP
    /// norm), in the activation dtype.
    pub fn norm(&self, site: Site) -> Result<&Tensor> {
        match site {
            Site::Qkv => Ok(self.attn_norm.weight()),
            Site::GateUp => Ok(self.mlp_norm.weight()),
            Site::O | Site::Down => bail!("{site:?} has no norm in front"),
        }
    }

    /// Sets the RMSNorm weight in front of `site` ([`norm`](Self::norm)) to `values`
    /// (converted to the norm's dtype).
    pub fn set_norm(&mut self, site: Site, values: &[f32]) -> Result<()> {
        let norm = match site {
            Site::Qkv => &mut self.attn_norm,
            Site::GateUp => &mut self.mlp_norm,
            Site::O | Site::Down => bail!("{site:?} has no norm in front"),
        };
        let w = norm.weight();
        if values.len() != w.elem_count() {
            bail!("{} values for a norm of {}", values.len(), w.elem_count());
        }
        let w = Tensor::from_slice(values, values.len(), w.device())?.to_dtype(w.dtype())?;
        *norm = RmsNorm::new(w, norm.eps())?;
        Ok(())
    }
}
