//! [`Parts`]: a model's modules before its KV caches are made (from a checkpoint here, or
//! random, see `random.rs`).

use super::block::Block;
use super::linear::{self, Loader};
use super::lm_head::LmHead;
use super::options::LoadOptions;
use crate::config::LlamaConfig;
use crate::rope::Rope;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_fp4::checkpoint::Checkpoint;
use candle_fp4::quant_config::QuantConfig;
use candle_fp4::quant_linear::QuantLinear;
use candle_fp4::tensor_parallel::{AllReduce, HeadSplit, Shard};
use std::path::Path;
use std::sync::Arc;

/// The modules of a model, before its KV caches are made ([`Llama::assemble`]).
pub(crate) struct Parts {
    pub cfg: LlamaConfig,
    pub quant: QuantConfig,
    pub embed: Tensor,
    pub blocks: Vec<Block>,
    pub norm: Tensor,
    pub lm_head: LmHead,
}

impl Parts {
    /// The modules of the folder `dir` on `device` (activations `dtype`) and the context
    /// (KV-cache length) `opts` asks for, checked against the config.
    pub(crate) fn read(
        dir: &Path,
        device: &Device,
        dtype: DType,
        opts: &LoadOptions,
    ) -> Result<(Parts, usize)> {
        if !dir.is_dir() {
            bail!(
                "{}: not a model folder (it does not exist or is not a directory)",
                dir.display()
            );
        }
        let cfg = LlamaConfig::from_dir(dir)?;
        let quant = QuantConfig::from_dir(dir)?;
        // SAFETY: the checkpoint files are memory-mapped read-only; like every mmap-based
        // loader we rely on nobody rewriting them while the model is being loaded (the
        // tensors are copied into device memory before `ckpt` is dropped).
        let ckpt = unsafe { Checkpoint::open(dir) }
            .with_context(|| format!("{}: cannot open the weights", dir.display()))?;
        let max_seq_len = crate::validate::check_load(
            &cfg,
            dir,
            &ckpt,
            opts.max_seq_len,
            opts.allow_long_context,
        )?;
        let ld = Loader {
            ckpt: &ckpt,
            quant: &quant,
            dtype,
            device,
        };
        // The RoPE tables (cannot fail on a valid config) are shared by every layer.
        let rope = Rope::new(&cfg, max_seq_len, dtype, device)?;
        let parts = Parts::load(&ld, cfg, quant.clone(), &rope)?;
        Ok((parts, max_seq_len))
    }

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
        let lm_head = LmHead::whole(if cfg.tie_word_embeddings {
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
        });
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

impl Parts {
    /// The config of rank `shard`'s part of a model of `cfg` (its share of the heads, KV
    /// heads and intermediate size) and the split of its attention.
    pub(crate) fn rank_config(cfg: &LlamaConfig, shard: Shard) -> Result<(LlamaConfig, HeadSplit)> {
        let split = HeadSplit::new(
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            shard,
        )?;
        let mut c = cfg.clone();
        c.num_attention_heads = split.heads();
        c.num_key_value_heads = split.kv_heads();
        c.intermediate_size = shard.per_rank("intermediate_size", cfg.intermediate_size)?;
        Ok((c, split))
    }

    /// Rank `reduce.shard()`'s part of the model on `device` (tensor parallel, Megatron):
    /// each layer's q|k|v and gate|up column-parallel, o_proj and down_proj row-parallel
    /// with their outputs summed over the ranks by `reduce`; `lm_head` vocabulary-parallel
    /// where the vocabulary divides by the ranks ([`LmHead::shard`]), else replicated;
    /// embeddings and norms replicated. The rank's config has its share of the heads, KV heads and
    /// intermediate size (what its KV caches, RoPE kernel and plans are made for), RoPE
    /// tables for `max_seq_len` positions in `dtype`.
    pub(crate) fn shard(
        &self,
        reduce: Arc<dyn AllReduce>,
        max_seq_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let c = &self.cfg;
        let (cfg, split) = Self::rank_config(c, reduce.shard())?;
        let rope = Rope::new(&cfg, max_seq_len, dtype, device)?;
        let blocks = self
            .blocks
            .iter()
            .map(|b| b.shard(&split, reduce.clone(), &rope, device))
            .collect::<Result<Vec<_>>>()?;
        let embed = self.embed.to_device(device)?;
        // Tied: the head comes from the rank's copy of the embeddings (a whole head shares
        // its storage).
        let tied = c.tie_word_embeddings.then_some(&embed);
        let lm_head = LmHead::shard(self.lm_head.linear(), tied, reduce, device)?;
        Ok(Self {
            cfg,
            quant: self.quant.clone(),
            embed,
            blocks,
            norm: self.norm.to_device(device)?,
            lm_head,
        })
    }
}
