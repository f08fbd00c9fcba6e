//! Writing the checkpoint as ModelOpt does: the safetensors file (same serializer and
//! metadata as Python's `safetensors`), the NVFP4 tensors of a Linear in ModelOpt's names
//! and dtypes, the quant-config json, and the tokenizer files copied along.

use anyhow::{Context, Result};
use candle_core::DType;
use candle_fp4::nvfp4::{Nvfp4Quantized, BLOCK_SIZE};
use safetensors::tensor::{Dtype as StDtype, View};
use serde_json::{json, Value as Json};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

/// Tokenizer / generation files copied from a Hugging Face folder when present.
pub const TOKENIZER_FILES: [&str; 8] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
];

/// An owned tensor for the safetensors writer.
#[derive(Debug, Clone)]
pub struct OwnedTensor {
    /// The stored dtype.
    pub dtype: StDtype,
    /// The shape.
    pub shape: Vec<usize>,
    /// The little-endian bytes, row-major.
    pub data: Vec<u8>,
}

impl View for &OwnedTensor {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// The safetensors dtype of a candle dtype (every dtype a checkpoint can hold maps back).
pub(super) fn st_dtype(dt: DType) -> Result<StDtype> {
    Ok(StDtype::from(dt))
}

/// Serializes `tensors` as Python's `safetensors.torch.save_file(..., metadata={"format": "pt"})` does.
pub fn write_safetensors(tensors: &[(String, OwnedTensor)], path: &Path) -> Result<()> {
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::serialize_to_file(
        tensors.iter().map(|(n, t)| (n.as_str(), t)),
        Some(meta),
        path,
    )
    .with_context(|| format!("cannot write {}", path.display()))
}

/// The NVFP4 tensors of one Linear `prefix`, in ModelOpt's names and dtypes.
pub fn nvfp4_tensors(prefix: &str, q: &Nvfp4Quantized) -> Vec<(String, OwnedTensor)> {
    vec![
        (
            format!("{prefix}.weight"),
            OwnedTensor {
                dtype: StDtype::U8,
                shape: vec![q.n, q.k / 2],
                data: q.weight.clone(),
            },
        ),
        (
            format!("{prefix}.weight_scale"),
            OwnedTensor {
                dtype: StDtype::F8_E4M3,
                shape: vec![q.n, q.k / BLOCK_SIZE],
                data: q.weight_scale.clone(),
            },
        ),
        (
            format!("{prefix}.weight_scale_2"),
            OwnedTensor {
                dtype: StDtype::F32,
                shape: vec![],
                data: q.global_scale.to_le_bytes().to_vec(),
            },
        ),
    ]
}

/// ModelOpt's `quantization_config` block (W4A16 form) for `config.json`.
pub fn quantization_config_block(exclude: &[String]) -> Json {
    json!({
        "config_groups": {"group_0": {
            "weights": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16},
            "targets": ["Linear"]}},
        "ignore": exclude,
        "quant_algo": "W4A16_NVFP4",
        "producer": {"name": "candle-fp4", "version": env!("CARGO_PKG_VERSION")},
        "quant_method": "modelopt",
    })
}

/// `hf_quant_config.json`, as ModelOpt writes it.
pub fn hf_quant_config(exclude: &[String]) -> Json {
    json!({
        "producer": {"name": "candle-fp4", "version": env!("CARGO_PKG_VERSION")},
        "quantization": {
            "quant_algo": "W4A16_NVFP4",
            "kv_cache_quant_algo": null,
            "group_size": 16,
            "exclude_modules": exclude,
        }
    })
}

pub(super) fn write_json(path: &Path, v: &Json) -> Result<()> {
    let text = serde_json::to_string_pretty(v)?;
    std::fs::write(path, text + "\n").with_context(|| format!("cannot write {}", path.display()))
}
