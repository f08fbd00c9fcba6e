//! [`LoadOptions`]: how a model is loaded (KV cache, context, batch, CUDA graph).

use candle_core::{DType, Device};
use candle_fp4::knobs::Knobs;
use candle_fp4::kv_cache::KvCacheKind;

/// How to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// KV-cache storage.
    pub kv_cache: KvCacheKind,
    /// Tokens the KV cache holds (prompt + generated); default
    /// `min(max_position_embeddings, 4096)`.
    pub max_seq_len: Option<usize>,
    /// Activation dtype; default F32 on CPU (candle's CPU BF16 ops are slower and
    /// QuantLinear takes BF16 input either way), BF16 elsewhere.
    pub dtype: Option<DType>,
    /// Longest run of tokens pushed through the layers at once; longer inputs are split.
    /// Default 32, the GEMV's largest M. A chunk of more than 32 tokens runs the
    /// projections as dequantize + matmul: on the CPU that is ~1.5× faster over a
    /// 512-token prompt but slower for short ones (every weight is dequantized once per
    /// chunk). With the UltraQuant cache a chunk attends over its own K/V exactly (see
    /// `kv_cache`), so this also sets how much of a prompt sees unquantized K/V.
    pub prefill_chunk: usize,
    /// UltraQuant cache only: the most recent tokens kept exact in BF16 besides their FP4
    /// slots (`candle_fp4::kv_cache`'s exact window; 0 = every token read from FP4).
    /// Default [`DEFAULT_KV_WINDOW`].
    pub kv_window: usize,
    /// Accept a `max_seq_len` beyond the model's `max_position_embeddings` (positions the
    /// model was not trained for); default `false`: such a request is a
    /// [`ConfigError::ContextTooLong`](crate::errors::ConfigError::ContextTooLong).
    pub allow_long_context: bool,
    /// Sequences the KV cache holds (batched decode: [`Llama::decode_greedy`](super::Llama::decode_greedy)); default 1.
    pub batch: usize,
    /// On CUDA, run [`Llama::decode_greedy`](super::Llama::decode_greedy) /
    /// [`Llama::decode_logits`](super::Llama::decode_logits) as a captured CUDA
    /// graph (recorded at the second step, replayed from then on); default `true`. `false`
    /// runs the same step eagerly, kernel by kernel.
    pub cuda_graph: bool,
    /// The launch knobs of the benchmarks (hidden; the default is the measured choice): the
    /// GEMVs' (`knobs.gemv`: PDL, on by default, and the kernel A/B switch,
    /// applied to every layer by `QuantLinear::set_gemv_knobs`; a model's layers take their
    /// tiles and splits from the device's table, not from `knobs.gemv`) and the decode
    /// attention's launch knobs (`knobs.attention`).
    #[doc(hidden)]
    pub knobs: Knobs,
}

/// Default exact window of the UltraQuant cache: 64 tokens (docs/accuracy.md: SmolLM2's
/// perplexity cost of the FP4 cache in pure decode drops from +20.8 % to the numbers
/// there; 64 · kv_heads · head_dim · 4 bytes per layer, 96 KiB per layer for SmolLM2).
pub const DEFAULT_KV_WINDOW: usize = 64;

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            kv_cache: KvCacheKind::Bf16,
            max_seq_len: None,
            dtype: None,
            prefill_chunk: 32,
            kv_window: DEFAULT_KV_WINDOW,
            allow_long_context: false,
            batch: 1,
            cuda_graph: true,
            knobs: Knobs::default(),
        }
    }
}

impl LoadOptions {
    /// The activation dtype on `device`: [`dtype`](Self::dtype), or F32 on the CPU and BF16
    /// elsewhere.
    pub fn activation_dtype(&self, device: &Device) -> DType {
        self.dtype.unwrap_or(if device.is_cpu() {
            DType::F32
        } else {
            DType::BF16
        })
    }
}
