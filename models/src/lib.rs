//! Model ports on candle-fp4.
//!
//! * [`llama`]: Llama (2, 3, 3.1 rope scaling; SmolLM2) on `QuantLinear`, NVFP4 or BF16
//!   per module as the checkpoint says, with a preallocated [`kv_cache`].
//! * [`quantize`]: HF safetensors (BF16/F16/F32) or a GGUF → a ModelOpt-compatible NVFP4
//!   checkpoint, bit-identical to ModelOpt's export for the same BF16 weights.
//! * [`gptq`]: GPTQ for NVFP4, an optional quantization method of the quantizer
//!   (calibrated on text; same ModelOpt checkpoint format).
//! * [`gguf`]: reading a llama.cpp GGUF as a Hugging Face Llama (weights un-permuted,
//!   config.json, tokenizer.json built from the GGUF metadata).
//! * [`norm_tweak`]: norm tweaking after GPTQ (the RMSNorm weights tuned so that each
//!   quantized block reproduces the unquantized block's output).
//! * [`tokenizer`], [`sampling`], [`smollm2`]: what the decode binary needs.

pub mod awq;
mod calib;
pub mod cli;
pub mod config;
pub mod errors;
pub mod gguf;
pub mod gguf_check;
pub mod gptq;
pub mod kv_cache;
pub mod llama;
pub mod norm_tweak;
pub mod quantize;
pub mod rope;
pub mod sampling;
pub mod smollm2;
pub mod staging;
pub mod tokenizer;
mod tokenizer_json;
pub mod validate;

pub use config::{LlamaConfig, RopeScaling};
pub use kv_cache::{KvCacheKind, LayerCache};
pub use llama::{Llama, LoadOptions, DEFAULT_KV_WINDOW};

/// Rows of hidden states sent through `lm_head` at once by `Llama::forward_all`.
pub const MAX_LOGIT_ROWS: usize = 32;
