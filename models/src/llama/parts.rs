//! [`Parts`]: a model's modules before its KV caches are made (from a checkpoint here, or
//! random, see `random.rs`).

use super::block::Block;
use super::linear::{self, Loader};
use crate::config::LlamaConfig;
use crate::rope::Rope;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use candle_fp4::quant_config::QuantConfig;
use candle_fp4::quant_linear::QuantLinear;

/// The modules of a model, before its KV caches are made ([`Llama::assemble`]).
pub(crate) struct Parts {
    pub cfg: LlamaConfig,
    pub quant: QuantConfig,
    pub embed: Tensor,
    pub blocks: Vec<Block>,
    pub norm: Tensor,
    pub lm_head: QuantLinear,
}

impl Parts {
    /// Every module of `cfg` from the checkpoint behind `ld` (embeddings, blocks, final
    /// norm, `lm_head`), each checked against `cfg`; `rope` shared by every layer.
    pub(crate) fn load(
        ld: &Loader<'_>,
        cfg: LlamaConfig,
        quant: QuantConfig,
        rope: &Rope,
    ) -> Result<Self> {
        let h = cfg.hidden_size;
        let ename = "model.embed_tokens.weight";
        let e = ld.ckpt.get(ename)?;
        if !e.dtype.is_float() {
            bail!("{}: `{ename}` is {:?}: quantized embeddings are not supported (ModelOpt keeps them in 16 bits)", ld.ckpt.origin(), e.dtype);
        }
        if e.shape != [cfg.vocab_size, h] {
            return Err(crate::errors::ConfigError::ShapeMismatch {
                origin: ld.ckpt.origin().to_string(),
                tensor: ename.to_string(),
                found: e.shape.clone(),
                expected: vec![cfg.vocab_size, h],
            }
            .into());
        }
        let embed = e.to_tensor(ld.device)?.to_dtype(DType::BF16)?;

        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| Block::load(ld, &cfg, i, rope))
            .collect::<Result<Vec<_>>>()?;
        let norm = ld.vector("model.norm.weight", h)?;
        // Untied: `lm_head.weight` must be there (a missing one is an error naming it,
        // never a silent fallback to the embedding).
        let lm_head = if cfg.tie_word_embeddings {
            QuantLinear::from_bf16(embed.clone(), None)?
        } else {
            let l = ld.linear("lm_head")?;
            linear::check_dims(
                ld.ckpt.origin(),
                "lm_head",
                l.out_features(),
                l.in_features(),
                cfg.vocab_size,
                h,
            )?;
            l
        };
        Ok(Self {
            cfg,
            quant,
            embed,
            blocks,
            norm,
            lm_head,
        })
    }
}
