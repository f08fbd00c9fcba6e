//! [`Parts`]: a model's modules before its KV caches are made (from a checkpoint or
//! random, see `random.rs`).

use super::block::Block;
use crate::config::LlamaConfig;
use candle_core::Tensor;
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
